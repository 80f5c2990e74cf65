//! A job's end heard across instances on one Redis, through MCP clients: a webhook that lands on
//! an instance that does not hold the job ends it on the one that does, at once, and the job
//! waiting there goes; and what was learnt of job lengths outlives a restart.

use std::time::Duration;

use crate::common::*;
use crate::test_redis::TestRedis;
use serde_json::{Value, json};

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

/// Redis as the store, the mock at `mock`, an account of one slot, webhooks to `webhooks_to`
/// (`{addr}`: the instance itself), room for every job.
fn config(redis: &TestRedis, mock: &str, webhooks_to: &str) -> String {
    format!(
        "[store]\nbackend = \"redis\"\nredis_url = \"{}\"\ntimeout_ms = 200\n\
         [upstream]\nurl = \"{mock}\"\nmax_in_flight = 1\n\
         webhook_url = \"http://{webhooks_to}/webhooks/upstream\"\nwebhook_secret = \"{SECRET}\"\n\
         [limits.caller]\nburst = 1000\nrefill_per_sec = 0.001\n[loop_detection]\nenabled = false\n{ROOMY_IN_FLIGHT}\n\
         [[auth.keys]]\nkey = \"agent-on-b\"\ntenant = \"acme\"\n",
        redis.url
    )
}

async fn image(client: &Client, prompt: &str) -> String {
    let r = call(client, "generate_image", json!({ "prompt": prompt })).await;
    assert!(!is_error(&r), "{}", text(&r));
    structured(&r)["predict_id"].as_str().expect("an id").to_owned()
}

async fn mock_usage(mock: &str) -> Value {
    reqwest::get(format!("{mock}/v1/usage")).await.expect("usage").json().await.expect("json")
}

#[tokio::test]
async fn a_webhook_landing_on_another_instance_ends_the_job_where_it_runs_and_the_next_goes() {
    let redis = TestRedis::private();
    let (mock_clock, mock) = shared_mock_signing(1_000, SECRET).await;
    let a = TestServer::start(&config(&redis, &mock.url, "{addr}")).await;
    let b = TestServer::start(&config(&redis, &mock.url, &a.addr.to_string())).await;
    let on_b = b.client(Some("agent-on-b")).await;
    let first = image(&on_b, "a fox").await;
    let second = image(&on_b, "an owl").await;
    assert_eq!(mock_usage(&mock.url).await["predictions_created"], 1, "one slot: the owl waits on b");
    // The fox ends at 1 s on the mock's clock; its webhook goes to a, which holds no job. The
    // servers' clocks stay at 0: no poll can happen.
    mock_clock.advance(Duration::from_millis(1_000));
    eventually("b submits the owl, told by a through Redis", || async {
        mock_usage(&mock.url).await["predictions_created"] == 2
    })
    .await;
    assert_eq!(mock_usage(&mock.url).await["polls"], 0, "no poll of the paid API was needed");
    let fox = structured(&call(&on_b, "get_prediction", json!({ "predict_id": first })).await).clone();
    assert_eq!(fox["status"], "succeeded", "{fox}");
    // b settled it and published its own final snapshot over a's: another instance reads the charge.
    let on_a = a.client(Some("agent-on-b")).await;
    eventually("a reads the fox as b settled it", || async {
        let there = call(&on_a, "get_prediction", json!({ "predict_id": first })).await;
        structured(&there)["charged"] == 5
    })
    .await;
    let owl = structured(&call(&on_b, "get_prediction", json!({ "predict_id": second })).await).clone();
    assert_eq!(owl["status"], "starting", "{owl}");
    let metrics = a.metrics().await;
    assert_eq!(metric_sum(&metrics, "mcp_ratelimit_upstream_webhooks_total{outcome=\"taken\"}"), 1.0);
}

#[tokio::test]
async fn a_restarted_instance_polls_at_the_job_length_the_instances_learnt() {
    let redis = TestRedis::private();
    let (mock_clock, mock) = shared_mock_running(5_000).await;
    let no_webhooks = |redis: &TestRedis| {
        format!(
            "[store]\nbackend = \"redis\"\nredis_url = \"{}\"\ntimeout_ms = 200\n[upstream]\nurl = \"{}\"\n\
             [limits.caller]\nburst = 1000\nrefill_per_sec = 0.001\n[loop_detection]\nenabled = false\n",
            redis.url, mock.url
        )
    };
    let first = TestServer::start(&no_webhooks(&redis)).await;
    let agent = first.client(Some("learner")).await;
    let id = image(&agent, "a slow fox").await;
    // Polled at the 2 s hint (nothing learnt yet): running at 2 and 4 s, final at 6 s.
    for polls in 1..=3 {
        mock_clock.advance(Duration::from_millis(2_000));
        first.advance_ms(2_000);
        eventually("a poll at the hint", || async { mock_usage(&mock.url).await["polls"] == polls }).await;
    }
    eventually("the fox is polled final", || async {
        let r = call(&agent, "get_prediction", json!({ "predict_id": id })).await;
        structured(&r)["status"] == "succeeded"
    })
    .await;
    first.app.stop();
    let mut redis_client = redis::Client::open(redis.url.as_str()).expect("a client");
    eventually("what was learnt is kept in Redis", || {
        let kept: Option<String> =
            redis::cmd("GET").arg("{upstream}job:durations").query(&mut redis_client).ok().flatten();
        std::future::ready(kept.is_some_and(|k| k.contains("5000")))
    })
    .await;
    let second = TestServer::start(&no_webhooks(&redis)).await;
    let agent = second.client(Some("learner")).await;
    let id = image(&agent, "another fox").await;
    eventually("the new instance starts from what was learnt", || async {
        let r = call(&agent, "get_prediction", json!({ "predict_id": id })).await;
        structured(&r)["next_poll_in_seconds"] == 5
    })
    .await;
}
