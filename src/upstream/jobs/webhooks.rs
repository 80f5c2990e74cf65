//! A job's end pushed by the paid API: its webhook, taken at `POST /webhooks/upstream`.
//!
//! With `upstream.webhook_url` set, every submission asks the API to POST the prediction there
//! when it is final ([`Jobs::with_webhook`]). A webhook that arrives is judged before anything
//! changes, and none of these checks costs a request to the paid API:
//!
//! 1. its body is at most [`BODY_MAX`] bytes (`413`);
//! 2. it is signed with `upstream.webhook_secret` the Standard Webhooks way, and its timestamp is
//!    within 300 s of now ([`WebhookKey::verify`]; `401`, or `400` for a stale one);
//! 3. its body is a prediction, and it names a job of ours: the `job` of its URL (a job queued
//!    under a `predict_id` of ours) or its own id, whose upstream id is the prediction's (`404`);
//! 4. its id was not taken before, by any instance (`409`): ids are kept [`SEEN_FOR`], longer than
//!    a timestamp stays acceptable, so a replay is refused by its id or by its age.
//!
//! A webhook that passes ends the job where it is. On the instance that holds it, at once: its
//! slots go back, its price is settled, and the next waiting job goes. A job of another instance
//! (over Redis) is published final there, marked `unsettled`, and announced on
//! [`ENDED_CHANNEL`]; its owner hears it, reads the job's final state and ends it the same way
//! ([`Jobs::hear_ended_elsewhere`]), then replaces the snapshot with its own, price settled. The
//! background poll stays the safety net for a webhook that never comes: it waits until twice the
//! job's expected end ([`Cadence`](super::cadence::Cadence)).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use http::StatusCode;

use super::Jobs;
use super::mirror::{Snapshot, keep, snapshot_key};
use super::watching::Heard;
use crate::clock::Nanos;
use crate::upstream::api::Prediction;

/// The largest webhook body taken: a prediction is a few hundred bytes.
pub const BODY_MAX: usize = 64 * 1024;

/// How long a webhook's id is remembered: longer than its timestamp stays acceptable (300 s
/// either way), so a replay is refused by one or the other.
pub(super) const SEEN_FOR: Duration = Duration::from_secs(900);

/// The most webhook ids one instance remembers without a shared store; past it, webhooks are
/// refused `503` (the sender tries again) until old ids expire.
const SEEN_MAX: usize = 100_000;

/// The jobs another instance made final from their webhook, for their owners to end (a sorted
/// set of the last [`ENDED_KEPT`]).
const ENDED_KEY: &str = "{upstream}job:ended";

/// How long a job's end stays announced: its owner, alive, hears it within milliseconds; one that
/// missed it (its subscription was down) or is dead learns it at its next poll, or never needs to.
const ENDED_KEPT: Duration = Duration::from_secs(60);

/// Where a job made final elsewhere is announced (its owner hears it at once).
const ENDED_CHANNEL: &str = "{upstream}job:ended";

/// A webhook as it arrived.
#[derive(Debug, Clone, Copy)]
pub struct Pushed<'a> {
    /// Its headers (`webhook-id`, `webhook-timestamp`, `webhook-signature`).
    pub headers: &'a http::HeaderMap,
    /// Its body, as sent (what was signed).
    pub body: &'a [u8],
    /// The `job` of its URL, if it had one: the `predict_id` it was asked for.
    pub job: Option<&'a str>,
}

/// What a webhook was answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookAnswer {
    /// The HTTP status: 2xx taken, 4xx refused (nothing changed), 503 try again.
    pub status: StatusCode,
    /// The `outcome` it is counted under (`mcp_ratelimit_upstream_webhooks_total`).
    pub outcome: &'static str,
    /// What it says, for the sender's log.
    pub message: String,
}

fn answer(status: StatusCode, outcome: &'static str, message: impl Into<String>) -> WebhookAnswer {
    WebhookAnswer { status, outcome, message: message.into() }
}

fn taken(message: &str) -> WebhookAnswer {
    answer(StatusCode::OK, "taken", message)
}

/// The ids of webhooks taken by an instance without a shared store, each until when (on the
/// book's clock) it is kept.
#[derive(Debug, Default)]
pub(super) struct SeenIds(Mutex<HashMap<String, Nanos>>);

impl SeenIds {
    /// Whether `id` is seen for the first time (and from now on kept until `until`); `None` when
    /// the set is full of ids not yet expired.
    fn first_sight(&self, id: &str, now: Nanos, until: Nanos) -> Option<bool> {
        let mut seen = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if seen.get(id).is_some_and(|kept| now < *kept) {
            return Some(false);
        }
        if seen.len() >= SEEN_MAX {
            seen.retain(|_, kept| now < *kept);
            if seen.len() >= SEEN_MAX {
                return None;
            }
        }
        seen.insert(id.to_owned(), until);
        Some(true)
    }
}

/// Where the job a webhook names stands.
enum Named {
    /// In this instance's book: whether it is final.
    Here { is_final: bool },
    /// Another instance's, as it published it.
    Elsewhere(Box<Snapshot>),
}

impl Jobs {
    /// Judges the webhook `pushed` and, when it passes, ends its job (see the module); counted in
    /// `/metrics` by outcome. Webhooks off: every one is refused `404`.
    pub async fn take_webhook(&self, pushed: Pushed<'_>) -> WebhookAnswer {
        let answer = self.judge_webhook(pushed).await;
        self.metrics.webhook(answer.outcome);
        // Anyone may post here: refusals are counted, and logged only at debug (no log flood).
        if answer.status.is_client_error() {
            tracing::debug!(outcome = answer.outcome, reason = %answer.message, "a webhook was refused");
        }
        answer
    }

    /// Refuses a webhook whose body was more than [`BODY_MAX`] bytes (or could not be read), counted.
    pub fn webhook_too_large(&self) -> WebhookAnswer {
        let answer =
            answer(StatusCode::PAYLOAD_TOO_LARGE, "too_large", format!("a webhook is {BODY_MAX} bytes at most"));
        self.metrics.webhook(answer.outcome);
        answer
    }

    async fn judge_webhook(&self, pushed: Pushed<'_>) -> WebhookAnswer {
        let Some(crate::webhook::WebhookTarget { key, .. }) = &self.rules.webhooks else {
            return answer(StatusCode::NOT_FOUND, "unknown_job", "this server does not take webhooks");
        };
        if pushed.body.len() > BODY_MAX {
            return answer(
                StatusCode::PAYLOAD_TOO_LARGE,
                "too_large",
                format!("a webhook is {BODY_MAX} bytes at most"),
            );
        }
        let now_unix = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let id = match key.verify(pushed.headers, pushed.body, now_unix) {
            Ok(id) => id,
            Err(why) => {
                let status = if why.outcome() == "stale" { StatusCode::BAD_REQUEST } else { StatusCode::UNAUTHORIZED };
                return answer(status, why.outcome(), why.to_string());
            }
        };
        let Ok(prediction) = serde_json::from_slice::<Prediction>(pushed.body) else {
            return answer(StatusCode::BAD_REQUEST, "unreadable", "the body is not a prediction");
        };
        let predict_id = pushed.job.unwrap_or(&prediction.id).to_owned();
        let Some(named) = self.named(&predict_id, &prediction.id).await else {
            return answer(StatusCode::NOT_FOUND, "unknown_job", "no job of ours has this id");
        };
        match self.first_sight(id).await {
            Ok(true) => {}
            Ok(false) => return answer(StatusCode::CONFLICT, "replayed", "this webhook-id was taken before"),
            Err(why) => return answer(StatusCode::SERVICE_UNAVAILABLE, "unavailable", why),
        }
        if !prediction.status.is_terminal() {
            return taken("the job is not final: nothing to change");
        }
        match named {
            Named::Here { is_final: true } => taken("the job was final already"),
            Named::Here { is_final: false } => {
                self.update(&predict_id, prediction, self.clock.now(), Heard::Pushed);
                taken("the job is final")
            }
            Named::Elsewhere(snapshot) if snapshot.is_final => taken("the job was final already"),
            Named::Elsewhere(snapshot) => self.end_elsewhere(&predict_id, *snapshot, prediction).await,
        }
    }

    /// The job `predict_id` whose upstream id is `upstream_id`, here or published by another
    /// instance; `None` when there is no such job (or the ids do not match: a body moved to
    /// another job's URL).
    async fn named(&self, predict_id: &str, upstream_id: &str) -> Option<Named> {
        let here = self
            .book()
            .get(predict_id)
            .map(|job| (job.upstream_id.as_deref() == Some(upstream_id), job.last.status.is_terminal()));
        match here {
            Some((true, is_final)) => Some(Named::Here { is_final }),
            Some((false, _)) => None,
            None => {
                let raw = self.shared.as_ref()?.get(&snapshot_key(predict_id)).await.ok()??;
                let snapshot = serde_json::from_str::<Snapshot>(&raw).ok()?;
                (snapshot.upstream_id.as_deref() == Some(upstream_id)).then(|| Named::Elsewhere(Box::new(snapshot)))
            }
        }
    }

    /// Whether the webhook `id` is taken for the first time: by any instance over a shared store,
    /// else by this one.
    async fn first_sight(&self, id: &str) -> Result<bool, String> {
        if let Some(shared) = &self.shared {
            return shared
                .take_once(&format!("{{upstream}}webhook:{id}"), SEEN_FOR)
                .await
                .map_err(|e| format!("cannot check the webhook-id: {e}; send it again"));
        }
        let now = self.clock.now();
        self.seen_ids
            .first_sight(id, now, now + Nanos::from(SEEN_FOR))
            .ok_or_else(|| "too many webhooks at once; send it again".to_owned())
    }

    /// Publishes another instance's job `predict_id` final as `prediction` says, and announces it
    /// to its owner, which ends it there.
    async fn end_elsewhere(&self, predict_id: &str, mut snapshot: Snapshot, prediction: Prediction) -> WebhookAnswer {
        let Some(shared) = &self.shared else { return taken("the job was final already") };
        snapshot.prediction = Prediction { id: predict_id.to_owned(), ..prediction };
        (snapshot.version, snapshot.is_final, snapshot.unsettled) = (snapshot.version.saturating_add(1), true, true);
        let unavailable = |e: crate::store::StoreError| {
            answer(StatusCode::SERVICE_UNAVAILABLE, "unavailable", format!("cannot publish the job's end: {e}"))
        };
        let Ok(value) = serde_json::to_string(&snapshot) else {
            return answer(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "cannot write the job's end");
        };
        match shared.put_record(&snapshot_key(predict_id), &value, snapshot.version, keep()).await {
            Ok(true) => {}
            Ok(false) => return taken("the job was final already"),
            Err(e) => return unavailable(e),
        }
        match shared.announce(ENDED_KEY, predict_id, ENDED_KEPT, ENDED_CHANNEL).await {
            Ok(()) => taken("the job is final; its instance is told"),
            // Published final: its owner's next poll of the upstream ends it anyway.
            Err(e) => {
                tracing::debug!(error = %e, "could not announce a job's end to its instance");
                taken("the job is final")
            }
        }
    }

    /// Hears, until the book stops, the jobs of this instance that another instance made final
    /// from their webhook, and ends each here at once ([`Jobs::take_ended_elsewhere`]). Over a
    /// shared store only.
    pub fn hear_ended_elsewhere(self: &Arc<Self>) {
        let Some(store) = self.settle_in.clone() else { return };
        let Some(mut heard) = store.hear(ENDED_CHANNEL) else { return };
        let (jobs, stop) = (Arc::downgrade(self), self.stop.clone());
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    changed = heard.changed() => if changed.is_err() { return },
                    () = stop.cancelled() => return,
                }
                let Some(jobs) = jobs.upgrade() else { return };
                if let Err(error) = jobs.take_ended_elsewhere().await {
                    tracing::debug!(%error, "could not read the jobs other instances ended");
                }
            }
        });
    }

    /// Ends each job of this instance another instance made final (see the module); how many.
    pub async fn take_ended_elsewhere(&self) -> Result<usize, crate::store::StoreError> {
        let Some(shared) = &self.shared else { return Ok(0) };
        if self.in_flight() == 0 {
            return Ok(0);
        }
        let announced = shared.announced(ENDED_KEY).await?;
        let mine: Vec<String> = {
            let book = self.book();
            announced.into_iter().filter(|id| book.contains_key(id)).collect()
        };
        for id in &mine {
            let Some(raw) = shared.get(&snapshot_key(id)).await? else { continue };
            let Ok(snapshot) = serde_json::from_str::<Snapshot>(&raw) else { continue };
            let upstream_id = self.book().get(id).and_then(|job| job.upstream_id.clone());
            if snapshot.is_final && snapshot.upstream_id.is_some() && snapshot.upstream_id == upstream_id {
                self.update(id, snapshot.prediction, self.clock.now(), Heard::Pushed);
            }
        }
        shared.withdraw(ENDED_KEY, &mine).await?;
        Ok(mine.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ids_kept_without_a_shared_store_are_bounded_and_a_full_set_makes_room_as_they_expire() {
        let seen = SeenIds::default();
        let (now, until) = (Nanos::ZERO, Nanos::from(SEEN_FOR));
        for i in 0..SEEN_MAX {
            assert_eq!(seen.first_sight(&format!("msg_{i}"), now, until), Some(true));
        }
        assert_eq!(seen.first_sight("msg_0", now, until), Some(false), "a replay is told apart");
        assert_eq!(seen.first_sight("msg_new", now, until), None, "full of ids still kept: refused, not grown");
        assert_eq!(seen.0.lock().map(|s| s.len()).unwrap_or_default(), SEEN_MAX);
        let later = until + Nanos::new(1);
        assert_eq!(seen.first_sight("msg_new", later, later + until), Some(true), "the expired ones made room");
        assert_eq!(seen.0.lock().map(|s| s.len()).unwrap_or_default(), 1);
    }
}
