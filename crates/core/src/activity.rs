//! What the limits did lately, kept for the live dashboard (`GET /dashboard`).
//!
//! `/metrics` counts for ever and names nobody. A person watching the server wants the last few
//! minutes: which tool is refused, with which code, for whom and why, and which budgets run low.
//! This keeps exactly that, in bounded memory:
//!
//! - refusals per tool and code, in a ring of [`BUCKETS`] buckets of [`BUCKET`] (ten minutes);
//! - the latest [`LATEST`] refusals, each with its scope, limit, level and message;
//! - up to [`MAX_SCOPES`] budgets with their last level (remaining of limit) and refusal count.
//!
//! Only refusals are recorded in full. An admitted call costs one atomic increment; the levels of
//! its scopes are sampled, under the lock, for one admitted call in [`SAMPLE_EVERY`] and for any
//! call that leaves a scope at a quarter or less. A budget running low therefore shows up at once
//! (and such calls are bounded by the budget's own refill rate), while the hot path of a server
//! with room to spare takes no lock.
//!
//! Nobody is named: a caller appears as a keyed hash of its id (`#3fa2c1`, keyed per process, so
//! the page cannot be used to test a guessed key or address) and its 16-way metrics bucket
//! (`b07`, the `client_bucket` of `/metrics` and the logs); an unverified caller's address the
//! same way. Scope names and messages are redacted like that *before* they are stored. Tenants
//! are names from the config and appear as they are. Time is whatever the caller passes in:
//! readings of the server's one clock.
//!
//! Whose a row is ([`Audience`]) is decided by the tenant and the caller id themselves, kept
//! beside each row and never shown: the six hex digits a row shows are 24 bits, and among a few
//! thousand callers two share them.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::Serialize;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::clock::{NANOS_PER_MS, NANOS_PER_SEC, Nanos};
use crate::identity::Caller;
use crate::limit::{Decision, Limiter};
use crate::metrics::Layer;

/// The width of one bucket of the refusal counts.
pub const BUCKET: Nanos = 10 * NANOS_PER_SEC;
/// Buckets kept: the window the dashboard shows is `BUCKETS × BUCKET` (ten minutes).
pub const BUCKETS: usize = 60;
/// Latest refusals kept in full.
pub const LATEST: usize = 50;
/// Scopes whose level is kept; past it, the one seen longest ago makes room.
pub const MAX_SCOPES: usize = 256;
/// One admitted call in this many has its scopes' levels sampled (besides every low one).
pub const SAMPLE_EVERY: u64 = 16;
/// Busiest scopes a snapshot lists.
const TOP_SCOPES: usize = 12;

/// The level one admitted call left a scope at.
#[derive(Debug, Clone, Copy)]
pub struct Sample<'a> {
    /// The scope's name (`caller:tok:…`): redacted before it is stored.
    pub name: &'a str,
    /// What the call's decision left.
    pub decision: &'a Decision,
    /// Where the scope's current level can be read again: its store key and limiter, when the
    /// guard's own store decided (not the insurance limiter, whose limits are a share).
    pub source: Option<(&'a str, &'a Limiter)>,
}

/// Where a shown budget's current level is read: its state key in the guard's store (never a
/// raw credential) and its limiter, as the last sampled call found them.
#[derive(Debug, Clone)]
pub struct Source {
    /// The state key.
    pub key: Arc<str>,
    /// The algorithm and parameters.
    pub limiter: Limiter,
}

/// A refusal as the dashboard records it. Strings may hold a caller's id: they are redacted
/// before anything is stored.
#[derive(Debug, Clone, Copy)]
pub struct Refused<'a> {
    /// Where it was refused.
    pub layer: Layer,
    /// The tool, the method (`tools/list`, `ping`, …) or `POST /mcp`.
    pub tool: &'a str,
    /// The refusal code (`rate_limited`, `busy`, `loop_detected`, …).
    pub code: &'static str,
    /// The scope that refused, by name (`caller:tok:…`, `tenant:acme`), when there is one.
    pub scope: Option<&'a str>,
    /// That scope's limit.
    pub limit: Option<u64>,
    /// What was left in it.
    pub remaining: Option<u64>,
    /// The wait the caller was given.
    pub retry_after_ms: Option<u64>,
    /// The sentence the caller read.
    pub message: &'a str,
}

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
struct ToolSeries {
    /// The tool's name, shared with its refusals in the latest list.
    name: Arc<str>,
    layer: Layer,
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
struct Entry {
    at: Nanos,
    layer: Layer,
    tool: Arc<str>,
    code: &'static str,
    /// The caller's id (never shown: it decides whose the row is), and its hash (shown).
    owner: Arc<str>,
    caller: u32,
    bucket: u8,
    tenant: Option<String>,
    scope: Option<Arc<str>>,
    limit: Option<u64>,
    remaining: Option<u64>,
    retry_after_ms: Option<u64>,
    message: String,
}

impl Entry {
    /// Whether `other` is the same refusal again: the same caller, refused at the same layer,
    /// for the same tool, code and scope (its message may differ only in the wait).
    fn same_refusal_as(&self, other: &Entry) -> bool {
        (&self.owner, self.layer, &self.tool, self.code, &self.scope)
            == (&other.owner, other.layer, &other.tool, other.code, &other.scope)
    }
}

/// A scope's last known level.
#[derive(Debug)]
struct Level {
    /// The redacted scope name, shared with the refusals it gave.
    name: Arc<str>,
    at: Nanos,
    limit: u64,
    remaining: u64,
    bucket: u8,
    /// The tenant, and the caller (its id, and its hash as shown), last seen on it: whose budget
    /// it is.
    tenant: Option<Arc<str>>,
    owner: Arc<str>,
    caller: u32,
    refused: u64,
    samples: u64,
    /// Where its current level can be read, if an admitted call named it since the limits were
    /// last put in force.
    source: Option<Source>,
}

impl Level {
    /// Notes that `caller` (hashed as `hash`, in metrics bucket `bucket`) was just seen on this
    /// scope.
    fn seen(&mut self, caller: &Caller, hash: u32, bucket: u8) {
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

/// Whose refusals, budgets and jobs a dashboard shows. The counts per tool and the totals name
/// nobody and are everyone's whoever looks.
#[derive(Debug, Clone, Copy)]
pub enum Audience<'a> {
    /// Everything (no key required, or the admin key).
    Everyone,
    /// What a configured key's caller may see: its tenant's rows, or, for a key without a
    /// tenant, its own.
    Of(&'a Caller),
}

impl Audience<'_> {
    /// Whether a row of `tenant`'s, by the caller whose id is `owner`, is shown.
    fn sees(&self, tenant: Option<&str>, owner: &str) -> bool {
        self.sees_job(owner, tenant)
    }

    /// Whether a job of `owner` (a caller id) and `tenant` is shown.
    pub fn sees_job(&self, owner: &str, tenant: Option<&str>) -> bool {
        match self {
            Audience::Everyone => true,
            Audience::Of(viewer) => match viewer.tenant() {
                Some(own) => tenant == Some(own),
                None => tenant.is_none() && owner == viewer.id(),
            },
        }
    }
}

#[derive(Debug, Default)]
struct Recent {
    per_tool: HashMap<Arc<str>, ToolSeries>,
    latest: VecDeque<Entry>,
    /// By redacted scope name.
    scopes: HashMap<Arc<str>, Level>,
}

impl Recent {
    /// Each tool's refusals in the window that ends with `bucket`, by code and per bucket, the
    /// most refused first; tools without any are left out.
    fn tools_refused(&self, bucket: u64) -> Vec<ToolRefusals> {
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
    fn touch(&mut self, scope: &str, at: Nanos, update: impl FnOnce(&mut Level)) -> Arc<str> {
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
    fn count(&mut self, tool: &str, layer: Layer, code: &'static str, bucket: u64) -> Arc<str> {
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

/// What the limits did lately: fed by the guard and the tool door, read by the dashboard.
pub struct Activity {
    /// Keys the hash callers and addresses are shown by.
    key: u64,
    admitted: AtomicU64,
    refused: AtomicU64,
    recent: Mutex<Recent>,
}

impl std::fmt::Debug for Activity {
    /// The counts, never the hash key (with it, a hashed caller could be tested against guesses).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Activity")
            .field("admitted", &self.admitted.load(Ordering::Relaxed))
            .field("refused", &self.refused.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Default for Activity {
    fn default() -> Self {
        Self::new()
    }
}

impl Activity {
    /// Nothing seen yet; callers are hashed with a fresh random key.
    pub fn new() -> Self {
        Self { key: rand::random(), admitted: AtomicU64::new(0), refused: AtomicU64::new(0), recent: Mutex::default() }
    }

    fn recent(&self) -> std::sync::MutexGuard<'_, Recent> {
        self.recent.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forgets the refusal counts of every tool `gone` says is gone (a proxied server no longer
    /// lists it): its dashboard row. Methods and the HTTP layer are never a tool.
    pub fn forget_tools(&self, gone: impl Fn(&str) -> bool) {
        self.recent().per_tool.retain(|tool, series| series.layer != Layer::Tool || !gone(tool));
    }

    /// How an identifier (a caller id, an address) is shown: `#` and six hex digits of a keyed
    /// hash, the same for the same identifier while this process runs.
    pub fn hashed(&self, id: &str) -> String {
        shown(self.hash(id))
    }

    fn hash(&self, id: &str) -> u32 {
        (xxh3_64_with_seed(id.as_bytes(), self.key) & 0x00ff_ffff) as u32
    }

    /// Writes `text` into `out` (cleared first) with the caller's id and address replaced by
    /// their hashed forms. One pass, no allocation beyond `out`'s growth: it runs for every
    /// refusal.
    fn redact_into(&self, text: &str, caller: &Caller, out: &mut String) {
        out.clear();
        let ids = [Some(caller.id()), caller.unverified_from()];
        let mut rest = text;
        loop {
            let next = ids.iter().flatten().filter_map(|id| Some((find(rest, id)?, *id))).min();
            let Some((at, id)) = next else { break };
            out.push_str(&rest[..at]);
            push_hashed(out, self.hash(id));
            rest = &rest[at + id.len()..];
        }
        out.push_str(rest);
    }

    fn redact(&self, text: &str, caller: &Caller) -> String {
        let mut out = String::with_capacity(text.len());
        self.redact_into(text, caller, &mut out);
        out
    }

    /// Counts one admitted call and, for one in [`SAMPLE_EVERY`] or when a scope is down to a
    /// quarter, records the levels its scopes were left at.
    pub fn admitted<'a, I>(&self, caller: &Caller, levels: I, now: Nanos)
    where
        I: Iterator<Item = Sample<'a>> + Clone,
    {
        let n = self.admitted.fetch_add(1, Ordering::Relaxed);
        let low = levels.clone().any(|s| s.decision.remaining.saturating_mul(4) <= s.decision.limit);
        if !low && !n.is_multiple_of(SAMPLE_EVERY) {
            return;
        }
        let (hash, bucket) = (self.hash(caller.id()), caller.bucket());
        let mut name = String::with_capacity(64);
        let mut recent = self.recent();
        for sample in levels {
            self.redact_into(sample.name, caller, &mut name);
            recent.touch(&name, now, |level| {
                (level.limit, level.remaining) = (sample.decision.limit, sample.decision.remaining);
                level.seen(caller, hash, bucket);
                level.samples += 1;
                level.source = sample.source.map(|(key, limiter)| match level.source.take() {
                    Some(known) if *known.key == *key => Source { key: known.key, limiter: limiter.clone() },
                    _ => Source { key: Arc::from(key), limiter: limiter.clone() },
                });
            });
        }
    }

    /// Forgets where levels are read: the limits were put in force anew, and a level read with
    /// the old limiter would show the old limit. The next admitted call of each scope says anew.
    pub fn limits_changed(&self) {
        for level in self.recent().scopes.values_mut() {
            level.source = None;
        }
    }

    /// Records one refusal.
    pub fn refused(&self, caller: &Caller, refused: Refused<'_>, now: Nanos) {
        self.refused.fetch_add(1, Ordering::Relaxed);
        let bucket = caller.bucket();
        let message = self.redact(refused.message, caller);
        let tenant = caller.tenant().map(str::to_owned);
        let mut scope = String::new();
        if let Some(name) = refused.scope {
            self.redact_into(name, caller, &mut scope);
        }
        let hash = self.hash(caller.id());
        let mut recent = self.recent();
        let scope: Option<Arc<str>> = match refused.scope {
            None => None,
            Some(_) if is_budget(&scope) => Some(recent.touch(&scope, now, |level| {
                level.seen(caller, hash, bucket);
                level.refused += 1;
                if let (Some(limit), Some(remaining)) = (refused.limit, refused.remaining) {
                    (level.limit, level.remaining) = (limit, remaining);
                }
            })),
            Some(_) => Some(Arc::from(scope)),
        };
        let tool = recent.count(refused.tool, refused.layer, refused.code, now / BUCKET);
        if recent.latest.len() >= LATEST {
            recent.latest.pop_back();
        }
        recent.latest.push_front(Entry {
            at: now,
            layer: refused.layer,
            tool,
            code: refused.code,
            owner: Arc::from(caller.id()),
            caller: hash,
            bucket,
            tenant,
            scope,
            limit: refused.limit,
            remaining: refused.remaining,
            retry_after_ms: refused.retry_after_ms,
            message,
        });
    }

    /// What the dashboard shows at `now`: the last ten minutes.
    pub fn snapshot(&self, now: Nanos) -> Snapshot {
        self.snapshot_for(now, Audience::Everyone)
    }

    /// What the dashboard shows `audience` at `now`: the counts per tool and the totals, and of
    /// the latest refusals and the busiest budgets those `audience` may see.
    pub fn snapshot_for(&self, now: Nanos, audience: Audience<'_>) -> Snapshot {
        let bucket = now / BUCKET;
        let window = BUCKET * BUCKETS as u64;
        let recent_enough = |at: Nanos| now.saturating_sub(at) < window;
        let ago_ms = |at: Nanos| now.saturating_sub(at) / NANOS_PER_MS;
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
            window_s: window / NANOS_PER_SEC,
            bucket_s: BUCKET / NANOS_PER_SEC,
            admitted_total: self.admitted.load(Ordering::Relaxed),
            refused_total: self.refused.load(Ordering::Relaxed),
            refused_in_window: tools.iter().map(|t| t.refused).sum(),
            tools,
            latest,
            scopes,
        }
    }
}

/// Appends `#` and the six hex digits of a 24-bit hash.
fn push_hashed(out: &mut String, hash: u32) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push('#');
    for shift in (0..6).rev() {
        out.push(char::from(HEX[((hash >> (shift * 4)) & 0xf) as usize]));
    }
}

/// A hash as the page shows it: `#3fa2c1`.
fn shown(hash: u32) -> String {
    let mut out = String::with_capacity(7);
    push_hashed(&mut out, hash);
    out
}

/// Where `needle` first occurs in `haystack`. A plain scan: scope names and ids are a few dozen
/// bytes, where `str::find` spends more setting up its two-way search than searching.
fn find(haystack: &str, needle: &str) -> Option<usize> {
    let needle = needle.as_bytes();
    let first = *needle.first()?;
    haystack.as_bytes().windows(needle.len()).position(|w| w[0] == first && w == needle)
}

/// Whether a refusal's scope is a budget with a level (not a loop stop, the upstream's queue
/// or the upstream itself, which name no caller and have no level of their own).
fn is_budget(scope: &str) -> bool {
    !matches!(kind_of(scope), "loop" | "queue" | "upstream" | "other")
}

/// What kind of budget a (redacted) scope name is, for people.
fn kind_of(scope: &str) -> &'static str {
    if scope.contains(":tool:") {
        return "tool budget";
    }
    match scope.split(':').next() {
        Some("http") => "HTTP",
        Some("method") => "method",
        Some("caller") => "caller",
        Some("tenant") => "tenant",
        Some("address") => "address",
        Some("in_flight") => "in flight",
        Some("loop") => "loop",
        Some("queue") => "queue",
        Some("upstream") => "upstream",
        _ => "other",
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

#[cfg(test)]
mod tests {
    use super::*;

    fn sample<'a>(name: &'a str, decision: &'a Decision) -> Sample<'a> {
        Sample { name, decision, source: None }
    }

    #[test]
    fn a_debug_print_never_shows_the_hash_key() {
        let activity = Activity::new();
        let printed = format!("{activity:?}{activity:#?}");
        assert!(!printed.contains(&activity.key.to_string()), "{printed}");
        assert!(printed.contains("admitted"), "{printed}");
    }

    fn refused<'a>(tool: &'a str, scope: &'a str, message: &'a str) -> Refused<'a> {
        Refused {
            layer: Layer::Tool,
            tool,
            code: "rate_limited",
            scope: Some(scope),
            limit: Some(60),
            remaining: Some(0),
            retry_after_ms: Some(1000),
            message,
        }
    }

    #[test]
    fn identical_refusals_in_a_row_are_one_row_with_their_count() {
        let activity = Activity::new();
        let (one, other) = (Caller::from_token("one"), Caller::from_token("other"));
        for at in 0..12 {
            activity.refused(&one, refused("POST /mcp", "http:x", "wait"), at * NANOS_PER_SEC);
        }
        activity.refused(&other, refused("POST /mcp", "http:y", "wait"), 12 * NANOS_PER_SEC);
        activity.refused(&one, refused("POST /mcp", "http:x", "wait 2"), 13 * NANOS_PER_SEC);
        activity.refused(&one, refused("list_articles", "caller:x", "wait"), 14 * NANOS_PER_SEC);
        let latest = activity.snapshot(14 * NANOS_PER_SEC).latest;
        let rows: Vec<(&str, u32, u64)> = latest.iter().map(|r| (r.tool.as_str(), r.count, r.ago_ms)).collect();
        // Newest first; another caller between two runs keeps them apart; a changed wait does not.
        assert_eq!(
            rows,
            vec![("list_articles", 1, 0), ("POST /mcp", 1, 1000), ("POST /mcp", 1, 2000), ("POST /mcp", 12, 3000)]
        );
    }

    #[test]
    fn counts_land_in_their_bucket_and_leave_the_window_after_ten_minutes() {
        let activity = Activity::new();
        let caller = Caller::from_token("agent");
        for at in [0, 1, 2] {
            activity.refused(&caller, refused("list_articles", "caller:x", "wait"), at * NANOS_PER_SEC);
        }
        activity.refused(&caller, refused("list_articles", "caller:x", "wait"), 15 * NANOS_PER_SEC);
        let snap = activity.snapshot(15 * NANOS_PER_SEC);
        let tool = &snap.tools[0];
        assert_eq!((tool.refused, snap.refused_in_window, snap.refused_total), (4, 4, 4));
        assert_eq!(&tool.per_bucket[BUCKETS - 2..], &[3, 1]);
        // 590 s later the first bucket has left the window; the second is its oldest.
        let snap = activity.snapshot(15 * NANOS_PER_SEC + 590 * NANOS_PER_SEC);
        assert_eq!(snap.tools[0].per_bucket[0], 1);
        assert_eq!(snap.tools[0].refused, 1);
        let snap = activity.snapshot(20 * 60 * NANOS_PER_SEC);
        assert!(snap.tools.is_empty() && snap.latest.is_empty() && snap.scopes.is_empty(), "{snap:?}");
        assert_eq!(snap.refused_total, 4, "the total counts since start");
        // A lap later the ring's slots are reused from zero.
        activity.refused(&caller, refused("list_articles", "caller:x", "wait"), 20 * 60 * NANOS_PER_SEC);
        assert_eq!(activity.snapshot(20 * 60 * NANOS_PER_SEC).tools[0].per_bucket.iter().sum::<u32>(), 1);
    }

    #[test]
    fn an_audience_of_one_key_sees_its_tenants_rows_or_its_own() {
        use sha2::Digest as _;
        let key = |name: &str, tenant: Option<&str>| {
            let key = crate::config::ApiKey {
                sha256: sha2::Sha256::digest(name.as_bytes()).into(),
                tenant: tenant.map(str::to_owned),
                tier: "default".to_owned(),
                caller: None,
            };
            Caller::of_key(&key, &crate::identity::CallerIds::unkeyed())
        };
        let (acme, acme_too, globex) = (key("a", Some("acme")), key("b", Some("acme")), key("g", Some("globex")));
        let (carol, dave) = (key("c", None), key("d", None));
        let activity = Activity::new();
        let d = Decision { allowed: true, limit: 60, remaining: 1, retry_after: 0, reset_after: 0, at: 0 };
        for caller in [&acme, &acme_too, &globex, &carol, &dave] {
            let own = format!("caller:{}", caller.id());
            activity.refused(caller, refused("list_articles", &own, "wait"), 0);
            let shared = format!("tenant:{}", caller.tenant().unwrap_or("-"));
            activity.admitted(caller, [sample(shared.as_str(), &d)].into_iter(), 0);
        }
        let everyone = activity.snapshot(0);
        assert_eq!((everyone.latest.len(), everyone.scopes.len()), (5, 8));
        let seen = |viewer: &Caller| activity.snapshot_for(0, Audience::Of(viewer));
        let of_acme = seen(&acme_too);
        assert_eq!(of_acme.latest.len(), 2, "both acme callers' refusals");
        assert!(of_acme.latest.iter().all(|r| r.tenant.as_deref() == Some("acme")));
        assert_eq!(of_acme.scopes.iter().filter(|s| s.scope == "tenant:acme").count(), 1);
        assert_eq!(of_acme.scopes.len(), 3, "acme's budget and both its callers'");
        let of_carol = seen(&carol);
        assert_eq!(of_carol.latest.len(), 1, "only carol's own: {of_carol:?}");
        assert_eq!(of_carol.latest[0].caller, activity.hashed(carol.id()));
        let scopes: Vec<&str> = of_carol.scopes.iter().map(|s| s.scope.as_str()).collect();
        assert_eq!(scopes, [format!("caller:{}", activity.hashed(carol.id()))], "not dave's, tenant-less too");
        assert_eq!((of_carol.refused_total, of_carol.tools.len()), (5, 1), "the counts are everyone's");
        assert!(Audience::Of(&carol).sees_job(carol.id(), None) && !Audience::Of(&carol).sees_job(dave.id(), None));
        assert!(Audience::Of(&acme).sees_job(acme_too.id(), Some("acme")));
        assert!(!Audience::Of(&acme).sees_job(globex.id(), Some("globex")));
    }

    #[test]
    fn callers_and_addresses_are_stored_only_hashed() {
        let activity = Activity::new();
        let caller = Caller::from_token("sk-secret");
        let scope = format!("caller:{}", caller.id());
        let message = format!("refused for {}", caller.id());
        activity.refused(&caller, refused("generate_image", &scope, &message), 0);
        let d = Decision { allowed: true, limit: 60, remaining: 1, retry_after: 0, reset_after: 0, at: 0 };
        let method = format!("method:tools/call:{}", caller.id());
        activity.admitted(&caller, [sample(method.as_str(), &d)].into_iter(), 0);
        let json = serde_json::to_string(&activity.snapshot(0)).expect("json");
        assert!(!json.contains(caller.id()) && !json.contains(&caller.id()[4..]), "{json}");
        let hashed = activity.hashed(caller.id());
        assert!(json.contains(&format!("caller:{hashed}")) && json.contains(&format!("method:tools/call:{hashed}")));
        assert!(json.contains(&format!("\"caller\":\"{hashed}\"")), "{json}");
        assert!(json.contains(&format!("\"bucket\":\"b{:02}\"", caller.bucket())), "{json}");
    }

    #[test]
    fn an_unverified_callers_id_and_address_are_both_hashed_wherever_they_appear() {
        let activity = Activity::new();
        let identifier = crate::identity::Identifier::new(
            &crate::config::LimitsConfig::from_toml("", &crate::config::Catalogue::new()).expect("defaults"),
        );
        let mut headers = http::HeaderMap::new();
        headers.insert("x-api-key", http::HeaderValue::from_static("made-up"));
        let caller = identifier.identify(&headers, Some([203, 0, 113, 9].into())).expect("a caller");
        let address = caller.unverified_from().expect("unverified").to_owned();
        let text = format!("{address} then {} then address:{address}", caller.id());
        let (a, c) = (activity.hashed(&address), activity.hashed(caller.id()));
        assert_eq!(activity.redact(&text, &caller), format!("{a} then {c} then address:{a}"));
        assert_eq!(activity.redact("tenant:acme", &caller), "tenant:acme");
    }

    #[test]
    fn levels_are_sampled_now_and_then_and_whenever_a_scope_runs_low() {
        let activity = Activity::new();
        let caller = Caller::from_token("agent");
        let roomy = Decision { allowed: true, limit: 100, remaining: 90, retry_after: 0, reset_after: 0, at: 0 };
        for _ in 1..SAMPLE_EVERY * 2 {
            activity.admitted(&caller, [sample("tenant:roomy", &roomy)].into_iter(), 0);
        }
        let low = Decision { remaining: 20, ..roomy };
        activity.admitted(&caller, [sample("tenant:low", &low)].into_iter(), 0);
        // A loop stop is a refusal, not a budget with a level.
        activity.refused(&caller, refused("list_articles", "loop:list_articles", "loop"), 0);
        let snap = activity.snapshot(0);
        assert_eq!(snap.latest[0].scope.as_deref(), Some("loop:list_articles"));
        assert_eq!(snap.admitted_total, SAMPLE_EVERY * 2);
        let level = |name: &str| snap.scopes.iter().find(|s| s.scope == name).map(|s| s.remaining);
        assert_eq!(level("tenant:roomy"), Some(90), "sampled: {:?}", snap.scopes);
        assert_eq!(level("tenant:low"), Some(20), "the 32nd call was not due a sample, but it ran low");
        assert_eq!(snap.scopes.len(), 2, "{:?}", snap.scopes);
        assert_eq!(snap.scopes[0].scope, "tenant:low", "the fuller scope ranks first");
    }

    #[test]
    fn a_level_is_read_again_from_where_its_last_call_found_it_until_the_limits_change() {
        use crate::limit::{Concurrency, Limiter};
        let activity = Activity::new();
        let caller = Caller::from_token("agent");
        let slots = Limiter::Concurrency(Concurrency::new(5));
        let key = format!("in_flight:caller:{}", caller.id());
        let held = Decision { allowed: true, limit: 5, remaining: 4, retry_after: 0, reset_after: 0, at: 0 };
        let sample = Sample { name: &key, decision: &held, source: Some((&key, &slots)) };
        activity.admitted(&caller, [sample].into_iter(), 0);
        let source = |snap: Snapshot| snap.scopes[0].source.clone().map(|s| (s.key.to_string(), s.limiter));
        assert_eq!(source(activity.snapshot(0)), Some((key.clone(), slots.clone())), "the raw key, never shown");
        assert!(!serde_json::to_string(&activity.snapshot(0)).expect("JSON").contains(caller.id()));
        activity.limits_changed();
        assert_eq!(source(activity.snapshot(0)), None, "the old limiter would read the old limit");
    }

    #[test]
    fn memory_stays_bounded_by_the_latest_and_the_scope_caps() {
        let activity = Activity::new();
        for i in 0..(MAX_SCOPES * 2) {
            let caller = Caller::from_token(&format!("agent-{i}"));
            let scope = format!("caller:{}", caller.id());
            activity.refused(&caller, refused("list_articles", &scope, "wait"), i as u64);
        }
        let recent = activity.recent();
        assert_eq!((recent.latest.len(), recent.scopes.len()), (LATEST, MAX_SCOPES));
    }
}
