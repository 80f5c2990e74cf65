//! Ending a job before the upstream does: its owner's cancel (upstream too, or out of the queue
//! while it waits) and its expiry.

use super::watching::Heard;
use super::{JobView, Jobs};
use crate::clock::NANOS_PER_SEC;
use crate::upstream::UpstreamError;
use crate::upstream::api::PredictionStatus;

impl Jobs {
    /// A job pending past its expiry: failed, its slots freed, and cancelled upstream so it
    /// stops holding the account's capacity too.
    pub(super) async fn expire(&self, id: &str) {
        let upstream_id = self.book().get(id).filter(|j| !j.last.status.is_terminal()).map(|j| j.upstream_id.clone());
        let Some(upstream_id) = upstream_id else { return };
        self.queue.remove(id);
        let secs = self.rules.expiry.as_u64() / NANOS_PER_SEC;
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
                let asked = self.clock.now();
                let answer = self.upstream.cancel_prediction(&upstream_id).await;
                self.metrics.upstream("cancel_prediction", UpstreamError::outcome_of(&answer));
                match answer {
                    // Finished before the cancel arrived: keep the real outcome.
                    Ok(prediction) if prediction.status.is_terminal() => {
                        self.update(id, prediction, asked, Heard::Polled);
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
}
