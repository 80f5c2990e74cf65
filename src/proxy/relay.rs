//! What the proxied server says on its own, carried to the downstream sessions it concerns: a
//! call's progress to the session that made the call, a resource's update to the sessions that
//! subscribed to it, its log messages and the lists' changes to every session. The proxy's MCP
//! client ([`Relay`]) hears them; the downstream sessions join when they are initialized and
//! leave when their handler is dropped.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

#[allow(deprecated)] // Logging is legacy in 2026-07-28, and still what servers send.
use rmcp::model::{
    ClientCapabilities, ClientConfig, Implementation, LoggingMessageNotificationParam, ProgressNotificationParam,
    ProgressToken, ResourceUpdatedNotificationParam,
};
use rmcp::service::{NotificationContext, Peer};
use rmcp::{ClientHandler, RoleClient, RoleServer};
use tokio::sync::Notify;

/// The downstream sessions, and which of them each notification is for.
#[derive(Default)]
pub struct Downstream {
    next: AtomicU64,
    state: Mutex<State>,
    /// Rung when the proxied server's tools changed (or it came back): the list is fetched again.
    pub(super) tools_changed: Notify,
}

#[derive(Default)]
struct State {
    sessions: HashMap<u64, Peer<RoleServer>>,
    /// The upstream progress token of a call in flight → the session and the token it gave.
    progress: HashMap<ProgressToken, (u64, ProgressToken)>,
    /// Resource URI → the sessions subscribed to it.
    subscribed: HashMap<String, HashSet<u64>>,
}

impl std::fmt::Debug for Downstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Downstream").field("sessions", &self.state().sessions.len()).finish()
    }
}

impl Downstream {
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

    /// The sessions to tell, pruned of those whose transport has closed.
    fn peers(&self, only: impl Fn(&State, u64) -> bool) -> Vec<Peer<RoleServer>> {
        let mut state = self.state();
        state.sessions.retain(|_, peer| !peer.is_transport_closed());
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
        state.progress.retain(|_, (session, _)| *session != id);
        state.subscribed.retain(|_, subscribers| {
            subscribers.remove(&id);
            !subscribers.is_empty()
        });
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

/// The proxy's MCP client: it declares no client capabilities (no sampling, elicitation or roots:
/// a request of the proxied server cannot be routed to one agent of many), and relays what the
/// proxied server sends on its own to [`Downstream`].
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

#[allow(deprecated)] // Logging and resource subscriptions are legacy in 2026-07-28, and still in use.
impl ClientHandler for Relay {
    fn get_info(&self) -> ClientConfig {
        ClientConfig::new(
            ClientCapabilities::default(),
            Implementation::new("mcp-ratelimit-proxy", env!("CARGO_PKG_VERSION")),
        )
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
        for peer in self.downstream.peers(|_, _| true) {
            let _ = peer.notify_logging_message(params.clone()).await;
        }
    }

    async fn on_resource_updated(
        &self,
        params: ResourceUpdatedNotificationParam,
        _context: NotificationContext<RoleClient>,
    ) {
        let uri = params.uri.clone();
        let subscribed = |state: &State, id: u64| state.subscribed.get(&uri).is_some_and(|s| s.contains(&id));
        for peer in self.downstream.peers(subscribed) {
            let _ = peer.notify_resource_updated(params.clone()).await;
        }
    }

    async fn on_resource_list_changed(&self, _context: NotificationContext<RoleClient>) {
        for peer in self.downstream.peers(|_, _| true) {
            let _ = peer.notify_resource_list_changed().await;
        }
    }

    async fn on_prompt_list_changed(&self, _context: NotificationContext<RoleClient>) {
        for peer in self.downstream.peers(|_, _| true) {
            let _ = peer.notify_prompt_list_changed().await;
        }
    }

    async fn on_tool_list_changed(&self, _context: NotificationContext<RoleClient>) {
        self.downstream.tools_changed.notify_one();
    }
}
