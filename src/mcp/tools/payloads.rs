//! What our tools answer in `structuredContent`: each type is its tool's `outputSchema`.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::Serialize;

use crate::guard::BudgetStatus;
use crate::upstream::api::{PredictionKind, PredictionStatus};

/// What image and video submissions answer.
#[derive(Debug, Serialize, JsonSchema)]
pub struct Submitted {
    /// Pass to get_prediction (or cancel_prediction).
    pub predict_id: String,
    /// Where the job is.
    pub status: PredictionStatus,
    /// Poll get_prediction no sooner than this (it covers any wait in the submission queue).
    pub next_poll_in_seconds: u64,
    /// While waiting to be submitted: the place in the queue (1 is next).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_position: Option<usize>,
    /// Units this job's price reserved in your budgets; get_prediction says what it was charged
    /// once it is final.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reserved: Option<u64>,
}

/// What get_prediction and cancel_prediction answer.
#[derive(Debug, Serialize, JsonSchema)]
pub struct PredictionReport {
    /// The job.
    pub predict_id: String,
    /// Image or video.
    pub kind: PredictionKind,
    /// Where the job is.
    pub status: PredictionStatus,
    /// Result URL, once succeeded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output: Option<String>,
    /// Failure reason, once failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// While pending: poll again no sooner than this.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_poll_in_seconds: Option<u64>,
    /// While waiting to be submitted: the place in the queue (1 is next).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_position: Option<usize>,
    /// Units the job's price reserved in your budgets.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reserved: Option<u64>,
    /// Once final: units it was charged, settled from what the upstream billed (the rest of the
    /// reservation given back, or more taken).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub charged: Option<u64>,
    /// What the upstream billed for it, once final.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<crate::upstream::api::Usage>,
}

/// One of the caller's jobs in flight, in rate_limit_status.
#[derive(Debug, Serialize, JsonSchema)]
pub struct JobInFlight {
    /// The job.
    pub predict_id: String,
    /// Image or video.
    pub kind: PredictionKind,
    /// Where the job is.
    pub status: PredictionStatus,
    /// Poll get_prediction for it no sooner than this.
    pub next_poll_in_seconds: u64,
    /// While waiting to be submitted: the place in the queue (1 is next).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_position: Option<usize>,
}

/// The upstream account and the fair queue in front of it, in rate_limit_status.
#[derive(Debug, Serialize, JsonSchema)]
pub struct QueueStatus {
    /// Predictions the account runs now, everyone's.
    pub account_in_flight: usize,
    /// Predictions the account runs at once: learnt from its answers when `account_adaptive`.
    pub account_max_in_flight: usize,
    /// Whether `account_max_in_flight` is learnt (`[upstream.adaptive]`), under the static cap
    /// `account_ceiling`.
    pub account_adaptive: bool,
    /// The static cap, `upstream.max_in_flight`.
    pub account_ceiling: usize,
    /// Jobs waiting for the account now, everyone's.
    pub waiting: usize,
    /// The most jobs that may wait.
    pub max_waiting: usize,
    /// Video jobs waiting now.
    pub videos_waiting: usize,
    /// The most video jobs that may wait.
    pub max_videos_waiting: usize,
    /// Least time between two video submissions, in milliseconds.
    pub video_min_gap_ms: u64,
    /// For a caller without a configured key: the share of the account and of the queue that
    /// such callers hold together, and may hold.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unverified_share: Option<UnverifiedShare>,
    /// When `[upstream.reserved]` or `[upstream.priority]` names the caller's tier: its rank and
    /// its reserved share of the account and the queue.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tier: Option<TierShare>,
}

/// A tier's rank and reserved share of the upstream account and its queue.
#[derive(Debug, Serialize, JsonSchema)]
pub struct TierShare {
    /// The caller's tier.
    pub tier: String,
    /// Its rank when the account is full: the waiting jobs of the highest rank go first.
    pub rank: i64,
    /// Whether the caller's jobs draw on the reservation (a caller without a configured key's
    /// never do).
    pub draws_on_reservation: bool,
    /// The account's slots reserved for the tier: a job of the tier gets the next slot that frees
    /// while the tier holds fewer.
    pub reserved_slots: usize,
    /// The queue's places reserved for it, never given to another tier.
    pub reserved_places: usize,
    /// Its jobs the account runs now.
    pub in_flight: usize,
    /// Its jobs waiting now.
    pub waiting: usize,
}

/// The account's slots and queue places that callers without a configured key share.
#[derive(Debug, Serialize, JsonSchema)]
pub struct UnverifiedShare {
    /// Their jobs the account runs now.
    pub in_flight: usize,
    /// The most of those it runs at once.
    pub max_in_flight: usize,
    /// Their jobs waiting now.
    pub waiting: usize,
    /// The most of those that may wait.
    pub max_waiting: usize,
}

/// What rate_limit_status answers.
#[derive(Debug, Serialize, JsonSchema)]
pub struct StatusReport {
    /// The caller these budgets belong to (a hash, never a credential): `tok:…` for a key,
    /// `sub:…` for an access token's subject, `ip:…` for an address, `local` on stdio.
    pub caller: String,
    /// How the caller proved who it is: `key`, `token`, `local` or `unverified`.
    pub proof: String,
    /// The tenant whose budgets the caller shares, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// The tier whose limits the caller's budgets are scaled by.
    pub tier: String,
    /// The OAuth client application the caller's token was issued to (a hash when it is a URL),
    /// whose `client:` budget every subject of it shares.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client: Option<String>,
    /// Each budget a call draws on, the in-flight caps among them.
    pub budgets: Vec<BudgetStatus>,
    /// The caller's jobs not final yet (waiting in the queue or running), oldest first.
    pub jobs_in_flight: Vec<JobInFlight>,
    /// The upstream account and the queue jobs wait in for it.
    pub upstream_queue: QueueStatus,
    /// What each tool costs (at most, for a tool priced by its arguments).
    pub costs: BTreeMap<String, u64>,
    /// The tools priced by their arguments, and the formula (held to `costs`).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub cost_formulas: BTreeMap<String, String>,
}
