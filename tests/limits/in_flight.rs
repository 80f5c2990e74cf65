//! In-flight slots (the `concurrency` algorithm) through the MCP interface: a caller over its
//! cap is told it is `busy`, and a slot comes back however the call ends — finished, failed or
//! cancelled.

use std::sync::Arc;

use crate::common::*;
use mcp_ratelimit::clock::ManualClock;
use mcp_ratelimit::config::LimitsConfig;
use mcp_ratelimit::guard::{Admitted, Call, Called, Guard, Worked};
use mcp_ratelimit::identity::Caller;
use mcp_ratelimit::mcp::limited::{Plain, ToolAnswer};
use mcp_ratelimit::ops::metrics::Metrics;
use mcp_ratelimit::store::MemoryStore;
use rmcp::model::{CallToolRequestParams, CallToolResponse, CallToolResult, ClientRequest, Request};
use rmcp::service::PeerRequestOptions;
use serde_json::json;

/// The caller's budget is two calls in flight; every tool costs one slot.
fn two_slots(mock: &str) -> String {
    format!(
        "[limits.caller]\nalgorithm = \"concurrency\"\nmax_in_flight = 2\n\
         [tools.save_article]\ncost = 1\n[tools.generate_image]\ncost = 1\n\
         [tools.generate_image_to_video]\ncost = 1\n{NO_LOOP_DETECTION}[mock_upstream]\n{mock}\n"
    )
}

async fn in_flight_left(client: &Client) -> u64 {
    let status = call(client, "rate_limit_status", json!({})).await;
    budget(&status, "caller:")["remaining"].as_u64().expect("remaining")
}

/// Waits (bounded) for an asynchronous effect on the server to show in `rate_limit_status`.
async fn until_remaining(client: &Client, want: u64) {
    eventually(&format!("remaining reaches {want}"), || async { in_flight_left(client).await == want }).await;
}

#[tokio::test]
async fn fan_out_beyond_the_cap_is_busy_and_finished_calls_give_slots_back() {
    use futures::StreamExt;
    let server = TestServer::start(&two_slots("")).await;
    let client = server.client(Some("fan-out")).await;
    // The mock holds every request at its gate: the two admitted calls stay in flight, on no clock,
    // until the test opens it.
    server.chaos(json!({"hold": true})).await;
    let mut calls: futures::stream::FuturesUnordered<_> =
        (0..4).map(|_| call(&client, "list_articles", json!({}))).collect();
    // Only refusals can come back while the gate is shut: the first two answers are both `busy`.
    let mut busy = Vec::new();
    for _ in 0..2 {
        busy.push(calls.next().await.expect("an answer"));
    }
    for refused in &busy {
        assert_eq!(error_code(refused), Some("busy"), "{}", text(refused));
    }
    let error = &structured(&busy[0])["error"];
    assert_eq!(error["limit"], 2);
    assert!(text(&busy[0]).contains("calls in flight to return"), "busy says what frees a slot: {}", text(&busy[0]));

    server.chaos(json!({"hold": false})).await;
    let served: Vec<_> = calls.collect().await;
    assert_eq!(served.len(), 2);
    assert!(served.iter().all(|r| !is_error(r)), "the two held calls finish once the gate opens");
    assert_eq!(in_flight_left(&client).await, 2, "both slots back once the calls finished");
    assert!(!is_error(&call(&client, "list_articles", json!({})).await));
}

#[tokio::test]
async fn a_failed_call_gives_its_slot_back() {
    let server = TestServer::start(&two_slots("rate_5xx = 1.0")).await;
    let client = server.client(Some("unlucky")).await;
    for _ in 0..5 {
        let r = call(&client, "list_articles", json!({})).await;
        assert_eq!(error_code(&r), Some("upstream_unavailable"), "never busy: {}", text(&r));
    }
    assert_eq!(in_flight_left(&client).await, 2);
}

#[tokio::test]
async fn a_cancelled_call_gives_its_slot_back() {
    let server = TestServer::start(&two_slots("")).await;
    let client = server.client(Some("impatient")).await;
    // Held at the mock's gate, the call stays in flight until it is cancelled.
    server.chaos(json!({"hold": true})).await;
    let params = CallToolRequestParams::new("list_articles").with_arguments(serde_json::Map::new());
    let request = ClientRequest::CallToolRequest(Request::new(params));
    let handle =
        client.peer().send_cancellable_request(request, PeerRequestOptions::no_options()).await.expect("request sent");
    until_remaining(&client, 1).await;
    handle.cancel(Some("changed my mind".into())).await.expect("cancel sent");
    until_remaining(&client, 2).await;
}

#[tokio::test]
async fn a_dropped_admission_gives_its_slot_back_even_when_its_task_is_aborted() {
    let config = LimitsConfig::from_toml(&two_slots(""), &mcp_ratelimit::mcp::tools::catalogue()).expect("config");
    let metrics = Arc::new(Metrics::new(&mcp_ratelimit::mcp::tools::catalogue()));
    let clock = ManualClock::new();
    let guard = Guard::new(Arc::new(MemoryStore::on(clock.clone())), clock, &config, metrics.clone());
    let caller = Caller::from_token("holder");
    let args = json!({"title": "t", "body": "b"});
    let args = args.as_object().expect("an object");
    // Each call's work takes its admission away, as a job does, and holds it.
    let save = || async {
        let call = Call::new("save_article", &caller, args);
        let mut held = None;
        let work = |admitted: Admitted<()>, _: &serde_json::Value| {
            held = admitted.admission.take();
            std::future::ready(Worked::Answer(ToolAnswer::new(Ok(CallToolResponse::Complete(
                CallToolResult::success(vec![]),
            )))))
        };
        match guard.call(&Plain, None, call, work).await {
            Called::Refused(refusal) => Err(refusal),
            _ => Ok(held.expect("the work took the admission")),
        }
    };

    let _first = save().await.expect("first slot");
    let admission = save().await.expect("second slot");
    assert!(metrics.render().contains("mcp_ratelimit_in_flight_calls 2"));
    assert_eq!(save().await.err().map(|r| r.code.as_str()), Some("busy"));
    let holder = tokio::spawn(async move {
        let _held = admission;
        std::future::pending::<()>().await;
    });
    holder.abort();
    assert!(holder.await.is_err_and(|e| e.is_cancelled()));
    let _again = save().await.expect("slot released by the aborted task");
    assert!(metrics.render().contains("mcp_ratelimit_in_flight_calls 2"));
}

/// A slot cap in `mode = "shadow"` that would have refused took no slot, so the call it let
/// through gives none back when it ends: the cap keeps counting the calls that do hold one.
#[tokio::test]
async fn a_shadow_slot_cap_that_would_refuse_takes_no_slot_and_gives_none_back() {
    let config = format!(
        "[limits.caller]\nalgorithm = \"concurrency\"\nmax_in_flight = 1\nmode = \"shadow\"\n\
         [tools.generate_image]\ncost = 1\n[tools.save_article]\ncost = 1\n{NO_LOOP_DETECTION}{ROOMY_IN_FLIGHT}"
    );
    let server = TestServer::start(&config).await;
    let client = server.client(Some("shadowed-jobs")).await;
    let shadow_refused = |metrics: &str| {
        metrics
            .lines()
            .filter(|l| l.contains("outcome=\"shadow_refused\"") && l.contains("tool=\"generate_image\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    // The jobs run on the manual clock, which never moves here: each holds what it took.
    let image = |n: u32| call(&client, "generate_image", json!({ "prompt": format!("image {n}") }));
    let first = image(1).await;
    assert!(!is_error(&first), "{}", text(&first));
    let second = image(2).await;
    assert!(!is_error(&second), "a shadow cap lets the call through: {}", text(&second));
    assert_eq!(shadow_refused(&server.metrics().await), 1.0, "and counts the refusal it would have made");
    // The second job ends first. It held no slot, so it gives none back: the first still holds
    // the only one, and a third job is counted as over the cap again.
    let id = structured(&second)["predict_id"].as_str().expect("predict_id").to_owned();
    let cancelled = call(&client, "cancel_prediction", json!({ "predict_id": id })).await;
    assert_eq!(structured(&cancelled)["status"], "canceled", "{}", text(&cancelled));
    assert_eq!(in_flight_left(&client).await, 0, "the first job's slot is still held");
    let third = image(3).await;
    assert!(!is_error(&third), "{}", text(&third));
    assert_eq!(shadow_refused(&server.metrics().await), 2.0, "the third would have been refused too");
}

#[tokio::test]
async fn a_tool_configured_to_hold_a_slot_holds_one_until_it_returns() {
    use futures::StreamExt;
    // list_articles is no job; `holds_slot` makes each call take one of the caller's slots.
    let config = format!(
        "[tools.list_articles]\ncost = 1\nholds_slot = true\n[limits.in_flight]\ncaller = 1\n{NO_LOOP_DETECTION}"
    );
    let server = TestServer::start(&config).await;
    let client = server.client(Some("holder")).await;
    // The mock holds every request at its gate: the admitted call stays in flight.
    server.chaos(json!({"hold": true})).await;
    let mut calls: futures::stream::FuturesUnordered<_> =
        ["a", "b"].into_iter().map(|q| call(&client, "list_articles", json!({"query": q}))).collect();
    let refused = calls.next().await.expect("an answer");
    assert_eq!(error_code(&refused), Some("busy"), "the other call holds the one slot: {}", text(&refused));
    assert!(structured(&refused)["error"]["scope"].as_str().is_some_and(|s| s.starts_with("in_flight:caller")));
    server.chaos(json!({"hold": false})).await;
    let held = calls.next().await.expect("the held call");
    assert!(!is_error(&held), "the held call finishes once the gate opens: {}", text(&held));
    drop(calls);
    assert!(!is_error(&call(&client, "list_articles", json!({"query": "c"})).await), "its slot came back");
}
