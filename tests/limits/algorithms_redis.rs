//! Every algorithm against a simple reference model, on the Redis store: the algorithm suite
//! (`common/algorithm_suite.rs`), the very properties `tests/limits/algorithms.rs` proves in
//! memory, run on the Lua scripts through [`RedisStore::decide_leased`] with explicit clock
//! readings, against a real `redis-server` per test (or `REDIS_URL`). Redis's scripts read the
//! clock in microseconds, so arrivals fall on whole microseconds and "one step sooner" is one
//! microsecond. A key is forked with `COPY`, and loses its TTL after every call so that only the
//! explicit clock decides (see [`RedisKey::acquire`]). Fewer cases than in memory: every call is
//! a few round trips.

use std::cell::Cell;
use std::rc::Rc;
use std::time::Duration;

use crate::algorithm_suite;
use crate::algorithm_suite::{Backend, Key};
use crate::test_redis::TestRedis;
use mcp_ratelimit::clock::Nanos;
use mcp_ratelimit::limit::{Adjustment, Decision, Limiter, Taken};
use mcp_ratelimit::store::Check;
use mcp_ratelimit::store::Lease;
use mcp_ratelimit::store::redis::RedisStore;

/// Generous: a loaded CI machine must not turn a slow answer into a failure.
const TIMEOUT: Duration = Duration::from_secs(5);
/// Cases per property (the memory suite runs 300).
const CASES: u32 = 20;
/// Cases of the changed-limits property: its steps are cheap (about 3 s for 100), and seven
/// algorithms share them.
const LIFE_CASES: u32 = 100;

/// A Redis store, and a connection of the test's own to copy, read and pin its keys.
struct Redis(Rc<Connected>);

/// What every key of one test shares.
struct Connected {
    runtime: tokio::runtime::Runtime,
    store: RedisStore,
    admin: redis::aio::MultiplexedConnection,
    /// Keys handed out so far: every key and fork gets a name of its own.
    keys: Cell<u64>,
    /// Declared last so the server outlives the connections to it.
    redis: TestRedis,
}

impl Redis {
    fn start() -> Self {
        let redis = TestRedis::start();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a tokio runtime");
        let (store, admin) = runtime.block_on(async {
            let store = RedisStore::connect(&redis.url, TIMEOUT).await.expect("connects to Redis");
            let client = redis::Client::open(redis.url.as_str()).expect("a Redis URL");
            (store, client.get_multiplexed_async_connection().await.expect("an admin connection"))
        });
        Redis(Rc::new(Connected { runtime, store, admin, keys: Cell::new(0), redis }))
    }
}

impl Connected {
    /// A key name no other key of this test has used.
    fn new_key(&self, limiter: &Limiter) -> String {
        self.keys.set(self.keys.get() + 1);
        self.redis.key(&format!("{}:{}", limiter.algorithm(), self.keys.get()))
    }

    /// Runs a command on the test's own connection.
    fn query<T: redis::FromRedisValue>(&self, command: &redis::Cmd) -> T {
        let mut admin = self.admin.clone();
        self.runtime.block_on(command.query_async(&mut admin)).unwrap_or_else(|e| panic!("{command:?}: {e}"))
    }
}

/// One Redis key under one limiter.
struct RedisKey {
    redis: Rc<Connected>,
    key: String,
    limiter: Limiter,
    /// The key's value after the latest call (none: not written), to put back if that value
    /// expires in real time before its TTL is removed.
    value: Option<String>,
    /// The lease of every admitted call still holding in-flight slots, latest last.
    held: Vec<(Lease, u64)>,
}

impl Backend for Redis {
    type Key = RedisKey;

    fn longest_span(&self) -> u64 {
        1 << 52
    }

    fn resolution(&self) -> u64 {
        1_000
    }

    fn start(&self, limiter: &Limiter, _now: u64) -> RedisKey {
        // A key Redis has never seen is fresh at any time.
        let key = self.0.new_key(limiter);
        RedisKey { redis: self.0.clone(), key, limiter: limiter.clone(), value: None, held: vec![] }
    }
}

/// How many times a call is decided again after losing its state to Redis's clock (see
/// [`RedisKey::acquire`]) before the test gives up.
const ATTEMPTS: usize = 100;

impl Key for RedisKey {
    /// The key's value as the scripts wrote it (none: never written, or forgotten).
    type State = Option<String>;

    /// Test-only: Redis expires a key on its own clock, `forget_at` (rounded up to the
    /// millisecond) after the write, while this suite walks an explicit clock that stands still
    /// or leaps ahead, so a key a millisecond from being forgotten could vanish in real time
    /// before the next call, which the explicit clock places before `forget_at`. Every call is
    /// therefore followed by PERSIST, which removes the TTL, so decisions depend on the explicit
    /// clock alone (that TTLs are right is proven in `tests/limits/redis_store.rs`). PERSIST can
    /// only be sent once the decision is back, and on a loaded machine that takes longer than a
    /// millisecond now and then: a charged key that expired meanwhile is put back as it was
    /// before the call, and the call decided again, which must give the same decision.
    fn acquire(&mut self, now: u64, cost: u64) -> Decision {
        let redis = &*self.redis;
        let lease = Lease::new();
        // In-flight slots have no clock, but their leases run on Redis's own, which the release
        // script reads: they are taken on it too (a lease lasts 30 s, far longer than a case).
        let at = (!self.limiter.holds_slots()).then_some(Nanos::new(now));
        let mut first: Option<Decision> = None;
        for _ in 0..ATTEMPTS {
            let check = Check { key: &self.key, limiter: &self.limiter, cost, shadow: false };
            let mut decision = match redis.runtime.block_on(redis.store.decide_leased(&[check], lease, at)).as_deref() {
                Ok([decision]) => *decision,
                other => panic!("{} at {now} ns, cost {cost}: {other:?}", self.limiter.describe()),
            };
            // Slots were decided on Redis's own clock; the suite's is the one its properties
            // speak of.
            decision.at = Nanos::new(now);
            assert_eq!(*first.get_or_insert(decision), decision, "{}: the same call decided twice", self.key);
            let mut pinned = redis::pipe();
            pinned.cmd("PERSIST").arg(&self.key).cmd("GET").arg(&self.key);
            let mut admin = redis.admin.clone();
            let (persisted, value): (i64, Option<String>) =
                redis.runtime.block_on(pinned.query_async(&mut admin)).expect("PERSIST and GET");
            // Every charged state is written with a TTL, which PERSIST finds unless it ran out.
            if decision.allowed && cost > 0 && persisted == 0 {
                // SET the value it had, or DEL it if it had none (a None argument adds nothing).
                let mut restore = redis::cmd(if self.value.is_some() { "SET" } else { "DEL" });
                restore.arg(&self.key).arg(&self.value);
                let () = redis.query(&restore);
                continue;
            }
            self.value = value;
            if decision.allowed && self.limiter.holds_slots() {
                self.held.push((lease, cost));
            }
            return decision;
        }
        panic!("{}: no TTL for PERSIST to remove after a charged call, {ATTEMPTS} times", self.key);
    }

    fn fork(&self) -> Self {
        let key = self.redis.new_key(&self.limiter);
        let _copied: i64 = self.redis.query(redis::cmd("COPY").arg(&self.key).arg(&key));
        RedisKey {
            redis: self.redis.clone(),
            key,
            limiter: self.limiter.clone(),
            value: self.value.clone(),
            held: self.held.clone(),
        }
    }

    fn release(&mut self, cost: u64) {
        let (lease, units) = self.held.pop().expect("a call holds slots");
        assert_eq!(units, cost, "released slots the latest admitted call did not take");
        let redis = &*self.redis;
        if let Err(e) = redis.runtime.block_on(redis.store.release(&self.key, lease)) {
            panic!("release on {}: {e}", self.key);
        }
        self.value = redis.query(redis::cmd("GET").arg(&self.key));
    }

    /// As `acquire`: the key loses its TTL after the script, and a state that expired in real
    /// time before that is put back and the settlement sent again.
    fn give_back(&mut self, now: u64, units: u64, taken: Taken) {
        let redis = &*self.redis;
        let by = Adjustment::Return { units, taken };
        for _ in 0..ATTEMPTS {
            let level = match redis.runtime.block_on(redis.store.adjust(
                &[(&self.key, &self.limiter, by)],
                None,
                Some(Nanos::new(now)),
            )) {
                Ok(level) => level,
                Err(e) => panic!("give back on {}: {e}", self.key),
            };
            let mut pinned = redis::pipe();
            pinned.cmd("PERSIST").arg(&self.key).cmd("GET").arg(&self.key);
            let mut admin = redis.admin.clone();
            let (persisted, value): (i64, Option<String>) =
                redis.runtime.block_on(pinned.query_async(&mut admin)).expect("PERSIST and GET");
            // A state still short of full is written with a TTL, which PERSIST finds unless it ran
            // out (a full one is deleted: nothing to find).
            let short_of_full = level.first().is_some_and(|d| d.reset_after > Nanos::ZERO);
            if short_of_full && persisted == 0 {
                let mut restore = redis::cmd(if self.value.is_some() { "SET" } else { "DEL" });
                restore.arg(&self.key).arg(&self.value);
                let () = redis.query(&restore);
                continue;
            }
            self.value = value;
            return;
        }
        panic!("{}: no TTL for PERSIST to remove after a give-back, {ATTEMPTS} times", self.key);
    }

    /// The key's value stays as it is: the scripts read it under whatever limiter a check names.
    fn relimit(&mut self, limiter: &Limiter) {
        self.limiter = limiter.clone();
    }

    fn state(&self) -> Option<String> {
        self.redis.query(redis::cmd("GET").arg(&self.key))
    }
}

#[test]
fn token_bucket_matches_the_replay_model() {
    algorithm_suite::token_bucket_matches_the_replay_model(&Redis::start(), CASES);
}

#[test]
fn gcra_and_leaky_bucket_decide_exactly_like_the_token_bucket() {
    algorithm_suite::gcra_and_leaky_bucket_decide_exactly_like_the_token_bucket(&Redis::start(), CASES);
}

#[test]
fn fixed_window_matches_a_count_per_window() {
    algorithm_suite::fixed_window_matches_a_count_per_window(&Redis::start(), CASES);
}

#[test]
fn sliding_log_matches_the_full_history() {
    algorithm_suite::sliding_log_matches_the_full_history(&Redis::start(), CASES);
}

#[test]
fn sliding_window_matches_the_weighted_estimate() {
    algorithm_suite::sliding_window_matches_the_weighted_estimate(&Redis::start(), CASES);
}

#[test]
fn refusals_never_charge() {
    algorithm_suite::refusals_never_charge(&Redis::start(), CASES);
}

#[test]
fn retry_after_is_exact() {
    algorithm_suite::retry_after_is_exact(&Redis::start(), CASES);
}

#[test]
fn concurrency_counts_slots_exactly() {
    algorithm_suite::concurrency_counts_slots_exactly(&Redis::start(), CASES);
}

#[test]
fn fixed_window_lets_twice_the_limit_through_across_an_edge() {
    algorithm_suite::fixed_window_lets_twice_the_limit_through_across_an_edge(&Redis::start());
}

#[test]
fn sliding_log_never_lets_more_than_the_limit_through_an_edge() {
    algorithm_suite::sliding_log_never_lets_more_than_the_limit_through_an_edge(&Redis::start());
}

#[test]
fn sliding_window_stays_within_its_documented_error_at_an_edge() {
    algorithm_suite::sliding_window_stays_within_its_documented_error_at_an_edge(&Redis::start());
}

#[test]
fn sliding_window_never_exceeds_twice_the_limit_in_any_window() {
    algorithm_suite::sliding_window_never_exceeds_twice_the_limit_in_any_window(&Redis::start(), CASES);
}

#[test]
fn changed_limits_keep_every_number_believable() {
    algorithm_suite::changed_limits_keep_every_number_believable(&Redis::start(), LIFE_CASES);
}

#[test]
fn every_rate_is_decided_exactly_or_refused_naming_its_key() {
    algorithm_suite::every_rate_is_decided_exactly_or_refused_naming_its_key(&Redis::start(), CASES * 10);
}

#[test]
fn late_refunds_go_back_only_where_they_were_taken() {
    algorithm_suite::late_refunds_go_back_only_where_they_were_taken(&Redis::start(), LIFE_CASES);
}

#[test]
fn every_registered_algorithm_has_a_reference_model() {
    algorithm_suite::every_registered_algorithm_has_a_reference_model();
}
