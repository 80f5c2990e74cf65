//! The span of an MCP request, continuing the trace its caller sent: the W3C `traceparent` (and
//! `tracestate`) of the request's `_meta` (MCP's place for it, SEP-414), else of its HTTP headers
//! (what a client instrumented with OpenTelemetry sends). A `_meta` one wins. A `tracestate` is
//! continued only if [`accepted_tracestate`](mcp_ratelimit_core::guard::trace::accepted_tracestate)
//! (1 to 512 bytes of printable ASCII): the span keeps it, and every span of the trace under it.
//! The request's id is cut to 128 bytes on its span, as every value a caller chose.
//!
//! The span is a `tracing` span of the core's trace target ([`TARGET`]), disabled — and free —
//! unless a subscriber wants that target. A `tools/call`'s is the core's
//! [`call_span`](mcp_ratelimit_core::guard::trace::call_span), which the guard records its
//! decision on: one span for the request and what was decided about it. With the feature `opentelemetry`, a subscriber with a tracing-opentelemetry layer (the
//! reference server's `[telemetry]`) makes it a child of the caller's span, read with the
//! propagator set in `opentelemetry::global`; without it the span starts its own trace.

use std::future::Future;

use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer};
use tracing::{Instrument, Span};

use mcp_ratelimit_core::guard::trace::{Cut, TARGET};

/// The span of one MCP request of `method` other than `tools/call`, continuing the trace `context`
/// carries; disabled when no subscriber wants it or the request is not traced (no caller's trace
/// context, and [`starts_trace`](mcp_ratelimit_core::guard::trace::starts_trace) did not keep it).
pub fn request_span(method: &str, context: &RequestContext<RoleServer>) -> Span {
    let Some(parent) = traced_request(context) else { return Span::none() };
    let span = tracing::info_span!(
        target: TARGET,
        "mcp.request",
        "otel.name" = method,
        "otel.kind" = "server",
        "mcp.method.name" = method,
        "mcp.request.id" = tracing::field::display(Cut(&context.id)),
        "rpc.jsonrpc.error_code" = tracing::field::Empty,
    );
    parent.adopt(&span);
    span
}

/// The span of one `tools/call` of `tool` ([`call_span`](mcp_ratelimit_core::guard::trace::call_span):
/// the request's, holding the guard's decision too), continuing the trace `context` carries;
/// disabled when no subscriber wants it or the request is not traced (as [`request_span`]).
pub fn call_span(tool: &str, context: &RequestContext<RoleServer>) -> Span {
    call_span_of(tool, &context.id, Carrier::of(context))
}

/// [`call_span`] of a request read without rmcp (the proxy's relay lane): its id, and the trace
/// context its `_meta` or HTTP headers carry.
pub fn call_span_of(tool: &str, request_id: &dyn std::fmt::Display, carrier: Carrier<'_>) -> Span {
    let Some(parent) = traced_carrier(carrier) else { return Span::none() };
    let span = mcp_ratelimit_core::guard::trace::call_span(tool, Some(request_id));
    parent.adopt(&span);
    span
}

/// Where a request carries its caller's trace context: its `_meta`, and its HTTP headers (none
/// over stdio).
#[derive(Debug, Clone, Copy)]
pub struct Carrier<'a> {
    /// The request's `_meta`.
    pub meta: &'a serde_json::Map<String, serde_json::Value>,
    /// Its HTTP request's headers.
    pub headers: Option<&'a http::HeaderMap>,
}

impl<'a> Carrier<'a> {
    /// What `context`'s request carries.
    pub fn of(context: &'a RequestContext<RoleServer>) -> Self {
        let headers = context.extensions.get::<http::request::Parts>().map(|parts| &parts.headers);
        Self { meta: &context.meta.0, headers }
    }
}

/// Whether the request `context` is of makes a span, and the caller's trace it continues, if any:
/// always when its caller sent a trace context (kept or not as that says), or when it runs inside
/// a span of ours; otherwise when this process starts a trace for it
/// ([`starts_trace`](mcp_ratelimit_core::guard::trace::starts_trace)). `Some` when no subscriber
/// wants the spans: their macro is then the cheap check.
fn traced_request(context: &RequestContext<RoleServer>) -> Option<Parent> {
    traced_carrier(Carrier::of(context))
}

/// [`traced_request`], of what a request carries.
fn traced_carrier(carrier: Carrier<'_>) -> Option<Parent> {
    if !tracing::enabled!(target: TARGET, tracing::Level::INFO) {
        return Some(Parent::default());
    }
    let parent = Parent::of(carrier);
    // The draw before the look at the current span: at ratio 1 it is all there is to it.
    (parent.is_some()
        || mcp_ratelimit_core::guard::trace::starts_trace()
        || mcp_ratelimit_core::guard::trace::in_trace())
    .then_some(parent)
}

/// The trace context a request's caller sent, read with the propagator set in
/// `opentelemetry::global` (none without the feature `opentelemetry`).
#[derive(Default)]
struct Parent(#[cfg(feature = "opentelemetry")] Option<opentelemetry::Context>);

impl Parent {
    #[cfg(feature = "opentelemetry")]
    fn of(carrier: Carrier<'_>) -> Self {
        use opentelemetry::trace::TraceContextExt;
        let parent = opentelemetry::global::get_text_map_propagator(|propagator| propagator.extract(&Carried(carrier)));
        Self(parent.span().span_context().is_valid().then_some(parent))
    }

    #[cfg(not(feature = "opentelemetry"))]
    fn of(_: Carrier<'_>) -> Self {
        Self::default()
    }

    #[cfg(feature = "opentelemetry")]
    fn is_some(&self) -> bool {
        self.0.is_some()
    }

    #[cfg(not(feature = "opentelemetry"))]
    fn is_some(&self) -> bool {
        false
    }

    /// Makes `span` a child of this trace, if there is one (and `span` is enabled).
    #[cfg(feature = "opentelemetry")]
    fn adopt(self, span: &Span) {
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        if let (false, Some(parent)) = (span.is_disabled(), self.0) {
            // Only a subscriber without the layer refuses, and then there is nothing to continue.
            let _ = span.set_parent(parent);
        }
    }

    #[cfg(not(feature = "opentelemetry"))]
    fn adopt(self, _: &Span) {}
}

/// `handling`, the handler of an MCP request of `method`, run in the request's span
/// ([`request_span`]), which records the JSON-RPC error it answers, if any (a method limit's
/// refusal is one: `-32000`). With no subscriber wanting the span, `handling` is simply awaited.
pub async fn traced<T>(
    method: &str,
    context: &RequestContext<RoleServer>,
    handling: impl Future<Output = Result<T, ErrorData>>,
) -> Result<T, ErrorData> {
    let span = request_span(method, context);
    if span.is_disabled() {
        return handling.await;
    }
    let handled = handling.instrument(span.clone()).await;
    record_error(&span, &handled);
    handled
}

/// Records on a request's `span` the JSON-RPC error `handled` is, if it is one.
pub fn record_error<T>(span: &Span, handled: &Result<T, ErrorData>) {
    if let (false, Err(error)) = (span.is_disabled(), handled) {
        span.record("rpc.jsonrpc.error_code", error.code.0);
    }
}

/// A request's W3C trace context, as an OpenTelemetry propagator reads it: from `_meta` when it
/// holds a `traceparent`, else from the HTTP request's headers.
#[cfg(feature = "opentelemetry")]
struct Carried<'a>(Carrier<'a>);

#[cfg(feature = "opentelemetry")]
impl Carried<'_> {
    fn in_meta(&self) -> bool {
        self.0.meta.get("traceparent").is_some_and(serde_json::Value::is_string)
    }
}

#[cfg(feature = "opentelemetry")]
impl opentelemetry::propagation::Extractor for Carried<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        let value = if self.in_meta() {
            self.0.meta.get(key).and_then(serde_json::Value::as_str)
        } else {
            self.0.headers?.get(key).and_then(|value| value.to_str().ok())
        };
        // A tracestate out of bounds is dropped, its traceparent kept.
        value.filter(|value| key != "tracestate" || mcp_ratelimit_core::guard::trace::accepted_tracestate(value))
    }

    fn keys(&self) -> Vec<&str> {
        vec!["traceparent", "tracestate"]
    }
}
