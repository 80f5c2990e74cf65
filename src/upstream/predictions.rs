//! The prediction book: which jobs a caller owns and when it may poll them next.
//!
//! Every job we submit gets a poll hint (`next_poll_in_seconds`). A poll that comes earlier is
//! answered from here, with the remaining wait, and never reaches the upstream: an agent that
//! polls in a tight loop costs nothing. Finished jobs are cached too, so re-reading a result is
//! free. Entries are dropped an hour after their last update, keeping memory bounded.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::clock::{NANOS_PER_SEC, Nanos, SharedClock};
use crate::upstream::api::Prediction;

const KEEP_FOR: Nanos = 3_600 * NANOS_PER_SEC;

#[derive(Debug, Clone)]
struct Tracked {
    owner: String,
    next_poll_at: Nanos,
    updated_at: Nanos,
    last: Prediction,
}

/// What to do with a poll.
#[derive(Debug, Clone)]
pub enum PollGate {
    /// Ask the upstream.
    Due,
    /// Too early, or already final: answer with this, and with the wait left (zero if final).
    Answer {
        /// The last state we saw.
        last: Prediction,
        /// Nanoseconds until the next poll is due.
        wait: Nanos,
    },
    /// No such job for this caller.
    NotYours,
}

/// Jobs known to this server instance.
#[derive(Debug)]
pub struct PredictionBook {
    clock: SharedClock,
    entries: Mutex<HashMap<String, Tracked>>,
}

impl PredictionBook {
    /// An empty book reading time from `clock`.
    pub fn new(clock: SharedClock) -> Self {
        Self { clock, entries: Mutex::new(HashMap::new()) }
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<String, Tracked>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records what the upstream said about `prediction`, owned by `owner`, with the next poll
    /// due `hint` nanoseconds from now.
    pub fn record(&self, owner: &str, prediction: Prediction, hint: Nanos) {
        let now = self.clock.now();
        let tracked = Tracked {
            owner: owner.to_owned(),
            next_poll_at: now.saturating_add(hint),
            updated_at: now,
            last: prediction,
        };
        self.entries().insert(tracked.last.id.clone(), tracked);
    }

    /// Decides whether a poll of `id` by `owner` goes upstream.
    ///
    /// A job this instance has never seen (submitted through another instance, or before a
    /// restart) is polled upstream; ids are long random strings, so they are not guessable.
    pub fn gate(&self, owner: &str, id: &str) -> PollGate {
        let now = self.clock.now();
        match self.entries().get(id) {
            None => PollGate::Due,
            Some(t) if t.owner != owner => PollGate::NotYours,
            Some(t) if t.last.status.is_terminal() => PollGate::Answer { last: t.last.clone(), wait: 0 },
            Some(t) if now < t.next_poll_at => PollGate::Answer { last: t.last.clone(), wait: t.next_poll_at - now },
            Some(_) => PollGate::Due,
        }
    }

    /// Drops entries not updated for an hour.
    pub fn sweep(&self) -> usize {
        let now = self.clock.now();
        let mut entries = self.entries();
        let before = entries.len();
        entries.retain(|_, t| now.saturating_sub(t.updated_at) < KEEP_FOR);
        before - entries.len()
    }
}
