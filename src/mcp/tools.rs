//! The tools: thin wrappers over the paid API, each with a schema that states its limits.
//!
//! Tools never check budgets themselves: [`McpServer::call_tool`](super::server) has already
//! validated their arguments (see [`validate_arguments`]) and charged the caller before a tool
//! body runs. A tool only turns upstream answers into results, and upstream failures into
//! refusals that carry the wait.

use std::collections::BTreeMap;

use rmcp::handler::server::tool::Extension;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, ContentBlock, JsonObject};
use rmcp::{ErrorData, tool, tool_router};
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::clock::{NANOS_PER_SEC, ceil_secs};
use crate::guard::{BudgetStatus, Refusal};
use crate::identity::Caller;
use crate::mcp::McpServer;
use crate::upstream::UpstreamError;
use crate::upstream::api::{NewArticle, NewPrediction, Prediction, PredictionKind, PredictionStatus};
use crate::upstream::predictions::PollGate;

/// Every tool this server exposes; config costs must name one of these.
pub const TOOL_NAMES: [&str; 6] = [
    "list_articles",
    "save_article",
    "generate_image",
    "generate_image_to_video",
    "get_prediction",
    "rate_limit_status",
];

/// Longest prompt accepted, in characters.
pub const MAX_PROMPT_CHARS: usize = 4000;
const MAX_TITLE_CHARS: usize = 200;
const MAX_BODY_CHARS: usize = 100_000;
const MAX_URL_CHARS: usize = 2048;
/// How long to tell an agent to wait after an upstream failure without a Retry-After.
const UPSTREAM_FAILURE_WAIT_MS: u64 = 5_000;

/// Arguments checked before any budget is charged.
trait Validate {
    /// Ok, or what is wrong in words an agent can fix.
    fn validate(&self) -> Result<(), String>;
}

fn at_most(field: &str, value: &str, max: usize) -> Result<(), String> {
    let n = value.chars().count();
    if n > max { Err(format!("`{field}` is {n} characters long; the limit is {max}")) } else { Ok(()) }
}

fn not_blank(field: &str, value: &str) -> Result<(), String> {
    if value.trim().is_empty() { Err(format!("`{field}` must not be empty")) } else { Ok(()) }
}

fn parse<T: DeserializeOwned + Validate>(args: Option<&JsonObject>) -> Result<(), String> {
    let value = serde_json::Value::Object(args.cloned().unwrap_or_default());
    let parsed: T = serde_json::from_value(value).map_err(|e| e.to_string())?;
    parsed.validate()
}

/// Checks `args` against the tool's schema and size limits, before anything is charged.
pub fn validate_arguments(tool: &str, args: Option<&JsonObject>) -> Result<(), Refusal> {
    let checked = match tool {
        "list_articles" => parse::<ListArticlesArgs>(args),
        "save_article" => parse::<SaveArticleArgs>(args),
        "generate_image" => parse::<GenerateImageArgs>(args),
        "generate_image_to_video" => parse::<GenerateVideoArgs>(args),
        "get_prediction" => parse::<GetPredictionArgs>(args),
        "rate_limit_status" => parse::<NoArgs>(args),
        _ => Err("unknown tool".to_owned()),
    };
    checked.map_err(|problem| Refusal::invalid_arguments(tool, &problem))
}

/// `list_articles` arguments. Every field is optional.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListArticlesArgs {
    /// Words to look for in article titles (empty: all articles).
    #[serde(default)]
    #[schemars(length(max = 200))]
    pub query: String,
    /// How many articles to return (1-50).
    #[serde(default = "default_page_size")]
    #[schemars(range(min = 1, max = 50))]
    pub limit: u32,
    /// The `next_cursor` of the previous page, to read the next one (empty: first page).
    #[serde(default)]
    #[schemars(length(max = 64))]
    pub cursor: String,
}

fn default_page_size() -> u32 {
    10
}

impl Validate for ListArticlesArgs {
    fn validate(&self) -> Result<(), String> {
        at_most("query", &self.query, 200)?;
        at_most("cursor", &self.cursor, 64)?;
        if (1..=50).contains(&self.limit) {
            Ok(())
        } else {
            Err(format!("`limit` must be between 1 and 50 (got {})", self.limit))
        }
    }
}

/// `save_article` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SaveArticleArgs {
    /// Headline (at most 200 characters).
    #[schemars(length(min = 1, max = 200))]
    pub title: String,
    /// Full text (at most 100000 characters).
    #[schemars(length(min = 1, max = 100000))]
    pub body: String,
}

impl Validate for SaveArticleArgs {
    fn validate(&self) -> Result<(), String> {
        not_blank("title", &self.title)?;
        not_blank("body", &self.body)?;
        at_most("title", &self.title, MAX_TITLE_CHARS)?;
        at_most("body", &self.body, MAX_BODY_CHARS)
    }
}

/// `generate_image` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GenerateImageArgs {
    /// What to draw (at most 4000 characters).
    #[schemars(length(min = 1, max = 4000))]
    pub prompt: String,
}

impl Validate for GenerateImageArgs {
    fn validate(&self) -> Result<(), String> {
        not_blank("prompt", &self.prompt)?;
        at_most("prompt", &self.prompt, MAX_PROMPT_CHARS)
    }
}

/// `generate_image_to_video` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GenerateVideoArgs {
    /// The http(s) URL of the first frame.
    #[schemars(length(min = 1, max = 2048))]
    pub image_url: String,
    /// How the scene should move (at most 4000 characters).
    #[schemars(length(min = 1, max = 4000))]
    pub prompt: String,
}

impl Validate for GenerateVideoArgs {
    fn validate(&self) -> Result<(), String> {
        not_blank("prompt", &self.prompt)?;
        at_most("prompt", &self.prompt, MAX_PROMPT_CHARS)?;
        at_most("image_url", &self.image_url, MAX_URL_CHARS)?;
        match reqwest::Url::parse(&self.image_url) {
            Ok(u) if matches!(u.scheme(), "http" | "https") => Ok(()),
            _ => Err("`image_url` must be an http or https URL".to_owned()),
        }
    }
}

/// `get_prediction` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GetPredictionArgs {
    /// The `predict_id` returned by generate_image or generate_image_to_video.
    #[schemars(length(min = 1, max = 64), regex(pattern = r"^[A-Za-z0-9_-]+$"))]
    pub predict_id: String,
}

impl Validate for GetPredictionArgs {
    fn validate(&self) -> Result<(), String> {
        let ok = !self.predict_id.is_empty()
            && self.predict_id.len() <= 64
            && self.predict_id.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if ok { Ok(()) } else { Err("`predict_id` must be 1-64 characters of A-Z, a-z, 0-9, _ or -".to_owned()) }
    }
}

/// No arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NoArgs {}

impl Validate for NoArgs {
    fn validate(&self) -> Result<(), String> {
        Ok(())
    }
}

/// What image and video submissions answer.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Submitted {
    /// Pass to get_prediction.
    pub predict_id: String,
    /// Where the job is.
    pub status: PredictionStatus,
    /// Poll get_prediction no sooner than this.
    pub next_poll_in_seconds: u64,
}

/// What get_prediction answers.
#[derive(Debug, Serialize, JsonSchema)]
pub struct PredictionReport {
    /// The job.
    pub predict_id: String,
    /// Image or video.
    pub kind: PredictionKind,
    /// Where the job is.
    pub status: PredictionStatus,
    /// Result URL, once succeeded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output: Option<String>,
    /// Failure reason, once failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// While pending: poll again no sooner than this.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_poll_in_seconds: Option<u64>,
}

/// What rate_limit_status answers.
#[derive(Debug, Serialize, JsonSchema)]
pub struct StatusReport {
    /// The caller these budgets belong to (a hash, never a credential).
    pub caller: String,
    /// Each budget a call draws on.
    pub budgets: Vec<BudgetStatus>,
    /// What each tool costs.
    pub costs: BTreeMap<String, u64>,
}

fn success(summary: String, structured: impl Serialize) -> Result<CallToolResult, ErrorData> {
    let value = serde_json::to_value(structured).map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
    let mut result = CallToolResult::success(vec![ContentBlock::text(summary)]);
    result.structured_content = Some(value);
    Ok(result)
}

fn upstream_refusal(tool: &str, error: UpstreamError) -> CallToolResult {
    let refusal = match error {
        UpstreamError::RateLimited { retry_after } => {
            // The upstream's Retry-After is a floor: never tell the agent to come back sooner.
            let floor = retry_after.map_or(1_000, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
            Refusal::upstream_rate_limited(tool, floor.max(1_000))
        }
        UpstreamError::NotFound => Refusal::invalid_arguments(tool, "the upstream does not know that id"),
        UpstreamError::Rejected(detail) => Refusal::invalid_arguments(tool, &detail),
        UpstreamError::Unavailable(detail) => Refusal::upstream_unavailable(tool, &detail, UPSTREAM_FAILURE_WAIT_MS),
    };
    tracing::warn!(tool, code = refusal.code.as_str(), "upstream refusal");
    refusal.into_result()
}

/// Someone else's job, or none at all: the same answer, so a `predict_id` never leaks.
fn unknown_prediction() -> CallToolResult {
    Refusal::invalid_arguments("get_prediction", "no prediction with that predict_id").into_result()
}

fn report(prediction: Prediction, wait_secs: Option<u64>) -> Result<CallToolResult, ErrorData> {
    let id = &prediction.id;
    let summary = match (prediction.status, &prediction.output, &prediction.error) {
        (PredictionStatus::Succeeded, Some(url), _) => format!("Prediction {id} succeeded: {url}"),
        (PredictionStatus::Failed, _, reason) => {
            format!("Prediction {id} failed: {}", reason.as_deref().unwrap_or("no reason given"))
        }
        (PredictionStatus::Canceled, _, _) => format!("Prediction {id} was canceled."),
        (status, _, _) => format!(
            "Prediction {id} is {}. Call get_prediction again in {} seconds.",
            serde_json::to_value(status).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default(),
            wait_secs.unwrap_or(1)
        ),
    };
    let pending = !prediction.status.is_terminal();
    success(
        summary,
        PredictionReport {
            predict_id: prediction.id,
            kind: prediction.kind,
            status: prediction.status,
            output: prediction.output,
            error: prediction.error,
            next_poll_in_seconds: pending.then(|| wait_secs.unwrap_or(1).max(1)),
        },
    )
}

impl McpServer {
    /// Counts an upstream answer in `mcp_ratelimit_upstream_requests_total` and passes it on.
    fn observe<T>(&self, tool: &str, answer: Result<T, UpstreamError>) -> Result<T, UpstreamError> {
        self.app.metrics.upstream(tool, answer.as_ref().map_or_else(UpstreamError::outcome, |_| "ok"));
        answer
    }

    fn poll_hint_secs(&self, kind: PredictionKind) -> u64 {
        let upstream = &self.app.config.upstream;
        match kind {
            PredictionKind::Image => upstream.image_poll_seconds,
            PredictionKind::Video => upstream.video_poll_seconds,
        }
    }

    async fn submit(&self, tool: &str, caller: &Caller, job: NewPrediction) -> Result<CallToolResult, ErrorData> {
        let kind = job.kind;
        let prediction = match self.observe(tool, self.app.upstream.create_prediction(&job).await) {
            Ok(p) => p,
            Err(e) => return Ok(upstream_refusal(tool, e)),
        };
        let hint = self.poll_hint_secs(kind);
        self.app.predictions.record(caller.id(), prediction.clone(), hint * NANOS_PER_SEC);
        let what = if kind == PredictionKind::Image { "Image" } else { "Video" };
        success(
            format!(
                "{what} job {} submitted. Call get_prediction with this predict_id in {hint} seconds.",
                prediction.id
            ),
            Submitted { predict_id: prediction.id, status: prediction.status, next_poll_in_seconds: hint },
        )
    }
}

#[tool_router(vis = "pub(crate)")]
impl McpServer {
    /// Lists articles from the upstream, a page at a time.
    #[tool(
        description = "List articles whose titles match a query. Pages with `cursor`.",
        annotations(read_only_hint = true, open_world_hint = true)
    )]
    async fn list_articles(&self, Parameters(args): Parameters<ListArticlesArgs>) -> Result<CallToolResult, ErrorData> {
        let query = Some(args.query.as_str()).filter(|q| !q.is_empty());
        let cursor = Some(args.cursor.as_str()).filter(|c| !c.is_empty());
        match self.observe("list_articles", self.app.upstream.list_articles(query, args.limit, cursor).await) {
            Ok(page) => {
                let more =
                    page.next_cursor.as_deref().map(|c| format!(" More with cursor \"{c}\".")).unwrap_or_default();
                let titles: Vec<&str> = page.articles.iter().map(|a| a.title.as_str()).collect();
                success(format!("{} articles: {}.{more}", titles.len(), titles.join("; ")), page)
            }
            Err(e) => Ok(upstream_refusal("list_articles", e)),
        }
    }

    /// Saves an article upstream.
    #[tool(
        description = "Save an article (title, body).",
        annotations(read_only_hint = false, destructive_hint = false, open_world_hint = true)
    )]
    async fn save_article(&self, Parameters(args): Parameters<SaveArticleArgs>) -> Result<CallToolResult, ErrorData> {
        let article = NewArticle { title: args.title, body: args.body };
        match self.observe("save_article", self.app.upstream.save_article(&article).await) {
            Ok(saved) => success(format!("Saved article {} \"{}\".", saved.id, saved.title), saved),
            Err(e) => Ok(upstream_refusal("save_article", e)),
        }
    }

    /// Submits an image job.
    #[tool(
        description = "Generate an image from a prompt (at most 4000 characters). Returns at once \
                       with a predict_id; poll get_prediction after next_poll_in_seconds.",
        annotations(read_only_hint = false, destructive_hint = false, open_world_hint = true)
    )]
    async fn generate_image(
        &self,
        Parameters(args): Parameters<GenerateImageArgs>,
        Extension(caller): Extension<Caller>,
    ) -> Result<CallToolResult, ErrorData> {
        let job = NewPrediction { kind: PredictionKind::Image, prompt: args.prompt, image_url: None };
        self.submit("generate_image", &caller, job).await
    }

    /// Submits a video job.
    #[tool(
        description = "Generate a video from an image URL and a prompt. Returns at once with a \
                       predict_id; poll get_prediction after next_poll_in_seconds.",
        annotations(read_only_hint = false, destructive_hint = false, open_world_hint = true)
    )]
    async fn generate_image_to_video(
        &self,
        Parameters(args): Parameters<GenerateVideoArgs>,
        Extension(caller): Extension<Caller>,
    ) -> Result<CallToolResult, ErrorData> {
        let job = NewPrediction { kind: PredictionKind::Video, prompt: args.prompt, image_url: Some(args.image_url) };
        self.submit("generate_image_to_video", &caller, job).await
    }

    /// Reads a job's status.
    #[tool(
        description = "Status of an image or video job: starting, processing, succeeded (with output URL), failed \
                       or canceled. While pending it says when to poll next; earlier polls are answered from \
                       cache with the remaining wait.",
        annotations(read_only_hint = true, open_world_hint = true)
    )]
    async fn get_prediction(
        &self,
        Parameters(args): Parameters<GetPredictionArgs>,
        Extension(caller): Extension<Caller>,
    ) -> Result<CallToolResult, ErrorData> {
        let book = &self.app.predictions;
        match book.gate(caller.id(), &args.predict_id) {
            PollGate::NotYours => Ok(unknown_prediction()),
            PollGate::Answer { last, wait } => report(last, Some(ceil_secs(wait))),
            PollGate::Due => {
                match self.observe("get_prediction", self.app.upstream.get_prediction(&args.predict_id).await) {
                    Ok(prediction) => {
                        let hint = self.poll_hint_secs(prediction.kind);
                        book.record(caller.id(), prediction.clone(), hint * NANOS_PER_SEC);
                        report(prediction, Some(hint))
                    }
                    Err(UpstreamError::NotFound) => Ok(unknown_prediction()),
                    Err(e) => Ok(upstream_refusal("get_prediction", e)),
                }
            }
        }
    }

    /// The caller's own budgets.
    #[tool(
        description = "Your own budgets: for each scope its algorithm, limit, tokens remaining and when it is full \
                       again, plus what each tool costs. Free; use it to plan instead of hitting limits.",
        annotations(read_only_hint = true, open_world_hint = false)
    )]
    async fn rate_limit_status(
        &self,
        Parameters(_): Parameters<NoArgs>,
        Extension(caller): Extension<Caller>,
    ) -> Result<CallToolResult, ErrorData> {
        let budgets = self.app.guard.status(&caller, self.transport == crate::mcp::Transport::Http);
        let lines: Vec<String> = budgets
            .iter()
            .map(|b| {
                format!(
                    "{}: {} of {} left, full in {} s",
                    b.scope,
                    b.remaining,
                    b.limit,
                    b.reset_after_ms.div_ceil(1000)
                )
            })
            .collect();
        let costs: BTreeMap<String, u64> =
            self.app.guard.policy().tools.iter().map(|(tool, policy)| (tool.clone(), policy.cost)).collect();
        let price: Vec<String> = costs.iter().map(|(t, c)| format!("{t} {c}")).collect();
        success(
            format!("{}. Costs: {}.", lines.join("; "), price.join(", ")),
            StatusReport { caller: caller.id().to_owned(), budgets, costs },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_routed_tool_is_in_the_catalog_and_back() {
        let routed: Vec<String> = McpServer::tool_router().list_all().into_iter().map(|t| t.name.to_string()).collect();
        let mut names: Vec<String> = TOOL_NAMES.iter().map(|s| s.to_string()).collect();
        names.sort();
        assert_eq!(routed, names);
        for name in TOOL_NAMES {
            // Each catalogued tool has a validator (an unknown one would say "unknown tool").
            let r = validate_arguments(name, None);
            assert!(r.as_ref().err().is_none_or(|e| !e.message.contains("unknown tool")), "{name}");
        }
    }

    #[test]
    fn over_long_prompt_is_refused_with_its_length() {
        let args = serde_json::json!({"prompt": "x".repeat(MAX_PROMPT_CHARS + 1)});
        let r = validate_arguments("generate_image", args.as_object()).expect_err("must refuse");
        assert!(r.message.contains("4001") && r.message.contains("4000"), "{}", r.message);
    }
}
