//! The one line every instance's waiting jobs stand in (`line.lua`), against a real Redis: jobs
//! go by their flows' turns whichever instance they wait on, only the instance whose job is next
//! takes a slot, a job at the door never overtakes the line, a tier owed a reserved slot and a
//! higher rank go first, a gap holds only its class, and a dead instance's jobs stop holding
//! the line.

use std::sync::Arc;
use std::time::Duration;

use crate::test_redis::TestRedis;
use mcp_ratelimit::limit::{Gcra, Limiter};
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

fn job(id: &str, flow: &str) -> LineEntry {
    LineEntry { job: id.into(), flow: flow.into(), weight: 1.0, class: 0, unverified: false, tier: None, rank: 0 }
}

/// A claim on an account of `slots`, one class (images, no gap), pro reserved `pro` of it.
async fn claim(store: &RedisStore, instance: &str, slots: u64, pro: f64, candidate: Option<&LineEntry>) -> LineAnswer {
    let tiers = [(PRO, pro)];
    let gaps = [None];
    let claim = LineClaim {
        account: (ACCOUNT, slots),
        share: (SHARE, slots),
        learnt: None,
        gaps: &gaps,
        tiers: &tiers,
        scan: 1000,
        candidate,
        lease: Lease::new(),
    };
    store.claim(at(instance), claim).await.expect("claims").0
}

fn went(answer: &LineAnswer) -> Option<&str> {
    match answer {
        LineAnswer::Go { job, .. } => Some(job),
        LineAnswer::Wait { .. } => None,
    }
}

#[tokio::test]
async fn jobs_go_by_their_flows_turns_whichever_instance_they_wait_on() {
    let redis = TestRedis::private();
    let store = line(&redis).await;
    // Tenant x queues three on instance a, then tenant y one on instance b.
    for i in 0..3 {
        store.join(at("a"), &job(&format!("x{i}"), "tenant:x"), &JoinAt::Back).await.expect("joins");
    }
    store.join(at("b"), &job("y0", "tenant:y"), &JoinAt::Back).await.expect("joins");
    let mut order = Vec::new();
    for _ in 0..4 {
        // Both ask, in turn: only the instance whose job is next takes a slot.
        for instance in ["a", "b"] {
            if let Some(job) = went(&claim(&store, instance, 10, 0.0, None).await) {
                order.push(job.to_owned());
            }
        }
    }
    assert_eq!(order, ["x0", "y0", "x1", "x2"], "y's single job goes second, not after x's backlog");
}

#[tokio::test]
async fn another_instances_job_next_changes_nothing_and_says_where_mine_stand() {
    let redis = TestRedis::private();
    let store = line(&redis).await;
    store.join(at("a"), &job("x0", "tenant:x"), &JoinAt::Back).await.expect("joins");
    store.join(at("b"), &job("y0", "tenant:y"), &JoinAt::Back).await.expect("joins");
    store.join(at("b"), &job("y1", "tenant:y"), &JoinAt::Back).await.expect("joins");
    let answer = claim(&store, "b", 10, 0.0, None).await;
    let LineAnswer::Wait { why, mine, complete, .. } = answer else { panic!("x0 is next: {answer:?}") };
    assert_eq!((why, complete), (LineWait::Theirs, true));
    assert_eq!(mine, [("y0".to_owned(), 1), ("y1".to_owned(), 2)]);
    assert_eq!(went(&claim(&store, "a", 10, 0.0, None).await), Some("x0"));
    // A full account: nobody goes.
    let full = claim(&store, "b", 1, 0.0, None).await;
    assert!(matches!(full, LineAnswer::Wait { why: LineWait::Full, .. }), "{full:?}");
}

#[tokio::test]
async fn a_job_at_the_door_goes_at_once_only_if_it_would_be_next() {
    let redis = TestRedis::private();
    let store = line(&redis).await;
    let door = job("z0", "tenant:z");
    assert_eq!(went(&claim(&store, "c", 10, 0.0, Some(&door)).await), Some("z0"), "an empty line: at once");
    store.join(at("a"), &job("x0", "tenant:x"), &JoinAt::Back).await.expect("joins");
    let second = job("z1", "tenant:z");
    let answer = claim(&store, "c", 10, 0.0, Some(&second)).await;
    assert!(matches!(answer, LineAnswer::Wait { why: LineWait::Theirs, .. }), "x0 waited first: {answer:?}");
}

#[tokio::test]
async fn a_tier_owed_a_reserved_slot_goes_first_then_the_highest_rank() {
    let redis = TestRedis::private();
    let store = line(&redis).await;
    store.join(at("a"), &job("free0", "tenant:f"), &JoinAt::Back).await.expect("joins");
    store.join(at("a"), &LineEntry { rank: 5, ..job("admin0", "tenant:admin") }, &JoinAt::Back).await.expect("joins");
    store.join(at("b"), &LineEntry { tier: Some(0), ..job("pro0", "tenant:p") }, &JoinAt::Back).await.expect("joins");
    // Pro is reserved half of 4 slots and holds none: first, on whichever instance; and A is told
    // where its jobs stand behind it.
    let answer = claim(&store, "a", 4, 0.5, None).await;
    let LineAnswer::Wait { why: LineWait::Theirs, mine, .. } = answer else { panic!("pro0 is next: {answer:?}") };
    assert_eq!(mine, [("free0".to_owned(), 2), ("admin0".to_owned(), 1)], "pro0, then admin0, then free0");
    assert_eq!(went(&claim(&store, "b", 4, 0.5, None).await), Some("pro0"));
    assert_eq!(went(&claim(&store, "a", 4, 0.5, None).await), Some("admin0"), "then the highest rank");
    assert_eq!(went(&claim(&store, "a", 4, 0.5, None).await), Some("free0"));
    // An unverified caller's job never draws on a reservation.
    store.join(at("a"), &job("free1", "tenant:f"), &JoinAt::Back).await.expect("joins");
    store
        .join(at("b"), &LineEntry { tier: Some(0), unverified: true, ..job("u0", "address:1") }, &JoinAt::Back)
        .await
        .expect("joins");
    assert_eq!(went(&claim(&store, "a", 4, 0.5, None).await), Some("free1"), "u0 is owed nothing");
}

#[tokio::test]
async fn a_gap_holds_only_its_class_and_says_when_it_passes() {
    let redis = TestRedis::private();
    let store = line(&redis).await;
    let gap = Limiter::Gcra(Gcra::new(1, 1.0 / 60.0));
    let gaps = [None, Some(("{t}video_gap", &gap))];
    let video = |id: &str| LineEntry { class: 1, ..job(id, "tenant:v") };
    store.join(at("a"), &video("v0"), &JoinAt::Back).await.expect("joins");
    store.join(at("a"), &video("v1"), &JoinAt::Back).await.expect("joins");
    store.join(at("a"), &job("i0", "tenant:i"), &JoinAt::Back).await.expect("joins");
    let claim_here = |store: Arc<RedisStore>| async move {
        let tiers = [];
        let claim = LineClaim {
            account: (ACCOUNT, 10),
            share: (SHARE, 0),
            learnt: None,
            gaps: &gaps,
            tiers: &tiers,
            scan: 1000,
            candidate: None,
            lease: Lease::new(),
        };
        store.claim(at("a"), claim).await.expect("claims").0
    };
    let mut first = [claim_here(store.clone()).await, claim_here(store.clone()).await];
    let mut first: Vec<&str> = first.iter_mut().filter_map(|a| went(a)).collect();
    first.sort();
    assert_eq!(first, ["i0", "v0"], "v1 waits for the gap; the image passes it");
    let answer = claim_here(store.clone()).await;
    let LineAnswer::Wait { why, wake, .. } = answer else { panic!("v1 waits: {answer:?}") };
    assert_eq!(why, LineWait::Nothing);
    assert!(wake.is_some_and(|ns| ns > 50_000_000_000), "about a minute: {wake:?}");
}

#[tokio::test]
async fn a_dead_instances_jobs_stop_holding_the_line() {
    let redis = TestRedis::private();
    let store = line(&redis).await;
    store.join(at("dead"), &job("d0", "tenant:d"), &JoinAt::Back).await.expect("joins");
    store.join(at("b"), &LineEntry { weight: 0.5, ..job("b0", "tenant:b") }, &JoinAt::Back).await.expect("joins");
    assert!(matches!(claim(&store, "b", 10, 0.0, None).await, LineAnswer::Wait { why: LineWait::Theirs, .. }));
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
    };
    let (answer, dropped) = store.claim(at("b"), claim).await.expect("claims");
    assert_eq!((went(&answer), dropped), (Some("b0"), vec!["d0".to_owned()]), "b0 goes; d0 is handed to b to end");
    let left: u64 = redis::cmd("ZCARD").arg("{t}line").query_async(&mut connection).await.expect("zcard");
    assert_eq!(left, 0, "the dead instance's job was dropped from the line");
    assert!(store.clone().shared_line().is_some());
}
