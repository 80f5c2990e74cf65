//! The suite every backend must pass: what the guard relies on a [`Store`] for, asked through
//! `dyn Store` only, with no time travel (a shared store keeps its own clock), so it runs the
//! same on this process's memory and on a Redis across the network.
//!
//! The memory store runs it in its unit tests; the Redis store in `tests/` against a
//! `redis-server` of its own. A third backend calls [`run`] from a test of its own:
//!
//! ```
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! use std::sync::Arc;
//! use mcp_ratelimit_kernel::store::{MemoryStore, Store, suite};
//!
//! let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
//! suite::run(store, "{suite}").await;
//! # });
//! ```
//!
//! Each check panics with what the backend got wrong. Buckets refill at one unit in a thousand
//! seconds, so a slow network changes no figure.

use std::sync::Arc;
use std::time::Duration;

use super::{Check, Lease, Store, Verdict};
use crate::clock::Nanos;
use crate::limit::{Adjustment, Concurrency, Limiter, TokenBucket};

/// Runs every check of the suite on `store`, each under its own keys beginning with `prefix`
/// (give a hash tag, e.g. `{suite}`, where keys of one call must share one, and a prefix of
/// its own per run where the store outlives the test).
pub async fn run(store: Arc<dyn Store>, prefix: &str) {
    a_refusal_in_one_scope_charges_none(&store, prefix).await;
    two_checks_on_one_key_see_each_other(&store, prefix).await;
    a_refused_shadow_check_stops_nothing_and_is_not_charged(&store, prefix).await;
    slots_given_back_admit_again(&store, prefix).await;
    a_block_stops_calls_until_lifted(&store, prefix).await;
    adjustments_stay_within_the_bucket(&store, prefix).await;
    forgotten_budgets_are_full(&store, prefix).await;
    counters_read_what_was_bumped(&store, prefix).await;
    a_busy_budget_is_spent_to_the_last_unit_and_no_further(&store, prefix).await;
}

/// A bucket of `capacity` that refills one unit in a thousand seconds.
fn bucket(capacity: u64) -> Limiter {
    Limiter::TokenBucket(TokenBucket::new(capacity, 0.001))
}

/// The decisions for `checks`, which must be decided (no block, no loop).
async fn decided(store: &Arc<dyn Store>, checks: &[Check<'_>]) -> Vec<crate::limit::Decision> {
    match store.decide(checks, &[], Lease::new()).await {
        Ok(Verdict::Decided(decisions)) => {
            assert_eq!(decisions.len(), checks.len(), "one decision per check");
            decisions
        }
        other => panic!("the store did not decide {checks:?}: {other:?}"),
    }
}

/// What is left under `key`, read without charging.
async fn remaining(store: &Arc<dyn Store>, key: &str, limiter: &Limiter) -> u64 {
    decided(store, &[Check { key, limiter, cost: 0, shadow: false }]).await[0].remaining
}

/// Either every scope admits a call and all are charged, or none is.
pub async fn a_refusal_in_one_scope_charges_none(store: &Arc<dyn Store>, prefix: &str) {
    let (roomy, tight) = (bucket(100), bucket(5));
    let (caller, tenant) = (format!("{prefix}all:caller"), format!("{prefix}all:tenant"));
    let checks = [
        Check { key: &caller, limiter: &roomy, cost: 5, shadow: false },
        Check { key: &tenant, limiter: &tight, cost: 5, shadow: false },
    ];
    assert!(decided(store, &checks).await.iter().all(|d| d.allowed), "both scopes have room");
    let second = decided(store, &checks).await;
    assert!(second[0].allowed && !second[1].allowed, "the tenant's scope is empty: {second:?}");
    assert!(second[1].retry_after > Nanos::ZERO, "a refusal says how long to wait: {second:?}");
    assert_eq!(remaining(store, &caller, &roomy).await, 95, "the refused call charged the caller");
    assert_eq!(remaining(store, &tenant, &tight).await, 0);
}

/// A later check on a key sees what an earlier check of the same call would charge.
pub async fn two_checks_on_one_key_see_each_other(store: &Arc<dyn Store>, prefix: &str) {
    let limiter = bucket(10);
    let key = format!("{prefix}same");
    let checks = [
        Check { key: &key, limiter: &limiter, cost: 6, shadow: false },
        Check { key: &key, limiter: &limiter, cost: 6, shadow: false },
    ];
    let decisions = decided(store, &checks).await;
    assert!(decisions[0].allowed && !decisions[1].allowed, "6 + 6 is over 10: {decisions:?}");
    assert_eq!(remaining(store, &key, &limiter).await, 10, "nothing charged when the second refused");
}

/// A shadow check is decided and reported, but its refusal stops nothing and charges it nothing.
pub async fn a_refused_shadow_check_stops_nothing_and_is_not_charged(store: &Arc<dyn Store>, prefix: &str) {
    let (enforced, shadow) = (bucket(10), bucket(2));
    let (key, watched) = (format!("{prefix}shadow:enforced"), format!("{prefix}shadow:watched"));
    decided(store, &[Check { key: &watched, limiter: &shadow, cost: 1, shadow: false }]).await;
    let checks = [
        Check { key: &key, limiter: &enforced, cost: 2, shadow: false },
        Check { key: &watched, limiter: &shadow, cost: 2, shadow: true },
    ];
    let decisions = decided(store, &checks).await;
    assert!(decisions[0].allowed && !decisions[1].allowed, "{decisions:?}");
    assert_eq!(remaining(store, &key, &enforced).await, 8, "the enforced scope was charged");
    assert_eq!(remaining(store, &watched, &shadow).await, 1, "the refused shadow scope was not charged");
}

/// In-flight slots are held under a lease and come back when given back.
pub async fn slots_given_back_admit_again(store: &Arc<dyn Store>, prefix: &str) {
    let slots = Limiter::Concurrency(Concurrency::new(2));
    let key = format!("{prefix}slots");
    let lease = Lease::new();
    let take = |cost| [Check { key: &key, limiter: &slots, cost, shadow: false }];
    match store.decide(&take(2), &[], lease).await {
        Ok(Verdict::Decided(d)) => assert!(d[0].allowed, "two free slots: {d:?}"),
        other => panic!("{other:?}"),
    }
    assert!(!decided(store, &take(1)).await[0].allowed, "both slots are held");
    store.clone().release(&key, &slots, 2, lease);
    // A shared store gives slots back in a task of its own: wait for it, a bounded while.
    for _ in 0..200 {
        if remaining(store, &key, &slots).await == 2 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("slots given back under their lease were not free again within 2 s");
}

/// An operator's block stops a call naming it, says how long it holds, and lifts.
pub async fn a_block_stops_calls_until_lifted(store: &Arc<dyn Store>, prefix: &str) {
    let limiter = bucket(10);
    let (key, block) = (format!("{prefix}blocked:budget"), format!("{prefix}blocked:block"));
    let check = [Check { key: &key, limiter: &limiter, cost: 1, shadow: false }];
    store.block(&block, Duration::from_secs(60)).await.expect("sets a block");
    match store.decide(&check, &[&block], Lease::new()).await {
        Ok(Verdict::Blocked { index: 0, left }) => {
            assert!(
                left > Nanos::ZERO && left <= Nanos::from_secs(60),
                "the block holds for at most its minute: {left:?}"
            )
        }
        other => panic!("a block in force must stop the call: {other:?}"),
    }
    assert_eq!(remaining(store, &key, &limiter).await, 10, "a blocked call is charged nothing");
    let left = store.block_left(&block).await.expect("reads a block");
    assert!(left.is_some_and(|left| left <= Nanos::from_secs(60)), "{left:?}");
    assert!(store.unblock(&block).await.expect("lifts"), "the block was in force");
    assert!(!store.unblock(&block).await.expect("lifts"), "and is no longer");
    assert_eq!(store.block_left(&block).await.expect("reads"), None);
    match store.decide(&check, &[&block], Lease::new()).await {
        Ok(Verdict::Decided(d)) => assert!(d[0].allowed, "{d:?}"),
        other => panic!("a lifted block stops nothing: {other:?}"),
    }
}

/// A refund never fills a bucket past its capacity; a charge never takes it below empty.
pub async fn adjustments_stay_within_the_bucket(store: &Arc<dyn Store>, prefix: &str) {
    let limiter = bucket(10);
    let key = format!("{prefix}adjust");
    decided(store, &[Check { key: &key, limiter: &limiter, cost: 4, shadow: false }]).await;
    let after = store.adjust(&[(&key, &limiter, Adjustment::Refund(100))], None).await.expect("adjusts");
    assert_eq!(after.len(), 1, "one level per budget");
    assert_eq!(remaining(store, &key, &limiter).await, 10, "a refund stops at the capacity");
    store.adjust(&[(&key, &limiter, Adjustment::Charge(25))], None).await.expect("adjusts");
    assert_eq!(remaining(store, &key, &limiter).await, 0, "a charge stops at empty");
}

/// A forgotten budget is full again, and the store says how many it forgot.
pub async fn forgotten_budgets_are_full(store: &Arc<dyn Store>, prefix: &str) {
    let limiter = bucket(10);
    let (key, never) = (format!("{prefix}forget"), format!("{prefix}forget:never"));
    decided(store, &[Check { key: &key, limiter: &limiter, cost: 7, shadow: false }]).await;
    let forgot = store.forget(&[&key, &never]).await.expect("forgets");
    assert_eq!(forgot, 1, "one of the two keys had state");
    assert_eq!(remaining(store, &key, &limiter).await, 10);
}

/// A counter reads what the last bump left (always 0 on a store nobody else shares).
pub async fn counters_read_what_was_bumped(store: &Arc<dyn Store>, prefix: &str) {
    let key = format!("{prefix}news");
    let first = store.bump(&key).await.expect("bumps");
    let second = store.bump(&key).await.expect("bumps");
    let read = store.counter(&key).await.expect("reads");
    if store.is_shared() {
        assert_eq!(second, first.saturating_add(1), "each bump adds one");
        assert_eq!(read, second, "the counter is what the last bump left");
    } else {
        assert_eq!((first, second, read), (0, 0, 0), "nobody to tell");
    }
}

/// A thousand units spent one call after another (what a store that hands busy keys' budgets out
/// in slices does with them): every call admitted, a read between them counts every unit not yet
/// spent, and the call after the thousandth is refused.
async fn a_busy_budget_is_spent_to_the_last_unit_and_no_further(store: &Arc<dyn Store>, prefix: &str) {
    let key = format!("{prefix}busy");
    let limiter = bucket(1_000);
    let call = Check { key: &key, limiter: &limiter, cost: 1, shadow: false };
    for n in 1..=1_000u64 {
        assert!(decided(store, &[call]).await[0].allowed, "call {n} of a thousand is admitted");
        if n % 250 == 0 {
            assert_eq!(remaining(store, &key, &limiter).await, 1_000 - n, "after {n} calls");
        }
    }
    let refused = decided(store, &[call]).await[0];
    assert!(!refused.allowed && refused.remaining == 0, "the 1001st call is refused: {refused:?}");
}
