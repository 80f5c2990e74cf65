//! The pipeline every tool call passes before its tool runs.
//!
//! The MCP server hands each `tools/call` to [`Guard::admit`] (see `mcp::server`), so no tool
//! can skip it. Order matters: arguments are validated first (bad input charges nothing),
//! then every scope the call draws on is decided at once — all pass and are charged, or none is.

pub mod refusal;

use std::collections::BTreeMap;

use tracing::info;

use crate::clock::{SharedClock, ceil_ms};
use crate::identity::Caller;
use crate::limit::Limiter;
use crate::store::{Check, Store};
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

/// Decides whether a caller may run a tool now, and charges it.
#[derive(Debug)]
pub struct Guard {
    store: Store,
    clock: SharedClock,
    caller_limit: Limiter,
    costs: BTreeMap<String, u64>,
}

impl Guard {
    /// A guard over `store` with the configured caller budget and tool costs.
    pub fn new(store: Store, clock: SharedClock, caller_limit: Limiter, costs: BTreeMap<String, u64>) -> Self {
        Self { store, clock, caller_limit, costs }
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
    pub fn admit(&self, caller: &Caller, tool: &str) -> Result<(), Refusal> {
        let cost = self.cost_of(tool);
        if cost == 0 {
            return Ok(());
        }
        let scope = Self::caller_scope(caller);
        let checks = [Check { key: &scope, limiter: &self.caller_limit, cost }];
        let decisions = self.store.decide(&checks, self.clock.now());
        // The call can pass only when every scope admits it, so the wait is the longest one.
        let refused = checks.iter().zip(&decisions).filter(|(_, d)| !d.allowed).max_by_key(|(_, d)| d.retry_after);
        match refused {
            None => Ok(()),
            Some((check, d)) => {
                info!(tool, scope = check.key, retry_after_ms = ceil_ms(d.retry_after), "rate_limited");
                Err(Refusal::rate_limited(tool, check.key.to_owned(), d.limit, d.remaining, d.retry_after))
            }
        }
    }

    /// The caller's budgets right now, without spending anything.
    pub fn status(&self, caller: &Caller) -> Vec<BudgetStatus> {
        let scope = Self::caller_scope(caller);
        let d = self.store.decide(&[Check { key: &scope, limiter: &self.caller_limit, cost: 0 }], self.clock.now())[0];
        vec![BudgetStatus {
            scope,
            algorithm: self.caller_limit.algorithm(),
            limit: d.limit,
            remaining: d.remaining,
            reset_after_ms: ceil_ms(d.reset_after),
        }]
    }

    /// Forgets idle limiter state; called on a schedule.
    pub fn sweep(&self) -> usize {
        self.store.sweep(self.clock.now())
    }
}
