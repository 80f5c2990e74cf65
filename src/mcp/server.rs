//! The rmcp server handler of the reference server, built on its own library: its tools are a
//! [`LimitedRouter`] under [`PaidTools`]' rules, so every call goes
//! through the one guarded call every door runs ([`crate::guard::call`]) — the library's router
//! and the proxy too. A tool added to `tools.rs` is guarded without doing anything, and cannot
//! opt out.
//!
//! Image and video jobs are also MCP Tasks (the SEP-2663 extension) for clients that declare
//! it: the call answers a task whose `taskId` is the `predict_id` and whose `pollIntervalMs` is
//! the poll hint, and `tasks/get` / `tasks/cancel` read and cancel the same job in the job book
//! that `get_prediction` and `cancel_prediction` use. (rmcp's `TaskManager` would keep a second
//! copy of every job, on the wall clock; the job book already is the task store.)

use std::sync::Arc;

use rmcp::handler::server::tool::ToolCallContext;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CancelTaskParams, CreateTaskResult, DetailedTask, ErrorCode, Extensions,
    GetTaskParams, GetTaskResult, Implementation, ListToolsResult, PaginatedRequestParams, ServerCapabilities,
    ServerConfig, Task, TaskPayload, TaskStatus,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler, tool_handler};
use serde_json::{Map, Value};

use crate::clock::NANOS_PER_MS;
use crate::guard::{MethodGroup, Refusal, RefusalCode, TakeOnce};
use crate::identity::Caller;
use crate::mcp::limited::{Asked, LimitedRouter, ToolAnswer, ToolRules};
use crate::mcp::{limited, results, tools};
use crate::state::{AppState, PaidApi};
use crate::upstream::jobs::JobView;
use crate::upstream::queue::Reservation;

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
    pub(crate) own: Arc<PaidApi>,
    pub(crate) transport: Transport,
    tools: LimitedRouter<Self, PaidTools>,
}

impl McpServer {
    /// A handler over the shared state and our tools' upstream.
    pub fn new(app: Arc<AppState>, own: Arc<PaidApi>, transport: Transport) -> Self {
        let door = PaidTools { app: app.clone(), own: own.clone() };
        let tools = LimitedRouter::with_door(Self::tool_router(), app.limits.clone(), door);
        Self { app, own, transport, tools }
    }

    fn caller_of(&self, context: &RequestContext<RoleServer>) -> Result<Caller, ErrorData> {
        limited::caller_of(&self.app.limits, context)
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

#[tool_handler(router = self.tools)]
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
        crate::mcp::trace::traced("tools/list", &context, async {
            self.admit_method(&context, MethodGroup::ToolsList, "tools/list").await?;
            Ok(ListToolsResult::with_all_items(self.tools.list_all()))
        })
        .await
    }

    async fn ping(&self, context: RequestContext<RoleServer>) -> Result<(), ErrorData> {
        crate::mcp::trace::traced("ping", &context, async {
            self.admit_method(&context, MethodGroup::Other, "ping").await
        })
        .await
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        self.tools.call(ToolCallContext::new(self, request, context)).await
    }

    async fn get_task(
        &self,
        request: GetTaskParams,
        context: RequestContext<RoleServer>,
    ) -> Result<GetTaskResult, ErrorData> {
        crate::mcp::trace::traced("tasks/get", &context, async {
            let caller = self.caller_of(&context)?;
            self.admit_method(&context, MethodGroup::Other, "tasks/get").await?;
            let view = self
                .own
                .jobs
                .poll(caller.id(), &request.task_id)
                .await
                .ok_or_else(|| unknown_task(&request.task_id))?;
            Ok(GetTaskResult::new(task_of(view, self.task_ttl_ms())?))
        })
        .await
    }

    async fn cancel_task(
        &self,
        request: CancelTaskParams,
        context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        crate::mcp::trace::traced("tasks/cancel", &context, async {
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
        })
        .await
    }
}

/// The reference server's rules around the one guarded call: our tools' arguments checked
/// against their limits before anything is charged; the upstream known down, or the account's
/// queue full, refused before charging too (a job holds its place in the queue until it starts);
/// a pending job's poll and `rate_limit_status` never a loop; a full job cap explained with the
/// jobs holding it; the answers ours (what we add goes in their `structuredContent`); an accepted
/// job answered as a task to a client that speaks tasks.
#[derive(Clone)]
pub struct PaidTools {
    app: Arc<AppState>,
    own: Arc<PaidApi>,
}

impl std::fmt::Debug for PaidTools {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PaidTools")
    }
}

impl ToolRules for PaidTools {
    type Place = Option<Reservation>;

    fn before_charging(&self, tool: &str, caller: &Caller) -> Result<Option<Reservation>, Refusal> {
        tools::before_charging(&self.own, tool, caller)
    }

    fn check(&self, tool: &str, args: &Map<String, Value>) -> Result<Value, Refusal> {
        tools::validate_arguments(tool, Some(args))
    }

    fn loop_exempt(&self, tool: &str, args: &Value, caller: &Caller) -> bool {
        tools::loop_exempt(&self.own, tool, args, caller)
    }

    fn explain(&self, tool: &str, refusal: Refusal, caller: &Caller) -> Refusal {
        if tools::starts_job(tool) && refusal.code == RefusalCode::Busy {
            tools::explain_busy(&self.own, tool, refusal, caller)
        } else {
            refusal
        }
    }

    fn add_to(&self) -> limited::AddTo {
        limited::AddTo::StructuredContent
    }

    /// A job tool answers with a receipt (a fresh `predict_id`), not the job's result: never
    /// compared. The rest as any tool's.
    fn outcome<'a>(&self, tool: &str, answer: &'a ToolAnswer) -> Option<std::borrow::Cow<'a, Value>> {
        if tools::starts_job(tool) { None } else { limited::outcome_of(answer) }
    }

    /// A job tool's queue place goes to the tool, which hands it to its job.
    fn hand_over(&self, place: Option<Reservation>, extensions: &mut Extensions) {
        if let Some(place) = place {
            extensions.insert(TakeOnce::new(place));
        }
    }

    /// An accepted job, to a client that speaks tasks, is a task.
    fn finish(&self, caller: &Caller, tool: &str, response: CallToolResponse, asked: &Asked) -> ToolAnswer {
        match response {
            CallToolResponse::Complete(done)
                if tools::starts_job(tool) && asked.supports_tasks && done.is_error != Some(true) =>
            {
                self.as_task(caller, &done)
            }
            other => Ok(other),
        }
    }
}

impl PaidTools {
    fn task_ttl_ms(&self) -> u64 {
        self.app.config.upstream.job_expiry_seconds.saturating_mul(1000)
    }

    /// Turns an accepted job's result into a `CreateTaskResult` for a client that speaks Tasks.
    fn as_task(&self, caller: &Caller, done: &rmcp::model::CallToolResult) -> ToolAnswer {
        let id = done
            .structured_content
            .as_ref()
            .and_then(|s| s["predict_id"].as_str())
            .ok_or_else(|| ErrorData::internal_error("an accepted job has no predict_id", None))?;
        let view = self.own.jobs.view(caller.id(), id).ok_or_else(|| unknown_task(id))?;
        Ok(CallToolResponse::Task(CreateTaskResult::new(task_of(view, self.task_ttl_ms())?.task)))
    }
}

impl McpServer {
    fn task_ttl_ms(&self) -> u64 {
        self.app.config.upstream.job_expiry_seconds.saturating_mul(1000)
    }
}
