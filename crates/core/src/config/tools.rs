//! `[tools.NAME]`: what each tool costs, its own budget, and whether it fails open or closed while
//! a shared store cannot decide; and the checks that every cost can be paid from every budget it
//! draws on, after tiers and insurance shares.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::limits::{DAY_MS, Limit, Limits, RawScope};
use super::price::{Formula, Settle};
use super::{Catalogue, ConfigError, invalid};
use crate::limit::Limiter;

/// What a refusal of `proxy.default_cost` calls the tools it prices.
pub(super) const UNPRICED: &str = "an unpriced tool";

/// `[tools.NAME]`.
#[derive(Debug, Clone)]
pub struct ToolPolicy {
    /// Units a call reserves in the caller's, tenant's and address's budgets and the spend cap:
    /// the fixed cost, or the most its [`ToolPolicy::formula`] may ask (`cost_max`). Every check
    /// that a cost fits a budget reads this.
    pub cost: u64,
    /// The price over the call's arguments (`cost = "…"`), held to `[cost_min, cost]`; `None`:
    /// `cost` itself.
    pub formula: Option<Formula>,
    /// The least a call priced by its formula reserves (`cost_min`, 1 unless set).
    pub cost_min: u64,
    /// What a call is charged in the end: what the upstream reports it used, or the reservation.
    pub settle: Settle,
    /// An own budget for this tool, per tenant (or per caller without one), counted in calls
    /// (empty: none).
    pub budget: Vec<Limit>,
    /// What the tool does while the shared limiter store cannot decide.
    pub fail: Fail,
    /// Whether a call holds one slot of the caller's, tenant's and address's in-flight caps
    /// (`limits.in_flight`) until it returns — or, for a job, until the job is final.
    pub holds_slot: bool,
    /// Within which scope identical calls in flight share one upstream request (`coalesce`).
    pub coalesce: Coalesce,
    /// How long a successful answer is reused for identical calls in the same scope
    /// (`cache_ttl_ms`; 0: never).
    pub cache_ttl_ms: u64,
    /// The tool's own `no_progress` (0: its answers are not compared), instead of
    /// `[loop_detection] no_progress`.
    pub no_progress: Option<u32>,
    /// The tool's own `volatile_fields`, instead of `[loop_detection] volatile_fields`.
    pub volatile_fields: Option<Vec<String>>,
}

/// `[tools.NAME] coalesce`: whose identical calls may share one upstream request (and, with
/// `cache_ttl_ms`, one cached answer). Never wider than the scope named: one tenant's answer
/// never reaches another tenant, nor (with `caller`) another caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Coalesce {
    /// Every call is its own request; a cache, if any, is per caller.
    #[default]
    Off,
    /// The identical calls of one caller.
    Caller,
    /// The identical calls of one tenant's callers (a caller without a tenant is its own).
    Tenant,
}

impl ToolPolicy {
    /// The policy of a tool `[tools]` does not name, in a catalogue learnt at run time: it costs
    /// `cost`, settles at that price whatever its answer says, has no budget of its own, fails
    /// closed if it costs, and holds no slot.
    pub fn unlisted(cost: u64) -> Self {
        Self {
            cost,
            formula: None,
            cost_min: 0,
            settle: Settle::Reserved,
            budget: Vec::new(),
            fail: Fail::default_for(cost),
            holds_slot: false,
            coalesce: Coalesce::Off,
            cache_ttl_ms: 0,
            no_progress: None,
            volatile_fields: None,
        }
    }
}

/// What a tool does while the shared limiter store (Redis) cannot decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fail {
    /// Decide with the in-memory insurance limiter (per-instance limits ÷ expected instances).
    Open,
    /// Refuse with `limiter_unavailable` and a wait.
    Closed,
}

impl Fail {
    /// What a tool that says nothing does: fail closed if it may cost, open if it is free.
    pub fn default_for(cost: u64) -> Self {
        if cost > 0 { Fail::Closed } else { Fail::Open }
    }
}

/// `cost` as written: units, or a formula over the arguments.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawCost {
    Units(i64),
    Formula(String),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTool {
    cost: RawCost,
    cost_max: Option<i64>,
    cost_min: Option<i64>,
    settle: Option<Settle>,
    budget: Option<RawScope>,
    fail: Option<Fail>,
    holds_slot: Option<bool>,
    coalesce: Option<Coalesce>,
    cache_ttl_ms: Option<i64>,
    no_progress: Option<u32>,
    volatile_fields: Option<Vec<String>>,
}

/// An answer may be shared (`coalesce`, `cache_ttl_ms`) only when it is the same for everyone who
/// asks the same.
fn may_share(tool: &str, coalesce: Coalesce, cache_ttl_ms: u64, catalogue: &Catalogue) -> Result<(), ConfigError> {
    let shares = if coalesce != Coalesce::Off {
        Some("coalesce")
    } else if cache_ttl_ms > 0 {
        Some("cache_ttl_ms")
    } else {
        None
    };
    if let Some(name) = shares {
        // A `holds_slot` tool may share: each waiting call holds its own slot until the answer.
        let why = if catalogue.holds_slots(tool) {
            Some("starts a job: each call is its own (a job has its own id)")
        } else if catalogue.answers_for_the_caller(tool) {
            Some("answers with the caller's own state (its jobs, its budgets), which no other caller may see")
        } else {
            None
        };
        if let Some(why) = why {
            return Err(invalid(format!("tools.{tool}.{name}"), format!("`{tool}` {why}; leave it out")));
        }
    }
    Ok(())
}

/// `[tools.*]`, checked against the server's `catalogue` (every tool there has a cost, and no
/// other is priced — unless the catalogue is learnt at run time, whose tools come and go) and
/// against the budgets each cost is drawn from, under every tier.
pub(super) fn validate_tools(
    raw: BTreeMap<String, RawTool>,
    catalogue: &Catalogue,
    limits: &Limits,
    tiers: &BTreeMap<String, f64>,
) -> Result<BTreeMap<String, ToolPolicy>, ConfigError> {
    let mut tools = BTreeMap::new();
    for (tool, spec) in raw {
        if !catalogue.contains(&tool) && !catalogue.is_learned() {
            return Err(invalid(
                format!("tools.{tool}"),
                format!("unknown tool `{tool}`; the tools are {}", catalogue.listed()),
            ));
        }
        let (cost, formula) = price_of(&tool, &spec.cost, spec.cost_max, catalogue)?;
        let cost_min = match spec.cost_min.map(u64::try_from) {
            None => 1,
            Some(Ok(least)) if formula.is_none() || least <= cost => least,
            Some(_) => {
                let key = format!("tools.{tool}.cost_min");
                return Err(invalid(key, format!("the least a priced call reserves: 0 to cost_max ({cost})")));
            }
        };
        cost_fits_the_scopes(&tool, cost, limits, tiers)?;
        let budget = match spec.budget {
            Some(budget) => budget.build(&format!("tools.{tool}.budget"))?,
            None => Vec::new(),
        };
        // config.toml says `open` for list_articles, a cheap read.
        let fail = spec.fail.unwrap_or(Fail::default_for(cost));
        let holds_slot = match spec.holds_slot {
            Some(false) if catalogue.holds_slots(&tool) => {
                return Err(invalid(
                    format!("tools.{tool}.holds_slot"),
                    format!("`{tool}` starts a job, which holds its slot until it is final; leave it out or set true"),
                ));
            }
            Some(holds) => holds,
            None => catalogue.holds_slots(&tool),
        };
        let coalesce = spec.coalesce.unwrap_or_default();
        let cache_ttl_ms = match spec.cache_ttl_ms.map(u64::try_from) {
            None => 0,
            Some(Ok(ms)) if ms <= DAY_MS => ms,
            Some(_) => {
                let key = format!("tools.{tool}.cache_ttl_ms");
                return Err(invalid(key, format!("0 (no cache) to {DAY_MS} (a day) milliseconds")));
            }
        };
        may_share(&tool, coalesce, cache_ttl_ms, catalogue)?;
        let settle = spec.settle.unwrap_or(Settle::default_for(catalogue));
        if let Some(no_progress) = spec.no_progress {
            super::store::no_progress_is_valid(&format!("tools.{tool}.no_progress"), no_progress)?;
        }
        if let Some(fields) = &spec.volatile_fields {
            super::store::volatile_fields_are_valid(&format!("tools.{tool}.volatile_fields"), fields)?;
        }
        let (no_progress, volatile_fields) = (spec.no_progress, spec.volatile_fields);
        let policy = ToolPolicy {
            cost,
            formula,
            cost_min,
            settle,
            budget,
            fail,
            holds_slot,
            coalesce,
            cache_ttl_ms,
            no_progress,
            volatile_fields,
        };
        tools.insert(tool, policy);
    }
    if let Some(missing) = catalogue.names().find(|t| !tools.contains_key(*t)) {
        return Err(invalid(format!("tools.{missing}.cost"), "every tool needs a cost"));
    }
    Ok(tools)
}

/// `[tools.NAME] cost` (and `cost_max`) as written: the most a call reserves, and its formula if
/// it has one, checked to read only arguments the tool takes when the catalogue knows them.
fn price_of(
    tool: &str,
    cost: &RawCost,
    cost_max: Option<i64>,
    catalogue: &Catalogue,
) -> Result<(u64, Option<Formula>), ConfigError> {
    let key = format!("tools.{tool}.cost");
    let max_key = format!("tools.{tool}.cost_max");
    match cost {
        RawCost::Units(units) => {
            let units =
                u64::try_from(*units).map_err(|_| invalid(&key, format!("a cost cannot be negative (got {units})")))?;
            // Read only for a formula: a fixed cost written over config.toml's formula leaves its
            // cap behind, and that must not be an error.
            if cost_max.is_some_and(|most| most < 1) {
                return Err(invalid(max_key, "the most a call may reserve: a whole number of units, 1 or more"));
            }
            Ok((units, None))
        }
        RawCost::Formula(text) => {
            let formula = Formula::parse(text).map_err(|problem| invalid(&key, problem))?;
            if let Some(arguments) = catalogue.arguments_of(tool)
                && let Some(unknown) = formula.reads().iter().find(|name| !arguments.contains(name))
            {
                return Err(invalid(
                    &key,
                    format!(
                        "`{text}` reads `{unknown}`, which `{tool}` does not take; it takes {}",
                        arguments.join(", ")
                    ),
                ));
            }
            let most = match cost_max.map(u64::try_from) {
                Some(Ok(most)) if most > 0 => most,
                Some(_) => {
                    return Err(invalid(max_key, "the most a call may reserve: a whole number of units, 1 or more"));
                }
                None => {
                    return Err(invalid(
                        max_key,
                        format!("`{key}` is a formula: say the most one call may reserve (its price is held to it)"),
                    ));
                }
            };
            Ok((most, Some(formula)))
        }
    }
}

/// `cost` of `tool` fits every enforced limit of the caller, tenant and address budgets, and of
/// the caller's under each tier.
fn cost_fits_the_scopes(
    tool: &str,
    cost: u64,
    limits: &Limits,
    tiers: &BTreeMap<String, f64>,
) -> Result<(), ConfigError> {
    let key = format!("tools.{tool}.cost");
    let enforced = |limits: &[Limit]| -> Vec<Limiter> {
        limits.iter().filter(|l| l.enforced_mode()).map(|l| l.limiter.clone()).collect()
    };
    let scopes = [
        ("limits.caller", enforced(&limits.caller)),
        ("limits.tenant", enforced(&limits.tenant)),
        ("limits.address", enforced(&limits.address)),
    ];
    for (scope, limiter) in scopes.iter().flat_map(|(scope, limiters)| limiters.iter().map(move |l| (*scope, l))) {
        if cost > limiter.capacity() {
            return Err(invalid(
                &key,
                format!(
                    "cost {cost} is larger than `{scope}.{}` = {}, so `{tool}` could never be called; lower the \
                     cost or raise the {}",
                    limiter.capacity_key(),
                    limiter.capacity(),
                    limiter.capacity_key()
                ),
            ));
        }
    }
    for (tier, factor) in tiers {
        for limiter in enforced(&limits.caller) {
            let scaled = limiter.scaled(*factor).capacity();
            if cost > scaled {
                return Err(invalid(
                    &key,
                    format!(
                        "cost {cost} is larger than `limits.caller.{}` × `tiers.{tier}` = {scaled}, so callers of \
                         tier {tier} could never call `{tool}`",
                        limiter.capacity_key()
                    ),
                ));
            }
        }
    }
    Ok(())
}
