//! `[store]` and `[loop_detection]`: where limiter state lives (this process, or Redis shared by
//! every instance), how long its leases and sweeps take, and how a stuck agent is told apart.

use serde::Deserialize;

use super::limits::DAY_MS;
use super::{ConfigError, invalid};

/// Where limiter state lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// In this process: one instance, nothing to set up.
    Memory,
    /// In Redis, shared by every instance.
    Redis,
}

/// `[loop_detection]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoopDetectionConfig {
    /// Whether identical repeated calls are refused.
    pub enabled: bool,
    /// Identical calls in a row (or occurrences in an A/B/A/B oscillation) that make a loop.
    pub repeats: u32,
    /// The window those calls must fall in, and how long a detected loop is stopped for.
    pub window_ms: u64,
    /// The same answer from the same tool this many times in a row (arguments changed or not)
    /// stops the caller's calls of that tool; 0: answers are not compared. A tool may say its own
    /// (`[tools.NAME] no_progress`).
    pub no_progress: u32,
    /// The fields (object keys, at any depth of an answer, or of the JSON in its text) whose
    /// values say nothing about progress — timestamps, request ids — left out when two answers are
    /// compared. A tool may name its own instead (`[tools.NAME] volatile_fields`).
    pub volatile_fields: Vec<String>,
}

/// `[store]`.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    /// Where limiter state lives.
    pub backend: Backend,
    /// The Redis to share state in, when `backend = "redis"`.
    pub redis_url: String,
    /// A PEM file of the CA to verify a TLS Redis (`rediss://`) against instead of the system's
    /// trust store; empty for the system's.
    pub redis_ca_file: String,
    /// The longest a request waits on the store before it counts as down.
    pub timeout_ms: u64,
    /// How long in-flight slots held in a shared store last unless renewed: what a crashed
    /// instance's slots are lost for.
    pub lease_ms: u64,
    /// Interval between sweeps of idle state.
    pub sweep_interval_ms: u64,
    /// Server instances expected to share the store: the insurance limiter gives each
    /// 1/`expected_instances` of every limit while the store cannot decide.
    pub expected_instances: u32,
    /// The most units of a busy key's budget an instance takes from Redis at once and decides on
    /// itself (a slice); 0: every decision in Redis.
    pub slice_max: u64,
    /// The longest an instance spends from a slice before what is left goes back.
    pub slice_ms: u64,
}

impl std::fmt::Debug for StoreConfig {
    /// The Redis URL without its password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self {
            backend,
            redis_url,
            redis_ca_file,
            timeout_ms,
            lease_ms,
            sweep_interval_ms,
            expected_instances,
            slice_max,
            slice_ms,
        } = self;
        f.debug_struct("StoreConfig")
            .field("backend", backend)
            .field("redis_url", &crate::redact::url(redis_url))
            .field("redis_ca_file", redis_ca_file)
            .field("timeout_ms", timeout_ms)
            .field("lease_ms", lease_ms)
            .field("sweep_interval_ms", sweep_interval_ms)
            .field("expected_instances", expected_instances)
            .field("slice_max", slice_max)
            .field("slice_ms", slice_ms)
            .finish()
    }
}

impl StoreConfig {
    /// The certificates of `redis_ca_file` (PEM), or `None` to trust the system's store.
    pub fn redis_ca(&self) -> Result<Option<Vec<u8>>, String> {
        if self.redis_ca_file.is_empty() {
            return Ok(None);
        }
        let pem =
            std::fs::read(&self.redis_ca_file).map_err(|e| format!("cannot read `{}`: {e}", self.redis_ca_file))?;
        if !pem.windows(27).any(|w| w == b"-----BEGIN CERTIFICATE-----") {
            return Err(format!("`{}` holds no PEM certificate (-----BEGIN CERTIFICATE-----)", self.redis_ca_file));
        }
        Ok(Some(pem))
    }
}

/// The most units one slice may hold: far above any useful size, far below what sums can overflow.
const MOST_A_SLICE: u64 = 1 << 32;
const MINUTE_MS: u64 = 60_000;

impl StoreConfig {
    /// The section, checked: durations above zero and within a day; with Redis, a URL the store
    /// can connect to and a readable CA.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        for (key, value) in [
            ("store.sweep_interval_ms", self.sweep_interval_ms),
            ("store.timeout_ms", self.timeout_ms),
            ("store.lease_ms", self.lease_ms),
            ("store.slice_ms", self.slice_ms),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be greater than zero"));
            }
            if value > DAY_MS {
                return Err(invalid(key, format!("{value} is more than a day ({DAY_MS})")));
            }
        }
        if self.slice_max > MOST_A_SLICE {
            return Err(invalid("store.slice_max", format!("{} is more than {MOST_A_SLICE}", self.slice_max)));
        }
        if self.slice_ms > MINUTE_MS {
            return Err(invalid("store.slice_ms", format!("{} is more than a minute ({MINUTE_MS})", self.slice_ms)));
        }
        if self.expected_instances == 0 {
            return Err(invalid("store.expected_instances", "must be greater than zero"));
        }
        if self.backend == Backend::Redis {
            // The URL itself is the backend's to read (`mcp_ratelimit_redis::RedisStore::check_url`):
            // the server checks it with the rest of its config, a library when it connects.
            if !self.redis_ca_file.is_empty() {
                self.redis_ca().map_err(|e| invalid("store.redis_ca_file", e))?;
            }
        }
        Ok(())
    }
}

/// The most a window, or a bucket's burst × refill time, may span on Redis: the Lua twins
/// compute in doubles, exact to the nanosecond over at most 2^52 ns (52 days).
pub(super) const REDIS_SPAN: crate::clock::Nanos = crate::clock::Nanos::new(1 << 52);

impl LoopDetectionConfig {
    /// The section, checked: a window above zero and within a day, at least two repeats.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.window_ms == 0 {
            return Err(invalid("loop_detection.window_ms", "must be greater than zero"));
        }
        if self.window_ms > DAY_MS {
            return Err(invalid(
                "loop_detection.window_ms",
                format!("{} is more than a day ({DAY_MS})", self.window_ms),
            ));
        }
        if self.repeats < 2 {
            return Err(invalid("loop_detection.repeats", "must be at least 2: one call is never a loop"));
        }
        no_progress_is_valid("loop_detection.no_progress", self.no_progress)?;
        volatile_fields_are_valid("loop_detection.volatile_fields", &self.volatile_fields)
    }
}

/// The most answers a `no_progress` rule may wait for: a caller's history keeps that many.
pub(super) const MAX_NO_PROGRESS: u32 = 1_000;

/// A `no_progress` (`key`) of 0 (off) or 2 to [`MAX_NO_PROGRESS`]: one answer is never a streak.
pub(super) fn no_progress_is_valid(key: &str, no_progress: u32) -> Result<(), ConfigError> {
    if no_progress == 1 || no_progress > MAX_NO_PROGRESS {
        return Err(invalid(
            key,
            format!("0 (answers are not compared) or 2 to {MAX_NO_PROGRESS}: one answer is never a streak"),
        ));
    }
    Ok(())
}

/// `volatile_fields` (`key`): names of object keys, none empty, at most 64 of them.
pub(super) fn volatile_fields_are_valid(key: &str, fields: &[String]) -> Result<(), ConfigError> {
    if fields.len() > 64 {
        return Err(invalid(key, format!("at most 64 field names (got {})", fields.len())));
    }
    if fields.iter().any(|f| f.is_empty()) {
        return Err(invalid(key, "a field name cannot be empty"));
    }
    Ok(())
}
