//! The composition root: builds the shared [`AppState`] once, puts the HTTP layers, rmcp's
//! service and the routes together, and serves them over a transport.
//!
//! Nothing below imports this module: the layers, the MCP handler and the limits are handed what
//! they need here.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::response::IntoResponse as _;
use axum::routing::{get, post};
use axum::{Json, Router};
use http::{HeaderMap, header};
use rmcp::ServiceExt;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use serde_json::json;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::clock::{Nanos, SharedClock};
use crate::config::Catalogue;
use crate::config::Config;
use crate::dashboard;
use crate::http::front_door::{self, AllowedHosts, FrontDoorLog};
use crate::http::identify::{self, IdentifyLayer};
use crate::http::limit::HttpLimitLayer;
use crate::http::{Shared, serve, sessions};
use crate::mcp::{McpServer, Transport};
use crate::mock_upstream::MockUpstream;
use crate::proxy::{LinkError, Proxied, ProxyServer, Target};
use crate::rate_limits::{LimitsError, RateLimits};
use crate::state::{AppState, PaidApi};
use crate::upstream::adaptive::AdaptiveLimit;
use crate::upstream::backoff::{Backoff, RetryBudget};
use crate::upstream::classes::JobClasses;
use crate::upstream::gate;
use crate::upstream::jobs::{JobRules, Jobs};
use crate::upstream::queue::{QueueRules, TierRule};
use crate::upstream::{ClientError, Upstream};

/// Why the server could not start or serve.
#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// A listener (the embedded mock upstream's, or a transport's) could not be opened or failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The upstream client could not be made.
    #[error(transparent)]
    Upstream(#[from] ClientError),
    /// The limits could not be built (their store did not answer, or the CA file is bad).
    #[error(transparent)]
    Limits(#[from] LimitsError),
    /// The proxied MCP server could not be reached.
    #[error(transparent)]
    Proxy(#[from] LinkError),
    /// The MCP session over stdio could not start or ended in error.
    #[error("MCP over stdio: {0}")]
    Stdio(String),
}

/// A started server: state, the embedded mock upstream if any, and the housekeeping task.
pub struct App {
    state: Arc<AppState>,
    serving: Serving,
    upstream_url: String,
    stop: CancellationToken,
    _mock: Option<MockUpstream>,
}

/// What the MCP handler of each session serves.
#[derive(Debug)]
enum Serving {
    /// Our tools.
    Tools(Arc<PaidApi>),
    /// A proxied MCP server's.
    Proxy(Arc<Proxied>),
}

impl std::fmt::Debug for App {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("App")
            .field("state", &self.state)
            .field("serving", &self.serving)
            .field("upstream_url", &crate::redact::url(&self.upstream_url))
            .field("stop", &self.stop)
            .field("mock", &self._mock)
            .finish()
    }
}

impl App {
    /// Builds the state, starting the embedded mock upstream when `upstream.url` is empty.
    pub async fn start(config: Config, clock: SharedClock) -> Result<Self, AppError> {
        let mock = if config.upstream.url.is_empty() {
            let listener = TcpListener::bind("127.0.0.1:0").await?;
            let mut deadlines = serve::Deadlines::of(&config.server);
            // Its one client is this server, from loopback: held to the listener's cap only.
            deadlines.connections.max_per_address = deadlines.connections.max;
            Some(MockUpstream::start(config.mock_upstream.clone(), deadlines, clock.clone(), listener).await?)
        } else {
            None
        };
        let upstream_url = mock.as_ref().map_or_else(|| config.upstream.url.clone(), |m| m.url.clone());
        let up = &config.upstream;
        let timeout = Duration::from_millis(up.timeout_ms);
        let breaker = gate::breaker(up);
        let upstream = Arc::new(Upstream::new(&upstream_url, up.credential(), timeout, breaker, clock.clone())?);
        let catalogue = crate::mcp::tools::catalogue();
        let stop = CancellationToken::new();
        let rules = JobRules {
            webhooks: up.webhooks(),
            expiry: Nanos::from_secs(up.job_expiry_seconds),
            backoff: Backoff::new(up.max_attempts, Duration::from_millis(up.max_retry_after_ms)),
            refresh_wait: timeout.saturating_add(Duration::from_secs(1)),
        };
        let limits = RateLimits::start(&config.limiting, catalogue, clock.clone()).await?;
        let store = limits.guard().store().clone();
        let queue_rules = QueueRules::new(up.max_in_flight, up.queue_max, JobClasses::from_config(up))
            .unverified_share(up.unverified_slots(), up.unverified_places())
            .with_tiers(TierRule::from_config(up));
        let adaptive = AdaptiveLimit::configured(&up.adaptive, up.max_in_flight);
        let queue = gate::start_queue(queue_rules, adaptive, &limits, "upstream", clock.clone(), stop.child_token());
        let jobs = Arc::new(
            Jobs::new(
                upstream.clone(),
                queue,
                RetryBudget::new(
                    up.retry_budget_ratio,
                    up.retry_budget_min_retries,
                    Nanos::from_millis(up.retry_budget_window_ms),
                ),
                rules,
                clock.clone(),
                limits.metrics().clone(),
                stop.child_token(),
            )
            .published_in(store.clone()),
        );
        jobs.end_orphans_of_dead_instances();
        jobs.hear_ended_elsewhere();
        let own = Arc::new(PaidApi { upstream, jobs });
        let state = Arc::new(AppState { limits, behind: own.clone(), clock, config, traces: Default::default() });
        tokio::spawn(sweep_forever(own.clone(), state.config.limiting.store.sweep_interval_ms, stop.clone()));
        if state.limits.guard().store().is_shared() {
            tokio::spawn(answer_cancel_requests_forever(own.clone(), stop.clone()));
        }
        Ok(Self { state, serving: Serving::Tools(own), upstream_url, stop, _mock: mock })
    }

    /// Builds the state of a proxy in front of the MCP server at `target` (its tools learnt at
    /// run time: `config` was loaded against [`Catalogue::learned`](crate::config::Catalogue::learned)),
    /// connecting to it now.
    pub async fn start_proxy(config: Config, target: Target, clock: SharedClock) -> Result<Self, AppError> {
        let stop = CancellationToken::new();
        let limits = RateLimits::start(&config.limiting, Catalogue::learned(), clock.clone()).await?;
        let upstream_url = target.to_string();
        let proxied = Proxied::start(target, &config, limits.clone(), clock.clone(), stop.child_token()).await?;
        let state = Arc::new(AppState { limits, behind: proxied.clone(), clock, config, traces: Default::default() });
        Ok(Self { state, serving: Serving::Proxy(proxied), upstream_url, stop, _mock: None })
    }

    /// The shared state (for tests and embedding).
    pub fn state(&self) -> &Arc<AppState> {
        &self.state
    }

    /// The proxied MCP server, when this is a proxy.
    pub fn proxied(&self) -> Option<&Arc<Proxied>> {
        match &self.serving {
            Serving::Proxy(proxied) => Some(proxied),
            Serving::Tools(_) => None,
        }
    }

    /// Where the tools send their upstream calls.
    pub fn upstream_url(&self) -> &str {
        &self.upstream_url
    }

    /// The axum app for the HTTP transport: `/mcp` behind the front door and the coarse limit;
    /// the dashboard, `/health` and `/metrics` behind the DNS-rebinding protection only (and
    /// `/metrics` behind `server.metrics_key`), never limited.
    pub fn router(&self) -> Router {
        let app = &self.state;
        let server = &app.config.server;
        let config = StreamableHttpServerConfig::default()
            .with_allowed_hosts(server.allowed_hosts.clone())
            .with_max_request_body_bytes(server.max_body_bytes)
            .with_cancellation_token(self.stop.child_token())
            // A 2026-07-28 request (stateless) is answered with a JSON body where its answer is
            // all there is to say, and with a stream only where something comes before it
            // (progress, a log message, a question for the caller): no stream to open, frame and
            // parse for the common call (rmcp falls back to a stream by itself). 2025-11-25
            // sessions keep their streams either way.
            .with_json_response(true);
        let session_manager = sessions::manager(server, matches!(self.serving, Serving::Tools(_)));
        let log = Arc::new(FrontDoorLog::new(app.clock.clone()));
        let stop = self.stop.child_token();
        let cap = sessions::SessionCap::new(session_manager.clone(), server, log.clone(), app.clock.clone(), stop);
        let cap = Arc::new(cap);
        let mut webhooks = Router::new();
        let mcp = match &self.serving {
            Serving::Tools(own) => {
                if app.config.upstream.webhooks().is_some() {
                    // Signed by the paid API, not a browser's: no rebinding check (its Host is
                    // whatever public name the API was given), the body deadline as everywhere.
                    let taken = post(take_webhook).with_state(own.clone());
                    let deadline = serve::read_body_by_deadline(serve::BodyDeadline::of(server));
                    webhooks = webhooks.route(crate::config::WEBHOOK_PATH, taken.layer(deadline));
                }
                let (app, own) = (app.clone(), own.clone());
                mcp_at(move || McpServer::new(app.clone(), own.clone(), Transport::Http), session_manager, config)
            }
            Serving::Proxy(proxied) => {
                let lane = crate::proxy::Lane::new(proxied.clone(), app.limits.clone(), session_manager.clone());
                let (proxied, limits) = (proxied.clone(), app.limits.clone());
                let service = StreamableHttpService::new(
                    move || Ok(ProxyServer::new(proxied.clone(), limits.clone())),
                    session_manager,
                    config,
                );
                // The relay lane before rmcp: what the proxy only forwards, forwarded as it came.
                let service = tower::ServiceBuilder::new()
                    .layer(crate::http::StepLayer::new(lane))
                    .map_response(|response: http::Response<_>| response.map(axum::body::Body::new))
                    .service(Shared::new(service));
                Router::new().nest_service("/mcp", service)
            }
        };
        let allowed =
            Arc::new(AllowedHosts::new(server.allowed_hosts.clone(), server.allowed_origins.clone(), log.clone()));
        let dashboard = dashboard::routes().layer(front_door::rebinding_protection(allowed.clone()));
        // Never limited, but only for this server's own names (a foreign Host gets 403, as on
        // /mcp and the dashboard), and /metrics for whoever holds server.metrics_key.
        let metrics_key = server.metrics_key_sha256.map(|key| key.0);
        let metrics_key = front_door::metrics_key(metrics_key, app.limits.identifier().clone(), log);
        let open = Router::new()
            .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
            .route("/metrics", get(metrics).layer(metrics_key))
            // RFC 9728 Protected Resource Metadata: where to get a token for /mcp (404 while
            // `[auth.oauth]` is off).
            .merge(mcp_ratelimit_rmcp::oauth::metadata_routes(app.limits.callers().tokens().clone()))
            .layer(front_door::rebinding_protection(allowed.clone()));
        // Outside in, as one layer (a router boxes each of its layers again for every request):
        // DNS-rebinding protection, identity, the header checks, the coarse HTTP limit, the 401
        // for an invalid token (after it was charged as its address's), the body deadline, the
        // session caps; then rmcp.
        let front_door = tower::ServiceBuilder::new()
            .layer(front_door::rebinding_protection(allowed))
            .layer(IdentifyLayer::new(app.limits.callers().clone(), app.clock.clone()))
            .layer(front_door::mcp_post_checks(server.max_body_bytes))
            .layer(HttpLimitLayer::new(app.limits.guard().clone()))
            .layer(identify::refuse_invalid_tokens())
            .layer(serve::read_body_by_deadline(serve::BodyDeadline::of(server)))
            .layer(sessions::cap(cap));
        mcp.layer(front_door).merge(dashboard).merge(open).with_state(app.clone()).merge(webhooks)
    }

    /// Serves HTTP on `listener` until [`App::stop`] is called, holding connections to the
    /// deadlines and caps of `[server]` (see [`crate::http::serve`]).
    pub async fn serve_http(&self, listener: TcpListener) -> std::io::Result<()> {
        let deadlines = serve::Deadlines::of(&self.state.config.server);
        let counted = self.state.limits.metrics().connections("mcp");
        serve::serve(listener, self.router(), deadlines, counted, self.stop.clone()).await;
        Ok(())
    }

    /// Serves the admin API on `listener` until [`App::stop`] is called, with the deadlines and
    /// connection caps of `[server]`; `None` when no `admin.key` is configured (the admin API is off).
    pub fn serve_admin(&self, listener: TcpListener) -> Option<impl Future<Output = ()> + use<>> {
        let key = self.state.config.admin.key_sha256?;
        let deadlines = serve::Deadlines::of(&self.state.config.server);
        let app = crate::admin::router(self.state.clone(), key, deadlines.body.answered_plainly());
        let counted = self.state.limits.metrics().connections("admin");
        Some(serve::serve(listener, app, deadlines, counted, self.stop.clone()))
    }

    /// Serves MCP over stdin/stdout until the client closes it.
    pub async fn serve_stdio(&self) -> Result<(), AppError> {
        match &self.serving {
            Serving::Tools(own) => over_stdio(McpServer::new(self.state.clone(), own.clone(), Transport::Stdio)).await,
            Serving::Proxy(proxied) => over_stdio(ProxyServer::new(proxied.clone(), self.state.limits.clone())).await,
        }
    }

    /// Reloads the config from `file` on `SIGHUP` and whenever the file changes, until stopped
    /// (see [`crate::reload`]).
    pub fn reload_on_change(&self, file: Option<std::path::PathBuf>) {
        let state = self.state.clone();
        tokio::spawn(crate::reload::watch(file, self.stop.child_token(), move |file| {
            state.reload_from(file);
        }));
    }

    /// Stops serving and the background tasks.
    pub fn stop(&self) {
        self.stop.cancel();
        self.state.limits.stop();
    }
}

impl Drop for App {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// `/mcp`: rmcp's streamable HTTP service, a `handler` per session.
fn mcp_at<S: rmcp::ServerHandler>(
    handler: impl Fn() -> S + Send + Sync + 'static,
    sessions: Arc<rmcp::transport::streamable_http_server::session::local::LocalSessionManager>,
    config: StreamableHttpServerConfig,
) -> Router<Arc<AppState>> {
    let service = StreamableHttpService::new(move || Ok(handler()), sessions, config);
    Router::new().nest_service("/mcp", Shared::new(service))
}

/// One MCP session over stdin/stdout with `handler`, until the client closes it; every line
/// the client sends is answered, a malformed or oversized one too ([`crate::mcp::stdio`]).
async fn over_stdio<S: rmcp::ServerHandler>(handler: S) -> Result<(), AppError> {
    let failed = |e: &dyn std::fmt::Display| AppError::Stdio(e.to_string());
    let (stdin, stdout) = rmcp::transport::stdio();
    let (transport, framing) = crate::mcp::stdio::frame(stdin, stdout);
    let served = match handler.serve(transport).await {
        Ok(running) => running.waiting().await.map(drop).map_err(|e| failed(&e)),
        Err(e) => Err(failed(&e)),
    };
    framing.finish().await;
    served
}

/// Cancels this instance's jobs that an agent asked another instance to cancel.
async fn answer_cancel_requests_forever(own: Arc<PaidApi>, stop: CancellationToken) {
    crate::clock::every(crate::upstream::jobs::CANCEL_REQUESTS_EVERY, stop, || async {
        if let Err(error) = own.jobs.answer_cancel_requests().await {
            tracing::debug!(%error, "could not read the cancel requests");
        }
    })
    .await;
}

/// The `job` a webhook's URL names (`?job=<predict_id>`), for a job queued under an id of ours.
#[derive(Debug, serde::Deserialize)]
struct WebhookQuery {
    job: Option<String>,
}

/// `POST /webhooks/upstream`: a job's end, pushed by the paid API ([`crate::upstream::jobs`]).
async fn take_webhook(
    State(own): State<Arc<PaidApi>>,
    Query(query): Query<WebhookQuery>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> axum::response::Response {
    use crate::upstream::jobs::{Pushed, WEBHOOK_BODY_MAX};
    let answer = match axum::body::to_bytes(body, WEBHOOK_BODY_MAX).await {
        Ok(body) => own.jobs.take_webhook(Pushed { headers: &headers, body: &body, job: query.job.as_deref() }).await,
        Err(_) => own.jobs.webhook_too_large(),
    };
    (answer.status, Json(json!({ "outcome": answer.outcome, "message": answer.message }))).into_response()
}

/// Forgets final jobs nobody asked about for long.
async fn sweep_forever(own: Arc<PaidApi>, every_ms: u64, stop: CancellationToken) {
    crate::clock::every(Duration::from_millis(every_ms), stop, || {
        let jobs = own.jobs.sweep();
        if jobs > 0 {
            tracing::debug!(jobs, "swept forgotten jobs");
        }
        std::future::ready(())
    })
    .await;
}

async fn metrics(State(app): State<Arc<AppState>>) -> impl axum::response::IntoResponse {
    app.refresh_gauges().await;
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], app.limits.metrics().render())
}
