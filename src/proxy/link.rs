//! The one MCP session to the proxied server, kept up: connected at start-up (a server that
//! cannot be reached then is a start-up error, said plainly), and reconnected — a stdio child
//! restarted — with backoff whenever it ends, the breaker open meanwhile so callers are told at
//! once how long to wait instead of waiting on a dead server.
//!
//! Which downstream sessions share one of these is [`super::scopes`]' to say.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwapOption;
use futures::stream::BoxStream;
use http::{HeaderName, HeaderValue};
use rmcp::model::{ClientJsonRpcMessage, GetMeta};
use rmcp::model::{ProtocolVersion, ServerNotification, ServerPeerInfo, SubscriptionFilter};
use rmcp::service::{Peer, RunningService};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::{
    SseError, StreamableHttpClient, StreamableHttpClientTransportConfig, StreamableHttpError,
    StreamableHttpPostResponse, StreamableHttpResponseLimits,
};
use rmcp::{ClientLifecycleMode, ClientServiceExt, RoleClient};
use sse_stream::Sse;
use tokio_util::sync::CancellationToken;

use super::relay::{Change, Relay};
use super::tap::Tap;
use crate::breaker::Breaker;
use crate::clock::SharedClock;
use crate::config::{ProxyConfig, UpstreamProtocol};

/// Where the proxied server is.
#[derive(Clone)]
pub enum Target {
    /// A streamable HTTP endpoint, and the headers to send it.
    Http {
        /// The endpoint, e.g. `http://127.0.0.1:3001/mcp`.
        url: String,
        /// Sent with every request (credentials, perhaps: never logged).
        headers: Vec<(http::HeaderName, http::HeaderValue)>,
    },
    /// A command started as a stdio child, restarted if it dies.
    Command {
        /// The program.
        program: String,
        /// Its arguments.
        args: Vec<String>,
        /// Its environment, besides the few variables every child gets.
        env: ChildEnv,
    },
}

/// The variables of the proxy's environment every stdio child gets, as the official MCP SDKs
/// pass them to a server they start (`getDefaultEnvironment`: what a program needs to start and
/// find its files), plus the time zone and the temporary directory; the locale (`LC_*`) too.
#[cfg(not(windows))]
pub const ALWAYS_PASSED: &[&str] =
    &["PATH", "HOME", "USER", "LOGNAME", "SHELL", "TERM", "TMPDIR", "TZ", "LANG", "LANGUAGE"];
/// The variables of the proxy's environment every stdio child gets, as the official MCP SDKs
/// pass them to a server they start (`getDefaultEnvironment`).
#[cfg(windows)]
pub const ALWAYS_PASSED: &[&str] = &[
    "APPDATA",
    "HOMEDRIVE",
    "HOMEPATH",
    "LOCALAPPDATA",
    "PATH",
    "PATHEXT",
    "PROCESSOR_ARCHITECTURE",
    "SYSTEMDRIVE",
    "SYSTEMROOT",
    "TEMP",
    "TMP",
    "USERNAME",
    "USERPROFILE",
    "PROGRAMFILES",
];

/// A stdio child's environment. It starts empty: a child is someone else's code (often fetched by
/// `npx -y` at start-up), and the proxy's environment holds its secrets (`MCP_RL__ADMIN__KEY`,
/// the Redis password, upstream credentials). It gets [`ALWAYS_PASSED`] and the locale from the
/// proxy's environment, then what the operator names: `[proxy] inherit_env` (names passed
/// through) and `[proxy] env` (values set). No `MCP_RL__` variable ever reaches it, whoever names
/// it.
#[derive(Clone, Default)]
pub struct ChildEnv {
    /// Set to these values (`[proxy] env`): perhaps credentials.
    pub set: Vec<(String, String)>,
    /// Passed through from the proxy's environment when it has them (`[proxy] inherit_env`).
    pub inherit: Vec<String>,
}

impl std::fmt::Debug for ChildEnv {
    /// Names only: the values may be credentials.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChildEnv")
            .field("set", &self.set.iter().map(|(name, _)| name.as_str()).collect::<Vec<_>>())
            .field("inherit", &self.inherit)
            .finish()
    }
}

/// Whether two variable names are the same variable: exactly, but on Windows, whose names ignore
/// case, in any case.
fn same_name(a: &str, b: &str) -> bool {
    if cfg!(windows) { a.eq_ignore_ascii_case(b) } else { a == b }
}

impl ChildEnv {
    /// What `[proxy] env` and `inherit_env` say.
    pub fn of(config: &ProxyConfig) -> Self {
        Self {
            set: config.env.iter().map(|(name, value)| (name.clone(), value.clone())).collect(),
            inherit: config.inherit_env.clone(),
        }
    }

    /// The child's whole environment, drawn from `proxy` (the proxy's own, as
    /// [`std::env::vars_os`] gives it).
    pub fn variables(&self, proxy: impl IntoIterator<Item = (OsString, OsString)>) -> Vec<(OsString, OsString)> {
        let mut out: BTreeMap<OsString, OsString> = BTreeMap::new();
        for (name, value) in proxy {
            let Some(text) = name.to_str() else { continue };
            let always = ALWAYS_PASSED.iter().any(|a| same_name(a, text)) || text.starts_with("LC_");
            // A value that looks like an exported shell function is not passed by default (as
            // the SDKs do): a shell the child starts would define it.
            let function = value.to_str().is_some_and(|v| v.starts_with("()"));
            if (always && !function) || self.inherit.iter().any(|n| same_name(n, text)) {
                out.insert(name, value);
            }
        }
        for (name, value) in &self.set {
            out.insert(name.into(), value.into());
        }
        // Whoever built this (a config is checked for it already): never one of the proxy's own.
        out.retain(|name, _| name.to_str().is_some_and(|name| !crate::config::proxy::is_own_variable(name)));
        out.into_iter().collect()
    }
}

impl Target {
    /// The proxied server the command line names (`--upstream URL`, or `-- COMMAND ARGS…`), else
    /// the one `[proxy]` names; with `[proxy] headers` for a URL. Exactly one must be named.
    pub fn of(config: &ProxyConfig, url: Option<String>, command: Vec<String>) -> Result<Self, String> {
        let url = url.or_else(|| Some(config.upstream_url.clone()).filter(|u| !u.is_empty()));
        let command = if command.is_empty() { config.command.clone() } else { command };
        let headers = || -> Result<Vec<_>, String> {
            config
                .headers
                .iter()
                .map(|(name, value)| {
                    let bad = || format!("`proxy.headers.{name}` is not a valid header");
                    Ok((http::HeaderName::try_from(name.as_str()).map_err(|_| bad())?, {
                        let mut value = http::HeaderValue::try_from(value.as_str()).map_err(|_| bad())?;
                        value.set_sensitive(true);
                        value
                    }))
                })
                .collect()
        };
        match (url, command.split_first()) {
            (Some(_), Some(_)) => Err("name one proxied server: --upstream URL or -- COMMAND, not both".to_owned()),
            (Some(url), None) => {
                crate::config::proxy::check_upstream_url(&url).map_err(|why| format!("--upstream {url:?}: {why}"))?;
                Ok(Target::Http { url, headers: headers()? })
            }
            (None, Some((program, args))) if !program.trim().is_empty() => {
                Ok(Target::Command { program: program.clone(), args: args.to_vec(), env: ChildEnv::of(config) })
            }
            _ => Err("name the proxied server: --upstream URL, or -- COMMAND ARGS… (or `proxy.upstream_url`, \
                      `proxy.command` in the config)"
                .to_owned()),
        }
    }
}

impl std::fmt::Debug for Target {
    /// The URL without its password, header names without values.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Http { url, headers } => f
                .debug_struct("Http")
                .field("url", &crate::redact::url(url))
                .field("headers", &headers.iter().map(|(name, _)| name.as_str()).collect::<Vec<_>>())
                .finish(),
            Target::Command { program, args, env } => f
                .debug_struct("Command")
                .field("program", program)
                .field("args", &args.len())
                .field("env", env)
                .finish(),
        }
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Http { url, .. } => write!(f, "{}", crate::redact::url(url)),
            Target::Command { program, .. } => write!(f, "`{program}` (stdio)"),
        }
    }
}

/// Why the proxied server could not be reached.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// The child could not be started.
    #[error("cannot start {target}: {source}")]
    Spawn {
        /// What was started.
        target: String,
        /// Why not.
        source: std::io::Error,
    },
    /// The MCP handshake failed.
    #[error("{target} did not complete the MCP handshake: {reason}")]
    Handshake {
        /// Whom we asked.
        target: String,
        /// What went wrong.
        reason: String,
    },
}

/// The session to the proxied server, while it is up.
pub struct Link {
    target: Target,
    /// Requests the session may have in flight at once (`proxy.max_in_flight`).
    concurrency: usize,
    /// The version its client asks for (`proxy.upstream_protocol`).
    protocol: UpstreamProtocol,
    peer: ArcSwapOption<Peer<RoleClient>>,
    /// What the proxied server said of itself at its last handshake.
    info: ArcSwapOption<ServerPeerInfo>,
    /// The child's process id, while one runs (for logs, and tests that kill it).
    child: std::sync::Mutex<Option<u32>>,
    /// The HTTP client of its sessions (and of the relay lane): one pool of connections.
    client: reqwest::Client,
    /// Its endpoint, read once (over HTTP).
    endpoint: Option<reqwest::Url>,
    /// The proxied server's id for the session over HTTP (`Mcp-Session-Id`), as rmcp's client
    /// last sent it: what the relay lane's requests on the session carry.
    session_id: Arc<ArcSwapOption<String>>,
    /// A stdio child's pipes as the relay lane shares them, while it runs.
    tap: ArcSwapOption<Tap>,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link").field("target", &self.target).field("up", &self.peer.load().is_some()).finish()
    }
}

/// First wait before reconnecting, doubled after each failed attempt up to [`RESTART_AT_MOST`].
const RESTART_FIRST: Duration = Duration::from_millis(200);
const RESTART_AT_MOST: Duration = Duration::from_secs(30);
/// A handshake, or a listing of the tools, that takes longer than this has failed.
pub(super) const ANSWER_WITHIN: Duration = Duration::from_secs(30);

type Session = RunningService<RoleClient, Relay>;

/// A 2026-07-28 server tells its clients of changes only on a subscription they hold open
/// (`subscriptions/listen`): the proxy holds one for each session to it, asking for what the
/// server says it tells of (its tools', prompts' and resources' lists changing), and relays what it
/// hears as a 2025-11-25 session's notifications are ([`Relay`]). It ends with the session. A
/// 2025-11-25 server tells its sessions unasked; a server that refuses the subscription is left
/// to be asked again when it comes back.
fn hear_changes(session: &Session, relay: Relay) {
    let Some(info) = session.peer_info() else { return };
    if info.protocol_version < ProtocolVersion::V_2026_07_28 {
        return;
    }
    let tells = |list_changed: Option<bool>| list_changed.filter(|&tells| tells);
    let capabilities = &info.capabilities;
    let mut asked = SubscriptionFilter::new();
    asked.tools_list_changed = tells(capabilities.tools.as_ref().and_then(|t| t.list_changed));
    asked.prompts_list_changed = tells(capabilities.prompts.as_ref().and_then(|p| p.list_changed));
    asked.resources_list_changed = tells(capabilities.resources.as_ref().and_then(|r| r.list_changed));
    if asked == SubscriptionFilter::new() {
        return;
    }
    let peer = session.peer().clone();
    tokio::spawn(async move {
        let mut subscription = match tokio::time::timeout(ANSWER_WITHIN, peer.listen(asked)).await {
            Ok(Ok(subscription)) => subscription,
            Ok(Err(error)) => {
                let reason = crate::redact::url(&error.to_string());
                tracing::info!(%reason, "the proxied server holds no subscription for the proxy: its changes go unheard");
                return;
            }
            Err(_) => {
                tracing::info!("the proxied server did not acknowledge a subscription in time: its changes go unheard");
                return;
            }
        };
        while let Ok(Some(heard)) = subscription.next().await {
            match heard {
                ServerNotification::ToolListChangedNotification(_) => relay.tools_changed(),
                ServerNotification::PromptListChangedNotification(_) => relay.changed(Change::Prompts).await,
                ServerNotification::ResourceListChangedNotification(_) => relay.changed(Change::Resources).await,
                _ => {}
            }
        }
    });
}

/// How the proxy's client meets the proxied server (`proxy.upstream_protocol`). `auto` asks for
/// 2026-07-28 (`server/discover`) and speaks it where the server does (no session: each request
/// carries its `_meta`, `Mcp-Method` and `Mcp-Name` go with it over HTTP, and a tool may ask the
/// caller for input, `input_required`); a server that does not know `server/discover` gets the
/// 2025-11-25 `initialize` handshake instead, within 10 seconds of asking.
fn lifecycle(protocol: UpstreamProtocol) -> ClientLifecycleMode {
    match protocol {
        UpstreamProtocol::Auto => ClientLifecycleMode::Auto {
            preferred_versions: vec![ProtocolVersion::V_2026_07_28],
            legacy_version: Some(ProtocolVersion::V_2025_11_25),
        },
        UpstreamProtocol::V2025_11_25 => ClientLifecycleMode::Initialize,
        UpstreamProtocol::V2026_07_28 => {
            ClientLifecycleMode::Discover { preferred_versions: vec![ProtocolVersion::V_2026_07_28] }
        }
    }
}

impl Link {
    /// Connects to `target` once (its error is the start-up error), with up to `concurrency`
    /// requests in flight on the session, and keeps it up until `stop`, reconnecting with backoff; `breaker` is opened while it is down and closed
    /// when it is back. `on_up` runs after every reconnection (the tools are listed again; the caller
    /// lists them after this first one).
    pub async fn start(
        target: Target,
        config: &ProxyConfig,
        relay: Relay,
        breaker: Arc<Breaker>,
        clock: SharedClock,
        stop: CancellationToken,
        on_up: impl Fn() + Send + Sync + 'static,
    ) -> Result<Arc<Self>, LinkError> {
        let endpoint = match &target {
            Target::Http { url, .. } => reqwest::Url::parse(url).ok(),
            Target::Command { .. } => None,
        };
        let link = Arc::new(Self {
            endpoint,
            target,
            concurrency: config.max_in_flight,
            protocol: config.upstream_protocol,
            peer: ArcSwapOption::empty(),
            info: ArcSwapOption::empty(),
            child: std::sync::Mutex::new(None),
            // A pooled client (the default one opens a connection per request), each request
            // sent at once (`TCP_NODELAY`, reqwest's default, said here so it stays so).
            client: reqwest::Client::builder().tcp_nodelay(true).build().map_err(|e| LinkError::Handshake {
                target: "the proxied server".to_owned(),
                reason: format!("no HTTP client: {e}"),
            })?,
            session_id: Arc::new(ArcSwapOption::empty()),
            tap: ArcSwapOption::empty(),
        });
        let session = link.connect(relay.clone()).await?;
        link.up(&session, &relay);
        let kept = link.clone();
        tokio::spawn(async move { kept.keep_up(session, relay, breaker, clock, stop, on_up).await });
        Ok(link)
    }

    /// Where the proxied server is.
    pub fn target(&self) -> &Target {
        &self.target
    }

    /// The session, while it is up.
    pub fn peer(&self) -> Option<Arc<Peer<RoleClient>>> {
        self.peer.load_full()
    }

    /// What the proxied server said of itself at its last handshake.
    pub fn info(&self) -> Option<Arc<ServerPeerInfo>> {
        self.info.load_full()
    }

    /// The HTTP client its sessions use.
    pub fn client(&self) -> &reqwest::Client {
        &self.client
    }

    /// Its streamable HTTP endpoint, when it is reached over HTTP.
    pub fn endpoint(&self) -> Option<&reqwest::Url> {
        self.endpoint.as_ref()
    }

    /// The proxied server's id for the session over HTTP (`Mcp-Session-Id`), once it gave one.
    pub fn session_id(&self) -> Option<Arc<String>> {
        self.session_id.load_full()
    }

    /// A stdio child's pipes, as the relay lane writes to them, while it runs.
    pub fn tap(&self) -> Option<Arc<Tap>> {
        self.tap.load_full()
    }

    /// The stdio child's process id, while one runs.
    pub fn child_pid(&self) -> Option<u32> {
        *self.child.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn up(&self, session: &Session, relay: &Relay) {
        self.info.store(session.peer_info());
        self.peer.store(Some(Arc::new(session.peer().clone())));
        hear_changes(session, relay.clone());
    }

    async fn keep_up(
        self: Arc<Self>,
        mut session: Session,
        relay: Relay,
        breaker: Arc<Breaker>,
        clock: SharedClock,
        stop: CancellationToken,
        on_up: impl Fn() + Send + Sync + 'static,
    ) {
        loop {
            let ended = tokio::select! {
                ended = session.waiting() => ended,
                () = stop.cancelled() => return,
            };
            self.peer.store(None);
            *self.child.lock().unwrap_or_else(|p| p.into_inner()) = None;
            self.tap.store(None);
            breaker.trip(clock.now());
            tracing::warn!(upstream = %self.target, reason = ?ended.ok(), "the proxied server went away; reconnecting");
            let mut wait = RESTART_FIRST;
            session = loop {
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    () = stop.cancelled() => return,
                }
                match self.connect(relay.clone()).await {
                    Ok(session) => break session,
                    Err(error) => {
                        breaker.trip(clock.now());
                        tracing::warn!(%error, retry_in = ?wait.saturating_mul(2).min(RESTART_AT_MOST), "reconnecting failed");
                        wait = wait.saturating_mul(2).min(RESTART_AT_MOST);
                    }
                }
            };
            self.up(&session, &relay);
            breaker.close();
            on_up();
            tracing::info!(upstream = %self.target, "the proxied server is back");
        }
    }

    async fn connect(&self, relay: Relay) -> Result<Session, LinkError> {
        let target = self.target.to_string();
        // The transport's errors quote the URL, with any password in it.
        let handshake =
            |reason: String| LinkError::Handshake { target: target.clone(), reason: crate::redact::url(&reason) };
        let connecting = async {
            match &self.target {
                Target::Http { url, headers } => {
                    // A new session: its id is the one rmcp's client sends from now on.
                    self.session_id.store(None);
                    let headers: HashMap<_, _> = headers.iter().cloned().collect();
                    // As many requests at once as the proxy lets through, and the subscription
                    // it holds open ([`hear_changes`]): the transport's own limit (16) would be a
                    // second, hidden cap.
                    let config = StreamableHttpClientTransportConfig::with_uri(url.as_str())
                        .custom_headers(headers)
                        .max_concurrent_requests(self.concurrency.saturating_add(1));
                    let traced = Traced { client: self.client.clone(), session_id: self.session_id.clone() };
                    let transport = StreamableHttpClientTransport::with_client(traced, config);
                    relay
                        .serve_with_lifecycle(transport, lifecycle(self.protocol))
                        .await
                        .map_err(|e| handshake(e.to_string()))
                }
                Target::Command { program, args, env } => {
                    let mut command = tokio::process::Command::new(program);
                    command.args(args).env_clear().envs(env.variables(std::env::vars_os()));
                    command.stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped());
                    command.kill_on_drop(true);
                    let spawned = command.spawn().and_then(|child| {
                        *self.child.lock().unwrap_or_else(|p| p.into_inner()) = child.id();
                        Tap::over(child)
                    });
                    let (pipe, tap) = spawned.map_err(|source| LinkError::Spawn { target: target.clone(), source })?;
                    self.tap.store(Some(tap));
                    relay
                        .serve_with_lifecycle(pipe, lifecycle(self.protocol))
                        .await
                        .map_err(|e| handshake(e.to_string()))
                }
            }
        };
        tokio::time::timeout(ANSWER_WITHIN, connecting)
            .await
            .map_err(|_| handshake(format!("no answer within {ANSWER_WITHIN:?}")))?
    }
}

/// The HTTP client of a proxied server's session: reqwest, as rmcp drives it, with the W3C trace
/// context a forwarded request carries in its `_meta` (`traceparent`, `tracestate`: the proxy's
/// span, when traces are on) also sent as headers, where an HTTP server instrumented with
/// OpenTelemetry reads it; it notes the session's id as rmcp sends it, for the relay lane.
/// Anything else passes as it is.
#[derive(Clone)]
struct Traced {
    client: reqwest::Client,
    session_id: Arc<ArcSwapOption<String>>,
}

impl Traced {
    /// Notes `id` as the session's, where it is a new one.
    fn note(&self, id: Option<&Arc<str>>) {
        if let Some(id) = id
            && self.session_id.load().as_deref().is_none_or(|known| known.as_str() != &**id)
        {
            self.session_id.store(Some(Arc::new(id.to_string())));
        }
    }
}

/// `headers` with the trace context of `message`'s `_meta`, if it is a request carrying one.
fn with_trace_headers(
    message: &ClientJsonRpcMessage,
    mut headers: HashMap<HeaderName, HeaderValue>,
) -> HashMap<HeaderName, HeaderValue> {
    let ClientJsonRpcMessage::Request(request) = message else { return headers };
    let meta = request.request.get_meta();
    for (name, value) in [("traceparent", meta.get_traceparent()), ("tracestate", meta.get_tracestate())] {
        if let Some(value) = value.and_then(|v| HeaderValue::from_str(v).ok()) {
            headers.insert(HeaderName::from_static(name), value);
        }
    }
    headers
}

impl StreamableHttpClient for Traced {
    type Error = reqwest::Error;

    fn post_message(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> impl Future<Output = Result<StreamableHttpPostResponse, StreamableHttpError<Self::Error>>> + Send + '_ {
        let headers = with_trace_headers(&message, custom_headers);
        self.note(session_id.as_ref());
        self.client.post_message(uri, message, session_id, auth_header, headers)
    }

    fn post_message_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        max_sse_event_size: usize,
    ) -> impl Future<Output = Result<StreamableHttpPostResponse, StreamableHttpError<Self::Error>>> + Send + '_ {
        let headers = with_trace_headers(&message, custom_headers);
        self.note(session_id.as_ref());
        self.client.post_message_with_max_sse_event_size(
            uri,
            message,
            session_id,
            auth_header,
            headers,
            max_sse_event_size,
        )
    }

    fn post_message_with_response_limits(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        limits: StreamableHttpResponseLimits,
    ) -> impl Future<Output = Result<StreamableHttpPostResponse, StreamableHttpError<Self::Error>>> + Send + '_ {
        let headers = with_trace_headers(&message, custom_headers);
        self.note(session_id.as_ref());
        self.client.post_message_with_response_limits(uri, message, session_id, auth_header, headers, limits)
    }

    fn delete_session(
        &self,
        uri: Arc<str>,
        session_id: Arc<str>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> impl Future<Output = Result<(), StreamableHttpError<Self::Error>>> + Send + '_ {
        self.client.delete_session(uri, session_id, auth_header, custom_headers)
    }

    fn get_stream(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> impl Future<Output = Result<BoxStream<'static, Result<Sse, SseError>>, StreamableHttpError<Self::Error>>> + Send + '_
    {
        self.client.get_stream(uri, session_id, last_event_id, auth_header, custom_headers)
    }

    fn get_stream_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        max_sse_event_size: usize,
    ) -> impl Future<Output = Result<BoxStream<'static, Result<Sse, SseError>>, StreamableHttpError<Self::Error>>> + Send + '_
    {
        self.client.get_stream_with_max_sse_event_size(
            uri,
            session_id,
            last_event_id,
            auth_header,
            custom_headers,
            max_sse_event_size,
        )
    }
}
