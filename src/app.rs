//! The composition root: builds the shared state once and serves it over a transport.
//!
//! Everything a tool call needs lives in [`AppState`], shared by every session of every
//! transport, so a caller has one budget however many sessions it opens.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::ListenerExt;
use rmcp::ServiceExt;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::clock::SharedClock;
use crate::config::Config;
use crate::guard::Guard;
use crate::identity::Identifier;
use crate::mcp::{McpServer, Transport};
use crate::metrics::Metrics;
use crate::mock_upstream::MockUpstream;
use crate::store::{MemoryStore, Store};
use crate::upstream::Upstream;
use crate::upstream::predictions::PredictionBook;

/// State shared by every session.
#[derive(Debug)]
pub struct AppState {
    /// The validated config.
    pub config: Config,
    /// The one clock.
    pub clock: SharedClock,
    /// Names callers (keys, tenants, tiers, trusted proxies).
    pub identifier: Identifier,
    /// Budgets and refusals.
    pub guard: Guard,
    /// What the limits are doing.
    pub metrics: Arc<Metrics>,
    /// The paid API.
    pub upstream: Upstream,
    /// Jobs we submitted and when they may be polled.
    pub predictions: PredictionBook,
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
        let upstream = Upstream::new(&upstream_url, Duration::from_millis(config.upstream.timeout_ms))?;
        let metrics = Arc::new(Metrics::new());
        let guard = Guard::new(Store::Memory(MemoryStore::new()), clock.clone(), &config, metrics.clone());
        let state = Arc::new(AppState {
            predictions: PredictionBook::new(clock.clone()),
            identifier: Identifier::new(&config),
            guard,
            metrics,
            upstream,
            clock,
            config,
        });
        let stop = CancellationToken::new();
        tokio::spawn(sweep_forever(state.clone(), stop.clone()));
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

    /// Serves HTTP on `listener` until [`App::stop`] is called.
    pub async fn serve_http(&self, listener: TcpListener) -> std::io::Result<()> {
        // An MCP response over SSE leaves in several small writes; without TCP_NODELAY, Nagle's
        // algorithm and the client's delayed ACK stall each one by ~40 ms.
        let listener = listener.tap_io(|tcp| {
            if let Err(error) = tcp.set_nodelay(true) {
                tracing::debug!(%error, "cannot set TCP_NODELAY");
            }
        });
        let app = self.router().into_make_service_with_connect_info::<SocketAddr>();
        axum::serve(listener, app).with_graceful_shutdown(self.stop.clone().cancelled_owned()).await
    }

    /// Serves MCP over stdin/stdout until the client closes it.
    pub async fn serve_stdio(&self) -> anyhow::Result<()> {
        let running = McpServer::new(self.state.clone(), Transport::Stdio).serve(rmcp::transport::stdio()).await?;
        running.waiting().await?;
        Ok(())
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

async fn sweep_forever(state: Arc<AppState>, stop: CancellationToken) {
    let mut every = tokio::time::interval(Duration::from_millis(state.config.store.sweep_interval_ms));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = every.tick() => {
                let keys = state.guard.sweep();
                let jobs = state.predictions.sweep();
                if keys + jobs > 0 {
                    tracing::debug!(keys, jobs, "swept idle state");
                }
            }
        }
    }
}
