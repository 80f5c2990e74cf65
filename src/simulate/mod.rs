//! `mcp-ratelimit simulate`: agent traffic replayed against the configured budgets.
//!
//! Each [`Shape`] is an agent — steady, bursty, fanning out, retrying, looping for hours — and
//! each run replays one shape against one algorithm on a [`ManualClock`], through a real
//! [`Guard`] on a memory store: the same one guarded call ([`Guard::call`]) every door of the
//! server runs, so the tables show what the server would decide, not what a model of it says. Hours of
//! agent time take milliseconds, and the only randomness is a seeded RNG's, so one seed always
//! prints the same numbers.
//!
//! To compare algorithms rather than configs, a run puts one algorithm in place of every rate
//! scope the simulated call draws on (the `tools/call` method, caller, tenant, address and the
//! tool's own budget) and keeps each scope's capacity and rate: a bucket of `burst` refilling at
//! `rate` becomes a window of `burst` units per `burst / rate` seconds, and back. In-flight caps
//! are slot counts, not rates, and stay as configured; `concurrency` cannot stand in for a rate
//! and is reported as not simulated.
//!
//! Every simulated call has arguments of its own, so loop detection (which would stop a loop of
//! identical calls long before any budget) stays on and never fires: the simulator is about the
//! budgets. The coarse HTTP limit in front of `/mcp` is a different layer and is not replayed.
//!
//! Six [`UpstreamShape`]s replay what budgets alone do not show, each with its own model and
//! table: the account's capacity dropping under a busy agent, the static cap against each adaptive
//! learner ([`capacity_drop`]); many agents asking the same paid read, with and without coalescing
//! and a cache ([`identical_asks`]); how soon a job's slot comes back, by a fixed poll, the learnt
//! cadence or webhooks ([`job_endings`]); three instances sharing one account ([`many_instances`]); and
//! two agents whose answers decide whether they loop — one paraphrasing a search that stays empty,
//! one polling a job that moves ([`result_loops`]). They run the server's own queue, learner,
//! answer sharing and loop detection on a current-thread runtime over a [`ManualClock`], so they
//! too take milliseconds and print the same numbers for a seed.

pub mod capacity_drop;
pub mod chart;
pub mod identical_asks;
pub mod job_endings;
pub mod many_instances;
mod report;
pub mod result_loops;
pub mod shapes;

use std::collections::VecDeque;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::clock::{Clock, ManualClock, NANOS_PER_MS, NANOS_PER_SEC, Nanos, SharedClock};
use crate::config::Config;
use crate::guard::{Admitted, Call, Called, Guard, Plain, Worked};
use crate::identity::{Caller, CallerIds, Identifier, Identity};
use crate::limit::{self, ALGORITHMS, Limiter, period_of};
use crate::mcp::tools::{job_class, starts_job};
use crate::ops::metrics::Metrics;
use crate::store::MemoryStore;
use crate::upstream::classes::{ClassId, VIDEO};
pub use report::{Budget, Budgets, Report, Run, ScopeLine, ShapeReport, Skipped};
pub(crate) use report::{span, trimmed};
use shapes::Outcome;
pub use shapes::{SHAPES, Shape};

/// Why `concurrency` is not run: it cannot hold a budget per time.
const NOT_A_RATE: &str = "a slot cap (work in flight), not a rate";

/// A shape that replays the upstream's side rather than one agent against the budgets: each has
/// its own model and table, and runs once (not once per algorithm).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamShape {
    /// The account's capacity drops mid-run, then partly returns: the static cap against each
    /// adaptive learner ([`capacity_drop`]).
    CapacityDrop,
    /// Many agents ask the same paid read at once and again: coalescing and reuse against neither
    /// ([`identical_asks`]).
    IdenticalAsks,
    /// An account's slots held until the server learns each job ended: a fixed poll, the learnt
    /// cadence and webhooks ([`job_endings`]).
    JobEndings,
    /// Three instances share one account through one store: one line against a queue each
    /// ([`many_instances`]).
    ManyInstances,
    /// An agent rephrases a search that keeps coming back empty: loops found by their answers
    /// ([`result_loops`]).
    ParaphrasingSearcher,
    /// An agent polls a job whose answer moves on every poll: a repeated call that is progress,
    /// not a loop ([`result_loops`]).
    PollingWithProgress,
}

/// Every upstream shape, in the order they are run and printed (after the budget shapes).
pub const UPSTREAM_SHAPES: [UpstreamShape; 6] = [
    UpstreamShape::CapacityDrop,
    UpstreamShape::IdenticalAsks,
    UpstreamShape::JobEndings,
    UpstreamShape::ManyInstances,
    UpstreamShape::ParaphrasingSearcher,
    UpstreamShape::PollingWithProgress,
];

impl UpstreamShape {
    /// The name used on the command line, in the tables and as a chart's file name.
    pub fn name(self) -> &'static str {
        match self {
            UpstreamShape::CapacityDrop => "capacity_drop",
            UpstreamShape::IdenticalAsks => "identical_asks",
            UpstreamShape::JobEndings => "job_endings",
            UpstreamShape::ManyInstances => "many_instances",
            UpstreamShape::ParaphrasingSearcher => "paraphrasing_searcher",
            UpstreamShape::PollingWithProgress => "polling_with_progress",
        }
    }

    /// The upstream shape called `name`, if there is one.
    pub fn from_name(name: &str) -> Option<UpstreamShape> {
        UPSTREAM_SHAPES.into_iter().find(|shape| shape.name() == name)
    }
}

/// What to simulate.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The budget shapes to replay, in order.
    pub shapes: Vec<Shape>,
    /// The upstream shapes to replay, in order, after them.
    pub upstream: Vec<UpstreamShape>,
    /// The algorithms to compare (names from [`ALGORITHMS`]), in order.
    pub algorithms: Vec<String>,
    /// The tool the agent calls; `None`: the costliest tool that answers at once.
    pub tool: Option<String>,
    /// Seeds every random draw.
    pub seed: u64,
}

impl Plan {
    /// Every budget shape against every algorithm, with the default tool, and every upstream
    /// shape.
    pub fn everything(seed: u64) -> Self {
        Self {
            shapes: SHAPES.to_vec(),
            upstream: UPSTREAM_SHAPES.to_vec(),
            algorithms: ALGORITHMS.iter().map(|a| (*a).to_owned()).collect(),
            tool: None,
            seed,
        }
    }
}

/// A simulation that cannot run, or whose charts cannot be written.
#[derive(Debug, thiserror::Error)]
pub enum SimulateError {
    /// An algorithm name not in [`ALGORITHMS`].
    #[error("unknown algorithm `{0}`; the algorithms are {known}", known = ALGORITHMS.join(", "))]
    UnknownAlgorithm(String),
    /// A tool the config does not have.
    #[error("unknown tool `{tool}`; the tools are {}", known.join(", "))]
    UnknownTool {
        /// The name asked for.
        tool: String,
        /// The tools there are.
        known: Vec<String>,
    },
    /// A tool that costs nothing: no budget would ever stop it.
    #[error("`{0}` costs nothing (cost 0), so no budget limits it; choose a tool with a cost, e.g. save_article")]
    FreeTool(String),
    /// No tool has a cost in this config.
    #[error("no tool has a cost in this config: there is no budget to simulate")]
    NothingPaid,
    /// Every scope the tool draws on is an in-flight cap.
    #[error("every budget `{0}` draws on is an in-flight cap: nothing limits it per time")]
    NoRate(String),
    /// The simulated caller could not be named (it needs a key the config accepts).
    #[error("cannot name the simulated caller: {0}")]
    Caller(#[from] crate::identity::Unauthorized),
    /// A chart could not be drawn or written.
    #[error("cannot write the chart {path}: {message}")]
    Chart {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// The runtime an upstream shape's tasks run on could not be started.
    #[error("cannot start the runtime the upstream shapes run on: {0}")]
    Runtime(String),
    /// An upstream shape's model broke a rule it keeps (a fault in the model, or in the server's
    /// part it runs): its numbers would be wrong, so none are printed.
    #[error("the {shape} model broke its own rule: {rule}")]
    Model {
        /// The upstream shape.
        shape: &'static str,
        /// What went wrong.
        rule: String,
    },
}

impl SimulateError {
    /// Whether the command line asked for something that cannot be (exit code 2), rather than
    /// the simulation failing to run or to write its output.
    pub fn is_usage(&self) -> bool {
        !matches!(self, SimulateError::Chart { .. } | SimulateError::Runtime(_) | SimulateError::Model { .. })
    }
}

/// The names of every shape, budget and upstream ones, for the command line.
pub fn shape_names() -> Vec<&'static str> {
    SHAPES.iter().map(|s| s.name()).chain(UPSTREAM_SHAPES.iter().map(|s| s.name())).collect()
}

/// Replays every budget shape of `plan` against every algorithm of it, under `config`'s budgets,
/// then its upstream shapes, under `config`'s upstream settings.
pub fn run(config: &Config, plan: &Plan) -> Result<Report, SimulateError> {
    let algorithms = plan
        .algorithms
        .iter()
        .map(|name| {
            ALGORITHMS.iter().copied().find(|a| a == name).ok_or_else(|| SimulateError::UnknownAlgorithm(name.clone()))
        })
        .collect::<Result<Vec<&'static str>, _>>()?;
    let budgets = if plan.shapes.is_empty() { None } else { Some(budget_shapes(config, plan, &algorithms)?) };
    let wants = |shape: UpstreamShape| plan.upstream.contains(&shape);
    let capacity_drop =
        wants(UpstreamShape::CapacityDrop).then(|| capacity_drop::run(config, plan.seed)).transpose()?;
    let identical_asks = wants(UpstreamShape::IdenticalAsks).then(|| identical_asks::run(config)).transpose()?;
    let job_endings = wants(UpstreamShape::JobEndings).then(|| job_endings::run(config, plan.seed)).transpose()?;
    let many_instances = wants(UpstreamShape::ManyInstances).then(many_instances::run).transpose()?;
    let (searcher, poller) = (wants(UpstreamShape::ParaphrasingSearcher), wants(UpstreamShape::PollingWithProgress));
    let result_loops = (searcher || poller).then(|| result_loops::run(config, searcher, poller)).transpose()?;
    Ok(Report { seed: plan.seed, budgets, capacity_drop, identical_asks, job_endings, many_instances, result_loops })
}

/// Replays every budget shape of `plan` against each of `algorithms`.
fn budget_shapes(config: &Config, plan: &Plan, algorithms: &[&'static str]) -> Result<Budgets, SimulateError> {
    let tool = pick_tool(config, plan.tool.as_deref())?;
    let cost = config.limiting.tools.get(tool).map_or(0, |t| t.cost);
    let (caller, who) = simulated_caller(config)?;
    let starts_job = starts_job(tool);

    let configured = guard(config, ManualClock::new());
    let drawn = configured.scopes_of(&caller, tool, starts_job);
    let scopes: Vec<ScopeLine> = drawn
        .iter()
        .map(|(scope, limit, units)| ScopeLine {
            scope: scope.name().to_owned(),
            algorithm: limit.limiter.algorithm(),
            parameters: limit.limiter.describe(),
            units_per_call: *units,
        })
        .collect();
    let binding = Budget::binding(drawn.iter().map(|(scope, limit, units)| (scope.name(), &limit.limiter, *units)))
        .ok_or_else(|| SimulateError::NoRate(tool.to_owned()))?;

    let variants: Vec<(&'static str, Result<Config, &'static str>)> =
        algorithms.iter().map(|a| (*a, with_algorithm(config, tool, a))).collect();
    let job = job_class(tool).map(|class| job_duration(config, class));
    let replays: Vec<(Shape, &'static str, Replay<'_>)> = plan
        .shapes
        .iter()
        .flat_map(|shape| variants.iter().map(move |(algorithm, variant)| (*shape, *algorithm, variant)))
        .filter_map(|(shape, algorithm, variant)| {
            let config = variant.as_ref().ok()?;
            let bucket = bucket_for(shape.horizon(&binding));
            let seed = seed_of(plan.seed, shape);
            Some((shape, algorithm, Replay { config, caller: &caller, tool, cost, job, bucket, seed }))
        })
        .collect();
    let mut runs = replay_all(&replays, &binding).into_iter();
    let mut shapes = Vec::with_capacity(plan.shapes.len());
    for shape in &plan.shapes {
        let horizon = shape.horizon(&binding);
        let mut report = ShapeReport {
            shape: shape.name(),
            description: shape.describe(&binding),
            horizon_ms: horizon.as_u64() / NANOS_PER_MS,
            bucket_ms: bucket_for(horizon).as_u64() / NANOS_PER_MS,
            runs: Vec::new(),
            not_simulated: Vec::new(),
            chart: None,
        };
        for (algorithm, variant) in &variants {
            match variant {
                Ok(_) => report.runs.extend(runs.next()),
                Err(reason) => report.not_simulated.push(Skipped { algorithm, reason }),
            }
        }
        shapes.push(report);
    }
    Ok(Budgets {
        tool: tool.to_owned(),
        cost,
        caller: who,
        scopes,
        binding,
        loop_detection: config.limiting.loop_detection.enabled,
        limits_enabled: config.limiting.limits.enabled,
        shapes,
    })
}

/// Runs every replay, spread over the machine's cores (each run is independent: its own clock,
/// store and guard), and returns the runs in the order given.
fn replay_all(replays: &[(Shape, &'static str, Replay<'_>)], budget: &Budget) -> Vec<Run> {
    let next = AtomicUsize::new(0);
    let done = Mutex::new(Vec::with_capacity(replays.len()));
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(replays.len());
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                loop {
                    let index = next.fetch_add(1, Ordering::Relaxed);
                    let Some((shape, algorithm, replay)) = replays.get(index) else { return };
                    // The memory store never waits, so the guard's futures complete on first poll.
                    let run = futures::executor::block_on(replay.run(algorithm, *shape, budget));
                    done.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push((index, run));
                }
            });
        }
    });
    let mut done = done.into_inner().unwrap_or_else(|poisoned| poisoned.into_inner());
    done.sort_by_key(|(index, _)| *index);
    done.into_iter().map(|(_, run)| run).collect()
}

/// A guard on its own memory store and `clock`: what the server builds, minus the transports.
fn guard(config: &Config, clock: Arc<ManualClock>) -> Guard {
    let clock: SharedClock = clock;
    Guard::new(Arc::new(MemoryStore::on(clock.clone())), clock, &config.limiting, Arc::new(Metrics::default()))
}

/// Each shape's draws depend on the seed and the shape alone, so every algorithm meets the same
/// open-loop traffic and a shape run alone prints what it prints in the full run.
fn seed_of(seed: u64, shape: Shape) -> u64 {
    let index = SHAPES.iter().position(|s| *s == shape).unwrap_or(0) as u64;
    seed ^ (index + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// The tool asked for, or the costliest one that answers at once (a job tool holds in-flight
/// slots, which would mix a slot cap into a comparison of rates).
fn pick_tool<'c>(config: &'c Config, asked: Option<&str>) -> Result<&'c str, SimulateError> {
    if let Some(asked) = asked {
        let Some((name, policy)) = config.limiting.tools.get_key_value(asked) else {
            let known = config.limiting.tools.keys().cloned().collect();
            return Err(SimulateError::UnknownTool { tool: asked.to_owned(), known });
        };
        return if policy.cost == 0 { Err(SimulateError::FreeTool(name.clone())) } else { Ok(name) };
    }
    let paid = || config.limiting.tools.iter().filter(|(_, policy)| policy.cost > 0);
    let costliest = |tools: Vec<(&'c String, u64)>| tools.into_iter().max_by_key(|(_, cost)| *cost).map(|(t, _)| t);
    costliest(paid().filter(|(tool, _)| !starts_job(tool)).map(|(t, p)| (t, p.cost)).collect())
        .or_else(|| costliest(paid().map(|(t, p)| (t, p.cost)).collect()))
        .map(String::as_str)
        .ok_or(SimulateError::NothingPaid)
}

/// The agent: the first configured key (its tenant and tier), or without keys an agent whose key
/// is not configured, named by the server's own [`Identifier`] as it would be over HTTP from
/// loopback (the anonymous tier, and its address's budget too).
fn simulated_caller(config: &Config) -> Result<(Caller, String), SimulateError> {
    if let Some(key) = config.limiting.auth.keys.first() {
        let tenant = key.tenant.as_deref().map_or_else(|| "no tenant".to_owned(), |t| format!("tenant {t}"));
        return Ok((
            Caller::of_key(key, &CallerIds::of(&config.limiting)),
            format!("the first configured key ({tenant}, tier {})", key.tier),
        ));
    }
    let mut headers = http::HeaderMap::new();
    headers.insert(http::header::AUTHORIZATION, http::HeaderValue::from_static("Bearer simulated-agent"));
    let caller = Identifier::new(&config.limiting)
        .identify(&headers, Some(IpAddr::V4(Ipv4Addr::LOCALHOST)))
        .map(Identity::without_verifying)?;
    let who = format!("an agent with a key that is not configured, from 127.0.0.1 (tier {})", caller.tier());
    Ok((caller, who))
}

/// `config` with `algorithm` in place of every rate scope a call of `tool` may draw on, each
/// keeping its capacity and rate; `Err` with the reason when the algorithm cannot hold a rate.
fn with_algorithm(config: &Config, tool: &str, algorithm: &str) -> Result<Config, &'static str> {
    let mut config = config.clone();
    let limits = &mut config.limiting.limits;
    let own = config.limiting.tools.get_mut(tool).map(|t| &mut t.budget);
    for limits in
        [&mut limits.tools_call, &mut limits.caller, &mut limits.tenant, &mut limits.address].into_iter().chain(own)
    {
        for limit in limits.iter_mut() {
            limit.limiter = reshaped(&limit.limiter, algorithm)?;
        }
    }
    Ok(config)
}

/// `limiter`'s budget (capacity, and capacity per span) under `algorithm`. A slot cap has no rate
/// to carry and is kept as it is.
fn reshaped(limiter: &Limiter, algorithm: &str) -> Result<Limiter, &'static str> {
    let Some(span) = limiter.policy_window() else { return Ok(limiter.clone()) };
    let capacity = limiter.capacity();
    let rate = capacity as f64 * NANOS_PER_SEC as f64 / span.as_u64() as f64;
    // A bucket refills the whole capacity over the span; a window counts it per span.
    [limit::Shape::Rate { period: period_of(rate) }, limit::Shape::Window { window: span }]
        .into_iter()
        .find_map(|shape| Limiter::with_shape(algorithm, capacity, shape))
        .ok_or(NOT_A_RATE)
}

/// How long a job of `class` holds its in-flight slots: the mock upstream's job time (its video
/// jobs take `video_job_ms`, every other `image_job_ms`).
fn job_duration(config: &Config, class: ClassId) -> Nanos {
    let ms = if class == VIDEO { config.mock_upstream.video_job_ms } else { config.mock_upstream.image_job_ms };
    Nanos::from_millis(ms)
}

/// A chart bucket of a round length giving at most about 200 points over `horizon`.
fn bucket_for(horizon: Nanos) -> Nanos {
    const ROUND_SECS: [u64; 13] = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600];
    let wanted = Nanos::new(horizon.as_u64().div_ceil(200));
    let secs = ROUND_SECS.into_iter().find(|s| Nanos::from_secs(*s) >= wanted).unwrap_or(3600);
    Nanos::from_secs(secs)
}

/// What one run needs besides the shape.
struct Replay<'a> {
    config: &'a Config,
    caller: &'a Caller,
    tool: &'a str,
    cost: u64,
    /// For a job tool, how long an admission holds its slots.
    job: Option<Nanos>,
    bucket: Nanos,
    seed: u64,
}

impl Replay<'_> {
    /// Replays `shape` through a fresh guard: every call goes through [`Guard::call`] at its
    /// instant on the manual clock; an admission is released when the tool would return (at once)
    /// or, for a job, when the job would be final.
    async fn run(&self, algorithm: &'static str, shape: Shape, budget: &Budget) -> Run {
        let clock = ManualClock::new();
        let guard = guard(self.config, clock.clone());
        let horizon = shape.horizon(budget);
        let mut tally = Tally::new(horizon, self.bucket);
        let mut agent = shape.agent(budget, self.seed);
        let mut jobs = VecDeque::new();
        while let Some(at) = agent.next_call().filter(|at| *at < horizon) {
            clock.advance((at - clock.now()).to_duration());
            while jobs.front().is_some_and(|(done, _)| *done <= at) {
                jobs.pop_front();
            }
            let mut args = serde_json::Map::new();
            args.insert("simulated_call".into(), tally.calls.into());
            let call = Call::new(self.tool, self.caller, &args);
            // The one guarded call, as a door runs it; a job takes its admission (its slots) away
            // with it until the job would be final.
            let mut job = None;
            let work = |admitted: Admitted<()>, _: &serde_json::Value| {
                if self.job.is_some() {
                    job = admitted.admission.take();
                }
                std::future::ready(Worked::Answer(()))
            };
            let answer = match guard.call(&Plain, None, call, work).await {
                Called::Refused(refusal) => {
                    Outcome::Refused { retry_after: refusal.retry_after_ms.map(Nanos::from_millis) }
                }
                _ => Outcome::Admitted,
            };
            if let (Some(lasts), Some(admission)) = (self.job, job) {
                jobs.push_back((at + lasts, admission));
            }
            tally.record(at, answer);
            agent.answered(at, answer);
        }
        tally.into_run(algorithm, self.cost)
    }
}

/// Counts of one run as it goes.
struct Tally {
    calls: u64,
    refused: u64,
    wasted: u64,
    last_refused: bool,
    admitted_at: Vec<Nanos>,
    admitted_per_bucket: Vec<u32>,
    refused_per_bucket: Vec<u32>,
    bucket: Nanos,
}

impl Tally {
    fn new(horizon: Nanos, bucket: Nanos) -> Self {
        let buckets = usize::try_from(horizon / bucket + 1).unwrap_or(0);
        Self {
            calls: 0,
            refused: 0,
            wasted: 0,
            last_refused: false,
            admitted_at: Vec::new(),
            admitted_per_bucket: vec![0; buckets],
            refused_per_bucket: vec![0; buckets],
            bucket,
        }
    }

    fn record(&mut self, at: Nanos, answer: Outcome) {
        self.calls += 1;
        // Buckets are centred on multiples of their length, so a window edge (a multiple of the
        // window, itself a multiple of the bucket by default) falls mid-bucket and the calls just
        // before and just after it are counted together.
        let index = usize::try_from((at + self.bucket / 2) / self.bucket).unwrap_or(usize::MAX);
        let refused = matches!(answer, Outcome::Refused { .. });
        let per_bucket = if refused { &mut self.refused_per_bucket } else { &mut self.admitted_per_bucket };
        if let Some(count) = per_bucket.get_mut(index) {
            *count += 1;
        }
        if refused {
            self.refused += 1;
            self.wasted += u64::from(self.last_refused);
        } else {
            self.admitted_at.push(at);
        }
        self.last_refused = refused;
    }

    fn into_run(self, algorithm: &'static str, cost: u64) -> Run {
        let allowed = self.admitted_at.len() as u64;
        Run {
            algorithm,
            calls: self.calls,
            allowed,
            refused: self.refused,
            wasted: self.wasted,
            spend: allowed * cost,
            peak_per_second: peak(&self.admitted_at, Nanos::from_secs(1)),
            peak_per_minute: peak(&self.admitted_at, Nanos::from_secs(60)),
            admitted_per_bucket: self.admitted_per_bucket,
            refused_per_bucket: self.refused_per_bucket,
        }
    }
}

/// The most instants of `at` (in order) within any span `[t, t + span)`.
fn peak(at: &[Nanos], span: Nanos) -> u64 {
    let mut first = 0;
    let mut most = 0;
    for (last, t) in at.iter().enumerate() {
        while *t - at[first] >= span {
            first += 1;
        }
        most = most.max(last + 1 - first);
    }
    most as u64
}

/// Runs `work` on a current-thread runtime of its own, as the upstream shapes need (the server's
/// queue and answer sharing spawn tasks); their time is a [`ManualClock`], so the runtime needs no
/// timer.
fn on_one_thread<F: Future>(work: F) -> Result<F::Output, SimulateError> {
    let runtime =
        // Time on: the queue's heartbeat to a shared line is kept in real time (it never comes
        // due in a run of milliseconds); every wait that matters is on the ManualClock.
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .map_err(|e| SimulateError::Runtime(e.to_string()))?;
    Ok(runtime.block_on(work))
}

/// How many passes in a row must leave the progress unchanged before an instant counts as done.
const SETTLED_AFTER: u32 = 3;

/// Lets every task woken at the clock's instant run — and the tasks those wake — until `progress`
/// has stood still for [`SETTLED_AFTER`] passes: what the server does at one instant is done
/// before the clock moves on. Each yield lets every task that is ready run once.
async fn settle<P: PartialEq>(mut progress: impl FnMut() -> P) {
    let mut last = progress();
    let mut still = 0;
    while still < SETTLED_AFTER {
        tokio::task::yield_now().await;
        let now = progress();
        if now == last {
            still += 1;
        } else {
            (last, still) = (now, 0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::TokenBucket;

    #[test]
    fn peak_counts_the_fullest_span() {
        let s = Nanos::from_secs(1);
        assert_eq!(peak(&[], s), 0);
        assert_eq!(peak(&[Nanos::ZERO, s / 2, s - Nanos::new(1), s, 3 * s], s), 3, "[0, 1 s) holds three");
        assert_eq!(peak(&[Nanos::new(5); 3], s), 3);
    }

    #[test]
    fn every_shape_name_is_one_shape_of_one_kind_and_everything_runs_them_all() {
        for name in shape_names() {
            let kinds =
                usize::from(Shape::from_name(name).is_some()) + usize::from(UpstreamShape::from_name(name).is_some());
            assert_eq!(kinds, 1, "{name}");
        }
        assert_eq!(shape_names().len(), SHAPES.len() + UPSTREAM_SHAPES.len());
        let plan = Plan::everything(1);
        assert_eq!((plan.shapes.len(), plan.upstream.len()), (SHAPES.len(), UPSTREAM_SHAPES.len()));
        assert_eq!(span(0), "0 s");
    }

    #[test]
    fn a_budget_keeps_its_burst_and_rate_under_every_algorithm() {
        let bucket = Limiter::TokenBucket(TokenBucket::new(60, 1.0));
        for algorithm in ALGORITHMS.iter().filter(|a| **a != "concurrency") {
            let other = reshaped(&bucket, algorithm).expect("a rate algorithm");
            assert_eq!((other.algorithm(), other.capacity()), (*algorithm, 60));
            assert_eq!(other.policy_window(), Some(Nanos::from_secs(60)), "{algorithm}");
            assert_eq!(reshaped(&other, "token_bucket").expect("back"), bucket, "{algorithm} and back");
        }
        assert_eq!(reshaped(&bucket, "concurrency"), Err(NOT_A_RATE));
    }
}
