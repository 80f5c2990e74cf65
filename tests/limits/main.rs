//! How limits decide and where their state lives: every algorithm against its reference model, in
//! memory and in Redis's Lua; the Redis store alone, on a cluster and shared by instances;
//! budgets, tenants, tiers, in-flight slots, prices and lowered limits through MCP.
//!
//! One test binary of modules (one per subject), so the crate is linked once for all of them.

// The shared helpers, one copy each in this binary.
#[path = "../common/algorithm_suite.rs"]
mod algorithm_suite;
#[path = "../common/mod.rs"]
mod common;
#[path = "../common/oauth.rs"]
mod oauth;
#[path = "../common/python.rs"]
mod python;
#[path = "../common/redis.rs"]
mod test_redis;

mod account;
mod adjust;
mod algorithms;
mod algorithms_redis;
mod budget_http;
mod contention;
mod in_flight;
mod job_ends;
mod lowered_limits;
mod operate;
mod pricing;
mod redis_cluster;
mod redis_store;
mod result_loops;
mod round_trips;
mod shared_line;
mod shared_store;
mod shedding;
mod slices;
mod tenants;
