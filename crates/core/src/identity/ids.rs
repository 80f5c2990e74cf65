//! Caller ids derived from a credential's SHA-256: unkeyed, or keyed with `auth.id_secret` so
//! that an id, which is shown, says nothing about the key.

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::config::LimitsConfig;

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

    /// The id of the subject `sub` of `issuer`: `sub:` and 64 bits of (the HMAC of) the SHA-256
    /// of both, each length-prefixed so no two pairs share an input.
    pub fn id_of_subject(&self, issuer: &str, sub: &str) -> String {
        let digest: [u8; 32] = Sha256::new()
            .chain_update((issuer.len() as u64).to_be_bytes())
            .chain_update(issuer.as_bytes())
            .chain_update((sub.len() as u64).to_be_bytes())
            .chain_update(sub.as_bytes())
            .finalize()
            .into();
        let mut id = self.id_of_digest(&digest);
        id.replace_range(..4, "sub:");
        id
    }

    /// A value a claim gave (a tenant, an OAuth client id) as the server shows it and keys budgets
    /// by: as it is when it is 1-64 plain characters (letters, digits, `-_.@+/`), else `#` and 64
    /// bits of its keyed digest, so a URL, a long or an odd value is a short, plain name and
    /// never collides with a plain one.
    pub fn shown(&self, value: &str) -> String {
        let plain = (1..=64).contains(&value.len())
            && value.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.@+/".contains(&b));
        if plain {
            return value.to_owned();
        }
        let mut id = self.id_of_digest(&Sha256::digest(value.as_bytes()).into());
        id.replace_range(..4, "#");
        id
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
