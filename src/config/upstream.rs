//! `[upstream]` and `[mock_upstream]`: the paid API behind the tools — its account's size and
//! queue, the share unverified callers may hold, timeouts, retries and the breaker — and the
//! mock that stands in for it.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use serde::Deserialize;

use super::DAY_MS;
use super::{ConfigError, invalid};
use crate::limit::adaptive::ALGORITHMS;
use crate::redact::Secret;

/// The same in seconds.
const DAY_SECONDS: u64 = 86_400;

/// The route on `server.listen` that takes the paid API's webhooks.
pub const WEBHOOK_PATH: &str = "/webhooks/upstream";

/// `[upstream]`.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    /// Base URL; empty means "start the embedded mock".
    pub url: String,
    /// The credential sent with every request (empty: none). Never printed.
    pub api_key: Secret,
    /// The header it goes in: `authorization` sends `Bearer <api_key>`, any other header the key
    /// itself.
    pub api_key_header: String,
    /// Per-request timeout.
    pub timeout_ms: u64,
    /// Poll hint for image jobs.
    pub image_poll_seconds: u64,
    /// Poll hint for video jobs.
    pub video_poll_seconds: u64,
    /// Predictions the upstream account runs at once, for every caller together.
    pub max_in_flight: usize,
    /// Jobs that may wait for an account slot (or their video gap), all callers together.
    pub queue_max: usize,
    /// Least time between two video submissions to the upstream, across all callers.
    pub video_min_gap_ms: u64,
    /// Video jobs that may wait in the queue.
    pub video_queue_max: usize,
    /// Attempts of one server-owned upstream request (a queued submission, a background poll).
    pub max_attempts: u32,
    /// A Retry-After longer than this fails the job instead of parking it.
    pub max_retry_after_ms: u64,
    /// A job still pending this long after it was accepted is failed and its slot freed.
    pub job_expiry_seconds: u64,
    /// Consecutive upstream failures that open the circuit breaker.
    pub breaker_failures: u32,
    /// How long the breaker stays open before one probe may try.
    pub breaker_cooldown_ms: u64,
    /// Server-owned retries allowed, as a share of recent first attempts.
    pub retry_budget_ratio: f64,
    /// Retries allowed per window whatever the traffic, so a quiet server can still retry.
    pub retry_budget_min_retries: u32,
    /// The window the retry budget counts over.
    pub retry_budget_window_ms: u64,
    /// The share (0 to 1) of the account's slots (`max_in_flight`) and of the queue
    /// (`queue_max`) that unverified callers of every address together may hold, so configured
    /// tenants always find room.
    pub unverified_share: f64,
    /// Answers kept for `[tools.NAME] cache_ttl_ms`, all tools and scopes together; past it the
    /// oldest makes room.
    pub cache_max_entries: usize,
    /// The same bound in bytes of the answers' JSON.
    pub cache_max_bytes: u64,
    /// The account's slots learnt from its answers (`[upstream.adaptive]`).
    pub adaptive: AdaptiveConfig,
    /// `[upstream.reserved]`: tier → the share (0 to 1) of the account's slots and of the queue
    /// its configured callers may always count on (slots lent to others for one job at most).
    #[serde(default)]
    pub reserved: BTreeMap<String, f64>,
    /// `[upstream.priority]`: tier → its rank when the account is full (higher goes first; a
    /// tier not named ranks 0).
    #[serde(default)]
    pub priority: BTreeMap<String, i64>,
    /// The URL the paid API is asked to call when a job ends (`…/webhooks/upstream`); empty: off.
    pub webhook_url: String,
    /// The `whsec_` secret its webhooks are signed with. Never printed.
    pub webhook_secret: Secret,
}

/// `[upstream.adaptive]`, `[proxy.adaptive]`: the slots toward the upstream learnt from its
/// answers instead of fixed ([`crate::limit::adaptive`]).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdaptiveConfig {
    /// Learn the limit (else the static cap holds).
    pub enabled: bool,
    /// How: one of [`ALGORITHMS`] (`aimd`, `gradient2`).
    pub algorithm: String,
    /// Fewest slots it learns down to.
    pub min: usize,
    /// Most slots it learns up to; 0: the static cap (`max_in_flight`), which it never exceeds.
    pub max: usize,
    /// What an overload cuts the limit to, as a share of itself (0 to 1, exclusive); for every
    /// algorithm.
    pub backoff_ratio: f64,
    /// gradient2: how much slower than the long-term round-trip time an answer may be before the
    /// limit shrinks (at least 1).
    pub tolerance: f64,
    /// gradient2: how far one answer moves the limit towards its new estimate (above 0, at most 1).
    pub smoothing: f64,
    /// gradient2: the answers the long-term round-trip time averages over (at least 1).
    pub long_window: usize,
    /// gradient2: the slots it allows above what the latency gradient says, how far it probes
    /// per answer (at least 1).
    pub queue_size: usize,
}

impl AdaptiveConfig {
    /// The most slots it learns up to under a static cap of `ceiling`.
    pub fn max_under(&self, ceiling: usize) -> usize {
        if self.max == 0 { ceiling } else { self.max.min(ceiling) }
    }

    /// The section at `section` (`upstream.adaptive`), checked against the static cap `ceiling`.
    pub(super) fn validate(&self, section: &str, ceiling: usize) -> Result<(), ConfigError> {
        let key = |name: &str| format!("{section}.{name}");
        if !ALGORITHMS.contains(&self.algorithm.as_str()) {
            return Err(invalid(
                key("algorithm"),
                format!("`{}` is not one: {}", self.algorithm, ALGORITHMS.join(", ")),
            ));
        }
        if self.min == 0 {
            return Err(invalid(key("min"), "at least one slot"));
        }
        let max = if self.max == 0 { ceiling } else { self.max };
        if self.max > ceiling {
            return Err(invalid(key("max"), format!("{} is above the static cap {ceiling}, its ceiling", self.max)));
        }
        if self.min > max {
            return Err(invalid(key("min"), format!("{} is above max {max}", self.min)));
        }
        if !(self.backoff_ratio > 0.0 && self.backoff_ratio < 1.0) {
            return Err(invalid(
                key("backoff_ratio"),
                format!("must be between 0 and 1, exclusive (got {})", self.backoff_ratio),
            ));
        }
        // The gradient2 keys are checked whatever the algorithm: a switch must not meet a bad one.
        if !(self.tolerance >= 1.0 && self.tolerance.is_finite()) {
            return Err(invalid(
                key("tolerance"),
                format!(
                    "must be at least 1 (1.5: an answer 1.5× the long-term time is still fine; got {})",
                    self.tolerance
                ),
            ));
        }
        if !(self.smoothing > 0.0 && self.smoothing <= 1.0) {
            return Err(invalid(key("smoothing"), format!("must be above 0 and at most 1 (got {})", self.smoothing)));
        }
        if self.long_window == 0 {
            return Err(invalid(key("long_window"), "at least one answer to average over"));
        }
        if self.queue_size == 0 {
            return Err(invalid(key("queue_size"), "at least 1: with none the limit could never grow"));
        }
        Ok(())
    }
}

impl UpstreamConfig {
    /// The account's slots unverified callers may hold together: `max_in_flight` ×
    /// `unverified_share`, rounded down.
    pub fn unverified_slots(&self) -> usize {
        self.unverified_share_of(self.max_in_flight)
    }

    /// The queue places unverified callers may hold together: `queue_max` × `unverified_share`,
    /// rounded down.
    pub fn unverified_places(&self) -> usize {
        self.unverified_share_of(self.queue_max)
    }

    /// `unverified_share` of `whole` (a proxied server's slots, say), rounded down: a share never
    /// grants what it does not cover.
    pub fn unverified_share_of(&self, whole: usize) -> usize {
        let share = self.unverified_share;
        if share >= 1.0 { whole } else { (whole as f64 * share.max(0.0)).floor() as usize }
    }
}

impl std::fmt::Debug for UpstreamConfig {
    /// The URL without its password (`https://user:token@…` is how some APIs take a key); a new
    /// field shows once it is listed here.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamConfig")
            .field("url", &crate::redact::url(&self.url))
            .field("api_key", &self.api_key)
            .field("api_key_header", &self.api_key_header)
            .field("timeout_ms", &self.timeout_ms)
            .field("image_poll_seconds", &self.image_poll_seconds)
            .field("video_poll_seconds", &self.video_poll_seconds)
            .field("max_in_flight", &self.max_in_flight)
            .field("queue_max", &self.queue_max)
            .field("video_min_gap_ms", &self.video_min_gap_ms)
            .field("video_queue_max", &self.video_queue_max)
            .field("max_attempts", &self.max_attempts)
            .field("max_retry_after_ms", &self.max_retry_after_ms)
            .field("job_expiry_seconds", &self.job_expiry_seconds)
            .field("breaker_failures", &self.breaker_failures)
            .field("breaker_cooldown_ms", &self.breaker_cooldown_ms)
            .field("retry_budget_ratio", &self.retry_budget_ratio)
            .field("retry_budget_min_retries", &self.retry_budget_min_retries)
            .field("retry_budget_window_ms", &self.retry_budget_window_ms)
            .field("unverified_share", &self.unverified_share)
            .field("cache_max_entries", &self.cache_max_entries)
            .field("cache_max_bytes", &self.cache_max_bytes)
            .field("adaptive", &self.adaptive)
            .field("reserved", &self.reserved)
            .field("priority", &self.priority)
            .field("webhook_url", &crate::redact::url(&self.webhook_url))
            .field("webhook_secret", &self.webhook_secret)
            .finish()
    }
}

/// `[mock_upstream]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MockUpstreamConfig {
    /// Listen address of the `mock-upstream` command.
    pub listen: SocketAddr,
    /// Latency added to every response.
    pub latency_ms: u64,
    /// Fraction of requests answered 429.
    pub rate_429: f64,
    /// Retry-After of those 429s.
    pub retry_after_seconds: u64,
    /// Fraction of requests answered 503.
    pub rate_5xx: f64,
    /// Concurrent predictions before 429.
    pub max_concurrent_predictions: usize,
    /// Duration of an image job.
    pub image_job_ms: u64,
    /// Duration of a video job.
    pub video_job_ms: u64,
    /// The longest clip it renders; a longer ask is cut to it and billed for what was rendered.
    pub max_video_seconds: u64,
    /// A key every `/v1` request must carry, as `Authorization: Bearer <key>` or `X-Api-Key: <key>`
    /// (empty: none asked); anything else is answered 401. Never printed.
    pub api_key: Secret,
    /// The `whsec_` secret it signs the webhooks it sends with (empty: it sends none). Never
    /// printed.
    pub webhook_secret: Secret,
}

/// A fraction from 0 to 1 at `key`.
fn fraction(key: &str, value: f64) -> Result<(), ConfigError> {
    if (0.0..=1.0).contains(&value) {
        return Ok(());
    }
    Err(invalid(key, format!("must be a fraction between 0.0 and 1.0 (got {value})")))
}

impl UpstreamConfig {
    /// The header and value `api_key` is sent as, if one is set: the value marked sensitive, so
    /// the HTTP stack never prints it.
    pub fn credential(&self) -> Option<(http::HeaderName, http::HeaderValue)> {
        if self.api_key.is_empty() {
            return None;
        }
        let name = http::HeaderName::try_from(self.api_key_header.as_str()).ok()?;
        let value = if name == http::header::AUTHORIZATION {
            format!("Bearer {}", self.api_key.expose())
        } else {
            self.api_key.expose().to_owned()
        };
        let mut value = http::HeaderValue::try_from(value).ok()?;
        value.set_sensitive(true);
        Some((name, value))
    }

    /// The section, checked: a URL the client can call, every count and duration above zero,
    /// every duration within a day (a week for a job's expiry), the shares fractions.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if http::HeaderName::try_from(self.api_key_header.as_str()).is_err() {
            return Err(invalid("upstream.api_key_header", "not a valid header name"));
        }
        if !self.api_key.is_empty() && self.credential().is_none() {
            return Err(invalid("upstream.api_key", "not a valid header value (no line breaks or control characters)"));
        }
        if !self.url.is_empty() {
            match reqwest::Url::parse(&self.url) {
                Ok(u) if matches!(u.scheme(), "http" | "https") => {}
                Ok(u) => return Err(invalid("upstream.url", format!("scheme `{}` is not http or https", u.scheme()))),
                Err(e) => return Err(invalid("upstream.url", format!("not a URL: {e}"))),
            }
        }
        for (key, value) in [
            ("upstream.timeout_ms", self.timeout_ms),
            ("upstream.image_poll_seconds", self.image_poll_seconds),
            ("upstream.video_poll_seconds", self.video_poll_seconds),
            ("upstream.max_in_flight", self.max_in_flight as u64),
            ("upstream.queue_max", self.queue_max as u64),
            ("upstream.video_queue_max", self.video_queue_max as u64),
            ("upstream.max_attempts", u64::from(self.max_attempts)),
            ("upstream.max_retry_after_ms", self.max_retry_after_ms),
            ("upstream.job_expiry_seconds", self.job_expiry_seconds),
            ("upstream.breaker_failures", u64::from(self.breaker_failures)),
            ("upstream.breaker_cooldown_ms", self.breaker_cooldown_ms),
            ("upstream.retry_budget_window_ms", self.retry_budget_window_ms),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be greater than zero"));
            }
        }
        // Durations the server adds to the current instant (timers, deadlines, hints): a day at
        // most (a week for a job's expiry), so no sum can leave the clock's range; longer would be
        // a typo. config.toml names each bound.
        for (key, value, most, what) in [
            ("upstream.timeout_ms", self.timeout_ms, DAY_MS, "a day"),
            ("upstream.image_poll_seconds", self.image_poll_seconds, DAY_SECONDS, "a day"),
            ("upstream.video_poll_seconds", self.video_poll_seconds, DAY_SECONDS, "a day"),
            ("upstream.video_min_gap_ms", self.video_min_gap_ms, DAY_MS, "a day"),
            ("upstream.max_retry_after_ms", self.max_retry_after_ms, DAY_MS, "a day"),
            ("upstream.job_expiry_seconds", self.job_expiry_seconds, 7 * DAY_SECONDS, "a week"),
            ("upstream.breaker_cooldown_ms", self.breaker_cooldown_ms, DAY_MS, "a day"),
            ("upstream.retry_budget_window_ms", self.retry_budget_window_ms, DAY_MS, "a day"),
        ] {
            if value > most {
                return Err(invalid(key, format!("{value} is more than {what} ({most})")));
            }
        }
        self.validate_webhooks()?;
        self.adaptive.validate("upstream.adaptive", self.max_in_flight)?;
        fraction("upstream.unverified_share", self.unverified_share)?;
        fraction("upstream.retry_budget_ratio", self.retry_budget_ratio)?;
        for (tier, share) in &self.reserved {
            fraction(&format!("upstream.reserved.{tier}"), *share)?;
        }
        // A little above 1 for the sum's rounding (0.1 + 0.2 + 0.7), never a whole slot's worth.
        let sum: f64 = self.reserved.values().sum();
        if sum > 1.0 + 1e-9 {
            return Err(invalid(
                "upstream.reserved",
                format!("the shares add up to {sum}, more than the whole account"),
            ));
        }
        Ok(())
    }

    /// Where the paid API is asked to send its webhooks, and the key they are signed with, when
    /// `webhook_url` is set (validation saw both readable).
    pub fn webhooks(&self) -> Option<crate::webhook::WebhookTarget> {
        let url = reqwest::Url::parse(&self.webhook_url).ok()?;
        let key = crate::webhook::WebhookKey::parse(self.webhook_secret.expose()).ok()?;
        Some(crate::webhook::WebhookTarget { url, key })
    }

    /// `webhook_url` and `webhook_secret`: both or neither, the URL an http(s) one ending in
    /// `/webhooks/upstream`, the secret a `whsec_` one.
    fn validate_webhooks(&self) -> Result<(), ConfigError> {
        if !self.webhook_secret.is_empty() {
            crate::webhook::WebhookKey::parse(self.webhook_secret.expose())
                .map_err(|why| invalid("upstream.webhook_secret", why))?;
        }
        if self.webhook_url.is_empty() {
            return Ok(());
        }
        if self.webhook_secret.is_empty() {
            return Err(invalid(
                "upstream.webhook_secret",
                "is needed with upstream.webhook_url: webhooks are taken only signed",
            ));
        }
        match reqwest::Url::parse(&self.webhook_url) {
            Ok(u) if !matches!(u.scheme(), "http" | "https") => {
                Err(invalid("upstream.webhook_url", format!("scheme `{}` is not http or https", u.scheme())))
            }
            Ok(u) if !u.path().ends_with(WEBHOOK_PATH) => {
                Err(invalid("upstream.webhook_url", format!("must end in {WEBHOOK_PATH}, the route that takes them")))
            }
            Ok(u) if u.query().is_some() || u.fragment().is_some() => {
                Err(invalid("upstream.webhook_url", "must carry no query or fragment (the server adds `?job=`)"))
            }
            Ok(_) => Ok(()),
            Err(e) => Err(invalid("upstream.webhook_url", format!("not a URL: {e}"))),
        }
    }

    /// `[upstream.reserved]` and `[upstream.priority]` checked against `[tiers]`: every tier
    /// they name is one.
    pub(super) fn validate_tiers(&self, tiers: &BTreeMap<String, f64>) -> Result<(), ConfigError> {
        let named = self.reserved.keys().map(|t| ("reserved", t)).chain(self.priority.keys().map(|t| ("priority", t)));
        for (section, tier) in named {
            if !tiers.contains_key(tier) {
                let names = tiers.keys().cloned().collect::<Vec<_>>().join(", ");
                return Err(invalid(
                    format!("upstream.{section}.{tier}"),
                    format!("unknown tier `{tier}`; the tiers are {names}"),
                ));
            }
        }
        Ok(())
    }
}

impl MockUpstreamConfig {
    /// The section, checked: durations within a day, rates fractions, clips an hour at most.
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        for (key, value, most) in [
            ("mock_upstream.latency_ms", self.latency_ms, DAY_MS),
            ("mock_upstream.retry_after_seconds", self.retry_after_seconds, DAY_SECONDS),
            ("mock_upstream.image_job_ms", self.image_job_ms, DAY_MS),
            ("mock_upstream.video_job_ms", self.video_job_ms, DAY_MS),
        ] {
            if value > most {
                return Err(invalid(key, format!("{value} is more than a day ({most})")));
            }
        }
        if !(1..=3600).contains(&self.max_video_seconds) {
            let got = self.max_video_seconds;
            return Err(invalid("mock_upstream.max_video_seconds", format!("1 to 3600 seconds (got {got})")));
        }
        if !self.webhook_secret.is_empty() {
            crate::webhook::WebhookKey::parse(self.webhook_secret.expose())
                .map_err(|why| invalid("mock_upstream.webhook_secret", why))?;
        }
        fraction("mock_upstream.rate_429", self.rate_429)?;
        fraction("mock_upstream.rate_5xx", self.rate_5xx)
    }
}
