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
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Nanoseconds since the Unix epoch (as the system clock stood when the process started, then
/// monotonic), so that windows of a minute or a day line up with the calendar's, as Redis's do;
/// a [`ManualClock`] starts at the epoch itself.
pub type Nanos = u64;

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
        let epoch_at_origin = u64::try_from(since_epoch.as_nanos()).unwrap_or(0);
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
        self.epoch_at_origin.saturating_add(self.clock.delta_as_nanos(self.origin, self.clock.raw()))
    }

    fn sleep_until(&self, deadline: Nanos) -> Sleep {
        let left = deadline.saturating_sub(self.now());
        Box::pin(tokio::time::sleep(Duration::from_nanos(left)))
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
        Self { now: AtomicU64::new(0), moved: tokio::sync::watch::Sender::new(0) }
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
        Arc::new(Self { now: AtomicU64::new(now), moved: tokio::sync::watch::Sender::new(now) })
    }

    /// Moves time forward by `by`.
    pub fn advance(&self, by: Duration) {
        let by = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        let now = self.now.fetch_add(by, Ordering::SeqCst).saturating_add(by);
        self.moved.send_modify(|seen| *seen = (*seen).max(now));
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Nanos {
        self.now.load(Ordering::SeqCst)
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
    nanos.div_ceil(NANOS_PER_MS)
}

/// Whole seconds in `nanos`, rounded up: "wait 1 second" when 200 ms remain, never "wait 0".
pub fn ceil_secs(nanos: Nanos) -> u64 {
    nanos.div_ceil(NANOS_PER_SEC)
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
            assert!(now >= last, "went backwards: {last} -> {now}");
            last = now;
        }
        let measured = Duration::from_nanos(clock.now() - first);
        assert!(measured >= Duration::from_millis(19) && measured < Duration::from_millis(500), "{measured:?}");
        // Readings are Unix time, so windows line up with the calendar.
        let wall = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("after 1970");
        let skew = wall.as_nanos().abs_diff(u128::from(clock.now()));
        assert!(skew < 1_000_000_000, "{skew} ns from the wall clock");
    }

    #[tokio::test]
    async fn a_manual_sleeper_wakes_when_time_passes_its_deadline_and_not_before() {
        let clock = ManualClock::new();
        let mut sleep = tokio::spawn(clock.sleep_until(30 * NANOS_PER_SEC));
        clock.advance(Duration::from_secs(29));
        let early = tokio::time::timeout(Duration::from_millis(20), &mut sleep).await;
        assert!(early.is_err(), "woke at 29 s for a 30 s deadline");
        clock.advance(Duration::from_secs(1));
        tokio::time::timeout(Duration::from_secs(5), sleep).await.expect("woke at 30 s").expect("task");
        // A deadline already behind resolves at once.
        tokio::time::timeout(Duration::from_secs(5), clock.sleep_until(NANOS_PER_SEC)).await.expect("past deadline");
    }
}
