//! The mock paid API's webhooks, against a receiver of the test's own on loopback that checks
//! each one's Standard Webhooks signature: sent once a job is final on the mock's manual clock
//! (or canceled), signed, retried on the mock's clock with the same id, and not sent when the
//! mock has no secret, the submission asks for none, or chaos holds them back.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use mcp_ratelimit::clock::ManualClock;
use mcp_ratelimit::config::{Config, MockUpstreamConfig};
use mcp_ratelimit::mock_upstream::{IMAGE_PRICE, MockUpstream};
use mcp_ratelimit::redact::Secret;
use mcp_ratelimit::webhook::WebhookKey;
use serde_json::{Value, json};
use tokio::net::TcpListener;

use crate::common::{eventually, settle};

/// The Standard Webhooks reference libraries' example secret.
const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
/// How long the mock's image jobs run here.
const JOB_MS: u64 = 6_000;

/// One webhook as the receiver got it.
#[derive(Debug, Clone)]
struct Got {
    webhook_id: String,
    /// Whether `WebhookKey::verify` took it (signature and timestamp).
    verified: bool,
    content_type: String,
    body: Value,
}

/// A webhook receiver: answers the statuses queued in `answers` in turn, then 200.
struct Receiver {
    key: WebhookKey,
    answers: Mutex<VecDeque<u16>>,
    got: Mutex<Vec<Got>>,
    url: String,
}

impl Receiver {
    async fn start(answers: &[u16]) -> Arc<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}/hook", listener.local_addr().expect("addr"));
        let receiver = Arc::new(Self {
            key: WebhookKey::parse(SECRET).expect("a secret"),
            answers: Mutex::new(answers.iter().copied().collect()),
            got: Mutex::new(Vec::new()),
            url,
        });
        let app = axum::Router::new().route("/hook", axum::routing::post(take)).with_state(receiver.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        receiver
    }

    fn got(&self) -> Vec<Got> {
        self.got.lock().expect("not poisoned").clone()
    }

    async fn wait_for(&self, count: usize) -> Vec<Got> {
        eventually(&format!("{count} webhooks received"), || async { self.got().len() >= count }).await;
        self.got()
    }
}

async fn take(State(receiver): State<Arc<Receiver>>, headers: HeaderMap, body: Bytes) -> StatusCode {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("after 1970").as_secs();
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    receiver.got.lock().expect("not poisoned").push(Got {
        webhook_id: header("webhook-id"),
        verified: receiver.key.verify(&headers, &body, now).is_ok(),
        content_type: header("content-type"),
        body: serde_json::from_slice(&body).unwrap_or(Value::Null),
    });
    let status = receiver.answers.lock().expect("not poisoned").pop_front().unwrap_or(200);
    StatusCode::from_u16(status).expect("a status")
}

/// A mock on a manual clock of its own, signing with `secret` (empty: it sends no webhooks).
async fn mock(secret: &str) -> (Arc<ManualClock>, MockUpstream) {
    let defaults = Config::defaults(&mcp_ratelimit::mcp::tools::catalogue()).expect("defaults");
    let deadlines = mcp_ratelimit::http::serve::Deadlines::of(&defaults.server);
    let config =
        MockUpstreamConfig { image_job_ms: JOB_MS, webhook_secret: Secret::new(secret), ..defaults.mock_upstream };
    let clock = ManualClock::new();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let mock = MockUpstream::start(config, deadlines, clock.clone(), listener).await.expect("mock");
    (clock, mock)
}

/// Submits an image job with `extra` fields in its body; its id.
async fn submit(mock: &MockUpstream, extra: Value) -> String {
    let mut body = json!({"kind": "image", "prompt": "a lighthouse"});
    body.as_object_mut().expect("an object").extend(extra.as_object().expect("an object").clone());
    let r = reqwest::Client::new().post(format!("{}/v1/predictions", mock.url)).json(&body).send().await.expect("sent");
    assert_eq!(r.status(), 201, "submission taken");
    r.json::<Value>().await.expect("json")["id"].as_str().expect("an id").to_owned()
}

async fn get(mock: &MockUpstream, path: &str) -> Value {
    reqwest::get(format!("{}{path}", mock.url)).await.expect("answered").json().await.expect("json")
}

/// `GET /v1/webhooks`' attempts.
async fn attempts(mock: &MockUpstream) -> Vec<Value> {
    get(mock, "/v1/webhooks").await["webhooks"].as_array().expect("a list").clone()
}

fn ms(clock: &ManualClock, ms: u64) {
    clock.advance(std::time::Duration::from_millis(ms));
}

#[tokio::test]
async fn a_job_that_asks_for_a_webhook_gets_its_final_prediction_posted_once_signed_at_its_end() {
    let (clock, mock) = mock(SECRET).await;
    let receiver = Receiver::start(&[]).await;
    let id = submit(&mock, json!({"webhook": receiver.url, "webhook_events_filter": ["completed"]})).await;
    ms(&clock, JOB_MS - 1);
    settle().await;
    assert!(receiver.got().is_empty(), "nothing before the job's end");

    ms(&clock, 1);
    let got = receiver.wait_for(1).await;
    let polled = get(&mock, &format!("/v1/predictions/{id}")).await;
    let webhook = &got[0];
    assert!(webhook.verified, "signed with the mock's secret, timestamp now");
    assert!(webhook.webhook_id.starts_with("msg_"), "{}", webhook.webhook_id);
    assert_eq!(webhook.content_type, "application/json");
    assert_eq!(webhook.body["id"], id.as_str());
    assert_eq!(webhook.body["status"], "succeeded");
    assert_eq!(webhook.body["usage"]["units"], IMAGE_PRICE);
    assert_eq!(webhook.body["metrics"]["predict_time"], JOB_MS as f64 / 1000.0);
    assert_eq!(webhook.body, polled, "the prediction a poll gives now");

    ms(&clock, 60_000);
    settle().await;
    assert_eq!(receiver.got().len(), 1, "sent once");
    let usage = get(&mock, "/v1/usage").await;
    assert_eq!((usage["webhooks_sent"].as_u64(), usage["webhooks_failed"].as_u64()), (Some(1), Some(0)));
    let log = attempts(&mock).await;
    assert_eq!(log.len(), 1);
    assert_eq!(log[0]["prediction_id"], id.as_str());
    assert_eq!(log[0]["webhook_id"], webhook.webhook_id.as_str());
    assert_eq!(log[0]["url"], receiver.url.as_str());
    assert_eq!((log[0]["attempt"].as_u64(), log[0]["status"].as_u64()), (Some(1), Some(200)));
    assert_eq!(log[0]["at_ns"].as_u64(), Some(JOB_MS * 1_000_000));
}

#[tokio::test]
async fn a_receiver_answering_500_twice_gets_the_same_message_again_after_1_s_then_2_s() {
    let (clock, mock) = mock(SECRET).await;
    let receiver = Receiver::start(&[500, 500]).await;
    submit(&mock, json!({"webhook": receiver.url})).await;
    ms(&clock, JOB_MS);
    receiver.wait_for(1).await;

    ms(&clock, 999);
    settle().await;
    assert_eq!(receiver.got().len(), 1, "no retry before 1 s");
    ms(&clock, 1);
    receiver.wait_for(2).await;
    ms(&clock, 1_999);
    settle().await;
    assert_eq!(receiver.got().len(), 2, "no retry before 2 more s");
    ms(&clock, 1);
    let got = receiver.wait_for(3).await;

    assert!(got.iter().all(|g| g.verified), "each attempt signed anew");
    assert!(got.iter().all(|g| g.webhook_id == got[0].webhook_id), "one message, one id: {got:?}");
    ms(&clock, 60_000);
    settle().await;
    assert_eq!(receiver.got().len(), 3, "answered 200 the third time: no more");
    let log = attempts(&mock).await;
    let seen: Vec<(u64, u64, u64)> = log
        .iter()
        .map(|a| {
            (a["attempt"].as_u64().expect("n"), a["status"].as_u64().expect("status"), a["at_ns"].as_u64().expect("at"))
        })
        .collect();
    let end = JOB_MS * 1_000_000;
    assert_eq!(seen, [(1, 500, end), (2, 500, end + 1_000_000_000), (3, 200, end + 3_000_000_000)]);
    let usage = get(&mock, "/v1/usage").await;
    let counts = ["webhooks_sent", "webhooks_failed", "webhooks_given_up"].map(|k| usage[k].as_u64());
    assert_eq!(counts, [Some(1), Some(2), Some(0)]);
}

#[tokio::test]
async fn a_receiver_that_never_answers_gets_six_attempts_over_31_s_then_is_given_up() {
    let (clock, mock) = mock(SECRET).await;
    // A port nobody listens on any more: every attempt's connection is refused.
    let closed = TcpListener::bind("127.0.0.1:0").await.expect("bind").local_addr().expect("addr");
    submit(&mock, json!({"webhook": format!("http://{closed}/hook")})).await;
    ms(&clock, JOB_MS);
    for (waited, count) in [(0, 1), (1_000, 2), (2_000, 3), (4_000, 4), (8_000, 5), (16_000, 6)] {
        ms(&clock, waited);
        eventually(&format!("attempt {count}"), || async { attempts(&mock).await.len() == count }).await;
    }
    eventually("given up", || async { get(&mock, "/v1/usage").await["webhooks_given_up"] == 1 }).await;
    ms(&clock, 600_000);
    settle().await;
    let log = attempts(&mock).await;
    assert_eq!(log.len(), 6, "six attempts in all");
    assert!(log.iter().all(|a| a["status"].is_null()), "no answer: status null");
    assert_eq!(get(&mock, "/v1/usage").await["webhooks_failed"], 6);
}

#[tokio::test]
async fn a_canceled_job_sends_one_webhook_at_its_cancel_and_nothing_at_its_planned_end() {
    let (clock, mock) = mock(SECRET).await;
    let receiver = Receiver::start(&[]).await;
    let id = submit(&mock, json!({"webhook": receiver.url})).await;
    ms(&clock, JOB_MS / 2);
    let cancel = reqwest::Client::new().post(format!("{}/v1/predictions/{id}/cancel", mock.url)).send().await;
    assert_eq!(cancel.expect("answered").status(), 200);

    let got = receiver.wait_for(1).await;
    assert!(got[0].verified);
    assert_eq!(got[0].body["status"], "canceled");
    assert_eq!(got[0].body["usage"]["units"], 0);
    ms(&clock, JOB_MS);
    settle().await;
    assert_eq!(receiver.got().len(), 1, "nothing more at the job's planned end");
    assert_eq!(attempts(&mock).await.len(), 1);
}

#[tokio::test]
async fn no_webhook_without_the_mocks_secret() {
    let (clock, mock) = mock("").await;
    let receiver = Receiver::start(&[]).await;
    submit(&mock, json!({"webhook": receiver.url})).await;
    ms(&clock, JOB_MS);
    settle().await;
    assert!(receiver.got().is_empty());
    assert!(attempts(&mock).await.is_empty());
}

#[tokio::test]
async fn only_a_job_that_names_a_webhook_and_the_completed_event_is_reported() {
    let (clock, mock) = mock(SECRET).await;
    let receiver = Receiver::start(&[]).await;
    submit(&mock, json!({})).await;
    submit(&mock, json!({"webhook": receiver.url, "webhook_events_filter": ["start", "output"]})).await;
    let reported =
        submit(&mock, json!({"webhook": receiver.url, "webhook_events_filter": ["logs", "completed"]})).await;
    ms(&clock, JOB_MS);
    receiver.wait_for(1).await;
    settle().await;
    let got = receiver.got();
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].body["id"], reported.as_str());
}

#[tokio::test]
async fn a_failed_job_is_reported_and_an_idempotent_resubmission_starts_no_second_sender() {
    let (clock, mock) = mock(SECRET).await;
    let receiver = Receiver::start(&[]).await;
    let submit_keyed = || async {
        let body = json!({"kind": "image", "prompt": "a lighthouse [fail]", "webhook": receiver.url});
        let r = reqwest::Client::new().post(format!("{}/v1/predictions", mock.url)).header("idempotency-key", "k_1");
        let answer: Value = r.json(&body).send().await.expect("sent").json().await.expect("json");
        answer["id"].as_str().expect("an id").to_owned()
    };
    let id = submit_keyed().await;
    assert_eq!(submit_keyed().await, id, "the same job");
    ms(&clock, JOB_MS);
    receiver.wait_for(1).await;
    settle().await;
    let got = receiver.got();
    assert_eq!(got.len(), 1, "one sender for the job: {got:?}");
    assert_eq!(got[0].body["status"], "failed");
    assert!(got[0].body["error"].is_string());
}

#[tokio::test]
async fn chaos_webhooks_false_ends_jobs_without_a_webhook_until_true_again() {
    let (clock, mock) = mock(SECRET).await;
    let receiver = Receiver::start(&[]).await;
    let chaos = |on: bool| {
        let url = format!("{}/v1/chaos", mock.url);
        async move { reqwest::Client::new().put(url).json(&json!({"webhooks": on})).send().await.expect("sent") }
    };
    let answer: Value = chaos(false).await.json().await.expect("json");
    assert_eq!(answer["webhooks"], false, "the chaos answer shows it");
    let lost = submit(&mock, json!({"webhook": receiver.url})).await;
    ms(&clock, JOB_MS);
    eventually("the webhook withheld", || async { get(&mock, "/v1/usage").await["webhooks_withheld"] == 1 }).await;
    settle().await;
    assert!(receiver.got().is_empty(), "no webhook left");
    assert_eq!(get(&mock, &format!("/v1/predictions/{lost}")).await["status"], "succeeded", "the job ended");

    assert_eq!(chaos(true).await.json::<Value>().await.expect("json")["webhooks"], true);
    let sent = submit(&mock, json!({"webhook": receiver.url})).await;
    ms(&clock, JOB_MS);
    let got = receiver.wait_for(1).await;
    assert_eq!(got[0].body["id"], sent.as_str());
    assert!(attempts(&mock).await.iter().all(|a| a["prediction_id"] == sent.as_str()));
}

#[tokio::test]
async fn a_webhook_that_is_not_an_http_url_is_refused_at_submission() {
    let (_clock, mock) = mock(SECRET).await;
    for webhook in ["file:///etc/passwd".to_owned(), "not a url".to_owned(), format!("http://h/{}", "a".repeat(2048))] {
        let body = json!({"kind": "image", "prompt": "x", "webhook": webhook});
        let r = reqwest::Client::new().post(format!("{}/v1/predictions", mock.url)).json(&body).send().await;
        assert_eq!(r.expect("answered").status(), 422, "{webhook:.40}");
    }
}
