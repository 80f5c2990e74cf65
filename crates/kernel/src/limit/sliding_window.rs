//! Sliding window counter: the current window's count plus a weighted share of the previous.
//!
//! **Choose it** for window semantics ("100 per minute") without the fixed window's 2× edge
//! burst and without a sliding log's memory: the state is two counters. The estimate of the
//! last `window` is `previous × (1 − elapsed/window) + current`, which assumes the previous
//! window's calls were spread evenly.
//!
//! **At a window edge** the previous window's count still weighs fully, so the classic edge
//! burst (limit at the end of one window, limit at the start of the next) is refused.
//! **Documented error:** the estimate is exact for evenly spread traffic; for adversarial
//! traffic packed at the end of a window, any span of `window` holds at most `2 × limit`
//! (never more than a fixed window), and any span of `window / 2` at most `1.5 × limit`.
//!
//! **When its limit is lowered** below the counts already kept, they stay and decay as always:
//! `remaining` is 0, never negative, and `retry_after` is an instant at which the call fits
//! beside the decaying counts under the new limit — in this window or, when this window's count
//! alone leaves no room, in the next — so it and `reset_after` are never more than two windows.
//! A raised limit lets the caller continue from its counts; a new window length keeps them only
//! while the key's window start is also a start of the new windows.
//!
//! **A late refund** ([`Algorithm::give_back`]) goes back to the count its charge was taken in:
//! the current window's while it lasts, the previous one's (where it still weighs) in the window
//! after, nothing later. Never to the current count for a charge of the previous window: that
//! would let the current window hold more than its limit.

use crate::clock::Nanos;
use crate::limit::{Algorithm, Decision, ParamError, Params, Shape, Taken};

/// About `limit` units per sliding `window` nanoseconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlidingWindow {
    limit: u64,
    window: Nanos,
}

/// The current window's start, and the counts of it and the window before (a count never
/// exceeds the limit, which config keeps within 32 bits, so the state is 16 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct State {
    start: Nanos,
    previous: u32,
    current: u32,
}

impl SlidingWindow {
    /// About `limit` units per sliding `window` nanoseconds.
    pub fn new(limit: u64, window: Nanos) -> Self {
        Self { limit: limit.clamp(1, u64::from(u32::MAX)), window: window.max(Nanos::new(1)) }
    }

    /// The window length in nanoseconds.
    pub fn window(&self) -> Nanos {
        self.window
    }

    /// The state rolled forward to the window containing `now`.
    fn roll(&self, state: &State, now: Nanos) -> State {
        let start = now - now % self.window;
        if start == state.start {
            *state
        } else if start == state.start + self.window {
            State { start, previous: state.current, current: 0 }
        } else {
            State { start, previous: 0, current: 0 }
        }
    }

    /// `weighted(previous) + current + cost`, scaled by `window` to stay in integers.
    fn scaled_load(&self, s: &State, now: Nanos, cost: u64) -> u128 {
        let elapsed = u128::from((now - s.start).as_u64());
        let window = u128::from(self.window.as_u64());
        u128::from(s.previous) * (window - elapsed) + (u128::from(s.current) + u128::from(cost)) * window
    }

    /// Time from `now` until `current + cost` fits beside the decaying previous count.
    fn wait(&self, s: &State, now: Nanos, cost: u64) -> Nanos {
        let window = u128::from(self.window.as_u64());
        let limit = u128::from(self.limit);
        let (prev, cur, start) = if u64::from(s.current).saturating_add(cost) <= self.limit {
            (u128::from(s.previous), u128::from(s.current), u128::from(s.start.as_u64()))
        } else {
            // Not in this window: in the next one, this window's count becomes "previous".
            (u128::from(s.current), 0, u128::from(s.start.as_u64()) + window)
        };
        // Need prev × (window − e) ≤ (limit − cur − cost) × window, i.e.
        // e ≥ window − ⌊(limit − cur − cost) × window / prev⌋.
        // Saturating: a cost above the limit (which validation refuses) never fits; waiting for
        // the counts to be gone is then the most honest answer, and no arithmetic wraps.
        let room = limit.saturating_sub(cur + u128::from(cost)) * window;
        let elapsed = room.checked_div(prev).map_or(0, |share| window.saturating_sub(share));
        let at = start + elapsed;
        Nanos::new(u64::try_from(at.saturating_sub(u128::from(now.as_u64()))).unwrap_or(u64::MAX).max(1))
    }
}

impl Algorithm for SlidingWindow {
    const NAME: &'static str = "sliding_window";
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
        format!("{} per ~sliding {} ms", self.limit, self.window.as_u64() / 1_000_000)
    }

    fn fresh(&self, now: Nanos) -> State {
        State { start: now - now % self.window, previous: 0, current: 0 }
    }

    fn acquire(&self, state: &mut State, now: Nanos, cost: u64) -> Decision {
        let s = self.roll(state, now);
        let window = u128::from(self.window.as_u64());
        let allowed = self.scaled_load(&s, now, cost) <= u128::from(self.limit) * window;
        // Allowed means current + cost ≤ limit ≤ u32::MAX, so the sum fits.
        let s = if allowed {
            State { current: s.current.saturating_add(u32::try_from(cost).unwrap_or(u32::MAX)), ..s }
        } else {
            s
        };
        if allowed && cost > 0 {
            *state = s;
        }
        let used = self.scaled_load(&s, now, 0).div_ceil(window);
        let used = u64::try_from(used).unwrap_or(u64::MAX);
        let full_at = if s.current > 0 {
            s.start + self.window * 2
        } else if s.previous > 0 {
            s.start + self.window
        } else {
            now
        };
        Decision {
            allowed,
            limit: self.limit,
            remaining: self.limit.saturating_sub(used),
            retry_after: if allowed { Nanos::ZERO } else { self.wait(&s, now, cost) },
            reset_after: full_at - now,
            at: now,
        }
    }

    fn forget_at(&self, state: &State) -> Nanos {
        if state.current > 0 {
            state.start + self.window * 2
        } else if state.previous > 0 {
            state.start + self.window
        } else {
            Nanos::ZERO
        }
    }

    fn capacity(&self) -> u64 {
        self.limit
    }

    /// Takes `units` back from the current window's count first (the most recent calls), then
    /// from the previous one's.
    fn refund(&self, state: &mut State, now: Nanos, units: u64) {
        let s = self.roll(state, now);
        let from_current = u32::try_from(units).unwrap_or(u32::MAX).min(s.current);
        let rest = u32::try_from(units - u64::from(from_current)).unwrap_or(u32::MAX);
        *state = State { current: s.current - from_current, previous: s.previous.saturating_sub(rest), ..s };
    }

    /// Takes `units` back from the count of the window the charge was taken in: the current
    /// one's while it lasts, the previous one's in the window after it, nothing later.
    fn give_back(&self, state: &mut State, now: Nanos, units: u64, taken: Taken) {
        let s = self.roll(state, now);
        let charged_in = taken.at - taken.at % self.window;
        let units = u32::try_from(units).unwrap_or(u32::MAX);
        *state = if charged_in == s.start {
            State { current: s.current.saturating_sub(units), ..s }
        } else if charged_in + self.window == s.start {
            State { previous: s.previous.saturating_sub(units), ..s }
        } else {
            s
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    const SEC: Nanos = Nanos::from_secs(1);

    #[test]
    fn previous_window_weighs_in_and_decays() {
        let w = SlidingWindow::new(10, 10 * SEC);
        let mut s = w.fresh(Nanos::ZERO);
        assert!(w.acquire(&mut s, 9 * SEC, 10).allowed);
        // 1 s into the next window the previous 10 still weigh 9.
        let d = w.acquire(&mut s, 11 * SEC, 2);
        assert!(!d.allowed);
        assert_eq!(d.retry_after, SEC, "at 12 s the previous window weighs 8, leaving room for 2");
        assert!(w.acquire(&mut s, 11 * SEC + d.retry_after, 2).allowed);
    }

    #[test]
    fn counts_above_a_lowered_limit_leave_nothing_and_a_finite_wait() {
        let before = SlidingWindow::new(100, 10 * SEC);
        let mut s = before.fresh(Nanos::ZERO);
        assert!(before.acquire(&mut s, SEC, 80).allowed);
        let after = SlidingWindow::new(20, 10 * SEC);
        let d = after.acquire(&mut s, 2 * SEC, 5);
        assert_eq!((d.allowed, d.limit, d.remaining), (false, 20, 0));
        // 80 weigh 80 × (1 − e/10 s) in the next window: at most 15 from e = 8.125 s on.
        assert_eq!(d.retry_after, 8 * SEC + 8_125 * SEC / 1_000);
        assert!(after.acquire(&mut s, 2 * SEC + d.retry_after, 5).allowed);
    }

    #[test]
    fn a_cost_above_the_limit_is_refused_without_wrapping() {
        // Config validation refuses such a cost; a limiter handed one anyway must not panic.
        let w = SlidingWindow::new(3, 10 * SEC);
        let mut s = w.fresh(Nanos::ZERO);
        assert!(w.acquire(&mut s, Nanos::ZERO, 2).allowed);
        let d = w.acquire(&mut s, SEC, 5);
        assert!(!d.allowed);
        assert!(d.retry_after > Nanos::ZERO && d.retry_after <= 20 * SEC, "{d:?}");
    }
}
