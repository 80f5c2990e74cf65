//! The stage that decides a plan: on the store, or — when a shared store cannot decide and the
//! call may fail open — on the insurance limiter, behind a breaker that skips a failing store
//! (one probe a second) and a memory of the store's refusals that answers a hot abuser without a
//! round trip.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::breaker::Breaker;
use crate::clock::Nanos;
use crate::config::Fail;
use crate::guard::admit::plan::{Planned, checks_of};
use crate::guard::policy::Policy;
use crate::guard::refusal_memory::RefusalMemory;
use crate::guard::{Guard, LimitsInForce};
use crate::limit::Decision;
use crate::ops::metrics::Layer;
use crate::store::{Check, Lease, LoopCall, LoopHistory, Store, StoreError, Verdict};

/// How long a failing shared store is skipped before one decision probes it again.
pub(in crate::guard) const STORE_PROBE_EVERY: Nanos = Nanos::from_secs(1);

/// The limiter that decides while a shared store cannot: the same limits divided by
/// `store.expected_instances`, in this instance's memory, so N instances deciding alone hand out
/// about one budget between them instead of N.
#[derive(Debug)]
pub(in crate::guard) struct Insurance {
    pub(in crate::guard) store: Arc<dyn Store>,
    /// Open while the shared store is failing: decisions skip it (no timeout to wait out on
    /// every call) until one probe a second finds it back.
    pub(in crate::guard) shared_down: Breaker,
    /// The shared store's refusals still in force, answered here without a round trip.
    pub(in crate::guard) refused: Arc<RefusalMemory>,
}

/// The store's [`Verdict`] on a plan, with the plan and the store that holds any slots taken.
pub(in crate::guard) struct VerdictOn<'s> {
    /// The limits decided (under the insurance limiter's policy, if it decided).
    pub(in crate::guard) scopes: Vec<Planned<'s>>,
    /// The store that holds any slots taken.
    pub(in crate::guard) store: &'s Arc<dyn Store>,
    /// What it said: one decision per scope, or the block or loop that stopped the call before
    /// anything was decided or charged.
    pub(in crate::guard) verdict: Verdict,
}

impl<'s> VerdictOn<'s> {
    fn decided(scopes: Vec<Planned<'s>>, decisions: Vec<Decision>, store: &'s Arc<dyn Store>) -> Self {
        Self { scopes, store, verdict: Verdict::Decided(decisions) }
    }

    /// One decision per scope; none when a block or a loop stopped the call.
    pub(in crate::guard) fn decisions(&self) -> &[Decision] {
        match &self.verdict {
            Verdict::Decided(decisions) => decisions,
            Verdict::Blocked { .. } | Verdict::Looping { .. } => &[],
        }
    }
}

impl Guard {
    /// Logs and counts a store that could not decide.
    pub(in crate::guard) fn store_failed(&self, layer: Layer, what: &str, error: &StoreError) {
        self.metrics.store_error(layer);
        tracing::warn!(target: "mcp_ratelimit::guard::admit::decide", layer = layer.as_str(), what, %error, "limiter store failed");
    }

    /// Decides `checks` on the store, unless a shared store is known to be down, after checking
    /// `looped` in the store's loop history in the same step when given; `None` when it could
    /// not decide (counted and logged), so the caller falls back as its policy says.
    async fn decide_shared(
        &self,
        checks: &[Check<'_>],
        blocks: &[&str],
        lease: Lease,
        looped: Option<(&dyn LoopHistory, LoopCall<'_>)>,
        (layer, what): (Layer, &str),
    ) -> Option<Verdict> {
        let permit = match &self.insurance {
            Some(insurance) => Some(insurance.shared_down.permit(self.clock.now()).ok()?),
            None => None,
        };
        let decided = match looped {
            Some((history, call)) => history.decide_after_loop_check(call, checks, blocks, lease).await,
            None => self.store.decide(checks, blocks, lease).await,
        };
        if let (Some(insurance), Some(permit)) = (&self.insurance, permit) {
            insurance.shared_down.record(permit, decided.is_ok(), self.clock.now());
            self.store_up.store(decided.is_ok(), Ordering::Relaxed);
        }
        decided.map_err(|error| self.store_failed(layer, what, &error)).ok()
    }

    /// Decides the plan `scopes_under` makes of the limits in force on the store or, when it
    /// cannot decide and the call may `fail` open, on the insurance limiter (under its own
    /// share of the limits). `blocks` are operator blocks read with the decision; they live in
    /// the shared store, so the insurance limiter cannot see them.
    pub(in crate::guard) async fn decide<'s, F>(
        &'s self,
        live: &'s LimitsInForce,
        scopes_under: F,
        blocks: &[&str],
        lease: Lease,
        fail: Fail,
        layer: (Layer, &str),
    ) -> Option<VerdictOn<'s>>
    where
        F: Fn(&'s Policy) -> Vec<Planned<'s>>,
    {
        match self.decide_on_store(live, &scopes_under, blocks, lease, None, layer).await {
            Some(decided) => Some(decided),
            None => self.decide_insured(live, &scopes_under, lease, fail).await,
        }
    }

    /// [`Guard::decide`] on the store alone, after checking `looped` against the store's loop
    /// history in the same step when given: `None` when the store could not decide. The memory
    /// of the shared store's refusals answers a plan it knows to be refused still, without a
    /// round trip (and without a loop check: the call is refused, and charged nothing, anyway).
    pub(in crate::guard) async fn decide_on_store<'s, F>(
        &'s self,
        live: &'s LimitsInForce,
        scopes_under: &F,
        blocks: &[&str],
        lease: Lease,
        looped: Option<(&dyn LoopHistory, LoopCall<'_>)>,
        layer: (Layer, &str),
    ) -> Option<VerdictOn<'s>>
    where
        F: Fn(&'s Policy) -> Vec<Planned<'s>>,
    {
        let scopes = scopes_under(&live.policy);
        let checks = checks_of(&scopes);
        let now = self.clock.now();
        if let Some(insurance) = &self.insurance
            && let Some(decisions) = insurance.refused.recall(&checks, now)
        {
            return Some(VerdictOn::decided(scopes, decisions, &self.store));
        }
        let verdict = self.decide_shared(&checks, blocks, lease, looped, layer).await?;
        if let (Verdict::Decided(decisions), Some(insurance)) = (&verdict, &self.insurance) {
            insurance.refused.remember(&checks, decisions, now);
        }
        Some(VerdictOn { scopes, store: &self.store, verdict })
    }

    /// The plan `scopes_under` makes of the insurance limiter's share of the limits, decided
    /// there, when the call may `fail` open: what decides while the shared store cannot.
    pub(in crate::guard) async fn decide_insured<'s, F>(
        &'s self,
        live: &'s LimitsInForce,
        scopes_under: &F,
        lease: Lease,
        fail: Fail,
    ) -> Option<VerdictOn<'s>>
    where
        F: Fn(&'s Policy) -> Vec<Planned<'s>>,
    {
        let insurance = self.insurance.as_ref().filter(|_| fail == Fail::Open)?;
        let scopes = scopes_under(live.insurance.as_ref()?);
        let decisions = insurance.store.decide_all(&checks_of(&scopes), lease).await.ok()?;
        crate::guard::trace::failed_open();
        Some(VerdictOn::decided(scopes, decisions, &insurance.store))
    }
}
