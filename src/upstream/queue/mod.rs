//! The account's fair queue: one upstream account shared by many callers.
//!
//! The paid API limits the *account* — a number of predictions running at once, shared by every
//! token and connection — while our callers and tenants each have their own caps inside it.
//! Every job needs one of the account's slots (`upstream.max_in_flight`) to reach the upstream.
//! A job whose caller and tenant may start it, but for which the account has no free slot, waits
//! here instead of being refused (or meeting the upstream's 429). Jobs are of a class
//! ([`JobClass`]: image, video), which the queue reads as data: a class with a gap also waits
//! for its spacing (videos: `upstream.video_min_gap_ms`, one submission per gap across all
//! callers), and a class may be held to a number of places of its own.
//!
//! Who goes next is decided by **deficit round robin across flows** (a flow is a tenant, or a
//! caller without one): each flow with an eligible job earns its quantum (its tier's factor) per
//! round and spends one unit per job served, and jobs within a flow keep their order. A tenant
//! that queued fifty videos therefore delays another tenant's single video by one turn, not by
//! fifty, and over a long contended run every busy flow gets its share of the submissions.
//!
//! A place is reserved *before* the call is charged (a full queue is refused `busy` with the
//! wait, and nothing is charged), and turned into a waiting job or — when a slot is free and
//! nobody is waiting for one — into a slot at once. One dispatcher task hands out slots; a
//! [`AccountSlot`] goes back (and wakes the dispatcher) when dropped. A job that must retry gives
//! its slot back and returns to the *front* of its flow with a `not_before`, so it keeps its
//! place and the backoff applies. Every wait is on the shared [`Clock`](crate::clock::Clock).
//!
//! Over a shared store (Redis) the account's cap and each class's spacing hold across instances:
//! before a job leaves, the dispatcher claims an account slot in the store (a lease on a
//! `concurrency` scope of `max_in_flight`, renewed while the job runs, like any in-flight slot)
//! and, for a job of a class with a gap, the gap (a GCRA of burst 1, one per gap, on Redis's clock)
//! — both in one all-or-nothing decision. An instance that finds the account full or the gap taken
//! puts the job back at the front of its flow and tries again when the store says (the gap) or
//! after a second (a slot another instance holds). The round robin itself is per instance.
//!
//! With an adaptive limit ([`FairQueue::adaptive`]) over a shared store, the learnt limit is one
//! value in the store too, beside the account's cap under the same hash tag: the claim is decided
//! under it in the same step (the account's cap and the unverified share scaled to it), and every
//! answer is learnt into it, so every instance hands out slots up to the one limit they all learn.
//! While the store cannot answer, the queue limits locally, under its own learner, and asks the
//! store again a second later; every failure is logged and counted
//! (`mcp_ratelimit_store_errors_total{layer="account"}`).
//!
//! **Unverified callers** (no configured key, or a made-up one) prove nothing about who they
//! are, so all of them together may hold only `upstream.unverified_share` of the account's slots
//! and of the queue's places ([`QueueRules::unverified_slots`], [`QueueRules::unverified_places`]):
//! however many keys a script invents, configured tenants always find room. All unverified
//! callers of one address wait in one flow. A waiting unverified job whose share is taken is not
//! eligible, so it neither takes a slot nor holds back a configured tenant's job behind it. Over
//! a shared store the share is claimed in the same decision as the account slot, so it holds
//! across instances too.
//!
//! The types are here; the rest is cut along its ideas: a place reserved and admitted
//! (`admission`), the dispatcher handing out slots (`dispatch`), the account claimed in a shared
//! store (`shared`), the one line across instances (`line`), who goes next (`round_robin`,
//! `tiers`), and what the queue shows (`view`).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::{Notify, oneshot};

use crate::clock::{Nanos, SharedClock};
use crate::limit::Limiter;
use crate::ops::metrics::Metrics;
use crate::store::{SharedLearner, SharedLine, SlotGuard, Store};
use crate::upstream::adaptive::{AdaptiveLimit, Signal};
use crate::upstream::classes::{ClassId, JobClass, JobClasses};

mod admission;
mod dispatch;
mod line;
mod round_robin;
mod shared;
mod tiers;
mod view;

use round_robin::State;
pub use tiers::{Standing, TierRule};

/// How long an instance waits before asking again for an account slot another instance holds,
/// unless it hears first that one was freed (a message can be lost: a subscription that dropped),
/// and before asking a store that failed again.
const ACCOUNT_RETRY: Nanos = Nanos::from_secs(1);

/// The account, its unverified share and the classes' gaps in a shared store.
struct Shared {
    store: Arc<dyn Store>,
    /// The keys the account's slots, the unverified share and the classes' gaps are claimed
    /// under (one hash tag, the queue's name: one slot, one decision).
    account_key: String,
    unverified_key: String,
    account: Limiter,
    unverified: Limiter,
    /// Per class, by [`ClassId`]: its gap's key (`{upstream}video_gap`) and limiter, if it has
    /// a gap longer than 0.
    gaps: Vec<Option<(String, Limiter)>>,
    /// Where the learnt limit every instance uses is kept (with an adaptive limit), under
    /// `learnt_key`.
    learner: Option<Arc<dyn SharedLearner>>,
    learnt_key: String,
    /// The slots the shared learnt limit hands out, as the store last said; 0 while it has not
    /// said or cannot (the local learner decides meanwhile).
    learnt: AtomicUsize,
    /// No call goes to the store before this (on the queue's clock) after one failed: the queue
    /// limits locally meanwhile.
    down_until: AtomicU64,
    metrics: Arc<Metrics>,
    /// The channel every instance says on that it freed an account slot (or one of the share),
    /// once it is free (`{upstream}account:freed`).
    freed_channel: String,
    /// What is heard on it: each message wakes the dispatcher, which asks again at once.
    freed: Option<tokio::sync::watch::Receiver<u64>>,
    /// The one line every instance's waiting jobs stand in, when the store keeps one.
    line: Option<Arc<dyn SharedLine>>,
    /// The queue's name (the keys' hash tag), and this instance's in the line (random).
    name: String,
    instance: String,
    /// Per tier of [`QueueRules::tiers`]: the key its jobs' slots are counted on, so a claim
    /// knows which tier holds fewer than it is reserved on every instance.
    tier_keys: Vec<String>,
    /// The limiter those keys are held under (the account's cap: they count, never refuse).
    tier_limiter: Limiter,
    /// Numbers the candidates a claim at the door names.
    doors: AtomicU64,
}

/// What a job about to leave waits for when the shared store says not yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Blocker {
    /// Every account slot is taken (by any instance).
    Account,
    /// The unverified callers' share of the slots is taken.
    UnverifiedShare,
    /// Another job of its class left within the class's gap.
    Gap,
}

/// How the queue is sized and paced.
#[derive(Debug, Clone)]
pub struct QueueRules {
    /// The account's slots: predictions the upstream runs at once for us.
    pub max_in_flight: usize,
    /// Jobs that may wait, all classes together.
    pub max_waiting: usize,
    /// The classes its jobs are of: their gaps and their own caps on waiting jobs.
    pub classes: JobClasses,
    /// The account's slots unverified callers may hold, all together.
    pub unverified_slots: usize,
    /// The places in the queue unverified callers may hold, all together.
    pub unverified_places: usize,
    /// The tiers with a reserved share or a rank (`[upstream.reserved]`, `[upstream.priority]`).
    pub tiers: Vec<TierRule>,
}

impl QueueRules {
    /// A queue without an unverified share (everyone may take every slot and place).
    pub fn new(max_in_flight: usize, max_waiting: usize, classes: JobClasses) -> Self {
        Self {
            max_in_flight,
            max_waiting,
            classes,
            unverified_slots: max_in_flight,
            unverified_places: max_waiting,
            tiers: Vec::new(),
        }
    }

    /// These rules with `tiers` reserved a share of the slots and places, and ranked.
    pub fn with_tiers(self, tiers: Vec<TierRule>) -> Self {
        Self { tiers, ..self }
    }

    /// Where a job of a caller of `tier` stands (an unverified caller draws on no reservation).
    pub fn standing(&self, tier: &str, unverified: bool) -> Standing {
        let Some((i, rule)) = self.tiers.iter().enumerate().find(|(_, t)| t.name == tier) else {
            return Standing::plain(unverified);
        };
        let reserved = (!unverified && rule.reserved > 0.0).then_some(i);
        Standing { unverified, reserved, rank: rule.rank }
    }

    /// The account's slots tier `i` is reserved (of the slots as these rules have them).
    pub fn reserved_slots(&self, i: usize) -> usize {
        self.tiers.get(i).map_or(0, |t| t.share_of(self.max_in_flight))
    }

    /// The queue's places tier `i` is reserved.
    pub fn reserved_places(&self, i: usize) -> usize {
        self.tiers.get(i).map_or(0, |t| t.share_of(self.max_waiting))
    }

    /// These rules with unverified callers held to `slots` of the account and `places` in the
    /// queue.
    pub fn unverified_share(self, slots: usize, places: usize) -> Self {
        Self {
            unverified_slots: slots.min(self.max_in_flight),
            unverified_places: places.min(self.max_waiting),
            ..self
        }
    }
}

/// The queue in front of the upstream account.
pub struct FairQueue {
    rules: QueueRules,
    /// The account's slots learnt from the upstream's answers, under `rules.max_in_flight`.
    adaptive: Option<AdaptiveLimit>,
    clock: SharedClock,
    state: Mutex<State>,
    changed: Notify,
    /// A shared store the account's slots and the classes' gaps are claimed in, so every
    /// instance keeps one cap and one spacing.
    shared: Option<Shared>,
    /// What ends the jobs of a dead instance that a claim here took out of the shared line
    /// ([`FairQueue::on_orphans`]).
    orphans: std::sync::OnceLock<Orphans>,
}

/// Ends jobs, by id, that waited on an instance no longer alive.
pub type Orphans = Box<dyn Fn(Vec<String>) + Send + Sync>;

impl std::fmt::Debug for FairQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FairQueue").field("rules", &self.rules).finish_non_exhaustive()
    }
}

/// A slot counted in the queue's state, owned from the instant it is counted: dropped — its
/// holder cancelled, or it never became an [`AccountSlot`] — it is given back. Nothing awaits
/// between counting a slot and making its guard, so no cancelled future can keep one.
struct Counted {
    queue: Arc<FairQueue>,
    /// Who it was counted for: an unverified caller's job holds one of their share, a reserved
    /// tier's one of its slots.
    standing: Standing,
    /// Still counted (not given back yet).
    held: bool,
}

impl Counted {
    /// Counts a slot for a job of this class in `state` (the queue's, locked).
    fn take(queue: &Arc<FairQueue>, state: &mut State, standing: Standing) -> Self {
        state.take_slot(standing);
        Self { queue: queue.clone(), standing, held: true }
    }

    /// Gives the slot back under a lock already held, with whatever else that step decides.
    fn give_back(mut self, state: &mut State) {
        state.give_slot(self.standing);
        self.held = false;
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        if self.held {
            self.queue.state().give_slot(self.standing);
            self.queue.changed.notify_waiters();
        }
    }
}

/// One of the account's slots, held by a job while the upstream runs it; given back on drop.
#[must_use = "dropping an account slot gives it back at once"]
pub struct AccountSlot {
    counted: Counted,
    /// When it was handed out, on the queue's clock.
    taken_at: Nanos,
    /// When the shared store gave it, on the store's clock, if it was claimed under the shared
    /// learnt limit (what it answers is then learnt there).
    shared_at: Option<Nanos>,
    /// Its leases in a shared store (the account's, and the share's), given back with it.
    _leases: Vec<SlotGuard>,
}

impl std::fmt::Debug for AccountSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AccountSlot")
    }
}

impl AccountSlot {
    /// The upstream took the work this slot was for: an adaptive limit may grow.
    pub async fn accepted(&self) {
        self.counted.queue.learn(self, Signal::Accepted).await;
    }

    /// The upstream said it had too much (a 429): an adaptive limit shrinks.
    pub async fn overloaded(&self) {
        self.counted.queue.learn(self, Signal::Overloaded).await;
    }

    /// The upstream did not answer the work within its time (its own time, from this slot on):
    /// an adaptive limit shrinks if other slots were in use too (see [`Signal::TimedOut`]).
    pub async fn timed_out(&self) {
        self.counted.queue.learn(self, Signal::TimedOut).await;
    }
}

/// A place promised in the queue while the call that asked for it is being admitted; given back
/// if dropped unused.
#[must_use = "dropping a queue place gives it back"]
pub struct QueuePlace {
    queue: Arc<FairQueue>,
    class: ClassId,
    standing: Standing,
    used: bool,
}

/// Why a job could not have a place in the queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QueueFull {
    /// Every place (or every place of the job's class) is taken.
    Full,
    /// The unverified callers' share of the places, or of the slots, is taken (or is none).
    UnverifiedShare {
        /// Slots unverified callers may hold.
        slots: usize,
        /// Places unverified callers may hold.
        places: usize,
    },
    /// The places left are reserved for tiers that do not hold their share yet
    /// (`[upstream.reserved]`).
    Reserved,
}

impl std::fmt::Debug for QueuePlace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePlace").field("class", &self.class).finish_non_exhaustive()
    }
}

/// A job waiting for its turn: resolves to its account slot, or to an error if it left the line
/// (cancelled, expired). Dropped before its turn came — its caller cancelled, or stopped
/// waiting — the job leaves the line at once, and its place is free for another.
#[must_use = "dropping a turn takes its job out of the line"]
pub struct Turn {
    slot: oneshot::Receiver<AccountSlot>,
    queue: Arc<FairQueue>,
    id: String,
    /// Its slot (or the news that it left) has arrived.
    done: bool,
}

impl std::fmt::Debug for Turn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Turn").field("id", &self.id).field("done", &self.done).finish()
    }
}

impl Turn {
    /// Its slot if it has come, without waiting ([`oneshot::Receiver::try_recv`]).
    pub fn try_recv(&mut self) -> Result<AccountSlot, oneshot::error::TryRecvError> {
        let answer = self.slot.try_recv();
        if !matches!(answer, Err(oneshot::error::TryRecvError::Empty)) {
            self.done = true;
        }
        answer
    }
}

impl Future for Turn {
    type Output = Result<AccountSlot, oneshot::error::RecvError>;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        let answer = std::task::ready!(std::pin::Pin::new(&mut self.slot).poll(cx));
        self.done = true;
        std::task::Poll::Ready(answer)
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        if !self.done {
            // Closed first, so the entry this turn waited on reads as abandoned; a slot already
            // sent into it goes back as the channel drops it.
            self.slot.close();
            self.queue.forget_abandoned(&self.id);
        }
    }
}

/// Where a waiting job stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position {
    /// Jobs that will be served before it, as the round robin stands now.
    pub ahead: usize,
    /// How many of those are of its own class (each waits the class's gap, if it has one).
    pub alike_ahead: usize,
}

/// What the queue holds, for `rate_limit_status` and `/metrics`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Occupancy {
    /// Account slots in use.
    pub in_flight: usize,
    /// Jobs waiting, all flows.
    pub waiting: usize,
    /// Jobs waiting per class, by [`ClassId`] (see [`Occupancy::waiting_of`]).
    pub waiting_per_class: Vec<usize>,
    /// Jobs waiting per flow.
    pub per_flow: Vec<(String, usize)>,
    /// Account slots unverified callers' jobs hold.
    pub unverified_in_flight: usize,
    /// Unverified callers' jobs waiting.
    pub unverified_waiting: usize,
    /// Per tier with a reserved share or a rank, in the order of [`QueueRules::tiers`].
    pub per_tier: Vec<TierOccupancy>,
}

/// What one tier with a reserved share or a rank holds of the queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierOccupancy {
    /// The tier.
    pub tier: String,
    /// Its rank when the account is full.
    pub rank: i64,
    /// The account's slots reserved for it (of the slots handed out now).
    pub reserved_slots: usize,
    /// The queue's places reserved for it.
    pub reserved_places: usize,
    /// Slots its configured callers' jobs hold.
    pub in_flight: usize,
    /// Its configured callers' jobs waiting.
    pub waiting: usize,
}

impl Occupancy {
    /// Jobs of `class` waiting.
    pub fn waiting_of(&self, class: ClassId) -> usize {
        self.waiting_per_class.get(class.index()).copied().unwrap_or(0)
    }
}

impl FairQueue {
    /// A queue with `rules`, its waits on `clock`.
    pub fn new(rules: QueueRules, clock: SharedClock) -> Self {
        let state = Mutex::new(State::new(&rules));
        let orphans = std::sync::OnceLock::new();
        Self { rules, clock, state, changed: Notify::new(), shared: None, adaptive: None, orphans }
    }

    /// The class `class` names, if the queue has it.
    fn class(&self, class: ClassId) -> Option<&JobClass> {
        self.rules.classes.get(class)
    }

    /// This queue handing out as many slots as `limit` has learnt the account takes, never
    /// more than `rules.max_in_flight`.
    pub fn adaptive(mut self, limit: Option<AdaptiveLimit>) -> Self {
        self.adaptive = limit;
        self
    }

    /// Has `end` end the jobs of a dead instance that a claim here takes out of the shared line
    /// (nobody else knows they will never run). Once; a second call is ignored.
    pub fn on_orphans(&self, end: Orphans) {
        let _ = self.orphans.set(end);
    }

    /// Whether its slots are learnt ([`FairQueue::adaptive`]).
    pub fn is_adaptive(&self) -> bool {
        self.adaptive.is_some()
    }

    /// The slots it hands out now: the static cap, or the learnt limit — the one every instance
    /// shares, as the store last said, or this instance's own while the store cannot say.
    pub fn slots(&self) -> usize {
        let Some(adaptive) = &self.adaptive else { return self.rules.max_in_flight };
        let shared = self.shared.as_ref().map_or(0, |s| s.learnt.load(Ordering::Relaxed));
        let learnt = if shared > 0 { shared } else { adaptive.current() };
        learnt.min(self.rules.max_in_flight)
    }

    /// The rules as they stand now: the account's slots as learnt, and the unverified callers'
    /// share of them scaled alike (rounded down).
    pub fn rules_now(&self) -> QueueRules {
        let slots = self.slots();
        if slots == self.rules.max_in_flight {
            return self.rules.clone();
        }
        let share = self.rules.unverified_slots.saturating_mul(slots) / self.rules.max_in_flight.max(1);
        QueueRules { max_in_flight: slots, unverified_slots: share, ..self.rules.clone() }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Every update leaves the state whole, so a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How it is sized and paced.
    pub fn rules(&self) -> &QueueRules {
        &self.rules
    }
}

/// The flow a job waits in: its name (a tenant, the address of unverified callers, or a caller),
/// its weight in the round robin (the caller's tier factor), and where its caller's jobs stand
/// (an unverified caller's held to their share; a tier's reservation and rank).
#[derive(Debug, Clone, Copy)]
pub struct Flowing<'a> {
    /// The flow's name.
    pub name: &'a str,
    /// Its quantum in the round robin.
    pub quantum: f64,
    /// Where the caller's jobs stand.
    pub standing: Standing,
}

#[cfg(test)]
mod tests;
