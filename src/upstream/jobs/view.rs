//! The book as agents and operators see it: a job's view and its estimated wait, an agent's poll
//! (answered from the book, never from the upstream), and counts of the jobs in flight.

use std::collections::HashMap;
use std::time::SystemTime;

use super::{Job, JobView, Jobs, Owner, PENDING_ELSEWHERE_FOR, PENDING_ELSEWHERE_MAX};
use crate::clock::Nanos;
use crate::upstream::classes::ClassId;
use crate::upstream::queue::Position;

impl Jobs {
    /// `owner`'s job `id`, as it stands; `None` for someone else's job or none at all.
    pub fn view(&self, owner: &str, id: &str) -> Option<JobView> {
        self.book().get(id).filter(|j| j.owner.caller == owner)?;
        self.view_of(id)
    }

    pub(super) fn view_of(&self, id: &str) -> Option<JobView> {
        let now = self.clock.now();
        let book = self.book();
        let job = book.get(id)?;
        let pending = !job.last.status.is_terminal();
        let queued = if pending && job.upstream_id.is_none() { self.queue.position(id) } else { None };
        let class = job.class;
        let wait = pending.then(|| match (&job.upstream_id, queued) {
            // Not submitted yet: the time in the queue, then the first useful poll.
            (None, Some(place)) => self.queue_wait(&book, class, place, now) + self.cadence.expected(class),
            (None, None) => self.cadence.expected(class),
            (Some(_), _) => job.news_at(now) - now,
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
            .map(|j| j.news_at(now) - now)
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
                let gap_left = self.queue.next_at(class) - now;
                gap_left + gap * place.alike_ahead as u64
            }
            None => Nanos::ZERO,
        };
        let free = rules.max_in_flight.saturating_sub(self.queue.occupancy().in_flight);
        let account = if place.ahead < free {
            Nanos::ZERO
        } else {
            let rounds = ((place.ahead - free) / rules.max_in_flight.max(1)) as u64;
            let first = Self::turnover(book, now).unwrap_or_else(|| self.typical_turnover());
            first + self.typical_turnover() * rounds
        };
        gaps.max(account)
    }

    /// How long until a full queue has room: until a job may leave it — when an account slot
    /// frees up (if none is free) and, while jobs of a class with a gap wait, when its gap has
    /// passed.
    pub(crate) fn place_frees_in(&self) -> Nanos {
        let now = self.clock.now();
        let account_full = self.queue.occupancy().in_flight >= self.queue.slots();
        let turnover = if account_full {
            Self::turnover(&self.book(), now).unwrap_or_else(|| self.typical_turnover())
        } else {
            Nanos::ZERO
        };
        turnover.max(self.queue.gaps_left(now)).max(Nanos::new(1))
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
            elsewhere.insert(key, now + PENDING_ELSEWHERE_FOR);
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

    /// The account's slots: those this instance's running jobs hold, `busy` before their expected
    /// end and `held_idle` past it (not yet known final: most likely ended, the server yet to learn
    /// it), and the account's `free` ones.
    pub fn account_slots(&self) -> AccountSlots {
        let now = self.clock.now();
        let free = self.queue.slots().saturating_sub(self.queue.occupancy().in_flight);
        let book = self.book();
        let running = book.values().filter(|j| j.upstream_id.is_some() && !j.last.status.is_terminal());
        let (busy, held_idle) = running
            .fold((0, 0), |(busy, idle), j| if now < j.expected_at { (busy + 1, idle) } else { (busy, idle + 1) });
        AccountSlots { busy, held_idle, free }
    }

    /// Jobs not final yet.
    pub fn in_flight(&self) -> usize {
        self.book().values().filter(|j| !j.last.status.is_terminal()).count()
    }
}

/// The account's slots as [`Jobs::account_slots`] splits them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct AccountSlots {
    /// Held by this instance's jobs before their expected end.
    pub busy: usize,
    /// Held by this instance's jobs past their expected end, not yet known final.
    pub held_idle: usize,
    /// Free for the next job (the account's, every instance's jobs counted).
    pub free: usize,
}
