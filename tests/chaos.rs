//! A burst of agents against a flaky upstream (30 % of requests answered 429), on the manual
//! clock: what the upstream received against the jobs accepted, the spacing it saw, and that no
//! in-flight slot leaked. Run with `--nocapture` to see the figures quoted in the README.

mod common;

use common::*;
use mcp_ratelimit::clock::NANOS_PER_SEC;
use serde_json::json;

const AGENTS: usize = 40;
const GAP_NS: u64 = 2 * NANOS_PER_SEC;
/// The retry budget's own guarantee: retries ≤ 20 % of first attempts, plus 1 per 10 s window.
const RATIO: f64 = 0.2;
const MIN_PER_WINDOW: f64 = 1.0;
const WINDOW_NS: u64 = 10 * NANOS_PER_SEC;

#[tokio::test]
async fn a_burst_of_agents_against_a_flaky_upstream_costs_little_in_retries_and_leaks_no_slot() {
    let config = "[upstream]\nvideo_queue_max = 100\n\
                  [mock_upstream]\nrate_429 = 0.3\nretry_after_seconds = 1\nmax_concurrent_predictions = 1000\n";
    let server = TestServer::start(config).await;
    let mut clients = Vec::new();
    for i in 0..AGENTS {
        clients.push(server.client(Some(&format!("agent-{i}"))).await);
    }
    let burst = clients.iter().enumerate().map(|(i, client)| async move {
        let video = call(
            client,
            "generate_image_to_video",
            json!({"image_url": "https://example.com/f.png", "prompt": format!("scene {i}")}),
        )
        .await;
        let image = call(client, "generate_image", json!({"prompt": format!("still {i}")})).await;
        (video, image)
    });
    let answers = futures::future::join_all(burst).await;
    let videos_accepted = answers.iter().filter(|(v, _)| !is_error(v)).count();
    let images_accepted = answers.iter().filter(|(_, i)| !is_error(i)).count();
    let images_429 = answers.iter().filter(|(_, i)| error_code(i) == Some("upstream_rate_limited")).count();
    assert_eq!(videos_accepted, AGENTS, "every video fits the queue");

    // Walk the clock in half-second steps, letting the server's background work run at each.
    let mut elapsed_ns = 0;
    loop {
        server.advance_ms(500);
        elapsed_ns += 500_000_000;
        tokio::time::sleep(std::time::Duration::from_millis(15)).await;
        if server.metrics().await.contains("mcp_ratelimit_jobs_in_flight 0") || elapsed_ns > 900 * NANOS_PER_SEC {
            break;
        }
    }
    assert!(server.metrics().await.contains("mcp_ratelimit_jobs_in_flight 0"), "every job ended");

    let log = server.submissions().await;
    let videos: Vec<&(u64, u16, String)> = log.iter().filter(|s| s.2.starts_with("v_")).collect();
    let video_ok = videos.iter().filter(|s| s.1 == 201).count();
    let min_gap = videos.windows(2).map(|w| w[1].0 - w[0].0).min().unwrap_or(u64::MAX);
    let peak_per_sec = videos
        .iter()
        .map(|s| videos.iter().filter(|t| t.0 >= s.0 && t.0 < s.0 + NANOS_PER_SEC).count())
        .max()
        .unwrap_or(0);
    let span_ns = videos.last().map_or(0, |s| s.0) - videos.first().map_or(0, |s| s.0);
    let windows = (span_ns / WINDOW_NS + 1) as f64;
    let budget = (videos_accepted as f64 * (1.0 + RATIO) + MIN_PER_WINDOW * windows).floor() as usize;
    let usage = server.upstream_usage().await;

    println!("agents: {AGENTS}, each 1 video (queued, server-owned retries) + 1 image (one attempt)");
    println!("upstream: 30 % of all requests answered 429 (Retry-After: 1)");
    println!(
        "videos accepted {videos_accepted}; upstream received {} submissions for them = {:.2}x; \
         {video_ok} started, {} failed (retry budget or attempts spent)",
        videos.len(),
        videos.len() as f64 / videos_accepted as f64,
        videos_accepted - video_ok
    );
    println!(
        "video submissions: closest two {:.3} s apart (gap {} s), peak {peak_per_sec} in any second, over {:.0} s",
        min_gap as f64 / 1e9,
        GAP_NS / NANOS_PER_SEC,
        span_ns as f64 / 1e9
    );
    println!("images: {images_accepted} accepted, {images_429} answered upstream_rate_limited to the agent");
    println!("upstream totals: {usage}");

    assert!(min_gap >= GAP_NS, "two video submissions {min_gap} ns apart");
    assert_eq!(peak_per_sec, 1);
    assert!(videos.len() <= budget, "{} submissions, more than the retry budget allows ({budget})", videos.len());
    for (i, client) in clients.iter().enumerate() {
        let status = call(client, "rate_limit_status", json!({})).await;
        assert_eq!(budget_of(&status), 5, "agent {i} has every in-flight slot back");
    }
}

fn budget_of(status: &rmcp::model::CallToolResult) -> u64 {
    budget(status, "in_flight:caller:")["remaining"].as_u64().expect("remaining")
}
