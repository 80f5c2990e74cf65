//! The pipeline every request passes before work is done for it.
//!
//! Three entry points, one per layer: [`Guard::admit_http`] (the coarse limit on `POST /mcp`,
//! called by the HTTP tower layer), [`Guard::admit_method`] (`tools/list` and other methods) and
//! [`Guard::admit`] (`tools/call`, called by `McpServer::call_tool` for every tool, so no tool
//! can skip it). A tool call is first checked for a loop ([`loops`]: the same call repeated),
//! then against every scope that applies — method, caller, tenant, the tool's own budget, and
//! for a job the in-flight caps — **atomically**: all pass and are charged, or none is.

pub mod loops;
pub mod operator;
pub mod policy;
pub mod refusal;
pub mod refusals;
pub mod scope;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use arc_swap::ArcSwap;

use tracing::info;

use crate::activity::{Activity, Refused};
use crate::breaker::Breaker;
use crate::clock::{Nanos, SharedClock, ceil_ms};
use crate::config::Limit;
use crate::config::{Config, Fail};
use crate::guard::loops::{LoopDetector, Looping};
use crate::guard::refusals::RefusalMemory;
use crate::identity::Caller;
use crate::limit::{Decision, Limiter};
use crate::metrics::{Layer, Metrics};
use crate::store::{Check, Lease, LoopAnswer, LoopHistory, SlotGuard, Store, StoreError, Verdict, new_lease};
pub use policy::{MethodGroup, Policy, TierLimits};
pub use refusal::{Refusal, RefusalCode};
pub use scope::Scope;

/// One budget as a caller sees it in `rate_limit_status`.
#[derive(Debug, Clone, serde::Serialize, schemars::JsonSchema)]
pub struct BudgetStatus {
    /// The scope key, e.g. `caller:tok:1f2e…`, `tenant:acme` or `caller:tok:1f2e…#day`.
    pub scope: String,
    /// The algorithm deciding it.
    pub algorithm: &'static str,
    /// Its limit (burst, window limit or slots).
    pub limit: u64,
    /// Units left now.
    pub remaining: u64,
    /// Milliseconds until it is full again if nothing is spent.
    pub reset_after_ms: u64,
    /// A shadow limit: counted, never refusing.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub shadow: bool,
    /// A spend cap in money, when a price per unit is configured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub money: Option<Money>,
}

/// What an admitted tool call holds while it runs: its in-flight slots (given back when it is
/// dropped) and its place in the in-flight gauge.
#[derive(Debug)]
#[must_use = "dropping the admission releases its in-flight slots at once"]
pub struct Admission {
    _slots: Vec<SlotGuard>,
    warnings: Vec<Warning>,
    metrics: Arc<Metrics>,
}

impl Admission {
    /// The only way to make one: the in-flight gauge goes up here and down in `Drop`.
    fn new(slots: Vec<SlotGuard>, metrics: Arc<Metrics>) -> Self {
        metrics.in_flight(1.0);
        Self { _slots: slots, warnings: Vec::new(), metrics }
    }

    fn warning(mut self, warnings: Vec<Warning>) -> Self {
        self.warnings = warnings;
        self
    }

    /// Limits this call took past their warning level (spend caps at 80 %, daily windows…).
    pub fn warnings(&self) -> &[Warning] {
        &self.warnings
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
    /// The decision of the limit the headers speak of: the one that refused, else the enforced
    /// one with least left.
    pub decision: Decision,
    /// The limiter that took it (for the policy header).
    pub limiter: Limiter,
    /// The policy's name in the headers: `http` (the caller's own limit) or `address_http` (the
    /// limit its address shares, for an unverified caller).
    pub policy: &'static str,
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
    store: Arc<dyn Store>,
    /// Open while the shared store is failing: decisions skip it (no timeout to wait out on
    /// every call) until one probe a second finds it back.
    shared_down: Breaker,
    /// The shared store's refusals still in force, answered here without a round trip.
    refused: RefusalMemory,
}

/// Decides whether a caller may proceed, charges it, and explains refusals.
#[derive(Debug)]
pub struct Guard {
    store: Arc<dyn Store>,
    clock: SharedClock,
    /// The limits in force; a reload swaps them whole, and a decision keeps the ones it started
    /// with.
    live: ArcSwap<Live>,
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
    shared: Option<Arc<dyn LoopHistory>>,
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
            match redis.check(key.key(), signature, self.window, self.repeats).await {
                Ok(LoopAnswer::Recorded(seq)) => return Ok(LoopMark::Shared(seq)),
                Ok(LoopAnswer::Looping { retry_after, oscillating }) => {
                    return Err(Looping { retry_after, repeats: self.repeats, oscillating });
                }
                Err(error) => tracing::warn!(%error, "loop history unavailable in the shared store; checking locally"),
            }
        }
        self.local.check(scope::loop_owner(caller), call.tool, call.args, now).map(LoopMark::Local)
    }

    async fn forget(&self, caller: &Caller, mark: LoopMark) {
        match (mark, &self.shared) {
            (LoopMark::Local(recorded), _) => self.local.forget(scope::loop_owner(caller), recorded),
            (LoopMark::Shared(seq), Some(redis)) => {
                if let Err(error) = redis.forget(Scope::loops(caller).key(), seq, self.window).await {
                    tracing::warn!(%error, "could not take a call back from the shared loop history");
                }
            }
            (LoopMark::Shared(_), None) => {}
        }
    }
}

/// One limit a decision takes: the scope (with the limit's suffix), the limit, and the cost.
type Planned<'p> = (Scope, &'p Limit, u64);

/// Adds `scope`'s `limits` at `cost`: the first under the scope itself, each other one under the
/// scope with its suffix.
fn plan<'p>(out: &mut Vec<Planned<'p>>, scope: Scope, limits: &'p [Limit], cost: u64) {
    for limit in limits {
        let scope = if limit.suffix.is_empty() { scope.clone() } else { scope.for_limit(&limit.suffix) };
        out.push((scope, limit, cost));
    }
}

/// The in-flight caps a job holds: the caller's, its tenant's, and for an unverified caller its
/// address's.
fn in_flight_scopes<'p>(policy: &'p Policy, caller: &Caller, cost: u64, out: &mut Vec<Planned<'p>>) {
    out.push((Scope::in_flight_caller(caller), &policy.in_flight_caller, cost));
    if let Some(tenant) = Scope::in_flight_tenant(caller) {
        out.push((tenant, &policy.in_flight_tenant, cost));
    }
    if let Some(address) = Scope::in_flight_address(caller) {
        out.push((address, &policy.in_flight_address, cost));
    }
}

/// The coarse HTTP scopes of one request: the caller's, and for an unverified caller its
/// address's.
fn http_scopes<'p>(policy: &'p Policy, caller: &Caller, cost: u64, out: &mut Vec<Planned<'p>>) {
    plan(out, Scope::http(caller), &policy.for_caller(caller).http, cost);
    if let Some(address) = Scope::address_http(caller) {
        plan(out, address, &policy.address_http, cost);
    }
}

/// The scopes a call of `tool` by `caller` draws on under `policy`, with their limits and costs.
fn tool_scopes<'p>(policy: &'p Policy, caller: &Caller, tool: &str, starts_job: bool) -> Vec<Planned<'p>> {
    let tier = policy.for_caller(caller);
    let cost = policy.cost_of(tool);
    let mut scopes = Vec::with_capacity(8);
    plan(&mut scopes, Scope::method(caller, MethodGroup::ToolsCall), &tier.tools_call, 1);
    if cost > 0 {
        plan(&mut scopes, Scope::caller(caller), policy.caller_budget(caller), cost);
        if let (Some(scope), Some(tenant)) = (Scope::tenant(caller), caller.tenant()) {
            plan(&mut scopes, scope, policy.tenant_budget(tenant), cost);
        }
        if let Some(address) = Scope::address(caller) {
            plan(&mut scopes, address, &policy.address, cost);
        }
        if let Some(cap) = policy.spend_cap(caller.tenant()) {
            scopes.push((Scope::spend(caller), cap, cost));
        }
    }
    if let Some(tool_policy) = policy.tools.get(tool) {
        plan(&mut scopes, Scope::tool(caller, tool), &tool_policy.budget, 1);
    }
    if starts_job {
        in_flight_scopes(policy, caller, 1, &mut scopes);
    }
    scopes
}

/// What `rate_limit_status` reads for `caller` (every limit, at cost 0), plus the HTTP scope
/// when the caller comes over HTTP.
fn status_scopes<'p>(policy: &'p Policy, caller: &Caller, over_http: bool) -> Vec<Planned<'p>> {
    let tier = policy.for_caller(caller);
    let mut peek = Vec::with_capacity(12);
    if over_http {
        http_scopes(policy, caller, 0, &mut peek);
    }
    plan(&mut peek, Scope::method(caller, MethodGroup::ToolsCall), &tier.tools_call, 0);
    plan(&mut peek, Scope::caller(caller), policy.caller_budget(caller), 0);
    if let (Some(scope), Some(tenant)) = (Scope::tenant(caller), caller.tenant()) {
        plan(&mut peek, scope, policy.tenant_budget(tenant), 0);
    }
    if let Some(address) = Scope::address(caller) {
        plan(&mut peek, address, &policy.address, 0);
    }
    if let Some(cap) = policy.spend_cap(caller.tenant()) {
        peek.push((Scope::spend(caller), cap, 0));
    }
    for (tool, tool_policy) in &policy.tools {
        plan(&mut peek, Scope::tool(caller, tool), &tool_policy.budget, 0);
    }
    in_flight_scopes(policy, caller, 0, &mut peek);
    peek
}

/// What [`Guard::decide`] answers: the scopes with their decisions, the store holding any slots,
/// and the operator block that stopped the call (which of those asked about, the time left).
type Decided<'s> = (Vec<Planned<'s>>, Vec<Decision>, &'s Arc<dyn Store>, Option<(usize, Nanos)>);

fn checks_of<'a>(scopes: &'a [Planned<'a>]) -> Vec<Check<'a>> {
    scopes
        .iter()
        .map(|(scope, limit, cost)| Check {
            key: scope.key(),
            limiter: &limit.limiter,
            cost: *cost,
            shadow: !limit.enforced_mode(),
        })
        .collect()
}

/// The enforced limit that refused with the longest wait (the call passes only when every
/// enforced limit admits it); shadow limits' refusals are counted and logged here.
fn refused_by<'a, 'p>(
    scopes: &'a [Planned<'p>],
    decisions: &'a [Decision],
    metrics: &Metrics,
    layer: Layer,
    what: &str,
) -> Option<(&'a Planned<'p>, &'a Decision)> {
    for ((scope, limit, _), d) in scopes.iter().zip(decisions) {
        if !d.allowed && !limit.enforced_mode() {
            metrics.shadow_refusal(layer, what);
            info!(
                layer = layer.as_str(),
                what,
                scope = scope.name(),
                retry_after_ms = ceil_ms(d.retry_after),
                "shadow limit would have refused"
            );
        }
    }
    scopes
        .iter()
        .zip(decisions)
        .filter(|((_, limit, _), d)| !d.allowed && limit.enforced_mode())
        .max_by_key(|(_, d)| d.retry_after)
}

/// A limit past its warning level after an admitted call, for the agent to plan with.
#[derive(Debug, Clone, serde::Serialize, schemars::JsonSchema)]
pub struct Warning {
    /// The scope, e.g. `spend:tenant:acme` or `caller:tok:1f2e…#day`.
    pub scope: String,
    /// The limit in words.
    pub policy: String,
    /// Units used of it.
    pub used: u64,
    /// Its limit.
    pub limit: u64,
    /// Percentage used, rounded down.
    pub percent_used: u64,
    /// Milliseconds until it is full again if nothing is spent.
    pub reset_after_ms: u64,
    /// The same in money, when a price per unit is configured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub money: Option<Money>,
}

/// Spend and a cap in money.
#[derive(Debug, Clone, serde::Serialize, schemars::JsonSchema)]
pub struct Money {
    /// Spent so far in the window.
    pub used: f64,
    /// The cap.
    pub cap: f64,
    /// The currency.
    pub currency: String,
}

impl Warning {
    /// The sentence an agent reads.
    pub fn sentence(&self) -> String {
        let money = self
            .money
            .as_ref()
            .map_or_else(String::new, |m| format!(" ({:.2} of {:.2} {})", m.used, m.cap, m.currency));
        format!(
            "Note: {}% of the limit {} ({}) is used: {} of {} units{money}. It is full again in {} s; plan the \
             remaining calls.",
            self.percent_used,
            self.scope,
            self.policy,
            self.used,
            self.limit,
            self.reset_after_ms.div_ceil(1000)
        )
    }
}

/// A spend cap's use and limit in money, when a price per unit is configured.
fn money_of(policy: &Policy, scope: &Scope, d: &Decision) -> Option<Money> {
    let (price, currency) = policy.price.as_ref().filter(|_| scope.name().starts_with("spend:"))?;
    let used = d.limit.saturating_sub(d.remaining);
    Some(Money { used: used as f64 * price, cap: d.limit as f64 * price, currency: currency.clone() })
}

/// One limit as `rate_limit_status` (and the admin API) shows it.
fn budget_status(policy: &Policy, scope: &Scope, limit: &Limit, d: &Decision) -> BudgetStatus {
    BudgetStatus {
        scope: scope.name().to_owned(),
        algorithm: limit.limiter.algorithm(),
        limit: d.limit,
        remaining: d.remaining,
        reset_after_ms: ceil_ms(d.reset_after),
        shadow: !limit.enforced_mode(),
        money: money_of(policy, scope, d),
    }
}

/// The warnings of an admitted decision: every limit with a warning level that the call took
/// past it.
fn warnings_of(policy: &Policy, scopes: &[Planned<'_>], decisions: &[Decision]) -> Vec<Warning> {
    let mut warnings = Vec::new();
    for ((scope, limit, cost), d) in scopes.iter().zip(decisions) {
        let Some(at) = limit.warn_at_percent else { continue };
        let used = d.limit.saturating_sub(d.remaining);
        if *cost == 0 || d.limit == 0 || u128::from(used) * 100 < u128::from(at) * u128::from(d.limit) {
            continue;
        }
        let money = money_of(policy, scope, d);
        warnings.push(Warning {
            scope: scope.name().to_owned(),
            policy: limit.limiter.describe(),
            used,
            limit: d.limit,
            percent_used: used.saturating_mul(100) / d.limit,
            reset_after_ms: ceil_ms(d.reset_after),
            money,
        });
    }
    warnings
}

/// The limits one decision is taken under.
#[derive(Debug)]
struct Live {
    /// `limits.enabled`.
    enabled: bool,
    policy: Arc<Policy>,
    /// The insurance limiter's share of them, over a shared store.
    insurance: Option<Policy>,
}

impl Live {
    fn new(config: &Config, insured: bool) -> Self {
        let policy = Policy::new(config);
        let insurance = insured.then(|| policy.scaled(1.0 / config.store.expected_instances as f64));
        Self { enabled: config.limits.enabled, policy: Arc::new(policy), insurance }
    }
}

impl Guard {
    /// A guard over `store` with the limits of `config` (over a shared store, add the insurance
    /// limiter for when it cannot decide with [`Guard::insured_by`]).
    pub fn new(store: Arc<dyn Store>, clock: SharedClock, config: &Config, metrics: Arc<Metrics>) -> Self {
        let detection = &config.loop_detection;
        let window = detection.window_ms.saturating_mul(crate::clock::NANOS_PER_MS);
        let loops = detection.enabled.then(|| Loops {
            local: LoopDetector::new(detection.repeats, window),
            shared: store.clone().loop_history(),
            repeats: detection.repeats,
            window,
        });
        Self {
            live: ArcSwap::from_pointee(Live::new(config, false)),
            store,
            clock,
            insurance: None,
            store_up: AtomicBool::new(true),
            loops,
            metrics,
            activity: Activity::new(),
        }
    }

    /// This guard with an insurance limiter in `local` (a store of this process alone): while the
    /// shared store cannot decide, it decides the tools that fail open, with every limit divided
    /// by `store.expected_instances` of `config`.
    pub fn insured_by(mut self, local: Arc<dyn Store>, config: &Config) -> Self {
        self.insurance = Some(Insurance {
            store: local,
            shared_down: Breaker::new(1, STORE_PROBE_EVERY),
            refused: RefusalMemory::default(),
        });
        self.live.store(Arc::new(Live::new(config, true)));
        self
    }

    /// Whether limits are enforced at all (`limits.enabled`).
    pub fn enabled(&self) -> bool {
        self.live.load().enabled
    }

    /// The limits in force.
    pub fn policy(&self) -> Arc<Policy> {
        self.live.load().policy.clone()
    }

    /// Puts the limits of `config` in force for every decision from now on. Usage carries over:
    /// the state lives under scope keys that do not depend on the limits' numbers. Refusals the
    /// shared store made under the old limits are forgotten, so a looser limit applies at once.
    pub fn reload(&self, config: &Config) {
        self.live.store(Arc::new(Live::new(config, self.insurance.is_some())));
        if let Some(insurance) = &self.insurance {
            insurance.refused.clear();
        }
    }

    /// The budgets a call of `tool` by `caller` draws on, with the units it costs in each (a job's
    /// in-flight caps among them): what [`Guard::admit`] charges, for tools that reason about it.
    pub fn scopes_of(&self, caller: &Caller, tool: &str, starts_job: bool) -> Vec<(Scope, Limit, u64)> {
        let policy = self.policy();
        tool_scopes(&policy, caller, tool, starts_job)
            .into_iter()
            .map(|(scope, limit, units)| (scope, limit.clone(), units))
            .collect()
    }

    /// Where limiter state lives.
    pub fn store(&self) -> &Arc<dyn Store> {
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
        blocks: &[&str],
        lease: Lease,
        layer: Layer,
        what: &str,
    ) -> Option<Verdict> {
        let permit = match &self.insurance {
            Some(insurance) => Some(insurance.shared_down.permit(self.clock.now()).ok()?),
            None => None,
        };
        let decided = self.store.decide(checks, blocks, lease).await;
        if let (Some(insurance), Some(permit)) = (&self.insurance, permit) {
            insurance.shared_down.record(permit, decided.is_ok(), self.clock.now());
            self.store_up.store(decided.is_ok(), Ordering::Relaxed);
        }
        decided.map_err(|error| self.store_failed(layer, what, &error)).ok()
    }

    /// Decides `scopes` (built by `scopes_under` from a policy) on the shared store or, when it
    /// cannot decide and the call may `fail` open, on the insurance limiter. Returns the
    /// decisions with the scopes they were taken on and the store that holds any slots, and
    /// which of `blocks` (operator blocks, read with the decision) stopped it, with the time
    /// left — then nothing was decided. Blocks live in the shared store: the insurance limiter
    /// cannot see them.
    async fn decide<'s, F>(
        &'s self,
        live: &'s Live,
        scopes_under: F,
        blocks: &[&str],
        lease: Lease,
        fail: Fail,
        (layer, what): (Layer, &str),
    ) -> Option<Decided<'s>>
    where
        F: Fn(&'s Policy) -> Vec<Planned<'s>>,
    {
        let scopes = scopes_under(&live.policy);
        let checks = checks_of(&scopes);
        if let Some(insurance) = &self.insurance
            && let Some(decisions) = insurance.refused.recall(&checks, self.clock.now())
        {
            return Some((scopes, decisions, &self.store, None));
        }
        let now = self.clock.now();
        match self.decide_shared(&checks, blocks, lease, layer, what).await {
            Some(Verdict::Decided(decisions)) => {
                if let Some(insurance) = &self.insurance {
                    insurance.refused.remember(&checks, &decisions, now);
                }
                return Some((scopes, decisions, &self.store, None));
            }
            Some(Verdict::Blocked { index, left }) => {
                return Some((scopes, Vec::new(), &self.store, Some((index, left))));
            }
            None => {}
        }
        let insurance = self.insurance.as_ref().filter(|_| fail == Fail::Open)?;
        let scopes = scopes_under(live.insurance.as_ref()?);
        let decisions = insurance.store.decide_all(&checks_of(&scopes), lease).await.ok()?;
        Some((scopes, decisions, &insurance.store, None))
    }

    /// Charges one `POST /mcp` to the caller's coarse HTTP budget. `None` only if nobody could
    /// decide: the coarse layer protects the server, so it then lets the request on to the finer
    /// limits behind it rather than refusing everyone.
    pub async fn admit_http(&self, caller: &Caller) -> Option<HttpDecision> {
        let under = |p| {
            let mut scopes = Vec::with_capacity(2);
            http_scopes(p, caller, 1, &mut scopes);
            scopes
        };
        let live = self.live.load_full();
        let (scopes, decisions, _, _) =
            self.decide(&live, under, &[], new_lease(), Fail::Open, (Layer::Http, "POST /mcp")).await?;
        let refused = refused_by(&scopes, &decisions, &self.metrics, Layer::Http, "POST /mcp");
        self.metrics.decision(Layer::Http, "POST /mcp", refused.is_none());
        // The headers speak of the limit that refused, else of the enforced one with least left.
        let ((scope, limit, _), decision) = match refused {
            Some(refused) => {
                self.metrics.rejection(Layer::Http, "POST /mcp", "rate_limited", caller);
                info!(
                    layer = "http",
                    scope = refused.0.0.name(),
                    retry_after_ms = ceil_ms(refused.1.retry_after),
                    "refused"
                );
                let record = Refused {
                    layer: Layer::Http,
                    tool: "POST /mcp",
                    code: "rate_limited",
                    scope: Some(refused.0.0.name()),
                    limit: Some(refused.1.limit),
                    remaining: Some(refused.1.remaining),
                    retry_after_ms: Some(ceil_ms(refused.1.retry_after)),
                    message: "Too many requests: answered 429 before any JSON was read.",
                };
                self.activity.refused(caller, record, self.clock.now());
                refused
            }
            None => scopes
                .iter()
                .zip(&decisions)
                .filter(|((_, limit, _), _)| limit.enforced_mode())
                .min_by_key(|(_, d)| d.remaining)
                .or_else(|| scopes.iter().zip(&decisions).next())?,
        };
        let policy = if scope.name().starts_with("address_http:") { "address_http" } else { "http" };
        let decision = Decision { allowed: refused.is_none(), ..*decision };
        Some(HttpDecision { decision, limiter: limit.limiter.clone(), policy })
    }

    /// Charges one `method` request to its group's limit (`tools/call` is charged by
    /// [`Guard::admit`], together with the tool's budgets).
    pub async fn admit_method(&self, caller: &Caller, group: MethodGroup, method: &str) -> Result<(), Refusal> {
        let live = self.live.load_full();
        if !live.enabled {
            return Ok(());
        }
        let under = |p| {
            let mut scopes = Vec::with_capacity(1);
            plan(&mut scopes, Scope::method(caller, group), Policy::for_caller(p, caller).method(group), 1);
            scopes
        };
        let decided = self.decide(&live, under, &[], new_lease(), Fail::Open, (Layer::Method, group.as_str())).await;
        let Some((scopes, decisions, _, _)) = decided else {
            return Err(Refusal::limiter_unavailable(method, STORE_RETRY_MS));
        };
        let refused = refused_by(&scopes, &decisions, &self.metrics, Layer::Method, group.as_str());
        self.metrics.decision(Layer::Method, group.as_str(), refused.is_none());
        let Some(((scope, limit, _), d)) = refused else { return Ok(()) };
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
        let refusal = if scopes.len() > 1 { refusal.naming_limit(limit.limiter.describe()) } else { refusal };
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
        let live = self.live.load_full();
        if !live.enabled {
            return Ok(Admission::new(Vec::new(), self.metrics.clone()));
        }
        let recorded = self.check_loop(caller, call).await?;
        let admitted = self.charge(&live, caller, call.tool, call.starts_job).await;
        if let (Err(_), Some(recorded), Some(loops)) = (&admitted, recorded, &self.loops) {
            loops.forget(caller, recorded).await;
        }
        admitted
    }

    async fn charge(&self, live: &Live, caller: &Caller, tool: &str, starts_job: bool) -> Result<Admission, Refusal> {
        let fail = live.policy.tools.get(tool).map_or(Fail::Closed, |t| t.fail);
        let under = |p| tool_scopes(p, caller, tool, starts_job);
        let lease = new_lease();
        let blocks: Vec<Scope> =
            std::iter::once(Scope::block_caller(caller)).chain(Scope::block_tenant(caller)).collect();
        let block_keys: Vec<&str> = blocks.iter().map(Scope::key).collect();
        let Some((scopes, decisions, store, blocked)) =
            self.decide(live, under, &block_keys, lease, fail, (Layer::Tool, tool)).await
        else {
            return Err(Refusal::limiter_unavailable(tool, STORE_RETRY_MS));
        };
        if let Some((index, left)) = blocked {
            return Err(self.refuse_blocked(caller, tool, blocks.get(index).map_or("block", Scope::name), left));
        }
        // The call passes only when every enforced limit admits it, so the wait is the longest.
        let refused = refused_by(&scopes, &decisions, &self.metrics, Layer::Tool, tool);
        self.metrics.decision(Layer::Tool, tool, refused.is_none());
        if let Some(((scope, limit, _), d)) = refused {
            let name = scope.name().to_owned();
            let refusal = if limit.limiter.holds_slots() {
                Refusal::busy(tool, name, d.limit)
            } else {
                let refusal = Refusal::rate_limited(tool, name, d.limit, d.remaining, d.retry_after);
                // Of several limits on one scope, say which refused.
                let several = !limit.suffix.is_empty()
                    || scopes.iter().any(|(s, l, _)| {
                        !l.suffix.is_empty() && s.key().strip_suffix(l.suffix.as_str()) == Some(scope.key())
                    });
                if several { refusal.naming_limit(limit.limiter.describe()) } else { refusal }
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
        // Only the slots the decision took: a shadow cap that would have refused took none, and
        // a guard for it would give back someone else's slot (or renew a lease above the cap).
        let slots = scopes
            .iter()
            .zip(&decisions)
            .filter(|((_, limit, _), d)| limit.limiter.holds_slots() && d.allowed)
            .map(|((scope, limit, cost), _)| {
                SlotGuard::new(store.clone(), scope.key().to_owned(), limit.limiter.clone(), *cost, lease)
            })
            .collect();
        let warnings = warnings_of(&live.policy, &scopes, &decisions);
        Ok(Admission::new(slots, self.metrics.clone()).warning(warnings))
    }

    /// The caller's budgets right now, without spending anything: the HTTP budget (when it
    /// applies), the `tools/call` method budget, the caller's and tenant's tool budgets, and
    /// every tool's own budget.
    pub async fn status(&self, caller: &Caller, over_http: bool) -> Option<Vec<BudgetStatus>> {
        let under = |policy| status_scopes(policy, caller, over_http);
        // Cost 0 reads every level in one decision, without charging anything.
        let live = self.live.load_full();
        let (scopes, decisions, _, _) =
            self.decide(&live, under, &[], new_lease(), Fail::Open, (Layer::Tool, "rate_limit_status")).await?;
        Some(
            scopes
                .iter()
                .zip(decisions)
                .map(|((scope, limit, _), d)| budget_status(&live.policy, scope, limit, &d))
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
