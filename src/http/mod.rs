//! The HTTP transport: the axum app around rmcp's streamable-HTTP service.
//!
//! On `/mcp`, outside in: [`front_door`] (DNS-rebinding protection, identity and auth, header
//! checks), then the coarse limit ([`limit::HttpLimitLayer`]), then rmcp. `/health` and
//! `/metrics` sit outside all of it and are never limited.

pub mod front_door;
pub mod limit;

use std::sync::Arc;

use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router, middleware};
use http::header;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
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
    let mcp = StreamableHttpService::new(
        move || Ok(McpServer::new(shared.clone(), Transport::Http)),
        Arc::new(LocalSessionManager::default()),
        config,
    );
    Router::new()
        .nest_service("/mcp", mcp)
        .layer(limit::HttpLimitLayer::new(app.clone()))
        .layer(middleware::from_fn_with_state(app.clone(), front_door::identify))
        .layer(middleware::from_fn_with_state(app.clone(), front_door::rebinding_protection))
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/metrics", get(metrics))
        .with_state(app)
}

async fn metrics(State(app): State<Arc<AppState>>) -> impl axum::response::IntoResponse {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], app.metrics.render())
}
