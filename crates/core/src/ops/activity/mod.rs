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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::clock::Nanos;
use crate::identity::Caller;
use crate::limit::{Decision, Limiter};
use crate::ops::metrics::Layer;

mod recent;
mod record;
mod snapshot;
#[cfg(test)]
mod tests;

use recent::Recent;
pub use snapshot::{CodeCount, LatestRefusal, ScopeLevel, Snapshot, ToolRefusals};

/// The width of one bucket of the refusal counts.
pub const BUCKET: Nanos = Nanos::from_secs(10);
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
}
