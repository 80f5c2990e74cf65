//! Where limiter state lives.
//!
//! A store takes the [`Check`]s of one call — one per scope it must pass — and decides them
//! **atomically**: either every scope admits the call and all are charged, or none is. The
//! algorithms live in [`crate::limit`]; a store only keeps their state, keyed by scope: in this
//! process's memory ([`memory`]), or in Redis, shared by every instance ([`redis`]), where each
//! algorithm has a Lua twin and one call is one script.

pub mod memory;
pub mod redis;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::clock::SharedClock;
use crate::limit::{Decision, Limiter};
pub use memory::MemoryStore;
pub use redis::{HeldLease, Lease, RedisStore, Renewed, new_lease};

/// One scope a call must pass: the key its state is kept under, its limiter and the cost.
#[derive(Debug, Clone, Copy)]
pub struct Check<'a> {
    /// The state key, e.g. `caller:tok:1f2e…`. Never a raw credential.
    pub key: &'a str,
    /// The algorithm and parameters of this scope.
    pub limiter: &'a Limiter,
    /// Units this call costs in this scope; zero only reads the level.
    pub cost: u64,
    /// A shadow limit: decided and reported like the others, but its refusal does not stop the
    /// call (the others are charged; a refused shadow limit itself is not).
    pub shadow: bool,
}

/// What a decision found: the decisions, one per check, or an operator's block that stopped it
/// before anything was decided or charged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Decided as [`Store::decide`] decides.
    Decided(Vec<Decision>),
    /// The block at `index` among those asked about holds for `left` more.
    Blocked {
        /// Which block.
        index: usize,
        /// How long it still holds.
        left: crate::clock::Nanos,
    },
}

/// The shared store could not decide: unreachable, timed out, or it answered nonsense. The
/// guard decides what that means for the call (fail open to the insurance limiter, or closed).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Redis could not decide.
    #[error(transparent)]
    Redis(#[from] redis::StoreError),
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
    Redis {
        /// The connection and scripts.
        redis: Arc<RedisStore>,
        /// The in-flight leases this instance holds (key, lease) → (units, the key's cap),
        /// renewed on a schedule by [`Store::renew_leases`] until given back.
        held: Mutex<Held>,
    },
}

impl Store {
    /// An in-memory store on `clock`.
    pub fn memory(clock: SharedClock) -> Self {
        Store::Memory { map: MemoryStore::new(), clock }
    }

    /// A store in `redis`, shared by every instance connected to it.
    pub fn redis(redis: RedisStore) -> Self {
        Store::Redis { redis: Arc::new(redis), held: Mutex::new(HashMap::new()) }
    }

    fn held(held: &Mutex<Held>) -> std::sync::MutexGuard<'_, Held> {
        held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Decides `checks` atomically: one decision per check, in order. Charges happen only when
    /// every decision is `allowed`; any in-flight slots are taken under `lease`, the id a
    /// [`SlotGuard`] gives them back (and, on Redis, renews them) by.
    pub async fn decide(&self, checks: &[Check<'_>], lease: Lease) -> Result<Vec<Decision>, StoreError> {
        match self {
            Store::Memory { map, clock } => Ok(map.decide(checks, clock.now())),
            Store::Redis { redis, .. } => Ok(redis.decide_leased(checks, lease, None).await?),
        }
    }

    /// [`Store::decide`], unless one of `blocks` (keys set by [`Store::block`]) holds: read in the
    /// same step, so a block costs a shared store no extra round trip.
    pub async fn decide_unless_blocked(
        &self,
        checks: &[Check<'_>],
        blocks: &[&str],
        lease: Lease,
    ) -> Result<Verdict, StoreError> {
        match self {
            Store::Memory { map, clock } => {
                let now = clock.now();
                Ok(match map.blocked(blocks, now) {
                    Some((index, left)) => Verdict::Blocked { index, left },
                    None => Verdict::Decided(map.decide(checks, now)),
                })
            }
            Store::Redis { redis, .. } => Ok(redis.decide_unless_blocked(checks, blocks, lease).await?),
        }
    }

    /// Gives `units` back to the budget `limiter` keeps under `key`, never beyond its capacity;
    /// returns its level after it.
    pub async fn refund(&self, key: &str, limiter: &Limiter, units: u64) -> Result<Decision, StoreError> {
        match self {
            Store::Memory { map, clock } => Ok(map.refund(key, limiter, units, clock.now())),
            Store::Redis { redis, .. } => Ok(redis.refund(key, limiter, units, None).await?),
        }
    }

    /// Forgets the budgets under `keys` (on Redis they must share a hash tag): the next call
    /// finds them full. Returns how many had state.
    pub async fn forget(&self, keys: &[&str]) -> Result<u64, StoreError> {
        match self {
            Store::Memory { map, .. } => Ok(map.forget(keys)),
            Store::Redis { redis, .. } => Ok(redis.forget(keys).await?),
        }
    }

    /// Sets the block `key` for `duration` (on Redis, for every instance).
    pub async fn block(&self, key: &str, duration: std::time::Duration) -> Result<(), StoreError> {
        match self {
            Store::Memory { map, clock } => {
                let nanos = u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
                map.block(key, clock.now().saturating_add(nanos));
                Ok(())
            }
            Store::Redis { redis, .. } => Ok(redis.block(key, duration).await?),
        }
    }

    /// Lifts the block `key`; whether one was in force.
    pub async fn unblock(&self, key: &str) -> Result<bool, StoreError> {
        match self {
            Store::Memory { map, clock } => Ok(map.unblock(key, clock.now())),
            Store::Redis { redis, .. } => Ok(redis.forget(&[key]).await? > 0),
        }
    }

    /// How long the block `key` still holds, if it does.
    pub async fn block_left(&self, key: &str) -> Result<Option<crate::clock::Nanos>, StoreError> {
        match self {
            Store::Memory { map, clock } => Ok(map.blocked(&[key], clock.now()).map(|(_, left)| left)),
            Store::Redis { redis, .. } => Ok(redis.block_left(key).await?),
        }
    }

    /// Notes that this instance holds `units` slots on `key` (capped at `capacity`) under
    /// `lease`, to renew them until they are given back (Redis only: memory slots cannot
    /// outlive their process).
    fn hold(&self, key: &str, lease: Lease, units: u64, capacity: u64) {
        if let Store::Redis { held, .. } = self {
            Self::held(held).insert((key.to_owned(), lease), (units, capacity));
        }
    }

    /// Gives back in-flight slots taken by an admitted [`Check`] on a concurrency limiter. Called
    /// from `Drop`, so it never waits: the memory store releases in place, Redis in a task of its
    /// own (a release that cannot reach Redis is logged; the lease then runs out by itself).
    pub fn release(&self, key: &str, limiter: &Limiter, cost: u64, lease: Lease) {
        match self {
            Store::Memory { map, clock } => map.release(key, limiter, cost, clock.now()),
            Store::Redis { redis, held } => {
                Self::held(held).remove(&(key.to_owned(), lease));
                let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                    tracing::warn!("in-flight slots were released outside the runtime: their lease will run out");
                    return;
                };
                let (redis, key) = (redis.clone(), key.to_owned());
                runtime.spawn(async move {
                    if let Err(error) = redis.release(&key, lease).await {
                        tracing::warn!(%error, "could not give in-flight slots back to Redis: their lease will run out");
                    }
                });
            }
        }
    }

    /// Renews every lease this instance still holds (Redis), in one round trip; how often to
    /// call it: [`Store::renew_every`]. A lease that expired and no longer fits under its cap
    /// (others took the slots while this instance could not reach Redis) is lost: it is no
    /// longer renewed, and the work holding it runs uncounted until it ends.
    pub async fn renew_leases(&self) -> Result<(), StoreError> {
        let Store::Redis { redis, held } = self else { return Ok(()) };
        let leases: Vec<(String, Lease, u64, u64)> =
            Self::held(held).iter().map(|((key, lease), (units, cap))| (key.clone(), *lease, *units, *cap)).collect();
        let borrowed: Vec<HeldLease<'_>> = leases
            .iter()
            .map(|(key, lease, units, capacity)| HeldLease { key, lease: *lease, units: *units, capacity: *capacity })
            .collect();
        let answers = redis.renew(&borrowed).await?;
        let count = |what: Renewed| answers.iter().filter(|a| **a == what).count();
        let (retaken, lost) = (count(Renewed::Retaken), count(Renewed::Lost));
        if retaken > 0 {
            tracing::warn!(
                retaken,
                "in-flight leases had expired (Redis unreachable for a whole lease) and were taken again"
            );
        }
        if lost > 0 {
            tracing::warn!(
                lost,
                "in-flight leases had expired and their caps are full (others took the slots meanwhile): no \
                 longer counted, their jobs run on uncounted until they end"
            );
        }
        let mut held = Self::held(held);
        for (lease, answer) in borrowed.iter().zip(&answers) {
            if matches!(answer, Renewed::Lost | Renewed::GivenBack) {
                held.remove(&(lease.key.to_owned(), lease.lease));
            }
        }
        Ok(())
    }

    /// How often leases must be renewed (a third of their duration), or `None` for a store
    /// without leases.
    pub fn renew_every(&self) -> Option<std::time::Duration> {
        match self {
            Store::Memory { .. } => None,
            Store::Redis { redis, .. } => Some(redis.lease() / 3),
        }
    }

    /// The Redis behind a shared store.
    pub fn redis_store(&self) -> Option<&Arc<RedisStore>> {
        match self {
            Store::Memory { .. } => None,
            Store::Redis { redis, .. } => Some(redis),
        }
    }

    /// Whether other instances share this store's state (and it can therefore fail).
    pub fn is_shared(&self) -> bool {
        match self {
            Store::Memory { .. } => false,
            Store::Redis { .. } => true,
        }
    }

    /// Forgets every key whose state is back to "as if never seen"; returns how many went.
    pub fn sweep(&self) -> usize {
        match self {
            Store::Memory { map, clock } => map.sweep(clock.now()),
            // Every Redis key carries a TTL from its `forget_at`: Redis forgets by itself.
            Store::Redis { .. } => 0,
        }
    }
}

/// The leases an instance holds: (key, lease) → (units, the key's cap).
type Held = HashMap<(String, Lease), (u64, u64)>;

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
    lease: Lease,
}

impl SlotGuard {
    /// Takes ownership of slots already charged by [`Store::decide`] under `lease`; on a
    /// shared store they are renewed until this guard is dropped.
    pub fn new(store: Arc<Store>, key: String, limiter: Limiter, cost: u64, lease: Lease) -> Self {
        store.hold(&key, lease, cost, limiter.capacity());
        Self { store, key, limiter, cost, lease }
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.store.release(&self.key, &self.limiter, self.cost, self.lease);
    }
}
