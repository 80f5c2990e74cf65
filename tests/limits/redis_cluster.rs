//! The Redis store on a Redis Cluster (three primaries): a decision over the keys of one hash
//! tag is one atomic script on the node that holds the tag's slot, all-or-nothing and exact like
//! the memory store; callers whose tags hash to different nodes each work there; instances
//! sharing the cluster share one budget; a settlement sent again under its mark lands once;
//! every node reloads a flushed script cache; and keys that span slots, or a malformed cluster
//! URL, are refused with an error that says so.
//!
//! Parity runs walk an explicit clock while Redis expires keys on its own. Every gap and every
//! span is a multiple of [`STEP`], so a key's `forget_at` is either passed or at least a step
//! ahead, never close enough to expire in real time between two calls (tests/limits/redis_store.rs
//! proves the scripts exact within a step, on one server).

use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use crate::test_redis::TestRedisCluster;
use mcp_ratelimit::Config;
use mcp_ratelimit::clock::Nanos;
use mcp_ratelimit::limit::{Adjustment, Concurrency, Decision, Limiter, SlidingLog, TokenBucket};
use mcp_ratelimit::store::redis::{HeldLease, RedisStore, Renewed};
use mcp_ratelimit::store::{Check, MemoryStore};
use mcp_ratelimit::store::{Lease, StoreError};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestCaseError, TestRunner};
use serde_json::json;

const SEC: Nanos = Nanos::from_secs(1);
/// 2026-01-01T00:00:00Z.
const EPOCH: Nanos = Nanos::from_secs(1_767_225_600);
/// The grain of parity runs' clocks and spans (see the module doc).
const STEP: Nanos = Nanos::from_millis(250);
/// Generous: a loaded CI machine must not turn a slow answer into a failure.
const TIMEOUT: Duration = Duration::from_secs(5);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a tokio runtime")
}

fn runner() -> TestRunner {
    TestRunner::new(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })
}

/// The three scopes of one tenant's tool call, as the guard names them: one hash tag.
fn tenant_keys(cluster: &TestRedisCluster, tag: &str) -> [String; 3] {
    [cluster.key(tag, "caller:x"), cluster.key(tag, "tenant:acme"), cluster.key(tag, "tenant:acme:tool:y")]
}

/// The Redis store on the cluster and the memory store, fed the same calls: every decision
/// must match.
struct Twins {
    redis: RedisStore,
    memory: MemoryStore,
}

impl Twins {
    async fn start(cluster: &TestRedisCluster) -> Self {
        Self { redis: RedisStore::connect(&cluster.url, TIMEOUT).await.expect("connects"), memory: MemoryStore::new() }
    }

    async fn decide(&self, checks: &[Check<'_>], now: Nanos) -> Vec<Decision> {
        let decisions = self.redis.decide_at(checks, now).await.expect("the cluster decides");
        assert_eq!(decisions, self.memory.decide_at(checks, now), "the cluster and memory disagree");
        decisions
    }

    async fn remaining(&self, checks: &[Check<'_>], now: Nanos) -> Vec<u64> {
        let peeks: Vec<Check<'_>> = checks.iter().map(|c| Check { cost: 0, ..*c }).collect();
        self.decide(&peeks, now).await.iter().map(|d| d.remaining).collect()
    }
}

#[tokio::test]
async fn a_tenants_three_scopes_are_charged_all_or_nothing_on_the_cluster() {
    let cluster = TestRedisCluster::start();
    let twins = Twins::start(&cluster).await;
    let [caller, tenant, tool] = tenant_keys(&cluster, "t:acme");
    let bucket = Limiter::TokenBucket(TokenBucket::new(100, 1.0));
    let log = Limiter::SlidingLog(SlidingLog::new(50, 60 * SEC));
    let tool_log = Limiter::SlidingLog(SlidingLog::new(5, 60 * SEC));
    let call = |cost| {
        [
            Check { key: &caller, limiter: &bucket, cost, shadow: false },
            Check { key: &tenant, limiter: &log, cost, shadow: false },
            Check { key: &tool, limiter: &tool_log, cost, shadow: false },
        ]
    };

    assert!(twins.decide(&call(4), EPOCH).await.iter().all(|d| d.allowed));
    assert_eq!(twins.remaining(&call(0), EPOCH).await, [96, 46, 1]);
    // The tool has 1 left: a call costing 2 passes the caller and tenant, and charges neither.
    let refused = twins.decide(&call(2), EPOCH).await;
    assert_eq!(refused.iter().map(|d| d.allowed).collect::<Vec<_>>(), [true, true, false]);
    assert_eq!(refused[2].retry_after, 60 * SEC, "the tool's oldest call leaves its window in 60 s");
    assert_eq!(twins.remaining(&call(0), EPOCH).await, [96, 46, 1], "a refused call charged a scope");
    assert!(twins.decide(&call(1), EPOCH).await.iter().all(|d| d.allowed));
    assert_eq!(twins.remaining(&call(0), EPOCH).await, [95, 45, 0], "an admitted call charges every scope");
}

#[tokio::test]
async fn a_settlement_sent_again_under_its_mark_lands_once_on_the_node_of_its_tag() {
    let cluster = TestRedisCluster::start();
    let twins = Twins::start(&cluster).await;
    let [caller, tenant, tool] = tenant_keys(&cluster, "t:acme");
    let bucket = Limiter::TokenBucket(TokenBucket::new(100, 0.0001));
    let checks = [&caller, &tenant, &tool].map(|key| Check { key, limiter: &bucket, cost: 30, shadow: false });
    assert!(twins.decide(&checks, EPOCH).await.iter().all(|d| d.allowed));
    // The mark the guard gives a settlement: under the first budget's key, so its tag's slot.
    let mark = format!("{caller}:settled:{:016x}", rand::random::<u64>());
    let budgets = [&caller, &tenant, &tool].map(|key| (key.as_str(), &bucket, Adjustment::Refund(4)));
    for _ in 0..3 {
        let levels =
            twins.redis.adjust(&budgets, Some(&mark), Some(EPOCH)).await.expect("one script on the tag's node");
        assert_eq!(levels.iter().map(|d| d.remaining).collect::<Vec<_>>(), [74, 74, 74], "4 back, once");
    }
}

/// One call of a parity run: steps of [`STEP`] since the previous call, and each scope's cost.
#[derive(Debug, Clone)]
struct Call {
    steps: u64,
    costs: [u64; 3],
}

#[test]
fn token_bucket_and_sliding_log_decide_on_the_cluster_like_the_memory_store() {
    let cluster = TestRedisCluster::start();
    let runtime = runtime();
    let store = runtime.block_on(RedisStore::connect(&cluster.url, TIMEOUT)).expect("connects");
    // Periods and windows in whole steps: 2 per 500 ms, 1 per second, 6 per 2 s, 3 per 1.25 s.
    let limiters = [
        Limiter::TokenBucket(TokenBucket::new(6, 2.0)),
        Limiter::TokenBucket(TokenBucket::new(4, 1.0)),
        Limiter::SlidingLog(SlidingLog::new(6, 8 * STEP)),
        Limiter::SlidingLog(SlidingLog::new(3, 5 * STEP)),
    ];
    let call = (prop_oneof![4 => Just(0u64), 3 => 1..=4u64, 1 => 5..=40u64], [0..=4u64, 0..=4u64, 0..=4u64])
        .prop_map(|(steps, costs)| Call { steps, costs });
    let strategy = ([0..4usize, 0..4usize, 0..4usize], prop::collection::vec(call, 1..=25));
    let case = std::cell::Cell::new(0);
    let outcome = runner().run(&strategy, |(picks, calls)| {
        case.set(case.get() + 1);
        // A tag per case: the cases' keys spread over every node of the cluster.
        let keys = tenant_keys(&cluster, &format!("t:acme{}", case.get()));
        let memory = MemoryStore::new();
        let mut now = EPOCH;
        for (n, call) in calls.iter().enumerate() {
            now += call.steps * STEP;
            let checks: Vec<Check<'_>> = (0..3)
                .map(|i| {
                    let limiter = &limiters[picks[i]];
                    Check { key: &keys[i], limiter, cost: call.costs[i].min(limiter.capacity()), shadow: false }
                })
                .collect();
            let expected = memory.decide_at(&checks, now);
            let got = runtime
                .block_on(store.decide_at(&checks, now))
                .map_err(|e| TestCaseError::fail(format!("call {n}: {e}")))?;
            prop_assert_eq!(got, expected, "call {} at +{} steps, costs {:?}", n, (now - EPOCH) / STEP, call.costs);
        }
        Ok(())
    });
    if let Err(e) = outcome {
        panic!("{e}");
    }
}

#[test]
fn in_flight_slots_on_the_cluster_are_taken_and_given_back_like_the_memory_store() {
    let cluster = TestRedisCluster::start();
    let runtime = runtime();
    let store = runtime.block_on(RedisStore::connect(&cluster.url, TIMEOUT)).expect("connects");
    let limiters = [1u64, 3, 5].map(|max| Limiter::Concurrency(Concurrency::new(max)));
    // Take slots (on all three scopes at once) or give back the latest admission's.
    let op = (any::<bool>(), [0..=3u64, 0..=3u64, 0..=3u64]);
    let strategy = prop::collection::vec(op, 1..=30);
    let case = std::cell::Cell::new(0);
    let outcome = runner().run(&strategy, |ops| {
        case.set(case.get() + 1);
        let keys = tenant_keys(&cluster, &format!("t:busy{}", case.get()));
        let memory = MemoryStore::new();
        let mut held = vec![];
        for (n, (take, costs)) in ops.into_iter().enumerate() {
            let checks: Vec<Check<'_>> = (0..3)
                .map(|i| Check {
                    key: &keys[i],
                    limiter: &limiters[i],
                    cost: costs[i].min(limiters[i].capacity()),
                    shadow: false,
                })
                .collect();
            if take || held.is_empty() {
                let expected = memory.decide_at(&checks, EPOCH);
                // Leases on Redis's own clock: none runs out within a case.
                let lease = Lease::new();
                let got = runtime
                    .block_on(store.decide_leased(&checks, lease, None))
                    .map_err(|e| TestCaseError::fail(format!("call {n}: {e}")))?;
                // Decided when Redis's clock said; the same in every other field.
                let got: Vec<_> = got.into_iter().map(|d| mcp_ratelimit::limit::Decision { at: EPOCH, ..d }).collect();
                prop_assert_eq!(&got, &expected, "call {}, costs {:?}", n, costs);
                if expected.iter().all(|d| d.allowed) {
                    held.push((lease, checks.iter().map(|c| c.cost).collect::<Vec<_>>()));
                }
            } else if let Some((lease, costs)) = held.pop() {
                for i in 0..3 {
                    memory.release_at(&keys[i], &limiters[i], costs[i], EPOCH);
                    runtime
                        .block_on(store.release(&keys[i], lease))
                        .map_err(|e| TestCaseError::fail(format!("release {n}: {e}")))?;
                }
            }
        }
        Ok(())
    });
    if let Err(e) = outcome {
        panic!("{e}");
    }
}

/// Two tags whose slots are held by different primaries, found by trying callers in turn.
fn tags_on_two_nodes(cluster: &TestRedisCluster) -> (String, String) {
    let first = "c:caller-0".to_owned();
    let node = cluster.primary_of(&cluster.key(&first, "caller"));
    let second = (1..)
        .map(|i| format!("c:caller-{i}"))
        .find(|tag| cluster.primary_of(&cluster.key(tag, "caller")) != node)
        .expect("three primaries");
    (first, second)
}

#[tokio::test]
async fn callers_whose_tags_hash_to_different_nodes_are_each_decided_on_their_own_node() {
    let cluster = TestRedisCluster::start();
    assert_eq!(cluster.primaries().len(), 3, "three primaries share the slots");
    let store = RedisStore::connect(&cluster.url, TIMEOUT).await.expect("connects");
    let (a, b) = tags_on_two_nodes(&cluster);
    let bucket = Limiter::TokenBucket(TokenBucket::new(10, 1.0 / 3_600.0));
    for (tag, cost) in [(&a, 3), (&b, 7)] {
        let keys = [cluster.key(tag, "caller"), cluster.key(tag, "tool:y")];
        let checks = keys.each_ref().map(|key| Check { key, limiter: &bucket, cost, shadow: false });
        let decisions = store.decide(&checks).await.expect("decides");
        assert!(decisions.iter().all(|d| d.allowed && d.remaining == 10 - cost), "{tag}: {decisions:?}");
        let node = cluster.primary_of(&keys[0]);
        for key in &keys {
            assert!(TestRedisCluster::holds(&node, key), "{key} is not on {node}, the primary of its slot");
        }
        for other in cluster.primaries().iter().filter(|n| **n != node) {
            assert!(!TestRedisCluster::holds(other, &keys[0]), "{} is also on {other}", keys[0]);
        }
    }
    assert_ne!(cluster.primary_of(&cluster.key(&a, "caller")), cluster.primary_of(&cluster.key(&b, "caller")));
}

/// What each budget has left at [`EPOCH`], read at cost 0.
async fn remaining_of(store: &RedisStore, budgets: &[(&str, &Limiter)]) -> Vec<u64> {
    let checks: Vec<Check<'_>> =
        budgets.iter().map(|&(key, limiter)| Check { key, limiter, cost: 0, shadow: false }).collect();
    store.decide_at(&checks, EPOCH).await.expect("decides").iter().map(|d| d.remaining).collect()
}

/// A call's budgets on two slots (a caller's, and an OAuth client's shared across tenants, which
/// has a tag of its own): decided as one, all or nothing across the nodes; settled under one mark
/// that lands once on each; forgotten together. In-flight slots away from the call's own slot
/// are refused with an error that says so, and charge nothing.
#[tokio::test]
async fn a_call_spanning_slots_is_all_or_nothing_across_them() {
    let cluster = TestRedisCluster::start();
    let store = RedisStore::connect(&cluster.url, TIMEOUT).await.expect("connects");
    let (a, b) = tags_on_two_nodes(&cluster);
    let (home, away) = (cluster.key(&a, "caller"), cluster.key(&b, "client:app"));
    let (roomy, tight) = (
        Limiter::TokenBucket(TokenBucket::new(10, 1.0 / 3_600.0)),
        Limiter::TokenBucket(TokenBucket::new(3, 1.0 / 3_600.0)),
    );
    let call = |cost| {
        [
            Check { key: &home, limiter: &roomy, cost, shadow: false },
            Check { key: &away, limiter: &tight, cost, shadow: false },
        ]
    };
    let admitted = store.decide_at(&call(2), EPOCH).await.expect("decided across two slots");
    assert!(admitted.iter().all(|d| d.allowed), "{admitted:?}");
    assert_eq!(remaining_of(&store, &[(&home, &roomy), (&away, &tight)]).await, [8, 1]);
    // The away budget has 1 left: a call of 2 is refused there, and the home budget keeps its 8.
    let refused = store.decide_at(&call(2), EPOCH).await.expect("decided");
    assert_eq!(refused.iter().map(|d| d.allowed).collect::<Vec<_>>(), [true, false], "{refused:?}");
    assert!(refused[1].retry_after > Nanos::ZERO);
    assert_eq!(
        remaining_of(&store, &[(&home, &roomy), (&away, &tight)]).await,
        [8, 1],
        "a refused call charged nothing on either node"
    );
    // The home budget refuses (8 left, 9 asked) after the away one admitted: its charge is given
    // back.
    let heavy = [
        Check { key: &home, limiter: &roomy, cost: 9, shadow: false },
        Check { key: &away, limiter: &tight, cost: 1, shadow: false },
    ];
    let refused = store.decide_at(&heavy, EPOCH).await.expect("decided");
    assert_eq!(refused.iter().map(|d| d.allowed).collect::<Vec<_>>(), [false, true], "{refused:?}");
    assert_eq!(
        remaining_of(&store, &[(&home, &roomy), (&away, &tight)]).await,
        [8, 1],
        "the away budget got its charge back"
    );

    // A settlement of both under one mark, sent twice (its answer lost): it lands once on each.
    let mark = format!("{home}:settled:{:016x}", rand::random::<u64>());
    let refund = [(home.as_str(), &roomy, Adjustment::Refund(1)), (away.as_str(), &tight, Adjustment::Refund(1))];
    store.adjust(&refund, Some(&mark), Some(EPOCH)).await.expect("adjusted on two nodes");
    store.adjust(&refund, Some(&mark), Some(EPOCH)).await.expect("sent again");
    assert_eq!(remaining_of(&store, &[(&home, &roomy), (&away, &tight)]).await, [9, 2], "each budget refunded once");
    assert_eq!(store.forget(&[&home, &away]).await.expect("forgotten on two nodes"), 2);
    assert_eq!(remaining_of(&store, &[(&home, &roomy), (&away, &tight)]).await, [10, 3]);

    // In-flight slots are held under a lease on the call's own slot: none away from it.
    let slots = Limiter::Concurrency(Concurrency::new(2));
    let apart = [
        Check { key: &home, limiter: &roomy, cost: 1, shadow: false },
        Check { key: &away, limiter: &slots, cost: 1, shadow: false },
    ];
    let e = store.decide_at(&apart, EPOCH).await.expect_err("slots on another slot");
    assert!(matches!(e, StoreError::KeysApart { .. }), "{e:?}");
    assert!(e.to_string().contains("hash tag"), "{e}");
    assert_eq!(remaining_of(&store, &[(&home, &roomy), (&away, &tight)]).await, [10, 3], "and nothing was charged");
}

#[tokio::test]
async fn leases_of_callers_on_different_nodes_are_renewed_together() {
    let cluster = TestRedisCluster::start();
    let store =
        RedisStore::connect(&cluster.url, TIMEOUT).await.expect("connects").with_lease(Duration::from_millis(300));
    let (a, b) = tags_on_two_nodes(&cluster);
    let (ka, kb) = (cluster.key(&a, "in_flight"), cluster.key(&b, "in_flight"));
    let slots = Limiter::Concurrency(Concurrency::new(2));
    let (la, lb) = (Lease::new(), Lease::new());
    for (key, lease) in [(&ka, la), (&kb, lb)] {
        let taken = store.decide_leased(&[Check { key, limiter: &slots, cost: 2, shadow: false }], lease, None).await;
        assert!(taken.expect("decides")[0].allowed);
    }
    let held = [
        HeldLease { key: &ka, lease: la, units: 2, capacity: 2 },
        HeldLease { key: &kb, lease: lb, units: 2, capacity: 2 },
    ];
    // Renewed in time: nothing had expired, on either node.
    assert_eq!(store.renew(&held).await.expect("renews across slots"), [Renewed::Renewed; 2]);
    // Leases that ran out, without waiting for them to: given back, then taken again at a clock
    // reading a second ago (the nodes read this host's clock), so by Redis's clock they expired
    // 700 ms ago. Renewed, both are taken again.
    for (key, lease) in [(&ka, la), (&kb, lb)] {
        store.release(key, lease).await.expect("gives the lease back");
    }
    let second_ago = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .saturating_sub(Duration::from_secs(1));
    let second_ago: Nanos = Nanos::new(u64::try_from(second_ago.as_micros()).expect("fits") * 1_000);
    let (la, lb) = (Lease::new(), Lease::new());
    for (key, lease) in [(&ka, la), (&kb, lb)] {
        let check = [Check { key, limiter: &slots, cost: 2, shadow: false }];
        let taken = store.decide_leased(&check, lease, Some(second_ago)).await;
        assert!(taken.expect("decides")[0].allowed);
    }
    let held = [
        HeldLease { key: &ka, lease: la, units: 2, capacity: 2 },
        HeldLease { key: &kb, lease: lb, units: 2, capacity: 2 },
    ];
    assert_eq!(store.renew(&held).await.expect("renews across slots"), [Renewed::Retaken; 2]);
    for key in [&ka, &kb] {
        let more = store.decide(&[Check { key, limiter: &slots, cost: 1, shadow: false }]).await.expect("decides");
        assert!(!more[0].allowed, "{key}: the renewed lease holds both slots");
    }
}

#[tokio::test]
async fn every_node_reloads_a_flushed_script_cache() {
    // Server-wide state: a cluster of this test's own.
    let cluster = TestRedisCluster::private();
    let store = RedisStore::connect(&cluster.url, TIMEOUT).await.expect("connects");
    let bucket = Limiter::TokenBucket(TokenBucket::new(10, 1.0 / 3_600.0));
    let primaries = cluster.primaries();
    for node in &primaries {
        // A key this node holds.
        let key = (0..)
            .map(|i| cluster.key(&format!("c:flush-{i}"), "caller"))
            .find(|key| cluster.primary_of(key) == *node)
            .expect("a key on every primary");
        for other in &primaries {
            let mut connection =
                redis::Client::open(other.as_str()).and_then(|c| c.get_connection()).expect("node connection");
            let () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut connection).expect("SCRIPT FLUSH");
        }
        let check = [Check { key: &key, limiter: &bucket, cost: 1, shadow: false }];
        assert_eq!(store.decide(&check).await.expect("decides after SCRIPT FLUSH")[0].remaining, 9, "{node}");
        assert!(TestRedisCluster::holds(node, &key));
    }
}

/// 8 tasks × 100 calls through one store on one key; returns the calls admitted.
async fn hammer(store: Arc<RedisStore>, key: Arc<String>, limiter: Arc<Limiter>) -> usize {
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let (store, key, limiter) = (store.clone(), key.clone(), limiter.clone());
            tokio::spawn(async move {
                let mut admitted = 0;
                for _ in 0..100 {
                    let check = Check { key: &key, limiter: &limiter, cost: 1, shadow: false };
                    if store.decide(&[check]).await.expect("decides")[0].allowed {
                        admitted += 1;
                    }
                }
                admitted
            })
        })
        .collect();
    let mut admitted = 0;
    for task in tasks {
        admitted += task.await.expect("task finished");
    }
    admitted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_instances_on_one_tagged_key_admit_exactly_the_burst() {
    let cluster = TestRedisCluster::start();
    let key = Arc::new(cluster.key("t:acme", "tenant:acme"));
    let limiter = Arc::new(Limiter::TokenBucket(TokenBucket::new(500, 1.0 / 3_600.0)));
    let mut instances = vec![];
    for _ in 0..3 {
        let store = Arc::new(RedisStore::connect(&cluster.url, TIMEOUT).await.expect("connects"));
        instances.push(tokio::spawn(hammer(store, key.clone(), limiter.clone())));
    }
    let mut admitted = 0;
    for instance in instances {
        admitted += instance.await.expect("instance finished");
    }
    assert_eq!(admitted, 500, "3 instances × 8 tasks × 100 calls on a burst of 500");
}

/// Two servers on the cluster, callers known by OAuth tokens: one client application's
/// subjects, in two tenants (so two hash tags beside the client's own), share its budget
/// across both servers; refused, they are charged nothing of their own; a settled price is
/// given back on every node it was charged on.
#[tokio::test]
async fn an_oauth_clients_budget_spans_tenants_and_servers_on_the_cluster() {
    let cluster = TestRedisCluster::start();
    let provider = crate::oauth::Provider::start(json!({})).await;
    let config = format!(
        "{NO_LOOP_DETECTION}[store]\nbackend = \"redis\"\nredis_url = \"{}\"\ntimeout_ms = 2000\n\
         [auth.oauth]\nissuer = \"{}\"\naudience = \"https://mcp.example.com/mcp\"\n\
         [limits.client]\nalgorithm = \"token_bucket\"\nburst = 6\nrefill_per_sec = 0.001\n\
         [tools.generate_image_to_video]\ncost = 5\n",
        cluster.url, provider.issuer
    );
    let wall = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("now");
    let wall = u64::try_from(wall.as_nanos()).expect("fits");
    let servers = [
        TestServer::start_on(&config, mcp_ratelimit::clock::ManualClock::starting_at(Nanos::new(wall))).await,
        TestServer::start_on(&config, mcp_ratelimit::clock::ManualClock::starting_at(Nanos::new(wall))).await,
    ];
    let app = format!("app-{:08x}", rand::random::<u32>());
    let mint = |sub: &str, org: &str| {
        provider.mint(json!({"sub": sub, "aud": "https://mcp.example.com/mcp", "org_id": org, "client_id": app}))
    };
    let (alice, bob) = (mint("alice", "acme").await, mint("bob", "globex").await);
    let clients = [servers[0].client(Some(&alice)).await, servers[1].client(Some(&bob)).await];
    let mut admitted = 0;
    for client in clients.iter().cycle().take(10) {
        let answer = call(client, "list_articles", json!({})).await;
        if !is_error(&answer) {
            admitted += 1;
        } else {
            assert_eq!(structured(&answer)["error"]["scope"], format!("client:{app}"), "{answer:?}");
        }
    }
    assert_eq!(admitted, 6, "one client's budget across two tenants and two servers");
    let status = call(&clients[0], "rate_limit_status", json!({})).await;
    assert_eq!(budget(&status, "caller:sub:")["remaining"], 57, "alice paid for her 3 calls only: {status:?}");
    assert_eq!(budget(&status, "client:")["remaining"], 0);
}

/// A caller token no other test (or run, on a shared cluster) uses.
fn token(name: &str) -> String {
    format!("{name}-{:016x}", rand::random::<u64>())
}

/// The suite every backend must pass, on a Redis Cluster (every key of one call under one tag).
#[tokio::test]
async fn the_cluster_passes_the_backend_suite() {
    let cluster = TestRedisCluster::start();
    let store = RedisStore::connect(&cluster.url, TIMEOUT).await.expect("connects");
    mcp_ratelimit::store::suite::run(std::sync::Arc::new(store), &cluster.key("suite", "")).await;
}

/// The same with budget slices: a busy key's top-ups ride on its own slot, and the last units are
/// spent and refused exactly.
#[tokio::test]
async fn the_cluster_with_slices_passes_the_backend_suite() {
    let cluster = TestRedisCluster::start();
    let rules = mcp_ratelimit::store::redis::SliceRules { most: 64, lasts: Duration::from_secs(30) };
    let store = RedisStore::connect(&cluster.url, TIMEOUT).await.expect("connects");
    let store = store.with_slices(rules, mcp_ratelimit::clock::SystemClock::shared()).shared();
    mcp_ratelimit::store::suite::run(store.clone(), &cluster.key("sliced", "")).await;
    assert_eq!(store.slices_held(), (0, 0), "the busy budget's slices were spent to the last unit");
}

#[tokio::test]
async fn two_servers_on_the_cluster_give_one_caller_one_budget_and_one_in_flight_cap() {
    let cluster = TestRedisCluster::start();
    // A caller budget that does not refill while the test runs (Redis's clock is real time).
    let config = format!(
        "[store]\nbackend = \"redis\"\nredis_url = \"{}\"\ntimeout_ms = 500\n\
         [limits.caller]\nrefill_per_sec = 0.001\n[mock_upstream]\nimage_job_ms = 600000\n{NO_PROGRESS_CHECK}",
        cluster.url
    );
    let servers = [TestServer::start(&config).await, TestServer::start(&config).await];

    let reader = token("reader");
    let clients = [servers[0].client(Some(&reader)).await, servers[1].client(Some(&reader)).await];
    let mut admitted = 0;
    let mut refusal = None;
    for i in 0..90 {
        let r = call(&clients[i % 2], "list_articles", json!({"query": format!("q{i}")})).await;
        if is_error(&r) {
            refusal.get_or_insert(r);
        } else {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 60, "one budget of 60 across two instances, not 120");
    let refusal = refusal.expect("refused past the shared budget");
    assert_eq!(error_code(&refusal), Some("rate_limited"));
    assert!(structured(&refusal)["error"]["scope"].as_str().is_some_and(|s| s.starts_with("caller:tok:")));

    let painter = token("painter");
    let clients = [servers[0].client(Some(&painter)).await, servers[1].client(Some(&painter)).await];
    let mut accepted = Vec::new();
    for i in 0..5 {
        let r = call(&clients[i % 2], "generate_image", json!({"prompt": format!("p{i}")})).await;
        accepted.push(structured(&r)["predict_id"].as_str().expect("accepted").to_owned());
    }
    let busy = call(&clients[1], "generate_image", json!({"prompt": "one more"})).await;
    assert_eq!(error_code(&busy), Some("busy"), "one in-flight cap of 5 across the instances");

    // A cancelled job gives its slot back on the cluster: the other instance can use it.
    let r = call(&clients[0], "cancel_prediction", json!({"predict_id": accepted[0]})).await;
    assert_eq!(structured(&r)["status"], "canceled", "{}", text(&r));
    eventually("the slot came back on the cluster", || async {
        let status = call(&clients[1], "rate_limit_status", json!({})).await;
        budget(&status, "in_flight:caller:")["remaining"] == 1
    })
    .await;
    assert!(!is_error(&call(&clients[1], "generate_image", json!({"prompt": "in its place"})).await));
}

fn redis_config(url: &str) -> String {
    format!("[store]\nbackend = \"redis\"\nredis_url = \"{url}\"\n")
}

#[test]
fn a_malformed_cluster_url_is_refused_naming_store_redis_url() {
    for (url, why) in [
        ("redis+cluster://", "no host"),
        ("redis+cluster://10.0.0.1:7000,:7001", "empty host"),
        ("redis+cluster://10.0.0.1:7000,10.0.0.2:70000", "invalid port"),
        ("redis+cluster://:hunter2@10.0.0.1:seven", "invalid port"),
        ("redis+cluster://10.0.0.1:0", "port 0"),
        ("redis+cluster://10.0.0.1:7000/2", "only database 0"),
        ("redis://10.0.0.1:7000,http://10.0.0.2:7000", "not redis://"),
        ("rediss://10.0.0.1:7000,redis://10.0.0.2:7000", "all TLS or none"),
        ("redis://:a@10.0.0.1:7000,redis://:b@10.0.0.2:7000", "password"),
        ("cluster://10.0.0.1:7000", "not redis://"),
    ] {
        let e =
            Config::from_toml(&redis_config(url), &mcp_ratelimit::mcp::tools::catalogue()).expect_err(url).to_string();
        assert!(e.contains("`store.redis_url`") && e.contains(why), "{url}: {e}");
        assert!(!e.contains("hunter2"), "{url}: the password is shown: {e}");
    }
    for url in [
        "redis+cluster://10.0.0.1:7000,10.0.0.2:7001,[::1]:7002",
        "redis+cluster://:secret@redis-a.internal,redis-b.internal:7001/0",
        "redis://10.0.0.1:7000, redis://10.0.0.2:7001",
        "redis://:secret@10.0.0.1:6379/3",
        "rediss://10.0.0.1:6380",
        "rediss+cluster://:secret@10.0.0.1:7000,10.0.0.2:7000",
    ] {
        assert!(
            Config::from_toml(&redis_config(url), &mcp_ratelimit::mcp::tools::catalogue()).is_ok(),
            "{url} is refused"
        );
    }
}

#[tokio::test]
async fn an_unreachable_cluster_is_named_without_its_password() {
    let ports: Vec<u16> = (0..2)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("port").port())
        .collect();
    let url = format!("redis+cluster://:hunter2@127.0.0.1:{},127.0.0.1:{}", ports[0], ports[1]);
    let e = RedisStore::connect(&url, TIMEOUT).await.expect_err("nothing listens there");
    let message = e.to_string();
    assert!(matches!(e, StoreError::Unreachable { .. } | StoreError::Timeout { .. }), "{e:?}");
    assert!(message.contains(&format!("127.0.0.1:{}, 127.0.0.1:{} (cluster)", ports[0], ports[1])), "{message}");
    assert!(!message.contains("hunter2"), "{message}");
}
