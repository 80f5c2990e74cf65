//! In-memory limiter state: a sharded map of key → state.
//!
//! Keys hash to one of a fixed number of shards, each behind its own mutex, so callers on
//! different keys rarely contend. A multi-scope decision locks the shards it touches in
//! index order (no deadlock), decides every scope, and writes back only if all admitted.
//! Entries remember when they become indistinguishable from a fresh key; [`MemoryStore::sweep`]
//! drops those, so memory is bounded by the callers active within one refill time.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Mutex, MutexGuard};

use crate::clock::Nanos;
use crate::limit::{Decision, LimiterState, Outcome};
use crate::store::Check;

const SHARDS: usize = 64;

#[derive(Debug, Clone, Copy)]
struct Entry {
    state: LimiterState,
    forget_at: Nanos,
}

type Shard = HashMap<Box<str>, Entry>;

/// A sharded in-memory store.
#[derive(Debug)]
pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // A panic while holding the lock cannot leave a half-written entry (entries are plain
    // copies), so a poisoned shard is still consistent.
    shard.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self { shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(), hasher: RandomState::new() }
    }

    fn shard_of(&self, key: &str) -> usize {
        (self.hasher.hash_one(key) as usize) % SHARDS
    }

    /// Decides all checks at once; see [`crate::store::Store::decide`].
    pub fn decide(&self, checks: &[Check<'_>], now: Nanos) -> Vec<Decision> {
        let shard_ids: Vec<usize> = checks.iter().map(|c| self.shard_of(c.key)).collect();
        let mut order = shard_ids.clone();
        order.sort_unstable();
        order.dedup();
        let mut guards: Vec<(usize, MutexGuard<'_, Shard>)> =
            order.iter().map(|&i| (i, lock(&self.shards[i]))).collect();

        // Decide every scope against the current state plus what earlier checks of this same
        // call would write (two scopes may share a key).
        let mut staged: Vec<(&str, usize, Outcome)> = Vec::with_capacity(checks.len());
        for (check, &shard) in checks.iter().zip(&shard_ids) {
            let prev = staged.iter().rev().find(|(k, _, _)| *k == check.key).map(|(_, _, o)| o.state).or_else(|| {
                let map = &guards.iter().find(|(i, _)| *i == shard)?.1;
                map.get(check.key).filter(|e| e.forget_at > now).map(|e| e.state)
            });
            staged.push((check.key, shard, check.limiter.check(prev, now, check.cost)));
        }

        let all_allowed = staged.iter().all(|(_, _, o)| o.decision.allowed);
        let charges = checks.iter().any(|c| c.cost > 0);
        if all_allowed && charges {
            for (key, shard, outcome) in &staged {
                if let Some((_, map)) = guards.iter_mut().find(|(i, _)| i == shard) {
                    let entry = Entry { state: outcome.state, forget_at: outcome.forget_at };
                    match map.get_mut(*key) {
                        Some(e) => *e = entry,
                        None => {
                            map.insert((*key).into(), entry);
                        }
                    }
                }
            }
        }
        staged.into_iter().map(|(_, _, o)| o.decision).collect()
    }

    /// Drops every entry that has gone back to its fresh state by `now`.
    pub fn sweep(&self, now: Nanos) -> usize {
        self.shards
            .iter()
            .map(|shard| {
                let mut map = lock(shard);
                let before = map.len();
                map.retain(|_, e| e.forget_at > now);
                before - map.len()
            })
            .sum()
    }

    /// Keys currently held (for tests and the memory report).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).len()).sum()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::{Limiter, TokenBucket};

    const SEC: Nanos = 1_000_000_000;

    #[test]
    fn refusal_in_a_later_scope_charges_no_earlier_scope() {
        let store = MemoryStore::new();
        let roomy = Limiter::TokenBucket(TokenBucket::new(100, 1.0));
        let tight = Limiter::TokenBucket(TokenBucket::new(5, 1.0));
        let checks =
            [Check { key: "caller:a", limiter: &roomy, cost: 5 }, Check { key: "tenant:t", limiter: &tight, cost: 5 }];
        assert!(store.decide(&checks, 0).iter().all(|d| d.allowed));
        let second = store.decide(&checks, 0);
        assert!(second[0].allowed && !second[1].allowed);
        let peek = store.decide(&[Check { key: "caller:a", limiter: &roomy, cost: 0 }], 0);
        assert_eq!(peek[0].remaining, 95, "the refused call must not have charged the caller");
    }

    #[test]
    fn sweep_forgets_only_full_buckets() {
        let store = MemoryStore::new();
        let l = Limiter::TokenBucket(TokenBucket::new(10, 1.0));
        store.decide(&[Check { key: "a", limiter: &l, cost: 1 }], 0);
        store.decide(&[Check { key: "b", limiter: &l, cost: 10 }], 0);
        assert_eq!(store.sweep(SEC), 1);
        assert_eq!(store.len(), 1);
        assert_eq!(store.sweep(10 * SEC), 1);
        assert!(store.is_empty());
    }

    #[test]
    fn many_threads_on_one_key_never_over_admit() {
        let store = std::sync::Arc::new(MemoryStore::new());
        let l = std::sync::Arc::new(Limiter::TokenBucket(TokenBucket::new(1000, 1.0)));
        let admitted: usize = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    let (store, l) = (store.clone(), l.clone());
                    s.spawn(move || {
                        (0..10_000)
                            .filter(|_| store.decide(&[Check { key: "hot", limiter: &l, cost: 1 }], 0)[0].allowed)
                            .count()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or(0)).sum()
        });
        assert_eq!(admitted, 1000);
    }
}
