//! The guarded call's span: what the guard decided about one tool call, as attributes of the span
//! of the request that asked, beside the upstream request it led to.
//!
//! Spans are `tracing` spans under one target, [`TARGET`], at `INFO`. The reference server turns
//! them into OpenTelemetry spans only when `[telemetry] otlp_endpoint` is set (a
//! tracing-opentelemetry layer filtered to this target; its log layer never shows the target).
//! With no layer that wants them, every callsite of the target is disabled once, when it is first
//! met, so [`call_span`] is a cached check that hands back a disabled span, and [`record`],
//! [`reserved`] and [`failed_open`] return at once: the hot path builds no attribute
//! and allocates nothing. The core stays free of any OpenTelemetry crate: a library user's own
//! subscriber may turn these spans into anything.
//!
//! One span per call, not one for the request and one for the decision under it: the decision is
//! the request's story (a `tools/call` is asked, decided, answered), and every span a trace holds
//! is paid for on every call — made, entered at each poll, closed, converted and encoded for the
//! collector. So [`call_span`] is the span a door makes for a `tools/call` (the MCP request's:
//! its method, tool, request id, JSON-RPC error), with the decision's fields declared empty, and
//! [`Guard::call`](crate::guard::Guard::call) records them on the span current where it runs. A
//! library user calling the guard directly makes [`call_span`] and runs the call in it.
//!
//! Fields are recorded a group at a time (`tracing::record_all!`): one dispatch to the
//! subscriber per group, not one per field, and each field once (an OpenTelemetry span keeps
//! every value recorded, so a field recorded twice would be exported twice).
//!
//! What a span names of a caller is what every other report names: its id (a hash of its key,
//! never the key: [`crate::identity`]), its tenant and tier.

use std::sync::atomic::{AtomicU64, Ordering};

use tracing::Span;
use tracing::field::Empty;

use crate::guard::Settled;
use crate::guard::call::Called;
use crate::guard::reuse::Served;
use crate::identity::Caller;

/// The `tracing` target of every span the project exports as a trace (the request's here and in
/// the rmcp glue, the upstream's in the server): what a subscriber filters on.
pub const TARGET: &str = "mcp_ratelimit::trace";

/// The share of the traces this process starts that are kept, as `f64` bits: 1 (all) until
/// [`sample_new_traces`] says otherwise.
static NEW_TRACES_KEPT: AtomicU64 = AtomicU64::new(1.0_f64.to_bits());

/// Keeps `ratio` (0 to 1; anything else is taken as the nearest of the two, NaN as 1) of the
/// traces this process starts: of the requests that arrive with no trace context of their
/// caller's. The draw is made once per request, before any span is made ([`starts_trace`]), so a
/// request that is not kept costs what traces off cost; its upstream requests make no span either
/// ([`in_trace`]). A request whose caller sent a trace context is always traced, kept or not as
/// that context's sampled flag says (the exporter's sampler is parent-based).
pub fn sample_new_traces(ratio: f64) {
    let ratio = if ratio.is_nan() { 1.0 } else { ratio.clamp(0.0, 1.0) };
    NEW_TRACES_KEPT.store(ratio.to_bits(), Ordering::Relaxed);
}

/// Whether a request with no trace context of its caller's starts a trace here: drawn at the
/// ratio [`sample_new_traces`] set.
pub fn starts_trace() -> bool {
    let kept = f64::from_bits(NEW_TRACES_KEPT.load(Ordering::Relaxed));
    kept >= 1.0 || (kept > 0.0 && rand::random::<f64>() < kept)
}

/// Whether the span current here is one of [`TARGET`]'s (a traced request's, or a span under
/// it): where the spans of the work a request leads to (an upstream request, a queued job's
/// wait) are made, and only there. A request that was not sampled ([`starts_trace`]) has none, nor
/// has work no request awaits. One cached check when no subscriber wants [`TARGET`].
pub fn in_trace() -> bool {
    tracing::enabled!(target: TARGET, tracing::Level::INFO)
        && Span::current().metadata().is_some_and(|metadata| metadata.target() == TARGET)
}

/// The span of one `tools/call` of `tool` (the MCP request `request_id`, if it has one), named
/// `tools/call` (`otel.name`), a child of the span current where it is made: the fields of the MCP
/// request (its id, and its JSON-RPC error, recorded by the door) and of the guard's decision (recorded by [`Guard::call`](crate::guard::Guard::call)
/// run inside it), empty until then. Disabled, and free, when no subscriber wants [`TARGET`].
pub fn call_span(tool: &str, request_id: Option<&dyn std::fmt::Display>) -> Span {
    tracing::info_span!(
        target: TARGET,
        "mcp.request",
        "otel.name" = "tools/call",
        "otel.kind" = "server",
        "mcp.method.name" = "tools/call",
        "mcp.tool.name" = tool,
        "mcp.request.id" = request_id.map(tracing::field::display),
        "rpc.jsonrpc.error_code" = Empty,
        "ratelimit.layer" = "tool",
        "ratelimit.caller.id" = Empty,
        "ratelimit.caller.tenant" = Empty,
        "ratelimit.caller.tier" = Empty,
        "ratelimit.outcome" = Empty,
        "ratelimit.code" = Empty,
        "ratelimit.scope" = Empty,
        "ratelimit.limit" = Empty,
        "ratelimit.remaining" = Empty,
        "ratelimit.retry_after_ms" = Empty,
        "ratelimit.reserved" = Empty,
        "ratelimit.charged" = Empty,
        "ratelimit.served" = Empty,
        "ratelimit.warnings" = Empty,
        "ratelimit.fail_open" = Empty,
        "ratelimit.loop.same_answers" = Empty,
        "ratelimit.loop.refused_for_ms" = Empty,
    )
}

/// The span the guard records on: the one current where it runs, when a subscriber wants
/// [`TARGET`] (one cached check when none does). A span without the decision's fields (not a
/// [`call_span`]) takes none of them: `tracing` skips a field its span does not declare.
fn current() -> Option<Span> {
    if !tracing::enabled!(target: TARGET, tracing::Level::INFO) {
        return None;
    }
    Some(Span::current()).filter(|span| !span.is_disabled())
}

/// Records on the current span, in one dispatch, who called (`caller`'s id, tier and tenant) and
/// what the call came to: its outcome, the refusal's budget and wait, the units it was charged
/// (those it reserved were recorded when it was admitted: [`reserved`]), how it was served, how
/// many limits it took past their warning, and how many identical answers in a row its tool gave
/// (when it warned or stopped).
pub fn record<A>(caller: &Caller, called: &Called<A>) {
    let Some(span) = current() else { return };
    let (outcome, refusal, settled) = match called {
        Called::Refused(refusal) => ("refused", Some(refusal), None),
        Called::RefusedAfter { refusal, settled } => ("refused_after", Some(refusal), settled.as_ref()),
        Called::Answered { settled, .. } => ("answered", None, settled.as_ref()),
        Called::Cancelled => ("cancelled", None, None),
        Called::Lost => ("lost", None, None),
    };
    let (served, warnings, no_progress) = match called {
        Called::Answered { served, warnings, no_progress, .. } => {
            let served = match served {
                Served::Asked => "asked",
                Served::Coalesced => "coalesced",
                Served::Cached => "cached",
            };
            (Some(served), Some(u64::try_from(warnings.len()).unwrap_or(u64::MAX)), no_progress.as_ref())
        }
        _ => (None, None, None),
    };
    tracing::record_all!(
        span,
        "ratelimit.caller.id" = caller.id(),
        "ratelimit.caller.tier" = caller.tier(),
        "ratelimit.caller.tenant" = caller.tenant(),
        "ratelimit.outcome" = outcome,
        "ratelimit.code" = refusal.map(|r| r.code.as_str()),
        "ratelimit.scope" = refusal.and_then(|r| r.scope.as_deref()),
        "ratelimit.limit" = refusal.and_then(|r| r.limit),
        "ratelimit.remaining" = refusal.and_then(|r| r.remaining),
        "ratelimit.retry_after_ms" = refusal.and_then(|r| r.retry_after_ms),
        "ratelimit.charged" = settled.map(|s: &Settled| s.charged),
        "ratelimit.served" = served,
        "ratelimit.warnings" = warnings,
        // The tool keeps giving this caller the same answer: warned, or stopped from now on.
        "ratelimit.loop.same_answers" = no_progress.map(|n| n.same_answers),
        "ratelimit.loop.refused_for_ms" = no_progress.and_then(|n| n.refused_for_ms),
    );
}

/// Records on the current span the units the call's price reserved, known before the work runs
/// (a job settles it only when it is final).
pub fn reserved(units: u64) {
    if let Some(span) = current() {
        tracing::record_all!(span, "ratelimit.reserved" = units);
    }
}

/// Marks the current span: the guard decided on its insurance limiter, because the shared store
/// could not decide; the call failed open.
pub fn failed_open() {
    if let Some(span) = current() {
        tracing::record_all!(span, "ratelimit.fail_open" = true);
    }
}
