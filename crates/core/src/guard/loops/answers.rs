//! The answer-loop half of the detector: a tool that keeps giving a caller the same answer,
//! whatever the arguments, warned of then stopped; and an answer that changed, never a loop.

use std::collections::VecDeque;

use serde_json::Value;

use super::history::{Call, MAX_STREAKS, Streak};
use super::{LoopDetector, Pattern, Streaked, tool_signature};
use crate::clock::Nanos;

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
    /// Records the answer (its hash, [`crate::guard::after::progress::answer_hash`]) that `caller`'s
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
        history.streaks.retain(|s| now - s.at < self.window);
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
