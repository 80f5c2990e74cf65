//! The admin API: an operator's HTTP API, on a listener of its own (`admin.listen`, loopback by
//! default), never on the MCP listener.
//!
//! Everything on it — every route, an unknown one, `openapi.json` too — first passes
//! `auth::require_key`: `Authorization: Bearer <admin.key>`, compared in constant time, or 401.
//! Its connections are held to the `[server]` deadlines, as the MCP endpoint's are (see
//! [`crate::http::serve`]): headers within `header_read_timeout_ms`, and — once the key is
//! checked — the body within `body_read_timeout_ms` (else 408).
//! The routes ([`ROUTES`], described by `openapi.json` beside this file and served at
//! `GET /admin/openapi.json`) inspect a caller's or tenant's budgets, reset them, refund units,
//! block a caller or tenant for a while, and list and cancel jobs in flight. They act on the
//! guard's store and the job book, so over Redis they act for every instance at once (see
//! [`crate::operator`]). Callers are named as the server shows them (`tok:…`, `ip:…`),
//! never by a key: `GET /admin/keys` gives each configured key's caller id.
//!
//! Every action is logged (`admin action`, with the target and amount, never a key).

mod auth;
mod routes;

use std::sync::Arc;

use axum::Router;
use axum::routing::{MethodRouter, delete, get, post, put};

use crate::http::serve::{BodyDeadline, read_body_by_deadline};
use crate::state::AppState;

pub use crate::http::front_door::presents_key;

/// The OpenAPI 3.1 document describing every route, as written beside this file; served by
/// [`openapi`] with what the registry knows filled in.
pub const OPENAPI: &str = include_str!("openapi.json");

/// The OpenAPI document as served: [`OPENAPI`] with the algorithms a budget may show taken from
/// the algorithm registry ([`crate::limit::ALGORITHMS`]), so a new algorithm is described without
/// editing the file.
pub fn openapi() -> String {
    static SERVED: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SERVED
        .get_or_init(|| {
            let Ok(mut document) = serde_json::from_str::<serde_json::Value>(OPENAPI) else {
                return OPENAPI.to_owned();
            };
            if let Some(algorithm) = document.pointer_mut("/components/schemas/Budget/properties/algorithm") {
                algorithm["enum"] = serde_json::json!(crate::limit::ALGORITHMS);
            }
            document.to_string()
        })
        .clone()
}

/// Every route the admin API serves: method and path, as the OpenAPI document writes them.
pub const ROUTES: &[(&str, &str)] = &[
    ("get", "/admin/openapi.json"),
    ("get", "/admin/keys"),
    ("get", "/admin/callers/{caller}"),
    ("post", "/admin/callers/{caller}/reset"),
    ("post", "/admin/callers/{caller}/refund"),
    ("put", "/admin/callers/{caller}/block"),
    ("delete", "/admin/callers/{caller}/block"),
    ("get", "/admin/tenants/{tenant}"),
    ("post", "/admin/tenants/{tenant}/reset"),
    ("post", "/admin/tenants/{tenant}/refund"),
    ("put", "/admin/tenants/{tenant}/block"),
    ("delete", "/admin/tenants/{tenant}/block"),
    ("get", "/admin/jobs"),
    ("post", "/admin/jobs/{predict_id}/cancel"),
];

/// The handler of one entry of [`ROUTES`].
fn handler(method: &str, path: &str) -> Option<MethodRouter<Arc<AppState>>> {
    Some(match (method, path) {
        ("get", "/admin/openapi.json") => get(routes::openapi),
        ("get", "/admin/keys") => get(routes::keys),
        ("get", "/admin/callers/{caller}") => get(routes::inspect_caller),
        ("post", "/admin/callers/{caller}/reset") => post(routes::reset_caller),
        ("post", "/admin/callers/{caller}/refund") => post(routes::refund_caller),
        ("put", "/admin/callers/{caller}/block") => put(routes::block_caller),
        ("delete", "/admin/callers/{caller}/block") => delete(routes::unblock_caller),
        ("get", "/admin/tenants/{tenant}") => get(routes::inspect_tenant),
        ("post", "/admin/tenants/{tenant}/reset") => post(routes::reset_tenant),
        ("post", "/admin/tenants/{tenant}/refund") => post(routes::refund_tenant),
        ("put", "/admin/tenants/{tenant}/block") => put(routes::block_tenant),
        ("delete", "/admin/tenants/{tenant}/block") => delete(routes::unblock_tenant),
        ("get", "/admin/jobs") => get(routes::jobs),
        ("post", "/admin/jobs/{predict_id}/cancel") => post(routes::cancel_job),
        _ => return None,
    })
}

/// The admin app, requiring the key whose SHA-256 is `key_sha256` on every request, then
/// reading a request's body within `body` (so an unauthenticated one is never read).
pub fn router(app: Arc<AppState>, key_sha256: [u8; 32], body: BodyDeadline) -> Router {
    let routes = ROUTES.iter().filter_map(|(method, path)| Some((*path, handler(method, path)?)));
    let router = routes.fold(Router::new(), |router, (path, handler)| router.route(path, handler));
    router
        .fallback(routes::no_such_route)
        .layer(read_body_by_deadline(body))
        .layer(axum::middleware::from_fn_with_state(Arc::new(key_sha256), auth::require_key))
        .with_state(app)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_served_document_lists_every_registered_algorithm() {
        let served: serde_json::Value = serde_json::from_str(&openapi()).expect("JSON");
        let listed = &served["components"]["schemas"]["Budget"]["properties"]["algorithm"]["enum"];
        assert_eq!(listed, &serde_json::json!(crate::limit::ALGORITHMS));
    }

    #[test]
    fn every_route_has_its_handler_and_its_place_in_the_openapi_document() {
        let document: serde_json::Value = serde_json::from_str(OPENAPI).expect("openapi.json is JSON");
        assert_eq!(document["openapi"].as_str().map(|v| v.starts_with("3.1")), Some(true));
        let paths = document["paths"].as_object().expect("paths");
        for (method, path) in ROUTES {
            assert!(handler(method, path).is_some(), "{method} {path} has no handler");
            assert!(paths.get(*path).and_then(|p| p.get(*method)).is_some(), "{method} {path} is not documented");
        }
        for (path, operations) in paths {
            for method in operations.as_object().expect("operations").keys().filter(|k| *k != "parameters") {
                assert!(
                    ROUTES.iter().any(|(m, p)| m == method && p == path),
                    "{method} {path} is documented but not served"
                );
            }
        }
    }
}
