//! `[telemetry]`: OpenTelemetry traces, exported over OTLP/HTTP (protobuf) to a collector. Off
//! while `otlp_endpoint` is empty; what the spans say is in `docs/observability.md`.

use std::time::Duration;

use reqwest::Url;
use serde::Deserialize;

use super::{ConfigError, invalid};

/// `[telemetry]`, as written.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTelemetry {
    /// The collector's OTLP/HTTP URL; empty: no traces.
    otlp_endpoint: String,
    /// `service.name` on every span.
    service_name: String,
    /// Share of new traces kept (0.0-1.0); a caller's sampled flag is followed.
    sample_ratio: f64,
    /// How often finished spans are sent, in milliseconds.
    export_interval_ms: u64,
    /// How long one export may take, in milliseconds.
    export_timeout_ms: u64,
}

/// `[telemetry]`, checked: `None` when traces are off.
#[derive(Debug, Clone, PartialEq)]
pub struct TelemetryConfig {
    /// Where spans are posted: the configured URL, with `/v1/traces` added when it names no path
    /// (a collector's base URL, `http://localhost:4318`).
    pub traces_url: Url,
    /// `service.name` on every span.
    pub service_name: String,
    /// Share of the traces this server starts that are kept; a trace a caller started is kept
    /// as its `traceparent`'s sampled flag says.
    pub sample_ratio: f64,
    /// How often finished spans are sent.
    pub export_interval: Duration,
    /// How long one export may take before it is given up.
    pub export_timeout: Duration,
}

/// The longest interval or timeout accepted, in milliseconds (an hour).
const MAX_MS: u64 = 3_600_000;

impl RawTelemetry {
    /// Checks the section: `None` when `otlp_endpoint` is empty (traces off), else a URL of
    /// `http` or `https` without credentials, a service name, a ratio within 0-1 and intervals
    /// of 1 ms to an hour, each error naming its key.
    pub(super) fn validate(self) -> Result<Option<TelemetryConfig>, ConfigError> {
        let endpoint = self.otlp_endpoint.trim();
        if endpoint.is_empty() {
            return Ok(None);
        }
        let mut url = Url::parse(endpoint).map_err(|e| {
            let shown = crate::redact::url(endpoint);
            invalid("telemetry.otlp_endpoint", format!("`{shown}` is not a URL ({e}); e.g. `http://localhost:4318`"))
        })?;
        if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none_or(str::is_empty) {
            return Err(invalid(
                "telemetry.otlp_endpoint",
                "must be an http:// or https:// URL of an OTLP/HTTP collector, e.g. `http://localhost:4318`",
            ));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(invalid("telemetry.otlp_endpoint", "must not hold credentials: they would be logged"));
        }
        if url.path() == "/" || url.path().is_empty() {
            url.set_path("/v1/traces");
        }
        let service_name = self.service_name.trim();
        if service_name.is_empty() {
            return Err(invalid("telemetry.service_name", "must not be empty (the default is `mcp-ratelimit`)"));
        }
        if !(0.0..=1.0).contains(&self.sample_ratio) {
            return Err(invalid("telemetry.sample_ratio", format!("is {}; expected 0.0 to 1.0", self.sample_ratio)));
        }
        let ms = |key: &str, value: u64| {
            if (1..=MAX_MS).contains(&value) {
                Ok(Duration::from_millis(value))
            } else {
                Err(invalid(key, format!("is {value}; expected 1 to {MAX_MS} milliseconds")))
            }
        };
        Ok(Some(TelemetryConfig {
            traces_url: url,
            service_name: service_name.to_owned(),
            sample_ratio: self.sample_ratio,
            export_interval: ms("telemetry.export_interval_ms", self.export_interval_ms)?,
            export_timeout: ms("telemetry.export_timeout_ms", self.export_timeout_ms)?,
        }))
    }
}
