//! `[auth]` and `[tiers]`: who a caller is (its key, tenant and tier, or the OAuth tokens of
//! `[auth.oauth]`, checked in [`super::oauth`]) and what a tier scales.

use std::collections::BTreeMap;

use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::limits::{Limit, RawScope};
use super::oauth::{OAuthConfig, RawOAuth};
use super::{ConfigError, invalid};
use crate::redact::Secret;

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
    /// `[auth.oauth]`: callers known by OAuth access tokens (off while its issuer is empty).
    pub oauth: OAuthConfig,
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

/// The shortest `auth.id_secret` accepted: a short one could itself be found by trying.
const MIN_ID_SECRET_CHARS: usize = 16;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawAuth {
    required: bool,
    anonymous_tier: String,
    id_secret: String,
    #[serde(default)]
    keys: Vec<RawKey>,
    oauth: RawOAuth,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawKey {
    key: Option<String>,
    sha256: Option<String>,
    tenant: Option<String>,
    tier: Option<String>,
    caller: Option<RawScope>,
}

impl std::fmt::Debug for RawAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self { required, anonymous_tier, id_secret, keys, oauth } = self;
        f.debug_struct("RawAuth")
            .field("required", required)
            .field("anonymous_tier", anonymous_tier)
            .field("id_secret", &if id_secret.trim().is_empty() { "" } else { "<redacted>" })
            .field("keys", keys)
            .field("oauth", oauth)
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

/// `[tiers]`, checked: every factor positive and finite.
pub(super) fn validate_tiers(tiers: &BTreeMap<String, f64>) -> Result<(), ConfigError> {
    for (tier, factor) in tiers {
        if !factor.is_finite() || *factor <= 0.0 || *factor > 1e6 {
            return Err(invalid(format!("tiers.{tier}"), format!("must be a positive factor (got {factor})")));
        }
    }
    Ok(())
}

/// An error naming `key` unless `tier` is one of `tiers`.
fn known_tier(tiers: &BTreeMap<String, f64>, key: String, tier: &str) -> Result<(), ConfigError> {
    if tiers.contains_key(tier) {
        return Ok(());
    }
    let names = tiers.keys().cloned().collect::<Vec<_>>().join(", ");
    Err(invalid(key, format!("unknown tier `{tier}`; the tiers are {names}")))
}

impl RawAuth {
    /// The section, checked against the tiers: every key given once, by exactly one of its
    /// plaintext or its SHA-256, of a known tier and a well-formed tenant.
    pub(super) fn validate(self, tiers: &BTreeMap<String, f64>) -> Result<AuthConfig, ConfigError> {
        known_tier(tiers, "auth.anonymous_tier".into(), &self.anonymous_tier)?;
        let mut keys = Vec::with_capacity(self.keys.len());
        for (i, raw) in self.keys.into_iter().enumerate() {
            let key = raw.validate(&format!("auth.keys[{i}]"), tiers)?;
            if keys.iter().any(|k: &ApiKey| k.sha256 == key.sha256) {
                return Err(invalid(format!("auth.keys[{i}]"), "the same key is configured twice"));
            }
            keys.push(key);
        }
        let oauth = self.oauth.validate()?;
        if self.required && keys.is_empty() && !oauth.enabled() {
            return Err(invalid(
                "auth.required",
                "is true but no `[[auth.keys]]` are configured and `[auth.oauth]` has no issuer: nobody could call",
            ));
        }
        let id_secret = id_secret(&self.id_secret)?;
        Ok(AuthConfig { required: self.required, anonymous_tier: self.anonymous_tier, keys, id_secret, oauth })
    }
}

impl RawKey {
    /// One `[[auth.keys]]` entry (at `at`), checked.
    fn validate(self, at: &str, tiers: &BTreeMap<String, f64>) -> Result<ApiKey, ConfigError> {
        let sha256 = match (&self.key, &self.sha256) {
            (Some(plain), None) if !plain.trim().is_empty() => Sha256::digest(plain.trim().as_bytes()).into(),
            (None, Some(hex)) => parse_digest(&format!("{at}.sha256"), hex)?,
            _ => {
                return Err(invalid(at, "give exactly one of `key` (plaintext, for local development) or `sha256`"));
            }
        };
        let tier = self.tier.unwrap_or_else(|| "default".to_owned());
        known_tier(tiers, format!("{at}.tier"), &tier)?;
        if self.tenant.as_deref().is_some_and(|t| t.is_empty() || t.len() > 64 || t.contains(':')) {
            return Err(invalid(format!("{at}.tenant"), "a tenant is 1-64 characters without `:`"));
        }
        let caller = self.caller.map(|c| c.build(&format!("{at}.caller"))).transpose()?;
        Ok(ApiKey { sha256, tenant: self.tenant, tier, caller })
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
