//! The queue over the one line every instance's waiting jobs stand in ([`SharedLine`]), when the
//! shared store keeps one: a job that must wait joins the line, and the dispatcher claims for
//! the jobs waiting here. Whichever instance frees a slot (and says so, heard at once), the job
//! whose turn it is takes it, on whichever instance it waits: one round robin, one set of
//! reserved tiers and ranks, across every instance.
//!
//! The jobs themselves stay here (their turns, their callers); the line holds their order. What
//! this instance has not told the line yet (a job that just started waiting, one that left) is
//! told at the next step. While the store cannot answer, the queue goes by its own round robin
//! (counted and logged, like every store failure); when it answers again, every job here joins
//! again with the tag it had, so the line is whole again. An instance says it is alive every
//! [`LINE_HEARTBEAT`] while it has jobs in the line; one that stops (it died) has its jobs dropped
//! from the line once its mark and a grace have run out ([`LINE_ALIVE`](crate::store::LINE_ALIVE)
//! each), so they never hold it.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::{ACCOUNT_RETRY, AccountSlot, Counted, FairQueue, Shared, Standing};
use crate::clock::Nanos;
use crate::limit::Limiter;
use crate::store::{
    LINE_HEARTBEAT, Lease, LineAnswer, LineAt, LineClaim, LineEntry, SharedLine, SlotGuard, StoreError,
};

/// What a step over the line leaves the dispatcher to do.
pub(super) enum LineStep {
    /// Step again at once: a job went, or the store failed (the queue limits locally now).
    Again,
    /// Wait for a change, a slot freed anywhere, or this instant (on the queue's clock).
    Wait(Option<Nanos>),
}

/// The most entries one claim reads: every place of the queue on a handful of instances.
const SCAN: usize = 4096;

impl FairQueue {
    /// The line the queue goes by now: the store keeps one, and answers.
    pub(super) fn line_now(&self, now: Nanos) -> Option<(&Shared, &Arc<dyn SharedLine>)> {
        let shared = self.shared.as_ref()?;
        let line = shared.line.as_ref()?;
        (!shared.down(now)).then_some((shared, line))
    }

    /// The store could not answer `what` about the line: the queue limits locally for a while,
    /// and every job waiting here joins again, with its tag, once the store answers.
    pub(super) fn line_failed(&self, shared: &Shared, error: &StoreError, what: &str) {
        shared.failed(error, what, self.clock.now());
        self.state().rejoin_all();
    }

    /// The leases a job the line gave slots to holds, each said when given back: the account's,
    /// the share's for an unverified caller's job, its tier's. With no standing (the job left
    /// meanwhile), every lease the claim may have taken, to give back at once.
    fn line_leases(&self, shared: &Shared, lease: Lease, standing: Option<Standing>) -> Vec<SlotGuard> {
        let guard = |key: &str, limiter: &Limiter| shared.slot(key, limiter, lease);
        let mut leases = vec![guard(&shared.account_key, &shared.account)];
        if standing.is_none_or(|s| s.unverified) {
            leases.push(guard(&shared.unverified_key, &shared.unverified));
        }
        for (i, key) in shared.tier_keys.iter().enumerate() {
            if standing.is_none_or(|s| s.reserved_tier() == Some(i)) {
                leases.push(guard(key, &shared.tier_limiter));
            }
        }
        leases
    }

    /// Asks the line for a turn for this instance's jobs (or `candidate`, a job at the door).
    pub(super) async fn ask_line(
        &self,
        shared: &Shared,
        line: &Arc<dyn SharedLine>,
        lease: Lease,
        candidate: Option<&LineEntry>,
    ) -> Result<LineAnswer, StoreError> {
        let (answer, dropped) = self.ask_line_dropping(shared, line, lease, candidate).await?;
        if !dropped.is_empty() {
            tracing::warn!(
                jobs = dropped.len(),
                "jobs of a server instance no longer alive were taken out of the shared line"
            );
            if let Some(end) = self.orphans.get() {
                end(dropped);
            }
        }
        Ok(answer)
    }

    /// [`FairQueue::ask_line`]'s round trip: the answer, and the jobs of instances no longer
    /// alive it took out of the line.
    async fn ask_line_dropping(
        &self,
        shared: &Shared,
        line: &Arc<dyn SharedLine>,
        lease: Lease,
        candidate: Option<&LineEntry>,
    ) -> Result<(LineAnswer, Vec<String>), StoreError> {
        let gaps: Vec<Option<(&str, &Limiter)>> =
            shared.gaps.iter().map(|gap| gap.as_ref().map(|(key, limiter)| (key.as_str(), limiter))).collect();
        let tiers: Vec<(&str, f64)> =
            shared.tier_keys.iter().zip(&self.rules.tiers).map(|(key, tier)| (key.as_str(), tier.reserved)).collect();
        let claim = LineClaim {
            account: (&shared.account_key, self.rules.max_in_flight as u64),
            share: (&shared.unverified_key, self.rules.unverified_slots as u64),
            learnt: self.learnt_at(shared).map(|(_, at)| at),
            gaps: &gaps,
            tiers: &tiers,
            scan: SCAN,
            candidate,
            lease,
            told: &shared.freed_channel,
        };
        let at = LineAt { name: &shared.name, instance: &shared.instance };
        line.claim(at, claim).await
    }

    /// A job at the door as the line would name it, never joining: it goes now only if it would
    /// be next.
    pub(super) fn candidate(&self, shared: &Shared, flow: &super::Flowing<'_>, class: super::ClassId) -> LineEntry {
        let door = shared.doors.fetch_add(1, Ordering::Relaxed);
        LineEntry {
            job: format!("door-{door}"),
            flow: flow.name.to_owned(),
            weight: flow.quantum.clamp(0.01, 1000.0),
            class: class.index(),
            unverified: flow.standing.unverified,
            tier: flow.standing.reserved_tier(),
            rank: flow.standing.rank,
        }
    }

    /// What the line said to a job at the door: its slot, when it went.
    pub(super) fn door_slot(
        self: &Arc<Self>,
        shared: &Shared,
        answer: LineAnswer,
        counted: Counted,
        lease: Lease,
    ) -> Result<AccountSlot, Counted> {
        match answer {
            LineAnswer::Go { at, limit, .. } => {
                if let Some(limit) = limit {
                    shared.heard(limit);
                }
                let standing = counted.standing;
                let taken_at = self.clock.now();
                let leases = self.line_leases(shared, lease, Some(standing));
                Ok(AccountSlot { counted, taken_at, shared_at: limit.map(|_| at), _leases: leases })
            }
            LineAnswer::Wait { .. } => Err(counted),
        }
    }

    /// One step over the line: what left here leaves it, what waits here joins it, and a claim
    /// for the jobs waiting here. `alive_at` is when this instance last said it is alive (real
    /// time: the line's marks run on the store's clock).
    pub(super) async fn line_step(
        self: &Arc<Self>,
        shared: &Shared,
        line: &Arc<dyn SharedLine>,
        alive_at: &mut tokio::time::Instant,
    ) -> LineStep {
        let at = LineAt { name: &shared.name, instance: &shared.instance };
        let leaving = std::mem::take(&mut self.state().leaving);
        for member in &leaving {
            if let Err(error) = line.leave(at, member).await {
                // Its entry stays until its turn: a claim for a job not here gives the slots back.
                self.line_failed(shared, &error, "take a job out of the shared line");
                return LineStep::Again;
            }
        }
        let joining = self.state().joining(self.clock.now());
        for job in joining {
            match line.join(at, &job.entry, &job.place).await {
                Ok((tag, member)) => {
                    let mut state = self.state();
                    if !state.joined(&job.entry.job, member.clone(), tag) {
                        state.leaving.push(member);
                    }
                }
                Err(error) => {
                    self.line_failed(shared, &error, "put a job in the shared line");
                    return LineStep::Again;
                }
            }
        }
        let now = self.clock.now();
        if self.state().joined_count() == 0 {
            // Only jobs whose retry waits are here, if any: until the first may join.
            return LineStep::Wait(self.state().next_wake(&self.rules_now(), now));
        }
        if alive_at.elapsed() >= LINE_HEARTBEAT {
            *alive_at = tokio::time::Instant::now();
            if let Err(error) = line.alive(at).await {
                self.line_failed(shared, &error, "say this instance is alive to the shared line");
                return LineStep::Again;
            }
        }
        let lease = Lease::new();
        match self.ask_line(shared, line, lease, None).await {
            Ok(LineAnswer::Go { job, at, limit }) => {
                if let Some(limit) = limit {
                    shared.heard(limit);
                }
                let mut state = self.state();
                match state.take_job(&job) {
                    Some(waiting) => {
                        let counted = Counted::take(self, &mut state, waiting.standing);
                        drop(state);
                        let leases = self.line_leases(shared, lease, Some(waiting.standing));
                        let taken_at = self.clock.now();
                        let slot = AccountSlot { counted, taken_at, shared_at: limit.map(|_| at), _leases: leases };
                        // A job that left meanwhile drops its receiver: the slot comes straight back.
                        let _ = waiting.turn.send(slot);
                    }
                    None => {
                        // It left here before the line heard: its slots go back (and are said).
                        drop(state);
                        drop(self.line_leases(shared, lease, None));
                    }
                }
                LineStep::Again
            }
            Ok(LineAnswer::Wait { wake, mine, complete, .. }) => {
                self.state().heard_places(&mine, complete);
                // A slot freed anywhere is heard at once; the retry covers a message lost.
                let wait = wake.map_or(ACCOUNT_RETRY, |w| w.clamp(Nanos::new(1), ACCOUNT_RETRY));
                let local = self.state().next_wake(&self.rules_now(), now);
                let at = now + wait;
                LineStep::Wait(Some(local.map_or(at, |l| l.min(at))))
            }
            Err(error) => {
                self.line_failed(shared, &error, "claim a turn in the shared line");
                LineStep::Again
            }
        }
    }
}
