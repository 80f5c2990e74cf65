//! Which limiter applies to which scope, resolved once from config.
//!
//! Tiers scale a caller's own scopes (`http`, `method`, `caller`); the scaled limiters are
//! built at start-up so the hot path only looks them up.

use std::collections::BTreeMap;

use crate::config::{Config, ToolPolicy};
use crate::identity::Caller;
use crate::limit::Limiter;

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
    /// The method name as it appears in scopes and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            MethodGroup::ToolsList => "tools/list",
            MethodGroup::ToolsCall => "tools/call",
            MethodGroup::Other => "other",
        }
    }
}

/// The per-caller limiters of one tier.
#[derive(Debug, Clone)]
pub struct TierLimits {
    /// `limits.http`, scaled.
    pub http: Limiter,
    /// `limits.method.tools_list`, scaled.
    pub tools_list: Limiter,
    /// `limits.method.tools_call`, scaled.
    pub tools_call: Limiter,
    /// `limits.method.other`, scaled.
    pub other_methods: Limiter,
    /// `limits.caller`, scaled.
    pub caller: Limiter,
}

impl TierLimits {
    /// The limiter of a method group.
    pub fn method(&self, group: MethodGroup) -> &Limiter {
        match group {
            MethodGroup::ToolsList => &self.tools_list,
            MethodGroup::ToolsCall => &self.tools_call,
            MethodGroup::Other => &self.other_methods,
        }
    }
}

/// Every limiter, by scope and tier.
#[derive(Debug, Clone)]
pub struct Policy {
    tiers: BTreeMap<String, TierLimits>,
    fallback: TierLimits,
    /// The shared budget of a tenant.
    pub tenant: Limiter,
    /// The shared budget of unverified callers from one address.
    pub address: Limiter,
    /// Jobs one caller may have in flight.
    pub in_flight_caller: Limiter,
    /// Jobs one tenant may have in flight.
    pub in_flight_tenant: Limiter,
    /// Cost and own budget of each tool.
    pub tools: BTreeMap<String, ToolPolicy>,
}

impl Policy {
    /// Resolves `config` into per-tier limiters.
    pub fn new(config: &Config) -> Self {
        let l = &config.limits;
        let scale = |factor: f64| TierLimits {
            http: l.http.scaled(factor),
            tools_list: l.tools_list.scaled(factor),
            tools_call: l.tools_call.scaled(factor),
            other_methods: l.other_methods.scaled(factor),
            caller: l.caller.scaled(factor),
        };
        let tiers = config.tiers.iter().map(|(name, factor)| (name.clone(), scale(*factor))).collect();
        Self {
            tiers,
            fallback: scale(1.0),
            tenant: l.tenant.clone(),
            address: l.address.clone(),
            in_flight_caller: l.in_flight_caller.clone(),
            in_flight_tenant: l.in_flight_tenant.clone(),
            tools: config.tools.clone(),
        }
    }

    /// These limits with every capacity and rate multiplied by `factor` (the insurance limiter's
    /// share of a budget shared by several instances); costs stay as they are.
    pub fn scaled(&self, factor: f64) -> Policy {
        let tier = |t: &TierLimits| TierLimits {
            http: t.http.scaled(factor),
            tools_list: t.tools_list.scaled(factor),
            tools_call: t.tools_call.scaled(factor),
            other_methods: t.other_methods.scaled(factor),
            caller: t.caller.scaled(factor),
        };
        let mut tools = self.tools.clone();
        for policy in tools.values_mut() {
            policy.budget = policy.budget.as_ref().map(|b| b.scaled(factor));
        }
        Policy {
            tiers: self.tiers.iter().map(|(name, t)| (name.clone(), tier(t))).collect(),
            fallback: tier(&self.fallback),
            tenant: self.tenant.scaled(factor),
            address: self.address.scaled(factor),
            in_flight_caller: self.in_flight_caller.scaled(factor),
            in_flight_tenant: self.in_flight_tenant.scaled(factor),
            tools,
        }
    }

    /// The limiters for `caller`'s tier (validated at start-up, so always a configured one).
    pub fn for_caller(&self, caller: &Caller) -> &TierLimits {
        self.tiers.get(caller.tier()).unwrap_or(&self.fallback)
    }

    /// What `tool` costs.
    pub fn cost_of(&self, tool: &str) -> u64 {
        self.tools.get(tool).map_or(0, |t| t.cost)
    }
}
