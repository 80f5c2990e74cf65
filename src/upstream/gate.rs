//! The gate both doors put in front of their upstream — the reference server before the paid
//! API's jobs, the proxy before the proxied server's calls: the account's fair queue, built once
//! the same way with its breaker, and the one check before a call is charged (the upstream not known down, then a
//! place in the queue), with the refusals an agent reads. Nothing is charged for a call this
//! gate refuses.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::breaker::Breaker;
use crate::clock::{Nanos, SharedClock, ceil_ms};
use crate::config::UpstreamConfig;
use crate::guard::Refusal;
use crate::identity::Caller;
use crate::rate_limits::RateLimits;
use crate::upstream::adaptive::AdaptiveLimit;
use crate::upstream::classes::ClassId;
use crate::upstream::queue::{FairQueue, QueueFull, QueuePlace, QueueRules};

/// The upstream's circuit breaker, as `[upstream]` configures it: `breaker_failures` failures in a
/// row open it for `breaker_cooldown_ms`.
pub fn breaker(up: &UpstreamConfig) -> Breaker {
    Breaker::new(up.breaker_failures, Nanos::from_millis(up.breaker_cooldown_ms))
}

/// The account's fair queue under `rules`, its slots learnt as `adaptive` says, kept in the
/// limits' store under `name` (one line for every instance on a shared store), its turns given
/// out until `stop`.
pub fn start_queue(
    rules: QueueRules,
    adaptive: Option<AdaptiveLimit>,
    limits: &RateLimits,
    name: &str,
    clock: SharedClock,
    stop: CancellationToken,
) -> Arc<FairQueue> {
    let queue = Arc::new(FairQueue::new(rules, clock).adaptive(adaptive).shared_in(
        limits.guard().store().clone(),
        name,
        limits.metrics().clone(),
    ));
    tokio::spawn(queue.clone().dispatch(stop));
    queue
}

/// Refused before charging while the upstream is known down (its breaker open for `open_for`),
/// saying `why` and the cool-down left.
pub fn up(tool: &str, open_for: Option<Nanos>, why: &str) -> Result<(), Refusal> {
    open_for.map_or(Ok(()), |wait| Err(unavailable(tool, why, wait)))
}

/// `upstream_unavailable` for `tool`, saying `why`, with `wait` (at least a millisecond) to wait.
pub fn unavailable(tool: &str, why: &str, wait: Nanos) -> Refusal {
    Refusal::upstream_unavailable(tool, why, ceil_ms(wait).max(1))
}

/// A place in `queue` for a call of `class` by `caller`, held while the call is admitted; or the
/// refusal that says why there is none, with `frees_in` (asked only then) as the wait.
pub fn place(
    tool: &str,
    caller: &Caller,
    queue: &Arc<FairQueue>,
    class: ClassId,
    frees_in: impl FnOnce() -> Nanos,
) -> Result<QueuePlace, Refusal> {
    let standing = queue.rules().standing(caller.tier(), caller.unverified_from().is_some());
    queue.reserve(class, standing).map_err(|full| {
        let wait = frees_in();
        match full {
            QueueFull::Full => Refusal::queue_full(tool, wait),
            QueueFull::UnverifiedShare { slots, places } => Refusal::unverified_share_full(tool, wait, slots, places),
            QueueFull::Reserved => Refusal::queue_reserved(tool, wait),
        }
    })
}
