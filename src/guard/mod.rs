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

use std::sync::Arc;

use tracing::info;

use crate::clock::{SharedClock, ceil_ms};
use crate::config::Config;
use crate::guard::loops::LoopDetector;
use crate::identity::Caller;
use crate::limit::{Decision, Limiter};
use crate::metrics::{Layer, Metrics};
use crate::store::{Check, SlotGuard, Store};
pub use policy::{MethodGroup, Policy, TierLimits};
pub use refusal::{Refusal, RefusalCode};

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

/// The scope keys, one place for their shape: `rate_limit_status` and refusals show them.
fn method_scope(group: MethodGroup, caller: &Caller) -> String {
    format!("method:{}:{}", group.as_str(), caller.id())
}

fn caller_scope(caller: &Caller) -> String {
    format!("caller:{}", caller.id())
}

fn tenant_scope(tenant: &str) -> String {
    format!("tenant:{tenant}")
}

fn address_scope(address: &str) -> String {
    format!("address:{address}")
}

/// A tool's own budget belongs to the caller's tenant, or to the caller when it has none.
fn tool_scope(caller: &Caller, tool: &str) -> String {
    match caller.tenant() {
        Some(tenant) => format!("tenant:{tenant}:tool:{tool}"),
        None => format!("caller:{}:tool:{tool}", caller.id()),
    }
}

/// The in-flight caps a job holds: the caller's, and its tenant's (a caller without a tenant is
/// its own tenant, so then the caller's cap is the only one).
fn in_flight_scopes<'p>(policy: &'p Policy, caller: &Caller) -> Vec<(String, &'p Limiter)> {
    let mut scopes = vec![(format!("in_flight:caller:{}", caller.id()), &policy.in_flight_caller)];
    if let Some(tenant) = caller.tenant() {
        scopes.push((format!("in_flight:tenant:{tenant}"), &policy.in_flight_tenant));
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

    /// Charges one `POST /mcp` to the caller's coarse HTTP budget.
    pub fn admit_http(&self, caller: &Caller) -> HttpDecision {
        let limiter = &self.policy.for_caller(caller).http;
        let scope = format!("http:{}", caller.id());
        let decision = self.store.decide_one(&Check { key: &scope, limiter, cost: 1 }, self.clock.now());
        self.metrics.decision(Layer::Http, "POST /mcp", decision.allowed);
        if !decision.allowed {
            self.metrics.rejection(Layer::Http, "POST /mcp", "rate_limited", caller);
            info!(layer = "http", scope, retry_after_ms = ceil_ms(decision.retry_after), "refused");
        }
        HttpDecision { decision, limiter: limiter.clone() }
    }

    /// Charges one `method` request to its group's limit (`tools/call` is charged by
    /// [`Guard::admit`], together with the tool's budgets).
    pub fn admit_method(&self, caller: &Caller, group: MethodGroup, method: &str) -> Result<(), Refusal> {
        if !self.enabled {
            return Ok(());
        }
        let limiter = self.policy.for_caller(caller).method(group);
        let scope = method_scope(group, caller);
        let d = self.store.decide_one(&Check { key: &scope, limiter, cost: 1 }, self.clock.now());
        self.metrics.decision(Layer::Method, group.as_str(), d.allowed);
        if d.allowed {
            return Ok(());
        }
        self.metrics.rejection(Layer::Method, group.as_str(), "rate_limited", caller);
        info!(layer = "method", method = group.as_str(), scope, retry_after_ms = ceil_ms(d.retry_after), "refused");
        Err(Refusal::rate_limited(method, scope, d.limit, d.remaining, d.retry_after))
    }

    /// The scopes a call of `tool` by `caller` draws on, with their limiters and costs.
    fn scopes<'p>(&'p self, caller: &Caller, tool: &str, starts_job: bool) -> Vec<(String, &'p Limiter, u64)> {
        let tier = self.policy.for_caller(caller);
        let cost = self.policy.cost_of(tool);
        let mut scopes = vec![(method_scope(MethodGroup::ToolsCall, caller), &tier.tools_call, 1)];
        if cost > 0 {
            scopes.push((caller_scope(caller), &tier.caller, cost));
            if let Some(tenant) = caller.tenant() {
                scopes.push((tenant_scope(tenant), &self.policy.tenant, cost));
            }
            if let Some(address) = caller.unverified_from() {
                scopes.push((address_scope(address), &self.policy.address, cost));
            }
        }
        if let Some(budget) = self.policy.tools.get(tool).and_then(|t| t.budget.as_ref()) {
            scopes.push((tool_scope(caller, tool), budget, 1));
        }
        if starts_job {
            scopes.extend(in_flight_scopes(&self.policy, caller).into_iter().map(|(key, limiter)| (key, limiter, 1)));
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
    pub fn admit(&self, caller: &Caller, call: &ToolCall<'_>) -> Result<Admission, Refusal> {
        if !self.enabled {
            return Ok(Admission::new(Vec::new(), self.metrics.clone()));
        }
        let recorded = self.check_loop(caller, call)?;
        let admitted = self.charge(caller, call.tool, call.starts_job);
        if let (Err(_), Some(recorded), Some(loops)) = (&admitted, recorded, &self.loops) {
            loops.forget(caller.id(), recorded);
        }
        admitted
    }

    fn charge(&self, caller: &Caller, tool: &str, starts_job: bool) -> Result<Admission, Refusal> {
        let scopes = self.scopes(caller, tool, starts_job);
        let checks: Vec<Check<'_>> =
            scopes.iter().map(|(key, limiter, cost)| Check { key, limiter, cost: *cost }).collect();
        let decisions = self.store.decide(&checks, self.clock.now());
        // The call passes only when every scope admits it, so the wait is the longest one.
        let refused = checks.iter().zip(&decisions).filter(|(_, d)| !d.allowed).max_by_key(|(_, d)| d.retry_after);
        self.metrics.decision(Layer::Tool, tool, refused.is_none());
        if let Some((check, d)) = refused {
            let refusal = if check.limiter.holds_slots() {
                Refusal::busy(tool, check.key.to_owned(), d.limit)
            } else {
                Refusal::rate_limited(tool, check.key.to_owned(), d.limit, d.remaining, d.retry_after)
            };
            self.metrics.rejection(Layer::Tool, tool, refusal.code.as_str(), caller);
            info!(
                layer = "tool",
                tool,
                scope = check.key,
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
            .map(|c| {
                SlotGuard::new(self.store.clone(), self.clock.clone(), c.key.to_owned(), c.limiter.clone(), c.cost)
            })
            .collect();
        Ok(Admission::new(slots, self.metrics.clone()))
    }

    /// The caller's budgets right now, without spending anything: the HTTP budget (when it
    /// applies), the `tools/call` method budget, the caller's and tenant's tool budgets, and
    /// every tool's own budget.
    pub fn status(&self, caller: &Caller, over_http: bool) -> Vec<BudgetStatus> {
        let tier = self.policy.for_caller(caller);
        let mut peek: Vec<(String, &Limiter)> = Vec::new();
        if over_http {
            peek.push((format!("http:{}", caller.id()), &tier.http));
        }
        peek.push((method_scope(MethodGroup::ToolsCall, caller), &tier.tools_call));
        peek.push((caller_scope(caller), &tier.caller));
        if let Some(tenant) = caller.tenant() {
            peek.push((tenant_scope(tenant), &self.policy.tenant));
        }
        if let Some(address) = caller.unverified_from() {
            peek.push((address_scope(address), &self.policy.address));
        }
        for (tool, policy) in &self.policy.tools {
            if let Some(budget) = &policy.budget {
                peek.push((tool_scope(caller, tool), budget));
            }
        }
        peek.extend(in_flight_scopes(&self.policy, caller));
        let now = self.clock.now();
        peek.into_iter()
            .map(|(scope, limiter)| {
                let d = self.store.decide_one(&Check { key: &scope, limiter, cost: 0 }, now);
                BudgetStatus {
                    scope,
                    algorithm: limiter.algorithm(),
                    limit: d.limit,
                    remaining: d.remaining,
                    reset_after_ms: ceil_ms(d.reset_after),
                }
            })
            .collect()
    }

    /// Forgets idle limiter state and loop histories; called on a schedule.
    pub fn sweep(&self) -> usize {
        let now = self.clock.now();
        self.store.sweep(now) + self.loops.as_ref().map_or(0, |loops| loops.sweep(now))
    }
}
