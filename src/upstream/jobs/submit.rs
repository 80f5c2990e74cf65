//! Submitting a job: a place reserved in the queue, the job submitted in the tool call when an
//! account slot is free, or queued and submitted by its own task when its turn comes (retried
//! under the backoff and the retry budget), and that task started.

use std::sync::Arc;
use std::time::SystemTime;

use rand::Rng;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::watching::{Heard, watch_span};
use super::{Job, JobView, Jobs, Owner, Queued};
use crate::clock::Nanos;
use crate::guard::{Admission, Held, TakeOnce};
use crate::upstream::UpstreamError;
use crate::upstream::api::{NewPrediction, Prediction, PredictionKind, PredictionStatus};
use crate::upstream::backoff::Retry;
use crate::upstream::classes::ClassId;
use crate::upstream::queue::{AccountSlot, QueuePlace};

/// What a submission's answer teaches the account's adaptive limit through the slot it used: the
/// upstream took the job, or said 429 (anything else says nothing of its capacity).
async fn learn_from(account: &AccountSlot, answer: &Result<Prediction, UpstreamError>) {
    match answer {
        Ok(_) => account.accepted().await,
        Err(UpstreamError::RateLimited { .. }) => account.overloaded().await,
        Err(_) => {}
    }
}

/// A fresh `predict_id` for a job the upstream has not named yet.
fn new_id(prefix: &str) -> String {
    let mut rng = rand::rng();
    format!("{prefix}_{:016x}{:08x}", rng.random::<u64>(), rng.random::<u32>())
}

impl Jobs {
    /// Starts the job `job` that `tool` asked for, for `owner`, and returns at once. A job of a
    /// class without a gap that finds an account slot free is submitted now, in one attempt (the
    /// agent gets any refusal with its wait); anything else waits its turn in the place `place`
    /// holds (for a job of its class). A job that exists takes its call's `admission` (its
    /// in-flight slots and price) and holds it until it is final; one that failed to start leaves
    /// it to its call, which settles it as any answered call.
    pub async fn start(
        self: &Arc<Self>,
        owner: &Owner,
        tool: &str,
        job: NewPrediction,
        place: QueuePlace,
        admission: &TakeOnce<Admission>,
    ) -> Result<JobView, UpstreamError> {
        let class = place.class();
        let place = match place.start_now(&owner.flowing()).await {
            Ok(account) => return self.submit_now(owner, tool, class, job, admission, account).await,
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
            metrics: None,
        };
        self.insert(owner, class, None, waiting, Held::taking(admission));
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
        admission: &TakeOnce<Admission>,
        account: AccountSlot,
    ) -> Result<JobView, UpstreamError> {
        let kind = job.kind;
        // The upstream names the job: its webhook finds it by that name.
        let job = self.with_webhook(job, None);
        let answer = self.upstream.create_prediction(&job, &new_id("k")).await;
        self.metrics.upstream(tool, UpstreamError::outcome_of(&answer));
        learn_from(&account, &answer).await;
        let prediction = answer?;
        let id = prediction.id.clone();
        let mut held = Held::taking(admission);
        held.hold(account);
        // Booked as just started, then told the answer: a job final already (it took no time)
        // gives its slots back at once, as one that ends later does.
        let booked = Prediction {
            status: PredictionStatus::Starting,
            output: None,
            error: None,
            usage: None,
            metrics: None,
            ..prediction.clone()
        };
        self.insert(owner, class, Some(id.clone()), booked, held);
        self.update(&id, prediction, self.clock.now(), Heard::Submitted);
        self.spawn(id.clone(), None);
        Ok(self.view_of(&id).unwrap_or_else(|| unreachable_view(&id, kind)))
    }

    /// Books a job: waiting in the queue, or started under `upstream_id` (the upstream's name for
    /// it), its submission answered now.
    fn insert(&self, owner: &Owner, class: ClassId, upstream_id: Option<String>, last: Prediction, held: Held) {
        let now = self.clock.now();
        let submitted_at = upstream_id.as_ref().map(|_| now);
        let job = Job {
            owner: owner.clone(),
            class,
            upstream_id,
            submitted_at,
            expected_at: now + self.cadence.expected(class),
            seen_running_at: None,
            next_poll_at: now + self.cadence.first_poll(class),
            updated_at: now,
            expires_at: now + self.rules.expiry,
            created: SystemTime::now(),
            may_have_run: false,
            reserved: held.units(),
            held: Some(held),
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
        let job = self.with_webhook(job, Some(id));
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
                let waited_ms = (self.clock.now() - queued_at).as_u64() / crate::clock::NANOS_PER_MS;
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
                    if let Some(held) = &mut job.held {
                        held.settled_elsewhere();
                    }
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
                    turn = retry_at(now + retry_after);
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
                            turn = retry_at(now + Nanos::from(delay));
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
            metrics: None,
        },
        wait: None,
        queue_ahead: None,
        created: SystemTime::now(),
        reserved: None,
        charged: None,
    }
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
