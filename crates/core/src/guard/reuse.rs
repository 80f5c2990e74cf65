//! One upstream request for identical calls, and answers reused for a while
//! (`[tools.NAME] coalesce`, `cache_ttl_ms`).
//!
//! Ten agents of one tenant asking the same paid question at once would pay ten upstream calls;
//! a cheap read repeated within seconds would pay one each time. Here the first of identical
//! calls in flight asks, and the others wait for its answer (*coalescing*, "single flight"), and
//! a successful answer may be kept for a time and handed to the next identical call (*reuse*).
//!
//! - **Never across the scope.** A call's key is a SHA-256 of its scope (the tenant, or the
//!   caller), the tool and its canonical arguments ([`crate::guard::loops::canonical_call`]), so
//!   one tenant's answer never reaches another, and a caller's own never another caller when the
//!   scope is `caller`. (A keyed cryptographic hash: nobody can craft two calls with one key.)
//! - **A waiter that goes away cancels nothing.** The request runs as its own task; the first
//!   caller cancelling its call leaves the others their answer.
//! - **Bounded.** Calls in flight are bounded by the admissions that reached here; the kept
//!   answers by `upstream.cache_max_entries` and `upstream.cache_max_bytes`, the oldest making
//!   room. Only answers the door says may be kept are kept (successes, not refusals).
//! - Time is the server's one clock, so a test walks past a TTL in a step.
//!
//! What is shared is the door's own answer type: the tool router's result for our tools, the
//! proxied server's for the proxy. Charging is the guard's, before any of this: every caller is
//! charged the tool's cost, whoever asked upstream.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use sha2::{Digest, Sha256};
use tracing::Instrument;

use crate::clock::{Nanos, SharedClock};
use crate::config::{Coalesce, ToolPolicy};
use crate::identity::Caller;
use crate::ops::metrics::Metrics;

/// Identifies identical calls in one scope.
pub type Key = [u8; 32];

/// How a call was answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Served {
    /// It asked the upstream itself.
    Asked,
    /// It waited for an identical call's request, already in flight.
    Coalesced,
    /// A kept answer of an identical call.
    Cached,
}

impl Served {
    /// The metrics label of a saved request, or `None` for one that asked.
    pub fn saved(self) -> Option<&'static str> {
        match self {
            Served::Asked => None,
            Served::Coalesced => Some("coalesced"),
            Served::Cached => Some("cached"),
        }
    }
}

/// The request an answer was waited for ended without one (its task panicked).
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the shared request ended without an answer")]
pub struct Lost;

/// Requests saved since start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Saved {
    /// Calls answered by an identical call's request in flight.
    pub coalesced: u64,
    /// Calls answered from a kept answer.
    pub cached: u64,
}

/// What a door asks of [`Reuse::answer`] for one call: where its answer may be shared, and for
/// how long it may be kept.
#[derive(Debug, Clone, Copy)]
pub struct Sharing {
    key: Key,
    coalesce: bool,
    ttl: Nanos,
}

impl Sharing {
    /// How `caller`'s call of `tool` with `args` may share its answer under `policy`, or `None`
    /// when it may not at all (`coalesce = "off"` and no cache).
    pub fn of(policy: &ToolPolicy, caller: &Caller, tool: &str, args: &serde_json::Value) -> Option<Self> {
        let ttl = Nanos::from_millis(policy.cache_ttl_ms);
        let scope = match (policy.coalesce, caller.tenant()) {
            (Coalesce::Off, _) if ttl == Nanos::ZERO => return None,
            (Coalesce::Tenant, Some(tenant)) => format!("tenant:{tenant}"),
            // A caller without a tenant is its own; with `off`, a cache is the caller's own.
            (Coalesce::Tenant | Coalesce::Caller | Coalesce::Off, _) => format!("caller:{}", caller.id()),
        };
        let mut hash = Sha256::new();
        // Each part is length-prefixed, so no split of one into the next can collide.
        for part in [scope.as_bytes(), crate::guard::loops::canonical_call(tool, args).as_bytes()] {
            hash.update((part.len() as u64).to_le_bytes());
            hash.update(part);
        }
        Some(Self { key: hash.finalize().into(), coalesce: policy.coalesce != Coalesce::Off, ttl })
    }
}

type InFlight<T> = Shared<BoxFuture<'static, Option<T>>>;

/// A kept answer.
struct Kept<T> {
    answer: T,
    /// When it was kept, and until when its TTL then ran.
    at: Nanos,
    until: Nanos,
    bytes: u64,
    /// Its place in [`State::order`].
    seq: u64,
}

struct State<T> {
    in_flight: HashMap<Key, InFlight<T>>,
    kept: HashMap<Key, Kept<T>>,
    /// Kept answers oldest first, by sequence number (an entry replaced since is skipped).
    order: VecDeque<(Key, u64)>,
    bytes: u64,
    seq: u64,
}

impl<T> Default for State<T> {
    fn default() -> Self {
        Self { in_flight: HashMap::new(), kept: HashMap::new(), order: VecDeque::new(), bytes: 0, seq: 0 }
    }
}

impl<T> State<T> {
    fn forget(&mut self, key: &Key) {
        if let Some(gone) = self.kept.remove(key) {
            self.bytes = self.bytes.saturating_sub(gone.bytes);
        }
    }
}

/// The calls in flight and the answers kept, of one door.
pub struct Reuse<T> {
    clock: SharedClock,
    metrics: Arc<Metrics>,
    max_entries: usize,
    max_bytes: u64,
    state: Mutex<State<T>>,
    coalesced: AtomicU64,
    cached: AtomicU64,
}

impl<T> std::fmt::Debug for Reuse<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reuse").field("saved", &self.saved()).finish_non_exhaustive()
    }
}

/// Takes a call's request out of the calls in flight when its task ends, however it ends.
struct Landed<T> {
    reuse: Arc<Reuse<T>>,
    key: Key,
}

impl<T> Drop for Landed<T> {
    fn drop(&mut self) {
        self.reuse.lock().in_flight.remove(&self.key);
    }
}

impl<T> Reuse<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Requests saved since start.
    pub fn saved(&self) -> Saved {
        Saved { coalesced: self.coalesced.load(Ordering::Relaxed), cached: self.cached.load(Ordering::Relaxed) }
    }

    /// Answers kept now, and their bytes.
    pub fn kept(&self) -> (usize, u64) {
        let state = self.lock();
        (state.kept.len(), state.bytes)
    }
}

impl<T: Clone + Send + Sync + 'static> Reuse<T> {
    /// Nothing in flight or kept; at most `max_entries` answers and `max_bytes` of them kept.
    pub fn new(clock: SharedClock, metrics: Arc<Metrics>, max_entries: usize, max_bytes: u64) -> Arc<Self> {
        Arc::new(Self {
            clock,
            metrics,
            max_entries,
            max_bytes,
            state: Mutex::default(),
            coalesced: AtomicU64::new(0),
            cached: AtomicU64::new(0),
        })
    }

    /// The answer to a call of `tool` that may share as `sharing` says: a kept one, the one an
    /// identical call in flight is getting, or `ask`'s, run as a task of its own. `keep` says
    /// whether an answer may be kept, and its size in bytes.
    pub async fn answer<F>(
        self: &Arc<Self>,
        tool: &str,
        sharing: Sharing,
        keep: fn(&T) -> Option<u64>,
        ask: F,
    ) -> Result<(T, Served), Lost>
    where
        F: Future<Output = T> + Send + 'static,
    {
        let (waiting, served) = {
            let mut state = self.lock();
            if sharing.ttl > Nanos::ZERO {
                let now = self.clock.now();
                // The TTL in force now, too: a reload that shortens it applies to what is kept.
                match state.kept.get(&sharing.key) {
                    Some(kept) if kept.until.min(kept.at + sharing.ttl) > now => {
                        let answer = kept.answer.clone();
                        drop(state);
                        self.count(tool, Served::Cached);
                        return Ok((answer, Served::Cached));
                    }
                    Some(_) => state.forget(&sharing.key),
                    None => {}
                }
            }
            match state.in_flight.get(&sharing.key) {
                Some(waiting) if sharing.coalesce => (waiting.clone(), Served::Coalesced),
                _ => {
                    // Only a request others may join is among those in flight.
                    let landed = sharing.coalesce.then(|| Landed { reuse: self.clone(), key: sharing.key });
                    let reuse = self.clone();
                    // In the asking call's span, so its upstream request is in that call's trace.
                    let task = tokio::spawn(
                        async move {
                            let answer = ask.await;
                            reuse.keep(sharing, &answer, keep);
                            drop(landed);
                            answer
                        }
                        .in_current_span(),
                    );
                    let waiting = async move { task.await.ok() }.boxed().shared();
                    if sharing.coalesce {
                        state.in_flight.insert(sharing.key, waiting.clone());
                    }
                    (waiting, Served::Asked)
                }
            }
        };
        if served == Served::Coalesced {
            self.count(tool, served);
        }
        waiting.await.map(|answer| (answer, served)).ok_or(Lost)
    }

    fn count(&self, tool: &str, served: Served) {
        let counter = if served == Served::Cached { &self.cached } else { &self.coalesced };
        counter.fetch_add(1, Ordering::Relaxed);
        if let Some(how) = served.saved() {
            self.metrics.upstream_saved(tool, how);
        }
    }

    /// Keeps `answer` for `sharing.ttl` if `keep` says it may be kept, making room within the
    /// bounds (the oldest first).
    fn keep(&self, sharing: Sharing, answer: &T, keep: fn(&T) -> Option<u64>) {
        if sharing.ttl == Nanos::ZERO {
            return;
        }
        let Some(bytes) = keep(answer) else { return };
        if bytes > self.max_bytes || self.max_entries == 0 {
            return;
        }
        let at = self.clock.now();
        let until = at + sharing.ttl;
        let mut state = self.lock();
        state.forget(&sharing.key);
        state.seq = state.seq.wrapping_add(1);
        let seq = state.seq;
        state.kept.insert(sharing.key, Kept { answer: answer.clone(), at, until, bytes, seq });
        state.order.push_back((sharing.key, seq));
        state.bytes = state.bytes.saturating_add(bytes);
        while state.kept.len() > self.max_entries || state.bytes > self.max_bytes {
            let Some((oldest, seq)) = state.order.pop_front() else { break };
            if state.kept.get(&oldest).is_some_and(|k| k.seq == seq) {
                state.forget(&oldest);
            }
        }
        // Entries replaced since leave stale places behind; never let those outgrow the kept.
        if state.order.len() > state.kept.len().saturating_mul(2).max(64) {
            let State { order, kept, .. } = &mut *state;
            order.retain(|(key, seq)| kept.get(key).is_some_and(|k| k.seq == *seq));
        }
    }

    /// Forgets the answers whose time has passed; returns how many.
    pub fn sweep(&self) -> usize {
        let now = self.clock.now();
        let mut state = self.lock();
        let before = state.kept.len();
        let State { kept, order, bytes, .. } = &mut *state;
        kept.retain(|_, k| {
            let live = k.until > now;
            if !live {
                *bytes = bytes.saturating_sub(k.bytes);
            }
            live
        });
        order.retain(|(key, seq)| kept.get(key).is_some_and(|k| k.seq == *seq));
        before - kept.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    fn policy(coalesce: Coalesce, cache_ttl_ms: u64) -> ToolPolicy {
        ToolPolicy { coalesce, cache_ttl_ms, ..ToolPolicy::unlisted(1) }
    }

    fn reuse(entries: usize, bytes: u64) -> (Arc<ManualClock>, Arc<Reuse<u64>>) {
        let clock = ManualClock::new();
        (clock.clone(), Reuse::new(clock, Arc::new(Metrics::default()), entries, bytes))
    }

    /// Two keys of acme's and one of globex's.
    fn callers() -> (Caller, Caller, Caller) {
        use sha2::Digest as _;
        let key = |name: &str, tenant: &str| {
            let key = crate::config::ApiKey {
                sha256: Sha256::digest(name.as_bytes()).into(),
                tenant: Some(tenant.to_owned()),
                tier: "default".to_owned(),
                caller: None,
            };
            Caller::of_key(&key, &crate::identity::CallerIds::unkeyed())
        };
        (key("a1", "acme"), key("a2", "acme"), key("g1", "globex"))
    }

    const ALWAYS: fn(&u64) -> Option<u64> = |_| Some(8);

    #[test]
    fn the_key_is_the_scope_the_tool_and_the_canonical_arguments() {
        let (a1, a2, g1) = callers();
        let args = serde_json::json!({"query": "x", "limit": 3});
        let same = serde_json::json!({"limit": 3, "query": "x"});
        let key =
            |p: &ToolPolicy, c: &Caller, tool: &str, a: &serde_json::Value| Sharing::of(p, c, tool, a).map(|s| s.key);
        let tenant = policy(Coalesce::Tenant, 0);
        assert_eq!(key(&tenant, &a1, "t", &args), key(&tenant, &a2, "t", &same), "one tenant, key order aside");
        assert_ne!(key(&tenant, &a1, "t", &args), key(&tenant, &g1, "t", &args), "never across tenants");
        assert_ne!(key(&tenant, &a1, "t", &args), key(&tenant, &a1, "u", &args), "another tool");
        let caller = policy(Coalesce::Caller, 0);
        assert_ne!(key(&caller, &a1, "t", &args), key(&caller, &a2, "t", &args), "never across callers");
        assert_eq!(key(&policy(Coalesce::Off, 0), &a1, "t", &args), None, "off, no cache: nothing shared");
        assert_eq!(
            key(&policy(Coalesce::Off, 5), &a1, "t", &args),
            key(&caller, &a1, "t", &args),
            "a cache per caller"
        );
    }

    #[tokio::test]
    async fn identical_calls_in_flight_share_one_request_and_a_cancelled_waiter_cancels_nothing() {
        let (_, reuse) = reuse(10, 1000);
        let (a1, a2, _) = callers();
        let sharing =
            |c: &Caller| Sharing::of(&policy(Coalesce::Tenant, 0), c, "t", &serde_json::json!({})).expect("shared");
        let asked = Arc::new(AtomicU64::new(0));
        let (open, gate) = tokio::sync::watch::channel(false);
        let ask = |asked: Arc<AtomicU64>, mut gate: tokio::sync::watch::Receiver<bool>| async move {
            asked.fetch_add(1, Ordering::SeqCst);
            let _ = gate.wait_for(|open| *open).await;
            42
        };
        let first = tokio::spawn({
            let (reuse, sharing, ask) = (reuse.clone(), sharing(&a1), ask(asked.clone(), gate.clone()));
            async move { reuse.answer("t", sharing, ALWAYS, ask).await }
        });
        tokio::task::yield_now().await;
        let second = tokio::spawn({
            let (reuse, sharing, ask) = (reuse.clone(), sharing(&a2), ask(asked.clone(), gate.clone()));
            async move { reuse.answer("t", sharing, ALWAYS, ask).await }
        });
        while reuse.saved().coalesced == 0 {
            tokio::task::yield_now().await;
        }
        first.abort();
        open.send_replace(true);
        assert_eq!(second.await.expect("joined").expect("answered"), (42, Served::Coalesced));
        assert_eq!(asked.load(Ordering::SeqCst), 1, "one request for both");
        assert!(reuse.lock().in_flight.is_empty(), "landed");
    }

    #[tokio::test]
    async fn a_kept_answer_serves_until_its_ttl_and_the_bounds_hold() {
        let (clock, reuse) = reuse(2, 20);
        let (a1, _, g1) = callers();
        let cached = policy(Coalesce::Tenant, 5_000);
        let call = |caller: &Caller, q: &str, value: u64| {
            let sharing = Sharing::of(&cached, caller, "t", &serde_json::json!({ "q": q })).expect("shared");
            let reuse = reuse.clone();
            async move { reuse.answer("t", sharing, ALWAYS, async move { value }).await.expect("answered") }
        };
        assert_eq!(call(&a1, "x", 1).await, (1, Served::Asked));
        assert_eq!(call(&a1, "x", 2).await, (1, Served::Cached));
        assert_eq!(call(&g1, "x", 3).await, (3, Served::Asked), "another tenant's is its own");
        clock.advance(std::time::Duration::from_secs(5));
        assert_eq!(call(&a1, "x", 4).await, (4, Served::Asked), "past the TTL");
        // Two entries at most (and 20 bytes, 8 each): a third pushes the oldest out.
        call(&a1, "y", 5).await;
        assert_eq!(reuse.kept(), (2, 16));
        assert_eq!(call(&g1, "x", 6).await, (6, Served::Asked), "the oldest made room");
        clock.advance(std::time::Duration::from_secs(5));
        assert_eq!(reuse.sweep(), 2);
        assert_eq!(reuse.kept(), (0, 0));
        // A shorter TTL in force (a reload) applies to an answer kept under a longer one.
        call(&a1, "z", 8).await;
        clock.advance(std::time::Duration::from_secs(2));
        let shorter =
            Sharing::of(&policy(Coalesce::Tenant, 1_000), &a1, "t", &serde_json::json!({ "q": "z" })).expect("shared");
        assert_eq!(reuse.answer("t", shorter, ALWAYS, async { 9 }).await.expect("answered"), (9, Served::Asked));
        let refused: fn(&u64) -> Option<u64> = |_| None;
        let sharing = Sharing::of(&cached, &a1, "t", &serde_json::json!({})).expect("shared");
        let before = reuse.kept();
        reuse.answer("t", sharing, refused, async { 7 }).await.expect("answered");
        assert_eq!(reuse.kept(), before, "what the door says not to keep is not kept");
    }
}
