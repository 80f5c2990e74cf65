//! The store's own unit tests: what is refused before anything is sent, the URLs it takes, and
//! a script for every algorithm. (The tests against a live Redis are in `tests/limits/`.)

use mcp_ratelimit_kernel::clock::Nanos;
use mcp_ratelimit_kernel::limit::{FixedWindow, Limiter, TokenBucket};
use mcp_ratelimit_kernel::store::Check;

use crate::RedisStore;
use crate::connection::Target;
use crate::scripts::{DECIDE_SCRIPT, LEARN_SCRIPT, script_span};

#[test]
fn checks_beyond_exact_integers_are_refused_before_sending() {
    let year = Limiter::FixedWindow(FixedWindow::new(
        10,
        Nanos::new(365 * 86_400 * mcp_ratelimit_kernel::clock::NANOS_PER_SEC),
    ));
    let e =
        script_span(&Check { key: "k", limiter: &year, cost: 1, shadow: false }).expect_err("a year is beyond 2^52 ns");
    assert!(e.to_string().contains("52 days"), "{e}");
    let bucket = Limiter::TokenBucket(TokenBucket::new(5, 1.0));
    let e =
        script_span(&Check { key: "k", limiter: &bucket, cost: 6, shadow: false }).expect_err("cost above capacity");
    assert!(e.to_string().contains("cost 6 is above its capacity 5"), "{e}");
    assert_eq!(
        script_span(&Check { key: "k", limiter: &bucket, cost: 5, shadow: false }).ok(),
        Some(mcp_ratelimit_kernel::clock::NANOS_PER_SEC)
    );
}

#[test]
fn a_cluster_url_names_its_seed_nodes_and_never_its_password() {
    let Ok(Target::Cluster { nodes, address, tls: false }) = Target::parse("redis+cluster://:pw@a:7000,b/0") else {
        panic!("a plain cluster")
    };
    assert_eq!(nodes, ["redis://:pw@a:7000/0", "redis://:pw@b/0"]);
    assert_eq!(address, "a:7000, b:6379 (cluster)");
    assert_eq!(mcp_ratelimit_kernel::redact::url("redis://user:pw@a:7000/0"), "redis://***@a:7000/0");
    assert_eq!(mcp_ratelimit_kernel::redact::url("redis://a:7000/x@y"), "redis://a:7000/x@y");
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
    for name in mcp_ratelimit_kernel::limit::ALGORITHMS {
        assert!(DECIDE_SCRIPT.contains(&format!("definitions.{name} = function()")), "no script for {name}");
    }
    for name in mcp_ratelimit_kernel::limit::adaptive::ALGORITHMS {
        for script in [DECIDE_SCRIPT, LEARN_SCRIPT] {
            assert!(script.contains(&format!("learners.{name} = function(")), "no learner script for {name}");
        }
    }
}
