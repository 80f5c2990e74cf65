//! The HTTP front door over real HTTP on loopback: the coarse 429 layer and its headers,
//! identities and proxies, DNS-rebinding protection, auth, and bad input that changes nothing.

use crate::common::*;
use serde_json::json;

fn header<'a>(headers: &'a reqwest::header::HeaderMap, name: &str) -> &'a str {
    headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or_else(|| panic!("header {name} missing"))
}

/// Parses `"name";k=v;k=v` (one structured-field list member) into its parameters.
fn sf_params(value: &str) -> (String, std::collections::HashMap<String, u64>) {
    let mut parts = value.split(';');
    let name = parts.next().unwrap_or_default().trim().trim_matches('"').to_owned();
    let params = parts
        .filter_map(|p| p.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().parse::<u64>().expect("integer parameter")))
        .collect();
    (name, params)
}

#[tokio::test]
async fn one_hundred_fifty_posts_exactly_120_served_then_429_with_retry_after_and_ratelimit_headers() {
    let server = TestServer::start("").await;
    let mut session = RawSession::new(&server.url, &[("authorization", "Bearer burst-caller")]);
    let (init, initialized) = session.open().await;
    assert_eq!((init, initialized), (200, 202));

    let mut served = 2;
    let mut refused = vec![];
    let mut last_remaining = 117;
    for id in 1..=148 {
        let (status, headers, body) = session.ping(id).await;
        if status == 429 {
            refused.push((headers, body));
            continue;
        }
        served += 1;
        let remaining: u64 = header(&headers, "ratelimit-remaining").parse().expect("number");
        assert_eq!(remaining, last_remaining, "remaining counts down by one per POST");
        last_remaining = remaining.saturating_sub(1);
    }
    assert_eq!(served, 120);
    assert_eq!(refused.len(), 30);

    let (headers, body) = &refused[0];
    let retry_after: u64 = header(headers, "retry-after").parse().expect("whole seconds");
    // 120 a minute refills one POST every 0.5 s: Retry-After is that, rounded up to whole seconds.
    assert_eq!(retry_after, 1);
    let (policy, p) = sf_params(header(headers, "ratelimit-policy"));
    assert_eq!((policy.as_str(), p["q"], p["w"]), ("http", 120, 60));
    let (name, r) = sf_params(header(headers, "ratelimit"));
    assert_eq!((name.as_str(), r["r"]), ("http", 0));
    assert!(r.contains_key("t"));
    assert_eq!(header(headers, "ratelimit-remaining"), "0");
    let error: serde_json::Value = serde_json::from_str(body).expect("JSON body");
    assert_eq!(error["jsonrpc"], "2.0");
    assert_eq!(error["id"], serde_json::Value::Null);
    assert_eq!(error["error"]["code"], -32000);
    assert_eq!(error["error"]["message"], "Too many requests. Retry after the delay in Retry-After.");
    assert_eq!(error["error"]["data"]["retry_after_ms"], 500, "one request back at 2/s");

    let mut other = RawSession::new(&server.url, &[("authorization", "Bearer someone-else")]);
    assert_eq!(other.open().await, (200, 202), "another caller is unaffected");

    server.advance_secs(0.5);
    assert_eq!(session.ping(999).await.0, 200, "one request back after half a second");
}

#[tokio::test]
async fn session_set_up_and_the_sse_stream_never_eat_the_tool_budget() {
    let server = TestServer::start("[limits.http]\nburst = 4\n").await;
    let client = server.client(Some("fresh")).await;
    let status = call(&client, "rate_limit_status", json!({})).await;
    assert_eq!(budget(&status, "caller:")["remaining"], 60);
    // initialize + initialized + this call: three POSTs; the GET stream is not counted.
    assert_eq!(budget(&status, "http:")["remaining"], 1);
}

#[tokio::test]
async fn a_spoofed_forwarded_for_changes_nothing_unless_the_proxy_is_trusted() {
    let server = TestServer::start("[limits.http]\nburst = 3\n").await;
    let mut a = RawSession::new(&server.url, &[("x-forwarded-for", "203.0.113.1")]);
    a.open().await;
    a.ping(1).await;
    assert_eq!(a.ping(2).await.0, 429);
    let mut b = RawSession::new(&server.url, &[("x-forwarded-for", "203.0.113.2")]);
    assert_eq!(b.open().await.0, 429, "the same peer is the same caller, whatever it claims");

    let proxied = TestServer::start("[limits.http]\nburst = 3\n[server]\ntrust_proxy = true\n").await;
    let mut a = RawSession::new(&proxied.url, &[("x-forwarded-for", "203.0.113.1")]);
    a.open().await;
    a.ping(1).await;
    assert_eq!(a.ping(2).await.0, 429);
    let mut b = RawSession::new(&proxied.url, &[("x-forwarded-for", "203.0.113.2")]);
    assert_eq!(b.open().await, (200, 202), "behind a trusted proxy the forwarded address is the caller");
}

#[tokio::test]
async fn foreign_host_or_origin_is_refused_before_anything_else() {
    let server = TestServer::start("[limits.http]\nburst = 1\n").await;
    let port = server.addr.port();
    let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}});
    for (host, origin) in [
        ("evil.example.com".to_owned(), None),
        (format!("localhost:{port}"), Some("http://evil.example.com")),
        (format!("localhost:{port}"), Some("null")),
    ] {
        let mut s = RawSession::new(&server.url, &[("host", host.as_str())]);
        if let Some(origin) = origin {
            s.headers.push(("origin".into(), origin.into()));
        }
        let (status, _, _) = s.post(init.clone()).await;
        assert_eq!(status, 403, "{host} {origin:?}");
    }
    let ok = RawSession::new(&server.url, &[("origin", &format!("http://localhost:{port}"))]);
    assert_eq!(ok.post(init).await.0, 200, "refusals above charged nothing, and a same-host origin is fine");
}

#[tokio::test]
async fn required_auth_answers_401_to_unknown_keys_before_anything_else() {
    let server =
        TestServer::start("[auth]\nrequired = true\n[[auth.keys]]\nkey = \"known\"\ntenant = \"acme\"\n").await;
    for headers in [vec![], vec![("authorization", "Bearer unknown")], vec![("x-api-key", "")]] {
        let mut s = RawSession::new(&server.url, &headers);
        let (status, _) = s.open().await;
        assert_eq!(status, 401, "{headers:?}");
    }
    let r = reqwest::Client::new().get(&server.url).send().await.expect("GET");
    assert_eq!(r.status(), 401);
    assert_eq!(r.headers().get("www-authenticate").and_then(|v| v.to_str().ok()), Some("Bearer"));
    let mut s = RawSession::new(&server.url, &[("x-api-key", "known")]);
    assert_eq!(s.open().await, (200, 202));
}

#[tokio::test]
async fn bad_input_gets_a_clear_error_and_changes_no_budget() {
    let server = TestServer::start("").await;
    let client = server.client(Some("careless")).await;
    let raw = RawSession::new(&server.url, &[("authorization", "Bearer careless")]);

    let (status, _, body) = raw.post_raw("{not json".into(), "application/json").await;
    assert!((400..500).contains(&status), "malformed JSON: {status} {body}");
    let (status, _, body) =
        raw.post_raw(json!({"jsonrpc": "2.0", "id": 1, "method": "ping"}).to_string(), "text/plain").await;
    assert_eq!(status, 415, "{body}");
    assert!(body.contains("application/json"));
    let huge = format!(
        "{{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"ping\",\"params\":{{\"pad\":\"{}\"}}}}",
        "x".repeat(11 << 20)
    );
    let (status, _, body) = raw.post_raw(huge, "application/json").await;
    assert_eq!(status, 413, "{body}");

    let status = call(&client, "rate_limit_status", json!({})).await;
    assert_eq!(budget(&status, "caller:")["remaining"], 60, "no tool budget spent");
    // 415 and 413 are refused from headers, before the limiter: only the malformed JSON (which
    // had to be read to be found bad) and the client's own POSTs count.
    assert_eq!(budget(&status, "http:")["remaining"], 120 - 3 - 1);
}

#[tokio::test]
async fn health_and_metrics_are_never_limited() {
    let server = TestServer::start("[limits.http]\nburst = 1\n").await;
    let mut s = RawSession::new(&server.url, &[]);
    s.open().await;
    assert_eq!(s.ping(1).await.0, 429);
    for path in ["/health", "/metrics", "/health", "/metrics"] {
        let r = reqwest::get(format!("http://{}{path}", server.addr)).await.expect("GET");
        assert_eq!(r.status(), 200, "{path}");
    }
}

#[tokio::test]
async fn the_master_switch_turns_every_limit_off() {
    let server = TestServer::start(
        "[limits]\nenabled = false\n[limits.http]\nburst = 1\n[limits.caller]\nburst = 40\n\
                           [tools.generate_image_to_video]\ncost = 20\n",
    )
    .await;
    let mut s = RawSession::new(&server.url, &[]);
    assert_eq!(s.open().await, (200, 202));
    let (status, headers, _) = s.ping(1).await;
    assert_eq!(status, 200);
    assert!(headers.get("ratelimit").is_none(), "no limit, no headers");
    let client = server.client(Some("free")).await;
    for _ in 0..10 {
        assert!(!is_error(
            &call(&client, "generate_image_to_video", json!({"image_url": "https://x.test/a.png", "prompt": "p"}))
                .await
        ));
    }
}

#[tokio::test]
async fn health_and_metrics_answer_only_this_servers_names_and_metrics_takes_its_key() {
    let http = reqwest::Client::new();
    let get = |url: String, headers: Vec<(&'static str, String)>| {
        let mut request = http.get(url);
        for (name, value) in headers {
            request = request.header(name, value);
        }
        async move {
            let response = request.send().await.expect("answered");
            let status = response.status().as_u16();
            let challenge = response.headers().get("www-authenticate").map(|v| v.to_str().unwrap_or("").to_owned());
            (status, challenge, response.text().await.unwrap_or_default())
        }
    };
    // Open by default, but to this server's own names only: a foreign Host or Origin gets 403,
    // as on /mcp and the dashboard, and not a line of the exposition.
    let server = TestServer::start("").await;
    for path in ["/health", "/metrics"] {
        let url = format!("http://{}{path}", server.addr);
        assert_eq!(get(url.clone(), vec![]).await.0, 200, "{path}");
        for foreign in [("host", "evil.example.com".to_owned()), ("origin", "http://evil.example.com".to_owned())] {
            let (status, _, body) = get(url.clone(), vec![foreign.clone()]).await;
            assert_eq!(status, 403, "{path} {foreign:?}");
            assert!(!body.contains("mcp_ratelimit_") && !body.contains("ok"), "{path}: {body}");
        }
    }

    // With server.metrics_key, only that bearer key reads /metrics; /health stays open.
    const KEY: &str = "a-metrics-key-0123456789";
    let server = TestServer::start(&format!("[server]\nmetrics_key = \"{KEY}\"\n")).await;
    let metrics = format!("http://{}/metrics", server.addr);
    for presented in [None, Some("Bearer wrong-key-0123456789"), Some("Basic a-metrics-key-0123456789")] {
        let headers = presented.map(|p| vec![("authorization", p.to_owned())]).unwrap_or_default();
        let (status, challenge, body) = get(metrics.clone(), headers).await;
        assert_eq!((status, challenge.as_deref()), (401, Some("Bearer")), "{presented:?}");
        assert!(body.contains("server.metrics_key") && !body.contains(KEY), "{body}");
    }
    let (status, _, body) = get(metrics.clone(), vec![("authorization", format!("Bearer {KEY}"))]).await;
    assert_eq!(status, 200);
    assert!(body.contains("mcp_ratelimit_"), "{body}");
    let (status, _, _) =
        get(metrics, vec![("authorization", format!("Bearer {KEY}")), ("host", "evil.example.com".into())]).await;
    assert_eq!(status, 403, "the key does not lift the Host check");
    assert_eq!(get(format!("http://{}/health", server.addr), vec![]).await.0, 200);

    // Under auth.required and no metrics key, /metrics is closed (a tenant's key is not the
    // operator's), and says which key opens it.
    let server = TestServer::start("[auth]\nrequired = true\n[[auth.keys]]\nkey = \"known\"\n").await;
    let metrics = format!("http://{}/metrics", server.addr);
    for headers in [vec![], vec![("authorization", "Bearer known".to_owned())]] {
        let (status, _, body) = get(metrics.clone(), headers).await;
        assert_eq!(status, 401);
        assert!(body.contains("server.metrics_key") && !body.contains("mcp_ratelimit_"), "{body}");
    }
    assert_eq!(get(format!("http://{}/health", server.addr), vec![]).await.0, 200);
    let both = format!("[auth]\nrequired = true\n[[auth.keys]]\nkey = \"known\"\n[server]\nmetrics_key = \"{KEY}\"\n");
    let server = TestServer::start(&both).await;
    let (status, _, _) =
        get(format!("http://{}/metrics", server.addr), vec![("authorization", format!("Bearer {KEY}"))]).await;
    assert_eq!(status, 200);
}

/// Each family of a Prometheus text exposition: its name, and whether it has a `# HELP` and a
/// `# TYPE` line (the type's word), as `promtool check metrics` reads them.
fn families_of(exposition: &str) -> std::collections::BTreeMap<String, (bool, Option<String>)> {
    let mut families: std::collections::BTreeMap<String, (bool, Option<String>)> = Default::default();
    for line in exposition.lines().filter(|l| !l.trim().is_empty()) {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let name = rest.split(' ').next().unwrap_or_default();
            families.entry(name.to_owned()).or_default().0 = true;
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut words = rest.split(' ');
            let name = words.next().unwrap_or_default();
            families.entry(name.to_owned()).or_default().1 = words.next().map(str::to_owned);
        } else if !line.starts_with('#') {
            let name = line.split(['{', ' ']).next().unwrap_or_default();
            families.entry(name.to_owned()).or_default();
        }
    }
    families
}

/// `promtool check metrics` refuses a family without `# HELP`: every family the server emits has
/// its `# HELP` and `# TYPE` (of the kind the code declares), and is one the code's list
/// (`metrics::FAMILIES`) names, so a metric added without a row there cannot hide. The server is
/// exercised first: served and refused calls, a loop, a job, connections counted.
#[tokio::test]
async fn every_metric_family_the_server_emits_has_help_and_type() {
    use mcp_ratelimit::ops::metrics::{FAMILIES, Kind};
    let server = TestServer::start("").await;
    let client = server.client(Some("metrics-walk")).await;
    for n in 0..5 {
        // The same call five times: four served, the fifth refused as a loop.
        let r = call(&client, "list_articles", json!({"query": "agents"})).await;
        assert_eq!(is_error(&r), n == 4, "{}", text(&r));
    }
    assert!(!is_error(&call(&client, "generate_image", json!({"prompt": "a lighthouse"})).await));
    let exposition = server.metrics().await;
    let families = families_of(&exposition);
    for (name, (help, kind)) in &families {
        let family = FAMILIES.iter().find(|f| f.name == name);
        assert!(family.is_some(), "{name} is in /metrics but not in metrics::FAMILIES:\n{exposition}");
        assert!(*help, "{name} has no # HELP line:\n{exposition}");
        let declared = family.map(|f| if f.kind == Kind::Counter { "counter" } else { "gauge" });
        assert_eq!(kind.as_deref(), declared, "{name}'s # TYPE:\n{exposition}");
    }
    // What this run must have made appear, the connection counters (registered when the listener
    // starts, at 0) among them.
    for name in [
        "mcp_ratelimit_connections_refused_total",
        "mcp_ratelimit_connections_timed_out_total",
        "mcp_ratelimit_connections_open",
        "mcp_ratelimit_decisions_total",
        "mcp_ratelimit_rejections_total",
        "mcp_ratelimit_loop_detections_total",
        "mcp_ratelimit_upstream_requests_total",
        "mcp_ratelimit_in_flight_calls",
        "mcp_ratelimit_jobs_in_flight",
        "mcp_ratelimit_store_up",
    ] {
        assert!(FAMILIES.iter().any(|f| f.name == name), "{name} is a family of the code's list");
        assert!(families.contains_key(name), "{name} missing from /metrics:\n{exposition}");
    }
}
