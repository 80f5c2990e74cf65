//! `[proxy]`: the MCP server `mcp-ratelimit proxy` stands in front of — where it is (a URL, or a
//! command to start as a stdio child), the headers to send it, the environment a child gets, what
//! its tools cost when `[tools.NAME]` does not say, and how hard it may be called.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::upstream::AdaptiveConfig;
use super::{ConfigError, invalid};

/// `[proxy]`.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProxyConfig {
    /// The proxied server's streamable HTTP endpoint (empty: `command` instead).
    pub upstream_url: String,
    /// The proxied server as a command and its arguments, started as a stdio child (empty:
    /// `upstream_url` instead).
    pub command: Vec<String>,
    /// Headers sent with every request to `upstream_url` (its own API key, say). Their values
    /// never reach a log line or a `Debug` string.
    pub headers: BTreeMap<String, String>,
    /// Variables set in a `command` child's environment, besides the few it always gets
    /// ([`crate::proxy::link::ALWAYS_PASSED`]); values may be credentials: never logged, never in
    /// a `Debug` string.
    pub env: BTreeMap<String, String>,
    /// Names of the proxy's own environment variables a `command` child also gets (its API key,
    /// say, set where the proxy starts).
    pub inherit_env: Vec<String>,
    /// The cost of a tool that `[tools.NAME]` does not price.
    pub default_cost: u64,
    /// Calls in flight to the proxied server at once, for every caller together; more wait in
    /// the fair queue (`upstream.queue_max` places).
    pub max_in_flight: usize,
    /// How long the proxied server has to answer a call once it is sent, before the call is
    /// answered `upstream_unavailable`; also the longest a call waits for its turn (then it is
    /// refused `busy`, never sent).
    pub timeout_ms: u64,
    /// The calls in flight learnt from its answers (`[proxy.adaptive]`), under `max_in_flight`.
    pub adaptive: AdaptiveConfig,
    /// The protocol version the proxy's own client speaks to the proxied server.
    pub upstream_protocol: UpstreamProtocol,
    /// Whose calls share one session to the proxied server (one child, for a command).
    pub upstream_sessions: UpstreamSessions,
    /// The most sessions to the proxied server (children, for a command) open at once for
    /// `tenant` or `session` scopes, besides the first one the proxy keeps.
    pub max_children: usize,
    /// A scope's session to the proxied server with no call and no downstream session for this
    /// long is closed (its child stopped).
    pub upstream_idle_seconds: u64,
    /// 2026-07-28 subscriptions (`subscriptions/listen`) one configured caller may hold open at
    /// once.
    pub max_subscriptions_per_caller: usize,
    /// Subscriptions the unverified callers of one address (no key, or made-up keys) may hold
    /// open together.
    pub max_subscriptions_per_address: usize,
}

/// `proxy.upstream_sessions`: which callers share one session to the proxied server (one child
/// process, for a command) — and with it whatever state the server keeps in a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UpstreamSessions {
    /// Every caller shares one session.
    Shared,
    /// The callers of one tenant share one (an unverified caller: those of its address).
    Tenant,
    /// Each downstream session has its own (a 2026-07-28 caller, which has none: each caller).
    Session,
}

/// `proxy.upstream_protocol`: which MCP version the proxy's own client speaks to the proxied
/// server, whatever its callers speak (each answer is made valid for its caller's version).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum UpstreamProtocol {
    /// Ask for 2026-07-28 (`server/discover`), and fall back to the 2025-11-25 handshake where
    /// the server does not know it.
    #[serde(rename = "auto")]
    Auto,
    /// The 2025-11-25 `initialize` handshake, and one session.
    #[serde(rename = "2025-11-25")]
    V2025_11_25,
    /// 2026-07-28 only: a server that does not speak it is a start-up error.
    #[serde(rename = "2026-07-28")]
    V2026_07_28,
}

impl std::fmt::Debug for ProxyConfig {
    /// The headers by name only (their values are credentials), the URL without its password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyConfig")
            .field("upstream_url", &crate::redact::url(&self.upstream_url))
            .field("command", &self.command.first())
            .field("headers", &self.headers.keys().collect::<Vec<_>>())
            .field("env", &self.env.keys().collect::<Vec<_>>())
            .field("inherit_env", &self.inherit_env)
            .field("default_cost", &self.default_cost)
            .field("max_in_flight", &self.max_in_flight)
            .field("timeout_ms", &self.timeout_ms)
            .field("adaptive", &self.adaptive)
            .field("upstream_protocol", &self.upstream_protocol)
            .field("upstream_sessions", &self.upstream_sessions)
            .field("max_children", &self.max_children)
            .field("upstream_idle_seconds", &self.upstream_idle_seconds)
            .field("max_subscriptions_per_caller", &self.max_subscriptions_per_caller)
            .field("max_subscriptions_per_address", &self.max_subscriptions_per_address)
            .finish()
    }
}

/// Why `url` cannot name a proxied server (it is reached over streamable HTTP), if it cannot:
/// for `proxy.upstream_url` and `--upstream` alike.
pub fn check_upstream_url(url: &str) -> Result<(), String> {
    let parsed = reqwest::Url::parse(url).map_err(|e| format!("not a URL: {e}"))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err("the proxied server is reached over http or https".to_owned());
    }
    Ok(())
}

/// The prefix of the proxy's own configuration variables (`MCP_RL__ADMIN__KEY`, …), which hold
/// its secrets: no child ever gets one.
pub const OWN_PREFIX: &str = "MCP_RL__";

/// Whether a variable named `name` is one of the proxy's own (its case ignored: a name that
/// differs only in case is as telling).
pub fn is_own_variable(name: &str) -> bool {
    name.get(..OWN_PREFIX.len()).is_some_and(|head| head.eq_ignore_ascii_case(OWN_PREFIX))
}

/// Why `name` cannot name a variable of a child's environment, if it cannot.
fn check_env_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.contains(['=', '\0']) {
        return Err("not a variable name (empty, or holding `=` or a NUL character)".to_owned());
    }
    if is_own_variable(name) {
        return Err(format!(
            "`{OWN_PREFIX}` variables configure the proxy and hold its secrets (its admin key, Redis password, \
             headers); no child gets one. Give the child its own variable"
        ));
    }
    Ok(())
}

impl ProxyConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if !self.upstream_url.is_empty() {
            check_upstream_url(&self.upstream_url).map_err(|why| invalid("proxy.upstream_url", why))?;
        }
        if !self.upstream_url.is_empty() && !self.command.is_empty() {
            return Err(invalid("proxy.command", "give `proxy.upstream_url` or `proxy.command`, not both"));
        }
        if self.command.first().is_some_and(|program| program.trim().is_empty()) {
            return Err(invalid("proxy.command", "the first element is the program to start; it is empty"));
        }
        for (name, value) in &self.headers {
            let key = format!("proxy.headers.{name}");
            http::HeaderName::try_from(name.as_str()).map_err(|_| invalid(&key, "not a valid header name"))?;
            http::HeaderValue::try_from(value.as_str())
                .map_err(|_| invalid(&key, "not a valid header value (no line breaks or control characters)"))?;
            if matches!(name.to_ascii_lowercase().as_str(), "accept" | "mcp-session-id" | "last-event-id" | "host") {
                return Err(invalid(&key, "this header belongs to the MCP transport and cannot be set"));
            }
        }
        for name in self.env.keys() {
            check_env_name(name).map_err(|why| invalid(format!("proxy.env.{name}"), why))?;
        }
        for (name, value) in &self.env {
            if value.contains('\0') {
                return Err(invalid(format!("proxy.env.{name}"), "a variable's value cannot hold a NUL character"));
            }
        }
        for (i, name) in self.inherit_env.iter().enumerate() {
            check_env_name(name).map_err(|why| invalid(format!("proxy.inherit_env[{i}]"), why))?;
        }
        if self.max_in_flight == 0 {
            return Err(invalid("proxy.max_in_flight", "at least one call must be able to reach the proxied server"));
        }
        self.adaptive.validate("proxy.adaptive", self.max_in_flight)?;
        if self.timeout_ms == 0 {
            return Err(invalid("proxy.timeout_ms", "a call needs some time to be answered (at least 1)"));
        }
        if self.max_children == 0 {
            return Err(invalid("proxy.max_children", "at least one scope must be able to reach the proxied server"));
        }
        if !(1..=86_400).contains(&self.upstream_idle_seconds) {
            return Err(invalid("proxy.upstream_idle_seconds", "from 1 second to a day (86400)"));
        }
        for (key, max) in [
            ("proxy.max_subscriptions_per_caller", self.max_subscriptions_per_caller),
            ("proxy.max_subscriptions_per_address", self.max_subscriptions_per_address),
        ] {
            if max == 0 {
                return Err(invalid(key, "at least one subscription must be able to open"));
            }
        }
        Ok(())
    }
}
