//! A limit's parameters as a config file writes them (`burst = 60`, `refill_per_sec = 1.0`,
//! `window_ms = 60000` …), read by each algorithm for the ones it takes
//! ([`Algorithm::from_params`](super::Algorithm::from_params)), so an algorithm's parameters are
//! named in its own file, with their bounds here, once.

use std::collections::BTreeMap;

use crate::clock::Nanos;

/// The most units a count may be (window counters are kept in 32 bits).
pub const MAX_UNITS: u64 = u32::MAX as u64;

/// The longest window: one year, in milliseconds.
pub const MAX_WINDOW_MS: u64 = 365 * 24 * 3_600_000;

/// The fastest rate: a billion units a second (one a nanosecond).
pub const MAX_RATE: f64 = 1e9;

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

    /// A window in milliseconds (from 1 to [`MAX_WINDOW_MS`]), as nanoseconds.
    pub fn window(&self, name: &str) -> Result<Nanos, ParamError> {
        match self.value(name)? {
            Value::Int(ms) if (1..=MAX_WINDOW_MS as i64).contains(ms) => Ok(*ms as u64 * 1_000_000),
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
