//! The limiting core of mcp-ratelimit: everything that decides whether a call may run, and
//! nothing of MCP, HTTP or Redis (Cargo keeps it so: this crate depends on none of them).
//!
//! Inside out, on the kernel (`mcp-ratelimit-kernel`, re-exported here: [`clock`], [`limit`],
//! [`store`], [`redact`]: the clock, the seven algorithms, the store traits and the memory store):
//! - [`guard`]: every scope of a call decided at once, the one guarded call
//!   ([`Guard::call`](guard::Guard::call)), refusals an agent can act on, loops, settlement;
//! - [`identity`] (who calls), [`config`] (the limits' part of the file, typed and validated)
//!   and [`breaker`];
//! - apart from that pipeline: the operations views it writes to, [`ops`] ([`ops::metrics`],
//!   [`ops::activity`]: the last ten minutes, for a dashboard), and what an operator may do to
//!   its budgets ([`operator`]).
//!
//! The rmcp integration (`RateLimits`, the guarded router, the tower layers) is the crate
//! `mcp-ratelimit-rmcp`, and the reference server is `mcp-ratelimit`.

#![warn(missing_docs)]

pub mod breaker;
pub mod config;
pub mod guard;
pub mod identity;
pub mod operator;
pub mod ops;

pub use mcp_ratelimit_kernel::{clock, limit, redact, store};
