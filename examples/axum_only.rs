//! An axum app that is not an MCP server at all, using only our HTTP layer: each caller gets a
//! budget of requests, and a caller over it gets 429 with `Retry-After` and the RateLimit headers.
//!
//! ```text
//! cargo run --example axum_only              # http://127.0.0.1:8081/search?q=rust
//! ```

use std::net::SocketAddr;

use axum::routing::get;
use mcp_ratelimit_rmcp::{Catalogue, RateLimits};

/// Each caller: 3 requests at once, refilled at one every 5 seconds.
const LIMITS: &str = r#"
[limits.http]
algorithm = "token_bucket"
burst = 3
refill_per_sec = 0.2
"#;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // No MCP tools here: the catalogue is empty, and only the HTTP budget applies.
    let limits = RateLimits::from_toml(LIMITS, Catalogue::new()).await?;
    let app =
        axum::Router::new().route("/search", get(|| async { "results" })).layer(limits.http_layer().every_method());

    let listen: SocketAddr = std::env::var("LISTEN").unwrap_or_else(|_| "127.0.0.1:8081".into()).parse()?;
    let listener = tokio::net::TcpListener::bind(listen).await?;
    println!("listening on http://{}/search", listener.local_addr()?);
    axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await?;
    Ok(())
}
