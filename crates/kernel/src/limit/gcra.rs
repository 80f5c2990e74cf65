//! GCRA: the generic cell rate algorithm (virtual scheduling form).
//!
//! **Choose it** for the same contract as a [token bucket](super::token_bucket) — a burst,
//! then a steady rate, with costs — when state size matters: a key is one timestamp, the
//! *theoretical arrival time* (TAT) at which the bucket would be full again. That is what makes
//! it the algorithm of choice for Redis (one integer per key) and for `governor`.
//!
//! **At a window edge** there is none: like the token bucket, at most `burst + t × rate` units
//! pass in any interval `t`. The two make identical decisions (a property test proves it).
//!
//! A call of cost `n` conforms when `max(TAT, now) + n·T − now ≤ burst·T`, where `T` is the
//! emission interval (ns per unit); it then moves TAT forward by `n·T`.
//!
//! **When its limit is lowered** (a smaller burst, a slower rate) the key keeps its schedule:
//! the TAT already booked is still owed, so while it is further ahead than the new `burst·T`
//! `remaining` is 0 and `retry_after` is exactly `TAT + n·T − now − burst·T` for the new limit.
//! An admitted call never books the TAT further ahead than the `burst·T` of the limit then in
//! force, so `retry_after` and `reset_after` never exceed the largest `burst·T` (the span) of any
//! limit the key has had. A raised limit lets the caller continue on its schedule.
//!
//! **A late refund** ([`Algorithm::give_back`]) moves TAT back by what the unused units still
//! owe: a charge's last units are the last of the schedule booked up to it, due at the TAT its
//! decision left; once that is past, nothing. Before anything else is charged that is exactly
//! the schedule had the call cost less; after other charges, never less booked than that (the
//! key may have been back to full meanwhile). A limit changed meanwhile does not matter: a
//! schedule is never cut by one. A give-back moves the schedule booked before it, so the key
//! remembers when it last gave back, and gives nothing to a charge older than that.

use crate::clock::Nanos;
use crate::limit::{
    Algorithm, Decision, GIVEN_BACK_AHEAD, ParamError, Params, Shape, Taken, bucket_period, owed, per_sec, period_of,
};

/// `burst` units at once, one more every `period` nanoseconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gcra {
    burst: u64,
    period: Nanos,
}

/// The theoretical arrival time: when the key is back to a full burst; and when it last gave
/// back (stamped [`GIVEN_BACK_AHEAD`] later), or was first seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct State {
    tat: Nanos,
    given_back_at: Nanos,
}

impl Gcra {
    /// A limiter admitting `burst` at once and `rate_per_sec` sustained.
    pub fn new(burst: u64, rate_per_sec: f64) -> Self {
        Self { burst: burst.max(1), period: bucket_period(burst, period_of(rate_per_sec)) }
    }

    /// The emission interval: ns per unit.
    pub fn period(&self) -> Nanos {
        self.period
    }

    fn tolerance(&self) -> Nanos {
        self.period * self.burst
    }
}

impl Algorithm for Gcra {
    const NAME: &'static str = "gcra";
    const PARAMS: &'static [&'static str] = &["burst", "refill_per_sec"];

    type State = State;

    fn from_params(params: &Params<'_>) -> Result<Self, ParamError> {
        let (burst, period) = params.bucket("burst", "refill_per_sec")?;
        Ok(Self { burst, period })
    }

    fn with_shape(capacity: u64, shape: Shape) -> Option<Self> {
        match shape {
            Shape::Rate { period } => Some(Self { burst: capacity.max(1), period: bucket_period(capacity, period) }),
            Shape::Window { .. } | Shape::Slots => None,
        }
    }

    fn shape(&self) -> Shape {
        Shape::Rate { period: self.period }
    }

    fn describe(&self) -> String {
        format!("burst {}, rate {}/s", self.burst, per_sec(self.period))
    }

    fn fresh(&self, now: Nanos) -> State {
        State { tat: Nanos::ZERO, given_back_at: now }
    }

    fn acquire(&self, state: &mut State, now: Nanos, cost: u64) -> Decision {
        let tolerance = self.tolerance();
        let start = state.tat.max(now);
        let new_tat = start + self.period * cost;
        let debt = new_tat - now;
        if debt <= tolerance {
            if cost > 0 {
                state.tat = new_tat;
            }
            Decision {
                allowed: true,
                limit: self.burst,
                remaining: (tolerance - debt) / self.period,
                retry_after: Nanos::ZERO,
                reset_after: debt,
                at: now,
            }
        } else {
            let held = start - now;
            Decision {
                allowed: false,
                limit: self.burst,
                remaining: (tolerance - held) / self.period,
                retry_after: debt - tolerance,
                reset_after: held,
                at: now,
            }
        }
    }

    fn forget_at(&self, state: &State) -> Nanos {
        state.tat
    }

    fn capacity(&self) -> u64 {
        self.burst
    }

    /// Moves TAT back by `units` periods, never before `now` (which already means full).
    fn refund(&self, state: &mut State, now: Nanos, units: u64) {
        move_back(state, now, self.period * units.min(self.burst));
    }

    /// Moves TAT back by what the last `units` of the charge still owe (`owed`), never before
    /// `now`; nothing when the key gave back since the charge (its schedule before the charge then
    /// moved, and the charge's units with it, by more than one timestamp can tell). Later charges
    /// do not matter: they only book after it.
    fn give_back(&self, state: &mut State, now: Nanos, units: u64, taken: Taken) {
        let back = owed(self.period * units.min(self.burst), taken, now);
        if state.given_back_at <= taken.at && back > Nanos::ZERO {
            move_back(state, now, back);
        }
    }
}

/// TAT moved back by `back` at `now`, never before `now`, stamped as a give-back.
fn move_back(state: &mut State, now: Nanos, back: Nanos) {
    if state.tat > now {
        state.tat = (state.tat - back).max(now);
        state.given_back_at = (now + GIVEN_BACK_AHEAD).max(state.given_back_at);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    const SEC: Nanos = Nanos::from_secs(1);

    #[test]
    fn burst_then_one_per_period() {
        let g = Gcra::new(3, 1.0);
        let mut s = g.fresh(Nanos::ZERO);
        assert!((0..3).all(|_| g.acquire(&mut s, Nanos::ZERO, 1).allowed));
        let d = g.acquire(&mut s, Nanos::ZERO, 1);
        assert!(!d.allowed);
        assert_eq!(d.retry_after, SEC);
        assert_eq!(d.reset_after, 3 * SEC);
        assert!(g.acquire(&mut s, SEC, 1).allowed);
        assert!(!g.acquire(&mut s, SEC, 1).allowed);
    }

    #[test]
    fn costs_wait_for_their_own_size() {
        let g = Gcra::new(10, 2.0);
        let mut s = g.fresh(Nanos::ZERO);
        assert!(g.acquire(&mut s, Nanos::ZERO, 8).allowed);
        let d = g.acquire(&mut s, Nanos::ZERO, 5);
        assert!(!d.allowed);
        assert_eq!(d.remaining, 2);
        assert_eq!(d.retry_after, 3 * SEC / 2);
    }

    #[test]
    fn a_schedule_booked_under_a_larger_burst_is_still_owed_exactly() {
        let before = Gcra::new(100, 1.0);
        let mut s = before.fresh(Nanos::ZERO);
        assert!(before.acquire(&mut s, Nanos::ZERO, 50).allowed);
        // TAT is 50 s ahead; the new burst tolerates 40 s.
        let after = Gcra::new(40, 1.0);
        let d = after.acquire(&mut s, Nanos::ZERO, 1);
        assert_eq!((d.allowed, d.limit, d.remaining), (false, 40, 0));
        assert_eq!((d.retry_after, d.reset_after), (11 * SEC, 50 * SEC));
        assert!(!after.acquire(&mut s, 11 * SEC - Nanos::new(1), 1).allowed);
        assert!(after.acquire(&mut s, 11 * SEC, 1).allowed);
    }
}
