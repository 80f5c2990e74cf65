//! A burst of agents against a flaky upstream (30 % of requests answered 429), on the manual
//! clock: what the upstream received against the jobs accepted, the spacing it saw, and that no
//! in-flight slot leaked. Run with `--nocapture` to see the figures quoted in docs/upstream.md.

use crate::common::*;
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
    let server = TestServer::start(&config()).await;
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
    assert_eq!(images_accepted + images_429, AGENTS, "an image is accepted, or refused with the upstream's wait");

    walk_the_clock_until_no_job_is_in_flight(&server).await;
    assert!(server.metrics().await.contains("mcp_ratelimit_jobs_in_flight 0"), "every job ended");

    let log = server.submissions().await;
    let accepted = videos_accepted + images_accepted;
    // Submissions the server owns carry the job's predict_id as their key (`v_…`, `i_…` for an
    // image that waited for an account slot); an image submitted in its call carries `k_…`.
    let owned: Vec<&(u64, u16, String)> = log.iter().filter(|s| !s.2.starts_with("k_")).collect();
    let queued_jobs = owned.iter().map(|s| s.2.as_str()).collect::<std::collections::BTreeSet<_>>().len();
    let started = log.iter().filter(|s| s.1 == 201).count();
    let videos: Vec<&(u64, u16, String)> = log.iter().filter(|s| s.2.starts_with("v_")).collect();
    let min_gap = videos.windows(2).map(|w| w[1].0 - w[0].0).min().unwrap_or(u64::MAX);
    let peak_per_sec = videos
        .iter()
        .map(|s| videos.iter().filter(|t| t.0 >= s.0 && t.0 < s.0 + NANOS_PER_SEC).count())
        .max()
        .unwrap_or(0);
    let span_ns = log.last().map_or(0, |s| s.0) - log.first().map_or(0, |s| s.0);
    let windows = (span_ns / WINDOW_NS + 1) as f64;
    let budget = (queued_jobs as f64 * (1.0 + RATIO) + MIN_PER_WINDOW * windows).floor() as usize;
    let usage = server.upstream_usage().await;

    println!("{AGENTS} agents, each its own tenant, at once: 1 video + 1 image each; account cap 10");
    println!("upstream: 30 % of all requests answered 429 (Retry-After: 1)");
    println!(
        "jobs accepted {accepted} ({videos_accepted} videos, {images_accepted} images; {images_429} images refused \
         upstream_rate_limited in their call); the upstream received {} submissions = {:.2}x; {started} jobs \
         started, {} failed (retry budget or attempts spent)",
        log.len(),
        log.len() as f64 / accepted as f64,
        accepted - started
    );
    println!(
        "video submissions: closest two {:.3} s apart (gap {} s), peak {peak_per_sec} in any second; run {:.0} s",
        min_gap as f64 / 1e9,
        GAP_NS / NANOS_PER_SEC,
        span_ns as f64 / 1e9
    );
    println!("upstream totals: {usage}");

    assert!(min_gap >= GAP_NS, "two video submissions {min_gap} ns apart");
    assert_eq!(peak_per_sec, 1);
    assert!(
        owned.len() <= budget,
        "{} server-owned submissions, over the retry budget's bound ({budget})",
        owned.len()
    );
    for (i, client) in clients.iter().enumerate() {
        let status = call(client, "rate_limit_status", json!({})).await;
        assert_eq!(budget_of(&status), 5, "agent {i} has every in-flight slot back");
    }
}

/// The server's config: a flaky mock upstream (30 % answered 429) and [`AGENTS`] keys. Each agent
/// has its own key and tenant: a burst of real customers, not one address rotating made-up keys
/// (which the address budget would stop).
fn config() -> String {
    let mut config = "[upstream]\nvideo_queue_max = 100\nqueue_max = 200\n\
                      [mock_upstream]\nrate_429 = 0.3\nretry_after_seconds = 1\nmax_concurrent_predictions = 1000\n"
        .to_owned();
    for i in 0..AGENTS {
        config.push_str(&format!("[[auth.keys]]\nkey = \"agent-{i}\"\ntenant = \"t{i}\"\n"));
    }
    config
}

/// Walks the clock in half-second steps, letting the server's background work run at each, until
/// no job is in flight or 900 s have passed.
async fn walk_the_clock_until_no_job_is_in_flight(server: &TestServer) {
    let mut elapsed_ns = 0;
    loop {
        server.advance_ms(500);
        elapsed_ns += 500_000_000;
        tokio::time::sleep(std::time::Duration::from_millis(15)).await;
        if server.metrics().await.contains("mcp_ratelimit_jobs_in_flight 0") || elapsed_ns > 900 * NANOS_PER_SEC {
            break;
        }
    }
}

fn budget_of(status: &rmcp::model::CallToolResult) -> u64 {
    budget(status, "in_flight:caller:")["remaining"].as_u64().expect("remaining")
}
