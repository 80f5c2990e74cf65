//! `many_instances`: three instances of the server behind a load balancer, one upstream account of
//! 4 one-second jobs, one shared store. Each instance is the server's own [`FairQueue`] (its
//! dispatcher a task on a current-thread runtime over a [`ManualClock`]), all three on one
//! [`SharedMemory`]: the twin of the Redis store's line (`line.lua`, the suite both pass) and of
//! its freed-slot channel. Every scenario runs twice:
//!
//! - **one line**: as over Redis today, every instance's waiting jobs stand in one line, and a
//!   slot freed on any instance is told to every other at once;
//! - **a queue each**: the same store keeping no line ([`SharedMemory::slots_only`]): each
//!   instance queues its own jobs, claims the account's slot in the store, and, never told that
//!   one was freed elsewhere, asks again a second later (how the server was before the line, and
//!   how it is on a shared store without one).
//!
//! The upstream is a model: a job runs one second from its submission and holds its account slot
//! until then (the account never refuses: the limit in front of it is exact). The clock moves in
//! steps of 10 ms; nothing is random.
//!
//! Scenarios: **busy** (three tenants, one per instance, each submit 10 images at once: how much
//! of the account runs while work waits, and never over 4), **handoff** (the slots C frees must
//! reach the jobs waiting on A and B), **turns** (tenant x queues 12 images
//! on A and 12 on B, then tenant y one on C: how long y waits), **priority** (`[upstream.reserved]
//! pro = 0.5`: two free tenants flood A and B, 12 images each, then a pro caller submits 2 on C:
//! how long pro waits).

use std::fmt::Write as _;
use std::sync::Arc;

use serde::Serialize;
use tokio::sync::oneshot::error::TryRecvError;
use tokio_util::sync::CancellationToken;

use crate::clock::{Clock, ManualClock, NANOS_PER_MS, Nanos, SharedClock};
use crate::ops::metrics::Metrics;
use crate::simulate::{SimulateError, settle};
use crate::store::{SharedMemory, Store};
use crate::upstream::classes::JobClasses;
use crate::upstream::queue::{AccountSlot, FairQueue, Flowing, QueueRules, TierRule, Turn};

/// The account's slots.
const SLOTS: usize = 4;
/// How long a job runs upstream.
const JOB: Nanos = Nanos::from_secs(1);
/// How far the clock moves at a time.
const STEP: Nanos = Nanos::from_millis(10);
/// The instances.
const INSTANCES: usize = 3;
/// The places of each instance's queue: more than any scenario waits.
const PLACES: usize = 100;
/// How long a scenario runs at most.
const HORIZON: Nanos = Nanos::from_secs(60);
/// The span the account's use is counted over for `started_in_6s`.
const FIRST: Nanos = Nanos::from_secs(6);

/// One way the instances share the account.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sharing {
    Line,
    QueueEach,
}

impl Sharing {
    fn name(self) -> &'static str {
        match self {
            Sharing::Line => "one line",
            Sharing::QueueEach => "a queue each",
        }
    }
}

/// Who submits what, where and when.
#[derive(Debug, Clone, Copy)]
struct Batch {
    /// The instance it reaches (0 = A).
    instance: usize,
    /// Its tenant (the flow).
    tenant: &'static str,
    /// Its tier.
    tier: &'static str,
    /// Images.
    jobs: usize,
    /// When, in milliseconds from the start.
    at_ms: u64,
    /// Whether its waits are the figure the scenario is about.
    watched: bool,
}

/// A scenario: its name, what happens, its batches, and the tiers it reserves.
struct Scenario {
    name: &'static str,
    description: &'static str,
    batches: Vec<Batch>,
    pro_reserved: f64,
}

fn scenarios() -> Vec<Scenario> {
    let batch = |instance, tenant, tier, jobs, at_ms, watched| Batch { instance, tenant, tier, jobs, at_ms, watched };
    vec![
        Scenario {
            name: "busy",
            description: "three tenants, one per instance, each submit 10 images at once",
            batches: (0..INSTANCES).map(|i| batch(i, ["a", "b", "c"][i], "default", 10, 0, false)).collect(),
            pro_reserved: 0.0,
        },
        Scenario {
            name: "handoff",
            description: "tenant c runs 4 images on C, then tenant x queues 12 on A and 12 on B",
            batches: vec![batch(2, "c", "default", 4, 0, false), batch(0, "x", "default", 12, 300, false), {
                batch(1, "x", "default", 12, 300, false)
            }],
            pro_reserved: 0.0,
        },
        Scenario {
            name: "turns",
            description: "tenant x queues 12 images on A and 12 on B, then tenant y one on C",
            batches: vec![batch(0, "x", "default", 12, 0, false), batch(1, "x", "default", 12, 0, false), {
                batch(2, "y", "default", 1, 100, true)
            }],
            pro_reserved: 0.0,
        },
        Scenario {
            name: "priority",
            description: "pro reserved 0.5; free tenants queue 12 images on A and 12 on B, then pro 2 on C",
            batches: vec![
                batch(0, "f1", "default", 12, 0, false),
                batch(1, "f2", "default", 12, 0, false),
                batch(2, "p", "pro", 2, 500, true),
            ],
            pro_reserved: 0.5,
        },
    ]
}

/// One scenario under one way of sharing.
#[derive(Debug, Clone, Serialize)]
pub struct InstancesRun {
    /// `busy`, `turns` or `priority`.
    pub scenario: String,
    /// `one line` or `a queue each`.
    pub sharing: String,
    /// The account's slots in use over the time any job waited, over all its slots then (1.0:
    /// every slot busy whenever work waited).
    pub utilization: f64,
    /// Jobs started in the first 6 s (the account can start 24).
    pub started_in_6s: u64,
    /// The most jobs running at once, all instances together.
    pub most_at_once: usize,
    /// The longest a watched job (y's, pro's) waited from its call to its start, in ms.
    pub watched_wait_ms: Option<u64>,
    /// When the last job started, in ms.
    pub last_start_ms: u64,
}

/// `many_instances`: every scenario under each way of sharing.
#[derive(Debug, Clone, Serialize)]
pub struct ManyInstances {
    /// Instances, the account's slots and a job's length.
    pub description: String,
    /// Each scenario with one line, then with a queue each.
    pub runs: Vec<InstancesRun>,
}

impl ManyInstances {
    /// Jobs submitted in all.
    pub fn calls(&self) -> u64 {
        let per: u64 = scenarios().iter().flat_map(|s| &s.batches).map(|b| b.jobs as u64).sum();
        per.saturating_mul(2)
    }

    pub(crate) fn write_text(&self, out: &mut String) {
        let _ = writeln!(out);
        let _ = writeln!(out, "many_instances: {}", self.description);
        for scenario in scenarios() {
            let _ = writeln!(out, "  {}: {}", scenario.name, scenario.description);
        }
        let _ = writeln!(
            out,
            "  {:<10} {:<13} {:>12} {:>14} {:>13} {:>14} {:>11}",
            "scenario", "sharing", "utilization", "started in 6s", "most at once", "watched wait", "last start"
        );
        for r in &self.runs {
            let watched = r.watched_wait_ms.map_or_else(|| "-".to_owned(), |ms| format!("{:.2} s", ms as f64 / 1000.0));
            let _ = writeln!(
                out,
                "  {:<10} {:<13} {:>11.1}% {:>14} {:>13} {:>14} {:>9.2} s",
                r.scenario,
                r.sharing,
                r.utilization * 100.0,
                r.started_in_6s,
                r.most_at_once,
                watched,
                r.last_start_ms as f64 / 1000.0
            );
        }
    }
}

/// Runs every scenario with one line and with a queue each, each on its own runtime and clock.
pub(crate) fn run() -> Result<ManyInstances, SimulateError> {
    let mut runs = Vec::new();
    for scenario in scenarios() {
        for sharing in [Sharing::Line, Sharing::QueueEach] {
            runs.push(super::on_one_thread(replay(&scenario, sharing))?);
        }
    }
    let description = format!(
        "{INSTANCES} instances, one shared store, an account of {SLOTS} one-second jobs; \
         one line (as over Redis) against a queue each"
    );
    Ok(ManyInstances { description, runs })
}

/// A job on its way: where it waits, and when it was asked for.
struct Pending {
    submitted: Nanos,
    watched: bool,
    turn: Turn,
}

/// What a replay counts of the jobs that started.
#[derive(Default)]
struct Tally {
    running: Vec<(Nanos, AccountSlot)>,
    started: usize,
    started_in_6s: u64,
    /// The longest a watched job waited (0 for one that started at once).
    watched_wait: Option<Nanos>,
    last_start: Nanos,
}

impl Tally {
    /// A job starts `now` in `slot`, having waited `waited` if it is watched.
    fn started(&mut self, now: Nanos, slot: AccountSlot, waited: Option<Nanos>) {
        self.started += 1;
        self.running.push((now + JOB, slot));
        if let Some(waited) = waited {
            self.watched_wait = Some(self.watched_wait.map_or(waited, |w| w.max(waited)));
        }
        self.last_start = now;
        self.started_in_6s += u64::from(now < FIRST);
    }
}

/// Each instance's queue over the one store, dispatching until `stop`.
fn queues_of(
    scenario: &Scenario,
    store: &Arc<dyn Store>,
    clock: &SharedClock,
    stop: &CancellationToken,
) -> Vec<Arc<FairQueue>> {
    let tiers = if scenario.pro_reserved > 0.0 {
        vec![TierRule { name: "pro".into(), reserved: scenario.pro_reserved, rank: 0 }]
    } else {
        Vec::new()
    };
    (0..INSTANCES)
        .map(|_| {
            let rules = QueueRules::new(SLOTS, PLACES, JobClasses::one("image")).with_tiers(tiers.clone());
            let queue = Arc::new(FairQueue::new(rules, clock.clone()).shared_in(
                store.clone(),
                "upstream",
                Arc::new(Metrics::default()),
            ));
            tokio::spawn(queue.clone().dispatch(stop.child_token()));
            queue
        })
        .collect()
}

async fn replay(scenario: &Scenario, sharing: Sharing) -> InstancesRun {
    let clock = ManualClock::new();
    let store: Arc<dyn Store> = match sharing {
        Sharing::Line => Arc::new(SharedMemory::on(clock.clone())),
        Sharing::QueueEach => Arc::new(SharedMemory::slots_only(clock.clone())),
    };
    let stop = CancellationToken::new();
    let queues = queues_of(scenario, &store, &(clock.clone() as SharedClock), &stop);
    let mut batches = scenario.batches.clone();
    batches.sort_by_key(|b| b.at_ms);
    let mut pending: Vec<Pending> = Vec::new();
    let mut tally = Tally::default();
    let (mut used, mut offered, mut most) = (0u128, 0u128, 0usize);
    let mut next_id = 0u64;
    let total: usize = batches.iter().map(|b| b.jobs).sum();
    let progress = |queues: &[Arc<FairQueue>]| -> Vec<(usize, usize)> {
        queues.iter().map(|q| q.occupancy()).map(|o| (o.in_flight, o.waiting)).collect()
    };
    loop {
        let now = clock.now();
        // Jobs that end give their slots back (and, with the line, say so).
        tally.running.retain(|(until, _)| *until > now);
        settle(|| progress(&queues)).await;
        // Calls that arrive now: a job goes at once if it may, else it waits its turn.
        while let Some(batch) = batches.first().copied().filter(|b| Nanos::from_millis(b.at_ms) <= now) {
            batches.remove(0);
            let queue = &queues[batch.instance];
            let standing = queue.rules().standing(batch.tier, false);
            let flow = Flowing { name: batch.tenant, quantum: 1.0, standing };
            for _ in 0..batch.jobs {
                next_id += 1;
                let Ok(place) = queue.reserve(JobClasses::ONLY, standing) else { continue };
                match place.start_now(&flow).await {
                    Ok(slot) => tally.started(now, slot, batch.watched.then_some(Nanos::ZERO)),
                    Err(place) => {
                        let turn = place.enqueue(&flow, &format!("{}-{next_id}", batch.tenant));
                        pending.push(Pending { submitted: now, watched: batch.watched, turn });
                    }
                }
            }
            settle(|| progress(&queues)).await;
        }
        // Turns that came: those jobs start now.
        pending.retain_mut(|job| match job.turn.try_recv() {
            Ok(slot) => {
                tally.started(now, slot, job.watched.then(|| now - job.submitted));
                false
            }
            Err(TryRecvError::Empty) => true,
            Err(TryRecvError::Closed) => false,
        });
        most = most.max(tally.running.len());
        if !pending.is_empty() {
            offered += (SLOTS as u128) * u128::from(STEP.as_u64());
            used += (tally.running.len().min(SLOTS) as u128) * u128::from(STEP.as_u64());
        }
        if (tally.started >= total && batches.is_empty()) || now >= HORIZON {
            break;
        }
        clock.advance(STEP.to_duration());
    }
    stop.cancel();
    InstancesRun {
        scenario: scenario.name.to_owned(),
        sharing: sharing.name().to_owned(),
        utilization: if offered == 0 { 1.0 } else { used as f64 / offered as f64 },
        started_in_6s: tally.started_in_6s,
        most_at_once: most,
        watched_wait_ms: tally.watched_wait.map(|w| w.as_u64() / NANOS_PER_MS),
        last_start_ms: tally.last_start.as_u64() / NANOS_PER_MS,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_keeps_the_account_busy_and_a_single_job_waits_one_job_at_most_where_a_queue_each_does_not() {
        let report = run().expect("runs");
        let of = |scenario: &str, sharing: Sharing| {
            report
                .runs
                .iter()
                .find(|r| r.scenario == scenario && r.sharing == sharing.name())
                .unwrap_or_else(|| panic!("{scenario} {}", sharing.name()))
        };
        for run in &report.runs {
            assert!(run.most_at_once <= SLOTS, "never over the account: {run:?}");
        }
        for scenario in ["busy", "handoff", "turns", "priority"] {
            let line = of(scenario, Sharing::Line);
            assert!(line.utilization >= 0.95, "{line:?}");
            assert_eq!(line.started_in_6s, 24, "{line:?}");
        }
        // y's one job and pro's two start in the first slots freed (1 s), wherever they wait.
        for scenario in ["turns", "priority"] {
            let (line, each) = (of(scenario, Sharing::Line), of(scenario, Sharing::QueueEach));
            assert!(line.watched_wait_ms.is_some_and(|ms| ms <= 1000), "{line:?}");
            assert!(each.watched_wait_ms.is_some_and(|ms| ms >= 5000), "behind the backlog on its own: {each:?}");
        }
        let text = {
            let mut out = String::new();
            report.write_text(&mut out);
            out
        };
        assert!(text.contains("many_instances") && text.contains("a queue each"), "{text}");
    }
}
