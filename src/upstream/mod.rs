//! Calls to the paid API, and what we remember about the jobs it runs.
//!
//! Agent-visible synchronous calls are made exactly once: a 429 or a failure goes straight
//! back to the model as a refusal with the wait, never into a server-side retry loop that
//! would burn quota while the agent waits.

pub mod api;
pub mod predictions;

use std::time::Duration;

use reqwest::{StatusCode, Url};

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
    /// 5xx, timeout, connection failure or an unreadable answer.
    #[error("{0}")]
    Unavailable(String),
    /// The thing asked for does not exist upstream.
    #[error("not found")]
    NotFound,
    /// Another 4xx: our request was refused.
    #[error("upstream refused the request: {0}")]
    Rejected(String),
}

impl UpstreamError {
    /// The `outcome` label of the upstream metric.
    pub fn outcome(&self) -> &'static str {
        match self {
            UpstreamError::RateLimited { .. } => "rate_limited",
            UpstreamError::Unavailable(_) => "unavailable",
            UpstreamError::NotFound => "not_found",
            UpstreamError::Rejected(_) => "rejected",
        }
    }
}

/// A client for the paid API.
#[derive(Debug, Clone)]
pub struct Upstream {
    http: reqwest::Client,
    base: Url,
}

impl Upstream {
    /// A client for the API at `base` with a per-request `timeout`.
    pub fn new(base: &str, timeout: Duration) -> anyhow::Result<Self> {
        let mut base = Url::parse(base)?;
        if !base.path().ends_with('/') {
            base.set_path(&format!("{}/", base.path()));
        }
        let http = reqwest::Client::builder().timeout(timeout).build()?;
        Ok(Self { http, base })
    }

    fn url(&self, path: &str) -> Result<Url, UpstreamError> {
        self.base.join(path).map_err(|e| UpstreamError::Unavailable(format!("bad upstream URL: {e}")))
    }

    /// Lists articles matching `query`.
    pub async fn list_articles(
        &self,
        query: Option<&str>,
        limit: u32,
        cursor: Option<&str>,
    ) -> Result<ArticlePage, UpstreamError> {
        let mut url = self.url("v1/articles")?;
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
        read_json(self.http.get(url).send().await).await
    }

    /// Saves an article.
    pub async fn save_article(&self, article: &NewArticle) -> Result<SavedArticle, UpstreamError> {
        read_json(self.http.post(self.url("v1/articles")?).json(article).send().await).await
    }

    /// Submits a prediction job.
    pub async fn create_prediction(&self, job: &NewPrediction) -> Result<Prediction, UpstreamError> {
        read_json(self.http.post(self.url("v1/predictions")?).json(job).send().await).await
    }

    /// Reads a prediction's current state.
    pub async fn get_prediction(&self, id: &str) -> Result<Prediction, UpstreamError> {
        let mut url = self.url("v1/predictions/")?;
        url.path_segments_mut()
            .map_err(|_| UpstreamError::Unavailable("bad upstream URL".into()))?
            .pop_if_empty()
            .push(id);
        read_json(self.http.get(url).send().await).await
    }
}

async fn read_json<T: serde::de::DeserializeOwned>(
    sent: Result<reqwest::Response, reqwest::Error>,
) -> Result<T, UpstreamError> {
    let response = sent.map_err(|e| {
        UpstreamError::Unavailable(if e.is_timeout() { "timed out".into() } else { "connection failed".into() })
    })?;
    let status = response.status();
    if status == StatusCode::TOO_MANY_REQUESTS {
        let retry_after = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s >= 0.0)
            .map(|s| Duration::from_secs_f64(s.min(86_400.0)));
        return Err(UpstreamError::RateLimited { retry_after });
    }
    if status == StatusCode::NOT_FOUND {
        return Err(UpstreamError::NotFound);
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
    response.json::<T>().await.map_err(|e| UpstreamError::Unavailable(format!("unreadable answer: {e}")))
}
