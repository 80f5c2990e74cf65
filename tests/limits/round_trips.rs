//! What a call costs in Redis, through MCP clients of both eras: the calls a server makes at one
//! moment travel to Redis together (`crates/redis/src/batch.rs`), and a busy caller's budgets are
//! spent from the slices this instance holds (`crates/redis/src/slices.rs`), Redis reading only
//! what must be read there per call: the caller's blocks and loop history. And, at the store
//! itself, how many calls one round trip carries at most, each with its own answer.

use crate::common::*;
use crate::python;
use crate::test_redis::TestRedis;
use serde_json::{Value, json};

/// A caller token no other test (or run) uses.
fn token(name: &str) -> String {
    format!("{name}-{:016x}", rand::random::<u64>())
}

/// Redis as the store, budgets that do not refill while a test runs (a bucket refilled faster
/// than it is spent lends no slice), answers not compared.
fn config(redis: &TestRedis) -> String {
    format!(
        "[store]\nbackend = \"redis\"\nredis_url = \"{}\"\ntimeout_ms = 500\n\
         [limits.caller]\nrefill_per_sec = 0.001\n[limits.http]\nrefill_per_sec = 0.1\n\
         [limits.address_http]\nrefill_per_sec = 0.1\n{NO_PROGRESS_CHECK}",
        redis.url
    )
}

/// `mcp_ratelimit_store_round_trips_total` and `mcp_ratelimit_store_commands_total`.
fn traffic(metrics: &str) -> (u64, u64) {
    let read = |name: &str| {
        let line = metrics.lines().find_map(|line| line.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')));
        line.and_then(|value| value.trim().parse::<f64>().ok()).map_or(0, |value| value as u64)
    };
    (read("mcp_ratelimit_store_round_trips_total"), read("mcp_ratelimit_store_commands_total"))
}

/// Twelve agents calling at the same moment: their scripts go to Redis in shared round trips,
/// as the store's own counters say.
#[tokio::test]
async fn calls_made_at_one_moment_share_their_round_trips_to_redis() {
    let redis = TestRedis::private();
    let server = TestServer::start(&config(&redis)).await;
    let mut clients = Vec::new();
    for n in 0..12 {
        clients.push(server.client(Some(&token(&format!("together{n}")))).await);
    }
    let before = traffic(&server.metrics().await);
    for round in 0..4 {
        // Made-up tokens are callers of one address, whose loop history they share: each asks
        // its own query.
        let calls = clients
            .iter()
            .enumerate()
            .map(|(n, client)| call(client, "list_articles", json!({"query": format!("round {round} of caller {n}")})));
        for answer in futures::future::join_all(calls).await {
            assert!(!is_error(&answer), "{}", text(&answer));
        }
    }
    let after = traffic(&server.metrics().await);
    let (trips, commands) = (after.0 - before.0, after.1 - before.1);
    // Each call's decision and its answer's loop history: two scripts at least.
    assert!(commands >= 12 * 4 * 2, "{commands} commands for 48 calls");
    assert!(trips * 2 <= commands, "{trips} round trips carried {commands} commands: calls made together go together");
    // The target: at most one round trip a served call, on average.
    assert!(trips <= 12 * 4, "{trips} round trips for 48 served calls");
}

/// A busy 2026-07-28 caller (the Python SDK's default era, no session): its HTTP and method
/// budgets come from slices, so a served call costs the script of its own decision (blocks and
/// loop check) and its answer's, and `rate_limit_status` shows what this instance holds.
#[tokio::test]
async fn a_busy_stateless_callers_calls_cost_two_scripts_and_its_status_shows_what_is_held_here() {
    let redis = TestRedis::private();
    let server = TestServer::start(&config(&redis)).await;
    let auth = format!("Authorization: Bearer {}", token("stateless"));
    let calls = 40;
    let mut steps: Vec<Value> = (0..calls)
        .map(|n| json!({"op": "call", "tool": "list_articles", "args": {"query": format!("q{n}")}}))
        .collect();
    steps.push(json!({"op": "call", "tool": "rate_limit_status", "args": {}}));
    let before = redis.evalsha_calls();
    let walked = python::walk(&server.url, "auto", Value::Array(steps), &["-H", &auth]).await;
    let scripts = redis.evalsha_calls() - before;
    assert_eq!(walked["protocol_version"], python::era_of("auto"), "{walked}");
    assert!(python::all_ok(&walked), "{walked}");
    let steps = walked["steps"].as_array().expect("steps");
    for (n, step) in steps.iter().take(calls).enumerate() {
        assert_eq!(step["ok"]["is_error"], json!(false), "call {n}: {step}");
    }
    // Without slices each call's HTTP limits would be a third script: over 120 in all.
    assert!(scripts <= 2 * calls as u64 + 12, "{scripts} scripts for {calls} calls and a status read");
    let status = &steps[calls]["ok"]["structured"];
    let budgets = status["budgets"].as_array().cloned().unwrap_or_default();
    let held = budgets.iter().filter_map(|budget| budget["held_here"].as_u64()).max().unwrap_or(0);
    assert!(held > 0, "a budget shows the slice held here: {status}");
}

/// Two hundred decisions of one exact budget made at the same instant: one pipeline carries at
/// most 64 of them, and each gets its own answer (the `remaining` of the admitted ones are every
/// count from 149 down to 0, once each).
#[tokio::test]
async fn a_round_trip_carries_at_most_64_calls_and_each_its_own_answer() {
    use mcp_ratelimit::clock::Nanos;
    use mcp_ratelimit::limit::{FixedWindow, Limiter};
    use mcp_ratelimit::store::{Budgets, Check, Lease, RedisStore, Store, Verdict};

    let redis = TestRedis::private();
    let store = RedisStore::connect(&redis.url, std::time::Duration::from_secs(5)).await.expect("connects").shared();
    let limiter = Limiter::FixedWindow(FixedWindow::new(150, Nanos::from_secs(3_600)));
    let decide = |key: &'static str| {
        let (store, limiter) = (store.clone(), limiter.clone());
        async move {
            let check = Check { key, limiter: &limiter, cost: 1, shadow: false };
            match Budgets::decide(&*store, &[check], &[], Lease::new()).await {
                Ok(Verdict::Decided(decisions)) => decisions[0],
                other => panic!("not decided: {other:?}"),
            }
        }
    };
    // The script loaded first, so what is counted below is the decisions alone.
    decide("batch:warm").await;
    let before = store.traffic();
    let decisions = futures::future::join_all((0..200).map(|_| decide("batch:exact"))).await;
    let (trips, commands) = (store.traffic().0 - before.0, store.traffic().1 - before.1);
    assert_eq!(commands, 200, "one script a decision");
    assert!(trips >= 200_u64.div_ceil(64), "{trips} round trips carried 200 commands: at most 64 go together");
    assert!(trips <= 20, "{trips} round trips for 200 calls made at one instant");
    let mut remaining: Vec<u64> = decisions.iter().filter(|d| d.allowed).map(|d| d.remaining).collect();
    remaining.sort_unstable();
    assert_eq!(remaining, (0..150).collect::<Vec<u64>>(), "150 admitted, each told its own count");
}
