//! A limit's parameters as a config file writes them (`burst = 60`, `refill_per_sec = 1.0`,
//! `window_ms = 60000` …), read by each algorithm for the ones it takes
//! ([`Algorithm::from_params`](super::Algorithm::from_params)), so an algorithm's parameters are
//! named in its own file, with their bounds here, once.

use std::collections::BTreeMap;

use crate::clock::{NANOS_PER_SEC, Nanos};

/// The most units a count may be (window counters are kept in 32 bits).
pub const MAX_UNITS: u64 = u32::MAX as u64;

/// The longest window: one year, in milliseconds.
pub const MAX_WINDOW_MS: u64 = 365 * 24 * 3_600_000;

/// The fastest rate: a billion units a second (one a nanosecond).
pub const MAX_RATE: f64 = 1e9;

/// The longest stretch of time a limit may span: a window of one year, or a bucket that takes a
/// year to refill (or drain) from empty. Every bucket's `burst × period` is then an exact number
/// of nanoseconds with room to spare, so its levels and waits are exact; a rate too slow for it
/// is refused, naming its key, rather than kept approximately (it would be a typo, or a budget
/// that never comes back).
pub const LONGEST_SPAN: Nanos = Nanos::from_millis(MAX_WINDOW_MS);

/// One parameter's value as written.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(untagged)]
pub enum Value {
    /// A whole number.
    Int(i64),
    /// A number with a fraction.
    Float(f64),
    /// Text (a typo for a number, or an environment variable that did not parse as one).
    Text(String),
    /// Anything else (a table, a list, a boolean).
    Other(serde::de::IgnoredAny),
}

/// What is wrong with a parameter, and under which key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamError {
    /// The full key, e.g. `limits.caller.burst`.
    pub key: String,
    /// What is wrong and what would be right.
    pub message: String,
}

/// The parameters of one limit: where they are in the config (`limits.caller`,
/// `limits.caller[1]`), the algorithm they are for, and their values by name.
#[derive(Debug, Clone, Copy)]
pub struct Params<'a> {
    key: &'a str,
    algorithm: &'a str,
    values: &'a BTreeMap<String, Value>,
}

impl<'a> Params<'a> {
    /// The parameters written under `key` for `algorithm`.
    pub fn new(key: &'a str, algorithm: &'a str, values: &'a BTreeMap<String, Value>) -> Self {
        Self { key, algorithm, values }
    }

    fn error(&self, name: &str, message: impl Into<String>) -> ParamError {
        ParamError { key: format!("{}.{name}", self.key), message: message.into() }
    }

    fn value(&self, name: &str) -> Result<&'a Value, ParamError> {
        self.values.get(name).ok_or_else(|| self.error(name, format!("{} needs `{name}`", self.algorithm)))
    }

    /// A count of units (a burst, a window's limit, slots): a whole number from 1 to
    /// [`MAX_UNITS`].
    pub fn units(&self, name: &str) -> Result<u64, ParamError> {
        match self.value(name)? {
            Value::Int(n) if (1..=MAX_UNITS as i64).contains(n) => Ok(*n as u64),
            Value::Int(n) => Err(self.error(name, format!("must be between 1 and {MAX_UNITS} (got {n})"))),
            other => Err(self.error(name, format!("must be a whole number from 1 to {MAX_UNITS} (got {other})"))),
        }
    }

    /// A rate in units per second: positive, at most [`MAX_RATE`].
    pub fn rate(&self, name: &str) -> Result<f64, ParamError> {
        let rate = match self.value(name)? {
            Value::Int(n) => *n as f64,
            Value::Float(x) => *x,
            other => return Err(self.error(name, format!("must be a number of units per second (got {other})"))),
        };
        if !rate.is_finite() || rate <= 0.0 {
            return Err(self.error(name, format!("must be a positive rate (got {rate})")));
        }
        if rate > MAX_RATE {
            return Err(self.error(name, "must be at most 1e9 per second"));
        }
        Ok(rate)
    }

    /// A bucket: `burst` units (a count, as [`Params::units`] reads it) and the period in
    /// nanoseconds in which one comes back (is refilled, or drains): `1e9 / rate`, rounded to the
    /// nearest nanosecond, where `rate` is in units per second ([`Params::rate`]). The whole
    /// bucket must come back within [`LONGEST_SPAN`]: a slower rate is refused naming `rate`.
    pub fn bucket(&self, burst: &str, rate: &str) -> Result<(u64, Nanos), ParamError> {
        let capacity = self.units(burst)?;
        let per_sec = self.rate(rate)?;
        let period = (NANOS_PER_SEC as f64 / per_sec).round();
        let longest = LONGEST_SPAN.as_u64();
        // Both sides are whole numbers of nanoseconds: the period (an integral double, exact as an
        // integer once it is below the bound) times the burst, without wrapping.
        let span = (period <= longest as f64).then(|| capacity.checked_mul(period as u64)).flatten();
        match span {
            Some(span) if span <= longest => Ok((capacity, Nanos::new(period as u64))),
            _ => {
                let year = longest / NANOS_PER_SEC;
                // The slowest rate there is for this burst, rounded up to four digits.
                let slowest = capacity as f64 / year as f64;
                let unit = 10f64.powi(slowest.log10().floor() as i32 - 3);
                Err(self.error(
                    rate,
                    format!(
                        "{per_sec:e} per second takes {:.3e} s to bring back a burst of {capacity}; a bucket must \
                         come back whole within a year ({year} s), the longest span a limit may have: give a \
                         rate of at least {capacity} / {year} = {:.3e} per second, or a smaller `{burst}`",
                        capacity as f64 / per_sec,
                        (slowest / unit).ceil() * unit,
                    ),
                ))
            }
        }
    }

    /// A window in milliseconds (from 1 to [`MAX_WINDOW_MS`]), as nanoseconds.
    pub fn window(&self, name: &str) -> Result<Nanos, ParamError> {
        match self.value(name)? {
            Value::Int(ms) if (1..=MAX_WINDOW_MS as i64).contains(ms) => Ok(Nanos::from_millis(*ms as u64)),
            Value::Int(ms) => Err(self.error(name, format!("must be between 1 and {MAX_WINDOW_MS} (got {ms})"))),
            other => Err(self.error(name, format!("must be whole milliseconds (got {other})"))),
        }
    }
}

impl std::fmt::Display for Value {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Value::Int(n) => write!(f, "{n}"),
            Value::Float(x) => write!(f, "{x}"),
            Value::Text(s) => write!(f, "{s:?}"),
            Value::Other(_) => f.write_str("something that is not a number"),
        }
    }
}
