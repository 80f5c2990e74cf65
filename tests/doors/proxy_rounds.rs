//! A 2026-07-28 caller asked what a 2025-11-25 server asks (`src/proxy/lane/rounds.rs`): the
//! server's sampling and roots requests come back to the caller as `input_required` rounds, the
//! server's call parked meanwhile, in front of `server-everything` over stdio and over HTTP.

use std::collections::BTreeMap;
use std::time::Duration;

use mcp_ratelimit::state::Behind as _;
use rmcp::model::{CallToolRequestParams, CallToolResponse, ProtocolVersion};
use rmcp::service::RunningService;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::{ClientLifecycleMode, ClientServiceExt, RoleClient};
use serde_json::{Value, json};

use crate::clients::modern_client;
use crate::proxy::{Asked, Proxy, call, command, everything, everything_over_http, sha256_hex, text_of};

/// Two tenants' keys and the config that names them, with budgets that never run dry.
fn tenants() -> ([&'static str; 2], String) {
    let keys = ["acme-0123456789abcdef", "globex-0123456789abcdef"];
    let generous = "algorithm = \"token_bucket\"\nburst = 100000\nrefill_per_sec = 1.0\n";
    let toml = format!(
        "[loop_detection]\nenabled = false\n[limits.http]\n{generous}[limits.method.other]\n{generous}\
         [limits.caller]\n{generous}[limits.address]\n{generous}[auth]\nkeys = [{{ sha256 = \"{}\", tenant = \
         \"acme\" }}, {{ sha256 = \"{}\", tenant = \"globex\" }}]\n",
        sha256_hex(keys[0]),
        sha256_hex(keys[1])
    );
    (keys, toml)
}

/// A 2026-07-28 client of the proxy presenting `key`, answering what it is asked as `asked` does.
async fn asked_client(proxy: &Proxy, key: &str, asked: Asked) -> RunningService<RoleClient, Asked> {
    let config = StreamableHttpClientTransportConfig::with_uri(proxy.url.clone()).auth_header(key);
    let preferred_versions = vec![ProtocolVersion::V_2026_07_28];
    let client = asked.serve_with_lifecycle(
        StreamableHttpClientTransport::from_config(config),
        ClientLifecycleMode::Discover { preferred_versions },
    );
    client.await.expect("a 2026-07-28 client connects")
}

/// Two tenants' 2026-07-28 clients (rmcp's, then the Python SDK's), each calling a tool that asks
/// for sampling and one that asks for roots: each is asked in a round and gets its own answer, and
/// the other tenant is never asked for it.
async fn each_tenant_is_asked_its_own(proxy: &Proxy, keys: [&str; 2]) {
    let (acme_asked, globex_asked) = (Asked::named("acme"), Asked::named("globex"));
    let acme = asked_client(proxy, keys[0], acme_asked.clone()).await;
    let globex = asked_client(proxy, keys[1], globex_asked.clone()).await;
    for (client, name, mine, other) in
        [(&acme, "acme", &acme_asked, &globex_asked), (&globex, "globex", &globex_asked, &acme_asked)]
    {
        let before = other.asked().len();
        let prompt = json!({"prompt": format!("{name}'s question")});
        let sampled = call(client, "trigger-sampling-request", prompt).await;
        assert!(text_of(&sampled).contains(&format!("sampled by {name}")), "{name}: {sampled:?}");
        assert!(mine.asked().iter().any(|a| a.contains(&format!("{name}'s question"))), "{:?}", mine.asked());
        let roots = call(client, "get-roots-list", json!({})).await;
        assert!(text_of(&roots).contains(&format!("file:///work/{name}")), "{name}: {roots:?}");
        assert_eq!(other.asked().len(), before, "the other tenant was not asked for {name}");
    }
    // The Python SDK of the 2026-07-28 era drives the rounds itself, answering as itself.
    crate::proxy::python_tenants_are_asked_their_own(&proxy.url, "auto", keys).await;
    assert_eq!(proxy.app.proxied().map(|p| p.rounds_waiting()), Some(0), "every round was resumed");
}

#[tokio::test]
async fn a_2026_caller_is_asked_in_rounds_what_its_tenants_stdio_child_asks() {
    let (keys, toml) = tenants();
    let proxy = Proxy::start(&toml, command(everything("stdio"))).await;
    each_tenant_is_asked_its_own(&proxy, keys).await;
    // A made-up key's client declares nothing it can be asked: the reason reaches it, no round.
    let bob = modern_client(&proxy.url, "bob-0123456789abcdef").await;
    let refused = format!("{:?}", call(&bob, "trigger-sampling-request", json!({"prompt": "bob's"})).await);
    assert!(refused.contains("did not declare") && !refused.contains("sampled by"), "{refused}");
}

#[tokio::test]
async fn a_2026_caller_is_asked_in_rounds_what_an_http_server_of_2025_asks_on_its_call() {
    let (_server, target) = everything_over_http().await;
    let (keys, toml) = tenants();
    let proxy = Proxy::start(&toml, target).await;
    each_tenant_is_asked_its_own(&proxy, keys).await;
}

/// One round of `trigger-sampling-request` driven by hand: `state` and `responses` sent as given.
async fn sampling_round<H: rmcp::ClientHandler>(
    client: &RunningService<RoleClient, H>,
    prompt: &str,
    state: Option<&str>,
    responses: Option<Value>,
) -> Result<CallToolResponse, String> {
    let args = json!({"prompt": prompt}).as_object().cloned().unwrap_or_default();
    let mut params = CallToolRequestParams::new("trigger-sampling-request").with_arguments(args);
    params.request_state = state.map(str::to_owned);
    params.input_responses =
        responses.map(|r| serde_json::from_value::<BTreeMap<String, Value>>(r).unwrap_or_default());
    client.peer().call_tool_once(params).await.map_err(|e| e.to_string())
}

/// The round's state and the key of its one question, a sampling request.
fn asked_for_sampling(answer: &Result<CallToolResponse, String>) -> (String, String) {
    let Ok(CallToolResponse::InputRequired(input)) = answer else { panic!("asked for input: {answer:?}") };
    let requests = serde_json::to_value(&input.input_requests).unwrap_or_default();
    let (key, request) = requests.as_object().and_then(|r| r.iter().next()).expect("one question");
    assert_eq!(request["method"], "sampling/createMessage", "{request}");
    (input.request_state.clone().expect("a state"), key.clone())
}

fn sampled(text: &str) -> Value {
    json!({"role": "assistant", "content": {"type": "text", "text": text}, "model": "by-hand"})
}

/// A round's state is its caller's, for that call, once: another caller, other arguments, a
/// replay, an invented state or answers to other questions are refused `-32602`, and the round
/// still waits for its own caller; a caller holds at most four rounds, even asked at once; an
/// unanswered round ends after `proxy.timeout_ms`, its slot back.
#[tokio::test]
async fn a_rounds_state_is_its_callers_for_that_call_once_and_rounds_are_bounded() {
    let (_server, target) = everything_over_http().await;
    let (keys, toml) = tenants();
    let toml = format!("{toml}[proxy]\ntimeout_ms = 60000\n");
    let proxy = Proxy::start(&toml, target).await;
    let waiting = || proxy.app.proxied().map(|p| p.rounds_waiting()).unwrap_or_default();
    let in_flight = || proxy.app.proxied().map(|p| p.occupancy().in_flight).unwrap_or_default();
    // A client that declares nothing it can be asked is not asked: no round.
    let plain = modern_client(&proxy.url, keys[0]).await;
    let refused = format!("{:?}", sampling_round(&plain, "by hand", None, None).await);
    assert!(refused.contains("did not declare") && waiting() == 0, "{refused}");
    let acme = asked_client(&proxy, keys[0], Asked::named("acme")).await;
    let globex = asked_client(&proxy, keys[1], Asked::named("globex")).await;
    let first = sampling_round(&acme, "by hand", None, None).await;
    let (state, key) = asked_for_sampling(&first);
    assert!(state.starts_with("mcp-rl-round-") && waiting() == 1, "{state}");
    assert_eq!(in_flight(), 1, "the parked call keeps its place to the proxied server");
    let answer = json!({ key.clone(): sampled("sampled by hand") });
    let over = |r: &Result<CallToolResponse, String>| format!("{r:?}").contains("-32602");
    for (client, prompt, state, responses) in [
        (&globex, "by hand", state.as_str(), Some(answer.clone())), // another caller
        (&acme, "other arguments", state.as_str(), Some(answer.clone())),
        (&acme, "by hand", "mcp-rl-round-00000000000000000000000000000000", Some(answer.clone())), // invented
        (&acme, "by hand", state.as_str(), None),                                                  // no answers
        (&acme, "by hand", state.as_str(), Some(json!({"input-9": sampled("x")}))),                // not its question
        (&acme, "by hand", state.as_str(), Some(json!({ key.clone(): {"roots": []} }))), // not a sampling result
    ] {
        let resumed = sampling_round(client, prompt, Some(state), responses).await;
        assert!(over(&resumed), "refused: {resumed:?}");
        assert_eq!(waiting(), 1, "the round still waits for its own caller");
    }
    let done = sampling_round(&acme, "by hand", Some(&state), Some(answer.clone())).await;
    let Ok(CallToolResponse::Complete(done)) = &done else { panic!("the server's answer: {done:?}") };
    assert!(text_of(done).contains("sampled by hand"), "{done:?}");
    assert_eq!((waiting(), in_flight()), (0, 0), "answered, its place is back");
    let replayed = sampling_round(&acme, "by hand", Some(&state), Some(answer)).await;
    assert!(over(&replayed), "taken once: {replayed:?}");

    // Three rounds wait for acme; of two calls asked at once, one takes the fourth place and the
    // other's question is answered with the reason: never a fifth round.
    for n in 0..3 {
        asked_for_sampling(&sampling_round(&acme, &format!("parked {n}"), None, None).await);
    }
    let (one, other) =
        tokio::join!(sampling_round(&acme, "fourth", None, None), sampling_round(&acme, "fifth", None, None));
    let (one, other) = (format!("{one:?}"), format!("{other:?}"));
    let full = |said: &str| said.contains("calls waiting for its input already");
    assert!(full(&one) != full(&other) && waiting() == 4, "exactly one parked: {one} / {other}");
    // Globex is not held back by acme's rounds.
    asked_for_sampling(&sampling_round(&globex, "globex's", None, None).await);
    assert_eq!((waiting(), in_flight()), (5, 5));
    // Unanswered for the call's time, the rounds end: the server told to stop, the slots back.
    proxy.clock.advance(Duration::from_millis(60_001));
    crate::common::eventually("the rounds ended", || async { waiting() == 0 && in_flight() == 0 }).await;
}

/// A call asked in rounds is one call: its price is charged on the first round, never on the
/// round that resumes it (a budget of one call's price lets it finish), and the next call is
/// refused for that budget.
#[tokio::test]
async fn a_call_asked_in_rounds_is_charged_once() {
    let toml = "[loop_detection]\nenabled = false\n[tools.trigger-sampling-request]\ncost = 5\n[limits.caller]\n\
                algorithm = \"token_bucket\"\nburst = 5\nrefill_per_sec = 0.0001\n[limits.address]\n\
                algorithm = \"token_bucket\"\nburst = 1000\nrefill_per_sec = 1\n[tiers]\nguest = 1.0\n";
    let proxy = Proxy::start(toml, command(everything("stdio"))).await;
    let client = asked_client(&proxy, "payer-0123456789abcdef", Asked::named("payer")).await;
    let sampled = call(&client, "trigger-sampling-request", json!({"prompt": "once"})).await;
    assert!(text_of(&sampled).contains("sampled by payer"), "the resumed round was not charged again: {sampled:?}");
    let again = call(&client, "trigger-sampling-request", json!({"prompt": "twice"})).await;
    let code = again.structured_content.as_ref().and_then(|s| s["error"]["code"].as_str().map(str::to_owned));
    assert_eq!(code.as_deref(), Some("rate_limited"), "{again:?}");
}
