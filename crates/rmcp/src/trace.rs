//! The span of an MCP request, continuing the trace its caller sent: the W3C `traceparent` (and
//! `tracestate`) of the request's `_meta` (MCP's place for it, SEP-414), else of its HTTP headers
//! (what a client instrumented with OpenTelemetry sends). A `_meta` one wins.
//!
//! The span is a `tracing` span of the core's trace target
//! ([`TARGET`](mcp_ratelimit_core::guard::trace::TARGET)), disabled — and free — unless a
//! subscriber wants that target; the guard's span ([`mcp_ratelimit_core::guard::trace`]) is its
//! child. With the feature `opentelemetry`, a subscriber with a tracing-opentelemetry layer (the
//! reference server's `[telemetry]`) makes it a child of the caller's span, read with the
//! propagator set in `opentelemetry::global`; without it the span starts its own trace.

use rmcp::RoleServer;
use rmcp::service::RequestContext;
use tracing::Span;

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
    );
    if !span.is_disabled() {
        span.record("mcp.request.id", tracing::field::display(&context.id));
        #[cfg(feature = "opentelemetry")]
        continue_trace(&span, context);
    }
    span
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
