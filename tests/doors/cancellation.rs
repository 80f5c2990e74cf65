//! Calls cancelled at every point of their path give back everything they held, at every door:
//! the reference server (`serve`), the proxy, and the library's `LimitedRouter`; on the memory
//! store and on a Redis behind a link that adds 100 ms each way (so a decision, a claim of the
//! upstream account's slot and a settlement each take 200 ms, and a cancel lands inside them).
//!
//! A storm of calls, each cancelled (`notifications/cancelled`) a different time after it was
//! sent — from at once to past the store's round trips, the wait in the fair queue and the
//! upstream's own work — and then every count must be back to zero: the account's slots in use,
//! the queue's waiting jobs, the admissions in flight, and on Redis every in-flight lease. Then
//! the caps admit as many calls as they hold: nothing leaked.
//!
//! Waiting for a cancelled call's cleanup is waiting for tasks, not for a window: the loops are
//! bounded and poll. The servers' own clocks do not move but where a test says so.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::common::{Client, TestServer, call, error_code, metric_sum, text};
use crate::slow_link::Impairment;
use crate::test_redis::TestRedis;
use crate::{common, slow_link};
use mcp_ratelimit::clock::ManualClock;
use mcp_ratelimit::config::{Catalogue, Config};
use mcp_ratelimit::limit::{Concurrency, Limiter};
use mcp_ratelimit::proxy::{ChildEnv, Target};
use mcp_ratelimit::store::{Check, Lease, RedisStore};
use mcp_ratelimit::{App, LimitedRouter, RateLimits};
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolRequest, CallToolRequestParams, ClientRequest, ProtocolVersion};
use rmcp::service::PeerRequestOptions;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::{ClientLifecycleMode, ClientServiceExt, ServerHandler, tool, tool_handler, tool_router};
use serde_json::{Value, json};

/// Each way, between a server and its Redis.
const LINK: Duration = Duration::from_millis(100);

/// How long every count has to come back to zero once the storm is over.
const CLEANUP: Duration = Duration::from_secs(10);

/// Budgets no storm comes near: what must come back is slots.
const ROOMY: &str = "[limits.caller]\nalgorithm = \"token_bucket\"\nburst = 100000\nrefill_per_sec = 1000\n\
                     [limits.address]\nalgorithm = \"token_bucket\"\nburst = 100000\nrefill_per_sec = 1000\n\
                     [limits.http]\nburst = 100000\nrefill_per_sec = 1000\n\
                     [limits.address_http]\nburst = 100000\nrefill_per_sec = 1000\n\
                     [limits.method.tools_call]\nburst = 100000\nrefill_per_sec = 1000\n\
                     [limits.method.other]\nburst = 100000\nrefill_per_sec = 1000\n";

/// After how long each call of a storm is cancelled: at once, then every 35 ms to 0.8 s.
fn cancel_points() -> impl Iterator<Item = Duration> {
    (0..24u64).map(|i| Duration::from_millis(i * 35))
}

/// Where a server under test keeps its limits.
enum Backend {
    Memory,
    /// A Redis of the test's own, reached through a slow link.
    SlowRedis {
        redis: TestRedis,
        link: SocketAddr,
    },
}

impl Backend {
    async fn slow_redis() -> Self {
        let redis = TestRedis::private();
        let link = slow_link::start(slow_link::address_of(&redis.url), Impairment::latency(LINK)).await;
        Backend::SlowRedis { redis, link }
    }

    /// The `[store]` section: a timeout well above the link's round trip, so decisions are slow
    /// but never fail here.
    fn toml(&self) -> String {
        match self {
            Backend::Memory => String::new(),
            Backend::SlowRedis { link, .. } => {
                format!("[store]\nbackend = \"redis\"\nredis_url = \"redis://{link}/\"\ntimeout_ms = 3000\n")
            }
        }
    }

    /// The in-flight units every lease in Redis still holds (none for the memory store).
    async fn leased_units(&self) -> u64 {
        match self {
            Backend::Memory => 0,
            Backend::SlowRedis { redis, .. } => leased_units(&redis.url).await,
        }
    }
}

/// The units of every live lease on every in-flight key (`concurrency <lease> <units>
/// <expires_us> …`, as `concurrency.lua` keeps them), on Redis's clock.
async fn leased_units(url: &str) -> u64 {
    let client = redis::Client::open(url).expect("url");
    let mut redis = client.get_multiplexed_async_connection().await.expect("connects to Redis");
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut redis).await.expect("TIME");
    let now_us = secs * 1_000_000 + micros;
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query_async(&mut redis).await.expect("KEYS");
    let mut units = 0;
    for key in keys {
        let Ok(Some(value)) = redis::cmd("GET").arg(&key).query_async::<Option<String>>(&mut redis).await else {
            continue;
        };
        let mut words = value.split(' ');
        if words.next() != Some("concurrency") {
            continue;
        }
        let fields: Vec<u64> = words.filter_map(|w| w.parse().ok()).collect();
        units += fields.chunks(3).filter(|l| l.len() == 3 && l[2] > now_us).map(|l| l[1]).sum::<u64>();
    }
    units
}

/// Sends a call of `tool` with `args`, and cancels it `after` its sending, whatever became of it.
async fn cancelled_after(client: &Client, tool: &str, args: Value, after: Duration) {
    let Value::Object(args) = args else { panic!("arguments are an object") };
    let params = CallToolRequestParams::new(tool.to_owned()).with_arguments(args);
    let request = ClientRequest::CallToolRequest(CallToolRequest::new(params));
    let Ok(handle) = client.peer().send_cancellable_request(request, PeerRequestOptions::no_options()).await else {
        return;
    };
    // Real time on purpose: the cancel races real round trips to Redis and to the upstream.
    tokio::time::sleep(after).await;
    let _ = handle.cancel(Some("the test stops waiting".to_owned())).await;
}

/// The two protocol eras a client may speak.
#[derive(Debug, Clone, Copy)]
enum Era {
    /// 2025-11-25: the initialize handshake, a session.
    Handshake,
    /// 2026-07-28: no session, every request on its own.
    Stateless,
}

const ERAS: [Era; 2] = [Era::Handshake, Era::Stateless];

impl Era {
    async fn client(self, url: &str) -> Client {
        match self {
            Era::Handshake => common::client_of(url).await,
            Era::Stateless => modern_client(url).await,
        }
    }
}

/// One call of `tool` per cancel point, all at once, each from a client of its own (a session's
/// requests would queue behind each other in the client) and cancelled at its point; the `i`th
/// call's arguments are `args(i)`.
async fn storm(url: &str, era: Era, tool: &str, args: impl Fn(usize) -> Value) {
    let mut clients = Vec::new();
    for _ in cancel_points() {
        clients.push(Arc::new(era.client(url).await));
    }
    let calls: Vec<_> = cancel_points()
        .zip(clients)
        .enumerate()
        .map(|(i, (after, client))| {
            let (tool, args) = (tool.to_owned(), args(i));
            tokio::spawn(async move { cancelled_after(&client, &tool, args, after).await })
        })
        .collect();
    for call in calls {
        call.await.expect("a cancelled call");
    }
}

/// Waits until `counts` (name, value) are all zero, bounded; panics naming those that are not.
async fn all_back_to_zero<F, Fut>(door: &str, mut counts: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Vec<(&'static str, f64)>>,
{
    let mut last = Vec::new();
    let started = std::time::Instant::now();
    while started.elapsed() < CLEANUP {
        last = counts().await;
        if last.iter().all(|(_, v)| *v == 0.0) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{door}: counts still held {CLEANUP:?} after the storm: {last:?}");
}

/// The counts a server's `/metrics` says: the account's slots, the queue, admissions, jobs.
fn held(exposition: &str) -> Vec<(&'static str, f64)> {
    ["mcp_ratelimit_account_slots_in_use", "mcp_ratelimit_queue_depth", "mcp_ratelimit_in_flight_calls"]
        .into_iter()
        .chain(exposition.contains("mcp_ratelimit_jobs_in_flight").then_some("mcp_ratelimit_jobs_in_flight"))
        .map(|metric| (metric, metric_sum(exposition, metric)))
        .collect()
}

/// A client of the 2026-07-28 protocol: no session, every request on its own.
async fn modern_client(url: &str) -> Client {
    let transport = StreamableHttpClientTransport::from_config(StreamableHttpClientTransportConfig::with_uri(url));
    let mode = ClientLifecycleMode::Discover { preferred_versions: vec![ProtocolVersion::V_2026_07_28] };
    ().serve_with_lifecycle(transport, mode).await.expect("a 2026-07-28 client connects")
}

// ---- the reference server -------------------------------------------------------------------

/// Image jobs: the caller's slots taken in the guard's decision, the account's slot claimed in
/// the store, the submission held at the mock (its latency is on the server's clock) until the
/// test moves the clock. Generous caps, so calls reach every point; a leak shows in the counts.
fn serve_toml(backend: &Backend) -> String {
    format!(
        "{}{}{ROOMY}{}[upstream]\nmax_in_flight = 50\n[mock_upstream]\nlatency_ms = 1000\nmax_concurrent_predictions = 1000\n",
        backend.toml(),
        common::NO_LOOP_DETECTION,
        common::ROOMY_IN_FLIGHT,
    )
}

async fn serve_storm(backend: Backend, era: Era) {
    let server = TestServer::start(&serve_toml(&backend)).await;
    storm(&server.url, era, "generate_image", |i| json!({"prompt": format!("a lighthouse, take {i}")})).await;
    // The submissions that reached the mock answer; the jobs they started run to their end.
    for _ in 0..40 {
        server.advance_ms(1_000);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    all_back_to_zero("serve", || async {
        let mut counts = held(&server.metrics().await);
        counts.push(("leased units in Redis", backend.leased_units().await as f64));
        counts
    })
    .await;
    // Nothing leaked: a call goes straight through, to a job of its own.
    server.chaos(json!({"latency_ms": 0})).await;
    let client = era.client(&server.url).await;
    let image = call(&client, "generate_image", json!({"prompt": "the last one"})).await;
    assert_eq!(error_code(&image), None, "{}", text(&image));
}

#[tokio::test]
async fn serve_gives_back_every_slot_of_cancelled_calls_on_memory() {
    for era in ERAS {
        serve_storm(Backend::Memory, era).await;
    }
}

#[tokio::test]
async fn serve_gives_back_every_slot_of_cancelled_calls_on_a_slow_redis() {
    serve_storm(Backend::slow_redis().await, Era::Handshake).await;
}

#[tokio::test]
async fn serve_gives_back_every_slot_of_cancelled_calls_of_a_2026_07_28_client_on_a_slow_redis() {
    serve_storm(Backend::slow_redis().await, Era::Stateless).await;
}

/// The store itself, under every door: a decision Redis runs after its caller stopped waiting —
/// the answer timed out (`store.timeout_ms`), or the caller was cancelled — took its slots all
/// the same; they are given back at once, not held until the lease runs out (30 s).
#[tokio::test]
async fn slots_a_decision_took_after_its_caller_stopped_waiting_are_given_back_at_once() {
    let redis = TestRedis::private();
    let impairment = Impairment::latency(Duration::ZERO);
    let link = slow_link::start(slow_link::address_of(&redis.url), impairment.clone()).await;
    let store = RedisStore::connect(&format!("redis://{link}/"), Duration::from_millis(300)).await.expect("connects");
    // 400 ms a round trip from now on: longer than the store's timeout.
    impairment.latency_ms.store(200, std::sync::atomic::Ordering::Relaxed);
    let limiter = Limiter::Concurrency(Concurrency::new(5));
    let check = Check { key: "{t}in_flight:caller:a", limiter: &limiter, cost: 2, shadow: false };
    let timed_out = store.decide_leased(&[check], Lease::new(), None).await;
    assert!(timed_out.is_err(), "the answer comes after the store's timeout: {timed_out:?}");
    // Dropped after Redis ran it (200 ms on the way there) and before its answer is back.
    let checks = [check];
    let dropped = tokio::time::timeout(Duration::from_millis(250), store.decide_leased(&checks, Lease::new(), None));
    assert!(dropped.await.is_err(), "the caller stopped waiting");
    // Redis fast again: what they took goes back now, not when the leases run out.
    impairment.latency_ms.store(0, std::sync::atomic::Ordering::Relaxed);
    all_back_to_zero("the Redis store", || async {
        vec![("leased units in Redis", leased_units(&redis.url).await as f64)]
    })
    .await;
    let all = Check { cost: 5, ..check };
    let decisions = store.decide_leased(&[all], Lease::new(), None).await.expect("decides");
    assert!(decisions[0].allowed, "all five slots are free: {decisions:?}");
}

// ---- the proxy ------------------------------------------------------------------------------

fn fixture_server() -> Target {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let python = root.join(".tools/python/bin/python");
    assert!(python.exists(), "{} is missing: run scripts/proxy-fixtures.sh (make test does)", python.display());
    let server = root.join("tests/fixtures/fastmcp_server.py").to_string_lossy().into_owned();
    Target::Command { program: python.to_string_lossy().into_owned(), args: vec![server], env: ChildEnv::default() }
}

/// `slots` calls at a time to the proxied server (all of them for these unverified callers), the
/// rest waiting in the fair queue; each `nap` holds a caller's slot while it runs.
fn proxy_toml(backend: &Backend, slots: usize) -> String {
    format!(
        "{}{}{ROOMY}{}[proxy]\nmax_in_flight = {slots}\n[upstream]\nunverified_share = 1.0\n\
         [tools.nap]\ncost = 1\nholds_slot = true\n",
        backend.toml(),
        common::NO_LOOP_DETECTION,
        common::ROOMY_IN_FLIGHT,
    )
}

/// Storms of calls to the proxy, of each era: with as many slots as calls, every call claims one
/// at the door (a cancel lands in the claim); with `slots` of them, most wait in the queue.
async fn proxy_storm(backend: Backend, slots: usize) {
    let config = Config::from_toml(&proxy_toml(&backend, slots), &Catalogue::learned()).expect("test config is valid");
    let clock = ManualClock::new();
    let app = Arc::new(App::start_proxy(config, fixture_server(), clock.clone()).await.expect("the proxy starts"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let serving = app.clone();
    tokio::spawn(async move { serving.serve_http(listener).await });
    let url = format!("http://{addr}/mcp");
    let metrics = || async move {
        reqwest::get(format!("http://{addr}/metrics")).await.expect("metrics").text().await.expect("text")
    };
    for era in ERAS {
        // Time passes: a slot given back here is given back in Redis a round trip later, and a
        // claim Redis refused in between is asked again a second later, on the proxy's clock; a
        // call the cancel did not reach ends by the proxy's timeout.
        let ticking = {
            let clock = clock.clone();
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    clock.advance(Duration::from_millis(500));
                }
            })
        };
        tokio::time::timeout(CLEANUP * 3, storm(&url, era, "nap", |_| json!({"ms": 300})))
            .await
            .expect("every call of the storm is sent and cancelled");
        all_back_to_zero("proxy", || async {
            let mut counts = held(&metrics().await);
            counts.push(("leased units in Redis", backend.leased_units().await as f64));
            counts
        })
        .await;
        // The proxied server's slots are all free: calls go through.
        let client = era.client(&url).await;
        let both =
            async { tokio::join!(call(&client, "nap", json!({"ms": 1})), call(&client, "nap", json!({"ms": 2}))) };
        let answers = tokio::time::timeout(CLEANUP, both).await;
        ticking.abort();
        let (a, b) = answers.expect("the calls after the storm find free slots");
        assert_eq!((text(&a), text(&b)), ("slept 1 ms".to_owned(), "slept 2 ms".to_owned()));
    }
}

#[tokio::test]
async fn the_proxy_gives_back_every_slot_and_place_of_cancelled_calls_on_memory() {
    proxy_storm(Backend::Memory, 2).await;
}

#[tokio::test]
async fn the_proxy_gives_back_every_slot_and_place_of_cancelled_calls_on_a_slow_redis() {
    proxy_storm(Backend::slow_redis().await, 2).await;
}

#[tokio::test]
async fn the_proxy_gives_back_every_slot_of_calls_cancelled_while_claiming_one_on_a_slow_redis() {
    proxy_storm(Backend::slow_redis().await, cancel_points().count()).await;
}

// ---- the library ----------------------------------------------------------------------------

#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
struct Nap {
    /// Milliseconds.
    ms: u64,
}

#[derive(Clone)]
struct Sleeper {
    tools: LimitedRouter<Self>,
}

#[tool_router]
impl Sleeper {
    #[tool(description = "Sleeps, holding one of the caller's two slots.")]
    async fn nap(&self, Parameters(Nap { ms }): Parameters<Nap>) -> String {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        format!("slept {ms} ms")
    }
}

#[tool_handler(router = self.tools)]
impl ServerHandler for Sleeper {}

async fn library_storm(backend: Backend) {
    let toml = format!(
        "{}{}{ROOMY}[limits.in_flight]\ncaller = 2\n[tools.nap]\ncost = 1\n",
        backend.toml(),
        common::NO_LOOP_DETECTION
    );
    let limits = RateLimits::from_toml(&toml, Catalogue::new().job("nap")).await.expect("limits");
    let server = Sleeper { tools: LimitedRouter::new(Sleeper::tool_router(), limits.clone()) };
    let url = common::serve_library(server, &limits).await;
    for era in ERAS {
        storm(&url, era, "nap", |_| json!({"ms": 300})).await;
        all_back_to_zero("the library", || async {
            let in_flight = metric_sum(&limits.metrics().render(), "mcp_ratelimit_in_flight_calls");
            vec![
                ("mcp_ratelimit_in_flight_calls", in_flight),
                ("leased units in Redis", backend.leased_units().await as f64),
            ]
        })
        .await;
        // Both of the caller's slots are free: two calls run at once, a third is busy.
        let client = era.client(&url).await;
        let (a, b, c) =
            tokio::join!(call(&client, "nap", json!({"ms": 400})), call(&client, "nap", json!({"ms": 401})), async {
                tokio::time::sleep(Duration::from_millis(150)).await;
                call(&client, "nap", json!({"ms": 402})).await
            });
        assert_eq!((text(&a), text(&b)), ("slept 400 ms".to_owned(), "slept 401 ms".to_owned()));
        assert_eq!(error_code(&c), Some("busy"), "{}", text(&c));
    }
}

#[tokio::test]
async fn the_library_gives_back_every_slot_of_cancelled_calls_on_memory() {
    library_storm(Backend::Memory).await;
}

#[tokio::test]
async fn the_library_gives_back_every_slot_of_cancelled_calls_on_a_slow_redis() {
    library_storm(Backend::slow_redis().await).await;
}
