//! The admin key check, as a middleware in front of every admin route (an unknown one too).
//!
//! The presented token is hashed, and its SHA-256 compared with the configured key's over all
//! 32 bytes whatever they hold: the time taken depends on neither the key nor the token's
//! length, and even a leak would only be about the digest of the attacker's own guess.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};

/// Lets a request through only with `Authorization: Bearer <admin key>`; otherwise 401 with
/// `WWW-Authenticate: Bearer`.
pub async fn require_key(State(key): State<Arc<[u8; 32]>>, request: Request, next: Next) -> Response {
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

/// Whether `headers` carry `Authorization: Bearer <the key whose SHA-256 is key_sha256>`,
/// compared over all 32 bytes of the digests.
pub fn presents_key(headers: &HeaderMap, key_sha256: &[u8; 32]) -> bool {
    bearer(headers).is_some_and(|token| same_digest(&Sha256::digest(token.as_bytes()).into(), key_sha256))
}

/// Whether two digests are equal, looking at every byte whatever the differences.
fn same_digest(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let difference = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(difference) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_are_equal_only_when_every_byte_is() {
        let a = [7u8; 32];
        let mut b = a;
        assert!(same_digest(&a, &b));
        b[31] ^= 1;
        assert!(!same_digest(&a, &b));
    }
}
