//! The pipeline every request passes before work is done for it.
//!
//! Three entry points, one per layer: [`Guard::admit_http`] (the coarse limit on `POST /mcp`,
//! called by the HTTP tower layer), [`Guard::admit_method`] (`tools/list` and other methods) and
//! [`Guard::admit`] (`tools/call`, called by `McpServer::call_tool` for every tool, so no tool
//! can skip it). A tool call is first checked for a loop ([`loops`]: the same call repeated),
//! then against every scope that applies — method, caller, tenant, the tool's own budget, and
//! for a job the in-flight caps — **atomically**: all pass and are charged, or none is.

pub mod loops;
pub mod policy;
pub mod refusal;
pub mod refusals;
pub mod scope;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tracing::info;

use crate::activity::{Activity, Refused};
use crate::clock::{SharedClock, ceil_ms};
use crate::config::{Config, Fail};
use crate::guard::loops::{LoopDetector, Looping};
use crate::guard::refusals::RefusalMemory;
use crate::identity::Caller;
use crate::limit::{Decision, Limiter};
use crate::metrics::{Layer, Metrics};
use crate::store::redis::LoopAnswer;
use crate::store::{Check, Lease, RedisStore, SlotGuard, Store, StoreError, new_lease};
use crate::upstream::breaker::Breaker;
pub use policy::{MethodGroup, Policy, TierLimits};
pub use refusal::{Refusal, RefusalCode};
pub use scope::Scope;

/// One budget as a caller sees it in `rate_limit_status`.
#[derive(Debug, Clone, serde::Serialize, schemars::JsonSchema)]
pub struct BudgetStatus {
    /// The scope key, e.g. `caller:tok:1f2e…` or `tenant:acme`.
    pub scope: String,
    /// The algorithm deciding it.
    pub algorithm: &'static str,
    /// Its limit (burst, window limit or slots).
    pub limit: u64,
    /// Units left now.
    pub remaining: u64,
    /// Milliseconds until it is full again if nothing is spent.
    pub reset_after_ms: u64,
}

/// What an admitted tool call holds while it runs: its in-flight slots (given back when it is
/// dropped) and its place in the in-flight gauge.
#[derive(Debug)]
#[must_use = "dropping the admission releases its in-flight slots at once"]
pub struct Admission {
    _slots: Vec<SlotGuard>,
    metrics: Arc<Metrics>,
}

impl Admission {
    /// The only way to make one: the in-flight gauge goes up here and down in `Drop`.
    fn new(slots: Vec<SlotGuard>, metrics: Arc<Metrics>) -> Self {
        metrics.in_flight(1.0);
        Self { _slots: slots, metrics }
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.metrics.in_flight(-1.0);
    }
}

/// The coarse HTTP decision, with what the RateLimit headers need.
#[derive(Debug, Clone)]
pub struct HttpDecision {
    /// The decision of the caller's `http` scope.
    pub decision: Decision,
    /// The limiter that took it (for the policy header).
    pub limiter: Limiter,
}

/// A tool call as the guard sees it.
#[derive(Debug, Clone, Copy)]
pub struct ToolCall<'a> {
    /// The tool's name.
    pub tool: &'a str,
    /// Its arguments, canonical (defaults filled in), for loop detection.
    pub args: &'a serde_json::Value,
    /// Whether the call starts a job that holds in-flight slots until it is final.
    pub starts_job: bool,
    /// Whether the call can never be a loop (a poll of a pending job, which the job book
    /// answers with its wait).
    pub loop_exempt: bool,
}

/// What a caller refused because the store could not decide is told to wait.
const STORE_RETRY_MS: u64 = 1_000;

/// How long a failing shared store is skipped before one decision probes it again.
const STORE_PROBE_EVERY: crate::clock::Nanos = crate::clock::NANOS_PER_SEC;

/// The limiter that decides while a shared store cannot: the same limits divided by
/// `store.expected_instances`, in this instance's memory, so N instances deciding alone hand out
/// about one budget between them instead of N.
#[derive(Debug)]
struct Insurance {
    store: Arc<Store>,
    policy: Policy,
    /// Open while the shared store is failing: decisions skip it (no timeout to wait out on
    /// every call) until one probe a second finds it back.
    shared_down: Breaker,
    /// The shared store's refusals still in force, answered here without a round trip.
    refused: RefusalMemory,
}

/// Decides whether a caller may proceed, charges it, and explains refusals.
#[derive(Debug)]
pub struct Guard {
    enabled: bool,
    store: Arc<Store>,
    clock: SharedClock,
    policy: Policy,
    insurance: Option<Insurance>,
    store_up: AtomicBool,
    loops: Option<Loops>,
    metrics: Arc<Metrics>,
    activity: Activity,
}

/// The seed of call signatures kept in a shared store: every instance must compute the same
/// signature for the same call. (A known seed lets a caller craft two calls that collide; that
/// only ever stops its own calls, since histories are per caller.)
const SHARED_SIGNATURE_SEED: u64 = 0x6d63_702d_726c_6f6f;

/// Loop detection: in this instance's memory, and over a shared store in Redis, so that every
/// instance sees one history per caller (the local detector decides while Redis cannot).
#[derive(Debug)]
struct Loops {
    local: LoopDetector,
    shared: Option<Arc<RedisStore>>,
    repeats: u32,
    window: crate::clock::Nanos,
}

/// A recorded call, to take back if a later step refuses it.
#[derive(Debug, Clone, Copy)]
enum LoopMark {
    Local(loops::Recorded),
    Shared(u64),
}

impl Loops {
    async fn check(&self, caller: &Caller, call: &ToolCall<'_>, now: crate::clock::Nanos) -> Result<LoopMark, Looping> {
        if let Some(redis) = &self.shared {
            let signature = loops::signature(SHARED_SIGNATURE_SEED, call.tool, call.args);
            let key = Scope::loops(caller);
            match redis.loop_check(key.key(), signature, self.window, self.repeats, None).await {
                Ok(LoopAnswer::Recorded(seq)) => return Ok(LoopMark::Shared(seq)),
                Ok(LoopAnswer::Looping { retry_after, oscillating }) => {
                    return Err(Looping { retry_after, repeats: self.repeats, oscillating });
                }
                Err(error) => tracing::warn!(%error, "loop history unavailable in the shared store; checking locally"),
            }
        }
        self.local.check(caller.id(), call.tool, call.args, now).map(LoopMark::Local)
    }

    async fn forget(&self, caller: &Caller, mark: LoopMark) {
        match (mark, &self.shared) {
            (LoopMark::Local(recorded), _) => self.local.forget(caller.id(), recorded),
            (LoopMark::Shared(seq), Some(redis)) => {
                if let Err(error) = redis.loop_forget(Scope::loops(caller).key(), seq, self.window).await {
                    tracing::warn!(%error, "could not take a call back from the shared loop history");
                }
            }
            (LoopMark::Shared(_), None) => {}
        }
    }
}

/// The in-flight caps a job holds: the caller's, and its tenant's.
fn in_flight_scopes<'p>(policy: &'p Policy, caller: &Caller) -> Vec<(Scope, &'p Limiter)> {
    let mut scopes = vec![(Scope::in_flight_caller(caller), &policy.in_flight_caller)];
    if let Some(tenant) = Scope::in_flight_tenant(caller) {
        scopes.push((tenant, &policy.in_flight_tenant));
    }
    scopes
}

/// The scopes a call of `tool` by `caller` draws on under `policy`, with their limiters and
/// costs.
fn tool_scopes<'p>(
    policy: &'p Policy,
    caller: &Caller,
    tool: &str,
    starts_job: bool,
) -> Vec<(Scope, &'p Limiter, u64)> {
    let tier = policy.for_caller(caller);
    let cost = policy.cost_of(tool);
    let mut scopes = vec![(Scope::method(caller, MethodGroup::ToolsCall), &tier.tools_call, 1)];
    if cost > 0 {
        scopes.push((Scope::caller(caller), &tier.caller, cost));
        if let Some(tenant) = Scope::tenant(caller) {
            scopes.push((tenant, &policy.tenant, cost));
        }
        if let Some(address) = Scope::address(caller) {
            scopes.push((address, &policy.address, cost));
        }
    }
    if let Some(budget) = policy.tools.get(tool).and_then(|t| t.budget.as_ref()) {
        scopes.push((Scope::tool(caller, tool), budget, 1));
    }
    if starts_job {
        scopes.extend(in_flight_scopes(policy, caller).into_iter().map(|(scope, limiter)| (scope, limiter, 1)));
    }
    scopes
}

/// Every budget `caller` has under `policy`, to read at cost 0: the HTTP budget (when it
/// applies), the `tools/call` method budget, the caller's, tenant's and address's tool budgets,
/// every tool's own budget, and the in-flight caps.
fn status_scopes<'p>(policy: &'p Policy, caller: &Caller, over_http: bool) -> Vec<(Scope, &'p Limiter, u64)> {
    let tier = policy.for_caller(caller);
    let mut peek: Vec<(Scope, &Limiter, u64)> = Vec::new();
    if over_http {
        peek.push((Scope::http(caller), &tier.http, 0));
    }
    peek.push((Scope::method(caller, MethodGroup::ToolsCall), &tier.tools_call, 0));
    peek.push((Scope::caller(caller), &tier.caller, 0));
    if let Some(tenant) = Scope::tenant(caller) {
        peek.push((tenant, &policy.tenant, 0));
    }
    if let Some(address) = Scope::address(caller) {
        peek.push((address, &policy.address, 0));
    }
    for (tool, tool_policy) in &policy.tools {
        if let Some(budget) = &tool_policy.budget {
            peek.push((Scope::tool(caller, tool), budget, 0));
        }
    }
    peek.extend(in_flight_scopes(policy, caller).into_iter().map(|(scope, limiter)| (scope, limiter, 0)));
    peek
}

fn checks_of<'a>(scopes: &'a [(Scope, &'a Limiter, u64)]) -> Vec<Check<'a>> {
    scopes.iter().map(|(scope, limiter, cost)| Check { key: scope.key(), limiter, cost: *cost }).collect()
}

impl Guard {
    /// A guard over `store` with the limits of `config`; over a shared store, with an insurance
    /// limiter for when it cannot decide.
    pub fn new(store: Arc<Store>, clock: SharedClock, config: &Config, metrics: Arc<Metrics>) -> Self {
        let detection = &config.loop_detection;
        let window = detection.window_ms.saturating_mul(crate::clock::NANOS_PER_MS);
        let loops = detection.enabled.then(|| Loops {
            local: LoopDetector::new(detection.repeats, window),
            shared: store.redis_store().cloned(),
            repeats: detection.repeats,
            window,
        });
        let insurance = store.is_shared().then(|| Insurance {
            store: Arc::new(Store::memory(clock.clone())),
            policy: Policy::new(config).scaled(1.0 / config.store.expected_instances as f64),
            shared_down: Breaker::new(1, STORE_PROBE_EVERY),
            refused: RefusalMemory::default(),
        });
        Self {
            enabled: config.limits.enabled,
            store,
            clock,
            policy: Policy::new(config),
            insurance,
            store_up: AtomicBool::new(true),
            loops,
            metrics,
            activity: Activity::new(),
        }
    }

    /// Whether limits are enforced at all (`limits.enabled`).
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// The resolved limits.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Where limiter state lives.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// What the limits did lately, for the dashboard: refusals, and the levels of busy scopes.
    pub fn activity(&self) -> &Activity {
        &self.activity
    }

    /// Whether the last decision on the limiter store succeeded (the `store_up` gauge).
    pub fn store_up(&self) -> bool {
        self.store_up.load(Ordering::Relaxed)
    }

    /// Logs and counts a store that could not decide.
    fn store_failed(&self, layer: Layer, what: &str, error: &StoreError) {
        self.metrics.store_error(layer);
        tracing::warn!(layer = layer.as_str(), what, %error, "limiter store failed");
    }

    /// Decides `checks` on the shared store, unless it is known to be down; `None` when it could
    /// not decide (counted and logged), so the caller falls back as its policy says.
    async fn decide_shared(
        &self,
        checks: &[Check<'_>],
        lease: Lease,
        layer: Layer,
        what: &str,
    ) -> Option<Vec<Decision>> {
        let permit = match &self.insurance {
            Some(insurance) => Some(insurance.shared_down.permit(self.clock.now()).ok()?),
            None => None,
        };
        let decided = self.store.decide(checks, lease).await;
        if let (Some(insurance), Some(permit)) = (&self.insurance, permit) {
            insurance.shared_down.record(permit, decided.is_ok(), self.clock.now());
            self.store_up.store(decided.is_ok(), Ordering::Relaxed);
        }
        decided.map_err(|error| self.store_failed(layer, what, &error)).ok()
    }

    /// Decides `scopes` (built by `scopes_under` from a policy) on the shared store or, when it
    /// cannot decide and the call may `fail` open, on the insurance limiter. Returns the
    /// decisions with the scopes they were taken on and the store that holds any slots.
    async fn decide<'s, F>(
        &'s self,
        scopes_under: F,
        lease: Lease,
        fail: Fail,
        layer: Layer,
        what: &str,
    ) -> Option<(Vec<(Scope, &'s Limiter, u64)>, Vec<Decision>, &'s Arc<Store>)>
    where
        F: Fn(&'s Policy) -> Vec<(Scope, &'s Limiter, u64)>,
    {
        let scopes = scopes_under(&self.policy);
        let checks = checks_of(&scopes);
        if let Some(insurance) = &self.insurance
            && let Some(decisions) = insurance.refused.recall(&checks, self.clock.now())
        {
            return Some((scopes, decisions, &self.store));
        }
        let now = self.clock.now();
        if let Some(decisions) = self.decide_shared(&checks, lease, layer, what).await {
            if let Some(insurance) = &self.insurance {
                insurance.refused.remember(&checks, &decisions, now);
            }
            return Some((scopes, decisions, &self.store));
        }
        let insurance = self.insurance.as_ref().filter(|_| fail == Fail::Open)?;
        let scopes = scopes_under(&insurance.policy);
        let decisions = insurance.store.decide(&checks_of(&scopes), lease).await.ok()?;
        Some((scopes, decisions, &insurance.store))
    }

    /// Charges one `POST /mcp` to the caller's coarse HTTP budget. `None` only if nobody could
    /// decide: the coarse layer protects the server, so it then lets the request on to the finer
    /// limits behind it rather than refusing everyone.
    pub async fn admit_http(&self, caller: &Caller) -> Option<HttpDecision> {
        let scope = Scope::http(caller);
        let under = |p| vec![(scope.clone(), &Policy::for_caller(p, caller).http, 1)];
        let (scopes, mut decisions, _) = self.decide(under, new_lease(), Fail::Open, Layer::Http, "POST /mcp").await?;
        let (decision, limiter) = (decisions.pop()?, scopes.first()?.1);
        self.metrics.decision(Layer::Http, "POST /mcp", decision.allowed);
        if !decision.allowed {
            self.metrics.rejection(Layer::Http, "POST /mcp", "rate_limited", caller);
            info!(layer = "http", scope = scope.name(), retry_after_ms = ceil_ms(decision.retry_after), "refused");
            let refused = Refused {
                layer: Layer::Http,
                tool: "POST /mcp",
                code: "rate_limited",
                scope: Some(scope.name()),
                limit: Some(decision.limit),
                remaining: Some(decision.remaining),
                retry_after_ms: Some(ceil_ms(decision.retry_after)),
                message: "Too many requests: answered 429 before any JSON was read.",
            };
            self.activity.refused(caller, refused, self.clock.now());
        }
        Some(HttpDecision { decision, limiter: limiter.clone() })
    }

    /// Charges one `method` request to its group's limit (`tools/call` is charged by
    /// [`Guard::admit`], together with the tool's budgets).
    pub async fn admit_method(&self, caller: &Caller, group: MethodGroup, method: &str) -> Result<(), Refusal> {
        if !self.enabled {
            return Ok(());
        }
        let scope = Scope::method(caller, group);
        let under = |p| vec![(scope.clone(), Policy::for_caller(p, caller).method(group), 1)];
        let decided = self.decide(under, new_lease(), Fail::Open, Layer::Method, group.as_str()).await;
        let Some(d) = decided.and_then(|(_, mut decisions, _)| decisions.pop()) else {
            return Err(Refusal::limiter_unavailable(method, STORE_RETRY_MS));
        };
        self.metrics.decision(Layer::Method, group.as_str(), d.allowed);
        if d.allowed {
            return Ok(());
        }
        self.metrics.rejection(Layer::Method, group.as_str(), "rate_limited", caller);
        let name = scope.name();
        info!(
            layer = "method",
            method = group.as_str(),
            scope = name,
            retry_after_ms = ceil_ms(d.retry_after),
            "refused"
        );
        let refusal = Refusal::rate_limited(method, name.to_owned(), d.limit, d.remaining, d.retry_after);
        self.activity.refused(caller, refusal.seen(Layer::Method, method), self.clock.now());
        Err(refusal)
    }

    /// Refuses a call that repeats the caller's recent calls in a loop; otherwise records it.
    async fn check_loop(&self, caller: &Caller, call: &ToolCall<'_>) -> Result<Option<LoopMark>, Refusal> {
        let Some(loops) = self.loops.as_ref().filter(|_| !call.loop_exempt) else { return Ok(None) };
        match loops.check(caller, call, self.clock.now()).await {
            Ok(recorded) => Ok(Some(recorded)),
            Err(looping) => {
                let refusal = Refusal::loop_detected(call.tool, &looping);
                self.metrics.decision(Layer::Tool, call.tool, false);
                self.metrics.loop_detected(call.tool);
                self.metrics.rejection(Layer::Tool, call.tool, refusal.code.as_str(), caller);
                info!(
                    layer = "tool",
                    tool = call.tool,
                    caller_bucket = caller.bucket(),
                    code = refusal.code.as_str(),
                    retry_after_ms = ceil_ms(looping.retry_after),
                    oscillating = looping.oscillating,
                    "refused"
                );
                Err(refusal)
            }
        }
    }

    /// Charges `caller` for `call` in every scope at once, or explains exactly how long to wait
    /// for the scope that refused. A loop is refused before anything is charged, and a call
    /// refused for budget does not count towards a loop.
    pub async fn admit(&self, caller: &Caller, call: &ToolCall<'_>) -> Result<Admission, Refusal> {
        if !self.enabled {
            return Ok(Admission::new(Vec::new(), self.metrics.clone()));
        }
        let recorded = self.check_loop(caller, call).await?;
        let admitted = self.charge(caller, call.tool, call.starts_job).await;
        if let (Err(_), Some(recorded), Some(loops)) = (&admitted, recorded, &self.loops) {
            loops.forget(caller, recorded).await;
        }
        admitted
    }

    async fn charge(&self, caller: &Caller, tool: &str, starts_job: bool) -> Result<Admission, Refusal> {
        let fail = self.policy.tools.get(tool).map_or(Fail::Closed, |t| t.fail);
        let under = |p| tool_scopes(p, caller, tool, starts_job);
        let lease = new_lease();
        let Some((scopes, decisions, store)) = self.decide(under, lease, fail, Layer::Tool, tool).await else {
            return Err(Refusal::limiter_unavailable(tool, STORE_RETRY_MS));
        };
        // The call passes only when every scope admits it, so the wait is the longest one.
        let refused = scopes.iter().zip(&decisions).filter(|(_, d)| !d.allowed).max_by_key(|(_, d)| d.retry_after);
        self.metrics.decision(Layer::Tool, tool, refused.is_none());
        if let Some(((scope, limiter, _), d)) = refused {
            let name = scope.name().to_owned();
            let refusal = if limiter.holds_slots() {
                Refusal::busy(tool, name, d.limit)
            } else {
                Refusal::rate_limited(tool, name, d.limit, d.remaining, d.retry_after)
            };
            self.metrics.rejection(Layer::Tool, tool, refusal.code.as_str(), caller);
            info!(
                layer = "tool",
                tool,
                scope = scope.name(),
                caller_bucket = caller.bucket(),
                code = refusal.code.as_str(),
                retry_after_ms = ceil_ms(d.retry_after),
                "refused"
            );
            return Err(refusal);
        }
        let levels = scopes.iter().zip(&decisions).map(|((scope, _, _), d)| (scope.name(), d));
        self.activity.admitted(caller, levels, self.clock.now());
        let slots = scopes
            .iter()
            .filter(|(_, limiter, _)| limiter.holds_slots())
            .map(|(scope, limiter, cost)| {
                SlotGuard::new(store.clone(), scope.key().to_owned(), (*limiter).clone(), *cost, lease)
            })
            .collect();
        Ok(Admission::new(slots, self.metrics.clone()))
    }

    /// The caller's budgets right now, without spending anything: the HTTP budget (when it
    /// applies), the `tools/call` method budget, the caller's and tenant's tool budgets, and
    /// every tool's own budget.
    pub async fn status(&self, caller: &Caller, over_http: bool) -> Option<Vec<BudgetStatus>> {
        let under = |policy| status_scopes(policy, caller, over_http);
        // Cost 0 reads every level in one decision, without charging anything.
        let (scopes, decisions, _) =
            self.decide(under, new_lease(), Fail::Open, Layer::Tool, "rate_limit_status").await?;
        Some(
            scopes
                .iter()
                .zip(decisions)
                .map(|((scope, limiter, _), d)| BudgetStatus {
                    scope: scope.name().to_owned(),
                    algorithm: limiter.algorithm(),
                    limit: d.limit,
                    remaining: d.remaining,
                    reset_after_ms: ceil_ms(d.reset_after),
                })
                .collect(),
        )
    }

    /// Forgets idle limiter state and loop histories; called on a schedule.
    pub fn sweep(&self) -> usize {
        let now = self.clock.now();
        let refusals = self.insurance.as_ref().map_or(0, |i| i.refused.sweep(now));
        self.store.sweep() + refusals + self.loops.as_ref().map_or(0, |loops| loops.local.sweep(now))
    }
}
