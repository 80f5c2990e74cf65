//! RFC 7662 introspection of opaque access tokens: the authorization server says whether a token
//! is active and what it grants. Its answer is kept by the token's digest no longer than the
//! token lives (its `exp`, or a minute without one), and an inactive answer for half a minute,
//! so a client repeating a token (good or bad) is asked about once. Introspections in flight are
//! bounded, so a flood of invented opaque tokens cannot become a flood at the authorization
//! server: beyond the bound a token is refused as unavailable, with a wait.

use std::sync::Arc;

use serde_json::{Map, Value};
use tokio::sync::Semaphore;

use mcp_ratelimit_core::clock::Nanos;
use mcp_ratelimit_core::config::OAuthConfig;
use mcp_ratelimit_core::ops::metrics::Metrics;
use mcp_ratelimit_core::redact::Secret;

use super::fetch::Fetch;
use super::{Rejected, TokenVerifier, Verified, has_scopes, seconds};

/// Answers kept at most (active and inactive together).
const KEPT: usize = 10_000;
/// How long an active answer without `exp` is believed.
const NO_EXP_BELIEVED: Nanos = Nanos::from_secs(60);
/// How long an inactive answer is believed.
const INACTIVE_BELIEVED: Nanos = Nanos::from_secs(30);
/// Introspections in flight at most, all tokens together.
const IN_FLIGHT: usize = 32;

/// The introspection endpoint and what it answered.
pub(super) struct Introspection {
    endpoint: String,
    client_id: String,
    secret: Option<Secret>,
    /// Inactive (or unreadable) answers, by digest, until when they are believed.
    refused: quick_cache::sync::Cache<[u8; 32], (Rejected, Nanos)>,
    in_flight: Semaphore,
    metrics: Arc<Metrics>,
}

impl Introspection {
    /// The introspection `config` names, if any.
    pub(super) fn of(config: &OAuthConfig, metrics: Arc<Metrics>) -> Option<Self> {
        (!config.introspection_endpoint.is_empty()).then(|| Self {
            endpoint: config.introspection_endpoint.clone(),
            client_id: config.introspection_client_id.clone(),
            secret: config.introspection_client_secret.clone(),
            refused: quick_cache::sync::Cache::new(KEPT),
            in_flight: Semaphore::new(IN_FLIGHT),
            metrics,
        })
    }

    /// What the authorization server says of `token`, checked as a JWT's claims would be (issuer,
    /// audience, subject, scopes), and kept for as long as it may be believed.
    pub(super) async fn ask(
        &self,
        fetch: &Fetch,
        token: &str,
        digest: &[u8; 32],
        verifier: &TokenVerifier,
    ) -> Result<Arc<Verified>, Rejected> {
        let now = verifier.clock.now();
        if let Some((rejected, until)) = self.refused.get(digest)
            && now < until
        {
            return Err(rejected);
        }
        let Ok(_permit) = self.in_flight.try_acquire() else {
            return Err(Rejected::Unavailable(Nanos::from_secs(1)));
        };
        let form = [("token", token), ("token_type_hint", "access_token")];
        let credentials = (self.client_id.as_str(), self.secret.as_ref().map(Secret::expose));
        let answer = match fetch.post_form(&self.endpoint, &form, credentials).await {
            Ok(Value::Object(answer)) => answer,
            Ok(_) | Err(_) => {
                self.metrics.token_introspection("failed");
                tracing::warn!(target: "mcp_ratelimit::oauth", endpoint = %self.endpoint, "token introspection failed");
                return Err(Rejected::Unavailable(Nanos::from_secs(1)));
            }
        };
        let active = answer.get("active").and_then(Value::as_bool) == Some(true);
        self.metrics.token_introspection(if active { "active" } else { "inactive" });
        match believe(answer, active, verifier, now) {
            Ok(verified) => {
                verifier.verified.insert(*digest, verified.clone());
                Ok(verified)
            }
            Err(rejected) => {
                self.refused.insert(*digest, (rejected, now + INACTIVE_BELIEVED));
                Err(rejected)
            }
        }
    }
}

/// An introspection answer as a verified token: active, issued by the issuer (when it says), for
/// this resource, to a subject.
fn believe(
    answer: Map<String, Value>,
    active: bool,
    verifier: &TokenVerifier,
    now: Nanos,
) -> Result<Arc<Verified>, Rejected> {
    if !active {
        return Err(Rejected::Inactive);
    }
    if answer.get("iss").is_some_and(|iss| iss.as_str() != Some(verifier.issuer.as_str())) {
        return Err(Rejected::WrongIssuer);
    }
    // RFC 8707: the token must be meant for this resource. An answer that does not say so is not
    // believed to.
    let for_us = match answer.get("aud") {
        Some(Value::String(aud)) => *aud == verifier.audience,
        Some(Value::Array(auds)) => auds.iter().any(|a| a.as_str() == Some(verifier.audience.as_str())),
        _ => false,
    };
    if !for_us {
        return Err(Rejected::WrongAudience);
    }
    let expires_at = match answer.get("exp") {
        Some(exp) => Some(seconds(Some(exp)).ok_or(Rejected::Malformed)?),
        None => None,
    };
    let believed_until = match expires_at {
        Some(exp) => Nanos::from_secs(exp),
        None => now + NO_EXP_BELIEVED,
    };
    if answer.get("sub").and_then(Value::as_str).is_none_or(str::is_empty) {
        return Err(Rejected::NoSubject);
    }
    Ok(Arc::new(Verified {
        expires_at,
        not_before: None,
        kid: None,
        believed_until: Some(believed_until.min(now + NO_EXP_BELIEVED * 60)),
        scopes_ok: has_scopes(&answer, &verifier.scopes_required),
        claims: answer,
    }))
}
