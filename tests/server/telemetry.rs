//! OpenTelemetry traces (`[telemetry]`) sent to a real OTLP/HTTP receiver (`common/otlp.rs`),
//! through MCP clients of both protocol eras: one tool call is one trace, continuing the caller's
//! `traceparent` (from its request's `_meta`, or its HTTP header), the guard's decision on the
//! request's own span, through the upstream queue to the paid API, which hears the trace too; and
//! no span carries a caller's key.
//!
//! The exporter is the server's own ([`Telemetry`]), under a subscriber this test's thread sets:
//! each test runs on a current-thread runtime, so the server's tasks run on that thread and see
//! it. The receiver is asked after a flush, never after a fixed sleep; the server's clock is
//! manual, and the upstream queue's wait is a step of it.

use mcp_ratelimit::telemetry::Telemetry;
use opentelemetry_proto::tonic::trace::v1::Span;
use rmcp::model::{CallToolRequestParams, RequestMetaObject};
use serde_json::{Value, json};

use crate::common::*;
use crate::otlp::{Receiver, Subscribed, attribute, hex, names, one, subscribe};
use crate::python;

/// A caller's key: configured, in tenant acme. It must never reach an exported byte.
const KEY: &str = "sk-live-7f3c9a1e5b2d4f60-never-in-a-span";

/// The trace the caller is in, and its span the call continues.
const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT: &str = "00f067aa0ba902b7";

/// [`KEY`], of tenant acme and tier `tier`.
fn keys(tier: &str) -> String {
    format!("[[auth.keys]]\nkey = \"{KEY}\"\ntenant = \"acme\"\ntier = \"{tier}\"\n")
}

fn traceparent() -> String {
    format!("00-{TRACE}-{PARENT}-01")
}

fn video(prompt: &str) -> Value {
    json!({"image_url": "https://example.com/a.png", "prompt": prompt})
}

/// A server on a manual clock exporting to `receiver` ([`KEY`] of tier `tier`, `extra` added to
/// its config), its exporter,
/// and the subscriber that feeds it, set for this thread while the guard lives.
async fn traced(receiver: &Receiver, tier: &str, extra: &str) -> (TestServer, Telemetry, Subscribed) {
    exporting(receiver, tier, extra, "").await
}

/// [`traced`], with `more` keys of `[telemetry]`; the server's `/metrics` shows its exporter's
/// queue, as `main` has it do.
async fn exporting(receiver: &Receiver, tier: &str, extra: &str, more: &str) -> (TestServer, Telemetry, Subscribed) {
    let toml = format!(
        "{}{extra}\n[telemetry]\notlp_endpoint = \"{}\"\nexport_interval_ms = 50\n{more}",
        keys(tier),
        receiver.url
    );
    let server = TestServer::start(&toml).await;
    let config = server.app.state().config.telemetry.clone().expect("[telemetry] is on");
    assert_eq!(config.traces_url.as_str(), format!("{}/v1/traces", receiver.url));
    let telemetry = Telemetry::start(&config).expect("the exporter starts");
    server.app.state().watch_traces(telemetry.queue());
    let subscribed = subscribe(&telemetry);
    (server, telemetry, subscribed)
}

/// The spans of trace [`TRACE`] among `spans`.
fn of_trace(spans: &[Span]) -> Vec<&Span> {
    spans.iter().filter(|s| hex(&s.trace_id) == TRACE).collect()
}

/// The mock upstream's submissions, as it logged them (with each one's `traceparent`).
async fn submissions(server: &TestServer) -> Vec<Value> {
    let url = format!("{}/v1/submissions", server.app.upstream_url());
    let log: Value = reqwest::get(url).await.expect("submissions").json().await.expect("json");
    log["submissions"].as_array().cloned().unwrap_or_default()
}

#[tokio::test(flavor = "current_thread")]
async fn a_queued_call_is_one_trace_from_the_callers_traceparent_through_the_decision_to_the_paid_api() {
    let receiver = Receiver::start();
    let (server, telemetry, _traced) = traced(&receiver, "admin", "[upstream]\nvideo_min_gap_ms = 10000\n").await;
    // The 2025-11-25 handshake (rmcp's client), the trace context in the request's `_meta`.
    let client = server.client(Some(KEY)).await;
    assert!(!is_error(&call(&client, "generate_image_to_video", video("first")).await));
    let mut request = CallToolRequestParams::new("generate_image_to_video")
        .with_arguments(video("second").as_object().cloned().expect("object"));
    let mut meta = RequestMetaObject::default();
    meta.0.insert("traceparent".to_owned(), traceparent().into());
    request.meta = Some(meta);
    let queued = client.call_tool(request).await.expect("tools/call answered");
    assert_eq!(structured(&queued)["queue_position"], 1, "{}", text(&queued));

    // Its turn comes when the videos' gap has passed on the server's clock.
    server.advance_secs(10.0);
    eventually("the queued video is submitted", || async { submissions(&server).await.len() == 2 }).await;
    let spans = receiver
        .wait_for(&telemetry, "queued submission of the trace", |spans| {
            of_trace(spans).iter().any(|s| s.name == "upstream.queue")
        })
        .await;
    let trace = of_trace(&spans);

    // One span for the request and the guard's decision on it.
    let decided = one(&trace, "tools/call");
    assert_eq!(hex(&decided.parent_span_id), PARENT, "the caller's span is the request's parent");
    assert_eq!(attribute(decided, "mcp.tool.name").as_deref(), Some("generate_image_to_video"));
    assert_eq!(attribute(decided, "ratelimit.caller.tenant").as_deref(), Some("acme"));
    assert_eq!(attribute(decided, "ratelimit.caller.tier").as_deref(), Some("admin"));
    assert!(attribute(decided, "ratelimit.caller.id").is_some_and(|id| id.starts_with("tok:")), "{:#?}", names(&spans));
    assert_eq!(attribute(decided, "ratelimit.outcome").as_deref(), Some("answered"));
    assert_eq!(attribute(decided, "ratelimit.reserved").as_deref(), Some("20"), "a video's price before it runs");
    let waited = one(&trace, "upstream.queue");
    assert_eq!(waited.parent_span_id, decided.span_id);
    assert_eq!(attribute(waited, "upstream.queue.waited_ms").as_deref(), Some("10000"));
    // The submission is the queue's child (the polls that watch the job are another span's).
    let sent: Vec<&Span> =
        trace.iter().copied().filter(|s| s.name == "upstream.request" && s.parent_span_id == waited.span_id).collect();
    assert_eq!(sent.len(), 1, "{:#?}", names(&spans));
    let sent = sent[0];
    assert_eq!(attribute(sent, "http.request.method").as_deref(), Some("POST"));
    assert_eq!(attribute(sent, "url.path").as_deref(), Some("/v1/predictions"));
    assert_eq!(attribute(sent, "upstream.outcome").as_deref(), Some("ok"));
    // The first video, sent without a trace context, is a trace of its own.
    assert!(
        spans.iter().any(|s| s.name == "tools/call" && hex(&s.trace_id) != TRACE && s.parent_span_id.is_empty()),
        "{:#?}",
        names(&spans)
    );

    // The paid API heard the trace, from the very span that sent the request.
    let heard = submissions(&server).await;
    assert_eq!(heard[1]["traceparent"], format!("00-{TRACE}-{}-01", hex(&sent.span_id)), "{heard:?}");
    assert_ne!(heard[0]["traceparent"].as_str().unwrap_or_default().get(3..35), Some(TRACE));
}

#[tokio::test(flavor = "current_thread")]
async fn a_2026_client_sending_traceparent_as_a_header_is_continued_and_a_refusal_names_its_budget() {
    let receiver = Receiver::start();
    let (server, telemetry, _traced) = traced(&receiver, "default", "[tiers]\nguest = 1.0\n[tools.list_articles]\ncost = 30\n[limits.caller]\nalgorithm = \"fixed_window\"\nlimit = 30\nwindow_ms = 3600000\n").await;
    // The Python SDK's default: the stateless 2026-07-28 protocol, the trace context as W3C headers.
    let headers = [format!("Authorization: Bearer {KEY}"), format!("traceparent: {}", traceparent())];
    let steps = json!([
        {"op": "call", "tool": "list_articles", "args": {}},
        {"op": "call", "tool": "list_articles", "args": {"query": "more"}},
        {"op": "list_tools"},
    ]);
    let walked = python::walk(&server.url, "auto", steps, &["-H", &headers[0], "-H", &headers[1]]).await;
    assert_eq!(walked["protocol_version"], python::era_of("auto"), "{walked}");
    assert!(python::all_ok(&walked), "{walked}");
    assert_eq!(walked["steps"][1]["ok"]["is_error"], true, "the caller's budget of one call is spent: {walked}");

    let spans = receiver
        .wait_for(&telemetry, "two decisions of the trace", |spans| {
            let trace = of_trace(spans);
            trace.iter().filter(|s| s.name == "tools/call").count() == 2 && trace.iter().any(|s| s.name == "tools/list")
        })
        .await;
    let trace = of_trace(&spans);
    let requests: Vec<_> = trace.iter().filter(|s| s.name == "tools/call").collect();
    assert_eq!(requests.len(), 2, "{:#?}", names(&spans));
    assert!(requests.iter().all(|s| hex(&s.parent_span_id) == PARENT), "both continue the header's span");
    // Every other request is a span of its own too, in the same trace (the SDK lists the tools
    // itself too, to check answers against their output schemas).
    let listed: Vec<_> = trace.iter().filter(|s| s.name == "tools/list").collect();
    assert!(!listed.is_empty(), "{:#?}", names(&spans));
    for listed in listed {
        assert_eq!(hex(&listed.parent_span_id), PARENT);
        assert_eq!(attribute(listed, "mcp.method.name").as_deref(), Some("tools/list"));
    }
    let refused = trace
        .iter()
        .find(|s| s.name == "tools/call" && attribute(s, "ratelimit.outcome").as_deref() == Some("refused"))
        .unwrap_or_else(|| panic!("a refused decision: {:#?}", names(&spans)));
    assert_eq!(attribute(refused, "ratelimit.code").as_deref(), Some("rate_limited"));
    assert_eq!(attribute(refused, "ratelimit.layer").as_deref(), Some("tool"));
    assert!(
        attribute(refused, "ratelimit.scope").is_some_and(|scope| scope.starts_with("caller:tok:")),
        "{:#?}",
        names(&spans)
    );
    assert_eq!(attribute(refused, "ratelimit.limit").as_deref(), Some("30"));
    // The first call reserved 30 and was settled to the 1 unit the paid API billed: 29 are left.
    assert_eq!(attribute(refused, "ratelimit.remaining").as_deref(), Some("29"));
    let answered = trace
        .iter()
        .find(|s| s.name == "tools/call" && attribute(s, "ratelimit.outcome").as_deref() == Some("answered"))
        .unwrap_or_else(|| panic!("an answered decision: {:#?}", names(&spans)));
    assert_eq!(attribute(answered, "ratelimit.reserved").as_deref(), Some("30"));
    assert_eq!(attribute(answered, "ratelimit.charged").as_deref(), Some("1"));
    assert!(attribute(refused, "ratelimit.retry_after_ms").is_some_and(|ms| ms.parse::<u64>().is_ok_and(|ms| ms > 0)));
    assert_eq!(attribute(refused, "ratelimit.caller.tenant").as_deref(), Some("acme"));
    // The answered one reached the paid API in the same trace.
    assert!(trace.iter().any(|s| s.name == "upstream.request"), "{:#?}", names(&spans));
    // Each field once: a span keeps every value recorded, so one recorded twice (the units
    // reserved at admission and again when settled) would be exported twice.
    for span in &trace {
        let mut keys: Vec<&str> = span.attributes.iter().map(|a| a.key.as_str()).collect();
        let all = keys.len();
        keys.sort_unstable();
        keys.dedup();
        assert_eq!(keys.len(), all, "a field exported twice on {}: {:?}", span.name, span.attributes);
    }
}

#[tokio::test(flavor = "current_thread")]
async fn no_exported_span_byte_holds_a_callers_key() {
    let receiver = Receiver::start();
    let (server, telemetry, _traced) = traced(&receiver, "guest", "").await;
    let client = server.client(Some(KEY)).await;
    assert!(!is_error(&call(&client, "list_articles", json!({"query": KEY})).await));
    // An unknown key is a caller too (unverified, by its address): its key is not in a span either.
    let stranger = "sk-live-0000-unknown-key-never-in-a-span";
    let other = server.client(Some(stranger)).await;
    call(&other, "list_articles", json!({})).await;
    receiver
        .wait_for(&telemetry, "both calls' decisions", |spans| {
            spans.iter().filter(|s| s.name == "tools/call").count() >= 2
        })
        .await;
    let bytes = receiver.bytes();
    let holds = |needle: &str| bytes.windows(needle.len()).any(|w| w == needle.as_bytes());
    assert!(holds("acme"), "the spans were exported, naming the tenant");
    assert!(!holds(KEY), "a configured key in an exported span");
    assert!(!holds(stranger), "an unknown caller's key in an exported span");
    // Not even a piece of one: the shortest part that would still say something.
    assert!(!holds(&KEY[..16]) && !holds(&stranger[..16]), "part of a key in an exported span");
}

/// Loops by their answers in the trace: the answer one short of the stop and the one that makes it
/// name the streak (and the stop's length), and the call refused after them names the loop's
/// scope and threshold, as any refusal names its budget.
#[tokio::test(flavor = "current_thread")]
async fn a_search_answering_nothing_again_and_again_shows_its_streak_and_its_stop_in_the_trace() {
    let receiver = Receiver::start();
    let (server, telemetry, _traced) = traced(&receiver, "default", "").await;
    let client = server.client(Some(KEY)).await;
    for n in 0..6 {
        let r = call(&client, "list_articles", json!({"query": format!("nothing like it, take {n}")})).await;
        assert_eq!(is_error(&r), n == 5, "search {n}: {}", text(&r));
    }
    let spans = receiver
        .wait_for(&telemetry, "six decisions", |spans| spans.iter().filter(|s| s.name == "tools/call").count() == 6)
        .await;
    let guard: Vec<&Span> = spans.iter().filter(|s| s.name == "tools/call").collect();
    let streak = |n: &str| guard.iter().find(|s| attribute(s, "ratelimit.loop.same_answers").as_deref() == Some(n));
    let warned = streak("4").unwrap_or_else(|| panic!("the warning: {:#?}", names(&spans)));
    assert_eq!(attribute(warned, "ratelimit.loop.refused_for_ms"), None, "warned, not yet stopped");
    let stopped = streak("5").unwrap_or_else(|| panic!("the stop: {:#?}", names(&spans)));
    assert_eq!(attribute(stopped, "ratelimit.outcome").as_deref(), Some("answered"));
    assert_eq!(attribute(stopped, "ratelimit.loop.refused_for_ms").as_deref(), Some("60000"));
    let refused = guard
        .iter()
        .find(|s| attribute(s, "ratelimit.code").as_deref() == Some("loop_detected"))
        .unwrap_or_else(|| panic!("the refusal: {:#?}", names(&spans)));
    assert_eq!(attribute(refused, "ratelimit.scope").as_deref(), Some("loop:list_articles"));
    assert_eq!(attribute(refused, "ratelimit.limit").as_deref(), Some("5"));
    assert_eq!(attribute(refused, "ratelimit.retry_after_ms").as_deref(), Some("60000"));
}

/// Redis killed mid-run: the call the insurance limiter admits says so on its span
/// (`ratelimit.fail_open`), and the paid call refused because the shared store cannot decide names
/// its code, each once, on the request's own span.
#[tokio::test(flavor = "current_thread")]
async fn with_redis_killed_the_span_says_the_call_failed_open_or_was_refused_closed() {
    let mut redis = crate::test_redis::TestRedis::private();
    let receiver = Receiver::start();
    let store = format!("[store]\nbackend = \"redis\"\nredis_url = \"{}\"\ntimeout_ms = 200\n", redis.url);
    let (server, telemetry, _traced) = traced(&receiver, "default", &store).await;
    let client = server.client(Some(KEY)).await;
    assert!(!is_error(&call(&client, "list_articles", json!({"query": "before"})).await));
    redis.kill();
    let open = call(&client, "list_articles", json!({"query": "after the crash"})).await;
    assert!(!is_error(&open), "{}", text(&open));
    let closed = call(&client, "generate_image", json!({"prompt": "costs money"})).await;
    assert_eq!(error_code(&closed), Some("limiter_unavailable"), "{}", text(&closed));
    let spans = receiver
        .wait_for(&telemetry, "the three calls", |spans| spans.iter().filter(|s| s.name == "tools/call").count() == 3)
        .await;
    let calls: Vec<&Span> = spans.iter().filter(|s| s.name == "tools/call").collect();
    let failed_open: Vec<&&Span> =
        calls.iter().filter(|s| attribute(s, "ratelimit.fail_open").as_deref() == Some("true")).collect();
    assert_eq!(failed_open.len(), 1, "only the call after the crash: {:#?}", names(&spans));
    assert_eq!(attribute(failed_open[0], "ratelimit.outcome").as_deref(), Some("answered"));
    let refused = calls
        .iter()
        .find(|s| attribute(s, "mcp.tool.name").as_deref() == Some("generate_image"))
        .unwrap_or_else(|| panic!("the paid call: {:#?}", names(&spans)));
    assert_eq!(attribute(refused, "ratelimit.outcome").as_deref(), Some("refused"));
    assert_eq!(attribute(refused, "ratelimit.code").as_deref(), Some("limiter_unavailable"));
}

/// `value` cut as a span holds what a caller chose: at most 128 bytes, at a character boundary.
fn cut(value: &str) -> &str {
    let mut end = value.len().min(128);
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    &value[..end]
}

/// A collector that is away, and a caller sending huge JSON-RPC ids: the
/// exporter's queue holds at most 2,048 spans (the rest dropped and counted) and the bytes of
/// values cut to 128 bytes, as `/metrics` shows while nothing is answered; once the collector
/// answers, the spans it gets hold every caller-chosen value cut, at a character boundary, and the
/// queue is empty again. (Before: 100 pings with 4 MB ids took the server from 40 MB to 926 MB.)
#[tokio::test(flavor = "current_thread")]
async fn a_collector_that_never_answers_holds_the_trace_queue_to_its_bounds_and_huge_ids_are_cut() {
    const PINGS: usize = 2100;
    let receiver = Receiver::never_answering();
    let roomy = "[limits.http]\nburst = 100000\nrefill_per_sec = 1000.0\n\
                 [limits.method.other]\nburst = 100000\nrefill_per_sec = 1000.0\n";
    let (server, telemetry, _traced) = exporting(&receiver, "default", roomy, "export_timeout_ms = 600000\n").await;
    let auth = format!("Bearer {KEY}");
    let mut session = RawSession::new(&server.url, &[("authorization", auth.as_str())]);
    assert_eq!(session.open().await, (200, 202));
    // Four pings whose ids are 4 MiB of three-byte characters: a span each.
    let huge = |n: usize| format!("huge-{n}-{}", "€".repeat((4 << 20) / 3));
    for n in 0..4 {
        let (status, _, body) = session.post(json!({"jsonrpc": "2.0", "id": huge(n), "method": "ping"})).await;
        assert_eq!(status, 200, "{}", cut(&body));
    }
    // More spans than the queue holds, while the collector answers nothing.
    for n in 0..PINGS {
        let id = format!("{n}-{}", "x".repeat(1000));
        assert_eq!(session.post(json!({"jsonrpc": "2.0", "id": id, "method": "ping"})).await.0, 200);
    }
    let metrics = server.metrics().await;
    let queued = metric_sum(&metrics, "mcp_ratelimit_trace_queue_bytes");
    let dropped = metric_sum(&metrics, "mcp_ratelimit_trace_spans_dropped_total");
    // A span per ping, 2,048 held: each a few hundred bytes, as its values are cut.
    assert_eq!(dropped, (PINGS + 4 - 2048) as f64, "{metrics}");
    assert!(queued > 0.0 && queued <= 2048.0 * 512.0, "{queued} bytes queued:\n{metrics}");
    assert!(metrics.contains("# HELP mcp_ratelimit_trace_queue_bytes "), "{metrics}");
    assert!(metrics.contains("# HELP mcp_ratelimit_trace_spans_dropped_total "), "{metrics}");

    // The collector is back: what it gets holds every value a caller chose cut.
    receiver.release();
    let spans = receiver.wait_for(&telemetry, "the spans held", |spans| spans.len() >= 2048).await;
    assert_eq!(spans.len(), 2048, "the queue's bound went through, the rest was dropped");
    for n in 0..4 {
        let id = huge(n);
        let span = spans
            .iter()
            .find(|s| attribute(s, "mcp.request.id").is_some_and(|v| v.starts_with(&format!("huge-{n}-"))))
            .unwrap_or_else(|| panic!("huge ping {n}"));
        assert_eq!(attribute(span, "mcp.request.id").as_deref(), Some(cut(&id)), "cut at a character boundary");
        assert_eq!(cut(&id).len(), 127, "`huge-N-` and 40 euros: the 41st would need byte 130");
    }
    for span in &spans {
        for (key, value) in span.attributes.iter().map(|a| (&a.key, attribute(span, &a.key).unwrap_or_default())) {
            assert!(value.len() <= 128, "{key} of {} holds {} bytes", span.name, value.len());
        }
    }
    eventually("the queue is empty again", || async {
        metric_sum(&server.metrics().await, "mcp_ratelimit_trace_queue_bytes") == 0.0
    })
    .await;
}

/// A caller's `tracestate` rides on its trace only when it is 1 to 512 bytes of printable ASCII
/// (from `_meta` or from the header), and the paid API never hears it: only the `traceparent` of
/// the server's own span of the request.
#[tokio::test(flavor = "current_thread")]
async fn a_callers_tracestate_is_kept_only_up_to_512_printable_bytes_and_never_reaches_the_paid_api() {
    let receiver = Receiver::start();
    let (server, telemetry, _traced) = traced(&receiver, "admin", "").await;
    // Two members a vendor may send, 512 bytes together; one more byte is too many.
    let most = format!("a={},b={}", "v".repeat(254), "w".repeat(253));
    let over = format!("{most}w");
    assert_eq!((most.len(), over.len()), (512, 513));
    let client = server.client(Some(KEY)).await;
    let traces = ["5bf92f3577b34da6a3ce929d0e0e4736", "6bf92f3577b34da6a3ce929d0e0e4736"];
    for (trace, state) in traces.iter().zip([&most, &over]) {
        let mut request = CallToolRequestParams::new("generate_image")
            .with_arguments(json!({"prompt": "a lighthouse"}).as_object().cloned().expect("object"));
        let mut meta = RequestMetaObject::default();
        meta.0.insert("traceparent".to_owned(), format!("00-{trace}-{PARENT}-01").into());
        meta.0.insert("tracestate".to_owned(), state.as_str().into());
        request.meta = Some(meta);
        let submitted = client.call_tool(request).await.expect("tools/call answered");
        assert!(!is_error(&submitted), "{}", text(&submitted));
    }
    // The 2026-07-28 era, the context as W3C headers: one byte too many is dropped there too.
    let third = "7bf92f3577b34da6a3ce929d0e0e4736";
    let headers = [
        format!("Authorization: Bearer {KEY}"),
        format!("traceparent: 00-{third}-{PARENT}-01"),
        format!("tracestate: {over}"),
    ];
    let steps = json!([{"op": "call", "tool": "list_articles", "args": {}}]);
    let args = ["-H", headers[0].as_str(), "-H", headers[1].as_str(), "-H", headers[2].as_str()];
    let walked = python::walk(&server.url, "auto", steps, &args).await;
    assert!(python::all_ok(&walked), "{walked}");
    let spans = receiver
        .wait_for(&telemetry, "three calls and two submissions", |spans| {
            let of = |trace: &str| spans.iter().filter(|s| hex(&s.trace_id) == trace).count();
            of(traces[0]) >= 2 && of(traces[1]) >= 2 && of(third) >= 1
        })
        .await;
    let called = |trace: &str| {
        spans
            .iter()
            .find(|s| s.name == "tools/call" && hex(&s.trace_id) == trace)
            .unwrap_or_else(|| panic!("the call of {trace}: {:#?}", names(&spans)))
    };
    let kept = called(traces[0]);
    assert_eq!(hex(&kept.parent_span_id), PARENT);
    assert_eq!(kept.trace_state, most, "512 bytes are continued");
    for trace in [traces[1], third] {
        let dropped = called(trace);
        assert_eq!(hex(&dropped.parent_span_id), PARENT, "its traceparent is still continued");
        assert_eq!(dropped.trace_state, "", "513 bytes are not");
    }
    // The paid API heard each submission's own span, and no tracestate at all.
    let heard = submissions(&server).await;
    assert_eq!(heard.len(), 2, "{heard:?}");
    for (submission, trace) in heard.iter().zip(traces) {
        let sent = spans
            .iter()
            .find(|s| s.name == "upstream.request" && hex(&s.trace_id) == trace)
            .unwrap_or_else(|| panic!("the submission of {trace}: {:#?}", names(&spans)));
        assert_eq!(submission["traceparent"], format!("00-{trace}-{}-01", hex(&sent.span_id)), "{heard:?}");
        assert!(submission.get("tracestate").is_none(), "the caller's tracestate reached the paid API: {heard:?}");
    }
}
