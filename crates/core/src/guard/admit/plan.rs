//! The first stage of every decision: which limits a request draws on, under which scope, at
//! what cost — the plan the store then decides all at once.
//!
//! A `POST /mcp` draws on the caller's HTTP limit (and its address's, for an unverified caller);
//! a `tools/call` on its method limit, its tool budget, its tenant's, its address's, its OAuth
//! client's, the spend cap, the tool's own budget and, for a job, the in-flight caps. `rate_limit_status` reads all of
//! them at cost 0. Nothing here touches a store.

use crate::config::Limit;
use crate::guard::policy::{MethodGroup, Policy};
use crate::guard::scope::Scope;
use crate::identity::Caller;
use crate::store::Check;

/// One limit a decision takes: the scope (with the limit's suffix), the limit, and the cost.
#[derive(Debug, Clone)]
pub struct Planned<'p> {
    /// Where its state lives and what agents call it.
    pub scope: Scope,
    /// The limit in force.
    pub limit: &'p Limit,
    /// Units this request costs in it (0: only read its level).
    pub cost: u64,
    /// Whether it is charged the call's price (a budget in cost units, settled once the upstream
    /// says what the call used), rather than one per call or a slot.
    pub priced: bool,
}

/// Adds `scope`'s `limits` at `cost`: the first under the scope itself, each other one under the
/// scope with its suffix.
pub(crate) fn plan<'p>(out: &mut Vec<Planned<'p>>, scope: Scope, limits: &'p [Limit], cost: u64) {
    for limit in limits {
        let scope = if limit.suffix.is_empty() { scope.clone() } else { scope.for_limit(&limit.suffix) };
        out.push(Planned { scope, limit, cost, priced: false });
    }
}

/// The in-flight caps a job holds: the caller's, its tenant's, and for an unverified caller its
/// address's.
pub(crate) fn in_flight_scopes<'p>(policy: &'p Policy, caller: &Caller, cost: u64, out: &mut Vec<Planned<'p>>) {
    out.push(Planned { scope: Scope::in_flight_caller(caller), limit: &policy.in_flight_caller, cost, priced: false });
    if let Some(scope) = Scope::in_flight_tenant(caller) {
        out.push(Planned { scope, limit: &policy.in_flight_tenant, cost, priced: false });
    }
    if let Some(scope) = Scope::in_flight_address(caller) {
        out.push(Planned { scope, limit: &policy.in_flight_address, cost, priced: false });
    }
}

/// The coarse HTTP scopes of one request: the caller's, and for an unverified caller its
/// address's.
pub(crate) fn http_scopes<'p>(policy: &'p Policy, caller: &Caller, cost: u64, out: &mut Vec<Planned<'p>>) {
    plan(out, Scope::http(caller), &policy.for_caller(caller).http, cost);
    if let Some(address) = Scope::address_http(caller) {
        plan(out, address, &policy.address_http, cost);
    }
}

/// The scope of one JSON-RPC method group for `caller` (`tools/list`, `ping` …).
pub(crate) fn method_scopes<'p>(policy: &'p Policy, caller: &Caller, group: MethodGroup) -> Vec<Planned<'p>> {
    let mut scopes = Vec::with_capacity(1);
    plan(&mut scopes, Scope::method(caller, group), policy.for_caller(caller).method(group), 1);
    scopes
}

/// The scopes a call of `tool` by `caller` that costs `cost` (its price: [`Policy::price_of`])
/// draws on under `policy`, with their limits and costs.
pub(crate) fn tool_scopes<'p>(
    policy: &'p Policy,
    caller: &Caller,
    tool: &str,
    cost: u64,
    starts_job: bool,
) -> Vec<Planned<'p>> {
    let tier = policy.for_caller(caller);
    let mut scopes = Vec::with_capacity(8);
    plan(&mut scopes, Scope::method(caller, MethodGroup::ToolsCall), &tier.tools_call, 1);
    if cost > 0 {
        let first = scopes.len();
        plan(&mut scopes, Scope::caller(caller), policy.caller_budget(caller), cost);
        if let (Some(scope), Some(tenant)) = (Scope::tenant(caller), caller.tenant()) {
            plan(&mut scopes, scope, policy.tenant_budget(tenant), cost);
        }
        if let Some(address) = Scope::address(caller) {
            plan(&mut scopes, address, &policy.address, cost);
        }
        if let Some(client) = Scope::client(caller) {
            plan(&mut scopes, client, &policy.client, cost);
        }
        if let Some(cap) = policy.spend_cap(caller.tenant()) {
            scopes.push(Planned { scope: Scope::spend(caller), limit: cap, cost, priced: false });
        }
        for priced in &mut scopes[first..] {
            priced.priced = true;
        }
    }
    if let Some(tool_policy) = policy.tool(tool) {
        plan(&mut scopes, Scope::tool(caller, tool), &tool_policy.budget, 1);
    }
    if starts_job {
        in_flight_scopes(policy, caller, 1, &mut scopes);
    }
    scopes
}

/// The scopes a call that resumes one answered "input required" draws on ([`crate::guard::after::resume`]):
/// its method limit (it is a request), and for a `holds_slot` tool the in-flight caps while it
/// runs; not its price, which the first round paid, nor its tool's budget (it is the same call).
pub(crate) fn resumed_scopes<'p>(policy: &'p Policy, caller: &Caller, starts_job: bool) -> Vec<Planned<'p>> {
    let mut scopes = Vec::with_capacity(4);
    plan(&mut scopes, Scope::method(caller, MethodGroup::ToolsCall), &policy.for_caller(caller).tools_call, 1);
    if starts_job {
        in_flight_scopes(policy, caller, 1, &mut scopes);
    }
    scopes
}

/// What `rate_limit_status` reads for `caller` (every limit, at cost 0), plus the HTTP scopes
/// when the caller comes over HTTP.
pub(crate) fn status_scopes<'p>(policy: &'p Policy, caller: &Caller, over_http: bool) -> Vec<Planned<'p>> {
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
    if let Some(client) = Scope::client(caller) {
        plan(&mut peek, client, &policy.client, 0);
    }
    if let Some(cap) = policy.spend_cap(caller.tenant()) {
        peek.push(Planned { scope: Scope::spend(caller), limit: cap, cost: 0, priced: true });
    }
    for (tool, tool_policy) in &policy.tools {
        plan(&mut peek, Scope::tool(caller, tool), &tool_policy.budget, 0);
    }
    in_flight_scopes(policy, caller, 0, &mut peek);
    peek
}

/// The checks a store decides for `scopes`.
pub(crate) fn checks_of<'a>(scopes: &'a [Planned<'a>]) -> Vec<Check<'a>> {
    scopes
        .iter()
        .map(|p| Check {
            key: p.scope.key(),
            limiter: &p.limit.limiter,
            cost: p.cost,
            shadow: !p.limit.enforced_mode(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Catalogue, LimitsConfig};
    use crate::identity::{Identifier, Identity};

    fn names(scopes: &[Planned<'_>]) -> Vec<String> {
        scopes.iter().map(|p| p.scope.name().to_owned()).collect()
    }

    fn policy(search_cost: u64, toml: &str) -> (Policy, Identifier) {
        let tools = Catalogue::new().tool("search").job("render");
        let toml = format!("[tools.search]\ncost = {search_cost}\n[tools.render]\ncost = 5\n{toml}");
        let config = LimitsConfig::from_toml(&toml, &tools).expect("config");
        (Policy::new(&config), Identifier::new(&config))
    }

    #[test]
    fn an_unverified_caller_draws_on_its_address_beside_its_own_budget_and_a_key_does_not() {
        let (policy, identifier) = policy(2, "[[auth.keys]]\nkey = \"k\"\ntenant = \"acme\"\n");
        let mut headers = http::HeaderMap::new();
        headers.insert("x-api-key", "made-up".parse().expect("header"));
        let made_up = identifier
            .identify(&headers, Some("203.0.113.7".parse().expect("ip")))
            .map(Identity::without_verifying)
            .expect("caller");
        let scopes = names(&tool_scopes(&policy, &made_up, "render", 5, true));
        for expected in ["address:ip:203.0.113.7", "in_flight:address:ip:203.0.113.7"] {
            assert!(scopes.iter().any(|s| s == expected), "{expected} in {scopes:?}");
        }
        headers.insert("x-api-key", "k".parse().expect("header"));
        let keyed = identifier
            .identify(&headers, Some("203.0.113.7".parse().expect("ip")))
            .map(Identity::without_verifying)
            .expect("caller");
        let scopes = names(&tool_scopes(&policy, &keyed, "render", 5, true));
        assert!(scopes.iter().all(|s| !s.contains("address")), "{scopes:?}");
        assert!(scopes.iter().any(|s| s == "tenant:acme") && scopes.iter().any(|s| s == "in_flight:tenant:acme"));
    }

    #[test]
    fn a_free_call_draws_only_on_its_method_and_a_job_takes_its_slots_at_one_each() {
        let (policy, identifier) = policy(0, "");
        let caller = identifier.local();
        let free = tool_scopes(&policy, &caller, "search", 0, false);
        assert_eq!(names(&free), vec!["method:tools/call:local"]);
        let job = tool_scopes(&policy, &caller, "render", 5, true);
        let slots: Vec<u64> = job.iter().filter(|p| p.limit.limiter.holds_slots()).map(|p| p.cost).collect();
        assert_eq!(slots, vec![1], "one slot of the caller's cap; stdio has no tenant and no address");
        let budget = job.iter().find(|p| p.scope.name() == "caller:local").expect("the caller's budget");
        assert_eq!(budget.cost, 5, "its cost in tokens");
    }
}
