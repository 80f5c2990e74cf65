//! The header parsers, fed any bytes a client (or an upstream) can send: `Retry-After` in both
//! forms, `X-Forwarded-For`, `Authorization` / `X-API-Key`, `Host` / `Origin`. Each answers
//! something sane and never panics.
#![no_main]

use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, SystemTime};

use axum::body::Body;
use http::{HeaderMap, HeaderValue, Request};
use libfuzzer_sys::fuzz_target;
use mcp_ratelimit::clock::SystemClock;
use mcp_ratelimit::http::front_door::{AllowedHosts, FrontDoorLog, rebinding_protection};
use mcp_ratelimit::identity::{Identifier, Identity};
use mcp_ratelimit::mcp::tools::catalogue;
use mcp_ratelimit::upstream::backoff::parse_retry_after;
use mcp_ratelimit::Config;
use tower::ServiceExt;

struct World {
    runtime: tokio::runtime::Runtime,
    identifier: Identifier,
    hosts: axum::Router,
}

static WORLD: LazyLock<World> = LazyLock::new(|| {
    let toml = "[server]\ntrust_proxy = true\ntrusted_proxies = [\"10.0.0.0/8\", \"::1\"]\n\
                [[auth.keys]]\nkey = \"known\"\ntenant = \"t\"\n";
    let config = Config::from_toml(toml, &catalogue()).expect("config");
    let log = Arc::new(FrontDoorLog::new(SystemClock::shared()));
    let allowed =
        Arc::new(AllowedHosts::new(config.server.allowed_hosts.clone(), config.server.allowed_origins.clone(), log));
    let hosts = axum::Router::new()
        .route("/", axum::routing::post(|| async { "in" }))
        .layer(rebinding_protection(allowed));
    let runtime = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
    World { runtime, identifier: Identifier::new(&config.limiting), hosts }
});

fuzz_target!(|data: &[u8]| {
    let world = &*WORLD;
    // Five values, split at 0xFF 0x00 pairs in the input.
    let mut parts = data.split(|&b| b == 0);
    let mut next = || parts.next().unwrap_or_default();
    let (retry, auth, key, forwarded, host) = (next(), next(), next(), next(), next());
    let origin = next();

    if let Ok(text) = std::str::from_utf8(retry) {
        if let Some(wait) = parse_retry_after(text, SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000)) {
            assert!(wait <= Duration::from_secs(24 * 60 * 60), "{text:?} read as {wait:?}");
        }
    }

    let mut headers = HeaderMap::new();
    for (name, bytes) in [("authorization", auth), ("x-api-key", key), ("x-forwarded-for", forwarded)] {
        if let Ok(value) = HeaderValue::from_bytes(bytes) {
            headers.insert(name, value);
        }
    }
    let peer = Some(IpAddr::V4(Ipv4Addr::new(10, 1, 2, 3)));
    let caller = world.identifier.identify(&headers, peer).map(Identity::without_verifying).expect("keys are not required");
    assert!(caller.id().starts_with("tok:") || caller.id().starts_with("ip:") || caller.id().starts_with("ip6:"));
    assert!(caller.id().len() <= 64, "{}", caller.id());

    let mut request = Request::post("/");
    for (name, bytes) in [("host", host), ("origin", origin)] {
        if let Ok(value) = HeaderValue::from_bytes(bytes) {
            request = request.header(name, value);
        }
    }
    let Ok(request) = request.body(Body::empty()) else { return };
    let status = world.runtime.block_on(world.hosts.clone().oneshot(request)).expect("infallible").status();
    assert!(status == 200 || status == 403, "{status}");
});
