//! Webhooks signed the Standard Webhooks way (<https://www.standardwebhooks.com>), as Replicate,
//! fal and OpenAI's video API send them when a job ends: the paid API (and the mock) signs, the
//! server's `POST /webhooks/upstream` verifies.
//!
//! A webhook carries three headers: `webhook-id` (the message's id, the same on every retry of
//! it), `webhook-timestamp` (Unix seconds when it was sent) and `webhook-signature`, one or more
//! space-separated `v1,<base64 HMAC-SHA256>` of `"<id>.<timestamp>.<body>"` under the secret's key
//! (more than one while a sender rotates its secret). The secret is `whsec_<base64 key>`.
//!
//! Verification compares in constant time ([`Mac::verify_slice`]) and refuses a timestamp more
//! than [`TOLERANCE_SECONDS`] from now, so a captured webhook cannot be replayed later; the id
//! refuses a replay within that window (the route keeps the ids it took).

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// How far a webhook's timestamp may be from now, either way, in seconds.
pub const TOLERANCE_SECONDS: u64 = 300;

/// The longest `webhook-id` taken (a real one is a few dozen characters).
pub const MAX_ID_LEN: usize = 128;

/// The prefix of a Standard Webhooks secret.
const PREFIX: &str = "whsec_";

/// The key a `whsec_` secret names. Never printed.
#[derive(Clone)]
pub struct WebhookKey(Vec<u8>);

impl std::fmt::Debug for WebhookKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WebhookKey(<redacted>)")
    }
}

impl WebhookKey {
    /// The key of `secret`, `whsec_<base64>` (the base64 of at least 16 bytes); why not otherwise
    /// (the message never repeats the secret).
    pub fn parse(secret: &str) -> Result<Self, &'static str> {
        let Some(encoded) = secret.strip_prefix(PREFIX) else {
            return Err("must start with `whsec_` (a Standard Webhooks secret: whsec_<base64 key>)");
        };
        match STANDARD.decode(encoded) {
            Ok(key) if key.len() >= 16 => Ok(Self(key)),
            Ok(_) => Err("the key after `whsec_` must be at least 16 bytes (24 base64 characters)"),
            Err(_) => Err("the text after `whsec_` is not base64"),
        }
    }

    fn mac(&self, id: &str, timestamp: u64, body: &[u8]) -> Hmac<Sha256> {
        // HMAC takes a key of any length: this cannot fail.
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes any key length");
        mac.update(id.as_bytes());
        mac.update(b".");
        mac.update(timestamp.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        mac
    }

    /// The `webhook-signature` value of `body` sent as message `id` at `timestamp`.
    pub fn sign(&self, id: &str, timestamp: u64, body: &[u8]) -> String {
        format!("v1,{}", STANDARD.encode(self.mac(id, timestamp, body).finalize().into_bytes()))
    }

    /// Checks a webhook's headers against its `body` at `now` (Unix seconds): its id when every
    /// check holds, else why it is refused.
    pub fn verify<'a>(&self, headers: &'a http::HeaderMap, body: &[u8], now: u64) -> Result<&'a str, Unverified> {
        let header = |name: &'static str| {
            headers.get(name).and_then(|v| v.to_str().ok()).filter(|v| !v.is_empty()).ok_or(Unverified::Missing(name))
        };
        let id = header("webhook-id")?;
        if id.len() > MAX_ID_LEN {
            return Err(Unverified::Malformed("webhook-id is too long"));
        }
        let timestamp: u64 = header("webhook-timestamp")?
            .parse()
            .map_err(|_| Unverified::Malformed("webhook-timestamp is not a number"))?;
        let signatures = header("webhook-signature")?;
        if timestamp.abs_diff(now) > TOLERANCE_SECONDS {
            return Err(Unverified::Stale);
        }
        let expected = self.mac(id, timestamp, body);
        let signed = signatures
            .split(' ')
            .filter_map(|s| s.strip_prefix("v1,"))
            .filter_map(|s| STANDARD.decode(s).ok())
            .any(|tag| expected.clone().verify_slice(&tag).is_ok());
        if signed { Ok(id) } else { Err(Unverified::BadSignature) }
    }
}

/// Where the paid API is asked to send its webhooks, and the key they are signed with
/// (`upstream.webhook_url`, `upstream.webhook_secret`). Its `Debug` shows neither the URL's
/// password nor the key.
#[derive(Clone)]
pub struct WebhookTarget {
    /// This server's `/webhooks/upstream`, as the paid API reaches it.
    pub url: reqwest::Url,
    /// The key its webhooks are signed with.
    pub key: WebhookKey,
}

impl std::fmt::Debug for WebhookTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookTarget")
            .field("url", &crate::redact::url(self.url.as_str()))
            .field("key", &self.key)
            .finish()
    }
}

/// Why a webhook was not taken as the paid API's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Unverified {
    /// A header it must carry is absent or empty.
    #[error("the header {0} is missing")]
    Missing(&'static str),
    /// A header cannot be read.
    #[error("{0}")]
    Malformed(&'static str),
    /// Its timestamp is more than [`TOLERANCE_SECONDS`] away from now.
    #[error("webhook-timestamp is more than 300 seconds from now")]
    Stale,
    /// No `v1` signature in it is the body's under our key.
    #[error("no signature in webhook-signature matches")]
    BadSignature,
}

impl Unverified {
    /// The `outcome` label it is counted under in `/metrics`.
    pub fn outcome(self) -> &'static str {
        match self {
            Self::Missing(_) | Self::Malformed(_) | Self::BadSignature => "bad_signature",
            Self::Stale => "stale",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(id: &str, timestamp: &str, signature: &str) -> http::HeaderMap {
        let mut headers = http::HeaderMap::new();
        for (name, value) in [("webhook-id", id), ("webhook-timestamp", timestamp), ("webhook-signature", signature)] {
            headers.insert(name, value.parse().expect("a header value"));
        }
        headers
    }

    /// The example of the Standard Webhooks reference libraries (svix), checked there.
    const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
    const AT: u64 = 1_614_265_330;
    const BODY: &[u8] = br#"{"test": 2432232314}"#;
    const SIGNATURE: &str = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";

    #[test]
    fn signs_as_the_reference_libraries_do() {
        let key = WebhookKey::parse(SECRET).expect("a secret");
        assert_eq!(key.sign(ID, AT, BODY), SIGNATURE);
        assert_eq!(key.verify(&headers(ID, &AT.to_string(), SIGNATURE), BODY, AT + 10), Ok(ID));
    }

    #[test]
    fn any_of_several_signatures_may_match_while_a_secret_rotates() {
        let key = WebhookKey::parse(SECRET).expect("a secret");
        let both = format!("v1,AAAA {SIGNATURE}");
        assert_eq!(key.verify(&headers(ID, &AT.to_string(), &both), BODY, AT), Ok(ID));
    }

    #[test]
    fn a_changed_body_id_or_time_an_old_webhook_or_a_missing_header_is_refused() {
        let key = WebhookKey::parse(SECRET).expect("a secret");
        let at = AT.to_string();
        let refused = |h: http::HeaderMap, body: &[u8], now: u64| key.verify(&h, body, now).err();
        assert_eq!(refused(headers(ID, &at, SIGNATURE), br#"{"test": 1}"#, AT), Some(Unverified::BadSignature));
        assert_eq!(refused(headers("msg_other", &at, SIGNATURE), BODY, AT), Some(Unverified::BadSignature));
        assert_eq!(refused(headers(ID, "1614265331", SIGNATURE), BODY, AT), Some(Unverified::BadSignature));
        assert_eq!(refused(headers(ID, &at, "v2,abc"), BODY, AT), Some(Unverified::BadSignature));
        assert_eq!(refused(headers(ID, &at, SIGNATURE), BODY, AT + 301), Some(Unverified::Stale));
        assert_eq!(refused(headers(ID, &at, SIGNATURE), BODY, AT - 301), Some(Unverified::Stale));
        assert_eq!(refused(headers(ID, "soon", SIGNATURE), BODY, AT).map(Unverified::outcome), Some("bad_signature"));
        let mut missing = headers(ID, &at, SIGNATURE);
        missing.remove("webhook-signature");
        assert_eq!(refused(missing, BODY, AT), Some(Unverified::Missing("webhook-signature")));
        let long = "m".repeat(MAX_ID_LEN + 1);
        let signed_long = key.sign(&long, AT, BODY);
        assert_eq!(
            refused(headers(&long, &at, &signed_long), BODY, AT),
            Some(Unverified::Malformed("webhook-id is too long")),
            "signed, but too long an id to keep"
        );
        let other = WebhookKey::parse("whsec_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA").expect("a secret");
        assert_eq!(other.verify(&headers(ID, &at, SIGNATURE), BODY, AT).err(), Some(Unverified::BadSignature));
    }

    #[test]
    fn a_secret_is_whsec_and_base64_of_enough_bytes_and_never_printed() {
        assert!(WebhookKey::parse("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").is_err());
        assert!(WebhookKey::parse("whsec_not base64!").is_err());
        assert!(WebhookKey::parse("whsec_AAAA").is_err());
        let key = WebhookKey::parse(SECRET).expect("a secret");
        assert!(!format!("{key:?}").contains("MfKQ"));
    }
}
