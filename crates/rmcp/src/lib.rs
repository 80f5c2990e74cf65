//! mcp-ratelimit for any rmcp server: build [`RateLimits`] from a config and the
//! [`Catalogue`] of your tools, wrap your `ToolRouter` in a [`LimitedRouter`]
//! (or run [`limited::call_tool`] in your own `call_tool`), and put [`RateLimits::http_layer`] in
//! front of your axum router. Every call then runs the one guarded call of the core: checked,
//! priced, admitted in every scope at once, shared with identical calls, settled, and refused
//! with a wait the agent can believe.
//!
//! The core's modules are re-exported here, so this is the one crate a library user names.
//! With the feature `redis`, `store.backend = "redis"` keeps one budget across many instances
//! ([`redis`]).

#![warn(missing_docs)]

pub mod http;
pub mod limited;
#[cfg(feature = "oauth")]
pub mod oauth;
pub mod rate_limits;
pub mod raw;
pub mod results;
pub mod trace;

pub use mcp_ratelimit_core::{breaker, clock, config, guard, identity, limit, operator, ops, redact, store};
/// The Redis store (the crate `mcp-ratelimit-redis`).
#[cfg(feature = "redis")]
pub use mcp_ratelimit_redis as redis;

pub use config::{Catalogue, LimitsConfig};
pub use limited::LimitedRouter;
pub use rate_limits::RateLimits;
