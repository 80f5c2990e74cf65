//! The rmcp server handler, and the one door every tool call goes through.
//!
//! `call_tool` is written by hand instead of generated: it identifies the caller, validates the
//! arguments, and asks the [`Guard`](crate::guard::Guard) before the tool router runs anything.
//! A tool added to `tools.rs` is guarded without doing anything, and cannot opt out. Every
//! refused call, whatever refused it, is recorded for the dashboard on its way out.
//!
//! Image and video jobs are also MCP Tasks (the SEP-2663 extension) for clients that declare
//! it: the call answers a task whose `taskId` is the `predict_id` and whose `pollIntervalMs` is
//! the poll hint, and `tasks/get` / `tasks/cancel` read and cancel the same job in the job book
//! that `get_prediction` and `cancel_prediction` use. (rmcp's `TaskManager` would keep a second
//! copy of every job, on the wall clock; the job book already is the task store.)

use std::sync::Arc;

use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::tool::ToolCallContext;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CancelTaskParams, CreateTaskResult, DetailedTask, ErrorCode,
    GetTaskParams, GetTaskResult, Implementation, ListToolsResult, PaginatedRequestParams, ServerCapabilities,
    ServerConfig, Task, TaskPayload, TaskStatus,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler, tool_handler};

use crate::clock::NANOS_PER_MS;
use crate::guard::{MethodGroup, Refusal, RefusalCode, ToolCall};
use crate::identity::Caller;
use crate::mcp::tools::{self, TakeOnce};
use crate::mcp::{limited, results};
use crate::reuse::{Served, Sharing};
use crate::state::{AppState, OwnTools, ToolAnswer};
use crate::upstream::jobs::JobView;

/// Which transport a handler serves; decides where the caller comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// Streamable HTTP: the caller was identified by the HTTP layer.
    Http,
    /// stdio: one local caller.
    Stdio,
}

/// The MCP server: one per session (HTTP) or process (stdio), all sharing one [`AppState`].
#[derive(Clone)]
pub struct McpServer {
    pub(crate) app: Arc<AppState>,
    /// The paid API and its jobs.
    pub(crate) own: Arc<OwnTools>,
    pub(crate) transport: Transport,
    tool_router: ToolRouter<Self>,
}

impl McpServer {
    /// A handler over the shared state and our tools' upstream.
    pub fn new(app: Arc<AppState>, own: Arc<OwnTools>, transport: Transport) -> Self {
        Self { app, own, transport, tool_router: Self::tool_router() }
    }

    fn caller_of(&self, context: &RequestContext<RoleServer>) -> Result<Caller, ErrorData> {
        match self.transport {
            Transport::Stdio => Ok(self.app.limits.identifier().load().local()),
            Transport::Http => context
                .extensions
                .get::<http::request::Parts>()
                .and_then(|parts| parts.extensions.get::<Caller>())
                .cloned()
                // Falling back to a shared identity would merge every caller into one budget.
                .ok_or_else(|| ErrorData::internal_error("request reached a tool without a caller identity", None)),
        }
    }

    /// Charges a non-tool method to its per-caller limit; a refusal is a JSON-RPC error (there
    /// is no tool result to carry it) with the same structured data a tool refusal has.
    async fn admit_method(
        &self,
        context: &RequestContext<RoleServer>,
        group: MethodGroup,
        method: &str,
    ) -> Result<(), ErrorData> {
        let caller = self.caller_of(context)?;
        self.app.limits.guard().admit_method(&caller, group, method).await.map_err(|r| results::method_error(&r))
    }
}

fn unknown_task(id: &str) -> ErrorData {
    ErrorData::invalid_params(format!("unknown task: {id}"), None)
}

/// A job as an MCP Task: `working` while pending (the status message says where it is),
/// `completed` once final — with the same result `get_prediction` gives, an `isError` one for a
/// failed job, as SEP-2663 has tool errors — or `cancelled`.
fn task_of(view: JobView, ttl_ms: u64) -> Result<DetailedTask, ErrorData> {
    let created = chrono::DateTime::<chrono::Utc>::from(view.created).to_rfc3339();
    let poll_ms = view.wait.map(|w| w.div_ceil(NANOS_PER_MS).max(1));
    let status = view.prediction.status;
    let mut task =
        Task::new(view.prediction.id.clone(), TaskStatus::Working, created, rmcp::task_manager::current_timestamp())
            .with_ttl_ms(ttl_ms);
    task.poll_interval_ms = poll_ms;
    let payload = match status {
        crate::upstream::api::PredictionStatus::Canceled => TaskPayload::Cancelled,
        s if s.is_terminal() => {
            let failed = s == crate::upstream::api::PredictionStatus::Failed;
            let mut result = tools::report(view)?;
            if failed {
                result.is_error = Some(true);
            }
            match serde_json::to_value(result) {
                Ok(serde_json::Value::Object(result)) => TaskPayload::Completed { result },
                _ => return Err(ErrorData::internal_error("cannot encode the task result", None)),
            }
        }
        _ => {
            if let Some(text) = tools::report(view)?.content.first().and_then(|c| c.as_text()) {
                task.status_message = Some(text.text.clone());
            }
            TaskPayload::Working
        }
    };
    Ok(DetailedTask::new(task, payload))
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for McpServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().enable_tasks().build())
            .with_server_info(Implementation::new("mcp-ratelimit", env!("CARGO_PKG_VERSION")))
            .with_instructions(format!(
                "Tools draw on a budget of tokens; each tool's description says what it costs. Call \
                 rate_limit_status (free) to plan. A refused call says how many seconds to wait: wait that \
                 long instead of retrying. Image and video jobs return a predict_id: poll get_prediction no \
                 sooner than next_poll_in_seconds; each job holds one of your {} in-flight slots until it is \
                 final (cancel_prediction frees it). Repeating the exact same call is refused as a loop. Your \
                 budget: {}.",
                self.app.config.limiting.limits.in_flight_caller.capacity(),
                self.app
                    .config
                    .limiting
                    .limits
                    .caller
                    .iter()
                    .filter(|l| l.enforced_mode())
                    .map(|l| l.limiter.in_words())
                    .collect::<Vec<_>>()
                    .join(", and "),
            ))
    }

    /// Lists the tools with their configured cost appended, so a model sees prices before it calls.
    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        self.admit_method(&context, MethodGroup::ToolsList, "tools/list").await?;
        let tools = limited::priced(self.tool_router.list_all(), &self.app.limits.guard().policy());
        Ok(ListToolsResult::with_all_items(tools))
    }

    async fn ping(&self, context: RequestContext<RoleServer>) -> Result<(), ErrorData> {
        self.admit_method(&context, MethodGroup::Other, "ping").await
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        mut context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        if self.tool_router.get(&request.name).is_none() {
            return Err(ErrorData::invalid_params(format!("unknown tool `{}`", request.name), None));
        }
        let caller = self.caller_of(&context)?;
        let tool = request.name.to_string();
        let args = match tools::validate_arguments(&tool, request.arguments.as_ref()) {
            Ok(args) => args,
            Err(refusal) => return Ok(self.refuse(&caller, &tool, refusal)),
        };
        let starts_job = tools::starts_job(&tool);
        // Known before anything is charged: the upstream is down, or the account's queue is full.
        let place = match self.before_charging(&tool, &caller) {
            Ok(place) => place,
            Err(refusal) => return Ok(self.refuse(&caller, &tool, refusal)),
        };
        // A job holds its slots until it is final; `[tools.NAME] holds_slot` makes any tool hold one
        // until it returns.
        let holds_slot = self.app.limits.guard().policy().holds_slot(&tool);
        let loop_exempt = self.loop_exempt(&tool, &args, &caller);
        let call = ToolCall { tool: &tool, args: &args, starts_job: holds_slot, loop_exempt };
        let (admission, warnings) = match self.app.limits.guard().admit(&caller, &call).await {
            Ok(admission) => {
                let warnings = admission.warnings().to_vec();
                (TakeOnce::new(admission), warnings)
            }
            Err(refusal) if starts_job && refusal.code == RefusalCode::Busy => {
                return Ok(self.refuse(&caller, &tool, self.explain_busy(&tool, refusal, &caller)));
            }
            Err(refusal) => return Ok(self.refuse(&caller, &tool, refusal)),
        };
        let wants_task = starts_job && context.client_capabilities().is_some_and(|c| c.supports_tasks());
        context.extensions.insert(caller.clone());
        // A job tool takes the admission (its in-flight slots) into the job, which keeps it
        // until the job is final; any other tool leaves it here, to be dropped when it returns.
        context.extensions.insert(admission.clone());
        if let Some(place) = place {
            context.extensions.insert(TakeOnce::new(place));
        }
        // rmcp signals a client's cancellation (or the session closing) through this token but
        // keeps polling the handler; racing it drops the tool's future at once, and with it any
        // in-flight slot the admission holds, instead of when the upstream finally answers.
        let cancelled = context.ct.clone();
        let policy = self.app.limits.guard().policy();
        let sharing = policy.tool(&tool).and_then(|p| Sharing::of(p, &caller, &tool, &args));
        let call = async {
            let Some(sharing) = sharing else {
                return (self.tool_router.call(ToolCallContext::new(self, request, context)).await, Served::Asked);
            };
            // Asked by a task of its own, which a cancelled waiter leaves running for the others.
            let server = self.clone();
            let ask = async move { server.tool_router.call(ToolCallContext::new(&server, request, context)).await };
            self.own
                .reuse
                .answer(&tool, sharing, keepable, ask)
                .await
                .unwrap_or_else(|lost| (Err(ErrorData::internal_error(lost.to_string(), None)), Served::Asked))
        };
        let (result, served) = tokio::select! {
            answered = call => answered,
            () = cancelled.cancelled() => (Err(ErrorData::internal_error("the request was cancelled", None)), Served::Asked),
        };
        // A job tool took the admission, and its job settles the price when it is final; any
        // other call's price is settled here, from the answer, as its slots go back.
        let reservation = admission.take().and_then(|mut admission| admission.reserved());
        let result = match result {
            Ok(CallToolResponse::Complete(done)) => {
                let done = results::reused(done, served, limited::Answer::Ours);
                let done = match reservation {
                    Some(reservation) => limited::settled(done, reservation, limited::Answer::Ours).await,
                    None => done,
                };
                Ok(CallToolResponse::Complete(done))
            }
            other => other,
        };
        // A refusal from the tool itself (the upstream's 429 or failure) is seen like the others.
        if let Ok(CallToolResponse::Complete(done)) = &result
            && let Some(refusal) = results::refusal_in(done)
        {
            self.seen_refused(&caller, &tool, &refusal);
        }
        match result {
            Ok(CallToolResponse::Complete(done)) if wants_task && done.is_error != Some(true) => {
                self.as_task(&caller, &done)
            }
            Ok(CallToolResponse::Complete(done)) if !warnings.is_empty() && done.is_error != Some(true) => {
                Ok(CallToolResponse::Complete(results::with_warnings(done, &warnings, limited::Answer::Ours)))
            }
            other => other,
        }
    }

    async fn get_task(
        &self,
        request: GetTaskParams,
        context: RequestContext<RoleServer>,
    ) -> Result<GetTaskResult, ErrorData> {
        let caller = self.caller_of(&context)?;
        self.admit_method(&context, MethodGroup::Other, "tasks/get").await?;
        let view =
            self.own.jobs.poll(caller.id(), &request.task_id).await.ok_or_else(|| unknown_task(&request.task_id))?;
        Ok(GetTaskResult::new(task_of(view, self.task_ttl_ms())?))
    }

    async fn cancel_task(
        &self,
        request: CancelTaskParams,
        context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        let caller = self.caller_of(&context)?;
        self.admit_method(&context, MethodGroup::Other, "tasks/cancel").await?;
        match self.own.jobs.cancel(caller.id(), &request.task_id).await {
            Ok(Some(_)) => Ok(()),
            Ok(None) => Err(unknown_task(&request.task_id)),
            Err(error) => Err(ErrorData::new(
                ErrorCode(-32000),
                format!("the job could not be cancelled upstream: {error}; try again"),
                None,
            )),
        }
    }
}

/// The size of an answer of ours that may be kept (`cache_ttl_ms`): a successful result.
fn keepable(answer: &ToolAnswer) -> Option<u64> {
    match answer {
        Ok(CallToolResponse::Complete(done)) => results::keepable(done),
        _ => None,
    }
}

impl McpServer {
    /// Records a refused tool call for the dashboard.
    fn seen_refused(&self, caller: &Caller, tool: &str, refusal: &Refusal) {
        limited::seen_refused(&self.app.limits, caller, tool, refusal);
    }

    /// The tool result of a refused call, recorded for the dashboard on its way out.
    fn refuse(&self, caller: &Caller, tool: &str, refusal: Refusal) -> CallToolResponse {
        limited::refused(&self.app.limits, caller, tool, &refusal).into()
    }

    fn task_ttl_ms(&self) -> u64 {
        self.app.config.upstream.job_expiry_seconds.saturating_mul(1000)
    }

    /// Turns an accepted job's result into a `CreateTaskResult` for a client that speaks Tasks.
    fn as_task(&self, caller: &Caller, done: &rmcp::model::CallToolResult) -> Result<CallToolResponse, ErrorData> {
        let id = done
            .structured_content
            .as_ref()
            .and_then(|s| s["predict_id"].as_str())
            .ok_or_else(|| ErrorData::internal_error("an accepted job has no predict_id", None))?;
        let view = self.own.jobs.view(caller.id(), id).ok_or_else(|| unknown_task(id))?;
        Ok(CallToolResponse::Task(CreateTaskResult::new(task_of(view, self.task_ttl_ms())?.task)))
    }
}
