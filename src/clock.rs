//! The one source of time.
//!
//! Every limiter, the prediction book and the embedded mock upstream read time from a
//! [`Clock`], never from `Instant::now()` directly. Production uses [`SystemClock`]; tests
//! hold a [`ManualClock`] and walk a minute forward in a microsecond, so no test ever
//! sleeps to wait out a window.

use std::fmt::Debug;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Nanoseconds since the clock's origin. Only differences between two readings mean anything.
pub type Nanos = u64;

/// Nanoseconds in one millisecond, for converting waits into the `_ms` fields agents read.
pub const NANOS_PER_MS: u64 = 1_000_000;
/// Nanoseconds in one second.
pub const NANOS_PER_SEC: u64 = 1_000_000_000;

/// A monotonic source of time shared by everything that limits.
pub trait Clock: Send + Sync + Debug {
    /// The current reading. Never goes backwards.
    fn now(&self) -> Nanos;
}

/// A shared handle to the clock the whole server uses.
pub type SharedClock = Arc<dyn Clock>;

/// Real monotonic time, counted from when the clock was made.
///
/// Read from the CPU's time-stamp counter through `quanta` (calibrated against the OS clock,
/// and falling back to it where the TSC is not reliable): about 10 ns a reading instead of
/// 25 ns for `Instant::now()`, which is a third of a whole limiter decision.
#[derive(Debug)]
pub struct SystemClock {
    clock: quanta::Clock,
    origin: u64,
}

impl SystemClock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        let clock = quanta::Clock::new();
        let origin = clock.raw();
        Self { clock, origin }
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
        self.clock.delta_as_nanos(self.origin, self.clock.raw())
    }
}

/// A clock that only moves when told to: the fake clock tests drive.
#[derive(Debug, Default)]
pub struct ManualClock {
    now: AtomicU64,
}

impl ManualClock {
    /// A manual clock standing at zero.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Moves time forward by `by`.
    pub fn advance(&self, by: Duration) {
        let by = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        self.now.fetch_add(by, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Nanos {
        self.now.load(Ordering::SeqCst)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_system_clock_is_monotonic_and_tracks_real_time() {
        let clock = SystemClock::new();
        let started = std::time::Instant::now();
        let mut last = clock.now();
        while started.elapsed() < Duration::from_millis(20) {
            let now = clock.now();
            assert!(now >= last, "went backwards: {last} -> {now}");
            last = now;
        }
        let measured = Duration::from_nanos(clock.now());
        assert!(measured >= Duration::from_millis(19) && measured < Duration::from_millis(500), "{measured:?}");
    }
}
