//! OpenTelemetry traces (`[telemetry]`): the spans the request path makes, exported over OTLP/HTTP
//! (protobuf) to a collector, and the W3C trace context they carry to the paid API and the proxied
//! server.
//!
//! The spans are `tracing` spans of one target ([`TARGET`]): the MCP request's (made by the rmcp
//! glue, `mcp_ratelimit_rmcp::trace`, continuing the caller's `traceparent`), the guard's decision
//! under it (`mcp_ratelimit_core::guard::trace`), and each request to the paid API or the proxied
//! server (here, in `upstream` and `proxy`). [`Telemetry::layer`] turns them into OpenTelemetry
//! spans: a tracing-opentelemetry layer with a filter of its own that lets only [`TARGET`] through,
//! beside the log layer, whose filter ([`log_filter`]) never lets it through.
//!
//! Why `tracing` spans, not the OpenTelemetry API directly: the guard is in a crate that must not
//! depend on an exporter, and a `tracing` span is already how its callers (a library user's
//! subscriber too) hear of what it does. Why it costs nothing when off: with `[telemetry]` off no
//! layer wants [`TARGET`], so `tracing` marks each of its callsites disabled the first time it is
//! met, and from then on a span macro is one load of that cached interest returning a disabled
//! span; no attribute is formatted (each recording checks `is_disabled` first), no exporter, no
//! thread, no header is written. The batch exporter runs on a thread of its own with a bounded
//! queue: a collector that is slow or down drops spans, never holds a request. The queue is bounded
//! in bytes too ([`bounded`]: 2,048 spans, 8 MiB), and every value a caller chose is cut to 128
//! bytes where its span is made, so a caller's huge ids cannot fill the server's memory.
//!
//! What goes on with a request: the paid API hears only the `traceparent` of the server's own
//! span of it ([`inject_traceparent`]), never a caller's `tracestate`; a proxied server hears the
//! proxy's span's context ([`context_of`]), whose `tracestate` is the caller's only when it was 1
//! to 512 bytes of printable ASCII (read by the rmcp glue, `mcp_ratelimit_rmcp::trace`).

pub mod bounded;

use std::collections::HashMap;
use std::sync::Arc;

use opentelemetry::propagation::{Injector, TextMapPropagator};
use opentelemetry::trace::TracerProvider;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracerProvider};
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::Layer;
use tracing_subscriber::filter::{Directive, Targets};
use tracing_subscriber::registry::LookupSpan;

use crate::config::TelemetryConfig;
use bounded::{Bounded, Counted, TraceQueue};

pub use mcp_ratelimit_core::guard::trace::TARGET;
use mcp_ratelimit_core::guard::trace::in_trace;

/// The W3C trace context's names, as HTTP headers and as request `_meta` keys (SEP-414).
pub const TRACEPARENT: &str = "traceparent";
/// See [`TRACEPARENT`].
pub const TRACESTATE: &str = "tracestate";

/// Traces that cannot be sent: the exporter could not be built.
#[derive(Debug, thiserror::Error)]
#[error("cannot start the OTLP exporter for `telemetry.otlp_endpoint`: {0}")]
pub struct TelemetryError(String);

/// The running exporter of `[telemetry]`: spans go to the collector until it is shut down.
#[derive(Debug)]
pub struct Telemetry {
    provider: SdkTracerProvider,
    queue: Arc<TraceQueue>,
}

impl Telemetry {
    /// An exporter posting batches of spans to `config.traces_url` every
    /// `config.export_interval`, each span of service `config.service_name`; a trace this server
    /// starts is kept at `config.sample_ratio`, one a caller started as its sampled flag says.
    /// Sets the process's propagator to W3C Trace Context, which the spans' `traceparent` is read
    /// and written with. Needs no runtime: the exporter has a thread of its own.
    pub fn start(config: &TelemetryConfig) -> Result<Self, TelemetryError> {
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(config.traces_url.as_str())
            .with_timeout(config.export_timeout)
            .build()
            .map_err(|e| TelemetryError(e.to_string()))?;
        let queue = Arc::new(TraceQueue::default());
        let batches = BatchConfigBuilder::default()
            .with_scheduled_delay(config.export_interval)
            .with_max_queue_size(bounded::MAX_SPANS)
            .build();
        let exporter = Counted::new(exporter, queue.clone());
        let processor = BatchSpanProcessor::builder(exporter).with_batch_config(batches).build();
        let processor = Bounded::new(processor, queue.clone());
        // The share of new traces is drawn per request before any span is made (so one not kept
        // costs nothing); a span with no parent here is one that draw kept.
        mcp_ratelimit_core::guard::trace::sample_new_traces(config.sample_ratio);
        let sampler = Sampler::ParentBased(Box::new(Sampler::AlwaysOn));
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_sampler(sampler)
            .with_resource(Resource::builder().with_service_name(config.service_name.clone()).build())
            .build();
        Ok(Self { provider, queue })
    }

    /// The spans waiting for the collector and those dropped, as `/metrics` shows them
    /// ([`AppState::watch_traces`](crate::state::AppState::watch_traces)).
    pub fn queue(&self) -> Arc<TraceQueue> {
        self.queue.clone()
    }

    /// The layer that turns the spans of [`TARGET`] into OpenTelemetry spans of this exporter,
    /// and sees nothing else. What it would add by default and the trace does not need is left
    /// out, because each is paid on every span or every poll of a traced future: the code
    /// location and thread, the target (every span has the one), busy/idle times (two clock reads
    /// at each enter and exit), and the OpenTelemetry context made current at each enter (nothing
    /// here reads the current context: a request that passes the trace on reads its span's own,
    /// [`context_of`]).
    pub fn layer<S>(&self) -> impl Layer<S> + use<S>
    where
        S: tracing::Subscriber + for<'span> LookupSpan<'span>,
    {
        let tracer = self.provider.tracer("mcp-ratelimit");
        tracing_opentelemetry::layer()
            .with_tracer(tracer)
            .with_location(false)
            .with_threads(false)
            .with_target(false)
            .with_tracked_inactivity(false)
            .with_context_activation(false)
            .with_filter(Targets::new().with_target(TARGET, tracing::Level::INFO))
    }

    /// Sends every finished span now, waiting for the collector's answer.
    pub fn flush(&self) -> Result<(), TelemetryError> {
        self.provider.force_flush().map_err(|e| TelemetryError(e.to_string()))
    }

    /// Sends what is left and stops the exporter's thread. Blocks: call it outside the async
    /// runtime (after it has stopped), as `main` does.
    pub fn shutdown(self) -> Result<(), TelemetryError> {
        self.provider.shutdown().map_err(|e| TelemetryError(e.to_string()))
    }
}

/// The span `make` makes, for work a request leads to (a request to the paid API or the proxied
/// server), a child of the span current here — only inside a traced request ([`in_trace`]): a
/// request not sampled makes no span of its work, nor does work no request awaits, and `make` is
/// then never called.
pub fn of_work(make: impl FnOnce() -> Span) -> Span {
    if in_trace() { make() } else { Span::none() }
}

/// As [`of_work`], for work that outlives the request that started it (a queued job's wait, its
/// watch): the span `make` makes with no `tracing` parent (`parent: None`) is the current span's
/// child in the trace, but not in `tracing`. A `tracing` parent is kept open until its last child
/// closes, so the request's span would be sent only when the job ends; an OpenTelemetry parent is
/// a name.
pub fn of_later_work(make: impl FnOnce() -> Span) -> Span {
    let span = of_work(make);
    if !span.is_disabled() {
        // Only a subscriber without the layer refuses, and then there is no trace to join.
        let _ = span.set_parent(Span::current().context());
    }
    span
}

/// `filter` (the log layer's) never letting [`TARGET`] through, whatever `RUST_LOG` says: those
/// spans are for the exporter, and a log that showed them would make them cost when traces are off.
pub fn log_filter(filter: tracing_subscriber::EnvFilter) -> tracing_subscriber::EnvFilter {
    match format!("{TARGET}=off").parse::<Directive>() {
        Ok(off) => filter.add_directive(off),
        Err(_) => filter,
    }
}

/// The W3C trace context of `span` (`traceparent`, and `tracestate` if it has one), to send on
/// with a request it makes; `None` when the span is not exported (traces off, or not sampled
/// and not to be passed on).
pub fn context_of(span: &Span) -> Option<HashMap<String, String>> {
    let mut carrier = Carrier::default();
    inject(span, &mut carrier);
    carrier.0.contains_key(TRACEPARENT).then_some(carrier.0)
}

/// Puts the `traceparent` of `span`, the server's own span of a request to the paid API, in
/// `headers`, over any there: written straight into the map, with no map of its own in between.
/// Never a `tracestate`: the caller's would ride along (a span's context carries its parent's),
/// and the paid API hears only the server's own span.
pub fn inject_traceparent(span: &Span, headers: &mut http::HeaderMap) {
    inject(span, &mut Only(TRACEPARENT, &mut Headers(headers)));
}

/// Writes the W3C trace context of `span` into `carrier`, an empty value (a `tracestate` the caller
/// never sent) left out; nothing when `span` is disabled.
fn inject(span: &Span, carrier: &mut dyn Injector) {
    if !span.is_disabled() {
        TraceContextPropagator::new().inject_context(&span.context(), &mut NonEmpty(carrier));
    }
}

/// A carrier given only the value of one name.
struct Only<'a>(&'static str, &'a mut dyn Injector);

impl Injector for Only<'_> {
    fn set(&mut self, key: &str, value: String) {
        if key == self.0 {
            self.1.set(key, value);
        }
    }
}

/// A carrier that is never given an empty value.
struct NonEmpty<'a>(&'a mut dyn Injector);

impl Injector for NonEmpty<'_> {
    fn set(&mut self, key: &str, value: String) {
        if !value.is_empty() {
            self.0.set(key, value);
        }
    }
}

/// A W3C trace context as a map of its headers' names to their values.
#[derive(Default)]
struct Carrier(HashMap<String, String>);

impl Injector for Carrier {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key.to_owned(), value);
    }
}

/// HTTP headers as a propagator writes a trace context into them.
struct Headers<'a>(&'a mut http::HeaderMap);

impl Injector for Headers<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) =
            (http::HeaderName::from_bytes(key.as_bytes()), http::HeaderValue::try_from(value))
        {
            self.0.insert(name, value);
        }
    }
}
