//! Calls to the paid API, and how the server protects it.
//!
//! Every request goes through one [`Upstream`] client, and through its circuit [`Breaker`]: once
//! the API has failed `breaker_failures` times in a row, nothing reaches it until the cool-down
//! has passed and one probe has succeeded. Agent-visible synchronous calls are made exactly
//! once: a 429 or a failure goes straight back to the model as a refusal with the wait, never
//! into a server-side retry loop that would burn quota while the agent waits. Work the server
//! owns — queued submissions, background polls — is retried in [`jobs`] with [`backoff`], under a
//! [`backoff::RetryBudget`], and spaced by the [`queue`], which tells jobs apart by their
//! [`classes`] (image, video), given to it as data.

pub mod adaptive;
pub mod api;
pub mod backoff;
pub mod classes;
pub mod gate;
pub mod jobs;
pub mod queue;

use std::time::{Duration, SystemTime};

use reqwest::{StatusCode, Url};

use crate::breaker::Breaker;
use crate::clock::{Nanos, SharedClock};
use api::{ArticlePage, NewArticle, NewPrediction, Prediction, SavedArticle};

/// Why an upstream call did not produce a result.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// 429; the upstream's Retry-After, if it sent one.
    #[error("upstream rate limited")]
    RateLimited {
        /// The upstream's Retry-After.
        retry_after: Option<Duration>,
    },
    /// The request did not reach the API's work: a connection that could not be made, or the
    /// API's own failure (5xx).
    #[error("{0}")]
    Unavailable(String),
    /// The request was sent and no usable answer came (a timeout, a connection broken before the
    /// answer, an answer that cannot be read): the API may have done the work, and billed it.
    #[error("{0}")]
    NoAnswer(String),
    /// The thing asked for does not exist upstream.
    #[error("not found")]
    NotFound,
    /// 401 or 403: the upstream refused this server's credential (`upstream.api_key`).
    #[error("the upstream refused this server's credential (HTTP {0}): check upstream.api_key")]
    Unauthorized(u16),
    /// Another 4xx: our request was refused.
    #[error("upstream refused the request: {0}")]
    Rejected(String),
    /// The circuit breaker is open: the request was not sent.
    #[error("the upstream is failing; the circuit breaker is open")]
    CircuitOpen {
        /// How long until a request may be tried again.
        retry_after: Nanos,
    },
}

impl UpstreamError {
    /// The `outcome` label of the upstream metric.
    pub fn outcome(&self) -> &'static str {
        match self {
            UpstreamError::RateLimited { .. } => "rate_limited",
            UpstreamError::Unavailable(_) | UpstreamError::NoAnswer(_) => "unavailable",
            UpstreamError::NotFound => "not_found",
            UpstreamError::Unauthorized(_) => "unauthorized",
            UpstreamError::Rejected(_) => "rejected",
            UpstreamError::CircuitOpen { .. } => "circuit_open",
        }
    }

    /// The `outcome` label of an upstream answer, success included.
    pub fn outcome_of<T>(answer: &Result<T, UpstreamError>) -> &'static str {
        answer.as_ref().map_or_else(UpstreamError::outcome, |_| "ok")
    }

    /// Whether the same request may succeed later (429, 5xx, timeouts); a 4xx will not.
    pub fn is_transient(&self) -> bool {
        matches!(self, UpstreamError::RateLimited { .. } | UpstreamError::Unavailable(_) | UpstreamError::NoAnswer(_))
    }

    /// Whether the upstream may have done the work the request asked for, though no answer
    /// says so (see [`UpstreamError::NoAnswer`]).
    pub fn may_have_run(&self) -> bool {
        matches!(self, UpstreamError::NoAnswer(_))
    }
}

/// An upstream client that cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// `upstream.url` is not a URL.
    #[error("`upstream.url` = `{url}` is not a URL: {reason}")]
    BadUrl {
        /// The URL as configured.
        url: String,
        /// Why it does not parse.
        reason: String,
    },
    /// The HTTP client could not be built (its TLS back end did not start).
    #[error("cannot build the upstream HTTP client: {0}")]
    Client(#[from] reqwest::Error),
}

/// How long the client keeps an idle connection to the upstream. A server closes a connection
/// it has left idle for its own time (ours, and the mock's, after `server.header_read_timeout_ms`;
/// Node's after 5 s), and a request sent on it at that very moment is reset, which would read as
/// an upstream failure (and count against the breaker). Letting connections go before common
/// servers do keeps that race away, at the price of a new connection after 4 s of quiet.
const POOL_IDLE: Duration = Duration::from_secs(4);

/// A client for the paid API, with its circuit breaker.
pub struct Upstream {
    http: reqwest::Client,
    base: Url,
    /// `v1/articles`, `v1/predictions` and `v1/predictions/`, joined to the base once: a
    /// request clones its URL rather than parsing one.
    articles: Url,
    submissions: Url,
    predictions: Url,
    breaker: Breaker,
    clock: SharedClock,
}

impl std::fmt::Debug for Upstream {
    /// The base URL without its password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("base", &crate::redact::url(self.base.as_str()))
            .field("breaker", &self.breaker)
            .finish_non_exhaustive()
    }
}

impl Upstream {
    /// A client for the API at `base` with a per-request `timeout`, guarded by `breaker`, sending
    /// `credential` (a header, its value marked sensitive) with every request.
    pub fn new(
        base: &str,
        credential: Option<(http::HeaderName, http::HeaderValue)>,
        timeout: Duration,
        breaker: Breaker,
        clock: SharedClock,
    ) -> Result<Self, ClientError> {
        let mut base =
            Url::parse(base).map_err(|e| ClientError::BadUrl { url: base.to_owned(), reason: e.to_string() })?;
        if !base.path().ends_with('/') {
            base.set_path(&format!("{}/", base.path()));
        }
        let join = |path: &str| {
            base.join(path)
                .map_err(|e| ClientError::BadUrl { url: crate::redact::url(base.as_str()), reason: e.to_string() })
        };
        let (articles, submissions, predictions) =
            (join("v1/articles")?, join("v1/predictions")?, join("v1/predictions/")?);
        let headers: reqwest::header::HeaderMap = credential.into_iter().collect();
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .pool_idle_timeout(POOL_IDLE)
            .default_headers(headers)
            .build()?;
        Ok(Self { http, base, articles, submissions, predictions, breaker, clock })
    }

    /// The breaker, for gauges and for refusing before anything is charged.
    pub fn breaker(&self) -> &Breaker {
        &self.breaker
    }

    /// How long the breaker will still refuse every request, if it is open now.
    pub fn open_for(&self) -> Option<Nanos> {
        self.breaker.open_for(self.clock.now())
    }

    /// Sends `request` if the breaker lets it through, and tells the breaker how it went: only
    /// failures of the API itself (5xx, timeouts, broken connections) count against it; a 429
    /// or a 4xx is an API that answers.
    ///
    /// Each request is a span of its own ([`upstream_span`]), under the call's, and carries that
    /// span's trace context as a `traceparent` header when traces are on. The span is never
    /// entered: nothing under it reads the current span (it is handed down), and entering it at
    /// every poll of the request would cost each traced call for nothing.
    async fn send<T: serde::de::DeserializeOwned>(&self, request: reqwest::RequestBuilder) -> Result<T, UpstreamError> {
        let request = request.build();
        let span = upstream_span(request.as_ref().ok());
        let mut status = None;
        let answer = self.send_in(request, &span, &mut status).await;
        if !span.is_disabled() {
            tracing::record_all!(
                span,
                "http.response.status_code" = status,
                "upstream.outcome" = UpstreamError::outcome_of(&answer),
            );
        }
        answer
    }

    /// [`Upstream::send`], the trace context of `span` sent with the request; `status` is the
    /// answer's status code, if it came.
    async fn send_in<T: serde::de::DeserializeOwned>(
        &self,
        request: Result<reqwest::Request, reqwest::Error>,
        span: &tracing::Span,
        status: &mut Option<u16>,
    ) -> Result<T, UpstreamError> {
        let permit = self
            .breaker
            .permit(self.clock.now())
            .map_err(|open| UpstreamError::CircuitOpen { retry_after: open.retry_after })?;
        let sent = match request {
            Ok(mut request) => {
                crate::telemetry::inject_traceparent(span, request.headers_mut());
                self.http.execute(request).await
            }
            Err(unbuilt) => Err(unbuilt),
        };
        *status = sent.as_ref().ok().map(|response| response.status().as_u16());
        let answer = read_json(sent).await;
        let failed = matches!(answer, Err(UpstreamError::Unavailable(_) | UpstreamError::NoAnswer(_)));
        self.breaker.record(permit, !failed, self.clock.now());
        answer
    }

    /// Lists articles matching `query`.
    pub async fn list_articles(
        &self,
        query: Option<&str>,
        limit: u32,
        cursor: Option<&str>,
    ) -> Result<ArticlePage, UpstreamError> {
        let mut url = self.articles.clone();
        {
            let mut q = url.query_pairs_mut();
            q.append_pair("limit", &limit.to_string());
            if let Some(query) = query {
                q.append_pair("query", query);
            }
            if let Some(cursor) = cursor {
                q.append_pair("cursor", cursor);
            }
        }
        self.send(self.http.get(url)).await
    }

    /// Saves an article.
    pub async fn save_article(&self, article: &NewArticle) -> Result<SavedArticle, UpstreamError> {
        self.send(self.http.post(self.articles.clone()).json(article)).await
    }

    /// Submits a prediction job. `idempotency_key` makes a retry after a lost answer return the
    /// job the first attempt created instead of paying for a second one.
    pub async fn create_prediction(
        &self,
        job: &NewPrediction,
        idempotency_key: &str,
    ) -> Result<Prediction, UpstreamError> {
        let request = self.http.post(self.submissions.clone()).header("idempotency-key", idempotency_key).json(job);
        self.send(request).await
    }

    /// Reads a prediction's current state.
    pub async fn get_prediction(&self, id: &str) -> Result<Prediction, UpstreamError> {
        self.send(self.http.get(self.prediction_url(id, None)?)).await
    }

    /// Cancels a running prediction; answers its state afterwards.
    pub async fn cancel_prediction(&self, id: &str) -> Result<Prediction, UpstreamError> {
        self.send(self.http.post(self.prediction_url(id, Some("cancel"))?)).await
    }

    /// `v1/predictions/{id}[/{action}]`, with `id` as one escaped path segment.
    fn prediction_url(&self, id: &str, action: Option<&str>) -> Result<Url, UpstreamError> {
        let mut url = self.predictions.clone();
        {
            let mut path =
                url.path_segments_mut().map_err(|_| UpstreamError::Unavailable("bad upstream URL".into()))?;
            path.pop_if_empty().push(id);
            if let Some(action) = action {
                path.push(action);
            }
        }
        Ok(url)
    }
}

/// The span of one request to the paid API: its method and path (never its query, which holds
/// an agent's words, nor its credential header), the status it was answered and the outcome the
/// metrics count (`circuit_open`: the breaker kept it from being sent). Disabled, and free, when
/// traces are off.
fn upstream_span(request: Option<&reqwest::Request>) -> tracing::Span {
    // A job's watch makes its own span, under the call's, for the polls no request awaits.
    crate::telemetry::of_work(|| {
        tracing::info_span!(
            target: crate::telemetry::TARGET,
            "upstream.request",
            "otel.kind" = "client",
            "http.request.method" = request.map(|r| r.method().as_str()),
            "url.path" = request.map(|r| crate::guard::trace::cut(r.url().path())),
            "http.response.status_code" = tracing::field::Empty,
            "upstream.outcome" = tracing::field::Empty,
        )
    })
}

async fn read_json<T: serde::de::DeserializeOwned>(
    sent: Result<reqwest::Response, reqwest::Error>,
) -> Result<T, UpstreamError> {
    let response = sent.map_err(|e| {
        if e.is_timeout() {
            UpstreamError::NoAnswer("timed out".into())
        } else if e.is_connect() || e.is_builder() {
            UpstreamError::Unavailable("connection failed".into())
        } else {
            // Written, perhaps whole, before the connection broke.
            UpstreamError::NoAnswer("the connection broke before the answer".into())
        }
    })?;
    let status = response.status();
    if status == StatusCode::TOO_MANY_REQUESTS {
        let retry_after = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| backoff::parse_retry_after(v, SystemTime::now()));
        return Err(UpstreamError::RateLimited { retry_after });
    }
    if status == StatusCode::NOT_FOUND {
        return Err(UpstreamError::NotFound);
    }
    if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
        return Err(UpstreamError::Unauthorized(status.as_u16()));
    }
    if status.is_server_error() {
        return Err(UpstreamError::Unavailable(format!("HTTP {}", status.as_u16())));
    }
    if !status.is_success() {
        let text = response.text().await.unwrap_or_default();
        return Err(UpstreamError::Rejected(format!(
            "HTTP {}: {}",
            status.as_u16(),
            text.chars().take(200).collect::<String>()
        )));
    }
    response.json::<T>().await.map_err(|e| UpstreamError::NoAnswer(format!("unreadable answer: {e}")))
}
