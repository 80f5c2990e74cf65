//! `job_endings`: how much of an account runs, against how the server learns that a job ended.
//!
//! A paid job holds one of the account's slots from its submission until the server *learns* that
//! it ended, so every moment between its end and that news is a slot paid for and left idle. One
//! account of 4 slots; every scenario submits 40 images at once, which wait in the server's own
//! [`FairQueue`] (its dispatcher a task on a current-thread runtime over a [`ManualClock`]) and
//! start the moment a slot is free. The upstream is a model: a job runs its length from its
//! submission, and its slot comes back when the server learns it ended, which depends on the
//! strategy:
//!
//! - **fixed poll**: as before the learnt cadence, a job is polled every `image_poll_seconds` (the
//!   image class's hint, 2 s by default) after its submission, and its slot comes back at the
//!   first poll at or after its end. It is the server's own [`Cadence`], never taught anything;
//! - **learnt cadence**: the server's own [`Cadence`], webhooks off: a job is first polled at
//!   `first_poll` after its submission, then `next_poll` after each poll that found it running;
//!   each job found ended teaches the cadence its length at once (the paid API reports
//!   `predict_time`, so the length is exact);
//! - **webhooks**: the end is heard 20 ms after it happens (a webhook's trip) and the slot comes
//!   back then; the background poll ([`Cadence`] with webhooks on: first at twice the expected end)
//!   still runs as the safety net, and its polls are counted too.
//!
//! Scenarios: **steady** (40 images of exactly 1 s: the target, ≥ 20 of 24 busy
//! slot-seconds between 4 s and 10 s without webhooks at ≤ 4 polls a job, ≥ 22 of 24 in the first
//! 6 s with them) and **varied** (40 images of 3–10 s each, uniform, drawn from the seed: what real
//! image APIs take).
//!
//! **Busy slot-seconds** in a span: the time jobs ran upstream within it, summed over the
//! account's slots (of 4 × 6 s = 24 in a span of 6 s). The time a slot is held after its job ended
//! is *idle held*, reported as a share of all the time slots were held. The clock jumps from one
//! event to the next (a poll, a webhook's arrival), so every time is exact; a run never has more
//! than 4 jobs running at once, or it is an error.

use std::fmt::Write as _;
use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use tokio::sync::oneshot::error::TryRecvError;
use tokio_util::sync::CancellationToken;

use crate::clock::{Clock, ManualClock, NANOS_PER_MS, Nanos, SharedClock};
use crate::config::Config;
use crate::simulate::{SimulateError, settle};
use crate::upstream::classes::{IMAGE, JobClasses};
use crate::upstream::jobs::cadence::Cadence;
use crate::upstream::queue::{AccountSlot, FairQueue, Flowing, QueueRules, Turn};

/// The account's slots.
const SLOTS: usize = 4;
/// Images each scenario submits, all at once.
const JOBS: usize = 40;
/// The places of the queue: room for every job.
const PLACES: usize = 100;
/// How long after a job's end its webhook reaches the server.
const WEBHOOK_TRIP: Nanos = Nanos::from_millis(20);
/// The first span the account's use is counted over: the first 6 s.
const FIRST: (Nanos, Nanos) = (Nanos::ZERO, Nanos::from_secs(6));
/// The second: 4 s to 10 s, once the first jobs' ends have taught the cadence.
const LATER: (Nanos, Nanos) = (Nanos::from_secs(4), Nanos::from_secs(10));
/// The longest a run may take: a model still running then is stuck.
const HORIZON: Nanos = Nanos::from_secs(3_600);
/// The name errors carry.
const SHAPE: &str = "job_endings";

/// One way the server learns that a job ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Strategy {
    FixedPoll,
    LearntCadence,
    Webhooks,
}

impl Strategy {
    const ALL: [Strategy; 3] = [Strategy::FixedPoll, Strategy::LearntCadence, Strategy::Webhooks];

    fn name(self) -> &'static str {
        match self {
            Strategy::FixedPoll => "fixed poll",
            Strategy::LearntCadence => "learnt cadence",
            Strategy::Webhooks => "webhooks",
        }
    }

    /// Whether a job's length is learnt once its end is: the fixed poll is the cadence that never
    /// learns, so it polls at the hint for ever.
    fn learns(self) -> bool {
        self != Strategy::FixedPoll
    }

    fn webhooks(self) -> bool {
        self == Strategy::Webhooks
    }
}

/// A scenario: its name, what is submitted, and each job's length.
struct Scenario {
    name: &'static str,
    description: &'static str,
    lengths: Vec<Nanos>,
}

fn scenarios(seed: u64) -> Vec<Scenario> {
    let mut rng = StdRng::seed_from_u64(seed);
    vec![
        Scenario {
            name: "steady",
            description: "40 images of exactly 1 s, submitted at once",
            lengths: vec![Nanos::from_secs(1); JOBS],
        },
        Scenario {
            name: "varied",
            description: "40 images of 3-10 s each (uniform, drawn from the seed), submitted at once",
            lengths: (0..JOBS).map(|_| Nanos::from_millis(rng.random_range(3_000..=10_000))).collect(),
        },
    ]
}

/// One scenario under one strategy.
#[derive(Debug, Clone, Serialize)]
pub struct EndingRun {
    /// `steady` or `varied`.
    pub scenario: String,
    /// `fixed poll`, `learnt cadence` or `webhooks`.
    pub strategy: String,
    /// Busy slot-seconds in the first 6 s: the time jobs ran upstream then, summed over the
    /// account's slots (of 24).
    pub busy_first_6s: f64,
    /// Busy slot-seconds from 4 s to 10 s (of 24).
    pub busy_4_to_10s: f64,
    /// Of the time slots were held, the share held after their job had ended (0.5: half).
    pub idle_held: f64,
    /// Polls of the paid API, per job.
    pub polls_per_job: f64,
    /// When the last job ended upstream, in ms.
    pub last_end_ms: u64,
    /// The most jobs running upstream at once (never over the account's slots).
    pub most_at_once: usize,
}

/// `job_endings`: every scenario under each strategy.
#[derive(Debug, Clone, Serialize)]
pub struct JobEndings {
    /// The account, and what the strategies are.
    pub description: String,
    /// The image class's poll hint (`image_poll_seconds`), in ms: the fixed poll's interval.
    pub hint_ms: u64,
    /// How long a webhook takes to arrive after the job's end, in ms.
    pub webhook_trip_ms: u64,
    /// Each scenario under the fixed poll, the learnt cadence and webhooks.
    pub runs: Vec<EndingRun>,
}

impl JobEndings {
    /// Jobs submitted in all.
    pub fn calls(&self) -> u64 {
        (self.runs.len() as u64).saturating_mul(JOBS as u64)
    }

    pub(crate) fn write_text(&self, out: &mut String) {
        let hint = super::trimmed(self.hint_ms as f64 / 1000.0);
        let _ = writeln!(out);
        let _ = writeln!(out, "job_endings: {}", self.description);
        for scenario in scenarios(0) {
            let _ = writeln!(out, "  {}: {}", scenario.name, scenario.description);
        }
        for line in [
            format!("fixed poll: polled every {hint} s after its submission (image_poll_seconds), as before"),
            "learnt cadence: polled at the sixths of the lengths seen (the hint until a job ended), then each tenth of its age"
                .to_owned(),
            format!(
                "webhooks: its end heard {} ms after it happens; the poll, at twice the expected end, a safety net",
                self.webhook_trip_ms
            ),
            "busy: slot-seconds jobs ran upstream within the span, of 24 (4 slots x 6 s)".to_owned(),
            "idle held: of the time slots were held, the share after their job had ended".to_owned(),
        ] {
            let _ = writeln!(out, "  {line}");
        }
        let _ = writeln!(
            out,
            "  {:<9} {:<15} {:>10} {:>11} {:>10} {:>10} {:>9} {:>13}",
            "scenario", "strategy", "busy 0-6s", "busy 4-10s", "idle held", "polls/job", "last end", "most at once"
        );
        for r in &self.runs {
            let _ = writeln!(
                out,
                "  {:<9} {:<15} {:>10.1} {:>11.1} {:>9.1}% {:>10.2} {:>7.2} s {:>13}",
                r.scenario,
                r.strategy,
                r.busy_first_6s,
                r.busy_4_to_10s,
                r.idle_held * 100.0,
                r.polls_per_job,
                r.last_end_ms as f64 / 1000.0,
                r.most_at_once
            );
        }
    }
}

/// Runs every scenario under each strategy, each on its own runtime, clock and queue; the image
/// class (its hint) is `config`'s, and the varied lengths are drawn from `seed`.
pub(crate) fn run(config: &Config, seed: u64) -> Result<JobEndings, SimulateError> {
    let classes = JobClasses::from_config(&config.upstream);
    let hint = classes.get(IMAGE).map_or(Nanos::ZERO, |class| class.poll_hint);
    let mut runs = Vec::new();
    for scenario in scenarios(seed) {
        for strategy in Strategy::ALL {
            runs.push(super::on_one_thread(replay(&scenario, strategy, &classes))??);
        }
    }
    let description = format!(
        "an account of {SLOTS} slots; {JOBS} images wait in the server's own queue, each holding its \
         slot until the server learns that its job ended"
    );
    Ok(JobEndings {
        description,
        hint_ms: hint.as_u64() / NANOS_PER_MS,
        webhook_trip_ms: WEBHOOK_TRIP.as_u64() / NANOS_PER_MS,
        runs,
    })
}

/// The model broke a rule it keeps.
fn broken(rule: String) -> SimulateError {
    SimulateError::Model { shape: SHAPE, rule }
}

/// Replays `scenario` under `strategy`: every job submitted at once, then the clock jumps from one
/// poll or webhook to the next until every job's end is learnt.
async fn replay(scenario: &Scenario, strategy: Strategy, classes: &JobClasses) -> Result<EndingRun, SimulateError> {
    let clock = ManualClock::new();
    let rules = QueueRules::new(SLOTS, PLACES, classes.clone());
    let queue = Arc::new(FairQueue::new(rules, clock.clone() as SharedClock));
    let stop = CancellationToken::new();
    tokio::spawn(queue.clone().dispatch(stop.child_token()));
    let mut model = Model::new(strategy, Cadence::new(classes, strategy.webhooks()));
    let occupancy = || {
        let now = queue.occupancy();
        (now.in_flight, now.waiting)
    };
    let played = async {
        model.submit(&queue, &scenario.lengths).await?;
        settle(occupancy).await;
        model.take_turns(clock.now());
        while !model.running.is_empty() || !model.waiting.is_empty() {
            let Some(at) = model.next_event().filter(|at| *at <= HORIZON) else {
                return Err(broken(format!("{} jobs wait, and no job holds a slot to free", model.waiting.len())));
            };
            clock.advance((at - clock.now()).to_duration());
            model.hear(at);
            // The slots given back reach the jobs waiting for them before the clock moves on.
            settle(occupancy).await;
            model.take_turns(at);
        }
        Ok(())
    };
    let played = played.await;
    stop.cancel();
    played?;
    model.summary(scenario, strategy)
}

/// A job the account runs; it holds its slot until the server learns that it ended.
struct Running {
    submitted: Nanos,
    length: Nanos,
    next_poll: Nanos,
    /// Given back when the job is dropped.
    _slot: AccountSlot,
}

/// A job whose end the server learnt: when it was submitted, ended, and was learnt to have ended.
#[derive(Debug, Clone, Copy)]
struct Ended {
    submitted: Nanos,
    ended: Nanos,
    learnt: Nanos,
}

/// One run's jobs and what the server knows of them.
struct Model {
    strategy: Strategy,
    cadence: Cadence,
    running: Vec<Running>,
    /// Jobs waiting for a slot, in the order submitted: each one's length and its turn.
    waiting: Vec<(Nanos, Turn)>,
    ended: Vec<Ended>,
    polls: u64,
}

impl Model {
    fn new(strategy: Strategy, cadence: Cadence) -> Self {
        Self { strategy, cadence, running: Vec::new(), waiting: Vec::new(), ended: Vec::new(), polls: 0 }
    }

    /// Submits a job of each of `lengths` at once: one starts if a slot is free, else it waits.
    async fn submit(&mut self, queue: &Arc<FairQueue>, lengths: &[Nanos]) -> Result<(), SimulateError> {
        let standing = queue.rules().standing("default", false);
        let flow = Flowing { name: "agent", quantum: 1.0, standing };
        for (n, length) in lengths.iter().enumerate() {
            let place = queue.reserve(IMAGE, standing).map_err(|full| broken(format!("job {n}: {full:?}")))?;
            match place.start_now(&flow).await {
                Ok(slot) => self.started(Nanos::ZERO, *length, slot),
                Err(place) => self.waiting.push((*length, place.enqueue(&flow, &format!("job-{n}")))),
            }
        }
        Ok(())
    }

    /// A job of `length` is submitted `now` in `slot`; its first poll is timed as the server's.
    fn started(&mut self, now: Nanos, length: Nanos, slot: AccountSlot) {
        let next_poll = now + self.cadence.first_poll(IMAGE);
        self.running.push(Running { submitted: now, length, next_poll, _slot: slot });
    }

    /// The jobs whose turn came start `now`; the others keep waiting, in order.
    fn take_turns(&mut self, now: Nanos) {
        for (length, mut turn) in std::mem::take(&mut self.waiting) {
            match turn.try_recv() {
                Ok(slot) => self.started(now, length, slot),
                Err(TryRecvError::Empty) => self.waiting.push((length, turn)),
                // Out of the line without a slot: the summary finds it missing.
                Err(TryRecvError::Closed) => {}
            }
        }
    }

    /// When `job`'s webhook reaches the server, with webhooks on.
    fn webhook_at(&self, job: &Running) -> Option<Nanos> {
        self.strategy.webhooks().then(|| job.submitted + job.length + WEBHOOK_TRIP)
    }

    /// When the next thing happens to a running job: a poll asked, or a webhook heard.
    fn next_event(&self) -> Option<Nanos> {
        let event = |job: &Running| self.webhook_at(job).map_or(job.next_poll, |at| at.min(job.next_poll));
        self.running.iter().map(event).min()
    }

    /// What is due `now`: a webhook heard ends its job; a poll asked at or after the job's end
    /// ends it, and one before times the next. A job learnt to have ended teaches its length (as
    /// the paid API reports it) and gives its slot back.
    fn hear(&mut self, now: Nanos) {
        for mut job in std::mem::take(&mut self.running) {
            let ended = job.submitted + job.length;
            let heard = if self.webhook_at(&job).is_some_and(|at| at <= now) {
                true
            } else if job.next_poll <= now {
                self.polls = self.polls.saturating_add(1);
                now >= ended
            } else {
                self.running.push(job);
                continue;
            };
            if heard {
                if self.strategy.learns() {
                    self.cadence.learn(IMAGE, job.length);
                }
                self.ended.push(Ended { submitted: job.submitted, ended, learnt: now });
            } else {
                job.next_poll = now + self.cadence.next_poll(IMAGE, now - job.submitted);
                self.running.push(job);
            }
        }
    }

    /// The run's figures, once every job's end was learnt; an error if a job is missing or the
    /// account ever ran more than its slots.
    fn summary(&self, scenario: &Scenario, strategy: Strategy) -> Result<EndingRun, SimulateError> {
        let jobs = scenario.lengths.len();
        if self.ended.len() != jobs {
            return Err(broken(format!("{} of {jobs} jobs ended", self.ended.len())));
        }
        let most_at_once = most_running(&self.ended);
        if most_at_once > SLOTS {
            return Err(broken(format!("{most_at_once} jobs ran at once on an account of {SLOTS}")));
        }
        let total = |of: fn(&Ended) -> Nanos| self.ended.iter().map(of).fold(Nanos::ZERO, |sum, t| sum + t);
        let held = total(|job| job.learnt - job.submitted);
        let idle = total(|job| job.learnt - job.ended);
        Ok(EndingRun {
            scenario: scenario.name.to_owned(),
            strategy: strategy.name().to_owned(),
            busy_first_6s: busy_within(&self.ended, FIRST).as_secs_f64(),
            busy_4_to_10s: busy_within(&self.ended, LATER).as_secs_f64(),
            idle_held: if held == Nanos::ZERO { 0.0 } else { idle.as_u64() as f64 / held.as_u64() as f64 },
            polls_per_job: self.polls as f64 / jobs.max(1) as f64,
            last_end_ms: self.ended.iter().map(|job| job.ended).max().unwrap_or(Nanos::ZERO).as_u64() / NANOS_PER_MS,
            most_at_once,
        })
    }
}

/// The slot-time jobs ran upstream within `[from, to)`: each job's run cut to the span, summed.
fn busy_within(jobs: &[Ended], (from, to): (Nanos, Nanos)) -> Nanos {
    jobs.iter().map(|job| job.ended.min(to) - job.submitted.max(from)).fold(Nanos::ZERO, |sum, t| sum + t)
}

/// The most jobs running upstream at any instant: a job runs from its submission until (not
/// including) its end, so one that ends as another starts is not counted with it.
fn most_running(jobs: &[Ended]) -> usize {
    // At one instant, ends (false) sort before starts (true).
    let mut edges: Vec<(Nanos, bool)> =
        jobs.iter().flat_map(|job| [(job.submitted, true), (job.ended, false)]).collect();
    edges.sort_unstable();
    let (mut now, mut most) = (0usize, 0usize);
    for (_, starts) in edges {
        now = if starts { now.saturating_add(1) } else { now.saturating_sub(1) };
        most = most.max(now);
    }
    most
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ended(submitted_ms: u64, ended_ms: u64) -> Ended {
        let (submitted, ended) = (Nanos::from_millis(submitted_ms), Nanos::from_millis(ended_ms));
        Ended { submitted, ended, learnt: ended }
    }

    #[test]
    fn a_job_that_ends_as_another_starts_is_not_running_with_it_and_five_at_once_are_counted() {
        assert_eq!(most_running(&[]), 0);
        let back_to_back: Vec<Ended> = (0..8).map(|i| ended(i / 4 * 1_000, (i / 4 + 1) * 1_000)).collect();
        assert_eq!(most_running(&back_to_back), 4);
        let mut five = back_to_back.clone();
        five.push(ended(999, 1_500));
        assert_eq!(most_running(&five), 5);
    }

    #[test]
    fn busy_slot_time_counts_each_run_cut_to_the_span() {
        let jobs = [ended(0, 1_000), ended(3_500, 4_500), ended(5_000, 12_000), ended(11_000, 12_000)];
        assert_eq!(busy_within(&jobs, LATER), Nanos::from_millis(500 + 5_000));
        assert_eq!(busy_within(&jobs, FIRST), Nanos::from_millis(1_000 + 1_000 + 1_000));
    }

    fn steady(strategy: Strategy) -> EndingRun {
        let config = Config::from_toml("", &crate::mcp::tools::catalogue()).expect("the defaults");
        let report = run(&config, 1).expect("runs");
        let name = strategy.name();
        let run = report.runs.iter().find(|r| r.scenario == "steady" && r.strategy == name);
        run.cloned().unwrap_or_else(|| panic!("steady, {name}"))
    }

    #[test]
    fn a_fixed_poll_holds_each_one_second_job_two_seconds() {
        let run = steady(Strategy::FixedPoll);
        // Four jobs every 2 s: 0, 2 and 4 s in the first 6 s; 4, 6 and 8 s from 4 s to 10 s.
        assert_eq!((run.busy_first_6s, run.busy_4_to_10s, run.idle_held), (12.0, 12.0, 0.5), "{run:?}");
        assert_eq!((run.polls_per_job, run.last_end_ms, run.most_at_once), (1.0, 19_000, 4), "{run:?}");
    }

    #[test]
    fn the_learnt_cadence_polls_once_at_the_expected_end_and_webhooks_free_a_slot_twenty_ms_after() {
        // The first four are polled at the hint (2 s); then every job at 1 s, as it ends.
        let learnt = steady(Strategy::LearntCadence);
        assert_eq!((learnt.polls_per_job, learnt.last_end_ms, learnt.most_at_once), (1.0, 11_000, 4), "{learnt:?}");
        // Started at 3, 4, 5, ..., 10 s: the account busy all through 4-10 s.
        assert!((learnt.busy_4_to_10s - 24.0).abs() < 1e-9, "{learnt:?}");
        // A batch every 1.02 s, no poll ever needed: 0 to 5.10 s, the last 0.9 s inside 6 s.
        let pushed = steady(Strategy::Webhooks);
        assert_eq!((pushed.polls_per_job, pushed.last_end_ms, pushed.most_at_once), (0.0, 10_180, 4), "{pushed:?}");
        assert!((pushed.busy_first_6s - 23.6).abs() < 1e-9, "{pushed:?}");
    }
}
