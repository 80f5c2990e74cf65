//! The recorder: admitted calls counted (their levels sampled), refusals recorded in full, and
//! every caller id and address redacted to a keyed hash before anything is stored.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::recent::Entry;
use super::{Activity, BUCKET, LATEST, Refused, SAMPLE_EVERY, Sample, Source};
use crate::clock::Nanos;
use crate::identity::Caller;

impl Activity {
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

    pub(super) fn redact(&self, text: &str, caller: &Caller) -> String {
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
pub(super) fn shown(hash: u32) -> String {
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
pub(super) fn kind_of(scope: &str) -> &'static str {
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
