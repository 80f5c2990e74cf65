//! The checks that run on `/mcp` before any limit is charged or any JSON is parsed.
//!
//! Outside in: DNS-rebinding protection (a foreign `Host` or `Origin` gets 403 before anything
//! else), then identity ([`crate::http::identify`]: 401 when `auth.required` and the key is
//! unknown, or an access token does not verify), then the cheap header checks that can refuse an MCP request without reading it (413 on a
//! declared body over the limit, 415 on a POST that is not JSON). A request refused here is never
//! charged.

use std::sync::Arc;
use std::task::{Context, Poll};

use arc_swap::ArcSwap;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use http::{HeaderMap, Method, StatusCode, header};
use serde::Serialize;
use sha2::{Digest, Sha256};
use tower::{Layer, Service};

use mcp_ratelimit_core::clock::SharedClock;
use mcp_ratelimit_core::guard::admit::report::RefusalLog;
use mcp_ratelimit_core::identity::Identifier;

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
    /// An `initialize` while unverified callers of every address hold their share of sessions (503).
    UnverifiedSessionsTaken = 3,
    /// An `initialize` while its key holds every session it may (429).
    KeySessionsTaken = 4,
    /// An `initialize` while its tenant's keys hold every session they may (429).
    TenantSessionsTaken = 5,
    /// A request to `/metrics` without the metrics key (401).
    MetricsKey = 6,
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
    jsonrpc_error_with(status, code, message, data.as_ref())
}

/// [`jsonrpc_error`] with any serializable `data`: serialized straight into the body, without
/// building a JSON value first (what a 429 does, at the rate a client can send requests).
pub fn jsonrpc_error_with<D: Serialize>(status: StatusCode, code: i64, message: &str, data: Option<&D>) -> Response {
    // The members in the order a `json!` object prints them (sorted), so the body is the same.
    #[derive(Serialize)]
    struct Body<'a, D> {
        error: Error<'a, D>,
        id: (),
        jsonrpc: &'static str,
    }
    #[derive(Serialize)]
    struct Error<'a, D> {
        code: i64,
        #[serde(skip_serializing_if = "Option::is_none")]
        data: Option<&'a D>,
        message: &'a str,
    }
    let body = Body { error: Error { code, data, message }, id: (), jsonrpc: "2.0" };
    // Serializing these fields cannot fail (string keys, no maps); a `D` that fails says so.
    let body = serde_json::to_string(&body).unwrap_or_else(|e| {
        format!(r#"{{"error":{{"code":-32603,"message":"cannot write the error: {e}"}},"id":null,"jsonrpc":"2.0"}}"#)
    });
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
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

/// Whether `Host` (HTTP/2's `:authority` when there is no `Host`, as rmcp reads it) and `Origin`
/// are ones this server answers to.
fn rebinding_problem(request: &Request, allowed: &AllowedHosts) -> Option<&'static str> {
    let headers = request.headers();
    let host = match headers.get(header::HOST) {
        Some(host) => host.to_str().ok(),
        None => request.uri().authority().map(http::uri::Authority::as_str),
    };
    if !host.is_some_and(|h| host_allowed(&allowed.hosts, h)) {
        return Some("Host header is not allowed");
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let origin = origin.to_str().unwrap_or("");
        let listed = allowed.origins.iter().any(|o| o.eq_ignore_ascii_case(origin));
        let same_host = url::Url::parse(origin).ok().is_some_and(|u| {
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

/// A check that answers a request from its head alone, or lets it through. As a tower layer
/// ([`CheckLayer`]) it costs neither a boxed future nor a clone of the services behind it per
/// request, as `axum::middleware::from_fn` would.
pub trait HeaderCheck: Clone + Send + Sync + 'static {
    /// The answer to `request`, or `None` to pass it on.
    fn refuse(&self, request: &Request) -> Option<Response>;
}

/// The layer of a [`HeaderCheck`].
#[derive(Debug, Clone)]
pub struct CheckLayer<C> {
    check: C,
}

impl<C> CheckLayer<C> {
    /// The layer of `check`.
    pub fn new(check: C) -> Self {
        Self { check }
    }
}

impl<S, C: Clone> Layer<S> for CheckLayer<C> {
    type Service = Checked<S, C>;

    fn layer(&self, inner: S) -> Self::Service {
        Checked { inner, check: self.check.clone() }
    }
}

/// The service [`CheckLayer`] produces.
#[derive(Debug, Clone)]
pub struct Checked<S, C> {
    inner: S,
    check: C,
}

impl<S, C> Service<Request> for Checked<S, C>
where
    S: Service<Request, Response = Response>,
    C: HeaderCheck,
{
    type Response = Response;
    type Error = S::Error;
    type Future = futures::future::Either<S::Future, std::future::Ready<Result<Response, S::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        match self.check.refuse(&request) {
            Some(response) => futures::future::Either::Right(std::future::ready(Ok(response))),
            None => futures::future::Either::Left(self.inner.call(request)),
        }
    }
}

/// 403 for a foreign `Host` or `Origin`, before anything else.
pub fn rebinding_protection(allowed: Arc<AllowedHosts>) -> CheckLayer<Arc<AllowedHosts>> {
    CheckLayer { check: allowed }
}

impl HeaderCheck for Arc<AllowedHosts> {
    fn refuse(&self, request: &Request) -> Option<Response> {
        let problem = rebinding_problem(request, self)?;
        if let Some(left_out) = self.log.admit(FrontDoorRefusal::Rebinding) {
            tracing::info!(target: "mcp_ratelimit::http::front_door", problem, left_out, "refused: DNS-rebinding protection");
        }
        Some(jsonrpc_error(StatusCode::FORBIDDEN, -32000, problem, None))
    }
}

/// The token of an `Authorization: Bearer <token>` header, if any.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| {
        let (scheme, token) = v.trim().split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
    })
}

/// Whether `headers` carry `Authorization: Bearer <the key whose SHA-256 is key_sha256>`,
/// compared over all 32 bytes of the digests: the time taken depends on neither the key nor the
/// token's length.
pub fn presents_key(headers: &HeaderMap, key_sha256: &[u8; 32]) -> bool {
    bearer(headers).is_some_and(|token| same_digest(&Sha256::digest(token.as_bytes()).into(), key_sha256))
}

/// Whether two digests are equal, looking at every byte whatever the differences.
fn same_digest(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let difference = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(difference) == 0
}

/// Who may read `GET /metrics`: with `server.metrics_key`, whoever presents it as a bearer key;
/// without, anyone, unless `auth.required` is on (read live, so a reload that turns it on closes
/// `/metrics` at once): then no one until the key is set. Every other answer is `401`.
#[derive(Clone)]
pub struct MetricsKey {
    key_sha256: Option<[u8; 32]>,
    identifier: Arc<ArcSwap<Identifier>>,
    log: Arc<FrontDoorLog>,
}

impl std::fmt::Debug for MetricsKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsKey").field("set", &self.key_sha256.is_some()).finish_non_exhaustive()
    }
}

/// `401` on `/metrics` for a request without the metrics key (see [`MetricsKey`]).
pub fn metrics_key(
    key_sha256: Option<[u8; 32]>,
    identifier: Arc<ArcSwap<Identifier>>,
    log: Arc<FrontDoorLog>,
) -> CheckLayer<MetricsKey> {
    CheckLayer { check: MetricsKey { key_sha256, identifier, log } }
}

impl HeaderCheck for MetricsKey {
    fn refuse(&self, request: &Request) -> Option<Response> {
        let message = match &self.key_sha256 {
            Some(key) if presents_key(request.headers(), key) => return None,
            Some(_) => "Unauthorized: /metrics needs `Authorization: Bearer <server.metrics_key>`.",
            None if !self.identifier.load().required() => return None,
            None => {
                "Unauthorized: with auth.required, /metrics is closed until server.metrics_key is set; then send \
                     `Authorization: Bearer <server.metrics_key>`."
            }
        };
        if let Some(left_out) = self.log.admit(FrontDoorRefusal::MetricsKey) {
            tracing::info!(target: "mcp_ratelimit::http::front_door", left_out, "refused: /metrics without the metrics key");
        }
        let mut response = jsonrpc_error(StatusCode::UNAUTHORIZED, -32001, message, None);
        response.headers_mut().insert(header::WWW_AUTHENTICATE, http::HeaderValue::from_static("Bearer"));
        Some(response)
    }
}

/// Refuses an MCP `POST` that can be refused from its headers alone, before it is charged or
/// read: 413 when it declares a body over `max_body_bytes`, 415 when it is not JSON.
pub fn mcp_post_checks(max_body_bytes: usize) -> CheckLayer<PostChecks> {
    CheckLayer { check: PostChecks { max_body_bytes } }
}

/// The check of [`mcp_post_checks`].
#[derive(Debug, Clone, Copy)]
pub struct PostChecks {
    max_body_bytes: usize,
}

impl HeaderCheck for PostChecks {
    fn refuse(&self, request: &Request) -> Option<Response> {
        if request.method() != Method::POST {
            return None;
        }
        let max_body_bytes = self.max_body_bytes;
        let declared = request
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > max_body_bytes as u64) {
            return Some(jsonrpc_error(
                StatusCode::PAYLOAD_TOO_LARGE,
                -32600,
                &format!("Request body too large: the limit is {max_body_bytes} bytes."),
                None,
            ));
        }
        let json =
            request.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|v| {
                v.split(';').next().is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
            });
        (!json).then(|| {
            jsonrpc_error(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                -32600,
                "Unsupported Media Type: POST /mcp takes Content-Type: application/json.",
                None,
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{host_allowed, jsonrpc_error, jsonrpc_error_with, same_digest};

    #[test]
    fn digests_are_equal_only_when_every_byte_is() {
        let a = [7u8; 32];
        let mut b = a;
        assert!(same_digest(&a, &b));
        b[31] ^= 1;
        assert!(!same_digest(&a, &b));
    }
    use http::StatusCode;
    use serde_json::json;

    async fn body(response: axum::response::Response) -> String {
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX).await.expect("a body");
        String::from_utf8(bytes.to_vec()).expect("UTF-8")
    }

    #[tokio::test]
    async fn an_error_body_is_the_json_object_it_always_was_byte_for_byte() {
        let data = json!({"retry_after_ms": 1500, "why": "a \"quoted\" word"});
        let expected = |data: Option<serde_json::Value>| {
            let mut error = json!({"code": -32000, "message": "Too \"many\"\nrequests"});
            if let Some(data) = data {
                error["data"] = data;
            }
            json!({"jsonrpc": "2.0", "error": error, "id": null}).to_string()
        };
        let with = jsonrpc_error(StatusCode::TOO_MANY_REQUESTS, -32000, "Too \"many\"\nrequests", Some(data.clone()));
        assert_eq!(body(with).await, expected(Some(data.clone())));
        let without = jsonrpc_error(StatusCode::TOO_MANY_REQUESTS, -32000, "Too \"many\"\nrequests", None);
        assert_eq!(body(without).await, expected(None));
        #[derive(serde::Serialize)]
        struct Data {
            retry_after_ms: u64,
            why: &'static str,
        }
        let typed = Data { retry_after_ms: 1500, why: "a \"quoted\" word" };
        let typed = jsonrpc_error_with(StatusCode::TOO_MANY_REQUESTS, -32000, "Too \"many\"\nrequests", Some(&typed));
        assert_eq!(body(typed).await, expected(Some(data)));
    }

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
