//! What the reference server does around the limits, through MCP clients: jobs and their slots,
//! the paid upstream's queue, backoff and breaker under chaos, loop detection, coalescing and
//! reused answers, the admin API and the dashboard (in headless Chromium).
//!
//! One test binary of modules (one per subject), so the crate is linked once for all of them.

// The shared helpers, one copy each in this binary.
#[path = "../common/browser.rs"]
mod browser;
#[path = "../common/mod.rs"]
mod common;
#[path = "../common/otlp.rs"]
mod otlp;
#[path = "../common/python.rs"]
mod python;
#[path = "../common/redis.rs"]
mod test_redis;

mod admin;
mod chaos;
mod dashboard;
mod dashboard_auth;
mod jobs;
mod loops;
mod mock_webhooks;
mod reuse;
mod telemetry;
mod upstream;
mod webhooks;
