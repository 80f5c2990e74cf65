//! The checks that run on `/mcp` before any limit is charged or any JSON is parsed.
//!
//! Outside in: DNS-rebinding protection (a foreign `Host` or `Origin` gets 403 before anything
//! else), then identity ([`IdentifyLayer`]: 401 when `auth.required` and the key is unknown),
//! then the cheap header checks that can refuse an MCP request without reading it (413 on a
//! declared body over the limit, 415 on a POST that is not JSON). A request refused here is never
//! charged.

use std::net::SocketAddr;
use std::sync::Arc;
use std::task::{Context, Poll};

use arc_swap::ArcSwap;
use axum::extract::{ConnectInfo, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::{HeaderMap, Method, StatusCode, header};
use serde_json::json;
use tower::{Layer, Service};

use crate::clock::SharedClock;
use crate::config::ServerConfig;
use crate::guard::report::RefusalLog;
use crate::identity::Identifier;

/// The `Host` and `Origin` values a server answers to (`server.allowed_hosts`,
/// `server.allowed_origins`): the state of [`rebinding_protection`], with the log its refusals
/// are written to.
#[derive(Debug, Clone)]
pub struct AllowedHosts {
    /// Accepted `Host` values (an entry without a port matches any port).
    pub hosts: Vec<String>,
    /// Further accepted `Origin` values, exactly as browsers send them.
    pub origins: Vec<String>,
    log: Arc<FrontDoorLog>,
}

impl AllowedHosts {
    /// These `hosts` and `origins`; refusals go to `log`.
    pub fn new(hosts: Vec<String>, origins: Vec<String>, log: Arc<FrontDoorLog>) -> Self {
        Self { hosts, origins, log }
    }

    /// The hosts and origins `server` allows; refusals go to `log`.
    pub fn of(server: &ServerConfig, log: Arc<FrontDoorLog>) -> Self {
        Self::new(server.allowed_hosts.clone(), server.allowed_origins.clone(), log)
    }
}

/// What the front door refuses before any caller is known or any limit is charged, as its log
/// counts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrontDoorRefusal {
    /// A foreign `Host` or `Origin` (403).
    Rebinding = 0,
    /// An `initialize` while every session of the server is taken (503).
    SessionsTaken = 1,
    /// An `initialize` while the unverified callers of its address hold every session they may (429).
    AddressSessionsTaken = 2,
}

/// The front door's refusal lines. A client can send these refusals as fast as it can send
/// requests, so, like the guard's (see [`RefusalLog`]), each kind writes a burst of ten lines,
/// then one a second, each saying how many it stands for (`left_out`), on the app's clock.
#[derive(Debug)]
pub struct FrontDoorLog {
    lines: RefusalLog,
    clock: SharedClock,
}

impl FrontDoorLog {
    /// A log on `clock`.
    pub fn new(clock: SharedClock) -> Self {
        Self { lines: RefusalLog::default(), clock }
    }

    /// Whether a refusal of `kind` may be logged now; if so, how many were left out since its
    /// last line.
    pub fn admit(&self, kind: FrontDoorRefusal) -> Option<u64> {
        self.lines.admit(kind as u8, self.clock.now())
    }
}

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
fn rebinding_problem(headers: &HeaderMap, allowed: &AllowedHosts) -> Option<&'static str> {
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
    if !host.is_some_and(|h| host_allowed(&allowed.hosts, h)) {
        return Some("Host header is not allowed");
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = origin.to_str().unwrap_or("");
        let listed = allowed.origins.iter().any(|o| o.eq_ignore_ascii_case(origin));
        let same_host = reqwest::Url::parse(origin).ok().is_some_and(|u| {
            let authority = match (u.host_str(), u.port_or_known_default()) {
                (Some(h), Some(p)) => format!("{h}:{p}"),
                (Some(h), None) => h.to_owned(),
                _ => return false,
            };
            host_allowed(&allowed.hosts, &authority)
        });
        if !listed && !same_host {
            return Some("Origin is not allowed");
        }
    }
    None
}

/// 403 for a foreign `Host` or `Origin`, before anything else.
pub async fn rebinding_protection(State(allowed): State<Arc<AllowedHosts>>, request: Request, next: Next) -> Response {
    if let Some(problem) = rebinding_problem(request.headers(), &allowed) {
        if let Some(left_out) = allowed.log.admit(FrontDoorRefusal::Rebinding) {
            tracing::info!(problem, left_out, "refused: DNS-rebinding protection");
        }
        return jsonrpc_error(StatusCode::FORBIDDEN, -32000, problem, None);
    }
    next.run(request).await
}

/// Names the caller of every request (a one-way hash of its key, else its address) and puts the
/// [`Caller`](crate::identity::Caller) into the request's extensions, for the limit behind it and the tools; answers 401
/// when `auth.required` and the key is missing or unknown. The address comes from axum's
/// `ConnectInfo<SocketAddr>` (serve with `into_make_service_with_connect_info`).
#[derive(Debug, Clone)]
pub struct IdentifyLayer {
    identifier: Arc<ArcSwap<Identifier>>,
}

impl IdentifyLayer {
    /// A layer naming callers with `identifier` (swapped whole by a config reload).
    pub fn new(identifier: Arc<ArcSwap<Identifier>>) -> Self {
        Self { identifier }
    }
}

impl<S> Layer<S> for IdentifyLayer {
    type Service = Identified<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Identified { inner, identifier: self.identifier.clone() }
    }
}

/// The service [`IdentifyLayer`] produces.
#[derive(Debug, Clone)]
pub struct Identified<S> {
    inner: S,
    identifier: Arc<ArcSwap<Identifier>>,
}

impl<S> Service<Request> for Identified<S>
where
    S: Service<Request, Response = Response>,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = futures::future::Either<S::Future, std::future::Ready<Result<Response, S::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request) -> Self::Future {
        let peer = request.extensions().get::<ConnectInfo<SocketAddr>>().map(|c| c.0.ip());
        match self.identifier.load().identify(request.headers(), peer) {
            Ok(caller) => {
                request.extensions_mut().insert(caller);
                futures::future::Either::Left(self.inner.call(request))
            }
            Err(unauthorized) => {
                let mut response =
                    jsonrpc_error(StatusCode::UNAUTHORIZED, -32001, &format!("Unauthorized: {unauthorized}."), None);
                response.headers_mut().insert(header::WWW_AUTHENTICATE, http::HeaderValue::from_static("Bearer"));
                futures::future::Either::Right(std::future::ready(Ok(response)))
            }
        }
    }
}

/// Refuses an MCP `POST` that can be refused from its headers alone, before it is charged or
/// read: 413 when it declares a body over `max_body_bytes`, 415 when it is not JSON.
pub async fn mcp_post_checks(State(max_body_bytes): State<usize>, request: Request, next: Next) -> Response {
    if request.method() == Method::POST {
        let declared = request
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > max_body_bytes as u64) {
            return jsonrpc_error(
                StatusCode::PAYLOAD_TOO_LARGE,
                -32600,
                &format!("Request body too large: the limit is {max_body_bytes} bytes."),
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
