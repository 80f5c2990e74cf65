//! A local memory of a shared store's refusals, so that a hot abuser does not cost a Redis round
//! trip per request.
//!
//! When the shared store refuses a scope, it says exactly when a call of that cost could pass.
//! Until then only time can make room — nothing gives rate budget back — so a call of at least
//! the same cost on that scope is refused here, with the time left, without asking the store.
//! It never admits anything: a call the memory does not cover goes to the store as before, and
//! in-flight slots (which another instance may free at any moment) are never remembered.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::clock::Nanos;
use crate::limit::Decision;
use crate::store::Check;

/// Scopes remembered at most; past it, new refusals are simply not remembered.
const MAX_ENTRIES: usize = 100_000;

#[derive(Debug, Clone, Copy)]
struct Refused {
    until: Nanos,
    full_at: Nanos,
    cost: u64,
    limit: u64,
    remaining: u64,
}

/// Refusals of the shared store still in force, by scope key.
#[derive(Debug, Default)]
pub(crate) struct RefusalMemory {
    refused: Mutex<HashMap<String, Refused>>,
}

impl RefusalMemory {
    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<String, Refused>> {
        self.refused.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The decisions for `scopes` at `now` if one of them is still refused for at least its cost:
    /// that scope refused with the time left, the others marked allowed (they were not asked and
    /// charge nothing). `None`: the store must decide.
    pub(crate) fn recall(&self, checks: &[Check<'_>], now: Nanos) -> Option<Vec<Decision>> {
        let entries = self.entries();
        let hit = checks.iter().position(|c| {
            !c.limiter.holds_slots()
                && !c.shadow
                && c.cost > 0
                && entries.get(c.key).is_some_and(|r| now < r.until && c.cost >= r.cost)
        })?;
        let refused = entries.get(checks[hit].key).copied()?;
        Some(
            checks
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    if i == hit {
                        Decision {
                            allowed: false,
                            limit: refused.limit,
                            remaining: refused.remaining,
                            retry_after: refused.until - now,
                            reset_after: refused.full_at - now,
                            at: now,
                        }
                    } else {
                        let limit = c.limiter.capacity();
                        Decision {
                            allowed: true,
                            limit,
                            remaining: 0,
                            retry_after: Nanos::ZERO,
                            reset_after: Nanos::ZERO,
                            at: now,
                        }
                    }
                })
                .collect(),
        )
    }

    /// Remembers what the store refused among `decisions` for `checks`, decided at `now`.
    pub(crate) fn remember(&self, checks: &[Check<'_>], decisions: &[Decision], now: Nanos) {
        let mut entries = self.entries();
        for (c, d) in checks.iter().zip(decisions) {
            if d.allowed || c.shadow || c.limiter.holds_slots() || c.cost == 0 || d.retry_after == Nanos::ZERO {
                continue;
            }
            if entries.len() >= MAX_ENTRIES && !entries.contains_key(c.key) {
                continue;
            }
            let refused = Refused {
                until: now + d.retry_after,
                full_at: now + d.reset_after,
                cost: c.cost,
                limit: d.limit,
                remaining: d.remaining,
            };
            entries.insert(c.key.to_owned(), refused);
        }
    }

    /// Forgets every refusal: the limits they were made under changed (a reload), or an operator
    /// gave budget back (a reset or refund through the admin API), which this memory's one
    /// assumption — only time makes room — no longer covers.
    pub(crate) fn clear(&self) {
        self.entries().clear();
    }

    /// Forgets the refusals of `keys`: budget came back to them other than by time (a call's price
    /// settled below what it reserved).
    pub(crate) fn forget<'k>(&self, keys: impl IntoIterator<Item = &'k str>) {
        let mut entries = self.entries();
        if entries.is_empty() {
            return;
        }
        for key in keys {
            entries.remove(key);
        }
    }

    /// Whether any refusal is remembered.
    pub(crate) fn is_empty(&self) -> bool {
        self.entries().is_empty()
    }

    /// Forgets refusals that have run out; returns how many went.
    pub(crate) fn sweep(&self, now: Nanos) -> usize {
        let mut entries = self.entries();
        let before = entries.len();
        entries.retain(|_, r| r.until > now);
        before - entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::{Concurrency, Limiter, TokenBucket};

    #[test]
    fn refuses_as_costly_calls_until_the_store_said_and_never_admits() {
        let memory = RefusalMemory::default();
        let bucket = Limiter::TokenBucket(TokenBucket::new(60, 1.0));
        let on = |key, limiter, cost| [Check { key, limiter, cost, shadow: false }];
        let refused = Decision {
            allowed: false,
            limit: 60,
            remaining: 2,
            retry_after: Nanos::new(3_000),
            reset_after: Nanos::new(58_000),
            at: Nanos::ZERO,
        };
        memory.remember(&on("k", &bucket, 5), &[refused], Nanos::new(1_000));
        assert!(
            memory.recall(&on("k", &bucket, 4), Nanos::new(1_000)).is_none(),
            "a cheaper call may pass: ask the store"
        );
        let again = memory.recall(&on("k", &bucket, 5), Nanos::new(2_000)).expect("refused locally");
        assert_eq!((again[0].allowed, again[0].retry_after), (false, Nanos::new(2_000)));
        assert!(memory.recall(&on("k", &bucket, 5), Nanos::new(4_000)).is_none(), "run out: ask the store");

        let slots = Limiter::Concurrency(Concurrency::new(1));
        memory.remember(&on("s", &slots, 1), &[refused], Nanos::ZERO);
        assert!(memory.recall(&on("s", &slots, 1), Nanos::ZERO).is_none(), "a slot may come back at any moment");
        assert_eq!(memory.sweep(Nanos::new(10_000)), 1);
    }
}
