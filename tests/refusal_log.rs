//! A refusal storm cannot cost the server its log: each caller bucket writes a burst of refusal
//! lines, then about one a second, each saying how many it stands for (`left_out`), while
//! `/metrics` counts every refusal exactly; the front door's refusals (a foreign Host, every
//! session taken) likewise per kind. Through an MCP client and raw HTTP, on a manual clock.

mod common;

use common::*;
use serde_json::json;

fn refused_lines(capture: &LogCapture) -> Vec<String> {
    capture.lines_with("mcp_ratelimit::guard: refused ")
}

#[tokio::test]
async fn a_refusal_storm_writes_a_few_lines_that_count_the_rest_and_the_metrics_count_every_one() {
    let capture = LogCapture::default();
    let writer = capture.clone();
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .init();
    // The caller's budget: 40 tokens (the least every tool's cost and tier allow), no refill to
    // speak of while the clock stands still.
    let config = format!(
        "[limits.caller]\nburst = 40\nrefill_per_sec = 1.0\n[tools.generate_image_to_video]\ncost = 20\n\
         [limits.http]\nburst = 10000\n\
         [limits.address_http]\nburst = 10000\n[limits.method.tools_call]\nburst = 10000\n{NO_LOOP_DETECTION}\n\
         [server]\nmax_sessions = 1\nunverified_session_share = 1.0\n"
    );
    let server = TestServer::start(&config).await;
    let client = server.client(Some("storm")).await;
    let mut refused = 0;
    for n in 0..240 {
        if is_error(&call(&client, "list_articles", json!({ "query": format!("q{n}") })).await) {
            refused += 1;
        }
    }
    assert_eq!(refused, 200, "40 admitted, then every call refused (the clock stands still)");
    let metrics = server.metrics().await;
    assert_eq!(metric_sum(&metrics, "mcp_ratelimit_rejections_total"), 200.0, "the metrics count every one");
    let lines = refused_lines(&capture);
    assert_eq!(lines.len(), 10, "a burst of ten lines for the caller's bucket:\n{}", lines.join("\n"));
    // A second later one more line, standing for the 190 left out meanwhile.
    server.advance_secs(1.0);
    // The refill gave back one token: spend it, then be refused once more.
    for n in 0..2 {
        call(&client, "list_articles", json!({ "query": format!("again {n}") })).await;
    }
    let lines = refused_lines(&capture);
    assert_eq!(lines.len(), 11, "{}", lines.join("\n"));
    assert!(lines[10].contains("left_out=190"), "{}", lines[10]);

    // The front door's refusals come before any caller is known, as fast as a client can send
    // requests: a foreign Host, an initialize while the one session (the client's) is open.
    // Each kind writes its own burst of ten lines, then one a second.
    let http = reqwest::Client::new();
    let initialize = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "storm", "version": "1"}}});
    let send = |foreign_host: bool| {
        let mut request = http
            .post(&server.url)
            .header("content-type", "application/json")
            .header("accept", "application/json, text/event-stream")
            .body(initialize.to_string());
        if foreign_host {
            request = request.header("host", "rebound.example");
        }
        async move { request.send().await.expect("an answer").status().as_u16() }
    };
    for _ in 0..50 {
        assert_eq!(send(true).await, 403);
        assert_eq!(send(false).await, 503);
    }
    let rebinding = capture.lines_with("refused: DNS-rebinding protection");
    let sessions = capture.lines_with("refused: every MCP session is taken");
    assert_eq!(rebinding.len(), 10, "{}", rebinding.join("\n"));
    assert_eq!(sessions.len(), 10, "{}", sessions.join("\n"));
    server.advance_secs(1.0);
    assert_eq!((send(true).await, send(false).await), (403, 503));
    let rebinding = capture.lines_with("refused: DNS-rebinding protection");
    let sessions = capture.lines_with("refused: every MCP session is taken");
    assert!(rebinding.len() == 11 && rebinding[10].contains("left_out=40"), "{}", rebinding.join("\n"));
    assert!(sessions.len() == 11 && sessions[10].contains("left_out=40"), "{}", sessions.join("\n"));
}
