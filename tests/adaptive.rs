//! Adaptive concurrency toward the upstream (`[upstream.adaptive]`), through an MCP client on the
//! manual clock: the mock account's capacity changes under a running server (10 → 4 → 8) while
//! an agent keeps twenty images pending, and the limit the server learns — by AIMD, and by
//! Gradient2 — follows it, with few 429s and the throughput the capacity allows; the static cap
//! of 10, in the same run, meets several times the 429s. And when the upstream slows down without
//! refusing anything, Gradient2 (which reads the round-trip time of each submission on the
//! server's clock) lowers the limit where AIMD, which only hears 429s, keeps it.
//!
//! Over Redis, two instances in front of one mock learn one limit: a 429 one of them hears
//! lowers the limit the other hands out and shows, the slots both hold never exceed it, and a
//! Redis killed under them leaves each limiting locally, then sharing again once it is back.

mod common;
#[path = "common/redis.rs"]
mod test_redis;

use common::*;
use serde_json::json;
use test_redis::TestRedis;

/// The key the agent calls with, and limits out of its way: only the account's capacity binds.
const LIMITS: &str = "[[auth.keys]]\nkey = \"sk-adaptive-agent-7f3a91\"\ntenant = \"acme\"\n\
    [limits.http]\nburst = 1000000\nrefill_per_sec = 100000.0\n\
    [limits.method.tools_call]\nburst = 1000000\nrefill_per_sec = 100000.0\n\
    [limits.caller]\nburst = 1000000\nrefill_per_sec = 100000.0\n\
    [limits.tenant]\nburst = 1000000\nrefill_per_sec = 100000.0\n\
    [limits.in_flight]\ncaller = 1000\ntenant = 1000\naddress = 1000\n";

/// The account's queue: polls every second, retries as often as the upstream allows.
const UPSTREAM: &str =
    "[upstream]\nimage_poll_seconds = 1\nqueue_max = 100\nretry_budget_ratio = 1.0\nretry_budget_min_retries = 1000\n";

/// The embedded mock: one-second jobs, and 429s that say to come back a second later.
const MOCK: &str = "[mock_upstream]\nimage_job_ms = 1000\nretry_after_seconds = 1\n";

/// A server with the embedded mock, learning as `section` (`[upstream.adaptive]`) says.
fn config(section: &str) -> String {
    format!("{LIMITS}{UPSTREAM}{MOCK}{section}")
}

/// The capacity of each phase and how long it lasts, in seconds.
const PHASES: [(usize, u64); 3] = [(10, 15), (4, 30), (8, 30)];
/// How long the limit may take to follow a change, in seconds.
const FOLLOWS_WITHIN: u64 = 6;
/// The clock's step, in milliseconds.
const STEP_MS: u64 = 100;
/// The real time a step leaves the server to run what it woke. (4 ms once let Gradient2 hear a
/// probe's 429 only after answers a later step woke had grown its limit a slot further: 10 on an
/// account of 8, in one `make test`.)
const STEP_PAUSE: std::time::Duration = std::time::Duration::from_millis(8);

/// One of this file's tests at a time: a busy machine would slow the servers of both behind
/// their clocks.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

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

/// The agent asks for as many images as it lacks of twenty pending, `at_once` at a time at most
/// (`asked` counts its calls, to vary the prompt). A call that finds a slot free waits for the
/// upstream's answer, the others return at once with their place in the queue.
async fn top_up_to_twenty(
    agent: &Client,
    jobs: &mcp_ratelimit::upstream::jobs::Jobs,
    asked: &mut usize,
    at_once: usize,
) {
    let missing = 20usize.saturating_sub(jobs.in_flight()).min(at_once);
    let prompts: Vec<String> = (*asked..*asked + missing).map(|n| format!("image {n}")).collect();
    *asked += missing;
    let calls = prompts.iter().map(|prompt| call(agent, "generate_image", json!({ "prompt": prompt })));
    for r in futures::future::join_all(calls).await {
        assert!(!is_error(&r), "{}", text(&r));
    }
}

/// The learners compared with the static cap, as `[upstream.adaptive]` configures them. Gradient2
/// probes `queue_size` slots at a time (Netflix's 4 suits limits of tens); an account of 10
/// wants 1, as `config.toml` says.
const LEARNERS: [(&str, &str); 2] =
    [("aimd", "algorithm = \"aimd\"\n"), ("gradient2", "algorithm = \"gradient2\"\nqueue_size = 1\n")];

/// How many times a learner's 429s after a change the static cap meets at least, as a fraction.
/// AIMD probes one slot above the capacity per limit's worth of answers; Gradient2, at steady
/// latency, grows by smoothing × queue_size = 0.2 slot an answer, so it probes more often.
const FEWER_429S: [(usize, usize); 2] = [(5, 2), (3, 2)];

/// Runs the phases against a server learning as `learning` says (`None`: the static cap); what
/// each phase saw.
async fn run(learning: Option<&str>) -> Vec<Phase> {
    let adaptive = learning.is_some();
    let section = format!("[upstream.adaptive]\nenabled = {adaptive}\n{}", learning.unwrap_or_default());
    let server = TestServer::start(&config(&section)).await;
    let agent = server.client(Some("sk-adaptive-agent-7f3a91")).await;
    let jobs = server.app.state().behind.jobs().expect("our tools run jobs").clone();
    let mut phases = Vec::new();
    let mut asked = 0;
    let mut now_ms = 0u64;
    for (capacity, seconds) in PHASES {
        server.chaos(json!({ "max_concurrent_predictions": capacity })).await;
        let (start, settled) = (now_ms, now_ms + FOLLOWS_WITHIN * 1000);
        let mut limit = (usize::MAX, 0);
        let mut followed_ms = None;
        while now_ms < start + seconds * 1000 {
            // The agent keeps twenty images pending, one call after another.
            while jobs.in_flight() < 20 {
                top_up_to_twenty(&agent, &jobs, &mut asked, 1).await;
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
            tokio::time::sleep(STEP_PAUSE).await;
        }
        // The agent sees the learnt limit too: the one in force when it asked. The clock stands
        // still meanwhile, and what the last step woke has run (else a job still answering may
        // move it by a probe while the answer travels, so it is also read on both sides).
        settle().await;
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
    let _alone = ONE_AT_A_TIME.lock().await;
    // One after another: side by side they would slow each other behind their clocks.
    let fixed = run(None).await;
    let mut learnt = Vec::new();
    for (_, learning) in LEARNERS {
        learnt.push(run(Some(learning)).await);
    }
    for (((name, _), learnt), (times, over)) in LEARNERS.iter().zip(learnt).zip(FEWER_429S) {
        for (phase, (seconds, (l, f))) in PHASES.iter().map(|(_, s)| *s).zip(learnt.iter().zip(&fixed)).enumerate() {
            println!(
                "{name:>9}, capacity {:>2}: limit at it after {:?} ms, {}..{} after {FOLLOWS_WITHIN} s, accepted {} \
                 ({:.0} % of what it allows), 429s {}; static cap 10: accepted {}, 429s {}",
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
            assert!(
                l.accepted as f64 >= 0.85 * allowed,
                "{name} phase {phase}: {l:?}: throughput under 85 % of {allowed}"
            );
            assert!(
                l.limit.0 + 1 >= l.capacity && l.limit.1 <= l.capacity + 1,
                "{name} phase {phase}: the limit follows the capacity within {FOLLOWS_WITHIN} s: {l:?}"
            );
            if l.capacity < 10 {
                // The drain of the old limit's jobs, then the probes above the capacity: measured
                // 14 to 23 a phase for AIMD, 21 to 30 for Gradient2.
                assert!(l.refused <= 35, "{name} phase {phase}: at most 35 429s a change: {l:?}");
                // Measured 3.2× to 4.3× (AIMD), 1.9× to 4.1× (Gradient2).
                assert!(
                    f.refused * over >= l.refused * times,
                    "{name} phase {phase}: the static cap meets {times}/{over} × as many: {f:?} against {l:?}"
                );
            }
        }
    }
}

/// The latency the mock adds to every answer, in ms, and for how long, in seconds: steady, then
/// four times slower (an upstream whose requests queue), then back (for longer: the limit grows
/// back one step per sample, and a loaded machine's agent sends fewer per second of the clock).
const LATENCIES: [(u64, u64); 3] = [(100, 10), (400, 10), (100, 20)];

/// The limit a server learning as `learning` says handed out in each phase of [`LATENCIES`]
/// (lowest, highest), its capacity never reached, and the 429s it met.
async fn slow_down(learning: &str) -> (Vec<(usize, usize)>, usize) {
    let server = TestServer::start(&config(&format!("[upstream.adaptive]\nenabled = true\n{learning}"))).await;
    let agent = server.client(Some("sk-adaptive-agent-7f3a91")).await;
    let jobs = server.app.state().behind.jobs().expect("our tools run jobs").clone();
    // The clock walks by itself, 20 ms every 4 ms: a submission waits out its latency on it (and
    // the server measures it there), while the agent keeps its jobs pending.
    let clock = server.clock.clone();
    let ticking = tokio::spawn(async move {
        loop {
            clock.advance(std::time::Duration::from_millis(20));
            tokio::time::sleep(std::time::Duration::from_millis(4)).await;
        }
    });
    let now_ms = || mcp_ratelimit::clock::Clock::now(&*server.clock).as_u64() / 1_000_000;
    let mut asked = 0;
    let mut seen = Vec::new();
    for (latency_ms, seconds) in LATENCIES {
        server.chaos(json!({ "latency_ms": latency_ms })).await;
        let until = now_ms() + seconds * 1000;
        let mut limit = (usize::MAX, 0);
        while now_ms() < until {
            // All at once, then the limit is read: the clock does not wait for the agent.
            top_up_to_twenty(&agent, &jobs, &mut asked, 20).await;
            let slots = server.app.state().behind.slots();
            limit = (limit.0.min(slots), limit.1.max(slots));
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
        seen.push(limit);
    }
    ticking.abort();
    let refused = server.submissions().await.iter().filter(|(_, status, _)| *status == 429).count();
    (seen, refused)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gradient2_lowers_the_limit_when_the_upstream_slows_down_before_any_429_where_aimd_cannot() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let ((aimd, aimd_refused), (gradient2, gradient2_refused)) =
        tokio::join!(slow_down(LEARNERS[0].1), slow_down(LEARNERS[1].1));
    for ((latency_ms, _), (a, g)) in LATENCIES.iter().zip(aimd.iter().zip(&gradient2)) {
        println!("latency {latency_ms:>3} ms: gradient2's limit {}..{}, aimd's {}..{}", g.0, g.1, a.0, a.1);
    }
    assert_eq!((aimd_refused, gradient2_refused), (0, 0), "the account of 10 is never full");
    assert_eq!(aimd, vec![(10, 10); 3], "AIMD hears no 429: it keeps the ceiling");
    assert_eq!(gradient2[0], (10, 10), "steady latency: the ceiling");
    // Four times slower: the gradient is at its floor, 0.5, and the limit falls towards
    // queue_size / (1 − 0.5) = 2 until the long-term RTT catches up.
    assert!(gradient2[1].0 <= 5, "slower answers lower the limit: {gradient2:?}");
    assert_eq!(gradient2[2].1, 10, "back to 100 ms: the limit grows back to the ceiling: {gradient2:?}");
}

/// Two servers on one Redis in front of one mock (on the test's own clock), learning the
/// account's limit by AIMD under a ceiling of 10, with an agent each (the same key).
struct Shared {
    redis: TestRedis,
    mock_clock: std::sync::Arc<mcp_ratelimit::clock::ManualClock>,
    _mock: mcp_ratelimit::mock_upstream::MockUpstream,
    servers: [TestServer; 2],
    agents: [Client; 2],
}

impl Shared {
    /// The mock runs an image job `job_ms` on its clock, which moves only when the test moves it.
    async fn start(job_ms: u64) -> Self {
        let redis = TestRedis::private();
        let (mock_clock, mock) = shared_mock_running(job_ms).await;
        let toml = format!(
            "{LIMITS}{UPSTREAM}url = \"{}\"\n[upstream.adaptive]\nenabled = true\n\
             [store]\nbackend = \"redis\"\nredis_url = \"{}\"\ntimeout_ms = 200\n\
             [tools.generate_image]\nfail = \"open\"\n",
            mock.url, redis.url
        );
        let servers = [TestServer::start(&toml).await, TestServer::start(&toml).await];
        let agents = [
            servers[0].client(Some("sk-adaptive-agent-7f3a91")).await,
            servers[1].client(Some("sk-adaptive-agent-7f3a91")).await,
        ];
        Self { redis, mock_clock, _mock: mock, servers, agents }
    }

    /// The slots every instance holds in Redis, and the whole slots the learnt limit hands out.
    async fn in_redis(&self) -> (u64, u64) {
        let mut connection = redis::Client::open(self.redis.url.as_str())
            .expect("url")
            .get_multiplexed_async_connection()
            .await
            .expect("redis");
        // The live leases' units (concurrency.lua's state), and the learnt state (adaptive.lua's).
        let (units, learnt): (u64, String) = redis::Script::new(
            "local t = redis.call('TIME') local now = t[1] * 1000000 + t[2] \
             local f = {} for w in string.gmatch(redis.call('GET', KEYS[1]) or '', '%S+') do f[#f + 1] = w end \
             local units = 0 for i = 2, #f, 3 do if tonumber(f[i + 2]) > now then units = units + f[i + 1] end end \
             return {units, redis.call('GET', KEYS[2]) or ''}",
        )
        .key("{upstream}account:in_flight")
        .key("{upstream}account:learnt")
        .invoke_async(&mut connection)
        .await
        .expect("reads Redis");
        let limit = learnt.split(' ').nth(1).and_then(|l| l.parse::<f64>().ok()).unwrap_or(10.0);
        (units, (limit.floor() as u64).clamp(1, 10))
    }

    /// What `rate_limit_status` shows an agent of instance `i` of the account.
    async fn status(&self, i: usize) -> serde_json::Value {
        structured(&call(&self.agents[i], "rate_limit_status", json!({})).await)["upstream_queue"].clone()
    }
}

async fn image(agent: &Client, prompt: &str) -> serde_json::Value {
    let r = call(agent, "generate_image", json!({ "prompt": prompt })).await;
    r.structured_content.clone().unwrap_or_else(|| json!({ "text": text(&r) }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_one_instance_hears_lowers_the_limit_the_other_hands_out_and_shows() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let shared = Shared::start(1_000).await;
    let (a, b) = (&shared.agents[0], &shared.agents[1]);
    shared.servers[0].chaos(json!({ "max_concurrent_predictions": 6 })).await;
    for i in 0..6 {
        let r = image(a, &format!("a{i}")).await;
        assert!(r["predict_id"].is_string(), "{r}");
    }
    assert_eq!(shared.status(1).await["account_max_in_flight"], 10, "nothing refused yet: the ceiling");
    // A's seventh meets the account's 429 (six jobs run on it): A cuts the one limit to the six
    // others that ran.
    let refused = call(a, "generate_image", json!({ "prompt": "a6" })).await;
    assert_eq!(error_code(&refused), Some("upstream_rate_limited"), "{}", text(&refused));
    let status = shared.status(1).await;
    assert_eq!(
        (&status["account_max_in_flight"], &status["account_adaptive"], &status["account_ceiling"]),
        (&json!(6), &json!(true), &json!(10)),
        "B shows the limit A learnt: {status}"
    );
    let metrics = shared.servers[1].metrics().await;
    assert!(metrics.contains("mcp_ratelimit_upstream_concurrency_limit 6"), "{metrics}");
    // B hands out no seventh slot: its image waits, though B holds none and the ceiling is 10.
    let waiting = image(b, "b0").await;
    assert!(waiting["queue_position"].is_u64(), "B's image waits under the learnt 6: {waiting}");
    let created = || async { shared.servers[0].upstream_usage().await["predictions_created"].as_u64() };
    assert_eq!(created().await, Some(6));
    let held = |s: &Shared| s.servers.iter().map(|s| s.app.state().behind.occupancy().in_flight as u64).sum::<u64>();
    assert_eq!((held(&shared), shared.in_redis().await), (6, (6, 6)), "six slots held of six");

    // A job of A's ends: B's waiting image takes the slot (its dispatcher asks again a second
    // later on its clock), and the slots held stay within the limit.
    let first = call(a, "rate_limit_status", json!({})).await;
    let id = structured(&first)["jobs_in_flight"][0]["predict_id"].as_str().expect("a job").to_owned();
    let r = call(a, "cancel_prediction", json!({ "predict_id": id })).await;
    assert_eq!(structured(&r)["status"], "canceled", "{}", text(&r));
    eventually("B's image started in the freed slot", || async {
        shared.servers[1].advance_ms(1_000);
        created().await == Some(7)
    })
    .await;
    let (units, limit) = shared.in_redis().await;
    assert!(units <= limit && held(&shared) <= limit, "{units} slots in Redis, {} held, limit {limit}", held(&shared));
    // And A's next image, with A holding five, waits too: B took the sixth.
    let waiting = image(a, "a7").await;
    assert!(waiting["queue_position"].is_u64(), "A's image waits: {waiting}");
    settle().await;
    assert_eq!(created().await, Some(7), "no seventh job on the account");
    assert_eq!(shared.status(0).await["account_max_in_flight"], shared.status(1).await["account_max_in_flight"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_under_load_never_hold_more_slots_than_the_limit_they_learn() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let shared = Shared::start(1_000).await;
    shared.servers[0].chaos(json!({ "max_concurrent_predictions": 4 })).await;
    let jobs = shared.servers.each_ref().map(|s| s.app.state().behind.jobs().expect("our tools run jobs").clone());
    let mut asked = 0;
    let (mut lowest, mut highest, mut transient) = (u64::MAX, 0, 0);
    for _ in 0..120 {
        // Each agent keeps eight images pending on its instance (an image submitted in its call
        // may meet the account's 429 itself: the agent asks again at the next step).
        for (agent, jobs) in shared.agents.iter().zip(&jobs) {
            while jobs.in_flight() < 8 {
                asked += 1;
                let r = call(agent, "generate_image", json!({ "prompt": format!("image {asked}") })).await;
                if error_code(&r) == Some("upstream_rate_limited") {
                    break;
                }
                assert!(!is_error(&r), "{}", text(&r));
            }
        }
        for server in &shared.servers {
            server.advance_ms(STEP_MS);
        }
        shared.mock_clock.advance(std::time::Duration::from_millis(STEP_MS));
        tokio::time::sleep(STEP_PAUSE).await;
        let (mut units, mut limit) = shared.in_redis().await;
        if units > limit {
            // A slot that met a 429 has cut the limit and is on its way back: with the clocks
            // standing still nothing new is claimed, so a slot taken above the limit would stay.
            transient += 1;
            settle().await;
            (units, limit) = shared.in_redis().await;
        }
        assert!(units <= limit, "{units} slots held in Redis by both instances, above the learnt {limit}");
        (lowest, highest) = (lowest.min(limit), highest.max(limit));
    }
    let refused = shared.servers[0].submissions().await.iter().filter(|(_, status, _)| *status == 429).count();
    let created = shared.servers[0].upstream_usage().await["predictions_created"].as_u64().expect("count");
    println!(
        "two instances, capacity 4, 12 s: limit {lowest}..{highest}, {created} jobs, {refused} 429s, \
         {transient} readings with a 429's slot not yet back"
    );
    assert!(lowest >= 3 && highest <= 6, "about the capacity, from the first 429 on: {lowest}..{highest}");
    // Answers still on their way (a freed slot is taken again at once) may move the limit once
    // more: what every instance shows is the one limit as it stands when asked.
    settle().await;
    let (_, limit) = shared.in_redis().await;
    assert!((4..=5).contains(&limit), "the limit learnt is the capacity, or one probe above: {limit}");
    eventually("every instance shows the one limit", || async {
        let (_, limit) = shared.in_redis().await;
        shared.status(0).await["account_max_in_flight"] == limit
            && shared.status(1).await["account_max_in_flight"] == limit
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_killed_under_two_instances_leaves_each_limiting_locally_then_they_share_again() {
    let _alone = ONE_AT_A_TIME.lock().await;
    let mut shared = Shared::start(60_000).await;
    for i in 0..4 {
        assert!(image(&shared.agents[0], &format!("before {i}")).await["predict_id"].is_string());
    }
    shared.redis.kill();
    // Neither instance panics nor stops: each claims its slots under its own limit meanwhile
    // (generate_image fails open here, so the insurance limiter admits the calls).
    for (i, agent) in shared.agents.iter().enumerate() {
        for n in 0..2 {
            let r = image(agent, &format!("down {i} {n}")).await;
            assert!(r["predict_id"].is_string(), "instance {i} serves while Redis is down: {r}");
        }
    }
    assert_eq!(shared.servers[0].upstream_usage().await["predictions_created"], 8);
    for server in &shared.servers {
        let metrics = server.metrics().await;
        assert!(
            metric_sum(&metrics, "mcp_ratelimit_store_errors_total{layer=\"account\"}") >= 1.0,
            "the failure is counted: {metrics}"
        );
        assert!(metrics.contains("mcp_ratelimit_upstream_concurrency_limit 10"), "its own limit: {metrics}");
    }
    // Redis comes back, empty: a second later on each clock the instances claim and learn there
    // again, and show one value.
    shared.redis.restart();
    for server in &shared.servers {
        server.advance_ms(1_000);
    }
    eventually("an image is claimed in Redis again", || async {
        for server in &shared.servers {
            server.advance_ms(1_000);
        }
        let r = image(&shared.agents[1], "after").await;
        r["predict_id"].is_string() && shared.in_redis().await.0 >= 1
    })
    .await;
    let (_, limit) = shared.in_redis().await;
    for i in 0..2 {
        assert_eq!(shared.status(i).await["account_max_in_flight"], limit, "instance {i} shows the shared limit");
    }
}
