//! The composition root: builds the shared state once and serves it over a transport.
//!
//! Everything a tool call needs lives in [`AppState`], shared by every session of every
//! transport, so a caller has one budget however many sessions it opens.

use std::sync::Arc;
use std::time::Duration;

use rmcp::ServiceExt;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::clock::{NANOS_PER_MS, NANOS_PER_SEC, SharedClock};
use crate::config::{Backend, Config};
use crate::guard::Guard;
use crate::identity::Identifier;
use crate::mcp::{McpServer, Transport};
use crate::metrics::Metrics;
use crate::mock_upstream::MockUpstream;
use crate::store::{RedisStore, Store};
use crate::upstream::Upstream;
use crate::upstream::backoff::{Backoff, RetryBudget};
use crate::upstream::breaker::Breaker;
use crate::upstream::jobs::{JobRules, Jobs};
use crate::upstream::queue::{FairQueue, QueueRules};

/// State shared by every session.
#[derive(Debug)]
pub struct AppState {
    /// The validated config.
    pub config: Config,
    /// The one clock.
    pub clock: SharedClock,
    /// Names callers (keys, tenants, tiers, trusted proxies); swapped whole by a reload.
    pub identifier: arc_swap::ArcSwap<Identifier>,
    /// Budgets and refusals.
    pub guard: Guard,
    /// What the limits are doing.
    pub metrics: Arc<Metrics>,
    /// The paid API, behind its circuit breaker.
    pub upstream: Arc<Upstream>,
    /// Jobs accepted and not yet forgotten: their slots, the account's fair queue, background polls.
    pub jobs: Arc<Jobs>,
}

impl AppState {
    /// Sets the gauges that are read from live state when `/metrics` is scraped.
    pub fn sample_gauges(&self) {
        use crate::metrics::{ACCOUNT_SLOTS_IN_USE, BREAKER_STATE, JOBS_IN_FLIGHT, QUEUE_DEPTH, STORE_UP};
        use crate::upstream::breaker::BreakerState;
        let occupancy = self.jobs.occupancy();
        // Per flow bucket (a 16-way hash of the tenant or caller, never its name); every bucket
        // is set, so an emptied one reads 0 instead of its last value.
        let mut buckets = [0usize; 16];
        for (flow, waiting) in &occupancy.per_flow {
            buckets[usize::from(crate::identity::bucket_of(flow))] += waiting;
        }
        for (bucket, waiting) in buckets.iter().enumerate() {
            let label = metrics::Label::new("flow_bucket", format!("b{bucket:02}"));
            self.metrics.sample(QUEUE_DEPTH, vec![label], *waiting as f64);
        }
        self.metrics.sample(ACCOUNT_SLOTS_IN_USE, Vec::new(), occupancy.in_flight as f64);
        self.metrics.sample(JOBS_IN_FLIGHT, Vec::new(), self.jobs.in_flight() as f64);
        let breaker = match self.upstream.breaker().state(self.clock.now()) {
            BreakerState::Closed => 0.0,
            BreakerState::HalfOpen => 1.0,
            BreakerState::Open => 2.0,
        };
        self.metrics.sample(BREAKER_STATE, Vec::new(), breaker);
        self.metrics.sample(STORE_UP, Vec::new(), if self.guard.store_up() { 1.0 } else { 0.0 });
    }
}

/// A started server: state, the embedded mock upstream if any, and the housekeeping task.
#[derive(Debug)]
pub struct App {
    state: Arc<AppState>,
    upstream_url: String,
    stop: CancellationToken,
    _mock: Option<MockUpstream>,
}

impl App {
    /// Builds the state, starting the embedded mock upstream when `upstream.url` is empty.
    pub async fn start(config: Config, clock: SharedClock) -> anyhow::Result<Self> {
        let mock = if config.upstream.url.is_empty() {
            let listener = TcpListener::bind("127.0.0.1:0").await?;
            Some(MockUpstream::start(config.mock_upstream.clone(), clock.clone(), listener).await?)
        } else {
            None
        };
        let upstream_url = mock.as_ref().map_or_else(|| config.upstream.url.clone(), |m| m.url.clone());
        let up = &config.upstream;
        let ms = |n: u64| n.saturating_mul(NANOS_PER_MS);
        let timeout = Duration::from_millis(up.timeout_ms);
        let breaker = Breaker::new(up.breaker_failures, ms(up.breaker_cooldown_ms));
        let upstream = Arc::new(Upstream::new(&upstream_url, timeout, breaker, clock.clone())?);
        let metrics = Arc::new(Metrics::new());
        let stop = CancellationToken::new();
        let rules = JobRules {
            image_hint: up.image_poll_seconds.saturating_mul(NANOS_PER_SEC),
            video_hint: up.video_poll_seconds.saturating_mul(NANOS_PER_SEC),
            expiry: up.job_expiry_seconds.saturating_mul(NANOS_PER_SEC),
            backoff: Backoff::new(up.max_attempts, Duration::from_millis(up.max_retry_after_ms)),
            refresh_wait: timeout + Duration::from_secs(1),
        };
        let store = Arc::new(match config.store.backend {
            Backend::Memory => Store::memory(clock.clone()),
            Backend::Redis => {
                let timeout = Duration::from_millis(config.store.timeout_ms);
                let lease = Duration::from_millis(config.store.lease_ms);
                let ca = config.store.redis_ca().map_err(|e| anyhow::anyhow!("store.redis_ca_file: {e}"))?;
                let redis = RedisStore::connect_trusting(&config.store.redis_url, timeout, ca).await?;
                Store::redis(redis.with_lease(lease))
            }
        });
        let queue = Arc::new(
            FairQueue::new(
                QueueRules {
                    max_in_flight: up.max_in_flight,
                    video_gap: ms(up.video_min_gap_ms),
                    max_waiting: up.queue_max,
                    max_videos_waiting: up.video_queue_max,
                },
                clock.clone(),
            )
            .shared_in(store.clone()),
        );
        tokio::spawn(queue.clone().dispatch(stop.child_token()));
        let jobs = Arc::new(
            Jobs::new(
                upstream.clone(),
                queue,
                RetryBudget::new(up.retry_budget_ratio, up.retry_budget_min_retries, ms(up.retry_budget_window_ms)),
                rules,
                clock.clone(),
                metrics.clone(),
                stop.child_token(),
            )
            .published_in(store.redis_store().cloned()),
        );
        let guard = Guard::new(store, clock.clone(), &config, metrics.clone());
        let state = Arc::new(AppState {
            identifier: arc_swap::ArcSwap::from_pointee(Identifier::new(&config)),
            guard,
            metrics,
            upstream,
            jobs,
            clock,
            config,
        });
        tokio::spawn(sweep_forever(state.clone(), stop.clone()));
        if let Some(every) = state.guard.store().renew_every() {
            tokio::spawn(renew_forever(state.clone(), every, stop.clone()));
            tokio::spawn(answer_cancel_requests_forever(state.clone(), stop.clone()));
            tokio::spawn(hear_operators_forever(state.clone(), stop.clone()));
        }
        Ok(Self { state, upstream_url, stop, _mock: mock })
    }

    /// The shared state (for tests and embedding).
    pub fn state(&self) -> &Arc<AppState> {
        &self.state
    }

    /// Where the tools send their upstream calls.
    pub fn upstream_url(&self) -> &str {
        &self.upstream_url
    }

    /// The axum app for the HTTP transport.
    pub fn router(&self) -> axum::Router {
        crate::http::router(self.state.clone(), self.stop.clone())
    }

    /// Serves HTTP on `listener` until [`App::stop`] is called, with the header deadline of
    /// `[server]` (see [`crate::http::serve`]).
    pub async fn serve_http(&self, listener: TcpListener) -> std::io::Result<()> {
        let headers_within = self.state.config.server.header_read_timeout;
        crate::http::serve::serve(listener, self.router(), headers_within, self.stop.clone()).await;
        Ok(())
    }

    /// Serves the admin API on `listener` until [`App::stop`] is called; `None` when no
    /// `admin.key` is configured (the admin API is off).
    pub fn serve_admin(&self, listener: TcpListener) -> Option<impl Future<Output = std::io::Result<()>> + use<>> {
        let key = self.state.config.admin.key_sha256?;
        let app = crate::admin::router(self.state.clone(), key);
        let stop = self.stop.clone();
        Some(async move { axum::serve(listener, app).with_graceful_shutdown(stop.cancelled_owned()).await })
    }

    /// Serves MCP over stdin/stdout until the client closes it.
    pub async fn serve_stdio(&self) -> anyhow::Result<()> {
        let running = McpServer::new(self.state.clone(), Transport::Stdio).serve(rmcp::transport::stdio()).await?;
        running.waiting().await?;
        Ok(())
    }

    /// Reloads the config from `file` on `SIGHUP` and whenever the file changes, until stopped
    /// (see [`crate::reload`]).
    pub fn reload_on_change(&self, file: Option<std::path::PathBuf>) {
        tokio::spawn(crate::reload::watch(self.state.clone(), file, self.stop.child_token()));
    }

    /// Stops serving and the background tasks.
    pub fn stop(&self) {
        self.stop.cancel();
    }
}

impl Drop for App {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Renews the in-flight leases this instance holds in a shared store. On the wall clock: the
/// leases run out on Redis's clock, whatever the server's clock says.
async fn renew_forever(state: Arc<AppState>, every: Duration, stop: CancellationToken) {
    let mut tick = tokio::time::interval(every.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {
                if let Err(error) = state.guard.store().renew_leases().await {
                    tracing::warn!(%error, "could not renew in-flight leases");
                }
            }
        }
    }
}

/// Cancels this instance's jobs that an agent asked another instance to cancel. On the wall
/// clock, like the leases: the request comes from another process.
async fn answer_cancel_requests_forever(state: Arc<AppState>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(crate::upstream::jobs::CANCEL_REQUESTS_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {
                if let Err(error) = state.jobs.answer_cancel_requests().await {
                    tracing::debug!(%error, "could not read the cancel requests");
                }
            }
        }
    }
}

/// Forgets this instance's remembered refusals when an operator gave budget back through any
/// instance's admin API (see `guard::operator`). On the wall clock: the news comes from another
/// process.
async fn hear_operators_forever(state: Arc<AppState>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(crate::guard::operator::HEAR_OPERATORS_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seen = 0;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => match state.guard.hear_operators(seen).await {
                Ok(now) => seen = now,
                Err(error) => tracing::debug!(%error, "could not read the operators' refunds and resets"),
            },
        }
    }
}

async fn sweep_forever(state: Arc<AppState>, stop: CancellationToken) {
    let mut every = tokio::time::interval(Duration::from_millis(state.config.store.sweep_interval_ms));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = every.tick() => {
                let keys = state.guard.sweep();
                let jobs = state.jobs.sweep();
                if keys + jobs > 0 {
                    tracing::debug!(keys, jobs, "swept idle state");
                }
            }
        }
    }
}
