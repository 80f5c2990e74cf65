//! Hostile input at the front door never panics and never gets a 5xx: any header bytes a
//! client can send are either an identity or a clear 4xx.

mod common;

use common::*;
use mcp_ratelimit::Config;
use mcp_ratelimit::identity::Identifier;
use proptest::prelude::*;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde_json::json;

fn header_bytes() -> impl Strategy<Value = Vec<u8>> {
    // Visible ASCII, spaces, tabs and obs-text bytes (0x80-0xFF): everything HTTP lets through.
    prop::collection::vec(prop_oneof![32u8..127, Just(b'\t'), 128u8..=255], 0..200)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn any_credential_or_forwarded_header_yields_an_identity(
        auth in header_bytes(), key in header_bytes(), forwarded in header_bytes(), trust in any::<bool>(),
    ) {
        let toml = format!("[server]\ntrust_proxy = {trust}\n[[auth.keys]]\nkey = \"known\"\ntenant = \"t\"\n");
        let identifier = Identifier::new(&Config::from_toml(&toml, &mcp_ratelimit::mcp::tools::catalogue()).expect("config"));
        let mut headers = http::HeaderMap::new();
        for (name, bytes) in [("authorization", &auth), ("x-api-key", &key), ("x-forwarded-for", &forwarded)] {
            if let Ok(value) = http::HeaderValue::from_bytes(bytes) {
                headers.insert(name, value);
            }
        }
        let caller = identifier.identify(&headers, Some("127.0.0.1".parse().expect("ip"))).expect("not required");
        prop_assert!(caller.id().starts_with("tok:") || caller.id().starts_with("ip:"));
        prop_assert!(caller.id().len() <= 64, "ids stay short: {}", caller.id());
        prop_assert!(caller.bucket() < 16);
    }
}

#[tokio::test]
async fn hostile_headers_get_clear_4xx_answers_never_5xx() {
    let server = TestServer::start("[server]\ntrust_proxy = true\n").await;
    let port = server.addr.port();
    let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})
    .to_string();
    let long = "a".repeat(16 * 1024);
    let cases: Vec<Vec<(&str, Vec<u8>)>> = vec![
        vec![("authorization", b"Bearer \xff\xfe\xfd".to_vec())],
        vec![("authorization", b"Bearer".to_vec())],
        vec![("authorization", b"Basic dXNlcjpwYXNz".to_vec())],
        vec![("x-api-key", long.as_bytes().to_vec())],
        vec![("x-forwarded-for", b"\xff, ::ffff:1.2.3.4, [::1]:80, 999.1.1.1, , ,".to_vec())],
        vec![("host", b"[::1]:".to_vec())],
        vec![("host", b"[".to_vec())],
        vec![("host", b"localhost:notaport".to_vec())],
        vec![("host", format!("localhost:{port}").into_bytes()), ("origin", b"http://[::1".to_vec())],
        vec![("origin", b"\xff\xfe".to_vec())],
        vec![("content-length", b"99999999999999999999999".to_vec())],
        vec![("content-type", b"application/json; charset=\xff".to_vec())],
        vec![("mcp-session-id", b"../../etc/passwd".to_vec())],
        vec![("mcp-protocol-version", b"1999-01-01".to_vec())],
    ];
    let client = reqwest::Client::new();
    for case in cases {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        headers.insert("accept", HeaderValue::from_static("application/json, text/event-stream"));
        for (name, bytes) in &case {
            let value = HeaderValue::from_bytes(bytes).expect("valid header bytes");
            headers.insert(HeaderName::from_static(name), value);
        }
        // A Content-Length that lies is the client's problem: send no body for that case.
        let body = if case.iter().any(|(n, _)| *n == "content-length") { String::new() } else { init.clone() };
        let status = match client.post(&server.url).headers(headers).body(body).send().await {
            Ok(response) => response.status().as_u16(),
            Err(_) => continue, // the client itself refused to send it
        };
        assert!(status < 500, "{case:?} got {status}");
    }
    let health = reqwest::get(format!("http://{}/health", server.addr)).await.expect("health");
    assert_eq!(health.status(), 200, "still serving");
}
