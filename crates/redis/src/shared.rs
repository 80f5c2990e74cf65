//! The Redis store as the [`Store`], [`LoopHistory`] and [`JobMirror`] the layers above use (and,
//! in `learner.rs`, the shared learnt limit), and
//! the leases this instance holds and renews.

use std::time::Duration;

use super::{HeldLease, HeldSlots, Lease, RedisStore, Renewed, StoreError};
use mcp_ratelimit_kernel::clock::Nanos;
use mcp_ratelimit_kernel::limit::{Adjustment, Decision, Limiter};
use mcp_ratelimit_kernel::store::{
    Blocks, Broadcast, Budgets, Check, JobMirror, LoopCall, LoopHistory, Slots, Store, StoreFuture, Verdict,
};

impl RedisStore {
    fn held(&self) -> std::sync::MutexGuard<'_, HeldSlots> {
        // Entries are inserted and removed whole: a poisoned map is still consistent.
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Renews every lease this instance holds, in one round trip; see [`Slots::renew_leases`].
    async fn renew_held(&self) -> Result<(), StoreError> {
        let leases: Vec<(String, Lease, u64, u64)> =
            self.held().iter().map(|((key, lease), (units, cap))| (key.clone(), *lease, *units, *cap)).collect();
        let borrowed: Vec<HeldLease<'_>> = leases
            .iter()
            .map(|(key, lease, units, capacity)| HeldLease { key, lease: *lease, units: *units, capacity: *capacity })
            .collect();
        let answers = self.renew(&borrowed).await?;
        let count = |what: Renewed| answers.iter().filter(|a| **a == what).count();
        let (retaken, lost) = (count(Renewed::Retaken), count(Renewed::Lost));
        if retaken > 0 {
            tracing::warn!(
                target: "mcp_ratelimit::store::redis::shared", retaken,
                "in-flight leases had expired (Redis unreachable for a whole lease) and were taken again"
            );
        }
        if lost > 0 {
            tracing::warn!(
                target: "mcp_ratelimit::store::redis::shared", lost,
                "in-flight leases had expired and their caps are full (others took the slots meanwhile): no \
                 longer counted, their jobs run on uncounted until they end"
            );
        }
        let mut held = self.held();
        for (lease, answer) in borrowed.iter().zip(&answers) {
            if matches!(answer, Renewed::Lost | Renewed::GivenBack) {
                held.remove(&(lease.key.to_owned(), lease.lease));
            }
        }
        Ok(())
    }

    /// A call's decision, after its loop check when it has one: from this instance's slices where
    /// every check may be sliced (its blocks and loop check still read in Redis), else in Redis,
    /// what the slices hold counted in each `remaining`.
    async fn decide_with(
        &self,
        checks: &[Check<'_>],
        blocks: &[&str],
        looped: Option<LoopCall<'_>>,
        lease: Lease,
    ) -> Result<Verdict, StoreError> {
        match &self.slices {
            Some(slices) if super::slices::sliceable(checks) => {
                self.decide_sliced(slices, checks, (blocks, looped), lease).await
            }
            Some(slices) => {
                let mut verdict = self.run_unless_blocked(checks, blocks, looped, None, lease).await?;
                if let Verdict::Decided(decisions) = &mut verdict {
                    slices.count_held(checks, decisions);
                }
                Ok(verdict)
            }
            None => self.run_unless_blocked(checks, blocks, looped, None, lease).await,
        }
    }
}

/// The shared store: every decision one script on Redis's clock, in-flight slots as leases this
/// instance renews until it gives them back.
impl Budgets for RedisStore {
    fn decide<'a>(&'a self, checks: &'a [Check<'a>], blocks: &'a [&'a str], lease: Lease) -> StoreFuture<'a, Verdict> {
        Box::pin(async move { self.decide_with(checks, blocks, None, lease).await })
    }

    fn adjust<'a>(
        &'a self,
        budgets: &'a [(&'a str, &'a Limiter, Adjustment)],
        once: Option<&'a str>,
    ) -> StoreFuture<'a, Vec<Decision>> {
        Box::pin(async move { RedisStore::adjust(self, budgets, once, None).await })
    }

    fn forget<'a>(&'a self, keys: &'a [&'a str]) -> StoreFuture<'a, u64> {
        Box::pin(async move { RedisStore::forget(self, keys).await })
    }
}

impl Slots for RedisStore {
    /// Gives the lease back in a task of its own (this is called from `Drop`), tried again while
    /// Redis does not take it; one that never lands is logged, and the lease then runs out by
    /// itself.
    fn release(self: std::sync::Arc<Self>, key: &str, _limiter: &Limiter, _cost: u64, lease: Lease) {
        self.held().remove(&(key.to_owned(), lease));
        super::GiveBack::of(&self).spawn(vec![key.to_owned()], lease);
    }

    fn release_telling(
        self: std::sync::Arc<Self>,
        key: &str,
        _limiter: &Limiter,
        _cost: u64,
        lease: Lease,
        channel: &str,
    ) {
        self.held().remove(&(key.to_owned(), lease));
        super::GiveBack::of(&self).telling(channel).spawn(vec![key.to_owned()], lease);
    }

    fn hold(&self, key: &str, lease: Lease, units: u64, capacity: u64) {
        self.held().insert((key.to_owned(), lease), (units, capacity));
    }

    fn renew_leases(&self) -> StoreFuture<'_, ()> {
        Box::pin(async move { self.renew_held().await })
    }

    fn renew_every(&self) -> Option<Duration> {
        Some(self.lease / 3)
    }
}

impl Blocks for RedisStore {
    fn block<'a>(&'a self, key: &'a str, duration: Duration) -> StoreFuture<'a, ()> {
        Box::pin(async move { RedisStore::block(self, key, duration).await })
    }

    fn unblock<'a>(&'a self, key: &'a str) -> StoreFuture<'a, bool> {
        Box::pin(async move { Ok(RedisStore::forget(self, &[key]).await? > 0) })
    }

    fn block_left<'a>(&'a self, key: &'a str) -> StoreFuture<'a, Option<Nanos>> {
        Box::pin(async move { RedisStore::block_left(self, key).await })
    }
}

impl Broadcast for RedisStore {
    fn bump<'a>(&'a self, key: &'a str) -> StoreFuture<'a, u64> {
        Box::pin(async move { RedisStore::bump(self, key).await })
    }

    fn counter<'a>(&'a self, key: &'a str) -> StoreFuture<'a, u64> {
        Box::pin(async move { RedisStore::counter(self, key).await })
    }

    fn hear(self: std::sync::Arc<Self>, channel: &str) -> Option<tokio::sync::watch::Receiver<u64>> {
        Some(self.hear_channel(channel))
    }
}

impl Store for RedisStore {
    fn is_shared(&self) -> bool {
        true
    }

    /// Budgets expire in Redis by themselves; what is swept here is the memory of keys that had
    /// slices.
    fn sweep(&self) -> usize {
        self.slices.as_ref().map_or(0, super::slices::Slices::sweep)
    }

    fn slices_held(&self) -> (u64, u64) {
        RedisStore::slices_held(self)
    }

    fn traffic(&self) -> (u64, u64) {
        self.connection.traffic()
    }

    fn slice_of(&self, key: &str, limiter: &Limiter) -> u64 {
        self.slices.as_ref().map_or(0, |slices| slices.held_of(key, limiter))
    }

    fn give_back_held(&self) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            self.give_back_slices().await;
            Ok(())
        })
    }

    fn loop_history(self: std::sync::Arc<Self>) -> Option<std::sync::Arc<dyn LoopHistory>> {
        Some(self)
    }

    fn job_mirror(self: std::sync::Arc<Self>) -> Option<std::sync::Arc<dyn JobMirror>> {
        Some(self)
    }

    fn shared_line(self: std::sync::Arc<Self>) -> Option<std::sync::Arc<dyn mcp_ratelimit_kernel::store::SharedLine>> {
        Some(self)
    }

    fn shared_learner(
        self: std::sync::Arc<Self>,
    ) -> Option<std::sync::Arc<dyn mcp_ratelimit_kernel::store::SharedLearner>> {
        Some(self)
    }
}

/// The loop history beside the budgets: a call's loop check is one more part of its decision's
/// script (`loop_history.lua`, run by `decide.lua`).
impl LoopHistory for RedisStore {
    fn decide_after_loop_check<'a>(
        &'a self,
        call: LoopCall<'a>,
        checks: &'a [Check<'a>],
        blocks: &'a [&'a str],
        lease: Lease,
    ) -> StoreFuture<'a, Verdict> {
        Box::pin(async move { self.decide_with(checks, blocks, Some(call), lease).await })
    }

    fn answered<'a>(
        &'a self,
        answer: mcp_ratelimit_kernel::store::LoopAnswered<'a>,
    ) -> StoreFuture<'a, mcp_ratelimit_kernel::store::Streaked> {
        Box::pin(async move { self.loop_answered(answer, None).await })
    }
}

impl JobMirror for RedisStore {
    fn put_record<'a>(&'a self, key: &'a str, value: &'a str, version: u64, ttl: Duration) -> StoreFuture<'a, bool> {
        Box::pin(async move { RedisStore::put_record(self, key, value, version, ttl).await })
    }

    fn get<'a>(&'a self, key: &'a str) -> StoreFuture<'a, Option<String>> {
        Box::pin(async move { RedisStore::get(self, key).await })
    }

    fn set_add<'a>(&'a self, key: &'a str, member: &'a str, ttl: Duration) -> StoreFuture<'a, ()> {
        Box::pin(async move { RedisStore::set_add(self, key, member, ttl).await })
    }

    fn set_members<'a>(&'a self, key: &'a str) -> StoreFuture<'a, Vec<String>> {
        Box::pin(async move { RedisStore::set_members(self, key).await })
    }

    fn set_remove<'a>(&'a self, key: &'a str, members: &'a [String]) -> StoreFuture<'a, ()> {
        Box::pin(async move { RedisStore::set_remove(self, key, members).await })
    }

    fn announce<'a>(&'a self, key: &'a str, member: &'a str, keep: Duration, channel: &'a str) -> StoreFuture<'a, ()> {
        Box::pin(async move { RedisStore::announce(self, key, member, keep, channel).await })
    }

    fn announced<'a>(&'a self, key: &'a str) -> StoreFuture<'a, Vec<String>> {
        Box::pin(async move { RedisStore::announced(self, key).await })
    }

    fn withdraw<'a>(&'a self, key: &'a str, members: &'a [String]) -> StoreFuture<'a, ()> {
        Box::pin(async move { RedisStore::withdraw(self, key, members).await })
    }

    fn take_once<'a>(&'a self, key: &'a str, ttl: Duration) -> StoreFuture<'a, bool> {
        Box::pin(async move { RedisStore::take_once(self, key, ttl).await })
    }
}
