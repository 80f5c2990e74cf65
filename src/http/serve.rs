//! Serving an HTTP app on a listener, with the connection-level defences `axum::serve` has
//! no knobs for.
//!
//! A client that sends nothing, sends its headers a byte at a time, or never finishes, holds a
//! connection and a task for as long as it likes unless something times it out; `axum::serve`
//! sets no timer, and opens as many connections as it is sent. Here:
//!
//! - **a whole request** (its headers, HTTP/1 or HTTP/2) must arrive within
//!   `server.header_read_timeout_ms` of the connection opening, or of its last answer ending:
//!   each connection is watched (`Watch`: requests under way, and since when it has had none),
//!   and one idle past the deadline is closed: at once if it never presented a request, else
//!   shut down gracefully (a `GOAWAY` on HTTP/2) and dropped a second later. So a connection that sends nothing, half an HTTP/2 preface (hyper-util reads the
//!   preface with no timer of its own), a preface and then nothing, or goes quiet between
//!   requests, is closed; one closed without ever presenting a request is counted
//!   (`mcp_ratelimit_connections_timed_out_total`). A response
//!   still streaming (an SSE stream) is a request under way. hyper's own `header_read_timeout`
//!   stays as a backstop a second later, and HTTP/2 pings a peer that stops answering off;
//! - **bodies** must arrive whole within `server.body_read_timeout_ms` of reaching
//!   [`read_body_by_deadline`]: a total deadline, not a gap between chunks (tower-http's
//!   `RequestBodyTimeoutLayer` restarts its clock at every frame, so a byte a second would
//!   never trip it). Past it: `408` with `Connection: close`. On `/mcp` that layer sits behind
//!   the front door and the HTTP limit (see [`crate::app::App::router`]), so a refused request's
//!   body is never read, and reads the body, up to `server.max_body_bytes`, before rmcp sees it;
//! - **connections** are capped as they are accepted: at most `server.max_connections` open, and
//!   `server.max_connections_per_address` from one address (IPv6 grouped by
//!   `server.ipv6_prefix`; with `server.trust_proxy`, the trusted proxies are exempt: every client
//!   behind one arrives from its address). One beyond is answered with a fixed `503` (`429` for
//!   the address) carrying `Retry-After: 1` and `Connection: close`, written without waiting (a
//!   flood of refusals costs no task and no timer), and closed unread; a client that had already
//!   sent its request may see the connection reset instead. Refusals are counted
//!   (`mcp_ratelimit_connections_refused_total`), open connections too;
//! - **streams** of one HTTP/2 connection: at most `server.max_streams_per_connection` requests
//!   under way at once (hyper's default is 200), announced in the connection's `SETTINGS`. One
//!   place among the connections would otherwise carry that many long-lived requests (SSE
//!   streams, 2026-07-28 subscriptions), which no cap on connections or sessions counts. A stream
//!   beyond is refused (`RST_STREAM` with `REFUSED_STREAM`) before anything of it is read; a
//!   client that heeds the setting waits for one of its streams to end.
//!
//! Every listener is served this way, with the same `[server]` rules ([`Deadlines::of`]), each
//! counting its own connections: the MCP endpoint, the admin API (its body deadline behind the
//! key check) and the mock upstream, embedded or the `mock-upstream` command.
//!
//! Everything else is as `axum::serve`: `TCP_NODELAY`, the peer address as `ConnectInfo`,
//! HTTP/1 with upgrades and HTTP/2, and a graceful stop.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{ConnectInfo, Request};
use axum::response::{IntoResponse, Response};
use axum::serve::{Listener, ListenerExt};
use http::{HeaderValue, StatusCode, header};
use http_body::Body as _;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulConnection;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt as _;

use crate::config::ServerConfig;
use crate::config::server::ConnectionCaps;
use crate::http::front_door::jsonrpc_error;
use crate::http::{Step, StepLayer};
use crate::identity::address_group;
use crate::ops::metrics::ConnectionMetrics;

/// How long a stop waits for open connections (SSE streams end with the stop token).
const DRAIN: Duration = Duration::from_secs(5);

/// How long a connection shut down for idling may take to go (a `GOAWAY` to flush).
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// How long a client refused a connection is told to wait.
const RETRY_AFTER_SECS: u64 = 1;

/// How long a request's body may take, and how large it may be.
#[derive(Debug, Clone, Copy)]
pub struct BodyDeadline {
    /// To send the whole body.
    pub timeout: Duration,
    /// The largest body read.
    pub max_bytes: usize,
    /// How a body that breaks them is answered.
    pub refusal: ErrorShape,
}

/// The shape of the answer to a body too slow, too large or cut off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorShape {
    /// A JSON-RPC error, as an MCP client reads it (`/mcp`).
    JsonRpc,
    /// `{"error": {"code": …, "message": …}}`, the admin API's shape (and the mock upstream's).
    Plain,
}

impl BodyDeadline {
    /// The deadline `[server]` configures, refused as JSON-RPC errors.
    pub fn of(server: &ServerConfig) -> Self {
        Self { timeout: server.body_read_timeout, max_bytes: server.max_body_bytes, refusal: ErrorShape::JsonRpc }
    }

    /// This deadline, refused as plain JSON errors.
    pub fn answered_plainly(self) -> Self {
        Self { refusal: ErrorShape::Plain, ..self }
    }

    fn refuse(&self, status: StatusCode, code: &str, message: &str) -> Response {
        let response = match self.refusal {
            ErrorShape::JsonRpc => jsonrpc_error(status, -32600, message, None),
            ErrorShape::Plain => {
                (status, axum::Json(serde_json::json!({"error": {"code": code, "message": message}}))).into_response()
            }
        };
        close(response)
    }
}

/// What a listener holds its clients to: a whole request within `headers` of a connection
/// opening (or of its last answer), the body within `body`, and at most `connections` open.
#[derive(Debug, Clone)]
pub struct Deadlines {
    /// To present a whole request's headers.
    pub headers: Duration,
    /// To send its body.
    pub body: BodyDeadline,
    /// Connections open at once, all together and per address.
    pub connections: ConnectionCaps,
    /// Requests one HTTP/2 connection may have under way at once.
    pub streams_per_connection: u32,
}

impl Deadlines {
    /// The rules `[server]` configures (`header_read_timeout_ms`, `body_read_timeout_ms`,
    /// `max_body_bytes`, `max_connections`, `max_connections_per_address`, `ipv6_prefix`,
    /// `max_streams_per_connection`), refused as JSON-RPC errors.
    pub fn of(server: &ServerConfig) -> Self {
        Self {
            headers: server.header_read_timeout,
            body: BodyDeadline::of(server),
            connections: server.connections.clone(),
            streams_per_connection: server.max_streams_per_connection,
        }
    }
}

/// Serves `app` on `listener` until `stop` is cancelled, holding every connection to
/// `deadlines` and counting them in `counted`.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    deadlines: Deadlines,
    counted: ConnectionMetrics,
    stop: CancellationToken,
) {
    // An MCP response over SSE leaves in several small writes; without TCP_NODELAY, Nagle's
    // algorithm and the client's delayed ACK stall each one by ~40 ms.
    let mut listener = listener.tap_io(|tcp| {
        if let Err(error) = tcp.set_nodelay(true) {
            tracing::debug!(%error, "cannot set TCP_NODELAY");
        }
    });
    let first_request = deadlines.headers;
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // The watch below holds HTTP/1 headers to the deadline too; hyper's own timer, a little
    // later, is a backstop that never races it.
    builder.http1().timer(TokioTimer::new()).header_read_timeout(first_request + CLOSE_GRACE);
    // A peer that stops answering pings is dropped even while a stream (SSE) is open; streams
    // past the cap are refused as they open.
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(first_request)
        .keep_alive_timeout(first_request)
        .max_concurrent_streams(deadlines.streams_per_connection);
    let open = Arc::new(Open::new(deadlines.connections, counted));
    loop {
        // `Listener::accept` retries failed accepts itself (e.g. out of file descriptors).
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => accepted,
            () = stop.cancelled() => break,
        };
        let held = match open.admit(peer.ip()) {
            Ok(held) => held,
            Err(full) => {
                open.refuse(tcp, full);
                continue;
            }
        };
        let watch = Arc::new(Watch::new());
        let service = Watched {
            inner: app.clone().map_request(move |mut request: Request<hyper::body::Incoming>| {
                request.extensions_mut().insert(ConnectInfo::<SocketAddr>(peer));
                request
            }),
            watch: watch.clone(),
        };
        let connection =
            builder.serve_connection_with_upgrades(TokioIo::new(tcp), TowerToHyperService::new(service)).into_owned();
        let stop = stop.clone();
        tokio::spawn(async move {
            drive(connection, &watch, first_request, &held.open.counted, &stop, peer).await;
            drop(held);
        });
    }
    drop(listener);
    if tokio::time::timeout(DRAIN, open.drained()).await.is_err() {
        tracing::debug!("connections still open after {DRAIN:?}; stopping anyway");
    }
}

/// Serves one connection until it ends, is idle past `first_request` (no request under way,
/// none presented since), or the server stops; then shuts it down gracefully, for a bounded time.
async fn drive<C>(
    connection: C,
    watch: &Watch,
    first_request: Duration,
    counted: &ConnectionMetrics,
    stop: &CancellationToken,
    peer: SocketAddr,
) where
    C: GracefulConnection,
    C::Error: std::fmt::Display,
{
    let mut connection = std::pin::pin!(connection);
    let mut closing: Option<Instant> = None;
    loop {
        let gone_by = closing.unwrap_or_else(Instant::now);
        tokio::select! {
            ended = connection.as_mut() => {
                if let Err(error) = ended {
                    // Timeouts and clients going away: theirs to explain, not the server's.
                    tracing::trace!(%error, %peer, "connection ended");
                }
                return;
            }
            () = stop.cancelled(), if closing.is_none() => {
                connection.as_mut().graceful_shutdown();
                closing = Some(Instant::now() + DRAIN);
            }
            () = watch.idle_past(first_request), if closing.is_none() => {
                tracing::trace!(%peer, "connection closed: no request within server.header_read_timeout_ms");
                if !watch.presented_any() {
                    // Nothing to say goodbye to: dropped at once.
                    counted.timed_out.increment(1);
                    return;
                }
                connection.as_mut().graceful_shutdown();
                closing = Some(Instant::now() + CLOSE_GRACE);
            }
            () = tokio::time::sleep_until(gone_by), if closing.is_some() => return,
        }
    }
}

/// Which cap a connection would pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Full {
    Server,
    Address,
}

/// The connections a listener holds: how many, and how many per address.
struct Open {
    caps: ConnectionCaps,
    counts: Mutex<Counts>,
    /// Told whenever the last connection goes, for the drain at a stop.
    drained: Notify,
    counted: ConnectionMetrics,
}

#[derive(Default)]
struct Counts {
    total: usize,
    per_address: HashMap<IpAddr, usize>,
}

/// One connection's place among those open, given back when it is dropped.
struct OpenConnection {
    open: Arc<Open>,
    address: Option<IpAddr>,
}

impl Open {
    fn new(caps: ConnectionCaps, counted: ConnectionMetrics) -> Self {
        Self { caps, counts: Mutex::default(), drained: Notify::new(), counted }
    }

    fn counts(&self) -> std::sync::MutexGuard<'_, Counts> {
        self.counts.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether `peer` is held to the cap per address (a trusted proxy is not).
    fn address_of(&self, peer: IpAddr) -> Option<IpAddr> {
        let peer = peer.to_canonical();
        let mapped = match peer {
            IpAddr::V4(v4) => Some(IpAddr::V6(v4.to_ipv6_mapped())),
            IpAddr::V6(_) => None,
        };
        let exempt = self.caps.exempt.iter().any(|net| net.contains(&peer) || mapped.is_some_and(|m| net.contains(&m)));
        (!exempt).then(|| address_group(peer, self.caps.ipv6_prefix))
    }

    /// A place for a connection from `peer`, or the cap that is full; both caps are checked and
    /// taken under one lock, so concurrent accepts never pass one together.
    fn admit(self: &Arc<Self>, peer: IpAddr) -> Result<OpenConnection, Full> {
        let address = self.address_of(peer);
        let mut counts = self.counts();
        if counts.total >= self.caps.max {
            return Err(Full::Server);
        }
        if let Some(address) = address {
            let held = counts.per_address.entry(address).or_default();
            // `max_per_address` is at least 1, so a refused address already had an entry.
            if *held >= self.caps.max_per_address {
                return Err(Full::Address);
            }
            *held += 1;
        }
        counts.total += 1;
        drop(counts);
        self.counted.open.increment(1.0);
        Ok(OpenConnection { open: self.clone(), address })
    }

    /// Answers a connection past a cap with a fixed refusal, written without waiting, and
    /// closes it; counted.
    fn refuse(&self, tcp: TcpStream, full: Full) {
        let answer = match full {
            Full::Server => {
                self.counted.refused_full.increment(1);
                &*REFUSED_FULL
            }
            Full::Address => {
                self.counted.refused_address.increment(1);
                &*REFUSED_ADDRESS
            }
        };
        // A fresh connection's send buffer is empty: the whole answer fits in one write, or the
        // peer is gone. What it sent already is read and dropped, so closing is a FIN rather
        // than a reset where it can be.
        let _ = tcp.try_write(answer);
        let mut sink = [0u8; 4096];
        let _ = tcp.try_read(&mut sink);
    }

    /// Resolves once no connection is open.
    async fn drained(&self) {
        loop {
            let notified = self.drained.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            if self.counts().total == 0 {
                return;
            }
            notified.await;
        }
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        let mut counts = self.open.counts();
        counts.total = counts.total.saturating_sub(1);
        if let Some(address) = self.address
            && let Some(held) = counts.per_address.get_mut(&address)
        {
            *held = held.saturating_sub(1);
            if *held == 0 {
                counts.per_address.remove(&address);
            }
        }
        let last = counts.total == 0;
        drop(counts);
        self.open.counted.open.decrement(1.0);
        if last {
            self.open.drained.notify_waiters();
        }
    }
}

/// The answer to a connection past a cap: a whole HTTP/1.1 response with a JSON-RPC error body.
fn refusal(status: &str, message: &str) -> Vec<u8> {
    let body = format!(
        r#"{{"error":{{"code":-32000,"data":{{"retry_after_ms":{}}},"message":"{message}"}},"id":null,"jsonrpc":"2.0"}}"#,
        RETRY_AFTER_SECS * 1000
    );
    format!(
        "HTTP/1.1 {status}\r\nRetry-After: {RETRY_AFTER_SECS}\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

static REFUSED_FULL: std::sync::LazyLock<Vec<u8>> = std::sync::LazyLock::new(|| {
    refusal(
        "503 Service Unavailable",
        "Too many connections to this server (server.max_connections). Retry after the delay in Retry-After.",
    )
});

static REFUSED_ADDRESS: std::sync::LazyLock<Vec<u8>> = std::sync::LazyLock::new(|| {
    refusal(
        "429 Too Many Requests",
        "Too many connections from this address (server.max_connections_per_address). Close one, or retry \
         after the delay in Retry-After.",
    )
});

/// One connection's requests: how many are under way (from their headers to the end of their
/// answer's body), since when it has had none, and whether it ever presented one.
struct Watch {
    state: Mutex<Requests>,
    changed: Notify,
}

#[derive(Clone, Copy)]
struct Requests {
    under_way: usize,
    idle_since: Instant,
    presented_any: bool,
}

impl Watch {
    fn new() -> Self {
        let requests = Requests { under_way: 0, idle_since: Instant::now(), presented_any: false };
        Self { state: Mutex::new(requests), changed: Notify::new() }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, Requests> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A request under way until the returned guard is dropped.
    fn begin(self: &Arc<Self>) -> Busy {
        let mut state = self.state();
        state.under_way += 1;
        state.presented_any = true;
        drop(state);
        self.changed.notify_one();
        Busy(self.clone())
    }

    /// Whether a whole request ever arrived on the connection.
    fn presented_any(&self) -> bool {
        self.state().presented_any
    }

    /// Resolves once the connection has had no request under way for `deadline`.
    async fn idle_past(&self, deadline: Duration) {
        loop {
            let Requests { under_way, idle_since: since, .. } = *self.state();
            if under_way == 0 && since.elapsed() >= deadline {
                return;
            }
            if under_way == 0 {
                tokio::select! {
                    () = tokio::time::sleep_until(since + deadline) => {}
                    () = self.changed.notified() => {}
                }
            } else {
                self.changed.notified().await;
            }
        }
    }
}

/// A request under way on a [`Watch`]ed connection.
struct Busy(Arc<Watch>);

impl Drop for Busy {
    fn drop(&mut self) {
        let mut state = self.0.state();
        state.under_way = state.under_way.saturating_sub(1);
        if state.under_way == 0 {
            state.idle_since = Instant::now();
        }
        drop(state);
        self.0.changed.notify_one();
    }
}

/// The app of one connection, each request of which is under way on its [`Watch`] until its
/// answer's body has been sent (or dropped).
#[derive(Clone)]
struct Watched<S> {
    inner: S,
    watch: Arc<Watch>,
}

impl<S, B> tower::Service<Request<B>> for Watched<S>
where
    S: tower::Service<Request<B>, Response = Response>,
    S::Future: Unpin,
{
    type Response = http::Response<WatchedBody>;
    type Error = S::Error;
    type Future = WatchedFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let busy = self.watch.begin();
        WatchedFuture { inner: self.inner.call(request), busy: Some(busy) }
    }
}

/// The future of [`Watched`]: the answer, its body holding the request under way.
struct WatchedFuture<F> {
    inner: F,
    busy: Option<Busy>,
}

impl<F, E> std::future::Future for WatchedFuture<F>
where
    F: std::future::Future<Output = Result<Response, E>> + Unpin,
{
    type Output = Result<http::Response<WatchedBody>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let answered = std::task::ready!(Pin::new(&mut self.inner).poll(cx));
        let busy = self.busy.take();
        Poll::Ready(answered.map(|response| response.map(|body| WatchedBody::new(body, busy))))
    }
}

/// An answer's body, holding its request under way until it has been sent or dropped.
type WatchedBody = crate::http::Holding<Option<Busy>>;

/// Reads the body within its deadline, then passes the request on with the body in memory.
/// A body declared larger than the limit is refused unread (on `/mcp` the front door answers
/// 413 before this layer). A request without a body passes straight through.
pub fn read_body_by_deadline(limits: BodyDeadline) -> StepLayer<BodyDeadline> {
    StepLayer::new(limits)
}

impl Step for BodyDeadline {
    fn takes(&self, request: &Request) -> bool {
        request.body().size_hint().exact() != Some(0)
    }

    async fn run<S>(self, request: Request, mut inner: S) -> Result<Response, S::Error>
    where
        S: tower::Service<Request, Response = Response> + Send + 'static,
        S::Future: Send,
        S::Error: Send,
    {
        match self.read(request).await {
            Ok(request) => inner.call(request).await,
            Err(refused) => Ok(refused),
        }
    }
}

impl BodyDeadline {
    /// `request` with its body read into memory, or the answer when the body is too large, cut
    /// off or too slow.
    async fn read(self, request: Request) -> Result<Request, Response> {
        let too_large = || {
            let message = format!("Request body too large: the limit is {} bytes.", self.max_bytes);
            self.refuse(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large", &message)
        };
        if request.body().size_hint().lower() > self.max_bytes as u64 {
            return Err(too_large());
        }
        let (parts, body) = request.into_parts();
        let read = tokio::time::timeout(self.timeout, axum::body::to_bytes(body, self.max_bytes));
        match read.await {
            Ok(Ok(bytes)) => Ok(Request::from_parts(parts, Body::from(bytes))),
            Ok(Err(error)) => {
                if std::error::Error::source(&error).is_some_and(|e| e.is::<http_body_util::LengthLimitError>()) {
                    Err(too_large())
                } else {
                    // The client broke off mid-body; nobody is left to read an answer.
                    Err(self.refuse(StatusCode::BAD_REQUEST, "body_cut_off", "The request body was cut off."))
                }
            }
            Err(_) => {
                tracing::info!(timeout = ?self.timeout, "refused: request body too slow");
                let message = format!(
                    "Request Timeout: the body did not arrive within {} ms of the headers.",
                    self.timeout.as_millis()
                );
                Err(self.refuse(StatusCode::REQUEST_TIMEOUT, "request_timeout", &message))
            }
        }
    }
}

/// Asks hyper to close the connection after this response: the rest of the body is unread.
fn close(mut response: Response) -> Response {
    response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}
