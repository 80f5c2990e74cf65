//! Learnt concurrency limits: how many calls an upstream takes at once, learnt from its answers
//! instead of known (`[upstream.adaptive]`, `[proxy.adaptive]`).
//!
//! A fixed `max_in_flight` is a number someone must know, and real accounts change: a provider
//! lowers a limit, a plan is upgraded, a shared key is used elsewhere. A [`Learner`] keeps a
//! limit instead — a real number, whose floor is the slots handed out — between `min` and `max`
//! (the static cap, its ceiling), starting at `max` where a static cap would be, and moves it
//! with what each use of a slot said (a [`Sample`]):
//!
//! - **An overload is a loss, whatever the algorithm.** The upstream's 429 cuts the limit to
//!   `backoff_ratio` of itself, and never above the slots the others were holding when it said
//!   so: it just told us that was already too many. Once per round: a slot taken before the last cut was handed out under the
//!   old limit, and its 429 says nothing new (as TCP halves once per window, not once per lost
//!   packet). Netflix's Gradient2 ignores drops and waits for latency to rise; a paid API that
//!   answers 429 at its cap without slowing down first would then be probed for ever, so here
//!   every learner cuts on it.
//! - **A call not answered in time** ([`Signal::TimedOut`], a proxied server's only sign of
//!   overload) is weaker evidence: one slow call may be slow for its own arguments. It cuts by
//!   the ratio alone (never to what the others held), once per round, and only when other slots
//!   were in use as it timed out: a lone slow call, with nothing else loading the upstream, says
//!   nothing about how many calls it takes, and teaches nothing. (Which callers' time-outs may
//!   teach at all is the door's call: the proxy lets no unverified caller's.)
//! - **An answer** is learnt by the algorithm: [`aimd`] grows the limit by one slot per limit's
//!   worth of answers; [`gradient2`] compares the answer's round-trip time with a long-term
//!   average, shrinking when latency rises (a queue forming upstream) and growing while it is
//!   steady. Neither grows while less than half the limit is in use (app-limited): an idle
//!   account does not learn a limit it never tried.
//!
//! Pure arithmetic on a [`Learnt`] state, like the limiting algorithms beside it: the account's
//! queue keeps one in memory (`upstream::adaptive::AdaptiveLimit`); over Redis the state lives in
//! one key, learnt by the Lua twins (`crates/redis/src/adaptive.lua` and `adaptive/<name>.lua`),
//! which do the very same floating-point operations in the same order, so both give the same
//! limit to the last bit. Time is whatever clock the caller reads (the server's, or Redis's).
//!
//! **Adding a learner** takes its `crates/kernel/src/limit/adaptive/<name>.rs`, its Lua twin
//! `crates/redis/src/adaptive/<name>.lua`, a variant of [`Algorithm`] and its name in
//! [`ALGORITHMS`].

pub mod aimd;
pub mod gradient2;

use crate::clock::Nanos;
pub use gradient2::Gradient2;

/// Every learner's name, as `algorithm` in `[upstream.adaptive]` takes it.
pub const ALGORITHMS: &[&str] = &[aimd::NAME, gradient2::NAME];

/// What one use of a slot said about the upstream's capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// It took the work (a submission accepted, a call answered).
    Accepted,
    /// It said it had too much (a 429).
    Overloaded,
    /// It did not answer in time (a proxied call past `proxy.timeout_ms`, its own time: not the
    /// wait for a slot).
    TimedOut,
}

/// One use of a slot, as a learner learns from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// What the upstream said.
    pub signal: Signal,
    /// Its round-trip time: from the slot being taken to the answer, in nanoseconds.
    pub rtt: Nanos,
    /// Slots in use besides this one when it answered.
    pub others: usize,
    /// When the slot was taken (for the once-per-round rule), on the clock `now` is read on.
    pub taken_at: Nanos,
    /// When it answered.
    pub now: Nanos,
}

/// How a learner grows (and, for gradient2, shrinks) its limit between overloads.
#[derive(Debug, Clone, PartialEq)]
pub enum Algorithm {
    /// Additive increase, multiplicative decrease ([`aimd`]).
    Aimd,
    /// Netflix's latency gradient ([`gradient2`]).
    Gradient2(Gradient2),
}

impl Algorithm {
    /// Its name in config.
    pub fn name(&self) -> &'static str {
        match self {
            Algorithm::Aimd => aimd::NAME,
            Algorithm::Gradient2(_) => gradient2::NAME,
        }
    }
}

/// What a learner knows: the limit so far and what its algorithm keeps to move it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Learnt {
    /// The limit, a real number: the slots handed out are its floor.
    pub limit: f64,
    /// When it was last cut: a slot taken before then cannot cut it again.
    pub cut_at: Nanos,
    /// Gradient2: the long-term round-trip time (ns), an exponential average.
    pub long_rtt: f64,
    /// Gradient2: the answers averaged into `long_rtt` so far, up to its warm-up.
    pub samples: u64,
}

/// A concurrency limit learnt between `min` and `max` slots.
#[derive(Debug, Clone, PartialEq)]
pub struct Learner {
    min: u64,
    max: u64,
    backoff_ratio: f64,
    algorithm: Algorithm,
}

impl Learner {
    /// A learner between `min` and `max` slots (at least one each, `min` ≤ `max`), cutting to
    /// `backoff_ratio` (0 to 1) of itself on an overload, growing by `algorithm`.
    pub fn new(min: u64, max: u64, backoff_ratio: f64, algorithm: Algorithm) -> Self {
        let max = max.max(1);
        Self { min: min.clamp(1, max), max, backoff_ratio: backoff_ratio.clamp(0.0, 1.0), algorithm }
    }

    /// Fewest slots.
    pub fn min(&self) -> u64 {
        self.min
    }

    /// Most slots: where it starts.
    pub fn max(&self) -> u64 {
        self.max
    }

    /// What an overload cuts the limit to, as a share of itself.
    pub fn backoff_ratio(&self) -> f64 {
        self.backoff_ratio
    }

    /// How it grows between overloads.
    pub fn algorithm(&self) -> &Algorithm {
        &self.algorithm
    }

    /// What it knows before its first sample: the limit at `max`.
    pub fn fresh(&self) -> Learnt {
        Learnt { limit: self.max as f64, cut_at: Nanos::ZERO, long_rtt: 0.0, samples: 0 }
    }

    /// The whole slots `learnt` hands out: its limit's floor, within `min` and `max`.
    pub fn current(&self, learnt: &Learnt) -> u64 {
        (learnt.limit.floor() as u64).clamp(self.min, self.max)
    }

    /// Moves `learnt` by what `sample` said; the limit stays within `min` and `max`.
    pub fn learn(&self, learnt: &mut Learnt, sample: &Sample) {
        match (sample.signal, &self.algorithm) {
            (Signal::Overloaded | Signal::TimedOut, _) => self.cut(learnt, sample),
            (Signal::Accepted, Algorithm::Aimd) => aimd::answered(learnt, sample),
            (Signal::Accepted, Algorithm::Gradient2(gradient2)) => gradient2.answered(learnt, sample),
        }
        learnt.limit = learnt.limit.min(self.max as f64).max(self.min as f64);
    }

    /// An overload: once per round, to `backoff_ratio` of the limit — and for a 429 no more than
    /// the others held. A time-out with nothing else running teaches nothing.
    fn cut(&self, learnt: &mut Learnt, sample: &Sample) {
        if sample.taken_at < learnt.cut_at || (sample.signal == Signal::TimedOut && sample.others == 0) {
            return;
        }
        let mut limit = learnt.limit * self.backoff_ratio;
        if sample.signal == Signal::Overloaded {
            limit = limit.min(sample.others as f64);
        }
        learnt.limit = limit;
        learnt.cut_at = sample.now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(signal: Signal, taken_at: u64, others: usize, now: u64) -> Sample {
        let (taken_at, now) = (Nanos::new(taken_at), Nanos::new(now));
        Sample { signal, rtt: now - taken_at, others, taken_at, now }
    }

    #[test]
    fn overload_cuts_once_per_round_to_at_most_what_else_was_running_whatever_the_algorithm() {
        let gradient2 =
            Algorithm::Gradient2(Gradient2 { tolerance: 1.5, smoothing: 0.2, long_window: 600, queue_size: 4 });
        for algorithm in [Algorithm::Aimd, gradient2] {
            let learner = Learner::new(2, 10, 0.9, algorithm);
            let mut learnt = learner.fresh();
            assert_eq!(learner.current(&learnt), 10, "starts at the ceiling");
            learner.learn(&mut learnt, &sample(Signal::Overloaded, 5, 6, 10));
            assert_eq!(learner.current(&learnt), 6, "a 429 while 6 others ran: 6 was already too many");
            learner.learn(&mut learnt, &sample(Signal::Overloaded, 9, 2, 11));
            assert_eq!(learner.current(&learnt), 6, "a slot taken before that cut says nothing new");
            learner.learn(&mut learnt, &sample(Signal::Overloaded, 12, 6, 13));
            assert_eq!(learner.current(&learnt), 5, "6 × 0.9 = 5.4");
            learner.learn(&mut learnt, &sample(Signal::Overloaded, 14, 0, 15));
            assert_eq!((learner.current(&learnt), learnt.limit), (2, 2.0), "never below min");
        }
    }

    #[test]
    fn a_lone_time_out_teaches_nothing_and_one_among_others_cuts_by_the_ratio_alone() {
        let learner = Learner::new(1, 16, 0.9, Algorithm::Aimd);
        let mut learnt = learner.fresh();
        learner.learn(&mut learnt, &sample(Signal::TimedOut, 0, 0, 3));
        assert_eq!((learner.current(&learnt), learnt.cut_at), (16, Nanos::ZERO), "one slow call alone says nothing");
        learner.learn(&mut learnt, &sample(Signal::TimedOut, 4, 2, 9));
        assert_eq!(learner.current(&learnt), 14, "a time-out while 2 others ran: 16 × 0.9, never down to 2");
        learner.learn(&mut learnt, &sample(Signal::TimedOut, 7, 5, 10));
        assert_eq!(learner.current(&learnt), 14, "once per round: taken before the last cut");
        learner.learn(&mut learnt, &sample(Signal::Overloaded, 11, 3, 12));
        assert_eq!(learner.current(&learnt), 3, "a 429 while 3 others ran: 3 was already the most");
    }

    #[test]
    fn bounds_are_whole_slots_of_at_least_one() {
        let learner = Learner::new(0, 0, 2.0, Algorithm::Aimd);
        assert_eq!((learner.min(), learner.max(), learner.backoff_ratio()), (1, 1, 1.0));
        let learner = Learner::new(7, 3, 0.5, Algorithm::Aimd);
        assert_eq!((learner.min(), learner.max()), (3, 3), "min is never above max");
        assert_eq!(ALGORITHMS, ["aimd", "gradient2"]);
    }
}
