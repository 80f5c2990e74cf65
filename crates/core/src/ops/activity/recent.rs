//! The bounded record behind the dashboard: refusal counts per tool and code in a ring of
//! buckets, the latest refusals, and the last level of each budget seen.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use super::snapshot::{CodeCount, ToolRefusals};
use super::{BUCKETS, MAX_SCOPES, Source};
use crate::clock::Nanos;
use crate::identity::Caller;
use crate::ops::metrics::Layer;

/// Refusal counts of one tool, one code, per bucket.
#[derive(Debug, Clone)]
struct Series {
    counts: [u32; BUCKETS],
    /// The newest bucket counted; slots after it (modulo the ring) are stale.
    last: u64,
}

impl Series {
    fn new(bucket: u64) -> Self {
        Self { counts: [0; BUCKETS], last: bucket }
    }

    fn add(&mut self, bucket: u64) {
        if bucket > self.last {
            // The slots of the buckets skipped since the last count hold counts from a lap ago.
            for skipped in 1..=(bucket - self.last).min(BUCKETS as u64) {
                self.counts[slot(self.last + skipped)] = 0;
            }
            self.last = bucket;
        }
        // A count from a clock read just before another thread's still lands in its own bucket.
        if self.last - bucket < BUCKETS as u64 {
            let count = &mut self.counts[slot(bucket)];
            *count = count.saturating_add(1);
        }
    }

    /// The counts of the window ending with `bucket`, oldest first.
    fn window(&self, bucket: u64) -> [u32; BUCKETS] {
        let mut out = [0; BUCKETS];
        for (i, count) in out.iter_mut().enumerate() {
            let Some(b) = (bucket + i as u64 + 1).checked_sub(BUCKETS as u64) else { continue };
            if b <= self.last && self.last - b < BUCKETS as u64 {
                *count = self.counts[slot(b)];
            }
        }
        out
    }
}

fn slot(bucket: u64) -> usize {
    (bucket % BUCKETS as u64) as usize
}

/// One tool's (or method's) refusals per code.
#[derive(Debug)]
pub(super) struct ToolSeries {
    /// The tool's name, shared with its refusals in the latest list.
    name: Arc<str>,
    pub(super) layer: Layer,
    codes: Vec<(&'static str, Series)>,
}

impl ToolSeries {
    fn count(&mut self, code: &'static str, bucket: u64) {
        match self.codes.iter_mut().find(|(c, _)| *c == code) {
            Some((_, counts)) => counts.add(bucket),
            None => {
                let mut counts = Series::new(bucket);
                counts.add(bucket);
                self.codes.push((code, counts));
            }
        }
    }
}

/// One refusal, redacted.
#[derive(Debug)]
pub(super) struct Entry {
    pub(super) at: Nanos,
    pub(super) layer: Layer,
    pub(super) tool: Arc<str>,
    pub(super) code: &'static str,
    /// The caller's id (never shown: it decides whose the row is), and its hash (shown).
    pub(super) owner: Arc<str>,
    pub(super) caller: u32,
    pub(super) bucket: u8,
    pub(super) tenant: Option<String>,
    pub(super) scope: Option<Arc<str>>,
    pub(super) limit: Option<u64>,
    pub(super) remaining: Option<u64>,
    pub(super) retry_after_ms: Option<u64>,
    pub(super) message: String,
}

impl Entry {
    /// Whether `other` is the same refusal again: the same caller, refused at the same layer,
    /// for the same tool, code and scope (its message may differ only in the wait).
    pub(super) fn same_refusal_as(&self, other: &Entry) -> bool {
        (&self.owner, self.layer, &self.tool, self.code, &self.scope)
            == (&other.owner, other.layer, &other.tool, other.code, &other.scope)
    }
}

/// A scope's last known level.
#[derive(Debug)]
pub(super) struct Level {
    /// The redacted scope name, shared with the refusals it gave.
    pub(super) name: Arc<str>,
    pub(super) at: Nanos,
    pub(super) limit: u64,
    pub(super) remaining: u64,
    pub(super) bucket: u8,
    /// The tenant, and the caller (its id, and its hash as shown), last seen on it: whose budget
    /// it is.
    pub(super) tenant: Option<Arc<str>>,
    pub(super) owner: Arc<str>,
    pub(super) caller: u32,
    pub(super) refused: u64,
    pub(super) samples: u64,
    /// Where its current level can be read, if an admitted call named it since the limits were
    /// last put in force.
    pub(super) source: Option<Source>,
}

impl Level {
    /// Notes that `caller` (hashed as `hash`, in metrics bucket `bucket`) was just seen on this
    /// scope.
    pub(super) fn seen(&mut self, caller: &Caller, hash: u32, bucket: u8) {
        self.bucket = bucket;
        self.caller = hash;
        if *self.owner != *caller.id() {
            self.owner = Arc::from(caller.id());
        }
        if self.tenant.as_deref() != caller.tenant() {
            self.tenant = caller.tenant_shared().cloned();
        }
    }
}

#[derive(Debug, Default)]
pub(super) struct Recent {
    pub(super) per_tool: HashMap<Arc<str>, ToolSeries>,
    pub(super) latest: VecDeque<Entry>,
    /// By redacted scope name.
    pub(super) scopes: HashMap<Arc<str>, Level>,
}

impl Recent {
    /// Each tool's refusals in the window that ends with `bucket`, by code and per bucket, the
    /// most refused first; tools without any are left out.
    pub(super) fn tools_refused(&self, bucket: u64) -> Vec<ToolRefusals> {
        let mut tools: Vec<ToolRefusals> = self
            .per_tool
            .iter()
            .map(|(tool, series)| {
                let mut per_bucket = [0u32; BUCKETS];
                let mut codes: Vec<CodeCount> = series
                    .codes
                    .iter()
                    .map(|(code, counts)| {
                        let counts = counts.window(bucket);
                        for (sum, n) in per_bucket.iter_mut().zip(counts) {
                            *sum = sum.saturating_add(n);
                        }
                        CodeCount { code, refused: counts.iter().map(|&n| u64::from(n)).sum() }
                    })
                    .filter(|c| c.refused > 0)
                    .collect();
                codes.sort_by(|a, b| b.refused.cmp(&a.refused).then(a.code.cmp(b.code)));
                ToolRefusals {
                    tool: tool.to_string(),
                    layer: series.layer.as_str(),
                    refused: codes.iter().map(|c| c.refused).sum(),
                    codes,
                    per_bucket: per_bucket.to_vec(),
                }
            })
            .filter(|t| t.refused > 0)
            .collect();
        tools.sort_by(|a, b| b.refused.cmp(&a.refused).then_with(|| a.tool.cmp(&b.tool)));
        tools
    }

    /// Updates the level of the (redacted) `scope` seen at `at`, making room for it if it is new;
    /// returns its shared name. (One hash lookup when it is known: this runs for every refusal.)
    pub(super) fn touch(&mut self, scope: &str, at: Nanos, update: impl FnOnce(&mut Level)) -> Arc<str> {
        if let Some(level) = self.scopes.get_mut(scope) {
            level.at = at;
            update(level);
            return level.name.clone();
        }
        if self.scopes.len() >= MAX_SCOPES
            && let Some(oldest) = self.scopes.values().min_by_key(|l| l.at).map(|l| l.name.clone())
        {
            self.scopes.remove(&oldest);
        }
        let name: Arc<str> = Arc::from(scope);
        let mut level = Level {
            name: name.clone(),
            at,
            limit: 0,
            remaining: 0,
            bucket: 0,
            tenant: None,
            owner: Arc::from(""),
            caller: 0,
            refused: 0,
            samples: 0,
            source: None,
        };
        update(&mut level);
        self.scopes.insert(name.clone(), level);
        name
    }

    /// Counts a refusal of `tool` with `code` in `bucket`; returns the tool's shared name.
    pub(super) fn count(&mut self, tool: &str, layer: Layer, code: &'static str, bucket: u64) -> Arc<str> {
        if let Some(series) = self.per_tool.get_mut(tool) {
            series.count(code, bucket);
            return series.name.clone();
        }
        let name: Arc<str> = Arc::from(tool);
        let mut series = ToolSeries { name: name.clone(), layer, codes: Vec::new() };
        series.count(code, bucket);
        self.per_tool.insert(name.clone(), series);
        name
    }
}
