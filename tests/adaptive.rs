//! Adaptive concurrency toward the upstream (`[upstream.adaptive]`), through an MCP client on the
//! manual clock: the mock account's capacity changes under a running server (10 → 4 → 8) while
//! an agent keeps twenty images pending, and the limit the server learns follows it, with few
//! 429s and the throughput the capacity allows; the static cap of 10, in the same run, meets
//! several times the 429s.

mod common;

use common::*;
use serde_json::json;

/// The key the agent calls with, and limits out of its way: only the account's capacity binds.
const CONFIG: &str = "[[auth.keys]]\nkey = \"sk-adaptive-agent-7f3a91\"\ntenant = \"acme\"\n\
    [limits.http]\nburst = 1000000\nrefill_per_sec = 100000.0\n\
    [limits.method.tools_call]\nburst = 1000000\nrefill_per_sec = 100000.0\n\
    [limits.caller]\nburst = 1000000\nrefill_per_sec = 100000.0\n\
    [limits.tenant]\nburst = 1000000\nrefill_per_sec = 100000.0\n\
    [limits.in_flight]\ncaller = 1000\ntenant = 1000\naddress = 1000\n\
    [upstream]\nimage_poll_seconds = 1\nqueue_max = 100\nretry_budget_ratio = 1.0\nretry_budget_min_retries = 1000\n\
    [mock_upstream]\nimage_job_ms = 1000\nretry_after_seconds = 1\n";

/// The capacity of each phase and how long it lasts, in seconds.
const PHASES: [(usize, u64); 3] = [(10, 15), (4, 30), (8, 30)];
/// How long the limit may take to follow a change, in seconds.
const FOLLOWS_WITHIN: u64 = 6;
/// The clock's step, in milliseconds.
const STEP_MS: u64 = 100;

#[derive(Debug, Default, Clone, Copy)]
struct Phase {
    capacity: usize,
    /// Submissions the upstream took, after the limit had had its time to follow.
    accepted: usize,
    /// Its 429s, the whole phase.
    refused: usize,
    /// The limit the server handed out, lowest and highest, after its time to follow.
    limit: (usize, usize),
    /// How long after the change the limit first stood at the capacity.
    followed_ms: Option<u64>,
}

/// Runs the phases against a server with `adaptive` on or off; what each phase saw.
async fn run(adaptive: bool) -> Vec<Phase> {
    let server = TestServer::start(&format!("{CONFIG}[upstream.adaptive]\nenabled = {adaptive}\n")).await;
    let agent = server.client(Some("sk-adaptive-agent-7f3a91")).await;
    let jobs = server.app.state().behind.jobs().expect("our tools run jobs").clone();
    let mut phases = Vec::new();
    let mut asked = 0u64;
    let mut now_ms = 0u64;
    for (capacity, seconds) in PHASES {
        server.chaos(json!({ "max_concurrent_predictions": capacity })).await;
        let (start, settled) = (now_ms, now_ms + FOLLOWS_WITHIN * 1000);
        let mut limit = (usize::MAX, 0);
        let mut followed_ms = None;
        while now_ms < start + seconds * 1000 {
            // The agent keeps twenty images pending.
            while jobs.in_flight() < 20 {
                asked += 1;
                let r = call(&agent, "generate_image", json!({ "prompt": format!("image {asked}") })).await;
                assert!(!is_error(&r), "{}", text(&r));
            }
            let slots = server.app.state().behind.slots();
            if followed_ms.is_none() && slots == capacity {
                followed_ms = Some(now_ms - start);
            }
            if now_ms >= settled {
                limit = (limit.0.min(slots), limit.1.max(slots));
            }
            server.advance_ms(STEP_MS);
            now_ms += STEP_MS;
            // Lets the woken jobs, polls and the dispatcher run before the next step.
            tokio::time::sleep(std::time::Duration::from_millis(4)).await;
        }
        // The agent sees the learnt limit too: the one in force when it asked (the jobs still in
        // flight may move it by a probe while the answer travels, so it is read on both sides).
        let before = server.app.state().behind.slots() as u64;
        let status = structured(&call(&agent, "rate_limit_status", json!({})).await)["upstream_queue"].clone();
        let after = server.app.state().behind.slots() as u64;
        assert_eq!(status["account_adaptive"], adaptive, "{status}");
        assert_eq!(status["account_ceiling"], 10, "{status}");
        if adaptive {
            let shown = status["account_max_in_flight"].as_u64().expect("a count");
            assert!(shown == before || shown == after, "{shown} is the limit before ({before}) or after ({after})");
        }
        let ns = |ms: u64| ms * 1_000_000;
        let submissions = server.submissions().await;
        let within = |from: u64, status: u16| {
            submissions.iter().filter(|(at, s, _)| *at >= ns(from) && *at < ns(now_ms) && *s == status).count()
        };
        phases.push(Phase {
            capacity,
            accepted: within(settled, 201),
            refused: within(start, 429),
            limit,
            followed_ms,
        });
    }
    phases
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_learnt_limit_follows_the_accounts_capacity_with_few_429s_where_a_static_cap_meets_many() {
    let learnt = run(true).await;
    let fixed = run(false).await;
    for (phase, (seconds, (l, f))) in PHASES.iter().map(|(_, s)| *s).zip(learnt.iter().zip(&fixed)).enumerate() {
        println!(
            "capacity {:>2}: adaptive limit at it after {:?} ms, {}..{} after {FOLLOWS_WITHIN} s, accepted {} ({:.0} % of \
             what it allows), 429s {}; static cap 10: accepted {}, 429s {}",
            l.capacity,
            l.followed_ms,
            l.limit.0,
            l.limit.1,
            l.accepted,
            100.0 * l.accepted as f64 / (l.capacity as f64 * (seconds - FOLLOWS_WITHIN) as f64),
            l.refused,
            f.accepted,
            f.refused,
        );
        let allowed = l.capacity as f64 * (seconds - FOLLOWS_WITHIN) as f64;
        assert!(l.accepted as f64 >= 0.85 * allowed, "phase {phase}: {l:?}: throughput under 85 % of {allowed}");
        assert!(
            l.limit.0 + 1 >= l.capacity && l.limit.1 <= l.capacity + 1,
            "phase {phase}: the limit follows the capacity within {FOLLOWS_WITHIN} s: {l:?}"
        );
        if l.capacity < 10 {
            // The drain of the old limit's jobs, then one probe above the capacity per limit's worth
            // of accepted jobs: measured 13 to 22 a phase.
            assert!(l.refused <= 30, "phase {phase}: at most 30 429s a change: {l:?}");
            // Measured 3.3× to 4.4×.
            assert!(
                f.refused >= l.refused * 5 / 2,
                "phase {phase}: the static cap meets far more: {f:?} against {l:?}"
            );
        }
    }
}
