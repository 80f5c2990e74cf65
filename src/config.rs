//! Typed configuration: defaults, layering and validation.
//!
//! Layers, last wins: the documented defaults (`config.toml` at the repository root, compiled
//! in), then the user's file, then `MCP_RL__SECTION__KEY` environment variables. Whatever the
//! layers say is validated before the server starts; every error names the key to fix.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use ipnet::IpNet;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::limit::{ALGORITHMS, Concurrency, FixedWindow, Limiter, Params};
use crate::redact::Secret;

/// The documented defaults, the base layer under every config.
pub const DEFAULT_TOML: &str = include_str!("../config.toml");

/// The tools a server offers, as its limits must know them: each tool's name, and whether a call
/// of it holds in-flight slots for as long as its admission lives (a job, until it is final).
///
/// The limits know no tools of their own: a server builds its catalogue from its tool router at
/// start-up and passes it down, and a config is checked against it (`[tools.NAME]` must name a
/// tool, and every tool needs a cost).
///
/// ```
/// use mcp_ratelimit::config::Catalogue;
///
/// let tools = Catalogue::new().tool("search").job("render_video");
/// assert!(tools.contains("search") && !tools.holds_slots("search"));
/// assert!(tools.holds_slots("render_video"));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Catalogue {
    /// Tool name → whether its calls hold in-flight slots.
    tools: BTreeMap<String, bool>,
}

impl Catalogue {
    /// An empty catalogue.
    pub fn new() -> Self {
        Self::default()
    }

    /// With a tool that answers and is done: its admission is released when the call returns.
    pub fn tool(mut self, name: impl Into<String>) -> Self {
        self.tools.insert(name.into(), false);
        self
    }

    /// With a tool whose calls hold one slot of the caller's and the tenant's in-flight caps
    /// (`limits.in_flight`) for as long as their admission lives.
    pub fn job(mut self, name: impl Into<String>) -> Self {
        self.tools.insert(name.into(), true);
        self
    }

    /// The tools' names, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tools.keys().map(String::as_str)
    }

    /// Whether `name` is one of the tools.
    pub fn contains(&self, name: &str) -> bool {
        self.tools.contains_key(name)
    }

    /// Whether calls of `name` hold in-flight slots.
    pub fn holds_slots(&self, name: &str) -> bool {
        self.tools.get(name).copied().unwrap_or(false)
    }

    fn listed(&self) -> String {
        if self.tools.is_empty() {
            return "none".to_owned();
        }
        self.names().collect::<Vec<_>>().join(", ")
    }
}

/// A config that cannot be used, with the key at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A file could not be read or a value has the wrong type (the message names the key).
    #[error("cannot load config: {0}")]
    Load(#[from] config::ConfigError),
    /// A value is well-typed but not acceptable.
    #[error("invalid config: `{key}`: {message}")]
    Invalid {
        /// The dotted key, e.g. `limits.caller.burst`.
        key: String,
        /// What is wrong and what would be right.
        message: String,
    },
}

fn invalid(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { key: key.into(), message: message.into() }
}

/// The validated configuration the server runs on.
#[derive(Debug, Clone)]
pub struct Config {
    /// The HTTP transport.
    pub server: ServerConfig,
    /// API keys, tenants and whether a key is required.
    pub auth: AuthConfig,
    /// Tier name → factor applied to the per-caller budgets (`http`, `method`, `caller`).
    pub tiers: BTreeMap<String, f64>,
    /// The budgets of every scope, unscaled.
    pub limits: Limits,
    /// Daily spend caps per tenant.
    pub spend_caps: SpendCaps,
    /// Per-tenant budgets and caps instead of the defaults.
    pub tenants: BTreeMap<String, TenantOverride>,
    /// Each tool's cost and optional own budget; every tool has an entry.
    pub tools: BTreeMap<String, ToolPolicy>,
    /// The paid API behind the tools.
    pub upstream: UpstreamConfig,
    /// State housekeeping.
    pub store: StoreConfig,
    /// Stuck agents repeating the same call.
    pub loop_detection: LoopDetectionConfig,
    /// The mock paid API's knobs.
    pub mock_upstream: MockUpstreamConfig,
    /// The admin API's listener and key.
    pub admin: AdminConfig,
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

/// The shortest `auth.id_secret` accepted: a short one could itself be found by trying.
const MIN_ID_SECRET_CHARS: usize = 16;

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
    /// Whether `X-Forwarded-For` from a trusted proxy names the caller.
    pub trust_proxy: bool,
    /// Proxies whose `X-Forwarded-For` is believed.
    pub trusted_proxies: Vec<IpNet>,
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

/// `[auth]`.
#[derive(Debug, Clone)]
pub struct AuthConfig {
    /// Refuse requests without a configured key (401).
    pub required: bool,
    /// Tier of callers without a configured key (when not required).
    pub anonymous_tier: String,
    /// The configured keys.
    pub keys: Vec<ApiKey>,
    /// `auth.id_secret`, which keys caller ids (see [`CallerIds`](crate::identity::CallerIds));
    /// `None`: unkeyed ids.
    pub id_secret: Option<Secret>,
}

/// A configured API key: its SHA-256, and the tenant and tier it belongs to.
#[derive(Clone)]
pub struct ApiKey {
    /// SHA-256 of the key; the key itself is not kept.
    pub sha256: [u8; 32],
    /// Tenant whose shared budget the key draws on, if any.
    pub tenant: Option<String>,
    /// Tier that scales the key's own budgets.
    pub tier: String,
    /// The key's own caller budget, instead of its tier's (not scaled by the tier).
    pub caller: Option<Vec<Limit>>,
}

impl std::fmt::Debug for ApiKey {
    /// Everything but the digest: of a short plaintext key, it would give the key away.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self { sha256: _, tenant, tier, caller } = self;
        f.debug_struct("ApiKey").field("tenant", tenant).field("tier", tier).field("caller", caller).finish()
    }
}

/// Whether a limit refuses, or only counts the calls it would have refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Refuses what is over the limit.
    Enforce,
    /// Lets everything through, but logs and counts (`outcome="shadow_refused"`) what it would
    /// have refused: to try a new limit on real traffic first.
    Shadow,
}

/// One limit of a scope. A scope may have several (a burst bucket plus a daily window), all
/// decided in the same atomic decision.
#[derive(Debug, Clone)]
pub struct Limit {
    /// The algorithm and its parameters.
    pub limiter: Limiter,
    /// Enforced, or shadow.
    pub mode: Mode,
    /// Tool results carry a warning once this percentage of the limit is used (`None`: never).
    pub warn_at_percent: Option<u8>,
    /// Empty for a scope's first limit; `#name` for the others, appended to the scope's store key
    /// and name so each keeps its own state. Derived from the limit's `name` (or its algorithm),
    /// not its position in a changed list, so a reload keeps the counters of the limits it keeps.
    pub suffix: String,
}

impl Limit {
    /// An enforced limit with no warning, as a scope's first.
    pub fn enforced(limiter: Limiter) -> Self {
        Self { limiter, mode: Mode::Enforce, warn_at_percent: None, suffix: String::new() }
    }

    /// This limit with capacity and rate multiplied by `factor` (tiers, the insurance limiter).
    pub fn scaled(&self, factor: f64) -> Self {
        Self { limiter: self.limiter.scaled(factor), ..self.clone() }
    }

    /// Whether it refuses (not shadow).
    pub fn enforced_mode(&self) -> bool {
        self.mode == Mode::Enforce
    }
}

/// Windows at least this long warn at 80 % used unless told otherwise: short windows refill
/// before a warning could help an agent plan.
const WARN_BY_DEFAULT_FROM: u64 = 3_600 * 1_000_000_000;

/// The daily spend cap of a tenant (or of a caller without one), in cost units.
#[derive(Debug, Clone)]
pub struct SpendCaps {
    /// The cap of every tenant without its own (`None`: no cap).
    pub daily_units: Option<u64>,
    /// Price of one cost unit, to show caps in money (0: units only).
    pub price_per_unit: f64,
    /// The currency of that price.
    pub currency: String,
    /// Percentage of a cap used at which tool results carry a warning.
    pub warn_at_percent: u8,
}

/// `[tenants.NAME]`: what one tenant has instead of the defaults.
#[derive(Debug, Clone, Default)]
pub struct TenantOverride {
    /// The tenant's shared budget instead of `limits.tenant`.
    pub budget: Option<Vec<Limit>>,
    /// Its daily spend cap instead of `spend_caps.daily_units`.
    pub daily_spend_units: Option<u64>,
}

/// The budgets of every scope a request passes, outside in. Every scope but the in-flight caps
/// has one or more limits.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Master switch; `false` admits everything (for overhead measurements only).
    pub enabled: bool,
    /// The coarse per-caller limit on `POST /mcp`, before any JSON is parsed.
    pub http: Vec<Limit>,
    /// The coarse limit on `POST /mcp` that all unverified callers of one address share, beside
    /// each one's own `http`.
    pub address_http: Vec<Limit>,
    /// Per caller and JSON-RPC method: `tools/list`.
    pub tools_list: Vec<Limit>,
    /// Per caller and JSON-RPC method: `tools/call`.
    pub tools_call: Vec<Limit>,
    /// Per caller and JSON-RPC method: everything else (`ping`, …) but session set-up.
    pub other_methods: Vec<Limit>,
    /// The caller's tool budget, charged each tool's cost.
    pub caller: Vec<Limit>,
    /// The budget all callers of one tenant share, charged each tool's cost.
    pub tenant: Vec<Limit>,
    /// The budget all unverified callers (no configured key) from one address share, charged
    /// each tool's cost: made-up keys cannot buy budget.
    pub address: Vec<Limit>,
    /// Jobs (image and video predictions) one caller may have in flight at once.
    pub in_flight_caller: Limiter,
    /// Jobs all callers of one tenant may have in flight at once (a caller without a tenant is
    /// its own tenant, so this scope is its caller scope).
    pub in_flight_tenant: Limiter,
    /// Jobs all unverified callers of one address may have in flight at once.
    pub in_flight_address: Limiter,
}

/// `[tools.NAME]`.
#[derive(Debug, Clone)]
pub struct ToolPolicy {
    /// Units charged to the caller and tenant budgets per call.
    pub cost: u64,
    /// An own budget for this tool, per tenant (or per caller without one), counted in calls
    /// (empty: none).
    pub budget: Vec<Limit>,
    /// What the tool does while the shared limiter store cannot decide.
    pub fail: Fail,
}

/// Where limiter state lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// In this process: one instance, nothing to set up.
    Memory,
    /// In Redis, shared by every instance.
    Redis,
}

/// What a tool does while the shared limiter store (Redis) cannot decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fail {
    /// Decide with the in-memory insurance limiter (per-instance limits ÷ expected instances).
    Open,
    /// Refuse with `limiter_unavailable` and a wait.
    Closed,
}

/// `[upstream]`.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    /// Base URL; empty means "start the embedded mock".
    pub url: String,
    /// Per-request timeout.
    pub timeout_ms: u64,
    /// Poll hint for image jobs.
    pub image_poll_seconds: u64,
    /// Poll hint for video jobs.
    pub video_poll_seconds: u64,
    /// Predictions the upstream account runs at once, for every caller together.
    pub max_in_flight: usize,
    /// Jobs that may wait for an account slot (or their video gap), all callers together.
    pub queue_max: usize,
    /// Least time between two video submissions to the upstream, across all callers.
    pub video_min_gap_ms: u64,
    /// Video jobs that may wait in the queue.
    pub video_queue_max: usize,
    /// Attempts of one server-owned upstream request (a queued submission, a background poll).
    pub max_attempts: u32,
    /// A Retry-After longer than this fails the job instead of parking it.
    pub max_retry_after_ms: u64,
    /// A job still pending this long after it was accepted is failed and its slot freed.
    pub job_expiry_seconds: u64,
    /// Consecutive upstream failures that open the circuit breaker.
    pub breaker_failures: u32,
    /// How long the breaker stays open before one probe may try.
    pub breaker_cooldown_ms: u64,
    /// Server-owned retries allowed, as a share of recent first attempts.
    pub retry_budget_ratio: f64,
    /// Retries allowed per window whatever the traffic, so a quiet server can still retry.
    pub retry_budget_min_retries: u32,
    /// The window the retry budget counts over.
    pub retry_budget_window_ms: u64,
    /// The share (0 to 1) of the account's slots (`max_in_flight`) and of the queue
    /// (`queue_max`) that unverified callers of every address together may hold, so configured
    /// tenants always find room.
    pub unverified_share: f64,
}

impl UpstreamConfig {
    /// The account's slots unverified callers may hold together: `max_in_flight` ×
    /// `unverified_share`, rounded down.
    pub fn unverified_slots(&self) -> usize {
        share_of(self.max_in_flight, self.unverified_share)
    }

    /// The queue places unverified callers may hold together: `queue_max` × `unverified_share`,
    /// rounded down.
    pub fn unverified_places(&self) -> usize {
        share_of(self.queue_max, self.unverified_share)
    }
}

/// `share` (0 to 1) of `whole`, rounded down: a share never grants what it does not cover.
fn share_of(whole: usize, share: f64) -> usize {
    if share >= 1.0 { whole } else { (whole as f64 * share.max(0.0)).floor() as usize }
}

impl std::fmt::Debug for UpstreamConfig {
    /// The URL without its password (`https://user:token@…` is how some APIs take a key); a new
    /// field shows once it is listed here.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamConfig")
            .field("url", &crate::redact::url(&self.url))
            .field("timeout_ms", &self.timeout_ms)
            .field("image_poll_seconds", &self.image_poll_seconds)
            .field("video_poll_seconds", &self.video_poll_seconds)
            .field("max_in_flight", &self.max_in_flight)
            .field("queue_max", &self.queue_max)
            .field("video_min_gap_ms", &self.video_min_gap_ms)
            .field("video_queue_max", &self.video_queue_max)
            .field("max_attempts", &self.max_attempts)
            .field("max_retry_after_ms", &self.max_retry_after_ms)
            .field("job_expiry_seconds", &self.job_expiry_seconds)
            .field("breaker_failures", &self.breaker_failures)
            .field("breaker_cooldown_ms", &self.breaker_cooldown_ms)
            .field("retry_budget_ratio", &self.retry_budget_ratio)
            .field("retry_budget_min_retries", &self.retry_budget_min_retries)
            .field("retry_budget_window_ms", &self.retry_budget_window_ms)
            .finish()
    }
}

/// `[loop_detection]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoopDetectionConfig {
    /// Whether identical repeated calls are refused.
    pub enabled: bool,
    /// Identical calls in a row (or occurrences in an A/B/A/B oscillation) that make a loop.
    pub repeats: u32,
    /// The window those calls must fall in, and how long a detected loop is stopped for.
    pub window_ms: u64,
}

/// `[store]`.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    /// Where limiter state lives.
    pub backend: Backend,
    /// The Redis to share state in, when `backend = "redis"`.
    pub redis_url: String,
    /// A PEM file of the CA to verify a TLS Redis (`rediss://`) against instead of the system's
    /// trust store; empty for the system's.
    pub redis_ca_file: String,
    /// The longest a request waits on the store before it counts as down.
    pub timeout_ms: u64,
    /// How long in-flight slots held in a shared store last unless renewed: what a crashed
    /// instance's slots are lost for.
    pub lease_ms: u64,
    /// Interval between sweeps of idle state.
    pub sweep_interval_ms: u64,
    /// Server instances expected to share the store: the insurance limiter gives each
    /// 1/`expected_instances` of every limit while the store cannot decide.
    pub expected_instances: u32,
}

impl std::fmt::Debug for StoreConfig {
    /// The Redis URL without its password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self { backend, redis_url, redis_ca_file, timeout_ms, lease_ms, sweep_interval_ms, expected_instances } =
            self;
        f.debug_struct("StoreConfig")
            .field("backend", backend)
            .field("redis_url", &crate::redact::url(redis_url))
            .field("redis_ca_file", redis_ca_file)
            .field("timeout_ms", timeout_ms)
            .field("lease_ms", lease_ms)
            .field("sweep_interval_ms", sweep_interval_ms)
            .field("expected_instances", expected_instances)
            .finish()
    }
}

impl StoreConfig {
    /// The certificates of `redis_ca_file` (PEM), or `None` to trust the system's store.
    pub fn redis_ca(&self) -> Result<Option<Vec<u8>>, String> {
        if self.redis_ca_file.is_empty() {
            return Ok(None);
        }
        let pem =
            std::fs::read(&self.redis_ca_file).map_err(|e| format!("cannot read `{}`: {e}", self.redis_ca_file))?;
        if !pem.windows(27).any(|w| w == b"-----BEGIN CERTIFICATE-----") {
            return Err(format!("`{}` holds no PEM certificate (-----BEGIN CERTIFICATE-----)", self.redis_ca_file));
        }
        Ok(Some(pem))
    }
}

/// `[mock_upstream]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MockUpstreamConfig {
    /// Listen address of the `mock-upstream` command.
    pub listen: SocketAddr,
    /// Latency added to every response.
    pub latency_ms: u64,
    /// Fraction of requests answered 429.
    pub rate_429: f64,
    /// Retry-After of those 429s.
    pub retry_after_seconds: u64,
    /// Fraction of requests answered 503.
    pub rate_5xx: f64,
    /// Concurrent predictions before 429.
    pub max_concurrent_predictions: usize,
    /// Duration of an image job.
    pub image_job_ms: u64,
    /// Duration of a video job.
    pub video_job_ms: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    server: RawServer,
    auth: RawAuth,
    tiers: BTreeMap<String, f64>,
    limits: RawLimits,
    spend_caps: RawSpendCaps,
    #[serde(default)]
    tenants: BTreeMap<String, RawTenant>,
    #[serde(default)]
    tools: BTreeMap<String, RawTool>,
    upstream: UpstreamConfig,
    store: StoreConfig,
    loop_detection: LoopDetectionConfig,
    mock_upstream: MockUpstreamConfig,
    admin: RawAdmin,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAdmin {
    listen: SocketAddr,
    key: String,
}

impl std::fmt::Debug for RawAdmin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawAdmin").field("listen", &self.listen).finish_non_exhaustive()
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServer {
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

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawAuth {
    required: bool,
    anonymous_tier: String,
    id_secret: String,
    #[serde(default)]
    keys: Vec<RawKey>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawKey {
    key: Option<String>,
    sha256: Option<String>,
    tenant: Option<String>,
    tier: Option<String>,
    caller: Option<RawScope>,
}

impl std::fmt::Debug for RawAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self { required, anonymous_tier, id_secret, keys } = self;
        f.debug_struct("RawAuth")
            .field("required", required)
            .field("anonymous_tier", anonymous_tier)
            .field("id_secret", &if id_secret.trim().is_empty() { "" } else { "<redacted>" })
            .field("keys", keys)
            .finish()
    }
}

impl std::fmt::Debug for RawKey {
    /// Whether the key is given as plaintext or as a digest, never either.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self { key, sha256, tenant, tier, caller } = self;
        f.debug_struct("RawKey")
            .field("key", &key.as_ref().map(|_| "<redacted>"))
            .field("sha256", &sha256.as_ref().map(|_| "<redacted>"))
            .field("tenant", tenant)
            .field("tier", tier)
            .field("caller", caller)
            .finish()
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSpendCaps {
    daily_units: i64,
    daily_money: f64,
    price_per_unit: f64,
    currency: String,
    warn_at_percent: i64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTenant {
    budget: Option<RawScope>,
    daily_spend_units: Option<i64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLimits {
    enabled: bool,
    http: RawScope,
    address_http: RawScope,
    method: BTreeMap<String, RawScope>,
    caller: RawScope,
    tenant: RawScope,
    address: RawScope,
    in_flight: RawInFlight,
}

/// A scope's limits as written: one table (today's form), or a list of tables.
#[derive(Debug)]
enum RawScope {
    One(RawLimit),
    Many(Vec<RawLimit>),
}

impl<'de> Deserialize<'de> for RawScope {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = RawScope;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a limit (a table with `algorithm`) or a list of limits")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<RawScope, A::Error> {
                RawLimit::deserialize(serde::de::value::MapAccessDeserializer::new(map)).map(RawScope::One)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, seq: A) -> Result<RawScope, A::Error> {
                Vec::<RawLimit>::deserialize(serde::de::value::SeqAccessDeserializer::new(seq)).map(RawScope::Many)
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawInFlight {
    caller: i64,
    tenant: i64,
    address: i64,
}

/// One scope's limiter as written in config: the algorithm and the union of all parameters.
/// Parameters another algorithm would use are ignored (the defaults layer always has some); a
/// parameter no algorithm takes is a typo, refused naming it. Each algorithm reads its own
/// ([`Algorithm::from_params`](crate::limit::Algorithm::from_params)).
#[derive(Debug, Deserialize)]
struct RawLimit {
    algorithm: String,
    mode: Option<Mode>,
    name: Option<String>,
    warn_at_percent: Option<i64>,
    #[serde(flatten)]
    params: BTreeMap<String, crate::limit::params::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTool {
    cost: i64,
    budget: Option<RawScope>,
    fail: Option<Fail>,
}

/// The JSON-RPC method groups with their own per-caller limit.
pub const METHOD_GROUPS: [&str; 3] = ["tools_list", "tools_call", "other"];

impl Config {
    /// Loads defaults, then `file` (required when given, else `./config.toml` if present),
    /// then the environment, and validates the result against the server's `tools`.
    pub fn load(file: Option<&Path>, tools: &Catalogue) -> Result<Self, ConfigError> {
        let env = config::Environment::with_prefix("MCP_RL")
            .prefix_separator("__")
            .separator("__")
            .try_parsing(true)
            .list_separator(",")
            .with_list_parse_key("server.allowed_hosts")
            .with_list_parse_key("server.allowed_origins")
            .with_list_parse_key("server.trusted_proxies");
        Self::load_layers(file, Some(env), tools)
    }

    /// The defaults plus `toml`, without the environment (for tests and embedding), checked
    /// against the server's `tools`.
    ///
    /// ```
    /// use mcp_ratelimit::config::{Catalogue, Config};
    ///
    /// let tools = Catalogue::new().tool("search");
    /// let config = Config::from_toml("[tools.search]\ncost = 2\n", &tools)?;
    /// assert_eq!(config.tools["search"].cost, 2);
    /// // A tool the server does not have is a mistake, named with the key to fix.
    /// let typo = Config::from_toml("[tools.serach]\ncost = 2\n", &tools).unwrap_err();
    /// assert!(typo.to_string().contains("tools.serach"));
    /// # Ok::<(), mcp_ratelimit::config::ConfigError>(())
    /// ```
    pub fn from_toml(toml: &str, tools: &Catalogue) -> Result<Self, ConfigError> {
        integer_too_large(toml)?;
        Self::defaults_for(tools)?
            .add_source(config::File::from_str(toml, config::FileFormat::Toml))
            .build()?
            .try_deserialize::<RawConfig>()?
            .validate(tools)
    }

    /// The documented defaults alone.
    pub fn defaults(tools: &Catalogue) -> Result<Self, ConfigError> {
        Self::from_toml("", tools)
    }

    /// The documented defaults as the base layer, keeping only the `[tools]` entries of `tools`:
    /// the defaults price the reference server's tools, which another server does not have.
    fn defaults_for(tools: &Catalogue) -> Result<config::ConfigBuilder<config::builder::DefaultState>, ConfigError> {
        let defaults = config::Config::builder()
            .add_source(config::File::from_str(DEFAULT_TOML, config::FileFormat::Toml))
            .build()?
            .try_deserialize::<config::Map<String, config::Value>>()?;
        let mut builder = config::Config::builder();
        for (section, mut value) in defaults {
            if section == "tools" {
                let mut priced = value.into_table()?;
                priced.retain(|name, _| tools.contains(name));
                value = config::Value::from(priced);
            }
            builder = builder.set_default(section, value)?;
        }
        Ok(builder)
    }

    fn load_layers(
        file: Option<&Path>,
        env: Option<config::Environment>,
        tools: &Catalogue,
    ) -> Result<Self, ConfigError> {
        let path = file.unwrap_or(Path::new("config.toml"));
        if let Ok(text) = std::fs::read_to_string(path) {
            integer_too_large(&text)?;
        }
        let mut builder = Self::defaults_for(tools)?;
        builder = match file {
            Some(path) => builder.add_source(config::File::from(path).format(config::FileFormat::Toml).required(true)),
            None => builder.add_source(
                config::File::from(Path::new("config.toml")).format(config::FileFormat::Toml).required(false),
            ),
        };
        if let Some(env) = env {
            builder = builder.add_source(env);
        }
        builder.build()?.try_deserialize::<RawConfig>()?.validate(tools)
    }

    /// The effective limits as a table for `check-config`.
    pub fn limits_table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "{:<34} {:<15} parameters", "scope", "algorithm");
        let limits = &self.limits;
        let in_flight = [
            Limit::enforced(limits.in_flight_caller.clone()),
            Limit::enforced(limits.in_flight_tenant.clone()),
            Limit::enforced(limits.in_flight_address.clone()),
        ];
        for (scope, list) in [
            ("http (per caller, POST /mcp)", limits.http.as_slice()),
            ("address_http (unverified, POST)", &limits.address_http),
            ("method tools/list (per caller)", &limits.tools_list),
            ("method tools/call (per caller)", &limits.tools_call),
            ("method other (per caller)", &limits.other_methods),
            ("caller (tool budget)", &limits.caller),
            ("tenant (shared tool budget)", &limits.tenant),
            ("address (unverified callers)", &limits.address),
            ("in flight (jobs per caller)", &in_flight[..1]),
            ("in flight (jobs per tenant)", &in_flight[1..2]),
            ("in flight (jobs per address)", &in_flight[2..]),
        ] {
            for limit in list {
                let shadow = if limit.enforced_mode() { "" } else { " (shadow)" };
                let scope = format!("{scope}{}", limit.suffix);
                let _ =
                    writeln!(out, "{scope:<34} {:<15} {}{shadow}", limit.limiter.algorithm(), limit.limiter.describe());
            }
        }
        if let Some(cap) = self.spend_caps.daily_units {
            let _ =
                writeln!(out, "{:<34} {:<15} {cap} cost units per UTC day", "spend cap (per tenant)", "fixed_window");
        }
        let _ = writeln!(out);
        let tiers: Vec<String> = self.tiers.iter().map(|(t, f)| format!("{t} ×{f}")).collect();
        let _ = writeln!(out, "tiers (scale per-caller scopes): {}", tiers.join(", "));
        let _ = writeln!(
            out,
            "auth: {} configured key(s), key required: {}, anonymous tier: {}, caller ids: {}",
            self.auth.keys.len(),
            self.auth.required,
            self.auth.anonymous_tier,
            if self.auth.id_secret.is_some() { "keyed (auth.id_secret)" } else { "unkeyed SHA-256" }
        );
        let up = &self.upstream;
        let _ = writeln!(
            out,
            "unverified callers (no configured key), all addresses together: {} of the account's {} slots, {} of \
             its {} queue places; {} sessions per address",
            up.unverified_slots(),
            up.max_in_flight,
            up.unverified_places(),
            up.queue_max,
            self.server.max_sessions_per_address
        );
        let _ = writeln!(out);
        let _ = writeln!(out, "{:<34} {:<6} own budget (per tenant, address or caller; in calls)", "tool", "cost");
        for (tool, policy) in &self.tools {
            let budget: Vec<String> =
                policy.budget.iter().map(|b| format!("{} {}", b.limiter.algorithm(), b.limiter.describe())).collect();
            let budget = if budget.is_empty() { "-".to_owned() } else { budget.join(" + ") };
            let _ = writeln!(out, "{tool:<34} {:<6} {budget}", policy.cost);
        }
        out
    }
}

fn parse_digest(key: &str, hex: &str) -> Result<[u8; 32], ConfigError> {
    let hex = hex.trim();
    let bad = || invalid(key, "must be 64 hexadecimal digits (the SHA-256 of the key, e.g. `sha256sum`)");
    if hex.len() != 64 {
        return Err(bad());
    }
    let mut digest = [0u8; 32];
    for (i, byte) in digest.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2).ok_or_else(bad)?, 16).map_err(|_| bad())?;
    }
    Ok(digest)
}

impl RawConfig {
    fn validate(self, catalogue: &Catalogue) -> Result<Config, ConfigError> {
        let tiers = self.tiers;
        for (tier, factor) in &tiers {
            if !factor.is_finite() || *factor <= 0.0 || *factor > 1e6 {
                return Err(invalid(format!("tiers.{tier}"), format!("must be a positive factor (got {factor})")));
            }
        }
        let tier_names = || tiers.keys().cloned().collect::<Vec<_>>().join(", ");
        let known_tier = |key: String, tier: &str| -> Result<(), ConfigError> {
            if tiers.contains_key(tier) {
                Ok(())
            } else {
                Err(invalid(key, format!("unknown tier `{tier}`; the tiers are {}", tier_names())))
            }
        };

        let mut method = self.limits.method;
        let mut group = |name: &str| -> Result<Vec<Limit>, ConfigError> {
            method
                .remove(name)
                .ok_or_else(|| invalid(format!("limits.method.{name}"), "missing"))?
                .build(&format!("limits.method.{name}"))
        };
        let limits = Limits {
            enabled: self.limits.enabled,
            http: self.limits.http.build("limits.http")?,
            address_http: self.limits.address_http.build("limits.address_http")?,
            tools_list: group("tools_list")?,
            tools_call: group("tools_call")?,
            other_methods: group("other")?,
            caller: self.limits.caller.build("limits.caller")?,
            tenant: self.limits.tenant.build("limits.tenant")?,
            address: self.limits.address.build("limits.address")?,
            in_flight_caller: slots("limits.in_flight.caller", self.limits.in_flight.caller)?,
            in_flight_tenant: slots("limits.in_flight.tenant", self.limits.in_flight.tenant)?,
            in_flight_address: slots("limits.in_flight.address", self.limits.in_flight.address)?,
        };
        if let Some(unknown) = method.keys().next() {
            return Err(invalid(
                format!("limits.method.{unknown}"),
                format!("unknown method group; the groups are {}", METHOD_GROUPS.join(", ")),
            ));
        }

        let mut tools = BTreeMap::new();
        let enforced = |limits: &[Limit]| -> Vec<Limiter> {
            limits.iter().filter(|l| l.enforced_mode()).map(|l| l.limiter.clone()).collect()
        };
        for (tool, spec) in self.tools {
            let key = format!("tools.{tool}.cost");
            if !catalogue.contains(&tool) {
                return Err(invalid(
                    format!("tools.{tool}"),
                    format!("unknown tool `{tool}`; the tools are {}", catalogue.listed()),
                ));
            }
            let cost = u64::try_from(spec.cost)
                .map_err(|_| invalid(&key, format!("a cost cannot be negative (got {})", spec.cost)))?;
            let scopes = [
                ("limits.caller", enforced(&limits.caller)),
                ("limits.tenant", enforced(&limits.tenant)),
                ("limits.address", enforced(&limits.address)),
            ];
            for (scope, limiter) in
                scopes.iter().flat_map(|(scope, limiters)| limiters.iter().map(move |l| (*scope, l)))
            {
                if cost > limiter.capacity() {
                    return Err(invalid(
                        &key,
                        format!(
                            "cost {cost} is larger than `{scope}.{}` = {}, so `{tool}` could never be called; \
                             lower the cost or raise the {}",
                            limiter.capacity_key(),
                            limiter.capacity(),
                            limiter.capacity_key()
                        ),
                    ));
                }
            }
            for (tier, factor) in &tiers {
                for limiter in enforced(&limits.caller) {
                    let scaled = limiter.scaled(*factor).capacity();
                    if cost > scaled {
                        return Err(invalid(
                            &key,
                            format!(
                                "cost {cost} is larger than `limits.caller.{}` × `tiers.{tier}` = {scaled}, so \
                                 callers of tier {tier} could never call `{tool}`",
                                limiter.capacity_key()
                            ),
                        ));
                    }
                }
            }
            let budget = match spec.budget {
                Some(budget) => budget.build(&format!("tools.{tool}.budget"))?,
                None => Vec::new(),
            };
            // A tool that says nothing fails closed if it costs, open if it is free (config.toml
            // says `open` for list_articles, a cheap read).
            let fail = spec.fail.unwrap_or(if cost > 0 { Fail::Closed } else { Fail::Open });
            tools.insert(tool, ToolPolicy { cost, budget, fail });
        }
        if let Some(missing) = catalogue.names().find(|t| !tools.contains_key(*t)) {
            return Err(invalid(format!("tools.{missing}.cost"), "every tool needs a cost"));
        }

        known_tier("auth.anonymous_tier".into(), &self.auth.anonymous_tier)?;
        let mut keys = Vec::with_capacity(self.auth.keys.len());
        for (i, raw) in self.auth.keys.into_iter().enumerate() {
            let at = format!("auth.keys[{i}]");
            let sha256 = match (&raw.key, &raw.sha256) {
                (Some(plain), None) if !plain.trim().is_empty() => Sha256::digest(plain.trim().as_bytes()).into(),
                (None, Some(hex)) => parse_digest(&format!("{at}.sha256"), hex)?,
                _ => {
                    return Err(invalid(
                        at,
                        "give exactly one of `key` (plaintext, for local development) or `sha256`",
                    ));
                }
            };
            let tier = raw.tier.unwrap_or_else(|| "default".to_owned());
            known_tier(format!("{at}.tier"), &tier)?;
            if raw.tenant.as_deref().is_some_and(|t| t.is_empty() || t.len() > 64 || t.contains(':')) {
                return Err(invalid(format!("{at}.tenant"), "a tenant is 1-64 characters without `:`"));
            }
            if keys.iter().any(|k: &ApiKey| k.sha256 == sha256) {
                return Err(invalid(at, "the same key is configured twice"));
            }
            let caller = raw.caller.map(|c| c.build(&format!("{at}.caller"))).transpose()?;
            keys.push(ApiKey { sha256, tenant: raw.tenant, tier, caller });
        }
        if self.auth.required && keys.is_empty() {
            return Err(invalid("auth.required", "is true but no `[[auth.keys]]` are configured: nobody could call"));
        }
        let id_secret = id_secret(&self.auth.id_secret)?;

        let caps = self.spend_caps;
        if !(caps.price_per_unit.is_finite() && caps.price_per_unit >= 0.0) {
            return Err(invalid("spend_caps.price_per_unit", "must be a price of 0 or more"));
        }
        if !(1..=100).contains(&caps.warn_at_percent) {
            return Err(invalid("spend_caps.warn_at_percent", "must be a percentage from 1 to 100"));
        }
        let cap_units = |key: &str, units: i64| -> Result<Option<u64>, ConfigError> {
            match units {
                0 => Ok(None),
                1..=MAX_UNITS => Ok(Some(units as u64)),
                _ => Err(invalid(key, format!("must be 0 (no cap) or between 1 and {MAX_UNITS} cost units"))),
            }
        };
        let mut daily_units = cap_units("spend_caps.daily_units", caps.daily_units)?;
        if caps.daily_money != 0.0 {
            if !(caps.daily_money.is_finite() && caps.daily_money > 0.0) {
                return Err(invalid("spend_caps.daily_money", "must be 0 (no cap) or a positive amount"));
            }
            if caps.price_per_unit == 0.0 {
                return Err(invalid(
                    "spend_caps.daily_money",
                    "needs `spend_caps.price_per_unit` to turn money into units",
                ));
            }
            let units = (caps.daily_money / caps.price_per_unit).floor().min(MAX_UNITS as f64) as i64;
            let units = cap_units("spend_caps.daily_money", units.max(1))?;
            // Both given: the tighter one.
            daily_units = daily_units.into_iter().chain(units).min();
        }
        let spend_caps = SpendCaps {
            daily_units,
            price_per_unit: caps.price_per_unit,
            currency: caps.currency,
            warn_at_percent: caps.warn_at_percent as u8,
        };
        let mut tenants = BTreeMap::new();
        for (name, raw) in self.tenants {
            let at = format!("tenants.{name}");
            if name.is_empty() || name.len() > 64 || name.contains(':') {
                return Err(invalid(at, "a tenant is 1-64 characters without `:`"));
            }
            let budget = raw.budget.map(|b| b.build(&format!("{at}.budget"))).transpose()?;
            let daily_spend_units =
                raw.daily_spend_units.map(|u| cap_units(&format!("{at}.daily_spend_units"), u)).transpose()?.flatten();
            tenants.insert(name, TenantOverride { budget, daily_spend_units });
        }
        let max_cost = tools.values().map(|t| t.cost).max().unwrap_or(0);
        for (key, cap) in std::iter::once(("spend_caps.daily_units".to_owned(), spend_caps.daily_units))
            .chain(tenants.iter().map(|(t, o)| (format!("tenants.{t}.daily_spend_units"), o.daily_spend_units)))
        {
            if let Some(cap) = cap.filter(|cap| *cap < max_cost) {
                return Err(invalid(key, format!("a cap of {cap} is below the dearest tool's cost {max_cost}")));
            }
        }
        let shared = (self.store.backend == Backend::Redis).then_some(self.store.expected_instances);
        costs_fit(&tools, &tiers, &limits, &tenants, &keys, &spend_caps, shared)?;

        let server = self.server;
        if server.max_body_bytes == 0 {
            return Err(invalid("server.max_body_bytes", "must be at least 1"));
        }
        if server.max_sessions == 0 {
            return Err(invalid("server.max_sessions", "must be greater than zero"));
        }
        if server.max_sessions_per_address == 0 {
            return Err(invalid("server.max_sessions_per_address", "must be greater than zero"));
        }
        // A day at most: longer would be a typo, and timers add these to the current instant.
        for (key, value, day) in [
            ("server.session_idle_timeout_seconds", server.session_idle_timeout_seconds, 86_400),
            ("server.header_read_timeout_ms", server.header_read_timeout_ms, 86_400_000),
            ("server.body_read_timeout_ms", server.body_read_timeout_ms, 86_400_000),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be greater than zero"));
            }
            if value > day {
                return Err(invalid(key, format!("{value} is more than a day ({day})")));
            }
        }
        if server.allowed_hosts.is_empty() {
            return Err(invalid("server.allowed_hosts", "list at least one host name (e.g. \"localhost\")"));
        }
        for (i, origin) in server.allowed_origins.iter().enumerate() {
            if reqwest::Url::parse(origin).map_or(true, |u| u.host_str().is_none()) {
                return Err(invalid(
                    format!("server.allowed_origins[{i}]"),
                    "must be an origin like https://app.example.com",
                ));
            }
        }
        let mut trusted_proxies = Vec::with_capacity(server.trusted_proxies.len());
        for (i, proxy) in server.trusted_proxies.iter().enumerate() {
            let net = proxy.parse::<IpNet>().or_else(|_| proxy.parse::<IpAddr>().map(IpNet::from)).map_err(|_| {
                invalid(format!("server.trusted_proxies[{i}]"), format!("`{proxy}` is not an IP or CIDR"))
            })?;
            trusted_proxies.push(net);
        }

        if !self.upstream.url.is_empty() {
            match reqwest::Url::parse(&self.upstream.url) {
                Ok(u) if matches!(u.scheme(), "http" | "https") => {}
                Ok(u) => return Err(invalid("upstream.url", format!("scheme `{}` is not http or https", u.scheme()))),
                Err(e) => return Err(invalid("upstream.url", format!("not a URL: {e}"))),
            }
        }
        let up = &self.upstream;
        let loops = &self.loop_detection;
        for (key, value) in [
            ("upstream.timeout_ms", up.timeout_ms),
            ("upstream.image_poll_seconds", up.image_poll_seconds),
            ("upstream.video_poll_seconds", up.video_poll_seconds),
            ("upstream.max_in_flight", up.max_in_flight as u64),
            ("upstream.queue_max", up.queue_max as u64),
            ("upstream.video_queue_max", up.video_queue_max as u64),
            ("upstream.max_attempts", u64::from(up.max_attempts)),
            ("upstream.max_retry_after_ms", up.max_retry_after_ms),
            ("upstream.job_expiry_seconds", up.job_expiry_seconds),
            ("upstream.breaker_failures", u64::from(up.breaker_failures)),
            ("upstream.breaker_cooldown_ms", up.breaker_cooldown_ms),
            ("upstream.retry_budget_window_ms", up.retry_budget_window_ms),
            ("store.sweep_interval_ms", self.store.sweep_interval_ms),
            ("store.timeout_ms", self.store.timeout_ms),
            ("store.lease_ms", self.store.lease_ms),
            ("store.expected_instances", u64::from(self.store.expected_instances)),
            ("loop_detection.window_ms", loops.window_ms),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be greater than zero"));
            }
        }
        // Durations the server adds to the current instant (timers, deadlines, leases, hints): a
        // day at most (a week for a job's expiry), so no sum can leave the clock's range; longer
        // would be a typo. config.toml names each bound.
        let mock = &self.mock_upstream;
        for (key, value, most, what) in [
            ("upstream.timeout_ms", up.timeout_ms, DAY_MS, "a day"),
            ("upstream.image_poll_seconds", up.image_poll_seconds, DAY_SECONDS, "a day"),
            ("upstream.video_poll_seconds", up.video_poll_seconds, DAY_SECONDS, "a day"),
            ("upstream.video_min_gap_ms", up.video_min_gap_ms, DAY_MS, "a day"),
            ("upstream.max_retry_after_ms", up.max_retry_after_ms, DAY_MS, "a day"),
            ("upstream.job_expiry_seconds", up.job_expiry_seconds, 7 * DAY_SECONDS, "a week"),
            ("upstream.breaker_cooldown_ms", up.breaker_cooldown_ms, DAY_MS, "a day"),
            ("upstream.retry_budget_window_ms", up.retry_budget_window_ms, DAY_MS, "a day"),
            ("store.timeout_ms", self.store.timeout_ms, DAY_MS, "a day"),
            ("store.lease_ms", self.store.lease_ms, DAY_MS, "a day"),
            ("store.sweep_interval_ms", self.store.sweep_interval_ms, DAY_MS, "a day"),
            ("loop_detection.window_ms", loops.window_ms, DAY_MS, "a day"),
            ("mock_upstream.latency_ms", mock.latency_ms, DAY_MS, "a day"),
            ("mock_upstream.retry_after_seconds", mock.retry_after_seconds, DAY_SECONDS, "a day"),
            ("mock_upstream.image_job_ms", mock.image_job_ms, DAY_MS, "a day"),
            ("mock_upstream.video_job_ms", mock.video_job_ms, DAY_MS, "a day"),
        ] {
            if value > most {
                return Err(invalid(key, format!("{value} is more than {what} ({most})")));
            }
        }
        if self.store.backend == Backend::Redis {
            // The store's own reading of the URL: one server, or a cluster's seed nodes.
            if let Err(e) = crate::store::RedisStore::check_url(&self.store.redis_url) {
                return Err(invalid("store.redis_url", e.to_string()));
            }
            if !self.store.redis_ca_file.is_empty() {
                self.store.redis_ca().map_err(|e| invalid("store.redis_ca_file", e))?;
            }
            // The Lua twins compute in doubles, exact to the nanosecond over at most 2^52 ns.
            let mut spans: Vec<(String, &[Limit])> = vec![
                ("limits.http".into(), &limits.http),
                ("limits.address_http".into(), &limits.address_http),
                ("limits.method.tools_list".into(), &limits.tools_list),
                ("limits.method.tools_call".into(), &limits.tools_call),
                ("limits.method.other".into(), &limits.other_methods),
                ("limits.caller".into(), &limits.caller),
                ("limits.tenant".into(), &limits.tenant),
                ("limits.address".into(), &limits.address),
            ];
            spans.extend(tools.iter().map(|(t, p)| (format!("tools.{t}.budget"), p.budget.as_slice())));
            spans.extend(
                tenants.iter().filter_map(|(t, o)| o.budget.as_deref().map(|b| (format!("tenants.{t}.budget"), b))),
            );
            spans.extend(
                keys.iter()
                    .enumerate()
                    .filter_map(|(i, k)| k.caller.as_deref().map(|c| (format!("auth.keys[{i}].caller"), c))),
            );
            if let Some((key, _)) = spans.iter().find(|(_, l)| l.iter().any(|l| l.limiter.span() > 1 << 52)) {
                return Err(invalid(
                    key.as_str(),
                    "with store.backend = \"redis\" a window, or a bucket's burst × refill time, may span at most \
                     52 days",
                ));
            }
            // A tier scales a bucket's burst (rounded, never below one) and its rate, so its span
            // can grow: a burst of 1 at half the rate spans twice as long.
            let own = ["http", "method.tools_list", "method.tools_call", "method.other", "caller"]
                .map(|s| format!("limits.{s}"));
            let tiered = spans.iter().filter(|(key, _)| own.contains(key));
            for ((key, limits), (tier, factor)) in tiered.flat_map(|s| tiers.iter().map(move |t| (s, t))) {
                if limits.iter().any(|l| l.limiter.scaled(*factor).span() > 1 << 52) {
                    return Err(invalid(
                        key.as_str(),
                        format!(
                            "× `tiers.{tier}` ({factor}) it spans more than 52 days, the most a window, or a \
                             bucket's burst × refill time, may span with store.backend = \"redis\""
                        ),
                    ));
                }
            }
        }
        if loops.repeats < 2 {
            return Err(invalid("loop_detection.repeats", "must be at least 2: one call is never a loop"));
        }
        if !(0.0..=1.0).contains(&up.unverified_share) {
            return Err(invalid(
                "upstream.unverified_share",
                format!("must be a fraction between 0.0 and 1.0 (got {})", up.unverified_share),
            ));
        }
        if !(0.0..=1.0).contains(&up.retry_budget_ratio) {
            return Err(invalid(
                "upstream.retry_budget_ratio",
                format!("must be a fraction between 0.0 and 1.0 (got {})", up.retry_budget_ratio),
            ));
        }
        for (key, rate) in [
            ("mock_upstream.rate_429", self.mock_upstream.rate_429),
            ("mock_upstream.rate_5xx", self.mock_upstream.rate_5xx),
        ] {
            if !(0.0..=1.0).contains(&rate) {
                return Err(invalid(key, format!("must be a fraction between 0.0 and 1.0 (got {rate})")));
            }
        }

        let admin = self.admin.validate()?;

        Ok(Config {
            admin,
            server: ServerConfig {
                listen: server.listen,
                allowed_hosts: server.allowed_hosts,
                allowed_origins: server.allowed_origins,
                max_body_bytes: server.max_body_bytes,
                trust_proxy: server.trust_proxy,
                trusted_proxies,
                session_idle_timeout: Duration::from_secs(server.session_idle_timeout_seconds),
                max_sessions: server.max_sessions,
                max_sessions_per_address: server.max_sessions_per_address,
                header_read_timeout: Duration::from_millis(server.header_read_timeout_ms),
                body_read_timeout: Duration::from_millis(server.body_read_timeout_ms),
            },
            auth: AuthConfig {
                required: self.auth.required,
                anonymous_tier: self.auth.anonymous_tier,
                keys,
                id_secret,
            },
            tiers,
            limits,
            spend_caps,
            tenants,
            tools,
            upstream: self.upstream,
            store: self.store,
            loop_detection: self.loop_detection,
            mock_upstream: self.mock_upstream,
        })
    }
}

impl RawAdmin {
    fn validate(self) -> Result<AdminConfig, ConfigError> {
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

/// `auth.id_secret`: `None` when it is empty, else the secret, at least [`MIN_ID_SECRET_CHARS`]
/// long (the message of a refused secret never shows it).
fn id_secret(secret: &str) -> Result<Option<Secret>, ConfigError> {
    let secret = secret.trim();
    if secret.is_empty() {
        return Ok(None);
    }
    let chars = secret.chars().count();
    if chars < MIN_ID_SECRET_CHARS {
        return Err(invalid(
            "auth.id_secret",
            format!(
                "is {chars} characters; an id secret needs at least {MIN_ID_SECRET_CHARS} (e.g. `openssl rand -hex 32`), \
                 or leave it empty for unkeyed caller ids"
            ),
        ));
    }
    Ok(Some(Secret::new(secret)))
}

/// A day, the longest most durations may be (see the bounds in [`RawConfig::validate`]).
const DAY_MS: u64 = 86_400_000;
/// The same in seconds.
const DAY_SECONDS: u64 = 86_400;

/// Refuses a config in which a paid tool's cost is larger than an enforced limit of a scope it
/// draws on, as the guard scales them (`Policy::new`, `Policy::scaled`: capacities rounded,
/// never below one): the tenants' and keys' own budgets as written, and over a shared store
/// (`shared`: its expected instances), for a tool that fails open, the insurance limiter's share
/// of 1/`store.expected_instances` of every one of them (`limits.caller` after each tier), and
/// of the spend caps. Such a tool could never be called by that tenant or key, or on any
/// instance while the store cannot decide. (The unscaled `limits.*`, their tiers and the caps
/// are checked where they are read.)
fn costs_fit(
    tools: &BTreeMap<String, ToolPolicy>,
    tiers: &BTreeMap<String, f64>,
    limits: &Limits,
    tenants: &BTreeMap<String, TenantOverride>,
    keys: &[ApiKey],
    spend_caps: &SpendCaps,
    shared: Option<u32>,
) -> Result<(), ConfigError> {
    // Every limit a cost is drawn from: the key of its capacity, the limiter, whether tiers scale it.
    let mut drawn: Vec<(String, Limiter, bool)> = Vec::new();
    let mut scope = |key: &str, list: &[Limit], tiered: bool| {
        for (i, limit) in list.iter().enumerate().filter(|(_, l)| l.enforced_mode()) {
            let at = if list.len() > 1 { format!("{key}[{i}]") } else { key.to_owned() };
            drawn.push((format!("{at}.{}", limit.limiter.capacity_key()), limit.limiter.clone(), tiered));
        }
    };
    scope("limits.caller", &limits.caller, true);
    scope("limits.tenant", &limits.tenant, false);
    scope("limits.address", &limits.address, false);
    for (tenant, own) in tenants {
        scope(&format!("tenants.{tenant}.budget"), own.budget.as_deref().unwrap_or_default(), false);
    }
    for (i, key) in keys.iter().enumerate() {
        scope(&format!("auth.keys[{i}].caller"), key.caller.as_deref().unwrap_or_default(), false);
    }
    let cap = |units: u64| Limiter::FixedWindow(FixedWindow::new(units, DAY_MS * 1_000_000));
    drawn.extend(spend_caps.daily_units.map(|units| ("spend_caps.daily_units".to_owned(), cap(units), false)));
    for (tenant, own) in tenants {
        if let Some(units) = own.daily_spend_units {
            drawn.push((format!("tenants.{tenant}.daily_spend_units"), cap(units), false));
        }
    }

    let untiered = [(None, 1.0)];
    for (tool, policy) in tools.iter().filter(|(_, p)| p.cost > 0) {
        let cost = policy.cost;
        for (at, limiter, tiered) in &drawn {
            let factors: Vec<(Option<&str>, f64)> =
                if *tiered { tiers.iter().map(|(t, f)| (Some(t.as_str()), *f)).collect() } else { untiered.to_vec() };
            for (tier, factor) in factors {
                let scaled = limiter.scaled(factor);
                let of = tier.map_or_else(|| format!("`{at}`"), |t| format!("`{at}` × `tiers.{t}`"));
                if cost > scaled.capacity() {
                    return Err(invalid(
                        format!("tools.{tool}.cost"),
                        format!(
                            "cost {cost} is larger than {of} = {}, so `{tool}` could never be called there; lower \
                             the cost or raise `{at}`",
                            scaled.capacity()
                        ),
                    ));
                }
                let Some(instances) = shared.filter(|n| *n > 1 && policy.fail == Fail::Open) else { continue };
                let share = scaled.scaled(1.0 / f64::from(instances)).capacity();
                if cost > share {
                    return Err(invalid(
                        "store.expected_instances",
                        format!(
                            "with {instances} instances sharing the store, the insurance limiter gives each 1/{instances} \
                             of {of} ({} → {share}), less than the cost {cost} of `{tool}`, which fails open: while \
                             the store cannot decide, no instance could admit it. Lower `store.expected_instances` \
                             or `tools.{tool}.cost`, raise `{at}`, or set `tools.{tool}.fail = \"closed\"`",
                            scaled.capacity()
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// TOML integers are 64-bit signed, and the TOML reader stops at a larger one (a `u64` maximum,
/// say) without naming its key: this finds it first and names it. Anything else unreadable is
/// left to the reader's own message.
fn integer_too_large(toml: &str) -> Result<(), ConfigError> {
    fn walk(path: &str, value: &toml::de::DeValue<'_>) -> Option<(String, String)> {
        match value {
            toml::de::DeValue::Integer(n) if i64::from_str_radix(n.as_str(), n.radix()).is_err() => {
                Some((path.to_owned(), n.as_str().to_owned()))
            }
            toml::de::DeValue::Table(table) => table.iter().find_map(|(key, value)| {
                let key = key.get_ref();
                walk(&if path.is_empty() { key.to_string() } else { format!("{path}.{key}") }, value.get_ref())
            }),
            toml::de::DeValue::Array(items) => {
                items.iter().enumerate().find_map(|(i, item)| walk(&format!("{path}[{i}]"), item.get_ref()))
            }
            _ => None,
        }
    }
    let Ok(document) = toml::de::DeTable::parse(toml) else { return Ok(()) };
    match walk("", &toml::de::DeValue::Table(document.into_inner())) {
        Some((key, number)) => Err(invalid(
            key,
            format!("{number} is larger than any number a config takes (TOML integers stop at {})", i64::MAX),
        )),
        None => Ok(()),
    }
}

/// Largest count a limit may have (window counters are kept in 32 bits).
const MAX_UNITS: i64 = crate::limit::params::MAX_UNITS as i64;

/// An in-flight cap: a `concurrency` limiter of `max` slots.
fn slots(key: &str, max: i64) -> Result<Limiter, ConfigError> {
    if max <= 0 || max > MAX_UNITS {
        return Err(invalid(key, format!("must be between 1 and {MAX_UNITS} jobs (got {max})")));
    }
    Ok(Limiter::Concurrency(Concurrency::new(max as u64)))
}
impl RawScope {
    /// The scope's limits, each named by its key (`limits.caller`, or `limits.caller[1]` in a
    /// list).
    fn build(&self, key: &str) -> Result<Vec<Limit>, ConfigError> {
        let (raw, listed): (Vec<&RawLimit>, bool) = match self {
            RawScope::One(limit) => (vec![limit], false),
            RawScope::Many(list) => (list.iter().collect(), true),
        };
        if raw.is_empty() {
            return Err(invalid(key, "an empty list of limits: give at least one"));
        }
        let mut limits: Vec<Limit> = Vec::with_capacity(raw.len());
        for (i, r) in raw.into_iter().enumerate() {
            let at = if listed { format!("{key}[{i}]") } else { key.to_owned() };
            let limiter = r.build(&at)?;
            let suffix = match &r.name {
                Some(name) => {
                    let ok = (1..=32).contains(&name.len())
                        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
                    if !ok {
                        return Err(invalid(format!("{at}.name"), "1-32 letters, digits, `_` or `-`"));
                    }
                    if limits.iter().any(|l| l.suffix == format!("#{name}")) {
                        return Err(invalid(format!("{at}.name"), format!("`{name}` names two limits of {key}")));
                    }
                    format!("#{name}")
                }
                None if i == 0 => String::new(),
                None => {
                    let base = limiter.algorithm();
                    let mut suffix = format!("#{base}");
                    let mut n = 2;
                    while limits.iter().any(|l| l.suffix == suffix) {
                        suffix = format!("#{base}{n}");
                        n += 1;
                    }
                    suffix
                }
            };
            let warn_at_percent = match r.warn_at_percent {
                Some(p) if (1..=100).contains(&p) => Some(p as u8),
                Some(_) => return Err(invalid(format!("{at}.warn_at_percent"), "must be a percentage from 1 to 100")),
                None => limiter.policy_window().filter(|w| *w >= WARN_BY_DEFAULT_FROM).map(|_| 80),
            };
            limits.push(Limit { limiter, mode: r.mode.unwrap_or(Mode::Enforce), warn_at_percent, suffix });
        }
        Ok(limits)
    }
}

impl RawLimit {
    /// The limiter this table describes: its algorithm, reading the parameters it takes.
    fn build(&self, key: &str) -> Result<Limiter, ConfigError> {
        if let Some(unknown) = self.params.keys().find(|name| crate::limit::is_param(name).is_err()) {
            let known = crate::limit::is_param(unknown).err().unwrap_or_default();
            return Err(invalid(
                format!("{key}.{unknown}"),
                format!(
                    "unknown parameter `{unknown}`; the parameters of a limit are algorithm, mode, name, warn_at_percent, {known}"
                ),
            ));
        }
        let params = Params::new(key, &self.algorithm, &self.params);
        match Limiter::from_params(&self.algorithm, &params) {
            Some(built) => built.map_err(|e| invalid(e.key, e.message)),
            None => Err(invalid(
                format!("{key}.algorithm"),
                format!("unknown algorithm `{}`; expected one of {}", self.algorithm, ALGORITHMS.join(", ")),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tools the documented defaults price: the reference server's catalogue, read from
    /// `config.toml` rather than imported from the MCP layer.
    fn reference() -> Catalogue {
        let defaults = config::Config::builder()
            .add_source(config::File::from_str(DEFAULT_TOML, config::FileFormat::Toml))
            .build()
            .expect("the defaults parse");
        let tools = defaults.get_table("tools").expect("the defaults price tools");
        tools.into_keys().fold(Catalogue::new(), Catalogue::tool)
    }

    impl Config {
        fn from_toml_test(toml: &str) -> Result<Self, ConfigError> {
            Self::from_toml(toml, &reference())
        }
    }

    fn err(toml: &str) -> String {
        match Config::from_toml_test(toml) {
            Ok(_) => panic!("config should have been rejected:\n{toml}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn documented_defaults_load() {
        let c = Config::from_toml_test("").expect("defaults are valid");
        assert_eq!(c.limits.caller[0].limiter.capacity(), 60);
        assert_eq!(c.tools["generate_image_to_video"].cost, 20);
        assert_eq!(c.tools.len(), reference().names().count());
        // Without those tools in the catalogue, their default prices are not loaded.
        assert!(Config::defaults(&Catalogue::new().tool("search")).is_err(), "search has no cost");
        let other = Config::from_toml("[tools.search]\ncost = 3\n", &Catalogue::new().tool("search"))
            .expect("another server's catalogue");
        assert_eq!(other.tools.keys().collect::<Vec<_>>(), ["search"]);
    }

    #[test]
    fn cost_larger_than_bucket_names_both_keys() {
        let e = err("[tools.generate_image_to_video]\ncost = 100\n");
        assert!(e.contains("tools.generate_image_to_video.cost") && e.contains("limits.caller.burst"), "{e}");
    }

    #[test]
    fn unknown_tool_unknown_algorithm_and_bad_rates_are_named() {
        assert!(err("[tools.make_coffee]\ncost = 1\n").contains("tools.make_coffee"));
        assert!(err("[limits.caller]\nalgorithm = \"magic\"\n").contains("limits.caller.algorithm"));
        assert!(err("[limits.caller]\nrefill_per_sec = 0\n").contains("limits.caller.refill_per_sec"));
        assert!(err("[limits.caller]\nrefill_per_sec = -1.5\n").contains("limits.caller.refill_per_sec"));
        assert!(err("[limits.caller]\nburst = 0\n").contains("limits.caller.burst"));
        assert!(err("[tools.save_article]\ncost = -2\n").contains("tools.save_article.cost"));
        assert!(err("[upstream]\nurl = \"ftp://x\"\n").contains("upstream.url"));
        assert!(err("[limits.in_flight]\ncaller = 0\n").contains("limits.in_flight.caller"));
        assert!(err("[loop_detection]\nrepeats = 1\n").contains("loop_detection.repeats"));
        assert!(err("[upstream]\nmax_attempts = 0\n").contains("upstream.max_attempts"));
        assert!(err("[upstream]\nretry_budget_ratio = 1.5\n").contains("upstream.retry_budget_ratio"));
    }

    #[test]
    fn every_algorithm_can_be_selected_with_its_own_parameters() {
        for (toml, name) in [
            ("algorithm = \"gcra\"", "gcra"),
            ("algorithm = \"fixed_window\"\nlimit = 100\nwindow_ms = 60000", "fixed_window"),
            ("algorithm = \"sliding_log\"\nlimit = 100\nwindow_ms = 60000", "sliding_log"),
            ("algorithm = \"sliding_window\"\nlimit = 100\nwindow_ms = 60000", "sliding_window"),
            ("algorithm = \"leaky_bucket\"\nleak_per_sec = 2.0", "leaky_bucket"),
            ("algorithm = \"concurrency\"\nmax_in_flight = 100", "concurrency"),
        ] {
            let c = Config::from_toml_test(&format!("[limits.caller]\n{toml}\n")).expect(name);
            assert_eq!(c.limits.caller[0].limiter.algorithm(), name);
        }
    }

    #[test]
    fn an_algorithm_without_its_parameters_names_the_missing_key() {
        assert!(err("[limits.caller]\nalgorithm = \"fixed_window\"\nlimit = 10\n").contains("limits.caller.window_ms"));
        assert!(err("[limits.caller]\nalgorithm = \"sliding_log\"\nwindow_ms = 10\n").contains("limits.caller.limit"));
        assert!(err("[limits.caller]\nalgorithm = \"concurrency\"\n").contains("limits.caller.max_in_flight"));
        assert!(
            err("[limits.caller]\nalgorithm = \"fixed_window\"\nlimit = 10\nwindow_ms = 0\n").contains("window_ms")
        );
    }

    #[test]
    fn a_short_admin_key_is_refused_and_no_key_keeps_the_admin_api_off() {
        let e = err("[admin]\nkey = \"short\"\n");
        assert!(e.contains("admin.key") && !e.contains("short"), "{e}");
        assert!(Config::from_toml_test("").expect("defaults").admin.key_sha256.is_none());
        let on = Config::from_toml_test("[admin]\nkey = \"0123456789abcdef\"\n").expect("16 characters");
        assert!(on.admin.key_sha256.is_some());
        assert!(!format!("{on:?}").contains("0123456789abcdef"), "the key never shows in a Debug print");
    }

    #[test]
    fn the_raw_config_prints_no_secret_either() {
        let toml = "[store]\nredis_url = \"redis://:redis-pw-hush@h:1,redis://:other-pw-hush@g:2\"\n\
                    [upstream]\nurl = \"https://u:upstream-pw-hush@api.example.com/\"\n\
                    [admin]\nkey = \"admin-key-hush-01234\"\n[auth]\nid_secret = \"id-secret-hush-01234\"\n\
                    [[auth.keys]]\nkey = \"plain-key-hush\"\n[[auth.keys]]\nsha256 = \"ab12cd34\"\n";
        let raw = Config::defaults_for(&reference())
            .expect("defaults")
            .add_source(config::File::from_str(toml, config::FileFormat::Toml))
            .build()
            .expect("builds")
            .try_deserialize::<RawConfig>()
            .expect("a raw config");
        for printed in [format!("{raw:?}"), format!("{raw:#?}")] {
            assert!(!printed.contains("hush") && !printed.contains("ab12cd34"), "{printed}");
            assert!(printed.contains("redis://***@h:1,redis://***@g:2") && printed.contains("RawKey"), "{printed}");
        }
    }

    #[test]
    fn a_short_id_secret_is_refused_without_showing_it() {
        let e = err("[auth]\nid_secret = \"too-short\"\n");
        assert!(e.contains("auth.id_secret") && e.contains("16") && !e.contains("too-short"), "{e}");
        assert!(Config::from_toml_test("[auth]\nid_secret = \"  \"\n").expect("blank").auth.id_secret.is_none());
        let on = Config::from_toml_test("[auth]\nid_secret = \" 0123456789abcdef \"\n").expect("16 characters");
        assert_eq!(on.auth.id_secret.as_ref().map(Secret::expose), Some("0123456789abcdef"), "trimmed");
        assert!(on.limits_table().contains("caller ids: keyed (auth.id_secret)"), "{}", on.limits_table());
        assert!(!format!("{on:?}{on:#?}").contains("0123456789abcdef"), "the secret never shows in a Debug print");
    }

    #[test]
    fn an_insurance_share_below_a_cost_names_the_instances_the_limit_and_the_tool() {
        let redis = "[store]\nbackend = \"redis\"\nexpected_instances = 3\n";
        // 60 × guest 0.5 = 30, a third of which (10) is below a video's 20, for a tool that fails open.
        let open = "[tools.generate_image_to_video]\nfail = \"open\"\n";
        let e = err(&format!("{redis}{open}"));
        assert!(e.contains("`store.expected_instances`"), "{e}");
        for part in ["1/3", "`limits.caller.burst` × `tiers.guest`", "30 → 10", "cost 20", "generate_image_to_video"]
        {
            assert!(e.contains(part), "{part}: {e}");
        }
        assert!(e.contains("fail = \"closed\""), "says what to change: {e}");
        // The same share for a tool that fails closed never decides it: accepted.
        assert!(Config::from_toml_test(redis).is_ok());
        // In memory there is no insurance limiter; with one instance its share is the whole.
        assert!(Config::from_toml_test(open).is_ok());
        assert!(Config::from_toml_test(&format!("{}{open}", redis.replace("= 3", "= 1"))).is_ok());
        // Tenants' and keys' own budgets are shared out too, and checked as written.
        let tenant = "[tenants.acme.budget]\nalgorithm = \"sliding_window\"\nlimit = 50\nwindow_ms = 60000\n";
        let e = err(&format!("{redis}{open}{tenant}[limits.caller]\nburst = 600\n"));
        assert!(e.contains("`tenants.acme.budget.limit` (50 → 17)"), "{e}");
        let key =
            "[[auth.keys]]\nkey = \"k\"\n[auth.keys.caller]\nalgorithm = \"gcra\"\nburst = 10\nrefill_per_sec = 1.0\n";
        let e = err(key);
        assert!(
            e.contains("`tools.generate_image_to_video.cost`") && e.contains("`auth.keys[0].caller.burst` = 10"),
            "{e}"
        );
    }

    #[test]
    fn durations_past_a_day_are_refused_naming_the_key() {
        for (toml, key) in [
            ("[upstream]\ntimeout_ms = 86400001\n", "upstream.timeout_ms"),
            ("[upstream]\ntimeout_ms = 9223372036854775807\n", "upstream.timeout_ms"),
            ("[upstream]\nbreaker_cooldown_ms = 100000000\n", "upstream.breaker_cooldown_ms"),
            ("[upstream]\njob_expiry_seconds = 604801\n", "upstream.job_expiry_seconds"),
            ("[upstream]\nvideo_poll_seconds = 86401\n", "upstream.video_poll_seconds"),
            ("[store]\nlease_ms = 86400001\n", "store.lease_ms"),
            ("[store]\nsweep_interval_ms = 86400001\n", "store.sweep_interval_ms"),
            ("[loop_detection]\nwindow_ms = 86400001\n", "loop_detection.window_ms"),
            ("[mock_upstream]\nvideo_job_ms = 86400001\n", "mock_upstream.video_job_ms"),
        ] {
            let e = err(toml);
            assert!(e.contains(&format!("`{key}`")), "{toml}: {e}");
        }
        let week = Config::from_toml_test("[upstream]\njob_expiry_seconds = 604800\ntimeout_ms = 86400000\n");
        assert!(week.is_ok(), "a week's expiry and a day's timeout are the bounds themselves");
    }

    #[test]
    fn an_integer_too_large_for_toml_is_refused_naming_its_key() {
        let e = err("[upstream]\ntimeout_ms = 18446744073709551615\n");
        assert!(e.contains("`upstream.timeout_ms`") && e.contains("18446744073709551615"), "{e}");
        let e = err("[[limits.caller]]\nalgorithm = \"token_bucket\"\nburst = 99999999999999999999\n");
        assert!(e.contains("`limits.caller[0].burst`"), "{e}");
    }

    #[test]
    fn a_tier_that_stretches_a_bucket_past_what_redis_decides_exactly_is_named() {
        // A burst of 1 stays 1 for guests (× 0.5, rounded, never below one) while its rate halves.
        let e = err("[store]\nbackend = \"redis\"\n[limits.caller]\nburst = 1\nrefill_per_sec = 0.0000003\n\
                     [tools.list_articles]\ncost = 1\n[tools.save_article]\ncost = 1\n[tools.generate_image]\ncost = 1\n\
                     [tools.generate_image_to_video]\ncost = 1\n");
        assert!(e.contains("`limits.caller`") && e.contains("tiers.guest"), "{e}");
    }

    #[test]
    fn typos_are_rejected_not_ignored() {
        let e = err("[limits.caller]\nbrust = 10\n");
        assert!(e.contains("brust"), "{e}");
    }
}
