//! The job book as every instance sees it, over a shared store ([`JobMirror`]): one publisher
//! per instance writes each changed job's current snapshot, in order, again after an outage; an
//! agent whose next session lands on another instance polls and cancels its job there; an
//! operator lists every instance's jobs.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::*;

/// A job as published for the other instances.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub(super) struct Snapshot {
    pub(super) owner: String,
    /// The owner's tenant (absent in snapshots of older versions).
    #[serde(default)]
    tenant: Option<String>,
    pub(super) prediction: Prediction,
    pub(super) upstream_id: Option<String>,
    /// Wall-clock milliseconds since the epoch (instances share no other clock).
    next_poll_unix_ms: u64,
    created_unix_ms: u64,
    /// How many snapshots of the job its owner has made, this one included: `record.lua` never
    /// lets a snapshot replace one of a higher version (0 in snapshots of older versions).
    #[serde(default)]
    pub(super) version: u64,
    /// Whether the job is final: `record.lua` never replaces a final snapshot, so another
    /// instance's cancel is not undone by the owner's next write (absent in older snapshots).
    #[serde(default, rename = "final")]
    pub(super) is_final: bool,
    /// Units its call reserved, and charged once settled (absent in older snapshots).
    #[serde(default)]
    reserved: Option<u64>,
    #[serde(default)]
    charged: Option<u64>,
    /// While it waits to be submitted: its call's reservation, for another instance to give back
    /// if this one dies first ([`Jobs::end_orphaned`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    handed: Option<Handed>,
    /// Ended by another instance, which gave its price back: its owner must not settle it again.
    #[serde(default)]
    given_back: bool,
    /// Made final by another instance that heard the job's webhook: its owner settles it and
    /// replaces this with its own final snapshot, `charged` filled in (`record.lua` lets it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(super) unsettled: bool,
}

impl Snapshot {
    /// `job` as it stands at `now` on the book's clock, as its version `job.published`.
    fn of(job: &Job, now: Nanos) -> Self {
        Snapshot {
            owner: job.owner.caller.clone(),
            tenant: job.owner.tenant.clone(),
            prediction: job.last.clone(),
            upstream_id: job.upstream_id.clone(),
            next_poll_unix_ms: unix_ms(SystemTime::now()).saturating_add((job.next_poll_at - now).as_u64() / 1_000_000),
            created_unix_ms: unix_ms(job.created),
            version: job.published,
            is_final: job.last.status.is_terminal(),
            reserved: job.reserved,
            charged: job.charged,
            handed: job
                .held
                .as_ref()
                .filter(|_| job.upstream_id.is_none() && !job.last.status.is_terminal())
                .and_then(Held::handed),
            given_back: false,
            unsettled: false,
        }
    }
}

/// The jobs changed since their snapshot was last written, and the publisher's wake-up call.
#[derive(Debug, Default)]
pub(super) struct Outbox {
    changed: Mutex<BTreeSet<String>>,
    wake: Notify,
}

impl Outbox {
    fn changed(&self) -> MutexGuard<'_, BTreeSet<String>> {
        self.changed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks `id` for the publisher (a job marked twice is written once, as it then stands).
    pub(super) fn mark(&self, id: &str) {
        self.changed().insert(id.to_owned());
        self.wake.notify_one();
    }

    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.changed()).into_iter().collect()
    }

    fn put_back(&self, ids: Vec<String>) {
        self.changed().extend(ids);
    }
}

/// A job another instance ended while it waited here ([`Jobs::ended_elsewhere`]).
pub(super) struct EndedElsewhere {
    /// Why, as its agent is told.
    pub(super) reason: String,
    /// Whether that instance gave its price back (then this one must not settle it).
    pub(super) given_back: bool,
}

/// The one writer of an instance's snapshots (see [`Jobs::published_in`]).
pub(super) struct Publisher {
    mirror: Arc<dyn JobMirror>,
    book: Arc<Mutex<Book>>,
    outbox: Arc<Outbox>,
    clock: SharedClock,
}

impl Publisher {
    /// Writes the marked jobs until `stop`: each as it stands when its turn comes. When Redis
    /// does not take a write, that job and the rest stay marked and the round is tried again
    /// after a backoff (Redis is most likely down for all of them).
    async fn run(self, stop: CancellationToken) {
        let mut retry_in = REPUBLISH_FIRST;
        let mut failing = false;
        loop {
            tokio::select! {
                () = self.outbox.wake.notified() => {}
                () = stop.cancelled() => return,
            }
            loop {
                let marked = self.outbox.take();
                if marked.is_empty() {
                    break;
                }
                let Err((error, unwritten)) = self.write_each(marked).await else {
                    if std::mem::take(&mut failing) {
                        tracing::info!("job states published to the shared store again");
                    }
                    retry_in = REPUBLISH_FIRST;
                    continue;
                };
                self.outbox.put_back(unwritten);
                if std::mem::replace(&mut failing, true) {
                    tracing::debug!(%error, ?retry_in, "still cannot publish job states");
                } else {
                    tracing::warn!(%error, "could not publish job states to the shared store; trying again until it takes them");
                }
                tokio::select! {
                    () = tokio::time::sleep(retry_in) => {}
                    () = stop.cancelled() => return,
                }
                retry_in = (retry_in * 2).min(REPUBLISH_AT_MOST);
            }
        }
    }

    /// Writes each of `ids` in turn; on the first failure, the error and the ids not written.
    async fn write_each(&self, ids: Vec<String>) -> Result<(), (StoreError, Vec<String>)> {
        for (i, id) in ids.iter().enumerate() {
            if let Err(error) = self.write(id).await {
                return Err((error, ids[i..].to_vec()));
            }
        }
        Ok(())
    }

    /// Writes job `id`'s snapshot as it stands (nothing once it has left the book), then adds it
    /// to or removes it from the shared set of jobs in flight if that changed: after the
    /// snapshot, so a lister that finds a member also finds its snapshot.
    async fn write(&self, id: &str) -> Result<(), StoreError> {
        let now = self.clock.now();
        let marked = lock_book(&self.book).get_mut(id).map(|job| {
            job.published += 1;
            let pending = !job.last.status.is_terminal();
            (Snapshot::of(job, now), (pending != job.indexed).then_some(pending))
        });
        let Some((snapshot, index)) = marked else { return Ok(()) };
        match serde_json::to_string(&snapshot) {
            // Written, or Redis kept the one there (final, or newer): either way Redis has it right.
            Ok(value) => {
                self.mirror.put_record(&snapshot_key(id), &value, snapshot.version, keep()).await?;
            }
            Err(error) => tracing::warn!(%error, predict_id = id, "a job's snapshot cannot be written as JSON"),
        }
        if let Some(in_flight) = index {
            if in_flight {
                self.mirror.set_add(IN_FLIGHT_KEY, id, keep()).await?;
            } else {
                self.mirror.set_remove(IN_FLIGHT_KEY, &[id.to_owned()]).await?;
            }
            if let Some(job) = lock_book(&self.book).get_mut(id) {
                job.indexed = in_flight;
            }
        }
        Ok(())
    }
}

/// Where what the [`Cadence`] learnt is kept for every instance, and for the next start.
const CADENCE_KEY: &str = "{upstream}job:durations";
/// How often an instance writes what it learnt, when it learnt something (wall clock).
const CADENCE_EVERY: Duration = Duration::from_secs(5);
/// How long what was learnt is kept after its last write.
const CADENCE_KEPT: Duration = Duration::from_secs(7 * 86_400);

/// Starts `cadence` from what the instances learnt before (in `redis`), then writes what it
/// learns every [`CADENCE_EVERY`] until `stop`: the last writer's durations are what a restarted
/// instance starts from.
async fn share_cadence(cadence: Arc<Cadence>, redis: Arc<dyn JobMirror>, stop: CancellationToken) {
    match redis.get(CADENCE_KEY).await {
        Ok(Some(raw)) => match serde_json::from_str::<cadence::Learnings>(&raw) {
            Ok(learnt) => cadence.start_from(&learnt),
            Err(error) => {
                tracing::warn!(%error, "what was learnt of job lengths cannot be read; starting from the hints")
            }
        },
        Ok(None) => {}
        Err(error) => tracing::warn!(%error, "cannot read what was learnt of job lengths; starting from the hints"),
    }
    let keep = || async {
        let Some(learnt) = cadence.learnt() else { return };
        let Ok(value) = serde_json::to_string(&learnt) else { return };
        if let Err(error) = redis.put_record(CADENCE_KEY, &value, 0, CADENCE_KEPT).await {
            tracing::debug!(%error, "could not keep what was learnt of job lengths");
        }
    };
    crate::clock::every(CADENCE_EVERY, stop, keep).await;
    // Stopping: what was learnt since the last write is kept for the next start.
    keep().await;
}

/// How long snapshots and the set of jobs in flight are kept after their last write.
pub(super) fn keep() -> Duration {
    KEEP_FOR.to_duration()
}

pub(super) fn snapshot_key(id: &str) -> String {
    format!("job:{{{id}}}")
}

pub(super) fn unix_ms(at: SystemTime) -> u64 {
    at.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Jobs {
    /// This book, published in `redis` for the other instances: starts its publisher, which
    /// runs until the book's stop token is cancelled. Call it once, inside a Tokio runtime
    /// (outside one the book stays this instance's own, and says so).
    pub fn published_in(mut self, store: Arc<dyn Store>) -> Self {
        let Some(redis) = store.clone().job_mirror() else { return self };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!("no async runtime to publish jobs from: other instances will not see this one's jobs");
            return self;
        };
        let publisher = Publisher {
            mirror: redis.clone(),
            book: self.book.clone(),
            outbox: self.outbox.clone(),
            clock: self.clock.clone(),
        };
        runtime.spawn(publisher.run(self.stop.clone()));
        runtime.spawn(share_cadence(self.cadence.clone(), redis.clone(), self.stop.clone()));
        self.shared = Some(redis);
        self.settle_in = Some(store);
        self
    }

    /// Marks the job for the publisher, which writes its snapshot for the other instances (the
    /// book's callers never wait on Redis).
    pub(super) fn publish(&self, id: &str) {
        if self.shared.is_some() {
            self.outbox.mark(id);
        }
    }

    /// `owner`'s job `id` as another instance published it.
    pub(super) async fn published(&self, owner: &str, id: &str) -> Option<Snapshot> {
        let redis = self.shared.as_ref()?;
        let raw = redis.get(&snapshot_key(id)).await.ok()??;
        serde_json::from_str::<Snapshot>(&raw).ok().filter(|s| s.owner == owner)
    }

    pub(super) fn view_of_snapshot(snapshot: Snapshot) -> JobView {
        let pending = !snapshot.prediction.status.is_terminal();
        let wait = Nanos::from_millis(snapshot.next_poll_unix_ms.saturating_sub(unix_ms(SystemTime::now())));
        JobView {
            prediction: snapshot.prediction,
            wait: pending.then_some(wait),
            queue_ahead: None,
            created: SystemTime::UNIX_EPOCH + Duration::from_millis(snapshot.created_unix_ms),
            reserved: snapshot.reserved,
            charged: snapshot.charged,
        }
    }

    /// Cancels `owner`'s job `id` that another instance accepted, as it published it. A started
    /// job is cancelled upstream, and in its snapshot; the owning instance sees the cancel at its
    /// next poll and gives the slots back. A job still waiting in that instance's queue can only
    /// be taken out by it: the request is left in Redis, and the answer is the job as that
    /// instance publishes it once canceled.
    pub(super) async fn cancel_elsewhere(&self, owner: &str, id: &str) -> Result<Option<JobView>, UpstreamError> {
        let Some(mut snapshot) = self.published(owner, id).await else { return Ok(None) };
        if snapshot.prediction.status.is_terminal() {
            return Ok(Some(Self::view_of_snapshot(snapshot)));
        }
        let Some(upstream_id) = snapshot.upstream_id.clone() else {
            return self.ask_owner_to_cancel(owner, id).await;
        };
        let answer = self.upstream.cancel_prediction(&upstream_id).await;
        self.metrics.upstream("cancel_prediction", UpstreamError::outcome_of(&answer));
        match answer {
            // Finished before the cancel arrived: keep the real outcome.
            Ok(prediction) if prediction.status.is_terminal() => {
                snapshot.prediction = Prediction { id: id.to_owned(), ..prediction };
            }
            Ok(_) | Err(UpstreamError::NotFound) => {
                snapshot.prediction.status = PredictionStatus::Canceled;
            }
            Err(error) => return Err(error),
        }
        // Final: the owner's later writes of the job, not final until it polls, cannot undo it.
        (snapshot.version, snapshot.is_final) = (snapshot.version.saturating_add(1), true);
        if let (Some(redis), Ok(value)) = (&self.shared, serde_json::to_string(&snapshot)) {
            match redis.put_record(&snapshot_key(id), &value, snapshot.version, keep()).await {
                Ok(true) => {}
                // The owner published it final meanwhile: that stands, and is the answer.
                Ok(false) => {
                    if let Some(there) = self.published(owner, id).await {
                        return Ok(Some(Self::view_of_snapshot(there)));
                    }
                }
                // The owner sees the cancel at its next poll of the upstream, and publishes it.
                Err(error) => tracing::debug!(%error, "could not publish a cancel to the shared store"),
            }
        }
        Ok(Some(Self::view_of_snapshot(snapshot)))
    }

    /// Ends the jobs `ids` that waited in another instance's queue when it died (the shared line
    /// took them out, as their instance stopped saying it is alive): each still waiting, never
    /// submitted, is published `failed` with the reason, final, so its agent polling on any
    /// instance learns it will never run and may call again; nothing of it ran upstream. Its
    /// caller's in-flight slots were held under the dead instance's leases and come back when
    /// they run out.
    pub async fn end_orphaned(&self, ids: Vec<String>) {
        let Some(redis) = &self.shared else { return };
        for id in ids {
            let Ok(Some(raw)) = redis.get(&snapshot_key(&id)).await else { continue };
            let Ok(mut snapshot) = serde_json::from_str::<Snapshot>(&raw) else { continue };
            if snapshot.prediction.status.is_terminal() || snapshot.upstream_id.is_some() {
                continue;
            }
            let handed = snapshot.handed.take();
            if handed.is_some() {
                (snapshot.given_back, snapshot.charged) = (true, Some(0));
            }
            snapshot.prediction.status = PredictionStatus::Failed;
            snapshot.prediction.error = Some(
                "the server instance it waited on stopped before submitting it: nothing ran upstream; call again"
                    .into(),
            );
            (snapshot.version, snapshot.is_final) = (snapshot.version.saturating_add(1), true);
            let Ok(value) = serde_json::to_string(&snapshot) else { continue };
            match redis.put_record(&snapshot_key(&id), &value, snapshot.version, keep()).await {
                Ok(written) => {
                    let _ = redis.set_remove(IN_FLIGHT_KEY, std::slice::from_ref(&id)).await;
                    tracing::warn!(predict_id = %id, "a job that waited on a dead server instance was ended as failed");
                    // Nothing ran: the price its call reserved goes back, once (only the writer of
                    // the final snapshot gives it back, and its owner then never settles it).
                    // In a task of its own: a settlement the store does not take is tried for a minute,
                    // which must not hold up ending the dead instance's other jobs.
                    if let (true, Some(handed), Some(store)) = (written, handed, &self.settle_in) {
                        let (store, clock, metrics) = (store.clone(), self.clock.clone(), self.metrics.clone());
                        tokio::spawn(async move {
                            let settled = handed.give_back(store, clock, metrics).await;
                            tracing::info!(predict_id = %id, reserved = settled.reserved, charged = settled.charged, "the price of a dead instance's job was given back");
                        });
                    }
                }
                Err(error) => tracing::warn!(%error, predict_id = %id, "could not end a dead instance's job"),
            }
        }
    }

    /// Why job `id` was ended by another instance while it waited here, if it was: its published
    /// snapshot is final (a cancel, or [`Jobs::end_orphaned`]). Over a shared store only; a store
    /// that cannot answer says nothing (the job goes on).
    pub(super) async fn ended_elsewhere(&self, id: &str) -> Option<EndedElsewhere> {
        let redis = self.shared.as_ref()?;
        let raw = redis.get(&snapshot_key(id)).await.ok()??;
        let snapshot = serde_json::from_str::<Snapshot>(&raw).ok()?;
        (snapshot.is_final && snapshot.prediction.status.is_terminal()).then(|| EndedElsewhere {
            reason: snapshot
                .prediction
                .error
                .unwrap_or_else(|| "another server instance ended it before it was submitted".into()),
            given_back: snapshot.given_back,
        })
    }

    /// Has the queue end, through [`Jobs::end_orphaned`], the jobs of a dead instance that a claim
    /// here takes out of the shared line.
    pub fn end_orphans_of_dead_instances(self: &Arc<Self>) {
        let jobs = Arc::downgrade(self);
        self.queue.on_orphans(Box::new(move |ids| {
            if let (Some(jobs), Ok(runtime)) = (jobs.upgrade(), tokio::runtime::Handle::try_current()) {
                runtime.spawn(async move { jobs.end_orphaned(ids).await });
            }
        }));
    }

    /// Leaves a cancel request for the instance whose queue holds `id`, and waits (at most
    /// [`CANCEL_CONFIRM`]) for it to publish the job final.
    pub(super) async fn ask_owner_to_cancel(&self, owner: &str, id: &str) -> Result<Option<JobView>, UpstreamError> {
        let unreachable =
            |e: crate::store::StoreError| UpstreamError::Unavailable(format!("cannot ask for the cancel: {e}"));
        let Some(redis) = &self.shared else { return Ok(None) };
        redis.set_add(CANCEL_REQUESTS_KEY, id, KEEP_FOR.to_duration()).await.map_err(unreachable)?;
        let asked = std::time::Instant::now();
        loop {
            tokio::time::sleep(CANCEL_REQUESTS_EVERY / 4).await;
            match self.published(owner, id).await {
                Some(snapshot) if snapshot.prediction.status.is_terminal() => {
                    return Ok(Some(Self::view_of_snapshot(snapshot)));
                }
                None => return Ok(None),
                Some(_) if asked.elapsed() >= CANCEL_CONFIRM => {
                    return Err(UpstreamError::Unavailable(format!(
                        "the job waits in another server instance's queue, which has not confirmed the cancel \
                         within {} s (it may be down: then the job never starts, and its slots come back when \
                         their leases run out); the request stands, poll the job to see it canceled",
                        CANCEL_CONFIRM.as_secs()
                    )));
                }
                Some(_) => {}
            }
        }
    }

    /// Cancels the jobs of this instance that another instance was asked to cancel (see
    /// `Jobs::cancel_elsewhere`): one read of the requests while this instance has jobs not yet
    /// final; the requests it answered are removed, the others left for their instances.
    pub async fn answer_cancel_requests(&self) -> Result<usize, crate::store::StoreError> {
        let Some(redis) = &self.shared else { return Ok(0) };
        if self.in_flight() == 0 {
            return Ok(0);
        }
        let requested = redis.set_members(CANCEL_REQUESTS_KEY).await?;
        let mine: Vec<(String, String)> = {
            let book = self.book();
            requested.iter().filter_map(|id| book.get(id).map(|job| (id.clone(), job.owner.caller.clone()))).collect()
        };
        let mut answered = Vec::with_capacity(mine.len());
        for (id, owner) in mine {
            match self.cancel(&owner, &id).await {
                Ok(_) => answered.push(id),
                // The upstream refused the cancel: leave the request for the next round.
                Err(error) => tracing::warn!(%error, "could not cancel a job another instance asked to cancel"),
            }
        }
        let count = answered.len();
        redis.set_remove(CANCEL_REQUESTS_KEY, &answered).await?;
        Ok(count)
    }

    /// Whose job `id` is (the caller id), on this instance or, over a shared store, another.
    pub async fn owner_of(&self, id: &str) -> Option<String> {
        if let Some(owner) = self.book().get(id).map(|job| job.owner.caller.clone()) {
            return Some(owner);
        }
        let raw = self.shared.as_ref()?.get(&snapshot_key(id)).await.ok()??;
        serde_json::from_str::<Snapshot>(&raw).ok().map(|snapshot| snapshot.owner)
    }

    /// Every job not yet final — of `caller`, of `tenant`, or all — oldest first: this
    /// instance's from its book, and over a shared store the other instances' from their
    /// snapshots.
    pub async fn in_flight_of(&self, caller: Option<&str>, tenant: Option<&str>) -> Vec<JobListing> {
        let wanted = |owner: &str, owner_tenant: Option<&str>| {
            caller.is_none_or(|c| c == owner) && tenant.is_none_or(|t| owner_tenant == Some(t))
        };
        let local: Vec<(String, Owner)> = self
            .book()
            .values()
            .filter(|j| !j.last.status.is_terminal() && wanted(&j.owner.caller, j.owner.tenant.as_deref()))
            .map(|j| (j.last.id.clone(), j.owner.clone()))
            .collect();
        let mut listed: Vec<JobListing> = local
            .into_iter()
            .filter_map(|(id, owner)| {
                let view = self.view_of(&id)?;
                Some(JobListing::of(view, owner.caller, owner.tenant, true))
            })
            .collect();
        if let Some(redis) = &self.shared {
            let members = redis.set_members(IN_FLIGHT_KEY).await.unwrap_or_default();
            let elsewhere: Vec<String> = {
                let book = self.book();
                members.into_iter().filter(|id| !book.contains_key(id)).collect()
            };
            let keys: Vec<String> = elsewhere.iter().map(|id| snapshot_key(id)).collect();
            let reads = keys.iter().map(|key| redis.get(key));
            let snapshots = futures::future::join_all(reads).await;
            let mut gone = Vec::new();
            for (id, read) in elsewhere.into_iter().zip(snapshots) {
                // A read that failed says nothing: the member stays for the next listing.
                let Ok(raw) = read else { continue };
                match raw.and_then(|raw| serde_json::from_str::<Snapshot>(&raw).ok()) {
                    Some(s) if !s.prediction.status.is_terminal() => {
                        if wanted(&s.owner, s.tenant.as_deref()) {
                            let (owner, tenant) = (s.owner.clone(), s.tenant.clone());
                            listed.push(JobListing::of(Self::view_of_snapshot(s), owner, tenant, false));
                        }
                    }
                    // Final, expired or unreadable: no longer in flight anywhere.
                    Some(_) | None => gone.push(id),
                }
            }
            if let Err(error) = redis.set_remove(IN_FLIGHT_KEY, &gone).await {
                tracing::debug!(%error, "could not tidy the shared set of jobs in flight");
            }
        }
        listed.sort_by_key(|job| job.created_unix_ms);
        listed
    }
}
