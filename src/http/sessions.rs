//! How many MCP sessions the server keeps, and for how long.
//!
//! A session costs memory (rmcp's session worker, our `McpServer`, their channels) whether or
//! not it is used, and opening one is cheap: a client can open thousands and walk away. So a
//! session with no message for `server.session_idle_timeout_seconds` is closed (rmcp's own
//! idle timer, which then drops it from its map), and at most `server.max_sessions` are open at
//! once: an `initialize` beyond that gets `503` with `Retry-After` instead of another session.
//! Memory is then bounded by `max_sessions` × the size of an idle session (about 110 KiB, nearly
//! all rmcp's channels), whoever opens them.
//! Budgets are not per session, so closing one takes nothing from its caller.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use http::{HeaderValue, Method, StatusCode, header};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;

use crate::config::ServerConfig;
use crate::http::front_door::jsonrpc_error;

/// Seconds a client is told to wait when every session is taken.
const RETRY_AFTER_SECS: u32 = 5;

/// rmcp's in-memory session manager with this server's idle timeout.
pub fn manager(server: &ServerConfig) -> Arc<LocalSessionManager> {
    let mut manager = LocalSessionManager::default();
    manager.session_config.keep_alive = Some(server.session_idle_timeout);
    Arc::new(manager)
}

/// The session cap: the manager whose sessions are counted, and the most it may hold.
#[derive(Debug, Clone)]
pub struct SessionCap {
    sessions: Arc<LocalSessionManager>,
    max: usize,
}

impl SessionCap {
    /// At most `max` sessions in `sessions`.
    pub fn new(sessions: Arc<LocalSessionManager>, max: usize) -> Self {
        Self { sessions, max }
    }
}

/// Refuses an `initialize` with `503` while `max` sessions are open. Only a POST without a
/// session id can open one, and the count is read only for those; the body is looked at only
/// when the server is full (a stateless request is not an `initialize` and passes).
pub async fn cap(State(cap): State<SessionCap>, request: Request, next: Next) -> Response {
    if request.method() != Method::POST || request.headers().contains_key("mcp-session-id") {
        return next.run(request).await;
    }
    if cap.sessions.sessions.read().await.len() < cap.max {
        return next.run(request).await;
    }
    let (parts, body) = request.into_parts();
    // The body has been read already (see `serve`), within the size limit; this only copies it.
    let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap_or_default();
    let method = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|message| message.get("method").and_then(|m| m.as_str()).map(str::to_owned));
    if method.as_deref() != Some("initialize") {
        return next.run(Request::from_parts(parts, Body::from(bytes))).await;
    }
    tracing::warn!(max = cap.max, "refused: every MCP session is taken (server.max_sessions)");
    let mut response = jsonrpc_error(
        StatusCode::SERVICE_UNAVAILABLE,
        -32000,
        "Too many open sessions on this server. Retry after the delay in Retry-After.",
        Some(serde_json::json!({ "retry_after_ms": u64::from(RETRY_AFTER_SECS) * 1000 })),
    );
    response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECS));
    response
}
