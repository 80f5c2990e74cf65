//! The mock's webhooks: when a job that asked for one ends, its final prediction is POSTed to the
//! submission's `webhook` URL, signed the Standard Webhooks way ([`crate::webhook`]), as
//! Replicate, fal and OpenAI's video API do, and retried with backoff until answered 2xx.
//!
//! One sender per job, started when the job is made: it waits on the mock's clock for the job's
//! end, or for its cancel (which ends it at once), then sends the prediction as
//! `GET /v1/predictions/{id}` shows it at that moment. Its waits between attempts are on the
//! mock's clock too, so a test with a manual clock walks a retry as it walks a job. Each attempt
//! is logged for `GET /v1/webhooks` and counted in `GET /v1/usage`.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::extract::State;
use rand::Rng;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::{MockState, bump, lock};
use crate::clock::Nanos;
use crate::redact::Secret;
use crate::upstream::api::{COMPLETED, NewPrediction};
use crate::webhook::WebhookKey;

/// Most attempts at one message, the first included.
const MAX_ATTEMPTS: u32 = 6;
/// The wait after the first failed attempt; each later one doubles it (1, 2, 4, 8, 16 s).
const FIRST_WAIT: Nanos = Nanos::from_secs(1);
/// Most senders waiting or sending at once: past it a job gets no webhook (counted as dropped),
/// so a flood of submissions cannot pile up tasks without bound.
const MAX_PENDING: usize = 10_000;
/// The longest one attempt may take, on the wall clock (the receiver is a real HTTP server).
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);
/// Most attempts kept for `GET /v1/webhooks`.
const MAX_LOG: usize = 100_000;
/// The longest `webhook` URL a submission may name: it is kept while its job runs.
const MAX_URL_LEN: usize = 2048;

/// One delivery attempt, as `GET /v1/webhooks` lists it.
#[derive(Debug, Clone, serde::Serialize)]
struct Attempt {
    /// The job it reports.
    prediction_id: String,
    /// The message's `webhook-id`, the same on every attempt at it.
    webhook_id: String,
    /// Where it was sent.
    url: String,
    /// 1 for the first try of the message.
    attempt: u32,
    /// The HTTP status it was answered with; `None` when no answer came (refused, timed out).
    status: Option<u16>,
    /// The mock clock's reading when it was sent, in nanoseconds.
    at_ns: Nanos,
}

/// What the mock needs to send webhooks, and what it sent.
#[derive(Debug)]
pub(super) struct Webhooks {
    /// The key `mock_upstream.webhook_secret` names; `None` (empty or unreadable): none are sent.
    key: Option<WebhookKey>,
    /// One client for every attempt, so connections to a receiver are reused.
    client: reqwest::Client,
    /// Senders started and not yet done.
    pending: AtomicUsize,
    /// Attempts answered 2xx.
    sent: AtomicU64,
    /// Attempts answered otherwise, or not at all.
    failed: AtomicU64,
    /// Messages whose every attempt failed.
    given_up: AtomicU64,
    /// Jobs that asked for a webhook while [`MAX_PENDING`] senders were waiting: none is sent.
    dropped: AtomicU64,
    /// Messages not sent, or not retried, because chaos `webhooks` was `false`.
    withheld: AtomicU64,
    log: Mutex<Vec<Attempt>>,
}

impl Webhooks {
    /// Webhooks signed with `secret`'s key (none sent when it is empty).
    pub(super) fn new(secret: &Secret) -> Self {
        // Empty is no `whsec_` secret: no key. The config check refuses any other unreadable one.
        let key = WebhookKey::parse(secret.expose()).ok();
        // A sender follows no redirect (a 3xx is a failed attempt), as Standard Webhooks senders do.
        // Without TLS or a proxy file to load, building cannot fail; the default is the same client
        // without those two settings.
        let client = reqwest::Client::builder()
            .timeout(ATTEMPT_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap_or_default();
        Self {
            key,
            client,
            pending: AtomicUsize::new(0),
            sent: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            given_up: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            withheld: AtomicU64::new(0),
            log: Mutex::new(Vec::new()),
        }
    }

    /// The counters `GET /v1/usage` adds, by name.
    pub(super) fn usage(&self) -> [(&'static str, u64); 5] {
        let read = |c: &AtomicU64| c.load(Ordering::Relaxed);
        [
            ("webhooks_sent", read(&self.sent)),
            ("webhooks_failed", read(&self.failed)),
            ("webhooks_given_up", read(&self.given_up)),
            ("webhooks_dropped", read(&self.dropped)),
            ("webhooks_withheld", read(&self.withheld)),
        ]
    }

    fn record(&self, attempt: Attempt) {
        let mut log = lock(&self.log);
        if log.len() < MAX_LOG {
            log.push(attempt);
        }
    }
}

/// Why a submission's `webhook` is refused, if it is: an http(s) URL of at most
/// [`MAX_URL_LEN`] characters, as a real API checks it when the job is made.
pub(super) fn refusal(new: &NewPrediction) -> Option<&'static str> {
    let url = new.webhook.as_deref()?;
    let readable = url.len() <= MAX_URL_LEN
        && reqwest::Url::parse(url).is_ok_and(|u| matches!(u.scheme(), "http" | "https") && u.has_host());
    (!readable).then_some("webhook must be an http or https URL of at most 2048 characters")
}

/// The URL a job made from `new` is to be reported to when it ends: its `webhook`, when the mock
/// has a key to sign with and `webhook_events_filter` is absent or names `completed` (the one
/// event the mock sends; other names are ignored).
pub(super) fn wanted<'a>(webhooks: &Webhooks, new: &'a NewPrediction) -> Option<&'a str> {
    webhooks.key.as_ref()?;
    let completed = new.webhook_events_filter.as_ref().is_none_or(|events| events.iter().any(|e| e == COMPLETED));
    new.webhook.as_deref().filter(|_| completed)
}

/// Starts the sender of job `id`'s webhook to `url`: it sends once the job is final, at `end` on
/// the mock's clock or when `ends_early` fires (the job was canceled), whichever comes first, and
/// only once. Not started, and counted as dropped, while [`MAX_PENDING`] senders wait.
pub(super) fn start(state: &Arc<MockState>, id: String, url: String, end: Nanos, ends_early: CancellationToken) {
    let webhooks = &state.webhooks;
    let Some(key) = webhooks.key.clone() else { return };
    let claimed = webhooks
        .pending
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n < MAX_PENDING).then(|| n.saturating_add(1)));
    if claimed.is_err() {
        bump(&webhooks.dropped);
        return;
    }
    let sender = Sender { state: state.clone(), key, id, url };
    tokio::spawn(sender.run(end, ends_early));
}

/// One job's webhook sender; it holds one of the [`MAX_PENDING`] places until dropped.
struct Sender {
    state: Arc<MockState>,
    key: WebhookKey,
    /// The job it reports.
    id: String,
    url: String,
}

impl Drop for Sender {
    fn drop(&mut self) {
        self.state.webhooks.pending.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Sender {
    /// Waits for the job to be final, then delivers it; gives up when the mock stops.
    async fn run(self, end: Nanos, ends_early: CancellationToken) {
        let state = &self.state;
        tokio::select! {
            () = state.stop.cancelled() => return,
            () = state.clock.sleep_until(end) => {}
            () = ends_early.cancelled() => {}
        }
        // A job forgotten in the meantime (only under `MAX_JOBS` of them) is reported no more.
        let Some(prediction) = state.final_view(&self.id) else { return };
        // A prediction always serializes; the `else` is never taken.
        let Ok(body) = serde_json::to_vec(&prediction) else { return };
        self.deliver(&body).await;
    }

    /// Sends `body` as one message until it is answered 2xx or [`MAX_ATTEMPTS`] were made, each
    /// retry [`FIRST_WAIT`] (then twice the last wait) after the attempt before it began.
    async fn deliver(&self, body: &[u8]) {
        let state = &self.state;
        let webhooks = &state.webhooks;
        let message = format!("msg_{:032x}", rand::rng().random::<u128>());
        let mut wait = FIRST_WAIT;
        for attempt in 1..=MAX_ATTEMPTS {
            if !state.webhooks_on() {
                bump(&webhooks.withheld);
                return;
            }
            let at_ns = state.clock.now();
            let status = tokio::select! {
                () = state.stop.cancelled() => return,
                status = self.post(&message, body) => status,
            };
            let answered = status.is_some_and(|s| (200..300).contains(&s));
            bump(if answered { &webhooks.sent } else { &webhooks.failed });
            let (prediction_id, url, webhook_id) = (self.id.clone(), self.url.clone(), message.clone());
            webhooks.record(Attempt { prediction_id, webhook_id, url, attempt, status, at_ns });
            if answered {
                return;
            }
            if attempt < MAX_ATTEMPTS {
                tokio::select! {
                    () = state.stop.cancelled() => return,
                    () = state.clock.sleep_until(at_ns + wait) => {}
                }
                wait = wait * 2;
            }
        }
        bump(&webhooks.given_up);
    }

    /// One attempt at message `id`, signed as sent now on the wall clock (what a receiver checks
    /// its timestamp against): the status it was answered with, if any.
    async fn post(&self, id: &str, body: &[u8]) -> Option<u16> {
        let timestamp = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let response = self
            .state
            .webhooks
            .client
            .post(&self.url)
            .header("webhook-id", id)
            .header("webhook-timestamp", timestamp.to_string())
            .header("webhook-signature", self.key.sign(id, timestamp, body))
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.to_vec())
            .send()
            .await
            .ok()?;
        Some(response.status().as_u16())
    }
}

/// `GET /v1/webhooks`: every delivery attempt, oldest first.
pub(super) async fn list(State(state): State<Arc<MockState>>) -> Json<serde_json::Value> {
    Json(json!({ "webhooks": *lock(&state.webhooks.log) }))
}
