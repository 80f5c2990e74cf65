//! Protecting the paid upstream from the server, through an MCP client on a manual clock: the
//! spaced video queue, backoff that honours Retry-After, giving up with the reason, the circuit
//! breaker, and agent-visible calls that are never retried by the server.

use crate::common::*;
use mcp_ratelimit::clock::NANOS_PER_SEC;
use serde_json::{Value, json};

const GAP_SECS: u64 = 2;

fn video(prompt: &str) -> Value {
    json!({"image_url": "https://example.com/first-frame.png", "prompt": prompt})
}

async fn until_submissions(server: &TestServer, n: usize) -> Vec<(u64, u16, String)> {
    eventually(&format!("{n} submissions reached the upstream"), || async { server.submissions().await.len() >= n })
        .await;
    server.submissions().await
}

#[tokio::test]
async fn three_callers_videos_reach_the_upstream_spaced_by_the_gap_in_arrival_order() {
    let server = TestServer::start("[upstream]\nvideo_min_gap_ms = 2000\nvideo_poll_seconds = 10\n").await;
    let mut ids = Vec::new();
    let mut hints = Vec::new();
    for who in ["ann", "bob", "cy"] {
        let client = server.client(Some(who)).await;
        let r = call(&client, "generate_image_to_video", video(who)).await;
        assert!(!is_error(&r), "{}", text(&r));
        ids.push(structured(&r)["predict_id"].as_str().expect("id").to_owned());
        hints.push(structured(&r)["next_poll_in_seconds"].as_u64().expect("hint"));
    }
    // The hint covers the wait in the queue: 0, 1 and 2 gaps, then the poll hint.
    assert_eq!(hints, vec![10, 10 + GAP_SECS, 10 + 2 * GAP_SECS]);

    let cy = server.client(Some("cy")).await;
    let r = call(&cy, "get_prediction", json!({"predict_id": ids[2]})).await;
    assert_eq!(structured(&r)["status"], "starting");
    assert_eq!(structured(&r)["queue_position"], 2, "bob's video is ahead");
    assert_eq!(structured(&r)["next_poll_in_seconds"], 10 + 2 * GAP_SECS);
    assert!(text(&r).contains("2nd in the queue"), "{}", text(&r));
    assert_eq!(server.upstream_usage().await["polls"], 0, "a queued job is not polled upstream");

    until_submissions(&server, 1).await;
    server.advance_ms(GAP_SECS * 1000 - 1);
    settle().await;
    assert_eq!(server.submissions().await.len(), 1, "nothing before the gap has passed");
    server.advance_ms(1);
    until_submissions(&server, 2).await;
    server.advance_secs(GAP_SECS as f64);
    let log = until_submissions(&server, 3).await;

    let keys: Vec<&str> = log.iter().map(|s| s.2.as_str()).collect();
    assert_eq!(keys, ids.iter().map(String::as_str).collect::<Vec<_>>(), "in arrival order");
    let gaps: Vec<u64> = log.windows(2).map(|w| w[1].0 - w[0].0).collect();
    assert_eq!(gaps, vec![GAP_SECS * NANOS_PER_SEC; 2], "exactly the gap apart");
    let metrics = server.metrics().await;
    assert!(metrics.contains("mcp_ratelimit_account_slots_in_use 3"), "{metrics}");
    assert_eq!(metric_sum(&metrics, "mcp_ratelimit_queue_depth"), 0.0, "{metrics}");
}

#[tokio::test]
async fn a_full_video_queue_is_busy_with_the_wait_and_charges_nothing() {
    let config = "[upstream]\nvideo_min_gap_ms = 10000\nvideo_queue_max = 2\n\
                  [tools.generate_image_to_video]\ncost = 1\n[loop_detection]\nenabled = false\n";
    let server = TestServer::start(config).await;
    let client = server.client(Some("fan-out")).await;
    for i in 0..3 {
        let r = call(&client, "generate_image_to_video", video(&format!("v{i}"))).await;
        assert!(!is_error(&r), "{}", text(&r));
    }
    until_submissions(&server, 1).await;
    server.advance_secs(4.0);
    let before = call(&client, "rate_limit_status", json!({})).await;
    let full = call(&client, "generate_image_to_video", video("one too many")).await;
    assert_eq!(error_code(&full), Some("busy"));
    let error = &structured(&full)["error"];
    assert_eq!(error["retry_after_ms"], 6000, "the head of the queue leaves in 6 s");
    assert!(text(&full).contains("Wait 6 seconds"), "{}", text(&full));
    let status = call(&client, "rate_limit_status", json!({})).await;
    assert_eq!(budget(&status, "caller:"), budget(&before, "caller:"), "the refused call cost nothing");
    assert_eq!(structured(&status)["upstream_queue"]["videos_waiting"], 2);

    // An obedient agent that waits as told gets in.
    server.advance_secs(6.0);
    until_submissions(&server, 2).await;
    assert!(!is_error(&call(&client, "generate_image_to_video", video("now")).await));
}

#[tokio::test]
async fn a_429_with_retry_after_is_not_retried_before_it_and_the_retry_keeps_its_place() {
    let server = TestServer::start("[mock_upstream]\nrate_429 = 1.0\nretry_after_seconds = 3\n").await;
    let client = server.client(Some("patient")).await;
    let r = call(&client, "generate_image_to_video", video("dawn")).await;
    assert!(!is_error(&r), "accepted into the queue: {}", text(&r));
    let id = structured(&r)["predict_id"].as_str().expect("id").to_owned();
    until_submissions(&server, 1).await;

    server.advance_ms(2900);
    settle().await;
    assert_eq!(server.submissions().await.len(), 1, "Retry-After: 3 is a floor");
    let r = call(&client, "get_prediction", json!({"predict_id": id})).await;
    assert_eq!(structured(&r)["status"], "starting");

    server.chaos(json!({"rate_429": 0.0})).await;
    server.advance_ms(100);
    let log = until_submissions(&server, 2).await;
    assert_eq!(log[1].0 - log[0].0, 3 * NANOS_PER_SEC, "retried exactly at the floor");
    assert_eq!((log[0].1, log[1].1), (429, 201));
    assert_eq!(log[0].2, log[1].2, "the retry carries the same idempotency key");
    let metrics = server.metrics().await;
    assert!(
        metrics.contains(r#"mcp_ratelimit_upstream_retries_total{work="submission",reason="rate_limited"} 1"#),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_submission_gives_up_after_max_attempts_and_the_job_fails_with_the_reason() {
    // No spacing, so only the backoff decides when the attempts go.
    let config = "[upstream]\nmax_attempts = 3\nvideo_min_gap_ms = 0\nretry_budget_min_retries = 5\n\
                  [mock_upstream]\nrate_5xx = 1.0\n";
    let server = TestServer::start(config).await;
    let client = server.client(Some("doomed")).await;
    let r = call(&client, "generate_image_to_video", video("never")).await;
    let id = structured(&r)["predict_id"].as_str().expect("id").to_owned();
    until_submissions(&server, 1).await;
    // Backoff: 500 ms then 1 s (±20 %); 1.2 s and 2.4 s cover the jitter.
    server.advance_ms(600);
    until_submissions(&server, 2).await;
    server.advance_ms(1200);
    until_submissions(&server, 3).await;
    eventually("the job failed", || async {
        let r = call(&client, "get_prediction", json!({"predict_id": id})).await;
        structured(&r)["status"] == "failed"
    })
    .await;
    let r = call(&client, "get_prediction", json!({"predict_id": id})).await;
    let reason = structured(&r)["error"].as_str().expect("reason").to_owned();
    assert!(reason.contains("3 attempts") && reason.contains("503"), "{reason}");
    server.advance_secs(120.0);
    settle().await;
    assert_eq!(server.submissions().await.len(), 3, "no attempt after giving up");
    let status = call(&client, "rate_limit_status", json!({})).await;
    assert_eq!(budget(&status, "in_flight:caller:")["remaining"], 5, "the failed job's slot came back");
}

#[tokio::test]
async fn a_retry_after_longer_than_the_maximum_fails_the_job_at_once() {
    let config =
        "[upstream]\nmax_retry_after_ms = 60000\n[mock_upstream]\nrate_429 = 1.0\nretry_after_seconds = 3600\n";
    let server = TestServer::start(config).await;
    let client = server.client(Some("parked")).await;
    let r = call(&client, "generate_image_to_video", video("later")).await;
    let id = structured(&r)["predict_id"].as_str().expect("id").to_owned();
    eventually("the job failed", || async {
        let r = call(&client, "get_prediction", json!({"predict_id": id})).await;
        structured(&r)["status"] == "failed"
    })
    .await;
    let r = call(&client, "get_prediction", json!({"predict_id": id})).await;
    assert!(structured(&r)["error"].as_str().is_some_and(|e| e.contains("3600")), "{}", text(&r));
    assert_eq!(server.submissions().await.len(), 1);
}

#[tokio::test]
async fn list_articles_against_a_429_reaches_it_once_and_passes_the_wait_on() {
    let server = TestServer::start("[mock_upstream]\nrate_429 = 1.0\nretry_after_seconds = 4\n").await;
    let client = server.client(Some("reader")).await;
    let r = call(&client, "list_articles", json!({"query": "agents"})).await;
    assert_eq!(error_code(&r), Some("upstream_rate_limited"));
    assert_eq!(structured(&r)["error"]["retry_after_ms"], 4000);
    assert!(text(&r).contains("Wait 4 seconds"), "{}", text(&r));
    settle().await;
    assert_eq!(server.upstream_usage().await["requests"], 1, "no server-side retry of an agent's call");
}

#[tokio::test]
async fn the_breaker_opens_refuses_without_upstream_traffic_and_closes_after_a_good_probe() {
    let config = "[upstream]\nbreaker_failures = 3\nbreaker_cooldown_ms = 30000\n[mock_upstream]\nrate_5xx = 1.0\n";
    let server = TestServer::start(config).await;
    let client = server.client(Some("reader")).await;
    for page in 0..3 {
        let r = call(&client, "list_articles", json!({"cursor": page.to_string()})).await;
        assert_eq!(error_code(&r), Some("upstream_unavailable"), "{}", text(&r));
    }
    let sent = server.upstream_usage().await["requests"].as_u64().expect("requests");
    assert_eq!(sent, 3);

    let before = call(&client, "rate_limit_status", json!({})).await;
    let refused = call(&client, "list_articles", json!({"cursor": "3"})).await;
    assert_eq!(error_code(&refused), Some("upstream_unavailable"));
    assert_eq!(structured(&refused)["error"]["retry_after_ms"], 30_000, "the whole cool-down is left");
    let image = call(&client, "generate_image", json!({"prompt": "p"})).await;
    assert_eq!(error_code(&image), Some("upstream_unavailable"));
    let status = call(&client, "rate_limit_status", json!({})).await;
    assert_eq!(budget(&status, "caller:"), budget(&before, "caller:"), "refused while open: nothing charged");
    server.advance_secs(10.0);
    let refused = call(&client, "list_articles", json!({"cursor": "4"})).await;
    assert_eq!(structured(&refused)["error"]["retry_after_ms"], 20_000);
    assert_eq!(server.upstream_usage().await["requests"], sent, "an open breaker sends nothing");
    assert!(server.metrics().await.contains("mcp_ratelimit_breaker_state 2"));

    server.chaos(json!({"rate_5xx": 0.0})).await;
    server.advance_secs(20.0);
    let probe = call(&client, "list_articles", json!({"cursor": "5"})).await;
    assert!(!is_error(&probe), "the probe succeeds: {}", text(&probe));
    assert!(!is_error(&call(&client, "list_articles", json!({"cursor": "6"})).await), "closed again");
    assert!(server.metrics().await.contains("mcp_ratelimit_breaker_state 0"));
}

#[tokio::test]
async fn the_api_key_is_sent_and_a_wrong_one_is_unavailable_saying_so_never_retried() {
    let mock = "[mock_upstream]\napi_key = \"paid-api-key-1\"\n";
    for (upstream, header) in [("paid-api-key-1", "authorization"), ("paid-api-key-1", "x-api-key")] {
        let config = format!("{mock}[upstream]\napi_key = \"{upstream}\"\napi_key_header = \"{header}\"\n");
        let server = TestServer::start(&config).await;
        let client = server.client(Some("caller")).await;
        let listed = call(&client, "list_articles", json!({})).await;
        assert!(!is_error(&listed), "the key in `{header}` is accepted: {}", text(&listed));
        assert_eq!(server.upstream_usage().await["refused_401"], 0);
    }

    let server = TestServer::start(&format!("{mock}[upstream]\napi_key = \"wrong\"\n")).await;
    let client = server.client(Some("caller")).await;
    let refused = call(&client, "list_articles", json!({})).await;
    assert_eq!(error_code(&refused), Some("upstream_unavailable"), "{}", text(&refused));
    assert!(text(&refused).contains("refused this server's credential (HTTP 401)"), "{}", text(&refused));
    assert!(text(&refused).contains("upstream.api_key"), "says what to fix: {}", text(&refused));
    let image = call(&client, "generate_image", json!({"prompt": "a cat"})).await;
    assert_eq!(error_code(&image), Some("upstream_unavailable"), "{}", text(&image));
    let usage = server.upstream_usage().await;
    assert_eq!(usage["refused_401"], 2, "one request each, never retried: {usage}");
    assert_eq!(usage["requests"], 2, "{usage}");
}

#[tokio::test]
async fn an_empty_search_says_so_in_a_sentence_the_agent_can_act_on() {
    let server = TestServer::start("").await;
    let client = server.client(None).await;
    let found = call(&client, "list_articles", json!({"query": "no-such-subject-anywhere"})).await;
    assert!(!is_error(&found), "{}", text(&found));
    assert_eq!(structured(&found)["articles"], json!([]), "{}", structured(&found));
    assert_eq!(
        text(&found),
        "No articles match \"no-such-subject-anywhere\". Try fewer or other words, or no query to list them all."
    );
}

/// A submission the upstream never answered may have started the job (and been billed): a job
/// given up after such tries keeps its reservation, as the settlement rule says. One whose
/// submissions were all refused never ran, and costs nothing (`tests/limits/pricing.rs`).
#[tokio::test]
async fn a_job_whose_submissions_went_unanswered_keeps_its_reservation_when_given_up() {
    // The mock answers nothing for ten minutes of its clock; the server waits 300 ms (real) for
    // each of its two tries.
    let server = TestServer::start(
        "[upstream]\ntimeout_ms = 300\nmax_attempts = 2\nvideo_min_gap_ms = 0\n[mock_upstream]\nlatency_ms = 600000\n",
    )
    .await;
    let client = server.client(Some("ann")).await;
    let accepted = call(&client, "generate_image_to_video", video("a lighthouse")).await;
    assert!(!is_error(&accepted), "{}", text(&accepted));
    let reserved = structured(&accepted)["reserved"].as_u64().expect("a price reserved");
    let id = structured(&accepted)["predict_id"].as_str().expect("id").to_owned();
    let report = eventually_some("the job is given up and settled", std::time::Duration::from_secs(10), || async {
        // The backoff between the two tries is on the server's clock.
        server.advance_ms(1_000);
        let report = structured(&call(&client, "get_prediction", json!({"predict_id": id})).await).clone();
        report.get("charged").is_some().then_some(report)
    })
    .await;
    assert_eq!(report["status"], "failed", "{report}");
    assert_eq!(report["charged"].as_u64(), Some(reserved), "the upstream may have started it: {report}");
}
