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

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::{Notify, oneshot};
use tokio_util::sync::CancellationToken;

use crate::clock::{NANOS_PER_SEC, Nanos, SharedClock};
use crate::limit::{Concurrency, Gcra, Limiter};
use crate::metrics::Metrics;
use crate::store::{Check, LearntAt, Lease, SharedLearner, SharedLimit, SharedLine, SlotGuard, Store, StoreError};
use crate::upstream::adaptive::{AdaptiveLimit, Signal};
use crate::upstream::classes::{ClassId, JobClass, JobClasses};

mod line;
mod round_robin;
mod tiers;

use round_robin::{State, Waiting};
pub use tiers::{Standing, TierRule};

/// How long an instance waits before asking again for an account slot another instance holds,
/// unless it hears first that one was freed (a message can be lost: a subscription that dropped),
/// and before asking a store that failed again.
const ACCOUNT_RETRY: Nanos = NANOS_PER_SEC;

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

impl Shared {
    /// Whether the store failed less than [`ACCOUNT_RETRY`] ago.
    fn down(&self, now: Nanos) -> bool {
        now < self.down_until.load(Ordering::Relaxed)
    }

    /// The store could not answer `what`: logged, counted, and not asked again for a while.
    fn failed(&self, error: &StoreError, what: &str, now: Nanos) {
        tracing::warn!(%error, "cannot {what} in the shared store; limiting locally for a second");
        self.metrics.account_store_error();
        self.learnt.store(0, Ordering::Relaxed);
        self.down_until.store(now.saturating_add(ACCOUNT_RETRY), Ordering::Relaxed);
    }

    /// The guard of one slot taken on `key` under `lease`: renewed while held, and given back
    /// with a word to every instance waiting for a slot.
    fn slot(&self, key: &str, limiter: &Limiter, lease: Lease) -> SlotGuard {
        SlotGuard::new(self.store.clone(), key.to_owned(), limiter.clone(), 1, lease).telling(&self.freed_channel)
    }

    /// The store's answer about the learnt limit: what every instance hands out now.
    fn heard(&self, limit: SharedLimit) {
        self.learnt.store(usize::try_from(limit.current).unwrap_or(usize::MAX), Ordering::Relaxed);
    }
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

/// What the shared store said to a job about to leave.
enum Claim {
    /// Go, holding these leases (none without a shared store, or when it cannot answer), taken
    /// at this reading of the store's clock when claimed under the shared learnt limit.
    Go(Vec<SlotGuard>, Option<Nanos>),
    /// Not yet, for this long.
    Wait(Nanos, Blocker),
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
#[must_use = "dropping a reservation gives the place back"]
pub struct Reservation {
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

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservation").field("class", &self.class).finish_non_exhaustive()
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

    /// Learns from `slot`'s use, if the limit is adaptive — here, and in the shared store when
    /// the slot was claimed there — and lets a job waiting for a slot the new limit frees go.
    async fn learn(&self, slot: &AccountSlot, signal: Signal) {
        let Some(adaptive) = &self.adaptive else { return };
        let now = self.clock.now();
        let others = self.state().in_flight.saturating_sub(1);
        // Always learnt here too: it is what limits this instance while the store cannot.
        adaptive.learn(signal, slot.taken_at, others, now);
        if let (Some(shared), Some(taken_at)) = (&self.shared, slot.shared_at)
            && let Some((learner, at)) = self.learnt_at(shared)
            && !shared.down(now)
        {
            match learner.learn(at, signal, now.saturating_sub(slot.taken_at), taken_at).await {
                Ok(limit) => shared.heard(limit),
                Err(error) => shared.failed(&error, "learn the account's limit", self.clock.now()),
            }
        }
        self.changed.notify_waiters();
    }

    /// Where the learnt limit every instance shares is kept, when the limit is adaptive and
    /// `shared`'s store keeps one.
    fn learnt_at<'a>(&'a self, shared: &'a Shared) -> Option<(&'a Arc<dyn SharedLearner>, LearntAt<'a>)> {
        let (adaptive, learner) = (self.adaptive.as_ref()?, shared.learner.as_ref()?);
        let at = LearntAt {
            key: &shared.learnt_key,
            in_flight_key: &shared.account_key,
            learner: adaptive.learner(),
            ceiling: self.rules.max_in_flight as u64,
        };
        Some((learner, at))
    }

    /// Reads the learnt limit every instance shares again, when there is one (another instance
    /// may have moved it), so what this one shows — `rate_limit_status`, `/metrics`, the
    /// dashboard — is the shared value. A store that cannot answer leaves the local limit shown.
    pub async fn refresh_learnt(&self) {
        let Some(shared) = &self.shared else { return };
        let now = self.clock.now();
        if let Some((learner, at)) = self.learnt_at(shared)
            && !shared.down(now)
        {
            match learner.learnt(at).await {
                Ok(limit) => shared.heard(limit),
                Err(error) => shared.failed(&error, "read the account's learnt limit", now),
            }
        }
    }

    /// This queue with the account's cap and the classes' spacing claimed in `store` when it is
    /// shared by several instances, under keys tagged `{name}` (`upstream` for the paid API's
    /// account, `proxied` for a proxied server): instances with the same name share one cap, and
    /// with an adaptive limit one learnt limit. The store's failures are counted in `metrics`.
    pub fn shared_in(mut self, store: Arc<dyn Store>, name: &str, metrics: Arc<Metrics>) -> Self {
        if store.is_shared() {
            let account = Limiter::Concurrency(Concurrency::new(self.rules.max_in_flight as u64));
            let unverified = Limiter::Concurrency(Concurrency::new(self.rules.unverified_slots.max(1) as u64));
            let gaps = self
                .rules
                .classes
                .iter()
                .map(|(_, class)| {
                    let gap = class.min_gap.filter(|gap| *gap > 0)?;
                    let limiter = Limiter::Gcra(Gcra::new(1, NANOS_PER_SEC as f64 / gap as f64));
                    Some((format!("{{{name}}}{}_gap", class.name), limiter))
                })
                .collect();
            let freed_channel = format!("{{{name}}}account:freed");
            let tier_keys = self.rules.tiers.iter().map(|t| format!("{{{name}}}account:tier:{}", t.name)).collect();
            self.shared = Some(Shared {
                line: store.clone().shared_line(),
                name: name.to_owned(),
                instance: format!("{:016x}", rand::random::<u64>()),
                tier_keys,
                tier_limiter: Limiter::Concurrency(Concurrency::new(self.rules.max_in_flight as u64)),
                doors: AtomicU64::new(0),
                freed: store.clone().hear(&freed_channel),
                freed_channel,
                learner: store.clone().shared_learner(),
                store,
                account_key: format!("{{{name}}}account:in_flight"),
                unverified_key: format!("{{{name}}}account:unverified"),
                account,
                unverified,
                gaps,
                learnt_key: format!("{{{name}}}account:learnt"),
                learnt: AtomicUsize::new(0),
                down_until: AtomicU64::new(0),
                metrics,
            });
        }
        self
    }

    /// Claims, in the shared store, an account slot, for an unverified caller's job one of their
    /// share, and for a job of a class with a gap the gap, in one decision — under the shared
    /// learnt limit, with an adaptive one. A store that cannot answer leaves the local cap (or
    /// learnt limit), share and spacing in charge.
    async fn claim(&self, class: ClassId, unverified: bool) -> Claim {
        let Some(shared) = &self.shared else { return Claim::Go(Vec::new(), None) };
        let now = self.clock.now();
        if shared.down(now) {
            return Claim::Go(Vec::new(), None);
        }
        let mut checks = vec![Check { key: &shared.account_key, limiter: &shared.account, cost: 1, shadow: false }];
        let mut blockers = vec![Blocker::Account];
        if unverified {
            checks.push(Check { key: &shared.unverified_key, limiter: &shared.unverified, cost: 1, shadow: false });
            blockers.push(Blocker::UnverifiedShare);
        }
        if let Some((gap_key, gap)) = shared.gaps.get(class.index()).and_then(Option::as_ref) {
            checks.push(Check { key: gap_key, limiter: gap, cost: 1, shadow: false });
            blockers.push(Blocker::Gap);
        }
        let lease = Lease::new();
        let answer = match self.learnt_at(shared) {
            Some((learner, at)) => learner.decide_under(at, &checks, lease).await.map(|(decisions, limit)| {
                shared.heard(limit);
                (decisions, Some(limit.at))
            }),
            None => shared.store.decide_all(&checks, lease).await.map(|decisions| (decisions, None)),
        };
        match answer {
            Ok((decisions, taken_at)) if decisions.iter().all(|d| d.allowed) => {
                let mut leases = vec![shared.slot(&shared.account_key, &shared.account, lease)];
                if unverified {
                    leases.push(shared.slot(&shared.unverified_key, &shared.unverified, lease));
                }
                Claim::Go(leases, taken_at)
            }
            Ok((decisions, _)) => {
                // The slots first: a gap passes by itself, a slot only when another job ends.
                let refused = |b: Blocker| blockers.iter().zip(&decisions).find(|(x, d)| **x == b && !d.allowed);
                let gap = refused(Blocker::Gap).map_or(0, |(_, d)| d.retry_after);
                match [Blocker::Account, Blocker::UnverifiedShare].into_iter().find(|b| refused(*b).is_some()) {
                    Some(slots) => Claim::Wait(gap.max(ACCOUNT_RETRY), slots),
                    None => Claim::Wait(gap.max(1), Blocker::Gap),
                }
            }
            Err(error) => {
                shared.failed(&error, "claim the upstream account", now);
                Claim::Go(Vec::new(), None)
            }
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Every update leaves the state whole, so a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How it is sized and paced.
    pub fn rules(&self) -> &QueueRules {
        &self.rules
    }

    /// Serves waiting jobs as slots free up and gaps pass, until `stop`. Over a shared store, a
    /// slot freed by any instance is heard at once, and the jobs waiting here ask for it then.
    pub async fn dispatch(self: Arc<Self>, stop: CancellationToken) {
        let mut freed = self.shared.as_ref().and_then(|s| s.freed.clone());
        let mut alive_at = tokio::time::Instant::now();
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let now = self.clock.now();
            let (wake_at, in_line) = if let Some((shared, line)) = self.line_now(now) {
                match self.line_step(shared, line, &mut alive_at).await {
                    line::LineStep::Again => continue,
                    // While jobs here stand in the line, they say so in real time (its clock).
                    line::LineStep::Wait(at) => (at, self.state().joined_count() > 0),
                }
            } else {
                match self.local_step(now).await {
                    Some(wake_at) => (wake_at, false),
                    None => continue,
                }
            };
            // Real time, made only when needed: the simulator's runtime keeps no timers.
            let heartbeat = async {
                if in_line {
                    tokio::time::sleep_until(alive_at + crate::store::LINE_HEARTBEAT).await;
                } else {
                    std::future::pending::<()>().await;
                }
            };
            let sleep = async {
                match wake_at {
                    Some(at) => self.clock.sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            let heard = async {
                match freed.as_mut() {
                    Some(freed) => freed.changed().await.is_ok(),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = stop.cancelled() => return,
                () = &mut changed => {}
                () = sleep => {}
                () = heartbeat => {}
                listening = heard => {
                    if listening {
                        // Another instance freed a slot: what it said full may not be any more.
                        let mut state = self.state();
                        (state.account_full_until, state.unverified_full_until) = (0, 0);
                    } else {
                        freed = None;
                    }
                }
            }
        }
    }

    /// One step of the local round robin (no shared line, or the store cannot answer): the next
    /// job picked here gets its slot (claimed in the shared store, if any), or when to look
    /// again. `None`: step again at once.
    async fn local_step(self: &Arc<Self>, now: Nanos) -> Option<Option<Nanos>> {
        let (picked, wake_at) = {
            let mut state = self.state();
            let rules = self.rules_now();
            match state.pick(&rules, now) {
                Some(mut job) => {
                    // Chosen here while the line could not be asked: out of the line, and
                    // back in with its tag if it must wait again.
                    if let Some(joined) = job.joined.take() {
                        state.leaving.push(joined.member.clone());
                        job.rejoin_at = Some(joined);
                    }
                    let counted = Counted::take(self, &mut state, job.standing);
                    if let Some(gap) = self.class(job.class).and_then(|c| c.min_gap) {
                        state.set_next_at(job.class, now.saturating_add(gap));
                    }
                    (Some((job, counted)), None)
                }
                None => (None, state.next_wake(&rules, now)),
            }
        };
        if let Some((job, counted)) = picked {
            let (leases, shared_at) = match self.claim(job.class, job.standing.unverified).await {
                Claim::Go(leases, shared_at) => (leases, shared_at),
                Claim::Wait(wait, blocker) => {
                    // Another instance holds the slots (or the share), or submitted a job of
                    // this class within its gap: back to the front, until the store says.
                    let mut state = self.state();
                    counted.give_back(&mut state);
                    let until = self.clock.now().saturating_add(wait);
                    match blocker {
                        Blocker::Account => state.account_full_until = until,
                        Blocker::UnverifiedShare => state.unverified_full_until = until,
                        Blocker::Gap => state.set_next_at(job.class, until),
                    }
                    state.unpick(job);
                    return None;
                }
            };
            // A job that left meanwhile drops its receiver: the slot comes straight back.
            let taken_at = self.clock.now();
            let slot = AccountSlot { counted, taken_at, shared_at, _leases: leases };
            let _ = job.turn.send(slot);
            return None;
        }
        Some(wake_at)
    }

    /// Promises a place for a job of `class` standing as `standing` (of an unverified caller,
    /// held to their share; never one a reserved tier is still owed), or says why there is none.
    pub fn reserve(self: &Arc<Self>, class: ClassId, standing: Standing) -> Result<Reservation, QueueFull> {
        let mut state = self.state();
        let waiting = state.waiting(None).saturating_add(state.reserved());
        let class_full = self
            .class(class)
            .and_then(|c| c.queue_max)
            .is_some_and(|max| state.waiting(Some(class)).saturating_add(state.of_class(class).reserved) >= max);
        if waiting >= self.rules.max_waiting || class_full {
            return Err(QueueFull::Full);
        }
        let rules = &self.rules;
        if standing.unverified
            && (rules.unverified_slots == 0
                || state.unverified_waiting() + state.reserved_unverified >= rules.unverified_places)
        {
            return Err(QueueFull::UnverifiedShare { slots: rules.unverified_slots, places: rules.unverified_places });
        }
        let owed = tiers::places_owed(&rules.tiers, rules.max_waiting, standing, |i| state.places_held_by(i));
        if waiting.saturating_add(1).saturating_add(owed) > rules.max_waiting {
            return Err(QueueFull::Reserved);
        }
        state.reserve_place(class, standing);
        Ok(Reservation { queue: self.clone(), class, standing, used: false })
    }

    /// Where `id` stands, if it is waiting.
    pub fn position(&self, id: &str) -> Option<Position> {
        let rules = self.rules_now();
        let state = self.state();
        let (flow_key, index) =
            state.flows.iter().find_map(|(key, f)| f.jobs.iter().position(|w| w.id == id).map(|i| (key.clone(), i)))?;
        // Who goes first (see `State::pick`): a tier still owed reserved slots, then the highest
        // rank. A flow that goes before ours serves all its jobs first; one alike, as the round
        // robin stands: up to `index + 1` jobs if it is ahead of ours in the ring, `index` if
        // behind; one after ours, none.
        let precedence = |s: Standing| (state.owed_a_slot(s, &rules), s.rank);
        let ring_at = state.ring.iter().position(|k| *k == flow_key).unwrap_or(0);
        let mine = state.flows.get(&flow_key);
        let mut ahead = index;
        let me = mine.and_then(|f| f.jobs.get(index));
        let (class, standing) = (me.map(|w| w.class), me.map_or(Standing::PLAIN, |w| w.standing));
        let alike = |w: &Waiting| Some(w.class) == class;
        let mut alike_ahead = mine.map_or(0, |f| f.jobs.iter().take(index).filter(|w| alike(w)).count());
        for (i, key) in state.ring.iter().enumerate().filter(|(_, k)| **k != flow_key) {
            if let Some(flow) = state.flows.get(key) {
                let theirs = flow.jobs.front().map_or(Standing::PLAIN, |w| w.standing);
                let take = match precedence(theirs).cmp(&precedence(standing)) {
                    std::cmp::Ordering::Greater => flow.jobs.len(),
                    std::cmp::Ordering::Equal if i < ring_at => index + 1,
                    std::cmp::Ordering::Equal => index,
                    std::cmp::Ordering::Less => 0,
                };
                let served: Vec<&Waiting> = flow.jobs.iter().take(take).collect();
                ahead = ahead.saturating_add(served.len());
                alike_ahead = alike_ahead.saturating_add(served.iter().filter(|w| alike(w)).count());
            }
        }
        // Over a shared line, how many go before it on every instance, as the line last said.
        let ahead = me.and_then(|w| w.ahead).unwrap_or(ahead);
        Some(Position { ahead, alike_ahead: alike_ahead.min(ahead) })
    }

    /// When the next job of `class` may be submitted, if its gap is running.
    pub fn next_at(&self, class: ClassId) -> Nanos {
        self.state().of_class(class).next_at
    }

    /// How long until every class with jobs waiting may submit again: the longest gap still
    /// running among them (0 when none is).
    pub fn gaps_left(&self, now: Nanos) -> Nanos {
        let state = self.state();
        let waiting = state.waiting_per_class();
        let per_class = state.classes.iter().zip(waiting);
        per_class.filter(|(_, waiting)| *waiting > 0).map(|(of, _)| of.next_at.saturating_sub(now)).max().unwrap_or(0)
    }

    /// Puts `id` back at the front of `flow` after a failed attempt (its slot already given
    /// back), not to leave before `not_before`.
    pub fn requeue_front(self: &Arc<Self>, flow: &Flowing<'_>, id: &str, class: ClassId, not_before: Nanos) -> Turn {
        let (turn, waiting) = oneshot::channel();
        let (standing, quantum) = (flow.standing, flow.quantum);
        let job = Waiting::new(id, class, standing, not_before, turn);
        let flow = flow.name;
        self.state().push(flow, quantum, job, true);
        self.changed.notify_waiters();
        Turn { slot: waiting, queue: self.clone(), id: id.to_owned(), done: false }
    }

    /// Takes `id` out of the line (a cancelled job); `true` if it was waiting.
    pub fn remove(&self, id: &str) -> bool {
        let removed = self.state().remove(id);
        if removed {
            self.changed.notify_waiters();
        }
        removed
    }

    /// Takes out of the line the entries for `id` whose [`Turn`] was dropped before it came.
    fn forget_abandoned(&self, id: &str) {
        let removed = self.state().remove_abandoned(id);
        if removed {
            self.changed.notify_waiters();
        }
    }

    /// What the queue holds now.
    pub fn occupancy(&self) -> Occupancy {
        let rules = self.rules_now();
        let state = self.state();
        let per_tier = rules
            .tiers
            .iter()
            .enumerate()
            .map(|(i, tier)| TierOccupancy {
                tier: tier.name.clone(),
                rank: tier.rank,
                reserved_slots: rules.reserved_slots(i),
                reserved_places: rules.reserved_places(i),
                in_flight: state.in_flight_of(i),
                waiting: state.waiting_of_tier(i),
            })
            .collect();
        let mut per_flow: Vec<(String, usize)> = state.flows.iter().map(|(k, f)| (k.clone(), f.jobs.len())).collect();
        per_flow.sort();
        Occupancy {
            in_flight: state.in_flight,
            waiting: state.waiting(None),
            waiting_per_class: state.waiting_per_class(),
            per_flow,
            unverified_in_flight: state.unverified_in_flight,
            unverified_waiting: state.unverified_waiting(),
            per_tier,
        }
    }
}

impl Reservation {
    /// The class of the job it holds a place for.
    pub fn class(&self) -> ClassId {
        self.class
    }

    /// An account slot at once, if one is free and no job is waiting for one (nobody is
    /// overtaken). A job of a class with a gap always waits its turn: the gap applies to it.
    ///
    /// Cancel-safe: dropped while the shared store is asked, the slot counted here goes back (its
    /// guard owns it from the instant it is counted), and so do the place and any lease the store
    /// may have taken ([`Budgets::decide`](crate::store::Budgets::decide)).
    pub async fn start_now(mut self, flow: &Flowing<'_>) -> Result<AccountSlot, Self> {
        let queue = self.queue.clone();
        let counted = {
            let mut state = queue.state();
            let free = state.door_open(&queue.rules_now(), self.standing, queue.clock.now());
            let spaced = queue.class(self.class).is_some_and(|c| c.min_gap.is_some());
            if spaced || !free {
                return Err(self);
            }
            // Taken locally first, so two calls racing here cannot both pass the local cap.
            Counted::take(&queue, &mut state, self.standing)
        };
        if let Some((shared, line)) = queue.line_now(queue.clock.now()) {
            // Over the one line: now only if this job would be next on every instance.
            let candidate = queue.candidate(shared, &Flowing { standing: self.standing, ..*flow }, self.class);
            let lease = Lease::new();
            match queue.ask_line(shared, line, lease, Some(&candidate)).await {
                Ok(answer) => match queue.door_slot(shared, answer, counted, lease) {
                    Ok(slot) => {
                        self.release_place(&mut queue.state());
                        self.used = true;
                        return Ok(slot);
                    }
                    Err(counted) => {
                        counted.give_back(&mut queue.state());
                        return Err(self);
                    }
                },
                // The queue limits locally now: the claim below says so.
                Err(error) => queue.line_failed(shared, &error, "claim a turn at the door"),
            }
        }
        match queue.claim(self.class, self.standing.unverified).await {
            Claim::Go(leases, shared_at) => {
                self.release_place(&mut queue.state());
                self.used = true;
                let taken_at = queue.clock.now();
                Ok(AccountSlot { counted, taken_at, shared_at, _leases: leases })
            }
            Claim::Wait(wait, blocker) => {
                let mut state = queue.state();
                counted.give_back(&mut state);
                let until = queue.clock.now().saturating_add(wait);
                match blocker {
                    Blocker::UnverifiedShare => state.unverified_full_until = until,
                    Blocker::Account | Blocker::Gap => state.account_full_until = until,
                }
                Err(self)
            }
        }
    }

    /// Turns the promised place into job `id` waiting at the back of its flow (over a shared
    /// line, it joins the line at the dispatcher's next step).
    pub fn enqueue(mut self, flow: &Flowing<'_>, id: &str) -> Turn {
        self.used = true;
        let (turn, waiting) = oneshot::channel();
        let mut state = self.queue.state();
        self.release_place(&mut state);
        let quantum = flow.quantum.clamp(0.01, 1000.0);
        let job = Waiting::new(id, self.class, self.standing, 0, turn);
        state.push(flow.name, quantum, job, false);
        drop(state);
        self.queue.changed.notify_waiters();
        Turn { slot: waiting, queue: self.queue.clone(), id: id.to_owned(), done: false }
    }

    /// Gives the promised place back to the count (it became a slot, a waiting job, or nothing).
    fn release_place(&self, state: &mut State) {
        state.release_place(self.class, self.standing);
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.used {
            self.release_place(&mut self.queue.state());
        }
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
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::clock::{ManualClock, NANOS_PER_SEC};
    use crate::store::{Blocks, Broadcast, Budgets, Lease, Slots, StoreFuture, Verdict};
    use crate::upstream::classes::{IMAGE, VIDEO};

    const GAP: Nanos = 2 * NANOS_PER_SEC;

    /// Images, and videos spaced by `gap` of which `videos` may wait: numbered as [`IMAGE`] and
    /// [`VIDEO`].
    fn classes(gap: Nanos, videos: usize) -> JobClasses {
        let video = JobClass { min_gap: Some(gap), queue_max: Some(videos), ..JobClass::plain("video") };
        JobClasses::new(vec![JobClass::plain("image"), video])
    }

    fn queue(clock: &Arc<ManualClock>, slots: usize) -> Arc<FairQueue> {
        let rules = QueueRules::new(slots, 100, classes(GAP, 100));
        let queue = Arc::new(FairQueue::new(rules, clock.clone()));
        tokio::spawn(queue.clone().dispatch(CancellationToken::new()));
        queue
    }

    fn flow(name: &str) -> Flowing<'_> {
        Flowing { name, quantum: 1.0, standing: Standing::PLAIN }
    }

    async fn granted(turn: &mut Turn) -> Option<AccountSlot> {
        tokio::time::timeout(Duration::from_millis(50), turn).await.ok()?.ok()
    }

    #[tokio::test]
    async fn round_robin_across_flows_not_first_come_first_served() {
        let clock = ManualClock::new();
        let q = queue(&clock, 1);
        let held =
            q.reserve(IMAGE, Standing::PLAIN).expect("room").start_now(&flow("door")).await.expect("a free slot");
        let mut turns = Vec::new();
        for i in 0..3 {
            turns.push(("a", q.reserve(IMAGE, Standing::PLAIN).expect("room").enqueue(&flow("a"), &format!("a{i}"))));
        }
        turns.push(("b", q.reserve(IMAGE, Standing::PLAIN).expect("room").enqueue(&flow("b"), "b0")));
        assert_eq!(q.position("b0").map(|p| p.ahead), Some(1), "one of a's, then b's");
        drop(held);
        let mut order = Vec::new();
        for _ in 0..4 {
            let mut next = None;
            for (i, (flow, turn)) in turns.iter_mut().enumerate() {
                if let Some(slot) = granted(turn).await {
                    next = Some((i, *flow, slot));
                    break;
                }
            }
            let (i, flow, slot) = next.expect("someone is served");
            order.push(flow);
            drop(turns.remove(i));
            drop(slot);
        }
        assert_eq!(order, vec!["a", "b", "a", "a"]);
    }

    #[tokio::test]
    async fn videos_are_spaced_by_the_gap_and_images_pass_them_meanwhile() {
        let clock = ManualClock::new();
        let q = queue(&clock, 10);
        let mut v1 = q.reserve(VIDEO, Standing::PLAIN).expect("room").enqueue(&flow("a"), "v1");
        let mut v2 = q.reserve(VIDEO, Standing::PLAIN).expect("room").enqueue(&flow("a"), "v2");
        let _first = granted(&mut v1).await.expect("the first video goes at once");
        assert!(granted(&mut v2).await.is_none(), "the second waits for the gap");
        let image = q.reserve(IMAGE, Standing::PLAIN).expect("room");
        let image = image.start_now(&flow("door")).await.expect_err("someone is waiting: no overtaking at the door");
        let mut image = image.enqueue(&flow("b"), "i1");
        assert!(granted(&mut image).await.is_some(), "an image needs no gap");
        clock.advance(Duration::from_nanos(GAP));
        assert!(granted(&mut v2).await.is_some());
    }

    #[tokio::test]
    async fn a_third_class_is_spaced_and_held_to_its_places_as_its_data_says() {
        let clock = ManualClock::new();
        let audio = JobClass { min_gap: Some(3 * NANOS_PER_SEC), queue_max: Some(2), ..JobClass::plain("audio") };
        let mut all: Vec<JobClass> = classes(GAP, 100).iter().map(|(_, c)| c.clone()).collect();
        all.push(audio);
        let classes = JobClasses::new(all);
        let audio = classes.iter().find(|(_, c)| c.name == "audio").map(|(id, _)| id).expect("audio");
        let q = Arc::new(FairQueue::new(QueueRules::new(10, 100, classes), clock.clone()));
        tokio::spawn(q.clone().dispatch(CancellationToken::new()));
        let first = q.reserve(audio, Standing::PLAIN).expect("room");
        let first = first.start_now(&flow("door")).await.expect_err("a spaced class never takes a slot at the door");
        let mut a1 = first.enqueue(&flow("a"), "a1");
        let mut a2 = q.reserve(audio, Standing::PLAIN).expect("room").enqueue(&flow("a"), "a2");
        assert_eq!(q.reserve(audio, Standing::PLAIN).err(), Some(QueueFull::Full), "two audio jobs may wait");
        assert_eq!(q.occupancy().waiting_of(audio), 2);
        let _a1 = granted(&mut a1).await.expect("the first goes at once");
        let mut v1 = q.reserve(VIDEO, Standing::PLAIN).expect("room").enqueue(&flow("b"), "v1");
        assert!(granted(&mut v1).await.is_some(), "a video waits for its own gap, not audio's");
        clock.advance(Duration::from_nanos(GAP));
        assert!(granted(&mut a2).await.is_none(), "audio's gap is longer than video's");
        clock.advance(Duration::from_secs(1));
        assert!(granted(&mut a2).await.is_some());
    }

    #[tokio::test]
    async fn a_full_account_holds_jobs_until_a_slot_is_given_back() {
        let clock = ManualClock::new();
        let q = queue(&clock, 2);
        let a = q.reserve(IMAGE, Standing::PLAIN).expect("room").start_now(&flow("door")).await.expect("slot");
        let _b = q.reserve(IMAGE, Standing::PLAIN).expect("room").start_now(&flow("door")).await.expect("slot");
        let waiting = q.reserve(IMAGE, Standing::PLAIN).expect("room");
        let mut waiting =
            waiting.start_now(&flow("door")).await.expect_err("the account is full").enqueue(&flow("c"), "c0");
        assert!(granted(&mut waiting).await.is_none());
        assert_eq!(q.occupancy().in_flight, 2);
        drop(a);
        let _c = granted(&mut waiting).await.expect("the freed slot goes to the waiting job");
        assert_eq!(q.occupancy().in_flight, 2);
    }

    /// A shared store that never answers a decision (Redis behind a dead link): what it was
    /// asked to give back is recorded.
    #[derive(Debug, Default)]
    struct Stalled {
        released: Mutex<Vec<String>>,
    }

    impl Budgets for Stalled {
        fn decide<'a>(&'a self, _: &'a [Check<'a>], _: &'a [&'a str], _: Lease) -> StoreFuture<'a, Verdict> {
            Box::pin(std::future::pending())
        }

        fn adjust<'a>(
            &'a self,
            _: &'a [(&'a str, &'a Limiter, crate::limit::Adjustment)],
            _: Option<&'a str>,
        ) -> StoreFuture<'a, Vec<crate::limit::Decision>> {
            Box::pin(std::future::pending())
        }

        fn forget<'a>(&'a self, _: &'a [&'a str]) -> StoreFuture<'a, u64> {
            Box::pin(std::future::pending())
        }
    }

    impl Slots for Stalled {
        fn release(self: Arc<Self>, key: &str, _: &Limiter, _: u64, _: Lease) {
            self.released.lock().unwrap_or_else(|p| p.into_inner()).push(key.to_owned());
        }
    }

    impl Blocks for Stalled {
        fn block<'a>(&'a self, _: &'a str, _: Duration) -> StoreFuture<'a, ()> {
            Box::pin(std::future::pending())
        }

        fn unblock<'a>(&'a self, _: &'a str) -> StoreFuture<'a, bool> {
            Box::pin(std::future::pending())
        }

        fn block_left<'a>(&'a self, _: &'a str) -> StoreFuture<'a, Option<Nanos>> {
            Box::pin(std::future::pending())
        }
    }

    impl Broadcast for Stalled {}

    impl Store for Stalled {
        fn is_shared(&self) -> bool {
            true
        }
    }

    #[tokio::test]
    async fn a_call_dropped_while_the_shared_store_decides_gives_its_slot_and_place_back() {
        let clock = ManualClock::new();
        let rules = QueueRules::new(1, 1, classes(GAP, 1));
        let metrics = Arc::new(Metrics::default());
        let q = Arc::new(FairQueue::new(rules, clock.clone()).shared_in(Arc::new(Stalled::default()), "t", metrics));
        let place = q.reserve(IMAGE, Standing::PLAIN).expect("room");
        let starting = tokio::time::timeout(Duration::from_millis(20), place.start_now(&flow("door"))).await;
        assert!(starting.is_err(), "the store never answers: the caller gives up (a client's cancel)");
        assert_eq!(q.occupancy().in_flight, 0, "the slot counted before the store was asked came back");
        let again = q.reserve(IMAGE, Standing::PLAIN).expect("the place came back");
        drop(again);
    }

    #[tokio::test]
    async fn a_job_whose_turn_is_dropped_leaves_the_line_at_once_and_only_that_entry() {
        let clock = ManualClock::new();
        let q = queue(&clock, 1);
        let held =
            q.reserve(IMAGE, Standing::PLAIN).expect("room").start_now(&flow("door")).await.expect("a free slot");
        let first = q.reserve(IMAGE, Standing::PLAIN).expect("room").enqueue(&flow("a"), "a0");
        let mut second = q.reserve(IMAGE, Standing::PLAIN).expect("room").enqueue(&flow("b"), "b0");
        assert_eq!(q.occupancy().waiting, 2);
        drop(first);
        assert_eq!(q.occupancy().waiting, 1, "the cancelled call is out of the line before any slot frees");
        assert_eq!(q.position("b0").map(|p| p.ahead), Some(0), "nobody is ahead of b0 any more");
        drop(held);
        let slot = granted(&mut second).await.expect("the freed slot goes to the one still waiting");
        drop(slot);
        // A turn that got its slot has nothing to take out: the next job under that id stays.
        let mut retried = q.requeue_front(&flow("b"), "b0", IMAGE, 0);
        drop(second);
        assert!(granted(&mut retried).await.is_some(), "a retry under the same id is not taken out");
    }

    #[tokio::test]
    async fn a_full_queue_refuses_and_unused_places_come_back() {
        let clock = ManualClock::new();
        let rules = QueueRules::new(1, 3, classes(GAP, 1));
        let q = Arc::new(FairQueue::new(rules, clock.clone()));
        let video = q.reserve(VIDEO, Standing::PLAIN).expect("room");
        assert!(q.reserve(VIDEO, Standing::PLAIN).is_err(), "one video may wait");
        let _i1 = q.reserve(IMAGE, Standing::PLAIN).expect("room");
        let i2 = q.reserve(IMAGE, Standing::PLAIN).expect("room");
        assert!(q.reserve(IMAGE, Standing::PLAIN).is_err(), "three places in all");
        drop(i2);
        assert!(q.reserve(IMAGE, Standing::PLAIN).is_ok(), "an unused reservation gives its place back");
        drop(video);
    }

    /// A queue of `slots` slots and `places` places whose tier `pro` is reserved `pro` of both,
    /// `admin` ranks 2 and `guest` -1.
    fn tiered(clock: &Arc<ManualClock>, slots: usize, places: usize, pro: f64) -> Arc<FairQueue> {
        let tiers = vec![
            TierRule { name: "admin".into(), reserved: 0.0, rank: 2 },
            TierRule { name: "guest".into(), reserved: 0.0, rank: -1 },
            TierRule { name: "pro".into(), reserved: pro, rank: 0 },
        ];
        let rules = QueueRules::new(slots, places, classes(GAP, 100)).with_tiers(tiers);
        let queue = Arc::new(FairQueue::new(rules, clock.clone()));
        tokio::spawn(queue.clone().dispatch(CancellationToken::new()));
        queue
    }

    #[tokio::test]
    async fn a_reserved_slot_is_lent_while_its_tier_waits_for_none_and_comes_back_at_the_next_free_slot() {
        let clock = ManualClock::new();
        let q = tiered(&clock, 2, 20, 0.5);
        let pro = q.rules().standing("pro", false);
        let free = Standing::PLAIN;
        let first = q.reserve(IMAGE, free).expect("room").start_now(&flow("door")).await.expect("a free slot");
        let _second = q
            .reserve(IMAGE, free)
            .expect("room")
            .start_now(&flow("door"))
            .await
            .expect("pro's slot, lent: nobody of pro waits");
        let mut flood = Vec::new();
        for i in 0..5 {
            flood.push(q.reserve(IMAGE, free).expect("room").enqueue(&flow("free"), &format!("f{i}")));
        }
        let mut mine = q.reserve(IMAGE, pro).expect("room").enqueue(&Flowing { standing: pro, ..flow("pro") }, "p0");
        assert_eq!(q.occupancy().per_tier[2].waiting, 1);
        assert_eq!(q.position("p0").map(|p| p.ahead), Some(0), "pro is next, however many free jobs wait");
        assert_eq!(q.position("f0").map(|p| p.ahead), Some(1), "pro goes before the free tier's first");
        drop(first);
        let slot = granted(&mut mine).await.expect("the next slot that frees goes to pro, owed one");
        assert_eq!(q.occupancy().per_tier[2].in_flight, 1);
        for turn in &mut flood {
            assert!(granted(turn).await.is_none(), "the free tier waits");
        }
        drop(slot);
        assert!(granted(&mut flood[0]).await.is_some(), "pro's slot, lent again once pro waits for none");
    }

    #[tokio::test]
    async fn when_the_account_is_full_the_highest_rank_goes_first_and_ranks_alike_take_turns() {
        let clock = ManualClock::new();
        let q = tiered(&clock, 1, 20, 0.0);
        let held =
            q.reserve(IMAGE, Standing::PLAIN).expect("room").start_now(&flow("door")).await.expect("a free slot");
        let mut turns = Vec::new();
        for (tier, flow_name, id) in
            [("guest", "g", "g0"), ("default", "d", "d0"), ("default", "e", "e0"), ("admin", "a", "a0")]
        {
            let standing = q.rules().standing(tier, false);
            let place = q.reserve(IMAGE, standing).expect("room");
            turns.push((id, place.enqueue(&Flowing { standing, ..flow(flow_name) }, id)));
        }
        assert_eq!(q.position("a0").map(|p| p.ahead), Some(0));
        assert_eq!(q.position("g0").map(|p| p.ahead), Some(3), "the lowest rank goes last");
        drop(held);
        let mut order = Vec::new();
        while !turns.is_empty() {
            let mut next = None;
            for (i, (id, turn)) in turns.iter_mut().enumerate() {
                if let Some(slot) = granted(turn).await {
                    next = Some((i, *id, slot));
                    break;
                }
            }
            let (i, id, slot) = next.expect("someone is served");
            order.push(id);
            drop(turns.remove(i));
            drop(slot);
        }
        assert_eq!(order, ["a0", "d0", "e0", "g0"]);
    }

    #[tokio::test]
    async fn a_reserved_tiers_places_are_never_taken_by_another_and_an_unverified_caller_draws_on_none() {
        let clock = ManualClock::new();
        let q = tiered(&clock, 1, 10, 0.5);
        let pro = q.rules().standing("pro", false);
        assert_eq!(q.rules().standing("pro", true).reserved_tier(), None, "a made-up key proves no tier");
        let mut places = Vec::new();
        for _ in 0..5 {
            places.push(q.reserve(IMAGE, Standing::PLAIN).expect("an unreserved place"));
        }
        assert_eq!(q.reserve(IMAGE, Standing::PLAIN).err(), Some(QueueFull::Reserved), "the other five are pro's");
        assert_eq!(q.reserve(IMAGE, Standing::plain(true)).err(), Some(QueueFull::Reserved));
        for _ in 0..5 {
            places.push(q.reserve(IMAGE, pro).expect("pro's own place"));
        }
        assert_eq!(q.reserve(IMAGE, pro).err(), Some(QueueFull::Full));
        places.truncate(4);
        assert!(q.reserve(IMAGE, Standing::PLAIN).is_ok(), "a place given back is anyone's again");
    }

    #[test]
    fn a_removed_job_leaves_the_line_and_weights_give_a_heavier_flow_more_turns() {
        let mut state = State::new(&QueueRules::new(100, 100, classes(GAP, 100)));
        let push = |state: &mut State, flow: &str, q: f64, id: &str| {
            let (turn, _) = oneshot::channel();
            let job = Waiting::new(id, IMAGE, Standing::PLAIN, 0, turn);
            state.push(flow, q, job, false);
        };
        for i in 0..8 {
            push(&mut state, "heavy", 3.0, &format!("h{i}"));
            push(&mut state, "light", 1.0, &format!("l{i}"));
        }
        assert!(state.remove("l7"));
        let served: Vec<String> =
            (0..8).filter_map(|_| state.pick(&QueueRules::new(100, 100, classes(GAP, 100)), 0)).map(|w| w.id).collect();
        assert_eq!(served.iter().filter(|id| id.starts_with('h')).count(), 6, "3:1 by weight: {served:?}");
    }
}
