//! Limits shared across instances through Redis, proven through MCP clients: three servers on
//! one Redis give a caller one budget and one in-flight cap; while Redis is down, tools that
//! cost money fail closed at once and free-or-open tools run under the insurance limiter; when
//! Redis comes back the shared limits resume without a restart.

use std::time::{Duration, Instant};

use crate::common::*;
use crate::test_redis::{TestRedis, TlsRedis};
use serde_json::{Value, json};

/// A caller token no other test (or run, on a shared `REDIS_URL`) uses.
fn token(name: &str) -> String {
    format!("{name}-{:016x}", rand::random::<u64>())
}

/// Redis as the store (`store` adds keys to `[store]`), a caller budget that does not refill
/// while a test runs (Redis's clock is real time), and image jobs that outlast the test.
fn shared(redis: &TestRedis, store: &str, extra: &str) -> String {
    format!(
        "[store]\nbackend = \"redis\"\nredis_url = \"{}\"\ntimeout_ms = 200\n{store}\
         [limits.caller]\nrefill_per_sec = 0.001\n[mock_upstream]\nimage_job_ms = 600000\n{extra}",
        redis.url
    )
}

#[tokio::test]
async fn three_instances_share_one_budget_and_one_in_flight_cap() {
    // Jobs claim upstream-wide keys (the account, the video gap): a server of this test's own.
    let redis = TestRedis::private();
    // The caller's HTTP budget (120 POSTs) out of the way: this test's 96 POSTs from one caller
    // come near it, and with budget slices another instance may hold what would have admitted the
    // last of them (a 429 from the HTTP layer, not the tool budget this test is about).
    let roomy_http = "[limits.http]\nburst = 1000\n";
    let config = shared(&redis, "", &format!("{NO_PROGRESS_CHECK}{roomy_http}"));
    let servers =
        [TestServer::start(&config).await, TestServer::start(&config).await, TestServer::start(&config).await];

    let reader = token("reader");
    let mut clients = Vec::new();
    for server in &servers {
        clients.push(server.client(Some(&reader)).await);
    }
    let mut admitted = 0;
    let mut refusal = None;
    for i in 0..90 {
        let r = call(&clients[i % 3], "list_articles", json!({"query": format!("q{i}")})).await;
        if is_error(&r) {
            refusal.get_or_insert(r);
        } else {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 60, "one budget of 60 across three instances, not 180");
    let refusal = refusal.expect("refused past the shared budget");
    assert_eq!(error_code(&refusal), Some("rate_limited"));
    assert!(structured(&refusal)["error"]["scope"].as_str().is_some_and(|s| s.starts_with("caller:tok:")));

    let painter = token("painter");
    let mut clients = Vec::new();
    for server in &servers {
        clients.push(server.client(Some(&painter)).await);
    }
    let mut accepted = Vec::new();
    for i in 0..5 {
        let r = call(&clients[i % 3], "generate_image", json!({"prompt": format!("p{i}")})).await;
        accepted.push(structured(&r)["predict_id"].as_str().expect("accepted").to_owned());
    }
    let busy = call(&clients[2], "generate_image", json!({"prompt": "one more"})).await;
    assert_eq!(error_code(&busy), Some("busy"), "one in-flight cap of 5 across the instances");
    assert!(structured(&busy)["error"]["scope"].as_str().is_some_and(|s| s.starts_with("in_flight:caller:")));

    // A cancelled job gives its slot back in Redis: another instance can use it.
    let r = call(&clients[0], "cancel_prediction", json!({"predict_id": accepted[0]})).await;
    assert_eq!(structured(&r)["status"], "canceled", "{}", text(&r));
    eventually("the slot came back in Redis", || async {
        let status = call(&clients[1], "rate_limit_status", json!({})).await;
        budget(&status, "in_flight:caller:")["remaining"] == 1
    })
    .await;
    assert!(!is_error(&call(&clients[1], "generate_image", json!({"prompt": "in its place"})).await));
}

#[tokio::test]
async fn while_redis_is_down_paid_tools_fail_closed_open_ones_use_the_insurance_and_then_it_resumes() {
    let mut redis = TestRedis::private();
    // A roomy HTTP layer: this test is about the tool decisions behind it.
    let extra = format!("[tools.list_articles]\nfail = \"open\"\n[limits.http]\nburst = 10000\n{NO_PROGRESS_CHECK}");
    let config = shared(&redis, "expected_instances = 2\n", &extra);
    let server = TestServer::start(&config).await;
    let client = server.client(Some(&token("resilient"))).await;
    assert!(!is_error(&call(&client, "list_articles", json!({"query": "before"})).await));

    redis.kill();
    // Time from Redis dying to the first insurance-limited answer, a whole MCP call included
    // (printed with --nocapture).
    let started = Instant::now();
    let first = call(&client, "list_articles", json!({"query": "the first after the crash"})).await;
    eprintln!("first insurance-limited answer {:?} after Redis died", started.elapsed());
    assert!(!is_error(&first), "{}", text(&first));
    let started = Instant::now();
    let closed = call(&client, "generate_image", json!({"prompt": "costs money"})).await;
    let waited = started.elapsed();
    assert_eq!(error_code(&closed), Some("limiter_unavailable"), "{}", text(&closed));
    assert!(structured(&closed)["error"]["retry_after_ms"].as_u64().is_some_and(|ms| ms >= 1));
    assert!(waited < Duration::from_secs(2), "answered in {waited:?}, not after a long wait on a dead Redis");

    // list_articles fails open: the insurance limiter holds 60 / 2 instances = 30 for the caller.
    let mut admitted = 0;
    for i in 0..40 {
        if !is_error(&call(&client, "list_articles", json!({"query": format!("down {i}")})).await) {
            admitted += 1;
        }
    }
    assert_eq!(admitted + 1, 30, "the insurance limiter's share, not an open door");
    let metrics = server.metrics().await;
    assert!(metrics.contains("mcp_ratelimit_store_up 0"), "{metrics}");
    assert!(metric_sum(&metrics, "mcp_ratelimit_store_errors_total") >= 1.0, "{metrics}");

    // Redis comes back (empty): after the store breaker's probe interval the shared limits
    // resume, without restarting the server.
    redis.restart();
    eventually("the shared store answers again", || async {
        // Each try waits out the store breaker's second, so the next decision probes Redis.
        server.advance_secs(1.0);
        !is_error(&call(&client, "generate_image", json!({"prompt": format!("{:?}", Instant::now())})).await)
    })
    .await;
    assert!(server.metrics().await.contains("mcp_ratelimit_store_up 1"));
}

#[tokio::test]
async fn with_the_documented_defaults_list_articles_fails_open_and_the_paid_tools_closed_while_redis_is_down() {
    // Nothing about `fail` here: only the backend, so the defaults (config.toml) decide.
    let mut redis = TestRedis::private();
    let config = format!("[store]\nbackend = \"redis\"\nredis_url = \"{}\"\ntimeout_ms = 200\n", redis.url);
    let server = TestServer::start(&config).await;
    let client = server.client(Some(&token("defaults"))).await;
    assert!(!is_error(&call(&client, "list_articles", json!({"query": "before"})).await));

    redis.kill();
    for i in 0..3 {
        let r = call(&client, "list_articles", json!({"query": format!("down {i}")})).await;
        assert!(!is_error(&r), "a cheap read is served by the insurance limiter: {}", text(&r));
    }
    let r = call(&client, "save_article", json!({"title": "t", "body": "while down"})).await;
    assert_eq!(error_code(&r), Some("limiter_unavailable"), "{}", text(&r));
    let r = call(&client, "generate_image", json!({"prompt": "while down"})).await;
    assert_eq!(error_code(&r), Some("limiter_unavailable"), "{}", text(&r));
    let metrics = server.metrics().await;
    assert!(metrics.contains("mcp_ratelimit_store_up 0"), "Redis was really down: {metrics}");
}

#[tokio::test]
async fn a_refused_caller_is_refused_locally_until_its_wait_is_over_without_a_round_trip() {
    let redis = TestRedis::private();
    // Slices off: every HTTP decision is a round trip, so the count tells the tool's apart.
    let server = TestServer::start(&shared(&redis, "slice_max = 0\n", NO_LOOP_DETECTION)).await;
    let client = server.client(Some(&token("hot"))).await;
    let (passed, refused) = spend_until_refused(&client, "save_article", json!({"title": "t", "body": "b0"}), 40).await;
    assert_eq!(passed, 30, "60 tokens, 2 a save");
    let wait = structured(&refused)["error"]["retry_after_ms"].as_u64().expect("wait");

    // Each call is one POST: the coarse HTTP layer still asks Redis (one EVALSHA), the tool's
    // decision no longer does.
    let before = redis.evalsha_calls();
    for i in 1..=5 {
        let r = call(&client, "save_article", json!({"title": "t", "body": format!("b{i}")})).await;
        assert_eq!(error_code(&r), Some("rate_limited"));
        assert_eq!(structured(&r)["error"]["scope"], structured(&refused)["error"]["scope"]);
        assert!(structured(&r)["error"]["retry_after_ms"].as_u64().is_some_and(|ms| ms <= wait));
    }
    assert_eq!(redis.evalsha_calls() - before, 5, "five HTTP decisions, no tool decision");
    // A cheaper call may pass where the expensive one may not: it still goes to Redis.
    let r = call(&client, "list_articles", json!({})).await;
    assert_eq!(redis.evalsha_calls() - before, 7);
    assert_eq!(error_code(&r), Some("rate_limited"), "nothing left at all");
}

/// A `serve` process of its own (so it can be killed outright) on the shared Redis.
struct Instance {
    child: tokio::process::Child,
    url: String,
}

impl Instance {
    async fn start(redis: &TestRedis, lease_ms: u64) -> Self {
        Self::start_with(redis, lease_ms, &[]).await
    }

    /// [`Instance::start`] with more `MCP_RL__` settings.
    async fn start_with(redis: &TestRedis, lease_ms: u64, settings: &[(&str, &str)]) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("port").port();
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_mcp-ratelimit"))
            .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
            .env("MCP_RL__STORE__BACKEND", "redis")
            .env("MCP_RL__STORE__REDIS_URL", &redis.url)
            .env("MCP_RL__STORE__LEASE_MS", lease_ms.to_string())
            // The same limits as the in-process instances of `shared`: instances share a config.
            .env("MCP_RL__LIMITS__CALLER__REFILL_PER_SEC", "0.001")
            .env("MCP_RL__MOCK_UPSTREAM__IMAGE_JOB_MS", "600000")
            .envs(settings.iter().copied())
            .env("RUST_LOG", "warn")
            .kill_on_drop(true)
            .spawn()
            .expect("the binary starts");
        let health = format!("http://127.0.0.1:{port}/health");
        eventually("the instance answers /health", || async { reqwest::get(&health).await.is_ok() }).await;
        Self { child, url: format!("http://127.0.0.1:{port}/mcp") }
    }
}

#[tokio::test]
async fn a_crashed_instances_slots_come_back_when_its_leases_run_out() {
    let redis = TestRedis::private();
    let painter = token("painter");
    let mut doomed = Instance::start(&redis, 400).await;
    let transport = rmcp::transport::StreamableHttpClientTransport::from_config(
        rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig::with_uri(doomed.url.clone())
            .auth_header(painter.clone()),
    );
    let client = rmcp::ServiceExt::serve((), transport).await.expect("client connects");
    for i in 0..5 {
        let r = call(&client, "generate_image", json!({"prompt": format!("p{i}")})).await;
        assert!(!is_error(&r), "{}", text(&r));
    }
    // The instance dies holding its 5 slots: no release, no renewal.
    doomed.child.kill().await.expect("killed");
    let survivor = TestServer::start(&shared(&redis, "lease_ms = 400\n", "")).await;
    let client = survivor.client(Some(&painter)).await;
    let busy = call(&client, "generate_image", json!({"prompt": "right after the crash"})).await;
    assert_eq!(error_code(&busy), Some("busy"), "the dead instance's leases still hold the slots");
    // The leases run out on Redis's clock, 400 ms after the last renewal.
    eventually("the crashed instance's slots came back", || async {
        let status = call(&client, "rate_limit_status", json!({})).await;
        budget(&status, "in_flight:caller:")["remaining"] == 5
    })
    .await;
    assert!(!is_error(&call(&client, "generate_image", json!({"prompt": "after the leases"})).await));
}

#[tokio::test]
async fn jobs_waiting_on_an_instance_that_dies_stop_holding_the_line_and_end_failed_for_their_agents() {
    let redis = TestRedis::private();
    let painter = token("painter");
    // Made-up keys: no share of the account is kept for configured ones.
    let settings = [("MCP_RL__UPSTREAM__MAX_IN_FLIGHT", "1"), ("MCP_RL__UPSTREAM__UNVERIFIED_SHARE", "1.0")];
    let mut doomed = Instance::start_with(&redis, 400, &settings).await;
    let transport = rmcp::transport::StreamableHttpClientTransport::from_config(
        rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig::with_uri(doomed.url.clone())
            .auth_header(painter.clone()),
    );
    let client = rmcp::ServiceExt::serve((), transport).await.expect("client connects");
    let mut waiting = Vec::new();
    for i in 0..3 {
        let r = call(&client, "generate_image", json!({"prompt": format!("p{i}")})).await;
        assert!(!is_error(&r), "{}", text(&r));
        if structured(&r)["queue_position"].is_u64() {
            waiting.push(structured(&r)["predict_id"].as_str().expect("id").to_owned());
        }
    }
    assert_eq!(waiting.len(), 2, "one runs on the account of 1, two wait in the line");
    // A job that starts waiting is told to the line at the dispatcher's next step, after its agent
    // is answered: both must stand in the line before the instance dies.
    let connection =
        redis::Client::open(redis.url.as_str()).expect("url").get_multiplexed_async_connection().await.expect("redis");
    let line = || {
        let mut connection = connection.clone();
        async move {
            let members: Vec<String> =
                redis::cmd("ZRANGE").arg("{upstream}line").arg(0).arg(-1).query_async(&mut connection).await.ok()?;
            (members.len() == 2).then_some(members)
        }
    };
    let members = eventually_some("both waiting jobs stand in the line", Duration::from_secs(10), line).await;
    // The instance dies with two jobs in the line; its mark of being alive, and the grace a claim
    // would give it then, are made to run out now rather than ten seconds of real time later.
    doomed.child.kill().await.expect("killed");
    taken_for_dead(&connection, &members[0]).await;
    let survivor = TestServer::start(&shared(
        &redis,
        "lease_ms = 400\n",
        "[upstream]\nmax_in_flight = 1\nunverified_share = 1.0\n",
    ))
    .await;
    let other = survivor.client(Some(&token("sculptor"))).await;
    let r = call(&other, "generate_image", json!({"prompt": "after the crash"})).await;
    let mine = structured(&r)["predict_id"].as_str().expect("accepted").to_owned();
    let agent = survivor.client(Some(&painter)).await;
    // A claim takes the dead instance's jobs out of the line and ends them; the survivor's job
    // goes in the slot its leases held.
    let ended = eventually_some("the dead instance's jobs were ended", Duration::from_secs(20), || async {
        // Asked a few times a second, within the address's request budget.
        tokio::time::sleep(Duration::from_millis(300)).await;
        survivor.advance_secs(1.0);
        let mut statuses = Vec::new();
        for id in &waiting {
            let r = call(&agent, "get_prediction", json!({"predict_id": id})).await;
            statuses.push(
                structured(&r)["prediction"]["status"].as_str().or(structured(&r)["status"].as_str())?.to_owned(),
            );
            if statuses.last().is_some_and(|s| s != "failed") {
                return None;
            }
        }
        Some(call(&agent, "get_prediction", json!({"predict_id": waiting[0]})).await)
    })
    .await;
    assert!(text(&ended).contains("stopped before submitting it"), "{}", text(&ended));
    // (Asked of the paid API, not of the agent's budget, which Redis refills in real time.)
    eventually("the survivor's job took the account's slot", || async {
        survivor.advance_secs(1.0);
        survivor.upstream_usage().await["predictions_created"] == 1
    })
    .await;
    let r = call(&other, "get_prediction", json!({"predict_id": mine})).await;
    assert!(structured(&r)["queue_position"].is_null(), "submitted, not waiting: {}", text(&r));
}

/// A server on the real clock (Redis's clock is real time too), serving on a free port.
async fn real_time_server(config: &str) -> (std::sync::Arc<mcp_ratelimit::App>, String) {
    let config = mcp_ratelimit::Config::from_toml(config, &mcp_ratelimit::mcp::tools::catalogue()).expect("config");
    let app = std::sync::Arc::new(
        mcp_ratelimit::App::start(config, mcp_ratelimit::clock::SystemClock::shared()).await.expect("starts"),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}/mcp", listener.local_addr().expect("addr"));
    let serving = app.clone();
    tokio::spawn(async move { serving.serve_http(listener).await });
    (app, url)
}

#[tokio::test]
async fn three_instances_space_their_video_submissions_as_one_queue() {
    let redis = TestRedis::private();
    // One mock upstream for all three, on the real clock, recording when submissions arrive.
    let defaults = mcp_ratelimit::Config::defaults(&mcp_ratelimit::mcp::tools::catalogue()).expect("defaults");
    let deadlines = mcp_ratelimit::http::serve::Deadlines::of(&defaults.server);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let clock = mcp_ratelimit::clock::SystemClock::shared();
    let mock = mcp_ratelimit::mock_upstream::MockUpstream::start(defaults.mock_upstream, deadlines, clock, listener)
        .await
        .expect("mock");
    const GAP_MS: u64 = 400;
    // Submissions are spaced on Redis's clock and stamped on arrival at the mock: a loaded
    // machine delays one submission's trip more than the next one's by tens of ms.
    const JITTER_MS: u64 = 100;
    // Every caller here has a made-up key: no share of the account is kept for configured ones.
    let config = shared(
        &redis,
        "",
        &format!("[upstream]\nurl = \"{}\"\nvideo_min_gap_ms = {GAP_MS}\nunverified_share = 1.0\n", mock.url),
    );
    let mut servers = Vec::new();
    for _ in 0..3 {
        servers.push(real_time_server(&config).await);
    }
    // Three callers, one on each instance, each sending two videos at once.
    let mut clients = Vec::new();
    for (_, url) in &servers {
        let transport = rmcp::transport::StreamableHttpClientTransport::from_config(
            rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig::with_uri(url.clone())
                .auth_header(token("director")),
        );
        clients.push(rmcp::ServiceExt::serve((), transport).await.expect("client connects"));
    }
    let video = |i: usize| json!({"image_url": "https://example.com/a.png", "prompt": format!("scene {i}")});
    let calls = clients.iter().enumerate().flat_map(|(i, c)| {
        [call(c, "generate_image_to_video", video(2 * i)), call(c, "generate_image_to_video", video(2 * i + 1))]
    });
    for r in futures::future::join_all(calls).await {
        assert!(!is_error(&r), "{}", text(&r));
    }
    let log_url = format!("{}/v1/submissions", mock.url);
    let mut arrivals = Vec::new();
    for _ in 0..500 {
        let log: serde_json::Value = reqwest::get(&log_url).await.expect("log").json().await.expect("json");
        arrivals = log["submissions"].as_array().expect("list").iter().filter_map(|s| s["at_ns"].as_u64()).collect();
        if arrivals.len() >= 6 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(arrivals.len(), 6, "every video was submitted");
    let gaps: Vec<u64> = arrivals.windows(2).map(|w| (w[1] - w[0]) / 1_000_000).collect();
    assert!(gaps.iter().all(|&gap| gap + JITTER_MS >= GAP_MS), "submissions {gaps:?} ms apart, the gap is {GAP_MS} ms");
}

#[tokio::test]
async fn a_slot_freed_on_one_instance_starts_a_job_waiting_on_another_at_once_told_by_redis() {
    let redis = TestRedis::private();
    // Every caller here has a made-up key: no share of the account is kept for configured ones.
    let config = shared(&redis, "", "[upstream]\nmax_in_flight = 3\nunverified_share = 1.0\n");
    let servers = [TestServer::start(&config).await, TestServer::start(&config).await];
    let mut running = Vec::new();
    let mut waiting = Vec::new();
    // Three start on the first instance; three wait on the second.
    for i in 0..6 {
        let server = &servers[i / 3];
        let client = server.client(Some(&token(&format!("caller{i}")))).await;
        let r = call(&client, "generate_image", json!({"prompt": format!("p{i}")})).await;
        assert!(!is_error(&r), "{}", text(&r));
        let id = structured(&r)["predict_id"].as_str().expect("id").to_owned();
        if structured(&r)["queue_position"].is_u64() {
            waiting.push(id);
        } else {
            running.push((i / 3, client, id));
        }
    }
    let created = || async {
        let mut n = 0;
        for server in &servers {
            n += server.upstream_usage().await["predictions_created"].as_u64().expect("count");
        }
        n
    };
    assert_eq!((running.len(), waiting.len()), (3, 3), "one account of 3 across both instances");
    assert!(running.iter().all(|(instance, _, _)| *instance == 0));
    assert_eq!(created().await, 3);

    // A job ends on the first instance: Redis says its slot is free once it is, and a job
    // waiting on the second starts then, with no clock moving (no asking again a second later).
    let (_, client, id) = &running[0];
    let r = call(client, "cancel_prediction", json!({"predict_id": id})).await;
    assert_eq!(structured(&r)["status"], "canceled");
    eventually("a job waiting on the other instance started in the freed slot", || async { created().await == 4 })
        .await;
    let submitted = servers[1].submissions().await;
    let started = submitted.last().map(|s| s.2.clone()).expect("a submission");
    assert!(waiting.contains(&started), "{started} was one of the second instance's: {waiting:?}");
    for server in &servers {
        server.advance_secs(5.0);
    }
    settle().await;
    assert_eq!(created().await, 4, "still one account of 3");
}

#[tokio::test]
async fn unverified_callers_hold_their_share_of_the_account_across_instances_and_a_tenant_finds_room() {
    let redis = TestRedis::private();
    let tenant = token("tenant-key");
    let keys = format!("[[auth.keys]]\nkey = \"{tenant}\"\ntenant = \"acme\"\n");
    // An account of 4, half of it for unverified callers: 2 across both instances, not 2 each.
    let config = shared(&redis, "", &format!("[upstream]\nmax_in_flight = 4\nunverified_share = 0.5\n{keys}"));
    let servers = [TestServer::start(&config).await, TestServer::start(&config).await];
    let created = || async {
        let mut n = 0;
        for server in &servers {
            n += server.upstream_usage().await["predictions_created"].as_u64().expect("count");
        }
        n
    };
    let mut waiting = 0;
    for i in 0..6 {
        let client = servers[i % 2].client(Some(&token(&format!("made-up{i}")))).await;
        let r = call(&client, "generate_image", json!({"prompt": format!("p{i}")})).await;
        assert!(!is_error(&r), "{}", text(&r));
        waiting += usize::from(structured(&r)["queue_position"].is_u64());
    }
    // Each instance's dispatcher asks Redis again a second later (on its clock) for the share.
    for _ in 0..3 {
        for server in &servers {
            server.advance_secs(1.0);
        }
        settle().await;
    }
    assert_eq!(created().await, 2, "the unverified share, across both instances");
    assert!(waiting >= 3, "the rest wait: {waiting}");
    // A configured tenant's image on either instance finds one of the other two slots.
    for server in &servers {
        let client = server.client(Some(&tenant)).await;
        let r = call(&client, "generate_image", json!({"prompt": "the tenant's"})).await;
        assert!(!is_error(&r), "{}", text(&r));
    }
    eventually("both tenant images started", || async {
        for server in &servers {
            server.advance_secs(1.0);
        }
        created().await == 4
    })
    .await;
}

#[tokio::test]
async fn a_loop_round_robin_over_two_instances_is_stopped_on_its_fifth_call_not_its_tenth() {
    let redis = TestRedis::start();
    let config = shared(&redis, "", "");
    let servers = [TestServer::start(&config).await, TestServer::start(&config).await];
    let stuck = token("stuck");
    let clients = [servers[0].client(Some(&stuck)).await, servers[1].client(Some(&stuck)).await];
    let same = json!({"query": "the same thing again"});
    for i in 0..4 {
        let r = call(&clients[i % 2], "list_articles", same.clone()).await;
        assert!(!is_error(&r), "call {i}: {}", text(&r));
    }
    let r = call(&clients[0], "list_articles", same).await;
    assert_eq!(error_code(&r), Some("loop_detected"), "one history across the instances: {}", text(&r));
}

/// A `tools/call` costs two round trips to Redis: the request's HTTP limits in one script, then
/// in another the call's budgets, the operator blocks and its loop check (a loop is refused, and
/// a call refused for budget not recorded, inside that script). Every round trip the guard
/// makes is a script (`EVALSHA`), so they are what is counted. Before the loop check joined
/// the decision it was three.
#[tokio::test]
async fn a_tool_call_costs_three_round_trips_to_redis_its_loop_check_and_answer_included() {
    let redis = TestRedis::private();
    // Ten searches that all find nothing would be a loop by their answers at the sixth. Slices
    // off: the HTTP limits' decision is a round trip of its own every time.
    let server = TestServer::start(&shared(&redis, "slice_max = 0\n", NO_PROGRESS_CHECK)).await;
    let client = server.client(Some(&token("counted"))).await;
    let per_call = round_trips_of_searches(&redis, &client, 10).await;
    // The HTTP limits', the decision's (its loop check in it), and the answer heard.
    assert_eq!(per_call, [3; 10], "round trips per call");
    // And the loop is still seen: four more of one call pass, the fifth is refused.
    let same = json!({"query": "the same thing again"});
    for i in 0..4 {
        assert!(!is_error(&call(&client, "list_articles", same.clone()).await), "call {i}");
    }
    let before = redis.evalsha_calls();
    assert_eq!(error_code(&call(&client, "list_articles", same).await), Some("loop_detected"));
    assert_eq!(redis.evalsha_calls() - before, 2, "a loop is refused in the decision's own round trip");
}

/// The round trips to Redis each of `calls` searches for different things costs (each served).
async fn round_trips_of_searches(redis: &TestRedis, client: &Client, calls: usize) -> Vec<u64> {
    let mut per_call = Vec::new();
    for n in 0..calls {
        let before = redis.evalsha_calls();
        let r = call(client, "list_articles", json!({"query": format!("query {n}")})).await;
        assert!(!is_error(&r), "call {n}: {}", text(&r));
        per_call.push(redis.evalsha_calls() - before);
    }
    per_call
}

/// With budget slices (the default), a busy caller's HTTP limits are decided from what this
/// instance holds of them: its calls cost the decision's round trip and the answer's, and one more
/// only when a slice runs out (the HTTP decision that takes the next).
#[tokio::test]
async fn with_slices_a_busy_callers_http_limits_cost_no_round_trip_of_their_own() {
    let redis = TestRedis::private();
    // HTTP limits that refill slower than any machine calls, so they are drawn down and sliced
    // however slow the run (a bucket refilled faster than it is spent lends nothing).
    let slow = "[limits.http]\nrefill_per_sec = 0.1\n[limits.address_http]\nrefill_per_sec = 0.1\n";
    let server = TestServer::start(&shared(&redis, "", &format!("{NO_PROGRESS_CHECK}{slow}"))).await;
    let client = server.client(Some(&token("counted"))).await;
    let per_call = round_trips_of_searches(&redis, &client, 30).await;
    assert!(per_call.iter().all(|trips| (2..=3).contains(trips)), "round trips per call: {per_call:?}");
    let late: u64 = per_call[10..].iter().sum();
    assert!(late <= 20 * 2 + 5, "the last twenty calls: at most five HTTP decisions in Redis: {per_call:?}");
    // What the instance holds is in its metrics (a slice may be spent to the unit: call on).
    let held = |metrics: String| {
        let units = metrics.lines().find_map(|line| line.strip_prefix("mcp_ratelimit_store_slice_units "));
        units.and_then(|units| units.trim().parse::<f64>().ok()).unwrap_or(0.0)
    };
    let mut more = 0;
    while held(server.metrics().await) == 0.0 {
        assert!(more < 20, "no slice held after {more} more calls");
        assert!(!is_error(&call(&client, "list_articles", json!({"query": format!("more {more}")})).await));
        more += 1;
    }
    // And in the caller's own status: which of its budgets this instance holds part of, counted
    // in what remains.
    let held_here = |status: &Value| {
        let budgets = status["budgets"].as_array().cloned().unwrap_or_default();
        budgets.iter().filter_map(|b| b["held_here"].as_u64()).max().unwrap_or(0)
    };
    for asked in 0.. {
        let answer = call(&client, "rate_limit_status", json!({})).await;
        let status = structured(&answer);
        if held_here(status) > 0 {
            break;
        }
        assert!(asked < 20, "no budget shows what is held here: {status}");
    }
}

#[tokio::test]
async fn a_job_accepted_by_one_instance_can_be_polled_and_cancelled_on_another() {
    let redis = TestRedis::private();
    let (mock_clock, mock) = shared_mock().await;
    let config = shared(&redis, "", &format!("[upstream]\nurl = \"{}\"\n", mock.url));
    let (a, b) = (TestServer::start(&config).await, TestServer::start(&config).await);
    let agent = token("roaming");
    let (on_a, on_b) = (a.client(Some(&agent)).await, b.client(Some(&agent)).await);

    let r = call(&on_a, "generate_image", json!({"prompt": "a harbour"})).await;
    let id = structured(&r)["predict_id"].as_str().expect("id").to_owned();
    eventually("instance b sees the job", || async {
        let r = call(&on_b, "get_prediction", json!({"predict_id": id})).await;
        !is_error(&r) && structured(&r)["status"] == "starting"
    })
    .await;
    // Polled again and again on b while it is pending on a: an agent waiting, never a loop.
    for poll in 0..8 {
        let r = call(&on_b, "get_prediction", json!({"predict_id": id})).await;
        assert!(!is_error(&r), "poll {poll}: {}", text(&r));
    }
    let stranger = b.client(Some(&token("stranger"))).await;
    let r = call(&stranger, "get_prediction", json!({"predict_id": id})).await;
    assert_eq!(error_code(&r), Some("invalid_arguments"), "someone else's job is unknown there too");

    // The job finishes at the upstream; instance a learns it at its next poll and publishes it.
    mock_clock.advance(Duration::from_secs(6));
    a.advance_secs(2.0);
    eventually("instance b reads the result", || async {
        let r = call(&on_b, "get_prediction", json!({"predict_id": id})).await;
        structured(&r)["status"] == "succeeded"
            && structured(&r)["output"].as_str().is_some_and(|url| url.contains(id.as_str()))
    })
    .await;

    // A second job, cancelled from instance b: upstream at once, and instance a gives the slot
    // back when it next polls.
    let r = call(&on_a, "generate_image", json!({"prompt": "a lighthouse"})).await;
    let second = structured(&r)["predict_id"].as_str().expect("id").to_owned();
    eventually("instance b sees the second job", || async {
        !is_error(&call(&on_b, "get_prediction", json!({"predict_id": second})).await)
    })
    .await;
    let r = call(&on_b, "cancel_prediction", json!({"predict_id": second})).await;
    assert_eq!(structured(&r)["status"], "canceled", "{}", text(&r));
    a.advance_secs(2.0);
    eventually("instance a gave the slot back", || async {
        let status = call(&on_b, "rate_limit_status", json!({})).await;
        budget(&status, "in_flight:caller:")["remaining"] == 5
    })
    .await;
}

#[tokio::test]
async fn two_instances_share_one_budget_over_tls_to_a_redis_with_a_private_ca() {
    let redis = TlsRedis::start();
    let store = |ca: &str| {
        format!(
            "[store]\nbackend = \"redis\"\nredis_url = \"{}\"\nredis_ca_file = \"{ca}\"\ntimeout_ms = 5000\n\
             [limits.caller]\nrefill_per_sec = 0.001\n{NO_PROGRESS_CHECK}",
            redis.url
        )
    };
    let config = store(&redis.ca_file.to_string_lossy());
    let servers = [TestServer::start(&config).await, TestServer::start(&config).await];
    let reader = token("tls-reader");
    let clients = [servers[0].client(Some(&reader)).await, servers[1].client(Some(&reader)).await];
    let mut admitted = 0;
    for i in 0..70 {
        if !is_error(&call(&clients[i % 2], "list_articles", json!({"query": format!("q{i}")})).await) {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 60, "one budget of 60 across two instances, over TLS");

    // The system's trust store does not know this server's CA: no connection, and the server
    // says why instead of starting without its shared limits. (A roomy store timeout: reading
    // the system's trust store and a handshake on a loaded machine can take longer than a call.)
    let config =
        mcp_ratelimit::Config::from_toml(&store(""), &mcp_ratelimit::mcp::tools::catalogue()).expect("valid config");
    let e = mcp_ratelimit::App::start(config, mcp_ratelimit::clock::SystemClock::shared())
        .await
        .expect_err("an unknown CA is refused");
    let message = format!("{e:#}");
    assert!(message.to_lowercase().contains("certificate"), "{message}");

    // A CA file that is not a certificate is a config error naming the key.
    let junk = tempfile::NamedTempFile::new().expect("a file");
    std::fs::write(junk.path(), "not a certificate").expect("write");
    let e = mcp_ratelimit::Config::from_toml(
        &store(&junk.path().to_string_lossy()),
        &mcp_ratelimit::mcp::tools::catalogue(),
    )
    .expect_err("junk CA");
    assert!(e.to_string().contains("store.redis_ca_file"), "{e}");
}

#[tokio::test]
async fn a_job_waiting_in_one_instances_queue_is_cancelled_from_another_and_never_submitted() {
    let redis = TestRedis::private();
    let (mock_clock, mock) = shared_mock().await;
    // An account of one slot: the second image waits in instance a's queue behind the first.
    // (Its caller has a made-up key: no share of the account is kept for configured ones.)
    let config =
        shared(&redis, "", &format!("[upstream]\nurl = \"{}\"\nmax_in_flight = 1\nunverified_share = 1.0\n", mock.url));
    let (a, b) = (TestServer::start(&config).await, TestServer::start(&config).await);
    let agent = token("impatient");
    let (on_a, on_b) = (a.client(Some(&agent)).await, b.client(Some(&agent)).await);

    let running = call(&on_a, "generate_image", json!({"prompt": "the first"})).await;
    assert!(!is_error(&running), "{}", text(&running));
    let r = call(&on_a, "generate_image", json!({"prompt": "waits its turn"})).await;
    assert_eq!(structured(&r)["queue_position"], 1, "queued behind the running job: {}", text(&r));
    let queued = structured(&r)["predict_id"].as_str().expect("id").to_owned();
    eventually("instance b sees the queued job", || async {
        !is_error(&call(&on_b, "get_prediction", json!({"predict_id": queued})).await)
    })
    .await;

    let r = call(&on_b, "cancel_prediction", json!({"predict_id": queued})).await;
    assert_eq!(structured(&r)["status"], "canceled", "{}", text(&r));
    let r = call(&on_a, "get_prediction", json!({"predict_id": queued})).await;
    assert_eq!(structured(&r)["status"], "canceled", "instance a took it out of its queue: {}", text(&r));
    let status = call(&on_a, "rate_limit_status", json!({})).await;
    assert_eq!(budget(&status, "in_flight:caller:")["remaining"], 4, "its slot came back; the running job keeps one");

    // The account frees up: nothing is waiting any more, so nothing else is submitted.
    mock_clock.advance(Duration::from_secs(6));
    a.advance_secs(2.0);
    eventually("the first job finished", || async {
        structured(&call(&on_a, "get_prediction", json!({"predict_id": structured(&running)["predict_id"]})).await)
            ["status"]
            == "succeeded"
    })
    .await;
    a.advance_secs(2.0);
    assert_eq!(a.submissions().await.len(), 1, "the cancelled job never reached the upstream");
}

/// A TCP link to Redis that a test can cut (every connection through it dropped, new ones
/// closed at once, as a network partition looks to the client) and mend. Redis keeps its data.
struct Link {
    url: String,
    up: tokio::sync::watch::Sender<bool>,
}

impl Link {
    async fn to(redis: &TestRedis) -> Self {
        let target: std::net::SocketAddr =
            redis.url.trim_start_matches("redis://").trim_end_matches('/').parse().expect("redis address");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the link");
        let url = format!("redis://{}/", listener.local_addr().expect("link address"));
        let up = tokio::sync::watch::Sender::new(true);
        let state = up.subscribe();
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let mut state = state.clone();
                if !*state.borrow() {
                    continue; // dropped: closed at once
                }
                tokio::spawn(async move {
                    let Ok(mut server) = tokio::net::TcpStream::connect(target).await else { return };
                    // Small commands, one at a time: without this, Nagle and delayed ACKs stall each.
                    let _ = (client.set_nodelay(true), server.set_nodelay(true));
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = state.wait_for(|up| !*up) => {}
                    }
                });
            }
        });
        Self { url, up }
    }

    fn cut(&self) {
        self.up.send_replace(false);
    }

    fn mend(&self) {
        self.up.send_replace(true);
    }
}

/// A job's status as `client` sees it, or the refusal's code.
async fn status_of(client: &Client, id: &str) -> String {
    let r = call(client, "get_prediction", json!({"predict_id": id})).await;
    let seen = structured(&r)["status"].as_str().or_else(|| error_code(&r));
    seen.unwrap_or("no status").to_owned()
}

/// Where a status is in a job's life: a view of a lower rank after a higher one went back.
fn rank(status: &str) -> u8 {
    match status {
        "starting" => 0,
        "processing" => 1,
        "succeeded" | "failed" | "canceled" => 2,
        other => panic!("not a job status: {other}"),
    }
}

/// Redis at `url` as the store, and limits out of the way of tests that poll a job many times.
fn redis_store(url: &str) -> String {
    format!(
        "[store]\nbackend = \"redis\"\nredis_url = \"{url}\"\ntimeout_ms = 200\n{NO_LOOP_DETECTION}\
         [limits.http]\nburst = 100000\n[limits.method.tools_call]\nburst = 100000\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_finishes_while_its_instance_cannot_reach_redis_is_published_once_it_can() {
    let redis = TestRedis::private();
    let link = Link::to(&redis).await;
    // Instance a owns the job and reaches Redis through the link; instance b directly.
    let (a, b) = (TestServer::start(&redis_store(&link.url)).await, TestServer::start(&redis_store(&redis.url)).await);
    let agent = token("roaming");
    let (on_a, on_b) = (a.client(Some(&agent)).await, b.client(Some(&agent)).await);
    let r = call(&on_a, "generate_image", json!({"prompt": "a harbour at dusk"})).await;
    let id = structured(&r)["predict_id"].as_str().expect("accepted").to_owned();
    // Every status instance b showed, each change once.
    let mut seen_on_b: Vec<String> = Vec::new();
    let see = |seen: &mut Vec<String>, status: String| {
        if seen.last() != Some(&status) {
            seen.push(status);
        }
    };
    for want in ["starting", "processing"] {
        let asked = Instant::now();
        while seen_on_b.last().map(String::as_str) != Some(want) {
            assert!(asked.elapsed() < Duration::from_secs(5), "instance b never saw the job {want}: {seen_on_b:?}");
            see(&mut seen_on_b, status_of(&on_b, &id).await);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // The mock's image takes 6 s: processing after 1.2 s; instance a polls every 2 s.
        a.advance_secs(2.0);
    }

    // Cut off from Redis, instance a sees the job finish (its poll of the upstream needs no Redis).
    link.cut();
    a.advance_secs(4.0);
    eventually("instance a sees the job succeed", || async { status_of(&on_a, &id).await == "succeeded" }).await;
    // Long enough for its publisher to fail and back off; b still reads the last snapshot.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let during = status_of(&on_b, &id).await;
    assert_eq!(during, "processing", "instance b reads the snapshot written before the cut");
    see(&mut seen_on_b, during);

    link.mend();
    let mended = Instant::now();
    let mut last = String::new();
    while mended.elapsed() < Duration::from_secs(5) && last != "succeeded" {
        last = status_of(&on_b, &id).await;
        see(&mut seen_on_b, last.clone());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(last, "succeeded", "published again once Redis could be reached: b saw {seen_on_b:?}");
    eprintln!("instance b saw the job succeed {:?} after the link was mended", mended.elapsed());
    let r = call(&on_b, "get_prediction", json!({"predict_id": id})).await;
    assert!(structured(&r)["output"].as_str().is_some_and(|url| url.contains(id.as_str())), "{}", text(&r));
    assert!(
        seen_on_b.windows(2).all(|w| rank(&w[0]) <= rank(&w[1])),
        "an older state after a newer one: {seen_on_b:?}"
    );
}

/// Spawns a reader that, every 2 ms while `watching` holds, reads the job snapshots at `keys`
/// straight from Redis; it ends with every (version, status) each snapshot went through, in order.
fn watch_snapshots(
    keys: Vec<String>,
    watching: std::sync::Arc<std::sync::atomic::AtomicBool>,
    mut connection: redis::aio::MultiplexedConnection,
) -> tokio::task::JoinHandle<Vec<Vec<(u64, String)>>> {
    tokio::spawn(async move {
        let mut seen: Vec<Vec<(u64, String)>> = vec![Vec::new(); keys.len()];
        while watching.load(std::sync::atomic::Ordering::Relaxed) {
            let values: Vec<Option<String>> =
                redis::cmd("MGET").arg(&keys).query_async(&mut connection).await.expect("MGET");
            for (k, value) in values.iter().enumerate() {
                let Some(snapshot) = value.as_deref().and_then(|v| serde_json::from_str::<Value>(v).ok()) else {
                    continue;
                };
                let version = snapshot["version"].as_u64().unwrap_or(0);
                let status = snapshot["prediction"]["status"].as_str().unwrap_or("none").to_owned();
                if seen[k].last() != Some(&(version, status.clone())) {
                    seen[k].push((version, status));
                }
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        seen
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_rapid_changes_reach_redis_in_order_across_an_outage_and_the_in_flight_set_follows() {
    const JOBS: usize = 20;
    let redis = TestRedis::private();
    let link = Link::to(&redis).await;
    let config = format!(
        "{}{ROOMY_IN_FLIGHT}[upstream]\nmax_in_flight = 30\nunverified_share = 1.0\n\
         [mock_upstream]\nmax_concurrent_predictions = 30\n\
         [limits.caller]\nburst = 1000\n",
        redis_store(&link.url)
    );
    let owner = TestServer::start(&config).await;
    let client = owner.client(Some(&token("prolific"))).await;
    let mut ids = Vec::new();
    for i in 0..JOBS {
        let r = call(&client, "generate_image", json!({"prompt": format!("picture {i}")})).await;
        assert!(!is_error(&r), "{}", text(&r));
        ids.push(structured(&r)["predict_id"].as_str().expect("accepted").to_owned());
    }
    // A reader straight on Redis records every (version, status) each snapshot goes through.
    let reader = redis::Client::open(redis.url.as_str()).expect("url");
    let connection = reader.get_multiplexed_async_connection().await.expect("connects");
    let keys: Vec<String> = ids.iter().map(|id| format!("job:{{{id}}}")).collect();
    let watching = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let watcher = watch_snapshots(keys.clone(), watching.clone(), connection.clone());
    let members = || {
        let mut connection = connection.clone();
        async move {
            let members: Vec<String> =
                redis::cmd("SMEMBERS").arg("{upstream}job:in_flight").query_async(&mut connection).await.expect("set");
            members
        }
    };
    eventually("every job is in the shared set of jobs in flight", || async {
        let members = members().await;
        ids.iter().all(|id| members.contains(id))
    })
    .await;

    // Every second of the job's 6, each of its polls (every 2 s) changes its snapshot; Redis is
    // out of reach from the 3rd second to the 7th, while every job finishes.
    for second in 1..=8 {
        if second == 3 {
            link.cut();
        }
        if second == 7 {
            link.mend();
        }
        owner.advance_secs(1.0);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for id in &ids {
        assert_eq!(status_of(&client, id).await, "succeeded", "the owner's own book");
    }
    eventually("every snapshot in Redis is final and the set of jobs in flight holds none", || async {
        let mut connection = connection.clone();
        let values: Vec<Option<String>> =
            redis::cmd("MGET").arg(&keys).query_async(&mut connection).await.expect("MGET");
        let finished = values.iter().all(|v| v.as_deref().is_some_and(|v| v.contains("\"succeeded\"")));
        let members = members().await;
        finished && ids.iter().all(|id| !members.contains(id))
    })
    .await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    watching.store(false, std::sync::atomic::Ordering::Relaxed);
    let seen = watcher.await.expect("the reader");
    for (id, history) in ids.iter().zip(&seen) {
        assert!(history.windows(2).all(|w| w[0].0 < w[1].0), "{id}: a version went back: {history:?}");
        assert!(
            history.windows(2).all(|w| rank(&w[0].1) <= rank(&w[1].1)),
            "{id}: an older state after a newer one: {history:?}"
        );
        assert_eq!(history.last().map(|(_, s)| s.as_str()), Some("succeeded"), "{id}: {history:?}");
    }
}

#[tokio::test]
async fn a_job_cancelled_on_another_instance_stays_canceled_there_whatever_its_owner_writes_next() {
    let redis = TestRedis::private();
    let (mock_clock, mock) = shared_mock().await;
    let config = format!("{}[upstream]\nurl = \"{}\"\n", redis_store(&redis.url), mock.url);
    let (a, b) = (TestServer::start(&config).await, TestServer::start(&config).await);
    let agent = token("changed-its-mind");
    let (on_a, on_b) = (a.client(Some(&agent)).await, b.client(Some(&agent)).await);
    let r = call(&on_a, "generate_image", json!({"prompt": "a lighthouse"})).await;
    let id = structured(&r)["predict_id"].as_str().expect("accepted").to_owned();
    eventually("instance b sees the job", || async { status_of(&on_b, &id).await == "starting" }).await;
    let r = call(&on_b, "cancel_prediction", json!({"predict_id": id})).await;
    assert_eq!(structured(&r)["status"], "canceled", "{}", text(&r));

    // Instance a does not know yet: its next poll fails (503), and it writes the job again, not
    // final, with its next poll time.
    let chaos = |knobs: Value| {
        let url = format!("{}/v1/chaos", mock.url);
        async move { reqwest::Client::new().put(url).json(&knobs).send().await.expect("chaos").status() }
    };
    assert!(chaos(json!({"rate_5xx": 1.0})).await.is_success());
    a.advance_secs(2.0);
    let usage = format!("{}/v1/usage", mock.url);
    eventually("instance a's poll failed", || async {
        let usage: Value = reqwest::get(&usage).await.expect("usage").json().await.expect("json");
        usage["refused_5xx"].as_u64() >= Some(1)
    })
    .await;
    assert_eq!(status_of(&on_a, &id).await, "starting", "the owner has not heard of the cancel yet");
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert_eq!(status_of(&on_b, &id).await, "canceled", "the owner's later write undid the cancel");
    }

    // The upstream is back: the owner hears of the cancel, and everyone agrees.
    assert!(chaos(json!({"rate_5xx": 0.0})).await.is_success());
    mock_clock.advance(Duration::from_secs(1));
    a.advance_secs(5.0);
    eventually("instance a sees the cancel", || async { status_of(&on_a, &id).await == "canceled" }).await;
    assert_eq!(status_of(&on_b, &id).await, "canceled");
}

/// Three instances on one Redis in front of one mock on its own clock (one-second images), an
/// account of `slots`, the server polling every second, and `extra` config (keys, tiers).
struct Three {
    redis: TestRedis,
    mock_clock: std::sync::Arc<mcp_ratelimit::clock::ManualClock>,
    mock: mcp_ratelimit::mock_upstream::MockUpstream,
    servers: [TestServer; 3],
}

impl Three {
    async fn start(slots: usize, extra: &str) -> Self {
        let redis = TestRedis::private();
        let (mock_clock, mock) = shared_mock_running(1_000).await;
        let config = format!(
            "[store]\nbackend = \"redis\"\nredis_url = \"{}\"\ntimeout_ms = 200\n\
             [upstream]\nurl = \"{}\"\nmax_in_flight = {slots}\nimage_poll_seconds = 1\nqueue_max = 100\n\
             [limits.caller]\nburst = 1000\nrefill_per_sec = 0.001\n[limits.tenant]\nburst = 1000\nrefill_per_sec = 0.001\n\
             [limits.http]\nburst = 100000\n[limits.address_http]\nburst = 100000\n\
             [limits.method.tools_call]\nburst = 100000\n\
             [limits.in_flight]\ncaller = 100\ntenant = 100\n[loop_detection]\nenabled = false\n{extra}",
            redis.url, mock.url
        );
        let servers =
            [TestServer::start(&config).await, TestServer::start(&config).await, TestServer::start(&config).await];
        Self { redis, mock_clock, mock, servers }
    }

    /// An agent presenting `key` to instance `i`.
    async fn agent(&self, i: usize, key: &str) -> Client {
        self.servers[i].client(Some(key)).await
    }

    /// Submits an image as `agent`: its id.
    async fn image(agent: &Client, prompt: &str) -> String {
        let r = call(agent, "generate_image", json!({ "prompt": prompt })).await;
        assert!(!is_error(&r), "{}", text(&r));
        structured(&r)["predict_id"].as_str().expect("an id").to_owned()
    }

    /// Moves every clock by `ms`, then waits (in real time, a little) for what that set off.
    async fn step(&self, ms: u64) {
        // The mock first: a poll the servers' step sets off finds the job as long done as it is.
        self.mock_clock.advance(Duration::from_millis(ms));
        for server in &self.servers {
            server.advance_ms(ms);
        }
        settle().await;
    }

    /// The ids the mock has seen submitted, in order.
    async fn submitted(&self) -> Vec<String> {
        let log: Value =
            reqwest::get(format!("{}/v1/submissions", self.mock.url)).await.expect("log").json().await.expect("json");
        log["submissions"]
            .as_array()
            .expect("list")
            .iter()
            .filter_map(|s| s["idempotency_key"].as_str())
            .map(str::to_owned)
            .collect()
    }
}

/// On an account of one slot: `backlog_key` queues one running and forty waiting on A and B, and
/// `single_key` keeps one job waiting on C for `rounds` job lengths. Which freed slots (1 is the
/// first after the running job) C's jobs took.
async fn one_at_a_time_on_c(three: &Three, backlog_key: &str, single_key: &str, rounds: usize) -> Vec<usize> {
    let backlog = [three.agent(0, backlog_key).await, three.agent(1, backlog_key).await];
    let single = three.agent(2, single_key).await;
    for i in 0..41 {
        Three::image(&backlog[i % 2], &format!("backlog {i}")).await;
    }
    let mut mine = vec![Three::image(&single, "single 0").await];
    for round in 1..=rounds {
        // One job's length: the running job ends, whichever instance ran it, and the slot goes on.
        three.step(1_000).await;
        eventually("the freed slot was taken again", || async { three.submitted().await.len() > round }).await;
        let submitted = three.submitted().await;
        if mine.last().is_some_and(|id| submitted.contains(id)) {
            mine.push(Three::image(&single, &format!("single {round}")).await);
        }
    }
    let submitted = three.submitted().await;
    (1..=rounds).filter(|&i| mine.contains(&submitted[i])).collect()
}

/// X's key, and Y's of `tier`.
fn x_and_y(tier: &str) -> String {
    format!(
        "[[auth.keys]]\nkey = \"x-backlog-key\"\ntenant = \"x\"\n\
         [[auth.keys]]\nkey = \"y-single-key\"\ntenant = \"y\"\ntier = \"{tier}\"\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_on_one_instance_takes_turns_with_another_tenants_backlog_on_two_others() {
    let three = Three::start(1, &x_and_y("default")).await;
    const ROUNDS: usize = 30;
    let starts = one_at_a_time_on_c(&three, "x-backlog-key", "y-single-key", ROUNDS).await;
    println!("Y's one job at a time on C took {} of {ROUNDS} slots against X's backlog on A and B", starts.len());
    // Turn and turn about: Y's next job, waiting from the moment its last one started, goes in
    // the freed slot after the next, one job's length later (of two jobs with one tag, the one
    // that joined first goes first). Instances racing for each freed slot would leave it behind
    // several of X's in a row.
    let longest = starts.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(ROUNDS);
    assert!(starts.first().is_some_and(|&first| first <= 2) && longest <= 2, "Y's jobs started at slots {starts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_waiting_on_one_instance_is_told_its_place_in_the_one_line_and_goes_when_it_says() {
    let three = Three::start(1, &x_and_y("default")).await;
    let x = three.agent(0, "x-backlog-key").await;
    for i in 0..6 {
        Three::image(&x, &format!("x {i}")).await;
    }
    let y = three.agent(2, "y-single-key").await;
    let id = Three::image(&y, "y").await;
    // Behind X's first waiting job (on A), which has the same tag and joined first: second.
    let place = || async {
        let status = call(&y, "rate_limit_status", json!({})).await;
        structured(&status)["jobs_in_flight"][0]["queue_position"].as_u64()
    };
    eventually("C heard from the line where Y's job stands", || async { place().await == Some(2) }).await;
    for slot in 1..=2 {
        three.step(1_000).await;
        eventually("the freed slot was taken again", || async { three.submitted().await.len() > slot }).await;
    }
    let submitted = three.submitted().await;
    assert_eq!(submitted.iter().position(|s| *s == id), Some(2), "Y's went in the second slot freed: {submitted:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_waiting_in_the_line_when_redis_dies_all_end_served_locally_and_the_line_is_used_again_when_it_is_back() {
    let mut three = Three::start(1, &x_and_y("default")).await;
    let x = three.agent(0, "x-backlog-key").await;
    let y = three.agent(2, "y-single-key").await;
    let mut ids = Vec::new();
    for i in 0..4 {
        ids.push(Three::image(&x, &format!("x {i}")).await);
    }
    for i in 0..2 {
        ids.push(Three::image(&y, &format!("y {i}")).await);
    }
    settle().await;
    three.redis.kill();
    // Each instance serves its own waiting jobs by its own round robin: none is stranded.
    for _ in 0..12 {
        three.step(1_000).await;
        // (The first was submitted at once, under a key of its own.)
        let submitted = three.submitted().await;
        if ids[1..].iter().all(|id| submitted.contains(id)) {
            break;
        }
    }
    let submitted = three.submitted().await;
    assert!(ids[1..].iter().all(|id| submitted.contains(id)), "every waiting job was submitted: {submitted:?}");
    for i in [0, 2] {
        let metrics = three.servers[i].metrics().await;
        assert!(
            metric_sum(&metrics, "mcp_ratelimit_store_errors_total{layer=\"account\"}") >= 1.0,
            "counted: {metrics}"
        );
    }
    three.redis.restart();
    for _ in 0..3 {
        three.step(1_000).await;
    }
    for (agent, id) in ids.iter().enumerate().map(|(i, id)| (if i < 4 { &x } else { &y }, id)) {
        let r = call(agent, "get_prediction", json!({ "predict_id": id })).await;
        assert_eq!(structured(&r)["status"], "succeeded", "{id}: {}", text(&r));
    }
    // Back: new waiting jobs stand in the one line again.
    for i in 0..3 {
        Three::image(&x, &format!("after {i}")).await;
    }
    let connection = redis::Client::open(three.redis.url.as_str())
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("redis");
    eventually("the waiting jobs joined the line again", || async {
        three.step(100).await;
        let waiting: u64 =
            redis::cmd("ZCARD").arg("{upstream}line").query_async(&mut connection.clone()).await.unwrap_or(0);
        waiting >= 1
    })
    .await;
}

/// What is left of `agent`'s budget `scope`, as it is told.
async fn left(agent: &Client, scope: &str) -> u64 {
    let status = call(agent, "rate_limit_status", json!({})).await;
    let budgets = structured(&status)["budgets"].as_array().expect("budgets").clone();
    let budget = budgets.iter().find(|b| b["scope"] == scope).unwrap_or_else(|| panic!("no {scope}: {budgets:?}"));
    budget["remaining"].as_u64().expect("remaining")
}

/// What is left of tenant x's budget, as `agent` (one of x's) is told.
async fn tenant_left(agent: &Client) -> u64 {
    left(agent, "tenant:x").await
}

/// The members of the sorted set `key` in the test's Redis, lowest score first.
async fn sorted_set(connection: &redis::aio::MultiplexedConnection, key: &str) -> Vec<String> {
    redis::cmd("ZRANGE").arg(key).arg(0).arg(-1).query_async(&mut connection.clone()).await.expect("zrange")
}

/// Marks of being alive in the shared line (an instance's, or `~` and its name: its grace) made
/// to have run out long ago, as they would after their time in real time.
async fn run_out(connection: &redis::aio::MultiplexedConnection, marks: &[String]) {
    for mark in marks {
        let zadd = redis::cmd("ZADD").arg("{upstream}line:alive").arg(1).arg(mark).to_owned();
        let _: () = zadd.query_async(&mut connection.clone()).await.expect("zadd");
    }
}

/// The instance whose job is the line's `member` made to look dead: its mark of being alive, and
/// the grace the next claim would give it, run out.
async fn taken_for_dead(connection: &redis::aio::MultiplexedConnection, member: &str) {
    let instance = member.split('\u{1f}').nth(1).expect("the instance in the member");
    run_out(connection, &[instance.to_owned(), format!("~{instance}")]).await;
}

/// X's agent on A with one job running (the account's one slot) and one waiting in the line
/// behind it: the agent, the waiting job's id, what is left of tenant x's budget (it never refills
/// here) once both were charged, and a connection to the test's Redis.
async fn a_job_waiting_on_a(three: &Three) -> (Client, String, u64, redis::aio::MultiplexedConnection) {
    let x = three.agent(0, "x-backlog-key").await;
    Three::image(&x, "x running").await;
    let waiting = Three::image(&x, "x waiting").await;
    let charged_both = tenant_left(&x).await;
    let connection = redis::Client::open(three.redis.url.as_str())
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("redis");
    eventually("A's waiting job joined the line", || async {
        sorted_set(&connection, "{upstream}line").await.len() == 1
    })
    .await;
    (x, waiting, charged_both, connection)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_another_instance_ended_for_an_instance_taken_for_dead_is_never_submitted() {
    // A daily spend cap: a window, where a price given back twice would show (a bucket never
    // takes back more than the charge left out).
    let three = Three::start(1, &format!("{}[spend_caps]\ndaily_units = 500\n", x_and_y("default"))).await;
    let (x, waiting, charged_both, connection) = a_job_waiting_on_a(&three).await;
    let spent_both = left(&x, "spend:tenant:x").await;
    // A looks dead for a moment (cut off from Redis, say): its mark of being alive runs out, and
    // the grace the next claim would give it too.
    taken_for_dead(&connection, &sorted_set(&connection, "{upstream}line").await[0]).await;
    // C's next claim takes A's job out of the line and ends it for its agent.
    let y = three.agent(2, "y-single-key").await;
    let after = Three::image(&y, "y").await;
    let x_on_c = three.agent(2, "x-backlog-key").await;
    eventually("A's waiting job was published failed", || async {
        let r = call(&x_on_c, "get_prediction", json!({ "predict_id": waiting })).await;
        structured(&r)["status"] == "failed"
    })
    .await;
    // Nothing ran: C gave its price back, from what A published of its reservation.
    let price = {
        let r = call(&x_on_c, "get_prediction", json!({ "predict_id": waiting })).await;
        assert_eq!(structured(&r)["charged"], 0, "{}", text(&r));
        structured(&r)["reserved"].as_u64().expect("its reservation")
    };
    eventually("the price was given back", || async { tenant_left(&x_on_c).await == charged_both + price }).await;
    assert_eq!(left(&x_on_c, "spend:tenant:x").await, spent_both + price);
    // A is alive after all: its running job ends, and the job it still holds is never sent.
    for slot in 1..=2 {
        three.step(1_000).await;
        eventually("the freed slot was taken again", || async {
            three.submitted().await.len() > slot || three.submitted().await.contains(&after)
        })
        .await;
    }
    let submitted = three.submitted().await;
    assert!(!submitted.contains(&waiting), "the ended job was never submitted: {submitted:?}");
    assert!(submitted.contains(&after), "the slot went on to C's job: {submitted:?}");
    let r = call(&x, "get_prediction", json!({ "predict_id": waiting })).await;
    assert_eq!(structured(&r)["status"], "failed", "A says so too once its turn came: {}", text(&r));
    // A settles nothing again: given back once, not twice.
    three.step(1_000).await;
    assert_eq!(tenant_left(&x).await, charged_both + price, "given back once");
    assert_eq!(left(&x, "spend:tenant:x").await, spent_both + price, "given back once, in the day's window too");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_waiting_on_an_instance_whose_mark_ran_out_while_redis_was_away_is_not_taken_for_dead() {
    // The soak's failure: Redis away longer than a mark of being alive lasts (5 s) left every mark
    // run out at once; the first claim after its return took A's waiting jobs for a dead
    // instance's, ended them and gave their price back, while A, alive, had sent them upstream
    // (billed, and charged by nobody). Now the claim that notices gives A a grace to say so.
    let three = Three::start(1, &x_and_y("default")).await;
    let (x, waiting, charged_both, connection) = a_job_waiting_on_a(&three).await;
    // Every instance's mark runs out, as while Redis was away for longer than one lasts.
    run_out(&connection, &sorted_set(&connection, "{upstream}line:alive").await).await;
    // C's claim comes first after the return: A's job stays in line, not ended, nothing given back.
    let y = three.agent(2, "y-single-key").await;
    let after = Three::image(&y, "y").await;
    let x_on_c = three.agent(2, "x-backlog-key").await;
    for _ in 0..3 {
        three.step(100).await;
        let r = call(&x_on_c, "get_prediction", json!({ "predict_id": waiting })).await;
        assert_ne!(structured(&r)["status"], "failed", "taken for dead: {}", text(&r));
    }
    assert_eq!(tenant_left(&x_on_c).await, charged_both, "nothing given back");
    // The slot freed goes on down the line: A's job, waiting first, then C's.
    for slot in 1..=2 {
        three.step(1_000).await;
        eventually("the freed slot was taken again", || async { three.submitted().await.len() > slot }).await;
    }
    let submitted = three.submitted().await;
    assert!(submitted.contains(&waiting), "A's job went upstream: {submitted:?}");
    let r = call(&x, "get_prediction", json!({ "predict_id": waiting })).await;
    assert_ne!(structured(&r)["status"], "failed", "{}", text(&r));
    let _ = after;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_higher_rank_on_one_instance_takes_every_freed_slot_before_a_lower_ranks_backlog_on_two_others() {
    // Y is a guest (half X's weight), ranked above X's default tier: when the account is full,
    // Y goes first.
    let three = Three::start(1, &format!("[upstream.priority]\nguest = 1\n{}", x_and_y("guest"))).await;
    const ROUNDS: usize = 12;
    let starts = one_at_a_time_on_c(&three, "x-backlog-key", "y-single-key", ROUNDS).await;
    assert_eq!(starts, (1..=ROUNDS).collect::<Vec<_>>(), "Y's one waiting job took every freed slot");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn free_tier_callers_flooding_two_instances_never_delay_a_pro_callers_job_on_a_third_past_one_job_length() {
    let keys = "[tiers]\npro = 1.0\n[upstream.reserved]\npro = 0.5\n\
                [[auth.keys]]\nkey = \"free-flood-key\"\ntenant = \"f\"\n\
                [[auth.keys]]\nkey = \"pro-caller-key\"\ntenant = \"p\"\ntier = \"pro\"\n";
    let three = Three::start(4, keys).await;
    let free = [three.agent(0, "free-flood-key").await, three.agent(1, "free-flood-key").await];
    for i in 0..30 {
        Three::image(&free[i % 2], &format!("free {i}")).await;
    }
    let agent = three.agent(2, "pro-caller-key").await;
    let pro = [Three::image(&agent, "pro 0").await, Three::image(&agent, "pro 1").await];
    settle().await;
    assert_eq!(three.submitted().await.len(), 4, "the free tier holds every slot, lent");
    for _ in 0..11 {
        three.step(100).await;
    }
    eventually("the freed slots were taken again", || async { three.submitted().await.len() >= 8 }).await;
    let next: Vec<String> = three.submitted().await[4..8].to_vec();
    assert!(pro.iter().all(|p| next.contains(p)), "pro's two jobs took two of the first slots freed: {next:?}");
}

/// Three tenants, one on each of three instances, each with ten one-second images: the account
/// of 4 runs at its capacity while work waits, whichever instance frees a slot and whichever
/// holds the next job (each hears from Redis the moment a slot frees anywhere), never over 4.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_keep_an_account_of_four_busy_while_work_waits_and_never_over_four() {
    let redis = TestRedis::private();
    let (mock_clock, mock) = shared_mock_running(1_000).await;
    let keys: String = ["x", "y", "z"]
        .iter()
        .map(|t| format!("[[auth.keys]]\nkey = \"{t}-busy-account-key\"\ntenant = \"{t}\"\n"))
        .collect();
    let config = format!(
        "[store]\nbackend = \"redis\"\nredis_url = \"{}\"\ntimeout_ms = 200\n\
         [upstream]\nurl = \"{}\"\nmax_in_flight = 4\nimage_poll_seconds = 1\nqueue_max = 100\n\
         [limits.caller]\nburst = 1000\n[limits.tenant]\nburst = 1000\n\
         [limits.in_flight]\ncaller = 100\ntenant = 100\n[loop_detection]\nenabled = false\n{keys}",
        redis.url, mock.url
    );
    let servers =
        [TestServer::start(&config).await, TestServer::start(&config).await, TestServer::start(&config).await];
    for (server, tenant) in servers.iter().zip(["x", "y", "z"]) {
        let client = server.client(Some(&format!("{tenant}-busy-account-key"))).await;
        for i in 0..10 {
            let r = call(&client, "generate_image", json!({"prompt": format!("{tenant} {i}")})).await;
            assert!(!is_error(&r), "{}", text(&r));
        }
    }
    let waiting = || servers.iter().map(|s| s.app.state().behind.occupancy().waiting).sum::<usize>();
    let created = || async {
        let usage: Value =
            reqwest::get(format!("{}/v1/usage", mock.url)).await.expect("usage").json().await.expect("json");
        usage["predictions_created"].as_u64().expect("count")
    };
    let mut connection =
        redis::Client::open(redis.url.as_str()).expect("url").get_multiplexed_async_connection().await.expect("redis");
    // The slots every instance holds: the live leases' units on the account's key (concurrency.lua).
    let held_script = redis::Script::new(
        "local t = redis.call('TIME') local now = t[1] * 1000000 + t[2] \
         local f = {} for w in string.gmatch(redis.call('GET', KEYS[1]) or '', '%S+') do f[#f + 1] = w end \
         local units = 0 for i = 2, #f, 3 do if tonumber(f[i + 2]) > now then units = units + f[i + 1] end end \
         return units",
    );
    let mut held = async || -> usize {
        held_script.key("{upstream}account:in_flight").invoke_async(&mut connection).await.expect("reads Redis")
    };
    // Every 100 ms of the clocks, once what it set off has settled (the jobs it ended polled, and
    // their slots taken again, or nobody waiting): the slots held in Redis while work waits.
    let (mut busy, mut steps, mut most) = (0usize, 0usize, 0usize);
    for step in 1..=60 {
        // The mock first: a poll the servers' step sets off finds the job as long done as it is.
        mock_clock.advance(Duration::from_millis(100));
        for server in &servers {
            server.advance_ms(100);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        let started = Instant::now();
        let mut now_held = held().await;
        while now_held < 4 && waiting() > 0 && started.elapsed() < Duration::from_millis(500) {
            tokio::time::sleep(Duration::from_millis(2)).await;
            now_held = held().await;
        }
        most = most.max(now_held);
        if waiting() > 0 && step < 60 {
            busy += now_held;
            steps += 1;
        }
    }
    let in_six_seconds = created().await;
    let used = busy as f64 / (4 * steps.max(1)) as f64;
    println!(
        "three instances, an account of 4, one-second jobs: {in_six_seconds} started in 6 s, {:.1} % of the slots held while work waited",
        100.0 * used
    );
    assert!(most <= 4, "never over the account's 4: {most}");
    assert!(used >= 0.95, "{:.1} % of the account used while work waited", 100.0 * used);
    assert!(in_six_seconds >= 24, "4 slots × 6 one-second rounds: {in_six_seconds}");
}
