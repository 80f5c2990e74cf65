//! The coarse per-caller limit on `POST /mcp`, as a tower [`Layer`].
//!
//! It runs before rmcp reads the body, so a flood costs one map lookup per request, not a JSON
//! parse and a session lookup. Only POSTs are counted — they are what costs the server work;
//! the SSE `GET` and `DELETE` of a session never are. Every counted response carries the IETF
//! RateLimit header fields (draft-ietf-httpapi-ratelimit-headers: `RateLimit-Policy` and
//! `RateLimit` as structured fields) and `RateLimit-Remaining`; a refusal is `429` with
//! `Retry-After` in whole seconds (at least 1) and a JSON-RPC error body.
//!
//! An unverified caller (no configured key, or a made-up one) is also charged, in the same
//! atomic decision, to the limit all unverified callers of its address share
//! (`limits.address_http`), so a key invented per request still meets a 429; the headers then
//! name whichever policy (`http` or `address_http`) refused, or has least left.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::response::Response;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode, header};
use tower::{Layer, Service};

use crate::http::front_door::{jsonrpc_error, jsonrpc_error_with};
use mcp_ratelimit_core::clock::{ceil_ms, ceil_secs};
use mcp_ratelimit_core::guard::shed::Arrived;
use mcp_ratelimit_core::guard::{Guard, RatePolicy};
use mcp_ratelimit_core::identity::Caller;
use mcp_ratelimit_core::limit::Decision;

/// Wraps a service with the coarse HTTP limit (`limits.http`) of each caller, and of its address
/// for an unverified caller (`limits.address_http`).
///
/// The caller must already be in the request's extensions ([`Caller`], put there by
/// [`IdentifyLayer`](crate::http::identify::IdentifyLayer) or your own layer): a request
/// without one is answered 500 rather than counted against a key everyone would share.
#[derive(Debug, Clone)]
pub struct HttpLimitLayer {
    guard: Arc<Guard>,
    every_method: bool,
}

impl HttpLimitLayer {
    /// A layer charging one unit of `guard`'s HTTP budget per `POST` (what costs an MCP server
    /// work; the SSE `GET` and `DELETE` of a session are never counted).
    pub fn new(guard: Arc<Guard>) -> Self {
        Self { guard, every_method: false }
    }

    /// Charges requests of every method, for an HTTP API that is not MCP.
    pub fn every_method(self) -> Self {
        Self { every_method: true, ..self }
    }
}

impl<S> Layer<S> for HttpLimitLayer {
    type Service = HttpLimit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        HttpLimit { inner, guard: self.guard.clone(), every_method: self.every_method }
    }
}

/// The service [`HttpLimitLayer`] produces.
#[derive(Debug, Clone)]
pub struct HttpLimit<S> {
    inner: S,
    guard: Arc<Guard>,
    every_method: bool,
}

/// The RateLimit header fields for `d`, a decision of the limit `policy`.
pub fn rate_limit_headers(d: &Decision, policy: &RatePolicy) -> HeaderMap {
    let mut headers = HeaderMap::with_capacity(3);
    let mut set = |name: &'static str, value: String| {
        if let Ok(value) = HeaderValue::from_str(&value) {
            headers.insert(HeaderName::from_static(name), value);
        }
    };
    let window = policy.limiter.policy_window().map(|w| format!(";w={}", ceil_secs(w).max(1))).unwrap_or_default();
    let name = policy.name;
    set("ratelimit-policy", format!("\"{name}\";q={}{window}", d.limit));
    set("ratelimit", format!("\"{name}\";r={};t={}", d.remaining, ceil_secs(d.reset_after)));
    set("ratelimit-remaining", d.remaining.to_string());
    headers
}

fn too_many_requests(d: &Decision, policy: &RatePolicy) -> Response {
    let retry_after_ms = ceil_ms(d.retry_after).max(1);
    #[derive(serde::Serialize)]
    struct Data {
        retry_after_ms: u64,
    }
    let mut response = jsonrpc_error_with(
        StatusCode::TOO_MANY_REQUESTS,
        -32000,
        "Too many requests. Retry after the delay in Retry-After.",
        Some(&Data { retry_after_ms }),
    );
    let headers = response.headers_mut();
    headers.extend(rate_limit_headers(d, policy));
    headers.insert(header::RETRY_AFTER, HeaderValue::from(ceil_secs(d.retry_after).max(1)));
    response
}

impl<S> Service<Request<Body>> for HttpLimit<S>
where
    S: Service<Request<Body>, Response = Response> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<Body>) -> Self::Future {
        let counted = self.every_method || request.method() == Method::POST;
        if !counted || !self.guard.enabled() {
            return Box::pin(self.inner.call(request));
        }
        let Some(caller) = request.extensions().get::<Caller>().cloned() else {
            // The identity layer always runs first; without it every caller would share one key.
            let response = jsonrpc_error(StatusCode::INTERNAL_SERVER_ERROR, -32603, "no caller identity", None);
            return Box::pin(std::future::ready(Ok(response)));
        };
        // The inner service is ready now (`poll_ready` said so); take it, leaving a clone, so
        // the future may call it after awaiting the decision (tower's usual clone-and-swap).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let guard = self.guard.clone();
        Box::pin(async move {
            let deciding = guard.clock().now();
            let decided = guard.admit_http(&caller).await;
            // The decision's round trip to the store is this server's work, not a queue: the
            // request's arrival moves on by it, so a slow store does not read as being behind
            // (`[server.shedding]`).
            if let Some(arrived) = request.extensions_mut().get_mut::<Arrived>() {
                arrived.0 += guard.clock().now() - deciding;
            }
            let Some((decision, policy)) = decided else {
                // The store could not decide: the finer limits behind this layer still apply.
                return inner.call(request).await;
            };
            if !decision.allowed {
                return Ok(too_many_requests(&decision, &policy));
            }
            let headers = rate_limit_headers(&decision, &policy);
            let mut response = inner.call(request).await?;
            response.headers_mut().extend(headers);
            Ok(response)
        })
    }
}
