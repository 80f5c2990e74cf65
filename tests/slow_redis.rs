//! A slow or lossy Redis, through the binary: Redis behind a proxy of the test's own that adds
//! latency and loses segments (held for a retransmission timeout, as TCP turns loss into a
//! stall). No request waits longer than `store.timeout_ms` plus a small margin; the fail-closed
//! tool (`save_article`) refuses `limiter_unavailable` and the fail-open one (`list_articles`)
//! is served by the insurance limiter; when the latency goes away, shared limits resume by
//! themselves. Prints the figures docs/resilience.md quotes (`--nocapture`).

mod common;
#[path = "common/process.rs"]
mod process;
#[path = "common/slow_link.rs"]
mod slow_link;
#[path = "common/redis.rs"]
mod test_redis;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::metric_sum;
use process::{Server, Session, quantile};
use serde_json::json;
use slow_link::Impairment;

/// `store.timeout_ms` in this test.
const STORE_TIMEOUT: Duration = Duration::from_millis(200);
/// What a request may take beyond it: the server's own work in a debug build on a loaded
/// 2-core machine (a few ms when quiet).
const MARGIN: Duration = Duration::from_millis(150);
/// One phase's calls: how long each took, and what each answered.
#[derive(Default)]
struct Phase {
    took: Vec<Duration>,
    outcomes: BTreeMap<String, usize>,
}

impl Phase {
    fn outcome(&self, what: &str) -> usize {
        self.outcomes.get(what).copied().unwrap_or(0)
    }

    fn line(&self, name: &str) -> String {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let outcomes: Vec<String> = self.outcomes.iter().map(|(k, v)| format!("{k} {v}")).collect();
        format!(
            "{name:<44} p50 {:>6.1} ms  p99 {:>6.1} ms  max {:>6.1} ms  {}",
            ms(quantile(&self.took, 0.5)),
            ms(quantile(&self.took, 0.99)),
            ms(self.took.iter().max().copied().unwrap_or_default()),
            outcomes.join(", ")
        )
    }
}

/// Calls alternating the fail-open and the fail-closed tool for `span`, each timed (long
/// enough for the store breaker to probe Redis several times: once a second).
async fn run_phase(caller: &Session, span: Duration, tag: &str) -> Phase {
    let mut phase = Phase::default();
    let started = Instant::now();
    for i in 0.. {
        if i % 2 == 0 && started.elapsed() >= span {
            break;
        }
        let (tool, args) = if i % 2 == 0 {
            ("list_articles", json!({"query": format!("{tag} {i}")}))
        } else {
            ("save_article", json!({"title": format!("{tag} {i}"), "body": "b"}))
        };
        let started = Instant::now();
        let answer = caller.call(tool, args).await.expect("every call is answered");
        phase.took.push(started.elapsed());
        let outcome = match (answer.status, answer.code()) {
            (200, None) if !answer.is_error() => format!("{tool} served"),
            (200, Some(code)) => format!("{tool} {code}"),
            (status, _) => format!("{tool} HTTP {status}"),
        };
        *phase.outcomes.entry(outcome).or_default() += 1;
    }
    phase
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_or_lossy_redis_costs_a_request_at_most_the_store_timeout_and_service_returns() {
    let redis = test_redis::TestRedis::private();
    let impairment = Arc::new(Impairment::default());
    let proxy = slow_link::start(slow_link::address_of(&redis.url), impairment.clone()).await;
    // Budgets roomy enough that only the store's health decides; list_articles fails open.
    let config = format!(
        "[store]\nbackend = \"redis\"\nredis_url = \"redis://{proxy}/\"\ntimeout_ms = {}\n\
         [tools.list_articles]\nfail = \"open\"\n[tools.save_article]\nfail = \"closed\"\n\
         [limits.http]\nburst = 100000\n[limits.address_http]\nburst = 100000\n\
         [limits.method.tools_call]\nburst = 100000\n\
         [limits.caller]\nburst = 100000\n[limits.address]\nburst = 1000000\n[loop_detection]\nenabled = false\n",
        STORE_TIMEOUT.as_millis()
    );
    let server = Server::start(&config, &[]).await;
    let http = reqwest::Client::new();
    let mut caller = Session::new(&http, &server.url, "patient-agent");
    assert_eq!(caller.open().await.expect("open"), 200);
    run_phase(&caller, Duration::from_millis(500), "warm-up").await;

    let healthy = run_phase(&caller, Duration::from_secs(2), "healthy").await;
    // Slow but within the timeout: every decision waits on Redis, which is work, not a queue in
    // front of the server, so nobody is shed (`[server.shedding]`, target 100 ms).
    impairment.latency_ms.store(60, Ordering::Relaxed);
    let sluggish = run_phase(&caller, Duration::from_secs(3), "sluggish").await;
    let metrics_sluggish = server.metrics().await;
    impairment.latency_ms.store(500, Ordering::Relaxed);
    let slow = run_phase(&caller, Duration::from_secs(4), "slow").await;
    // Sampled where the answer cannot depend on the instant: while every round trip takes
    // 500 ms each way, no decision (and no probe) can succeed. In the lossy phase a probe may
    // just have got through, so its gauge is not read there.
    let metrics_down = server.metrics().await;
    impairment.latency_ms.store(20, Ordering::Relaxed);
    impairment.loss_per_mille.store(100, Ordering::Relaxed);
    let lossy = run_phase(&caller, Duration::from_secs(6), "lossy").await;

    impairment.latency_ms.store(0, Ordering::Relaxed);
    impairment.loss_per_mille.store(0, Ordering::Relaxed);
    let healed = Instant::now();
    let mut i = 0;
    process::wait_until("the fail-closed tool is served again", Duration::from_secs(15), || {
        i += 1;
        let caller = caller.clone();
        async move {
            let answer = caller.call("save_article", json!({"title": format!("back {i}"), "body": "b"})).await;
            answer.is_ok_and(|a| a.status == 200 && !a.is_error())
        }
    })
    .await;
    let recovered_in = healed.elapsed();
    let recovered = run_phase(&caller, Duration::from_secs(2), "recovered").await;
    let metrics_up = server.metrics().await;

    println!("slow and lossy Redis (store.timeout_ms {}), one caller, tool calls in turn:", STORE_TIMEOUT.as_millis());
    println!("{}", healthy.line("healthy"));
    println!("{}", sluggish.line("+60 ms each way"));
    println!("{}", slow.line("+500 ms each way"));
    println!("{}", lossy.line("+20 ms, 10 % of segments held 1 s"));
    println!("{}", recovered.line("healthy again"));
    println!("fail-closed tool served again {recovered_in:.2?} after the latency went away");
    println!("panics: {}", server.process.panics());

    assert_eq!(server.process.panics(), 0, "{}", server.process.log());
    let phases =
        [("healthy", &healthy), ("sluggish", &sluggish), ("slow", &slow), ("lossy", &lossy), ("recovered", &recovered)];
    for (name, phase) in phases {
        let slowest = phase.took.iter().max().copied().unwrap_or_default();
        assert!(slowest <= STORE_TIMEOUT + MARGIN, "{name}: a request waited {slowest:?}");
        assert!(phase.outcomes.keys().all(|k| !k.contains("HTTP")), "{name}: {:?}", phase.outcomes);
    }
    assert!(metrics_sluggish.contains("mcp_ratelimit_shed_level 0"), "a slow store is not overload");
    for phase in [&healthy, &sluggish, &recovered] {
        assert_eq!(phase.outcome("list_articles served") + phase.outcome("save_article served"), phase.took.len());
    }
    // Redis too slow to answer in time: closed refuses, open is served (by the insurance).
    let half = slow.took.len() / 2;
    assert_eq!(slow.outcome("save_article limiter_unavailable"), half, "{:?}", slow.outcomes);
    assert_eq!(slow.outcome("list_articles served"), half, "{:?}", slow.outcomes);
    // Lossy: the closed tool served when Redis answered in time and refused when not, the open
    // one always served.
    let half = lossy.took.len() / 2;
    assert_eq!(lossy.outcome("list_articles served"), half, "{:?}", lossy.outcomes);
    assert_eq!(
        lossy.outcome("save_article served") + lossy.outcome("save_article limiter_unavailable"),
        half,
        "{:?}",
        lossy.outcomes
    );
    assert!(metrics_down.contains("mcp_ratelimit_store_up 0"), "store_up while too slow to answer");
    assert!(metric_sum(&metrics_down, "mcp_ratelimit_store_errors_total") >= 1.0);
    assert!(metrics_up.contains("mcp_ratelimit_store_up 1"), "store_up after");
}
