//! Who a caller is, through the public interface: caller ids keyed with `auth.id_secret` (the
//! same key is the same caller on every instance sharing the secret, and its budgets follow it),
//! and IPv4 clients of a dual-stack listener named and trusted by their IPv4 address.

use std::process::Command;
use std::sync::Arc;

use crate::common::*;
use mcp_ratelimit::clock::ManualClock;
use mcp_ratelimit::identity::Caller;
use mcp_ratelimit::{App, Config};
use serde_json::json;

const SECRET: &str = "id-secret-shared-by-instances-42";
const KEY: &str = "sk-short-1";

fn with_secret(secret: &str) -> String {
    format!("[auth]\nid_secret = \"{secret}\"\n")
}

/// The caller id the server shows `client` (the scope of its own caller budget).
async fn shown_id(client: &Client) -> String {
    let status = call(client, "rate_limit_status", json!({})).await;
    let scope = budget(&status, "caller:")["scope"].as_str().expect("scope").to_owned();
    scope.strip_prefix("caller:").expect("caller scope").to_owned()
}

#[tokio::test]
async fn one_key_is_one_caller_on_every_server_with_the_same_id_secret() {
    let a = TestServer::start(&with_secret(SECRET)).await;
    let b = TestServer::start(&with_secret(SECRET)).await;
    let on_a = shown_id(&a.client(Some(KEY)).await).await;
    let on_b = shown_id(&b.client(Some(KEY)).await).await;
    assert!(on_a.starts_with("tok:") && on_a.len() == 20, "{on_a}");
    assert_eq!(on_a, on_b, "instances sharing the secret name the key alike");

    let unkeyed = Caller::from_token(KEY).id().to_owned();
    assert_ne!(on_a, unkeyed, "not the first 16 hex digits of SHA-256(key), which a guess can be tested against");
    let plain = TestServer::start("").await;
    assert_eq!(shown_id(&plain.client(Some(KEY)).await).await, unkeyed, "without a secret: the unkeyed id");
    let other = TestServer::start(&with_secret("another-secret-of-enough-length")).await;
    let on_other = shown_id(&other.client(Some(KEY)).await).await;
    assert!(on_other != on_a && on_other != unkeyed, "another secret, another id: {on_other}");
}

#[tokio::test]
async fn a_keys_own_caller_budget_holds_with_an_id_secret() {
    let config = format!(
        "{}{NO_LOOP_DETECTION}[[auth.keys]]\nkey = \"{KEY}\"\n[auth.keys.caller]\nalgorithm = \"token_bucket\"\n\
         burst = 20\nrefill_per_sec = 0.001\n[[auth.keys]]\nkey = \"plain-key\"\n\
         [tools.generate_image_to_video]\ncost = 20\n",
        with_secret(SECRET)
    );
    let server = TestServer::start(&config).await;
    let own = server.client(Some(KEY)).await;
    let (admitted, refusal) = spend_until_refused(&own, "list_articles", json!({}), 100).await;
    // 20: its own burst (every tool's cost must fit it), not the tier's 60.
    assert_eq!(admitted, 20, "the key's own budget, found under its keyed id");
    let id = shown_id(&own).await;
    assert_eq!(structured(&refusal)["error"]["scope"], format!("caller:{id}"));
    assert_ne!(id, Caller::from_token(KEY).id());
    let plain = server.client(Some("plain-key")).await;
    let (admitted, _) = spend_until_refused(&plain, "list_articles", json!({}), 100).await;
    assert_eq!(admitted, 60, "other keys keep the tier's budget");
}

fn check_config(env: &[(&str, &str)]) -> (bool, String) {
    let file = tempfile::NamedTempFile::new().expect("an empty config file");
    let mut command = Command::new(env!("CARGO_BIN_EXE_mcp-ratelimit"));
    command.arg("check-config").arg(file.path());
    for (k, v) in env {
        command.env(k, v);
    }
    let out = command.output().expect("binary runs");
    let printed = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), printed)
}

#[test]
fn the_id_secret_comes_from_the_environment_and_is_checked_there_too() {
    let (ok, printed) = check_config(&[("MCP_RL__AUTH__ID_SECRET", SECRET)]);
    assert!(ok, "{printed}");
    assert!(printed.contains("caller ids: keyed (auth.id_secret)") && !printed.contains(SECRET), "{printed}");
    let (ok, printed) = check_config(&[("MCP_RL__AUTH__ID_SECRET", "short-secret")]);
    assert!(!ok, "{printed}");
    assert!(printed.contains("auth.id_secret") && !printed.contains("short-secret"), "{printed}");
    let (ok, printed) = check_config(&[]);
    assert!(ok && printed.contains("caller ids: unkeyed SHA-256"), "{printed}");
}

/// The scope of the caller budget `rate_limit_status` reports over a raw session.
async fn raw_caller_scope(session: &RawSession) -> String {
    let request = json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": {"name": "rate_limit_status", "arguments": {}}});
    let (status, _, body) = session.post(request).await;
    assert_eq!(status, 200, "{body}");
    let reply = jsonrpc_of(&body);
    let budgets = reply["result"]["structuredContent"]["budgets"].as_array().cloned().unwrap_or_default();
    let scope = budgets.iter().filter_map(|b| b["scope"].as_str()).find(|s| s.starts_with("caller:"));
    scope.map(str::to_owned).unwrap_or_else(|| panic!("no caller budget: {reply}"))
}

#[tokio::test]
async fn an_ipv4_client_of_a_dual_stack_listener_is_named_and_trusted_by_its_ipv4_address() {
    let config =
        Config::from_toml("[server]\ntrust_proxy = true\n", &mcp_ratelimit::mcp::tools::catalogue()).expect("config");
    let app = Arc::new(App::start(config, ManualClock::new()).await.expect("server starts"));
    // Every address, IPv4 too (as ::ffff:a.b.c.d), on one IPv6 socket.
    let listener = tokio::net::TcpListener::bind("[::]:0").await.expect("bind [::]");
    let port = listener.local_addr().expect("addr").port();
    let serving = app.clone();
    tokio::spawn(async move { serving.serve_http(listener).await });
    let url = format!("http://127.0.0.1:{port}/mcp");

    // The peer is ::ffff:127.0.0.1: the trusted proxy 127.0.0.1/8, so its forwarded client counts.
    let mut proxied = RawSession::new(&url, &[("x-forwarded-for", "203.0.113.7")]);
    assert_eq!(proxied.open().await, (200, 202));
    assert_eq!(raw_caller_scope(&proxied).await, "caller:ip:203.0.113.7");
    // Without a forwarded hop the caller is the peer, by its IPv4 address.
    let mut direct = RawSession::new(&url, &[]);
    assert_eq!(direct.open().await, (200, 202));
    assert_eq!(raw_caller_scope(&direct).await, "caller:ip:127.0.0.1");
    app.stop();
}
