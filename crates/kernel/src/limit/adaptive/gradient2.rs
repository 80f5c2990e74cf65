//! Gradient2, Netflix `concurrency-limits`' latency gradient: choose it for an upstream that
//! slows down before it refuses (a server whose requests queue), where the round-trip time says
//! "too many" before any error does.
//!
//! It keeps a long-term round-trip time, an exponential average over `long_window` answers (the
//! first ten simply averaged, to warm up; an answer that took no measurable time, as on a clock
//! that did not move, is left out), and compares each answer's own RTT with it:
//!
//! ```text
//! gradient = max(0.5, min(1.0, tolerance × long_rtt / rtt))
//! new      = limit × gradient + queue_size
//! limit    = limit × (1 − smoothing) + new × smoothing
//! ```
//!
//! While latency is steady the gradient is 1 and the limit grows by `smoothing × queue_size` per
//! answer, up to `max`; when an answer takes more than `tolerance` times the long-term RTT the
//! gradient falls (never below 0.5, so one outlier cannot halve the limit) and the limit shrinks
//! towards `queue_size / (1 − gradient)`. When latency falls back after a long overload (the
//! long-term RTT more than twice the answer's), the long-term RTT decays by 5 % per answer, as
//! Netflix does, so the limit need not wait for the average to catch up. Nothing changes while
//! less than half the limit is in use (app-limited).
//!
//! Unlike Netflix's, an overload (a 429, a timeout) also cuts the limit, by `backoff_ratio`
//! once per round ([`super::Learner`]'s loss rule): a paid API that refuses at its cap without
//! slowing down would otherwise be probed by `queue_size` a time for ever. An overload is not
//! an RTT sample: how fast an upstream says no says nothing of its queue.
//!
//! `queue_size` is how far it probes: Netflix's 4 suits limits of tens or hundreds; for an
//! account of a few slots, 1 probes one slot at a time, as AIMD does. Its Lua twin is
//! `crates/redis/src/adaptive/gradient2.lua`.

use super::{Learnt, Sample};

/// Its name in config.
pub const NAME: &str = "gradient2";

/// Answers averaged before the long-term RTT becomes an exponential average (Netflix's warm-up).
pub const WARM_UP: u64 = 10;

/// Gradient2's parameters, named as Netflix names them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gradient2 {
    /// How much slower than the long-term RTT an answer may be before the limit shrinks (≥ 1).
    pub tolerance: f64,
    /// How far one answer moves the limit towards its new estimate (0 to 1].
    pub smoothing: f64,
    /// Answers the long-term RTT averages over (≥ 1).
    pub long_window: u64,
    /// Slots it allows above what the gradient says: how far it probes per answer (≥ 1).
    pub queue_size: u64,
}

impl Gradient2 {
    /// An answer that took `sample.rtt`: the long-term RTT moves, and the limit with the gradient
    /// unless the limit is app-limited.
    pub(super) fn answered(&self, learnt: &mut Learnt, sample: &Sample) {
        let rtt = sample.rtt.as_u64() as f64;
        // An answer that took no measurable time (a clock that did not move, as a manual one
        // between its steps) says nothing of latency: the long-term RTT is left alone, and the
        // gradient is 1, no queue.
        let mut gradient = 1.0;
        if rtt > 0.0 {
            if learnt.samples < WARM_UP {
                learnt.samples += 1;
                learnt.long_rtt += (rtt - learnt.long_rtt) / learnt.samples as f64;
            } else {
                let factor = 2.0 / (self.long_window as f64 + 1.0);
                learnt.long_rtt = learnt.long_rtt * (1.0 - factor) + rtt * factor;
            }
            let long_rtt = learnt.long_rtt;
            // Latency back to normal after a long overload: let the baseline follow sooner.
            if long_rtt / rtt > 2.0 {
                learnt.long_rtt = long_rtt * 0.95;
            }
            gradient = (self.tolerance * long_rtt / rtt).clamp(0.5, 1.0);
        }
        // Less than half in use: the limit is not what holds us back.
        if (sample.others.saturating_add(1) as f64) < learnt.limit / 2.0 {
            return;
        }
        let new = learnt.limit * gradient + self.queue_size as f64;
        learnt.limit = learnt.limit * (1.0 - self.smoothing) + new * self.smoothing;
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Algorithm, Learner, Signal};
    use super::*;
    use crate::clock::{NANOS_PER_MS, Nanos};

    const NETFLIX: Gradient2 = Gradient2 { tolerance: 1.5, smoothing: 0.2, long_window: 600, queue_size: 4 };

    fn learner(min: u64, max: u64) -> Learner {
        Learner::new(min, max, 0.9, Algorithm::Gradient2(NETFLIX))
    }

    fn answer(rtt_ms: u64, others: usize) -> Sample {
        Sample {
            signal: Signal::Accepted,
            rtt: Nanos::from_millis(rtt_ms),
            others,
            taken_at: Nanos::ZERO,
            now: Nanos::from_millis(rtt_ms),
        }
    }

    #[test]
    fn steady_latency_grows_the_limit_to_max() {
        let learner = learner(1, 40);
        let mut learnt = Learnt { limit: 10.0, ..learner.fresh() };
        let mut seen = Vec::new();
        for _ in 0..40 {
            let busy = learner.current(&learnt) as usize;
            learner.learn(&mut learnt, &answer(100, busy));
            seen.push(learner.current(&learnt));
        }
        assert_eq!(seen[0], 10, "10 + 0.2 × 4 = 10.8: {seen:?}");
        assert!(seen.windows(2).all(|w| w[1] >= w[0]), "only grows: {seen:?}");
        assert_eq!(learner.current(&learnt), 40, "0.8 a steady answer, up to max: {seen:?}");
        assert!((learnt.long_rtt / NANOS_PER_MS as f64 - 100.0).abs() < 1e-6, "{}", learnt.long_rtt);
    }

    #[test]
    fn latency_rising_shrinks_the_limit_and_falling_lets_it_grow_again() {
        let learner = learner(1, 100);
        let mut learnt = Learnt { limit: 50.0, ..learner.fresh() };
        for _ in 0..100 {
            learner.learn(&mut learnt, &answer(100, 60));
        }
        let before = learnt.limit;
        assert_eq!(before, 100.0, "steady at 100 ms: grown to max");
        // Three times slower: 1.5 × 100 / 300, about 0.5, the floor of the gradient.
        let mut shrinking = Vec::new();
        for _ in 0..20 {
            learner.learn(&mut learnt, &answer(300, 99));
            shrinking.push(learner.current(&learnt));
        }
        assert_eq!(shrinking[0], 90, "100 × 0.8 + (100 × 0.5 + 4) × 0.2 ≈ 90.8: {shrinking:?}");
        assert!(shrinking.windows(2).all(|w| w[1] <= w[0]), "falls while latency stays up: {shrinking:?}");
        assert!(learnt.limit < 25.0, "towards queue_size / (1 − 0.5) = 8: {shrinking:?}");
        // Latency back at 100 ms: the limit grows again.
        let low = learnt.limit;
        for _ in 0..20 {
            learner.learn(&mut learnt, &answer(100, 99));
        }
        assert!(learnt.limit > low + 10.0, "{low} → {}", learnt.limit);
    }

    #[test]
    fn an_app_limited_limit_does_not_grow_but_the_long_rtt_still_learns() {
        let learner = learner(1, 40);
        let mut learnt = Learnt { limit: 20.0, ..learner.fresh() };
        for _ in 0..50 {
            learner.learn(&mut learnt, &answer(100, 8));
        }
        assert_eq!(learnt.limit, 20.0, "9 of 20 in use: under half, nothing moves");
        assert_eq!(learnt.samples, WARM_UP);
        learner.learn(&mut learnt, &answer(100, 9));
        assert!((learnt.limit - 20.8).abs() < 1e-9, "10 of 20: half in use, it grows: {}", learnt.limit);
    }

    #[test]
    fn a_long_rtt_far_above_the_answers_decays_as_netflix_does() {
        let learner = learner(1, 40);
        let mut learnt =
            Learnt { limit: 10.0, long_rtt: 1000.0 * NANOS_PER_MS as f64, samples: WARM_UP, cut_at: Nanos::ZERO };
        learner.learn(&mut learnt, &answer(100, 0));
        let averaged = 1000.0 * (1.0 - 2.0 / 601.0) + 100.0 * (2.0 / 601.0);
        assert!((learnt.long_rtt / NANOS_PER_MS as f64 - averaged * 0.95).abs() < 1e-6, "{}", learnt.long_rtt);
    }

    #[test]
    fn an_answer_without_measurable_time_shows_no_queue_and_leaves_the_long_rtt_alone() {
        let learner = learner(1, 10);
        let mut learnt = Learnt { limit: 4.0, long_rtt: 250.0, samples: 3, cut_at: Nanos::ZERO };
        learner.learn(&mut learnt, &answer(0, 3));
        assert!((learnt.limit - 4.8).abs() < 1e-9, "gradient 1: + 0.2 × 4: {}", learnt.limit);
        assert_eq!((learnt.long_rtt, learnt.samples), (250.0, 3));
    }

    proptest::proptest! {
        #[test]
        fn the_limit_never_leaves_min_and_max(
            min in 1u64..8,
            span in 0u64..40,
            steps in proptest::collection::vec((0u64..5_000, 0usize..60, proptest::bool::ANY), 1..200),
            tolerance in 1.0f64..3.0,
            smoothing in 0.01f64..=1.0,
            long_window in 1u64..1000,
            queue_size in 1u64..10,
        ) {
            let algorithm = Algorithm::Gradient2(Gradient2 { tolerance, smoothing, long_window, queue_size });
            let learner = Learner::new(min, min + span, 0.5, algorithm);
            let mut learnt = learner.fresh();
            for (now, (rtt_ms, others, overload)) in steps.into_iter().enumerate() {
                let signal = if overload { Signal::Overloaded } else { Signal::Accepted };
                let now = Nanos::from_millis(now as u64);
                let sample = Sample { signal, rtt: Nanos::from_millis(rtt_ms), others, taken_at: now, now };
                learner.learn(&mut learnt, &sample);
                proptest::prop_assert!(learnt.limit >= min as f64 && learnt.limit <= (min + span) as f64, "{learnt:?}");
                let current = learner.current(&learnt);
                proptest::prop_assert!(current >= min && current <= min + span);
            }
        }
    }
}
