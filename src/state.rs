//! The state every session of every transport shares, so a caller has one budget however many
//! sessions it opens: the limits (guard, identity, metrics) and the upstream (client, job book).
//!
//! [`crate::app`] builds it; the MCP handler, the dashboard and the admin API read it. Reloading
//! the config is a change of this state ([`AppState::reload`]); [`crate::reload`] only says when.

use std::path::Path;
use std::sync::Arc;

use crate::breaker::Breaker;
use crate::clock::SharedClock;
use crate::config::Config;
use crate::rate_limits::RateLimits;
use crate::telemetry::bounded::TraceQueue;
use crate::upstream::Upstream;
use crate::upstream::jobs::Jobs;
use crate::upstream::queue::{FairQueue, Occupancy};

/// State shared by every session.
#[derive(Debug)]
pub struct AppState {
    /// The validated config.
    pub config: Config,
    /// The one clock.
    pub clock: SharedClock,
    /// The limits, as any rmcp server uses them: the guard (budgets and refusals), who callers
    /// are, the metrics, and the catalogue of our tools (a reloaded config is checked against it).
    pub limits: RateLimits,
    /// What the guard stands in front of, as the dashboard, the admin API and `/metrics` see it.
    pub behind: Arc<dyn Behind>,
    /// The trace exporter's queue, with `[telemetry]` on: `/metrics` shows what it holds and drops.
    pub traces: std::sync::OnceLock<Arc<TraceQueue>>,
}

/// What the guard stands in front of: our own tools and the paid API behind them ([`PaidApi`],
/// for `serve` and `stdio`), or another MCP server ([`Proxied`](crate::proxy::Proxied), for
/// `proxy`); what the dashboard, the admin API and `/metrics` read of it.
pub trait Behind: std::fmt::Debug + Send + Sync {
    /// Its circuit breaker.
    fn breaker(&self) -> &Breaker;
    /// Its slots in use and its queue.
    fn occupancy(&self) -> Occupancy;
    /// Calls (or jobs) it may run at once, all callers together: learnt, with `adaptive`.
    fn slots(&self) -> usize;
    /// The static cap on them (`upstream.max_in_flight`, `proxy.max_in_flight`), which a learnt
    /// limit never exceeds.
    fn ceiling(&self) -> usize;
    /// The queue its calls (or jobs) wait in for a slot, whose learnt limit
    /// ([`FairQueue::refresh_learnt`]) is read again before it is shown.
    fn queue(&self) -> &FairQueue;
    /// The jobs running on it, if it runs jobs.
    fn jobs(&self) -> Option<&Arc<Jobs>> {
        None
    }
    /// The 2026-07-28 subscriptions held open through it, if it takes any (a proxied server).
    fn subscriptions(&self) -> Option<usize> {
        None
    }
}

/// Our tools' upstream: the paid API and the jobs running on it.
#[derive(Debug)]
pub struct PaidApi {
    /// The paid API, behind its circuit breaker.
    pub upstream: Arc<Upstream>,
    /// Jobs accepted and not yet forgotten: their slots, the account's fair queue, background polls.
    pub jobs: Arc<Jobs>,
}

impl Behind for PaidApi {
    fn breaker(&self) -> &Breaker {
        self.upstream.breaker()
    }

    fn occupancy(&self) -> Occupancy {
        self.jobs.occupancy()
    }

    fn slots(&self) -> usize {
        self.jobs.slots()
    }

    fn ceiling(&self) -> usize {
        self.jobs.queue().rules().max_in_flight
    }

    fn queue(&self) -> &FairQueue {
        self.jobs.queue()
    }

    fn jobs(&self) -> Option<&Arc<Jobs>> {
        Some(&self.jobs)
    }
}

impl AppState {
    /// Shows the trace exporter's `queue` in `/metrics` from now on (the process's one exporter,
    /// started before the server: `main`); a second call changes nothing.
    pub fn watch_traces(&self, queue: Arc<TraceQueue>) {
        let _ = self.traces.set(queue);
    }

    /// Sets the gauges that are read from live state when `/metrics` is scraped (the learnt limit
    /// as [`FairQueue::refresh_learnt`] last read it: see [`AppState::refresh_gauges`]).
    pub fn sample_gauges(&self) {
        use crate::breaker::BreakerState;
        use crate::ops::metrics::{
            ACCOUNT_SLOTS, ACCOUNT_SLOTS_IN_USE, ACCOUNT_TIER_PLACES, ACCOUNT_TIER_SLOTS, BREAKER_STATE,
            EXPECTED_JOB_SECONDS, JOBS_IN_FLIGHT, QUEUE_DEPTH, QUEUEING_DELAY, SHED_LEVEL, STORE_SLICE_KEYS,
            STORE_SLICE_UNITS, STORE_UP, SUBSCRIPTIONS_OPEN, UPSTREAM_CONCURRENCY_LIMIT,
        };
        let occupancy = self.behind.occupancy();
        // Per flow bucket (a 16-way hash of the tenant or caller, never its name); every bucket
        // is set, so an emptied one reads 0 instead of its last value.
        let mut buckets = [0usize; 16];
        for (flow, waiting) in &occupancy.per_flow {
            buckets[usize::from(crate::identity::bucket_of(flow))] += waiting;
        }
        for (bucket, waiting) in buckets.iter().enumerate() {
            let label = metrics::Label::new("flow_bucket", format!("b{bucket:02}"));
            self.limits.metrics().sample(QUEUE_DEPTH, vec![label], *waiting as f64);
        }
        self.limits.metrics().sample(ACCOUNT_SLOTS_IN_USE, Vec::new(), occupancy.in_flight as f64);
        // Tier names come from the config, never from a caller: a bounded label.
        for tier in &occupancy.per_tier {
            let labels =
                |of: &'static str| vec![metrics::Label::new("tier", tier.tier.clone()), metrics::Label::new("of", of)];
            let metrics = self.limits.metrics();
            metrics.sample(ACCOUNT_TIER_SLOTS, labels("reserved"), tier.reserved_slots as f64);
            metrics.sample(ACCOUNT_TIER_SLOTS, labels("in_use"), tier.in_flight as f64);
            metrics.sample(ACCOUNT_TIER_PLACES, labels("reserved"), tier.reserved_places as f64);
            metrics.sample(ACCOUNT_TIER_PLACES, labels("waiting"), tier.waiting as f64);
        }
        self.limits.metrics().sample(UPSTREAM_CONCURRENCY_LIMIT, Vec::new(), self.behind.slots() as f64);
        if let Some(open) = self.behind.subscriptions() {
            self.limits.metrics().sample(SUBSCRIPTIONS_OPEN, Vec::new(), open as f64);
        }
        let jobs = self.behind.jobs().map_or(0, |jobs| jobs.in_flight());
        self.limits.metrics().sample(JOBS_IN_FLIGHT, Vec::new(), jobs as f64);
        if let Some(jobs) = self.behind.jobs() {
            let slots = jobs.account_slots();
            for (state, slots) in [("busy", slots.busy), ("held_idle", slots.held_idle), ("free", slots.free)] {
                let label = metrics::Label::new("state", state);
                self.limits.metrics().sample(ACCOUNT_SLOTS, vec![label], slots as f64);
            }
            for (class, learnt) in jobs.queue().rules().classes.iter() {
                let label = metrics::Label::new("class", learnt.name);
                let expected = jobs.cadence().expected(class).as_secs_f64();
                self.limits.metrics().sample(EXPECTED_JOB_SECONDS, vec![label], expected);
            }
        }
        let breaker = match self.behind.breaker().state(self.clock.now()) {
            BreakerState::Closed => 0.0,
            BreakerState::HalfOpen => 1.0,
            BreakerState::Open => 2.0,
        };
        self.limits.metrics().sample(BREAKER_STATE, Vec::new(), breaker);
        self.limits.metrics().sample(STORE_UP, Vec::new(), if self.limits.guard().store_up() { 1.0 } else { 0.0 });
        let (keys, units) = self.limits.guard().store().slices_held();
        self.limits.metrics().sample(STORE_SLICE_KEYS, Vec::new(), keys as f64);
        self.limits.metrics().sample(STORE_SLICE_UNITS, Vec::new(), units as f64);
        self.limits.metrics().store_traffic(self.limits.guard().store().traffic());
        if let Some(traces) = self.traces.get() {
            self.limits.metrics().trace_queue(traces.bytes(), traces.dropped());
        }
        if let Some(overload) = self.limits.guard().overload() {
            let delay = overload.least_delay.as_secs_f64();
            self.limits.metrics().sample(QUEUEING_DELAY, Vec::new(), delay);
            self.limits.metrics().sample(SHED_LEVEL, Vec::new(), overload.level as f64);
        }
    }
}

impl AppState {
    /// Reads what other instances may have moved (the shared learnt limit), then
    /// [`AppState::sample_gauges`].
    pub async fn refresh_gauges(&self) {
        self.behind.queue().refresh_learnt().await;
        self.sample_gauges();
    }
}

/// What a reload did.
#[derive(Debug)]
pub enum Reloaded {
    /// The new limits are live. Settings named here changed too but need a restart.
    Applied {
        /// Keys whose new values take effect only at the next start.
        need_restart: Vec<&'static str>,
    },
    /// The file did not load or validate; the running config stays.
    Refused(String),
}

impl AppState {
    /// Loads `file` (and the environment) as at start-up and, if it validates, makes its limits
    /// live.
    pub fn reload_from(&self, file: Option<&Path>) -> Reloaded {
        let loaded = Config::load(file, self.limits.catalogue());
        // The same default audience as at start: the address served is not reloaded.
        let loaded = match self.config.served_at {
            Some(addr) => loaded.and_then(|config| config.serving_at(addr)),
            None => loaded,
        };
        match loaded {
            Ok(config) => self.reload(&config),
            Err(error) => self.refuse(error.to_string()),
        }
    }

    /// Makes the limits of `config` live (see the module doc for what a reload changes).
    pub fn reload(&self, config: &Config) -> Reloaded {
        self.limits.reload(&config.limiting);
        let running = &self.config;
        let mut need_restart = Vec::new();
        for (key, changed) in [
            ("server.listen", running.server.listen != config.server.listen),
            ("server.allowed_hosts", running.server.allowed_hosts != config.server.allowed_hosts),
            ("server.max_body_bytes", running.server.max_body_bytes != config.server.max_body_bytes),
            ("store.backend", running.limiting.store.backend != config.limiting.store.backend),
            ("store.redis_url", running.limiting.store.redis_url != config.limiting.store.redis_url),
            ("server.max_sessions", running.server.max_sessions != config.server.max_sessions),
            (
                "server.max_sessions_per_address",
                running.server.max_sessions_per_address != config.server.max_sessions_per_address,
            ),
            (
                "server.unverified_session_share",
                running.server.unverified_session_share != config.server.unverified_session_share,
            ),
            ("server.key_session_share", running.server.key_session_share != config.server.key_session_share),
            ("server.tenant_session_share", running.server.tenant_session_share != config.server.tenant_session_share),
            (
                "server.session_idle_timeout_seconds",
                running.server.session_idle_timeout != config.server.session_idle_timeout,
            ),
            ("server.header_read_timeout_ms", running.server.header_read_timeout != config.server.header_read_timeout),
            ("server.body_read_timeout_ms", running.server.body_read_timeout != config.server.body_read_timeout),
            ("server.max_connections", running.server.connections.max != config.server.connections.max),
            (
                "server.max_connections_per_address",
                running.server.connections.max_per_address != config.server.connections.max_per_address,
            ),
            // Connections are grouped when accepted; callers' addresses follow a reload at once.
            ("server.ipv6_prefix", running.server.connections.ipv6_prefix != config.server.connections.ipv6_prefix),
            ("server.metrics_key", running.server.metrics_key_sha256 != config.server.metrics_key_sha256),
            (
                "server.shedding",
                running.limiting.shedding.enabled != config.limiting.shedding.enabled
                    || running.limiting.shedding.target != config.limiting.shedding.target
                    || running.limiting.shedding.interval != config.limiting.shedding.interval,
            ),
            ("upstream.url", running.upstream.url != config.upstream.url),
            ("upstream.api_key", running.upstream.api_key != config.upstream.api_key),
            ("upstream.api_key_header", running.upstream.api_key_header != config.upstream.api_key_header),
            ("upstream.max_in_flight", running.upstream.max_in_flight != config.upstream.max_in_flight),
            ("upstream.queue_max", running.upstream.queue_max != config.upstream.queue_max),
            ("upstream.unverified_share", running.upstream.unverified_share != config.upstream.unverified_share),
            ("upstream.reserved", running.upstream.reserved != config.upstream.reserved),
            ("upstream.priority", running.upstream.priority != config.upstream.priority),
            ("upstream.cache_max_entries", running.upstream.cache_max_entries != config.upstream.cache_max_entries),
            ("upstream.cache_max_bytes", running.upstream.cache_max_bytes != config.upstream.cache_max_bytes),
            ("upstream.adaptive", running.upstream.adaptive != config.upstream.adaptive),
            ("proxy.upstream_url", running.proxy.upstream_url != config.proxy.upstream_url),
            ("proxy.command", running.proxy.command != config.proxy.command),
            ("proxy.headers", running.proxy.headers != config.proxy.headers),
            ("proxy.max_in_flight", running.proxy.max_in_flight != config.proxy.max_in_flight),
            ("proxy.timeout_ms", running.proxy.timeout_ms != config.proxy.timeout_ms),
            ("proxy.adaptive", running.proxy.adaptive != config.proxy.adaptive),
            // The exporter and the subscriber it feeds are set up once, when the process starts.
            ("telemetry", running.telemetry != config.telemetry),
            (
                "loop_detection",
                format!("{:?}", running.limiting.loop_detection) != format!("{:?}", config.limiting.loop_detection),
            ),
        ] {
            if changed {
                need_restart.push(key);
            }
        }
        self.limits.metrics().config_reload("applied");
        if need_restart.is_empty() {
            tracing::info!("config reloaded: new limits are live, usage carried over");
        } else {
            tracing::warn!(?need_restart, "config reloaded: new limits are live; these settings need a restart");
        }
        Reloaded::Applied { need_restart }
    }

    fn refuse(&self, error: String) -> Reloaded {
        self.limits.metrics().config_reload("refused");
        tracing::error!(%error, "config reload refused; the running config stays");
        Reloaded::Refused(error)
    }
}
