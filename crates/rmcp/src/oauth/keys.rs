//! The authorization server's signing keys: found through its metadata (RFC 8414, then OpenID
//! discovery), fetched from its JWKS, kept, and fetched again only when a token names a key not
//! seen yet — at most once per `jwks_refresh_min_seconds`, and by one request at a time while the
//! others wait for it, so a flood of tokens under made-up key ids costs the provider nothing.
//!
//! Only keys for signatures are kept, each with what it may verify (its type, its curve, the
//! `alg` it names). A key is never taken from a token: its `jku`, `x5u` and `jwk` headers are
//! ignored, as is any key the set holds for HMAC (`oct`).

use std::collections::HashMap;
use std::sync::Arc;

use arc_swap::ArcSwap;
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, PublicKeyUse};
use jsonwebtoken::{Algorithm, DecodingKey};
use serde_json::Value;

use mcp_ratelimit_core::clock::{Nanos, SharedClock};
use mcp_ratelimit_core::ops::metrics::Metrics;

use super::fetch::{Fetch, FetchError};

/// The most keys a set may hold: more is not a key set but an attack on memory.
const MAX_KEYS: usize = 64;

/// One verification key of the set.
pub(super) struct Key {
    pub(super) decoding: DecodingKey,
    /// The algorithms it may verify: its type's (and curve's), narrowed to its `alg` if it names one.
    algorithms: Vec<Algorithm>,
}

impl Key {
    /// Whether it may verify a signature made with `alg`.
    pub(super) fn verifies(&self, alg: Algorithm) -> bool {
        self.algorithms.contains(&alg)
    }
}

/// The keys as last fetched, by `kid` (`None`: a key without one).
#[derive(Default)]
pub(super) struct KeySet {
    keys: HashMap<Option<String>, Arc<Key>>,
}

impl KeySet {
    /// The key `kid` names that may verify `alg`; a token without a `kid` is verified by the one
    /// key that may, when there is exactly one.
    pub(super) fn key_for(&self, kid: Option<&str>, alg: Algorithm) -> Option<&Arc<Key>> {
        match kid {
            Some(kid) => self.keys.get(&Some(kid.to_owned())).filter(|k| k.verifies(alg)),
            None => {
                let mut fitting = self.keys.values().filter(|k| k.verifies(alg));
                let only = fitting.next()?;
                fitting.next().is_none().then_some(only)
            }
        }
    }

    /// Whether the set holds a key under `kid`.
    pub(super) fn has(&self, kid: Option<&str>) -> bool {
        self.keys.contains_key(&kid.map(str::to_owned))
    }

    /// How many keys it holds.
    pub(super) fn len(&self) -> usize {
        self.keys.len()
    }

    /// The signing keys of a JWKS document; keys this server cannot use (encryption keys, HMAC
    /// secrets, curves it does not verify, malformed ones) are left out.
    pub(super) fn from_document(document: &Value) -> Result<Self, String> {
        let listed = document.get("keys").and_then(Value::as_array).ok_or("no `keys` list")?;
        let mut keys = HashMap::new();
        for raw in listed.iter().take(MAX_KEYS) {
            let Ok(jwk) = serde_json::from_value::<Jwk>(raw.clone()) else { continue };
            if let Some(key) = usable(&jwk) {
                keys.insert(jwk.common.key_id.clone(), Arc::new(key));
            }
        }
        Ok(Self { keys })
    }
}

/// The verification key `jwk` is, if it is one this server may verify signatures with.
fn usable(jwk: &Jwk) -> Option<Key> {
    if jwk.common.public_key_use.as_ref().is_some_and(|u| *u != PublicKeyUse::Signature) {
        return None;
    }
    use Algorithm::{ES256, ES384, EdDSA, PS256, PS384, PS512, RS256, RS384, RS512};
    let mut algorithms = match &jwk.algorithm {
        AlgorithmParameters::RSA(_) => vec![RS256, RS384, RS512, PS256, PS384, PS512],
        AlgorithmParameters::EllipticCurve(ec) => match ec.curve {
            EllipticCurve::P256 => vec![ES256],
            EllipticCurve::P384 => vec![ES384],
            _ => return None,
        },
        AlgorithmParameters::OctetKeyPair(okp) if okp.curve == EllipticCurve::Ed25519 => vec![EdDSA],
        // HMAC secrets (`oct`) and everything else: never.
        _ => return None,
    };
    if let Some(named) = &jwk.common.key_algorithm {
        let named: Algorithm = named.to_string().parse().ok()?;
        algorithms.retain(|alg| *alg == named);
    }
    if algorithms.is_empty() {
        return None;
    }
    let decoding = DecodingKey::from_jwk(jwk).ok()?;
    Some(Key { decoding, algorithms })
}

/// Where the keys come from, and when they may be fetched again.
pub(super) struct Keys {
    issuer: String,
    /// `auth.oauth.jwks_uri`, or what the metadata said (found once).
    jwks_uri: tokio::sync::Mutex<Option<String>>,
    set: ArcSwap<KeySet>,
    /// When the last fetch started (on the app's clock), successful or not.
    last_fetch: std::sync::Mutex<Option<Nanos>>,
    /// One fetch at a time; the others wait for its keys.
    fetching: tokio::sync::Mutex<()>,
    min_gap: Nanos,
    clock: SharedClock,
    metrics: Arc<Metrics>,
}

/// Why a token's key cannot be had.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum NoKey {
    /// The set, fetched again or too recently to fetch, has no such key.
    Unknown,
    /// The keys could not be fetched; try again after this many nanoseconds.
    Unavailable(Nanos),
}

impl Keys {
    pub(super) fn new(
        issuer: &str,
        jwks_uri: &str,
        min_gap_seconds: u64,
        clock: SharedClock,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            issuer: issuer.to_owned(),
            jwks_uri: tokio::sync::Mutex::new((!jwks_uri.is_empty()).then(|| jwks_uri.to_owned())),
            set: ArcSwap::from_pointee(KeySet::default()),
            last_fetch: std::sync::Mutex::new(None),
            fetching: tokio::sync::Mutex::new(()),
            min_gap: Nanos::from_secs(min_gap_seconds),
            clock,
            metrics,
        }
    }

    /// The keys as they stand.
    pub(super) fn now(&self) -> arc_swap::Guard<Arc<KeySet>> {
        self.set.load()
    }

    /// How long until a fetch is allowed again (0: now).
    pub(super) fn wait_to_fetch(&self) -> Nanos {
        let now = self.clock.now();
        let last = *self.last_fetch.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        last.map_or(Nanos::ZERO, |at| at + self.min_gap - now)
    }

    /// How long ago the last fetch started (on the app's clock); `None` before the first.
    pub(super) fn age(&self) -> Option<Nanos> {
        let last = *self.last_fetch.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        last.map(|at| self.clock.now() - at)
    }

    /// Fetches the keys now, whatever the last fetch (at start-up).
    pub(super) async fn fetch_now(&self, fetch: &Fetch) -> Result<(), FetchError> {
        let _one = self.fetching.lock().await;
        self.fetch(fetch).await
    }

    /// The keys once a fetch for `kid` is done: fetched again if the set lacks `kid` and the last
    /// fetch is old enough, by this request or one it waits for.
    pub(super) async fn refreshed_for(&self, fetch: &Fetch, kid: Option<&str>) -> Result<Arc<KeySet>, NoKey> {
        let _one = self.fetching.lock().await;
        let set = self.set.load_full();
        if set.has(kid) {
            return Ok(set);
        }
        let wait = self.wait_to_fetch();
        if wait > Nanos::ZERO {
            // Fetched moments ago (perhaps while this request waited): an empty set means the
            // provider could not be reached, else the key is not one of its.
            return if set.len() == 0 { Err(NoKey::Unavailable(wait)) } else { Err(NoKey::Unknown) };
        }
        match self.fetch(fetch).await {
            Ok(()) => Ok(self.set.load_full()),
            Err(_) if self.set.load().len() > 0 => Err(NoKey::Unknown),
            Err(_) => Err(NoKey::Unavailable(self.min_gap)),
        }
    }

    /// One fetch of the JWKS (and of the metadata first, until its `jwks_uri` is known); the set
    /// is replaced only by a document that parses.
    async fn fetch(&self, fetch: &Fetch) -> Result<(), FetchError> {
        *self.last_fetch.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(self.clock.now());
        let fetched = self.fetch_set(fetch).await;
        self.metrics.jwks_fetch(fetched.is_ok());
        match fetched {
            Ok(set) => {
                tracing::debug!(target: "mcp_ratelimit::oauth", keys = set.len(), "fetched the authorization server's keys");
                self.set.store(Arc::new(set));
                Ok(())
            }
            Err(error) => {
                tracing::warn!(target: "mcp_ratelimit::oauth", %error, "could not fetch the authorization server's keys");
                Err(error)
            }
        }
    }

    async fn fetch_set(&self, fetch: &Fetch) -> Result<KeySet, FetchError> {
        let mut uri = self.jwks_uri.lock().await;
        let jwks_uri = match uri.as_ref() {
            Some(found) => found.clone(),
            None => {
                let found = fetch.jwks_uri_of(&self.issuer).await?;
                *uri = Some(found.clone());
                found
            }
        };
        drop(uri);
        let document = fetch.json(&jwks_uri).await?;
        KeySet::from_document(&document).map_err(|why| FetchError::Document { url: jwks_uri, why })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_signing_keys_this_server_can_use_are_kept() {
        let document = serde_json::json!({"keys": [
            {"kty": "RSA", "kid": "rsa", "n": "sXch", "e": "AQAB", "alg": "RS256", "use": "sig"},
            {"kty": "RSA", "kid": "enc", "n": "sXch", "e": "AQAB", "use": "enc"},
            {"kty": "oct", "kid": "secret", "k": "c2VjcmV0"},
            {"kty": "EC", "kid": "p521", "crv": "P-521", "x": "AA", "y": "AA"},
            {"kty": "EC", "kid": "p256", "crv": "P-256", "x": "AA", "y": "AA"},
            {"kty": "weird", "kid": "what"},
            "not even an object"
        ]});
        let set = KeySet::from_document(&document).expect("a set");
        assert_eq!(set.len(), 2, "the RSA signing key and the P-256 key");
        assert!(set.key_for(Some("rsa"), Algorithm::RS256).is_some());
        assert!(set.key_for(Some("rsa"), Algorithm::PS256).is_none(), "the key names RS256 only");
        assert!(set.key_for(Some("secret"), Algorithm::HS256).is_none(), "no HMAC key, ever");
        assert!(set.key_for(Some("p256"), Algorithm::ES256).is_some());
        assert!(set.key_for(Some("p256"), Algorithm::RS256).is_none());
        // Without a kid: the one key that fits, or none when several do.
        assert!(set.key_for(None, Algorithm::ES256).is_some());
        assert!(KeySet::from_document(&serde_json::json!({"no": "keys"})).is_err());
    }

    #[test]
    fn a_set_holds_at_most_its_bound() {
        let many: Vec<Value> = (0..200)
            .map(|i| serde_json::json!({"kty": "RSA", "kid": format!("k{i}"), "n": "sXch", "e": "AQAB"}))
            .collect();
        let set = KeySet::from_document(&serde_json::json!({ "keys": many })).expect("a set");
        assert_eq!(set.len(), MAX_KEYS);
    }
}
