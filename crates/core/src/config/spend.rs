//! `[spend_caps]` and `[tenants.NAME]`: what a tenant may spend per day, and what one tenant has
//! instead of the defaults.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::limits::{Limit, MAX_UNITS, RawScope};
use super::{ConfigError, invalid};

/// The daily spend cap of a tenant (or of a caller without one), in cost units.
#[derive(Debug, Clone)]
pub struct SpendCaps {
    /// The cap of every tenant without its own (`None`: no cap).
    pub daily_units: Option<u64>,
    /// Price of one cost unit, to show caps in money (0: units only).
    pub price_per_unit: f64,
    /// The currency of that price.
    pub currency: String,
    /// Percentage of a cap used at which tool results carry a warning.
    pub warn_at_percent: u8,
}

/// `[tenants.NAME]`: what one tenant has instead of the defaults.
#[derive(Debug, Clone, Default)]
pub struct TenantOverride {
    /// The tenant's shared budget instead of `limits.tenant`.
    pub budget: Option<Vec<Limit>>,
    /// Its daily spend cap instead of `spend_caps.daily_units`.
    pub daily_spend_units: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSpendCaps {
    daily_units: i64,
    daily_money: f64,
    price_per_unit: f64,
    currency: String,
    warn_at_percent: i64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTenant {
    budget: Option<RawScope>,
    daily_spend_units: Option<i64>,
}

/// A cap in cost units as written at `key`: 0 for none.
fn cap_units(key: &str, units: i64) -> Result<Option<u64>, ConfigError> {
    match units {
        0 => Ok(None),
        1..=MAX_UNITS => Ok(Some(units as u64)),
        _ => Err(invalid(key, format!("must be 0 (no cap) or between 1 and {MAX_UNITS} cost units"))),
    }
}

impl RawSpendCaps {
    /// The section, checked: a cap in units, in money (turned into units at the price), or the
    /// tighter of both.
    pub(super) fn validate(self) -> Result<SpendCaps, ConfigError> {
        if !(self.price_per_unit.is_finite() && self.price_per_unit >= 0.0) {
            return Err(invalid("spend_caps.price_per_unit", "must be a price of 0 or more"));
        }
        if !(1..=100).contains(&self.warn_at_percent) {
            return Err(invalid("spend_caps.warn_at_percent", "must be a percentage from 1 to 100"));
        }
        let mut daily_units = cap_units("spend_caps.daily_units", self.daily_units)?;
        if self.daily_money != 0.0 {
            if !(self.daily_money.is_finite() && self.daily_money > 0.0) {
                return Err(invalid("spend_caps.daily_money", "must be 0 (no cap) or a positive amount"));
            }
            if self.price_per_unit == 0.0 {
                return Err(invalid(
                    "spend_caps.daily_money",
                    "needs `spend_caps.price_per_unit` to turn money into units",
                ));
            }
            let units = (self.daily_money / self.price_per_unit).floor().min(MAX_UNITS as f64) as i64;
            let units = cap_units("spend_caps.daily_money", units.max(1))?;
            // Both given: the tighter one.
            daily_units = daily_units.into_iter().chain(units).min();
        }
        Ok(SpendCaps {
            daily_units,
            price_per_unit: self.price_per_unit,
            currency: self.currency,
            warn_at_percent: self.warn_at_percent as u8,
        })
    }
}

/// `[tenants.*]`, checked: well-formed names, their own budgets and caps.
pub(super) fn validate_tenants(
    raw: BTreeMap<String, RawTenant>,
) -> Result<BTreeMap<String, TenantOverride>, ConfigError> {
    let mut tenants = BTreeMap::new();
    for (name, raw) in raw {
        let at = format!("tenants.{name}");
        if name.is_empty() || name.len() > 64 || name.contains(':') {
            return Err(invalid(at, "a tenant is 1-64 characters without `:`"));
        }
        let budget = raw.budget.map(|b| b.build(&format!("{at}.budget"))).transpose()?;
        let daily_spend_units =
            raw.daily_spend_units.map(|u| cap_units(&format!("{at}.daily_spend_units"), u)).transpose()?.flatten();
        tenants.insert(name, TenantOverride { budget, daily_spend_units });
    }
    Ok(tenants)
}
