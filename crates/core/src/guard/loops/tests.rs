//! The loop detector's tests: repeats, alternations, answers that stay the same or move, and the
//! bounds on what one caller's history keeps.

use std::sync::{Arc, Barrier};

use serde_json::{Value, json};

use super::history::MAX_STOPS;
use super::signature::push_canonical;
use super::{LoopDetector, Looping, NoProgress, Pattern, Streaked};
use crate::clock::Nanos;

const SEC: Nanos = Nanos::from_secs(1);

const WINDOW: Nanos = Nanos::from_secs(60);

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
        assert!(d.check("alice", "generate", &json!({"prompt": "a cat"}), Nanos::new(t)).is_ok());
    }
    assert!(d.check("alice", "generate", &json!({"prompt": "a cat!"}), Nanos::new(4)).is_ok());
    assert!(d.check("alice", "generate", &json!({"prompt": "a cat"}), Nanos::new(5)).is_ok());
    let d = detector();
    for t in 0..4 {
        assert!(d.check("alice", "generate", &json!({}), Nanos::new(t)).is_ok());
    }
    assert!(d.check("alice", "status", &json!({}), Nanos::new(4)).is_ok());
}

#[test]
fn key_order_does_not_matter() {
    let d = detector();
    for t in 0..4 {
        let args = if t % 2 == 0 { json!({"a": 1, "b": 2}) } else { json!({"b": 2, "a": 1}) };
        assert!(d.check("alice", "generate", &args, Nanos::new(t)).is_ok());
    }
    assert!(d.check("alice", "generate", &json!({"b": 2, "a": 1}), Nanos::new(4)).is_err());
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
        assert!(d.check("alice", "poll", args, Nanos::new(t as u64)).is_ok(), "call {t}");
    }
}

#[test]
fn a_a_b_is_neither_a_run_nor_an_alternation() {
    let d = detector();
    let (a, b) = (json!({"id": "a"}), json!({"id": "b"}));
    for t in 0..30 {
        let args = if t % 3 == 2 { &b } else { &a };
        assert!(d.check("alice", "poll", args, Nanos::new(t)).is_ok(), "call {t}");
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
        assert!(d.check("alice", "generate", &json!({}), Nanos::new(t)).is_ok());
        assert!(d.check("bob", "generate", &json!({}), Nanos::new(t)).is_ok());
    }
    assert!(d.check("alice", "generate", &json!({}), Nanos::new(4)).is_err());
    assert!(d.check("carol", "generate", &json!({}), Nanos::new(4)).is_ok());
    assert!(d.check("bob", "generate", &json!({}), Nanos::new(4)).is_err());
}

#[test]
fn a_forgotten_call_does_not_count() {
    let d = detector();
    for t in 0..3 {
        assert!(d.check("alice", "generate", &json!({}), Nanos::new(t)).is_ok());
    }
    let Ok(taken_back) = d.check("alice", "generate", &json!({}), Nanos::new(3)) else { panic!("4th call refused") };
    d.forget("alice", taken_back);
    d.forget("alice", taken_back);
    d.forget("nobody", taken_back);
    assert!(d.check("alice", "generate", &json!({}), Nanos::new(4)).is_ok());
    assert!(d.check("alice", "generate", &json!({}), Nanos::new(5)).is_err());
}

#[test]
fn sweep_frees_idle_callers() {
    let d = detector();
    assert!(d.check("idle", "generate", &json!({}), Nanos::ZERO).is_ok());
    assert!(d.check("busy", "generate", &json!({}), WINDOW).is_ok());
    for t in 0..5 {
        let _ = d.check("stopped", "generate", &json!({}), t * SEC);
    }
    assert_eq!(d.sweep(WINDOW), 1);
    // "stopped" has nothing in the window by now but its stop runs until 4 s + WINDOW.
    assert_eq!(d.sweep(WINDOW + 4 * SEC - Nanos::new(1)), 0);
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
        assert!(d.check("alice", "generate", &args, Nanos::new(n)).is_ok());
        assert!(d.check("alice", "generate", &args, Nanos::new(n)).is_err());
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
        let streaked = ask(&d, &json!({ "query": format!("zebras, take {n}") }), 7, u64::from(n) * SEC);
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
        let streaked = ask(&d, &poll, u128::from(n), u64::from(n) * SEC / 10);
        assert_eq!(streaked, Ok(Streaked { same: 1, stopped_for: None }), "poll {n}");
    }
    // Moving every other time is progress too: a run never reaches five unanswered repeats.
    let d = detector();
    for n in 0..50u32 {
        assert!(ask(&d, &poll, u128::from(n / 2), Nanos::new(u64::from(n))).is_ok(), "poll {n}");
    }
    // But the same answer again and again to the same call is the old loop, at the fifth.
    let d = detector();
    for n in 0..4 {
        assert!(ask(&d, &poll, 1, Nanos::new(n)).is_ok());
    }
    assert_eq!(d.check("alice", "search", &poll, Nanos::new(4)).map_err(|l| l.pattern), Err(Pattern::Repeated));
}

#[test]
fn an_alternation_whose_answers_move_is_not_an_oscillation() {
    let d = detector();
    let (a, b) = (json!({"page": 1}), json!({"page": 2}));
    for n in 0..40u32 {
        let (args, answer) = if n % 2 == 0 { (&a, u128::from(n)) } else { (&b, 1_000) };
        assert!(d.check("alice", "poll", args, Nanos::new(u64::from(n))).is_ok(), "call {n}");
        d.answered("alice", ("poll", args), answer, 0, Nanos::new(u64::from(n)));
    }
}

#[test]
fn without_no_progress_answers_only_break_runs() {
    let d = detector();
    for n in 0..20u64 {
        assert!(d.check("alice", "search", &json!({ "q": n }), Nanos::new(n)).is_ok());
        assert_eq!(
            d.answered("alice", ("search", &json!({ "q": n })), 7, 0, Nanos::new(n)),
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
