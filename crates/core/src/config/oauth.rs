//! `[auth.oauth]`: callers known by an OAuth 2.1 access token, this server being the resource
//! server MCP's authorization chapter describes. What is checked here is the shape of the
//! section; verifying tokens (fetching the issuer's keys, signatures, introspection) is the HTTP
//! layer's (`mcp-ratelimit-rmcp`, feature `oauth`), and naming a caller from verified claims is
//! [`crate::identity`]'s.

use serde::Deserialize;

use super::{ConfigError, invalid};
use crate::redact::Secret;

/// The signature algorithms a token may use: asymmetric only. A resource server that verified
/// HS256 would hold the secret that signs tokens, and `none` signs nothing.
pub(super) const ALGORITHMS: [&str; 9] =
    ["RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "EdDSA"];

/// The most clock skew allowed on `exp` and `nbf`.
const MAX_LEEWAY_SECONDS: u64 = 300;

/// The longest a claim's name may be (it is looked up in every token).
const MAX_CLAIM_NAME: usize = 128;

/// `[auth.oauth]`, checked. Off ([`OAuthConfig::enabled`] false) while `issuer` is empty.
#[derive(Debug, Clone, PartialEq)]
pub struct OAuthConfig {
    /// The authorization server's issuer identifier, exactly as tokens name it (`iss`); empty: off.
    pub issuer: String,
    /// This server's canonical resource URI, which a token's `aud` must name; empty: the server
    /// fills in the MCP URL it serves.
    pub audience: String,
    /// Where the signing keys are; empty: from the issuer's metadata.
    pub jwks_uri: String,
    /// The signature algorithms accepted (asymmetric ones only: `none` and HS* are refused).
    pub algorithms: Vec<String>,
    /// Clock skew allowed on `exp` and `nbf`, in seconds.
    pub leeway_seconds: u64,
    /// Scopes every token must carry.
    pub scopes_required: Vec<String>,
    /// The claim naming the caller's tenant.
    pub tenant_claim: String,
    /// The claim naming the caller's tier.
    pub tier_claim: String,
    /// The claim naming the OAuth client application (`azp` when it is absent).
    pub client_claim: String,
    /// The least time between two fetches of the keys that an unknown `kid` causes.
    pub jwks_refresh_min_seconds: u64,
    /// RFC 7662 introspection of opaque tokens: the endpoint (empty: off).
    pub introspection_endpoint: String,
    /// The client id this server introspects as.
    pub introspection_client_id: String,
    /// Its secret.
    pub introspection_client_secret: Option<Secret>,
}

impl OAuthConfig {
    /// Whether callers may be known by tokens (`issuer` is set).
    pub fn enabled(&self) -> bool {
        !self.issuer.is_empty()
    }

    /// The section as it is when off (no issuer), with the documented defaults.
    pub fn off() -> Self {
        Self {
            issuer: String::new(),
            audience: String::new(),
            jwks_uri: String::new(),
            algorithms: vec!["RS256".into(), "ES256".into(), "EdDSA".into()],
            leeway_seconds: 30,
            scopes_required: Vec::new(),
            tenant_claim: "org_id".into(),
            tier_claim: "tier".into(),
            client_claim: "client_id".into(),
            jwks_refresh_min_seconds: 60,
            introspection_endpoint: String::new(),
            introspection_client_id: String::new(),
            introspection_client_secret: None,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawOAuth {
    issuer: String,
    audience: String,
    jwks_uri: String,
    algorithms: Vec<String>,
    leeway_seconds: i64,
    scopes_required: Vec<String>,
    tenant_claim: String,
    tier_claim: String,
    client_claim: String,
    jwks_refresh_min_seconds: i64,
    introspection_endpoint: String,
    introspection_client_id: String,
    introspection_client_secret: String,
}

impl std::fmt::Debug for RawOAuth {
    /// Everything but the introspection secret's value.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let secret = if self.introspection_client_secret.trim().is_empty() { "" } else { "<redacted>" };
        f.debug_struct("RawOAuth")
            .field("issuer", &self.issuer)
            .field("audience", &self.audience)
            .field("jwks_uri", &self.jwks_uri)
            .field("algorithms", &self.algorithms)
            .field("scopes_required", &self.scopes_required)
            .field("introspection_endpoint", &self.introspection_endpoint)
            .field("introspection_client_secret", &secret)
            .finish_non_exhaustive()
    }
}

/// An endpoint of the authorization server (or this server's own URI) at `key`: an absolute URL
/// without a fragment, over https, or over http to a loopback host (the spec's one exception,
/// for local development); `None` for an empty value.
fn endpoint(key: &str, value: &str) -> Result<Option<String>, ConfigError> {
    let value = value.trim();
    if value.is_empty() {
        return Ok(None);
    }
    let shown = crate::redact::url(value);
    let bad = |why: &str| invalid(key, format!("`{shown}` {why}"));
    let url = url::Url::parse(value).map_err(|e| bad(&format!("is not a URL ({e})")))?;
    if url.fragment().is_some() || !url.username().is_empty() || url.password().is_some() {
        return Err(bad("must not carry a fragment or credentials"));
    }
    let loopback = match url.host() {
        Some(url::Host::Domain(name)) => name.eq_ignore_ascii_case("localhost"),
        Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
        Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
        None => return Err(bad("names no host")),
    };
    match url.scheme() {
        "https" => Ok(Some(value.to_owned())),
        "http" if loopback => Ok(Some(value.to_owned())),
        "http" => Err(bad("must use https (http only to a loopback host, for local development)")),
        _ => Err(bad("must be an https URL")),
    }
}

/// A claim's name at `key`: not empty, not absurdly long.
fn claim_name(key: &str, value: String) -> Result<String, ConfigError> {
    if value.trim().is_empty() || value.len() > MAX_CLAIM_NAME {
        return Err(invalid(key, format!("a claim's name, 1 to {MAX_CLAIM_NAME} characters")));
    }
    Ok(value)
}

impl RawOAuth {
    /// The section, checked; the key of the first fault named.
    pub(super) fn validate(self) -> Result<OAuthConfig, ConfigError> {
        let issuer = endpoint("auth.oauth.issuer", &self.issuer)?.unwrap_or_default();
        // An issuer identifier is compared byte for byte with `iss`: keep it as written (RFC 8414
        // builds the metadata URL from it, trailing slash and all).
        let audience = endpoint("auth.oauth.audience", &self.audience)?.unwrap_or_default();
        let jwks_uri = endpoint("auth.oauth.jwks_uri", &self.jwks_uri)?.unwrap_or_default();
        if self.algorithms.is_empty() {
            return Err(invalid("auth.oauth.algorithms", format!("name at least one of {}", ALGORITHMS.join(", "))));
        }
        for (i, alg) in self.algorithms.iter().enumerate() {
            let at = format!("auth.oauth.algorithms[{i}]");
            if alg.eq_ignore_ascii_case("none") || alg.to_ascii_uppercase().starts_with("HS") {
                return Err(invalid(
                    at,
                    format!(
                        "`{alg}` is refused: a token must be signed with the authorization server's private key \
                         (none signs nothing, and HS* would need the signing secret here); one of {}",
                        ALGORITHMS.join(", ")
                    ),
                ));
            }
            if !ALGORITHMS.contains(&alg.as_str()) {
                return Err(invalid(at, format!("unknown algorithm `{alg}`; one of {}", ALGORITHMS.join(", "))));
            }
        }
        let leeway_seconds =
            u64::try_from(self.leeway_seconds).ok().filter(|s| *s <= MAX_LEEWAY_SECONDS).ok_or_else(|| {
                invalid("auth.oauth.leeway_seconds", format!("must be 0 to {MAX_LEEWAY_SECONDS} seconds"))
            })?;
        let jwks_refresh_min_seconds = u64::try_from(self.jwks_refresh_min_seconds)
            .ok()
            .filter(|s| (1..=86_400).contains(s))
            .ok_or_else(|| invalid("auth.oauth.jwks_refresh_min_seconds", "must be 1 to 86400 seconds"))?;
        for (i, scope) in self.scopes_required.iter().enumerate() {
            // RFC 6749's scope-token: printable ASCII but space, `"` and `\` (it goes into a
            // WWW-Authenticate header as it is).
            let ok = !scope.is_empty() && scope.bytes().all(|b| (0x21..=0x7e).contains(&b) && b != b'"' && b != b'\\');
            if !ok {
                return Err(invalid(
                    format!("auth.oauth.scopes_required[{i}]"),
                    "a scope is printable ASCII without spaces, `\"` or `\\`",
                ));
            }
        }
        let introspection_endpoint =
            endpoint("auth.oauth.introspection_endpoint", &self.introspection_endpoint)?.unwrap_or_default();
        let secret = self.introspection_client_secret.trim();
        let introspection_client_secret = (!secret.is_empty()).then(|| Secret::new(secret));
        if !introspection_endpoint.is_empty() && self.introspection_client_id.trim().is_empty() {
            return Err(invalid(
                "auth.oauth.introspection_client_id",
                "is required with an introspection_endpoint: the authorization server only answers a client it knows",
            ));
        }
        if issuer.is_empty() && (!introspection_endpoint.is_empty() || !jwks_uri.is_empty()) {
            return Err(invalid(
                "auth.oauth.issuer",
                "is empty, so tokens are off: set it, or leave the other keys empty",
            ));
        }
        Ok(OAuthConfig {
            issuer,
            audience,
            jwks_uri,
            algorithms: self.algorithms,
            leeway_seconds,
            scopes_required: self.scopes_required,
            tenant_claim: claim_name("auth.oauth.tenant_claim", self.tenant_claim)?,
            tier_claim: claim_name("auth.oauth.tier_claim", self.tier_claim)?,
            client_claim: claim_name("auth.oauth.client_claim", self.client_claim)?,
            jwks_refresh_min_seconds,
            introspection_endpoint,
            introspection_client_id: self.introspection_client_id.trim().to_owned(),
            introspection_client_secret,
        })
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{Catalogue, LimitsConfig};

    fn oauth(toml: &str) -> Result<super::OAuthConfig, String> {
        LimitsConfig::from_toml(&format!("[auth.oauth]\n{toml}"), &Catalogue::new())
            .map(|c| c.auth.oauth)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn off_by_default_and_on_with_an_issuer() {
        assert!(!oauth("").expect("defaults").enabled());
        assert_eq!(oauth("").expect("defaults"), super::OAuthConfig::off());
        let on = oauth("issuer = \"https://login.example.com/realms/acme\"").expect("valid");
        assert!(on.enabled());
        assert_eq!(on.issuer, "https://login.example.com/realms/acme");
    }

    #[test]
    fn symmetric_and_unsigned_algorithms_are_refused_naming_the_key() {
        for alg in ["HS256", "hs512", "none", "None"] {
            let e = oauth(&format!("issuer = \"https://idp.example\"\nalgorithms = [\"RS256\", \"{alg}\"]"))
                .expect_err("refused");
            assert!(e.contains("auth.oauth.algorithms[1]") && e.contains("is refused"), "{alg}: {e}");
        }
        let e = oauth("issuer = \"https://idp.example\"\nalgorithms = [\"RS1024\"]").expect_err("unknown");
        assert!(e.contains("unknown algorithm"), "{e}");
        assert!(oauth("issuer = \"https://idp.example\"\nalgorithms = []").is_err());
    }

    #[test]
    fn an_issuer_over_plain_http_is_refused_unless_it_is_on_loopback() {
        let e = oauth("issuer = \"http://idp.example\"").expect_err("plain http");
        assert!(e.contains("auth.oauth.issuer") && e.contains("https"), "{e}");
        for local in ["http://127.0.0.1:8080", "http://localhost:9/x", "http://[::1]:80"] {
            assert!(oauth(&format!("issuer = \"{local}\"")).is_ok(), "{local}");
        }
        let e = oauth("issuer = \"https://user:pw@idp.example\"").expect_err("credentials");
        assert!(!e.contains("pw@"), "{e}");
        assert!(oauth("issuer = \"https://idp.example\"\naudience = \"ftp://x\"").is_err());
    }

    #[test]
    fn a_scope_that_would_break_the_challenge_header_is_refused() {
        for bad in ["two words", "quo\\\"te", ""] {
            let e = oauth(&format!("issuer = \"https://idp.example\"\nscopes_required = [\"{bad}\"]"));
            assert!(e.is_err(), "{bad}");
        }
        let ok = oauth("issuer = \"https://idp.example\"\nscopes_required = [\"mcp:tools\", \"read\"]").expect("ok");
        assert_eq!(ok.scopes_required, ["mcp:tools", "read"]);
    }

    #[test]
    fn introspection_needs_its_client_and_the_secret_never_prints() {
        let e = oauth("issuer = \"https://idp.example\"\nintrospection_endpoint = \"https://idp.example/introspect\"")
            .expect_err("no client");
        assert!(e.contains("introspection_client_id"), "{e}");
        let on = oauth(
            "issuer = \"https://idp.example\"\nintrospection_endpoint = \"https://idp.example/i\"\n\
             introspection_client_id = \"mcp\"\nintrospection_client_secret = \"hush-hush-secret\"",
        )
        .expect("ok");
        assert!(!format!("{on:?}").contains("hush-hush"), "{on:?}");
        assert!(oauth("introspection_endpoint = \"https://idp.example/i\"\nintrospection_client_id = \"m\"").is_err());
    }

    #[test]
    fn numbers_out_of_range_name_their_key() {
        let e = oauth("issuer = \"https://idp.example\"\nleeway_seconds = 301").expect_err("too much skew");
        assert!(e.contains("auth.oauth.leeway_seconds"), "{e}");
        let e = oauth("issuer = \"https://idp.example\"\njwks_refresh_min_seconds = 0").expect_err("zero");
        assert!(e.contains("auth.oauth.jwks_refresh_min_seconds"), "{e}");
        let e = oauth("issuer = \"https://idp.example\"\ntenant_claim = \"\"").expect_err("empty");
        assert!(e.contains("auth.oauth.tenant_claim"), "{e}");
    }
}
