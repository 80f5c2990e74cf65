//! The span of an MCP request, continuing the trace its caller sent: the W3C `traceparent` (and
//! `tracestate`) of the request's `_meta` (MCP's place for it, SEP-414), else of its HTTP headers
//! (what a client instrumented with OpenTelemetry sends). A `_meta` one wins.
//!
//! The span is a `tracing` span of the core's trace target
//! ([`TARGET`]), disabled — and free — unless a
//! subscriber wants that target; the guard's span ([`mcp_ratelimit_core::guard::trace`]) is its
//! child. With the feature `opentelemetry`, a subscriber with a tracing-opentelemetry layer (the
//! reference server's `[telemetry]`) makes it a child of the caller's span, read with the
//! propagator set in `opentelemetry::global`; without it the span starts its own trace.

use std::future::Future;

use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer};
use tracing::{Instrument, Span};

use mcp_ratelimit_core::guard::trace::TARGET;

/// The span of one MCP request of `method` (`tools/call`, naming `tool`), continuing the trace
/// `context` carries; disabled when no subscriber wants it.
pub fn request_span(method: &str, tool: Option<&str>, context: &RequestContext<RoleServer>) -> Span {
    let span = tracing::info_span!(
        target: TARGET,
        "mcp.request",
        "otel.name" = method,
        "otel.kind" = "server",
        "mcp.method.name" = method,
        "mcp.tool.name" = tool,
        "mcp.request.id" = tracing::field::Empty,
        "rpc.jsonrpc.error_code" = tracing::field::Empty,
    );
    if !span.is_disabled() {
        span.record("mcp.request.id", tracing::field::display(&context.id));
        #[cfg(feature = "opentelemetry")]
        continue_trace(&span, context);
    }
    span
}

/// `handling`, the handler of an MCP request of `method`, run in the request's span
/// ([`request_span`]), which records the JSON-RPC error it answers, if any (a method limit's
/// refusal is one: `-32000`). With no subscriber wanting the span, `handling` is simply awaited.
pub async fn traced<T>(
    method: &str,
    context: &RequestContext<RoleServer>,
    handling: impl Future<Output = Result<T, ErrorData>>,
) -> Result<T, ErrorData> {
    let span = request_span(method, None, context);
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

/// Makes `span` a child of the trace `context` carries, if it carries one.
#[cfg(feature = "opentelemetry")]
fn continue_trace(span: &Span, context: &RequestContext<RoleServer>) {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let parent = opentelemetry::global::get_text_map_propagator(|propagator| propagator.extract(&Carried(context)));
    if parent.span().span_context().is_valid() {
        // Only a subscriber without the layer refuses, and then there is nothing to continue.
        let _ = span.set_parent(parent);
    }
}

/// A request's W3C trace context, as an OpenTelemetry propagator reads it: from `_meta` when it
/// holds a `traceparent`, else from the HTTP request's headers.
#[cfg(feature = "opentelemetry")]
struct Carried<'a>(&'a RequestContext<RoleServer>);

#[cfg(feature = "opentelemetry")]
impl Carried<'_> {
    fn in_meta(&self) -> bool {
        self.0.meta.0.get("traceparent").is_some_and(serde_json::Value::is_string)
    }
}

#[cfg(feature = "opentelemetry")]
impl opentelemetry::propagation::Extractor for Carried<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        if self.in_meta() {
            return self.0.meta.0.get(key).and_then(serde_json::Value::as_str);
        }
        let parts = self.0.extensions.get::<http::request::Parts>()?;
        parts.headers.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        vec!["traceparent", "tracestate"]
    }
}
