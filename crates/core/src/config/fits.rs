//! The checks across sections: what one section allows, read against the others. A cost must
//! fit every budget a call draws on (after tiers, tenants' own budgets and the insurance limiter's
//! share), a spend cap must cover the dearest tool, and no limit may span longer than its store
//! decides exactly. Each section's own checks stay in its file; these read several, so they live
//! here and no section file imports another's.

use std::collections::BTreeMap;

use super::auth::ApiKey;
use super::limits::{DAY_MS, Limit, Limits};
use super::spend::{SpendCaps, TenantOverride};
use super::store::REDIS_SPAN;
use super::tools::{Fail, ToolPolicy};
use super::{ConfigError, invalid};
use crate::clock::Nanos;
use crate::limit::{FixedWindow, Limiter};

/// The longest a limit may span (a window, or a bucket's burst × refill time), and why.
#[derive(Debug, Clone, Copy)]
pub(super) struct Longest {
    /// In nanoseconds.
    pub span: Nanos,
    /// As an error says it: `a year (31536000 s)`.
    pub in_words: &'static str,
    /// Where the bound comes from, after the span in an error (` with store.backend = "redis"`),
    /// or nothing for the bound every limit has.
    pub because: &'static str,
}

/// The bound every limit has ([`crate::limit::params::LONGEST_SPAN`]).
pub(super) const LONGEST: Longest =
    Longest { span: crate::limit::params::LONGEST_SPAN, in_words: "a year (31536000 s)", because: "" };

/// Every limit written for a caller, a tenant or a tool spans at most `most`, and so does each
/// of the caller's own under every tier (a tier scales a bucket's burst, rounded and never below
/// one, and its rate, so its span can grow: a burst of 1 at half the rate spans twice as long).
pub(super) fn spans_fit(
    (limits, tools, tenants, keys): (
        &Limits,
        &BTreeMap<String, ToolPolicy>,
        &BTreeMap<String, TenantOverride>,
        &[ApiKey],
    ),
    tiers: &BTreeMap<String, f64>,
    most: &Longest,
) -> Result<(), ConfigError> {
    let mut spans: Vec<(String, &[Limit])> = vec![
        ("limits.http".into(), &limits.http),
        ("limits.address_http".into(), &limits.address_http),
        ("limits.method.tools_list".into(), &limits.tools_list),
        ("limits.method.tools_call".into(), &limits.tools_call),
        ("limits.method.other".into(), &limits.other_methods),
        ("limits.caller".into(), &limits.caller),
        ("limits.tenant".into(), &limits.tenant),
        ("limits.address".into(), &limits.address),
        ("limits.client".into(), &limits.client),
    ];
    spans.extend(tools.iter().map(|(t, p)| (format!("tools.{t}.budget"), p.budget.as_slice())));
    spans.extend(tenants.iter().filter_map(|(t, o)| o.budget.as_deref().map(|b| (format!("tenants.{t}.budget"), b))));
    spans.extend(
        keys.iter().enumerate().filter_map(|(i, k)| k.caller.as_deref().map(|c| (format!("auth.keys[{i}].caller"), c))),
    );
    let Longest { span: longest, in_words, because } = *most;
    if let Some((key, _)) = spans.iter().find(|(_, l)| l.iter().any(|l| l.limiter.span() > longest)) {
        return Err(invalid(
            key.as_str(),
            format!("a window, or a bucket's burst × refill time, may span at most {in_words}{because}"),
        ));
    }
    let own =
        ["http", "method.tools_list", "method.tools_call", "method.other", "caller"].map(|s| format!("limits.{s}"));
    let tiered = spans.iter().filter(|(key, _)| own.contains(key));
    for ((key, limits), (tier, factor)) in tiered.flat_map(|s| tiers.iter().map(move |t| (s, t))) {
        if limits.iter().any(|l| l.limiter.scaled(*factor).span() > longest) {
            return Err(invalid(
                key.as_str(),
                format!(
                    "× `tiers.{tier}` ({factor}) it spans more than {in_words}, the most a window, or a bucket's \
                     burst × refill time, may span{because}"
                ),
            ));
        }
    }
    Ok(())
}

/// With Redis as the store, every limit spans at most [`REDIS_SPAN`], the caller's own under
/// every tier too (see [`super::limits::spans_fit`]).
pub(super) fn spans_fit_redis(
    limits: &Limits,
    tools: &BTreeMap<String, ToolPolicy>,
    tenants: &BTreeMap<String, TenantOverride>,
    keys: &[ApiKey],
    tiers: &BTreeMap<String, f64>,
) -> Result<(), ConfigError> {
    let most = Longest { span: REDIS_SPAN, in_words: "52 days", because: " with store.backend = \"redis\"" };
    spans_fit((limits, tools, tenants, keys), tiers, &most)
}

/// Refuses a config in which a paid tool's cost is larger than an enforced limit of a scope it
/// draws on, as the guard scales them (`Policy::new`, `Policy::scaled`: capacities rounded,
/// never below one): the tenants' and keys' own budgets as written, and over a shared store
/// (`shared`: its expected instances), for a tool that fails open, the insurance limiter's share
/// of 1/`store.expected_instances` of every one of them (`limits.caller` after each tier), and
/// of the spend caps. Such a tool could never be called by that tenant or key, or on any
/// instance while the store cannot decide. (The unscaled `limits.*`, their tiers and the caps
/// are checked where they are read.)
pub(super) fn costs_fit(
    tools: &BTreeMap<String, ToolPolicy>,
    tiers: &BTreeMap<String, f64>,
    limits: &Limits,
    tenants: &BTreeMap<String, TenantOverride>,
    keys: &[ApiKey],
    spend_caps: &SpendCaps,
    shared: Option<u32>,
) -> Result<(), ConfigError> {
    // Every limit a cost is drawn from: the key of its capacity, the limiter, whether tiers scale it.
    let mut drawn: Vec<(String, Limiter, bool)> = Vec::new();
    let mut scope = |key: &str, list: &[Limit], tiered: bool| {
        for (i, limit) in list.iter().enumerate().filter(|(_, l)| l.enforced_mode()) {
            let at = if list.len() > 1 { format!("{key}[{i}]") } else { key.to_owned() };
            drawn.push((format!("{at}.{}", limit.limiter.capacity_key()), limit.limiter.clone(), tiered));
        }
    };
    scope("limits.caller", &limits.caller, true);
    scope("limits.tenant", &limits.tenant, false);
    scope("limits.address", &limits.address, false);
    scope("limits.client", &limits.client, false);
    for (tenant, own) in tenants {
        scope(&format!("tenants.{tenant}.budget"), own.budget.as_deref().unwrap_or_default(), false);
    }
    for (i, key) in keys.iter().enumerate() {
        scope(&format!("auth.keys[{i}].caller"), key.caller.as_deref().unwrap_or_default(), false);
    }
    let cap = |units: u64| Limiter::FixedWindow(FixedWindow::new(units, Nanos::from_millis(DAY_MS)));
    drawn.extend(spend_caps.daily_units.map(|units| ("spend_caps.daily_units".to_owned(), cap(units), false)));
    for (tenant, own) in tenants {
        if let Some(units) = own.daily_spend_units {
            drawn.push((format!("tenants.{tenant}.daily_spend_units"), cap(units), false));
        }
    }

    let untiered = [(None, 1.0)];
    for (tool, policy) in tools.iter().filter(|(_, p)| p.cost > 0) {
        let cost = policy.cost;
        for (at, limiter, tiered) in &drawn {
            let factors: Vec<(Option<&str>, f64)> =
                if *tiered { tiers.iter().map(|(t, f)| (Some(t.as_str()), *f)).collect() } else { untiered.to_vec() };
            for (tier, factor) in factors {
                let scaled = limiter.scaled(factor);
                let of = tier.map_or_else(|| format!("`{at}`"), |t| format!("`{at}` × `tiers.{t}`"));
                if cost > scaled.capacity() {
                    return Err(invalid(
                        format!("tools.{tool}.cost"),
                        format!(
                            "cost {cost} is larger than {of} = {}, so `{tool}` could never be called there; lower \
                             the cost or raise `{at}`",
                            scaled.capacity()
                        ),
                    ));
                }
                let Some(instances) = shared.filter(|n| *n > 1 && policy.fail == Fail::Open) else { continue };
                let share = scaled.scaled(1.0 / f64::from(instances)).capacity();
                if cost > share {
                    return Err(invalid(
                        "store.expected_instances",
                        format!(
                            "with {instances} instances sharing the store, the insurance limiter gives each 1/{instances} \
                             of {of} ({} → {share}), less than the cost {cost} of `{tool}`, which fails open: while \
                             the store cannot decide, no instance could admit it. Lower `store.expected_instances` \
                             or `tools.{tool}.cost`, raise `{at}`, or set `tools.{tool}.fail = \"closed\"`",
                            scaled.capacity()
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Every cap at least the dearest tool's cost: a smaller one could never admit that tool.
pub(super) fn caps_cover_costs(
    spend_caps: &SpendCaps,
    tenants: &BTreeMap<String, TenantOverride>,
    tools: &BTreeMap<String, ToolPolicy>,
) -> Result<(), ConfigError> {
    let max_cost = tools.values().map(|t| t.cost).max().unwrap_or(0);
    for (key, cap) in std::iter::once(("spend_caps.daily_units".to_owned(), spend_caps.daily_units))
        .chain(tenants.iter().map(|(t, o)| (format!("tenants.{t}.daily_spend_units"), o.daily_spend_units)))
    {
        if let Some(cap) = cap.filter(|cap| *cap < max_cost) {
            return Err(invalid(key, format!("a cap of {cap} is below the dearest tool's cost {max_cost}")));
        }
    }
    Ok(())
}
