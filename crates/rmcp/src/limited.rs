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
use rmcp::model::{CallToolRequestParams, CallToolResponse, CallToolResult, Extensions, JsonObject, Tool};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer};
use tracing::Instrument;

use crate::rate_limits::RateLimits;
use crate::results;
pub use crate::results::AddTo;
use mcp_ratelimit_core::config::ToolPolicy;
use mcp_ratelimit_core::guard::shed::Arrived;
use mcp_ratelimit_core::guard::{Admitted, Call, Called, Door, Policy, Refusal, Reserved, Used, Worked};
use mcp_ratelimit_core::identity::Caller;

pub use crate::rate_limits::ToolAnswer;

/// A door of MCP tools: what differs for them around the one guarded call ([`Door`]: checks,
/// what is known before charging, loops, refusals explained, usage read), and what the rmcp side
/// adds — whose answer it is (where what we add to it goes), what the work is handed, a last word
/// on the response. Every method but [`ToolRules::before_charging`] has the library's default, so
/// a door says only what differs, the way tower's `retry::Policy` says what to retry.
pub trait ToolRules: Send + Sync {
    /// What the door holds from before charging until its tool runs (a place in a queue).
    type Place: Send + 'static;

    /// What is known before anything is charged — the upstream known down, its queue full — or
    /// what the call holds until its tool runs.
    fn before_charging(&self, tool: &str, caller: &Caller) -> Result<Self::Place, Refusal>;

    /// The arguments as the limits see them, or why they are refused before anything is
    /// charged. By default as they are.
    fn check(&self, _tool: &str, args: &JsonObject) -> Result<serde_json::Value, Refusal> {
        Ok(serde_json::Value::Object(args.clone()))
    }

    /// Whether this call can never be a loop. By default none.
    fn loop_exempt(&self, _tool: &str, _args: &serde_json::Value, _caller: &Caller) -> bool {
        false
    }

    /// A refusal of the guard's, said better where the door knows more. By default as it is.
    fn explain(&self, _tool: &str, refusal: Refusal, _caller: &Caller) -> Refusal {
        refusal
    }

    /// What an answer says its tool used: by default its usage report
    /// (`structuredContent.usage.units`, else `_meta.usage.units`; see [`used_by`]).
    fn used(&self, _tool: &str, answer: &ToolAnswer) -> Used {
        used_by(answer)
    }

    /// What an answer says, for loop detection to compare with the tool's last answers to the
    /// caller: by default a complete result's (see [`outcome_of`]); a door returns `None` for a
    /// tool whose answer is a receipt rather than a result (a job's id).
    fn outcome<'a>(&self, _tool: &str, answer: &'a ToolAnswer) -> Option<Cow<'a, serde_json::Value>> {
        outcome_of(answer)
    }

    /// Whether `tool` only reads (its `readOnlyHint`): its identical answers in a row are counted
    /// under `[loop_detection] no_progress`. By default none is known to; [`LimitedRouter`] reads
    /// its tools' annotations.
    fn read_only(&self, _tool: &str) -> bool {
        false
    }

    /// The refusal an answer carries when the tool itself refused (an upstream's 429, in our
    /// refusals' shape), to record it like the others. By default read as our tools write it.
    fn refusal_in(&self, answer: &ToolAnswer) -> Option<Refusal> {
        refusal_in(answer)
    }

    /// Where what the guard adds to these tools' results goes: by default `_meta`, the result
    /// left as it was; `structuredContent` for tools whose `outputSchema`s admit what we add.
    fn add_to(&self) -> AddTo {
        AddTo::Meta
    }

    /// Hands what the call held since before charging to the tool, through the request's
    /// extensions. By default it is dropped here.
    fn hand_over(&self, _place: Self::Place, _extensions: &mut Extensions) {}

    /// The response as the caller gets it, last (a job's result as a task for a client that
    /// speaks tasks; a task's caller recorded). By default as it is.
    fn finish(&self, _caller: &Caller, _tool: &str, response: CallToolResponse, _asked: &Asked) -> ToolAnswer {
        Ok(response)
    }
}

/// What the caller said of itself when it asked, for [`ToolRules::finish`].
#[derive(Debug, Clone, Copy)]
pub struct Asked {
    /// Its client declared MCP Tasks.
    pub supports_tasks: bool,
}

/// A door of tools as the one guarded call ([`Guard::call`](mcp_ratelimit_core::guard::Guard::call)) sees
/// it: `R`'s rules, for answers that are tool results. [`call_tool`] wraps its rules in it.
#[derive(Debug)]
pub struct Tools<'a, R>(pub &'a R);

impl<R: ToolRules> Door for Tools<'_, R> {
    type Answer = ToolAnswer;
    type Place = R::Place;

    fn check(&self, tool: &str, args: &JsonObject) -> Result<serde_json::Value, Refusal> {
        self.0.check(tool, args)
    }

    fn before_charging(&self, tool: &str, caller: &Caller) -> Result<R::Place, Refusal> {
        self.0.before_charging(tool, caller)
    }

    fn loop_exempt(&self, tool: &str, args: &serde_json::Value, caller: &Caller) -> bool {
        self.0.loop_exempt(tool, args, caller)
    }

    fn explain(&self, tool: &str, refusal: Refusal, caller: &Caller) -> Refusal {
        self.0.explain(tool, refusal, caller)
    }

    fn used(&self, tool: &str, answer: &ToolAnswer) -> Used {
        self.0.used(tool, answer)
    }

    fn outcome<'a>(&self, tool: &str, answer: &'a ToolAnswer) -> Option<Cow<'a, serde_json::Value>> {
        self.0.outcome(tool, answer)
    }

    fn reads_only(&self, tool: &str) -> bool {
        self.0.read_only(tool)
    }

    fn keepable(answer: &ToolAnswer) -> Option<u64> {
        keepable(answer)
    }

    fn refusal_in(&self, answer: &ToolAnswer) -> Option<Refusal> {
        self.0.refusal_in(answer)
    }

    fn asks_input(answer: &ToolAnswer) -> Option<&str> {
        asks_input(answer)
    }
}

/// The library's rules: every default of [`ToolRules`], nothing known before charging.
#[derive(Debug, Clone, Copy, Default)]
pub struct Plain;

impl ToolRules for Plain {
    type Place = ();

    fn before_charging(&self, _tool: &str, _caller: &Caller) -> Result<(), Refusal> {
        Ok(())
    }
}

/// What an answer's usage report says its work used (`structuredContent.usage.units`, else
/// `_meta.usage.units`); unreported for an error or a result without one.
pub fn used_by(answer: &ToolAnswer) -> Used {
    match answer {
        Ok(CallToolResponse::Complete(done)) => used_in(done),
        _ => Used::Unreported,
    }
}

/// What a complete tool result says, for loop detection: its `structuredContent` when it has one
/// and is not an error, else whether it is an error and its content (`_meta` is never part of
/// it). `None` for anything that is not a complete result (a task, a request for input, a
/// JSON-RPC error).
pub fn outcome_of(answer: &ToolAnswer) -> Option<Cow<'_, serde_json::Value>> {
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
pub fn keepable(answer: &ToolAnswer) -> Option<u64> {
    match answer {
        Ok(CallToolResponse::Complete(done)) => results::keepable(done),
        _ => None,
    }
}

/// The `requestState` to resume with (empty when it gave none), if `answer` is MCP's
/// `input_required`: the caller is asked for input and calls again with it.
pub fn asks_input(answer: &ToolAnswer) -> Option<&str> {
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
pub fn refusal_in(answer: &ToolAnswer) -> Option<Refusal> {
    match answer {
        Ok(CallToolResponse::Complete(done)) => results::refusal_in(done),
        _ => None,
    }
}

/// A door's rules for one call of a routed tool, with what the router's annotations say of it:
/// whether it only reads.
struct Routed<'a, D> {
    door: &'a D,
    read_only: bool,
}

impl<D: ToolRules> ToolRules for Routed<'_, D> {
    type Place = D::Place;

    fn before_charging(&self, tool: &str, caller: &Caller) -> Result<D::Place, Refusal> {
        self.door.before_charging(tool, caller)
    }

    fn check(&self, tool: &str, args: &JsonObject) -> Result<serde_json::Value, Refusal> {
        self.door.check(tool, args)
    }

    fn loop_exempt(&self, tool: &str, args: &serde_json::Value, caller: &Caller) -> bool {
        self.door.loop_exempt(tool, args, caller)
    }

    fn explain(&self, tool: &str, refusal: Refusal, caller: &Caller) -> Refusal {
        self.door.explain(tool, refusal, caller)
    }

    fn used(&self, tool: &str, answer: &ToolAnswer) -> Used {
        self.door.used(tool, answer)
    }

    fn outcome<'a>(&self, tool: &str, answer: &'a ToolAnswer) -> Option<Cow<'a, serde_json::Value>> {
        self.door.outcome(tool, answer)
    }

    /// What the door says, or else the tool's `readOnlyHint`.
    fn read_only(&self, tool: &str) -> bool {
        self.read_only || self.door.read_only(tool)
    }

    fn refusal_in(&self, answer: &ToolAnswer) -> Option<Refusal> {
        self.door.refusal_in(answer)
    }

    fn add_to(&self) -> AddTo {
        self.door.add_to()
    }

    fn hand_over(&self, place: D::Place, extensions: &mut Extensions) {
        self.door.hand_over(place, extensions);
    }

    fn finish(&self, caller: &Caller, tool: &str, response: CallToolResponse, asked: &Asked) -> ToolAnswer {
        self.door.finish(caller, tool, response, asked)
    }
}

/// A `ToolRouter` whose every call is guarded by [`RateLimits`] under the door's rules `D`
/// ([`Plain`] for a library's tools: see [`ToolRules`]); it has the methods `#[tool_handler(router = …)]` calls
/// (`call`, `list_all`, `get`).
#[derive(Debug)]
pub struct LimitedRouter<S, D = Plain> {
    router: ToolRouter<S>,
    limits: RateLimits,
    door: D,
}

impl<S, D: Clone> Clone for LimitedRouter<S, D> {
    fn clone(&self) -> Self {
        Self { router: self.router.clone(), limits: self.limits.clone(), door: self.door.clone() }
    }
}

impl<S: Clone + Send + Sync + 'static> LimitedRouter<S> {
    /// `router`, with every call guarded by `limits`.
    pub fn new(router: ToolRouter<S>, limits: RateLimits) -> Self {
        Self { router, limits, door: Plain }
    }
}

impl<S: Clone + Send + Sync + 'static, D: ToolRules> LimitedRouter<S, D> {
    /// `router`, with every call guarded by `limits` under `door`'s rules.
    pub fn with_door(router: ToolRouter<S>, limits: RateLimits, door: D) -> Self {
        Self { router, limits, door }
    }

    /// Runs the call through the one guarded pipeline ([`call_tool`]): charged, run if it may (a
    /// tool that is cancelled is dropped at once), settled and reported; a refusal is the tool
    /// result an agent can act on. An unknown tool is the JSON-RPC error `-32602`, charged nothing.
    pub async fn call(&self, context: ToolCallContext<'_, S>) -> Result<CallToolResponse, ErrorData> {
        if self.router.get(context.name()).is_none() {
            return Err(ErrorData::invalid_params(format!("unknown tool `{}`", context.name()), None));
        }
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
            self.door.hand_over(admitted.place, &mut request_context.extensions);
            async move { Worked::Answer(router.call(ToolCallContext::new(&service, request, request_context)).await) }
        };
        let read_only = self.router.get(&asked.name).and_then(|t| t.annotations.as_ref()?.read_only_hint);
        let door = Routed { door: &self.door, read_only: read_only == Some(true) };
        call_tool(&self.limits, &door, &asked, &request_context, work).await
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

/// One call (`request`: its tool, its arguments, the round it resumes) through the one guarded pipeline (under `door`'s
/// [`ToolRules`], run by
/// [`Guard::call`](mcp_ratelimit_core::guard::Guard::call)), as an rmcp door makes it: the caller named from
/// `context`, the call raced against `context`'s cancellation, `work` run when admitted (shared
/// with identical calls where the tool allows), and what came of it turned into the response:
/// a refusal as the tool result an agent can act on, an answer with what we add to it (reused,
/// its price, warnings) where `door` says it goes. `Err` only for a JSON-RPC error: the caller
/// cannot be named, the tool's own, a cancelled call.
pub async fn call_tool<D, W, F>(
    limits: &RateLimits,
    door: &D,
    request: &CallToolRequestParams,
    context: &RequestContext<RoleServer>,
    work: W,
) -> Result<CallToolResponse, ErrorData>
where
    D: ToolRules,
    W: FnOnce(Admitted<D::Place>, &serde_json::Value) -> F,
    F: Future<Output = Worked<ToolAnswer>> + Send + 'static,
{
    let span = crate::trace::call_span(request.name.as_ref(), context);
    let answered = call_tool_in_span(limits, door, request, context, work).instrument(span.clone()).await;
    crate::trace::record_error(&span, &answered);
    answered
}

/// [`call_tool`], in the request's span.
async fn call_tool_in_span<D, W, F>(
    limits: &RateLimits,
    door: &D,
    request: &CallToolRequestParams,
    context: &RequestContext<RoleServer>,
    work: W,
) -> Result<CallToolResponse, ErrorData>
where
    D: ToolRules,
    W: FnOnce(Admitted<D::Place>, &serde_json::Value) -> F,
    F: Future<Output = Worked<ToolAnswer>> + Send + 'static,
{
    let caller = caller_of(limits, context)?;
    let asked = Asked { supports_tasks: context.client_capabilities().is_some_and(|c| c.supports_tasks()) };
    let (tool, no_arguments) = (request.name.as_ref(), JsonObject::new());
    let arguments = request.arguments.as_ref().unwrap_or(&no_arguments);
    let resumes = resumes(request);
    let arrived = context.extensions.get::<http::request::Parts>().and_then(|parts| parts.extensions.get::<Arrived>());
    let call = Call {
        tool,
        caller: &caller,
        args: arguments,
        cancelled: context.ct.clone(),
        resumes,
        arrived: arrived.map(|a| a.0),
    };
    let add_to = door.add_to();
    match limits.guard().call(&Tools(door), Some(limits.reuse()), call, work).await {
        Called::Refused(refusal) => Ok(results::tool_result(&refusal).into()),
        Called::RefusedAfter { refusal, settled } => {
            let done = results::tool_result(&refusal);
            Ok(settled.map_or(done.clone(), |settled| results::priced(done, settled, AddTo::StructuredContent)).into())
        }
        Called::Answered { answer: Ok(CallToolResponse::Complete(done)), served, settled, warnings, no_progress } => {
            let mut done = results::reused(done, served, add_to);
            if let Some(settled) = settled {
                // Another's answer is left as it was unless its own usage report moved the price.
                if add_to == AddTo::StructuredContent || settled.charged != settled.reserved {
                    done = results::priced(done, settled, add_to);
                }
            }
            if !warnings.is_empty() && done.is_error != Some(true) {
                done = results::with_warnings(done, &warnings, add_to);
            }
            if let Some(no_progress) = no_progress {
                done = results::with_no_progress(done, &no_progress);
            }
            door.finish(&caller, tool, CallToolResponse::Complete(done), &asked)
        }
        Called::Answered { answer: Ok(other), .. } => door.finish(&caller, tool, other, &asked),
        Called::Answered { answer: Err(error), .. } => Err(error),
        Called::Cancelled => Err(ErrorData::internal_error("the request was cancelled", None)),
        Called::Lost => Err(ErrorData::internal_error(mcp_ratelimit_core::guard::reuse::Lost.to_string(), None)),
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

/// What the work behind `done` came to, as far as its price goes: the units it reports, else
/// unreported — an upstream's refusal or failure included: a failed upstream call is still
/// charged (see [`mcp_ratelimit_core::guard::settle`]).
pub fn used_in(done: &CallToolResult) -> Used {
    results::usage_in(done).map_or(Used::Unreported, Used::Reported)
}

/// `done`, the answer to a call that reserved `reservation`, with the price settled from what it
/// says was used ([`used_in`]) and said in it where `add_to` says.
pub async fn settled(done: CallToolResult, reservation: Reserved, add_to: AddTo) -> CallToolResult {
    let used = used_in(&done);
    settled_as(done, reservation, used, add_to).await
}

/// `done` with the price `reservation` holds settled for work that came to `used` (what the door
/// knows better than the answer: a call never sent did nothing), said as [`settled`] says it.
pub async fn settled_as(done: CallToolResult, reservation: Reserved, used: Used, add_to: AddTo) -> CallToolResult {
    let settled = reservation.settle_behind(used).await;
    match add_to {
        // Another's answer is left as it was unless its own usage report moved the price.
        AddTo::Meta if settled.charged == settled.reserved => done,
        add_to => results::priced(done, settled, add_to),
    }
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
