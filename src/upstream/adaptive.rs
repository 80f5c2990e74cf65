//! Adaptive concurrency toward the upstream (`[upstream.adaptive]`, `[proxy.adaptive]`): the
//! account's slots learnt instead of known.
//!
//! `upstream.max_in_flight` is a number someone must know, and real accounts change: a provider
//! lowers a limit, a plan is upgraded, a shared key is used elsewhere. Then a static cap either
//! wastes capacity or meets 429s. This learns the limit the way TCP and Netflix's
//! `concurrency-limits` do, by **AIMD** (additive increase, multiplicative decrease), between
//! `min` and the static cap (the ceiling):
//!
//! - **Overload** (the upstream's 429 on a submission; for a proxied server, a call that did not
//!   answer in time) cuts the limit to `backoff_ratio` of itself, and never above the slots our
//!   other jobs were holding when it said so: it just told us that was already too many. Only
//!   one cut per round: a slot taken before the last cut was decided under the old limit, and its
//!   429 says nothing new (as TCP halves once per window, not once per lost packet).
//! - **Success** (a submission accepted, a call answered) grows it by `1 / limit`, so by one slot
//!   per limit's worth of successes, and only while the limit is what holds us back (at least
//!   half of it in use, as Netflix's AIMD checks): an idle account does not learn a limit it never
//!   tried.
//!
//! The queue ([`super::queue::FairQueue`]) hands out slots up to the current limit; jobs that do
//! not fit wait in the fair queue as they do under a static cap. The limit is kept per instance
//! (over Redis each instance learns its own, under the shared static cap).

use std::sync::Mutex;

use crate::clock::Nanos;
use crate::config::AdaptiveConfig;

/// What one use of a slot said about the upstream's capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// It took the work (a submission accepted, a call answered).
    Accepted,
    /// It said it had too much (a 429; a proxied call that timed out).
    Overloaded,
}

#[derive(Debug)]
struct Learnt {
    limit: f64,
    /// When the limit was last cut: a slot taken before then cannot cut it again.
    cut_at: Nanos,
}

/// An AIMD limit between `min` and `max`, starting at `max`.
#[derive(Debug)]
pub struct AdaptiveLimit {
    min: f64,
    max: f64,
    backoff_ratio: f64,
    learnt: Mutex<Learnt>,
}

impl AdaptiveLimit {
    /// The learner `config` asks for under a static cap of `ceiling` slots, if it is enabled.
    pub fn configured(config: &AdaptiveConfig, ceiling: usize) -> Option<Self> {
        config.enabled.then(|| Self::aimd(config.min, config.max_under(ceiling), config.backoff_ratio))
    }

    /// AIMD between `min` and `max` slots (at least one each, `min` ≤ `max`), cutting to
    /// `backoff_ratio` (0 to 1) on overload; it starts at `max`, where a static cap would be.
    pub fn aimd(min: usize, max: usize, backoff_ratio: f64) -> Self {
        let max = max.max(1) as f64;
        let min = (min.max(1) as f64).min(max);
        Self {
            min,
            max,
            backoff_ratio: backoff_ratio.clamp(0.0, 1.0),
            learnt: Mutex::new(Learnt { limit: max, cut_at: 0 }),
        }
    }

    fn learnt(&self) -> std::sync::MutexGuard<'_, Learnt> {
        self.learnt.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The slots that may be in use now (whole slots, never below `min`).
    pub fn current(&self) -> usize {
        self.learnt().limit.floor().clamp(self.min, self.max) as usize
    }

    /// The ceiling (the static cap).
    pub fn max(&self) -> usize {
        self.max as usize
    }

    /// Learns from a slot taken at `taken_at` that said `signal` at `now`, while `others` more
    /// slots were in use.
    pub fn learn(&self, signal: Signal, taken_at: Nanos, others: usize, now: Nanos) {
        let mut learnt = self.learnt();
        match signal {
            Signal::Accepted => {
                // Only while the limit is what holds us back.
                if (others.saturating_add(1) as f64) * 2.0 >= learnt.limit {
                    learnt.limit = (learnt.limit + 1.0 / learnt.limit.max(1.0)).min(self.max);
                }
            }
            Signal::Overloaded if taken_at >= learnt.cut_at => {
                let cut = (learnt.limit * self.backoff_ratio).min(others as f64);
                learnt.limit = cut.max(self.min);
                learnt.cut_at = now;
            }
            Signal::Overloaded => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_configured_limit_starts_at_the_ceiling_and_none_when_off() {
        let config = crate::config::Config::defaults(&crate::config::Catalogue::learned()).expect("defaults");
        assert!(AdaptiveLimit::configured(&config.upstream.adaptive, 10).is_none(), "off by default");
        let on = AdaptiveConfig { enabled: true, max: 6, ..config.upstream.adaptive.clone() };
        let limit = AdaptiveLimit::configured(&on, 10).expect("on");
        assert_eq!((limit.current(), limit.max()), (6, 6), "max under the static cap");
    }

    #[test]
    fn overload_cuts_once_per_round_to_at_most_what_else_was_running_and_success_grows_it_back() {
        let limit = AdaptiveLimit::aimd(1, 10, 0.9);
        assert_eq!(limit.current(), 10, "starts at the ceiling");
        // A 429 while 6 other slots ran: 6 was already too many... at most 6.
        limit.learn(Signal::Overloaded, 5, 6, 10);
        assert_eq!(limit.current(), 6);
        // A slot taken before that cut says nothing new.
        limit.learn(Signal::Overloaded, 9, 2, 11);
        assert_eq!(limit.current(), 6);
        limit.learn(Signal::Overloaded, 12, 6, 13);
        assert_eq!(limit.current(), 5, "6 × 0.9 = 5.4");
        // Six successes at the limit: +1/limit each, one slot more.
        for _ in 0..6 {
            limit.learn(Signal::Accepted, 14, 4, 15);
        }
        assert_eq!(limit.current(), 6);
        // Idle (little in use): no growth.
        for _ in 0..100 {
            limit.learn(Signal::Accepted, 16, 0, 17);
        }
        assert_eq!(limit.current(), 6);
        for _ in 0..1000 {
            limit.learn(Signal::Accepted, 16, 9, 17);
        }
        assert_eq!(limit.current(), 10, "never above the ceiling");
        limit.learn(Signal::Overloaded, 20, 0, 21);
        assert_eq!(limit.current(), 1, "never below min");
    }
}
