//! The last stage of every decision: what it tells the caller, the operator and the logs — which
//! limit refused, the warnings an admitted call carries (spend caps at 80 % …), the budgets as
//! `rate_limit_status` shows them, and one log line per refusal.
//!
//! Refusal log lines are rate-limited per caller bucket (the 16-way hash bucket metrics use,
//! never the caller): a refusal storm writes a few lines a second, each saying how many it
//! stands for, while `/metrics` counts every refusal exactly.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::clock::{Nanos, ceil_ms};
use crate::config::Limit;
use crate::guard::admit::plan::Planned;
use crate::guard::policy::Policy;
use crate::guard::scope::Scope;
use crate::limit::Decision;
use crate::ops::metrics::{Layer, Metrics};

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
    /// Units of it the answering instance holds in budget slices (a shared store's budget, taken
    /// a slice at a time and decided there without a round trip), counted in `remaining`.
    #[serde(skip_serializing_if = "is_zero")]
    pub held_here: u64,
}

fn is_zero(units: &u64) -> bool {
    *units == 0
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
pub fn budget_status(policy: &Policy, scope: &Scope, limit: &Limit, d: &Decision) -> BudgetStatus {
    BudgetStatus {
        scope: scope.name().to_owned(),
        algorithm: limit.limiter.algorithm(),
        limit: d.limit,
        remaining: d.remaining,
        reset_after_ms: ceil_ms(d.reset_after),
        shadow: !limit.enforced_mode(),
        money: money_of(policy, scope, d),
        held_here: 0,
    }
}

/// The warnings of an admitted decision: every limit with a warning level that the call took
/// past it. Nothing is built for a limit without one.
pub fn warnings_of(policy: &Policy, scopes: &[Planned<'_>], decisions: &[Decision]) -> Vec<Warning> {
    let mut warnings = Vec::new();
    for (p, d) in scopes.iter().zip(decisions) {
        let Some(at) = p.limit.warn_at_percent else { continue };
        let used = d.limit.saturating_sub(d.remaining);
        if p.cost == 0 || d.limit == 0 || u128::from(used) * 100 < u128::from(at) * u128::from(d.limit) {
            continue;
        }
        warnings.push(Warning {
            scope: p.scope.name().to_owned(),
            policy: p.limit.limiter.describe(),
            used,
            limit: d.limit,
            percent_used: used.saturating_mul(100) / d.limit,
            reset_after_ms: ceil_ms(d.reset_after),
            money: money_of(policy, &p.scope, d),
        });
    }
    warnings
}

/// The enforced limit that refused with the longest wait (the call passes only when every
/// enforced limit admits it); shadow limits' refusals are counted here, and logged as
/// `log` allows.
pub fn refused_by<'a, 'p>(
    scopes: &'a [Planned<'p>],
    decisions: &'a [Decision],
    (metrics, log): (&Metrics, &RefusalLog),
    (layer, what): (Layer, &str),
    (bucket, now): (u8, Nanos),
) -> Option<(&'a Planned<'p>, &'a Decision)> {
    for (p, d) in scopes.iter().zip(decisions) {
        if !d.allowed && !p.limit.enforced_mode() {
            metrics.shadow_refusal(layer, what);
            if let Some(left_out) = log.admit(bucket, now) {
                tracing::info!(
                    target: "mcp_ratelimit::guard::admit::report", layer = layer.as_str(),
                    what,
                    scope = p.scope.name(),
                    retry_after_ms = ceil_ms(d.retry_after),
                    left_out,
                    "shadow limit would have refused"
                );
            }
        }
    }
    scopes
        .iter()
        .zip(decisions)
        .filter(|(p, d)| !d.allowed && p.limit.enforced_mode())
        .max_by_key(|(_, d)| d.retry_after)
}

/// Lines a caller bucket may write at once.
const LOG_BURST: u64 = 10;
/// Then one line per this long, per bucket.
const LOG_EVERY: Nanos = Nanos::from_secs(1);

/// How many refusal log lines each of the 16 caller buckets may write: a burst of
/// ten, then one a second (a GCRA per bucket, on the guard's clock, lock-free). What it
/// holds back is counted, and the next line says how many it stands for (`left_out`).
#[derive(Debug, Default)]
pub struct RefusalLog {
    /// Per bucket: the theoretical arrival time of its next line (GCRA).
    due: [AtomicU64; 16],
    /// Per bucket: refusals not logged since its last line.
    left_out: [AtomicU64; 16],
}

impl RefusalLog {
    /// Whether a refusal of caller bucket `bucket` may be logged at `now`; if so, how many of the
    /// bucket's refusals were left out of the log since its last line.
    pub fn admit(&self, bucket: u8, now: Nanos) -> Option<u64> {
        let b = usize::from(bucket & 0x0f);
        let tolerance = LOG_EVERY * LOG_BURST;
        let mut due = Nanos::new(self.due[b].load(Ordering::Relaxed));
        loop {
            let next = due.max(now) + LOG_EVERY;
            if next - now > tolerance {
                self.left_out[b].fetch_add(1, Ordering::Relaxed);
                return None;
            }
            match self.due[b].compare_exchange_weak(due.as_u64(), next.as_u64(), Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return Some(self.left_out[b].swap(0, Ordering::Relaxed)),
                Err(seen) => due = Nanos::new(seen),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_storm_writes_a_burst_then_a_line_a_second_each_counting_what_it_left_out() {
        let log = RefusalLog::default();
        let logged: Vec<u64> = (0..100).filter_map(|_| log.admit(3, Nanos::ZERO)).collect();
        assert_eq!(logged.len() as u64, LOG_BURST, "a burst of lines at once");
        assert!(logged.iter().all(|n| *n == 0), "nothing was left out before them");
        assert_eq!(log.admit(3, LOG_EVERY / 2), None, "half a second later: still held back");
        assert_eq!(log.admit(3, LOG_EVERY), Some(91), "a second later: one line, for the 91 left out");
        assert_eq!(log.admit(4, Nanos::ZERO), Some(0), "another bucket has its own");
    }
}
