//! Loop detection: a stuck agent repeats the exact same call, or keeps getting the same answer;
//! a working one varies its calls and gets somewhere.
//!
//! Each caller (a caller id, never a raw credential) has a short history of its recent calls,
//! across sessions, as signatures of the tool name and its canonicalised arguments, and of the
//! answers they got (hashed by [`crate::guard::progress`], volatile fields left out). Three
//! patterns are refused, with `repeats` (default 5), `no_progress` (default 5) and `window`
//! (default 60 s):
//!
//! - **Repetition**: the same signature `repeats` times in a row within the window. The
//!   `repeats`-th call is refused.
//! - **Oscillation**: a trailing run of calls alternating strictly between two signatures
//!   (A B A B …). The call that would be the `repeats`-th occurrence of its signature in that
//!   run, within the window, is refused.
//! - **No progress**: the same answer from the same tool `no_progress` times in a row within the
//!   window, whatever the arguments (an agent paraphrasing a search that keeps coming back
//!   empty). That answer still reaches the caller, with a warning the model reads (the one
//!   before it warns too: [`NoProgress`]); the tool's next call is refused.
//!
//! A refused pattern becomes a hard stop: every identical call (for an oscillation, a call of
//! either signature; for no progress, any call of the tool) is refused with the time left until
//! `window` has passed since the refusal, and is not recorded. Anything else resets: a different
//! call in between breaks a run, calls older than the window do not count, a change of any
//! argument makes a different signature, and **an answer that changed is never a loop**: when a
//! call's answer differs from the one its signature got last, the earlier calls of that
//! signature stop counting (polling something that moves is progress, for any tool).
//!
//! Checking and recording are one atomic step; a recorded call can be taken back with
//! [`LoopDetector::forget`] when a later guard step refuses it, so that a call refused for
//! budget never counts as a repetition. Its answer is recorded when it comes
//! ([`LoopDetector::answered`]).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::Value;
use xxhash_rust::xxh3::xxh3_128_with_seed;

use crate::clock::Nanos;
use crate::guard::ToolCall;
use crate::guard::progress::answer_hash;
use crate::guard::scope::{Scope, loop_owner};
use crate::identity::Caller;
use crate::store::{LoopAnswered, LoopCall, LoopHistory};
pub use crate::store::{Pattern, Streaked};

/// The most signatures one caller can have stopped at once. Reaching it drops the stop that
/// ends soonest: an agent looping on that many different calls inside one window is stopped
/// again after another `repeats` calls anyway, and memory stays bounded.
const MAX_STOPS: usize = 32;

/// The most tools whose last answers one caller's history keeps; reaching it drops the streak
/// heard of longest ago.
const MAX_STREAKS: usize = 32;

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

/// One caller's last `2 × repeats` calls (oldest first), its stops in force and the last answer
/// of each tool it called lately.
#[derive(Debug, Default)]
struct History {
    calls: VecDeque<Call>,
    stops: Vec<Stop>,
    streaks: VecDeque<Streak>,
}

/// One recorded call.
#[derive(Debug, Clone, Copy)]
struct Call {
    seq: u64,
    /// Its signature; `None` once an answer that changed made it stop counting (it then matches
    /// no call, so it breaks runs and alternations as a different call would).
    signature: Option<u128>,
    at: Nanos,
    /// The hash of its answer, once heard.
    answer: Option<u128>,
}

/// A signature refused until `until`.
#[derive(Debug, Clone, Copy)]
struct Stop {
    signature: u128,
    until: Nanos,
    pattern: Pattern,
}

/// The last answer a tool gave a caller, and how many times in a row it gave it.
#[derive(Debug, Clone, Copy)]
struct Streak {
    /// The tool's signature ([`tool_signature`]).
    tool: u128,
    answer: u128,
    same: u32,
    at: Nanos,
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
    /// How many repetitions (or, for no progress, identical answers) trip the detector, for the
    /// message to the agent.
    pub repeats: u32,
    /// The pattern found.
    pub pattern: Pattern,
}

/// The warning an answer carries when its tool keeps giving the caller the same answer: one
/// answer before the stop, and with the answer that stops the tool.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, schemars::JsonSchema)]
pub struct NoProgress {
    /// The tool.
    pub tool: String,
    /// Identical answers in a row, this one included.
    pub same_answers: u32,
    /// How many make a loop.
    pub no_progress: u32,
    /// Milliseconds the tool is now refused for; absent while it is not yet.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refused_for_ms: Option<u64>,
}

impl NoProgress {
    /// The warning for `streaked`, the `tool`'s answers under `no_progress`, if it warrants one:
    /// from one identical answer short of the stop.
    pub fn of(tool: &str, streaked: Streaked, no_progress: u32) -> Option<Self> {
        let warn_from = no_progress.saturating_sub(1).max(2);
        (no_progress >= 2 && streaked.same >= warn_from).then(|| NoProgress {
            tool: tool.to_owned(),
            same_answers: streaked.same,
            no_progress,
            refused_for_ms: streaked.stopped_for.map(|wait| crate::clock::ceil_ms(wait).max(1)),
        })
    }

    /// The warning in words, for the model to read.
    pub fn sentence(&self) -> String {
        let Self { tool, same_answers, refused_for_ms, .. } = self;
        match refused_for_ms {
            Some(ms) => format!(
                "Loop warning: {tool} gave you the same answer {same_answers} times in a row, whatever you asked. \
                 Calls of {tool} are now refused for the next {} s. Do not rephrase and retry: use what you \
                 have, try another tool, or ask the user.",
                ms.div_ceil(1_000)
            ),
            None => format!(
                "Note: {tool} gave you the same answer {same_answers} times in a row. Asking again, however \
                 phrased, is unlikely to change it; if the next answer is the same again, {tool} is stopped for \
                 a while. Try something else."
            ),
        }
    }
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

    /// Records the answer (its hash, [`crate::guard::progress::answer_hash`]) that `caller`'s
    /// call of `tool` with `args` got at `now`. An answer other than the last one that signature
    /// got makes its earlier calls stop counting towards a loop. With `no_progress` (0: off), the
    /// tool's answers are counted too, whatever the arguments: the `no_progress`-th identical one
    /// in a row stops the tool for the window.
    pub fn answered(
        &self,
        caller: &str,
        (tool, args): (&str, &Value),
        answer: u128,
        no_progress: u32,
        now: Nanos,
    ) -> Streaked {
        let signature = self.signature(tool, args);
        let stopping_tool = tool_signature(self.seed, tool);
        let mut state = self.lock();
        let history = state.callers.entry(caller.to_owned()).or_default();
        hear_answer(&mut history.calls, signature, answer);
        if no_progress < 2 {
            return Streaked { same: 1, stopped_for: None };
        }
        history.streaks.retain(|s| now.saturating_sub(s.at) < self.window);
        let same = match history.streaks.iter().position(|s| s.tool == stopping_tool) {
            Some(i) => {
                let streak = &mut history.streaks[i];
                streak.same = if streak.answer == answer { streak.same.saturating_add(1) } else { 1 };
                (streak.answer, streak.at) = (answer, now);
                streak.same
            }
            None => {
                if history.streaks.len() >= MAX_STREAKS {
                    history.streaks.pop_front();
                }
                history.streaks.push_back(Streak { tool: stopping_tool, answer, same: 1, at: now });
                1
            }
        };
        let stopped_for = (same >= no_progress).then(|| {
            self.stop(history, stopping_tool, now, Pattern::NoProgress);
            self.window
        });
        Streaked { same, stopped_for }
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
                || h.streaks.iter().any(|s| now.saturating_sub(s.at) < self.window)
        });
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

    fn looping(&self, retry_after: Nanos, pattern: Pattern) -> Looping {
        Looping { retry_after, repeats: self.repeats, pattern }
    }

    fn stop(&self, history: &mut History, signature: u128, now: Nanos, pattern: Pattern) {
        history.stops.retain(|s| s.signature != signature);
        if history.stops.len() >= MAX_STOPS
            && let Some(soonest) = history.stops.iter().enumerate().min_by_key(|(_, s)| s.until).map(|(i, _)| i)
        {
            history.stops.swap_remove(soonest);
        }
        history.stops.push(Stop { signature, until: now.saturating_add(self.window), pattern });
    }

    fn signature(&self, tool: &str, args: &Value) -> u128 {
        signature(self.seed, tool, args)
    }
}

/// Gives `answer` to the latest call of `signature` still waiting for one; if the answer before
/// it of that signature was another, the earlier calls of that signature stop counting: the
/// answer changed, so repeating the call was progress, not a loop.
fn hear_answer(calls: &mut VecDeque<Call>, signature: u128, answer: u128) {
    let Some(this) = calls.iter().rposition(|c| c.signature == Some(signature) && c.answer.is_none()) else {
        return;
    };
    let earlier = calls.iter().take(this).rev().find(|c| c.signature == Some(signature) && c.answer.is_some());
    if earlier.is_some_and(|c| c.answer != Some(answer)) {
        for call in calls.iter_mut().take(this).filter(|c| c.signature == Some(signature)) {
            call.signature = None;
        }
    }
    calls[this].answer = Some(answer);
}

/// The signature of a tool's answers ([`Pattern::NoProgress`]): its stop matches every call of
/// the tool. It never equals a call's signature: a call's canonical form is the quoted name and
/// JSON arguments, and `#answers` is not JSON.
pub fn tool_signature(seed: u64, tool: &str) -> u128 {
    let mut text = String::new();
    push_json_string(&mut text, tool);
    text.push_str("#answers");
    xxh3_128_with_seed(text.as_bytes(), seed)
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
    // The runs between characters that need escaping are copied whole; those are ASCII, so every
    // cut falls on a character boundary.
    let mut start = 0;
    for (i, byte) in s.bytes().enumerate() {
        let escaped = match byte {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            b if b < 0x20 => "",
            _ => continue,
        };
        out.push_str(s.get(start..i).unwrap_or_default());
        if escaped.is_empty() {
            out.push_str(&format!("\\u{byte:04x}"));
        } else {
            out.push_str(escaped);
        }
        start = i + 1;
    }
    out.push_str(s.get(start..).unwrap_or_default());
    out.push('"');
}

/// The seed of call signatures kept in a shared store: every instance must compute the same
/// signature for the same call. (A known seed lets a caller craft two calls that collide; that
/// only ever stops its own calls, since histories are per caller.)
const SHARED_SIGNATURE_SEED: u64 = 0x6d63_702d_726c_6f6f;

/// The loop stage of the guard: in this instance's memory, and over a shared store in its
/// [`LoopHistory`], so that every instance sees one history per caller. The shared history
/// checks a call in the same step as its budgets ([`Loops::shared_call`]) and hears its answer
/// in a round trip of its own ([`Loops::answered`]); this instance's detector does both when
/// there is no shared history, or while it cannot decide.
#[derive(Debug)]
pub struct Loops {
    local: LoopDetector,
    shared: Option<Arc<dyn LoopHistory>>,
    repeats: u32,
    window: Nanos,
    /// `[loop_detection] no_progress` and `volatile_fields`: what a tool without its own compares.
    no_progress: u32,
    volatile_fields: Vec<String>,
}

/// A call as the shared loop history checks it: in the caller's history, by its signature.
#[derive(Debug)]
pub struct SharedLoopCall {
    history: Arc<dyn LoopHistory>,
    key: Scope,
    signature: u128,
    tool_signature: u128,
    window: Nanos,
    repeats: u32,
}

impl SharedLoopCall {
    /// The history to check the call in, and the call as it is checked.
    pub fn parts(&self) -> (&dyn LoopHistory, LoopCall<'_>) {
        let call = LoopCall {
            key: self.key.key(),
            signature: self.signature,
            tool_signature: self.tool_signature,
            window: self.window,
            repeats: self.repeats,
        };
        (&*self.history, call)
    }
}

impl Loops {
    /// Loop detection with `repeats` identical calls in `window`, in `shared` too when given.
    pub fn new(repeats: u32, window: Nanos, shared: Option<Arc<dyn LoopHistory>>) -> Self {
        Self {
            local: LoopDetector::new(repeats, window),
            shared,
            repeats,
            window,
            no_progress: 0,
            volatile_fields: Vec::new(),
        }
    }

    /// These loops comparing answers too: `no_progress` identical ones of a tool in a row stop it
    /// (0: answers are not compared), `volatile_fields` left out; for a tool that does not say
    /// its own.
    pub fn comparing(mut self, no_progress: u32, volatile_fields: Vec<String>) -> Self {
        (self.no_progress, self.volatile_fields) = (no_progress, volatile_fields);
        self
    }

    /// What `policy` (the tool's own, if it has one) compares of a tool's answers: how many
    /// identical ones stop it (0: none) and which fields are left out. A tool without its own
    /// `no_progress` has `[loop_detection]`'s if it `reads_only`, else none: the same
    /// acknowledgement of a write is not a loop.
    pub fn answers_of<'a>(
        &'a self,
        policy: Option<&'a crate::config::ToolPolicy>,
        reads_only: bool,
    ) -> (u32, &'a [String]) {
        let default = if reads_only { self.no_progress } else { 0 };
        let no_progress = policy.and_then(|p| p.no_progress).unwrap_or(default);
        let volatile = policy.and_then(|p| p.volatile_fields.as_deref()).unwrap_or(&self.volatile_fields);
        (no_progress, volatile)
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
            tool_signature: tool_signature(SHARED_SIGNATURE_SEED, call.tool),
            window: self.window,
            repeats: self.repeats,
        })
    }

    /// Records `call` by `caller` at `now` in this instance's detector, or says it repeats a loop.
    pub fn check_locally(&self, caller: &Caller, call: &ToolCall<'_>, now: Nanos) -> Result<Recorded, Looping> {
        self.local.check(loop_owner(caller), call.tool, call.args, now)
    }

    /// Records the answer `caller`'s call of `tool` with `args` got at `now`, where its call was
    /// checked: in the shared history when there is one (this instance's detector while it cannot
    /// answer), else here. `answer` is what the answer says ([`crate::guard::Door::outcome`]),
    /// compared without `volatile` fields; with `no_progress` (0: off) the tool's answers are
    /// counted whatever the arguments.
    pub async fn answered(
        &self,
        caller: &Caller,
        (tool, args): (&str, &Value),
        (answer, volatile): (&Value, &[String]),
        no_progress: u32,
        now: Nanos,
    ) -> Streaked {
        if let Some(shared) = &self.shared {
            let key = Scope::loops(caller);
            let heard = LoopAnswered {
                key: key.key(),
                signature: signature(SHARED_SIGNATURE_SEED, tool, args),
                tool_signature: tool_signature(SHARED_SIGNATURE_SEED, tool),
                answer: answer_hash(SHARED_SIGNATURE_SEED, answer, volatile),
                window: self.window,
                repeats: self.repeats,
                no_progress,
            };
            match shared.answered(heard).await {
                Ok(streaked) => return streaked,
                Err(error) => tracing::debug!(%error, "the shared loop history did not hear an answer; kept here"),
            }
        }
        let answer = answer_hash(self.local.seed, answer, volatile);
        self.local.answered(loop_owner(caller), (tool, args), answer, no_progress, now)
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
        let refused = Looping { retry_after: WINDOW, repeats: 5, pattern: Pattern::Repeated };
        assert_eq!(d.check("alice", "generate", &args, 4 * SEC), Err(refused));
        let refused = Looping { retry_after: WINDOW - 10 * SEC, repeats: 5, pattern: Pattern::Repeated };
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
        let refused = Looping { retry_after: WINDOW, repeats: 5, pattern: Pattern::Oscillating };
        assert_eq!(d.check("alice", "poll", &a, 8 * SEC), Err(refused));
        let refused = Looping { retry_after: WINDOW - SEC, repeats: 5, pattern: Pattern::Oscillating };
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

    /// A call that always gets `answer`, checked then heard, as the guard does.
    fn ask(d: &LoopDetector, args: &Value, answer: u128, at: Nanos) -> Result<Streaked, Looping> {
        d.check("alice", "search", args, at)?;
        Ok(d.answered("alice", ("search", args), answer, 5, at))
    }

    #[test]
    fn the_same_answer_five_times_stops_the_tool_whatever_the_arguments() {
        let d = detector();
        for n in 0..5u32 {
            let streaked = ask(&d, &json!({ "query": format!("zebras, take {n}") }), 7, Nanos::from(n) * SEC);
            let stopped_for = (n == 4).then_some(WINDOW);
            assert_eq!(streaked, Ok(Streaked { same: n + 1, stopped_for }), "answer {n}");
        }
        let refused = Looping { retry_after: WINDOW - SEC, repeats: 5, pattern: Pattern::NoProgress };
        assert_eq!(d.check("alice", "search", &json!({"query": "anything else"}), 5 * SEC), Err(refused));
        assert!(d.check("alice", "fetch", &json!({}), 5 * SEC).is_ok(), "another tool is not stopped");
        assert!(d.check("bob", "search", &json!({}), 5 * SEC).is_ok(), "nor another caller");
        assert!(d.check("alice", "search", &json!({"query": "later"}), 4 * SEC + WINDOW).is_ok(), "a window on");
    }

    #[test]
    fn an_answer_that_changed_is_never_a_loop() {
        // The same call polled 50 times, its answer moving every time: never refused.
        let d = detector();
        let poll = json!({"job": "j1"});
        for n in 0..50u32 {
            let streaked = ask(&d, &poll, u128::from(n), Nanos::from(n) * SEC / 10);
            assert_eq!(streaked, Ok(Streaked { same: 1, stopped_for: None }), "poll {n}");
        }
        // Moving every other time is progress too: a run never reaches five unanswered repeats.
        let d = detector();
        for n in 0..50u32 {
            assert!(ask(&d, &poll, u128::from(n / 2), Nanos::from(n)).is_ok(), "poll {n}");
        }
        // But the same answer again and again to the same call is the old loop, at the fifth.
        let d = detector();
        for n in 0..4 {
            assert!(ask(&d, &poll, 1, n).is_ok());
        }
        assert_eq!(d.check("alice", "search", &poll, 4).map_err(|l| l.pattern), Err(Pattern::Repeated));
    }

    #[test]
    fn an_alternation_whose_answers_move_is_not_an_oscillation() {
        let d = detector();
        let (a, b) = (json!({"page": 1}), json!({"page": 2}));
        for n in 0..40u32 {
            let (args, answer) = if n % 2 == 0 { (&a, u128::from(n)) } else { (&b, 1_000) };
            assert!(d.check("alice", "poll", args, Nanos::from(n)).is_ok(), "call {n}");
            d.answered("alice", ("poll", args), answer, 0, Nanos::from(n));
        }
    }

    #[test]
    fn without_no_progress_answers_only_break_runs() {
        let d = detector();
        for n in 0..20u64 {
            assert!(d.check("alice", "search", &json!({ "q": n }), n).is_ok());
            assert_eq!(
                d.answered("alice", ("search", &json!({ "q": n })), 7, 0, n),
                Streaked { same: 1, stopped_for: None }
            );
        }
    }

    #[test]
    fn the_nudge_comes_one_answer_before_the_stop_and_with_it() {
        let of = |same, stopped_for| NoProgress::of("search", Streaked { same, stopped_for }, 5);
        assert_eq!(of(3, None), None);
        let warned = of(4, None).expect("one short of the stop");
        assert!(warned.sentence().contains("same answer 4 times"), "{}", warned.sentence());
        let stopped = of(5, Some(WINDOW)).expect("the stop");
        assert_eq!(stopped.refused_for_ms, Some(60_000));
        assert!(stopped.sentence().contains("refused for the next 60 s"), "{}", stopped.sentence());
        // With no_progress 2 the first answer never warns; off, nothing does.
        assert_eq!(NoProgress::of("search", Streaked { same: 1, stopped_for: None }, 2), None);
        assert_eq!(NoProgress::of("search", Streaked { same: 9, stopped_for: None }, 0), None);
    }
}
