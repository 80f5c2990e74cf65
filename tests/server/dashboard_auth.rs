//! The dashboard's data with `auth.required = true`: it names tenants and what they do, so it
//! needs a key like `/mcp` — a configured key sees its own tenant's rows (a key without a tenant,
//! its own), the admin key everyone's — while the page still loads and asks for the key. Without
//! `auth.required` it stays public.

use crate::browser::Browser;
use crate::common::*;
use serde_json::{Value, json};

const ADMIN_KEY: &str = "admin-key-for-dashboard-0123456789";
const ACME_KEY: &str = "sk-acme-dashboard-auth-01";
const GLOBEX_KEY: &str = "sk-globex-dashboard-auth-02";
const CAROL_KEY: &str = "sk-carol-dashboard-auth-03";

/// Keys required; acme, globex and carol (no tenant); small caller budgets that do not refill
/// while a test runs; image jobs that outlast it.
fn required() -> String {
    format!(
        "[auth]\nrequired = true\n[admin]\nkey = \"{ADMIN_KEY}\"\n\
         [[auth.keys]]\nkey = \"{ACME_KEY}\"\ntenant = \"acme\"\n\
         [[auth.keys]]\nkey = \"{GLOBEX_KEY}\"\ntenant = \"globex\"\n\
         [[auth.keys]]\nkey = \"{CAROL_KEY}\"\n\
         [limits.caller]\nburst = 10\nrefill_per_sec = 0.001\n[tools.generate_image_to_video]\ncost = 5\n\
         [mock_upstream]\nimage_job_ms = 600000\n{NO_LOOP_DETECTION}"
    )
}

/// `GET path` with `authorization` (a whole header value) if given: status, headers, body.
async fn get(
    server: &TestServer,
    path: &str,
    authorization: Option<&str>,
) -> (u16, reqwest::header::HeaderMap, String) {
    let mut request = reqwest::Client::new().get(format!("http://{}{path}", server.addr));
    if let Some(value) = authorization {
        request = request.header("authorization", value);
    }
    let response = request.send().await.expect("answered");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    (status, headers, response.text().await.expect("body"))
}

async fn data_as(server: &TestServer, key: &str) -> Value {
    let (status, _, body) = get(server, "/dashboard/data", Some(&format!("Bearer {key}"))).await;
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).expect("data is JSON")
}

#[tokio::test]
async fn with_keys_required_the_data_needs_a_configured_key_or_the_admin_key() {
    let server = TestServer::start(&required()).await;
    for authorization in [None, Some("Bearer sk-made-up-key"), Some("Bearer "), Some(&*format!("Basic {ACME_KEY}"))] {
        let (status, headers, body) = get(&server, "/dashboard/data", authorization).await;
        assert_eq!(status, 401, "{authorization:?}: {body}");
        assert_eq!(headers.get("www-authenticate").map(|v| v.as_bytes()), Some(&b"Bearer"[..]));
        assert_eq!(headers.get("cache-control").map(|v| v.as_bytes()), Some(&b"no-store"[..]));
        let body: Value = serde_json::from_str(&body).expect("a JSON error");
        assert_eq!(body["error"]["code"], "unauthorized");
        assert!(!body.to_string().contains("acme"), "a refusal names no tenant: {body}");
    }
    assert_eq!(data_as(&server, ACME_KEY).await["showing"], "tenant acme");
    assert_eq!(data_as(&server, ADMIN_KEY).await["showing"], "everyone (admin key)");
    let carol = data_as(&server, CAROL_KEY).await;
    assert!(carol["showing"].as_str().is_some_and(|s| s.starts_with("caller #")), "{carol}");
    // The page and its script still load without a key: it is what asks for one.
    for path in ["/dashboard", "/dashboard/dashboard.js", "/dashboard/dashboard.css"] {
        assert_eq!(get(&server, path, None).await.0, 200, "{path}");
    }
}

#[tokio::test]
async fn a_configured_key_sees_its_tenants_rows_and_the_admin_key_everyones() {
    let server = TestServer::start(&required()).await;
    let acme = server.client(Some(ACME_KEY)).await;
    let globex = server.client(Some(GLOBEX_KEY)).await;
    let carol = server.client(Some(CAROL_KEY)).await;
    // globex starts a job that outlasts the test, then runs out of budget.
    let job = call(&globex, "generate_image", json!({"prompt": "a lighthouse"})).await;
    assert!(!is_error(&job), "{}", text(&job));
    spend_until_refused(&globex, "save_article", json!({"title": "t", "body": "b"}), 20).await;
    spend_until_refused(&acme, "list_articles", json!({}), 20).await;
    spend_until_refused(&carol, "list_articles", json!({}), 20).await;

    let everyone = data_as(&server, ADMIN_KEY).await;
    let tenants = |data: &Value| -> Vec<Value> {
        data["latest"].as_array().expect("latest").iter().map(|r| r["tenant"].clone()).collect()
    };
    let all = tenants(&everyone);
    for tenant in [json!("acme"), json!("globex"), Value::Null] {
        assert!(all.contains(&tenant), "the admin key sees {tenant}'s refusals: {everyone}");
    }

    let own = data_as(&server, ACME_KEY).await;
    let rows = tenants(&own);
    assert!(!rows.is_empty() && rows.iter().all(|t| t == "acme"), "only acme's refusals: {own}");
    let scopes: Vec<&str> =
        own["scopes"].as_array().expect("scopes").iter().filter_map(|s| s["scope"].as_str()).collect();
    assert!(scopes.contains(&"tenant:acme"), "its tenant's budget: {scopes:?}");
    assert!(own.to_string().matches("globex").count() == 0, "nothing of another tenant: {own}");
    // The counts per tool and the totals name nobody, and are everyone's.
    for field in ["refused_total", "refused_in_window", "admitted_total", "tools"] {
        assert_eq!(own[field], everyone[field], "{field}");
    }
    assert_eq!(own["jobs"]["in_flight"], everyone["jobs"]["in_flight"]);
    assert!(own["jobs"]["per_owner"].as_array().is_some_and(|o| o.is_empty()), "no job of acme's: {own}");
    let globex_view = data_as(&server, GLOBEX_KEY).await;
    let owners = globex_view["jobs"]["per_owner"].as_array().cloned().unwrap_or_default();
    assert_eq!(owners.len(), 1, "{globex_view}");
    assert_eq!(owners[0]["owner"], "tenant globex");

    // A key without a tenant sees its own rows: no tenant's, and one caller's.
    let alone = data_as(&server, CAROL_KEY).await;
    let rows = alone["latest"].as_array().expect("latest");
    assert!(!rows.is_empty() && rows.iter().all(|r| r["tenant"].is_null()), "{alone}");
    let callers: std::collections::BTreeSet<&str> = rows.iter().filter_map(|r| r["caller"].as_str()).collect();
    assert_eq!(callers.len(), 1, "{alone}");
    assert!(alone["showing"].as_str().is_some_and(|s| callers.iter().any(|c| s.ends_with(c))), "{alone}");
    assert!(!alone.to_string().contains("acme") && !alone.to_string().contains("globex"), "{alone}");
}

#[tokio::test]
async fn without_auth_required_the_data_stays_public() {
    let server = TestServer::start(&format!("[[auth.keys]]\nkey = \"{ACME_KEY}\"\ntenant = \"acme\"\n")).await;
    let client = server.client(Some(ACME_KEY)).await;
    call(&client, "list_articles", json!({})).await;
    for authorization in [None, Some("Bearer sk-made-up-key")] {
        let (status, _, body) = get(&server, "/dashboard/data", authorization).await;
        assert_eq!(status, 200, "{body}");
        let data: Value = serde_json::from_str(&body).expect("JSON");
        assert_eq!(data["showing"], "everyone");
    }
}

#[tokio::test]
async fn the_page_asks_for_a_key_and_shows_the_data_with_it() {
    let server = TestServer::start(&required()).await;
    let acme = server.client(Some(ACME_KEY)).await;
    spend_until_refused(&acme, "list_articles", json!({}), 20).await;
    let mut browser = Browser::launch().await;
    browser.open(&format!("http://{}/dashboard", server.addr)).await;
    let asking = "!document.getElementById('key-panel').hidden \
                  && document.getElementById('key-message').textContent.includes('needs a key')";
    browser.wait_for("the request for a key", asking).await;

    let give = |key: &str| {
        format!(
            "(() => {{ document.getElementById('key-input').value = '{key}'; \
             document.getElementById('key-form').requestSubmit(); return true; }})()"
        )
    };
    browser.eval(&give("sk-made-up-key")).await;
    browser
        .wait_for(
            "a refused key, forgotten",
            "document.getElementById('key-message').textContent.includes('not accepted') \
             && sessionStorage.length === 0",
        )
        .await;

    browser.eval(&give(ACME_KEY)).await;
    browser
        .wait_for(
            "acme's data",
            "document.getElementById('key-panel').hidden \
             && document.getElementById('status').textContent.includes('showing tenant acme') \
             && document.querySelectorAll('#refusals tbody tr').length === 1",
        )
        .await;
    let kept = browser.eval("Object.values(sessionStorage)").await;
    assert_eq!(kept, json!([ACME_KEY]), "the key is kept in this tab only");
    let text = browser.eval("document.body.innerText").await;
    assert!(text.as_str().is_some_and(|t| t.contains("tenant acme") && !t.contains(ACME_KEY)), "{text}");
}

/// Two keys without a tenant whose ids the dashboard shows alike (`#` and 24 bits of a keyed
/// hash), found by trying generated keys against this server's own hash.
fn keys_shown_alike(server: &TestServer) -> (String, String) {
    let activity = server.app.state().limits.guard().activity();
    let mut shown: std::collections::HashMap<String, String> = std::collections::HashMap::new();
    for i in 0..1_000_000u32 {
        let key = format!("sk-shown-alike-{i:07}");
        let hashed = activity.hashed(mcp_ratelimit::identity::Caller::from_token(&key).id());
        if let Some(first) = shown.insert(hashed, key.clone()) {
            return (first, key);
        }
    }
    panic!("no two of a million ids share 24 bits");
}

#[tokio::test]
async fn a_key_without_a_tenant_never_sees_the_rows_of_another_shown_by_the_same_hash() {
    let server = TestServer::start(&required()).await;
    let (first, second) = keys_shown_alike(&server);
    let both = format!("{}[[auth.keys]]\nkey = \"{first}\"\n[[auth.keys]]\nkey = \"{second}\"\n", required());
    let both = mcp_ratelimit::Config::from_toml(&both, &mcp_ratelimit::mcp::tools::catalogue()).expect("valid");
    server.app.state().reload(&both);
    let agent = server.client(Some(&first)).await;
    spend_until_refused(&agent, "list_articles", json!({}), 20).await;

    let own = data_as(&server, &first).await;
    assert!(!own["latest"].as_array().expect("latest").is_empty(), "its own refusal: {own}");
    let other = data_as(&server, &second).await;
    assert_eq!(other["showing"], own["showing"], "both shown as one hash: {other}");
    assert_eq!(other["latest"], json!([]), "nothing of the other caller's: {other}");
    assert_eq!(other["scopes"], json!([]), "no budget of the other caller's: {other}");
}
