//! Jobs: image and video predictions, from the tool call that accepted them until they are final.
//!
//! A job holds the caller's in-flight slots (whatever its admission took: the per-caller and
//! per-tenant job caps) from acceptance until it is `succeeded`, `failed` or `canceled`, or
//! expires. The server learns that by **polling the upstream itself**, in a background task per
//! job, at the job's own hint — not only when an agent polls — so a job its agent forgot still
//! gives its slot back. An agent's `get_prediction` never reaches the upstream: it is answered
//! from the book, and a poll that arrives while the background poll it was told to wait for is
//! still in flight waits for that answer instead of making a second request.
//!
//! Over a shared store (Redis) the book is also published: every change of a job marks it for
//! one writer per instance (the publisher, [`Jobs::published_in`]), which writes the job's
//! snapshot (owner, state, when to poll next) to Redis and keeps the shared set of jobs in flight
//! in step. It writes the job's *current* state, one job after another, so an older state can
//! never land after a newer one; a write Redis does not take (it is down) leaves the job marked,
//! and is tried again with a backoff until Redis takes it. In Redis a final snapshot is never
//! replaced, nor a snapshot by an older version of itself (`record.lua`), so a cancel written by
//! another instance is not undone by the owner's next write. An agent whose next session lands
//! on another instance can still poll its job there, and cancel it: a started job is cancelled
//! upstream (the owning instance sees it at its next poll and gives the slots back); a job still
//! waiting in the owning instance's queue is cancelled by that instance, which reads the cancel
//! requests left for it in Redis a few times a second ([`Jobs::answer_cancel_requests`]) and
//! publishes the canceled job, which the asking instance waits for.
//!
//! Every job also needs one of the upstream *account's* slots, from the [`FairQueue`]. A job of a
//! class without a gap (an image) that finds one free (and nobody waiting) is submitted in the tool
//! call itself — one attempt: a 429 goes back to the agent with its wait. Any other job — every
//! video (its class is spaced by the queue), and an image while the account is full — is accepted
//! at once with a `predict_id` of our own and waits its turn; its task then submits it, retrying
//! 429s, 5xx and timeouts with [`Backoff`] under the [`RetryBudget`] — work the server owns. The
//! submission carries the `predict_id` as its idempotency key, so a retry after a lost answer
//! cannot start (and bill) a second job.

use std::any::Any;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use rand::Rng;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::clock::{NANOS_PER_SEC, Nanos, SharedClock};
use crate::guard::{Handed, Reserved, Used};
use crate::metrics::Metrics;
use crate::store::StoreError;
use crate::store::{JobMirror, Store};
use crate::upstream::api::{NewPrediction, Prediction, PredictionKind, PredictionStatus};
use crate::upstream::backoff::{Backoff, Retry, RetryBudget};
use crate::upstream::classes::ClassId;
use crate::upstream::queue::{
    AccountSlot, FairQueue, Flowing, Position, QueueFull, QueueRules, Reservation, Standing, Turn,
};
use crate::upstream::{Upstream, UpstreamError};

mod mirror;

use mirror::{Outbox, unix_ms};

/// Final jobs are remembered this long after their last change, so a late poll still reads
/// the result (and re-reading it stays free).
const KEEP_FOR: Nanos = 3_600 * NANOS_PER_SEC;
/// The set of `predict_id`s of jobs not yet final on any instance, so an operator on one
/// instance can list the others' (their snapshots say the rest).
const IN_FLIGHT_KEY: &str = "{upstream}job:in_flight";
/// The set of `predict_id`s whose cancel was asked on an instance that does not hold them.
const CANCEL_REQUESTS_KEY: &str = "{upstream}job:cancel_requests";
/// How often an instance with queued jobs reads the cancel requests (wall clock: instances share
/// no other).
pub const CANCEL_REQUESTS_EVERY: Duration = Duration::from_millis(200);
/// How long an instance that asked another to cancel a queued job waits to see it canceled.
const CANCEL_CONFIRM: Duration = Duration::from_secs(3);
/// How soon the publisher writes again after Redis did not take a write, doubling each time up
/// to [`REPUBLISH_AT_MOST`] (wall clock: it waits on Redis, not on the jobs).
const REPUBLISH_FIRST: Duration = Duration::from_millis(100);
/// The longest the publisher waits between two tries: as often as the store breaker probes.
const REPUBLISH_AT_MOST: Duration = Duration::from_secs(1);

/// Whatever a job's admission holds (its in-flight slots); dropped when the job is final.
pub type Slots = Box<dyn Any + Send + Sync>;

/// A job waiting its turn in the queue, with what its submission needs.
struct Queued {
    /// The tool that asked for it (its upstream requests are counted under that tool).
    tool: String,
    job: NewPrediction,
    turn: Turn,
}

/// Who a job belongs to, and where it queues.
#[derive(Debug, Clone)]
pub struct Owner {
    /// The caller id (only the owner may read or cancel the job).
    pub caller: String,
    /// The caller's tenant, if any.
    pub tenant: Option<String>,
    /// The fair queue's flow: the tenant, the address of an unverified caller (all of whose
    /// unverified callers are one flow), or the caller.
    pub flow: String,
    /// The flow's weight in the round robin (the caller's tier factor).
    pub weight: f64,
    /// Where its jobs stand in the queue: a caller without a configured key's are held to the
    /// unverified share of the account's slots and queue; a tier's draw on its reservation and go
    /// by its rank.
    pub standing: Standing,
}

impl Owner {
    /// `caller` as an owner: its flow is its tenant, its address for an unverified caller (all
    /// of whose unverified callers are one flow), or the caller, weighted by its tier's factor in
    /// `policy`, standing by its tier as the queue's `rules` say.
    pub fn of(caller: &crate::identity::Caller, policy: &crate::guard::Policy, rules: &QueueRules) -> Self {
        let flow = match (caller.tenant(), caller.unverified_from()) {
            (Some(tenant), _) => format!("tenant:{tenant}"),
            (None, Some(address)) => format!("address:{address}"),
            (None, None) => format!("caller:{}", caller.id()),
        };
        Owner {
            caller: caller.id().to_owned(),
            tenant: caller.tenant().map(str::to_owned),
            flow,
            weight: policy.factor_of(caller),
            standing: rules.standing(caller.tier(), caller.unverified_from().is_some()),
        }
    }

    /// The flow its jobs wait in.
    pub fn flowing(&self) -> Flowing<'_> {
        Flowing { name: &self.flow, quantum: self.weight, standing: self.standing }
    }
}

/// The fixed parameters of job handling, from `[upstream]` (each class's poll hint is the
/// class's: [`crate::upstream::classes::JobClass::poll_hint`]).
#[derive(Debug, Clone)]
pub struct JobRules {
    /// How soon an account slot may free up when no running job says when: the unit of a queue
    /// wait's estimate (the image poll hint).
    pub turnover: Nanos,
    /// A job still pending this long after acceptance is failed.
    pub expiry: Nanos,
    /// Retries of server-owned requests.
    pub backoff: Backoff,
    /// How long an agent's poll waits for a background poll already in flight (the upstream
    /// request timeout, and a little more).
    pub refresh_wait: Duration,
}

struct Job {
    owner: Owner,
    /// The class it queues as, whose poll hint it follows.
    class: ClassId,
    upstream_id: Option<String>,
    /// The last state, with `id` = the `predict_id` agents see.
    last: Prediction,
    next_poll_at: Nanos,
    updated_at: Nanos,
    expires_at: Nanos,
    created: SystemTime,
    /// The admission's slots and, once submitted, the account slot.
    slots: Vec<Slots>,
    /// The price the call that started it reserved, settled when the job is final.
    reservation: Option<Reserved>,
    /// A submission of it was sent and never answered (a timeout, a broken connection): the
    /// upstream may have started it, though it never said so.
    may_have_run: bool,
    /// Units reserved, and charged once settled, as the agent is shown them.
    reserved: Option<u64>,
    charged: Option<u64>,
    cancel: CancellationToken,
    changed: watch::Sender<u64>,
    /// Snapshots of it the publisher has made: the version of the latest.
    published: u64,
    /// Whether the shared set of jobs in flight is known to hold it.
    indexed: bool,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job").field("id", &self.last.id).field("status", &self.last.status).finish_non_exhaustive()
    }
}

/// A job as its owner sees it.
#[derive(Debug, Clone)]
pub struct JobView {
    /// The last known state; `prediction.id` is the `predict_id`.
    pub prediction: Prediction,
    /// While pending: how long until asking again is worth it (covers the queue wait).
    pub wait: Option<Nanos>,
    /// While queued for submission: jobs ahead of it.
    pub queue_ahead: Option<usize>,
    /// When the job was accepted (wall clock, for MCP Tasks' `createdAt`).
    pub created: SystemTime,
    /// Units its call reserved, if it had a price.
    pub reserved: Option<u64>,
    /// Units it was charged, once final and settled (see [`crate::guard::settle`]).
    pub charged: Option<u64>,
}

impl JobView {
    /// Whether the job is still going.
    pub fn is_pending(&self) -> bool {
        !self.prediction.status.is_terminal()
    }
}

/// Every job this instance accepted.
#[derive(Debug)]
pub struct Jobs {
    upstream: Arc<Upstream>,
    clock: SharedClock,
    metrics: Arc<Metrics>,
    queue: Arc<FairQueue>,
    retry_budget: RetryBudget,
    rules: JobRules,
    book: Arc<Mutex<Book>>,
    stop: CancellationToken,
    /// Where snapshots of the book are published for the other instances.
    shared: Option<Arc<dyn JobMirror>>,
    /// The shared store the prices of a dead instance's jobs are given back in.
    settle_in: Option<Arc<dyn Store>>,
    /// The jobs whose snapshot Redis does not have yet.
    outbox: Arc<Outbox>,
    /// Jobs of other instances an agent polled here and found pending, (owner, id) → until when
    /// (on the book's clock) their polls are not a loop, as a local job's are not.
    pending_elsewhere: Mutex<HashMap<(String, String), Nanos>>,
}

type Book = HashMap<String, Job>;

/// How long a job of another instance found pending stays known as such without another poll.
const PENDING_ELSEWHERE_FOR: Nanos = 600 * NANOS_PER_SEC;

/// The most jobs of other instances remembered as pending: past it, new ones are not (their
/// polls count towards a loop, as before).
const PENDING_ELSEWHERE_MAX: usize = 10_000;

fn lock_book(book: &Mutex<Book>) -> MutexGuard<'_, Book> {
    // Jobs are replaced field by field under the lock, never left half-written.
    book.lock().unwrap_or_else(|p| p.into_inner())
}

/// What a submission's answer teaches the account's adaptive limit through the slot it used: the
/// upstream took the job, or said 429 (anything else says nothing of its capacity).
async fn learn_from(account: &AccountSlot, answer: &Result<Prediction, UpstreamError>) {
    match answer {
        Ok(_) => account.accepted().await,
        Err(UpstreamError::RateLimited { .. }) => account.overloaded().await,
        Err(_) => {}
    }
}

fn nanos(d: Duration) -> Nanos {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// A fresh `predict_id` for a job the upstream has not named yet.
fn new_id(prefix: &str) -> String {
    let mut rng = rand::rng();
    format!("{prefix}_{:016x}{:08x}", rng.random::<u64>(), rng.random::<u32>())
}

impl Jobs {
    /// The job book over `upstream`, whose account's slots `queue` hands out.
    pub fn new(
        upstream: Arc<Upstream>,
        queue: Arc<FairQueue>,
        retry_budget: RetryBudget,
        rules: JobRules,
        clock: SharedClock,
        metrics: Arc<Metrics>,
        stop: CancellationToken,
    ) -> Self {
        let book = Arc::new(Mutex::new(HashMap::new()));
        let outbox = Arc::default();
        let pending_elsewhere = Mutex::default();
        Self {
            upstream,
            clock,
            metrics,
            queue,
            retry_budget,
            rules,
            book,
            stop,
            shared: None,
            settle_in: None,
            outbox,
            pending_elsewhere,
        }
    }

    fn book(&self) -> MutexGuard<'_, Book> {
        lock_book(&self.book)
    }

    /// How long after a change a job of `class` is worth polling.
    fn hint(&self, class: ClassId) -> Nanos {
        self.queue.rules().classes.get(class).map_or(self.rules.turnover, |c| c.poll_hint)
    }

    /// The queue in front of the upstream account.
    pub fn queue(&self) -> &FairQueue {
        &self.queue
    }

    /// Promises a place in the queue for a job of `class` standing as `standing` (of an
    /// unverified caller: within their share; never one a reserved tier is owed) before the call
    /// is charged, or says why there is none and how long until one frees up.
    pub fn reserve(&self, class: ClassId, standing: Standing) -> Result<Reservation, (QueueFull, Nanos)> {
        self.queue.reserve(class, standing).map_err(|full| (full, self.place_frees_in()))
    }

    /// Starts the job `job` that `tool` asked for, for `owner`, holding `slots` until it is final,
    /// and returns at once. A job of a class without a gap that finds an account slot free is
    /// submitted now, in one attempt (the agent gets any refusal with its wait); anything else
    /// waits its turn in the place `place` holds (for a job of its class).
    pub async fn start(
        self: &Arc<Self>,
        owner: &Owner,
        tool: &str,
        job: NewPrediction,
        place: Reservation,
        slots: Slots,
    ) -> Result<JobView, UpstreamError> {
        let class = place.class();
        let place = match place.start_now(&owner.flowing()).await {
            Ok(account) => return self.submit_now(owner, tool, class, job, slots, account).await,
            Err(place) => place,
        };
        let prefix = self.queue.rules().classes.get(class).map_or("", |c| c.id_prefix);
        let id = new_id(prefix);
        let kind = job.kind;
        let waiting = Prediction {
            id: id.clone(),
            kind,
            status: PredictionStatus::Starting,
            output: None,
            error: None,
            usage: None,
        };
        self.insert(owner, class, None, waiting, vec![slots]);
        let turn = place.enqueue(&owner.flowing(), &id);
        self.spawn(id.clone(), Some(Queued { tool: tool.to_owned(), job, turn }));
        Ok(self.view_of(&id).unwrap_or_else(|| unreachable_view(&id, kind)))
    }

    async fn submit_now(
        self: &Arc<Self>,
        owner: &Owner,
        tool: &str,
        class: ClassId,
        job: NewPrediction,
        slots: Slots,
        account: AccountSlot,
    ) -> Result<JobView, UpstreamError> {
        let answer = self.upstream.create_prediction(&job, &new_id("k")).await;
        self.metrics.upstream(tool, UpstreamError::outcome_of(&answer));
        learn_from(&account, &answer).await;
        let prediction = answer?;
        let id = prediction.id.clone();
        self.insert(owner, class, Some(id.clone()), prediction, vec![slots, Box::new(account)]);
        self.spawn(id.clone(), None);
        Ok(self.view_of(&id).unwrap_or_else(|| unreachable_view(&id, job.kind)))
    }

    fn insert(&self, owner: &Owner, class: ClassId, upstream_id: Option<String>, last: Prediction, slots: Vec<Slots>) {
        let now = self.clock.now();
        let job = Job {
            owner: owner.clone(),
            class,
            upstream_id,
            next_poll_at: now.saturating_add(self.hint(class)),
            updated_at: now,
            expires_at: now.saturating_add(self.rules.expiry),
            created: SystemTime::now(),
            slots,
            reservation: None,
            may_have_run: false,
            reserved: None,
            charged: None,
            cancel: CancellationToken::new(),
            changed: watch::Sender::new(0),
            published: 0,
            indexed: false,
            last,
        };
        let id = job.last.id.clone();
        self.book().insert(id.clone(), job);
        self.publish(&id);
    }

    fn spawn(self: &Arc<Self>, id: String, queued: Option<Queued>) {
        let Some((cancel, expires_at)) = self.book().get(&id).map(|j| (j.cancel.clone(), j.expires_at)) else {
            return;
        };
        let jobs = self.clone();
        // A queued job's wait and submission, and the polls that watch it, belong to the trace of
        // the call that started it.
        let queue_span = match &queued {
            Some(_) => queue_span(),
            None => tracing::Span::none(),
        };
        let watch_span = watch_span();
        tokio::spawn(async move {
            let stop = jobs.stop.clone();
            let work = async {
                if let Some(queued) = queued
                    && !jobs.submit_queued(&id, queued).instrument(queue_span).await
                {
                    return;
                }
                jobs.watch(&id).instrument(watch_span).await;
            };
            tokio::select! {
                () = work => {}
                () = cancel.cancelled() => {}
                () = stop.cancelled() => {}
                () = jobs.clock.sleep_until(expires_at) => jobs.expire(&id).await,
            }
        });
    }

    /// Submits a queued job when its turn comes; `false` if it ended instead.
    async fn submit_queued(&self, id: &str, queued: Queued) -> bool {
        let Queued { tool, job, mut turn } = queued;
        let Some((owner, class)) = self.book().get(id).map(|j| (j.owner.clone(), j.class)) else { return false };
        let queued_at = self.clock.now();
        let retry_at = |not_before: Nanos| self.queue.requeue_front(&owner.flowing(), id, class, not_before);
        let mut failed = 0;
        let mut sent = false;
        loop {
            // The sender is dropped when the job leaves the line (cancelled, expired).
            let Ok(account) = turn.await else { return false };
            let span = tracing::Span::current();
            if !span.is_disabled() {
                let waited_ms = self.clock.now().saturating_sub(queued_at) / crate::clock::NANOS_PER_MS;
                span.record("upstream.queue.waited_ms", waited_ms);
                span.record("upstream.queue.tries", u32::saturating_add(failed, 1));
            }
            // Ended by another instance while it waited (this one was taken for dead): never sent,
            // so its agent, told it failed, is never billed for it.
            if let Some(ended) = self.ended_elsewhere(id).await {
                drop(account);
                if ended.given_back
                    && let Some(job) = self.book().get_mut(id)
                {
                    // Given back by the instance that ended it: settled once, there.
                    job.reservation = None;
                    job.charged = Some(0);
                }
                self.fail(id, ended.reason);
                return false;
            }
            let answer = self.upstream.create_prediction(&job, id).await;
            self.metrics.upstream(&tool, UpstreamError::outcome_of(&answer));
            learn_from(&account, &answer).await;
            let now = self.clock.now();
            // The budget is a share of the submissions the upstream actually received lately,
            // counted when the first one goes out, so a long queue does not bank retries.
            if !matches!(answer, Err(UpstreamError::CircuitOpen { .. })) && !std::mem::replace(&mut sent, true) {
                self.retry_budget.record_request(now);
            }
            match answer {
                Ok(prediction) => {
                    self.started(id, prediction, account);
                    return true;
                }
                Err(UpstreamError::CircuitOpen { retry_after }) => {
                    // Nothing was sent: wait out the cool-down without spending an attempt.
                    drop(account);
                    turn = retry_at(now.saturating_add(retry_after));
                }
                Err(error) if error.is_transient() => {
                    // Nothing runs upstream while we back off: the slot goes to the next job.
                    drop(account);
                    if error.may_have_run()
                        && let Some(job) = self.book().get_mut(id)
                    {
                        job.may_have_run = true;
                    }
                    failed += 1;
                    let next = self.backoff_after(failed, &error);
                    match next {
                        Retry::After(delay) if self.retry_budget.try_retry(now) => {
                            self.metrics.upstream_retry("submission", error.outcome());
                            turn = retry_at(now.saturating_add(nanos(delay)));
                        }
                        Retry::After(_) => {
                            self.fail(id, format!("the upstream failed ({error}) and the retry budget is spent"));
                            return false;
                        }
                        Retry::GiveUp(why) => {
                            self.fail(id, format!("could not submit the job: {why} (last answer: {error})"));
                            return false;
                        }
                    }
                }
                Err(error) => {
                    self.fail(id, format!("the upstream refused the job: {error}"));
                    return false;
                }
            }
        }
    }

    fn backoff_after(&self, failed: u32, error: &UpstreamError) -> Retry {
        let retry_after = match error {
            UpstreamError::RateLimited { retry_after } => *retry_after,
            _ => None,
        };
        self.rules.backoff.after_failure(failed, retry_after, &mut rand::rng())
    }

    /// Polls the upstream at the job's hint until the job is final.
    async fn watch(&self, id: &str) {
        let mut failed = 0;
        loop {
            let Some((upstream_id, due)) = self.book().get(id).and_then(|j| {
                let pending = !j.last.status.is_terminal();
                j.upstream_id.clone().filter(|_| pending).map(|u| (u, j.next_poll_at))
            }) else {
                return;
            };
            self.clock.sleep_until(due).await;
            let answer = self.upstream.get_prediction(&upstream_id).await;
            self.metrics.upstream("get_prediction", UpstreamError::outcome_of(&answer));
            match answer {
                Ok(prediction) => {
                    failed = 0;
                    if self.update(id, prediction) {
                        return;
                    }
                }
                Err(UpstreamError::CircuitOpen { retry_after }) => self.poll_again_in(id, retry_after),
                Err(UpstreamError::NotFound) => {
                    self.fail(id, "the upstream no longer knows this job".to_owned());
                    return;
                }
                Err(error) => {
                    failed += 1;
                    let next = self.backoff_after(failed, &error);
                    match next {
                        Retry::After(delay) => {
                            self.metrics.upstream_retry("poll", error.outcome());
                            self.poll_again_in(id, nanos(delay));
                        }
                        Retry::GiveUp(why) => {
                            self.fail(id, format!("lost track of the job: {why} (last answer: {error})"));
                            return;
                        }
                    }
                }
            }
        }
    }

    /// Records the upstream's answer to a submission; the job holds `account` from now on.
    fn started(&self, id: &str, prediction: Prediction, account: AccountSlot) {
        let upstream_id = prediction.id.clone();
        if let Some(job) = self.book().get_mut(id) {
            job.upstream_id = Some(upstream_id);
            job.slots.push(Box::new(account));
        }
        self.update(id, prediction);
    }

    /// Records what the upstream said about `id`; releases its slots when it is final. Returns
    /// whether it is final.
    fn update(&self, id: &str, mut prediction: Prediction) -> bool {
        let now = self.clock.now();
        let released;
        let is_final;
        let mut to_settle = None;
        {
            let mut book = self.book();
            let Some(job) = book.get_mut(id) else { return true };
            if job.last.status.is_terminal() {
                return true;
            }
            prediction.id = id.to_owned();
            job.next_poll_at = now.saturating_add(self.hint(job.class));
            job.updated_at = now;
            is_final = prediction.status.is_terminal();
            job.last = prediction;
            released = if is_final { std::mem::take(&mut job.slots) } else { Vec::new() };
            if is_final && let Some(reservation) = job.reservation.take() {
                to_settle = Some((reservation, used_by(job)));
            }
            job.changed.send_modify(|v| *v += 1);
        }
        // Slots go back outside the book's lock: releasing takes the store's locks.
        drop(released);
        match to_settle {
            // Published once settled: a final snapshot is never replaced, so it carries `charged`.
            Some((reservation, used)) => self.settle_price(id, reservation, used),
            None => self.publish(id),
        }
        is_final
    }

    /// Hands job `id` the price its call reserved, to settle when it is final (at once if it
    /// already is); the units reserved, as the agent is shown them.
    pub fn bill(&self, id: &str, reservation: Reserved) -> u64 {
        let units = reservation.units();
        let mut book = self.book();
        let Some(job) = book.get_mut(id) else {
            // Gone already (swept, or never kept): nobody says what it used.
            drop(book);
            self.settle_price(id, reservation, Used::Unreported);
            return units;
        };
        job.reserved = Some(units);
        if !job.last.status.is_terminal() {
            job.reservation = Some(reservation);
            drop(book);
            // Its snapshot carries the reservation now, for another instance to give back if
            // this one dies while it waits.
            self.publish(id);
            return units;
        }
        let used = used_by(job);
        drop(book);
        self.settle_price(id, reservation, used);
        units
    }

    /// Settles a final job's price in a task of its own (it awaits the store), and only then says
    /// what it was charged: what the store settled, or, when it could not, the reservation that
    /// stands.
    fn settle_price(&self, id: &str, reservation: Reserved, used: Used) {
        let (book, id) = (self.book.clone(), id.to_owned());
        let outbox = self.outbox.clone();
        let publish = self.shared.is_some();
        tokio::spawn(async move {
            let settled = reservation.settle(used).await;
            if let Some(job) = lock_book(&book).get_mut(&id) {
                job.charged = Some(settled.charged);
                job.changed.send_modify(|v| *v += 1);
            }
            if publish {
                outbox.mark(&id);
            }
        });
    }

    fn poll_again_in(&self, id: &str, delay: Nanos) {
        if let Some(job) = self.book().get_mut(id) {
            job.next_poll_at = self.clock.now().saturating_add(delay);
            job.changed.send_modify(|v| *v += 1);
        }
        self.publish(id);
    }

    /// Ends `id` with `status` on our own word (the upstream said nothing of it: canceled in
    /// the queue, given up, expired).
    fn end(&self, id: &str, status: PredictionStatus, error: Option<String>) {
        let Some(kind) = self.book().get(id).map(|j| j.last.kind) else { return };
        self.update(id, Prediction { id: id.to_owned(), kind, status, output: None, error, usage: None });
    }

    fn fail(&self, id: &str, reason: String) {
        tracing::warn!(predict_id = id, reason, "job failed");
        self.end(id, PredictionStatus::Failed, Some(reason));
    }

    /// A job pending past its expiry: failed, its slots freed, and cancelled upstream so it
    /// stops holding the account's capacity too.
    async fn expire(&self, id: &str) {
        let upstream_id = self.book().get(id).filter(|j| !j.last.status.is_terminal()).map(|j| j.upstream_id.clone());
        let Some(upstream_id) = upstream_id else { return };
        self.queue.remove(id);
        let secs = self.rules.expiry / NANOS_PER_SEC;
        self.fail(id, format!("the job did not finish within {secs} seconds and was given up"));
        if let Some(upstream_id) = upstream_id {
            let answer = self.upstream.cancel_prediction(&upstream_id).await;
            self.metrics.upstream("cancel_prediction", UpstreamError::outcome_of(&answer));
        }
    }

    /// Cancels `owner`'s job `id`, upstream too, and frees its slots at once. `Ok(None)`: no
    /// such job for this owner. An upstream that cannot be reached keeps the job (and its
    /// slot) as it was: the refusal goes back to the agent.
    pub async fn cancel(&self, owner: &str, id: &str) -> Result<Option<JobView>, UpstreamError> {
        let local = self.book().get(id).map(|job| {
            let mine = job.owner.caller == owner;
            (mine, (!job.last.status.is_terminal()).then(|| job.upstream_id.clone()))
        });
        let upstream_id = match local {
            None => return self.cancel_elsewhere(owner, id).await,
            Some((false, _)) => return Ok(None),
            Some((true, upstream_id)) => upstream_id,
        };
        match upstream_id {
            None => {}
            // Still queued (or being submitted): leaving the line is enough.
            Some(None) => {
                self.queue.remove(id);
                self.end(id, PredictionStatus::Canceled, None);
            }
            Some(Some(upstream_id)) => {
                let answer = self.upstream.cancel_prediction(&upstream_id).await;
                self.metrics.upstream("cancel_prediction", UpstreamError::outcome_of(&answer));
                match answer {
                    // Finished before the cancel arrived: keep the real outcome.
                    Ok(prediction) if prediction.status.is_terminal() => {
                        self.update(id, prediction);
                    }
                    Ok(_) | Err(UpstreamError::NotFound) => self.end(id, PredictionStatus::Canceled, None),
                    Err(error) => return Err(error),
                }
            }
        }
        if let Some(job) = self.book().get(id) {
            job.cancel.cancel();
        }
        Ok(self.view_of(id))
    }

    /// `owner`'s job `id`, as it stands; `None` for someone else's job or none at all.
    pub fn view(&self, owner: &str, id: &str) -> Option<JobView> {
        self.book().get(id).filter(|j| j.owner.caller == owner)?;
        self.view_of(id)
    }

    fn view_of(&self, id: &str) -> Option<JobView> {
        let now = self.clock.now();
        let book = self.book();
        let job = book.get(id)?;
        let pending = !job.last.status.is_terminal();
        let queued = if pending && job.upstream_id.is_none() { self.queue.position(id) } else { None };
        let class = job.class;
        let wait = pending.then(|| match (&job.upstream_id, queued) {
            // Not submitted yet: the time in the queue, then the first useful poll.
            (None, Some(place)) => self.queue_wait(&book, class, place, now).saturating_add(self.hint(class)),
            (None, None) => self.hint(class),
            (Some(_), _) => job.next_poll_at.saturating_sub(now),
        });
        Some(JobView {
            prediction: job.last.clone(),
            wait,
            queue_ahead: queued.map(|p| p.ahead),
            created: job.created,
            reserved: job.reserved,
            charged: job.charged,
        })
    }

    /// When the server will next hear from the upstream about a running job: how soon an
    /// account slot may come back.
    fn turnover(book: &HashMap<String, Job>, now: Nanos) -> Option<Nanos> {
        book.values()
            .filter(|j| j.upstream_id.is_some() && !j.last.status.is_terminal())
            .map(|j| j.next_poll_at.saturating_sub(now))
            .min()
    }

    /// What a job of `class` waiting at `place` may expect to wait for its turn: its class's
    /// gaps ahead of it, if the class has one, and — when more jobs are ahead than the account has
    /// free slots — until a running job is seen to end, plus one turnover per further account's
    /// worth of jobs ahead. An estimate: every poll recomputes it.
    fn queue_wait(&self, book: &HashMap<String, Job>, class: ClassId, place: Position, now: Nanos) -> Nanos {
        let rules = self.queue.rules();
        let gaps = match rules.classes.get(class).and_then(|c| c.min_gap) {
            Some(gap) => {
                let gap_left = self.queue.next_at(class).saturating_sub(now);
                gap_left.saturating_add(gap.saturating_mul(place.alike_ahead as u64))
            }
            None => 0,
        };
        let free = rules.max_in_flight.saturating_sub(self.queue.occupancy().in_flight);
        let account = if place.ahead < free {
            0
        } else {
            let rounds = ((place.ahead - free) / rules.max_in_flight.max(1)) as u64;
            let first = Self::turnover(book, now).unwrap_or(self.rules.turnover);
            first.saturating_add(self.rules.turnover.saturating_mul(rounds))
        };
        gaps.max(account)
    }

    /// How long until a full queue has room: until a job may leave it — when an account slot
    /// frees up (if none is free) and, while jobs of a class with a gap wait, when its gap has
    /// passed.
    fn place_frees_in(&self) -> Nanos {
        let now = self.clock.now();
        let account_full = self.queue.occupancy().in_flight >= self.queue.slots();
        let turnover = if account_full { Self::turnover(&self.book(), now).unwrap_or(self.rules.turnover) } else { 0 };
        turnover.max(self.queue.gaps_left(now)).max(1)
    }

    /// An agent's poll: the job as it stands, never a request to the upstream. When the
    /// background poll the agent was told to wait for is due or in flight, waits (a bounded
    /// time) for its answer, so an obedient agent reads fresh state.
    pub async fn poll(&self, owner: &str, id: &str) -> Option<JobView> {
        let give_up = tokio::time::Instant::now() + self.rules.refresh_wait.min(crate::clock::LONGEST_WAIT);
        loop {
            let local = self.book().get(id).map(|j| j.owner.caller == owner);
            match local {
                // Accepted by another instance: its published state.
                None => {
                    let view = self.published(owner, id).await.map(Self::view_of_snapshot);
                    self.heard_elsewhere(owner, id, view.as_ref().is_some_and(JobView::is_pending));
                    return view;
                }
                Some(false) => return None,
                Some(true) => {}
            }
            let mut changed = {
                let book = self.book();
                let job = book.get(id).filter(|j| j.owner.caller == owner)?;
                let due =
                    !job.last.status.is_terminal() && job.upstream_id.is_some() && self.clock.now() >= job.next_poll_at;
                if !due {
                    drop(book);
                    return self.view_of(id);
                }
                job.changed.subscribe()
            };
            if tokio::time::timeout_at(give_up, changed.changed()).await.is_err() {
                return self.view_of(id);
            }
        }
    }

    /// Whether `owner`'s job `id` exists and is still pending (its polls are never a loop): here,
    /// or on another instance as its last poll here found it.
    pub fn is_pending(&self, owner: &str, id: &str) -> bool {
        if let Some(job) = self.book().get(id) {
            return job.owner.caller == owner && !job.last.status.is_terminal();
        }
        let now = self.clock.now();
        let elsewhere = self.pending_elsewhere.lock().unwrap_or_else(|p| p.into_inner());
        elsewhere.get(&(owner.to_owned(), id.to_owned())).is_some_and(|until| now < *until)
    }

    /// What a poll here found of `owner`'s job `id` on another instance: pending or not.
    fn heard_elsewhere(&self, owner: &str, id: &str, pending: bool) {
        let now = self.clock.now();
        let mut elsewhere = self.pending_elsewhere.lock().unwrap_or_else(|p| p.into_inner());
        let key = (owner.to_owned(), id.to_owned());
        if !pending {
            elsewhere.remove(&key);
            return;
        }
        if elsewhere.len() >= PENDING_ELSEWHERE_MAX {
            elsewhere.retain(|_, until| now < *until);
        }
        if elsewhere.len() < PENDING_ELSEWHERE_MAX || elsewhere.contains_key(&key) {
            elsewhere.insert(key, now.saturating_add(PENDING_ELSEWHERE_FOR));
        }
    }

    /// `owner`'s pending jobs, oldest first.
    pub fn pending_of(&self, owner: &str) -> Vec<JobView> {
        let mut ids: Vec<(SystemTime, String)> = self
            .book()
            .values()
            .filter(|j| j.owner.caller == owner && !j.last.status.is_terminal())
            .map(|j| (j.created, j.last.id.clone()))
            .collect();
        ids.sort();
        ids.iter().filter_map(|(_, id)| self.view_of(id)).collect()
    }

    /// How long until the first pending job of `owner`, or of its `tenant`, is worth polling:
    /// when a busy caller should look again.
    pub fn soonest_news(&self, owner: &str, tenant: Option<&str>) -> Option<Nanos> {
        let ids: Vec<String> = self
            .book()
            .values()
            .filter(|j| !j.last.status.is_terminal())
            .filter(|j| j.owner.caller == owner || (tenant.is_some() && j.owner.tenant.as_deref() == tenant))
            .map(|j| j.last.id.clone())
            .collect();
        ids.iter().filter_map(|id| self.view_of(id)?.wait).min()
    }

    /// How many jobs of each flow wait in the queue, and the account's slots in use.
    pub fn occupancy(&self) -> crate::upstream::queue::Occupancy {
        self.queue.occupancy()
    }

    /// The account's slots: jobs the upstream runs at once (as learnt, with `[upstream.adaptive]`).
    pub fn slots(&self) -> usize {
        self.queue.slots()
    }

    /// Who owns each job not final yet, and whether it has reached the upstream (else it waits
    /// in the queue): one entry per job, for the dashboard's jobs per tenant.
    pub fn pending_owners(&self) -> Vec<(Owner, bool)> {
        let book = self.book();
        book.values()
            .filter(|j| !j.last.status.is_terminal())
            .map(|j| (j.owner.clone(), j.upstream_id.is_some()))
            .collect()
    }

    /// Jobs not final yet.
    pub fn in_flight(&self) -> usize {
        self.book().values().filter(|j| !j.last.status.is_terminal()).count()
    }

    /// Forgets final jobs untouched for an hour; returns how many went.
    pub fn sweep(&self) -> usize {
        let now = self.clock.now();
        let mut book = self.book();
        let before = book.len();
        book.retain(|_, j| !j.last.status.is_terminal() || now.saturating_sub(j.updated_at) < KEEP_FOR);
        before - book.len()
    }
}

/// A job not yet final, as an operator lists it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct JobListing {
    /// The job's id, as its agent knows it.
    pub predict_id: String,
    /// Whose it is (a caller id, never a key).
    pub caller: String,
    /// The owner's tenant, if any.
    pub tenant: Option<String>,
    /// Image or video.
    pub kind: PredictionKind,
    /// `starting` or `processing`.
    pub status: PredictionStatus,
    /// While queued for the upstream account: its place (1 = next).
    pub queue_position: Option<usize>,
    /// When it was accepted, in milliseconds since the epoch.
    pub created_unix_ms: u64,
    /// Whether this instance runs it (otherwise another instance published it).
    pub on_this_instance: bool,
}

impl JobListing {
    fn of(view: JobView, caller: String, tenant: Option<String>, here: bool) -> Self {
        Self {
            predict_id: view.prediction.id,
            caller,
            tenant,
            kind: view.prediction.kind,
            status: view.prediction.status,
            queue_position: view.queue_ahead.map(|ahead| ahead + 1),
            created_unix_ms: unix_ms(view.created),
            on_this_instance: here,
        }
    }
}

/// A job just inserted is always in the book; this keeps that invariant out of `unwrap`.
fn unreachable_view(id: &str, kind: PredictionKind) -> JobView {
    JobView {
        prediction: Prediction {
            id: id.to_owned(),
            kind,
            status: PredictionStatus::Failed,
            output: None,
            error: Some("the job was lost".to_owned()),
            usage: None,
        },
        wait: None,
        queue_ahead: None,
        created: SystemTime::now(),
        reserved: None,
        charged: None,
    }
}

/// What a final job's work came to, as far as its price goes: nothing if the upstream never
/// took it (it never left our queue, or every submission was refused), the reservation if a
/// submission went unanswered (the upstream may have started it), else what the upstream
/// reports, if it does.
fn used_by(job: &Job) -> Used {
    match (&job.upstream_id, job.last.usage) {
        (None, _) if job.may_have_run => Used::Unreported,
        (None, _) => Used::Nothing,
        (Some(_), Some(usage)) => Used::Reported(usage.units),
        (Some(_), None) => Used::Unreported,
    }
}

/// The span of a job's watch, from its submission to its final state, under the call that
/// started it: the polls of the paid API are its children. Disabled, and free, when traces are off
/// or the call was not traced.
fn watch_span() -> tracing::Span {
    crate::telemetry::of_later_work(
        || tracing::info_span!(target: crate::telemetry::TARGET, parent: None, "upstream.watch"),
    )
}

/// The span of a queued job from the call that queued it (its parent: the span current there) to
/// its submission: how long it waited for an account slot on the server's clock, and in how many
/// tries it was sent; its submission's [`upstream`](crate::upstream) request is its child.
/// Disabled, and free, when traces are off.
fn queue_span() -> tracing::Span {
    crate::telemetry::of_later_work(|| {
        tracing::info_span!(
            target: crate::telemetry::TARGET,
            parent: None,
            "upstream.queue",
            "upstream.queue.waited_ms" = tracing::field::Empty,
            "upstream.queue.tries" = tracing::field::Empty,
        )
    })
}
