//! Identical calls coalesced and answers reused (`[tools.NAME] coalesce`, `cache_ttl_ms`),
//! through MCP clients against the embedded mock, on the manual clock: ten agents of one tenant
//! asking the same question at once cost one upstream request, never one across tenants; each is
//! charged; a kept answer serves until its TTL, and only in its scope.

use crate::common::*;
use mcp_ratelimit::config::{Catalogue, Coalesce};
use mcp_ratelimit::{Config, mcp::tools::catalogue};
use rmcp::model::CallToolResult;
use serde_json::json;

/// `n` configured keys of `tenant`, as `[[auth.keys]]` entries, and the keys.
fn keys(tenant: &str, n: usize) -> (String, Vec<String>) {
    let keys: Vec<String> = (0..n).map(|i| format!("sk-{tenant}-{i:02}-reuse-7f3a91")).collect();
    let toml = keys.iter().map(|k| format!("[[auth.keys]]\nkey = \"{k}\"\ntenant = \"{tenant}\"\n")).collect();
    (toml, keys)
}

async fn articles_listed(server: &TestServer) -> u64 {
    server.upstream_usage().await["articles_listed"].as_u64().expect("articles_listed")
}

/// How another call's request answered `result`: `coalesced`, `cached`, or `None` (it asked).
fn reused(result: &CallToolResult) -> Option<&'static str> {
    ["coalesced", "cached"].into_iter().find(|how| structured(result)[*how] == true)
}

/// Calls `list_articles` with one query from a client of each of `keys` at once, while the mock
/// holds every request at its gate, and releases the gate once `joined` calls wait for another's
/// request; the upstream requests that made, and the answers.
async fn at_once(server: &TestServer, keys: &[String], joined: u64) -> (u64, Vec<CallToolResult>) {
    let mut clients = Vec::new();
    for key in keys {
        clients.push(server.client(Some(key)).await);
    }
    let before = articles_listed(server).await;
    server.chaos(json!({"hold": true})).await;
    let calls: Vec<_> = clients
        .into_iter()
        .map(|client| {
            tokio::spawn(async move { call(&client, "list_articles", json!({"query": "lighthouses"})).await })
        })
        .collect();
    let saved = || async { server.app.state().limits.reuse().saved().coalesced };
    eventually("the identical calls wait for the first one's request", || async { saved().await == joined }).await;
    server.chaos(json!({"hold": false})).await;
    let mut answers = Vec::new();
    for call in calls {
        answers.push(call.await.expect("the call"));
    }
    (articles_listed(server).await - before, answers)
}

#[tokio::test]
async fn ten_identical_calls_of_one_tenant_cost_one_upstream_request_and_each_is_charged() {
    let (toml, keys) = keys("acme", 10);
    let server = TestServer::start(&toml).await;
    let (requests, answers) = at_once(&server, &keys, 9).await;
    assert_eq!(requests, 1, "one upstream request for the ten");
    assert!(answers.iter().all(|a| !is_error(a)), "ten answers: {answers:?}");
    let first = &structured(&answers[0])["articles"];
    assert!(answers.iter().all(|a| &structured(a)["articles"] == first), "the same answer for each");
    let how: Vec<_> = answers.iter().map(reused).collect();
    assert_eq!(how.iter().filter(|h| **h == Some("coalesced")).count(), 9, "{how:?}");
    // Each caller was charged the tool's cost, whoever asked upstream; the tenant all ten.
    for key in &keys {
        let status = call(&server.client(Some(key)).await, "rate_limit_status", json!({})).await;
        assert_eq!(budget(&status, "caller:")["remaining"], 59, "{}", structured(&status));
        assert_eq!(budget(&status, "tenant:acme")["remaining"], 290);
    }
    let saved = metric_sum(&server.metrics().await, "mcp_ratelimit_upstream_requests_saved_total");
    assert_eq!(saved, 9.0);
}

#[tokio::test]
async fn never_across_tenants_and_never_with_coalesce_off() {
    let (acme, acme_keys) = keys("acme", 5);
    let (globex, globex_keys) = keys("globex", 5);
    let server = TestServer::start(&format!("{acme}{globex}")).await;
    let (requests, answers) = at_once(&server, &[acme_keys, globex_keys].concat(), 8).await;
    assert_eq!(requests, 2, "one request per tenant");
    assert_eq!(answers.iter().filter(|a| reused(a).is_none()).count(), 2);

    let (toml, keys) = keys("acme", 10);
    let off =
        TestServer::start(&format!("{toml}[tools.list_articles]\ncost = 1\nfail = \"open\"\ncoalesce = \"off\"\n"))
            .await;
    let (requests, answers) = at_once(&off, &keys, 0).await;
    assert_eq!(requests, 10, "coalesce = \"off\": each call its own request");
    assert!(answers.iter().all(|a| !is_error(a) && reused(a).is_none()));
}

#[tokio::test]
async fn a_kept_answer_serves_its_scope_until_its_ttl_then_one_request_again() {
    let (acme, acme_keys) = keys("acme", 2);
    let (globex, globex_keys) = keys("globex", 1);
    let server =
        TestServer::start(&format!("{acme}{globex}[tools.list_articles]\ncost = 1\ncache_ttl_ms = 5000\n")).await;
    let (first, second) = (server.client(Some(&acme_keys[0])).await, server.client(Some(&acme_keys[1])).await);
    let other = server.client(Some(&globex_keys[0])).await;
    let before = articles_listed(&server).await;
    let asked = call(&first, "list_articles", json!({"query": "lighthouses"})).await;
    assert_eq!((articles_listed(&server).await - before, reused(&asked)), (1, None));
    server.advance_secs(4.9);
    let kept = call(&second, "list_articles", json!({"query": "lighthouses"})).await;
    assert_eq!((articles_listed(&server).await - before, reused(&kept)), (1, Some("cached")), "no request");
    assert_eq!(structured(&kept)["articles"], structured(&asked)["articles"]);
    let theirs = call(&other, "list_articles", json!({"query": "lighthouses"})).await;
    assert_eq!((articles_listed(&server).await - before, reused(&theirs)), (2, None), "globex's is its own");
    let other_query = call(&first, "list_articles", json!({"query": "harbours"})).await;
    assert_eq!((articles_listed(&server).await - before, reused(&other_query)), (3, None), "other arguments");
    server.advance_secs(0.1);
    let after = call(&second, "list_articles", json!({"query": "lighthouses"})).await;
    assert_eq!((articles_listed(&server).await - before, reused(&after)), (4, None), "past the TTL: one request");
    // A refusal from the upstream is never kept.
    server.chaos(json!({"rate_429": 1.0})).await;
    let refused = call(&first, "list_articles", json!({"query": "storms"})).await;
    assert_eq!(error_code(&refused), Some("upstream_rate_limited"));
    server.chaos(json!({"rate_429": 0.0})).await;
    let served = call(&second, "list_articles", json!({"query": "storms"})).await;
    assert!(!is_error(&served) && reused(&served).is_none(), "{served:?}");
}

#[test]
fn a_tool_whose_answer_is_the_callers_own_or_a_job_cannot_share_it() {
    let tools = catalogue();
    for (tool, key) in [
        ("rate_limit_status", "coalesce = \"tenant\""),
        ("get_prediction", "cache_ttl_ms = 1000"),
        ("cancel_prediction", "coalesce = \"caller\""),
        ("generate_image", "coalesce = \"tenant\""),
    ] {
        let toml = format!("[tools.{tool}]\ncost = 0\n{key}\n");
        let error = Config::from_toml(&toml, &tools).expect_err(tool).to_string();
        let name = key.split(' ').next().unwrap_or_default();
        assert!(error.contains(&format!("`tools.{tool}.{name}`")), "{error}");
    }
    let too_long = Config::from_toml("[tools.list_articles]\ncost = 1\ncache_ttl_ms = 86400001\n", &tools);
    assert!(too_long.expect_err("past a day").to_string().contains("`tools.list_articles.cache_ttl_ms`"));
    let unknown = Config::from_toml("[tools.list_articles]\ncost = 1\ncoalesce = \"everyone\"\n", &tools);
    assert!(unknown.is_err(), "only tenant, caller or off");
    // Behind the proxy nothing is known of a tool but what the config says: any may share.
    let learned = Config::from_toml(
        "[tools.search]\ncost = 1\ncoalesce = \"tenant\"\ncache_ttl_ms = 500\n",
        &Catalogue::learned(),
    );
    let search = &learned.expect("a proxied tool may share").limiting.tools["search"];
    assert_eq!((search.coalesce, search.cache_ttl_ms), (Coalesce::Tenant, 500));
}
