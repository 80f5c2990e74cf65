//! Shedding under overload through MCP clients of both eras: when every call of an interval queued
//! longer than `server.shedding.target_ms` (told here by a trusted proxy's `X-Request-Start`, on a
//! manual clock), the lowest priority is refused first, with the wait and nothing charged, the
//! highest never; once calls are on time again, each priority comes back an interval apart.

use std::collections::HashMap;

use crate::common::*;
use crate::python;
use serde_json::{Value, json};

const CONFIG: &str = "[server]\ntrust_proxy = true\ntrusted_proxies = [\"127.0.0.1/32\"]\n\
    [tiers]\npro = 2.0\n[upstream.priority]\npro = 1\n[limits.address]\nburst = 600\nrefill_per_sec = 0.0001\n\
    [[auth.keys]]\nkey = \"free-key\"\ntenant = \"free\"\n\
    [[auth.keys]]\nkey = \"pro-key\"\ntenant = \"bigco\"\ntier = \"pro\"\n";

/// A 2025-11-25 client presenting `key` (or none) whose requests a proxy stamped as arriving at
/// `stamp` seconds on the server's clock (or none: they arrive as they reach the server).
async fn client(server: &TestServer, key: Option<&str>, stamp: Option<&str>) -> Client {
    use rmcp::ServiceExt;
    use rmcp::transport::StreamableHttpClientTransport;
    use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
    let mut config = StreamableHttpClientTransportConfig::with_uri(server.url.clone());
    if let Some(key) = key {
        config = config.auth_header(key);
    }
    if let Some(stamp) = stamp {
        let value = http::HeaderValue::from_str(&format!("t={stamp}")).expect("header");
        config = config.custom_headers(HashMap::from([(http::HeaderName::from_static("x-request-start"), value)]));
    }
    ().serve(StreamableHttpClientTransport::from_config(config)).await.expect("client connects")
}

async fn search(client: &Client, n: u32) -> rmcp::model::CallToolResult {
    call(client, "list_articles", json!({"query": format!("q{n}")})).await
}

fn shed_wait(r: &rmcp::model::CallToolResult) -> Option<u64> {
    let error = &structured(r)["error"];
    (error_code(r) == Some("busy") && error["scope"] == "server:overloaded")
        .then(|| error["retry_after_ms"].as_u64().expect("a wait"))
}

fn metric(metrics: &str, line_start: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(line_start).and_then(|rest| rest.trim().parse().ok()))
        .unwrap_or_else(|| panic!("no {line_start} in\n{metrics}"))
}

#[tokio::test]
async fn a_server_behind_refuses_the_lowest_priority_first_with_the_wait_and_never_the_highest_in_both_eras() {
    let server = TestServer::start(CONFIG).await;
    server.advance_ms(100_000);
    // Everything the proxy passes on was stamped at 99.7 s: each call has queued 300 ms and more.
    let late = Some("99.700");
    let anonymous = client(&server, None, late).await;
    let free = client(&server, Some("free-key"), late).await;
    let pro = client(&server, Some("pro-key"), late).await;
    let mut listed = 0;
    for (n, c) in [&anonymous, &free, &pro].into_iter().enumerate() {
        assert!(!is_error(&search(c, n as u32).await), "one interval behind is a burst, not overload");
        listed += 1;
    }

    // A whole interval behind: the unverified callers are refused first, for the rest of this
    // interval; configured keys go on.
    server.advance_ms(1000);
    let r = search(&anonymous, 10).await;
    assert_eq!(shed_wait(&r), Some(1000), "{}", text(&r));
    assert!(text(&r).contains("Nothing was charged"), "{}", text(&r));
    assert!(!is_error(&search(&free, 11).await));
    listed += 1;

    // Two intervals: the free tier too; pro, the highest, never.
    server.advance_ms(1000);
    let r = search(&free, 12).await;
    assert_eq!(shed_wait(&r), Some(1000), "{}", text(&r));
    assert_eq!(shed_wait(&search(&anonymous, 13).await), Some(2000), "two classes down: two intervals at least");
    assert!(!is_error(&search(&pro, 14).await));
    listed += 1;

    // The 2026-07-28 era (the Python SDK's default) and the 2025-11-25 one through its SDK alike.
    let steps = json!([{"op": "call", "tool": "list_articles", "args": {"query": "py"}, "check_schema": true}]);
    let stamp = ["-H", "X-Request-Start: t=99.700"];
    for (mode, key, shed) in [("auto", "free-key", true), ("auto", "pro-key", false), ("legacy", "free-key", true)] {
        let auth = format!("Authorization: Bearer {key}");
        let walked = python::walk(&server.url, mode, steps.clone(), &[stamp[0], stamp[1], "-H", &auth]).await;
        assert_eq!(walked["protocol_version"], python::era_of(mode), "{walked}");
        let answer = &walked["steps"][0]["ok"];
        assert_eq!(answer["is_error"], shed, "{mode} {key}: {walked}");
        if shed {
            assert_eq!(answer["structured"]["error"]["code"], "busy", "{walked}");
            assert_eq!(answer["structured"]["error"]["scope"], "server:overloaded", "{walked}");
            assert_eq!(answer["structured"]["error"]["retry_after_ms"], 1000, "{walked}");
        } else {
            listed += 1;
        }
    }

    let metrics = server.metrics().await;
    assert_eq!(metric(&metrics, "mcp_ratelimit_shed_level "), 2.0);
    assert!(metric(&metrics, "mcp_ratelimit_queueing_delay_seconds ") > 0.1, "{metrics}");
    assert_eq!(metric(&metrics, "mcp_ratelimit_shed_total{tier=\"default\",unverified=\"true\"} "), 2.0);
    assert_eq!(metric(&metrics, "mcp_ratelimit_shed_total{tier=\"default\",unverified=\"false\"} "), 3.0);
    // Nothing refused here reached the paid API.
    assert_eq!(server.upstream_usage().await["articles_listed"], listed, "only the calls that went on");

    // Calls on time again (straight from their clients): one priority back per interval.
    let free_direct = client(&server, Some("free-key"), None).await;
    assert!(shed_wait(&search(&free_direct, 20).await).is_some(), "still refused until the interval ends");
    server.advance_ms(1000);
    assert!(!is_error(&search(&free_direct, 21).await), "the free tier is back first");
    assert_eq!(shed_wait(&search(&anonymous, 22).await), Some(1000));
    server.advance_ms(1000);
    let anonymous_direct = client(&server, None, None).await;
    assert!(!is_error(&search(&anonymous_direct, 23).await), "then the unverified callers");
    let status = call(&anonymous_direct, "rate_limit_status", json!({})).await;
    let budgets = structured(&status)["budgets"].as_array().expect("budgets").clone();
    let address = budgets.iter().find(|b| b["scope"] == "address:ip:127.0.0.1").expect("address budget");
    let charged = |b: &Value| b["limit"].as_u64().unwrap_or(0) - b["remaining"].as_u64().unwrap_or(0);
    assert_eq!(
        charged(address),
        2,
        "the unverified callers were charged for the two calls that went on, not the 4 refused"
    );
    assert_eq!(metric(&server.metrics().await, "mcp_ratelimit_shed_level "), 0.0);
}

#[tokio::test]
async fn a_stamp_from_a_peer_that_is_not_a_trusted_proxy_cannot_make_the_server_shed() {
    let server = TestServer::start(&CONFIG.replace("127.0.0.1/32", "10.0.0.0/8")).await;
    server.advance_ms(100_000);
    // Whoever calls straight may write any X-Request-Start: it says nothing of the server.
    let liar = client(&server, None, Some("1.0")).await;
    for n in 0..5 {
        let r = search(&liar, n).await;
        assert!(!is_error(&r), "{}", text(&r));
        server.advance_ms(1000);
    }
    assert_eq!(metric(&server.metrics().await, "mcp_ratelimit_shed_level "), 0.0);
}
