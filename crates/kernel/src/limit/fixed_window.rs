//! Fixed window: a counter per aligned window of time.
//!
//! **Choose it** when the contract is literally "N per calendar minute" (billing periods,
//! published quotas) and its edge behaviour is acceptable: it is the cheapest limiter there is
//! and the easiest to explain.
//!
//! **At a window edge** the counter resets all at once, so a caller can spend `limit` in the
//! last instant of one window and `limit` again in the first instant of the next: up to 2×
//! the limit within a span much shorter than the window. Use [`sliding_log`](super::sliding_log)
//! or [`sliding_window`](super::sliding_window) when that matters.
//!
//! Windows are aligned to multiples of the window length on the store's clock.
//!
//! **When its limit is lowered** below what the current window has already counted, the count
//! stays (those calls happened): `remaining` is 0, never negative, and a call is refused until
//! the window ends, which `retry_after` names exactly; it and `reset_after` are never more than
//! one window. A raised limit lets the caller continue from its count. A new window length keeps
//! the count only while the key's window start is also a start of the new windows.
//!
//! **A late refund** ([`Algorithm::give_back`]) goes back to the window its charge was counted in,
//! while that window lasts, and is lost with it: a call reserved 30 of 60 at 8.2 s into a 10 s
//! window and settled at 26 in the next gives that next window nothing (it never held the 30,
//! and taking 4 from its count let it admit 64).

use crate::clock::Nanos;
use crate::limit::{Algorithm, Decision, ParamError, Params, Shape, Taken};

/// `limit` units per window of `window` nanoseconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FixedWindow {
    limit: u64,
    window: Nanos,
}

/// The window a key last counted in, and its count there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct State {
    start: Nanos,
    count: u64,
}

impl FixedWindow {
    /// `limit` units per `window` nanoseconds.
    pub fn new(limit: u64, window: Nanos) -> Self {
        Self { limit: limit.max(1), window: window.max(Nanos::new(1)) }
    }

    /// The window length in nanoseconds.
    pub fn window(&self) -> Nanos {
        self.window
    }
}

impl Algorithm for FixedWindow {
    const NAME: &'static str = "fixed_window";
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
        format!("{} per {} ms window", self.limit, self.window.as_u64() / 1_000_000)
    }

    fn fresh(&self, now: Nanos) -> State {
        State { start: now - now % self.window, count: 0 }
    }

    fn acquire(&self, state: &mut State, now: Nanos, cost: u64) -> Decision {
        let start = now - now % self.window;
        let count = if state.start == start { state.count } else { 0 };
        let end = start + self.window;
        let allowed = count.saturating_add(cost) <= self.limit;
        let count = if allowed { count.saturating_add(cost) } else { count };
        if allowed && cost > 0 {
            *state = State { start, count };
        }
        Decision {
            allowed,
            limit: self.limit,
            // Saturating: a count taken under a larger limit may exceed this one.
            remaining: self.limit.saturating_sub(count),
            retry_after: if allowed { Nanos::ZERO } else { end - now },
            reset_after: if count == 0 { Nanos::ZERO } else { end - now },
            at: now,
        }
    }

    fn forget_at(&self, state: &State) -> Nanos {
        if state.count == 0 { Nanos::ZERO } else { state.start + self.window }
    }

    fn capacity(&self) -> u64 {
        self.limit
    }

    /// Takes `units` back from the current window's count; a count of an earlier window no
    /// longer counts anyway.
    fn refund(&self, state: &mut State, now: Nanos, units: u64) {
        if state.start == now - now % self.window {
            state.count = state.count.saturating_sub(units);
        }
    }

    /// Takes `units` back from the count of the window the charge was taken in, while it is the
    /// current one; after it ends, nothing (that window's count no longer counts, and the next
    /// one never held the charge).
    fn give_back(&self, state: &mut State, now: Nanos, units: u64, taken: Taken) {
        let charged_in = taken.at - taken.at % self.window;
        if state.start == charged_in && charged_in == now - now % self.window {
            state.count = state.count.saturating_sub(units);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    const SEC: Nanos = Nanos::from_secs(1);

    #[test]
    fn counts_reset_at_the_aligned_edge() {
        let w = FixedWindow::new(2, 10 * SEC);
        let mut s = w.fresh(3 * SEC);
        assert!(w.acquire(&mut s, 3 * SEC, 1).allowed);
        assert!(w.acquire(&mut s, 4 * SEC, 1).allowed);
        let d = w.acquire(&mut s, 4 * SEC, 1);
        assert!(!d.allowed);
        assert_eq!(d.retry_after, 6 * SEC, "until the window ends at 10 s");
        assert!(w.acquire(&mut s, 10 * SEC, 1).allowed);
    }

    #[test]
    fn a_limit_lowered_under_the_count_leaves_nothing_until_the_window_ends() {
        let before = FixedWindow::new(100, 60 * SEC);
        let mut s = before.fresh(Nanos::ZERO);
        assert!(before.acquire(&mut s, SEC, 50).allowed);
        let after = FixedWindow::new(40, 60 * SEC);
        let d = after.acquire(&mut s, 2 * SEC, 1);
        assert_eq!((d.allowed, d.limit, d.remaining), (false, 40, 0));
        assert_eq!(d.retry_after, 58 * SEC, "exactly until the window ends");
        assert!(after.acquire(&mut s, 60 * SEC, 40).allowed);
    }
}
