//! The proxy's relay lane (`src/proxy/lane/`): what the proxy only forwards, forwarded as the
//! caller sent it, in front of servers nobody here wrote. The rest of `proxy.rs` runs through it
//! too wherever the proxied server is reached over HTTP; these are what only the lane can do.

use std::time::Duration;

use mcp_ratelimit::proxy::Target;
use serde_json::{Value, json};

use crate::common::{RawSession, eventually_some, jsonrpc_of};
use crate::proxy::{Proxy, everything, free_port, serve_http, sha256_hex};

/// Two tenants' keys, and the config that names them: budgets that never run dry (the proxy's
/// clock stands still while a test waits for a real server).
fn tenants(extra: &str) -> ([&'static str; 2], String) {
    let keys = ["acme-0123456789abcdef", "globex-0123456789abcdef"];
    let generous = "algorithm = \"token_bucket\"\nburst = 100000\nrefill_per_sec = 1.0\n";
    let toml = format!(
        "[loop_detection]\nenabled = false\n[limits.http]\n{generous}[limits.method.other]\n{generous}{extra}[auth]\nkeys = [{{ sha256 = \"{}\", tenant = \"acme\" }}, \
         {{ sha256 = \"{}\", tenant = \"globex\" }}]\n",
        sha256_hex(keys[0]),
        sha256_hex(keys[1])
    );
    (keys, toml)
}

/// A 2025-11-25 session of `key` to the proxy.
async fn session_of(proxy: &Proxy, key: &str) -> RawSession {
    let mut session = RawSession::new(&proxy.url, &[("authorization", &format!("Bearer {key}"))]);
    assert_eq!(session.open().await, (200, 202), "the session opens");
    session
}

/// The answer to `method` with `params`, asked as request `id`.
async fn ask(session: &RawSession, id: u64, method: &str, params: Value) -> Value {
    let (_, _, body) = session.post(json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params})).await;
    jsonrpc_of(&body)
}

/// A 2025-11-25 client's task-augmented call (`params.task`), which rmcp would drop, reaches
/// `server-everything` over HTTP through the lane: its `simulate-research-query` (which requires a
/// task) answers one in that era's shape, which `tasks/get` polls to `completed` and `tasks/result`
/// reads. Under `limits.in_flight.caller = 1` with the tool `holds_slot`, the same caller's second
/// task is `busy` while the first works, and admitted once the proxy has seen it final. Another
/// tenant's `tasks/get` and `tasks/cancel` of it are unknown, and its `tasks/list` holds none of it.
#[tokio::test]
async fn a_2025_11_25_task_passes_the_lane_holds_its_callers_slot_and_is_theirs_alone() {
    let port = free_port();
    let (node, args) = everything("streamableHttp");
    let _server = serve_http(&node, &args, port).await;
    let target = Target::Http { url: format!("http://127.0.0.1:{port}/mcp"), headers: Vec::new() };
    let (keys, toml) =
        tenants("[limits.in_flight]\ncaller = 1\n[tools.\"simulate-research-query\"]\ncost = 1\nholds_slot = true\n");
    let proxy = Proxy::start(&toml, target).await;
    let (alice, bob) = (session_of(&proxy, keys[0]).await, session_of(&proxy, keys[1]).await);
    let research =
        json!({"name": "simulate-research-query", "arguments": {"topic": "rate limits"}, "task": {"ttl": 60000}});

    let created = ask(&alice, 1, "tools/call", research.clone()).await;
    let task = created["result"]["task"]["taskId"].as_str().map(str::to_owned);
    let task = task.unwrap_or_else(|| panic!("a task, in 2025-11-25's shape: {created}"));
    let refused = ask(&alice, 2, "tools/call", research.clone()).await;
    assert_eq!(refused["result"]["structuredContent"]["error"]["code"], "busy", "{refused}");

    for (id, method) in [(1, "tasks/get"), (2, "tasks/cancel"), (3, "tasks/result")] {
        let theirs = ask(&bob, id, method, json!({"taskId": task})).await;
        let said = theirs["error"]["message"].as_str().unwrap_or_default();
        assert!(said.contains("unknown task"), "{method} of another tenant's task: {theirs}");
    }
    let listed = ask(&bob, 4, "tasks/list", json!({})).await;
    assert!(listed["error"].is_object() || listed["result"]["tasks"] == json!([]), "{listed}");

    // server-everything works in real time (about 4 s): polled, bounded.
    let completed = eventually_some("the task completes", Duration::from_secs(30), || async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let got = ask(&alice, 5, "tasks/get", json!({"taskId": task})).await;
        (got["result"]["status"] == "completed").then_some(got)
    })
    .await;
    assert_eq!(completed["result"]["taskId"], task.as_str());
    let result = ask(&alice, 6, "tasks/result", json!({"taskId": task})).await;
    let text = result["result"]["content"][0]["text"].as_str().unwrap_or_default();
    assert!(text.contains("rate limits"), "its result: {result}");
    let listed = ask(&alice, 7, "tasks/list", json!({})).await;
    assert!(listed["result"]["tasks"].as_array().is_some_and(|t| t.iter().any(|t| t["taskId"] == task.as_str())));

    // The proxy asks after the task on its own clock (at its pollInterval); once it has seen it
    // final, the caller's slot is back.
    let mut next = 100;
    let admitted = eventually_some("the slot comes back", Duration::from_secs(30), || {
        next += 1;
        proxy.clock.advance(Duration::from_secs(1));
        let (alice, research) = (&alice, research.clone());
        async move {
            let answer = ask(alice, next, "tools/call", research).await;
            answer["result"]["task"]["taskId"].as_str().map(str::to_owned)
        }
    })
    .await;
    assert_ne!(admitted, task, "a new task");
}
