//! The examples in `examples/`, run as a user runs them (`cargo run --example …`) and driven
//! from outside: an MCP client against the rmcp example, plain HTTP against the axum one.

mod common;

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Mutex;
use std::time::Duration;

use common::{call, error_code, is_error, structured, text};
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
    let mut child = Command::new(example(name))
        .env("LISTEN", "127.0.0.1:0")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start examples/{name}: {e}"));
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .expect("the example prints its address")
        .expect("stdout readable")
        .expect("a line");
    let url = line.strip_prefix("listening on ").unwrap_or_else(|| panic!("unexpected first line: {line}"));
    (child, url.to_owned())
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
