//! The limiting algorithms and the [`Decision`] they share.
//!
//! An algorithm is pure arithmetic: given the state a key had (or none), the time, and the
//! cost of a call, it says whether the call conforms and what the state becomes. Where that
//! state lives (a sharded map in memory, or Redis) is the [`crate::store`]'s business, so an
//! algorithm can be read, tested and swapped on its own.

pub mod token_bucket;

use crate::clock::Nanos;
pub use token_bucket::TokenBucket;

/// The answer a limiter gives for one call against one scope.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Whether the call conforms. When it does not, nothing was charged.
    pub allowed: bool,
    /// The most the scope can ever admit at once (its burst or window limit).
    pub limit: u64,
    /// Units the scope could still admit right now, after this call if it was allowed.
    pub remaining: u64,
    /// When refused: how long until a call of the same cost would be admitted. Zero when allowed.
    pub retry_after: Nanos,
    /// How long until the scope is back to its full limit if nothing else is charged.
    pub reset_after: Nanos,
}

/// The state one key keeps between decisions, whichever algorithm owns it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimiterState {
    /// See [`token_bucket::State`].
    TokenBucket(token_bucket::State),
}

/// A configured limiter: one algorithm with its parameters.
#[derive(Debug, Clone, PartialEq)]
pub enum Limiter {
    /// Lazy-refill token bucket with costs.
    TokenBucket(TokenBucket),
}

/// What a limiter makes of one call: the decision and the state to store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// The decision to report.
    pub decision: Decision,
    /// The state the key should hold afterwards (refreshed even when refused; never charged then).
    pub state: LimiterState,
    /// From this instant on the stored state is indistinguishable from no state at all, so the
    /// store may forget the key (sweep in memory, TTL in Redis).
    pub forget_at: Nanos,
}

impl Limiter {
    /// The name used in config and in `rate_limit_status`.
    pub fn algorithm(&self) -> &'static str {
        match self {
            Limiter::TokenBucket(_) => "token_bucket",
        }
    }

    /// The most this limiter can admit at once; a cost above it can never pass.
    pub fn capacity(&self) -> u64 {
        match self {
            Limiter::TokenBucket(b) => b.capacity(),
        }
    }

    /// Units returned per second on average (the sustained rate).
    pub fn refill_per_sec(&self) -> f64 {
        match self {
            Limiter::TokenBucket(b) => crate::clock::NANOS_PER_SEC as f64 / b.period() as f64,
        }
    }

    /// Decides a call of `cost` units at `now` against the key's previous state.
    ///
    /// A cost of zero never charges and is how a scope's level is read without spending it.
    pub fn check(&self, prev: Option<LimiterState>, now: Nanos, cost: u64) -> Outcome {
        match self {
            Limiter::TokenBucket(b) => {
                let prev = prev.map(|LimiterState::TokenBucket(s)| s);
                let (decision, state, forget_at) = b.check(prev, now, cost);
                Outcome { decision, state: LimiterState::TokenBucket(state), forget_at }
            }
        }
    }
}
