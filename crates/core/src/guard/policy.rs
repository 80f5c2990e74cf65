//! Which limiter applies to which scope, resolved once from config.
//!
//! Tiers scale a caller's own scopes (`http`, `method`, `caller`); the scaled limits are built at
//! start-up so the hot path only looks them up. A scope may have several limits. A key may have
//! its own caller budget, and a tenant its own shared budget and spend cap.

use std::collections::{BTreeMap, HashMap};

use crate::config::{Limit, LimitsConfig, ToolPolicy};
use crate::identity::{Caller, CallerIds};
use crate::limit::{FixedWindow, Limiter};

/// A JSON-RPC method group with its own per-caller limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MethodGroup {
    /// `tools/list`.
    ToolsList,
    /// `tools/call`.
    ToolsCall,
    /// Everything else a client may send after set-up (`ping`, …).
    Other,
}

impl MethodGroup {
    /// The group of a method other than a tool call: `tools/list`'s own, else the rest's.
    pub fn of(method: &str) -> Self {
        match method {
            "tools/list" => MethodGroup::ToolsList,
            "tools/call" => MethodGroup::ToolsCall,
            _ => MethodGroup::Other,
        }
    }

    /// The method name as it appears in scopes and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            MethodGroup::ToolsList => "tools/list",
            MethodGroup::ToolsCall => "tools/call",
            MethodGroup::Other => "other",
        }
    }
}

/// The per-caller limits of one tier.
#[derive(Debug, Clone)]
pub struct TierLimits {
    /// `limits.http`, scaled.
    pub http: Vec<Limit>,
    /// `limits.method.tools_list`, scaled.
    pub tools_list: Vec<Limit>,
    /// `limits.method.tools_call`, scaled.
    pub tools_call: Vec<Limit>,
    /// `limits.method.other`, scaled.
    pub other_methods: Vec<Limit>,
    /// `limits.caller`, scaled.
    pub caller: Vec<Limit>,
}

impl TierLimits {
    /// The limits of a method group.
    pub fn method(&self, group: MethodGroup) -> &[Limit] {
        match group {
            MethodGroup::ToolsList => &self.tools_list,
            MethodGroup::ToolsCall => &self.tools_call,
            MethodGroup::Other => &self.other_methods,
        }
    }

    fn scaled(&self, factor: f64) -> Self {
        Self {
            http: scaled(&self.http, factor),
            tools_list: scaled(&self.tools_list, factor),
            tools_call: scaled(&self.tools_call, factor),
            other_methods: scaled(&self.other_methods, factor),
            caller: scaled(&self.caller, factor),
        }
    }
}

fn scaled(limits: &[Limit], factor: f64) -> Vec<Limit> {
    limits.iter().map(|l| l.scaled(factor)).collect()
}

/// A day, the window of spend caps: a fixed window of a day is the UTC calendar day.
const DAY: crate::clock::Nanos = crate::clock::Nanos::from_secs(86_400);

/// Every limit, by scope and tier, with the per-key and per-tenant overrides.
#[derive(Debug, Clone)]
pub struct Policy {
    tiers: BTreeMap<String, TierLimits>,
    /// Each tier's factor, also its weight in the upstream account's fair queue.
    factors: BTreeMap<String, f64>,
    fallback: TierLimits,
    tenant: Vec<Limit>,
    /// The shared budget of unverified callers from one address.
    pub address: Vec<Limit>,
    /// The coarse HTTP limit unverified callers from one address share.
    pub address_http: Vec<Limit>,
    /// The budget all subjects of one OAuth client share.
    pub client: Vec<Limit>,
    /// Jobs one caller may have in flight.
    pub in_flight_caller: Limit,
    /// Jobs one tenant may have in flight.
    pub in_flight_tenant: Limit,
    /// Jobs the unverified callers of one address may have in flight together.
    pub in_flight_address: Limit,
    /// Price of one cost unit and its currency, to show spend in money (`None`: units only).
    pub price: Option<(f64, String)>,
    /// Cost and own budget of each tool.
    pub tools: BTreeMap<String, ToolPolicy>,
    /// The policy of a tool `tools` does not name, for tools learnt at run time.
    unlisted_tools: Option<ToolPolicy>,
    /// Keys with a caller budget of their own, by caller id.
    key_budgets: HashMap<String, Vec<Limit>>,
    /// Tenants with a shared budget of their own.
    tenant_budgets: HashMap<String, Vec<Limit>>,
    /// The daily spend cap of tenants without their own.
    spend_cap: Option<Limit>,
    /// Tenants with a spend cap of their own (`None`: uncapped).
    tenant_caps: HashMap<String, Option<Limit>>,
}

impl Policy {
    /// Resolves `config` into per-tier limits.
    pub fn new(config: &LimitsConfig) -> Self {
        let l = &config.limits;
        let base = TierLimits {
            http: l.http.clone(),
            tools_list: l.tools_list.clone(),
            tools_call: l.tools_call.clone(),
            other_methods: l.other_methods.clone(),
            caller: l.caller.clone(),
        };
        let tiers = config.tiers.iter().map(|(name, factor)| (name.clone(), base.scaled(*factor))).collect();
        // Keyed by caller id, as the identifier names the key's callers.
        let ids = CallerIds::of(config);
        let caps = &config.spend_caps;
        let cap = |units: u64| Limit {
            limiter: Limiter::FixedWindow(FixedWindow::new(units, DAY)),
            mode: crate::config::Mode::Enforce,
            warn_at_percent: Some(caps.warn_at_percent),
            suffix: String::new(),
        };
        Self {
            tiers,
            factors: config.tiers.clone(),
            fallback: base,
            tenant: l.tenant.clone(),
            address: l.address.clone(),
            address_http: l.address_http.clone(),
            client: l.client.clone(),
            in_flight_caller: Limit::enforced(l.in_flight_caller.clone()),
            in_flight_tenant: Limit::enforced(l.in_flight_tenant.clone()),
            in_flight_address: Limit::enforced(l.in_flight_address.clone()),
            price: (caps.price_per_unit > 0.0).then(|| (caps.price_per_unit, caps.currency.clone())),
            tools: config.tools.clone(),
            unlisted_tools: config.unlisted_tools.clone(),
            key_budgets: config
                .auth
                .keys
                .iter()
                .filter_map(|k| Some((ids.id_of_digest(&k.sha256), k.caller.clone()?)))
                .collect(),
            tenant_budgets: config.tenants.iter().filter_map(|(t, o)| Some((t.clone(), o.budget.clone()?))).collect(),
            spend_cap: caps.daily_units.map(cap),
            tenant_caps: config
                .tenants
                .iter()
                .filter(|(_, o)| o.daily_spend_units.is_some())
                .map(|(t, o)| (t.clone(), o.daily_spend_units.map(cap)))
                .collect(),
        }
    }

    /// These limits with every capacity and rate multiplied by `factor` (the insurance limiter's
    /// share of a budget shared by several instances); costs stay as they are.
    pub fn scaled(&self, factor: f64) -> Policy {
        let mut tools = self.tools.clone();
        for policy in tools.values_mut() {
            policy.budget = scaled(&policy.budget, factor);
        }
        let each =
            |map: &HashMap<String, Vec<Limit>>| map.iter().map(|(k, v)| (k.clone(), scaled(v, factor))).collect();
        Policy {
            tiers: self.tiers.iter().map(|(name, t)| (name.clone(), t.scaled(factor))).collect(),
            factors: self.factors.clone(),
            fallback: self.fallback.scaled(factor),
            tenant: scaled(&self.tenant, factor),
            address: scaled(&self.address, factor),
            address_http: scaled(&self.address_http, factor),
            client: scaled(&self.client, factor),
            in_flight_caller: self.in_flight_caller.scaled(factor),
            in_flight_tenant: self.in_flight_tenant.scaled(factor),
            in_flight_address: self.in_flight_address.scaled(factor),
            price: self.price.clone(),
            tools,
            unlisted_tools: self.unlisted_tools.clone(),
            key_budgets: each(&self.key_budgets),
            tenant_budgets: each(&self.tenant_budgets),
            spend_cap: self.spend_cap.as_ref().map(|c| c.scaled(factor)),
            tenant_caps: self
                .tenant_caps
                .iter()
                .map(|(t, c)| (t.clone(), c.as_ref().map(|c| c.scaled(factor))))
                .collect(),
        }
    }

    /// The limits for `caller`'s tier (validated at start-up, so always a configured one).
    pub fn for_caller(&self, caller: &Caller) -> &TierLimits {
        self.tiers.get(caller.tier()).unwrap_or(&self.fallback)
    }

    /// The factor of `caller`'s tier (1 for an unknown one).
    pub fn factor_of(&self, caller: &Caller) -> f64 {
        self.factors.get(caller.tier()).copied().unwrap_or(1.0)
    }

    /// The caller's own tool budget: its key's, or its tier's.
    pub fn caller_budget(&self, caller: &Caller) -> &[Limit] {
        if !self.key_budgets.is_empty()
            && let Some(own) = self.key_budgets.get(caller.id())
        {
            return own;
        }
        &self.for_caller(caller).caller
    }

    /// The budget `tenant` shares: its own, or `limits.tenant`.
    pub fn tenant_budget(&self, tenant: &str) -> &[Limit] {
        self.tenant_budgets.get(tenant).map_or(&self.tenant, Vec::as_slice)
    }

    /// The daily spend cap of `tenant` (`None`: a caller without one, capped as its own tenant).
    pub fn spend_cap(&self, tenant: Option<&str>) -> Option<&Limit> {
        match tenant.and_then(|t| self.tenant_caps.get(t)) {
            Some(own) => own.as_ref(),
            None => self.spend_cap.as_ref(),
        }
    }

    /// The policy of `tool`: its `[tools.NAME]`, else — for tools learnt at run time — the
    /// default (`proxy.default_cost`).
    pub fn tool(&self, tool: &str) -> Option<&ToolPolicy> {
        self.tools.get(tool).or(self.unlisted_tools.as_ref())
    }

    /// The most a call of `tool` costs: its fixed cost, or its formula's `cost_max`.
    pub fn cost_of(&self, tool: &str) -> u64 {
        self.tool(tool).map_or(0, |t| t.cost)
    }

    /// What a call of `tool` with `args` reserves: its formula's price for them (held to
    /// `cost_max`), else its fixed cost.
    pub fn price_of(&self, tool: &str, args: &serde_json::Value) -> u64 {
        match self.tool(tool) {
            Some(ToolPolicy { formula: Some(formula), cost, cost_min, .. }) => formula.units(args, (*cost_min, *cost)),
            Some(policy) => policy.cost,
            None => 0,
        }
    }

    /// Whether a call of `tool` holds an in-flight slot until it returns (or its job is final).
    pub fn holds_slot(&self, tool: &str) -> bool {
        self.tool(tool).is_some_and(|t| t.holds_slot)
    }
}
