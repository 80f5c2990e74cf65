//! The kernel of mcp-ratelimit, what changes least: the way governor is a kernel for tower's
//! rate limits, this crate is one for ours, and the Redis store depends on it alone.
//!
//! Inside out:
//! - [`clock`]: the one source of time (a test walks a minute in a millisecond);
//! - [`limit`]: the seven algorithms, each a pure function of its state and the time;
//! - [`store`]: where their state lives: the [`Store`](store::Store) traits any backend
//!   implements, the suite every backend passes, and this process's memory
//!   ([`MemoryStore`](store::MemoryStore)); the Redis backend is the crate `mcp-ratelimit-redis`;
//! - [`redact`]: what is never printed (a secret, a URL's password).
//!
//! The guard that decides every scope of a call at once, callers and the limits' config are the
//! crate `mcp-ratelimit-core`, built on this one.

#![warn(missing_docs)]

pub mod clock;
pub mod limit;
pub mod redact;
pub mod store;
