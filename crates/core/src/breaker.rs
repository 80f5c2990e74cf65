//! A circuit breaker, as Envoy and resilience4j keep one per upstream: the paid API's (see
//! `crate::upstream`), and the shared limiter store's (the guard stops waiting on a Redis that is
//! down, and probes it once a second).
//!
//! When an upstream keeps failing, calling it harder helps nobody: agents wait on timeouts and
//! the upstream gets no room to recover. After `failures_to_open` consecutive failures the
//! breaker opens for a `cooldown`, and every call is refused at once with the time left, so
//! the server answers `upstream_unavailable` with a `retry_after_ms` without touching the
//! upstream. Once the cool-down has passed exactly one probe goes through (half-open): a good
//! probe closes the breaker, a failed one opens it for another full cool-down.
//!
//! A probe whose outcome is never recorded (its future was dropped) cannot wedge the breaker:
//! once a probe has been out for a whole cool-down, the next request probes instead.
//!
//! Time comes in as explicit `now` arguments read from the server's one clock.

use std::sync::Mutex;

use crate::clock::Nanos;

/// The breaker of one upstream.
#[derive(Debug)]
pub struct Breaker {
    failures_to_open: u32,
    cooldown: Nanos,
    phase: Mutex<Phase>,
}

/// Where the breaker stands, with what each phase must remember.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Calls pass; `failures` in a row so far.
    Closed { failures: u32 },
    /// Calls are refused until `until`; after that the next call probes.
    Open { until: Nanos },
    /// One probe has been out since `since`; others wait for its outcome.
    HalfOpen { since: Nanos },
}

/// What [`Breaker::permit`] granted. Hand it back to [`Breaker::record`] with the outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Permit {
    /// An ordinary call through a closed breaker.
    Normal,
    /// The one trial call that decides whether an open breaker closes.
    Probe,
}

/// A refusal: the upstream is considered down, so the call is not made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Open {
    /// Nanoseconds until a call may be tried: the cool-down left, or while a probe is out, a
    /// short wait for its outcome (1 s at most). Never under 1 ms.
    pub retry_after: Nanos,
}

/// The breaker's state as a metrics gauge shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Calls go through.
    Closed,
    /// Calls are refused until the cool-down ends.
    Open,
    /// The cool-down is over: a probe is out, or the next call will be one.
    HalfOpen,
}

impl Breaker {
    /// A closed breaker that opens after `failures_to_open` (at least 1) failures in a row and
    /// stays open for `cooldown` nanoseconds.
    pub fn new(failures_to_open: u32, cooldown: Nanos) -> Self {
        Self {
            failures_to_open: failures_to_open.max(1),
            cooldown: cooldown.max(Nanos::new(1)),
            phase: Mutex::new(Phase::Closed { failures: 0 }),
        }
    }

    /// Whether a call may go to the upstream at `now`, and as what.
    pub fn permit(&self, now: Nanos) -> Result<Permit, Open> {
        let mut phase = self.phase.lock().unwrap_or_else(|p| p.into_inner());
        match *phase {
            Phase::Closed { .. } => Ok(Permit::Normal),
            Phase::Open { until } if now < until => Err(refusal(until - now)),
            Phase::HalfOpen { since } if now - since < self.cooldown => {
                // Its outcome is due any moment; if it never comes, the probe counts as lost
                // a cool-down after it left, and then a new one may go.
                Err(refusal((since + self.cooldown - now).min(Nanos::from_secs(1))))
            }
            // The cool-down is over, or the last probe was lost: this call is the probe.
            Phase::Open { .. } | Phase::HalfOpen { .. } => {
                *phase = Phase::HalfOpen { since: now };
                Ok(Permit::Probe)
            }
        }
    }

    /// Records how a permitted call went.
    ///
    /// A late outcome of a call permitted before the breaker opened is ignored while it is
    /// open: it says nothing about the upstream now. A probe's outcome decides a half-open
    /// breaker. In the closed state every outcome counts, whatever its permit.
    pub fn record(&self, permit: Permit, ok: bool, now: Nanos) {
        let mut phase = self.phase.lock().unwrap_or_else(|p| p.into_inner());
        *phase = match (*phase, permit) {
            (Phase::Closed { .. }, _) if ok => Phase::Closed { failures: 0 },
            (Phase::Closed { failures }, _) => {
                let failures = failures.saturating_add(1);
                if failures >= self.failures_to_open { self.open(now) } else { Phase::Closed { failures } }
            }
            (Phase::HalfOpen { .. }, Permit::Probe) if ok => Phase::Closed { failures: 0 },
            (Phase::HalfOpen { .. }, Permit::Probe) => self.open(now),
            (unchanged, _) => unchanged,
        };
    }

    /// Opens the breaker at `now` for a whole cool-down, whatever it counted: the upstream is
    /// known to be down (a proxied server's process died).
    pub fn trip(&self, now: Nanos) {
        *self.phase.lock().unwrap_or_else(|p| p.into_inner()) = self.open(now);
    }

    /// Closes the breaker: the upstream is known to be back (a proxied server restarted).
    pub fn close(&self) {
        *self.phase.lock().unwrap_or_else(|p| p.into_inner()) = Phase::Closed { failures: 0 };
    }

    /// How long every call will still be refused, if the breaker is open at `now`. Unlike
    /// [`Breaker::permit`] it never takes the probe: a tool asks it before charging a call that
    /// could not reach the upstream anyway.
    pub fn open_for(&self, now: Nanos) -> Option<Nanos> {
        match *self.phase.lock().unwrap_or_else(|p| p.into_inner()) {
            Phase::Open { until } if now < until => Some(until - now),
            _ => None,
        }
    }

    /// The state at `now`, for the metrics gauge.
    pub fn state(&self, now: Nanos) -> BreakerState {
        match *self.phase.lock().unwrap_or_else(|p| p.into_inner()) {
            Phase::Closed { .. } => BreakerState::Closed,
            Phase::Open { until } if now < until => BreakerState::Open,
            Phase::Open { .. } | Phase::HalfOpen { .. } => BreakerState::HalfOpen,
        }
    }

    fn open(&self, now: Nanos) -> Phase {
        Phase::Open { until: now + self.cooldown }
    }
}

/// A refusal saying to come back in `wait`, but never sooner than 1 ms: a `retry_after_ms` of
/// 0 would invite an agent to spin.
fn refusal(wait: Nanos) -> Open {
    Open { retry_after: wait.max(Nanos::from_millis(1)) }
}

#[cfg(test)]
mod tests {
    use super::*;
    const MS: Nanos = Nanos::from_millis(1);
    const SEC: Nanos = Nanos::from_secs(1);
    use std::sync::{Arc, Barrier};

    const COOLDOWN: Nanos = Nanos::from_secs(30);

    fn fail(b: &Breaker, times: u32, now: Nanos) {
        for _ in 0..times {
            assert_eq!(b.permit(now), Ok(Permit::Normal));
            b.record(Permit::Normal, false, now);
        }
    }

    #[test]
    fn opens_after_exactly_n_consecutive_failures() {
        let b = Breaker::new(5, COOLDOWN);
        fail(&b, 4, Nanos::ZERO);
        b.record(Permit::Normal, true, Nanos::ZERO);
        fail(&b, 4, Nanos::ZERO);
        assert_eq!(b.state(Nanos::ZERO), BreakerState::Closed);
        fail(&b, 1, SEC);
        assert_eq!(b.state(SEC), BreakerState::Open);
        assert_eq!(b.permit(SEC), Err(Open { retry_after: COOLDOWN }));
    }

    #[test]
    fn refuses_with_the_exact_cooldown_left() {
        let b = Breaker::new(1, COOLDOWN);
        fail(&b, 1, 10 * SEC);
        assert_eq!(b.permit(10 * SEC), Err(Open { retry_after: 30 * SEC }));
        assert_eq!(b.permit(11 * SEC), Err(Open { retry_after: 29 * SEC }));
        assert_eq!(b.permit(39 * SEC + 250 * MS), Err(Open { retry_after: 750 * MS }));
        // Never under 1 ms, so no one is told to retry in 0 ms.
        assert_eq!(b.permit(40 * SEC - Nanos::new(1)), Err(Open { retry_after: MS }));
        assert_eq!(b.permit(40 * SEC), Ok(Permit::Probe));
    }

    #[test]
    fn lets_one_probe_through_and_a_good_one_closes() {
        let b = Breaker::new(2, COOLDOWN);
        fail(&b, 2, Nanos::ZERO);
        assert_eq!(b.state(COOLDOWN), BreakerState::HalfOpen);
        assert_eq!(b.permit(COOLDOWN), Ok(Permit::Probe));
        for t in [COOLDOWN, COOLDOWN + 5 * SEC] {
            assert_eq!(b.permit(t), Err(Open { retry_after: SEC }));
        }
        assert_eq!(b.state(COOLDOWN + 5 * SEC), BreakerState::HalfOpen);
        b.record(Permit::Probe, true, COOLDOWN + 6 * SEC);
        assert_eq!(b.state(COOLDOWN + 6 * SEC), BreakerState::Closed);
        assert_eq!(b.permit(COOLDOWN + 6 * SEC), Ok(Permit::Normal));
        // Closed afresh: the count starts again from zero.
        fail(&b, 1, COOLDOWN + 7 * SEC);
        assert_eq!(b.state(COOLDOWN + 7 * SEC), BreakerState::Closed);
    }

    #[test]
    fn a_bad_probe_reopens_for_a_full_cooldown() {
        let b = Breaker::new(1, COOLDOWN);
        fail(&b, 1, Nanos::ZERO);
        assert_eq!(b.permit(COOLDOWN + SEC), Ok(Permit::Probe));
        b.record(Permit::Probe, false, COOLDOWN + 3 * SEC);
        assert_eq!(b.state(COOLDOWN + 3 * SEC), BreakerState::Open);
        assert_eq!(b.permit(COOLDOWN + 3 * SEC), Err(Open { retry_after: COOLDOWN }));
        assert_eq!(b.permit(2 * COOLDOWN + 3 * SEC - Nanos::new(1)), Err(Open { retry_after: MS }));
        assert_eq!(b.permit(2 * COOLDOWN + 3 * SEC), Ok(Permit::Probe));
    }

    #[test]
    fn an_abandoned_probe_does_not_wedge_the_breaker() {
        let b = Breaker::new(1, COOLDOWN);
        fail(&b, 1, Nanos::ZERO);
        assert_eq!(b.permit(COOLDOWN), Ok(Permit::Probe));
        // Its outcome never comes. Near the end, the wait offered is what is left of it.
        assert_eq!(b.permit(2 * COOLDOWN - 200 * MS), Err(Open { retry_after: 200 * MS }));
        assert_eq!(b.permit(2 * COOLDOWN), Ok(Permit::Probe));
        assert_eq!(b.permit(2 * COOLDOWN), Err(Open { retry_after: SEC }));
        b.record(Permit::Probe, true, 2 * COOLDOWN + SEC);
        assert_eq!(b.permit(2 * COOLDOWN + SEC), Ok(Permit::Normal));
    }

    #[test]
    fn late_outcomes_of_normal_calls_do_not_move_an_open_breaker() {
        let b = Breaker::new(1, COOLDOWN);
        fail(&b, 1, Nanos::ZERO);
        b.record(Permit::Normal, true, SEC);
        assert_eq!(b.state(SEC), BreakerState::Open);
        assert_eq!(b.permit(COOLDOWN), Ok(Permit::Probe));
        b.record(Permit::Normal, false, COOLDOWN);
        assert_eq!(b.permit(COOLDOWN), Err(Open { retry_after: SEC }));
    }

    #[test]
    fn eight_threads_after_the_cooldown_get_exactly_one_probe() {
        for _ in 0..50 {
            let b = Arc::new(Breaker::new(1, COOLDOWN));
            fail(&b, 1, Nanos::ZERO);
            let barrier = Arc::new(Barrier::new(8));
            let threads: Vec<_> = (0..8)
                .map(|_| {
                    let (b, barrier) = (Arc::clone(&b), Arc::clone(&barrier));
                    std::thread::spawn(move || {
                        barrier.wait();
                        b.permit(COOLDOWN + SEC)
                    })
                })
                .collect();
            let results: Vec<_> = threads.into_iter().map(|t| t.join().expect("a permit thread panicked")).collect();
            assert_eq!(results.iter().filter(|r| **r == Ok(Permit::Probe)).count(), 1, "{results:?}");
            assert_eq!(results.iter().filter(|r| **r == Err(Open { retry_after: SEC })).count(), 7, "{results:?}");
        }
    }
}
