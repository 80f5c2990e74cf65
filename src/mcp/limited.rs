//! Our limits around any rmcp `ToolRouter`: the one change a server needs is the router its
//! `#[tool_handler]` calls.
//!
//! ```text
//! #[tool_handler(router = self.tools)]        // was: self.tool_router
//! impl ServerHandler for MyServer {}
//! // where   tools: LimitedRouter::new(Self::tool_router(), limits)
//! ```
//!
//! Every call then passes [`Guard::admit`](crate::guard::Guard::admit) before the tool runs:
//! loops are refused, the tool's cost is charged to the caller's, tenant's and tool's budgets at
//! once (all or none), and a tool the [`Catalogue`](crate::config::Catalogue) marks as a job takes
//! an in-flight slot for as long as it runs. The cost is a reservation: once the tool answers, it
//! is settled to the `usage.units` the answer reports ([`settled`]). A refusal is the tool result an agent can act on
//! (`isError`, the wait in whole seconds, `structuredContent.error`); limits close to their end
//! add warnings to the result. `tools/list` shows each tool's cost in its description.
//!
//! The caller is the one the HTTP layer named ([`RateLimits::http_layer`]); without that layer,
//! it is named here from the request's headers and address; over stdio it is the local caller.

use std::borrow::Cow;

use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::tool::ToolCallContext;
use rmcp::model::{CallToolResponse, CallToolResult, JsonObject, Tool};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer};

use crate::config::ToolPolicy;
use crate::guard::{Admission, Policy, Refusal, Reserved, ToolCall, Used};
use crate::identity::Caller;
use crate::mcp::results;
pub use crate::mcp::results::Answer;
use crate::metrics::Layer;
use crate::rate_limits::RateLimits;

/// A `ToolRouter` whose every call is guarded by [`RateLimits`]; it has the methods
/// `#[tool_handler(router = …)]` calls (`call`, `list_all`, `get`).
#[derive(Debug)]
pub struct LimitedRouter<S> {
    router: ToolRouter<S>,
    limits: RateLimits,
}

impl<S> Clone for LimitedRouter<S> {
    fn clone(&self) -> Self {
        Self { router: self.router.clone(), limits: self.limits.clone() }
    }
}

impl<S: Send + Sync + 'static> LimitedRouter<S> {
    /// `router`, with every call guarded by `limits`.
    pub fn new(router: ToolRouter<S>, limits: RateLimits) -> Self {
        Self { router, limits }
    }

    /// Charges the call, runs the tool if it may, and answers a refusal the agent can act on if
    /// it may not. An unknown tool is the JSON-RPC error rmcp gives (`-32602`), charged nothing.
    pub async fn call(&self, context: ToolCallContext<'_, S>) -> Result<CallToolResponse, ErrorData> {
        if self.router.get(context.name()).is_none() {
            return Err(ErrorData::invalid_params("tool not found", None));
        }
        let mut admission =
            match admit(&self.limits, &context.request_context, context.name(), context.arguments.as_ref()).await? {
                Ok(admission) => admission,
                Err(refused) => return Ok(refused.into()),
            };
        let reservation = admission.reserved();
        // A client's cancellation (or the session closing) drops the tool, and with it the
        // admission's in-flight slots, at once instead of when the tool would have returned.
        let cancelled = context.request_context.ct.clone();
        let result = tokio::select! {
            result = self.router.call(context) => result,
            () = cancelled.cancelled() => Err(ErrorData::internal_error("the request was cancelled", None)),
        };
        let warnings = admission.warnings().to_vec();
        drop(admission);
        let result = match (result, reservation) {
            (Ok(CallToolResponse::Complete(done)), Some(reservation)) => {
                Ok(CallToolResponse::Complete(settled(done, reservation, Answer::Theirs).await))
            }
            (other, _) => other,
        };
        match result {
            Ok(CallToolResponse::Complete(done)) if !warnings.is_empty() && done.is_error != Some(true) => {
                Ok(CallToolResponse::Complete(results::with_warnings(done, &warnings, Answer::Theirs)))
            }
            other => other,
        }
    }

    /// Every tool, with its cost added to its description so a model sees prices before it calls.
    pub fn list_all(&self) -> Vec<Tool> {
        priced(self.router.list_all(), &self.limits.guard().policy())
    }

    /// The tool called `name`, as the router has it.
    pub fn get(&self, name: &str) -> Option<&Tool> {
        self.router.get(name)
    }
}

/// `tools` with each one's cost under `policy` appended to its description ("Costs 5 tokens.",
/// or a formula and its most), as `tools/list` shows them.
pub fn priced(tools: Vec<Tool>, policy: &Policy) -> Vec<Tool> {
    tools
        .into_iter()
        .map(|mut tool| {
            let price = match (policy.tool(&tool.name), policy.cost_of(&tool.name)) {
                (Some(ToolPolicy { formula: Some(formula), .. }), most) => {
                    format!(" Costs {formula} tokens, at most {most}: reserved when called, settled to what it used.")
                }
                (_, 0) => " Free: costs no budget.".to_owned(),
                (_, 1) => " Costs 1 token.".to_owned(),
                (_, n) => format!(" Costs {n} tokens."),
            };
            let said = tool.description.as_deref().unwrap_or_default().trim_end();
            // A description that ends mid-sentence (another server's) gets its full stop first.
            let stop = if said.is_empty() || said.ends_with(['.', '!', '?']) { "" } else { "." };
            let description = format!("{said}{stop}{price}");
            tool.description = Some(Cow::Owned(description));
            tool
        })
        .collect()
}

/// Guards one call of `tool` with `arguments`, for a server that writes its own `call_tool`:
/// the [`Admission`] to hold while the tool runs (dropping it gives its in-flight slots back),
/// or the tool result that explains the refusal, to return as it is. `Err` only when the caller
/// cannot be named (see [`caller_of`]).
///
/// ```text
/// async fn call_tool(&self, request: CallToolRequestParams, context: RequestContext<RoleServer>)
///     -> Result<CallToolResponse, ErrorData> {
///     let _admission = match admit(&self.limits, &context, &request.name, request.arguments.as_ref()).await? {
///         Ok(admission) => admission,
///         Err(refused) => return Ok(refused.into()),
///     };
///     self.tool_router.call(ToolCallContext::new(self, request, context)).await
/// }
/// ```
pub async fn admit(
    limits: &RateLimits,
    context: &RequestContext<RoleServer>,
    tool: &str,
    arguments: Option<&JsonObject>,
) -> Result<Result<Admission, CallToolResult>, ErrorData> {
    let caller = caller_of(limits, context)?;
    let args = serde_json::Value::Object(arguments.cloned().unwrap_or_default());
    let guard = limits.guard();
    let call = ToolCall { tool, args: &args, starts_job: guard.policy().holds_slot(tool), loop_exempt: false };
    Ok(guard.admit(&caller, &call).await.map_err(|refusal| refused(limits, &caller, tool, &refusal)))
}

/// What the work behind `done` came to, as far as its price goes: the units it reports, else
/// unreported — an upstream's refusal or failure included: a failed upstream call is still
/// charged (see [`crate::guard::settle`]).
pub fn used_in(done: &CallToolResult) -> Used {
    results::usage_in(done).map_or(Used::Unreported, Used::Reported)
}

/// `done`, the answer to a call that reserved `reservation`, with the price settled from what it
/// says was used ([`used_in`]) and said in it as `whose` answer it is allows.
pub async fn settled(done: CallToolResult, reservation: Reserved, whose: Answer) -> CallToolResult {
    let used = used_in(&done);
    settled_as(done, reservation, used, whose).await
}

/// `done` with the price `reservation` holds settled for work that came to `used` (what the door
/// knows better than the answer: a call never sent did nothing), said as [`settled`] says it.
pub async fn settled_as(done: CallToolResult, reservation: Reserved, used: Used, whose: Answer) -> CallToolResult {
    let settled = reservation.settle_behind(used).await;
    match whose {
        // Another's answer is left as it was unless its own usage report moved the price.
        Answer::Theirs if settled.charged == settled.reserved => done,
        whose => results::priced(done, settled, whose),
    }
}

/// Records a refused call of `tool` for the dashboard, whatever refused it.
pub fn seen_refused(limits: &RateLimits, caller: &Caller, tool: &str, refusal: &Refusal) {
    limits.guard().activity().refused(caller, refusal.seen(Layer::Tool, tool), limits.clock().now());
}

/// The tool result of a refused call of `tool`, recorded for the dashboard on its way out.
pub fn refused(limits: &RateLimits, caller: &Caller, tool: &str, refusal: &Refusal) -> CallToolResult {
    seen_refused(limits, caller, tool, refusal);
    results::tool_result(refusal)
}

/// The caller of an MCP request: the one the HTTP layer named, else one named here from the
/// request's headers and address (401-like `invalid_request` when `auth.required` refuses it),
/// else — over stdio, where there is no HTTP request — the local caller.
pub fn caller_of(limits: &RateLimits, context: &RequestContext<RoleServer>) -> Result<Caller, ErrorData> {
    let Some(parts) = context.extensions.get::<http::request::Parts>() else {
        return Ok(limits.identifier().load().local());
    };
    if let Some(caller) = parts.extensions.get::<Caller>() {
        return Ok(caller.clone());
    }
    let peer = parts.extensions.get::<axum::extract::ConnectInfo<std::net::SocketAddr>>().map(|c| c.0.ip());
    limits
        .identifier()
        .load()
        .identify(&parts.headers, peer)
        .map_err(|unauthorized| ErrorData::invalid_request(format!("Unauthorized: {unauthorized}."), None))
}
