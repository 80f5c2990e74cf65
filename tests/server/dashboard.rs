//! The live dashboard (`GET /dashboard`), as a person sees it in a real browser and as a program
//! reads its data: refusals made over MCP show up on the page (which tool, why, for whom), so do
//! the account's learnt limit under its ceiling and the upstream requests saved, the page and its
//! data carry no credential, answer only to this server's own Host and Origin, and are never rate
//! limited.

use std::path::PathBuf;

use crate::browser::Browser;
use crate::common::*;
use mcp_ratelimit::identity::Caller;
use rmcp::model::CallToolResult;
use serde_json::{Value, json};

const ACME_KEY: &str = "sk-acme-dashboard-7f3a91c2";
const GLOBEX_KEY: &str = "sk-globex-dashboard-51be07";

/// Two configured keys, each with a tenant.
fn keys() -> String {
    format!(
        "[[auth.keys]]\nkey = \"{ACME_KEY}\"\ntenant = \"acme\"\n[[auth.keys]]\nkey = \"{GLOBEX_KEY}\"\ntenant = \"globex\"\n"
    )
}

fn dashboard_url(server: &TestServer, path: &str) -> String {
    format!("http://{}{path}", server.addr)
}

async fn data(server: &TestServer) -> Value {
    let response = reqwest::get(dashboard_url(server, "/dashboard/data")).await.expect("data answered");
    assert_eq!(response.status(), 200);
    response.json().await.expect("data is JSON")
}

/// Calls `list_articles` with a fresh query each time (no loop) until it is refused.
async fn list_until_refused(client: &Client, round: usize) -> CallToolResult {
    for i in 0..200 {
        let r = call(client, "list_articles", json!({"query": format!("round {round} query {i}")})).await;
        if is_error(&r) {
            return r;
        }
    }
    panic!("list_articles was never refused");
}

/// An expression true once the page's refusal counter reads `n` and its newest refused call is
/// `tool` refused with `code`.
fn shows(n: usize, tool: &str, code: &str) -> String {
    format!(
        "(() => {{
            const row = document.querySelector('#refusals tbody tr');
            return document.getElementById('refused-window').textContent === '{n}'
                && row !== null
                && row.querySelector('td.tool').textContent.startsWith('{tool}')
                && row.querySelector('.code').textContent === '{code}';
        }})()"
    )
}

/// Who and why, readable without JSON: the newest refusal's row shows the tenant and hashed
/// caller, the budget and the message; the tools are listed most refused first; no key or caller
/// id is anywhere on the page.
async fn assert_who_and_why_are_readable_and_no_key_shows(browser: &mut Browser) {
    let acme_id = Caller::from_token(ACME_KEY).id().to_owned();
    let row = browser
        .eval(
            "(() => { const row = document.querySelector('#refusals tbody tr'); \
             return { who: row.querySelector('td.who').innerText, scope: row.querySelector('td.scope').textContent, \
                      why: row.querySelector('td.why').textContent }; })()",
        )
        .await;
    let who = row["who"].as_str().expect("who");
    let bucket = format!("b{:02}", Caller::from_token(ACME_KEY).bucket());
    assert!(
        who.starts_with("tenant acme\ncaller #") && who.ends_with(&format!(" {bucket}")),
        "hashed caller, bucket: {row}"
    );
    assert!(row["scope"].as_str().is_some_and(|s| s.starts_with("caller:#")), "the caller's budget refused: {row}");
    let why = row["why"].as_str().expect("why");
    assert!(
        why.contains("Rate limit reached for list_articles.") && why.contains("limit 60") && why.contains("0 left"),
        "{row}"
    );
    let tools = browser.eval("[...document.querySelectorAll('#per-tool .tool-row')].map(r => r.dataset.tool)").await;
    assert_eq!(tools, json!(["list_articles", "save_article"]), "per tool, most refused first");
    let page_text = browser.eval("document.body.innerText").await;
    let page_text = page_text.as_str().expect("text");
    for secret in [ACME_KEY, GLOBEX_KEY, acme_id.as_str(), &acme_id[4..]] {
        assert!(!page_text.contains(secret), "{secret} on the page");
    }
}

#[tokio::test]
async fn a_browser_sees_which_tool_is_refused_for_whom_and_why() {
    // Loops by calls stay on (the stuck agent below); the greedy one's searches all find nothing.
    let server = TestServer::start(&format!("{}{NO_PROGRESS_CHECK}", keys())).await;
    let mut browser = Browser::launch().await;
    browser.open(&dashboard_url(&server, "/dashboard")).await;
    browser
        .wait_for(
            "its first answer: nothing refused",
            "document.getElementById('refused-window').textContent === '0' \
             && document.querySelectorAll('#refusals tbody tr').length === 0",
        )
        .await;

    // A stuck agent: the same save_article five times; the fifth is a loop.
    let globex = server.client(Some(GLOBEX_KEY)).await;
    for _ in 0..4 {
        assert!(!is_error(&call(&globex, "save_article", json!({"title": "Draft", "body": "same"})).await));
    }
    let looping = call(&globex, "save_article", json!({"title": "Draft", "body": "same"})).await;
    assert_eq!(error_code(&looping), Some("loop_detected"), "{}", text(&looping));
    browser.wait_for("the loop on save_article", &shows(1, "save_article", "loop_detected")).await;

    // A greedy agent: list_articles until its caller budget is empty.
    server.advance_secs(40.0);
    let acme = server.client(Some(ACME_KEY)).await;
    let refused = list_until_refused(&acme, 0).await;
    assert_eq!(error_code(&refused), Some("rate_limited"), "{}", text(&refused));
    browser.wait_for("list_articles refused", &shows(2, "list_articles", "rate_limited")).await;

    assert_who_and_why_are_readable_and_no_key_shows(&mut browser).await;

    // More of the same over the next minute (the sparkline's bars), an anonymous agent's loop,
    // and jobs: globex fills its five in-flight slots and the sixth image is busy.
    let mut refusals = 2;
    for round in 1..=3 {
        server.advance_secs(20.0);
        list_until_refused(&acme, round).await;
        refusals += 1;
    }
    let anonymous = server.client(None).await;
    for _ in 0..5 {
        call(&anonymous, "list_articles", json!({"query": "lighthouses"})).await;
    }
    refusals += 1;
    server.advance_secs(5.0);
    for i in 0..5 {
        let accepted =
            call(&globex, "generate_image", json!({"prompt": format!("a lighthouse at dusk, take {i}")})).await;
        assert!(!is_error(&accepted), "{}", text(&accepted));
    }
    let busy = call(&globex, "generate_image", json!({"prompt": "a lighthouse at dusk, take 5"})).await;
    assert_eq!(error_code(&busy), Some("busy"), "{}", text(&busy));
    refusals += 1;
    browser.wait_for("the busy image", &shows(refusals, "generate_image", "busy")).await;
    browser
        .wait_for(
            "globex's five jobs in flight",
            "document.getElementById('jobs-in-flight').textContent === '5' \
             && document.querySelector('#owners tbody td.who').textContent === 'tenant globex'",
        )
        .await;

    let artifact = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dashboard.png");
    browser.screenshot(&artifact).await;
    println!("dashboard screenshot: {}", artifact.display());
    if let Some(copy) = std::env::var_os("DASHBOARD_SCREENSHOT").filter(|p| !p.is_empty()) {
        std::fs::copy(&artifact, &copy).expect("copy the screenshot");
        println!("dashboard screenshot copied to {}", PathBuf::from(copy).display());
    }
    let png = std::fs::read(&artifact).expect("screenshot written");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 10_000, "a real PNG: {} bytes", png.len());
}

#[tokio::test]
async fn the_page_and_its_data_answer_with_their_types_and_a_strict_policy() {
    let server = TestServer::start("").await;
    let http = reqwest::Client::new();
    for (path, content_type) in [
        ("/dashboard", "text/html; charset=utf-8"),
        ("/dashboard/dashboard.js", "text/javascript; charset=utf-8"),
        ("/dashboard/dashboard.css", "text/css; charset=utf-8"),
        ("/dashboard/data", "application/json"),
    ] {
        let response = http.get(dashboard_url(&server, path)).send().await.expect("answered");
        assert_eq!(response.status(), 200, "{path}");
        let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
        assert_eq!(header("content-type"), content_type, "{path}");
        assert_eq!(header("x-content-type-options"), "nosniff", "{path}");
        assert_eq!(header("cache-control"), "no-store", "{path}");
        let policy = header("content-security-policy");
        assert!(
            policy.starts_with("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'"),
            "{policy}"
        );
        let body = response.text().await.expect("body");
        // Nothing from elsewhere: no CDN, no font, no absolute URL (the SVG namespace is a name,
        // not a fetch).
        let external = body.replace("http://www.w3.org/2000/svg", "");
        assert!(
            !external.contains("http://") && !external.contains("https://") && !external.contains("//cdn"),
            "{path}"
        );
    }
    let page = http.get(dashboard_url(&server, "/dashboard")).send().await.expect("page").text().await.expect("text");
    assert!(
        page.contains("<script src=\"/dashboard/dashboard.js\" defer></script>") && !page.contains("<script>"),
        "no inline script"
    );
    let board = data(&server).await;
    assert_eq!(board["refused_total"], 0);
    assert_eq!(
        (board["breaker"]["state"].as_str(), board["store"]["backend"].as_str()),
        (Some("closed"), Some("memory"))
    );
    assert_eq!(board["store"]["up"], true);
}

#[tokio::test]
async fn a_foreign_host_or_origin_is_refused_like_on_mcp() {
    let server = TestServer::start("").await;
    let http = reqwest::Client::new();
    let port = server.addr.port();
    for path in ["/dashboard", "/dashboard/data", "/dashboard/dashboard.js"] {
        let url = dashboard_url(&server, path);
        let foreign_host = http.get(&url).header("host", "evil.example.com").send().await.expect("answered");
        assert_eq!(foreign_host.status(), 403, "{path} with a foreign Host");
        let foreign_origin = http.get(&url).header("origin", "http://evil.example.com").send().await.expect("answered");
        assert_eq!(foreign_origin.status(), 403, "{path} with a foreign Origin");
        let own = http.get(&url).header("origin", format!("http://localhost:{port}")).send().await.expect("answered");
        assert_eq!(own.status(), 200, "{path} from its own origin");
    }
}

#[tokio::test]
async fn the_data_never_holds_a_raw_key_a_caller_id_or_an_address() {
    let unconfigured = "sk-made-up-9d1c44e0";
    let server = TestServer::start(&format!("{}{}", keys(), NO_LOOP_DETECTION)).await;
    let acme = server.client(Some(ACME_KEY)).await;
    let made_up = server.client(Some(unconfigured)).await;
    let anonymous = server.client(None).await;
    for client in [&acme, &made_up, &anonymous] {
        let (_, refused) = spend_until_refused(client, "list_articles", json!({}), 100).await;
        assert_eq!(error_code(&refused), Some("rate_limited"));
        call(client, "generate_image", json!({"prompt": "x".repeat(4001)})).await;
    }
    let raw = RawSession::new(&server.url, &[("x-api-key", ACME_KEY)]);
    for id in 0..130 {
        raw.ping(id).await;
    }
    let board = data(&server).await;
    let json = board.to_string();
    assert!(board["refused_total"].as_u64().is_some_and(|n| n >= 6), "refusals were recorded: {json}");
    for secret in [ACME_KEY, unconfigured] {
        let id = Caller::from_token(secret).id().to_owned();
        for leak in [secret, &secret[3..], id.as_str(), &id[4..]] {
            assert!(!json.contains(leak), "{leak} in {json}");
        }
    }
    assert!(!json.contains("127.0.0.1") && !json.contains("ip:"), "no address: {json}");
    assert!(!json.contains("tok:"), "no caller id: {json}");
}

#[tokio::test]
async fn the_dashboard_is_never_rate_limited() {
    let server = TestServer::start("[limits.http]\nburst = 3\nrefill_per_sec = 0.001\n").await;
    let mut session = RawSession::new(&server.url, &[]);
    session.open().await;
    let mut statuses = Vec::new();
    for id in 1..=4 {
        statuses.push(session.ping(id).await.0);
    }
    assert_eq!(statuses, [200, 429, 429, 429], "initialize, initialized and one ping spent the HTTP budget of 3");
    let http = reqwest::Client::new();
    for _ in 0..100 {
        for path in ["/dashboard", "/dashboard/data"] {
            let response = http.get(dashboard_url(&server, path)).send().await.expect("answered");
            assert_eq!(response.status(), 200, "{path} after the HTTP limit");
        }
    }
    let board = data(&server).await;
    assert_eq!(board["tools"][0]["tool"], "POST /mcp", "the 429 is on the board: {board}");
    assert_eq!(board["tools"][0]["layer"], "http");
    assert_eq!(board["latest"][0]["code"], "rate_limited");
}

#[tokio::test]
async fn twelve_identical_refusals_are_one_row_with_their_count() {
    let server = TestServer::start("[limits.http]\nburst = 3\nrefill_per_sec = 0.001\n").await;
    let mut session = RawSession::new(&server.url, &[]);
    session.open().await;
    session.ping(0).await;
    for id in 1..=12 {
        assert_eq!(session.ping(id).await.0, 429);
    }
    let board = data(&server).await;
    let latest = board["latest"].as_array().expect("latest");
    assert_eq!(latest.len(), 1, "one row for the run: {board}");
    assert_eq!((latest[0]["count"].as_u64(), latest[0]["code"].as_str()), (Some(12), Some("rate_limited")), "{board}");
}

#[tokio::test]
async fn refusals_show_per_tool_code_and_level_for_ten_minutes() {
    let server = TestServer::start(&format!("{}{}", keys(), NO_LOOP_DETECTION)).await;
    let acme = server.client(Some(ACME_KEY)).await;
    let (passed, _) = spend_until_refused(&acme, "list_articles", json!({}), 100).await;
    assert_eq!(passed, 60);
    let board = data(&server).await;
    assert_eq!((board["refused_in_window"].as_u64(), board["admitted_total"].as_u64()), (Some(1), Some(60)));
    let tool = &board["tools"][0];
    assert_eq!((tool["tool"].as_str(), tool["layer"].as_str()), (Some("list_articles"), Some("tool")));
    assert_eq!(tool["codes"], json!([{"code": "rate_limited", "refused": 1}]));
    assert_eq!(tool["per_bucket"].as_array().map(Vec::len), Some(60));
    assert_eq!(tool["per_bucket"][59], 1, "in the current bucket");
    let latest = &board["latest"][0];
    let hashed = latest["caller"].as_str().expect("hashed caller");
    assert!(hashed.starts_with('#') && hashed.len() == 7, "{latest}");
    assert_eq!(latest["scope"], format!("caller:{hashed}"));
    assert_eq!(latest["tenant"], "acme");
    assert_eq!((latest["limit"].as_u64(), latest["remaining"].as_u64()), (Some(60), Some(0)));
    assert_eq!(latest["retry_after_ms"], 1000);
    assert_eq!(latest["message"], "Rate limit reached for list_articles. Wait 1 second before calling it again.");
    let scope = &board["scopes"][0];
    assert_eq!(
        (scope["scope"].as_str(), scope["kind"].as_str()),
        (Some(format!("caller:{hashed}").as_str()), Some("caller"))
    );
    assert_eq!((scope["remaining"].as_u64(), scope["refused"].as_u64()), (Some(0), Some(1)));

    // Jobs per tenant and the account's slots, read live.
    let globex = server.client(Some(GLOBEX_KEY)).await;
    for i in 0..2 {
        assert!(!is_error(&call(&globex, "generate_image", json!({"prompt": format!("p{i}")})).await));
    }
    let jobs = &data(&server).await["jobs"];
    assert_eq!(jobs["per_owner"], json!([{"owner": "tenant globex", "running": 2, "waiting": 0}]), "{jobs}");
    assert_eq!((jobs["in_flight"].as_u64(), jobs["account_in_use"].as_u64()), (Some(2), Some(2)));
    let split =
        |jobs: &Value| [&jobs["account_busy"], &jobs["account_held_idle"], &jobs["account_free"]].map(Value::as_u64);
    assert_eq!(split(jobs), [Some(2), Some(0), Some(8)], "before their expected end (the 2 s hint): busy");
    // Past it (they run 6 s), not yet known final: held, most likely idle.
    server.advance_secs(2.5);
    let jobs = &data(&server).await["jobs"];
    assert_eq!(split(jobs), [Some(0), Some(2), Some(8)], "{jobs}");

    // Ten minutes later the refusal has left the window; the total keeps it.
    server.advance_secs(600.0);
    let board = data(&server).await;
    assert_eq!((board["refused_in_window"].as_u64(), board["refused_total"].as_u64()), (Some(0), Some(1)));
    assert_eq!(board["tools"], json!([]));
    assert_eq!(board["latest"], json!([]));
}

#[tokio::test]
async fn a_browser_sees_the_learnt_account_limit_under_its_ceiling_and_the_upstream_requests_saved() {
    let adaptive = "[upstream.adaptive]\nenabled = true\n[tools.list_articles]\ncost = 1\ncache_ttl_ms = 60000\n";
    let server = TestServer::start(&format!("{}{adaptive}", keys())).await;
    let mut browser = Browser::launch().await;
    browser.open(&dashboard_url(&server, "/dashboard")).await;
    let account = "document.getElementById('account-text').textContent";
    let saved = "document.getElementById('saved-total').textContent";
    let saved_note = "document.getElementById('saved-note').textContent";
    let split = "document.getElementById('account-split').textContent";
    browser
        .wait_for(
            "nothing saved yet, and the limit at its ceiling says nothing of learning",
            &format!(
                "{saved} === '0' && {account} === '0 of 10 in use' && {split} === '0 busy · 0 idle but held · 10 free (ends by poll)'"
            ),
        )
        .await;

    // The same read twice from one tenant: the second is the first's kept answer.
    let acme = server.client(Some(ACME_KEY)).await;
    for _ in 0..2 {
        assert!(!is_error(&call(&acme, "list_articles", json!({"query": "lighthouses"})).await));
    }
    browser
        .wait_for(
            "one upstream request saved",
            &format!("{saved} === '1' && {saved_note} === '0 coalesced, 1 cached, since start'"),
        )
        .await;

    // The account now runs two jobs at once: the third image meets its 429, which cuts the learnt
    // limit to the two that were running.
    server.chaos(json!({"max_concurrent_predictions": 2})).await;
    let globex = server.client(Some(GLOBEX_KEY)).await;
    for i in 0..3 {
        let image = call(&globex, "generate_image", json!({"prompt": format!("a lighthouse, take {i}")})).await;
        let expected = if i < 2 { None } else { Some("upstream_rate_limited") };
        assert_eq!(error_code(&image), expected, "{}", text(&image));
    }
    let jobs = &data(&server).await["jobs"];
    assert_eq!((jobs["account_max"].as_u64(), jobs["account_ceiling"].as_u64()), (Some(2), Some(10)), "{jobs}");
    browser
        .wait_for("the learnt limit and its ceiling", &format!("{account} === '2 of 2 in use (learnt; ceiling 10)'"))
        .await;
}

#[tokio::test]
async fn an_open_breaker_and_the_upstream_refusals_show() {
    let server = TestServer::start(&format!("{}[upstream]\nbreaker_failures = 2\n", keys())).await;
    let acme = server.client(Some(ACME_KEY)).await;
    server.chaos(json!({"rate_5xx": 1.0})).await;
    for i in 0..2 {
        let failed = call(&acme, "list_articles", json!({"query": format!("q{i}")})).await;
        assert_eq!(error_code(&failed), Some("upstream_unavailable"), "{}", text(&failed));
    }
    let refused = call(&acme, "save_article", json!({"title": "t", "body": "b"})).await;
    assert_eq!(error_code(&refused), Some("upstream_unavailable"), "refused before charging: {}", text(&refused));
    let board = data(&server).await;
    assert_eq!(board["breaker"]["state"], "open", "{board}");
    assert!(board["breaker"]["open_for_ms"].as_u64().is_some_and(|ms| ms > 0), "{board}");
    let tools: Vec<(&str, u64)> = board["tools"]
        .as_array()
        .expect("tools")
        .iter()
        .map(|t| (t["tool"].as_str().unwrap_or(""), t["refused"].as_u64().unwrap_or(0)))
        .collect();
    assert_eq!(
        tools,
        [("list_articles", 2), ("save_article", 1)],
        "upstream failures from the tool and the breaker's refusal"
    );
    assert_eq!(board["latest"][0]["scope"], "upstream:save_article");
}

#[tokio::test]
async fn busiest_budgets_show_current_levels_not_the_last_calls() {
    let server = TestServer::start(&format!("{}{}", keys(), NO_LOOP_DETECTION)).await;
    let acme = server.client(Some(ACME_KEY)).await;
    let started = call(&acme, "generate_image", json!({"prompt": "one job"})).await;
    assert!(!is_error(&started), "{}", text(&started));
    let id = structured(&started)["predict_id"].as_str().expect("predict_id").to_owned();
    let level = |board: &Value, scope: &str| {
        let row = board["scopes"].as_array()?.iter().find(|s| s["scope"] == scope)?.clone();
        Some((row["remaining"].as_u64()?, row["limit"].as_u64()?, row["current"].as_bool()?))
    };
    let board = data(&server).await;
    assert_eq!(level(&board, "in_flight:tenant:acme"), Some((4, 5, true)), "one slot of the tenant's held: {board}");

    // The job ends; its slot is back, though no call has named the budget since.
    server.advance_secs(6.0);
    eventually("the image succeeded", || async {
        structured(&call(&acme, "get_prediction", json!({ "predict_id": id })).await)["status"] == "succeeded"
    })
    .await;
    let board = data(&server).await;
    assert_eq!(level(&board, "in_flight:tenant:acme"), Some((5, 5, true)), "{board}");

    // A budget spent and then refilled reads as it is now, too.
    let (passed, _) = spend_until_refused(&acme, "list_articles", json!({}), 100).await;
    assert!(passed > 0);
    let tenant_calls = |board: &Value| level(board, "tenant:acme").map(|(left, _, _)| left);
    let spent = tenant_calls(&data(&server).await).expect("the tenant's budget is shown");
    server.advance_secs(60.0);
    let refilled = tenant_calls(&data(&server).await).expect("still shown");
    assert!(refilled > spent, "refilled from {spent} to {refilled}");
}
