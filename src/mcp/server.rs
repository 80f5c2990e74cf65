//! The rmcp server handler of the reference server, built on its own library: every tool call goes
//! through the one guarded call every door runs ([`crate::guard::call`], by
//! [`limited::call_tool`]) under [`PaidTools`]' rules — the library's router and the proxy too —
//! and its tool's method is handed what the call was admitted with as a typed value
//! ([`tools::Declaration::work`]). A tool declared in `tools/` is guarded without doing anything,
//! and cannot opt out.
//!
//! Image and video jobs are also MCP Tasks (the SEP-2663 extension) for clients that declare
//! it: the call answers a task whose `taskId` is the `predict_id` and whose `pollIntervalMs` is
//! the poll hint, and `tasks/get` / `tasks/cancel` read and cancel the same job in the job book
//! that `get_prediction` and `cancel_prediction` use. (rmcp's `TaskManager` would keep a second
//! copy of every job, on the wall clock; the job book already is the task store.)

use std::sync::Arc;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CancelTaskParams, CreateTaskResult, DetailedTask, ErrorCode,
    GetTaskParams, GetTaskResult, Implementation, ListToolsResult, PaginatedRequestParams, ServerCapabilities,
    ServerConfig, Task, TaskPayload, TaskStatus, Tool,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler};
use serde_json::{Map, Value};

use crate::guard::{Admitted, Checked, Door, Refusal, RefusalCode, Worked};
use crate::identity::Caller;
use crate::mcp::limited::{AddTo, Response, Routed, ToolAnswer};
use crate::mcp::{limited, tools};
use crate::state::{AppState, PaidApi};
use crate::upstream::jobs::JobView;
use crate::upstream::queue::QueuePlace;

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
    door: PaidTools,
}

impl std::fmt::Debug for McpServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpServer").field("transport", &self.transport).finish_non_exhaustive()
    }
}

impl McpServer {
    /// A handler over the shared state and our tools' upstream.
    pub fn new(app: Arc<AppState>, own: Arc<PaidApi>, transport: Transport) -> Self {
        let door = PaidTools { own: own.clone() };
        Self { app, own, transport, door }
    }

    fn caller_of(&self, context: &RequestContext<RoleServer>) -> Result<Caller, ErrorData> {
        limited::caller_of(&self.app.limits, context)
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
    let poll_ms = view.wait.map(|w| crate::clock::ceil_ms(w).max(1));
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
        let tools = |_| async {
            let priced = limited::priced(tools::listed().to_vec(), &self.app.limits.guard().policy());
            Ok(ListToolsResult::with_all_items(priced))
        };
        limited::method(&self.app.limits, "tools/list", &context, tools).await
    }

    async fn ping(&self, context: RequestContext<RoleServer>) -> Result<(), ErrorData> {
        limited::method(&self.app.limits, "ping", &context, |_| async { Ok(()) }).await
    }

    /// The tool as `tools/list` shows it, before its price is added (rmcp checks a stateless
    /// request's `Mcp-Param-*` headers against its input schema).
    fn get_tool(&self, name: &str) -> Option<Tool> {
        tools::listed().iter().find(|t| t.name == name).cloned()
    }

    /// A call of one of our tools through the one guarded call, its method handed what the call
    /// was admitted with; an unknown tool is the JSON-RPC error `-32602`, charged nothing.
    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let Some(declared) = tools::declared(&request.name) else {
            return Err(ErrorData::invalid_params(format!("unknown tool `{}`", request.name), None));
        };
        // An accepted job, to a client that speaks tasks, is a task.
        let supports_tasks = context.client_capabilities().is_some_and(|c| c.supports_tasks());
        // The caller is named here only for a call that may become a task (the guarded call names
        // it again, as it does for every call).
        let task_of = (tools::starts_job(&request.name) && supports_tasks).then(|| self.caller_of(&context));
        let listed = tools::listed().iter().find(|t| t.name == request.name);
        let reads_only = listed.and_then(|t| t.annotations.as_ref()).and_then(|a| a.read_only_hint);
        let routed = Routed { add_to: AddTo::StructuredContent, reads_only: reads_only == Some(true) };
        let server = self.clone();
        let work = move |admitted: Admitted<Option<QueuePlace>>, args: &Value| {
            let args = args.clone();
            async move { Worked::Answer(ToolAnswer::new((declared.work)(&server, admitted, args).await.map(Into::into))) }
        };
        let response = limited::call_tool(&self.app.limits, &self.door, routed, &request, &context, work).await?;
        match (response, task_of) {
            (CallToolResponse::Complete(done), Some(Ok(caller))) if done.is_error != Some(true) => {
                self.as_task(&caller, &done)
            }
            (response, _) => Ok(response),
        }
    }

    async fn get_task(
        &self,
        request: GetTaskParams,
        context: RequestContext<RoleServer>,
    ) -> Result<GetTaskResult, ErrorData> {
        limited::method(&self.app.limits, "tasks/get", &context, |caller| async move {
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
        limited::method(&self.app.limits, "tasks/cancel", &context, |caller| async move {
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
/// jobs holding it; a job's answer a receipt. (What we add goes in our results'
/// `structuredContent`, and an accepted job is a task to a client that speaks tasks: both
/// [`McpServer`]'s to say.)
#[derive(Clone)]
pub struct PaidTools {
    own: Arc<PaidApi>,
}

impl std::fmt::Debug for PaidTools {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PaidTools")
    }
}

impl Door for PaidTools {
    type Place = Option<QueuePlace>;

    /// Our tools' arguments checked against their limits; a pending job's poll and
    /// `rate_limit_status` never a loop; a job tool's answer a receipt (a fresh `predict_id`), not
    /// the job's result.
    fn check(&self, tool: &str, args: &Map<String, Value>, caller: &Caller) -> Result<Checked, Refusal> {
        let args = tools::validate_arguments(tool, Some(args))?;
        let loop_exempt = tools::loop_exempt(&self.own, tool, &args, caller);
        Ok(Checked { args, loop_exempt, receipt: tools::starts_job(tool) })
    }

    /// A job tool's queue place goes to the tool, which hands it to its job.
    fn before_charging(&self, tool: &str, caller: &Caller) -> Result<Option<QueuePlace>, Refusal> {
        tools::before_charging(&self.own, tool, caller)
    }

    fn explain(&self, tool: &str, refusal: Refusal, caller: &Caller) -> Refusal {
        if tools::starts_job(tool) && refusal.code == RefusalCode::Busy {
            tools::explain_busy(&self.own, tool, refusal, caller)
        } else {
            refusal
        }
    }
}

impl McpServer {
    fn task_ttl_ms(&self) -> u64 {
        self.app.config.upstream.job_expiry_seconds.saturating_mul(1000)
    }

    /// Turns an accepted job's result into a `CreateTaskResult` for a client that speaks Tasks.
    fn as_task(&self, caller: &Caller, done: &rmcp::model::CallToolResult) -> Response {
        let id = done
            .structured_content
            .as_ref()
            .and_then(|s| s["predict_id"].as_str())
            .ok_or_else(|| ErrorData::internal_error("an accepted job has no predict_id", None))?;
        let view = self.own.jobs.view(caller.id(), id).ok_or_else(|| unknown_task(id))?;
        Ok(CallToolResponse::Task(CreateTaskResult::new(task_of(view, self.task_ttl_ms())?.task)))
    }
}
