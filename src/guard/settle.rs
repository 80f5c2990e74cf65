//! The last stage of a priced call: its price settled from what the upstream says it used.
//!
//! A fixed price over- or under-charges whenever the work depends on the arguments or on what
//! the upstream actually did (a video cut shorter than asked, tokens an answer did not need).
//! So [`Guard::admit`](super::Guard::admit) *reserves* the call's price — its `[tools.NAME] cost`,
//! or that cost's formula over the arguments — in every budget counted in cost units (the
//! caller's, its tenant's, its address's, the spend cap), atomically with everything else, and
//! hands the reservation out as a [`Reserved`]. When the answer is in, the door that asked
//! settles it ([`Reserved::settle`]) by one rule, [`Reserved::charge_for`]:
//!
//! | the answer | charged |
//! | --- | --- |
//! | reports `usage.units` (`settle = "usage"`, the default) | those units |
//! | the upstream never started the work: a job that never left our queue (canceled or expired there, or given up after the server's own submissions were refused: retries the server owns, not the agent's), a proxied call never sent | 0 |
//! | anything else: no report, the upstream's refusal or error, a timeout, a cancelled call | the reservation |
//!
//! The last row keeps a decision made before prices were settled: a failed upstream call is still
//! charged, because the budget protects the upstream from the agent, and an agent hammering a
//! failing upstream must be slowed as much as one hammering a healthy one (and a timed-out or
//! cancelled call may have been done, and billed).
//!
//! The difference goes back, or is taken on top, in each of those budgets through its
//! algorithm's adjustment ([`Adjustment`]) on the store that decided the call (Redis, or this
//! instance's insurance limiter while Redis was down): a refund never lifts a budget past its
//! capacity, and a charge past what is left takes what is left — a budget never goes below
//! empty. On Redis it is one script for all of them. A settlement the store cannot make is
//! logged and counted, and the reservation stands (a lost refund can only have charged more,
//! never admitted more). A reservation dropped without being settled stands too: a door that
//! does not settle charges what it reserved, as a fixed price always did.

use std::sync::Arc;

use crate::config::Settle;
use crate::guard::refusal_memory::RefusalMemory;
use crate::limit::{Adjustment, Limiter};
use crate::metrics::Metrics;
use crate::store::Store;

/// What the work behind a call came to, as far as its price goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Used {
    /// The upstream reported using this many units.
    Reported(u64),
    /// The upstream never started the work: the job never left our queue (the server's own
    /// refused submissions aside), the proxied call was never sent.
    Nothing,
    /// Nobody says: the reservation stands.
    Unreported,
}

/// A call's price, reserved and settled, as the agent sees both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settled {
    /// Units reserved before the call ran.
    pub reserved: u64,
    /// Units it was charged in the end: its settled price (a budget that had less left gave
    /// what it had, and stands at empty).
    pub charged: u64,
}

/// The price an admitted call reserved, until it is settled.
#[must_use = "a reservation dropped unsettled stands: the call is charged what it reserved"]
pub struct Reserved {
    tool: String,
    units: u64,
    settle: Settle,
    store: Arc<dyn Store>,
    /// The budgets that took the reservation: each key and its limiter.
    budgets: Vec<(String, Limiter)>,
    metrics: Arc<Metrics>,
    /// The memory of a shared store's refusals, which a refund makes stale for these keys.
    refusals: Option<Arc<RefusalMemory>>,
}

impl std::fmt::Debug for Reserved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reserved").field("tool", &self.tool).field("units", &self.units).finish_non_exhaustive()
    }
}

impl Reserved {
    /// A reservation of `units` for a call of `tool`, taken in `budgets` on `store`.
    pub(super) fn new(
        (tool, units, settle): (&str, u64, Settle),
        store: Arc<dyn Store>,
        budgets: Vec<(String, Limiter)>,
        metrics: Arc<Metrics>,
        refusals: Option<Arc<RefusalMemory>>,
    ) -> Self {
        Self { tool: tool.to_owned(), units, settle, store, budgets, metrics, refusals }
    }

    /// Units reserved.
    pub fn units(&self) -> u64 {
        self.units
    }

    /// What a call whose work came to `used` is charged (the table in the module doc).
    pub fn charge_for(&self, used: Used) -> u64 {
        match (self.settle, used) {
            (Settle::Usage, Used::Reported(units)) => units,
            (Settle::Usage, Used::Nothing) => 0,
            (Settle::Usage, Used::Unreported) | (Settle::Reserved, _) => self.units,
        }
    }

    /// Settles the reservation for work that came to `used`: the difference refunded, or
    /// charged on top, in every budget that took it. Returns what was reserved and charged; when
    /// the store cannot settle, the reservation stands and that is what it says.
    pub async fn settle(self, used: Used) -> Settled {
        let charged = self.charge_for(used);
        let settled = Settled { reserved: self.units, charged };
        let (how, by) = match charged.cmp(&self.units) {
            std::cmp::Ordering::Equal => return settled,
            std::cmp::Ordering::Less => ("refunded", Adjustment::Refund(self.units - charged)),
            std::cmp::Ordering::Greater => ("charged", Adjustment::Charge(charged - self.units)),
        };
        if self.budgets.is_empty() {
            return settled;
        }
        let budgets: Vec<(&str, &Limiter)> =
            self.budgets.iter().map(|(key, limiter)| (key.as_str(), limiter)).collect();
        match self.store.adjust(&budgets, by).await {
            Ok(_) => {
                // A charge takes at most what a budget holds, whatever a report claims.
                let most = self.budgets.iter().map(|(_, limiter)| limiter.capacity()).max().unwrap_or(0);
                self.metrics.settled(&self.tool, how, self.units.abs_diff(charged).min(most));
                if let (Adjustment::Refund(_), Some(refusals)) = (by, &self.refusals) {
                    // Only time gave budget back until now: a refusal remembered for these keys
                    // may be too long. (Other instances keep theirs until it runs out: they can
                    // only refuse a little longer, never admit more.)
                    refusals.forget(budgets.iter().map(|(key, _)| *key));
                }
                settled
            }
            Err(error) => {
                self.metrics.settlement_error(&self.tool);
                tracing::warn!(tool = %self.tool, reserved = self.units, charged, %error, "could not settle a price: the reservation stands");
                Settled { reserved: self.units, charged: self.units }
            }
        }
    }
}
