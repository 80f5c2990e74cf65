//! The exporter's queue, bounded in bytes as well as in spans.
//!
//! OpenTelemetry's batch span processor holds finished spans until the collector takes them, at
//! most 2,048 of them, whatever their size: with a collector that is slow or away, 2,048 spans
//! each holding a 4 MB JSON-RPC id were 8 GB. Values a caller chose are cut where spans are made
//! (`guard::trace::cut`); this bounds what is left in bytes too. [`Bounded`] stands before the
//! batch processor and admits a finished span only while the spans waiting — queued, or in a
//! batch the collector has not answered yet — fit in [`MAX_SPANS`] and [`MAX_BYTES`] of their
//! names and attribute values; it drops (and counts) any other. [`Counted`] wraps the exporter,
//! and gives a batch's spans and bytes back when the collector has answered it, or the export
//! gave up (`telemetry.export_timeout_ms`).
//!
//! [`TraceQueue`] is what `/metrics` reads: `mcp_ratelimit_trace_queue_bytes` and
//! `mcp_ratelimit_trace_spans_dropped_total`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry::{Array, KeyValue, Value};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{Span, SpanData, SpanExporter, SpanProcessor};

/// The most finished spans waiting for the collector (the batch processor's own queue is as
/// long, so it never drops one this admitted).
pub const MAX_SPANS: usize = 2048;

/// The most bytes of names and values the spans waiting for the collector hold together.
pub const MAX_BYTES: u64 = 8 * 1024 * 1024;

/// The spans waiting for the collector, and those dropped because they did not fit.
#[derive(Debug, Default)]
pub struct TraceQueue {
    held: Mutex<Backlog>,
    dropped: AtomicU64,
}

#[derive(Debug, Default, Clone, Copy)]
struct Backlog {
    spans: usize,
    bytes: u64,
}

impl TraceQueue {
    /// Bytes of names and values the spans waiting hold ([`size_of`]).
    pub fn bytes(&self) -> u64 {
        self.held().bytes
    }

    /// Spans waiting: queued, or in a batch the collector has not answered.
    pub fn spans(&self) -> usize {
        self.held().spans
    }

    /// Spans dropped since the exporter started, because the queue was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    fn held(&self) -> Backlog {
        *self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes a place for one span of `bytes`, if it fits; counts it dropped if not.
    fn admit(&self, bytes: u64) -> bool {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let fits = held.spans < MAX_SPANS && held.bytes.saturating_add(bytes) <= MAX_BYTES;
        if fits {
            held.spans += 1;
            held.bytes = held.bytes.saturating_add(bytes);
        } else {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
        fits
    }

    /// Gives back the places of `spans` spans of `bytes` together.
    fn release(&self, spans: usize, bytes: u64) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        held.spans = held.spans.saturating_sub(spans);
        held.bytes = held.bytes.saturating_sub(bytes);
    }
}

/// What a finished span is weighed at: the bytes of its name, of its attributes' keys and values,
/// and of its events' and links' (a number or a flag is 8).
pub fn size_of(span: &SpanData) -> u64 {
    let attributes = |attributes: &[KeyValue]| -> u64 {
        attributes.iter().map(|kv| len(kv.key.as_str()).saturating_add(value_size(&kv.value))).sum()
    };
    let events = span.events.iter().map(|e| len(&e.name).saturating_add(attributes(&e.attributes))).sum::<u64>();
    let links = span.links.iter().map(|l| attributes(&l.attributes)).sum::<u64>();
    len(&span.name).saturating_add(attributes(&span.attributes)).saturating_add(events).saturating_add(links)
}

fn len(text: &str) -> u64 {
    u64::try_from(text.len()).unwrap_or(u64::MAX)
}

fn value_size(value: &Value) -> u64 {
    match value {
        Value::Bool(_) | Value::I64(_) | Value::F64(_) => 8,
        Value::String(text) => len(text.as_str()),
        Value::Array(Array::String(texts)) => texts.iter().map(|t| len(t.as_str())).sum(),
        Value::Array(Array::Bool(items)) => len_of(items.len()),
        Value::Array(Array::I64(items)) => len_of(items.len()).saturating_mul(8),
        Value::Array(Array::F64(items)) => len_of(items.len()).saturating_mul(8),
        // A kind the SDK adds later: weighed as it would be written.
        other => len(&other.as_str()),
    }
}

fn len_of(items: usize) -> u64 {
    u64::try_from(items).unwrap_or(u64::MAX)
}

/// A span processor that passes a finished span on to `P` (the batch processor) only while the
/// spans waiting fit in [`MAX_SPANS`] and [`MAX_BYTES`]; it drops the others and counts them.
#[derive(Debug)]
pub struct Bounded<P> {
    inner: P,
    queue: Arc<TraceQueue>,
}

impl<P> Bounded<P> {
    /// `inner` behind the bounds of `queue`, which the exporter `inner` sends with gives back to
    /// ([`Counted`]).
    pub fn new(inner: P, queue: Arc<TraceQueue>) -> Self {
        Self { inner, queue }
    }
}

impl<P: SpanProcessor> SpanProcessor for Bounded<P> {
    fn on_start(&self, span: &mut Span, cx: &opentelemetry::Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        if self.queue.admit(size_of(&span)) {
            self.inner.on_end(span);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// An exporter that gives a batch's places in the [`TraceQueue`] back once `E` is done with it:
/// answered, refused, or timed out (or dropped unfinished).
#[derive(Debug)]
pub struct Counted<E> {
    inner: E,
    queue: Arc<TraceQueue>,
}

impl<E> Counted<E> {
    /// `inner`, giving back to `queue`.
    pub fn new(inner: E, queue: Arc<TraceQueue>) -> Self {
        Self { inner, queue }
    }
}

/// A batch's places, given back when it is dropped.
struct Places {
    queue: Arc<TraceQueue>,
    spans: usize,
    bytes: u64,
}

impl Drop for Places {
    fn drop(&mut self) {
        self.queue.release(self.spans, self.bytes);
    }
}

impl<E: SpanExporter> SpanExporter for Counted<E> {
    fn export(&self, batch: Vec<SpanData>) -> impl Future<Output = OTelSdkResult> + Send {
        let places = Places {
            queue: self.queue.clone(),
            spans: batch.len(),
            bytes: batch.iter().map(size_of).fold(0, u64::saturating_add),
        };
        let exported = self.inner.export(batch);
        async move {
            let result = exported.await;
            drop(places);
            result
        }
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState};
    use opentelemetry_sdk::trace::{SpanEvents, SpanLinks};
    use std::sync::atomic::AtomicUsize;

    /// A finished span of `bytes` bytes: its name and one attribute.
    fn span(bytes: usize) -> SpanData {
        let context = SpanContext::new(TraceId::from(1), SpanId::from(1), TraceFlags::SAMPLED, false, TraceState::NONE);
        SpanData {
            span_context: context,
            parent_span_id: SpanId::INVALID,
            parent_span_is_remote: false,
            span_kind: SpanKind::Server,
            name: "s".into(),
            start_time: std::time::SystemTime::UNIX_EPOCH,
            end_time: std::time::SystemTime::UNIX_EPOCH,
            attributes: vec![KeyValue::new("k", "v".repeat(bytes.saturating_sub(2)))],
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status: Status::Unset,
            instrumentation_scope: Default::default(),
        }
    }

    /// A processor that only counts what reaches it.
    #[derive(Debug, Default)]
    struct Counting(AtomicUsize);

    impl SpanProcessor for Counting {
        fn on_start(&self, _: &mut Span, _: &opentelemetry::Context) {}
        fn on_end(&self, _: SpanData) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
        fn force_flush(&self) -> OTelSdkResult {
            Ok(())
        }
        fn shutdown_with_timeout(&self, _: Duration) -> OTelSdkResult {
            Ok(())
        }
    }

    #[test]
    fn the_queue_holds_at_most_2048_spans_and_8_mib_and_counts_what_it_drops() {
        let queue = Arc::new(TraceQueue::default());
        let bounded = Bounded::new(Counting::default(), queue.clone());
        assert_eq!(size_of(&span(100)), 100, "its name and its attribute's key and value");
        for _ in 0..MAX_SPANS + 10 {
            bounded.on_end(span(100));
        }
        assert_eq!((queue.spans(), queue.dropped()), (MAX_SPANS, 10), "by count");
        assert_eq!(bounded.inner.0.load(Ordering::Relaxed), MAX_SPANS);
        queue.release(MAX_SPANS, queue.bytes());
        assert_eq!((queue.spans(), queue.bytes()), (0, 0));
        // By bytes: two spans of 3 MiB fit in 8 MiB, a third does not, a small one still does.
        let big = 3 << 20;
        for _ in 0..3 {
            bounded.on_end(span(big));
        }
        bounded.on_end(span(100));
        assert_eq!(queue.spans(), 3);
        assert_eq!(queue.dropped(), 11);
        assert!(queue.bytes() <= MAX_BYTES, "{}", queue.bytes());
    }

    /// An exporter the collector answers at once.
    #[derive(Debug)]
    struct Answering;

    impl SpanExporter for Answering {
        async fn export(&self, _: Vec<SpanData>) -> OTelSdkResult {
            Ok(())
        }
    }

    #[test]
    fn a_batch_gives_its_places_back_when_the_collector_has_answered_or_the_export_is_dropped() {
        let queue = Arc::new(TraceQueue::default());
        let bounded = Bounded::new(Counting::default(), queue.clone());
        for _ in 0..3 {
            bounded.on_end(span(50));
        }
        let counted = Counted::new(Answering, queue.clone());
        let export = counted.export(vec![span(50), span(50)]);
        assert_eq!(queue.spans(), 3, "held while the collector has not answered");
        assert!(futures::executor::block_on(export).is_ok());
        assert_eq!((queue.spans(), queue.bytes()), (1, 50));
        drop(counted.export(vec![span(50)]));
        assert_eq!((queue.spans(), queue.bytes()), (0, 0), "an export dropped unfinished gives back too");
    }
}
