//! The HTTP pieces: tower layers any axum app can use.
//!
//! Every connection is served by [`serve`] (a header deadline). On `/mcp`, outside in:
//! [`front_door`] (DNS-rebinding protection, identity and auth, header checks), then the coarse
//! limit ([`limit::HttpLimitLayer`]), then the body deadline ([`serve::read_body_by_deadline`]),
//! then the session cap ([`sessions`]), then rmcp. Each layer takes only what it needs (the
//! allowed hosts, the identifier, the guard, the deadlines), so it can be used, and tested, alone.
//! Each is a tower layer of its own, not `axum::middleware::from_fn`, which boxes the stack
//! behind it and its future for every request; a request a layer does not touch (a GET, a call
//! in an open session at the session cap) passes without an allocation.
//! [`crate::app`] puts them together with rmcp's service, `/health` and `/metrics` (never limited)
//! and the dashboard (behind the DNS-rebinding protection only).

pub mod front_door;
pub mod limit;
pub mod serve;
pub mod sessions;

use std::sync::Arc;

/// A service behind an `Arc`. axum's router and the layers that await before calling on (the
/// HTTP limit, the body deadline, the session cap) clone the inner stack on every request;
/// rmcp's service carries its config (host lists and more), so cloning it per layer
/// per request shows in a profile. Behind an `Arc` those clones are a reference count, and the
/// service itself is cloned once, only for a request that actually reaches it.
#[derive(Debug)]
pub struct Shared<S>(Arc<S>);

impl<S> Shared<S> {
    /// `service`, behind an `Arc`.
    pub fn new(service: S) -> Self {
        Self(Arc::new(service))
    }
}

impl<S> Clone for Shared<S> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<S, R> tower::Service<R> for Shared<S>
where
    S: tower::Service<R> + Clone,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = tower::util::Oneshot<S, R>;

    fn poll_ready(&mut self, _cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        // Readiness belongs to the clone that serves the request: `oneshot` waits for it.
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: R) -> Self::Future {
        tower::ServiceExt::oneshot(S::clone(&self.0), request)
    }
}
