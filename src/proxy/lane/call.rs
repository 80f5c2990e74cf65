//! A `tools/call` through the relay lane: the one guarded call at the proxy's door, its work the
//! caller's request forwarded as it came, its answer passed on as it came with what the guard
//! adds; a JSON body, or an event stream once something comes before the answer (its progress).

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::response::Response;
use futures::StreamExt;
use http::request::Parts;
use rmcp::ErrorData;
use rmcp::model::{CallToolResponse, ClientCapabilities, RequestMetaObject, ResultType};
use serde::Deserialize as _;
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::envelope::{self, Params};
use super::rounds::{self, Binding, Bridge};
use super::send::{Hearing, Relayed};
use super::{Era, LaneState, json};
use crate::guard::shed::Arrived;
use crate::guard::{Call, Used, Worked};
use crate::identity::Caller;
use crate::mcp::limited::{Finished, finish};
use crate::mcp::raw::RawKind;
use crate::mcp::results::{AddTo, Editing};
use crate::proxy::scopes::{self, Upstream};
use crate::proxy::server::{ToSession, with_trace_headers};
use crate::proxy::{Outgoing, Sending};

/// The methods this part of the lane takes.
pub(super) const TAKEN: [&str; 1] = ["tools/call"];

/// How many of a call's notifications (its progress) may wait for its caller's stream.
const INTERIM_KEPT: usize = 16;

/// The lane's calls in flight from 2025-11-25 sessions, by session and request id: what a
/// session's `notifications/cancelled` stops.
#[derive(Default)]
pub(super) struct InFlight(Mutex<HashMap<(Arc<str>, String), CancellationToken>>);

impl InFlight {
    fn calls(&self) -> std::sync::MutexGuard<'_, HashMap<(Arc<str>, String), CancellationToken>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Cancels the call `request` (its id as the caller wrote it) of session `session`; whether it
    /// was one of the lane's.
    pub(super) fn cancel(&self, session: &str, request: &str) -> bool {
        let token = self.calls().get(&(Arc::from(session), request.to_owned())).cloned();
        token.inspect(CancellationToken::cancel).is_some()
    }
}

/// A call's place in [`InFlight`], left when dropped.
struct Registered<'a> {
    calls: &'a InFlight,
    key: Option<(Arc<str>, String)>,
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            self.calls.calls().remove(&key);
        }
    }
}

/// What the lane reads of a call's params before it is charged.
struct Asked {
    name: String,
    arguments: Map<String, Value>,
    /// The round of an earlier call it resumes (MCP's `requestState`; empty with `inputResponses`
    /// alone).
    resumes: Option<String>,
}

impl Asked {
    /// `None` where a member is not what the spec says it is (rmcp then answers).
    fn read(params: &Params<'_>) -> Option<Self> {
        let name: String = envelope::member(params, "name")?.ok()?;
        let arguments = match envelope::member::<Map<String, Value>>(params, "arguments") {
            None => Map::new(),
            Some(arguments) => arguments.ok()?,
        };
        let state = envelope::member::<String>(params, "requestState").transpose().ok()?;
        let resumes = state.or_else(|| params.contains_key("inputResponses").then(String::new));
        Some(Self { name, arguments, resumes })
    }
}

impl LaneState {
    /// A `tools/call`, as rmcp's path serves it (`ProxyServer::call_tool`) but for the bytes: a
    /// tool the proxied server does not list is `-32602`, charged nothing; any other passes the one
    /// guarded call at the proxy's door, its work the caller's request forwarded on its scope's
    /// session.
    pub(super) async fn call_tool(
        self: &Arc<Self>,
        era: Era,
        caller: Caller,
        parts: &Parts,
        id: &RawValue,
        params: Params<'_>,
        meta: Map<String, Value>,
    ) -> Option<Response> {
        let asked = Asked::read(&params)?;
        if !self.proxied.lists(&asked.name) {
            let unknown = ErrorData::invalid_params(format!("unknown tool `{}`", asked.name), None);
            return Some(json(envelope::error(id, &unknown)));
        }
        let meta = serde_json::from_value::<RequestMetaObject>(Value::Object(meta)).ok()?;
        let span = crate::mcp::trace::call_span_of(
            &asked.name,
            &id.get(),
            crate::mcp::trace::Carrier { meta: &meta.0.0, headers: Some(&parts.headers) },
        );
        let meta = with_trace_headers(meta, Some(&parts.headers));
        let (interim, heard) = mpsc::channel(INTERIM_KEPT);
        let (asker, bridge) = match &era {
            Era::Session { seat, .. } => (Some(seat.clone()), None),
            Era::Stateless => match self.bridge(&caller, &asked, &params) {
                Ok(bridge) => (None, Some(bridge)),
                Err(refused) => return Some(json(envelope::error(id, &refused))),
            },
        };
        // What a 2026-07-28 caller's client declared it can be asked (a session's is its seat's).
        let capabilities = bridge
            .as_ref()
            .and_then(|_| meta.0.0.get(super::CLIENT_CAPABILITIES))
            .and_then(|declared| ClientCapabilities::deserialize(declared).ok());
        let hearing = Hearing { interim: Some(interim), asker, capabilities, ..Hearing::default() };
        let params = envelope::owned(&params);
        let relayed = Relayed { method: "tools/call", name: asked.name.clone(), params, hearing, bridge };
        let arrived = parts.extensions.get::<Arrived>().map(|arrived| arrived.0);
        let (lane, id) = (self.clone(), id.to_owned());
        let finishing = async move {
            let answered = lane.guarded(&era, &caller, asked, meta, relayed, arrived, &id).await;
            render(answered, &era, &id)
        };
        Some(respond(finishing.instrument(span), heard).await)
    }

    /// A 2026-07-28 caller's call, to be asked in rounds what the proxied server asks: the round it
    /// resumes when its `requestState` is one of the proxy's — refused (nothing charged) when that
    /// round does not wait for this call's answers.
    fn bridge(&self, caller: &Caller, asked: &Asked, params: &Params<'_>) -> Result<Bridge, ErrorData> {
        let binding = Binding::of(caller, &asked.name, &asked.arguments);
        let resume = match asked.resumes.as_deref() {
            Some(state) if state.starts_with(rounds::PREFIX) => {
                let responses = envelope::member::<Value>(params, "inputResponses").and_then(Result::ok);
                Some(self.proxied.rounds.resume_of(state, &binding, responses.as_ref())?)
            }
            _ => None,
        };
        Ok(Bridge { binding, resume })
    }

    /// The call through the one guarded call ([`crate::guard::call`]) at the proxy's door; a task
    /// it makes recorded as its caller's.
    #[expect(clippy::too_many_arguments, reason = "one call's parts, each read once")]
    async fn guarded(
        &self,
        era: &Era,
        caller: &Caller,
        asked: Asked,
        meta: RequestMetaObject,
        relayed: Relayed,
        arrived: Option<crate::clock::Nanos>,
        id: &RawValue,
    ) -> Finished {
        let proxied = &self.proxied;
        let upstream: Result<Arc<Upstream>, _> = match era {
            Era::Session { seat, .. } => seat.upstream(proxied, &self.limits, caller, &asked.name).await,
            Era::Stateless => {
                let scope = proxied.scopes().scope_of(caller, None);
                proxied.scopes().get(scope, caller, &self.limits, &asked.name).await
            }
        };
        let upstream = upstream.map_err(|unopened| proxied.unopened_refusal(&asked.name, unopened));
        let unopened = upstream.as_ref().err().cloned();
        let sending = Sending::Lane(Box::new(relayed));
        let outgoing = upstream.map(|upstream| Outgoing { tool: asked.name.clone(), meta, upstream, sending });
        let working = proxied.clone();
        let work = move |admitted, _: &Value| async move {
            match outgoing {
                Ok(outgoing) => working.work(admitted, outgoing).await,
                Err(refusal) => Worked::Refused(refusal, Used::Nothing),
            }
        };
        let cancelled = CancellationToken::new();
        let _registered = self.register(era, id, &cancelled);
        let call = Call {
            tool: &asked.name,
            caller,
            args: &asked.arguments,
            cancelled,
            resumes: asked.resumes.as_deref(),
            arrived,
            reads_only: proxied.reads_only(&asked.name),
        };
        let door = ToSession { proxied, unopened };
        let called = self.limits.guard().call(&door, Some(self.limits.reuse()), call, work).await;
        let finished = finish(called, AddTo::Meta, true);
        if let Some((task, ttl_ms)) = task_made(&finished) {
            let scope = match era {
                Era::Session { seat, .. } => seat.scope(proxied, caller),
                Era::Stateless => proxied.scopes().scope_of(caller, None),
            };
            let key = scopes::task_key(scope.as_deref(), &task);
            proxied.tasks.record(&key, ttl_ms, caller.id(), caller.unverified_from());
        }
        finished
    }

    /// The call's place among those a session's `notifications/cancelled` stops (a 2026-07-28
    /// request is stopped by closing it).
    fn register(&self, era: &Era, id: &RawValue, cancelled: &CancellationToken) -> Registered<'_> {
        let key = match era {
            Era::Session { id: session, .. } => Some((session.clone(), id.get().to_owned())),
            Era::Stateless => None,
        };
        if let Some(key) = &key {
            self.calls.calls().insert(key.clone(), cancelled.clone());
        }
        Registered { calls: &self.calls, key }
    }
}

/// The task an answer made, and how long the server keeps it.
fn task_made(finished: &Finished) -> Option<(String, Option<u64>)> {
    match finished {
        Finished::Raw(Editing { result, .. }) => match result.kind() {
            RawKind::Task(task) => Some((task.id.clone(), task.ttl_ms)),
            _ => None,
        },
        Finished::Response(Ok(CallToolResponse::Task(task))) => Some((task.task.task_id.clone(), task.task.ttl_ms)),
        Finished::Response(_) => None,
    }
}

/// What a call came to, as the JSON-RPC response to request `id` that its caller's era reads: a
/// complete result says `resultType: "complete"` to a 2026-07-28 caller, and never to a
/// 2025-11-25 one (as rmcp writes them).
fn render(finished: Finished, era: &Era, id: &RawValue) -> String {
    let stateless = era.stateless();
    let written = match finished {
        Finished::Raw(Editing { result, mut edit }) => {
            if matches!(result.kind(), RawKind::Complete { .. }) && stateless != result.says_result_type() {
                edit.set_result_type(stateless.then_some(ResultType::COMPLETE.as_str()));
            }
            edit.apply(&result)
        }
        Finished::Response(Ok(CallToolResponse::Complete(mut done))) => {
            done.result_type = stateless.then_some(ResultType::COMPLETE);
            serde_json::to_string(&done)
        }
        Finished::Response(Ok(CallToolResponse::Task(task))) => serde_json::to_string(&task),
        Finished::Response(Ok(CallToolResponse::InputRequired(input))) => serde_json::to_string(&input),
        Finished::Response(Ok(_)) => Ok(r#"{"content":[],"isError":true}"#.to_owned()),
        Finished::Response(Err(error)) => return envelope::error(id, &error),
    };
    match written {
        Ok(result) => envelope::result(id, &result),
        Err(error) => {
            envelope::error(id, &ErrorData::internal_error(format!("the answer could not be written: {error}"), None))
        }
    }
}

/// The answer to a call: a JSON body when nothing comes before it; else an event stream, what
/// came first (`heard`: its progress) and then the answer. Dropped (its caller gone), the call is
/// dropped with it: its slots come back, the proxied server is told to stop.
async fn respond(
    finishing: impl Future<Output = String> + Send + 'static,
    mut heard: mpsc::Receiver<Bytes>,
) -> Response {
    let mut finishing = Box::pin(finishing);
    let first = tokio::select! {
        biased;
        done = &mut finishing => {
            // What came before the answer goes before it, even when both were ready at once.
            let before: Vec<Bytes> = std::iter::from_fn(|| heard.try_recv().ok()).map(|e| event_of(&e)).collect();
            if before.is_empty() {
                return json(done);
            }
            let events = before.into_iter().chain(std::iter::once(event_of(done.as_bytes())));
            return event_stream(Body::from_stream(futures::stream::iter(events).map(Ok::<_, Infallible>)));
        }
        first = heard.recv() => first,
    };
    let Some(first) = first else { return json(finishing.await) };
    let events =
        futures::stream::unfold((Some(first), Some(finishing), heard), |(first, finishing, mut heard)| async move {
            if let Some(event) = first {
                return Some((event_of(&event), (None, finishing, heard)));
            }
            let mut finishing = finishing?;
            tokio::select! {
                biased;
                Some(event) = heard.recv() => Some((event_of(&event), (None, Some(finishing), heard))),
                done = &mut finishing => Some((event_of(done.as_bytes()), (None, None, heard))),
            }
        });
    event_stream(Body::from_stream(events.map(Ok::<_, Infallible>)))
}

/// A response carrying `body`, an event stream.
fn event_stream(body: Body) -> Response {
    let mut response = Response::new(body);
    let headers = response.headers_mut();
    headers.insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("text/event-stream"));
    headers.insert(http::header::CACHE_CONTROL, http::HeaderValue::from_static("no-cache"));
    response
}

/// One server-sent event carrying a JSON-RPC message (a line of `data:` for each of its lines: a
/// server's JSON may be written over many).
fn event_of(message: &[u8]) -> Bytes {
    let mut event = Vec::with_capacity(message.len() + 24);
    event.extend_from_slice(b"event: message\n");
    for line in message.split(|&b| b == b'\n') {
        event.extend_from_slice(b"data: ");
        event.extend_from_slice(line.strip_suffix(b"\r").unwrap_or(line));
        event.push(b'\n');
    }
    event.push(b'\n');
    Bytes::from(event)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Progress that came before the answer is never dropped for it: with both ready when the
    /// response is made, the progress goes first, on an event stream.
    #[tokio::test]
    async fn progress_ready_with_the_answer_goes_before_it() {
        let (interim, heard) = mpsc::channel(INTERIM_KEPT);
        for n in 1..=2 {
            let progress =
                format!(r#"{{"jsonrpc":"2.0","method":"notifications/progress","params":{{"progress":{n}}}}}"#);
            interim.send(Bytes::from(progress)).await.expect("queued");
        }
        let answer = r#"{"jsonrpc":"2.0","id":1,"result":{}}"#.to_owned();
        let response = respond(async move { answer }, heard).await;
        let kind = response.headers().get(http::header::CONTENT_TYPE).cloned();
        let body = axum::body::to_bytes(response.into_body(), usize::MAX).await.expect("the body");
        let body = String::from_utf8_lossy(&body);
        assert_eq!(kind.as_ref().and_then(|k| k.to_str().ok()), Some("text/event-stream"), "{body}");
        let said: Vec<&str> = body.lines().filter_map(|line| line.strip_prefix("data: ")).collect();
        assert_eq!(said.len(), 3, "{body}");
        assert!(said[0].contains(r#""progress":1"#) && said[1].contains(r#""progress":2"#), "{body}");
        assert!(said[2].contains(r#""result""#), "{body}");
    }
}
