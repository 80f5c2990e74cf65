//! Token bucket with lazy refill and costs.
//!
//! **Choose it** when callers should be able to spend a saved-up burst at once and then
//! settle to a steady rate: the natural model for "60 calls, then one a second". Expensive
//! calls cost more tokens than cheap ones, all drawn from the same bucket.
//!
//! **At a window edge** there is no edge: tokens come back continuously, so the most a caller
//! can ever spend within any interval `t` is `capacity + t × rate`. A refused call is not
//! charged, and its `retry_after` is exactly the time until enough tokens for *its* cost are
//! back.
//!
//! The level is kept in integer nanoseconds of refill ("one token = `period` ns"), so refill is
//! just elapsed time and every wait comes out exact, with no floating-point drift.
//!
//! **When its limit is lowered** the level a key kept is capped at the new full bucket: the
//! caller keeps what it had saved, never more than the new burst. Every number then depends on
//! the current limit alone: `retry_after` is at most the call's cost in refill time and
//! `reset_after` at most the refill time of a whole bucket (`burst × period`). A raised burst
//! lets the caller continue from its level. (The level is refill time, so a new period reprices
//! the tokens saved: a caller keeps the time it had saved.)
//!
//! **A late refund** (a price settled below its reservation, [`Algorithm::give_back`]) gives
//! back the refill the unused units still owe: the bucket repays its charges in order, so the
//! last units of a charge are the last to come back by time alone, and once the bucket would
//! have been full again without them they are owed nothing. Given back before anything else is
//! charged, the key holds exactly what it would had the call cost less; after other charges,
//! never more (the bucket may have come back part of the way meanwhile, which one level cannot
//! tell). A burst lowered under a saved level caps it, which forgets debt: the guard gives
//! nothing back to a token bucket whose limits were reloaded since the charge. Nor does a bucket
//! written since the charge (another call charged, or something given back) get anything: a
//! give-back moves the debt before it, and where the call's units sit then one level cannot tell;
//! so a give-back is stamped a microsecond ahead ([`GIVEN_BACK_AHEAD`]), and the common case —
//! a job whose caller only polls until it is settled — is given back exactly.

use crate::clock::Nanos;
use crate::limit::{
    Algorithm, Decision, GIVEN_BACK_AHEAD, ParamError, Params, Shape, Taken, bucket_period, owed, per_sec, period_of,
};

/// A bucket of `capacity` tokens that refills one token every `period` nanoseconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBucket {
    capacity: u64,
    period: Nanos,
}

/// What a key remembers: its level (in ns of refill) when last written, and when that was (for a
/// give-back, [`GIVEN_BACK_AHEAD`] later: see `owed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct State {
    level: Nanos,
    updated_at: Nanos,
}

impl TokenBucket {
    /// A bucket of `capacity` tokens refilled at `refill_per_sec` tokens per second.
    pub fn new(capacity: u64, refill_per_sec: f64) -> Self {
        Self { capacity: capacity.max(1), period: bucket_period(capacity, period_of(refill_per_sec)) }
    }

    /// Nanoseconds it takes to refill one token.
    pub fn period(&self) -> Nanos {
        self.period
    }

    fn full(&self) -> Nanos {
        self.period * self.capacity
    }

    /// `back` ns of refill into the level at `now`, never past full, stamped as a give-back.
    fn put_back(&self, state: &mut State, now: Nanos, back: Nanos) {
        let full = self.full();
        let level = (state.level + (now - state.updated_at)).min(full);
        let stamp = (now + GIVEN_BACK_AHEAD).max(state.updated_at);
        *state = State { level: (level + back).min(full), updated_at: stamp };
    }
}

impl Algorithm for TokenBucket {
    const NAME: &'static str = "token_bucket";
    const PARAMS: &'static [&'static str] = &["burst", "refill_per_sec"];

    type State = State;

    fn from_params(params: &Params<'_>) -> Result<Self, ParamError> {
        let (capacity, period) = params.bucket("burst", "refill_per_sec")?;
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
        format!("burst {}, refill {}/s", self.capacity, per_sec(self.period))
    }

    fn fresh(&self, now: Nanos) -> State {
        State { level: self.full(), updated_at: now }
    }

    fn acquire(&self, state: &mut State, now: Nanos, cost: u64) -> Decision {
        let full = self.full();
        let level = (state.level + (now - state.updated_at)).min(full);
        let need = self.period * cost;
        let allowed = need <= level;
        let level = if allowed { level - need } else { level };
        if allowed && cost > 0 {
            *state = State { level, updated_at: now.max(state.updated_at) };
        }
        Decision {
            allowed,
            limit: self.capacity,
            remaining: level / self.period,
            retry_after: if allowed { Nanos::ZERO } else { need - level },
            reset_after: full - level,
            at: now,
        }
    }

    fn forget_at(&self, state: &State) -> Nanos {
        state.updated_at + (self.full() - state.level)
    }

    fn capacity(&self) -> u64 {
        self.capacity
    }

    fn refund(&self, state: &mut State, now: Nanos, units: u64) {
        self.put_back(state, now, self.period * units.min(self.capacity));
    }

    /// The refill the last `units` of the charge still owe (`owed`), back into the level,
    /// never past full; nothing when the key was written since the charge (another call charged,
    /// or something given back: where its units sit then is more than one level can tell).
    fn give_back(&self, state: &mut State, now: Nanos, units: u64, taken: Taken) {
        let back = owed(self.period * units.min(self.capacity), taken, now);
        if state.updated_at <= taken.at && back > Nanos::ZERO {
            self.put_back(state, now, back);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    const SEC: Nanos = Nanos::from_secs(1);

    #[test]
    fn burst_then_refused_with_exact_wait() {
        let b = TokenBucket::new(60, 1.0);
        let mut s = b.fresh(Nanos::ZERO);
        for i in 0..60 {
            let d = b.acquire(&mut s, Nanos::ZERO, 1);
            assert!(d.allowed, "call {i} should pass");
            assert_eq!(d.remaining, 59 - i);
        }
        let d = b.acquire(&mut s, Nanos::ZERO, 1);
        assert!(!d.allowed);
        assert_eq!(d.retry_after, SEC);
        assert_eq!(d.reset_after, 60 * SEC);
        assert!(b.acquire(&mut s, SEC, 1).allowed);
    }

    #[test]
    fn refusal_charges_nothing_and_waits_for_its_own_cost() {
        let b = TokenBucket::new(60, 1.0);
        let mut s = b.fresh(Nanos::ZERO);
        b.acquire(&mut s, Nanos::ZERO, 58);
        let d = b.acquire(&mut s, Nanos::ZERO, 20);
        assert!(!d.allowed);
        assert_eq!(d.remaining, 2);
        assert_eq!(d.retry_after, 18 * SEC);
        assert!(b.acquire(&mut s, 18 * SEC, 20).allowed);
    }

    #[test]
    fn forget_at_is_when_the_bucket_is_full_again() {
        let b = TokenBucket::new(10, 2.0);
        let mut s = b.fresh(5 * SEC);
        b.acquire(&mut s, 5 * SEC, 4);
        assert_eq!(b.forget_at(&s), 7 * SEC);
    }

    #[test]
    fn a_refund_gives_tokens_back_up_to_the_burst() {
        let b = TokenBucket::new(10, 1.0);
        let mut s = b.fresh(Nanos::ZERO);
        b.acquire(&mut s, Nanos::ZERO, 10);
        b.refund(&mut s, Nanos::ZERO, 4);
        assert_eq!(b.acquire(&mut s, Nanos::ZERO, 0).remaining, 4);
        b.refund(&mut s, Nanos::ZERO, 1_000);
        assert_eq!(b.acquire(&mut s, Nanos::ZERO, 0).remaining, 10, "never beyond the burst");
        assert_eq!(b.forget_at(&s), GIVEN_BACK_AHEAD, "full again: as good as fresh once its stamp is past");
    }

    #[test]
    fn fractional_rates_have_exact_periods() {
        let b = TokenBucket::new(5, 0.5);
        assert_eq!(b.period(), 2 * SEC);
        let mut s = b.fresh(Nanos::ZERO);
        b.acquire(&mut s, Nanos::ZERO, 5);
        assert_eq!(b.acquire(&mut s, Nanos::ZERO, 1).retry_after, 2 * SEC);
    }

    #[test]
    fn a_lowered_burst_caps_the_saved_level() {
        let before = TokenBucket::new(100, 1.0);
        let mut s = before.fresh(Nanos::ZERO);
        assert!(before.acquire(&mut s, Nanos::ZERO, 50).allowed);
        let after = TokenBucket::new(40, 1.0);
        let d = after.acquire(&mut s, Nanos::ZERO, 0);
        assert_eq!((d.limit, d.remaining, d.reset_after), (40, 40, Nanos::ZERO), "50 saved, at most 40 kept");
    }
}
