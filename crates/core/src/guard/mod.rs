//! The pipeline every request passes before work is done for it.
//!
//! Three entry points, one per layer: [`Guard::admit_http`] (the coarse limit on `POST /mcp`,
//! called by the HTTP tower layer), [`Guard::admit_method`] (`tools/list` and other methods) and
//! [`Guard::call`] (`tools/call`: the one guarded call every door runs — the library's router,
//! the reference server, the proxy, the simulator — in [`call`]; no tool can skip it, and it is
//! the only caller of the guard's `admit`). Each passes the same stages, each in a file of its
//! own, composed here; the admission's in [`admit`], what follows the work in [`after`]:
//!
//! 1. **plan** ([`admit::plan`]): the limits the request draws on, under which scope, at what cost;
//! 2. **loops** ([`loops`], tool calls only): the same call repeated is refused before anything
//!    is charged;
//! 3. **decide** (`admit/decide.rs`): every planned limit **atomically** — all pass and are
//!    charged, or none is — on the store, or on the insurance limiter while a shared store cannot
//!    decide;
//! 4. **report** ([`admit::report`]): which limit refused and how long to wait, the warnings an
//!    admitted call carries, metrics, the dashboard's activity and the (rate-limited) log;
//! 5. **settle** ([`after::settle`], after the call): the price the call reserved made what the
//!    upstream says it used, as the call answers, or when work that outlives it is final
//!    ([`Held`]);
//! 6. **hear** ([`after::progress`], [`loops`], after the call): what the answer says, so that a
//!    call whose answer moved stops counting towards a loop, and a read that keeps giving the same
//!    answer is warned, then stopped (`[loop_detection] no_progress`).
//!
//! A forker who wants no loop detection removes stage 2 (the `loops` field and its two calls in
//! `Guard::admit`); one who wants another store hands [`Guard::new`] another [`Store`].

pub mod admit;
pub mod after;
pub mod call;
pub mod loops;
mod policy;
mod refusal;
mod refusal_memory;
pub mod reuse;
mod scope;
pub mod shed;
pub mod trace;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use arc_swap::ArcSwap;

use crate::clock::{Nanos, SharedClock, ceil_ms};
use crate::config::{Fail, Limit, LimitsConfig, Settle};
use crate::guard::admit::decide::Insurance;
use crate::guard::admit::plan::{Planned, http_scopes, method_scopes, resumed_scopes, status_scopes, tool_scopes};
use crate::guard::admit::report::{RefusalLog, budget_status, refused_by, warnings_of};
use crate::guard::loops::{Looping, Loops, NoProgress, Pattern, Recorded, SharedLoopCall};
use crate::identity::Caller;
use crate::limit::{Decision, Limiter, Taken};
use crate::ops::activity::{Activity, Refused, Sample, ScopeLevel};
use crate::ops::metrics::{Layer, Metrics};
use crate::store::{Check, Lease, SlotGuard, Store, Verdict};
pub use admit::report::{BudgetStatus, Money, Warning};
pub use after::settle::{Handed, Held, Reserved, Settled, Used};
pub use call::{Admitted, Answer, Call, Called, Checked, Door, Plain, TakeOnce, Worked};
pub use policy::{MethodGroup, Policy, TierLimits};
pub use refusal::{Refusal, RefusalCode};
pub use scope::Scope;

/// What an admitted tool call holds while it runs: its in-flight slots (given back when it is
/// dropped) and its place in the in-flight gauge.
#[derive(Debug)]
#[must_use = "dropping the admission releases its in-flight slots at once"]
pub struct Admission {
    _slots: Vec<SlotGuard>,
    warnings: Vec<Warning>,
    reserved: Option<Reserved>,
    metrics: Arc<Metrics>,
}

impl Admission {
    /// The only way to make one: the in-flight gauge goes up here and down in `Drop`.
    fn new(slots: Vec<SlotGuard>, metrics: Arc<Metrics>) -> Self {
        metrics.in_flight(1.0);
        Self { _slots: slots, warnings: Vec::new(), reserved: None, metrics }
    }

    fn warning(mut self, warnings: Vec<Warning>) -> Self {
        self.warnings = warnings;
        self
    }

    fn reserving(mut self, reserved: Option<Reserved>) -> Self {
        if let Some(reserved) = &reserved {
            trace::reserved(reserved.units());
        }
        self.reserved = reserved;
        self
    }

    /// The price this call reserved, for the guard to settle when the call answers or its work
    /// is final ([`Held::finish`]); `None` for a call that costs nothing, or once taken. Left here
    /// unsettled, the reservation stands.
    pub(crate) fn reserved(&mut self) -> Option<Reserved> {
        self.reserved.take()
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

/// The limit the RateLimit headers describe: the one whose decision they give.
#[derive(Debug, Clone)]
pub struct RatePolicy {
    /// Its limiter (its quota and window).
    pub limiter: Limiter,
    /// Its name in the headers: `http` (the caller's own limit) or `address_http` (the limit its
    /// address shares, for an unverified caller).
    pub name: &'static str,
}

/// A tool call as the guard sees it.
#[derive(Debug, Clone, Copy)]
pub struct ToolCall<'a> {
    /// The tool's name.
    pub tool: &'a str,
    /// Its arguments, canonical (defaults filled in), for loop detection.
    pub args: &'a serde_json::Value,
    /// Whether the call holds in-flight slots for as long as its admission lives (a job, until it
    /// is final; a `holds_slot` tool, until it returns).
    pub starts_job: bool,
    /// Whether the call can never be a loop (a poll of a pending job, which the job book
    /// answers with its wait).
    pub loop_exempt: bool,
    /// Whether the call resumes one answered "input required" ([`after::resume`]): then it is charged
    /// neither its price nor its tool's budget again (it is still a request, and a `holds_slot`
    /// tool still takes its slot), and it is never a loop.
    pub resumed: bool,
}

/// What a caller refused because the store could not decide is told to wait.
const STORE_RETRY_MS: u64 = 1_000;

/// Decides whether a caller may proceed, charges it, and explains refusals.
#[derive(Debug)]
pub struct Guard {
    store: Arc<dyn Store>,
    clock: SharedClock,
    /// The limits in force; a reload swaps them whole, and a decision keeps the ones it started
    /// with.
    live: ArcSwap<LimitsInForce>,
    /// The limits put in force lately, numbered: what a settlement reads to tell whether the limit
    /// of a budget it gives back to changed since its call was charged.
    generations: Arc<Generations>,
    insurance: Option<Insurance>,
    store_up: AtomicBool,
    loops: Option<Loops>,
    metrics: Arc<Metrics>,
    activity: Activity,
    refusal_log: RefusalLog,
    /// Refuses the lowest priority first while the server itself is behind (`[server.shedding]`).
    shedder: Option<shed::Shedder>,
}

/// The limits one decision is taken under.
#[derive(Debug)]
struct LimitsInForce {
    /// `limits.enabled`.
    enabled: bool,
    policy: Arc<Policy>,
    /// The insurance limiter's share of them, over a shared store.
    insurance: Option<Policy>,
    /// Which limits put in force these are: one more at every reload.
    generation: u64,
}

impl LimitsInForce {
    fn new(config: &LimitsConfig, insured: bool, generation: u64) -> Self {
        let policy = Policy::new(config);
        let insurance = insured.then(|| policy.scaled(1.0 / config.store.expected_instances as f64));
        Self { enabled: config.limits.enabled, policy: Arc::new(policy), insurance, generation }
    }
}

/// How many of the latest limits put in force a settlement can look back through; one charged
/// before more reloads than that gives nothing back.
const GENERATIONS_KEPT: usize = 16;

/// The limits put in force lately, oldest first.
#[derive(Debug, Default)]
struct Generations(std::sync::Mutex<std::collections::VecDeque<Arc<LimitsInForce>>>);

impl Generations {
    fn kept(&self) -> std::sync::MutexGuard<'_, std::collections::VecDeque<Arc<LimitsInForce>>> {
        self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Puts the limits `make` builds (given their number) in force in `live`, the next after the
    /// latest, and keeps them; all under one lock, so numbers follow the order they went live in.
    fn put_in_force(&self, live: &ArcSwap<LimitsInForce>, make: impl FnOnce(u64) -> LimitsInForce) {
        let mut kept = self.kept();
        let next = Arc::new(make(kept.back().map_or(0, |latest| latest.generation + 1)));
        kept.push_back(next.clone());
        while kept.len() > GENERATIONS_KEPT {
            kept.pop_front();
        }
        live.store(next);
    }

    /// Every limits put in force after `generation`, oldest first; `None` when some of them are
    /// no longer kept.
    fn since(&self, generation: u64) -> Option<Vec<Arc<LimitsInForce>>> {
        let kept = self.kept();
        let since: Vec<Arc<LimitsInForce>> = kept.iter().filter(|l| l.generation > generation).cloned().collect();
        match since.first() {
            Some(first) if first.generation != generation + 1 => None,
            None if kept.front().is_none_or(|oldest| oldest.generation > generation) => None,
            _ => Some(since),
        }
    }
}

impl Guard {
    /// A guard over `store` with the limits of `config` (over a shared store, add the insurance
    /// limiter for when it cannot decide with [`Guard::insured_by`]).
    pub fn new(store: Arc<dyn Store>, clock: SharedClock, config: &LimitsConfig, metrics: Arc<Metrics>) -> Self {
        let detection = &config.loop_detection;
        let window = crate::clock::Nanos::from_millis(detection.window_ms);
        let loops = detection.enabled.then(|| {
            Loops::new(detection.repeats, window, store.clone().loop_history())
                .comparing(detection.no_progress, detection.volatile_fields.clone())
        });
        let first = Arc::new(LimitsInForce::new(config, false, 0));
        Self {
            live: ArcSwap::from(first.clone()),
            generations: Arc::new(Generations(std::sync::Mutex::new([first].into()))),
            store,
            clock,
            insurance: None,
            store_up: AtomicBool::new(true),
            loops,
            metrics,
            activity: Activity::new(),
            refusal_log: RefusalLog::default(),
            shedder: shed::Shedder::configured(config),
        }
    }

    /// The clock every decision takes its time from.
    pub fn clock(&self) -> &SharedClock {
        &self.clock
    }

    /// Where the server stands against `[server.shedding]`: the least queueing delay of the last
    /// interval and how many classes of callers are refused (`None`: shedding is off).
    pub fn overload(&self) -> Option<shed::Overload> {
        self.shedder.as_ref().map(|shedder| shedder.overload(self.clock.now()))
    }

    /// This guard with an insurance limiter in `local` (a store of this process alone): while the
    /// shared store cannot decide, it decides the tools that fail open, with every limit divided
    /// by `store.expected_instances` of `config`.
    pub fn insured_by(mut self, local: Arc<dyn Store>, config: &LimitsConfig) -> Self {
        self.insurance = Some(Insurance {
            store: local,
            shared_down: crate::breaker::Breaker::new(1, admit::decide::STORE_PROBE_EVERY),
            refused: Arc::default(),
        });
        self.generations.put_in_force(&self.live, |generation| LimitsInForce::new(config, true, generation));
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
    pub fn reload(&self, config: &LimitsConfig) {
        let insured = self.insurance.is_some();
        self.generations.put_in_force(&self.live, |generation| LimitsInForce::new(config, insured, generation));
        if let Some(insurance) = &self.insurance {
            insurance.refused.clear();
        }
        self.activity.limits_changed();
    }

    /// The budgets a call of `tool` by `caller` draws on, with the units it costs in each (a job's
    /// in-flight caps among them): what a call of it is charged, for tools that reason about it.
    /// (A tool priced by a formula is shown at its most, `cost_max`.)
    pub fn scopes_of(&self, caller: &Caller, tool: &str, starts_job: bool) -> Vec<(Scope, Limit, u64)> {
        let policy = self.policy();
        let cost = policy.cost_of(tool);
        let scopes = tool_scopes(&policy, caller, tool, cost, starts_job);
        scopes.into_iter().map(|p| (p.scope, p.limit.clone(), p.cost)).collect()
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

    /// Whether a refusal of `caller`'s may be logged now (see [`RefusalLog`]), and how many of
    /// its bucket's were left out since the last line.
    fn may_log(&self, caller: &Caller) -> Option<u64> {
        self.refusal_log.admit(caller.bucket(), self.clock.now())
    }

    /// The refusal stage's counters for `caller` on `layer`: the metrics and the log.
    fn report_refusal(&self, caller: &Caller, (layer, what): (Layer, &str), code: &'static str, detail: (&str, Nanos)) {
        self.metrics.rejection(layer, what, code, caller);
        let (scope, retry_after) = detail;
        if let Some(left_out) = self.may_log(caller) {
            tracing::info!(
                target: "mcp_ratelimit::guard", layer = layer.as_str(),
                what,
                scope,
                caller_bucket = caller.bucket(),
                code,
                retry_after_ms = ceil_ms(retry_after),
                left_out,
                "refused"
            );
        }
    }

    /// Charges one `POST /mcp` to the caller's coarse HTTP budget: the decision the RateLimit
    /// headers give (of the limit that refused, else of the enforced one with least left;
    /// `allowed` if every limit admitted it) and that limit. `None` only if nobody could decide:
    /// the coarse layer protects the server, so it then lets the request on to the finer limits
    /// behind it rather than refusing everyone.
    pub async fn admit_http(&self, caller: &Caller) -> Option<(Decision, RatePolicy)> {
        let under = |p| {
            let mut scopes = Vec::with_capacity(2);
            http_scopes(p, caller, 1, &mut scopes);
            scopes
        };
        let live = self.live.load_full();
        let layer = (Layer::Http, "POST /mcp");
        let decided = self.decide(&live, under, &[], Lease::new(), Fail::Open, layer).await?;
        let (scopes, decisions) = (&decided.scopes, decided.decisions());
        let refused = refused_by(scopes, decisions, (&self.metrics, &self.refusal_log), layer, self.at(caller));
        self.metrics.decision(Layer::Http, "POST /mcp", refused.is_none());
        // The headers speak of the limit that refused, else of the enforced one with least left.
        let (planned, decision) = match refused {
            Some((planned, d)) => {
                self.report_refusal(caller, layer, "rate_limited", (planned.scope.name(), d.retry_after));
                let record = Refused {
                    layer: Layer::Http,
                    tool: "POST /mcp",
                    code: "rate_limited",
                    scope: Some(planned.scope.name()),
                    limit: Some(d.limit),
                    remaining: Some(d.remaining),
                    retry_after_ms: Some(ceil_ms(d.retry_after)),
                    message: "Too many requests: answered 429 before any JSON was read.",
                };
                self.activity.refused(caller, record, self.clock.now());
                (planned, d)
            }
            None => scopes
                .iter()
                .zip(decisions)
                .filter(|(p, _)| p.limit.enforced_mode())
                .min_by_key(|(_, d)| d.remaining)
                .or_else(|| scopes.iter().zip(decisions).next())?,
        };
        let name = if planned.scope.name().starts_with("address_http:") { "address_http" } else { "http" };
        let decision = Decision { allowed: refused.is_none(), ..*decision };
        Some((decision, RatePolicy { limiter: planned.limit.limiter.clone(), name }))
    }

    /// Charges one `method` request to its group's limit (`tools/call` is charged by
    /// [`Guard::call`], together with the tool's budgets); a refusal is on the dashboard.
    pub async fn admit_method(&self, caller: &Caller, group: MethodGroup, method: &str) -> Result<(), Refusal> {
        let admitted = self.charge_method(caller, group, method).await;
        if let Err(refusal) = &admitted {
            self.activity.refused(caller, refusal.seen(Layer::Method, method), self.clock.now());
        }
        admitted
    }

    /// [`Guard::admit_method`], leaving a refusal for whoever answers with it to record: a proxied
    /// session opened for a tool call is refused by that call ([`Guard::call`] records it once).
    pub async fn charge_method(&self, caller: &Caller, group: MethodGroup, method: &str) -> Result<(), Refusal> {
        let live = self.live.load_full();
        if !live.enabled {
            return Ok(());
        }
        let layer = (Layer::Method, group.as_str());
        let under = |p| method_scopes(p, caller, group);
        let Some(decided) = self.decide(&live, under, &[], Lease::new(), Fail::Open, layer).await else {
            return Err(Refusal::limiter_unavailable(method, STORE_RETRY_MS));
        };
        let (scopes, decisions) = (&decided.scopes, decided.decisions());
        let refused = refused_by(scopes, decisions, (&self.metrics, &self.refusal_log), layer, self.at(caller));
        self.metrics.decision(Layer::Method, group.as_str(), refused.is_none());
        let Some((planned, d)) = refused else { return Ok(()) };
        let name = planned.scope.name();
        self.report_refusal(caller, layer, "rate_limited", (name, d.retry_after));
        let refusal = Refusal::rate_limited(method, name.to_owned(), d.limit, d.remaining, d.retry_after);
        let refusal = if scopes.len() > 1 { refusal.naming_limit(planned.limit.limiter.describe()) } else { refusal };
        Err(refusal)
    }

    /// Refuses a call that repeats the caller's recent calls in a loop, by this instance's
    /// detector; otherwise records it there.
    fn check_loop_locally(&self, loops: &Loops, caller: &Caller, call: &ToolCall<'_>) -> Result<Recorded, Refusal> {
        loops
            .check_locally(caller, call, self.clock.now())
            .map_err(|looping| self.refuse_loop(caller, call.tool, looping))
    }

    /// The refusal of a call an operator's block stopped, counted and logged like any other.
    fn refuse_blocked(&self, caller: &Caller, tool: &str, scope: &str, left: Nanos) -> Refusal {
        let refusal = Refusal::blocked(tool, scope.to_owned(), left);
        self.metrics.decision(Layer::Tool, tool, false);
        self.report_refusal(caller, (Layer::Tool, tool), refusal.code.as_str(), (scope, left));
        refusal
    }

    /// The shared store's refusals this instance remembers (to answer them without a round
    /// trip), for an operator who gives budget back to make it forget them.
    pub(crate) fn remembered_refusals(&self) -> Option<&refusal_memory::RefusalMemory> {
        self.insurance.as_ref().map(|insurance| &*insurance.refused)
    }

    /// The refusal of a call found in a loop, counted and reported.
    fn refuse_loop(&self, caller: &Caller, tool: &str, mut looping: Looping) -> Refusal {
        if let (Pattern::NoProgress, Some(loops)) = (looping.pattern, &self.loops) {
            // A stop is only ever made under the tool's own `no_progress` or the one a read has.
            looping.repeats = loops.answers_of(self.policy().tool(tool), true).0;
        }
        let refusal = Refusal::loop_detected(tool, &looping);
        self.metrics.decision(Layer::Tool, tool, false);
        self.metrics.loop_detected(tool);
        self.report_refusal(caller, (Layer::Tool, tool), refusal.code.as_str(), ("loop", looping.retry_after));
        refusal
    }

    /// Charges `caller` for `call` in every scope at once, or explains exactly how long to wait
    /// for the scope that refused. A loop is refused before anything is charged, and a call
    /// refused for budget does not count towards a loop. Over a shared store the loop is
    /// checked in the same step as the budgets (one round trip for both); this instance's
    /// detector checks it otherwise, and while the shared store cannot decide.
    async fn admit(&self, caller: &Caller, call: &ToolCall<'_>) -> Result<Admission, Refusal> {
        let live = self.live.load_full();
        if !live.enabled {
            return Ok(Admission::new(Vec::new(), self.metrics.clone()));
        }
        let loops = self.loops.as_ref().filter(|_| !call.loop_exempt && !call.resumed);
        let shared = loops.and_then(|loops| loops.shared_call(caller, call));
        let mut recorded = None;
        if let (Some(loops), None) = (loops, &shared) {
            recorded = Some(self.check_loop_locally(loops, caller, call)?);
        }
        let admitted = self.charge(&live, caller, call, shared.as_ref(), &mut recorded).await;
        if let (Err(_), Some(recorded), Some(loops)) = (&admitted, recorded, loops) {
            loops.forget(caller, recorded);
        }
        admitted
    }

    /// `Guard::admit`'s decision: `shared` is the call as the shared loop history checks it,
    /// if it does; a call this instance's detector records instead goes to `recorded`.
    async fn charge(
        &self,
        live: &LimitsInForce,
        caller: &Caller,
        call: &ToolCall<'_>,
        shared: Option<&SharedLoopCall>,
        recorded: &mut Option<Recorded>,
    ) -> Result<Admission, Refusal> {
        let (tool, starts_job) = (call.tool, call.starts_job);
        let fail = live.policy.tool(tool).map_or(Fail::Closed, |t| t.fail);
        let under = |p| match call.resumed {
            true => resumed_scopes(p, caller, starts_job),
            false => tool_scopes(p, caller, tool, Policy::price_of(p, tool, call.args), starts_job),
        };
        let lease = Lease::new();
        let blocks: Vec<Scope> =
            std::iter::once(Scope::block_caller(caller)).chain(Scope::block_tenant(caller)).collect();
        let block_keys: Vec<&str> = blocks.iter().map(Scope::key).collect();
        let layer = (Layer::Tool, tool);
        let looped = shared.map(SharedLoopCall::parts);
        let decided = match self.decide_on_store(live, &under, &block_keys, lease, looped, layer).await {
            Some(decided) => decided,
            None => {
                // The shared store could not decide, nor check the loop: this instance's
                // detector does, before the insurance limiter charges anything.
                if let (Some(_), Some(loops)) = (shared, &self.loops) {
                    *recorded = Some(self.check_loop_locally(loops, caller, call)?);
                }
                let insured = self.decide_insured(live, &under, lease, fail).await;
                insured.ok_or_else(|| Refusal::limiter_unavailable(tool, STORE_RETRY_MS))?
            }
        };
        match decided.verdict {
            Verdict::Looping { retry_after, pattern } => {
                let repeats = self.loops.as_ref().map_or(0, Loops::repeats);
                return Err(self.refuse_loop(caller, tool, Looping { retry_after, repeats, pattern }));
            }
            Verdict::Blocked { index, left } => {
                return Err(self.refuse_blocked(caller, tool, blocks.get(index).map_or("block", Scope::name), left));
            }
            Verdict::Decided(_) => {}
        }
        let (scopes, decisions) = (&decided.scopes, decided.decisions());
        // The call passes only when every enforced limit admits it, so the wait is the longest.
        let refused = refused_by(scopes, decisions, (&self.metrics, &self.refusal_log), layer, self.at(caller));
        self.metrics.decision(Layer::Tool, tool, refused.is_none());
        if let Some((planned, d)) = refused {
            let refusal = refusal_of(tool, planned, d, scopes);
            self.report_refusal(caller, layer, refusal.code.as_str(), (planned.scope.name(), d.retry_after));
            return Err(refusal);
        }
        // Levels the shared store holds can be read again later; the insurance limiter's are a share.
        let readable = Arc::ptr_eq(decided.store, &self.store);
        let levels = scopes.iter().zip(decisions).map(|(p, d)| Sample {
            name: p.scope.name(),
            decision: d,
            source: readable.then(|| (p.scope.key(), &p.limit.limiter)),
        });
        self.activity.admitted(caller, levels, self.clock.now());
        // Only the slots the decision took: a shadow cap that would have refused took none, and
        // a guard for it would give back someone else's slot (or renew a lease above the cap).
        let slots = scopes
            .iter()
            .zip(decisions)
            .filter(|(p, d)| p.limit.limiter.holds_slots() && d.allowed)
            .map(|(p, _)| {
                SlotGuard::new(decided.store.clone(), p.scope.key().to_owned(), p.limit.limiter.clone(), p.cost, lease)
            })
            .collect();
        let warnings = warnings_of(&live.policy, scopes, decisions);
        let reserved = self.reserved(live, caller, call, &decided);
        Ok(Admission::new(slots, self.metrics.clone()).warning(warnings).reserving(reserved))
    }

    /// What an admitted call reserved in the budgets that took its price, and where each charge
    /// landed, to settle later; `None` for a call that costs nothing.
    fn reserved(
        &self,
        live: &LimitsInForce,
        caller: &Caller,
        call: &ToolCall<'_>,
        decided: &admit::decide::VerdictOn<'_>,
    ) -> Option<Reserved> {
        let budgets: Vec<(String, Limiter, Taken)> = decided
            .scopes
            .iter()
            .zip(decided.decisions())
            .filter(|(p, d)| p.priced && p.cost > 0 && d.allowed && !p.limit.limiter.holds_slots())
            .map(|(p, d)| (p.scope.key().to_owned(), p.limit.limiter.clone(), d.taken()))
            .collect();
        let units = decided.scopes.iter().find(|p| p.priced).map_or(0, |p| p.cost);
        if units == 0 {
            return None;
        }
        let (tool, starts_job) = (call.tool, call.starts_job);
        let settle = live.policy.tool(tool).map_or(Settle::default(), |t| t.settle);
        // The memory of the shared store's refusals goes stale where a refund lands there.
        let shared = Arc::ptr_eq(decided.store, &self.store);
        let refusals = self.insurance.as_ref().filter(|_| shared).map(|i| i.refused.clone());
        // The budgets' limiters as the same call would have been planned under every limits put in
        // force since (a reload each).
        let (generations, charged_under) = (self.generations.clone(), live.generation);
        let (caller, tool_name) = (caller.clone(), tool.to_owned());
        let in_force: after::settle::InForce = Box::new(move || {
            let since = generations.since(charged_under)?;
            let plan = |limits: &LimitsInForce| {
                let policy = if shared { Some(&*limits.policy) } else { limits.insurance.as_ref() };
                let scopes = policy.map(|p| tool_scopes(p, &caller, &tool_name, units, starts_job)).unwrap_or_default();
                scopes.into_iter().map(|p| (p.scope.key().to_owned(), p.limit.limiter.clone())).collect()
            };
            Some(since.iter().map(|limits| plan(limits)).collect())
        });
        Some(Reserved::new(
            (tool, units, settle),
            (decided.store.clone(), self.clock.clone()),
            (budgets, in_force),
            self.metrics.clone(),
            refusals,
        ))
    }

    /// Hears the answer `caller`'s call of `tool` with `args` got (`said`: what it says,
    /// [`Answer::outcome`](call::Answer::outcome)), for loop detection: an answer that changed makes the call's earlier
    /// repetitions stop counting; the same answer again and again from one tool that `reads_only`
    /// (or says its own `no_progress`) stops it. Returns the warning the answer must carry, if it
    /// is one short of the stop or makes it.
    async fn heard(
        &self,
        caller: &Caller,
        (tool, args): (&str, &serde_json::Value),
        said: &serde_json::Value,
        reads_only: bool,
    ) -> Option<NoProgress> {
        let loops = self.loops.as_ref()?;
        if !self.live.load().enabled {
            return None;
        }
        let policy = self.policy();
        let (no_progress, volatile) = loops.answers_of(policy.tool(tool), reads_only);
        let streaked = loops.answered(caller, (tool, args), (said, volatile), no_progress, self.clock.now()).await;
        NoProgress::of(tool, streaked, no_progress)
    }

    /// The caller's bucket and the time, for the report stage.
    fn at(&self, caller: &Caller) -> (u8, Nanos) {
        (caller.bucket(), self.clock.now())
    }

    /// The caller's budgets right now, without spending anything: the HTTP budget (when it
    /// applies), the `tools/call` method budget, the caller's and tenant's tool budgets, and
    /// every tool's own budget. `tool` is the tool that asks (the reference server's
    /// `rate_limit_status`), as the metrics name the read.
    pub async fn status(&self, caller: &Caller, over_http: bool, tool: &str) -> Option<Vec<BudgetStatus>> {
        let under = |policy| status_scopes(policy, caller, over_http);
        // Cost 0 reads every level in one decision, without charging anything.
        let live = self.live.load_full();
        let layer = (Layer::Tool, tool);
        let decided = self.decide(&live, under, &[], Lease::new(), Fail::Open, layer).await?;
        Some(
            decided
                .scopes
                .iter()
                .zip(decided.decisions())
                .map(|(p, d)| BudgetStatus {
                    held_here: decided.store.slice_of(p.scope.key(), &p.limit.limiter),
                    ..budget_status(&live.policy, &p.scope, p.limit, d)
                })
                .collect(),
        )
    }

    /// Reads the shown budgets' levels as they are now, without spending anything: a slot a
    /// finished job gave back, or a budget refilled since its last call, shows at once. One
    /// read per scope (each may live on its own Redis Cluster node), all at once; a scope the
    /// store cannot read now keeps the level its last sampled call left, marked not current.
    pub async fn current_levels(&self, scopes: &mut [ScopeLevel]) {
        let reads = scopes.iter().map(|shown| async move {
            let source = shown.source.as_ref()?;
            let check = Check { key: &source.key, limiter: &source.limiter, cost: 0, shadow: false };
            self.store.decide_all(&[check], Lease::new()).await.ok()?.pop()
        });
        let read = futures::future::join_all(reads).await;
        for (shown, now) in scopes.iter_mut().zip(read) {
            if let Some(d) = now {
                (shown.limit, shown.remaining, shown.current) = (d.limit, d.remaining, true);
            }
        }
    }

    /// Forgets idle limiter state and loop histories; called on a schedule.
    pub fn sweep(&self) -> usize {
        let now = self.clock.now();
        let refusals = self.insurance.as_ref().map_or(0, |i| i.refused.sweep(now));
        self.store.sweep() + refusals + self.loops.as_ref().map_or(0, |loops| loops.sweep(now))
    }
}

/// The refusal of a `tool` call the limit `planned` refused with `d`: `busy` for a slot cap,
/// `rate_limited` with the wait otherwise (naming the limit when its scope has several).
fn refusal_of(tool: &str, planned: &Planned<'_>, d: &Decision, scopes: &[Planned<'_>]) -> Refusal {
    let (scope, limit) = (&planned.scope, planned.limit);
    let name = scope.name().to_owned();
    if limit.limiter.holds_slots() {
        return Refusal::busy(tool, name, d.limit);
    }
    let refusal = Refusal::rate_limited(tool, name, d.limit, d.remaining, d.retry_after);
    // Of several limits on one scope, say which refused.
    let several = !limit.suffix.is_empty()
        || scopes.iter().any(|p| {
            !p.limit.suffix.is_empty() && p.scope.key().strip_suffix(p.limit.suffix.as_str()) == Some(scope.key())
        });
    if several { refusal.naming_limit(limit.limiter.describe()) } else { refusal }
}
