//! The store's conformance: the suites every backend passes (`mcp_ratelimit_kernel::store::suite`
//! for budgets, slots, blocks and counters; `line_suite` for the line every instance's waiting
//! jobs stand in), run through `dyn Store` against a real Redis — a `redis-server` this test
//! starts on a free loopback port and stops when it is done. The memory store and its shared twin
//! pass the same suites in the kernel's unit tests.
//!
//! Behind the `redis-server` feature, on by default: `cargo test -p mcp-ratelimit-redis` runs it,
//! `--no-default-features` leaves it out on a machine without `redis-server`.

use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mcp_ratelimit_kernel::store::{Store, line_suite, suite};
use mcp_ratelimit_redis::RedisStore;

/// A `redis-server` of this test's own, stopped when dropped.
#[derive(Debug)]
struct RedisServer {
    child: Child,
    url: String,
}

impl RedisServer {
    /// Starts one on a free loopback port and waits (at most 10 s) until it takes connections.
    fn start() -> Self {
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .and_then(|listener| listener.local_addr())
            .expect("a free loopback port")
            .port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot start redis-server ({e}): install it (apt-get install redis-server), or test with --no-default-features")
            });
        let server = Self { child, url: format!("redis://127.0.0.1:{port}") };
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not come up on port {port} within 10 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        server
    }

    async fn store(&self) -> Arc<dyn Store> {
        Arc::new(RedisStore::connect(&self.url, Duration::from_secs(5)).await.expect("connects to its redis-server"))
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test]
async fn the_redis_store_passes_the_backend_suite() {
    let redis = RedisServer::start();
    suite::run(redis.store().await, "{suite}").await;
}

/// The same with busy keys' budgets handed out in slices: a read counts what this instance holds,
/// and the last units are spent and refused exactly.
#[tokio::test]
async fn the_redis_store_with_slices_passes_the_backend_suite() {
    let redis = RedisServer::start();
    let store = RedisStore::connect(&redis.url, Duration::from_secs(5)).await.expect("connects to its redis-server");
    let rules = mcp_ratelimit_redis::SliceRules { most: 64, lasts: Duration::from_secs(5) };
    let clock = mcp_ratelimit_kernel::clock::SystemClock::shared();
    let store = store.with_slices(rules, clock).shared();
    suite::run(store.clone(), "{suite}").await;
    assert!(store.slices_held().1 == 0, "the busy budget's slices were spent to the last unit");
}

#[tokio::test]
async fn the_redis_line_passes_the_line_suite_its_memory_twin_passes() {
    let redis = RedisServer::start();
    line_suite::run(redis.store().await, "suite").await;
}
