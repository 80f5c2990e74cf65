//! mcp-ratelimit: the reference MCP server that keeps AI agents from running up a bill, built
//! on its own library.
//!
//! **The layers are crates** (Cargo keeps them apart; nothing here can reach below a layer's
//! public face):
//! - `mcp-ratelimit-core` (`crates/core`): the limiting core, which knows nothing of MCP, HTTP or
//!   Redis: [`clock`], [`limit`] (the algorithms), [`store`] (the traits and the memory store),
//!   [`guard`] (the one guarded call), [`identity`], [`config`]'s limits sections, [`breaker`],
//!   [`redact`], and apart from the pipeline [`ops`] (metrics, the dashboard's activity) and
//!   [`operator`] (what the admin API may do to budgets);
//! - `mcp-ratelimit-redis` (`crates/redis`): the Redis store and its Lua ([`store::redis`]);
//! - `mcp-ratelimit-rmcp` (`crates/rmcp`): what an rmcp server depends on: [`RateLimits`], the
//!   guarded router ([`mcp::limited`], [`mcp::results`]) and the tower layers ([`http`]);
//! - this crate, the server: [`mcp::server`] and [`mcp::tools`] (seven tools over a paid API),
//!   [`upstream`] (jobs, the fair queue, backoff), [`proxy`], [`state`] (what every session
//!   shares), [`dashboard`], [`admin`], [`reload`], [`simulate`], [`mock_upstream`], the
//!   server's sections of [`config`], and [`app`], which wires it together.
//!
//! The lower crates' modules are re-exported under the same names, so a path reads the same
//! from here (`mcp_ratelimit::guard::Guard`) as in the crate that defines it.

#![warn(missing_docs)]

pub mod admin;
pub mod app;
pub mod config;
pub mod dashboard;
pub mod http;
pub mod mcp;
pub mod mock_upstream;
pub mod proxy;
pub mod reload;
pub mod simulate;
pub mod state;
pub mod telemetry;
pub mod upstream;
pub mod webhook;

pub use mcp_ratelimit_core::{breaker, clock, guard, identity, limit, operator, ops, redact};
pub use mcp_ratelimit_rmcp::{oauth, rate_limits};

/// Where limiter state lives: the core's traits and memory store, and the Redis store.
pub mod store {
    pub use mcp_ratelimit_core::store::*;
    pub use mcp_ratelimit_redis as redis;
    pub use mcp_ratelimit_redis::RedisStore;
}

pub use app::App;
pub use config::{Catalogue, Config};
pub use mcp::LimitedRouter;
pub use rate_limits::RateLimits;
