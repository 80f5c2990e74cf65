//! Jobs: image and video predictions, from the tool call that accepted them until they are final.
//!
//! A job holds the caller's in-flight slots (whatever its admission took: the per-caller and
//! per-tenant job caps) from acceptance until it is `succeeded`, `failed` or `canceled`, or
//! expires. The server learns that from the paid API's **webhook**, the moment the job ends
//! (`webhooks`), and by **polling the upstream itself**, in a background task per job, timed by the
//! lengths the jobs of its class were seen to take (`cadence`) — not only when an agent polls — so
//! a job its agent forgot, or whose webhook was lost, still gives its slot back. An agent's `get_prediction` never reaches the upstream: it is answered
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
//!
//! The types are here; the rest is cut along a job's life: submitting it (`submit`), polling it
//! and settling its price (`watching`) at the times `cadence` says, its end pushed by a webhook
//! (`webhooks`), ending it early (`cancel`), what its owner sees of it (`view`), and the book as
//! other instances see it (`mirror`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::clock::{Nanos, SharedClock};
use crate::guard::{Handed, Held};
use crate::ops::metrics::Metrics;
use crate::store::StoreError;
use crate::store::{JobMirror, Store};
use crate::upstream::api::{NewPrediction, Prediction, PredictionKind, PredictionStatus};
use crate::upstream::backoff::{Backoff, Retry, RetryBudget};
use crate::upstream::classes::ClassId;
use crate::upstream::queue::{FairQueue, Flowing, QueueRules, Standing, Turn};
use crate::upstream::{Upstream, UpstreamError};

pub mod cadence;
mod cancel;
mod mirror;
mod submit;
mod view;
mod watching;
mod webhooks;

use cadence::Cadence;
use mirror::{Outbox, unix_ms};
pub use view::AccountSlots;
pub use webhooks::{BODY_MAX as WEBHOOK_BODY_MAX, Pushed, WebhookAnswer};

/// Final jobs are remembered this long after their last change, so a late poll still reads
/// the result (and re-reading it stays free).
const KEEP_FOR: Nanos = Nanos::from_secs(3_600);
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

/// The fixed parameters of job handling, from `[upstream]` (each class's poll hint, where its
/// [`Cadence`] starts, is the class's: [`crate::upstream::classes::JobClass::poll_hint`]).
#[derive(Debug, Clone)]
pub struct JobRules {
    /// Where the paid API is asked to send a webhook when a job ends (`upstream.webhook_url`),
    /// with the key its webhooks are signed with; `None`: ends are learnt by polls only.
    pub webhooks: Option<crate::webhook::WebhookTarget>,
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
    /// When its submission was sent (on the book's clock), once the upstream took it.
    submitted_at: Option<Nanos>,
    /// When it is expected to be final ([`Cadence::expected`] after its submission).
    expected_at: Nanos,
    /// How long after its submission the last poll that found it running was asked.
    seen_running_at: Option<Nanos>,
    next_poll_at: Nanos,
    updated_at: Nanos,
    expires_at: Nanos,
    created: SystemTime,
    /// What its call holds until it is final: the admission (in-flight slots, the reserved
    /// price) and, once submitted, the account slot; `None` once final.
    held: Option<Held>,
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

impl Job {
    /// When the server expects to hear next of this running job: its expected end, or once that
    /// has passed, its next poll.
    fn news_at(&self, now: Nanos) -> Nanos {
        if self.expected_at > now { self.expected_at.min(self.next_poll_at) } else { self.next_poll_at }
    }
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
    /// Units it was charged, once final and settled (see [`crate::guard::after::settle`]).
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
    /// How long each class's jobs take, as seen: when to poll them.
    cadence: Arc<Cadence>,
    book: Arc<Mutex<Book>>,
    stop: CancellationToken,
    /// Where snapshots of the book are published for the other instances.
    shared: Option<Arc<dyn JobMirror>>,
    /// The shared store the prices of a dead instance's jobs are given back in.
    settle_in: Option<Arc<dyn Store>>,
    /// The jobs whose snapshot Redis does not have yet.
    outbox: Arc<Outbox>,
    /// The ids of the webhooks taken, without a shared store (with one, they are kept there).
    seen_ids: webhooks::SeenIds,
    /// Jobs of other instances an agent polled here and found pending, (owner, id) → until when
    /// (on the book's clock) their polls are not a loop, as a local job's are not.
    pending_elsewhere: Mutex<HashMap<(String, String), Nanos>>,
}

type Book = HashMap<String, Job>;

/// How long a job of another instance found pending stays known as such without another poll.
const PENDING_ELSEWHERE_FOR: Nanos = Nanos::from_secs(600);

/// The most jobs of other instances remembered as pending: past it, new ones are not (their
/// polls count towards a loop, as before).
const PENDING_ELSEWHERE_MAX: usize = 10_000;

fn lock_book(book: &Mutex<Book>) -> MutexGuard<'_, Book> {
    // Jobs are replaced field by field under the lock, never left half-written.
    book.lock().unwrap_or_else(|p| p.into_inner())
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
        let cadence = Arc::new(Cadence::new(&queue.rules().classes, rules.webhooks.is_some()));
        Self {
            upstream,
            clock,
            metrics,
            queue,
            retry_budget,
            rules,
            cadence,
            book,
            stop,
            shared: None,
            settle_in: None,
            outbox,
            seen_ids: webhooks::SeenIds::default(),
            pending_elsewhere,
        }
    }

    fn book(&self) -> MutexGuard<'_, Book> {
        lock_book(&self.book)
    }

    /// How long each class's jobs take, as learnt.
    pub fn cadence(&self) -> &Cadence {
        &self.cadence
    }

    /// How soon an account slot may free up when no running job says when: the shortest
    /// expected length of any class's jobs.
    fn typical_turnover(&self) -> Nanos {
        let classes = &self.queue.rules().classes;
        classes.iter().map(|(class, _)| self.cadence.expected(class)).min().unwrap_or(Nanos::from_secs(1))
    }

    /// `job` as submitted: asking for a webhook when they are on, addressed to `id` when the
    /// upstream will name the job otherwise (a job queued under a `predict_id` of ours).
    fn with_webhook(&self, mut job: NewPrediction, id: Option<&str>) -> NewPrediction {
        if let Some(target) = &self.rules.webhooks {
            let mut url = target.url.clone();
            if let Some(id) = id {
                url.query_pairs_mut().append_pair("job", id);
            }
            job.webhook = Some(url.into());
            job.webhook_events_filter = Some(vec![crate::upstream::api::COMPLETED.to_owned()]);
        }
        job
    }

    /// The queue in front of the upstream account.
    pub fn queue(&self) -> &Arc<FairQueue> {
        &self.queue
    }

    fn backoff_after(&self, failed: u32, error: &UpstreamError) -> Retry {
        let retry_after = match error {
            UpstreamError::RateLimited { retry_after } => *retry_after,
            _ => None,
        };
        self.rules.backoff.after_failure(failed, retry_after, &mut rand::rng())
    }

    /// Forgets final jobs untouched for an hour; returns how many went.
    pub fn sweep(&self) -> usize {
        let now = self.clock.now();
        let mut book = self.book();
        let before = book.len();
        book.retain(|_, j| !j.last.status.is_terminal() || now - j.updated_at < KEEP_FOR);
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
