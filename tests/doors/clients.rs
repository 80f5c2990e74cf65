//! `serve`, and a library user's tools through `LimitedRouter`, as clients of both protocol eras
//! meet them: rmcp's own client speaking 2026-07-28 (`ClientLifecycleMode::Discover`), and the
//! official Python SDK in its default `auto` mode (2026-07-28) and in `legacy` (2025-11-25), which
//! checks every answer as its era requires — `resultType`, and structured content against the
//! tool's `outputSchema`. What we add to an answer of ours (`reserved`, `charged`, `cached`,
//! `warnings`) is in its `outputSchema`; what we add to an answer we did not write is in `_meta`.

use std::sync::Arc;

use crate::common::*;
use crate::{common, python};
use mcp_ratelimit::guard::Refusal;
use mcp_ratelimit::{Catalogue, LimitedRouter, RateLimits};
use rmcp::handler::server::tool::{InputResponses, RequestState};
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, InputRequiredResult, JsonObject, MetaObject,
    ProtocolVersion, ResultType,
};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::{ServerHandler, tool, tool_handler, tool_router};
use serde_json::{Value, json};

/// Every answer warns (a spend cap warned of at 1 %), list_articles answers are kept, and the
/// mock and the caps leave room for every job the walk starts.
const EVERY_FIELD: &str = "[spend_caps]\ndaily_units = 100\nwarn_at_percent = 1\n\
                           [tools.list_articles]\ncache_ttl_ms = 60000\n\
                           [mock_upstream]\nmax_concurrent_predictions = 1000\n";

#[tokio::test]
async fn every_answer_of_our_tools_is_valid_for_clients_of_both_eras_and_admitted_by_its_output_schema() {
    let server = TestServer::start(&format!("{EVERY_FIELD}{ROOMY_IN_FLIGHT}{NO_LOOP_DETECTION}")).await;
    for mode in ["legacy", "auto"] {
        let key = format!("Authorization: Bearer walker-{mode}");
        let steps = json!([
            {"op": "list_tools"},
            {"op": "call", "tool": "list_articles", "args": {"query": "agents"}},
            {"op": "call", "tool": "list_articles", "args": {"query": "agents"}},
            {"op": "call", "tool": "save_article", "args": {"title": "On limits", "body": "Budgets."}},
            {"op": "call", "tool": "generate_image", "args": {"prompt": "a lighthouse"}},
            {"op": "call", "tool": "generate_image", "args": {"prompt": "draw [fail] please"}},
            {"op": "call", "tool": "generate_image_to_video",
             "args": {"image_url": "https://example.com/a.png", "prompt": "pan left", "seconds": 8}},
            {"op": "call", "tool": "rate_limit_status", "args": {}},
            {"op": "call", "tool": "save_article", "args": {"title": "  ", "body": "no title"}, "check_schema": true},
            {"op": "call", "tool": "list_articles", "args": {"query": "agents", "limit": 0}, "check_schema": true},
        ]);
        let walked = python::walk(&server.url, mode, steps, &["-H", &key]).await;
        assert_eq!(walked["protocol_version"], python::era_of(mode), "{walked}");
        assert!(python::all_ok(&walked), "{mode}: every answer valid for the SDK: {walked}");
        let steps = &walked["steps"];
        let tools = steps[0]["ok"].as_array().expect("tools");
        assert_eq!(tools.len(), 7, "{walked}");
        // The job tools may answer a task handle, which has no structured content: no schema.
        let jobs = ["generate_image", "generate_image_to_video"];
        for tool in tools {
            let declared = tool["outputSchema"]["type"] == "object";
            assert_eq!(declared, !jobs.contains(&tool["name"].as_str().unwrap_or_default()), "{tool}");
        }
        let answer = |i: usize| &steps[i]["ok"]["structured"];
        assert_eq!((answer(1).get("cached"), answer(2)["cached"].clone()), (None, json!(true)), "{walked}");
        assert!(answer(1)["articles"].is_array() && answer(1)["charged"] == 1, "{walked}");
        assert!(answer(3)["warnings"][0]["percent_used"].is_u64(), "warned: {walked}");
        assert_eq!(answer(6)["reserved"], 26, "20 + 2 × 3 seconds: {walked}");
        // Refusals too are what the outputSchema admits, for clients that check those as well.
        assert_eq!(answer(8)["error"]["code"], "invalid_arguments", "a refusal: {walked}");
        assert_eq!(answer(9)["error"]["code"], "invalid_arguments", "a refusal: {walked}");
        let id = |i: usize| answer(i)["predict_id"].as_str().expect("a job").to_owned();
        let (image, failing, video) = (id(4), id(5), id(6));
        server.advance_secs(10.0);
        let steps = json!([
            {"op": "call", "tool": "get_prediction", "args": {"predict_id": image}},
            {"op": "call", "tool": "get_prediction", "args": {"predict_id": failing}},
            {"op": "call", "tool": "cancel_prediction", "args": {"predict_id": video}},
            {"op": "call", "tool": "rate_limit_status", "args": {}},
        ]);
        let walked = python::walk(&server.url, mode, steps, &["-H", &key]).await;
        assert!(python::all_ok(&walked), "{mode}: {walked}");
        let answer = |i: usize| &walked["steps"][i]["ok"]["structured"];
        assert_eq!((answer(0)["status"].clone(), answer(0)["charged"].clone()), (json!("succeeded"), json!(5)));
        assert_eq!(answer(1)["status"], "failed", "{walked}");
        assert!(answer(2)["status"].is_string(), "{walked}");
    }
}

/// An rmcp client of `url` presenting `key`, speaking 2026-07-28: no handshake, no session.
pub(crate) async fn modern_client(url: &str, key: &str) -> Client {
    use rmcp::{ClientLifecycleMode, ClientServiceExt};
    let config = StreamableHttpClientTransportConfig::with_uri(url).auth_header(key);
    let preferred_versions = vec![ProtocolVersion::V_2026_07_28];
    ().serve_with_lifecycle(
        StreamableHttpClientTransport::from_config(config),
        ClientLifecycleMode::Discover { preferred_versions },
    )
    .await
    .expect("a 2026-07-28 client connects")
}

#[tokio::test]
async fn an_rmcp_client_speaking_2026_07_28_is_served_and_refused_with_the_exact_wait() {
    let server = TestServer::start(NO_LOOP_DETECTION).await;
    let client = modern_client(&server.url, "modern-agent").await;
    let version = client.peer_info().map(|info| info.protocol_version.clone());
    assert_eq!(version, Some(ProtocolVersion::V_2026_07_28));
    let status = call(&client, "rate_limit_status", json!({})).await;
    assert_eq!(status.result_type, Some(ResultType::COMPLETE));
    assert!(structured(&status)["caller"].as_str().is_some_and(|c| c.starts_with("tok:")));
    let (passed, refused) = spend_until_refused(&client, "list_articles", json!({}), 100).await;
    assert_eq!(passed, 60, "the caller's 60 tokens, as for a 2025-11-25 client");
    assert_eq!((error_code(&refused), refused.result_type.clone()), (Some("rate_limited"), Some(ResultType::COMPLETE)));
    assert_eq!(structured(&refused)["error"]["retry_after_ms"], 1000);
    assert_eq!(text(&refused), "Rate limit reached for list_articles. Wait 1 second before calling it again.");
}

/// A forker's weather server: one tool whose outputSchema forbids any property it does not list,
/// and which reports the units it used in `_meta`, behind our limits.
#[derive(Clone)]
struct Weather {
    tools: LimitedRouter<Self>,
}

#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
struct City {
    /// The city.
    city: String,
}

fn strict_forecast() -> Arc<JsonObject> {
    let schema = json!({
        "type": "object",
        "properties": {"city": {"type": "string"}, "celsius": {"type": "number"}},
        "required": ["city", "celsius"],
        "additionalProperties": false,
    });
    let Value::Object(schema) = schema else { unreachable!("an object") };
    Arc::new(schema)
}

#[tool_router]
impl Weather {
    #[tool(description = "Forecast for a city.", output_schema = strict_forecast())]
    async fn forecast(&self, Parameters(City { city }): Parameters<City>) -> CallToolResult {
        let mut done = CallToolResult::structured(json!({"city": city, "celsius": 21.5}));
        let mut meta = MetaObject::default();
        meta.0.insert("usage".into(), json!({"units": 2}));
        done.meta = Some(meta);
        done
    }
}

#[tool_handler(router = self.tools)]
impl ServerHandler for Weather {}

#[tokio::test]
async fn what_we_add_to_a_library_users_answer_goes_in_meta_and_its_structured_content_is_left_as_it_was() {
    let limits = "[tools.forecast]\ncost = 3\n[spend_caps]\ndaily_units = 100\nwarn_at_percent = 1\n";
    let limits = RateLimits::from_toml(limits, Catalogue::new().tool("forecast")).await.expect("limits");
    let server = Weather { tools: LimitedRouter::new(Weather::tool_router(), limits.clone()) };
    let url = common::serve_library(server, &limits).await;
    for mode in ["legacy", "auto"] {
        let steps = json!([{"op": "call", "tool": "forecast", "args": {"city": "Oslo"}}]);
        let walked = python::walk(&url, mode, steps, &[]).await;
        assert!(python::all_ok(&walked), "{mode}: the structured content validates: {walked}");
        let answer = &walked["steps"][0]["ok"];
        assert_eq!(answer["structured"], json!({"city": "Oslo", "celsius": 21.5}), "left as it was: {walked}");
        assert_eq!(answer["text"], json!({"city": "Oslo", "celsius": 21.5}).to_string(), "its text too: {walked}");
        let meta = &answer["meta"];
        assert_eq!(meta["usage"], json!({"units": 2}), "its own _meta kept: {walked}");
        let ours = |key: &str| meta[format!("io.github.mcp-ratelimit/{key}")].clone();
        assert_eq!((ours("reserved"), ours("charged")), (json!(3), json!(2)), "{walked}");
        assert!(ours("warnings")[0]["scope"].as_str().is_some_and(|s| s.starts_with("spend:")), "{walked}");
    }
}

/// A library user's index: a search that only reads (annotated so) and a note that writes, both
/// answering the same thing whatever they are asked.
#[derive(Clone)]
struct Index {
    tools: LimitedRouter<Self>,
}

#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
struct Term {
    /// What to look up, or to note (the tools answer alike whatever it is).
    #[allow(dead_code)]
    term: String,
}

#[tool_router]
impl Index {
    #[tool(description = "Searches the index.", annotations(read_only_hint = true))]
    async fn search(&self, Parameters(Term { term: _ }): Parameters<Term>) -> CallToolResult {
        CallToolResult::structured(json!({"hits": [], "took_ms": 3}))
    }

    #[tool(description = "Notes a term.")]
    async fn note(&self, Parameters(Term { term: _ }): Parameters<Term>) -> CallToolResult {
        CallToolResult::structured(json!({"noted": true}))
    }
}

#[tool_handler(router = self.tools)]
impl ServerHandler for Index {}

/// A library user's router reads its tools' annotations: a read (`readOnlyHint`) answering
/// nothing again and again stops its caller at the sixth call whatever the term, in both eras; a
/// write whose acknowledgements are all alike is never a loop by its answers.
#[tokio::test]
async fn a_library_users_read_that_keeps_answering_nothing_is_stopped_and_its_write_is_not() {
    // Configured keys: unverified callers of one address share one loop history.
    let toml = "[tools.search]\ncost = 1\n[tools.note]\ncost = 1\n[[auth.keys]]\nkey = \"index-key-legacy\"\n\
                [[auth.keys]]\nkey = \"index-key-auto\"\n";
    let limits = RateLimits::from_toml(toml, Catalogue::new().tool("search").tool("note")).await.expect("limits");
    let url =
        common::serve_library(Index { tools: LimitedRouter::new(Index::tool_router(), limits.clone()) }, &limits).await;
    for mode in ["legacy", "auto"] {
        let key = format!("Authorization: Bearer index-key-{mode}");
        let mut steps: Vec<Value> =
            (0..7).map(|n| json!({"op": "call", "tool": "note", "args": {"term": format!("note {n}")}})).collect();
        steps.extend((0..7).map(|n| json!({"op": "call", "tool": "search", "args": {"term": format!("term {n}")}})));
        let walked = python::walk(&url, mode, Value::Array(steps), &["-H", &key]).await;
        let steps = walked["steps"].as_array().expect("steps");
        let refused = |step: &Value| step["ok"]["is_error"] == json!(true);
        for (n, step) in steps.iter().enumerate().take(7) {
            assert!(!refused(step), "{mode}: note {n}, a write, is never stopped by its answers: {step}");
        }
        for (n, step) in steps.iter().enumerate().skip(7).take(5) {
            assert!(!refused(step), "{mode}: search {}: {step}", n - 7);
        }
        assert_eq!(steps[12]["ok"]["structured"]["error"]["code"], "loop_detected", "{mode}: {}", steps[12]);
        assert_eq!(steps[12]["ok"]["structured"]["error"]["scope"], "loop:search", "{mode}");
    }
}

/// A library user's slow tool, counting how often it really runs.
#[derive(Clone)]
struct Lookup {
    tools: LimitedRouter<Self, Gate>,
    runs: Arc<std::sync::atomic::AtomicU64>,
}

#[tool_router]
impl Lookup {
    #[tool(description = "Looks a city up (slowly).")]
    async fn lookup(&self, Parameters(City { city }): Parameters<City>) -> String {
        self.runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        format!("{city}: found")
    }
}

#[tool_handler(router = self.tools)]
impl ServerHandler for Lookup {}

/// A library user's one rule of its own: while the gate is shut, calls are refused before
/// anything is charged (as a breaker does).
#[derive(Clone, Default)]
struct Gate(Arc<std::sync::atomic::AtomicBool>);

impl mcp_ratelimit::guard::Door for Gate {
    type Place = ();

    fn before_charging(&self, tool: &str, _caller: &mcp_ratelimit::identity::Caller) -> Result<(), Refusal> {
        match self.0.load(std::sync::atomic::Ordering::SeqCst) {
            true => Err(Refusal::upstream_unavailable(tool, "the gate is shut", 7_000)),
            false => Ok(()),
        }
    }
}

/// A forker of the library gets what the reference server has, through the same guarded call:
/// identical calls sharing one run of the tool (each still charged), and a rule of its own run
/// before anything is charged.
#[tokio::test]
async fn a_library_users_router_coalesces_identical_calls_and_runs_its_own_rule_before_charging() {
    let toml = "[tools.lookup]\ncost = 1\ncoalesce = \"caller\"\n[limits.caller]\nalgorithm = \"token_bucket\"\n\
                burst = 12\nrefill_per_sec = 0.0001\n[limits.address]\nalgorithm = \"token_bucket\"\nburst = 1000\n\
                refill_per_sec = 1\n[loop_detection]\nenabled = false\n";
    let limits = RateLimits::from_toml(toml, Catalogue::new().tool("lookup")).await.expect("limits");
    let gate = Gate::default();
    let runs = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let tools = LimitedRouter::with_door(Lookup::tool_router(), limits.clone(), gate.clone());
    let url = common::serve_library(Lookup { tools, runs: runs.clone() }, &limits).await;
    let key = "lookup-key-0123456789";
    let legacy = || async {
        let config = StreamableHttpClientTransportConfig::with_uri(url.as_str()).auth_header(key);
        rmcp::ServiceExt::serve((), StreamableHttpClientTransport::from_config(config)).await.expect("connects")
    };
    for (era, client) in [("2025-11-25", legacy().await), ("2026-07-28", modern_client(&url, key).await)] {
        let before = runs.load(std::sync::atomic::Ordering::SeqCst);
        let answers = futures::future::join_all((0..5).map(|_| call(&client, "lookup", json!({"city": "Oslo"})))).await;
        assert!(answers.iter().all(|a| text(a) == "Oslo: found"), "{era}: {answers:?}");
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst) - before, 1, "{era}: five identical calls, one run");
        let coalesced =
            |a: &CallToolResult| a.meta.as_ref().and_then(|m| m.0.get("io.github.mcp-ratelimit/coalesced")).is_some();
        assert_eq!(answers.iter().filter(|a| coalesced(a)).count(), 4, "{era}: said in _meta: {answers:?}");
        gate.0.store(true, std::sync::atomic::Ordering::SeqCst);
        let refused = call(&client, "lookup", json!({"city": "Bergen"})).await;
        assert_eq!(error_code(&refused), Some("upstream_unavailable"), "{era}: {refused:?}");
        gate.0.store(false, std::sync::atomic::Ordering::SeqCst);
    }
    // 12 units: the ten calls answered were each charged; the gate's refusals were not.
    let client = legacy().await;
    for city in ["Tromsø", "Bodø"] {
        assert_eq!(text(&call(&client, "lookup", json!({"city": city})).await), format!("{city}: found"));
    }
    let refused = call(&client, "lookup", json!({"city": "Alta"})).await;
    assert_eq!(error_code(&refused), Some("rate_limited"), "12 spent: ten shared, two alone: {refused:?}");
}

/// A library user's tools that ask their caller for input (MCP 2026-07-28's multi-round-trip
/// requests, SEP-2322): a booking confirmed in a second round, and a quiz of seven rounds.
#[derive(Clone)]
pub(crate) struct Booking {
    tools: LimitedRouter<Self>,
    asked: Arc<std::sync::atomic::AtomicU64>,
}

impl Booking {
    /// The booking tools under no limits of their own: a 2026-07-28 server to proxy.
    pub(crate) async fn unlimited() -> Self {
        let tools = Catalogue::new().tool("book").tool("quiz");
        let toml = "[tools.book]\ncost = 1\n[tools.quiz]\ncost = 1\n[limits]\nenabled = false\n";
        let limits = RateLimits::from_toml(toml, tools).await.expect("limits");
        Self { tools: LimitedRouter::new(Self::tool_router(), limits), asked: Arc::default() }
    }
}

#[tool_router]
impl Booking {
    #[tool(description = "Books a night in a city, once the caller confirms.")]
    async fn book(
        &self,
        Parameters(City { city }): Parameters<City>,
        RequestState(state): RequestState,
        InputResponses(responses): InputResponses,
    ) -> CallToolResponse {
        match responses {
            None => {
                let n = self.asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                InputRequiredResult::from_request_state(format!("confirm-{n}")).into()
            }
            Some(_) => CallToolResult::success(vec![ContentBlock::text(format!(
                "{city}: booked ({})",
                state.unwrap_or_default()
            ))])
            .into(),
        }
    }

    #[tool(description = "Asks seven questions, one a round.")]
    async fn quiz(&self, RequestState(state): RequestState) -> CallToolResponse {
        let asked: u32 =
            state.as_deref().and_then(|s| s.strip_prefix("asked-")).and_then(|n| n.parse().ok()).unwrap_or(0);
        match asked {
            0..7 => InputRequiredResult::from_request_state(format!("asked-{}", asked + 1)).into(),
            _ => CallToolResult::success(vec![ContentBlock::text("seven answers")]).into(),
        }
    }
}

#[tool_handler(router = self.tools)]
impl ServerHandler for Booking {}

/// One round of `tool` with `args`: resuming `state` with an answer, or (`None`) a call of its own.
pub(crate) async fn round(
    client: &Client,
    tool: &str,
    args: Value,
    state: Option<&str>,
) -> Result<CallToolResponse, String> {
    let Value::Object(args) = args else { unreachable!("arguments are an object") };
    let mut params = CallToolRequestParams::new(tool.to_owned()).with_arguments(args);
    if let Some(state) = state {
        params.request_state = Some(state.to_owned());
        params.input_responses = Some([("confirm".to_owned(), json!({"action": "accept"}))].into());
    }
    client.peer().call_tool_once(params).await.map_err(|e| e.to_string())
}

pub(crate) fn asked_state(answer: &Result<CallToolResponse, String>) -> Option<String> {
    match answer {
        Ok(CallToolResponse::InputRequired(input)) => input.request_state.clone(),
        _ => None,
    }
}

pub(crate) fn completed(answer: &Result<CallToolResponse, String>) -> Option<&CallToolResult> {
    match answer {
        Ok(CallToolResponse::Complete(done)) => Some(done),
        _ => None,
    }
}

/// A call answered `input_required` and sent again with the input is one call: its price is
/// charged once, its rounds are never a loop (loop detection on, five in a row), and the state it
/// resumes with is believed only once, for that caller, that tool and those arguments — replayed
/// or invented, it is charged as a new call, by a client of either era.
#[tokio::test]
async fn a_call_that_asks_for_input_and_is_resumed_is_one_call_charged_once_and_never_a_loop() {
    let toml = "[tools.book]\ncost = 5\n[tools.quiz]\ncost = 0\n[limits.caller]\nalgorithm = \"token_bucket\"\n\
                burst = 5\nrefill_per_sec = 0.0001\n[limits.address]\nalgorithm = \"token_bucket\"\nburst = 1000\n\
                refill_per_sec = 1\n[loop_detection]\nenabled = true\nrepeats = 5\n[tiers]\nguest = 1.0\n";
    let limits = RateLimits::from_toml(toml, Catalogue::new().tool("book").tool("quiz")).await.expect("limits");
    let tools = LimitedRouter::new(Booking::tool_router(), limits.clone());
    let url = common::serve_library(Booking { tools, asked: Arc::default() }, &limits).await;
    let refused = |answer: &Result<CallToolResponse, String>| completed(answer).and_then(error_code).map(str::to_owned);

    let client = modern_client(&url, "traveller-0123456789").await;
    let config = StreamableHttpClientTransportConfig::with_uri(url.as_str()).auth_header("old-client-0123456789");
    let legacy: Client =
        rmcp::ServiceExt::serve((), StreamableHttpClientTransport::from_config(config)).await.expect("connects");
    let oslo = json!({"city": "Oslo"});
    let first = round(&client, "book", oslo.clone(), None).await;
    let state = asked_state(&first).expect("asked to confirm");
    // Another caller (a 2025-11-25 client) sending that state is a new call: charged its 5 tokens,
    // then refused for the next 5; the mark is not its to take.
    let theirs = round(&legacy, "book", oslo.clone(), Some(&state)).await;
    assert_eq!(completed(&theirs).map(text), Some(format!("Oslo: booked ({state})")), "{theirs:?}");
    let again = round(&legacy, "book", oslo.clone(), Some(&state)).await;
    assert_eq!(refused(&again).as_deref(), Some("rate_limited"), "its 5 tokens spent: {again:?}");
    let booked = round(&client, "book", oslo.clone(), Some(&state)).await;
    assert_eq!(completed(&booked).map(text), Some(format!("Oslo: booked ({state})")), "5 tokens paid once: {booked:?}");
    // Replayed, the state is a new call: 5 more tokens the caller has not got.
    let replayed = round(&client, "book", oslo.clone(), Some(&state)).await;
    assert_eq!(refused(&replayed).as_deref(), Some("rate_limited"), "{replayed:?}");
    for (args, state) in [(oslo.clone(), "confirm-99"), (json!({"city": "Bergen"}), state.as_str())] {
        let invented = round(&client, "book", args, Some(state)).await;
        assert_eq!(refused(&invented).as_deref(), Some("rate_limited"), "{state}: {invented:?}");
    }
    // Eight rounds of one quiz, five in a row being a loop: never a loop, and the answer at the end.
    let mut answer = round(&client, "quiz", json!({}), None).await;
    for _ in 0..7 {
        let state = asked_state(&answer).unwrap_or_else(|| panic!("another question: {answer:?}"));
        answer = round(&client, "quiz", json!({}), Some(&state)).await;
    }
    assert_eq!(completed(&answer).map(text).as_deref(), Some("seven answers"), "{answer:?}");
    // The detector is on, and the eight rounds were one call of the five a loop takes: the fourth
    // quiz started afresh is the fifth in a row.
    let mut fresh = Vec::new();
    for _ in 0..5 {
        fresh.push(refused(&round(&client, "quiz", json!({}), None).await));
    }
    let looped = Some("loop_detected".to_owned());
    assert_eq!(fresh, [None, None, None, looped.clone(), looped], "{fresh:?}");
}
