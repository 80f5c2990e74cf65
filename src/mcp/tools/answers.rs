//! Upstream answers turned into results, and upstream failures into refusals that carry the
//! wait; a job started with what its call was admitted with.

use super::payloads::{PredictionReport, Submitted};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use rmcp::ErrorData;
use rmcp::model::{CallToolResult, ContentBlock, JsonObject};
use schemars::JsonSchema;
use serde::Serialize;

use crate::clock::{Nanos, ceil_ms, ceil_secs};
use crate::guard::{Admitted, Refusal};
use crate::identity::Caller;
use crate::mcp::McpServer;
use crate::mcp::results;
use crate::upstream::UpstreamError;
use crate::upstream::api::{ArticlePage, NewPrediction, PredictionKind, PredictionStatus};
use crate::upstream::jobs::{JobView, Owner};
use crate::upstream::queue::QueuePlace;

/// What an agent reads of a page of articles: the titles, and how to get more — or, for an empty
/// page, a sentence that says so and what to try instead.
pub(super) fn articles_found(query: Option<&str>, page: &ArticlePage) -> String {
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
    /// What to heed before the next call: the limits this call left close to their end, to plan
    /// with, and a tool that keeps giving you the same answer (stopped from the answer that makes
    /// `no_progress`).
    warnings: Option<Vec<AddedWarning>>,
}

/// One of [`Added`]'s `warnings`: a limit past its warning level ([`results::with_warnings`]), or
/// a tool giving the caller the same answer again and again ([`results::with_no_progress`]).
#[derive(JsonSchema)]
#[serde(untagged)]
#[allow(dead_code)]
enum AddedWarning {
    Limit(crate::guard::Warning),
    NoProgress(crate::guard::loops::NoProgress),
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
pub(super) fn output_schema<T: JsonSchema + 'static>() -> Arc<JsonObject> {
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

pub(super) fn success(summary: String, structured: impl Serialize) -> Result<CallToolResult, ErrorData> {
    let value = serde_json::to_value(structured).map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
    let mut result = CallToolResult::success(vec![ContentBlock::text(summary)]);
    result.structured_content = Some(value);
    Ok(result)
}

/// How long to tell an agent to wait after an upstream failure without a Retry-After.
const UPSTREAM_FAILURE_WAIT_MS: u64 = 5_000;

pub(super) fn upstream_refusal(tool: &str, error: UpstreamError) -> CallToolResult {
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
    Refusal::upstream_unavailable(tool, BREAKER_OPEN, ceil_ms(retry_after))
}

/// Why a tool that needs the paid API is refused while its breaker is open.
pub(super) const BREAKER_OPEN: &str = "it failed repeatedly and the circuit breaker is open";

/// Someone else's job, or none at all: the same answer, so a `predict_id` never leaks.
pub(super) fn unknown_prediction(tool: &str) -> CallToolResult {
    results::tool_result(&Refusal::invalid_arguments(tool, "no prediction with that predict_id"))
}

/// Whole seconds to tell an agent to wait, never zero while something is pending.
pub(super) fn wait_secs(wait: Nanos) -> u64 {
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
                wait_secs(wait.unwrap_or(Nanos::ZERO))
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
            next_poll_in_seconds: pending.then(|| wait_secs(wait.unwrap_or(Nanos::ZERO))),
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

fn submitted(view: JobView) -> Result<CallToolResult, ErrorData> {
    let id = view.prediction.id.clone();
    let what = if view.prediction.kind == PredictionKind::Image { "Image" } else { "Video" };
    let hint = wait_secs(view.wait.unwrap_or(Nanos::ZERO));
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
            reserved: view.reserved,
        },
    )
}

impl McpServer {
    /// Counts an upstream answer in `mcp_ratelimit_upstream_requests_total` and passes it on.
    pub(super) fn observe<T>(&self, tool: &str, answer: Result<T, UpstreamError>) -> Result<T, UpstreamError> {
        self.app.limits.metrics().upstream(tool, UpstreamError::outcome_of(&answer));
        answer
    }

    /// Who a job belongs to, and the flow it waits in ([`Owner::of`]).
    fn owner_of(&self, caller: &Caller) -> Owner {
        Owner::of(caller, &self.app.limits.guard().policy(), self.own.jobs.queue().rules())
    }

    /// Starts a job with what its call was admitted with: the caller, the admission (its
    /// in-flight slots and price, which a job that starts holds until it is final) and the queue
    /// place.
    pub(super) async fn start_job(
        &self,
        tool: &str,
        job: NewPrediction,
        admitted: Admitted<Option<QueuePlace>>,
    ) -> Result<CallToolResult, ErrorData> {
        let Admitted { caller, admission, place } = admitted;
        let place = place.ok_or_else(|| ErrorData::internal_error("a job ran without its queue place", None))?;
        match self.own.jobs.start(&self.owner_of(&caller), tool, job, place, &admission).await {
            Ok(view) => submitted(view),
            // Its one attempt failed: the admission is still its call's, settled by the guard from
            // this answer as the rule says (a failed upstream call is still charged; see
            // `guard::after::settle`).
            Err(e) => Ok(upstream_refusal(tool, e)),
        }
    }
}
