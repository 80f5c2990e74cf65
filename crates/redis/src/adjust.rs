//! Budgets adjusted after a decision (refunds, settlements, charges given back), at most once
//! per mark, one script per hash slot.

use std::collections::HashMap;

use ::redis::cluster_routing::Slot;

use mcp_ratelimit_kernel::clock::Nanos;
use mcp_ratelimit_kernel::limit::{Adjustment, Decision, Limiter};
use mcp_ratelimit_kernel::store::{Check, StoreError};

use crate::RedisStore;
use crate::batch::Invocation;
use crate::connection::Connection;
use crate::errors::bounded;
use crate::scripts::{MAX_SPAN, micros, script_span};

impl RedisStore {
    /// Adjusts each budget under its key as its [`Adjustment`] says
    /// ([`mcp_ratelimit_kernel::store::Budgets::adjust`]; `adjust.lua`), at most once while the mark under `once`
    /// lives ([`mcp_ratelimit_kernel::store::MARK_LIVES`]), at an explicit clock reading when `now` is given.
    /// Returns each budget's level after it, as a cost-0 decision. The keys (and the mark's) must
    /// share a hash tag on a cluster (one script).
    pub async fn adjust(
        &self,
        budgets: &[(&str, &Limiter, Adjustment)],
        once: Option<&str>,
        now: Option<Nanos>,
    ) -> Result<Vec<Decision>, StoreError> {
        let Some(groups) = self.by_slot(budgets.iter().map(|(key, _, _)| *key)) else {
            return self.adjust_in_slot(budgets, once, now).await;
        };
        // On a cluster, budgets of one call may span slots (an OAuth client's is shared across
        // tenants): one script per slot, each at most once under a mark of its own slot's, the
        // call's mark re-tagged (`{o:app}` + the mark), so a retry skips exactly what landed.
        let adjusted = groups.iter().map(|group| async move {
            let part: Vec<(&str, &Limiter, Adjustment)> = group.iter().map(|&i| budgets[i]).collect();
            let mark = once.map(|mark| retagged(mark, part[0].0));
            self.adjust_in_slot(&part, mark.as_deref(), now).await
        });
        let mut levels: Vec<Option<Decision>> = vec![None; budgets.len()];
        for (group, answer) in groups.iter().zip(futures::future::try_join_all(adjusted).await?) {
            for (&i, level) in group.iter().zip(answer) {
                levels[i] = Some(level);
            }
        }
        self.merged(levels)
    }

    /// On a cluster, the indices of `keys` grouped by hash slot, when they span more than one;
    /// `None` when they share one (always, on one Redis).
    pub(super) fn by_slot<'k>(&self, keys: impl Iterator<Item = &'k str>) -> Option<Vec<Vec<usize>>> {
        let Connection::Cluster(..) = self.connection else { return None };
        let mut by_slot: HashMap<Slot, Vec<usize>> = HashMap::new();
        for (i, key) in keys.enumerate() {
            by_slot.entry(Slot::for_key(key)).or_default().push(i);
        }
        (by_slot.len() > 1).then(|| by_slot.into_values().collect())
    }

    /// [`RedisStore::adjust`] of budgets (and mark) on one hash slot: one script.
    async fn adjust_in_slot(
        &self,
        budgets: &[(&str, &Limiter, Adjustment)],
        once: Option<&str>,
        now: Option<Nanos>,
    ) -> Result<Vec<Decision>, StoreError> {
        if budgets.is_empty() {
            return Ok(Vec::new());
        }
        let mut invocation = Invocation::of(&self.adjust);
        invocation.arg(now.map(micros).transpose()?.map_or_else(String::new, |us| us.to_string()));
        let mark_ms = once.map_or(0, |_| mcp_ratelimit_kernel::store::MARK_LIVES.as_millis());
        invocation.arg(mark_ms.to_string());
        for &(key, limiter, by) in budgets {
            let span = script_span(&Check { key, limiter, cost: 0, shadow: false })?;
            invocation.key(key).arg(limiter.algorithm()).arg(limiter.capacity()).arg(span);
            // A charge's instant was a reading of the script's clock: whole microseconds.
            let (how, units, (taken_us, reset_after)) = match by {
                Adjustment::Refund(units) => ("refund", units, (0, Nanos::ZERO)),
                Adjustment::Charge(units) => ("charge", units, (0, Nanos::ZERO)),
                Adjustment::Return { units, taken } => ("return", units, (micros(taken.at)?, taken.reset_after)),
            };
            invocation.arg(how).arg(units).arg(taken_us).arg(reset_after.min(MAX_SPAN).as_u64());
        }
        if let Some(mark) = once {
            invocation.key(mark);
        }
        let mut reply: Vec<i64> = bounded(&self.address, self.timeout, self.connection.invoke(&invocation)).await?;
        let at = self.clock_of(reply.pop())?;
        self.decisions(&reply, budgets.len(), at)
    }
}

/// `mark` under the hash tag of `key` (Redis's rule: what the first `{…}` holds, when it holds
/// anything): the same mark, on `key`'s slot.
fn retagged(mark: &str, key: &str) -> String {
    let tag = |k: &str| -> Option<(usize, usize)> {
        let open = k.find('{')?;
        let close = open + 1 + k[open + 1..].find('}')?;
        (close > open + 1).then_some((open, close))
    };
    let untagged = tag(mark).map_or(mark, |(_, close)| &mark[close + 1..]);
    match tag(key) {
        Some((open, close)) => format!("{}{untagged}", &key[open..=close]),
        None => format!("{{{key}}}{untagged}"),
    }
}
