//! The Redis store as the [`SharedLearner`]: the upstream account's learnt concurrency limit in
//! one key (`adaptive.lua`, `learn.lua`), claimed under in the same script as the account's
//! slots (`decide.lua`).

use std::time::Duration;

use super::{RedisStore, StoreError, bounded, micros};
use crate::batch::Invocation;
use mcp_ratelimit_kernel::clock::Nanos;
use mcp_ratelimit_kernel::limit::Decision;
use mcp_ratelimit_kernel::limit::adaptive::{Algorithm, Learner, Sample, Signal};
use mcp_ratelimit_kernel::store::{Check, LearntAt, Lease, SharedLearner, SharedLimit, StoreFuture, Verdict};

/// How long a learnt limit is kept past its last use (a claim, an answer, a read): an account
/// left alone this long starts again from its ceiling, as a freshly started instance would.
pub(crate) const LEARNT_TTL: Duration = Duration::from_secs(3600);

/// [`LEARNT_TTL`] in milliseconds, as the scripts take it.
pub(super) fn learnt_ttl_ms() -> u64 {
    u64::try_from(LEARNT_TTL.as_millis()).unwrap_or(u64::MAX)
}

/// `learner` as the scripts read it: "name min max backoff_ratio tolerance smoothing long_window
/// queue_size" (`adaptive.lua`). Floats are written as Rust's shortest form that reads back to
/// the same double, so both twins learn from the very same parameters.
pub(super) fn spec(learner: &Learner) -> String {
    // AIMD reads none of gradient2's parameters; any numbers hold their places.
    let (tolerance, smoothing, long_window, queue_size) = match learner.algorithm() {
        Algorithm::Aimd => (1.0, 1.0, 1, 1),
        Algorithm::Gradient2(g) => (g.tolerance, g.smoothing, g.long_window, g.queue_size),
    };
    format!(
        "{} {} {} {} {tolerance} {smoothing} {long_window} {queue_size}",
        learner.algorithm().name(),
        learner.min(),
        learner.max(),
        learner.backoff_ratio(),
    )
}

impl RedisStore {
    /// [`SharedLearner::decide_under`], at an explicit clock reading when `now` is given (see
    /// [`RedisStore::decide_at`]).
    pub async fn decide_under(
        &self,
        at: LearntAt<'_>,
        checks: &[Check<'_>],
        lease: Lease,
        now: Option<Nanos>,
    ) -> Result<(Vec<Decision>, SharedLimit), StoreError> {
        let now_us = now.map(micros).transpose()?;
        match self.run_script(checks, &[], None, Some(at), now_us, lease).await? {
            (Verdict::Decided(decisions), Some(limit)) => Ok((decisions, limit)),
            _ => Err(self.malformed("a decision under a learnt limit answered something else".into())),
        }
    }

    /// Teaches the limit `at` one `sample` with every field as given — what is in use besides it
    /// (`others`), when the slot was taken and now (whole microseconds) — instead of counting and
    /// reading Redis's clock: the parity runs against [`Learner::learn`] go through here. Returns
    /// the limit after it and its exact value.
    pub async fn learn_sample(&self, at: LearntAt<'_>, sample: &Sample) -> Result<(SharedLimit, f64), StoreError> {
        self.run_learn(
            at,
            Some(sample.signal),
            sample.rtt,
            micros(sample.taken_at)?,
            Some(sample.others),
            Some(micros(sample.now)?),
        )
        .await
    }

    /// Runs `learn.lua`: `signal` (none: only read) for a slot taken at `taken_us`, after `rtt`.
    async fn run_learn(
        &self,
        at: LearntAt<'_>,
        signal: Option<Signal>,
        rtt: Nanos,
        taken_us: u64,
        others: Option<usize>,
        now_us: Option<u64>,
    ) -> Result<(SharedLimit, f64), StoreError> {
        let mut invocation = Invocation::of(&self.learn);
        invocation.key(at.key);
        invocation.key(at.in_flight_key);
        invocation.arg(now_us.map_or_else(String::new, |us| us.to_string()));
        invocation.arg(learnt_ttl_ms()).arg(spec(at.learner));
        invocation.arg(match signal {
            Some(Signal::Accepted) => "1",
            Some(Signal::Overloaded) => "0",
            Some(Signal::TimedOut) => "2",
            None => "",
        });
        invocation.arg(rtt.as_u64()).arg(taken_us).arg(others.map_or_else(String::new, |n| n.to_string()));
        let (current, limit, now_us): (i64, String, i64) =
            bounded(&self.address, self.timeout, self.connection.invoke(&invocation)).await?;
        let limit = limit.parse::<f64>().map_err(|_| self.malformed(format!("learn.lua answered limit {limit:?}")))?;
        let unsigned = |v: i64| u64::try_from(v).map_err(|_| self.malformed(format!("negative value {v}")));
        Ok((SharedLimit { current: unsigned(current)?, at: Nanos::from_micros(unsigned(now_us)?) }, limit))
    }
}

/// The learnt limit beside the account's slots, on Redis's clock.
impl SharedLearner for RedisStore {
    fn decide_under<'a>(
        &'a self,
        at: LearntAt<'a>,
        checks: &'a [Check<'a>],
        lease: Lease,
    ) -> StoreFuture<'a, (Vec<Decision>, SharedLimit)> {
        Box::pin(async move { RedisStore::decide_under(self, at, checks, lease, None).await })
    }

    fn learn<'a>(
        &'a self,
        at: LearntAt<'a>,
        signal: Signal,
        rtt: Nanos,
        taken_at: Nanos,
    ) -> StoreFuture<'a, SharedLimit> {
        // `taken_at` is a reading of the scripts' own clock: whole microseconds.
        let taken_us = taken_at.as_u64() / 1_000;
        Box::pin(async move { Ok(self.run_learn(at, Some(signal), rtt, taken_us, None, None).await?.0) })
    }

    fn learnt<'a>(&'a self, at: LearntAt<'a>) -> StoreFuture<'a, SharedLimit> {
        Box::pin(async move { Ok(self.run_learn(at, None, Nanos::ZERO, 0, None, None).await?.0) })
    }
}
