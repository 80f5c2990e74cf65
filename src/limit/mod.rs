//! The limiting algorithms and the [`Decision`] they share.
//!
//! An algorithm is pure arithmetic: given the state a key had, the time and the cost of a
//! call, it says whether the call conforms and updates the state — only when it does; a refused
//! call is never charged. Where the state lives (a sharded map in memory, or Redis) is the
//! [`crate::store`]'s business, so each algorithm can be read, tested and swapped on its own.
//!
//! | algorithm | choose it when | state per key |
//! | --- | --- | --- |
//! | [`token_bucket`] | callers may spend a saved-up burst, then a steady rate | level + time |
//! | [`gcra`] | the same contract as a token bucket in one timestamp | one timestamp |
//! | [`fixed_window`] | you need "N per calendar minute" and can live with 2× at the edge | window + count |
//! | [`sliding_log`] | the limit must be exact over *every* window (small limits) | one entry per call |
//! | [`sliding_window`] | near-exact windows in constant memory | window + two counts |
//! | [`leaky_bucket`] | you think in load that drains, not credit that refills | level + time |
//! | [`concurrency`] | you cap work in flight, not work per time | a counter |

pub mod concurrency;
pub mod fixed_window;
pub mod gcra;
pub mod leaky_bucket;
pub mod sliding_log;
pub mod sliding_window;
pub mod token_bucket;

use crate::clock::Nanos;
pub use concurrency::Concurrency;
pub use fixed_window::FixedWindow;
pub use gcra::Gcra;
pub use leaky_bucket::LeakyBucket;
pub use sliding_log::SlidingLog;
pub use sliding_window::SlidingWindow;
pub use token_bucket::TokenBucket;

/// The answer a limiter gives for one call against one scope.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Whether the call conforms. When it does not, nothing was charged.
    pub allowed: bool,
    /// The most the scope can ever admit at once (its burst, window limit or slot count).
    pub limit: u64,
    /// Units the scope could still admit right now, after this call if it was allowed.
    pub remaining: u64,
    /// When refused: how long until a call of the same cost would be admitted, if nothing else
    /// is charged meanwhile. Zero when allowed, and for [`concurrency`] (a slot frees when a
    /// holder finishes, which no clock can tell).
    pub retry_after: Nanos,
    /// How long until the scope is back to its full limit if nothing else is charged.
    pub reset_after: Nanos,
}

/// One algorithm: parameters plus the arithmetic on its per-key state.
///
/// Precondition everywhere: `cost <= capacity()` (config validation rejects larger costs, after
/// tiers and insurance shares too). A state may have been left by the same algorithm with other
/// parameters (a reload, a tier, an insurance share of 1/N): the answer is then still about the
/// current limit — `limit` is its capacity, `remaining` at most that, a wait exact and bounded as
/// each module doc says under "when its limit is lowered" — and no arithmetic wraps.
pub trait Algorithm {
    /// What a key remembers between decisions.
    type State: Clone + std::fmt::Debug;

    /// The state of a key never seen before, at `now`.
    fn fresh(&self, now: Nanos) -> Self::State;

    /// Decides a call of `cost` units at `now`; charges `state` only if the call is allowed.
    /// A cost of zero never charges and reads the level.
    fn acquire(&self, state: &mut Self::State, now: Nanos, cost: u64) -> Decision;

    /// From this instant on `state` behaves exactly like [`Algorithm::fresh`], so the store may
    /// forget the key (sweep in memory, TTL in Redis).
    fn forget_at(&self, state: &Self::State) -> Nanos;

    /// The most this limiter can admit at once; a larger cost can never pass.
    fn capacity(&self) -> u64;

    /// Gives `units` back to `state` at `now` (an operator's refund), never beyond the capacity:
    /// afterwards the key admits what it admitted before plus at most `units`. Units past the
    /// capacity are ignored, so a refund of any size means "fill it up".
    fn refund(&self, state: &mut Self::State, now: Nanos, units: u64);
}

/// The state one key keeps, whichever algorithm owns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LimiterState {
    /// See [`token_bucket::State`].
    TokenBucket(token_bucket::State),
    /// See [`gcra::State`].
    Gcra(gcra::State),
    /// See [`fixed_window::State`].
    FixedWindow(fixed_window::State),
    /// See [`sliding_log::State`]; boxed so the other states stay small.
    SlidingLog(Box<sliding_log::State>),
    /// See [`sliding_window::State`].
    SlidingWindow(sliding_window::State),
    /// See [`leaky_bucket::State`].
    LeakyBucket(leaky_bucket::State),
    /// See [`concurrency::State`].
    Concurrency(concurrency::State),
}

/// A configured limiter: one algorithm with its parameters.
#[derive(Debug, Clone, PartialEq)]
pub enum Limiter {
    /// Lazy-refill token bucket with costs.
    TokenBucket(TokenBucket),
    /// Generic cell rate algorithm (virtual scheduling).
    Gcra(Gcra),
    /// Counter per aligned window.
    FixedWindow(FixedWindow),
    /// Exact log of admitted calls over a sliding window.
    SlidingLog(SlidingLog),
    /// Weighted counter over the current and previous window.
    SlidingWindow(SlidingWindow),
    /// Leaky bucket as a meter.
    LeakyBucket(LeakyBucket),
    /// In-flight slots.
    Concurrency(Concurrency),
}

/// Every algorithm name a config may use.
pub const ALGORITHMS: &[&str] =
    &["token_bucket", "gcra", "fixed_window", "sliding_log", "sliding_window", "leaky_bucket", "concurrency"];

/// Runs `$body` with `$alg` bound to the algorithm and `$state` to its state, resetting a
/// state that belongs to another algorithm (a config change under a shared store).
macro_rules! with_state {
    ($limiter:expr, $slot:expr, $now:expr, |$alg:ident, $state:ident| $body:expr) => {{
        let slot: &mut LimiterState = $slot;
        match $limiter {
            Limiter::TokenBucket($alg) => {
                if !matches!(slot, LimiterState::TokenBucket(_)) {
                    *slot = LimiterState::TokenBucket($alg.fresh($now));
                }
                let LimiterState::TokenBucket($state) = slot else { unreachable!("state was just set") };
                $body
            }
            Limiter::Gcra($alg) => {
                if !matches!(slot, LimiterState::Gcra(_)) {
                    *slot = LimiterState::Gcra($alg.fresh($now));
                }
                let LimiterState::Gcra($state) = slot else { unreachable!("state was just set") };
                $body
            }
            Limiter::FixedWindow($alg) => {
                if !matches!(slot, LimiterState::FixedWindow(_)) {
                    *slot = LimiterState::FixedWindow($alg.fresh($now));
                }
                let LimiterState::FixedWindow($state) = slot else { unreachable!("state was just set") };
                $body
            }
            Limiter::SlidingLog($alg) => {
                if !matches!(slot, LimiterState::SlidingLog(_)) {
                    *slot = LimiterState::SlidingLog(Box::new($alg.fresh($now)));
                }
                let LimiterState::SlidingLog(boxed) = slot else { unreachable!("state was just set") };
                let $state = &mut **boxed;
                $body
            }
            Limiter::SlidingWindow($alg) => {
                if !matches!(slot, LimiterState::SlidingWindow(_)) {
                    *slot = LimiterState::SlidingWindow($alg.fresh($now));
                }
                let LimiterState::SlidingWindow($state) = slot else { unreachable!("state was just set") };
                $body
            }
            Limiter::LeakyBucket($alg) => {
                if !matches!(slot, LimiterState::LeakyBucket(_)) {
                    *slot = LimiterState::LeakyBucket($alg.fresh($now));
                }
                let LimiterState::LeakyBucket($state) = slot else { unreachable!("state was just set") };
                $body
            }
            Limiter::Concurrency($alg) => {
                if !matches!(slot, LimiterState::Concurrency(_)) {
                    *slot = LimiterState::Concurrency($alg.fresh($now));
                }
                let LimiterState::Concurrency($state) = slot else { unreachable!("state was just set") };
                $body
            }
        }
    }};
}

impl Limiter {
    /// The name used in config and in `rate_limit_status`.
    pub fn algorithm(&self) -> &'static str {
        match self {
            Limiter::TokenBucket(_) => "token_bucket",
            Limiter::Gcra(_) => "gcra",
            Limiter::FixedWindow(_) => "fixed_window",
            Limiter::SlidingLog(_) => "sliding_log",
            Limiter::SlidingWindow(_) => "sliding_window",
            Limiter::LeakyBucket(_) => "leaky_bucket",
            Limiter::Concurrency(_) => "concurrency",
        }
    }

    /// The most this limiter can admit at once; a cost above it can never pass.
    pub fn capacity(&self) -> u64 {
        match self {
            Limiter::TokenBucket(a) => a.capacity(),
            Limiter::Gcra(a) => a.capacity(),
            Limiter::FixedWindow(a) => a.capacity(),
            Limiter::SlidingLog(a) => a.capacity(),
            Limiter::SlidingWindow(a) => a.capacity(),
            Limiter::LeakyBucket(a) => a.capacity(),
            Limiter::Concurrency(a) => a.capacity(),
        }
    }

    /// The config parameter that sets [`Limiter::capacity`], for error messages.
    pub fn capacity_key(&self) -> &'static str {
        match self {
            Limiter::TokenBucket(_) | Limiter::Gcra(_) | Limiter::LeakyBucket(_) => "burst",
            Limiter::FixedWindow(_) | Limiter::SlidingLog(_) | Limiter::SlidingWindow(_) => "limit",
            Limiter::Concurrency(_) => "max_in_flight",
        }
    }

    /// This limiter with its capacity and its rate multiplied by `factor` (a tier); windows keep
    /// their length. Capacities round to the nearest unit and never drop below one.
    pub fn scaled(&self, factor: f64) -> Limiter {
        if factor == 1.0 {
            return self.clone();
        }
        let units = |n: u64| ((n as f64 * factor).round() as u64).max(1);
        match self {
            Limiter::TokenBucket(a) => {
                Limiter::TokenBucket(TokenBucket::new(units(a.capacity()), per_sec(a.period()) * factor))
            }
            Limiter::Gcra(a) => Limiter::Gcra(Gcra::new(units(a.capacity()), per_sec(a.period()) * factor)),
            Limiter::LeakyBucket(a) => {
                Limiter::LeakyBucket(LeakyBucket::new(units(a.capacity()), per_sec(a.period()) * factor))
            }
            Limiter::FixedWindow(a) => Limiter::FixedWindow(FixedWindow::new(units(a.capacity()), a.window())),
            Limiter::SlidingLog(a) => Limiter::SlidingLog(SlidingLog::new(units(a.capacity()), a.window())),
            Limiter::SlidingWindow(a) => Limiter::SlidingWindow(SlidingWindow::new(units(a.capacity()), a.window())),
            Limiter::Concurrency(a) => Limiter::Concurrency(Concurrency::new(units(a.capacity()))),
        }
    }

    /// The window a quota policy header should name: the window itself for window algorithms,
    /// the time to refill from empty for buckets, none for in-flight slots.
    pub fn policy_window(&self) -> Option<Nanos> {
        match self {
            Limiter::TokenBucket(a) => Some(a.capacity().saturating_mul(a.period())),
            Limiter::Gcra(a) => Some(a.capacity().saturating_mul(a.period())),
            Limiter::LeakyBucket(a) => Some(a.capacity().saturating_mul(a.period())),
            Limiter::FixedWindow(a) => Some(a.window()),
            Limiter::SlidingLog(a) => Some(a.window()),
            Limiter::SlidingWindow(a) => Some(a.window()),
            Limiter::Concurrency(_) => None,
        }
    }

    /// The longest stretch of time the state remembers: a full bucket's refill time, or the
    /// window (zero for in-flight slots).
    pub fn span(&self) -> Nanos {
        self.policy_window().unwrap_or(0)
    }

    /// Whether admitted units must be given back with [`Limiter::release`] (in-flight slots).
    pub fn holds_slots(&self) -> bool {
        matches!(self, Limiter::Concurrency(_))
    }

    /// The state of a key never seen before.
    pub fn fresh(&self, now: Nanos) -> LimiterState {
        match self {
            Limiter::TokenBucket(a) => LimiterState::TokenBucket(a.fresh(now)),
            Limiter::Gcra(a) => LimiterState::Gcra(a.fresh(now)),
            Limiter::FixedWindow(a) => LimiterState::FixedWindow(a.fresh(now)),
            Limiter::SlidingLog(a) => LimiterState::SlidingLog(Box::new(a.fresh(now))),
            Limiter::SlidingWindow(a) => LimiterState::SlidingWindow(a.fresh(now)),
            Limiter::LeakyBucket(a) => LimiterState::LeakyBucket(a.fresh(now)),
            Limiter::Concurrency(a) => LimiterState::Concurrency(a.fresh(now)),
        }
    }

    /// Decides a call of `cost` units at `now`, charging `state` only if it is allowed.
    pub fn acquire(&self, state: &mut LimiterState, now: Nanos, cost: u64) -> Decision {
        with_state!(self, state, now, |alg, s| alg.acquire(s, now, cost))
    }

    /// When `state` becomes indistinguishable from a fresh one.
    pub fn forget_at(&self, state: &mut LimiterState, now: Nanos) -> Nanos {
        with_state!(self, state, now, |alg, s| alg.forget_at(s))
    }

    /// Gives `units` back to the budget in `state` at `now`, never beyond its capacity (see
    /// [`Algorithm::refund`]).
    pub fn refund(&self, state: &mut LimiterState, now: Nanos, units: u64) {
        // Past the capacity a refund only fills up; clamped here so both stores see one number.
        let units = units.min(self.capacity());
        with_state!(self, state, now, |alg, s| alg.refund(s, now, units))
    }

    /// Gives back `cost` in-flight slots; a no-op for rate algorithms.
    pub fn release(&self, state: &mut LimiterState, cost: u64) {
        if let (Limiter::Concurrency(alg), LimiterState::Concurrency(s)) = (self, state) {
            alg.release(s, cost);
        }
    }

    /// A one-line description of the parameters, for `check-config`.
    pub fn describe(&self) -> String {
        match self {
            Limiter::TokenBucket(a) => format!("burst {}, refill {}/s", a.capacity(), per_sec(a.period())),
            Limiter::Gcra(a) => format!("burst {}, rate {}/s", a.capacity(), per_sec(a.period())),
            Limiter::FixedWindow(a) => format!("{} per {} ms window", a.capacity(), a.window() / 1_000_000),
            Limiter::SlidingLog(a) => format!("{} per sliding {} ms", a.capacity(), a.window() / 1_000_000),
            Limiter::SlidingWindow(a) => format!("{} per ~sliding {} ms", a.capacity(), a.window() / 1_000_000),
            Limiter::LeakyBucket(a) => format!("capacity {}, leak {}/s", a.capacity(), per_sec(a.period())),
            Limiter::Concurrency(a) => format!("{} in flight", a.capacity()),
        }
    }

    /// The limit as an agent reads it: `60 tokens, refilled at 1 per second`,
    /// `2000 tokens per 86400-second window`.
    pub fn in_words(&self) -> String {
        match self {
            Limiter::TokenBucket(_) | Limiter::Gcra(_) | Limiter::LeakyBucket(_) => {
                format!("{} tokens, refilled at {} per second", self.capacity(), self.rate_per_sec())
            }
            Limiter::FixedWindow(_) | Limiter::SlidingLog(_) | Limiter::SlidingWindow(_) => {
                format!("{} tokens per {}-second window", self.capacity(), self.span() / 1_000_000_000)
            }
            Limiter::Concurrency(_) => format!("{} at once", self.capacity()),
        }
    }

    /// Units returned per second on average (the sustained rate); zero for in-flight slots.
    pub fn rate_per_sec(&self) -> f64 {
        match self {
            Limiter::TokenBucket(a) => per_sec(a.period()),
            Limiter::Gcra(a) => per_sec(a.period()),
            Limiter::LeakyBucket(a) => per_sec(a.period()),
            Limiter::FixedWindow(a) => a.capacity() as f64 / (a.window() as f64 / 1e9),
            Limiter::SlidingLog(a) => a.capacity() as f64 / (a.window() as f64 / 1e9),
            Limiter::SlidingWindow(a) => a.capacity() as f64 / (a.window() as f64 / 1e9),
            Limiter::Concurrency(_) => 0.0,
        }
    }
}

fn per_sec(period: Nanos) -> f64 {
    crate::clock::NANOS_PER_SEC as f64 / period as f64
}

/// Nanoseconds per unit for a rate in units per second, rounded to the nearest nanosecond and
/// never zero.
pub(crate) fn period_of(rate_per_sec: f64) -> Nanos {
    let period = (crate::clock::NANOS_PER_SEC as f64 / rate_per_sec).round();
    if period.is_finite() && period >= 1.0 { period as u64 } else { 1 }
}
