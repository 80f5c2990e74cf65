//! The caller's token budget, proven through a real MCP client over streamable HTTP.

use crate::common::*;
use serde_json::json;

/// A mock upstream that runs any number of jobs at once, no in-flight caps and no loop
/// detection, so only the budget refuses a caller that repeats one call until it is refused.
fn roomy() -> String {
    format!("[mock_upstream]\nmax_concurrent_predictions = 1000\n{ROOMY_IN_FLIGHT}{NO_LOOP_DETECTION}")
}

#[tokio::test]
async fn sixty_calls_then_refused_with_exact_wait() {
    let server = TestServer::start(NO_LOOP_DETECTION).await;
    let client = server.client(Some("agent-a")).await;

    let (passed, refused) = spend_until_refused(&client, "list_articles", json!({}), 100).await;
    assert_eq!(passed, 60);
    assert_eq!(error_code(&refused), Some("rate_limited"));
    let error = &structured(&refused)["error"];
    let wait = error["retry_after_ms"].as_u64().expect("retry_after_ms");
    assert_eq!(wait, 1000, "one token at 1 per second, on a clock that has not moved");
    assert_eq!(error["limit"], 60);
    assert_eq!(error["remaining"], 0);
    assert!(error["scope"].as_str().is_some_and(|s| s.starts_with("caller:tok:")));
    assert_eq!(text(&refused), "Rate limit reached for list_articles. Wait 1 second before calling it again.");

    server.advance_secs(1.0);
    assert!(!is_error(&call(&client, "list_articles", json!({})).await), "one token is back after 1 s");
    assert_eq!(error_code(&call(&client, "list_articles", json!({})).await), Some("rate_limited"));
    client.cancel().await.ok();
}

#[tokio::test]
async fn expensive_tools_draw_more_from_the_same_budget() {
    let server = TestServer::start(&roomy()).await;

    let images = server.client(Some("images")).await;
    let (passed, refused) = spend_until_refused(&images, "generate_image", json!({"prompt": "a red fox"}), 100).await;
    assert_eq!(passed, 12, "60 tokens / cost 5");
    assert_eq!(error_code(&refused), Some("rate_limited"));
    assert_eq!(structured(&refused)["error"]["retry_after_ms"], 5000, "exactly 5 tokens' worth");

    let videos = server.client(Some("videos")).await;
    let args = json!({"image_url": "https://example.com/fox.png", "prompt": "the fox runs"});
    let (passed, refused) = spend_until_refused(&videos, "generate_image_to_video", args, 100).await;
    assert_eq!(passed, 3, "60 tokens / cost 20");
    assert_eq!(structured(&refused)["error"]["retry_after_ms"], 20_000);

    let mixed = server.client(Some("mixed")).await;
    let video = json!({"image_url": "https://example.com/a.png", "prompt": "pan left"});
    for _ in 0..2 {
        assert!(!is_error(&call(&mixed, "generate_image_to_video", video.clone()).await));
    }
    for _ in 0..3 {
        assert!(!is_error(&call(&mixed, "generate_image", json!({"prompt": "x"})).await));
    }
    for _ in 0..2 {
        assert!(!is_error(&call(&mixed, "save_article", json!({"title": "t", "body": "b"})).await));
    }
    assert!(!is_error(&call(&mixed, "list_articles", json!({})).await), "40 + 15 + 4 + 1 = 60");
    let refused = call(&mixed, "list_articles", json!({})).await;
    assert_eq!(error_code(&refused), Some("rate_limited"));
    // A refused expensive call waits for its own cost, not for one token.
    let refused = call(&mixed, "generate_image", json!({"prompt": "x"})).await;
    assert_eq!(structured(&refused)["error"]["retry_after_ms"], 5000);
}

#[tokio::test]
async fn two_callers_are_kept_apart() {
    let server = TestServer::start(&roomy()).await;
    let a = server.client(Some("token-a")).await;
    let b = server.client(Some("token-b")).await;
    let (passed, _) = spend_until_refused(&a, "generate_image", json!({"prompt": "p"}), 100).await;
    assert_eq!(passed, 12);
    let r = call(&b, "generate_image", json!({"prompt": "p"})).await;
    assert!(!is_error(&r), "caller b has its own budget: {}", text(&r));
    let status = call(&b, "rate_limit_status", json!({})).await;
    assert_eq!(budget(&status, "caller:")["remaining"], 55);
}

#[tokio::test]
async fn new_session_does_not_reset_budget() {
    let server = TestServer::start(&roomy()).await;
    let first = server.client(Some("same-token")).await;
    let (passed, _) = spend_until_refused(
        &first,
        "generate_image_to_video",
        json!({"image_url": "http://x.test/a.png", "prompt": "p"}),
        10,
    )
    .await;
    assert_eq!(passed, 3);
    first.cancel().await.ok();

    let second = server.client(Some("same-token")).await;
    let r = call(&second, "list_articles", json!({})).await;
    assert_eq!(error_code(&r), Some("rate_limited"), "a new session must not buy a fresh budget");
}

#[tokio::test]
async fn callers_without_credentials_share_their_address_budget() {
    let server = TestServer::start(&roomy()).await;
    let one = server.client(None).await;
    let two = server.client(None).await;
    let (passed, _) = spend_until_refused(
        &one,
        "generate_image_to_video",
        json!({"image_url": "http://x.test/a.png", "prompt": "p"}),
        10,
    )
    .await;
    assert_eq!(passed, 3);
    let r = call(&two, "save_article", json!({"title": "t", "body": "b"})).await;
    assert_eq!(error_code(&r), Some("rate_limited"));
    assert!(structured(&r)["error"]["scope"].as_str().is_some_and(|s| s == "caller:ip:127.0.0.1"));
}

#[tokio::test]
async fn over_long_prompt_is_refused_and_charges_nothing() {
    let server = TestServer::start("").await;
    let client = server.client(Some("long")).await;
    let r = call(&client, "generate_image", json!({"prompt": "x".repeat(4001)})).await;
    assert!(is_error(&r));
    assert_eq!(error_code(&r), Some("invalid_arguments"));
    assert!(text(&r).contains("4001"), "{}", text(&r));

    let exactly = call(&client, "generate_image", json!({"prompt": "y".repeat(4000)})).await;
    assert!(!is_error(&exactly), "4000 characters is allowed");
    let status = call(&client, "rate_limit_status", json!({})).await;
    assert_eq!(budget(&status, "caller:")["remaining"], 55, "only the valid call was charged");
    assert_eq!(server.upstream_usage().await["predictions_created"], 1);
}

#[tokio::test]
async fn malformed_arguments_and_unknown_tools_charge_nothing() {
    let server = TestServer::start("").await;
    let client = server.client(Some("sloppy")).await;
    for (tool, args) in [
        ("generate_image", json!({})),
        ("generate_image", json!({"prompt": 42})),
        ("generate_image", json!({"prompt": "ok", "seed": 1})),
        ("generate_image_to_video", json!({"image_url": "file:///etc/passwd", "prompt": "p"})),
        ("list_articles", json!({"limit": 500})),
        ("save_article", json!({"title": " ", "body": "b"})),
        ("get_prediction", json!({"predict_id": "../../admin"})),
    ] {
        let r = call(&client, tool, args.clone()).await;
        assert_eq!(error_code(&r), Some("invalid_arguments"), "{tool} {args}: {}", text(&r));
    }
    let unknown = rmcp::model::CallToolRequestParams::new("make_coffee");
    assert!(client.call_tool(unknown).await.is_err(), "an unknown tool is a protocol error");
    let status = call(&client, "rate_limit_status", json!({})).await;
    assert_eq!(budget(&status, "caller:")["remaining"], 60);
}

#[tokio::test]
async fn rate_limit_status_reports_the_budget_and_costs_nothing() {
    let server = TestServer::start("").await;
    let client = server.client(Some("planner")).await;
    call(&client, "generate_image_to_video", json!({"image_url": "https://x.test/a.png", "prompt": "p"})).await;
    for _ in 0..5 {
        call(&client, "rate_limit_status", json!({})).await;
    }
    let status = call(&client, "rate_limit_status", json!({})).await;
    let s = structured(&status);
    let own = budget(&status, "caller:");
    assert_eq!(own["algorithm"], "token_bucket");
    assert_eq!(own["limit"], 60);
    assert_eq!(own["remaining"], 40);
    assert_eq!(own["reset_after_ms"], 20_000);
    let video = budget(&status, "caller:tok:");
    assert_eq!(video["remaining"], 40);
    let per_tool = structured(&status)["budgets"]
        .as_array()
        .expect("budgets")
        .iter()
        .find(|b| b["scope"].as_str().is_some_and(|s| s.ends_with(":tool:generate_image_to_video")))
        .expect("the video tool's own budget");
    assert_eq!(per_tool["algorithm"], "sliding_log");
    assert_eq!(per_tool["remaining"], 29, "one video of 30 per rolling hour");
    // Priced by its length: 20 for the default 5 seconds (charged above), at most 30.
    assert_eq!(s["costs"]["generate_image_to_video"], 30);
    assert_eq!(s["cost_formulas"]["generate_image_to_video"], "20 + 2 * max(0, seconds - 5)");
    assert!(s["caller"].as_str().is_some_and(|c| c.starts_with("tok:") && !c.contains("planner")));
}

#[tokio::test]
async fn image_job_polls_are_spaced_by_the_hint() {
    let server = TestServer::start("").await;
    let client = server.client(Some("poller")).await;
    let submitted = call(&client, "generate_image", json!({"prompt": "a lighthouse"})).await;
    let s = structured(&submitted).clone();
    let id = s["predict_id"].as_str().expect("predict_id").to_owned();
    assert_eq!(s["next_poll_in_seconds"], 2);
    assert_eq!(s["status"], "starting");

    // Polling early is answered here, with the wait left, and never reaches the upstream.
    server.advance_secs(0.5);
    for _ in 0..10 {
        let early = call(&client, "get_prediction", json!({"predict_id": id})).await;
        assert!(!is_error(&early));
        assert_eq!(structured(&early)["next_poll_in_seconds"], 2, "1.5 s left rounds up to 2");
    }
    assert_eq!(server.upstream_usage().await["polls"], 0);

    server.advance_secs(1.5);
    let due = call(&client, "get_prediction", json!({"predict_id": id})).await;
    assert_eq!(structured(&due)["status"], "processing");
    assert_eq!(server.upstream_usage().await["polls"], 1);

    server.advance_secs(6.0);
    let done = call(&client, "get_prediction", json!({"predict_id": id})).await;
    let d = structured(&done);
    assert_eq!(d["status"], "succeeded");
    assert!(d["output"].as_str().is_some_and(|u| u.contains(&id)));
    assert!(d.get("next_poll_in_seconds").is_none());

    // Someone else's job is not theirs to read.
    let other = server.client(Some("stranger")).await;
    let r = call(&other, "get_prediction", json!({"predict_id": id})).await;
    assert_eq!(error_code(&r), Some("invalid_arguments"));
}

#[tokio::test]
async fn failed_jobs_report_their_reason() {
    let server = TestServer::start("").await;
    let client = server.client(Some("unlucky")).await;
    let submitted = call(&client, "generate_image", json!({"prompt": "draw [fail] please"})).await;
    let id = structured(&submitted)["predict_id"].as_str().expect("id").to_owned();
    server.advance_secs(10.0);
    let r = call(&client, "get_prediction", json!({"predict_id": id})).await;
    assert_eq!(structured(&r)["status"], "failed");
    assert!(structured(&r)["error"].as_str().is_some());
}

#[tokio::test]
async fn upstream_429_is_passed_on_with_its_retry_after_as_a_floor() {
    let server = TestServer::start("[mock_upstream]\nrate_429 = 1.0\nretry_after_seconds = 7\n").await;
    let client = server.client(Some("unlucky")).await;
    let r = call(&client, "generate_image", json!({"prompt": "p"})).await;
    assert_eq!(error_code(&r), Some("upstream_rate_limited"));
    assert_eq!(structured(&r)["error"]["retry_after_ms"], 7000, "the upstream's Retry-After, exactly");
    assert!(text(&r).contains("Wait 7 seconds"), "{}", text(&r));
    let metrics =
        reqwest::get(format!("http://{}/metrics", server.addr)).await.expect("metrics").text().await.expect("text");
    assert!(
        metrics.contains(r#"mcp_ratelimit_upstream_requests_total{tool="generate_image",outcome="rate_limited"} 1"#),
        "{metrics}"
    );
}

#[tokio::test]
async fn server_reports_its_own_name_and_prices_in_tool_descriptions() {
    let server = TestServer::start("[tools.generate_image]\ncost = 7\n").await;
    let client = server.client(None).await;
    let info = client.peer_info().expect("server info");
    let implementation = info.server_info.as_ref().expect("serverInfo");
    assert_eq!(implementation.name, "mcp-ratelimit");
    assert_eq!(implementation.version, env!("CARGO_PKG_VERSION"));
    let tools = client.list_all_tools().await.expect("tools/list");
    assert_eq!(tools.len(), 7);
    let image = tools.iter().find(|t| t.name == "generate_image").expect("generate_image");
    assert!(image.description.as_deref().is_some_and(|d| d.ends_with("Costs 7 tokens.")));
    assert_eq!(image.input_schema.get("properties").and_then(|p| p["prompt"].get("maxLength")), Some(&json!(4000)));
}

#[tokio::test]
async fn health_is_served() {
    let server = TestServer::start("").await;
    let r = reqwest::get(format!("http://{}/health", server.addr)).await.expect("health");
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn the_upstream_job_cap_comes_back_as_upstream_rate_limited() {
    // Defaults: the mock runs at most 10 jobs at once; our budget would allow 12 images.
    // Our account cap as high as the budget, so the mock's own cap is what the 11th image meets.
    let account = "[upstream]\nmax_in_flight = 1000\n";
    let server = TestServer::start(&format!("{ROOMY_IN_FLIGHT}{NO_LOOP_DETECTION}{account}")).await;
    let client = server.client(Some("fan-out")).await;
    let (passed, refused) = spend_until_refused(&client, "generate_image", json!({"prompt": "p"}), 20).await;
    assert_eq!(passed, 10);
    assert_eq!(error_code(&refused), Some("upstream_rate_limited"));
    assert_eq!(structured(&refused)["error"]["retry_after_ms"], 2000, "the mock's Retry-After: 2");
    server.advance_secs(6.0);
    assert!(!is_error(&call(&client, "generate_image", json!({"prompt": "p"})).await), "jobs finished, room again");
}
