//! `capacity_drop`: the upstream account's capacity changes under a busy agent, and the account's
//! limit in front of it either stays where it was configured (the static cap,
//! `upstream.max_in_flight`) or is learnt (`[upstream.adaptive]`, each learner in turn).
//!
//! The server's side is its own code: the [`FairQueue`] hands out the account's slots (its
//! dispatcher a task on a current-thread runtime, its waits on a [`ManualClock`]); the learnt limit
//! is the [`AdaptiveLimit`] that [`AdaptiveLimit::configured`] builds from `[upstream.adaptive]`
//! (enabled, with the learner's name), and it learns through the slot each submission used, as the
//! job book teaches it (`accepted` for a job the upstream took, `overloaded` for its 429); a
//! refused job goes back to the front of its flow after the server's [`Backoff`] and within its
//! [`RetryBudget`], or fails. One agent keeps twice the ceiling's jobs pending: a call that finds a
//! slot free and nobody waiting is submitted at once (a 429 goes back to the agent, which asks again
//! after the wait), the others wait in the queue, as `Jobs::start` decides.
//!
//! The upstream is a model (the account's capacity, not the server, is what changes): it runs a job
//! for one second, answers a submission in 100 ms, and refuses a submission while it runs as many
//! jobs as its capacity, with `429 Retry-After: 1`. The server's poll sees a job final when it ends
//! (a poll hint of the job's length), and its slot comes back then. The capacity is 10, 4 then 8
//! tenths of the ceiling, for 15, 30 and 30 seconds. The only randomness is the backoff's jitter,
//! drawn from the seed.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use rand::SeedableRng;
use rand::rngs::StdRng;
use serde::Serialize;
use tokio::sync::oneshot::error::TryRecvError;
use tokio_util::sync::CancellationToken;

use crate::clock::{Clock, ManualClock, NANOS_PER_MS, NANOS_PER_SEC, Nanos, ceil_secs};
use crate::config::{AdaptiveConfig, Config, UpstreamConfig};
use crate::simulate::shapes::secs;
use crate::simulate::{SimulateError, settle, span, trimmed};
use crate::upstream::adaptive::AdaptiveLimit;
use crate::upstream::backoff::{Backoff, Retry, RetryBudget};
use crate::upstream::classes::JobClasses;
use crate::upstream::queue::{AccountSlot, FairQueue, Flowing, QueueRules, Standing, Turn};

/// The learners compared with the static cap, in order: every one `[upstream.adaptive]` offers.
const LEARNERS: &[&str] = crate::upstream::adaptive::ALGORITHMS;

/// The account's capacity in each phase, in tenths of the ceiling, and how long it lasts in seconds.
const PHASES: [(usize, u64); 3] = [(10, 15), (4, 30), (8, 30)];
/// How long the upstream runs a job.
const JOB: Nanos = Nanos::from_secs(1);
/// How long the upstream takes to answer a submission.
const ANSWER: Nanos = Nanos::from_millis(100);
/// The upstream's `Retry-After` on a 429.
const RETRY_AFTER: Duration = Duration::from_secs(1);
/// Jobs the agent keeps pending, per slot of the ceiling: always more than the account runs.
const PENDING_PER_SLOT: usize = 2;
/// The agent's turn: after a round of calls it asks again no sooner (so an instant always ends,
/// even with an upstream that answers in no time and a retry budget of none).
const AGENT_TURN: Nanos = Nanos::from_millis(100);
/// The agent's flow in the fair queue (its tenant).
const FLOW: Flowing<'static> = Flowing { name: "tenant:simulated", quantum: 1.0, standing: Standing::PLAIN };

/// One phase of the account's capacity.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct CapacityPhase {
    /// Jobs the upstream runs at once.
    pub capacity: usize,
    /// When it starts, in milliseconds from the start.
    pub from_ms: u64,
    /// When it ends.
    pub to_ms: u64,
}

impl CapacityPhase {
    fn from(&self) -> Nanos {
        Nanos::from_millis(self.from_ms)
    }

    fn to(&self) -> Nanos {
        Nanos::from_millis(self.to_ms)
    }

    fn contains(&self, at: Nanos) -> bool {
        (self.from()..self.to()).contains(&at)
    }

    /// Jobs the capacity lets the upstream take over `span` nanoseconds of the phase.
    fn allows(&self, span: Nanos) -> f64 {
        self.capacity as f64 * span.as_u64() as f64 / JOB.as_u64() as f64
    }
}

/// What one limit did in one phase.
#[derive(Debug, Clone, Serialize)]
pub struct PhaseOutcome {
    /// The account's capacity.
    pub capacity: usize,
    /// The phase, in milliseconds from the start.
    pub from_ms: u64,
    /// Its end.
    pub to_ms: u64,
    /// Submissions the upstream refused with a 429.
    pub upstream_429s: u64,
    /// Submissions it took.
    pub accepted: u64,
    /// Jobs the server gave up on (attempts or retry budget spent).
    pub failed: u64,
    /// `accepted` over the jobs the capacity allowed in the phase (1.0 = every one).
    pub throughput: f64,
    /// How long after the change the limit first stood at the capacity; `None`: never.
    pub followed_after_ms: Option<u64>,
    /// From then to the phase's end: accepted over what the capacity allowed.
    pub throughput_once_followed: Option<f64>,
    /// From then to the phase's end: the lowest and highest limit.
    pub limit_once_followed: Option<(usize, usize)>,
}

/// The capacity drop under one limit.
#[derive(Debug, Clone, Serialize)]
pub struct LimitRun {
    /// `static` or the learner's name.
    pub limit: String,
    /// One entry per phase.
    pub phases: Vec<PhaseOutcome>,
    /// 429s over the whole run.
    pub upstream_429s: u64,
    /// Jobs the upstream took over the whole run.
    pub accepted: u64,
    /// Jobs failed over the whole run.
    pub failed: u64,
    /// `accepted` over what the capacity allowed over the whole run.
    pub throughput: f64,
    /// The agent's `generate_image` calls.
    pub calls: u64,
    /// The limit as it changed: (milliseconds from the start, slots).
    #[serde(skip)]
    limit_changes: Vec<(u64, usize)>,
    #[serde(skip)]
    refused_per_second: Vec<u32>,
}

impl LimitRun {
    /// The limit as it changed: (milliseconds from the start, slots), the first at 0.
    pub fn limit_over_time(&self) -> &[(u64, usize)] {
        &self.limit_changes
    }

    /// The upstream's 429s in each second of the run.
    pub fn refused_per_second(&self) -> &[u32] {
        &self.refused_per_second
    }
}

/// `capacity_drop` under the static cap and under each learner.
#[derive(Debug, Clone, Serialize)]
pub struct CapacityDrop {
    /// What happens, with this config's numbers.
    pub description: String,
    /// How long it runs, in milliseconds.
    pub horizon_ms: u64,
    /// The static cap (`upstream.max_in_flight`), the learners' ceiling.
    pub ceiling: usize,
    /// The account's capacity over time.
    pub phases: Vec<CapacityPhase>,
    /// The static cap first, then each learner.
    pub runs: Vec<LimitRun>,
    /// Where its chart was written, once it was.
    pub chart: Option<std::path::PathBuf>,
}

/// Replays the capacity drop under the static cap and under each learner of `config`'s
/// `[upstream.adaptive]`, each on its own runtime and clock.
pub(crate) fn run(config: &Config, seed: u64) -> Result<CapacityDrop, SimulateError> {
    let ceiling = config.upstream.max_in_flight.max(1);
    let mut phases = Vec::with_capacity(PHASES.len());
    let mut from_ms = 0u64;
    for (tenths, seconds) in PHASES {
        let to_ms = from_ms.saturating_add(seconds.saturating_mul(1000));
        phases.push(CapacityPhase { capacity: (ceiling.saturating_mul(tenths) / 10).max(1), from_ms, to_ms });
        from_ms = to_ms;
    }
    let setup = Setup { upstream: &config.upstream, ceiling, phases: phases.clone(), seed };
    let mut runs = Vec::with_capacity(LEARNERS.len() + 1);
    for learner in std::iter::once(None).chain(LEARNERS.iter().copied().map(Some)) {
        runs.push(super::on_one_thread(setup.replay(learner))?);
    }
    let phrases: Vec<String> = phases
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let jobs = if i == 0 { " jobs at once" } else { "" };
            format!("{}{jobs} for {}", p.capacity, span(p.to_ms - p.from_ms))
        })
        .collect();
    let description = format!(
        "the account runs {}; one agent keeps {} images pending",
        phrases.join(", then "),
        ceiling.saturating_mul(PENDING_PER_SLOT)
    );
    Ok(CapacityDrop { description, horizon_ms: from_ms, ceiling, phases, runs, chart: None })
}

/// What every run shares: the server's upstream settings, the account's capacity over time, and
/// the seed of the backoff's jitter.
struct Setup<'a> {
    upstream: &'a UpstreamConfig,
    ceiling: usize,
    phases: Vec<CapacityPhase>,
    seed: u64,
}

/// The upstream: its capacity over time and the jobs it runs.
struct Account<'a> {
    phases: &'a [CapacityPhase],
    /// When each job it runs ends.
    running_until: Vec<Nanos>,
}

impl Account<'_> {
    fn capacity_at(&self, at: Nanos) -> usize {
        self.phases.iter().find(|p| p.contains(at)).or(self.phases.last()).map_or(0, |p| p.capacity)
    }

    /// Whether it takes a job submitted at `at`: it does while it runs fewer than its capacity.
    fn takes(&mut self, at: Nanos) -> bool {
        self.running_until.retain(|end| *end > at);
        let room = self.running_until.len() < self.capacity_at(at);
        if room {
            self.running_until.push(at + JOB);
        }
        room
    }
}

/// A job the agent asked for, as the server tracks it.
struct Job {
    /// Its number, in the order the agent asked.
    number: u64,
    /// Submissions of it the upstream refused.
    refused: u32,
    /// Whether its first submission went out (the retry budget counts first attempts).
    sent: bool,
}

impl Job {
    /// Its id in the queue.
    fn id(&self) -> String {
        format!("job{}", self.number)
    }
}

/// A job waiting in the queue for its turn.
struct Waiting {
    turn: Turn,
    job: Job,
    /// Not before this instant (a retry after its backoff).
    not_before: Nanos,
}

/// A submission on its way back, holding its slot.
struct Answering {
    at: Nanos,
    /// When the job ends upstream, if the upstream took it.
    runs_until: Option<Nanos>,
    slot: AccountSlot,
    job: Job,
    /// Submitted by the server from the queue (retried on a 429), or at once in the agent's call
    /// (a 429 goes back to the agent).
    queued: bool,
}

/// What a run saw, as it went.
#[derive(Default)]
struct Record {
    /// The agent's calls.
    calls: u64,
    /// When the upstream took a submission, refused one, and when the server gave a job up.
    accepted_at: Vec<Nanos>,
    refused_at: Vec<Nanos>,
    failed_at: Vec<Nanos>,
    /// The limit as it changed: (when, slots).
    limit_changes: Vec<(Nanos, usize)>,
}

/// One run as it goes: the server's queue (with its learner), backoff and retry budget, the jobs
/// the server tracks, the upstream, and the agent.
struct Replay<'a> {
    clock: Arc<ManualClock>,
    queue: Arc<FairQueue>,
    backoff: Backoff,
    retry_budget: RetryBudget,
    /// The backoff's jitter.
    rng: StdRng,
    /// By job number, so grants are taken in a fixed order.
    waiting: BTreeMap<u64, Waiting>,
    answering: Vec<Answering>,
    /// Jobs the upstream runs, holding their slots until they end.
    running: Vec<(Nanos, AccountSlot)>,
    account: Account<'a>,
    /// Jobs the agent keeps pending; it asks again after a refusal's wait.
    pending_wanted: usize,
    agent_ready_at: Nanos,
    record: Record,
}

impl Setup<'_> {
    /// The run under `learner`, or under the static cap (`None`), built as the server builds its
    /// queue from `[upstream]`, with one class of job (every job here is an image: no gap, no
    /// cap of its own).
    async fn replay(&self, learner: Option<&'static str>) -> LimitRun {
        let up = self.upstream;
        let clock = ManualClock::new();
        let adaptive = learner.and_then(|name| {
            let config = AdaptiveConfig { enabled: true, algorithm: name.to_owned(), ..up.adaptive.clone() };
            AdaptiveLimit::configured(&config, self.ceiling)
        });
        let rules = QueueRules::new(self.ceiling, up.queue_max, JobClasses::one("image"));
        let queue = Arc::new(FairQueue::new(rules, clock.clone()).adaptive(adaptive));
        let stop = CancellationToken::new();
        tokio::spawn(queue.clone().dispatch(stop.clone()));
        let window = Nanos::from_millis(up.retry_budget_window_ms);
        let mut replay = Replay {
            clock: clock.clone(),
            queue: queue.clone(),
            backoff: Backoff::new(up.max_attempts, Duration::from_millis(up.max_retry_after_ms)),
            retry_budget: RetryBudget::new(up.retry_budget_ratio, up.retry_budget_min_retries, window),
            rng: StdRng::seed_from_u64(self.seed),
            waiting: BTreeMap::new(),
            answering: Vec::new(),
            running: Vec::new(),
            account: Account { phases: &self.phases, running_until: Vec::new() },
            pending_wanted: self.ceiling.saturating_mul(PENDING_PER_SLOT),
            agent_ready_at: Nanos::ZERO,
            record: Record { limit_changes: vec![(Nanos::ZERO, queue.slots())], ..Record::default() },
        };
        let horizon = self.phases.last().map_or(Nanos::ZERO, CapacityPhase::to);
        loop {
            replay.instant().await;
            let now = clock.now();
            match replay.next_instant(now) {
                Some(next) if next < horizon => clock.advance((next - now).to_duration()),
                _ => break,
            }
        }
        stop.cancel();
        replay.record.outcome(learner.unwrap_or("static"), &self.phases)
    }
}

impl Replay<'_> {
    /// Everything that happens at the clock's instant, in the order the server meets it: jobs that
    /// end give their slots back, answers arrive and teach the limit, the dispatcher hands out what
    /// it can, the agent asks for more, the dispatcher again.
    async fn instant(&mut self) {
        let now = self.clock.now();
        self.running.retain(|(until, _)| *until > now);
        // Until nothing more is due now (an upstream answering in no time answers at once).
        loop {
            let (due, later): (Vec<Answering>, Vec<Answering>) =
                std::mem::take(&mut self.answering).into_iter().partition(|a| a.at <= now);
            self.answering = later;
            for answer in due {
                self.answered(answer, now).await;
            }
            self.grants(now).await;
            self.agent_asks(now).await;
            self.grants(now).await;
            if self.answering.iter().all(|a| a.at > now) {
                break;
            }
        }
        let limit = self.queue.slots();
        if self.record.limit_changes.last().is_none_or(|(_, last)| *last != limit) {
            self.record.limit_changes.push((now, limit));
        }
    }

    /// The next instant anything happens: a job ends, an answer arrives, a retry may go, the
    /// capacity changes, or the agent may ask again.
    fn next_instant(&self, now: Nanos) -> Option<Nanos> {
        let ends = self.running.iter().map(|(until, _)| *until);
        let answers = self.answering.iter().map(|a| a.at);
        let retries = self.waiting.values().map(|w| w.not_before);
        let phases = self.account.phases.iter().map(CapacityPhase::to);
        let agent = (self.pending() < self.pending_wanted).then_some(self.agent_ready_at);
        ends.chain(answers).chain(retries).chain(phases).chain(agent).filter(|at| *at > now).min()
    }

    fn pending(&self) -> usize {
        self.waiting.len().saturating_add(self.answering.len()).saturating_add(self.running.len())
    }

    /// Lets the dispatcher hand out every slot it can now, and submits the jobs it chose, in the
    /// order they were asked for.
    async fn grants(&mut self, now: Nanos) {
        let queue = self.queue.clone();
        settle(|| queue.occupancy().in_flight).await;
        let mut granted = Vec::new();
        let mut left = Vec::new();
        for (number, waiting) in &mut self.waiting {
            match waiting.turn.try_recv() {
                Ok(slot) => granted.push((*number, slot)),
                Err(TryRecvError::Empty) => {}
                // Only a job that left the line loses its turn; none does here.
                Err(TryRecvError::Closed) => left.push(*number),
            }
        }
        for number in left {
            self.waiting.remove(&number);
        }
        for (number, slot) in granted {
            if let Some(waiting) = self.waiting.remove(&number) {
                self.submit(waiting.job, slot, true, now);
            }
        }
    }

    /// The upstream's answer to a submission: it teaches the limit through the slot, as the job
    /// book does; a taken job holds its slot until it ends, a refused one gives it back and waits
    /// its backoff at the front of its flow (or fails), or goes back to the agent.
    async fn answered(&mut self, answer: Answering, now: Nanos) {
        let Answering { runs_until, slot, mut job, queued, .. } = answer;
        // The retry budget is a share of the first attempts the upstream received.
        if queued && !std::mem::replace(&mut job.sent, true) {
            self.retry_budget.record_request(now);
        }
        if let Some(until) = runs_until {
            slot.accepted().await;
            self.running.push((until, slot));
            return;
        }
        slot.overloaded().await;
        drop(slot);
        if !queued {
            self.agent_ready_at = self.agent_ready_at.max(now + Nanos::from(RETRY_AFTER));
            return;
        }
        job.refused = job.refused.saturating_add(1);
        match self.backoff.after_failure(job.refused, Some(RETRY_AFTER), &mut self.rng) {
            Retry::After(delay) if self.retry_budget.try_retry(now) => {
                let not_before = now + Nanos::from(delay);
                let turn = self.queue.requeue_front(&FLOW, &job.id(), JobClasses::ONLY, not_before);
                self.waiting.insert(job.number, Waiting { turn, job, not_before });
            }
            Retry::After(_) | Retry::GiveUp(_) => self.record.failed_at.push(now),
        }
    }

    /// The agent keeps its jobs pending, a round of calls a turn at most: each call is submitted
    /// at once when a slot is free and nobody waits, else it waits in the queue.
    async fn agent_asks(&mut self, now: Nanos) {
        if now < self.agent_ready_at {
            return;
        }
        if self.pending() < self.pending_wanted {
            self.agent_ready_at = now + AGENT_TURN;
        }
        while self.pending() < self.pending_wanted {
            // A full queue refuses the call (`busy`): the agent asks again at its next turn.
            let Ok(place) = self.queue.reserve(JobClasses::ONLY, Standing::PLAIN) else { return };
            self.record.calls = self.record.calls.saturating_add(1);
            let job = Job { number: self.record.calls, refused: 0, sent: false };
            match place.start_now(&FLOW).await {
                Ok(slot) => self.submit(job, slot, false, now),
                Err(place) => {
                    let turn = place.enqueue(&FLOW, &job.id());
                    self.waiting.insert(job.number, Waiting { turn, job, not_before: Nanos::ZERO });
                }
            }
        }
    }

    /// Sends `job` to the upstream on `slot`; its answer arrives [`ANSWER`] later.
    fn submit(&mut self, job: Job, slot: AccountSlot, queued: bool, now: Nanos) {
        let runs_until = self.account.takes(now).then(|| now + JOB);
        match runs_until {
            Some(_) => self.record.accepted_at.push(now),
            None => self.record.refused_at.push(now),
        }
        self.answering.push(Answering { at: now + ANSWER, runs_until, slot, job, queued });
    }
}

impl Record {
    /// What the run did, phase by phase.
    fn outcome(self, limit: &str, phases: &[CapacityPhase]) -> LimitRun {
        let within =
            |at: &[Nanos], from: Nanos, to: Nanos| at.iter().filter(|t| (from..to).contains(*t)).count() as u64;
        let changes = &self.limit_changes;
        let limit_at = |at: Nanos| changes.iter().take_while(|(t, _)| *t <= at).last().map_or(0, |(_, l)| *l);
        let mut outcomes = Vec::with_capacity(phases.len());
        for phase in phases {
            let (from, to) = (phase.from(), phase.to());
            let followed = if limit_at(from) == phase.capacity {
                Some(from)
            } else {
                changes.iter().find(|(at, l)| phase.contains(*at) && *l == phase.capacity).map(|(at, _)| *at)
            };
            let once = followed.filter(|at| *at < to);
            let limit_once = once.map(|since| {
                let later = changes.iter().filter(|(at, _)| *at > since && *at < to).map(|(_, l)| *l);
                later.fold((limit_at(since), limit_at(since)), |(low, high), l| (low.min(l), high.max(l)))
            });
            let accepted = within(&self.accepted_at, from, to);
            outcomes.push(PhaseOutcome {
                capacity: phase.capacity,
                from_ms: phase.from_ms,
                to_ms: phase.to_ms,
                upstream_429s: within(&self.refused_at, from, to),
                accepted,
                failed: within(&self.failed_at, from, to),
                throughput: accepted as f64 / phase.allows(to - from),
                followed_after_ms: followed.map(|at| (at - from).as_u64() / NANOS_PER_MS),
                throughput_once_followed: once
                    .map(|since| within(&self.accepted_at, since, to) as f64 / phase.allows(to - since)),
                limit_once_followed: limit_once,
            });
        }
        let allowed: f64 = phases.iter().map(|p| p.allows(p.to() - p.from())).sum();
        let horizon_secs = phases.last().map_or(0, |p| ceil_secs(p.to()));
        let mut refused_per_second = vec![0u32; usize::try_from(horizon_secs).unwrap_or(0)];
        for at in &self.refused_at {
            if let Some(count) =
                usize::try_from(at.as_u64() / NANOS_PER_SEC).ok().and_then(|s| refused_per_second.get_mut(s))
            {
                *count = count.saturating_add(1);
            }
        }
        LimitRun {
            limit: limit.to_owned(),
            phases: outcomes,
            upstream_429s: self.refused_at.len() as u64,
            accepted: self.accepted_at.len() as u64,
            failed: self.failed_at.len() as u64,
            throughput: self.accepted_at.len() as f64 / allowed.max(1.0),
            calls: self.calls,
            limit_changes: self.limit_changes.iter().map(|(at, l)| (at.as_u64() / NANOS_PER_MS, *l)).collect(),
            refused_per_second,
        }
    }
}

impl CapacityDrop {
    /// The table: for each limit, one row per phase and one for the whole run.
    pub(crate) fn write_text(&self, out: &mut String) {
        let _ = writeln!(out);
        let _ = writeln!(out, "capacity_drop ({}): {}", span(self.horizon_ms), self.description);
        let _ = writeln!(
            out,
            "  the upstream runs a job {} and answers a submission in {}; over its capacity: 429, Retry-After: {}",
            secs(JOB),
            secs(ANSWER),
            secs(Nanos::from(RETRY_AFTER))
        );
        let _ = writeln!(
            out,
            "  limits      the static cap (upstream.max_in_flight = {}), then each learner of [upstream.adaptive]",
            self.ceiling
        );
        let _ = writeln!(out, "              under it, through the server's fair queue, backoff and retry budget");
        let _ = writeln!(out, "  failed      jobs the server gave up on: out of attempts, or the retry budget spent");
        let _ = writeln!(out, "  throughput  accepted jobs over what the capacity allowed (capacity x time / job)");
        let _ = writeln!(out, "  followed    how long after the change the limit first stood at the capacity");
        let _ = writeln!(
            out,
            "  then        from that instant to the phase's end: the limit (lowest..highest), the throughput"
        );
        let _ = writeln!(
            out,
            "  {:<9} {:<9} {:>8} {:>6} {:>8} {:>6} {:>10} {:>9} {:>6} {:>6}",
            "limit", "phase", "capacity", "429s", "accepted", "failed", "throughput", "followed", "then", "then %"
        );
        for run in &self.runs {
            for phase in &run.phases {
                let followed = match phase.followed_after_ms {
                    Some(0) => "at once".to_owned(),
                    Some(ms) => secs(Nanos::from_millis(ms)),
                    None => "never".to_owned(),
                };
                let then = phase.limit_once_followed.map_or("-".to_owned(), |(low, high)| format!("{low}..{high}"));
                let _ = writeln!(
                    out,
                    "  {:<9} {:<9} {:>8} {:>6} {:>8} {:>6} {:>10} {:>9} {:>6} {:>6}",
                    run.limit,
                    format!("{}-{}", trimmed(phase.from_ms as f64 / 1000.0), span(phase.to_ms)),
                    phase.capacity,
                    phase.upstream_429s,
                    phase.accepted,
                    phase.failed,
                    percent(phase.throughput),
                    followed,
                    then,
                    phase.throughput_once_followed.map_or("-".to_owned(), percent),
                );
            }
            let _ = writeln!(
                out,
                "  {:<9} {:<9} {:>8} {:>6} {:>8} {:>6} {:>10}",
                run.limit,
                "all",
                "",
                run.upstream_429s,
                run.accepted,
                run.failed,
                percent(run.throughput)
            );
        }
    }
}

/// `0.973` as `97 %`.
fn percent(share: f64) -> String {
    format!("{:.0} %", share * 100.0)
}
