//! `[server]` and `[admin]`: the listeners, what they accept, and how long a client may take.

use std::net::SocketAddr;
use std::time::Duration;

use ipnet::IpNet;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::{ConfigError, ProxyTrust, invalid};
use crate::redact::Secret;

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
    /// The share (0 to 1) of `max_sessions` unverified callers of every address together may
    /// hold, so configured keys always find a session.
    pub unverified_session_share: f64,
    /// The share (above 0, at most 1) of `max_sessions` one configured key may hold.
    pub key_session_share: f64,
    /// The share (above 0, at most 1) of `max_sessions` the keys of one tenant may hold together.
    pub tenant_session_share: f64,
    /// The longest a client may take to send a request's headers; every connection must present
    /// a whole request within it of opening (or of its last answer).
    pub header_read_timeout: Duration,
    /// The longest a client may take to send a request's body, from its headers on.
    pub body_read_timeout: Duration,
    /// How many connections a listener holds, all together and per address.
    pub connections: ConnectionCaps,
    /// Requests (streams) one HTTP/2 connection may have under way at once; a stream beyond is
    /// refused (`REFUSED_STREAM`), and a client that heeds the limit waits for one to end.
    pub max_streams_per_connection: u32,
    /// SHA-256 of the bearer key `GET /metrics` requires; `None`: no key (open, unless
    /// `auth.required`). The key itself is not kept.
    pub metrics_key_sha256: Option<KeyDigest>,
}

impl ServerConfig {
    /// The sessions unverified callers of every address may hold together: `max_sessions` ×
    /// `unverified_session_share`, rounded down (a share never grants what it does not cover).
    pub fn unverified_sessions(&self) -> usize {
        share_of(self.max_sessions, self.unverified_session_share)
    }

    /// The sessions one configured key may hold: `max_sessions` × `key_session_share`, rounded
    /// down, at least one.
    pub fn sessions_per_key(&self) -> usize {
        share_of(self.max_sessions, self.key_session_share).max(1)
    }

    /// The sessions one tenant's keys may hold together: `max_sessions` × `tenant_session_share`,
    /// rounded down, at least one.
    pub fn sessions_per_tenant(&self) -> usize {
        share_of(self.max_sessions, self.tenant_session_share).max(1)
    }
}

/// `share` (0 to 1) of `whole`, rounded down.
fn share_of(whole: usize, share: f64) -> usize {
    if share >= 1.0 { whole } else { (whole as f64 * share.max(0.0)).floor() as usize }
}

/// How many connections a listener holds open (`server.max_connections`,
/// `server.max_connections_per_address`); a connection beyond either is refused as it is accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionCaps {
    /// Connections open at once, all peers together.
    pub max: usize,
    /// Connections open at once from one address (IPv6 grouped by `ipv6_prefix`).
    pub max_per_address: usize,
    /// The prefix length that groups IPv6 peers into one address.
    pub ipv6_prefix: u8,
    /// Peers never held to `max_per_address`: the trusted proxies when `server.trust_proxy` is
    /// on (every client behind one arrives from its address).
    pub exempt: Vec<IpNet>,
}

/// The SHA-256 of a key a listener requires: compared, never printed.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct KeyDigest(pub [u8; 32]);

impl std::fmt::Debug for KeyDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<set>")
    }
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

/// The shortest `server.metrics_key` accepted, as for the admin key.
const MIN_METRICS_KEY_CHARS: usize = 16;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServer {
    listen: SocketAddr,
    allowed_hosts: Vec<String>,
    allowed_origins: Vec<String>,
    max_body_bytes: usize,
    // The keys that name callers are the limits' to read and check (`ProxyTrust`).
    #[serde(rename = "trust_proxy")]
    _trust_proxy: serde::de::IgnoredAny,
    #[serde(rename = "trusted_proxies")]
    _trusted_proxies: serde::de::IgnoredAny,
    session_idle_timeout_seconds: u64,
    max_sessions: usize,
    max_sessions_per_address: usize,
    unverified_session_share: f64,
    key_session_share: f64,
    tenant_session_share: f64,
    header_read_timeout_ms: u64,
    body_read_timeout_ms: u64,
    max_connections: usize,
    max_connections_per_address: usize,
    max_streams_per_connection: u32,
    #[serde(rename = "ipv6_prefix")]
    _ipv6_prefix: serde::de::IgnoredAny,
    metrics_key: Secret,
    // When the server counts as behind is the limits' to read and check (`Shedding`).
    #[serde(rename = "shedding")]
    _shedding: serde::de::IgnoredAny,
}

impl RawServer {
    /// The section, checked: every key named in its error. The keys that name callers were read
    /// and checked by the limits (`proxies`).
    pub(super) fn validate(self, proxies: &ProxyTrust) -> Result<ServerConfig, ConfigError> {
        self.counts_are_valid()?;
        self.hosts_are_valid()?;
        let metrics_key_sha256 = self.metrics_key_digest()?;
        let connections = ConnectionCaps {
            max: self.max_connections,
            max_per_address: self.max_connections_per_address,
            ipv6_prefix: proxies.ipv6_prefix,
            exempt: if proxies.trust_proxy { proxies.trusted_proxies.clone() } else { Vec::new() },
        };
        let server = ServerConfig {
            listen: self.listen,
            allowed_hosts: self.allowed_hosts,
            allowed_origins: self.allowed_origins,
            max_body_bytes: self.max_body_bytes,
            session_idle_timeout: Duration::from_secs(self.session_idle_timeout_seconds),
            max_sessions: self.max_sessions,
            max_sessions_per_address: self.max_sessions_per_address,
            unverified_session_share: self.unverified_session_share,
            key_session_share: self.key_session_share,
            tenant_session_share: self.tenant_session_share,
            header_read_timeout: Duration::from_millis(self.header_read_timeout_ms),
            body_read_timeout: Duration::from_millis(self.body_read_timeout_ms),
            connections,
            max_streams_per_connection: self.max_streams_per_connection,
            metrics_key_sha256,
        };
        Ok(server)
    }

    /// The counts, shares and timeouts: each in its range.
    fn counts_are_valid(&self) -> Result<(), ConfigError> {
        if self.max_body_bytes == 0 {
            return Err(invalid("server.max_body_bytes", "must be at least 1"));
        }
        if self.max_sessions == 0 {
            return Err(invalid("server.max_sessions", "must be greater than zero"));
        }
        if self.max_sessions_per_address == 0 {
            return Err(invalid("server.max_sessions_per_address", "must be greater than zero"));
        }
        for (key, value) in [
            ("server.max_connections", self.max_connections),
            ("server.max_connections_per_address", self.max_connections_per_address),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be greater than zero"));
            }
        }
        if self.max_streams_per_connection == 0 {
            return Err(invalid("server.max_streams_per_connection", "an HTTP/2 connection needs at least 1 stream"));
        }
        if !(0.0..=1.0).contains(&self.unverified_session_share) {
            return Err(invalid(
                "server.unverified_session_share",
                format!("must be a fraction between 0.0 and 1.0 (got {})", self.unverified_session_share),
            ));
        }
        for (key, share) in [
            ("server.key_session_share", self.key_session_share),
            ("server.tenant_session_share", self.tenant_session_share),
        ] {
            if !(share > 0.0 && share <= 1.0) {
                return Err(invalid(key, format!("must be a fraction above 0.0, at most 1.0 (got {share})")));
            }
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
        Ok(())
    }

    /// The hosts and origins a request may name.
    fn hosts_are_valid(&self) -> Result<(), ConfigError> {
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
        Ok(())
    }

    /// The metrics key's digest (the key itself is never kept), or none for no key.
    fn metrics_key_digest(&self) -> Result<Option<KeyDigest>, ConfigError> {
        let metrics_key = self.metrics_key.expose().trim();
        if !metrics_key.is_empty() && metrics_key.chars().count() < MIN_METRICS_KEY_CHARS {
            return Err(invalid(
                "server.metrics_key",
                format!(
                    "is {} characters; a metrics key needs at least {MIN_METRICS_KEY_CHARS} (e.g. `openssl rand -hex \
                     32`), or leave it empty for no key",
                    metrics_key.chars().count()
                ),
            ));
        }
        Ok((!metrics_key.is_empty()).then(|| KeyDigest(Sha256::digest(metrics_key.as_bytes()).into())))
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
