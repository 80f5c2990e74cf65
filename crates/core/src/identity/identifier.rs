//! The [`Identifier`]: turns a request's credential (a configured key, a made-up one, a token to
//! verify, or none) into its caller, and an operator's name for a caller back into one.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use http::HeaderMap;
use ipnet::IpNet;
use sha2::{Digest, Sha256};

use super::address::{address_of, canonical_address};
use super::oauth::Claims;
use super::{Caller, CallerIds, Identity, Unauthorized, UnknownCaller};
use crate::config::LimitsConfig;

/// Turns requests into callers, per the `[auth]` and `[server]` config.
pub struct Identifier {
    keys: HashMap<[u8; 32], KeyInfo>,
    pub(super) ids: CallerIds,
    required: bool,
    anonymous_tier: Arc<str>,
    pub(super) trust_proxy: bool,
    pub(super) trusted_proxies: Vec<IpNet>,
    ipv6_prefix: u8,
    /// `[auth.oauth]`'s claims, when it is on.
    pub(super) claims: Option<Claims>,
    /// The configured tiers, which a token's tier claim must name.
    pub(super) tiers: BTreeSet<Arc<str>>,
}

impl fmt::Debug for Identifier {
    /// How many keys, never their digests (of a short plaintext key, a digest gives it away).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Identifier")
            .field("keys", &self.keys.len())
            .field("ids", &self.ids)
            .field("required", &self.required)
            .field("anonymous_tier", &self.anonymous_tier)
            .field("trust_proxy", &self.trust_proxy)
            .field("trusted_proxies", &self.trusted_proxies)
            .field("ipv6_prefix", &self.ipv6_prefix)
            .field("claims", &self.claims)
            .finish()
    }
}

#[derive(Debug)]
struct KeyInfo {
    tenant: Option<Arc<str>>,
    tier: Arc<str>,
}

impl Identifier {
    /// An identifier for `config`.
    pub fn new(config: &LimitsConfig) -> Self {
        let keys = config
            .auth
            .keys
            .iter()
            .map(|k| {
                (k.sha256, KeyInfo { tenant: k.tenant.as_deref().map(Arc::from), tier: Arc::from(k.tier.as_str()) })
            })
            .collect();
        Self {
            keys,
            ids: CallerIds::of(config),
            required: config.auth.required,
            anonymous_tier: Arc::from(config.auth.anonymous_tier.as_str()),
            trust_proxy: config.proxies.trust_proxy,
            trusted_proxies: config.proxies.trusted_proxies.clone(),
            ipv6_prefix: config.proxies.ipv6_prefix,
            claims: Claims::of(&config.auth.oauth),
            tiers: config.tiers.keys().map(|t| Arc::from(t.as_str())).collect(),
        }
    }

    /// The caller a configured key's SHA-256 names, as requests presenting that key are named.
    pub fn configured(&self, sha256: &[u8; 32]) -> Option<Caller> {
        let info = self.keys.get(sha256)?;
        Some(Caller::from_digest(&self.ids, sha256, info.tenant.clone(), info.tier.clone(), None))
    }

    /// A caller of `tenant`, through which an operator reaches the tenant's budgets; `None` when
    /// no configured key belongs to it.
    pub fn member_of(&self, tenant: &str) -> Option<Caller> {
        // The smallest digest, so the same member answers every time.
        let (digest, _) =
            self.keys.iter().filter(|(_, info)| info.tenant.as_deref() == Some(tenant)).min_by_key(|(d, _)| **d)?;
        self.configured(digest)
    }

    /// The caller an operator names by the id the server shows (`tok:…` in refusal scopes and
    /// `rate_limit_status`, `ip:…`, `local`), never by a key. A `tok:` id that is no configured
    /// key's is an unverified caller, whose budgets are kept with its address: `from` names it.
    /// A token's subject (`sub:…`) is named by [`Identifier::subject_by_id`].
    pub fn by_id(&self, id: &str, from: Option<&str>) -> Result<Caller, UnknownCaller> {
        if id == "local" {
            return Ok(self.local());
        }
        if id.starts_with("sub:") {
            return self.subject_by_id(id, None, None, None);
        }
        if let Some(hex) = id.strip_prefix("tok:") {
            if hex.len() != 16 || !hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
                return Err(UnknownCaller::Malformed(id.to_owned()));
            }
            if let Some(caller) = self.keys.keys().filter_map(|digest| self.configured(digest)).find(|c| c.id == id) {
                return Ok(caller);
            }
            let from = from.ok_or_else(|| UnknownCaller::NeedsAddress(id.to_owned()))?;
            let from =
                canonical_address(from, self.ipv6_prefix).ok_or_else(|| UnknownCaller::BadAddress(from.to_owned()))?;
            let tier = self.anonymous_tier.clone();
            return Ok(Caller::new(id.to_owned(), None, tier, Some(from.into())));
        }
        let ip = match id.strip_prefix("ip:") {
            Some("unknown") => None,
            Some(ip) => Some(ip.parse::<IpAddr>().map_err(|_| UnknownCaller::Malformed(id.to_owned()))?.to_canonical()),
            None => return Err(UnknownCaller::Malformed(id.to_owned())),
        };
        let id = ip.map_or_else(|| "ip:unknown".to_owned(), |ip| format!("ip:{ip}"));
        let from = Some(Arc::from(address_of(ip, self.ipv6_prefix)));
        Ok(Caller::new(id, None, self.anonymous_tier.clone(), from))
    }

    /// How this identifier derives caller ids from credentials.
    pub fn ids(&self) -> &CallerIds {
        &self.ids
    }

    /// Whether requests without a configured key are refused (`auth.required`).
    pub fn required(&self) -> bool {
        self.required
    }

    /// The single caller behind a stdio transport: the local user, trusted like a default key.
    pub fn local(&self) -> Caller {
        Caller::new("local".to_owned(), None, Arc::from("default"), None)
    }

    /// Identifies the caller of an HTTP request from its credential, else its address; a bearer
    /// token to verify first, with `[auth.oauth]` on.
    pub fn identify<'h>(&self, headers: &'h HeaderMap, peer: Option<IpAddr>) -> Result<Identity<'h>, Unauthorized> {
        match credential(headers) {
            Some((token, scheme)) => {
                let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
                if let Some(info) = self.keys.get(&digest) {
                    return Ok(Identity::Caller(Caller::from_digest(
                        &self.ids,
                        &digest,
                        info.tenant.clone(),
                        info.tier.clone(),
                        None,
                    )));
                }
                let to_verify = scheme == Scheme::Bearer && self.claims.is_some();
                if self.required && !to_verify {
                    return Err(Unauthorized::Unknown);
                }
                let from = address_of(self.client_ip(headers, peer), self.ipv6_prefix);
                let tier = self.anonymous_tier.clone();
                let unverified = Caller::from_digest(&self.ids, &digest, None, tier, Some(from.into()));
                Ok(if to_verify { Identity::Token { token, digest, unverified } } else { Identity::Caller(unverified) })
            }
            None if self.required => Err(Unauthorized::Missing),
            None => {
                let ip = self.client_ip(headers, peer);
                let id = match ip {
                    Some(ip) => format!("ip:{ip}"),
                    None => "ip:unknown".to_owned(),
                };
                let from = Some(Arc::from(address_of(ip, self.ipv6_prefix)));
                Ok(Identity::Caller(Caller::new(id, None, self.anonymous_tier.clone(), from)))
            }
        }
    }
}

/// How a credential was presented.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scheme {
    /// `Authorization: Bearer <t>`: a key, or an OAuth access token.
    Bearer,
    /// `X-API-Key: <t>`: a key only.
    ApiKey,
}

/// The credential a request presents, if any, and how.
fn credential(headers: &HeaderMap) -> Option<(&str, Scheme)> {
    let bearer = headers.get(http::header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| {
        let (scheme, token) = v.trim().split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
    });
    let api_key = || headers.get("x-api-key").and_then(|v| v.to_str().ok()).map(str::trim);
    match bearer.filter(|t| !t.is_empty()) {
        Some(token) => Some((token, Scheme::Bearer)),
        None => api_key().filter(|t| !t.is_empty()).map(|key| (key, Scheme::ApiKey)),
    }
}
