//! `identical_asks`: many agents asking the same paid read at once and again, with identical calls
//! coalesced (or not) and answers kept (or not): the upstream requests each setting makes, the
//! requests it saves, and what each caller is charged.
//!
//! Each call goes the way every door of the server sends it, through the one guarded call
//! ([`Guard::call`](crate::guard::Guard::call)): admitted first (which charges it the tool's
//! cost, whoever asks upstream), then its work shared through a real [`Reuse`] as the tool's
//! policy says — the first of identical calls in flight asks, the
//! others wait for its answer, and a kept answer serves until its time is up. Every task runs on a
//! current-thread runtime over a [`ManualClock`]; the upstream is a model that answers a read
//! 500 ms after it is asked and counts the requests. Nothing is random.
//!
//! Ten agents call: each twice at once (two parallel tool calls of one turn), once more 2 s later
//! (within a 5 s cache) and once more at 8 s (after it): four identical calls a caller, so loop
//! detection (on; five in a row) never stops one. They are one tenant's, then five of each of two
//! tenants'.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::clock::{Clock, ManualClock, NANOS_PER_MS, Nanos};
use crate::config::{ApiKey, Coalesce, Config, ToolPolicy};
use crate::guard::reuse::Reuse;
use crate::guard::{Answer, Call, Called, Plain, Worked};
use crate::identity::{Caller, CallerIds};
use crate::ops::metrics::Metrics;
use crate::simulate::shapes::secs;
use crate::simulate::{SimulateError, settle, span};

/// The paid read the agents ask.
const TOOL: &str = "list_articles";
/// Agents in all, shared equally by the tenants.
const AGENTS: usize = 10;
/// How long the upstream takes to answer a read.
const READ_TAKES: Nanos = Nanos::from_millis(500);
/// How long a kept answer serves, where one is kept.
const CACHE_TTL_MS: u64 = 5_000;
/// When the agents call (milliseconds from the start), and how many identical calls each makes
/// then: twice at once, again within the cache's time, again after it.
const ROUNDS: [(u64, usize); 3] = [(0, 2), (2_000, 1), (8_000, 1)];
/// The settings compared: coalescing, and how long an answer is kept.
const SETTINGS: [(Coalesce, u64); 5] = [
    (Coalesce::Off, 0),
    (Coalesce::Caller, 0),
    (Coalesce::Tenant, 0),
    (Coalesce::Off, CACHE_TTL_MS),
    (Coalesce::Tenant, CACHE_TTL_MS),
];
/// The agents belong to one tenant, then to two.
const TENANTS: [usize; 2] = [1, 2];

/// One setting with one split of the agents into tenants.
#[derive(Debug, Clone, Serialize)]
pub struct AskRun {
    /// `coalesce`: `off`, `caller` or `tenant`.
    pub coalesce: &'static str,
    /// `cache_ttl_ms` (0: no answer kept).
    pub cache_ttl_ms: u64,
    /// Tenants the agents belong to.
    pub tenants: usize,
    /// Calls made.
    pub calls: u64,
    /// Calls the guard refused (none while the budgets and loop detection allow the calls).
    pub refused: u64,
    /// Requests the upstream received.
    pub upstream_requests: u64,
    /// Of them, in each round.
    pub requests_per_round: Vec<u64>,
    /// Calls answered by an identical call's request in flight.
    pub coalesced: u64,
    /// Calls answered by a kept answer.
    pub cached: u64,
    /// Cost units the guard charged each agent, in agent order.
    pub charged_per_caller: Vec<u64>,
}

impl AskRun {
    /// Cost units charged, every agent together.
    pub fn charged(&self) -> u64 {
        self.charged_per_caller.iter().fold(0, |all, c| all.saturating_add(*c))
    }

    /// The setting, as in config: `coalesce = "tenant", cache_ttl_ms = 5000`.
    fn setting(&self) -> String {
        match self.cache_ttl_ms {
            0 => format!("coalesce = \"{}\"", self.coalesce),
            ttl => format!("coalesce = \"{}\", cache_ttl_ms = {ttl}", self.coalesce),
        }
    }
}

/// `identical_asks` under every setting, for one tenant and for two.
#[derive(Debug, Clone, Serialize)]
pub struct IdenticalAsks {
    /// What happens, with this config's numbers.
    pub description: String,
    /// The tool called.
    pub tool: String,
    /// Its cost.
    pub cost: u64,
    /// When the agents call, in milliseconds from the start.
    pub rounds_ms: Vec<u64>,
    /// One run per setting and split into tenants.
    pub runs: Vec<AskRun>,
}

/// Replays the identical asks under every setting, for one tenant and for two, each on its own
/// runtime, clock and guard.
pub(crate) fn run(config: &Config) -> Result<IdenticalAsks, SimulateError> {
    let policy = config.limiting.tools.get(TOOL).cloned().unwrap_or_else(|| ToolPolicy::unlisted(1));
    let mut runs = Vec::with_capacity(SETTINGS.len() * TENANTS.len());
    for tenants in TENANTS {
        for (coalesce, cache_ttl_ms) in SETTINGS {
            let policy = ToolPolicy { coalesce, cache_ttl_ms, ..policy.clone() };
            runs.push(super::on_one_thread(replay(config, policy, tenants))?);
        }
    }
    let rounds: Vec<String> = ROUNDS.iter().skip(1).map(|(at, _)| span(*at)).collect();
    let description = format!(
        "{AGENTS} agents call {TOOL} (cost {}) with the same arguments: each twice at once, then once at {}; \
         the upstream answers in {}; one tenant, then two",
        policy.cost,
        rounds.join(" and at "),
        secs(READ_TAKES),
    );
    Ok(IdenticalAsks {
        description,
        tool: TOOL.to_owned(),
        cost: policy.cost,
        rounds_ms: ROUNDS.iter().map(|(at, _)| *at).collect(),
        runs,
    })
}

/// The upstream: it answers a read [`READ_TAKES`] after it is asked, and counts the requests.
#[derive(Default)]
struct Reads {
    asked: AtomicU64,
    /// When each request is answered.
    answers_at: Mutex<Vec<Nanos>>,
}

impl Reads {
    /// The next instant after `now` a request is answered.
    fn next_answer(&self, now: Nanos) -> Option<Nanos> {
        let answers = self.answers_at.lock().unwrap_or_else(|p| p.into_inner());
        answers.iter().copied().filter(|at| *at > now).min()
    }
}

/// Counts of the calls as they end.
#[derive(Default)]
struct Ended {
    calls: AtomicU64,
    refused: AtomicU64,
}

/// Agent `index` of `tenants` tenants: its own key, its tenant's budget.
fn agent(index: usize, tenants: usize, ids: &CallerIds) -> Caller {
    let key = ApiKey {
        sha256: Sha256::digest(format!("simulated-agent-{index}").as_bytes()).into(),
        tenant: Some(format!("tenant-{}", index % tenants.max(1))),
        tier: "default".to_owned(),
        caller: None,
    };
    Caller::of_key(&key, ids)
}

/// One setting (`policy`) with the agents split among `tenants` tenants.
async fn replay(config: &Config, policy: ToolPolicy, tenants: usize) -> AskRun {
    let clock = ManualClock::new();
    // The setting is the tool's policy, as a config would give it.
    let mut config = config.clone();
    config.limiting.tools.insert(TOOL.to_owned(), policy.clone());
    let guard = Arc::new(super::guard(&config, clock.clone()));
    let up = &config.upstream;
    let reuse: Arc<Reuse<Worked<Read>>> =
        Reuse::new(clock.clone(), Arc::new(Metrics::default()), up.cache_max_entries, up.cache_max_bytes);
    let reads = Arc::new(Reads::default());
    let ended = Arc::new(Ended::default());
    let ids = CallerIds::of(&config.limiting);
    let agents: Vec<Caller> = (0..AGENTS).map(|i| agent(i, tenants, &ids)).collect();
    let charged: Arc<Vec<AtomicU64>> = Arc::new((0..AGENTS).map(|_| AtomicU64::new(0)).collect());
    let args = match serde_json::json!({ "query": "rate limiting", "limit": 10 }) {
        serde_json::Value::Object(args) => args,
        _ => serde_json::Map::new(),
    };
    // What moves while the woken tasks run: settled once none of it changes.
    let progress = || (ended.calls.load(Ordering::SeqCst), reads.asked.load(Ordering::SeqCst), reuse.saved());
    let mut calls = 0u64;
    let mut requests_per_round = Vec::with_capacity(ROUNDS.len());
    for (at_ms, times) in ROUNDS {
        let before = reads.asked.load(Ordering::SeqCst);
        walk(&clock, &reads, Nanos::from_millis(at_ms), progress).await;
        for (index, caller) in agents.iter().enumerate() {
            for _ in 0..times {
                calls = calls.saturating_add(1);
                let (guard, reuse, reads, ended, charged) =
                    (guard.clone(), reuse.clone(), reads.clone(), ended.clone(), charged.clone());
                let (caller, policy, args, clock) = (caller.clone(), policy.clone(), args.clone(), clock.clone());
                tokio::spawn(async move {
                    let call = Call::new(TOOL, &caller, &args);
                    // The one guarded call, as a door runs it: admitted (and charged), then one
                    // read, shared with identical calls as the setting allows.
                    let work = |_, _: &serde_json::Value| async move { Worked::Answer(read(reads, clock).await) };
                    match guard.call(&Plain, Some(&reuse), call, work).await {
                        Called::Answered { .. } => {
                            if let Some(units) = charged.get(index) {
                                units.fetch_add(policy.cost, Ordering::SeqCst);
                            }
                        }
                        _ => {
                            ended.refused.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    ended.calls.fetch_add(1, Ordering::SeqCst);
                });
            }
        }
        settle(progress).await;
        requests_per_round.push(reads.asked.load(Ordering::SeqCst).saturating_sub(before));
    }
    walk(&clock, &reads, Nanos::MAX, progress).await;
    let saved = reuse.saved();
    AskRun {
        coalesce: match policy.coalesce {
            Coalesce::Off => "off",
            Coalesce::Caller => "caller",
            Coalesce::Tenant => "tenant",
        },
        cache_ttl_ms: policy.cache_ttl_ms,
        tenants,
        calls,
        refused: ended.refused.load(Ordering::SeqCst),
        upstream_requests: reads.asked.load(Ordering::SeqCst),
        requests_per_round,
        coalesced: saved.coalesced,
        cached: saved.cached,
        charged_per_caller: charged.iter().map(|c| c.load(Ordering::SeqCst)).collect(),
    }
}

/// A read's answer, kept for identical calls (8 bytes, as a number); nothing reported of what it
/// used (each call is charged its cost).
#[derive(Debug, Clone, Copy)]
struct Read;

impl Answer for Read {
    fn keepable(&self) -> Option<u64> {
        Some(8)
    }
}

/// A read: one upstream request, answered [`READ_TAKES`] later on the clock.
async fn read(reads: Arc<Reads>, clock: Arc<ManualClock>) -> Read {
    reads.asked.fetch_add(1, Ordering::SeqCst);
    let at = clock.now() + READ_TAKES;
    reads.answers_at.lock().unwrap_or_else(|p| p.into_inner()).push(at);
    clock.sleep_until(at).await;
    Read
}

/// Moves the clock to `until` (at most), stopping at every answer on the way and letting what it
/// wakes run.
async fn walk<P: PartialEq>(clock: &ManualClock, reads: &Reads, until: Nanos, progress: impl Fn() -> P) {
    while let Some(next) = reads.next_answer(clock.now()).filter(|at| *at <= until) {
        clock.advance((next - clock.now()).to_duration());
        settle(&progress).await;
    }
    if until != Nanos::MAX && until > clock.now() {
        clock.advance((until - clock.now()).to_duration());
        settle(&progress).await;
    }
}

impl IdenticalAsks {
    /// Calls made in every run together.
    pub(crate) fn calls(&self) -> u64 {
        self.runs.iter().map(|r| r.calls).sum()
    }

    /// The table: one row per setting and split into tenants.
    pub(crate) fn write_text(&self, out: &mut String) {
        let last = ROUNDS.last().map_or(0, |(at, _)| *at).saturating_add(READ_TAKES.as_u64() / NANOS_PER_MS);
        let _ = writeln!(out);
        let _ = writeln!(out, "identical_asks ({}): {}", span(last), self.description);
        let _ = writeln!(
            out,
            "  calls     each passes the guard (which charges it), then the server's coalescing and cache"
        );
        let _ =
            writeln!(out, "  requests  what reached the upstream, in all and at each round; coalesced: answered by");
        let _ = writeln!(out, "            another's request in flight; cached: by a kept answer; charged: cost units");
        let rounds: Vec<String> = self.rounds_ms.iter().map(|at| format!("at {}", span(*at))).collect();
        let _ = writeln!(
            out,
            "  {:<43} {:>7} {:>6} {:>8} {:>7} {:>7} {:>7} {:>9} {:>6} {:>8} {:>7}",
            "setting",
            "tenants",
            "calls",
            "requests",
            rounds.first().map_or("", String::as_str),
            rounds.get(1).map_or("", String::as_str),
            rounds.get(2).map_or("", String::as_str),
            "coalesced",
            "cached",
            "charged",
            "in all"
        );
        for run in &self.runs {
            let low = run.charged_per_caller.iter().min().copied().unwrap_or(0);
            let high = run.charged_per_caller.iter().max().copied().unwrap_or(0);
            let each = if low == high { format!("{low} each") } else { format!("{low}-{high}") };
            let per_round = |i: usize| run.requests_per_round.get(i).map_or(String::new(), u64::to_string);
            let _ = writeln!(
                out,
                "  {:<43} {:>7} {:>6} {:>8} {:>7} {:>7} {:>7} {:>9} {:>6} {:>8} {:>7}",
                run.setting(),
                run.tenants,
                run.calls,
                run.upstream_requests,
                per_round(0),
                per_round(1),
                per_round(2),
                run.coalesced,
                run.cached,
                each,
                run.charged()
            );
        }
    }
}
