//! The admin API through HTTP (reqwest against its own listener) and the agent's view through
//! MCP clients, on the memory store and on Redis: reset, refund, block and cancel each change
//! what the next MCP call sees; without the admin key every admin route is 401; no admin answer
//! shows a configured key; on Redis, what one instance's admin API does holds on every instance.

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::*;
use crate::test_redis::TestRedis;
use mcp_ratelimit::admin::ROUTES;
use mcp_ratelimit::identity::Caller;
use serde_json::{Value, json};

const ADMIN_KEY: &str = "admin-key-for-tests-0123456789";
const ALICE: &str = "alice-secret-key-0001";
const BOB: &str = "bob-secret-key-0002";
const CAROL: &str = "carol-secret-key-0003";

/// Alice and Bob share tenant acme; Carol has none. Small budgets that do not refill while a
/// test runs (Redis's clock is real), and image jobs that outlast the test.
const KEYS: &str = "[admin]\nkey = \"admin-key-for-tests-0123456789\"\n\
    [[auth.keys]]\nkey = \"alice-secret-key-0001\"\ntenant = \"acme\"\n\
    [[auth.keys]]\nkey = \"bob-secret-key-0002\"\ntenant = \"acme\"\n\
    [[auth.keys]]\nkey = \"carol-secret-key-0003\"\n\
    [limits.caller]\nburst = 20\nrefill_per_sec = 0.001\n\
    [limits.tenant]\nburst = 30\nrefill_per_sec = 0.001\n\
    [tools.generate_image_to_video]\ncost = 5\n\
    [mock_upstream]\nimage_job_ms = 600000\n\
    [loop_detection]\nenabled = false\n";

/// A server with its MCP listener and its admin listener, both on free loopback ports.
struct Admin {
    server: TestServer,
    url: String,
    http: reqwest::Client,
}

impl Admin {
    async fn start(extra: &str) -> Self {
        let server = TestServer::start(&format!("{KEYS}{extra}")).await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        tokio::spawn(server.app.serve_admin(listener).expect("admin.key is set"));
        Self { server, url, http: reqwest::Client::new() }
    }

    /// `method path` with the admin key (or `key`), and `body` as JSON when given: status and
    /// the body, parsed, with its text.
    async fn send(&self, key: Option<&str>, method: &str, path: &str, body: Option<Value>) -> (u16, Value, String) {
        let method = reqwest::Method::from_bytes(method.to_uppercase().as_bytes()).expect("method");
        let mut request = self.http.request(method, format!("{}{path}", self.url));
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.expect("admin answered");
        let status = response.status().as_u16();
        let text = response.text().await.expect("body");
        (status, serde_json::from_str(&text).unwrap_or(Value::Null), text)
    }

    async fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let (status, value, _) = self.send(Some(ADMIN_KEY), method, path, body).await;
        (status, value)
    }

    /// The caller id of the configured key at `auth.keys[index]`, from `GET /admin/keys`.
    async fn caller_id(&self, index: usize) -> String {
        let (status, keys) = self.call("get", "/admin/keys", None).await;
        assert_eq!(status, 200, "{keys}");
        let key = keys["keys"].as_array().and_then(|k| k.iter().find(|k| k["config"] == format!("auth.keys[{index}]")));
        key.and_then(|k| k["caller"].as_str()).expect("the key is listed").to_owned()
    }
}

fn path_of(route: &str) -> String {
    route.replace("{caller}", "ip:127.0.0.1").replace("{tenant}", "acme").replace("{predict_id}", "i_missing")
}

#[tokio::test]
async fn without_the_admin_key_every_admin_route_is_401() {
    let admin = Admin::start("").await;
    let wrong = "admin-key-for-tests-0123456780";
    let mut routes: Vec<(String, String)> = ROUTES.iter().map(|(m, p)| (m.to_string(), path_of(p))).collect();
    routes.push(("get".into(), "/admin/no-such-thing".into()));
    routes.push(("post".into(), "/admin/callers/ip:127.0.0.1".into()));
    for (method, path) in &routes {
        for key in [None, Some(wrong), Some(""), Some(ALICE)] {
            let (status, body, _) = admin.send(key, method, path, Some(json!({}))).await;
            assert_eq!(status, 401, "{method} {path} with {key:?}: {body}");
            assert_eq!(body["error"]["code"], "unauthorized");
        }
        // Another scheme with the right key is no bearer key either.
        let response = admin
            .http
            .request(reqwest::Method::GET, format!("{}{path}", admin.url))
            .header("authorization", format!("Basic {ADMIN_KEY}"))
            .send()
            .await
            .expect("answered");
        assert_eq!(response.status().as_u16(), 401);
        assert_eq!(response.headers().get("www-authenticate").map(|v| v.as_bytes()), Some(&b"Bearer"[..]));
    }
    // With the key, every documented route is served (whatever it then says about its input),
    // and only an unknown route is the router's 404.
    for (method, path) in ROUTES {
        let (status, body) = admin.call(method, &path_of(path), Some(json!({"units": 1, "duration_ms": 1}))).await;
        assert!(status != 405 && body["error"]["code"] != "no_such_route", "{method} {path}: {status} {body}");
    }
    let (status, body) = admin.call("get", "/admin/no-such-thing", None).await;
    assert_eq!((status, body["error"]["code"].as_str()), (404, Some("no_such_route")));
    let (status, document) = admin.call("get", "/admin/openapi.json", None).await;
    assert_eq!(status, 200);
    assert_eq!(document["openapi"], "3.1.0");
}

#[tokio::test]
async fn a_reset_gives_a_spent_caller_its_budget_back() {
    let admin = Admin::start("").await;
    let agent = admin.server.client(Some(CAROL)).await;
    let (passed, refusal) = spend_until_refused(&agent, "list_articles", json!({}), 100).await;
    assert_eq!(passed, 20);
    let carol = admin.caller_id(2).await;
    assert_eq!(structured(&refusal)["error"]["scope"], format!("caller:{carol}"));

    let (status, answer) = admin.call("get", &format!("/admin/callers/{carol}"), None).await;
    assert_eq!(status, 200, "{answer}");
    let caller_budget = |answer: &Value| {
        answer["budgets"].as_array().and_then(|b| b.iter().find(|b| b["scope"] == format!("caller:{carol}"))).cloned()
    };
    assert_eq!(caller_budget(&answer).expect("the caller budget")["remaining"], 0);

    let (status, answer) = admin.call("post", &format!("/admin/callers/{carol}/reset"), None).await;
    assert_eq!(status, 200, "{answer}");
    assert!(answer["reset"].as_array().is_some_and(|s| s.contains(&json!(format!("caller:{carol}")))), "{answer}");
    let (passed, _) = spend_until_refused(&agent, "list_articles", json!({}), 100).await;
    assert_eq!(passed, 20, "the whole budget is back after the reset");

    // One scope alone, named as agents see it.
    let (status, answer) = admin
        .call("post", &format!("/admin/callers/{carol}/reset"), Some(json!({"scope": format!("caller:{carol}")})))
        .await;
    assert_eq!((status, answer["reset"].clone()), (200, json!([format!("caller:{carol}")])));
    assert!(!is_error(&call(&agent, "list_articles", json!({})).await));
}

#[tokio::test]
async fn a_refund_gives_units_back_never_beyond_the_budget() {
    let admin = Admin::start("").await;
    let agent = admin.server.client(Some(CAROL)).await;
    let carol = admin.caller_id(2).await;
    spend_until_refused(&agent, "list_articles", json!({}), 100).await;

    let (status, answer) =
        admin.call("post", &format!("/admin/callers/{carol}/refund"), Some(json!({"units": 3}))).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!((answer["refunded"].clone(), answer["budget"]["remaining"].clone()), (json!(3), json!(3)));
    let (passed, refusal) = spend_until_refused(&agent, "list_articles", json!({}), 100).await;
    assert_eq!(passed, 3, "exactly the refunded units");
    assert_eq!(error_code(&refusal), Some("rate_limited"));

    let (_, answer) = admin.call("post", &format!("/admin/callers/{carol}/refund"), Some(json!({"units": 1000}))).await;
    assert_eq!(answer["budget"]["remaining"], 20, "a refund fills the budget up, never beyond: {answer}");
    let status = call(&agent, "rate_limit_status", json!({})).await;
    assert_eq!(budget(&status, "caller:")["remaining"], 20);
    let (passed, _) = spend_until_refused(&agent, "list_articles", json!({}), 100).await;
    assert_eq!(passed, 20);
}

#[tokio::test]
async fn a_blocked_caller_is_refused_with_the_blocks_time_left_until_unblocked() {
    let admin = Admin::start("").await;
    let carol_agent = admin.server.client(Some(CAROL)).await;
    let alice_agent = admin.server.client(Some(ALICE)).await;
    let carol = admin.caller_id(2).await;

    let (status, answer) =
        admin.call("put", &format!("/admin/callers/{carol}/block"), Some(json!({"duration_ms": 60_000}))).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["blocked"], json!({"scope": format!("block:caller:{carol}"), "left_ms": 60_000}));
    let refusal = call(&carol_agent, "list_articles", json!({})).await;
    assert_eq!(error_code(&refusal), Some("rate_limited"));
    let error = &structured(&refusal)["error"];
    assert_eq!(error["retry_after_ms"], 60_000);
    assert_eq!(error["scope"], format!("block:caller:{carol}"));
    assert!(text(&refusal).contains("operator") && text(&refusal).contains("60 seconds"), "{}", text(&refusal));
    assert!(!is_error(&call(&alice_agent, "list_articles", json!({})).await), "another caller is not blocked");

    admin.server.advance_ms(20_000);
    let refusal = call(&carol_agent, "generate_image", json!({"prompt": "a cat"})).await;
    assert_eq!(structured(&refusal)["error"]["retry_after_ms"], 40_000, "the block's time left");
    let (_, inspected) = admin.call("get", &format!("/admin/callers/{carol}"), None).await;
    assert_eq!(inspected["blocks"], json!([{"scope": format!("block:caller:{carol}"), "left_ms": 40_000}]));
    // Nothing was charged while blocked.
    let status = call(&carol_agent, "rate_limit_status", json!({})).await;
    assert!(is_error(&status), "rate_limit_status is a tool call too, and blocked");

    let (status, answer) = admin.call("delete", &format!("/admin/callers/{carol}/block"), None).await;
    assert_eq!((status, answer), (200, json!({"lifted": true})));
    let status = call(&carol_agent, "rate_limit_status", json!({})).await;
    assert_eq!(budget(&status, "caller:")["remaining"], 20, "blocked calls charged nothing");

    // A block ends by itself.
    admin.call("put", &format!("/admin/callers/{carol}/block"), Some(json!({"duration_ms": 5_000}))).await;
    assert!(is_error(&call(&carol_agent, "list_articles", json!({})).await));
    admin.server.advance_ms(5_000);
    assert!(!is_error(&call(&carol_agent, "list_articles", json!({})).await));
    let (_, answer) = admin.call("delete", &format!("/admin/callers/{carol}/block"), None).await;
    assert_eq!(answer, json!({"lifted": false}));
}

#[tokio::test]
async fn a_tenant_is_blocked_reset_and_refunded_for_all_its_callers_and_only_them() {
    let admin = Admin::start("").await;
    let (alice, bob, carol) = (
        admin.server.client(Some(ALICE)).await,
        admin.server.client(Some(BOB)).await,
        admin.server.client(Some(CAROL)).await,
    );
    let (status, answer) = admin.call("put", "/admin/tenants/acme/block", Some(json!({"duration_ms": 30_000}))).await;
    assert_eq!(status, 200, "{answer}");
    for agent in [&alice, &bob] {
        let refusal = call(agent, "list_articles", json!({})).await;
        assert_eq!(structured(&refusal)["error"]["scope"], "block:tenant:acme");
        assert!(text(&refusal).contains("your tenant"), "{}", text(&refusal));
    }
    assert!(!is_error(&call(&carol, "list_articles", json!({})).await), "carol has no tenant");
    admin.call("delete", "/admin/tenants/acme/block", None).await;

    // Alice spends 20 of the tenant's 30, Bob the last 10: the tenant refuses Bob.
    spend_until_refused(&alice, "list_articles", json!({}), 100).await;
    let (passed, refusal) = spend_until_refused(&bob, "list_articles", json!({}), 100).await;
    assert_eq!((passed, structured(&refusal)["error"]["scope"].clone()), (10, json!("tenant:acme")));
    let (status, answer) = admin.call("post", "/admin/tenants/acme/refund", Some(json!({"units": 2}))).await;
    assert_eq!(
        (status, answer["budget"]["scope"].clone(), answer["budget"]["remaining"].clone()),
        (200, json!("tenant:acme"), json!(2))
    );
    let (passed, _) = spend_until_refused(&bob, "list_articles", json!({}), 100).await;
    assert_eq!(passed, 2);
    let (status, answer) = admin.call("post", "/admin/tenants/acme/reset", None).await;
    let tool_budget = "tenant:acme:tool:generate_image_to_video";
    assert_eq!((status, answer["reset"].clone()), (200, json!(["tenant:acme", tool_budget])));
    let (passed, refusal) = spend_until_refused(&bob, "list_articles", json!({}), 100).await;
    assert_eq!(passed, 8, "the tenant's budget is back: now bob's own (12 of 20 spent) is what stops him");
    assert!(structured(&refusal)["error"]["scope"].as_str().is_some_and(|s| s.starts_with("caller:tok:")));

    let (status, tenant) = admin.call("get", "/admin/tenants/acme", None).await;
    assert_eq!(status, 200);
    assert_eq!(tenant["callers"].as_array().map(Vec::len), Some(2));
    assert_eq!(tenant["budgets"][0]["scope"], "tenant:acme");
}

#[tokio::test]
async fn an_admin_cancel_frees_the_callers_slot_for_its_next_job() {
    let admin = Admin::start("[limits.in_flight]\ncaller = 3\n").await;
    let agent = admin.server.client(Some(CAROL)).await;
    let carol = admin.caller_id(2).await;
    let mut ids = Vec::new();
    for i in 0..3 {
        let r = call(&agent, "generate_image", json!({"prompt": format!("p{i}")})).await;
        ids.push(structured(&r)["predict_id"].as_str().expect("accepted").to_owned());
    }
    assert_eq!(error_code(&call(&agent, "generate_image", json!({"prompt": "four"})).await), Some("busy"));

    let (status, listed) = admin.call("get", &format!("/admin/jobs?caller={carol}"), None).await;
    assert_eq!(status, 200, "{listed}");
    let listed: Vec<&str> =
        listed["jobs"].as_array().expect("jobs").iter().filter_map(|j| j["predict_id"].as_str()).collect();
    assert_eq!(listed, ids.iter().map(String::as_str).collect::<Vec<_>>(), "oldest first");
    let (_, none) = admin.call("get", "/admin/jobs?tenant=acme", None).await;
    assert_eq!(none["jobs"], json!([]), "carol's jobs are no tenant's");

    let (status, answer) = admin.call("post", &format!("/admin/jobs/{}/cancel", ids[0]), None).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!((answer["status"].clone(), answer["caller"].clone()), (json!("canceled"), json!(carol)));
    let seen = call(&agent, "get_prediction", json!({"predict_id": ids[0]})).await;
    assert_eq!(structured(&seen)["status"], "canceled");
    let next = call(&agent, "generate_image", json!({"prompt": "four"})).await;
    assert!(!is_error(&next), "the freed slot takes the next job: {}", text(&next));
    let (_, all) = admin.call("get", "/admin/jobs", None).await;
    assert_eq!(all["jobs"].as_array().map(Vec::len), Some(3));
}

#[tokio::test]
async fn bad_input_is_a_400_naming_the_field_and_unknown_targets_are_404() {
    let admin = Admin::start("").await;
    let carol = admin.caller_id(2).await;
    let refund = format!("/admin/callers/{carol}/refund");
    for (method, path, body, field) in [
        ("post", refund.clone(), json!({"units": 0}), "units"),
        ("post", refund.clone(), json!({"units": "ten"}), "units"),
        ("post", refund.clone(), json!({"units": -3}), "units"),
        ("post", refund.clone(), json!({}), "units"),
        ("post", refund.clone(), json!({"units": 1, "tokens": 2}), "tokens"),
        ("post", refund.clone(), json!([1, 2]), "body"),
        ("post", refund.clone(), json!({"units": 1, "scope": "tenant:acme"}), "scope"),
        ("post", refund.clone(), json!({"units": 1, "scope": format!("in_flight:caller:{carol}")}), "scope"),
        ("post", format!("/admin/callers/{carol}/reset"), json!({"scope": 7}), "scope"),
        ("put", format!("/admin/callers/{carol}/block"), json!({"duration_ms": 0}), "duration_ms"),
        ("put", format!("/admin/callers/{carol}/block"), json!({"duration_ms": 1e12}), "duration_ms"),
        ("get", "/admin/callers/alice".to_owned(), Value::Null, "caller"),
        ("get", "/admin/callers/tok:xyz".to_owned(), Value::Null, "caller"),
        ("get", "/admin/callers/tok:0123456789abcdef?from=nowhere".to_owned(), Value::Null, "from"),
        ("get", "/admin/jobs?owner=x".to_owned(), Value::Null, "owner"),
    ] {
        let (status, answer) = admin.call(method, &path, (!body.is_null()).then_some(body.clone())).await;
        assert_eq!((status, answer["error"]["field"].as_str()), (400, Some(field)), "{method} {path} {body}: {answer}");
    }
    let (status, answer, _) = admin.send(Some(ADMIN_KEY), "post", &refund, None).await;
    assert_eq!((status, answer["error"]["field"].as_str()), (400, Some("units")));
    let raw = admin.http.post(format!("{}{refund}", admin.url)).bearer_auth(ADMIN_KEY).body("{not json").send().await;
    assert_eq!(raw.expect("answered").status().as_u16(), 400);
    for (path, code) in [
        ("/admin/callers/tok:0123456789abcdef", "unknown_caller"),
        ("/admin/tenants/globex", "unknown_tenant"),
        ("/admin/jobs?tenant=globex", "unknown_tenant"),
    ] {
        let (status, answer) = admin.call("get", path, None).await;
        assert_eq!((status, answer["error"]["code"].as_str()), (404, Some(code)), "{path}: {answer}");
    }
    let (status, answer) = admin.call("post", "/admin/jobs/i_nope/cancel", None).await;
    assert_eq!((status, answer["error"]["code"].as_str()), (404, Some("unknown_job")));
    // A made-up key's budgets are reached through the address it calls from.
    let (status, answer) = admin.call("get", "/admin/callers/tok:0123456789abcdef?from=ip:127.0.0.1", None).await;
    assert_eq!(status, 200, "{answer}");
    assert!(answer["budgets"].as_array().is_some_and(|b| b.iter().any(|b| b["scope"] == "address:ip:127.0.0.1")));
}

#[tokio::test]
async fn with_an_id_secret_the_admin_api_finds_callers_by_the_ids_the_server_shows() {
    let admin = Admin::start("[auth]\nid_secret = \"id-secret-for-admin-tests-0123\"\n").await;
    let agent = admin.server.client(Some(CAROL)).await;
    let (passed, refusal) = spend_until_refused(&agent, "list_articles", json!({}), 100).await;
    assert_eq!(passed, 20);
    let scope = structured(&refusal)["error"]["scope"].as_str().expect("the refusal names its scope").to_owned();
    let carol = scope.strip_prefix("caller:").expect("the caller budget refused").to_owned();
    assert_ne!(carol, Caller::from_token(CAROL).id(), "the id is keyed");
    assert_eq!(admin.caller_id(2).await, carol, "GET /admin/keys lists the id refusals show");
    let (status, answer) = admin.call("get", &format!("/admin/callers/{carol}"), None).await;
    assert_eq!(status, 200, "{answer}");
    let (status, answer) = admin.call("post", &format!("/admin/callers/{carol}/reset"), None).await;
    assert_eq!(status, 200, "{answer}");
    let (passed, _) = spend_until_refused(&agent, "list_articles", json!({}), 100).await;
    assert_eq!(passed, 20, "the reset reached the budget the agent spends");

    // A made-up key's caller: its keyed id as rate_limit_status shows it, and its address.
    let stranger = admin.server.client(Some("made-up-key-0004")).await;
    assert!(!is_error(&call(&stranger, "list_articles", json!({})).await));
    let status = call(&stranger, "rate_limit_status", json!({})).await;
    let scope = budget(&status, "caller:")["scope"].as_str().expect("scope").to_owned();
    let (status, answer) =
        admin.call("get", &format!("/admin/{}?from=ip:127.0.0.1", scope.replace("caller:", "callers/")), None).await;
    assert_eq!(status, 200, "{answer}");
    let seen = answer["budgets"].as_array().and_then(|b| b.iter().find(|b| b["scope"] == scope)).cloned();
    assert_eq!(seen.map(|b| b["remaining"].clone()), Some(json!(19)), "the stranger's own budget: {answer}");
}

#[tokio::test]
async fn no_admin_answer_shows_a_configured_key() {
    let admin = Admin::start("").await;
    let agent = admin.server.client(Some(ALICE)).await;
    let r = call(&agent, "generate_image", json!({"prompt": "a key in a haystack"})).await;
    let job = structured(&r)["predict_id"].as_str().expect("accepted").to_owned();
    let alice = admin.caller_id(0).await;
    let mut bodies = Vec::new();
    for (method, path) in ROUTES {
        let path = path.replace("{caller}", &alice).replace("{tenant}", "acme").replace("{predict_id}", &job);
        for body in [json!({"units": 2, "duration_ms": 1000}), json!({"units": 0})] {
            bodies.push(admin.send(Some(ADMIN_KEY), method, &path, Some(body)).await.2);
        }
    }
    bodies.push(admin.send(None, "get", "/admin/keys", None).await.2);
    let everything = bodies.join("\n");
    assert!(everything.contains(&alice), "the answers name callers by id");
    for secret in [ALICE, BOB, CAROL, ADMIN_KEY] {
        assert!(!everything.contains(secret), "an admin answer shows a raw key");
    }
}

#[test]
fn serve_logs_the_admin_api_off_or_on_and_never_its_key() {
    let free = || std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("free port").port();
    let wrong = "a-wrong-admin-key-that-must-not-be-logged";
    let serve = |admin_key: &str, admin_port: u16, mcp_port: u16| {
        Command::new(env!("CARGO_BIN_EXE_mcp-ratelimit"))
            .args(["serve", "--listen", &format!("127.0.0.1:{mcp_port}")])
            .env("RUST_LOG", "trace")
            .env("MCP_RL__ADMIN__KEY", admin_key)
            .env("MCP_RL__ADMIN__LISTEN", format!("127.0.0.1:{admin_port}"))
            .stderr(Stdio::piped())
            .spawn()
            .expect("server starts")
    };
    let wait_for = |port: u16| {
        (0..400).any(|_| {
            std::thread::sleep(Duration::from_millis(25)); // polling the child process, bounded
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        })
    };
    let stop = |child: std::process::Child| {
        let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
        let out = child.wait_with_output().expect("server exits");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };

    let (admin_port, mcp_port) = (free(), free());
    let off = serve("", admin_port, mcp_port);
    assert!(wait_for(mcp_port), "server never listened");
    assert!(std::net::TcpStream::connect(("127.0.0.1", admin_port)).is_err(), "no admin listener without a key");
    assert!(stop(off).contains("admin API off"));

    let short = Command::new(env!("CARGO_BIN_EXE_mcp-ratelimit"))
        .args(["serve", "--listen", &format!("127.0.0.1:{}", free())])
        .env("MCP_RL__ADMIN__KEY", "too-short")
        .output()
        .expect("binary runs");
    let stderr = String::from_utf8_lossy(&short.stderr);
    assert!(!short.status.success() && stderr.contains("admin.key") && !stderr.contains("too-short"), "{stderr}");

    let (admin_port, mcp_port) = (free(), free());
    let on = serve(ADMIN_KEY, admin_port, mcp_port);
    assert!(wait_for(admin_port), "the admin listener never came up");
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    runtime.block_on(async {
        let http = reqwest::Client::new();
        let url = format!("http://127.0.0.1:{admin_port}/admin/callers/ip:127.0.0.1/reset");
        let refused = http.post(&url).bearer_auth(wrong).send().await.expect("answered");
        assert_eq!(refused.status().as_u16(), 401);
        let done = http.post(&url).bearer_auth(ADMIN_KEY).send().await.expect("answered");
        assert_eq!(done.status().as_u16(), 200);
    });
    let log = stop(on);
    assert!(log.contains("admin API on") && log.contains("admin action") && log.contains("refused"), "{log}");
    assert!(!log.contains(ADMIN_KEY) && !log.contains(wrong), "a key reached the log");
}

/// Redis as the store for servers sharing one private Redis (jobs claim upstream-wide keys).
fn on_redis(redis: &TestRedis, extra: &str) -> String {
    format!("[store]\nbackend = \"redis\"\nredis_url = \"{}\"\ntimeout_ms = 200\n{extra}", redis.url)
}

#[tokio::test]
async fn on_redis_what_one_instances_admin_api_does_holds_on_every_instance() {
    let redis = TestRedis::private();
    let config = on_redis(&redis, "[limits.in_flight]\ncaller = 1\n");
    // B's embedded mock is the one upstream: a cancel through A must reach the job B started.
    let b = TestServer::start(&format!("{KEYS}{config}")).await;
    let a = Admin::start(&format!("{config}[upstream]\nurl = \"{}\"\n", b.app.upstream_url())).await;
    let carol = a.caller_id(2).await;
    let alice = a.caller_id(0).await;
    let on_b = b.client(Some(CAROL)).await;

    // Block through A: refused on B, with the block's time left; unblocked through A: served on B.
    let (status, _) =
        a.call("put", &format!("/admin/callers/{carol}/block"), Some(json!({"duration_ms": 60_000}))).await;
    assert_eq!(status, 200);
    let refusal = call(&on_b, "list_articles", json!({})).await;
    let error = &structured(&refusal)["error"];
    assert_eq!(
        (error["code"].as_str(), error["scope"].clone()),
        (Some("rate_limited"), json!(format!("block:caller:{carol}")))
    );
    let left = error["retry_after_ms"].as_u64().expect("a wait");
    assert!((50_000..=60_000).contains(&left), "the block's time left, on Redis's clock: {left}");
    let (_, inspected) = a.call("get", &format!("/admin/callers/{carol}"), None).await;
    assert_eq!(inspected["blocks"][0]["scope"], format!("block:caller:{carol}"));
    a.call("delete", &format!("/admin/callers/{carol}/block"), None).await;
    assert!(!is_error(&call(&on_b, "list_articles", json!({})).await));

    // A tenant blocked through A stops its callers on B.
    a.call("put", "/admin/tenants/acme/block", Some(json!({"duration_ms": 60_000}))).await;
    let alice_on_b = b.client(Some(ALICE)).await;
    let refusal = call(&alice_on_b, "list_articles", json!({})).await;
    assert_eq!(structured(&refusal)["error"]["scope"], "block:tenant:acme");
    a.call("delete", "/admin/tenants/acme/block", None).await;

    // Spent on B (which then remembers the refusal locally); reset through A: B serves again.
    let (passed, _) = spend_until_refused(&on_b, "list_articles", json!({}), 100).await;
    assert_eq!(passed, 19);
    let (status, _) = a.call("post", &format!("/admin/callers/{carol}/reset"), None).await;
    assert_eq!(status, 200);
    eventually("B serves carol again after the reset", || async {
        !is_error(&call(&on_b, "list_articles", json!({})).await)
    })
    .await;
    let (passed, _) = spend_until_refused(&on_b, "list_articles", json!({}), 100).await;
    assert_eq!(passed, 19, "the whole budget came back (one call was spent seeing it)");

    // Refund through A: exactly those units on B.
    let (_, answer) = a.call("post", &format!("/admin/callers/{carol}/refund"), Some(json!({"units": 2}))).await;
    assert_eq!(answer["budget"]["remaining"], 2, "{answer}");
    eventually("B serves the refunded units", || async { !is_error(&call(&on_b, "list_articles", json!({})).await) })
        .await;
    assert!(!is_error(&call(&on_b, "list_articles", json!({})).await));
    assert!(is_error(&call(&on_b, "list_articles", json!({})).await), "two units, no more");

    // A job running on B, listed and cancelled through A: B's next job gets the slot.
    let painter = b.client(Some(ALICE)).await;
    let r = call(&painter, "generate_image", json!({"prompt": "on b"})).await;
    let job = structured(&r)["predict_id"].as_str().expect("accepted").to_owned();
    assert_eq!(error_code(&call(&painter, "generate_image", json!({"prompt": "second"})).await), Some("busy"));
    eventually("A lists B's job", || async {
        let listed = a.call("get", &format!("/admin/jobs?caller={alice}"), None).await.1;
        listed["jobs"].as_array().is_some_and(|j| j.len() == 1)
    })
    .await;
    let (_, listed) = a.call("get", &format!("/admin/jobs?caller={alice}"), None).await;
    assert_eq!(
        (listed["jobs"][0]["predict_id"].as_str(), listed["jobs"][0]["on_this_instance"].as_bool()),
        (Some(job.as_str()), Some(false))
    );
    let (status, answer) = a.call("post", &format!("/admin/jobs/{job}/cancel"), None).await;
    assert_eq!((status, answer["status"].as_str()), (200, Some("canceled")), "{answer}");
    // B sees the cancel at its next poll of the job, and gives the slot back.
    b.advance_ms(2_000);
    eventually("B's next job gets the freed slot", || async {
        !is_error(&call(&painter, "generate_image", json!({"prompt": "second"})).await)
    })
    .await;
    // B publishes its jobs' snapshots as they change, in a task of its own: A lists the new
    // job once B's publisher has written it, and never the cancelled one.
    eventually("A lists B's new job", || async {
        let listed = a.call("get", "/admin/jobs?tenant=acme", None).await.1;
        listed["jobs"].as_array().is_some_and(|j| !j.is_empty())
    })
    .await;
    let (_, listed) = a.call("get", "/admin/jobs?tenant=acme", None).await;
    let jobs = listed["jobs"].as_array().cloned().unwrap_or_default();
    assert_eq!(jobs.len(), 1, "the new job, not the cancelled one: {listed}");
    assert_ne!(jobs[0]["predict_id"].as_str(), Some(job.as_str()), "the new job, not the cancelled one: {listed}");
}
