//! The pipeline every tool call passes before its tool runs.
//!
//! The MCP server hands each `tools/call` to [`Guard::admit`] (see `mcp::server`), so no tool
//! can skip it. Order matters: arguments are validated first (bad input charges nothing),
//! then every scope the call draws on is decided at once — all pass and are charged, or none is.

pub mod refusal;

use std::collections::BTreeMap;
use std::sync::Arc;

use tracing::info;

use crate::clock::{SharedClock, ceil_ms};
use crate::identity::Caller;
use crate::limit::Limiter;
use crate::store::{Check, SlotGuard, Store};
pub use refusal::{Refusal, RefusalCode};

/// One budget as a caller sees it in `rate_limit_status`.
#[derive(Debug, Clone, serde::Serialize, schemars::JsonSchema)]
pub struct BudgetStatus {
    /// The scope key, e.g. `caller:tok:1f2e…`.
    pub scope: String,
    /// The algorithm deciding it.
    pub algorithm: &'static str,
    /// Its limit (burst).
    pub limit: u64,
    /// Units left now.
    pub remaining: u64,
    /// Milliseconds until it is full again if nothing is spent.
    pub reset_after_ms: u64,
}

/// What an admitted call holds while it runs: in-flight slots, given back when it is dropped.
#[derive(Debug, Default)]
#[must_use = "dropping the admission releases its in-flight slots at once"]
pub struct Admission {
    _slots: Vec<SlotGuard>,
}

/// Decides whether a caller may run a tool now, and charges it.
#[derive(Debug)]
pub struct Guard {
    store: Arc<Store>,
    clock: SharedClock,
    caller_limit: Limiter,
    costs: BTreeMap<String, u64>,
}

impl Guard {
    /// A guard over `store` with the configured caller budget and tool costs.
    pub fn new(store: Store, clock: SharedClock, caller_limit: Limiter, costs: BTreeMap<String, u64>) -> Self {
        Self { store: Arc::new(store), clock, caller_limit, costs }
    }

    fn caller_scope(caller: &Caller) -> String {
        format!("caller:{}", caller.id())
    }

    /// What `tool` costs; unknown tools are refused by the MCP layer before they get here.
    pub fn cost_of(&self, tool: &str) -> u64 {
        self.costs.get(tool).copied().unwrap_or(0)
    }

    /// The configured costs, for `rate_limit_status`.
    pub fn costs(&self) -> &BTreeMap<String, u64> {
        &self.costs
    }

    /// Charges `caller` for one call of `tool`, or explains exactly how long to wait.
    pub fn admit(&self, caller: &Caller, tool: &str) -> Result<Admission, Refusal> {
        let cost = self.cost_of(tool);
        if cost == 0 {
            return Ok(Admission::default());
        }
        let scope = Self::caller_scope(caller);
        let checks = [Check { key: &scope, limiter: &self.caller_limit, cost }];
        let decisions = self.store.decide(&checks, self.clock.now());
        // The call can pass only when every scope admits it, so the wait is the longest one.
        let refused = checks.iter().zip(&decisions).filter(|(_, d)| !d.allowed).max_by_key(|(_, d)| d.retry_after);
        if let Some((check, d)) = refused {
            let refusal = if check.limiter.holds_slots() {
                Refusal::busy(tool, check.key.to_owned(), d.limit)
            } else {
                Refusal::rate_limited(tool, check.key.to_owned(), d.limit, d.remaining, d.retry_after)
            };
            info!(
                tool,
                scope = check.key,
                code = refusal.code.as_str(),
                retry_after_ms = ceil_ms(d.retry_after),
                "refused"
            );
            return Err(refusal);
        }
        let slots = checks
            .iter()
            .filter(|c| c.limiter.holds_slots())
            .map(|c| {
                SlotGuard::new(self.store.clone(), self.clock.clone(), c.key.to_owned(), c.limiter.clone(), c.cost)
            })
            .collect();
        Ok(Admission { _slots: slots })
    }

    /// The caller's budgets right now, without spending anything.
    pub fn status(&self, caller: &Caller) -> Vec<BudgetStatus> {
        let scope = Self::caller_scope(caller);
        let peek = [Check { key: &scope, limiter: &self.caller_limit, cost: 0 }];
        let decisions = self.store.decide(&peek, self.clock.now());
        peek.iter()
            .zip(decisions)
            .map(|(check, d)| BudgetStatus {
                scope: check.key.to_owned(),
                algorithm: check.limiter.algorithm(),
                limit: d.limit,
                remaining: d.remaining,
                reset_after_ms: ceil_ms(d.reset_after),
            })
            .collect()
    }

    /// Forgets idle limiter state; called on a schedule.
    pub fn sweep(&self) -> usize {
        self.store.sweep(self.clock.now())
    }
}
