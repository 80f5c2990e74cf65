//! Every algorithm against a simple reference model, on a fake clock, with random arrival
//! times and costs (proptest). The models keep the whole history and recompute from scratch,
//! so they share no state-handling code with the algorithms they check.

use std::collections::HashMap;

use mcp_ratelimit::limit::{
    Algorithm, Concurrency, Decision, FixedWindow, Gcra, LeakyBucket, SlidingLog, SlidingWindow, TokenBucket,
};
use proptest::prelude::*;

const MS: u64 = 1_000_000;

/// One call: time since the previous call, and its cost.
#[derive(Debug, Clone, Copy)]
struct Arrival {
    gap: u64,
    cost: u64,
}

fn arrivals(max_gap: u64, max_cost: u64) -> impl Strategy<Value = Vec<Arrival>> {
    // Mostly bursts (gap 0), sometimes short or long pauses, and often whole multiples of
    // 250 ms so that calls land exactly on window edges and refill boundaries.
    let gap = prop_oneof![
        3 => Just(0u64),
        3 => 0..max_gap / 4,
        2 => 0..max_gap,
        1 => 0..max_gap * 8,
        3 => (0..12u64).prop_map(|k| k * 250 * MS),
    ];
    prop::collection::vec((gap, 0..=max_cost).prop_map(|(gap, cost)| Arrival { gap, cost }), 1..250)
}

/// Window lengths: any, or round ones that quantized gaps land on exactly.
fn window_ms() -> impl Strategy<Value = u64> {
    prop_oneof![1u64..5_000, prop::sample::select(vec![250u64, 500, 750, 1_000, 2_000])]
}

/// Runs an algorithm over arrivals, returning each decision and its time.
fn run<A: Algorithm>(alg: &A, calls: &[Arrival]) -> Vec<(u64, u64, Decision)> {
    let mut now = 1_000 * MS;
    let mut state = alg.fresh(now);
    calls
        .iter()
        .map(|a| {
            now += a.gap;
            (now, a.cost, alg.acquire(&mut state, now, a.cost))
        })
        .collect()
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

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn token_bucket_matches_the_replay_model(
        capacity in 1u64..30, period_ms in window_ms(), calls in arrivals(3_000 * MS, 30)
    ) {
        let alg = TokenBucket::new(capacity, 1_000.0 / period_ms as f64);
        let mut model = BucketModel { capacity, period: alg.period(), admitted: vec![] };
        let calls: Vec<Arrival> = calls.into_iter().map(|a| Arrival { cost: a.cost.min(capacity), ..a }).collect();
        for (now, cost, d) in run(&alg, &calls) {
            let (allowed, wait) = model.call(now, cost);
            prop_assert_eq!(d.allowed, allowed, "at {} cost {}", now, cost);
            prop_assert_eq!(d.retry_after, wait);
        }
    }

    /// GCRA and the leaky bucket (as a meter) are the token bucket in other clothes: the same
    /// parameters must give the same decision and the same wait, call for call.
    #[test]
    fn gcra_and_leaky_bucket_decide_exactly_like_the_token_bucket(
        capacity in 1u64..30, period_ms in window_ms(), calls in arrivals(3_000 * MS, 30)
    ) {
        let rate = 1_000.0 / period_ms as f64;
        let calls: Vec<Arrival> = calls.into_iter().map(|a| Arrival { cost: a.cost.min(capacity), ..a }).collect();
        let bucket = run(&TokenBucket::new(capacity, rate), &calls);
        let gcra = run(&Gcra::new(capacity, rate), &calls);
        let leaky = run(&LeakyBucket::new(capacity, rate), &calls);
        for ((b, g), l) in bucket.iter().zip(&gcra).zip(&leaky) {
            prop_assert_eq!((b.2.allowed, b.2.retry_after), (g.2.allowed, g.2.retry_after));
            prop_assert_eq!((b.2.allowed, b.2.retry_after), (l.2.allowed, l.2.retry_after));
            prop_assert_eq!(b.2.remaining, g.2.remaining);
            prop_assert_eq!(b.2.remaining, l.2.remaining);
        }
    }

    #[test]
    fn fixed_window_matches_a_count_per_window(
        limit in 1u64..30, window_ms in window_ms(), calls in arrivals(5_000 * MS, 30)
    ) {
        let window = window_ms * MS;
        let alg = FixedWindow::new(limit, window);
        let mut counts: HashMap<u64, u64> = HashMap::new();
        let calls: Vec<Arrival> = calls.into_iter().map(|a| Arrival { cost: a.cost.min(limit), ..a }).collect();
        for (now, cost, d) in run(&alg, &calls) {
            let count = counts.entry(now / window).or_default();
            let allowed = *count + cost <= limit;
            if allowed { *count += cost; }
            prop_assert_eq!(d.allowed, allowed);
            if !allowed {
                prop_assert_eq!(d.retry_after, (now / window + 1) * window - now);
            }
        }
    }

    #[test]
    fn sliding_log_matches_the_full_history(
        limit in 1u64..30, window_ms in window_ms(), calls in arrivals(5_000 * MS, 30)
    ) {
        let window = window_ms * MS;
        let alg = SlidingLog::new(limit, window);
        let mut admitted: Vec<(u64, u64)> = vec![];
        let in_window = |log: &[(u64, u64)], t: u64| -> u64 {
            log.iter().filter(|(at, _)| at + window > t).map(|(_, c)| c).sum()
        };
        let calls: Vec<Arrival> = calls.into_iter().map(|a| Arrival { cost: a.cost.min(limit), ..a }).collect();
        for (now, cost, d) in run(&alg, &calls) {
            let allowed = in_window(&admitted, now) + cost <= limit;
            prop_assert_eq!(d.allowed, allowed, "at {} cost {}", now, cost);
            if allowed {
                if cost > 0 { admitted.push((now, cost)); }
            } else {
                // The exact wait: the first instant an entry ages out and the call fits.
                let wait = admitted
                    .iter()
                    .map(|(at, _)| at + window)
                    .filter(|&t| t > now && in_window(&admitted, t) + cost <= limit)
                    .min()
                    .map(|t| t - now);
                prop_assert_eq!(Some(d.retry_after), wait);
            }
        }
    }

    #[test]
    fn sliding_window_matches_the_weighted_estimate(
        limit in 1u64..30, window_ms in window_ms(), calls in arrivals(5_000 * MS, 30)
    ) {
        let window = window_ms * MS;
        let alg = SlidingWindow::new(limit, window);
        let mut counts: HashMap<u64, u64> = HashMap::new();
        let calls: Vec<Arrival> = calls.into_iter().map(|a| Arrival { cost: a.cost.min(limit), ..a }).collect();
        for (now, cost, d) in run(&alg, &calls) {
            let k = now / window;
            let elapsed = now - k * window;
            let previous = if k == 0 { 0 } else { counts.get(&(k - 1)).copied().unwrap_or(0) };
            let current = counts.get(&k).copied().unwrap_or(0);
            let scaled = u128::from(previous) * u128::from(window - elapsed) + u128::from(current + cost) * u128::from(window);
            let allowed = scaled <= u128::from(limit) * u128::from(window);
            prop_assert_eq!(d.allowed, allowed, "at {} cost {}", now, cost);
            if allowed {
                *counts.entry(k).or_default() += cost;
            }
        }
    }

    /// Refused calls change nothing: dropping them from the input changes no other decision.
    #[test]
    fn refusals_never_charge(
        algorithm in 0usize..6, capacity in 1u64..20, span_ms in window_ms(), calls in arrivals(3_000 * MS, 20)
    ) {
        let calls: Vec<Arrival> = calls.into_iter().map(|a| Arrival { cost: a.cost.min(capacity), ..a }).collect();
        let decide = |calls: &[Arrival]| -> Vec<(u64, bool)> {
            let rate = 1_000.0 / span_ms as f64;
            let window = span_ms * MS;
            let all = match algorithm {
                0 => run(&TokenBucket::new(capacity, rate), calls),
                1 => run(&Gcra::new(capacity, rate), calls),
                2 => run(&LeakyBucket::new(capacity, rate), calls),
                3 => run(&FixedWindow::new(capacity, window), calls),
                4 => run(&SlidingLog::new(capacity, window), calls),
                _ => run(&SlidingWindow::new(capacity, window), calls),
            };
            all.into_iter().map(|(now, _, d)| (now, d.allowed)).collect()
        };
        let full = decide(&calls);
        // Keep only the admitted calls, carrying each dropped call's gap over to the next one.
        let mut kept = vec![];
        let mut carried = 0;
        for (call, (_, allowed)) in calls.iter().zip(&full) {
            carried += call.gap;
            if *allowed {
                kept.push(Arrival { gap: carried, cost: call.cost });
                carried = 0;
            }
        }
        let admitted_only = decide(&kept);
        prop_assert!(admitted_only.iter().all(|(_, allowed)| *allowed));
    }

    /// A refusal's wait is exact for the algorithms that can know it: one nanosecond sooner is
    /// still refused, at the wait the same call passes.
    #[test]
    fn retry_after_is_exact(
        algorithm in 0usize..6, capacity in 1u64..20, span_ms in window_ms(), calls in arrivals(3_000 * MS, 20)
    ) {
        let rate = 1_000.0 / span_ms as f64;
        let window = span_ms * MS;
        let calls: Vec<Arrival> = calls.into_iter().map(|a| Arrival { cost: a.cost.min(capacity), ..a }).collect();
        macro_rules! check {
            ($alg:expr, $exact:expr) => {{
                let alg = $alg;
                let mut now = 1_000 * MS;
                let mut state = alg.fresh(now);
                for a in &calls {
                    now += a.gap;
                    let d = alg.acquire(&mut state, now, a.cost);
                    if !d.allowed {
                        let mut later = state.clone();
                        prop_assert!(alg.acquire(&mut later, now + d.retry_after, a.cost).allowed,
                            "not admitted after its retry_after {}", d.retry_after);
                        if $exact {
                            let mut sooner = state.clone();
                            prop_assert!(!alg.acquire(&mut sooner, now + d.retry_after - 1, a.cost).allowed,
                                "admitted before its retry_after {}", d.retry_after);
                        }
                    }
                }
            }};
        }
        match algorithm {
            0 => check!(TokenBucket::new(capacity, rate), true),
            1 => check!(Gcra::new(capacity, rate), true),
            2 => check!(LeakyBucket::new(capacity, rate), true),
            3 => check!(FixedWindow::new(capacity, window), true),
            4 => check!(SlidingLog::new(capacity, window), true),
            _ => check!(SlidingWindow::new(capacity, window), false),
        }
    }

    #[test]
    fn concurrency_counts_slots_exactly(max in 1u64..10, ops in prop::collection::vec((any::<bool>(), 0u64..5), 1..200)) {
        let alg = Concurrency::new(max);
        let mut state = alg.fresh(0);
        let mut held: Vec<u64> = vec![];
        for (acquire, cost) in ops {
            let cost = cost.min(max);
            if acquire || held.is_empty() {
                let in_flight: u64 = held.iter().sum();
                let d = alg.acquire(&mut state, 0, cost);
                prop_assert_eq!(d.allowed, in_flight + cost <= max);
                if d.allowed { held.push(cost); }
                prop_assert_eq!(d.remaining, max - held.iter().sum::<u64>());
            } else if let Some(c) = held.pop() {
                alg.release(&mut state, c);
            }
        }
    }
}

/// The window-edge attack: `limit` calls just before a window boundary, `limit` just after.
fn edge_burst<A: Algorithm>(alg: &A, limit: u64, window: u64) -> u64 {
    let mut state = alg.fresh(0);
    let before = 10 * window - 1;
    let after = 10 * window;
    let mut admitted = 0;
    for now in [before, after] {
        for _ in 0..limit {
            if alg.acquire(&mut state, now, 1).allowed {
                admitted += 1;
            }
        }
    }
    admitted
}

#[test]
fn fixed_window_lets_twice_the_limit_through_across_an_edge() {
    let window = 60_000 * MS;
    assert_eq!(edge_burst(&FixedWindow::new(100, window), 100, window), 200);
}

#[test]
fn sliding_log_never_lets_more_than_the_limit_through_an_edge() {
    let window = 60_000 * MS;
    assert_eq!(edge_burst(&SlidingLog::new(100, window), 100, window), 100);
}

#[test]
fn sliding_window_stays_within_its_documented_error_at_an_edge() {
    let window = 60_000 * MS;
    let admitted = edge_burst(&SlidingWindow::new(100, window), 100, window);
    assert!(admitted <= 101, "the previous window still weighs fully at the edge: {admitted}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Documented bound of the sliding window counter: any span of one window holds at most
    /// twice the limit, whatever the arrival pattern.
    #[test]
    fn sliding_window_never_exceeds_twice_the_limit_in_any_window(
        limit in 1u64..20, window_ms in window_ms(), calls in arrivals(2_000 * MS, 5)
    ) {
        let window = window_ms * MS;
        let alg = SlidingWindow::new(limit, window);
        let calls: Vec<Arrival> = calls.into_iter().map(|a| Arrival { cost: a.cost.min(limit), ..a }).collect();
        let admitted: Vec<(u64, u64)> =
            run(&alg, &calls).into_iter().filter(|(_, _, d)| d.allowed).map(|(t, c, _)| (t, c)).collect();
        for &(start, _) in &admitted {
            let in_span: u64 = admitted.iter().filter(|(t, _)| *t >= start && *t < start + window).map(|(_, c)| c).sum();
            prop_assert!(in_span <= 2 * limit, "{} in one window, limit {}", in_span, limit);
        }
    }
}
