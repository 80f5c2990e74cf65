//! How many MCP sessions the server keeps, for whom, and for how long.
//!
//! A session costs memory (rmcp's session worker, our `McpServer`, their channels) whether or
//! not it is used, and opening one is cheap: a client can open thousands and walk away. So:
//!
//! - at most `server.max_sessions` are open at once: an `initialize` beyond gets `503` with
//!   `Retry-After` instead of another session. Memory is then bounded by `max_sessions` × the
//!   size of an idle session (about 110 KiB, nearly all rmcp's channels), whoever opens them;
//! - no one holds them all. Unverified callers (no configured key, or a made-up one) of one
//!   address (IPv6 by `server.ipv6_prefix`) hold at most `server.max_sessions_per_address`
//!   together (`429`), and those of every address together at most
//!   `server.unverified_session_share` of `max_sessions` (`503`), so configured keys always
//!   find one; one configured key holds at most `server.key_session_share` of them, and the keys
//!   of one tenant together `server.tenant_session_share` (`429`);
//! - a session with no *message* for `server.session_idle_timeout_seconds` is closed, through
//!   rmcp's session manager, on the server's clock ([`SessionCap::reap_idle`]). A message is a
//!   `POST` in the session that rmcp accepted (a request, a notification, an answer to the
//!   server), from its arrival to the end of its answer: a long tool call is never idle. The
//!   `GET` stream and a `DELETE` are not messages (rmcp's own idle timer counts them, so a
//!   client sending only `GET /mcp` every few seconds kept its session for ever); rmcp's timer
//!   stays for `serve`, as a backstop that can only fire later (not in front of the proxy's relay
//!   lane, whose calls rmcp never sees: [`manager`]).
//!
//! Every cap is decided atomically: an `initialize` holds a place in each group it belongs to
//! from its check until rmcp has answered it (and so put the session in its map), so concurrent
//! `initialize`s cannot pass a cap together. Only an `initialize` opens a session (rmcp makes
//! one for nothing else), so any other `POST` passes without a place: a 2026-07-28 client, which
//! has no session, is never held to these caps.
//!
//! Budgets are not per session, so closing one takes nothing from its caller.

use std::borrow::Cow;
use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use http::{HeaderValue, Method, StatusCode, header};
use rmcp::transport::streamable_http_server::SessionManager as _;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use tokio_util::sync::CancellationToken;

use crate::clock::{Nanos, SharedClock};
use crate::config::ServerConfig;
use crate::http::front_door::{FrontDoorLog, FrontDoorRefusal, jsonrpc_error};
use crate::http::{Step, StepLayer};
use crate::identity::Caller;

/// Seconds a client is told to wait when a cap is full.
const RETRY_AFTER_SECS: u32 = 5;

/// rmcp's in-memory session manager, its own idle timer at this server's idle timeout where
/// `backstop` (a backstop: [`SessionCap::reap_idle`] closes idle sessions first). In front of the
/// proxy's relay lane it has none: rmcp never sees the calls the lane answers, and would close a
/// session busy with them as idle; [`SessionCap`] sees every one.
pub fn manager(server: &ServerConfig, backstop: bool) -> Arc<LocalSessionManager> {
    let mut manager = LocalSessionManager::default();
    manager.session_config.keep_alive = backstop.then_some(server.session_idle_timeout);
    Arc::new(manager)
}

/// A set of sessions held to a cap of its own.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Group {
    /// Every unverified caller's, all addresses together.
    Unverified,
    /// The unverified callers' of one address.
    Address(Arc<str>),
    /// One configured key's (its caller id).
    Key(Arc<str>),
    /// One tenant's keys'.
    Tenant(Arc<str>),
}

impl Group {
    /// The groups `caller`'s sessions count in.
    fn of(caller: Option<&Caller>) -> Vec<Group> {
        let Some(caller) = caller else { return Vec::new() };
        match caller.unverified_from() {
            Some(address) => vec![Group::Unverified, Group::Address(Arc::from(address))],
            None => {
                let mut groups = vec![Group::Key(Arc::from(caller.id()))];
                groups.extend(caller.tenant_shared().cloned().map(Group::Tenant));
                groups
            }
        }
    }
}

/// The caps, from `[server]`.
#[derive(Debug, Clone, Copy)]
struct Caps {
    max: usize,
    unverified: usize,
    per_address: usize,
    per_key: usize,
    per_tenant: usize,
    idle: Nanos,
}

impl Caps {
    /// The most sessions `group` may hold.
    fn of(&self, group: &Group) -> usize {
        match group {
            Group::Unverified => self.unverified,
            Group::Address(_) => self.per_address,
            Group::Key(_) => self.per_key,
            Group::Tenant(_) => self.per_tenant,
        }
    }
}

/// The sessions this cap let open (pruned against rmcp's map of live ones when a cap is
/// reached, and now and then), those being opened, and how many each group holds.
#[derive(Debug, Default)]
struct Book {
    /// `initialize`s between their check and rmcp's answer, all callers.
    opening: usize,
    /// The sessions opened (some perhaps closed by rmcp since, until pruned). A session moves
    /// here from `opening` in one step, so it is never counted twice nor missed.
    open: HashMap<Arc<str>, Record>,
    /// Per group: its sessions being opened, and open.
    groups: HashMap<Group, SessionCount>,
    /// `initialize`s since the last full prune.
    since_prune: usize,
}

/// An open session: its groups, and whether and since when it is idle.
#[derive(Debug)]
struct Record {
    groups: Vec<Group>,
    /// When its last message ended (or it opened), on the server's clock.
    last_message: Nanos,
    /// Messages under way: from a `POST`'s arrival to the end of its answer.
    under_way: usize,
}

#[derive(Debug, Default)]
struct SessionCount {
    opening: usize,
    open: usize,
}

impl SessionCount {
    fn count(&self) -> usize {
        self.opening.saturating_add(self.open)
    }
}

impl Book {
    /// Sessions open or being opened, all callers.
    fn count(&self) -> usize {
        self.open.len().saturating_add(self.opening)
    }

    /// Forgets the session `id`, and takes it from its groups.
    fn forget(&mut self, id: &str) {
        if let Some(record) = self.open.remove(id) {
            for group in &record.groups {
                if let Some(held) = self.groups.get_mut(group) {
                    held.open = held.open.saturating_sub(1);
                    if held.count() == 0 {
                        self.groups.remove(group);
                    }
                }
            }
        }
    }

    /// Forgets the sessions rmcp has closed.
    fn prune(&mut self, live: &HashMap<Arc<str>, impl Sized>) {
        let gone: Vec<Arc<str>> = self.open.keys().filter(|id| !live.contains_key(*id)).cloned().collect();
        for id in gone {
            self.forget(&id);
        }
        self.since_prune = 0;
    }

    /// The first of `groups` at its cap, if any.
    fn full(&self, groups: &[Group], caps: &Caps) -> Option<Full> {
        groups.iter().find_map(|group| {
            let held = self.groups.get(group).map_or(0, SessionCount::count);
            (held >= caps.of(group)).then(|| Full::Group(group.clone()))
        })
    }
}

/// The session caps: the manager whose sessions are counted, the caps, the book, and the clock
/// idle sessions are measured on.
#[derive(Debug)]
pub struct SessionCap {
    sessions: Arc<LocalSessionManager>,
    caps: Caps,
    book: Arc<Mutex<Book>>,
    log: Arc<FrontDoorLog>,
    clock: SharedClock,
    /// Stops the idle reaper (started with the first session).
    stop: CancellationToken,
    reaping: std::sync::Once,
}

impl SessionCap {
    /// The caps `server` configures on the sessions of `sessions`; refusals go to `log`, idle
    /// time is measured on `clock`, and the idle reaper stops with `stop`.
    pub fn new(
        sessions: Arc<LocalSessionManager>,
        server: &ServerConfig,
        log: Arc<FrontDoorLog>,
        clock: SharedClock,
        stop: CancellationToken,
    ) -> Self {
        let caps = Caps {
            max: server.max_sessions,
            unverified: server.unverified_sessions(),
            per_address: server.max_sessions_per_address,
            per_key: server.sessions_per_key(),
            per_tenant: server.sessions_per_tenant(),
            idle: Nanos::from(server.session_idle_timeout),
        };
        Self { sessions, caps, book: Arc::default(), log, clock, stop, reaping: std::sync::Once::new() }
    }

    fn book(&self) -> MutexGuard<'_, Book> {
        lock(&self.book)
    }
}

fn lock(book: &Mutex<Book>) -> MutexGuard<'_, Book> {
    book.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Which cap an `initialize` would pass.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Full {
    Server,
    Group(Group),
}

/// A place among the sessions being opened, given back when rmcp has answered (or the request
/// went away); the session it opened is then in rmcp's map, or was never made.
struct Opening {
    book: Arc<Mutex<Book>>,
    groups: Vec<Group>,
    /// Given back by [`Opening::opened`], so `Drop` has nothing left to do.
    settled: bool,
}

impl Opening {
    /// Counts the session rmcp opened for this place, if it did, as open (in its groups), its
    /// idle time starting `now`.
    fn opened(mut self, session_id: Option<&str>, now: Nanos) {
        self.settled = true;
        let mut book = lock(&self.book);
        book.opening = book.opening.saturating_sub(1);
        for group in &self.groups {
            if let Some(held) = book.groups.get_mut(group) {
                held.opening = held.opening.saturating_sub(1);
            }
        }
        match session_id {
            Some(id) => record(&mut book, id, std::mem::take(&mut self.groups), now),
            None => book.groups.retain(|_, held| held.count() > 0),
        }
    }
}

/// Counts session `id` as open in `groups` (once: an id already counted is left as it is).
fn record(book: &mut Book, id: &str, groups: Vec<Group>, now: Nanos) {
    if book.open.contains_key(id) {
        return;
    }
    for group in &groups {
        book.groups.entry(group.clone()).or_default().open += 1;
    }
    book.open.insert(Arc::from(id), Record { groups, last_message: now, under_way: 0 });
}

impl Drop for Opening {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        // The request was dropped before rmcp answered: give the place back.
        let mut book = lock(&self.book);
        book.opening = book.opening.saturating_sub(1);
        for group in &self.groups {
            if let Some(held) = book.groups.get_mut(group) {
                held.opening = held.opening.saturating_sub(1);
                if held.count() == 0 {
                    book.groups.remove(group);
                }
            }
        }
    }
}

impl SessionCap {
    /// Takes a place among the sessions being opened, in each of `groups`, or says which cap is
    /// full.
    async fn open(self: &Arc<Self>, groups: Vec<Group>) -> Result<Opening, Full> {
        self.reaping.call_once(|| {
            tokio::spawn(self.clone().reap_idle());
        });
        let live = self.sessions.sessions.read().await;
        let mut book = self.book();
        book.since_prune += 1;
        // The counts only overstate (closed sessions not yet pruned): prune when one says full,
        // and now and then so the book stays as small as the sessions.
        let full = |book: &Book| {
            if book.count() >= self.caps.max { Some(Full::Server) } else { book.full(&groups, &self.caps) }
        };
        if full(&book).is_some() || book.since_prune > self.caps.max {
            book.prune(&live);
        }
        if let Some(full) = full(&book) {
            return Err(full);
        }
        for group in &groups {
            book.groups.entry(group.clone()).or_default().opening += 1;
        }
        book.opening += 1;
        Ok(Opening { book: self.book.clone(), groups, settled: false })
    }

    /// A message under way in session `id` (if this cap counts it) until the guard is dropped;
    /// `accepted` on the guard stamps its end as the session's last message.
    fn message(&self, id: &str) -> Option<Message> {
        let mut book = self.book();
        let record = book.open.get_mut(id)?;
        record.under_way += 1;
        Some(Message { book: self.book.clone(), clock: self.clock.clone(), id: Arc::from(id), accepted: false })
    }

    /// Closes the sessions with no message for `server.session_idle_timeout_seconds`, on the
    /// server's clock, until the server stops. It sleeps until the first session could be idle
    /// that long: a message or a new session only ever moves that later.
    pub async fn reap_idle(self: Arc<Self>) {
        loop {
            let wake = {
                let book = self.book();
                let oldest = book.open.values().filter(|r| r.under_way == 0).map(|r| r.last_message).min();
                oldest.unwrap_or_else(|| self.clock.now()) + self.caps.idle
            };
            tokio::select! {
                () = self.stop.cancelled() => return,
                () = self.clock.sleep_until(wake) => {}
            }
            let now = self.clock.now();
            let idle: Vec<Arc<str>> = {
                let mut book = self.book();
                let idle: Vec<Arc<str>> = book
                    .open
                    .iter()
                    .filter(|(_, r)| r.under_way == 0 && r.last_message + self.caps.idle <= now)
                    .map(|(id, _)| id.clone())
                    .collect();
                for id in &idle {
                    book.forget(id);
                }
                idle
            };
            for id in idle {
                if let Err(error) = self.sessions.close_session(&id).await {
                    tracing::debug!(%error, "closing an idle session");
                }
            }
            // Sessions rmcp closed itself (a DELETE, its own timer) leave the book too.
            let live = self.sessions.sessions.read().await;
            self.book().prune(&live);
        }
    }
}

/// A message under way in a session: its end (the guard dropped) is the session's last
/// message if rmcp accepted it.
struct Message {
    book: Arc<Mutex<Book>>,
    clock: SharedClock,
    id: Arc<str>,
    accepted: bool,
}

impl Drop for Message {
    fn drop(&mut self) {
        let now = self.clock.now();
        let mut book = lock(&self.book);
        if let Some(record) = book.open.get_mut(&self.id) {
            record.under_way = record.under_way.saturating_sub(1);
            if self.accepted {
                record.last_message = record.last_message.max(now);
            }
        }
    }
}

/// Holds `initialize`s to the caps (`503` / `429` past one), and counts the messages of each
/// open session for its idle time. Only a `POST` can do either, so every other request passes
/// straight through.
pub fn cap(cap: Arc<SessionCap>) -> StepLayer<Capped> {
    StepLayer::new(Capped(cap))
}

/// The caps as a [`Step`] of the request path ([`cap`]).
#[derive(Debug, Clone)]
pub struct Capped(Arc<SessionCap>);

impl Step for Capped {
    fn takes(&self, request: &Request) -> bool {
        request.method() == Method::POST
    }

    fn run<S>(self, request: Request, inner: S) -> impl Future<Output = Result<Response, S::Error>> + Send
    where
        S: tower::Service<Request, Response = Response> + Send + 'static,
        S::Future: Send,
        S::Error: Send,
    {
        within_caps(self.0, request, inner)
    }
}

/// The `method` of a JSON-RPC message, read without building the message.
#[derive(serde::Deserialize)]
struct Probe<'a> {
    #[serde(borrow, default)]
    method: Option<Cow<'a, str>>,
}

/// A `POST`: in a session, a message counted for the session's idle time; without one, an
/// `initialize` within the caps (holding a place until rmcp has answered) or refused, and
/// anything else passed on.
async fn within_caps<S>(cap: Arc<SessionCap>, request: Request, mut inner: S) -> Result<Response, S::Error>
where
    S: tower::Service<Request, Response = Response>,
{
    if let Some(id) = request.headers().get("mcp-session-id").and_then(|v| v.to_str().ok()) {
        let Some(mut message) = cap.message(id) else { return inner.call(request).await };
        let response = inner.call(request).await?;
        if !response.status().is_success() {
            return Ok(response);
        }
        message.accepted = true;
        return Ok(response.map(|body| Body::new(crate::http::Holding::new(body, message))));
    }
    let groups = Group::of(request.extensions().get::<Caller>());
    let (parts, body) = request.into_parts();
    // The body has been read already (see `serve`), within the size limit; this only copies it.
    let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap_or_default();
    // Only a message that plainly is not an `initialize` passes without a place; one that cannot
    // be read holds one (rmcp, not this probe, decides what it is).
    let initialize =
        serde_json::from_slice::<Probe<'_>>(&bytes).map_or(true, |m| m.method.as_deref() == Some("initialize"));
    let request = Request::from_parts(parts, Body::from(bytes));
    if !initialize {
        let response = inner.call(request).await?;
        if let Some(id) = opened_session(&response) {
            // rmcp made a session of something else after all: counted, so the caps stay true.
            record(&mut cap.book(), id, groups, cap.clock.now());
        }
        return Ok(response);
    }
    match cap.open(groups).await {
        Ok(opening) => {
            // An error drops `opening`, which gives its place back.
            let response = inner.call(request).await?;
            opening.opened(opened_session(&response), cap.clock.now());
            Ok(response)
        }
        Err(full) => Ok(refuse(&cap, &full)),
    }
}

/// The session an answer opened, if it did.
fn opened_session(response: &Response) -> Option<&str> {
    response.headers().get("mcp-session-id").and_then(|v| v.to_str().ok()).filter(|_| response.status().is_success())
}

/// The answer to an `initialize` past the `full` cap, logged as its kind allows.
fn refuse(cap: &SessionCap, full: &Full) -> Response {
    let caps = &cap.caps;
    let (status, kind, message) = match full {
        Full::Server => (
            StatusCode::SERVICE_UNAVAILABLE,
            FrontDoorRefusal::SessionsTaken,
            "Too many open sessions on this server. Retry after the delay in Retry-After.",
        ),
        Full::Group(Group::Unverified) => (
            StatusCode::SERVICE_UNAVAILABLE,
            FrontDoorRefusal::UnverifiedSessionsTaken,
            "Every session callers without a configured API key may hold is taken. Send a configured key, or \
             retry after the delay in Retry-After.",
        ),
        Full::Group(Group::Address(_)) => (
            StatusCode::TOO_MANY_REQUESTS,
            FrontDoorRefusal::AddressSessionsTaken,
            "Too many open sessions from this address for callers without a configured API key. Close one \
             (DELETE /mcp), send a configured key, or retry after the delay in Retry-After.",
        ),
        Full::Group(Group::Key(_)) => (
            StatusCode::TOO_MANY_REQUESTS,
            FrontDoorRefusal::KeySessionsTaken,
            "Too many open sessions for this API key. Close one (DELETE /mcp), or retry after the delay in \
             Retry-After.",
        ),
        Full::Group(Group::Tenant(_)) => (
            StatusCode::TOO_MANY_REQUESTS,
            FrontDoorRefusal::TenantSessionsTaken,
            "Too many open sessions for this API key's tenant. Close one (DELETE /mcp), or retry after the delay \
             in Retry-After.",
        ),
    };
    if let Some(left_out) = cap.log.admit(kind) {
        let (key, max) = match full {
            Full::Server => ("server.max_sessions", caps.max),
            Full::Group(Group::Unverified) => ("server.unverified_session_share", caps.unverified),
            Full::Group(Group::Address(_)) => ("server.max_sessions_per_address", caps.per_address),
            Full::Group(Group::Key(_)) => ("server.key_session_share", caps.per_key),
            Full::Group(Group::Tenant(_)) => ("server.tenant_session_share", caps.per_tenant),
        };
        if *full == Full::Server {
            tracing::warn!(max, left_out, key, "refused: every MCP session is taken");
        } else {
            tracing::info!(max, left_out, key, "refused: a group of callers holds every MCP session it may");
        }
    }
    let mut response = jsonrpc_error(
        status,
        -32000,
        message,
        Some(serde_json::json!({ "retry_after_ms": u64::from(RETRY_AFTER_SECS) * 1000 })),
    );
    response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECS));
    response
}
