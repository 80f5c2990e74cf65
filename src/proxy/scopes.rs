//! Whose calls share one session to the proxied server (`proxy.upstream_sessions`), and with it
//! whatever the server keeps in a session: a browser, a database connection, a cart, a
//! subscription, a log level.
//!
//! - `shared`: every caller shares the proxy's one session (one child, for a command);
//! - `tenant` (the default): the callers of one tenant share one, the unverified callers of one
//!   address one, and a caller without a tenant has its own — so no tenant ever sees state another
//!   left in the server;
//! - `session`: each downstream session has its own, as if it had connected directly (a
//!   2026-07-28 caller, which has no session, has one per caller).
//!
//! The proxy always keeps one session of its own (the first, opened at start-up): it learns the
//! tools every caller is offered from it, so no caller's calls go on it, except where that is the
//! configuration's point: `shared` serves every caller on it, and over stdio (`proxy --stdio`) its
//! one caller, `local`, takes it (one client costs one child) and keeps it. Over HTTP under
//! `tenant` or `session` no scope takes it: the first to come could be a made-up key, and what it
//! left in that session (a tool its server dropped from its own list) would be every tenant's.
//!
//! Every other scope's session is opened by its first request, which is charged to the caller's
//! `limits.method.other` (opening sessions buys nothing); at most `proxy.max_children` are open at
//! once — a new scope beyond them takes the place of the one idle longest (no call in flight, no
//! downstream session), or is refused `busy` with a wait — and one with no call and no downstream
//! session for `proxy.upstream_idle_seconds` is closed, its child stopped. A scope's session that
//! fails is started again with backoff, like the first; its breaker is its own, so one tenant's
//! crashing child does not stop another's calls.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use rmcp::model::{ProtocolVersion, RequestMetaObject};
use tokio::sync::{Notify, OnceCell};
use tokio_util::sync::CancellationToken;

use super::link::{Link, LinkError, Target};
use super::relay::{Downstream, Relay};
use crate::breaker::Breaker;
use crate::clock::{Nanos, SharedClock};
use crate::config::{ProxyConfig, UpstreamSessions};
use crate::guard::{MethodGroup, Refusal};
use crate::identity::{Caller, Proof};
use crate::rate_limits::RateLimits;

/// One session to the proxied server, and the downstream sessions its notifications go to.
pub struct Upstream {
    link: Arc<Link>,
    downstream: Arc<Downstream>,
    stop: CancellationToken,
    /// When it was last let go of, on the server's clock.
    used: AtomicU64,
    /// Calls in flight on it and downstream sessions attached to it: it is not closed while any.
    held: AtomicUsize,
}

impl std::fmt::Debug for Upstream {
    /// Not the scope: a caller's id is a hash of its key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream").field("link", &self.link).field("held", &self.held.load(Ordering::Relaxed)).finish()
    }
}

impl Upstream {
    /// The session to the proxied server.
    pub fn link(&self) -> &Link {
        &self.link
    }

    /// The downstream sessions it tells what the proxied server says on its own.
    pub fn downstream(&self) -> &Arc<Downstream> {
        &self.downstream
    }

    /// Whether the proxied server speaks 2026-07-28 on it: no session, each request
    /// self-contained.
    pub fn stateless(&self) -> bool {
        self.link.info().is_some_and(|info| info.protocol_version >= ProtocolVersion::V_2026_07_28)
    }

    /// What the proxied server gets of a caller's request `_meta` (what describes the caller's
    /// own connection left out); and where it speaks 2026-07-28, which has no
    /// `logging/setLevel`, the level its log messages
    /// are wanted at: the most verbose any downstream session of this scope asked for, as the one
    /// level of a 2025-11-25 session would be (each session then hears what meets its own level).
    pub fn upstream_meta(&self, meta: RequestMetaObject) -> RequestMetaObject {
        let mut meta = super::for_upstream(meta);
        if self.stateless()
            && let Some(level) = self.downstream.wanted_level()
            && let Ok(level) = serde_json::to_value(level)
        {
            meta.0.insert(super::LOG_LEVEL.to_owned(), level);
        }
        meta
    }

    /// Keeps it open until the returned hold is dropped (a call in flight, a downstream session).
    pub fn hold(self: &Arc<Self>, clock: &SharedClock) -> Hold {
        self.held.fetch_add(1, Ordering::AcqRel);
        Hold { upstream: self.clone(), clock: clock.clone() }
    }

    fn idle_since(&self) -> Option<Nanos> {
        (self.held.load(Ordering::Acquire) == 0).then(|| Nanos::new(self.used.load(Ordering::Acquire)))
    }
}

/// The key a task the proxied server made on the session of `scope` is recorded under: task ids
/// are the server's, and two sessions may each have a `task-1`.
pub fn task_key(scope: Option<&str>, id: &str) -> String {
    match scope {
        Some(scope) => format!("{scope}\u{0}{id}"),
        None => id.to_owned(),
    }
}

/// A reason to keep an [`Upstream`] open; let go of when dropped.
#[derive(Debug)]
pub struct Hold {
    upstream: Arc<Upstream>,
    clock: SharedClock,
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.upstream.used.store(self.clock.now().as_u64(), Ordering::Release);
        self.upstream.held.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What a scope's session is started with.
struct Start {
    target: Target,
    config: ProxyConfig,
    clock: SharedClock,
    stop: CancellationToken,
    tools_changed: Arc<Notify>,
}

type SessionCell = Arc<OnceCell<Arc<Upstream>>>;

/// A scope's place among the open sessions: its session (once opened), and whether it was opened
/// for a caller without a configured key (held to their share of the places).
#[derive(Clone, Default)]
struct ScopeSession {
    slot: SessionCell,
    unverified: bool,
}

/// The sessions to the proxied server: the proxy's own, and one per scope.
pub struct Scopes {
    mode: UpstreamSessions,
    shared: Arc<Upstream>,
    scoped: Mutex<HashMap<String, ScopeSession>>,
    max: usize,
    /// Of `max`, the places callers without a configured key may hold together
    /// (`upstream.unverified_share` of them): configured tenants always find room.
    unverified_max: usize,
    idle: Nanos,
    start: Start,
    /// Downstream sessions so far, to name each one's scope under `session`.
    sessions: AtomicU64,
    /// The scope that took the proxy's own session: `proxy --stdio`'s one caller (`local`), so that
    /// Claude Desktop costs one child, not two. It keeps it for the proxy's life. Over HTTP no
    /// scope takes it: the tools every caller is offered are learnt from it, and the first caller
    /// to come may be anyone, a made-up key too.
    adopter: std::sync::OnceLock<String>,
}

impl std::fmt::Debug for Scopes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scopes").field("mode", &self.mode).field("scoped", &self.slots().len()).finish()
    }
}

/// Why a scope's session could not be had.
#[derive(Debug)]
pub enum Unopened {
    /// A refusal of the caller's: its limit on opening sessions, or every place taken.
    Refused(Refusal),
    /// The proxied server could not be reached for it.
    Unreachable(LinkError),
}

impl Scopes {
    /// The proxy's own session to the proxied server at `target` (connected now: its error is the
    /// start-up error), and the rules for the others (of `proxy.max_children`, `unverified_max` for
    /// callers without a configured key); each started on `clock`, until `stop`.
    pub async fn start(
        target: Target,
        config: &ProxyConfig,
        unverified_max: usize,
        breaker: Arc<Breaker>,
        clock: SharedClock,
        stop: CancellationToken,
    ) -> Result<Arc<Self>, LinkError> {
        let tools_changed = Arc::new(Notify::new());
        let start = Start { target, config: config.clone(), clock, stop, tools_changed };
        let shared = start.upstream(breaker).await?;
        let scopes = Arc::new(Self {
            mode: config.upstream_sessions,
            shared,
            scoped: Mutex::new(HashMap::new()),
            max: config.max_children,
            unverified_max: unverified_max.min(config.max_children),
            idle: Nanos::from_secs(config.upstream_idle_seconds),
            start,
            sessions: AtomicU64::new(0),
            adopter: std::sync::OnceLock::new(),
        });
        if scopes.mode != UpstreamSessions::Shared {
            tokio::spawn(scopes.clone().close_idle_forever());
        }
        Ok(scopes)
    }

    /// The proxy's own session.
    pub fn shared(&self) -> &Arc<Upstream> {
        &self.shared
    }

    /// Which callers share one session.
    pub fn mode(&self) -> UpstreamSessions {
        self.mode
    }

    /// Rung when the proxied server's tools changed (on any session), or it came back.
    pub fn tools_changed(&self) -> &Notify {
        &self.start.tools_changed
    }

    /// A number for a new downstream session.
    pub fn next_session(&self) -> u64 {
        self.sessions.fetch_add(1, Ordering::Relaxed)
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<String, ScopeSession>> {
        self.scoped.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every session open now, the proxy's own first.
    pub fn all(&self) -> Vec<Arc<Upstream>> {
        let scoped = self.slots().values().filter_map(|place| place.slot.get().cloned()).collect::<Vec<_>>();
        std::iter::once(self.shared.clone()).chain(scoped).collect()
    }

    /// The scope of `caller`'s requests made in downstream session `session` (`None`: a
    /// 2026-07-28 request, which has none); `None` for the proxy's own session.
    pub fn scope_of(&self, caller: &Caller, session: Option<u64>) -> Option<String> {
        match self.mode {
            UpstreamSessions::Shared => None,
            UpstreamSessions::Tenant => Some(match (caller.tenant(), caller.unverified_from()) {
                (Some(tenant), _) => format!("tenant:{tenant}"),
                (None, Some(address)) => format!("address:{address}"),
                (None, None) => format!("caller:{}", caller.id()),
            }),
            UpstreamSessions::Session => Some(match session {
                Some(session) => format!("session:{session}"),
                None => format!("caller:{}", caller.id()),
            }),
        }
    }

    /// The session of `scope`, opened for `caller` if it is not open yet: opening it is charged
    /// to the caller's `limits.method.other`; with every place taken, the one idle longest is
    /// closed for it, or the caller is refused `busy`. The scope of `proxy --stdio`'s one caller
    /// (`local`) takes the proxy's own session instead, and keeps it.
    pub async fn get(
        &self,
        scope: Option<String>,
        caller: &Caller,
        limits: &RateLimits,
        what: &str,
    ) -> Result<Arc<Upstream>, Unopened> {
        let Some(scope) = scope else { return Ok(self.shared.clone()) };
        if self.adopter.get() == Some(&scope) {
            return Ok(self.shared.clone());
        }
        let slot = {
            let mut slots = self.slots();
            if let Some(place) = slots.get(&scope) {
                place.slot.clone()
            } else if caller.proof() == Proof::Local && self.adopter.set(scope.clone()).is_ok() {
                // The stdio caller takes the proxy's own session: it opens nothing.
                return Ok(self.shared.clone());
            } else {
                let unverified = caller.unverified_from().is_some();
                // Recorded by whoever answers with it: the one guarded call, or a method's handler.
                let refused = |refusal: Refusal| Err(Unopened::Refused(refusal));
                let theirs = slots.values().filter(|place| place.unverified).count();
                if unverified && theirs >= self.unverified_max && !self.close_longest_idle(&mut slots, true) {
                    let max = u64::try_from(self.unverified_max).unwrap_or(u64::MAX);
                    return refused(Refusal::unverified_sessions_full(what, max, self.close_every()));
                }
                if slots.len() >= self.max && !self.close_longest_idle(&mut slots, false) {
                    let max = u64::try_from(self.max).unwrap_or(u64::MAX);
                    return refused(Refusal::sessions_full(what, max, self.close_every()));
                }
                let place = ScopeSession { slot: SessionCell::default(), unverified };
                slots.insert(scope.clone(), place.clone());
                place.slot
            }
        };
        let opened = slot
            .get_or_try_init(|| async {
                limits
                    .guard()
                    .charge_method(caller, MethodGroup::Other, "initialize")
                    .await
                    .map_err(Unopened::Refused)?;
                let breaker = Arc::new(Breaker::new(SCOPE_BREAKER_FAILURES, SCOPE_BREAKER_COOLDOWN));
                self.start.upstream(breaker).await.map_err(Unopened::Unreachable)
            })
            .await
            .cloned();
        if opened.is_err() {
            // Not opened: the next request tries again.
            let mut slots = self.slots();
            if slots.get(&scope).is_some_and(|p| Arc::ptr_eq(&p.slot, &slot) && !p.slot.initialized()) {
                slots.remove(&scope);
            }
        }
        opened
    }

    /// Closes the open session idle longest (of unverified callers' only, if `unverified`), if one
    /// is idle; whether one was.
    fn close_longest_idle(&self, slots: &mut HashMap<String, ScopeSession>, unverified: bool) -> bool {
        let idle = slots
            .iter()
            .filter(|(_, place)| place.unverified || !unverified)
            .filter_map(|(scope, place)| Some((scope.clone(), place.slot.get()?.idle_since()?)))
            .min_by_key(|(_, since)| *since);
        let Some((scope, _)) = idle else { return false };
        if let Some(place) = slots.remove(&scope)
            && let Some(upstream) = place.slot.get()
        {
            upstream.stop.cancel();
        }
        true
    }

    /// How often idle sessions are looked for: a quarter of the idle time, 1 to 30 seconds.
    fn close_every(&self) -> Nanos {
        (self.idle / 4).clamp(Nanos::from_secs(1), Nanos::from_secs(30))
    }

    /// Closes every scope's session idle for `proxy.upstream_idle_seconds`, until stopped.
    async fn close_idle_forever(self: Arc<Self>) {
        let every = self.close_every();
        loop {
            let clock = &self.start.clock;
            tokio::select! {
                () = clock.sleep_until(clock.now() + every) => {}
                () = self.start.stop.cancelled() => return,
            }
            let now = clock.now();
            let mut slots = self.slots();
            slots.retain(|_, place| {
                let Some(upstream) = place.slot.get() else { return true };
                let stale = upstream.idle_since().is_some_and(|since| now - since >= self.idle);
                if stale {
                    upstream.stop.cancel();
                }
                !stale
            });
        }
    }
}

impl Start {
    /// A session to the proxied server, connected now, kept up (its breaker `breaker`) until
    /// closed or the proxy stops.
    async fn upstream(&self, breaker: Arc<Breaker>) -> Result<Arc<Upstream>, LinkError> {
        let downstream = Arc::new(Downstream::new(self.tools_changed.clone()));
        let relay = Relay::new(downstream.clone());
        let stop = self.stop.child_token();
        let changed = self.tools_changed.clone();
        let link = Link::start(
            self.target.clone(),
            &self.config,
            relay,
            breaker,
            self.clock.clone(),
            stop.clone(),
            move || changed.notify_one(),
        )
        .await?;
        Ok(Arc::new(Upstream {
            link,
            downstream,
            stop,
            used: AtomicU64::new(self.clock.now().as_u64()),
            held: AtomicUsize::new(0),
        }))
    }
}

/// A scope's own breaker (its session's reconnections): one tenant's crashing child does not
/// open the breaker every caller's calls are checked against.
const SCOPE_BREAKER_FAILURES: u32 = 5;
const SCOPE_BREAKER_COOLDOWN: Nanos = Nanos::from_secs(5);
