//! What naming a caller by its OAuth access token costs, beside naming it by a configured key:
//! the part of a served call that `[auth.oauth]` changes.
//!
//! Run with `cargo bench --bench oauth`. Under `cargo test` each benchmark runs once.
//!
//! The keys come from a JWKS served in-process on loopback (an RSA 2048 key kept for the bench in
//! `benches/fixtures/bench-rsa-key.pem`, never a secret of anyone's), fetched once at start as the
//! server does:
//!
//! * `name_caller/configured_key`: a request with a configured key in `Authorization`: its
//!   SHA-256, the key table, the caller's id;
//! * `name_caller/cached_token`: a request with an RS256 access token verified before: its SHA-256,
//!   the verification kept for it (its key still in the set, `exp`/`nbf` on the clock), the caller
//!   from its claims — what every request after a client's first costs;
//! * `name_caller/new_token`: the signature check a token's first request adds (jsonwebtoken's
//!   RS256 verify, and parsing its claims), the cost no cache can hide.

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};

use criterion::{Criterion, criterion_group, criterion_main};
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use mcp_ratelimit::RateLimits;
use mcp_ratelimit::clock::SystemClock;
use mcp_ratelimit::config::LimitsConfig;

const KEY: &str = "bench-configured-key-0123456789";
const AUDIENCE: &str = "http://127.0.0.1:3000/mcp";

fn name_caller(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    let pem = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/benches/fixtures/bench-rsa-key.pem")).expect("key");
    let signing = EncodingKey::from_rsa_pem(&pem).expect("an RSA key");
    let mut jwk = jsonwebtoken::jwk::Jwk::from_encoding_key(&signing, Algorithm::RS256).expect("its JWK");
    jwk.common.key_id = Some("bench".to_owned());
    let jwks = serde_json::json!({ "keys": [jwk] });

    // The authorization server's JWKS, on loopback.
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).expect("bind");
    let issuer = format!("http://{}", listener.local_addr().expect("addr"));
    let served = jwks.clone();
    let app = axum::Router::new().route("/jwks", axum::routing::get(move || async move { axum::Json(served) }));
    runtime.spawn(async move { axum::serve(listener, app).await });

    let toml = format!(
        "[[auth.keys]]\nkey = \"{KEY}\"\n[auth.oauth]\nissuer = \"{issuer}\"\njwks_uri = \"{issuer}/jwks\"\naudience = \"{AUDIENCE}\"\n"
    );
    let tools = mcp_ratelimit::mcp::tools::catalogue();
    let config = LimitsConfig::from_toml(&toml, &tools).expect("the bench's config is valid");
    let limits = runtime.block_on(RateLimits::start(&config, tools, SystemClock::shared())).expect("limits start");

    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("now").as_secs();
    let claims = serde_json::json!({"iss": issuer, "aud": AUDIENCE, "sub": "alice", "org_id": "acme",
                                    "client_id": "bench-app", "iat": now, "exp": now + 3600});
    let mut header = Header::new(Algorithm::RS256);
    header.kid = Some("bench".to_owned());
    let token = jsonwebtoken::encode(&header, &claims, &signing).expect("a token");

    let bearer = |credential: &str| {
        let mut headers = http::HeaderMap::new();
        let value = http::HeaderValue::from_str(&format!("Bearer {credential}")).expect("a header");
        headers.insert(http::header::AUTHORIZATION, value);
        headers
    };
    let peer = Some(IpAddr::V4(Ipv4Addr::LOCALHOST));
    let callers = limits.callers().clone();
    let (keyed, tokened) = (bearer(KEY), bearer(&token));
    let named = runtime.block_on(callers.name(&tokened, peer)).expect("the token names a caller");
    assert!(named.id().starts_with("sub:"), "{}", named.id());

    let mut group = c.benchmark_group("name_caller");
    group.bench_function("configured_key", |b| {
        b.iter(|| runtime.block_on(callers.name(black_box(&keyed), peer)).expect("a caller"))
    });
    group.bench_function("cached_token", |b| {
        b.iter(|| runtime.block_on(callers.name(black_box(&tokened), peer)).expect("a caller"))
    });
    let decoding = DecodingKey::from_jwk(&jwk).expect("a decoding key");
    let mut validation = Validation::new(Algorithm::RS256);
    validation.set_audience(&[AUDIENCE]);
    validation.set_issuer(&[issuer.as_str()]);
    group.bench_function("new_token", |b| {
        b.iter(|| {
            jsonwebtoken::decode::<serde_json::Map<String, serde_json::Value>>(
                black_box(&token),
                &decoding,
                &validation,
            )
            .expect("verified")
        })
    });
    group.finish();
    limits.stop();
}

criterion_group!(benches, name_caller);
criterion_main!(benches);
