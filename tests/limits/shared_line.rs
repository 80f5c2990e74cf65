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
    let _: () =
        redis::cmd("ZADD").arg("{t}line:alive").arg(1).arg("dead").query_async(&mut connection).await.expect("zadd");
    let lease = Lease::new();
    let (tiers, gaps) = ([(PRO, 0.0)], [None]);
    let claim = LineClaim {
        account: (ACCOUNT, 10),
        share: (SHARE, 10),
        learnt: None,
        gaps: &gaps,
        tiers: &tiers,
        scan: 1000,
        candidate: None,
        lease,
        told: "",
    };
    let (answer, dropped) = store.claim(at("b"), claim).await.expect("claims");
    assert_eq!((went(&answer), dropped), (Some("b0"), vec!["d0".to_owned()]), "b0 goes; d0 is handed to b to end");
    let left: u64 = redis::cmd("ZCARD").arg("{t}line").query_async(&mut connection).await.expect("zcard");
    assert_eq!(left, 0, "the dead instance's job was dropped from the line");
    assert!(store.clone().shared_line().is_some());
}
