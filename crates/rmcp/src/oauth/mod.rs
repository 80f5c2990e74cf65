//! Callers known by OAuth 2.1 access tokens: this server as the *resource server* of MCP's
//! authorization chapter (`[auth.oauth]`).
//!
//! A bearer token that is no configured key is verified here ([`TokenVerifier`]): a JWT against
//! the authorization server's keys (`keys.rs`: its metadata, then its JWKS, fetched again only for
//! a key not seen yet, at most once per `jwks_refresh_min_seconds`), or an opaque token by RFC
//! 7662 introspection (`introspect.rs`). A JWT must be signed with one of the configured
//! asymmetric algorithms (never `none`, never HS*, whatever its header says), by a key of the
//! issuer's set (never one the token names through `jku`, `x5u` or `jwk`), and name this server's
//! issuer (`iss`), this resource (`aud`, RFC 8707), a subject (`sub`), and a time it is good for
//! (`exp`, `nbf`, within `leeway_seconds`) on the app's clock. A token that lacks a scope of
//! `scopes_required` is valid but refused (403 `insufficient_scope`).
//!
//! A verification holds for the same token until it expires, as long as its key is still in the
//! set: it is kept by the token's SHA-256 (never the token), so a client presenting its token on
//! every request pays for one signature check, not one per request. Who the verified claims name
//! is [`Identifier::subject`](mcp_ratelimit_core::identity::Identifier::subject)'s to say; how a
//! refused token is answered (401 with the Protected Resource Metadata's URL, so clients find
//! where to get a token) is `resource.rs`'s.

mod fetch;
mod introspect;
mod keys;
mod resource;

use std::sync::Arc;

use jsonwebtoken::{Algorithm, Validation};
use serde_json::{Map, Value};

use mcp_ratelimit_core::clock::{NANOS_PER_SEC, Nanos, SharedClock};
use mcp_ratelimit_core::config::OAuthConfig;
use mcp_ratelimit_core::ops::metrics::Metrics;

pub use resource::{ProtectedResource, metadata_routes};

use fetch::Fetch;
use introspect::Introspection;
use keys::{Keys, NoKey};

/// How many verified tokens are remembered (by digest) at most.
const VERIFIED_KEPT: usize = 10_000;

/// How long the keys as fetched are trusted before they are fetched again, whether or not a token
/// names a key they lack ([`TokenVerifier::refresh_if_stale`]).
pub const KEYS_KEPT: std::time::Duration = std::time::Duration::from_secs(3_600);

/// Why a token is refused. Each is counted under its [`Rejected::outcome`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Rejected {
    /// Not a JWT, and no introspection endpoint is configured to ask about it.
    #[error("the access token is not a JWT this server can verify")]
    NotAJwt,
    /// Not a well-formed token (header, claims, a number where one is needed).
    #[error("the access token is malformed")]
    Malformed,
    /// Signed with an algorithm this server does not accept (`none`, HS*, or one not listed).
    #[error("the access token's signature algorithm is not accepted")]
    AlgorithmNotAllowed,
    /// Signed by a key the authorization server does not publish.
    #[error("the access token is signed by an unknown key")]
    UnknownKey,
    /// The signature does not verify.
    #[error("the access token's signature does not verify")]
    BadSignature,
    /// Issued by another authorization server.
    #[error("the access token was issued by another authorization server")]
    WrongIssuer,
    /// Issued for another resource (its `aud` does not name this server).
    #[error("the access token was not issued for this server (aud)")]
    WrongAudience,
    /// Past its `exp`.
    #[error("the access token expired")]
    Expired,
    /// Before its `nbf`.
    #[error("the access token is not valid yet")]
    NotYetValid,
    /// It names no subject.
    #[error("the access token names no subject")]
    NoSubject,
    /// Introspection says it is not active.
    #[error("the access token is not active")]
    Inactive,
    /// Valid, but without a scope this server requires.
    #[error("the access token lacks a required scope")]
    InsufficientScope,
    /// It cannot be verified now: the authorization server's keys (or its introspection) could
    /// not be reached. Try again after this many nanoseconds.
    #[error("the authorization server cannot be reached to verify the access token")]
    Unavailable(Nanos),
}

impl Rejected {
    /// The `outcome` label of `mcp_ratelimit_token_validations_total`.
    pub fn outcome(self) -> &'static str {
        match self {
            Rejected::NotAJwt => "not_a_jwt",
            Rejected::Malformed => "malformed",
            Rejected::AlgorithmNotAllowed => "algorithm_not_allowed",
            Rejected::UnknownKey => "unknown_key",
            Rejected::BadSignature => "bad_signature",
            Rejected::WrongIssuer => "wrong_issuer",
            Rejected::WrongAudience => "wrong_audience",
            Rejected::Expired => "expired",
            Rejected::NotYetValid => "not_yet_valid",
            Rejected::NoSubject => "no_subject",
            Rejected::Inactive => "inactive",
            Rejected::InsufficientScope => "insufficient_scope",
            Rejected::Unavailable(_) => "unavailable",
        }
    }
}

/// What a verified token says: its claims, and when it stops being good.
#[derive(Debug)]
pub struct Verified {
    claims: Map<String, Value>,
    /// `exp`, in Unix seconds (an introspected token may have none).
    expires_at: Option<u64>,
    /// `nbf`, in Unix seconds.
    not_before: Option<u64>,
    /// The key that verified it (`Some(None)`: one without a `kid`); `None`: introspected.
    kid: Option<Option<String>>,
    /// Until when (app clock) an introspection's answer may be believed without asking again.
    believed_until: Option<Nanos>,
    /// Whether it carries every scope `scopes_required` names.
    scopes_ok: bool,
}

impl Verified {
    /// The token's claims (the introspection answer's, for an opaque token).
    pub fn claims(&self) -> &Map<String, Value> {
        &self.claims
    }

    /// Whether it carries every scope `scopes_required` names: a token without one is valid but
    /// refused (403 `insufficient_scope`).
    pub fn scopes_ok(&self) -> bool {
        self.scopes_ok
    }
}

/// Verifies bearer tokens as access tokens issued for this server. Cheap to share: one per
/// `[auth.oauth]` in force.
pub struct TokenVerifier {
    issuer: String,
    audience: String,
    algorithms: Vec<Algorithm>,
    leeway: u64,
    scopes_required: Vec<String>,
    keys: Arc<Keys>,
    introspection: Option<Introspection>,
    fetch: Fetch,
    verified: quick_cache::sync::Cache<[u8; 32], Arc<Verified>>,
    resource: ProtectedResource,
    clock: SharedClock,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for TokenVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenVerifier")
            .field("issuer", &self.issuer)
            .field("audience", &self.audience)
            .field("algorithms", &self.algorithms)
            .field("introspection", &self.introspection.is_some())
            .finish_non_exhaustive()
    }
}

/// Why a verifier could not be made from a config.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerifierError {
    /// `auth.oauth.audience` is empty: a library user names its own resource URI.
    #[error("`auth.oauth.audience` is empty: set it to this server's canonical MCP URL")]
    NoAudience,
    /// The HTTP client toward the authorization server could not be made.
    #[error("the HTTP client toward the authorization server: {0}")]
    Client(String),
}

/// What checking a token without waiting came to.
#[derive(Debug)]
pub enum Checked {
    /// Decided: verified, or refused.
    Now(Result<Arc<Verified>, Rejected>),
    /// It takes a fetch of the keys, or an introspection: [`TokenVerifier::check`].
    Later,
}

impl TokenVerifier {
    /// A verifier for `config` (which must be on, with its audience set), on `clock`; it fetches
    /// nothing until [`TokenVerifier::start`] or the first token.
    pub fn new(config: &OAuthConfig, clock: SharedClock, metrics: Arc<Metrics>) -> Result<Self, VerifierError> {
        if config.audience.is_empty() {
            return Err(VerifierError::NoAudience);
        }
        let fetch = Fetch::new().map_err(VerifierError::Client)?;
        let algorithms = config.algorithms.iter().filter_map(|a| a.parse::<Algorithm>().ok()).collect();
        let keys = Keys::new(
            &config.issuer,
            &config.jwks_uri,
            config.jwks_refresh_min_seconds,
            clock.clone(),
            metrics.clone(),
        );
        Ok(Self {
            issuer: config.issuer.clone(),
            audience: config.audience.clone(),
            algorithms,
            leeway: config.leeway_seconds,
            scopes_required: config.scopes_required.clone(),
            keys: Arc::new(keys),
            introspection: Introspection::of(config, metrics.clone()),
            fetch,
            verified: quick_cache::sync::Cache::new(VERIFIED_KEPT),
            resource: ProtectedResource::of(config),
            clock,
            metrics,
        })
    }

    /// Fetches the authorization server's metadata and keys now, so the first token does not
    /// wait for them; a failure is logged and counted, and tried again when a token needs them.
    pub async fn start(&self) {
        if self.keys.fetch_now(&self.fetch).await.is_ok() {
            tracing::info!(target: "mcp_ratelimit::oauth", issuer = %self.issuer, keys = self.keys.now().len(), "OAuth tokens verified against the issuer's keys");
        }
    }

    /// Fetches the keys again when the last fetch is older than [`KEYS_KEPT`]: a key the
    /// authorization server withdrew (rotated out, or compromised) is trusted no longer than that,
    /// though no token names a key it lacks. The server calls it every minute.
    pub async fn refresh_if_stale(&self) {
        if self.keys.age().is_none_or(|age| age >= Nanos::from(KEYS_KEPT)) {
            let _ = self.keys.fetch_now(&self.fetch).await;
        }
    }

    /// This server as a protected resource: its metadata document, and how it asks for a token.
    pub fn resource(&self) -> &ProtectedResource {
        &self.resource
    }

    /// Checks `token` (whose SHA-256 is `digest`) with what is at hand: a verification kept for
    /// it, or the keys as they stand. [`Checked::Later`] when it takes a fetch or an
    /// introspection. A decision is counted.
    pub fn check_now(&self, token: &str, digest: &[u8; 32]) -> Checked {
        let checked = self.decide_now(token, digest);
        if let Checked::Now(result) = &checked {
            self.count(result);
        }
        checked
    }

    /// Checks `token` (whose SHA-256 is `digest`), fetching the keys again or introspecting when
    /// that is what it takes. The decision is counted.
    pub async fn check(&self, token: &str, digest: &[u8; 32]) -> Result<Arc<Verified>, Rejected> {
        let result = match self.decide_now(token, digest) {
            Checked::Now(result) => result,
            Checked::Later => self.decide_later(token, digest).await,
        };
        self.count(&result);
        result
    }

    fn count(&self, result: &Result<Arc<Verified>, Rejected>) {
        let outcome = match result {
            Ok(verified) if verified.scopes_ok => "valid",
            Ok(_) => Rejected::InsufficientScope.outcome(),
            Err(rejected) => rejected.outcome(),
        };
        self.metrics.token_validation(outcome);
    }

    fn decide_now(&self, token: &str, digest: &[u8; 32]) -> Checked {
        if let Some(kept) = self.verified.get(digest) {
            let key_kept = kept.kid.as_ref().is_none_or(|kid| self.keys.now().has(kid.as_deref()));
            let believed = kept.believed_until.is_none_or(|until| self.clock.now() < until);
            if key_kept && believed {
                return Checked::Now(self.in_time(kept));
            }
            self.verified.remove(digest);
        }
        if token.bytes().filter(|b| *b == b'.').count() != 2 {
            return match &self.introspection {
                Some(_) => Checked::Later,
                None => Checked::Now(Err(Rejected::NotAJwt)),
            };
        }
        let Ok(header) = jsonwebtoken::decode_header(token) else { return Checked::Now(Err(Rejected::Malformed)) };
        if !self.algorithms.contains(&header.alg) {
            return Checked::Now(Err(Rejected::AlgorithmNotAllowed));
        }
        let kid = header.kid.as_deref();
        let set = self.keys.now();
        match set.key_for(kid, header.alg) {
            Some(key) => Checked::Now(self.verify_with(token, digest, header.alg, kid, &key.decoding)),
            // A key of its kid that cannot verify its algorithm: no fetch would change that.
            None if set.has(kid) => Checked::Now(Err(Rejected::UnknownKey)),
            None if self.keys.wait_to_fetch() == Nanos::ZERO => Checked::Later,
            None if set.len() == 0 => Checked::Now(Err(Rejected::Unavailable(self.keys.wait_to_fetch()))),
            None => Checked::Now(Err(Rejected::UnknownKey)),
        }
    }

    async fn decide_later(&self, token: &str, digest: &[u8; 32]) -> Result<Arc<Verified>, Rejected> {
        if token.bytes().filter(|b| *b == b'.').count() != 2 {
            let Some(introspection) = &self.introspection else { return Err(Rejected::NotAJwt) };
            let verified = introspection.ask(&self.fetch, token, digest, self).await?;
            return self.in_time(verified);
        }
        let header = jsonwebtoken::decode_header(token).map_err(|_| Rejected::Malformed)?;
        let kid = header.kid.as_deref();
        let set = self.keys.refreshed_for(&self.fetch, kid).await.map_err(|no| match no {
            NoKey::Unknown => Rejected::UnknownKey,
            NoKey::Unavailable(wait) => Rejected::Unavailable(wait),
        })?;
        match set.key_for(kid, header.alg) {
            Some(key) => self.verify_with(token, digest, header.alg, kid, &key.decoding),
            None => Err(Rejected::UnknownKey),
        }
    }

    /// Verifies the signature and claims of `token` with `key`; a verified token is kept.
    fn verify_with(
        &self,
        token: &str,
        digest: &[u8; 32],
        alg: Algorithm,
        kid: Option<&str>,
        key: &jsonwebtoken::DecodingKey,
    ) -> Result<Arc<Verified>, Rejected> {
        let mut validation = Validation::new(alg);
        validation.set_issuer(&[&self.issuer]);
        validation.set_audience(&[&self.audience]);
        validation.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
        // Time is checked on the app's clock below, not the system's.
        validation.validate_exp = false;
        validation.validate_nbf = false;
        let decoded = jsonwebtoken::decode::<Map<String, Value>>(token, key, &validation).map_err(rejected_by)?;
        let claims = decoded.claims;
        let verified = Arc::new(Verified {
            expires_at: Some(seconds(claims.get("exp")).ok_or(Rejected::Malformed)?),
            not_before: match claims.get("nbf") {
                Some(nbf) => Some(seconds(Some(nbf)).ok_or(Rejected::Malformed)?),
                None => None,
            },
            kid: Some(kid.map(str::to_owned)),
            believed_until: None,
            scopes_ok: has_scopes(&claims, &self.scopes_required),
            claims,
        });
        let verified = self.in_time(verified)?;
        if verified.claims.get("sub").and_then(Value::as_str).is_none_or(str::is_empty) {
            return Err(Rejected::NoSubject);
        }
        self.verified.insert(*digest, verified.clone());
        Ok(verified)
    }

    /// `verified` if the app's clock is within its `nbf` and `exp` (each with the leeway).
    fn in_time(&self, verified: Arc<Verified>) -> Result<Arc<Verified>, Rejected> {
        let now = self.clock.now().as_u64() / NANOS_PER_SEC;
        if verified.expires_at.is_some_and(|exp| now >= exp.saturating_add(self.leeway)) {
            return Err(Rejected::Expired);
        }
        if verified.not_before.is_some_and(|nbf| now.saturating_add(self.leeway) < nbf) {
            return Err(Rejected::NotYetValid);
        }
        Ok(verified)
    }
}

/// The refusal a `jsonwebtoken` error comes to.
fn rejected_by(error: jsonwebtoken::errors::Error) -> Rejected {
    use jsonwebtoken::errors::ErrorKind;
    match error.kind() {
        ErrorKind::InvalidSignature => Rejected::BadSignature,
        ErrorKind::InvalidAudience => Rejected::WrongAudience,
        ErrorKind::InvalidIssuer => Rejected::WrongIssuer,
        ErrorKind::InvalidAlgorithm | ErrorKind::MissingAlgorithm => Rejected::AlgorithmNotAllowed,
        ErrorKind::MissingRequiredClaim(claim) => match claim.as_str() {
            "sub" => Rejected::NoSubject,
            "aud" => Rejected::WrongAudience,
            "iss" => Rejected::WrongIssuer,
            _ => Rejected::Malformed,
        },
        _ => Rejected::Malformed,
    }
}

/// A NumericDate claim in whole seconds (a fraction is dropped, as RFC 7519 allows it).
fn seconds(value: Option<&Value>) -> Option<u64> {
    let value = value?;
    value.as_u64().or_else(|| value.as_f64().filter(|f| f.is_finite() && *f >= 0.0 && *f < 1e18).map(|f| f as u64))
}

/// Whether `claims` grant every scope of `required`: the `scope` claim (space-separated, RFC 8693
/// and 9068), or `scp` (a string or a list, as Entra and Okta write it).
fn has_scopes(claims: &Map<String, Value>, required: &[String]) -> bool {
    if required.is_empty() {
        return true;
    }
    let mut granted: Vec<&str> = Vec::new();
    for name in ["scope", "scp"] {
        match claims.get(name) {
            Some(Value::String(list)) => granted.extend(list.split_whitespace()),
            Some(Value::Array(items)) => granted.extend(items.iter().filter_map(Value::as_str)),
            _ => {}
        }
    }
    required.iter().all(|scope| granted.contains(&scope.as_str()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_are_read_from_scope_or_scp() {
        let claims = |v: Value| v.as_object().cloned().expect("object");
        let need = ["mcp:tools".to_owned(), "read".to_owned()];
        assert!(has_scopes(&claims(serde_json::json!({"scope": "read mcp:tools other"})), &need));
        assert!(has_scopes(&claims(serde_json::json!({"scp": ["mcp:tools", "read"]})), &need));
        assert!(has_scopes(&claims(serde_json::json!({"scp": "read mcp:tools"})), &need));
        assert!(!has_scopes(&claims(serde_json::json!({"scope": "read"})), &need));
        assert!(!has_scopes(&claims(serde_json::json!({"scope": "read mcp:toolsX"})), &need));
        assert!(has_scopes(&claims(serde_json::json!({})), &[]));
    }

    #[test]
    fn numeric_dates_are_whole_seconds_and_nothing_else() {
        assert_eq!(seconds(Some(&serde_json::json!(1_700_000_000))), Some(1_700_000_000));
        assert_eq!(seconds(Some(&serde_json::json!(1_700_000_000.9))), Some(1_700_000_000));
        for bad in [serde_json::json!(-1), serde_json::json!("1700000000"), serde_json::json!(1e300)] {
            assert_eq!(seconds(Some(&bad)), None, "{bad}");
        }
    }
}
