//! Limits stated fully, through an MCP client: several limits on one scope (a minute bucket and a
//! day cap) each refusing with its own exact wait, warnings before a cap is reached, daily spend
//! caps per tenant that no tier multiplies, shadow limits that count without refusing, and
//! per-key and per-tenant budgets. The server's clock is a `ManualClock` that starts at the Unix
//! epoch, so a day window ends at a multiple of 86 400 s.

use crate::common::*;
use serde_json::json;

const DAY_MS: u64 = 86_400_000;

/// Nothing but the limits under test refuses: roomy method, HTTP and address budgets, no loop
/// detection (the calls vary their arguments anyway).
const ROOMY: &str = r#"
[limits.http]
burst = 100000
refill_per_sec = 1000.0
[limits.method.tools_call]
burst = 100000
refill_per_sec = 1000.0
[limits.address]
burst = 100000
refill_per_sec = 1000.0
[loop_detection]
enabled = false
"#;

fn query(i: usize) -> serde_json::Value {
    json!({"query": format!("q{i}")})
}

#[tokio::test]
async fn a_minute_budget_and_a_day_cap_each_refuse_with_their_own_wait_and_the_day_warns_at_80_percent() {
    let config = format!(
        r#"{ROOMY}
[[limits.caller]]
algorithm = "fixed_window"
limit = 60
window_ms = 60000
[[limits.caller]]
name = "day"
algorithm = "fixed_window"
limit = 100
window_ms = 86400000
"#
    );
    let server = TestServer::start(&config).await;
    let agent = server.client(Some("steady-agent")).await;
    let mut calls = 0;
    let mut elapsed_ms = 0;
    let mut minute_refusals = 0;
    loop {
        let r = call(&agent, "list_articles", query(calls)).await;
        if is_error(&r) {
            let error = &structured(&r)["error"];
            assert_eq!(error["code"], "rate_limited", "{}", text(&r));
            let scope = error["scope"].as_str().expect("scope");
            if scope.ends_with("#day") {
                // The day cap: the wait runs to the end of the UTC day, exactly.
                assert_eq!(calls, 100, "the day cap holds at 100 calls");
                assert_eq!(error["retry_after_ms"], DAY_MS - elapsed_ms, "{error}");
                assert!(error["policy"].as_str().is_some_and(|p| p.contains("100 per 86400000 ms")), "{error}");
                assert!(text(&r).contains("#day"), "the message names the limit: {}", text(&r));
                break;
            }
            // The minute budget: its wait is the rest of this minute; walk to it and go on.
            minute_refusals += 1;
            assert_eq!(calls % 60, 0, "the minute budget refuses after 60 in a minute: {error}");
            let wait = error["retry_after_ms"].as_u64().expect("wait");
            assert_eq!(wait, 60_000 - elapsed_ms % 60_000, "{error}");
            server.advance_ms(wait);
            elapsed_ms += wait;
            continue;
        }
        calls += 1;
        let warnings = structured(&r)["warnings"].as_array().cloned().unwrap_or_default();
        if calls < 80 {
            assert!(warnings.is_empty(), "no warning before 80 % (call {calls}): {warnings:?}");
        } else {
            // From the 80th call on, the day cap warns; the minute window never does (too short
            // to plan with).
            assert_eq!(warnings.len(), 1, "call {calls}: {warnings:?}");
            assert!(warnings[0]["scope"].as_str().is_some_and(|s| s.ends_with("#day")));
            assert_eq!(warnings[0]["used"], calls as u64);
            assert_eq!(warnings[0]["percent_used"], calls as u64);
            assert!(text(&r).contains(&format!("{calls}% of the limit")), "{}", text(&r));
        }
        // A steady agent: one call every 10 s.
        server.advance_ms(10_000);
        elapsed_ms += 10_000;
    }
    assert!(minute_refusals == 0, "at one call per 10 s the minute budget never refused");

    // A burst, the next day: the minute budget refuses at 60, the day cap is fresh.
    server.advance_ms(DAY_MS - elapsed_ms);
    let (admitted, refusal) = spend_until_refused(&agent, "list_articles", query(10_000), 200).await;
    assert_eq!(admitted, 60);
    let error = &structured(&refusal)["error"];
    assert!(!error["scope"].as_str().expect("scope").contains('#'), "the minute budget refused: {error}");
    assert_eq!(error["retry_after_ms"], 60_000);

    // rate_limit_status shows both limits of the caller scope.
    let status = call(&agent, "rate_limit_status", json!({})).await;
    let budgets = structured(&status)["budgets"].as_array().expect("budgets");
    let day = budgets.iter().find(|b| b["scope"].as_str().is_some_and(|s| s.ends_with("#day"))).expect("day");
    assert_eq!((day["limit"].as_u64(), day["remaining"].as_u64()), (Some(100), Some(40)));
}

const SPEND: &str = r#"
[spend_caps]
daily_units = 40
price_per_unit = 0.05
currency = "EUR"

[tenants.big]
daily_spend_units = 60

[[auth.keys]]
key = "acme-ops"
tenant = "acme"
tier = "admin"

[[auth.keys]]
key = "acme-trial"
tenant = "acme"
tier = "guest"

[[auth.keys]]
key = "big-one"
tenant = "big"
"#;

#[tokio::test]
async fn a_daily_spend_cap_per_tenant_warns_at_80_percent_in_money_and_no_tier_multiplies_it() {
    let server = TestServer::start(&format!("{ROOMY}{SPEND}")).await;
    // An admin-tier key (×4 budgets) and a guest of the same tenant share one cap of 40 units
    // (the cap cannot be below the dearest tool's cost, 20).
    let ops = server.client(Some("acme-ops")).await;
    let trial = server.client(Some("acme-trial")).await;
    for i in 0..40 {
        let client = if i % 2 == 0 { &ops } else { &trial };
        let r = call(client, "list_articles", query(i)).await;
        assert!(!is_error(&r), "call {i}: {}", text(&r));
        let warnings = structured(&r)["warnings"].as_array().cloned().unwrap_or_default();
        if i + 1 < 32 {
            assert!(warnings.is_empty(), "call {i}: {warnings:?}");
        } else {
            let warning = &warnings[0];
            assert_eq!(warning["scope"], "spend:tenant:acme");
            assert_eq!(warning["used"], i as u64 + 1);
            let money = &warning["money"];
            assert_eq!(money["currency"], "EUR");
            assert!((money["cap"].as_f64().expect("cap") - 2.0).abs() < 1e-9, "{money}");
            assert!(text(&r).contains("EUR"), "{}", text(&r));
        }
        server.advance_ms(1_000);
    }
    let refused = call(&ops, "list_articles", query(99)).await;
    let error = &structured(&refused)["error"];
    assert_eq!(error["code"], "rate_limited");
    assert_eq!(error["scope"], "spend:tenant:acme", "the cap refused, not a budget: {error}");
    assert_eq!(error["retry_after_ms"], DAY_MS - 40_000, "until midnight UTC");

    // Free tools stay free; the status shows the cap, in units and in money.
    let status = call(&trial, "rate_limit_status", json!({})).await;
    assert!(!is_error(&status));
    let cap = budget(&status, "spend:tenant:acme");
    assert_eq!((cap["limit"].as_u64(), cap["remaining"].as_u64()), (Some(40), Some(0)));
    assert!((cap["money"]["used"].as_f64().expect("used") - 2.0).abs() < 1e-9, "{cap}");

    // Another tenant has its own cap of 60.
    let big = server.client(Some("big-one")).await;
    let (admitted, refusal) = spend_until_refused(&big, "list_articles", query(500), 100).await;
    assert_eq!(admitted, 60);
    assert_eq!(structured(&refusal)["error"]["scope"], "spend:tenant:big");
}

#[tokio::test]
async fn a_shadow_limit_lets_every_call_through_and_counts_the_refusals_it_would_have_made() {
    let config = format!(
        r#"{ROOMY}
[limits.caller]
algorithm = "token_bucket"
burst = 3
refill_per_sec = 0.001
mode = "shadow"
"#
    );
    let server = TestServer::start(&config).await;
    let agent = server.client(Some("shadowed")).await;
    for i in 0..100 {
        let r = call(&agent, "list_articles", query(i)).await;
        assert!(!is_error(&r), "call {i} went through: {}", text(&r));
    }
    let metrics = server.metrics().await;
    let shadow = metrics
        .lines()
        .find(|l| l.contains("outcome=\"shadow_refused\"") && l.contains("tool=\"list_articles\""))
        .unwrap_or_else(|| panic!("no shadow_refused series:\n{metrics}"));
    assert!(shadow.ends_with(" 97"), "3 fit the burst, 97 would have been refused: {shadow}");
    let status = call(&agent, "rate_limit_status", json!({})).await;
    assert_eq!(budget(&status, "caller:")["shadow"], true);
}

#[tokio::test]
async fn a_key_and_a_tenant_with_budgets_of_their_own() {
    let config = format!(
        r#"{ROOMY}
[[auth.keys]]
key = "small-key"
[auth.keys.caller]
algorithm = "token_bucket"
burst = 3
refill_per_sec = 0.001

[[auth.keys]]
key = "plain-key"

[[auth.keys]]
key = "tiny-tenant-key"
tenant = "tiny"

[tenants.tiny.budget]
algorithm = "token_bucket"
burst = 4
refill_per_sec = 0.001

# Every paid tool priced within those budgets: a cost one of them could never pay is refused at
# start-up.
[tools.save_article]
cost = 1
[tools.generate_image]
cost = 1
[tools.generate_image_to_video]
cost = 1
"#
    );
    let server = TestServer::start(&config).await;
    let small = server.client(Some("small-key")).await;
    let (admitted, refusal) = spend_until_refused(&small, "list_articles", query(0), 100).await;
    assert_eq!(admitted, 3, "the key's own budget");
    assert!(structured(&refusal)["error"]["scope"].as_str().is_some_and(|s| s.starts_with("caller:tok:")));
    let plain = server.client(Some("plain-key")).await;
    let (admitted, _) = spend_until_refused(&plain, "list_articles", query(1000), 100).await;
    assert_eq!(admitted, 60, "other keys keep the tier's budget");
    let tiny = server.client(Some("tiny-tenant-key")).await;
    let (admitted, refusal) = spend_until_refused(&tiny, "list_articles", query(2000), 100).await;
    assert_eq!(admitted, 4, "the tenant's own budget");
    assert_eq!(structured(&refusal)["error"]["scope"], "tenant:tiny");
}

#[tokio::test]
async fn a_reload_mid_burst_carries_usage_over_and_a_broken_config_is_refused() {
    let server = TestServer::start(ROOMY).await;
    let agent = server.client(Some("mid-burst")).await;
    for i in 0..10 {
        assert!(!is_error(&call(&agent, "list_articles", query(i)).await));
    }
    let remaining = |status: &rmcp::model::CallToolResult| budget(status, "caller:")["remaining"].as_u64();
    let status = call(&agent, "rate_limit_status", json!({})).await;
    assert_eq!(remaining(&status), Some(50));

    // Looser: the burst doubles, and the caller continues from where it was, not from full.
    let looser = mcp_ratelimit::Config::from_toml(
        &format!("{ROOMY}[limits.caller]\nburst = 120\n"),
        &mcp_ratelimit::mcp::tools::catalogue(),
    )
    .expect("valid");
    let state = server.app.state();
    assert!(matches!(state.reload(&looser), mcp_ratelimit::state::Reloaded::Applied { .. }));
    let status = call(&agent, "rate_limit_status", json!({})).await;
    assert_eq!((budget(&status, "caller:")["limit"].as_u64(), remaining(&status)), (Some(120), Some(50)));

    // Tighter: a burst of 40 (the least a guest-tier caller can afford a video of a fixed 20
    // with) applies at once, below the 50 the caller had left.
    let tighter = mcp_ratelimit::Config::from_toml(
        &format!("{ROOMY}[limits.caller]\nburst = 40\n[tools.generate_image_to_video]\ncost = 20\n"),
        &mcp_ratelimit::mcp::tools::catalogue(),
    )
    .expect("valid");
    state.reload(&tighter);
    let (admitted, _) = spend_until_refused(&agent, "list_articles", query(100), 100).await;
    assert_eq!(admitted, 40);

    // A broken file is refused, named and counted; the running limits stay.
    let dir = tempfile::tempdir().expect("dir");
    let file = dir.path().join("config.toml");
    std::fs::write(&file, "[limits.caller]\nburst = -1\n").expect("write");
    match state.reload_from(Some(&file)) {
        mcp_ratelimit::state::Reloaded::Refused(why) => assert!(why.contains("limits.caller.burst"), "{why}"),
        other => panic!("a broken config was applied: {other:?}"),
    }
    let status = call(&agent, "rate_limit_status", json!({})).await;
    assert_eq!(budget(&status, "caller:")["limit"], 40, "the old limits keep working");
    let metrics = server.metrics().await;
    assert!(metrics.contains("mcp_ratelimit_config_reloads_total{outcome=\"refused\"} 1"), "{metrics}");
    assert!(metrics.contains("mcp_ratelimit_config_reloads_total{outcome=\"applied\"} 2"), "{metrics}");
}

/// `serve --config FILE` as its own process, reloading on SIGHUP and on file changes.
#[tokio::test]
async fn the_binary_reloads_on_sighup_and_on_a_changed_file_and_keeps_its_limits_on_a_broken_one() {
    let dir = tempfile::tempdir().expect("dir");
    let file = dir.path().join("limits.toml");
    // No refill while the test runs (real time): levels move only by calls and reloads.
    // (A fixed video price, so a burst of 45, 22 for a guest, still fits every cost.)
    let limits = |burst: &str| {
        format!(
            "{ROOMY}[limits.caller]\nburst = {burst}\nrefill_per_sec = 0.0001\n[tools.generate_image_to_video]\ncost = 20\n"
        )
    };
    std::fs::write(&file, limits("60")).expect("write");
    let (child, agent, port) = serve_file(&file, "reloaded").await;
    for i in 0..10 {
        assert!(!is_error(&call(&agent, "list_articles", query(i)).await));
    }
    let caller = |status: &rmcp::model::CallToolResult| {
        let b = budget(status, "caller:");
        (b["limit"].as_u64(), b["remaining"].as_u64())
    };

    // The file changes: the watcher reloads it, and the 10 spent stay spent (50 left, not 80).
    std::fs::write(&file, limits("80")).expect("write");
    eventually("the edited file is live", || async {
        caller(&call(&agent, "rate_limit_status", json!({})).await).0 == Some(80)
    })
    .await;
    assert_eq!(caller(&call(&agent, "rate_limit_status", json!({})).await), (Some(80), Some(50)));

    // A broken edit is refused: the limits of the last good file keep working.
    std::fs::write(&file, "[limits.caller]\nalgorithm = \"leaky_faucet\"\n").expect("write");
    // The watcher saw it and refused it (counted), instead of a wait that hopes it had.
    let metrics_url = format!("http://127.0.0.1:{port}/metrics");
    eventually("the broken file was refused", || async {
        let metrics = reqwest::get(&metrics_url).await.expect("metrics").text().await.expect("text");
        metrics.contains("mcp_ratelimit_config_reloads_total{outcome=\"refused\"} 1\n")
    })
    .await;
    assert_eq!(caller(&call(&agent, "rate_limit_status", json!({})).await).0, Some(80));

    // Fixed, then SIGHUP (an operator's explicit reload) — also picked up by the watcher; either
    // way the new limit applies.
    std::fs::write(&file, limits("45")).expect("write");
    let pid = child.id().expect("running").to_string();
    let hup = std::process::Command::new("kill").args(["-HUP", &pid]).status().expect("kill runs");
    assert!(hup.success());
    eventually("SIGHUP applied the fixed file", || async {
        caller(&call(&agent, "rate_limit_status", json!({})).await).0 == Some(45)
    })
    .await;
    assert_eq!(caller(&call(&agent, "rate_limit_status", json!({})).await).1, Some(45), "the tighter burst, at once");
    let metrics = reqwest::get(&metrics_url).await.expect("metrics").text().await.expect("text");
    assert!(metrics.contains("mcp_ratelimit_config_reloads_total{outcome=\"refused\"} 1\n"), "{metrics}");
}

#[tokio::test]
async fn a_reload_names_the_settings_the_queue_and_the_answer_cache_were_built_with() {
    let server = TestServer::start(ROOMY).await;
    let built = mcp_ratelimit::Config::from_toml(
        &format!("{ROOMY}[upstream]\ncache_max_entries = 5\n[upstream.adaptive]\nenabled = true\n"),
        &mcp_ratelimit::mcp::tools::catalogue(),
    )
    .expect("valid");
    let reloaded = server.app.state().reload(&built);
    let mcp_ratelimit::state::Reloaded::Applied { need_restart } = reloaded else { panic!("applied: {reloaded:?}") };
    assert_eq!(need_restart, ["upstream.cache_max_entries", "upstream.adaptive"], "named, not silently kept");
    // The exporter and the subscriber it feeds are set up once, when the process starts.
    let traced = mcp_ratelimit::Config::from_toml(
        &format!("{ROOMY}[telemetry]\notlp_endpoint = \"http://127.0.0.1:4318\"\n"),
        &mcp_ratelimit::mcp::tools::catalogue(),
    )
    .expect("valid");
    let reloaded = server.app.state().reload(&traced);
    let mcp_ratelimit::state::Reloaded::Applied { need_restart } = reloaded else { panic!("applied: {reloaded:?}") };
    assert_eq!(need_restart, ["telemetry"], "named, not silently kept");
}
