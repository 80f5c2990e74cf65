//! mcp-ratelimit: a reference MCP server that keeps AI agents from running up a bill.
//!
//! The layers, outside in: [`http`] (transport) and [`mcp`] (the rmcp handler and tools) hand
//! every tool call to the [`guard`], which names the caller ([`identity`]), prices the call
//! ([`config`] costs) and asks the [`limit`] algorithms, whose state lives in a [`store`], all on
//! one [`clock`], and [`metrics`] shows what they decide ([`activity`]: the last ten minutes, for the
//! dashboard); [`simulate`] replays agents against them. Tools reach the paid API through
//! [`upstream`]; [`mock_upstream`] stands in for it. [`app`] wires it together, and [`reload`] puts
//! new limits in force on a running server.

pub mod activity;
pub mod admin;
pub mod app;
pub mod breaker;
pub mod clock;
pub mod config;
pub mod guard;
pub mod http;
pub mod identity;
pub mod limit;
pub mod mcp;
pub mod metrics;
pub mod mock_upstream;
pub mod rate_limits;
pub mod reload;
pub mod simulate;
pub mod state;
pub mod store;
pub mod upstream;

pub use app::App;
pub use config::{Catalogue, Config};
pub use mcp::LimitedRouter;
pub use rate_limits::RateLimits;
