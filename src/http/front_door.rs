//! The checks that run on `/mcp` before any limit is charged or any JSON is parsed.
//!
//! Outside in: DNS-rebinding protection (a foreign `Host` or `Origin` gets 403 before anything
//! else), then identity (and 401 when `auth.required` and the key is unknown), then the cheap
//! header checks that can refuse a request without reading it (413 on a declared body over the
//! limit, 415 on a POST that is not JSON). A request refused here is never charged.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{ConnectInfo, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::{HeaderMap, Method, StatusCode, header};
use serde_json::json;

use crate::app::AppState;

/// A JSON-RPC error body with `id: null`, as MCP clients expect on transport-level refusals.
pub fn jsonrpc_error(status: StatusCode, code: i64, message: &str, data: Option<serde_json::Value>) -> Response {
    let mut error = json!({"code": code, "message": message});
    if let Some(data) = data {
        error["data"] = data;
    }
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        json!({"jsonrpc": "2.0", "error": error, "id": null}).to_string(),
    )
        .into_response()
}

/// Splits an authority (`host`, `host:port`, `[v6]:port`, bare `v6`) into host and port.
fn split_authority(authority: &str) -> (&str, Option<&str>) {
    if let Some(rest) = authority.strip_prefix('[') {
        let (host, after) = rest.split_once(']').unwrap_or((rest, ""));
        return (host, after.strip_prefix(':'));
    }
    match authority.split_once(':') {
        Some((host, port)) if !port.contains(':') => (host, Some(port)),
        _ => (authority, None),
    }
}

/// Whether `authority` is allowed by `allowed_hosts` (an entry without a port matches any port).
fn host_allowed(allowed_hosts: &[String], authority: &str) -> bool {
    let (host, port) = split_authority(authority);
    allowed_hosts.iter().any(|entry| {
        let (allowed_host, allowed_port) = split_authority(entry);
        allowed_host.eq_ignore_ascii_case(host) && (allowed_port.is_none() || allowed_port == port)
    })
}

/// Whether `Host` and `Origin` are ones this server answers to.
fn rebinding_problem(headers: &HeaderMap, state: &AppState) -> Option<&'static str> {
    let server = &state.config.server;
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
    if !host.is_some_and(|h| host_allowed(&server.allowed_hosts, h)) {
        return Some("Host header is not allowed");
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = origin.to_str().unwrap_or("");
        let listed = server.allowed_origins.iter().any(|o| o.eq_ignore_ascii_case(origin));
        let same_host = reqwest::Url::parse(origin).ok().is_some_and(|u| {
            let authority = match (u.host_str(), u.port_or_known_default()) {
                (Some(h), Some(p)) => format!("{h}:{p}"),
                (Some(h), None) => h.to_owned(),
                _ => return false,
            };
            host_allowed(&server.allowed_hosts, &authority)
        });
        if !listed && !same_host {
            return Some("Origin is not allowed");
        }
    }
    None
}

/// 403 for a foreign `Host` or `Origin`, before anything else.
pub async fn rebinding_protection(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    if let Some(problem) = rebinding_problem(request.headers(), &state) {
        tracing::info!(problem, "refused: DNS-rebinding protection");
        return jsonrpc_error(StatusCode::FORBIDDEN, -32000, problem, None);
    }
    next.run(request).await
}

/// Names the caller (401 when a key is required and missing or unknown), then refuses what can
/// be refused from headers alone. The caller goes into the request's extensions for the
/// limiter and the tools.
pub async fn identify(State(state): State<Arc<AppState>>, mut request: Request, next: Next) -> Response {
    let peer = request.extensions().get::<ConnectInfo<SocketAddr>>().map(|c| c.0.ip());
    let caller = match state.identifier.load().identify(request.headers(), peer) {
        Ok(caller) => caller,
        Err(unauthorized) => {
            let mut response =
                jsonrpc_error(StatusCode::UNAUTHORIZED, -32001, &format!("Unauthorized: {unauthorized}."), None);
            response.headers_mut().insert(header::WWW_AUTHENTICATE, http::HeaderValue::from_static("Bearer"));
            return response;
        }
    };
    if request.method() == Method::POST {
        let declared = request
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let max = state.config.server.max_body_bytes;
        if declared.is_some_and(|n| n > max as u64) {
            return jsonrpc_error(
                StatusCode::PAYLOAD_TOO_LARGE,
                -32600,
                &format!("Request body too large: the limit is {max} bytes."),
                None,
            );
        }
        let json =
            request.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|v| {
                v.split(';').next().is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
            });
        if !json {
            return jsonrpc_error(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                -32600,
                "Unsupported Media Type: POST /mcp takes Content-Type: application/json.",
                None,
            );
        }
    }
    request.extensions_mut().insert(caller);
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::host_allowed;

    #[test]
    fn entries_without_a_port_match_any_port() {
        let allowed = ["localhost".to_owned(), "::1".to_owned(), "mcp.example.com:443".to_owned()];
        assert!(host_allowed(&allowed, "localhost:3000"));
        assert!(host_allowed(&allowed, "LOCALHOST"));
        assert!(host_allowed(&allowed, "[::1]:3000"));
        assert!(host_allowed(&allowed, "mcp.example.com:443"));
        assert!(!host_allowed(&allowed, "mcp.example.com:8443"));
        assert!(!host_allowed(&allowed, "evil.example.com"));
        assert!(!host_allowed(&allowed, "localhost.evil.com"));
    }
}
