//! `mcp-ratelimit proxy`: every limit of the guard in front of an MCP server written in any
//! language, reached over streamable HTTP or started as a stdio child.
//!
//! The proxied server's tools are learnt from its `tools/list` (again on its
//! `notifications/tools/list_changed`, and whenever it comes back) and listed downstream with
//! their prices. A call passes, in order:
//!
//! 1. the breaker ([`Breaker`]): while the proxied server is failing or its child is down, the call
//!    is refused `upstream_unavailable` with the time left, before anything is charged;
//! 2. a place in the fair queue ([`FairQueue`], `upstream.queue_max` places): a full queue is
//!    `busy` with a wait, before anything is charged;
//! 3. the guard (the one guarded call, [`Guard::call`](crate::guard::Guard::call)): loops, budgets, tenants, spend
//!    caps, in-flight slots for a `holds_slot` tool — exactly as for our own tools;
//! 4. its turn for one of `proxy.max_in_flight` slots to the proxied server (tenants take turns);
//! 5. the call itself, within `proxy.timeout_ms` of the proxied server's own time (the wait for
//!    a turn is bounded by it too, separately), never retried: its result, `isError` or not, and
//!    its JSON-RPC errors pass through unchanged.
//!
//! **Sessions.** Whose calls share one MCP session to the proxied server (one child process for a
//! command) is `proxy.upstream_sessions` ([`scopes`]): each tenant its own by default, so no tenant
//! reads what another left in a stateful server; opening one is charged, and they are capped and
//! closed when idle. The tools are learnt on the proxy's own session, which no caller over HTTP
//! takes (only `shared` serves callers on it, and `proxy --stdio` its one caller): what a caller
//! does to its own session never changes another's tools. Notifications are routed back ([`relay`]) among a session's callers: progress
//! to the session that made the call, resource updates to the sessions that subscribed, log
//! messages to the sessions that set a level (each at its own), list changes to all. A session's
//! `logging/setLevel` is its own; the shared session's level is the most verbose any asked for.
//! A 2026-07-28 server tells of changes only on a subscription: the proxy holds one on each
//! session to it ([`link`]), and a 2026-07-28 caller's own subscription hears the lists' changes;
//! a caller holds a bounded number of those open, the unverified callers of one address together
//! ([`subscriptions`]).
//!
//! **Tasks.** A task a proxied call creates is its caller's ([`tasks`]): `tasks/get` and
//! `tasks/cancel` for it from anyone else are refused as unknown, never passed on.
//!
//! **Identity.** The caller's key never leaves the proxy: the proxied server gets only
//! `proxy.headers` (over HTTP) and the caller's own `_meta` (minus its progress token, which is
//! the proxy's own upstream). It cannot tell callers apart; the proxy does that. Nor does a stdio
//! child get the proxy's secrets: it starts from an empty environment plus what [`ChildEnv`]
//! allows, and never an `MCP_RL__` variable.

mod came;
pub mod lane;
pub mod link;
mod open_tasks;
pub mod relay;
pub mod scopes;
mod seat;
mod server;
pub mod subscriptions;
pub mod tap;
pub mod tasks;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use rmcp::ErrorData;
use rmcp::model::{
    CallToolRequest, CallToolRequestParams, ClientRequest, ProgressToken, RequestMetaObject, ServerResult, Tool,
};
use rmcp::service::{PeerRequestOptions, ServiceError};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

pub use lane::Lane;
pub use link::{ChildEnv, Link, LinkError, Target};
pub use relay::{Downstream, Relay};
pub use scopes::{Scopes, Upstream};
pub use server::ProxyServer;

use crate::breaker::Breaker;
use crate::clock::{Nanos, SharedClock};
use crate::config::Config;
use crate::guard::{Admitted, Held, Refusal, Used, Worked};
use crate::identity::Caller;
use crate::mcp::limited::{Said, ToolAnswer};
use crate::rate_limits::RateLimits;
use crate::state::Behind;
use crate::upstream::adaptive::AdaptiveLimit;
use crate::upstream::classes::JobClasses;
use crate::upstream::gate;
use crate::upstream::jobs::Owner;
use crate::upstream::queue::{AccountSlot, FairQueue, Occupancy, QueuePlace, QueueRules, TierRule};

/// The proxied server and what protects it, shared by every downstream session.
pub struct Proxied {
    /// The sessions to it: the proxy's own, and one per scope (`proxy.upstream_sessions`).
    scopes: Arc<Scopes>,
    /// Its tools as it last listed them (unpriced).
    tools: ArcSwap<Vec<Tool>>,
    breaker: Arc<Breaker>,
    queue: Arc<FairQueue>,
    timeout: Duration,
    clock: SharedClock,
    limits: RateLimits,
    /// Calls so far, to name each one's place in the queue.
    calls: AtomicU64,
    /// A running mean of how long a call takes (ns): how soon a queue place frees up.
    mean_call: AtomicU64,
    /// Whose each task created through the proxy is.
    tasks: tasks::Owners,
    /// How many times its tools were learnt again since it started: what a 2026-07-28
    /// subscription to `notifications/tools/list_changed` waits on.
    relearnt: tokio::sync::watch::Sender<u64>,
    /// The initialized downstream sessions, for the relay lane.
    seats: seat::Seats,
    /// The 2026-07-28 subscriptions its callers hold open, per caller and per address.
    subscriptions: subscriptions::Subscriptions,
    /// The calls of 2026-07-28 callers waiting for their input ([`lane::rounds`]).
    rounds: Arc<lane::rounds::Rounds>,
}

impl std::fmt::Debug for Proxied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxied").field("scopes", &self.scopes).field("tools", &self.tools.load().len()).finish()
    }
}

impl Behind for Proxied {
    fn breaker(&self) -> &Breaker {
        &self.breaker
    }

    /// Calls in flight to it, and waiting for their turn.
    fn occupancy(&self) -> Occupancy {
        self.queue.occupancy()
    }

    fn slots(&self) -> usize {
        self.queue.slots()
    }

    fn ceiling(&self) -> usize {
        self.queue.rules().max_in_flight
    }

    fn queue(&self) -> &FairQueue {
        &self.queue
    }

    fn subscriptions(&self) -> Option<usize> {
        Some(self.subscriptions.count())
    }
}

// A call the proxied server did not answer with a result, as the guarded call reads it:

/// Its own JSON-RPC error, passed through unchanged.
fn passed_through(error: ErrorData) -> Worked<ToolAnswer> {
    Worked::Answer(ToolAnswer::relayed(Err(error)))
}

/// Not reached, or no answer in time, once the call was sent: refused, and the reservation stands
/// (the work may have been done).
fn unavailable_once_sent(refusal: Refusal) -> Worked<ToolAnswer> {
    Worked::Refused(refusal, Used::Unreported)
}

/// Never sent (no turn in time, the breaker open, the server restarting): it did no work, and its
/// price is given back.
fn never_sent(refusal: Refusal) -> Worked<ToolAnswer> {
    Worked::Refused(refusal, Used::Nothing)
}

impl Proxied {
    /// Connects to `target` (an error if it cannot be reached now), learns its tools, and keeps
    /// both up until `stop`.
    pub async fn start(
        target: Target,
        config: &Config,
        limits: RateLimits,
        clock: SharedClock,
        stop: CancellationToken,
    ) -> Result<Arc<Self>, LinkError> {
        let up = &config.upstream;
        let breaker = Arc::new(gate::breaker(up));
        let max_in_flight = config.proxy.max_in_flight;
        let unverified_children = up.unverified_share_of(config.proxy.max_children);
        let scopes = Scopes::start(
            target,
            &config.proxy,
            unverified_children,
            breaker.clone(),
            clock.clone(),
            stop.child_token(),
        )
        .await?;
        // Its calls are all alike: one class, neither spaced nor counted apart.
        let rules = QueueRules::new(max_in_flight, up.queue_max, JobClasses::one("call"))
            .unverified_share(up.unverified_share_of(max_in_flight), up.unverified_places())
            .with_tiers(TierRule::from_config(up));
        let adaptive = AdaptiveLimit::configured(&config.proxy.adaptive, max_in_flight);
        let queue = gate::start_queue(rules, adaptive, &limits, "proxied", clock.clone(), stop.child_token());
        let proxied = Arc::new(Self {
            scopes,
            tools: ArcSwap::from_pointee(Vec::new()),
            breaker,
            queue,
            timeout: Duration::from_millis(config.proxy.timeout_ms),
            clock: clock.clone(),
            limits: limits.clone(),
            calls: AtomicU64::new(0),
            mean_call: AtomicU64::new(0),
            tasks: tasks::Owners::new(clock.clone()),
            relearnt: tokio::sync::watch::Sender::new(0),
            seats: seat::Seats::default(),
            subscriptions: subscriptions::Subscriptions::new(&config.proxy),
            rounds: Arc::new(lane::rounds::Rounds::new(clock.clone(), Nanos::from_millis(config.proxy.timeout_ms))),
        });
        // Without its tools there is nothing to serve: a server that cannot list them is a
        // start-up error, as one that cannot be reached is.
        proxied.learn_tools().await.map_err(|reason| LinkError::Handshake {
            target: proxied.link().target().to_string(),
            reason: format!("it did not list its tools: {reason}"),
        })?;
        tokio::spawn(proxied.clone().learn_tools_when_changed(stop));
        Ok(proxied)
    }

    /// The proxy's own session to the proxied server, which the tools are learnt on (the one
    /// `shared` serves every caller on, and `proxy --stdio` its one caller).
    pub fn link(&self) -> &Link {
        self.scopes.shared().link()
    }

    /// The sessions to the proxied server.
    pub fn scopes(&self) -> &Arc<Scopes> {
        &self.scopes
    }

    /// Its tools as it last listed them, without prices.
    pub fn tools(&self) -> Arc<Vec<Tool>> {
        self.tools.load_full()
    }

    /// Changes each time its tools are learnt again (its list changed, or it came back).
    fn relearnt(&self) -> tokio::sync::watch::Receiver<u64> {
        self.relearnt.subscribe()
    }

    /// Whether it lists `name`.
    fn lists(&self, name: &str) -> bool {
        self.tools.load().iter().any(|t| t.name == name)
    }

    /// What its `tools/list` annotations say of `tool`: its `readOnlyHint`.
    fn reads_only(&self, tool: &str) -> bool {
        let tools = self.tools();
        let annotated = tools.iter().find(|t| t.name == tool).and_then(|t| t.annotations.as_ref());
        annotated.and_then(|a| a.read_only_hint) == Some(true)
    }

    /// Why a scope's session could not be had, as the refusal its caller gets.
    fn unopened_refusal(&self, what: &str, unopened: scopes::Unopened) -> Refusal {
        match unopened {
            scopes::Unopened::Refused(refusal) => refusal,
            scopes::Unopened::Unreachable(error) => self.unavailable_refusal(what, &error.to_string()),
        }
    }

    /// `upstream_unavailable` for `what`, with the breaker's time left as the wait (a second when
    /// it is closed).
    fn unavailable_refusal(&self, what: &str, detail: &str) -> Refusal {
        let wait = self.breaker.open_for(self.clock.now()).unwrap_or(Nanos::from_secs(1));
        gate::unavailable(what, detail, wait)
    }

    async fn learn_tools_when_changed(self: Arc<Self>, stop: CancellationToken) {
        loop {
            tokio::select! {
                () = self.scopes.tools_changed().notified() => {}
                () = stop.cancelled() => return,
            }
            if let Err(reason) = self.learn_tools().await {
                tracing::warn!(%reason, "the proxied server did not list its tools; keeping the last list");
            }
            for upstream in self.scopes.all() {
                upstream.downstream().tools_list_changed().await;
            }
            self.relearnt.send_modify(|times| *times = times.wrapping_add(1));
        }
    }

    /// Lists the proxied server's tools again on the proxy's own session (within
    /// [`link::ANSWER_WITHIN`], whatever `proxy.timeout_ms` says of calls), keeps those it may
    /// offer ([`offered`]), forgets the metrics and dashboard rows of every tool it no longer
    /// lists, and warns of each `[tools.NAME]` it does not list; on an error the last list stays.
    async fn learn_tools(&self) -> Result<(), String> {
        let peer = self.link().peer().ok_or("it is not connected")?;
        let tools = match tokio::time::timeout(link::ANSWER_WITHIN, list_tools(&peer)).await {
            Ok(Ok(tools)) => offered(tools),
            Ok(Err(error)) => return Err(crate::redact::url(&error.to_string())),
            Err(_) => return Err(format!("no answer within {:?}", link::ANSWER_WITHIN)),
        };
        for name in self.limits.guard().policy().tools.keys() {
            if !tools.iter().any(|t| t.name == name.as_str()) {
                tracing::warn!(tool = %name, "`[tools.{name}]` names no tool of the proxied server (it may list it later)");
            }
        }
        tracing::info!(tools = tools.len(), "learnt the proxied server's tools");
        // Every series and row of a tool it does not list now: those of tools renamed or dropped,
        // and any a call still in flight then recorded after the last list.
        let listed: std::collections::HashSet<String> = tools.iter().map(|t| t.name.to_string()).collect();
        self.limits.metrics().forget_tools(|tool| !listed.contains(tool));
        self.limits.guard().activity().forget_tools(|tool| !listed.contains(tool));
        self.tools.store(Arc::new(tools));
        Ok(())
    }

    /// Refuses a call the proxied server could not take now, before it is charged: the breaker
    /// is open, or the queue has no place.
    pub(crate) fn before_charging(&self, tool: &str, caller: &Caller) -> Result<QueuePlace, Refusal> {
        let why = "it failed or is restarting, and the circuit breaker is open";
        gate::up(tool, self.breaker.open_for(self.clock.now()), why)?;
        // A place frees in about a call's time.
        let frees_in = || Nanos::new(self.mean_call.load(Ordering::Relaxed)).max(Nanos::from_millis(1));
        gate::place(tool, caller, &self.queue, JobClasses::ONLY, frees_in)
    }

    /// `work`'s output if it is done before the clock reads `deadline`; `None` (and `work`
    /// dropped) if not.
    async fn by<T>(&self, deadline: Nanos, work: impl Future<Output = T>) -> Option<T> {
        tokio::select! {
            done = work => Some(done),
            () = self.clock.sleep_until(deadline) => None,
        }
    }

    /// An admitted call's work, as the one guarded call runs it ([`crate::guard::call`]): sent
    /// in its turn ([`Proxied::forward`]), its answer passed on as the caller's protocol era
    /// reads it, without any key of ours the proxied server put in its `_meta`; or why it was not
    /// answered. (Shared with identical calls, it is the asker's: its progress goes to the asker's
    /// session.)
    async fn work(self: Arc<Self>, admitted: Admitted<QueuePlace>, outgoing: Outgoing) -> Worked<ToolAnswer> {
        let (meta, upstream) = (outgoing.meta.clone(), outgoing.upstream.clone());
        let holds_slot = self.limits.guard().policy().holds_slot(&outgoing.tool);
        match self.forward(&admitted.caller, admitted.place, outgoing).await {
            // A task of a `holds_slot` tool holds its place to the proxied server, its caller's
            // slots and its price until it is final, not until its handle came back. (Only those:
            // the in-flight caps bound how many places one caller's tasks can hold.)
            Ok((said, slot)) => match (came::task_of(&said), slot) {
                (Some(task), Some(slot)) if holds_slot => {
                    let mut held = Held::taking(&admitted.admission);
                    held.hold(slot);
                    let open = open_tasks::OpenTask { task, held, meta, upstream };
                    tokio::spawn(self.clone().hold_until_final(open));
                    Worked::Answer(came::relayed(said))
                }
                _ => Worked::Answer(came::relayed(said)),
            },
            Err(unanswered) => unanswered,
        }
    }

    /// Waits for the call's turn (at most `proxy.timeout_ms`), sends it, and waits for the answer
    /// (at most `proxy.timeout_ms` of the proxied server's own time), meanwhile asking its caller
    /// what the proxied server asks while it serves the call ([`relay::Ask`]).
    ///
    /// Cancel-safe: dropped anywhere — its caller cancelled — the call leaves the line at once
    /// ([`Turn`](crate::upstream::queue::Turn)), gives back any slot it held, and the proxied
    /// server is told to stop a call already sent.
    ///
    /// The call is a span of its own ([`proxied_span`]): its wait for a turn and its request to the
    /// proxied server, which hears that span's trace context in `_meta` (and, over HTTP, in a
    /// `traceparent` header: [`link`]) when traces are on.
    async fn forward(
        &self,
        caller: &Caller,
        place: QueuePlace,
        outgoing: Outgoing,
    ) -> Result<Answered, Worked<ToolAnswer>> {
        let span = proxied_span(&outgoing.tool);
        // Boxed: the call's future is large, and a span around it would copy it on the stack.
        let forwarded = Box::pin(self.forward_in(caller, place, outgoing)).instrument(span.clone()).await;
        if !span.is_disabled() {
            let outcome = match &forwarded {
                Ok((said, _)) if came::task_of(said).is_some() => "task",
                Ok(_) => "answered",
                Err(Worked::Answer(_)) => "error",
                Err(Worked::Refused(_, Used::Nothing)) => "not_sent",
                Err(Worked::Refused(..)) => "unavailable",
            };
            span.record("proxy.outcome", outcome);
        }
        forwarded
    }

    /// [`Proxied::forward`], in its span.
    async fn forward_in(
        &self,
        caller: &Caller,
        place: QueuePlace,
        outgoing: Outgoing,
    ) -> Result<Answered, Worked<ToolAnswer>> {
        let Outgoing { tool, meta, upstream, mut sending } = outgoing;
        // Its session stays open while it is in flight (a 2026-07-28 caller's has no other hold).
        let _in_flight = upstream.hold(&self.clock);
        // A call resuming a round that waits for its caller's input has the round's place.
        let (slot, resumed) = match self.resumed(&mut sending).map_err(passed_through)? {
            Some((exchange, slot)) => (slot, Some(exchange)),
            None => (self.turn_of(caller, place, &tool).await?, None),
        };
        let started = self.clock.now();
        // The proxied server's own time: what it took teaches the limit, the queue's wait does not.
        let deadline = started + self.timeout_nanos();
        let now = started;
        let permit = self
            .breaker
            .permit(now)
            .map_err(|open| never_sent(gate::unavailable(&tool, "the circuit breaker is open", open.retry_after)))?;
        let Some(peer) = upstream.link().peer() else {
            self.breaker.record(permit, false, now);
            let wait = self.breaker.open_for(now).unwrap_or(Nanos::from_secs(1));
            return Err(never_sent(gate::unavailable(&tool, "it is restarting", wait)));
        };
        let meta = upstream_meta_of_call(&upstream, meta);
        let (answer, parking) = match sending {
            Sending::Rmcp(via) => {
                let ViaRmcp { request, progress, asker } = *via;
                let asked = ask_upstream(&peer, request, meta, progress, &asker, &upstream);
                (self.by(deadline, asked).await.map(came::Came::of_rmcp), None)
            }
            Sending::Lane(relayed) => self.lane_answer(*relayed, resumed, &upstream, meta, deadline).await,
        };
        let now = self.clock.now();
        let took = now - started;
        let mean = Nanos::new(self.mean_call.load(Ordering::Relaxed));
        let mean = if mean == Nanos::ZERO { took } else { mean - mean / 8 + took / 8 };
        self.mean_call.store(mean.as_u64(), Ordering::Relaxed);
        match &answer {
            // A slow call may be slow for its own arguments: an unverified caller, who can send
            // any, must not shrink the limit every caller shares (see `Signal::TimedOut`).
            None if caller.unverified_from().is_none() => slot.timed_out().await,
            None => {}
            Some(came::Came::Result(_)) => slot.accepted().await,
            Some(came::Came::Error(_) | came::Came::Failed(_)) => {}
        }
        let (said, slot) = self.answered(&tool, permit, now, answer, slot)?;
        // A round asking its caller for input keeps its place to the proxied server meanwhile.
        Ok(match parking {
            Some(parking) => {
                self.rounds.park(parking, slot);
                (said, None)
            }
            None => (said, Some(slot)),
        })
    }

    /// The call's timeout on the server's one clock, like every other wait: a test walks past it.
    fn timeout_nanos(&self) -> Nanos {
        Nanos::from(self.timeout)
    }

    /// The call's turn in the account's fair queue: at once when a slot is free and nobody waits,
    /// else in its flow's turn. No turn within the timeout: the call was never sent.
    async fn turn_of(&self, caller: &Caller, place: QueuePlace, tool: &str) -> Result<AccountSlot, Worked<ToolAnswer>> {
        let queued_at = self.clock.now();
        let owner = Owner::of(caller, &self.limits.guard().policy(), self.queue.rules());
        let place = match place.start_now(&owner.flowing()).await {
            Ok(slot) => return Ok(slot),
            Err(place) => place,
        };
        let id = format!("call-{}", self.calls.fetch_add(1, Ordering::Relaxed));
        let turn = place.enqueue(&owner.flowing(), &id);
        // Dropped here when the time is up, the turn takes the call out of the line.
        match self.by(queued_at + self.timeout_nanos(), turn).await {
            Some(Ok(slot)) => Ok(slot),
            Some(Err(_)) | None => {
                // A place frees in about a call's time.
                let waited = self.clock.now() - queued_at;
                let wait = Nanos::new(self.mean_call.load(Ordering::Relaxed)).max(Nanos::from_millis(1));
                Err(never_sent(Refusal::never_sent(tool, waited, self.queue.slots(), wait)))
            }
        }
    }

    /// What the proxied server's answer (or its silence until the deadline, `None`) makes of the
    /// call, the breaker told whether it is up.
    #[expect(clippy::result_large_err, reason = "the answer is as large either way, and moved once")]
    fn answered(
        &self,
        tool: &str,
        permit: crate::breaker::Permit,
        now: Nanos,
        answer: Option<came::Came>,
        slot: AccountSlot,
    ) -> Result<(Said, AccountSlot), Worked<ToolAnswer>> {
        let down = |detail: &str| {
            let wait = self.breaker.open_for(now).unwrap_or(Nanos::from_secs(1));
            unavailable_once_sent(gate::unavailable(tool, detail, wait))
        };
        match answer {
            None => {
                self.breaker.record(permit, false, now);
                Err(down(&format!("it did not answer within {} ms", self.timeout.as_millis())))
            }
            Some(came::Came::Result(said)) => {
                self.breaker.record(permit, true, now);
                Ok((said, slot))
            }
            Some(came::Came::Error(error)) => {
                // It answered: it is up, and its error is the caller's to read.
                self.breaker.record(permit, true, now);
                Err(passed_through(error))
            }
            Some(came::Came::Failed(detail)) => {
                self.breaker.record(permit, false, now);
                Err(down(&detail))
            }
        }
    }
}

/// What the proxied server hears of a call's `_meta`: what the caller's may carry there
/// ([`Upstream::upstream_meta`]), under this call's trace context — the trace goes on from this
/// call's span, not from the caller's: its context replaces whatever trace context the caller's
/// `_meta` held (a tracestate the span does not carry is one it dropped).
fn upstream_meta_of_call(upstream: &Upstream, mut meta: RequestMetaObject) -> RequestMetaObject {
    if let Some(ours) = crate::telemetry::context_of(&tracing::Span::current()) {
        meta.0.remove(crate::telemetry::TRACEPARENT);
        meta.0.remove(crate::telemetry::TRACESTATE);
        for (key, value) in ours {
            meta.0.insert(key, value.into());
        }
    }
    upstream.upstream_meta(meta)
}

/// Sends the call to the proxied server through rmcp's client (with `meta`: see
/// [`upstream_meta_of_call`]) and waits for its answer, passing on its progress, and asking the caller what the server asks while it serves
/// the call. Dropped before the answer (the caller cancelled, or the timeout): the proxied server
/// is told to stop.
async fn ask_upstream(
    peer: &rmcp::service::Peer<rmcp::RoleClient>,
    request: CallToolRequestParams,
    meta: RequestMetaObject,
    progress: Option<(u64, ProgressToken)>,
    asker: &Asker,
    upstream: &Upstream,
) -> Result<ServerResult, ServiceError> {
    let request = ClientRequest::CallToolRequest(CallToolRequest::new(request));
    let mut options = PeerRequestOptions::no_options();
    options.meta = Some(meta);
    let handle = peer.send_cancellable_request(request, options).await?;
    let _route = progress
        .map(|(session, token)| upstream.downstream().route_progress(handle.progress_token.clone(), session, token));
    // A 2026-07-28 caller here (one the relay lane did not take) is never sent a request: nothing
    // the server asks is routed to its call, and it is refused as nobody's.
    let (_asks_route, mut asks) = match asker.session {
        Some(session) => {
            let (route, asks) =
                upstream.downstream().route_asks(handle.id.clone(), Some(session), asker.capabilities.clone());
            (Some(route), asks)
        }
        None => (None, tokio::sync::mpsc::channel(1).1),
    };
    let id = handle.id.clone();
    // Dropped before the answer (the caller cancelled, or the timeout): the proxied
    // server is told to stop.
    let cancel = CancelOnDrop { peer: Some((*peer).clone()), id };
    let response = handle.await_response();
    tokio::pin!(response);
    // What the server asks while it serves the call is asked of this call's caller, here,
    // in the caller's own request (rmcp then sends it on that request's stream).
    let answer = loop {
        tokio::select! {
            answer = &mut response => break answer,
            Some((ask, reply)) = asks.recv() => {
                let _ = reply.send(ask.of(&asker.peer, asker.capabilities.as_ref()).await);
            }
        }
    };
    cancel.disarm();
    answer
}

/// The span of one call forwarded to the proxied server, from its wait for a turn to its answer
/// (`proxy.outcome`: `answered`, `task`, `error`, `unavailable`, `not_sent`). Disabled, and free,
/// when traces are off.
fn proxied_span(tool: &str) -> tracing::Span {
    crate::telemetry::of_work(|| {
        tracing::info_span!(
            target: crate::telemetry::TARGET,
            "proxy.request",
            "otel.kind" = "client",
            "mcp.method.name" = "tools/call",
            "mcp.tool.name" = crate::guard::trace::cut(tool),
            "proxy.outcome" = tracing::field::Empty,
        )
    })
}

/// What a sent call came back with, and its place to the proxied server: given back with the
/// answer, kept by a task until it is final (`None`: kept by a round waiting for its caller's
/// input, [`lane::rounds`]).
type Answered = (Said, Option<AccountSlot>);

/// A call on its way to the proxied server: its tool, what its caller's `_meta` said, the session
/// to the proxied server it goes on (its caller's scope's), and how it is sent.
pub(crate) struct Outgoing {
    pub(crate) tool: String,
    pub(crate) meta: RequestMetaObject,
    pub(crate) upstream: Arc<Upstream>,
    pub(crate) sending: Sending,
}

/// How a call is sent to the proxied server.
pub(crate) enum Sending {
    /// Through rmcp's client (a stdio child's session, or a call the relay lane did not take):
    /// the request, where its progress goes (a downstream session and the caller's token), and
    /// whom to ask what the server asks while it serves the call.
    Rmcp(Box<ViaRmcp>),
    /// Through the relay lane: the caller's request as it came ([`lane`]).
    Lane(Box<lane::Relayed>),
}

/// A call sent through rmcp's client: the request, where its progress goes (a downstream session
/// and the caller's token), and whom to ask what the server asks while it serves the call.
pub(crate) struct ViaRmcp {
    pub(crate) request: CallToolRequestParams,
    pub(crate) progress: Option<(u64, ProgressToken)>,
    pub(crate) asker: Asker,
}

/// The caller of a call, as the proxied server's requests reach it: its session (or stateless
/// request), its number among the sessions on its session to the proxied server (`None`: a
/// 2026-07-28 request, which has none), and the capabilities its client declared.
pub(crate) struct Asker {
    pub(crate) peer: rmcp::service::Peer<rmcp::RoleServer>,
    pub(crate) session: Option<u64>,
    pub(crate) capabilities: Option<rmcp::model::ClientCapabilities>,
}

/// The most tools a proxied server's list is read to; the rest are not offered (each tool is a
/// handful of metric series and a dashboard row, which must stay bounded).
pub const MAX_TOOLS: usize = 1000;
/// The longest tool name the MCP spec allows (1 to 128 characters).
pub const MAX_TOOL_NAME: usize = 128;

/// Every page of the proxied server's tools, up to [`MAX_TOOLS`] (and as many pages): a server
/// that lists more, or pages for ever, is read that far.
async fn list_tools(peer: &rmcp::service::Peer<rmcp::RoleClient>) -> Result<Vec<Tool>, ServiceError> {
    let mut tools = Vec::new();
    let mut cursor = None;
    for _ in 0..MAX_TOOLS {
        let page = peer.list_tools(Some(rmcp::model::PaginatedRequestParams::default().with_cursor(cursor))).await?;
        tools.extend(page.tools);
        cursor = page.next_cursor;
        if cursor.is_none() || tools.len() > MAX_TOOLS {
            break;
        }
    }
    Ok(tools)
}

/// The tools the proxy offers of those the proxied server lists: each with a name the MCP spec
/// allows the length of (1 to 128 characters) and no control character in it, the first
/// [`MAX_TOOLS`] of them. The others are neither listed downstream nor callable (a warning says
/// how many): a 100 KB name would be a 100 KB metric label on every series of its tool. A name
/// of other characters than the spec's `[A-Za-z0-9_.-]` is offered as it is.
fn offered(tools: Vec<Tool>) -> Vec<Tool> {
    let listed = tools.len();
    let named = |tool: &Tool| {
        let chars = tool.name.chars().count();
        (1..=MAX_TOOL_NAME).contains(&chars) && !tool.name.chars().any(char::is_control)
    };
    let mut tools: Vec<Tool> = tools.into_iter().filter(named).collect();
    if tools.len() < listed {
        tracing::warn!(
            dropped = listed - tools.len(),
            "the proxied server lists tools whose names are empty, longer than {MAX_TOOL_NAME} characters or hold \
             control characters; they are not offered"
        );
    }
    if tools.len() > MAX_TOOLS {
        tracing::warn!(
            listed = tools.len(),
            "the proxied server lists more than {MAX_TOOLS} tools; the rest are not offered"
        );
        tools.truncate(MAX_TOOLS);
    }
    tools
}

/// Tells the proxied server to stop a call whose answer nobody waits for any more.
struct CancelOnDrop {
    peer: Option<rmcp::service::Peer<rmcp::RoleClient>>,
    id: rmcp::model::RequestId,
}

impl CancelOnDrop {
    fn disarm(mut self) {
        self.peer = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        let Some(peer) = self.peer.take() else { return };
        let params = rmcp::model::CancelledNotificationParam::new(
            Some(self.id.clone()),
            Some("the caller stopped waiting".to_owned()),
        );
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = peer.notify_cancelled(params).await;
            });
        }
    }
}

/// What the proxied server gets of a caller's request `_meta`: everything the caller says of its
/// call (a trace context, its own keys; its progress token is replaced by the proxy's), but not
/// what describes the caller's own connection to the proxy under 2026-07-28 (its protocol
/// version, who it is, the log level it opts in to): the proxy's connection to the proxied server
/// is its own, of its own version, and its client says those of itself. (rmcp's HTTP transport
/// would send a caller's `protocolVersion` as that session's `MCP-Protocol-Version`, which a
/// 2025-11-25 server refuses — and keep it for every request after.) Its capabilities stay: a
/// server may answer a caller that speaks tasks with one.
fn for_upstream(mut meta: RequestMetaObject) -> RequestMetaObject {
    for key in CALLERS_CONNECTION {
        meta.0.remove(key);
    }
    meta
}

/// The request `_meta` key of 2026-07-28 that says which log messages the request wants.
pub(crate) const LOG_LEVEL: &str = "io.modelcontextprotocol/logLevel";

/// The request `_meta` keys of 2026-07-28 that describe the caller's connection, not its call.
const CALLERS_CONNECTION: [&str; 3] =
    ["io.modelcontextprotocol/protocolVersion", "io.modelcontextprotocol/clientInfo", LOG_LEVEL];
