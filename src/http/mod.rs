//! The server's HTTP pieces: the connection loop ([`serve`]: connection caps, a deadline for each
//! request to arrive) and the session caps and idle time ([`sessions`]). The tower layers any
//! axum app can use (the front door, the coarse limit, [`Shared`], [`StepLayer`]) are the
//! library's (`mcp-ratelimit-rmcp`), re-exported here.
//!
//! On `/mcp`, outside in: [`front_door`] (DNS-rebinding protection, identity and auth, header
//! checks), then the coarse limit ([`limit::HttpLimitLayer`]), then the body deadline
//! ([`serve::read_body_by_deadline`]), then the session caps and idle time ([`sessions`]), then
//! rmcp. [`crate::app`] puts them together with rmcp's service, and `/health`, `/metrics` (behind
//! [`front_door::metrics_key`] too) and the dashboard, never limited, behind the DNS-rebinding
//! protection only.

pub mod serve;
pub mod sessions;

pub use mcp_ratelimit_rmcp::http::*;

/// An answer's body that holds `G` (a guard: a request under way, a session's message) until the
/// body has been sent whole or dropped, so what the guard counts lasts as long as the answer does
/// (an SSE stream included).
pub(crate) struct Holding<G> {
    body: axum::body::Body,
    _held: G,
}

impl<G> Holding<G> {
    /// `body`, holding `held` until it is done.
    pub(crate) fn new(body: axum::body::Body, held: G) -> Self {
        Self { body, _held: held }
    }
}

impl<G: Unpin> http_body::Body for Holding<G> {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}
