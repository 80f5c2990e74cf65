//! The limits as a library: one handle that gives every caller of your rmcp server (or of any
//! axum app) a budget, charges each tool its cost, caps calls in flight, and explains every
//! refusal in words an agent can act on.
//!
//! Build a [`RateLimits`] from a config ([`RateLimits::from_toml`], or a [`LimitsConfig`] you load or
//! change in code) and the [`Catalogue`] of your tools, then use it in one or both places:
//! - around your tools: [`LimitedRouter`](crate::limited::LimitedRouter) wraps an rmcp
//!   `ToolRouter`, so `#[tool_handler(router = self.tools)]` guards every call;
//! - in front of HTTP: [`RateLimits::http_layer`] names each caller and charges its coarse HTTP
//!   budget, answering 429 with `Retry-After` and the RateLimit headers.
//!
//! ```
//! use mcp_ratelimit_rmcp::config::Catalogue;
//! use mcp_ratelimit_rmcp::RateLimits;
//!
//! # tokio_test_block_on(async {
//! let tools = Catalogue::new().tool("search").job("render");
//! let limits = RateLimits::from_toml(
//!     r#"
//!     [limits.caller]
//!     algorithm = "token_bucket"
//!     burst = 10
//!     refill_per_sec = 0.5
//!
//!     [tools.search]
//!     cost = 1
//!
//!     [tools.render]
//!     cost = 5
//!     "#,
//!     tools,
//! )
//! .await?;
//! assert!(limits.guard().enabled());
//! # Ok::<(), mcp_ratelimit_rmcp::rate_limits::LimitsError>(())
//! # }).unwrap();
//! # fn tokio_test_block_on<F: std::future::Future>(f: F) -> F::Output {
//! #     tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(f)
//! # }
//! ```
//!
//! The limits run on their own: idle state is swept, and over Redis in-flight leases are renewed
//! and operators' resets heard, in tasks that stop when the last clone of the handle is dropped.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio_util::sync::CancellationToken;

use crate::http::front_door::{CheckLayer, Checked};
use crate::http::identify::{Callers, IdentifyLayer, RefuseInvalidTokens, refuse_invalid_tokens};
use crate::http::limit::HttpLimitLayer;
use crate::raw::RawResult;
use mcp_ratelimit_core::clock::{SharedClock, SystemClock};
use mcp_ratelimit_core::config::{Backend, Catalogue, ConfigError, LimitsConfig};
use mcp_ratelimit_core::guard::reuse::Reuse;
use mcp_ratelimit_core::guard::{Guard, Worked};
use mcp_ratelimit_core::identity::Identifier;
use mcp_ratelimit_core::ops::metrics::Metrics;
use mcp_ratelimit_core::store::{MemoryStore, Store, StoreError};

/// What a tool answers: its response (a result, a task, an input request) in rmcp's types, or a
/// JSON-RPC error; or another server's result as it sent it ([`RawResult`], the proxy's relay
/// lane); what identical calls share ([`RateLimits::reuse`]). How the one guarded call reads it is
/// its [`Answer`](mcp_ratelimit_core::guard::Answer) (in [`crate::limited`]).
#[derive(Debug, Clone)]
pub struct ToolAnswer {
    said: Said,
    relayed: bool,
}

/// An answer, in rmcp's types or as another server sent it.
#[derive(Debug, Clone)]
pub enum Said {
    /// In rmcp's types.
    Typed(Result<rmcp::model::CallToolResponse, rmcp::ErrorData>),
    /// Another server's result as it came.
    Raw(RawResult),
}

impl ToolAnswer {
    /// The answer of one of this server's own tools.
    pub fn new(response: Result<rmcp::model::CallToolResponse, rmcp::ErrorData>) -> Self {
        Self { said: Said::Typed(response), relayed: false }
    }

    /// Another server's answer, relayed (the proxy's): its usage is believed only from its
    /// `_meta` (its `structuredContent` may echo the caller's own arguments), and an `isError`
    /// result is its own, never read as a refusal of ours.
    pub fn relayed(response: Result<rmcp::model::CallToolResponse, rmcp::ErrorData>) -> Self {
        Self { said: Said::Typed(response), relayed: true }
    }

    /// Another server's result as it sent it, relayed ([`ToolAnswer::relayed`]).
    pub fn relayed_raw(result: RawResult) -> Self {
        Self { said: Said::Raw(result), relayed: true }
    }

    /// The answer as it is held.
    pub fn said(&self) -> &Said {
        &self.said
    }

    /// Whether it is another server's ([`ToolAnswer::relayed`]).
    pub fn is_relayed(&self) -> bool {
        self.relayed
    }

    /// The response, as rmcp answers it (a raw result read into rmcp's types).
    pub fn into_response(self) -> Result<rmcp::model::CallToolResponse, rmcp::ErrorData> {
        match self.said {
            Said::Typed(response) => response,
            Said::Raw(raw) => raw.to_response(),
        }
    }

    /// The answer as it is held.
    pub fn into_said(self) -> Said {
        self.said
    }
}

/// Why limits could not be built.
#[derive(Debug, thiserror::Error)]
pub enum LimitsError {
    /// The config does not load or validate (the message names the key).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// `store.redis_ca_file` cannot be used.
    #[error("`store.redis_ca_file`: {0}")]
    RedisCa(String),
    /// The shared limiter store did not answer.
    #[error("the limiter store: {0}")]
    Store(#[from] StoreError),
    /// `store.backend` names a backend this build does not have.
    #[error("`store.backend`: \"{0}\" needs the feature `{0}` of mcp-ratelimit-rmcp")]
    NoBackend(&'static str),
    /// `[auth.oauth]` is on in a build without the feature `oauth`.
    #[error("`auth.oauth.issuer`: OAuth tokens need the feature `oauth` of mcp-ratelimit-rmcp")]
    NoOAuth,
    /// The access-token verifier could not be made.
    #[cfg(feature = "oauth")]
    #[error(transparent)]
    OAuth(#[from] crate::oauth::VerifierError),
}

/// The verifier `config` asks for (none while `[auth.oauth]` is off), its keys fetched.
#[cfg(feature = "oauth")]
async fn token_verifier(
    config: &LimitsConfig,
    clock: &SharedClock,
    metrics: &Arc<Metrics>,
) -> Result<Option<Arc<crate::oauth::TokenVerifier>>, LimitsError> {
    if !config.auth.oauth.enabled() {
        return Ok(None);
    }
    if config.auth.oauth.audience.is_empty() {
        // stdio has no use for tokens; over HTTP every token is refused 503 until it is set.
        tracing::warn!(target: "mcp_ratelimit::rate_limits", "[auth.oauth] is on without an audience: access tokens are refused until auth.oauth.audience is set");
        return Ok(None);
    }
    let verifier = crate::oauth::TokenVerifier::new(&config.auth.oauth, clock.clone(), metrics.clone())?;
    verifier.start().await;
    Ok(Some(Arc::new(verifier)))
}

/// The Redis store `config.store` names, connected.
#[cfg(feature = "redis")]
async fn redis_store(config: &LimitsConfig, clock: &SharedClock) -> Result<Arc<dyn Store>, LimitsError> {
    let timeout = Duration::from_millis(config.store.timeout_ms);
    let lease = Duration::from_millis(config.store.lease_ms);
    let ca = config.store.redis_ca().map_err(LimitsError::RedisCa)?;
    let redis = crate::redis::RedisStore::connect_trusting(&config.store.redis_url, timeout, ca).await?;
    let slices =
        crate::redis::SliceRules { most: config.store.slice_max, lasts: Duration::from_millis(config.store.slice_ms) };
    Ok(redis.with_lease(lease).with_slices(slices, clock.clone()).shared())
}

/// Without the feature `redis`, a config that names it is refused when the limits start.
#[cfg(not(feature = "redis"))]
async fn redis_store(_config: &LimitsConfig, _clock: &SharedClock) -> Result<Arc<dyn Store>, LimitsError> {
    Err(LimitsError::NoBackend("redis"))
}

/// Everything that decides: the guard (budgets, costs, in-flight caps, loops), who callers are,
/// the metrics, and the tools they are for. Cheap to clone: clones share one state.
#[derive(Debug, Clone)]
pub struct RateLimits {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    guard: Arc<Guard>,
    callers: Callers,
    /// `[auth.oauth]` as the verifier in force was made from (a reload keeps it while it is the same).
    oauth: std::sync::Mutex<mcp_ratelimit_core::config::OAuthConfig>,
    metrics: Arc<Metrics>,
    catalogue: Catalogue,
    clock: SharedClock,
    /// Identical calls in flight sharing one piece of work, and answers kept for them.
    reuse: Arc<Reuse<Worked<ToolAnswer>>>,
    stop: CancellationToken,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl RateLimits {
    /// The documented defaults plus `toml`, for the tools of `tools`, on the system clock.
    pub async fn from_toml(toml: &str, tools: Catalogue) -> Result<Self, LimitsError> {
        let config = LimitsConfig::from_toml(toml, &tools)?;
        Self::start(&config, tools, SystemClock::shared()).await
    }

    /// The limits of `config` (checked against `tools`, as [`LimitsConfig::load`] did), with their
    /// state where `store.backend` says (connecting to Redis when it says so), on `clock`.
    ///
    /// A config can be changed in code before it is used, and a call run through the one guarded
    /// call ([`Guard::call`]) without MCP at all: the door is [`Plain`](crate::guard::Plain) (it
    /// adds nothing), the work is the tool, and its answer says nothing of its usage (here on a
    /// manual clock, so the wait is exact):
    ///
    /// ```
    /// use mcp_ratelimit_rmcp::clock::ManualClock;
    /// use mcp_ratelimit_rmcp::config::{Catalogue, Limit, LimitsConfig};
    /// use mcp_ratelimit_rmcp::guard::{Answer, Call, Called, Plain, Worked};
    /// use mcp_ratelimit_rmcp::limit::{Limiter, TokenBucket};
    /// use mcp_ratelimit_rmcp::RateLimits;
    ///
    /// /// A search's results: every method of `Answer` has a default.
    /// #[derive(Debug, Clone, PartialEq)]
    /// struct Results(String);
    ///
    /// impl Answer for Results {}
    ///
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// let tools = Catalogue::new().tool("search");
    /// let mut config = LimitsConfig::from_toml("[tools.search]\ncost = 1\n", &tools)?;
    /// // Three calls at once, then one every two seconds.
    /// config.limits.caller = vec![Limit::enforced(Limiter::TokenBucket(TokenBucket::new(3, 0.5)))];
    /// let clock = ManualClock::new();
    /// let limits = RateLimits::start(&config, tools, clock.clone()).await?;
    ///
    /// let caller = limits.identifier().load().local();
    /// for query in ["a", "b", "c", "d"] {
    ///     let mut args = serde_json::Map::new();
    ///     args.insert("q".into(), query.into());
    ///     let call = Call::new("search", &caller, &args);
    ///     let work = |_, _: &serde_json::Value| async move { Worked::Answer(Results(format!("for {query}"))) };
    ///     match limits.guard().call(&Plain, None, call, work).await {
    ///         Called::Answered { answer, .. } => assert_eq!(answer, Results(format!("for {query}"))),
    ///         Called::Refused(refusal) => {
    ///             assert_eq!(query, "d");
    ///             assert_eq!(refusal.retry_after_ms, Some(2_000));
    ///             assert!(refusal.message.contains("Wait 2 seconds"));
    ///         }
    ///         other => panic!("{other:?}"),
    ///     }
    /// }
    /// # Ok::<(), mcp_ratelimit_rmcp::rate_limits::LimitsError>(())
    /// # }).unwrap();
    /// ```
    pub async fn start(config: &LimitsConfig, tools: Catalogue, clock: SharedClock) -> Result<Self, LimitsError> {
        let store: Arc<dyn Store> = match config.store.backend {
            Backend::Memory => Arc::new(MemoryStore::on(clock.clone())),
            Backend::Redis => redis_store(config, &clock).await?,
        };
        let metrics = Arc::new(Metrics::new(&tools));
        let shared = store.is_shared();
        let mut guard = Guard::new(store, clock.clone(), config, metrics.clone());
        if shared {
            guard = guard.insured_by(Arc::new(MemoryStore::on(clock.clone())), config);
        }
        let guard = Arc::new(guard);
        let stop = CancellationToken::new();
        let (entries, bytes) = (config.answers.max_entries, config.answers.max_bytes);
        let reuse = Reuse::new(clock.clone(), metrics.clone(), entries, bytes);
        let every = Duration::from_millis(config.store.sweep_interval_ms);
        tokio::spawn(sweep_forever(guard.clone(), reuse.clone(), every, stop.clone()));
        if let Some(every) = guard.store().renew_every() {
            tokio::spawn(renew_forever(guard.clone(), every, stop.clone()));
            tokio::spawn(hear_operators_forever(guard.clone(), stop.clone()));
        }
        let identifier = Arc::new(ArcSwap::from_pointee(Identifier::new(config)));
        #[cfg(feature = "oauth")]
        let callers = Callers::with_tokens(
            identifier,
            Arc::new(arc_swap::ArcSwapOption::new(token_verifier(config, &clock, &metrics).await?)),
        );
        #[cfg(not(feature = "oauth"))]
        let callers = match config.auth.oauth.enabled() {
            true => return Err(LimitsError::NoOAuth),
            false => Callers::new(identifier),
        };
        #[cfg(feature = "oauth")]
        tokio::spawn(refresh_keys_forever(callers.tokens().clone(), stop.clone()));
        let oauth = std::sync::Mutex::new(config.auth.oauth.clone());
        let inner = Inner { guard, callers, oauth, metrics, catalogue: tools, clock, reuse, stop };
        Ok(Self { inner: Arc::new(inner) })
    }

    /// Decides every call: [`Guard::call`] for a tool call (the one guarded call every door runs),
    /// [`Guard::admit_http`] for a request.
    pub fn guard(&self) -> &Arc<Guard> {
        &self.inner.guard
    }

    /// Names callers from a request's headers and address (swapped whole by [`RateLimits::reload`]).
    pub fn identifier(&self) -> &Arc<ArcSwap<Identifier>> {
        self.inner.callers.identifier()
    }

    /// Names callers: [`RateLimits::identifier`] and, with `[auth.oauth]`, the access tokens.
    pub fn callers(&self) -> &Callers {
        &self.inner.callers
    }

    /// What the limits decided, for a `/metrics` route ([`Metrics::render`]).
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.inner.metrics
    }

    /// The tools the limits are for.
    pub fn catalogue(&self) -> &Catalogue {
        &self.inner.catalogue
    }

    /// The clock every decision reads.
    pub fn clock(&self) -> &SharedClock {
        &self.inner.clock
    }

    /// Identical tool calls in flight sharing one piece of work, and the answers kept for them
    /// (`[tools.NAME] coalesce`, `cache_ttl_ms`): every door's, through the one guarded call.
    pub fn reuse(&self) -> &Arc<Reuse<Worked<ToolAnswer>>> {
        &self.inner.reuse
    }

    /// Puts the limits, keys and tenants of `config` in force from the next decision on; usage
    /// carries over (see [`Guard::reload`]). A changed `[auth.oauth]` gets a new verifier, which
    /// fetches the issuer's keys in the background; an unchanged one keeps its keys and the
    /// tokens it verified.
    pub fn reload(&self, config: &LimitsConfig) {
        if self.identifier().load().ids() != &mcp_ratelimit_core::identity::CallerIds::of(config) {
            // Every budget hangs on a caller id: new ids are new, full budgets.
            tracing::warn!(target: "mcp_ratelimit::rate_limits", "auth.id_secret changed: every key's caller id is new, so its budgets start afresh");
        }
        self.inner.guard.reload(config);
        // Slices of a shared store's budgets were cut under the old limits: back they go.
        let store = self.inner.guard.store().clone();
        tokio::spawn(async move { store.give_back_held().await });
        self.identifier().store(Arc::new(Identifier::new(config)));
        let mut oauth = self.inner.oauth.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if *oauth != config.auth.oauth {
            *oauth = config.auth.oauth.clone();
            self.renew_tokens(config);
        }
    }

    #[cfg(feature = "oauth")]
    fn renew_tokens(&self, config: &LimitsConfig) {
        let tokens = self.inner.callers.tokens().clone();
        if !config.auth.oauth.enabled() {
            tokens.store(None);
            return;
        }
        match crate::oauth::TokenVerifier::new(&config.auth.oauth, self.inner.clock.clone(), self.inner.metrics.clone())
        {
            Ok(verifier) => {
                let verifier = Arc::new(verifier);
                tokens.store(Some(verifier.clone()));
                tokio::spawn(async move { verifier.start().await });
            }
            Err(error) => {
                tracing::error!(target: "mcp_ratelimit::rate_limits", %error, "[auth.oauth] changed but cannot be used: tokens are refused until it can");
                tokens.store(None);
            }
        }
    }

    #[cfg(not(feature = "oauth"))]
    fn renew_tokens(&self, config: &LimitsConfig) {
        if config.auth.oauth.enabled() {
            tracing::error!(target: "mcp_ratelimit::rate_limits", "{}", LimitsError::NoOAuth);
        }
    }

    /// The tower layer for an axum app: names each caller ([`IdentifyLayer`]: its key's hash,
    /// else its address; 401 when `auth.required` and the key is unknown), then charges its coarse
    /// HTTP budget (`limits.http`) for every `POST` ([`HttpLimitLayer`]: 429 with `Retry-After`
    /// and the RateLimit headers). Serve the app with `into_make_service_with_connect_info` so
    /// callers without a key are told apart by address.
    pub fn http_layer(&self) -> HttpLayer {
        HttpLayer {
            identify: IdentifyLayer::new(self.inner.callers.clone(), self.inner.clock.clone()),
            limit: HttpLimitLayer::new(self.inner.guard.clone()),
            refuse: refuse_invalid_tokens(),
        }
    }

    /// Gives back whatever this instance holds of a shared store's budgets (its slices), waiting
    /// at most two seconds: before the process exits.
    pub async fn give_back_held(&self) {
        let store = self.inner.guard.store().give_back_held();
        let _ = tokio::time::timeout(Duration::from_secs(2), store).await;
    }

    /// Stops the housekeeping tasks now rather than when the last clone is dropped.
    pub fn stop(&self) {
        self.inner.stop.cancel();
    }
}

/// [`IdentifyLayer`] around [`HttpLimitLayer`] around the refusal of invalid access tokens
/// (charged first as their address's unverified callers): what [`RateLimits::http_layer`] gives.
#[derive(Debug, Clone)]
pub struct HttpLayer {
    identify: IdentifyLayer,
    limit: HttpLimitLayer,
    refuse: CheckLayer<RefuseInvalidTokens>,
}

impl HttpLayer {
    /// Charges requests of every method, not only `POST`: for an HTTP API that is not MCP.
    pub fn every_method(self) -> Self {
        Self { limit: self.limit.every_method(), ..self }
    }
}

impl<S> tower::Layer<S> for HttpLayer {
    type Service = <IdentifyLayer as tower::Layer<
        <HttpLimitLayer as tower::Layer<Checked<S, RefuseInvalidTokens>>>::Service,
    >>::Service;

    fn layer(&self, inner: S) -> Self::Service {
        self.identify.layer(self.limit.layer(self.refuse.layer(inner)))
    }
}

/// Forgets idle limiter state on a schedule, so memory stays bounded however many callers come.
async fn sweep_forever(
    guard: Arc<Guard>,
    reuse: Arc<Reuse<Worked<ToolAnswer>>>,
    every: Duration,
    stop: CancellationToken,
) {
    mcp_ratelimit_core::clock::every(every, stop, || {
        let (keys, answers) = (guard.sweep(), reuse.sweep());
        if keys + answers > 0 {
            tracing::debug!(target: "mcp_ratelimit::rate_limits", keys, answers, "swept idle limiter state and answers past their time");
        }
        std::future::ready(())
    })
    .await;
}

/// Renews the in-flight leases this instance holds in a shared store (at least every 10 ms).
/// Every minute, the keys of the tokens in force fetched again once they are an hour old
/// ([`crate::oauth::KEYS_KEPT`]).
#[cfg(feature = "oauth")]
async fn refresh_keys_forever(tokens: crate::http::identify::Tokens, stop: CancellationToken) {
    mcp_ratelimit_core::clock::every(Duration::from_secs(60), stop, || {
        let verifier = tokens.load_full();
        async move {
            if let Some(verifier) = verifier {
                verifier.refresh_if_stale().await;
            }
        }
    })
    .await;
}

async fn renew_forever(guard: Arc<Guard>, every: Duration, stop: CancellationToken) {
    mcp_ratelimit_core::clock::every(every.max(Duration::from_millis(10)), stop, || async {
        if let Err(error) = guard.store().renew_leases().await {
            tracing::warn!(target: "mcp_ratelimit::rate_limits", %error, "could not renew in-flight leases");
        }
    })
    .await;
}

/// Forgets this instance's remembered refusals when an operator gave budget back through any
/// instance's admin API (see `operator`).
async fn hear_operators_forever(guard: Arc<Guard>, stop: CancellationToken) {
    let seen = std::sync::atomic::AtomicU64::new(0);
    mcp_ratelimit_core::clock::every(mcp_ratelimit_core::operator::HEAR_OPERATORS_EVERY, stop, || async {
        match guard.hear_operators(seen.load(std::sync::atomic::Ordering::Relaxed)).await {
            Ok(now) => seen.store(now, std::sync::atomic::Ordering::Relaxed),
            Err(error) => tracing::debug!(target: "mcp_ratelimit::rate_limits", %error, "could not read the operators' refunds and resets"),
        }
    })
    .await;
}
