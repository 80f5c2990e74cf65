//! Prices that follow the arguments and are settled from the usage the upstream reports, through
//! an MCP client on the manual clock, on the memory store and on Redis: a video priced by its
//! length is reserved when accepted and, once final, charged what the mock billed, the
//! difference given back to every budget that took it, exactly; a price above its reservation is
//! charged on top and a budget stands at empty, never below; work the upstream never took or did
//! not bill (a job canceled in the queue, a failed job it billed nothing) costs nothing, while an
//! upstream 429 answered to the agent is still charged; `settle = "reserved"` keeps the
//! reservation; a settlement frozen Redis answers too late is tried again and lands exactly once,
//! one Redis never takes is given up after a minute of the server's clock (the reservation
//! stands, and the job says so), and a limit lowered before it settles shows a level under the
//! new limit.

use crate::common::*;
use crate::test_redis::TestRedis;
use serde_json::{Value, json};

const KEY: &str = "sk-pricing-agent-1";

/// One key of tenant acme; budgets that do not refill while a test runs (a unit per 1000 s, on
/// the manual clock and on Redis's real one alike), a spend cap, short jobs polled each second.
fn config(extra: &str) -> String {
    format!(
        "[[auth.keys]]\nkey = \"{KEY}\"\ntenant = \"acme\"\n\
         [limits.caller]\nburst = 100\nrefill_per_sec = 0.001\n\
         [limits.tenant]\nburst = 1000\nrefill_per_sec = 0.001\n\
         [spend_caps]\ndaily_units = 500\n\
         [upstream]\nimage_poll_seconds = 1\nvideo_poll_seconds = 1\nvideo_min_gap_ms = 1000\n\
         [mock_upstream]\nimage_job_ms = 1000\nvideo_job_ms = 2000\nmax_video_seconds = 8\n\
         [tools.generate_image_to_video.budget]\nalgorithm = \"sliding_log\"\nlimit = 100\nwindow_ms = 3600000\n\
         {NO_LOOP_DETECTION}{extra}"
    )
}

fn video(seconds: u32) -> Value {
    json!({ "image_url": "https://example.com/frame.png", "prompt": "waves", "seconds": seconds })
}

/// What is left in the caller's, the tenant's and the spend cap's budgets.
async fn left(client: &Client) -> (u64, u64, u64) {
    let status = call(client, "rate_limit_status", json!({})).await;
    let remaining = |prefix| budget(&status, prefix)["remaining"].as_u64().expect("remaining");
    (remaining("caller:"), remaining("tenant:"), remaining("spend:"))
}

/// Walks the clock until job `id` is final and its price settled; its report.
async fn settled(server: &TestServer, client: &Client, id: &str) -> Value {
    for _ in 0..10 {
        server.advance_ms(1_000);
        settle().await;
    }
    eventually_some("the job is final and its price settled", std::time::Duration::from_secs(5), || async {
        let report = structured(&call(client, "get_prediction", json!({ "predict_id": id })).await).clone();
        report.get("charged").is_some().then_some(report)
    })
    .await
}

async fn a_video_priced_by_its_length_is_refunded_what_it_did_not_use(server: &TestServer) {
    let agent = server.client(Some(KEY)).await;
    let accepted = call(&agent, "generate_image_to_video", video(10)).await;
    assert!(!is_error(&accepted), "{}", text(&accepted));
    // 20 with five seconds included, 2 per second beyond: 30 reserved in every budget.
    assert_eq!(structured(&accepted)["reserved"], 30, "{}", structured(&accepted));
    assert_eq!(left(&agent).await, (70, 970, 470));

    let id = structured(&accepted)["predict_id"].as_str().expect("predict_id").to_owned();
    let report = settled(server, &agent, &id).await;
    // The mock renders 8 of the 10 seconds asked and bills 26: 4 come back, exactly.
    assert_eq!(report["status"], "succeeded", "{report}");
    assert_eq!((report["reserved"].clone(), report["charged"].clone()), (json!(30), json!(26)), "{report}");
    assert_eq!(report["usage"]["units"], 26, "{report}");
    assert_eq!(left(&agent).await, (74, 974, 474), "each budget charged 26 in the end, not 30");
    assert_eq!(server.upstream_usage().await["units_billed"], 26, "what the upstream billed");
    let metrics = server.metrics().await;
    assert!(
        metrics.lines().any(|l| l.starts_with("mcp_ratelimit_settled_units_total{")
            && l.contains("how=\"refunded\"")
            && l.ends_with(" 4")),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_video_priced_by_its_length_is_refunded_what_it_did_not_use_in_memory() {
    let server = TestServer::start(&config("")).await;
    a_video_priced_by_its_length_is_refunded_what_it_did_not_use(&server).await;
}

#[tokio::test]
async fn a_video_priced_by_its_length_is_refunded_what_it_did_not_use_on_redis() {
    let redis = TestRedis::start();
    let store = format!("[store]\nbackend = \"redis\"\nredis_url = \"{}\"\n", redis.url);
    // A key of this run's own: the Redis may be shared (REDIS_URL).
    let key = format!("sk-pricing-{:016x}", rand::random::<u64>());
    let server = TestServer::start(&config(&store).replace(KEY, &key)).await;
    let agent = server.client(Some(&key)).await;
    let accepted = call(&agent, "generate_image_to_video", video(10)).await;
    assert_eq!(structured(&accepted)["reserved"], 30, "{}", text(&accepted));
    let (caller, tenant, spend) = left(&agent).await;
    assert_eq!(caller, 70);
    let id = structured(&accepted)["predict_id"].as_str().expect("predict_id").to_owned();
    let report = settled(&server, &agent, &id).await;
    assert_eq!((report["reserved"].clone(), report["charged"].clone()), (json!(30), json!(26)), "{report}");
    assert_eq!(left(&agent).await, (caller + 4, tenant + 4, spend + 4), "4 back in Redis, in every budget");
}

#[tokio::test]
async fn a_price_above_its_reservation_is_charged_on_top_and_a_budget_never_goes_below_empty() {
    // A fixed price of 20 while the upstream bills a 30-second video 70; the caller has 50.
    let config = config("[tools.generate_image_to_video]\ncost = 20\n")
        .replace("burst = 100\n", "burst = 50\n")
        .replace("max_video_seconds = 8", "max_video_seconds = 30");
    let server = TestServer::start(&config).await;
    let agent = server.client(Some(KEY)).await;
    let accepted = call(&agent, "generate_image_to_video", video(30)).await;
    assert_eq!(structured(&accepted)["reserved"], 20, "{}", text(&accepted));
    assert_eq!(left(&agent).await, (30, 980, 480));
    let id = structured(&accepted)["predict_id"].as_str().expect("predict_id").to_owned();
    let report = settled(&server, &agent, &id).await;
    assert_eq!((report["reserved"].clone(), report["charged"].clone()), (json!(20), json!(70)), "{report}");
    // 50 more: the tenant and the spend cap had them; the caller had 30, and stands at 0.
    assert_eq!(left(&agent).await, (0, 930, 430));
    let refused = call(&agent, "list_articles", json!({})).await;
    assert_eq!(error_code(&refused), Some("rate_limited"), "{}", text(&refused));
    assert_eq!(structured(&refused)["error"]["remaining"], 0, "empty, not below");
    // It refills from empty like any budget: one unit in 1000 s.
    server.advance_ms(1_000_000);
    assert!(!is_error(&call(&agent, "list_articles", json!({})).await), "served once a unit is back");
}

#[tokio::test]
async fn work_the_upstream_never_took_or_did_not_bill_costs_nothing_and_a_failed_call_is_still_charged() {
    let server = TestServer::start(&config("")).await;
    let agent = server.client(Some(KEY)).await;

    // A job the model fails: the mock bills nothing, and all 20 come back.
    let failing =
        call(&agent, "generate_image_to_video", json!({"image_url": "https://e.com/a.png", "prompt": "[fail]"}));
    let failing = failing.await;
    assert_eq!(structured(&failing)["reserved"], 20);
    let id = structured(&failing)["predict_id"].as_str().expect("predict_id").to_owned();
    let report = settled(&server, &agent, &id).await;
    assert_eq!((report["status"].clone(), report["charged"].clone()), (json!("failed"), json!(0)), "{report}");
    assert!(text(&call(&agent, "get_prediction", json!({ "predict_id": id })).await).contains("charged 0 of the 20"));
    assert_eq!(left(&agent).await, (100, 1000, 500));

    // A video still waiting in the queue (behind another, a gap apart) canceled: never sent.
    let first = call(&agent, "generate_image_to_video", video(5)).await;
    let second = call(&agent, "generate_image_to_video", video(6)).await;
    assert_eq!(structured(&second)["queue_position"], 1, "{}", structured(&second));
    let queued = structured(&second)["predict_id"].as_str().expect("predict_id").to_owned();
    assert_eq!(left(&agent).await, (58, 958, 458), "20 + 22 reserved");
    let canceled = call(&agent, "cancel_prediction", json!({ "predict_id": queued })).await;
    assert_eq!(structured(&canceled)["status"], "canceled", "{}", structured(&canceled));
    eventually("the canceled job's 22 are back", || async { left(&agent).await == (80, 980, 480) }).await;
    let first = structured(&first)["predict_id"].as_str().expect("predict_id").to_owned();
    assert_eq!(settled(&server, &agent, &first).await["charged"], 20, "the first, 5 seconds, as reserved");

    // The upstream's 429 on a call answered at once reached it: a failed upstream call is still
    // charged (docs/decisions.md), and says so.
    server.chaos(json!({ "rate_429": 1.0 })).await;
    let before = left(&agent).await;
    let refused = call(&agent, "list_articles", json!({ "query": "budgets" })).await;
    assert_eq!(error_code(&refused), Some("upstream_rate_limited"), "{}", text(&refused));
    assert_eq!(
        (structured(&refused)["reserved"].clone(), structured(&refused)["charged"].clone()),
        (json!(1), json!(1))
    );
    assert_eq!(left(&agent).await, (before.0 - 1, before.1 - 1, before.2 - 1), "charged as reserved");
    server.chaos(json!({ "rate_429": 0.0 })).await;
    let served = call(&agent, "list_articles", json!({ "query": "budgets" })).await;
    assert_eq!((structured(&served)["reserved"].clone(), structured(&served)["charged"].clone()), (json!(1), json!(1)));
    assert_eq!(left(&agent).await.0, before.0 - 2);
}

#[tokio::test]
async fn settle_reserved_keeps_the_reservation_whatever_the_upstream_bills() {
    let server = TestServer::start(&config("[tools.generate_image_to_video]\nsettle = \"reserved\"\n")).await;
    let agent = server.client(Some(KEY)).await;
    let accepted = call(&agent, "generate_image_to_video", video(10)).await;
    let id = structured(&accepted)["predict_id"].as_str().expect("predict_id").to_owned();
    let report = settled(&server, &agent, &id).await;
    assert_eq!((report["reserved"].clone(), report["charged"].clone()), (json!(30), json!(30)), "{report}");
    assert_eq!(report["usage"]["units"], 26, "billed 26, charged as reserved");
    assert_eq!(left(&agent).await, (70, 970, 470));
}

#[tokio::test]
async fn the_price_is_listed_with_its_formula_and_a_call_it_cannot_price_reserves_the_most() {
    let server = TestServer::start(&config("")).await;
    let agent = server.client(Some(KEY)).await;
    let tools = agent.list_all_tools().await.expect("tools/list");
    let listed = tools.iter().find(|t| t.name == "generate_image_to_video").expect("listed");
    let description = listed.description.as_deref().unwrap_or_default();
    assert!(description.contains("Costs 20 + 2 * max(0, seconds - 5) tokens, at most 30"), "{description}");
    let status = call(&agent, "rate_limit_status", json!({})).await;
    assert_eq!(structured(&status)["costs"]["generate_image_to_video"], 30);
    assert_eq!(structured(&status)["cost_formulas"]["generate_image_to_video"], "20 + 2 * max(0, seconds - 5)");
    // Held to cost_max: a 30-second video reserves 30, not 70.
    let long = call(&agent, "generate_image_to_video", video(30)).await;
    assert_eq!(structured(&long)["reserved"], 30);
    // The schema refuses what the formula could not price, before anything is charged.
    let bad = call(&agent, "generate_image_to_video", video(31)).await;
    assert_eq!(error_code(&bad), Some("invalid_arguments"), "{}", text(&bad));
    assert_eq!(left(&agent).await, (70, 970, 470));
}

#[tokio::test]
async fn a_settlement_redis_answers_too_late_is_tried_again_and_lands_exactly_once() {
    let redis = TestRedis::private();
    let store = format!("[store]\nbackend = \"redis\"\nredis_url = \"{}\"\ntimeout_ms = 200\n", redis.url);
    let server = TestServer::start(&config(&store)).await;
    let agent = server.client(Some(KEY)).await;
    let accepted = call(&agent, "generate_image_to_video", video(10)).await;
    assert_eq!(structured(&accepted)["reserved"], 30, "{}", text(&accepted));
    assert_eq!(left(&agent).await, (70, 970, 470));
    let id = structured(&accepted)["predict_id"].as_str().expect("predict_id").to_owned();
    // Redis frozen: the job ends, and its settlement's first try reaches Redis but gets no
    // answer within the 200 ms timeout.
    redis.pause();
    for _ in 0..10 {
        server.advance_ms(1_000);
        settle().await;
    }
    eventually_some("a try of the settlement timed out", std::time::Duration::from_secs(10), || async {
        (metric_sum(&server.metrics().await, "mcp_ratelimit_settlement_errors_total") >= 1.0).then_some(())
    })
    .await;
    // Thawed, Redis runs the try it was sent (4 back), and the next try — when the server's
    // clock says so — finds its mark: the 4 come back once, not twice, and the job says so once
    // they have.
    redis.resume();
    let report =
        eventually_some("the job is final and its price settled", std::time::Duration::from_secs(20), || async {
            server.advance_ms(500);
            let report = structured(&call(&agent, "get_prediction", json!({ "predict_id": id })).await).clone();
            report.get("charged").is_some().then_some(report)
        })
        .await;
    assert_eq!(report["usage"]["units"], 26, "{report}");
    assert_eq!((report["reserved"].clone(), report["charged"].clone()), (json!(30), json!(26)), "{report}");
    assert_eq!(left(&agent).await, (74, 974, 474), "4 back in every budget, exactly once");
    let metrics = server.metrics().await;
    assert_eq!(metric_sum(&metrics, "mcp_ratelimit_settlements_given_up_total"), 0.0, "{metrics}");
}

#[tokio::test]
async fn a_settlement_redis_never_takes_is_given_up_after_a_minute_and_the_reservation_stands() {
    let mut redis = TestRedis::private();
    let store = format!("[store]\nbackend = \"redis\"\nredis_url = \"{}\"\ntimeout_ms = 200\n", redis.url);
    let server = TestServer::start(&config(&store)).await;
    let agent = server.client(Some(KEY)).await;
    let accepted = call(&agent, "generate_image_to_video", video(10)).await;
    assert_eq!(structured(&accepted)["reserved"], 30, "{}", text(&accepted));
    let id = structured(&accepted)["predict_id"].as_str().expect("predict_id").to_owned();
    redis.kill();
    // The job ends while Redis is away, and stays away: the tries go on for a minute of the
    // server's clock, and the job says nothing of its price until they end.
    for _ in 0..10 {
        server.advance_ms(1_000);
        settle().await;
    }
    let report = structured(&call(&agent, "get_prediction", json!({ "predict_id": id })).await).clone();
    assert_eq!(report["status"], "succeeded", "{report}");
    assert!(report.get("charged").is_none(), "said before the settlement ended: {report}");
    eventually_some("the settlement given up", std::time::Duration::from_secs(20), || async {
        server.advance_ms(2_000);
        (metric_sum(&server.metrics().await, "mcp_ratelimit_settlements_given_up_total") == 1.0).then_some(())
    })
    .await;
    // Given up: the 4 were never given back, so the reservation stands, and the job says what
    // was charged, not what was meant.
    let report = structured(&call(&agent, "get_prediction", json!({ "predict_id": id })).await).clone();
    assert_eq!(report["usage"]["units"], 26, "{report}");
    assert_eq!((report["reserved"].clone(), report["charged"].clone()), (json!(30), json!(30)), "{report}");
    assert!(metric_sum(&server.metrics().await, "mcp_ratelimit_settlement_errors_total") >= 2.0, "tried again");
    redis.restart();
    // Redis back (empty: it keeps nothing on disk): the server decides there again.
    eventually_some("served again once Redis is back", std::time::Duration::from_secs(10), || async {
        let served = call(&agent, "list_articles", json!({ "query": "back" })).await;
        (!is_error(&served)).then_some(())
    })
    .await;
}

#[tokio::test]
async fn a_limit_lowered_before_a_job_settles_shows_a_level_under_the_new_limit_never_a_wrapped_one() {
    let server = TestServer::start(&config("")).await;
    let agent = server.client(Some(KEY)).await;
    let accepted = call(&agent, "generate_image_to_video", video(10)).await;
    let id = structured(&accepted)["predict_id"].as_str().expect("predict_id").to_owned();
    assert_eq!(left(&agent).await, (70, 970, 470));
    // The caller's burst lowered to 40 while the job runs: 70 left is more than the new burst.
    let lowered = config("").replace("burst = 100\n", "burst = 40\n") + "[tools.generate_image_to_video]\ncost = 20\n";
    let lowered = mcp_ratelimit::Config::from_toml(&lowered, &mcp_ratelimit::mcp::tools::catalogue()).expect("valid");
    server.app.state().reload(&lowered);
    let report = settled(&server, &agent, &id).await;
    assert_eq!((report["reserved"].clone(), report["charged"].clone()), (json!(30), json!(26)), "{report}");
    // The refund lands under the limit the call was charged under; the level shown is the new
    // limit's: full at 40, never above it, never a number wrapped round.
    let status = call(&agent, "rate_limit_status", json!({})).await;
    let caller = budget(&status, "caller:");
    assert_eq!((caller["limit"].clone(), caller["remaining"].clone()), (json!(40), json!(40)), "{caller}");
    assert_eq!(left(&agent).await.1, 974, "the tenant's 4 back");
}

/// `cost` for `generate_image`, with room for it in every budget.
fn image_priced(formula: &str) -> String {
    format!("[tools.generate_image]\ncost = \"{formula}\"\ncost_max = 5\n{NO_LOOP_DETECTION}")
}

#[tokio::test]
async fn a_reload_to_a_formula_too_deep_for_a_stack_is_refused_and_the_server_keeps_serving() {
    let dir = tempfile::tempdir().expect("dir");
    let file = dir.path().join("prices.toml");
    std::fs::write(&file, image_priced("1 + 2")).expect("write");
    let (mut child, agent, port) = serve_file(&file, "deep-formula").await;
    let image = |i: u32| json!({ "prompt": format!("a lighthouse, take {i}") });
    assert_eq!(structured(&call(&agent, "generate_image", image(0)).await)["reserved"], 3);

    // 10,000 brackets deep: the watcher sees the file, and SIGHUP asks again; both refuse it.
    let depth = 10_000;
    std::fs::write(&file, image_priced(&format!("{}1{}", "(".repeat(depth), ")".repeat(depth)))).expect("write");
    let pid = child.id().expect("running").to_string();
    let hup = std::process::Command::new("kill").args(["-HUP", &pid]).status().expect("kill runs");
    assert!(hup.success());
    let metrics_url = format!("http://127.0.0.1:{port}/metrics");
    eventually("the deep formula was refused", || async {
        let metrics = reqwest::get(&metrics_url).await.map(|r| r.text());
        match metrics {
            Ok(text) => {
                text.await.is_ok_and(|t| t.contains("mcp_ratelimit_config_reloads_total{outcome=\"refused\"} 2\n"))
            }
            Err(_) => false,
        }
    })
    .await;
    assert!(child.try_wait().expect("status").is_none(), "the server is still running");
    let served = call(&agent, "generate_image", image(1)).await;
    assert!(!is_error(&served), "{}", text(&served));
    assert_eq!(structured(&served)["reserved"], 3, "the old price keeps working");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deepest_formula_allowed_prices_a_call_on_a_tokio_worker() {
    use mcp_ratelimit::config::price::{MAX_LEN, MAX_NESTING};
    // As long as allowed: unary minus signs all the way (the deepest tree there is, one level a
    // byte), and brackets nested the most allowed around the longest sum that still fits.
    let unary = format!("{}1", "-".repeat(MAX_LEN - 1));
    let sum = "+0".repeat((MAX_LEN - 2 * MAX_NESTING - 1) / 2);
    let nested = format!("{}1{sum}{}", "(".repeat(MAX_NESTING), ")".repeat(MAX_NESTING));
    let nested = format!("{nested:<MAX_LEN$}");
    for formula in [unary, nested] {
        assert_eq!(formula.len(), MAX_LEN);
        let server = TestServer::start(&image_priced(&formula)).await;
        let agent = server.client(Some(KEY)).await;
        let priced = call(&agent, "generate_image", json!({ "prompt": "a lighthouse" })).await;
        assert!(!is_error(&priced), "{}", text(&priced));
        assert_eq!(structured(&priced)["reserved"], 1, "{formula}");
    }
}

#[tokio::test]
async fn a_video_settled_in_the_next_window_gives_that_window_nothing() {
    // The case: the caller's budget a fixed window of 60 units per 10 s; a video reserves
    // 30 at 8.2 s into window A, and its bill of 26 settles in window B, which must still admit
    // 60 and no more (it admitted 64: the 4 went back to B).
    let windowed = "[limits.caller]\nalgorithm = \"fixed_window\"\nlimit = 60\nwindow_ms = 10000\n";
    let server =
        TestServer::start(&config("").replace("[limits.caller]\nburst = 100\nrefill_per_sec = 0.001\n", windowed))
            .await;
    let agent = server.client(Some(KEY)).await;
    let now_ms = || mcp_ratelimit::clock::Clock::now(&*server.clock).as_u64() / 1_000_000;
    server.advance_ms(8_200);
    let accepted = call(&agent, "generate_image_to_video", video(10)).await;
    assert_eq!(structured(&accepted)["reserved"], 30, "{}", text(&accepted));
    let id = structured(&accepted)["predict_id"].as_str().expect("predict_id").to_owned();

    // Window B opens; the caller spends 10 there while the job still runs.
    server.advance_ms(1_800);
    let articles = |i: usize| json!({ "query": format!("window b, {i}") });
    for i in 0..10 {
        let served = call(&agent, "list_articles", articles(i)).await;
        assert!(!is_error(&served), "{}", text(&served));
    }
    let report =
        eventually_some("the job is final and its price settled", std::time::Duration::from_secs(10), || async {
            server.advance_ms(250);
            settle().await;
            let report = structured(&call(&agent, "get_prediction", json!({ "predict_id": id })).await).clone();
            report.get("charged").is_some().then_some(report)
        })
        .await;
    assert_eq!((report["reserved"].clone(), report["charged"].clone()), (json!(30), json!(26)), "{report}");
    assert!(now_ms() < 20_000, "settled in window B, at {} ms", now_ms());

    let mut spent = 10;
    for i in 10..100 {
        let answer = call(&agent, "list_articles", articles(i)).await;
        if is_error(&answer) {
            assert_eq!(structured(&answer)["error"]["scope"].as_str().map(|s| s.starts_with("caller:")), Some(true));
            break;
        }
        spent += 1;
    }
    assert!(now_ms() < 20_000, "still window B");
    assert_eq!(spent, 60, "window B admits its 60, no more: the 4 went back to window A, long gone");
    // The spend cap's day, where the 30 were counted, got its 4 back; the tenant's bucket, charged
    // again since (the 10 calls), keeps them: where its units sit then, one level cannot tell.
    let (_, tenant, spend) = left(&agent).await;
    assert_eq!((tenant, spend), (1000 - 30 - 60, 500 - 26 - 60));
}

#[tokio::test]
async fn a_burst_lowered_and_put_back_while_a_job_runs_gets_none_of_its_refund() {
    let server = TestServer::start(&config("")).await;
    let agent = server.client(Some(KEY)).await;
    let accepted = call(&agent, "generate_image_to_video", video(10)).await;
    let id = structured(&accepted)["predict_id"].as_str().expect("predict_id").to_owned();
    assert_eq!(left(&agent).await.0, 70);
    let reload = |toml: &str| {
        let limits = mcp_ratelimit::Config::from_toml(toml, &mcp_ratelimit::mcp::tools::catalogue()).expect("valid");
        server.app.state().reload(&limits);
    };
    // Lowered to 40 while the job runs: the next call finds 70 saved, keeps 40 and spends one.
    reload(&(config("").replace("burst = 100\n", "burst = 40\n") + "[tools.generate_image_to_video]\ncost = 20\n"));
    assert!(!is_error(&call(&agent, "list_articles", json!({ "query": "under 40" })).await));
    assert_eq!(left(&agent).await.0, 39);
    // Put back to 100 before the job settles at 26: had it cost 26 from the start, the caller
    // would stand at 39 all the same (74 saved, 40 kept, one spent); the 4 are not given back.
    reload(&config(""));
    let report = settled(&server, &agent, &id).await;
    assert_eq!((report["reserved"].clone(), report["charged"].clone()), (json!(30), json!(26)), "{report}");
    assert_eq!(left(&agent).await, (39, 1000 - 26 - 1, 500 - 26 - 1), "the limits that never changed get the 4 back");
}
