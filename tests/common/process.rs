//! The server as its users run it: `mcp-ratelimit serve` and `mock-upstream` processes started
//! from the binary with a config file and `MCP_RL__…` variables, and MCP spoken over raw HTTP.
//!
//! Nothing here touches the library's internals, so the hardening tests (`tests/idle_abuse.rs`,
//! `tests/slow_redis.rs`, `tests/binary/soak.rs`) prove what a deployment would see. Waits
//! are bounded polls.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// The binary under test: the one `cargo test` built.
pub(crate) const BINARY: &str = env!("CARGO_BIN_EXE_mcp-ratelimit");

/// The binary the processes run: `MCP_RATELIMIT_BIN` (e.g. a release build, for figures a
/// deployment would see), else [`BINARY`].
pub(crate) fn binary() -> String {
    std::env::var("MCP_RATELIMIT_BIN").ok().filter(|b| !b.is_empty()).unwrap_or_else(|| BINARY.to_owned())
}

/// A free loopback port (bound and let go: another process may take it first, rarely).
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free loopback port").port()
}

/// Polls `check` every 20 ms until it holds, at most `limit`; panics naming `what` otherwise.
pub(crate) async fn wait_until<F, Fut>(what: &str, limit: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    while !check().await {
        assert!(started.elapsed() < limit, "never happened within {limit:?}: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Resident memory of a process in KiB (`VmRSS` in `/proc/<pid>/status`; Linux).
pub(crate) fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// A process of the binary: its stderr goes to a file the test can read (panics, warnings).
pub(crate) struct Process {
    child: tokio::process::Child,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Process {
    /// Runs `mcp-ratelimit <args> --config <file with toml>` with `env` set.
    pub(crate) fn spawn(args: &[&str], toml: &str, env: &[(&str, String)]) -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let config = dir.path().join("config.toml");
        std::fs::write(&config, toml).expect("write the config");
        let log = dir.path().join("stderr.log");
        let stderr = std::fs::File::create(&log).expect("a log file");
        let mut command = tokio::process::Command::new(binary());
        command
            .args(args)
            .arg("--config")
            .arg(&config)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(stderr)
            .kill_on_drop(true);
        for (key, value) in env {
            command.env(key, value);
        }
        let child = command.spawn().expect("the binary starts");
        Self { child, log, _dir: dir }
    }

    /// The process id, while it runs.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id().expect("the process runs")
    }

    /// Its resident memory in KiB.
    pub(crate) fn rss_kib(&self) -> u64 {
        rss_kib(self.pid()).expect("VmRSS of a running process")
    }

    /// Everything it wrote to stderr so far.
    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Panics it reported (a panicking task prints "panicked at").
    pub(crate) fn panics(&self) -> usize {
        self.log().matches("panicked at").count()
    }

    /// Whether it has exited.
    pub(crate) fn exited(&mut self) -> bool {
        !matches!(self.child.try_wait(), Ok(None))
    }

    /// Kills it outright.
    pub(crate) async fn kill(&mut self) {
        let _ = self.child.kill().await;
    }
}

/// A `serve` process on a free port.
pub(crate) struct Server {
    pub process: Process,
    /// `http://127.0.0.1:<port>`.
    pub base: String,
    /// `…/mcp`.
    pub url: String,
}

impl Server {
    /// Starts `serve` with `toml` as its config file, and waits (bounded) for `/health`.
    pub(crate) async fn start(toml: &str, env: &[(&str, String)]) -> Self {
        let port = free_port();
        let listen = format!("127.0.0.1:{port}");
        let mut process = Process::spawn(&["serve", "--listen", &listen], toml, env);
        let base = format!("http://{listen}");
        let health = format!("{base}/health");
        let http = reqwest::Client::new();
        let started = Instant::now();
        while !http.get(&health).send().await.is_ok_and(|r| r.status().is_success()) {
            assert!(!process.exited(), "serve exited: {}", process.log());
            assert!(started.elapsed() < Duration::from_secs(30), "serve never answered /health: {}", process.log());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Self { process, url: format!("{base}/mcp"), base }
    }

    /// `GET /metrics`.
    pub(crate) async fn metrics(&self) -> String {
        let response = reqwest::get(format!("{}/metrics", self.base)).await.expect("metrics");
        response.text().await.expect("metrics text")
    }
}

/// A `mock-upstream` process on a free port with `[mock_upstream]` knobs from `toml`.
pub(crate) struct Upstream {
    pub process: Process,
    /// Its base URL, for `upstream.url`.
    pub url: String,
}

impl Upstream {
    /// Starts it and waits (bounded) until it answers.
    pub(crate) async fn start(toml: &str) -> Self {
        let port = free_port();
        let listen = format!("127.0.0.1:{port}");
        let process = Process::spawn(&["mock-upstream", "--listen", &listen], toml, &[]);
        let url = format!("http://{listen}");
        let usage = format!("{url}/v1/usage");
        wait_until("mock-upstream answers", Duration::from_secs(30), || async {
            reqwest::get(&usage).await.is_ok_and(|r| r.status().is_success())
        })
        .await;
        Self { process, url }
    }
}

/// One MCP session over raw HTTP (what any client sends), with a Bearer token.
#[derive(Clone)]
pub(crate) struct Session {
    http: reqwest::Client,
    url: String,
    token: String,
    /// `Mcp-Session-Id`, once opened.
    pub id: Option<String>,
    next_id: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

/// What a POST got back.
#[derive(Debug)]
pub(crate) struct Answer {
    pub status: u16,
    /// `Mcp-Session-Id` of the answer, if it carried one (an `initialize`'s).
    pub session_id: Option<String>,
    /// The JSON-RPC message (from SSE `data:` or a JSON body); `Null` if none.
    pub message: Value,
    /// `Retry-After` in seconds, on a refusal that carried one (`429`, `503`).
    pub retry_after: Option<u64>,
}

impl Answer {
    /// The tool result's `structuredContent`, if any.
    pub(crate) fn structured(&self) -> &Value {
        &self.message["result"]["structuredContent"]
    }

    /// Whether the tool result is a refusal (`isError: true`).
    pub(crate) fn is_error(&self) -> bool {
        self.message["result"]["isError"] == true
    }

    /// The refusal's code (`rate_limited`, `busy`, …).
    pub(crate) fn code(&self) -> Option<&str> {
        self.structured()["error"]["code"].as_str()
    }
}

impl Session {
    /// A session for `token` against `url`, not yet opened; `http` may be shared.
    pub(crate) fn new(http: &reqwest::Client, url: &str, token: &str) -> Self {
        Self {
            http: http.clone(),
            url: url.to_owned(),
            token: token.to_owned(),
            id: None,
            next_id: std::sync::Arc::new(std::sync::atomic::AtomicU64::new(1)),
        }
    }

    /// POSTs one JSON-RPC message; `Err` only when no HTTP answer came at all.
    pub(crate) async fn post(&self, body: &Value) -> Result<Answer, reqwest::Error> {
        let mut request = self
            .http
            .post(&self.url)
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .bearer_auth(&self.token)
            .body(body.to_string());
        if let Some(id) = &self.id {
            request = request.header("mcp-session-id", id).header("mcp-protocol-version", "2025-11-25");
        }
        let response = request.send().await?;
        let status = response.status().as_u16();
        let session_id = response.headers().get("mcp-session-id").and_then(|v| v.to_str().ok()).map(str::to_owned);
        let retry_after = response.headers().get("retry-after").and_then(|v| v.to_str().ok()?.parse().ok());
        let text = response.text().await?;
        let data = text.lines().filter_map(|l| l.strip_prefix("data:")).map(str::trim).find(|d| d.starts_with('{'));
        let message = serde_json::from_str(data.unwrap_or(&text)).unwrap_or(Value::Null);
        Ok(Answer { status, session_id, message, retry_after })
    }

    /// `initialize` then `notifications/initialized`; returns the initialize's status (200 when
    /// a session was opened; then `id` is set).
    pub(crate) async fn open(&mut self) -> Result<u16, reqwest::Error> {
        let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "harden", "version": "1"}}});
        let answer = self.post(&init).await?;
        if answer.status != 200 {
            return Ok(answer.status);
        }
        self.id = answer.session_id;
        self.post(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"})).await?;
        Ok(answer.status)
    }

    /// `tools/call`.
    pub(crate) async fn call(&self, tool: &str, arguments: Value) -> Result<Answer, reqwest::Error> {
        let id = self.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.post(&json!({"jsonrpc": "2.0", "id": id, "method": "tools/call",
            "params": {"name": tool, "arguments": arguments}}))
            .await
    }

    /// `ping`: the status tells whether the session still exists (404 once it is gone).
    pub(crate) async fn ping(&self) -> Result<u16, reqwest::Error> {
        let id = self.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(self.post(&json!({"jsonrpc": "2.0", "id": id, "method": "ping"})).await?.status)
    }
}

/// The `q`-quantile (0.0-1.0) of `samples`, nearest rank.
pub(crate) fn quantile(samples: &[Duration], q: f64) -> Duration {
    let mut sorted = samples.to_vec();
    sorted.sort();
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}
