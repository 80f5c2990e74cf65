//! Limiter state in Redis, so that every instance of the server draws on one budget.
//!
//! **One round trip per call.** [`RedisStore::decide`] sends every [`Check`] of a call to one
//! Lua script, which Redis runs atomically: it reads each key's state, decides every check on
//! what it read (a later check on the same key sees what an earlier one would write), and only
//! if *all* are allowed writes the charged states back; otherwise it writes nothing. That is
//! [`mcp_ratelimit_kernel::store::MemoryStore`]'s all-or-nothing rule, kept across instances without a lock.
//! Time is Redis's own (`TIME`), so instances whose clocks disagree still share one clock.
//!
//! **The scripts** live in `crates/redis/src/`, one file per algorithm named after its Rust twin
//! in [`mcp_ratelimit_kernel::limit`] (`token_bucket.lua` beside `token_bucket.rs`), plus `prelude.lua` (exact
//! arithmetic, time, state encoding) and the entry points (`decide.lua`, which checks a call
//! for a loop with `loop_history.lua` first, `release.lua`, `renew.lua`, `adjust.lua`);
//! `record.lua` stands alone: the write of a shared record (a job's snapshot) that never
//! replaces a final or newer one. They are assembled into one script each with `include_str!`,
//! loaded once with `SCRIPT LOAD`
//! and run with `EVALSHA`; after a `SCRIPT FLUSH` or a failover, [`Script`] sees `NOSCRIPT` and
//! loads them again.
//!
//! **State**: one string per key, the algorithm's name then integer fields, e.g.
//! `gcra 1767225600333333 333 1767225600000000` (each Lua file documents its own). Absolute instants are epoch
//! microseconds, plus a nanosecond remainder where an algorithm needs one (GCRA's TAT, a window
//! start that is not a whole microsecond). A key kept by another algorithm, or holding anything
//! else, is treated as fresh, as `with_state!` does in Rust.
//!
//! **Exactness.** The scripts give the very [`Decision`] the Rust algorithm gives for the same
//! state, time and cost, to the nanosecond. Lua numbers are doubles, exact for integers up to
//! 2^53, and epoch nanoseconds are larger; so the clock is read in microseconds and every
//! algorithm computes in nanoseconds *relative to now*, which stays exact as long as a bucket
//! (capacity × period) and a window are at most 2^52 ns, about 52 days. A limiter beyond that,
//! a cost above a limiter's capacity (the [`mcp_ratelimit_kernel::limit::Algorithm`] precondition), or a clock
//! reading that is not a whole microsecond is refused with [`StoreError::OutOfRange`] rather
//! than decided approximately.
//!
//! **Where a charge landed.** Every decision comes back with the script's clock
//! ([`Decision::at`]), so a price settled later goes back only to where the call was charged
//! (`adjust.lua` with each algorithm's `give_back`), on the clock it was charged by.
//!
//! **Forgetting.** Every written key gets a TTL at its state's `forget_at` (rounded up to the
//! millisecond), so Redis drops idle callers by itself: there is no sweep.
//!
//! **In-flight slots** ([`mcp_ratelimit_kernel::limit::Concurrency`]) are *leases*: each admission that takes
//! slots names a lease (a random id of its instance's choosing) that lasts `lease` (default
//! 30 s); the instance renews the leases it still holds ([`RedisStore::renew`], one script for
//! all of them) and gives them back when the work ends ([`RedisStore::release`]). A server that
//! dies holding slots stops renewing, and its slots come back when the leases run out, instead of
//! leaking for ever. Decisions are those of the Rust twin as long as no lease expires.
//!
//! **A learnt limit** (the upstream account's slots, learnt from its answers:
//! [`mcp_ratelimit_kernel::limit::adaptive`]) is one key every instance learns into (`learn.lua`, one script per
//! answer) and claims under: a decision under it (`decide.lua` with the learner named) reads it in
//! the same script as the account's in-flight checks and scales their capacity to it. Its state
//! is floating point, like its Rust twin's, written so it reads back to the same double
//! (`adaptive.lua` says why that is exact); the key is kept an hour past its last use.
//!
//! **Keys** are used exactly as the checks name them. A Redis Cluster runs a script only on keys
//! of one hash slot, so the keys of one caller carry one hash tag (`{t:acme}caller:x`,
//! `{t:acme}tenant:acme`), as the guard's scopes do (`mcp-ratelimit-core`), and its call is one
//! script. One budget is shared across tenants and so has a tag of its own: an OAuth client's
//! (`{o:app}client:app`). A call that draws on it is decided on both slots as one: the away
//! budgets first (charged, or nothing is), then the call's own slot with its blocks, loop history
//! and in-flight slots; whatever refuses, what the other admitted is given back at once. Its
//! settlement and an operator's reset go to each slot, the settlement's mark re-tagged for each
//! so a retry lands once on every node. In-flight slots away from a call's own slot are refused
//! as [`StoreError::KeysApart`]. Renewing leases, the one call that gathers keys of many callers,
//! is sent as one script per slot.
//!
//! **Connection.** To one Redis (`redis://`, or `rediss://` over TLS): one [`ConnectionManager`](::redis::aio::ConnectionManager),
//! a single multiplexed, pipelined connection that every decision shares and that reconnects by
//! itself; the script calls made at one moment go to it together, as one pipeline (`batch.rs`:
//! one write and one read for all of them, each script still run alone). To a cluster (`redis+cluster://host1:port1,host2:port2` or `rediss+cluster://…`, or
//! several `redis://`/`rediss://` URLs separated by commas, the seed nodes): one
//! [`ClusterConnection`](::redis::cluster_async::ClusterConnection), which learns the slot map from the seeds, sends
//! each script call to the primary holding its keys' slot and follows `MOVED` when slots move.
//! The same [`Script`]s run on either; `SCRIPT LOAD` goes to every node, so a node that lost its
//! script cache (restart, failover, `SCRIPT FLUSH`) gets it back on its next `NOSCRIPT`. Every
//! call is bounded by the timeout given to [`RedisStore::connect`], so no request waits longer
//! than that on a dead Redis. TLS (rustls) verifies the server against the system's trust store,
//! or only against the CA given to [`RedisStore::connect_trusting`] (`store.redis_ca_file`), as
//! managed Redis services with a private CA need. A call that timed out may still run when a slow Redis gets to it:
//! it then charges a budget the caller was told nothing about: a lost answer can only refuse
//! more, never admit more.
//!
//! [`Check`]: mcp_ratelimit_kernel::store::Check
//! [`Decision`]: mcp_ratelimit_kernel::limit::Decision
//! [`Decision::at`]: mcp_ratelimit_kernel::limit::Decision::at

use std::collections::HashMap;
use std::time::Duration;

use ::redis::{Script, TlsCertificates};

use mcp_ratelimit_kernel::clock::Nanos;
use mcp_ratelimit_kernel::store::{Lease, Pattern, StoreError};

/// A script of the prelude, every registered algorithm's Lua twin (`redis/<name>.lua`, read at
/// compile time: an algorithm without its twin does not build), then the files `entry` names
/// (what the entry point uses, then the entry point).
macro_rules! with_every_algorithm {
    (($($entry:literal)+) $($module:ident => $name:ident $($boxed:ident)?,)*) => {
        concat!(
            include_str!("prelude.lua"),
            $(include_str!(concat!(stringify!($module), ".lua")),)*
            $(include_str!($entry),)+
        )
    };
}

mod adjust;
mod batch;
mod connection;
mod decide;
mod errors;
mod learner;
mod leases;
mod line;
mod listen;
mod loop_history;
mod records;
mod scripts;
mod shared;
mod slices;
#[cfg(test)]
mod tests;

use connection::{Connection, Target};
// Shared by the store's modules, which reach them here at the root (`super::bounded`, …).
use errors::{bounded, classify, invalid_url};
use leases::{GiveBack, Unanswered};
use scripts::{micros, script_span};
pub use slices::SliceRules;

/// What the loop history answered to a call checked alone ([`RedisStore::loop_check`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoopAnswer {
    /// Not a loop; recorded.
    Recorded,
    /// A loop: refused for this long.
    Looping {
        /// Nanoseconds until the call may be made again.
        retry_after: Nanos,
        /// The pattern it repeats.
        pattern: Pattern,
    },
}

/// How long a lease on in-flight slots lasts unless renewed.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// A lease an instance holds and renews: its key, its id, its units, and the key's capacity
/// (a lease taken again after it expired must fit under it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeldLease<'a> {
    /// The concurrency key.
    pub key: &'a str,
    /// The lease id.
    pub lease: Lease,
    /// Slots it holds.
    pub units: u64,
    /// The key's cap.
    pub capacity: u64,
}

/// What a renewal did with one lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewed {
    /// It was live and lasts another lease duration.
    Renewed,
    /// It had expired and was taken again (its work still runs, and the cap had room).
    Retaken,
    /// It was given back meanwhile: nothing to renew.
    GivenBack,
    /// It had expired and the cap had no room for it any more: no longer counted.
    Lost,
}

/// Limiter state shared by every server instance through one Redis or one Redis Cluster.
pub struct RedisStore {
    connection: Connection,
    timeout: Duration,
    /// `host:port` (the seed nodes' of a cluster), for error messages: the URL may carry a
    /// password.
    address: String,
    decide: Script,
    release: Script,
    renew: Script,
    adjust: Script,
    record: Script,
    learn: Script,
    line: Script,
    loop_answer: Script,
    lease: Duration,
    /// The in-flight leases this instance holds (key, lease) → (units, the key's cap), renewed on
    /// a schedule ([`Slots::renew_leases`](mcp_ratelimit_kernel::store::Slots::renew_leases)) until given back.
    held: std::sync::Mutex<HeldSlots>,
    /// A client of one node, for subscriptions ([`Broadcast::hear`](mcp_ratelimit_kernel::store::Broadcast::hear)).
    /// Its URL may carry a password: never printed.
    listener: ::redis::Client,
    /// Busy keys' budgets held here a slice at a time ([`RedisStore::with_slices`]); `None`: every
    /// decision in Redis.
    slices: Option<slices::Slices>,
    /// This store, once shared ([`RedisStore::shared`]): what gives its slices back in tasks of
    /// their own.
    me: std::sync::OnceLock<std::sync::Weak<RedisStore>>,
}

/// The leases an instance holds: (key, lease) → (units, the key's cap).
type HeldSlots = HashMap<(String, Lease), (u64, u64)>;

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore").field("address", &self.address).field("timeout", &self.timeout).finish()
    }
}

impl RedisStore {
    /// Connects to the Redis at `url` and loads the scripts: one server
    /// (`redis://[:password@]host[:port][/db]`), or the seed nodes of a Redis Cluster
    /// (`redis+cluster://[:password@]host1:port1,host2:port2,...`, or `redis://` URLs separated by
    /// commas). `timeout` bounds this and every later call.
    pub async fn connect(url: &str, timeout: Duration) -> Result<RedisStore, StoreError> {
        Self::connect_trusting(url, timeout, None).await
    }

    /// [`RedisStore::connect`], verifying a TLS server (`rediss://`) against `ca_pem` (the PEM
    /// certificates of a private CA) alone instead of the system's trust store.
    pub async fn connect_trusting(
        url: &str,
        timeout: Duration,
        ca_pem: Option<Vec<u8>>,
    ) -> Result<RedisStore, StoreError> {
        let target = Target::parse(url)?;
        if target.tls() {
            // One process-wide rustls provider, whatever else in the build enables: ring. An
            // error only means one is installed already, which serves as well.
            let _ = ::rustls::crypto::ring::default_provider().install_default();
        }
        let certificates = TlsCertificates { client_tls: None, root_cert: ca_pem };
        let address = target.address().to_owned();
        let listener = target.listener(certificates.clone()).map_err(|e| classify(&address, timeout, e))?;
        let (decide, release, renew, adjust, record, learn, line, loop_answer) = (
            Script::new(scripts::DECIDE_SCRIPT),
            Script::new(scripts::RELEASE_SCRIPT),
            Script::new(scripts::RENEW_SCRIPT),
            Script::new(scripts::ADJUST_SCRIPT),
            Script::new(scripts::RECORD_SCRIPT),
            Script::new(scripts::LEARN_SCRIPT),
            Script::new(line::LINE_SCRIPT),
            Script::new(scripts::LOOP_ANSWER_SCRIPT),
        );
        let connecting = async {
            let connection = target.connect(timeout, certificates).await?;
            // Side by side on the one connection: a round trip for all of them, not one each.
            let scripts = [&decide, &release, &renew, &adjust, &record, &learn, &line, &loop_answer];
            futures::future::try_join_all(scripts.map(|script| connection.load(script))).await?;
            Ok(connection)
        };
        let connection = bounded(&address, timeout, connecting).await?;
        let lease = DEFAULT_LEASE;
        let held = std::sync::Mutex::default();
        Ok(RedisStore {
            connection,
            timeout,
            address,
            decide,
            release,
            renew,
            adjust,
            record,
            learn,
            line,
            loop_answer,
            lease,
            held,
            listener,
            slices: None,
            me: std::sync::OnceLock::new(),
        })
    }

    /// Checks that `url` has one of the forms [`RedisStore::connect`] takes, without connecting:
    /// for config validation. The error never shows a password.
    pub fn check_url(url: &str) -> Result<(), StoreError> {
        Target::parse(url).map(drop)
    }

    /// This store with leases on in-flight slots lasting `lease` unless renewed (at least a
    /// millisecond, and at most [`mcp_ratelimit_kernel::clock::LONGEST_WAIT`], which the scripts still add to
    /// their clock exactly).
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease.clamp(Duration::from_millis(1), mcp_ratelimit_kernel::clock::LONGEST_WAIT);
        self
    }

    /// How long a lease on in-flight slots lasts unless renewed.
    pub fn lease(&self) -> Duration {
        self.lease
    }
}
