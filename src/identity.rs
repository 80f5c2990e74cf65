//! Who is calling: the identity every budget hangs on.
//!
//! A caller is named by a one-way hash of its credential (`tok:` + the first 16 hex digits of
//! SHA-256 of the Bearer token or X-API-Key), else by its peer address (`ip:…`), and is
//! `local` over stdio. The raw token is dropped right here: it never reaches a map key, a log
//! line or a metric label. The MCP session id is deliberately *not* an identity: opening a new
//! session must not buy a fresh budget.

use std::fmt;
use std::net::IpAddr;

use http::HeaderMap;
use sha2::{Digest, Sha256};

/// The identity a request is charged to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Caller {
    id: String,
}

impl Caller {
    /// A caller known by a credential; only a hash of it is kept.
    pub fn from_token(token: &str) -> Self {
        let digest = Sha256::digest(token.as_bytes());
        let mut id = String::with_capacity(20);
        id.push_str("tok:");
        for byte in &digest[..8] {
            id.push_str(&format!("{byte:02x}"));
        }
        Self { id }
    }

    /// A caller known only by its network address.
    pub fn from_ip(ip: IpAddr) -> Self {
        Self { id: format!("ip:{ip}") }
    }

    /// The single caller behind a stdio transport.
    pub fn local() -> Self {
        Self { id: "local".to_owned() }
    }

    /// The stable, non-secret identifier (`tok:…`, `ip:…` or `local`).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Identifies the caller of an HTTP request: a Bearer token or X-API-Key if present and
    /// non-empty, else the peer address.
    pub fn from_request(headers: &HeaderMap, peer: Option<IpAddr>) -> Self {
        if let Some(token) = credential(headers) {
            return Self::from_token(token);
        }
        match peer {
            Some(ip) => Self::from_ip(ip),
            None => Self { id: "ip:unknown".to_owned() },
        }
    }
}

impl fmt::Display for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.id)
    }
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
            h.insert(*k, v.parse().expect("valid header"));
        }
        h
    }

    #[test]
    fn token_is_hashed_never_kept() {
        let c = Caller::from_request(&headers(&[("authorization", "Bearer sk-live-secret")]), None);
        assert!(c.id().starts_with("tok:") && c.id().len() == 20);
        assert!(!c.id().contains("secret"));
    }

    #[test]
    fn bearer_and_api_key_with_the_same_token_are_one_caller() {
        let a = Caller::from_request(&headers(&[("authorization", "bearer abc")]), None);
        let b = Caller::from_request(&headers(&[("x-api-key", "abc")]), None);
        assert_eq!(a, b);
    }

    #[test]
    fn no_credential_falls_back_to_the_peer_address() {
        let ip: IpAddr = "127.0.0.9".parse().expect("ip");
        let c = Caller::from_request(&headers(&[("authorization", "Bearer  ")]), Some(ip));
        assert_eq!(c.id(), "ip:127.0.0.9");
    }
}
