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

pub type Client = RunningService<RoleClient, ()>;

/// A server started in-process on a free loopback port, on a manual clock.
pub struct TestServer {
    pub app: Arc<App>,
    pub clock: Arc<ManualClock>,
    pub addr: std::net::SocketAddr,
    pub url: String,
}

impl TestServer {
    /// Starts a server with the defaults plus `toml`.
    pub async fn start(toml: &str) -> Self {
        let config = Config::from_toml(toml).expect("test config is valid");
        let clock = ManualClock::new();
        let app = Arc::new(App::start(config, clock.clone()).await.expect("server starts"));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let serving = app.clone();
        tokio::spawn(async move { serving.serve_http(listener).await });
        Self { app, clock, addr, url: format!("http://{addr}/mcp") }
    }

    /// An MCP client presenting `token` as a Bearer credential (or none).
    pub async fn client(&self, token: Option<&str>) -> Client {
        let mut config = StreamableHttpClientTransportConfig::with_uri(self.url.clone());
        if let Some(token) = token {
            config = config.auth_header(token);
        }
        ().serve(StreamableHttpClientTransport::from_config(config)).await.expect("client connects")
    }

    /// The embedded mock upstream's usage counters.
    pub async fn upstream_usage(&self) -> Value {
        let url = format!("{}/v1/usage", self.app.upstream_url());
        reqwest::get(url).await.expect("usage").json().await.expect("usage json")
    }

    pub fn advance_secs(&self, secs: f64) {
        self.clock.advance(std::time::Duration::from_secs_f64(secs));
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.app.stop();
    }
}

/// Calls `tool` with `args`; panics on a protocol error (refusals are results, not errors).
pub async fn call(client: &Client, tool: &str, args: Value) -> CallToolResult {
    let mut params = CallToolRequestParams::new(tool.to_owned());
    if let Value::Object(map) = args {
        params = params.with_arguments(map);
    }
    client.call_tool(params).await.expect("tools/call answered")
}

pub fn is_error(r: &CallToolResult) -> bool {
    r.is_error == Some(true)
}

pub fn structured(r: &CallToolResult) -> &Value {
    r.structured_content.as_ref().expect("structuredContent present")
}

pub fn error_code(r: &CallToolResult) -> Option<&str> {
    r.structured_content.as_ref()?.get("error")?.get("code")?.as_str()
}

pub fn text(r: &CallToolResult) -> String {
    r.content.iter().filter_map(|c| c.as_text().map(|t| t.text.clone())).collect::<Vec<_>>().join("\n")
}

/// Calls `tool` until it is refused; returns how many calls passed.
pub async fn spend_until_refused(client: &Client, tool: &str, args: Value, max: usize) -> (usize, CallToolResult) {
    for passed in 0..max {
        let r = call(client, tool, args.clone()).await;
        if is_error(&r) {
            return (passed, r);
        }
    }
    panic!("{tool} was never refused in {max} calls");
}
