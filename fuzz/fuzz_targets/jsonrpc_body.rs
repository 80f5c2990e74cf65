//! The JSON-RPC body at the HTTP front door: any bytes POSTed to `/mcp`, in a session or not,
//! through the whole router (front door, HTTP limit, rmcp, the tools). The answer is never a 5xx
//! and the server never panics.
#![no_main]

use std::sync::{Arc, LazyLock};

use axum::body::Body;
use http::Request;
use libfuzzer_sys::fuzz_target;
use mcp_ratelimit::clock::ManualClock;
use mcp_ratelimit::mcp::tools::catalogue;
use mcp_ratelimit::{App, Config};
use tower::ServiceExt;

struct World {
    runtime: tokio::runtime::Runtime,
    router: axum::Router,
    session: String,
    _app: Arc<App>,
}

const INIT: &str = r#"{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"fuzz","version":"1"}}}"#;

fn post(body: Vec<u8>, session: Option<&str>) -> Request<Body> {
    let mut request = Request::post("/mcp")
        .header("host", "localhost")
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream");
    if let Some(session) = session {
        request = request.header("mcp-session-id", session).header("mcp-protocol-version", "2025-11-25");
    }
    request.body(Body::from(body)).expect("request")
}

static WORLD: LazyLock<World> = LazyLock::new(|| {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    // Roomy limits: the fuzzer should reach rmcp and the tools, not stop at the 429.
    let toml = "[limits.http]\nburst = 1000000000\nrefill_per_sec = 1000000000.0\n\
                [limits.method.other]\nburst = 1000000000\nrefill_per_sec = 1000000000.0\n";
    let config = Config::from_toml(toml, &catalogue()).expect("config");
    let (app, router, session) = runtime.block_on(async {
        let app = Arc::new(App::start(config, ManualClock::new()).await.expect("app"));
        let router = app.router();
        let answer = router.clone().oneshot(post(INIT.as_bytes().to_vec(), None)).await.expect("infallible");
        let session = answer.headers()["mcp-session-id"].to_str().expect("ascii").to_owned();
        let initialized = br#"{"jsonrpc":"2.0","method":"notifications/initialized"}"#.to_vec();
        router.clone().oneshot(post(initialized, Some(&session))).await.expect("infallible");
        (app, router, session)
    });
    World { runtime, router, session, _app: app }
});

fuzz_target!(|data: &[u8]| {
    let world = &*WORLD;
    let Some((&flags, body)) = data.split_first() else { return };
    let session = (flags & 1 == 1).then_some(world.session.as_str());
    let status = world.runtime.block_on(async {
        let answer = world.router.clone().oneshot(post(body.to_vec(), session)).await.expect("infallible");
        let status = answer.status();
        // Read the body to its end: an SSE answer is produced while it is read.
        let _ = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            axum::body::to_bytes(answer.into_body(), 1 << 20),
        )
        .await;
        status
    });
    assert!(!status.is_server_error(), "{status} for {:?}", String::from_utf8_lossy(body));
});
