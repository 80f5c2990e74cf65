//! What is never shown: secrets from the config (a [`Secret`] prints as `<redacted>`), and the
//! passwords inside URLs ([`url()`]), wherever a value is printed — a `{:?}`, a log line, an error.
//!
//! Configured API keys and the admin key are not kept at all (only their SHA-256); what must be
//! kept to be used (the Redis URL, `auth.id_secret`) is kept here, and every `Debug` impl of a
//! type that holds one prints it through this module.

use std::fmt;

/// A secret from the config: usable through [`Secret::expose`], never printed (`Debug` shows
/// `<redacted>`; there is no `Display`).
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps `value`.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The secret itself, for the one place that uses it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl<'de> serde::Deserialize<'de> for Secret {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        String::deserialize(deserializer).map(Secret)
    }
}

impl Secret {
    /// Whether it is empty (not set).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// `text` with the user information (a password) of every URL in it replaced by `***`: one URL,
/// a comma-separated list of them (a Redis Cluster's seed nodes) or `redis+cluster://` hosts.
/// A URL's user information is whatever precedes the last `@` of its authority (up to the first
/// `/` after `://`); text with no `://` is taken as one authority.
///
/// ```
/// use mcp_ratelimit_kernel::redact;
///
/// assert_eq!(redact::url("redis://:hunter2@cache:6379/0"), "redis://***@cache:6379/0");
/// assert_eq!(redact::url("redis://:a@x:1,redis://:b@y:2"), "redis://***@x:1,redis://***@y:2");
/// assert_eq!(redact::url("redis://cache:6379"), "redis://cache:6379");
/// ```
pub fn url(text: &str) -> String {
    let mut starts: Vec<usize> = text.match_indices("://").map(|(at, _)| at + 3).collect();
    if starts.is_empty() {
        starts.push(0);
    }
    let mut out = String::with_capacity(text.len());
    out.push_str(&text[..starts[0]]);
    for (n, &start) in starts.iter().enumerate() {
        let next = starts.get(n + 1).map(|next| next - 3);
        let part = &text[start..next.unwrap_or(text.len())];
        let authority = &part[..part.find('/').unwrap_or(part.len())];
        match authority.rfind('@') {
            Some(at) => {
                out.push_str("***");
                out.push_str(&part[at..]);
            }
            None => out.push_str(part),
        }
        if next.is_some() {
            out.push_str("://");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_password_of_every_url_is_replaced() {
        for (given, shown) in [
            ("redis://user:pw@a:7000/0", "redis://***@a:7000/0"),
            ("rediss://:p@ss@a:6380", "rediss://***@a:6380"),
            ("redis://a:7000/x@y", "redis://a:7000/x@y"),
            ("redis+cluster://:pw@a:7000,b:7001/0", "redis+cluster://***@a:7000,b:7001/0"),
            ("redis://:p,w@a:1,redis://:pw2@b:2", "redis://***@a:1,redis://***@b:2"),
            ("redis://:pa#ss?@a:1", "redis://***@a:1"),
            (":secret@host:6379", "***@host:6379"),
            ("https://api.example.com/v1/", "https://api.example.com/v1/"),
            ("", ""),
        ] {
            assert_eq!(url(given), shown, "{given}");
        }
    }

    #[test]
    fn a_secret_is_never_printed() {
        let secret = Secret::new("hunter2-hunter2-hunter2");
        assert_eq!(format!("{secret:?} {secret:#?}"), "<redacted> <redacted>");
        assert_eq!(secret.expose(), "hunter2-hunter2-hunter2");
    }
}
