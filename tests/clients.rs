//! `serve`, and a library user's tools through `LimitedRouter`, as clients of both protocol eras
//! meet them: rmcp's own client speaking 2026-07-28 (`ClientLifecycleMode::Discover`), and the
//! official Python SDK in its default `auto` mode (2026-07-28) and in `legacy` (2025-11-25), which
//! checks every answer as its era requires — `resultType`, and structured content against the
//! tool's `outputSchema`. What we add to an answer of ours (`reserved`, `charged`, `cached`,
//! `warnings`) is in its `outputSchema`; what we add to an answer we did not write is in `_meta`.

mod common;
#[path = "common/python.rs"]
mod python;

use std::sync::Arc;

use common::*;
use mcp_ratelimit::{Catalogue, LimitedRouter, RateLimits};
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, JsonObject, MetaObject, ProtocolVersion, ResultType};
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
async fn modern_client(url: &str, key: &str) -> Client {
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
