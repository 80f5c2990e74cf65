//! The account claimed in a shared store (Redis), so every instance keeps one cap and one
//! spacing: its slots, the unverified callers' share and the classes' gaps in one decision, and,
//! with an adaptive limit, the learnt limit every instance shares.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::{ACCOUNT_RETRY, AccountSlot, Blocker, FairQueue, Shared};
use crate::clock::{NANOS_PER_SEC, Nanos};
use crate::limit::{Concurrency, Gcra, Limiter};
use crate::ops::metrics::Metrics;
use crate::store::{Check, LearntAt, Lease, SharedLearner, SharedLimit, SlotGuard, Store, StoreError};
use crate::upstream::adaptive::Signal;
use crate::upstream::classes::ClassId;

impl Shared {
    /// Whether the store failed less than [`ACCOUNT_RETRY`] ago.
    pub(super) fn down(&self, now: Nanos) -> bool {
        now < Nanos::new(self.down_until.load(Ordering::Relaxed))
    }

    /// The store could not answer `what`: logged, counted, and not asked again for a while.
    pub(super) fn failed(&self, error: &StoreError, what: &str, now: Nanos) {
        tracing::warn!(%error, "cannot {what} in the shared store; limiting locally for a second");
        self.metrics.account_store_error();
        self.learnt.store(0, Ordering::Relaxed);
        self.down_until.store((now + ACCOUNT_RETRY).as_u64(), Ordering::Relaxed);
    }

    /// The guard of one slot taken on `key` under `lease`: renewed while held, and given back
    /// with a word to every instance waiting for a slot.
    pub(super) fn slot(&self, key: &str, limiter: &Limiter, lease: Lease) -> SlotGuard {
        SlotGuard::new(self.store.clone(), key.to_owned(), limiter.clone(), 1, lease).telling(&self.freed_channel)
    }

    /// The store's answer about the learnt limit: what every instance hands out now.
    pub(super) fn heard(&self, limit: SharedLimit) {
        self.learnt.store(usize::try_from(limit.current).unwrap_or(usize::MAX), Ordering::Relaxed);
    }
}

impl FairQueue {
    /// Learns from `slot`'s use, if the limit is adaptive — here, and in the shared store when
    /// the slot was claimed there — and lets a job waiting for a slot the new limit frees go.
    pub(super) async fn learn(&self, slot: &AccountSlot, signal: Signal) {
        let Some(adaptive) = &self.adaptive else { return };
        let now = self.clock.now();
        let others = self.state().in_flight.saturating_sub(1);
        // Always learnt here too: it is what limits this instance while the store cannot.
        adaptive.learn(signal, slot.taken_at, others, now);
        if let (Some(shared), Some(taken_at)) = (&self.shared, slot.shared_at)
            && let Some((learner, at)) = self.learnt_at(shared)
            && !shared.down(now)
        {
            match learner.learn(at, signal, now - slot.taken_at, taken_at).await {
                Ok(limit) => shared.heard(limit),
                Err(error) => shared.failed(&error, "learn the account's limit", self.clock.now()),
            }
        }
        self.changed.notify_waiters();
    }

    /// Where the learnt limit every instance shares is kept, when the limit is adaptive and
    /// `shared`'s store keeps one.
    pub(super) fn learnt_at<'a>(&'a self, shared: &'a Shared) -> Option<(&'a Arc<dyn SharedLearner>, LearntAt<'a>)> {
        let (adaptive, learner) = (self.adaptive.as_ref()?, shared.learner.as_ref()?);
        let at = LearntAt {
            key: &shared.learnt_key,
            in_flight_key: &shared.account_key,
            learner: adaptive.learner(),
            ceiling: self.rules.max_in_flight as u64,
        };
        Some((learner, at))
    }

    /// Reads the learnt limit every instance shares again, when there is one (another instance
    /// may have moved it), so what this one shows — `rate_limit_status`, `/metrics`, the
    /// dashboard — is the shared value. A store that cannot answer leaves the local limit shown.
    pub async fn refresh_learnt(&self) {
        let Some(shared) = &self.shared else { return };
        let now = self.clock.now();
        if let Some((learner, at)) = self.learnt_at(shared)
            && !shared.down(now)
        {
            match learner.learnt(at).await {
                Ok(limit) => shared.heard(limit),
                Err(error) => shared.failed(&error, "read the account's learnt limit", now),
            }
        }
    }

    /// This queue with the account's cap and the classes' spacing claimed in `store` when it is
    /// shared by several instances, under keys tagged `{name}` (`upstream` for the paid API's
    /// account, `proxied` for a proxied server): instances with the same name share one cap, and
    /// with an adaptive limit one learnt limit. The store's failures are counted in `metrics`.
    pub fn shared_in(mut self, store: Arc<dyn Store>, name: &str, metrics: Arc<Metrics>) -> Self {
        if store.is_shared() {
            let account = Limiter::Concurrency(Concurrency::new(self.rules.max_in_flight as u64));
            let unverified = Limiter::Concurrency(Concurrency::new(self.rules.unverified_slots.max(1) as u64));
            let gaps = self
                .rules
                .classes
                .iter()
                .map(|(_, class)| {
                    let gap = class.min_gap.filter(|gap| *gap > Nanos::ZERO)?;
                    let limiter = Limiter::Gcra(Gcra::new(1, NANOS_PER_SEC as f64 / gap.as_u64() as f64));
                    Some((format!("{{{name}}}{}_gap", class.name), limiter))
                })
                .collect();
            let freed_channel = format!("{{{name}}}account:freed");
            let tier_keys = self.rules.tiers.iter().map(|t| format!("{{{name}}}account:tier:{}", t.name)).collect();
            self.shared = Some(Shared {
                line: store.clone().shared_line(),
                name: name.to_owned(),
                instance: format!("{:016x}", rand::random::<u64>()),
                tier_keys,
                tier_limiter: Limiter::Concurrency(Concurrency::new(self.rules.max_in_flight as u64)),
                doors: AtomicU64::new(0),
                freed: store.clone().hear(&freed_channel),
                freed_channel,
                learner: store.clone().shared_learner(),
                store,
                account_key: format!("{{{name}}}account:in_flight"),
                unverified_key: format!("{{{name}}}account:unverified"),
                account,
                unverified,
                gaps,
                learnt_key: format!("{{{name}}}account:learnt"),
                learnt: AtomicUsize::new(0),
                down_until: AtomicU64::new(0),
                metrics,
            });
        }
        self
    }

    /// Claims, in the shared store, an account slot, for an unverified caller's job one of their
    /// share, and for a job of a class with a gap the gap, in one decision — under the shared
    /// learnt limit, with an adaptive one. A store that cannot answer leaves the local cap (or
    /// learnt limit), share and spacing in charge.
    ///
    /// The job may go holding these leases (none without a shared store, or when it cannot
    /// answer), taken at this reading of the store's clock when claimed under the shared learnt
    /// limit; or not yet, for this long, for this reason.
    pub(super) async fn claim(
        &self,
        class: ClassId,
        unverified: bool,
    ) -> Result<(Vec<SlotGuard>, Option<Nanos>), (Nanos, Blocker)> {
        let Some(shared) = &self.shared else { return Ok((Vec::new(), None)) };
        let now = self.clock.now();
        if shared.down(now) {
            return Ok((Vec::new(), None));
        }
        let mut checks = vec![Check { key: &shared.account_key, limiter: &shared.account, cost: 1, shadow: false }];
        let mut blockers = vec![Blocker::Account];
        if unverified {
            checks.push(Check { key: &shared.unverified_key, limiter: &shared.unverified, cost: 1, shadow: false });
            blockers.push(Blocker::UnverifiedShare);
        }
        if let Some((gap_key, gap)) = shared.gaps.get(class.index()).and_then(Option::as_ref) {
            checks.push(Check { key: gap_key, limiter: gap, cost: 1, shadow: false });
            blockers.push(Blocker::Gap);
        }
        let lease = Lease::new();
        let answer = match self.learnt_at(shared) {
            Some((learner, at)) => learner.decide_under(at, &checks, lease).await.map(|(decisions, limit)| {
                shared.heard(limit);
                (decisions, Some(limit.at))
            }),
            None => shared.store.decide_all(&checks, lease).await.map(|decisions| (decisions, None)),
        };
        match answer {
            Ok((decisions, taken_at)) if decisions.iter().all(|d| d.allowed) => {
                let mut leases = vec![shared.slot(&shared.account_key, &shared.account, lease)];
                if unverified {
                    leases.push(shared.slot(&shared.unverified_key, &shared.unverified, lease));
                }
                Ok((leases, taken_at))
            }
            Ok((decisions, _)) => {
                // The slots first: a gap passes by itself, a slot only when another job ends.
                let refused = |b: Blocker| blockers.iter().zip(&decisions).find(|(x, d)| **x == b && !d.allowed);
                let gap = refused(Blocker::Gap).map_or(Nanos::ZERO, |(_, d)| d.retry_after);
                match [Blocker::Account, Blocker::UnverifiedShare].into_iter().find(|b| refused(*b).is_some()) {
                    Some(slots) => Err((gap.max(ACCOUNT_RETRY), slots)),
                    None => Err((gap.max(Nanos::new(1)), Blocker::Gap)),
                }
            }
            Err(error) => {
                shared.failed(&error, "claim the upstream account", now);
                Ok((Vec::new(), None))
            }
        }
    }
}
