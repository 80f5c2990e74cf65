//! Our limits around any rmcp `ToolRouter`: the one change a server needs is the router its
//! `#[tool_handler]` calls.
//!
//! ```text
//! #[tool_handler(router = self.tools)]        // was: self.tool_router
//! impl ServerHandler for MyServer {}
//! // where   tools: LimitedRouter::new(Self::tool_router(), limits)
//! ```
//!
//! Every call then goes through the one guarded call ([`Guard::call`](mcp_ratelimit_core::guard::Guard::call)),
//! which every door runs — this router, the reference server's and the proxy: before the tool runs
//! loops are refused, the tool's cost is charged to the caller's, tenant's and tool's budgets at
//! once (all or none), and a tool the [`Catalogue`](mcp_ratelimit_core::config::Catalogue) marks as a job takes
//! an in-flight slot for as long as it runs. The cost is a reservation: once the tool answers, it
//! is settled to the `usage.units` the answer reports. Identical calls may share one run of the
//! tool (`[tools.NAME] coalesce`, `cache_ttl_ms`). A refusal is the tool result an agent can act on
//! (`isError`, the wait in whole seconds, `structuredContent.error`); limits close to their end
//! add warnings to the result. `tools/list` shows each tool's cost in its description.
//!
//! The caller is the one the HTTP layer named ([`RateLimits::http_layer`]); without that layer,
//! it is named here from the request's headers and address; over stdio it is the local caller.

use std::borrow::Cow;
use std::future::Future;

use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::tool::ToolCallContext;
use rmcp::model::{CallToolRequestParams, CallToolResponse, CallToolResult, JsonObject, Tool};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer};
use tracing::Instrument;

use crate::rate_limits::RateLimits;
use crate::results;
pub use crate::results::AddTo;
use mcp_ratelimit_core::config::ToolPolicy;
use mcp_ratelimit_core::guard::shed::Arrived;
use mcp_ratelimit_core::guard::{
    Admitted, Answer, Call, Called, Door, MethodGroup, Policy, Refusal, TakeOnce, Used, Worked,
};
use mcp_ratelimit_core::identity::Caller;

pub use crate::rate_limits::{Said, ToolAnswer};
use crate::raw::RawKind;

/// What rmcp answers a tool call with.
pub type Response = Result<CallToolResponse, ErrorData>;

pub use mcp_ratelimit_core::guard::Plain;

/// A tool result as the one guarded call reads it: its usage report (our own tools':
/// `structuredContent.usage.units`, else `_meta.usage.units`; a relayed one's `_meta` only), what
/// it says for loops by answers, whether it may be kept, the refusal it carries (never a relayed
/// one's), and the state a request for input resumes with.
impl Answer for ToolAnswer {
    fn used(&self) -> Used {
        match (self.said(), self.is_relayed()) {
            (Said::Typed(Ok(CallToolResponse::Complete(done))), true) => {
                results::usage_in_meta(done).map_or(Used::Unreported, Used::Reported)
            }
            (Said::Typed(answer), false) => used_by(answer),
            (Said::Raw(raw), _) if matches!(raw.kind(), RawKind::Complete { .. }) => {
                raw.usage_in_meta().map_or(Used::Unreported, Used::Reported)
            }
            _ => Used::Unreported,
        }
    }

    fn outcome(&self) -> Option<Cow<'_, serde_json::Value>> {
        match self.said() {
            Said::Typed(answer) => outcome_of(answer),
            Said::Raw(raw) => raw.outcome().map(Cow::Owned),
        }
    }

    fn keepable(&self) -> Option<u64> {
        match self.said() {
            Said::Typed(answer) => keepable(answer),
            Said::Raw(raw) => raw.keepable(),
        }
    }

    fn refusal_in(&self) -> Option<Refusal> {
        match self.said() {
            Said::Typed(answer) if !self.is_relayed() => refusal_in(answer),
            _ => None,
        }
    }

    fn asks_input(&self) -> Option<&str> {
        match self.said() {
            Said::Typed(answer) => asks_input(answer),
            Said::Raw(raw) => match raw.kind() {
                RawKind::InputRequired { state } => Some(state),
                _ => None,
            },
        }
    }
}

/// What an answer's usage report says its work used (`structuredContent.usage.units`, else
/// `_meta.usage.units`); unreported for an error or a result without one.
pub fn used_by(answer: &Response) -> Used {
    match answer {
        Ok(CallToolResponse::Complete(done)) => used_in(done),
        _ => Used::Unreported,
    }
}

/// What a complete tool result says, for loop detection: its `structuredContent` when it has one
/// and is not an error, else whether it is an error and its content (`_meta` is never part of
/// it). `None` for anything that is not a complete result (a task, a request for input, a
/// JSON-RPC error).
pub fn outcome_of(answer: &Response) -> Option<Cow<'_, serde_json::Value>> {
    let Ok(CallToolResponse::Complete(done)) = answer else { return None };
    match &done.structured_content {
        Some(structured) if done.is_error != Some(true) => Some(Cow::Borrowed(structured)),
        _ => {
            let content = serde_json::to_value(&done.content).ok()?;
            Some(Cow::Owned(serde_json::json!({ "isError": done.is_error == Some(true), "content": content })))
        }
    }
}

/// The size of a successful tool result that may be kept for identical calls (`cache_ttl_ms`).
pub fn keepable(answer: &Response) -> Option<u64> {
    match answer {
        Ok(CallToolResponse::Complete(done)) => results::keepable(done),
        _ => None,
    }
}

/// The `requestState` to resume with (empty when it gave none), if `answer` is MCP's
/// `input_required`: the caller is asked for input and calls again with it.
pub fn asks_input(answer: &Response) -> Option<&str> {
    match answer {
        Ok(CallToolResponse::InputRequired(input)) => Some(input.request_state.as_deref().unwrap_or_default()),
        _ => None,
    }
}

/// The state a call says it resumes an earlier round with: its `requestState`, or empty when it
/// answers input requests without one; `None` for a call of its own.
pub fn resumes(request: &CallToolRequestParams) -> Option<&str> {
    match (&request.request_state, &request.input_responses) {
        (Some(state), _) => Some(state.as_str()),
        (None, Some(_)) => Some(""),
        (None, None) => None,
    }
}

/// The refusal a tool result carries (an upstream's 429 our tools answered), if it is one.
pub fn refusal_in(answer: &Response) -> Option<Refusal> {
    match answer {
        Ok(CallToolResponse::Complete(done)) => results::refusal_in(done),
        _ => None,
    }
}

/// A `ToolRouter` whose every call is guarded by [`RateLimits`] at the door `D` ([`Plain`] for a
/// library's tools: see [`Door`]); it has the methods `#[tool_handler(router = …)]` calls
/// (`call`, `list_all`, `get`).
#[derive(Debug)]
pub struct LimitedRouter<S, D = Plain> {
    router: ToolRouter<S>,
    limits: RateLimits,
    door: D,
    add_to: AddTo,
}

impl<S, D: Clone> Clone for LimitedRouter<S, D> {
    fn clone(&self) -> Self {
        Self { router: self.router.clone(), limits: self.limits.clone(), door: self.door.clone(), add_to: self.add_to }
    }
}

impl<S: Clone + Send + Sync + 'static> LimitedRouter<S> {
    /// `router`, with every call guarded by `limits`.
    pub fn new(router: ToolRouter<S>, limits: RateLimits) -> Self {
        Self::with_door(router, limits, Plain)
    }
}

impl<S: Clone + Send + Sync + 'static, D: Door> LimitedRouter<S, D> {
    /// `router`, with every call guarded by `limits` at `door`; what the guard adds to a result
    /// goes in its `_meta`.
    pub fn with_door(router: ToolRouter<S>, limits: RateLimits, door: D) -> Self {
        Self { router, limits, door, add_to: AddTo::Meta }
    }

    /// The same router, what the guard adds to a result going where `add_to` says
    /// (`structuredContent` for tools whose `outputSchema`s admit it).
    #[must_use]
    pub fn adding_to(mut self, add_to: AddTo) -> Self {
        self.add_to = add_to;
        self
    }

    /// Runs the call through the one guarded pipeline ([`call_tool`]): charged, run if it may (a
    /// tool that is cancelled is dropped at once), settled and reported; a refusal is the tool
    /// result an agent can act on. An unknown tool is the JSON-RPC error `-32602`, charged nothing.
    ///
    /// The tool finds in its request's extensions who called ([`Caller`]), the call's admission
    /// (`TakeOnce<Admission>`: a job takes it, and holds its in-flight slots until it is final)
    /// and what the door held since before charging (`TakeOnce<D::Place>`).
    pub async fn call(&self, context: ToolCallContext<'_, S>) -> Response {
        let Some(routed) = self.router.get(context.name()) else {
            return Err(ErrorData::invalid_params(format!("unknown tool `{}`", context.name()), None));
        };
        let reads_only = routed.annotations.as_ref().and_then(|a| a.read_only_hint) == Some(true);
        let service = context.service.clone();
        let router = self.router.clone();
        let ToolCallContext { request_context, name, arguments, input_responses, request_state, .. } = context;
        let mut request = CallToolRequestParams::new(name);
        request.arguments = arguments;
        request.input_responses = input_responses;
        request.request_state = request_state;
        let asked = request.clone();
        let work = |admitted: Admitted<D::Place>, _checked: &serde_json::Value| {
            let mut request_context = request_context.clone();
            request_context.extensions.insert(admitted.caller);
            request_context.extensions.insert(admitted.admission);
            request_context.extensions.insert(TakeOnce::new(admitted.place));
            async move {
                Worked::Answer(ToolAnswer::new(
                    router.call(ToolCallContext::new(&service, request, request_context)).await,
                ))
            }
        };
        let tool = Routed { add_to: self.add_to, reads_only };
        call_tool(&self.limits, &self.door, tool, &asked, &request_context, work).await
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

/// What the entry that routes a call knows of its tool: where what the guard adds to its result
/// goes, and whether it only reads (its `readOnlyHint`: its identical answers in a row are counted
/// under `[loop_detection] no_progress`).
#[derive(Debug, Clone, Copy)]
pub struct Routed {
    /// Where what the guard adds goes.
    pub add_to: AddTo,
    /// The tool only reads.
    pub reads_only: bool,
}

/// One call (`request`: its tool, its arguments, the round it resumes) through the one guarded
/// pipeline at `door` (run by [`Guard::call`](mcp_ratelimit_core::guard::Guard::call)), as an rmcp
/// door makes it: the caller named from `context`, the call raced against `context`'s
/// cancellation, `work` run when admitted (shared with identical calls where the tool allows), and
/// what came of it turned into the response: a refusal as the tool result an agent can act on, an
/// answer with what we add to it (reused, its price, warnings) where `tool` says it goes. `Err`
/// only for a JSON-RPC error: the caller cannot be named, the tool's own, a cancelled call.
pub async fn call_tool<D, W, F>(
    limits: &RateLimits,
    door: &D,
    tool: Routed,
    request: &CallToolRequestParams,
    context: &RequestContext<RoleServer>,
    work: W,
) -> Response
where
    D: Door,
    W: FnOnce(Admitted<D::Place>, &serde_json::Value) -> F,
    F: Future<Output = Worked<ToolAnswer>> + Send + 'static,
{
    let span = crate::trace::call_span(request.name.as_ref(), context);
    let answered = call_tool_in_span(limits, door, tool, request, context, work).instrument(span.clone()).await;
    crate::trace::record_error(&span, &answered);
    answered
}

/// [`call_tool`], in the request's span.
async fn call_tool_in_span<D, W, F>(
    limits: &RateLimits,
    door: &D,
    routed: Routed,
    request: &CallToolRequestParams,
    context: &RequestContext<RoleServer>,
    work: W,
) -> Response
where
    D: Door,
    W: FnOnce(Admitted<D::Place>, &serde_json::Value) -> F,
    F: Future<Output = Worked<ToolAnswer>> + Send + 'static,
{
    let caller = caller_of(limits, context)?;
    let (tool, no_arguments) = (request.name.as_ref(), JsonObject::new());
    let arguments = request.arguments.as_ref().unwrap_or(&no_arguments);
    let arrived = context.extensions.get::<http::request::Parts>().and_then(|parts| parts.extensions.get::<Arrived>());
    let call = Call {
        tool,
        caller: &caller,
        args: arguments,
        cancelled: context.ct.clone(),
        resumes: resumes(request),
        arrived: arrived.map(|a| a.0),
        reads_only: routed.reads_only,
    };
    match finish(limits.guard().call(door, Some(limits.reuse()), call, work).await, routed.add_to, false) {
        Finished::Response(response) => response,
        // Never: asked for a response in rmcp's types.
        Finished::Raw(editing) => editing.result.to_response(),
    }
}

/// What a guarded call came to, as its door answers it: a response in rmcp's types, or another
/// server's result as it came with what the guard adds to it ([`results::Editing`]: the proxy's
/// relay lane, which writes it out itself).
#[derive(Debug)]
pub enum Finished {
    /// In rmcp's types.
    Response(Response),
    /// Another server's result as it came, and what is added to it.
    Raw(results::Editing),
}

/// What a guarded call came to ([`Called`]), as its door answers it: a refusal as the tool result
/// an agent can act on, an answer with what we add to it (reused, its price, warnings) where
/// `add_to` says it goes. A result another server sent stays as it came where `keep_raw` (the
/// relay lane's), else is read into rmcp's types. `Err` only for a JSON-RPC error: the tool's
/// own, a cancelled call.
pub fn finish(called: Called<ToolAnswer>, add_to: AddTo, keep_raw: bool) -> Finished {
    match called {
        Called::Refused(refusal) => Finished::Response(Ok(results::tool_result(&refusal).into())),
        Called::RefusedAfter { refusal, settled } => {
            let mut done = results::tool_result(&refusal);
            if let Some(settled) = settled {
                results::priced(&mut done, settled, AddTo::StructuredContent);
            }
            Finished::Response(Ok(done.into()))
        }
        Called::Answered { answer, served, settled, warnings, no_progress } => {
            let added = Added { served, settled, warnings, no_progress, add_to };
            match answer.into_said() {
                Said::Raw(raw) if keep_raw => {
                    let complete = matches!(raw.kind(), RawKind::Complete { .. });
                    let mut editing = results::Editing::of(raw);
                    if complete {
                        added.to(&mut editing);
                    }
                    Finished::Raw(editing)
                }
                said => {
                    let response = match said {
                        Said::Typed(response) => response,
                        Said::Raw(raw) => raw.to_response(),
                    };
                    Finished::Response(match response {
                        Ok(CallToolResponse::Complete(mut done)) => {
                            added.to(&mut done);
                            Ok(CallToolResponse::Complete(done))
                        }
                        other => other,
                    })
                }
            }
        }
        Called::Cancelled => Finished::Response(Err(ErrorData::internal_error("the request was cancelled", None))),
        Called::Lost => {
            Finished::Response(Err(ErrorData::internal_error(mcp_ratelimit_core::guard::reuse::Lost.to_string(), None)))
        }
    }
}

/// What the guard adds to a complete answer.
struct Added {
    served: mcp_ratelimit_core::guard::reuse::Served,
    settled: Option<mcp_ratelimit_core::guard::Settled>,
    warnings: Vec<mcp_ratelimit_core::guard::Warning>,
    no_progress: Option<mcp_ratelimit_core::guard::loops::NoProgress>,
    add_to: AddTo,
}

impl Added {
    fn to(self, done: &mut impl results::Addable) {
        let add_to = self.add_to;
        results::reused(done, self.served, add_to);
        if let Some(settled) = self.settled {
            // Another's answer is left as it was unless its own usage report moved the price.
            if add_to == AddTo::StructuredContent || settled.charged != settled.reserved {
                results::priced(done, settled, add_to);
            }
        }
        if !self.warnings.is_empty() && !done.is_error() {
            results::with_warnings(done, &self.warnings, add_to);
        }
        if let Some(no_progress) = &self.no_progress {
            results::with_no_progress(done, no_progress, add_to);
        }
    }
}

/// A request other than a tool call, as every handler serves it: in its span
/// ([`crate::trace::traced`]), its caller charged to its per-method limit
/// (`limits.method.tools_list` for `tools/list`, else `limits.method.other`; refused, the
/// JSON-RPC error carrying the refusal's data, as there is no tool result to carry it), then
/// `serve`d for that caller.
pub async fn method<T, F>(
    limits: &RateLimits,
    method: &str,
    context: &RequestContext<RoleServer>,
    serve: impl FnOnce(Caller) -> F,
) -> Result<T, ErrorData>
where
    F: Future<Output = Result<T, ErrorData>>,
{
    crate::trace::traced(method, context, async {
        let caller = caller_of(limits, context)?;
        let group = MethodGroup::of(method);
        limits.guard().admit_method(&caller, group, method).await.map_err(|r| results::method_error(&r))?;
        serve(caller).await
    })
    .await
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

/// What the work behind `done` came to, as far as its price goes: the units it reports, else
/// unreported — an upstream's refusal or failure included: a failed upstream call is still
/// charged (see [`mcp_ratelimit_core::guard::after::settle`]).
pub fn used_in(done: &CallToolResult) -> Used {
    results::usage_in(done).map_or(Used::Unreported, Used::Reported)
}

/// The caller of an MCP request: the one the HTTP layer named, else one named here from the
/// request's headers and address (401-like `invalid_request` when `auth.required` refuses it;
/// an access token, which only the HTTP layer verifies, counts as its address's unverified
/// caller), else — over stdio, where there is no HTTP request — the local caller.
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
        .map(mcp_ratelimit_core::identity::Identity::without_verifying)
        .map_err(|unauthorized| ErrorData::invalid_request(format!("Unauthorized: {unauthorized}."), None))
}
