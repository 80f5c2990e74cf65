//! The relay lane: what the proxy only forwards, forwarded as the caller sent it.
//!
//! **Where it starts and stops.** In front of a proxied server reached over streamable HTTP, a
//! `POST /mcp` that has crossed the front door (identity, the coarse limit, the body deadline, the
//! session caps) reaches this [`Step`] before rmcp. Its JSON-RPC envelope is read with
//! `serde_json` (borrowed fields: the method, the id, the params' members, the `_meta`), and the
//! lane takes it only when it is one of the requests the proxy merely passes on and its shape is
//! plainly well-formed:
//!
//! - `tools/call` — the only one the guard decides (the one guarded call, exactly as on rmcp's
//!   path: [`crate::guard::call`]), and the one worth the lane's while: every call of an agent;
//! - a 2025-11-25 session's `tasks/get`, `tasks/result`, `tasks/list` and `tasks/cancel` (that
//!   era's tasks: rmcp knows only 2026-07-28's, and drops a call's `params.task`), each only for
//!   its caller's own tasks;
//!
//! from a 2025-11-25 session rmcp holds and the proxy has seen initialized, or a 2026-07-28
//! request whose `_meta`, `MCP-Protocol-Version`, `Mcp-Method` and `Mcp-Name` agree. Everything
//! else — `initialize`, `server/discover`, lists, subscriptions, notifications, answers to the
//! server's requests, sessions' streams, any request whose headers or `_meta` rmcp must judge
//! (and answer `400` for) — goes to rmcp as before: this is a relay, not a second MCP stack.
//!
//! **What it does.** It forwards the caller's params (`_meta` aside: what the proxied server hears
//! of it is what rmcp's path sends, [`crate::proxy::Upstream::upstream_meta`]) with an id of the
//! proxy's own, over the session's pooled HTTP client (`send`), and reads the answer's envelope:
//! the result is parsed only as far as the guard reads it (its kind, `_meta.usage`, the task it
//! made: [`crate::mcp::raw::RawResult`]) and passed on as it came, with what the guard adds in
//! `_meta` ([`crate::mcp::limited::finish`]). What comes on the call's stream before the answer
//! goes on: its progress to the caller's own stream (the response turns into an event stream
//! then), a question to the caller's session (as rmcp asks: [`crate::proxy::relay::Ask`]) or, to a
//! 2026-07-28 caller, in an `input_required` round ([`rounds`]), anything else as rmcp's client
//! relays it.
//!
//! **Why.** rmcp parses every message into its typed enums (serde's buffered untagged matching)
//! on both sides of the proxy; a call through the proxy cost two full MCP stacks, 96 % of the
//! proxy's CPU. The lane spends it on the guard instead. A stdio child gets the same lane: its
//! pipes are tapped ([`crate::proxy::tap`]), rmcp's client and the lane writing whole lines to it,
//! and the lines that answer the lane going to the lane.

mod call;
mod envelope;
pub(crate) use envelope::Envelope;
pub mod rounds;
mod send;
mod tasks;

use std::sync::Arc;

use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use http::request::Parts;
use http::{HeaderMap, Method};
use rmcp::transport::streamable_http_server::SessionManager as _;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use serde_json::{Map, Value};

pub(crate) use send::{Relayed, Reply, request};

use super::Proxied;
use super::seat::Seat;
use crate::http::Step;
use crate::identity::Caller;
use crate::rate_limits::RateLimits;
use envelope::Params;

/// The relay lane, as a step in front of rmcp ([`crate::http::StepLayer`]).
#[derive(Clone)]
pub struct Lane(Arc<LaneState>);

struct LaneState {
    proxied: Arc<Proxied>,
    limits: RateLimits,
    sessions: Arc<LocalSessionManager>,
    calls: call::InFlight,
}

impl std::fmt::Debug for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lane").finish_non_exhaustive()
    }
}

impl Lane {
    /// The lane in front of `proxied` (sessions kept by rmcp's `sessions`).
    pub fn new(proxied: Arc<Proxied>, limits: RateLimits, sessions: Arc<LocalSessionManager>) -> Self {
        Self(Arc::new(LaneState { proxied, limits, sessions, calls: call::InFlight::default() }))
    }
}

/// Which era a request the lane takes is of.
#[derive(Clone)]
pub(super) enum Era {
    /// A 2025-11-25 session's (its id, and the session as the proxy keeps it).
    Session { id: Arc<str>, seat: Arc<Seat> },
    /// A 2026-07-28 request: no session.
    Stateless,
}

impl Era {
    /// Whether its caller reads 2026-07-28 answers (`resultType` required).
    pub(super) fn stateless(&self) -> bool {
        matches!(self, Era::Stateless)
    }
}

impl Step for Lane {
    fn takes(&self, request: &Request) -> bool {
        request.method() == Method::POST
    }

    async fn run<S>(self, request: Request, mut inner: S) -> Result<Response, S::Error>
    where
        S: tower::Service<Request, Response = Response> + Send + 'static,
        S::Future: Send,
        S::Error: Send,
    {
        let (parts, body) = request.into_parts();
        // The body is in memory already (the body deadline read it, within the size limit).
        let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap_or_default();
        if let Some(answered) = self.0.take(&parts, &bytes).await {
            return Ok(answered);
        }
        inner.call(Request::from_parts(parts, Body::from(bytes))).await
    }
}

impl LaneState {
    /// A session's `notifications/cancelled` for one of the lane's calls: that call is cancelled
    /// (`202`); `None` for any other, which rmcp hears.
    fn cancelled(&self, headers: &HeaderMap, envelope: &Envelope<'_>) -> Option<Response> {
        let session = headers.get("mcp-session-id")?.to_str().ok()?;
        let params = envelope::params(envelope.params)?;
        let request = params.get("requestId")?;
        if !self.calls.cancel(session, request.get()) {
            return None;
        }
        let mut accepted = Response::new(Body::empty());
        *accepted.status_mut() = http::StatusCode::ACCEPTED;
        Some(accepted)
    }

    /// The answer to a request the lane takes; `None` for one it leaves to rmcp.
    async fn take(self: &Arc<Self>, parts: &Parts, bytes: &[u8]) -> Option<Response> {
        let envelope = Envelope::read(bytes)?;
        let method = envelope.method.as_deref()?;
        if method == "notifications/cancelled" {
            return self.cancelled(&parts.headers, &envelope);
        }
        let id = envelope.id?;
        if !call::TAKEN.contains(&method) && !tasks::TAKEN.contains(&method) {
            return None;
        }
        let params = envelope::params(envelope.params)?;
        let meta = envelope::meta(&params)?;
        let caller = parts.extensions.get::<Caller>()?.clone();
        let era = self.era(&parts.headers, method, &params, &meta).await?;
        if method == "tools/call" {
            self.call_tool(era, caller, parts, id, params, meta).await
        } else {
            // That era's tasks, between a 2025-11-25 session and a 2025-11-25 server only.
            let Era::Session { seat, .. } = &era else { return None };
            if self.proxied.scopes().shared().stateless() {
                return None;
            }
            Some(self.task(seat.clone(), caller, method, id, &params, meta).await)
        }
    }

    /// The era of a request the lane may take: a 2025-11-25 session rmcp holds and the proxy saw
    /// initialized, whose request carries no 2026-07-28 version; or a 2026-07-28 request whose
    /// version, method and name agree in its `_meta` and its headers. `None` for anything else,
    /// which rmcp judges (and answers `400` where it must).
    async fn era(
        &self,
        headers: &HeaderMap,
        method: &str,
        params: &Params<'_>,
        meta: &Map<String, Value>,
    ) -> Option<Era> {
        // A tool's parameters mirrored in headers (SEP-2243) are rmcp's to check against its schema.
        if headers.keys().any(|name| name.as_str().starts_with("mcp-param-")) {
            return None;
        }
        let header = |name: &str| headers.get(name).map(|value| value.to_str().ok());
        // What a router reads in the headers must be what the body says (SEP-2243); any doubt is
        // rmcp's to answer.
        let name = envelope::member::<String>(params, "name").and_then(Result::ok);
        let agrees = |header: Option<Option<&str>>, body: Option<&str>| header.is_none_or(|h| h.is_some() && h == body);
        if !agrees(header("mcp-method"), Some(method))
            || (method == "tools/call" && !agrees(header("mcp-name"), name.as_deref()))
        {
            return None;
        }
        let version = header("mcp-protocol-version");
        let said = meta.get(PROTOCOL_VERSION);
        match header("mcp-session-id") {
            Some(id) => {
                let id = id?;
                let legacy = version.is_none_or(|v| v.is_some_and(|v| LEGACY_VERSIONS.contains(&v)));
                if !legacy || said.is_some() || !self.sessions.has_session(&id.to_owned().into()).await.ok()? {
                    return None;
                }
                let seat = self.proxied.seats.get(id)?;
                Some(Era::Session { id: Arc::from(id), seat })
            }
            None => {
                let stateless = version == Some(Some(STATELESS))
                    && said.and_then(Value::as_str) == Some(STATELESS)
                    && meta.get(CLIENT_CAPABILITIES).is_some_and(Value::is_object)
                    && header("mcp-method") == Some(Some(method));
                let named = method != "tools/call" || header("mcp-name").flatten() == name.as_deref();
                (stateless && named).then_some(Era::Stateless)
            }
        }
    }
}

/// The versions of the session era the lane relays a session's requests under.
const LEGACY_VERSIONS: [&str; 3] = ["2025-11-25", "2025-06-18", "2025-03-26"];
const STATELESS: &str = "2026-07-28";
const PROTOCOL_VERSION: &str = "io.modelcontextprotocol/protocolVersion";
const CLIENT_CAPABILITIES: &str = "io.modelcontextprotocol/clientCapabilities";

/// A JSON response (`body`, a JSON-RPC message).
fn json(body: String) -> Response {
    let mut response = Response::new(Body::from(body));
    response.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
    response
}
