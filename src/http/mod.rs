//! The HTTP transport: the axum app around rmcp's streamable-HTTP service.
//!
//! Layers run before any JSON is parsed. The identity layer names the caller from headers and
//! the peer address and hands it to the tools through the request's extensions; rmcp itself
//! enforces the `Host` allow-list (DNS-rebinding protection) and the body size limit.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{ConnectInfo, Request};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::get;
use axum::{Json, Router};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::app::AppState;
use crate::identity::Caller;
use crate::mcp::{McpServer, Transport};

/// The whole HTTP app: `/mcp` (guarded) and `/health` (never limited).
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
        .layer(middleware::from_fn(identify))
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
}

/// Names the caller of every `/mcp` request; tools read it back from the extensions.
async fn identify(mut request: Request, next: Next) -> Response {
    let peer = request.extensions().get::<ConnectInfo<SocketAddr>>().map(|c| c.0.ip());
    let caller = Caller::from_request(request.headers(), peer);
    request.extensions_mut().insert(caller);
    next.run(request).await
}
