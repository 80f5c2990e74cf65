//! This server as an OAuth protected resource (RFC 9728): the metadata document a client reads
//! to find the authorization server, and the `WWW-Authenticate` challenges (RFC 6750) that point
//! to it — on a request without a token (`auth.required`), with a token that does not verify
//! (`invalid_token`, so the client gets a new one), or without a required scope
//! (`insufficient_scope`, 403).

use std::sync::Arc;

use arc_swap::ArcSwapOption;
use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http::{HeaderValue, StatusCode};
use serde_json::json;

use mcp_ratelimit_core::config::OAuthConfig;

use super::{Rejected, TokenVerifier};

/// This server's resource URI, its metadata and where that is served.
#[derive(Debug, Clone)]
pub struct ProtectedResource {
    document: serde_json::Value,
    /// Where the document is: the well-known URI of the resource (RFC 9728 §3.1).
    metadata_url: String,
    /// `scope="…"` of every challenge, when scopes are required.
    scope: Option<String>,
}

impl ProtectedResource {
    /// The resource `config` describes (its audience is this server's resource URI).
    pub fn of(config: &OAuthConfig) -> Self {
        let document = json!({
            "resource": config.audience,
            "authorization_servers": [config.issuer],
            "scopes_supported": config.scopes_required,
            "bearer_methods_supported": ["header"],
            "resource_name": "mcp-ratelimit",
        });
        let scope = (!config.scopes_required.is_empty()).then(|| config.scopes_required.join(" "));
        Self { document, metadata_url: metadata_url(&config.audience), scope }
    }

    /// The Protected Resource Metadata document.
    pub fn document(&self) -> &serde_json::Value {
        &self.document
    }

    /// Where the document is served.
    pub fn metadata_url(&self) -> &str {
        &self.metadata_url
    }

    /// The `WWW-Authenticate` value that asks for a token: `error` (with its description) when one
    /// was presented and refused.
    pub fn challenge(&self, error: Option<&Rejected>) -> HeaderValue {
        let mut value = String::from("Bearer");
        let mut param = |name: &str, text: &str| {
            value.push_str(if value.len() > 6 { ", " } else { " " });
            value.push_str(name);
            value.push_str("=\"");
            // Every text here is ours or checked at start-up; quotes and backslashes are escaped
            // all the same (RFC 9110 quoted-string).
            for c in text.chars() {
                if c == '"' || c == '\\' {
                    value.push('\\');
                }
                value.push(c);
            }
            value.push('"');
        };
        match error {
            Some(Rejected::InsufficientScope) => {
                param("error", "insufficient_scope");
                param("error_description", &Rejected::InsufficientScope.to_string());
            }
            Some(rejected) => {
                param("error", "invalid_token");
                param("error_description", &rejected.to_string());
            }
            None => {}
        }
        if let Some(scope) = &self.scope {
            param("scope", scope);
        }
        param("resource_metadata", &self.metadata_url);
        // Every piece is visible ASCII (the URL is parsed, scopes checked); a value that were not
        // would only lose the header.
        HeaderValue::from_str(&value).unwrap_or_else(|_| HeaderValue::from_static("Bearer"))
    }

    /// The status a refused token is answered with: 403 for a missing scope, 503 when it cannot
    /// be verified now, else 401.
    pub fn status_of(rejected: &Rejected) -> StatusCode {
        match rejected {
            Rejected::InsufficientScope => StatusCode::FORBIDDEN,
            Rejected::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::UNAUTHORIZED,
        }
    }
}

/// RFC 9728 §3.1: `https://host/mcp` has its metadata at
/// `https://host/.well-known/oauth-protected-resource/mcp`.
fn metadata_url(resource: &str) -> String {
    match url::Url::parse(resource) {
        Ok(url) => {
            let path = url.path().trim_end_matches('/');
            format!("{}/.well-known/oauth-protected-resource{path}", url.origin().ascii_serialization())
        }
        Err(_) => String::new(),
    }
}

/// `GET /.well-known/oauth-protected-resource` and `…/oauth-protected-resource/<any path>`: the
/// metadata of the verifier in force (404 while `[auth.oauth]` is off), whatever path the
/// audience has (`…/mcp` for the default; RFC 9728 inserts the resource's path). Never limited: a
/// client reads it before it has a token. Put the DNS-rebinding protection in front, as for
/// `/health`.
pub fn metadata_routes<S: Clone + Send + Sync + 'static>(
    verifier: Arc<ArcSwapOption<TokenVerifier>>,
) -> axum::Router<S> {
    axum::Router::new()
        .route("/.well-known/oauth-protected-resource", get(document))
        .route("/.well-known/oauth-protected-resource/{*path}", get(document))
        .with_state(verifier)
}

async fn document(State(verifier): State<Arc<ArcSwapOption<TokenVerifier>>>) -> Response {
    match verifier.load_full() {
        Some(verifier) => {
            let mut response = Json(verifier.resource().document().clone()).into_response();
            response.headers_mut().insert(http::header::CACHE_CONTROL, HeaderValue::from_static("max-age=300"));
            response
        }
        None => (StatusCode::NOT_FOUND, Json(json!({"error": "this server takes no OAuth tokens"}))).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resource(scopes: &[&str]) -> ProtectedResource {
        let mut config = OAuthConfig::off();
        config.issuer = "https://idp.example".into();
        config.audience = "https://mcp.example.com/mcp".into();
        config.scopes_required = scopes.iter().map(|s| (*s).to_owned()).collect();
        ProtectedResource::of(&config)
    }

    #[test]
    fn the_metadata_is_at_the_resources_well_known_uri() {
        let r = resource(&[]);
        assert_eq!(r.metadata_url(), "https://mcp.example.com/.well-known/oauth-protected-resource/mcp");
        assert_eq!(r.document()["resource"], "https://mcp.example.com/mcp");
        assert_eq!(r.document()["authorization_servers"], json!(["https://idp.example"]));
        assert_eq!(r.document()["bearer_methods_supported"], json!(["header"]));
        assert_eq!(
            metadata_url("http://127.0.0.1:3000/mcp"),
            "http://127.0.0.1:3000/.well-known/oauth-protected-resource/mcp"
        );
    }

    #[test]
    fn challenges_name_the_metadata_and_what_was_wrong() {
        let r = resource(&["mcp:tools"]);
        let url = "https://mcp.example.com/.well-known/oauth-protected-resource/mcp";
        assert_eq!(r.challenge(None), format!("Bearer scope=\"mcp:tools\", resource_metadata=\"{url}\"").as_str());
        let expired = r.challenge(Some(&Rejected::Expired));
        let expired = expired.to_str().expect("ascii");
        assert!(
            expired.starts_with("Bearer error=\"invalid_token\", error_description=\"the access token expired\""),
            "{expired}"
        );
        let scope = r.challenge(Some(&Rejected::InsufficientScope));
        assert!(scope.to_str().expect("ascii").starts_with("Bearer error=\"insufficient_scope\""), "{scope:?}");
        assert_eq!(resource(&[]).challenge(None), format!("Bearer resource_metadata=\"{url}\"").as_str());
    }
}
