//! The limiting core of mcp-ratelimit: everything that decides whether a call may run, and
//! nothing of MCP, HTTP or Redis (Cargo keeps it so: this crate depends on none of them).
//!
//! Inside out:
//! - [`clock`]: the one source of time (a test walks a minute in a millisecond);
//! - [`limit`]: the seven algorithms, each a pure function of its state and the time;
//! - [`store`]: where their state lives: the [`Store`](store::Store) traits any backend
//!   implements, and this process's memory ([`MemoryStore`](store::MemoryStore)); the Redis
//!   backend is the crate `mcp-ratelimit-redis`;
//! - [`guard`]: every scope of a call decided at once, the one guarded call
//!   ([`Guard::call`](guard::Guard::call)), refusals an agent can act on, loops, settlement;
//! - [`identity`] (who calls), [`config`] (the limits' part of the file, typed and validated),
//!   [`metrics`], [`activity`] (the last ten minutes, for a dashboard), [`breaker`] and
//!   [`redact`] (what is never printed).
//!
//! The rmcp integration (`RateLimits`, the guarded router, the tower layers) is the crate
//! `mcp-ratelimit-rmcp`, and the reference server is `mcp-ratelimit`.

#![warn(missing_docs)]

pub mod activity;
pub mod breaker;
pub mod clock;
pub mod config;
pub mod guard;
pub mod identity;
pub mod limit;
pub mod metrics;
pub mod redact;
pub mod store;
