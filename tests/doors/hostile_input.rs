//! Hostile input at the front door never panics and never gets a 5xx: any header bytes a
//! client can send are either an identity or a clear 4xx.

use crate::common::*;
use mcp_ratelimit::config::LimitsConfig;
use mcp_ratelimit::identity::{Identifier, Identity};
use proptest::prelude::*;
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
        let identifier = Identifier::new(&LimitsConfig::from_toml(&toml, &mcp_ratelimit::mcp::tools::catalogue()).expect("config"));
        let mut headers = http::HeaderMap::new();
        for (name, bytes) in [("authorization", &auth), ("x-api-key", &key), ("x-forwarded-for", &forwarded)] {
            // Every generated value is one HTTP lets through, so every case tests what it says.
            let value = http::HeaderValue::from_bytes(bytes).expect("the strategy makes only valid header bytes");
            headers.insert(name, value);
        }
        let caller = identifier.identify(&headers, Some("127.0.0.1".parse().expect("ip")))
            .map(Identity::without_verifying)
            .expect("not required");
        prop_assert!(caller.id().starts_with("tok:") || caller.id().starts_with("ip:"));
        prop_assert!(caller.id().len() <= 64, "ids stay short: {}", caller.id());
        prop_assert!(caller.bucket() < 16);
    }
}

/// Sends `head` (request line and headers, raw bytes) and `body` over a fresh TCP connection and
/// returns the status code of the answer: no HTTP client in the way to refuse or mend a header.
async fn raw_status(addr: std::net::SocketAddr, head: &[u8], body: &[u8]) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    tcp.write_all(head).await.expect("write head");
    tcp.write_all(body).await.expect("write body");
    let mut answer = Vec::new();
    let mut buf = [0u8; 1024];
    while !answer.windows(2).any(|w| w == b"\r\n") {
        let n = tcp.read(&mut buf).await.expect("read");
        assert!(n > 0, "connection closed without a status line after {:?}", String::from_utf8_lossy(head));
        answer.extend_from_slice(&buf[..n]);
    }
    let line = String::from_utf8_lossy(&answer);
    line.split(' ').nth(1).and_then(|code| code.parse().ok()).unwrap_or_else(|| panic!("no status in {line}"))
}

#[tokio::test]
async fn hostile_headers_get_clear_4xx_answers_never_5xx() {
    let server = TestServer::start("[server]\ntrust_proxy = true\n").await;
    let port = server.addr.port();
    let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})
    .to_string();
    let long = "a".repeat(16 * 1024);
    let host = format!("127.0.0.1:{port}").into_bytes();
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
        vec![("content-length", b"-1".to_vec())],
        vec![("content-type", b"application/json; charset=\xff".to_vec())],
        vec![("mcp-session-id", b"../../etc/passwd".to_vec())],
        vec![("mcp-protocol-version", b"1999-01-01".to_vec())],
    ];
    let mut answered = 0;
    for case in &cases {
        let mut head = b"POST /mcp HTTP/1.1\r\n".to_vec();
        let mut header = |name: &str, value: &[u8]| {
            head.extend_from_slice(name.as_bytes());
            head.extend_from_slice(b": ");
            head.extend_from_slice(value);
            head.extend_from_slice(b"\r\n");
        };
        let named = |wanted: &str| case.iter().any(|(n, _)| *n == wanted);
        if !named("host") {
            header("host", &host);
        }
        if !named("content-type") {
            header("content-type", b"application/json");
        }
        header("accept", b"application/json, text/event-stream");
        header("connection", b"close");
        for (name, bytes) in case {
            header(name, bytes);
        }
        // A Content-Length that lies is the client's problem: send no body for that case.
        let body = if named("content-length") { Vec::new() } else { init.clone().into_bytes() };
        if !named("content-length") {
            header("content-length", body.len().to_string().as_bytes());
        }
        head.extend_from_slice(b"\r\n");
        let status = raw_status(server.addr, &head, &body).await;
        assert!((400..500).contains(&status) || status == 200, "{case:?} got {status}");
        answered += 1;
    }
    // Every case went out as written and was answered: none skipped on the way.
    assert_eq!(answered, cases.len());
    let health = reqwest::get(format!("http://{}/health", server.addr)).await.expect("health");
    assert_eq!(health.status(), 200, "still serving");
}
