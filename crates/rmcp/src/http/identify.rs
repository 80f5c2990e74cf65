//! Who calls: every request's [`Caller`], named before any limit is charged.
//!
//! A configured key names its caller at once; so does no key, or a made-up one (the address's
//! unverified caller). With `[auth.oauth]` on (feature `oauth`), a bearer token that is no
//! configured key is an access token, verified here ([`crate::oauth::TokenVerifier`]): usually
//! from what is at hand (a verification kept for the token, or the keys as fetched), else after
//! a fetch of the keys or an introspection, which only this request waits for.
//!
//! What a refused token costs: it is its address's unverified caller, so it goes on to be charged
//! as such by the HTTP limit ([`crate::http::limit`]) and is then answered 401 `invalid_token` by
//! [`refuse_invalid_tokens`], which is what makes a client fetch a new one. Nothing of the subject
//! it names is touched. A valid token without a required scope is answered 403 at once, and one
//! that cannot be verified now (the authorization server unreachable) 503 with `Retry-After`.
//!
//! Without a credential, with `auth.required` on, a request gets 401 at once; its
//! `WWW-Authenticate` names the Protected Resource Metadata when tokens are on, so MCP clients
//! know where to get one.

use std::net::SocketAddr;
use std::sync::Arc;
use std::task::{Context, Poll};

use arc_swap::ArcSwap;
use axum::extract::{ConnectInfo, Request};
use axum::response::Response;
use http::{HeaderMap, HeaderValue, StatusCode, header};
use tower::{Layer, Service};

use mcp_ratelimit_core::clock::SharedClock;
use mcp_ratelimit_core::guard::shed::Arrived;
use mcp_ratelimit_core::identity::{Caller, Identifier, Identity, Unauthorized};

use super::front_door::{CheckLayer, HeaderCheck, jsonrpc_error};

#[cfg(feature = "oauth")]
use crate::oauth::{Checked, ProtectedResource, Rejected, TokenVerifier};

/// The access tokens in force, if any (swapped whole by a reload that changes `[auth.oauth]`).
#[cfg(feature = "oauth")]
pub type Tokens = Arc<arc_swap::ArcSwapOption<TokenVerifier>>;

/// Names callers: configured keys and addresses (the [`Identifier`]) and, with `[auth.oauth]`,
/// access tokens. Cheap to clone.
#[derive(Clone)]
pub struct Callers {
    identifier: Arc<ArcSwap<Identifier>>,
    #[cfg(feature = "oauth")]
    tokens: Tokens,
}

impl std::fmt::Debug for Callers {
    /// The [`Identifier`] (which shows counts, never a key) and whether tokens are taken.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut out = f.debug_struct("Callers");
        out.field("identifier", &**self.identifier.load());
        #[cfg(feature = "oauth")]
        out.field("tokens", &self.tokens.load().is_some());
        out.finish()
    }
}

/// Why a request names no caller it may call as, and how to say so.
#[derive(Debug, Clone)]
pub struct Denied {
    /// 401, 403 or 503.
    pub status: StatusCode,
    /// What the request lacks, in words.
    pub message: String,
    /// `WWW-Authenticate`: where to get a token, and what was wrong with this one.
    pub challenge: HeaderValue,
    /// For a 503: how long to wait, in whole seconds.
    pub retry_after: Option<u64>,
}

impl Denied {
    /// The answer: a JSON-RPC error body with the challenge (and `Retry-After` for a 503).
    pub fn response(&self) -> Response {
        let mut response = jsonrpc_error(self.status, -32001, &self.message, None);
        response.headers_mut().insert(header::WWW_AUTHENTICATE, self.challenge.clone());
        if let Some(seconds) = self.retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(seconds.max(1)));
        }
        response
    }
}

/// A token refused as invalid: the request goes on as its address's unverified caller, to be
/// charged as one, and is answered 401 by [`refuse_invalid_tokens`].
#[derive(Debug, Clone)]
pub struct InvalidToken(Denied);

/// What naming a request came to without waiting.
enum Named {
    Caller(Caller),
    /// An access token refused as invalid: the caller it is charged as, and the answer.
    #[cfg_attr(not(feature = "oauth"), allow(dead_code))]
    Invalid(Caller, Denied),
    Denied(Denied),
    /// An access token to verify with a fetch or an introspection (held only while it is).
    #[cfg_attr(not(feature = "oauth"), allow(dead_code))]
    Later {
        token: String,
        digest: [u8; 32],
        unverified: Caller,
    },
}

impl Callers {
    /// Callers named by `identifier` alone: configured keys and addresses.
    pub fn new(identifier: Arc<ArcSwap<Identifier>>) -> Self {
        Self {
            identifier,
            #[cfg(feature = "oauth")]
            tokens: Arc::default(),
        }
    }

    /// Callers named by `identifier`, and access tokens verified by `tokens`.
    #[cfg(feature = "oauth")]
    pub fn with_tokens(identifier: Arc<ArcSwap<Identifier>>, tokens: Tokens) -> Self {
        Self { identifier, tokens }
    }

    /// The keys, tenants and addresses in force.
    pub fn identifier(&self) -> &Arc<ArcSwap<Identifier>> {
        &self.identifier
    }

    /// The access tokens in force.
    #[cfg(feature = "oauth")]
    pub fn tokens(&self) -> &Tokens {
        &self.tokens
    }

    /// The caller of a request with `headers` from `peer`, verifying its token if it has one to
    /// verify; or why it may not call (an invalid token included: here it is refused, not
    /// charged as its address's caller).
    pub async fn name(&self, headers: &HeaderMap, peer: Option<std::net::IpAddr>) -> Result<Caller, Denied> {
        match self.name_now(headers, peer) {
            Named::Caller(caller) => Ok(caller),
            Named::Invalid(_, denied) | Named::Denied(denied) => Err(denied),
            Named::Later { token, digest, unverified } => match self.verify(&token, digest, unverified).await {
                Named::Caller(caller) => Ok(caller),
                Named::Invalid(_, denied) | Named::Denied(denied) => Err(denied),
                Named::Later { .. } => Err(denied_later()),
            },
        }
    }

    /// What `headers` name without waiting.
    fn name_now(&self, headers: &HeaderMap, peer: Option<std::net::IpAddr>) -> Named {
        let identifier = self.identifier.load();
        match identifier.identify(headers, peer) {
            Ok(Identity::Caller(caller)) => Named::Caller(caller),
            Err(unauthorized) => Named::Denied(self.unauthorized(unauthorized)),
            Ok(Identity::Token { token, digest, unverified }) => self.token_now(&identifier, token, digest, unverified),
        }
    }

    #[cfg(feature = "oauth")]
    fn token_now(&self, identifier: &Identifier, token: &str, digest: [u8; 32], unverified: Caller) -> Named {
        let Some(verifier) = self.tokens.load_full() else { return Named::Denied(no_verifier()) };
        match verifier.check_now(token, &digest) {
            Checked::Now(checked) => named(identifier, &verifier, checked, unverified),
            Checked::Later => Named::Later { token: token.to_owned(), digest, unverified },
        }
    }

    /// Without the feature `oauth` no token can be verified (and `[auth.oauth]` cannot be on).
    #[cfg(not(feature = "oauth"))]
    fn token_now(&self, _: &Identifier, _: &str, _: [u8; 32], _: Caller) -> Named {
        Named::Denied(no_verifier())
    }

    #[cfg(feature = "oauth")]
    async fn verify(&self, token: &str, digest: [u8; 32], unverified: Caller) -> Named {
        let Some(verifier) = self.tokens.load_full() else { return Named::Denied(no_verifier()) };
        let checked = verifier.check(token, &digest).await;
        named(&self.identifier.load(), &verifier, checked, unverified)
    }

    #[cfg(not(feature = "oauth"))]
    async fn verify(&self, _: &str, _: [u8; 32], _: Caller) -> Named {
        Named::Denied(no_verifier())
    }

    /// 401 for a request without a usable credential, asking for a token where tokens are taken.
    fn unauthorized(&self, unauthorized: Unauthorized) -> Denied {
        #[cfg(feature = "oauth")]
        let challenge = self.tokens.load().as_ref().map(|v| v.resource().challenge(None));
        #[cfg(not(feature = "oauth"))]
        let challenge: Option<HeaderValue> = None;
        Denied {
            status: StatusCode::UNAUTHORIZED,
            message: format!("Unauthorized: {unauthorized}."),
            challenge: challenge.unwrap_or_else(|| HeaderValue::from_static("Bearer")),
            retry_after: None,
        }
    }
}

/// With `[auth.oauth]` on but no verifier in force (its audience was never set, or a reload
/// made it unusable): a token can be neither verified nor taken for anything, so the request is
/// refused, and the log says why.
fn no_verifier() -> Denied {
    Denied {
        status: StatusCode::SERVICE_UNAVAILABLE,
        message: "Access tokens cannot be verified: [auth.oauth] is on but not in force (is auth.oauth.audience set?)."
            .into(),
        challenge: HeaderValue::from_static("Bearer"),
        retry_after: Some(60),
    }
}

/// The answer of a verification that asked for another fetch (it never does: the second check
/// fetches itself). Kept as a refusal rather than a panic.
fn denied_later() -> Denied {
    Denied {
        status: StatusCode::SERVICE_UNAVAILABLE,
        message: "The access token could not be verified now.".into(),
        challenge: HeaderValue::from_static("Bearer"),
        retry_after: Some(1),
    }
}

/// What a checked token names: its subject, or the refusal, with the unverified caller an invalid
/// one is charged as.
#[cfg(feature = "oauth")]
fn named(
    identifier: &Identifier,
    verifier: &TokenVerifier,
    checked: Result<Arc<crate::oauth::Verified>, Rejected>,
    unverified: Caller,
) -> Named {
    let rejected = match checked {
        Ok(verified) if verified.scopes_ok() => match identifier.subject(verified.claims()) {
            Ok(caller) => return Named::Caller(caller),
            Err(_) => Rejected::NoSubject,
        },
        Ok(_) => Rejected::InsufficientScope,
        Err(rejected) => rejected,
    };
    let denied = Denied {
        status: ProtectedResource::status_of(&rejected),
        message: format!("Unauthorized: {rejected}."),
        challenge: verifier.resource().challenge(Some(&rejected)),
        retry_after: match rejected {
            Rejected::Unavailable(wait) => Some(mcp_ratelimit_core::clock::ceil_secs(wait)),
            _ => None,
        },
    };
    if denied.status == StatusCode::UNAUTHORIZED { Named::Invalid(unverified, denied) } else { Named::Denied(denied) }
}

/// Names the caller of every request ([`Callers`]) and puts the [`Caller`] into the request's
/// extensions, for the limit behind it and the tools; answers 401 when `auth.required` and the
/// key is missing or unknown (403/503 for a token without a scope, or that cannot be verified
/// now). The address comes from axum's `ConnectInfo<SocketAddr>` (serve with
/// `into_make_service_with_connect_info`).
///
/// It also stamps when the request arrived ([`Arrived`], on `clock`; a trusted proxy's
/// `X-Request-Start` if earlier), so the guard can tell how long calls queue in the server
/// (`[server.shedding]`).
#[derive(Clone)]
pub struct IdentifyLayer {
    callers: Callers,
    clock: SharedClock,
}

impl std::fmt::Debug for IdentifyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdentifyLayer").finish_non_exhaustive()
    }
}

impl IdentifyLayer {
    /// A layer naming callers with `callers` (swapped whole by a config reload), stamping
    /// arrivals on `clock` (the guard's).
    pub fn new(callers: Callers, clock: SharedClock) -> Self {
        Self { callers, clock }
    }
}

impl<S> Layer<S> for IdentifyLayer {
    type Service = Identified<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Identified { inner, callers: self.callers.clone(), clock: self.clock.clone() }
    }
}

/// The service [`IdentifyLayer`] produces.
#[derive(Clone)]
pub struct Identified<S> {
    inner: S,
    callers: Callers,
    clock: SharedClock,
}

impl<S> std::fmt::Debug for Identified<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Identified").finish_non_exhaustive()
    }
}

/// What [`Identified`] answers with: the inner service's future (the caller named at once), a
/// ready refusal, or a verification that waits for a fetch, then calls on.
pub type IdentifiedFuture<F, E> = futures::future::Either<
    futures::future::Either<F, std::future::Ready<Result<Response, E>>>,
    std::pin::Pin<Box<dyn Future<Output = Result<Response, E>> + Send>>,
>;

impl<S> Service<Request> for Identified<S>
where
    S: Service<Request, Response = Response> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = Response;
    type Error = S::Error;
    type Future = IdentifiedFuture<S::Future, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request) -> Self::Future {
        use futures::future::Either;
        let peer = request.extensions().get::<ConnectInfo<SocketAddr>>().map(|c| c.0.ip());
        let arrived = self.callers.identifier.load().arrived(request.headers(), peer, self.clock.now());
        request.extensions_mut().insert(Arrived(arrived));
        let named = match self.callers.name_now(request.headers(), peer) {
            Named::Later { token, digest, unverified } => {
                // The inner service is ready now (`poll_ready` said so); take it, leaving a clone,
                // so the future may call it after the verification (tower's clone-and-swap).
                let clone = self.inner.clone();
                let mut inner = std::mem::replace(&mut self.inner, clone);
                let callers = self.callers.clone();
                return Either::Right(Box::pin(async move {
                    match into_request(callers.verify(&token, digest, unverified).await, &mut request) {
                        Ok(()) => inner.call(request).await,
                        Err(denied) => Ok(denied.response()),
                    }
                }));
            }
            named => into_request(named, &mut request),
        };
        match named {
            Ok(()) => Either::Left(Either::Left(self.inner.call(request))),
            Err(denied) => Either::Left(Either::Right(std::future::ready(Ok(denied.response())))),
        }
    }
}

/// Puts what a request was named as into it; or the answer that refuses it now.
fn into_request(named: Named, request: &mut Request) -> Result<(), Denied> {
    match named {
        Named::Caller(caller) => {
            request.extensions_mut().insert(caller);
            Ok(())
        }
        Named::Invalid(unverified, denied) => {
            request.extensions_mut().insert(unverified);
            request.extensions_mut().insert(InvalidToken(denied));
            Ok(())
        }
        Named::Denied(denied) => Err(denied),
        Named::Later { .. } => Err(denied_later()),
    }
}

/// 401 `invalid_token` for a request whose token [`IdentifyLayer`] refused, once the layers
/// between (the HTTP limit) have charged it as its address's unverified caller. Put it behind the
/// HTTP limit.
pub fn refuse_invalid_tokens() -> CheckLayer<RefuseInvalidTokens> {
    CheckLayer::new(RefuseInvalidTokens)
}

/// The check of [`refuse_invalid_tokens`].
#[derive(Debug, Clone, Copy)]
pub struct RefuseInvalidTokens;

impl HeaderCheck for RefuseInvalidTokens {
    fn refuse(&self, request: &Request) -> Option<Response> {
        request.extensions().get::<InvalidToken>().map(|InvalidToken(denied)| denied.response())
    }
}
