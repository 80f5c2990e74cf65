//! Where limiter state lives.
//!
//! A store takes the [`Check`]s of one call — one per scope it must pass — and decides them
//! **atomically**: either every scope admits the call and all are charged, or none is. The
//! algorithms live in [`crate::limit`]; a store only keeps their state, keyed by scope: in this
//! process's memory ([`memory`]), or in Redis, shared by every instance ([`redis`]), where each
//! algorithm has a Lua twin and one call is one script.

pub mod memory;
pub mod redis;

use std::sync::Arc;

use crate::clock::SharedClock;
use crate::limit::{Decision, Limiter};
pub use memory::MemoryStore;
pub use redis::RedisStore;

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

/// The shared store could not decide: unreachable, timed out, or it answered nonsense. The
/// guard decides what that means for the call (fail open to the insurance limiter, or closed).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Redis could not decide.
    #[error(transparent)]
    Redis(#[from] redis::StoreError),
    /// The store answered with fewer decisions than checks.
    #[error("the limiter store returned no decision")]
    NoDecision,
}

/// The state store behind every budget.
///
/// It owns time: a decision takes no `now` from its caller, because on a shared store only the
/// store's clock means the same thing to every instance.
#[derive(Debug)]
pub enum Store {
    /// Per-process state in a sharded map, swept when idle, on the server's clock.
    Memory {
        /// The map.
        map: MemoryStore,
        /// Its time.
        clock: SharedClock,
    },
    /// State in Redis, shared by every instance, on Redis's clock.
    Redis(Arc<RedisStore>),
}

impl Store {
    /// An in-memory store on `clock`.
    pub fn memory(clock: SharedClock) -> Self {
        Store::Memory { map: MemoryStore::new(), clock }
    }

    /// Decides `checks` atomically: one decision per check, in order. Charges happen only when
    /// every decision is `allowed`.
    pub async fn decide(&self, checks: &[Check<'_>]) -> Result<Vec<Decision>, StoreError> {
        match self {
            Store::Memory { map, clock } => Ok(map.decide(checks, clock.now())),
            Store::Redis(redis) => Ok(redis.decide(checks).await?),
        }
    }

    /// Decides a single check: the common case of a call with one scope.
    pub async fn decide_one(&self, check: &Check<'_>) -> Result<Decision, StoreError> {
        match self {
            Store::Memory { map, clock } => Ok(map.decide_one(check, clock.now())),
            Store::Redis(redis) => redis.decide(std::slice::from_ref(check)).await?.pop().ok_or(StoreError::NoDecision),
        }
    }

    /// Gives back in-flight slots taken by an admitted [`Check`] on a concurrency limiter. Called
    /// from `Drop`, so it never waits: the memory store releases in place, Redis in a task of its
    /// own (a release that cannot reach Redis is logged; the slot is lost until Redis forgets it).
    pub fn release(&self, key: &str, limiter: &Limiter, cost: u64) {
        match self {
            Store::Memory { map, clock } => map.release(key, limiter, cost, clock.now()),
            Store::Redis(redis) => {
                let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                    tracing::warn!("an in-flight slot was released outside the runtime and is lost");
                    return;
                };
                let (redis, key, limiter) = (redis.clone(), key.to_owned(), limiter.clone());
                runtime.spawn(async move {
                    if let Err(error) = redis.release(&key, &limiter, cost).await {
                        tracing::warn!(%error, "could not give an in-flight slot back to Redis");
                    }
                });
            }
        }
    }

    /// Whether other instances share this store's state (and it can therefore fail).
    pub fn is_shared(&self) -> bool {
        match self {
            Store::Memory { .. } => false,
            Store::Redis(_) => true,
        }
    }

    /// Forgets every key whose state is back to "as if never seen"; returns how many went.
    pub fn sweep(&self) -> usize {
        match self {
            Store::Memory { map, clock } => map.sweep(clock.now()),
            // Every Redis key carries a TTL from its `forget_at`: Redis forgets by itself.
            Store::Redis(_) => 0,
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
    key: String,
    limiter: Limiter,
    cost: u64,
}

impl SlotGuard {
    /// Takes ownership of slots already charged by [`Store::decide`].
    pub fn new(store: Arc<Store>, key: String, limiter: Limiter, cost: u64) -> Self {
        Self { store, key, limiter, cost }
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.store.release(&self.key, &self.limiter, self.cost);
    }
}
