//! The tools: thin wrappers over the paid API, each with a schema that states its limits.
//!
//! Each tool is declared once, in [`TOOLS`]: its name, what it reaches (the paid API, a job of
//! which class, or only the caller's own state), whether asking again can be a loop, its arguments
//! type and its `#[tool]` method. That one entry builds rmcp's router, the [`catalogue`] the
//! limits are checked against, the argument checks and the refusals before anything is charged
//! ([`validate_arguments`], `before_charging`) and the loop exemption (`loop_exempt`).
//!
//! Tools never check budgets themselves: the one guarded call ([`crate::guard::call`], under
//! [`PaidTools`](super::server::PaidTools)' rules) has already validated their arguments and
//! charged the caller before a tool body runs. A tool only turns upstream answers into results,
//! and upstream failures into refusals that carry the wait. The job tools take over what the
//! admission holds (their in-flight slots) and hand it to the job, which gives it back when the
//! job is final.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use rmcp::handler::server::router::tool::{ToolRoute, ToolRouter};
use rmcp::handler::server::tool::Extension;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, ContentBlock, JsonObject};
use rmcp::{ErrorData, tool};
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::clock::{Nanos, ceil_ms, ceil_secs};
use crate::config::Catalogue;
use crate::guard::{Admission, BudgetStatus, Refusal, TakeOnce};
use crate::identity::Caller;
use crate::mcp::McpServer;
use crate::mcp::{limited, results};
use crate::state::PaidApi;
use crate::upstream::UpstreamError;
use crate::upstream::api::{ArticlePage, NewArticle, NewPrediction, PredictionKind, PredictionStatus};
use crate::upstream::classes::{ClassId, IMAGE, VIDEO};
use crate::upstream::jobs::{JobView, Owner};
use crate::upstream::queue::{QueueFull, Reservation};

/// What a tool reaches, as the limits and the checks before charging must know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    /// One request to the paid API, answered when it returns: refused before anything is charged
    /// while the API's circuit breaker is open.
    Upstream,
    /// A job of this class on the paid API: refused before anything is charged while the breaker
    /// is open or the account's queue has no place for it; the call holds the caller's in-flight
    /// slots until the job is final.
    Job(ClassId),
    /// Only the caller's own state (its jobs, its budgets): two callers asking the same get
    /// different answers.
    Caller,
}

/// Whether asking the same again can be a loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Repeats {
    /// The same call again counts towards a loop.
    Loop,
    /// Never a loop: asking again is how it is meant to be used, and its answer changes with time.
    Never,
    /// Never a loop while the job its `predict_id` names is pending: a poll is answered with the
    /// wait left, however often it comes. Re-reading a final job is a loop: its answer will not
    /// change.
    WhileJobPending,
}

/// One tool of ours, declared once: everything the router, the catalogue, the checks before
/// charging and loop detection read of it.
pub struct Declaration {
    /// Its name: the name of its `#[tool]` method.
    pub name: &'static str,
    /// What it reaches.
    pub reach: Reach,
    /// Whether asking the same again can be a loop.
    pub repeats: Repeats,
    /// Its arguments checked before anything is charged (their schema, and the limits the
    /// schema cannot say), answered in canonical form: `parse::<T>` of the arguments type `T`
    /// its method takes, or `Err` with what is wrong.
    pub check: fn(Option<&JsonObject>) -> Result<serde_json::Value, String>,
    /// Its `#[tool]` method (its description, schemas and annotations), as rmcp routes it.
    pub route: fn() -> ToolRoute<McpServer>,
}

impl std::fmt::Debug for Declaration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Declaration")
            .field("name", &self.name)
            .field("reach", &self.reach)
            .field("repeats", &self.repeats)
            .finish_non_exhaustive()
    }
}

/// Our tools, each declared once. A tool added is an entry here, its arguments type and its
/// `#[tool]` method below — and a `[tools.NAME]` price in `config.toml`.
pub static TOOLS: &[Declaration] = &[
    Declaration {
        name: "list_articles",
        reach: Reach::Upstream,
        repeats: Repeats::Loop,
        check: parse::<ListArticlesArgs>,
        route: || ToolRoute::new(McpServer::list_articles_tool_attr(), McpServer::list_articles),
    },
    Declaration {
        name: "save_article",
        reach: Reach::Upstream,
        repeats: Repeats::Loop,
        check: parse::<SaveArticleArgs>,
        route: || ToolRoute::new(McpServer::save_article_tool_attr(), McpServer::save_article),
    },
    Declaration {
        name: "generate_image",
        reach: Reach::Job(IMAGE),
        repeats: Repeats::Loop,
        check: parse::<GenerateImageArgs>,
        route: || ToolRoute::new(McpServer::generate_image_tool_attr(), McpServer::generate_image),
    },
    Declaration {
        name: "generate_image_to_video",
        reach: Reach::Job(VIDEO),
        repeats: Repeats::Loop,
        check: parse::<GenerateVideoArgs>,
        route: || ToolRoute::new(McpServer::generate_image_to_video_tool_attr(), McpServer::generate_image_to_video),
    },
    Declaration {
        name: "get_prediction",
        reach: Reach::Caller,
        repeats: Repeats::WhileJobPending,
        check: parse::<PredictionArgs>,
        route: || ToolRoute::new(McpServer::get_prediction_tool_attr(), McpServer::get_prediction),
    },
    Declaration {
        name: "cancel_prediction",
        reach: Reach::Caller,
        repeats: Repeats::Loop,
        check: parse::<PredictionArgs>,
        route: || ToolRoute::new(McpServer::cancel_prediction_tool_attr(), McpServer::cancel_prediction),
    },
    Declaration {
        name: "rate_limit_status",
        reach: Reach::Caller,
        repeats: Repeats::Never,
        check: parse::<NoArgs>,
        route: || ToolRoute::new(McpServer::rate_limit_status_tool_attr(), McpServer::rate_limit_status),
    },
];

/// The declaration of `tool`, if it is one of ours.
fn declared(tool: &str) -> Option<&'static Declaration> {
    TOOLS.iter().find(|d| d.name == tool)
}

impl McpServer {
    /// rmcp's router of our tools, built from their declarations ([`TOOLS`]).
    pub(crate) fn tool_router() -> ToolRouter<Self> {
        TOOLS.iter().fold(ToolRouter::new(), |router, tool| router.with_route((tool.route)()))
    }
}

/// The tools this server offers, as its limits must know them, from their declarations
/// ([`TOOLS`]): a tool declared is in the catalogue (and needs a cost in the config).
pub fn catalogue() -> Catalogue {
    TOOLS.iter().fold(Catalogue::new(), |catalogue, tool| {
        // A price formula may read only the arguments a tool takes.
        let route = (tool.route)();
        let arguments: Vec<String> = route
            .attr
            .input_schema
            .get("properties")
            .and_then(|p| p.as_object())
            .map(|p| p.keys().cloned().collect())
            .unwrap_or_default();
        let catalogue = catalogue.arguments(tool.name, arguments);
        match tool.reach {
            Reach::Upstream => catalogue.tool(tool.name),
            Reach::Job(_) => catalogue.job(tool.name),
            Reach::Caller => catalogue.own_answer(tool.name),
        }
    })
}

/// Whether `tool` starts a job that holds in-flight slots until it is final.
pub fn starts_job(tool: &str) -> bool {
    job_class(tool).is_some()
}

/// The class of the jobs `tool` starts, if it starts any.
pub(crate) fn job_class(tool: &str) -> Option<ClassId> {
    match declared(tool)?.reach {
        Reach::Job(class) => Some(class),
        Reach::Upstream | Reach::Caller => None,
    }
}

/// Longest prompt accepted, in characters.
pub const MAX_PROMPT_CHARS: usize = 4000;
const MAX_TITLE_CHARS: usize = 200;
const MAX_BODY_CHARS: usize = 100_000;
const MAX_URL_CHARS: usize = 2048;
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

/// Parses and checks `args`, answering them in canonical form: every default filled in, so
/// `{}` and `{"limit": 10}` are the same call to loop detection.
fn parse<T: DeserializeOwned + Serialize + Validate>(args: Option<&JsonObject>) -> Result<serde_json::Value, String> {
    let value = serde_json::Value::Object(args.cloned().unwrap_or_default());
    let parsed: T = serde_json::from_value(value).map_err(|e| e.to_string())?;
    parsed.validate()?;
    serde_json::to_value(&parsed).map_err(|e| e.to_string())
}

/// Checks `args` against the tool's schema and size limits, before anything is charged, and
/// answers them in canonical form.
pub fn validate_arguments(tool: &str, args: Option<&JsonObject>) -> Result<serde_json::Value, Refusal> {
    let checked = match declared(tool) {
        Some(declared) => (declared.check)(args),
        None => Err("unknown tool".to_owned()),
    };
    checked.map_err(|problem| Refusal::invalid_arguments(tool, &problem))
}

/// `list_articles` arguments. Every field is optional.
#[derive(Debug, Deserialize, Serialize, JsonSchema)]
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
#[derive(Debug, Deserialize, Serialize, JsonSchema)]
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
#[derive(Debug, Deserialize, Serialize, JsonSchema)]
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
#[derive(Debug, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct GenerateVideoArgs {
    /// The http(s) URL of the first frame.
    #[schemars(length(min = 1, max = 2048))]
    pub image_url: String,
    /// How the scene should move (at most 4000 characters).
    #[schemars(length(min = 1, max = 4000))]
    pub prompt: String,
    /// The clip's length in seconds (1-30; the price follows it).
    #[serde(default = "default_video_seconds")]
    #[schemars(range(min = 1, max = 30))]
    pub seconds: u32,
}

fn default_video_seconds() -> u32 {
    crate::upstream::api::DEFAULT_VIDEO_SECONDS
}

/// The longest clip a video job may ask for.
const MAX_VIDEO_SECONDS: u32 = 30;

impl Validate for GenerateVideoArgs {
    fn validate(&self) -> Result<(), String> {
        if !(1..=MAX_VIDEO_SECONDS).contains(&self.seconds) {
            return Err(format!("`seconds` must be between 1 and {MAX_VIDEO_SECONDS} (got {})", self.seconds));
        }
        not_blank("prompt", &self.prompt)?;
        at_most("prompt", &self.prompt, MAX_PROMPT_CHARS)?;
        at_most("image_url", &self.image_url, MAX_URL_CHARS)?;
        match reqwest::Url::parse(&self.image_url) {
            Ok(u) if matches!(u.scheme(), "http" | "https") => Ok(()),
            _ => Err("`image_url` must be an http or https URL".to_owned()),
        }
    }
}

/// `get_prediction` and `cancel_prediction` arguments.
#[derive(Debug, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PredictionArgs {
    /// The `predict_id` returned by generate_image or generate_image_to_video.
    #[schemars(length(min = 1, max = 64), regex(pattern = r"^[A-Za-z0-9_-]+$"))]
    pub predict_id: String,
}

impl Validate for PredictionArgs {
    fn validate(&self) -> Result<(), String> {
        let ok = !self.predict_id.is_empty()
            && self.predict_id.len() <= 64
            && self.predict_id.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if ok { Ok(()) } else { Err("`predict_id` must be 1-64 characters of A-Z, a-z, 0-9, _ or -".to_owned()) }
    }
}

/// No arguments.
#[derive(Debug, Deserialize, Serialize, JsonSchema)]
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
    /// Pass to get_prediction (or cancel_prediction).
    pub predict_id: String,
    /// Where the job is.
    pub status: PredictionStatus,
    /// Poll get_prediction no sooner than this (it covers any wait in the submission queue).
    pub next_poll_in_seconds: u64,
    /// While waiting to be submitted: the place in the queue (1 is next).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_position: Option<usize>,
    /// Units this job's price reserved in your budgets; get_prediction says what it was charged
    /// once it is final.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reserved: Option<u64>,
}

/// What get_prediction and cancel_prediction answer.
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
    /// While waiting to be submitted: the place in the queue (1 is next).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_position: Option<usize>,
    /// Units the job's price reserved in your budgets.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reserved: Option<u64>,
    /// Once final: units it was charged, settled from what the upstream billed (the rest of the
    /// reservation given back, or more taken).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub charged: Option<u64>,
    /// What the upstream billed for it, once final.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<crate::upstream::api::Usage>,
}

/// One of the caller's jobs in flight, in rate_limit_status.
#[derive(Debug, Serialize, JsonSchema)]
pub struct JobInFlight {
    /// The job.
    pub predict_id: String,
    /// Image or video.
    pub kind: PredictionKind,
    /// Where the job is.
    pub status: PredictionStatus,
    /// Poll get_prediction for it no sooner than this.
    pub next_poll_in_seconds: u64,
    /// While waiting to be submitted: the place in the queue (1 is next).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_position: Option<usize>,
}

/// The upstream account and the fair queue in front of it, in rate_limit_status.
#[derive(Debug, Serialize, JsonSchema)]
pub struct QueueStatus {
    /// Predictions the account runs now, everyone's.
    pub account_in_flight: usize,
    /// Predictions the account runs at once: learnt from its answers when `account_adaptive`.
    pub account_max_in_flight: usize,
    /// Whether `account_max_in_flight` is learnt (`[upstream.adaptive]`), under the static cap
    /// `account_ceiling`.
    pub account_adaptive: bool,
    /// The static cap, `upstream.max_in_flight`.
    pub account_ceiling: usize,
    /// Jobs waiting for the account now, everyone's.
    pub waiting: usize,
    /// The most jobs that may wait.
    pub max_waiting: usize,
    /// Video jobs waiting now.
    pub videos_waiting: usize,
    /// The most video jobs that may wait.
    pub max_videos_waiting: usize,
    /// Least time between two video submissions, in milliseconds.
    pub video_min_gap_ms: u64,
    /// For a caller without a configured key: the share of the account and of the queue that
    /// such callers hold together, and may hold.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unverified_share: Option<UnverifiedShare>,
    /// When `[upstream.reserved]` or `[upstream.priority]` names the caller's tier: its rank and
    /// its reserved share of the account and the queue.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tier: Option<TierShare>,
}

/// A tier's rank and reserved share of the upstream account and its queue.
#[derive(Debug, Serialize, JsonSchema)]
pub struct TierShare {
    /// The caller's tier.
    pub tier: String,
    /// Its rank when the account is full: the waiting jobs of the highest rank go first.
    pub rank: i64,
    /// Whether the caller's jobs draw on the reservation (a caller without a configured key's
    /// never do).
    pub draws_on_reservation: bool,
    /// The account's slots reserved for the tier: a job of the tier gets the next slot that frees
    /// while the tier holds fewer.
    pub reserved_slots: usize,
    /// The queue's places reserved for it, never given to another tier.
    pub reserved_places: usize,
    /// Its jobs the account runs now.
    pub in_flight: usize,
    /// Its jobs waiting now.
    pub waiting: usize,
}

/// The account's slots and queue places that callers without a configured key share.
#[derive(Debug, Serialize, JsonSchema)]
pub struct UnverifiedShare {
    /// Their jobs the account runs now.
    pub in_flight: usize,
    /// The most of those it runs at once.
    pub max_in_flight: usize,
    /// Their jobs waiting now.
    pub waiting: usize,
    /// The most of those that may wait.
    pub max_waiting: usize,
}

/// What rate_limit_status answers.
#[derive(Debug, Serialize, JsonSchema)]
pub struct StatusReport {
    /// The caller these budgets belong to (a hash, never a credential).
    pub caller: String,
    /// Each budget a call draws on, the in-flight caps among them.
    pub budgets: Vec<BudgetStatus>,
    /// The caller's jobs not final yet (waiting in the queue or running), oldest first.
    pub jobs_in_flight: Vec<JobInFlight>,
    /// The upstream account and the queue jobs wait in for it.
    pub upstream_queue: QueueStatus,
    /// What each tool costs (at most, for a tool priced by its arguments).
    pub costs: BTreeMap<String, u64>,
    /// The tools priced by their arguments, and the formula (held to `costs`).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub cost_formulas: BTreeMap<String, String>,
}

/// What an agent reads of a page of articles: the titles, and how to get more — or, for an empty
/// page, a sentence that says so and what to try instead.
fn articles_found(query: Option<&str>, page: &ArticlePage) -> String {
    let more = page.next_cursor.as_deref().map(|c| format!(" More with cursor \"{c}\".")).unwrap_or_default();
    let titles: Vec<&str> = page.articles.iter().map(|a| a.title.as_str()).collect();
    match (titles.as_slice(), query) {
        ([], Some(query)) => {
            format!("No articles match \"{query}\". Try fewer or other words, or no query to list them all.")
        }
        ([], None) => format!("There are no articles on this page.{more}"),
        ([one], _) => format!("1 article: {one}.{more}"),
        (titles, _) => format!("{} articles: {}.{more}", titles.len(), titles.join("; ")),
    }
}

/// What the doors may add to a successful answer of ours once the tool has answered
/// ([`results::priced`], [`results::reused`], [`results::with_warnings`]): every tool's
/// `outputSchema` admits these, so a client that checks structured content against it (the
/// official Python SDK does) accepts every answer. Only its schema is ever built.
#[derive(JsonSchema)]
#[allow(dead_code)]
struct Added {
    /// Units this call's price reserved in your budgets.
    reserved: Option<u64>,
    /// Units it was charged, settled from what the upstream reported it used.
    charged: Option<u64>,
    /// Answered from an identical call's answer, kept for `cache_ttl_ms`: no upstream request.
    cached: Option<bool>,
    /// Answered by an identical call's request in flight at the same time.
    coalesced: Option<bool>,
    /// The limits this call left close to their end, to plan with.
    warnings: Option<Vec<crate::guard::Warning>>,
}

/// The `outputSchema` of a tool of ours whose successful answer is a `T`: `T`'s (what it
/// serialises to), with what [`Added`] may add as optional properties; or, for a refusal (an
/// `isError` result, which some clients check too: the MCP Inspector 2.12 does), the refusal's
/// `{"error": {…}}`. Either `T`'s required properties, or `error`.
///
/// The two job tools declare none: to a client that speaks tasks they answer a task handle, which
/// has no structured content (a client that checks the handle against a schema, as the MCP
/// Inspector 2.12 does, would refuse it), and the task's result is a [`PredictionReport`], not the
/// [`Submitted`] a client without tasks gets.
fn output_schema<T: JsonSchema + 'static>() -> Arc<JsonObject> {
    use rmcp::handler::server::tool::schema_for_output;
    // Built once per type: every session's router holds the same schemas, not copies of its own.
    static BUILT: std::sync::LazyLock<Mutex<BTreeMap<std::any::TypeId, Arc<JsonObject>>>> =
        std::sync::LazyLock::new(Mutex::default);
    let mut built = BUILT.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(schema) = built.get(&std::any::TypeId::of::<T>()) {
        return schema.clone();
    }
    let mut schema = schema_for_output::<T>().as_ref().clone();
    let added = schema_for_output::<Added>();
    for section in ["properties", "$defs"] {
        let Some(serde_json::Value::Object(more)) = added.get(section) else { continue };
        let entry = schema.entry(section).or_insert_with(|| serde_json::Value::Object(JsonObject::new()));
        if let serde_json::Value::Object(into) = entry {
            for (name, value) in more {
                into.entry(name.clone()).or_insert_with(|| value.clone());
            }
        }
    }
    let refusal = serde_json::json!({
        "type": "object",
        "description": "Why the call was refused, and how long to wait: code, message, retry_after_ms, and where \
                        known scope, limit and remaining.",
        "required": ["code", "message"],
    });
    if let Some(serde_json::Value::Object(properties)) = schema.get_mut("properties") {
        // A failed job's report has an `error` of its own (the reason, a string).
        let error = match properties.remove("error") {
            Some(own) => serde_json::json!({"anyOf": [own, refusal]}),
            None => refusal,
        };
        properties.insert("error".into(), error);
    }
    let required = schema.remove("required").unwrap_or_else(|| serde_json::json!([]));
    schema.insert("anyOf".into(), serde_json::json!([{"required": required}, {"required": ["error"]}]));
    let schema = Arc::new(schema);
    built.insert(std::any::TypeId::of::<T>(), schema.clone());
    schema
}

fn success(summary: String, structured: impl Serialize) -> Result<CallToolResult, ErrorData> {
    let value = serde_json::to_value(structured).map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
    let mut result = CallToolResult::success(vec![ContentBlock::text(summary)]);
    result.structured_content = Some(value);
    Ok(result)
}

/// How long to tell an agent to wait after an upstream failure without a Retry-After.
const UPSTREAM_FAILURE_WAIT_MS: u64 = 5_000;

fn upstream_refusal(tool: &str, error: UpstreamError) -> CallToolResult {
    let refusal = match error {
        UpstreamError::RateLimited { retry_after } => {
            // The upstream's Retry-After is a floor: never tell the agent to come back sooner.
            let floor = retry_after.map_or(1_000, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
            Refusal::upstream_rate_limited(tool, floor.max(1_000))
        }
        UpstreamError::NotFound => Refusal::invalid_arguments(tool, "the upstream does not know that id"),
        UpstreamError::Rejected(detail) => Refusal::invalid_arguments(tool, &detail),
        // Not the agent's doing, and no retry fixes it: the operator's credential is wrong.
        error @ UpstreamError::Unauthorized(_) => {
            Refusal::upstream_unavailable(tool, &error.to_string(), UPSTREAM_FAILURE_WAIT_MS)
        }
        UpstreamError::Unavailable(detail) | UpstreamError::NoAnswer(detail) => {
            Refusal::upstream_unavailable(tool, &detail, UPSTREAM_FAILURE_WAIT_MS)
        }
        UpstreamError::CircuitOpen { retry_after } => breaker_open(tool, retry_after),
    };
    tracing::warn!(tool, code = refusal.code.as_str(), "upstream refusal");
    results::tool_result(&refusal)
}

fn breaker_open(tool: &str, retry_after: Nanos) -> Refusal {
    Refusal::upstream_unavailable(tool, "it failed repeatedly and the circuit breaker is open", ceil_ms(retry_after))
}

/// Someone else's job, or none at all: the same answer, so a `predict_id` never leaks.
fn unknown_prediction(tool: &str) -> CallToolResult {
    results::tool_result(&Refusal::invalid_arguments(tool, "no prediction with that predict_id"))
}

/// Whole seconds to tell an agent to wait, never zero while something is pending.
fn wait_secs(wait: Nanos) -> u64 {
    ceil_secs(wait).max(1)
}

fn ordinal(place: usize) -> String {
    let suffix = match (place % 10, place % 100) {
        (1, n) if n != 11 => "st",
        (2, n) if n != 12 => "nd",
        (3, n) if n != 13 => "rd",
        _ => "th",
    };
    format!("{place}{suffix}")
}

fn status_word(status: PredictionStatus) -> &'static str {
    match status {
        PredictionStatus::Starting => "starting",
        PredictionStatus::Processing => "processing",
        PredictionStatus::Succeeded => "succeeded",
        PredictionStatus::Failed => "failed",
        PredictionStatus::Canceled => "canceled",
    }
}

/// The text and structured report of a job, as get_prediction and cancel_prediction answer.
pub(crate) fn report(view: JobView) -> Result<CallToolResult, ErrorData> {
    let JobView { prediction, wait, queue_ahead, reserved, charged, .. } = view;
    let id = &prediction.id;
    let queue_position = queue_ahead.map(|ahead| ahead + 1);
    let summary = match (prediction.status, &prediction.output, &prediction.error) {
        (PredictionStatus::Succeeded, Some(url), _) => {
            format!("Prediction {id} succeeded: {url}{}", charged_words(reserved, charged))
        }
        (PredictionStatus::Failed, _, reason) => {
            let reason = reason.as_deref().unwrap_or("no reason given");
            format!("Prediction {id} failed: {reason}{}", charged_words(reserved, charged))
        }
        (PredictionStatus::Canceled, _, _) => {
            format!("Prediction {id} was canceled{}", charged_words(reserved, charged))
        }
        (status, _, _) => {
            let place =
                queue_position.map(|p| format!(", {} in the queue for submission", ordinal(p))).unwrap_or_default();
            format!(
                "Prediction {id} is {}{place}. Call get_prediction again in {} seconds.",
                status_word(status),
                wait_secs(wait.unwrap_or(0))
            )
        }
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
            next_poll_in_seconds: pending.then(|| wait_secs(wait.unwrap_or(0))),
            queue_position,
            reserved,
            charged,
            usage: prediction.usage,
        },
    )
}

/// The end of a final job's sentence: what it was charged of what it reserved.
fn charged_words(reserved: Option<u64>, charged: Option<u64>) -> String {
    match (reserved, charged) {
        (Some(reserved), Some(charged)) => format!(" (charged {charged} of the {reserved} units reserved)."),
        _ => ".".to_owned(),
    }
}

fn submitted(view: JobView, reserved: Option<u64>) -> Result<CallToolResult, ErrorData> {
    let id = view.prediction.id.clone();
    let what = if view.prediction.kind == PredictionKind::Image { "Image" } else { "Video" };
    let hint = wait_secs(view.wait.unwrap_or(0));
    let queue_position = view.queue_ahead.map(|ahead| ahead + 1);
    let place = queue_position
        .map(|p| format!(" It is {} in the queue for submission to the upstream.", ordinal(p)))
        .unwrap_or_default();
    success(
        format!("{what} job {id} accepted.{place} Call get_prediction with this predict_id in {hint} seconds."),
        Submitted {
            predict_id: id,
            status: view.prediction.status,
            next_poll_in_seconds: hint,
            queue_position,
            reserved,
        },
    )
}

impl McpServer {
    /// Counts an upstream answer in `mcp_ratelimit_upstream_requests_total` and passes it on.
    fn observe<T>(&self, tool: &str, answer: Result<T, UpstreamError>) -> Result<T, UpstreamError> {
        self.app.limits.metrics().upstream(tool, UpstreamError::outcome_of(&answer));
        answer
    }

    /// Who a job belongs to, and the flow it waits in ([`Owner::of`]).
    fn owner_of(&self, caller: &Caller) -> Owner {
        Owner::of(caller, &self.app.limits.guard().policy(), self.own.jobs.queue().rules())
    }

    /// Starts a job with what `call_tool` handed over: the admission and the queue place.
    async fn start_job(
        &self,
        tool: &str,
        caller: &Caller,
        job: NewPrediction,
        admission: &TakeOnce<Admission>,
        place: &TakeOnce<Reservation>,
    ) -> Result<CallToolResult, ErrorData> {
        let place = place.take().ok_or_else(|| ErrorData::internal_error("a job ran without its queue place", None))?;
        let mut admission = held(admission)?;
        let reservation = admission.reserved();
        let slots = Box::new(admission);
        match self.own.jobs.start(&self.owner_of(caller), tool, job, place, slots).await {
            // The job settles its price when it is final.
            Ok(view) => {
                let reserved = reservation.map(|r| self.own.jobs.bill(&view.prediction.id, r));
                submitted(view, reserved)
            }
            // Its one attempt failed: charged as the settlement rule says (a failed upstream call
            // is still charged; see `guard::settle`).
            Err(e) => {
                let refusal = upstream_refusal(tool, e);
                match reservation {
                    Some(reservation) => {
                        Ok(limited::settled(refusal, reservation, limited::AddTo::StructuredContent).await)
                    }
                    None => Ok(refusal),
                }
            }
        }
    }
}

/// What must hold before `tool` is charged, with what it must carry to the tool body: the
/// upstream must not be known down (circuit breaker open), and a job needs a place in the queue
/// for the upstream account, in case it has to wait for a slot.
pub(crate) fn before_charging(own: &PaidApi, tool: &str, caller: &Caller) -> Result<Option<Reservation>, Refusal> {
    let Some(declared) = declared(tool) else { return Ok(None) };
    if declared.reach != Reach::Caller
        && let Some(open_for) = own.upstream.open_for()
    {
        return Err(breaker_open(tool, open_for));
    }
    let Reach::Job(class) = declared.reach else { return Ok(None) };
    let standing = own.jobs.queue().rules().standing(caller.tier(), caller.unverified_from().is_some());
    own.jobs.reserve(class, standing).map(Some).map_err(|(full, wait)| match full {
        QueueFull::Full => Refusal::queue_full(tool, wait),
        QueueFull::UnverifiedShare { slots, places } => Refusal::unverified_share_full(tool, wait, slots, places),
        QueueFull::Reserved => Refusal::queue_reserved(tool, wait),
    })
}

/// Whether this call can never be a loop, as its tool's declaration says ([`Repeats`]): asking
/// again is how it is meant to be used and its answer changes with time.
pub(crate) fn loop_exempt(own: &PaidApi, tool: &str, args: &serde_json::Value, caller: &Caller) -> bool {
    match declared(tool).map(|d| d.repeats) {
        Some(Repeats::Never) => true,
        Some(Repeats::WhileJobPending) => {
            args["predict_id"].as_str().is_some_and(|id| own.jobs.is_pending(caller.id(), id))
        }
        Some(Repeats::Loop) | None => false,
    }
}

/// A busy refusal for a job tool, made specific: the caller's jobs and when to look again.
pub(crate) fn explain_busy(own: &PaidApi, tool: &str, refusal: Refusal, caller: &Caller) -> Refusal {
    let jobs = &own.jobs;
    let mine = jobs.pending_of(caller.id()).into_iter().map(|v| v.prediction.id).collect();
    refusal.with_jobs_in_flight(tool, mine, jobs.soonest_news(caller.id(), caller.tenant()))
}

/// The admission (in-flight slots) a job tool hands to its job.
fn held(admission: &TakeOnce<Admission>) -> Result<Admission, ErrorData> {
    admission.take().ok_or_else(|| ErrorData::internal_error("a job tool ran without its admission", None))
}

/// The tools' methods: each is routed by its entry in [`TOOLS`].
impl McpServer {
    /// Lists articles from the upstream, a page at a time.
    #[tool(
        description = "List articles whose titles match a query. Pages with `cursor`.",
        output_schema = output_schema::<crate::upstream::api::ArticlePage>(),
        annotations(read_only_hint = true, open_world_hint = true)
    )]
    async fn list_articles(&self, Parameters(args): Parameters<ListArticlesArgs>) -> Result<CallToolResult, ErrorData> {
        let query = Some(args.query.as_str()).filter(|q| !q.is_empty());
        let cursor = Some(args.cursor.as_str()).filter(|c| !c.is_empty());
        match self.observe("list_articles", self.own.upstream.list_articles(query, args.limit, cursor).await) {
            Ok(page) => {
                let text = articles_found(query, &page);
                success(text, page)
            }
            Err(e) => Ok(upstream_refusal("list_articles", e)),
        }
    }

    /// Saves an article upstream.
    #[tool(
        description = "Save an article (title, body).",
        output_schema = output_schema::<crate::upstream::api::SavedArticle>(),
        annotations(read_only_hint = false, destructive_hint = false, open_world_hint = true)
    )]
    async fn save_article(&self, Parameters(args): Parameters<SaveArticleArgs>) -> Result<CallToolResult, ErrorData> {
        let article = NewArticle { title: args.title, body: args.body };
        match self.observe("save_article", self.own.upstream.save_article(&article).await) {
            Ok(saved) => success(format!("Saved article {} \"{}\".", saved.id, saved.title), saved),
            Err(e) => Ok(upstream_refusal("save_article", e)),
        }
    }

    /// Submits an image job.
    #[tool(
        description = "Generate an image from a prompt (at most 4000 characters). Returns at once \
                       with a predict_id; poll get_prediction after next_poll_in_seconds. Each job \
                       holds one of your in-flight slots until it is final.",
        annotations(read_only_hint = false, destructive_hint = false, open_world_hint = true)
    )]
    async fn generate_image(
        &self,
        Parameters(args): Parameters<GenerateImageArgs>,
        Extension(caller): Extension<Caller>,
        Extension(admission): Extension<TakeOnce<Admission>>,
        Extension(place): Extension<TakeOnce<Reservation>>,
    ) -> Result<CallToolResult, ErrorData> {
        let job = NewPrediction { kind: PredictionKind::Image, prompt: args.prompt, image_url: None, seconds: None };
        self.start_job("generate_image", &caller, job, &admission, &place).await
    }

    /// Accepts a video job into the fair queue, where videos are spaced.
    #[tool(
        description = "Generate a video of `seconds` (1-30, default 5) from an image URL and a prompt. \
                       Returns at once with a predict_id: the job waits its turn in a queue that spaces \
                       submissions to the upstream, and next_poll_in_seconds covers that wait. Each job \
                       holds one of your in-flight slots until it is final. Its price follows its length: \
                       reserved when accepted, settled to what the upstream billed once final.",
        annotations(read_only_hint = false, destructive_hint = false, open_world_hint = true)
    )]
    async fn generate_image_to_video(
        &self,
        Parameters(args): Parameters<GenerateVideoArgs>,
        Extension(caller): Extension<Caller>,
        Extension(admission): Extension<TakeOnce<Admission>>,
        Extension(place): Extension<TakeOnce<Reservation>>,
    ) -> Result<CallToolResult, ErrorData> {
        let job = NewPrediction {
            kind: PredictionKind::Video,
            prompt: args.prompt,
            image_url: Some(args.image_url),
            seconds: Some(args.seconds),
        };
        self.start_job("generate_image_to_video", &caller, job, &admission, &place).await
    }

    /// Reads a job's status.
    #[tool(
        description = "Status of an image or video job: starting (perhaps still queued for submission), \
                       processing, succeeded (with output URL), failed (with the reason) or canceled. While \
                       pending it says when to poll next; earlier polls are answered with the wait left.",
        output_schema = output_schema::<PredictionReport>(),
        annotations(read_only_hint = true, open_world_hint = false)
    )]
    async fn get_prediction(
        &self,
        Parameters(args): Parameters<PredictionArgs>,
        Extension(caller): Extension<Caller>,
    ) -> Result<CallToolResult, ErrorData> {
        match self.own.jobs.poll(caller.id(), &args.predict_id).await {
            Some(view) => report(view),
            None => Ok(unknown_prediction("get_prediction")),
        }
    }

    /// Cancels one of the caller's jobs.
    #[tool(
        description = "Cancel one of your image or video jobs, upstream too; its in-flight slot is free at \
                       once. A job that already finished keeps its result.",
        output_schema = output_schema::<PredictionReport>(),
        annotations(read_only_hint = false, destructive_hint = true, idempotent_hint = true, open_world_hint = true)
    )]
    async fn cancel_prediction(
        &self,
        Parameters(args): Parameters<PredictionArgs>,
        Extension(caller): Extension<Caller>,
    ) -> Result<CallToolResult, ErrorData> {
        match self.own.jobs.cancel(caller.id(), &args.predict_id).await {
            Ok(Some(view)) => report(view),
            Ok(None) => Ok(unknown_prediction("cancel_prediction")),
            Err(e) => Ok(upstream_refusal("cancel_prediction", e)),
        }
    }

    /// The caller's own budgets.
    #[tool(
        description = "Your own budgets: for each scope its algorithm, limit, what remains and when it is full \
                       again (your jobs in flight among them), your jobs in flight, the video submission queue, \
                       and what each tool costs. Free; use it to plan instead of hitting limits.",
        output_schema = output_schema::<StatusReport>(),
        annotations(read_only_hint = true, open_world_hint = false)
    )]
    async fn rate_limit_status(
        &self,
        Parameters(_): Parameters<NoArgs>,
        Extension(caller): Extension<Caller>,
    ) -> Result<CallToolResult, ErrorData> {
        let Some(budgets) =
            self.app.limits.guard().status(&caller, self.transport == crate::mcp::Transport::Http).await
        else {
            return Ok(results::tool_result(&Refusal::limiter_unavailable("rate_limit_status", 1_000)));
        };
        let mut lines: Vec<String> = budgets
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
        let jobs_in_flight: Vec<JobInFlight> = self
            .own
            .jobs
            .pending_of(caller.id())
            .into_iter()
            .map(|v| JobInFlight {
                next_poll_in_seconds: wait_secs(v.wait.unwrap_or(0)),
                queue_position: v.queue_ahead.map(|ahead| ahead + 1),
                predict_id: v.prediction.id,
                kind: v.prediction.kind,
                status: v.prediction.status,
            })
            .collect();
        if !jobs_in_flight.is_empty() {
            let ids: Vec<&str> = jobs_in_flight.iter().map(|j| j.predict_id.as_str()).collect();
            lines.push(format!("jobs in flight: {}", ids.join(", ")));
        }
        let queue = self.own.jobs.queue();
        // The learnt limit another instance may have moved since this one last heard.
        queue.refresh_learnt().await;
        let rules = queue.rules_now();
        let occupancy = self.own.jobs.occupancy();
        let videos = rules.classes.get(VIDEO);
        let upstream_queue = QueueStatus {
            account_in_flight: occupancy.in_flight,
            account_max_in_flight: rules.max_in_flight,
            account_adaptive: queue.is_adaptive(),
            account_ceiling: queue.rules().max_in_flight,
            waiting: occupancy.waiting,
            max_waiting: rules.max_waiting,
            videos_waiting: occupancy.waiting_of(VIDEO),
            max_videos_waiting: videos.and_then(|c| c.queue_max).unwrap_or(0),
            video_min_gap_ms: videos.and_then(|c| c.min_gap).unwrap_or(0) / crate::clock::NANOS_PER_MS,
            unverified_share: caller.unverified_from().map(|_| UnverifiedShare {
                in_flight: occupancy.unverified_in_flight,
                max_in_flight: rules.unverified_slots,
                waiting: occupancy.unverified_waiting,
                max_waiting: rules.unverified_places,
            }),
            tier: occupancy.per_tier.into_iter().find(|t| t.tier == caller.tier()).map(|t| TierShare {
                draws_on_reservation: caller.unverified_from().is_none() && t.reserved_slots + t.reserved_places > 0,
                tier: t.tier,
                rank: t.rank,
                reserved_slots: t.reserved_slots,
                reserved_places: t.reserved_places,
                in_flight: t.in_flight,
                waiting: t.waiting,
            }),
        };
        lines.push(format!(
            "upstream account: {} of {} running, {} waiting",
            upstream_queue.account_in_flight, upstream_queue.account_max_in_flight, upstream_queue.waiting
        ));
        let policy = self.app.limits.guard().policy();
        let costs: BTreeMap<String, u64> = policy.tools.iter().map(|(tool, p)| (tool.clone(), p.cost)).collect();
        let cost_formulas: BTreeMap<String, String> =
            policy.tools.iter().filter_map(|(tool, p)| Some((tool.clone(), p.formula.as_ref()?.to_string()))).collect();
        let price: Vec<String> = costs
            .iter()
            .map(|(t, c)| match cost_formulas.get(t) {
                Some(formula) => format!("{t} {formula} (at most {c})"),
                None => format!("{t} {c}"),
            })
            .collect();
        success(
            format!("{}. Costs: {}.", lines.join("; "), price.join(", ")),
            StatusReport {
                caller: caller.id().to_owned(),
                budgets,
                jobs_in_flight,
                upstream_queue,
                costs,
                cost_formulas,
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_declaration_routes_its_own_method_under_its_name_once() {
        let router = McpServer::tool_router();
        let mut routed: Vec<String> = router.list_all().into_iter().map(|t| t.name.to_string()).collect();
        routed.sort();
        let mut declared: Vec<&str> = TOOLS.iter().map(|d| d.name).collect();
        declared.sort();
        assert_eq!(routed, declared, "one route per declaration, none twice");
        for tool in TOOLS {
            assert_eq!((tool.route)().name(), tool.name, "the declaration of {} routes another method", tool.name);
        }
    }

    #[test]
    fn the_catalogue_reads_what_each_tool_reaches_from_its_declaration() {
        let catalogue = catalogue();
        for (tool, job, callers_own) in [
            ("list_articles", false, false),
            ("save_article", false, false),
            ("generate_image", true, false),
            ("generate_image_to_video", true, false),
            ("get_prediction", false, true),
            ("cancel_prediction", false, true),
            ("rate_limit_status", false, true),
        ] {
            assert!(catalogue.contains(tool), "{tool}");
            assert_eq!(catalogue.holds_slots(tool), job, "{tool}");
            assert_eq!(starts_job(tool), job, "{tool}");
            assert_eq!(catalogue.answers_for_the_caller(tool), callers_own, "{tool}");
        }
        assert_eq!((job_class("generate_image"), job_class("generate_image_to_video")), (Some(IMAGE), Some(VIDEO)));
        let video = catalogue.arguments_of("generate_image_to_video").expect("known arguments");
        assert!(["image_url", "prompt", "seconds"].iter().all(|a| video.iter().any(|v| v == a)), "{video:?}");
    }

    #[test]
    fn every_routed_tool_is_in_the_catalogue_with_a_validator() {
        let catalogue = catalogue();
        assert_eq!(catalogue.names().count(), 7);
        assert!(catalogue.holds_slots("generate_image") && !catalogue.holds_slots("list_articles"));
        for name in catalogue.names() {
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
