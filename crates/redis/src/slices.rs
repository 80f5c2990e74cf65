//! Budget slices: a busy key's budget taken from Redis a slice at a time, and spent here.
//!
//! A call whose every check may be sliced ([`sliceable`]) is decided here when this instance holds
//! enough of each key's budget: no round trip. Otherwise it goes to `decide.lua` as always, and
//! behind each check of a busy key rides a *top-up*: the same key again, for the slice's units,
//! as a shadow check. The script charges it only where the budget has it after the call's own
//! price (a shadow check's refusal stops nothing and charges nothing), and only when the call is
//! admitted. So every unit spent here was debited in Redis first: the instances together never
//! admit more than the budget. Refusals always come from Redis, with its exact wait.
//!
//! **How big.** A key's next slice doubles while the key is busy (called again within the time a
//! slice lasts), from the call's own cost up to [`SliceRules::most`]. It is never more than the
//! key's demand here (what it was admitted at its latest pace over a quarter of a slice's life, the
//! quiet that sends a slice back), so a slice is about spent before it would go back and a slow
//! key is decided per call; and never more than an eighth of what Redis said was left: as a
//! budget nears empty, or other instances draw on it, slices shrink to nothing, which is today's
//! exact decision per call. A call Redis refuses gives this instance's slices of that key back at
//! once.
//!
//! **How long.** A slice is spent only while what it holds could not have made a difference had it
//! stayed in Redis:
//! - a window's count (`fixed_window`, `sliding_window`): until the window it was counted in ends;
//! - a bucket (`token_bucket`, `gcra`, `leaky_bucket`): until the bucket, had the slice stayed in
//!   it, would be full again (units that came back by time alone past the capacity would be lost
//!   to it, so a slice spent later would add to a full burst);
//!
//! and never longer than [`SliceRules::lasts`]. What is left goes back to Redis (`adjust.lua`,
//! "return": only where it still counts; sent once, never again) when the key has been quiet for a
//! quarter of that, a quarter before the slice's end, when a call finds its key's limiter changed
//! (a reload), and when the store gives every slice back ([`crate::RedisStore::give_back_slices`]:
//! shutdown). An instance that dies holding slices under-admits by what they held until they
//! would have ended: at most [`SliceRules::most`] units a key, for at most [`SliceRules::lasts`].

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use mcp_ratelimit_kernel::clock::{Nanos, SharedClock};
use mcp_ratelimit_kernel::limit::{Decision, Limiter, Shape, Taken};
use mcp_ratelimit_kernel::store::{Check, Lease, LoopCall, StoreError, Verdict};

use crate::errors::STORE;

/// How slices are cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SliceRules {
    /// The most units one slice of a key holds; 0 turns slices off (every decision in Redis).
    pub most: u64,
    /// The longest a slice is spent from.
    pub lasts: Duration,
}

/// The most keys remembered here: keys come from callers (each made-up key its own), so what is
/// kept of them is bounded however many arrive between two sweeps. A key beyond it is decided
/// exactly, in Redis.
const KEYS_KEPT: usize = 65_536;

/// What a key's slices are given back as: the key, its limiter, the units, where they were charged.
pub(crate) type GivenBack = (String, Limiter, u64, Taken);

/// Units drawn from slices for one call: the check's place in the call, the slice's id, the units.
pub(crate) type Drawn = Vec<(usize, u64, u64)>;

/// The slices this instance holds, by key.
pub(crate) struct Slices {
    rules: SliceRules,
    clock: SharedClock,
    keys: Mutex<HashMap<String, Held>>,
    next_id: AtomicU64,
}

/// One key's slices, and what Redis last said of the key.
struct Held {
    limiter: Limiter,
    pieces: Vec<Piece>,
    /// What Redis said at its last decision of the key: the limit, what was left beside the
    /// slices it handed out, how long until full; read at `read_at` (this instance's clock).
    limit: u64,
    left: u64,
    reset_after: Nanos,
    read_at: Nanos,
    /// The size of the last slice asked for.
    want: u64,
    last_call: Nanos,
    /// Units admitted here since `spent_from` (the start of the key's latest stretch of calls, at
    /// most a quarter of a slice's life ago): its demand, which a slice is sized to
    /// ([`Slices::wants`]).
    spent: u64,
    spent_from: Nanos,
    /// Units of top-ups asked for and not yet answered: calls of the key in flight at once ask
    /// for one slice between them, not one each.
    asking: u64,
    /// Counts the top-ups answered (or given up): what a call that found the key short while one
    /// was asked for waits on ([`Slices::top_up_awaited`]).
    answers: tokio::sync::watch::Sender<u64>,
}

/// One slice: its units left, where they were charged, until when they may be spent.
struct Piece {
    id: u64,
    units: u64,
    taken: Taken,
    until: Nanos,
}

/// What became of a slice when its time to go back was looked at.
pub(crate) enum Due {
    /// Spent, or given back already.
    Gone,
    /// Not yet: look again then.
    Wait(Nanos),
    /// Give these back now.
    Back(GivenBack),
}

/// The top-ups a call asks for ([`Slices::wants`]): one per check, 0 for none. They count in their
/// keys' room until this is dropped, once the answer was taken ([`Slices::took`]), or the call
/// failed, or was given up.
pub(crate) struct Asking<'a, 'c> {
    slices: &'a Slices,
    checks: &'c [Check<'c>],
    pub(crate) wants: Vec<u64>,
}

impl Drop for Asking<'_, '_> {
    fn drop(&mut self) {
        let mut keys = self.slices.keys();
        for (check, want) in self.checks.iter().zip(&self.wants).filter(|(_, want)| **want > 0) {
            if let Some(held) = keys.get_mut(check.key) {
                held.asking = held.asking.saturating_sub(*want);
                held.answers.send_modify(|answers| *answers = answers.wrapping_add(1));
            }
        }
    }
}

/// Whether a call with `checks` may be decided from slices: every check has a price, is no shadow
/// limit, is kept by an algorithm of counts or a bucket (not a log of every call, not slots), and
/// names a key no other check of the call names.
pub(crate) fn sliceable(checks: &[Check<'_>]) -> bool {
    !checks.is_empty()
        && checks.iter().enumerate().all(|(i, check)| {
            check.cost > 0
                && !check.shadow
                && !check.limiter.holds_slots()
                && !matches!(check.limiter, Limiter::SlidingLog(_))
                && checks[..i].iter().all(|before| before.key != check.key)
        })
}

impl Slices {
    pub(crate) fn new(rules: SliceRules, clock: SharedClock) -> Self {
        Self { rules, clock, keys: Mutex::default(), next_id: AtomicU64::new(0) }
    }

    pub(crate) fn clock(&self) -> &SharedClock {
        &self.clock
    }

    fn keys(&self) -> std::sync::MutexGuard<'_, HashMap<String, Held>> {
        self.keys.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The call decided here, every check's price spent from its key's slices, when they hold
    /// enough for all (else nothing is spent), with where each unit came from (to be put back
    /// there if the call is stopped after all: [`Slices::put_back`]); `None` sends it to Redis.
    pub(crate) fn spend(&self, checks: &[Check<'_>], now: Nanos) -> Option<(Vec<Decision>, Drawn)> {
        let mut keys = self.keys();
        let enough = checks
            .iter()
            .all(|check| keys.get(check.key).is_some_and(|held| held.live_under(check.limiter, now) >= check.cost));
        if !enough {
            return None;
        }
        let mut decisions = Vec::with_capacity(checks.len());
        let mut drawn = Vec::new();
        for (at, check) in checks.iter().enumerate() {
            let held = keys.get_mut(check.key)?;
            let mut owed = check.cost;
            let mut charged_in = None;
            for piece in held.pieces.iter_mut().filter(|piece| piece.until > now && piece.units > 0) {
                let spent = owed.min(piece.units);
                piece.units -= spent;
                owed -= spent;
                drawn.push((at, piece.id, spent));
                charged_in.get_or_insert(piece.taken);
                if owed == 0 {
                    break;
                }
            }
            held.pieces.retain(|piece| piece.units > 0);
            held.called(check.cost, now, self.lasts());
            let taken = charged_in.unwrap_or(Taken { at: Nanos::ZERO, reset_after: Nanos::ZERO });
            decisions.push(Decision {
                allowed: true,
                limit: held.limit,
                remaining: held.left.saturating_add(held.live(now)),
                retry_after: Nanos::ZERO,
                reset_after: held.reset_after - (now - held.read_at),
                at: taken.at,
            });
        }
        Some((decisions, drawn))
    }

    /// When a check of the call finds its key short here while a top-up of that key is being
    /// asked for by another call: that top-up's answer, to wait for and spend from rather than ask
    /// Redis again (calls of one key in flight at once then cost one round trip between them).
    pub(crate) fn top_up_awaited(&self, checks: &[Check<'_>], now: Nanos) -> Option<tokio::sync::watch::Receiver<u64>> {
        let keys = self.keys();
        checks.iter().find_map(|check| {
            let held = keys.get(check.key)?;
            (held.asking > 0 && held.live_under(check.limiter, now) < check.cost).then(|| held.answers.subscribe())
        })
    }

    /// Units [`Slices::spend`] drew for a call that was stopped after all, back into the slices
    /// they came from. Units of a slice gone meanwhile (spent to its end by this very call,
    /// given back, or its key's limiter changed) stay spent: this instance admits less, by at
    /// most the call's price, never more.
    pub(crate) fn put_back(&self, checks: &[Check<'_>], drawn: Drawn) {
        let mut keys = self.keys();
        for (at, id, units) in drawn {
            let held = checks.get(at).and_then(|check| keys.get_mut(check.key));
            let piece = held.and_then(|held| held.pieces.iter_mut().find(|piece| piece.id == id));
            if let Some(piece) = piece {
                piece.units = piece.units.saturating_add(units);
            }
        }
    }

    /// The slice to ask for behind each check: none for a key called for the first time in a
    /// while, else twice the last (at least the call's cost), within [`SliceRules::most`], the
    /// key's demand here, an eighth of what Redis said was left, and what a bucket can lend for a
    /// useful while.
    pub(crate) fn wants<'c>(&self, checks: &'c [Check<'c>], now: Nanos) -> Asking<'_, 'c> {
        let lasts = Nanos::from(self.rules.lasts);
        let mut keys = self.keys();
        let wants: Vec<u64> = checks
            .iter()
            .map(|check| {
                let Some(held) = keys.get_mut(check.key).filter(|held| held.limiter == *check.limiter) else {
                    return 0;
                };
                if now - held.last_call > lasts {
                    return 0;
                }
                // What a key holds here stays within `most`, however many calls found another
                // key of theirs short and took a top-up of this one with it, and however many
                // found this one short at once (what they ask for counts until it is answered).
                let room = self.rules.most.saturating_sub(held.live(now).saturating_add(held.asking));
                let grown = held.want.saturating_mul(2).max(check.cost);
                let want = grown.min(held.demand(now, lasts)).min(room).min(held.left / 8);
                // A slice that cannot pay for the next such call is not worth its keeping.
                if want < check.cost {
                    return 0;
                }
                // A bucket that would be full again within half a slice's life lends nothing: its
                // slice would go back (a quarter before its end) about as soon as it came.
                let want = match check.limiter.shape() {
                    Shape::Rate { period } => {
                        let level = held.left.saturating_sub(check.cost).saturating_add(1);
                        let short = check.limiter.capacity().saturating_sub(level);
                        if period.as_u64().saturating_mul(short) < lasts.as_u64() / 2 { 0 } else { want }
                    }
                    Shape::Window { .. } | Shape::Slots => want,
                };
                held.asking = held.asking.saturating_add(want);
                want
            })
            .collect();
        drop(keys);
        Asking { slices: self, checks, wants }
    }

    /// Redis's answer to a call sent with top-ups `wants`: `decisions` (the call's own, their
    /// `remaining` counted with the slices held here) and `top_ups` (one per nonzero want, in
    /// order). Returns the slices taken (to be given back when due: [`Slices::due`]) and those to
    /// give back at once (a key Redis refused, a key whose limiter changed).
    pub(crate) fn took(
        &self,
        checks: &[Check<'_>],
        wants: &[u64],
        decisions: &mut [Decision],
        top_ups: &[Decision],
        now: Nanos,
    ) -> (Vec<(String, u64)>, Vec<GivenBack>) {
        let admitted = decisions.iter().all(|d| d.allowed);
        let mut top_ups = top_ups.iter();
        let (mut taken, mut back) = (Vec::new(), Vec::new());
        let mut keys = self.keys();
        for ((check, &want), decision) in checks.iter().zip(wants).zip(decisions.iter_mut()) {
            let top_up = if want > 0 { top_ups.next() } else { None };
            // A key first seen is remembered (to tell it busy next time) while there is room; it
            // had no top-up (nothing is asked for a key not known here).
            if !keys.contains_key(check.key) && keys.len() < KEYS_KEPT {
                keys.insert(check.key.to_owned(), Held::new(check.limiter.clone(), now));
            }
            let Some(held) = keys.get_mut(check.key) else { continue };
            if held.limiter != *check.limiter {
                back.extend(held.give_back(check.key));
                held.limiter = check.limiter.clone();
                held.want = 0;
            }
            // Only an admitted call spent the key: a check allowed in a call refused elsewhere
            // adds nothing to its demand, nor makes it busy.
            if admitted {
                held.called(check.cost, now, self.lasts());
            }
            held.limit = decision.limit;
            let granted = top_up.filter(|t| admitted && t.allowed);
            // What an allowed check of a call refused elsewhere says is the level its charge would
            // have left: never written, so it is no reading of the key. (A call spent from slices
            // is settled by the reading it was spent under: a level read lower than the key's
            // would give back more than its units still owe.)
            let read = admitted || !decision.allowed;
            if read {
                held.read_at = now;
            }
            match granted {
                Some(top_up) => {
                    // Calls of one key in flight at once each asked for the room there was: what
                    // would take the key past `most` goes straight back.
                    let keep = want.min(self.rules.most.saturating_sub(held.live(now)));
                    if keep < want {
                        back.push((check.key.to_owned(), check.limiter.clone(), want - keep, top_up.taken()));
                    }
                    if keep > 0 {
                        let until = now + self.lasting(check.limiter, top_up, want);
                        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                        held.pieces.push(Piece { id, units: keep, taken: top_up.taken(), until });
                        taken.push((check.key.to_owned(), id));
                    }
                    held.want = want;
                    held.left = top_up.remaining;
                    held.reset_after = top_up.reset_after;
                }
                None if read => {
                    held.left = decision.remaining;
                    held.reset_after = decision.reset_after;
                    if !decision.allowed {
                        // Nearly empty: what is held here goes back for exact decisions to find.
                        held.want = 0;
                        back.extend(held.give_back(check.key));
                    }
                }
                None => {}
            }
            if decision.allowed {
                let left = if read { held.left } else { decision.remaining };
                decision.remaining = left.saturating_add(held.live(now));
            }
        }
        (taken, back)
    }

    /// `decisions` of `checks` decided in Redis without slices (a read, a call with blocks): what
    /// each key's slices here hold counted in its `remaining`, as a sliced call's are.
    pub(crate) fn count_held(&self, checks: &[Check<'_>], decisions: &mut [Decision]) {
        let now = self.clock.now();
        let keys = self.keys();
        for (check, decision) in checks.iter().zip(decisions) {
            let held = keys.get(check.key).map_or(0, |held| held.live_under(check.limiter, now));
            decision.remaining = decision.remaining.saturating_add(held);
        }
    }

    /// Forgets the keys that hold no slice and have not been called for a slice's life; returns
    /// how many went.
    pub(crate) fn sweep(&self) -> usize {
        let now = self.clock.now();
        let mut keys = self.keys();
        let before = keys.len();
        keys.retain(|_, held| !held.pieces.is_empty() || now - held.last_call <= self.lasts());
        before - keys.len()
    }

    fn lasts(&self) -> Nanos {
        Nanos::from(self.rules.lasts)
    }

    /// How long a slice of `want` units taken with `top_up` may be spent from.
    fn lasting(&self, limiter: &Limiter, top_up: &Decision, want: u64) -> Nanos {
        let bound = match limiter.shape() {
            Shape::Window { window } => {
                let into = top_up.at.as_u64().checked_rem(window.as_u64()).unwrap_or(0);
                Nanos::new(window.as_u64().saturating_sub(into))
            }
            // Redis's level, had the slice stayed: at least `remaining + want` (and less than one
            // unit more), full again after the shortfall's periods.
            Shape::Rate { period } => {
                let level = top_up.remaining.saturating_add(want).saturating_add(1);
                Nanos::new(period.as_u64().saturating_mul(limiter.capacity().saturating_sub(level)))
            }
            Shape::Slots => Nanos::ZERO,
        };
        bound.min(self.lasts())
    }

    /// Whether slice `id` of `key` goes back now: when it is spent there is nothing to; when the
    /// key has been quiet a quarter of a slice's life, or the slice is within that of its end, what
    /// is left of it does.
    pub(crate) fn due(&self, key: &str, id: u64, now: Nanos) -> Due {
        let quiet = Nanos::new(self.lasts().as_u64() / 4);
        let mut keys = self.keys();
        let Some(held) = keys.get_mut(key) else { return Due::Gone };
        let Some(at) = held.pieces.iter().position(|piece| piece.id == id) else { return Due::Gone };
        let piece = &held.pieces[at];
        let ends = piece.until - quiet;
        let idle = held.last_call + quiet;
        if now < ends && now < idle {
            return Due::Wait(ends.min(idle));
        }
        let piece = held.pieces.remove(at);
        if piece.units == 0 {
            return Due::Gone;
        }
        Due::Back((key.to_owned(), held.limiter.clone(), piece.units, piece.taken))
    }

    /// Every slice held, taken out to be given back.
    pub(crate) fn all(&self) -> Vec<GivenBack> {
        let mut keys = self.keys();
        keys.iter_mut().flat_map(|(key, held)| held.give_back(key)).collect()
    }

    /// The units `key` holds here under `limiter`.
    pub(crate) fn held_of(&self, key: &str, limiter: &Limiter) -> u64 {
        let now = self.clock.now();
        self.keys().get(key).map_or(0, |held| held.live_under(limiter, now))
    }

    /// The keys with slices, and the units they hold.
    pub(crate) fn held(&self) -> (u64, u64) {
        let now = self.clock.now();
        let keys = self.keys();
        let live = keys.values().map(|held| held.live(now)).filter(|units| *units > 0);
        live.fold((0, 0), |(keys, units), held| (keys + 1, units.saturating_add(held)))
    }
}

impl Held {
    fn new(limiter: Limiter, now: Nanos) -> Self {
        let answers = tokio::sync::watch::Sender::new(0);
        let (read_at, last_call, spent_from) = (now, now, now);
        let (limit, left, reset_after, want, spent, asking) = (0, 0, Nanos::ZERO, 0, 0, 0);
        let pieces = Vec::new();
        Held { limiter, pieces, limit, left, reset_after, read_at, want, last_call, spent, spent_from, asking, answers }
    }

    /// A call admitted here at `now` for `cost` units, counted in the key's demand; a stretch of
    /// calls that began over a quarter of a slice's life (`lasts`) ago starts anew.
    fn called(&mut self, cost: u64, now: Nanos, lasts: Nanos) {
        if now - self.spent_from > Nanos::new(lasts.as_u64() / 4) {
            (self.spent, self.spent_from) = (0, now);
        }
        self.spent = self.spent.saturating_add(cost);
        self.last_call = now;
    }

    /// The units this key was admitted here at the pace of its latest stretch over a quarter of
    /// `lasts` (the quiet that sends a slice back): what a slice can expect to be spent on before
    /// it goes back. All at one instant: no bound.
    fn demand(&self, now: Nanos, lasts: Nanos) -> u64 {
        let over = (now - self.spent_from).as_u64();
        if over == 0 {
            return u64::MAX;
        }
        let paced = u128::from(self.spent) * u128::from(lasts.as_u64() / 4) / u128::from(over);
        u64::try_from(paced).unwrap_or(u64::MAX)
    }

    /// Units that may still be spent at `now` under `limiter` (none under another).
    fn live_under(&self, limiter: &Limiter, now: Nanos) -> u64 {
        if self.limiter == *limiter { self.live(now) } else { 0 }
    }

    /// Units that may still be spent at `now`.
    fn live(&self, now: Nanos) -> u64 {
        let live = self.pieces.iter().filter(|piece| piece.until > now);
        live.fold(0, |units, piece| units.saturating_add(piece.units))
    }

    /// Its slices, taken out to be given back (what is left of each).
    fn give_back(&mut self, key: &str) -> Vec<GivenBack> {
        let pieces = std::mem::take(&mut self.pieces).into_iter().filter(|piece| piece.units > 0);
        pieces.map(|piece| (key.to_owned(), self.limiter.clone(), piece.units, piece.taken)).collect()
    }
}

impl crate::RedisStore {
    /// This store with busy keys' budgets held here a slice at a time, cut by `rules`, their time
    /// told by `clock` (nothing changes where `rules.most` is 0). Slices go back to Redis in tasks
    /// of their own once the store is [`RedisStore::shared`](crate::RedisStore::shared).
    pub fn with_slices(mut self, rules: SliceRules, clock: SharedClock) -> Self {
        self.slices = (rules.most > 0 && !rules.lasts.is_zero()).then(|| Slices::new(rules, clock));
        self
    }

    /// This store, shared: as every server holds it, and as it gives slices back.
    pub fn shared(self) -> std::sync::Arc<Self> {
        let shared = std::sync::Arc::new(self);
        let _ = shared.me.set(std::sync::Arc::downgrade(&shared));
        shared
    }

    /// The keys this instance holds slices of, and the units in them.
    pub fn slices_held(&self) -> (u64, u64) {
        self.slices.as_ref().map_or((0, 0), Slices::held)
    }

    /// Gives every slice this instance holds back to Redis, side by side, and waits for it
    /// (shutdown, reload).
    pub async fn give_back_slices(&self) {
        let Some(slices) = &self.slices else { return };
        futures::future::join_all(slices.all().into_iter().map(|given| self.give_slice_back(given))).await;
    }

    /// A call decided from this instance's slices when they hold its price, else in Redis with a
    /// top-up behind each busy key's check ([`Slices::took`]). What must be read in Redis all the
    /// same, the operator's `blocks` and the caller's loop history (`looped`), is then all the
    /// script does: a call they stop charges nothing, its price going back into the slices it
    /// came from.
    pub(crate) async fn decide_sliced(
        &self,
        slices: &Slices,
        checks: &[Check<'_>],
        (blocks, looped): (&[&str], Option<LoopCall<'_>>),
        lease: Lease,
    ) -> Result<Verdict, StoreError> {
        let mut now = slices.clock().now();
        let mut spent = slices.spend(checks, now);
        // A call that finds a key short while another's top-up of it is on its way waits for that
        // answer, where that saves it a round trip: not when its blocks or loop check send it to
        // Redis anyway (its budgets then ride in that script). What it then does in Redis counts
        // within the same `store.timeout_ms`: a request waits on Redis no longer for having waited.
        let deadline = tokio::time::Instant::now() + self.timeout;
        let mut waited = false;
        while spent.is_none() && blocks.is_empty() && looped.is_none() {
            let Some(mut answered) = slices.top_up_awaited(checks, now) else { break };
            waited = true;
            if !matches!(tokio::time::timeout_at(deadline, answered.changed()).await, Ok(Ok(()))) {
                break;
            }
            now = slices.clock().now();
            spent = slices.spend(checks, now);
        }
        let rest = self.decide_after_slices(slices, checks, (blocks, looped), lease, (spent, now));
        if !waited {
            return rest.await;
        }
        let timed_out = || StoreError::Timeout { store: STORE, address: self.address.clone(), timeout: self.timeout };
        tokio::time::timeout_at(deadline, rest).await.unwrap_or_else(|_| Err(timed_out()))
    }

    /// [`RedisStore::decide_sliced`] once the slices were tried (`spent`, at `now`): what was spent
    /// from them, its blocks and loop check read in Redis; else the call in Redis, with top-ups.
    async fn decide_after_slices(
        &self,
        slices: &Slices,
        checks: &[Check<'_>],
        (blocks, looped): (&[&str], Option<LoopCall<'_>>),
        lease: Lease,
        (spent, now): (Option<(Vec<Decision>, Drawn)>, Nanos),
    ) -> Result<Verdict, StoreError> {
        if let Some((decisions, drawn)) = spent {
            if blocks.is_empty() && looped.is_none() {
                return Ok(Verdict::Decided(decisions));
            }
            let verdict = self.run_unless_blocked(&[], blocks, looped, None, lease).await;
            if !matches!(verdict, Ok(Verdict::Decided(_))) {
                slices.put_back(checks, drawn);
            }
            return verdict.map(|verdict| match verdict {
                Verdict::Decided(_) => Verdict::Decided(decisions),
                stopped => stopped,
            });
        }
        let asking = slices.wants(checks, now);
        let wants = &asking.wants;
        let mut asked = checks.to_vec();
        let top_ups = checks.iter().zip(wants).filter(|(_, want)| **want > 0);
        asked.extend(top_ups.map(|(check, want)| Check { cost: *want, shadow: true, ..*check }));
        let verdict = self.run_unless_blocked(&asked, blocks, looped, None, lease).await?;
        let Verdict::Decided(mut decisions) = verdict else { return Ok(verdict) };
        let top_ups = decisions.split_off(checks.len().min(decisions.len()));
        let (taken, back) = slices.took(checks, wants, &mut decisions, &top_ups, slices.clock().now());
        drop(asking);
        for (key, id) in taken {
            self.give_back_when_due(key, id);
        }
        for given in back {
            self.give_back_later(given);
        }
        Ok(Verdict::Decided(decisions))
    }

    /// Watches slice `id` of `key` until it is spent or due back ([`Slices::due`]), then gives
    /// back what is left, in a task of its own.
    fn give_back_when_due(&self, key: String, id: u64) {
        self.in_a_task(move |store| async move {
            let Some(slices) = &store.slices else { return };
            loop {
                match slices.due(&key, id, slices.clock().now()) {
                    Due::Gone => return,
                    Due::Wait(at) => slices.clock().sleep_until(at).await,
                    Due::Back(given) => return store.give_slice_back(given).await,
                }
            }
        });
    }

    fn give_back_later(&self, given: GivenBack) {
        self.in_a_task(move |store| async move { store.give_slice_back(given).await });
    }

    /// `work` on this store in a task of its own, once the store is shared (never otherwise: a
    /// store nobody shares has no task to outlive its caller).
    fn in_a_task<W, F>(&self, work: W)
    where
        W: FnOnce(std::sync::Arc<Self>) -> F,
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let Some(store) = self.me.get().and_then(std::sync::Weak::upgrade) else { return };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(work(store));
        }
    }

    /// What is left of a slice, back where it was charged. Sent once: a try that fails (or whose
    /// answer is lost) is not sent again, so it is never applied twice; the slice then ends unused.
    async fn give_slice_back(&self, (key, limiter, units, taken): GivenBack) {
        use mcp_ratelimit_kernel::limit::Adjustment;
        let budgets = [(key.as_str(), &limiter, Adjustment::Return { units, taken })];
        if let Err(error) = self.adjust(&budgets, None, None).await {
            tracing::debug!(target: "mcp_ratelimit::store", %error, units, "a slice could not go back: it ends unused");
        }
    }
}

#[cfg(test)]
mod tests;
