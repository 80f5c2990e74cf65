//! Polling and settling: a started job's own task polls the upstream at the job's hint until it is
//! final; each answer is recorded, and a final job gives back its slots and settles its price
//! ([`Held::finish`]).

use super::{Job, Jobs, lock_book};
use crate::clock::Nanos;
use crate::guard::{Held, Used};
use crate::upstream::UpstreamError;
use crate::upstream::api::{Prediction, PredictionStatus};
use crate::upstream::backoff::Retry;
use crate::upstream::queue::AccountSlot;

impl Jobs {
    /// Polls the upstream when the job's schedule says until the job is final. A job that changed
    /// while its poll was waiting (its webhook ended it, another poll moved it on) is looked at
    /// again first: a job already final is never polled.
    pub(super) async fn watch(&self, id: &str) {
        let mut failed = 0;
        loop {
            let Some((upstream_id, due, mut changed)) = self.book().get(id).and_then(|j| {
                let pending = !j.last.status.is_terminal();
                j.upstream_id.clone().filter(|_| pending).map(|u| (u, j.next_poll_at, j.changed.subscribe()))
            }) else {
                return;
            };
            tokio::select! {
                () = self.clock.sleep_until(due) => {}
                // Changed meanwhile: read it again (the sender lives as long as the job).
                _ = changed.changed() => continue,
            }
            let asked = self.clock.now();
            let answer = self.upstream.get_prediction(&upstream_id).await;
            self.metrics.upstream("get_prediction", UpstreamError::outcome_of(&answer));
            match answer {
                Ok(prediction) => {
                    failed = 0;
                    if self.update(id, prediction, asked, Heard::Polled) {
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
                            self.poll_again_in(id, Nanos::from(delay));
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

    /// Records the upstream's answer to a submission, just arrived; the job holds `account` from
    /// now on (until it is final: one that ended meanwhile gives it back at once).
    pub(super) fn started(&self, id: &str, prediction: Prediction, account: AccountSlot) {
        let upstream_id = prediction.id.clone();
        if let Some(job) = self.book().get_mut(id) {
            job.upstream_id = Some(upstream_id);
            if let Some(held) = &mut job.held {
                held.hold(account);
            }
        }
        self.update(id, prediction, self.clock.now(), Heard::Submitted);
    }

    /// Records what the upstream said about `id` (`heard` says how: the answer to its submission,
    /// arrived at `asked`; the answer to a poll put at `asked`; or its webhook, arrived at `asked`);
    /// releases its slots when it is final. Returns whether it is final.
    ///
    /// The next poll is timed from the question, not the answer: a slow answer does not push the
    /// schedule back (nor does time that passed while it was on its way). It is due at the marks
    /// the lengths learnt for its class set, then a tenth of its age after each poll that found it
    /// running ([`Cadence`](super::cadence::Cadence)); what a succeeded job took is learnt.
    pub(super) fn update(&self, id: &str, mut prediction: Prediction, asked: Nanos, heard: Heard) -> bool {
        let now = self.clock.now();
        let is_final;
        let mut to_finish = None;
        {
            let mut book = self.book();
            let Some(job) = book.get_mut(id) else { return true };
            if job.last.status.is_terminal() {
                return true;
            }
            prediction.id = id.to_owned();
            is_final = prediction.status.is_terminal();
            self.schedule(job, &prediction, asked, heard);
            job.updated_at = now;
            job.last = prediction;
            if is_final {
                to_finish = job.held.take().map(|held| (held, used_by(job)));
            }
            job.changed.send_modify(|v| *v += 1);
        }
        match to_finish {
            // Outside the book's lock: giving slots back takes the store's locks.
            Some((held, used)) => self.finish(id, held, used),
            None => self.publish(id),
        }
        is_final
    }

    /// Times `job`'s next poll from what was `heard` of it at `asked` (`now` becomes `prediction`);
    /// learns how long it took once it succeeded, and how long its slot was held after its end.
    ///
    /// A job's age counts from when the answer to its submission arrived: the upstream had started
    /// it by then, so a job polled its length after that has ended (no margin to guess, however
    /// far the upstream is).
    fn schedule(&self, job: &mut Job, now: &Prediction, asked: Nanos, heard: Heard) {
        let class = job.class;
        if heard == Heard::Submitted {
            job.submitted_at = Some(asked);
            job.expected_at = asked + self.cadence.expected(class);
            job.next_poll_at = asked + self.cadence.first_poll(class);
            return;
        }
        let Some(sent) = job.submitted_at else { return };
        let age = asked - sent;
        if !now.status.is_terminal() {
            if heard == Heard::Polled {
                job.seen_running_at = Some(age);
                job.next_poll_at = asked + self.cadence.next_poll(class, age);
            }
            return;
        }
        if now.status != PredictionStatus::Succeeded {
            return;
        }
        let reported = now.ran_for();
        if let Some(ran) = reported {
            self.metrics.idle_held((age - ran).as_u64() / crate::clock::NANOS_PER_MS);
        }
        // What it took, from its submission: when its webhook came; else what the API says it ran,
        // unless a poll saw it running longer than that (the API's time leaves out its own queue);
        // else the middle of the last poll that found it running (or four fifths of the way, when
        // none did) and this one.
        let seen_running = job.seen_running_at;
        let took = match heard {
            Heard::Pushed => Some(age),
            Heard::Polled => Some(match (reported, seen_running) {
                (Some(ran), Some(seen)) if ran < seen => (seen + age) / 2,
                (Some(ran), _) => ran.min(age),
                (None, seen) => (seen.unwrap_or(age * 4 / 5) + age) / 2,
            }),
            Heard::Submitted | Heard::Ours => None,
        };
        if let Some(took) = took {
            self.cadence.learn(class, took);
        }
    }

    /// Ends what a final job held: its slots back now, its price settled in a task of its own (it
    /// awaits the store), and only then said: what the store settled, or, when it could not, the
    /// reservation that stands. Published once settled: a final snapshot is never replaced, so it
    /// carries `charged`.
    fn finish(&self, id: &str, held: Held, used: Used) {
        let settling = held.finish(used);
        let (book, id) = (self.book.clone(), id.to_owned());
        let outbox = self.outbox.clone();
        let publish = self.shared.is_some();
        tokio::spawn(async move {
            if let Some(settled) = settling.await
                && let Some(job) = lock_book(&book).get_mut(&id)
            {
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
            job.next_poll_at = self.clock.now() + delay;
            job.changed.send_modify(|v| *v += 1);
        }
        self.publish(id);
    }

    /// Ends `id` with `status` on our own word (the upstream said nothing of it: canceled in
    /// the queue, given up, expired).
    pub(super) fn end(&self, id: &str, status: PredictionStatus, error: Option<String>) {
        let Some(kind) = self.book().get(id).map(|j| j.last.kind) else { return };
        let now = self.clock.now();
        let ended = Prediction { id: id.to_owned(), kind, status, output: None, error, usage: None, metrics: None };
        self.update(id, ended, now, Heard::Ours);
    }

    pub(super) fn fail(&self, id: &str, reason: String) {
        tracing::warn!(predict_id = id, reason, "job failed");
        self.end(id, PredictionStatus::Failed, Some(reason));
    }
}

/// How the server heard of a job's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Heard {
    /// The upstream's answer to its submission.
    Submitted,
    /// The upstream's answer to a poll (ours, or a cancel).
    Polled,
    /// Its webhook (here, or on another instance that published it).
    Pushed,
    /// Our own word: canceled in the queue, given up, expired.
    Ours,
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
pub(super) fn watch_span() -> tracing::Span {
    crate::telemetry::of_later_work(
        || tracing::info_span!(target: crate::telemetry::TARGET, parent: None, "upstream.watch"),
    )
}
