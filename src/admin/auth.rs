//! The admin key check, as a middleware in front of every admin route (an unknown one too).
//!
//! The presented token is hashed, and its SHA-256 compared with the configured key's over all
//! 32 bytes whatever they hold ([`presents_key`], shared with `server.metrics_key`): the time
//! taken depends on neither the key nor the token's length, and even a leak would only be about
//! the digest of the attacker's own guess.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::http::front_door::presents_key;

/// Lets a request through only with `Authorization: Bearer <admin key>`; otherwise 401 with
/// `WWW-Authenticate: Bearer`.
pub(super) async fn require_key(State(key): State<Arc<[u8; 32]>>, request: Request, next: Next) -> Response {
    let presented = bearer(request.headers());
    if presents_key(request.headers(), &key) {
        return next.run(request).await;
    }
    tracing::warn!(
        method = %request.method(),
        path = request.uri().path(),
        with_credential = presented.is_some(),
        "admin request refused: no valid admin key"
    );
    let body = serde_json::json!({"error": {"code": "unauthorized",
        "message": "the admin API needs `Authorization: Bearer <admin.key>`"}});
    let mut response = (StatusCode::UNAUTHORIZED, axum::Json(body)).into_response();
    response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

/// The token of an `Authorization: Bearer <token>` header, if any.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| {
        let (scheme, token) = v.trim().split_once(' ')?;
        scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
    })
}
