//! mcp-ratelimit: limits that keep AI agents from running up a bill, as a library for any rmcp
//! server, and the reference MCP server built on it.
//!
//! **As a library**: build [`RateLimits`] from a config and the [`Catalogue`] of your tools, wrap
//! your `ToolRouter` in a [`LimitedRouter`] (or run [`mcp::limited::call_tool`] in your own
//! `call_tool`), and put [`RateLimits::http_layer`] in front of your axum router. See
//! `examples/rmcp_server.rs` and `examples/axum_only.rs`.
//!
//! **The layers**, inside out; no module imports one above it, and no two import each other:
//! - the core, which knows nothing of MCP or of any tool: [`clock`] (the one source of time),
//!   [`limit`] (the algorithms), [`store`] (their state: memory or Redis), [`guard`] (every scope
//!   of a call decided at once, refusals), [`identity`] (who calls), [`config`] (typed and
//!   validated, checked against the catalogue passed down), [`metrics`], [`activity`] (the last
//!   ten minutes, for the dashboard), [`breaker`] and [`redact`] (what is never printed);
//! - the library around it: [`rate_limits`] (the handle), [`http`] (tower layers) and the rmcp
//!   glue in [`mcp::limited`] and [`mcp::results`];
//! - this server: [`mcp::server`] and [`mcp::tools`] (seven tools over a paid API), [`upstream`]
//!   (jobs, the fair queue, backoff), [`state`] (what every session shares), [`dashboard`], [`admin`],
//!   [`reload`], [`simulate`] and [`mock_upstream`];
//! - [`app`], which wires the server together; nothing imports it.

#![warn(missing_docs)]

pub mod activity;
pub mod admin;
pub mod app;
pub mod breaker;
pub mod clock;
pub mod config;
pub mod dashboard;
pub mod guard;
pub mod http;
pub mod identity;
pub mod limit;
pub mod mcp;
pub mod metrics;
pub mod mock_upstream;
pub mod proxy;
pub mod rate_limits;
pub mod redact;
pub mod reload;
pub mod simulate;
pub mod state;
pub mod store;
pub mod upstream;

pub use app::App;
pub use config::{Catalogue, Config};
pub use mcp::LimitedRouter;
pub use rate_limits::RateLimits;
