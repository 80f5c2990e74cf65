//! Budgets adjusted after the fact, on every algorithm: an operator's refund never gives a budget
//! more than its capacity and gives exactly the units asked where the algorithm counts units one
//! by one; a settled price below its reservation gives back at most the units, never past the
//! capacity; one above it takes what is left and never more (a budget never goes below empty).
//! The Lua twin (`adjust.lua` with each algorithm's `acquire`, `refund` and `give_back`) leaves
//! Redis in the very state the Rust algorithm leaves memory in — the decisions after it agree
//! field by field, settlements of earlier charges included. An adjustment sent again under its
//! mark (a settlement tried again after a lost answer) is applied once. (That a settlement goes
//! back only where its charge was taken is the algorithm suite's
//! `late_refunds_go_back_only_where_they_were_taken`.)

use std::time::Duration;

use crate::test_redis::TestRedis;
use mcp_ratelimit::clock::Nanos;
use mcp_ratelimit::limit::{
    Adjustment, Concurrency, FixedWindow, GIVEN_BACK_AHEAD, Gcra, LeakyBucket, Limiter, SlidingLog, SlidingWindow,
    TokenBucket,
};
use mcp_ratelimit::store::redis::RedisStore;
use mcp_ratelimit::store::{Check, MemoryStore};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

const SEC: Nanos = Nanos::from_secs(1);
/// 2026-01-01T00:00:00Z: a realistic epoch reading, a multiple of every whole-second window.
const EPOCH: Nanos = Nanos::from_secs(1_767_225_600);
const TIMEOUT: Duration = Duration::from_secs(5);
/// A key closer than this to its `forget_at` may expire in Redis's real time while the test's
/// clock stands still: the next step then moves on to `forget_at` (see redis_store.rs beside).
const MARGIN: Nanos = Nanos::from_millis(200);

fn limiters() -> Vec<Limiter> {
    vec![
        Limiter::TokenBucket(TokenBucket::new(7, 3.0)),
        Limiter::Gcra(Gcra::new(7, 3.0)),
        Limiter::LeakyBucket(LeakyBucket::new(7, 0.7)),
        Limiter::FixedWindow(FixedWindow::new(7, 10 * SEC)),
        Limiter::SlidingLog(SlidingLog::new(7, 10 * SEC)),
        Limiter::SlidingWindow(SlidingWindow::new(7, 10 * SEC)),
    ]
}

/// One step: after `gap_us`, spend `cost`, adjust the budget after the fact, or settle the
/// `of`th admitted spend so far (modulo their number) `units` below its cost.
#[derive(Debug, Clone)]
enum Step {
    Spend { gap_us: u64, cost: u64 },
    Adjust { gap_us: u64, by: Adjustment },
    Settle { gap_us: u64, of: usize, units: u64 },
}

fn steps(capacity: u64) -> impl Strategy<Value = Vec<Step>> {
    let gap = prop_oneof![4 => Just(0u64), 3 => 1..3_000_000u64, 1 => 3_000_000..30_000_000u64];
    let step = prop_oneof![
        3 => (gap.clone(), 0..=capacity).prop_map(|(gap_us, cost)| Step::Spend { gap_us, cost }),
        2 => (gap.clone(), 1..=capacity * 3).prop_map(|(gap_us, units)| Step::Adjust { gap_us, by: Adjustment::Refund(units) }),
        2 => (gap.clone(), 1..=capacity * 3).prop_map(|(gap_us, units)| Step::Adjust { gap_us, by: Adjustment::Charge(units) }),
        2 => (gap, any::<usize>(), 1..=capacity).prop_map(|(gap_us, of, units)| Step::Settle { gap_us, of, units }),
    ];
    prop::collection::vec(step, 1..=25)
}

/// The adjustment settling the `of`th of `spent` (admitted spends: cost and decision) `units`
/// below its cost, if there is one.
fn settling(spent: &[(u64, mcp_ratelimit::limit::Decision)], of: usize, units: u64) -> Option<Adjustment> {
    let (cost, d) = spent.get(of.checked_rem(spent.len())?)?;
    Some(Adjustment::Return { units: units.min(*cost), taken: d.taken() })
}

fn runner() -> TestRunner {
    TestRunner::new(Config { cases: 64, failure_persistence: None, ..Config::default() })
}

/// What a key can admit right now.
fn remaining(limiter: &Limiter, state: &mut mcp_ratelimit::limit::LimiterState, now: Nanos) -> u64 {
    limiter.acquire(state, now, 0).remaining
}

#[test]
fn an_adjustment_never_lifts_a_budget_past_its_capacity_nor_below_empty_and_moves_it_by_what_it_says() {
    let mut all = limiters();
    all.push(Limiter::Concurrency(Concurrency::new(7)));
    let strategy = (0..all.len()).prop_flat_map(|i| (Just(i), steps(7)));
    let outcome = runner().run(&strategy, |(i, steps)| {
        let limiter = &all[i];
        let mut now = EPOCH;
        let mut state = limiter.fresh(now);
        let mut spent = vec![];
        for step in &steps {
            match *step {
                Step::Spend { gap_us, cost } => {
                    now += Nanos::new(gap_us * 1_000);
                    let d = limiter.acquire(&mut state, now, cost);
                    if d.allowed && cost > 0 {
                        spent.push((cost, d));
                    }
                }
                Step::Settle { gap_us, of, units } => {
                    now += Nanos::new(gap_us * 1_000);
                    let Some(by) = settling(&spent, of, units) else { continue };
                    let before = remaining(limiter, &mut state, now);
                    limiter.adjust(&mut state, now, by);
                    let after = remaining(limiter, &mut state, now);
                    prop_assert!(after >= before, "{}: a settlement took budget away", limiter.describe());
                    prop_assert!(
                        after <= (before + units).min(limiter.capacity()),
                        "{}: {before} → {after}",
                        limiter.describe()
                    );
                }
                Step::Adjust { gap_us, by } => {
                    now += Nanos::new(gap_us * 1_000);
                    let before = remaining(limiter, &mut state, now);
                    limiter.adjust(&mut state, now, by);
                    let after = remaining(limiter, &mut state, now);
                    prop_assert!(after <= limiter.capacity(), "{}: {after} left after {by:?}", limiter.describe());
                    match by {
                        Adjustment::Refund(units) => {
                            prop_assert!(after >= before, "{}: a refund took budget away", limiter.describe());
                            // The sliding window's previous count weighs in fractions; every other
                            // algorithm counts units one by one and gives back exactly what was asked.
                            if !matches!(limiter, Limiter::SlidingWindow(_)) {
                                prop_assert_eq!(
                                    after,
                                    (before + units).min(limiter.capacity()),
                                    "{}",
                                    limiter.describe()
                                );
                            }
                        }
                        // Slots are work, not a price: a charge leaves them as they were.
                        Adjustment::Charge(_) if limiter.holds_slots() => prop_assert_eq!(after, before),
                        // What was left, less the units, and never below empty.
                        Adjustment::Charge(units) => {
                            prop_assert_eq!(after, before.saturating_sub(units), "{}", limiter.describe());
                        }
                        Adjustment::Return { .. } => unreachable!("settlements are their own step"),
                    }
                    // However it was adjusted, one instant admits no more than it says is left.
                    let mut burst = state.clone();
                    let admitted =
                        (0..=limiter.capacity()).take_while(|_| limiter.acquire(&mut burst, now, 1).allowed).count();
                    prop_assert!(admitted as u64 == after, "{}: {admitted} admitted, {after} said", limiter.describe());
                }
            }
        }
        Ok(())
    });
    if let Err(e) = outcome {
        panic!("{e}");
    }
}

#[test]
fn adjust_lua_leaves_redis_as_the_rust_adjustment_leaves_memory() {
    let redis = TestRedis::start();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let store = runtime.block_on(RedisStore::connect(&redis.url, TIMEOUT)).expect("connects to Redis");
    let all = limiters();
    let strategy = (0..all.len()).prop_flat_map(|i| (Just(i), steps(7)));
    let case = std::cell::Cell::new(0);
    let outcome = runner().run(&strategy, |(i, steps)| {
        let limiter = &all[i];
        case.set(case.get() + 1);
        let key = redis.key(&format!("adjust:{}:{}", limiter.algorithm(), case.get()));
        let memory = MemoryStore::new();
        let mut now = EPOCH;
        let mut not_before = Nanos::ZERO;
        let mut spent = vec![];
        for (n, step) in steps.iter().enumerate() {
            let adjusted = |by: Adjustment, now: Nanos| {
                let got = runtime.block_on(store.adjust(&[(&key, limiter, by)], None, Some(now)));
                Ok::<_, TestCaseError>((
                    memory.adjust_at(&[(&key, limiter, by)], now).pop(),
                    got.map_err(|e| TestCaseError::fail(e.to_string()))?.pop(),
                ))
            };
            let (gap_us, expected, got) = match *step {
                Step::Spend { gap_us, cost } => {
                    now = (now + Nanos::new(gap_us * 1_000)).max(not_before);
                    let check = Check { key: &key, limiter, cost, shadow: false };
                    let got = runtime.block_on(store.decide_at(&[check], now)).map(|mut d| d.pop());
                    let expected = memory.decide_one(&check, now);
                    if expected.allowed && cost > 0 {
                        spent.push((cost, expected));
                    }
                    (gap_us, Some(expected), got.map_err(|e| TestCaseError::fail(e.to_string()))?)
                }
                Step::Adjust { gap_us, by } => {
                    now = (now + Nanos::new(gap_us * 1_000)).max(not_before);
                    let (expected, got) = adjusted(by, now)?;
                    (gap_us, expected, got)
                }
                Step::Settle { gap_us, of, units } => {
                    let Some(by) = settling(&spent, of, units) else { continue };
                    now = (now + Nanos::new(gap_us * 1_000)).max(not_before);
                    let (expected, got) = adjusted(by, now)?;
                    (gap_us, expected, got)
                }
            };
            prop_assert_eq!(got, expected, "step {} ({:?}, +{} µs) of {}", n, step, gap_us, limiter.describe());
            // When the key is full again (as good as forgotten), to keep off Redis's real-time expiry.
            let read = memory.decide_one(&Check { key: &key, limiter, cost: 0, shadow: false }, now);
            // (A bucket that gave back is stamped a microsecond ahead: forgotten that much later.)
            let full_at = now + read.reset_after + GIVEN_BACK_AHEAD;
            not_before =
                if full_at - now < MARGIN { Nanos::new(full_at.as_u64().div_ceil(1_000) * 1_000) } else { Nanos::ZERO };
        }
        Ok(())
    });
    if let Err(e) = outcome {
        panic!("{e}");
    }
}

#[test]
fn adjust_lua_gives_in_flight_slots_back_like_a_release_and_charges_none() {
    let redis = TestRedis::start();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let store = runtime.block_on(RedisStore::connect(&redis.url, TIMEOUT)).expect("connects to Redis");
    let slots = Limiter::Concurrency(Concurrency::new(5));
    let key = redis.key("refund:slots");
    let memory = MemoryStore::new();
    let now = EPOCH;
    for cost in [2, 2] {
        let check = Check { key: &key, limiter: &slots, cost, shadow: false };
        let got = runtime.block_on(store.decide_at(&[check], now)).expect("decides");
        assert_eq!(got, vec![memory.decide_one(&check, now)]);
    }
    for by in [Adjustment::Charge(2), Adjustment::Refund(3), Adjustment::Charge(9), Adjustment::Refund(3)] {
        let got = runtime.block_on(store.adjust(&[(&key, &slots, by)], None, Some(now))).expect("adjusts");
        assert_eq!(got, memory.adjust_at(&[(&key, &slots, by)], now), "after {by:?}");
    }
    let read = runtime
        .block_on(store.decide_at(&[Check { key: &key, limiter: &slots, cost: 0, shadow: false }], now))
        .expect("reads");
    assert_eq!(read[0].remaining, 5, "every slot back, never more");
}

#[test]
fn an_adjustment_sent_again_with_its_mark_is_applied_once_and_a_new_mark_applies_again() {
    let redis = TestRedis::start();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let store = runtime.block_on(RedisStore::connect(&redis.url, TIMEOUT)).expect("connects to Redis");
    let bucket = Limiter::TokenBucket(TokenBucket::new(100, 0.0001));
    let (caller, tenant) = (redis.key("mark:caller"), redis.key("mark:tenant"));
    let budgets = |by| [(caller.as_str(), &bucket, by), (tenant.as_str(), &bucket, by)];
    let now = EPOCH;
    for key in [&caller, &tenant] {
        let check = Check { key, limiter: &bucket, cost: 30, shadow: false };
        runtime.block_on(store.decide_at(&[check], now)).expect("decides");
    }
    let (first, second) = (redis.key("mark:settlement-1"), redis.key("mark:settlement-2"));
    let remaining = |got: Vec<mcp_ratelimit::limit::Decision>| got.iter().map(|d| d.remaining).collect::<Vec<_>>();
    // A refund of 4, sent three times under one mark (its answers lost, say): 4 back, once.
    for _ in 0..3 {
        let got = runtime.block_on(store.adjust(&budgets(Adjustment::Refund(4)), Some(&first), Some(now)));
        assert_eq!(remaining(got.expect("adjusts")), vec![74, 74]);
    }
    // A charge under another mark is another adjustment; sent twice, it too lands once.
    for _ in 0..2 {
        let got = runtime.block_on(store.adjust(&budgets(Adjustment::Charge(10)), Some(&second), Some(now)));
        assert_eq!(remaining(got.expect("adjusts")), vec![64, 64]);
    }
    // Without a mark (an operator's refund), each one sent is applied.
    for expected in [66, 68] {
        let got = runtime.block_on(store.adjust(&budgets(Adjustment::Refund(2)), None, Some(now)));
        assert_eq!(remaining(got.expect("adjusts")), vec![expected, expected]);
    }
}
