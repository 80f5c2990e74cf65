//! Budget slices on a real Redis (`crates/redis/src/slices.rs`): a busy key's budget taken a slice
//! at a time and spent without a round trip, every unit debited in Redis first. Three instances
//! hammering one budget never admit more than it holds, use nearly all of it, and hand back the
//! rest; a limit lowered live is never spent from slices cut under the old one; an instance that
//! dies holding slices costs the others at most what it held.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::test_redis::TestRedis;
use mcp_ratelimit::clock::SystemClock;
use mcp_ratelimit::limit::{Limiter, TokenBucket};
use mcp_ratelimit::store::redis::SliceRules;
use mcp_ratelimit::store::{Budgets, Check, Lease, RedisStore, Verdict};

const TIMEOUT: Duration = Duration::from_secs(5);
const RULES: SliceRules = SliceRules { most: 64, lasts: Duration::from_secs(30) };

/// A budget of `capacity` that refills one unit in a thousand seconds: a fixed budget for the
/// length of a test.
fn budget(capacity: u64) -> Limiter {
    Limiter::TokenBucket(TokenBucket::new(capacity, 0.001))
}

async fn store(redis: &TestRedis, rules: Option<SliceRules>) -> Arc<RedisStore> {
    let store = RedisStore::connect(&redis.url, TIMEOUT).await.expect("connects");
    match rules {
        Some(rules) => store.with_slices(rules, SystemClock::shared()).shared(),
        None => store.shared(),
    }
}

/// Whether a call of `cost` on `key` under `limiter` is admitted.
async fn admitted(store: &RedisStore, key: &str, limiter: &Limiter, cost: u64) -> bool {
    decided(store, Check { key, limiter, cost, shadow: false }).await.allowed
}

/// The decision of one check, through the store as the guard asks it (`Budgets::decide`).
async fn decided(store: &RedisStore, check: Check<'_>) -> mcp_ratelimit::limit::Decision {
    match Budgets::decide(store, &[check], &[], Lease::new()).await {
        Ok(Verdict::Decided(decisions)) => decisions[0],
        other => panic!("not decided: {other:?}"),
    }
}

/// Calls (each admitted) until the instance holds part of a slice: how many it took.
async fn spend_until_a_slice_is_held(store: &RedisStore, key: &str, limiter: &Limiter) -> u64 {
    let mut calls = 0;
    while store.slices_held().1 == 0 {
        assert!(calls < 2 * RULES.most, "no slice held after {calls} more calls");
        assert!(admitted(store, key, limiter, 1).await, "a call while the budget is plentiful");
        calls += 1;
    }
    calls
}

/// What Redis itself holds of `key`'s budget, read by an instance without slices.
async fn in_redis(redis: &TestRedis, key: &str, limiter: &Limiter) -> u64 {
    let plain = store(redis, None).await;
    decided(&plain, Check { key, limiter, cost: 0, shadow: false }).await.remaining
}

#[tokio::test]
async fn a_busy_key_is_decided_from_slices_without_a_round_trip_and_counted_to_the_unit() {
    let redis = TestRedis::private();
    let (key, limiter) = (redis.key("busy"), Limiter::TokenBucket(TokenBucket::new(10_000, 0.01)));
    let sliced = store(&redis, Some(RULES)).await;
    let before = redis.evalsha_calls();
    for n in 0..2_000 {
        assert!(admitted(&sliced, &key, &limiter, 1).await, "call {n}");
    }
    let trips = redis.evalsha_calls() - before;
    assert!(trips <= 2_000 / 20, "2,000 calls took {trips} round trips: slices of up to 64 take a few dozen");
    let spent = 2_000 + spend_until_a_slice_is_held(&sliced, &key, &limiter).await;
    // What this instance reads counts what it holds; Redis holds the rest.
    let (_, held) = sliced.slices_held();
    assert!(held > 0 && held <= RULES.most, "a slice is held: {held}");
    let here = decided(&sliced, Check { key: &key, limiter: &limiter, cost: 0, shadow: false }).await;
    assert_eq!(here.remaining, 10_000 - spent, "read here: exactly what was not spent");
    assert_eq!(in_redis(&redis, &key, &limiter).await, 10_000 - spent - held, "Redis holds all but the slice");
    sliced.give_back_slices().await;
    assert_eq!(sliced.slices_held(), (0, 0));
    assert_eq!(in_redis(&redis, &key, &limiter).await, 10_000 - spent, "the slice went back whole");
}

/// Sixteen calls of one key always in flight on one instance, as one busy agent's fan-out: they
/// ask for one slice between them, not one each, so no top-up is sent straight back (on a bucket
/// charged since, what goes back is lost), and once the slices go back Redis has lost nothing.
#[tokio::test]
async fn calls_of_one_key_in_flight_at_once_take_one_slice_between_them_and_lose_nothing() {
    let redis = TestRedis::private();
    // Refilled one unit in 40 s: a bucket that comes back no more than a few units while it runs.
    let (key, limiter) = (redis.key("fan-out"), Limiter::TokenBucket(TokenBucket::new(100_000, 0.025)));
    let sliced = store(&redis, Some(RULES)).await;
    let before = redis.evalsha_calls();
    let workers = (0..16).map(|_| {
        let (sliced, key, limiter) = (sliced.clone(), key.clone(), limiter.clone());
        tokio::spawn(async move {
            for _ in 0..125 {
                assert!(admitted(&sliced, &key, &limiter, 1).await, "a plentiful budget");
            }
        })
    });
    for worker in futures::future::join_all(workers).await {
        worker.expect("a worker");
    }
    let scripts = redis.evalsha_calls() - before;
    sliced.give_back_slices().await;
    let lost = 100_000 - 2_000 - in_redis(&redis, &key, &limiter).await;
    assert_eq!(lost, 0, "2,000 admitted; with {scripts} scripts, {lost} more units gone from Redis");
    // Each key's first call (sixteen, before it is known here), slices doubling to 64, then one
    // top-up a slice: about 50. Asked for one each, they were over 120 and a few hundred units lost.
    assert!(scripts <= 80, "{scripts} scripts for 2,000 calls sixteen at a time");
}

/// Redis frozen while a top-up is on its way: the calls of its key that wait for that answer fail
/// within `store.timeout_ms` of their start, as a call alone does, not after the wait and a try of
/// their own as well.
#[tokio::test]
async fn calls_waiting_on_a_top_up_redis_never_answers_fail_within_the_store_timeout() {
    // A wait and a try of its own would take twice the timeout, past it with the slack.
    const TIMEOUT_HERE: Duration = Duration::from_millis(400);
    const SLACK: Duration = Duration::from_millis(200);
    let redis = TestRedis::private();
    let (key, limiter) = (redis.key("frozen"), budget(1_000));
    let connected = RedisStore::connect(&redis.url, TIMEOUT_HERE).await.expect("connects");
    let sliced = connected.with_slices(RULES, SystemClock::shared()).shared();
    spend_until_a_slice_is_held(&sliced, &key, &limiter).await;
    while sliced.slices_held().1 > 0 {
        assert!(admitted(&sliced, &key, &limiter, 1).await, "spent from the slice");
    }
    redis.pause();
    let calls = (0..8).map(|_| {
        let (sliced, key, limiter) = (sliced.clone(), key.clone(), limiter.clone());
        tokio::spawn(async move {
            let started = std::time::Instant::now();
            let check = Check { key: &key, limiter: &limiter, cost: 1, shadow: false };
            let outcome = Budgets::decide(&*sliced, &[check], &[], Lease::new()).await;
            (started.elapsed(), outcome.is_err())
        })
    });
    let outcomes = futures::future::join_all(calls).await;
    redis.resume();
    for outcome in outcomes {
        let (took, failed) = outcome.expect("a call");
        assert!(failed, "a frozen Redis decides nothing");
        assert!(took < TIMEOUT_HERE + SLACK, "a call took {took:?} against a store timeout of {TIMEOUT_HERE:?}");
    }
}

/// Three instances, eight callers each, one budget of 1,000: never more than 1,000 admitted; with
/// the load spread evenly at least 95 % of it while the callers press on; every unit once every
/// instance has given its slices back.
#[tokio::test]
async fn three_instances_never_admit_more_than_the_budget_and_use_nearly_all_of_it() {
    let redis = TestRedis::private();
    let (key, limiter) = (redis.key("hot"), budget(1_000));
    let instances =
        [store(&redis, Some(RULES)).await, store(&redis, Some(RULES)).await, store(&redis, Some(RULES)).await];
    let admitted_in_all = Arc::new(AtomicU64::new(0));
    let mut callers = Vec::new();
    for instance in &instances {
        for _ in 0..8 {
            let (instance, key, limiter, count) =
                (instance.clone(), key.clone(), limiter.clone(), admitted_in_all.clone());
            callers.push(tokio::spawn(async move {
                for _ in 0..200 {
                    if admitted(&instance, &key, &limiter, 1).await {
                        count.fetch_add(1, Ordering::SeqCst);
                    }
                }
            }));
        }
    }
    for caller in callers {
        caller.await.expect("a caller");
    }
    let pressed = admitted_in_all.load(Ordering::SeqCst);
    let held: u64 = instances.iter().map(|i| i.slices_held().1).sum();
    assert!(pressed <= 1_000, "{pressed} admitted of a budget of 1,000");
    assert_eq!(pressed + held + in_redis(&redis, &key, &limiter).await, 1_000, "every unit is spent, held or in Redis");
    assert!(pressed >= 950, "{pressed} of 1,000 used under an even load ({held} held in slices)");
    for instance in &instances {
        instance.give_back_slices().await;
    }
    let mut after = 0;
    while admitted(&instances[0], &key, &limiter, 1).await {
        after += 1;
    }
    assert_eq!(pressed + after, 1_000, "what the slices held is spent after they went back, and no more");
}

/// A limit lowered live: the next call under the new limiter spends nothing cut under the old one,
/// gives those slices back, and the lowered budget admits no more than it holds.
#[tokio::test]
async fn a_limit_lowered_live_is_never_spent_from_slices_cut_under_the_old_one() {
    let redis = TestRedis::private();
    let key = redis.key("lowered");
    let (old, lowered) = (budget(1_000), budget(10));
    let sliced = store(&redis, Some(RULES)).await;
    for _ in 0..200 {
        assert!(admitted(&sliced, &key, &old, 1).await);
    }
    spend_until_a_slice_is_held(&sliced, &key, &old).await;
    let mut under_lowered = 0;
    for _ in 0..50 {
        under_lowered += u64::from(admitted(&sliced, &key, &lowered, 1).await);
    }
    assert!(under_lowered <= 10, "{under_lowered} admitted under a limit of 10");
    assert_eq!(sliced.slices_held(), (0, 0), "the old slices went back, and none was cut under 10");
}

/// An instance that dies holding slices (it never gives them back) costs the others what it held,
/// at most a slice's worth, and never lets them admit more than the budget.
#[tokio::test]
async fn an_instance_that_dies_holding_slices_costs_the_others_at_most_them() {
    let redis = TestRedis::private();
    let (key, limiter) = (redis.key("orphaned"), budget(1_000));
    // Never shared: nothing gives its slices back, as after a crash.
    let dying =
        RedisStore::connect(&redis.url, TIMEOUT).await.expect("connects").with_slices(RULES, SystemClock::shared());
    let mut spent = 0;
    for _ in 0..300 {
        spent += u64::from(admitted(&dying, &key, &limiter, 1).await);
    }
    spent += spend_until_a_slice_is_held(&dying, &key, &limiter).await;
    let lost = dying.slices_held().1;
    assert!(lost > 0 && lost <= RULES.most, "it dies holding {lost}");
    drop(dying);
    let survivor = store(&redis, Some(RULES)).await;
    let mut after = 0;
    while admitted(&survivor, &key, &limiter, 1).await {
        after += 1;
    }
    assert_eq!(spent + after + lost, 1_000, "the survivor spends all but what died with the other");
}

/// A call whose budgets this instance's slices pay for still has its operator's block and its
/// loop check read in Redis (the script then reads nothing else): a call they stop charges
/// nothing, its price back in the slice it came from, and is not recorded as a call.
#[tokio::test]
async fn a_call_paid_from_slices_is_still_stopped_by_a_block_or_a_loop_and_charges_nothing() {
    use mcp_ratelimit::store::{LoopCall, LoopHistory};
    let redis = TestRedis::private();
    let (key, limiter) = (redis.key("{c}budget"), budget(1_000));
    let (block, history) = (redis.key("{c}block"), redis.key("{c}loops"));
    let sliced = store(&redis, Some(RULES)).await;
    let mut spent = spend_until_a_slice_is_held(&sliced, &key, &limiter).await;
    // Slices grow while the key is busy: enough held for the four calls below.
    while sliced.slices_held().1 < 8 {
        assert!(spent < 200, "no slice of 8 after {spent} calls");
        assert!(admitted(&sliced, &key, &limiter, 1).await);
        spent += 1;
    }
    let check = [Check { key: &key, limiter: &limiter, cost: 1, shadow: false }];
    let held = sliced.slices_held().1;
    // Calls A, B, A, B, ... (signature n % 2), or calls of their own (any other signature).
    let call = |signature: u128| LoopCall {
        key: &history,
        signature,
        tool_signature: 99,
        window: mcp_ratelimit::clock::Nanos::from_secs(60),
        repeats: 3,
    };

    // Paid from the slice, and a round trip all the same: for the block and the loop check.
    let before = redis.evalsha_calls();
    for n in 0..4 {
        let verdict = sliced.decide_after_loop_check(call(n % 2), &check, &[&block], Lease::new()).await;
        assert!(matches!(verdict, Ok(Verdict::Decided(ref d)) if d[0].allowed), "call {n}: {verdict:?}");
        spent += 1;
    }
    assert_eq!(redis.evalsha_calls() - before, 4, "one script each, for the block and the loop");
    assert_eq!(sliced.slices_held().1, held - 4, "paid from the slice");

    // A block stops the next (each checked for a loop first, and none is one): nothing charged,
    // the slice as it was.
    sliced.block(&block, Duration::from_secs(600)).await.expect("blocks");
    for n in 100..106 {
        let verdict = sliced.decide_after_loop_check(call(n), &check, &[&block], Lease::new()).await;
        assert!(matches!(verdict, Ok(Verdict::Blocked { index: 0, .. })), "blocked: {verdict:?}");
    }
    assert_eq!(sliced.slices_held().1, held - 4, "a blocked call charges nothing");
    Budgets::forget(&*sliced, &[&block]).await.expect("unblocks");

    // A/B/A/B: the third turn of the alternation is the loop, and charges nothing either (the
    // blocked calls were not recorded, or the loop would have come sooner).
    let verdict = sliced.decide_after_loop_check(call(0), &check, &[&block], Lease::new()).await;
    assert!(matches!(verdict, Ok(Verdict::Looping { .. })), "the alternation is a loop: {verdict:?}");
    assert_eq!(sliced.slices_held().1, held - 4, "a looping call charges nothing");

    // Every unit accounted for: what was spent, what is held here, what Redis holds.
    sliced.give_back_slices().await;
    assert_eq!(in_redis(&redis, &key, &limiter).await, 1_000 - spent, "nothing charged for the stopped calls");
}

/// Redis killed under three instances holding slices, then started again, empty: while it is away
/// each instance admits at most what its slices hold, and nothing else; once it is back, the
/// budget starts afresh (no persistence, as before slices), plus at most what was still held.
#[tokio::test]
async fn with_redis_killed_an_instance_admits_at_most_its_slices_and_after_a_restart_no_more_than_them() {
    let mut redis = TestRedis::private();
    let (key, limiter) = (redis.key("{k}killed"), budget(1_000));
    let mut instances = Vec::new();
    for _ in 0..3 {
        instances.push(store(&redis, Some(RULES)).await);
    }
    for instance in &instances {
        spend_until_a_slice_is_held(instance, &key, &limiter).await;
        for _ in 0..40 {
            assert!(admitted(instance, &key, &limiter, 1).await, "a plentiful budget");
        }
    }
    let held: Vec<u64> = instances.iter().map(|instance| instance.slices_held().1).collect();
    assert!(held.iter().all(|&units| units > 0 && units <= RULES.most), "each holds a slice: {held:?}");

    redis.kill();
    for (instance, &held) in instances.iter().zip(&held) {
        let mut spent = 0;
        for _ in 0..200 {
            match Budgets::decide(
                &**instance,
                &[Check { key: &key, limiter: &limiter, cost: 1, shadow: false }],
                &[],
                Lease::new(),
            )
            .await
            {
                Ok(Verdict::Decided(d)) if d[0].allowed => spent += 1,
                _ => {}
            }
        }
        assert_eq!(spent, held, "with Redis away, an instance admits exactly what its slices hold");
    }

    redis.restart();
    let mut after = 0;
    for n in 0..3_000 {
        let check = Check { key: &key, limiter: &limiter, cost: 1, shadow: false };
        match Budgets::decide(&*instances[n % 3], &[check], &[], Lease::new()).await {
            Ok(Verdict::Decided(d)) if d[0].allowed => after += 1,
            _ => {}
        }
    }
    // Every slice was spent while Redis was away: the fresh budget is all there is.
    assert!(after <= 1_000, "{after} admitted by a budget of 1,000 started afresh");
    assert!(after >= 900, "the instances reconnected and spent the fresh budget: {after}");
}

/// The mixed load of the issue: three instances, eight callers each, press one hot key of 1,000;
/// once 300 are admitted the limit is lowered live to 600 (each caller's next call is under it),
/// and once 500 are, one instance is killed holding its slices (its callers stop, nothing gives
/// them back). No more than 1,000 are admitted in all, no more than 600 under the lowered limit,
/// and after the survivors give theirs back and the budget is drained, still no more than 1,000.
#[tokio::test]
async fn a_mixed_load_with_a_limit_lowered_live_and_an_instance_killed_never_admits_more_than_the_budget() {
    use std::sync::atomic::AtomicBool;
    let redis = TestRedis::private();
    let key = redis.key("mixed");
    let (old, lowered) = (budget(1_000), budget(600));
    let in_force = Arc::new(std::sync::Mutex::new(old.clone()));
    // The one to be killed is never shared: nothing of it gives slices back, as after a crash.
    let doomed = Arc::new(
        RedisStore::connect(&redis.url, TIMEOUT).await.expect("connects").with_slices(RULES, SystemClock::shared()),
    );
    let instances = [store(&redis, Some(RULES)).await, store(&redis, Some(RULES)).await, doomed.clone()];
    let (under_old, under_lowered) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let killed = Arc::new(AtomicBool::new(false));
    let mut callers = Vec::new();
    for (n, instance) in instances.iter().enumerate() {
        for _ in 0..8 {
            let (instance, key, in_force) = (instance.clone(), key.clone(), in_force.clone());
            let (under_old, under_lowered, killed) = (under_old.clone(), under_lowered.clone(), killed.clone());
            let (old, lowered) = (old.clone(), lowered.clone());
            callers.push(tokio::spawn(async move {
                for _ in 0..200 {
                    if n == 2 && killed.load(Ordering::SeqCst) {
                        return;
                    }
                    let limiter = in_force.lock().expect("limiter").clone();
                    if !admitted(&instance, &key, &limiter, 1).await {
                        continue;
                    }
                    let counted = if limiter == old { &under_old } else { &under_lowered };
                    counted.fetch_add(1, Ordering::SeqCst);
                    let admitted = under_old.load(Ordering::SeqCst) + under_lowered.load(Ordering::SeqCst);
                    if admitted >= 300 {
                        *in_force.lock().expect("limiter") = lowered.clone();
                    }
                    if admitted >= 500 {
                        killed.store(true, Ordering::SeqCst);
                    }
                }
            }));
        }
    }
    for caller in callers {
        caller.await.expect("a caller");
    }
    let lost = doomed.slices_held().1;
    for survivor in &instances[..2] {
        survivor.give_back_slices().await;
    }
    drop(instances);
    drop(doomed);
    let (old_count, lowered_count) = (under_old.load(Ordering::SeqCst), under_lowered.load(Ordering::SeqCst));
    assert!(killed.load(Ordering::SeqCst), "the instance was killed mid-load");
    assert!(lowered_count <= 600, "{lowered_count} admitted under the lowered limit of 600");
    assert!(old_count + lowered_count <= 1_000, "{old_count} + {lowered_count} admitted of a budget of 1,000");
    assert!(lost <= RULES.most, "the killed instance held at most a slice: {lost}");
    // The survivors' slices went back; the lowered budget drained: still never more than 1,000.
    let survivor = store(&redis, Some(RULES)).await;
    let mut after = 0;
    while admitted(&survivor, &key, &lowered, 1).await {
        after += 1;
        assert!(after <= 1_000, "a drained budget refuses");
    }
    assert!(old_count + lowered_count + after <= 1_000, "{old_count} + {lowered_count} + {after} of 1,000");
    assert!(lowered_count + after <= 600, "{lowered_count} + {after} under the lowered limit of 600");
}
