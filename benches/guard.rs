//! What the limiter costs one served `tools/call`, without the HTTP server, rmcp or the tool
//! around it: the number the whole-server runs (`scripts/bench-compare.sh`) can only estimate as
//! the difference of two noisy throughputs.
//!
//! Run with `cargo bench --bench guard`. Under `cargo test` each benchmark runs once.
//!
//! Every benchmark names a caller with a made-up bearer token from 127.0.0.1, as the `generous`
//! whole-server scenario does (so its address's scopes are charged too), on the memory store and
//! the system clock, and walks `list_articles` through eleven pages so loop detection does its work
//! and never fires:
//!
//! * `served_call/limited`: the HTTP layer's decision (`http` and `address_http`) with its three
//!   RateLimit headers, then the tool guard's (method, caller, address, the tool's address budget,
//!   the operator's blocks, the loop check), the admission dropped as a finished call drops it;
//! * `served_call/unshed`: `limited` with `[server.shedding]` off: `limited` over it is what
//!   judging each call's queueing delay costs (every call here carries its arrival, as the HTTP
//!   layer stamps it);
//! * `served_call/off`: the same with `limits.enabled = false`: naming the caller, and the two
//!   early returns;
//! * `served_call/limited_minus_off` is not a benchmark: subtract the two medians.

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};

use criterion::{Criterion, criterion_group, criterion_main};
use mcp_ratelimit::RateLimits;
use mcp_ratelimit::clock::SystemClock;
use mcp_ratelimit::config::LimitsConfig;
use mcp_ratelimit::guard::{Call, Called, Worked};
use mcp_ratelimit::http::limit::rate_limit_headers;
use mcp_ratelimit::identity::Identity;
use mcp_ratelimit::mcp::limited::{Plain, ToolAnswer};
use rmcp::model::{CallToolResponse, CallToolResult};

/// Every limit the caller draws on, never refusing (as `scripts/bench-compare.sh`'s `generous`).
fn generous() -> String {
    ["http", "method.tools_call", "caller", "address", "address_http"]
        .map(|scope| format!("[limits.{scope}]\nburst = 1000000000\nrefill_per_sec = 1000000000.0\n"))
        .concat()
}

fn limits(toml: &str, runtime: &tokio::runtime::Runtime) -> RateLimits {
    let tools = mcp_ratelimit::mcp::tools::catalogue();
    let config = LimitsConfig::from_toml(toml, &tools).expect("the bench's config is valid");
    runtime.block_on(RateLimits::start(&config, tools, SystemClock::shared())).expect("memory limits start")
}

/// A tool's answer, as the router gives it.
fn answered() -> CallToolResponse {
    CallToolResponse::Complete(CallToolResult::success(vec![]))
}

fn served_call(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    let pages: Vec<serde_json::Value> =
        (0..=100).step_by(10).map(|cursor| serde_json::json!({ "cursor": cursor.to_string() })).collect();
    let mut headers = http::HeaderMap::new();
    headers.insert(http::header::AUTHORIZATION, http::HeaderValue::from_static("Bearer bench-made-up-key"));
    let peer = Some(IpAddr::V4(Ipv4Addr::LOCALHOST));
    let mut group = c.benchmark_group("served_call");
    let variants = [
        ("limited", generous()),
        ("unshed", format!("{}[server.shedding]\nenabled = false\n", generous())),
        ("off", format!("{}[limits]\nenabled = false\n", generous())),
    ];
    for (name, toml) in variants {
        let limits = limits(&toml, &runtime);
        let mut n = 0usize;
        group.bench_function(name, |b| {
            b.iter(|| {
                n = n.wrapping_add(1);
                let args = &pages[n % pages.len()];
                runtime.block_on(async {
                    let caller = limits
                        .identifier()
                        .load()
                        .identify(&headers, peer)
                        .map(Identity::without_verifying)
                        .expect("a caller");
                    if let Some((decision, policy)) = limits.guard().admit_http(&caller).await {
                        assert!(decision.allowed, "the generous HTTP limit refused");
                        black_box(rate_limit_headers(&decision, &policy));
                    }
                    let args = args.as_object().expect("an object");
                    let mut call = Call::new("list_articles", &caller, args);
                    // Stamped as the identify layer stamps a request that has just arrived.
                    call.arrived = Some(limits.clock().now());
                    // The one guarded call every door runs, its work answering at once.
                    let work =
                        |_, _: &serde_json::Value| std::future::ready(Worked::Answer(ToolAnswer::new(Ok(answered()))));
                    let called = limits.guard().call(&Plain, Some(limits.reuse()), call, work).await;
                    assert!(matches!(called, Called::Answered { .. }), "the generous guard refused");
                    black_box(called);
                });
            });
        });
    }
    group.finish();
}

criterion_group!(benches, served_call);
criterion_main!(benches);
