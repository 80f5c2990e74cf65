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

//!
//! **Adding an algorithm** takes one file, `crates/kernel/src/limit/<name>.rs` (the arithmetic, an
//! [`Algorithm`]), and one line in `registry!` below, which declares its module and re-exports
//! its type. Config parsing, `check-config`, the simulator, the admin API's schema and both
//! stores read the registry. On Redis it also needs its Lua twin beside the others
//! (`crates/redis/src/<name>.lua`): the Redis crate lists the twins from the same line, so its
//! build fails naming the missing file. `tests/limits/algorithms.rs` fails until the shared suite
//! has a reference model for it.
//!
//! Beside them, [`adaptive`]: not a limit on callers but the learners that find how many calls
//! an upstream takes at once from its answers (AIMD, Gradient2), which the account's queue hands
//! out slots by.

pub mod adaptive;
pub mod params;

use std::borrow::BorrowMut;

use crate::clock::Nanos;
pub use params::{ParamError, Params};

/// Every algorithm, once: `module => Type`, with `boxed` for a state kept behind a pointer (so the
/// others stay small in the memory store). The order is the order configs, tables and the
/// simulator list them in. Calls `$callback! { (args…) module => Type …, }`. Exported, so the
/// Redis store lists its Lua twins from the same line.
#[doc(hidden)]
#[macro_export]
macro_rules! __limit_registry {
    ($callback:ident $(, $arg:tt)*) => {
        $callback! {
            ($($arg)*)
            token_bucket => TokenBucket,
            gcra => Gcra,
            fixed_window => FixedWindow,
            sliding_log => SlidingLog boxed,
            sliding_window => SlidingWindow,
            leaky_bucket => LeakyBucket,
            concurrency => Concurrency,
        }
    };
}
#[doc(inline)]
pub use crate::__limit_registry as registry;

/// Each registered algorithm's module (`pub mod token_bucket;`) and type (`pub use
/// token_bucket::TokenBucket;`), from its one registry line.
macro_rules! declare_algorithms {
    (() $($module:ident => $Type:ident $($boxed:ident)?,)*) => {
        $(
            pub mod $module;
            pub use $module::$Type;
        )*
    };
}
registry!(declare_algorithms);

/// A registered algorithm's state as a [`LimiterState`] holds it: itself, or boxed.
macro_rules! stored {
    ($module:ident) => { $module::State };
    ($module:ident boxed) => { Box<$module::State> };
}

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
    /// The store's clock when it was decided: where an admitted call's charge landed, which a
    /// settlement later gives back to ([`Taken`]).
    pub at: Nanos,
}

impl Decision {
    /// Where this decision's charge landed, for a settlement to give back to.
    pub fn taken(&self) -> Taken {
        Taken { at: self.at, reset_after: self.reset_after }
    }
}

/// Where and when a call's price was taken from one budget, as its admitting [`Decision`] said:
/// what a settlement gives back to, so a refund lands in the window (or period) the charge did,
/// never in a later one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Taken {
    /// The store's clock when the call was charged.
    pub at: Nanos,
    /// How long after `at` the budget was to be full again, had nothing else been charged: for a
    /// bucket, when this charge (and everything charged before it) would have come back by time
    /// alone.
    pub reset_after: Nanos,
}

/// A change to a budget after the fact, beside the decisions that charge it: units given back (an
/// operator's refund; a settled price below what the call reserved) or taken on top (a settled
/// price above it). None ever takes a budget beyond its capacity or below empty.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Adjustment {
    /// Give `units` back now, never beyond the capacity ([`Algorithm::refund`]): an operator's
    /// refund, tied to no call.
    Refund(u64),
    /// Give back `units` of the charge `taken`, only where it still counts
    /// ([`Algorithm::give_back`]): a settled price below what the call reserved.
    Return {
        /// Units to give back.
        units: u64,
        /// Where the call's charge landed.
        taken: Taken,
    },
    /// Take `units` more now whether or not they are left: what is left is taken and the rest
    /// is forgiven, so the budget stands at empty, never below (a settlement saturates).
    Charge(u64),
}

/// What an algorithm's budget is besides its capacity: a rate, a window, or slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// One unit comes back (refilled, or drained) every `period` nanoseconds: the buckets.
    Rate {
        /// Nanoseconds per unit.
        period: Nanos,
    },
    /// At most the capacity per window of `window` nanoseconds.
    Window {
        /// The window's length.
        window: Nanos,
    },
    /// Units in flight at once, no time at all.
    Slots,
}

/// One algorithm: parameters plus the arithmetic on its per-key state.
///
/// Precondition everywhere: `cost <= capacity()` (config validation rejects larger costs, after
/// tiers and insurance shares too). A state may have been left by the same algorithm with other
/// parameters (a reload, a tier, an insurance share of 1/N): the answer is then still about the
/// current limit — `limit` is its capacity, `remaining` at most that, a wait exact and bounded as
/// each module doc says under "when its limit is lowered" — and no arithmetic wraps.
pub trait Algorithm: Sized {
    /// The name configs, refusals and `rate_limit_status` use; the Lua twin is `<NAME>.lua`.
    const NAME: &'static str;

    /// The parameters it reads from a config table (beside `algorithm`, `mode`, `name`,
    /// `warn_at_percent`).
    const PARAMS: &'static [&'static str];

    /// What a key remembers between decisions.
    type State: Clone + std::fmt::Debug;

    /// Builds it from a config table's parameters, naming the key of any that is missing or out
    /// of bounds.
    fn from_params(params: &Params<'_>) -> Result<Self, ParamError>;

    /// It with `capacity` and `shape` (of its own kind; `None` for another kind): what tiers,
    /// insurance shares and the simulator make of a budget.
    fn with_shape(capacity: u64, shape: Shape) -> Option<Self>;

    /// Its budget besides the capacity.
    fn shape(&self) -> Shape;

    /// A one-line description of the parameters, for `check-config`.
    fn describe(&self) -> String;

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

    /// Gives back, at `now`, `units` of a charge `taken` earlier (a settled price below what the
    /// call reserved), only to where that charge still counts: the window or period it was taken
    /// in, never a later one, and never beyond what the key would hold had the call cost `units`
    /// less. Each module doc says what that is for its algorithm; a charge that no longer counts
    /// gets nothing back.
    fn give_back(&self, state: &mut Self::State, now: Nanos, units: u64, taken: Taken);

    /// Gives back `cost` units of work that ended (in-flight slots); nothing for a rate.
    fn release(&self, _state: &mut Self::State, _cost: u64) {}
}

/// The limiter and state types of every registered algorithm, and what dispatches between them.
macro_rules! limiters {
    (() $($module:ident => $name:ident $($boxed:ident)?,)*) => {
        /// The state one key keeps, whichever algorithm owns it.
        #[derive(Debug, Clone, PartialEq, Eq)]
        pub enum LimiterState {
            $(
                #[doc = concat!("See [`", stringify!($module), "::State`].")]
                $name(stored!($module $($boxed)?)),
            )*
        }

        /// A configured limiter: one algorithm with its parameters.
        #[derive(Debug, Clone, PartialEq)]
        pub enum Limiter {
            $(
                #[doc = concat!("See [`", stringify!($module), "`].")]
                $name($name),
            )*
        }

        /// Every algorithm name a config may use, in the registry's order.
        pub const ALGORITHMS: &[&str] = &[$(<$name as Algorithm>::NAME),*];

        /// Every parameter some algorithm takes.
        const EVERY_PARAM: &[&[&str]] = &[$(<$name as Algorithm>::PARAMS),*];

        impl Limiter {
            /// The name used in config and in `rate_limit_status`.
            pub fn algorithm(&self) -> &'static str {
                match self {
                    $(Limiter::$name(_) => <$name as Algorithm>::NAME,)*
                }
            }

            /// The limiter `algorithm` names, from its config table's parameters; `None` for a
            /// name no algorithm has.
            pub fn from_params(algorithm: &str, params: &Params<'_>) -> Option<Result<Limiter, ParamError>> {
                $(
                    if algorithm == <$name as Algorithm>::NAME {
                        return Some($name::from_params(params).map(Limiter::$name));
                    }
                )*
                None
            }

            /// `algorithm` with `capacity` and `shape`: `None` for an unknown name, or a shape
            /// of another kind (a window for a bucket, a rate for in-flight slots).
            pub fn with_shape(algorithm: &str, capacity: u64, shape: Shape) -> Option<Limiter> {
                $(
                    if algorithm == <$name as Algorithm>::NAME {
                        return $name::with_shape(capacity, shape).map(Limiter::$name);
                    }
                )*
                None
            }

            /// The most this limiter can admit at once; a cost above it can never pass.
            pub fn capacity(&self) -> u64 {
                match self {
                    $(Limiter::$name(a) => a.capacity(),)*
                }
            }

            /// Its budget besides the capacity.
            pub fn shape(&self) -> Shape {
                match self {
                    $(Limiter::$name(a) => a.shape(),)*
                }
            }

            /// A one-line description of the parameters, for `check-config`.
            pub fn describe(&self) -> String {
                match self {
                    $(Limiter::$name(a) => a.describe(),)*
                }
            }

            /// The state of a key never seen before.
            pub fn fresh(&self, now: Nanos) -> LimiterState {
                match self {
                    $(Limiter::$name(a) => LimiterState::$name(a.fresh(now).into()),)*
                }
            }

            /// Runs `f` on `state` as this limiter's own, first resetting a state another
            /// algorithm left (a config change under a shared store).
            fn with_state<R>(&self, state: &mut LimiterState, now: Nanos, f: impl Op<R>) -> R {
                match self {
                    $(
                        Limiter::$name(a) => {
                            if !matches!(state, LimiterState::$name(_)) {
                                *state = LimiterState::$name(a.fresh(now).into());
                            }
                            match state {
                                LimiterState::$name(s) => f.run(a, BorrowMut::<<$name as Algorithm>::State>::borrow_mut(s)),
                                // Just set: the other arms cannot be reached.
                                _ => f.run(a, &mut a.fresh(now)),
                            }
                        }
                    )*
                }
            }
        }
    };
}

registry!(limiters);

/// One operation on an algorithm and its own state, whichever the algorithm.
trait Op<R> {
    fn run<A: Algorithm>(self, algorithm: &A, state: &mut A::State) -> R;
}

/// `acquire(now, cost)`.
struct Acquire(Nanos, u64);
impl Op<Decision> for Acquire {
    fn run<A: Algorithm>(self, algorithm: &A, state: &mut A::State) -> Decision {
        algorithm.acquire(state, self.0, self.1)
    }
}

/// `forget_at`.
struct ForgetAt;
impl Op<Nanos> for ForgetAt {
    fn run<A: Algorithm>(self, algorithm: &A, state: &mut A::State) -> Nanos {
        algorithm.forget_at(state)
    }
}

/// `refund(now, units)`.
struct Refund(Nanos, u64);
impl Op<()> for Refund {
    fn run<A: Algorithm>(self, algorithm: &A, state: &mut A::State) {
        algorithm.refund(state, self.0, self.1);
    }
}

/// `give_back(now, units, taken)`.
struct GiveBack(Nanos, u64, Taken);
impl Op<()> for GiveBack {
    fn run<A: Algorithm>(self, algorithm: &A, state: &mut A::State) {
        algorithm.give_back(state, self.0, self.1, self.2);
    }
}

/// `release(cost)`.
struct Release(u64);
impl Op<()> for Release {
    fn run<A: Algorithm>(self, algorithm: &A, state: &mut A::State) {
        algorithm.release(state, self.0);
    }
}

impl Limiter {
    /// The config parameter that sets [`Limiter::capacity`], for error messages.
    pub fn capacity_key(&self) -> &'static str {
        match self.shape() {
            Shape::Rate { .. } => "burst",
            Shape::Window { .. } => "limit",
            Shape::Slots => "max_in_flight",
        }
    }

    /// This limiter with its capacity and its rate multiplied by `factor` (a tier); windows keep
    /// their length. Capacities round to the nearest unit and never drop below one; a period
    /// rounds to the nearest nanosecond (see `bucket_period` for its bounds).
    pub fn scaled(&self, factor: f64) -> Limiter {
        if factor == 1.0 {
            return self.clone();
        }
        let capacity = ((self.capacity() as f64 * factor).round() as u64).max(1);
        let shape = match self.shape() {
            // The period itself divided (a float cast saturates: a factor near zero is a period
            // that never ends, not one of a nanosecond).
            Shape::Rate { period } => {
                Shape::Rate { period: Nanos::new((period.as_u64() as f64 / factor).round() as u64) }
            }
            other => other,
        };
        Limiter::with_shape(self.algorithm(), capacity, shape).unwrap_or_else(|| self.clone())
    }

    /// The window a quota policy header should name: the window itself for window algorithms,
    /// the time to refill from empty for buckets, none for in-flight slots.
    pub fn policy_window(&self) -> Option<Nanos> {
        match self.shape() {
            Shape::Rate { period } => Some(period * self.capacity()),
            Shape::Window { window } => Some(window),
            Shape::Slots => None,
        }
    }

    /// The longest stretch of time the state remembers: a full bucket's refill time, or the
    /// window (zero for in-flight slots).
    pub fn span(&self) -> Nanos {
        self.policy_window().unwrap_or(Nanos::ZERO)
    }

    /// Whether admitted units must be given back with [`Limiter::release`] (in-flight slots).
    pub fn holds_slots(&self) -> bool {
        self.shape() == Shape::Slots
    }

    /// Decides a call of `cost` units at `now`, charging `state` only if it is allowed.
    pub fn acquire(&self, state: &mut LimiterState, now: Nanos, cost: u64) -> Decision {
        self.with_state(state, now, Acquire(now, cost))
    }

    /// When `state` becomes indistinguishable from a fresh one.
    pub fn forget_at(&self, state: &mut LimiterState, now: Nanos) -> Nanos {
        self.with_state(state, now, ForgetAt)
    }

    /// Gives `units` back to the budget in `state` at `now`, never beyond its capacity (see
    /// [`Algorithm::refund`]).
    pub fn refund(&self, state: &mut LimiterState, now: Nanos, units: u64) {
        // Past the capacity a refund only fills up; clamped here so both stores see one number.
        let units = units.min(self.capacity());
        self.with_state(state, now, Refund(now, units));
    }

    /// Adjusts the budget in `state` at `now` ([`Adjustment`]). A charge takes what the key can
    /// still admit, capped at `units`: by the meaning of [`Decision::remaining`] every algorithm
    /// admits that much at once, so one rule serves all of them (and their Lua twins). In-flight
    /// slots are work, not a price: a charge leaves them alone, a refund gives slots back.
    pub fn adjust(&self, state: &mut LimiterState, now: Nanos, by: Adjustment) {
        match by {
            Adjustment::Refund(units) => self.refund(state, now, units),
            Adjustment::Return { units, taken } => self.with_state(state, now, GiveBack(now, units, taken)),
            Adjustment::Charge(_) if self.holds_slots() => {}
            Adjustment::Charge(units) => {
                let take = units.min(self.acquire(state, now, 0).remaining);
                if take > 0 {
                    let taken = self.acquire(state, now, take);
                    debug_assert!(taken.allowed, "{}: {take} of what was left refused", self.describe());
                }
            }
        }
    }

    /// Gives back `cost` in-flight slots; a no-op for rate algorithms (and for a state another
    /// algorithm left).
    pub fn release(&self, state: &mut LimiterState, cost: u64) {
        if self.holds_slots() {
            self.with_state(state, Nanos::ZERO, Release(cost));
        }
    }

    /// The limit as an agent reads it: `60 tokens, refilled at 1 per second`,
    /// `2000 tokens per 86400-second window`.
    pub fn in_words(&self) -> String {
        match self.shape() {
            Shape::Rate { .. } => {
                format!("{} tokens, refilled at {} per second", self.capacity(), self.rate_per_sec())
            }
            Shape::Window { window } => {
                format!("{} tokens per {}-second window", self.capacity(), window.as_u64() / 1_000_000_000)
            }
            Shape::Slots => format!("{} at once", self.capacity()),
        }
    }

    /// Units returned per second on average (the sustained rate); zero for in-flight slots.
    pub fn rate_per_sec(&self) -> f64 {
        match self.shape() {
            Shape::Rate { period } => per_sec(period),
            Shape::Window { window } => self.capacity() as f64 / window.as_secs_f64(),
            Shape::Slots => 0.0,
        }
    }
}

/// Whether some algorithm takes a parameter named `name`, and the names they take, for an error
/// message about one that none does.
pub fn is_param(name: &str) -> Result<(), String> {
    if EVERY_PARAM.iter().any(|params| params.contains(&name)) {
        return Ok(());
    }
    let mut every: Vec<&str> = EVERY_PARAM.iter().flat_map(|p| p.iter().copied()).collect();
    every.sort_unstable();
    every.dedup();
    Err(every.join(", "))
}

pub(crate) fn per_sec(period: Nanos) -> f64 {
    crate::clock::NANOS_PER_SEC as f64 / period.as_u64() as f64
}

/// How much of `most` nanoseconds of a bucket's charge `taken` are still owed at `now`: a bucket
/// repays what it was charged in the order it was charged, so the last of a charge comes back
/// last, at `taken.at + taken.reset_after` (what the charge's own decision said), and a give-back
/// of the last `units` of it ([`Algorithm::give_back`]) gives back at most what is left until
/// then. Exactly what the key would hold had the call cost less, as long as nothing else was
/// charged since; less (never more) when more was charged and the bucket came back part of the
/// way meanwhile. Sound only while nothing has been given back to the key since the charge: a
/// give-back moves the debt charged before it earlier, so a bucket remembers when it last gave
/// back ([`GIVEN_BACK_AHEAD`]) and gives nothing to a charge older than that.
pub(crate) fn owed(most: Nanos, taken: Taken, now: Nanos) -> Nanos {
    most.min(taken.at + taken.reset_after - now)
}

/// How far ahead of its instant a bucket stamps a give-back (or an operator's refund): one
/// microsecond, the finest step both stores' clocks share, so a charge at the same instant (on
/// Redis, in the same microsecond) counts as before it — whichever came first — and is never
/// given more back than its own units still owe after the debt moved. (A token bucket and a
/// leaky bucket stamp their `updated_at`, and refill or drain from there: a give-back costs them at
/// most a microsecond of refill.)
pub const GIVEN_BACK_AHEAD: Nanos = Nanos::new(1_000);

/// Nanoseconds per unit for a rate in units per second, rounded to the nearest nanosecond: at
/// least one, and for a rate too slow for 64 bits of nanoseconds (or none at all) the longest
/// there is, never the shortest. Config reads rates with [`Params::bucket`], which refuses those.
pub fn period_of(rate_per_sec: f64) -> Nanos {
    if rate_per_sec.is_nan() || rate_per_sec <= 0.0 {
        return Nanos::MAX;
    }
    // A float cast saturates: an infinite period is the longest.
    Nanos::new(((crate::clock::NANOS_PER_SEC as f64 / rate_per_sec).round() as u64).max(1))
}

/// A bucket's period for `capacity` units: at least a nanosecond, and short enough that the whole
/// bucket (`capacity × period`) is a number of nanoseconds 64 bits hold, so no level or wait of it
/// ever saturates. Config keeps every bucket it reads far within ([`params::LONGEST_SPAN`]);
/// only a share scaled down without limit (a tier, an insurance share) comes near this one.
pub(crate) fn bucket_period(capacity: u64, period: Nanos) -> Nanos {
    period.clamp(Nanos::new(1), Nanos::MAX / capacity.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rate_too_slow_for_64_bits_is_the_longest_period_never_the_shortest() {
        assert_eq!(period_of(1e-300), Nanos::MAX);
        assert_eq!((period_of(0.0), period_of(-1.0), period_of(f64::NAN)), (Nanos::MAX, Nanos::MAX, Nanos::MAX));
        assert_eq!((period_of(1e12), period_of(1.0)), (Nanos::new(1), Nanos::from_secs(1)));
        // A whole bucket stays a number of nanoseconds: nothing saturates to a wrong level.
        let bucket = TokenBucket::new(300, 1e-300);
        assert_eq!(bucket.period(), Nanos::MAX / 300);
        let limiter = Limiter::TokenBucket(bucket);
        let mut state = limiter.fresh(Nanos::ZERO);
        let d = limiter.acquire(&mut state, Nanos::ZERO, 1);
        assert_eq!((d.allowed, d.remaining, d.reset_after), (true, 299, Nanos::MAX / 300));
        // A tier near zero stretches the period to the longest, not down to a nanosecond.
        let scaled = Limiter::TokenBucket(TokenBucket::new(10, 1.0)).scaled(1e-300);
        assert_eq!(scaled.shape(), Shape::Rate { period: Nanos::MAX });
    }
}
