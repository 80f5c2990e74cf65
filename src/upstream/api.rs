//! The wire format of the paid API: what the mock serves and what the client sends.
//!
//! Kept in one place so the client and the mock cannot drift apart. It is shaped like the
//! image APIs agents usually drive (submit a prediction, poll it by id).

use serde::{Deserialize, Serialize};

/// One article.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Article {
    /// Upstream id.
    pub id: String,
    /// Headline.
    pub title: String,
    /// First lines of the body.
    pub summary: String,
}

/// What the paid API billed for a request, as it reports it on its answer (a prediction's once
/// it is final): the price a call is settled to ([`crate::guard::Held::finish`] for a job).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct Usage {
    /// Units billed, in the units `[tools.*] cost` counts.
    pub units: u64,
}

/// A page of articles.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
pub struct ArticlePage {
    /// The articles on this page.
    pub articles: Vec<Article>,
    /// Pass as `cursor` to get the next page; absent on the last page.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
    /// What the upstream billed for this page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// Body of `POST /v1/articles`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NewArticle {
    /// Headline.
    pub title: String,
    /// Full text.
    pub body: String,
}

/// Answer to `POST /v1/articles`.
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
pub struct SavedArticle {
    /// Upstream id of the new article.
    pub id: String,
    /// Headline as stored.
    pub title: String,
    /// What the upstream billed for saving it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// What kind of job a prediction is, as the paid API's wire says it. The queue and the job book
/// know jobs by their class instead ([`crate::upstream::classes`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PredictionKind {
    /// Text to image.
    #[default]
    Image,
    /// Image to video.
    Video,
}

/// How long a video is when its submission does not say (`NewPrediction::seconds`).
pub const DEFAULT_VIDEO_SECONDS: u32 = 5;

/// Body of `POST /v1/predictions`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct NewPrediction {
    /// Image or video.
    pub kind: PredictionKind,
    /// What to generate.
    pub prompt: String,
    /// Source image, for video jobs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_url: Option<String>,
    /// The clip's length asked for, for video jobs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seconds: Option<u32>,
    /// Where the API should POST the prediction when it ends (Replicate's `webhook`), signed the
    /// Standard Webhooks way ([`crate::webhook`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub webhook: Option<String>,
    /// Which of its events to send there: `["completed"]`, the final state only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub webhook_events_filter: Option<Vec<String>>,
}

/// The one webhook event the server asks for: the job is final.
pub const COMPLETED: &str = "completed";

/// Where a prediction is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PredictionStatus {
    /// Accepted, waiting for a worker.
    Starting,
    /// Running.
    Processing,
    /// Done; `output` holds the result URL.
    Succeeded,
    /// Done without a result; `error` says why.
    Failed,
    /// Stopped on request.
    Canceled,
}

impl PredictionStatus {
    /// Whether the job will not change any more.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::Canceled)
    }
}

/// A prediction as the upstream reports it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Prediction {
    /// Upstream id (the `predict_id` agents see).
    pub id: String,
    /// Image or video.
    pub kind: PredictionKind,
    /// Current status.
    pub status: PredictionStatus,
    /// Result URL once succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<String>,
    /// Failure reason once failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// What the upstream billed for it, once final.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// How long it ran, as the API measured it, once it succeeded (Replicate's `metrics`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<PredictionMetrics>,
}

/// What the API measured of a prediction (Replicate's `metrics`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PredictionMetrics {
    /// Seconds it ran, from start to its final state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predict_time: Option<f64>,
}

impl Prediction {
    /// How long it ran as the API says, if it says (a time that is not a finite, positive
    /// number of seconds up to a week says nothing).
    pub fn ran_for(&self) -> Option<crate::clock::Nanos> {
        let seconds = self.metrics?.predict_time?;
        (seconds.is_finite() && seconds > 0.0 && seconds <= 7.0 * 86_400.0)
            .then(|| crate::clock::Nanos::from_secs_f64(seconds))
    }
}
