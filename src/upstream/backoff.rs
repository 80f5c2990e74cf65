//! When to try the upstream again, and when to stop trying.
//!
//! This is for work the server owns — queued submissions, background polls of running jobs —
//! not for agents' calls, which are refused at once with a `retry_after` instead. Three pieces:
//!
//! - [`parse_retry_after`] reads the upstream's `Retry-After` header (delta-seconds or an
//!   HTTP-date).
//! - [`Backoff`] turns "attempt `n` failed" into a [`Retry`]: a jittered exponential delay
//!   that never undercuts the upstream's `Retry-After`, or a reason to give up a user can read.
//! - [`RetryBudget`] caps retries at a share of recent original requests, so a failing
//!   upstream is never hit by a retry storm on top of its normal load.

use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use crate::clock::{Nanos, ceil_secs};

/// The delay after the first failure, and the least delay ever waited.
pub const BASE: Duration = Duration::from_millis(500);
/// The most a delay grows to, jitter included (only the upstream's `Retry-After` can exceed it).
pub const CAP: Duration = Duration::from_secs(30);
/// How far a delay is spread either side of its nominal value: ±20 %, so many jobs failing at
/// the same instant do not all come back at the same instant.
pub const JITTER: f64 = 0.2;

/// The longest `Retry-After` we believe: anything further is read as one day, not overflowed.
const RETRY_AFTER_LIMIT: Duration = Duration::from_secs(24 * 60 * 60);

/// How long the upstream asked us to wait, from a `Retry-After` header value.
///
/// Accepts delta-seconds (a non-negative integer, RFC 9110; a non-negative decimal such as
/// `"1.5"` is tolerated because some APIs send one) and an HTTP-date in any form `httpdate`
/// reads (IMF-fixdate, RFC 850, asctime). A date at or before `now` means [`Duration::ZERO`].
/// Surrounding whitespace is ignored. Values above one day are read as one day. Anything
/// else — negatives, `NaN`, exponents, garbage — is `None`.
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    let wait = if let Some(secs) = delta_seconds(value) {
        secs
    } else {
        let at = httpdate::parse_http_date(value).ok()?;
        at.duration_since(now).unwrap_or(Duration::ZERO)
    };
    Some(wait.min(RETRY_AFTER_LIMIT))
}

/// Delta-seconds: `digits` or `digits.digits`, nothing else. The shape is checked by hand
/// because `f64::from_str` also takes `"inf"`, `"NaN"`, `"+1"` and `"1e9"`.
fn delta_seconds(value: &str) -> Option<Duration> {
    let (whole, fraction) = match value.split_once('.') {
        Some((whole, fraction)) => (whole, Some(fraction)),
        None => (value, None),
    };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(whole) || !fraction.is_none_or(digits) {
        return None;
    }
    let Some(fraction) = fraction else {
        // Only an overflow can fail here (the digits are checked), and that is "absurdly long".
        return Some(whole.parse::<u64>().map_or(RETRY_AFTER_LIMIT, Duration::from_secs));
    };
    // The digits and the dot are checked, so this parses; a huge value comes out as infinity.
    let secs: f64 = format!("{whole}.{fraction}").parse().ok()?;
    if secs >= RETRY_AFTER_LIMIT.as_secs_f64() {
        return Some(RETRY_AFTER_LIMIT);
    }
    // Rounded up to the nanosecond: the upstream's floor is never undercut.
    Some(Duration::from_nanos((secs * 1e9).ceil() as u64))
}

/// The retry policy for one kind of server-owned work: how many attempts, and how long a
/// `Retry-After` we are willing to wait out.
#[derive(Debug, Clone, PartialEq)]
pub struct Backoff {
    max_attempts: u32,
    max_retry_after: Duration,
}

/// What to do after a failed attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum Retry {
    /// Try again once this long has passed.
    After(Duration),
    /// Stop: the work fails, with this as its reason.
    GiveUp(GiveUp),
}

/// Why the server stopped retrying. Its [`Display`](fmt::Display) is a sentence for the
/// failed job's `reason`.
#[derive(Debug, Clone, PartialEq)]
pub enum GiveUp {
    /// Every allowed attempt was made and failed.
    Exhausted {
        /// How many attempts were made in all.
        attempts: u32,
    },
    /// The upstream asked for a wait longer than `upstream.max_retry_after_ms`; parking the job
    /// that long would look like a hang, so it fails now and the user can decide.
    RetryAfterTooLong {
        /// The wait the upstream asked for.
        retry_after: Duration,
    },
}

impl fmt::Display for GiveUp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Exhausted { attempts: 1 } => f.write_str("gave up after 1 attempt"),
            Self::Exhausted { attempts } => write!(f, "gave up after {attempts} attempts"),
            Self::RetryAfterTooLong { retry_after } => {
                write!(
                    f,
                    "the upstream asked us to wait {} s, more than upstream.max_retry_after_ms allows",
                    ceil_secs(Nanos::from(*retry_after))
                )
            }
        }
    }
}

impl std::error::Error for GiveUp {}

impl Backoff {
    /// At most `max_attempts` attempts in all (at least 1), and no waiting out a `Retry-After`
    /// longer than `max_retry_after`.
    pub fn new(max_attempts: u32, max_retry_after: Duration) -> Self {
        Self { max_attempts: max_attempts.max(1), max_retry_after }
    }

    /// How many attempts are made in all, the first included.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// After `failed_attempts` attempts (counted from 1; 0 is read as 1) have failed, what to do
    /// next, given the upstream's `Retry-After` if it sent one.
    ///
    /// Running out of attempts is checked first: with no attempt left the upstream's wait is
    /// moot, and "gave up after 5 attempts" is the true reason. Otherwise a `Retry-After` above
    /// the maximum gives up at once. Otherwise the delay is `min(CAP, BASE × 2^(n−1))` times a
    /// uniform factor in `[1 − JITTER, 1 + JITTER]`, kept within `[BASE, CAP]`, and then
    /// raised to the `Retry-After` if that is longer.
    pub fn after_failure(
        &self,
        failed_attempts: u32,
        retry_after: Option<Duration>,
        rng: &mut impl rand::Rng,
    ) -> Retry {
        let failed_attempts = failed_attempts.max(1);
        if failed_attempts >= self.max_attempts {
            return Retry::GiveUp(GiveUp::Exhausted { attempts: failed_attempts });
        }
        if let Some(retry_after) = retry_after
            && retry_after > self.max_retry_after
        {
            return Retry::GiveUp(GiveUp::RetryAfterTooLong { retry_after });
        }
        let nominal = nominal_nanos(failed_attempts);
        let factor = rng.random_range(1.0 - JITTER..=1.0 + JITTER);
        let jittered = Duration::from_nanos((nominal.as_u64() as f64 * factor).round() as u64).clamp(BASE, CAP);
        Retry::After(jittered.max(retry_after.unwrap_or(Duration::ZERO)))
    }
}

/// `min(CAP, BASE × 2^(n−1))` in nanoseconds, without overflow for any `n >= 1`.
fn nominal_nanos(failed_attempts: u32) -> Nanos {
    let (base, cap) = (Nanos::from(BASE), Nanos::from(CAP));
    1u64.checked_shl(failed_attempts.saturating_sub(1)).map_or(cap, |m| (base * m).min(cap))
}

/// How many sub-buckets the sliding window is kept in.
const SLOTS: usize = 10;

/// Retries the server owns are capped at a share of recent original requests, so a failing
/// upstream never sees a retry storm (Envoy/Finagle style).
///
/// A retry is allowed while `retries + 1 <= min_retries + ratio × requests`, both counted over
/// the last `window`. The window slides in ten steps of `window / 10`: an event counts for
/// between 0.9 × `window` and `window` after it happened, and memory is constant.
#[derive(Debug)]
pub struct RetryBudget {
    ratio: f64,
    min_retries: u32,
    slot_len: Nanos,
    slots: Mutex<[StepCounts; SLOTS]>,
}

/// The counts of one `window / 10` step, and which step it holds.
#[derive(Debug, Clone, Copy, Default)]
struct StepCounts {
    step: u64,
    requests: u64,
    retries: u64,
}

impl RetryBudget {
    /// Retries allowed up to `min_retries` plus `ratio` (e.g. 0.2) of the original requests
    /// seen in the last `window` nanoseconds. A negative or non-finite ratio counts as 0.
    pub fn new(ratio: f64, min_retries: u32, window: Nanos) -> Self {
        let ratio = if ratio.is_finite() { ratio.max(0.0) } else { 0.0 };
        let slot_len = (window / SLOTS as u64).max(Nanos::new(1));
        Self { ratio, min_retries, slot_len, slots: Mutex::new([StepCounts::default(); SLOTS]) }
    }

    /// Counts one original (first) attempt at `now`.
    pub fn record_request(&self, now: Nanos) {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        self.slot_at(&mut slots, now).requests += 1;
    }

    /// Whether a retry may go out at `now`; if so it is counted.
    pub fn try_retry(&self, now: Nanos) -> bool {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let step = now / self.slot_len;
        let (mut requests, mut retries) = (0u64, 0u64);
        // A slot a step ahead of `now` belongs to a caller that read the clock later; it counts.
        for slot in slots.iter().filter(|s| step.saturating_sub(s.step) < SLOTS as u64) {
            requests += slot.requests;
            retries += slot.retries;
        }
        // A hair of tolerance so that 0.2 × 100 is 20, not 20.000000000000004 or 19.99….
        let allowed = f64::from(self.min_retries) + self.ratio * requests as f64 + 1e-9;
        if (retries + 1) as f64 > allowed {
            return false;
        }
        self.slot_at(&mut slots, now).retries += 1;
        true
    }

    /// The slot for `now`, emptied first if it still holds an older step.
    fn slot_at<'a>(&self, slots: &'a mut [StepCounts; SLOTS], now: Nanos) -> &'a mut StepCounts {
        let step = now / self.slot_len;
        let slot = &mut slots[(step % SLOTS as u64) as usize];
        if slot.step < step {
            *slot = StepCounts { step, ..StepCounts::default() };
        }
        slot
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    const MS: Nanos = Nanos::from_millis(1);
    const SEC: Nanos = Nanos::from_secs(1);
    use proptest::prelude::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    fn delay(retry: Retry) -> Duration {
        match retry {
            Retry::After(d) => d,
            Retry::GiveUp(g) => panic!("gave up: {g}"),
        }
    }

    /// The band the contract allows: the nominal delay ±JITTER, kept within [BASE, CAP].
    fn band(failed_attempts: u32) -> (Duration, Duration) {
        let nominal = (BASE.as_nanos() << failed_attempts.saturating_sub(1).min(64)).min(CAP.as_nanos()) as f64;
        let at = |f: f64| Duration::from_nanos((nominal * f).round() as u64).clamp(BASE, CAP);
        (at(1.0 - JITTER), at(1.0 + JITTER))
    }

    proptest! {
        #[test]
        fn every_delay_is_in_the_band_and_never_under_the_floor(
            seed in any::<u64>(),
            failed_attempts in prop_oneof![1u32..20, any::<u32>()],
            retry_after_ms in proptest::option::of(0u64..120_000),
        ) {
            let backoff = Backoff::new(u32::MAX, Duration::from_secs(3600));
            let floor = retry_after_ms.map(Duration::from_millis);
            let mut rng = StdRng::seed_from_u64(seed);
            let d = delay(backoff.after_failure(failed_attempts, floor, &mut rng));
            let floor = floor.unwrap_or(Duration::ZERO);
            prop_assert!(d >= floor);
            prop_assert!(d >= BASE.max(floor) && d <= CAP.max(floor), "{d:?}");
            let (lo, hi) = band(failed_attempts);
            prop_assert!(d >= lo.max(floor) && d <= hi.max(floor), "{d:?} outside {lo:?}..{hi:?}");
        }
    }

    #[test]
    fn delays_double_from_half_a_second_up_to_the_cap() {
        assert_eq!(nominal_nanos(1), 500 * MS);
        assert_eq!(nominal_nanos(2), SEC);
        assert_eq!(nominal_nanos(6), 16 * SEC);
        assert_eq!(nominal_nanos(7), 30 * SEC);
        assert_eq!(nominal_nanos(64), 30 * SEC);
        assert_eq!(nominal_nanos(u32::MAX), 30 * SEC);
    }

    #[test]
    fn the_jitter_is_real_and_spans_the_band() {
        let backoff = Backoff::new(10, Duration::from_secs(60));
        let mut rng = StdRng::seed_from_u64(7);
        let draws: Vec<Duration> = (0..1000).map(|_| delay(backoff.after_failure(3, None, &mut rng))).collect();
        let (min, max) = (draws.iter().min().copied(), draws.iter().max().copied());
        assert_ne!(min, max, "all 1000 delays were equal");
        // Nominal 2 s, band [1.6 s, 2.4 s]: the draws cover at least 90 % of it.
        assert!(min < Some(Duration::from_millis(1640)), "{min:?}");
        assert!(max > Some(Duration::from_millis(2360)), "{max:?}");
    }

    #[test]
    fn gives_up_when_the_attempts_are_spent() {
        let backoff = Backoff::new(5, Duration::from_secs(60));
        let mut rng = StdRng::seed_from_u64(1);
        for n in 1..5 {
            assert!(matches!(backoff.after_failure(n, None, &mut rng), Retry::After(_)), "attempt {n}");
        }
        let retry = backoff.after_failure(5, None, &mut rng);
        assert_eq!(retry, Retry::GiveUp(GiveUp::Exhausted { attempts: 5 }));
        let Retry::GiveUp(reason) = retry else { unreachable!() };
        assert_eq!(reason.to_string(), "gave up after 5 attempts");
        assert_eq!(Backoff::new(0, Duration::ZERO).max_attempts(), 1);
    }

    #[test]
    fn a_retry_after_above_the_max_gives_up_at_once() {
        let backoff = Backoff::new(5, Duration::from_secs(60));
        let mut rng = StdRng::seed_from_u64(1);
        let hour = Duration::from_secs(3600);
        let retry = backoff.after_failure(1, Some(hour), &mut rng);
        assert_eq!(retry, Retry::GiveUp(GiveUp::RetryAfterTooLong { retry_after: hour }));
        let Retry::GiveUp(reason) = retry else { unreachable!() };
        assert_eq!(
            reason.to_string(),
            "the upstream asked us to wait 3600 s, more than upstream.max_retry_after_ms allows"
        );
        // Exactly the max is still waited out, even above the 30 s cap.
        assert_eq!(delay(backoff.after_failure(1, Some(Duration::from_secs(60)), &mut rng)), Duration::from_secs(60));
        // With no attempts left, running out is the reason given.
        assert_eq!(backoff.after_failure(5, Some(hour), &mut rng), Retry::GiveUp(GiveUp::Exhausted { attempts: 5 }));
    }

    #[test]
    fn parses_delta_seconds() {
        let now = SystemTime::UNIX_EPOCH;
        assert_eq!(parse_retry_after("3", now), Some(Duration::from_secs(3)));
        assert_eq!(parse_retry_after("  120 \t", now), Some(Duration::from_secs(120)));
        assert_eq!(parse_retry_after("0", now), Some(Duration::ZERO));
        assert_eq!(parse_retry_after("1.5", now), Some(Duration::from_millis(1500)));
        assert_eq!(parse_retry_after("0.001", now), Some(Duration::from_millis(1)));
        let day = Some(Duration::from_secs(86_400));
        assert_eq!(parse_retry_after("99999999999999999999999999", now), day);
        assert_eq!(parse_retry_after("1000000.5", now), day);
        assert_eq!(parse_retry_after(&format!("{}.0", "9".repeat(400)), now), day);
    }

    #[test]
    fn parses_http_dates_and_past_dates_are_zero() {
        let now = httpdate::parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT").ok();
        let Some(now) = now else { panic!("the test's own date does not parse") };
        let three = Some(Duration::from_secs(3));
        assert_eq!(parse_retry_after("Sun, 06 Nov 1994 08:49:40 GMT", now), three);
        assert_eq!(parse_retry_after("Sunday, 06-Nov-94 08:49:40 GMT", now), three);
        assert_eq!(parse_retry_after("Sun Nov  6 08:49:40 1994", now), three);
        assert_eq!(parse_retry_after("Sun, 06 Nov 1994 08:49:37 GMT", now), Some(Duration::ZERO));
        assert_eq!(parse_retry_after("Sat, 05 Nov 1994 08:49:37 GMT", now), Some(Duration::ZERO));
        assert_eq!(parse_retry_after("Fri, 01 Jan 2100 00:00:00 GMT", now), Some(Duration::from_secs(86_400)));
    }

    #[test]
    fn garbage_is_none() {
        let now = SystemTime::UNIX_EPOCH;
        for bad in ["", " ", "-1", "-0.5", "+3", "NaN", "nan", "inf", "1e3", "1.", ".5", "1.2.3", "3 s", "soon", "0x10"]
        {
            assert_eq!(parse_retry_after(bad, now), None, "{bad:?}");
        }
    }

    #[test]
    fn the_budget_allows_a_share_of_recent_requests() {
        let budget = RetryBudget::new(0.2, 3, 10 * SEC);
        for i in 0..100 {
            budget.record_request(i * 10 * MS);
        }
        let now = SEC;
        let passed = (0..100).filter(|_| budget.try_retry(now)).count();
        assert_eq!(passed, 20 + 3);
    }

    #[test]
    fn the_budget_comes_back_after_the_window() {
        let budget = RetryBudget::new(0.2, 0, 10 * SEC);
        for _ in 0..10 {
            budget.record_request(Nanos::ZERO);
        }
        assert!(budget.try_retry(Nanos::ZERO));
        assert!(budget.try_retry(SEC));
        assert!(!budget.try_retry(2 * SEC));
        // Within the window (up to one 1 s step short of it) the spent budget stays spent.
        assert!(!budget.try_retry(9 * SEC));
        // A window on, requests and retries have both aged out: new requests, new budget.
        for _ in 0..10 {
            budget.record_request(10 * SEC + SEC / 2);
        }
        assert!(budget.try_retry(11 * SEC));
        assert!(budget.try_retry(11 * SEC));
        assert!(!budget.try_retry(11 * SEC));
    }

    #[test]
    fn with_no_requests_only_the_minimum_passes() {
        let budget = RetryBudget::new(0.2, 2, 10 * SEC);
        assert!(budget.try_retry(Nanos::ZERO));
        assert!(budget.try_retry(Nanos::ZERO));
        assert!(!budget.try_retry(Nanos::ZERO));
        assert!(!RetryBudget::new(f64::NAN, 0, 10 * SEC).try_retry(Nanos::ZERO));
    }
}
