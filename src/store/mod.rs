//! Where limiter state lives.
//!
//! A store takes the [`Check`]s of one call — one per scope it must pass — and decides them
//! **atomically**: either every scope admits the call and all are charged, or none is. The
//! algorithms live in [`crate::limit`]; a store only keeps their state, keyed by scope.

pub mod memory;
pub mod redis;

use std::sync::Arc;

use crate::clock::{Nanos, SharedClock};
use crate::limit::{Decision, Limiter};
pub use memory::MemoryStore;

/// One scope a call must pass: the key its state is kept under, its limiter and the cost.
#[derive(Debug, Clone, Copy)]
pub struct Check<'a> {
    /// The state key, e.g. `caller:tok:1f2e…`. Never a raw credential.
    pub key: &'a str,
    /// The algorithm and parameters of this scope.
    pub limiter: &'a Limiter,
    /// Units this call costs in this scope; zero only reads the level.
    pub cost: u64,
}

/// The state store behind every budget.
#[derive(Debug)]
pub enum Store {
    /// Per-process state in a sharded map, swept when idle.
    Memory(MemoryStore),
}

impl Store {
    /// Decides `checks` atomically at `now`: one decision per check, in order. Charges happen
    /// only when every decision is `allowed`.
    pub fn decide(&self, checks: &[Check<'_>], now: Nanos) -> Vec<Decision> {
        match self {
            Store::Memory(m) => m.decide(checks, now),
        }
    }

    /// Decides a single check without allocating: the common case of a call with one scope.
    pub fn decide_one(&self, check: &Check<'_>, now: Nanos) -> Decision {
        match self {
            Store::Memory(m) => m.decide_one(check, now),
        }
    }

    /// Gives back in-flight slots taken by an admitted [`Check`] on a concurrency limiter.
    pub fn release(&self, key: &str, limiter: &Limiter, cost: u64, now: Nanos) {
        match self {
            Store::Memory(m) => m.release(key, limiter, cost, now),
        }
    }

    /// Forgets every key whose state is back to "as if never seen"; returns how many went.
    pub fn sweep(&self, now: Nanos) -> usize {
        match self {
            Store::Memory(m) => m.sweep(now),
        }
    }
}

/// In-flight slots held by an admitted call; dropping it gives them back.
///
/// The guard pipeline keeps one alive for as long as the work runs, so a slot comes back
/// however the work ends: success, error, cancellation or a dropped connection (the future
/// holding it is dropped).
#[derive(Debug)]
pub struct SlotGuard {
    store: Arc<Store>,
    clock: SharedClock,
    key: String,
    limiter: Limiter,
    cost: u64,
}

impl SlotGuard {
    /// Takes ownership of slots already charged by [`Store::decide`].
    pub fn new(store: Arc<Store>, clock: SharedClock, key: String, limiter: Limiter, cost: u64) -> Self {
        Self { store, clock, key, limiter, cost }
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.store.release(&self.key, &self.limiter, self.cost, self.clock.now());
    }
}
