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
//! A bearer token that is no configured key, with `[auth.oauth]` on, is an OAuth access token to
//! verify ([`Identity::Token`]): the HTTP layer verifies it (signature, issuer, audience, expiry)
//! and names its caller from the verified claims ([`Identifier::subject`]): `sub:` and 16 hex
//! digits derived from (issuer, `sub`) as a key's id is from the key, its tenant, tier and OAuth
//! client from the claims `[auth.oauth]` names. Such a caller is verified: the IdP vouches for it.
//! A token that fails is its address's unverified caller, as a made-up key is, and nothing of the
//! subject it names is touched. Values a claim gives (a tenant, a client id) are shown as they are
//! when they are short and plain, and hashed like keys otherwise (a Client ID Metadata Document's
//! id is a URL).
//!
//! The MCP session id is deliberately *not* an identity: a new session must not buy a fresh
//! budget. `X-Forwarded-For` is believed only from configured proxies, and then the caller is
//! the right-most address that is not one of them — anything further left was written by the
//! client and could be anything.

mod address;
mod caller;
mod identifier;
mod ids;
mod oauth;
#[cfg(test)]
mod tests;

pub use address::address_group;
pub use caller::{Caller, Proof, bucket_of};
pub use identifier::Identifier;
pub use ids::CallerIds;

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

/// What a request's credential says, before any token in it is verified. Its `Debug` never shows
/// the token.
pub enum Identity<'h> {
    /// The caller is known from the request alone: a configured key, an unverified caller (a
    /// made-up key or none, by its address), or stdio's local user.
    Caller(Caller),
    /// With `[auth.oauth]` on, a bearer token that is no configured key: an access token to
    /// verify. `unverified` is who the request is until it is verified, and if it fails: its
    /// address's unverified caller, as a made-up key would be.
    Token {
        /// The token as presented (never kept: hash it, verify it, drop it).
        token: &'h str,
        /// Its SHA-256, which caches a verification and names the unverified caller.
        digest: [u8; 32],
        /// The request's caller until the token is verified.
        unverified: Caller,
    },
}

impl std::fmt::Debug for Identity<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Identity::Caller(caller) => f.debug_tuple("Caller").field(caller).finish(),
            Identity::Token { unverified, .. } => {
                f.debug_struct("Token").field("unverified", unverified).finish_non_exhaustive()
            }
        }
    }
}

impl Identity<'_> {
    /// The caller as the request stands without verifying a token: a token's unverified caller.
    /// For a place that cannot verify one (no HTTP layer in front): such a caller gains nothing a
    /// made-up key would not.
    pub fn without_verifying(self) -> Caller {
        match self {
            Identity::Caller(caller) | Identity::Token { unverified: caller, .. } => caller,
        }
    }
}

/// Why verified claims name no caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NoSubject {
    /// No `sub` claim, or one that is not a string of 1-1024 characters.
    #[error("the token names no subject (`sub`)")]
    Missing,
}

/// Why an operator's name for a caller names nobody this server can act on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnknownCaller {
    /// Not of any form a caller id takes.
    #[error("`{0}` is not a caller id: expected tok:<16 hex digits>, sub:<16 hex digits>, ip:<address> or local")]
    Malformed(String),
    /// A `tok:` id that no configured key has, without the address it calls from.
    #[error(
        "`{0}` is not a configured key's caller (GET /admin/keys lists those); a made-up key's budgets are          kept with the address it calls from: give it as `from` (e.g. from=ip:203.0.113.7)"
    )]
    NeedsAddress(String),
    /// A tier no `[tiers]` entry names.
    #[error("`{0}` is not a configured tier")]
    UnknownTier(String),
    /// `from` is not an address as the server names them.
    #[error(
        "`{0}` is not an address: expected ip:<IPv4 address>, ip6:<IPv6 network>/<server.ipv6_prefix> (e.g. \
         ip6:2001:db8::/64) or ip:unknown"
    )]
    BadAddress(String),
}
