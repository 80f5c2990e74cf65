//! Numbers a client can believe after a limit changes under it, through an MCP client: a budget
//! or an in-flight cap lowered by a live reload below what the caller has already used shows
//! nothing left (not a count wrapped around to 2^64), and refuses with the exact wait. The
//! server's clock is a `ManualClock` that starts at the Unix epoch, so an hour window ends at a
//! multiple of 3 600 s.

use crate::common::*;
use mcp_ratelimit::state::Reloaded;
use serde_json::json;

/// Nothing but the limit under test refuses: roomy HTTP, method and address budgets, no loop
/// detection, and the key the agent presents.
const ROOMY: &str = r#"
[limits.http]
burst = 100000
refill_per_sec = 1000.0
[limits.method.tools_call]
burst = 100000
refill_per_sec = 1000.0
[limits.address]
burst = 100000
refill_per_sec = 1000.0
[loop_detection]
enabled = false
[[auth.keys]]
key = "lowered-agent"
# A fixed video price, so a caller limit lowered to 40 (20 for a guest) still fits every cost.
[tools.generate_image_to_video]
cost = 20
"#;

const HOUR_MS: u64 = 3_600_000;

/// Puts `toml` (over [`ROOMY`]) in force on the running server, as SIGHUP would.
fn reload(server: &TestServer, toml: &str) {
    let config = mcp_ratelimit::Config::from_toml(&format!("{ROOMY}{toml}"), &mcp_ratelimit::mcp::tools::catalogue())
        .expect("a valid config");
    assert!(matches!(server.app.state().reload(&config), Reloaded::Applied { .. }));
}

/// [`call`], bounded: a server whose handler panicked (an overflow in a debug build) never
/// answers, and that must fail the test, not hang it.
async fn ask(client: &Client, tool: &str, args: serde_json::Value) -> rmcp::model::CallToolResult {
    tokio::time::timeout(std::time::Duration::from_secs(10), call(client, tool, args))
        .await
        .unwrap_or_else(|_| panic!("{tool}: no answer within 10 s (did the server panic?)"))
}

fn hourly_caller_budget(limit: u64) -> String {
    format!("[limits.caller]\nalgorithm = \"fixed_window\"\nlimit = {limit}\nwindow_ms = {HOUR_MS}\n")
}

#[tokio::test]
async fn a_window_lowered_below_what_was_spent_shows_nothing_left_and_refuses_until_it_ends() {
    let server = TestServer::start(&format!("{ROOMY}{}", hourly_caller_budget(100))).await;
    let agent = server.client(Some("lowered-agent")).await;
    for i in 0..50 {
        let r = ask(&agent, "list_articles", json!({"query": format!("q{i}")})).await;
        assert!(!is_error(&r), "call {i}: {}", text(&r));
    }
    server.advance_ms(600_000);
    reload(&server, &hourly_caller_budget(40));

    // 50 spent under a limit of 40: nothing left, until the hour's window ends in 50 minutes.
    let status = ask(&agent, "rate_limit_status", json!({})).await;
    let caller = budget(&status, "caller:");
    assert_eq!(caller["algorithm"], "fixed_window", "{caller}");
    assert_eq!((caller["limit"].as_u64(), caller["remaining"].as_u64()), (Some(40), Some(0)), "{caller}");
    assert_eq!(caller["reset_after_ms"], HOUR_MS - 600_000, "{caller}");

    let refused = ask(&agent, "list_articles", json!({"query": "one more"})).await;
    let error = &structured(&refused)["error"];
    assert_eq!(error["code"], "rate_limited", "{}", text(&refused));
    assert!(error["scope"].as_str().is_some_and(|s| s.starts_with("caller:")), "{error}");
    assert_eq!((error["limit"].as_u64(), error["remaining"].as_u64()), (Some(40), Some(0)), "{error}");
    assert_eq!(error["retry_after_ms"], HOUR_MS - 600_000, "exactly until the window ends: {error}");

    // The wait is exact: a millisecond short of it, still refused; at it, the new limit is whole.
    server.advance_ms(HOUR_MS - 600_000 - 1);
    let early = ask(&agent, "list_articles", json!({"query": "early"})).await;
    assert_eq!(structured(&early)["error"]["retry_after_ms"], 1, "{}", text(&early));
    server.advance_ms(1);
    assert!(!is_error(&ask(&agent, "list_articles", json!({"query": "on time"})).await));
    let status = ask(&agent, "rate_limit_status", json!({})).await;
    assert_eq!(budget(&status, "caller:")["remaining"], 39);
}

#[tokio::test]
async fn an_in_flight_cap_lowered_under_running_jobs_shows_none_left_and_refuses_busy() {
    let jobs_in_flight = |cap: u64| {
        format!(
            "[limits.caller]\nburst = 1000\nrefill_per_sec = 1.0\n[limits.in_flight]\ncaller = {cap}\ntenant = {cap}\n"
        )
    };
    let server = TestServer::start(&format!("{ROOMY}{}", jobs_in_flight(5))).await;
    let agent = server.client(Some("lowered-agent")).await;
    let mut jobs = Vec::new();
    for i in 0..3 {
        let r = ask(&agent, "generate_image", json!({"prompt": format!("fox {i}")})).await;
        assert!(!is_error(&r), "job {i}: {}", text(&r));
        jobs.push(structured(&r)["predict_id"].as_str().expect("a predict_id").to_owned());
    }
    let in_flight = |status: &rmcp::model::CallToolResult| {
        let slots = budget(status, "in_flight:caller:");
        (slots["limit"].as_u64(), slots["remaining"].as_u64())
    };
    assert_eq!(in_flight(&ask(&agent, "rate_limit_status", json!({})).await), (Some(5), Some(2)));

    // The clock stands still, so the three jobs keep running while the cap drops to one.
    reload(&server, &jobs_in_flight(1));
    assert_eq!(in_flight(&ask(&agent, "rate_limit_status", json!({})).await), (Some(1), Some(0)));
    let refused = ask(&agent, "generate_image", json!({"prompt": "a fourth"})).await;
    assert_eq!(error_code(&refused), Some("busy"), "{}", text(&refused));
    assert_eq!(structured(&refused)["error"]["remaining"], 0, "{}", text(&refused));

    // Two jobs end: the third still fills the whole new cap. The last one ends: one slot free.
    for id in &jobs[..2] {
        assert!(!is_error(&ask(&agent, "cancel_prediction", json!({"predict_id": id})).await));
    }
    assert_eq!(in_flight(&ask(&agent, "rate_limit_status", json!({})).await), (Some(1), Some(0)));
    assert!(!is_error(&ask(&agent, "cancel_prediction", json!({"predict_id": &jobs[2]})).await));
    assert_eq!(in_flight(&ask(&agent, "rate_limit_status", json!({})).await), (Some(1), Some(1)));
    assert!(!is_error(&ask(&agent, "generate_image", json!({"prompt": "now it fits"})).await));
}
