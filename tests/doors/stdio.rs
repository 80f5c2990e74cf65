//! The same budget over stdio, through the real binary started as a child process.

use crate::common::{call, error_code, is_error, structured, text};
use rmcp::ServiceExt;
use rmcp::transport::{ConfigureCommandExt, TokioChildProcess};
use serde_json::json;

#[tokio::test]
async fn stdio_burst_then_refusal_through_the_binary() {
    let command = tokio::process::Command::new(env!("CARGO_BIN_EXE_mcp-ratelimit")).configure(|c| {
        // 60 identical calls exhaust the budget here; loop detection would stop them at 5. The
        // binary runs on the wall clock, so the refill is one token per 1000 s: nothing comes back
        // while the test runs, however slow the machine, and the 61st call is refused exactly.
        c.arg("stdio")
            .env("RUST_LOG", "warn")
            .env("MCP_RL__LOOP_DETECTION__ENABLED", "false")
            .env("MCP_RL__LIMITS__CALLER__REFILL_PER_SEC", "0.001");
    });
    let transport = TokioChildProcess::new(command).expect("binary starts");
    let client = ().serve(transport).await.expect("stdio handshake");

    let info = client.peer_info().and_then(|i| i.server_info.clone()).expect("serverInfo");
    assert_eq!(info.name, "mcp-ratelimit");
    assert_eq!(client.list_all_tools().await.expect("tools/list").len(), 7);

    for i in 0..60 {
        let r = call(&client, "list_articles", json!({"limit": 2})).await;
        assert!(!is_error(&r), "call {i}: {}", text(&r));
    }
    let refused = call(&client, "list_articles", json!({})).await;
    assert_eq!(error_code(&refused), Some("rate_limited"));
    let error = &structured(&refused)["error"];
    assert_eq!(error["scope"], "caller:local");
    assert_eq!(error["limit"], 60);
    assert_eq!(error["remaining"], 0);
    // One token's worth (1000 s) less the seconds the burst took on the wall clock.
    let wait = error["retry_after_ms"].as_u64().expect("retry_after_ms");
    assert!((940_000..=1_000_000).contains(&wait), "{error}");
    client.cancel().await.ok();
}

#[tokio::test]
async fn stdio_keeps_stderr_quiet_by_default() {
    let command = tokio::process::Command::new(env!("CARGO_BIN_EXE_mcp-ratelimit")).configure(|c| {
        c.arg("stdio").env_remove("RUST_LOG").current_dir(std::env::temp_dir());
    });
    let (transport, stderr) =
        TokioChildProcess::builder(command).stderr(std::process::Stdio::piped()).spawn().expect("binary starts");
    let client = ().serve(transport).await.expect("stdio handshake");
    assert!(!is_error(&call(&client, "list_articles", json!({"limit": 2})).await));
    client.cancel().await.ok();
    let mut log = String::new();
    if let Some(mut stderr) = stderr {
        use tokio::io::AsyncReadExt;
        let read = tokio::time::timeout(std::time::Duration::from_secs(10), stderr.read_to_string(&mut log));
        read.await.expect("stderr ends with the process").expect("stderr");
    }
    assert!(log.trim().is_empty(), "nothing on stderr for a normal session: {log}");
}

/// The binary run with `args`, spoken to over raw pipes: its stdin, and its stdout a line at a time.
fn raw_stdio(args: &[&str]) -> (tokio::process::Child, tokio::process::ChildStdin, Lines) {
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_mcp-ratelimit"))
        .args(args)
        .env("RUST_LOG", "warn")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("binary starts");
    let stdin = child.stdin.take().expect("stdin");
    let stdout = child.stdout.take().expect("stdout");
    (child, stdin, tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout)))
}

type Lines = tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>;

/// The next message on stdout, which must come within 10 s (a client's timeout is longer: an
/// answer that comes is one it does not wait out).
async fn next_message(lines: &mut Lines) -> serde_json::Value {
    let line = tokio::time::timeout(std::time::Duration::from_secs(10), lines.next_line())
        .await
        .expect("an answer within 10 s")
        .expect("stdout readable")
        .expect("a line before the end");
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("stdout carries JSON only ({e}): {line}"))
}

async fn send(stdin: &mut tokio::process::ChildStdin, line: &[u8]) {
    use tokio::io::AsyncWriteExt;
    stdin.write_all(line).await.expect("written");
    stdin.flush().await.expect("flushed");
}

#[tokio::test]
async fn a_malformed_or_oversized_line_is_answered_at_once_over_stdio_and_the_session_goes_on() {
    let binary = env!("CARGO_BIN_EXE_mcp-ratelimit");
    for args in [vec!["stdio"], vec!["proxy", "--stdio", "--", binary, "stdio"]] {
        let (_child, mut stdin, mut lines) = raw_stdio(&args);
        send(&mut stdin, b"this is not json\n").await;
        let parse_error = next_message(&mut lines).await;
        assert_eq!(parse_error["error"]["code"], -32700, "{args:?}: {parse_error}");
        assert_eq!(parse_error.get("id"), Some(&serde_json::Value::Null), "id: null, {parse_error}");

        let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "pipes", "version": "1"}}});
        send(&mut stdin, format!("{init}\n").as_bytes()).await;
        let initialized = next_message(&mut lines).await;
        assert_eq!(initialized["id"], 1, "{args:?}: {initialized}");
        assert!(initialized["result"]["protocolVersion"].is_string(), "{initialized}");
        send(&mut stdin, b"{\"jsonrpc\":\"2.0\",\"method\":\"notifications/initialized\"}\n").await;

        // A line over rmcp's 16 MiB: answered once it passes the limit, the rest skipped.
        let pad = "x".repeat(17 << 20);
        let huge = format!("{{\"jsonrpc\":\"2.0\",\"id\":2,\"method\":\"ping\",\"params\":{{\"pad\":\"{pad}\"}}}}\n");
        let mut writer = stdin;
        let sent = tokio::spawn(async move {
            send(&mut writer, huge.as_bytes()).await;
            writer
        });
        let too_long = next_message(&mut lines).await;
        assert_eq!(too_long["error"]["code"], -32600, "{args:?}: {too_long}");
        assert_eq!(too_long.get("id"), Some(&serde_json::Value::Null), "{too_long}");
        let mut stdin = sent.await.expect("sent");

        send(&mut stdin, b"{\"jsonrpc\":\"2.0\",\"id\":3,\"method\":\"ping\"}\n{broken\n").await;
        let (first, second) = (next_message(&mut lines).await, next_message(&mut lines).await);
        let (pong, broken) = if first["id"] == 3 { (first, second) } else { (second, first) };
        assert_eq!((pong["id"].clone(), pong["result"].clone()), (json!(3), json!({})), "{args:?}: {pong}");
        assert_eq!(broken["error"]["code"], -32700, "{broken}");
    }
}
