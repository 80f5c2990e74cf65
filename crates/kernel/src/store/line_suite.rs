//! The suite every [`SharedLine`] must pass, asked through `dyn Store` only and with no time
//! travel, so it runs alike on the Redis store (`line.lua`, in `tests/limits/shared_line.rs`) and
//! on the [`SharedMemory`](super::SharedMemory) the simulator's instances share (its unit tests):
//! the two are one line, judged by one set of rules.
//!
//! ```
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! use std::sync::Arc;
//! use mcp_ratelimit_kernel::clock::SystemClock;
//! use mcp_ratelimit_kernel::store::{SharedMemory, Store, line_suite};
//!
//! let store: Arc<dyn Store> = Arc::new(SharedMemory::on(SystemClock::shared()));
//! line_suite::run(store, "suite").await;
//! # });
//! ```

use std::sync::Arc;
use std::time::Duration;

use super::{JoinAt, Lease, LineAnswer, LineAt, LineClaim, LineEntry, LineWait, SharedLine, Store};
use crate::clock::Nanos;
use crate::limit::{Concurrency, Gcra, Limiter};

/// Runs every check on `store`'s line, each in a line of its own named `prefix` and a number
/// (give a prefix of its own per run where the store outlives the test).
pub async fn run(store: Arc<dyn Store>, prefix: &str) {
    let line = store.clone().shared_line().expect("the store keeps a line");
    let name = |n: u32| format!("{prefix}{n}");
    jobs_go_by_their_flows_turns_whichever_instance_they_wait_on(&line, &name(1)).await;
    another_instances_job_next_changes_nothing_and_says_where_mine_stand(&line, &name(2)).await;
    a_job_at_the_door_goes_at_once_only_if_it_would_be_next(&line, &name(3)).await;
    a_tier_owed_a_reserved_slot_goes_first_then_the_highest_rank(&line, &name(4)).await;
    a_gap_holds_only_its_class_and_says_when_it_passes(&line, &name(5)).await;
    a_job_joining_again_keeps_its_place_and_one_that_left_is_gone(&line, &name(6)).await;
    a_turn_taken_with_slots_left_free_is_told_to_every_instance(&store, &line, &name(7)).await;
}

/// A job of `flow`, weight 1, class 0, verified, of no tier, rank 0.
pub fn job(id: &str, flow: &str) -> LineEntry {
    LineEntry { job: id.into(), flow: flow.into(), weight: 1.0, class: 0, unverified: false, tier: None, rank: 0 }
}

/// The keys a line named `name` claims on: the account's, the share's, the pro tier's.
pub fn keys(name: &str) -> [String; 3] {
    ["account:in_flight", "account:unverified", "account:tier:pro"].map(|k| format!("{{{name}}}{k}"))
}

/// What a claim answered: the job that went, if one did.
pub fn went(answer: &LineAnswer) -> Option<&str> {
    match answer {
        LineAnswer::Go { job, .. } => Some(job),
        LineAnswer::Wait { .. } => None,
    }
}

/// A claim by `instance` of the line `name` on an account of `slots` (one class, no gap), pro
/// reserved `pro` of it.
pub async fn claim(
    line: &Arc<dyn SharedLine>,
    name: &str,
    instance: &str,
    slots: u64,
    pro: f64,
    candidate: Option<&LineEntry>,
) -> (LineAnswer, Vec<String>) {
    let [account, share, tier] = keys(name);
    let tiers = [(tier.as_str(), pro)];
    let gaps = [None];
    let claim = LineClaim {
        account: (&account, slots),
        share: (&share, slots),
        learnt: None,
        gaps: &gaps,
        tiers: &tiers,
        scan: 1000,
        candidate,
        lease: Lease::new(),
        told: "",
    };
    line.claim(LineAt { name, instance }, claim).await.expect("claims")
}

async fn join(line: &Arc<dyn SharedLine>, name: &str, instance: &str, entry: &LineEntry) -> (f64, String) {
    line.join(LineAt { name, instance }, entry, &JoinAt::Back).await.expect("joins")
}

async fn jobs_go_by_their_flows_turns_whichever_instance_they_wait_on(line: &Arc<dyn SharedLine>, name: &str) {
    // Tenant x queues three on instance a, then tenant y one on instance b.
    for i in 0..3 {
        join(line, name, "a", &job(&format!("x{i}"), "tenant:x")).await;
    }
    join(line, name, "b", &job("y0", "tenant:y")).await;
    let mut order = Vec::new();
    for _ in 0..4 {
        // Both ask, in turn: only the instance whose job is next takes a slot.
        for instance in ["a", "b"] {
            if let Some(job) = went(&claim(line, name, instance, 10, 0.0, None).await.0) {
                order.push(job.to_owned());
            }
        }
    }
    assert_eq!(order, ["x0", "y0", "x1", "x2"], "y's single job goes second, not after x's backlog");
}

async fn another_instances_job_next_changes_nothing_and_says_where_mine_stand(line: &Arc<dyn SharedLine>, name: &str) {
    join(line, name, "a", &job("x0", "tenant:x")).await;
    join(line, name, "b", &job("y0", "tenant:y")).await;
    join(line, name, "b", &job("y1", "tenant:y")).await;
    let (answer, _) = claim(line, name, "b", 10, 0.0, None).await;
    let LineAnswer::Wait { why, mine, complete, .. } = answer else { panic!("x0 is next: {answer:?}") };
    assert_eq!((why, complete), (LineWait::Theirs, true));
    assert_eq!(mine, [("y0".to_owned(), 1), ("y1".to_owned(), 2)]);
    assert_eq!(went(&claim(line, name, "a", 10, 0.0, None).await.0), Some("x0"));
    // A full account: nobody goes.
    let (full, _) = claim(line, name, "b", 1, 0.0, None).await;
    assert!(matches!(full, LineAnswer::Wait { why: LineWait::Full, .. }), "{full:?}");
}

async fn a_job_at_the_door_goes_at_once_only_if_it_would_be_next(line: &Arc<dyn SharedLine>, name: &str) {
    let door = job("z0", "tenant:z");
    assert_eq!(went(&claim(line, name, "c", 10, 0.0, Some(&door)).await.0), Some("z0"), "an empty line: at once");
    join(line, name, "a", &job("x0", "tenant:x")).await;
    let second = job("z1", "tenant:z");
    let (answer, _) = claim(line, name, "c", 10, 0.0, Some(&second)).await;
    assert!(matches!(answer, LineAnswer::Wait { why: LineWait::Theirs, .. }), "x0 waited first: {answer:?}");
}

async fn a_tier_owed_a_reserved_slot_goes_first_then_the_highest_rank(line: &Arc<dyn SharedLine>, name: &str) {
    join(line, name, "a", &job("free0", "tenant:f")).await;
    join(line, name, "a", &LineEntry { rank: 5, ..job("admin0", "tenant:admin") }).await;
    join(line, name, "b", &LineEntry { tier: Some(0), ..job("pro0", "tenant:p") }).await;
    // Pro is reserved half of 4 slots and holds none: first, on whichever instance; and A is told
    // where its jobs stand behind it.
    let (answer, _) = claim(line, name, "a", 4, 0.5, None).await;
    let LineAnswer::Wait { why: LineWait::Theirs, mine, .. } = answer else { panic!("pro0 is next: {answer:?}") };
    assert_eq!(mine, [("free0".to_owned(), 2), ("admin0".to_owned(), 1)], "pro0, then admin0, then free0");
    assert_eq!(went(&claim(line, name, "b", 4, 0.5, None).await.0), Some("pro0"));
    assert_eq!(went(&claim(line, name, "a", 4, 0.5, None).await.0), Some("admin0"), "then the highest rank");
    assert_eq!(went(&claim(line, name, "a", 4, 0.5, None).await.0), Some("free0"));
    // An unverified caller's job never draws on a reservation.
    join(line, name, "a", &job("free1", "tenant:f")).await;
    join(line, name, "b", &LineEntry { tier: Some(0), unverified: true, ..job("u0", "address:1") }).await;
    assert_eq!(went(&claim(line, name, "a", 4, 0.5, None).await.0), Some("free1"), "u0 is owed nothing");
}

async fn a_gap_holds_only_its_class_and_says_when_it_passes(line: &Arc<dyn SharedLine>, name: &str) {
    let gap = Limiter::Gcra(Gcra::new(1, 1.0 / 60.0));
    let gap_key = format!("{{{name}}}video_gap");
    let gaps = [None, Some((gap_key.as_str(), &gap))];
    let video = |id: &str| LineEntry { class: 1, ..job(id, "tenant:v") };
    join(line, name, "a", &video("v0")).await;
    join(line, name, "a", &video("v1")).await;
    join(line, name, "a", &job("i0", "tenant:i")).await;
    let [account, share, _] = keys(name);
    let claim_here = || async {
        let tiers = [];
        let claim = LineClaim {
            account: (&account, 10),
            share: (&share, 0),
            learnt: None,
            gaps: &gaps,
            tiers: &tiers,
            scan: 1000,
            candidate: None,
            lease: Lease::new(),
            told: "",
        };
        line.claim(LineAt { name, instance: "a" }, claim).await.expect("claims").0
    };
    let first = [claim_here().await, claim_here().await];
    let mut first: Vec<&str> = first.iter().filter_map(went).collect();
    first.sort();
    assert_eq!(first, ["i0", "v0"], "v1 waits for the gap; the image passes it");
    let answer = claim_here().await;
    let LineAnswer::Wait { why, wake, .. } = answer else { panic!("v1 waits: {answer:?}") };
    assert_eq!(why, LineWait::Nothing);
    assert!(wake.is_some_and(|ns| ns > Nanos::from_secs(50)), "about a minute: {wake:?}");
}

async fn a_job_joining_again_keeps_its_place_and_one_that_left_is_gone(line: &Arc<dyn SharedLine>, name: &str) {
    let (x0_tag, x0) = join(line, name, "a", &job("x0", "tenant:x")).await;
    join(line, name, "b", &job("y0", "tenant:y")).await;
    // Joining again under its name while it stands there changes nothing.
    let again = JoinAt::Again { tag: 99.0, member: x0.clone() };
    let rejoined = line.join(LineAt { name, instance: "a" }, &job("x0", "tenant:x"), &again).await.expect("joins");
    assert_eq!(rejoined, (x0_tag, x0.clone()));
    // Taken out, it is gone; told again where it stood, it stands there again, still first.
    let at = LineAt { name, instance: "a" };
    assert!(line.leave(at, &x0).await.expect("leaves"));
    assert!(!line.leave(at, &x0).await.expect("leaves"), "once");
    let again = JoinAt::Again { tag: x0_tag, member: x0.clone() };
    line.join(at, &job("x0", "tenant:x"), &again).await.expect("joins");
    assert_eq!(went(&claim(line, name, "a", 10, 0.0, None).await.0), Some("x0"));
    assert_eq!(went(&claim(line, name, "b", 10, 0.0, None).await.0), Some("y0"));
    let (empty, _) = claim(line, name, "a", 10, 0.0, None).await;
    assert!(matches!(empty, LineAnswer::Wait { why: LineWait::Nothing, .. }), "{empty:?}");
}

async fn a_turn_taken_with_slots_left_free_is_told_to_every_instance(
    store: &Arc<dyn Store>,
    line: &Arc<dyn SharedLine>,
    name: &str,
) {
    let channel = format!("{{{name}}}account:freed");
    let mut heard = store.clone().hear(&channel).expect("a shared store hears its channels");
    // A subscription may take a moment to hold (Redis): a slot given back and told, until heard.
    let slot = Limiter::Concurrency(Concurrency::new(1));
    let warm_up = format!("{{{name}}}warm_up");
    let mut ready = false;
    for _ in 0..50 {
        store.clone().release_telling(&warm_up, &slot, 0, Lease::new(), &channel);
        if tokio::time::timeout(Duration::from_millis(100), heard.changed()).await.is_ok() {
            ready = true;
            break;
        }
    }
    assert!(ready, "a slot given back and told is heard");
    // Two jobs wait on two instances; a takes its turn with slots left free: b is told to ask.
    join(line, name, "a", &job("a0", "tenant:a")).await;
    join(line, name, "b", &job("b0", "tenant:b")).await;
    heard.borrow_and_update();
    let [account, share, tier] = keys(name);
    let tiers = [(tier.as_str(), 0.0)];
    let gaps = [None];
    let claim = || LineClaim {
        account: (&account, 10),
        share: (&share, 10),
        learnt: None,
        gaps: &gaps,
        tiers: &tiers,
        scan: 1000,
        candidate: None,
        lease: Lease::new(),
        told: &channel,
    };
    let (went_a, _) = line.claim(LineAt { name, instance: "a" }, claim()).await.expect("claims");
    assert_eq!(went(&went_a), Some("a0"));
    let told = tokio::time::timeout(Duration::from_secs(5), heard.changed()).await;
    assert!(told.is_ok(), "b, whose job is next, is told");
    heard.borrow_and_update();
    // b's turn empties the line: nobody is told.
    let (went_b, _) = line.claim(LineAt { name, instance: "b" }, claim()).await.expect("claims");
    assert_eq!(went(&went_b), Some("b0"));
    let told = tokio::time::timeout(Duration::from_millis(300), heard.changed()).await;
    assert!(told.is_err(), "nobody waits: nothing told");
}
