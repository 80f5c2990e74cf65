//! The Lua scripts the store runs, assembled at compile time from `crates/redis/src/*.lua`, and
//! what they decide exactly: the clock in whole microseconds, spans up to 2^52 ns.

use mcp_ratelimit_kernel::clock::Nanos;
use mcp_ratelimit_kernel::limit::Shape;
use mcp_ratelimit_kernel::store::{Check, StoreError};

/// The decide script: the prelude, every algorithm, the learnt limits, the loop history, then the
/// entry point.
pub(super) const DECIDE_SCRIPT: &str = mcp_ratelimit_kernel::limit::registry!(
    with_every_algorithm,
    "adaptive.lua",
    "adaptive/aimd.lua",
    "adaptive/gradient2.lua",
    "loop_history.lua",
    "decide.lua"
);

/// The learn script: the prelude, in-flight slots (to count what is in use), the learnt limits
/// (every learner's twin, as in [`DECIDE_SCRIPT`]), then the entry point.
pub(super) const LEARN_SCRIPT: &str = concat!(
    include_str!("prelude.lua"),
    include_str!("concurrency.lua"),
    include_str!("adaptive.lua"),
    include_str!("adaptive/aimd.lua"),
    include_str!("adaptive/gradient2.lua"),
    include_str!("learn.lua"),
);

/// The release script: the prelude, in-flight slots, then the entry point.
pub(super) const RELEASE_SCRIPT: &str =
    concat!(include_str!("prelude.lua"), include_str!("concurrency.lua"), include_str!("release.lua"),);

/// The renew script: the prelude, in-flight slots, then the entry point.
pub(super) const RENEW_SCRIPT: &str =
    concat!(include_str!("prelude.lua"), include_str!("concurrency.lua"), include_str!("renew.lua"),);

/// The adjust script (refunds and settlements): the prelude, every algorithm, then the entry point.
pub(super) const ADJUST_SCRIPT: &str = mcp_ratelimit_kernel::limit::registry!(with_every_algorithm, "adjust.lua");

/// The record script: a shared record that a final or newer one is never replaced by.
pub(super) const RECORD_SCRIPT: &str = include_str!("record.lua");

/// The loop answer script: the prelude, the loop history, then the entry point.
pub(super) const LOOP_ANSWER_SCRIPT: &str =
    concat!(include_str!("prelude.lua"), include_str!("loop_history.lua"), include_str!("loop_answer.lua"));

/// The longest bucket (capacity × period) or window, in ns, the scripts decide exactly: two of
/// them added still fit in the 53 bits of a Lua number's integer range.
pub(super) const MAX_SPAN: Nanos = Nanos::new(1 << 52);

/// Integers the scripts hold exactly (a clock reading in microseconds must stay below).
pub(super) const MAX_EXACT: u64 = 1 << 53;

/// `signature` as 32 lowercase hex digits, without an allocation (a call's loop signature, as
/// the loop history keeps it).
pub(super) fn hex(signature: u128) -> [u8; 32] {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = [0u8; 32];
    for (i, digit) in out.iter_mut().enumerate() {
        *digit = DIGITS[((signature >> (4 * (31 - i))) & 0xf) as usize];
    }
    out
}

/// A clock reading in whole epoch microseconds below 2^53, as the scripts read time.
pub(super) fn micros(now: Nanos) -> Result<u64, StoreError> {
    let now = now.as_u64();
    if !now.is_multiple_of(1_000) || now / 1_000 >= MAX_EXACT {
        return Err(StoreError::OutOfRange(format!(
            "clock reading {now} ns: the Redis store reads time in whole microseconds below 2^53"
        )));
    }
    Ok(now / 1_000)
}

/// Values in the script's reply per check: allowed, limit, remaining, retry_after, reset_after.
pub(super) const REPLY_FIELDS: usize = 5;

/// The span the scripts take for a check's limiter (a bucket's period, a window's length, 0 for
/// in-flight slots), in nanoseconds, once the check is known to be decidable exactly.
pub(super) fn script_span(check: &Check<'_>) -> Result<u64, StoreError> {
    let limiter = check.limiter;
    let capacity = limiter.capacity();
    let out_of_range =
        |why: String| StoreError::OutOfRange(format!("check on `{}` ({}): {why}", check.key, limiter.describe()));
    if check.cost > capacity {
        return Err(out_of_range(format!("cost {} is above its capacity {capacity}", check.cost)));
    }
    if capacity > MAX_SPAN.as_u64() || limiter.policy_window().unwrap_or(Nanos::ZERO) > MAX_SPAN {
        return Err(out_of_range(format!(
            "its bucket or window exceeds {} days, the most the Redis store decides exactly",
            MAX_SPAN.as_u64() / (86_400 * mcp_ratelimit_kernel::clock::NANOS_PER_SEC)
        )));
    }
    Ok(match limiter.shape() {
        Shape::Rate { period } => period.as_u64(),
        Shape::Window { window } => window.as_u64(),
        Shape::Slots => 0,
    })
}
