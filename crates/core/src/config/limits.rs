//! `[limits]`: the budgets of every scope a request passes — the HTTP layer, the method groups,
//! the caller, its tenant, address and OAuth client, the in-flight caps — each one limit or a list of them,
//! each with its algorithm (read by the algorithm itself, see [`crate::limit::Params`]).

use std::collections::BTreeMap;

use serde::Deserialize;

use super::{ConfigError, invalid};
use crate::limit::{ALGORITHMS, Concurrency, Limiter, Params};

/// Whether a limit refuses, or only counts the calls it would have refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Refuses what is over the limit.
    Enforce,
    /// Lets everything through, but logs and counts (`outcome="shadow_refused"`) what it would
    /// have refused: to try a new limit on real traffic first.
    Shadow,
}

/// One limit of a scope. A scope may have several (a burst bucket plus a daily window), all
/// decided in the same atomic decision.
#[derive(Debug, Clone)]
pub struct Limit {
    /// The algorithm and its parameters.
    pub limiter: Limiter,
    /// Enforced, or shadow.
    pub mode: Mode,
    /// Tool results carry a warning once this percentage of the limit is used (`None`: never).
    pub warn_at_percent: Option<u8>,
    /// Empty for a scope's first limit; `#name` for the others, appended to the scope's store key
    /// and name so each keeps its own state. Derived from the limit's `name` (or its algorithm),
    /// not its position in a changed list, so a reload keeps the counters of the limits it keeps.
    pub suffix: String,
}

impl Limit {
    /// An enforced limit with no warning, as a scope's first.
    pub fn enforced(limiter: Limiter) -> Self {
        Self { limiter, mode: Mode::Enforce, warn_at_percent: None, suffix: String::new() }
    }

    /// This limit with capacity and rate multiplied by `factor` (tiers, the insurance limiter).
    pub fn scaled(&self, factor: f64) -> Self {
        Self { limiter: self.limiter.scaled(factor), ..self.clone() }
    }

    /// Whether it refuses (not shadow).
    pub fn enforced_mode(&self) -> bool {
        self.mode == Mode::Enforce
    }
}

/// Windows at least this long warn at 80 % used unless told otherwise: short windows refill
/// before a warning could help an agent plan.
const WARN_BY_DEFAULT_FROM: crate::clock::Nanos = crate::clock::Nanos::from_secs(3_600);

/// The budgets of every scope a request passes, outside in. Every scope but the in-flight caps
/// has one or more limits.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Master switch; `false` admits everything (for overhead measurements only).
    pub enabled: bool,
    /// The coarse per-caller limit on `POST /mcp`, before any JSON is parsed.
    pub http: Vec<Limit>,
    /// The coarse limit on `POST /mcp` that all unverified callers of one address share, beside
    /// each one's own `http`.
    pub address_http: Vec<Limit>,
    /// Per caller and JSON-RPC method: `tools/list`.
    pub tools_list: Vec<Limit>,
    /// Per caller and JSON-RPC method: `tools/call`.
    pub tools_call: Vec<Limit>,
    /// Per caller and JSON-RPC method: everything else (`ping`, …) but session set-up.
    pub other_methods: Vec<Limit>,
    /// The caller's tool budget, charged each tool's cost.
    pub caller: Vec<Limit>,
    /// The budget all callers of one tenant share, charged each tool's cost.
    pub tenant: Vec<Limit>,
    /// The budget all unverified callers (no configured key) from one address share, charged
    /// each tool's cost: made-up keys cannot buy budget.
    pub address: Vec<Limit>,
    /// The budget all subjects of one OAuth client application share (`[auth.oauth]`'s
    /// `client_claim`), charged each tool's cost: one runaway agent app cannot spend every user's
    /// budget. Callers known by a configured key or by their address have no client.
    pub client: Vec<Limit>,
    /// Jobs (image and video predictions) one caller may have in flight at once.
    pub in_flight_caller: Limiter,
    /// Jobs all callers of one tenant may have in flight at once (a caller without a tenant is
    /// its own tenant, so this scope is its caller scope).
    pub in_flight_tenant: Limiter,
    /// Jobs all unverified callers of one address may have in flight at once.
    pub in_flight_address: Limiter,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLimits {
    enabled: bool,
    http: RawScope,
    address_http: RawScope,
    method: BTreeMap<String, RawScope>,
    caller: RawScope,
    tenant: RawScope,
    address: RawScope,
    client: RawScope,
    in_flight: RawInFlight,
}

/// A scope's limits as written: one table (today's form), or a list of tables.
#[derive(Debug)]
pub(super) enum RawScope {
    One(RawLimit),
    Many(Vec<RawLimit>),
}

impl<'de> Deserialize<'de> for RawScope {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = RawScope;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a limit (a table with `algorithm`) or a list of limits")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<RawScope, A::Error> {
                RawLimit::deserialize(serde::de::value::MapAccessDeserializer::new(map)).map(RawScope::One)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, seq: A) -> Result<RawScope, A::Error> {
                Vec::<RawLimit>::deserialize(serde::de::value::SeqAccessDeserializer::new(seq)).map(RawScope::Many)
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawInFlight {
    caller: i64,
    tenant: i64,
    address: i64,
}

/// One scope's limiter as written in config: the algorithm and the union of all parameters.
/// Parameters another algorithm would use are ignored (the defaults layer always has some); a
/// parameter no algorithm takes is a typo, refused naming it. Each algorithm reads its own
/// ([`Algorithm::from_params`](crate::limit::Algorithm::from_params)).
#[derive(Debug, Deserialize)]
pub(super) struct RawLimit {
    algorithm: String,
    mode: Option<Mode>,
    name: Option<String>,
    warn_at_percent: Option<i64>,
    #[serde(flatten)]
    params: BTreeMap<String, crate::limit::params::Value>,
}

/// The JSON-RPC method groups with their own per-caller limit.
pub const METHOD_GROUPS: [&str; 3] = ["tools_list", "tools_call", "other"];

/// Largest count a limit may have (window counters are kept in 32 bits).
pub(super) const MAX_UNITS: i64 = crate::limit::params::MAX_UNITS as i64;

/// An in-flight cap: a `concurrency` limiter of `max` slots.
fn slots(key: &str, max: i64) -> Result<Limiter, ConfigError> {
    if max <= 0 || max > MAX_UNITS {
        return Err(invalid(key, format!("must be between 1 and {MAX_UNITS} jobs (got {max})")));
    }
    Ok(Limiter::Concurrency(Concurrency::new(max as u64)))
}

/// A day in milliseconds, the longest most durations may be.
pub const DAY_MS: u64 = 86_400_000;

impl RawLimits {
    /// The section, checked: every scope's limits built and named by its key, the method groups
    /// known, the in-flight caps counts of jobs.
    pub(super) fn validate(self) -> Result<Limits, ConfigError> {
        let mut method = self.method;
        let mut group = |name: &str| -> Result<Vec<Limit>, ConfigError> {
            method
                .remove(name)
                .ok_or_else(|| invalid(format!("limits.method.{name}"), "missing"))?
                .build(&format!("limits.method.{name}"))
        };
        let limits = Limits {
            enabled: self.enabled,
            http: self.http.build("limits.http")?,
            address_http: self.address_http.build("limits.address_http")?,
            tools_list: group("tools_list")?,
            tools_call: group("tools_call")?,
            other_methods: group("other")?,
            caller: self.caller.build("limits.caller")?,
            tenant: self.tenant.build("limits.tenant")?,
            address: self.address.build("limits.address")?,
            client: self.client.build("limits.client")?,
            in_flight_caller: slots("limits.in_flight.caller", self.in_flight.caller)?,
            in_flight_tenant: slots("limits.in_flight.tenant", self.in_flight.tenant)?,
            in_flight_address: slots("limits.in_flight.address", self.in_flight.address)?,
        };
        if let Some(unknown) = method.keys().next() {
            return Err(invalid(
                format!("limits.method.{unknown}"),
                format!("unknown method group; the groups are {}", METHOD_GROUPS.join(", ")),
            ));
        }
        Ok(limits)
    }
}

impl RawScope {
    /// The scope's limits, each named by its key (`limits.caller`, or `limits.caller[1]` in a
    /// list).
    pub(super) fn build(&self, key: &str) -> Result<Vec<Limit>, ConfigError> {
        let (raw, listed): (Vec<&RawLimit>, bool) = match self {
            RawScope::One(limit) => (vec![limit], false),
            RawScope::Many(list) => (list.iter().collect(), true),
        };
        if raw.is_empty() {
            return Err(invalid(key, "an empty list of limits: give at least one"));
        }
        let mut limits: Vec<Limit> = Vec::with_capacity(raw.len());
        for (i, r) in raw.into_iter().enumerate() {
            let at = if listed { format!("{key}[{i}]") } else { key.to_owned() };
            let limiter = r.build(&at)?;
            let suffix = match &r.name {
                Some(name) => {
                    let ok = (1..=32).contains(&name.len())
                        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
                    if !ok {
                        return Err(invalid(format!("{at}.name"), "1-32 letters, digits, `_` or `-`"));
                    }
                    if limits.iter().any(|l| l.suffix == format!("#{name}")) {
                        return Err(invalid(format!("{at}.name"), format!("`{name}` names two limits of {key}")));
                    }
                    format!("#{name}")
                }
                None if i == 0 => String::new(),
                None => {
                    let base = limiter.algorithm();
                    let mut suffix = format!("#{base}");
                    let mut n = 2;
                    while limits.iter().any(|l| l.suffix == suffix) {
                        suffix = format!("#{base}{n}");
                        n += 1;
                    }
                    suffix
                }
            };
            let warn_at_percent = match r.warn_at_percent {
                Some(p) if (1..=100).contains(&p) => Some(p as u8),
                Some(_) => return Err(invalid(format!("{at}.warn_at_percent"), "must be a percentage from 1 to 100")),
                None => limiter.policy_window().filter(|w| *w >= WARN_BY_DEFAULT_FROM).map(|_| 80),
            };
            limits.push(Limit { limiter, mode: r.mode.unwrap_or(Mode::Enforce), warn_at_percent, suffix });
        }
        Ok(limits)
    }
}

impl RawLimit {
    /// The limiter this table describes: its algorithm, reading the parameters it takes.
    fn build(&self, key: &str) -> Result<Limiter, ConfigError> {
        if let Some(unknown) = self.params.keys().find(|name| crate::limit::is_param(name).is_err()) {
            let known = crate::limit::is_param(unknown).err().unwrap_or_default();
            return Err(invalid(
                format!("{key}.{unknown}"),
                format!(
                    "unknown parameter `{unknown}`; the parameters of a limit are algorithm, mode, name, warn_at_percent, {known}"
                ),
            ));
        }
        let params = Params::new(key, &self.algorithm, &self.params);
        match Limiter::from_params(&self.algorithm, &params) {
            Some(built) => built.map_err(|e| invalid(e.key, e.message)),
            None => Err(invalid(
                format!("{key}.algorithm"),
                format!("unknown algorithm `{}`; expected one of {}", self.algorithm, ALGORITHMS.join(", ")),
            )),
        }
    }
}
