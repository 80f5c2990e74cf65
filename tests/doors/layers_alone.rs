//! Each HTTP layer on its own, with `oneshot` and no server: it takes only what it needs (the
//! guard, the identifier, the allowed hosts), so it can be put in any axum or tower stack.

use std::sync::Arc;

use arc_swap::ArcSwap;
use axum::body::Body;
use axum::response::Response;
use http::{Request, StatusCode};
use mcp_ratelimit::clock::ManualClock;
use mcp_ratelimit::config::{Catalogue, LimitsConfig};
use mcp_ratelimit::guard::Guard;
use mcp_ratelimit::http::front_door::{AllowedHosts, FrontDoorLog, rebinding_protection};
use mcp_ratelimit::http::identify::{Callers, IdentifyLayer};
use mcp_ratelimit::http::limit::HttpLimitLayer;
use mcp_ratelimit::identity::{Caller, Identifier};
use mcp_ratelimit::ops::metrics::Metrics;
use mcp_ratelimit::store::MemoryStore;
use tower::{Layer, ServiceExt, service_fn};

/// The innermost service: 200, saying which caller it was handed (or none).
async fn echo_caller(request: Request<Body>) -> Result<Response, std::convert::Infallible> {
    let who = request.extensions().get::<Caller>().map_or("nobody".to_owned(), |c| c.id().to_owned());
    Ok(Response::new(Body::from(who)))
}

fn config(toml: &str) -> LimitsConfig {
    LimitsConfig::from_toml(toml, &Catalogue::new()).expect("config")
}

fn post() -> Request<Body> {
    Request::post("/").body(Body::empty()).expect("request")
}

async fn body(response: Response) -> String {
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 16).await.expect("body");
    String::from_utf8_lossy(&bytes).into_owned()
}

#[tokio::test]
async fn the_http_limit_needs_only_a_guard() {
    let config = config("[limits.http]\nalgorithm = \"token_bucket\"\nburst = 2\nrefill_per_sec = 0.5\n");
    let clock = ManualClock::new();
    let guard =
        Arc::new(Guard::new(Arc::new(MemoryStore::on(clock.clone())), clock, &config, Arc::new(Metrics::default())));
    let limited = HttpLimitLayer::new(guard).layer(service_fn(echo_caller));
    let with_caller = |mut request: Request<Body>| {
        request.extensions_mut().insert(Caller::from_token("alone"));
        request
    };
    for remaining in ["1", "0"] {
        let response = limited.clone().oneshot(with_caller(post())).await.expect("infallible");
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(response.headers()["ratelimit-remaining"], remaining);
    }
    let refused = limited.clone().oneshot(with_caller(post())).await.expect("infallible");
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers()["retry-after"], "2", "one request every 2 s");
    // A GET (the SSE stream of an MCP session) is never counted; a request nobody named is an
    // error, not a charge to a key everyone would share.
    let get = Request::get("/").body(Body::empty()).expect("request");
    assert_eq!(limited.clone().oneshot(with_caller(get)).await.expect("infallible").status(), StatusCode::OK);
    assert_eq!(limited.oneshot(post()).await.expect("infallible").status(), StatusCode::INTERNAL_SERVER_ERROR);
}

#[tokio::test]
async fn identify_needs_only_an_identifier() {
    let config = config("[auth]\nrequired = true\n[[auth.keys]]\nkey = \"known-key\"\ntenant = \"acme\"\n");
    let identifier = Arc::new(ArcSwap::from_pointee(Identifier::new(&config)));
    let identified = IdentifyLayer::new(Callers::new(identifier), mcp_ratelimit::clock::SystemClock::shared())
        .layer(service_fn(echo_caller));

    let known = Request::post("/").header("authorization", "Bearer known-key").body(Body::empty()).expect("request");
    let response = identified.clone().oneshot(known).await.expect("infallible");
    assert_eq!(response.status(), StatusCode::OK);
    let id = body(response).await;
    assert!(id.starts_with("tok:") && !id.contains("known-key"), "a hash, never the key: {id}");

    let unknown = Request::post("/").header("authorization", "Bearer made-up").body(Body::empty()).expect("request");
    let response = identified.oneshot(unknown).await.expect("infallible");
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(response.headers()["www-authenticate"], "Bearer");
}

#[tokio::test]
async fn rebinding_protection_needs_only_the_allowed_hosts() {
    let log = Arc::new(FrontDoorLog::new(ManualClock::new()));
    let allowed = Arc::new(AllowedHosts::new(vec!["localhost".into()], Vec::new(), log));
    let app =
        axum::Router::new().route("/", axum::routing::post(|| async { "in" })).layer(rebinding_protection(allowed));
    let ours = Request::post("/").header("host", "localhost:3000").body(Body::empty()).expect("request");
    assert_eq!(app.clone().oneshot(ours).await.expect("infallible").status(), StatusCode::OK);
    let foreign = Request::post("/").header("host", "evil.example").body(Body::empty()).expect("request");
    assert_eq!(app.clone().oneshot(foreign).await.expect("infallible").status(), StatusCode::FORBIDDEN);
    let origin = Request::post("/")
        .header("host", "localhost")
        .header("origin", "https://evil.example")
        .body(Body::empty())
        .expect("request");
    assert_eq!(app.oneshot(origin).await.expect("infallible").status(), StatusCode::FORBIDDEN);
}
