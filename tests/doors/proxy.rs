//! `mcp-ratelimit proxy` in front of MCP servers nobody here wrote: the official
//! `@modelcontextprotocol/server-everything` (TypeScript) over stdio and streamable HTTP, and a
//! small FastMCP (Python) server of our own (`tests/fixtures/fastmcp_server.py`), both installed
//! from the package registries by `scripts/proxy-fixtures.sh` (which `make test` runs).
//!
//! The proxy runs in-process on a manual clock, so every wait it tells is exact; the proxied
//! servers run for real. Waiting for a killed child to be restarted is waiting for a process, not
//! for a window: those loops are bounded and poll.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use mcp_ratelimit::App;
use mcp_ratelimit::clock::{Clock, ManualClock, Nanos};
use mcp_ratelimit::config::{Catalogue, Config};
use mcp_ratelimit::proxy::{ChildEnv, Target};
use rmcp::ServiceExt;
use rmcp::model::{CallToolRequestParams, CallToolResult, GetPromptRequestParams, ReadResourceRequestParams};
use rmcp::service::ServiceError;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::{ConfigureCommandExt, StreamableHttpClientTransport, TokioChildProcess};
use serde_json::{Value, json};
use tokio::net::TcpListener;

use crate::common::{Client, eventually, eventually_some};
use crate::{common, python};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn installed(path: PathBuf) -> String {
    assert!(path.exists(), "{} is missing: run scripts/proxy-fixtures.sh (make test does)", path.display());
    path.to_string_lossy().into_owned()
}

/// Node 22 and the `everything` server's entry point, as `scripts/proxy-fixtures.sh` installed them.
pub(crate) fn everything(transport: &str) -> (String, Vec<String>) {
    let node = installed(root().join(".tools/node/node_modules/.bin/node"));
    let main = installed(root().join(".tools/node/node_modules/@modelcontextprotocol/server-everything/dist/index.js"));
    (node, vec![main, transport.to_owned()])
}

/// The virtualenv's Python (with FastMCP) and our FastMCP server.
pub(crate) fn fastmcp(args: &[&str]) -> (String, Vec<String>) {
    let python = installed(root().join(".tools/python/bin/python"));
    let server = installed(root().join("tests/fixtures/fastmcp_server.py"));
    (python, std::iter::once(server).chain(args.iter().map(|a| (*a).to_owned())).collect())
}

pub(crate) fn command((program, args): (String, Vec<String>)) -> Target {
    Target::Command { program, args, env: ChildEnv::default() }
}

/// A proxy serving HTTP in-process on a free port, on a manual clock.
pub(crate) struct Proxy {
    pub(crate) app: Arc<App>,
    pub(crate) clock: Arc<ManualClock>,
    pub(crate) url: String,
}

impl Proxy {
    pub(crate) async fn start(toml: &str, target: Target) -> Self {
        Self::start_on(toml, target, ManualClock::new()).await
    }

    /// [`Proxy::start`] on `clock` (an OAuth test's starts at the wall clock's time).
    async fn start_on(toml: &str, target: Target, clock: Arc<ManualClock>) -> Self {
        let config = Config::from_toml(toml, &Catalogue::learned()).expect("test config is valid");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let config = config.serving_at(addr).expect("a loopback address names the audience");
        let app = Arc::new(App::start_proxy(config, target, clock.clone()).await.expect("the proxy starts"));
        let url = format!("http://{addr}/mcp");
        let serving = app.clone();
        tokio::spawn(async move { serving.serve_http(listener).await });
        Self { app, clock, url }
    }

    async fn client(&self, key: Option<&str>) -> Client {
        let mut config = StreamableHttpClientTransportConfig::with_uri(self.url.clone());
        if let Some(key) = key {
            config = config.auth_header(key);
        }
        ().serve(StreamableHttpClientTransport::from_config(config)).await.expect("client connects")
    }
}

/// A client straight to the proxied server, to compare with what the proxy answers: declaring
/// what the proxy's own client declares (it can be asked for sampling, elicitation and roots).
async fn direct((program, args): (String, Vec<String>)) -> rmcp::service::RunningService<rmcp::RoleClient, Asked> {
    let child = TokioChildProcess::new(tokio::process::Command::new(program).configure(|c| {
        c.args(&args);
    }))
    .expect("the server starts");
    Asked::default().serve(child).await.expect("handshake")
}

/// A client that can be asked (it declares sampling, elicitation and roots) and answers sampling
/// (`sampled by NAME`) and roots (`file:///work/NAME`) as its name says, recording every request
/// it was asked.
#[derive(Clone)]
pub(crate) struct Asked {
    asked: Arc<std::sync::Mutex<Vec<String>>>,
    name: &'static str,
}

impl Default for Asked {
    fn default() -> Self {
        Self::named("the-caller-that-asked")
    }
}

#[allow(deprecated)] // Sampling and roots are legacy in 2026-07-28, and what 2025-11-25 servers send.
impl rmcp::ClientHandler for Asked {
    fn get_info(&self) -> rmcp::model::ClientConfig {
        let mut capabilities = rmcp::model::ClientCapabilities::default();
        capabilities.sampling = Some(Default::default());
        capabilities.elicitation = Some(Default::default());
        capabilities.roots = Some(Default::default());
        rmcp::model::ClientConfig::new(capabilities, rmcp::model::Implementation::new("asked", "1"))
    }

    async fn create_message(
        &self,
        params: rmcp::model::CreateMessageRequestParams,
        _context: rmcp::service::RequestContext<rmcp::RoleClient>,
    ) -> Result<rmcp::model::CreateMessageResult, rmcp::ErrorData> {
        self.asked
            .lock()
            .expect("a lock nobody panicked holding")
            .push(serde_json::to_string(&params).unwrap_or_default());
        let answer = rmcp::model::SamplingMessage::assistant_text(format!("sampled by {}", self.name));
        Ok(rmcp::model::CreateMessageResult::new(answer, "test-model".to_owned()))
    }

    async fn list_roots(
        &self,
        _context: rmcp::service::RequestContext<rmcp::RoleClient>,
    ) -> Result<rmcp::model::ListRootsResult, rmcp::ErrorData> {
        self.asked.lock().expect("a lock nobody panicked holding").push("roots/list".to_owned());
        Ok(rmcp::model::ListRootsResult::new(vec![rmcp::model::Root::new(format!("file:///work/{}", self.name))]))
    }
}

impl Asked {
    pub(crate) fn named(name: &'static str) -> Self {
        Self { asked: Arc::default(), name }
    }

    pub(crate) fn asked(&self) -> Vec<String> {
        self.asked.lock().expect("a lock nobody panicked holding").clone()
    }
}

pub(crate) async fn call<H: rmcp::ClientHandler>(
    client: &rmcp::service::RunningService<rmcp::RoleClient, H>,
    tool: &str,
    args: Value,
) -> CallToolResult {
    let Value::Object(args) = args else { panic!("arguments are an object") };
    client.call_tool(CallToolRequestParams::new(tool.to_owned()).with_arguments(args)).await.expect("an answer")
}

fn code_of(result: &CallToolResult) -> Option<&str> {
    result.structured_content.as_ref().and_then(|s| s["error"]["code"].as_str())
}

pub(crate) fn text_of(result: &CallToolResult) -> String {
    result.content.iter().filter_map(|c| c.as_text()).map(|t| t.text.clone()).collect::<Vec<_>>().join("")
}

/// A free loopback port for a server the test starts.
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// `server-everything` over streamable HTTP on a free port (killed when the child is dropped), and
/// the target that reaches it.
pub(crate) async fn everything_over_http() -> (tokio::process::Child, Target) {
    let port = free_port();
    let (node, args) = everything("streamableHttp");
    let server = serve_http(&node, &args, port).await;
    (server, Target::Http { url: format!("http://127.0.0.1:{port}/mcp"), headers: Vec::new() })
}

/// Starts a server that listens on `port`, and waits (bounded) until it accepts connections.
pub(crate) async fn serve_http(program: &str, args: &[String], port: u16) -> tokio::process::Child {
    let child = tokio::process::Command::new(program)
        .args(args)
        .env("PORT", port.to_string())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("the server starts");
    let listening = || async { tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok().map(drop) };
    eventually_some(&format!("{program} listens on {port}"), Duration::from_secs(30), listening).await;
    child
}

#[tokio::test]
async fn everything_over_stdio_lists_its_tools_with_their_prices() {
    let proxy = Proxy::start("[tools.echo]\ncost = 2\n", command(everything("stdio"))).await;
    let client = proxy.client(None).await;
    let through: Vec<_> = client.list_all_tools().await.expect("tools");
    let upstream = direct(everything("stdio")).await.list_all_tools().await.expect("its tools");
    let names = |tools: &[rmcp::model::Tool]| tools.iter().map(|t| t.name.to_string()).collect::<Vec<_>>();
    assert_eq!(names(&through), names(&upstream), "every tool of the proxied server, and no other");
    assert!(through.len() > 5, "{:?}", names(&through));
    for tool in &through {
        let description = tool.description.as_deref().unwrap_or_default();
        let price = if tool.name == "echo" { "Costs 2 tokens." } else { "Costs 1 token." };
        assert!(description.ends_with(price), "{}: {description}", tool.name);
    }
    let echo = call(&client, "echo", json!({"message": "hi"})).await;
    assert_eq!(text_of(&echo), "Echo: hi");
}

#[tokio::test]
async fn everything_over_streamable_http_is_proxied_too() {
    let (_server, target) = everything_over_http().await;
    let proxy = Proxy::start("", target).await;
    let client = proxy.client(None).await;
    let tools = client.list_all_tools().await.expect("tools");
    assert!(tools.iter().any(|t| t.name == "echo"), "{tools:?}");
    let echo = call(&client, "echo", json!({"message": "over http"})).await;
    assert_eq!(text_of(&echo), "Echo: over http");
}

/// What the proxied server asks while it serves a call (here `sampling/createMessage`) reaches the
/// session of the caller whose call it is, and no other; a caller whose client did not declare
/// sampling is refused without anyone being asked; and over stdio, where nothing says which call
/// a request belongs to, nobody is asked.
#[tokio::test]
async fn what_the_proxied_server_asks_during_a_call_reaches_that_callers_session_only() {
    let (_server, target) = everything_over_http().await;
    let proxy = Proxy::start("[loop_detection]\nenabled = false\n", target).await;
    let session = |key: &str| StreamableHttpClientTransportConfig::with_uri(proxy.url.clone()).auth_header(key);
    let (alice_asked, carol_asked) = (Asked::default(), Asked::default());
    let alice =
        alice_asked.clone().serve(StreamableHttpClientTransport::from_config(session("alice-0123456789abcdef"))).await;
    let alice = alice.expect("alice connects");
    let carol =
        carol_asked.clone().serve(StreamableHttpClientTransport::from_config(session("carol-0123456789abcdef"))).await;
    let _carol = carol.expect("carol connects, and stays connected");
    let bob = ().serve(StreamableHttpClientTransport::from_config(session("bob-0123456789abcdef"))).await;
    let bob = bob.expect("bob connects");
    let tools = alice.list_all_tools().await.expect("tools");
    assert!(tools.iter().any(|t| t.name == "trigger-sampling-request"), "offered: the proxy can be asked");

    let sample = |prompt: &str| {
        CallToolRequestParams::new("trigger-sampling-request")
            .with_arguments(json!({"prompt": prompt}).as_object().cloned().unwrap_or_default())
    };
    let answered = alice.call_tool(sample("alice's question")).await.expect("answered");
    assert!(text_of(&answered).contains("sampled by the-caller-that-asked"), "{answered:?}");
    let asked = alice_asked.asked();
    assert!(asked.len() == 1 && asked[0].contains("alice's question"), "alice was asked once: {asked:?}");
    assert!(carol_asked.asked().is_empty(), "carol, who can be asked too, was not");

    // Bob's client cannot be asked: the server hears a refusal, and nobody else is asked for him.
    let refused = bob.call_tool(sample("bob's question")).await;
    let said = format!("{refused:?}");
    assert!(!said.contains("sampled by"), "{said}");
    assert!(said.contains("did not declare"), "the reason reaches him: {said}");
    assert_eq!((alice_asked.asked().len(), carol_asked.asked().len()), (1, 0), "nobody answered for bob");
}

/// Over stdio nothing marks which call a request is for, but a tenant's child serves that tenant
/// alone: what it asks goes to the one caller of its scope that can have asked (the only call in
/// flight whose client declared the capability, else the scope's only session). Two tenants'
/// clients, each able to be asked, each get their own answer and never the other's — the rmcp
/// client and the Python SDK's (2025-11-25) alike; a second idle session of one tenant is not
/// asked for the first's call; and a caller whose client cannot be asked hears why, nobody asked
/// for it.
#[tokio::test]
async fn a_stdio_childs_questions_reach_the_one_caller_of_its_tenant_that_can_have_asked() {
    let keys = ["acme-0123456789abcdef", "globex-0123456789abcdef"];
    let toml = format!(
        "[loop_detection]\nenabled = false\n[auth]\nkeys = [{{ sha256 = \"{}\", tenant = \"acme\" }}, \
         {{ sha256 = \"{}\", tenant = \"globex\" }}]\n",
        sha256_hex(keys[0]),
        sha256_hex(keys[1])
    );
    let proxy = Proxy::start(&toml, command(everything("stdio"))).await;
    let session = |key: &str| StreamableHttpClientTransportConfig::with_uri(proxy.url.clone()).auth_header(key);
    let (acme_asked, globex_asked) = (Asked::named("acme"), Asked::named("globex"));
    let acme = acme_asked.clone().serve(StreamableHttpClientTransport::from_config(session(keys[0])));
    let acme = acme.await.expect("acme connects");
    let globex = globex_asked.clone().serve(StreamableHttpClientTransport::from_config(session(keys[1])));
    let globex = globex.await.expect("globex connects");
    let sample = |prompt: &str| json!({"prompt": prompt});
    for (client, name, other) in [(&acme, "acme", &globex_asked), (&globex, "globex", &acme_asked)] {
        let before = other.asked().len();
        let sampled = call(client, "trigger-sampling-request", sample(&format!("{name}'s question"))).await;
        assert!(text_of(&sampled).contains(&format!("sampled by {name}")), "{name}: {sampled:?}");
        let roots = call(client, "get-roots-list", json!({})).await;
        assert!(text_of(&roots).contains(&format!("file:///work/{name}")), "{name}: {roots:?}");
        assert_eq!(other.asked().len(), before, "the other tenant was not asked for {name}");
    }
    python_tenants_are_asked_their_own(&proxy.url, "legacy", keys).await;
    // A second session of acme's, idle: acme's call in flight is the one that asked.
    let (idle_asked, before) = (Asked::named("acme-idle"), acme_asked.asked().len());
    let idle = idle_asked.clone().serve(StreamableHttpClientTransport::from_config(session(keys[0])));
    let _idle = idle.await.expect("a second acme session connects");
    let sampled = call(&acme, "trigger-sampling-request", sample("acme's again")).await;
    assert!(text_of(&sampled).contains("sampled by acme"), "{sampled:?}");
    assert!(idle_asked.asked().is_empty() && acme_asked.asked().len() == before + 1, "{:?}", idle_asked.asked());
    // A made-up key's client declares nothing: its own call is the one that asked, and it cannot be.
    let bob = ().serve(StreamableHttpClientTransport::from_config(session("bob-0123456789abcdef"))).await;
    let (bob, asked_before) = (bob.expect("bob connects"), acme_asked.asked().len() + globex_asked.asked().len());
    let refused = format!("{:?}", call(&bob, "trigger-sampling-request", sample("bob's question")).await);
    assert!(refused.contains("did not declare") && !refused.contains("sampled by"), "{refused}");
    assert_eq!(acme_asked.asked().len() + globex_asked.asked().len(), asked_before, "nobody answered for bob");
}

/// Two tenants' Python SDK clients in `mode` (`legacy`: 2025-11-25; `auto`: 2026-07-28, which
/// drives `input_required` rounds itself), each answering as itself: its own sampling answer; the
/// roots are what its tenant's child learnt from its tenant (server-everything keeps them per
/// session).
pub(crate) async fn python_tenants_are_asked_their_own(url: &str, mode: &str, keys: [&str; 2]) {
    let version = if mode == "legacy" { "2025-11-25" } else { "2026-07-28" };
    for (key, tenant) in [(keys[0], "acme"), (keys[1], "globex")] {
        let (header, name) = (format!("Authorization: Bearer {key}"), format!("{tenant}-python"));
        let steps = json!([
            {"op": "call", "tool": "trigger-sampling-request", "args": {"prompt": "a question"}},
            {"op": "call", "tool": "get-roots-list", "args": {}},
        ]);
        let walked = python::walk(url, mode, steps, &["-H", &header, "--answer-as", &name]).await;
        let text = |step: usize| walked["steps"][step]["ok"]["text"].as_str().unwrap_or_default().to_owned();
        assert_eq!(walked["protocol_version"], version, "{walked}");
        assert!(python::all_ok(&walked) && text(0).contains(&format!("sampled by {name}")), "{walked}");
        assert!(text(1).contains(&format!("file:///work/{tenant}")), "{walked}");
    }
}

/// With `proxy.upstream_sessions = "session"`, a stdio child serves one downstream session, so what
/// it asks off any call's stream is that session's caller's: `server-everything`'s roots, which it
/// asks for on its own, reach the caller whose child it is.
#[tokio::test]
async fn a_child_of_one_session_asks_that_sessions_caller_even_off_a_calls_stream() {
    let proxy = Proxy::start("[proxy]\nupstream_sessions = \"session\"\n", command(everything("stdio"))).await;
    let session = |key: &str| StreamableHttpClientTransportConfig::with_uri(proxy.url.clone()).auth_header(key);
    let alice_asked = Asked::default();
    let alice =
        alice_asked.clone().serve(StreamableHttpClientTransport::from_config(session("alice-0123456789abcdef")));
    let alice = alice.await.expect("alice connects");
    let roots = call(&alice, "get-roots-list", json!({})).await;
    assert!(text_of(&roots).contains("file:///work/the-caller-that-asked"), "{roots:?}");
    assert!(alice_asked.asked().iter().any(|a| a == "roots/list"), "{:?}", alice_asked.asked());
    // Another session's child asks its own caller, who cannot be asked: nobody answers for it.
    let bob = ().serve(StreamableHttpClientTransport::from_config(session("bob-0123456789abcdef"))).await;
    let bob = bob.expect("bob connects");
    let (before, theirs) = (alice_asked.asked().len(), call(&bob, "get-roots-list", json!({})).await);
    assert!(!text_of(&theirs).contains("the-caller-that-asked"), "{theirs:?}");
    assert_eq!(alice_asked.asked().len(), before, "alice was not asked for bob");
}

#[tokio::test]
async fn a_burst_is_refused_at_exactly_the_budget_with_the_wait() {
    let toml = "[limits.caller]\nalgorithm = \"token_bucket\"\nburst = 3\nrefill_per_sec = 0.5\n";
    let proxy = Proxy::start(toml, command(fastmcp(&[]))).await;
    let client = proxy.client(None).await;
    for b in 1..=3 {
        let sum = call(&client, "add", json!({"a": 1, "b": b})).await;
        assert_eq!(text_of(&sum), (1 + b).to_string(), "call {b} is within the budget");
    }
    let refused = call(&client, "add", json!({"a": 1, "b": 4})).await;
    assert_eq!(refused.is_error, Some(true));
    assert_eq!(code_of(&refused), Some("rate_limited"), "{refused:?}");
    let error = &refused.structured_content.as_ref().expect("structured")["error"];
    assert_eq!(error["retry_after_ms"], 2_000, "one token comes back in exactly 2 s: {error}");
    proxy.clock.advance(Duration::from_secs(2));
    let later = call(&client, "add", json!({"a": 1, "b": 4})).await;
    assert_eq!(text_of(&later), "5", "served once the wait is over");
}

#[tokio::test]
async fn a_long_tool_holds_its_slot_until_it_returns() {
    let toml = "[tools.wait_for]\nholds_slot = true\ncost = 1\n[limits.in_flight]\ncaller = 1\n";
    let proxy = Proxy::start(toml, command(fastmcp(&[]))).await;
    let client = Arc::new(proxy.client(None).await);
    let dir = tempfile::tempdir().expect("tempdir");
    let release = dir.path().join("release");
    let long = {
        let (client, path) = (client.clone(), release.to_string_lossy().into_owned());
        tokio::spawn(async move { call(&client, "wait_for", json!({"path": path})).await })
    };
    wait_until_exists(&dir.path().join("release.started")).await;
    let second = call(&client, "wait_for", json!({"path": "/nonexistent/other"})).await;
    assert_eq!(code_of(&second), Some("busy"), "the first call holds the one slot: {second:?}");
    std::fs::write(&release, "go").expect("release");
    let first = long.await.expect("the long call");
    assert_eq!(text_of(&first), "released");
    let sum = call(&client, "add", json!({"a": 2, "b": 3})).await;
    assert_eq!(text_of(&sum), "5", "a tool that holds no slot is never busy");
    let dir2 = dir.path().join("again");
    std::fs::write(&dir2, "go").expect("pre-released");
    let third = call(&client, "wait_for", json!({"path": dir2.to_string_lossy()})).await;
    assert_eq!(text_of(&third), "released", "the slot came back when the long call returned");
}

pub(crate) async fn wait_until_exists(path: &Path) {
    let what = format!("{} appears", path.display());
    eventually_some(&what, Duration::from_secs(12), || async { path.exists().then_some(()) }).await;
}

/// The first answer to `tool` that `wanted` accepts, asked again (bounded real time) until one is.
async fn answer_when(
    client: &Client,
    tool: &str,
    args: Value,
    within: Duration,
    wanted: impl Fn(&CallToolResult) -> bool,
) -> CallToolResult {
    eventually_some(&format!("an answer to {tool} as wanted"), within, || async {
        Some(call(client, tool, args.clone()).await).filter(|answer| wanted(answer))
    })
    .await
}

#[tokio::test]
async fn five_identical_calls_are_a_loop() {
    let proxy = Proxy::start("", command(fastmcp(&[]))).await;
    let client = proxy.client(None).await;
    for n in 1..=4 {
        assert_eq!(text_of(&call(&client, "add", json!({"a": 2, "b": 2})).await), "4", "call {n}");
    }
    let fifth = call(&client, "add", json!({"a": 2, "b": 2})).await;
    assert_eq!(code_of(&fifth), Some("loop_detected"), "{fifth:?}");
}

#[tokio::test]
async fn the_proxied_servers_errors_pass_through_unchanged() {
    let proxy = Proxy::start("", command(fastmcp(&[]))).await;
    let client = proxy.client(None).await;
    let upstream = direct(fastmcp(&[])).await;

    let through = call(&client, "fail", json!({"reason": "testing"})).await;
    let straight = call(&upstream, "fail", json!({"reason": "testing"})).await;
    assert_eq!(through.is_error, Some(true));
    assert_eq!(serde_json::to_value(&through).expect("JSON"), serde_json::to_value(&straight).expect("JSON"));

    let missing = || ReadResourceRequestParams::new("fixture://nope");
    let through = client.read_resource(missing()).await.expect_err("no such resource");
    let straight = upstream.read_resource(missing()).await.expect_err("no such resource");
    match (through, straight) {
        (ServiceError::McpError(through), ServiceError::McpError(straight)) => {
            assert_eq!((through.code, through.message), (straight.code, straight.message));
        }
        other => panic!("both are the server's JSON-RPC error: {other:?}"),
    }
}

#[tokio::test]
async fn an_unknown_tool_is_an_error_and_charges_nothing() {
    let toml = "[limits.caller]\nalgorithm = \"token_bucket\"\nburst = 1\nrefill_per_sec = 0.01\n";
    let proxy = Proxy::start(toml, command(fastmcp(&[]))).await;
    let client = proxy.client(None).await;
    for _ in 0..3 {
        let unknown = client.call_tool(CallToolRequestParams::new("no_such_tool")).await;
        assert!(matches!(unknown, Err(ServiceError::McpError(_))), "{unknown:?}");
    }
    let sum = call(&client, "add", json!({"a": 1, "b": 1})).await;
    assert_eq!(text_of(&sum), "2", "the budget of 1 is still whole");
}

#[tokio::test]
async fn resources_and_prompts_pass_through() {
    let proxy = Proxy::start("", command(fastmcp(&[]))).await;
    let client = proxy.client(None).await;
    let resources = client.list_all_resources().await.expect("resources");
    assert!(resources.iter().any(|r| r.uri == "fixture://greeting"), "{resources:?}");
    let read = client.read_resource(ReadResourceRequestParams::new("fixture://greeting")).await.expect("read");
    assert!(format!("{:?}", read.contents).contains("hello from python"), "{read:?}");
    let mut args = serde_json::Map::new();
    args.insert("code".to_owned(), json!("x = 1"));
    let prompt = client.get_prompt(GetPromptRequestParams::new("review").with_arguments(args)).await.expect("prompt");
    assert!(format!("{:?}", prompt.messages).contains("Please review: x = 1"), "{prompt:?}");
}

#[tokio::test]
async fn a_killed_child_is_unavailable_with_a_wait_then_served_after_its_restart() {
    // The test asks every 10 ms until the child is back (a process start: a second or more on a
    // busy machine): the request limits stand aside, this is about the restart.
    let toml = "[upstream]\nbreaker_cooldown_ms = 5000\n[loop_detection]\nenabled = false\n\
                [limits.http]\nburst = 100000\n[limits.address_http]\nburst = 100000\n\
                [limits.method.tools_call]\nburst = 100000\n[proxy]\nupstream_sessions = \"shared\"\n";
    let proxy = Proxy::start(toml, command(fastmcp(&[]))).await;
    let client = proxy.client(None).await;
    let pid: i32 = text_of(&call(&client, "pid", json!({})).await).parse().expect("a pid");
    let proxied = proxy.app.proxied().expect("a proxy").clone();
    assert_eq!(proxied.link().child_pid(), Some(pid as u32));
    let killed = std::process::Command::new("kill").args(["-9", &pid.to_string()]).status().expect("kill");
    assert!(killed.success());

    // Until the proxy notices, a call may meet the dead pipe; then the breaker answers at once.
    let unavailable = |a: &CallToolResult| code_of(a) == Some("upstream_unavailable");
    let refusal = answer_when(&client, "add", json!({"a": 1, "b": 1}), Duration::from_secs(10), unavailable).await;
    let wait = refusal.structured_content.as_ref().expect("structured")["error"]["retry_after_ms"].as_u64();
    assert!(wait.is_some_and(|ms| ms > 0 && ms <= 5_000), "a wait of at most the cool-down: {refusal:?}");

    // Restarted with backoff (its first try after 200 ms), the breaker closed: served again.
    let served = answer_when(&client, "pid", json!({}), Duration::from_secs(30), |a| a.is_error != Some(true)).await;
    let new_pid: i32 = text_of(&served).parse().expect("a pid");
    assert_ne!(new_pid, pid, "a new child");
}

#[tokio::test]
async fn headers_from_config_reach_an_http_upstream_and_the_callers_key_never_does() {
    let port = free_port();
    let (python, args) = fastmcp(&["http", &port.to_string()]);
    let _server = serve_http(&python, &args, port).await;
    let secret = "upstream-secret-123";
    let headers =
        vec![(http::HeaderName::from_static("x-upstream-key"), http::HeaderValue::from_str(secret).expect("header"))];
    let target = Target::Http { url: format!("http://127.0.0.1:{port}/mcp"), headers };
    let key = "caller-key-0123456789abcdef";
    let toml = format!("[auth]\nkeys = [{{ sha256 = \"{}\", tenant = \"acme\" }}]\n", sha256_hex(key));
    let proxy = Proxy::start(&toml, target).await;
    let client = proxy.client(Some(key)).await;
    let seen = call(&client, "header", json!({"name": "x-upstream-key"})).await;
    assert_eq!(text_of(&seen), secret);
    let seen = call(&client, "header", json!({"name": "authorization"})).await;
    assert_eq!(text_of(&seen), "", "the caller's key stays at the proxy");
    assert!(!format!("{:?}", proxy.app).contains(secret), "the header's value is in no Debug string");
    // FastMCP speaks 2026-07-28, and so does the proxy to it: a router in front of it reads the
    // method and the tool from the headers (SEP-2243) without parsing the body.
    let spoken = proxy.app.proxied().expect("a proxy").link().info().map(|i| i.protocol_version.clone());
    assert_eq!(spoken, Some(rmcp::model::ProtocolVersion::V_2026_07_28));
    for (name, sent) in [("mcp-method", "tools/call"), ("mcp-name", "header"), ("mcp-protocol-version", "2026-07-28")] {
        let seen = call(&client, "header", json!({"name": name})).await;
        assert_eq!(text_of(&seen), sent, "{name}");
    }
}

/// In front of an HTTP server with `[auth.oauth]` on: a caller's access token stays at the proxy
/// (MCP forbids passing it through; only `[proxy.headers]` goes upstream), and the tenant its
/// claims name is the scope of its upstream session, for the Python SDK of both eras too.
#[tokio::test]
async fn an_access_token_never_reaches_the_proxied_server_and_its_tenant_keeps_its_session() {
    let provider = crate::oauth::Provider::start(json!({})).await;
    let port = free_port();
    let (python, args) = fastmcp(&["http", &port.to_string()]);
    let _server = serve_http(&python, &args, port).await;
    let headers = vec![(http::HeaderName::from_static("x-upstream-key"), http::HeaderValue::from_static("proxy-own"))];
    let target = Target::Http { url: format!("http://127.0.0.1:{port}/mcp"), headers };
    let toml = format!(
        "[loop_detection]\nenabled = false\n[auth]\nrequired = true\n[auth.oauth]\nissuer = \"{}\"\n",
        provider.issuer
    );
    let wall = || {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("now");
        ManualClock::starting_at(Nanos::new(u64::try_from(now.as_nanos()).expect("fits")))
    };
    let proxy = Proxy::start_on(&toml, target, wall()).await;
    let alice = provider.mint(json!({"sub": "alice", "aud": proxy.url, "org_id": "acme"})).await;
    let alice_client = proxy.client(Some(&alice)).await;
    let seen = call(&alice_client, "header", json!({"name": "authorization"})).await;
    assert_eq!(text_of(&seen), "", "the token stays at the proxy");
    assert_eq!(text_of(&call(&alice_client, "header", json!({"name": "x-upstream-key"})).await), "proxy-own");
    for mode in ["auto", "legacy"] {
        let header = format!("Authorization: Bearer {alice}");
        let steps = json!([{"op": "call", "tool": "header", "args": {"name": "authorization"}}]);
        let walked = python::walk(&proxy.url, mode, steps, &["-H", &header]).await;
        assert_eq!(walked["protocol_version"], python::era_of(mode), "{walked}");
        assert_eq!(walked["steps"][0]["ok"]["text"], "", "{mode}: {walked}");
    }

    // In front of a stateful server over stdio (one child holds one tenant's state): the tenant a
    // token names is the scope of its session.
    let stdio = Proxy::start_on(&toml, command(fastmcp(&[])), wall()).await;
    let token = |sub: &str, org: &str| provider.mint(json!({"sub": sub, "aud": stdio.url, "org_id": org}));
    let (alice, anna, bob) = (token("alice", "acme").await, token("anna", "acme").await, token("bob", "globex").await);
    let remembered = call(&stdio.client(Some(&alice)).await, "remember", json!({"value": "acme's note"})).await;
    assert_eq!(text_of(&remembered), "remembered");
    let recalled = call(&stdio.client(Some(&bob)).await, "recall", json!({})).await;
    assert_eq!(text_of(&recalled), "", "globex reads nothing of acme's");
    for mode in ["auto", "legacy"] {
        for (token, expected) in [(&anna, "acme's note"), (&bob, "")] {
            let header = format!("Authorization: Bearer {token}");
            let steps = json!([{"op": "call", "tool": "recall", "args": {}}]);
            let walked = python::walk(&stdio.url, mode, steps, &["-H", &header]).await;
            assert_eq!(walked["protocol_version"], python::era_of(mode), "{walked}");
            assert_eq!(walked["steps"][0]["ok"]["text"], expected, "{mode}: the tenant its token names: {walked}");
        }
    }
    // A forged token is no caller of acme's: refused at the door, before anything is proxied.
    let forged = provider.forge("other_key", json!({"sub": "alice", "aud": stdio.url, "org_id": "acme"})).await;
    let config = StreamableHttpClientTransportConfig::with_uri(stdio.url.clone()).auth_header(forged);
    assert!(().serve(StreamableHttpClientTransport::from_config(config)).await.is_err(), "refused at the door");
}

pub(crate) fn sha256_hex(key: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(key.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test]
async fn proxy_over_stdio_fronts_a_local_server_as_claude_desktop_runs_it() {
    let mut file = tempfile::NamedTempFile::new().expect("config");
    std::io::Write::write_all(&mut file, b"[tools.add]\ncost = 3\n").expect("write");
    let (python, args) = fastmcp(&[]);
    let proxy = tokio::process::Command::new(env!("CARGO_BIN_EXE_mcp-ratelimit")).configure(|c| {
        c.arg("proxy").arg("--stdio").arg("--config").arg(file.path()).arg("--").arg(&python).args(&args);
    });
    let client = ().serve(TokioChildProcess::new(proxy).expect("the proxy starts")).await.expect("handshake");
    let tools = client.list_all_tools().await.expect("tools");
    let add = tools.iter().find(|t| t.name == "add").expect("the proxied server's add");
    assert!(add.description.as_deref().is_some_and(|d| d.ends_with("Costs 3 tokens.")), "{add:?}");
    assert_eq!(text_of(&call(&client, "add", json!({"a": 20, "b": 22})).await), "42");
    // One client, one child: its one caller (`local`) is on the proxy's own session, which the
    // tools are learnt on, so what it does to its server's list is the list it is offered.
    assert_eq!(text_of(&call(&client, "hide", json!({"name": "add"})).await), "hid add");
    eventually("the tool it hid is no longer listed", || async {
        client.list_all_tools().await.expect("tools").iter().all(|t| t.name != "add")
    })
    .await;
}

#[test]
fn the_command_line_wants_exactly_one_proxied_server() {
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_mcp-ratelimit"))
            .arg("proxy")
            .args(args)
            .current_dir(std::env::temp_dir())
            .output()
            .expect("binary runs");
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (ok, stderr) = run(&[]);
    assert!(!ok && stderr.contains("--upstream URL") && stderr.contains("-- COMMAND"), "{stderr}");
    let (ok, stderr) = run(&["--upstream", "http://127.0.0.1:9/mcp", "--", "some-server"]);
    assert!(!ok && stderr.contains("cannot be used with"), "{stderr}");
    let (ok, stderr) = run(&["--upstream", "ftp://example.invalid/mcp"]);
    assert!(!ok && stderr.contains("http or https"), "{stderr}");
    let (ok, stderr) = run(&["--", "/nonexistent/mcp-server"]);
    assert!(!ok && stderr.contains("cannot start"), "a command that cannot start is a start-up error: {stderr}");
    let closed = free_port();
    let (ok, stderr) = run(&["--upstream", &format!("http://user:s3cret-pw@127.0.0.1:{closed}/mcp")]);
    assert!(!ok && stderr.contains("did not complete the MCP handshake"), "{stderr}");
    assert!(!stderr.contains("s3cret-pw"), "a password in the URL is never printed: {stderr}");
}

#[test]
fn a_proxys_config_prices_tools_it_has_not_seen_and_checks_the_default_price() {
    let learned = Catalogue::learned();
    let config = Config::from_toml("[tools.render]\ncost = 4\nholds_slot = true\n", &learned).expect("valid");
    assert_eq!(config.limiting.tools["render"].cost, 4, "a tool the server may list later");
    assert!(config.limiting.tools["render"].holds_slot);
    assert_eq!(config.limiting.unlisted_tools.as_ref().map(|t| t.cost), Some(1), "proxy.default_cost's default");

    let dear = Config::from_toml("[proxy]\ndefault_cost = 1000\n", &learned).expect_err("no budget can pay it");
    assert!(dear.to_string().contains("`proxy.default_cost`"), "{dear}");
    assert!(dear.to_string().contains("limits.caller.burst"), "{dear}");

    for (toml, key) in [
        ("[proxy]\nmax_in_flight = 0\n", "proxy.max_in_flight"),
        ("[proxy]\ntimeout_ms = 0\n", "proxy.timeout_ms"),
        ("[proxy]\nmax_subscriptions_per_caller = 0\n", "proxy.max_subscriptions_per_caller"),
        ("[proxy]\nmax_subscriptions_per_address = 0\n", "proxy.max_subscriptions_per_address"),
        ("[proxy]\nupstream_url = \"nope\"\n", "proxy.upstream_url"),
        ("[proxy.headers]\n\"bad header\" = \"x\"\n", "proxy.headers.bad header"),
        ("[proxy.headers]\nmcp-session-id = \"x\"\n", "proxy.headers.mcp-session-id"),
    ] {
        let error = Config::from_toml(toml, &learned).expect_err(toml);
        assert!(error.to_string().contains(key), "{toml}: {error}");
    }
    // `check-config --proxy` reads a file as `proxy` does.
    let mut file = tempfile::NamedTempFile::new().expect("config");
    std::io::Write::write_all(&mut file, b"[tools.render]\ncost = 4\n").expect("write");
    let check = |proxy: bool| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_mcp-ratelimit"));
        command.arg("check-config").arg(file.path());
        if proxy {
            command.arg("--proxy");
        }
        command.output().expect("binary runs").status.success()
    };
    assert!(check(true), "a proxy's tool it has not seen yet");
    assert!(!check(false), "our own server has no tool `render`");
    // Our own server's catalogue is fixed: there, a tool it does not have is a typo.
    let fixed = Config::from_toml("[tools.render]\ncost = 4\n", &mcp_ratelimit::mcp::tools::catalogue());
    assert!(fixed.is_err());
    let job = "[tools.generate_image]\ncost = 5\nholds_slot = false\n";
    let error = Config::from_toml(job, &mcp_ratelimit::mcp::tools::catalogue()).expect_err("a job holds its slot");
    assert!(error.to_string().contains("tools.generate_image.holds_slot"), "{error}");
}

#[tokio::test]
async fn a_tool_the_server_adds_is_learnt_priced_and_callable() {
    // Tools are learnt from the proxy's own session: one the server adds in another is not.
    let toml = "[tools.plus_one]\ncost = 3\n[proxy]\nupstream_sessions = \"shared\"\n";
    let proxy = Proxy::start(toml, command(fastmcp(&[]))).await;
    let client = proxy.client(None).await;
    let unknown = client.call_tool(CallToolRequestParams::new("plus_one")).await;
    assert!(matches!(unknown, Err(ServiceError::McpError(_))), "not listed yet: {unknown:?}");
    assert_eq!(text_of(&call(&client, "grow", json!({"name": "plus_one"})).await), "added plus_one");
    // The proxy re-lists on the server's list_changed, in the background: a bounded poll.
    let tool = eventually_some("the new tool is listed", Duration::from_secs(10), || async {
        client.list_all_tools().await.expect("tools").into_iter().find(|t| t.name == "plus_one")
    })
    .await;
    assert_eq!(tool.description.as_deref(), Some("Adds one. Costs 3 tokens."), "priced by [tools.plus_one]");
    assert_eq!(text_of(&call(&client, "plus_one", json!({"x": 41})).await), "42");
}

/// A client that keeps the progress notifications it hears.
#[derive(Clone, Default)]
struct Progress(Arc<std::sync::Mutex<Vec<rmcp::model::ProgressNotificationParam>>>);

impl rmcp::ClientHandler for Progress {
    async fn on_progress(
        &self,
        params: rmcp::model::ProgressNotificationParam,
        _context: rmcp::service::NotificationContext<rmcp::RoleClient>,
    ) {
        self.0.lock().expect("a lock nobody panicked holding").push(params);
    }
}

#[tokio::test]
async fn a_calls_progress_reaches_the_session_that_made_it_and_no_other() {
    let proxy = Proxy::start("", command(fastmcp(&[]))).await;
    let heard = Progress::default();
    let transport =
        StreamableHttpClientTransport::from_config(StreamableHttpClientTransportConfig::with_uri(proxy.url.clone()));
    let caller = heard.clone().serve(transport).await.expect("client");
    let bystander = Progress::default();
    let transport =
        StreamableHttpClientTransport::from_config(StreamableHttpClientTransportConfig::with_uri(proxy.url.clone()));
    let _other = bystander.clone().serve(transport).await.expect("client");
    let mut args = serde_json::Map::new();
    args.insert("n".to_owned(), json!(3));
    let done = caller.call_tool(CallToolRequestParams::new("count").with_arguments(args)).await.expect("answer");
    assert_eq!(text_of(&done), "counted 3");
    let heard = heard.0.lock().expect("a lock nobody panicked holding").clone();
    assert_eq!(heard.iter().map(|p| p.progress).collect::<Vec<_>>(), vec![1.0, 2.0, 3.0], "{heard:?}");
    assert!(bystander.0.lock().expect("a lock nobody panicked holding").is_empty(), "another session hears none of it");
}

#[tokio::test]
async fn calls_beyond_max_in_flight_wait_their_turn_and_a_full_queue_is_busy() {
    // A configured key: unverified callers would hold only `upstream.unverified_share` (half, rounded
    // down: none) of one slot and one place.
    let key = "queue-key-0123456789abcdef";
    let toml = format!(
        "[proxy]\nmax_in_flight = 1\n[upstream]\nqueue_max = 1\n[loop_detection]\nenabled = false\n\
         [auth]\nkeys = [{{ sha256 = \"{}\" }}]\n",
        sha256_hex(key)
    );
    let proxy = Proxy::start(&toml, command(fastmcp(&[]))).await;
    let client = Arc::new(proxy.client(Some(key)).await);
    let dir = tempfile::tempdir().expect("tempdir");
    let release = dir.path().join("release");
    let path = release.to_string_lossy().into_owned();
    let first = {
        let (client, path) = (client.clone(), path.clone());
        tokio::spawn(async move { call(&client, "wait_for", json!({"path": path})).await })
    };
    wait_until_exists(&dir.path().join("release.started")).await;
    // The one slot is taken: the next call waits in the queue's one place...
    let second = {
        let client = client.clone();
        tokio::spawn(async move { call(&client, "add", json!({"a": 1, "b": 1})).await })
    };
    let occupancy = || proxy.app.state().behind.occupancy();
    eventually("the second call waits in the queue", || async { occupancy().waiting == 1 }).await;
    assert_eq!((occupancy().in_flight, occupancy().waiting), (1, 1), "one call in flight, one waiting");
    // ...and with it waiting there, a third finds the queue full: busy, with a wait.
    let refused = call(&client, "add", json!({"a": 2, "b": 2})).await;
    assert_eq!(code_of(&refused), Some("busy"), "{refused:?}");
    let error = &refused.structured_content.as_ref().expect("structured")["error"];
    assert!(error["retry_after_ms"].as_u64().is_some_and(|ms| ms > 0), "{error}");
    assert!(!second.is_finished(), "the second call still waits its turn");
    std::fs::write(&release, "go").expect("release");
    assert_eq!(text_of(&first.await.expect("first")), "released");
    assert_eq!(text_of(&second.await.expect("second")), "2", "served when the slot came back");
}

#[tokio::test]
async fn a_call_slower_than_the_timeout_is_unavailable_and_never_retried() {
    let toml = "[proxy]\ntimeout_ms = 1000\nupstream_sessions = \"shared\"\n";
    let proxy = Proxy::start(toml, command(fastmcp(&[]))).await;
    let client = Arc::new(proxy.client(None).await);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("never").to_string_lossy().into_owned();
    let slow = {
        let client = client.clone();
        tokio::spawn(async move { call(&client, "wait_for", json!({"path": path})).await })
    };
    // The tool appends a line each time it starts. Once it runs, the proxy's clock walks past the
    // timeout: the answer is the refusal, on no real-time deadline.
    let started = dir.path().join("never.started");
    wait_until_exists(&started).await;
    proxy.clock.advance(Duration::from_millis(1000));
    let slow = slow.await.expect("the call");
    assert_eq!(code_of(&slow), Some("upstream_unavailable"), "{slow:?}");
    assert!(text_of(&slow).contains("did not answer within 1000 ms"), "{slow:?}");
    let starts = std::fs::read_to_string(&started).expect("marker").lines().count();
    assert_eq!(starts, 1, "sent once, and not again before the refusal");
}

#[tokio::test]
async fn many_downstream_sessions_share_one_upstream_session_and_child() {
    let toml = "[loop_detection]\nenabled = false\n[proxy]\nupstream_sessions = \"shared\"\n";
    let proxy = Proxy::start(toml, command(fastmcp(&[]))).await;
    let child = proxy.app.proxied().expect("a proxy").link().child_pid().expect("a child");
    let mut sessions = Vec::new();
    for _ in 0..10 {
        sessions.push(proxy.client(None).await);
    }
    for session in &sessions {
        let pid = text_of(&call(session, "pid", json!({})).await);
        assert_eq!(pid, child.to_string(), "every session reaches the one child");
    }
    assert_eq!(proxy.app.proxied().expect("a proxy").link().child_pid(), Some(child), "and no other was started");
}

#[tokio::test]
async fn an_http_upstream_that_goes_down_is_unavailable_then_served_again_when_it_is_back() {
    let port = free_port();
    let (python, args) = fastmcp(&["http", &port.to_string()]);
    let server = serve_http(&python, &args, port).await;
    let target = Target::Http { url: format!("http://127.0.0.1:{port}/mcp"), headers: Vec::new() };
    let proxy = Proxy::start("[loop_detection]\nenabled = false\n[upstream]\nbreaker_failures = 1\n", target).await;
    let client = proxy.client(None).await;
    assert_eq!(text_of(&call(&client, "add", json!({"a": 1, "b": 1})).await), "2");

    drop(server); // killed (kill_on_drop), its port closed
    let unavailable = |a: &CallToolResult| code_of(a) == Some("upstream_unavailable");
    let refused = answer_when(&client, "add", json!({"a": 1, "b": 2}), Duration::from_secs(20), unavailable).await;
    assert!(refused.structured_content.as_ref().expect("structured")["error"]["retry_after_ms"].as_u64() > Some(0));

    // Back on the same port, a new process with no memory of the proxy's session: once the
    // cool-down has passed (on the proxy's clock), a probe goes through and calls are served.
    let _back = serve_http(&python, &args, port).await;
    let served = eventually_some("served again", Duration::from_secs(30), || async {
        proxy.clock.advance(Duration::from_secs(60));
        Some(call(&client, "add", json!({"a": 2, "b": 2})).await).filter(|a| a.is_error != Some(true))
    })
    .await;
    assert_eq!(text_of(&served), "4");
}

#[tokio::test]
async fn a_tenants_spend_cap_warns_then_refuses_a_proxied_tool_and_a_reload_reprices_it() {
    let (a, b) = ("tenant-key-a-0123456789abcdef", "tenant-key-b-0123456789abcdef");
    let toml = |cost: u64| {
        format!(
            "[spend_caps]\ndaily_units = 10\nwarn_at_percent = 80\n[tools.add]\ncost = {cost}\n\
             [loop_detection]\nenabled = false\n\
             [auth]\nkeys = [{{ sha256 = \"{}\", tenant = \"acme\" }}, {{ sha256 = \"{}\", tenant = \"acme\" }}]\n",
            sha256_hex(a),
            sha256_hex(b)
        )
    };
    let proxy = Proxy::start(&toml(4), command(fastmcp(&[]))).await;
    let (first, second) = (proxy.client(Some(a)).await, proxy.client(Some(b)).await);
    assert_eq!(text_of(&call(&first, "add", json!({"a": 1, "b": 1})).await), "2", "4 of the tenant's 10");
    let warned = call(&second, "add", json!({"a": 1, "b": 2})).await;
    assert_eq!(text_of(&warned), "3", "the proxied server's content, unchanged: {warned:?}");
    let warnings = &warned.meta.as_ref().expect("_meta").0["io.github.mcp-ratelimit/warnings"];
    assert_eq!(
        (warnings[0]["scope"].clone(), warnings[0]["percent_used"].clone()),
        (json!("spend:tenant:acme"), json!(80))
    );
    let refused = call(&first, "add", json!({"a": 1, "b": 3})).await;
    assert_eq!(code_of(&refused), Some("rate_limited"), "{refused:?}");
    let error = &refused.structured_content.as_ref().expect("structured")["error"];
    assert_eq!(error["scope"], "spend:tenant:acme", "the tenant's two keys share one cap: {error}");
    assert_eq!(error["remaining"], 2, "8 of 10 spent, and a call costs 4: {error}");

    // A reload reprices the proxied tool for the next tools/list and the next call.
    let cheaper = Config::from_toml(&toml(1), &Catalogue::learned()).expect("valid");
    proxy.app.state().reload(&cheaper);
    let tools = first.list_all_tools().await.expect("tools");
    let add = tools.iter().find(|t| t.name == "add").expect("add");
    assert!(add.description.as_deref().is_some_and(|d| d.ends_with("Costs 1 token.")), "{add:?}");
    assert_eq!(text_of(&call(&first, "add", json!({"a": 1, "b": 4})).await), "5", "9 of 10 at cost 1");
}

#[tokio::test]
async fn a_proxied_tool_priced_by_its_arguments_is_settled_to_the_usage_it_reports() {
    let key = "pricing-key-0123456789abcdef";
    let toml = format!(
        "[tools.transcribe]\ncost = \"seconds / 5\"\ncost_max = 20\nsettle = \"usage\"\n[tools.add]\ncost = 3\n\
         [limits.caller]\nburst = 50\nrefill_per_sec = 0.001\n\
         [auth]\nkeys = [{{ sha256 = \"{}\", tenant = \"acme\" }}]\n",
        sha256_hex(key)
    );
    let proxy = Proxy::start(&toml, command(fastmcp(&[]))).await;
    let client = proxy.client(Some(key)).await;
    // 60 seconds: 12 reserved; the server bills 6, and says so: 6 come back.
    let done = call(&client, "transcribe", json!({"seconds": 60})).await;
    let structured = done.structured_content.as_ref().expect("its own structured content");
    assert_eq!(structured["text"], "60 seconds transcribed", "{done:?}");
    assert_eq!(structured.get("reserved"), None, "the proxied server's structured content is left as it was");
    let meta = &done.meta.as_ref().expect("the price moved: _meta says so").0;
    let said = (meta["io.github.mcp-ratelimit/reserved"].clone(), meta["io.github.mcp-ratelimit/charged"].clone());
    assert_eq!(said, (json!(12), json!(6)), "{meta:?}");
    assert_eq!(meta["usage"], json!({"units": 6}), "its own _meta kept: {meta:?}");
    // A tool that reports nothing keeps its fixed price, and its answer is passed through unchanged.
    let added = call(&client, "add", json!({"a": 1, "b": 2})).await;
    let straight = call(&direct(fastmcp(&[])).await, "add", json!({"a": 1, "b": 2})).await;
    assert_eq!(serde_json::to_value(&added).expect("json"), serde_json::to_value(&straight).expect("json"));
    // 50 - 6 - 3 = 41 left: 13 more calls at 3, then 2 left.
    let mut passed = 0;
    let refused = loop {
        let r = call(&client, "add", json!({"a": passed, "b": 100})).await;
        if r.is_error == Some(true) {
            break r;
        }
        passed += 1;
    };
    assert_eq!(passed, 13, "{refused:?}");
    assert_eq!(refused.structured_content.as_ref().expect("structured")["error"]["remaining"], 2, "{refused:?}");
}

#[tokio::test]
async fn the_dashboard_and_metrics_show_the_proxied_server_and_its_refusals() {
    let toml = "[proxy]\nmax_in_flight = 7\n";
    let proxy = Proxy::start(toml, command(fastmcp(&[]))).await;
    let client = proxy.client(None).await;
    for _ in 0..5 {
        call(&client, "add", json!({"a": 3, "b": 3})).await;
    }
    let base = proxy.url.trim_end_matches("/mcp").to_owned();
    let data: Value = reqwest::get(format!("{base}/dashboard/data")).await.expect("data").json().await.expect("json");
    assert_eq!(data["jobs"]["account_max"], 7, "the proxied server's slots: {data}");
    assert_eq!(data["breaker"]["state"], "closed", "{data}");
    assert!(data.to_string().contains("loop_detected"), "the fifth call's refusal is on the dashboard: {data}");
    let metrics = reqwest::get(format!("{base}/metrics")).await.expect("metrics").text().await.expect("text");
    assert!(metrics.contains(r#"tool="add""#) && metrics.contains("loop_detected"), "{metrics}");
}

/// How another call's request answered `result` (`coalesced`, `cached`), as its `_meta` says.
fn reused(result: &CallToolResult) -> Option<&'static str> {
    let said = |how: &str| {
        let key = format!("io.github.mcp-ratelimit/{how}");
        result.meta.as_ref().is_some_and(|m| m.0.get(&key) == Some(&json!(true)))
    };
    ["coalesced", "cached"].into_iter().find(|how| said(how))
}

#[tokio::test]
async fn identical_calls_of_one_tenant_share_one_request_to_the_proxied_server_never_another_tenants() {
    let acme: Vec<String> = (0..10).map(|i| format!("acme-coalesce-{i:02}-0123456789")).collect();
    let globex = "globex-coalesce-0123456789abc";
    let mut toml = "[tools.wait_for]\ncost = 1\ncoalesce = \"tenant\"\n".to_owned();
    for key in &acme {
        toml += &format!("[[auth.keys]]\nsha256 = \"{}\"\ntenant = \"acme\"\n", sha256_hex(key));
    }
    toml += &format!("[[auth.keys]]\nsha256 = \"{}\"\ntenant = \"globex\"\n", sha256_hex(globex));
    let proxy = Proxy::start(&toml, command(fastmcp(&[]))).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let release = dir.path().join("release");
    let path = release.to_string_lossy().into_owned();
    let mut calls = Vec::new();
    for key in acme.iter().map(String::as_str).chain([globex]) {
        let (client, path) = (proxy.client(Some(key)).await, path.clone());
        calls.push(tokio::spawn(async move { call(&client, "wait_for", json!({"path": path})).await }));
    }
    let saved = || proxy.app.state().limits.reuse().saved().coalesced;
    eventually("nine of acme's calls wait for the first one's request", || async { saved() == 9 }).await;
    std::fs::write(&release, "go").expect("release");
    let mut answers = Vec::new();
    for call in calls {
        answers.push(call.await.expect("the call"));
    }
    assert!(answers.iter().all(|a| text_of(a) == "released"), "eleven answers: {answers:?}");
    let started = std::fs::read_to_string(dir.path().join("release.started")).expect("started");
    assert_eq!(started.lines().count(), 2, "one request for acme's ten, one for globex's");
    assert_eq!(answers.iter().filter(|a| reused(a) == Some("coalesced")).count(), 9);
    assert_eq!(reused(&answers[10]), None, "globex's call was its own");
}

/// Calls of `tool` with each of `args` at once from `client`; their answers, in order.
fn at_once(client: &Arc<Client>, tool: &str, args: Vec<Value>) -> Vec<tokio::task::JoinHandle<CallToolResult>> {
    args.into_iter()
        .map(|args| {
            let (client, tool) = (client.clone(), tool.to_owned());
            tokio::spawn(async move { call(&client, &tool, args).await })
        })
        .collect()
}

/// Waits (bounded) until `wait_for` calls on `path` have started `n` times in all.
async fn started(path: &Path, n: usize) {
    let marker = PathBuf::from(format!("{}.started", path.display()));
    let what = format!("{n} calls started on {}", path.display());
    eventually_some(&what, Duration::from_secs(12), || async {
        let lines = std::fs::read_to_string(&marker).map(|t| t.lines().count()).unwrap_or(0);
        (lines >= n).then_some(())
    })
    .await;
}

#[tokio::test]
async fn with_proxy_adaptive_one_slow_call_closes_the_door_on_nobody() {
    // The attack as it was reproduced: a made-up key's one call slower than the timeout, then a
    // configured tenant's four calls at once.
    let key = "adaptive-key-0123456789abcdef";
    let toml = format!(
        "[proxy]\ntimeout_ms = 1500\n[proxy.adaptive]\nenabled = true\n[loop_detection]\nenabled = false\n\
         [auth]\nkeys = [{{ sha256 = \"{}\", tenant = \"acme\" }}]\n",
        sha256_hex(key)
    );
    let proxy = Proxy::start(&toml, command(fastmcp(&[]))).await;
    let slots = || proxy.app.state().behind.slots();
    assert_eq!(slots(), 16, "it starts at the ceiling, proxy.max_in_flight");
    let dir = tempfile::tempdir().expect("tempdir");
    let never = dir.path().join("never");
    let made_up = Arc::new(proxy.client(Some("made-up-key-nobody-configured")).await);
    let slow = at_once(&made_up, "wait_for", vec![json!({"path": never.to_string_lossy()})]);
    started(&never, 1).await;
    proxy.clock.advance(Duration::from_millis(1500));
    for slow in slow {
        let slow = slow.await.expect("the slow call");
        assert_eq!(code_of(&slow), Some("upstream_unavailable"), "{slow:?}");
        assert!(text_of(&slow).contains("did not answer within 1500 ms"), "{slow:?}");
    }
    assert_eq!(slots(), 16, "one slow call, with nothing else running, teaches nothing");

    // A configured caller's own slow call, alone: nothing either.
    let tenant = Arc::new(proxy.client(Some(key)).await);
    let alone = dir.path().join("alone");
    let slow = at_once(&tenant, "wait_for", vec![json!({"path": alone.to_string_lossy()})]);
    started(&alone, 1).await;
    proxy.clock.advance(Duration::from_millis(1500));
    assert_eq!(code_of(&slow.into_iter().next().expect("one").await.expect("answered")), Some("upstream_unavailable"));
    assert_eq!(slots(), 16, "a lone sample says nothing of how many calls it takes");

    // The tenant's four calls run at once, and are all answered.
    let release = dir.path().join("release");
    let four = at_once(&tenant, "wait_for", vec![json!({"path": release.to_string_lossy()}); 4]);
    started(&release, 4).await;
    std::fs::write(&release, "go").expect("release");
    for answer in four {
        assert_eq!(text_of(&answer.await.expect("an answer")), "released");
    }
    assert_eq!(slots(), 16);
}

#[tokio::test]
async fn with_proxy_adaptive_time_outs_while_others_run_cut_by_the_ratio_once_and_only_a_configured_callers() {
    let key = "adaptive-key-0123456789abcdef";
    let toml = format!(
        "[proxy]\nmax_in_flight = 10\ntimeout_ms = 1000\n[proxy.adaptive]\nenabled = true\nbackoff_ratio = 0.5\n\
         [loop_detection]\nenabled = false\n[auth]\nkeys = [{{ sha256 = \"{}\" }}]\n",
        sha256_hex(key)
    );
    let proxy = Proxy::start(&toml, command(fastmcp(&[]))).await;
    let slots = || proxy.app.state().behind.slots();
    let dir = tempfile::tempdir().expect("tempdir");
    let (never, later) = (dir.path().join("never"), dir.path().join("later"));

    // An unverified caller's calls time out while another runs: they may be slow on purpose.
    let made_up = Arc::new(proxy.client(Some("made-up-key-nobody-configured")).await);
    let slow = at_once(&made_up, "wait_for", vec![json!({"path": never.to_string_lossy()}); 2]);
    started(&never, 2).await;
    proxy.clock.advance(Duration::from_millis(1000));
    for slow in slow {
        assert_eq!(code_of(&slow.await.expect("answered")), Some("upstream_unavailable"));
    }
    assert_eq!(slots(), 10, "no unverified caller's time-out shrinks the limit every caller shares");

    // A configured caller's three at once, all past the timeout: one cut (a round), by the ratio.
    let client = Arc::new(proxy.client(Some(key)).await);
    let slow = at_once(&client, "wait_for", vec![json!({"path": later.to_string_lossy()}); 3]);
    started(&later, 3).await;
    proxy.clock.advance(Duration::from_millis(1000));
    for slow in slow {
        assert_eq!(code_of(&slow.await.expect("answered")), Some("upstream_unavailable"));
    }
    assert_eq!(slots(), 5, "10 × 0.5, once: never down to the 2 others running, nor cut three times");
    let gauge = common::metric_sum(&proxy_metrics(&proxy).await, "mcp_ratelimit_upstream_concurrency_limit");
    assert_eq!(gauge, 5.0, "the learnt limit is a gauge");
}

/// Without a turn within the timeout, a call is never sent: it says so, and its price comes back.
#[tokio::test]
async fn a_call_that_waited_the_timeout_for_a_turn_says_it_was_never_sent_and_costs_nothing() {
    // A configured caller (an unverified one has no share of a single slot), with a budget for
    // two calls of 7, refilling nothing meanwhile.
    let key = "queued-key-0123456789abcdef";
    let toml = format!(
        "[proxy]\nmax_in_flight = 1\ntimeout_ms = 1000\n[tools.wait_for]\ncost = 7\n[tools.add]\ncost = 7\n\
         [limits.caller]\nalgorithm = \"token_bucket\"\nburst = 14\nrefill_per_sec = 0.0001\n\
         [loop_detection]\nenabled = false\n[auth]\nkeys = [{{ sha256 = \"{}\" }}]\n",
        sha256_hex(key)
    );
    let proxy = Proxy::start(&toml, command(fastmcp(&[]))).await;
    let client = Arc::new(proxy.client(Some(key)).await);
    let dir = tempfile::tempdir().expect("tempdir");
    let (first, second) = (dir.path().join("first"), dir.path().join("second"));
    let running = at_once(&client, "wait_for", vec![json!({"path": first.to_string_lossy()})]);
    started(&first, 1).await;
    let waiting = at_once(&client, "wait_for", vec![json!({"path": second.to_string_lossy()})]);
    eventually("the second call waits its turn", || async {
        common::metric_sum(&proxy_metrics(&proxy).await, "mcp_ratelimit_queue_depth") == 1.0
    })
    .await;
    proxy.clock.advance(Duration::from_millis(1000));
    let never_sent = waiting.into_iter().next().expect("one").await.expect("answered");
    assert_eq!(code_of(&never_sent), Some("busy"), "{never_sent:?}");
    let said = text_of(&never_sent);
    assert!(said.contains("waited 1 second for its 1 call in flight to finish and was never sent"), "{said}");
    assert!(said.contains("its price was given back"), "{said}");
    assert!(!PathBuf::from(format!("{}.started", second.display())).exists(), "the proxied server never heard of it");
    // The first, sent, had the proxied server's own time, and timed out: it stays charged.
    let first_answer = running.into_iter().next().expect("one").await.expect("answered");
    assert!(text_of(&first_answer).contains("did not answer within 1000 ms"), "{first_answer:?}");
    // 14 - 7 (sent, charged) - 7 (never sent, given back) + 7: one more call of 7 passes, and no other.
    let sum = call(&client, "add", json!({"a": 1, "b": 2})).await;
    assert_eq!(sum.content.first().and_then(|c| c.as_text()).map(|t| t.text.as_str()), Some("3"), "the 7 came back");
    let refused = call(&client, "add", json!({"a": 2, "b": 2})).await;
    assert_eq!(code_of(&refused), Some("rate_limited"), "{refused:?}");
}

pub(crate) async fn proxy_metrics(proxy: &Proxy) -> String {
    let url = proxy.url.replace("/mcp", "/metrics");
    reqwest::get(url).await.expect("metrics").text().await.expect("text")
}

/// The proxy binary over stdio in front of `everything`, started with `env` added to (and
/// `MCP_RL__…` of the test's own environment removed from) what the test runs with, and the
/// config file `toml`.
async fn proxy_binary_with_env(toml: &str, env: &[(&str, &str)]) -> (Client, tempfile::NamedTempFile) {
    let mut file = tempfile::NamedTempFile::new().expect("config");
    std::io::Write::write_all(&mut file, toml.as_bytes()).expect("write");
    let (node, args) = everything("stdio");
    let proxy = tokio::process::Command::new(env!("CARGO_BIN_EXE_mcp-ratelimit")).configure(|c| {
        c.arg("proxy").arg("--stdio").arg("--config").arg(file.path()).arg("--").arg(&node).args(&args);
        c.envs(env.iter().copied()).env("RUST_LOG", "warn");
    });
    let client = ().serve(TokioChildProcess::new(proxy).expect("the proxy starts")).await.expect("handshake");
    (client, file)
}

#[tokio::test]
async fn a_stdio_child_gets_none_of_the_proxys_secrets_only_what_the_operator_names() {
    // Every secret the README says to set in the environment, and an ordinary one nobody named.
    let secrets = [
        ("MCP_RL__ADMIN__KEY", "admin-key-secret-0123456789"),
        ("MCP_RL__AUTH__ID_SECRET", "id-secret-secret-0123456789"),
        ("MCP_RL__UPSTREAM__API_KEY", "paid-api-key-secret-0123"),
        ("MCP_RL__STORE__REDIS_URL", "redis://:redis-password-secret@127.0.0.1:6379"),
        ("MCP_RL__PROXY__HEADERS__AUTHORIZATION", "Bearer header-secret-0123"),
        ("AWS_SECRET_ACCESS_KEY", "aws-secret-not-named-0123"),
    ];
    let named = [("PASSED_THROUGH", "inherited-value-0123"), ("LC_TIME", "C")];
    let toml = "[proxy]\ninherit_env = [\"PASSED_THROUGH\"]\n[proxy.env]\nSET_BY_OPERATOR = \"set-value-0123\"\n";
    let env: Vec<(&str, &str)> = secrets.iter().chain(&named).copied().collect();
    let (client, _file) = proxy_binary_with_env(toml, &env).await;
    let seen = text_of(&call(&client, "get-env", json!({})).await);
    let child: serde_json::Map<String, Value> = serde_json::from_str(&seen).expect("get-env answers the child's env");
    for (name, value) in secrets {
        assert!(!seen.contains(value), "{name}'s value reached the child: {seen}");
    }
    assert!(child.keys().all(|name| !name.to_ascii_uppercase().starts_with("MCP_RL__")), "{seen}");
    assert_eq!(child.get("PASSED_THROUGH"), Some(&json!("inherited-value-0123")), "inherit_env: {seen}");
    assert_eq!(child.get("SET_BY_OPERATOR"), Some(&json!("set-value-0123")), "[proxy.env]: {seen}");
    assert_eq!(child.get("LC_TIME"), Some(&json!("C")), "the locale: {seen}");
    assert_eq!(child.get("PATH").and_then(Value::as_str), std::env::var("PATH").ok().as_deref(), "{seen}");
    let mut names: Vec<&str> = child.keys().map(String::as_str).collect();
    names.retain(|n| {
        !["PATH", "HOME", "USER", "LOGNAME", "SHELL", "TERM", "TMPDIR", "TZ", "LANG", "LANGUAGE"].contains(n)
    });
    names.retain(|n| !n.starts_with("LC_") && !["PASSED_THROUGH", "SET_BY_OPERATOR"].contains(n));
    assert_eq!(names, Vec::<&str>::new(), "nothing else: {seen}");
}

#[test]
fn the_childs_environment_is_checked_and_its_values_are_in_no_debug_string() {
    let learned = Catalogue::learned();
    for (toml, key) in [
        ("[proxy]\ninherit_env = [\"PATH\", \"MCP_RL__ADMIN__KEY\"]\n", "proxy.inherit_env[1]"),
        ("[proxy]\ninherit_env = [\"mcp_rl__store__redis_url\"]\n", "proxy.inherit_env[0]"),
        ("[proxy.env]\nMCP_RL__UPSTREAM__API_KEY = \"x\"\n", "proxy.env.MCP_RL__UPSTREAM__API_KEY"),
        ("[proxy.env]\n\"A=B\" = \"x\"\n", "proxy.env.A=B"),
        ("[proxy]\ninherit_env = [\"\"]\n", "proxy.inherit_env[0]"),
    ] {
        let error = Config::from_toml(toml, &learned).expect_err(toml);
        assert!(error.to_string().contains(key), "{toml}: {error}");
    }
    let toml = "[proxy]\ninherit_env = [\"GITHUB_TOKEN\"]\n[proxy.env]\nAPI_TOKEN = \"value-never-printed\"\n";
    let config = Config::from_toml(toml, &learned).expect("valid");
    let target = Target::of(&config.proxy, None, vec!["some-server".into()]).expect("a command");
    for shown in [format!("{config:?}"), format!("{target:?}"), format!("{:?}", config.proxy)] {
        assert!(!shown.contains("value-never-printed"), "{shown}");
        assert!(shown.contains("API_TOKEN") && shown.contains("GITHUB_TOKEN"), "the names are shown: {shown}");
    }
}

#[tokio::test]
async fn python_clients_of_both_eras_read_every_answer_the_proxy_passes_on_from_stdio_and_http_upstreams() {
    let (_server, http) = everything_over_http().await;
    // get-sum's own budget of one call a minute: the second is refused, a result the agent reads.
    let toml = "[tools.get-sum]\ncost = 1\n[tools.get-sum.budget]\nalgorithm = \"fixed_window\"\nlimit = 1\nwindow_ms = 60000\n";
    for (upstream, target) in [("stdio", command(everything("stdio"))), ("http", http)] {
        let proxy = Proxy::start(toml, target).await;
        // Legacy again after auto: a 2026-07-28 caller leaves the proxy's one upstream session as it was.
        for mode in ["legacy", "auto", "legacy"] {
            let steps = json!([
                {"op": "list_tools"},
                {"op": "call", "tool": "echo", "args": {"message": "hi"}},
                {"op": "call", "tool": "get-structured-content", "args": {"location": "New York"}},
                {"op": "call", "tool": "get-sum", "args": {"a": 1, "b": 2}},
                {"op": "call", "tool": "get-sum", "args": {"a": 2, "b": 2}},
                {"op": "list_resources"},
                {"op": "read", "uri": "demo://resource/static/document/features.md"},
                {"op": "list_prompts"},
                {"op": "prompt", "name": "args-prompt", "args": {"city": "Paris"}},
                {"op": "complete", "prompt": "completable-prompt", "argument": "department", "value": "E"},
            ]);
            let walked = python::walk(&proxy.url, mode, steps, &[]).await;
            let at = format!("{mode} client, {upstream} upstream: {walked}");
            assert_eq!(walked["protocol_version"], python::era_of(mode), "{at}");
            let steps = walked["steps"].as_array().expect("steps");
            assert!(steps.iter().all(|s| s.get("ok").is_some()), "every answer valid for the client's era: {at}");
            assert_eq!(steps[1]["ok"]["text"], "Echo: hi", "{at}");
            assert!(steps[2]["ok"]["structured"]["conditions"].is_string(), "{at}");
            assert_eq!(steps[3]["ok"]["text"], "The sum of 1 and 2 is 3.", "{at}");
            assert_eq!(steps[4]["ok"]["is_error"], true, "{at}");
            assert_eq!(steps[4]["ok"]["structured"]["error"]["code"], "rate_limited", "{at}");
            assert!(steps[8]["ok"].to_string().contains("Paris"), "{at}");
            assert!(steps[9]["ok"]["completion"]["values"].to_string().contains("Engineering"), "{at}");
            proxy.clock.advance(Duration::from_secs(60));
        }
    }
}

/// An rmcp client that speaks 2026-07-28 (stateless, `server/discover`) to `url`.
async fn modern_client(url: &str) -> Client {
    use rmcp::{ClientLifecycleMode, ClientServiceExt};
    let transport = StreamableHttpClientTransport::from_config(StreamableHttpClientTransportConfig::with_uri(url));
    let preferred_versions = vec![rmcp::model::ProtocolVersion::V_2026_07_28];
    ().serve_with_lifecycle(transport, ClientLifecycleMode::Discover { preferred_versions })
        .await
        .expect("a 2026-07-28 client connects")
}

#[tokio::test]
async fn an_rmcp_client_speaking_2026_07_28_gets_results_that_say_their_type() {
    let toml = "[tools.get-sum]\ncost = 1\n[tools.get-sum.budget]\nalgorithm = \"fixed_window\"\nlimit = 1\nwindow_ms = 60000\n";
    let proxy = Proxy::start(toml, command(everything("stdio"))).await;
    let client = modern_client(&proxy.url).await;
    let version = client.peer_info().map(|info| info.protocol_version.clone());
    assert_eq!(version, Some(rmcp::model::ProtocolVersion::V_2026_07_28));
    let complete = Some(rmcp::model::ResultType::COMPLETE);
    let echo = call(&client, "echo", json!({"message": "modern"})).await;
    assert_eq!((text_of(&echo), echo.result_type.clone()), ("Echo: modern".to_owned(), complete.clone()));
    assert_eq!(call(&client, "get-sum", json!({"a": 1, "b": 2})).await.result_type, complete);
    let refused = call(&client, "get-sum", json!({"a": 2, "b": 2})).await;
    assert_eq!((code_of(&refused), refused.result_type.clone()), (Some("rate_limited"), complete.clone()));
    let listed = client.list_resources(None).await.expect("resources");
    assert_eq!(listed.result_type, complete);
    let read = client.read_resource(ReadResourceRequestParams::new("demo://resource/static/document/features.md"));
    assert_eq!(read.await.expect("read").result_type, complete);
    assert_eq!(client.list_prompts(None).await.expect("prompts").result_type, complete);
}

#[tokio::test]
async fn a_cached_answer_passes_on_unchanged_and_says_so_in_meta_for_clients_that_check_its_schema() {
    // `get-structured-content` declares an outputSchema with `additionalProperties: false`.
    let toml = "[tools.get-structured-content]\ncost = 1\ncache_ttl_ms = 60000\n";
    let proxy = Proxy::start(toml, command(everything("stdio"))).await;
    let ask = json!({"op": "call", "tool": "get-structured-content", "args": {"location": "Chicago"}});
    for mode in ["legacy", "auto"] {
        let walked = python::walk(&proxy.url, mode, json!([ask, ask]), &[]).await;
        let steps = &walked["steps"];
        assert!(steps[0].get("ok").is_some() && steps[1].get("ok").is_some(), "{mode}: {walked}");
        assert_eq!(steps[1]["ok"]["structured"], steps[0]["ok"]["structured"], "unchanged: {walked}");
        assert_eq!(steps[1]["ok"]["meta"]["io.github.mcp-ratelimit/cached"], true, "{mode}: {walked}");
    }
    let client = proxy.client(None).await;
    let first = call(&client, "get-structured-content", json!({"location": "Los Angeles"})).await;
    let second = call(&client, "get-structured-content", json!({"location": "Los Angeles"})).await;
    assert_eq!((reused(&first), reused(&second)), (None, Some("cached")), "{first:?}\n{second:?}");
    assert_eq!(second.structured_content, first.structured_content, "structuredContent unchanged");
    assert_eq!(second.content, first.content, "content unchanged");
}

#[tokio::test]
async fn a_caller_cannot_price_its_own_call_through_a_tool_that_echoes_it() {
    // echo_back answers its argument as structuredContent; echo_meta as _meta. Both cost 5: a
    // caller's `usage.units: 0` in either is not a price. echo_back is even trusted to bill
    // (`settle = "usage"`), but only a `_meta` report is read.
    let toml = "[tools.echo_back]\ncost = 5\nsettle = \"usage\"\n[tools.echo_meta]\ncost = 5\n\
                [limits.caller]\nburst = 17\nrefill_per_sec = 0.001\n";
    let proxy = Proxy::start(toml, command(fastmcp(&[]))).await;
    let client = proxy.client(None).await;
    let free = json!({"usage": {"units": 0}});
    let echoed = call(&client, "echo_back", json!({"value": free})).await;
    assert_eq!(echoed.structured_content, Some(free.clone()), "its answer, unchanged: {echoed:?}");
    let echoed = call(&client, "echo_meta", json!({"meta": free})).await;
    let meta = &echoed.meta.as_ref().expect("its _meta").0;
    assert_eq!(meta["usage"], free["usage"], "its own _meta, unchanged: {echoed:?}");
    assert_eq!(meta.get("io.github.mcp-ratelimit/charged"), None, "charged as reserved: {echoed:?}");
    // Nor can a server (or a caller through it) speak for the proxy in _meta.
    let forged = call(&client, "echo_meta", json!({"meta": {"io.github.mcp-ratelimit/charged": 0, "own": 1}})).await;
    let meta = &forged.meta.as_ref().expect("its _meta").0;
    assert_eq!((meta.get("io.github.mcp-ratelimit/charged"), meta.get("own")), (None, Some(&json!(1))), "{meta:?}");
    let refused = call(&client, "echo_back", json!({"value": {"again": true}})).await;
    assert_eq!(code_of(&refused), Some("rate_limited"), "15 of 17 spent: {refused:?}");
    assert_eq!(refused.structured_content.as_ref().expect("structured")["error"]["remaining"], 2);
}

#[tokio::test]
async fn a_proxied_call_never_sent_is_charged_nothing_though_its_tool_settles_at_its_reservation() {
    let key = "never-sent-key-0123456789abcdef";
    let toml = format!(
        "[proxy]\nmax_in_flight = 1\ntimeout_ms = 1000\n[upstream]\nqueue_max = 4\n[tools.add]\ncost = 5\n\
         [limits.caller]\nburst = 10\nrefill_per_sec = 0.001\n[loop_detection]\nenabled = false\n\
         [auth]\nkeys = [{{ sha256 = \"{}\" }}]\n",
        sha256_hex(key)
    );
    let proxy = Proxy::start(&toml, command(fastmcp(&[]))).await;
    let client = Arc::new(proxy.client(Some(key)).await);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("never").to_string_lossy().into_owned();
    let holder = {
        let client = client.clone();
        tokio::spawn(async move { call(&client, "wait_for", json!({"path": path})).await })
    };
    wait_until_exists(&dir.path().join("never.started")).await;
    let waiting = {
        let client = client.clone();
        tokio::spawn(async move { call(&client, "add", json!({"a": 1, "b": 1})).await })
    };
    eventually("the add waits for the one slot", || async { proxy.app.state().behind.occupancy().waiting == 1 }).await;
    proxy.clock.advance(Duration::from_millis(1000));
    assert_eq!(code_of(&waiting.await.expect("the add")), Some("busy"), "never sent: waited for a slot in vain");
    assert_eq!(code_of(&holder.await.expect("wait_for")), Some("upstream_unavailable"), "sent, no answer");
    // 10 - 1 (wait_for, sent: its reservation stands) = 9: one more add at 5, then 4 left.
    assert_eq!(text_of(&call(&client, "add", json!({"a": 2, "b": 2})).await), "4");
    let refused = call(&client, "add", json!({"a": 3, "b": 3})).await;
    assert_eq!(refused.structured_content.as_ref().expect("structured")["error"]["remaining"], 4, "{refused:?}");
}

/// A small MCP server of the test's own (rmcp over streamable HTTP) that answers `research` with a
/// SEP-2663 task for a caller that speaks tasks, and answers `tasks/get` and `tasks/cancel` for
/// any id anyone names, as a server that trusts its one client (the proxy) would. While `working`
/// is set, every task it is asked about is still working.
#[derive(Clone, Default)]
struct Tasker {
    topics: Arc<std::sync::Mutex<std::collections::HashMap<String, String>>>,
    cancelled: Arc<std::sync::Mutex<Vec<String>>>,
    working: Arc<std::sync::atomic::AtomicBool>,
    asked: Arc<std::sync::atomic::AtomicU64>,
}

impl rmcp::ServerHandler for Tasker {
    fn get_info(&self) -> rmcp::model::ServerConfig {
        let capabilities = rmcp::model::ServerCapabilities::builder().enable_tools().enable_tasks().build();
        rmcp::model::ServerConfig::new(capabilities)
    }

    async fn list_tools(
        &self,
        _request: Option<rmcp::model::PaginatedRequestParams>,
        _context: rmcp::service::RequestContext<rmcp::RoleServer>,
    ) -> Result<rmcp::model::ListToolsResult, rmcp::ErrorData> {
        let Value::Object(schema) = json!({"type": "object", "properties": {"topic": {"type": "string"}}}) else {
            unreachable!("an object")
        };
        let research = rmcp::model::Tool::new("research", "Researches a topic, as a task", Arc::new(schema));
        Ok(rmcp::model::ListToolsResult::with_all_items(vec![research]))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: rmcp::service::RequestContext<rmcp::RoleServer>,
    ) -> Result<rmcp::model::CallToolResponse, rmcp::ErrorData> {
        let topic = request.arguments.and_then(|a| a.get("topic").cloned()).unwrap_or_default().to_string();
        if !context.client_capabilities().is_some_and(|c| c.supports_tasks()) {
            return Ok(CallToolResult::success(vec![rmcp::model::ContentBlock::text(topic)]).into());
        }
        let mut topics = self.topics.lock().expect("a lock nobody panicked holding");
        let id = format!("task-{}", topics.len() + 1);
        topics.insert(id.clone(), topic);
        let now = "2026-12-03T00:00:00Z";
        let task = rmcp::model::Task::new(id, rmcp::model::TaskStatus::Working, now, now).with_ttl_ms(60_000);
        Ok(rmcp::model::CallToolResponse::Task(rmcp::model::CreateTaskResult::new(task)))
    }

    async fn get_task(
        &self,
        request: rmcp::model::GetTaskParams,
        _context: rmcp::service::RequestContext<rmcp::RoleServer>,
    ) -> Result<rmcp::model::GetTaskResult, rmcp::ErrorData> {
        let unknown = || rmcp::ErrorData::invalid_params(format!("no task {}", request.task_id), None);
        let topic = self
            .topics
            .lock()
            .expect("a lock nobody panicked holding")
            .get(&request.task_id)
            .cloned()
            .ok_or_else(unknown)?;
        self.asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if self.working.load(std::sync::atomic::Ordering::SeqCst) {
            let now = "2026-12-03T00:00:01Z";
            let task = rmcp::model::Task::new(request.task_id, rmcp::model::TaskStatus::Working, now, now);
            return Ok(rmcp::model::GetTaskResult::new(rmcp::model::DetailedTask::new(
                task,
                rmcp::model::TaskPayload::Working,
            )));
        }
        let Value::Object(result) = json!({"content": [{"type": "text", "text": format!("findings on {topic}")}]})
        else {
            unreachable!("an object")
        };
        let now = "2026-12-03T00:00:01Z";
        let task = rmcp::model::Task::new(request.task_id, rmcp::model::TaskStatus::Completed, now, now);
        let payload = rmcp::model::TaskPayload::Completed { result };
        Ok(rmcp::model::GetTaskResult::new(rmcp::model::DetailedTask::new(task, payload)))
    }

    async fn cancel_task(
        &self,
        request: rmcp::model::CancelTaskParams,
        _context: rmcp::service::RequestContext<rmcp::RoleServer>,
    ) -> Result<(), rmcp::ErrorData> {
        self.cancelled.lock().expect("a lock nobody panicked holding").push(request.task_id);
        Ok(())
    }
}

/// Serves `server` over streamable HTTP on a free loopback port; its `/mcp` URL.
pub(crate) async fn serve_in_test<S: rmcp::ServerHandler + Clone + Send + Sync + 'static>(server: S) -> String {
    use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
    use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
    let mcp = StreamableHttpService::new(
        move || Ok(server.clone()),
        LocalSessionManager::default().into(),
        StreamableHttpServerConfig::default(),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}/mcp", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, axum::Router::new().nest_service("/mcp", mcp)).await });
    url
}

/// A tool of a 2026-07-28 server that asks its caller for input, through the proxy: the proxy's
/// own client speaks 2026-07-28 to that server (it asks with `server/discover`), the
/// `input_required` answer reaches a 2026-07-28 caller as the server gave it, and the call resumed
/// with the input is one call: charged once; replayed, charged as a new one.
#[tokio::test]
async fn a_call_a_2026_upstream_answers_input_required_is_resumed_through_the_proxy_as_one_call() {
    use crate::clients::{Booking, asked_state, completed, modern_client, round};
    let target = Target::Http { url: serve_in_test(Booking::unlimited().await).await, headers: Vec::new() };
    let toml = "[tools.book]\ncost = 5\n[limits.caller]\nalgorithm = \"token_bucket\"\nburst = 5\n\
                refill_per_sec = 0.0001\n[limits.address]\nalgorithm = \"token_bucket\"\nburst = 1000\n\
                refill_per_sec = 1\n[tiers]\nguest = 1.0\n";
    let proxy = Proxy::start(toml, target).await;
    let upstream = proxy.app.proxied().expect("a proxy").link().info().map(|i| i.protocol_version.clone());
    assert_eq!(upstream, Some(rmcp::model::ProtocolVersion::V_2026_07_28), "the proxy's client speaks 2026-07-28");
    let client = modern_client(&proxy.url, "traveller-through-the-proxy").await;
    let oslo = json!({"city": "Oslo"});
    let first = round(&client, "book", oslo.clone(), None).await;
    let state = asked_state(&first).unwrap_or_else(|| panic!("asked to confirm: {first:?}"));
    let booked = round(&client, "book", oslo.clone(), Some(&state)).await;
    let booked = completed(&booked).map(common::text);
    assert_eq!(booked, Some(format!("Oslo: booked ({state})")), "its 5 tokens paid once");
    let replayed = round(&client, "book", oslo, Some(&state)).await;
    let refused = completed(&replayed).and_then(common::error_code);
    assert_eq!(refused, Some("rate_limited"), "replayed, a new call: {replayed:?}");
}

/// A client that declares the tasks extension.
#[derive(Clone)]
struct SpeaksTasks;

impl rmcp::ClientHandler for SpeaksTasks {
    fn get_info(&self) -> rmcp::model::ClientConfig {
        let capabilities = rmcp::model::ClientCapabilities::builder().enable_tasks().build();
        rmcp::model::ClientConfig::new(capabilities, rmcp::model::Implementation::new("tasks-test", "1"))
    }
}

/// A 2026-07-28 client of `url` presenting `key` that declares the tasks extension.
async fn speaks_tasks(url: &str, key: &str) -> rmcp::service::RunningService<rmcp::RoleClient, SpeaksTasks> {
    use rmcp::{ClientLifecycleMode, ClientServiceExt};
    let config = StreamableHttpClientTransportConfig::with_uri(url).auth_header(key);
    let preferred_versions = vec![rmcp::model::ProtocolVersion::V_2026_07_28];
    SpeaksTasks
        .serve_with_lifecycle(
            StreamableHttpClientTransport::from_config(config),
            ClientLifecycleMode::Discover { preferred_versions },
        )
        .await
        .expect("a client that speaks tasks connects")
}

#[tokio::test]
async fn a_task_through_the_proxy_is_its_callers_and_unknown_to_any_other() {
    let upstream = Tasker::default();
    let target = Target::Http { url: serve_in_test(upstream.clone()).await, headers: Vec::new() };
    let (a, b) = ("tenant-a-task-key-0123456789", "tenant-b-task-key-0123456789");
    let toml = format!(
        "[tools.research]\ncost = 1\n[auth]\nkeys = [{{ sha256 = \"{}\", tenant = \"acme\" }}, \
         {{ sha256 = \"{}\", tenant = \"globex\" }}]\n",
        sha256_hex(a),
        sha256_hex(b)
    );
    let proxy = Proxy::start(&toml, target).await;
    let (alice, bob) = (speaks_tasks(&proxy.url, a).await, speaks_tasks(&proxy.url, b).await);
    let mut args = serde_json::Map::new();
    args.insert("topic".into(), json!("acme's merger"));
    let asked = alice.call_tool_once(CallToolRequestParams::new("research").with_arguments(args)).await;
    let Ok(rmcp::model::CallToolResponse::Task(created)) = asked else { panic!("a task: {asked:?}") };
    let id = created.task.task_id.clone();

    fn unknown<T>(answer: &Result<T, ServiceError>) -> bool {
        matches!(answer, Err(ServiceError::McpError(error)) if error.message.contains("unknown task"))
    }
    let read = bob.get_task(rmcp::model::GetTaskParams::new(id.clone())).await;
    assert!(unknown(&read), "another tenant reads nothing: {read:?}");
    let cancel = bob.cancel_task(rmcp::model::CancelTaskParams::new(id.clone())).await;
    assert!(unknown(&cancel), "nor cancels it: {cancel:?}");
    assert!(
        upstream.cancelled.lock().expect("a lock nobody panicked holding").is_empty(),
        "the proxied server never heard of bob's cancel"
    );
    let guessed = bob.get_task(rmcp::model::GetTaskParams::new("task-1")).await;
    assert!(unknown(&guessed), "an id no call of bob's made is unknown as well: {guessed:?}");

    let own = alice.get_task(rmcp::model::GetTaskParams::new(id.clone())).await.expect("alice's own task");
    let rmcp::model::TaskPayload::Completed { result } = &own.task.payload else { panic!("completed: {own:?}") };
    assert_eq!(result["content"][0]["text"], "findings on \"acme's merger\"", "{result:?}");
    alice.cancel_task(rmcp::model::CancelTaskParams::new(id.clone())).await.expect("alice cancels her own");
    assert_eq!(*upstream.cancelled.lock().expect("a lock nobody panicked holding"), vec![id]);
}

/// A call of a `holds_slot` tool the proxied server answers with a task keeps its caller's slot
/// (and its place to the proxied server) until the task is final — the proxy asks the server at
/// the task's poll interval — not until its handle came back.
#[tokio::test]
async fn a_proxied_task_holds_its_slot_until_it_is_final_not_until_its_handle_returns() {
    let upstream = Tasker::default();
    upstream.working.store(true, std::sync::atomic::Ordering::SeqCst);
    let target = Target::Http { url: serve_in_test(upstream.clone()).await, headers: Vec::new() };
    let toml = "[tools.research]\ncost = 1\nholds_slot = true\n[limits.in_flight]\ncaller = 1\n\
                [loop_detection]\nenabled = false\n";
    let proxy = Proxy::start(toml, target).await;
    let alice = speaks_tasks(&proxy.url, "alice-tasks-0123456789").await;
    let research = |topic: &str| {
        let args = json!({"topic": topic}).as_object().cloned().unwrap_or_default();
        alice.call_tool_once(CallToolRequestParams::new("research").with_arguments(args))
    };
    let busy = |answer: &Result<rmcp::model::CallToolResponse, ServiceError>| match answer {
        Ok(rmcp::model::CallToolResponse::Complete(done)) => code_of(done) == Some("busy"),
        _ => false,
    };
    let first = research("one").await;
    assert!(matches!(first, Ok(rmcp::model::CallToolResponse::Task(_))), "a task: {first:?}");
    let second = research("two").await;
    assert!(busy(&second), "the task holds the one slot: {second:?}");
    // A second later the proxy asks after the task: still working, still holding.
    let asked = upstream.asked.load(std::sync::atomic::Ordering::SeqCst);
    proxy.clock.advance(Duration::from_secs(1));
    eventually("the proxy asks after the task", || async {
        upstream.asked.load(std::sync::atomic::Ordering::SeqCst) > asked
    })
    .await;
    let third = research("three").await;
    assert!(busy(&third), "still working, still held: {third:?}");
    // Final: the next time it asks, the slot comes back.
    upstream.working.store(false, std::sync::atomic::Ordering::SeqCst);
    proxy.clock.advance(Duration::from_secs(1));
    eventually_some("the slot comes back once the task is final", Duration::from_secs(10), || async {
        matches!(research("four").await, Ok(rmcp::model::CallToolResponse::Task(_))).then_some(())
    })
    .await;

    // A tool that does not hold a slot gives its place to the proxied server back with the handle:
    // with one place, task after task is answered at once, none waiting for another to be final.
    let key = "bob-tasks-0123456789";
    let toml = format!(
        "[tools.research]\ncost = 1\n[proxy]\nmax_in_flight = 1\n[loop_detection]\nenabled = false\n\
         [auth]\nkeys = [{{ sha256 = \"{}\" }}]\n",
        sha256_hex(key)
    );
    let target = Target::Http { url: serve_in_test(upstream.clone()).await, headers: Vec::new() };
    upstream.working.store(true, std::sync::atomic::Ordering::SeqCst);
    let proxy = Proxy::start(&toml, target).await;
    let bob = speaks_tasks(&proxy.url, key).await;
    for topic in ["five", "six", "seven"] {
        let args = json!({"topic": topic}).as_object().cloned().unwrap_or_default();
        let asked = bob.call_tool_once(CallToolRequestParams::new("research").with_arguments(args));
        let answered = tokio::time::timeout(Duration::from_secs(10), asked).await;
        assert!(matches!(answered, Ok(Ok(rmcp::model::CallToolResponse::Task(_)))), "{topic}: {answered:?}");
    }
}

/// The process id of the proxied server `client`'s calls reach.
async fn pid(client: &Client) -> String {
    text_of(&call(client, "pid", json!({})).await)
}

/// With `proxy.upstream_sessions = "tenant"` (the default) in front of a stateful server (over
/// stdio, each child one client's state): what one tenant leaves in it another never reads, while
/// the callers of one tenant share it; no tenant takes the proxy's own child (the tools are learnt
/// on it), each tenant's child is opened by its first call; at most `proxy.max_children` are open, a
/// new scope refused `busy` while all are in use and given the place of one idle; and one idle for
/// `proxy.upstream_idle_seconds` is closed.
#[tokio::test]
async fn two_tenants_never_see_each_others_state_and_the_children_are_capped_and_closed_when_idle() {
    let keys =
        ["acme-one-0123456789abcdef", "acme-two-0123456789abcdef", "globex-0123456789abcdef", "initech-0123456789abc"];
    let toml = format!(
        "[loop_detection]\nenabled = false\n[proxy]\nmax_children = 2\nupstream_idle_seconds = 60\n[auth]\nkeys = [\
         {{ sha256 = \"{}\", tenant = \"acme\" }}, {{ sha256 = \"{}\", tenant = \"acme\" }}, \
         {{ sha256 = \"{}\", tenant = \"globex\" }}, {{ sha256 = \"{}\", tenant = \"initech\" }}]\n",
        sha256_hex(keys[0]),
        sha256_hex(keys[1]),
        sha256_hex(keys[2]),
        sha256_hex(keys[3])
    );
    let proxy = Proxy::start(&toml, command(fastmcp(&[]))).await;
    let own = proxy.app.proxied().expect("a proxy").link().child_pid().expect("the proxy's own child");
    let (alice, alice_too, bob) =
        (proxy.client(Some(keys[0])).await, proxy.client(Some(keys[1])).await, proxy.client(Some(keys[2])).await);
    assert_eq!(text_of(&call(&alice, "remember", json!({"value": "acme's secret"})).await), "remembered");
    assert_eq!(text_of(&call(&bob, "recall", json!({})).await), "", "another tenant reads nothing of acme's");
    assert_eq!(text_of(&call(&alice_too, "recall", json!({})).await), "acme's secret", "acme's callers share theirs");
    let (acme, globex) = (pid(&alice).await, pid(&bob).await);
    assert_eq!(pid(&alice_too).await, acme);
    assert_ne!(acme, own.to_string(), "the first tenant has a child of its own: the tools are learnt on the proxy's");
    assert_ne!(globex, acme, "another tenant, another child");
    // The official Python SDK of both eras (a 2026-07-28 caller has no session: its scope is its
    // tenant all the same): acme's callers read acme's, globex's read nothing of it.
    for mode in ["auto", "legacy"] {
        for (key, expected) in [(keys[1], "acme's secret"), (keys[2], "")] {
            let header = format!("Authorization: Bearer {key}");
            let steps = json!([{"op": "call", "tool": "recall", "args": {}}]);
            let walked = python::walk(&proxy.url, mode, steps, &["-H", &header]).await;
            assert_eq!(walked["protocol_version"], python::era_of(mode), "{walked}");
            assert_eq!(walked["steps"][0]["ok"]["text"], expected, "{mode}: {walked}");
        }
    }

    // Both children open and in use (alice's and bob's sessions live): a third tenant waits.
    let carol = proxy.client(Some(keys[3])).await;
    let refused = call(&carol, "pid", json!({})).await;
    assert_eq!(code_of(&refused), Some("busy"), "{refused:?}");
    assert_eq!(common::structured(&refused)["error"]["scope"], "proxy:max_children", "{refused:?}");
    let base = proxy.url.trim_end_matches("/mcp").to_owned();
    let data: Value = reqwest::get(format!("{base}/dashboard/data")).await.expect("data").json().await.expect("json");
    assert!(data.to_string().contains("proxy:max_children"), "the refusal is on the dashboard: {data}");
    // Bob leaves: his tenant's child is idle, and carol's takes its place.
    bob.cancel().await.expect("bob leaves");
    let initech = eventually_some("carol gets a child once bob's is idle", Duration::from_secs(10), || async {
        let answer = call(&carol, "pid", json!({})).await;
        (code_of(&answer).is_none()).then(|| text_of(&answer))
    })
    .await;
    assert!(initech != acme && initech != globex, "{initech}");
    // Idle for a minute (carol gone too), initech's child is closed; acme's, alice's session on
    // it, stays, and so does the proxy's own.
    carol.cancel().await.expect("carol leaves");
    let scopes = proxy.app.proxied().expect("a proxy").scopes().clone();
    eventually("carol's session is let go of", || async {
        proxy.clock.advance(Duration::from_secs(61));
        scopes.all().len() == 2
    })
    .await;
    assert_eq!(pid(&alice).await, acme, "acme's child was never closed");
}

/// A client that counts the tool list changes it is told of.
#[derive(Clone, Default)]
struct ToolsHeard(Arc<std::sync::atomic::AtomicUsize>);

impl rmcp::ClientHandler for ToolsHeard {
    async fn on_tool_list_changed(&self, _context: rmcp::service::NotificationContext<rmcp::RoleClient>) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// The tools every tenant is offered are learnt from the proxy's own session, which no caller over
/// HTTP ever takes: a made-up key that comes first, in front of a stateful server whose tool
/// `hide` drops another tool from its own process's list (and says so), changes only its own
/// child's list; a configured tenant who comes after still finds the tool listed and calls it.
#[tokio::test]
async fn a_made_up_key_that_comes_first_never_changes_the_tools_a_tenant_is_offered() {
    let key = "acme-0123456789abcdef";
    let toml = format!("[auth]\nkeys = [{{ sha256 = \"{}\", tenant = \"acme\" }}]\n", sha256_hex(key));
    let proxy = Proxy::start(&toml, command(fastmcp(&[]))).await;
    let own = proxy.app.proxied().expect("a proxy").link().child_pid().expect("the proxy's own child");
    let heard = ToolsHeard::default();
    let mut config = StreamableHttpClientTransportConfig::with_uri(proxy.url.clone());
    config = config.auth_header("made-up-0123456789abcdef");
    let stranger = heard.clone().serve(StreamableHttpClientTransport::from_config(config)).await.expect("connects");
    assert_eq!(text_of(&call(&stranger, "hide", json!({"name": "add"})).await), "hid add");
    // Its child said its list changed: the proxy learnt the tools again, then told every session.
    eventually("the proxy learnt the tools again", || async { heard.0.load(std::sync::atomic::Ordering::SeqCst) > 0 })
        .await;
    let tenant = proxy.client(Some(key)).await;
    let tools = tenant.list_all_tools().await.expect("tools");
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    assert!(names.contains(&"add"), "still offered to the tenant: {names:?}");
    assert_eq!(text_of(&call(&tenant, "add", json!({"a": 1, "b": 2})).await), "3", "and served from its own child");
    let theirs = text_of(&call(&stranger, "pid", json!({})).await);
    assert_ne!(theirs, own.to_string(), "the made-up key's calls reach a child of its own");
}

/// With `proxy.upstream_sessions = "session"`, each downstream session has its own child (never
/// the proxy's own, which the tools are learnt on), and opening one is charged to the caller's `limits.method.other`: a flood of
/// sessions opens what that budget allows, never more than `proxy.max_children`; and callers
/// without a configured key hold at most their share of them (`upstream.unverified_share`), so
/// configured tenants always find room.
#[tokio::test]
async fn each_session_its_own_child_and_a_flood_of_sessions_opens_what_its_budget_allows() {
    let key = "flooder-0123456789abcdef";
    let toml = format!(
        "[loop_detection]\nenabled = false\n[proxy]\nupstream_sessions = \"session\"\nmax_children = 4\n\
         [limits.method.other]\nalgorithm = \"token_bucket\"\nburst = 2\nrefill_per_sec = 0.001\n\
         [auth]\nkeys = [{{ sha256 = \"{}\", tenant = \"flood\" }}]\n",
        sha256_hex(key)
    );
    let proxy = Proxy::start(&toml, command(fastmcp(&[]))).await;
    let (first, second) = (proxy.client(Some(key)).await, proxy.client(Some(key)).await);
    let (one, two) = (text_of(&call(&first, "pid", json!({})).await), text_of(&call(&second, "pid", json!({})).await));
    assert_ne!(one, two, "two sessions of one caller, two children");
    assert_eq!(text_of(&call(&first, "pid", json!({})).await), one, "a session stays on its own");
    // The two openings spent its budget of two: every session after is refused.
    let mut sessions = Vec::new();
    let mut refused = Vec::new();
    for _ in 0..10 {
        let session = proxy.client(Some(key)).await;
        refused.push(code_of(&call(&session, "pid", json!({})).await).map(str::to_owned));
        sessions.push(session);
    }
    let rate_limited = Some("rate_limited".to_owned());
    assert!(refused.iter().all(|r| *r == rate_limited), "{refused:?}");
    // Callers with made-up keys, each its own budget: together they open at most their share of
    // the children (half of 4: 2), whatever is free.
    let made_up = ["other-a-0123456789", "other-b-0123456789", "other-c-0123456789", "other-d-0123456789"];
    let others: Vec<Client> = futures::future::join_all(made_up.iter().map(|k| proxy.client(Some(k)))).await;
    let mut answers = Vec::new();
    for other in &others {
        answers.push(call(other, "pid", json!({})).await);
    }
    let codes: Vec<Option<&str>> = answers.iter().map(code_of).collect();
    assert_eq!(codes.iter().filter(|c| c.is_none()).count(), 2, "{codes:?}");
    for answer in answers.iter().filter(|a| code_of(a).is_some()) {
        assert_eq!(code_of(answer), Some("busy"), "{answer:?}");
        let error = &common::structured(answer)["error"];
        assert_eq!(error["scope"], "proxy:max_children:unverified", "{answer:?}");
        assert_eq!(error["limit"], 2, "{answer:?}");
    }
    // A 2026-07-28 caller with a made-up key (the Python SDK, stateless: its own scope) is held
    // to the same share.
    let step = json!([{"op": "call", "tool": "pid"}]);
    let walked = python::walk(&proxy.url, "auto", step, &["-H", "Authorization: Bearer other-e-0123456789"]).await;
    let error = &walked["steps"][0]["ok"]["structured"]["error"];
    assert_eq!(error["scope"], "proxy:max_children:unverified", "{walked}");
    let open = proxy.app.proxied().expect("a proxy").scopes().all().len() - 1;
    assert_eq!(open, 4, "never more than max_children");
    // A session that could not be opened is refused by the one guarded call like any other call:
    // each refusal on the dashboard under its tool and code (10 over the opening budget, 3 past the
    // unverified callers' share of the children).
    let seen = proxy.app.state().limits.guard().activity().snapshot(proxy.clock.now());
    let pid = seen.tools.iter().find(|t| t.tool == "pid" && t.layer == "tool").expect("pid's refusals are seen");
    let count = |code: &str| pid.codes.iter().find(|c| c.code == code).map_or(0, |c| c.refused);
    assert_eq!((count("rate_limited"), count("busy")), (10, 3), "{:?}", pid.codes);
}

/// A client that keeps the log messages it hears: their text.
#[derive(Clone, Default)]
struct Logs(Arc<std::sync::Mutex<Vec<String>>>);

#[allow(deprecated)] // Logging is legacy in 2026-07-28, and still what servers send.
impl rmcp::ClientHandler for Logs {
    async fn on_logging_message(
        &self,
        params: rmcp::model::LoggingMessageNotificationParam,
        _context: rmcp::service::NotificationContext<rmcp::RoleClient>,
    ) {
        let text =
            params.data.get("msg").and_then(Value::as_str).map_or_else(|| params.data.to_string(), str::to_owned);
        self.0.lock().expect("a lock nobody panicked holding").push(text);
    }
}

impl Logs {
    fn heard(&self) -> Vec<String> {
        self.0.lock().expect("a lock nobody panicked holding").clone()
    }
}

/// Whichever version the proxy speaks to FastMCP (which speaks both): 2025-11-25, one session
/// whose level the proxy sets, or 2026-07-28, where each request says the level it wants.
#[tokio::test]
async fn a_log_message_reaches_only_the_sessions_that_asked_each_at_its_own_level() {
    for (protocol, version) in [
        ("2025-11-25", rmcp::model::ProtocolVersion::V_2025_11_25),
        ("auto", rmcp::model::ProtocolVersion::V_2026_07_28),
    ] {
        each_session_hears_the_log_messages_it_asked_for(protocol, version).await;
    }
}

async fn each_session_hears_the_log_messages_it_asked_for(protocol: &str, version: rmcp::model::ProtocolVersion) {
    let (a, b) = ("tenant-a-logs-key-0123456789", "tenant-b-logs-key-0123456789");
    let toml = format!(
        "[loop_detection]\nenabled = false\n[auth]\nkeys = [{{ sha256 = \"{}\", tenant = \"acme\" }}, \
         {{ sha256 = \"{}\", tenant = \"globex\" }}]\n[proxy]\nupstream_protocol = \"{protocol}\"\n\
         upstream_sessions = \"shared\"\n",
        sha256_hex(a),
        sha256_hex(b)
    );
    let proxy = Proxy::start(&toml, command(fastmcp(&[]))).await;
    let spoken = proxy.app.proxied().expect("a proxy").link().info().map(|i| i.protocol_version.clone());
    assert_eq!(spoken, Some(version), "{protocol}");
    let session = |key: &str, logs: Logs| {
        let config = StreamableHttpClientTransportConfig::with_uri(proxy.url.clone()).auth_header(key);
        logs.serve(StreamableHttpClientTransport::from_config(config))
    };
    let (heard_a, heard_b) = (Logs::default(), Logs::default());
    let alice = session(a, heard_a.clone()).await.expect("a connects");
    let bob = session(b, heard_b.clone()).await.expect("b connects");
    #[allow(deprecated)]
    let level = |l| rmcp::model::SetLevelRequestParams::new(l);
    #[allow(deprecated)]
    alice.set_level(level(rmcp::model::LoggingLevel::Warning)).await.expect("alice asks for warnings");
    async fn log(client: &rmcp::service::RunningService<rmcp::RoleClient, Logs>, level: &str, message: &str) {
        let mut args = serde_json::Map::new();
        args.insert("level".into(), json!(level));
        args.insert("message".into(), json!(message));
        let logged = client.call_tool(CallToolRequestParams::new("log").with_arguments(args)).await;
        assert_eq!(logged.map(|r| text_of(&r)).ok().as_deref(), Some("logged"));
    }
    log(&bob, "error", "first error").await;
    eventually("alice hears the error", || async { heard_a.heard() == ["first error"] }).await;
    // Bob never asked: he hears nothing, though his own call made the message.
    log(&bob, "info", "an info alice's level drops").await;
    #[allow(deprecated)]
    bob.set_level(level(rmcp::model::LoggingLevel::Debug)).await.expect("bob asks for everything");
    log(&alice, "debug", "some debug").await;
    log(&alice, "warning", "a warning").await;
    eventually("bob hears what was sent after he asked", || async { heard_b.heard() == ["some debug", "a warning"] })
        .await;
    eventually("alice hears the warning", || async { heard_a.heard() == ["first error", "a warning"] }).await;
    common::settle().await;
    assert_eq!(heard_a.heard(), ["first error", "a warning"], "alice's own level: warning and above");
    assert_eq!(heard_b.heard(), ["some debug", "a warning"], "nothing from before bob asked");
}

#[tokio::test]
async fn tools_the_proxied_server_renames_leave_no_series_or_dashboard_rows_and_names_and_counts_are_bounded() {
    let key = "renaming-key-0123456789abcdef";
    let toml = format!(
        "[limits.http]\nburst = 100000\n[limits.method.tools_call]\nburst = 100000\n\
         [limits.method.tools_list]\nburst = 100000\n[limits.caller]\nburst = 100000\n\
         [auth]\nkeys = [{{ sha256 = \"{}\" }}]\n[proxy]\nupstream_sessions = \"shared\"\n",
        sha256_hex(key)
    );
    let proxy = Proxy::start(&toml, command(fastmcp(&[]))).await;
    let client = proxy.client(Some(key)).await;
    let base = proxy.url.trim_end_matches("/mcp").to_owned();
    let names = |tools: &[rmcp::model::Tool]| tools.iter().map(|t| t.name.to_string()).collect::<Vec<_>>();
    let mut sizes = Vec::new();
    for round in ["alpha", "beta", "gamma"] {
        let replaced = call(&client, "replace_tools", json!({"prefix": round, "count": 20})).await;
        assert_eq!(text_of(&replaced), "20 tools");
        let last = format!("{round}19");
        eventually_some("the new tools are listed", Duration::from_secs(10), || async {
            names(&client.list_all_tools().await.expect("tools")).contains(&last).then_some(())
        })
        .await;
        for i in 0..20 {
            assert_eq!(text_of(&call(&client, &format!("{round}{i}"), json!({})).await), format!("{round}{i}"));
        }
        // Four more identical calls of the first: the fifth in a row is a loop, a dashboard row.
        let looped = answer_when(&client, &format!("{round}0"), json!({}), Duration::from_secs(5), |a| {
            code_of(a) == Some("loop_detected")
        })
        .await;
        assert_eq!(code_of(&looped), Some("loop_detected"));
        let metrics = proxy_metrics(&proxy).await;
        assert!(metrics.contains(&format!("tool=\"{round}0\"")), "{metrics}");
        let data: Value =
            reqwest::get(format!("{base}/dashboard/data")).await.expect("data").json().await.expect("json");
        let rows: Vec<String> = data["tools"].as_array().expect("rows").iter().map(|r| r["tool"].to_string()).collect();
        assert_eq!(rows, vec![format!("\"{round}0\"")], "one row, this round's looping tool: {data}");
        for gone in ["alpha", "beta", "gamma"].iter().take_while(|r| **r != round) {
            assert!(!metrics.contains(&format!("tool=\"{gone}")), "{gone}'s series are forgotten: {metrics}");
        }
        sizes.push(metrics.lines().count());
    }
    assert_eq!(sizes[1], sizes[0], "as many series for twenty renamed tools as for the twenty before");
    assert_eq!(sizes[2], sizes[0], "and again");

    // A name longer than the MCP spec's 128 characters is never offered, nor a label.
    let long = "x".repeat(129);
    call(&client, "replace_tools", json!({"prefix": long, "count": 5})).await;
    eventually_some("the round's tools are gone", Duration::from_secs(10), || async {
        let listed = names(&client.list_all_tools().await.expect("tools"));
        (!listed.iter().any(|n| n.starts_with("gamma"))).then_some(listed)
    })
    .await;
    let listed = client.list_all_tools().await.expect("tools");
    assert!(listed.iter().all(|t| t.name.chars().count() <= 128), "{:?}", names(&listed));
    let refused = client.call_tool(CallToolRequestParams::new(format!("{long}0"))).await;
    assert!(matches!(refused, Err(ServiceError::McpError(_))), "not the proxied server's to hear: {refused:?}");
    assert!(!proxy_metrics(&proxy).await.contains(&long), "no such label");

    // And at most a thousand tools: the rest are not offered.
    call(&client, "replace_tools", json!({"prefix": "many", "count": 1100})).await;
    let listed = eventually_some("many tools listed", Duration::from_secs(20), || async {
        let listed = client.list_all_tools().await.expect("tools");
        listed.iter().any(|t| t.name.starts_with("many")).then_some(listed)
    })
    .await;
    assert_eq!(listed.len(), mcp_ratelimit::proxy::MAX_TOOLS, "the first thousand of 1,100 and the fixture's own");
}

#[tokio::test]
async fn a_callers_trace_context_reaches_the_proxied_server_from_its_http_headers_or_its_own_meta() {
    // Five calls of `trace` alike would be a loop; what they carry differs outside the arguments.
    let proxy = Proxy::start("[loop_detection]\nenabled = false\n", command(fastmcp(&[]))).await;
    let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let state = "vendor=opaque";
    let trace = json!({"op": "call", "tool": "trace"});
    // Sent as W3C headers by clients of both eras: the proxied server reads them in `_meta`.
    for mode in ["legacy", "auto"] {
        let headers = [format!("traceparent: {parent}"), format!("tracestate: {state}")];
        let args = ["-H", headers[0].as_str(), "-H", headers[1].as_str()];
        let walked = python::walk(&proxy.url, mode, json!([trace]), &args).await;
        let seen = &walked["steps"][0]["ok"]["structured"];
        assert_eq!(*seen, json!({"traceparent": parent, "tracestate": state}), "{mode}: {walked}");
        // A header that is no traceparent is not passed on, nor its tracestate.
        let args = ["-H", "traceparent: 00-not-a-trace-01", "-H", headers[1].as_str()];
        let walked = python::walk(&proxy.url, mode, json!([trace]), &args).await;
        assert_eq!(walked["steps"][0]["ok"]["structured"], json!({}), "{mode}: {walked}");
    }
    // A trace context in the request's own `_meta` (SEP-414) passes on as the caller sent it.
    let client = proxy.client(None).await;
    let own = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";
    let mut meta = rmcp::model::RequestMetaObject::default();
    meta.0.insert("traceparent".to_owned(), own.into());
    let mut request = CallToolRequestParams::new("trace");
    request.meta = Some(meta);
    let seen = client.call_tool(request).await.expect("traced");
    assert_eq!(seen.structured_content, Some(json!({"traceparent": own})));
}

/// A W3C `tracestate` of 512 bytes (two members a vendor may send), and one byte more.
fn tracestates() -> (String, String) {
    let most = format!("a={},b={}", "v".repeat(254), "w".repeat(253));
    let over = format!("{most}w");
    assert_eq!((most.len(), over.len()), (512, 513));
    (most, over)
}

/// A `trace` call whose request `_meta` carries `traceparent` and, if given, `tracestate`.
fn traced_call(traceparent: &str, tracestate: Option<&str>) -> CallToolRequestParams {
    let mut meta = rmcp::model::RequestMetaObject::default();
    meta.0.insert("traceparent".to_owned(), traceparent.into());
    if let Some(state) = tracestate {
        meta.0.insert("tracestate".to_owned(), state.into());
    }
    let mut request = CallToolRequestParams::new("trace");
    request.meta = Some(meta);
    request
}

/// A caller's `tracestate` reaches the proxied server (traces off: as the caller sent it) only
/// when it is 1 to 512 bytes of printable ASCII, from its HTTP header or its own `_meta`; anything
/// else is dropped and its `traceparent` still passes on.
#[tokio::test]
async fn a_callers_tracestate_reaches_the_proxied_server_only_if_1_to_512_printable_bytes() {
    let proxy = Proxy::start("[loop_detection]\nenabled = false\n", command(fastmcp(&[]))).await;
    let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let (most, over) = tracestates();
    let trace = json!({"op": "call", "tool": "trace"});
    for (state, heard) in
        [(&most, json!({"traceparent": parent, "tracestate": most})), (&over, json!({"traceparent": parent}))]
    {
        let headers = [format!("traceparent: {parent}"), format!("tracestate: {state}")];
        let walked = python::walk(&proxy.url, "legacy", json!([trace]), &["-H", &headers[0], "-H", &headers[1]]).await;
        assert_eq!(walked["steps"][0]["ok"]["structured"], heard, "{} bytes in a header: {walked}", state.len());
    }
    let client = proxy.client(None).await;
    let own = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";
    for state in [over.as_str(), "vendor=\u{1}", "vendor=caf\u{e9}"] {
        let seen = client.call_tool(traced_call(own, Some(state))).await.expect("traced");
        assert_eq!(seen.structured_content, Some(json!({"traceparent": own})), "{state:?} in _meta");
    }
    let seen = client.call_tool(traced_call(own, Some(&most))).await.expect("traced");
    assert_eq!(seen.structured_content, Some(json!({"traceparent": own, "tracestate": most})));
}

/// `[telemetry]` on: the proxied server hears the proxy's span, whose `tracestate` is the caller's
/// only when it was 1 to 512 bytes of printable ASCII; one byte more is neither continued nor
/// passed on from the caller's `_meta`.
#[tokio::test(flavor = "current_thread")]
async fn with_traces_on_a_callers_tracestate_reaches_the_proxied_server_only_if_1_to_512_printable_bytes() {
    use crate::otlp::{Receiver, subscribe};
    let receiver = Receiver::start();
    let toml = format!("[loop_detection]\nenabled = false\n[telemetry]\notlp_endpoint = \"{}\"\n", receiver.url);
    let config = Config::from_toml(&toml, &Catalogue::learned()).expect("valid");
    let telemetry = mcp_ratelimit::telemetry::Telemetry::start(&config.telemetry.expect("on")).expect("exporter");
    let _traced = subscribe(&telemetry);
    let proxy = Proxy::start(&toml, command(fastmcp(&[]))).await;
    let client = proxy.client(None).await;
    let trace = "3df7651916cd43dd8448eb211c80319c";
    let callers = format!("00-{trace}-b7ad6b7169203331-01");
    let (most, over) = tracestates();
    let seen = client.call_tool(traced_call(&callers, Some(&most))).await.expect("answered");
    let heard = seen.structured_content.clone().unwrap_or_default();
    assert!(heard["traceparent"].as_str().is_some_and(|p| p.contains(trace) && p != callers), "{heard}");
    assert_eq!(heard["tracestate"], most, "512 bytes ride on the trace");
    let seen = client.call_tool(traced_call(&callers, Some(&over))).await.expect("answered");
    let heard = seen.structured_content.clone().unwrap_or_default();
    assert!(heard["traceparent"].as_str().is_some_and(|p| p.contains(trace) && p != callers), "{heard}");
    assert_eq!(heard.get("tracestate"), None, "513 bytes do not: {heard}");
}

/// `[telemetry]` on: the proxied server hears the trace of a call in `_meta` — not the caller's
/// span but the proxy's own span of the call, a child in the caller's trace — over stdio and over
/// HTTP, where it also hears it as the `traceparent` header; the receiver holds that span.
#[tokio::test(flavor = "current_thread")]
async fn with_traces_on_the_proxied_server_hears_the_proxys_span_of_the_callers_trace() {
    use crate::otlp::{Receiver, hex, subscribe};
    let receiver = Receiver::start();
    let toml = format!("[loop_detection]\nenabled = false\n[telemetry]\notlp_endpoint = \"{}\"\n", receiver.url);
    let config = Config::from_toml(&toml, &Catalogue::learned()).expect("valid");
    let telemetry = mcp_ratelimit::telemetry::Telemetry::start(&config.telemetry.expect("on")).expect("exporter");
    let _traced = subscribe(&telemetry);
    let port = free_port();
    let (python, args) = fastmcp(&["http", &port.to_string()]);
    let _server = serve_http(&python, &args, port).await;
    let http = Target::Http { url: format!("http://127.0.0.1:{port}/mcp"), headers: Vec::new() };
    // One trace of the caller's per call, so each is told apart in the receiver.
    let calls = [
        ("stdio", command(fastmcp(&[])), "trace", json!({}), "0af7651916cd43dd8448eb211c80319c"),
        ("http", http.clone(), "trace", json!({}), "1bf7651916cd43dd8448eb211c80319c"),
        ("http", http, "header", json!({"name": "traceparent"}), "2cf7651916cd43dd8448eb211c80319c"),
    ];
    for (mode, target, tool, args, trace) in calls {
        let proxy = Proxy::start(&toml, target).await;
        let client = proxy.client(None).await;
        let callers = format!("00-{trace}-b7ad6b7169203331-01");
        let mut meta = rmcp::model::RequestMetaObject::default();
        meta.0.insert("traceparent".to_owned(), callers.clone().into());
        let mut request = CallToolRequestParams::new(tool);
        request.arguments = args.as_object().cloned();
        request.meta = Some(meta);
        let seen = client.call_tool(request).await.expect("answered");
        let heard = match tool {
            "trace" => seen.structured_content.as_ref().and_then(|s| s["traceparent"].as_str()).map(str::to_owned),
            _ => Some(text_of(&seen)),
        };
        let spans = receiver
            .wait_for(&telemetry, "the proxied call's span", |spans| {
                spans.iter().any(|s| s.name == "proxy.request" && hex(&s.trace_id) == trace)
            })
            .await;
        let sent = spans.iter().find(|s| s.name == "proxy.request" && hex(&s.trace_id) == trace).expect("found");
        let expected = format!("00-{trace}-{}-01", hex(&sent.span_id));
        assert_ne!(expected, callers);
        assert_eq!(heard.as_deref(), Some(expected.as_str()), "{mode} {tool}: {seen:?}");
        assert_eq!(crate::otlp::attribute(sent, "proxy.outcome").as_deref(), Some("answered"), "{mode}");
    }
}

/// A tool `name` of a test's own server, taking any object.
pub(crate) fn tool_taking_an_object(name: &str) -> rmcp::model::Tool {
    let schema = json!({"type": "object"}).as_object().cloned().unwrap_or_default();
    rmcp::model::Tool::new(name.to_owned(), format!("The tool {name}"), Arc::new(schema))
}

/// A 2026-07-28 server whose tool `change` adds a tool `extra` and a prompt `extra`, and tells
/// its subscribers (`subscriptions/listen`) that both lists changed: the only way a 2026-07-28
/// server tells its clients of changes.
#[derive(Clone, Default)]
pub(crate) struct Changing {
    changed: Arc<std::sync::atomic::AtomicBool>,
    told: Arc<tokio::sync::Notify>,
    /// The 2025-11-25 sessions that subscribed to a resource (`resources/subscribe`): `change`
    /// tells them it was updated.
    subscribers: Arc<std::sync::Mutex<Vec<Subscribed>>>,
}

/// A session of the server's and the resource it subscribed to.
type Subscribed = (rmcp::service::Peer<rmcp::RoleServer>, String);

impl rmcp::ServerHandler for Changing {
    fn get_info(&self) -> rmcp::model::ServerConfig {
        let capabilities = rmcp::model::ServerCapabilities::builder()
            .enable_prompts()
            .enable_prompts_list_changed()
            .enable_resources()
            .enable_resources_subscribe()
            .enable_tools()
            .enable_tool_list_changed()
            .build();
        rmcp::model::ServerConfig::new(capabilities)
    }

    async fn list_tools(
        &self,
        _request: Option<rmcp::model::PaginatedRequestParams>,
        _context: rmcp::service::RequestContext<rmcp::RoleServer>,
    ) -> Result<rmcp::model::ListToolsResult, rmcp::ErrorData> {
        let mut tools = vec![tool_taking_an_object("change")];
        if self.changed.load(std::sync::atomic::Ordering::SeqCst) {
            tools.push(tool_taking_an_object("extra"));
        }
        Ok(rmcp::model::ListToolsResult::with_all_items(tools))
    }

    async fn list_prompts(
        &self,
        _request: Option<rmcp::model::PaginatedRequestParams>,
        _context: rmcp::service::RequestContext<rmcp::RoleServer>,
    ) -> Result<rmcp::model::ListPromptsResult, rmcp::ErrorData> {
        let prompts = if self.changed.load(std::sync::atomic::Ordering::SeqCst) {
            vec![rmcp::model::Prompt::new("extra", Some("A prompt added"), None)]
        } else {
            Vec::new()
        };
        Ok(rmcp::model::ListPromptsResult::with_all_items(prompts))
    }

    async fn call_tool(
        &self,
        _request: CallToolRequestParams,
        _context: rmcp::service::RequestContext<rmcp::RoleServer>,
    ) -> Result<rmcp::model::CallToolResponse, rmcp::ErrorData> {
        self.changed.store(true, std::sync::atomic::Ordering::SeqCst);
        self.told.notify_waiters();
        let subscribers = self.subscribers.lock().expect("a lock nobody panicked holding").clone();
        for (peer, uri) in subscribers {
            #[allow(deprecated)] // What a 2025-11-25 session is told.
            let _ = peer.notify_resource_updated(rmcp::model::ResourceUpdatedNotificationParam::new(uri)).await;
        }
        Ok(CallToolResult::success(vec![rmcp::model::ContentBlock::text("changed")]).into())
    }

    #[allow(deprecated)] // A 2025-11-25 session's subscription.
    async fn subscribe(
        &self,
        request: rmcp::model::SubscribeRequestParams,
        context: rmcp::service::RequestContext<rmcp::RoleServer>,
    ) -> Result<(), rmcp::ErrorData> {
        self.subscribers.lock().expect("a lock nobody panicked holding").push((context.peer, request.uri));
        Ok(())
    }

    /// Ends the subscription to the resource (every client of this server's is the proxy's one
    /// session per scope: the test's have one scope).
    #[allow(deprecated)] // A 2025-11-25 session's subscription.
    async fn unsubscribe(
        &self,
        request: rmcp::model::UnsubscribeRequestParams,
        _context: rmcp::service::RequestContext<rmcp::RoleServer>,
    ) -> Result<(), rmcp::ErrorData> {
        self.subscribers.lock().expect("a lock nobody panicked holding").retain(|(_, uri)| *uri != request.uri);
        Ok(())
    }

    fn accepted_subscription_filter(
        &self,
        requested: &rmcp::model::SubscriptionFilter,
    ) -> Option<rmcp::model::SubscriptionFilter> {
        Some(requested.clone())
    }

    async fn listen(&self, subscription: rmcp::service::SubscriptionContext) -> Result<(), rmcp::ErrorData> {
        use rmcp::model::ServerNotification::{PromptListChangedNotification, ToolListChangedNotification};
        loop {
            tokio::select! {
                () = subscription.cancelled() => return Ok(()),
                () = self.told.notified() => {
                    let _ = subscription.sink().send(ToolListChangedNotification(Default::default())).await;
                    let _ = subscription.sink().send(PromptListChangedNotification(Default::default())).await;
                }
            }
        }
    }
}

/// A 2025-11-25 client that counts the prompt list changes it is told of.
#[derive(Clone, Default)]
struct PromptsHeard(Arc<std::sync::atomic::AtomicUsize>);

impl rmcp::ClientHandler for PromptsHeard {
    async fn on_prompt_list_changed(&self, _context: rmcp::service::NotificationContext<rmcp::RoleClient>) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

#[tokio::test]
async fn a_2026_07_28_servers_changes_reach_the_proxy_and_its_callers_of_both_eras() {
    use rmcp::model::{ServerNotification, SubscriptionFilter};
    let target = Target::Http { url: serve_in_test(Changing::default()).await, headers: Vec::new() };
    let proxy = Proxy::start("", target).await;
    // A 2025-11-25 session hears changes unasked.
    let heard_by_legacy = PromptsHeard::default();
    let transport =
        StreamableHttpClientTransport::from_config(StreamableHttpClientTransportConfig::with_uri(proxy.url.clone()));
    let legacy = heard_by_legacy.clone().serve(transport).await.expect("a 2025-11-25 client connects");
    // Its first request puts it on its scope's session to the proxied server.
    assert!(legacy.list_all_prompts().await.expect("prompts").is_empty());
    // A 2026-07-28 caller subscribes.
    let client = modern_client(&proxy.url).await;
    // Of what it asks, the proxy accepts the lists' changes the server tells of (not resources').
    let mut asked = SubscriptionFilter::builder().tools_list_changed().prompts_list_changed().build();
    asked.resources_list_changed = Some(true);
    let mut subscription = client.peer().listen(asked).await.expect("subscribed");
    let accepted = SubscriptionFilter::builder().tools_list_changed().prompts_list_changed().build();
    assert_eq!(*subscription.acknowledged(), accepted);
    // The server tells the proxy (on the proxy's own subscription); the proxy learns the tools
    // again and tells its subscriber of both lists.
    assert_eq!(text_of(&call(&client, "change", json!({})).await), "changed");
    let mut heard = Vec::new();
    while heard.len() < 2 {
        let next = tokio::time::timeout(Duration::from_secs(10), subscription.next()).await;
        heard.push(next.expect("told within 10 s").expect("the stream stands").expect("a notification"));
    }
    assert!(heard.iter().any(|n| matches!(n, ServerNotification::ToolListChangedNotification(_))), "{heard:?}");
    assert!(heard.iter().any(|n| matches!(n, ServerNotification::PromptListChangedNotification(_))), "{heard:?}");
    // Told of its tools, the caller finds the new one listed (and priced) by then.
    let tools = client.list_all_tools().await.expect("tools");
    let extra = tools.iter().find(|t| t.name == "extra").unwrap_or_else(|| panic!("listed: {tools:?}"));
    assert_eq!(extra.description.as_deref(), Some("The tool extra. Costs 1 token."));
    let prompts = client.list_all_prompts().await.expect("prompts");
    assert!(prompts.iter().any(|p| p.name == "extra"), "{prompts:?}");
    eventually("the 2025-11-25 session is told the prompts changed", || async {
        heard_by_legacy.0.load(std::sync::atomic::Ordering::SeqCst) == 1
    })
    .await;
    legacy.cancel().await.expect("closed");
}

#[tokio::test]
async fn opening_subscriptions_through_the_proxy_is_charged_and_refused_past_the_budget() {
    use rmcp::model::SubscriptionFilter;
    let target = Target::Http { url: serve_in_test(Changing::default()).await, headers: Vec::new() };
    let toml = "[limits.method.other]\nalgorithm = \"token_bucket\"\nburst = 4\nrefill_per_sec = 0.001\n";
    let proxy = Proxy::start(toml, target).await;
    let client = modern_client(&proxy.url).await;
    let asked = || SubscriptionFilter::builder().tools_list_changed().build();
    // rmcp acknowledges a subscription before the server's handler runs; the charge comes then,
    // and one past the budget ends at once with the refusal. Three fit the burst of four, with the
    // opening of their scope's session to the proxied server (charged as opening one always is).
    let mut subscriptions = Vec::new();
    for _ in 0..5 {
        subscriptions.push(client.peer().listen(asked()).await.expect("acknowledged"));
    }
    for refused in &mut subscriptions[3..] {
        let ended = tokio::time::timeout(Duration::from_secs(10), refused.next()).await.expect("ended at once");
        let error = ended.expect_err("refused");
        assert!(error.to_string().contains("rate_limited"), "{error}");
    }
    for open in &mut subscriptions[..3] {
        assert!(futures::FutureExt::now_or_never(open.next()).is_none(), "still open");
    }
}

/// A 2025-11-25 client that keeps the URIs of the resource updates it is told of.
#[derive(Clone, Default)]
struct Updates(Arc<std::sync::Mutex<Vec<String>>>);

impl rmcp::ClientHandler for Updates {
    async fn on_resource_updated(
        &self,
        params: rmcp::model::ResourceUpdatedNotificationParam,
        _context: rmcp::service::NotificationContext<rmcp::RoleClient>,
    ) {
        self.0.lock().expect("a lock nobody panicked holding").push(params.uri);
    }
}

/// A resource's update reaches whoever subscribed to it, in either era: a 2025-11-25 session by
/// `resources/subscribe`, a 2026-07-28 caller on its `subscriptions/listen`; the proxied server
/// (2025-11-25) is subscribed once for both.
#[tokio::test]
async fn a_resource_update_reaches_the_callers_of_both_eras_that_subscribed_to_it() {
    use rmcp::model::{ServerNotification, SubscriptionFilter};
    let server = Changing::default();
    let target = Target::Http { url: serve_in_test(server.clone()).await, headers: Vec::new() };
    let proxy = Proxy::start("[proxy]\nupstream_protocol = \"2025-11-25\"\n", target).await;
    let thing = "test://thing";
    let heard_by_legacy = Updates::default();
    let transport =
        StreamableHttpClientTransport::from_config(StreamableHttpClientTransportConfig::with_uri(proxy.url.clone()));
    let legacy = heard_by_legacy.clone().serve(transport).await.expect("a 2025-11-25 client connects");
    #[allow(deprecated)] // A 2025-11-25 session's subscription.
    legacy.subscribe(rmcp::model::SubscribeRequestParams::new(thing)).await.expect("subscribed");
    let client = modern_client(&proxy.url).await;
    let mut asked = SubscriptionFilter::new();
    asked.resource_subscriptions = Some(vec![thing.to_owned(), "test://never-changes".to_owned()]);
    let mut subscription = client.peer().listen(asked.clone()).await.expect("subscribed");
    assert_eq!(subscription.acknowledged().resource_subscriptions, asked.resource_subscriptions);
    assert_eq!(text_of(&call(&client, "change", json!({})).await), "changed");
    let heard = tokio::time::timeout(Duration::from_secs(10), subscription.next()).await;
    let heard = heard.expect("told within 10 s").expect("the stream stands").expect("a notification");
    let ServerNotification::ResourceUpdatedNotification(updated) = heard else { panic!("{heard:?}") };
    assert_eq!(updated.params.uri, thing);
    eventually("the 2025-11-25 session is told too", || async {
        heard_by_legacy.0.lock().expect("a lock nobody panicked holding").as_slice() == [thing.to_owned()]
    })
    .await;
    let asked_upstream: Vec<String> =
        server.subscribers.lock().expect("a lock nobody panicked holding").iter().map(|(_, uri)| uri.clone()).collect();
    assert_eq!(asked_upstream, [thing, "test://never-changes"], "the server asked once per resource");
    legacy.cancel().await.expect("closed");
}

/// A request without a session (the 2026-07-28 lifecycle: `_meta` says its version, here
/// 2025-11-25, which rmcp then serves as a legacy request) holds no resource subscription, so it
/// neither ends one nor opens one upstream: its `resources/unsubscribe` is answered without asking
/// the proxied server, whose one subscription for the session of its scope that subscribed stays
/// (that session still hears the updates), and its `resources/subscribe` is refused, naming
/// `subscriptions/listen`. A 2026-07-28 client cannot send either (rmcp answers it "method not
/// found").
#[tokio::test]
async fn a_request_without_a_session_never_ends_nor_opens_a_subscription_upstream() {
    let server = Changing::default();
    let target = Target::Http { url: serve_in_test(server.clone()).await, headers: Vec::new() };
    let proxy = Proxy::start("[proxy]\nupstream_protocol = \"2025-11-25\"\n", target).await;
    let thing = "test://thing";
    let heard = Updates::default();
    let transport =
        StreamableHttpClientTransport::from_config(StreamableHttpClientTransportConfig::with_uri(proxy.url.clone()));
    let legacy = heard.clone().serve(transport).await.expect("a 2025-11-25 client connects");
    #[allow(deprecated)] // A 2025-11-25 session's subscription.
    legacy.subscribe(rmcp::model::SubscribeRequestParams::new(thing)).await.expect("subscribed");
    let upstream = || server.subscribers.lock().expect("a lock nobody panicked holding").len();
    assert_eq!(upstream(), 1, "subscribed upstream");

    // The same caller (no key: its address's scope, the same session to the proxied server),
    // without a session.
    let sessionless = common::RawSession::new(&proxy.url, &[("mcp-protocol-version", "2025-11-25")]);
    let request = |id: u64, method: &str| {
        json!({"jsonrpc": "2.0", "id": id, "method": method, "params": {"uri": thing, "_meta": {
            "io.modelcontextprotocol/protocolVersion": "2025-11-25",
            "io.modelcontextprotocol/clientCapabilities": {},
            "io.modelcontextprotocol/clientInfo": {"name": "sessionless", "version": "1"}}}})
    };
    let (status, _, body) = sessionless.post(request(1, "resources/unsubscribe")).await;
    let answer = common::jsonrpc_of(&body);
    assert_eq!((status, &answer["result"]), (200, &json!({})), "{body}");
    assert_eq!(upstream(), 1, "the proxied server was not asked to unsubscribe");
    let (_, _, body) = sessionless.post(request(2, "resources/subscribe")).await;
    let answer = common::jsonrpc_of(&body);
    let message = answer["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("subscriptions/listen"), "refused, naming the way to subscribe: {body}");
    assert_eq!(upstream(), 1, "nor asked to subscribe");
    // A 2026-07-28 client cannot send it at all.
    let modern = modern_client(&proxy.url).await;
    #[allow(deprecated)] // What the test shows a 2026-07-28 client cannot send.
    let refused = modern.peer().unsubscribe(rmcp::model::UnsubscribeRequestParams::new(thing)).await;
    assert!(refused.is_err(), "{refused:?}");
    assert_eq!(upstream(), 1);

    assert_eq!(text_of(&call(&legacy, "change", json!({})).await), "changed");
    eventually("the session that subscribed still hears the update", || async {
        heard.0.lock().expect("a lock nobody panicked holding").as_slice() == [thing.to_owned()]
    })
    .await;
    legacy.cancel().await.expect("closed");
}

/// Loops found by their answers, in front of a server nobody here wrote, through the Python SDK in
/// both eras: a proxied read (`lookup`, `readOnlyHint`) that keeps answering nothing (a fresh
/// `request_id` each time, a volatile field) is warned, then stopped at the sixth call whatever
/// the term, and the calls refused never reach it; a proxied poll whose answer moves (`tick`) is
/// never a loop however often the same call is repeated; the same call with the same answer
/// (`pid`) still is, at the fifth.
#[tokio::test]
async fn a_proxied_read_that_keeps_answering_nothing_is_stopped_and_a_poll_that_moves_never_is_in_both_eras() {
    let keys = "[[auth.keys]]\nkey = \"auto-key\"\n[[auth.keys]]\nkey = \"legacy-key\"\n";
    let proxy = Proxy::start(keys, command(fastmcp(&[]))).await;
    let step = |tool: &str, args: Value| json!({"op": "call", "tool": tool, "args": args});
    for (mode, key) in [("auto", "auto-key"), ("legacy", "legacy-key")] {
        let mut steps: Vec<Value> = (0..7).map(|n| step("lookup", json!({"term": format!("term {n}")}))).collect();
        steps.extend((0..12).map(|_| step("tick", json!({}))));
        steps.extend((0..5).map(|_| step("pid", json!({}))));
        let auth = format!("Authorization: Bearer {key}");
        let walked = python::walk(&proxy.url, mode, Value::Array(steps), &["-H", &auth]).await;
        assert_eq!(walked["protocol_version"], python::era_of(mode), "{walked}");
        let steps = walked["steps"].as_array().expect("steps");
        let ok = |n: usize| steps[n].get("ok").unwrap_or_else(|| panic!("{mode}: step {n}: {}", steps[n]));
        let refused = |n: usize| ok(n)["is_error"] == json!(true);
        let code = |n: usize| ok(n)["structured"]["error"]["code"].clone();
        let warned = |n: usize| ok(n)["meta"]["io.github.mcp-ratelimit/no_progress"]["same_answers"].clone();
        for n in 0..5 {
            assert!(!refused(n), "{mode}: lookup {n} is answered: {}", ok(n));
            assert_eq!(ok(n)["structured"]["matches"], json!([]), "{mode}: the proxied answer is passed on");
        }
        assert_eq!((warned(3), warned(4)), (json!(4), json!(5)), "{mode}: warned, then stopped");
        assert!(ok(4)["text"].as_str().is_some_and(|t| t.contains("now refused for the next 60 s")), "{}", ok(4));
        for n in 5..7 {
            assert_eq!(code(n), "loop_detected", "{mode}: lookup {n}: {}", ok(n));
        }
        for n in 7..19 {
            assert!(!refused(n), "{mode}: tick {} moves, never a loop: {}", n - 7, ok(n));
        }
        for n in 19..23 {
            assert!(!refused(n), "{mode}: pid {}: {}", n - 19, ok(n));
        }
        assert_eq!(code(23), "loop_detected", "{mode}: the fifth identical pid with the same answer: {}", ok(23));
    }
}
