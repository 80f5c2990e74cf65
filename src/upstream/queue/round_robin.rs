//! Who goes next: deficit round robin across flows, FIFO within a flow, with the classes' gaps and
//! the unverified callers' share deciding which heads may go now (see [`super::FairQueue`]), and
//! the tiers' reserved slots and ranks which of those go first (see [`super::tiers`]).

use std::collections::{HashMap, VecDeque};

use tokio::sync::oneshot;

use super::{AccountSlot, QueueRules, Standing};
use crate::clock::Nanos;
use crate::store::{JoinAt, LineEntry};
use crate::upstream::classes::ClassId;

pub(super) struct Waiting {
    pub(super) id: String,
    pub(super) class: ClassId,
    /// Where it stands: an unverified caller's job is held to their share; a tier's draws on
    /// its reservation and goes by its rank.
    pub(super) standing: Standing,
    pub(super) not_before: Nanos,
    /// The flow it waits in, and that flow's quantum (set by `State::push`).
    pub(super) flow: String,
    pub(super) quantum: f64,
    pub(super) turn: oneshot::Sender<AccountSlot>,
    /// Over a shared line: how it is named there and its tag, once it has joined.
    pub(super) joined: Option<Joined>,
    /// A job put back at the front of its flow (a retry): it keeps its place in the line too.
    pub(super) front: bool,
    /// Over a shared line: how many go before it, as the line last said.
    pub(super) ahead: Option<usize>,
    /// Over a shared line: where it joins again, having lost its entry (the store failed).
    pub(super) rejoin_at: Option<Joined>,
}

impl Waiting {
    /// Job `id` of `class` standing as `standing`, not to leave before `not_before`; its slot
    /// goes into `turn`. Its flow is set when it is pushed ([`State::push`]).
    pub(super) fn new(
        id: &str,
        class: ClassId,
        standing: Standing,
        not_before: Nanos,
        turn: oneshot::Sender<AccountSlot>,
    ) -> Self {
        let (flow, quantum) = (String::new(), 1.0);
        let (joined, front, ahead, rejoin_at) = (None, false, None, None);
        Self { id: id.to_owned(), class, standing, not_before, flow, quantum, turn, joined, front, ahead, rejoin_at }
    }
}

/// A waiting job's entry in the shared line.
#[derive(Debug, Clone)]
pub(super) struct Joined {
    /// Its name there ([`LineEntry::member`]).
    pub(super) member: String,
    /// Its tag: a job put back keeps it.
    pub(super) tag: f64,
}

/// A waiting job that has not joined the shared line yet, as it joins.
pub(super) struct Joining {
    pub(super) entry: LineEntry,
    /// Where: at the tag it had (it joined before the store failed), at the front (a job put
    /// back), or behind its flow's.
    pub(super) place: JoinAt,
}

#[derive(Default)]
pub(super) struct Flow {
    pub(super) quantum: f64,
    pub(super) deficit: f64,
    pub(super) jobs: VecDeque<Waiting>,
}

/// What the queue keeps per job class.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct PerClass {
    /// No job of the class leaves before this (its gap since the last one, or as the shared store
    /// said); 0 for a class without a gap.
    pub(super) next_at: Nanos,
    /// Places promised to jobs of the class and not used yet.
    pub(super) reserved: usize,
}

/// What the queue keeps per tier with a reserved share or a rank.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct PerTier {
    /// Slots its jobs (of configured callers) hold.
    pub(super) in_flight: usize,
    /// Places promised to its jobs and not used yet.
    pub(super) reserved: usize,
}

#[derive(Default)]
pub(super) struct State {
    pub(super) in_flight: usize,
    /// Of `in_flight`, the slots unverified callers' jobs hold.
    pub(super) unverified_in_flight: usize,
    /// Per class, by [`ClassId`].
    pub(super) classes: Vec<PerClass>,
    /// Over a shared store: no job leaves before this (the account was full everywhere).
    pub(super) account_full_until: Nanos,
    /// Over a shared store: no unverified job leaves before this (their share was taken).
    pub(super) unverified_full_until: Nanos,
    pub(super) flows: HashMap<String, Flow>,
    /// Flows with waiting jobs, in round-robin order.
    pub(super) ring: VecDeque<String>,
    /// Of the reservations, those of unverified callers.
    pub(super) reserved_unverified: usize,
    /// Per tier, by its index in [`QueueRules::tiers`].
    pub(super) tiers: Vec<PerTier>,
    /// Over a shared line: the entries of jobs that left here, to take out of the line.
    pub(super) leaving: Vec<String>,
}

impl State {
    /// An empty state for a queue under `rules` (its classes and tiers).
    pub(super) fn new(rules: &QueueRules) -> Self {
        let (classes, tiers) = (rules.classes.len(), rules.tiers.len());
        Self { classes: vec![PerClass::default(); classes], tiers: vec![PerTier::default(); tiers], ..Self::default() }
    }

    /// Slots tier `i`'s jobs hold.
    pub(super) fn in_flight_of(&self, i: usize) -> usize {
        self.tiers.get(i).map_or(0, |t| t.in_flight)
    }

    /// Tier `i`'s jobs waiting.
    pub(super) fn waiting_of_tier(&self, i: usize) -> usize {
        self.flows.values().flat_map(|f| &f.jobs).filter(|w| w.standing.reserved == Some(i)).count()
    }

    /// Places tier `i`'s jobs hold: waiting, or promised.
    pub(super) fn places_held_by(&self, i: usize) -> usize {
        let promised = self.tiers.get(i).map_or(0, |t| t.reserved);
        self.waiting_of_tier(i).saturating_add(promised)
    }

    /// What is kept for `class` (nothing, for a class the queue does not have).
    pub(super) fn of_class(&self, class: ClassId) -> PerClass {
        self.classes.get(class.index()).copied().unwrap_or_default()
    }

    /// No job of `class` leaves before `at`.
    pub(super) fn set_next_at(&mut self, class: ClassId, at: Nanos) {
        if let Some(of) = self.classes.get_mut(class.index()) {
            of.next_at = at;
        }
    }

    /// Counts a place promised to a job of `class` standing as `standing`.
    pub(super) fn reserve_place(&mut self, class: ClassId, standing: Standing) {
        if let Some(of) = self.classes.get_mut(class.index()) {
            of.reserved = of.reserved.saturating_add(1);
        }
        if standing.unverified {
            self.reserved_unverified = self.reserved_unverified.saturating_add(1);
        }
        if let Some(tier) = standing.reserved.and_then(|i| self.tiers.get_mut(i)) {
            tier.reserved = tier.reserved.saturating_add(1);
        }
    }

    /// Gives back a place promised to a job of `class` standing as `standing`.
    pub(super) fn release_place(&mut self, class: ClassId, standing: Standing) {
        if let Some(of) = self.classes.get_mut(class.index()) {
            of.reserved = of.reserved.saturating_sub(1);
        }
        if standing.unverified {
            self.reserved_unverified = self.reserved_unverified.saturating_sub(1);
        }
        if let Some(tier) = standing.reserved.and_then(|i| self.tiers.get_mut(i)) {
            tier.reserved = tier.reserved.saturating_sub(1);
        }
    }

    /// Places promised and not used yet, all classes together.
    pub(super) fn reserved(&self) -> usize {
        self.classes.iter().fold(0, |sum, of| sum.saturating_add(of.reserved))
    }

    pub(super) fn waiting(&self, class: Option<ClassId>) -> usize {
        self.flows.values().flat_map(|f| &f.jobs).filter(|w| class.is_none_or(|c| w.class == c)).count()
    }

    /// Jobs waiting per class, by [`ClassId`].
    pub(super) fn waiting_per_class(&self) -> Vec<usize> {
        let mut waiting = vec![0usize; self.classes.len()];
        for w in self.flows.values().flat_map(|f| &f.jobs) {
            if let Some(n) = waiting.get_mut(w.class.index()) {
                *n = n.saturating_add(1);
            }
        }
        waiting
    }

    /// Whether the unverified callers' share of the account is taken (here, or as the shared
    /// store last said).
    pub(super) fn unverified_share_taken(&self, rules: &QueueRules, now: Nanos) -> bool {
        self.unverified_in_flight >= rules.unverified_slots || now < self.unverified_full_until
    }

    pub(super) fn eligible(&self, w: &Waiting, rules: &QueueRules, now: Nanos) -> bool {
        now >= w.not_before
            && now >= self.of_class(w.class).next_at
            && !(w.standing.unverified && self.unverified_share_taken(rules, now))
    }

    /// Whether a job standing as `standing` is of a tier that holds fewer slots than it is
    /// reserved.
    pub(super) fn owed_a_slot(&self, standing: Standing, rules: &QueueRules) -> bool {
        standing.reserved.is_some_and(|i| self.in_flight_of(i) < rules.reserved_slots(i))
    }

    /// The next job to serve, taken out of its flow; `None` if no slot is free or no waiting job
    /// may go yet. Among the flows whose first job may go now, those of a tier still owed
    /// reserved slots go first, else those of the highest rank; among them, deficit round robin.
    pub(super) fn pick(&mut self, rules: &QueueRules, now: Nanos) -> Option<Waiting> {
        if self.in_flight >= rules.max_in_flight || now < self.account_full_until {
            return None;
        }
        let eligible_head = |state: &State, key: &String| {
            state
                .flows
                .get(key)
                .and_then(|f| f.jobs.front())
                .filter(|w| state.eligible(w, rules, now))
                .map(|w| w.standing)
        };
        let (mut top, mut any_owed) = (None, false);
        for head in self.ring.iter().filter_map(|key| eligible_head(self, key)) {
            top = top.max(Some(head.rank));
            any_owed |= self.owed_a_slot(head, rules);
        }
        let top = top?;
        let goes_now = |state: &State, s: Standing| if any_owed { state.owed_a_slot(s, rules) } else { s.rank == top };
        // Terminates: a flow that goes now earns at least its quantum (≥ 0.01) every round.
        loop {
            let key = self.ring.front()?.clone();
            let head_ok = eligible_head(self, &key).is_some_and(|s| goes_now(self, s));
            let flow = self.flows.get_mut(&key)?;
            if head_ok {
                if flow.deficit < 1.0 {
                    flow.deficit += flow.quantum;
                }
                if flow.deficit >= 1.0 {
                    flow.deficit -= 1.0;
                    let job = flow.jobs.pop_front();
                    if flow.jobs.is_empty() {
                        self.flows.remove(&key);
                        self.ring.pop_front();
                    } else if flow.deficit < 1.0 {
                        self.ring.rotate_left(1);
                    }
                    return job;
                }
            }
            self.ring.rotate_left(1);
        }
    }

    /// When something may become eligible without any slot being freed.
    pub(super) fn next_wake(&self, rules: &QueueRules, now: Nanos) -> Option<Nanos> {
        if self.in_flight >= rules.max_in_flight {
            return None;
        }
        if now < self.account_full_until && !self.ring.is_empty() {
            return Some(self.account_full_until);
        }
        self.flows
            .values()
            .filter_map(|f| f.jobs.front())
            // An unverified job whose share is held here waits for a slot to come back (which
            // wakes the dispatcher), not for a time.
            .filter(|w| !(w.standing.unverified && self.unverified_in_flight >= rules.unverified_slots))
            .map(|w| {
                let mut at = w.not_before.max(self.of_class(w.class).next_at);
                if w.standing.unverified {
                    at = at.max(self.unverified_full_until);
                }
                at
            })
            .filter(|&at| at > now)
            .min()
    }

    /// Whether a job may take a free slot at the door without overtaking anyone: nobody waits,
    /// or (for a configured caller's job) only unverified jobs whose share is taken, which
    /// could not have the slot anyway.
    pub(super) fn door_open(&self, rules: &QueueRules, standing: Standing, now: Nanos) -> bool {
        let unverified = standing.unverified;
        if self.in_flight >= rules.max_in_flight || now < self.account_full_until {
            return false;
        }
        if self.ring.is_empty() {
            return !unverified || !self.unverified_share_taken(rules, now);
        }
        !unverified
            && self.unverified_share_taken(rules, now)
            && self.flows.values().flat_map(|f| &f.jobs).all(|w| w.standing.unverified)
    }

    pub(super) fn unverified_waiting(&self) -> usize {
        self.flows.values().flat_map(|f| &f.jobs).filter(|w| w.standing.unverified).count()
    }

    /// Counts a slot taken by a job standing as `standing`.
    pub(super) fn take_slot(&mut self, standing: Standing) {
        self.in_flight = self.in_flight.saturating_add(1);
        if standing.unverified {
            self.unverified_in_flight = self.unverified_in_flight.saturating_add(1);
        }
        if let Some(tier) = standing.reserved.and_then(|i| self.tiers.get_mut(i)) {
            tier.in_flight = tier.in_flight.saturating_add(1);
        }
    }

    /// Gives back a slot taken by a job standing as `standing`.
    pub(super) fn give_slot(&mut self, standing: Standing) {
        self.in_flight = self.in_flight.saturating_sub(1);
        if standing.unverified {
            self.unverified_in_flight = self.unverified_in_flight.saturating_sub(1);
        }
        if let Some(tier) = standing.reserved.and_then(|i| self.tiers.get_mut(i)) {
            tier.in_flight = tier.in_flight.saturating_sub(1);
        }
    }

    /// Takes out the entries for `id` whose turn nobody waits for any more.
    pub(super) fn remove_abandoned(&mut self, id: &str) -> bool {
        let mut removed = false;
        let leaving = &mut self.leaving;
        self.flows.retain(|_, flow| {
            let before = flow.jobs.len();
            flow.jobs.retain(|w| {
                let gone = w.id == id && w.turn.is_closed();
                if let (true, Some(joined)) = (gone, &w.joined) {
                    leaving.push(joined.member.clone());
                }
                !gone
            });
            removed |= flow.jobs.len() != before;
            !flow.jobs.is_empty()
        });
        if removed {
            let flows = &self.flows;
            self.ring.retain(|key| flows.contains_key(key));
        }
        removed
    }

    pub(super) fn remove(&mut self, id: &str) -> bool {
        let Some(key) = self.flows.iter().find(|(_, f)| f.jobs.iter().any(|w| w.id == id)).map(|(k, _)| k.clone())
        else {
            return false;
        };
        if let Some(flow) = self.flows.get_mut(&key) {
            let leaving = &mut self.leaving;
            flow.jobs.retain(|w| {
                if let (true, Some(joined)) = (w.id == id, &w.joined) {
                    leaving.push(joined.member.clone());
                }
                w.id != id
            });
            if flow.jobs.is_empty() {
                self.flows.remove(&key);
                self.ring.retain(|k| *k != key);
            }
        }
        true
    }

    /// Puts a job [`State::pick`] took back at the front of its flow, with its unit of deficit,
    /// as if it had not been picked.
    pub(super) fn unpick(&mut self, job: Waiting) {
        let (flow, quantum) = (job.flow.clone(), job.quantum);
        self.push(&flow, quantum, job, true);
        if let Some(entry) = self.flows.get_mut(&flow) {
            entry.deficit += 1.0;
        }
    }

    /// Takes job `id` out of its flow, wherever it stands (the shared line chose it).
    pub(super) fn take_job(&mut self, id: &str) -> Option<Waiting> {
        let key = self.flows.iter().find(|(_, f)| f.jobs.iter().any(|w| w.id == id)).map(|(k, _)| k.clone())?;
        let flow = self.flows.get_mut(&key)?;
        let at = flow.jobs.iter().position(|w| w.id == id)?;
        let job = flow.jobs.remove(at);
        if flow.jobs.is_empty() {
            self.flows.remove(&key);
            self.ring.retain(|k| *k != key);
        }
        job
    }

    /// The waiting jobs that have not joined the shared line and may (their retry's wait over),
    /// as entries of `instance`'s.
    pub(super) fn joining(&self, now: Nanos) -> Vec<Joining> {
        let jobs = self.flows.values().flat_map(|f| &f.jobs);
        jobs.filter(|w| w.joined.is_none() && now >= w.not_before)
            .map(|w| Joining {
                entry: LineEntry {
                    job: w.id.clone(),
                    flow: w.flow.clone(),
                    weight: w.quantum,
                    class: w.class.index(),
                    unverified: w.standing.unverified,
                    tier: w.standing.reserved,
                    rank: w.standing.rank,
                },
                place: match (&w.rejoin_at, w.front) {
                    (Some(Joined { tag, member }), _) => JoinAt::Again { tag: *tag, member: member.clone() },
                    (None, true) => JoinAt::Front,
                    (None, false) => JoinAt::Back,
                },
            })
            .collect()
    }

    /// Job `id` has joined the line as `member` at `tag`; `false` if it is not waiting here any
    /// more (its entry must leave the line).
    pub(super) fn joined(&mut self, id: &str, member: String, tag: f64) -> bool {
        match self.flows.values_mut().flat_map(|f| f.jobs.iter_mut()).find(|w| w.id == id && w.joined.is_none()) {
            Some(job) => {
                job.joined = Some(Joined { member, tag });
                job.rejoin_at = None;
                true
            }
            None => false,
        }
    }

    /// Jobs waiting here that stand in the shared line.
    pub(super) fn joined_count(&self) -> usize {
        self.flows.values().flat_map(|f| &f.jobs).filter(|w| w.joined.is_some()).count()
    }

    /// The line may have lost track of what joined (the store failed): every job joins again,
    /// keeping its tag, when the store answers.
    pub(super) fn rejoin_all(&mut self) {
        for job in self.flows.values_mut().flat_map(|f| f.jobs.iter_mut()) {
            if let Some(joined) = job.joined.take() {
                job.ahead = None;
                job.rejoin_at = Some(joined);
            }
        }
    }

    /// What the line said of this instance's jobs: how many go before each; when it read the
    /// whole line, a joined job it did not name is no longer in it, and joins again.
    pub(super) fn heard_places(&mut self, mine: &[(String, usize)], complete: bool) {
        let places: HashMap<&str, usize> = mine.iter().map(|(id, ahead)| (id.as_str(), *ahead)).collect();
        for job in self.flows.values_mut().flat_map(|f| f.jobs.iter_mut()) {
            match (places.get(job.id.as_str()), &job.joined) {
                (Some(ahead), _) => job.ahead = Some(*ahead),
                (None, Some(_)) if complete => {
                    job.rejoin_at = job.joined.take();
                }
                (None, _) => {}
            }
        }
    }

    pub(super) fn push(&mut self, flow: &str, quantum: f64, mut job: Waiting, front: bool) {
        job.flow = flow.to_owned();
        job.quantum = quantum;
        job.front |= front;
        let entry = self.flows.entry(flow.to_owned()).or_insert_with(|| Flow { quantum, ..Flow::default() });
        entry.quantum = quantum;
        let was_idle = entry.jobs.is_empty();
        if front {
            entry.jobs.push_front(job);
        } else {
            entry.jobs.push_back(job);
        }
        if was_idle {
            // A retry keeps its place: its flow goes back to the front of the round.
            if front { self.ring.push_front(flow.to_owned()) } else { self.ring.push_back(flow.to_owned()) }
        }
    }
}
