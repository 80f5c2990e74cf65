//! The examples in `examples/`, run as a user runs them (`cargo run --example …`) and driven
//! from outside: an MCP client against the rmcp example, plain HTTP against the axum one.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Mutex;
use std::time::Duration;

use crate::common::{Client, call, error_code, is_error, structured, text};
use crate::test_redis;
use rmcp::ServiceExt;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// An example's binary, built here (`cargo build --example NAME`, once per test run) so the test
/// runs what it names: `cargo test --all-targets` builds examples only as test harnesses, and a
/// plain `target/debug/examples/NAME` exists only where an earlier build left one.
fn example(name: &str) -> PathBuf {
    static BUILT: Mutex<Vec<(String, PathBuf)>> = Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, path)) = built.iter().find(|(n, _)| n == name) {
        return path.clone();
    }
    let mut cargo = std::process::Command::new(env!("CARGO"));
    cargo.current_dir(env!("CARGO_MANIFEST_DIR")).args(["build", "--example", name, "--message-format=json"]);
    if !cfg!(debug_assertions) {
        cargo.arg("--release");
    }
    let output = cargo.stderr(Stdio::inherit()).output().unwrap_or_else(|e| panic!("cannot run cargo: {e}"));
    assert!(output.status.success(), "cargo build --example {name} failed");
    // The artifact message names the executable wherever the target dir is.
    let path = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == name)
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .unwrap_or_else(|| panic!("cargo build --example {name} named no executable"));
    built.push((name.to_owned(), path.clone()));
    path
}

/// Starts an example on a free port and returns it with the URL it printed.
async fn start(name: &str) -> (Child, String) {
    let (child, lines) = start_with(name, &[], 1).await;
    (child, lines[0].clone())
}

/// Starts an example on a free port with `env` set, and returns it with the first `lines` lines
/// it printed, the first (the URL it serves) without its `listening on `.
async fn start_with(name: &str, env: &[(&str, &str)], lines: usize) -> (Child, Vec<String>) {
    let mut child = Command::new(example(name))
        .env("LISTEN", "127.0.0.1:0")
        .env("RUST_LOG", "warn")
        // Limits in memory unless the test says otherwise (a REDIS_URL set for other tests is not this one's).
        .env_remove("REDIS_URL")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start examples/{name}: {e}"));
    let stdout = child.stdout.take().expect("stdout");
    let mut reader = BufReader::new(stdout).lines();
    let mut printed = Vec::new();
    while printed.len() < lines {
        let line = tokio::time::timeout(Duration::from_secs(30), reader.next_line())
            .await
            .expect("the example prints its address")
            .expect("stdout readable")
            .expect("a line");
        printed.push(line);
    }
    let url =
        printed[0].strip_prefix("listening on ").unwrap_or_else(|| panic!("unexpected first line: {}", printed[0]));
    printed[0] = url.to_owned();
    (child, printed)
}

#[tokio::test]
async fn rmcp_example_refuses_the_call_its_budget_cannot_pay_with_the_wait() {
    let (_example, url) = start("rmcp_server").await;
    let config = StreamableHttpClientTransportConfig::with_uri(url).auth_header("agent-one");
    let client = ().serve(StreamableHttpClientTransport::from_config(config)).await.expect("client connects");

    // The prices are in the descriptions.
    let tools = client.list_all_tools().await.expect("tools/list");
    let described = |name: &str| {
        tools.iter().find(|t| t.name == name).and_then(|t| t.description.clone()).unwrap_or_default().to_string()
    };
    assert!(described("define").ends_with("Costs 1 token."), "{}", described("define"));
    assert!(described("summarise").ends_with("Costs 2 tokens."), "{}", described("summarise"));

    // 5 tokens: summarise (2) + summarise (2) + define (1); the fourth call cannot be paid.
    for (tool, word) in [("summarise", "alpha"), ("summarise", "beta"), ("define", "gamma")] {
        let r = call(&client, tool, json!({ "word": word })).await;
        assert!(!is_error(&r), "{tool} {word} refused: {}", text(&r));
    }
    let refused = call(&client, "define", json!({ "word": "delta" })).await;
    assert!(is_error(&refused), "the fourth call is refused");
    assert_eq!(error_code(&refused), Some("rate_limited"));
    let error = &structured(&refused)["error"];
    assert_eq!(error["limit"], 5);
    assert_eq!(error["remaining"], 0);
    assert!(error["scope"].as_str().is_some_and(|s| s.starts_with("caller:tok:")), "{error}");
    // One token comes back every 10 s; a little of it has refilled while the calls ran.
    let wait = error["retry_after_ms"].as_u64().expect("retry_after_ms");
    assert!((5_000..=10_000).contains(&wait), "wait {wait} ms");
    assert!(
        text(&refused).contains("Wait 10 seconds") || text(&refused).contains("Wait 9 seconds"),
        "{}",
        text(&refused)
    );

    client.cancel().await.expect("client closes");
}

#[tokio::test]
async fn rmcp_example_gives_each_caller_its_own_budget() {
    let (_example, url) = start("rmcp_server").await;
    for token in ["agent-a", "agent-b"] {
        let config = StreamableHttpClientTransportConfig::with_uri(url.clone()).auth_header(token);
        let client = ().serve(StreamableHttpClientTransport::from_config(config)).await.expect("client connects");
        let mut admitted = 0;
        for i in 0..7 {
            let r = call(&client, "define", json!({ "word": format!("w{i}") })).await;
            if is_error(&r) {
                assert_eq!(error_code(&r), Some("rate_limited"), "{}", text(&r));
                break;
            }
            admitted += 1;
        }
        assert_eq!(admitted, 5, "{token} gets the whole burst of 5");
        client.cancel().await.expect("client closes");
    }
}

#[tokio::test]
async fn axum_example_answers_429_with_retry_after_and_ratelimit_headers() {
    let (_example, url) = start("axum_only").await;
    let http = reqwest::Client::new();
    for remaining in [2, 1, 0] {
        let response = http.get(&url).send().await.expect("GET /search");
        assert_eq!(response.status(), 200);
        let headers = response.headers();
        assert_eq!(headers["ratelimit-policy"], "\"http\";q=3;w=15");
        assert_eq!(headers["ratelimit-remaining"], remaining.to_string().as_str());
        assert_eq!(response.text().await.expect("body"), "results");
    }
    let refused = http.get(&url).send().await.expect("GET /search");
    assert_eq!(refused.status(), 429);
    let headers = refused.headers().clone();
    // One request comes back every 5 s: Retry-After says so in whole seconds.
    let retry_after: u64 = headers["retry-after"].to_str().expect("ascii").parse().expect("seconds");
    assert!((4..=5).contains(&retry_after), "Retry-After: {retry_after}");
    assert_eq!(headers["ratelimit-policy"], "\"http\";q=3;w=15");
    assert!(headers["ratelimit"].to_str().expect("ascii").starts_with("\"http\";r=0;t="), "{:?}", headers["ratelimit"]);
    let body: serde_json::Value = refused.json().await.expect("JSON-RPC error body");
    assert!(body["error"]["data"]["retry_after_ms"].as_u64().is_some_and(|ms| ms > 0 && ms <= 5_000), "{body}");
    // Another caller (by key) is not held back by the first one's budget.
    let other = http.get(&url).bearer_auth("someone-else").send().await.expect("GET /search");
    assert_eq!(other.status(), 200);
}

/// `examples/paid_api.rs` running, with the stand-in paid API it started: its MCP URL, and the
/// API's own knobs and counters, read from outside as a forker's operator would.
struct PaidApiExample {
    _example: Child,
    mcp: String,
    api: String,
    http: reqwest::Client,
}

impl PaidApiExample {
    async fn start(env: &[(&str, &str)]) -> Self {
        let (example, lines) = start_with("paid_api", env, 2).await;
        let api =
            lines[1].strip_prefix("paid API (stand-in) on ").unwrap_or_else(|| panic!("second line: {}", lines[1]));
        Self { _example: example, mcp: lines[0].clone(), api: api.to_owned(), http: reqwest::Client::new() }
    }

    /// An MCP client presenting `key` as its Bearer credential.
    async fn client(&self, key: &str) -> Client {
        let config = StreamableHttpClientTransportConfig::with_uri(self.mcp.clone()).auth_header(key);
        ().serve(StreamableHttpClientTransport::from_config(config)).await.expect("client connects")
    }

    /// The API's counters: `requests` that reached it, documents `held`, `last_retry_after`.
    async fn stats(&self) -> serde_json::Value {
        let stats = self.http.get(format!("{}/admin/stats", self.api)).send().await.expect("GET /admin/stats");
        stats.json().await.expect("stats JSON")
    }

    async fn requests(&self) -> u64 {
        self.stats().await["requests"].as_u64().expect("requests")
    }

    /// Turns one of the API's knobs (`/admin/outage`, `/admin/hold`) on or off.
    async fn knob(&self, path: &str, on: bool) {
        let url = format!("{}{path}", self.api);
        let request = if on { self.http.post(url) } else { self.http.delete(url) };
        let status = request.send().await.expect("knob answered").status();
        assert_eq!(status, 204, "{path}");
    }
}

/// The refusal's `retry_after_ms`.
fn retry_after_ms(r: &rmcp::model::CallToolResult) -> u64 {
    structured(r)["error"]["retry_after_ms"].as_u64().unwrap_or_else(|| panic!("no retry_after_ms: {}", text(r)))
}

/// What an agent reads: the wait in whole seconds, rounded up from `retry_after_ms`.
fn says_wait_of(r: &rmcp::model::CallToolResult) -> bool {
    let secs = retry_after_ms(r).div_ceil(1000);
    text(r).contains(&format!("Wait {secs} seconds"))
}

#[tokio::test]
async fn paid_api_example_shows_each_tools_price_in_its_description() {
    let example = PaidApiExample::start(&[]).await;
    let client = example.client("agent").await;
    let tools = client.list_all_tools().await.expect("tools/list");
    let described = |name: &str| {
        tools.iter().find(|t| t.name == name).and_then(|t| t.description.clone()).unwrap_or_default().to_string()
    };
    assert_eq!(described("translate"), "Translate a short text. Costs 1 token.");
    assert_eq!(described("translate_document"), "Translate a whole document (slow; one at a time). Costs 5 tokens.");
    client.cancel().await.expect("client closes");
}

#[tokio::test]
async fn paid_api_example_refuses_an_empty_caller_budget_then_the_tenants_with_the_wait() {
    let example = PaidApiExample::start(&[]).await;
    let began = std::time::Instant::now();
    let alice = example.client("acme-alice").await;
    for i in 0..10 {
        let r = call(&alice, "translate", json!({ "text": format!("hello {i}"), "to": "fr" })).await;
        assert!(!is_error(&r), "call {i} refused: {}", text(&r));
        assert_eq!(structured(&r)["translation"], format!("[fr] hello {i}"));
    }
    let refused = call(&alice, "translate", json!({ "text": "one too many", "to": "fr" })).await;
    let elapsed_ms = began.elapsed().as_millis() as u64;
    assert_eq!(error_code(&refused), Some("rate_limited"), "{}", text(&refused));
    let error = &structured(&refused)["error"];
    assert!(error["scope"].as_str().is_some_and(|s| s.starts_with("caller:tok:")), "{error}");
    assert_eq!((error["limit"].as_u64(), error["remaining"].as_u64()), (Some(10), Some(0)));
    // One token comes back every 20 s, counted from the first charge: the wait is 20 s less what
    // has refilled since, and this test measured an upper bound of that.
    let wait = retry_after_ms(&refused);
    assert!((20_000u64.saturating_sub(elapsed_ms)..=20_000).contains(&wait), "wait {wait} ms after {elapsed_ms} ms");
    assert!(says_wait_of(&refused), "{}", text(&refused));
    assert_eq!(example.requests().await, 10, "the refused call never reached the API");

    // Bob's own budget is full, but acme's 15 are down to 5.
    let bob = example.client("acme-bob").await;
    for i in 0..5 {
        let r = call(&bob, "translate", json!({ "text": format!("bonjour {i}"), "to": "en" })).await;
        assert!(!is_error(&r), "bob's call {i} refused: {}", text(&r));
    }
    let refused = call(&bob, "translate", json!({ "text": "bonjour 5", "to": "en" })).await;
    let elapsed_ms = began.elapsed().as_millis() as u64;
    assert_eq!(error_code(&refused), Some("rate_limited"), "{}", text(&refused));
    let error = &structured(&refused)["error"];
    assert_eq!(error["scope"], "tenant:acme");
    assert_eq!((error["limit"].as_u64(), error["remaining"].as_u64()), (Some(15), Some(0)));
    let wait = retry_after_ms(&refused);
    assert!((20_000u64.saturating_sub(elapsed_ms)..=20_000).contains(&wait), "wait {wait} ms after {elapsed_ms} ms");
    assert_eq!(example.requests().await, 15);
    alice.cancel().await.expect("client closes");
    bob.cancel().await.expect("client closes");
}

#[tokio::test]
async fn paid_api_example_answers_busy_while_the_callers_document_is_in_flight() {
    let example = PaidApiExample::start(&[]).await;
    // The API holds every document until released: the first call is in flight for as long as
    // the test says, not for as long as a sleep happens to last.
    example.knob("/admin/hold", true).await;
    let first = example.client("writer").await;
    let running = tokio::spawn(async move {
        let r = call(&first, "translate_document", json!({ "text": "chapter one", "to": "de" })).await;
        first.cancel().await.expect("client closes");
        r
    });
    for _ in 0..3000 {
        if example.stats().await["held"] == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(example.stats().await["held"], 1, "the first document reached the API and is held there");

    // The same caller from another session: its one slot is taken.
    let second = example.client("writer").await;
    let answer = tokio::time::timeout(
        Duration::from_secs(30),
        call(&second, "translate_document", json!({ "text": "chapter two", "to": "de" })),
    );
    let busy = answer.await.expect("answered at once, not held at the API");
    assert_eq!(error_code(&busy), Some("busy"), "{}", text(&busy));
    let scope = structured(&busy)["error"]["scope"].as_str().unwrap_or_default().to_owned();
    assert!(scope.starts_with("in_flight:caller:tok:"), "{scope}");
    assert_eq!(example.requests().await, 1, "the busy call never reached the API");

    example.knob("/admin/hold", false).await;
    let done = running.await.expect("the first call returns");
    assert!(!is_error(&done), "{}", text(&done));
    assert_eq!(structured(&done)["translation"], "[de] chapter one");
    // Its slot came back when it returned.
    let next = call(&second, "translate_document", json!({ "text": "chapter two", "to": "de" })).await;
    assert!(!is_error(&next), "{}", text(&next));
    assert_eq!(example.requests().await, 2);
    second.cancel().await.expect("client closes");
}

#[tokio::test]
async fn paid_api_example_stops_an_agent_repeating_the_same_call() {
    let example = PaidApiExample::start(&[]).await;
    let client = example.client("stuck-agent").await;
    let same = json!({ "text": "are we there yet", "to": "es" });
    for i in 0..4 {
        let r = call(&client, "translate", same.clone()).await;
        assert!(!is_error(&r), "repeat {i} refused: {}", text(&r));
    }
    let stopped = call(&client, "translate", same.clone()).await;
    assert_eq!(error_code(&stopped), Some("loop_detected"), "{}", text(&stopped));
    assert_eq!(example.requests().await, 4, "the fifth never reached the API");
    // An agent that changes its call is working, not stuck.
    let changed = call(&client, "translate", json!({ "text": "are we there yet?", "to": "es" })).await;
    assert!(!is_error(&changed), "{}", text(&changed));
    assert_eq!(example.requests().await, 5);
    client.cancel().await.expect("client closes");
}

#[tokio::test]
async fn paid_api_example_passes_on_the_apis_429_with_its_retry_after_and_never_retries() {
    // An account allowed 2 translations a minute.
    let example = PaidApiExample::start(&[("PAID_API_QUOTA", "2")]).await;
    let client = example.client("agent").await;
    for word in ["one", "two"] {
        let r = call(&client, "translate", json!({ "text": word, "to": "it" })).await;
        assert!(!is_error(&r), "{}", text(&r));
    }
    let limited = call(&client, "translate", json!({ "text": "three", "to": "it" })).await;
    assert_eq!(error_code(&limited), Some("upstream_rate_limited"), "{}", text(&limited));
    let stats = example.stats().await;
    let retry_after_s = stats["last_retry_after"].as_u64().expect("the API sent a Retry-After");
    assert!((1..=60).contains(&retry_after_s), "Retry-After: {retry_after_s}");
    // At least the API's Retry-After; this example passes it on as it is.
    assert_eq!(retry_after_ms(&limited), retry_after_s * 1000);
    assert!(says_wait_of(&limited), "{}", text(&limited));
    assert_eq!(stats["requests"], 3, "the 429 was not retried by the server");
    client.cancel().await.expect("client closes");
}

#[tokio::test]
async fn paid_api_example_breaker_opens_after_three_failures_and_refuses_without_calling_the_api() {
    let example = PaidApiExample::start(&[]).await;
    let client = example.client("agent").await;
    example.knob("/admin/outage", true).await;
    let mut opened_after = std::time::Instant::now();
    for i in 0..3 {
        opened_after = std::time::Instant::now();
        let r = call(&client, "translate", json!({ "text": format!("down {i}"), "to": "fr" })).await;
        assert_eq!(error_code(&r), Some("upstream_unavailable"), "{}", text(&r));
        assert!(text(&r).contains("it answered 503 Service Unavailable"), "{}", text(&r));
        assert_eq!(retry_after_ms(&r), 5_000);
    }
    assert_eq!(example.requests().await, 3);

    // Open: ten more calls of either tool, more than the 7 tokens the caller has left, are all
    // refused with the cool-down left, reach nothing, and are charged nothing.
    for i in 0..10 {
        let tool = if i % 2 == 0 { "translate" } else { "translate_document" };
        let r = call(&client, tool, json!({ "text": format!("still down {i}"), "to": "fr" })).await;
        let elapsed_ms = opened_after.elapsed().as_millis() as u64;
        assert_eq!(error_code(&r), Some("upstream_unavailable"), "call {i}: {}", text(&r));
        assert!(text(&r).contains("circuit breaker is open"), "{}", text(&r));
        let left = retry_after_ms(&r);
        assert!(
            (30_000u64.saturating_sub(elapsed_ms)..=30_000).contains(&left),
            "{left} ms left after {elapsed_ms} ms"
        );
        assert!(says_wait_of(&r), "{}", text(&r));
    }
    assert_eq!(example.requests().await, 3, "nothing reached the API while its breaker was open");
    client.cancel().await.expect("client closes");
}

#[tokio::test]
async fn paid_api_example_answers_429_before_any_json_once_a_caller_floods_it() {
    let example = PaidApiExample::start(&[]).await;
    let began = std::time::Instant::now();
    let post = |key: &'static str| {
        example
            .http
            .post(&example.mcp)
            .bearer_auth(key)
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .body("{}")
            .send()
    };
    let mut passed = 0;
    let refused = loop {
        let response = post("flood").await.expect("POST /mcp answered");
        if response.status() == 429 {
            break response;
        }
        passed += 1;
        assert!(passed <= 60, "never refused");
    };
    // 40 at once, then one every 5 s: exactly 40, plus what refilled while this test ran.
    let refilled = began.elapsed().as_secs() / 5;
    assert!((40..=40 + refilled).contains(&passed), "{passed} POSTs passed in {:?}", began.elapsed());
    let headers = refused.headers();
    let retry_after: u64 = headers["retry-after"].to_str().expect("ascii").parse().expect("seconds");
    assert!((1..=5).contains(&retry_after), "Retry-After: {retry_after}");
    assert_eq!(headers["ratelimit-policy"], "\"http\";q=40;w=200");
    assert_eq!(example.requests().await, 0, "nothing reached the API");
    // Another caller is not held back by the first one's flood.
    assert_ne!(post("someone-else").await.expect("POST /mcp answered").status(), 429);
}

#[tokio::test]
async fn paid_api_example_instances_on_one_redis_share_a_callers_budget() {
    let redis = test_redis::TestRedis::private();
    let on_redis = [("REDIS_URL", redis.url.as_str())];
    let (one, two) = (PaidApiExample::start(&on_redis).await, PaidApiExample::start(&on_redis).await);
    let (on_one, on_two) = (one.client("acme-alice").await, two.client("acme-alice").await);
    // Alice's 10 tokens, spent across both instances.
    for i in 0..10 {
        let client = if i % 2 == 0 { &on_one } else { &on_two };
        let r = call(client, "translate", json!({ "text": format!("hello {i}"), "to": "fr" })).await;
        assert!(!is_error(&r), "call {i} refused: {}", text(&r));
    }
    for client in [&on_one, &on_two] {
        let refused = call(client, "translate", json!({ "text": "one too many", "to": "fr" })).await;
        assert_eq!(error_code(&refused), Some("rate_limited"), "{}", text(&refused));
        assert_eq!(structured(&refused)["error"]["limit"], 10);
    }
    assert_eq!((one.requests().await, two.requests().await), (5, 5));
    on_one.cancel().await.expect("client closes");
    on_two.cancel().await.expect("client closes");
}
