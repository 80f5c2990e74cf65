//! The detector, and the call-loop half of it: a call checked against its caller's history
//! (repeated, or alternating A/B) and recorded in the same step, or taken back.

use std::sync::{Mutex, MutexGuard};

use serde_json::Value;

use super::history::{Call, History, Looping, MAX_STOPS, Recorded, State, Stop};
use super::{Pattern, signature, tool_signature};
use crate::clock::Nanos;

/// Watches every caller's recent calls for loops.
#[derive(Debug)]
pub struct LoopDetector {
    repeats: u32,
    pub(super) window: Nanos,
    /// Keys the signature hash, so no one outside can craft two calls that collide.
    pub(super) seed: u64,
    state: Mutex<State>,
}

impl LoopDetector {
    /// Refuses the `repeats`-th (at least 2nd) repetition within `window` nanoseconds.
    pub fn new(repeats: u32, window: Nanos) -> Self {
        Self {
            repeats: repeats.max(2),
            window: window.max(Nanos::new(1)),
            seed: rand::random(),
            state: Mutex::default(),
        }
    }

    /// The window within which repetitions count, and for which a loop stays stopped.
    pub fn window(&self) -> Nanos {
        self.window
    }

    /// Checks `caller`'s call of `tool` with `args` at `now` and, if it is not a loop, records
    /// it.
    pub fn check(&self, caller: &str, tool: &str, args: &Value, now: Nanos) -> Result<Recorded, Looping> {
        let signature = self.signature(tool, args);
        let stopping_tool = tool_signature(self.seed, tool);
        let mut state = self.lock();
        let seq = state.next_seq;
        let history = state.callers.entry(caller.to_owned()).or_default();
        history.stops.retain(|s| s.until > now);
        if let Some(stop) = history.stops.iter().find(|s| s.signature == signature || s.signature == stopping_tool) {
            return Err(self.looping(stop.until - now, stop.pattern));
        }
        history.calls.retain(|c| self.live(c, now));

        // The live calls before this one, newest first.
        let mut before = history.calls.iter().rev().map(|c| c.signature);
        let same_in_a_row = 1 + before.clone().take_while(|s| *s == Some(signature)).count();
        if same_in_a_row >= self.repeats as usize {
            self.stop(history, signature, now, Pattern::Repeated);
            return Err(self.looping(self.window, Pattern::Repeated));
        }
        if let Some(Some(other)) = before.next()
            && other != signature
        {
            // Walk back while the calls keep alternating this, other, this, … and count this
            // call's occurrences in that run.
            let alternating =
                2 + before.zip([signature, other].into_iter().cycle()).take_while(|(s, e)| *s == Some(*e)).count();
            if alternating.div_ceil(2) >= self.repeats as usize {
                self.stop(history, signature, now, Pattern::Oscillating);
                self.stop(history, other, now, Pattern::Oscillating);
                return Err(self.looping(self.window, Pattern::Oscillating));
            }
        }

        if history.calls.len() >= 2 * self.repeats as usize {
            history.calls.pop_front();
        }
        history.calls.push_back(Call { seq, signature: Some(signature), at: now, answer: None });
        state.next_seq += 1;
        Ok(Recorded { seq })
    }

    /// Takes back a call [`check`](Self::check) recorded, as if it had never been made. Does
    /// nothing if it is already gone.
    pub fn forget(&self, caller: &str, recorded: Recorded) {
        let mut state = self.lock();
        if let Some(history) = state.callers.get_mut(caller) {
            history.calls.retain(|c| c.seq != recorded.seq);
        }
    }

    /// Drops the callers with no call or answer inside the window and no stop in force at `now`;
    /// returns how many were dropped.
    pub fn sweep(&self, now: Nanos) -> usize {
        let mut state = self.lock();
        let before = state.callers.len();
        state.callers.retain(|_, h| {
            h.calls.iter().any(|c| self.live(c, now))
                || h.stops.iter().any(|s| s.until > now)
                || h.streaks.iter().any(|s| now - s.at < self.window)
        });
        before - state.callers.len()
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `call` is still inside the window at `now`. A call stamped a hair after `now`
    /// (another thread read the clock later) is live.
    fn live(&self, call: &Call, now: Nanos) -> bool {
        now - call.at < self.window
    }

    fn looping(&self, retry_after: Nanos, pattern: Pattern) -> Looping {
        Looping { retry_after, repeats: self.repeats, pattern }
    }

    pub(super) fn stop(&self, history: &mut History, signature: u128, now: Nanos, pattern: Pattern) {
        history.stops.retain(|s| s.signature != signature);
        if history.stops.len() >= MAX_STOPS
            && let Some(soonest) = history.stops.iter().enumerate().min_by_key(|(_, s)| s.until).map(|(i, _)| i)
        {
            history.stops.swap_remove(soonest);
        }
        history.stops.push(Stop { signature, until: now + self.window, pattern });
    }

    pub(super) fn signature(&self, tool: &str, args: &Value) -> u128 {
        signature(self.seed, tool, args)
    }
}
