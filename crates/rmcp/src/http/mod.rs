//! The HTTP pieces: tower layers any axum app can use.
//!
//! On `/mcp`, outside in: [`front_door`] (DNS-rebinding protection, header checks) with
//! [`identify`] (who calls: keys, addresses, OAuth access tokens), then the coarse limit
//! ([`limit::HttpLimitLayer`]) and the refusal of invalid tokens it charged
//! ([`identify::refuse_invalid_tokens`]), then the server's own (a body
//! deadline, session caps), then rmcp. Each layer takes only what it needs (the allowed hosts,
//! the identifier, the guard), so it can be used, and tested, alone.
//! Each is a tower layer of its own, not `axum::middleware::from_fn`, which boxes the stack
//! behind it and its future for every request; a request a layer does not touch (a GET, a
//! DELETE) passes without an allocation.

pub mod front_door;
pub mod identify;
pub mod limit;

use std::future::Future;
use std::sync::Arc;

use axum::extract::Request;
use axum::response::Response;

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

/// A front-door layer that passes most requests straight on and takes the rest into an async
/// step of its own: the reference server's body deadline (`serve::read_body_by_deadline`) and
/// session caps (`sessions::cap`). [`StepLayer`] is the tower plumbing they share, so each is
/// only its test and its step.
pub trait Step: Clone + Send + Sync + 'static {
    /// Whether `request` needs the step; one that does not passes on without an allocation.
    fn takes(&self, request: &Request) -> bool;

    /// The step for a taken `request`: it calls `inner` (ready) to pass the request on, or
    /// answers itself.
    fn run<S>(self, request: Request, inner: S) -> impl Future<Output = Result<Response, S::Error>> + Send
    where
        S: tower::Service<Request, Response = Response> + Send + 'static,
        S::Future: Send,
        S::Error: Send;
}

/// The layer of a [`Step`].
#[derive(Debug, Clone)]
pub struct StepLayer<T> {
    step: T,
}

impl<T> StepLayer<T> {
    /// A layer running `step`.
    pub fn new(step: T) -> Self {
        Self { step }
    }
}

impl<S, T: Clone> tower::Layer<S> for StepLayer<T> {
    type Service = Stepped<S, T>;

    fn layer(&self, inner: S) -> Self::Service {
        Stepped { inner, step: self.step.clone() }
    }
}

/// The service [`StepLayer`] produces.
#[derive(Debug, Clone)]
pub struct Stepped<S, T> {
    inner: S,
    step: T,
}

impl<S, T> tower::Service<Request> for Stepped<S, T>
where
    S: tower::Service<Request, Response = Response> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    T: Step,
{
    type Response = Response;
    type Error = S::Error;
    type Future = futures::future::Either<S::Future, futures::future::BoxFuture<'static, Result<Response, S::Error>>>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        use futures::future::Either;
        if !self.step.takes(&request) {
            return Either::Left(self.inner.call(request));
        }
        // The inner service is ready (`poll_ready` said so); take it, leaving a clone, so the
        // step may call it after awaiting (tower's usual clone-and-swap).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        Either::Right(Box::pin(self.step.clone().run(request, inner)))
    }
}
