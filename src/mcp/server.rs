//! The rmcp server handler, and the one door every tool call goes through.
//!
//! `call_tool` is written by hand instead of generated: it identifies the caller, validates the
//! arguments, and asks the [`Guard`](crate::guard::Guard) before the tool router runs anything.
//! A tool added to `tools.rs` is guarded without doing anything, and cannot opt out.

use std::sync::Arc;

use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::tool::ToolCallContext;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, ErrorCode, Implementation, ListToolsResult, PaginatedRequestParams,
    ServerCapabilities, ServerConfig,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler, tool_handler};

use crate::app::AppState;
use crate::guard::{MethodGroup, Refusal};
use crate::identity::Caller;
use crate::mcp::tools;

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
    pub(crate) transport: Transport,
    tool_router: ToolRouter<Self>,
}

impl McpServer {
    /// A handler over the shared state.
    pub fn new(app: Arc<AppState>, transport: Transport) -> Self {
        Self { app, transport, tool_router: Self::tool_router() }
    }

    fn caller_of(&self, context: &RequestContext<RoleServer>) -> Result<Caller, ErrorData> {
        match self.transport {
            Transport::Stdio => Ok(self.app.identifier.local()),
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
    fn admit_method(
        &self,
        context: &RequestContext<RoleServer>,
        group: MethodGroup,
        method: &str,
    ) -> Result<(), ErrorData> {
        let caller = self.caller_of(context)?;
        self.app.guard.admit_method(&caller, group, method).map_err(method_refusal)
    }
}

fn method_refusal(refusal: Refusal) -> ErrorData {
    let data = refusal.to_json().get("error").cloned();
    ErrorData::new(ErrorCode(-32000), refusal.message, data)
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for McpServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("mcp-ratelimit", env!("CARGO_PKG_VERSION")))
            .with_instructions(format!(
                "Tools draw on a budget of tokens; each tool's description says what it costs. Call \
                 rate_limit_status (free) to plan. A refused call says how many seconds to wait: wait that \
                 long instead of retrying. Image and video jobs return a predict_id: poll get_prediction no \
                 sooner than next_poll_in_seconds. Your budget: {} tokens, refilled at {} per second.",
                self.app.config.limits.caller.capacity(),
                self.app.config.limits.caller.rate_per_sec(),
            ))
    }

    /// Lists the tools with their configured cost appended, so a model sees prices before it calls.
    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        self.admit_method(&context, MethodGroup::ToolsList, "tools/list")?;
        let tools = self
            .tool_router
            .list_all()
            .into_iter()
            .map(|mut tool| {
                let cost = self.app.guard.policy().cost_of(&tool.name);
                let price = match cost {
                    0 => " Free: costs no budget.".to_owned(),
                    1 => " Costs 1 token.".to_owned(),
                    n => format!(" Costs {n} tokens."),
                };
                tool.description = Some(format!("{}{price}", tool.description.as_deref().unwrap_or_default()).into());
                tool
            })
            .collect();
        Ok(ListToolsResult::with_all_items(tools))
    }

    async fn ping(&self, context: RequestContext<RoleServer>) -> Result<(), ErrorData> {
        self.admit_method(&context, MethodGroup::Other, "ping")
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
        if let Err(refusal) = tools::validate_arguments(&request.name, request.arguments.as_ref()) {
            return Ok(refusal.into_result().into());
        }
        let admission = match self.app.guard.admit(&caller, &request.name) {
            Ok(admission) => admission,
            Err(refusal) => return Ok(refusal.into_result().into()),
        };
        context.extensions.insert(caller);
        // rmcp signals a client's cancellation (or the session closing) through this token but
        // keeps polling the handler; racing it drops the tool's future at once, and with it any
        // in-flight slot the admission holds, instead of when the upstream finally answers.
        let cancelled = context.ct.clone();
        let call = self.tool_router.call(ToolCallContext::new(self, request, context));
        let result = tokio::select! {
            result = call => result,
            () = cancelled.cancelled() => Err(ErrorData::internal_error("the request was cancelled", None)),
        };
        drop(admission);
        result
    }
}
