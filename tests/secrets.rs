//! A raw credential never reaches a log line or a metric label, even with every log level on.
//! (The only test in this binary: it installs a process-wide log capture.)

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};

use common::*;
use serde_json::json;

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

const TOKEN: &str = "sk-live-DO-NOT-LOG-7f3a91c2";

#[tokio::test]
async fn the_raw_token_never_appears_in_logs_or_metrics() {
    let capture = Capture::default();
    let writer = capture.clone();
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .init();

    let server =
        TestServer::start("[limits.http]\nburst = 40\n[mock_upstream]\nmax_concurrent_predictions = 1000\n").await;
    let client = server.client(Some(TOKEN)).await;
    client.list_all_tools().await.expect("tools/list");
    spend_until_refused(&client, "generate_image", json!({"prompt": "p"}), 20).await;
    call(&client, "generate_image", json!({"prompt": "x".repeat(4001)})).await;
    let raw = RawSession::new(&server.url, &[("x-api-key", TOKEN)]);
    for id in 0..50 {
        raw.ping(id).await;
    }
    let metrics =
        reqwest::get(format!("http://{}/metrics", server.addr)).await.expect("metrics").text().await.expect("text");

    let logs = String::from_utf8_lossy(&capture.0.lock().unwrap_or_else(|p| p.into_inner())).into_owned();
    assert!(logs.contains("refused"), "the capture saw the rejections:\n{logs}");
    assert!(logs.contains("rmcp::"), "the capture includes the MCP library's own trace logs");
    assert!(metrics.contains("mcp_ratelimit_rejections_total"), "{metrics}");
    assert!(metrics.contains("client_bucket=\"b"), "{metrics}");
    for haystack in [&logs, &metrics] {
        assert!(!haystack.contains(TOKEN), "raw token leaked");
        assert!(!haystack.contains("DO-NOT-LOG"), "part of the raw token leaked");
    }
    assert!(!metrics.contains("tok:"), "no caller id in metric labels");
}
