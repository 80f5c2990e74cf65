//! Limiter state in Redis, so that every instance of the server draws on one budget.
//!
//! **One round trip per call.** [`RedisStore::decide`] sends every [`Check`] of a call to one
//! Lua script, which Redis runs atomically: it reads each key's state, decides every check on
//! what it read (a later check on the same key sees what an earlier one would write), and only
//! if *all* are allowed writes the charged states back; otherwise it writes nothing. That is
//! [`mcp_ratelimit_core::store::MemoryStore`]'s all-or-nothing rule, kept across instances without a lock.
//! Time is Redis's own (`TIME`), so instances whose clocks disagree still share one clock.
//!
//! **The scripts** live in `crates/redis/src/`, one file per algorithm named after its Rust twin
//! in [`mcp_ratelimit_core::limit`] (`token_bucket.lua` beside `token_bucket.rs`), plus `prelude.lua` (exact
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
//! a cost above a limiter's capacity (the [`mcp_ratelimit_core::limit::Algorithm`] precondition), or a clock
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
//! **In-flight slots** ([`mcp_ratelimit_core::limit::Concurrency`]) are *leases*: each admission that takes
//! slots names a lease (a random id of its instance's choosing) that lasts `lease` (default
//! 30 s); the instance renews the leases it still holds ([`RedisStore::renew`], one script for
//! all of them) and gives them back when the work ends ([`RedisStore::release`]). A server that
//! dies holding slots stops renewing, and its slots come back when the leases run out, instead of
//! leaking for ever. Decisions are those of the Rust twin as long as no lease expires.
//!
//! **A learnt limit** (the upstream account's slots, learnt from its answers:
//! [`mcp_ratelimit_core::limit::adaptive`]) is one key every instance learns into (`learn.lua`, one script per
//! answer) and claims under: a decision under it (`decide.lua` with the learner named) reads it in
//! the same script as the account's in-flight checks and scales their capacity to it. Its state
//! is floating point, like its Rust twin's, written so it reads back to the same double
//! (`adaptive.lua` says why that is exact); the key is kept an hour past its last use.
//!
//! **Keys** are used exactly as the checks name them. A Redis Cluster runs a script only on keys
//! of one hash slot, so every key of one call must carry the same hash tag (`{t:acme}caller:x`,
//! `{t:acme}tenant:acme`), as [`mcp_ratelimit_core::guard`]'s scopes do; a call that mixes slots is refused
//! by Redis and comes back as [`StoreError::KeysApart`]. Renewing leases, the one call that
//! gathers keys of many callers, is sent as one script per slot.
//!
//! **Connection.** To one Redis (`redis://`, or `rediss://` over TLS): one [`ConnectionManager`](::redis::aio::ConnectionManager),
//! a single multiplexed, pipelined connection that every decision shares and that reconnects by
//! itself. To a cluster (`redis+cluster://host1:port1,host2:port2` or `rediss+cluster://…`, or
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

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use ::redis::cluster_routing::Slot;
use ::redis::{ErrorKind, RedisError, RedisResult, Script, ServerErrorKind, TlsCertificates};

use mcp_ratelimit_core::clock::Nanos;
use mcp_ratelimit_core::guard::loops::{Pattern, Streaked};
use mcp_ratelimit_core::limit::{Adjustment, Decision, Limiter, Shape};
use mcp_ratelimit_core::store::{Check, LearntAt, Lease, LoopAnswered, LoopCall, SharedLimit, StoreError, Verdict};

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

/// The decide script: the prelude, every algorithm, the learnt limits, the loop history, then the
/// entry point.
const DECIDE_SCRIPT: &str = mcp_ratelimit_core::limit::registry!(
    with_every_algorithm,
    "adaptive.lua",
    "adaptive/aimd.lua",
    "adaptive/gradient2.lua",
    "loop_history.lua",
    "decide.lua"
);

/// The learn script: the prelude, in-flight slots (to count what is in use), the learnt limits
/// (every learner's twin, as in [`DECIDE_SCRIPT`]), then the entry point.
const LEARN_SCRIPT: &str = concat!(
    include_str!("prelude.lua"),
    include_str!("concurrency.lua"),
    include_str!("adaptive.lua"),
    include_str!("adaptive/aimd.lua"),
    include_str!("adaptive/gradient2.lua"),
    include_str!("learn.lua"),
);

/// The release script: the prelude, in-flight slots, then the entry point.
const RELEASE_SCRIPT: &str =
    concat!(include_str!("prelude.lua"), include_str!("concurrency.lua"), include_str!("release.lua"),);

/// The renew script: the prelude, in-flight slots, then the entry point.
const RENEW_SCRIPT: &str =
    concat!(include_str!("prelude.lua"), include_str!("concurrency.lua"), include_str!("renew.lua"),);

/// The adjust script (refunds and settlements): the prelude, every algorithm, then the entry point.
const ADJUST_SCRIPT: &str = mcp_ratelimit_core::limit::registry!(with_every_algorithm, "adjust.lua");

/// The record script: a shared record that a final or newer one is never replaced by.
const RECORD_SCRIPT: &str = include_str!("record.lua");

/// The loop answer script: the prelude, the loop history, then the entry point.
const LOOP_ANSWER_SCRIPT: &str =
    concat!(include_str!("prelude.lua"), include_str!("loop_history.lua"), include_str!("loop_answer.lua"));

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

/// The longest bucket (capacity × period) or window, in ns, the scripts decide exactly: two of
/// them added still fit in the 53 bits of a Lua number's integer range.
const MAX_SPAN: Nanos = 1 << 52;

/// Integers the scripts hold exactly (a clock reading in microseconds must stay below).
const MAX_EXACT: u64 = 1 << 53;

/// `signature` as 32 lowercase hex digits, without an allocation (a call's loop signature, as
/// the loop history keeps it).
fn hex(signature: u128) -> [u8; 32] {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = [0u8; 32];
    for (i, digit) in out.iter_mut().enumerate() {
        *digit = DIGITS[((signature >> (4 * (31 - i))) & 0xf) as usize];
    }
    out
}

/// A clock reading in whole epoch microseconds below 2^53, as the scripts read time.
fn micros(now: Nanos) -> Result<u64, StoreError> {
    if !now.is_multiple_of(1_000) || now / 1_000 >= MAX_EXACT {
        return Err(StoreError::OutOfRange(format!(
            "clock reading {now} ns: the Redis store reads time in whole microseconds below 2^53"
        )));
    }
    Ok(now / 1_000)
}

/// Values in the script's reply per check: allowed, limit, remaining, retry_after, reset_after.
const REPLY_FIELDS: usize = 5;

mod connection;
mod learner;
mod line;
mod listen;
mod shared;

use learner::learnt_ttl_ms;

use connection::{Connection, Target};

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
    /// a schedule ([`Slots::renew_leases`](mcp_ratelimit_core::store::Slots::renew_leases)) until given back.
    held: std::sync::Mutex<Held>,
    /// A client of one node, for subscriptions ([`Broadcast::hear`](mcp_ratelimit_core::store::Broadcast::hear)).
    /// Its URL may carry a password: never printed.
    listener: ::redis::Client,
}

/// The leases an instance holds: (key, lease) → (units, the key's cap).
type Held = HashMap<(String, Lease), (u64, u64)>;

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
            Script::new(DECIDE_SCRIPT),
            Script::new(RELEASE_SCRIPT),
            Script::new(RENEW_SCRIPT),
            Script::new(ADJUST_SCRIPT),
            Script::new(RECORD_SCRIPT),
            Script::new(LEARN_SCRIPT),
            Script::new(line::LINE_SCRIPT),
            Script::new(LOOP_ANSWER_SCRIPT),
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
        })
    }

    /// Checks that `url` has one of the forms [`RedisStore::connect`] takes, without connecting:
    /// for config validation. The error never shows a password.
    pub fn check_url(url: &str) -> Result<(), StoreError> {
        Target::parse(url).map(drop)
    }

    /// This store with leases on in-flight slots lasting `lease` unless renewed (at least a
    /// millisecond, and at most [`mcp_ratelimit_core::clock::LONGEST_WAIT`], which the scripts still add to
    /// their clock exactly).
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease.clamp(Duration::from_millis(1), mcp_ratelimit_core::clock::LONGEST_WAIT);
        self
    }

    /// How long a lease on in-flight slots lasts unless renewed.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// Decides every check atomically in ONE script call (one round trip), time from Redis TIME.
    ///
    /// One decision per check, in order; the states are charged only when every decision is
    /// `allowed`.
    pub async fn decide(&self, checks: &[Check<'_>]) -> Result<Vec<Decision>, StoreError> {
        self.run(checks, None, Lease::new()).await
    }

    /// [`RedisStore::decide`], with any in-flight slots taken under `lease` (to renew and release
    /// them by), at an explicit clock reading when `now` is given (see [`RedisStore::decide_at`]).
    pub async fn decide_leased(
        &self,
        checks: &[Check<'_>],
        lease: Lease,
        now: Option<Nanos>,
    ) -> Result<Vec<Decision>, StoreError> {
        let now_us = now.map(micros).transpose()?;
        self.run(checks, now_us, lease).await
    }

    /// The same with an explicit clock reading (epoch nanoseconds, a multiple of 1000): for
    /// tests that walk time, and parity with the Rust algorithms.
    ///
    /// TTLs are set as if Redis's clock stood at `now`: a key written at a `now` ahead of Redis
    /// still expires one TTL after the write.
    pub async fn decide_at(&self, checks: &[Check<'_>], now: Nanos) -> Result<Vec<Decision>, StoreError> {
        self.run(checks, Some(micros(now)?), Lease::new()).await
    }

    /// [`LoopHistory::decide_after_loop_check`](mcp_ratelimit_core::store::LoopHistory::decide_after_loop_check)
    /// at an explicit clock reading (see [`RedisStore::decide_at`]).
    pub async fn decide_after_loop_check_at(
        &self,
        call: LoopCall<'_>,
        checks: &[Check<'_>],
        blocks: &[&str],
        now: Nanos,
    ) -> Result<Verdict, StoreError> {
        self.run_unless_blocked(checks, blocks, Some(call), Some(micros(now)?), Lease::new()).await
    }

    /// Gives back the in-flight slots `lease` holds on `key`, when the work ends. A lease that is
    /// gone already (expired, or given back) has nothing to give back.
    pub async fn release(&self, key: &str, lease: Lease) -> Result<(), StoreError> {
        let mut invocation = self.release.key(key);
        invocation.arg(lease.id()).arg(u64::try_from(self.lease.as_micros()).unwrap_or(u64::MAX));
        let _in_flight: i64 = bounded(&self.address, self.timeout, self.connection.invoke(&invocation)).await?;
        Ok(())
    }

    /// Extends every lease in `held` by another lease duration, in one script (on a cluster, one
    /// per hash slot, side by side), and says what became of each, in order. A lease that
    /// expired meanwhile is taken again, as its work still runs, if its key's cap has room; one
    /// given back meanwhile is never taken again.
    pub async fn renew(&self, held: &[HeldLease<'_>]) -> Result<Vec<Renewed>, StoreError> {
        let batches: Vec<Vec<usize>> = match self.connection {
            Connection::Node(_) => vec![(0..held.len()).collect()],
            // A cluster runs one script on one slot's keys only; leases of many callers span many.
            Connection::Cluster(_) => {
                let mut by_slot: HashMap<Slot, Vec<usize>> = HashMap::new();
                for (i, lease) in held.iter().enumerate() {
                    by_slot.entry(Slot::for_key(lease.key)).or_default().push(i);
                }
                by_slot.into_values().collect()
            }
        };
        let renewing = batches.iter().filter(|batch| !batch.is_empty()).map(|batch| self.renew_batch(held, batch));
        let mut answers = vec![Renewed::Renewed; held.len()];
        for (batch, statuses) in batches.iter().zip(futures::future::try_join_all(renewing).await?) {
            for (&i, status) in batch.iter().zip(statuses) {
                answers[i] = status;
            }
        }
        Ok(answers)
    }

    /// [`RedisStore::renew`] for the leases at `indices` of `held`, whose keys share a slot.
    async fn renew_batch(&self, held: &[HeldLease<'_>], indices: &[usize]) -> Result<Vec<Renewed>, StoreError> {
        let mut invocation = self.renew.prepare_invoke();
        invocation.arg(u64::try_from(self.lease.as_micros()).unwrap_or(u64::MAX));
        for lease in indices.iter().filter_map(|&i| held.get(i)) {
            invocation.key(lease.key).arg(lease.lease.id()).arg(lease.units).arg(lease.capacity);
        }
        let statuses: Vec<i64> = bounded(&self.address, self.timeout, self.connection.invoke(&invocation)).await?;
        if statuses.len() != indices.len() {
            return Err(self.malformed(format!(
                "renew.lua answered {} statuses for {} leases",
                statuses.len(),
                indices.len()
            )));
        }
        statuses
            .into_iter()
            .map(|status| match status {
                0 => Ok(Renewed::Renewed),
                1 => Ok(Renewed::Retaken),
                2 => Ok(Renewed::GivenBack),
                3 => Ok(Renewed::Lost),
                other => Err(self.malformed(format!("renew.lua answered status {other}"))),
            })
            .collect()
    }

    /// Checks a caller's call (its `signature`) against the history under `key`, as
    /// [`mcp_ratelimit_core::guard::loops::LoopDetector::check`] does, and records it if it is not a loop;
    /// at an explicit clock reading when `now` is given. The very script a call's decision runs
    /// ([`LoopHistory::decide_after_loop_check`](mcp_ratelimit_core::store::LoopHistory::decide_after_loop_check)),
    /// with nothing else to decide.
    pub async fn loop_check(&self, call: LoopCall<'_>, now: Option<Nanos>) -> Result<LoopAnswer, StoreError> {
        let now_us = now.map(micros).transpose()?;
        match self.run_unless_blocked(&[], &[], Some(call), now_us, Lease::new()).await? {
            Verdict::Looping { retry_after, pattern } => Ok(LoopAnswer::Looping { retry_after, pattern }),
            Verdict::Decided(_) => Ok(LoopAnswer::Recorded),
            Verdict::Blocked { .. } => Err(self.malformed("a block answered a loop check that named none".into())),
        }
    }

    /// Hears the answer a checked call got, as
    /// [`mcp_ratelimit_core::guard::loops::LoopDetector::answered`] does (`loop_answer.lua`); at an
    /// explicit clock reading when `now` is given.
    pub async fn loop_answered(&self, heard: LoopAnswered<'_>, now: Option<Nanos>) -> Result<Streaked, StoreError> {
        let now_us = now.map(micros).transpose()?;
        let mut invocation = self.loop_answer.key(heard.key);
        invocation.arg(now_us.map_or_else(String::new, |us| us.to_string()));
        invocation.arg(heard.window.div_ceil(1_000)).arg(heard.repeats.max(2));
        let (signature, tool, answer) = (hex(heard.signature), hex(heard.tool_signature), hex(heard.answer));
        let said = |h: &[u8; 32]| String::from_utf8_lossy(h).into_owned();
        invocation.arg(format!("{} {} {} {}", said(&signature), said(&tool), said(&answer), heard.no_progress));
        let reply: Vec<i64> = bounded(&self.address, self.timeout, self.connection.invoke(&invocation)).await?;
        match reply[..] {
            [same, stopped_for_us] => Ok(Streaked {
                same: u32::try_from(same).unwrap_or(u32::MAX).max(1),
                stopped_for: (stopped_for_us > 0)
                    .then(|| u64::try_from(stopped_for_us).unwrap_or(0).saturating_mul(1_000)),
            }),
            _ => Err(self.malformed(format!("loop_answer.lua answered {reply:?}"))),
        }
    }

    /// Writes `value` under `key` for `ttl`: a record every instance may read (a job's state).
    pub async fn put(&self, key: &str, value: &str, ttl: Duration) -> Result<(), StoreError> {
        let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
        let mut command = ::redis::cmd("SET");
        command.arg(key).arg(value).arg("PX").arg(ms);
        let _: () = bounded(&self.address, self.timeout, self.connection.query(&command)).await?;
        Ok(())
    }

    /// Writes the record `value` (a JSON object with `version` and `final` fields) under `key`
    /// for `ttl`, unless the record there must stand: one that is final, or of a higher version
    /// than `version` (`record.lua`). Returns whether it was written.
    pub async fn put_record(&self, key: &str, value: &str, version: u64, ttl: Duration) -> Result<bool, StoreError> {
        let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
        let mut invocation = self.record.key(key);
        invocation.arg(value).arg(version).arg(ms);
        let written: i64 = bounded(&self.address, self.timeout, self.connection.invoke(&invocation)).await?;
        Ok(written == 1)
    }

    /// What [`RedisStore::put`] or [`RedisStore::put_record`] wrote under `key`, if it is still there.
    pub async fn get(&self, key: &str) -> Result<Option<String>, StoreError> {
        let mut command = ::redis::cmd("GET");
        command.arg(key);
        bounded(&self.address, self.timeout, self.connection.query(&command)).await
    }

    /// Adds `member` to the set at `key`, which is kept `ttl` past its latest addition.
    pub async fn set_add(&self, key: &str, member: &str, ttl: Duration) -> Result<(), StoreError> {
        let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
        let mut script = ::redis::cmd("EVAL");
        // One call (a pipeline of two could be split by a failover): add, then keep.
        script.arg("redis.call('SADD', KEYS[1], ARGV[1]) return redis.call('PEXPIRE', KEYS[1], ARGV[2])");
        script.arg(1).arg(key).arg(member).arg(ms);
        let _: i64 = bounded(&self.address, self.timeout, self.connection.query(&script)).await?;
        Ok(())
    }

    /// The members of the set at `key` (none when it is gone).
    pub async fn set_members(&self, key: &str) -> Result<Vec<String>, StoreError> {
        let mut command = ::redis::cmd("SMEMBERS");
        command.arg(key);
        bounded(&self.address, self.timeout, self.connection.query(&command)).await
    }

    /// Removes `members` from the set at `key`.
    pub async fn set_remove(&self, key: &str, members: &[String]) -> Result<(), StoreError> {
        if members.is_empty() {
            return Ok(());
        }
        let mut command = ::redis::cmd("SREM");
        command.arg(key).arg(members);
        let _: i64 = bounded(&self.address, self.timeout, self.connection.query(&command)).await?;
        Ok(())
    }

    async fn run(&self, checks: &[Check<'_>], now_us: Option<u64>, lease: Lease) -> Result<Vec<Decision>, StoreError> {
        match self.run_unless_blocked(checks, &[], None, now_us, lease).await? {
            Verdict::Decided(decisions) => Ok(decisions),
            Verdict::Blocked { .. } => Err(self.malformed("a block answered a decision that named none".into())),
            Verdict::Looping { .. } => Err(self.malformed("a loop answered a decision that checked none".into())),
        }
    }

    /// [`RedisStore::decide_leased`], unless one of `blocks` (keys an operator set with
    /// [`RedisStore::block`]) still exists, after checking `looped` against its loop history:
    /// all read in the same script, so neither a block nor a loop check costs a round trip
    /// ([`Budgets::decide`](mcp_ratelimit_core::store::Budgets::decide),
    /// [`LoopHistory`](mcp_ratelimit_core::store::LoopHistory)). The block keys and the history must share
    /// the checks' hash tag.
    async fn run_unless_blocked(
        &self,
        checks: &[Check<'_>],
        blocks: &[&str],
        looped: Option<LoopCall<'_>>,
        now_us: Option<u64>,
        lease: Lease,
    ) -> Result<Verdict, StoreError> {
        Ok(self.run_script(checks, blocks, looped, None, now_us, lease).await?.0)
    }

    /// [`RedisStore::run_unless_blocked`], with the in-flight checks decided under the learnt
    /// limit `under` names when there is one (read in the same script, its key last), and what
    /// that limit stood at.
    ///
    /// Cancel-safe: the in-flight slots the script may take under `lease` are owned by a guard
    /// from the moment it is sent ([`Unanswered`]). Dropped before its answer (its caller was
    /// cancelled) or failed (timed out: Redis may run it all the same), the decision gives them
    /// back; only an answer in hand hands them to the caller, who holds them by [`SlotGuard`]s
    /// made in the same step.
    ///
    /// [`SlotGuard`]: mcp_ratelimit_core::store::SlotGuard
    async fn run_script(
        &self,
        checks: &[Check<'_>],
        blocks: &[&str],
        looped: Option<LoopCall<'_>>,
        under: Option<LearntAt<'_>>,
        now_us: Option<u64>,
        lease: Lease,
    ) -> Result<(Verdict, Option<SharedLimit>), StoreError> {
        let unanswered = Unanswered::of(self, checks, lease);
        let answer = self.ask_script(checks, blocks, looped, under, now_us, lease).await;
        if answer.is_ok() {
            unanswered.answered();
        }
        answer
    }

    /// [`RedisStore::run_script`]'s round trip.
    async fn ask_script(
        &self,
        checks: &[Check<'_>],
        blocks: &[&str],
        looped: Option<LoopCall<'_>>,
        under: Option<LearntAt<'_>>,
        now_us: Option<u64>,
        lease: Lease,
    ) -> Result<(Verdict, Option<SharedLimit>), StoreError> {
        if checks.is_empty() && looped.is_none() && under.is_none() {
            return Ok((Verdict::Decided(Vec::new()), None));
        }
        let mut invocation = self.decide.prepare_invoke();
        invocation.arg(now_us.map_or_else(String::new, |us| us.to_string()));
        invocation.arg(lease.id()).arg(u64::try_from(self.lease.as_micros()).unwrap_or(u64::MAX));
        match &looped {
            Some(call) => {
                let (signature, tool) = (hex(call.signature), hex(call.tool_signature));
                let said = |h: &[u8; 32]| String::from_utf8_lossy(h).into_owned();
                invocation.arg(call.window.div_ceil(1_000)).arg(call.repeats).arg(format!(
                    "{} {}",
                    said(&signature),
                    said(&tool)
                ))
            }
            None => invocation.arg("").arg("").arg(""),
        };
        match &under {
            Some(at) => {
                invocation.arg(format!("{} {} {}", at.ceiling.max(1), learnt_ttl_ms(), learner::spec(at.learner)))
            }
            None => invocation.arg(""),
        };
        for check in checks {
            invocation.key(check.key).arg(check.limiter.algorithm()).arg(check.limiter.capacity());
            invocation.arg(script_span(check)?).arg(check.cost).arg(u8::from(check.shadow));
        }
        for block in blocks {
            invocation.key(*block);
        }
        if let Some(call) = &looped {
            invocation.key(call.key);
        }
        if let Some(at) = &under {
            invocation.key(at.key);
        }
        let mut reply: Vec<i64> = bounded(&self.address, self.timeout, self.connection.invoke(&invocation)).await?;
        if let [-2, retry_after_us, pattern] = reply[..] {
            let retry_after = u64::try_from(retry_after_us).unwrap_or(0).saturating_mul(1_000);
            return Ok((Verdict::Looping { retry_after, pattern: Pattern::from_code(pattern) }, None));
        }
        if let [-1, place, left_ms] = reply[..] {
            let index = usize::try_from(place - 1).ok().filter(|i| *i < blocks.len());
            let index = index.ok_or_else(|| self.malformed(format!("block reply {reply:?}")))?;
            let left = u64::try_from(left_ms).unwrap_or(0).saturating_mul(mcp_ratelimit_core::clock::NANOS_PER_MS);
            return Ok((Verdict::Blocked { index, left }, None));
        }
        // Last, the script's clock: when every charge of the call landed.
        let at = self.clock_of(reply.pop())?;
        let limit = match under {
            Some(_) => {
                let Some(current) = reply.pop() else {
                    return Err(self.malformed("a decision under a learnt limit answered without it".into()));
                };
                let current =
                    u64::try_from(current).map_err(|_| self.malformed(format!("negative value {current}")))?;
                Some(SharedLimit { current, at })
            }
            None => None,
        };
        Ok((Verdict::Decided(self.decisions(&reply, checks.len(), at)?), limit))
    }

    fn malformed(&self, reason: String) -> StoreError {
        StoreError::Failed { store: STORE, address: self.address.clone(), reason }
    }

    /// The clock reading a script ends its reply with (epoch microseconds), in nanoseconds.
    fn clock_of(&self, now_us: Option<i64>) -> Result<Nanos, StoreError> {
        let now_us = now_us.ok_or_else(|| self.malformed("a reply without the script's clock".into()))?;
        let now_us = u64::try_from(now_us).map_err(|_| self.malformed(format!("clock reading {now_us}")))?;
        Ok(now_us.saturating_mul(1_000))
    }

    /// Adjusts each budget under its key as its [`Adjustment`] says
    /// ([`mcp_ratelimit_core::store::Budgets::adjust`]; `adjust.lua`), at most once while the mark under `once`
    /// lives ([`mcp_ratelimit_core::store::MARK_LIVES`]), at an explicit clock reading when `now` is given.
    /// Returns each budget's level after it, as a cost-0 decision. The keys (and the mark's) must
    /// share a hash tag on a cluster (one script).
    pub async fn adjust(
        &self,
        budgets: &[(&str, &Limiter, Adjustment)],
        once: Option<&str>,
        now: Option<Nanos>,
    ) -> Result<Vec<Decision>, StoreError> {
        if budgets.is_empty() {
            return Ok(Vec::new());
        }
        let mut invocation = self.adjust.prepare_invoke();
        invocation.arg(now.map(micros).transpose()?.map_or_else(String::new, |us| us.to_string()));
        let mark_ms = once.map_or(0, |_| mcp_ratelimit_core::store::MARK_LIVES.as_millis());
        invocation.arg(mark_ms.to_string());
        for &(key, limiter, by) in budgets {
            let span = script_span(&Check { key, limiter, cost: 0, shadow: false })?;
            invocation.key(key).arg(limiter.algorithm()).arg(limiter.capacity()).arg(span);
            // A charge's instant was a reading of the script's clock: whole microseconds.
            let (how, units, (taken_us, reset_after)) = match by {
                Adjustment::Refund(units) => ("refund", units, (0, 0)),
                Adjustment::Charge(units) => ("charge", units, (0, 0)),
                Adjustment::Return { units, taken } => ("return", units, (micros(taken.at)?, taken.reset_after)),
            };
            invocation.arg(how).arg(units).arg(taken_us).arg(reset_after.min(MAX_SPAN));
        }
        if let Some(mark) = once {
            invocation.key(mark);
        }
        let mut reply: Vec<i64> = bounded(&self.address, self.timeout, self.connection.invoke(&invocation)).await?;
        let at = self.clock_of(reply.pop())?;
        self.decisions(&reply, budgets.len(), at)
    }

    /// Deletes `keys` (one `DEL`: on a cluster they must share a hash tag); returns how many were
    /// there.
    pub async fn forget(&self, keys: &[&str]) -> Result<u64, StoreError> {
        if keys.is_empty() {
            return Ok(0);
        }
        let mut command = ::redis::cmd("DEL");
        command.arg(keys);
        bounded(&self.address, self.timeout, self.connection.query(&command)).await
    }

    /// Sets the operator block `key` for `duration`, which [`Budgets::decide`](mcp_ratelimit_core::store::Budgets::decide) honours on every
    /// instance.
    pub async fn block(&self, key: &str, duration: Duration) -> Result<(), StoreError> {
        self.put(key, "blocked", duration).await
    }

    /// How long the block `key` still holds, if it does.
    pub async fn block_left(&self, key: &str) -> Result<Option<Nanos>, StoreError> {
        let mut command = ::redis::cmd("PTTL");
        command.arg(key);
        let left: i64 = bounded(&self.address, self.timeout, self.connection.query(&command)).await?;
        Ok(u64::try_from(left)
            .ok()
            .filter(|ms| *ms > 0)
            .map(|ms| ms.saturating_mul(mcp_ratelimit_core::clock::NANOS_PER_MS)))
    }

    /// Adds one to the counter at `key` and returns it (a signal every instance can watch).
    pub async fn bump(&self, key: &str) -> Result<u64, StoreError> {
        let mut command = ::redis::cmd("INCR");
        command.arg(key);
        bounded(&self.address, self.timeout, self.connection.query(&command)).await
    }

    /// The counter at `key` (0 when there is none).
    pub async fn counter(&self, key: &str) -> Result<u64, StoreError> {
        Ok(self.get(key).await?.and_then(|v| v.parse().ok()).unwrap_or(0))
    }

    /// Reads the script's reply: [`REPLY_FIELDS`] integers per check, decided `at`.
    fn decisions(&self, reply: &[i64], checks: usize, at: Nanos) -> Result<Vec<Decision>, StoreError> {
        let malformed = |what: String| StoreError::Failed { store: STORE, address: self.address.clone(), reason: what };
        if reply.len() != checks * REPLY_FIELDS {
            return Err(malformed(format!("{} values in the reply for {checks} checks", reply.len())));
        }
        let unsigned = |v: i64| u64::try_from(v).map_err(|_| malformed(format!("negative value {v} in the reply")));
        reply
            .chunks_exact(REPLY_FIELDS)
            .map(|d| {
                Ok(Decision {
                    allowed: d[0] == 1,
                    limit: unsigned(d[1])?,
                    remaining: unsigned(d[2])?,
                    retry_after: unsigned(d[3])?,
                    reset_after: unsigned(d[4])?,
                    at,
                })
            })
            .collect()
    }
}

/// The span the scripts take for a check's limiter (a bucket's period, a window's length, 0 for
/// in-flight slots), once the check is known to be decidable exactly.
fn script_span(check: &Check<'_>) -> Result<Nanos, StoreError> {
    let limiter = check.limiter;
    let capacity = limiter.capacity();
    let out_of_range =
        |why: String| StoreError::OutOfRange(format!("check on `{}` ({}): {why}", check.key, limiter.describe()));
    if check.cost > capacity {
        return Err(out_of_range(format!("cost {} is above its capacity {capacity}", check.cost)));
    }
    if capacity > MAX_SPAN || limiter.policy_window().unwrap_or(0) > MAX_SPAN {
        return Err(out_of_range(format!(
            "its bucket or window exceeds {} days, the most the Redis store decides exactly",
            MAX_SPAN / (86_400 * mcp_ratelimit_core::clock::NANOS_PER_SEC)
        )));
    }
    Ok(match limiter.shape() {
        Shape::Rate { period } => period,
        Shape::Window { window } => window,
        Shape::Slots => 0,
    })
}

/// Runs one Redis call under the store timeout, naming what went wrong in terms a user can act
/// on.
/// The in-flight slots a decision in flight may take under its lease, on the keys it names:
/// given back if it is dropped before [`Unanswered::answered`] — the decision was cancelled, or
/// failed without an answer that says what it took. Giving a lease back is safe whether or not
/// the script ran: `release.lua` takes only that lease's units, and leaves a tombstone a late
/// renewal cannot revive. (The release goes on the same connection after the decision, so Redis
/// runs it after.)
struct Unanswered {
    /// The keys to give back on, while armed; `None` for a decision that can take no slot.
    release: Option<(GiveBack, Vec<String>)>,
    lease: Lease,
}

impl Unanswered {
    fn of(store: &RedisStore, checks: &[Check<'_>], lease: Lease) -> Self {
        let keys: Vec<String> =
            checks.iter().filter(|c| c.cost > 0 && c.limiter.holds_slots()).map(|c| c.key.to_owned()).collect();
        let release = (!keys.is_empty()).then(|| (GiveBack::of(store), keys));
        Self { release, lease }
    }

    /// The answer is in hand: what it took is the caller's to hold now.
    fn answered(mut self) {
        self.release = None;
    }
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        if let Some((give_back, keys)) = self.release.take() {
            give_back.spawn(keys, self.lease);
        }
    }
}

/// What giving a lease back takes, owned, so it can run in a task of its own (from `Drop`).
struct GiveBack {
    connection: Connection,
    script: Script,
    address: String,
    timeout: Duration,
    lease: Duration,
    /// A channel the release says so on, when it gives slots back (`release.lua`).
    tell: Option<String>,
}

/// The first pause before a release Redis did not take is tried again; it doubles.
const RELEASE_PAUSE: Duration = Duration::from_millis(100);

impl GiveBack {
    fn of(store: &RedisStore) -> Self {
        Self {
            connection: store.connection.clone(),
            script: store.release.clone(),
            address: store.address.clone(),
            timeout: store.timeout,
            lease: store.lease,
            tell: None,
        }
    }

    /// This release, said on `channel` when it gives slots back.
    fn telling(self, channel: &str) -> Self {
        Self { tell: Some(channel.to_owned()), ..self }
    }

    /// Gives back `lease`'s slots on every one of `keys` in a task of its own, trying each again
    /// (a growing pause, up to a second) while Redis does not take it — a restart, a slow link
    /// — for as long as the lease would hold them: after that it has run out by itself. Every
    /// try is safe to repeat (`release.lua` takes that lease's units, once).
    fn spawn(self, keys: Vec<String>, lease: Lease) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(target: "mcp_ratelimit::store::redis", "in-flight slots were released outside the runtime: their lease will run out");
            return;
        };
        runtime.spawn(async move {
            let lease_us = u64::try_from(self.lease.as_micros()).unwrap_or(u64::MAX);
            let give_up_at = tokio::time::Instant::now() + self.lease;
            for key in &keys {
                let mut pause = RELEASE_PAUSE;
                loop {
                    let mut invocation = self.script.key(key);
                    invocation.arg(lease.id()).arg(lease_us);
                    if let Some(channel) = &self.tell {
                        invocation.arg(channel);
                    }
                    let given: Result<i64, StoreError> =
                        bounded(&self.address, self.timeout, self.connection.invoke(&invocation)).await;
                    let Err(error) = given else { break };
                    if tokio::time::Instant::now() + pause >= give_up_at {
                        tracing::warn!(target: "mcp_ratelimit::store::redis", %error, "could not give in-flight slots back to Redis: their lease will run out");
                        break;
                    }
                    tokio::time::sleep(pause).await;
                    pause = pause.saturating_mul(2).min(Duration::from_secs(1));
                }
            }
        });
    }
}

async fn bounded<T>(
    address: &str,
    timeout: Duration,
    call: impl Future<Output = RedisResult<T>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(timeout, call).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(classify(address, timeout, e)),
        Err(_) => Err(StoreError::Timeout { store: STORE, address: address.to_owned(), timeout }),
    }
}

fn classify(address: &str, timeout: Duration, e: RedisError) -> StoreError {
    let address = address.to_owned();
    if e.kind() == ErrorKind::Server(ServerErrorKind::CrossSlot) {
        StoreError::KeysApart { store: STORE, address }
    } else if e.kind() == ErrorKind::InvalidClientConfig {
        invalid_url(e.to_string())
    } else if e.is_timeout() {
        StoreError::Timeout { store: STORE, address, timeout }
    } else if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() {
        unreachable(address, e.to_string())
    } else {
        StoreError::Failed { store: STORE, address, reason: e.to_string() }
    }
}

/// What this backend is called in its errors.
const STORE: &str = "Redis";

/// Redis at `address` cannot be reached, with what to look at.
fn unreachable(address: String, reason: String) -> StoreError {
    StoreError::Unreachable {
        store: STORE,
        address,
        reason: format!("{reason}. Is redis-server running there and reachable from this host?"),
    }
}

/// A Redis URL that cannot be used: `why`, and the forms a URL takes.
fn invalid_url(why: String) -> StoreError {
    StoreError::InvalidAddress(format!(
        "the Redis URL is not valid ({why}); expected redis://[:password@]host[:port][/db] (rediss:// for TLS) for \
         one server, or redis+cluster://[:password@]host1:port1,host2:port2,... (rediss+cluster:// for TLS; or \
         redis:// URLs separated by commas) for the nodes of a Redis Cluster"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use mcp_ratelimit_core::limit::{FixedWindow, TokenBucket};

    #[test]
    fn checks_beyond_exact_integers_are_refused_before_sending() {
        let year = Limiter::FixedWindow(FixedWindow::new(10, 365 * 86_400 * mcp_ratelimit_core::clock::NANOS_PER_SEC));
        let e = script_span(&Check { key: "k", limiter: &year, cost: 1, shadow: false })
            .expect_err("a year is beyond 2^52 ns");
        assert!(e.to_string().contains("52 days"), "{e}");
        let bucket = Limiter::TokenBucket(TokenBucket::new(5, 1.0));
        let e = script_span(&Check { key: "k", limiter: &bucket, cost: 6, shadow: false })
            .expect_err("cost above capacity");
        assert!(e.to_string().contains("cost 6 is above its capacity 5"), "{e}");
        assert_eq!(
            script_span(&Check { key: "k", limiter: &bucket, cost: 5, shadow: false }).ok(),
            Some(mcp_ratelimit_core::clock::NANOS_PER_SEC)
        );
    }

    #[test]
    fn a_cluster_url_names_its_seed_nodes_and_never_its_password() {
        let Ok(Target::Cluster { nodes, address, tls: false }) = Target::parse("redis+cluster://:pw@a:7000,b/0") else {
            panic!("a plain cluster")
        };
        assert_eq!(nodes, ["redis://:pw@a:7000/0", "redis://:pw@b/0"]);
        assert_eq!(address, "a:7000, b:6379 (cluster)");
        assert_eq!(mcp_ratelimit_core::redact::url("redis://user:pw@a:7000/0"), "redis://***@a:7000/0");
        assert_eq!(mcp_ratelimit_core::redact::url("redis://a:7000/x@y"), "redis://a:7000/x@y");
        let e = RedisStore::check_url("redis+cluster://:pw@a:7000,b:x").expect_err("bad port").to_string();
        assert!(e.contains("`redis://***@b:x/`: invalid port number") && !e.contains("pw"), "{e}");
    }

    #[test]
    fn rediss_urls_ask_for_tls_on_every_node_or_none() {
        assert!(matches!(Target::parse("rediss://:pw@a:6380/0"), Ok(Target::Node { tls: true, .. })));
        assert!(matches!(Target::parse("redis://a:6380"), Ok(Target::Node { tls: false, .. })));
        let Ok(Target::Cluster { nodes, tls: true, .. }) = Target::parse("rediss+cluster://:pw@a:7000,b:7001") else {
            panic!("a TLS cluster")
        };
        assert_eq!(nodes, ["rediss://:pw@a:7000/", "rediss://:pw@b:7001/"]);
        let e = RedisStore::check_url("rediss://a:7000,redis://b:7001").expect_err("mixed").to_string();
        assert!(e.contains("all TLS or none"), "{e}");
        let e = RedisStore::check_url("https://a:6379").expect_err("not redis").to_string();
        assert!(e.contains("not redis:// or rediss://"), "{e}");
    }

    #[test]
    fn every_algorithm_has_its_script() {
        for name in mcp_ratelimit_core::limit::ALGORITHMS {
            assert!(DECIDE_SCRIPT.contains(&format!("definitions.{name} = function()")), "no script for {name}");
        }
        for name in mcp_ratelimit_core::limit::adaptive::ALGORITHMS {
            for script in [DECIDE_SCRIPT, LEARN_SCRIPT] {
                assert!(script.contains(&format!("learners.{name} = function(")), "no learner script for {name}");
            }
        }
    }
}
