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
pub mod scope;

use std::sync::Arc;

use tracing::info;

use crate::clock::{SharedClock, ceil_ms};
use crate::config::Config;
use crate::guard::loops::LoopDetector;
use crate::identity::Caller;
use crate::limit::{Decision, Limiter};
use crate::metrics::{Layer, Metrics};
use crate::store::{Check, SlotGuard, Store, StoreError};
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

/// Decides whether a caller may proceed, charges it, and explains refusals.
#[derive(Debug)]
pub struct Guard {
    enabled: bool,
    store: Arc<Store>,
    clock: SharedClock,
    policy: Policy,
    loops: Option<LoopDetector>,
    metrics: Arc<Metrics>,
}

/// The in-flight caps a job holds: the caller's, and its tenant's.
fn in_flight_scopes<'p>(policy: &'p Policy, caller: &Caller) -> Vec<(Scope, &'p Limiter)> {
    let mut scopes = vec![(Scope::in_flight_caller(caller), &policy.in_flight_caller)];
    if let Some(tenant) = Scope::in_flight_tenant(caller) {
        scopes.push((tenant, &policy.in_flight_tenant));
    }
    scopes
}

impl Guard {
    /// A guard over `store` with the limits of `config`.
    pub fn new(store: Store, clock: SharedClock, config: &Config, metrics: Arc<Metrics>) -> Self {
        let loops = &config.loop_detection;
        let loops = loops
            .enabled
            .then(|| LoopDetector::new(loops.repeats, loops.window_ms.saturating_mul(crate::clock::NANOS_PER_MS)));
        Self {
            enabled: config.limits.enabled,
            store: Arc::new(store),
            clock,
            policy: Policy::new(config),
            loops,
            metrics,
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

    /// Logs and counts a store that could not decide.
    fn store_failed(&self, layer: Layer, what: &str, error: &StoreError) {
        self.metrics.store_error(layer);
        tracing::warn!(layer = layer.as_str(), what, %error, "limiter store failed");
    }

    /// Charges one `POST /mcp` to the caller's coarse HTTP budget. `None` when the store could
    /// not decide: the coarse layer protects the server, so it lets the request on to the
    /// finer limits behind it rather than refusing everyone.
    pub async fn admit_http(&self, caller: &Caller) -> Option<HttpDecision> {
        let limiter = &self.policy.for_caller(caller).http;
        let scope = Scope::http(caller);
        let decision = match self.store.decide_one(&Check { key: scope.key(), limiter, cost: 1 }).await {
            Ok(decision) => decision,
            Err(error) => {
                self.store_failed(Layer::Http, "POST /mcp", &error);
                return None;
            }
        };
        self.metrics.decision(Layer::Http, "POST /mcp", decision.allowed);
        if !decision.allowed {
            self.metrics.rejection(Layer::Http, "POST /mcp", "rate_limited", caller);
            info!(layer = "http", scope = scope.name(), retry_after_ms = ceil_ms(decision.retry_after), "refused");
        }
        Some(HttpDecision { decision, limiter: limiter.clone() })
    }

    /// Charges one `method` request to its group's limit (`tools/call` is charged by
    /// [`Guard::admit`], together with the tool's budgets).
    pub async fn admit_method(&self, caller: &Caller, group: MethodGroup, method: &str) -> Result<(), Refusal> {
        if !self.enabled {
            return Ok(());
        }
        let limiter = self.policy.for_caller(caller).method(group);
        let scope = Scope::method(caller, group);
        let d = match self.store.decide_one(&Check { key: scope.key(), limiter, cost: 1 }).await {
            Ok(decision) => decision,
            Err(error) => {
                self.store_failed(Layer::Method, group.as_str(), &error);
                return Err(Refusal::limiter_unavailable(method, STORE_RETRY_MS));
            }
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
        Err(Refusal::rate_limited(method, name.to_owned(), d.limit, d.remaining, d.retry_after))
    }

    /// The scopes a call of `tool` by `caller` draws on, with their limiters and costs.
    fn scopes<'p>(&'p self, caller: &Caller, tool: &str, starts_job: bool) -> Vec<(Scope, &'p Limiter, u64)> {
        let tier = self.policy.for_caller(caller);
        let cost = self.policy.cost_of(tool);
        let mut scopes = vec![(Scope::method(caller, MethodGroup::ToolsCall), &tier.tools_call, 1)];
        if cost > 0 {
            scopes.push((Scope::caller(caller), &tier.caller, cost));
            if let Some(tenant) = Scope::tenant(caller) {
                scopes.push((tenant, &self.policy.tenant, cost));
            }
            if let Some(address) = Scope::address(caller) {
                scopes.push((address, &self.policy.address, cost));
            }
        }
        if let Some(budget) = self.policy.tools.get(tool).and_then(|t| t.budget.as_ref()) {
            scopes.push((Scope::tool(caller, tool), budget, 1));
        }
        if starts_job {
            scopes
                .extend(in_flight_scopes(&self.policy, caller).into_iter().map(|(scope, limiter)| (scope, limiter, 1)));
        }
        scopes
    }

    /// Refuses a call that repeats the caller's recent calls in a loop; otherwise records it.
    fn check_loop(&self, caller: &Caller, call: &ToolCall<'_>) -> Result<Option<loops::Recorded>, Refusal> {
        let Some(loops) = self.loops.as_ref().filter(|_| !call.loop_exempt) else { return Ok(None) };
        match loops.check(caller.id(), call.tool, call.args, self.clock.now()) {
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
        let recorded = self.check_loop(caller, call)?;
        let admitted = self.charge(caller, call.tool, call.starts_job).await;
        if let (Err(_), Some(recorded), Some(loops)) = (&admitted, recorded, &self.loops) {
            loops.forget(caller.id(), recorded);
        }
        admitted
    }

    async fn charge(&self, caller: &Caller, tool: &str, starts_job: bool) -> Result<Admission, Refusal> {
        let scopes = self.scopes(caller, tool, starts_job);
        let checks: Vec<Check<'_>> =
            scopes.iter().map(|(scope, limiter, cost)| Check { key: scope.key(), limiter, cost: *cost }).collect();
        let decisions = match self.store.decide(&checks).await {
            Ok(decisions) => decisions,
            Err(error) => {
                self.store_failed(Layer::Tool, tool, &error);
                return Err(Refusal::limiter_unavailable(tool, STORE_RETRY_MS));
            }
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
        let slots = checks
            .iter()
            .filter(|c| c.limiter.holds_slots())
            .map(|c| SlotGuard::new(self.store.clone(), c.key.to_owned(), c.limiter.clone(), c.cost))
            .collect();
        Ok(Admission::new(slots, self.metrics.clone()))
    }

    /// The caller's budgets right now, without spending anything: the HTTP budget (when it
    /// applies), the `tools/call` method budget, the caller's and tenant's tool budgets, and
    /// every tool's own budget.
    pub async fn status(&self, caller: &Caller, over_http: bool) -> Result<Vec<BudgetStatus>, StoreError> {
        let tier = self.policy.for_caller(caller);
        let mut peek: Vec<(Scope, &Limiter)> = Vec::new();
        if over_http {
            peek.push((Scope::http(caller), &tier.http));
        }
        peek.push((Scope::method(caller, MethodGroup::ToolsCall), &tier.tools_call));
        peek.push((Scope::caller(caller), &tier.caller));
        if let Some(tenant) = Scope::tenant(caller) {
            peek.push((tenant, &self.policy.tenant));
        }
        if let Some(address) = Scope::address(caller) {
            peek.push((address, &self.policy.address));
        }
        for (tool, policy) in &self.policy.tools {
            if let Some(budget) = &policy.budget {
                peek.push((Scope::tool(caller, tool), budget));
            }
        }
        peek.extend(in_flight_scopes(&self.policy, caller));
        // Cost 0 reads every level in one decision, without charging anything.
        let checks: Vec<Check<'_>> =
            peek.iter().map(|(scope, limiter)| Check { key: scope.key(), limiter, cost: 0 }).collect();
        let decisions = self.store.decide(&checks).await?;
        Ok(peek
            .iter()
            .zip(decisions)
            .map(|((scope, limiter), d)| BudgetStatus {
                scope: scope.name().to_owned(),
                algorithm: limiter.algorithm(),
                limit: d.limit,
                remaining: d.remaining,
                reset_after_ms: ceil_ms(d.reset_after),
            })
            .collect())
    }

    /// Forgets idle limiter state and loop histories; called on a schedule.
    pub fn sweep(&self) -> usize {
        self.store.sweep() + self.loops.as_ref().map_or(0, |loops| loops.sweep(self.clock.now()))
    }
}
