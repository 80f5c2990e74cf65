//! Where limiter state lives.
//!
//! A [`Store`] takes the [`Check`]s of one call — one per scope it must pass — and decides them
//! **atomically**: either every scope admits the call and all are charged, or none is. The
//! algorithms live in [`crate::limit`]; a store only keeps their state, keyed by scope: in this
//! process's memory ([`MemoryStore`]), or in Redis, shared by every instance (`RedisStore`),
//! where each algorithm has a Lua twin and one call is one script.
//!
//! A store shared by several instances also keeps what they must agree on beside the budgets,
//! each behind a trait of its own, so the guard and the upstream name no concrete store: a
//! caller's recent calls ([`LoopHistory`], for loop detection), the published job book
//! ([`JobMirror`]), the upstream account's learnt concurrency limit ([`SharedLearner`]) and the
//! one line every instance's waiting jobs stand in ([`SharedLine`]). A third backend implements
//! these traits and nothing above changes.

pub mod line;
pub mod line_suite;
pub mod memory;
pub mod shared_memory;
pub mod suite;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::clock::Nanos;
use crate::limit::adaptive::{Learner, Signal};
use crate::limit::{Adjustment, Decision, Limiter};
pub use line::{JoinAt, LINE_ALIVE, LINE_HEARTBEAT, LineAnswer, LineAt, LineClaim, LineEntry, LineWait, SharedLine};
pub use memory::MemoryStore;
pub use shared_memory::SharedMemory;

/// How long the mark of an adjustment sent with one ([`Budgets::adjust`]) lives: longer than the
/// settlement that sent it keeps trying (the guard's `settle`), so no retry of it can land twice.
pub const MARK_LIVES: Duration = Duration::from_secs(600);

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
    /// Decided: one decision per check, in order. Charges happened only if every enforced one
    /// is `allowed`.
    Decided(Vec<Decision>),
    /// The block at `index` among those asked about holds for `left` more.
    Blocked {
        /// Which block.
        index: usize,
        /// How long it still holds.
        left: crate::clock::Nanos,
    },
    /// The call repeats the caller's recent calls in a loop ([`LoopHistory`]): refused for
    /// `retry_after` before anything was decided or charged.
    Looping {
        /// How long until the call may be made again.
        retry_after: crate::clock::Nanos,
        /// The pattern it repeats.
        pattern: Pattern,
    },
}

/// A lease id: what an admission's in-flight slots are held under, so that they are given back
/// (and, on a shared store, renewed) by it and by nothing else. Below 2^52, so any backend can
/// keep it exactly (a Lua number holds it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Lease(u64);

impl Lease {
    /// A fresh, random lease id.
    pub fn new() -> Self {
        Self(rand::random::<u64>() & ((1 << 52) - 1))
    }

    /// The id as a number, as a backend stores it.
    pub fn id(self) -> u64 {
        self.0
    }

    /// The lease a backend stored as `id` (an id of 2^52 or more keeps only its low 52 bits).
    pub fn from_id(id: u64) -> Self {
        Self(id & ((1 << 52) - 1))
    }
}

impl Default for Lease {
    fn default() -> Self {
        Self::new()
    }
}

/// A store could not decide: unreachable, timed out, or it answered nonsense. The guard decides
/// what that means for the call (fail open to the insurance limiter, or closed). Every backend
/// answers with these; `store` names the backend ("Redis"), `address` where it is (never a
/// password).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The address given to connect cannot be used; the backend's message says which forms it
    /// takes (and never shows a password).
    #[error("{0}")]
    InvalidAddress(String),
    /// The store refused the connection, or it broke.
    #[error("cannot reach {store} at {address}: {reason}")]
    Unreachable {
        /// The backend.
        store: &'static str,
        /// `host:port` (never a password).
        address: String,
        /// What the connection reported, and what to look at.
        reason: String,
    },
    /// The store did not answer within its timeout.
    #[error(
        "{store} at {address} did not answer within {} ms: it may be down, paused or overloaded (the store timeout bounds every call)",
        timeout.as_millis()
    )]
    Timeout {
        /// The backend.
        store: &'static str,
        /// `host:port` (never a password).
        address: String,
        /// The bound that passed.
        timeout: Duration,
    },
    /// The store answered with an error, or with a reply it cannot read.
    #[error("{store} at {address} failed the call: {reason}")]
    Failed {
        /// The backend.
        store: &'static str,
        /// `host:port` (never a password).
        address: String,
        /// The error the store gave, or what was wrong with its reply.
        reason: String,
    },
    /// A store split over nodes refused a call whose keys live on different ones (Redis
    /// Cluster's CROSSSLOT): a caller of the store did not give the keys of one call one hash tag.
    #[error(
        "{store} at {address} refused a call whose keys live on different nodes: every key of one call must \
         carry the same hash tag, e.g. {{t:acme}}caller:x and {{t:acme}}tenant:acme"
    )]
    KeysApart {
        /// The backend.
        store: &'static str,
        /// The seed nodes' `host:port` (never a password).
        address: String,
    },
    /// A check the store cannot decide exactly; nothing was sent.
    #[error("{0}")]
    OutOfRange(String),
}

/// What a store's asynchronous operations return.
pub type StoreFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// An answer already known, as a [`StoreFuture`].
pub(crate) fn ready<'a, T: Send + 'a>(answer: Result<T, StoreError>) -> StoreFuture<'a, T> {
    Box::pin(std::future::ready(answer))
}

/// The budgets: every scope of a call decided at once, adjusted after the fact, forgotten.
///
/// A store owns time: a decision takes no `now` from its caller, because on a shared store only
/// the store's clock means the same thing to every instance.
pub trait Budgets: Send + Sync + std::fmt::Debug {
    /// Decides `checks` atomically, unless one of `blocks` (keys set by [`Blocks::block`]) holds —
    /// read in the same step, so a block costs a shared store no extra round trip. Any
    /// in-flight slots are taken under `lease`, the id a [`SlotGuard`] gives them back (and, on
    /// a shared store, renews them) by.
    fn decide<'a>(&'a self, checks: &'a [Check<'a>], blocks: &'a [&'a str], lease: Lease) -> StoreFuture<'a, Verdict>;

    /// Adjusts each budget a limiter keeps under its key after the fact, each as its
    /// [`Adjustment`] says, never beyond its capacity nor below empty: an operator's refund, or a
    /// call's price settled from what it used (a refund then goes back only to where the call
    /// was charged, [`Adjustment::Return`]). Returns each budget's level after it. On a store
    /// split over nodes the keys must share a hash tag, as one call's keys do.
    ///
    /// `once` is the key of a mark that makes the adjustment happen at most once while the mark
    /// lives ([`MARK_LIVES`]): sent again with the same mark — because the answer to the first
    /// was lost, and the first may have been applied — it changes nothing and only answers the
    /// levels. It must share the budgets' hash tag. A store that always answers whether it
    /// applied an adjustment (the memory store: it cannot fail) is never sent one twice, and may
    /// ignore it.
    fn adjust<'a>(
        &'a self,
        budgets: &'a [(&'a str, &'a Limiter, Adjustment)],
        once: Option<&'a str>,
    ) -> StoreFuture<'a, Vec<Decision>>;

    /// Forgets the budgets under `keys` (on a store split over nodes they must share a hash
    /// tag): the next call finds them full. Returns how many had state.
    fn forget<'a>(&'a self, keys: &'a [&'a str]) -> StoreFuture<'a, u64>;
}

/// In-flight slots, held under leases: given back when the work ends, renewed while it runs
/// where a slot could outlive its process.
pub trait Slots: Send + Sync {
    /// Gives back in-flight slots taken by an admitted [`Check`] on a concurrency limiter. Called
    /// from `Drop`, so it never waits (a shared store gives them back in a task of its own; a
    /// release that cannot reach it is tried again while the lease would hold, and the lease
    /// then runs out by itself).
    fn release(self: Arc<Self>, key: &str, limiter: &Limiter, cost: u64, lease: Lease);

    /// [`Slots::release`], and once the slots are free, says so on `channel` to every instance
    /// that hears it ([`Broadcast::hear`]); a store nobody shares has nobody to tell.
    fn release_telling(self: Arc<Self>, key: &str, limiter: &Limiter, cost: u64, lease: Lease, _channel: &str) {
        self.release(key, limiter, cost, lease);
    }

    /// Notes that this instance holds `units` slots on `key` (capped at `capacity`) under
    /// `lease`, to renew them until they are given back; nothing to do where slots cannot
    /// outlive their process.
    fn hold(&self, _key: &str, _lease: Lease, _units: u64, _capacity: u64) {}

    /// Renews every lease this instance still holds; how often: [`Slots::renew_every`].
    fn renew_leases(&self) -> StoreFuture<'_, ()> {
        ready(Ok(()))
    }

    /// How often leases must be renewed, or `None` for a store without leases.
    fn renew_every(&self) -> Option<Duration> {
        None
    }
}

/// Keys that hold for a while and can be lifted once: an operator's blocks (a key that stops
/// every call naming it until it runs out or is lifted), and the mark that lets a call answered
/// "input required" be resumed once (the guard's `resume`). `unblock` must say whether the
/// key was in force and lift it in one step: of two instances lifting it at once, one is told yes.
pub trait Blocks: Send + Sync {
    /// Sets the block `key` for `duration` (on a shared store, for every instance).
    fn block<'a>(&'a self, key: &'a str, duration: Duration) -> StoreFuture<'a, ()>;

    /// Lifts the block `key`; whether one was in force.
    fn unblock<'a>(&'a self, key: &'a str) -> StoreFuture<'a, bool>;

    /// How long the block `key` still holds, if it does.
    fn block_left<'a>(&'a self, key: &'a str) -> StoreFuture<'a, Option<Nanos>>;
}

/// News for every instance: counters any instance bumps and every instance reads (an
/// operator's change, heard by the others), and channels any instance says something on and
/// every instance hears at once (a slot freed). A store no other instance shares has nobody to
/// tell.
pub trait Broadcast: Send + Sync {
    /// Hears what any instance says on `channel` ([`SlotGuard::telling`]): the receiver's value
    /// counts the messages heard, and changes with each (and once more when the store has been
    /// out of reach, as messages may have been missed meanwhile). `None` where nobody else shares
    /// the store. Heard until every receiver is dropped.
    fn hear(self: Arc<Self>, _channel: &str) -> Option<tokio::sync::watch::Receiver<u64>> {
        None
    }

    /// Adds one to the counter `key` every instance can read; the count after it (0 where
    /// nobody else shares the store).
    fn bump<'a>(&'a self, _key: &'a str) -> StoreFuture<'a, u64> {
        ready(Ok(0))
    }

    /// The counter `key` as [`Broadcast::bump`] left it.
    fn counter<'a>(&'a self, _key: &'a str) -> StoreFuture<'a, u64> {
        ready(Ok(0))
    }
}

/// The state store behind every budget: [`Budgets`], [`Slots`], [`Blocks`] and [`Broadcast`],
/// and what a store shared by several instances keeps beside them.
///
/// A backend implements the four small traits and this one; everything above names only
/// `dyn Store`. The memory store's tests are the suite every backend must pass
/// (`crates/kernel/src/store/memory.rs`; `docs/forking.md` says how to run them on a third).
pub trait Store: Budgets + Slots + Blocks + Broadcast {
    /// Whether other instances share this store's state (and it can therefore fail).
    fn is_shared(&self) -> bool;

    /// Forgets every key whose state is back to "as if never seen"; returns how many went (a
    /// store whose keys expire by themselves has nothing to sweep).
    fn sweep(&self) -> usize {
        0
    }

    /// The keys whose budgets this instance holds slices of, and the units in them (a store that
    /// hands out none: none).
    fn slices_held(&self) -> (u64, u64) {
        (0, 0)
    }

    /// Round trips to a shared store since it connected, and the commands they carried (several
    /// calls made at one moment travel as one pipeline); a store in memory makes none.
    fn traffic(&self) -> (u64, u64) {
        (0, 0)
    }

    /// The units of `key`'s budget (under `limiter`) this instance holds in slices.
    fn slice_of(&self, _key: &str, _limiter: &crate::limit::Limiter) -> u64 {
        0
    }

    /// Gives back whatever budget this instance holds of a shared store's (its slices), before
    /// it stops: a store that holds none has nothing to give.
    fn give_back_held(&self) -> StoreFuture<'_, ()> {
        Box::pin(async { Ok(()) })
    }

    /// Where every instance keeps each caller's recent calls, if this store is shared.
    fn loop_history(self: Arc<Self>) -> Option<Arc<dyn LoopHistory>> {
        None
    }

    /// Where the job book is published for every instance, if this store is shared.
    fn job_mirror(self: Arc<Self>) -> Option<Arc<dyn JobMirror>> {
        None
    }

    /// Where the line every instance's waiting jobs stand in is kept, if this store is shared.
    fn shared_line(self: Arc<Self>) -> Option<Arc<dyn SharedLine>> {
        None
    }

    /// Where a learnt concurrency limit is kept for every instance, if this store is shared.
    fn shared_learner(self: Arc<Self>) -> Option<Arc<dyn SharedLearner>> {
        None
    }
}

impl dyn Store {
    /// [`Budgets::decide`] without blocks: the decisions, one per check.
    pub async fn decide_all(&self, checks: &[Check<'_>], lease: Lease) -> Result<Vec<Decision>, StoreError> {
        match self.decide(checks, &[], lease).await? {
            Verdict::Decided(decisions) => Ok(decisions),
            // Nothing was asked about: no block can hold, no loop was checked.
            Verdict::Blocked { .. } | Verdict::Looping { .. } => Ok(Vec::new()),
        }
    }
}

/// Which pattern made a loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pattern {
    /// The same call `repeats` times in a row.
    Repeated,
    /// Two calls in strict alternation.
    Oscillating,
    /// The same answer from one tool `no_progress` times in a row.
    NoProgress,
}

impl Pattern {
    /// Its number in a shared store's history (and a script's reply).
    pub fn code(self) -> u8 {
        match self {
            Pattern::Repeated => 0,
            Pattern::Oscillating => 1,
            Pattern::NoProgress => 2,
        }
    }

    /// The pattern numbered `code`; an unknown number reads as a repetition.
    pub fn from_code(code: i64) -> Self {
        match code {
            1 => Pattern::Oscillating,
            2 => Pattern::NoProgress,
            _ => Pattern::Repeated,
        }
    }
}

/// How a tool's answers to a caller stand after one more: how many in a row were the same, and
/// whether that stopped the tool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Streaked {
    /// Identical answers in a row, this one included (1: it changed).
    pub same: u32,
    /// Whether this answer completed `no_progress` of them: the tool's next call is refused, for
    /// this many nanoseconds.
    pub stopped_for: Option<Nanos>,
}

/// A call to check against its caller's recent calls ([`LoopHistory`]).
#[derive(Debug, Clone, Copy)]
pub struct LoopCall<'a> {
    /// The caller's history (on Redis, with the hash tag of the call's other keys).
    pub key: &'a str,
    /// The call: its tool and canonical arguments, hashed alike on every instance.
    pub signature: u128,
    /// Its tool's answers (the guard's `tool_signature`): a stop under it refuses the
    /// call whatever its arguments.
    pub tool_signature: u128,
    /// How long a call stays in the history, and a loop stays refused.
    pub window: Nanos,
    /// Identical calls in a row (or turns of an A/B alternation) that make a loop.
    pub repeats: u32,
}

/// An answer for the history to hear ([`LoopHistory::answered`]).
#[derive(Debug, Clone, Copy)]
pub struct LoopAnswered<'a> {
    /// The caller's history.
    pub key: &'a str,
    /// The call answered.
    pub signature: u128,
    /// Its tool's answers.
    pub tool_signature: u128,
    /// What the answer says (the guard's `answer_hash`), hashed alike on every
    /// instance.
    pub answer: u128,
    /// How long a call stays in the history, and a loop stays refused.
    pub window: Nanos,
    /// Identical calls in a row that make a loop (how many calls the history keeps).
    pub repeats: u32,
    /// Identical answers of the tool in a row that stop it (0: not counted).
    pub no_progress: u32,
}

/// Each caller's recent calls, kept where every instance sees them (the twin of
/// the guard's `LoopDetector`), so a stuck agent round-robined over instances is
/// stopped on its `repeats`th identical call. It is a store's own ([`Store::loop_history`]),
/// because a call is checked in the same step as its decision: loop detection costs no round
/// trip of its own.
pub trait LoopHistory: Send + Sync + std::fmt::Debug {
    /// Checks `call` against the history under `call.key` and, unless it is a loop, decides
    /// `checks` as [`Budgets::decide`] does, unless one of `blocks` holds: in one step. A loop is
    /// refused before anything is decided or charged ([`Verdict::Looping`]); a call that a block
    /// stops or a check refuses is not recorded (it does not count towards a loop).
    fn decide_after_loop_check<'a>(
        &'a self,
        call: LoopCall<'a>,
        checks: &'a [Check<'a>],
        blocks: &'a [&'a str],
        lease: Lease,
    ) -> StoreFuture<'a, Verdict>;

    /// Hears the answer a checked call got, as the guard's `LoopDetector::answered`
    /// does, in one step: the call's earlier runs stop counting if its answer changed, and the
    /// tool's answers are counted (and the tool stopped) under `no_progress`.
    fn answered<'a>(&'a self, answer: LoopAnswered<'a>) -> StoreFuture<'a, Streaked>;
}

/// The job book as every instance sees it: a versioned record per job and a few shared sets
/// (the jobs in flight, the cancel requests).
pub trait JobMirror: Send + Sync + std::fmt::Debug {
    /// Writes `value` as the record under `key` at `version`, kept `ttl`, unless the record there
    /// is final or newer; whether it was written.
    fn put_record<'a>(&'a self, key: &'a str, value: &'a str, version: u64, ttl: Duration) -> StoreFuture<'a, bool>;

    /// The record under `key`, if it is still there.
    fn get<'a>(&'a self, key: &'a str) -> StoreFuture<'a, Option<String>>;

    /// Adds `member` to the set at `key`, kept `ttl` past its latest addition.
    fn set_add<'a>(&'a self, key: &'a str, member: &'a str, ttl: Duration) -> StoreFuture<'a, ()>;

    /// The members of the set at `key` (none when it is gone).
    fn set_members<'a>(&'a self, key: &'a str) -> StoreFuture<'a, Vec<String>>;

    /// Removes `members` from the set at `key`.
    fn set_remove<'a>(&'a self, key: &'a str, members: &'a [String]) -> StoreFuture<'a, ()>;

    /// Announces `member` at `key` and says so on `channel`, in one step: every instance that
    /// [hears](Broadcast::hear) it reads [`JobMirror::announced`]. An announcement is kept `keep`
    /// (older ones are dropped as a new one comes, so the key holds at most `keep` of them).
    fn announce<'a>(&'a self, key: &'a str, member: &'a str, keep: Duration, channel: &'a str) -> StoreFuture<'a, ()>;

    /// What is announced at `key`, oldest first.
    fn announced<'a>(&'a self, key: &'a str) -> StoreFuture<'a, Vec<String>>;

    /// Takes `members` out of the announcements at `key` (their instance heard them).
    fn withdraw<'a>(&'a self, key: &'a str, members: &'a [String]) -> StoreFuture<'a, ()>;

    /// Sets `key` for `ttl` unless it is set: whether it was not (of two instances claiming it at
    /// once, one is told yes). A webhook's id, taken once by any instance.
    fn take_once<'a>(&'a self, key: &'a str, ttl: Duration) -> StoreFuture<'a, bool>;
}

/// A learnt concurrency limit in a shared store: where its state is kept, the in-flight slots it
/// limits, and how it learns.
#[derive(Debug, Clone, Copy)]
pub struct LearntAt<'a> {
    /// The learner's state (on Redis, with the hash tag of `in_flight_key`).
    pub key: &'a str,
    /// The concurrency key the slots it limits are claimed on: what is in use when it learns.
    pub in_flight_key: &'a str,
    /// How it learns.
    pub learner: &'a Learner,
    /// The static cap the in-flight checks it decides are sized for: each one's capacity is
    /// scaled by the learnt limit ÷ this (rounded down), so the account's cap becomes the learnt
    /// limit and a share of it shrinks alike.
    pub ceiling: u64,
}

/// What a shared learnt limit stands at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedLimit {
    /// The whole slots it hands out.
    pub current: u64,
    /// The store's clock when it was read (a slot claimed then was taken at this instant).
    pub at: Nanos,
}

/// The upstream account's learnt concurrency limit (the twin of
/// [`crate::limit::adaptive::Learner`]), kept where every instance learns and uses it: one value,
/// not one per instance. Every sample updates it atomically, and a slot is claimed against it in
/// the same step as the account's other checks, so no instance takes a slot under a limit
/// another has just cut.
pub trait SharedLearner: Send + Sync + std::fmt::Debug {
    /// Decides `checks` as [`Budgets::decide`] does (no blocks), with the capacity of each in-flight
    /// check scaled to the limit `at` holds, read in the same step; and what that limit is, with
    /// the store's clock (when the slots were taken).
    fn decide_under<'a>(
        &'a self,
        at: LearntAt<'a>,
        checks: &'a [Check<'a>],
        lease: Lease,
    ) -> StoreFuture<'a, (Vec<Decision>, SharedLimit)>;

    /// Teaches the limit `at` what a slot taken at `taken_at` (the store's clock, as
    /// [`SharedLearner::decide_under`] said) answered: `signal`, after `rtt` (the server's
    /// clock); what is in use besides it is counted on `at.in_flight_key`. The limit after it.
    fn learn<'a>(
        &'a self,
        at: LearntAt<'a>,
        signal: Signal,
        rtt: Nanos,
        taken_at: Nanos,
    ) -> StoreFuture<'a, SharedLimit>;

    /// The limit `at` holds now.
    fn learnt<'a>(&'a self, at: LearntAt<'a>) -> StoreFuture<'a, SharedLimit>;
}

/// In-flight slots held by an admitted call; dropping it gives them back.
///
/// The guard pipeline keeps one alive for as long as the work runs, so a slot comes back
/// however the work ends: success, error, cancellation or a dropped connection (the future
/// holding it is dropped).
#[derive(Debug)]
pub struct SlotGuard {
    store: Arc<dyn Store>,
    key: String,
    limiter: Limiter,
    cost: u64,
    lease: Lease,
    /// A channel its release is said on ([`SlotGuard::telling`]).
    tell: Option<String>,
}

impl SlotGuard {
    /// Takes ownership of slots already charged by [`Budgets::decide`] under `lease`; on a
    /// shared store they are renewed until this guard is dropped.
    pub fn new(store: Arc<dyn Store>, key: String, limiter: Limiter, cost: u64, lease: Lease) -> Self {
        store.hold(&key, lease, cost, limiter.capacity());
        Self { store, key, limiter, cost, lease, tell: None }
    }

    /// This guard, its release said on `channel` once the slots are free
    /// ([`Slots::release_telling`]): every instance waiting for one hears it at once.
    pub fn telling(mut self, channel: &str) -> Self {
        self.tell = Some(channel.to_owned());
        self
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        match &self.tell {
            Some(channel) => {
                self.store.clone().release_telling(&self.key, &self.limiter, self.cost, self.lease, channel)
            }
            None => self.store.clone().release(&self.key, &self.limiter, self.cost, self.lease),
        }
    }
}
