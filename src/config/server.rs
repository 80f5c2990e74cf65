//! `[server]` and `[admin]`: the listeners, what they accept, and how long a client may take.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use ipnet::IpNet;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::{ConfigError, invalid};

/// `[server]`.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Listen address of `serve`.
    pub listen: SocketAddr,
    /// Accepted `Host` values on `/mcp` (and hosts an `Origin` may name).
    pub allowed_hosts: Vec<String>,
    /// Further accepted `Origin` values, exactly as browsers send them.
    pub allowed_origins: Vec<String>,
    /// Largest accepted body on `/mcp`.
    pub max_body_bytes: usize,
    /// An MCP session with no message for this long is closed and forgotten.
    pub session_idle_timeout: Duration,
    /// MCP sessions open at once; an `initialize` beyond them gets 503.
    pub max_sessions: usize,
    /// MCP sessions the unverified callers of one address may hold together; an `initialize`
    /// beyond them gets 429.
    pub max_sessions_per_address: usize,
    /// The longest a client may take to send a request's headers.
    pub header_read_timeout: Duration,
    /// The longest a client may take to send a request's body, from its headers on.
    pub body_read_timeout: Duration,
}

/// The part of `[server]` that names callers (`trust_proxy`, `trusted_proxies`): the limits read
/// it to tell one unverified caller from another, so it belongs to their configuration
/// ([`LimitsConfig`](super::LimitsConfig)), not to the listener's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProxyTrust {
    /// Whether `X-Forwarded-For` from a trusted proxy names the caller.
    pub trust_proxy: bool,
    /// Proxies whose `X-Forwarded-For` is believed.
    pub trusted_proxies: Vec<IpNet>,
}

/// `[admin]`: the operator's API, on a listener of its own.
#[derive(Clone)]
pub struct AdminConfig {
    /// Where the admin API listens.
    pub listen: SocketAddr,
    /// SHA-256 of the bearer key it requires; `None` (no key configured) leaves it off. The key
    /// itself is not kept.
    pub key_sha256: Option<[u8; 32]>,
}

impl std::fmt::Debug for AdminConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminConfig").field("listen", &self.listen).field("on", &self.key_sha256.is_some()).finish()
    }
}

/// The shortest admin key accepted: it guards every budget of every caller.
const MIN_ADMIN_KEY_CHARS: usize = 16;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServer {
    listen: SocketAddr,
    allowed_hosts: Vec<String>,
    allowed_origins: Vec<String>,
    max_body_bytes: usize,
    trust_proxy: bool,
    trusted_proxies: Vec<String>,
    session_idle_timeout_seconds: u64,
    max_sessions: usize,
    max_sessions_per_address: usize,
    header_read_timeout_ms: u64,
    body_read_timeout_ms: u64,
}

impl RawServer {
    /// The section, checked: every key named in its error. The listener's part, and the part that
    /// names callers.
    pub(super) fn validate(self) -> Result<(ServerConfig, ProxyTrust), ConfigError> {
        if self.max_body_bytes == 0 {
            return Err(invalid("server.max_body_bytes", "must be at least 1"));
        }
        if self.max_sessions == 0 {
            return Err(invalid("server.max_sessions", "must be greater than zero"));
        }
        if self.max_sessions_per_address == 0 {
            return Err(invalid("server.max_sessions_per_address", "must be greater than zero"));
        }
        // A day at most: longer would be a typo, and timers add these to the current instant.
        for (key, value, day) in [
            ("server.session_idle_timeout_seconds", self.session_idle_timeout_seconds, 86_400),
            ("server.header_read_timeout_ms", self.header_read_timeout_ms, 86_400_000),
            ("server.body_read_timeout_ms", self.body_read_timeout_ms, 86_400_000),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be greater than zero"));
            }
            if value > day {
                return Err(invalid(key, format!("{value} is more than a day ({day})")));
            }
        }
        if self.allowed_hosts.is_empty() {
            return Err(invalid("server.allowed_hosts", "list at least one host name (e.g. \"localhost\")"));
        }
        for (i, origin) in self.allowed_origins.iter().enumerate() {
            if reqwest::Url::parse(origin).map_or(true, |u| u.host_str().is_none()) {
                return Err(invalid(
                    format!("server.allowed_origins[{i}]"),
                    "must be an origin like https://app.example.com",
                ));
            }
        }
        let mut trusted_proxies = Vec::with_capacity(self.trusted_proxies.len());
        for (i, proxy) in self.trusted_proxies.iter().enumerate() {
            let net = proxy.parse::<IpNet>().or_else(|_| proxy.parse::<IpAddr>().map(IpNet::from)).map_err(|_| {
                invalid(format!("server.trusted_proxies[{i}]"), format!("`{proxy}` is not an IP or CIDR"))
            })?;
            trusted_proxies.push(net);
        }
        let server = ServerConfig {
            listen: self.listen,
            allowed_hosts: self.allowed_hosts,
            allowed_origins: self.allowed_origins,
            max_body_bytes: self.max_body_bytes,
            session_idle_timeout: Duration::from_secs(self.session_idle_timeout_seconds),
            max_sessions: self.max_sessions,
            max_sessions_per_address: self.max_sessions_per_address,
            header_read_timeout: Duration::from_millis(self.header_read_timeout_ms),
            body_read_timeout: Duration::from_millis(self.body_read_timeout_ms),
        };
        Ok((server, ProxyTrust { trust_proxy: self.trust_proxy, trusted_proxies }))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAdmin {
    listen: SocketAddr,
    key: String,
}

impl std::fmt::Debug for RawAdmin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawAdmin").field("listen", &self.listen).finish_non_exhaustive()
    }
}

impl RawAdmin {
    pub(super) fn validate(self) -> Result<AdminConfig, ConfigError> {
        let key = self.key.trim();
        if !key.is_empty() && key.chars().count() < MIN_ADMIN_KEY_CHARS {
            return Err(invalid(
                "admin.key",
                format!(
                    "is {} characters; an admin key needs at least {MIN_ADMIN_KEY_CHARS} (e.g. `openssl rand -hex 32`), \
                     or leave it empty to keep the admin API off",
                    key.chars().count()
                ),
            ));
        }
        let key_sha256 = (!key.is_empty()).then(|| Sha256::digest(key.as_bytes()).into());
        Ok(AdminConfig { listen: self.listen, key_sha256 })
    }
}
