//! One upstream account, many callers, through MCP clients on a manual clock: made-up keys buy
//! no budget, the account's cap is shared and never overrun (the upstream never says 429), and
//! when it is full, jobs wait their turn round-robin across tenants.

use crate::common::*;
use crate::python;
use mcp_ratelimit::clock::NANOS_PER_SEC;
use serde_json::{Value, json};

fn image(prompt: &str) -> Value {
    json!({ "prompt": prompt })
}

fn keys(tenants: &[&str]) -> String {
    tenants.iter().map(|t| format!("[[auth.keys]]\nkey = \"{t}-key\"\ntenant = \"{t}\"\n")).collect()
}

#[tokio::test]
async fn eighty_sessions_with_made_up_keys_from_one_address_never_exceed_its_budget() {
    let server = TestServer::start(&format!("{}{NO_PROGRESS_CHECK}", keys(&["acme"]))).await;
    let mut admitted = 0;
    let mut refusal = None;
    for session in 0..80 {
        let client = server.client(Some(&format!("made-up-{session}"))).await;
        for call_no in 0..10 {
            let r = call(&client, "list_articles", json!({"query": format!("q{call_no}")})).await;
            if is_error(&r) {
                refusal.get_or_insert(r);
            } else {
                admitted += 1;
            }
        }
        client.cancel().await.ok();
    }
    assert_eq!(admitted, 600, "the address budget, not 80 fresh budgets of 60");
    assert_eq!(server.upstream_usage().await["articles_listed"], 600);
    let refusal = refusal.expect("refused once the address budget was spent");
    assert_eq!(error_code(&refusal), Some("rate_limited"));
    assert_eq!(structured(&refusal)["error"]["scope"], "address:ip:127.0.0.1");
    assert_eq!(structured(&refusal)["error"]["limit"], 600);

    // A configured key from the same address keeps its own budget, and is not charged to it.
    let customer = server.client(Some("acme-key")).await;
    for call_no in 0..60 {
        let r = call(&customer, "list_articles", json!({"query": format!("k{call_no}")})).await;
        assert!(!is_error(&r), "call {call_no}: {}", text(&r));
    }
    let status = call(&customer, "rate_limit_status", json!({})).await;
    assert!(
        structured(&status)["budgets"]
            .as_array()
            .expect("budgets")
            .iter()
            .all(|b| b["scope"] != "address:ip:127.0.0.1"),
        "a configured key draws on no address budget"
    );
}

#[tokio::test]
async fn three_tenants_of_five_images_share_an_account_of_ten_and_the_upstream_never_says_429() {
    let config = format!("[upstream]\nmax_in_flight = 10\n{}", keys(&["a", "b", "c"]));
    let server = TestServer::start(&config).await;
    let mut clients = Vec::new();
    for t in ["a", "b", "c"] {
        clients.push(server.client(Some(&format!("{t}-key"))).await);
    }
    let mut waiting = Vec::new();
    for n in 0..5 {
        for (t, client) in clients.iter().enumerate() {
            let r = call(client, "generate_image", image(&format!("{t}-{n}"))).await;
            assert!(!is_error(&r), "{}", text(&r));
            if structured(&r)["queue_position"].is_u64() {
                waiting.push(structured(&r)["predict_id"].as_str().expect("id").to_owned());
                assert_eq!(structured(&r)["status"], "starting");
            }
        }
    }
    assert_eq!(waiting.len(), 5, "10 run, 5 wait");
    assert_eq!(server.upstream_usage().await["predictions_created"], 10);
    let metrics = server.metrics().await;
    assert!(metrics.contains("mcp_ratelimit_account_slots_in_use 10"), "{metrics}");
    assert_eq!(metric_sum(&metrics, "mcp_ratelimit_queue_depth"), 5.0);
    let status = call(&clients[2], "rate_limit_status", json!({})).await;
    let mine = structured(&status)["jobs_in_flight"].as_array().expect("jobs").clone();
    assert_eq!(mine.len(), 5);
    assert!(mine.iter().any(|j| j["queue_position"].is_u64()), "the caller sees its waiting jobs: {mine:?}");
    assert_eq!(structured(&status)["upstream_queue"]["waiting"], 5);

    // As jobs end, the waiting ones start: all 15 done, and the upstream never refused one.
    server.advance_secs(6.0);
    eventually("the waiting jobs were submitted", || async {
        server.upstream_usage().await["predictions_created"] == 15
    })
    .await;
    server.advance_secs(6.0);
    eventually("every job ended", || async { server.metrics().await.contains("mcp_ratelimit_jobs_in_flight 0") }).await;
    assert_eq!(server.upstream_usage().await["refused_429"], 0);
    for id in &waiting {
        let owner = &clients[id_owner(&server, id).await];
        let r = call(owner, "get_prediction", json!({"predict_id": id})).await;
        assert_eq!(structured(&r)["status"], "succeeded", "{}", text(&r));
    }
}

/// Which of the three clients (tenants a, b, c) submitted the waiting job `id`.
async fn id_owner(server: &TestServer, id: &str) -> usize {
    for (i, t) in ["a", "b", "c"].iter().enumerate() {
        let client = server.client(Some(&format!("{t}-key"))).await;
        let r = call(&client, "get_prediction", json!({"predict_id": id})).await;
        if !is_error(&r) {
            return i;
        }
    }
    panic!("nobody owns {id}");
}

async fn submit(client: &Client, prompt: &str) -> String {
    let r = call(client, "generate_image", image(prompt)).await;
    structured(&r)["predict_id"].as_str().unwrap_or_else(|| panic!("accepted: {}", text(&r))).to_owned()
}

/// Each tenant keeps its 5 in-flight slots busy: a new job whenever one has ended.
async fn top_up(clients: &[Client], owner: &mut std::collections::HashMap<String, usize>) {
    for (t, client) in clients.iter().enumerate() {
        loop {
            let r = call(client, "generate_image", image("keep busy")).await;
            match structured(&r)["predict_id"].as_str() {
                Some(id) => owner.insert(id.to_owned(), t),
                None => break,
            };
        }
    }
}

#[tokio::test]
async fn waiting_jobs_start_round_robin_across_tenants_not_first_come_first_served() {
    let config = format!("[upstream]\nmax_in_flight = 1\n{}", keys(&["a", "b", "c", "d"]));
    let server = TestServer::start(&config).await;
    let a = server.client(Some("a-key")).await;
    let b = server.client(Some("b-key")).await;
    let c = server.client(Some("c-key")).await;
    let d = server.client(Some("d-key")).await;
    let _running = submit(&a, "a0").await;
    // Arrival order: b b b c c d — first come first served would start all of b's first.
    let mut ids = std::collections::HashMap::new();
    for (who, client, n) in [("b", &b, 3), ("c", &c, 2), ("d", &d, 1)] {
        for i in 0..n {
            ids.insert(submit(client, &format!("{who}{i}")).await, format!("{who}{i}"));
        }
    }
    let mut started = Vec::new();
    for step in 1..=6 {
        server.advance_secs(6.0);
        eventually(&format!("submission {step}"), || async { server.submissions().await.len() > step }).await;
        let log = server.submissions().await;
        started.push(ids[&log[step].2].clone());
    }
    assert_eq!(started, ["b0", "c0", "d0", "b1", "c1", "b2"]);
}

#[tokio::test]
async fn a_tenant_with_ten_queued_videos_delays_another_tenants_one_by_a_single_turn() {
    let config = format!(
        "[upstream]\nvideo_min_gap_ms = 2000\n[tools.generate_image_to_video]\ncost = 1\n\
         [limits.in_flight]\ncaller = 20\ntenant = 20\n[loop_detection]\nenabled = false\n{}",
        keys(&["big", "small"])
    );
    let server = TestServer::start(&config).await;
    let big = server.client(Some("big-key")).await;
    let small = server.client(Some("small-key")).await;
    let video = |p: String| json!({"image_url": "https://example.com/a.png", "prompt": p});
    for i in 0..10 {
        assert!(!is_error(&call(&big, "generate_image_to_video", video(format!("big {i}"))).await));
    }
    let r = call(&small, "generate_image_to_video", video("small".into())).await;
    let small_id = structured(&r)["predict_id"].as_str().expect("id").to_owned();
    assert_eq!(structured(&r)["queue_position"], 2, "one of big's, then small's");
    for step in 1..=3 {
        server.advance_secs(2.0);
        eventually("a submission per gap", || async { server.submissions().await.len() > step }).await;
    }
    let log = server.submissions().await;
    let first = log[0].0;
    let at = log.iter().find(|s| s.2 == small_id).map(|s| s.0).expect("small's video was submitted");
    assert!(at - first <= 2 * 2 * NANOS_PER_SEC, "within two gaps of the first, not after big's ten");
}

#[tokio::test]
async fn busy_tenants_each_get_their_share_of_a_contended_account() {
    let tenants = ["a", "b", "c", "d"];
    let config = format!(
        "[upstream]\nmax_in_flight = 1\n[tools.generate_image]\ncost = 1\n[limits.tenant]\nburst = 1000\n\
         [loop_detection]\nenabled = false\n{}",
        keys(&tenants)
    );
    let server = TestServer::start(&config).await;
    let mut clients = Vec::new();
    for t in tenants {
        clients.push(server.client(Some(&format!("{t}-key"))).await);
    }
    let mut owner = std::collections::HashMap::new();
    top_up(&clients, &mut owner).await;
    const STEPS: usize = 80;
    for step in 1..=STEPS {
        server.advance_secs(6.0);
        eventually("the next job started", || async { server.submissions().await.len() > step }).await;
        top_up(&clients, &mut owner).await;
    }
    let log = server.submissions().await;
    let mut share = [0usize; 4];
    for s in log.iter().skip(1).take(STEPS) {
        let key = if s.2.starts_with("k_") { None } else { Some(&s.2) };
        if let Some(t) = key.and_then(|k| owner.get(k)) {
            share[*t] += 1;
        }
    }
    let fair = STEPS / tenants.len();
    for (t, got) in share.iter().enumerate() {
        assert!(got.abs_diff(fair) * 10 <= fair, "tenant {t} got {got} of {STEPS}, fair is {fair}: {share:?}");
    }
}

#[tokio::test]
async fn a_full_queue_is_busy_with_a_wait_an_obedient_agent_can_honour() {
    let config = format!(
        "[upstream]\nmax_in_flight = 1\nqueue_max = 2\n[mock_upstream]\nimage_job_ms = 2000\n{}",
        keys(&["a", "b"])
    );
    let server = TestServer::start(&config).await;
    let a = server.client(Some("a-key")).await;
    let b = server.client(Some("b-key")).await;
    for i in 0..3 {
        assert!(!is_error(&call(&a, "generate_image", image(&format!("a{i}"))).await), "1 runs, 2 wait");
    }
    let before = call(&b, "rate_limit_status", json!({})).await;
    let full = call(&b, "generate_image", image("b0")).await;
    assert_eq!(error_code(&full), Some("busy"));
    assert_eq!(structured(&full)["error"]["scope"], "queue:upstream");
    let wait = structured(&full)["error"]["retry_after_ms"].as_u64().expect("a wait");
    assert_eq!(wait, 2000, "when the running job is next polled");
    let after = call(&b, "rate_limit_status", json!({})).await;
    assert_eq!(budget(&after, "caller:"), budget(&before, "caller:"), "busy cost nothing");

    server.advance_ms(wait);
    eventually("a place freed up", || async {
        let status = call(&b, "rate_limit_status", json!({})).await;
        structured(&status)["upstream_queue"]["waiting"] == 1
    })
    .await;
    assert!(!is_error(&call(&b, "generate_image", image("b0")).await), "after the wait it was told, it gets in");
}

/// Eight free-tier tenants (`f0`…`f7`, tier `default`) and a pro one (`pro-key`, tier `pro`),
/// on an account of 4 slots and 20 places, half of each reserved for pro.
fn free_and_pro() -> String {
    let free: String = (0..8).map(|i| format!("[[auth.keys]]\nkey = \"f{i}-key\"\ntenant = \"f{i}\"\n")).collect();
    format!(
        "[tiers]\npro = 1.0\n[upstream]\nmax_in_flight = 4\nqueue_max = 20\n[upstream.reserved]\npro = 0.5\n\
         [limits.in_flight]\ncaller = 50\ntenant = 50\n[loop_detection]\nenabled = false\n{free}\
         [[auth.keys]]\nkey = \"pro-key\"\ntenant = \"p\"\ntier = \"pro\"\n"
    )
}

#[tokio::test]
async fn free_tier_callers_flooding_the_account_never_delay_a_pro_callers_job_past_one_job_length() {
    let server = TestServer::start(&free_and_pro()).await;
    let mut free = Vec::new();
    for i in 0..8 {
        free.push(server.client(Some(&format!("f{i}-key"))).await);
    }
    // The flood: round after round over the free tenants, until the queue turns them away.
    let (mut accepted, mut refused) = (0, None);
    for round in 0..3 {
        for client in &free {
            let r = call(client, "generate_image", image(&format!("free {round}"))).await;
            if is_error(&r) { refused = Some(r) } else { accepted += 1 }
        }
    }
    assert_eq!(accepted, 4 + 10, "4 run and 10 wait: the other 10 places are pro's");
    let refused = refused.expect("the free tier was turned away");
    assert_eq!(error_code(&refused), Some("busy"));
    assert_eq!(structured(&refused)["error"]["scope"], "queue:upstream:reserved", "{}", text(&refused));
    assert!(structured(&refused)["error"]["retry_after_ms"].as_u64().is_some_and(|ms| ms > 0));

    // A pro caller of each era finds a place, and is next.
    let pro = server.client(Some("pro-key")).await;
    let r = call(&pro, "generate_image", image("pro, 2025-11-25")).await;
    assert_eq!(structured(&r)["queue_position"], 1, "next, however many free jobs wait: {}", text(&r));
    let first = structured(&r)["predict_id"].as_str().expect("id").to_owned();
    let steps = json!([
        {"op": "call", "tool": "generate_image", "args": {"prompt": "pro, 2026-07-28"}},
        {"op": "call", "tool": "rate_limit_status", "args": {}, "check_schema": true},
    ]);
    let walked = python::walk(&server.url, "auto", steps, &["-H", "Authorization: Bearer pro-key"]).await;
    assert_eq!(walked["protocol_version"], "2026-07-28", "{walked}");
    assert!(python::all_ok(&walked), "{walked}");
    let second = &walked["steps"][0]["ok"]["structured"];
    assert_eq!(second["queue_position"], 2, "behind pro's first only: {walked}");
    let second = second["predict_id"].as_str().expect("id").to_owned();
    let tier = &walked["steps"][1]["ok"]["structured"]["upstream_queue"]["tier"];
    assert_eq!(tier["tier"], "pro", "{walked}");
    assert_eq!(tier["draws_on_reservation"], true);
    assert_eq!((tier["reserved_slots"].as_u64(), tier["reserved_places"].as_u64()), (Some(2), Some(10)));
    assert_eq!((tier["in_flight"].as_u64(), tier["waiting"].as_u64()), (Some(0), Some(2)));
    let metrics = server.metrics().await;
    let sample = |of: &str| {
        metrics.lines().find(|l| {
            l.starts_with("mcp_ratelimit_account_tier_places{")
                && l.contains("tier=\"pro\"")
                && l.contains(&format!("of=\"{of}\""))
        })
    };
    assert!(sample("reserved").is_some_and(|l| l.ends_with(" 10")), "{metrics}");
    assert!(sample("waiting").is_some_and(|l| l.ends_with(" 2")), "{metrics}");

    // One job's length: the free jobs running end, and both of pro's go in the first slots freed.
    server.advance_secs(6.0);
    eventually("the freed slots were handed out", || async { server.submissions().await.len() >= 8 }).await;
    let log = server.submissions().await;
    let next: Vec<&str> = log[4..8].iter().map(|s| s.2.as_str()).collect();
    assert!(next.contains(&first.as_str()) && next.contains(&second.as_str()), "pro's jobs among {next:?}");
    let (started, pro_at) = (log[0].0, log.iter().filter(|s| s.2 == first || s.2 == second).map(|s| s.0).max());
    assert!(pro_at.is_some_and(|at| at - started <= 6 * NANOS_PER_SEC), "within one job's length of the flood");
}
