//! The one line every instance's waiting jobs stand in (`line.lua`), against a real Redis, beyond
//! the suite it passes with its memory twin (`mcp_ratelimit_kernel::store::line_suite`, run in
//! `crates/redis/tests/conformance.rs`): a dead instance's jobs stop holding the line.

use std::sync::Arc;
use std::time::Duration;

use crate::test_redis::TestRedis;
use mcp_ratelimit::store::redis::RedisStore;
use mcp_ratelimit::store::{JoinAt, Lease, LineAnswer, LineAt, LineClaim, LineEntry, LineWait, SharedLine, Store};

const ACCOUNT: &str = "{t}account:in_flight";
const SHARE: &str = "{t}account:unverified";
const PRO: &str = "{t}account:tier:pro";

async fn line(redis: &TestRedis) -> Arc<RedisStore> {
    Arc::new(RedisStore::connect(&redis.url, Duration::from_secs(5)).await.expect("connects"))
}

fn at(instance: &str) -> LineAt<'_> {
    LineAt { name: "t", instance }
}

use mcp_ratelimit::store::line_suite::{job, went};

#[tokio::test]
async fn a_dead_instances_jobs_stop_holding_the_line() {
    let redis = TestRedis::private();
    let store = line(&redis).await;
    store.join(at("dead"), &job("d0", "tenant:d"), &JoinAt::Back).await.expect("joins");
    store.join(at("b"), &LineEntry { weight: 0.5, ..job("b0", "tenant:b") }, &JoinAt::Back).await.expect("joins");
    let line: Arc<dyn SharedLine> = store.clone();
    let (first, _) = mcp_ratelimit::store::line_suite::claim(&line, "t", "b", 10, 0.0, None).await;
    assert!(matches!(first, LineAnswer::Wait { why: LineWait::Theirs, .. }), "{first:?}");
    // Its mark of being alive runs out (made to here, as five seconds would).
    let mut connection =
        redis::Client::open(redis.url.as_str()).expect("url").get_multiplexed_async_connection().await.expect("redis");
    let ran_out = |who: &str| redis::cmd("ZADD").arg("{t}line:alive").arg(1).arg(who).to_owned();
    let _: () = ran_out("dead").query_async(&mut connection).await.expect("zadd");
    let (tiers, gaps) = ([(PRO, 0.0)], [None]);
    let claim = || LineClaim {
        account: (ACCOUNT, 10),
        share: (SHARE, 10),
        learnt: None,
        gaps: &gaps,
        tiers: &tiers,
        scan: 1000,
        candidate: None,
        lease: Lease::new(),
        told: "",
    };
    // The claim that notices gives it a grace (as after Redis was away longer than a mark lasts,
    // when every mark has run out at once): its job stays, and is still next.
    let (answer, dropped) = store.claim(at("b"), claim()).await.expect("claims");
    assert!(matches!(answer, LineAnswer::Wait { why: LineWait::Theirs, .. }), "{answer:?}");
    assert!(dropped.is_empty(), "d0 stays, in its grace: {dropped:?}");
    let graced: Option<f64> =
        redis::cmd("ZSCORE").arg("{t}line:alive").arg("~dead").query_async(&mut connection).await.expect("zscore");
    assert!(graced.is_some(), "the grace is kept beside the marks");
    // Silent through its grace too (made to run out here): dead, its job dropped and handed to b.
    let _: () = ran_out("~dead").query_async(&mut connection).await.expect("zadd");
    let (answer, dropped) = store.claim(at("b"), claim()).await.expect("claims");
    assert_eq!((went(&answer), dropped), (Some("b0"), vec!["d0".to_owned()]), "b0 goes; d0 is handed to b to end");
    let left: u64 = redis::cmd("ZCARD").arg("{t}line").query_async(&mut connection).await.expect("zcard");
    assert_eq!(left, 0, "the dead instance's job was dropped from the line");
    assert!(store.clone().shared_line().is_some());
}

#[tokio::test]
async fn an_instance_that_says_it_is_alive_within_its_grace_keeps_its_jobs_and_a_new_grace_later() {
    let redis = TestRedis::private();
    let store = line(&redis).await;
    store.join(at("a"), &job("a0", "tenant:a"), &JoinAt::Back).await.expect("joins");
    store.join(at("b"), &job("b0", "tenant:b"), &JoinAt::Back).await.expect("joins");
    let mut connection =
        redis::Client::open(redis.url.as_str()).expect("url").get_multiplexed_async_connection().await.expect("redis");
    let score = |who: &str| redis::cmd("ZSCORE").arg("{t}line:alive").arg(who).to_owned();
    for round in 0..2 {
        // Every mark runs out at once, as while Redis was away longer than a mark lasts.
        for who in ["a", "b"] {
            let _: () = redis::cmd("ZADD")
                .arg("{t}line:alive")
                .arg(1)
                .arg(who)
                .query_async(&mut connection)
                .await
                .expect("zadd");
        }
        // b's word notices a's mark ran out: a is in its grace.
        store.alive(at("b")).await.expect("b is alive");
        let graced: Option<f64> = score("~a").query_async(&mut connection).await.expect("zscore");
        assert!(graced.is_some(), "round {round}: a is given a grace");
        // a says it is alive within it: its mark is back, its grace gone, its job still in line.
        store.alive(at("a")).await.expect("a is alive");
        let (mark, grace): (Option<f64>, Option<f64>) = (
            score("a").query_async(&mut connection).await.expect("zscore"),
            score("~a").query_async(&mut connection).await.expect("zscore"),
        );
        assert!(mark.is_some_and(|m| m > 1.0) && grace.is_none(), "round {round}: a's mark {mark:?}, grace {grace:?}");
        let left: u64 = redis::cmd("ZCARD").arg("{t}line").query_async(&mut connection).await.expect("zcard");
        assert_eq!(left, 2, "round {round}: both jobs stay in line");
    }
}
