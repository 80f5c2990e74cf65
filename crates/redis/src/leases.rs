//! In-flight slots held under leases: given back when the work ends (or its decision was
//! cancelled before an answer), renewed on a schedule while it runs.

use std::collections::HashMap;
use std::time::Duration;

use ::redis::Script;
use ::redis::cluster_routing::Slot;

use mcp_ratelimit_kernel::store::{Check, Lease, StoreError};

use crate::batch::Invocation;
use crate::connection::Connection;
use crate::errors::bounded;
use crate::{HeldLease, RedisStore, Renewed};

impl RedisStore {
    /// Gives back the in-flight slots `lease` holds on `key`, when the work ends. A lease that is
    /// gone already (expired, or given back) has nothing to give back.
    pub async fn release(&self, key: &str, lease: Lease) -> Result<(), StoreError> {
        let mut invocation = Invocation::of(&self.release);
        invocation.key(key);
        invocation.arg(lease.id()).arg(u64::try_from(self.lease.as_micros()).unwrap_or(u64::MAX));
        let _in_flight: i64 = bounded(&self.address, self.timeout, self.connection.invoke(&invocation)).await?;
        Ok(())
    }

    /// Extends every lease in `held` by another lease duration, in one script (on a cluster, one
    /// per hash slot, side by side), and says what became of each, in order. A lease that
    /// expired meanwhile is taken again, as its work still runs, if its key's cap has room; one
    /// given back meanwhile is never taken again.
    pub async fn renew(&self, held: &[HeldLease<'_>]) -> Result<Vec<Renewed>, StoreError> {
        let batches: Vec<Vec<usize>> = match self.connection {
            Connection::Node { .. } => vec![(0..held.len()).collect()],
            // A cluster runs one script on one slot's keys only; leases of many callers span many.
            Connection::Cluster(..) => {
                let mut by_slot: HashMap<Slot, Vec<usize>> = HashMap::new();
                for (i, lease) in held.iter().enumerate() {
                    by_slot.entry(Slot::for_key(lease.key)).or_default().push(i);
                }
                by_slot.into_values().collect()
            }
        };
        let renewing = batches.iter().filter(|batch| !batch.is_empty()).map(|batch| self.renew_batch(held, batch));
        let mut answers = vec![Renewed::Renewed; held.len()];
        for (batch, statuses) in batches.iter().zip(futures::future::try_join_all(renewing).await?) {
            for (&i, status) in batch.iter().zip(statuses) {
                answers[i] = status;
            }
        }
        Ok(answers)
    }

    /// [`RedisStore::renew`] for the leases at `indices` of `held`, whose keys share a slot.
    async fn renew_batch(&self, held: &[HeldLease<'_>], indices: &[usize]) -> Result<Vec<Renewed>, StoreError> {
        let mut invocation = Invocation::of(&self.renew);
        invocation.arg(u64::try_from(self.lease.as_micros()).unwrap_or(u64::MAX));
        for lease in indices.iter().filter_map(|&i| held.get(i)) {
            invocation.key(lease.key).arg(lease.lease.id()).arg(lease.units).arg(lease.capacity);
        }
        let statuses: Vec<i64> = bounded(&self.address, self.timeout, self.connection.invoke(&invocation)).await?;
        if statuses.len() != indices.len() {
            return Err(self.malformed(format!(
                "renew.lua answered {} statuses for {} leases",
                statuses.len(),
                indices.len()
            )));
        }
        statuses
            .into_iter()
            .map(|status| match status {
                0 => Ok(Renewed::Renewed),
                1 => Ok(Renewed::Retaken),
                2 => Ok(Renewed::GivenBack),
                3 => Ok(Renewed::Lost),
                other => Err(self.malformed(format!("renew.lua answered status {other}"))),
            })
            .collect()
    }
}

/// The in-flight slots a decision in flight may take under its lease, on the keys it names:
/// given back if it is dropped before [`Unanswered::answered`] — the decision was cancelled, or
/// failed without an answer that says what it took. Giving a lease back is safe whether or not
/// the script ran: `release.lua` takes only that lease's units, and leaves a tombstone a late
/// renewal cannot revive. (The release goes on the same connection after the decision, so Redis
/// runs it after.)
pub(super) struct Unanswered {
    /// The keys to give back on, while armed; `None` for a decision that can take no slot.
    pub(super) release: Option<(GiveBack, Vec<String>)>,
    pub(super) lease: Lease,
}

impl Unanswered {
    pub(super) fn of(store: &RedisStore, checks: &[Check<'_>], lease: Lease) -> Self {
        let keys: Vec<String> =
            checks.iter().filter(|c| c.cost > 0 && c.limiter.holds_slots()).map(|c| c.key.to_owned()).collect();
        let release = (!keys.is_empty()).then(|| (GiveBack::of(store), keys));
        Self { release, lease }
    }

    /// The answer is in hand: what it took is the caller's to hold now.
    pub(super) fn answered(mut self) {
        self.release = None;
    }
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        if let Some((give_back, keys)) = self.release.take() {
            give_back.spawn(keys, self.lease);
        }
    }
}

/// What giving a lease back takes, owned, so it can run in a task of its own (from `Drop`).
pub(super) struct GiveBack {
    connection: Connection,
    script: Script,
    address: String,
    timeout: Duration,
    lease: Duration,
    /// A channel the release says so on, when it gives slots back (`release.lua`).
    tell: Option<String>,
}

/// The first pause before a release Redis did not take is tried again; it doubles.
const RELEASE_PAUSE: Duration = Duration::from_millis(100);

impl GiveBack {
    pub(super) fn of(store: &RedisStore) -> Self {
        Self {
            connection: store.connection.clone(),
            script: store.release.clone(),
            address: store.address.clone(),
            timeout: store.timeout,
            lease: store.lease,
            tell: None,
        }
    }

    /// This release, said on `channel` when it gives slots back.
    pub(super) fn telling(self, channel: &str) -> Self {
        Self { tell: Some(channel.to_owned()), ..self }
    }

    /// Gives back `lease`'s slots on every one of `keys` in a task of its own, trying each again
    /// (a growing pause, up to a second) while Redis does not take it — a restart, a slow link
    /// — for as long as the lease would hold them: after that it has run out by itself. Every
    /// try is safe to repeat (`release.lua` takes that lease's units, once).
    pub(super) fn spawn(self, keys: Vec<String>, lease: Lease) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(target: "mcp_ratelimit::store::redis", "in-flight slots were released outside the runtime: their lease will run out");
            return;
        };
        runtime.spawn(async move {
            let lease_us = u64::try_from(self.lease.as_micros()).unwrap_or(u64::MAX);
            let give_up_at = tokio::time::Instant::now() + self.lease;
            for key in &keys {
                let mut pause = RELEASE_PAUSE;
                loop {
                    let mut invocation = Invocation::of(&self.script);
        invocation.key(key);
                    invocation.arg(lease.id()).arg(lease_us);
                    if let Some(channel) = &self.tell {
                        invocation.arg(channel);
                    }
                    let given: Result<i64, StoreError> =
                        bounded(&self.address, self.timeout, self.connection.invoke(&invocation)).await;
                    let Err(error) = given else { break };
                    if tokio::time::Instant::now() + pause >= give_up_at {
                        tracing::warn!(target: "mcp_ratelimit::store::redis", %error, "could not give in-flight slots back to Redis: their lease will run out");
                        break;
                    }
                    tokio::time::sleep(pause).await;
                    pause = pause.saturating_mul(2).min(Duration::from_secs(1));
                }
            }
        });
    }
}
