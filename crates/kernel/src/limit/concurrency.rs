//! Concurrency: a fixed number of in-flight slots.
//!
//! **Choose it** to cap work *in flight* rather than work per time: jobs running at the
//! upstream at once, parallel fan-out of one agent. A slot is taken when a call is admitted
//! and given back when the work ends — finished, failed, cancelled or its connection dropped;
//! the store hands out a guard that releases on drop, so no path can leak a slot.
//!
//! There is no window and no clock: a refused call cannot be told when a slot will free up
//! (`retry_after` is zero); the refusal says `busy` and suggests polling instead.
//!
//! **When its cap is lowered** below the slots already held, the held slots stay held (their
//! work is running) and count against the new cap: `remaining` is 0, never negative, and every
//! call is refused until enough of them are given back. A raised cap admits at once.

use crate::clock::Nanos;
use crate::limit::{Algorithm, Decision, ParamError, Params, Shape, Taken};

/// At most `max` units in flight at once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Concurrency {
    max: u64,
}

/// Units currently in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct State {
    in_flight: u64,
}

impl Concurrency {
    /// At most `max` in flight.
    pub fn new(max: u64) -> Self {
        Self { max: max.max(1) }
    }
}

impl Algorithm for Concurrency {
    const NAME: &'static str = "concurrency";
    const PARAMS: &'static [&'static str] = &["max_in_flight"];

    type State = State;

    fn from_params(params: &Params<'_>) -> Result<Self, ParamError> {
        Ok(Self::new(params.units("max_in_flight")?))
    }

    fn with_shape(capacity: u64, shape: Shape) -> Option<Self> {
        match shape {
            Shape::Slots => Some(Self::new(capacity)),
            Shape::Rate { .. } | Shape::Window { .. } => None,
        }
    }

    fn shape(&self) -> Shape {
        Shape::Slots
    }

    fn describe(&self) -> String {
        format!("{} in flight", self.max)
    }

    /// Gives back `cost` slots.
    fn release(&self, state: &mut State, cost: u64) {
        state.in_flight = state.in_flight.saturating_sub(cost);
    }

    fn fresh(&self, _now: Nanos) -> State {
        State { in_flight: 0 }
    }

    fn acquire(&self, state: &mut State, now: Nanos, cost: u64) -> Decision {
        let allowed = state.in_flight.saturating_add(cost) <= self.max;
        if allowed {
            state.in_flight = state.in_flight.saturating_add(cost);
        }
        // Saturating: slots taken under a larger cap may exceed this one.
        let remaining = self.max.saturating_sub(state.in_flight);
        Decision { allowed, limit: self.max, remaining, retry_after: Nanos::ZERO, reset_after: Nanos::ZERO, at: now }
    }

    fn forget_at(&self, state: &State) -> Nanos {
        if state.in_flight == 0 { Nanos::ZERO } else { Nanos::MAX }
    }

    fn capacity(&self) -> u64 {
        self.max
    }

    /// Releases `units` slots, as the end of that much work would.
    fn refund(&self, state: &mut State, _now: Nanos, units: u64) {
        self.release(state, units);
    }

    /// Slots have no time: the same as a refund.
    fn give_back(&self, state: &mut State, _now: Nanos, units: u64, _taken: Taken) {
        self.release(state, units);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cap_lowered_under_held_slots_leaves_none_until_they_are_given_back() {
        let before = Concurrency::new(5);
        let mut s = before.fresh(Nanos::ZERO);
        assert!(before.acquire(&mut s, Nanos::ZERO, 3).allowed);
        let after = Concurrency::new(1);
        let d = after.acquire(&mut s, Nanos::ZERO, 1);
        assert_eq!((d.allowed, d.limit, d.remaining), (false, 1, 0));
        after.release(&mut s, 2);
        assert_eq!(after.acquire(&mut s, Nanos::ZERO, 0).remaining, 0, "one slot still held: the whole new cap");
        after.release(&mut s, 1);
        assert!(after.acquire(&mut s, Nanos::ZERO, 1).allowed);
    }
}
