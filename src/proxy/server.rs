//! The MCP server each downstream session gets: the proxied server's tools, priced and guarded,
//! and its resources, prompts, completions, logging and tasks passed through under the
//! per-method limits.

use std::sync::Arc;

#[allow(deprecated)] // Logging and resource subscriptions are legacy in 2026-07-28, and still in use.
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, CancelTaskParams, CancelTaskRequest, ClientRequest,
    CompleteRequestParams, CompleteResult, GetPromptRequestParams, GetPromptResponse, GetPromptResult, GetTaskParams,
    GetTaskRequest, GetTaskResult, Implementation, ListPromptsResult, ListResourceTemplatesResult, ListResourcesResult,
    ListToolsResult, PaginatedRequestParams, ReadResourceRequestParams, ReadResourceResponse, ReadResourceResult,
    ResourceUpdatedNotification, ResourceUpdatedNotificationParam, ResultType, ServerConfig, ServerNotification,
    ServerResult, SetLevelRequestParams, SubscribeRequestParams, SubscriptionFilter, TaskPayload,
    UnsubscribeRequestParams,
};
use rmcp::service::{
    NotificationContext, Peer, PeerRequestOptions, RequestContext, ServiceError, SubscriptionContext,
    SubscriptionSendError,
};
use rmcp::{ErrorData, RoleClient, RoleServer, ServerHandler};
use tokio::sync::broadcast::error::RecvError;

use super::relay::Change;
use super::scopes::{self, Unopened, Upstream};
use super::seat::Seat;
use super::{Asker, Outgoing, Proxied, Sending, ViaRmcp};
use crate::config::UpstreamSessions;
use crate::guard::{Checked, Door, Refusal, Used, Worked};
use crate::identity::Caller;
use crate::mcp::limited::{self, AddTo, Routed};
use crate::mcp::results;
use crate::rate_limits::RateLimits;
use crate::upstream::queue::QueuePlace;

/// One downstream session's handler.
pub struct ProxyServer {
    proxied: Arc<Proxied>,
    limits: RateLimits,
    /// The session, as the proxy keeps it (shared with the relay lane).
    seat: Arc<Seat>,
}

/// A request's way to the proxied server: its scope's session, and that session's client.
struct Asking {
    upstream: Arc<Upstream>,
    peer: Arc<Peer<RoleClient>>,
}

impl std::fmt::Debug for ProxyServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyServer").field("seat", &self.seat).finish_non_exhaustive()
    }
}

impl ProxyServer {
    /// A handler for one session, over HTTP or stdio: the caller is the one the HTTP layer named,
    /// and over stdio the local one ([`limited::caller_of`]).
    pub fn new(proxied: Arc<Proxied>, limits: RateLimits) -> Self {
        let seat = Arc::new(Seat::new(proxied.scopes().next_session()));
        Self { proxied, limits, seat }
    }

    /// The scope of `caller`'s requests in this session (`None`: the proxy's own session).
    fn scope(&self, caller: &Caller) -> Option<String> {
        self.seat.scope(&self.proxied, caller)
    }

    /// The session to the proxied server this request goes on ([`Seat::upstream`]).
    async fn upstream(&self, context: &RequestContext<RoleServer>, what: &str) -> Result<Arc<Upstream>, Unopened> {
        let caller = limited::caller_of(&self.limits, context).map_err(|_| {
            Unopened::Refused(Refusal::upstream_unavailable(what, "the caller could not be named", 1_000))
        })?;
        self.seat.upstream(&self.proxied, &self.limits, &caller, what).await
    }

    /// Why a scope's session could not be had, as the refusal its caller gets.
    fn unopened_refusal(&self, what: &str, unopened: Unopened) -> Refusal {
        self.proxied.unopened_refusal(what, unopened)
    }

    /// Why a scope's session could not be had, as a JSON-RPC error, on the dashboard as any other
    /// refusal (a tool call's is the one guarded call's to record).
    fn unopened(&self, context: &RequestContext<RoleServer>, method: &str, unopened: Unopened) -> ErrorData {
        let refusal = self.unopened_refusal(method, unopened);
        if let Ok(caller) = limited::caller_of(&self.limits, context) {
            self.limits.guard().seen_refused(&caller, method, &refusal);
        }
        results::method_error(&refusal)
    }

    /// A method passed to the proxied server, as every such handler serves it: admitted under its
    /// per-method limit in its span ([`limited::method`]), then `asked` of the session to the
    /// proxied server of its caller's scope (or the refusal a caller gets while it is down), the
    /// proxied server's error passed back as its own ([`ProxyServer::passed`]).
    async fn pass<T, F>(
        &self,
        method: &str,
        context: &RequestContext<RoleServer>,
        asked: impl FnOnce(Asking) -> F,
    ) -> Result<T, ErrorData>
    where
        F: Future<Output = Result<T, ServiceError>>,
    {
        limited::method(&self.limits, method, context, |_| async {
            let asking = self.asking(context, method).await?;
            asked(asking).await.map_err(|e| self.passed(method, e))
        })
        .await
    }

    /// The session to the proxied server of `context`'s caller's scope, for `method`, or the
    /// refusal a caller gets while it is down.
    async fn asking(&self, context: &RequestContext<RoleServer>, method: &str) -> Result<Asking, ErrorData> {
        let upstream = self.upstream(context, method).await.map_err(|u| self.unopened(context, method, u))?;
        let peer = upstream.link().peer().ok_or_else(|| self.unavailable(method, "it is restarting"))?;
        Ok(Asking { upstream, peer })
    }

    /// A passed-through request's error: the proxied server's own, unchanged; or why it could not
    /// be asked (the transport's words, which quote the URL, redacted).
    fn passed(&self, method: &str, error: ServiceError) -> ErrorData {
        match error {
            ServiceError::McpError(error) => error,
            other => self.unavailable(method, &crate::redact::url(&other.to_string())),
        }
    }

    /// `upstream_unavailable` for `what`, with the breaker's time left as the wait (a second when
    /// it is closed).
    fn unavailable_refusal(&self, what: &str, detail: &str) -> Refusal {
        self.proxied.unavailable_refusal(what, detail)
    }

    /// `upstream_unavailable` as a JSON-RPC error, with the refusal's data.
    fn unavailable(&self, method: &str, detail: &str) -> ErrorData {
        results::method_error(&self.unavailable_refusal(method, detail))
    }

    /// `request` sent to the proxied server with what the caller's `_meta` may carry there
    /// ([`Proxied::upstream_meta`]): a task's requests need the capabilities the caller declared
    /// (the tasks extension), which the proxy's own session to it does not.
    async fn as_caller(
        &self,
        asking: &Asking,
        request: ClientRequest,
        context: &RequestContext<RoleServer>,
    ) -> Result<ServerResult, ServiceError> {
        let mut options = PeerRequestOptions::no_options();
        options.meta = Some(asking.upstream.upstream_meta(with_trace_context(context)));
        asking.peer.send_request_with_option(request, options).await?.await_response().await
    }

    /// Subscribes a 2026-07-28 subscription to `uris` on `upstream` (a 2025-11-25 session): each
    /// charged as a 2025-11-25 session's `resources/subscribe` is (so asking for many buys
    /// nothing), and each no one on that session subscribed to yet subscribed to upstream, within
    /// the time a listing of tools has. The subscriptions are given up as the returned guard is
    /// dropped.
    #[allow(deprecated)] // Resource subscriptions are what a 2025-11-25 server knows.
    async fn subscribe_all(
        &self,
        context: &RequestContext<RoleServer>,
        upstream: &Arc<Upstream>,
        uris: Vec<String>,
    ) -> Result<Resources, ErrorData> {
        let method = "subscriptions/listen";
        let peer = upstream.link().peer().ok_or_else(|| self.unavailable(method, "it is restarting"))?;
        let downstream = upstream.downstream().clone();
        let mut resources = Resources { subscriber: downstream.subscriber(), downstream, peer, uris: Vec::new() };
        for uri in uris {
            // Each resource is charged as a subscription of its own.
            limited::method(&self.limits, "resources/subscribe", context, |_| async { Ok(()) }).await?;
            let first = resources.downstream.subscribe(resources.subscriber, &uri);
            resources.uris.push(uri.clone());
            if first {
                let subscribing = resources.peer.subscribe(SubscribeRequestParams::new(uri));
                match tokio::time::timeout(super::link::ANSWER_WITHIN, subscribing).await {
                    Ok(done) => done.map_err(|e| self.passed(method, e))?,
                    Err(_) => return Err(self.unavailable(method, "it did not answer in time")),
                }
            }
        }
        Ok(resources)
    }

    /// Refuses a task the caller does not own — another caller's, or one no proxied call of ours
    /// created — as `serve` refuses a job that is not the caller's: unknown, whether it exists or
    /// not. (The method limit has counted the request already: guessing ids costs.)
    fn owned(&self, context: &RequestContext<RoleServer>, task: &str) -> Result<(), ErrorData> {
        let caller = limited::caller_of(&self.limits, context)?;
        if self.proxied.tasks.is_owned_by(&scopes::task_key(self.scope(&caller).as_deref(), task), caller.id()) {
            Ok(())
        } else {
            Err(ErrorData::invalid_params(format!("unknown task: {task}"), None))
        }
    }
}

/// The proxy's door around the one guarded call ([`crate::guard::call`]), for one call: the
/// session it goes on could not be opened (its caller's share of the sessions spent, the proxied
/// server unreachable) — refused like any other refusal, by the guard in the call's span, before
/// anything is charged; the proxied server known down (its breaker open), or its queue full,
/// refused before anything is charged too; and a place in its queue held until the call's turn.
/// Its answers are another server's
/// ([`ToolAnswer::relayed`](crate::mcp::limited::ToolAnswer::relayed)): a price settled from the
/// `_meta.usage.units` it reports — never its structured content, which may echo the caller's own
/// arguments — where the operator trusts it to (`settle = "usage"`), and what we add goes in
/// `_meta`.
#[derive(Debug)]
pub(super) struct ToSession<'a> {
    pub(super) proxied: &'a Proxied,
    /// Why its session could not be opened, if it could not.
    pub(super) unopened: Option<Refusal>,
}

impl Door for ToSession<'_> {
    type Place = QueuePlace;

    fn check(
        &self,
        _tool: &str,
        args: &serde_json::Map<String, serde_json::Value>,
        _caller: &Caller,
    ) -> Result<Checked, Refusal> {
        match &self.unopened {
            Some(refusal) => Err(refusal.clone()),
            None => Ok(Checked::new(serde_json::Value::Object(args.clone()))),
        }
    }

    fn before_charging(&self, tool: &str, caller: &Caller) -> Result<QueuePlace, Refusal> {
        self.proxied.before_charging(tool, caller)
    }
}

#[allow(deprecated)] // Logging and resource subscriptions are legacy in 2026-07-28, and still in use.
impl ServerHandler for ProxyServer {
    fn get_info(&self) -> ServerConfig {
        let theirs = self.proxied.link().info();
        let mut capabilities = theirs.as_ref().map(|i| i.capabilities.clone()).unwrap_or_default();
        // The proxy always lists tools, and says when they change.
        let mut tools = capabilities.tools.clone().unwrap_or_default();
        tools.list_changed = Some(true);
        capabilities.tools = Some(tools);
        let ours = "Tools draw on a budget of tokens; each tool's description says what it costs. A refused call \
                    says how many seconds to wait: wait that long instead of retrying. Repeating the exact same call \
                    is refused as a loop.";
        let instructions = match theirs.as_ref().and_then(|i| i.instructions.as_deref()) {
            Some(theirs) => format!("{theirs}\n\n{ours}"),
            None => ours.to_owned(),
        };
        let server_info = theirs
            .as_ref()
            .and_then(|i| i.server_info.clone())
            .unwrap_or_else(|| Implementation::new("mcp-ratelimit-proxy", env!("CARGO_PKG_VERSION")));
        ServerConfig::new(capabilities).with_server_info(server_info).with_instructions(instructions)
    }

    async fn on_initialized(&self, context: NotificationContext<RoleServer>) {
        self.seat.initialized(context.peer);
        // Over HTTP, the relay lane serves its requests as this session's.
        let id = context.extensions.get::<http::request::Parts>().and_then(|parts| parts.headers.get(SESSION_ID));
        if let Some(id) = id.and_then(|id| id.to_str().ok()) {
            self.proxied.seats.register(id, &self.seat);
        }
        // On the proxy's own session, every session hears its notifications from the start.
        if self.proxied.scopes().mode() == UpstreamSessions::Shared {
            self.seat.attach(&self.proxied, self.proxied.scopes().shared());
        }
    }

    async fn ping(&self, context: RequestContext<RoleServer>) -> Result<(), ErrorData> {
        limited::method(&self.limits, "ping", &context, |_| async { Ok(()) }).await
    }

    /// The proxied server's tools, each with its price appended.
    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        limited::method(&self.limits, "tools/list", &context, |_| async {
            let tools = limited::priced(self.proxied.tools().to_vec(), &self.limits.guard().policy());
            Ok(ListToolsResult::with_all_items(tools))
        })
        .await
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        // A name it does not list is not the proxied server's to hear, nor a budget to open.
        if !self.proxied.lists(&request.name) {
            return Err(ErrorData::invalid_params(format!("unknown tool `{}`", request.name), None));
        }
        let upstream = self.upstream(&context, &request.name).await;
        let upstream = upstream.map_err(|unopened| self.unopened_refusal(&request.name, unopened));
        let unopened = upstream.as_ref().err().cloned();
        let session = self.seat.member();
        let progress = session.zip(context.meta.get_progress_token());
        let asker = Asker { peer: context.peer.clone(), session, capabilities: context.client_capabilities() };
        let asked = request.clone();
        let meta = with_trace_context(&context);
        let tool = request.name.to_string();
        let sending = Sending::Rmcp(Box::new(ViaRmcp { request, progress, asker }));
        let outgoing = upstream.map(|upstream| Outgoing { tool, meta, upstream, sending });
        let proxied = self.proxied.clone();
        let work = move |admitted, _: &serde_json::Value| async move {
            match outgoing {
                Ok(outgoing) => proxied.work(admitted, outgoing).await,
                // Refused at the door (`ToSession`) and never run; were it run, the same refusal,
                // nothing sent.
                Err(refusal) => Worked::Refused(refusal, Used::Nothing),
            }
        };
        let tool = Routed { add_to: AddTo::Meta, reads_only: self.proxied.reads_only(&asked.name) };
        let door = ToSession { proxied: &self.proxied, unopened };
        let response = limited::call_tool(&self.limits, &door, tool, &asked, &context, work).await;
        // A task it answers with is the caller's: only its caller may read or cancel it.
        if let Ok(CallToolResponse::Task(task)) = &response
            && let Ok(caller) = limited::caller_of(&self.limits, &context)
        {
            let key = scopes::task_key(self.scope(&caller).as_deref(), &task.task.task_id);
            self.proxied.tasks.record(&key, task.task.ttl_ms, caller.id(), caller.unverified_from());
        }
        response
    }

    async fn list_resources(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, ErrorData> {
        self.pass("resources/list", &context, |a| async move {
            a.peer.list_resources(request).await.map(Complete::complete)
        })
        .await
    }

    async fn list_resource_templates(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListResourceTemplatesResult, ErrorData> {
        self.pass("resources/templates/list", &context, |a| async move {
            a.peer.list_resource_templates(request).await.map(Complete::complete)
        })
        .await
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, ErrorData> {
        self.pass("resources/read", &context, |a| async move {
            a.peer.read_resource_once(request).await.map(Complete::complete)
        })
        .await
    }

    async fn subscribe(
        &self,
        request: SubscribeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        let method = "resources/subscribe";
        limited::method(&self.limits, method, &context, |_| async {
            // Without a session there is nobody to tell of its updates (it has `subscriptions/listen`).
            let sessionless = || ErrorData::invalid_request(SESSIONLESS_SUBSCRIBE, None);
            self.seat.peer().ok_or_else(sessionless)?;
            let asking = self.asking(&context, method).await?;
            let session = self.seat.member().ok_or_else(sessionless)?;
            // The upstream session subscribes once, for every downstream session on it that asked.
            let first = asking.upstream.downstream().subscribe(session, &request.uri);
            if first { asking.peer.subscribe(request).await.map_err(|e| self.passed(method, e)) } else { Ok(()) }
        })
        .await
    }

    /// Ends this session's subscription (upstream with the last session on its scope's to hold one).
    /// A request without a session holds none: it ends nothing, and the proxied server is not asked.
    async fn unsubscribe(
        &self,
        request: UnsubscribeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        let method = "resources/unsubscribe";
        limited::method(&self.limits, method, &context, |_| async {
            let Some(_peer) = self.seat.peer() else { return Ok(()) };
            let asking = self.asking(&context, method).await?;
            let Some(session) = self.seat.member() else { return Ok(()) };
            let last = asking.upstream.downstream().unsubscribe(session, &request.uri);
            if last { asking.peer.unsubscribe(request).await.map_err(|e| self.passed(method, e)) } else { Ok(()) }
        })
        .await
    }

    async fn list_prompts(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListPromptsResult, ErrorData> {
        self.pass(
            "prompts/list",
            &context,
            |a| async move { a.peer.list_prompts(request).await.map(Complete::complete) },
        )
        .await
    }

    async fn get_prompt(
        &self,
        request: GetPromptRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<GetPromptResponse, ErrorData> {
        self.pass(
            "prompts/get",
            &context,
            |a| async move { a.peer.get_prompt_once(request).await.map(Complete::complete) },
        )
        .await
    }

    async fn complete(
        &self,
        request: CompleteRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CompleteResult, ErrorData> {
        self.pass(
            "completion/complete",
            &context,
            |a| async move { a.peer.complete(request).await.map(Complete::complete) },
        )
        .await
    }

    /// Sets the level of the proxied server's log messages this session hears; the proxied
    /// server's own level becomes the most verbose any session asked for (see [`super::relay`]).
    /// A request without a session (2026-07-28, stateless) hears no log messages, and changes
    /// nothing.
    async fn set_level(
        &self,
        request: SetLevelRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        let method = "logging/setLevel";
        limited::method(&self.limits, method, &context, |_| async {
            let asking = self.asking(&context, method).await?;
            let Some(session) = self.seat.member() else { return Ok(()) };
            let downstream = asking.upstream.downstream();
            let mut set = downstream.upstream_level.lock().await;
            let wanted = downstream.set_level(session, request.level);
            // A 2026-07-28 server has no level to set: each request says its own (`upstream_meta`).
            if asking.upstream.stateless() {
                return Ok(());
            }
            if *set != Some(wanted) {
                // Within the time a listing of tools has: the lock is held meanwhile.
                let setting = asking.peer.set_level(SetLevelRequestParams::new(wanted));
                match tokio::time::timeout(super::link::ANSWER_WITHIN, setting).await {
                    Ok(done) => done.map_err(|e| self.passed(method, e))?,
                    Err(_) => return Err(self.unavailable(method, "it did not answer in time")),
                }
                *set = Some(wanted);
            }
            Ok(())
        })
        .await
    }

    /// A 2026-07-28 caller's subscription: of what it asks, the lists' changes — the tools', which
    /// the proxy tells of once it has learnt them again, and the prompts' and resources', which
    /// the proxied server tells of (rmcp keeps only those its capabilities advertise). Updates of
    /// single resources are not offered: they are subscribed upstream per URI, a 2025-11-25
    /// session's `resources/subscribe`.
    fn accepted_subscription_filter(&self, requested: &SubscriptionFilter) -> Option<SubscriptionFilter> {
        let wanted = |asked: Option<bool>| asked.filter(|&wanted| wanted);
        let mut accepted = SubscriptionFilter::new();
        accepted.tools_list_changed = wanted(requested.tools_list_changed);
        accepted.prompts_list_changed = wanted(requested.prompts_list_changed);
        accepted.resources_list_changed = wanted(requested.resources_list_changed);
        // Single resources from a 2025-11-25 server, which the proxy subscribes to for it
        // (`resources/subscribe`, once for all its subscribers); the first [`MAX_RESOURCES`].
        if !self.proxied.scopes().shared().stateless() {
            accepted.resource_subscriptions = requested
                .resource_subscriptions
                .as_ref()
                .map(|uris| uris.iter().take(MAX_RESOURCES).cloned().collect::<Vec<_>>())
                .filter(|uris| !uris.is_empty());
        }
        Some(accepted)
    }

    /// Holds a subscription open until its caller ends it (or the proxy stops), telling it of
    /// each change it accepted: the tools learnt again, and the prompts' and resources' lists as
    /// the session to the proxied server of the caller's scope hears of them (that session is
    /// held open meanwhile). It holds a place among its caller's (its address's, unverified)
    /// subscriptions meanwhile ([`super::subscriptions`]): one past the bound is refused before
    /// anything is charged. Opening one is charged as any other method (`limits.method.other`).
    async fn listen(&self, subscription: SubscriptionContext) -> Result<(), ErrorData> {
        let method = "subscriptions/listen";
        // From its acknowledgment on: a change while its scope's session opens is not missed.
        let mut relearnt = self.proxied.relearnt();
        let context = subscription.request_context();
        let caller = limited::caller_of(&self.limits, context)?;
        let _place = self.proxied.subscriptions.open(&caller, method).map_err(|refusal| {
            self.limits.guard().seen_refused(&caller, method, &refusal);
            results::method_error(&refusal)
        })?;
        limited::method(&self.limits, method, context, |_| async { Ok(()) }).await?;
        let upstream = self.upstream(context, method).await.map_err(|u| self.unopened(context, method, u))?;
        let _open = upstream.hold(&self.proxied.clock);
        let mut changes = upstream.downstream().changes();
        let uris = subscription.accepted().resource_subscriptions.clone().unwrap_or_default();
        let _resources = if uris.is_empty() { None } else { Some(self.subscribe_all(context, &upstream, uris).await?) };
        loop {
            let told: Vec<ServerNotification> = tokio::select! {
                () = subscription.cancelled() => return Ok(()),
                relearnt = relearnt.changed() => match relearnt {
                    Ok(()) => vec![ServerNotification::ToolListChangedNotification(Default::default())],
                    Err(_) => return Ok(()),
                },
                change = changes.recv() => match change {
                    Ok(Change::Prompts) => vec![ServerNotification::PromptListChangedNotification(Default::default())],
                    Ok(Change::Resources) => {
                        vec![ServerNotification::ResourceListChangedNotification(Default::default())]
                    }
                    // Of those it subscribed to (the sink sends no other).
                    Ok(Change::Resource(uri)) => vec![ServerNotification::ResourceUpdatedNotification(
                        ResourceUpdatedNotification::new(ResourceUpdatedNotificationParam::new(uri)),
                    )],
                    // It fell behind: whatever it missed, both lists may have changed.
                    Err(RecvError::Lagged(_)) => vec![
                        ServerNotification::PromptListChangedNotification(Default::default()),
                        ServerNotification::ResourceListChangedNotification(Default::default()),
                    ],
                    Err(RecvError::Closed) => return Ok(()),
                },
            };
            for notification in told {
                match subscription.sink().send(notification).await {
                    // Not a kind it accepted: it is not told.
                    Ok(()) | Err(SubscriptionSendError::NotificationNotAccepted(_)) => {}
                    Err(_) => return Ok(()),
                }
            }
        }
    }

    /// A task of the caller's own, as the proxied server reports it; any other is unknown.
    async fn get_task(
        &self,
        request: GetTaskParams,
        context: RequestContext<RoleServer>,
    ) -> Result<GetTaskResult, ErrorData> {
        let method = "tasks/get";
        limited::method(&self.limits, method, &context, |_| async {
            let asking = self.asking(&context, method).await?;
            self.owned(&context, &request.task_id)?;
            let request = ClientRequest::GetTaskRequest(GetTaskRequest::new(request));
            let mut got = match self.as_caller(&asking, request, &context).await {
                Ok(ServerResult::GetTaskResult(got)) => got,
                Ok(_) => return Err(self.passed(method, ServiceError::UnexpectedResponse)),
                Err(error) => return Err(self.passed(method, error)),
            };
            // Its result, a 2025-11-25 server's, made valid for a 2026-07-28 caller as any other.
            if let TaskPayload::Completed { result } = &mut got.task.payload {
                result.entry("resultType").or_insert_with(|| ResultType::COMPLETE.as_str().into());
            }
            Ok(got)
        })
        .await
    }

    /// Cancels a task of the caller's own; any other is unknown, and the proxied server never hears.
    async fn cancel_task(
        &self,
        request: CancelTaskParams,
        context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        let method = "tasks/cancel";
        limited::method(&self.limits, method, &context, |_| async {
            let asking = self.asking(&context, method).await?;
            self.owned(&context, &request.task_id)?;
            let request = ClientRequest::CancelTaskRequest(CancelTaskRequest::new(request));
            match self.as_caller(&asking, request, &context).await {
                Ok(ServerResult::TaskAckResult(_) | ServerResult::EmptyResult(_)) => Ok(()),
                Ok(_) => Err(self.passed(method, ServiceError::UnexpectedResponse)),
                Err(error) => Err(self.passed(method, error)),
            }
        })
        .await
    }
}

/// The header a 2025-11-25 session's requests name it by.
const SESSION_ID: &str = "mcp-session-id";

/// Why a `resources/subscribe` without a session (2026-07-28's lifecycle) is refused.
const SESSIONLESS_SUBSCRIBE: &str = "`resources/subscribe` needs a session (2025-11-25's `initialize`) to send \
                                     the updates on; without one, name the resource in a `subscriptions/listen` \
                                     request (`resourceSubscriptions`)";

/// The most resources one 2026-07-28 subscription may ask to hear of (each is charged, and may
/// cost a request to the proxied server).
const MAX_RESOURCES: usize = 100;

/// A 2026-07-28 subscription's place among the subscribers of single resources on one session
/// to the proxied server; dropped, it leaves, and each resource nobody is subscribed to any more
/// is unsubscribed from upstream.
struct Resources {
    downstream: Arc<super::Downstream>,
    peer: Arc<Peer<RoleClient>>,
    subscriber: u64,
    uris: Vec<String>,
}

impl Drop for Resources {
    #[allow(deprecated)] // Resource subscriptions are what a 2025-11-25 server knows.
    fn drop(&mut self) {
        let left: Vec<String> =
            self.uris.drain(..).filter(|uri| self.downstream.unsubscribe(self.subscriber, uri)).collect();
        if left.is_empty() {
            return;
        }
        let peer = self.peer.clone();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                for uri in left {
                    let _ = peer.unsubscribe(UnsubscribeRequestParams::new(uri)).await;
                }
            });
        }
    }
}

/// The W3C trace context's names, as HTTP headers and as request `_meta` keys (SEP-414).
const TRACEPARENT: &str = "traceparent";
const TRACESTATE: &str = "tracestate";

/// The caller's request `_meta`, with the W3C trace context its HTTP request carried
/// (`traceparent`, `tracestate` headers) where the `_meta` says none of its own: the proxied
/// server hears it in `_meta`, where MCP carries a request's trace context (SEP-414), so the
/// caller's trace goes on through the proxied server whichever way the caller sent it. A
/// `traceparent` that is not one (W3C Trace Context's format) is left out, and its `tracestate`
/// with it; a `tracestate`, from either place, only if
/// [`accepted_tracestate`](crate::guard::trace::accepted_tracestate) (1 to 512 bytes of printable
/// ASCII).
fn with_trace_context(context: &RequestContext<RoleServer>) -> rmcp::model::RequestMetaObject {
    let headers = context.extensions.get::<http::request::Parts>().map(|parts| &parts.headers);
    with_trace_headers(context.meta.clone(), headers)
}

/// [`with_trace_context`] of a request's `_meta` and its HTTP headers (none over stdio).
pub(super) fn with_trace_headers(
    mut meta: rmcp::model::RequestMetaObject,
    headers: Option<&http::HeaderMap>,
) -> rmcp::model::RequestMetaObject {
    use crate::guard::trace::accepted_tracestate;
    if meta.0.get(TRACESTATE).is_some_and(|state| !state.as_str().is_some_and(accepted_tracestate)) {
        meta.0.remove(TRACESTATE);
    }
    if meta.0.contains_key(TRACEPARENT) {
        return meta;
    }
    let Some(headers) = headers else { return meta };
    let header = |name: &str| headers.get(name).and_then(|value| value.to_str().ok()).map(str::trim);
    let Some(parent) = header(TRACEPARENT).filter(|parent| is_traceparent(parent)) else { return meta };
    meta.0.insert(TRACEPARENT.to_owned(), parent.into());
    match header(TRACESTATE).filter(|state| accepted_tracestate(state)) {
        Some(state) => meta.0.insert(TRACESTATE.to_owned(), state.into()),
        // Not one its `_meta` may keep beside the header's traceparent either.
        None => meta.0.remove(TRACESTATE),
    };
    meta
}

/// Whether `value` is a W3C `traceparent`: `VERSION-TRACEID-PARENTID-FLAGS` in lowercase hex,
/// neither id all zeros, version `ff` never; version `00` exactly that, a later version perhaps
/// followed by `-` and more.
fn is_traceparent(value: &str) -> bool {
    let bytes = value.as_bytes();
    let hex = |part: &[u8]| part.iter().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b));
    let zeros = |part: &[u8]| part.iter().all(|&b| b == b'0');
    if bytes.len() < 55 || bytes[2] != b'-' || bytes[35] != b'-' || bytes[52] != b'-' {
        return false;
    }
    let (version, trace, parent, flags) = (&bytes[0..2], &bytes[3..35], &bytes[36..52], &bytes[53..55]);
    let rest = &bytes[55..];
    [version, trace, parent, flags].into_iter().all(hex)
        && version != b"ff"
        && !zeros(trace)
        && !zeros(parent)
        && if version == b"00" { rest.is_empty() } else { rest.is_empty() || rest[0] == b'-' }
}

/// A result passed on from the proxied server, made valid for a caller of either protocol
/// version, whatever the proxied server speaks: `resultType: "complete"` where it left it out
/// (a 2025-11-25 server), which a 2026-07-28
/// caller requires; rmcp takes `"complete"` off again for a 2025-11-25 caller. A `resultType`
/// it did say (`input_required`, …) stays.
pub(super) trait Complete {
    fn complete(self) -> Self;
}

macro_rules! complete_where_missing {
    ($($result:ty),*) => {$(
        impl Complete for $result {
            fn complete(mut self) -> Self {
                self.result_type.get_or_insert(ResultType::COMPLETE);
                without_their_connection(&mut self.meta);
                self
            }
        }
    )*};
}

/// The result `_meta` key of 2026-07-28 that describes the proxied server's connection to the
/// proxy, not its answer: who answered it (the proxy answers its callers).
const THEIR_CONNECTION: &str = "io.modelcontextprotocol/serverInfo";

/// `meta` without what describes the proxied server's connection to the proxy; left out
/// altogether where that was all it held, as a 2025-11-25 server would have sent it.
fn without_their_connection(meta: &mut Option<rmcp::model::MetaObject>) {
    if let Some(held) = meta
        && held.remove(THEIR_CONNECTION).is_some()
        && held.is_empty()
    {
        *meta = None;
    }
}

complete_where_missing!(
    CallToolResult,
    ListResourcesResult,
    ListResourceTemplatesResult,
    ListPromptsResult,
    CompleteResult,
    GetPromptResult,
    ReadResourceResult
);

impl Complete for GetPromptResponse {
    fn complete(self) -> Self {
        match self {
            GetPromptResponse::Complete(prompt) => GetPromptResponse::Complete(prompt.complete()),
            other => other,
        }
    }
}

impl Complete for ReadResourceResponse {
    fn complete(self) -> Self {
        match self {
            ReadResourceResponse::Complete(read) => ReadResourceResponse::Complete(read.complete()),
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::is_traceparent;

    #[test]
    fn only_a_w3c_traceparent_is_one() {
        assert!(is_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"));
        assert!(is_traceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-later"));
        for not in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0\u{e9}",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert!(!is_traceparent(not), "{not}");
        }
    }
}
