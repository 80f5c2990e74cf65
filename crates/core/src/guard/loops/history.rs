//! What the detector keeps per caller: its recent calls, the stops in force and the last answer
//! of each tool; and what a check hands back (a recorded call, or a refusal).

use std::collections::{HashMap, VecDeque};

use super::Pattern;
use crate::clock::Nanos;

/// The most signatures one caller can have stopped at once. Reaching it drops the stop that
/// ends soonest: an agent looping on that many different calls inside one window is stopped
/// again after another `repeats` calls anyway, and memory stays bounded.
pub(super) const MAX_STOPS: usize = 32;

/// The most tools whose last answers one caller's history keeps; reaching it drops the streak
/// heard of longest ago.
pub(super) const MAX_STREAKS: usize = 32;

/// Everything behind the lock: the histories, and the sequence numbers handed out.
#[derive(Debug, Default)]
pub(super) struct State {
    pub(super) next_seq: u64,
    pub(super) callers: HashMap<String, History>,
}

/// One caller's last `2 × repeats` calls (oldest first), its stops in force and the last answer
/// of each tool it called lately.
#[derive(Debug, Default)]
pub(super) struct History {
    pub(super) calls: VecDeque<Call>,
    pub(super) stops: Vec<Stop>,
    pub(super) streaks: VecDeque<Streak>,
}

/// One recorded call.
#[derive(Debug, Clone, Copy)]
pub(super) struct Call {
    pub(super) seq: u64,
    /// Its signature; `None` once an answer that changed made it stop counting (it then matches
    /// no call, so it breaks runs and alternations as a different call would).
    pub(super) signature: Option<u128>,
    pub(super) at: Nanos,
    /// The hash of its answer, once heard.
    pub(super) answer: Option<u128>,
}

/// A signature refused until `until`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Stop {
    pub(super) signature: u128,
    pub(super) until: Nanos,
    pub(super) pattern: Pattern,
}

/// The last answer a tool gave a caller, and how many times in a row it gave it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Streak {
    /// The tool's signature ([`tool_signature`](super::tool_signature)).
    pub(super) tool: u128,
    pub(super) answer: u128,
    pub(super) same: u32,
    pub(super) at: Nanos,
}

/// A call [`LoopDetector::check`] recorded, to hand to [`LoopDetector::forget`] if it must be
/// taken back.
///
/// [`LoopDetector::check`]: super::LoopDetector::check
/// [`LoopDetector::forget`]: super::LoopDetector::forget
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recorded {
    pub(super) seq: u64,
}

/// A refusal: the caller is looping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Looping {
    /// Nanoseconds until this call may be made again.
    pub retry_after: Nanos,
    /// How many repetitions (or, for no progress, identical answers) trip the detector, for the
    /// message to the agent.
    pub repeats: u32,
    /// The pattern found.
    pub pattern: Pattern,
}
