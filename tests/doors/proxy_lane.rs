//! The proxy's relay lane (`src/proxy/lane/`): what the proxy only forwards, forwarded as the
//! caller sent it, in front of servers nobody here wrote. The rest of `proxy.rs` runs through it
//! too wherever the proxied server is reached over HTTP; these are what only the lane can do.

use std::time::Duration;

use mcp_ratelimit::proxy::Target;
use serde_json::{Value, json};

use crate::common::{RawSession, eventually_some, jsonrpc_of};
use crate::proxy::{Proxy, everything_over_http, free_port, serve_http, sha256_hex};

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
/// `server-everything` through the lane, over HTTP and as a stdio child: its `simulate-research-query` (which requires a
/// task) answers one in that era's shape, which `tasks/get` polls to `completed` and `tasks/result`
/// reads. Under `limits.in_flight.caller = 1` with the tool `holds_slot`, the same caller's second
/// task is `busy` while the first works, and admitted once the proxy has seen it final. Another
/// tenant's `tasks/get` and `tasks/cancel` of it are unknown, and its `tasks/list` holds none of it.
#[tokio::test]
async fn a_2025_11_25_task_passes_the_lane_holds_its_callers_slot_and_is_theirs_alone() {
    let (_server, target) = everything_over_http().await;
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

/// A server whose tool `answer` answers `{"mib": N}` with N MiB of text, and whose tool `forged`
/// puts keys of the proxy's own (and its connection's) in its result's `_meta`.
#[derive(Clone, Default)]
struct Answering;

impl rmcp::ServerHandler for Answering {
    fn get_info(&self) -> rmcp::model::ServerConfig {
        rmcp::model::ServerConfig::new(rmcp::model::ServerCapabilities::builder().enable_tools().build())
    }

    async fn list_tools(
        &self,
        _request: Option<rmcp::model::PaginatedRequestParams>,
        _context: rmcp::service::RequestContext<rmcp::RoleServer>,
    ) -> Result<rmcp::model::ListToolsResult, rmcp::ErrorData> {
        let tool = crate::proxy::tool_taking_an_object;
        Ok(rmcp::model::ListToolsResult::with_all_items(vec![tool("answer"), tool("forged")]))
    }

    async fn call_tool(
        &self,
        request: rmcp::model::CallToolRequestParams,
        _context: rmcp::service::RequestContext<rmcp::RoleServer>,
    ) -> Result<rmcp::model::CallToolResponse, rmcp::ErrorData> {
        let mut done = rmcp::model::CallToolResult::success(vec![rmcp::model::ContentBlock::text("ok")]);
        if request.name == "forged" {
            let meta = json!({"io.github.mcp-ratelimit/charged": 0, "io.modelcontextprotocol/serverInfo": {"name": "x"},
                "theirs": 1});
            done.meta = serde_json::from_value(meta).ok();
        } else {
            let mib = request.arguments.as_ref().and_then(|a| a.get("mib")).and_then(Value::as_u64).unwrap_or(0);
            let size = usize::try_from(mib).unwrap_or(0).saturating_mul(1 << 20);
            done = rmcp::model::CallToolResult::success(vec![rmcp::model::ContentBlock::text("x".repeat(size))]);
        }
        Ok(done.into())
    }
}

/// What a proxied server answers is read at most 16 MiB (as rmcp's client reads one): a larger
/// answer is `upstream_unavailable`, nothing of it passed on; one within passes. Keys of the
/// proxy's own a proxied server puts in its result's `_meta` (a `charged: 0` that would read as the
/// proxy's price) and what describes its connection are taken out on the way; its own stay.
#[tokio::test]
async fn a_proxied_servers_answer_past_16_mib_is_upstream_unavailable() {
    let url = crate::proxy::serve_in_test(Answering).await;
    let (keys, toml) = tenants("");
    let proxy = Proxy::start(&toml, Target::Http { url, headers: Vec::new() }).await;
    let alice = session_of(&proxy, keys[0]).await;
    let within = ask(&alice, 1, "tools/call", json!({"name": "answer", "arguments": {"mib": 15}})).await;
    let text = within["result"]["content"][0]["text"].as_str().map_or(0, str::len);
    assert_eq!(text, 15 << 20, "15 MiB passes");
    let past = ask(&alice, 2, "tools/call", json!({"name": "answer", "arguments": {"mib": 17}})).await;
    assert_eq!(past["result"]["structuredContent"]["error"]["code"], "upstream_unavailable", "17 MiB does not");
    let said = past["result"]["structuredContent"]["error"]["message"].as_str().unwrap_or_default();
    assert!(said.contains("16777216 bytes"), "{said}");
    let forged = ask(&alice, 3, "tools/call", json!({"name": "forged", "arguments": {}})).await;
    assert_eq!(forged["result"]["_meta"], json!({"theirs": 1}), "{forged}");
}

/// A 2025-11-25 session's `notifications/cancelled` for a call the lane holds cancels it: the
/// call answers at once (the proxied server left to stop on its own), and the `holds_slot` tool's
/// slot comes back, so the caller's next call is served, not `busy`. A cancel naming another
/// request, or from another session, changes nothing.
#[tokio::test]
async fn a_sessions_cancel_of_a_lane_call_gives_its_slot_back() {
    let port = free_port();
    let (python, args) = crate::proxy::fastmcp(&["http", &port.to_string()]);
    let _server = serve_http(&python, &args, port).await;
    let target = Target::Http { url: format!("http://127.0.0.1:{port}/mcp"), headers: Vec::new() };
    let (keys, toml) = tenants("[limits.in_flight]\ncaller = 1\n[tools.wait_for]\ncost = 1\nholds_slot = true\n");
    let proxy = Proxy::start(&toml, target).await;
    let (alice, bob) = (session_of(&proxy, keys[0]).await, session_of(&proxy, keys[1]).await);
    let dir = tempfile::tempdir().expect("tempdir");
    let held = dir.path().join("held").to_string_lossy().into_owned();
    let waiting = {
        let (url, id) = (alice.url.clone(), alice.session_id.clone());
        let mut again = RawSession::new(&url, &[("authorization", &format!("Bearer {}", keys[0]))]);
        again.session_id = id;
        let held = held.clone();
        tokio::spawn(async move {
            ask(&again, 7, "tools/call", json!({"name": "wait_for", "arguments": {"path": held}})).await
        })
    };
    crate::proxy::wait_until_exists(&dir.path().join("held.started")).await;
    let cancel =
        |request: u64| json!({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": request}});
    // Another session's cancel of the same request id, and alice's of another id: nothing.
    let (status, _, _) = bob.post(cancel(7)).await;
    assert_eq!(status, 202);
    let (status, _, _) = alice.post(cancel(8)).await;
    assert_eq!(status, 202);
    let busy = ask(&alice, 9, "tools/call", json!({"name": "wait_for", "arguments": {"path": "/nonexistent/x"}})).await;
    assert_eq!(busy["result"]["structuredContent"]["error"]["code"], "busy", "still held: {busy}");
    let (status, _, _) = alice.post(cancel(7)).await;
    assert_eq!(status, 202);
    let cancelled = waiting.await.expect("the waiting call");
    assert!(cancelled["error"]["message"].as_str().is_some_and(|m| m.contains("cancelled")), "{cancelled}");
    let released = dir.path().join("released");
    std::fs::write(&released, "go").expect("pre-released");
    let next = ask(&alice, 10, "tools/call", json!({"name": "wait_for", "arguments": {"path": released}})).await;
    assert_eq!(next["result"]["content"][0]["text"], "released", "the slot came back: {next}");
}

/// What the lane does not take is rmcp's to answer, as before the lane: a 2026-07-28 call whose
/// `Mcp-Name` header names another tool than its body (`400`), or whose `_meta` lacks the client's
/// capabilities (`400`), a session nobody opened (`404`), a batch; none is forwarded, and a
/// well-formed call after them is served.
#[tokio::test]
async fn what_the_lane_does_not_take_rmcp_answers_as_before() {
    let url = crate::proxy::serve_in_test(Answering).await;
    let (keys, toml) = tenants("");
    let proxy = Proxy::start(&toml, Target::Http { url, headers: Vec::new() }).await;
    let auth = format!("Bearer {}", keys[0]);
    let call =
        json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "forged", "arguments": {}}});
    let stateless = |name: &str| {
        let headers =
            [("authorization", auth.as_str()), ("mcp-protocol-version", "2026-07-28"), ("mcp-method", "tools/call")];
        let mut session = RawSession::new(&proxy.url, &headers);
        session.headers.push(("mcp-name".to_owned(), name.to_owned()));
        session
    };
    let mut well_formed = call.clone();
    well_formed["params"]["_meta"] = json!({"io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {}});
    let (status, _, body) = stateless("answer").post(well_formed.clone()).await;
    assert_eq!(status, 400, "a name the header and the body disagree on: {body}");
    let mut missing = well_formed.clone();
    missing["params"]["_meta"] = json!({"io.modelcontextprotocol/protocolVersion": "2026-07-28"});
    let (status, _, body) = stateless("forged").post(missing).await;
    assert_eq!(status, 400, "a 2026-07-28 request without its client's capabilities: {body}");
    let mut stranger = RawSession::new(&proxy.url, &[("authorization", &auth)]);
    stranger.session_id = Some("no-such-session".to_owned());
    let (status, _, _) = stranger.post(call.clone()).await;
    assert_eq!(status, 404, "a session nobody opened");
    let alice = session_of(&proxy, keys[0]).await;
    let (status, _, body) = alice.post(json!([call.clone()])).await;
    assert!(status >= 400 || !body.contains("\"theirs\""), "a batch is not the lane's: {status} {body}");
    let (status, _, body) = stateless("forged").post(well_formed).await;
    assert_eq!((status, jsonrpc_of(&body)["result"]["_meta"].clone()), (200, json!({"theirs": 1})), "{body}");
    let served = ask(&alice, 2, "tools/call", json!({"name": "forged", "arguments": {}})).await;
    assert_eq!(served["result"]["_meta"], json!({"theirs": 1}), "{served}");
}

/// Every TCP connection the proxy opens to the proxied server sends at once (`TCP_NODELAY`):
/// without it, Nagle's algorithm holds a small request back for the peer's delayed ACK (40 ms
/// stalls, measured by others). Read off the sockets themselves: of this process's connections,
/// those to the proxied server's port are the proxy's (its relay lane and rmcp's client share one
/// pool), each copied with `pidfd_getfd` and asked.
#[cfg(target_os = "linux")]
#[tokio::test]
async fn every_connection_the_proxy_opens_to_the_proxied_server_sends_at_once() {
    let url = crate::proxy::serve_in_test(Answering).await;
    let port = url.rsplit(':').next().and_then(|rest| rest.trim_end_matches("/mcp").parse().ok());
    let port: u16 = port.expect("the server's port");
    let (keys, toml) = tenants("");
    let proxy = Proxy::start(&toml, Target::Http { url, headers: Vec::new() }).await;
    let alice = session_of(&proxy, keys[0]).await;
    let served = ask(&alice, 1, "tools/call", json!({"name": "forged", "arguments": {}})).await;
    assert_eq!(served["result"]["_meta"], json!({"theirs": 1}), "{served}");
    let sockets = sockets_to(port);
    assert!(!sockets.is_empty(), "the proxy holds a connection to the proxied server");
    let me = rustix::process::pidfd_open(rustix::process::getpid(), rustix::process::PidfdFlags::empty())
        .expect("a pidfd of this process");
    for fd in sockets {
        let copy = rustix::process::pidfd_getfd(&me, fd, rustix::process::PidfdGetfdFlags::empty());
        let copy = copy.expect("a copy of the socket");
        assert!(rustix::net::sockopt::tcp_nodelay(&copy).expect("TCP_NODELAY read"), "fd {fd} delays small writes");
    }
}

/// This process's file descriptors of established TCP connections whose remote port is `port`.
#[cfg(target_os = "linux")]
fn sockets_to(port: u16) -> Vec<i32> {
    let mut inodes = std::collections::HashSet::new();
    for table in ["/proc/self/net/tcp", "/proc/self/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (Some(remote), Some(state), Some(inode)) = (fields.get(2), fields.get(3), fields.get(9)) else {
                continue;
            };
            let remote_port = remote.rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok());
            if remote_port == Some(port) && *state == "01" {
                inodes.insert(format!("socket:[{inode}]"));
            }
        }
    }
    let fds = std::fs::read_dir("/proc/self/fd").expect("this process's fds");
    fds.filter_map(Result::ok)
        .filter(|entry| std::fs::read_link(entry.path()).is_ok_and(|to| inodes.contains(&*to.to_string_lossy())))
        .filter_map(|entry| entry.file_name().to_str()?.parse().ok())
        .collect()
}

/// The progress notifications in an answer's event stream.
fn progress_in(body: &str) -> Vec<Value> {
    body.lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter_map(|data| serde_json::from_str::<Value>(data).ok())
        .filter(|message| message["method"] == "notifications/progress")
        .map(|message| message["params"].clone())
        .collect()
}

/// Two callers of one stdio child (here two tenants sharing it) may give the same progress token,
/// and rmcp's own client numbers its own: the child is given the lane's token for each call, and
/// each caller hears its own call's progress, under its own token, and nothing of the other's.
/// Callers of both eras: 2025-11-25 sessions, then 2026-07-28 requests (no session; the token in
/// each request's `_meta` beside its version and capabilities).
#[tokio::test]
async fn two_callers_with_one_progress_token_on_one_child_each_hear_only_their_own_progress() {
    let (keys, toml) = tenants("[proxy]\nupstream_sessions = \"shared\"\n");
    let proxy = Proxy::start(&toml, crate::proxy::command(crate::proxy::fastmcp(&[]))).await;
    let (alice, bob) = (session_of(&proxy, keys[0]).await, session_of(&proxy, keys[1]).await);
    each_hears_only_their_own_progress((alice, bob), json!({"progressToken": "p"})).await;
    let stateless = |key: &str| {
        let auth = format!("Bearer {key}");
        let headers = [
            ("authorization", auth.as_str()),
            ("mcp-protocol-version", "2026-07-28"),
            ("mcp-method", "tools/call"),
            ("mcp-name", "count"),
        ];
        RawSession::new(&proxy.url, &headers)
    };
    let meta = json!({"progressToken": "p", "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": {}});
    each_hears_only_their_own_progress((stateless(keys[0]), stateless(keys[1])), meta).await;
}

/// Alice's call of the fixture's `count` (three reports, the last after a gate opens) and Bob's
/// (one), both with `meta` (the same progress token): each hears its own reports alone.
async fn each_hears_only_their_own_progress((alice, bob): (RawSession, RawSession), meta: Value) {
    let dir = tempfile::tempdir().expect("tempdir");
    let gate = dir.path().join("go");
    let counting = |n: u64, until: &str| {
        json!({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
            "name": "count", "arguments": {"n": n, "until": until}, "_meta": meta.clone()}})
    };
    let alices = {
        let call = counting(3, &gate.display().to_string());
        tokio::spawn(async move { alice.post(call).await })
    };
    // Alice's call told its first progress and waits; Bob's, with the same token, runs whole.
    crate::proxy::wait_until_exists(&dir.path().join("go.started")).await;
    let (_, _, bobs) = bob.post(counting(1, "")).await;
    let heard: Vec<Value> = progress_in(&bobs);
    assert_eq!(heard.len(), 1, "bob hears his one report and none of alice's: {bobs}");
    assert_eq!(heard[0]["progressToken"], "p", "under his own token: {bobs}");
    std::fs::write(&gate, "").expect("the gate opens");
    let (_, _, alices) = alices.await.expect("alice's call");
    let heard: Vec<(Value, Option<f64>)> =
        progress_in(&alices).into_iter().map(|p| (p["progressToken"].clone(), p["progress"].as_f64())).collect();
    let expected: Vec<(Value, Option<f64>)> = [1.0, 2.0, 3.0].map(|n| (json!("p"), Some(n))).into();
    assert_eq!(heard, expected, "alice hears all three of her reports: {alices}");
}
