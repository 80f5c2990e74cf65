//! Where limiter state lives.
//!
//! A store takes a set of [`Check`]s — one per scope a call must pass — and decides them
//! **atomically**: either every scope admits the call and all are charged, or none is. The
//! algorithms themselves live in [`crate::limit`]; a store only keeps their state.

pub mod memory;

use crate::clock::Nanos;
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

    /// Forgets every key whose state is back to "as if never seen"; returns how many went.
    pub fn sweep(&self, now: Nanos) -> usize {
        match self {
            Store::Memory(m) => m.sweep(now),
        }
    }
}
