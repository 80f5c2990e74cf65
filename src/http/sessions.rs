//! How many MCP sessions the server keeps, and for how long.
//!
//! A session costs memory (rmcp's session worker, our `McpServer`, their channels) whether or
//! not it is used, and opening one is cheap: a client can open thousands and walk away. So a
//! session with no message for `server.session_idle_timeout_seconds` is closed (rmcp's own
//! idle timer, which then drops it from its map), and at most `server.max_sessions` are open at
//! once: an `initialize` beyond that gets `503` with `Retry-After` instead of another session.
//! Memory is then bounded by `max_sessions` × the size of an idle session (about 110 KiB, nearly
//! all rmcp's channels), whoever opens them.
//!
//! Unverified callers (no configured key, or a made-up one) of one address may hold at most
//! `server.max_sessions_per_address` of them together (an `initialize` beyond gets `429`), so a
//! host that invents a key per session cannot take every session from everyone else.
//!
//! Both caps are decided atomically: an `initialize` holds a place among the sessions being
//! opened from its check until rmcp has answered it (and so put the session in its map), so
//! concurrent `initialize`s cannot pass a cap together.
//!
//! Budgets are not per session, so closing one takes nothing from its caller.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use http::{HeaderValue, Method, StatusCode, header};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use tokio::sync::Mutex;

use crate::config::ServerConfig;
use crate::http::front_door::{FrontDoorLog, FrontDoorRefusal, jsonrpc_error};
use crate::http::{Step, StepLayer};
use crate::identity::Caller;

/// Seconds a client is told to wait when every session is taken.
const RETRY_AFTER_SECS: u32 = 5;

/// rmcp's in-memory session manager with this server's idle timeout.
pub fn manager(server: &ServerConfig) -> Arc<LocalSessionManager> {
    let mut manager = LocalSessionManager::default();
    manager.session_config.keep_alive = Some(server.session_idle_timeout);
    Arc::new(manager)
}

/// The sessions this cap let open (pruned against rmcp's map of live ones when a cap is
/// reached, and now and then), those being opened, and which address's unverified callers hold
/// which.
#[derive(Debug, Default)]
struct Book {
    /// `initialize`s between their check and rmcp's answer, all callers.
    opening: usize,
    /// Ids of the sessions opened (some perhaps closed by rmcp since, until pruned). A session
    /// moves here from `opening` in one step, so it is never counted twice nor missed.
    open: HashSet<Arc<str>>,
    /// Per address of unverified callers: its sessions being opened, and its open ones' ids.
    addresses: HashMap<Arc<str>, Holder>,
    /// `initialize`s since the last full prune.
    since_prune: usize,
}

#[derive(Debug, Default)]
struct Holder {
    opening: usize,
    open: Vec<Arc<str>>,
}

impl Book {
    /// Forgets the sessions rmcp has closed, and the addresses left with none.
    fn prune(&mut self, live: &HashMap<Arc<str>, impl Sized>) {
        self.open.retain(|id| live.contains_key(id));
        let open = &self.open;
        self.addresses.retain(|_, holder| {
            holder.open.retain(|id| open.contains(id));
            holder.opening > 0 || !holder.open.is_empty()
        });
        self.since_prune = 0;
    }
}

/// The session caps: the manager whose sessions are counted, the most it may hold, and the most
/// the unverified callers of one address may hold.
#[derive(Debug, Clone)]
pub struct SessionCap {
    sessions: Arc<LocalSessionManager>,
    max: usize,
    max_per_address: usize,
    book: Arc<Mutex<Book>>,
    log: Arc<FrontDoorLog>,
}

impl SessionCap {
    /// At most `max` sessions in `sessions`, and `max_per_address` for the unverified callers of
    /// one address; refusals go to `log`.
    pub fn new(sessions: Arc<LocalSessionManager>, max: usize, max_per_address: usize, log: Arc<FrontDoorLog>) -> Self {
        Self { sessions, max, max_per_address, book: Arc::default(), log }
    }
}

/// Which cap an `initialize` would pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Full {
    Server,
    Address,
}

/// A place among the sessions being opened, given back when rmcp has answered (or the request
/// went away); the session it opened is then in rmcp's map, or was never made.
struct Opening {
    book: Arc<Mutex<Book>>,
    address: Option<Arc<str>>,
    /// Given back by [`Opening::opened`], so `Drop` has nothing left to do.
    settled: bool,
}

impl Opening {
    /// Counts the session rmcp opened for this place, if it did, as open (under its address).
    async fn opened(mut self, session_id: Option<&str>) {
        self.settled = true;
        let id: Option<Arc<str>> = session_id.map(Arc::from);
        let mut book = self.book.lock().await;
        book.opening = book.opening.saturating_sub(1);
        if let Some(id) = &id {
            book.open.insert(id.clone());
        }
        if let Some(holder) = self.address.as_ref().and_then(|address| book.addresses.get_mut(address)) {
            holder.opening = holder.opening.saturating_sub(1);
            holder.open.extend(id);
        }
    }
}

impl Drop for Opening {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        // The request was dropped before rmcp answered: give the place back without waiting.
        let (book, address) = (self.book.clone(), self.address.take());
        let release = async move {
            let mut book = book.lock().await;
            book.opening = book.opening.saturating_sub(1);
            if let Some(holder) = address.and_then(|a| book.addresses.get_mut(&a)) {
                holder.opening = holder.opening.saturating_sub(1);
            }
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(release);
        }
    }
}

impl SessionCap {
    /// Takes a place among the sessions being opened, or says which cap is full.
    async fn open(&self, address: Option<&str>) -> Result<Opening, Full> {
        let live = self.sessions.sessions.read().await;
        let mut book = self.book.lock().await;
        book.since_prune += 1;
        // The count only overstates (closed sessions not yet pruned): prune when it says full,
        // and now and then so the book stays as small as the sessions.
        let count = |book: &Book| book.open.len().saturating_add(book.opening);
        if count(&book) >= self.max || book.since_prune > self.max {
            book.prune(&live);
        }
        if count(&book) >= self.max {
            return Err(Full::Server);
        }
        let address: Option<Arc<str>> = address.map(Arc::from);
        if let Some(address) = &address {
            let Book { open, addresses, .. } = &mut *book;
            let holder = addresses.entry(address.clone()).or_default();
            if holder.open.len().saturating_add(holder.opening) >= self.max_per_address {
                holder.open.retain(|id| live.contains_key(id) && open.contains(id));
            }
            if holder.open.len().saturating_add(holder.opening) >= self.max_per_address {
                return Err(Full::Address);
            }
            holder.opening += 1;
        }
        book.opening += 1;
        Ok(Opening { book: self.book.clone(), address, settled: false })
    }
}

/// Refuses an `initialize` while `max` sessions are open (`503`), or while the unverified
/// callers of its address hold `max_per_address` (`429`). Only a POST without a session id can
/// open one, so every other request passes straight through; an opening POST's body is looked at
/// only when a cap is full (a request that is not an `initialize` then passes, holding no place).
pub fn cap(cap: Arc<SessionCap>) -> StepLayer<Arc<SessionCap>> {
    StepLayer::new(cap)
}

impl Step for Arc<SessionCap> {
    fn takes(&self, request: &Request) -> bool {
        request.method() == Method::POST && !request.headers().contains_key("mcp-session-id")
    }

    fn run<S>(self, request: Request, inner: S) -> impl Future<Output = Result<Response, S::Error>> + Send
    where
        S: tower::Service<Request, Response = Response> + Send + 'static,
        S::Future: Send,
        S::Error: Send,
    {
        open_within_caps(self, request, inner)
    }
}

/// A POST that may open a session: passed on holding a place, or, when a cap is full and it is
/// an `initialize`, refused.
async fn open_within_caps<S>(cap: Arc<SessionCap>, request: Request, mut inner: S) -> Result<Response, S::Error>
where
    S: tower::Service<Request, Response = Response>,
{
    let address = request.extensions().get::<Caller>().and_then(Caller::unverified_from).map(str::to_owned);
    let full = match cap.open(address.as_deref()).await {
        Ok(opening) => {
            // An error drops `opening`, which gives its place back.
            let response = inner.call(request).await?;
            let session_id = response.headers().get("mcp-session-id").and_then(|v| v.to_str().ok());
            opening.opened(session_id.filter(|_| response.status().is_success())).await;
            return Ok(response);
        }
        Err(full) => full,
    };
    let (parts, body) = request.into_parts();
    // The body has been read already (see `serve`), within the size limit; this only copies it.
    let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap_or_default();
    let method = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|message| message.get("method").and_then(|m| m.as_str()).map(str::to_owned));
    if method.as_deref() != Some("initialize") {
        return inner.call(Request::from_parts(parts, Body::from(bytes))).await;
    }
    Ok(refuse(&cap, full))
}

/// The answer to an `initialize` past the `full` cap, logged as its kind allows.
fn refuse(cap: &SessionCap, full: Full) -> Response {
    let (status, message) = match full {
        Full::Server => {
            if let Some(left_out) = cap.log.admit(FrontDoorRefusal::SessionsTaken) {
                tracing::warn!(max = cap.max, left_out, "refused: every MCP session is taken (server.max_sessions)");
            }
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "Too many open sessions on this server. Retry after the delay in Retry-After.",
            )
        }
        Full::Address => {
            if let Some(left_out) = cap.log.admit(FrontDoorRefusal::AddressSessionsTaken) {
                tracing::info!(
                    max = cap.max_per_address,
                    left_out,
                    "refused: the unverified callers of one address hold every session they may \
                     (server.max_sessions_per_address)"
                );
            }
            (
                StatusCode::TOO_MANY_REQUESTS,
                "Too many open sessions from this address for callers without a configured API key. Close one \
                 (DELETE /mcp), send a configured key, or retry after the delay in Retry-After.",
            )
        }
    };
    let mut response = jsonrpc_error(
        status,
        -32000,
        message,
        Some(serde_json::json!({ "retry_after_ms": u64::from(RETRY_AFTER_SECS) * 1000 })),
    );
    response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECS));
    response
}
