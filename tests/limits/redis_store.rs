//! The Redis store against a real Redis: every Lua script decides exactly like its Rust twin
//! (property tests, field by field, to the nanosecond), a call's checks are all-or-nothing in
//! one round trip, no call is admitted twice under contention, keys expire at `forget_at`, a
//! flushed script cache heals itself, and a dead Redis costs a request at most the timeout. A
//! learnt concurrency limit learns in Lua exactly as its Rust twin does, to the last bit of its
//! floating-point state, and the account's slots are claimed under it in the same script.
//!
//! Parity runs walk an explicit clock (`decide_at`) while Redis expires keys on its own clock.
//! A key about to be forgotten (its `forget_at` less than [`MARGIN`] ahead) could expire in
//! real time while the test's clock stands still, so the call after it moves on to `forget_at`,
//! from where a forgotten key and a kept one decide alike.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::test_redis::TestRedis;
use mcp_ratelimit::clock::Nanos;
use mcp_ratelimit::limit::adaptive::{Algorithm, Gradient2, Learner, Sample, Signal};
use mcp_ratelimit::limit::{
    Concurrency, Decision, FixedWindow, Gcra, LeakyBucket, Limiter, LimiterState, SlidingLog, SlidingWindow,
    TokenBucket,
};
use mcp_ratelimit::store::redis::{HeldLease, RedisStore, Renewed};
use mcp_ratelimit::store::{Check, LearntAt, MemoryStore};
use mcp_ratelimit::store::{Lease, StoreError};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

const MS: Nanos = Nanos::from_millis(1);
const SEC: Nanos = Nanos::from_secs(1);
const DAY: Nanos = Nanos::from_secs(86_400);
/// 2026-01-01T00:00:00Z: a realistic epoch reading, a multiple of every whole-second window.
const EPOCH: Nanos = Nanos::from_secs(1_767_225_600);
/// Generous: a loaded CI machine must not turn a slow answer into a failure.
const TIMEOUT: Duration = Duration::from_secs(5);
/// How close to its `forget_at` a key may be revisited by a parity run (see the module doc).
const MARGIN: Nanos = Nanos::from_millis(200);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a tokio runtime")
}

fn runner() -> TestRunner {
    TestRunner::new(Config { cases: 40, failure_persistence: None, ..Config::default() })
}

/// The span a limiter's arithmetic turns on: a bucket's period or a window's length.
fn span_of(limiter: &Limiter) -> Nanos {
    match limiter {
        Limiter::TokenBucket(a) => a.period(),
        Limiter::Gcra(a) => a.period(),
        Limiter::LeakyBucket(a) => a.period(),
        Limiter::FixedWindow(a) => a.window(),
        Limiter::SlidingLog(a) => a.window(),
        Limiter::SlidingWindow(a) => a.window(),
        Limiter::Concurrency(_) => unreachable!("in-flight slots have no clock; their parity test has its own steps"),
    }
}

/// One step of a parity run: a call, or a change of the limit under the key.
#[derive(Debug, Clone)]
enum Step {
    /// A call: the time since the previous call (whole µs) and its cost (at most the capacity of
    /// the limit in force).
    Call { gap_us: u64, cost: u64 },
    /// The key is decided from now on by another limiter of the run's list (same algorithm,
    /// other numbers: a reload), or
    Relimit(usize),
    /// by the current one multiplied by a factor (a tier, or an insurance share of 1/N).
    Scale(f64),
}

/// Calls for a limiter: mostly bursts at one instant, often exactly one or a few periods or
/// windows apart, sometimes a long pause (up to 200 days, past any exact-integer shortcut);
/// costs from 0 to the capacity, so often above what remains; and now and then the limit
/// changes under the key.
fn steps(span: Nanos, capacity: u64) -> impl Strategy<Value = Vec<Step>> {
    let span_us = span.as_u64() / 1_000;
    let gap = prop_oneof![
        5 => Just(0u64),
        2 => Just(span_us),
        1 => Just(span.as_u64().div_ceil(1_000)),
        1 => (2..=4u64).prop_map(move |k| k * span_us),
        4 => 1..span_us.max(2),
        1 => 0..span_us.saturating_mul(20).max(1),
        1 => Just((200 * DAY / 1_000).as_u64()),
    ];
    let step = prop_oneof![
        12 => (gap, 0..=capacity).prop_map(|(gap_us, cost)| Step::Call { gap_us, cost }),
        1 => (0..8usize).prop_map(Step::Relimit),
        1 => prop::sample::select(vec![0.5, 4.0, 1.0 / 3.0]).prop_map(Step::Scale),
    ];
    prop::collection::vec(step, 1..=30)
}

/// Runs random calls through each limiter twice, in Rust on a local state and in Redis with
/// `decide_at` at the same instants, and requires identical decisions, also after the limit
/// changed under a key that kept its state.
fn decides_like_its_rust_twin(limiters: Vec<Limiter>) {
    let redis = TestRedis::start();
    let runtime = runtime();
    let store = runtime.block_on(RedisStore::connect(&redis.url, TIMEOUT)).expect("connects to Redis");
    let strategy = (0..limiters.len()).prop_flat_map({
        let limiters = limiters.clone();
        move |i| {
            let span = span_of(&limiters[i]);
            // Start on a window edge, or anywhere within the first span.
            let phase_us = prop_oneof![Just(0u64), 0..(span.as_u64() / 1_000).max(1)];
            (Just(i), phase_us, steps(span, limiters[i].capacity()))
        }
    });
    let case = std::cell::Cell::new(0);
    let outcome = runner().run(&strategy, |(i, phase_us, steps)| {
        let mut limiter = limiters[i].clone();
        case.set(case.get() + 1);
        let key = redis.key(&format!("{}:{}", limiter.algorithm(), case.get()));
        let span = span_of(&limiter);
        let mut now = Nanos::new((EPOCH - EPOCH % span).as_u64().div_ceil(1_000) * 1_000 + phase_us * 1_000);
        // None until a call charges it, as in Redis (and `MemoryStore`): a key never written is
        // fresh under whichever limiter decides it first.
        let mut state: Option<LimiterState> = None;
        // When the key as last written is as good as fresh, if that is so soon that Redis may
        // forget it in real time (see the module doc), and the limiter that wrote it.
        let mut soon: Option<(Nanos, Limiter)> = None;
        for (n, step) in steps.iter().enumerate() {
            let (gap_us, cost) = match *step {
                Step::Call { gap_us, cost } => (gap_us, cost.min(limiter.capacity())),
                Step::Relimit(j) => {
                    limiter = limiters[j % limiters.len()].clone();
                    continue;
                }
                Step::Scale(factor) => {
                    let scaled = limiter.scaled(factor);
                    // Only limits the Redis store decides exactly (config validation's rule).
                    if scaled.span() <= Nanos::new(1 << 52) {
                        limiter = scaled;
                    }
                    continue;
                }
            };
            now += Nanos::from_micros(gap_us);
            if let Some((forget_at, writer)) = soon.take() {
                now = now.max(forget_at);
                // As good as fresh under the limiter that wrote it, but not necessarily under
                // another: both stores may forget it, so both do.
                if writer != limiter {
                    runtime.block_on(store.forget(&[key.as_str()])).map_err(|e| TestCaseError::fail(e.to_string()))?;
                    state = None;
                }
            }
            let mut next = state.clone().unwrap_or_else(|| limiter.fresh(now));
            let expected = limiter.acquire(&mut next, now, cost);
            let check = Check { key: &key, limiter: &limiter, cost, shadow: false };
            let got = runtime
                .block_on(store.decide_at(&[check], now))
                .map_err(|e| TestCaseError::fail(format!("call {n}: {e}")))?;
            prop_assert_eq!(
                &got,
                &vec![expected],
                "call {} of {} at {} ns (+{} µs), cost {}",
                n,
                limiter.describe(),
                now.as_u64(),
                gap_us,
                cost
            );
            if expected.allowed && cost > 0 {
                let forget_at = limiter.forget_at(&mut next, now);
                state = Some(next);
                soon = (forget_at > now && forget_at - now < MARGIN)
                    .then(|| (Nanos::new(forget_at.as_u64().div_ceil(1_000) * 1_000), limiter.clone()));
            }
        }
        Ok(())
    });
    if let Err(e) = outcome {
        panic!("{e}");
    }
}

#[test]
fn token_bucket_script_decides_like_token_bucket_rs() {
    decides_like_its_rust_twin(vec![
        Limiter::TokenBucket(TokenBucket::new(5, 3.0)),
        Limiter::TokenBucket(TokenBucket::new(12, 0.7)),
        Limiter::TokenBucket(TokenBucket::new(3, 1.0)),
        Limiter::TokenBucket(TokenBucket::new(40, 1.0 / 86_400.0)),
    ]);
}

#[test]
fn gcra_script_decides_like_gcra_rs() {
    decides_like_its_rust_twin(vec![
        Limiter::Gcra(Gcra::new(5, 3.0)),
        Limiter::Gcra(Gcra::new(12, 0.7)),
        Limiter::Gcra(Gcra::new(3, 1.0)),
        Limiter::Gcra(Gcra::new(40, 1.0 / 86_400.0)),
    ]);
}

#[test]
fn leaky_bucket_script_decides_like_leaky_bucket_rs() {
    decides_like_its_rust_twin(vec![
        Limiter::LeakyBucket(LeakyBucket::new(5, 3.0)),
        Limiter::LeakyBucket(LeakyBucket::new(12, 0.7)),
        Limiter::LeakyBucket(LeakyBucket::new(3, 1.0)),
        Limiter::LeakyBucket(LeakyBucket::new(40, 1.0 / 86_400.0)),
    ]);
}

#[test]
fn fixed_window_script_decides_like_fixed_window_rs() {
    decides_like_its_rust_twin(vec![
        Limiter::FixedWindow(FixedWindow::new(3, SEC)),
        Limiter::FixedWindow(FixedWindow::new(10, 2_500 * MS)),
        Limiter::FixedWindow(FixedWindow::new(4, SEC - Nanos::new(1))),
        Limiter::FixedWindow(FixedWindow::new(20, 30 * DAY)),
    ]);
}

#[test]
fn sliding_log_script_decides_like_sliding_log_rs() {
    decides_like_its_rust_twin(vec![
        Limiter::SlidingLog(SlidingLog::new(3, SEC)),
        Limiter::SlidingLog(SlidingLog::new(6, 2_500 * MS)),
        Limiter::SlidingLog(SlidingLog::new(4, SEC - Nanos::new(1))),
        Limiter::SlidingLog(SlidingLog::new(8, 30 * DAY)),
    ]);
}

#[test]
fn sliding_window_script_decides_like_sliding_window_rs() {
    decides_like_its_rust_twin(vec![
        Limiter::SlidingWindow(SlidingWindow::new(3, SEC)),
        Limiter::SlidingWindow(SlidingWindow::new(10, 2_500 * MS)),
        Limiter::SlidingWindow(SlidingWindow::new(7, SEC - Nanos::new(1))),
        // Counts times windows far beyond 2^53.
        Limiter::SlidingWindow(SlidingWindow::new(1_000, 30 * DAY)),
        Limiter::SlidingWindow(SlidingWindow::new(4_000_000_000, 7 * DAY)),
    ]);
}

/// One step of the in-flight parity run.
#[derive(Debug, Clone, Copy)]
enum SlotStep {
    /// Takes this many slots (at most the cap in force).
    Acquire(u64),
    /// Gives back the slots of the latest admission still held.
    Release,
    /// The cap changes under the held slots (a reload; lowered below them, or raised).
    Cap(u64),
}

#[test]
fn concurrency_script_counts_slots_like_concurrency_rs() {
    let redis = TestRedis::start();
    let runtime = runtime();
    let store = runtime.block_on(RedisStore::connect(&redis.url, TIMEOUT)).expect("connects to Redis");
    let cap = prop_oneof![Just(1u64), Just(3u64), Just(10u64)];
    let step = prop_oneof![
        5 => (0..=10u64).prop_map(SlotStep::Acquire),
        4 => Just(SlotStep::Release),
        1 => cap.clone().prop_map(SlotStep::Cap),
    ];
    let strategy = (cap, prop::collection::vec(step, 1..=30));
    let case = std::cell::Cell::new(0);
    let outcome = runner().run(&strategy, |(max, steps)| {
        let mut limiter = Limiter::Concurrency(Concurrency::new(max));
        case.set(case.get() + 1);
        let key = redis.key(&format!("concurrency:{}", case.get()));
        let mut state = limiter.fresh(EPOCH);
        let mut held: Vec<(Lease, u64)> = vec![];
        for (n, step) in steps.into_iter().enumerate() {
            match step {
                SlotStep::Cap(max) => limiter = Limiter::Concurrency(Concurrency::new(max)),
                SlotStep::Acquire(cost) => {
                    let cost = cost.min(limiter.capacity());
                    let expected = limiter.acquire(&mut state, EPOCH, cost);
                    // Slots are leases on Redis's own clock (releases read it too); none runs out here.
                    let lease = Lease::new();
                    let got = runtime
                        .block_on(store.decide_leased(
                            &[Check { key: &key, limiter: &limiter, cost, shadow: false }],
                            lease,
                            None,
                        ))
                        .map_err(|e| TestCaseError::fail(format!("call {n}: {e}")))?;
                    // Decided when Redis's clock said; the same in every other field.
                    let got: Vec<_> = got.into_iter().map(|d| Decision { at: EPOCH, ..d }).collect();
                    prop_assert_eq!(&got, &vec![expected], "call {} of {}, cost {}", n, limiter.describe(), cost);
                    if expected.allowed {
                        held.push((lease, cost));
                    }
                }
                SlotStep::Release => {
                    if let Some((lease, slots)) = held.pop() {
                        limiter.release(&mut state, slots);
                        runtime
                            .block_on(store.release(&key, lease))
                            .map_err(|e| TestCaseError::fail(format!("release {n}: {e}")))?;
                    }
                }
            }
        }
        Ok(())
    });
    if let Err(e) = outcome {
        panic!("{e}");
    }
}

/// The Redis store and the memory store, fed the same calls: every decision must match.
struct Twins {
    redis: RedisStore,
    memory: MemoryStore,
}

impl Twins {
    async fn start(redis: &TestRedis) -> Self {
        Self {
            redis: RedisStore::connect(&redis.url, TIMEOUT).await.expect("connects to Redis"),
            memory: MemoryStore::new(),
        }
    }

    async fn decide(&self, checks: &[Check<'_>], now: Nanos) -> Vec<Decision> {
        let decisions = self.redis.decide_at(checks, now).await.expect("Redis decides");
        assert_eq!(decisions, self.memory.decide_at(checks, now), "Redis and memory disagree");
        decisions
    }

    /// What each key has left, read with cost-0 checks (which charge nothing).
    async fn remaining(&self, checks: &[Check<'_>], now: Nanos) -> Vec<u64> {
        let peeks: Vec<Check<'_>> = checks.iter().map(|c| Check { cost: 0, ..*c }).collect();
        self.decide(&peeks, now).await.iter().map(|d| d.remaining).collect()
    }
}

#[tokio::test]
async fn a_refusal_in_the_last_scope_charges_none_and_a_pass_charges_all() {
    let redis = TestRedis::start();
    let twins = Twins::start(&redis).await;
    let (a, b, c, d) = (redis.key("caller:a"), redis.key("tenant:t"), redis.key("tool:video"), redis.key("tool:image"));
    let bucket = Limiter::TokenBucket(TokenBucket::new(100, 1.0));
    let window = Limiter::FixedWindow(FixedWindow::new(100, 60 * SEC));
    let log = Limiter::SlidingLog(SlidingLog::new(5, 60 * SEC));
    let now = EPOCH;

    assert!(twins.decide(&[Check { key: &c, limiter: &log, cost: 5, shadow: false }], now).await[0].allowed);
    let refused = [
        Check { key: &a, limiter: &bucket, cost: 10, shadow: false },
        Check { key: &b, limiter: &window, cost: 10, shadow: false },
        Check { key: &c, limiter: &log, cost: 1, shadow: false },
    ];
    let decisions = twins.decide(&refused, now).await;
    assert_eq!(decisions.iter().map(|d| d.allowed).collect::<Vec<_>>(), [true, true, false]);
    assert_eq!(twins.remaining(&refused, now).await, [100, 100, 0], "the refused call charged a scope");

    let admitted = [
        Check { key: &a, limiter: &bucket, cost: 10, shadow: false },
        Check { key: &b, limiter: &window, cost: 10, shadow: false },
        Check { key: &d, limiter: &log, cost: 1, shadow: false },
    ];
    assert!(twins.decide(&admitted, now).await.iter().all(|d| d.allowed));
    assert_eq!(twins.remaining(&admitted, now).await, [90, 90, 4], "an admitted call must charge every scope");
}

#[tokio::test]
async fn a_refusing_shadow_limit_neither_stops_the_call_nor_is_charged_on_either_store() {
    let redis = TestRedis::start();
    let twins = Twins::start(&redis).await;
    let (burst, day) = (redis.key("caller:s"), redis.key("caller:s#day"));
    let bucket = Limiter::TokenBucket(TokenBucket::new(100, 1.0));
    let tiny = Limiter::FixedWindow(FixedWindow::new(2, DAY));
    let now = EPOCH;
    let call = [
        Check { key: &burst, limiter: &bucket, cost: 1, shadow: false },
        Check { key: &day, limiter: &tiny, cost: 1, shadow: true },
    ];
    for n in 0..5 {
        let decisions = twins.decide(&call, now).await;
        assert!(decisions[0].allowed, "call {n}: the enforced limit decides");
        assert_eq!(decisions[1].allowed, n < 2, "call {n}: the shadow limit reports what it would do");
    }
    // Every call charged the enforced limit; the shadow one stopped counting at its limit.
    assert_eq!(twins.remaining(&call, now).await, [95, 0]);
    // As an enforced limit, the same refusal stops the call and charges nothing.
    let enforced = [call[0], Check { shadow: false, ..call[1] }];
    assert!(!twins.decide(&enforced, now).await[0..2].iter().all(|d| d.allowed));
    assert_eq!(twins.remaining(&call, now).await, [95, 0]);
}

#[tokio::test]
async fn two_checks_on_one_key_see_each_other() {
    let redis = TestRedis::start();
    let twins = Twins::start(&redis).await;
    let key = redis.key("k");
    let bucket = Limiter::TokenBucket(TokenBucket::new(10, 1.0));
    let checks = [
        Check { key: &key, limiter: &bucket, cost: 6, shadow: false },
        Check { key: &key, limiter: &bucket, cost: 6, shadow: false },
    ];
    let decisions = twins.decide(&checks, EPOCH).await;
    assert!(decisions[0].allowed && !decisions[1].allowed);
    assert_eq!(twins.remaining(&checks[..1], EPOCH).await, [10]);
    let both = [
        Check { key: &key, limiter: &bucket, cost: 4, shadow: false },
        Check { key: &key, limiter: &bucket, cost: 6, shadow: false },
    ];
    assert!(twins.decide(&both, EPOCH).await.iter().all(|d| d.allowed));
    assert_eq!(twins.remaining(&checks[..1], EPOCH).await, [0]);
}

#[tokio::test]
async fn sliding_window_weighs_counts_beyond_2_53_exactly() {
    let redis = TestRedis::start();
    let twins = Twins::start(&redis).await;
    let key = redis.key("k");
    let window = 7 * DAY;
    let limiter = Limiter::SlidingWindow(SlidingWindow::new(4_000_000_000, window));
    let edge = EPOCH - EPOCH % window;
    assert!(
        twins.decide(&[Check { key: &key, limiter: &limiter, cost: 4_000_000_000, shadow: false }], edge - SEC).await
            [0]
        .allowed
    );
    // 3.024 ms into the next window the previous 4e9 weigh exactly 3_999_999_980; their product
    // with the window (about 2^81) is far past 2^53, and a double rounds the weight up to ..._981.
    let now = edge + Nanos::new(3_024_000);
    let peek = twins.decide(&[Check { key: &key, limiter: &limiter, cost: 0, shadow: false }], now).await;
    assert_eq!(peek[0].remaining, 20);
    assert!(twins.decide(&[Check { key: &key, limiter: &limiter, cost: 20, shadow: false }], now).await[0].allowed);
    assert!(!twins.decide(&[Check { key: &key, limiter: &limiter, cost: 1, shadow: false }], now).await[0].allowed);
}

#[tokio::test]
async fn three_scopes_are_decided_in_one_script_call() {
    let redis = TestRedis::private();
    let store = RedisStore::connect(&redis.url, TIMEOUT).await.expect("connects to Redis");
    let (a, b, c) = (redis.key("a"), redis.key("b"), redis.key("c"));
    let bucket = Limiter::TokenBucket(TokenBucket::new(100, 1.0));
    let gcra = Limiter::Gcra(Gcra::new(100, 1.0));
    let window = Limiter::SlidingWindow(SlidingWindow::new(100, 60 * SEC));
    let checks = [
        Check { key: &a, limiter: &bucket, cost: 1, shadow: false },
        Check { key: &b, limiter: &gcra, cost: 1, shadow: false },
        Check { key: &c, limiter: &window, cost: 1, shadow: false },
    ];
    let before = redis.evalsha_calls();
    let decisions = store.decide(&checks).await.expect("decides");
    assert!(decisions.iter().all(|d| d.allowed));
    assert_eq!(redis.evalsha_calls() - before, 1);
}

/// 16 tasks × 200 calls through one store on one key; returns the calls admitted.
async fn hammer(store: Arc<RedisStore>, key: String, limiter: Limiter) -> usize {
    let limiter = Arc::new(limiter);
    let key = Arc::new(key);
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let (store, key, limiter) = (store.clone(), key.clone(), limiter.clone());
            tokio::spawn(async move {
                let mut admitted = 0;
                for _ in 0..200 {
                    let check = Check { key: &key, limiter: &limiter, cost: 1, shadow: false };
                    if store.decide(&[check]).await.expect("decides")[0].allowed {
                        admitted += 1;
                    }
                }
                admitted
            })
        })
        .collect();
    let mut admitted = 0;
    for task in tasks {
        admitted += task.await.expect("task finished");
    }
    admitted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn contention_from_three_instances_admits_exactly_the_burst() {
    let redis = TestRedis::start();
    // Three stores, each with its own connection, as three server instances would have. Slots
    // are held to the end: leases that outlast the test however slow the machine is.
    let mut stores = Vec::new();
    for _ in 0..3 {
        let store = RedisStore::connect(&redis.url, TIMEOUT).await.expect("connects to Redis");
        stores.push(Arc::new(store.with_lease(Duration::from_secs(3_600))));
    }
    for limiter in [
        Limiter::TokenBucket(TokenBucket::new(500, 1.0 / 3_600.0)),
        Limiter::SlidingLog(SlidingLog::new(500, 3_600 * SEC)),
        Limiter::Concurrency(Concurrency::new(500)),
    ] {
        let name = limiter.algorithm();
        let runs = stores.iter().map(|store| hammer(store.clone(), redis.key(name), limiter.clone()));
        let admitted: usize = futures::future::join_all(runs).await.into_iter().sum();
        assert_eq!(admitted, 500, "{name}: 3 instances × 16 tasks × 200 calls on a limit of 500");
    }
}

/// Redis's clock in microseconds.
async fn redis_time_us(connection: &mut redis::aio::MultiplexedConnection) -> u64 {
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(connection).await.expect("TIME");
    secs * 1_000_000 + micros
}

#[tokio::test]
async fn written_keys_expire_at_forget_at_rounded_up_to_the_millisecond() {
    let redis = TestRedis::start();
    let store = RedisStore::connect(&redis.url, TIMEOUT).await.expect("connects to Redis");
    let mut admin = redis::Client::open(redis.url.as_str())
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("admin connection");
    // Not on a window edge, and every forget_at a fraction of a millisecond away, so rounding
    // down instead of up would show.
    let now = EPOCH + Nanos::new(123_457_000);
    for (limiter, cost) in [
        (Limiter::TokenBucket(TokenBucket::new(10, 3.0)), 4),
        (Limiter::Gcra(Gcra::new(10, 3.0)), 2),
        (Limiter::LeakyBucket(LeakyBucket::new(4, 3.0)), 1),
        (Limiter::FixedWindow(FixedWindow::new(5, 60 * SEC)), 1),
        (Limiter::SlidingLog(SlidingLog::new(5, 10 * SEC + Nanos::new(1_000))), 2),
        (Limiter::SlidingWindow(SlidingWindow::new(5, 10 * SEC)), 3),
    ] {
        let mut state: LimiterState = limiter.fresh(now);
        assert!(limiter.acquire(&mut state, now, cost).allowed);
        let expected_ms = (limiter.forget_at(&mut state, now) - now).as_u64().div_ceil(1_000_000);
        // The TTL is the key's absolute expiry less the instant Redis set it, which lies between
        // two TIME readings: exact once both fall in one millisecond.
        let mut exact = false;
        for attempt in 0..50 {
            let key = redis.key(&format!("{}:{attempt}", limiter.algorithm()));
            let before = redis_time_us(&mut admin).await / 1_000;
            let decided = store.decide_at(&[Check { key: &key, limiter: &limiter, cost, shadow: false }], now).await;
            assert!(decided.expect("decides")[0].allowed);
            let after = redis_time_us(&mut admin).await / 1_000;
            let expires: u64 = redis::cmd("PEXPIRETIME").arg(&key).query_async(&mut admin).await.expect("PEXPIRETIME");
            let name = limiter.algorithm();
            assert!(
                (expires - after..=expires - before).contains(&expected_ms),
                "{name}: TTL between {} and {} ms, forget_at in {expected_ms} ms",
                expires - after,
                expires - before
            );
            if before == after {
                assert_eq!(expires - before, expected_ms, "{name}");
                exact = true;
                break;
            }
        }
        assert!(exact, "{}: never read Redis's clock twice within one millisecond", limiter.algorithm());
    }

    let slots = Limiter::Concurrency(Concurrency::new(3));
    let key = redis.key("concurrency");
    let lease = Lease::new();
    let held = store.decide_leased(&[Check { key: &key, limiter: &slots, cost: 2, shadow: false }], lease, None).await;
    assert!(held.expect("decides")[0].allowed);
    let ttl: i64 = redis::cmd("PTTL").arg(&key).query_async(&mut admin).await.expect("PTTL");
    let lease_ms = i64::try_from(store.lease().as_millis()).expect("ms");
    assert!(ttl > lease_ms - 1_000 && ttl <= lease_ms, "held slots last as long as their lease: {ttl} ms");
    store.release(&key, lease).await.expect("releases");
    // What is left is the released lease's tombstone (0 slots, so a late renewal cannot bring it
    // back): every slot is free, and the key goes when the tombstone does, a lease from now.
    let level = store.decide(&[Check { key: &key, limiter: &slots, cost: 0, shadow: false }]).await;
    assert_eq!(level.expect("decides")[0].remaining, 3, "a key with no slot held admits as a fresh one");
    let ttl: i64 = redis::cmd("PTTL").arg(&key).query_async(&mut admin).await.expect("PTTL");
    assert!(ttl > lease_ms - 1_000 && ttl <= lease_ms, "the tombstone lasts one lease: {ttl} ms");
}

#[tokio::test]
async fn a_flushed_script_cache_is_reloaded() {
    let redis = TestRedis::private();
    let store = RedisStore::connect(&redis.url, TIMEOUT).await.expect("connects to Redis");
    let mut admin = redis::Client::open(redis.url.as_str())
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("admin connection");
    let key = redis.key("k");
    let bucket = Limiter::TokenBucket(TokenBucket::new(10, 1.0 / 3_600.0));
    let check = [Check { key: &key, limiter: &bucket, cost: 1, shadow: false }];
    assert_eq!(store.decide(&check).await.expect("decides")[0].remaining, 9);
    let () = redis::cmd("SCRIPT").arg("FLUSH").query_async(&mut admin).await.expect("SCRIPT FLUSH");
    assert_eq!(store.decide(&check).await.expect("decides after SCRIPT FLUSH")[0].remaining, 8);
}

#[tokio::test]
async fn a_record_is_never_replaced_by_an_older_version_nor_once_final() {
    let redis = TestRedis::start();
    let store = RedisStore::connect(&redis.url, TIMEOUT).await.expect("connects to Redis");
    let key = redis.key("job:{j1}");
    let ttl = Duration::from_secs(60);
    let record = |version: u64, status: &str, done: bool| {
        serde_json::json!({"version": version, "final": done, "status": status}).to_string()
    };
    let read = || async { store.get(&key).await.expect("reads").expect("a record") };
    // A record written by an older server (no version, no final flag) is replaced.
    store.put(&key, r#"{"status":"starting"}"#, ttl).await.expect("writes");
    assert!(store.put_record(&key, &record(2, "processing", false), 2, ttl).await.expect("writes"));
    // An older version, delayed, does not land after a newer one; the same version does.
    assert!(!store.put_record(&key, &record(1, "starting", false), 1, ttl).await.expect("answers"));
    assert_eq!(read().await, record(2, "processing", false));
    assert!(store.put_record(&key, &record(2, "processing", false), 2, ttl).await.expect("writes"));
    // Once final it stands, whatever version comes after it.
    assert!(store.put_record(&key, &record(3, "canceled", true), 3, ttl).await.expect("writes"));
    assert!(!store.put_record(&key, &record(4, "processing", false), 4, ttl).await.expect("answers"));
    assert!(!store.put_record(&key, &record(5, "succeeded", true), 5, ttl).await.expect("answers"));
    assert_eq!(read().await, record(3, "canceled", true));
    // Anything that is not a JSON object is no record: replaced.
    store.put(&key, "not json", ttl).await.expect("writes");
    assert!(store.put_record(&key, &record(1, "starting", false), 1, ttl).await.expect("writes"));
    let mut admin = redis::Client::open(redis.url.as_str())
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("admin connection");
    let left: i64 = redis::cmd("PTTL").arg(&key).query_async(&mut admin).await.expect("PTTL");
    assert!((59_000..=60_000).contains(&left), "kept for its lifetime: {left} ms");
}

const SHORT: Duration = Duration::from_millis(300);
/// Scheduling slack on a loaded machine, on top of the timeout.
const SLACK: Duration = Duration::from_millis(300);

#[tokio::test]
async fn a_paused_redis_costs_a_call_at_most_the_timeout() {
    let redis = TestRedis::private();
    let store = RedisStore::connect(&redis.url, SHORT).await.expect("connects to Redis");
    let key = redis.key("k");
    let bucket = Limiter::TokenBucket(TokenBucket::new(10, 1.0));
    let check = [Check { key: &key, limiter: &bucket, cost: 1, shadow: false }];
    assert!(store.decide(&check).await.is_ok());

    redis.pause();
    let started = Instant::now();
    let outcome = store.decide(&check).await;
    let waited = started.elapsed();
    redis.resume();
    let e = outcome.expect_err("a paused Redis cannot decide");
    assert!(matches!(e, StoreError::Timeout { .. }), "{e:?}");
    assert!(waited < SHORT + SLACK, "waited {waited:?}");
    assert!(e.to_string().contains("did not answer within 300 ms"), "{e}");

    // Once Redis runs again, so does the store.
    let mut recovered = false;
    for _ in 0..20 {
        if store.decide(&check).await.is_ok() {
            recovered = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(recovered, "the store did not recover after Redis resumed");
}

#[tokio::test]
async fn a_server_that_never_answers_costs_connect_at_most_the_timeout() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    // Accepts every connection and holds it open without a word.
    tokio::spawn(async move {
        let mut held = vec![];
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let started = Instant::now();
    let e = RedisStore::connect(&format!("redis://{address}/"), SHORT).await.expect_err("nothing answers");
    assert!(matches!(e, StoreError::Timeout { .. }), "{e:?}");
    assert!(started.elapsed() < SHORT + SLACK, "waited {:?}", started.elapsed());
}

#[tokio::test]
async fn a_closed_port_is_named_without_its_password() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("address").port();
    let e = RedisStore::connect(&format!("redis://:hunter2@127.0.0.1:{port}/"), TIMEOUT)
        .await
        .expect_err("nothing listens there");
    let message = e.to_string();
    assert!(matches!(e, StoreError::Unreachable { .. }), "{e:?}");
    assert!(message.contains(&format!("127.0.0.1:{port}")) && message.contains("redis-server"), "{message}");
    assert!(!message.contains("hunter2"), "{message}");
}

#[tokio::test]
async fn a_clock_reading_finer_than_a_microsecond_is_refused() {
    let redis = TestRedis::start();
    let store = RedisStore::connect(&redis.url, TIMEOUT).await.expect("connects to Redis");
    let key = redis.key("k");
    let bucket = Limiter::TokenBucket(TokenBucket::new(10, 1.0));
    let e = store
        .decide_at(&[Check { key: &key, limiter: &bucket, cost: 1, shadow: false }], EPOCH + Nanos::new(1))
        .await
        .expect_err("1 ns");
    assert!(matches!(e, StoreError::OutOfRange(_)), "{e:?}");
}

#[tokio::test]
async fn an_unrenewed_lease_runs_out_and_frees_its_slots_and_a_renewed_one_does_not() {
    let redis = TestRedis::start();
    let store = RedisStore::connect(&redis.url, TIMEOUT).await.expect("connects to Redis").with_lease(LEASE);
    let mut admin =
        redis::Client::open(redis.url.as_str()).expect("url").get_multiplexed_async_connection().await.expect("admin");
    let slots = Limiter::Concurrency(Concurrency::new(2));
    let (crashed, alive) = (redis.key("crashed"), redis.key("alive"));
    // Both taken half a lease ago, on the script's clock: they run out half a lease from now.
    let now = Nanos::from_micros(redis_time_us(&mut admin).await);
    let half = Nanos::from(LEASE) / 2;
    for key in [&crashed, &alive] {
        let held = store
            .decide_leased(&[Check { key, limiter: &slots, cost: 2, shadow: false }], Lease::new(), Some(now - half))
            .await;
        assert!(held.expect("decides")[0].allowed);
    }
    // The holder of `alive` renews its lease; the holder of `crashed` is gone and does not.
    let lease_of =
        |raw: String| raw.split(' ').nth(1).and_then(|id| id.parse::<u64>().ok()).map(Lease::from_id).expect("a lease");
    let alive_lease = lease_of(redis::cmd("GET").arg(&alive).query_async(&mut admin).await.expect("GET"));
    let renewed =
        store.renew(&[HeldLease { key: &alive, lease: alive_lease, units: 2, capacity: 2 }]).await.expect("renews");
    assert_eq!(renewed, [Renewed::Renewed]);

    // Read both just after the first leases run out, on the script's clock (no waiting in real
    // time): the renewed one lasts a whole lease from its renewal.
    let later = now + half + MS;
    let crashed_now = store.decide_at(&[Check { key: &crashed, limiter: &slots, cost: 1, shadow: false }], later).await;
    assert!(crashed_now.expect("decides")[0].allowed, "an unrenewed lease runs out: its slots are free");
    let alive_now = store.decide_at(&[Check { key: &alive, limiter: &slots, cost: 1, shadow: false }], later).await;
    assert!(!alive_now.expect("decides")[0].allowed, "a renewed lease still holds its slots");

    // A lease that expired while its holder could not reach Redis is taken again on renewal.
    let gone = redis.key("gone");
    let retaken =
        store.renew(&[HeldLease { key: &gone, lease: Lease::new(), units: 1, capacity: 2 }]).await.expect("renews");
    assert_eq!(retaken, [Renewed::Retaken]);
    let level = store.decide(&[Check { key: &gone, limiter: &slots, cost: 0, shadow: false }]).await.expect("decides");
    assert_eq!(level[0].remaining, 1, "the renewed lease counts again");
}

#[tokio::test]
async fn a_renewal_never_takes_an_expired_lease_again_above_the_cap() {
    let redis = TestRedis::start();
    let store = RedisStore::connect(&redis.url, TIMEOUT).await.expect("connects to Redis").with_lease(LEASE);
    let slots = Limiter::Concurrency(Concurrency::new(2));
    let key = redis.key("after_an_outage");
    // While this instance could not reach Redis, its lease ran out and others took both slots.
    let theirs = Lease::new();
    let two = [Check { key: &key, limiter: &slots, cost: 2, shadow: false }];
    assert!(store.decide_leased(&two, theirs, None).await.expect("decides")[0].allowed);
    let mine = HeldLease { key: &key, lease: Lease::new(), units: 1, capacity: 2 };
    assert_eq!(store.renew(&[mine]).await.expect("renews"), [Renewed::Lost], "no room: the lease is lost");
    // Counted exactly: when the others' two slots come back, both are free (a third, taken
    // again above the cap, would still hold one).
    store.release(&key, theirs).await.expect("releases");
    let level = store.decide(&[Check { key: &key, limiter: &slots, cost: 0, shadow: false }]).await.expect("decides");
    assert_eq!((level[0].limit, level[0].remaining), (2, 2), "two were in flight, not three");
    // With room, the same renewal takes it again; never more than fits.
    let roomy = redis.key("room_for_one");
    let one = store.decide(&[Check { key: &roomy, limiter: &slots, cost: 1, shadow: false }]).await;
    assert!(one.expect("decides")[0].allowed);
    let two = [HeldLease { key: &roomy, lease: Lease::new(), units: 1, capacity: 2 }; 2];
    let answers = store.renew(&[two[0], HeldLease { lease: Lease::new(), ..two[1] }]).await.expect("renews");
    assert_eq!(answers, [Renewed::Retaken, Renewed::Lost], "the second would be a third slot of two");
    let level = store.decide(&[Check { key: &roomy, limiter: &slots, cost: 0, shadow: false }]).await.expect("decides");
    assert_eq!(level[0].remaining, 0);
}

#[tokio::test]
async fn a_renewal_that_reaches_redis_after_the_release_does_not_bring_the_slot_back() {
    let redis = TestRedis::start();
    let store = RedisStore::connect(&redis.url, TIMEOUT).await.expect("connects to Redis").with_lease(LEASE);
    let slots = Limiter::Concurrency(Concurrency::new(2));
    let key = redis.key("released");
    let lease = Lease::new();
    let taken = store.decide_leased(&[Check { key: &key, limiter: &slots, cost: 1, shadow: false }], lease, None).await;
    assert!(taken.expect("decides")[0].allowed);
    // The renewal read the lease as held, then the job ended and its release got there first.
    store.release(&key, lease).await.expect("releases");
    let late = HeldLease { key: &key, lease, units: 1, capacity: 2 };
    assert_eq!(store.renew(&[late]).await.expect("renews"), [Renewed::GivenBack]);
    let level = store.decide(&[Check { key: &key, limiter: &slots, cost: 0, shadow: false }]).await.expect("decides");
    assert_eq!(level[0].remaining, 2, "no phantom slot");
}

/// How long leases last in the lease test.
const LEASE: Duration = Duration::from_secs(10);

/// The loop check inside a decision's script: a loop is refused before anything is charged,
/// and a call a check refuses is taken back out of the history, so it never counts towards a
/// loop (the guard's order: check the loop, decide, forget a refused call; in one step).
#[test]
fn a_loop_checked_in_the_decision_charges_nothing_and_a_refused_or_blocked_call_is_never_recorded() {
    use mcp_ratelimit::guard::loops::{Pattern, signature};
    use mcp_ratelimit::store::{LoopCall, Verdict};
    let redis = TestRedis::start();
    let runtime = runtime();
    let store = runtime.block_on(RedisStore::connect(&redis.url, TIMEOUT)).expect("connects to Redis");
    let (budget, history) = (redis.key("fold:budget"), redis.key("fold:loops"));
    let bucket = Limiter::TokenBucket(TokenBucket::new(3, 1.0));
    let check = [Check { key: &budget, limiter: &bucket, cost: 1, shadow: false }];
    let same = signature(7, "list_articles", &serde_json::json!({}));
    let tool_signature = mcp_ratelimit::guard::loops::tool_signature(7, "list_articles");
    let call = LoopCall { key: &history, signature: same, tool_signature, window: 60 * SEC, repeats: 5 };
    let decide =
        |call, now| runtime.block_on(store.decide_after_loop_check_at(call, &check, &[], now)).expect("decides");
    let allowed = |verdict: &Verdict| match verdict {
        Verdict::Decided(d) => Some((d[0].allowed, d[0].remaining)),
        _ => None,
    };
    for n in 0..3 {
        assert_eq!(allowed(&decide(call, EPOCH)).map(|a| a.0), Some(true), "call {n} spends a token");
    }
    // The fourth, refused for budget ten times: had any been kept, the fifth would be a loop.
    for n in 0..10 {
        assert_eq!(allowed(&decide(call, EPOCH)).map(|a| a.0), Some(false), "refused for budget {n}, not a loop");
    }
    // A token is back a second later: the fourth passes; the fifth, a second after, is the loop.
    assert_eq!(allowed(&decide(call, EPOCH + SEC)), Some((true, 0)));
    let at = EPOCH + 2 * SEC;
    assert_eq!(decide(call, at), Verdict::Looping { retry_after: 60 * SEC, pattern: Pattern::Repeated });
    // It charged nothing: another call finds the token that second brought.
    let other = LoopCall { signature: signature(7, "list_articles", &serde_json::json!({"page": 2})), ..call };
    assert_eq!(allowed(&decide(other, at)), Some((true, 0)));

    // A call an operator's block stops is not recorded either: ten blocked, then four pass and
    // the fifth is the loop.
    let (history, block) = (redis.key("fold:blocked:loops"), redis.key("fold:blocked:block"));
    let call = LoopCall { key: &history, ..call };
    let roomy = Limiter::TokenBucket(TokenBucket::new(100, 1.0));
    let budget = redis.key("fold:blocked:budget");
    let check = [Check { key: &budget, limiter: &roomy, cost: 1, shadow: false }];
    let decide = |blocks: &[&str]| {
        runtime.block_on(store.decide_after_loop_check_at(call, &check, blocks, EPOCH)).expect("decides")
    };
    runtime.block_on(store.block(&block, Duration::from_secs(600))).expect("blocks");
    for n in 0..10 {
        assert!(matches!(decide(&[block.as_str()]), Verdict::Blocked { index: 0, .. }), "blocked {n}");
    }
    for n in 0..4 {
        assert!(matches!(decide(&[]), Verdict::Decided(d) if d[0].allowed), "call {n} after the block");
    }
    assert!(matches!(decide(&[]), Verdict::Looping { .. }), "the fifth recorded call");
}

/// The loop twins' window: a call repeated 5 times within it is a loop.
const LOOP_WINDOW: Nanos = Nanos::from_secs(60);
/// The loop twins' `no_progress`: the same answer this many times stops the tool.
const NO_PROGRESS: u32 = 3;

/// The Lua twin of the loop detector, calls and answers alike: random calls of two tools (one
/// with two argument sets), each answered (or not) with one of two answers, under `no_progress`
/// 3, checked and heard by both, with every refusal, pattern, wait and streak equal.
#[test]
fn the_loop_script_decides_like_the_loop_detector() {
    use mcp_ratelimit::guard::loops::{LoopDetector, signature, tool_signature};
    use mcp_ratelimit::store::redis::LoopAnswer;
    use mcp_ratelimit::store::{LoopAnswered, LoopCall};
    let redis = TestRedis::start();
    let runtime = runtime();
    let store = runtime.block_on(RedisStore::connect(&redis.url, TIMEOUT)).expect("connects to Redis");
    // Calls from a small alphabet (so repeats, A/B runs and streaks are common), now and then a
    // step of time, sometimes a whole window; an answer of two (or none heard).
    let step = prop_oneof![8 => Just(Nanos::ZERO), 1 => Just(SEC), 1 => Just(LOOP_WINDOW), 1 => Just(LOOP_WINDOW - Nanos::new(1_000))];
    let answer = prop_oneof![3 => Just(Some(0u128)), 2 => Just(Some(1u128)), 1 => Just(None)];
    let strategy = prop::collection::vec((0..3u8, answer, step), 1..=40);
    let case = std::cell::Cell::new(0);
    let outcome = runner().run(&strategy, |calls| {
        case.set(case.get() + 1);
        let key = redis.key(&format!("loops:{}", case.get()));
        let local = LoopDetector::new(5, LOOP_WINDOW);
        let mut now = EPOCH;
        for (n, (letter, answer, dt)) in calls.into_iter().enumerate() {
            now += dt;
            let (tool, args) = match letter {
                2 => ("save_article", serde_json::json!({})),
                page => ("list_articles", serde_json::json!({ "page": page })),
            };
            let call = LoopCall {
                key: &key,
                signature: signature(7, tool, &args),
                tool_signature: tool_signature(7, tool),
                window: LOOP_WINDOW,
                repeats: 5,
            };
            let expected = local.check("caller", tool, &args, now);
            let checked = runtime
                .block_on(store.loop_check(call, Some(now)))
                .map_err(|e| TestCaseError::fail(format!("call {n}: {e}")))?;
            match (&expected, checked) {
                (Ok(_), LoopAnswer::Recorded) => {}
                (Err(looping), LoopAnswer::Looping { retry_after, pattern }) => {
                    prop_assert_eq!((looping.retry_after, looping.pattern), (retry_after, pattern), "call {}", n);
                }
                (expected, checked) => prop_assert!(false, "call {}: local {:?}, Redis {:?}", n, expected, checked),
            }
            if let (Ok(_), Some(answer)) = (expected, answer) {
                let heard = local.answered("caller", (tool, &args), answer, NO_PROGRESS, now);
                let answered = LoopAnswered {
                    key: &key,
                    signature: call.signature,
                    tool_signature: call.tool_signature,
                    answer,
                    window: LOOP_WINDOW,
                    repeats: 5,
                    no_progress: NO_PROGRESS,
                };
                let shared = runtime
                    .block_on(store.loop_answered(answered, Some(now)))
                    .map_err(|e| TestCaseError::fail(format!("answer {n}: {e}")))?;
                prop_assert_eq!(heard, shared, "answer {}", n);
            }
        }
        Ok(())
    });
    if let Err(e) = outcome {
        panic!("{e}");
    }
    the_loop_script_names_each_pattern(&redis, &runtime, &store);
}

/// The patterns by name, as the loop script answers them: the 5th of one call, the 9th of an A/B
/// run, and a tool whose answer was the same three times (the arguments changing) stopped for
/// every argument.
fn the_loop_script_names_each_pattern(redis: &TestRedis, runtime: &tokio::runtime::Runtime, store: &RedisStore) {
    use mcp_ratelimit::guard::loops::{Pattern, Streaked, signature, tool_signature};
    use mcp_ratelimit::store::redis::LoopAnswer;
    use mcp_ratelimit::store::{LoopAnswered, LoopCall};
    let key = redis.key("loops:named");
    let call = |key: &str, letter: u8, now: Nanos| {
        let args = serde_json::json!({ "page": letter });
        let (signature, tool_signature) = (signature(7, "list_articles", &args), tool_signature(7, "list_articles"));
        let call = LoopCall { key, signature, tool_signature, window: LOOP_WINDOW, repeats: 5 };
        runtime.block_on(store.loop_check(call, Some(now))).expect("answers")
    };
    let answers: Vec<LoopAnswer> = [0u8, 0, 0, 0, 0].iter().map(|&l| call(&key, l, EPOCH)).collect();
    assert!(answers[..4].iter().all(|a| matches!(a, LoopAnswer::Recorded)));
    assert_eq!(answers[4], LoopAnswer::Looping { retry_after: LOOP_WINDOW, pattern: Pattern::Repeated });
    let key = redis.key("loops:alternating");
    let answers: Vec<LoopAnswer> = (0..9u8).map(|i| call(&key, i % 2, EPOCH)).collect();
    assert!(answers[..8].iter().all(|a| matches!(a, LoopAnswer::Recorded)));
    assert_eq!(answers[8], LoopAnswer::Looping { retry_after: LOOP_WINDOW, pattern: Pattern::Oscillating });
    let key = redis.key("loops:no_progress");
    for page in 0..3u8 {
        assert_eq!(call(&key, page, EPOCH), LoopAnswer::Recorded);
        let args = serde_json::json!({ "page": page });
        let answered = LoopAnswered {
            key: &key,
            signature: signature(7, "list_articles", &args),
            tool_signature: tool_signature(7, "list_articles"),
            answer: 42,
            window: LOOP_WINDOW,
            repeats: 5,
            no_progress: NO_PROGRESS,
        };
        let streaked = runtime.block_on(store.loop_answered(answered, Some(EPOCH))).expect("hears");
        let stopped_for = (page == 2).then_some(LOOP_WINDOW);
        assert_eq!(streaked, Streaked { same: u32::from(page) + 1, stopped_for });
    }
    assert_eq!(
        call(&key, 9, EPOCH + SEC),
        LoopAnswer::Looping { retry_after: LOOP_WINDOW - SEC, pattern: Pattern::NoProgress }
    );
}

/// A learner of either algorithm, with parameters anywhere config allows.
fn learners() -> impl Strategy<Value = Learner> {
    let gradient2 =
        (1.0f64..3.0, 0.01f64..=1.0, 1u64..700, 1u64..6).prop_map(|(tolerance, smoothing, long_window, queue_size)| {
            Algorithm::Gradient2(Gradient2 { tolerance, smoothing, long_window, queue_size })
        });
    let algorithm = prop_oneof![Just(Algorithm::Aimd), gradient2];
    (1u64..4, 0u64..30, 0.05f64..0.99, algorithm)
        .prop_map(|(min, span, backoff_ratio, algorithm)| Learner::new(min, min + span, backoff_ratio, algorithm))
}

/// Answers and overloads: round-trip times from nothing to seconds (any nanosecond), any number
/// of others in use, steps of whole microseconds, and slots taken before the last cut.
fn samples() -> impl Strategy<Value = Vec<(Signal, Nanos, usize, u64, u64)>> {
    let rtt = prop_oneof![1 => Just(Nanos::ZERO), 6 => (1..2_000_000_000u64).prop_map(Nanos::new), 2 => Just(100 * MS), 1 => Just(300 * MS)];
    let signal = prop_oneof![17 => Just(Signal::Accepted), 2 => Just(Signal::Overloaded), 1 => Just(Signal::TimedOut)];
    let sample = (signal, rtt, prop_oneof![1 => Just(0usize), 4 => 0usize..40], 0u64..3_000_000, 0u64..5_000_000);
    prop::collection::vec(sample, 1..=120)
}

#[test]
fn learnt_limits_learn_exactly_like_their_rust_twins() {
    let redis = TestRedis::start();
    let runtime = runtime();
    let store = runtime.block_on(RedisStore::connect(&redis.url, TIMEOUT)).expect("connects to Redis");
    let case = std::cell::Cell::new(0);
    let outcome = runner().run(&(learners(), samples()), |(learner, samples)| {
        case.set(case.get() + 1);
        let key = redis.key(&format!("learnt:{}", case.get()));
        let in_flight = redis.key(&format!("learnt:{}:in_flight", case.get()));
        let at = LearntAt { key: &key, in_flight_key: &in_flight, learner: &learner, ceiling: learner.max() };
        let mut learnt = learner.fresh();
        let mut now = EPOCH;
        for (n, (signal, rtt, others, gap_us, back_us)) in samples.into_iter().enumerate() {
            now += Nanos::from_micros(gap_us);
            // Now and then a slot taken before the last cut: its overload must change nothing.
            let taken_at = now - Nanos::from_micros(back_us.min((now - EPOCH).as_u64() / 1_000));
            let sample = Sample { signal, rtt, others, taken_at, now };
            learner.learn(&mut learnt, &sample);
            let (got, limit) = runtime
                .block_on(store.learn_sample(at, &sample))
                .map_err(|e| TestCaseError::fail(format!("{n}: {e}")))?;
            prop_assert_eq!(
                limit.to_bits(),
                learnt.limit.to_bits(),
                "sample {} {:?}: {} in Lua, {:?} in Rust",
                n,
                sample,
                limit,
                learnt
            );
            prop_assert_eq!(got.current, learner.current(&learnt), "sample {}", n);
            prop_assert_eq!(got.at, now);
        }
        Ok(())
    });
    if let Err(e) = outcome {
        panic!("{e}");
    }
}

#[tokio::test]
async fn slots_are_claimed_under_the_learnt_limit_in_the_same_script_and_its_key_expires_when_left_alone() {
    let redis = TestRedis::start();
    let store = RedisStore::connect(&redis.url, TIMEOUT).await.expect("connects to Redis");
    let (key, account_key, share_key) =
        (redis.key("{acct}learnt"), redis.key("{acct}in_flight"), redis.key("{acct}share"));
    let learner = Learner::new(1, 10, 0.9, Algorithm::Aimd);
    let at = LearntAt { key: &key, in_flight_key: &account_key, learner: &learner, ceiling: 10 };
    let (account, share) = (Limiter::Concurrency(Concurrency::new(10)), Limiter::Concurrency(Concurrency::new(5)));
    let claim = |with_share: bool| {
        let (store, account, share, account_key, share_key) = (&store, &account, &share, &account_key, &share_key);
        async move {
            let mut checks = vec![Check { key: account_key, limiter: account, cost: 1, shadow: false }];
            if with_share {
                checks.push(Check { key: share_key, limiter: share, cost: 1, shadow: false });
            }
            let lease = Lease::new();
            let (decisions, limit) = store.decide_under(at, &checks, lease, None).await.expect("decides");
            (decisions.iter().all(|d| d.allowed).then_some(lease), decisions, limit)
        }
    };
    let mut held = Vec::new();
    for _ in 0..6 {
        let (lease, decisions, limit) = claim(false).await;
        assert_eq!((decisions[0].limit, limit.current), (10, 10), "a fresh learner stands at its ceiling");
        held.push(lease.expect("room under 10"));
    }
    // A 429 while the six others ran: the limit every claim is decided under is now 6.
    let (seventh, _, limit) = claim(false).await;
    assert!(seventh.is_some(), "seven of ten");
    let taken_at = limit.at;
    let learnt = store
        .learn_sample(at, &Sample { signal: Signal::Overloaded, rtt: Nanos::ZERO, others: 6, taken_at, now: taken_at })
        .await
        .expect("learns");
    assert_eq!((learnt.0.current, learnt.1), (6, 6.0));
    let (lease, decisions, limit) = claim(false).await;
    assert_eq!((lease, decisions[0].limit, limit.current), (None, 6, 6), "seven held: none more under 6");
    // An unverified caller's share of 5 shrinks alike: 5 × 6 / 10 = 3.
    let (_, decisions, _) = claim(true).await;
    assert_eq!((decisions[0].limit, decisions[1].limit), (6, 3));

    // Every use keeps the key an hour more; a key another learner wrote is as good as fresh.
    let mut admin =
        redis::Client::open(redis.url.as_str()).expect("url").get_multiplexed_async_connection().await.expect("admin");
    let ttl: i64 = redis::cmd("PTTL").arg(&key).query_async(&mut admin).await.expect("PTTL");
    assert!(ttl > 3_590_000 && ttl <= 3_600_000, "kept an hour past its last use: {ttl} ms");
    let gradient2 = Learner::new(
        1,
        10,
        0.9,
        Algorithm::Gradient2(Gradient2 { tolerance: 1.5, smoothing: 0.2, long_window: 600, queue_size: 4 }),
    );
    let other = LearntAt { learner: &gradient2, ..at };
    let (_, limit) = store.decide_under(other, &[], Lease::new(), None).await.expect("reads");
    assert_eq!(limit.current, 10, "aimd's state means nothing to gradient2");
}

/// A loop history the version before wrote in words (it is packed with MessagePack now) is still
/// read: while a deployment rolls from one version to the other, a caller's history stays one.
#[test]
fn a_loop_history_written_in_words_by_the_version_before_is_still_read() {
    use mcp_ratelimit::store::LoopCall;
    use mcp_ratelimit::store::redis::LoopAnswer;
    let redis = TestRedis::start();
    let runtime = runtime();
    let store = runtime.block_on(RedisStore::connect(&redis.url, TIMEOUT)).expect("connects to Redis");
    let history = redis.key("words:loops");
    let (signature, tool_signature) = (0x7e57_u128, 0x70_u128);
    let call = LoopCall { key: &history, signature, tool_signature, window: 60 * SEC, repeats: 5 };
    // Four identical calls a second apart, answers not yet heard, as the version before kept them.
    let us = |n: u64| EPOCH.as_u64() / 1_000 + n * 1_000_000;
    let sig = format!("{signature:032x}");
    let words: Vec<String> = (0..4).map(|n| format!("c {n} {sig} {} -", us(n))).collect();
    let state = format!("4 {}", words.join(" "));
    runtime.block_on(async {
        let mut admin = redis::Client::open(redis.url.as_str())
            .expect("url")
            .get_multiplexed_async_connection()
            .await
            .expect("admin");
        let _: () = redis::cmd("SET").arg(&history).arg(&state).query_async(&mut admin).await.expect("set");
    });
    let fifth = runtime.block_on(store.loop_check(call, Some(EPOCH + 4 * SEC))).expect("checks");
    assert!(matches!(fifth, LoopAnswer::Looping { .. }), "the fifth identical call is a loop: {fifth:?}");
    // And what it wrote back is read by this version: the stop holds.
    let other = LoopCall { signature: 0x0123, ..call };
    let again = runtime.block_on(store.loop_check(call, Some(EPOCH + 5 * SEC))).expect("checks");
    assert!(matches!(again, LoopAnswer::Looping { .. }), "still stopped: {again:?}");
    let unrelated = runtime.block_on(store.loop_check(other, Some(EPOCH + 5 * SEC))).expect("checks");
    assert_eq!(unrelated, LoopAnswer::Recorded, "another call is not");
}
