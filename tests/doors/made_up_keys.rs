//! Made-up keys gain nothing at any layer: a credential that is not a configured key proves
//! nothing (anyone can invent one per request), so every unverified caller of one address
//! shares with the others what the address is given — its request limit, its cost budget, its
//! jobs in flight, one flow in the fair queue, its sessions, its tools' own budgets, its spend cap
//! and its loop history — and unverified callers of every address together hold only
//! `upstream.unverified_share` of the account, so configured tenants always find room. Through
//! MCP clients and raw HTTP on a manual clock.

use crate::common::*;
use crate::process::Session;
use serde_json::{Value, json};

const ACME: &str = "[[auth.keys]]\nkey = \"acme-key\"\ntenant = \"acme\"\n";
const GLOBEX: &str = "[[auth.keys]]\nkey = \"globex-key\"\ntenant = \"globex\"\n";

fn image(prompt: &str) -> Value {
    json!({ "prompt": prompt })
}

#[tokio::test]
async fn twenty_made_up_keys_asking_for_a_hundred_images_leave_a_configured_tenant_room() {
    // The defaults: 10 account slots, 5 of them (and 25 of 50 queue places) for unverified
    // callers; 10 jobs in flight per address.
    let server = TestServer::start(ACME).await;
    let mut accepted = Vec::new();
    let mut busy = None;
    for key in 0..20 {
        let agent = server.client(Some(&format!("made-up-{key}"))).await;
        for n in 0..5 {
            let r = call(&agent, "generate_image", image(&format!("{key}-{n}"))).await;
            if is_error(&r) {
                busy.get_or_insert(r);
            } else {
                accepted.push(structured(&r)["predict_id"].as_str().expect("predict_id").to_owned());
            }
        }
    }
    assert_eq!(accepted.len(), 10, "the address's 10 jobs in flight, not 20 keys × 5");
    let busy = busy.expect("refused beyond them");
    assert_eq!(error_code(&busy), Some("busy"), "{}", text(&busy));
    assert_eq!(structured(&busy)["error"]["scope"], "in_flight:address:ip:127.0.0.1");
    assert_eq!(structured(&busy)["error"]["limit"], 10);
    // Of those, the unverified share of the account runs; the rest wait in the address's flow.
    assert_eq!(server.upstream_usage().await["predictions_created"], 5);
    let occupancy = server.app.state().behind.occupancy();
    assert_eq!((occupancy.in_flight, occupancy.unverified_in_flight), (5, 5));
    assert_eq!(occupancy.per_flow, vec![("address:ip:127.0.0.1".to_owned(), 5)], "one flow for the address");

    // A paying tenant's image starts at once: nobody it could overtake may take the slot.
    let customer = server.client(Some("acme-key")).await;
    let mine = call(&customer, "generate_image", image("the customer's")).await;
    assert!(!is_error(&mine), "{}", text(&mine));
    assert!(structured(&mine)["queue_position"].is_null(), "not queued behind them: {}", text(&mine));
    assert_eq!(server.upstream_usage().await["predictions_created"], 6);
    let id = structured(&mine)["predict_id"].as_str().expect("predict_id").to_owned();
    // One job length (the mock's 6 s) and the poll after it: succeeded, well within two.
    server.advance_secs(6.0);
    eventually("the tenant's image succeeded", || async {
        structured(&call(&customer, "get_prediction", json!({ "predict_id": id })).await)["status"] == "succeeded"
    })
    .await;
}

#[tokio::test]
async fn unverified_callers_never_hold_more_than_their_share_of_the_account_or_its_queue() {
    // Three addresses' worth of room per address, so only the share holds them.
    let config = format!("{ACME}[limits.in_flight]\ncaller = 1000\ntenant = 1000\naddress = 1000\n");
    let server = TestServer::start(&config).await;
    let mut accepted = 0;
    let mut refusal = None;
    for key in 0..60 {
        let agent = server.client(Some(&format!("invented-{key}"))).await;
        let r = call(&agent, "generate_image", image(&format!("job {key}"))).await;
        if is_error(&r) {
            refusal.get_or_insert(r);
        } else {
            accepted += 1;
        }
    }
    assert_eq!(accepted, 5 + 25, "5 of the 10 slots running, 25 of the 50 places waiting");
    let refusal = refusal.expect("refused beyond the share");
    assert_eq!(error_code(&refusal), Some("busy"));
    assert_eq!(structured(&refusal)["error"]["scope"], "queue:upstream:unverified", "{}", text(&refusal));
    assert!(structured(&refusal)["error"]["retry_after_ms"].as_u64().is_some_and(|ms| ms > 0));
    assert!(text(&refusal).contains("configured API key"), "{}", text(&refusal));
    // An unverified caller can see the share it is held to, and plan with it.
    let agent = server.client(Some("invented-to-ask")).await;
    let status = call(&agent, "rate_limit_status", json!({})).await;
    let share = json!({"in_flight": 5, "max_in_flight": 5, "waiting": 25, "max_waiting": 25});
    assert_eq!(structured(&status)["upstream_queue"]["unverified_share"], share, "{}", text(&status));
    let scopes: Vec<&str> = structured(&status)["budgets"]
        .as_array()
        .expect("budgets")
        .iter()
        .filter_map(|b| b["scope"].as_str())
        .collect();
    for scope in ["address_http:ip:127.0.0.1", "address:ip:127.0.0.1", "in_flight:address:ip:127.0.0.1"] {
        assert!(scopes.contains(&scope), "{scope} in {scopes:?}");
    }
    // Refused before anything is charged: the address's budget is where it was.
    let again = call(&agent, "generate_image", image("refused again")).await;
    assert_eq!(structured(&again)["error"]["scope"], "queue:upstream:unverified");
    let after = call(&agent, "rate_limit_status", json!({})).await;
    assert_eq!(budget(&after, "address:ip:127.0.0.1"), budget(&status, "address:ip:127.0.0.1"), "nothing charged");
    // A configured tenant still has 5 slots, and the other 25 places, to itself.
    let customer = server.client(Some("acme-key")).await;
    for n in 0..5 {
        let r = call(&customer, "generate_image", image(&format!("acme {n}"))).await;
        assert!(!is_error(&r) && structured(&r)["queue_position"].is_null(), "{n}: {}", text(&r));
    }
    assert_eq!(server.upstream_usage().await["predictions_created"], 10);
    assert_eq!(server.upstream_usage().await["refused_429"], 0);
    let status = call(&customer, "rate_limit_status", json!({})).await;
    assert!(structured(&status)["upstream_queue"]["unverified_share"].is_null(), "a configured key is not held to it");
}

#[tokio::test]
async fn all_unverified_callers_of_an_address_are_one_flow_in_the_fair_queue() {
    // One account slot, no share: the round robin alone decides who goes next.
    let config = format!("{ACME}[upstream]\nmax_in_flight = 1\nunverified_share = 1.0\n{ROOMY_IN_FLIGHT}");
    let server = TestServer::start(&config).await;
    let first = server.client(Some("made-up-first")).await;
    assert!(!is_error(&call(&first, "generate_image", image("holds the slot")).await));
    // Five invented keys queue two jobs each: one flow of ten, not five flows of two.
    for key in 0..5 {
        let agent = server.client(Some(&format!("made-up-{key}"))).await;
        for n in 0..2 {
            let r = call(&agent, "generate_image", image(&format!("{key}/{n}"))).await;
            assert!(structured(&r)["queue_position"].is_u64(), "{}", text(&r));
        }
    }
    let customer = server.client(Some("acme-key")).await;
    let mine = call(&customer, "generate_image", image("the tenant's")).await;
    assert_eq!(structured(&mine)["queue_position"], 2, "one of the address's, then the tenant's: {}", text(&mine));
}

#[tokio::test]
async fn rotating_keys_per_request_meets_a_429_and_configured_keys_keep_their_budgets() {
    let server = TestServer::start(&format!("{ACME}{GLOBEX}{NO_PROGRESS_CHECK}")).await;
    let http = reqwest::Client::new();
    let ping = json!({"jsonrpc": "2.0", "id": 1, "method": "ping"});
    let mut refused = None;
    for n in 0..1500 {
        // A fresh key per request: each gets a fresh `limits.http`, never a fresh address.
        let answer = Session::new(&http, &server.url, &format!("rotated-{n}")).post(&ping).await.expect("answered");
        if answer.status == 429 {
            refused = Some(n);
            break;
        }
    }
    // The clock stands still: exactly the address's burst of 1200 POSTs got through.
    assert_eq!(refused, Some(1200), "the address's request limit, whatever the keys");
    let response = http
        .post(&server.url)
        .header("content-type", "application/json")
        .bearer_auth("yet-another-made-up-key")
        .body(ping.to_string())
        .send()
        .await
        .expect("answered");
    assert_eq!(response.status(), 429);
    assert_eq!(response.headers()["ratelimit-policy"], "\"address_http\";q=1200;w=60");
    assert!(response.headers()["retry-after"].to_str().is_ok_and(|s| s == "1"), "{:?}", response.headers());

    // Two configured keys from that address: each its own budget, neither charged to the address.
    for key in ["acme-key", "globex-key"] {
        let client = server.client(Some(key)).await;
        let (passed, refusal) = spend_until_refused(&client, "list_articles", 100).await;
        assert_eq!(passed, 60, "{key}: the whole caller budget");
        assert!(structured(&refusal)["error"]["scope"].as_str().is_some_and(|s| s.starts_with("caller:tok:")));
    }
}

/// Calls `tool` with fresh arguments until refused; (admitted, the refusal).
async fn spend_until_refused(client: &Client, tool: &str, at_most: usize) -> (usize, rmcp::model::CallToolResult) {
    for n in 0..at_most {
        let r = call(client, tool, json!({ "query": format!("q{n}") })).await;
        if is_error(&r) {
            return (n, r);
        }
    }
    panic!("{tool} was never refused in {at_most} calls");
}

#[tokio::test]
async fn an_addresss_tool_budgets_spend_cap_and_loop_history_are_shared_by_its_made_up_keys() {
    let config = "[tools.save_article.budget]\nalgorithm = \"fixed_window\"\nlimit = 3\nwindow_ms = 3600000\n\
                  [spend_caps]\ndaily_units = 20\n[tools.generate_image_to_video]\ncost = 20\n\
                  [loop_detection]\nno_progress = 0\n";
    let server = TestServer::start(config).await;
    // The tool's own budget: 3 saves per address, whichever keys ask.
    for n in 0..3 {
        let agent = server.client(Some(&format!("saver-{n}"))).await;
        let r = call(&agent, "save_article", json!({"title": format!("t{n}"), "body": "b"})).await;
        assert!(!is_error(&r), "{}", text(&r));
    }
    let agent = server.client(Some("saver-4")).await;
    let r = call(&agent, "save_article", json!({"title": "t4", "body": "b"})).await;
    assert_eq!(error_code(&r), Some("rate_limited"));
    assert_eq!(structured(&r)["error"]["scope"], "address:ip:127.0.0.1:tool:save_article");

    // The spend cap: 20 units a day for the address, 6 of them spent on those saves.
    for n in 0..14 {
        let agent = server.client(Some(&format!("reader-{n}"))).await;
        assert!(!is_error(&call(&agent, "list_articles", json!({"query": format!("r{n}")})).await));
    }
    let agent = server.client(Some("reader-15")).await;
    let r = call(&agent, "list_articles", json!({"query": "one more"})).await;
    assert_eq!(error_code(&r), Some("rate_limited"));
    assert_eq!(structured(&r)["error"]["scope"], "spend:address:ip:127.0.0.1");

    // The loop history: the same call from five invented keys is one agent repeating itself.
    let server = TestServer::start("").await;
    let mut last = None;
    for n in 0..5 {
        let agent = server.client(Some(&format!("looping-{n}"))).await;
        last = Some(call(&agent, "list_articles", json!({"query": "the same thing"})).await);
    }
    let last = last.expect("five calls");
    assert_eq!(error_code(&last), Some("loop_detected"), "{}", text(&last));

    // And by its answers: a search rephrased by six invented keys, each finding nothing, is one
    // agent getting the same answer; the sixth is refused.
    let server = TestServer::start("").await;
    for n in 0..6 {
        let agent = server.client(Some(&format!("paraphrasing-{n}"))).await;
        let r = call(&agent, "list_articles", json!({"query": format!("nothing like this, take {n}")})).await;
        match n {
            5 => assert_eq!(error_code(&r), Some("loop_detected"), "{}", text(&r)),
            _ => assert!(!is_error(&r), "search {n}: {}", text(&r)),
        }
    }
}

/// `initialize` over raw HTTP for `token`: the status, and the session id when one was opened.
async fn initialize(http: &reqwest::Client, url: &str, token: &str) -> (u16, Option<String>) {
    let mut session = Session::new(http, url, token);
    let status = session.open().await.expect("answered");
    (status, session.id)
}

#[tokio::test]
async fn the_unverified_callers_of_one_address_hold_at_most_their_sessions() {
    let server = TestServer::start(&format!("{ACME}[server]\nmax_sessions_per_address = 3\n")).await;
    let http = reqwest::Client::new();
    let mut open = Vec::new();
    for n in 0..3 {
        let (status, id) = initialize(&http, &server.url, &format!("session-{n}")).await;
        assert_eq!(status, 200);
        open.push(id.expect("a session id"));
    }
    let refused = http
        .post(&server.url)
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .bearer_auth("session-3")
        .body(
            json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})
            .to_string(),
        )
        .send()
        .await
        .expect("answered");
    assert_eq!(refused.status(), 429, "a fourth made-up key from the address");
    assert_eq!(refused.headers()["retry-after"], "5");
    let body: Value = refused.json().await.expect("a JSON-RPC error");
    assert!(body["error"]["message"].as_str().is_some_and(|m| m.contains("this address")), "{body}");
    // A configured key from the same address is not counted with them.
    assert_eq!(initialize(&http, &server.url, "acme-key").await.0, 200);
    // Closing one gives the address its place back.
    let closed = http.delete(&server.url).header("mcp-session-id", &open[0]).bearer_auth("session-0").send().await;
    assert!(closed.expect("DELETE answered").status().is_success());
    eventually("the closed session is gone from rmcp's map", || async {
        initialize(&http, &server.url, "session-4").await.0 == 200
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_initializes_never_open_more_sessions_than_a_cap_allows() {
    // The server-wide cap, with configured keys (no address involved).
    let keys: String = (0..40).map(|n| format!("[[auth.keys]]\nkey = \"key-{n}\"\n")).collect();
    let server = TestServer::start(&format!("[server]\nmax_sessions = 5\n{keys}")).await;
    let http = reqwest::Client::new();
    let opening = (0..40).map(|n| {
        let (http, url) = (http.clone(), server.url.clone());
        tokio::spawn(async move { initialize(&http, &url, &format!("key-{n}")).await.0 })
    });
    let statuses: Vec<u16> = futures::future::join_all(opening).await.into_iter().map(|s| s.expect("task")).collect();
    assert_eq!(statuses.iter().filter(|s| **s == 200).count(), 5, "{statuses:?}");
    assert!(statuses.iter().all(|s| *s == 200 || *s == 503), "{statuses:?}");

    // The cap per address, with made-up keys at once from one address.
    let server = TestServer::start("[server]\nmax_sessions_per_address = 5\n").await;
    let opening = (0..40).map(|n| {
        let (http, url) = (http.clone(), server.url.clone());
        tokio::spawn(async move { initialize(&http, &url, &format!("made-up-{n}")).await.0 })
    });
    let statuses: Vec<u16> = futures::future::join_all(opening).await.into_iter().map(|s| s.expect("task")).collect();
    assert_eq!(statuses.iter().filter(|s| **s == 200).count(), 5, "{statuses:?}");
    assert!(statuses.iter().all(|s| *s == 200 || *s == 429), "{statuses:?}");
}

#[tokio::test]
async fn ipv6_callers_rotating_addresses_within_one_64_are_one_address() {
    // Behind a trusted proxy (loopback), the caller is the forwarded IPv6 address. One host holds
    // its /64 whole, so rotating the low 64 bits (and the key) buys nothing either.
    let config = "[server]\ntrust_proxy = true\n[limits.address_http]\nburst = 10\nrefill_per_sec = 0.1\n";
    let server = TestServer::start(config).await;
    let http = reqwest::Client::new();
    let ping = json!({"jsonrpc": "2.0", "id": 1, "method": "ping"}).to_string();
    let post = |token: String, from: String| {
        http.post(&server.url)
            .header("content-type", "application/json")
            .header("x-forwarded-for", from)
            .bearer_auth(token)
            .body(ping.clone())
            .send()
    };
    for n in 0..10 {
        let r = post(format!("k{n}"), format!("2001:db8:0:7::{:x}", n + 1)).await.expect("answered");
        assert_ne!(r.status(), 429, "request {n}");
    }
    let refused = post("k10".into(), "2001:db8:0:7:ffff:ffff:ffff:fffe".into()).await.expect("answered");
    assert_eq!(refused.status(), 429, "the /64's 11th request");
    assert_eq!(refused.headers()["ratelimit-policy"], "\"address_http\";q=10;w=100");
    let elsewhere = post("k11".into(), "2001:db8:0:8::1".into()).await.expect("answered");
    assert_ne!(elsewhere.status(), 429, "another /64 is another address");
}

/// An `initialize` over raw HTTP with `headers`: its status, and the error message of a refusal.
async fn initialize_with(url: &str, headers: &[(&str, &str)]) -> (u16, String) {
    let mut session = RawSession::new(url, headers);
    let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}});
    let (status, response_headers, body) = session.post(init).await;
    session.session_id = response_headers.get("mcp-session-id").and_then(|v| v.to_str().ok()).map(str::to_owned);
    let message = jsonrpc_of(&body)["error"]["message"].as_str().unwrap_or_default().to_owned();
    (status, message)
}

#[tokio::test]
async fn unverified_callers_of_many_addresses_hold_their_share_and_a_configured_key_still_finds_a_session() {
    // A /56 is 256 /64s: each its own address by default, so the cap per address alone lets a host
    // holding one fill the server. The unverified share caps them all together.
    // The defaults: unverified_session_share 0.5; a key holds 0.1 of 8, so one each.
    let keys: String = (0..4).map(|n| format!("[[auth.keys]]\nkey = \"key-{n}\"\n")).collect();
    let config = format!("{keys}[server]\ntrust_proxy = true\nmax_sessions = 8\nmax_sessions_per_address = 2\n");
    let server = TestServer::start(&config).await;
    let mut statuses = Vec::new();
    for n in 0..8 {
        let from = format!("2001:db8:0:{n:x}::1");
        let token = format!("Bearer made-up-{n}");
        statuses.push(initialize_with(&server.url, &[("x-forwarded-for", &from), ("authorization", &token)]).await);
    }
    let codes: Vec<u16> = statuses.iter().map(|(status, _)| *status).collect();
    assert_eq!(codes, [200, 200, 200, 200, 503, 503, 503, 503], "{statuses:?}");
    assert!(statuses[4].1.contains("without a configured API key"), "{}", statuses[4].1);
    for n in 0..4 {
        let status = initialize_with(&server.url, &[("authorization", &format!("Bearer key-{n}"))]).await.0;
        assert_eq!(status, 200, "configured key {n}: the unverified callers left room");
    }
    let made_up = initialize_with(&server.url, &[("x-forwarded-for", "2001:db8:1::1")]).await.0;
    assert_eq!(made_up, 503, "now every session is taken");

    // With the prefix at /56, that host is one address: its cap per address holds it.
    let server = TestServer::start(&format!("{config}ipv6_prefix = 56\n")).await;
    let mut codes = Vec::new();
    for n in 0..4 {
        let from = format!("2001:db8:0:{n:x}::1");
        let token = format!("Bearer made-up-{n}");
        codes.push(initialize_with(&server.url, &[("x-forwarded-for", &from), ("authorization", &token)]).await.0);
    }
    assert_eq!(codes, [200, 200, 429, 429]);
    let next_56 = initialize_with(&server.url, &[("x-forwarded-for", "2001:db8:0:100::1")]).await.0;
    assert_eq!(next_56, 200, "the next /56 is another address");
}

#[tokio::test]
async fn one_key_or_one_tenant_cannot_take_every_session() {
    // The repro with the defaults: one key opening session after session of 30.
    let server = TestServer::start(&format!("{ACME}{GLOBEX}[server]\nmax_sessions = 30\n")).await;
    let mut opened = 0;
    let refused = loop {
        let (status, message) = initialize_with(&server.url, &[("authorization", "Bearer acme-key")]).await;
        if status != 200 {
            break (status, message);
        }
        opened += 1;
        assert!(opened <= 30, "one key took every session");
    };
    assert_eq!((opened, refused.0), (3, 429), "key_session_share 0.1 of 30: {refused:?}");
    assert!(refused.1.contains("this API key"), "{}", refused.1);
    assert_eq!(initialize_with(&server.url, &[("authorization", "Bearer globex-key")]).await.0, 200, "the next tenant");

    // A tenant's keys together hold at most its share; another tenant's keys are not counted.
    let keys = "[[auth.keys]]\nkey = \"a1\"\ntenant = \"acme\"\n[[auth.keys]]\nkey = \"a2\"\ntenant = \"acme\"\n\
                [[auth.keys]]\nkey = \"a3\"\ntenant = \"acme\"\n[[auth.keys]]\nkey = \"b1\"\ntenant = \"beta\"\n\
                [[auth.keys]]\nkey = \"solo\"\n";
    let server = TestServer::start(&format!(
        "{keys}[server]\nmax_sessions = 10\nkey_session_share = 0.2\ntenant_session_share = 0.3\n"
    ))
    .await;
    let open = |key: &'static str| {
        let url = server.url.clone();
        async move { initialize_with(&url, &[("authorization", &format!("Bearer {key}"))]).await }
    };
    assert_eq!((open("a1").await.0, open("a1").await.0), (200, 200));
    assert_eq!(open("a1").await.0, 429, "a key holds 2 of 10");
    assert_eq!(open("a2").await.0, 200);
    let tenant_full = open("a3").await;
    assert_eq!(tenant_full.0, 429, "the tenant holds 3 of 10");
    assert!(tenant_full.1.contains("tenant"), "{}", tenant_full.1);
    assert_eq!((open("b1").await.0, open("solo").await.0, open("solo").await.0), (200, 200, 200));
    assert_eq!(open("solo").await.0, 429, "a key without a tenant is held per key");
}

/// A 2026-07-28 MCP client (no session, `server/discover`) presenting `token`.
async fn modern_client(url: &str, token: &str) -> Client {
    use rmcp::model::ProtocolVersion;
    use rmcp::transport::StreamableHttpClientTransport;
    use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
    use rmcp::{ClientLifecycleMode, ClientServiceExt};
    let config = StreamableHttpClientTransportConfig::with_uri(url.to_owned()).auth_header(token);
    let lifecycle = ClientLifecycleMode::Discover { preferred_versions: vec![ProtocolVersion::V_2026_07_28] };
    ().serve_with_lifecycle(StreamableHttpClientTransport::from_config(config), lifecycle)
        .await
        .expect("a 2026-07-28 client needs no session")
}

#[tokio::test]
async fn a_2026_client_is_never_held_to_the_session_caps_nor_holds_a_place_in_them() {
    let server = TestServer::start(&format!("{ACME}[server]\nmax_sessions = 1\n")).await;
    // A stateless call under way (its upstream request held) is no session being opened: a
    // legacy client still opens the only session.
    let modern = modern_client(&server.url, "acme-key").await;
    server.chaos(json!({"hold": true})).await;
    let calling = tokio::spawn(async move {
        let answer = call(&modern, "list_articles", json!({"limit": 1})).await;
        (modern, answer)
    });
    settle().await;
    let legacy = server.client(Some("acme-key")).await;
    server.chaos(json!({"hold": false})).await;
    let (modern, answer) = calling.await.expect("the call");
    assert!(!is_error(&answer), "{}", text(&answer));
    // With every session taken, a 2026-07-28 client of the same key, or of none, still calls.
    assert_eq!(initialize_with(&server.url, &[("authorization", "Bearer acme-key")]).await.0, 503, "full");
    for client in [modern, modern_client(&server.url, "made-up").await] {
        let status = call(&client, "rate_limit_status", json!({})).await;
        assert!(!is_error(&status), "{}", text(&status));
        client.cancel().await.ok();
    }
    assert!(!is_error(&call(&legacy, "rate_limit_status", json!({})).await), "the legacy session still works");
}

#[tokio::test]
async fn only_messages_keep_a_session_open_not_its_get_stream() {
    let idle: u64 = 60;
    let server = TestServer::start(&format!("[server]\nsession_idle_timeout_seconds = {idle}\n")).await;
    let mut streaming = RawSession::new(&server.url, &[("authorization", "Bearer streams-only")]);
    let mut talking = RawSession::new(&server.url, &[("authorization", "Bearer talks")]);
    assert_eq!((streaming.open().await, talking.open().await), ((200, 202), (200, 202)));
    let stream = |session: &RawSession| {
        let id = session.session_id.clone().expect("a session");
        session
            .http
            .get(&session.url)
            .header("accept", "text/event-stream")
            .header("mcp-session-id", id)
            .header("mcp-protocol-version", "2025-11-25")
            .header("authorization", "Bearer streams-only")
            .send()
    };
    // Every 10 s of the server's clock: a GET stream opened (and dropped) in one session, a ping
    // in the other.
    for step in 1..=5 {
        server.advance_ms(10_000);
        let get = stream(&streaming).await.expect("GET answered");
        assert_eq!(get.status(), 200, "step {step}");
        drop(get);
        assert_eq!(talking.ping(step).await.0, 200, "step {step}");
    }
    // 60 s after its last message, the streaming session is closed; the talking one lives on.
    server.advance_ms(10_000);
    eventually("the session with only GETs is closed", || async { streaming.ping(100).await.0 == 404 }).await;
    assert_eq!(talking.ping(101).await.0, 200, "10 s since its last ping");
    server.advance_ms(idle * 1000 - 1);
    assert_eq!(talking.ping(102).await.0, 200, "a moment before its idle time is up");
    server.advance_ms(idle * 1000);
    eventually("the talking session is closed once it is quiet", || async { talking.ping(103).await.0 == 404 }).await;

    // A call under way is a message until it is answered: its session outlives the idle time.
    let client = server.client(Some("a-long-call")).await;
    server.chaos(json!({"hold": true})).await;
    let calling = tokio::spawn(async move {
        let answer = call(&client, "list_articles", json!({"limit": 1})).await;
        (client, answer)
    });
    settle().await;
    server.advance_ms(idle * 2000);
    settle().await;
    server.chaos(json!({"hold": false})).await;
    // Had its session been closed under it, the call would never be answered.
    let answered = tokio::time::timeout(std::time::Duration::from_secs(10), calling).await;
    let (client, answer) = answered.expect("the call is answered in its session").expect("the call");
    assert!(!is_error(&answer), "answered in its session: {}", text(&answer));
    assert!(!is_error(&call(&client, "rate_limit_status", json!({})).await), "and the session goes on");
}
