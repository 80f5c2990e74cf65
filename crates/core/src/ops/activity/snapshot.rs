//! The views: what the dashboard shows of the last ten minutes, whole or as one audience may
//! see it.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use serde::Serialize;

use super::recent::{Entry, Level};
use super::record::{kind_of, shown};
use super::{Activity, Audience, BUCKET, BUCKETS, Source, TOP_SCOPES};
use crate::clock::{NANOS_PER_MS, NANOS_PER_SEC, Nanos};

impl Activity {
    /// What the dashboard shows at `now`: the last ten minutes.
    pub fn snapshot(&self, now: Nanos) -> Snapshot {
        self.snapshot_for(now, Audience::Everyone)
    }

    /// What the dashboard shows `audience` at `now`: the counts per tool and the totals, and of
    /// the latest refusals and the busiest budgets those `audience` may see.
    pub fn snapshot_for(&self, now: Nanos, audience: Audience<'_>) -> Snapshot {
        let bucket = now / BUCKET;
        let window = BUCKET * BUCKETS as u64;
        let recent_enough = |at: Nanos| now - at < window;
        let ago_ms = |at: Nanos| (now - at).as_u64() / NANOS_PER_MS;
        let mut recent = self.recent();
        let tools = recent.tools_refused(bucket);
        // Consecutive refusals of the same caller by the same scope for the same reason are one
        // row with a count (twelve identical 429s fill no screen); the row shows the newest.
        let mut latest: Vec<LatestRefusal> = Vec::new();
        let mut previous: Option<&Entry> = None;
        for e in recent.latest.iter().filter(|e| recent_enough(e.at) && audience.sees(e.tenant.as_deref(), &e.owner)) {
            if let (Some(p), Some(row)) = (previous, latest.last_mut())
                && p.same_refusal_as(e)
            {
                row.count = row.count.saturating_add(1);
                continue;
            }
            previous = Some(e);
            latest.push(LatestRefusal {
                ago_ms: ago_ms(e.at),
                count: 1,
                layer: e.layer.as_str(),
                tool: e.tool.to_string(),
                code: e.code,
                caller: shown(e.caller),
                bucket: format!("b{:02}", e.bucket),
                tenant: e.tenant.clone(),
                scope: e.scope.as_deref().map(str::to_owned),
                limit: e.limit,
                remaining: e.remaining,
                retry_after_ms: e.retry_after_ms,
                message: e.message.clone(),
            });
        }
        recent.scopes.retain(|_, level| recent_enough(level.at));
        let mut scopes: Vec<(&Arc<str>, &Level)> =
            recent.scopes.iter().filter(|(_, l)| audience.sees(l.tenant.as_deref(), &l.owner)).collect();
        // Busiest: most refused, then fullest (least left of its limit), then most seen.
        let used = |l: &Level| if l.limit == 0 { 0.0 } else { 1.0 - l.remaining as f64 / l.limit as f64 };
        scopes.sort_by(|(an, a), (bn, b)| {
            b.refused.cmp(&a.refused).then(used(b).total_cmp(&used(a))).then(b.samples.cmp(&a.samples)).then(an.cmp(bn))
        });
        let scopes = scopes
            .into_iter()
            .take(TOP_SCOPES)
            .map(|(scope, l)| ScopeLevel {
                scope: scope.to_string(),
                kind: kind_of(scope),
                bucket: format!("b{:02}", l.bucket),
                limit: l.limit,
                remaining: l.remaining,
                refused: l.refused,
                ago_ms: ago_ms(l.at),
                current: false,
                source: l.source.clone(),
            })
            .collect();
        Snapshot {
            window_s: window.as_u64() / NANOS_PER_SEC,
            bucket_s: BUCKET.as_u64() / NANOS_PER_SEC,
            admitted_total: self.admitted.load(Ordering::Relaxed),
            refused_total: self.refused.load(Ordering::Relaxed),
            refused_in_window: tools.iter().map(|t| t.refused).sum(),
            tools,
            latest,
            scopes,
        }
    }
}

/// The last ten minutes, as `GET /dashboard/data` serves them.
#[derive(Debug, Clone, Serialize)]
pub struct Snapshot {
    /// The window everything below covers, in seconds.
    pub window_s: u64,
    /// The width of one bucket of `per_bucket`, in seconds.
    pub bucket_s: u64,
    /// Tool calls admitted since start.
    pub admitted_total: u64,
    /// Refusals since start, every layer.
    pub refused_total: u64,
    /// Refusals within the window.
    pub refused_in_window: u64,
    /// Refusals per tool (or method, or `POST /mcp`) within the window, most refused first.
    pub tools: Vec<ToolRefusals>,
    /// The latest refusals, newest first.
    pub latest: Vec<LatestRefusal>,
    /// The busiest scopes: most refused, then fullest.
    pub scopes: Vec<ScopeLevel>,
}

/// One tool's refusals within the window.
#[derive(Debug, Clone, Serialize)]
pub struct ToolRefusals {
    /// The tool, method or `POST /mcp`.
    pub tool: String,
    /// `http`, `method` or `tool`.
    pub layer: &'static str,
    /// Refusals within the window.
    pub refused: u64,
    /// The same, per code, most first.
    pub codes: Vec<CodeCount>,
    /// Refusals per bucket, oldest first; the last one is the current bucket.
    pub per_bucket: Vec<u32>,
}

/// Refusals of one code.
#[derive(Debug, Clone, Serialize)]
pub struct CodeCount {
    /// `rate_limited`, `busy`, …
    pub code: &'static str,
    /// How many within the window.
    pub refused: u64,
}

/// One recent refusal, redacted, or a run of identical ones.
#[derive(Debug, Clone, Serialize)]
pub struct LatestRefusal {
    /// How long ago, on the server's clock (the newest of a run).
    pub ago_ms: u64,
    /// How many identical refusals in a row this row stands for: same caller, layer, tool, code
    /// and scope.
    pub count: u32,
    /// `http`, `method` or `tool`.
    pub layer: &'static str,
    /// The tool, method or `POST /mcp`.
    pub tool: String,
    /// The refusal code.
    pub code: &'static str,
    /// The caller, hashed (`#3fa2c1`).
    pub caller: String,
    /// The caller's metrics bucket (`b07`).
    pub bucket: String,
    /// The caller's tenant, if its key has one.
    pub tenant: Option<String>,
    /// The scope that refused, redacted.
    pub scope: Option<String>,
    /// Its limit.
    pub limit: Option<u64>,
    /// What was left in it.
    pub remaining: Option<u64>,
    /// The wait the caller was given.
    pub retry_after_ms: Option<u64>,
    /// The sentence the caller read, redacted.
    pub message: String,
}

/// A scope's last known level.
#[derive(Debug, Clone, Serialize)]
pub struct ScopeLevel {
    /// The scope, redacted (`caller:#3fa2c1`, `tenant:acme:tool:generate_image`).
    pub scope: String,
    /// `caller`, `tenant`, `tool budget`, `address`, `in flight`, …
    pub kind: &'static str,
    /// The metrics bucket of the caller last seen on it.
    pub bucket: String,
    /// Its limit.
    pub limit: u64,
    /// Units left: now when `current`, else when last seen.
    pub remaining: u64,
    /// Refusals it gave since it was first seen (a budget unseen for a whole window is
    /// forgotten).
    pub refused: u64,
    /// How long ago it was last seen.
    pub ago_ms: u64,
    /// Whether `limit` and `remaining` were read from the store just now ([`crate::guard::Guard::current_levels`]):
    /// a slot given back or a budget refilled since the last call shows. Otherwise they are what
    /// the last sampled call left (the store could not be read, or no call named the scope since
    /// the limits were last put in force).
    pub current: bool,
    /// Where to read them now.
    #[serde(skip)]
    pub source: Option<Source>,
}
