//! AIMD (additive increase, multiplicative decrease), as TCP and Netflix's `concurrency-limits`
//! learn a window: choose it for an upstream that says "too many" (a 429) rather than slowing
//! down, which is what paid APIs with an account cap do.
//!
//! Every answer grows the limit by `1 / limit`, so by one slot per limit's worth of answers, and
//! only while the limit is what holds us back: at least half of it in use (as Netflix's AIMD
//! checks). An overload cuts it to `backoff_ratio` of itself ([`super::Learner`]'s loss rule,
//! shared by every learner). It probes one slot above the capacity about once per limit's worth
//! of answers: the price of finding out that the capacity grew.
//!
//! Its Lua twin is `crates/redis/src/adaptive/aimd.lua`.

use super::{Learnt, Sample};

/// Its name in config.
pub const NAME: &str = "aimd";

/// An answer: one slot more per limit's worth of them, while at least half the limit is in use.
pub(super) fn answered(learnt: &mut Learnt, sample: &Sample) {
    // Only while the limit is what holds us back.
    if (sample.others.saturating_add(1) as f64) * 2.0 >= learnt.limit {
        learnt.limit += 1.0 / learnt.limit.max(1.0);
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Algorithm, Learner, Signal};
    use super::*;
    use crate::clock::Nanos;

    fn answer(others: usize) -> Sample {
        Sample { signal: Signal::Accepted, rtt: Nanos::ZERO, others, taken_at: Nanos::new(16), now: Nanos::new(17) }
    }

    #[test]
    fn answers_grow_it_by_one_slot_per_limits_worth_while_half_is_in_use_and_never_above_max() {
        let learner = Learner::new(1, 10, 0.9, Algorithm::Aimd);
        let mut learnt = Learnt { limit: 5.4, ..learner.fresh() };
        for _ in 0..6 {
            learner.learn(&mut learnt, &answer(4));
        }
        assert_eq!(learner.current(&learnt), 6, "six answers at the limit: one slot more");
        for _ in 0..100 {
            learner.learn(&mut learnt, &answer(0));
        }
        assert_eq!(learner.current(&learnt), 6, "idle (one of six in use): no growth");
        for _ in 0..1000 {
            learner.learn(&mut learnt, &answer(9));
        }
        assert_eq!((learner.current(&learnt), learnt.limit), (10, 10.0), "never above the ceiling");
    }
}
