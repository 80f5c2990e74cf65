//! The HTTP transport: the axum app around rmcp's streamable-HTTP service.
//!
//! Every connection is served by [`serve`] (a header deadline). On `/mcp`, outside in:
//! [`front_door`] (DNS-rebinding protection, identity and auth, header checks), then the coarse
//! limit ([`limit::HttpLimitLayer`]), then the body deadline ([`serve::read_body_by_deadline`]),
//! then the session cap ([`sessions`]), then rmcp. `/health` and
//! `/metrics` sit outside all of it and are never limited. The [`dashboard`] sits behind the
//! DNS-rebinding protection only: never limited, no identity needed.

pub mod dashboard;
pub mod front_door;
pub mod limit;
pub mod serve;
pub mod sessions;

use std::sync::Arc;

use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router, middleware};
use http::header;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::app::AppState;
use crate::mcp::{McpServer, Transport};

/// The whole HTTP app.
pub fn router(app: Arc<AppState>, stop: CancellationToken) -> Router {
    let server = &app.config.server;
    let config = StreamableHttpServerConfig::default()
        .with_allowed_hosts(server.allowed_hosts.clone())
        .with_max_request_body_bytes(server.max_body_bytes)
        .with_cancellation_token(stop.child_token());
    let shared = app.clone();
    let session_manager = sessions::manager(server);
    let cap = sessions::SessionCap::new(session_manager.clone(), server.max_sessions);
    let mcp = StreamableHttpService::new(
        move || Ok(McpServer::new(shared.clone(), Transport::Http)),
        session_manager,
        config,
    );
    Router::new()
        .nest_service("/mcp", Shared::new(mcp))
        .layer(middleware::from_fn_with_state(cap, sessions::cap))
        .layer(middleware::from_fn_with_state(serve::BodyDeadline::of(server), serve::read_body_by_deadline))
        .layer(limit::HttpLimitLayer::new(app.clone()))
        .layer(middleware::from_fn_with_state(app.clone(), front_door::identify))
        .layer(middleware::from_fn_with_state(app.clone(), front_door::rebinding_protection))
        .merge(dashboard::routes().layer(middleware::from_fn_with_state(app.clone(), front_door::rebinding_protection)))
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/metrics", get(metrics))
        .with_state(app)
}

/// A service behind an `Arc`. axum and its `from_fn` layers clone the inner stack on every
/// request; rmcp's service carries its config (host lists and more), so cloning it per layer
/// per request shows in a profile. Behind an `Arc` those clones are a reference count, and the
/// service itself is cloned once, only for a request that actually reaches it.
#[derive(Debug)]
struct Shared<S>(Arc<S>);

impl<S> Shared<S> {
    fn new(service: S) -> Self {
        Self(Arc::new(service))
    }
}

impl<S> Clone for Shared<S> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<S, R> tower::Service<R> for Shared<S>
where
    S: tower::Service<R> + Clone,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = tower::util::Oneshot<S, R>;

    fn poll_ready(&mut self, _cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        // Readiness belongs to the clone that serves the request: `oneshot` waits for it.
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: R) -> Self::Future {
        tower::ServiceExt::oneshot(S::clone(&self.0), request)
    }
}

async fn metrics(State(app): State<Arc<AppState>>) -> impl axum::response::IntoResponse {
    app.sample_gauges();
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], app.metrics.render())
}
