//! In-memory limiter state: a sharded map of key fingerprint → state.
//!
//! Keys are reduced to a 128-bit fingerprint (xxh3 with a per-process random seed; the chance
//! that two of a million live keys collide is about 1 in 10^26), so an entry is a fixed
//! 48 bytes with no heap allocation for the key. The fingerprint's high half picks one of 64
//! shards, each behind its own mutex, and its low half is the shard's hash, so callers on
//! different keys rarely contend and nothing is hashed twice.
//!
//! A single-scope decision updates the entry in place. A multi-scope decision locks the shards
//! it touches in index order (no deadlock), decides every scope on a copy, and writes back only
//! if all admitted. Entries remember when they become indistinguishable from a fresh key;
//! [`MemoryStore::sweep_at`] drops those and gives memory back, so memory is bounded by the
//! callers active within one refill time.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use xxhash_rust::xxh3::xxh3_128_with_seed;

use std::time::Duration;

use crate::clock::{Nanos, SharedClock, SystemClock};
use crate::limit::{Adjustment, Decision, Limiter, LimiterState};
use crate::store::{Blocks, Broadcast, Budgets, Check, Lease, Slots, Store, StoreFuture, Verdict, ready};

const SHARDS: usize = 64;

/// A key, reduced to 128 well-mixed bits.
type Fingerprint = u128;

#[derive(Debug, Clone)]
struct Entry {
    state: LimiterState,
    forget_at: Nanos,
}

/// Fingerprints are already uniformly mixed: use their low 64 bits as the hash.
#[derive(Debug, Default)]
struct FingerprintHasher(u64);

impl Hasher for FingerprintHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only reached for non-u128 keys, which this map never has; mix anyway.
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u128(&mut self, fp: u128) {
        self.0 = fp as u64;
    }
}

type Shard = HashMap<Fingerprint, Entry, BuildHasherDefault<FingerprintHasher>>;

/// A sharded in-memory store, on the server's clock as a [`Store`]; its inherent methods take the
/// instant explicitly (`decide_at`, `adjust_at`…), for tests and benchmarks that walk time.
pub struct MemoryStore {
    clock: SharedClock,
    shards: Box<[Mutex<Shard>]>,
    seed: u64,
    /// Operator blocks: key → until when. Rare, so a plain map; `blocking` counts its entries so
    /// the hot path skips the lock while there are none.
    blocks: Mutex<HashMap<String, Nanos>>,
    blocking: AtomicUsize,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore").field("keys", &self.len()).finish_non_exhaustive()
    }
}

fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // A panic while holding the lock cannot leave a half-written entry (entries are replaced
    // whole), so a poisoned shard is still consistent.
    shard.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl MemoryStore {
    /// An empty store on the system clock.
    pub fn new() -> Self {
        Self::on(SystemClock::shared())
    }

    /// An empty store whose decisions as a [`Store`] take their time from `clock`.
    pub fn on(clock: SharedClock) -> Self {
        Self {
            clock,
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            seed: rand::random(),
            blocks: Mutex::new(HashMap::new()),
            blocking: AtomicUsize::new(0),
        }
    }

    fn fingerprint(&self, key: &str) -> Fingerprint {
        xxh3_128_with_seed(key.as_bytes(), self.seed)
    }

    fn shard_of(fp: Fingerprint) -> usize {
        ((fp >> 64) as usize) % SHARDS
    }

    /// What `check` would be decided at `now`, deciding nothing: the key's state is read, not
    /// changed (the line judges jobs by it before it takes their slots).
    pub fn peek_at(&self, check: &Check<'_>, now: Nanos) -> Decision {
        let fp = self.fingerprint(check.key);
        let map = lock(&self.shards[Self::shard_of(fp)]);
        let mut state = map.get(&fp).map_or_else(|| check.limiter.fresh(now), |entry| entry.state.clone());
        check.limiter.acquire(&mut state, now, check.cost)
    }

    /// The in-flight slots held on `key` at `now`, whatever its cap.
    pub fn slots_in_use_at(&self, key: &str, now: Nanos) -> u64 {
        let unbounded = Limiter::Concurrency(crate::limit::Concurrency::new(u64::MAX));
        let check = Check { key, limiter: &unbounded, cost: 0, shadow: false };
        u64::MAX - self.peek_at(&check, now).remaining
    }

    /// The clock its decisions as a [`Store`] take their time from.
    pub fn clock(&self) -> &SharedClock {
        &self.clock
    }

    /// Decides all checks at once at `now`; see [`Budgets::decide`].
    pub fn decide_at(&self, checks: &[Check<'_>], now: Nanos) -> Vec<Decision> {
        match checks {
            [check] => vec![self.decide_one(check, now)],
            _ => self.decide_many(checks, now),
        }
    }

    /// The hot path: one scope, decided and charged in place under one shard lock.
    pub fn decide_one(&self, check: &Check<'_>, now: Nanos) -> Decision {
        let fp = self.fingerprint(check.key);
        let mut map = lock(&self.shards[Self::shard_of(fp)]);
        if let Some(entry) = map.get_mut(&fp) {
            let decision = check.limiter.acquire(&mut entry.state, now, check.cost);
            entry.forget_at = check.limiter.forget_at(&mut entry.state, now);
            return decision;
        }
        let mut state = check.limiter.fresh(now);
        let decision = check.limiter.acquire(&mut state, now, check.cost);
        if decision.allowed && check.cost > 0 {
            let forget_at = check.limiter.forget_at(&mut state, now);
            map.insert(fp, Entry { state, forget_at });
        }
        decision
    }

    fn decide_many(&self, checks: &[Check<'_>], now: Nanos) -> Vec<Decision> {
        let fps: Vec<Fingerprint> = checks.iter().map(|c| self.fingerprint(c.key)).collect();
        let mut order: Vec<usize> = fps.iter().map(|&fp| Self::shard_of(fp)).collect();
        order.sort_unstable();
        order.dedup();
        let mut guards: Vec<(usize, MutexGuard<'_, Shard>)> =
            order.iter().map(|&i| (i, lock(&self.shards[i]))).collect();

        // Decide every scope on a copy of its state; two scopes of one call may share a key,
        // so a later check sees what an earlier one would write.
        let mut staged: Vec<(Fingerprint, LimiterState)> = Vec::with_capacity(checks.len());
        let mut decisions = Vec::with_capacity(checks.len());
        for (check, &fp) in checks.iter().zip(&fps) {
            let mut state = match staged.iter().rev().find(|(f, _)| *f == fp) {
                Some((_, s)) => s.clone(),
                None => guards
                    .iter()
                    .find(|(i, _)| *i == Self::shard_of(fp))
                    .and_then(|(_, map)| map.get(&fp))
                    .map_or_else(|| check.limiter.fresh(now), |e| e.state.clone()),
            };
            decisions.push(check.limiter.acquire(&mut state, now, check.cost));
            staged.push((fp, state));
        }

        // A shadow limit's refusal does not stop the call (its own state is unchanged: a refusal
        // never charges).
        let all_allowed = decisions.iter().zip(checks).all(|(d, c): (&Decision, _)| d.allowed || c.shadow);
        if all_allowed && checks.iter().any(|c| c.cost > 0) {
            for ((fp, mut state), check) in staged.into_iter().zip(checks) {
                let forget_at = check.limiter.forget_at(&mut state, now);
                if let Some((_, map)) = guards.iter_mut().find(|(i, _)| *i == Self::shard_of(fp)) {
                    map.insert(fp, Entry { state, forget_at });
                }
            }
        }
        decisions
    }

    /// Gives back in-flight slots at `now`; see [`Slots::release`].
    pub fn release_at(&self, key: &str, limiter: &Limiter, cost: u64, now: Nanos) {
        let fp = self.fingerprint(key);
        let mut map = lock(&self.shards[Self::shard_of(fp)]);
        if let Some(entry) = map.get_mut(&fp) {
            limiter.release(&mut entry.state, cost);
            // An idle entry stays for the next acquire (removing and re-inserting it on every
            // call costs a quarter of a slot round trip); the sweep drops it if none comes.
            entry.forget_at = limiter.forget_at(&mut entry.state, now);
        }
    }

    /// Adjusts each budget under its key at `now` as its [`Adjustment`] says (see
    /// [`Budgets::adjust`]) and returns its level after it. A key never seen is full: a refund
    /// leaves it so, a charge starts from there.
    pub fn adjust_at(&self, budgets: &[(&str, &Limiter, Adjustment)], now: Nanos) -> Vec<Decision> {
        budgets
            .iter()
            .map(|&(key, limiter, by)| {
                let fp = self.fingerprint(key);
                let mut map = lock(&self.shards[Self::shard_of(fp)]);
                let entry = match (map.get_mut(&fp), by) {
                    (Some(entry), _) => entry,
                    (None, Adjustment::Refund(_) | Adjustment::Return { .. }) => {
                        return limiter.acquire(&mut limiter.fresh(now), now, 0);
                    }
                    (None, Adjustment::Charge(_)) => {
                        map.entry(fp).or_insert(Entry { state: limiter.fresh(now), forget_at: now })
                    }
                };
                limiter.adjust(&mut entry.state, now, by);
                entry.forget_at = limiter.forget_at(&mut entry.state, now);
                limiter.acquire(&mut entry.state.clone(), now, 0)
            })
            .collect()
    }

    /// Forgets the state under each of `keys` (the next call finds a fresh budget); returns how
    /// many were there.
    pub fn forget_keys(&self, keys: &[&str]) -> u64 {
        keys.iter()
            .filter(|key| {
                let fp = self.fingerprint(key);
                lock(&self.shards[Self::shard_of(fp)]).remove(&fp).is_some()
            })
            .count() as u64
    }

    fn blocks(&self) -> MutexGuard<'_, HashMap<String, Nanos>> {
        self.blocks.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Sets the operator block `key` until `until`.
    pub fn block_until(&self, key: &str, until: Nanos) {
        let mut blocks = self.blocks();
        blocks.insert(key.to_owned(), until);
        self.blocking.store(blocks.len(), Ordering::Relaxed);
    }

    /// Lifts the block `key`; whether there was one in force at `now`.
    pub fn unblock_at(&self, key: &str, now: Nanos) -> bool {
        let mut blocks = self.blocks();
        let lifted = blocks.remove(key).is_some_and(|until| until > now);
        self.blocking.store(blocks.len(), Ordering::Relaxed);
        lifted
    }

    /// The first of `keys` blocked at `now`, with the time its block has left.
    pub fn blocked(&self, keys: &[&str], now: Nanos) -> Option<(usize, Nanos)> {
        if keys.is_empty() || self.blocking.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let blocks = self.blocks();
        keys.iter().enumerate().find_map(|(i, key)| {
            let until = *blocks.get(*key)?;
            (until > now).then(|| (i, until - now))
        })
    }

    /// Drops every entry that has gone back to its fresh state by `now`, and returns the
    /// memory of shards that shrank a lot.
    pub fn sweep_at(&self, now: Nanos) -> usize {
        let blocks = {
            let mut blocks = self.blocks();
            let before = blocks.len();
            blocks.retain(|_, until| *until > now);
            self.blocking.store(blocks.len(), Ordering::Relaxed);
            before - blocks.len()
        };
        blocks
            + self
                .shards
                .iter()
                .map(|shard| {
                    let mut map = lock(shard);
                    let before = map.len();
                    map.retain(|_, e| e.forget_at > now);
                    if map.capacity() > 64 && map.len() < map.capacity() / 4 {
                        map.shrink_to_fit();
                    }
                    before - map.len()
                })
                .sum::<usize>()
    }

    /// Keys currently held.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).len()).sum()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Budgets for MemoryStore {
    fn decide<'a>(&'a self, checks: &'a [Check<'a>], blocks: &'a [&'a str], _lease: Lease) -> StoreFuture<'a, Verdict> {
        let now = self.clock.now();
        ready(Ok(match self.blocked(blocks, now) {
            Some((index, left)) => Verdict::Blocked { index, left },
            None => Verdict::Decided(self.decide_at(checks, now)),
        }))
    }

    fn adjust<'a>(
        &'a self,
        budgets: &'a [(&'a str, &'a Limiter, Adjustment)],
        _once: Option<&'a str>,
    ) -> StoreFuture<'a, Vec<Decision>> {
        // Always applied and always answered: never sent twice, so no mark to keep.
        ready(Ok(self.adjust_at(budgets, self.clock.now())))
    }

    fn forget<'a>(&'a self, keys: &'a [&'a str]) -> StoreFuture<'a, u64> {
        ready(Ok(self.forget_keys(keys)))
    }
}

impl Slots for MemoryStore {
    fn release(self: std::sync::Arc<Self>, key: &str, limiter: &Limiter, cost: u64, _lease: Lease) {
        self.release_at(key, limiter, cost, self.clock.now());
    }
}

impl Blocks for MemoryStore {
    fn block<'a>(&'a self, key: &'a str, duration: Duration) -> StoreFuture<'a, ()> {
        self.block_until(key, self.clock.now() + Nanos::from(duration));
        ready(Ok(()))
    }

    fn unblock<'a>(&'a self, key: &'a str) -> StoreFuture<'a, bool> {
        ready(Ok(self.unblock_at(key, self.clock.now())))
    }

    fn block_left<'a>(&'a self, key: &'a str) -> StoreFuture<'a, Option<Nanos>> {
        ready(Ok(self.blocked(&[key], self.clock.now()).map(|(_, left)| left)))
    }
}

impl Broadcast for MemoryStore {}

impl Store for MemoryStore {
    fn is_shared(&self) -> bool {
        false
    }

    fn sweep(&self) -> usize {
        self.sweep_at(self.clock.now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::{Concurrency, TokenBucket};

    const SEC: Nanos = Nanos::from_secs(1);

    /// The suite every backend must pass ([`crate::store::suite`]).
    #[tokio::test]
    async fn passes_the_backend_suite() {
        let store: std::sync::Arc<dyn Store> = std::sync::Arc::new(MemoryStore::new());
        crate::store::suite::run(store, "{suite}").await;
    }

    #[test]
    fn entries_stay_small() {
        assert!(std::mem::size_of::<(Fingerprint, Entry)>() <= 48, "{}", std::mem::size_of::<(Fingerprint, Entry)>());
    }

    #[test]
    fn sweep_forgets_only_full_buckets() {
        let store = MemoryStore::new();
        let l = Limiter::TokenBucket(TokenBucket::new(10, 1.0));
        store.decide_at(&[Check { key: "a", limiter: &l, cost: 1, shadow: false }], Nanos::ZERO);
        store.decide_at(&[Check { key: "b", limiter: &l, cost: 10, shadow: false }], Nanos::ZERO);
        assert_eq!(store.sweep_at(SEC), 1);
        assert_eq!(store.len(), 1);
        assert_eq!(store.sweep_at(10 * SEC), 1);
        assert!(store.is_empty());
    }

    #[test]
    fn released_slots_are_swept_once_idle() {
        let store = MemoryStore::new();
        let l = Limiter::Concurrency(Concurrency::new(2));
        assert!(store.decide_at(&[Check { key: "c", limiter: &l, cost: 2, shadow: false }], Nanos::ZERO)[0].allowed);
        assert!(!store.decide_at(&[Check { key: "c", limiter: &l, cost: 1, shadow: false }], Nanos::ZERO)[0].allowed);
        assert_eq!(store.sweep_at(Nanos::new(u64::MAX - 1)), 0, "held slots are never swept");
        store.release_at("c", &l, 2, Nanos::ZERO);
        assert_eq!(store.sweep_at(Nanos::ZERO), 1, "an idle slot entry is swept");
        assert!(store.is_empty());
    }
}
