//! Serving an HTTP app on a listener, with the connection-level defences `axum::serve` has
//! no knobs for.
//!
//! A client that sends its headers a byte at a time, or never finishes, holds a connection and
//! a task for as long as it likes unless something times it out; `axum::serve` sets no timer.
//! Here each connection is served by hyper-util's builder with a timer, so:
//!
//! - **headers** must arrive within `server.header_read_timeout_ms` (hyper's
//!   `header_read_timeout`; on a kept-alive connection the clock starts after the previous
//!   response, so an idle connection is closed after the same time);
//! - **bodies** must arrive whole within `server.body_read_timeout_ms` of reaching
//!   [`read_body_by_deadline`]: a total deadline, not a gap between chunks (tower-http's
//!   `RequestBodyTimeoutLayer` restarts its clock at every frame, so a byte a second would
//!   never trip it). Past it: `408` with `Connection: close`. On `/mcp` that layer sits behind
//!   the front door and the HTTP limit (see [`crate::app::App::router`]), so a refused request's
//!   body is never read, and reads the body, up to `server.max_body_bytes`, before rmcp sees it.
//!
//! Every listener is served this way, with the same `[server]` deadlines ([`Deadlines::of`]):
//! the MCP endpoint, the admin API (its body deadline behind the key check) and the mock
//! upstream, embedded or the `mock-upstream` command.
//!
//! Everything else is as `axum::serve`: `TCP_NODELAY`, the peer address as `ConnectInfo`,
//! HTTP/1 with upgrades and HTTP/2, and a graceful stop.

use std::net::SocketAddr;
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
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt as _;

use crate::config::ServerConfig;
use crate::http::front_door::jsonrpc_error;
use crate::http::{Step, StepLayer};

/// How long a stop waits for open connections (SSE streams end with the stop token).
const DRAIN: Duration = Duration::from_secs(5);

/// How long a request's body may take, and how large it may be.
#[derive(Debug, Clone, Copy)]
pub struct BodyDeadline {
    /// To send the whole body.
    pub timeout: Duration,
    /// The largest body read.
    pub max_bytes: usize,
    /// How a body that breaks them is answered.
    pub refusal: Refusal,
}

/// The shape of the answer to a body too slow, too large or cut off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// A JSON-RPC error, as an MCP client reads it (`/mcp`).
    JsonRpc,
    /// `{"error": {"code": …, "message": …}}`, the admin API's shape (and the mock upstream's).
    Plain,
}

impl BodyDeadline {
    /// The deadline `[server]` configures, refused as JSON-RPC errors.
    pub fn of(server: &ServerConfig) -> Self {
        Self { timeout: server.body_read_timeout, max_bytes: server.max_body_bytes, refusal: Refusal::JsonRpc }
    }

    /// This deadline, refused as plain JSON errors.
    pub fn answered_plainly(self) -> Self {
        Self { refusal: Refusal::Plain, ..self }
    }

    fn refuse(&self, status: StatusCode, code: &str, message: &str) -> Response {
        let response = match self.refusal {
            Refusal::JsonRpc => jsonrpc_error(status, -32600, message, None),
            Refusal::Plain => {
                (status, axum::Json(serde_json::json!({"error": {"code": code, "message": message}}))).into_response()
            }
        };
        close(response)
    }
}

/// The deadlines a listener holds its clients to: the headers, then the body.
#[derive(Debug, Clone, Copy)]
pub struct Deadlines {
    /// To send a request's headers.
    pub headers: Duration,
    /// To send its body.
    pub body: BodyDeadline,
}

impl Deadlines {
    /// The deadlines `[server]` configures (`header_read_timeout_ms`, `body_read_timeout_ms`,
    /// `max_body_bytes`), refused as JSON-RPC errors.
    pub fn of(server: &ServerConfig) -> Self {
        Self { headers: server.header_read_timeout, body: BodyDeadline::of(server) }
    }
}

/// Serves `app` on `listener` until `stop` is cancelled; headers must arrive within
/// `header_read_timeout`.
pub async fn serve(listener: TcpListener, app: Router, header_read_timeout: Duration, stop: CancellationToken) {
    // An MCP response over SSE leaves in several small writes; without TCP_NODELAY, Nagle's
    // algorithm and the client's delayed ACK stall each one by ~40 ms.
    let mut listener = listener.tap_io(|tcp| {
        if let Err(error) = tcp.set_nodelay(true) {
            tracing::debug!(%error, "cannot set TCP_NODELAY");
        }
    });
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(header_read_timeout);
    let graceful = GracefulShutdown::new();
    loop {
        // `Listener::accept` retries failed accepts itself (e.g. out of file descriptors).
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => accepted,
            () = stop.cancelled() => break,
        };
        let service = app.clone().map_request(move |mut request: Request<hyper::body::Incoming>| {
            request.extensions_mut().insert(ConnectInfo::<SocketAddr>(peer));
            request
        });
        let connection =
            builder.serve_connection_with_upgrades(TokioIo::new(tcp), TowerToHyperService::new(service)).into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                // Timeouts and clients going away: theirs to explain, not the server's.
                tracing::trace!(%error, %peer, "connection ended");
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(DRAIN, graceful.shutdown()).await.is_err() {
        tracing::debug!("connections still open after {DRAIN:?}; stopping anyway");
    }
}

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
