//! Many OS threads hammering one key admit exactly what a sequential model admits: never one
//! call too many, never one too few. Time is frozen within a phase and moved between phases,
//! so the exact number each phase must admit is known.

use std::sync::Barrier;

use mcp_ratelimit::clock::Nanos;
use mcp_ratelimit::limit::{
    Concurrency, FixedWindow, Gcra, LeakyBucket, Limiter, SlidingLog, SlidingWindow, TokenBucket,
};
use mcp_ratelimit::store::{Check, MemoryStore};

const THREADS: usize = 4;
const CALLS_PER_THREAD: usize = 100_000;
const SEC: u64 = 1_000_000_000;

/// All threads at once, at time `now`, on one key; returns the units admitted.
fn hammer(store: &MemoryStore, limiter: &Limiter, now: u64, cost: u64) -> u64 {
    let start = Barrier::new(THREADS);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..THREADS)
            .map(|_| {
                s.spawn(|| {
                    start.wait();
                    let check = Check { key: "caller:tok:hot", limiter, cost, shadow: false };
                    (0..CALLS_PER_THREAD).filter(|_| store.decide_one(&check, Nanos::new(now)).allowed).count() as u64
                        * cost
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().expect("worker finished")).sum()
    })
}

/// Phase 0 admits the full capacity; each later phase, after `step` of time, admits `refill`.
fn exact_per_phase(limiter: Limiter, cost: u64, step: u64, refill: u64) {
    let store = MemoryStore::new();
    let name = limiter.algorithm();
    let mut now = 1_000 * SEC;
    assert_eq!(hammer(&store, &limiter, now, cost), limiter.capacity(), "{name}: first burst");
    for phase in 1..=3 {
        now += step;
        assert_eq!(hammer(&store, &limiter, now, cost), refill, "{name}: phase {phase}");
    }
}

#[test]
fn token_bucket_admits_exactly_under_contention() {
    exact_per_phase(Limiter::TokenBucket(TokenBucket::new(1_000, 100.0)), 1, 2 * SEC, 200);
}

#[test]
fn gcra_admits_exactly_under_contention() {
    exact_per_phase(Limiter::Gcra(Gcra::new(1_000, 100.0)), 1, 2 * SEC, 200);
}

#[test]
fn leaky_bucket_admits_exactly_under_contention() {
    exact_per_phase(Limiter::LeakyBucket(LeakyBucket::new(1_000, 100.0)), 1, 2 * SEC, 200);
}

#[test]
fn costs_are_all_or_nothing_under_contention() {
    // 1000 tokens, cost 7: 142 calls fit (994 tokens), the 6 left over never admit a 7.
    let store = MemoryStore::new();
    let limiter = Limiter::TokenBucket(TokenBucket::new(1_000, 1.0));
    assert_eq!(hammer(&store, &limiter, SEC, 7), 994);
}

#[test]
fn fixed_window_admits_exactly_under_contention() {
    exact_per_phase(Limiter::FixedWindow(FixedWindow::new(1_000, Nanos::new(60 * SEC))), 1, 60 * SEC, 1_000);
}

#[test]
fn sliding_log_admits_exactly_under_contention() {
    exact_per_phase(Limiter::SlidingLog(SlidingLog::new(500, Nanos::new(10 * SEC))), 1, 10 * SEC, 500);
}

#[test]
fn sliding_window_admits_exactly_under_contention() {
    // Two windows later the previous count no longer weighs: a full limit each phase.
    exact_per_phase(Limiter::SlidingWindow(SlidingWindow::new(1_000, Nanos::new(10 * SEC))), 1, 20 * SEC, 1_000);
}

#[test]
fn concurrency_hands_out_exactly_its_slots_under_contention() {
    let store = MemoryStore::new();
    let limiter = Limiter::Concurrency(Concurrency::new(64));
    assert_eq!(hammer(&store, &limiter, 0, 1), 64);
    store.release_at("caller:tok:hot", &limiter, 64, Nanos::ZERO);
    assert_eq!(hammer(&store, &limiter, 0, 2), 64, "released slots are all there again");
}
