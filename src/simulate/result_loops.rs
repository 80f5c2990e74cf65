//! `paraphrasing_searcher` and `polling_with_progress`: loops found by their results
//! ([`crate::guard::loops`]), and polls that are not loops because their answers move.
//!
//! Each agent calls through the one guarded call ([`Guard::call`](crate::guard::Guard::call)) on a
//! [`ManualClock`], one call per turn; a refused call is retried after the wait it names (the agent
//! obeys `retry_after_ms` and nothing else). Each shape runs under three settings of loop
//! detection (on, with the config's `repeats` and `window_ms`):
//!
//! - **arguments only**: answers are not heard (how the detector was before it compared them);
//! - **answers heard, `no_progress = 0`**: an answer that changed makes the call's earlier
//!   repetitions stop counting, but answers are not counted;
//! - **`no_progress = N`** (the config's, or 5 where it has 0): the same answer `N` times in a row
//!   stops the tool, whatever the arguments.
//!
//! **`paraphrasing_searcher`**: for 10 minutes, an agent searches for something that is not there,
//! rephrasing the query every turn (2 s); every answer is empty (with a fresh `request_id` and
//! `took_ms`, which are volatile). What matters: how many searches reached the paid API.
//!
//! **`polling_with_progress`**: an agent polls a job's status with the same arguments every 2 s; the
//! job's `progress` moves on every poll until it succeeds at 2 min, and the agent stops once it sees
//! that. What matters: that no poll is refused while the answer moves, and when the agent learns
//! the result. Nothing is random.

use std::borrow::Cow;
use std::fmt::Write as _;

use serde::Serialize;
use serde_json::{Value, json};

use crate::clock::{Clock, ManualClock, NANOS_PER_MS, Nanos};
use crate::config::Config;
use crate::guard::{Answer, Call, Called, Plain, RefusalCode, Worked};
use crate::identity::Caller;
use crate::simulate::SimulateError;
use crate::simulate::shapes::secs;

/// One turn of the agent: a model round trip, then a call.
const TURN: Nanos = Nanos::from_secs(2);
/// How long the searcher searches.
const SEARCH_FOR: Nanos = Nanos::from_secs(600);
/// When the polled job succeeds.
const JOB_DONE: Nanos = Nanos::from_secs(120);
/// How long the poller polls at most.
const POLL_FOR: Nanos = Nanos::from_secs(600);
/// The `no_progress` used where the config has 0.
const DEFAULT_NO_PROGRESS: u32 = 5;

/// One setting of loop detection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Setting {
    ArgumentsOnly,
    AnswersHeard,
    NoProgress(u32),
}

impl Setting {
    fn all(config: &Config) -> [Setting; 3] {
        let configured = config.limiting.loop_detection.no_progress;
        let n = if configured == 0 { DEFAULT_NO_PROGRESS } else { configured };
        [Setting::ArgumentsOnly, Setting::AnswersHeard, Setting::NoProgress(n)]
    }

    fn name(self) -> String {
        match self {
            Setting::ArgumentsOnly => "arguments only".to_owned(),
            Setting::AnswersHeard => "answers heard, no_progress = 0".to_owned(),
            Setting::NoProgress(n) => format!("no_progress = {n}"),
        }
    }
}

/// One agent under one setting.
#[derive(Debug, Clone, Serialize)]
pub struct ResultRun {
    /// The setting of loop detection.
    pub setting: String,
    /// Calls the agent made.
    pub calls: u64,
    /// Of them, answered (each a request to the paid API).
    pub answered: u64,
    /// Of them, refused as a loop (a refusal by a budget is waited out, and not counted here).
    pub refused: u64,
    /// The first call refused (1-based), if any was.
    pub first_refused: Option<u64>,
    /// Answers that carried the no-progress warning.
    pub warned: u64,
    /// Of the poller: when it saw the job's result, in milliseconds from the start.
    pub result_seen_ms: Option<u64>,
    /// Of the poller: polls refused while the job's answer was still moving.
    pub refused_while_moving: u64,
}

/// Both shapes under every setting.
#[derive(Debug, Clone, Serialize)]
pub struct ResultLoops {
    /// `paraphrasing_searcher`, if it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub paraphrasing_searcher: Option<Vec<ResultRun>>,
    /// `polling_with_progress`, if it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub polling_with_progress: Option<Vec<ResultRun>>,
    /// `repeats` and `window_ms` the runs used.
    pub repeats: u32,
    /// The window, in milliseconds.
    pub window_ms: u64,
}

/// Replays the shapes asked for under every setting, each on its own clock and guard.
pub(crate) fn run(config: &Config, searcher: bool, poller: bool) -> Result<ResultLoops, SimulateError> {
    let (caller, _) = super::simulated_caller(config)?;
    let replay = |agent: Agent| -> Result<Vec<ResultRun>, SimulateError> {
        Setting::all(config)
            .into_iter()
            .map(|setting| super::on_one_thread(replay(config, &caller, setting, agent)))
            .collect()
    };
    Ok(ResultLoops {
        paraphrasing_searcher: searcher.then(|| replay(Agent::Searcher)).transpose()?,
        polling_with_progress: poller.then(|| replay(Agent::Poller)).transpose()?,
        repeats: config.limiting.loop_detection.repeats,
        window_ms: config.limiting.loop_detection.window_ms,
    })
}

/// The two agents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Agent {
    Searcher,
    Poller,
}

impl Agent {
    /// The tool the agent calls.
    fn tool(self) -> &'static str {
        match self {
            Agent::Searcher => "list_articles",
            Agent::Poller => "get_prediction",
        }
    }

    /// The arguments of its `n`th call.
    fn args(self, n: u64) -> serde_json::Map<String, Value> {
        let args = match self {
            Agent::Searcher => json!({ "query": format!("zebra migration routes, take {n}") }),
            Agent::Poller => json!({ "predict_id": "p-1" }),
        };
        args.as_object().cloned().unwrap_or_default()
    }

    /// What the paid API answers its `n`th answered call at `at`.
    fn answer(self, n: u64, at: Nanos) -> Value {
        match self {
            Agent::Searcher => json!({ "articles": [], "request_id": format!("r{n}"), "took_ms": 40 + n % 17 }),
            Agent::Poller if at >= JOB_DONE => {
                json!({ "status": "succeeded", "output": "https://example.com/p-1.png" })
            }
            Agent::Poller => json!({
                "status": "processing",
                "progress": at * 100 / JOB_DONE,
                "timestamp": at.as_u64() / NANOS_PER_MS,
            }),
        }
    }

    fn horizon(self) -> Nanos {
        match self {
            Agent::Searcher => SEARCH_FOR,
            Agent::Poller => POLL_FOR,
        }
    }
}

/// One agent under one setting.
async fn replay(config: &Config, caller: &Caller, setting: Setting, agent: Agent) -> ResultRun {
    let clock = ManualClock::new();
    let mut config = config.clone();
    let detection = &mut config.limiting.loop_detection;
    detection.enabled = true;
    detection.no_progress = match setting {
        Setting::NoProgress(n) => n,
        _ => 0,
    };
    let guard = super::guard(&config, clock.clone());
    let heard = setting != Setting::ArgumentsOnly;
    let mut run = ResultRun {
        setting: setting.name(),
        calls: 0,
        answered: 0,
        refused: 0,
        first_refused: None,
        warned: 0,
        result_seen_ms: None,
        refused_while_moving: 0,
    };
    let mut at = Nanos::ZERO;
    while at < agent.horizon() {
        clock.advance((at - clock.now()).to_duration());
        run.calls += 1;
        let args = agent.args(run.calls);
        let answer = Heard { answer: agent.answer(run.answered + 1, at), heard };
        let work = |_, _: &Value| std::future::ready(Worked::Answer(answer));
        // Both agents read: a search, a job's status.
        let call = Call { reads_only: true, ..Call::new(agent.tool(), caller, &args) };
        match guard.call(&Plain, None, call, work).await {
            Called::Answered { answer, no_progress, .. } => {
                run.answered += 1;
                run.warned += u64::from(no_progress.is_some());
                if answer.answer["status"] == "succeeded" {
                    run.result_seen_ms = Some(at.as_u64() / NANOS_PER_MS);
                    break;
                }
                at += TURN;
            }
            Called::Refused(refusal) if refusal.code == RefusalCode::LoopDetected => {
                run.refused += 1;
                run.first_refused.get_or_insert(run.calls);
                if agent == Agent::Poller && at < JOB_DONE {
                    run.refused_while_moving += 1;
                }
                let wait = refusal.retry_after_ms.map_or(TURN, Nanos::from_millis);
                at += wait.max(TURN);
            }
            Called::Refused(refusal) => {
                // Another limit (a budget): waited out, not a loop.
                let wait = refusal.retry_after_ms.map_or(TURN, Nanos::from_millis);
                at += wait.max(TURN);
            }
            _ => at += TURN,
        }
    }
    run
}

/// An agent's answer: JSON, heard by loop detection unless the setting says not.
#[derive(Debug, Clone)]
struct Heard {
    answer: Value,
    heard: bool,
}

impl Answer for Heard {
    fn outcome(&self) -> Option<Cow<'_, Value>> {
        self.heard.then_some(Cow::Borrowed(&self.answer))
    }
}

impl ResultLoops {
    /// Calls made in every run together.
    pub(crate) fn calls(&self) -> u64 {
        self.paraphrasing_searcher.iter().chain(&self.polling_with_progress).flatten().map(|r| r.calls).sum()
    }

    /// The tables: one per shape, a row per setting.
    pub(crate) fn write_text(&self, out: &mut String) {
        let window = secs(Nanos::from_millis(self.window_ms));
        if let Some(runs) = &self.paraphrasing_searcher {
            let _ = writeln!(out);
            let _ = writeln!(
                out,
                "paraphrasing_searcher ({}): one agent rephrases a search every {} and every answer is empty \
                 (a new request_id each time); refused, it waits the retry_after it is told (repeats {}, window {window})",
                secs(SEARCH_FOR),
                secs(TURN),
                self.repeats
            );
            let _ = writeln!(
                out,
                "  answered  searches that reached the paid API; warned: answers that carried the warning"
            );
            let _ = writeln!(
                out,
                "  {:<32} {:>6} {:>9} {:>8} {:>14} {:>7}",
                "setting", "calls", "answered", "refused", "first refused", "warned"
            );
            for run in runs {
                let first = run.first_refused.map_or("never".to_owned(), |n| format!("call {n}"));
                let _ = writeln!(
                    out,
                    "  {:<32} {:>6} {:>9} {:>8} {:>14} {:>7}",
                    run.setting, run.calls, run.answered, run.refused, first, run.warned
                );
            }
        }
        if let Some(runs) = &self.polling_with_progress {
            let _ = writeln!(out);
            let _ = writeln!(
                out,
                "polling_with_progress: one agent polls a job with the same arguments every {}; its progress moves \
                 on every poll until it succeeds at {}; the agent stops when it sees that, and waits any retry_after \
                 it is told (repeats {}, window {window})",
                secs(TURN),
                secs(JOB_DONE),
                self.repeats
            );
            let _ = writeln!(
                out,
                "  {:<32} {:>6} {:>8} {:>20} {:>14}",
                "setting", "polls", "refused", "refused while moving", "result seen at"
            );
            for run in runs {
                let seen = run.result_seen_ms.map_or("never".to_owned(), |ms| secs(Nanos::from_millis(ms)));
                let _ = writeln!(
                    out,
                    "  {:<32} {:>6} {:>8} {:>20} {:>14}",
                    run.setting, run.calls, run.refused, run.refused_while_moving, seen
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Config {
        Config::from_toml("[loop_detection]\nno_progress = 5\n", &crate::mcp::tools::catalogue()).expect("valid")
    }

    #[test]
    fn the_paraphraser_is_stopped_only_by_its_answers_and_then_within_six_calls() {
        let loops = run(&config(), true, false).expect("runs");
        let runs = loops.paraphrasing_searcher.expect("ran");
        assert_eq!((runs[0].refused, runs[0].answered), (0, 300), "arguments only: every search paid");
        assert_eq!((runs[1].refused, runs[1].answered), (0, 300), "answers only break runs");
        assert_eq!(runs[2].first_refused, Some(6), "stopped at no_progress + 1");
        // Five searches a window and a turn at most: 5 per 62 s over 600 s.
        assert!(runs[2].answered <= 50, "{:?}", runs[2]);
        assert!(runs[2].warned >= 2, "warned before and at each stop: {:?}", runs[2]);
    }

    #[test]
    fn the_poller_whose_answer_moves_is_never_stopped_by_answers_heard() {
        let loops = run(&config(), false, true).expect("runs");
        let runs = loops.polling_with_progress.expect("ran");
        assert!(runs[0].refused_while_moving > 0, "arguments only stops a moving poll: {:?}", runs[0]);
        assert!(runs[0].result_seen_ms > Some(120_000), "and it learns late: {:?}", runs[0]);
        for run in &runs[1..] {
            assert_eq!(run.refused, 0, "{run:?}");
            assert_eq!(run.result_seen_ms, Some(120_000), "{run:?}");
        }
    }
}
