//! A downstream session as the proxy keeps it ([`Seat`]): its number, its peer once initialized,
//! the session to the proxied server it is on (held open while it lives) and its place among the
//! sessions that hear what the proxied server says on its own. Its handler ([`super::ProxyServer`])
//! and the relay lane ([`super::lane`]), which answers some of its requests without rmcp, share
//! it: the lane finds it by the session's `Mcp-Session-Id` ([`Seats`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use rmcp::RoleServer;
use rmcp::model::ClientCapabilities;
use rmcp::service::Peer;

use super::Proxied;
use super::relay::Membership;
use super::scopes::{Hold, Unopened, Upstream};
use crate::identity::Caller;
use crate::rate_limits::RateLimits;

/// One downstream session.
pub(crate) struct Seat {
    /// Its number among the downstream sessions (its scope under `proxy.upstream_sessions =
    /// "session"`).
    number: u64,
    /// The downstream session, once initialized (a 2026-07-28 request has none).
    peer: OnceLock<Peer<RoleServer>>,
    /// The session to the proxied server it is on, held open while it lives.
    attached: OnceLock<(Arc<Upstream>, Hold)>,
    /// The session's place among those the proxied server's notifications go to.
    membership: OnceLock<Membership>,
}

impl std::fmt::Debug for Seat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seat").field("number", &self.number).field("membership", &self.membership).finish()
    }
}

impl Seat {
    /// A new downstream session, numbered `number`.
    pub(crate) fn new(number: u64) -> Self {
        Self { number, peer: OnceLock::new(), attached: OnceLock::new(), membership: OnceLock::new() }
    }

    /// Its session is initialized: `peer` is how it is told and asked things.
    pub(crate) fn initialized(&self, peer: Peer<RoleServer>) {
        let _ = self.peer.set(peer);
    }

    /// Its peer, once initialized.
    pub(crate) fn peer(&self) -> Option<&Peer<RoleServer>> {
        self.peer.get()
    }

    /// What its client declared, once initialized.
    pub(crate) fn capabilities(&self) -> Option<ClientCapabilities> {
        self.peer.get().and_then(|peer| peer.peer_info()).map(|info| info.capabilities.clone())
    }

    /// Its number among the sessions on its session to the proxied server, once it joined them.
    pub(crate) fn member(&self) -> Option<u64> {
        self.membership.get().map(Membership::id)
    }

    /// The scope of `caller`'s requests in this session (`None`: the proxy's own session).
    pub(crate) fn scope(&self, proxied: &Proxied, caller: &Caller) -> Option<String> {
        proxied.scopes().scope_of(caller, self.peer.get().map(|_| self.number))
    }

    /// The session to the proxied server its request goes on: its caller's scope's, opened if need
    /// be (`what` names what opened it). A downstream session stays on the one it first got, which
    /// holds it open and tells it what the proxied server says on its own.
    pub(crate) async fn upstream(
        &self,
        proxied: &Proxied,
        limits: &RateLimits,
        caller: &Caller,
        what: &str,
    ) -> Result<Arc<Upstream>, Unopened> {
        if let Some((upstream, _)) = self.attached.get() {
            return Ok(upstream.clone());
        }
        let upstream = proxied.scopes().get(self.scope(proxied, caller), caller, limits, what).await?;
        self.attach(proxied, &upstream);
        Ok(upstream)
    }

    /// Puts an initialized downstream session on `upstream` for as long as it lives.
    pub(crate) fn attach(&self, proxied: &Proxied, upstream: &Arc<Upstream>) {
        let Some(peer) = self.peer.get() else { return };
        if self.attached.set((upstream.clone(), upstream.hold(&proxied.clock))).is_ok() {
            let _ = self.membership.set(upstream.downstream().join(peer.clone()));
        }
    }
}

/// The initialized downstream sessions, by their `Mcp-Session-Id`: what the relay lane serves a
/// session's request as. A session leaves when its handler is dropped (its entry is then dead,
/// and pruned when the next one joins): at most as many as the sessions `server.max_sessions`
/// lets live, and the dead of one moment.
#[derive(Default)]
pub(crate) struct Seats(Mutex<HashMap<Arc<str>, Weak<Seat>>>);

impl std::fmt::Debug for Seats {
    /// How many, never the ids (a session id is a bearer secret of its client's).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seats").field("sessions", &self.seats().len()).finish()
    }
}

impl Seats {
    fn seats(&self) -> std::sync::MutexGuard<'_, HashMap<Arc<str>, Weak<Seat>>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Session `id` is `seat`'s, for as long as `seat` lives.
    pub(crate) fn register(&self, id: &str, seat: &Arc<Seat>) {
        let mut seats = self.seats();
        seats.retain(|_, seat| seat.strong_count() > 0);
        seats.insert(Arc::from(id), Arc::downgrade(seat));
    }

    /// The seat of session `id`, if it is initialized and alive.
    pub(crate) fn get(&self, id: &str) -> Option<Arc<Seat>> {
        self.seats().get(id).and_then(Weak::upgrade)
    }
}
