//! Tenants, tiers and per-method limits through an MCP client: keys of one tenant share its
//! budget, other tenants are unaffected, tiers scale budgets, discovery cannot eat the tool
//! budget, and a refusal in a later scope charges no earlier one.

use crate::common::*;
use rmcp::model::PaginatedRequestParams;
use serde_json::json;

const TENANTS: &str = r#"
[limits.tenant]
burst = 50
refill_per_sec = 1.0

[limits.in_flight]
caller = 1000
tenant = 1000
address = 1000

[upstream]
max_in_flight = 1000

[loop_detection]
enabled = false

[mock_upstream]
max_concurrent_predictions = 1000

[[auth.keys]]
key = "acme-one"
tenant = "acme"

[[auth.keys]]
key = "acme-two"
tenant = "acme"

[[auth.keys]]
key = "beta-one"
tenant = "beta"

[[auth.keys]]
key = "ops-admin"
tier = "admin"

[[auth.keys]]
key = "trial"
tier = "guest"
"#;

const IMAGE: fn() -> serde_json::Value = || json!({"prompt": "a kite"});

#[tokio::test]
async fn keys_of_one_tenant_share_its_budget_and_other_tenants_are_unaffected() {
    let server = TestServer::start(TENANTS).await;
    let one = server.client(Some("acme-one")).await;
    let two = server.client(Some("acme-two")).await;
    let beta = server.client(Some("beta-one")).await;

    for _ in 0..6 {
        assert!(!is_error(&call(&one, "generate_image", IMAGE()).await));
    }
    for _ in 0..4 {
        assert!(!is_error(&call(&two, "generate_image", IMAGE()).await));
    }
    // acme has spent 50 of its 50; each key has spent less than its own 60.
    let refused = call(&two, "generate_image", IMAGE()).await;
    assert_eq!(error_code(&refused), Some("rate_limited"));
    let error = &structured(&refused)["error"];
    assert_eq!(error["scope"], "tenant:acme");
    assert_eq!(error["limit"], 50);
    assert_eq!(error["retry_after_ms"], 5000, "5 tokens at 1/s");

    // The refusal at the tenant scope left the key's own budget as it was.
    let status = call(&two, "rate_limit_status", json!({})).await;
    assert_eq!(budget(&status, "caller:")["remaining"], 40);
    assert_eq!(budget(&status, "tenant:acme")["remaining"], 0);

    for _ in 0..10 {
        assert!(!is_error(&call(&beta, "generate_image", IMAGE()).await), "beta has its own tenant budget");
    }
}

#[tokio::test]
async fn tiers_scale_a_callers_own_budgets() {
    let server = TestServer::start(TENANTS).await;
    let admin = server.client(Some("ops-admin")).await;
    let status = call(&admin, "rate_limit_status", json!({})).await;
    assert_eq!(budget(&status, "caller:")["limit"], 240, "admin ×4");
    assert_eq!(budget(&status, "http:")["limit"], 480);
    let (passed, refused) = spend_until_refused(&admin, "generate_image", IMAGE(), 100).await;
    assert_eq!(passed, 48, "240 tokens / cost 5");
    assert_eq!(structured(&refused)["error"]["limit"], 240);

    let guest = server.client(Some("trial")).await;
    let (passed, _) = spend_until_refused(&guest, "generate_image", IMAGE(), 100).await;
    assert_eq!(passed, 6, "guest ×0.5: 30 tokens / cost 5");

    let anonymous = server.client(Some("unconfigured")).await;
    let (passed, _) = spend_until_refused(&anonymous, "generate_image", IMAGE(), 100).await;
    assert_eq!(passed, 12, "an unconfigured key is the default tier");
}

#[tokio::test]
async fn hammering_tools_list_does_not_reduce_what_tools_call_may_do() {
    let server = TestServer::start(NO_LOOP_DETECTION).await;
    let client = server.client(Some("explorer")).await;
    let mut listed = 0;
    let mut refused = None;
    for _ in 0..40 {
        match client.list_tools(Some(PaginatedRequestParams::default())).await {
            Ok(_) => listed += 1,
            Err(e) => refused = Some(e.to_string()),
        }
    }
    assert_eq!(listed, 30, "tools/list has its own burst of 30");
    let refused = refused.expect("the 31st tools/list is refused");
    assert!(refused.contains("Rate limit reached for tools/list"), "{refused}");

    let (passed, _) = spend_until_refused(&client, "list_articles", json!({}), 100).await;
    assert_eq!(passed, 60, "the whole tool budget is still there");
}

#[tokio::test]
async fn the_tools_call_method_limit_counts_calls_whatever_their_cost() {
    let server = TestServer::start("[limits.method.tools_call]\nburst = 5\n").await;
    let client = server.client(Some("chatty")).await;
    for _ in 0..5 {
        assert!(!is_error(&call(&client, "rate_limit_status", json!({})).await));
    }
    let refused = call(&client, "rate_limit_status", json!({})).await;
    assert_eq!(error_code(&refused), Some("rate_limited"));
    assert!(structured(&refused)["error"]["scope"].as_str().is_some_and(|s| s.starts_with("method:tools/call:")));
}

#[tokio::test]
async fn ping_is_limited_as_an_other_method() {
    let server = TestServer::start("[limits.method.other]\nburst = 2\n").await;
    let client = server.client(Some("pinger")).await;
    let ping = || client.send_request(rmcp::model::ClientRequest::PingRequest(Default::default()));
    assert!(ping().await.is_ok());
    assert!(ping().await.is_ok());
    let refused = ping().await.expect_err("third ping refused");
    assert!(refused.to_string().contains("Rate limit reached for ping"), "{refused}");
    assert!(!is_error(&call(&client, "list_articles", json!({})).await), "tools are unaffected");
}
