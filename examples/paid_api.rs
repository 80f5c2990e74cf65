//! Your own paid HTTP API behind every protection: an rmcp server whose two tools wrap a paid
//! translation API, with our limits in front of the tools and a circuit breaker behind them.
//!
//! What protects what, in the order a call meets it:
//! - the coarse HTTP limit (`limits.http_layer()`): 40 POSTs per caller, then 429 with
//!   `Retry-After`, before any JSON is read;
//! - the circuit breaker, while open: `upstream_unavailable` with the cool-down left, before the
//!   guard charges anything (`ApiRules::before_charging`: the one rule this door adds to the
//!   library's);
//! - the guard (`LimitedRouter`): loop detection, each tool's price (in `tools/list` too) charged
//!   to the caller's and the tenant's budgets at once, and one `translate_document` in flight
//!   per caller (a `job` in the `Catalogue`);
//! - the call to the API (`PaidApi::post`): made once, never retried for an agent; its 429 goes
//!   back as `upstream_rate_limited` with the API's `Retry-After` as the wait; its failures open
//!   the breaker.
//!
//! The paid API is a stand-in started in this process (`mod stand_in`, at the end): an account
//! with a quota per minute, and knobs to take it down or hold its slow calls. Yours is a URL
//! and an account key; `docs/forking.md` walks through making this file yours.
//!
//! ```text
//! cargo run --example paid_api                  # MCP at http://127.0.0.1:8082/mcp
//! LISTEN=127.0.0.1:0 PAID_API_QUOTA=2 cargo run --example paid_api
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example paid_api   # budgets shared by instances
//! ```
//!
//! The stand-in's knobs, at the address the second printed line gives (`API` here):
//!
//! ```text
//! curl -X POST http://API/admin/outage          # every paid call answers 503 until DELETE
//! curl -X POST http://API/admin/hold            # documents wait until DELETE /admin/hold
//! curl http://API/admin/stats                   # requests that reached the API
//! ```

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

// The library (mcp-ratelimit-rmcp, which re-exports the core), and one helper of the server's.
use mcp_ratelimit::upstream::backoff::parse_retry_after;
use mcp_ratelimit_rmcp::breaker::Breaker;
use mcp_ratelimit_rmcp::clock::{Nanos, SharedClock, ceil_ms};
use mcp_ratelimit_rmcp::guard::{Door, Refusal};
use mcp_ratelimit_rmcp::identity::Caller;
use mcp_ratelimit_rmcp::results;
use mcp_ratelimit_rmcp::{Catalogue, LimitedRouter, RateLimits};
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::CallToolResult;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ServerHandler, tool, tool_handler, tool_router};
use serde_json::{Value, json};

/// Our limits; everything not set here is `config.toml`'s default.
const LIMITS: &str = r#"
# Before any JSON: 40 POSTs per caller, then one every 5 s.
[limits.http]
algorithm = "token_bucket"
burst = 40
refill_per_sec = 0.2

# Each caller's tool budget: 10 tokens, then one every 20 s.
[limits.caller]
algorithm = "token_bucket"
burst = 10
refill_per_sec = 0.05

# All keys of one tenant together: 15 tokens, then one every 20 s.
[limits.tenant]
algorithm = "token_bucket"
burst = 15
refill_per_sec = 0.05

# One document in flight per caller.
[limits.in_flight]
caller = 1

# The same call 5 times in a minute is a stuck agent: the fifth is refused.
[loop_detection]
repeats = 5
window_ms = 60000

# Two keys of tenant acme (plaintext keys are for local development; give `sha256` instead).
[[auth.keys]]
key = "acme-alice"
tenant = "acme"

[[auth.keys]]
key = "acme-bob"
tenant = "acme"

[tools.translate]
cost = 1

[tools.translate_document]
cost = 5
"#;

/// Consecutive failures of the API that open its breaker, and for how long.
const BREAKER_FAILURES: u32 = 3;
const BREAKER_COOLDOWN: Nanos = Nanos::from_secs(30);
/// The wait suggested after one failure, before the breaker has an opinion.
const FAILURE_WAIT_MS: u64 = 5_000;

#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
struct Translation {
    /// The text to translate.
    text: String,
    /// The language to translate it into, e.g. "fr".
    to: String,
}

#[derive(Clone)]
struct Translator {
    tools: LimitedRouter<Self, ApiRules>,
    api: Arc<PaidApi>,
}

/// What this door adds to the library's rules around every call: every tool here needs the API,
/// so while its breaker is open a call could not succeed, and it is refused before the guard
/// charges anything for it.
#[derive(Clone)]
struct ApiRules(Arc<PaidApi>);

impl Door for ApiRules {
    type Place = ();

    fn before_charging(&self, tool: &str, _caller: &Caller) -> Result<(), Refusal> {
        match self.0.breaker.open_for(self.0.clock.now()) {
            Some(left) => Err(breaker_open(tool, left)),
            None => Ok(()),
        }
    }
}

#[tool_router]
impl Translator {
    #[tool(description = "Translate a short text.")]
    async fn translate(&self, Parameters(t): Parameters<Translation>) -> CallToolResult {
        answer(self.api.post("translate", "/v1/translate", json!({ "text": t.text, "to": t.to })).await)
    }

    #[tool(description = "Translate a whole document (slow; one at a time).")]
    async fn translate_document(&self, Parameters(t): Parameters<Translation>) -> CallToolResult {
        answer(self.api.post("translate_document", "/v1/documents", json!({ "text": t.text, "to": t.to })).await)
    }
}

#[tool_handler(router = self.tools, name = "paid-api-translator")]
impl ServerHandler for Translator {}

/// The API's answer as the tool's result, or the refusal the agent can act on.
fn answer(outcome: Result<Value, Refusal>) -> CallToolResult {
    match outcome {
        Ok(body) => CallToolResult::structured(body),
        Err(refusal) => results::tool_result(&refusal),
    }
}

/// The refusal while the breaker is open: the wait is the cool-down `left`.
fn breaker_open(tool: &str, left: Nanos) -> Refusal {
    Refusal::upstream_unavailable(tool, "it failed repeatedly and its circuit breaker is open", ceil_ms(left))
}

/// The paid API as the tools see it: one client, one account key, one breaker.
struct PaidApi {
    http: reqwest::Client,
    base: String,
    breaker: Breaker,
    clock: SharedClock,
}

impl PaidApi {
    fn new(base: String, clock: SharedClock) -> reqwest::Result<Self> {
        let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build()?;
        Ok(Self { http, base, breaker: Breaker::new(BREAKER_FAILURES, BREAKER_COOLDOWN), clock })
    }

    /// One attempt, never retried: an agent-visible call that fails hands the agent the wait,
    /// instead of burning quota while it waits.
    async fn post(&self, tool: &str, path: &str, body: Value) -> Result<Value, Refusal> {
        let permit = self.breaker.permit(self.clock.now()).map_err(|open| breaker_open(tool, open.retry_after))?;
        let url = format!("{}{path}", self.base);
        let sent = self.http.post(url).bearer_auth(stand_in::ACCOUNT_KEY).json(&body).send().await;
        // Only the API failing counts against it: a 429 or another 4xx is an API that answers.
        let answered = matches!(&sent, Ok(response) if !response.status().is_server_error());
        self.breaker.record(permit, answered, self.clock.now());

        let unavailable = |detail: &str| Refusal::upstream_unavailable(tool, detail, FAILURE_WAIT_MS);
        let response = sent.map_err(|_| unavailable("it could not be reached"))?;
        match response.status() {
            status if status.is_success() => {
                response.json().await.map_err(|_| unavailable("its answer was unreadable"))
            }
            reqwest::StatusCode::TOO_MANY_REQUESTS => {
                // The API's Retry-After (seconds or an HTTP date) is the floor of the wait.
                let retry_after = response
                    .headers()
                    .get(reqwest::header::RETRY_AFTER)
                    .and_then(|value| value.to_str().ok())
                    .and_then(|value| parse_retry_after(value, SystemTime::now()))
                    .unwrap_or(Duration::from_secs(1));
                Err(Refusal::upstream_rate_limited(tool, (retry_after.as_millis() as u64).max(1)))
            }
            status => Err(unavailable(&format!("it answered {status}"))),
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The paid API: a stand-in in this process. Yours is a URL and an account key.
    let quota = std::env::var("PAID_API_QUOTA").map_or(Ok(60), |q| q.parse())?;
    let api_addr = stand_in::start(quota).await?;

    // Our limits: the tools they price (a job holds an in-flight slot while it runs), kept in
    // Redis when several instances must share one budget per caller.
    let tools = Catalogue::new().tool("translate").job("translate_document");
    let limits = match std::env::var("REDIS_URL") {
        Ok(url) => format!("{LIMITS}\n[store]\nbackend = \"redis\"\nredis_url = \"{url}\"\n"),
        Err(_) => LIMITS.to_owned(),
    };
    let limits = RateLimits::from_toml(&limits, tools).await?;
    let api = Arc::new(PaidApi::new(format!("http://{api_addr}"), limits.clock().clone())?);
    let rules = ApiRules(api.clone());
    let server = Translator { tools: LimitedRouter::with_door(Translator::tool_router(), limits.clone(), rules), api };

    let mcp = StreamableHttpService::new(
        move || Ok(server.clone()),
        LocalSessionManager::default().into(),
        StreamableHttpServerConfig::default(),
    );
    // Our HTTP layer names each caller (its key's hash, else its address) and charges its POSTs.
    let app = axum::Router::new().nest_service("/mcp", mcp).layer(limits.http_layer());

    let listen: SocketAddr = std::env::var("LISTEN").unwrap_or_else(|_| "127.0.0.1:8082".into()).parse()?;
    let listener = tokio::net::TcpListener::bind(listen).await?;
    println!("listening on http://{}/mcp", listener.local_addr()?);
    println!("paid API (stand-in) on http://{api_addr}");
    axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await?;
    Ok(())
}

/// A stand-in for someone else's paid translation API, small enough to read and deterministic
/// enough to test against. Replace it with the real API's URL and key.
mod stand_in {
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use axum::extract::State;
    use axum::http::{HeaderMap, StatusCode, header};
    use axum::response::{IntoResponse, Response};
    use axum::routing::{get, post};
    use axum::{Json, Router};
    use serde_json::{Value, json};
    use tokio::sync::watch;

    /// The account our server holds with the API.
    pub(crate) const ACCOUNT_KEY: &str = "demo-account";
    /// The account's quota is counted per minute.
    const QUOTA_WINDOW: Duration = Duration::from_secs(60);

    struct Api {
        /// Paid requests the account may make per minute.
        quota: u32,
        /// When the current minute began, and the requests made in it.
        window: Mutex<(Instant, u32)>,
        /// Every request that reached `/v1/…`, whatever it was answered.
        requests: AtomicU64,
        /// While on, every paid request is answered 503.
        outage: AtomicBool,
        /// While on, documents wait; `held` of them are waiting.
        hold: watch::Sender<bool>,
        held: AtomicU64,
        /// The Retry-After of the last 429, in seconds.
        last_retry_after: AtomicU64,
    }

    /// Serves the API on a free loopback port.
    pub(crate) async fn start(quota: u32) -> std::io::Result<SocketAddr> {
        let api = Arc::new(Api {
            quota,
            window: Mutex::new((Instant::now(), 0)),
            requests: AtomicU64::new(0),
            outage: AtomicBool::new(false),
            hold: watch::Sender::new(false),
            held: AtomicU64::new(0),
            last_retry_after: AtomicU64::new(0),
        });
        let app = Router::new()
            .route("/v1/translate", post(translate))
            .route("/v1/documents", post(translate_document))
            .route("/admin/stats", get(stats))
            .route("/admin/outage", post(|s| outage(s, true)).delete(|s| outage(s, false)))
            .route("/admin/hold", post(|s| hold(s, true)).delete(|s| hold(s, false)))
            .with_state(api);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(async move { axum::serve(listener, app).await });
        Ok(addr)
    }

    #[derive(serde::Deserialize)]
    struct Translation {
        text: String,
        to: String,
    }

    async fn translate(State(api): State<Arc<Api>>, headers: HeaderMap, Json(t): Json<Translation>) -> Response {
        if let Some(refused) = api.refusal(&headers) {
            return refused;
        }
        Json(json!({ "translation": format!("[{}] {}", t.to, t.text) })).into_response()
    }

    async fn translate_document(
        State(api): State<Arc<Api>>,
        headers: HeaderMap,
        Json(t): Json<Translation>,
    ) -> Response {
        if let Some(refused) = api.refusal(&headers) {
            return refused;
        }
        // A document takes a second, or, while /admin/hold is on, until it is released.
        let mut hold = api.hold.subscribe();
        if *hold.borrow_and_update() {
            api.held.fetch_add(1, Relaxed);
            let _ = hold.wait_for(|on| !on).await;
            api.held.fetch_sub(1, Relaxed);
        } else {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        Json(json!({ "translation": format!("[{}] {}", t.to, t.text), "pages": 1 })).into_response()
    }

    impl Api {
        /// Why a paid request is refused, if it is: the outage knob, the account key, the quota.
        fn refusal(&self, headers: &HeaderMap) -> Option<Response> {
            self.requests.fetch_add(1, Relaxed);
            if self.outage.load(Relaxed) {
                return Some((StatusCode::SERVICE_UNAVAILABLE, "outage").into_response());
            }
            let key = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
            if key.and_then(|k| k.strip_prefix("Bearer ")) != Some(ACCOUNT_KEY) {
                return Some((StatusCode::UNAUTHORIZED, "unknown account").into_response());
            }
            let mut window = self.window.lock().unwrap_or_else(|p| p.into_inner());
            let (began, used) = &mut *window;
            if began.elapsed() >= QUOTA_WINDOW {
                (*began, *used) = (Instant::now(), 0);
            }
            if *used >= self.quota {
                let left = QUOTA_WINDOW.saturating_sub(began.elapsed());
                let retry_after = (left.as_millis() as u64).div_ceil(1000).max(1);
                self.last_retry_after.store(retry_after, Relaxed);
                let headers = [(header::RETRY_AFTER, retry_after.to_string())];
                return Some((StatusCode::TOO_MANY_REQUESTS, headers, "quota exceeded").into_response());
            }
            *used += 1;
            None
        }
    }

    async fn stats(State(api): State<Arc<Api>>) -> Json<Value> {
        Json(json!({
            "requests": api.requests.load(Relaxed),
            "held": api.held.load(Relaxed),
            "last_retry_after": api.last_retry_after.load(Relaxed),
        }))
    }

    async fn outage(State(api): State<Arc<Api>>, on: bool) -> StatusCode {
        api.outage.store(on, Relaxed);
        StatusCode::NO_CONTENT
    }

    async fn hold(State(api): State<Arc<Api>>, on: bool) -> StatusCode {
        api.hold.send_replace(on);
        StatusCode::NO_CONTENT
    }
}
