//! Decisions through [`RedisStore`], against what a bare Redis round trip allows on the same
//! machine in the same run. The driver of `scripts/bench-redis.sh`, which starts the Redis, runs
//! `redis-benchmark` for the floor and prints the table; method and results: `BENCHMARKS.md`,
//! section "Redis store".
//!
//! One mode per invocation; each prints its figures on `RESULT` lines:
//! * `throughput URL TASKS SCOPES SECONDS` — TASKS tokio tasks share one `RedisStore` (one
//!   multiplexed connection, as in the server), each deciding on keys of its own, back to back:
//!   1 s of warm-up, then SECONDS measured. SCOPES 0: an EVALSHA of `return 1` on one shared
//!   `ConnectionManager` instead, the same client with nothing for Redis to do.
//! * `latency URL SECONDS` — one task, sequential, cycling through a `SET` on a
//!   `ConnectionManager` configured as the store's, an `EVALSHA` of `return 1` on that same
//!   connection, a one-scope and a three-scope decision; so drift in the machine hits all four
//!   alike. 0.5 s of warm-up, then SECONDS measured; p50, p90, p99 and mean of each.
//!
//! **Scopes**: one is the caller's token bucket; three are the caller's and the tenant's token
//! buckets plus a tool budget in a fixed window, under one hash tag as the guard names them.
//! Limits are generous, so every decision is allowed (counted: a refusal or an error fails the
//! run) and every decision writes its state back, the dearer path.
//!
//! With `REDIS_PID` set, Redis's CPU time over the measured window is reported too
//! (`/proc/PID/stat`, in ticks of `CLK_TCK`, default 100 per second), and the driver's own.
//!
//! Under `cargo test` (no mode given) every mode runs for a moment against a private
//! `redis-server`, so the bench is known to work; under a bare `cargo bench` it only says how
//! to run it.

#[path = "../tests/common/redis.rs"]
mod test_redis;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use mcp_ratelimit::limit::{FixedWindow, Limiter, TokenBucket};
use mcp_ratelimit::store::{Check, RedisStore};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};

/// The store timeout: far above any latency here, so a timeout means something broke.
const TIMEOUT: Duration = Duration::from_secs(2);
const THROUGHPUT_WARM_UP: Duration = Duration::from_secs(1);
const LATENCY_WARM_UP: Duration = Duration::from_millis(500);

/// The three budgets of a three-scope decision (the first alone is the one-scope decision):
/// never exhausted at the rates one Redis can serve.
struct Budgets {
    caller: Limiter,
    tenant: Limiter,
    tool: Limiter,
}

impl Budgets {
    fn generous() -> Self {
        Self {
            // 1,000,000 tokens, refilled at 1,000,000 a second.
            caller: Limiter::TokenBucket(TokenBucket::new(1_000_000, 1_000_000.0)),
            tenant: Limiter::TokenBucket(TokenBucket::new(1_000_000, 1_000_000.0)),
            // 1,000,000,000 calls a second.
            tool: Limiter::FixedWindow(FixedWindow::new(1_000_000_000, mcp_ratelimit::clock::Nanos::from_secs(1))),
        }
    }
}

/// The state keys of one task, named as `guard::scope` names them: one hash tag for all.
struct Keys {
    caller: String,
    tenant: String,
    tool: String,
}

impl Keys {
    fn new(run: u64, task: usize) -> Self {
        let tag = format!("{{t:bench-{run:x}-{task}}}");
        Self {
            caller: format!("{tag}caller:tok:{:016x}", (task as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)),
            tenant: format!("{tag}tenant:bench-{task}"),
            tool: format!("{tag}tenant:bench-{task}:tool:generate_image"),
        }
    }

    fn checks<'a>(&'a self, budgets: &'a Budgets, scopes: usize) -> Vec<Check<'a>> {
        let all = [
            Check { key: &self.caller, limiter: &budgets.caller, cost: 1, shadow: false },
            Check { key: &self.tenant, limiter: &budgets.tenant, cost: 1, shadow: false },
            Check { key: &self.tool, limiter: &budgets.tool, cost: 1, shadow: false },
        ];
        all[..scopes].to_vec()
    }
}

/// A key prefix of this run's own, so state left by an earlier run is never read.
fn run_id() -> u64 {
    rand::random()
}

/// CPU seconds (user + system) `pid` has used, from `/proc/PID/stat`.
fn cpu_seconds(pid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses: utime is the 12th, stime the 13th.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    let per_second: f64 = std::env::var("CLK_TCK").ok().and_then(|t| t.parse().ok()).unwrap_or(100.0);
    Some(ticks / per_second)
}

/// The driver's and Redis's CPU seconds so far (Redis's only when `REDIS_PID` names it).
fn cpu_now() -> (f64, Option<f64>) {
    let redis = std::env::var("REDIS_PID").ok().and_then(|pid| cpu_seconds(&pid));
    (cpu_seconds("self").unwrap_or(0.0), redis)
}

/// `client_cpu_s=… redis_cpu_s=…` for a window, as the script reads them.
fn cpu_fields(before: (f64, Option<f64>), after: (f64, Option<f64>)) -> String {
    let redis = match (before.1, after.1) {
        (Some(b), Some(a)) => format!("{:.3}", a - b),
        _ => "na".to_owned(),
    };
    format!("client_cpu_s={:.3} redis_cpu_s={redis}", after.0 - before.0)
}

/// A `ConnectionManager` configured as `RedisStore::connect` configures the store's.
async fn connection(url: &str) -> anyhow::Result<ConnectionManager> {
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(TIMEOUT))
        .set_response_timeout(Some(TIMEOUT))
        .set_number_of_retries(1);
    Ok(ConnectionManager::new_with_config(redis::Client::open(url)?, config).await?)
}

/// TASKS tasks on one store, each deciding back to back until stopped; returns the decisions
/// per second over the measured window. With zero scopes the tasks share one `ConnectionManager`
/// instead and each call is an EVALSHA of `return 1`: the same client with no work in Redis.
async fn throughput(url: String, tasks: usize, scopes: usize, seconds: f64) -> anyhow::Result<f64> {
    if scopes > 3 {
        bail!("scopes must be 0 (EVALSHA of `return 1`), 1, 2 or 3, not {scopes}");
    }
    let store = Arc::new(RedisStore::connect(&url, TIMEOUT).await.context("connecting the store")?);
    let return_1 = Arc::new(redis::Script::new("return 1"));
    let shared = connection(&url).await?;
    let decided = Arc::new(AtomicU64::new(0));
    let refused = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let run = run_id();
    let mut workers = Vec::with_capacity(tasks);
    for task in 0..tasks {
        let (store, decided, refused, stop) = (store.clone(), decided.clone(), refused.clone(), stop.clone());
        let (return_1, mut connection) = (return_1.clone(), shared.clone());
        workers.push(tokio::spawn(async move {
            let (keys, budgets) = (Keys::new(run, task), Budgets::generous());
            while !stop.load(Ordering::Relaxed) {
                let allowed = if scopes == 0 {
                    return_1.invoke_async::<_, i64>(&mut connection).await? == 1
                } else {
                    store.decide(&keys.checks(&budgets, scopes)).await?.iter().all(|d| d.allowed)
                };
                let counter = if allowed { &decided } else { &refused };
                counter.fetch_add(1, Ordering::Relaxed);
            }
            anyhow::Ok(())
        }));
    }
    tokio::time::sleep(THROUGHPUT_WARM_UP).await;
    let (n0, t0, cpu0) = (decided.load(Ordering::Relaxed), Instant::now(), cpu_now());
    tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
    let (n1, t1, cpu1) = (decided.load(Ordering::Relaxed), Instant::now(), cpu_now());
    stop.store(true, Ordering::Relaxed);
    for worker in workers {
        worker.await.context("a deciding task panicked")?.context("a decision failed")?;
    }
    let refused = refused.load(Ordering::Relaxed);
    if refused > 0 {
        bail!("{refused} decisions were refused: the budgets are meant never to run out");
    }
    let elapsed = (t1 - t0).as_secs_f64();
    let per_second = (n1 - n0) as f64 / elapsed;
    println!(
        "RESULT throughput scopes={scopes} tasks={tasks} workers={} decisions={} seconds={elapsed:.3} per_sec={per_second:.0} {}",
        tokio::runtime::Handle::current().metrics().num_workers(),
        n1 - n0,
        cpu_fields(cpu0, cpu1),
    );
    Ok(per_second)
}

/// What the latency run times, in the order it cycles through them.
const LATENCY_KINDS: [&str; 4] = ["set", "evalsha_return_1", "decide_1_scope", "decide_3_scopes"];

/// One task, sequential: each kind in turn, timed one call at a time. Returns each kind's p50 in µs.
async fn latency(url: String, seconds: f64) -> anyhow::Result<Vec<f64>> {
    let store = RedisStore::connect(&url, TIMEOUT).await.context("connecting the store")?;
    let mut manager = connection(&url).await?;
    let return_1 = redis::Script::new("return 1");
    let run = run_id();
    let (set_key, one_scope, three_scopes) = (Keys::new(run, 0).caller, Keys::new(run, 1), Keys::new(run, 2));
    let budgets = Budgets::generous();
    // About the size of a token bucket's state.
    let value = "token_bucket 999999000000000 1767225600333333";

    let mut samples: [Vec<u64>; 4] = Default::default();
    let started = Instant::now();
    let measure_from = started + LATENCY_WARM_UP;
    let until = measure_from + Duration::from_secs_f64(seconds);
    let mut cpu0 = None;
    loop {
        let now = Instant::now();
        if now >= until {
            break;
        }
        let measuring = now >= measure_from;
        if measuring && cpu0.is_none() {
            cpu0 = Some(cpu_now());
        }
        for (kind, samples) in samples.iter_mut().enumerate() {
            let start = Instant::now();
            match kind {
                0 => redis::cmd("SET").arg(&set_key).arg(value).exec_async(&mut manager).await?,
                1 => {
                    let one: i64 = return_1.invoke_async(&mut manager).await?;
                    assert_eq!(one, 1);
                }
                _ => {
                    let (keys, scopes) = if kind == 2 { (&one_scope, 1) } else { (&three_scopes, 3) };
                    let decisions = store.decide(&keys.checks(&budgets, scopes)).await?;
                    if !decisions.iter().all(|d| d.allowed) {
                        bail!("a decision was refused: the budgets are meant never to run out");
                    }
                }
            }
            if measuring {
                samples.push(start.elapsed().as_nanos() as u64);
            }
        }
    }
    let cpu = cpu_fields(cpu0.unwrap_or_else(cpu_now), cpu_now());
    let mut p50s = Vec::new();
    for (kind, samples) in LATENCY_KINDS.iter().zip(samples.iter_mut()) {
        samples.sort_unstable();
        if samples.is_empty() {
            bail!("no {kind} was measured");
        }
        let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize] as f64 / 1_000.0;
        let mean = samples.iter().sum::<u64>() as f64 / samples.len() as f64 / 1_000.0;
        println!(
            "RESULT latency kind={kind} n={} p50_us={:.1} p90_us={:.1} p99_us={:.1} mean_us={mean:.1} {cpu}",
            samples.len(),
            at(0.5),
            at(0.9),
            at(0.99),
        );
        p50s.push(at(0.5));
    }
    Ok(p50s)
}

fn runtime() -> tokio::runtime::Runtime {
    // As many workers as CPUs this process may use (one under `taskset -c 1`).
    tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("a tokio runtime")
}

/// Every mode for a moment against a private Redis: the bench still runs.
fn smoke() {
    let redis = test_redis::TestRedis::private();
    let runtime = runtime();
    for scopes in [0, 1, 3] {
        let per_second = runtime
            .block_on(async { tokio::spawn(throughput(redis.url.clone(), 4, scopes, 0.2)).await })
            .expect("the throughput task")
            .expect("the throughput mode runs");
        assert!(per_second > 0.0, "no decision in 0.2 s");
    }
    let url = redis.url.clone();
    let p50s = runtime.block_on(async { tokio::spawn(latency(url, 0.2)).await });
    assert_eq!(p50s.expect("the latency task").expect("the latency mode runs").len(), LATENCY_KINDS.len());
}

fn parse<T: std::str::FromStr>(value: Option<&String>, what: &str) -> anyhow::Result<T> {
    value.with_context(|| format!("missing {what}"))?.parse().map_err(|_| anyhow::anyhow!("{what} is not a number"))
}

fn main() -> anyhow::Result<()> {
    // `cargo bench` adds `--bench`; flags are not ours.
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let Some(mode) = args.first() else {
        if std::env::args().any(|a| a == "--bench") {
            eprintln!("redis_store: run scripts/bench-redis.sh (it starts a Redis and prints the table)");
        } else {
            smoke();
        }
        return Ok(());
    };
    let url = args.get(1).context("missing the Redis URL")?.clone();
    let runtime = runtime();
    match mode.as_str() {
        "throughput" => {
            let tasks = parse(args.get(2), "TASKS")?;
            let scopes = parse(args.get(3), "SCOPES")?;
            let seconds = parse(args.get(4), "SECONDS")?;
            runtime.block_on(async { tokio::spawn(throughput(url, tasks, scopes, seconds)).await })??;
        }
        "latency" => {
            let seconds = parse(args.get(2), "SECONDS")?;
            runtime.block_on(async { tokio::spawn(latency(url, seconds)).await })??;
        }
        other => bail!("unknown mode {other}: throughput URL TASKS SCOPES SECONDS | latency URL SECONDS"),
    }
    Ok(())
}
