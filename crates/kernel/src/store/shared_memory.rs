//! A memory store several instances in one process share, as they would share a Redis: the
//! simulator's instances (`simulate --shape many_instances`), and tests that want many
//! instances without a `redis-server`. Its budgets and slots are a [`MemoryStore`]'s; beside them
//! it keeps what only a shared store has: the line every instance's waiting jobs stand in (the
//! twin of `line.lua`, [`SharedLine`]) and the channels a freed slot is told on
//! ([`Broadcast::hear`]).
//!
//! The line is `line.lua` step for step, on the store's clock: jobs in the order of their flows'
//! virtual finish tags (ties to the one that joined first), a claim judging the jobs it reads
//! alike (a tier owed a reserved slot first, then the highest rank, each by tag; a class's gap;
//! the unverified callers' share), taking the slots of the job whose turn it is in the same step
//! (one lock here, one script there), and dropping the jobs of instances no longer alive. The
//! suite both pass is [`line_suite`](super::line_suite). It keeps no learnt limit: a claim's caps
//! are the static ones.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use super::{
    Blocks, Broadcast, Budgets, Check, JoinAt, LINE_ALIVE, Lease, LineAnswer, LineAt, LineClaim, LineEntry, LineWait,
    MemoryStore, SharedLine, Slots, Store, StoreFuture, Verdict, ready,
};
use crate::clock::{Nanos, SharedClock};
use crate::limit::{Adjustment, Concurrency, Decision, Limiter};

/// A memory store shared by the instances of one process; see the module.
pub struct SharedMemory {
    memory: Arc<MemoryStore>,
    /// Whether it keeps the line and the channels ([`SharedMemory::slots_only`]: not).
    keeps_line: bool,
    lines: Mutex<HashMap<String, Line>>,
    channels: Mutex<HashMap<String, tokio::sync::watch::Sender<u64>>>,
}

impl std::fmt::Debug for SharedMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedMemory").field("memory", &self.memory).finish_non_exhaustive()
    }
}

/// A tag, ordered as a sorted set orders its scores (tags are finite and never negative).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Tag(f64);

impl Eq for Tag {}

impl PartialOrd for Tag {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Tag {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// One job in the line.
#[derive(Debug, Clone)]
struct Waiting {
    /// Its name in the line.
    member: String,
    instance: String,
    entry: LineEntry,
}

/// One line: `line.lua`'s five keys.
#[derive(Debug, Default)]
struct Line {
    /// (tag, the order it joined in) → the job.
    order: BTreeMap<(Tag, u64), Waiting>,
    /// Its name → where it stands in `order`.
    place: HashMap<String, (Tag, u64)>,
    /// Each flow's waiting jobs and last tag.
    flows: HashMap<String, (u64, f64)>,
    /// The line's virtual time: the tag of the last job served.
    vtime: f64,
    /// Each instance → until when it counts as alive.
    alive: HashMap<String, Nanos>,
    /// Each instance whose mark ran out → the end of its grace (`line.lua`'s `mark_alive`).
    graces: HashMap<String, Nanos>,
    /// Joins so far.
    sequence: u64,
}

impl Line {
    /// Marks `instance` alive; a mark that ran out is given one more mark's life from now, once,
    /// before its instance counts as dead (as `line.lua` does: after the store was away longer
    /// than a mark lasts, the instances alive say so again before their jobs are dropped).
    fn mark_alive(&mut self, instance: &str, now: Nanos) {
        let lives = Nanos::from(LINE_ALIVE);
        let ran_out = self.alive.iter().filter(|(who, until)| **until <= now && !self.graces.contains_key(*who));
        let graced: Vec<String> = ran_out.map(|(who, _)| who.clone()).collect();
        self.alive.retain(|_, until| *until > now);
        self.graces.retain(|_, until| *until > now);
        self.graces.extend(graced.into_iter().map(|who| (who, now + lives)));
        self.alive.insert(instance.to_owned(), now + lives);
        self.graces.remove(instance);
    }

    fn is_alive(&self, instance: &str, now: Nanos) -> bool {
        let until = |marks: &HashMap<String, Nanos>| marks.get(instance).copied().unwrap_or(Nanos::ZERO);
        until(&self.alive).max(until(&self.graces)) > now
    }

    fn next_tag(&self, flow: &str, weight: f64) -> f64 {
        let tail = self.flows.get(flow).map_or(0.0, |(_, tail)| *tail);
        self.vtime.max(tail) + 1.0 / weight
    }

    /// Takes `member` out of the line; whether it was in it.
    fn take_out(&mut self, member: &str) -> bool {
        let Some(place) = self.place.remove(member) else { return false };
        if let Some(waiting) = self.order.remove(&place)
            && let Some((count, _)) = self.flows.get_mut(&waiting.entry.flow)
        {
            *count = count.saturating_sub(1);
            if *count == 0 {
                self.flows.remove(&waiting.entry.flow);
            }
        }
        true
    }
}

/// The order a member's name says it joined in: the sequence it begins with.
fn sequence_of(member: &str) -> Option<u64> {
    member.split('\u{1f}').next()?.parse().ok()
}

impl SharedMemory {
    /// An empty store on `clock`.
    pub fn on(clock: SharedClock) -> Self {
        Self {
            memory: Arc::new(MemoryStore::on(clock)),
            keeps_line: true,
            lines: Mutex::new(HashMap::new()),
            channels: Mutex::new(HashMap::new()),
        }
    }

    /// An empty store on `clock` that shares only budgets and slots, as a shared store that keeps
    /// no line would: each instance queues its own jobs, claims the account's slots here, and,
    /// never told of a slot freed, asks again a second later (what the simulator compares the
    /// line with).
    pub fn slots_only(clock: SharedClock) -> Self {
        Self { keeps_line: false, ..Self::on(clock) }
    }

    fn now(&self) -> Nanos {
        self.memory.clock().now()
    }

    fn line<'a>(lines: &'a mut MutexGuard<'_, HashMap<String, Line>>, name: &str) -> &'a mut Line {
        lines.entry(name.to_owned()).or_default()
    }

    fn lines(&self) -> MutexGuard<'_, HashMap<String, Line>> {
        self.lines.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn tell(&self, channel: &str) {
        let channels = self.channels.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(sender) = channels.get(channel) {
            sender.send_modify(|heard| *heard = heard.wrapping_add(1));
        }
    }

    fn join_now(&self, at: LineAt<'_>, entry: &LineEntry, place: &JoinAt) -> (f64, String) {
        let now = self.now();
        let mut lines = self.lines();
        let line = Self::line(&mut lines, at.name);
        line.mark_alive(at.instance, now);
        let (member, sequence, tag) = match place {
            JoinAt::Again { tag, member } => {
                if let Some((held, _)) = line.place.get(member) {
                    return (held.0, member.clone());
                }
                let sequence = sequence_of(member).unwrap_or_else(|| {
                    line.sequence += 1;
                    line.sequence
                });
                (member.clone(), sequence, *tag)
            }
            JoinAt::Back | JoinAt::Front => {
                line.sequence += 1;
                let member = format!("{:015}\u{1f}{}", line.sequence, entry.member(at.instance));
                let tag = match place {
                    JoinAt::Front => line.vtime,
                    _ => line.next_tag(&entry.flow, entry.weight),
                };
                (member, line.sequence, tag)
            }
        };
        let flow = line.flows.entry(entry.flow.clone()).or_insert((0, 0.0));
        *flow = (flow.0.saturating_add(1), flow.1.max(tag));
        let key = (Tag(tag), sequence);
        line.place.insert(member.clone(), key);
        let waiting = Waiting { member: member.clone(), instance: at.instance.to_owned(), entry: entry.clone() };
        line.order.insert(key, waiting);
        (tag, member)
    }

    fn claim_now(&self, at: LineAt<'_>, claim: &LineClaim<'_>) -> (LineAnswer, Vec<String>) {
        let now = self.now();
        let mut lines = self.lines();
        let line = Self::line(&mut lines, at.name);
        line.mark_alive(at.instance, now);
        let judge = Judge::of(&self.memory, claim, now);
        let (considered, dropped) = read_line(line, at, claim, now);
        let (next_up, wake) = judge.next_up(&considered);
        let next_up = next_up.map(|i| &considered[i]);
        let why = if judge.in_use >= judge.cap {
            Some(LineWait::Full)
        } else {
            match next_up {
                None => Some(LineWait::Nothing),
                Some(next) if next.waiting.instance != at.instance => Some(LineWait::Theirs),
                Some(_) => None,
            }
        };
        if let Some(why) = why {
            let mine = judge.positions(&considered, at.instance);
            let complete = line.order.len() <= claim.scan.max(1);
            return (LineAnswer::Wait { why, wake, mine, complete }, dropped);
        }
        let Some(Considered { tag, waiting, is_candidate }) = next_up.cloned() else {
            return (LineAnswer::Wait { why: LineWait::Nothing, wake, mine: Vec::new(), complete: true }, dropped);
        };
        // One of ours goes: its slots, in one step (all are free: checked above, under the lock).
        if !judge.take_slots(&waiting.entry) {
            return (LineAnswer::Wait { why: LineWait::Full, wake, mine: Vec::new(), complete: false }, dropped);
        }
        if is_candidate {
            // A job served at the door moves its flow on as one that waited would have.
            if let Some((count, tail)) = line.flows.get_mut(&waiting.entry.flow)
                && *count > 0
            {
                *tail = tail.max(tag);
            }
        } else {
            line.take_out(&waiting.member);
        }
        line.vtime = line.vtime.max(tag);
        // Slots left free and jobs still waiting: the instance whose job is next may be asleep.
        if judge.in_use.saturating_add(1) < judge.cap && !line.order.is_empty() && !claim.told.is_empty() {
            self.tell(claim.told);
        }
        (LineAnswer::Go { job: waiting.entry.job, at: now, limit: None }, dropped)
    }
}

/// A job a claim reads: one in the line, or the candidate at the door, with its tag.
#[derive(Debug, Clone)]
struct Considered {
    tag: f64,
    waiting: Waiting,
    /// Whether it is the claim's candidate (which has not joined).
    is_candidate: bool,
}

/// Reads the line in tag order (the candidate where its tag puts it), dropping the jobs of
/// instances no longer alive: what is read, and the jobs dropped.
fn read_line(line: &mut Line, at: LineAt<'_>, claim: &LineClaim<'_>, now: Nanos) -> (Vec<Considered>, Vec<String>) {
    let read: Vec<((Tag, u64), Waiting)> =
        line.order.iter().take(claim.scan.max(1)).map(|(k, w)| (*k, w.clone())).collect();
    let mut candidate = claim.candidate.map(|entry| Considered {
        tag: line.next_tag(&entry.flow, entry.weight),
        waiting: Waiting { member: String::new(), instance: at.instance.to_owned(), entry: entry.clone() },
        is_candidate: true,
    });
    let mut dropped = Vec::new();
    let mut considered = Vec::new();
    for ((tag, _), waiting) in read {
        if let Some(first) = candidate.take_if(|c| c.tag < tag.0) {
            considered.push(first);
        }
        if line.is_alive(&waiting.instance, now) {
            considered.push(Considered { tag: tag.0, waiting, is_candidate: false });
        } else {
            line.take_out(&waiting.member);
            dropped.push(waiting.entry.job);
        }
    }
    considered.extend(candidate);
    (considered, dropped)
}

/// What a claim judges the jobs it reads by, read from the store under the line's lock.
struct Judge<'a> {
    memory: &'a MemoryStore,
    claim: &'a LineClaim<'a>,
    now: Nanos,
    cap: u64,
    share: u64,
    in_use: u64,
    share_in_use: u64,
    tier_in_use: Vec<u64>,
    /// Each tier's reserved slots, as `TierRule::share_of`: rounded down, a whole share the whole.
    reserved: Vec<u64>,
}

impl<'a> Judge<'a> {
    fn of(memory: &'a MemoryStore, claim: &'a LineClaim<'a>, now: Nanos) -> Self {
        let cap = claim.account.1;
        Self {
            memory,
            claim,
            now,
            cap,
            share: claim.share.1.max(1),
            in_use: memory.slots_in_use_at(claim.account.0, now),
            share_in_use: memory.slots_in_use_at(claim.share.0, now),
            tier_in_use: claim.tiers.iter().map(|(key, _)| memory.slots_in_use_at(key, now)).collect(),
            reserved: claim
                .tiers
                .iter()
                .map(|(_, s)| if *s >= 1.0 { cap } else { (cap as f64 * s.max(0.0)).floor() as u64 })
                .collect(),
        }
    }

    /// How long until `entry` may go by time alone (0: now; None: only when a slot is back).
    fn wait_of(&self, entry: &LineEntry) -> Option<Nanos> {
        if entry.unverified && self.share_in_use >= self.share {
            return None;
        }
        let Some((key, limiter)) = self.claim.gaps.get(entry.class).copied().flatten() else {
            return Some(Nanos::ZERO);
        };
        let decision = self.memory.peek_at(&Check { key, limiter, cost: 1, shadow: false }, self.now);
        Some(if decision.allowed { Nanos::ZERO } else { decision.retry_after.max(Nanos::new(1)) })
    }

    /// Whether `entry`'s tier is owed a reserved slot.
    fn owed(&self, entry: &LineEntry) -> bool {
        !entry.unverified && entry.tier.is_some_and(|t| self.tier_in_use.get(t) < self.reserved.get(t))
    }

    /// The job whose turn it is (a tier owed a slot first, then the highest rank, each by tag),
    /// and how long until one may go by time alone.
    fn next_up(&self, considered: &[Considered]) -> (Option<usize>, Option<Nanos>) {
        let mut first_owed: Option<usize> = None;
        let mut first_ranked: Option<usize> = None;
        let mut wake: Option<Nanos> = None;
        for (i, next) in considered.iter().enumerate() {
            match self.wait_of(&next.waiting.entry) {
                Some(Nanos::ZERO) => {
                    if self.owed(&next.waiting.entry) && first_owed.is_none() {
                        first_owed = Some(i);
                    }
                    if first_ranked.is_none_or(|r| next.waiting.entry.rank > considered[r].waiting.entry.rank) {
                        first_ranked = Some(i);
                    }
                }
                Some(wait) => wake = Some(wake.map_or(wait, |w| w.min(wait))),
                None => {}
            }
        }
        (first_owed.or(first_ranked), wake)
    }

    /// How many go before each of `instance`'s jobs, as State::pick orders them (the line as
    /// read, the candidate, which has not joined, left out).
    fn positions(&self, considered: &[Considered], instance: &str) -> Vec<(String, usize)> {
        let precedence = |entry: &LineEntry| (self.owed(entry), entry.rank);
        let kept = || considered.iter().filter(|c| !c.is_candidate).map(|c| &c.waiting);
        let mut counts: BTreeMap<(bool, i64), usize> = BTreeMap::new();
        for waiting in kept() {
            *counts.entry(precedence(&waiting.entry)).or_default() += 1;
        }
        let mut seen: BTreeMap<(bool, i64), usize> = BTreeMap::new();
        let mut mine = Vec::new();
        for waiting in kept() {
            let p = precedence(&waiting.entry);
            let ahead_here = seen.entry(p).or_default();
            if waiting.instance == instance {
                let before: usize = counts.iter().filter(|(q, _)| **q > p).map(|(_, n)| *n).sum();
                mine.push((waiting.entry.job.clone(), before.saturating_add(*ahead_here)));
            }
            *ahead_here += 1;
        }
        mine
    }

    /// Takes the slots of `entry`'s job in one step: the account's, the unverified share's, its
    /// tier's and its class's gap; whether they were all free.
    fn take_slots(&self, entry: &LineEntry) -> bool {
        let claim = self.claim;
        let account = Limiter::Concurrency(Concurrency::new(self.cap));
        let share_limiter = Limiter::Concurrency(Concurrency::new(self.share));
        let tier_limiter = Limiter::Concurrency(Concurrency::new(self.cap.max(1)));
        let mut checks = vec![Check { key: claim.account.0, limiter: &account, cost: 1, shadow: false }];
        if entry.unverified {
            checks.push(Check { key: claim.share.0, limiter: &share_limiter, cost: 1, shadow: false });
        }
        if let Some((key, _)) = entry.tier.and_then(|t| claim.tiers.get(t)) {
            checks.push(Check { key, limiter: &tier_limiter, cost: 1, shadow: false });
        }
        if let Some((key, limiter)) = claim.gaps.get(entry.class).copied().flatten() {
            checks.push(Check { key, limiter, cost: 1, shadow: false });
        }
        self.memory.decide_at(&checks, self.now).iter().all(|d| d.allowed)
    }
}

impl Budgets for SharedMemory {
    fn decide<'a>(&'a self, checks: &'a [Check<'a>], blocks: &'a [&'a str], lease: Lease) -> StoreFuture<'a, Verdict> {
        self.memory.decide(checks, blocks, lease)
    }

    fn adjust<'a>(
        &'a self,
        budgets: &'a [(&'a str, &'a Limiter, Adjustment)],
        once: Option<&'a str>,
    ) -> StoreFuture<'a, Vec<Decision>> {
        self.memory.adjust(budgets, once)
    }

    fn forget<'a>(&'a self, keys: &'a [&'a str]) -> StoreFuture<'a, u64> {
        self.memory.forget(keys)
    }
}

impl Slots for SharedMemory {
    fn release(self: Arc<Self>, key: &str, limiter: &Limiter, cost: u64, lease: Lease) {
        self.memory.clone().release(key, limiter, cost, lease);
    }

    fn release_telling(self: Arc<Self>, key: &str, limiter: &Limiter, cost: u64, lease: Lease, channel: &str) {
        self.memory.clone().release(key, limiter, cost, lease);
        self.tell(channel);
    }
}

impl Blocks for SharedMemory {
    fn block<'a>(&'a self, key: &'a str, duration: Duration) -> StoreFuture<'a, ()> {
        self.memory.block(key, duration)
    }

    fn unblock<'a>(&'a self, key: &'a str) -> StoreFuture<'a, bool> {
        self.memory.unblock(key)
    }

    fn block_left<'a>(&'a self, key: &'a str) -> StoreFuture<'a, Option<Nanos>> {
        self.memory.block_left(key)
    }
}

impl Broadcast for SharedMemory {
    fn hear(self: Arc<Self>, channel: &str) -> Option<tokio::sync::watch::Receiver<u64>> {
        if !self.keeps_line {
            return None;
        }
        let mut channels = self.channels.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        Some(channels.entry(channel.to_owned()).or_insert_with(|| tokio::sync::watch::Sender::new(0)).subscribe())
    }
}

impl Store for SharedMemory {
    fn is_shared(&self) -> bool {
        true
    }

    fn sweep(&self) -> usize {
        self.memory.sweep()
    }

    fn shared_line(self: Arc<Self>) -> Option<Arc<dyn SharedLine>> {
        if self.keeps_line { Some(self) } else { None }
    }
}

/// The line on the store's clock; every answer is known at once.
impl SharedLine for SharedMemory {
    fn join<'a>(&'a self, at: LineAt<'a>, entry: &'a LineEntry, place: &'a JoinAt) -> StoreFuture<'a, (f64, String)> {
        ready(Ok(self.join_now(at, entry, place)))
    }

    fn leave<'a>(&'a self, at: LineAt<'a>, member: &'a str) -> StoreFuture<'a, bool> {
        let mut lines = self.lines();
        ready(Ok(Self::line(&mut lines, at.name).take_out(member)))
    }

    fn alive<'a>(&'a self, at: LineAt<'a>) -> StoreFuture<'a, ()> {
        let now = self.now();
        let mut lines = self.lines();
        Self::line(&mut lines, at.name).mark_alive(at.instance, now);
        ready(Ok(()))
    }

    fn claim<'a>(&'a self, at: LineAt<'a>, claim: LineClaim<'a>) -> StoreFuture<'a, (LineAnswer, Vec<String>)> {
        ready(Ok(self.claim_now(at, &claim)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::store::line_suite::{self, claim, job, went};

    #[tokio::test]
    async fn passes_the_line_suite_line_lua_passes() {
        let store: Arc<dyn Store> = Arc::new(SharedMemory::on(ManualClock::new()));
        line_suite::run(store, "suite").await;
    }

    /// Instance b's claim of line `t`: it waits on the jobs of others in line before its own, and
    /// drops none of theirs.
    async fn b_waits_on_the_others(line: &Arc<dyn SharedLine>) {
        let (answer, dropped) = claim(line, "t", "b", 10, 0.0, None).await;
        assert!(matches!(answer, LineAnswer::Wait { why: LineWait::Theirs, .. }) && dropped.is_empty(), "{answer:?}");
    }

    #[tokio::test]
    async fn a_dead_instances_jobs_stop_holding_the_line_and_are_handed_to_the_claimer() {
        let clock = ManualClock::new();
        let store = Arc::new(SharedMemory::on(clock.clone()));
        let line: Arc<dyn SharedLine> = store.clone();
        let at = |instance| LineAt { name: "t", instance };
        line.join(at("dead"), &job("d0", "tenant:d"), &JoinAt::Back).await.expect("joins");
        clock.advance(Duration::from_secs(3));
        line.join(at("b"), &LineEntry { weight: 0.5, ..job("b0", "tenant:b") }, &JoinAt::Back).await.expect("joins");
        b_waits_on_the_others(&line).await;
        // Five seconds after its last word its mark has run out: the claim that notices gives it
        // a grace of five seconds more (as after the store was away longer than a mark lasts).
        clock.advance(Duration::from_secs(2));
        b_waits_on_the_others(&line).await;
        clock.advance(Duration::from_millis(4_999));
        b_waits_on_the_others(&line).await;
        // Silent through its grace too: taken for dead.
        clock.advance(Duration::from_millis(1));
        let (answer, dropped) = claim(&line, "t", "b", 10, 0.0, None).await;
        assert_eq!((went(&answer), dropped), (Some("b0"), vec!["d0".to_owned()]));
        assert!(store.lines()["t"].order.is_empty() && store.lines()["t"].flows.is_empty());
    }

    #[tokio::test]
    async fn an_instance_that_speaks_within_its_grace_keeps_its_jobs() {
        let clock = ManualClock::new();
        let store = Arc::new(SharedMemory::on(clock.clone()));
        let line: Arc<dyn SharedLine> = store.clone();
        let at = |instance| LineAt { name: "t", instance };
        line.join(at("a"), &job("a0", "tenant:a"), &JoinAt::Back).await.expect("joins");
        line.join(at("b"), &LineEntry { weight: 0.5, ..job("b0", "tenant:b") }, &JoinAt::Back).await.expect("joins");
        for _ in 0..2 {
            // Every mark runs out at once (the store away longer than one lasts).
            clock.advance(Duration::from_secs(6));
            b_waits_on_the_others(&line).await;
            // a says it is alive within its grace: a mark again, and a grace the next time.
            clock.advance(Duration::from_secs(1));
            line.alive(at("a")).await.expect("alive");
        }
        b_waits_on_the_others(&line).await;
    }

    #[tokio::test]
    async fn a_slot_given_back_is_told_to_every_instance_that_hears_its_channel() {
        let store = Arc::new(SharedMemory::on(ManualClock::new()));
        let (mut a, mut b) =
            (store.clone().hear("{t}freed").expect("hears"), store.clone().hear("{t}freed").expect("hears"));
        let slot = Limiter::Concurrency(Concurrency::new(1));
        let check = [Check { key: "{t}account", limiter: &slot, cost: 1, shadow: false }];
        let lease = Lease::new();
        assert!(matches!(store.decide(&check, &[], lease).await, Ok(Verdict::Decided(d)) if d[0].allowed));
        store.clone().release_telling("{t}account", &slot, 1, lease, "{t}freed");
        assert!(a.has_changed().expect("open") && b.has_changed().expect("open"));
        assert_eq!((*a.borrow_and_update(), *b.borrow_and_update()), (1, 1));
        assert_eq!(store.memory.slots_in_use_at("{t}account", Nanos::ZERO), 0);
    }
}
