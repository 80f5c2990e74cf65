//! The same budget over stdio, through the real binary started as a child process.

mod common;

use common::{call, error_code, is_error, structured, text};
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
