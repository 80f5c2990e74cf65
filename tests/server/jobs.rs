//! Jobs hold their in-flight slots until they end, through an MCP client: the per-tenant cap
//! shared by a tenant's keys, `busy` naming the jobs, and the slot coming back when a job
//! succeeds (nobody polling it), fails, or is cancelled — with `cancel_prediction` or with
//! MCP Tasks' `tasks/cancel`.

use crate::common::*;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CancelTaskParams, ClientCapabilities, ClientConfig, GetTaskParams,
    Implementation, TaskPayload, TaskStatus,
};
use rmcp::service::RunningService;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::{RoleClient, ServiceExt};
use serde_json::{Value, json};

/// Two keys of tenant acme, one of beta; no loop detection (the tests repeat one prompt).
const ACME: &str = r#"
[loop_detection]
enabled = false

[[auth.keys]]
key = "acme-one"
tenant = "acme"

[[auth.keys]]
key = "acme-two"
tenant = "acme"

[[auth.keys]]
key = "beta-one"
tenant = "beta"
"#;

fn image(prompt: &str) -> Value {
    json!({ "prompt": prompt })
}

async fn slots_left(client: &Client, scope_prefix: &str) -> u64 {
    let status = call(client, "rate_limit_status", json!({})).await;
    budget(&status, scope_prefix)["remaining"].as_u64().expect("remaining")
}

async fn until_slots_left(client: &Client, scope_prefix: &str, want: u64) {
    eventually(&format!("{scope_prefix} has {want} slots free"), || async {
        slots_left(client, scope_prefix).await == want
    })
    .await;
}

#[tokio::test]
async fn six_parallel_images_from_one_tenant_five_run_and_one_is_busy() {
    let server = TestServer::start(ACME).await;
    let one = server.client(Some("acme-one")).await;
    let two = server.client(Some("acme-two")).await;
    let calls = (0..6).map(|i| {
        let client = if i % 2 == 0 { &one } else { &two };
        call(client, "generate_image", image(&format!("fox {i}")))
    });
    let results = futures::future::join_all(calls).await;
    let accepted: Vec<_> = results.iter().filter(|r| !is_error(r)).collect();
    let busy: Vec<_> = results.iter().filter(|r| error_code(r) == Some("busy")).collect();
    assert_eq!((accepted.len(), busy.len()), (5, 1), "two keys of one tenant share its 5 slots");
    assert_eq!(server.upstream_usage().await["predictions_created"], 5, "the refused one never reached the upstream");

    assert_eq!(structured(busy[0])["error"]["scope"], "in_flight:tenant:acme");
    // Asked again once the burst has settled, the refusal names the caller's own jobs.
    let again = call(&one, "generate_image", image("once more")).await;
    let refusal = &again;
    let error = &structured(refusal)["error"];
    assert_eq!(error["scope"], "in_flight:tenant:acme");
    assert_eq!(error["limit"], 5);
    let mine = error["in_flight"].as_array().expect("the caller's jobs are named");
    assert!(!mine.is_empty() && mine.len() < 5, "only the caller's own jobs: {error}");
    assert!(text(refusal).contains("get_prediction"), "{}", text(refusal));
    assert!(text(refusal).contains(mine[0].as_str().expect("id")), "{}", text(refusal));
    assert_eq!(error["retry_after_ms"], 2000, "the first job is worth polling at its hint");

    // Another tenant is unaffected, and a busy refusal charged nothing.
    let beta = server.client(Some("beta-one")).await;
    assert!(!is_error(&call(&beta, "generate_image", image("owl")).await));
    assert_eq!(slots_left(&one, "in_flight:tenant:acme").await, 0);
    let status = call(&one, "rate_limit_status", json!({})).await;
    let jobs = structured(&status)["jobs_in_flight"].as_array().expect("jobs").len();
    assert_eq!(budget(&status, "caller:")["remaining"], 60 - 5 * jobs as u64, "busy calls cost nothing");
}

#[tokio::test]
async fn a_job_nobody_polls_gives_its_slot_back_when_it_ends() {
    let server = TestServer::start(ACME).await;
    let client = server.client(Some("acme-one")).await;
    for i in 0..5 {
        assert!(!is_error(&call(&client, "generate_image", image(&format!("cat {i}"))).await));
    }
    assert_eq!(error_code(&call(&client, "generate_image", image("one more")).await), Some("busy"));
    let status = call(&client, "rate_limit_status", json!({})).await;
    assert_eq!(structured(&status)["jobs_in_flight"].as_array().map(Vec::len), Some(5));

    // Image jobs take 6 s. Nobody calls get_prediction: the server polls by itself.
    server.advance_secs(6.0);
    until_slots_left(&client, "in_flight:tenant:acme", 5).await;
    assert!(server.upstream_usage().await["polls"].as_u64().is_some_and(|n| n >= 5));
    let status = call(&client, "rate_limit_status", json!({})).await;
    assert_eq!(structured(&status)["jobs_in_flight"], json!([]));
    assert!(!is_error(&call(&client, "generate_image", image("room again")).await));
}

/// The mock's counter `name` (`requests` arrive before its gate, `polls` are answered).
async fn upstream_count(server: &TestServer, name: &str) -> u64 {
    server.upstream_usage().await[name].as_u64().expect("a count")
}

#[tokio::test]
async fn a_slow_answer_to_a_poll_does_not_push_the_next_poll_back() {
    let server = TestServer::start(ACME).await;
    let client = server.client(Some("acme-one")).await;
    assert!(!is_error(&call(&client, "generate_image", image("a lighthouse")).await));
    // Its first poll is due at 2 s (`image_poll_seconds`): asked then, and held at the mock's gate
    // while 1.5 s pass.
    server.chaos(json!({"hold": true})).await;
    let arrived = upstream_count(&server, "requests").await;
    server.advance_ms(2_000);
    eventually("the first poll reaches the gate", || async { upstream_count(&server, "requests").await > arrived })
        .await;
    server.advance_ms(1_500);
    server.chaos(json!({"hold": false})).await;
    eventually("the first poll is answered", || async { upstream_count(&server, "polls").await == 1 }).await;
    // The next is due 2 s after the first was asked (at 4 s), not after its answer (5.5 s).
    server.advance_ms(500);
    eventually("the second poll goes at 4 s", || async { upstream_count(&server, "polls").await == 2 }).await;
}

#[tokio::test]
async fn a_failed_job_gives_its_slot_back_and_says_why() {
    let server = TestServer::start(&format!("{ACME}\n[limits.in_flight]\ncaller = 1\ntenant = 1\n")).await;
    let client = server.client(Some("acme-one")).await;
    let r = call(&client, "generate_image", image("draw [fail] please")).await;
    let id = structured(&r)["predict_id"].as_str().expect("id").to_owned();
    assert_eq!(error_code(&call(&client, "generate_image", image("next")).await), Some("busy"));
    server.advance_secs(6.0);
    until_slots_left(&client, "in_flight:caller:", 1).await;
    let r = call(&client, "get_prediction", json!({"predict_id": id})).await;
    assert_eq!(structured(&r)["status"], "failed");
    assert!(structured(&r)["error"].as_str().is_some_and(|e| !e.is_empty()));
    assert!(!is_error(&call(&client, "generate_image", image("next")).await));
}

#[tokio::test]
async fn cancel_prediction_cancels_upstream_and_frees_the_slot_at_once() {
    let server = TestServer::start(&format!("{ACME}\n[limits.in_flight]\ncaller = 1\ntenant = 1\n")).await;
    let client = server.client(Some("acme-one")).await;
    let r = call(&client, "generate_image", image("a slow one")).await;
    let id = structured(&r)["predict_id"].as_str().expect("id").to_owned();
    assert_eq!(error_code(&call(&client, "generate_image", image("next")).await), Some("busy"));

    // Someone else's job is unknown, as for get_prediction.
    let stranger = server.client(Some("beta-one")).await;
    let r = call(&stranger, "cancel_prediction", json!({"predict_id": id})).await;
    assert_eq!(error_code(&r), Some("invalid_arguments"));
    assert_eq!(server.upstream_usage().await["cancels"], 0);

    let r = call(&client, "cancel_prediction", json!({"predict_id": id})).await;
    assert!(!is_error(&r), "{}", text(&r));
    assert_eq!(structured(&r)["status"], "canceled");
    assert_eq!(server.upstream_usage().await["cancels"], 1);
    // No waiting: the slot is free the moment cancel_prediction answers.
    assert_eq!(slots_left(&client, "in_flight:caller:").await, 1);
    assert!(!is_error(&call(&client, "generate_image", image("next")).await));
    let r = call(&client, "get_prediction", json!({"predict_id": id})).await;
    assert_eq!(structured(&r)["status"], "canceled");
}

#[tokio::test]
async fn a_cancelled_video_leaves_the_queue_without_reaching_the_upstream() {
    let server = TestServer::start(&format!("{ACME}\n[upstream]\nvideo_min_gap_ms = 10000\n")).await;
    let client = server.client(Some("acme-one")).await;
    let video = |p: &str| json!({"image_url": "https://example.com/a.png", "prompt": p});
    call(&client, "generate_image_to_video", video("first")).await;
    let queued = call(&client, "generate_image_to_video", video("second")).await;
    assert_eq!(structured(&queued)["queue_position"], 1);
    let id = structured(&queued)["predict_id"].as_str().expect("id").to_owned();
    let r = call(&client, "cancel_prediction", json!({"predict_id": id})).await;
    assert_eq!(structured(&r)["status"], "canceled");
    server.advance_secs(30.0);
    settle().await;
    assert_eq!(server.submissions().await.len(), 1, "the cancelled video was never submitted");
    assert_eq!(server.upstream_usage().await["cancels"], 0, "nothing upstream to cancel");
}

type TasksClient = RunningService<RoleClient, ClientConfig>;

async fn tasks_client(server: &TestServer, token: &str) -> TasksClient {
    let transport = StreamableHttpClientTransport::from_config(
        StreamableHttpClientTransportConfig::with_uri(server.url.clone()).auth_header(token),
    );
    let info =
        ClientConfig::new(ClientCapabilities::builder().enable_tasks().build(), Implementation::new("tasks-test", "1"));
    info.serve(transport).await.expect("client connects")
}

async fn start_task(client: &TasksClient, prompt: &str) -> rmcp::model::Task {
    let params = CallToolRequestParams::new("generate_image")
        .with_arguments(image(prompt).as_object().cloned().expect("object"));
    match client.call_tool_once(params).await.expect("tools/call") {
        CallToolResponse::Task(created) => created.task,
        other => panic!("expected a task, got {other:?}"),
    }
}

#[tokio::test]
async fn an_image_job_runs_to_completion_as_an_mcp_task() {
    let server = TestServer::start(ACME).await;
    let client = tasks_client(&server, "acme-one").await;
    let task = start_task(&client, "a lighthouse").await;
    assert_eq!(task.status, TaskStatus::Working);
    assert_eq!(task.poll_interval_ms, Some(2000), "the poll hint");
    assert!(task.task_id.starts_with("p_"), "the taskId is the predict_id: {}", task.task_id);

    let early = client.peer().get_task(GetTaskParams::new(task.task_id.clone())).await.expect("tasks/get");
    assert_eq!(early.task.status(), TaskStatus::Working);
    server.advance_secs(6.0);
    let mut done = None;
    for _ in 0..200 {
        let got = client.peer().get_task(GetTaskParams::new(task.task_id.clone())).await.expect("tasks/get");
        if got.task.status().is_terminal() {
            done = Some(got.task);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let done = done.expect("the task completed");
    let TaskPayload::Completed { result } = done.payload else { panic!("completed: {:?}", done.payload) };
    assert_eq!(result["structuredContent"]["status"], "succeeded");
    assert!(result["structuredContent"]["output"].as_str().is_some_and(|u| u.contains(&task.task_id)));

    // The same job through the classic tools.
    let plain = server.client(Some("acme-one")).await;
    let r = call(&plain, "get_prediction", json!({"predict_id": task.task_id})).await;
    assert_eq!(structured(&r)["status"], "succeeded");
    // Another caller cannot read it.
    let stranger = tasks_client(&server, "beta-one").await;
    assert!(stranger.peer().get_task(GetTaskParams::new(task.task_id.clone())).await.is_err());
}

#[tokio::test]
async fn tasks_cancel_cancels_the_job_and_frees_its_slot() {
    let server = TestServer::start(&format!("{ACME}\n[limits.in_flight]\ncaller = 1\ntenant = 1\n")).await;
    let client = tasks_client(&server, "acme-one").await;
    let task = start_task(&client, "cancel me").await;
    let plain = server.client(Some("acme-one")).await;
    assert_eq!(error_code(&call(&plain, "generate_image", image("blocked")).await), Some("busy"));

    client.peer().cancel_task(CancelTaskParams::new(task.task_id.clone())).await.expect("tasks/cancel");
    let got = client.peer().get_task(GetTaskParams::new(task.task_id.clone())).await.expect("tasks/get");
    assert_eq!(got.task.status(), TaskStatus::Cancelled);
    assert_eq!(server.upstream_usage().await["cancels"], 1);
    assert!(!is_error(&call(&plain, "generate_image", image("free again")).await), "the slot came back");
}

#[tokio::test]
async fn a_job_final_at_its_submission_gives_its_slot_back_at_once() {
    // An API that answers some submissions already final (a cached render): the job took no time.
    let server = TestServer::start(&format!(
        "{ACME}\n[limits.in_flight]\ncaller = 1\ntenant = 1\n[mock_upstream]\nimage_job_ms = 0\n"
    ))
    .await;
    let client = server.client(Some("acme-one")).await;
    let first = call(&client, "generate_image", image("instant")).await;
    assert!(!is_error(&first), "{}", text(&first));
    assert_eq!(structured(&first)["status"], "succeeded", "{}", text(&first));
    // No clock moved and nobody polled: the slot is free for the next.
    let second = call(&client, "generate_image", image("instant too")).await;
    assert!(!is_error(&second), "the slot came back with the answer: {}", text(&second));
}
