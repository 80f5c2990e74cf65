//! The algorithm test suite, written once and run against both stores:
//! `tests/limits/algorithms.rs` runs it on the Rust algorithms with a local state (the memory
//! store's arithmetic), `tests/limits/algorithms_redis.rs` on the Redis store's Lua scripts. Same
//! properties, same models, same numbers.
//!
//! Every algorithm is checked against a reference model, on an explicit clock, with random
//! arrival times and costs (proptest). The models keep the whole history and recompute from
//! scratch, so they share no state-handling code with the algorithms they check. A [`Backend`]
//! only says where a key's state lives; the properties never look inside it, except to ask
//! whether two keys hold the same state.

use std::collections::HashMap;
use std::fmt::Debug;

use mcp_ratelimit::clock::Nanos;
use mcp_ratelimit::limit::params::{LONGEST_SPAN, MAX_UNITS, Value};
use mcp_ratelimit::limit::{
    ALGORITHMS, Concurrency, Decision, FixedWindow, GIVEN_BACK_AHEAD, Limiter, Params, Shape, SlidingLog,
    SlidingWindow, Taken, TokenBucket,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

const MS: u64 = 1_000_000;

/// Where every run starts: 2026-01-01T00:00:00Z in epoch nanoseconds, a clock reading Redis's
/// scripts can take (they read epoch microseconds).
const START: u64 = 1_767_225_600_000 * MS;

/// Where a limiter's state lives while the suite drives it.
pub(crate) trait Backend {
    /// One key's state in this backend.
    type Key: Key;

    /// The finest step this backend's clock takes: every arrival falls on a multiple of it.
    fn resolution(&self) -> u64;

    /// A key never seen before, decided by `limiter`, first seen at `now`.
    fn start(&self, limiter: &Limiter, now: u64) -> Self::Key;

    /// The longest bucket (burst × period) or window this backend decides (config refuses
    /// longer ones for it).
    fn longest_span(&self) -> u64;
}

/// One key under one limiter.
pub(crate) trait Key: Sized {
    /// What [`Key::state`] reads: equal for two keys that hold the same state.
    type State: PartialEq + Debug;

    /// Decides a call of `cost` units at `now` (a multiple of [`Backend::resolution`]).
    fn acquire(&mut self, now: u64, cost: u64) -> Decision;

    /// An independent copy of this key as it stands: what happens to one never touches the other.
    fn fork(&self) -> Self;

    /// Gives back the in-flight slots of the latest admitted call still held, which took `cost`.
    fn release(&mut self, cost: u64);

    /// Gives back, at `now`, `units` of the charge `taken` (a settled price below its
    /// reservation: `Adjustment::Return`).
    fn give_back(&mut self, now: u64, units: u64, taken: Taken);

    /// From now on this key is decided by `limiter` (the same algorithm with other numbers), on
    /// the state it holds: what a reload, a tier change or an insurance share does to a key.
    fn relimit(&mut self, limiter: &Limiter);

    /// The state this key holds now.
    fn state(&self) -> Self::State;
}

/// One call: time since the previous call, and its cost.
#[derive(Debug, Clone, Copy)]
struct Arrival {
    gap: u64,
    cost: u64,
}

/// Calls whose gaps fall on multiples of `resolution`.
fn arrivals(max_gap: u64, max_cost: u64, resolution: u64) -> impl Strategy<Value = Vec<Arrival>> {
    // Mostly bursts (gap 0), sometimes short or long pauses, and often whole multiples of
    // 250 ms so that calls land exactly on window edges and refill boundaries.
    let gap = prop_oneof![
        3 => Just(0u64),
        3 => 0..max_gap / 4,
        2 => 0..max_gap,
        1 => 0..max_gap * 8,
        3 => (0..12u64).prop_map(|k| k * 250 * MS),
    ];
    let gap = gap.prop_map(move |gap| gap - gap % resolution);
    prop::collection::vec((gap, 0..=max_cost).prop_map(|(gap, cost)| Arrival { gap, cost }), 1..250)
}

/// The calls with every cost within `capacity` (the [`mcp_ratelimit::limit::Algorithm`]
/// precondition).
fn capped(calls: Vec<Arrival>, capacity: u64) -> Vec<Arrival> {
    calls.into_iter().map(|a| Arrival { cost: a.cost.min(capacity), ..a }).collect()
}

/// Window lengths: any, or round ones that quantized gaps land on exactly.
fn window_ms() -> impl Strategy<Value = u64> {
    prop_oneof![1u64..5_000, prop::sample::select(vec![250u64, 500, 750, 1_000, 2_000])]
}

/// Runs a limiter over arrivals on a new key, returning each call's time, cost and decision.
fn run(backend: &impl Backend, limiter: &Limiter, calls: &[Arrival]) -> Vec<(u64, u64, Decision)> {
    let mut now = START;
    let mut key = backend.start(limiter, now);
    calls
        .iter()
        .map(|a| {
            now += a.gap;
            (now, a.cost, key.acquire(now, a.cost))
        })
        .collect()
}

/// Each registered algorithm's reference model in this suite: the property that checks it
/// against a model sharing no code with it. A newly registered algorithm fails
/// [`every_registered_algorithm_has_a_reference_model`] until it has one here (and the exhaustive
/// matches below, such as [`wait_bound`], until it has its place in them).
pub(crate) const REFERENCE_MODELS: &[(&str, &str)] = &[
    ("token_bucket", "token_bucket_matches_the_replay_model"),
    ("gcra", "gcra_and_leaky_bucket_decide_exactly_like_the_token_bucket"),
    ("fixed_window", "fixed_window_matches_a_count_per_window"),
    ("sliding_log", "sliding_log_matches_the_full_history"),
    ("sliding_window", "sliding_window_matches_the_weighted_estimate"),
    ("leaky_bucket", "gcra_and_leaky_bucket_decide_exactly_like_the_token_bucket"),
    ("concurrency", "concurrency_counts_slots_exactly"),
];

/// The reference models of late refunds: each rate algorithm's own promise, counting settled
/// prices, in `late_refunds_go_back_only_where_they_were_taken` (listed for the same reason as
/// [`REFERENCE_MODELS`]: a new algorithm fails until it has its place there).
fn refund_promise(limiter: &Limiter) -> &'static str {
    match limiter {
        Limiter::FixedWindow(_) => "a count per window, less what was given back while it was current",
        Limiter::SlidingWindow(_) => "the weighted counts, less what was given back while each still weighed",
        Limiter::SlidingLog(_) => "the log, less what was given back while each entry was in it",
        Limiter::TokenBucket(_) | Limiter::Gcra(_) | Limiter::LeakyBucket(_) => {
            "never more than a replay of every call at its price settled so far"
        }
        Limiter::Concurrency(_) => "no time: not a price",
    }
}

/// Every algorithm the registry lists is checked against a reference model here.
pub(crate) fn every_registered_algorithm_has_a_reference_model() {
    for algorithm in ALGORITHMS {
        assert!(
            REFERENCE_MODELS.iter().any(|(name, _)| name == algorithm),
            "`{algorithm}` is registered but the algorithm suite has no reference model for it: add one to \
             tests/common/algorithm_suite.rs and list it in REFERENCE_MODELS"
        );
    }
}

/// The registered algorithms, or those that limit a rate (not in-flight slots).
fn registered(rates_only: bool) -> Vec<&'static str> {
    ALGORITHMS.iter().copied().filter(|name| !rates_only || !limiter(name, 1, 1).holds_slots()).collect()
}

/// The registered algorithm `name` with `capacity` units and `span_ms` as its refill period (a
/// bucket refills one unit per `span_ms`) or its window.
fn limiter(name: &str, capacity: u64, span_ms: u64) -> Limiter {
    let shapes = [
        Shape::Rate { period: Nanos::new(span_ms * MS) },
        Shape::Window { window: Nanos::new(span_ms * MS) },
        Shape::Slots,
    ];
    shapes
        .into_iter()
        .find_map(|shape| Limiter::with_shape(name, capacity, shape))
        .unwrap_or_else(|| panic!("`{name}` takes none of the shapes"))
}

/// Runs `test` on `cases` random values of `strategy`, shrinking a failure to a small case.
fn check<S: Strategy>(cases: u32, strategy: S, test: impl Fn(S::Value) -> Result<(), TestCaseError>) {
    // By default shrinking stops after 4 × `cases` runs, too few to shrink 250 calls when
    // `cases` is small (Redis).
    let config = Config { cases, max_shrink_iters: 2_000, failure_persistence: None, ..Config::default() };
    let mut runner = TestRunner::new(config);
    if let Err(e) = runner.run(&strategy, test) {
        panic!("{e}");
    }
}

/// Reference token bucket: replays every admitted call from the start to get the level.
struct BucketModel {
    capacity: u64,
    period: u64,
    admitted: Vec<(u64, u64)>,
}

impl BucketModel {
    fn level(&self, now: u64) -> u64 {
        let full = self.capacity * self.period;
        let mut level = full;
        let mut last = 0;
        for &(at, cost) in &self.admitted {
            level = (level + (at - last)).min(full) - cost * self.period;
            last = at;
        }
        (level + (now - last)).min(full)
    }

    fn call(&mut self, now: u64, cost: u64) -> (bool, u64) {
        let level = self.level(now);
        let need = cost * self.period;
        if need <= level {
            if cost > 0 {
                self.admitted.push((now, cost));
            }
            (true, 0)
        } else {
            (false, need - level)
        }
    }
}

pub(crate) fn token_bucket_matches_the_replay_model(backend: &impl Backend, cases: u32) {
    let strategy = (1u64..30, window_ms(), arrivals(3_000 * MS, 30, backend.resolution()));
    check(cases, strategy, |(capacity, period_ms, calls)| {
        let bucket = TokenBucket::new(capacity, 1_000.0 / period_ms as f64);
        let mut model = BucketModel { capacity, period: bucket.period().as_u64(), admitted: vec![] };
        for (now, cost, d) in run(backend, &Limiter::TokenBucket(bucket), &capped(calls, capacity)) {
            let (allowed, wait) = model.call(now, cost);
            prop_assert_eq!(d.allowed, allowed, "at {} cost {}", now, cost);
            prop_assert_eq!(d.retry_after.as_u64(), wait);
        }
        Ok(())
    });
}

/// GCRA and the leaky bucket (as a meter) are the token bucket in other clothes: the same
/// parameters must give the same decision and the same wait, call for call.
pub(crate) fn gcra_and_leaky_bucket_decide_exactly_like_the_token_bucket(backend: &impl Backend, cases: u32) {
    let strategy = (1u64..30, window_ms(), arrivals(3_000 * MS, 30, backend.resolution()));
    check(cases, strategy, |(capacity, period_ms, calls)| {
        let calls = capped(calls, capacity);
        let [bucket, gcra, leaky] = ["token_bucket", "gcra", "leaky_bucket"]
            .map(|name| run(backend, &limiter(name, capacity, period_ms), &calls));
        for ((b, g), l) in bucket.iter().zip(&gcra).zip(&leaky) {
            prop_assert_eq!((b.2.allowed, b.2.retry_after), (g.2.allowed, g.2.retry_after));
            prop_assert_eq!((b.2.allowed, b.2.retry_after), (l.2.allowed, l.2.retry_after));
            prop_assert_eq!(b.2.remaining, g.2.remaining);
            prop_assert_eq!(b.2.remaining, l.2.remaining);
        }
        Ok(())
    });
}

pub(crate) fn fixed_window_matches_a_count_per_window(backend: &impl Backend, cases: u32) {
    let strategy = (1u64..30, window_ms(), arrivals(5_000 * MS, 30, backend.resolution()));
    check(cases, strategy, |(limit, window_ms, calls)| {
        let window = window_ms * MS;
        let mut counts: HashMap<u64, u64> = HashMap::new();
        let limiter = Limiter::FixedWindow(FixedWindow::new(limit, Nanos::new(window)));
        for (now, cost, d) in run(backend, &limiter, &capped(calls, limit)) {
            let count = counts.entry(now / window).or_default();
            let allowed = *count + cost <= limit;
            if allowed {
                *count += cost;
            }
            prop_assert_eq!(d.allowed, allowed);
            if !allowed {
                prop_assert_eq!(d.retry_after.as_u64(), (now / window + 1) * window - now);
            }
        }
        Ok(())
    });
}

pub(crate) fn sliding_log_matches_the_full_history(backend: &impl Backend, cases: u32) {
    let strategy = (1u64..30, window_ms(), arrivals(5_000 * MS, 30, backend.resolution()));
    check(cases, strategy, |(limit, window_ms, calls)| {
        let window = window_ms * MS;
        let mut admitted: Vec<(u64, u64)> = vec![];
        let in_window =
            |log: &[(u64, u64)], t: u64| -> u64 { log.iter().filter(|(at, _)| at + window > t).map(|(_, c)| c).sum() };
        let limiter = Limiter::SlidingLog(SlidingLog::new(limit, Nanos::new(window)));
        for (now, cost, d) in run(backend, &limiter, &capped(calls, limit)) {
            let allowed = in_window(&admitted, now) + cost <= limit;
            prop_assert_eq!(d.allowed, allowed, "at {} cost {}", now, cost);
            if allowed {
                if cost > 0 {
                    admitted.push((now, cost));
                }
            } else {
                // The exact wait: the first instant an entry ages out and the call fits.
                let wait = admitted
                    .iter()
                    .map(|(at, _)| at + window)
                    .filter(|&t| t > now && in_window(&admitted, t) + cost <= limit)
                    .min()
                    .map(|t| t - now);
                prop_assert_eq!(Some(d.retry_after.as_u64()), wait);
            }
        }
        Ok(())
    });
}

pub(crate) fn sliding_window_matches_the_weighted_estimate(backend: &impl Backend, cases: u32) {
    let strategy = (1u64..30, window_ms(), arrivals(5_000 * MS, 30, backend.resolution()));
    check(cases, strategy, |(limit, window_ms, calls)| {
        let window = window_ms * MS;
        let mut counts: HashMap<u64, u64> = HashMap::new();
        let limiter = Limiter::SlidingWindow(SlidingWindow::new(limit, Nanos::new(window)));
        for (now, cost, d) in run(backend, &limiter, &capped(calls, limit)) {
            let k = now / window;
            let elapsed = now - k * window;
            let previous = if k == 0 { 0 } else { counts.get(&(k - 1)).copied().unwrap_or(0) };
            let current = counts.get(&k).copied().unwrap_or(0);
            let scaled =
                u128::from(previous) * u128::from(window - elapsed) + u128::from(current + cost) * u128::from(window);
            let allowed = scaled <= u128::from(limit) * u128::from(window);
            prop_assert_eq!(d.allowed, allowed, "at {} cost {}", now, cost);
            if allowed {
                *counts.entry(k).or_default() += cost;
            }
        }
        Ok(())
    });
}

/// A refusal charges nothing: it leaves the key's state exactly as a call of cost zero (a read)
/// at the same instant would, and dropping every refused call from the input changes no
/// decision of the calls that were admitted, field for field.
pub(crate) fn refusals_never_charge(backend: &impl Backend, cases: u32) {
    let strategy = (
        prop::sample::select(registered(false)),
        1u64..20,
        window_ms(),
        arrivals(3_000 * MS, 20, backend.resolution()),
    );
    check(cases, strategy, |(algorithm, capacity, span_ms, calls)| {
        let limiter = limiter(algorithm, capacity, span_ms);
        let mut key = backend.start(&limiter, START);
        let mut now = START;
        let mut admitted = vec![];
        for a in capped(calls, capacity) {
            now += a.gap;
            let before = key.fork();
            let d = key.acquire(now, a.cost);
            if d.allowed {
                admitted.push((now, a.cost, d));
            } else {
                let mut read = before;
                read.acquire(now, 0);
                prop_assert_eq!(key.state(), read.state(), "refused at {} cost {}: {:?}", now, a.cost, d);
            }
        }
        let mut replay = backend.start(&limiter, START);
        for (now, cost, d) in admitted {
            prop_assert_eq!(replay.acquire(now, cost), d, "admitted at {} cost {}, without the refusals", now, cost);
        }
        Ok(())
    });
}

/// A refusal's wait is exact for the algorithms that can know it: at the first instant the
/// backend's clock can express at or after the wait the same call passes, at the instant
/// before (one nanosecond in memory, one microsecond on Redis) it is still refused.
pub(crate) fn retry_after_is_exact(backend: &impl Backend, cases: u32) {
    let resolution = backend.resolution();
    let strategy =
        (prop::sample::select(registered(true)), 1u64..20, window_ms(), arrivals(3_000 * MS, 20, resolution));
    check(cases, strategy, |(algorithm, capacity, span_ms, calls)| {
        let limiter = limiter(algorithm, capacity, span_ms);
        // The sliding window (an estimate) is held only to a wait that is enough, as it always was.
        let exact = !matches!(limiter, Limiter::SlidingWindow(_));
        let mut key = backend.start(&limiter, START);
        let mut now = START;
        for a in capped(calls, capacity) {
            now += a.gap;
            let d = key.acquire(now, a.cost);
            if !d.allowed {
                let at = (now + d.retry_after.as_u64()).div_ceil(resolution) * resolution;
                prop_assert!(
                    key.fork().acquire(at, a.cost).allowed,
                    "not admitted {} ns after its retry_after {}",
                    at - now - d.retry_after.as_u64(),
                    d.retry_after.as_u64()
                );
                if exact {
                    prop_assert!(
                        !key.fork().acquire(at - resolution, a.cost).allowed,
                        "admitted before its retry_after {}",
                        d.retry_after.as_u64()
                    );
                }
            }
        }
        Ok(())
    });
}

pub(crate) fn concurrency_counts_slots_exactly(backend: &impl Backend, cases: u32) {
    let strategy = (1u64..10, prop::collection::vec((any::<bool>(), 0u64..5), 1..200));
    check(cases, strategy, |(max, ops)| {
        let mut key = backend.start(&Limiter::Concurrency(Concurrency::new(max)), START);
        let mut held: Vec<u64> = vec![];
        for (acquire, cost) in ops {
            let cost = cost.min(max);
            if acquire || held.is_empty() {
                let in_flight: u64 = held.iter().sum();
                let d = key.acquire(START, cost);
                prop_assert_eq!(d.allowed, in_flight + cost <= max);
                if d.allowed {
                    held.push(cost);
                }
                prop_assert_eq!(d.remaining, max - held.iter().sum::<u64>());
            } else if let Some(c) = held.pop() {
                key.release(c);
            }
        }
        Ok(())
    });
}

/// Documented bound of the sliding window counter: any span of one window holds at most twice
/// the limit, whatever the arrival pattern.
pub(crate) fn sliding_window_never_exceeds_twice_the_limit_in_any_window(backend: &impl Backend, cases: u32) {
    let strategy = (1u64..20, window_ms(), arrivals(2_000 * MS, 5, backend.resolution()));
    check(cases, strategy, |(limit, window_ms, calls)| {
        let window = window_ms * MS;
        let limiter = Limiter::SlidingWindow(SlidingWindow::new(limit, Nanos::new(window)));
        let admitted: Vec<(u64, u64)> = run(backend, &limiter, &capped(calls, limit))
            .into_iter()
            .filter(|(_, _, d)| d.allowed)
            .map(|(t, c, _)| (t, c))
            .collect();
        for &(start, _) in &admitted {
            let in_span: u64 =
                admitted.iter().filter(|(t, _)| *t >= start && *t < start + window).map(|(_, c)| c).sum();
            prop_assert!(in_span <= 2 * limit, "{} in one window, limit {}", in_span, limit);
        }
        Ok(())
    });
}

/// The window-edge attack: `limit` calls at the last instant the backend can express before a
/// window boundary, `limit` at the boundary; returns how many were admitted.
fn edge_burst(backend: &impl Backend, limiter: &Limiter, window: u64) -> u64 {
    let edge = (START / window + 10) * window;
    let mut key = backend.start(limiter, START);
    let mut admitted = 0;
    for now in [edge - backend.resolution(), edge] {
        for _ in 0..limiter.capacity() {
            if key.acquire(now, 1).allowed {
                admitted += 1;
            }
        }
    }
    admitted
}

const MINUTE: u64 = 60_000 * MS;

pub(crate) fn fixed_window_lets_twice_the_limit_through_across_an_edge(backend: &impl Backend) {
    assert_eq!(edge_burst(backend, &Limiter::FixedWindow(FixedWindow::new(100, Nanos::new(MINUTE))), MINUTE), 200);
}

pub(crate) fn sliding_log_never_lets_more_than_the_limit_through_an_edge(backend: &impl Backend) {
    assert_eq!(edge_burst(backend, &Limiter::SlidingLog(SlidingLog::new(100, Nanos::new(MINUTE))), MINUTE), 100);
}

pub(crate) fn sliding_window_stays_within_its_documented_error_at_an_edge(backend: &impl Backend) {
    let admitted = edge_burst(backend, &Limiter::SlidingWindow(SlidingWindow::new(100, Nanos::new(MINUTE))), MINUTE);
    assert!(admitted <= 101, "the previous window still weighs fully at the edge: {admitted}");
}

/// One step in the life of a key whose limit changes under it.
#[derive(Debug, Clone, Copy)]
enum Life {
    /// A call `gap` after the previous step; its cost is `cost` modulo the current capacity + 1,
    /// so always within the limit in force (the [`mcp_ratelimit::limit::Algorithm`]
    /// precondition, which config validation keeps for every scaled limit).
    Call { gap: u64, cost: u64 },
    /// The latest admitted call still holding in-flight slots ends (a no-op for rate algorithms).
    Release,
    /// The limit changes, the algorithm stays: new numbers (capacity lowered or raised, a new
    /// period or window), as a reload sets them.
    Renumber { capacity: u64, span_ms: u64 },
    /// The limit is multiplied by a tier's factor, or divided by an instance count (the
    /// insurance share): [`Limiter::scaled`], as the guard builds them.
    Scale(f64),
}

fn lives(resolution: u64) -> impl Strategy<Value = Vec<Life>> {
    let gap = prop_oneof![
        4 => Just(0u64),
        2 => 0..1_000 * MS,
        1 => 0..20_000 * MS,
        2 => (0..12u64).prop_map(|k| k * 250 * MS),
    ]
    .prop_map(move |gap| gap - gap % resolution);
    let step = prop_oneof![
        10 => (gap, any::<u64>()).prop_map(|(gap, cost)| Life::Call { gap, cost }),
        2 => Just(Life::Release),
        2 => (1u64..40, window_ms()).prop_map(|(capacity, span_ms)| Life::Renumber { capacity, span_ms }),
        2 => prop::sample::select(vec![0.5, 4.0, 1.0 / 3.0, 0.25, 2.0]).prop_map(Life::Scale),
    ];
    prop::collection::vec(step, 1..80)
}

/// The most a wait (`retry_after`, `reset_after`) may be after the limit changed, as each
/// algorithm's module doc states it: the current limit's span for the algorithms whose state
/// saturates at the current limit, twice the window for the sliding window (the next window's
/// end at most), and for the two that keep a debt (GCRA's schedule, the leaky bucket's water)
/// the largest span (burst × period) of any limit the key has had, since a debt taken on under a
/// larger limit is still owed.
fn wait_bound(limiter: &Limiter, largest_span: u64) -> u64 {
    match limiter {
        Limiter::Gcra(_) | Limiter::LeakyBucket(_) => largest_span.max(limiter.span().as_u64()),
        Limiter::SlidingWindow(a) => 2 * a.window().as_u64(),
        Limiter::TokenBucket(_) | Limiter::FixedWindow(_) | Limiter::SlidingLog(_) | Limiter::Concurrency(_) => {
            limiter.span().as_u64()
        }
    }
}

/// Limits lowered, raised, scaled by a tier or divided among instances under a live key, at
/// random between random calls: every decision still speaks of the limit in force (`limit` is
/// its capacity, `remaining` never above it and exactly what a call could take right now: a call
/// of `remaining` passes, one unit more is refused), a refusal's wait is exact for the current
/// limit (the same call passes at `retry_after` and not one clock step sooner; the sliding
/// window's estimate only needs to be enough) and within the algorithm's documented bound, and
/// held in-flight slots count against a lowered cap until they are given back.
pub(crate) fn changed_limits_keep_every_number_believable(backend: &impl Backend, cases: u32) {
    let resolution = backend.resolution();
    let strategy = (prop::sample::select(registered(false)), 1u64..40, window_ms(), lives(resolution));
    check(cases, strategy, |(algorithm, capacity, span_ms, steps)| {
        let mut limiter = limiter(algorithm, capacity, span_ms);
        let mut largest_span = limiter.span().as_u64();
        let mut key = backend.start(&limiter, START);
        let mut now = START;
        let mut held: Vec<u64> = vec![];
        for (n, step) in steps.into_iter().enumerate() {
            let cost = match step {
                Life::Call { gap, cost } => {
                    now += gap;
                    cost % (limiter.capacity() + 1)
                }
                Life::Release => {
                    if let Some(slots) = held.pop() {
                        key.release(slots);
                    }
                    continue;
                }
                Life::Renumber { capacity, span_ms } => {
                    limiter = self::limiter(algorithm, capacity, span_ms);
                    largest_span = largest_span.max(limiter.span().as_u64());
                    key.relimit(&limiter);
                    continue;
                }
                Life::Scale(factor) => {
                    limiter = limiter.scaled(factor);
                    largest_span = largest_span.max(limiter.span().as_u64());
                    key.relimit(&limiter);
                    continue;
                }
            };
            let d = key.acquire(now, cost);
            let capacity = limiter.capacity();
            let at = format!("step {n}, at {now} cost {cost} under {}: {d:?}", limiter.describe());
            prop_assert_eq!(d.limit, capacity, "{}", at);
            prop_assert!(d.remaining <= d.limit, "{}", at);
            prop_assert!(!d.allowed || d.retry_after == Nanos::ZERO, "{}", at);
            let bound = wait_bound(&limiter, largest_span);
            prop_assert!(
                d.retry_after.as_u64() <= bound && d.reset_after.as_u64() <= bound,
                "{} (bound {} ns)",
                at,
                bound
            );
            if limiter.holds_slots() {
                let in_flight: u64 = held.iter().sum();
                prop_assert_eq!(d.allowed, in_flight + cost <= capacity, "{}", at);
                if d.allowed {
                    held.push(cost);
                }
                prop_assert_eq!(d.remaining, capacity.saturating_sub(held.iter().sum()), "{}", at);
            }
            if d.remaining > 0 {
                prop_assert!(key.fork().acquire(now, d.remaining).allowed, "a call of `remaining` is refused: {}", at);
            }
            if d.remaining < capacity {
                prop_assert!(!key.fork().acquire(now, d.remaining + 1).allowed, "one past `remaining` passes: {}", at);
            }
            if !d.allowed && !limiter.holds_slots() {
                let then = (now + d.retry_after.as_u64()).div_ceil(resolution) * resolution;
                prop_assert!(key.fork().acquire(then, cost).allowed, "not admitted at its retry_after: {}", at);
                if !matches!(limiter, Limiter::SlidingWindow(_)) {
                    prop_assert!(
                        !key.fork().acquire(then - resolution, cost).allowed,
                        "admitted before its retry_after: {}",
                        at
                    );
                }
            }
        }
        Ok(())
    });
}

/// A rate as a config writes it: a number of units per second, or one within a hair of the
/// slowest a burst may have (its bucket back whole in [`LONGEST_SPAN`]), as a factor of it.
#[derive(Debug, Clone, Copy)]
enum Rate {
    PerSec(f64),
    NearTheSlowest(f64),
}

/// Rates as a config writes them, from the tiniest a double holds to past a billion a second, for
/// bursts from one unit to the most, on every bucket algorithm: a rate too fast, or too slow for
/// its bucket to come back whole within [`LONGEST_SPAN`], is refused naming its key; every other
/// one is kept as the period nearest to a second ÷ rate, and decided exactly: each call's
/// `allowed`, `remaining`, `retry_after` and `reset_after` are what a model of the bucket's level
/// in 128-bit nanoseconds says, with arrivals a fraction or a few periods apart (up to a year).
pub(crate) fn every_rate_is_decided_exactly_or_refused_naming_its_key(backend: &impl Backend, cases: u32) {
    let resolution = backend.resolution();
    let burst = prop_oneof![1u64..=64, MAX_UNITS - 64..=MAX_UNITS, 1..=MAX_UNITS];
    let rate = prop_oneof![
        1 => (-324i32..=10, 1.0f64..10.0).prop_map(|(e, m)| Rate::PerSec(m * 10f64.powi(e))),
        2 => (-8i32..=9, 1.0f64..10.0).prop_map(|(e, m)| Rate::PerSec(m * 10f64.powi(e))),
        1 => (f64::MIN_POSITIVE..2e9).prop_map(Rate::PerSec),
        2 => (0.999_999f64..1.000_001).prop_map(Rate::NearTheSlowest),
    ];
    // A gap of `quarters`/4 periods plus some nanoseconds; a cost of nothing, a little, or the
    // burst, or anything up to it.
    let calls = prop::collection::vec((0u64..12, 0u64..1_000_000, 0u64..4, any::<u64>()), 1..40);
    let algorithm = prop::sample::select(vec![
        ("token_bucket", "refill_per_sec"),
        ("gcra", "refill_per_sec"),
        ("leaky_bucket", "leak_per_sec"),
    ]);
    check(cases, (algorithm, burst, rate, calls), |((algorithm, param), burst, rate, calls)| {
        let per_sec = match rate {
            Rate::PerSec(r) => r,
            Rate::NearTheSlowest(f) => burst as f64 * 1e9 / LONGEST_SPAN.as_u64() as f64 * f,
        };
        let values = std::collections::BTreeMap::from([
            ("burst".to_owned(), Value::Int(burst as i64)),
            (param.to_owned(), Value::Float(per_sec)),
        ]);
        let built = Limiter::from_params(algorithm, &Params::new("limits.caller", algorithm, &values));
        let built = built.expect("a bucket algorithm");
        // The model: the nearest nanosecond to a second ÷ rate, and the whole bucket in 128 bits.
        let period = (1e9 / per_sec).round();
        let span = (period <= u64::MAX as f64).then(|| u128::from(burst) * period as u128);
        let keepable = per_sec <= 1e9 && span.is_some_and(|span| span <= u128::from(LONGEST_SPAN.as_u64()));
        let limiter = match (keepable, built) {
            (true, Ok(limiter)) => limiter,
            (false, Err(e)) => {
                prop_assert_eq!(e.key, format!("limits.caller.{param}"));
                return Ok(());
            }
            (true, Err(e)) => return Err(TestCaseError::fail(format!("{per_sec}/s, burst {burst} refused: {e:?}"))),
            (false, Ok(l)) => {
                return Err(TestCaseError::fail(format!("{per_sec}/s, burst {burst} kept: {}", l.describe())));
            }
        };
        let period = period as u64;
        prop_assert_eq!(limiter.shape(), Shape::Rate { period: Nanos::new(period) });
        prop_assert_eq!((limiter.capacity(), limiter.span().as_u64()), (burst, burst * period));
        if limiter.span().as_u64() > backend.longest_span() {
            return Ok(());
        }
        let mut model = ExactBucket::full(burst, period);
        let mut now = START;
        let mut key = backend.start(&limiter, now);
        for (n, (quarters, nanos, size, pick)) in calls.into_iter().enumerate() {
            let gap = u64::try_from(u128::from(period) * u128::from(quarters) / 4).expect("within a year") + nanos;
            now += gap - gap % resolution;
            let cost = match size {
                0 => 0,
                1 => (pick % 4).min(burst),
                2 => burst,
                _ => pick % (burst + 1),
            };
            let expected = model.call(gap - gap % resolution, cost, now);
            let d = key.acquire(now, cost);
            prop_assert_eq!(
                d,
                expected,
                "call {} at +{} ns, cost {}, under {}",
                n,
                now - START,
                cost,
                limiter.describe()
            );
        }
        Ok(())
    });
}

/// Reference bucket for any rate: `burst` units of `period` ns each, its level kept in 128-bit
/// nanoseconds.
struct ExactBucket {
    burst: u64,
    period: u128,
    full: u128,
    level: u128,
}

impl ExactBucket {
    /// A bucket of `burst` units of `period` ns, full.
    fn full(burst: u64, period: u64) -> Self {
        let full = u128::from(burst) * u128::from(period);
        Self { burst, period: u128::from(period), full, level: full }
    }

    /// The decision the bucket expects at `now` for a call of `cost`, `refill` ns after the
    /// previous one: refill since the previous call, never past full; then the call, if it fits.
    fn call(&mut self, refill: u64, cost: u64, now: u64) -> Decision {
        self.level = (self.level + u128::from(refill)).min(self.full);
        let need = u128::from(cost) * self.period;
        let allowed = need <= self.level;
        if allowed {
            self.level -= need;
        }
        let ns = |v: u128| u64::try_from(v).expect("below a year");
        Decision {
            allowed,
            limit: self.burst,
            remaining: ns(self.level / self.period),
            retry_after: Nanos::new(if allowed { 0 } else { ns(need - self.level) }),
            reset_after: Nanos::new(ns(self.full - self.level)),
            at: Nanos::new(now),
        }
    }
}

/// One step of a key whose calls are settled late.
#[derive(Debug, Clone, Copy)]
enum Late {
    /// A call `gap` after the previous step, of `cost` (within the capacity).
    Call { gap: u64, cost: u64 },
    /// `gap` later, the `of`th admitted call not yet settled (modulo their number) is settled
    /// `units` below its cost (at least one unit, at most its cost).
    Settle { gap: u64, of: usize, units: u64 },
}

fn late_lives(resolution: u64) -> impl Strategy<Value = Vec<Late>> {
    let gap = prop_oneof![
        3 => Just(0u64),
        2 => 0..1_000 * MS,
        1 => 0..8_000 * MS,
        3 => (0..12u64).prop_map(|k| k * 250 * MS),
    ]
    .prop_map(move |gap| gap - gap % resolution);
    let step = prop_oneof![
        3 => (gap.clone(), any::<u64>()).prop_map(|(gap, cost)| Late::Call { gap, cost }),
        2 => (gap, any::<usize>(), any::<u64>()).prop_map(|(gap, of, units)| Late::Settle { gap, of, units }),
    ];
    prop::collection::vec(step, 1..60)
}

/// An admitted call, as the models see it.
#[derive(Debug, Clone)]
struct Charged {
    at: u64,
    cost: u64,
    taken: Taken,
    /// Settled: when, and how many units were given back.
    settled: Option<(u64, u64)>,
}

impl Charged {
    /// What the call costs as of `now`: its price once settled at or before `now`.
    fn price_at(&self, now: u64) -> u64 {
        match self.settled {
            Some((when, units)) if when <= now => self.cost - units,
            _ => self.cost,
        }
    }

    /// Units given back at or before `now`, if they were given while `counts(when)` held.
    fn back_if(&self, now: u64, counts: impl Fn(u64) -> bool) -> u64 {
        match self.settled {
            Some((when, units)) if when <= now && counts(when) => units,
            _ => 0,
        }
    }
}

/// Checks the decision `d` on a call of `cost` at `now`, described by `at`, against the refund
/// promise of `limiter` (a rate algorithm of `capacity`), given the admitted `calls` before it:
/// exactly what the fixed window's, sliding window's and sliding log's models decide, and for a
/// bucket nothing past a replay of every admitted call at its price settled so far.
fn admitted_as_promised(
    limiter: &Limiter,
    calls: &[Charged],
    capacity: u64,
    now: u64,
    cost: u64,
    d: &Decision,
    at: &str,
) -> Result<(), TestCaseError> {
    let window = limiter.policy_window().map_or(1, Nanos::as_u64);
    match limiter {
        Limiter::FixedWindow(_) => {
            let k = now / window;
            let count: u64 = calls
                .iter()
                .filter(|c| c.at / window == k)
                .map(|c| c.cost - c.back_if(now, |when| when / window == k))
                .sum();
            prop_assert_eq!(d.allowed, count + cost <= capacity, "{}", at);
        }
        Limiter::SlidingWindow(_) => {
            let k = now / window;
            let count = |of: u64| -> u64 {
                calls
                    .iter()
                    .filter(|c| c.at / window == of)
                    .map(|c| c.cost - c.back_if(now, |when| when / window <= of + 1))
                    .sum()
            };
            let (previous, current) = (if k == 0 { 0 } else { count(k - 1) }, count(k));
            let elapsed = now - k * window;
            let load =
                u128::from(previous) * u128::from(window - elapsed) + u128::from(current + cost) * u128::from(window);
            prop_assert_eq!(d.allowed, load <= u128::from(capacity) * u128::from(window), "{}", at);
        }
        Limiter::SlidingLog(_) => {
            let logged: u64 = calls
                .iter()
                .filter(|c| c.at + window > now)
                .map(|c| c.cost - c.back_if(now, |when| c.at + window > when))
                .sum();
            prop_assert_eq!(d.allowed, logged + cost <= capacity, "{}", at);
        }
        Limiter::TokenBucket(_) | Limiter::Gcra(_) | Limiter::LeakyBucket(_) => {
            // A replay of every admitted call at its price settled so far.
            let Shape::Rate { period } = limiter.shape() else { unreachable!("a bucket") };
            let period = period.as_u64();
            let full = i128::from(capacity) * i128::from(period);
            let (mut level, mut last) = (full, START);
            for c in calls {
                level = (level + i128::from(c.at - last)).min(full) - i128::from(c.price_at(now)) * i128::from(period);
                last = c.at;
                prop_assert!(level >= 0, "the replay refuses a call the key admitted: {}", at);
            }
            let level = (level + i128::from(now - last)).min(full);
            if d.allowed {
                let after = level - i128::from(cost) * i128::from(period);
                prop_assert!(after >= 0, "admitted past the replay: {}", at);
                prop_assert!(
                    i128::from(d.remaining) <= after / i128::from(period),
                    "more left than the replay: {}",
                    at
                );
            }
        }
        Limiter::Concurrency(_) => unreachable!("rates only"),
    }
    Ok(())
}

/// Calls settled late — a price settled below its reservation after other calls, a window
/// boundary or a whole window later — on every rate algorithm: no call is admitted that the
/// algorithm's own promise, counting every price at what it was settled to so far, would refuse
/// ([`refund_promise`]): a fixed window's count is its calls less what was given back while it
/// was the current window (never a later window's), a sliding window's counts likewise while each
/// still weighed, the sliding log's entries while each was in the log — each decided exactly as
/// that model says — and a bucket never holds more than a replay of every admitted call at its
/// price settled so far would. And a refund given back before anything else happened to the key
/// restores exactly: the key then decides as one whose call had cost the settled price from the
/// start (for a bucket, unless something was given back in the microsecond before the charge,
/// which it counts as after: [`GIVEN_BACK_AHEAD`]).
pub(crate) fn late_refunds_go_back_only_where_they_were_taken<B: Backend>(backend: &B, cases: u32) {
    let resolution = backend.resolution();
    let strategy = (prop::sample::select(registered(true)), 1u64..20, window_ms(), late_lives(resolution));
    check(cases, strategy, |(algorithm, capacity, span_ms, steps)| {
        let limiter = limiter(algorithm, capacity, span_ms);
        let promise = refund_promise(&limiter);
        let mut key = backend.start(&limiter, START);
        let mut now = START;
        let mut calls: Vec<Charged> = vec![];
        // The key just before the latest admitted charge, while nothing has happened since it.
        let mut quiet: Option<(usize, B::Key)> = None;
        let bucket = matches!(limiter.shape(), Shape::Rate { .. });
        let mut given_back_at: Option<u64> = None;
        for (n, step) in steps.into_iter().enumerate() {
            match step {
                Late::Settle { gap, of, units } => {
                    now += gap;
                    let open: Vec<usize> = (0..calls.len()).filter(|&i| calls[i].settled.is_none()).collect();
                    let Some(&i) = open.get(of % open.len().max(1)) else { continue };
                    let units = 1 + units % calls[i].cost;
                    key.give_back(now, units, calls[i].taken);
                    calls[i].settled = Some((now, units));
                    given_back_at = Some(now);
                    let at = format!(
                        "step {n}: call {i} settled {units} below {} at +{} ns under {}",
                        calls[i].cost,
                        now - START,
                        limiter.describe()
                    );
                    if let Some((last, mut before)) = quiet.take().filter(|(last, _)| *last == i) {
                        let cheaper = before.acquire(calls[last].at, calls[last].cost - units);
                        prop_assert!(cheaper.allowed, "{}", at);
                        prop_assert_eq!(
                            key.fork().acquire(now, 0),
                            before.acquire(now, 0),
                            "not restored exactly: {}",
                            at
                        );
                    }
                }
                Late::Call { gap, cost } => {
                    now += gap;
                    let cost = cost % (capacity + 1);
                    let before = key.fork();
                    let d = key.acquire(now, cost);
                    let at = format!(
                        "step {n}: at +{} ns cost {cost} under {} ({promise}): {d:?}",
                        now - START,
                        limiter.describe()
                    );
                    admitted_as_promised(&limiter, &calls, capacity, now, cost, &d, &at)?;
                    if d.allowed && cost > 0 {
                        calls.push(Charged { at: now, cost, taken: d.taken(), settled: None });
                        let stamped = bucket && given_back_at.is_some_and(|at| now < at + GIVEN_BACK_AHEAD.as_u64());
                        quiet = (!stamped).then(|| (calls.len() - 1, before));
                    }
                }
            }
        }
        Ok(())
    });
}
