//! The queue's own tests: the round robin, the classes' gaps and places, the tiers' reserved
//! shares and ranks, and cancel-safety of slots and places.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::round_robin::Waiting;
use super::*;
use crate::clock::ManualClock;
use crate::store::{Blocks, Broadcast, Budgets, Check, Lease, Slots, StoreFuture, Verdict};
use crate::upstream::classes::{IMAGE, VIDEO};

const GAP: Nanos = Nanos::from_secs(2);

/// Images, and videos spaced by `gap` of which `videos` may wait: numbered as [`IMAGE`] and
/// [`VIDEO`].
fn classes(gap: Nanos, videos: usize) -> JobClasses {
    let video = JobClass { min_gap: Some(gap), queue_max: Some(videos), ..JobClass::plain("video") };
    JobClasses::new(vec![JobClass::plain("image"), video])
}

fn queue(clock: &Arc<ManualClock>, slots: usize) -> Arc<FairQueue> {
    let rules = QueueRules::new(slots, 100, classes(GAP, 100));
    let queue = Arc::new(FairQueue::new(rules, clock.clone()));
    tokio::spawn(queue.clone().dispatch(CancellationToken::new()));
    queue
}

fn flow(name: &str) -> Flowing<'_> {
    Flowing { name, quantum: 1.0, standing: Standing::PLAIN }
}

async fn granted(turn: &mut Turn) -> Option<AccountSlot> {
    tokio::time::timeout(Duration::from_millis(50), turn).await.ok()?.ok()
}

#[tokio::test]
async fn round_robin_across_flows_not_first_come_first_served() {
    let clock = ManualClock::new();
    let q = queue(&clock, 1);
    let held = q.reserve(IMAGE, Standing::PLAIN).expect("room").start_now(&flow("door")).await.expect("a free slot");
    let mut turns = Vec::new();
    for i in 0..3 {
        turns.push(("a", q.reserve(IMAGE, Standing::PLAIN).expect("room").enqueue(&flow("a"), &format!("a{i}"))));
    }
    turns.push(("b", q.reserve(IMAGE, Standing::PLAIN).expect("room").enqueue(&flow("b"), "b0")));
    assert_eq!(q.position("b0").map(|p| p.ahead), Some(1), "one of a's, then b's");
    drop(held);
    let mut order = Vec::new();
    for _ in 0..4 {
        let mut next = None;
        for (i, (flow, turn)) in turns.iter_mut().enumerate() {
            if let Some(slot) = granted(turn).await {
                next = Some((i, *flow, slot));
                break;
            }
        }
        let (i, flow, slot) = next.expect("someone is served");
        order.push(flow);
        drop(turns.remove(i));
        drop(slot);
    }
    assert_eq!(order, vec!["a", "b", "a", "a"]);
}

#[tokio::test]
async fn videos_are_spaced_by_the_gap_and_images_pass_them_meanwhile() {
    let clock = ManualClock::new();
    let q = queue(&clock, 10);
    let mut v1 = q.reserve(VIDEO, Standing::PLAIN).expect("room").enqueue(&flow("a"), "v1");
    let mut v2 = q.reserve(VIDEO, Standing::PLAIN).expect("room").enqueue(&flow("a"), "v2");
    let _first = granted(&mut v1).await.expect("the first video goes at once");
    assert!(granted(&mut v2).await.is_none(), "the second waits for the gap");
    let image = q.reserve(IMAGE, Standing::PLAIN).expect("room");
    let image = image.start_now(&flow("door")).await.expect_err("someone is waiting: no overtaking at the door");
    let mut image = image.enqueue(&flow("b"), "i1");
    assert!(granted(&mut image).await.is_some(), "an image needs no gap");
    clock.advance(GAP.to_duration());
    assert!(granted(&mut v2).await.is_some());
}

#[tokio::test]
async fn a_third_class_is_spaced_and_held_to_its_places_as_its_data_says() {
    let clock = ManualClock::new();
    let audio = JobClass { min_gap: Some(Nanos::from_secs(3)), queue_max: Some(2), ..JobClass::plain("audio") };
    let mut all: Vec<JobClass> = classes(GAP, 100).iter().map(|(_, c)| c.clone()).collect();
    all.push(audio);
    let classes = JobClasses::new(all);
    let audio = classes.iter().find(|(_, c)| c.name == "audio").map(|(id, _)| id).expect("audio");
    let q = Arc::new(FairQueue::new(QueueRules::new(10, 100, classes), clock.clone()));
    tokio::spawn(q.clone().dispatch(CancellationToken::new()));
    let first = q.reserve(audio, Standing::PLAIN).expect("room");
    let first = first.start_now(&flow("door")).await.expect_err("a spaced class never takes a slot at the door");
    let mut a1 = first.enqueue(&flow("a"), "a1");
    let mut a2 = q.reserve(audio, Standing::PLAIN).expect("room").enqueue(&flow("a"), "a2");
    assert_eq!(q.reserve(audio, Standing::PLAIN).err(), Some(QueueFull::Full), "two audio jobs may wait");
    assert_eq!(q.occupancy().waiting_of(audio), 2);
    let _a1 = granted(&mut a1).await.expect("the first goes at once");
    let mut v1 = q.reserve(VIDEO, Standing::PLAIN).expect("room").enqueue(&flow("b"), "v1");
    assert!(granted(&mut v1).await.is_some(), "a video waits for its own gap, not audio's");
    clock.advance(GAP.to_duration());
    assert!(granted(&mut a2).await.is_none(), "audio's gap is longer than video's");
    clock.advance(Duration::from_secs(1));
    assert!(granted(&mut a2).await.is_some());
}

#[tokio::test]
async fn a_full_account_holds_jobs_until_a_slot_is_given_back() {
    let clock = ManualClock::new();
    let q = queue(&clock, 2);
    let a = q.reserve(IMAGE, Standing::PLAIN).expect("room").start_now(&flow("door")).await.expect("slot");
    let _b = q.reserve(IMAGE, Standing::PLAIN).expect("room").start_now(&flow("door")).await.expect("slot");
    let waiting = q.reserve(IMAGE, Standing::PLAIN).expect("room");
    let mut waiting =
        waiting.start_now(&flow("door")).await.expect_err("the account is full").enqueue(&flow("c"), "c0");
    assert!(granted(&mut waiting).await.is_none());
    assert_eq!(q.occupancy().in_flight, 2);
    drop(a);
    let _c = granted(&mut waiting).await.expect("the freed slot goes to the waiting job");
    assert_eq!(q.occupancy().in_flight, 2);
}

/// A shared store that never answers a decision (Redis behind a dead link): what it was
/// asked to give back is recorded.
#[derive(Debug, Default)]
struct Stalled {
    released: Mutex<Vec<String>>,
}

impl Budgets for Stalled {
    fn decide<'a>(&'a self, _: &'a [Check<'a>], _: &'a [&'a str], _: Lease) -> StoreFuture<'a, Verdict> {
        Box::pin(std::future::pending())
    }

    fn adjust<'a>(
        &'a self,
        _: &'a [(&'a str, &'a Limiter, crate::limit::Adjustment)],
        _: Option<&'a str>,
    ) -> StoreFuture<'a, Vec<crate::limit::Decision>> {
        Box::pin(std::future::pending())
    }

    fn forget<'a>(&'a self, _: &'a [&'a str]) -> StoreFuture<'a, u64> {
        Box::pin(std::future::pending())
    }
}

impl Slots for Stalled {
    fn release(self: Arc<Self>, key: &str, _: &Limiter, _: u64, _: Lease) {
        self.released.lock().unwrap_or_else(|p| p.into_inner()).push(key.to_owned());
    }
}

impl Blocks for Stalled {
    fn block<'a>(&'a self, _: &'a str, _: Duration) -> StoreFuture<'a, ()> {
        Box::pin(std::future::pending())
    }

    fn unblock<'a>(&'a self, _: &'a str) -> StoreFuture<'a, bool> {
        Box::pin(std::future::pending())
    }

    fn block_left<'a>(&'a self, _: &'a str) -> StoreFuture<'a, Option<Nanos>> {
        Box::pin(std::future::pending())
    }
}

impl Broadcast for Stalled {}

impl Store for Stalled {
    fn is_shared(&self) -> bool {
        true
    }
}

#[tokio::test]
async fn a_call_dropped_while_the_shared_store_decides_gives_its_slot_and_place_back() {
    let clock = ManualClock::new();
    let rules = QueueRules::new(1, 1, classes(GAP, 1));
    let metrics = Arc::new(Metrics::default());
    let q = Arc::new(FairQueue::new(rules, clock.clone()).shared_in(Arc::new(Stalled::default()), "t", metrics));
    let place = q.reserve(IMAGE, Standing::PLAIN).expect("room");
    let starting = tokio::time::timeout(Duration::from_millis(20), place.start_now(&flow("door"))).await;
    assert!(starting.is_err(), "the store never answers: the caller gives up (a client's cancel)");
    assert_eq!(q.occupancy().in_flight, 0, "the slot counted before the store was asked came back");
    let again = q.reserve(IMAGE, Standing::PLAIN).expect("the place came back");
    drop(again);
}

#[tokio::test]
async fn a_job_whose_turn_is_dropped_leaves_the_line_at_once_and_only_that_entry() {
    let clock = ManualClock::new();
    let q = queue(&clock, 1);
    let held = q.reserve(IMAGE, Standing::PLAIN).expect("room").start_now(&flow("door")).await.expect("a free slot");
    let first = q.reserve(IMAGE, Standing::PLAIN).expect("room").enqueue(&flow("a"), "a0");
    let mut second = q.reserve(IMAGE, Standing::PLAIN).expect("room").enqueue(&flow("b"), "b0");
    assert_eq!(q.occupancy().waiting, 2);
    drop(first);
    assert_eq!(q.occupancy().waiting, 1, "the cancelled call is out of the line before any slot frees");
    assert_eq!(q.position("b0").map(|p| p.ahead), Some(0), "nobody is ahead of b0 any more");
    drop(held);
    let slot = granted(&mut second).await.expect("the freed slot goes to the one still waiting");
    drop(slot);
    // A turn that got its slot has nothing to take out: the next job under that id stays.
    let mut retried = q.requeue_front(&flow("b"), "b0", IMAGE, Nanos::ZERO);
    drop(second);
    assert!(granted(&mut retried).await.is_some(), "a retry under the same id is not taken out");
}

#[tokio::test]
async fn a_full_queue_refuses_and_unused_places_come_back() {
    let clock = ManualClock::new();
    let rules = QueueRules::new(1, 3, classes(GAP, 1));
    let q = Arc::new(FairQueue::new(rules, clock.clone()));
    let video = q.reserve(VIDEO, Standing::PLAIN).expect("room");
    assert!(q.reserve(VIDEO, Standing::PLAIN).is_err(), "one video may wait");
    let _i1 = q.reserve(IMAGE, Standing::PLAIN).expect("room");
    let i2 = q.reserve(IMAGE, Standing::PLAIN).expect("room");
    assert!(q.reserve(IMAGE, Standing::PLAIN).is_err(), "three places in all");
    drop(i2);
    assert!(q.reserve(IMAGE, Standing::PLAIN).is_ok(), "an unused reservation gives its place back");
    drop(video);
}

/// A queue of `slots` slots and `places` places whose tier `pro` is reserved `pro` of both,
/// `admin` ranks 2 and `guest` -1.
fn tiered(clock: &Arc<ManualClock>, slots: usize, places: usize, pro: f64) -> Arc<FairQueue> {
    let tiers = vec![
        TierRule { name: "admin".into(), reserved: 0.0, rank: 2 },
        TierRule { name: "guest".into(), reserved: 0.0, rank: -1 },
        TierRule { name: "pro".into(), reserved: pro, rank: 0 },
    ];
    let rules = QueueRules::new(slots, places, classes(GAP, 100)).with_tiers(tiers);
    let queue = Arc::new(FairQueue::new(rules, clock.clone()));
    tokio::spawn(queue.clone().dispatch(CancellationToken::new()));
    queue
}

#[tokio::test]
async fn a_reserved_slot_is_lent_while_its_tier_waits_for_none_and_comes_back_at_the_next_free_slot() {
    let clock = ManualClock::new();
    let q = tiered(&clock, 2, 20, 0.5);
    let pro = q.rules().standing("pro", false);
    let free = Standing::PLAIN;
    let first = q.reserve(IMAGE, free).expect("room").start_now(&flow("door")).await.expect("a free slot");
    let _second = q
        .reserve(IMAGE, free)
        .expect("room")
        .start_now(&flow("door"))
        .await
        .expect("pro's slot, lent: nobody of pro waits");
    let mut flood = Vec::new();
    for i in 0..5 {
        flood.push(q.reserve(IMAGE, free).expect("room").enqueue(&flow("free"), &format!("f{i}")));
    }
    let mut mine = q.reserve(IMAGE, pro).expect("room").enqueue(&Flowing { standing: pro, ..flow("pro") }, "p0");
    assert_eq!(q.occupancy().per_tier[2].waiting, 1);
    assert_eq!(q.position("p0").map(|p| p.ahead), Some(0), "pro is next, however many free jobs wait");
    assert_eq!(q.position("f0").map(|p| p.ahead), Some(1), "pro goes before the free tier's first");
    drop(first);
    let slot = granted(&mut mine).await.expect("the next slot that frees goes to pro, owed one");
    assert_eq!(q.occupancy().per_tier[2].in_flight, 1);
    for turn in &mut flood {
        assert!(granted(turn).await.is_none(), "the free tier waits");
    }
    drop(slot);
    assert!(granted(&mut flood[0]).await.is_some(), "pro's slot, lent again once pro waits for none");
}

#[tokio::test]
async fn when_the_account_is_full_the_highest_rank_goes_first_and_ranks_alike_take_turns() {
    let clock = ManualClock::new();
    let q = tiered(&clock, 1, 20, 0.0);
    let held = q.reserve(IMAGE, Standing::PLAIN).expect("room").start_now(&flow("door")).await.expect("a free slot");
    let mut turns = Vec::new();
    for (tier, flow_name, id) in
        [("guest", "g", "g0"), ("default", "d", "d0"), ("default", "e", "e0"), ("admin", "a", "a0")]
    {
        let standing = q.rules().standing(tier, false);
        let place = q.reserve(IMAGE, standing).expect("room");
        turns.push((id, place.enqueue(&Flowing { standing, ..flow(flow_name) }, id)));
    }
    assert_eq!(q.position("a0").map(|p| p.ahead), Some(0));
    assert_eq!(q.position("g0").map(|p| p.ahead), Some(3), "the lowest rank goes last");
    drop(held);
    let mut order = Vec::new();
    while !turns.is_empty() {
        let mut next = None;
        for (i, (id, turn)) in turns.iter_mut().enumerate() {
            if let Some(slot) = granted(turn).await {
                next = Some((i, *id, slot));
                break;
            }
        }
        let (i, id, slot) = next.expect("someone is served");
        order.push(id);
        drop(turns.remove(i));
        drop(slot);
    }
    assert_eq!(order, ["a0", "d0", "e0", "g0"]);
}

#[tokio::test]
async fn a_reserved_tiers_places_are_never_taken_by_another_and_an_unverified_caller_draws_on_none() {
    let clock = ManualClock::new();
    let q = tiered(&clock, 1, 10, 0.5);
    let pro = q.rules().standing("pro", false);
    assert_eq!(q.rules().standing("pro", true).reserved_tier(), None, "a made-up key proves no tier");
    let mut places = Vec::new();
    for _ in 0..5 {
        places.push(q.reserve(IMAGE, Standing::PLAIN).expect("an unreserved place"));
    }
    assert_eq!(q.reserve(IMAGE, Standing::PLAIN).err(), Some(QueueFull::Reserved), "the other five are pro's");
    assert_eq!(q.reserve(IMAGE, Standing::plain(true)).err(), Some(QueueFull::Reserved));
    for _ in 0..5 {
        places.push(q.reserve(IMAGE, pro).expect("pro's own place"));
    }
    assert_eq!(q.reserve(IMAGE, pro).err(), Some(QueueFull::Full));
    places.truncate(4);
    assert!(q.reserve(IMAGE, Standing::PLAIN).is_ok(), "a place given back is anyone's again");
}

#[test]
fn a_removed_job_leaves_the_line_and_weights_give_a_heavier_flow_more_turns() {
    let mut state = State::new(&QueueRules::new(100, 100, classes(GAP, 100)));
    let push = |state: &mut State, flow: &str, q: f64, id: &str| {
        let (turn, _) = oneshot::channel();
        let job = Waiting::new(id, IMAGE, Standing::PLAIN, Nanos::ZERO, turn);
        state.push(flow, q, job, false);
    };
    for i in 0..8 {
        push(&mut state, "heavy", 3.0, &format!("h{i}"));
        push(&mut state, "light", 1.0, &format!("l{i}"));
    }
    assert!(state.remove("l7"));
    let served: Vec<String> = (0..8)
        .filter_map(|_| state.pick(&QueueRules::new(100, 100, classes(GAP, 100)), Nanos::ZERO))
        .map(|w| w.id)
        .collect();
    assert_eq!(served.iter().filter(|id| id.starts_with('h')).count(), 6, "3:1 by weight: {served:?}");
}
