//! Sliding log: an exact record of what was admitted in the last window.
//!
//! **Choose it** when the limit must hold over *every* window of the given length, with no
//! approximation — small limits on expensive operations ("5 video jobs per rolling hour").
//! It costs memory proportional to the calls admitted per window (entries at the same instant
//! are merged), so keep its limits small.
//!
//! **At a window edge** nothing special happens: a call at `t` counts until `t + window`, so
//! no span of length `window` ever holds more than `limit` units. A refusal's `retry_after` is
//! exactly when enough old entries will have aged out for this call's cost.
//!
//! **When its limit is lowered** below what the log holds, the entries stay until they age out
//! of the (current) window: `remaining` is 0, never negative, and `retry_after` is still exact for
//! the new limit — when enough of the oldest entries have aged out that this call fits beside the
//! rest — so it and `reset_after` are never more than one window. A raised limit lets the caller
//! continue from the log; a shorter window drops the entries older than it at once.
//!
//! **A late refund** ([`Algorithm::give_back`]) comes off the entry its charge was logged as, at
//! its own instant, while it is in the log: the log is then exactly what it would be had the call
//! cost less. Off the newest entries instead, a refund for an old call would shorten the wait
//! that a recent one still owes.

use std::collections::VecDeque;

use crate::clock::Nanos;
use crate::limit::{Algorithm, Decision, ParamError, Params, Shape, Taken};

/// At most `limit` units within any `window` nanoseconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlidingLog {
    limit: u64,
    window: Nanos,
}

/// Admitted calls still inside the window: `(time, units)`, oldest first, and their sum.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct State {
    entries: VecDeque<(Nanos, u64)>,
    total: u64,
}

impl SlidingLog {
    /// At most `limit` units in any `window` nanoseconds.
    pub fn new(limit: u64, window: Nanos) -> Self {
        Self { limit: limit.max(1), window: window.max(Nanos::new(1)) }
    }

    /// The window length in nanoseconds.
    pub fn window(&self) -> Nanos {
        self.window
    }

    /// Drops entries that no longer count at `now` (those at or before `now - window`).
    fn expire(&self, state: &mut State, now: Nanos) {
        while let Some(&(at, units)) = state.entries.front() {
            if at + self.window > now {
                break;
            }
            state.entries.pop_front();
            state.total = state.total.saturating_sub(units);
        }
    }
}

impl Algorithm for SlidingLog {
    const NAME: &'static str = "sliding_log";
    const PARAMS: &'static [&'static str] = &["limit", "window_ms"];

    type State = State;

    fn from_params(params: &Params<'_>) -> Result<Self, ParamError> {
        Ok(Self::new(params.units("limit")?, params.window("window_ms")?))
    }

    fn with_shape(capacity: u64, shape: Shape) -> Option<Self> {
        match shape {
            Shape::Window { window } => Some(Self::new(capacity, window)),
            Shape::Rate { .. } | Shape::Slots => None,
        }
    }

    fn shape(&self) -> Shape {
        Shape::Window { window: self.window }
    }

    fn describe(&self) -> String {
        format!("{} per sliding {} ms", self.limit, self.window.as_u64() / 1_000_000)
    }

    fn fresh(&self, _now: Nanos) -> State {
        State::default()
    }

    fn acquire(&self, state: &mut State, now: Nanos, cost: u64) -> Decision {
        self.expire(state, now);
        let allowed = state.total.saturating_add(cost) <= self.limit;
        if allowed && cost > 0 {
            match state.entries.back_mut() {
                Some((at, units)) if *at >= now => *units += cost,
                _ => state.entries.push_back((now, cost)),
            }
            state.total = state.total.saturating_add(cost);
        }
        let retry_after = if allowed {
            Nanos::ZERO
        } else {
            // Walk the oldest entries until enough units would have aged out; the log may hold
            // more than a lowered limit, so only what is left after them counts.
            let mut freed: u64 = 0;
            let mut wait = self.window;
            for &(at, units) in &state.entries {
                freed = freed.saturating_add(units);
                wait = at + self.window - now;
                if state.total.saturating_sub(freed).saturating_add(cost) <= self.limit {
                    break;
                }
            }
            wait
        };
        let reset_after = state.entries.back().map_or(Nanos::ZERO, |&(at, _)| at + self.window - now);
        // Saturating: a log kept under a larger limit may hold more than this one.
        let remaining = self.limit.saturating_sub(state.total);
        Decision { allowed, limit: self.limit, remaining, retry_after, reset_after, at: now }
    }

    fn forget_at(&self, state: &State) -> Nanos {
        state.entries.back().map_or(Nanos::ZERO, |&(at, _)| at + self.window)
    }

    fn capacity(&self) -> u64 {
        self.limit
    }

    /// Drops `units` from the newest entries: the calls being refunded are usually the latest.
    fn refund(&self, state: &mut State, now: Nanos, units: u64) {
        self.expire(state, now);
        let mut left = units;
        while left > 0 {
            let Some(newest) = state.entries.back_mut() else { break };
            let taken = newest.1.min(left);
            newest.1 -= taken;
            state.total = state.total.saturating_sub(taken);
            left -= taken;
            if newest.1 == 0 {
                state.entries.pop_back();
            }
        }
    }

    /// Takes `units` from the entry the charge was logged as (the one at its instant), while it
    /// is still in the log; an entry aged out takes nothing back, nor does any other.
    fn give_back(&self, state: &mut State, now: Nanos, units: u64, taken: Taken) {
        self.expire(state, now);
        let Ok(i) = state.entries.binary_search_by_key(&taken.at, |&(at, _)| at) else { return };
        let entry = &mut state.entries[i];
        let back = entry.1.min(units);
        entry.1 -= back;
        state.total = state.total.saturating_sub(back);
        if entry.1 == 0 {
            state.entries.remove(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    const SEC: Nanos = Nanos::from_secs(1);

    #[test]
    fn waits_for_the_oldest_entries_to_age_out() {
        let l = SlidingLog::new(3, 10 * SEC);
        let mut s = l.fresh(Nanos::ZERO);
        assert!(l.acquire(&mut s, Nanos::ZERO, 1).allowed);
        assert!(l.acquire(&mut s, 2 * SEC, 1).allowed);
        assert!(l.acquire(&mut s, 4 * SEC, 1).allowed);
        let d = l.acquire(&mut s, 5 * SEC, 2);
        assert!(!d.allowed);
        assert_eq!(d.retry_after, 7 * SEC, "two entries must go: the one at 2 s leaves at 12 s");
        assert!(!l.acquire(&mut s, 11 * SEC, 2).allowed);
        assert!(l.acquire(&mut s, 12 * SEC, 2).allowed);
    }

    #[test]
    fn a_limit_lowered_under_the_log_waits_exactly_for_enough_entries_to_age_out() {
        let before = SlidingLog::new(10, 10 * SEC);
        let mut s = before.fresh(Nanos::ZERO);
        for t in 0..4 {
            assert!(before.acquire(&mut s, t * SEC, 2).allowed);
        }
        // 8 in the log, the limit now 3: 6 must age out before a call of 1 fits beside the rest.
        let after = SlidingLog::new(3, 10 * SEC);
        let d = after.acquire(&mut s, 5 * SEC, 1);
        assert_eq!((d.allowed, d.remaining), (false, 0));
        assert_eq!(d.retry_after, 7 * SEC, "the entry at 2 s leaves at 12 s");
        assert!(!after.acquire(&mut s, 12 * SEC - Nanos::new(1), 1).allowed);
        assert!(after.acquire(&mut s, 12 * SEC, 1).allowed);
    }
}
