//! Refusals an agent can act on.
//!
//! A refusal is a sentence for the model, saying in whole seconds how long to wait, and the same
//! facts as a JSON object for programs ([`Refusal::to_json`]). How it travels is the transport's
//! business: the MCP layer makes it a tool result with `isError: true` (never a JSON-RPC error,
//! so the text lands in the model's context; see `mcp::results`).

use serde_json::{Map, Value, json};

use crate::clock::{Nanos, ceil_ms, ceil_secs};
use crate::guard::loops::{Looping, Pattern};
use crate::ops::activity::Refused;
use crate::ops::metrics::Layer;

/// Why a call was refused; the `code` field of the structured error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalCode {
    /// A budget is empty.
    RateLimited,
    /// Too many jobs in flight.
    Busy,
    /// The same call repeated too many times in a row.
    LoopDetected,
    /// The upstream answered 429.
    UpstreamRateLimited,
    /// The upstream failed or timed out.
    UpstreamUnavailable,
    /// The shared limiter store is down and this tool fails closed.
    LimiterUnavailable,
    /// The arguments break the schema or a size limit.
    InvalidArguments,
}

impl RefusalCode {
    /// Every code.
    pub const ALL: [RefusalCode; 7] = [
        RefusalCode::RateLimited,
        RefusalCode::Busy,
        RefusalCode::LoopDetected,
        RefusalCode::UpstreamRateLimited,
        RefusalCode::UpstreamUnavailable,
        RefusalCode::LimiterUnavailable,
        RefusalCode::InvalidArguments,
    ];

    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            RefusalCode::RateLimited => "rate_limited",
            RefusalCode::Busy => "busy",
            RefusalCode::LoopDetected => "loop_detected",
            RefusalCode::UpstreamRateLimited => "upstream_rate_limited",
            RefusalCode::UpstreamUnavailable => "upstream_unavailable",
            RefusalCode::LimiterUnavailable => "limiter_unavailable",
            RefusalCode::InvalidArguments => "invalid_arguments",
        }
    }
}

/// A refused tool call, ready to be turned into an `isError` tool result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// What kind of refusal.
    pub code: RefusalCode,
    /// The sentence the model reads.
    pub message: String,
    /// How long to wait before the same call can succeed, when that is known.
    pub retry_after_ms: Option<u64>,
    /// The budget that refused, e.g. `caller:tok:1f2e…` (boxed: keeps every `Result<_, Refusal>`
    /// on the hot path small).
    pub scope: Option<Box<str>>,
    /// That budget's limit.
    pub limit: Option<u64>,
    /// What is left in it.
    pub remaining: Option<u64>,
    /// What only some refusals carry; boxed to keep every `Result<_, Refusal>` on the hot path
    /// small.
    pub details: Option<Box<Details>>,
}

/// The parts of a [`Refusal`] that only some refusals have.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Details {
    /// For `busy`: the caller's jobs in flight (their `predict_id`s).
    pub in_flight: Vec<String>,
    /// The limit that refused, in words (`100 per 86400000 ms window`), when its scope has several.
    pub policy: Option<String>,
}

fn seconds(n: u64) -> String {
    if n == 1 { "1 second".to_owned() } else { format!("{n} seconds") }
}

impl Refusal {
    /// A budget is empty; `retry_after` is exact for this call's cost.
    pub fn rate_limited(tool: &str, scope: String, limit: u64, remaining: u64, retry_after: Nanos) -> Self {
        Self {
            code: RefusalCode::RateLimited,
            message: format!(
                "Rate limit reached for {tool}. Wait {} before calling it again.",
                seconds(ceil_secs(retry_after))
            ),
            retry_after_ms: Some(ceil_ms(retry_after)),
            scope: Some(scope.into()),
            limit: Some(limit),
            remaining: Some(remaining),
            details: None,
        }
    }

    /// This refusal naming the limit that refused (one of its scope's several), in the message
    /// and as `policy`.
    pub fn naming_limit(mut self, policy: String) -> Self {
        if let Some(scope) = &self.scope {
            self.message = self.message.replacen(". Wait", &format!(" ({scope}: {policy}). Wait"), 1);
        }
        self.details.get_or_insert_default().policy = Some(policy);
        self
    }

    /// An operator blocked the caller (or its tenant) for a while, through the admin API.
    pub fn blocked(tool: &str, scope: String, left: Nanos) -> Self {
        let whom = if scope.starts_with("block:tenant:") { "your tenant" } else { "you" };
        Self {
            code: RefusalCode::RateLimited,
            message: format!(
                "An operator has blocked {whom} from calling tools for a while. Wait {} before calling {tool} again.",
                seconds(ceil_secs(left))
            ),
            retry_after_ms: Some(ceil_ms(left).max(1)),
            scope: Some(scope.into()),
            limit: None,
            remaining: Some(0),
            details: None,
        }
    }

    /// The scope already has its maximum of work in flight.
    pub fn busy(tool: &str, scope: String, limit: u64) -> Self {
        Self {
            code: RefusalCode::Busy,
            message: format!(
                "Too much in flight for {tool}: {limit} at once is the limit. Wait for the calls in flight to \
                 return before calling it again."
            ),
            retry_after_ms: None,
            scope: Some(scope.into()),
            limit: Some(limit),
            remaining: Some(0),
            details: None,
        }
    }

    /// A busy refusal for a job tool, naming the caller's jobs in flight, what to do about them
    /// (`advice`, the door's: which tool polls them, which stops one), and when the first of them
    /// is worth polling.
    pub fn with_jobs_in_flight(
        mut self,
        tool: &str,
        jobs: Vec<String>,
        advice: &str,
        soonest_news: Option<Nanos>,
    ) -> Self {
        let limit = self.limit.unwrap_or_default();
        let whose = match self.scope.as_deref() {
            Some(scope) if scope.starts_with("in_flight:tenant:") => "your tenant",
            Some(scope) if scope.starts_with("in_flight:address:") => {
                "the callers without a configured API key from your address, together,"
            }
            _ => "you",
        };
        let yours = if jobs.is_empty() { String::new() } else { format!("Yours: {}. ", jobs.join(", ")) };
        let when = soonest_news
            .map_or_else(String::new, |wait| format!(" The first may have news in {}.", seconds(ceil_secs(wait))));
        self.message =
            format!("Too many jobs in flight for {tool}: {whose} may run {limit} at once. {yours}{advice}{when}");
        self.retry_after_ms = soonest_news.map(|wait| ceil_ms(wait).max(1));
        self.details.get_or_insert_default().in_flight = jobs;
        self
    }

    /// Every session a proxy may open to the server it fronts (`max` of them) is in use by other
    /// callers, so the caller's own cannot be opened; `wait` is until one may go idle.
    pub fn sessions_full(tool: &str, max: u64, wait: Nanos) -> Self {
        Self {
            code: RefusalCode::Busy,
            message: format!(
                "All {max} sessions to the proxied server are in use by other callers, so {tool} cannot open \
                 yours. Wait {} before calling it again.",
                seconds(ceil_secs(wait))
            ),
            retry_after_ms: Some(ceil_ms(wait).max(1)),
            scope: Some("proxy:max_children".into()),
            limit: Some(max),
            remaining: Some(0),
            details: None,
        }
    }

    /// The sessions a proxy may open to the server it fronts for callers without a configured key
    /// (`max` of them, all such callers together) are in use, so this caller's cannot be opened;
    /// `wait` is until one may go idle.
    pub fn unverified_sessions_full(tool: &str, max: u64, wait: Nanos) -> Self {
        let message = if max == 0 {
            format!(
                "This proxy keeps its sessions to the server it fronts for callers with a configured API key: {tool} \
                 needs one. Send your key as `Authorization: Bearer <key>` or `X-API-Key: <key>`."
            )
        } else {
            format!(
                "Callers without a configured API key may hold {max} sessions to the proxied server together, and they \
                 are in use, so {tool} cannot open yours. Wait {} before calling it again, or send a configured API key.",
                seconds(ceil_secs(wait))
            )
        };
        Self {
            code: RefusalCode::Busy,
            message,
            retry_after_ms: Some(ceil_ms(wait).max(1)),
            scope: Some("proxy:max_children:unverified".into()),
            limit: Some(max),
            remaining: Some(0),
            details: None,
        }
    }

    /// The subscriptions a proxy lets one caller hold open at once (`max`; for callers without a
    /// configured key, `address`: those of one address together) are open, so `tool` cannot open
    /// another; `wait` is a guess (one ends only when its holder closes it), the scope names the
    /// bound: `proxy:max_subscriptions_per_caller` or `proxy:max_subscriptions_per_address`.
    pub fn subscriptions_full(tool: &str, address: bool, max: u64, wait: Nanos) -> Self {
        let wait_words = seconds(ceil_secs(wait));
        let (message, scope) = if address {
            let message = format!(
                "Callers without a configured API key from your address may hold {max} subscriptions open together, \
                 and they are open, so {tool} cannot open yours. Close one, send a configured API key, or wait \
                 {wait_words} before opening another."
            );
            (message, "proxy:max_subscriptions_per_address")
        } else {
            let message = format!(
                "You hold {max} subscriptions open, the most one caller may, so {tool} cannot open another. Close \
                 one, or wait {wait_words} before opening another."
            );
            (message, "proxy:max_subscriptions_per_caller")
        };
        Self {
            code: RefusalCode::Busy,
            message,
            retry_after_ms: Some(ceil_ms(wait).max(1)),
            scope: Some(scope.into()),
            limit: Some(max),
            remaining: Some(0),
            details: None,
        }
    }

    /// The queue in front of the upstream account is full; `wait` is until a place frees up.
    pub fn queue_full(tool: &str, wait: Nanos) -> Self {
        Self {
            code: RefusalCode::Busy,
            message: format!(
                "Too many jobs are waiting for the upstream to start {tool}. Wait {} before calling it again.",
                seconds(ceil_secs(wait))
            ),
            retry_after_ms: Some(ceil_ms(wait).max(1)),
            scope: Some("queue:upstream".into()),
            limit: None,
            remaining: Some(0),
            details: None,
        }
    }

    /// The server itself is behind (`[server.shedding]`) and refuses callers of this one's
    /// priority first; `wait` is the least time before it serves them again.
    pub fn overloaded(tool: &str, wait: Nanos) -> Self {
        Self {
            code: RefusalCode::Busy,
            message: format!(
                "The server is overloaded and is turning away callers of your priority before it charges them. \
                 Nothing was charged for {tool}. Wait {} before calling it again.",
                seconds(ceil_secs(wait))
            ),
            retry_after_ms: Some(ceil_ms(wait).max(1)),
            scope: Some("server:overloaded".into()),
            limit: None,
            remaining: Some(0),
            details: None,
        }
    }

    /// The places left in the queue in front of the upstream account are reserved for callers of
    /// tiers that do not hold their share yet (`[upstream.reserved]`); `wait` is until a place
    /// may free up.
    pub fn queue_reserved(tool: &str, wait: Nanos) -> Self {
        Self {
            code: RefusalCode::Busy,
            message: format!(
                "The places left for jobs waiting for the upstream to start {tool} are reserved for callers of \
                 another tier. Wait {} before calling it again.",
                seconds(ceil_secs(wait))
            ),
            retry_after_ms: Some(ceil_ms(wait).max(1)),
            scope: Some("queue:upstream:reserved".into()),
            limit: None,
            remaining: Some(0),
            details: None,
        }
    }

    /// A call that waited `waited` for one of the upstream's `slots` calls in flight to finish,
    /// in vain, and was never sent: the upstream is busy, not down, and the call cost nothing.
    pub fn never_sent(tool: &str, waited: Nanos, slots: usize, wait: Nanos) -> Self {
        let calls = if slots == 1 { "its 1 call".to_owned() } else { format!("one of its {slots} calls") };
        Self {
            code: RefusalCode::Busy,
            message: format!(
                "The upstream behind {tool} was busy: the call waited {} for {calls} in flight to finish and was \
                 never sent: its price was given back. Wait {} before calling it again.",
                seconds(ceil_secs(waited)),
                seconds(ceil_secs(wait))
            ),
            retry_after_ms: Some(ceil_ms(wait).max(1)),
            scope: Some("queue:upstream".into()),
            limit: Some(slots as u64),
            remaining: Some(0),
            details: None,
        }
    }

    /// The share of the upstream account that callers without a configured key may hold
    /// together (`slots` running, `places` waiting) is taken, or is none; `wait` is until a place
    /// may free up.
    pub fn unverified_share_full(tool: &str, wait: Nanos, slots: usize, places: usize) -> Self {
        let message = if slots == 0 || places == 0 {
            format!(
                "This server keeps its upstream account for callers with a configured API key: {tool} needs one. \
                 Send your key as `Authorization: Bearer <key>` or `X-API-Key: <key>`."
            )
        } else {
            format!(
                "Callers without a configured API key may hold {slots} running and {places} waiting jobs of the \
                 upstream account together, and they are taken. Wait {} before calling {tool} again, or send a \
                 configured API key.",
                seconds(ceil_secs(wait))
            )
        };
        Self {
            code: RefusalCode::Busy,
            message,
            retry_after_ms: Some(ceil_ms(wait).max(1)),
            scope: Some("queue:upstream:unverified".into()),
            limit: Some(places as u64),
            remaining: Some(0),
            details: None,
        }
    }

    /// The caller repeated the same call in a loop, or kept getting the same answer from one tool;
    /// the same arguments (for no progress, the tool) are refused until the window has passed.
    pub fn loop_detected(tool: &str, looping: &Looping) -> Self {
        let wait = seconds(ceil_secs(looping.retry_after));
        let message = match looping.pattern {
            Pattern::NoProgress => format!(
                "Loop detected: {tool} gave you the same answer {} times in a row, whatever the arguments. \
                 Asking again will not change it. Use what you have, try another tool or ask the user; \
                 calls of {tool} are refused for the next {wait}.",
                looping.repeats
            ),
            pattern => {
                let what = if pattern == Pattern::Oscillating {
                    format!(
                        "you keep alternating between the same two calls, {tool} among them, with identical arguments"
                    )
                } else {
                    format!("you called {tool} with identical arguments {} times in a row", looping.repeats)
                };
                format!(
                    "Loop detected: {what}. The result will not change. Change the arguments or try something else; \
                     these identical calls are refused for the next {wait}."
                )
            }
        };
        Self {
            code: RefusalCode::LoopDetected,
            message,
            retry_after_ms: Some(ceil_ms(looping.retry_after).max(1)),
            scope: Some(format!("loop:{tool}").into()),
            limit: Some(u64::from(looping.repeats)),
            remaining: Some(0),
            details: None,
        }
    }

    /// The arguments are unusable; nothing was charged.
    pub fn invalid_arguments(tool: &str, problem: &str) -> Self {
        Self {
            code: RefusalCode::InvalidArguments,
            message: format!("Invalid arguments for {tool}: {problem}. Fix the arguments and call it again."),
            retry_after_ms: None,
            scope: None,
            limit: None,
            remaining: None,
            details: None,
        }
    }

    /// The upstream said 429; the wait is at least the upstream's Retry-After.
    pub fn upstream_rate_limited(tool: &str, retry_after_ms: u64) -> Self {
        Self {
            code: RefusalCode::UpstreamRateLimited,
            message: format!(
                "The upstream API behind {tool} is rate limiting us. Wait {} before calling it again.",
                seconds(retry_after_ms.div_ceil(1000))
            ),
            retry_after_ms: Some(retry_after_ms),
            scope: Some(format!("upstream:{tool}").into()),
            limit: None,
            remaining: None,
            details: None,
        }
    }

    /// The upstream failed; the agent may try again later.
    pub fn upstream_unavailable(tool: &str, detail: &str, retry_after_ms: u64) -> Self {
        Self {
            code: RefusalCode::UpstreamUnavailable,
            message: format!(
                "The upstream API behind {tool} is unavailable ({detail}). Wait {} before trying again.",
                seconds(retry_after_ms.div_ceil(1000))
            ),
            retry_after_ms: Some(retry_after_ms),
            scope: Some(format!("upstream:{tool}").into()),
            limit: None,
            remaining: None,
            details: None,
        }
    }

    /// The shared limiter store could not decide and this call fails closed.
    pub fn limiter_unavailable(tool: &str, retry_after_ms: u64) -> Self {
        Self {
            code: RefusalCode::LimiterUnavailable,
            message: format!(
                "The rate limiter is unavailable, so {tool} cannot be admitted safely right now. Wait {} before \
                 trying again.",
                seconds(retry_after_ms.div_ceil(1000))
            ),
            retry_after_ms: Some(retry_after_ms.max(1)),
            scope: None,
            limit: None,
            remaining: None,
            details: None,
        }
    }

    /// The structured error object.
    pub fn to_json(&self) -> Value {
        let mut error = Map::new();
        error.insert("code".into(), json!(self.code.as_str()));
        error.insert("message".into(), json!(self.message));
        for (key, value) in
            [("retry_after_ms", self.retry_after_ms), ("limit", self.limit), ("remaining", self.remaining)]
        {
            if let Some(v) = value {
                error.insert(key.into(), json!(v));
            }
        }
        if let Some(scope) = &self.scope {
            error.insert("scope".into(), json!(scope));
        }
        if let Some(details) = &self.details {
            if !details.in_flight.is_empty() {
                error.insert("in_flight".into(), json!(details.in_flight));
            }
            if let Some(policy) = &details.policy {
                error.insert("policy".into(), json!(policy));
            }
        }
        json!({ "error": error })
    }

    /// The refusal [`Refusal::to_json`] wrote, read back (for whoever sees only a tool's result);
    /// `None` for any other JSON.
    pub fn from_json(json: &Value) -> Option<Self> {
        let error = json.get("error")?;
        let code = error.get("code")?.as_str()?;
        let number = |key: &str| error.get(key).and_then(Value::as_u64);
        Some(Self {
            code: RefusalCode::ALL.into_iter().find(|c| c.as_str() == code)?,
            message: error.get("message")?.as_str()?.to_owned(),
            retry_after_ms: number("retry_after_ms"),
            scope: error.get("scope").and_then(Value::as_str).map(Box::from),
            limit: number("limit"),
            remaining: number("remaining"),
            details: {
                let in_flight: Vec<String> = error
                    .get("in_flight")
                    .and_then(Value::as_array)
                    .map(|jobs| jobs.iter().filter_map(|j| j.as_str().map(str::to_owned)).collect())
                    .unwrap_or_default();
                let policy = error.get("policy").and_then(Value::as_str).map(str::to_owned);
                (!in_flight.is_empty() || policy.is_some()).then(|| Box::new(Details { in_flight, policy }))
            },
        })
    }

    /// This refusal of `tool` at `layer`, as the dashboard records it.
    pub fn seen<'a>(&'a self, layer: Layer, tool: &'a str) -> Refused<'a> {
        Refused {
            layer,
            tool,
            code: self.code.as_str(),
            scope: self.scope.as_deref(),
            limit: self.limit,
            remaining: self.remaining,
            retry_after_ms: self.retry_after_ms,
            message: &self.message,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_is_rounded_up_to_whole_seconds() {
        let r = Refusal::rate_limited("generate_image", "caller:x".into(), 60, 0, Nanos::new(11_800_000_000));
        assert_eq!(r.message, "Rate limit reached for generate_image. Wait 12 seconds before calling it again.");
        assert_eq!(r.retry_after_ms, Some(11_800));
        let v = r.to_json();
        assert_eq!(v["error"]["code"], "rate_limited");
        assert_eq!(v["error"]["limit"], 60);
        assert_eq!(v["error"]["remaining"], 0);
    }

    #[test]
    fn the_json_gives_back_the_refusal_it_carries() {
        let busy = Refusal::busy("generate_image", "in_flight:caller:x".into(), 5);
        let rate = Refusal::rate_limited("list_articles", "caller:x".into(), 60, 0, Nanos::new(1_000_000_000));
        let named = rate.clone().naming_limit("token_bucket burst 60".into());
        let bad = Refusal::invalid_arguments("generate_image", "prompt too long");
        for refusal in [busy, rate, named, bad] {
            assert_eq!(Refusal::from_json(&refusal.to_json()), Some(refusal));
        }
        assert_eq!(Refusal::from_json(&json!({"articles": []})), None);
        assert_eq!(Refusal::from_json(&json!({"error": {"code": "teapot", "message": "no"}})), None);
    }
}
