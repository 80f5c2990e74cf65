//! Nanoseconds per limiter decision: our [`MemoryStore`] with every algorithm, against
//! `governor`'s keyed limiter (its default `DashMap` state) in the same run, on the same quota.
//!
//! Run with `cargo bench --bench limiters` (or `scripts/bench.sh`, which also prints a table).
//! Under `cargo test` each benchmark runs once, on 10,000 keys instead of 1,000,000.
//! Results and how to read them: `BENCHMARKS.md`.
//!
//! # Groups
//! * `hot_key` — one key, decided over and over: every algorithm of ours and governor. For
//!   `concurrency` one "decision" is an acquire plus its release (two store calls);
//!   `concurrency_1_held` is the same with one other slot held throughout, so the key's entry
//!   is not removed on every release.
//! * `many_keys` — the next of 1,000,000 pre-warmed keys on every decision (the map no longer
//!   fits in cache).
//! * `contended_two_threads` — two OS threads on one key, ns per decision over both. The spread
//!   between samples is wide on a small VM, so `contended_paired` re-measures it with ours and
//!   governor taking turns in short rounds and prints per-round ratios.
//! * `clock_read` — one reading of each real clock.
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
//!   Each thread has its own counter (synced at the start and end of every sample), so the
//!   clock itself is never a contended cache line; the key's state is the only shared thing.
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
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use governor::middleware::NoOpMiddleware;
use governor::state::keyed::DashMapStateStore;
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use mcp_ratelimit::clock::{Nanos, SystemClock};
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
        "fixed_window" => Limiter::FixedWindow(FixedWindow::new(BURST, Nanos::new(WINDOW_NANOS))),
        "sliding_log" => Limiter::SlidingLog(SlidingLog::new(BURST, Nanos::new(WINDOW_NANOS))),
        "sliding_window" => Limiter::SlidingWindow(SlidingWindow::new(BURST, Nanos::new(WINDOW_NANOS))),
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
/// The furthest any thread's fake clock got when it last synced; threads start from there.
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

/// Brings this thread's fake clock up to the furthest any thread has gone, and publishes it, so
/// no thread (and no limiter's start instant) is ever behind another's time by more than the
/// decisions made since the last sync.
fn tick_sync() {
    let mine = TICK.with(Cell::get);
    let high = TICK_HIGH_WATER.fetch_max(mine, Ordering::SeqCst).max(mine);
    TICK.with(|t| t.set(high));
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
    let decision = store.decide_one(&Check { key: black_box(key), limiter, cost: 1, shadow: false }, Nanos::new(now));
    if limiter.holds_slots() && decision.allowed {
        store.release_at(key, limiter, 1, Nanos::new(now));
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

/// Spins until `ready` says so, yielding the CPU now and then so a waiting thread never starves
/// the one it waits for.
fn wait_until(mut ready: impl FnMut() -> bool) {
    let mut spins = 0u32;
    while !ready() {
        spins = spins.saturating_add(1);
        if spins > 20_000 {
            // Idle for a while (between benchmarks): stop burning a core.
            std::thread::sleep(Duration::from_millis(1));
        } else if spins.is_multiple_of(256) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

/// Runs `body` with a function that splits `iters` decisions between this thread and one helper
/// OS thread, and returns the wall time from the first one's start to the last one's end.
///
/// The helper lives for the whole of `body` (every sample of one benchmark), so thread start-up
/// is never timed, and both threads begin each sample together after a handshake, so the two
/// halves really overlap. Expect a wide spread: on this 2-vCPU VM some samples run both threads
/// at near single-thread speed while overlapping (the cache line moves cheaply, presumably when
/// the two vCPUs share a physical core) and others at 4-6× that, so compare medians.
fn with_two_threads<R>(decide: &(dyn Fn() -> bool + Sync), body: impl FnOnce(&dyn Fn(u64) -> Duration) -> R) -> R {
    let job = AtomicU64::new(0); // sample number the helper should run; u64::MAX: stop
    let helper_iters = AtomicU64::new(0);
    let started = AtomicU64::new(0);
    let finished = AtomicU64::new(0);
    let helper_span: Mutex<Option<(Instant, Instant)>> = Mutex::new(None);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let mut seen = 0;
            loop {
                wait_until(|| job.load(Ordering::Acquire) != seen);
                seen = job.load(Ordering::Acquire);
                if seen == u64::MAX {
                    return;
                }
                tick_sync();
                let n = helper_iters.load(Ordering::Acquire);
                started.store(seen, Ordering::Release);
                let start = Instant::now();
                for _ in 0..n {
                    black_box(decide());
                }
                let end = Instant::now();
                tick_sync();
                *helper_span.lock().expect("span lock") = Some((start, end));
                finished.store(seen, Ordering::Release);
            }
        });
        let sample = AtomicU64::new(0);
        let run = |iters: u64| {
            let n = sample.fetch_add(1, Ordering::Relaxed) + 1;
            tick_sync();
            helper_iters.store(iters / 2, Ordering::Release);
            job.store(n, Ordering::Release);
            wait_until(|| started.load(Ordering::Acquire) == n);
            let start = Instant::now();
            for _ in 0..iters - iters / 2 {
                black_box(decide());
            }
            let end = Instant::now();
            wait_until(|| finished.load(Ordering::Acquire) == n);
            tick_sync();
            let (helper_start, helper_end) = helper_span.lock().expect("span lock").take().expect("helper ran");
            end.max(helper_end) - start.min(helper_start)
        };
        let result = body(&run);
        job.store(u64::MAX, Ordering::Release);
        result
    })
}

/// Prints the share of decisions `decide` allows when two threads make 2,000,000 of them.
fn print_contended_regime(label: &str, decide: &(dyn Fn() -> bool + Sync)) {
    if !bench_mode() || !selected(label) {
        return;
    }
    let allowed = AtomicU64::new(0);
    let counting = || {
        let ok = decide();
        allowed.fetch_add(u64::from(ok), Ordering::Relaxed);
        ok
    };
    with_two_threads(&counting, |run| run(2_000_000));
    eprintln!("regime {label}: {:.1}% allowed", allowed.load(Ordering::Relaxed) as f64 / 20_000.0);
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
    tick_sync();

    for &algorithm in OURS.iter().chain(&["concurrency_1_held"]) {
        let mut setup: Option<(MemoryStore, Limiter)> = None;
        group.bench_function(BenchmarkId::new(algorithm, "fake_clock"), |b| {
            let (store, limiter) = setup.get_or_insert_with(|| {
                let store = MemoryStore::new();
                let limiter = limiter(algorithm);
                if algorithm == "concurrency_1_held" {
                    // One slot stays taken, so the key's entry is never removed on release.
                    let held = store.decide_one(
                        &Check { key: HOT_KEY, limiter: &limiter, cost: 1, shadow: false },
                        Nanos::new(tick::<0>()),
                    );
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
                    ours_once(&regime.0, &regime.1, HOT_KEY, clock.now().as_u64())
                });
                (MemoryStore::new(), limiter)
            });
            b.iter(|| ours_once(store, limiter, HOT_KEY, clock.now().as_u64()));
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
    tick_sync();

    for algorithm in ["token_bucket", "gcra", "fixed_window", "sliding_log", "sliding_window", "leaky_bucket"] {
        let mut setup: Option<(MemoryStore, Limiter)> = None;
        let mut next = 0usize;
        group.bench_function(BenchmarkId::new(algorithm, "fake_clock"), |b| {
            let keys = keys();
            let (store, limiter) = setup.get_or_insert_with(|| {
                let store = MemoryStore::new();
                let limiter = limiter(algorithm);
                for key in keys {
                    store.decide_one(
                        &Check { key, limiter: &limiter, cost: 1, shadow: false },
                        Nanos::new(tick::<STEP_ONE_THREAD>()),
                    );
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
    // Twice the samples of the other groups: the spread between samples is wide here.
    group.measurement_time(Duration::from_secs(4)).sample_size(60);
    group.throughput(Throughput::Elements(1));
    tick_sync();

    for algorithm in ["token_bucket", "gcra"] {
        let limiter = limiter(algorithm);
        let regime_store = MemoryStore::new();
        print_contended_regime(&format!("contended_two_threads/{algorithm}/fake_clock"), &|| {
            ours_once(&regime_store, &limiter, HOT_KEY, tick::<STEP_TWO_THREADS>())
        });
        let store = MemoryStore::new();
        let decide = || ours_once(&store, &limiter, HOT_KEY, tick::<STEP_TWO_THREADS>());
        with_two_threads(&decide, |run| {
            group.bench_function(BenchmarkId::new(algorithm, "fake_clock"), |b| b.iter_custom(run));
        });
    }

    let key = HOT_KEY.to_string();
    let regime = governor_fake::<STEP_TWO_THREADS>();
    print_contended_regime("contended_two_threads/governor/fake_clock", &|| regime.check_key(&key).is_ok());
    let governor = governor_fake::<STEP_TWO_THREADS>();
    let decide = || governor.check_key(black_box(&key)).is_ok();
    with_two_threads(&decide, |run| {
        group.bench_function(BenchmarkId::new("governor", "fake_clock"), |b| b.iter_custom(run));
    });

    group.finish();
}

/// Whether criterion's filter (if any) selects a benchmark named `id`; a rough check for the
/// measurement below, which criterion does not run itself.
fn selected(id: &str) -> bool {
    let filters: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    filters.is_empty() || filters.iter().any(|f| id.contains(f.as_str()))
}

fn quartiles(mut values: Vec<f64>) -> [f64; 3] {
    values.sort_by(f64::total_cmp);
    let at = |q: f64| values[((values.len() - 1) as f64 * q).round() as usize];
    [at(0.25), at(0.5), at(0.75)]
}

/// The contended comparison again, paired: ours and governor take turns in short rounds
/// (100,000 decisions by two threads each, order rotating), so a change in how the host runs
/// the two vCPUs hits all three alike. Prints the per-round ratio ours/governor; `scripts/bench.sh`
/// repeats these lines under its table. Bench mode only; about 3 s.
fn contended_paired(_: &mut Criterion) {
    if !bench_mode() || !selected("contended_two_threads/paired") {
        return;
    }
    const ROUNDS: usize = 120;
    const PER_ROUND: u64 = 100_000;
    let key = HOT_KEY.to_string();
    let (token_bucket, gcra) = (limiter("token_bucket"), limiter("gcra"));
    let (store_tb, store_gcra) = (MemoryStore::new(), MemoryStore::new());
    let governor = governor_fake::<STEP_TWO_THREADS>();
    let decide_tb = || ours_once(&store_tb, &token_bucket, HOT_KEY, tick::<STEP_TWO_THREADS>());
    let decide_gcra = || ours_once(&store_gcra, &gcra, HOT_KEY, tick::<STEP_TWO_THREADS>());
    let decide_governor = || governor.check_key(black_box(&key)).is_ok();
    let mut ns: [Vec<f64>; 3] = Default::default();
    with_two_threads(&decide_tb, |run_tb| {
        with_two_threads(&decide_gcra, |run_gcra| {
            with_two_threads(&decide_governor, |run_governor| {
                let runs = [run_tb, run_gcra, run_governor];
                for run in runs {
                    run(PER_ROUND); // warm-up
                }
                for round in 0..ROUNDS {
                    for k in 0..3 {
                        let i = (round + k) % 3;
                        ns[i].push(runs[i](PER_ROUND).as_nanos() as f64 / PER_ROUND as f64);
                    }
                }
            })
        })
    });
    let [.., governor_ns] = &ns;
    let [_, governor_median, _] = quartiles(governor_ns.clone());
    println!("paired contended_two_threads fake_clock ({ROUNDS} rounds x {PER_ROUND} decisions, ns/decision):");
    println!("paired   governor          median {governor_median:6.1}");
    for (name, ours) in [("token_bucket", &ns[0]), ("gcra", &ns[1])] {
        let [_, median, _] = quartiles(ours.clone());
        let ratios: Vec<f64> = ours.iter().zip(governor_ns).map(|(o, g)| o / g).collect();
        let [q1, ratio, q3] = quartiles(ratios);
        println!(
            "paired   ours {name:<12} median {median:6.1}   ours/governor per round: median {ratio:.2}x (quartiles {q1:.2}-{q3:.2})"
        );
    }
}

/// The price of one reading of each real clock, to read the `real_clock` rows against.
fn clock_read(c: &mut Criterion) {
    let mut group = c.benchmark_group("clock_read");
    configure(&mut group);
    let ours = SystemClock::shared();
    group.bench_function(BenchmarkId::new("system_clock", "real_clock"), |b| b.iter(|| ours.now()));
    let quanta = governor::clock::DefaultClock::default();
    group.bench_function(BenchmarkId::new("governor", "real_clock"), |b| {
        b.iter(|| governor::clock::Clock::now(&quanta))
    });
    group.finish();
}

criterion_group!(benches, hot_key, many_keys, contended_two_threads, contended_paired, clock_read);
criterion_main!(benches);
