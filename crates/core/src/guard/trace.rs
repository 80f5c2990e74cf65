//! The guarded call's span: what the guard decided about one tool call, as attributes a trace
//! shows beside the request that asked and the upstream request it led to.
//!
//! Spans are `tracing` spans under one target, [`TARGET`], at `INFO`. The reference server turns
//! them into OpenTelemetry spans only when `[telemetry] otlp_endpoint` is set (a
//! tracing-opentelemetry layer filtered to this target; its log layer never shows the target).
//! With no layer that wants them, every callsite of the target is disabled once, when it is first
//! met, so [`call_span`] is a cached check that hands back a disabled span, and [`record`] returns
//! at once: the hot path builds no attribute and allocates nothing. The core stays free of any
//! OpenTelemetry crate: a library user's own subscriber may turn these spans into anything.
//!
//! What a span names of a caller is what every other report names: its id (a hash of its key,
//! never the key: [`crate::identity`]), its tenant and tier.

use tracing::Span;
use tracing::field::Empty;

use crate::guard::call::Called;
use crate::guard::reuse::Served;
use crate::guard::{Refusal, Settled};
use crate::identity::Caller;

/// The `tracing` target of every span the project exports as a trace (the guard's here, the
/// request's in the rmcp glue, the upstream's in the server): what a subscriber filters on.
pub const TARGET: &str = "mcp_ratelimit::trace";

/// The span of one guarded call of `tool` by `caller`, a child of the span current where it is
/// made (the MCP request's); disabled, and free, when no subscriber wants [`TARGET`].
pub fn call_span(tool: &str, caller: &Caller) -> Span {
    let span = tracing::info_span!(
        target: TARGET,
        "ratelimit.guard",
        "mcp.tool.name" = tool,
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
    );
    if !span.is_disabled() {
        span.record("ratelimit.caller.id", caller.id());
        span.record("ratelimit.caller.tier", caller.tier());
        if let Some(tenant) = caller.tenant() {
            span.record("ratelimit.caller.tenant", tenant);
        }
    }
    span
}

/// Records on `span` what the call came to: its outcome, the refusal's budget and wait, its
/// price reserved and charged, how it was served, how many limits it took past their warning,
/// and how many identical answers in a row its tool gave (when it warned or stopped).
pub fn record<A>(span: &Span, called: &Called<A>) {
    if span.is_disabled() {
        return;
    }
    match called {
        Called::Refused(refusal) => {
            span.record("ratelimit.outcome", "refused");
            refused(span, refusal);
        }
        Called::RefusedAfter { refusal, settled } => {
            span.record("ratelimit.outcome", "refused_after");
            refused(span, refusal);
            priced(span, settled.as_ref());
        }
        Called::Answered { served, settled, warnings, no_progress, .. } => {
            span.record("ratelimit.outcome", "answered");
            let served = match served {
                Served::Asked => "asked",
                Served::Coalesced => "coalesced",
                Served::Cached => "cached",
            };
            span.record("ratelimit.served", served);
            span.record("ratelimit.warnings", u64::try_from(warnings.len()).unwrap_or(u64::MAX));
            priced(span, settled.as_ref());
            // The tool keeps giving this caller the same answer: warned, or stopped from now on.
            if let Some(no_progress) = no_progress {
                span.record("ratelimit.loop.same_answers", no_progress.same_answers);
                if let Some(ms) = no_progress.refused_for_ms {
                    span.record("ratelimit.loop.refused_for_ms", ms);
                }
            }
        }
        Called::Cancelled => {
            span.record("ratelimit.outcome", "cancelled");
        }
        Called::Lost => {
            span.record("ratelimit.outcome", "lost");
        }
    }
}

/// Records on the span current where a call was admitted (its guard span) the units its price
/// reserved, known before the work runs (a job settles it only when it is final). One cached
/// check when no subscriber wants [`TARGET`].
pub fn reserved(units: u64) {
    if tracing::enabled!(target: TARGET, tracing::Level::INFO) {
        Span::current().record("ratelimit.reserved", units);
    }
}

/// Marks the span current where the guard decided on its insurance limiter, because the shared
/// store could not decide: the call failed open.
pub fn failed_open() {
    if tracing::enabled!(target: TARGET, tracing::Level::INFO) {
        Span::current().record("ratelimit.fail_open", true);
    }
}

fn refused(span: &Span, refusal: &Refusal) {
    span.record("ratelimit.code", refusal.code.as_str());
    if let Some(scope) = refusal.scope.as_deref() {
        span.record("ratelimit.scope", scope);
    }
    if let Some(limit) = refusal.limit {
        span.record("ratelimit.limit", limit);
    }
    if let Some(remaining) = refusal.remaining {
        span.record("ratelimit.remaining", remaining);
    }
    if let Some(wait) = refusal.retry_after_ms {
        span.record("ratelimit.retry_after_ms", wait);
    }
}

fn priced(span: &Span, settled: Option<&Settled>) {
    if let Some(settled) = settled {
        span.record("ratelimit.reserved", settled.reserved);
        span.record("ratelimit.charged", settled.charged);
    }
}
