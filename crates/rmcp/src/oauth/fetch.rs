//! The few requests a resource server makes of its authorization server: its metadata, its keys,
//! and (for opaque tokens) introspection. Each is bounded: a timeout, no redirects (a document
//! is where the metadata says it is), and a cap on the answer's size.

use std::time::Duration;

use serde_json::Value;

/// How long one request to the authorization server may take.
const TIMEOUT: Duration = Duration::from_secs(10);

/// The largest answer read: a metadata document or a key set is a few kilobytes.
const MAX_BODY: usize = 1 << 20;

/// Why a document could not be had.
#[derive(Debug, thiserror::Error)]
pub(super) enum FetchError {
    /// The request failed or timed out.
    #[error("{url}: {why}")]
    Request {
        /// Where it was sent.
        url: String,
        /// What went wrong.
        why: String,
    },
    /// It answered, but not the document asked for.
    #[error("{url}: {why}")]
    Document {
        /// Where it came from.
        url: String,
        /// What is wrong with it.
        why: String,
    },
}

/// The HTTP client toward the authorization server.
#[derive(Debug, Clone)]
pub(super) struct Fetch {
    client: reqwest::Client,
}

impl Fetch {
    pub(super) fn new() -> Result<Self, String> {
        let client = reqwest::Client::builder()
            .timeout(TIMEOUT)
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("mcp-ratelimit/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| e.to_string())?;
        Ok(Self { client })
    }

    /// The JSON document at `url`.
    pub(super) async fn json(&self, url: &str) -> Result<Value, FetchError> {
        let request = self.client.get(url).header(http::header::ACCEPT, "application/json");
        self.read(url, request).await
    }

    /// The JSON answer of a form `POST` to `url` with HTTP Basic credentials (RFC 7662).
    pub(super) async fn post_form(
        &self,
        url: &str,
        form: &[(&str, &str)],
        (user, password): (&str, Option<&str>),
    ) -> Result<Value, FetchError> {
        let body = form_encode(form);
        let request = self
            .client
            .post(url)
            .basic_auth(form_component(user), password.map(form_component))
            .header(http::header::CONTENT_TYPE, "application/x-www-form-urlencoded")
            .header(http::header::ACCEPT, "application/json")
            .body(body);
        self.read(url, request).await
    }

    async fn read(&self, url: &str, request: reqwest::RequestBuilder) -> Result<Value, FetchError> {
        let failed = |why: String| FetchError::Request { url: url.to_owned(), why };
        let mut response = request.send().await.map_err(|e| failed(without_url(e)))?;
        if !response.status().is_success() {
            return Err(failed(format!("answered {}", response.status())));
        }
        if response.content_length().is_some_and(|n| n > MAX_BODY as u64) {
            return Err(failed(format!("an answer over {MAX_BODY} bytes")));
        }
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(|e| failed(without_url(e)))? {
            if body.len() + chunk.len() > MAX_BODY {
                return Err(failed(format!("an answer over {MAX_BODY} bytes")));
            }
            body.extend_from_slice(&chunk);
        }
        serde_json::from_slice(&body)
            .map_err(|e| FetchError::Document { url: url.to_owned(), why: format!("not JSON ({e})") })
    }

    /// The `jwks_uri` of `issuer`'s metadata: RFC 8414's document first, then OpenID Connect
    /// discovery's, each of which must name `issuer` exactly (RFC 8414 §3.3).
    pub(super) async fn jwks_uri_of(&self, issuer: &str) -> Result<String, FetchError> {
        let mut last = None;
        for url in metadata_urls(issuer) {
            match self.json(&url).await {
                Ok(document) => {
                    let named = document.get("issuer").and_then(Value::as_str);
                    if named != Some(issuer) {
                        let why = format!("names issuer {named:?}, not {issuer:?}");
                        return Err(FetchError::Document { url, why });
                    }
                    let jwks_uri = document.get("jwks_uri").and_then(Value::as_str);
                    return jwks_uri
                        .filter(|uri| safe_endpoint(uri))
                        .map(str::to_owned)
                        .ok_or_else(|| FetchError::Document { url, why: "no https `jwks_uri`".into() });
                }
                Err(error) => last = Some(error),
            }
        }
        Err(last.unwrap_or_else(|| FetchError::Request { url: issuer.to_owned(), why: "no metadata URL".into() }))
    }
}

/// Where `issuer`'s metadata may be: RFC 8414's well-known URI (the well-known segment inserted
/// before the issuer's path), then OpenID Connect discovery's (appended to it).
pub(super) fn metadata_urls(issuer: &str) -> Vec<String> {
    let Ok(url) = url::Url::parse(issuer) else { return Vec::new() };
    let origin = url.origin().ascii_serialization();
    let path = url.path().trim_end_matches('/');
    vec![
        format!("{origin}/.well-known/oauth-authorization-server{path}"),
        format!("{}/.well-known/openid-configuration", issuer.trim_end_matches('/')),
    ]
}

/// Whether `uri` is an endpoint the server may call: https, or http to a loopback host.
pub(super) fn safe_endpoint(uri: &str) -> bool {
    let Ok(url) = url::Url::parse(uri) else { return false };
    let loopback = match url.host() {
        Some(url::Host::Domain(name)) => name.eq_ignore_ascii_case("localhost"),
        Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
        Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
        None => false,
    };
    url.scheme() == "https" || (url.scheme() == "http" && loopback)
}

/// A request error's message without its URL's query (an introspected token never rides in a
/// URL, but a configured endpoint might hold something).
fn without_url(error: reqwest::Error) -> String {
    let kind = if error.is_timeout() {
        "timed out"
    } else if error.is_connect() {
        "could not connect"
    } else {
        "failed"
    };
    format!("{kind}: {}", error.without_url())
}

/// `application/x-www-form-urlencoded` of `form`.
fn form_encode(form: &[(&str, &str)]) -> String {
    form.iter().map(|(k, v)| format!("{}={}", form_component(k), form_component(v))).collect::<Vec<_>>().join("&")
}

/// One component, form-encoded (RFC 6749 §2.3.1 encodes client credentials this way too).
fn form_component(value: &str) -> String {
    url::form_urlencoded::byte_serialize(value.as_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_is_looked_for_where_rfc_8414_then_openid_connect_put_it() {
        assert_eq!(
            metadata_urls("https://login.example.com/realms/acme"),
            [
                "https://login.example.com/.well-known/oauth-authorization-server/realms/acme",
                "https://login.example.com/realms/acme/.well-known/openid-configuration",
            ]
        );
        assert_eq!(
            metadata_urls("http://127.0.0.1:8080"),
            [
                "http://127.0.0.1:8080/.well-known/oauth-authorization-server",
                "http://127.0.0.1:8080/.well-known/openid-configuration",
            ]
        );
    }

    #[test]
    fn only_https_or_loopback_endpoints_are_called() {
        assert!(safe_endpoint("https://idp.example/jwks"));
        assert!(safe_endpoint("http://127.0.0.1:9/jwks") && safe_endpoint("http://localhost/jwks"));
        assert!(!safe_endpoint("http://idp.example/jwks") && !safe_endpoint("file:///etc/passwd"));
    }

    #[test]
    fn form_values_are_encoded() {
        assert_eq!(form_encode(&[("token", "a+b/c=d&e"), ("hint", "x y")]), "token=a%2Bb%2Fc%3Dd%26e&hint=x+y");
    }
}
