//! `[server.shedding]`: when the server itself falls behind, it refuses the lowest priority first
//! (see [`crate::guard::shed`]). It sits in the server's section, but every door's one guarded
//! call reads it, so it belongs to the limits' configuration, with the ranks of
//! `[upstream.priority]` it sheds by.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::{ConfigError, invalid};
use crate::clock::Nanos;

/// The longest `target_ms` and `interval_ms` accepted: a server a minute behind is down, not
/// overloaded.
const LONGEST_MS: u64 = 60_000;

/// When the server counts as behind, and whom it refuses first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shedding {
    /// Whether it sheds at all.
    pub enabled: bool,
    /// The queueing delay that, when even the least delayed call of a whole interval waited
    /// longer, says the server is behind.
    pub target: Nanos,
    /// How long the least delay is taken over, and how often the shedding goes one priority up
    /// or down.
    pub interval: Nanos,
    /// Tier → its rank (`[upstream.priority]`; a tier not named ranks 0): the lowest is refused
    /// first.
    pub ranks: BTreeMap<String, i64>,
}

impl Default for Shedding {
    fn default() -> Self {
        Self {
            enabled: true,
            target: Nanos::from_millis(100),
            interval: Nanos::from_millis(1000),
            ranks: BTreeMap::new(),
        }
    }
}

/// `[server.shedding]` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawShedding {
    enabled: bool,
    target_ms: u64,
    interval_ms: u64,
}

impl RawShedding {
    /// The section, checked, with the ranks it sheds by.
    pub(super) fn validate(self, ranks: BTreeMap<String, i64>) -> Result<Shedding, ConfigError> {
        for (key, ms) in
            [("server.shedding.target_ms", self.target_ms), ("server.shedding.interval_ms", self.interval_ms)]
        {
            if ms == 0 || ms > LONGEST_MS {
                return Err(invalid(key, format!("must be from 1 to {LONGEST_MS} milliseconds (got {ms})")));
            }
        }
        Ok(Shedding {
            enabled: self.enabled,
            target: Nanos::from_millis(self.target_ms),
            interval: Nanos::from_millis(self.interval_ms),
            ranks,
        })
    }
}
