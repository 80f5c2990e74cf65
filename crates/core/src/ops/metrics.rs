//! What the limits are doing, as Prometheus metrics at `GET /metrics`.
//!
//! Each server instance has its own recorder (not the process-global one), so two servers in
//! one process — tests, or an embedding — never mix their numbers. Labels name layers, tools,
//! outcomes and a 16-way *client bucket* (a hash of the caller id): enough to see whether
//! rejections come from one caller or many, never enough to tell who. No label ever holds a
//! token, a caller id or an address.
//!
//! Counters live in a registry of our own, not the exporter's: a proxied server's tools come and
//! go, and the series of a tool it no longer lists are forgotten ([`Metrics::forget_tools`]),
//! which the exporter's registry cannot do. Gauges stay with the exporter.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use metrics::{Counter, Gauge, Key, Label, Level, Metadata, Recorder, SharedString};
use metrics_exporter_prometheus::formatting::sanitize_label_value;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle, PrometheusRecorder};
use metrics_util::registry::{AtomicStorage, Registry};

use crate::config::Catalogue;
use crate::identity::Caller;

const META: Metadata<'static> = Metadata::new("mcp_ratelimit", Level::INFO, Some(module_path!()));

/// `mcp_ratelimit_decisions_total{layer, tool, outcome}`.
pub const DECISIONS: &str = "mcp_ratelimit_decisions_total";
/// `mcp_ratelimit_rejections_total{layer, tool, code, client_bucket}`.
pub const REJECTIONS: &str = "mcp_ratelimit_rejections_total";
/// `mcp_ratelimit_in_flight_calls`: admissions still held — tool calls running, and jobs holding
/// their in-flight slots until they are final.
pub const IN_FLIGHT: &str = "mcp_ratelimit_in_flight_calls";
/// `mcp_ratelimit_upstream_requests_total{tool, outcome}`.
pub const UPSTREAM: &str = "mcp_ratelimit_upstream_requests_total";
/// `mcp_ratelimit_upstream_retries_total{work, reason}`: retries of server-owned work.
pub const UPSTREAM_RETRIES: &str = "mcp_ratelimit_upstream_retries_total";
/// `mcp_ratelimit_loop_detections_total{tool}`: calls refused as a loop.
pub const LOOP_DETECTIONS: &str = "mcp_ratelimit_loop_detections_total";
/// `mcp_ratelimit_queue_depth{flow_bucket}`: jobs waiting for the upstream account, per flow
/// (tenant, or caller without one) bucket.
pub const QUEUE_DEPTH: &str = "mcp_ratelimit_queue_depth";
/// `mcp_ratelimit_account_slots_in_use`: the upstream account's slots held by running jobs.
pub const ACCOUNT_SLOTS_IN_USE: &str = "mcp_ratelimit_account_slots_in_use";
/// `mcp_ratelimit_account_tier_slots{tier, of}`: per tier of `[upstream.reserved]` or
/// `[upstream.priority]`, the account's slots reserved for it (`of="reserved"`) and held by its
/// configured callers' jobs (`of="in_use"`).
pub const ACCOUNT_TIER_SLOTS: &str = "mcp_ratelimit_account_tier_slots";
/// `mcp_ratelimit_account_tier_places{tier, of}`: the same for the queue's places: reserved
/// (`of="reserved"`) and held by its jobs waiting (`of="waiting"`).
pub const ACCOUNT_TIER_PLACES: &str = "mcp_ratelimit_account_tier_places";
/// `mcp_ratelimit_upstream_concurrency_limit`: the slots toward the upstream handed out now —
/// the static cap, or the limit `[upstream.adaptive]` (`[proxy.adaptive]`) has learnt.
pub const UPSTREAM_CONCURRENCY_LIMIT: &str = "mcp_ratelimit_upstream_concurrency_limit";
/// `mcp_ratelimit_jobs_in_flight`: accepted jobs not yet final.
pub const JOBS_IN_FLIGHT: &str = "mcp_ratelimit_jobs_in_flight";
/// `mcp_ratelimit_subscriptions_open`: 2026-07-28 subscriptions (`subscriptions/listen`) callers
/// hold open through the proxy (only a proxy reports it).
pub const SUBSCRIPTIONS_OPEN: &str = "mcp_ratelimit_subscriptions_open";
/// `mcp_ratelimit_store_errors_total{layer}`: decisions the limiter store could not make
/// (`http`, `method`, `tool`, and `account` for the upstream account's shared slots and learnt
/// limit).
pub const STORE_ERRORS: &str = "mcp_ratelimit_store_errors_total";
/// `mcp_ratelimit_store_up`: 1 while the limiter store answers, 0 while it fails.
pub const STORE_UP: &str = "mcp_ratelimit_store_up";
/// `mcp_ratelimit_store_slice_units`: units of busy keys' budgets this instance holds of a shared
/// store's, decided here without a round trip (budget slices).
pub const STORE_SLICE_UNITS: &str = "mcp_ratelimit_store_slice_units";
/// Round trips to the shared store (Redis) since start.
pub const STORE_ROUND_TRIPS: &str = "mcp_ratelimit_store_round_trips_total";
/// Commands (script calls and plain commands) sent to the shared store since start.
pub const STORE_COMMANDS: &str = "mcp_ratelimit_store_commands_total";
/// `mcp_ratelimit_store_slice_keys`: the keys this instance holds slices of.
pub const STORE_SLICE_KEYS: &str = "mcp_ratelimit_store_slice_keys";
/// `mcp_ratelimit_breaker_state`: the upstream circuit breaker (0 closed, 1 half-open, 2 open).
pub const BREAKER_STATE: &str = "mcp_ratelimit_breaker_state";

/// `mcp_ratelimit_upstream_requests_saved_total{tool, how}`: tool calls answered without an
/// upstream request of their own: `coalesced` (an identical call's, in flight) or `cached`.
pub const UPSTREAM_SAVED: &str = "mcp_ratelimit_upstream_requests_saved_total";

/// `mcp_ratelimit_settled_units_total{tool, how}`: cost units moved when calls' prices were
/// settled from the usage the upstream reported: `refunded` (used less than reserved) or
/// `charged` (more).
pub const SETTLED_UNITS: &str = "mcp_ratelimit_settled_units_total";
/// `mcp_ratelimit_settlement_errors_total{tool}`: tries of a settlement the limiter store did
/// not take (each is tried again, for up to a minute).
pub const SETTLEMENT_ERRORS: &str = "mcp_ratelimit_settlement_errors_total";

/// `mcp_ratelimit_settlements_given_up_total{tool}`: settlements the limiter store did not take
/// for a minute of tries: the reservation stands.
pub const SETTLEMENTS_GIVEN_UP: &str = "mcp_ratelimit_settlements_given_up_total";

/// `mcp_ratelimit_shed_total{tier, unverified}`: tool calls refused, before anything was
/// charged, because the server itself was behind (`[server.shedding]`).
pub const SHED: &str = "mcp_ratelimit_shed_total";
/// `mcp_ratelimit_shed_level`: how many of the lowest classes of callers the server refuses now
/// (0: none).
pub const SHED_LEVEL: &str = "mcp_ratelimit_shed_level";
/// `mcp_ratelimit_queueing_delay_seconds`: the least queueing delay of the tool calls of the last
/// interval of `[server.shedding]` (over `target_ms`, the server is behind).
pub const QUEUEING_DELAY: &str = "mcp_ratelimit_queueing_delay_seconds";

/// `mcp_ratelimit_config_reloads_total{outcome}`: config reloads applied or refused.
pub const CONFIG_RELOADS: &str = "mcp_ratelimit_config_reloads_total";

/// `mcp_ratelimit_connections_open{listener}`: connections a listener (`mcp`, `admin`) holds.
pub const CONNECTIONS_OPEN: &str = "mcp_ratelimit_connections_open";
/// `mcp_ratelimit_connections_refused_total{listener, reason}`: connections refused as they were
/// accepted: `max_connections` or `max_connections_per_address`.
pub const CONNECTIONS_REFUSED: &str = "mcp_ratelimit_connections_refused_total";
/// `mcp_ratelimit_connections_timed_out_total{listener}`: connections closed without ever
/// presenting a whole request, `server.header_read_timeout_ms` after opening (silent, half a
/// request, half an HTTP/2 preface). An idle kept-alive connection closed is not counted.
pub const CONNECTIONS_TIMED_OUT: &str = "mcp_ratelimit_connections_timed_out_total";

/// `mcp_ratelimit_token_validations_total{outcome}`: bearer tokens checked as OAuth access tokens
/// (`[auth.oauth]`), by outcome: `valid`, or why not ([`TOKEN_OUTCOMES`]).
pub const TOKEN_VALIDATIONS: &str = "mcp_ratelimit_token_validations_total";
/// `mcp_ratelimit_jwks_fetches_total{outcome}`: fetches of the authorization server's signing keys
/// (its metadata too, the first time), `ok` or `failed`.
pub const JWKS_FETCHES: &str = "mcp_ratelimit_jwks_fetches_total";
/// `mcp_ratelimit_token_introspections_total{outcome}`: RFC 7662 introspections of opaque tokens
/// asked of the authorization server: `active`, `inactive` or `failed`.
pub const TOKEN_INTROSPECTIONS: &str = "mcp_ratelimit_token_introspections_total";

/// `mcp_ratelimit_trace_queue_bytes`: bytes of names and attribute values of the finished spans
/// waiting for the OTLP collector (`[telemetry]`), queued or in a batch it has not answered: at
/// most 8 MiB.
pub const TRACE_QUEUE_BYTES: &str = "mcp_ratelimit_trace_queue_bytes";
/// `mcp_ratelimit_trace_spans_dropped_total`: finished spans dropped because the exporter's queue
/// was full (2,048 spans or 8 MiB): the collector is slow or away.
pub const TRACE_SPANS_DROPPED: &str = "mcp_ratelimit_trace_spans_dropped_total";

/// `mcp_ratelimit_upstream_webhooks_total{outcome}`: webhooks the paid API sent to
/// `POST /webhooks/upstream`: `taken`, or why refused ([`WEBHOOK_OUTCOMES`]).
pub const WEBHOOKS: &str = "mcp_ratelimit_upstream_webhooks_total";
/// `mcp_ratelimit_account_slots{state}`: the account's slots this instance's running jobs hold,
/// `busy` (before their expected end) and `held_idle` (past it, not yet known final: most likely
/// ended and waiting for the server to learn it), and the account's `free` slots.
pub const ACCOUNT_SLOTS: &str = "mcp_ratelimit_account_slots";
/// `mcp_ratelimit_account_idle_held_milliseconds_total`: time the account's slots were held by
/// jobs that had already ended (the API's `predict_time` says when), before the server learnt it.
pub const ACCOUNT_IDLE_HELD: &str = "mcp_ratelimit_account_idle_held_milliseconds_total";
/// `mcp_ratelimit_upstream_expected_job_seconds{class}`: how long after its submission a job of
/// the class is expected to be final, as learnt from the jobs seen (its first poll's time).
pub const EXPECTED_JOB_SECONDS: &str = "mcp_ratelimit_upstream_expected_job_seconds";

/// Every outcome of a webhook, as `mcp_ratelimit_upstream_webhooks_total` labels it.
pub const WEBHOOK_OUTCOMES: [&str; 8] =
    ["taken", "bad_signature", "stale", "replayed", "unknown_job", "too_large", "unreadable", "unavailable"];

/// Every outcome of a token's validation, as `mcp_ratelimit_token_validations_total` labels it.
pub const TOKEN_OUTCOMES: [&str; 14] = [
    "valid",
    "expired",
    "not_yet_valid",
    "bad_signature",
    "wrong_audience",
    "wrong_issuer",
    "unknown_key",
    "algorithm_not_allowed",
    "malformed",
    "no_subject",
    "insufficient_scope",
    "inactive",
    "not_a_jwt",
    "unavailable",
];

/// What kind of series a metric family is, as its `# TYPE` line says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Only ever goes up (kept in our own registry: see the module doc).
    Counter,
    /// Goes up and down, or is sampled from live state when `/metrics` is scraped.
    Gauge,
}

/// One metric family the server can emit: its name, its kind and its `# HELP` text.
#[derive(Debug, Clone, Copy)]
pub struct Family {
    /// The family's name, e.g. [`DECISIONS`].
    pub name: &'static str,
    /// Counter or gauge.
    pub kind: Kind,
    /// The `# HELP` text.
    pub help: &'static str,
}

const fn counter(name: &'static str, help: &'static str) -> Family {
    Family { name, kind: Kind::Counter, help }
}

const fn gauge(name: &'static str, help: &'static str) -> Family {
    Family { name, kind: Kind::Gauge, help }
}

/// Every metric family the server can emit, each described once, here: [`Metrics::new`] gives
/// each its `# HELP` from this table, so a name recorded without a row would have none (a test
/// reads this file and fails on a `mcp_ratelimit_` name without one).
pub const FAMILIES: &[Family] = &[
    counter(DECISIONS, "Limit decisions by layer, tool (or method) and outcome."),
    counter(REJECTIONS, "Refusals by layer, tool, code and client bucket (a 16-way hash)."),
    counter(UPSTREAM, "Requests to the paid API by tool and outcome."),
    counter(UPSTREAM_RETRIES, "Retries of server-owned upstream work by kind and reason."),
    counter(UPSTREAM_SAVED, "Tool calls answered without an upstream request of their own, by tool and how."),
    counter(
        SETTLED_UNITS,
        "Cost units refunded or charged when prices were settled from the usage the upstream reported.",
    ),
    counter(SETTLEMENT_ERRORS, "Tries of a price settlement the limiter store did not take."),
    counter(
        SETTLEMENTS_GIVEN_UP,
        "Price settlements the limiter store did not take for a minute of tries (reservation kept).",
    ),
    counter(LOOP_DETECTIONS, "Tool calls refused because the caller repeated them in a loop."),
    counter(STORE_ERRORS, "Decisions the limiter store could not make, by layer."),
    counter(CONNECTIONS_REFUSED, "Connections refused as they were accepted, by listener and the cap that was full."),
    counter(
        CONNECTIONS_TIMED_OUT,
        "Connections closed without ever presenting a whole request within server.header_read_timeout_ms.",
    ),
    counter(CONFIG_RELOADS, "Config reloads applied or refused."),
    counter(TOKEN_VALIDATIONS, "Bearer tokens checked as OAuth access tokens, by outcome."),
    counter(JWKS_FETCHES, "Fetches of the authorization server's signing keys (JWKS), by outcome (ok, failed)."),
    counter(TOKEN_INTROSPECTIONS, "RFC 7662 introspections of opaque tokens, by outcome (active, inactive, failed)."),
    counter(WEBHOOKS, "Webhooks the paid API sent to /webhooks/upstream, by outcome (taken, or why refused)."),
    counter(
        ACCOUNT_IDLE_HELD,
        "Milliseconds the account's slots were held by jobs already ended upstream, before the server learnt it.",
    ),
    counter(SHED, "Tool calls refused before any charge because the server itself was behind, by tier and unverified."),
    counter(
        TRACE_SPANS_DROPPED,
        "Finished spans dropped because the exporter's queue was full (2048 spans or 8 MiB): the collector is slow or away.",
    ),
    gauge(IN_FLIGHT, "Admissions still held: tool calls running and jobs not yet final."),
    gauge(QUEUE_DEPTH, "Jobs waiting for the upstream account, by flow bucket (a 16-way hash of the tenant)."),
    gauge(ACCOUNT_SLOTS_IN_USE, "The upstream account's slots held by running jobs."),
    gauge(
        ACCOUNT_SLOTS,
        "The account's slots: busy, held_idle (past the job's expected end, not yet known final), free.",
    ),
    gauge(EXPECTED_JOB_SECONDS, "How long after its submission a job of the class is expected to be final, as learnt."),
    gauge(ACCOUNT_TIER_SLOTS, "The account's slots reserved for a tier, and held by its jobs (of: reserved, in_use)."),
    gauge(ACCOUNT_TIER_PLACES, "The queue's places reserved for a tier, and held by its jobs (of: reserved, waiting)."),
    gauge(
        UPSTREAM_CONCURRENCY_LIMIT,
        "Slots toward the upstream handed out now: the static cap, or the adaptive limit learnt.",
    ),
    gauge(JOBS_IN_FLIGHT, "Accepted jobs (image and video predictions) not yet final."),
    gauge(SUBSCRIPTIONS_OPEN, "2026-07-28 subscriptions (subscriptions/listen) callers hold open through the proxy."),
    gauge(STORE_UP, "1 while the limiter store answers, 0 while it fails."),
    gauge(STORE_SLICE_UNITS, "Units of busy keys' budgets this instance holds of Redis's, decided here (slices)."),
    gauge(STORE_SLICE_KEYS, "Keys this instance holds budget slices of."),
    counter(
        STORE_ROUND_TRIPS,
        "Round trips to the shared store (Redis); the calls made at one moment travel together as one.",
    ),
    counter(STORE_COMMANDS, "Commands (script calls and plain commands) sent to the shared store (Redis)."),
    gauge(BREAKER_STATE, "The upstream circuit breaker: 0 closed, 1 half-open, 2 open."),
    gauge(CONNECTIONS_OPEN, "Connections a listener holds open, by listener."),
    gauge(
        TRACE_QUEUE_BYTES,
        "Bytes of names and attribute values of the finished spans waiting for the OTLP collector (at most 8 MiB).",
    ),
    gauge(SHED_LEVEL, "How many of the lowest classes of callers the server refuses because it is behind."),
    gauge(QUEUEING_DELAY, "The least queueing delay of the tool calls of the last shedding interval, in seconds."),
];

/// The connection counters of one listener, registered once, so accepting a connection only
/// moves handles ([`Metrics::connections`]); [`ConnectionMetrics::none`] for a listener without
/// `/metrics` (the mock upstream).
#[derive(Clone)]
pub struct ConnectionMetrics {
    /// Connections open now.
    pub open: Gauge,
    /// Refused past `server.max_connections`.
    pub refused_full: Counter,
    /// Refused past `server.max_connections_per_address`.
    pub refused_address: Counter,
    /// Closed without ever presenting a request.
    pub timed_out: Counter,
}

impl ConnectionMetrics {
    /// Handles that count nothing.
    pub fn none() -> Self {
        Self {
            open: Gauge::noop(),
            refused_full: Counter::noop(),
            refused_address: Counter::noop(),
            timed_out: Counter::noop(),
        }
    }
}

impl std::fmt::Debug for ConnectionMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ConnectionMetrics")
    }
}

/// Where a decision was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layer {
    /// The coarse HTTP limit on `POST /mcp`.
    Http,
    /// A per-method limit (`tools/list`, `tools/call`, other).
    Method,
    /// The tool guard: caller, tenant and per-tool budgets, in-flight slots.
    Tool,
}

/// How a decision went.
#[derive(Debug, Clone, Copy)]
enum Outcome {
    Allowed,
    Refused,
    /// A shadow limit would have refused; the call went through.
    ShadowRefused,
}

/// The labelled key of `mcp_ratelimit_decisions_total`, the one place its labels are spelled.
fn decision_key(layer: Layer, tool: &str, outcome: Outcome) -> Key {
    let outcome = match outcome {
        Outcome::Allowed => "allowed",
        Outcome::Refused => "refused",
        Outcome::ShadowRefused => "shadow_refused",
    };
    let labels =
        vec![Label::new("layer", layer.as_str()), Label::new("tool", tool.to_owned()), Label::new("outcome", outcome)];
    Key::from_parts(DECISIONS, labels)
}

impl Layer {
    /// Position in the pre-registered handle tables.
    fn index(self) -> usize {
        match self {
            Layer::Http => 0,
            Layer::Method => 1,
            Layer::Tool => 2,
        }
    }

    /// The `layer` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Layer::Http => "http",
            Layer::Method => "method",
            Layer::Tool => "tool",
        }
    }
}

/// The names decisions are recorded under, per layer, registered once at start-up so the hot
/// path increments a handle instead of building a labelled key.
const HTTP_NAMES: &[&str] = &["POST /mcp"];
const METHOD_NAMES: &[&str] = &["tools/list", "tools/call", "other"];

/// The server's metrics.
pub struct Metrics {
    recorder: PrometheusRecorder,
    handle: PrometheusHandle,
    /// Every counter (see the module doc for why not the recorder's).
    counters: Registry<Key, AtomicStorage>,
    /// Each counter's help text, by name.
    help: HashMap<&'static str, &'static str>,
    /// `[layer][name] -> [allowed, refused]` for every known layer and name.
    decisions: [HashMap<String, [Counter; 2]>; 3],
    /// One counter per [`TOKEN_OUTCOMES`], in its order: a token is checked on every request.
    token_validations: Vec<Counter>,
    in_flight: Gauge,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    /// Metrics with no tool's counters registered ahead (each is registered at its first use).
    fn default() -> Self {
        Self::new(&Catalogue::new())
    }
}

impl Metrics {
    /// A fresh recorder with every metric described, and the decision counters of every tool of
    /// `tools` registered ahead.
    pub fn new(tools: &Catalogue) -> Self {
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let counters = Registry::atomic();
        let mut help = HashMap::new();
        for family in FAMILIES {
            match family.kind {
                Kind::Counter => {
                    help.insert(family.name, family.help);
                }
                Kind::Gauge => {
                    recorder.describe_gauge(family.name.into(), None, SharedString::const_str(family.help));
                }
            }
        }
        let register = |layer: Layer, names: &mut dyn Iterator<Item = &str>| -> HashMap<String, [Counter; 2]> {
            names
                .map(|name| {
                    let counter = |outcome| counter_in(&counters, &decision_key(layer, name, outcome));
                    (name.to_owned(), [counter(Outcome::Allowed), counter(Outcome::Refused)])
                })
                .collect()
        };
        let decisions = [
            register(Layer::Http, &mut HTTP_NAMES.iter().copied()),
            register(Layer::Method, &mut METHOD_NAMES.iter().copied()),
            register(Layer::Tool, &mut tools.names()),
        ];
        let in_flight = recorder.register_gauge(&Key::from_name(IN_FLIGHT), &META);
        let token_validations = TOKEN_OUTCOMES
            .iter()
            .map(|outcome| {
                counter_in(&counters, &Key::from_parts(TOKEN_VALIDATIONS, vec![Label::new("outcome", *outcome)]))
            })
            .collect();
        Self { recorder, handle, counters, help, decisions, token_validations, in_flight }
    }

    /// Records one bearer token checked as an OAuth access token: `outcome` is one of
    /// [`TOKEN_OUTCOMES`] (another is counted as `malformed`).
    pub fn token_validation(&self, outcome: &str) {
        let at = |name: &str| TOKEN_OUTCOMES.iter().position(|o| *o == name);
        if let Some(counter) = at(outcome).or_else(|| at("malformed")).and_then(|i| self.token_validations.get(i)) {
            counter.increment(1);
        }
    }

    /// Records one fetch of the authorization server's keys (or metadata).
    pub fn jwks_fetch(&self, ok: bool) {
        self.count(JWKS_FETCHES, vec![Label::new("outcome", if ok { "ok" } else { "failed" })]);
    }

    /// Records one introspection asked of the authorization server (`active`, `inactive`, `failed`).
    pub fn token_introspection(&self, outcome: &'static str) {
        self.count(TOKEN_INTROSPECTIONS, vec![Label::new("outcome", outcome)]);
    }

    fn counter(&self, key: &Key) -> Counter {
        counter_in(&self.counters, key)
    }

    fn count(&self, name: &'static str, labels: Vec<Label>) {
        self.counter(&Key::from_parts(name, labels)).increment(1);
    }

    /// Records one decision.
    pub fn decision(&self, layer: Layer, tool: &str, allowed: bool) {
        if let Some(counters) = self.decisions[layer.index()].get(tool) {
            counters[usize::from(!allowed)].increment(1);
            return;
        }
        let outcome = if allowed { Outcome::Allowed } else { Outcome::Refused };
        self.counter(&decision_key(layer, tool, outcome)).increment(1);
    }

    /// Records one refusal a shadow limit would have made (`outcome="shadow_refused"`); the
    /// call itself is counted allowed or refused by the enforced limits as usual.
    pub fn shadow_refusal(&self, layer: Layer, tool: &str) {
        self.counter(&decision_key(layer, tool, Outcome::ShadowRefused)).increment(1);
    }

    /// Records one refusal, labelled with the caller's bucket, never the caller.
    pub fn rejection(&self, layer: Layer, tool: &str, code: &'static str, caller: &Caller) {
        self.count(
            REJECTIONS,
            vec![
                Label::new("layer", layer.as_str()),
                Label::new("tool", tool.to_owned()),
                Label::new("code", code),
                Label::new("client_bucket", format!("b{:02}", caller.bucket())),
            ],
        );
    }

    /// Records one upstream request's outcome (`ok`, `rate_limited`, `unavailable`, …).
    pub fn upstream(&self, tool: &str, outcome: &'static str) {
        self.count(UPSTREAM, vec![Label::new("tool", tool.to_owned()), Label::new("outcome", outcome)]);
    }

    /// Records one tool call answered without an upstream request of its own (`coalesced`,
    /// `cached`).
    pub fn upstream_saved(&self, tool: &str, how: &'static str) {
        self.count(UPSTREAM_SAVED, vec![Label::new("tool", tool.to_owned()), Label::new("how", how)]);
    }

    /// Records `units` cost units `refunded` or `charged` by settling a call of `tool`.
    pub fn settled(&self, tool: &str, how: &'static str, units: u64) {
        let labels = vec![Label::new("tool", tool.to_owned()), Label::new("how", how)];
        self.counter(&Key::from_parts(SETTLED_UNITS, labels)).increment(units);
    }

    /// Records one try of a settlement the store did not take.
    pub fn settlement_error(&self, tool: &str) {
        self.count(SETTLEMENT_ERRORS, vec![Label::new("tool", tool.to_owned())]);
    }

    /// Records one settlement given up on: its reservation stands.
    pub fn settlement_given_up(&self, tool: &str) {
        self.count(SETTLEMENTS_GIVEN_UP, vec![Label::new("tool", tool.to_owned())]);
    }

    /// Records one webhook at `/webhooks/upstream`: `outcome` is one of [`WEBHOOK_OUTCOMES`].
    pub fn webhook(&self, outcome: &'static str) {
        self.count(WEBHOOKS, vec![Label::new("outcome", outcome)]);
    }

    /// Records `ms` milliseconds an account slot was held by a job that had already ended.
    pub fn idle_held(&self, ms: u64) {
        self.counter(&Key::from_name(ACCOUNT_IDLE_HELD)).increment(ms);
    }

    /// Records one retry of server-owned upstream work (`submission` or `poll`).
    pub fn upstream_retry(&self, work: &'static str, reason: &'static str) {
        self.count(UPSTREAM_RETRIES, vec![Label::new("work", work), Label::new("reason", reason)]);
    }

    /// Records one decision the store could not make.
    pub fn store_error(&self, layer: Layer) {
        self.count(STORE_ERRORS, vec![Label::new("layer", layer.as_str())]);
    }

    /// Records one claim of the upstream account's slots, or one use of its shared learnt
    /// limit, the store could not answer (`layer="account"`): the queue limited locally.
    pub fn account_store_error(&self) {
        self.count(STORE_ERRORS, vec![Label::new("layer", "account")]);
    }

    /// The connection counters of `listener` (`mcp`, `admin`), registered now.
    pub fn connections(&self, listener: &'static str) -> ConnectionMetrics {
        let key = |name: &'static str, reason: Option<&'static str>| {
            let mut labels = vec![Label::new("listener", listener)];
            labels.extend(reason.map(|reason| Label::new("reason", reason)));
            Key::from_parts(name, labels)
        };
        ConnectionMetrics {
            open: self.recorder.register_gauge(&key(CONNECTIONS_OPEN, None), &META),
            // In our registry, as every counter: the recorder's would render without a `# HELP`.
            refused_full: self.counter(&key(CONNECTIONS_REFUSED, Some("max_connections"))),
            refused_address: self.counter(&key(CONNECTIONS_REFUSED, Some("max_connections_per_address"))),
            timed_out: self.counter(&key(CONNECTIONS_TIMED_OUT, None)),
        }
    }

    /// Records one config reload, `applied` or `refused`.
    pub fn config_reload(&self, outcome: &'static str) {
        self.count(CONFIG_RELOADS, vec![Label::new("outcome", outcome)]);
    }

    /// Records one call refused because the server was behind, by its caller's tier.
    pub fn shed(&self, caller: &Caller) {
        let unverified = if caller.unverified_from().is_some() { "true" } else { "false" };
        self.count(SHED, vec![Label::new("tier", caller.tier().to_owned()), Label::new("unverified", unverified)]);
    }

    /// Records one call refused as a loop.
    pub fn loop_detected(&self, tool: &str) {
        self.count(LOOP_DETECTIONS, vec![Label::new("tool", tool.to_owned())]);
    }

    /// Sets a gauge sampled from live state when `/metrics` is scraped (queue depth, jobs in
    /// flight, breaker state): read where the state is, so it can never drift from it.
    pub fn sample(&self, name: &'static str, labels: Vec<Label>, value: f64) {
        self.recorder.register_gauge(&Key::from_parts(name, labels), &META).set(value);
    }

    /// Sets what the trace exporter's queue holds now (`bytes`) and has dropped since it started
    /// (`dropped`, a count that only grows), read from it when `/metrics` is scraped.
    pub fn trace_queue(&self, bytes: u64, dropped: u64) {
        self.recorder.register_gauge(&Key::from_name(TRACE_QUEUE_BYTES), &META).set(bytes as f64);
        self.counter(&Key::from_name(TRACE_SPANS_DROPPED)).absolute(dropped);
    }

    /// Sets the round trips to the shared store and the commands they carried, counts that only
    /// grow, read from the store when `/metrics` is scraped.
    pub fn store_traffic(&self, (round_trips, commands): (u64, u64)) {
        self.counter(&Key::from_name(STORE_ROUND_TRIPS)).absolute(round_trips);
        self.counter(&Key::from_name(STORE_COMMANDS)).absolute(commands);
    }

    /// Moves the in-flight gauge by `delta`.
    pub fn in_flight(&self, delta: f64) {
        if delta >= 0.0 { self.in_flight.increment(delta) } else { self.in_flight.decrement(-delta) }
    }

    /// Forgets every series of a tool `gone` says is gone (a proxied server no longer lists
    /// it): its decisions, refusals, upstream requests and settlements. A method (`tools/list`)
    /// and the HTTP layer are never a tool, whatever a proxied server names its tools.
    pub fn forget_tools(&self, gone: impl Fn(&str) -> bool) {
        self.counters.retain_counters(|key, _| {
            let label = |name: &str| key.labels().find(|l| l.key() == name).map(|l| l.value());
            let of_a_tool = label("layer").is_none_or(|layer| layer == Layer::Tool.as_str());
            !(of_a_tool && label("tool").is_some_and(&gone))
        });
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut families: BTreeMap<String, Vec<(Key, u64)>> = BTreeMap::new();
        self.counters.visit_counters(|key, value| {
            let value = value.load(std::sync::atomic::Ordering::Relaxed);
            families.entry(key.name().to_owned()).or_default().push((key.clone(), value));
        });
        let mut out = String::new();
        for (name, mut series) in families {
            series.sort_by(|a, b| a.0.cmp(&b.0));
            if let Some(help) = self.help.get(name.as_str()) {
                let _ = writeln!(out, "# HELP {name} {help}");
            }
            let _ = writeln!(out, "# TYPE {name} counter");
            for (key, value) in series {
                out.push_str(&name);
                let labels: Vec<String> =
                    key.labels().map(|l| format!("{}=\"{}\"", l.key(), sanitize_label_value(l.value()))).collect();
                if !labels.is_empty() {
                    let _ = write!(out, "{{{}}}", labels.join(","));
                }
                let _ = writeln!(out, " {value}");
            }
            out.push('\n');
        }
        out.push_str(&self.handle.render());
        out
    }
}

/// The counter `key` names in `counters`, made there at its first use.
fn counter_in(counters: &Registry<Key, AtomicStorage>, key: &Key) -> Counter {
    counters.get_or_create_counter(key, |counter| Counter::from_arc(counter.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pre_registered_and_ad_hoc_decisions_render_alike() {
        let m = Metrics::new(&Catalogue::new().job("generate_image"));
        m.decision(Layer::Tool, "generate_image", true);
        m.decision(Layer::Tool, "generate_image", false);
        m.decision(Layer::Method, "tools/list", false);
        m.decision(Layer::Tool, "not_a_tool", true);
        m.in_flight(1.0);
        let text = m.render();
        for line in [
            "mcp_ratelimit_decisions_total{layer=\"tool\",tool=\"generate_image\",outcome=\"allowed\"} 1",
            "mcp_ratelimit_decisions_total{layer=\"tool\",tool=\"generate_image\",outcome=\"refused\"} 1",
            "mcp_ratelimit_decisions_total{layer=\"method\",tool=\"tools/list\",outcome=\"refused\"} 1",
            "mcp_ratelimit_decisions_total{layer=\"tool\",tool=\"not_a_tool\",outcome=\"allowed\"} 1",
            "mcp_ratelimit_in_flight_calls 1",
        ] {
            assert!(text.contains(line), "missing {line} in\n{text}");
        }
    }

    #[test]
    fn every_family_named_in_this_file_is_described_once() {
        let source = include_str!("metrics.rs");
        let named: std::collections::BTreeSet<&str> = source
            .match_indices("\"mcp_ratelimit_")
            .map(|(at, _)| {
                let rest = &source[at + 1..];
                let end = rest.find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'));
                &rest[..end.unwrap_or(rest.len())]
            })
            .filter(|name| name.len() > "mcp_ratelimit_".len())
            .collect();
        assert!(named.len() >= FAMILIES.len(), "the names were read: {named:?}");
        for name in &named {
            let rows = FAMILIES.iter().filter(|f| f.name == *name).count();
            assert_eq!(rows, 1, "{name} needs exactly one row in FAMILIES, for its # HELP");
        }
        assert!(FAMILIES.iter().all(|f| !f.help.is_empty() && named.contains(f.name)));
    }

    #[test]
    fn a_forgotten_tool_leaves_no_series_and_a_method_is_never_a_tool() {
        let m = Metrics::default();
        for tool in ["gone", "kept"] {
            m.decision(Layer::Tool, tool, true);
            m.loop_detected(tool);
            m.settled(tool, "refunded", 3);
        }
        m.decision(Layer::Method, "tools/list", false);
        m.forget_tools(|tool| tool == "gone" || tool == "tools/list");
        let text = m.render();
        assert!(!text.contains("tool=\"gone\""), "{text}");
        assert_eq!(text.matches("tool=\"kept\"").count(), 3, "{text}");
        assert!(text.contains("layer=\"method\",tool=\"tools/list\",outcome=\"refused\"} 1"), "{text}");
        assert!(text.contains("# HELP mcp_ratelimit_decisions_total "), "{text}");
        m.decision(Layer::Tool, "gone", false);
        assert!(m.render().contains("tool=\"gone\",outcome=\"refused\"} 1"), "it starts afresh if it comes back");
    }
}
