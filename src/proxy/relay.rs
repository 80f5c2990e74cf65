//! What the proxied server says on its own, carried to the downstream sessions it concerns: a
//! call's progress to the session that made the call, a resource's update to the sessions that
//! subscribed to it, its log messages to the sessions that asked for them (`logging/setLevel`),
//! each at or above its own level, and the lists' changes to every session. The proxy's MCP
//! client ([`Relay`]) hears them; the downstream sessions join when they are initialized and
//! leave when their handler is dropped.
//!
//! **What it asks.** A request the proxied server sends while it serves a call — sampling
//! (`sampling/createMessage`), elicitation (`elicitation/create`), the client's roots
//! (`roots/list`) — is the caller's to answer, and only that caller's: it reaches the call that
//! is waiting for the server's answer ([`Downstream::route_asks`]), which asks its own caller
//! ([`Ask`]) and hands the answer back. Which call a request belongs to is the HTTP response stream
//! it arrived on (rmcp's [`InboundStreamOrigin`]: a 2025-11-25 server sends a call's requests on
//! that call's stream). A request on no call's stream — every request of a stdio child, where
//! there are no streams, or one the server sends on its own — goes to the one downstream session
//! that can be its asker (`Downstream::off_stream`): the only call in flight on this session to
//! the proxied server whose caller declared the capability it needs, else the only downstream
//! session on it. With more than one candidate it is refused: the proxy cannot tell whose it is,
//! and answering for one caller what another asked would leak. Every candidate is of the one scope
//! whose session this is (`proxy.upstream_sessions`: a tenant's callers, one address's unverified
//! callers, or one downstream session), so an answer never crosses a tenant.
//!
//! **Log levels.** The proxied server has one level, for its one client (the proxy); each session
//! has its own. A session's `logging/setLevel` is recorded for it alone, and the proxied server's
//! level is set to the most verbose any live session asked for ([`Downstream::set_level`]), so
//! one caller's `debug` never makes another caller hear `debug`: each message goes to the sessions
//! whose own level it meets. A session that never set a level hears none (the MCP spec lets a
//! server choose what to send before `setLevel`). A message is not routed to the call it came
//! from: a 2025-11-25 server's log notification does not say which request it belongs to.

// Sampling, roots and logging are legacy in 2026-07-28 (SEP-2577), and still what 2025-11-25
// servers send.
#![allow(deprecated)]

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

#[allow(deprecated)] // Logging is legacy in 2026-07-28, and still what servers send.
use rmcp::model::{
    ClientCapabilities, ClientConfig, Implementation, LoggingLevel, LoggingMessageNotificationParam,
    ProgressNotificationParam, ProgressToken, ResourceUpdatedNotificationParam,
};
use rmcp::model::{
    CreateMessageRequestParams, CreateMessageResult, ElicitRequestParams, ElicitResult, ElicitationCapability,
    ListRootsResult, RequestId, RootsCapabilities, SamplingCapability,
};
use rmcp::service::{InboundStreamOrigin, NotificationContext, Peer, RequestContext, ServiceError};
use rmcp::{ClientHandler, ErrorData, RoleClient, RoleServer};
use tokio::sync::{Notify, mpsc, oneshot};

/// The downstream sessions of one session to the proxied server, and which of them each
/// notification is for.
#[allow(deprecated)] // Logging is legacy in 2026-07-28, and still what servers send.
pub struct Downstream {
    next: AtomicU64,
    state: Mutex<State>,
    /// Rung when the proxied server's tools changed (or it came back): the list is fetched again
    /// (one bell for every session to it).
    tools_changed: Arc<Notify>,
    /// The level last set on the proxied server, held while a new one is set so that two
    /// sessions' `setLevel`s reach it in the order their levels were recorded.
    pub(super) upstream_level: tokio::sync::Mutex<Option<LoggingLevel>>,
    /// The changes the proxied server tells of, for the 2026-07-28 subscriptions on this session
    /// (`subscriptions/listen`), which join no session.
    changes: tokio::sync::broadcast::Sender<Change>,
}

/// A change of the proxied server's that a 2026-07-28 subscription hears of (its tools' are the
/// proxy's to tell: it lists them only once it has learnt them again).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Its prompts' list (`notifications/prompts/list_changed`).
    Prompts,
    /// Its resources' list (`notifications/resources/list_changed`).
    Resources,
    /// One resource, to whoever subscribed to it (`notifications/resources/updated`).
    Resource(String),
}

/// How many changes a slow subscription may fall behind by (then it is told of both kinds).
const CHANGES_KEPT: usize = 16;

#[derive(Default)]
#[allow(deprecated)] // Logging is legacy in 2026-07-28, and still what servers send.
struct State {
    sessions: HashMap<u64, Peer<RoleServer>>,
    /// The upstream progress token of a call in flight → the session and the token it gave.
    progress: HashMap<ProgressToken, (u64, ProgressToken)>,
    /// Resource URI → the sessions subscribed to it.
    subscribed: HashMap<String, HashSet<u64>>,
    /// The log level each session asked for; a session not here hears no log message.
    levels: HashMap<u64, LoggingLevel>,
    /// The upstream request id of a call waiting for its answer → where the proxied server's
    /// requests made while serving it go, and who its caller is.
    asks: HashMap<RequestId, CallAsks>,
}

/// Where the proxied server's requests for one call in flight go: to the call, which asks its
/// caller (a downstream session, or a 2026-07-28 request of none) whose client declared
/// `capabilities`.
struct CallAsks {
    to: mpsc::Sender<Asked>,
    session: Option<u64>,
    capabilities: Option<ClientCapabilities>,
}

/// Who answers a request the proxied server sent: a call in flight (its caller is asked within
/// the call's own request), or a downstream session with none.
enum Answerer {
    Call(mpsc::Sender<Asked>),
    Session(Peer<RoleServer>),
}

/// What the proxied server asks of a caller while it serves the caller's call.
#[derive(Debug)]
pub enum Ask {
    /// `sampling/createMessage`.
    Sampling(CreateMessageRequestParams),
    /// `elicitation/create`.
    Elicitation(ElicitRequestParams),
    /// `roots/list`.
    Roots,
}

/// A caller's answer to an [`Ask`].
#[derive(Debug)]
pub enum Reply {
    /// To `sampling/createMessage`.
    Sampling(CreateMessageResult),
    /// To `elicitation/create`.
    Elicitation(ElicitResult),
    /// To `roots/list`.
    Roots(ListRootsResult),
}

/// An ask on its way to the call it is for, with where its answer goes.
pub type Asked = (Ask, oneshot::Sender<Result<Reply, ErrorData>>);

impl Ask {
    /// What the proxied server asked in `request` (read by the relay lane off a call's stream);
    /// else the answer the proxy gives itself: `{}` to a ping, an error to anything else.
    pub fn from_request(request: rmcp::model::ServerRequest) -> Result<Self, Result<String, ErrorData>> {
        use rmcp::model::ServerRequest;
        match request {
            ServerRequest::CreateMessageRequest(asked) => Ok(Ask::Sampling(asked.params)),
            ServerRequest::ElicitRequest(asked) => Ok(Ask::Elicitation(asked.params)),
            ServerRequest::ListRootsRequest(_) => Ok(Ask::Roots),
            ServerRequest::PingRequest(_) => Err(Ok("{}".to_owned())),
            _ => Err(Err(ErrorData::new(
                rmcp::model::ErrorCode::METHOD_NOT_FOUND,
                "the proxy answers no such request",
                None,
            ))),
        }
    }

    /// The method the proxied server sent.
    pub fn method(&self) -> &'static str {
        match self {
            Ask::Sampling(_) => "sampling/createMessage",
            Ask::Elicitation(_) => "elicitation/create",
            Ask::Roots => "roots/list",
        }
    }

    /// The request as a 2026-07-28 caller is asked it in an `input_required` result's
    /// `inputRequests`: its method and params.
    pub fn request(&self) -> serde_json::Value {
        let params = match self {
            Ask::Sampling(params) => serde_json::to_value(params).ok(),
            Ask::Elicitation(params) => serde_json::to_value(params).ok(),
            Ask::Roots => None,
        };
        match params {
            Some(params) => serde_json::json!({"method": self.method(), "params": params}),
            None => serde_json::json!({"method": self.method()}),
        }
    }

    /// Whether a client that declared `capabilities` can be asked this.
    pub(crate) fn declared(&self, capabilities: Option<&ClientCapabilities>) -> bool {
        capabilities.is_some_and(|c| match self {
            Ask::Sampling(_) => c.sampling.is_some(),
            Ask::Elicitation(_) => c.elicitation.is_some(),
            Ask::Roots => c.roots.is_some(),
        })
    }

    /// Asks `caller` (its client declared `capabilities`, if it said): refused, without asking,
    /// when its client did not declare the capability the request needs.
    #[allow(deprecated)] // Sampling and roots are legacy in 2026-07-28, and still what servers send.
    pub async fn of(
        self,
        caller: &Peer<RoleServer>,
        capabilities: Option<&ClientCapabilities>,
    ) -> Result<Reply, ErrorData> {
        let method = self.method();
        if !self.declared(capabilities) {
            return Err(undeclared(method));
        }
        let answered = match self {
            Ask::Sampling(params) => caller.create_message(params).await.map(Reply::Sampling),
            Ask::Elicitation(params) => caller.create_elicitation(params).await.map(Reply::Elicitation),
            Ask::Roots => caller.list_roots().await.map(Reply::Roots),
        };
        answered.map_err(|error| match error {
            ServiceError::McpError(error) => error,
            other => ErrorData::internal_error(format!("the caller could not be asked `{method}`: {other}"), None),
        })
    }
}

/// The refusal of a question a caller's client did not declare it can be asked (`method`).
pub(crate) fn undeclared(method: &str) -> ErrorData {
    ErrorData::invalid_request(
        format!("the caller's client did not declare the capability `{method}` needs: it cannot be asked"),
        None,
    )
}

impl Reply {
    /// A caller's answer to a `method` question, read from the JSON it sent (a 2026-07-28 caller's
    /// `inputResponses`).
    pub fn read(method: &str, answer: serde_json::Value) -> Result<Self, serde_json::Error> {
        match method {
            "sampling/createMessage" => serde_json::from_value(answer).map(Reply::Sampling),
            "elicitation/create" => serde_json::from_value(answer).map(Reply::Elicitation),
            _ => serde_json::from_value(answer).map(Reply::Roots),
        }
    }
}

impl std::fmt::Debug for Downstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Downstream").field("sessions", &self.state().sessions.len()).finish()
    }
}

impl Downstream {
    /// No sessions yet; `tools_changed` rung when the proxied server says its tools changed.
    pub fn new(tools_changed: Arc<Notify>) -> Self {
        Self {
            next: AtomicU64::new(0),
            state: Mutex::default(),
            tools_changed,
            upstream_level: tokio::sync::Mutex::new(None),
            changes: tokio::sync::broadcast::Sender::new(CHANGES_KEPT),
        }
    }

    /// The changes told of from now on, for a subscription.
    pub fn changes(&self) -> tokio::sync::broadcast::Receiver<Change> {
        self.changes.subscribe()
    }

    /// A number for a 2026-07-28 subscription's place among the subscribers of resources (it
    /// joins no session: [`Downstream::subscribe`] and [`Downstream::unsubscribe`] take it).
    pub fn subscriber(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A session joins: it hears notifications until the [`Membership`] is dropped.
    pub fn join(self: &Arc<Self>, peer: Peer<RoleServer>) -> Membership {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.state().sessions.insert(id, peer);
        Membership { id, downstream: self.clone() }
    }

    /// The progress of the upstream call with token `upstream` goes to `session` as `token`,
    /// until the returned route is dropped.
    pub fn route_progress(self: &Arc<Self>, upstream: ProgressToken, session: u64, token: ProgressToken) -> Route {
        self.state().progress.insert(upstream.clone(), (session, token));
        Route { upstream, downstream: self.clone() }
    }

    /// The proxied server's requests made while it serves the upstream call `upstream` go to the
    /// returned receiver, until the route is dropped (the call has its answer, or was dropped);
    /// its caller is downstream session `session` (`None`: a 2026-07-28 request), whose client
    /// declared `capabilities`.
    pub fn route_asks(
        self: &Arc<Self>,
        upstream: RequestId,
        session: Option<u64>,
        capabilities: Option<ClientCapabilities>,
    ) -> (AskRoute, mpsc::Receiver<Asked>) {
        let (to, receiver) = mpsc::channel(4);
        self.state().asks.insert(upstream.clone(), CallAsks { to, session, capabilities });
        (AskRoute { upstream, downstream: self.clone() }, receiver)
    }

    /// Hands `ask` to the call whose response stream it arrived on, or for a request on no call's
    /// stream to the one downstream session that can be its asker ([`Downstream::off_stream`]),
    /// and waits for the answer; refused when there is no such call or session, or more than one.
    async fn ask(&self, context: &RequestContext<RoleClient>, ask: Ask) -> Result<Reply, ErrorData> {
        let method = ask.method();
        let answerer = match context.extensions.get::<InboundStreamOrigin>() {
            Some(InboundStreamOrigin::OutboundRequest(call)) => {
                self.state().asks.get(call).map(|call| Answerer::Call(call.to.clone()))
            }
            _ => self.off_stream(&ask),
        };
        let route = match answerer {
            Some(Answerer::Call(route)) => route,
            Some(Answerer::Session(caller)) => {
                let capabilities = caller.peer_info().map(|info| info.capabilities.clone());
                return ask.of(&caller, capabilities.as_ref()).await;
            }
            None => {
                return Err(ErrorData::invalid_request(
                    format!(
                        "`{method}` did not come on the stream of a call in flight, and more than one caller on \
                         this session to the proxied server could have asked it (or none): the proxy cannot tell \
                         whose it is"
                    ),
                    None,
                ));
            }
        };
        let gone = || ErrorData::invalid_request(format!("the call `{method}` was asked for is over"), None);
        let (reply, answer) = oneshot::channel();
        route.send((ask, reply)).await.map_err(|_| gone())?;
        answer.await.map_err(|_| gone())?
    }

    /// Who answers `ask`, which the proxied server sent on no call's stream (over stdio every
    /// request is; a server may also ask on its own). With calls in flight on this session to it:
    /// the one caller among them whose client declared what `ask` needs, or, none having
    /// declared it, the one caller of them all (asked, it is refused for want of the capability).
    /// A session's several calls are one caller; a 2026-07-28 request, which has no session, is a
    /// caller alone (asked in rounds: [`crate::proxy::lane`]). With no call in flight: the only
    /// downstream session on it.
    /// `None` when there is no candidate, or more than one. Every candidate is of the scope whose
    /// session this is, never another tenant's.
    fn off_stream(&self, ask: &Ask) -> Option<Answerer> {
        let mut state = self.state();
        state.prune();
        if !state.asks.is_empty() {
            let declared: Vec<&CallAsks> =
                state.asks.values().filter(|call| ask.declared(call.capabilities.as_ref())).collect();
            let pool = if declared.is_empty() { state.asks.values().collect() } else { declared };
            let first = pool.first()?;
            // A session's calls are one caller; a 2026-07-28 call, of no session, is a caller alone.
            let one_caller = match first.session {
                Some(_) => pool.iter().all(|call| call.session == first.session),
                None => pool.len() == 1,
            };
            return one_caller.then(|| Answerer::Call(first.to.clone()));
        }
        let mut sessions = state.sessions.values();
        match (sessions.next(), sessions.next()) {
            (Some(only), None) => Some(Answerer::Session(only.clone())),
            _ => None,
        }
    }

    /// Records that `session` subscribed to `uri`; `true` when it is the first to.
    pub fn subscribe(&self, session: u64, uri: &str) -> bool {
        let mut state = self.state();
        let subscribers = state.subscribed.entry(uri.to_owned()).or_default();
        subscribers.insert(session);
        subscribers.len() == 1
    }

    /// Records that `session` unsubscribed from `uri`; `true` when nobody is subscribed any more.
    pub fn unsubscribe(&self, session: u64, uri: &str) -> bool {
        let mut state = self.state();
        let Some(subscribers) = state.subscribed.get_mut(uri) else { return false };
        let was = subscribers.remove(&session);
        let none_left = subscribers.is_empty();
        if none_left {
            state.subscribed.remove(uri);
        }
        was && none_left
    }

    /// Records that `session` hears the proxied server's log messages at `level` and above;
    /// returns the level the proxied server must send at for every live session to hear what it
    /// asked for: the most verbose of theirs.
    #[allow(deprecated)] // Logging is legacy in 2026-07-28, and still what servers send.
    pub fn set_level(&self, session: u64, level: LoggingLevel) -> LoggingLevel {
        let mut state = self.state();
        state.prune();
        if state.sessions.contains_key(&session) {
            state.levels.insert(session, level);
        }
        state.levels.values().copied().min_by_key(|l| severity(*l)).unwrap_or(level)
    }

    /// The most verbose level any live session asked for, if one did: what a 2026-07-28 proxied
    /// server is asked to send at with each request, having no level of its own.
    #[allow(deprecated)] // Logging is legacy in 2026-07-28, and still what servers send.
    pub fn wanted_level(&self) -> Option<LoggingLevel> {
        // Asked with every call: the levels only (a session that left took its level with it),
        // not a walk of every session.
        self.state().levels.values().copied().min_by_key(|l| severity(*l))
    }

    /// The sessions to tell, pruned of those whose transport has closed.
    fn peers(&self, only: impl Fn(&State, u64) -> bool) -> Vec<Peer<RoleServer>> {
        let mut state = self.state();
        state.prune();
        let state = &*state;
        state.sessions.iter().filter(|(id, _)| only(state, **id)).map(|(_, peer)| peer.clone()).collect()
    }

    /// Tells every session that the proxied server's tools changed.
    pub async fn tools_list_changed(&self) {
        for peer in self.peers(|_, _| true) {
            let _ = peer.notify_tool_list_changed().await;
        }
    }

    fn leave(&self, id: u64) {
        let mut state = self.state();
        state.sessions.remove(&id);
        state.levels.remove(&id);
        state.progress.retain(|_, (session, _)| *session != id);
        state.subscribed.retain(|_, subscribers| {
            subscribers.remove(&id);
            !subscribers.is_empty()
        });
    }
}

impl State {
    /// Forgets the sessions whose transport has closed, and the levels they asked for.
    fn prune(&mut self) {
        self.sessions.retain(|_, peer| !peer.is_transport_closed());
        let sessions = &self.sessions;
        self.levels.retain(|id, _| sessions.contains_key(id));
    }
}

/// How severe a log level is: `debug` 0 to `emergency` 7, as RFC 5424 orders them (reversed).
#[allow(deprecated)] // Logging is legacy in 2026-07-28, and still what servers send.
fn severity(level: LoggingLevel) -> u8 {
    match level {
        LoggingLevel::Debug => 0,
        LoggingLevel::Info => 1,
        LoggingLevel::Notice => 2,
        LoggingLevel::Warning => 3,
        LoggingLevel::Error => 4,
        LoggingLevel::Critical => 5,
        LoggingLevel::Alert => 6,
        LoggingLevel::Emergency => 7,
    }
}

/// A downstream session's place among the sessions; it leaves when this is dropped.
#[derive(Debug)]
pub struct Membership {
    id: u64,
    downstream: Arc<Downstream>,
}

impl Membership {
    /// The session's number.
    pub fn id(&self) -> u64 {
        self.id
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        self.downstream.leave(self.id);
    }
}

/// A call's progress route; removed when dropped (the call has returned).
#[derive(Debug)]
pub struct Route {
    upstream: ProgressToken,
    downstream: Arc<Downstream>,
}

impl Drop for Route {
    fn drop(&mut self) {
        self.downstream.state().progress.remove(&self.upstream);
    }
}

/// A call's route for the proxied server's requests; removed when dropped.
#[derive(Debug)]
pub struct AskRoute {
    upstream: RequestId,
    downstream: Arc<Downstream>,
}

impl Drop for AskRoute {
    fn drop(&mut self) {
        self.downstream.state().asks.remove(&self.upstream);
    }
}

/// The proxy's MCP client: it declares sampling, elicitation and roots (a server offers the tools
/// that use them only to a client that does), routes what the proxied server asks to the caller
/// whose call it is serving, and relays what it sends on its own to [`Downstream`].
#[derive(Debug, Clone)]
pub struct Relay {
    downstream: Arc<Downstream>,
}

impl Relay {
    /// A client relaying to `downstream`.
    pub fn new(downstream: Arc<Downstream>) -> Self {
        Self { downstream }
    }
}

/// What the proxy's client declares: sampling, elicitation and roots (a server offers the tools
/// that use them only to a client that does).
fn declared() -> ClientCapabilities {
    let mut capabilities = ClientCapabilities::default();
    capabilities.sampling = Some(SamplingCapability::default());
    capabilities.elicitation = Some(ElicitationCapability::default());
    capabilities.roots = Some(RootsCapabilities::default());
    capabilities
}

/// Who the proxy's client is.
fn ours() -> Implementation {
    Implementation::new("mcp-ratelimit-proxy", env!("CARGO_PKG_VERSION"))
}

/// What the proxy's client declares, as a request's `_meta` says it (2026-07-28).
pub fn client_capabilities() -> serde_json::Value {
    static DECLARED: std::sync::LazyLock<serde_json::Value> =
        std::sync::LazyLock::new(|| serde_json::to_value(declared()).unwrap_or_default());
    DECLARED.clone()
}

/// Who the proxy's client is, as a request's `_meta` says it (2026-07-28).
pub fn client_info() -> serde_json::Value {
    static OURS: std::sync::LazyLock<serde_json::Value> =
        std::sync::LazyLock::new(|| serde_json::to_value(ours()).unwrap_or_default());
    OURS.clone()
}

#[allow(deprecated)] // Logging and resource subscriptions are legacy in 2026-07-28, and still in use.
impl ClientHandler for Relay {
    fn get_info(&self) -> ClientConfig {
        ClientConfig::new(declared(), ours())
    }

    async fn create_message(
        &self,
        params: CreateMessageRequestParams,
        context: RequestContext<RoleClient>,
    ) -> Result<CreateMessageResult, ErrorData> {
        match self.downstream.ask(&context, Ask::Sampling(params)).await? {
            Reply::Sampling(answer) => Ok(answer),
            _ => Err(ErrorData::internal_error("the caller answered another request", None)),
        }
    }

    async fn create_elicitation(
        &self,
        params: ElicitRequestParams,
        context: RequestContext<RoleClient>,
    ) -> Result<ElicitResult, ErrorData> {
        match self.downstream.ask(&context, Ask::Elicitation(params)).await? {
            Reply::Elicitation(answer) => Ok(answer),
            _ => Err(ErrorData::internal_error("the caller answered another request", None)),
        }
    }

    async fn list_roots(&self, context: RequestContext<RoleClient>) -> Result<ListRootsResult, ErrorData> {
        match self.downstream.ask(&context, Ask::Roots).await? {
            Reply::Roots(answer) => Ok(answer),
            _ => Err(ErrorData::internal_error("the caller answered another request", None)),
        }
    }

    async fn on_progress(&self, params: ProgressNotificationParam, _context: NotificationContext<RoleClient>) {
        let routed = {
            let state = self.downstream.state();
            state
                .progress
                .get(&params.progress_token)
                .and_then(|(session, token)| state.sessions.get(session).map(|peer| (peer.clone(), token.clone())))
        };
        if let Some((peer, token)) = routed {
            let mut params = params;
            params.progress_token = token;
            let _ = peer.notify_progress(params).await;
        }
    }

    async fn on_logging_message(
        &self,
        params: LoggingMessageNotificationParam,
        _context: NotificationContext<RoleClient>,
    ) {
        self.logged(params).await;
    }

    async fn on_resource_updated(
        &self,
        params: ResourceUpdatedNotificationParam,
        _context: NotificationContext<RoleClient>,
    ) {
        self.updated(params).await;
    }

    async fn on_resource_list_changed(&self, _context: NotificationContext<RoleClient>) {
        self.changed(Change::Resources).await;
    }

    async fn on_prompt_list_changed(&self, _context: NotificationContext<RoleClient>) {
        self.changed(Change::Prompts).await;
    }

    async fn on_tool_list_changed(&self, _context: NotificationContext<RoleClient>) {
        self.tools_changed();
    }
}

impl Relay {
    /// What the proxied server sent on its own, heard by the relay lane on a call's stream: relayed
    /// as rmcp's client relays it (a call's progress goes to its caller's stream instead).
    pub async fn heard(&self, notification: rmcp::model::ServerNotification) {
        use rmcp::model::ServerNotification as Heard;
        match notification {
            Heard::LoggingMessageNotification(logged) => self.logged(logged.params).await,
            Heard::ResourceUpdatedNotification(updated) => self.updated(updated.params).await,
            Heard::ResourceListChangedNotification(_) => self.changed(Change::Resources).await,
            Heard::PromptListChangedNotification(_) => self.changed(Change::Prompts).await,
            Heard::ToolListChangedNotification(_) => self.tools_changed(),
            _ => {}
        }
    }

    /// A log message, to the sessions that asked for it, each at its own level.
    async fn logged(&self, params: LoggingMessageNotificationParam) {
        let heard = severity(params.level);
        let asked = |state: &State, id: u64| state.levels.get(&id).is_some_and(|l| heard >= severity(*l));
        for peer in self.downstream.peers(asked) {
            let _ = peer.notify_logging_message(params.clone()).await;
        }
    }

    /// A resource's update, to the sessions and subscriptions that subscribed to it.
    async fn updated(&self, params: ResourceUpdatedNotificationParam) {
        let uri = params.uri.clone();
        let _ = self.downstream.changes.send(Change::Resource(uri.clone()));
        let subscribed = |state: &State, id: u64| state.subscribed.get(&uri).is_some_and(|s| s.contains(&id));
        for peer in self.downstream.peers(subscribed) {
            let _ = peer.notify_resource_updated(params.clone()).await;
        }
    }

    /// The proxied server's tools changed: they are learnt again (then every session and
    /// subscription is told).
    pub fn tools_changed(&self) {
        self.downstream.tools_changed.notify_one();
    }

    /// The proxied server's prompts or resources changed: every session on its session is told,
    /// and every subscription.
    pub async fn changed(&self, change: Change) {
        let _ = self.downstream.changes.send(change.clone());
        for peer in self.downstream.peers(|_, _| true) {
            let _ = match &change {
                Change::Prompts => peer.notify_prompt_list_changed().await,
                Change::Resources => peer.notify_resource_list_changed().await,
                // Only the sessions that subscribed hear of it (`on_resource_updated`).
                Change::Resource(_) => Ok(()),
            };
        }
    }
}
