//! Who is calling: the identity every budget hangs on.
//!
//! A caller is named by a one-way hash of its credential (`tok:` + the first 16 hex digits of
//! SHA-256 of the Bearer token or X-API-Key), else by its address (`ip:…`), and is `local`
//! over stdio. The raw token is dropped right here: it never reaches a map key, a log line or
//! a metric label. A configured key also names the caller's tenant (whose budget it shares)
//! and tier (which scales its own budgets).
//!
//! Caller ids are shown (refusal scopes, `rate_limit_status`, logs), and an unkeyed hash of a
//! short key can be reversed by trying keys. With `auth.id_secret` the id is keyed instead:
//! `tok:` + 16 hex digits of HMAC-SHA256(id_secret, SHA-256(key)) ([`CallerIds`]). It is
//! computed from the key's SHA-256, so keys configured only by their digest get one too.
//!
//! A credential that is not a configured key proves nothing: anyone can make one up. Such a
//! caller (and one with no credential) is *unverified*, and also carries the address it came
//! from (IPv6 by its network of `server.ipv6_prefix` bits, /64 unless set: one host can hold a
//! /64 whole), so the guard can charge every unverified caller of one address to one shared
//! budget: rotating made-up keys buys nothing. [`address_group`] is that grouping, for whatever
//! else counts per address (sessions, connections).
//!
//! The MCP session id is deliberately *not* an identity: a new session must not buy a fresh
//! budget. `X-Forwarded-For` is believed only from configured proxies, and then the caller is
//! the right-most address that is not one of them — anything further left was written by the
//! client and could be anything.

use std::collections::HashMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use hmac::{Hmac, Mac};
use http::HeaderMap;
use ipnet::IpNet;
use sha2::{Digest, Sha256};

use crate::clock::Nanos;
use crate::config::{ApiKey, LimitsConfig};

/// The identity a request is charged to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Caller {
    id: String,
    tenant: Option<Arc<str>>,
    tier: Arc<str>,
    unverified_from: Option<Arc<str>>,
    /// [`bucket_of`] the id, computed once: every refusal reports it, some several times.
    bucket: u8,
}

/// How a credential's caller id is derived from its SHA-256: unkeyed (the first 64 bits of the
/// digest), or keyed with `auth.id_secret` (the first 64 bits of HMAC-SHA256(id_secret, digest)),
/// so that an id, which is shown, says nothing about the key without the secret. Every instance
/// sharing budgets must derive ids alike: the id is every budget's key.
#[derive(Clone)]
pub struct CallerIds {
    /// HMAC-SHA256 keyed with the secret, ready to be cloned per id; `None`: unkeyed.
    mac: Option<Hmac<Sha256>>,
}

impl CallerIds {
    /// The ids `config` asks for: keyed with its `auth.id_secret`, or unkeyed without one.
    pub fn of(config: &LimitsConfig) -> Self {
        config.auth.id_secret.as_ref().map_or_else(Self::unkeyed, |secret| Self::keyed(secret.expose()))
    }

    /// Ids as the first 64 bits of the credential's SHA-256 (no `auth.id_secret`).
    pub fn unkeyed() -> Self {
        Self { mac: None }
    }

    /// Ids keyed with `secret` (its bytes are the HMAC key).
    pub fn keyed(secret: &str) -> Self {
        // RFC 2104: a key longer than SHA-256's 64-byte block is hashed first, and the key is then
        // zero-padded to the block. Doing that here gives the same MAC through the infallible
        // fixed-size constructor.
        let mut block = [0u8; 64];
        if secret.len() > block.len() {
            block[..32].copy_from_slice(&Sha256::digest(secret.as_bytes()));
        } else {
            block[..secret.len()].copy_from_slice(secret.as_bytes());
        }
        Self { mac: Some(<Hmac<Sha256> as hmac::digest::KeyInit>::new(&block.into())) }
    }

    /// Whether ids are keyed with a secret.
    pub fn is_keyed(&self) -> bool {
        self.mac.is_some()
    }

    /// The id of the caller whose credential has SHA-256 `digest`: `tok:` and 64 bits of the
    /// digest, or of its HMAC, so the credential itself cannot be read back.
    pub fn id_of_digest(&self, digest: &[u8; 32]) -> String {
        match &self.mac {
            None => tok_id(&digest[..8]),
            Some(mac) => {
                let mut mac = mac.clone();
                mac.update(digest);
                tok_id(&mac.finalize().into_bytes()[..8])
            }
        }
    }

    /// The id of the caller presenting `token`.
    pub fn id_of_token(&self, token: &str) -> String {
        self.id_of_digest(&Sha256::digest(token.as_bytes()).into())
    }
}

impl PartialEq for CallerIds {
    /// Whether both give every credential the same id: both unkeyed, or keyed alike (told apart
    /// by the id each gives one fixed digest).
    fn eq(&self, other: &Self) -> bool {
        self.is_keyed() == other.is_keyed() && self.id_of_digest(&[0; 32]) == other.id_of_digest(&[0; 32])
    }
}

impl fmt::Debug for CallerIds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CallerIds").field("keyed", &self.is_keyed()).finish()
    }
}

/// `tok:` and the hex digits of `bytes`.
fn tok_id(bytes: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut id = String::with_capacity(4 + 2 * bytes.len());
    id.push_str("tok:");
    for byte in bytes {
        id.push(char::from(HEX[usize::from(byte >> 4)]));
        id.push(char::from(HEX[usize::from(byte & 0x0f)]));
    }
    id
}

impl Caller {
    fn new(id: String, tenant: Option<Arc<str>>, tier: Arc<str>, unverified_from: Option<Arc<str>>) -> Self {
        let bucket = bucket_of(&id);
        Self { id, tenant, tier, unverified_from, bucket }
    }

    fn from_digest(
        ids: &CallerIds,
        digest: &[u8; 32],
        tenant: Option<Arc<str>>,
        tier: Arc<str>,
        unverified_from: Option<Arc<str>>,
    ) -> Self {
        Self::new(ids.id_of_digest(digest), tenant, tier, unverified_from)
    }

    /// A caller known by a credential (tier `default`, no tenant, not tied to an address), named
    /// as a server without `auth.id_secret` names it.
    pub fn from_token(token: &str) -> Self {
        Self::from_digest(&CallerIds::unkeyed(), &Sha256::digest(token.as_bytes()).into(), None, "default".into(), None)
    }

    /// The caller a configured key names, with its tenant and tier, its id derived by `ids` (the
    /// config's `auth.id_secret`): what [`Identifier::identify`] returns for that key, for callers
    /// that act as a key without holding it (the simulator).
    pub fn of_key(key: &ApiKey, ids: &CallerIds) -> Self {
        Self::from_digest(ids, &key.sha256, key.tenant.as_deref().map(Arc::from), Arc::from(key.tier.as_str()), None)
    }

    /// The stable, non-secret identifier (`tok:…`, `ip:…` or `local`).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The tenant whose shared budget this caller draws on, if its key has one.
    pub fn tenant(&self) -> Option<&str> {
        self.tenant.as_deref()
    }

    /// [`Caller::tenant`], shared (for records that keep it).
    pub fn tenant_shared(&self) -> Option<&Arc<str>> {
        self.tenant.as_ref()
    }

    /// The tier scaling this caller's own budgets.
    pub fn tier(&self) -> &str {
        &self.tier
    }

    /// For a caller without a configured key, the address it came from (`ip:…`, or `ip6:…/64`
    /// with the configured prefix), whose budget all such callers share; `None` for configured
    /// keys and stdio.
    pub fn unverified_from(&self) -> Option<&str> {
        self.unverified_from.as_deref()
    }

    /// A small, stable bucket (0-15) for metric labels: enough to see whether rejections come
    /// from a few callers or many, never enough to name one.
    pub fn bucket(&self) -> u8 {
        self.bucket
    }
}

/// The 16-way bucket (0-15) of an identifier (a caller id, a tenant's flow), for metric labels.
pub fn bucket_of(id: &str) -> u8 {
    Sha256::digest(id.as_bytes())[0] & 0x0f
}

impl fmt::Display for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.id)
    }
}

/// Why a request has no usable identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Unauthorized {
    /// `auth.required` is on and the request presents no credential.
    #[error("an API key is required: send `Authorization: Bearer <key>` or `X-API-Key: <key>`")]
    Missing,
    /// `auth.required` is on and the credential is not a configured key.
    #[error("this API key is not recognised")]
    Unknown,
}

#[derive(Debug)]
struct KeyInfo {
    tenant: Option<Arc<str>>,
    tier: Arc<str>,
}

/// Why an operator's name for a caller names nobody this server can act on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnknownCaller {
    /// Not of any form a caller id takes.
    #[error("`{0}` is not a caller id: expected tok:<16 hex digits>, ip:<address> or local")]
    Malformed(String),
    /// A `tok:` id that no configured key has, without the address it calls from.
    #[error(
        "`{0}` is not a configured key's caller (GET /admin/keys lists those); a made-up key's budgets are          kept with the address it calls from: give it as `from` (e.g. from=ip:203.0.113.7)"
    )]
    NeedsAddress(String),
    /// `from` is not an address as the server names them.
    #[error(
        "`{0}` is not an address: expected ip:<IPv4 address>, ip6:<IPv6 network>/<server.ipv6_prefix> (e.g. \
         ip6:2001:db8::/64) or ip:unknown"
    )]
    BadAddress(String),
}

/// Turns requests into callers, per the `[auth]` and `[server]` config.
pub struct Identifier {
    keys: HashMap<[u8; 32], KeyInfo>,
    ids: CallerIds,
    required: bool,
    anonymous_tier: Arc<str>,
    trust_proxy: bool,
    trusted_proxies: Vec<IpNet>,
    ipv6_prefix: u8,
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
            .finish()
    }
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
    pub fn by_id(&self, id: &str, from: Option<&str>) -> Result<Caller, UnknownCaller> {
        if id == "local" {
            return Ok(self.local());
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

    /// Identifies the caller of an HTTP request from its credential, else its address.
    pub fn identify(&self, headers: &HeaderMap, peer: Option<IpAddr>) -> Result<Caller, Unauthorized> {
        match credential(headers) {
            Some(token) => {
                let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
                match self.keys.get(&digest) {
                    Some(info) => {
                        Ok(Caller::from_digest(&self.ids, &digest, info.tenant.clone(), info.tier.clone(), None))
                    }
                    None if self.required => Err(Unauthorized::Unknown),
                    None => {
                        let from = address_of(self.client_ip(headers, peer), self.ipv6_prefix);
                        let tier = self.anonymous_tier.clone();
                        Ok(Caller::from_digest(&self.ids, &digest, None, tier, Some(from.into())))
                    }
                }
            }
            None if self.required => Err(Unauthorized::Missing),
            None => {
                let ip = self.client_ip(headers, peer);
                let id = match ip {
                    Some(ip) => format!("ip:{ip}"),
                    None => "ip:unknown".to_owned(),
                };
                let from = Some(Arc::from(address_of(ip, self.ipv6_prefix)));
                Ok(Caller::new(id, None, self.anonymous_tier.clone(), from))
            }
        }
    }

    /// Whether `ip` (canonical: an IPv4-mapped IPv6 address is its IPv4 one) is a trusted proxy,
    /// whether the proxy is written as IPv4 (`127.0.0.1/8`) or IPv4-mapped (`::ffff:10.0.0.0/104`).
    /// When a request that reached this server at `now` (on the guard's clock, which counts from
    /// the Unix epoch) arrived: `now`, or, with `trust_proxy` and a trusted peer, the earlier
    /// `X-Request-Start` that proxy stamped on it (`t=` seconds, milliseconds or microseconds
    /// since the epoch, as nginx, HAProxy and Heroku's router write it), so the time it queued in
    /// front of the server counts too. Never later than `now`; anyone else's stamp is ignored (it
    /// would let a caller say the server is behind).
    pub fn arrived(&self, headers: &HeaderMap, peer: Option<IpAddr>, now: Nanos) -> Nanos {
        let Some(peer) = peer.map(|p| p.to_canonical()) else { return now };
        if !self.trust_proxy || !self.trusted(peer) {
            return now;
        }
        headers
            .get("x-request-start")
            .and_then(|v| v.to_str().ok())
            .and_then(request_start)
            .map_or(now, |stamped| stamped.min(now))
    }

    fn trusted(&self, ip: IpAddr) -> bool {
        let mapped = match ip {
            IpAddr::V4(v4) => Some(IpAddr::V6(v4.to_ipv6_mapped())),
            IpAddr::V6(_) => None,
        };
        self.trusted_proxies.iter().any(|net| net.contains(&ip) || mapped.is_some_and(|m| net.contains(&m)))
    }

    /// The peer, or with `trust_proxy` and a trusted peer, the right-most untrusted
    /// `X-Forwarded-For` hop. Addresses are canonical: on a dual-stack listener an IPv4 client
    /// arrives as `::ffff:a.b.c.d`, and it is `a.b.c.d` both to `server.trusted_proxies` and in
    /// the caller's `ip:` id.
    fn client_ip(&self, headers: &HeaderMap, peer: Option<IpAddr>) -> Option<IpAddr> {
        let peer = peer?.to_canonical();
        if !self.trust_proxy || !self.trusted(peer) {
            return Some(peer);
        }
        let hops = headers
            .get_all("x-forwarded-for")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .collect::<Vec<_>>();
        let mut client = peer;
        for hop in hops.iter().rev() {
            let Some(ip) = parse_hop(hop).map(|ip| ip.to_canonical()) else { break };
            client = ip;
            if !self.trusted(ip) {
                break;
            }
        }
        Some(client)
    }
}

/// An `X-Request-Start` value in nanoseconds since the Unix epoch: `t=` (optional) and a number
/// of seconds (a fraction allowed), milliseconds or microseconds, told apart by size as the
/// monitoring tools that read it do.
fn request_start(value: &str) -> Option<Nanos> {
    let number = value.trim();
    let number = number.strip_prefix("t=").unwrap_or(number).trim();
    let reading: f64 = number.parse().ok().filter(|n: &f64| n.is_finite() && *n >= 0.0)?;
    let per_unit = if reading < 1e11 {
        1e9
    } else if reading < 1e14 {
        1e6
    } else if reading < 1e17 {
        1e3
    } else {
        1.0
    };
    let nanos = reading * per_unit;
    (nanos < u64::MAX as f64).then_some(nanos as Nanos)
}

/// The address `ip` counts as wherever callers are counted per address: an IPv4 address as it
/// is (an IPv4-mapped IPv6 one as its IPv4 address), an IPv6 address as its network of
/// `ipv6_prefix` bits (host bits zero). A single host is routinely given a whole /64, so the
/// addresses inside a prefix cost nothing to rotate.
pub fn address_group(ip: IpAddr, ipv6_prefix: u8) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => {
            let bits = u32::from(ipv6_prefix.min(128));
            let mask = u128::MAX.checked_shl(128 - bits).unwrap_or(0);
            IpAddr::V6(std::net::Ipv6Addr::from(u128::from(v6) & mask))
        }
    }
}

/// The address an unverified caller is charged to: an IPv4 address, or an IPv6 network of
/// `ipv6_prefix` bits ([`address_group`]).
fn address_of(ip: Option<IpAddr>, ipv6_prefix: u8) -> String {
    match ip.map(|ip| address_group(ip, ipv6_prefix)) {
        Some(IpAddr::V4(v4)) => format!("ip:{v4}"),
        Some(IpAddr::V6(net)) => format!("ip6:{net}/{ipv6_prefix}"),
        None => "ip:unknown".to_owned(),
    }
}

/// An address as [`address_of`] writes it (`ip:…`, `ip6:…/<ipv6_prefix>`, `ip:unknown`), in that
/// form; an `ip6:` network of another prefix length names no address this server counts.
fn canonical_address(text: &str, ipv6_prefix: u8) -> Option<String> {
    if text == "ip:unknown" {
        return Some(text.to_owned());
    }
    if let Some(ip) = text.strip_prefix("ip:") {
        return Some(address_of(Some(ip.parse().ok()?), ipv6_prefix));
    }
    let (net, prefix) = text.strip_prefix("ip6:")?.rsplit_once('/')?;
    if prefix.parse::<u8>().ok()? != ipv6_prefix {
        return None;
    }
    let net = net.parse::<std::net::Ipv6Addr>().ok()?;
    Some(address_of(Some(IpAddr::V6(net)), ipv6_prefix))
}

/// One `X-Forwarded-For` entry: an address, possibly with a port or IPv6 brackets.
fn parse_hop(hop: &str) -> Option<IpAddr> {
    hop.parse::<IpAddr>()
        .ok()
        .or_else(|| hop.parse::<std::net::SocketAddr>().ok().map(|s| s.ip()))
        .or_else(|| hop.strip_prefix('[')?.strip_suffix(']')?.parse().ok())
}

/// The credential a request presents, if any.
fn credential(headers: &HeaderMap) -> Option<&str> {
    let bearer = headers.get(http::header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| {
        let (scheme, token) = v.trim().split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
    });
    let api_key = || headers.get("x-api-key").and_then(|v| v.to_str().ok()).map(str::trim);
    bearer.filter(|t| !t.is_empty()).or_else(|| api_key().filter(|t| !t.is_empty()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, v.parse().expect("valid header"));
        }
        h
    }

    fn identifier(toml: &str) -> Identifier {
        Identifier::new(&LimitsConfig::from_toml(toml, &crate::config::Catalogue::new()).expect("config"))
    }

    fn ip(s: &str) -> Option<IpAddr> {
        Some(s.parse().expect("ip"))
    }

    #[test]
    fn token_is_hashed_never_kept() {
        let c = identifier("").identify(&headers(&[("authorization", "Bearer sk-live-secret")]), None).expect("caller");
        // The first 16 hex digits of SHA-256("sk-live-secret").
        let digest = Sha256::digest(b"sk-live-secret");
        let expected: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(c.id(), format!("tok:{expected}"));
        assert!(!c.id().contains("secret"));
    }

    #[test]
    fn bearer_and_api_key_with_the_same_token_are_one_caller() {
        let id = identifier("");
        let a = id.identify(&headers(&[("authorization", "bearer abc")]), None);
        let b = id.identify(&headers(&[("x-api-key", "abc")]), None);
        assert_eq!(a, b);
    }

    #[test]
    fn configured_keys_carry_tenant_and_tier() {
        let id = identifier("[[auth.keys]]\nkey = \"k1\"\ntenant = \"acme\"\ntier = \"admin\"\n");
        let c = id.identify(&headers(&[("x-api-key", "k1")]), None).expect("caller");
        assert_eq!((c.tenant(), c.tier()), (Some("acme"), "admin"));
        let config = LimitsConfig::from_toml(
            "[[auth.keys]]\nkey = \"k1\"\ntenant = \"acme\"\ntier = \"admin\"\n",
            &crate::config::Catalogue::new(),
        )
        .expect("config");
        assert_eq!(
            Caller::of_key(&config.auth.keys[0], &CallerIds::of(&config)),
            c,
            "the key's caller without the key"
        );
        let other = id.identify(&headers(&[("x-api-key", "k2")]), None).expect("anonymous");
        assert_eq!((other.tenant(), other.tier()), (None, "default"));
    }

    #[test]
    fn required_auth_refuses_missing_and_unknown_keys() {
        let id = identifier("[auth]\nrequired = true\n[[auth.keys]]\nkey = \"k1\"\n");
        assert_eq!(id.identify(&headers(&[]), ip("10.0.0.1")), Err(Unauthorized::Missing));
        assert_eq!(id.identify(&headers(&[("x-api-key", "nope")]), None), Err(Unauthorized::Unknown));
        assert!(id.identify(&headers(&[("authorization", "Bearer k1")]), None).is_ok());
    }

    #[test]
    fn an_operator_names_callers_as_the_server_shows_them() {
        let id = identifier("[[auth.keys]]\nkey = \"k1\"\ntenant = \"acme\"\n");
        let keyed = id.identify(&headers(&[("x-api-key", "k1")]), None).expect("caller");
        assert_eq!(id.by_id(keyed.id(), None), Ok(keyed.clone()));
        assert_eq!(id.member_of("acme"), Some(keyed));
        let anonymous = id.identify(&headers(&[("x-api-key", "made-up")]), ip("203.0.113.7")).expect("caller");
        assert_eq!(id.by_id(anonymous.id(), None), Err(UnknownCaller::NeedsAddress(anonymous.id().to_owned())));
        assert_eq!(id.by_id(anonymous.id(), Some("ip:203.0.113.7")), Ok(anonymous));
        let v6 = id.identify(&headers(&[]), ip("2001:db8::7")).expect("caller");
        assert_eq!(id.by_id("ip:2001:db8::7", None), Ok(v6));
        assert!(matches!(id.by_id("tok:xyz", None), Err(UnknownCaller::Malformed(_))));
        assert!(matches!(id.by_id("alice", None), Err(UnknownCaller::Malformed(_))));
    }

    #[test]
    fn a_request_start_stamp_counts_only_from_a_trusted_proxy_and_never_after_now() {
        let now: Nanos = 1_700_000_000_500_000_000;
        let stamped = |value: &str| headers(&[("x-request-start", value)]);
        let off = identifier("");
        assert_eq!(off.arrived(&stamped("t=1700000000.2"), ip("127.0.0.1"), now), now, "trust_proxy off");
        let on = identifier("[server]\ntrust_proxy = true\ntrusted_proxies = [\"10.0.0.0/8\"]\n");
        assert_eq!(on.arrived(&stamped("t=1700000000.2"), ip("203.0.113.9"), now), now, "an untrusted peer");
        assert_eq!(on.arrived(&stamped("t=1700000000.2"), None, now), now);
        let from_proxy = |value: &str| on.arrived(&stamped(value), ip("10.1.2.3"), now);
        // nginx's `t=${msec}` (seconds), Heroku's milliseconds, HAProxy's and Apache's microseconds.
        assert_eq!(from_proxy("t=1700000000.200"), 1_700_000_000_200_000_000);
        assert_eq!(from_proxy("1700000000300"), 1_700_000_000_300_000_000);
        assert_eq!(from_proxy("t=1700000000400000"), 1_700_000_000_400_000_000);
        for never_later in ["t=1800000000", "t=1e300", "NaN", "t=-5", "inf", "t=", "soon", "t=1700000000.2.1"] {
            assert_eq!(from_proxy(never_later), now, "{never_later}");
        }
    }

    #[test]
    fn forwarded_for_is_ignored_unless_trusted() {
        let spoofed = headers(&[("x-forwarded-for", "6.6.6.6")]);
        let off = identifier("");
        assert_eq!(off.identify(&spoofed, ip("127.0.0.1")).expect("caller").id(), "ip:127.0.0.1");
        let on = identifier("[server]\ntrust_proxy = true\n");
        assert_eq!(on.identify(&spoofed, ip("127.0.0.1")).expect("caller").id(), "ip:6.6.6.6");
        // A peer that is not a trusted proxy cannot forward for anyone.
        assert_eq!(on.identify(&spoofed, ip("8.8.8.8")).expect("caller").id(), "ip:8.8.8.8");
    }

    #[test]
    fn the_right_most_untrusted_hop_is_the_caller() {
        let on = identifier("[server]\ntrust_proxy = true\ntrusted_proxies = [\"127.0.0.1/8\", \"10.0.0.0/8\"]\n");
        let chain = headers(&[("x-forwarded-for", "1.1.1.1, 203.0.113.7"), ("x-forwarded-for", "10.1.2.3")]);
        assert_eq!(on.identify(&chain, ip("127.0.0.1")).expect("caller").id(), "ip:203.0.113.7");
        let garbage = headers(&[("x-forwarded-for", "not-an-ip, 10.1.2.3")]);
        assert_eq!(on.identify(&garbage, ip("127.0.0.1")).expect("caller").id(), "ip:10.1.2.3");
    }

    /// HMAC-SHA256 written out from RFC 2104 (a reference that shares no code with `hmac`).
    fn reference_hmac(key: &[u8], message: &[u8]) -> [u8; 32] {
        let mut block = [0u8; 64];
        if key.len() > 64 {
            block[..32].copy_from_slice(&Sha256::digest(key));
        } else {
            block[..key.len()].copy_from_slice(key);
        }
        let pad = |byte: u8| block.iter().map(|b| b ^ byte).collect::<Vec<u8>>();
        let inner = Sha256::new().chain_update(pad(0x36)).chain_update(message).finalize();
        Sha256::new().chain_update(pad(0x5c)).chain_update(inner).finalize().into()
    }

    const SECRET: &str = "id-secret-for-tests-0123456789";

    #[test]
    fn an_id_secret_keys_caller_ids_with_hmac_of_the_keys_sha256() {
        let keyed = identifier(&format!("[auth]\nid_secret = \"{SECRET}\"\n"));
        let c =
            keyed.identify(&headers(&[("authorization", "Bearer sk-live-secret")]), ip("10.0.0.1")).expect("caller");
        let digest: [u8; 32] = Sha256::digest(b"sk-live-secret").into();
        let mac = reference_hmac(SECRET.as_bytes(), &digest);
        let expected: String = mac[..8].iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(c.id(), format!("tok:{expected}"), "tok: + 16 hex of HMAC-SHA256(id_secret, SHA-256(key))");
        assert_ne!(c.id(), Caller::from_token("sk-live-secret").id(), "not the unkeyed SHA-256 prefix");
        let again = identifier(&format!("[auth]\nid_secret = \"{SECRET}\"\n"));
        assert_eq!(again.identify(&headers(&[("x-api-key", "sk-live-secret")]), ip("10.0.0.1")), Ok(c.clone()));
        // A secret longer than SHA-256's block is hashed first, as HMAC says.
        let long = "a-long-secret-".repeat(8);
        let long_id = identifier(&format!("[auth]\nid_secret = \"{long}\"\n"))
            .identify(&headers(&[("x-api-key", "sk-live-secret")]), None)
            .expect("caller");
        let mac = reference_hmac(long.as_bytes(), &digest);
        let expected: String = mac[..8].iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(long_id.id(), format!("tok:{expected}"));
        let other = identifier("[auth]\nid_secret = \"another-secret-of-enough-length\"\n");
        let other = other.identify(&headers(&[("x-api-key", "sk-live-secret")]), None).expect("caller");
        assert_ne!(other.id(), c.id(), "another secret, another id");
        // No secret (or only blanks): today's unkeyed ids.
        for plain in ["", "[auth]\nid_secret = \"   \"\n"] {
            let unkeyed =
                identifier(plain).identify(&headers(&[("x-api-key", "sk-live-secret")]), None).expect("caller");
            assert_eq!(unkeyed.id(), Caller::from_token("sk-live-secret").id());
        }
        assert!(!format!("{keyed:?}").contains(SECRET), "the secret never shows in a Debug print");
    }

    #[test]
    fn configured_keys_and_operators_use_the_keyed_ids() {
        let toml = format!(
            "[auth]\nid_secret = \"{SECRET}\"\n[[auth.keys]]\nkey = \"k1\"\ntenant = \"acme\"\n\
             [[auth.keys]]\nsha256 = \"{}\"\n",
            Sha256::digest(b"k2").iter().map(|b| format!("{b:02x}")).collect::<String>()
        );
        let config = LimitsConfig::from_toml(&toml, &crate::config::Catalogue::new()).expect("config");
        let id = Identifier::new(&config);
        let k1 = id.identify(&headers(&[("x-api-key", "k1")]), None).expect("caller");
        assert_eq!(k1.id(), CallerIds::of(&config).id_of_token("k1"));
        assert_eq!(Caller::of_key(&config.auth.keys[0], &CallerIds::of(&config)), k1);
        assert_eq!(id.configured(&config.auth.keys[0].sha256), Some(k1.clone()));
        assert_eq!(id.by_id(k1.id(), None), Ok(k1.clone()), "an operator finds it by the id the server shows");
        assert_eq!(id.member_of("acme"), Some(k1));
        // A key given only by its SHA-256 has its keyed id too.
        let k2 = id.identify(&headers(&[("x-api-key", "k2")]), None).expect("caller");
        assert_eq!((k2.id(), k2.unverified_from()), (CallerIds::of(&config).id_of_token("k2").as_str(), None));
        assert_eq!(id.by_id(k2.id(), None), Ok(k2));
        // An unkeyed id of a configured key names nobody configured.
        let unkeyed = Caller::from_token("k1");
        assert_eq!(id.by_id(unkeyed.id(), None), Err(UnknownCaller::NeedsAddress(unkeyed.id().to_owned())));
    }

    #[test]
    fn an_ipv4_mapped_peer_is_its_ipv4_address() {
        // A dual-stack listener sees IPv4 clients as ::ffff:a.b.c.d.
        let off = identifier("");
        let caller = off.identify(&headers(&[]), ip("::ffff:1.2.3.4")).expect("caller");
        assert_eq!((caller.id(), caller.unverified_from()), ("ip:1.2.3.4", Some("ip:1.2.3.4")));
        assert_eq!(off.identify(&headers(&[]), ip("1.2.3.4")), Ok(caller.clone()), "one caller either way");
        assert_eq!(off.by_id("ip:::ffff:1.2.3.4", None), Ok(caller), "an operator's mapped form names it too");
        // A plain IPv6 peer is left as it is.
        assert_eq!(off.identify(&headers(&[]), ip("2001:db8::7")).expect("caller").id(), "ip:2001:db8::7");
    }

    #[test]
    fn ipv6_callers_are_grouped_by_the_configured_prefix() {
        let addr = |s: &str| s.parse::<IpAddr>().expect("ip");
        // The grouping itself: host bits zero, IPv4 (and IPv4-mapped) left whole.
        assert_eq!(address_group(addr("2001:db8:1:2:3:4:5:6"), 64), addr("2001:db8:1:2::"));
        assert_eq!(address_group(addr("2001:db8:1:2ff:3:4:5:6"), 56), addr("2001:db8:1:200::"));
        assert_eq!(address_group(addr("2001:db8:1:2ff:3:4:5:6"), 48), addr("2001:db8:1::"));
        assert_eq!(address_group(addr("2001:db8::7"), 128), addr("2001:db8::7"));
        assert_eq!(address_group(addr("2001:db8::7"), 1), addr("::"));
        assert_eq!(address_group(addr("::ffff:1.2.3.4"), 48), addr("1.2.3.4"));
        assert_eq!(address_group(addr("1.2.3.4"), 48), addr("1.2.3.4"));
        // A /56 (256 /64s) is 256 addresses by default, one with ipv6_prefix = 56.
        let by = |toml: &str, peer: &str| {
            let caller = identifier(toml).identify(&headers(&[("x-api-key", "made-up")]), ip(peer)).expect("caller");
            caller.unverified_from().expect("unverified").to_owned()
        };
        assert_eq!(by("", "2001:db8:0:7::1"), "ip6:2001:db8:0:7::/64");
        assert_ne!(by("", "2001:db8:0:1::1"), by("", "2001:db8:0:2::1"));
        let wide = "[server]\nipv6_prefix = 56\n";
        assert_eq!(by(wide, "2001:db8:0:1::1"), "ip6:2001:db8::/56");
        assert_eq!(by(wide, "2001:db8:0:ff:ffff::1"), by(wide, "2001:db8:0:1::1"));
        assert_ne!(by(wide, "2001:db8:0:100::1"), by(wide, "2001:db8:0:1::1"), "the next /56");
        // An operator names such an address in the configured form only.
        let id = identifier(wide);
        let made_up = id.identify(&headers(&[("x-api-key", "made-up")]), ip("2001:db8:0:42::9")).expect("caller");
        assert_eq!(id.by_id(made_up.id(), Some("ip6:2001:db8::/56")), Ok(made_up.clone()));
        assert!(matches!(id.by_id(made_up.id(), Some("ip6:2001:db8::/64")), Err(UnknownCaller::BadAddress(_))));
    }

    #[test]
    fn an_ipv4_mapped_proxy_is_the_trusted_ipv4_proxy() {
        let on = identifier("[server]\ntrust_proxy = true\ntrusted_proxies = [\"127.0.0.1/8\", \"10.0.0.0/8\"]\n");
        let forwarded = headers(&[("x-forwarded-for", "203.0.113.7")]);
        assert_eq!(on.identify(&forwarded, ip("::ffff:127.0.0.1")).expect("caller").id(), "ip:203.0.113.7");
        // A mapped hop is trusted like its IPv4 address, and a mapped client is named unmapped.
        let chain = headers(&[("x-forwarded-for", "::ffff:198.51.100.9, ::ffff:10.1.2.3")]);
        assert_eq!(on.identify(&chain, ip("::ffff:127.0.0.1")).expect("caller").id(), "ip:198.51.100.9");
        // An untrusted mapped peer is still not a proxy.
        assert_eq!(on.identify(&forwarded, ip("::ffff:8.8.8.8")).expect("caller").id(), "ip:8.8.8.8");
        // A proxy written in mapped form trusts the same peers.
        let mapped = identifier("[server]\ntrust_proxy = true\ntrusted_proxies = [\"::ffff:10.0.0.0/104\"]\n");
        for peer in ["10.1.2.3", "::ffff:10.1.2.3"] {
            assert_eq!(mapped.identify(&forwarded, ip(peer)).expect("caller").id(), "ip:203.0.113.7", "{peer}");
        }
    }
}
