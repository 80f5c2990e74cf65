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
//! What a span names of a caller is what every other report names: its id (a hash of its key or
//! of its token's issuer and subject, never the credential: [`crate::identity`]), how it proved
//! it, its tenant, tier and OAuth client.
//!
//! A span holds no value at the size its sender chose: a JSON-RPC id, a tool name before it is
//! checked, a tenant or client from a token's claims, a scope naming them are cut to
//! [`MAX_ATTRIBUTE_BYTES`] where the span is made ([`cut`], [`Cut`]), on a character boundary. An
//! exporter's queue bounds spans by count, not size: one session's pings with 4 MB ids once held
//! 900 MB in it. A caller's W3C `tracestate` is continued only when [`accepted_tracestate`].

use std::fmt;
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

/// The most bytes of a value a span holds that its caller chose (or could have): a JSON-RPC id,
/// a tool name before it is checked, a tenant, a client, a scope, a URL path.
pub const MAX_ATTRIBUTE_BYTES: usize = 128;

/// `value` cut to at most [`MAX_ATTRIBUTE_BYTES`] bytes, at a character boundary.
pub fn cut(value: &str) -> &str {
    let mut end = value.len().min(MAX_ATTRIBUTE_BYTES);
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    &value[..end]
}

/// `T` written at most [`MAX_ATTRIBUTE_BYTES`] long, at a character boundary, and never formatted
/// whole (a 4 MB JSON-RPC id stops being written at its 128th byte): for a span field recorded as
/// `tracing::field::display`.
#[derive(Debug, Clone, Copy)]
pub struct Cut<T>(pub T);

impl<T: fmt::Display> fmt::Display for Cut<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        /// Passes on what fits, then stops the writer with an error of its own.
        struct UpTo<'a, 'b> {
            out: &'a mut fmt::Formatter<'b>,
            left: usize,
            full: bool,
        }
        impl fmt::Write for UpTo<'_, '_> {
            fn write_str(&mut self, text: &str) -> fmt::Result {
                let mut end = text.len().min(self.left);
                while !text.is_char_boundary(end) {
                    end -= 1;
                }
                self.out.write_str(&text[..end])?;
                self.left -= end;
                if end < text.len() {
                    self.full = true;
                    return Err(fmt::Error);
                }
                Ok(())
            }
        }
        let mut up_to = UpTo { out: f, left: MAX_ATTRIBUTE_BYTES, full: false };
        match fmt::write(&mut up_to, format_args!("{}", self.0)) {
            // Stopped here, because the rest would not fit: what fitted is written.
            Err(_) if up_to.full => Ok(()),
            written => written,
        }
    }
}

/// The most bytes of a caller's `tracestate` continued (W3C allows 32 members of 256 characters;
/// a vendor's own rarely takes more than a few dozen).
pub const MAX_TRACESTATE_BYTES: usize = 512;

/// Whether a caller's W3C `tracestate` is continued: 1 to [`MAX_TRACESTATE_BYTES`] bytes of
/// printable ASCII. Anything else is dropped (its `traceparent` still counts): it would ride on
/// every span of the trace, and on every request the trace leads to.
pub fn accepted_tracestate(value: &str) -> bool {
    (1..=MAX_TRACESTATE_BYTES).contains(&value.len()) && value.bytes().all(|b| (0x20..0x7f).contains(&b))
}

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
        "mcp.tool.name" = cut(tool),
        "mcp.request.id" = request_id.map(|id| tracing::field::display(Cut(id))),
        "rpc.jsonrpc.error_code" = Empty,
        "ratelimit.layer" = "tool",
        "ratelimit.caller.id" = Empty,
        "ratelimit.caller.tenant" = Empty,
        "ratelimit.caller.tier" = Empty,
        "ratelimit.caller.proof" = Empty,
        "ratelimit.caller.client" = Empty,
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
        "ratelimit.caller.id" = cut(caller.id()),
        "ratelimit.caller.tier" = cut(caller.tier()),
        "ratelimit.caller.tenant" = caller.tenant().map(cut),
        "ratelimit.caller.proof" = caller.proof().as_str(),
        "ratelimit.caller.client" = caller.client().map(cut),
        "ratelimit.outcome" = outcome,
        "ratelimit.code" = refusal.map(|r| r.code.as_str()),
        "ratelimit.scope" = refusal.and_then(|r| r.scope.as_deref()).map(cut),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_is_cut_at_a_character_boundary_and_never_formatted_whole() {
        assert_eq!(cut("short"), "short");
        let euros = "€".repeat(100);
        assert_eq!(cut(&euros), "€".repeat(42), "126 bytes: a 43rd would need 129");
        assert_eq!(Cut(&euros).to_string(), "€".repeat(42));
        assert_eq!(Cut(12_345_u64).to_string(), "12345");
        let long = "x".repeat(4 << 20);
        assert_eq!(Cut(&long).to_string().len(), MAX_ATTRIBUTE_BYTES);
        // Written in pieces, the cut still lands at the boundary.
        assert_eq!(Cut(format_args!("{}{}", "a".repeat(127), "€")).to_string(), "a".repeat(127));
    }

    #[test]
    fn a_tracestate_is_accepted_from_one_to_512_printable_bytes() {
        assert!(accepted_tracestate("vendor=opaque"));
        assert!(accepted_tracestate(&"a".repeat(512)));
        for refused in [String::new(), "a".repeat(513), "vendor=\u{1}".into(), "v=\u{e9}".into(), "v=\tx".into()] {
            assert!(!accepted_tracestate(&refused), "{refused:?}");
        }
    }
}
