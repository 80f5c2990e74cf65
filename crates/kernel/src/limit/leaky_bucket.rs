//! Leaky bucket as a meter.
//!
//! **Choose it** when you think of a caller's *load* rather than its credit: each call pours
//! its cost into a bucket that drains at a constant rate, and a call that would overflow it is
//! refused. As a meter it is the mirror image of the [token bucket](super::token_bucket) (level
//! = capacity − tokens) and makes the same decisions; the *queue* form, which delays work
//! instead of refusing it, is the fair queue in front of the upstream account (`upstream::queue`).
//!
//! **At a window edge** there is none: the bucket drains continuously, so at most
//! `capacity + t × rate` units pass in any interval `t`.
//!
//! **When its limit is lowered** (a smaller capacity, a slower leak) the water already poured
//! stays and drains at one nanosecond per nanosecond, whatever the period: above the new brim,
//! `remaining` is 0, never negative, and `retry_after` is still exact for the new limit (when
//! the water is down to the brim less this call's cost). Water never exceeds the largest brim
//! (capacity × period) of any limit the key has had, so neither `retry_after` nor `reset_after`
//! ever does. A raised limit lets the caller continue from its level.
//!
//! **A late refund** ([`Algorithm::give_back`]) takes out the water the unused units have not
//! drained yet: a charge's last units drain last, gone by when its decision said the bucket would
//! be empty; once that is past, nothing; nothing either when the key was written since the
//! charge, as for the token bucket. Exact before anything else is poured, never more than the
//! bucket would hold had the call cost less.

use crate::clock::Nanos;
use crate::limit::{
    Algorithm, Decision, GIVEN_BACK_AHEAD, ParamError, Params, Shape, Taken, bucket_period, owed, per_sec, period_of,
};

/// A bucket holding `capacity` units that drains one unit every `period` nanoseconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeakyBucket {
    capacity: u64,
    period: Nanos,
}

/// How full the bucket was (in ns of draining) when last seen, and when that was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct State {
    water: Nanos,
    updated_at: Nanos,
}

impl LeakyBucket {
    /// A bucket of `capacity` units draining at `leak_per_sec` units per second.
    pub fn new(capacity: u64, leak_per_sec: f64) -> Self {
        Self { capacity: capacity.max(1), period: bucket_period(capacity, period_of(leak_per_sec)) }
    }

    /// Nanoseconds to drain one unit.
    pub fn period(&self) -> Nanos {
        self.period
    }
}

impl Algorithm for LeakyBucket {
    const NAME: &'static str = "leaky_bucket";
    const PARAMS: &'static [&'static str] = &["burst", "leak_per_sec"];

    type State = State;

    fn from_params(params: &Params<'_>) -> Result<Self, ParamError> {
        let (capacity, period) = params.bucket("burst", "leak_per_sec")?;
        Ok(Self { capacity, period })
    }

    fn with_shape(capacity: u64, shape: Shape) -> Option<Self> {
        match shape {
            Shape::Rate { period } => Some(Self { capacity: capacity.max(1), period: bucket_period(capacity, period) }),
            Shape::Window { .. } | Shape::Slots => None,
        }
    }

    fn shape(&self) -> Shape {
        Shape::Rate { period: self.period }
    }

    fn describe(&self) -> String {
        format!("capacity {}, leak {}/s", self.capacity, per_sec(self.period))
    }

    fn fresh(&self, now: Nanos) -> State {
        State { water: Nanos::ZERO, updated_at: now }
    }

    fn acquire(&self, state: &mut State, now: Nanos, cost: u64) -> Decision {
        let brim = self.period * self.capacity;
        let water = state.water - (now - state.updated_at);
        let poured = water + self.period * cost;
        let allowed = poured <= brim;
        let water = if allowed { poured } else { water };
        if allowed && cost > 0 {
            *state = State { water, updated_at: now.max(state.updated_at) };
        }
        Decision {
            allowed,
            limit: self.capacity,
            // Saturating: water poured under a larger brim may stand above this one.
            remaining: (brim - water) / self.period,
            retry_after: if allowed { Nanos::ZERO } else { poured - brim },
            reset_after: water,
            at: now,
        }
    }

    fn forget_at(&self, state: &State) -> Nanos {
        state.updated_at + state.water
    }

    fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Takes `units` of water out, never below empty.
    fn refund(&self, state: &mut State, now: Nanos, units: u64) {
        take_out(state, now, self.period * units.min(self.capacity));
    }

    /// Takes out the water the last `units` of the charge have not drained yet (`owed`);
    /// nothing when the key was written since the charge (as the token bucket).
    fn give_back(&self, state: &mut State, now: Nanos, units: u64, taken: Taken) {
        let back = owed(self.period * units.min(self.capacity), taken, now);
        if state.updated_at <= taken.at && back > Nanos::ZERO {
            take_out(state, now, back);
        }
    }
}

/// `back` ns of water out at `now`, never below empty, stamped as a give-back.
fn take_out(state: &mut State, now: Nanos, back: Nanos) {
    let water = state.water - (now - state.updated_at);
    let stamp = (now + GIVEN_BACK_AHEAD).max(state.updated_at);
    *state = State { water: water - back, updated_at: stamp };
}

#[cfg(test)]
mod tests {
    use super::*;
    const SEC: Nanos = Nanos::from_secs(1);

    #[test]
    fn overflow_is_refused_until_enough_has_drained() {
        let b = LeakyBucket::new(4, 2.0);
        let mut s = b.fresh(Nanos::ZERO);
        assert!(b.acquire(&mut s, Nanos::ZERO, 3).allowed);
        let d = b.acquire(&mut s, Nanos::ZERO, 2);
        assert!(!d.allowed);
        assert_eq!(d.retry_after, SEC / 2);
        assert!(b.acquire(&mut s, SEC / 2, 2).allowed);
    }

    #[test]
    fn water_above_a_lowered_brim_drains_to_an_exact_wait() {
        let before = LeakyBucket::new(10, 1.0);
        let mut s = before.fresh(Nanos::ZERO);
        assert!(before.acquire(&mut s, Nanos::ZERO, 8).allowed);
        // 8 s of water; the new brim holds 2 units of half a second: 1 s.
        let after = LeakyBucket::new(2, 2.0);
        let d = after.acquire(&mut s, Nanos::ZERO, 1);
        assert_eq!((d.allowed, d.limit, d.remaining), (false, 2, 0));
        assert_eq!(d.retry_after, 15 * SEC / 2, "down to the brim less one unit: 8 s - 0.5 s");
        assert_eq!(d.reset_after, 8 * SEC);
        assert!(!after.acquire(&mut s, d.retry_after - Nanos::new(1), 1).allowed);
        assert!(after.acquire(&mut s, d.retry_after, 1).allowed);
    }
}
