//! Loop detection through an MCP client: a stuck agent repeats the exact same call, a working
//! one varies it. Identical calls are stopped on the 5th, across sessions; A/B/A/B is caught;
//! pagination, changed arguments and polling a job at its hint never are.

use crate::common::*;
use serde_json::json;

#[tokio::test]
async fn the_fifth_identical_call_is_a_loop_even_from_a_new_session() {
    let server = TestServer::start("").await;
    let first = server.client(Some("stuck")).await;
    let same = json!({"query": "rate limits", "limit": 5});
    for i in 0..4 {
        let r = call(&first, "list_articles", same.clone()).await;
        assert!(!is_error(&r), "call {i}: {}", text(&r));
    }
    first.cancel().await.ok();

    let second = server.client(Some("stuck")).await;
    let r = call(&second, "list_articles", same.clone()).await;
    assert_eq!(error_code(&r), Some("loop_detected"), "a new session does not reset it: {}", text(&r));
    assert!(text(&r).contains("will not change"), "{}", text(&r));
    assert_eq!(structured(&r)["error"]["retry_after_ms"], 60_000);
    assert_eq!(server.upstream_usage().await["articles_listed"], 4, "the loop never reached the upstream");
    let status = call(&second, "rate_limit_status", json!({})).await;
    assert_eq!(budget(&status, "caller:")["remaining"], 56, "the refused call cost nothing");

    // Key order and defaults do not make a different call; a changed argument does.
    let reordered = json!({"limit": 5, "query": "rate limits", "cursor": ""});
    assert_eq!(error_code(&call(&second, "list_articles", reordered).await), Some("loop_detected"));
    assert!(!is_error(&call(&second, "list_articles", json!({"query": "rate limits", "limit": 6})).await));

    // A hard stop until the window has passed.
    server.advance_secs(59.0);
    let r = call(&second, "list_articles", same.clone()).await;
    assert_eq!(structured(&r)["error"]["retry_after_ms"], 1000);
    server.advance_secs(1.0);
    assert!(!is_error(&call(&second, "list_articles", same).await));
    assert!(server.metrics().await.contains(r#"mcp_ratelimit_loop_detections_total{tool="list_articles"} 3"#));
}

#[tokio::test]
async fn an_a_b_a_b_oscillation_is_a_loop() {
    let server = TestServer::start("").await;
    let client = server.client(Some("flip-flop")).await;
    let a = json!({"query": "a"});
    let b = json!({"query": "b"});
    for i in 0..8 {
        let args = if i % 2 == 0 { &a } else { &b };
        let r = call(&client, "list_articles", args.clone()).await;
        assert!(!is_error(&r), "call {i}: {}", text(&r));
    }
    let r = call(&client, "list_articles", a.clone()).await;
    assert_eq!(error_code(&r), Some("loop_detected"), "the 5th A: {}", text(&r));
    assert!(text(&r).contains("alternating"), "{}", text(&r));
    assert_eq!(error_code(&call(&client, "list_articles", b).await), Some("loop_detected"));
}

#[tokio::test]
async fn pagination_and_changing_arguments_are_never_a_loop() {
    let server = TestServer::start("").await;
    let client = server.client(Some("reader")).await;
    let mut cursor = String::new();
    for page in 0..12 {
        let r = call(&client, "list_articles", json!({"limit": 5, "cursor": cursor})).await;
        assert!(!is_error(&r), "page {page}: {}", text(&r));
        cursor = structured(&r)["next_cursor"].as_str().expect("more pages").to_owned();
    }
    for i in 0..10 {
        let r = call(&client, "save_article", json!({"title": format!("draft {i}"), "body": "same body"})).await;
        assert!(!is_error(&r), "{}", text(&r));
    }
}

#[tokio::test]
async fn twenty_polls_of_one_job_each_at_its_hint_are_never_a_loop() {
    let server = TestServer::start("[mock_upstream]\nimage_job_ms = 100000\n").await;
    let client = server.client(Some("obedient")).await;
    let r = call(&client, "generate_image", json!({"prompt": "a long render"})).await;
    let id = structured(&r)["predict_id"].as_str().expect("id").to_owned();
    let mut hint = structured(&r)["next_poll_in_seconds"].as_u64().expect("hint");
    for i in 0..20 {
        server.advance_secs(hint as f64);
        let r = call(&client, "get_prediction", json!({"predict_id": id})).await;
        assert!(!is_error(&r), "poll {i}: {}", text(&r));
        let status = structured(&r)["status"].as_str().expect("status");
        assert!(["starting", "processing"].contains(&status), "still running: {status}");
        hint = structured(&r)["next_poll_in_seconds"].as_u64().expect("hint");
        assert_eq!(hint, 2, "a fresh answer, the full hint ahead");
    }
    // One upstream poll per hint, by the server: the agent's polls were answered from the book.
    assert_eq!(server.upstream_usage().await["polls"], 20);
    // Re-reading a final result is another matter: it will not change.
    server.advance_secs(100.0);
    eventually("the job finished", || async {
        let r = call(&client, "get_prediction", json!({"predict_id": id})).await;
        structured(&r)["status"] == "succeeded"
    })
    .await;
    let mut codes = Vec::new();
    for _ in 0..5 {
        codes.push(error_code(&call(&client, "get_prediction", json!({"predict_id": id})).await).map(str::to_owned));
    }
    assert!(codes.iter().any(|c| c.as_deref() == Some("loop_detected")), "{codes:?}");
}
