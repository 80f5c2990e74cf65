//! Loops found by their results, through MCP clients of both eras on both stores: an agent
//! paraphrasing a search that keeps coming back empty is warned, then stopped within
//! `no_progress + 1` calls, and nothing more reaches the paid API; an agent polling something
//! whose answer changes is never stopped, however often it repeats the same call; the same call
//! with the same answer is still the old loop. With the shared store killed, this instance's
//! detector still stops the paraphraser.

use crate::common::*;
use crate::python;
use crate::test_redis::TestRedis;
use serde_json::{Value, json};

const KEYS: &str = "[[auth.keys]]\nkey = \"auto-key\"\n[[auth.keys]]\nkey = \"legacy-key\"\n\
    [[auth.keys]]\nkey = \"rmcp-key\"\n[[auth.keys]]\nkey = \"saver-key\"\n";

/// The stores the tests run on: this process's memory, and a Redis of the test's own.
enum Store {
    Memory,
    Redis(TestRedis),
}

impl Store {
    fn both() -> [Store; 2] {
        [Store::Memory, Store::Redis(TestRedis::start())]
    }

    fn config(&self) -> String {
        match self {
            Store::Memory => KEYS.to_owned(),
            Store::Redis(redis) => {
                format!("{KEYS}[store]\nbackend = \"redis\"\nredis_url = \"{}\"\ntimeout_ms = 200\n", redis.url)
            }
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Store::Memory => "memory",
            Store::Redis(_) => "redis",
        }
    }
}

/// A query of the paraphraser's `n`th try: never the same words, never a match.
fn paraphrase(n: usize) -> String {
    [
        "zebra migration routes",
        "routes zebras migrate along",
        "migrating zebras: the paths",
        "where do zebras migrate",
        "zebra seasonal movement",
        "zebras moving each season",
        "the great zebra trek",
    ][n % 7]
        .to_owned()
}

/// The walk's steps: `calls` calls of `tool`, the `n`th with `args(n)`.
fn calls(tool: &str, count: usize, args: impl Fn(usize) -> Value) -> Value {
    Value::Array((0..count).map(|n| json!({"op": "call", "tool": tool, "args": args(n)})).collect())
}

/// What a Python walk's call step came to: (is_error, text, structured, meta).
fn answered(step: &Value) -> (bool, &str, &Value, &Value) {
    let ok = step.get("ok").unwrap_or_else(|| panic!("the SDK raised: {step}"));
    (ok["is_error"] == json!(true), ok["text"].as_str().unwrap_or_default(), &ok["structured"], &ok["meta"])
}

#[tokio::test]
async fn a_paraphrasing_agent_is_warned_then_stopped_within_no_progress_plus_one_calls_in_both_eras_on_both_stores() {
    for store in Store::both() {
        let server = TestServer::start(&store.config()).await;
        let where_ = store.name();
        for (mode, key) in [("auto", "auto-key"), ("legacy", "legacy-key")] {
            let auth = format!("Authorization: Bearer {key}");
            let steps = calls("list_articles", 7, |n| json!({"query": paraphrase(n)}));
            let walked = python::walk(&server.url, mode, steps, &["-H", &auth]).await;
            assert_eq!(walked["protocol_version"], python::era_of(mode), "{walked}");
            let steps = walked["steps"].as_array().expect("steps");
            for (n, step) in steps.iter().take(5).enumerate() {
                let (is_error, text, structured, _) = answered(step);
                assert!(!is_error, "{where_} {mode}: search {n} is answered: {text}");
                assert_eq!(structured["articles"], json!([]), "{where_} {mode}: nothing found");
                // Ours keeps what the guard adds in the structured content its outputSchema
                // admits (the SDK checked it), never in `_meta`.
                assert!(structured.get("no_progress").is_none());
            }
            let (_, text, structured, meta) = answered(&steps[3]);
            assert!(text.contains("same answer 4 times in a row"), "{where_} {mode}: the nudge: {text}");
            assert_eq!(structured["warnings"][0]["same_answers"], 4, "{where_} {mode}: {structured}");
            assert!(meta.get("io.github.mcp-ratelimit/no_progress").is_none(), "{where_} {mode}: {meta}");
            let (_, text, structured, _) = answered(&steps[4]);
            assert!(text.contains("now refused for the next 60 s"), "{where_} {mode}: the stop, said: {text}");
            assert_eq!(structured["warnings"][0]["refused_for_ms"], 60_000, "{where_} {mode}: {structured}");
            for (n, step) in steps.iter().enumerate().skip(5) {
                let (is_error, text, structured, _) = answered(step);
                assert!(is_error, "{where_} {mode}: search {n} is refused: {text}");
                let error = &structured["error"];
                assert_eq!(error["code"], "loop_detected", "{where_} {mode}: {text}");
                assert_eq!(error["scope"], "loop:list_articles", "{where_} {mode}");
                assert_eq!(error["limit"], 5, "{where_} {mode}");
                // On the manual clock, exactly the window; Redis keeps its own (real) time.
                let wait = error["retry_after_ms"].as_u64().unwrap_or(0);
                assert!((59_000..=60_000).contains(&wait), "{where_} {mode}: {wait}");
                assert!(text.contains("same answer 5 times in a row, whatever the arguments"), "{text}");
            }
        }
        // The same through rmcp's client, and the stop ends with its window.
        let client = server.client(Some("rmcp-key")).await;
        for n in 0..5 {
            assert!(!is_error(&call(&client, "list_articles", json!({"query": paraphrase(n)})).await), "{where_}");
        }
        let stopped = call(&client, "list_articles", json!({"query": paraphrase(5)})).await;
        assert_eq!(error_code(&stopped), Some("loop_detected"), "{where_}: {}", text(&stopped));
        // Another tool is not stopped.
        let saved = call(&client, "save_article", json!({"title": "Zebras", "body": "They migrate."})).await;
        assert!(!is_error(&saved), "{where_}: {}", text(&saved));
        // Three callers, five searches each reached the paid API: no refused call did.
        let mut listed = 15;
        if let Store::Memory = store {
            // A window later (on the manual clock: Redis keeps its own time), it may search again.
            server.advance_ms(60_000);
            let found = call(&client, "list_articles", json!({"query": "zebras"})).await;
            assert!(!is_error(&found), "{where_}: a window later: {}", text(&found));
            listed += 1;
        }
        let usage = server.upstream_usage().await;
        assert_eq!(usage["articles_listed"], listed, "{where_}: {usage}");
    }
}

/// An agent that reads data, not prose, can obey the loop warning: the 4th and 5th identical
/// answers of one of our tools carry it in their `structuredContent.warnings` (what the tool's
/// `outputSchema` admits: the SDK checks every answer against it, in both eras), with the streak,
/// the threshold and, from the stop, how long the tool is refused; the answers before carry none.
#[tokio::test]
async fn the_loop_warning_is_in_our_tools_structured_content_for_clients_of_both_eras() {
    let server = TestServer::start(KEYS).await;
    for (mode, key) in [("auto", "auto-key"), ("legacy", "legacy-key")] {
        let auth = format!("Authorization: Bearer {key}");
        let steps: Vec<Value> = (0..5)
            .map(|n| json!({"op": "call", "tool": "list_articles", "args": {"query": paraphrase(n)}, "check_schema": true}))
            .collect();
        let walked = python::walk(&server.url, mode, Value::Array(steps), &["-H", &auth]).await;
        assert_eq!(walked["protocol_version"], python::era_of(mode), "{walked}");
        assert!(python::all_ok(&walked), "every answer valid for its outputSchema: {walked}");
        let steps = walked["steps"].as_array().expect("steps");
        for (n, step) in steps.iter().take(3).enumerate() {
            let (_, _, structured, _) = answered(step);
            assert!(structured.get("warnings").is_none(), "{mode}: answer {n} warns of nothing: {structured}");
        }
        let (_, _, nudged, _) = answered(&steps[3]);
        assert_eq!(
            nudged["warnings"],
            json!([{"tool": "list_articles", "same_answers": 4, "no_progress": 5}]),
            "{mode}: the nudge, as data: {nudged}"
        );
        let (_, _, stopped, _) = answered(&steps[4]);
        assert_eq!(
            stopped["warnings"],
            json!([{"tool": "list_articles", "same_answers": 5, "no_progress": 5, "refused_for_ms": 60_000}]),
            "{mode}: the stop, as data: {stopped}"
        );
    }
    // rmcp's client (2025-11-25) reads the same.
    let client = server.client(Some("rmcp-key")).await;
    let answers = [0, 1, 2, 3].map(paraphrase);
    let mut last = None;
    for query in answers {
        last = Some(call(&client, "list_articles", json!({"query": query})).await);
    }
    let nudged = last.expect("four calls");
    assert_eq!(structured(&nudged)["warnings"][0]["same_answers"], 4, "{}", text(&nudged));
}

#[tokio::test]
async fn a_poll_whose_answer_changes_is_never_stopped_but_the_same_answer_to_the_same_call_still_is() {
    for store in Store::both() {
        let server = TestServer::start(&store.config()).await;
        let where_ = store.name();
        // In both eras, an agent polls a search (one Python client run a poll) while another
        // saves what it looks for: six identical calls in a row, each answered anew, none a loop.
        let saver = server.client(Some("saver-key")).await;
        for (mode, key) in [("auto", "auto-key"), ("legacy", "legacy-key")] {
            let auth = format!("Authorization: Bearer {key}");
            for n in 0..6 {
                let title = format!("Kingfisher {mode} {n}");
                let saved = call(&saver, "save_article", json!({"title": title, "body": "A kingfisher."})).await;
                assert!(!is_error(&saved), "{where_}: {}", text(&saved));
                let poll = calls("list_articles", 1, |_| json!({"query": format!("kingfisher {mode}"), "limit": 50}));
                let walked = python::walk(&server.url, mode, poll, &["-H", &auth]).await;
                let (is_error, text, structured, _) = answered(&walked["steps"][0]);
                assert!(!is_error, "{where_} {mode}: poll {n} of a moving answer: {text}");
                assert_eq!(structured["articles"].as_array().map(Vec::len), Some(n + 1), "{where_} {mode}");
            }
        }
        // One caller polls a search while another saves what it looks for: the same call, a new
        // answer each time, never stopped.
        let poller = server.client(Some("rmcp-key")).await;
        for n in 0..12 {
            let title = format!("Heron sighting {n}");
            let saved = call(&saver, "save_article", json!({"title": title, "body": "A heron."})).await;
            assert!(!is_error(&saved), "{where_}: {}", text(&saved));
            let polled = call(&poller, "list_articles", json!({"query": "heron sighting", "limit": 50})).await;
            assert!(!is_error(&polled), "{where_}: poll {n} of a moving answer: {}", text(&polled));
            assert_eq!(structured(&polled)["articles"].as_array().map(Vec::len), Some(n + 1), "{where_}");
        }
        // Once nothing moves, the same call with the same answer is the old loop: the fifth
        // identical call in a row, counting the last one whose answer changed (here, the fourth
        // poll after it), refused before anything is charged.
        let mut refused_at = None;
        for n in 0..6 {
            let polled = call(&poller, "list_articles", json!({"query": "heron sighting", "limit": 50})).await;
            if is_error(&polled) {
                assert_eq!(error_code(&polled), Some("loop_detected"), "{where_}: {}", text(&polled));
                refused_at = Some(n);
                break;
            }
        }
        assert_eq!(refused_at, Some(3), "{where_}: the fifth identical call since the last change");
    }
}

#[tokio::test]
async fn with_redis_killed_this_instances_detector_still_stops_the_paraphraser() {
    let mut redis = TestRedis::private();
    let config = format!("{KEYS}[store]\nbackend = \"redis\"\nredis_url = \"{}\"\ntimeout_ms = 200\n", redis.url);
    let server = TestServer::start(&config).await;
    let client = server.client(Some("rmcp-key")).await;
    // Two answers heard in Redis, then Redis gone: list_articles fails open (config.toml), and
    // the answers are heard here from then on.
    for n in 0..2 {
        assert!(!is_error(&call(&client, "list_articles", json!({"query": paraphrase(n)})).await));
    }
    redis.kill();
    let mut refused_at = None;
    for n in 2..12 {
        let r = call(&client, "list_articles", json!({"query": paraphrase(n)})).await;
        if is_error(&r) {
            assert_eq!(error_code(&r), Some("loop_detected"), "{}", text(&r));
            refused_at = Some(n);
            break;
        }
    }
    // Five identical answers heard here after the two Redis heard: the sixth call after the kill.
    assert_eq!(refused_at, Some(7));
}

/// A tool's own `no_progress` lowered live (as SIGHUP would) applies at its next answer: three
/// identical answers heard under the default 5, then the tool's own 2 put in force, and the fourth
/// answer stops it (said in that answer), the fifth call refused naming the new threshold.
#[tokio::test]
async fn a_tools_no_progress_lowered_live_applies_at_its_next_answer() {
    use mcp_ratelimit::state::Reloaded;
    let server = TestServer::start(KEYS).await;
    let client = server.client(Some("rmcp-key")).await;
    for n in 0..3 {
        let r = call(&client, "list_articles", json!({"query": paraphrase(n)})).await;
        assert!(!is_error(&r) && !text(&r).contains("same answer"), "search {n}: {}", text(&r));
    }
    let lowered = format!("{KEYS}[tools.list_articles]\nno_progress = 2\n");
    let config = mcp_ratelimit::Config::from_toml(&lowered, &mcp_ratelimit::mcp::tools::catalogue()).expect("valid");
    assert!(matches!(server.app.state().reload(&config), Reloaded::Applied { .. }));
    let r = call(&client, "list_articles", json!({"query": paraphrase(3)})).await;
    assert!(!is_error(&r), "{}", text(&r));
    assert!(text(&r).contains("same answer 4 times in a row") && text(&r).contains("now refused"), "{}", text(&r));
    let r = call(&client, "list_articles", json!({"query": paraphrase(4)})).await;
    assert_eq!(error_code(&r), Some("loop_detected"), "{}", text(&r));
    assert_eq!(structured(&r)["error"]["limit"], 2, "the threshold in force");
}
