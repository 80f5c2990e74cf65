//! Typed configuration: defaults, layering and validation.
//!
//! Layers, last wins: the documented defaults (`config.toml` at the repository root, compiled
//! in), then the user's file, then `MCP_RL__SECTION__KEY` environment variables. Whatever the
//! layers say is validated before the server starts; every error names the key to fix.
//!
//! One file configures the limits and the server around them. This module reads the limits'
//! sections, each section's types and checks in a file of their own:
//!
//! | section | file |
//! | --- | --- |
//! | `[limits]` (every scope's limits, the in-flight caps) | `limits.rs` |
//! | `[tools.NAME]` (costs, own budgets, fail open or closed) and the checks that every cost fits | `tools.rs` |
//! | `[tools.NAME] cost` as a formula over the arguments, and `settle` | `price.rs` |
//! | `[auth]`, `[tiers]` | `auth.rs` |
//! | `[auth.oauth]` (callers known by OAuth tokens) | `oauth.rs` |
//! | `[spend_caps]`, `[tenants.NAME]` | `spend.rs` |
//! | `[store]`, `[loop_detection]` | `store.rs` |
//! | `[server]`'s keys that name callers behind a proxy | `trust.rs` |
//! | the checks across sections (costs that fit every budget, caps that cover them, spans a store decides exactly) | `fits.rs` |
//!
//! [`Document`] reads the layers; [`LimitsConfig::from_document`] checks the limits' sections in
//! turn. A server reads its own sections (`[server]`, `[upstream]`, `[admin]`, …) from the same
//! [`Document`]: the reference server's `Config` does.

mod auth;
mod fits;
mod limits;
mod oauth;
pub mod price;
mod shed;
mod spend;
mod store;
mod tools;
mod trust;

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;
use serde::de::DeserializeOwned;

pub use auth::{ApiKey, AuthConfig};
pub use limits::{DAY_MS, Limit, Limits, METHOD_GROUPS, Mode};
pub use oauth::OAuthConfig;
pub use price::{Formula, Settle};
pub use spend::{SpendCaps, TenantOverride};
pub use store::{Backend, LoopDetectionConfig, StoreConfig};
pub use tools::{Coalesce, Fail, ToolPolicy};
pub use trust::ProxyTrust;

/// The documented defaults, the base layer under every config.
pub const DEFAULT_TOML: &str = include_str!("../../../../config.toml");

/// The tools a server offers, as its limits must know them: each tool's name, and whether a call
/// of it holds in-flight slots for as long as its admission lives (a job, until it is final).
///
/// The limits know no tools of their own: a server builds its catalogue from its tool router at
/// start-up and passes it down, and a config is checked against it (`[tools.NAME]` must name a
/// tool, and every tool needs a cost).
///
/// ```
/// use mcp_ratelimit_core::config::Catalogue;
///
/// let tools = Catalogue::new().tool("search").job("render_video");
/// assert!(tools.contains("search") && !tools.holds_slots("search"));
/// assert!(tools.holds_slots("render_video"));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Catalogue {
    /// Tool name → what kind of tool it is.
    tools: BTreeMap<String, ToolKind>,
    /// Tool name → the arguments it takes, where known (a price formula may read only those).
    arguments: BTreeMap<String, Vec<String>>,
    /// The tools are learnt at run time (see [`Catalogue::learned`]).
    learned: bool,
}

impl Catalogue {
    /// An empty catalogue.
    pub fn new() -> Self {
        Self::default()
    }

    /// A catalogue whose tools are learnt at run time, as a proxy learns them from the `tools/list`
    /// of the server behind it: `[tools.NAME]` may name a tool not listed yet (the list changes),
    /// and a tool it does not price costs `proxy.default_cost`
    /// ([`LimitsConfig::unlisted_tools`]).
    ///
    /// ```
    /// use mcp_ratelimit_core::config::{Catalogue, LimitsConfig};
    ///
    /// let limits = LimitsConfig::from_toml("[proxy]\ndefault_cost = 3\n[tools.render]\ncost = 9\n", &Catalogue::learned())?;
    /// assert_eq!(limits.tools["render"].cost, 9);
    /// assert_eq!(limits.unlisted_tools.map(|t| t.cost), Some(3));
    /// # Ok::<(), mcp_ratelimit_core::config::ConfigError>(())
    /// ```
    pub fn learned() -> Self {
        Self { tools: BTreeMap::new(), arguments: BTreeMap::new(), learned: true }
    }

    /// Whether the tools are learnt at run time.
    pub fn is_learned(&self) -> bool {
        self.learned
    }

    /// With a tool that answers and is done: its admission is released when the call returns.
    pub fn tool(mut self, name: impl Into<String>) -> Self {
        self.tools.insert(name.into(), ToolKind::Answers);
        self
    }

    /// With a tool whose calls hold one slot of the caller's and the tenant's in-flight caps
    /// (`limits.in_flight`) for as long as their admission lives.
    pub fn job(mut self, name: impl Into<String>) -> Self {
        self.tools.insert(name.into(), ToolKind::Job);
        self
    }

    /// With a tool whose answer is the caller's own (its jobs, its budgets): two callers asking
    /// the same get different answers, so `[tools.NAME] coalesce` and `cache_ttl_ms` are refused
    /// for it.
    pub fn own_answer(mut self, name: impl Into<String>) -> Self {
        self.tools.insert(name.into(), ToolKind::OwnAnswer);
        self
    }

    /// With the arguments `name` takes: a `[tools.NAME] cost` formula reading another is refused.
    pub fn arguments(
        mut self,
        name: impl Into<String>,
        arguments: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        self.arguments.insert(name.into(), arguments.into_iter().map(Into::into).collect());
        self
    }

    /// The arguments `name` takes, if the catalogue knows them.
    pub fn arguments_of(&self, name: &str) -> Option<&[String]> {
        self.arguments.get(name).map(Vec::as_slice)
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
        self.tools.get(name) == Some(&ToolKind::Job)
    }

    /// Whether `name` answers with the caller's own state ([`Catalogue::own_answer`]).
    pub fn answers_for_the_caller(&self, name: &str) -> bool {
        self.tools.get(name) == Some(&ToolKind::OwnAnswer)
    }

    fn listed(&self) -> String {
        if self.tools.is_empty() {
            return "none".to_owned();
        }
        self.names().collect::<Vec<_>>().join(", ")
    }
}

/// What a tool of a [`Catalogue`] is, as the limits must know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ToolKind {
    /// Answers and is done.
    Answers,
    /// Holds in-flight slots for as long as its admission lives.
    Job,
    /// Answers with the caller's own state.
    OwnAnswer,
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

impl ConfigError {
    /// The same fault, named at `key` (a check shared by two keys reports the one the user wrote).
    pub fn at(self, key: &str) -> Self {
        match self {
            ConfigError::Invalid { message, .. } => ConfigError::Invalid { key: key.to_owned(), message },
            load => load,
        }
    }
}

/// A value that is well-typed but not acceptable, at `key`.
pub fn invalid(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { key: key.into(), message: message.into() }
}

/// The limits' configuration, which is all `RateLimits` and the
/// [`Guard`](crate::guard::Guard) read: `[limits]`, `[tools.NAME]`, `[auth]`, `[tiers]`,
/// `[spend_caps]`, `[tenants.NAME]`, `[store]`, `[loop_detection]`, and the two `[server]` keys
/// that name callers behind a proxy. It is read from the same file as the server's, under the
/// same keys.
///
/// ```
/// use mcp_ratelimit_core::config::{Catalogue, LimitsConfig};
///
/// let tools = Catalogue::new().tool("search");
/// let limits = LimitsConfig::from_toml("[tools.search]\ncost = 2\n", &tools)?;
/// assert_eq!(limits.tools["search"].cost, 2);
/// # Ok::<(), mcp_ratelimit_core::config::ConfigError>(())
/// ```
#[derive(Debug, Clone)]
pub struct LimitsConfig {
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
    /// Each tool's cost and optional own budget; every tool of the catalogue has an entry.
    pub tools: BTreeMap<String, ToolPolicy>,
    /// The policy of a tool `tools` does not name, when the catalogue is learnt at run time
    /// ([`Catalogue::learned`]: it costs `proxy.default_cost`); `None` for a fixed catalogue.
    pub unlisted_tools: Option<ToolPolicy>,
    /// Where the state lives, and its housekeeping.
    pub store: StoreConfig,
    /// Stuck agents repeating the same call.
    pub loop_detection: LoopDetectionConfig,
    /// Whose `X-Forwarded-For` names the caller.
    pub proxies: ProxyTrust,
    /// How many answers may be kept for identical calls (`upstream.cache_max_entries`,
    /// `upstream.cache_max_bytes`), all tools and scopes together.
    pub answers: AnswerBounds,
    /// When the server counts as behind, and whom it refuses first (`[server.shedding]`, the
    /// ranks of `[upstream.priority]`).
    pub shedding: shed::Shedding,
}

/// The bounds of the answers kept for `[tools.NAME] cache_ttl_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AnswerBounds {
    /// Answers kept at most; past it the oldest makes room.
    pub max_entries: usize,
    /// Bytes of their JSON kept at most.
    pub max_bytes: u64,
}

/// Every section of the one config file: the limits' (read here) and the server's around them
/// (read by the server from the same [`Document`]). A section not named here is a typo.
pub const SECTIONS: [&str; 14] = [
    "server",
    "auth",
    "tiers",
    "limits",
    "spend_caps",
    "tenants",
    "tools",
    "upstream",
    "store",
    "loop_detection",
    "mock_upstream",
    "admin",
    "proxy",
    "telemetry",
];

/// Keys whose environment override is a comma-separated list.
const LIST_KEYS: [&str; 6] = [
    "server.allowed_hosts",
    "server.allowed_origins",
    "server.trusted_proxies",
    "proxy.inherit_env",
    "auth.oauth.algorithms",
    "auth.oauth.scopes_required",
];

/// The config file as read, layers merged, before any section is checked: the documented
/// defaults, then the user's file, then `MCP_RL__SECTION__KEY` environment variables (last wins).
/// Each layer built on it reads its own sections ([`Document::section`]).
#[derive(Clone)]
pub struct Document(config::Config);

/// Only the sections' names: the values may hold secrets (a Redis password, API keys).
impl std::fmt::Debug for Document {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sections = self.0.clone().try_deserialize::<config::Map<String, config::Value>>().unwrap_or_default();
        f.debug_struct("Document").field("sections", &sections.keys().collect::<Vec<_>>()).finish_non_exhaustive()
    }
}

impl Document {
    /// The defaults, then `file` (required when given, else `./config.toml` if present), then
    /// the environment; `[tools]` of the defaults kept only for the tools of `tools`.
    pub fn load(file: Option<&Path>, tools: &Catalogue) -> Result<Self, ConfigError> {
        let mut env = config::Environment::with_prefix("MCP_RL")
            .prefix_separator("__")
            .separator("__")
            .try_parsing(true)
            .list_separator(",");
        for key in LIST_KEYS {
            env = env.with_list_parse_key(key);
        }
        let path = file.unwrap_or(Path::new("config.toml"));
        if let Ok(text) = std::fs::read_to_string(path) {
            integer_too_large(&text)?;
        }
        let builder = Self::defaults_for(tools)?;
        let builder = match file {
            Some(path) => builder.add_source(config::File::from(path).format(config::FileFormat::Toml).required(true)),
            None => builder.add_source(
                config::File::from(Path::new("config.toml")).format(config::FileFormat::Toml).required(false),
            ),
        };
        Self::checked(builder.add_source(env).build()?)
    }

    /// The defaults plus `toml`, without the environment (for tests and embedding).
    pub fn from_toml(toml: &str, tools: &Catalogue) -> Result<Self, ConfigError> {
        integer_too_large(toml)?;
        Self::checked(
            Self::defaults_for(tools)?.add_source(config::File::from_str(toml, config::FileFormat::Toml)).build()?,
        )
    }

    /// The sections of the document as `T` reads them (a section `T` does not name is left to
    /// whoever reads it).
    pub fn section<T: DeserializeOwned>(&self) -> Result<T, ConfigError> {
        Ok(self.0.clone().try_deserialize::<T>()?)
    }

    /// Refuses a section no layer reads, naming it.
    fn checked(document: config::Config) -> Result<Self, ConfigError> {
        let table = document.clone().try_deserialize::<config::Map<String, config::Value>>()?;
        if let Some(unknown) = table.keys().find(|key| !SECTIONS.contains(&key.as_str())) {
            return Err(invalid(unknown.as_str(), format!("unknown section, expected one of {}", SECTIONS.join(", "))));
        }
        Ok(Self(document))
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
}

impl LimitsConfig {
    /// The documented defaults plus `toml`, checked against `tools`; the server's sections are
    /// left to the server.
    pub fn from_toml(toml: &str, tools: &Catalogue) -> Result<Self, ConfigError> {
        Self::from_document(&Document::from_toml(toml, tools)?, tools)
    }

    /// The layers [`Document::load`] reads (the defaults, `file` or `./config.toml`, then
    /// `MCP_RL__SECTION__KEY` variables), checked against `tools`.
    pub fn load(file: Option<&Path>, tools: &Catalogue) -> Result<Self, ConfigError> {
        Self::from_document(&Document::load(file, tools)?, tools)
    }

    /// The limits' sections of `document`, each checked, in the order a reader meets them; the
    /// first error names its key.
    pub fn from_document(document: &Document, catalogue: &Catalogue) -> Result<Self, ConfigError> {
        document.section::<RawLimitsConfig>()?.validate(catalogue)
    }
}

/// The sections the limits read, and the few keys of the server's they depend on.
#[derive(Debug, Deserialize)]
struct RawLimitsConfig {
    auth: auth::RawAuth,
    tiers: BTreeMap<String, f64>,
    limits: limits::RawLimits,
    spend_caps: spend::RawSpendCaps,
    #[serde(default)]
    tenants: BTreeMap<String, spend::RawTenant>,
    #[serde(default)]
    tools: BTreeMap<String, tools::RawTool>,
    store: StoreConfig,
    loop_detection: LoopDetectionConfig,
    server: RawServerPart,
    upstream: RawAnswerBounds,
    proxy: RawUnlisted,
}

/// The keys of `[server]` the limits read: those naming callers behind a proxy, and
/// `[server.shedding]`.
#[derive(Debug, Deserialize)]
struct RawServerPart {
    #[serde(flatten)]
    trust: trust::RawTrust,
    shedding: shed::RawShedding,
}

/// `upstream.cache_max_entries` and `upstream.cache_max_bytes`: the bounds of the kept answers;
/// `[upstream.priority]`: the ranks the server sheds by (the server checks it names known tiers).
#[derive(Debug, Deserialize)]
struct RawAnswerBounds {
    cache_max_entries: usize,
    cache_max_bytes: u64,
    #[serde(default)]
    priority: BTreeMap<String, i64>,
}

/// `proxy.default_cost`: what a tool the config does not price costs when tools are learnt.
#[derive(Debug, Deserialize)]
struct RawUnlisted {
    default_cost: u64,
}

impl RawLimitsConfig {
    fn validate(self, catalogue: &Catalogue) -> Result<LimitsConfig, ConfigError> {
        auth::validate_tiers(&self.tiers)?;
        let limits = self.limits.validate()?;
        let tools = tools::validate_tools(self.tools, catalogue, &limits, &self.tiers)?;
        let auth = self.auth.validate(&self.tiers)?;
        let spend_caps = self.spend_caps.validate()?;
        let tenants = spend::validate_tenants(self.tenants)?;
        fits::caps_cover_costs(&spend_caps, &tenants, &tools)?;
        let shared = (self.store.backend == Backend::Redis).then_some(self.store.expected_instances);
        fits::costs_fit(&tools, &self.tiers, &limits, &tenants, &auth.keys, &spend_caps, shared)?;
        let unlisted_tools = catalogue.is_learned().then(|| ToolPolicy::unlisted(self.proxy.default_cost));
        if let Some(unlisted) = &unlisted_tools {
            // The default price is checked as a tool of its own, and a fault named at its key.
            let priced = BTreeMap::from([(tools::UNPRICED.to_owned(), unlisted.clone())]);
            fits::caps_cover_costs(&spend_caps, &tenants, &priced)
                .and_then(|()| {
                    fits::costs_fit(&priced, &self.tiers, &limits, &tenants, &auth.keys, &spend_caps, shared)
                })
                .map_err(|e| e.at("proxy.default_cost"))?;
        }
        let proxies = self.server.trust.validate()?;
        let shedding = self.server.shedding.validate(self.upstream.priority.clone())?;
        self.store.validate()?;
        fits::spans_fit((&limits, &tools, &tenants, &auth.keys), &self.tiers, &fits::LONGEST)?;
        if self.store.backend == Backend::Redis {
            fits::spans_fit_redis(&limits, &tools, &tenants, &auth.keys, &self.tiers)?;
        }
        self.loop_detection.validate()?;
        for (key, value) in [
            ("upstream.cache_max_entries", self.upstream.cache_max_entries as u64),
            ("upstream.cache_max_bytes", self.upstream.cache_max_bytes),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be greater than zero"));
            }
        }
        Ok(LimitsConfig {
            auth,
            tiers: self.tiers,
            limits,
            spend_caps,
            tenants,
            tools,
            unlisted_tools,
            store: self.store,
            loop_detection: self.loop_detection,
            proxies,
            answers: AnswerBounds {
                max_entries: self.upstream.cache_max_entries,
                max_bytes: self.upstream.cache_max_bytes,
            },
            shedding,
        })
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_raw_limits_sections_print_no_secret() {
        let toml = "[store]\nredis_url = \"redis://:redis-pw-hush@h:1,redis://:other-pw-hush@g:2\"\n\
                    [auth]\nid_secret = \"id-secret-hush-01234\"\n\
                    [[auth.keys]]\nkey = \"plain-key-hush\"\n[[auth.keys]]\nsha256 = \"ab12cd34\"\n";
        let document = Document::from_toml(toml, &Catalogue::new()).expect("reads");
        let raw = document.section::<RawLimitsConfig>().expect("the limits' sections");
        for printed in [format!("{raw:?}"), format!("{raw:#?}"), format!("{document:?}")] {
            assert!(!printed.contains("hush") && !printed.contains("ab12cd34"), "{printed}");
        }
        assert!(format!("{raw:?}").contains("redis://***@h:1,redis://***@g:2"), "{raw:?}");
        assert!(format!("{raw:?}").contains("RawKey"), "{raw:?}");
    }

    #[test]
    fn a_section_nobody_reads_is_named() {
        let e = LimitsConfig::from_toml("[limts.caller]\nburst = 3\n", &Catalogue::new()).expect_err("a typo");
        assert!(e.to_string().contains("`limts`") && e.to_string().contains("unknown section"), "{e}");
    }
}
