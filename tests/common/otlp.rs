//! A real OTLP/HTTP receiver for the telemetry tests: an axum server on a free loopback port
//! taking `POST /v1/traces`, decoding each body as the protobuf `ExportTraceServiceRequest` it must
//! be (opentelemetry-proto's prost messages), and keeping the bytes too, to search them whole.
//!
//! It runs on a thread and a runtime of its own: the exporter's flush blocks the thread that asks
//! for it, which in a current-thread test is the test's runtime. [`Receiver::never_answering`]
//! is a collector that takes each request and answers none until [`Receiver::release`].
#![allow(dead_code)]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use mcp_ratelimit::telemetry::Telemetry;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;

/// What the receiver was sent, body by body.
#[derive(Clone)]
pub(crate) struct Receiver {
    /// `http://127.0.0.1:PORT`, for `[telemetry] otlp_endpoint` (the exporter adds `/v1/traces`).
    pub url: String,
    bodies: Arc<Mutex<Vec<Vec<u8>>>>,
    /// While `true`, every request waits unanswered (and unrecorded).
    held: Arc<tokio::sync::watch::Sender<bool>>,
}

/// What the receiver's handler shares.
type Shared = (Arc<Mutex<Vec<Vec<u8>>>>, Arc<tokio::sync::watch::Sender<bool>>);

impl Receiver {
    /// A receiver listening on a free loopback port, for as long as the test process lives.
    pub(crate) fn start() -> Self {
        Self::listening(false)
    }

    /// A collector that is away without saying so: it accepts every request and answers none
    /// (the exporter waits its `export_timeout_ms` on each), until [`Receiver::release`].
    pub(crate) fn never_answering() -> Self {
        Self::listening(true)
    }

    /// Answers from now on: the requests waiting are taken, and every one after.
    pub(crate) fn release(&self) {
        self.held.send_replace(false);
    }

    fn listening(held: bool) -> Self {
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let held = Arc::new(tokio::sync::watch::Sender::new(held));
        let kept: Shared = (bodies.clone(), held.clone());
        let (told, heard) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
                told.send(listener.local_addr().expect("addr")).expect("the test waits");
                let app = axum::Router::new().route("/v1/traces", axum::routing::post(receive)).with_state(kept);
                axum::serve(listener, app).await.expect("the receiver serves");
            });
        });
        let addr = heard.recv().expect("the receiver listens");
        Self { url: format!("http://{addr}"), bodies, held }
    }

    /// Every span received so far.
    pub(crate) fn spans(&self) -> Vec<Span> {
        let bodies = self.bodies.lock().unwrap_or_else(|p| p.into_inner()).clone();
        bodies
            .iter()
            .map(|body| ExportTraceServiceRequest::decode(body.as_slice()).expect("a valid OTLP protobuf body"))
            .flat_map(|request| request.resource_spans)
            .flat_map(|resource| resource.scope_spans)
            .flat_map(|scope| scope.spans)
            .collect()
    }

    /// Every byte received so far, bodies end to end.
    pub(crate) fn bytes(&self) -> Vec<u8> {
        self.bodies.lock().unwrap_or_else(|p| p.into_inner()).concat()
    }

    /// Flushes `telemetry` until `done` holds of the spans received (every finished span is sent
    /// at each flush), for at most ten seconds of real time, letting the server's tasks run (and
    /// end their spans) in between; the spans then.
    pub(crate) async fn wait_for(
        &self,
        telemetry: &Telemetry,
        what: &str,
        done: impl Fn(&[Span]) -> bool,
    ) -> Vec<Span> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            telemetry.flush().expect("the exporter flushes");
            let spans = self.spans();
            if done(&spans) {
                return spans;
            }
            assert!(Instant::now() < deadline, "no {what} in 10 s; spans: {:#?}", names(&spans));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// `telemetry`'s layer as this thread's subscriber, while the value lives: for a current-thread
/// test, whose server runs its tasks on this thread.
///
/// `tracing` caches whether a callsite is wanted, and while only one subscriber has ever been
/// registered it asks only the subscriber of the thread that meets the callsite first: another
/// test's thread, with none, would turn the trace spans off for good. A second subscriber, kept
/// alive beside this one, makes it ask every live one, and the cache is rebuilt once both are.
pub(crate) struct Subscribed {
    _default: tracing::subscriber::DefaultGuard,
    _second: tracing::Dispatch,
}

/// See [`Subscribed`].
pub(crate) fn subscribe(telemetry: &Telemetry) -> Subscribed {
    use tracing_subscriber::layer::SubscriberExt;
    let second = tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default());
    let dispatch = tracing::Dispatch::new(tracing_subscriber::registry().with(telemetry.layer()));
    let default = tracing::dispatcher::set_default(&dispatch);
    tracing::callsite::rebuild_interest_cache();
    Subscribed { _default: default, _second: second }
}

impl Receiver {
    /// Waits, at most ten seconds of real time, until `done` holds of the spans received: for an
    /// exporter in another process, which sends at its own interval.
    pub(crate) async fn eventually(&self, what: &str, done: impl Fn(&[Span]) -> bool) -> Vec<Span> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let spans = self.spans();
            if done(&spans) {
                return spans;
            }
            assert!(Instant::now() < deadline, "no {what} in 10 s; spans: {:#?}", names(&spans));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

async fn receive(State((bodies, held)): State<Shared>, body: Bytes) -> StatusCode {
    let _ = held.subscribe().wait_for(|held| !*held).await;
    bodies.lock().unwrap_or_else(|p| p.into_inner()).push(body.to_vec());
    StatusCode::OK
}

/// Each span's name and attributes, to read in a failure.
pub(crate) fn names(spans: &[Span]) -> Vec<String> {
    spans.iter().map(|s| format!("{} {} {:?}", hex(&s.trace_id), s.name, attributes(s))).collect()
}

/// A span's attribute `key`, as text (a string as it is, a number or a flag written out).
pub(crate) fn attribute(span: &Span, key: &str) -> Option<String> {
    span.attributes.iter().find(|a| a.key == key).and_then(|a| a.value.as_ref()?.value.as_ref()).map(|v| match v {
        Any::StringValue(s) => s.clone(),
        Any::IntValue(i) => i.to_string(),
        Any::BoolValue(b) => b.to_string(),
        Any::DoubleValue(d) => d.to_string(),
        other => format!("{other:?}"),
    })
}

fn attributes(span: &Span) -> Vec<(String, String)> {
    span.attributes.iter().map(|a| (a.key.clone(), attribute(span, &a.key).unwrap_or_default())).collect()
}

/// Lowercase hex of an id.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The one span named `name` among `spans`, panicking with them all if there is not exactly one.
pub(crate) fn one<'a>(spans: &'a [&'a Span], name: &str) -> &'a Span {
    let found: Vec<_> = spans.iter().filter(|s| s.name == name).collect();
    assert_eq!(
        found.len(),
        1,
        "one `{name}` span expected among {:#?}",
        spans.iter().map(|s| &s.name).collect::<Vec<_>>()
    );
    found[0]
}
