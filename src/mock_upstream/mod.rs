//! A stand-in for the paid API: a real HTTP service (axum), embedded or its own process.
//!
//! It behaves like the image APIs agents drive — submit a prediction, poll it by id — and has
//! the knobs needed to show what limits are for: added latency, a share of 429s with
//! Retry-After, a share of 503s, a cap on predictions running at once, and job durations.
//! Job progress and the added latency read the shared [`Clock`](crate::clock::Clock), so tests
//! finish a 30-second video job, or wait out a latency, by advancing a manual clock. A prompt
//! containing `[fail]` makes a job fail.
//!
//! It bills like a real paid API and says so on every answer (`usage.units`, a prediction's once
//! it is final), in the units our `[tools.*] cost` counts: [`LIST_PRICE`], [`SAVE_PRICE`],
//! [`IMAGE_PRICE`], and a video by its length ([`video_price`]); a failed or canceled job is
//! billed nothing. A video longer than `max_video_seconds` is cut to it, and billed for what was
//! rendered: a call priced by what it asked for then settles to less.
//! A submission carrying an `Idempotency-Key` it has seen returns the job it already made.
//!
//! It sends webhooks as Replicate, fal and OpenAI's video API do (`webhooks.rs`): a submission
//! naming a `webhook` URL (and a `webhook_events_filter` that is absent or names `completed`) gets
//! its final prediction, the JSON `GET /v1/predictions/{id}` then answers, POSTed there once the
//! job ends on the mock's clock or is canceled, signed the Standard Webhooks way with
//! `mock_upstream.webhook_secret` (empty: none sent), and retried while not answered 2xx: 6
//! attempts at most, 1, 2, 4, 8 and 16 s apart on the mock's clock. An idempotent resubmission
//! starts no second sender.
//!
//! For tests and experiments (never limited, never subject to chaos):
//! - `GET /v1/usage`: what it was asked to do — the bill an agent ran up — and the webhooks it
//!   sent (`webhooks_sent`: attempts answered 2xx; `webhooks_failed`: attempts not answered 2xx;
//!   `webhooks_given_up`: messages whose 6 attempts all failed; `webhooks_dropped`: jobs past the
//!   10,000 senders it holds, reported by none; `webhooks_withheld`: messages chaos kept back);
//! - `GET /v1/submissions`: every `POST /v1/predictions` it received, with the clock reading
//!   and the status it answered (to prove spacing and backoff), and the W3C `traceparent` and
//!   `tracestate` it carried (to prove which trace reaches the paid API);
//! - `GET /v1/webhooks`: every webhook attempt, oldest first (`prediction_id`, `webhook_id`, `url`,
//!   `attempt` from 1, `status`: the HTTP status or `null` when no answer came, `at_ns`: the
//!   clock reading), to prove what was sent, when, and that a retry kept its id;
//! - `PUT /v1/chaos`: change the chaos knobs while running (`rate_429`, `rate_5xx`,
//!   `retry_after_seconds`, `latency_ms`, `max_concurrent_predictions`), e.g. to take the API down
//!   and bring it back, or to change the account's capacity under a running server;
//!   `hold`: while `true`, every request waits at a gate until it is `false` again, so a test can
//!   keep calls in flight for as long as it needs without waiting on the wall clock; and
//!   `webhooks`: while `false`, jobs end but no webhook leaves (a retry due then is not made), to
//!   show the server's background polls are the safety net for lost webhooks (`true` at start).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::extract::{Path, Query, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use rand::Rng;
use serde::Deserialize;
use serde_json::json;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::clock::{Nanos, SharedClock};
use crate::config::MockUpstreamConfig;
use crate::http::serve::{Deadlines, read_body_by_deadline, serve};
use crate::ops::metrics::ConnectionMetrics;
use crate::upstream::api::{
    Article, ArticlePage, DEFAULT_VIDEO_SECONDS, NewArticle, NewPrediction, Prediction, PredictionKind,
    PredictionMetrics, PredictionStatus, SavedArticle, Usage,
};

/// Units billed for a page of articles.
pub const LIST_PRICE: u64 = 1;
/// Units billed for saving an article.
pub const SAVE_PRICE: u64 = 2;
/// Units billed for an image.
pub const IMAGE_PRICE: u64 = 5;

/// Units billed for a video of `seconds`: 20 with five seconds included, 2 per second beyond.
pub fn video_price(seconds: u32) -> u64 {
    20 + 2 * u64::from(seconds.saturating_sub(5))
}

mod webhooks;

const SEEDED_ARTICLES: usize = 120;
const MAX_ARTICLES: usize = 10_000;
const MAX_JOBS: usize = 100_000;

#[derive(Debug)]
struct Job {
    kind: PredictionKind,
    prompt: String,
    /// For a video: the seconds it renders (what was asked, cut to `max_video_seconds`).
    seconds: u32,
    created_at: Nanos,
    canceled_at: Option<Nanos>,
    /// For a job whose webhook sender runs: fired when the job is canceled, so the sender sends
    /// the canceled prediction at once, and nothing at the job's planned end.
    ends_early: Option<CancellationToken>,
}

/// The knobs `PUT /v1/chaos` may change while the mock runs.
#[derive(Debug, Clone, Copy, Deserialize, serde::Serialize)]
struct Chaos {
    latency_ms: u64,
    rate_429: f64,
    retry_after_seconds: u64,
    rate_5xx: f64,
    /// Predictions it runs at once before it answers 429: the account's capacity, which a
    /// provider may change under a running server.
    max_concurrent_predictions: usize,
    /// Whether webhooks are sent: `false` loses every one, as a broken delivery would.
    webhooks: bool,
}

/// Body of `PUT /v1/chaos`: the knobs to change; absent ones stay.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ChaosChange {
    hold: Option<bool>,
    latency_ms: Option<u64>,
    rate_429: Option<f64>,
    retry_after_seconds: Option<u64>,
    rate_5xx: Option<f64>,
    max_concurrent_predictions: Option<usize>,
    webhooks: Option<bool>,
}

/// One `POST /v1/predictions` as received.
#[derive(Debug, Clone, serde::Serialize)]
struct Submission {
    /// Clock reading when it arrived, in nanoseconds.
    at_ns: Nanos,
    /// The HTTP status it was answered with.
    status: u16,
    /// Its `Idempotency-Key` (the server sends a job's `predict_id` when it has one).
    #[serde(skip_serializing_if = "Option::is_none")]
    idempotency_key: Option<String>,
    /// Its `traceparent` header (`[telemetry]` on: the trace of the call that submitted it).
    #[serde(skip_serializing_if = "Option::is_none")]
    traceparent: Option<String>,
    /// Its `tracestate` header, if it had one (its first 1,024 characters).
    #[serde(skip_serializing_if = "Option::is_none")]
    tracestate: Option<String>,
}

const MAX_SUBMISSION_LOG: usize = 100_000;

#[derive(Debug)]
struct MockState {
    config: MockUpstreamConfig,
    chaos: Mutex<Chaos>,
    /// `true` while requests are held at the gate (`hold`).
    gate: tokio::sync::watch::Sender<bool>,
    clock: SharedClock,
    articles: Mutex<VecDeque<Stored>>,
    jobs: Mutex<HashMap<String, Job>>,
    idempotency: Mutex<HashMap<String, String>>,
    submissions: Mutex<Vec<Submission>>,
    next_article: std::sync::atomic::AtomicU64,
    usage: Counters,
    webhooks: webhooks::Webhooks,
    /// Cancelled when the mock stops: its webhook senders stop with it.
    stop: CancellationToken,
}

/// What the mock has been asked to do: the bill an agent ran up, and how hard it was hit.
#[derive(Debug, Default)]
struct Counters {
    requests: AtomicU64,
    articles_listed: AtomicU64,
    articles_saved: AtomicU64,
    predictions_created: AtomicU64,
    polls: AtomicU64,
    cancels: AtomicU64,
    refused_429: AtomicU64,
    refused_5xx: AtomicU64,
    refused_401: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

impl MockState {
    fn duration(&self, kind: PredictionKind) -> Nanos {
        let ms = match kind {
            PredictionKind::Image => self.config.image_job_ms,
            PredictionKind::Video => self.config.video_job_ms,
        };
        Nanos::from_millis(ms)
    }

    fn view(&self, id: &str, job: &Job, now: Nanos) -> Prediction {
        let duration = self.duration(job.kind);
        let elapsed = now - job.created_at;
        let (status, output, error) = if job.canceled_at.is_some() {
            (PredictionStatus::Canceled, None, None)
        } else if elapsed < duration / 5 {
            (PredictionStatus::Starting, None, None)
        } else if elapsed < duration {
            (PredictionStatus::Processing, None, None)
        } else if job.prompt.contains("[fail]") {
            (PredictionStatus::Failed, None, Some("the model could not render this prompt".to_owned()))
        } else {
            let ext = if job.kind == PredictionKind::Image { "png" } else { "mp4" };
            (PredictionStatus::Succeeded, Some(format!("https://files.mock-upstream.invalid/{id}.{ext}")), None)
        };
        let usage = status.is_terminal().then(|| Usage { units: Self::bill(job, status) });
        // As Replicate reports it: how long a job that ran to its end ran.
        let metrics = (status == PredictionStatus::Succeeded)
            .then(|| PredictionMetrics { predict_time: Some(duration.as_secs_f64()) });
        Prediction { id: id.to_owned(), kind: job.kind, status, output, error, usage, metrics }
    }

    /// What `job` is billed once it ends `status`: only a delivered result costs.
    fn bill(job: &Job, status: PredictionStatus) -> u64 {
        match (status, job.kind) {
            (PredictionStatus::Succeeded, PredictionKind::Image) => IMAGE_PRICE,
            (PredictionStatus::Succeeded, PredictionKind::Video) => video_price(job.seconds),
            _ => 0,
        }
    }

    fn running(&self, job: &Job, now: Nanos) -> bool {
        job.canceled_at.is_none() && now - job.created_at < self.duration(job.kind)
    }

    /// Job `id` as `GET /v1/predictions/{id}` shows it now, if it is final (what its webhook sends).
    fn final_view(&self, id: &str) -> Option<Prediction> {
        let now = self.clock.now();
        let jobs = lock(&self.jobs);
        let view = self.view(id, jobs.get(id)?, now);
        view.status.is_terminal().then_some(view)
    }

    /// Whether chaos lets webhooks leave.
    fn webhooks_on(&self) -> bool {
        lock(&self.chaos).webhooks
    }
}

/// An article as the mock keeps it: with its title lowercased once, for the searches.
#[derive(Debug)]
struct Stored {
    article: Article,
    folded_title: String,
}

impl From<Article> for Stored {
    fn from(article: Article) -> Self {
        Self { folded_title: article.title.to_lowercase(), article }
    }
}

/// The mock API's routes, ready to serve (its webhook senders run until their jobs are final).
pub fn router(config: MockUpstreamConfig, clock: SharedClock) -> Router {
    routes(config, clock, CancellationToken::new())
}

/// [`router`], its webhook senders stopping when `stop` is cancelled.
fn routes(config: MockUpstreamConfig, clock: SharedClock, stop: CancellationToken) -> Router {
    let articles = (0..SEEDED_ARTICLES)
        .map(|i| Article {
            id: format!("a{i}"),
            title: format!("{} #{i}", TOPICS[i % TOPICS.len()]),
            summary: format!("Article {i} about {}.", TOPICS[i % TOPICS.len()].to_lowercase()),
        })
        .map(Stored::from)
        .collect();
    let knobs = Chaos {
        latency_ms: config.latency_ms,
        rate_429: config.rate_429,
        retry_after_seconds: config.retry_after_seconds,
        rate_5xx: config.rate_5xx,
        max_concurrent_predictions: config.max_concurrent_predictions,
        webhooks: true,
    };
    let state = Arc::new(MockState {
        webhooks: webhooks::Webhooks::new(&config.webhook_secret),
        stop,
        config,
        chaos: Mutex::new(knobs),
        gate: tokio::sync::watch::Sender::new(false),
        clock,
        articles: Mutex::new(articles),
        jobs: Mutex::new(HashMap::new()),
        idempotency: Mutex::new(HashMap::new()),
        submissions: Mutex::new(Vec::new()),
        next_article: AtomicU64::new(SEEDED_ARTICLES as u64),
        usage: Counters::default(),
    });
    Router::new()
        .route("/v1/articles", get(list_articles).post(save_article))
        .route("/v1/predictions", post(create_prediction))
        .route("/v1/predictions/{id}", get(get_prediction))
        .route("/v1/predictions/{id}/cancel", post(cancel_prediction))
        .layer(middleware::from_fn_with_state(state.clone(), chaos))
        .layer(middleware::from_fn_with_state(state.clone(), log_submissions))
        .route("/v1/usage", get(usage))
        .route("/v1/submissions", get(submissions))
        .route("/v1/webhooks", get(webhooks::list))
        .route("/v1/chaos", axum::routing::put(change_chaos))
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .with_state(state)
}

const TOPICS: &[&str] = &["Rate limits", "Token buckets", "Agents", "Retries", "Budgets", "Backoff"];

/// A running mock upstream.
#[derive(Debug)]
pub struct MockUpstream {
    /// Its base URL, e.g. `http://127.0.0.1:40123`.
    pub url: String,
    stop: CancellationToken,
}

impl MockUpstream {
    /// Serves the mock on `listener` until dropped, holding its clients to `deadlines` (the
    /// `[server]` ones: a slow client is cut off here as on the MCP endpoint).
    pub async fn start(
        config: MockUpstreamConfig,
        deadlines: Deadlines,
        clock: SharedClock,
        listener: TcpListener,
    ) -> std::io::Result<Self> {
        let url = format!("http://{}", listener.local_addr()?);
        let stop = CancellationToken::new();
        let body = deadlines.body.answered_plainly();
        let app = routes(config, clock, stop.clone()).layer(read_body_by_deadline(body));
        tokio::spawn(serve(listener, app, deadlines, ConnectionMetrics::none(), stop.clone()));
        Ok(Self { url, stop })
    }
}

impl Drop for MockUpstream {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether `request` carries the key `mock_upstream.api_key` asks for (any request, when none is).
fn has_key(state: &MockState, request: &Request) -> bool {
    let key = state.config.api_key.expose();
    if key.is_empty() {
        return true;
    }
    let header = |name| request.headers().get(name).and_then(|v| v.to_str().ok());
    header("authorization").and_then(|v| v.strip_prefix("Bearer ")) == Some(key) || header("x-api-key") == Some(key)
}

async fn chaos(State(state): State<Arc<MockState>>, request: Request, next: Next) -> Response {
    bump(&state.usage.requests);
    if !has_key(&state, &request) {
        bump(&state.usage.refused_401);
        return (StatusCode::UNAUTHORIZED, Json(json!({"error": "missing or wrong API key"}))).into_response();
    }
    // Held: wait until the gate opens (a closed channel cannot happen: the state owns the sender).
    let _ = state.gate.subscribe().wait_for(|held| !held).await;
    let chaos = *lock(&state.chaos);
    if chaos.latency_ms > 0 {
        // On the shared clock, like job progress: a test walks a latency as it walks a job, and
        // the server measures it as its round-trip time.
        state.clock.sleep_until(state.clock.now() + Nanos::from_millis(chaos.latency_ms)).await;
    }
    let roll: f64 = rand::rng().random();
    if roll < chaos.rate_429 {
        bump(&state.usage.refused_429);
        return too_many(chaos.retry_after_seconds, "mock chaos: rate limited");
    }
    if roll < chaos.rate_429 + chaos.rate_5xx {
        bump(&state.usage.refused_5xx);
        return (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"error": "mock chaos: unavailable"}))).into_response();
    }
    next.run(request).await
}

/// Records every prediction submission with the time it arrived and how it was answered.
async fn log_submissions(State(state): State<Arc<MockState>>, request: Request, next: Next) -> Response {
    let is_submission = request.method() == axum::http::Method::POST && request.uri().path() == "/v1/predictions";
    let at_ns = state.clock.now();
    let idempotency_key =
        request.headers().get("idempotency-key").and_then(|v| v.to_str().ok()).map(|k| k.chars().take(64).collect());
    let traceparent = header_text(request.headers(), "traceparent", 64);
    let tracestate = header_text(request.headers(), "tracestate", 1024);
    let response = next.run(request).await;
    if is_submission {
        let mut log = lock(&state.submissions);
        if log.len() < MAX_SUBMISSION_LOG {
            log.push(Submission {
                at_ns,
                status: response.status().as_u16(),
                idempotency_key,
                traceparent,
                tracestate,
            });
        }
    }
    response
}

/// The first `most` characters of header `name`, if it was sent.
fn header_text(headers: &axum::http::HeaderMap, name: &str, most: usize) -> Option<String> {
    headers.get(name).map(|v| String::from_utf8_lossy(v.as_bytes()).chars().take(most).collect())
}

/// `GET /v1/submissions`: every submission received, oldest first.
async fn submissions(State(state): State<Arc<MockState>>) -> Json<serde_json::Value> {
    Json(json!({ "submissions": *lock(&state.submissions) }))
}

/// `PUT /v1/chaos`: changes the chaos knobs; answers the knobs now in force.
async fn change_chaos(State(state): State<Arc<MockState>>, Json(change): Json<ChaosChange>) -> Response {
    for rate in [change.rate_429, change.rate_5xx].into_iter().flatten() {
        if !(0.0..=1.0).contains(&rate) {
            return (StatusCode::BAD_REQUEST, Json(json!({"error": "rates are fractions between 0.0 and 1.0"})))
                .into_response();
        }
    }
    if let Some(hold) = change.hold {
        state.gate.send_replace(hold);
    }
    let mut chaos = lock(&state.chaos);
    chaos.latency_ms = change.latency_ms.unwrap_or(chaos.latency_ms);
    chaos.rate_429 = change.rate_429.unwrap_or(chaos.rate_429);
    chaos.retry_after_seconds = change.retry_after_seconds.unwrap_or(chaos.retry_after_seconds);
    chaos.rate_5xx = change.rate_5xx.unwrap_or(chaos.rate_5xx);
    chaos.max_concurrent_predictions = change.max_concurrent_predictions.unwrap_or(chaos.max_concurrent_predictions);
    chaos.webhooks = change.webhooks.unwrap_or(chaos.webhooks);
    let mut answer = json!(*chaos);
    answer["hold"] = json!(*state.gate.borrow());
    Json(answer).into_response()
}

fn too_many(retry_after_seconds: u64, why: &str) -> Response {
    (
        StatusCode::TOO_MANY_REQUESTS,
        [(header::RETRY_AFTER, retry_after_seconds.to_string())],
        Json(json!({"error": why})),
    )
        .into_response()
}

#[derive(Debug, Deserialize)]
struct ListQuery {
    query: Option<String>,
    limit: Option<usize>,
    cursor: Option<String>,
}

async fn list_articles(State(state): State<Arc<MockState>>, Query(q): Query<ListQuery>) -> Response {
    bump(&state.usage.articles_listed);
    let limit = q.limit.unwrap_or(10).clamp(1, 100);
    let Ok(offset) = q.cursor.as_deref().unwrap_or("0").parse::<usize>() else {
        return (StatusCode::BAD_REQUEST, Json(json!({"error": "bad cursor"}))).into_response();
    };
    let needle = q.query.unwrap_or_default().to_lowercase();
    let articles = state.articles.lock().unwrap_or_else(|p| p.into_inner());
    let mut matching = articles.iter().filter(|a| a.folded_title.contains(&needle)).skip(offset);
    let page: Vec<Article> = matching.by_ref().take(limit).map(|a| a.article.clone()).collect();
    let next_cursor = matching.next().is_some().then(|| (offset + page.len()).to_string());
    Json(ArticlePage { articles: page, next_cursor, usage: Some(Usage { units: LIST_PRICE }) }).into_response()
}

async fn save_article(State(state): State<Arc<MockState>>, Json(new): Json<NewArticle>) -> Response {
    bump(&state.usage.articles_saved);
    let n = state.next_article.fetch_add(1, Ordering::Relaxed);
    let article =
        Article { id: format!("a{n}"), title: new.title.clone(), summary: new.body.chars().take(120).collect() };
    let mut articles = state.articles.lock().unwrap_or_else(|p| p.into_inner());
    if articles.len() >= MAX_ARTICLES {
        articles.pop_front();
    }
    articles.push_back(Stored::from(article.clone()));
    let usage = Some(Usage { units: SAVE_PRICE });
    (StatusCode::CREATED, Json(SavedArticle { id: article.id, title: article.title, usage })).into_response()
}

async fn create_prediction(
    State(state): State<Arc<MockState>>,
    headers: axum::http::HeaderMap,
    Json(new): Json<NewPrediction>,
) -> Response {
    if let Some(why) = webhooks::refusal(&new) {
        return (StatusCode::UNPROCESSABLE_ENTITY, Json(json!({"error": why}))).into_response();
    }
    let now = state.clock.now();
    let key = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).map(str::to_owned);
    let mut jobs = lock(&state.jobs);
    let mut seen = lock(&state.idempotency);
    if let Some(id) = key.as_ref().and_then(|k| seen.get(k))
        && let Some(job) = jobs.get(id)
    {
        // A retry of a submission we already took (its answer was lost): the same job, no new bill.
        return Json(state.view(id, job, now)).into_response();
    }
    let running = jobs.values().filter(|j| state.running(j, now)).count();
    let capacity = lock(&state.chaos).max_concurrent_predictions;
    if running >= capacity {
        bump(&state.usage.refused_429);
        return too_many(state.config.retry_after_seconds, "too many predictions running at once");
    }
    if jobs.len() >= MAX_JOBS {
        // Forget the finished jobs first; a real API would archive them.
        jobs.retain(|_, j| state.running(j, now));
        seen.retain(|_, id| jobs.contains_key(id));
    }
    bump(&state.usage.predictions_created);
    let id = format!("p_{:016x}{:04x}", rand::rng().random::<u64>(), rand::rng().random::<u16>());
    let asked = new.seconds.unwrap_or(DEFAULT_VIDEO_SECONDS);
    let seconds = asked.min(u32::try_from(state.config.max_video_seconds).unwrap_or(u32::MAX));
    let webhook = webhooks::wanted(&state.webhooks, &new).map(str::to_owned);
    let ends_early = webhook.is_some().then(CancellationToken::new);
    let job = Job { kind: new.kind, prompt: new.prompt, seconds, created_at: now, canceled_at: None, ends_early };
    if let (Some(url), Some(ends_early)) = (webhook, &job.ends_early) {
        let end = now + state.duration(job.kind);
        webhooks::start(&state, id.clone(), url, end, ends_early.clone());
    }
    let view = state.view(&id, &job, now);
    if let Some(key) = key {
        seen.insert(key, id.clone());
    }
    jobs.insert(id, job);
    (StatusCode::CREATED, Json(view)).into_response()
}

async fn get_prediction(State(state): State<Arc<MockState>>, Path(id): Path<String>) -> Response {
    bump(&state.usage.polls);
    let now = state.clock.now();
    let jobs = state.jobs.lock().unwrap_or_else(|p| p.into_inner());
    match jobs.get(&id) {
        Some(job) => Json(state.view(&id, job, now)).into_response(),
        None => (StatusCode::NOT_FOUND, Json(json!({"error": "no such prediction"}))).into_response(),
    }
}

async fn cancel_prediction(State(state): State<Arc<MockState>>, Path(id): Path<String>) -> Response {
    bump(&state.usage.cancels);
    let now = state.clock.now();
    let mut jobs = state.jobs.lock().unwrap_or_else(|p| p.into_inner());
    match jobs.get_mut(&id) {
        Some(job) => {
            if state.running(job, now) {
                job.canceled_at = Some(now);
                // After the mark: its webhook sender, woken, reads the job as canceled.
                if let Some(ends_early) = &job.ends_early {
                    ends_early.cancel();
                }
            }
            Json(state.view(&id, job, now)).into_response()
        }
        None => (StatusCode::NOT_FOUND, Json(json!({"error": "no such prediction"}))).into_response(),
    }
}

/// `GET /v1/usage`: counters since start (not itself counted or subject to chaos).
async fn usage(State(state): State<Arc<MockState>>) -> Json<serde_json::Value> {
    let u = &state.usage;
    let read = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let now = state.clock.now();
    let jobs: u64 =
        lock(&state.jobs).iter().filter_map(|(id, job)| state.view(id, job, now).usage).map(|u| u.units).sum();
    let units_billed = read(&u.articles_listed) * LIST_PRICE + read(&u.articles_saved) * SAVE_PRICE + jobs;
    let mut answer = json!({
        "units_billed": units_billed,
        "requests": read(&u.requests),
        "articles_listed": read(&u.articles_listed),
        "articles_saved": read(&u.articles_saved),
        "predictions_created": read(&u.predictions_created),
        "polls": read(&u.polls),
        "cancels": read(&u.cancels),
        "refused_429": read(&u.refused_429),
        "refused_5xx": read(&u.refused_5xx),
        "refused_401": read(&u.refused_401),
    });
    for (name, count) in state.webhooks.usage() {
        answer[name] = json!(count);
    }
    Json(answer)
}
