//! The one source of time.
//!
//! Every limiter, the job book, the upstream backoff and the embedded mock upstream read time
//! from a [`Clock`], never from `Instant::now()` directly, and background work waits with
//! [`Clock::sleep_until`] instead of `tokio::time::sleep`. Production uses [`SystemClock`];
//! tests hold a [`ManualClock`] and walk a minute forward in a microsecond — a job's background
//! poll or a backoff delay fires the moment the test moves time past it — so no test ever
//! sleeps to wait out a window.

use std::fmt::Debug;
use std::future::Future;
use std::ops::{Add, AddAssign, Div, Mul, Rem, Sub, SubAssign};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Nanoseconds: an instant (since the Unix epoch, as the system clock stood when the process
/// started, then monotonic, so that windows of a minute or a day line up with the calendar's, as
/// Redis's do; a [`ManualClock`] starts at the epoch itself) or a duration.
///
/// Its arithmetic saturates by construction: `+` stops at [`Nanos::MAX`], `-` at zero, `*` and
/// `/` never panic, so no time computation overflows, wraps or needs a `saturating_*` call.
/// Serialized as the bare number of nanoseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct Nanos(u64);

impl Nanos {
    /// No time at all (and the epoch, as an instant).
    pub const ZERO: Self = Self(0);
    /// The longest time there is, about 584 years: where `+` stops.
    pub const MAX: Self = Self(u64::MAX);

    /// `nanos` nanoseconds.
    pub const fn new(nanos: u64) -> Self {
        Self(nanos)
    }

    /// `us` microseconds (how Redis's scripts count time), [`Nanos::MAX`] if that is more.
    pub const fn from_micros(us: u64) -> Self {
        Self(us.saturating_mul(1_000))
    }

    /// `ms` milliseconds, [`Nanos::MAX`] if that is more.
    pub const fn from_millis(ms: u64) -> Self {
        Self(ms.saturating_mul(NANOS_PER_MS))
    }

    /// `secs` seconds, [`Nanos::MAX`] if that is more.
    pub const fn from_secs(secs: u64) -> Self {
        Self(secs.saturating_mul(NANOS_PER_SEC))
    }

    /// `secs` seconds rounded down to the nanosecond: zero for a negative or NaN, [`Nanos::MAX`] past it.
    pub fn from_secs_f64(secs: f64) -> Self {
        // `as` saturates, and turns NaN into 0.
        Self((secs * NANOS_PER_SEC as f64) as u64)
    }

    /// The number of nanoseconds.
    pub const fn as_u64(self) -> u64 {
        self.0
    }

    /// In seconds, as a float (to the nearest one it can hold).
    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / NANOS_PER_SEC as f64
    }

    /// As a [`Duration`] (every `Nanos` fits one).
    pub const fn to_duration(self) -> Duration {
        Duration::from_nanos(self.0)
    }
}

/// A [`Duration`] in nanoseconds, [`Nanos::MAX`] if it is longer.
impl From<Duration> for Nanos {
    fn from(d: Duration) -> Self {
        Self(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
    }
}

/// Saturates at [`Nanos::MAX`].
impl Add for Nanos {
    type Output = Self;
    fn add(self, rhs: Self) -> Self {
        Self(self.0.saturating_add(rhs.0))
    }
}

/// Saturates at zero: the time from a later instant to an earlier one is none.
impl Sub for Nanos {
    type Output = Self;
    fn sub(self, rhs: Self) -> Self {
        Self(self.0.saturating_sub(rhs.0))
    }
}

impl AddAssign for Nanos {
    fn add_assign(&mut self, rhs: Self) {
        *self = *self + rhs;
    }
}

impl SubAssign for Nanos {
    fn sub_assign(&mut self, rhs: Self) {
        *self = *self - rhs;
    }
}

/// `rhs` times as long, saturating at [`Nanos::MAX`].
impl Mul<u64> for Nanos {
    type Output = Self;
    fn mul(self, rhs: u64) -> Self {
        Self(self.0.saturating_mul(rhs))
    }
}

/// `self` times `rhs`, saturating at [`Nanos::MAX`] (so `60 * SEC` reads as written).
impl Mul<Nanos> for u64 {
    type Output = Nanos;
    fn mul(self, rhs: Nanos) -> Nanos {
        rhs * self
    }
}

/// A `rhs`th of it, rounded down; divided by zero, [`Nanos::MAX`].
impl Div<u64> for Nanos {
    type Output = Self;
    fn div(self, rhs: u64) -> Self {
        Self(self.0.checked_div(rhs).unwrap_or(u64::MAX))
    }
}

/// How many whole `rhs` fit in it; divided by zero, `u64::MAX`.
impl Div for Nanos {
    type Output = u64;
    fn div(self, rhs: Self) -> u64 {
        self.0.checked_div(rhs.0).unwrap_or(u64::MAX)
    }
}

/// What is left after the last whole `rhs` (`t - t % window` is the start of `t`'s window);
/// modulo zero, zero.
impl Rem for Nanos {
    type Output = Self;
    fn rem(self, rhs: Self) -> Self {
        Self(self.0.checked_rem(rhs.0).unwrap_or(0))
    }
}

/// Nanoseconds in one millisecond, for converting waits into the `_ms` fields agents read.
pub const NANOS_PER_MS: u64 = 1_000_000;
/// Nanoseconds in one second.
pub const NANOS_PER_SEC: u64 = 1_000_000_000;

/// The longest wait the server hands to a timer or adds to an `Instant`: about 30 years, tokio's
/// own "far future". Config validation keeps every duration within a day (a week for a job's
/// expiry); this bound is for a `Config` built by hand, whose absurd durations would otherwise
/// overflow `Instant + d` where the OS clock counts in 64-bit nanoseconds.
pub const LONGEST_WAIT: Duration = Duration::from_secs(30 * 365 * 86_400);

/// A future that resolves at an instant of a [`Clock`].
pub type Sleep = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// A monotonic source of time shared by everything that limits.
pub trait Clock: Send + Sync + Debug {
    /// The current reading. Never goes backwards.
    fn now(&self) -> Nanos;

    /// Resolves once [`Clock::now`] has reached `deadline` (at once if it already has).
    fn sleep_until(&self, deadline: Nanos) -> Sleep;
}

/// A shared handle to the clock the whole server uses.
pub type SharedClock = Arc<dyn Clock>;

/// Real monotonic time: the wall clock's reading when the clock was made, then the time since.
///
/// Read from the CPU's time-stamp counter through `quanta` (calibrated against the OS clock,
/// and falling back to it where the TSC is not reliable): about 10 ns a reading instead of
/// 25 ns for `Instant::now()`, which is a third of a whole limiter decision.
#[derive(Debug)]
pub struct SystemClock {
    clock: quanta::Clock,
    origin: u64,
    /// The wall clock at `origin`, in nanoseconds since the Unix epoch.
    epoch_at_origin: Nanos,
}

impl SystemClock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        let clock = quanta::Clock::new();
        let origin = clock.raw();
        let since_epoch = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let epoch_at_origin = Nanos::from(since_epoch);
        Self { clock, origin, epoch_at_origin }
    }

    /// The system clock as a [`SharedClock`].
    pub fn shared() -> SharedClock {
        Arc::new(Self::new())
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Nanos {
        self.epoch_at_origin + Nanos(self.clock.delta_as_nanos(self.origin, self.clock.raw()))
    }

    fn sleep_until(&self, deadline: Nanos) -> Sleep {
        let left = deadline - self.now();
        Box::pin(tokio::time::sleep(left.to_duration()))
    }
}

/// A clock that only moves when told to: the fake clock tests drive.
///
/// Sleepers wait on a watch channel that [`ManualClock::advance`] updates, so a background task
/// parked until second 30 wakes as soon as a test advances past it, and not before.
#[derive(Debug)]
pub struct ManualClock {
    now: AtomicU64,
    moved: tokio::sync::watch::Sender<Nanos>,
}

impl Default for ManualClock {
    fn default() -> Self {
        Self { now: AtomicU64::new(0), moved: tokio::sync::watch::Sender::new(Nanos::ZERO) }
    }
}

impl ManualClock {
    /// A manual clock standing at zero.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// A manual clock standing at `now` (e.g. the wall clock's reading, for tests of what is
    /// stamped with Unix time, such as access tokens).
    pub fn starting_at(now: Nanos) -> Arc<Self> {
        Arc::new(Self { now: AtomicU64::new(now.0), moved: tokio::sync::watch::Sender::new(now) })
    }

    /// Moves time forward by `by`.
    pub fn advance(&self, by: Duration) {
        let by = Nanos::from(by);
        let now = Nanos(self.now.fetch_add(by.0, Ordering::SeqCst)) + by;
        self.moved.send_modify(|seen| *seen = (*seen).max(now));
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Nanos {
        Nanos(self.now.load(Ordering::SeqCst))
    }

    fn sleep_until(&self, deadline: Nanos) -> Sleep {
        let mut moved = self.moved.subscribe();
        Box::pin(async move {
            // `wait_for` checks the current value first, so a deadline already passed (or passed
            // between `subscribe` and here) resolves at once. The sender lives as long as the
            // clock; if it is gone, time can never move again.
            if moved.wait_for(|now| *now >= deadline).await.is_err() {
                std::future::pending::<()>().await;
            }
        })
    }
}

/// Whole milliseconds in `nanos`, rounded up: a wait reported to an agent is never short.
pub fn ceil_ms(nanos: Nanos) -> u64 {
    nanos.0.div_ceil(NANOS_PER_MS)
}

/// Whole seconds in `nanos`, rounded up: "wait 1 second" when 200 ms remain, never "wait 0".
pub fn ceil_secs(nanos: Nanos) -> u64 {
    nanos.0.div_ceil(NANOS_PER_SEC)
}

/// Runs `work` every `period` of wall-clock time (at most [`LONGEST_WAIT`], at least a
/// millisecond), the first time at once, until `stop` is cancelled: the one loop behind every
/// background chore (sweeps, lease renewals, reading other instances' news). A tick that comes
/// while `work` still runs waits for it (ticks are delayed, never bunched).
///
/// On the wall clock, not a [`Clock`]: these chores keep pace with other processes (Redis's
/// leases, other instances), which a test's manual clock does not move.
pub async fn every<F, Fut>(period: Duration, stop: tokio_util::sync::CancellationToken, mut work: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    let mut tick = tokio::time::interval(period.clamp(Duration::from_millis(1), LONGEST_WAIT));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => work().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_system_clock_is_monotonic_and_tracks_real_time() {
        let clock = SystemClock::new();
        let started = std::time::Instant::now();
        let first = clock.now();
        let mut last = first;
        while started.elapsed() < Duration::from_millis(20) {
            let now = clock.now();
            assert!(now >= last, "went backwards: {last:?} -> {now:?}");
            last = now;
        }
        let measured = (clock.now() - first).to_duration();
        assert!(measured >= Duration::from_millis(19) && measured < Duration::from_millis(500), "{measured:?}");
        // Readings are Unix time, so windows line up with the calendar.
        let wall = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("after 1970");
        let skew = wall.as_nanos().abs_diff(u128::from(clock.now().0));
        assert!(skew < 1_000_000_000, "{skew} ns from the wall clock");
    }

    #[test]
    fn plus_and_minus_stop_at_the_ends_and_nothing_panics() {
        let one = Nanos::new(1);
        assert_eq!((Nanos::MAX + one, Nanos::ZERO - one), (Nanos::MAX, Nanos::ZERO));
        let (mut up, mut down) = (Nanos::MAX, one);
        up += Nanos::MAX;
        down -= Nanos::MAX;
        assert_eq!((up, down), (Nanos::MAX, Nanos::ZERO));
        assert_eq!((Nanos::MAX * 2, 2 * Nanos::MAX), (Nanos::MAX, Nanos::MAX));
        // Divided by zero: the most there is, never a panic; modulo zero, nothing.
        assert_eq!((Nanos::new(7) / 0, Nanos::new(7) / Nanos::ZERO), (Nanos::MAX, u64::MAX));
        assert_eq!(Nanos::new(7) % Nanos::ZERO, Nanos::ZERO);
        assert_eq!((Nanos::new(7) / Nanos::new(2), Nanos::new(7) % Nanos::new(2)), (3, one));
        assert_eq!((Nanos::from_secs(u64::MAX), Nanos::from_millis(u64::MAX)), (Nanos::MAX, Nanos::MAX));
        assert_eq!(Nanos::from_micros(u64::MAX), Nanos::MAX);
        assert_eq!(
            (Nanos::from(Duration::MAX), Nanos::from(Duration::from_millis(3))),
            (Nanos::MAX, Nanos::from_millis(3))
        );
        assert_eq!(Nanos::MAX.to_duration(), Duration::from_nanos(u64::MAX));
    }

    #[test]
    fn seconds_as_a_float_clamp_to_the_range() {
        for nothing in [-1.0, -0.0, f64::NAN, f64::NEG_INFINITY, -1e300] {
            assert_eq!(Nanos::from_secs_f64(nothing), Nanos::ZERO, "{nothing}");
        }
        for too_long in [f64::INFINITY, 1e300, 6e11] {
            assert_eq!(Nanos::from_secs_f64(too_long), Nanos::MAX, "{too_long}");
        }
        assert_eq!(Nanos::from_secs_f64(1.5), Nanos::from_millis(1_500));
        assert_eq!(Nanos::from_millis(2_500).as_secs_f64(), 2.5);
    }

    proptest::proptest! {
        #[test]
        fn the_arithmetic_is_u64s_saturating_arithmetic(a: u64, b: u64, secs: f64) {
            let (x, y) = (Nanos::new(a), Nanos::new(b));
            proptest::prop_assert_eq!((x + y).as_u64(), a.saturating_add(b));
            proptest::prop_assert_eq!((x - y).as_u64(), a.saturating_sub(b));
            proptest::prop_assert_eq!((x * b).as_u64(), a.saturating_mul(b));
            proptest::prop_assert_eq!((x / b).as_u64(), a.checked_div(b).unwrap_or(u64::MAX));
            proptest::prop_assert_eq!(x / y, a.checked_div(b).unwrap_or(u64::MAX));
            proptest::prop_assert!(x - y <= x && x + y >= x);
            let from_float = Nanos::from_secs_f64(secs);
            if secs.is_nan() || secs <= 0.0 {
                proptest::prop_assert_eq!(from_float, Nanos::ZERO);
            }
        }
    }

    #[tokio::test]
    async fn a_manual_sleeper_wakes_when_time_passes_its_deadline_and_not_before() {
        let clock = ManualClock::new();
        let mut sleep = tokio::spawn(clock.sleep_until(Nanos::from_secs(30)));
        clock.advance(Duration::from_secs(29));
        let early = tokio::time::timeout(Duration::from_millis(20), &mut sleep).await;
        assert!(early.is_err(), "woke at 29 s for a 30 s deadline");
        clock.advance(Duration::from_secs(1));
        tokio::time::timeout(Duration::from_secs(5), sleep).await.expect("woke at 30 s").expect("task");
        // A deadline already behind resolves at once.
        tokio::time::timeout(Duration::from_secs(5), clock.sleep_until(Nanos::from_secs(1)))
            .await
            .expect("past deadline");
    }
}
