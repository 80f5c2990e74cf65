//! The relay lane's way to the proxied server over streamable HTTP: the caller's request, its
//! envelope's id made the proxy's own (ids are per session, and many callers share one), POSTed
//! on the session's pooled connections with the session's headers; the answer read from a JSON
//! body or from the request's event stream, on which what comes before it is passed on: the
//! call's progress to its caller's stream, what the server asks to its caller (as rmcp's client
//! asks: [`Ask`]), anything else as rmcp's client relays it ([`Relay`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::body::Bytes;
use futures::StreamExt;
use http::header::{ACCEPT, CONTENT_TYPE};
use rmcp::ErrorData;
use rmcp::model::{JsonRpcRequest, RequestMetaObject, ServerNotification, ServerRequest};
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use tokio::sync::{mpsc, oneshot};

use super::envelope::{self, Envelope, OwnedParams};
use crate::mcp::limited::Said as Answer;
use crate::mcp::raw::RawResult;
use crate::proxy::came::Came;
use crate::proxy::link::Target;
use crate::proxy::relay::{Ask, Asked, Relay, Reply as Answered};
use crate::proxy::scopes::Upstream;
use crate::proxy::seat::Seat;
use crate::proxy::tap::Tap;

/// The most a reply may hold: its JSON body, or all of its event stream (as rmcp's client holds
/// a JSON answer to).
const MOST: usize = 16 * 1024 * 1024;

/// What the proxied server answered a request sent through the lane.
#[derive(Debug)]
pub(crate) enum Reply {
    /// Its result, as JSON.
    Result(String),
    /// Its own JSON-RPC error.
    Error(ErrorData),
    /// No answer (why, any password in a URL taken out).
    Failed(String),
}

/// Ids of the lane's requests, unique for the proxy's life: `mcp-rl-N`, never one rmcp's client
/// (numbers) uses on the same session.
static NEXT: AtomicU64 = AtomicU64::new(0);

fn next_id() -> String {
    format!("mcp-rl-{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// A call the lane sends: the caller's params as they came (its `_meta` the one the proxied server
/// hears: [`Relayed::send`]), and where what comes before the answer goes.
pub(crate) struct Relayed {
    pub(super) method: &'static str,
    /// The name a router in front of a 2026-07-28 server reads (`Mcp-Name`).
    pub(super) name: String,
    pub(super) params: OwnedParams,
    pub(super) hearing: Hearing,
    /// A 2026-07-28 caller's call, asked what the server asks in rounds ([`super::rounds`]).
    pub(super) bridge: Option<super::rounds::Bridge>,
}

/// Where what the proxied server sends before its answer goes.
#[derive(Clone, Default)]
pub(crate) struct Hearing {
    /// The call's caller's stream (its progress): `None` where nobody listens.
    pub(super) interim: Option<mpsc::Sender<Bytes>>,
    /// The session to ask what the server asks (a 2025-11-25 session; a 2026-07-28 caller is
    /// never sent requests).
    pub(super) asker: Option<Arc<Seat>>,
    /// For a 2026-07-28 caller: where what the server asks goes, to be asked in a round
    /// ([`super::rounds`]), and what its client declared it can be asked.
    pub(super) rounds: Option<mpsc::Sender<Asked>>,
    pub(super) capabilities: Option<rmcp::model::ClientCapabilities>,
    /// The caller's progress token, where a stdio child is given the lane's own: two callers on
    /// one child may use the same token, and rmcp's client its own numbers.
    pub(super) progress_of_caller: Option<Value>,
}

impl Hearing {
    /// Hands `ask` to be asked of this call's caller: on its session, or in a round; refused when
    /// it can be asked neither way.
    async fn ask(&self, ask: Ask, reply: oneshot::Sender<Result<Answered, ErrorData>>) {
        if let Some(seat) = &self.asker {
            let answered = match seat.peer() {
                Some(peer) => ask.of(peer, seat.capabilities().as_ref()).await,
                None => Err(unaskable()),
            };
            let _ = reply.send(answered);
        } else if let Some(rounds) = &self.rounds {
            if let Err(mpsc::error::SendError((_, reply))) = rounds.send((ask, reply)).await {
                let _ = reply.send(Err(unaskable()));
            }
        } else {
            let _ = reply.send(Err(unaskable()));
        }
    }
}

impl Relayed {
    /// Sends the call on `upstream` with `meta` (what the proxied server hears of the caller's:
    /// [`crate::proxy::Upstream::upstream_meta`]) and waits for its answer. Dropped before it (the
    /// caller cancelled, the timeout), a 2025-11-25 server is told to stop; a 2026-07-28 server's
    /// request is closed.
    pub(crate) async fn send(self, upstream: &Arc<Upstream>, meta: RequestMetaObject) -> Came {
        let id = next_id();
        let mut meta = for_the_session(upstream, meta.0.0);
        let mut hearing = self.hearing;
        if upstream.link().tap().is_some() {
            hearing.progress_of_caller =
                meta.get_mut("progressToken").map(|token| std::mem::replace(token, Value::String(id.clone())));
        }
        let members = self.params.iter().map(|(key, value)| (key.as_str(), value.as_ref()));
        let body = envelope::request(&id, self.method, members, Some(&meta));
        // A 2026-07-28 server over HTTP hears the request closed; any other is told.
        let told = !upstream.stateless() || upstream.link().tap().is_some();
        let stop = StopOnDrop { upstream: told.then(|| upstream.clone()), id: id.clone() };
        let reply = post(upstream, (self.method, Some(&self.name), &meta), body, &id, &hearing).await;
        stop.disarm();
        match reply {
            Reply::Result(json) => match RawResult::read(&json) {
                Ok(raw) => Came::Result(Answer::Raw(raw)),
                Err(error) => Came::Error(ErrorData::internal_error(
                    format!("the proxied server's result could not be read: {error}"),
                    None,
                )),
            },
            Reply::Error(error) => Came::Error(error),
            Reply::Failed(detail) => Came::Failed(detail),
        }
    }
}

/// A request of the proxy's own on `upstream` through the lane (a 2025-11-25 task's `tasks/get`,
/// which rmcp's client does not know), within the time a listing of tools has.
pub(crate) async fn request(upstream: &Upstream, method: &str, params: &Value) -> Reply {
    let Ok(params) = serde_json::from_value::<OwnedParams>(params.clone()) else {
        return Reply::Failed("its params are not an object".to_owned());
    };
    request_within(upstream, method, &params, Map::new(), crate::proxy::link::ANSWER_WITHIN).await
}

/// A request on `upstream` through the lane: `params` with `meta` (what the proxied server hears
/// of the caller's), its answer awaited at most `within`.
pub(crate) async fn request_within(
    upstream: &Upstream,
    method: &str,
    params: &OwnedParams,
    meta: Map<String, Value>,
    within: std::time::Duration,
) -> Reply {
    let id = next_id();
    let meta = for_the_session(upstream, meta);
    let body = envelope::request(&id, method, params.iter().map(|(k, v)| (k.as_str(), v.as_ref())), Some(&meta));
    let nobody = Hearing::default();
    let asked = post(upstream, (method, None, &meta), body, &id, &nobody);
    tokio::time::timeout(within, asked).await.unwrap_or_else(|_| Reply::Failed("no answer in time".to_owned()))
}

/// `meta` as a request on `upstream` carries it: to a 2026-07-28 server, which has no session,
/// what describes the proxy's connection to it (its protocol version, the proxy as its client,
/// the capabilities its client declares where the caller said none of its own).
fn for_the_session(upstream: &Upstream, mut meta: Map<String, Value>) -> Map<String, Value> {
    if upstream.stateless() {
        meta.insert(PROTOCOL_VERSION.to_owned(), Value::String(STATELESS.to_owned()));
        meta.insert(CLIENT_INFO.to_owned(), crate::proxy::relay::client_info());
        meta.entry(CLIENT_CAPABILITIES.to_owned()).or_insert_with(crate::proxy::relay::client_capabilities);
    }
    meta
}

const PROTOCOL_VERSION: &str = "io.modelcontextprotocol/protocolVersion";
const CLIENT_INFO: &str = "io.modelcontextprotocol/clientInfo";
const CLIENT_CAPABILITIES: &str = "io.modelcontextprotocol/clientCapabilities";
const STATELESS: &str = "2026-07-28";

/// What a message says of itself in its headers: its method, its name (`Mcp-Name`), its `_meta`
/// (the W3C trace context in it goes as headers too, where an HTTP server instrumented with
/// OpenTelemetry reads it).
type Said<'a> = (&'a str, Option<&'a str>, &'a Map<String, Value>);

/// Sends `body` (a message; a request's id is `id`) on `upstream` — POSTed over HTTP, a line to a
/// stdio child — and reads the answer. While a call whose caller can be asked is in flight, what
/// the server asks on no call's stream (every request of a stdio child; a server's own over HTTP)
/// may be this call's: the call is one of those in flight on the session
/// ([`crate::proxy::Downstream::route_asks`]), and what reaches it is asked of its caller.
async fn post(upstream: &Upstream, said: Said<'_>, body: Vec<u8>, id: &str, hearing: &Hearing) -> Reply {
    let sent = async {
        match upstream.link().tap() {
            Some(tap) => by_line(&tap, said, body, id, hearing).await,
            None => over_http(upstream, said, body, id, hearing).await,
        }
    };
    if id.is_empty() || (hearing.asker.is_none() && hearing.rounds.is_none()) {
        return sent.await;
    }
    let (session, capabilities) = match &hearing.asker {
        Some(seat) => (seat.member(), seat.capabilities()),
        None => (None, hearing.capabilities.clone()),
    };
    let call = rmcp::model::RequestId::String(id.into());
    let (_route, mut asks) = upstream.downstream().route_asks(call, session, capabilities);
    let mut sent = std::pin::pin!(sent);
    // Each question asked while the call goes on: one the server asks on the call's own stream
    // (inside `sent`) is not held up by one asked off it, nor one off it by another.
    let mut asking = futures::stream::FuturesUnordered::new();
    loop {
        tokio::select! {
            reply = &mut sent => return reply,
            Some((ask, reply)) = asks.recv() => asking.push(hearing.ask(ask, reply)),
            Some(()) = asking.next(), if !asking.is_empty() => {}
        }
    }
}

/// [`post`] to a stdio child: the line written, its answer the child's line with its id.
async fn by_line(tap: &Arc<Tap>, said: Said<'_>, body: Vec<u8>, id: &str, hearing: &Hearing) -> Reply {
    let (_method, _name, meta) = said;
    if id.is_empty() {
        // A message that is no request (an answer, a notification): written, nothing to wait for.
        return if tap.send(body).await { Reply::Result(String::new()) } else { gone() };
    }
    let (mut waiting, answer) = tap.await_answer(id);
    if let (Some(token), Some(interim), Some(theirs)) =
        (meta.get("progressToken"), &hearing.interim, &hearing.progress_of_caller)
    {
        tap.hear_progress(&mut waiting, token.to_string(), interim.clone(), theirs.clone());
    }
    if !tap.send(body).await {
        return gone();
    }
    match answer.await {
        Ok(line) => match Envelope::read(&line) {
            Some(envelope) => answer_of(&envelope),
            None => Reply::Failed("its answer is not a JSON-RPC response".to_owned()),
        },
        Err(_) => gone(),
    }
}

fn gone() -> Reply {
    Reply::Failed("the proxied server's process is gone".to_owned())
}

/// [`post`] over streamable HTTP.
async fn over_http(
    upstream: &Upstream,
    (method, name, meta): Said<'_>,
    body: Vec<u8>,
    id: &str,
    hearing: &Hearing,
) -> Reply {
    let link = upstream.link();
    let (Target::Http { headers, .. }, Some(endpoint)) = (link.target(), link.endpoint()) else {
        return Reply::Failed("the proxied server is not reached over HTTP".to_owned());
    };
    let mut request = link
        .client()
        .post(endpoint.clone())
        .header(CONTENT_TYPE, "application/json")
        .header(ACCEPT, "application/json, text/event-stream");
    for (header, value) in headers {
        request = request.header(header, value);
    }
    for name in ["traceparent", "tracestate"] {
        if let Some(value) = meta.get(name).and_then(Value::as_str).and_then(|v| http::HeaderValue::from_str(v).ok()) {
            request = request.header(name, value);
        }
    }
    if upstream.stateless() {
        request = request.header("mcp-protocol-version", STATELESS).header("mcp-method", method);
        if let Some(name) = name.and_then(|name| http::HeaderValue::from_str(name).ok()) {
            request = request.header("mcp-name", name);
        }
    } else {
        if let Some(info) = link.info() {
            request = request.header("mcp-protocol-version", info.protocol_version.as_str());
        }
        if let Some(session) = link.session_id() {
            request = request.header("mcp-session-id", session.as_str());
        }
    }
    let response = match request.body(body).send().await {
        Ok(response) => response,
        Err(error) => return Reply::Failed(crate::redact::url(&error.to_string())),
    };
    let status = response.status();
    if !status.is_success() {
        return Reply::Failed(format!("it answered HTTP {status}"));
    }
    let streamed = response
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.trim_start().starts_with("text/event-stream"));
    if streamed { read_stream(upstream, response, id, hearing).await } else { read_body(response, id).await }
}

/// The answer to request `id` in a JSON body.
async fn read_body(mut response: reqwest::Response, id: &str) -> Reply {
    let mut body = Vec::new();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) if body.len() + chunk.len() <= MOST => body.extend_from_slice(&chunk),
            Ok(Some(_)) => return Reply::Failed(format!("its answer is larger than {MOST} bytes")),
            Ok(None) => break,
            Err(error) => return Reply::Failed(crate::redact::url(&error.to_string())),
        }
    }
    match Envelope::read(&body) {
        Some(envelope) if answers(&envelope, id) => answer_of(&envelope),
        _ => Reply::Failed("its answer is not a JSON-RPC response to the call".to_owned()),
    }
}

/// Whether `envelope` is the answer to request `id`.
fn answers(envelope: &Envelope<'_>, id: &str) -> bool {
    envelope.method.is_none()
        && envelope.id.is_some_and(|theirs| serde_json::from_str::<&str>(theirs.get()).ok() == Some(id))
}

/// The answer an envelope holds.
fn answer_of(envelope: &Envelope<'_>) -> Reply {
    match (envelope.result, envelope.error) {
        (Some(result), None) => Reply::Result(result.get().to_owned()),
        (None, Some(error)) => match serde_json::from_str::<ErrorData>(error.get()) {
            Ok(error) => Reply::Error(error),
            Err(_) => Reply::Failed("its error could not be read".to_owned()),
        },
        _ => Reply::Failed("its answer is neither a result nor an error".to_owned()),
    }
}

/// The answer to request `id` on its event stream, what comes before it passed on.
async fn read_stream(upstream: &Upstream, response: reqwest::Response, id: &str, hearing: &Hearing) -> Reply {
    let mut read = 0usize;
    let capped = response.bytes_stream().map(move |chunk| {
        let chunk = chunk.map_err(std::io::Error::other)?;
        read = read.saturating_add(chunk.len());
        if read > MOST {
            return Err(std::io::Error::other(format!("its event stream is longer than {MOST} bytes")));
        }
        Ok::<_, std::io::Error>(chunk)
    });
    let mut events = sse_stream::SseStream::from_bytes_stream(capped);
    while let Some(event) = events.next().await {
        let event = match event {
            Ok(event) => event,
            Err(error) => return Reply::Failed(format!("its event stream broke: {error}")),
        };
        let Some(data) = event.data.as_deref() else { continue };
        let Some(envelope) = Envelope::read(data.as_bytes()) else { continue };
        if answers(&envelope, id) {
            return answer_of(&envelope);
        }
        match (&envelope.method, envelope.id) {
            (Some(_), Some(asked)) => answer_ask(upstream, data, asked, hearing).await,
            (Some(method), None) if method == "notifications/progress" => {
                if let Some(interim) = &hearing.interim {
                    let _ = interim.send(Bytes::copy_from_slice(data.as_bytes())).await;
                }
            }
            (Some(_), None) => {
                if let Ok(heard) = serde_json::from_str::<rmcp::model::JsonRpcNotification<ServerNotification>>(data) {
                    Relay::new(upstream.downstream().clone()).heard(heard.notification).await;
                }
            }
            _ => {}
        }
    }
    Reply::Failed("its event stream ended without an answer".to_owned())
}

/// Answers what the proxied server asked on a call's stream (`data`, a request whose id is
/// `asked`): its caller's answer when the caller is a session that can be asked, else the reason
/// it cannot; sent back on the session.
async fn answer_ask(upstream: &Upstream, data: &str, asked: &RawValue, hearing: &Hearing) {
    let answer: Result<String, ErrorData> = match serde_json::from_str::<JsonRpcRequest<ServerRequest>>(data) {
        Ok(request) => match Ask::from_request(request.request) {
            Ok(ask) => {
                let (reply, answered) = oneshot::channel();
                hearing.ask(ask, reply).await;
                let gone = || ErrorData::invalid_request("the call it was asked for is over", None);
                answered.await.unwrap_or_else(|_| Err(gone())).and_then(|reply| written(&reply))
            }
            Err(answer) => answer,
        },
        Err(_) => {
            Err(ErrorData::new(rmcp::model::ErrorCode::METHOD_NOT_FOUND, "the proxy answers no such request", None))
        }
    };
    let body = match &answer {
        Ok(result) => envelope::result(asked, result),
        Err(error) => envelope::error(asked, error),
    };
    // An answer is a message on the session: accepted (202) or not, nothing more comes of it.
    let nobody = Hearing::default();
    let _ = Box::pin(post(upstream, ("", None, &Map::new()), body.into_bytes(), "", &nobody)).await;
}

fn unaskable() -> ErrorData {
    ErrorData::invalid_request(
        "the caller cannot be asked: it speaks 2026-07-28, which has no requests from the server",
        None,
    )
}

/// A caller's answer, as JSON.
fn written(reply: &Answered) -> Result<String, ErrorData> {
    let json = match reply {
        Answered::Sampling(result) => serde_json::to_string(result),
        Answered::Elicitation(result) => serde_json::to_string(result),
        Answered::Roots(result) => serde_json::to_string(result),
    };
    json.map_err(|e| ErrorData::internal_error(format!("the caller's answer could not be written: {e}"), None))
}

/// Tells a 2025-11-25 server to stop a call nobody waits for any more (dropped before disarmed).
struct StopOnDrop {
    upstream: Option<Arc<Upstream>>,
    id: String,
}

impl StopOnDrop {
    fn disarm(mut self) {
        self.upstream = None;
    }
}

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        let Some(upstream) = self.upstream.take() else { return };
        let params = serde_json::json!({"requestId": self.id, "reason": "the caller stopped waiting"});
        let body = serde_json::json!({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": params});
        let body = serde_json::to_vec(&body).unwrap_or_default();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let said = ("notifications/cancelled", None, &Map::new());
                let _ = post(&upstream, said, body, "", &Hearing::default()).await;
            });
        }
    }
}
