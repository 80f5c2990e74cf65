//! A job's slot comes back when the job ends, through an MCP client: the paid API's signed webhook
//! ends it at once and the next waiting job goes, with no poll; forged, stale, replayed or
//! oversized webhooks change nothing and cost no poll; a lost webhook is caught by the background
//! poll; and without webhooks, polls follow the job lengths learnt.

use crate::common::*;
use mcp_ratelimit::webhook::WebhookKey;
use serde_json::{Value, json};

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

/// An account of one slot, one-second images, webhooks on (to this server), a tenant with room.
fn with_webhooks(extra: &str) -> String {
    format!(
        "[upstream]\nmax_in_flight = 1\nwebhook_url = \"http://{{addr}}/webhooks/upstream\"\nwebhook_secret = \"{SECRET}\"\n\
         [mock_upstream]\nimage_job_ms = 1000\nwebhook_secret = \"{SECRET}\"\n\
         [loop_detection]\nenabled = false\n{ROOMY_IN_FLIGHT}\n\
         [[auth.keys]]\nkey = \"acme-one\"\ntenant = \"acme\"\n{extra}"
    )
}

async fn image(client: &Client, prompt: &str) -> String {
    let r = call(client, "generate_image", json!({ "prompt": prompt })).await;
    assert!(!is_error(&r), "{}", text(&r));
    structured(&r)["predict_id"].as_str().expect("an id").to_owned()
}

async fn status(client: &Client, id: &str) -> Value {
    structured(&call(client, "get_prediction", json!({ "predict_id": id })).await).clone()
}

async fn usage(server: &TestServer, counter: &str) -> u64 {
    server.upstream_usage().await[counter].as_u64().unwrap_or_default()
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("after 1970").as_secs()
}

/// POSTs `body` to the server's webhook route as message `id` sent at `at`, signed `signature`
/// (`None`: signed with `SECRET`); its status.
async fn send(server: &TestServer, query: &str, id: &str, at: u64, body: &str, signature: Option<&str>) -> u16 {
    let key = WebhookKey::parse(SECRET).expect("the secret");
    let signed = signature.map_or_else(|| key.sign(id, at, body.as_bytes()), str::to_owned);
    let mut request = reqwest::Client::new()
        .post(format!("http://{}/webhooks/upstream{query}", server.addr))
        .header("content-type", "application/json")
        .header("webhook-id", id)
        .header("webhook-timestamp", at.to_string());
    if !signed.is_empty() {
        request = request.header("webhook-signature", signed);
    }
    request.body(body.to_owned()).send().await.expect("the route answers").status().as_u16()
}

#[tokio::test]
async fn a_signed_webhook_ends_the_job_at_once_and_the_waiting_job_goes_without_a_poll() {
    let server = TestServer::start(&with_webhooks("")).await;
    let client = server.client(Some("acme-one")).await;
    let first = image(&client, "a fox").await;
    let second = image(&client, "an owl").await;
    assert_eq!(usage(&server, "predictions_created").await, 1, "one slot: the owl waits");
    // The fox ends at 1 s and the mock says so at once: the owl is submitted while the clock
    // still reads 1 s, long before any poll (the first is due at twice the expected end, 4 s).
    server.advance_ms(1_000);
    eventually("the owl is submitted", || async { usage(&server, "predictions_created").await == 2 }).await;
    assert_eq!(usage(&server, "polls").await, 0, "no poll of the paid API was needed");
    let fox = status(&client, &first).await;
    assert_eq!(fox["status"], "succeeded", "{fox}");
    assert_eq!(fox["charged"], 5, "settled from the webhook's usage: {fox}");
    assert_eq!(status(&client, &second).await["status"], "starting");
    let metrics = server.metrics().await;
    assert_eq!(metric_sum(&metrics, "mcp_ratelimit_upstream_webhooks_total{outcome=\"taken\"}"), 1.0);
    // The owl ends at 2 s, by its webhook too; then past the time both safety-net polls were due
    // (the fox's at 4 s, the owl's at 3 s): a job its webhook ended is never polled.
    server.advance_ms(1_000);
    eventually("the owl ends by its webhook", || async { status(&client, &second).await["status"] == "succeeded" })
        .await;
    server.advance_ms(2_500);
    settle().await;
    assert_eq!(usage(&server, "polls").await, 0, "both were final: no poll");
}

#[tokio::test]
async fn forged_stale_replayed_or_oversized_webhooks_are_refused_and_the_job_still_runs() {
    let server = TestServer::start(&with_webhooks("")).await;
    let client = server.client(Some("acme-one")).await;
    let id = image(&client, "a running fox").await;
    let done = json!({"id": id, "kind": "image", "status": "succeeded", "output": "https://x.invalid/f.png",
                      "usage": {"units": 0}})
    .to_string();
    let now = unix_now();
    let wrong = WebhookKey::parse("whsec_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA").expect("a key");
    let forged = wrong.sign("msg_1", now, done.as_bytes());
    assert_eq!(send(&server, "", "msg_0", now, &done, Some("")).await, 401, "unsigned");
    assert_eq!(send(&server, "", "msg_1", now, &done, Some(&forged)).await, 401, "signed with another key");
    assert_eq!(send(&server, "", "msg_2", now - 600, &done, None).await, 400, "ten minutes old");
    assert_eq!(send(&server, "", "msg_3", now + 600, &done, None).await, 400, "ten minutes ahead");
    let elsewhere = done.replace(&id, "p_not_ours");
    assert_eq!(send(&server, "", "msg_4", now, &elsewhere, None).await, 404, "a job we do not know");
    assert_eq!(send(&server, "?job=i_other", "msg_5", now, &done, None).await, 404, "moved to another job's URL");
    let huge = format!("{{\"pad\": \"{}\"}}", "x".repeat(100_000));
    assert_eq!(send(&server, "", "msg_6", now, &huge, None).await, 413, "over the size limit");
    // A genuine webhook that changes nothing (the job runs), then the same message again.
    let running = done.replace("succeeded", "processing");
    assert_eq!(send(&server, "", "msg_7", now, &running, None).await, 200);
    assert_eq!(send(&server, "", "msg_7", now, &running, None).await, 409, "replayed");
    // None of it ended the job, or cost a poll of the paid API.
    assert_eq!(status(&client, &id).await["status"], "starting");
    assert_eq!(usage(&server, "polls").await, 0);
    let metrics = server.metrics().await;
    for (outcome, times) in
        [("bad_signature", 2.0), ("stale", 2.0), ("unknown_job", 2.0), ("too_large", 1.0), ("replayed", 1.0)]
    {
        let series = format!("mcp_ratelimit_upstream_webhooks_total{{outcome=\"{outcome}\"}}");
        assert_eq!(metric_sum(&metrics, &series), times, "{series}");
    }
    // The real end still arrives and is taken.
    server.advance_ms(1_000);
    eventually("the fox ends by its webhook", || async { status(&client, &id).await["status"] == "succeeded" }).await;
}

#[tokio::test]
async fn a_lost_webhook_is_caught_by_the_background_poll_at_twice_the_expected_end() {
    let server = TestServer::start(&with_webhooks("")).await;
    server.chaos(json!({"webhooks": false})).await;
    let client = server.client(Some("acme-one")).await;
    let id = image(&client, "a fox whose webhook is lost").await;
    server.advance_ms(3_900);
    settle().await;
    assert_eq!(status(&client, &id).await["status"], "starting", "no news yet: nothing learnt, first poll at 4 s");
    server.advance_ms(100);
    eventually("the poll finds it final", || async { status(&client, &id).await["status"] == "succeeded" }).await;
    assert_eq!(usage(&server, "polls").await, 1);
}

#[tokio::test]
async fn without_webhooks_polls_follow_the_job_length_learnt_and_agents_are_told_it() {
    let config = format!(
        "[upstream]\nmax_in_flight = 1\n[mock_upstream]\nimage_job_ms = 5000\n[loop_detection]\nenabled = false\n\
         {ROOMY_IN_FLIGHT}\n[[auth.keys]]\nkey = \"acme-one\"\ntenant = \"acme\"\n"
    );
    let server = TestServer::start(&config).await;
    let client = server.client(Some("acme-one")).await;
    let first = image(&client, "one").await;
    assert_eq!(status(&client, &first).await["next_poll_in_seconds"], 2, "nothing learnt: the hint");
    // Polled every 2 s (the hint) while nothing is learnt: running at 2 and 4 s, final at 6 s.
    for polls in 1..=3 {
        server.advance_ms(2_000);
        eventually("a poll at the hint", || async { usage(&server, "polls").await == polls }).await;
    }
    assert_eq!(status(&client, &first).await["status"], "succeeded");
    // It ran 5 s (the API's predict_time): the next job is expected at 5 s, told so, polled then.
    let second = image(&client, "two").await;
    assert_eq!(status(&client, &second).await["next_poll_in_seconds"], 5, "the length learnt");
    server.advance_ms(4_900);
    settle().await;
    assert_eq!(usage(&server, "polls").await, 3, "not before its expected end");
    server.advance_ms(100);
    eventually("the second is polled once, final", || async {
        status(&client, &second).await["status"] == "succeeded"
    })
    .await;
    assert_eq!(usage(&server, "polls").await, 4, "one poll for the second job");
    let metrics = server.metrics().await;
    assert!(metrics.contains("mcp_ratelimit_upstream_expected_job_seconds{class=\"image\"} 5"), "{metrics}");
}

#[tokio::test]
async fn clients_of_both_eras_see_a_job_their_webhook_ended_succeeded_and_charged() {
    let server = TestServer::start(&with_webhooks("")).await;
    let auth = ["-H", "Authorization: Bearer acme-one"];
    for mode in ["auto", "legacy"] {
        let submit = json!([{"op": "call", "tool": "generate_image", "args": {"prompt": format!("a fox, {mode}")}}]);
        let walked = crate::python::walk(&server.url, mode, submit, &auth).await;
        assert_eq!(walked["protocol_version"], crate::python::era_of(mode), "{walked}");
        assert!(crate::python::all_ok(&walked), "{walked}");
        let id = walked["steps"][0]["ok"]["structured"]["predict_id"].as_str().expect("an id").to_owned();
        let polls = usage(&server, "polls").await;
        server.advance_ms(1_000);
        eventually("its webhook is taken", || async {
            server.upstream_usage().await["webhooks_sent"].as_u64() == Some(if mode == "auto" { 1 } else { 2 })
        })
        .await;
        let read = json!([{"op": "call", "tool": "get_prediction", "args": {"predict_id": id}, "check_schema": true}]);
        let walked = crate::python::walk(&server.url, mode, read, &auth).await;
        assert!(crate::python::all_ok(&walked), "{walked}");
        let job = &walked["steps"][0]["ok"]["structured"];
        assert_eq!((job["status"].as_str(), job["charged"].as_u64()), (Some("succeeded"), Some(5)), "{walked}");
        assert_eq!(usage(&server, "polls").await, polls, "ended by its webhook, not a poll");
    }
}
