//! The agents the simulator replays: one [`Shape`] each, paced from the budget they run into.
//!
//! Every pace is a multiple of the binding budget (its burst `b` in calls, its sustained rate
//! `r` in calls per second, its window `W = b / r`), so a shape means the same thing under any
//! config: a steady agent stays under the rate, a runaway loop runs at twice it, an edge attack
//! aims at the window's edges. An *agent turn* (one model round trip, then a call) is `1 / 2r`:
//! an agent that never waits asks for twice what the budget gives. Every random draw (fan-out
//! timing, round trips, turns) comes from the run's seeded RNG.
//!
//! Open-loop agents (`Agent::Scheduled`) call at instants fixed in advance, whatever they are
//! told: the same traffic meets every algorithm. Closed-loop agents (`Agent::Reactive`) take
//! one turn per call and differ only in what they do with a refusal.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::clock::{NANOS_PER_MS, Nanos};
use crate::simulate::Budget;

/// One agent behaviour to replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// Calls evenly spaced at 80 % of the sustained rate: what a budget should never refuse.
    Steady,
    /// Twice the burst at once, then steady: how much a cold start may spend, and how long the
    /// overdraft is felt.
    BurstThenSteady,
    /// Every third of a window, half a burst of parallel calls within half a second: tool calls
    /// fanned out from one turn, 1.5× what the budget sustains.
    FanOut,
    /// One call per turn; a refused call is retried at once (one round trip later), again and
    /// again: a client retry loop without backoff.
    RetryStorm,
    /// One call per turn; after a refusal it waits exactly `retry_after_ms`, then retries.
    Obedient,
    /// One call per turn for 8 hours, deaf to refusals: a stuck agent nobody watches.
    RunawayLoop,
    /// One call per turn; after a refusal it reconnects (a new MCP session, 200-400 ms) and
    /// retries, hoping a session brings a fresh budget. It presents the same key, so it is the
    /// same caller: sessions are never a budget key.
    ReconnectToReset,
    /// A full burst just before a window edge and another just after, at every other edge (the
    /// window between lets any budget fill up again): the attack that gets 2× through a fixed
    /// window.
    EdgeAttack,
}

/// Every shape, in the order they are run and printed.
pub const SHAPES: [Shape; 8] = [
    Shape::Steady,
    Shape::BurstThenSteady,
    Shape::FanOut,
    Shape::RetryStorm,
    Shape::Obedient,
    Shape::RunawayLoop,
    Shape::ReconnectToReset,
    Shape::EdgeAttack,
];

const MINUTE: Nanos = Nanos::from_secs(60);
const HOUR: Nanos = Nanos::from_secs(3_600);

/// How an answer reached the agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// The call went through.
    Admitted,
    /// The call was refused, with the wait the refusal named (`retry_after_ms`), if any.
    Refused { retry_after: Option<Nanos> },
}

/// What a closed-loop agent does with a refusal.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Reaction {
    /// Retries after one round trip (30-70 ms).
    RetryAtOnce,
    /// Waits the refusal's `retry_after_ms` (a turn when it names none), then retries.
    WaitRetryAfter,
    /// Opens a new session (200-400 ms), then retries.
    Reconnect,
}

/// An agent being replayed: when it calls next, and what it makes of each answer.
#[derive(Debug)]
pub(crate) enum Agent {
    /// Calls at fixed instants, in order, whatever the answers.
    Scheduled(std::vec::IntoIter<Nanos>),
    /// One call per turn (±10 %); a refusal gets its [`Reaction`].
    Reactive { next: Nanos, turn: Nanos, reaction: Reaction, rng: Box<StdRng> },
}

impl Agent {
    /// The instant of the next call, never earlier than the last one; `None` when done.
    pub(crate) fn next_call(&mut self) -> Option<Nanos> {
        match self {
            Agent::Scheduled(at) => at.next(),
            Agent::Reactive { next, .. } => Some(*next),
        }
    }

    /// Tells the agent how its call made at `at` was answered.
    pub(crate) fn answered(&mut self, at: Nanos, answer: Outcome) {
        let Agent::Reactive { next, turn, reaction, rng } = self else { return };
        let wait = match (answer, *reaction) {
            (Outcome::Admitted, _) => jittered(rng, *turn),
            (Outcome::Refused { .. }, Reaction::RetryAtOnce) => Nanos::from_millis(rng.random_range(30..=70)),
            (Outcome::Refused { retry_after }, Reaction::WaitRetryAfter) => retry_after.unwrap_or(*turn),
            (Outcome::Refused { .. }, Reaction::Reconnect) => Nanos::from_millis(rng.random_range(200..=400)),
        };
        // Time moves on after every call, even after a refusal that named no wait.
        *next = at + wait.max(Nanos::from_millis(1));
    }
}

/// `around` ±10 %.
fn jittered(rng: &mut StdRng, around: Nanos) -> Nanos {
    let tenth = around / 10;
    Nanos::new(rng.random_range((around - tenth).as_u64()..=(around + tenth).as_u64()))
}

impl Shape {
    /// The name used on the command line, in the tables and as the chart's file name.
    pub fn name(self) -> &'static str {
        match self {
            Shape::Steady => "steady",
            Shape::BurstThenSteady => "burst_then_steady",
            Shape::FanOut => "fan_out",
            Shape::RetryStorm => "retry_storm",
            Shape::Obedient => "obedient",
            Shape::RunawayLoop => "runaway_loop",
            Shape::ReconnectToReset => "reconnect_to_reset",
            Shape::EdgeAttack => "edge_attack",
        }
    }

    /// The shape called `name`, if there is one.
    pub fn from_name(name: &str) -> Option<Shape> {
        SHAPES.into_iter().find(|shape| shape.name() == name)
    }

    /// How long the shape is replayed: 8 hours for the runaway loop, past the fifth window edge
    /// for the edge attack, ten windows (at least 10 minutes, at most 2 hours) for the others.
    pub(crate) fn horizon(self, budget: &Budget) -> Nanos {
        let window = budget.window();
        match self {
            Shape::RunawayLoop => 8 * HOUR,
            Shape::EdgeAttack => 5 * window + window / 2,
            _ => (window * 10).clamp(10 * MINUTE, 2 * HOUR),
        }
    }

    /// What the agent does, with this budget's numbers.
    pub(crate) fn describe(self, budget: &Budget) -> String {
        let (turn, steady) = (secs(turn(budget)), secs(steady_gap(budget)));
        let (burst, fan) = (budget.burst_calls, fan_width(budget));
        match self {
            Shape::Steady => format!("one call every {steady} (80 % of the sustained rate)"),
            Shape::BurstThenSteady => format!("{} calls at once, then one every {steady}", 2 * burst),
            Shape::FanOut => {
                format!(
                    "{fan} parallel calls (within 0.5 s) every {}: 1.5x the sustained rate",
                    secs(budget.window() / 3)
                )
            }
            Shape::RetryStorm => format!("one call per {turn} turn; a refused call is retried at once (30-70 ms)"),
            Shape::Obedient => format!("one call per {turn} turn; after a refusal, waits retry_after_ms"),
            Shape::RunawayLoop => format!("one call every {turn} for 8 hours, whatever the answer"),
            Shape::ReconnectToReset => {
                format!("one call per {turn} turn; after a refusal, a new session (200-400 ms), then retries")
            }
            Shape::EdgeAttack => format!(
                "{burst} calls {} before a window edge and {burst} at the edge, at edges 1, 3 and 5",
                secs(edge_lead(budget))
            ),
        }
    }

    /// The agent, drawing its randomness from `seed`.
    pub(crate) fn agent(self, budget: &Budget, seed: u64) -> Agent {
        let mut rng = StdRng::seed_from_u64(seed);
        let reactive =
            |reaction, rng| Agent::Reactive { next: Nanos::ZERO, turn: turn(budget), reaction, rng: Box::new(rng) };
        let horizon = self.horizon(budget);
        let steady_from = |start: Nanos| (0..).map(move |k| start + k * steady_gap(budget));
        let schedule: Vec<Nanos> = match self {
            Shape::RetryStorm => return reactive(Reaction::RetryAtOnce, rng),
            Shape::Obedient => return reactive(Reaction::WaitRetryAfter, rng),
            Shape::ReconnectToReset => return reactive(Reaction::Reconnect, rng),
            Shape::Steady => steady_from(Nanos::ZERO).take_while(|t| *t < horizon).collect(),
            Shape::BurstThenSteady => std::iter::repeat_n(Nanos::ZERO, 2 * budget.burst_calls as usize)
                .chain(steady_from(steady_gap(budget)).take_while(|t| *t < horizon))
                .collect(),
            Shape::FanOut => {
                let every = (budget.window() / 3).max(Nanos::new(1));
                let spread = Nanos::from_millis(500).min(every / 2).max(Nanos::new(1));
                let mut at: Vec<Nanos> = (0..)
                    .map(|k| k * every)
                    .take_while(|t| *t < horizon)
                    .flat_map(|start| (0..fan_width(budget)).map(move |_| start))
                    .map(|start| start + Nanos::new(rng.random_range(0..spread.as_u64())))
                    .collect();
                at.sort_unstable();
                at
            }
            Shape::RunawayLoop => (0..).map(|k| k * turn(budget)).take_while(|t| *t < horizon).collect(),
            Shape::EdgeAttack => [1u64, 3, 5]
                .into_iter()
                .flat_map(|k| {
                    let edge = k * budget.window();
                    let burst = budget.burst_calls as usize;
                    std::iter::repeat_n(edge - edge_lead(budget), burst).chain(std::iter::repeat_n(edge, burst))
                })
                .collect(),
        };
        Agent::Scheduled(schedule.into_iter())
    }
}

/// One agent turn: half the time the budget takes to give back one call (never under 100 ms,
/// so even a huge budget is simulated with a plausible agent, not a busy loop).
fn turn(budget: &Budget) -> Nanos {
    (budget.call_period() / 2).max(Nanos::from_millis(100))
}

/// The steady agent's gap between calls: 80 % of the sustained rate.
fn steady_gap(budget: &Budget) -> Nanos {
    budget.call_period() * 5 / 4
}

/// Calls in one fan-out: half a burst.
fn fan_width(budget: &Budget) -> u64 {
    budget.burst_calls.div_ceil(2)
}

/// How long before an edge the attack's first burst lands: 100 ms, or a tenth of a short window.
fn edge_lead(budget: &Budget) -> Nanos {
    Nanos::from_millis(100).min(budget.window() / 10)
}

/// A duration as people say it: `2.5 s`, `20 s`, `100 ms`.
pub(crate) fn secs(nanos: Nanos) -> String {
    if nanos < Nanos::from_secs(1) {
        return format!("{} ms", nanos.as_u64() / NANOS_PER_MS);
    }
    let tenths = (nanos + Nanos::from_millis(50)) / Nanos::from_millis(100);
    if tenths.is_multiple_of(10) { format!("{} s", tenths / 10) } else { format!("{}.{} s", tenths / 10, tenths % 10) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shape_is_found_by_its_name_and_durations_read_well() {
        for shape in SHAPES {
            assert_eq!(Shape::from_name(shape.name()), Some(shape));
        }
        assert_eq!(Shape::from_name("stampede"), None);
        assert_eq!(
            (secs(Nanos::from_millis(2_500)), secs(Nanos::from_secs(20)), secs(Nanos::from_millis(100))),
            ("2.5 s".to_owned(), "20 s".to_owned(), "100 ms".to_owned())
        );
    }
}
