//! Nanoseconds per limiter decision: our [`MemoryStore`] with every algorithm, against
//! `governor`'s keyed limiter (its default `DashMap` state) in the same run, on the same quota.
//!
//! Run with `cargo bench --bench limiters` (or `scripts/bench.sh`, which also prints a table).
//! Under `cargo test` each benchmark runs once, on 10,000 keys instead of 1,000,000.
//!
//! # Quota
//! Every rate limiter gets the same quota: a burst of 1,000 and 1,000,000 per second (one unit
//! every 1 µs); window algorithms get 1,000 per 1 ms window; concurrency gets 1,000 slots.
//! `governor` gets `Quota::with_period(1 µs).allow_burst(1000)`, the same contract as our
//! GCRA and token bucket.
//!
//! # Clocks
//! * `fake_clock` — the limiter alone: on both sides time comes from the same thread-local
//!   counter ([`tick`]) that advances by a fixed step on every reading, so both pay the same
//!   (tiny) cost for time and see the same time series. One thread steps 500 ns per decision:
//!   2 × the quota's rate is offered, so once the burst is gone about half the decisions on a
//!   hot key are refused and both paths are measured. Two threads step 1 µs each: again 2 ×.
//! * `real_clock` — what a server pays: ours reads `SystemClock::now()` (through the
//!   `SharedClock` the server uses) before each decision; `governor` reads its default
//!   `QuantaClock`. At tens of nanoseconds per decision this offers far more than 1 M/s, so a
//!   hot key is mostly refused.
//!
//! The share of allowed decisions each limiter settles at is printed to stderr (bench mode
//! only), so the regime is on record next to the numbers.

use std::cell::Cell;
use std::hint::black_box;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Barrier, OnceLock};
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use governor::middleware::NoOpMiddleware;
use governor::state::keyed::DashMapStateStore;
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use mcp_ratelimit::clock::SystemClock;
use mcp_ratelimit::limit::{
    Concurrency, FixedWindow, Gcra, LeakyBucket, Limiter, SlidingLog, SlidingWindow, TokenBucket,
};
use mcp_ratelimit::store::{Check, MemoryStore};

const BURST: u64 = 1_000;
const RATE_PER_SEC: f64 = 1_000_000.0;
const WINDOW_NANOS: u64 = 1_000_000;
const HOT_KEY: &str = "caller:tok:0123456789abcdef";

/// Fake-clock step per decision with one thread: 2 × the quota's period.
const STEP_ONE_THREAD: u64 = 500;
/// Fake-clock step per decision on each of two threads: together again 2 × the rate.
const STEP_TWO_THREADS: u64 = 1_000;

/// Every algorithm of ours, in the order the table lists them.
const OURS: &[&str] =
    &["token_bucket", "gcra", "fixed_window", "sliding_log", "sliding_window", "leaky_bucket", "concurrency"];

fn limiter(algorithm: &str) -> Limiter {
    match algorithm {
        "token_bucket" => Limiter::TokenBucket(TokenBucket::new(BURST, RATE_PER_SEC)),
        "gcra" => Limiter::Gcra(Gcra::new(BURST, RATE_PER_SEC)),
        "fixed_window" => Limiter::FixedWindow(FixedWindow::new(BURST, WINDOW_NANOS)),
        "sliding_log" => Limiter::SlidingLog(SlidingLog::new(BURST, WINDOW_NANOS)),
        "sliding_window" => Limiter::SlidingWindow(SlidingWindow::new(BURST, WINDOW_NANOS)),
        "leaky_bucket" => Limiter::LeakyBucket(LeakyBucket::new(BURST, RATE_PER_SEC)),
        "concurrency" | "concurrency_1_held" => Limiter::Concurrency(Concurrency::new(BURST)),
        other => unreachable!("unknown algorithm {other}"),
    }
}

fn quota() -> Quota {
    let period = Duration::from_nanos((1e9 / RATE_PER_SEC) as u64);
    let burst = NonZeroU32::new(BURST as u32).expect("burst is not zero");
    Quota::with_period(period).expect("period is not zero").allow_burst(burst)
}

/// Whether this is a real measurement (`cargo bench`), not `cargo test`'s single pass.
fn bench_mode() -> bool {
    static MODE: OnceLock<bool> = OnceLock::new();
    *MODE.get_or_init(|| {
        let has = |flag: &str| std::env::args().any(|a| a == flag);
        has("--bench") && !has("--test") && !has("--list")
    })
}

// ---------------------------------------------------------------------------------------------
// The fake clock both sides share.

/// Where every thread's fake clock starts (1 s, so no limiter ever sees time zero).
const T0: u64 = 1_000_000_000;
/// The furthest any finished thread's fake clock got; new threads start there.
static TICK_HIGH_WATER: AtomicU64 = AtomicU64::new(T0);

thread_local! {
    static TICK: Cell<u64> = const { Cell::new(T0) };
}

/// Reads this thread's fake clock and moves it `STEP` ns forward: one plain add, no atomics.
#[inline(always)]
fn tick<const STEP: u64>() -> u64 {
    TICK.with(|t| {
        let now = t.get() + STEP;
        t.set(now);
        now
    })
}

/// Brings this thread's fake clock up to the furthest any thread has gone.
fn tick_enter() {
    let high = TICK_HIGH_WATER.load(Ordering::SeqCst);
    TICK.with(|t| t.set(t.get().max(high)));
}

/// Publishes this thread's fake clock so later threads never go back in time.
fn tick_leave() {
    TICK_HIGH_WATER.fetch_max(TICK.with(Cell::get), Ordering::SeqCst);
}

/// `governor`'s view of [`tick`].
#[derive(Debug, Clone, Copy, Default)]
struct TickClock<const STEP: u64>;

impl<const STEP: u64> governor::clock::Clock for TickClock<STEP> {
    type Instant = governor::nanos::Nanos;

    #[inline(always)]
    fn now(&self) -> Self::Instant {
        tick::<STEP>().into()
    }
}

/// `governor`'s keyed limiter with its default `DashMap` store, on a fake clock.
type GovernorFake<const STEP: u64> =
    RateLimiter<String, DashMapStateStore<String>, TickClock<STEP>, NoOpMiddleware<governor::nanos::Nanos>>;

fn governor_fake<const STEP: u64>() -> GovernorFake<STEP> {
    RateLimiter::dashmap_with_clock(quota(), TickClock::<STEP>)
}

// ---------------------------------------------------------------------------------------------
// Helpers.

/// One decision of ours on the hot key at `now` (for concurrency: acquire, then release).
#[inline(always)]
fn ours_once(store: &MemoryStore, limiter: &Limiter, key: &str, now: u64) -> bool {
    let decision = store.decide_one(&Check { key: black_box(key), limiter, cost: 1 }, now);
    if limiter.holds_slots() && decision.allowed {
        store.release(key, limiter, 1, now);
    }
    decision.allowed
}

/// Runs `decide` 300,000 times and prints the share allowed over the last 200,000.
fn print_regime(label: &str, mut decide: impl FnMut() -> bool) {
    if !bench_mode() {
        return;
    }
    for _ in 0..100_000 {
        decide();
    }
    let allowed = (0..200_000).filter(|_| decide()).count();
    eprintln!("regime {label}: {:.1}% allowed", allowed as f64 / 2_000.0);
}

/// `iters` decisions split over two OS threads released together; returns the wall time from
/// the first thread's start to the last one's end (thread start-up is not counted).
fn two_threads(iters: u64, decide: &(dyn Fn() -> bool + Sync)) -> Duration {
    let barrier = Barrier::new(2);
    let halves = [iters / 2, iters - iters / 2];
    let spans: Vec<(Instant, Instant)> = std::thread::scope(|scope| {
        let handles: Vec<_> = halves
            .iter()
            .map(|&n| {
                let barrier = &barrier;
                scope.spawn(move || {
                    tick_enter();
                    barrier.wait();
                    let start = Instant::now();
                    for _ in 0..n {
                        black_box(decide());
                    }
                    let end = Instant::now();
                    tick_leave();
                    (start, end)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("bench thread panicked")).collect()
    });
    tick_enter();
    let start = spans.iter().map(|s| s.0).min().expect("two spans");
    let end = spans.iter().map(|s| s.1).max().expect("two spans");
    end - start
}

/// 1,000,000 distinct caller keys (10,000 under `cargo test`), made once.
fn keys() -> &'static [String] {
    static KEYS: OnceLock<Vec<String>> = OnceLock::new();
    KEYS.get_or_init(|| {
        let n: u64 = if bench_mode() { 1_000_000 } else { 10_000 };
        (0..n).map(|i| format!("caller:tok:{:016x}", i.wrapping_mul(0x9E37_79B9_7F4A_7C15))).collect()
    })
}

fn configure(group: &mut BenchmarkGroup<'_, WallTime>) {
    group.warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(2)).sample_size(30);
}

// ---------------------------------------------------------------------------------------------
// The groups.

/// One key, decided over and over.
fn hot_key(c: &mut Criterion) {
    let mut group = c.benchmark_group("hot_key");
    configure(&mut group);
    tick_enter();

    for &algorithm in OURS.iter().chain(&["concurrency_1_held"]) {
        let mut setup: Option<(MemoryStore, Limiter)> = None;
        group.bench_function(BenchmarkId::new(algorithm, "fake_clock"), |b| {
            let (store, limiter) = setup.get_or_insert_with(|| {
                let store = MemoryStore::new();
                let limiter = limiter(algorithm);
                if algorithm == "concurrency_1_held" {
                    // One slot stays taken, so the key's entry is never removed on release.
                    let held = store.decide_one(&Check { key: HOT_KEY, limiter: &limiter, cost: 1 }, tick::<0>());
                    assert!(held.allowed);
                }
                let regime = (MemoryStore::new(), limiter.clone());
                print_regime(&format!("hot_key/{algorithm}/fake_clock"), || {
                    ours_once(&regime.0, &regime.1, HOT_KEY, tick::<STEP_ONE_THREAD>())
                });
                (store, limiter)
            });
            b.iter(|| ours_once(store, limiter, HOT_KEY, tick::<STEP_ONE_THREAD>()));
        });
    }

    let mut governor: Option<GovernorFake<STEP_ONE_THREAD>> = None;
    let key = HOT_KEY.to_string();
    group.bench_function(BenchmarkId::new("governor", "fake_clock"), |b| {
        let governor = governor.get_or_insert_with(|| {
            let regime = governor_fake::<STEP_ONE_THREAD>();
            print_regime("hot_key/governor/fake_clock", || regime.check_key(&key).is_ok());
            governor_fake()
        });
        b.iter(|| governor.check_key(black_box(&key)));
    });

    let clock = SystemClock::shared();
    for algorithm in ["token_bucket", "gcra"] {
        let mut setup: Option<(MemoryStore, Limiter)> = None;
        group.bench_function(BenchmarkId::new(algorithm, "real_clock"), |b| {
            let (store, limiter) = setup.get_or_insert_with(|| {
                let limiter = limiter(algorithm);
                let regime = (MemoryStore::new(), limiter.clone());
                print_regime(&format!("hot_key/{algorithm}/real_clock"), || {
                    ours_once(&regime.0, &regime.1, HOT_KEY, clock.now())
                });
                (MemoryStore::new(), limiter)
            });
            b.iter(|| ours_once(store, limiter, HOT_KEY, clock.now()));
        });
    }

    let mut governor: Option<DefaultKeyedRateLimiter<String>> = None;
    group.bench_function(BenchmarkId::new("governor", "real_clock"), |b| {
        let governor = governor.get_or_insert_with(|| {
            let regime: DefaultKeyedRateLimiter<String> = RateLimiter::keyed(quota());
            print_regime("hot_key/governor/real_clock", || regime.check_key(&key).is_ok());
            RateLimiter::keyed(quota())
        });
        b.iter(|| governor.check_key(black_box(&key)));
    });

    group.finish();
}

/// A million callers: every decision is on the next of 1,000,000 pre-warmed keys, so the map
/// lookup misses the CPU caches as it would on a busy server. Each key comes round every
/// 0.5 s of fake time, long enough to refill it, so here (nearly) every decision is allowed.
fn many_keys(c: &mut Criterion) {
    let mut group = c.benchmark_group("many_keys");
    configure(&mut group);
    tick_enter();

    for algorithm in ["token_bucket", "gcra", "fixed_window", "sliding_log", "sliding_window", "leaky_bucket"] {
        let mut setup: Option<(MemoryStore, Limiter)> = None;
        let mut next = 0usize;
        group.bench_function(BenchmarkId::new(algorithm, "fake_clock"), |b| {
            let keys = keys();
            let (store, limiter) = setup.get_or_insert_with(|| {
                let store = MemoryStore::new();
                let limiter = limiter(algorithm);
                for key in keys {
                    store.decide_one(&Check { key, limiter: &limiter, cost: 1 }, tick::<STEP_ONE_THREAD>());
                }
                assert_eq!(store.len(), keys.len(), "every key is pre-warmed");
                (store, limiter)
            });
            b.iter(|| {
                let key = &keys[next];
                next += 1;
                if next == keys.len() {
                    next = 0;
                }
                ours_once(store, limiter, key, tick::<STEP_ONE_THREAD>())
            });
        });
        // A million entries per store: give the memory back before the next one.
        drop(setup);
    }

    let mut governor: Option<GovernorFake<STEP_ONE_THREAD>> = None;
    let mut next = 0usize;
    group.bench_function(BenchmarkId::new("governor", "fake_clock"), |b| {
        let keys = keys();
        let governor = governor.get_or_insert_with(|| {
            let governor = governor_fake::<STEP_ONE_THREAD>();
            for key in keys {
                let _ = governor.check_key(key);
            }
            assert_eq!(governor.len(), keys.len(), "every key is pre-warmed");
            governor
        });
        b.iter(|| {
            let key = &keys[next];
            next += 1;
            if next == keys.len() {
                next = 0;
            }
            governor.check_key(key)
        });
    });
    drop(governor);

    group.finish();
}

/// Two OS threads on one key. Reported per decision over both threads (wall time / decisions),
/// so 1e9 / ns is the pair's combined throughput.
fn contended_two_threads(c: &mut Criterion) {
    let mut group = c.benchmark_group("contended_two_threads");
    configure(&mut group);
    group.throughput(Throughput::Elements(1));
    tick_enter();

    for algorithm in ["token_bucket", "gcra"] {
        let store = MemoryStore::new();
        let limiter = limiter(algorithm);
        let mut regime_done = false;
        group.bench_function(BenchmarkId::new(algorithm, "fake_clock"), |b| {
            let decide = || ours_once(&store, &limiter, HOT_KEY, tick::<STEP_TWO_THREADS>());
            if !regime_done && bench_mode() {
                regime_done = true;
                let regime_store = MemoryStore::new();
                let counted = AtomicU64::new(0);
                let decide = || {
                    let allowed = ours_once(&regime_store, &limiter, HOT_KEY, tick::<STEP_TWO_THREADS>());
                    counted.fetch_add(u64::from(allowed), Ordering::Relaxed);
                    allowed
                };
                two_threads(400_000, &decide);
                let share = counted.load(Ordering::Relaxed) as f64 / 4_000.0;
                eprintln!("regime contended_two_threads/{algorithm}/fake_clock: {share:.1}% allowed");
            }
            b.iter_custom(|iters| two_threads(iters, &decide));
        });
    }

    let governor = governor_fake::<STEP_TWO_THREADS>();
    let key = HOT_KEY.to_string();
    let mut regime_done = false;
    group.bench_function(BenchmarkId::new("governor", "fake_clock"), |b| {
        let decide = || governor.check_key(black_box(&key)).is_ok();
        if !regime_done && bench_mode() {
            regime_done = true;
            let regime = governor_fake::<STEP_TWO_THREADS>();
            let counted = AtomicU64::new(0);
            let decide = || {
                let allowed = regime.check_key(&key).is_ok();
                counted.fetch_add(u64::from(allowed), Ordering::Relaxed);
                allowed
            };
            two_threads(400_000, &decide);
            let share = counted.load(Ordering::Relaxed) as f64 / 4_000.0;
            eprintln!("regime contended_two_threads/governor/fake_clock: {share:.1}% allowed");
        }
        b.iter_custom(|iters| two_threads(iters, &decide));
    });

    group.finish();
}

criterion_group!(benches, hot_key, many_keys, contended_two_threads);
criterion_main!(benches);
