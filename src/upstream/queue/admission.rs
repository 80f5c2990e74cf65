//! Admission: a place promised before the call is charged, then turned into an account slot at
//! the door (when one is free and nobody waits) or into a job waiting its turn.

use std::sync::Arc;

use tokio::sync::oneshot;

use super::round_robin::{State, Waiting};
use super::{AccountSlot, Blocker, Counted, FairQueue, Flowing, QueueFull, QueuePlace, Standing, Turn, tiers};
use crate::store::Lease;
use crate::upstream::classes::ClassId;

impl FairQueue {
    /// Promises a place for a job of `class` standing as `standing` (of an unverified caller,
    /// held to their share; never one a reserved tier is still owed), or says why there is none.
    pub fn reserve(self: &Arc<Self>, class: ClassId, standing: Standing) -> Result<QueuePlace, QueueFull> {
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
        Ok(QueuePlace { queue: self.clone(), class, standing, used: false })
    }
}

impl QueuePlace {
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
            Ok((leases, shared_at)) => {
                self.release_place(&mut queue.state());
                self.used = true;
                let taken_at = queue.clock.now();
                Ok(AccountSlot { counted, taken_at, shared_at, _leases: leases })
            }
            Err((wait, blocker)) => {
                let mut state = queue.state();
                counted.give_back(&mut state);
                let until = queue.clock.now() + wait;
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
        let job = Waiting::new(id, self.class, self.standing, crate::clock::Nanos::ZERO, turn);
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

impl Drop for QueuePlace {
    fn drop(&mut self) {
        if !self.used {
            self.release_place(&mut self.queue.state());
        }
    }
}
