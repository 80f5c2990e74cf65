//! An rmcp server with two tools of its own, and our limits: per-caller budgets with a cost per
//! tool, an in-flight cap on the slow tool, and refusals an agent can act on.
//!
//! ```text
//! cargo run --example rmcp_server            # MCP at http://127.0.0.1:8080/mcp
//! LISTEN=127.0.0.1:0 cargo run --example rmcp_server
//! ```

use std::net::SocketAddr;

use mcp_ratelimit_rmcp::{Catalogue, LimitedRouter, RateLimits};
use rmcp::handler::server::wrapper::Parameters;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ServerHandler, tool, tool_handler, tool_router};

/// Each caller: 5 tokens, refilled at one every 10 s; `define` costs 1, `summarise` 2, and a
/// caller may run one `summarise` at a time.
const LIMITS: &str = r#"
[limits.caller]
algorithm = "token_bucket"
burst = 5
refill_per_sec = 0.1

[limits.in_flight]
caller = 1

[tools.define]
cost = 1

[tools.summarise]
cost = 2
"#;

#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
struct Word {
    /// The word to define.
    word: String,
}

#[derive(Clone)]
struct Dictionary {
    tools: LimitedRouter<Self>,
}

#[tool_router]
impl Dictionary {
    #[tool(description = "Define a word.")]
    async fn define(&self, Parameters(Word { word }): Parameters<Word>) -> String {
        format!("{word}: a word worth knowing.")
    }

    #[tool(description = "Summarise a long text about a word (slow).")]
    async fn summarise(&self, Parameters(Word { word }): Parameters<Word>) -> String {
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        format!("A summary of everything about {word}.")
    }
}

#[tool_handler(router = self.tools)]
impl ServerHandler for Dictionary {}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Our limits: the tools they price, and the budgets.
    let limits = RateLimits::from_toml(LIMITS, Catalogue::new().tool("define").job("summarise")).await?;
    let server = Dictionary { tools: LimitedRouter::new(Dictionary::tool_router(), limits.clone()) };

    let mcp = StreamableHttpService::new(
        move || Ok(server.clone()),
        LocalSessionManager::default().into(),
        StreamableHttpServerConfig::default(),
    );
    // Our HTTP layer names each caller (its key's hash, else its address) for the budgets.
    let app = axum::Router::new().nest_service("/mcp", mcp).layer(limits.http_layer());

    let listen: SocketAddr = std::env::var("LISTEN").unwrap_or_else(|_| "127.0.0.1:8080".into()).parse()?;
    let listener = tokio::net::TcpListener::bind(listen).await?;
    println!("listening on http://{}/mcp", listener.local_addr()?);
    axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await?;
    Ok(())
}
