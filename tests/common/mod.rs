//! Test harness: a real server on a loopback port, a manual clock, and rmcp clients.
#![allow(dead_code)]

use std::sync::Arc;

use mcp_ratelimit::clock::ManualClock;
use mcp_ratelimit::{App, Config};
use rmcp::model::{CallToolRequestParams, CallToolResult};
use rmcp::service::RunningService;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::{RoleClient, ServiceExt};
use serde_json::Value;
use tokio::net::TcpListener;

pub(crate) type Client = RunningService<RoleClient, ()>;

/// For tests that exhaust a budget by repeating one identical call: loop detection would
/// (rightly) stop such an agent first.
pub(crate) const NO_LOOP_DETECTION: &str = "[loop_detection]\nenabled = false\n";

/// For tests that exhaust a budget with searches that all find nothing: loop detection by
/// answers (`no_progress`) would (rightly) stop such an agent first.
pub(crate) const NO_PROGRESS_CHECK: &str = "[loop_detection]\nno_progress = 0\n";

/// For tests about budgets that start many jobs at once: the in-flight caps out of the way.
pub(crate) const ROOMY_IN_FLIGHT: &str = "[limits.in_flight]\ncaller = 1000\ntenant = 1000\naddress = 1000\n";

/// A server started in-process on a free loopback port, on a manual clock.
pub(crate) struct TestServer {
    pub app: Arc<App>,
    pub clock: Arc<ManualClock>,
    pub addr: std::net::SocketAddr,
    pub url: String,
}

impl TestServer {
    /// Starts a server with the defaults plus `toml`.
    pub(crate) async fn start(toml: &str) -> Self {
        Self::start_on(toml, ManualClock::new()).await
    }

    /// Starts a server with the defaults plus `toml`, on `clock` (an OAuth test's clock starts
    /// at the wall clock's time, which the tokens it checks are stamped with).
    /// `{addr}` in `toml` becomes the server's own address (a webhook URL that names it).
    pub(crate) async fn start_on(toml: &str, clock: Arc<ManualClock>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let toml = toml.replace("{addr}", &addr.to_string());
        let config = Config::from_toml(&toml, &mcp_ratelimit::mcp::tools::catalogue()).expect("test config is valid");
        let config = config.serving_at(addr).expect("a loopback address names the audience");
        let app = Arc::new(App::start(config, clock.clone()).await.expect("server starts"));
        let serving = app.clone();
        tokio::spawn(async move { serving.serve_http(listener).await });
        Self { app, clock, addr, url: format!("http://{addr}/mcp") }
    }

    /// An MCP client presenting `token` as a Bearer credential (or none).
    pub(crate) async fn client(&self, token: Option<&str>) -> Client {
        let mut config = StreamableHttpClientTransportConfig::with_uri(self.url.clone());
        if let Some(token) = token {
            config = config.auth_header(token);
        }
        ().serve(StreamableHttpClientTransport::from_config(config)).await.expect("client connects")
    }

    /// The embedded mock upstream's usage counters.
    pub(crate) async fn upstream_usage(&self) -> Value {
        let url = format!("{}/v1/usage", self.app.upstream_url());
        reqwest::get(url).await.expect("usage").json().await.expect("usage json")
    }

    /// Every prediction submission the mock received: (clock reading in ns, status, key).
    pub(crate) async fn submissions(&self) -> Vec<(u64, u16, String)> {
        let url = format!("{}/v1/submissions", self.app.upstream_url());
        let log: Value = reqwest::get(url).await.expect("submissions").json().await.expect("json");
        log["submissions"]
            .as_array()
            .expect("list")
            .iter()
            .map(|s| {
                let key = s["idempotency_key"].as_str().unwrap_or_default().to_owned();
                (s["at_ns"].as_u64().expect("at_ns"), s["status"].as_u64().expect("status") as u16, key)
            })
            .collect()
    }

    /// Changes the mock's chaos knobs while it runs (e.g. `{"rate_5xx": 1.0}` takes it down).
    pub(crate) async fn chaos(&self, knobs: Value) {
        let url = format!("{}/v1/chaos", self.app.upstream_url());
        let r = reqwest::Client::new().put(url).json(&knobs).send().await.expect("chaos");
        assert!(r.status().is_success(), "chaos change refused: {}", r.status());
    }

    /// `GET /metrics`.
    pub(crate) async fn metrics(&self) -> String {
        reqwest::get(format!("http://{}/metrics", self.addr)).await.expect("metrics").text().await.expect("text")
    }

    /// Moves the server's clock by whole milliseconds (exact, unlike a float of seconds).
    pub(crate) fn advance_ms(&self, ms: u64) {
        self.clock.advance(std::time::Duration::from_millis(ms));
    }

    pub(crate) fn advance_secs(&self, secs: f64) {
        self.clock.advance(std::time::Duration::from_secs_f64(secs));
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.app.stop();
    }
}

/// A 2025-11-25 MCP client (the initialize handshake, a session) of the server at `url`.
pub(crate) async fn client_of(url: &str) -> Client {
    let transport = StreamableHttpClientTransport::from_config(StreamableHttpClientTransportConfig::with_uri(url));
    ().serve(transport).await.expect("client connects")
}

/// `mcp-ratelimit serve --config FILE` as its own process on a free port (it reloads on SIGHUP and
/// on the file changing), once it answers `/health`; an MCP client of it presenting `key`; its port.
pub(crate) async fn serve_file(file: &std::path::Path, key: &str) -> (tokio::process::Child, Client, u16) {
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("port").port();
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_mcp-ratelimit"))
        .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--config"])
        .arg(file)
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .spawn()
        .expect("the binary starts");
    let health = format!("http://127.0.0.1:{port}/health");
    eventually("the server answers /health", || async { reqwest::get(&health).await.is_ok() }).await;
    let config = StreamableHttpClientTransportConfig::with_uri(format!("http://127.0.0.1:{port}/mcp")).auth_header(key);
    let agent = ().serve(StreamableHttpClientTransport::from_config(config)).await.expect("client connects");
    (child, agent, port)
}

/// Serves `server` (a library user's rmcp handler) on a free loopback port, as
/// `examples/rmcp_server.rs` does: streamable HTTP at `/mcp` behind `limits`' HTTP layer. Its URL.
pub(crate) async fn serve_library<S>(server: S, limits: &mcp_ratelimit::RateLimits) -> String
where
    S: rmcp::ServerHandler + Clone + Send + Sync + 'static,
{
    use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
    use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
    let mcp = StreamableHttpService::new(
        move || Ok(server.clone()),
        LocalSessionManager::default().into(),
        StreamableHttpServerConfig::default(),
    );
    let app = axum::Router::new().nest_service("/mcp", mcp).layer(limits.http_layer());
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}/mcp", listener.local_addr().expect("addr"));
    let app = app.into_make_service_with_connect_info::<std::net::SocketAddr>();
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// One mock upstream for several instances (`upstream.url`), on a clock of the test's own.
pub(crate) async fn shared_mock() -> (Arc<ManualClock>, mcp_ratelimit::mock_upstream::MockUpstream) {
    let defaults = Config::defaults(&mcp_ratelimit::mcp::tools::catalogue()).expect("defaults");
    shared_mock_running(defaults.mock_upstream.image_job_ms).await
}

/// [`shared_mock`], its image jobs running `image_job_ms` on its clock.
pub(crate) async fn shared_mock_running(
    image_job_ms: u64,
) -> (Arc<ManualClock>, mcp_ratelimit::mock_upstream::MockUpstream) {
    shared_mock_signing(image_job_ms, "").await
}

/// [`shared_mock_running`], sending webhooks signed with `webhook_secret` (empty: none).
pub(crate) async fn shared_mock_signing(
    image_job_ms: u64,
    webhook_secret: &str,
) -> (Arc<ManualClock>, mcp_ratelimit::mock_upstream::MockUpstream) {
    let mock_clock = ManualClock::new();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let defaults = Config::defaults(&mcp_ratelimit::mcp::tools::catalogue()).expect("defaults");
    let deadlines = mcp_ratelimit::http::serve::Deadlines::of(&defaults.server);
    let webhook_secret = mcp_ratelimit::redact::Secret::new(webhook_secret.to_owned());
    let config = mcp_ratelimit::config::MockUpstreamConfig { image_job_ms, webhook_secret, ..defaults.mock_upstream };
    let mock = mcp_ratelimit::mock_upstream::MockUpstream::start(config, deadlines, mock_clock.clone(), listener)
        .await
        .expect("mock");
    (mock_clock, mock)
}

/// Calls `tool` with `args`; panics on a protocol error (refusals are results, not errors).
pub(crate) async fn call(client: &Client, tool: &str, args: Value) -> CallToolResult {
    let mut params = CallToolRequestParams::new(tool.to_owned());
    if let Value::Object(map) = args {
        params = params.with_arguments(map);
    }
    client.call_tool(params).await.expect("tools/call answered")
}

pub(crate) fn is_error(r: &CallToolResult) -> bool {
    r.is_error == Some(true)
}

pub(crate) fn structured(r: &CallToolResult) -> &Value {
    r.structured_content.as_ref().expect("structuredContent present")
}

pub(crate) fn error_code(r: &CallToolResult) -> Option<&str> {
    r.structured_content.as_ref()?.get("error")?.get("code")?.as_str()
}

pub(crate) fn text(r: &CallToolResult) -> String {
    r.content.iter().filter_map(|c| c.as_text().map(|t| t.text.clone())).collect::<Vec<_>>().join("\n")
}

/// The sum of every sample of `metric` in a Prometheus text exposition (all label sets).
pub(crate) fn metric_sum(exposition: &str, metric: &str) -> f64 {
    exposition
        .lines()
        .filter(|l| l.strip_prefix(metric).is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' ')))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Waits, a bounded real time, for background work on the server (a job's poll, a queued
/// submission) to reach the state `check` looks for. Time on the server's clock does not move.
pub(crate) async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    eventually_some(what, std::time::Duration::from_secs(5), || {
        let checked = check();
        async move { checked.await.then_some(()) }
    })
    .await
}

/// Asks `attempt` every 10 ms until it gives a value, for at most `within` of real time (a
/// process starting, restarting or answering; never a window of the server's clock).
pub(crate) async fn eventually_some<T, F, Fut>(what: &str, within: std::time::Duration, mut attempt: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let pause = std::time::Duration::from_millis(10);
    for _ in 0..(within.as_millis() / pause.as_millis()).max(1) {
        if let Some(value) = attempt().await {
            return value;
        }
        tokio::time::sleep(pause).await;
    }
    panic!("never happened within {within:?}: {what}");
}

/// Lets background tasks that were woken run to their next wait, before asserting that
/// something did *not* happen.
pub(crate) async fn settle() {
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
}

/// Calls `tool` until it is refused; returns how many calls passed.
pub(crate) async fn spend_until_refused(
    client: &Client,
    tool: &str,
    args: Value,
    max: usize,
) -> (usize, CallToolResult) {
    for passed in 0..max {
        let r = call(client, tool, args.clone()).await;
        if is_error(&r) {
            return (passed, r);
        }
    }
    panic!("{tool} was never refused in {max} calls");
}

/// The budget in a `rate_limit_status` result whose scope starts with `prefix`.
pub(crate) fn budget<'a>(status: &'a CallToolResult, prefix: &str) -> &'a Value {
    structured(status)["budgets"]
        .as_array()
        .and_then(|b| b.iter().find(|b| b["scope"].as_str().is_some_and(|s| s.starts_with(prefix))))
        .unwrap_or_else(|| panic!("no budget with scope {prefix}…: {}", structured(status)))
}

/// A hand-driven MCP session over raw HTTP, for asserting status codes and headers.
pub(crate) struct RawSession {
    pub http: reqwest::Client,
    pub url: String,
    pub headers: Vec<(String, String)>,
    pub session_id: Option<String>,
}

impl RawSession {
    pub(crate) fn new(url: &str, headers: &[(&str, &str)]) -> Self {
        Self {
            http: reqwest::Client::new(),
            url: url.to_owned(),
            headers: headers.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            session_id: None,
        }
    }

    /// POSTs a JSON-RPC body as an MCP client would, returning status, headers and body text.
    pub(crate) async fn post_raw(&self, body: String, content_type: &str) -> (u16, reqwest::header::HeaderMap, String) {
        let mut request = self
            .http
            .post(&self.url)
            .header("content-type", content_type)
            .header("accept", "application/json, text/event-stream")
            .body(body);
        for (k, v) in &self.headers {
            request = request.header(k.as_str(), v.as_str());
        }
        if let Some(id) = &self.session_id {
            request = request.header("mcp-session-id", id.as_str()).header("mcp-protocol-version", "2025-11-25");
        }
        let response = request.send().await.expect("POST answered");
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        (status, headers, response.text().await.unwrap_or_default())
    }

    pub(crate) async fn post(&self, body: Value) -> (u16, reqwest::header::HeaderMap, String) {
        self.post_raw(body.to_string(), "application/json").await
    }

    /// initialize + notifications/initialized; returns the HTTP statuses of both.
    pub(crate) async fn open(&mut self) -> (u16, u16) {
        let init = serde_json::json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "raw-test", "version": "1"}}});
        let (status, headers, _) = self.post(init).await;
        self.session_id = headers.get("mcp-session-id").and_then(|v| v.to_str().ok()).map(str::to_owned);
        let (second, _, _) =
            self.post(serde_json::json!({"jsonrpc": "2.0", "method": "notifications/initialized"})).await;
        (status, second)
    }

    pub(crate) async fn ping(&self, id: u64) -> (u16, reqwest::header::HeaderMap, String) {
        self.post(serde_json::json!({"jsonrpc": "2.0", "id": id, "method": "ping"})).await
    }
}

/// The JSON-RPC message inside a response body that may be SSE (`data: {...}` lines) or JSON.
pub(crate) fn jsonrpc_of(body: &str) -> Value {
    let data = body.lines().filter_map(|l| l.strip_prefix("data:")).map(str::trim).find(|d| d.starts_with('{'));
    serde_json::from_str(data.unwrap_or(body)).unwrap_or(Value::Null)
}

/// Everything a `tracing` subscriber writes, kept for a test to read (install it with
/// `with_writer(move || capture.clone())`; the subscriber is process-wide).
#[derive(Clone, Default)]
pub(crate) struct LogCapture(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for LogCapture {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl LogCapture {
    /// All that was written so far.
    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|p| p.into_inner())).into_owned()
    }

    /// The lines written so far that contain `text`.
    pub(crate) fn lines_with(&self, text: &str) -> Vec<String> {
        self.text().lines().filter(|l| l.contains(text)).map(str::to_owned).collect()
    }
}
