//! Loop detection: a stuck agent repeats the exact same call; a working one varies it.
//!
//! Each caller (a caller id, never a raw credential) has a short history of its recent calls,
//! across sessions, as signatures of the tool name and its canonicalised arguments. Two
//! patterns are refused, with `repeats` (default 5) and `window` (default 60 s):
//!
//! - **Repetition**: the same signature `repeats` times in a row within the window. The
//!   `repeats`-th call is refused.
//! - **Oscillation**: a trailing run of calls alternating strictly between two signatures
//!   (A B A B …). The call that would be the `repeats`-th occurrence of its signature in that
//!   run, within the window, is refused.
//!
//! A refused pattern becomes a hard stop: every identical call (for an oscillation, a call of
//! either signature) is refused with the time left until `window` has passed since the
//! refusal, and is not recorded. Anything else resets: a different call in between breaks a
//! run, calls older than the window do not count, and a change of any argument makes a
//! different signature.
//!
//! Checking and recording are one atomic step; a recorded call can be taken back with
//! [`LoopDetector::forget`] when a later guard step refuses it, so that a call refused for
//! budget never counts as a repetition.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::Value;
use xxhash_rust::xxh3::xxh3_128_with_seed;

use crate::clock::Nanos;
use crate::guard::ToolCall;
use crate::guard::scope::{Scope, loop_owner};
use crate::identity::Caller;
use crate::store::{LoopCall, LoopHistory};

/// The most signatures one caller can have stopped at once. Reaching it drops the stop that
/// ends soonest: an agent looping on that many different calls inside one window is stopped
/// again after another `repeats` calls anyway, and memory stays bounded.
const MAX_STOPS: usize = 32;

/// Watches every caller's recent calls for loops.
#[derive(Debug)]
pub struct LoopDetector {
    repeats: u32,
    window: Nanos,
    /// Keys the signature hash, so no one outside can craft two calls that collide.
    seed: u64,
    state: Mutex<State>,
}

/// Everything behind the lock: the histories, and the sequence numbers handed out.
#[derive(Debug, Default)]
struct State {
    next_seq: u64,
    callers: HashMap<String, History>,
}

/// One caller's last `2 × repeats` calls (oldest first) and its stops in force.
#[derive(Debug, Default)]
struct History {
    calls: VecDeque<Call>,
    stops: Vec<Stop>,
}

/// One recorded call.
#[derive(Debug, Clone, Copy)]
struct Call {
    seq: u64,
    signature: u128,
    at: Nanos,
}

/// A signature refused until `until`.
#[derive(Debug, Clone, Copy)]
struct Stop {
    signature: u128,
    until: Nanos,
    oscillating: bool,
}

/// A call [`LoopDetector::check`] recorded, to hand to [`LoopDetector::forget`] if it must be
/// taken back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recorded {
    seq: u64,
}

/// A refusal: the caller is looping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Looping {
    /// Nanoseconds until this call may be made again.
    pub retry_after: Nanos,
    /// How many repetitions trip the detector, for the message to the agent.
    pub repeats: u32,
    /// Whether the loop was an A/B oscillation rather than one call repeated.
    pub oscillating: bool,
}

impl LoopDetector {
    /// Refuses the `repeats`-th (at least 2nd) repetition within `window` nanoseconds.
    pub fn new(repeats: u32, window: Nanos) -> Self {
        Self { repeats: repeats.max(2), window: window.max(1), seed: rand::random(), state: Mutex::default() }
    }

    /// The window within which repetitions count, and for which a loop stays stopped.
    pub fn window(&self) -> Nanos {
        self.window
    }

    /// Checks `caller`'s call of `tool` with `args` at `now` and, if it is not a loop, records
    /// it.
    pub fn check(&self, caller: &str, tool: &str, args: &Value, now: Nanos) -> Result<Recorded, Looping> {
        let signature = self.signature(tool, args);
        let mut state = self.lock();
        let seq = state.next_seq;
        let history = state.callers.entry(caller.to_owned()).or_default();
        history.stops.retain(|s| s.until > now);
        if let Some(stop) = history.stops.iter().find(|s| s.signature == signature) {
            return Err(self.looping(stop.until - now, stop.oscillating));
        }
        history.calls.retain(|c| self.live(c, now));

        // The live calls before this one, newest first.
        let mut before = history.calls.iter().rev().map(|c| c.signature);
        let same_in_a_row = 1 + before.clone().take_while(|s| *s == signature).count();
        if same_in_a_row >= self.repeats as usize {
            self.stop(history, signature, now, false);
            return Err(self.looping(self.window, false));
        }
        if let Some(other) = before.next()
            && other != signature
        {
            // Walk back while the calls keep alternating this, other, this, … and count this
            // call's occurrences in that run.
            let alternating =
                2 + before.zip([signature, other].into_iter().cycle()).take_while(|(s, e)| s == e).count();
            if alternating.div_ceil(2) >= self.repeats as usize {
                self.stop(history, signature, now, true);
                self.stop(history, other, now, true);
                return Err(self.looping(self.window, true));
            }
        }

        if history.calls.len() >= 2 * self.repeats as usize {
            history.calls.pop_front();
        }
        history.calls.push_back(Call { seq, signature, at: now });
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

    /// Drops the callers with no call inside the window and no stop in force at `now`;
    /// returns how many were dropped.
    pub fn sweep(&self, now: Nanos) -> usize {
        let mut state = self.lock();
        let before = state.callers.len();
        state.callers.retain(|_, h| h.calls.iter().any(|c| self.live(c, now)) || h.stops.iter().any(|s| s.until > now));
        before - state.callers.len()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `call` is still inside the window at `now`. A call stamped a hair after `now`
    /// (another thread read the clock later) is live.
    fn live(&self, call: &Call, now: Nanos) -> bool {
        now.saturating_sub(call.at) < self.window
    }

    fn looping(&self, retry_after: Nanos, oscillating: bool) -> Looping {
        Looping { retry_after, repeats: self.repeats, oscillating }
    }

    fn stop(&self, history: &mut History, signature: u128, now: Nanos, oscillating: bool) {
        if history.stops.len() >= MAX_STOPS
            && let Some(soonest) = history.stops.iter().enumerate().min_by_key(|(_, s)| s.until).map(|(i, _)| i)
        {
            history.stops.swap_remove(soonest);
        }
        history.stops.push(Stop { signature, until: now.saturating_add(self.window), oscillating });
    }

    fn signature(&self, tool: &str, args: &Value) -> u128 {
        signature(self.seed, tool, args)
    }
}

/// The xxh3-128, keyed by `seed`, of the tool name and the canonical arguments: what makes two
/// calls "the same call".
pub fn signature(seed: u64, tool: &str, args: &Value) -> u128 {
    xxh3_128_with_seed(canonical_call(tool, args).as_bytes(), seed)
}

/// The tool name, quoted, and the arguments as canonical JSON (keys sorted at every depth, no
/// whitespace): equal for two calls exactly when they are the same call. A quoted name ends
/// unambiguously, so no tool/arguments split can collide with another.
pub fn canonical_call(tool: &str, args: &Value) -> String {
    let mut text = String::new();
    push_json_string(&mut text, tool);
    push_canonical(&mut text, args);
    text
}

/// What is left to write while canonicalising.
enum Step<'a> {
    Value(&'a Value),
    Key(&'a str),
    Text(&'static str),
}

/// Appends `value` as canonical JSON: object keys sorted by their bytes at every depth, arrays
/// in order, no whitespace. Iterative, so a deeply nested argument cannot overflow the stack.
fn push_canonical(out: &mut String, value: &Value) {
    let mut todo = vec![Step::Value(value)];
    while let Some(step) = todo.pop() {
        match step {
            Step::Text(text) => out.push_str(text),
            Step::Key(key) => {
                push_json_string(out, key);
                out.push(':');
            }
            Step::Value(Value::Null) => out.push_str("null"),
            Step::Value(Value::Bool(b)) => out.push_str(if *b { "true" } else { "false" }),
            Step::Value(Value::Number(n)) => out.push_str(&n.to_string()),
            Step::Value(Value::String(s)) => push_json_string(out, s),
            Step::Value(Value::Array(items)) => {
                out.push('[');
                todo.push(Step::Text("]"));
                for (i, item) in items.iter().enumerate().rev() {
                    todo.push(Step::Value(item));
                    if i > 0 {
                        todo.push(Step::Text(","));
                    }
                }
            }
            Step::Value(Value::Object(map)) => {
                out.push('{');
                todo.push(Step::Text("}"));
                // Sorted here, not trusted to the map: serde_json's order depends on its features.
                let mut entries: Vec<_> = map.iter().collect();
                entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
                for (i, (key, item)) in entries.into_iter().enumerate().rev() {
                    todo.push(Step::Value(item));
                    todo.push(Step::Key(key));
                    if i > 0 {
                        todo.push(Step::Text(","));
                    }
                }
            }
        }
    }
}

/// Appends `s` as a quoted JSON string.
fn push_json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// The seed of call signatures kept in a shared store: every instance must compute the same
/// signature for the same call. (A known seed lets a caller craft two calls that collide; that
/// only ever stops its own calls, since histories are per caller.)
const SHARED_SIGNATURE_SEED: u64 = 0x6d63_702d_726c_6f6f;

/// The loop stage of the guard: in this instance's memory, and over a shared store in its
/// [`LoopHistory`], so that every instance sees one history per caller. The shared history
/// checks a call in the same step as its budgets ([`Loops::shared_call`]); this instance's
/// detector checks calls when there is no shared history, or while it cannot decide.
#[derive(Debug)]
pub struct Loops {
    local: LoopDetector,
    shared: Option<Arc<dyn LoopHistory>>,
    repeats: u32,
    window: Nanos,
}

/// A call as the shared loop history checks it: in the caller's history, by its signature.
#[derive(Debug)]
pub struct SharedLoopCall {
    history: Arc<dyn LoopHistory>,
    key: Scope,
    signature: u128,
    window: Nanos,
    repeats: u32,
}

impl SharedLoopCall {
    /// The history to check the call in, and the call as it is checked.
    pub fn parts(&self) -> (&dyn LoopHistory, LoopCall<'_>) {
        let call =
            LoopCall { key: self.key.key(), signature: self.signature, window: self.window, repeats: self.repeats };
        (&*self.history, call)
    }
}

impl Loops {
    /// Loop detection with `repeats` identical calls in `window`, in `shared` too when given.
    pub fn new(repeats: u32, window: Nanos, shared: Option<Arc<dyn LoopHistory>>) -> Self {
        Self { local: LoopDetector::new(repeats, window), shared, repeats, window }
    }

    /// How many identical calls in a row make a loop.
    pub fn repeats(&self) -> u32 {
        self.repeats
    }

    /// `call` by `caller` as the shared history checks it, when there is one.
    pub fn shared_call(&self, caller: &Caller, call: &ToolCall<'_>) -> Option<SharedLoopCall> {
        Some(SharedLoopCall {
            history: self.shared.clone()?,
            key: Scope::loops(caller),
            signature: signature(SHARED_SIGNATURE_SEED, call.tool, call.args),
            window: self.window,
            repeats: self.repeats,
        })
    }

    /// Records `call` by `caller` at `now` in this instance's detector, or says it repeats a loop.
    pub fn check_locally(&self, caller: &Caller, call: &ToolCall<'_>, now: Nanos) -> Result<Recorded, Looping> {
        self.local.check(loop_owner(caller), call.tool, call.args, now)
    }

    /// Takes back a call this instance's detector recorded (a later step refused it).
    pub fn forget(&self, caller: &Caller, recorded: Recorded) {
        self.local.forget(loop_owner(caller), recorded);
    }

    /// Forgets idle histories of this instance; how many went.
    pub fn sweep(&self, now: Nanos) -> usize {
        self.local.sweep(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::NANOS_PER_SEC as SEC;
    use serde_json::json;
    use std::sync::{Arc, Barrier};

    const WINDOW: Nanos = 60 * SEC;

    fn detector() -> LoopDetector {
        LoopDetector::new(5, WINDOW)
    }

    fn canonical(value: &Value) -> String {
        let mut out = String::new();
        push_canonical(&mut out, value);
        out
    }

    #[test]
    fn the_fifth_identical_call_is_refused_until_the_window_passes() {
        let d = detector();
        let args = json!({"prompt": "a cat"});
        for t in 0..4 {
            assert!(d.check("alice", "generate", &args, t * SEC).is_ok(), "call {t}");
        }
        let refused = Looping { retry_after: WINDOW, repeats: 5, oscillating: false };
        assert_eq!(d.check("alice", "generate", &args, 4 * SEC), Err(refused));
        let refused = Looping { retry_after: WINDOW - 10 * SEC, repeats: 5, oscillating: false };
        assert_eq!(d.check("alice", "generate", &args, 14 * SEC), Err(refused));
        assert!(d.check("alice", "generate", &args, 4 * SEC + WINDOW).is_ok());
    }

    #[test]
    fn a_changed_argument_or_another_tool_is_another_call() {
        let d = detector();
        for t in 0..4 {
            assert!(d.check("alice", "generate", &json!({"prompt": "a cat"}), t).is_ok());
        }
        assert!(d.check("alice", "generate", &json!({"prompt": "a cat!"}), 4).is_ok());
        assert!(d.check("alice", "generate", &json!({"prompt": "a cat"}), 5).is_ok());
        let d = detector();
        for t in 0..4 {
            assert!(d.check("alice", "generate", &json!({}), t).is_ok());
        }
        assert!(d.check("alice", "status", &json!({}), 4).is_ok());
    }

    #[test]
    fn key_order_does_not_matter() {
        let d = detector();
        for t in 0..4 {
            let args = if t % 2 == 0 { json!({"a": 1, "b": 2}) } else { json!({"b": 2, "a": 1}) };
            assert!(d.check("alice", "generate", &args, t).is_ok());
        }
        assert!(d.check("alice", "generate", &json!({"b": 2, "a": 1}), 4).is_err());
        assert_eq!(
            canonical(&json!({"z": [3, {"y": null, "x": "q\"\n"}], "a": {"c": true, "b": 1.5}})),
            r#"{"a":{"b":1.5,"c":true},"z":[3,{"x":"q\"\u000a","y":null}]}"#
        );
    }

    #[test]
    fn an_a_b_oscillation_is_caught_and_both_calls_stopped() {
        let d = detector();
        let (a, b) = (json!({"id": "a"}), json!({"id": "b"}));
        for t in 0..8 {
            let args = if t % 2 == 0 { &a } else { &b };
            assert!(d.check("alice", "poll", args, t * SEC).is_ok(), "call {t}");
        }
        let refused = Looping { retry_after: WINDOW, repeats: 5, oscillating: true };
        assert_eq!(d.check("alice", "poll", &a, 8 * SEC), Err(refused));
        let refused = Looping { retry_after: WINDOW - SEC, repeats: 5, oscillating: true };
        assert_eq!(d.check("alice", "poll", &b, 9 * SEC), Err(refused));
        assert!(d.check("alice", "poll", &json!({"id": "c"}), 9 * SEC).is_ok());
    }

    #[test]
    fn a_break_in_the_alternation_resets_it() {
        let d = detector();
        let (a, b, c) = (json!({"id": "a"}), json!({"id": "b"}), json!({"id": "c"}));
        for (t, args) in [&a, &b, &a, &b, &a, &b, &a, &b, &b, &a, &b, &a, &b, &c, &a, &b, &a].into_iter().enumerate() {
            assert!(d.check("alice", "poll", args, t as Nanos).is_ok(), "call {t}");
        }
    }

    #[test]
    fn a_a_b_is_neither_a_run_nor_an_alternation() {
        let d = detector();
        let (a, b) = (json!({"id": "a"}), json!({"id": "b"}));
        for t in 0..30 {
            let args = if t % 3 == 2 { &b } else { &a };
            assert!(d.check("alice", "poll", args, t).is_ok(), "call {t}");
        }
    }

    #[test]
    fn calls_further_apart_than_the_window_never_trip() {
        let d = detector();
        for t in 0..20 {
            assert!(d.check("alice", "generate", &json!({}), t * WINDOW).is_ok(), "call {t}");
        }
        // Old calls fall out of an alternation too.
        let d = detector();
        let (a, b) = (json!({"id": "a"}), json!({"id": "b"}));
        for t in 0..20 {
            let args = if t % 2 == 0 { &a } else { &b };
            assert!(d.check("alice", "poll", args, t * WINDOW / 4).is_ok(), "call {t}");
        }
    }

    #[test]
    fn callers_are_independent() {
        let d = detector();
        for t in 0..4 {
            assert!(d.check("alice", "generate", &json!({}), t).is_ok());
            assert!(d.check("bob", "generate", &json!({}), t).is_ok());
        }
        assert!(d.check("alice", "generate", &json!({}), 4).is_err());
        assert!(d.check("carol", "generate", &json!({}), 4).is_ok());
        assert!(d.check("bob", "generate", &json!({}), 4).is_err());
    }

    #[test]
    fn a_forgotten_call_does_not_count() {
        let d = detector();
        for t in 0..3 {
            assert!(d.check("alice", "generate", &json!({}), t).is_ok());
        }
        let Ok(taken_back) = d.check("alice", "generate", &json!({}), 3) else { panic!("4th call refused") };
        d.forget("alice", taken_back);
        d.forget("alice", taken_back);
        d.forget("nobody", taken_back);
        assert!(d.check("alice", "generate", &json!({}), 4).is_ok());
        assert!(d.check("alice", "generate", &json!({}), 5).is_err());
    }

    #[test]
    fn sweep_frees_idle_callers() {
        let d = detector();
        assert!(d.check("idle", "generate", &json!({}), 0).is_ok());
        assert!(d.check("busy", "generate", &json!({}), WINDOW).is_ok());
        for t in 0..5 {
            let _ = d.check("stopped", "generate", &json!({}), t * SEC);
        }
        assert_eq!(d.sweep(WINDOW), 1);
        // "stopped" has nothing in the window by now but its stop runs until 4 s + WINDOW.
        assert_eq!(d.sweep(WINDOW + 4 * SEC - 1), 0);
        assert_eq!(d.sweep(2 * WINDOW), 2);
        assert_eq!(d.window(), WINDOW);
    }

    #[test]
    fn eight_threads_on_one_call_get_exactly_repeats_minus_one_through() {
        let d = Arc::new(detector());
        let barrier = Arc::new(Barrier::new(8));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (d, barrier) = (Arc::clone(&d), Arc::clone(&barrier));
                std::thread::spawn(move || {
                    barrier.wait();
                    (0..50).filter(|i| d.check("alice", "generate", &json!({"n": 1}), *i * SEC / 10).is_ok()).count()
                })
            })
            .collect();
        let admitted: usize = threads.into_iter().map(|t| t.join().expect("a check thread panicked")).sum();
        assert_eq!(admitted, 4);
    }

    #[test]
    fn stops_per_caller_are_bounded() {
        let d = LoopDetector::new(2, WINDOW);
        for n in 0..100u64 {
            let args = json!({ "n": n });
            assert!(d.check("alice", "generate", &args, n).is_ok());
            assert!(d.check("alice", "generate", &args, n).is_err());
        }
        let state = d.lock();
        let alice = state.callers.get("alice").map(|h| (h.calls.len(), h.stops.len()));
        assert_eq!(alice, Some((4, MAX_STOPS)));
    }
}
