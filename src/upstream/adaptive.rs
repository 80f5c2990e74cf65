//! Adaptive concurrency toward the upstream (`[upstream.adaptive]`, `[proxy.adaptive]`): the
//! account's slots learnt instead of known.
//!
//! [`AdaptiveLimit`] is one learner ([`crate::limit::adaptive`]: AIMD or Gradient2, between
//! `min` and the static cap) kept in this process: the queue ([`super::queue::FairQueue`]) hands
//! out slots up to its current limit, and tells it what each slot's use said — the upstream took
//! the work, or said it had too much — with the slot's round-trip time on the server's clock.
//! Jobs that do not fit wait in the fair queue as they do under a static cap.
//!
//! Over a shared store (Redis) the queue learns one limit for every instance instead, in the
//! store (`FairQueue::shared_in`), and this one stays its fallback while the store cannot answer.

use std::sync::Mutex;

use crate::clock::Nanos;
use crate::config::AdaptiveConfig;
pub use crate::limit::adaptive::{ALGORITHMS, Signal};
use crate::limit::adaptive::{Algorithm, Gradient2, Learner, Learnt, Sample, gradient2};

/// A learnt limit between `min` and `max` slots, starting at `max`.
#[derive(Debug)]
pub struct AdaptiveLimit {
    learner: Learner,
    learnt: Mutex<Learnt>,
}

impl AdaptiveLimit {
    /// The learner `config` asks for under a static cap of `ceiling` slots, if it is enabled.
    pub fn configured(config: &AdaptiveConfig, ceiling: usize) -> Option<Self> {
        let algorithm = match config.algorithm.as_str() {
            gradient2::NAME => Algorithm::Gradient2(Gradient2 {
                tolerance: config.tolerance,
                smoothing: config.smoothing,
                long_window: config.long_window as u64,
                queue_size: config.queue_size as u64,
            }),
            // Validated: the only other one.
            _ => Algorithm::Aimd,
        };
        let max = config.max_under(ceiling) as u64;
        config.enabled.then(|| Self::new(Learner::new(config.min as u64, max, config.backoff_ratio, algorithm)))
    }

    /// AIMD between `min` and `max` slots (at least one each, `min` ≤ `max`), cutting to
    /// `backoff_ratio` (0 to 1) on overload; it starts at `max`, where a static cap would be.
    pub fn aimd(min: usize, max: usize, backoff_ratio: f64) -> Self {
        Self::new(Learner::new(min as u64, max as u64, backoff_ratio, Algorithm::Aimd))
    }

    /// `learner`, starting at its `max`.
    pub fn new(learner: Learner) -> Self {
        let learnt = Mutex::new(learner.fresh());
        Self { learner, learnt }
    }

    fn learnt(&self) -> std::sync::MutexGuard<'_, Learnt> {
        // A learnt state is replaced whole: a poisoned one is still consistent.
        self.learnt.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How it learns.
    pub fn learner(&self) -> &Learner {
        &self.learner
    }

    /// The slots that may be in use now (whole slots, never below `min`).
    pub fn current(&self) -> usize {
        usize::try_from(self.learner.current(&self.learnt())).unwrap_or(usize::MAX)
    }

    /// The ceiling (the static cap).
    pub fn max(&self) -> usize {
        usize::try_from(self.learner.max()).unwrap_or(usize::MAX)
    }

    /// Learns from a slot taken at `taken_at` that said `signal` at `now` (its round-trip time is
    /// the difference), while `others` more slots were in use.
    pub fn learn(&self, signal: Signal, taken_at: Nanos, others: usize, now: Nanos) {
        let sample = Sample { signal, rtt: now - taken_at, others, taken_at, now };
        self.learner.learn(&mut self.learnt(), &sample);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defaults() -> AdaptiveConfig {
        let config = crate::config::Config::defaults(&crate::config::Catalogue::learned()).expect("defaults");
        config.upstream.adaptive
    }

    #[test]
    fn a_configured_limit_starts_at_the_ceiling_and_none_when_off() {
        assert!(AdaptiveLimit::configured(&defaults(), 10).is_none(), "off by default");
        let on = AdaptiveConfig { enabled: true, max: 6, ..defaults() };
        let limit = AdaptiveLimit::configured(&on, 10).expect("on");
        assert_eq!((limit.current(), limit.max()), (6, 6), "max under the static cap");
        assert_eq!(limit.learner().algorithm(), &Algorithm::Aimd);
    }

    #[test]
    fn gradient2_is_configured_with_netflixs_parameters_and_a_probe_of_one_slot() {
        let on = AdaptiveConfig { enabled: true, algorithm: "gradient2".into(), ..defaults() };
        let limit = AdaptiveLimit::configured(&on, 10).expect("on");
        // Netflix's but for queue_size (its 4 suits limits of tens; an account has a few slots).
        let ours = Gradient2 { tolerance: 1.5, smoothing: 0.2, long_window: 600, queue_size: 1 };
        assert_eq!(limit.learner().algorithm(), &Algorithm::Gradient2(ours));
        // Answers 100 ms each while the limit is in use: steady latency, it stays at the ceiling.
        for at in 0..50u64 {
            limit.learn(
                Signal::Accepted,
                Nanos::new(at * 1_000_000_000),
                9,
                Nanos::new(at * 1_000_000_000 + 100_000_000),
            );
        }
        assert_eq!(limit.current(), 10);
        // A 429 cuts it as AIMD's does; a slot taken before the cut cannot cut it again.
        limit.learn(Signal::Overloaded, Nanos::new(60_000_000_000), 6, Nanos::new(60_100_000_000));
        limit.learn(Signal::Overloaded, Nanos::new(59_000_000_000), 2, Nanos::new(60_200_000_000));
        assert_eq!(limit.current(), 6);
    }

    #[test]
    fn overload_cuts_once_per_round_to_at_most_what_else_was_running_and_success_grows_it_back() {
        let limit = AdaptiveLimit::aimd(1, 10, 0.9);
        assert_eq!(limit.current(), 10, "starts at the ceiling");
        // A 429 while 6 other slots ran: 6 was already too many... at most 6.
        limit.learn(Signal::Overloaded, Nanos::new(5), 6, Nanos::new(10));
        assert_eq!(limit.current(), 6);
        // A slot taken before that cut says nothing new.
        limit.learn(Signal::Overloaded, Nanos::new(9), 2, Nanos::new(11));
        assert_eq!(limit.current(), 6);
        limit.learn(Signal::Overloaded, Nanos::new(12), 6, Nanos::new(13));
        assert_eq!(limit.current(), 5, "6 × 0.9 = 5.4");
        // Six successes at the limit: +1/limit each, one slot more.
        for _ in 0..6 {
            limit.learn(Signal::Accepted, Nanos::new(14), 4, Nanos::new(15));
        }
        assert_eq!(limit.current(), 6);
        // Idle (little in use): no growth.
        for _ in 0..100 {
            limit.learn(Signal::Accepted, Nanos::new(16), 0, Nanos::new(17));
        }
        assert_eq!(limit.current(), 6);
        for _ in 0..1000 {
            limit.learn(Signal::Accepted, Nanos::new(16), 9, Nanos::new(17));
        }
        assert_eq!(limit.current(), 10, "never above the ceiling");
        limit.learn(Signal::Overloaded, Nanos::new(20), 0, Nanos::new(21));
        assert_eq!(limit.current(), 1, "never below min");
    }
}
