//! The server's configuration: the limits' sections (read by the core,
//! [`LimitsConfig`]) and the server's own around them, from one file.
//!
//! Layers, last wins: the documented defaults (`config.toml` at the repository root, compiled
//! in), then the user's file, then `MCP_RL__SECTION__KEY` environment variables
//! ([`Document`]). Whatever the layers say is validated before the server starts; every error
//! names the key to fix.
//!
//! | section | file |
//! | --- | --- |
//! | the limits' sections (`[limits]`, `[tools.NAME]`, `[auth]`, `[tiers]`, `[spend_caps]`, `[tenants.NAME]`, `[store]`, `[loop_detection]`) | `mcp_ratelimit_core::config` |
//! | `[server]`, `[admin]` | [`server`] |
//! | `[upstream]`, `[mock_upstream]` | [`upstream`] |
//! | `[proxy]` (the server `mcp-ratelimit proxy` stands in front of) | [`proxy`] |
//! | `[telemetry]` (OpenTelemetry traces) | [`telemetry`] |
//!
//! This file reads the document, has the core check the limits' sections, then checks the
//! server's; `table.rs` prints the effective limits for `check-config`.

pub mod proxy;
pub mod server;
mod table;
pub mod telemetry;
pub mod upstream;

use std::path::Path;

use serde::Deserialize;

pub use mcp_ratelimit_core::config::*;
pub use proxy::{ProxyConfig, UpstreamProtocol, UpstreamSessions};
pub use server::{AdminConfig, ServerConfig};
pub use telemetry::TelemetryConfig;
pub use upstream::{AdaptiveConfig, MockUpstreamConfig, UpstreamConfig, WEBHOOK_PATH};

/// The validated configuration the server runs on: the limits' own ([`LimitsConfig`], all a
/// library user needs), and the server's listeners, paid API and mock around them.
#[derive(Debug, Clone)]
pub struct Config {
    /// Every budget, cost and cap, who callers are, and where the state lives.
    pub limiting: LimitsConfig,
    /// The HTTP transport.
    pub server: ServerConfig,
    /// The paid API behind the tools.
    pub upstream: UpstreamConfig,
    /// The mock paid API's knobs.
    pub mock_upstream: MockUpstreamConfig,
    /// The admin API's listener and key.
    pub admin: AdminConfig,
    /// The server `mcp-ratelimit proxy` stands in front of.
    pub proxy: ProxyConfig,
    /// Where traces go, if anywhere (`None`: off).
    pub telemetry: Option<TelemetryConfig>,
    /// The address `/mcp` is served at, once [`Config::serving_at`] said it (`None` on stdio).
    pub served_at: Option<std::net::SocketAddr>,
}

/// The server's own sections, as written (the limits' are the core's to read).
#[derive(Debug, Deserialize)]
struct RawServerSections {
    server: server::RawServer,
    upstream: UpstreamConfig,
    mock_upstream: MockUpstreamConfig,
    admin: server::RawAdmin,
    proxy: ProxyConfig,
    telemetry: telemetry::RawTelemetry,
}

impl Config {
    /// Loads defaults, then `file` (required when given, else `./config.toml` if present),
    /// then the environment, and validates the result against the server's `tools`.
    pub fn load(file: Option<&Path>, tools: &Catalogue) -> Result<Self, ConfigError> {
        Self::from_document(&Document::load(file, tools)?, tools)
    }

    /// The defaults plus `toml`, without the environment (for tests and embedding), checked
    /// against the server's `tools`.
    ///
    /// ```
    /// use mcp_ratelimit::config::{Catalogue, Config};
    ///
    /// let tools = Catalogue::new().tool("search");
    /// let config = Config::from_toml("[tools.search]\ncost = 2\n", &tools)?;
    /// assert_eq!(config.limiting.tools["search"].cost, 2);
    /// // A tool the server does not have is a mistake, named with the key to fix.
    /// let typo = Config::from_toml("[tools.serach]\ncost = 2\n", &tools).unwrap_err();
    /// assert!(typo.to_string().contains("tools.serach"));
    /// # Ok::<(), mcp_ratelimit::config::ConfigError>(())
    /// ```
    pub fn from_toml(toml: &str, tools: &Catalogue) -> Result<Self, ConfigError> {
        Self::from_document(&Document::from_toml(toml, tools)?, tools)
    }

    /// The documented defaults alone.
    pub fn defaults(tools: &Catalogue) -> Result<Self, ConfigError> {
        Self::from_toml("", tools)
    }

    /// The limits' sections checked by the core, then the server's, in the order a reader meets
    /// them; the first error names its key.
    fn from_document(document: &Document, tools: &Catalogue) -> Result<Self, ConfigError> {
        let raw = document.section::<RawServerSections>()?;
        let limiting = LimitsConfig::from_document(document, tools)?;
        raw.proxy.validate()?;
        let server = raw.server.validate(&limiting.proxies)?;
        raw.upstream.validate()?;
        raw.upstream.validate_tiers(&limiting.tiers)?;
        if limiting.store.backend == Backend::Redis {
            // The backend reads its own URL: one server, or a cluster's seed nodes.
            mcp_ratelimit_redis::RedisStore::check_url(&limiting.store.redis_url)
                .map_err(|e| invalid("store.redis_url", e.to_string()))?;
        }
        raw.mock_upstream.validate()?;
        let admin = raw.admin.validate()?;
        let telemetry = raw.telemetry.validate()?;
        Ok(Config {
            limiting,
            server,
            upstream: raw.upstream,
            mock_upstream: raw.mock_upstream,
            admin,
            proxy: raw.proxy,
            telemetry,
            served_at: None,
        })
    }

    /// This config served over HTTP at `addr`: an access token's audience, when
    /// `auth.oauth.audience` is not set, is the MCP URL the server prints (`http://{addr}/mcp`).
    /// An unspecified address (`0.0.0.0`, `::`) names no URL a client could use, so then the
    /// audience must be set.
    pub fn serving_at(mut self, addr: std::net::SocketAddr) -> Result<Self, ConfigError> {
        let oauth = &mut self.limiting.auth.oauth;
        if oauth.enabled() && oauth.audience.is_empty() {
            if addr.ip().is_unspecified() {
                return Err(invalid(
                    "auth.oauth.audience",
                    format!(
                        "must be set when serving on {addr}: tokens are issued for this server's public URL \
                         (e.g. \"https://mcp.example.com/mcp\"), which an unspecified address does not name"
                    ),
                ));
            }
            oauth.audience = format!("http://{addr}/mcp");
        }
        self.served_at = Some(addr);
        Ok(self)
    }
}

#[cfg(test)]
mod tests;
