//! Idle abuse, through the binary: thousands of MCP sessions opened and left idle, and clients
//! that send their headers or their body a byte at a time. Memory stays bounded (sessions are
//! capped by `server.max_sessions`, and reaped after `server.session_idle_timeout_seconds`),
//! slow clients are cut off by `server.header_read_timeout_ms` / `body_read_timeout_ms`, and a
//! well-behaved caller's p99 during the abuse stays within 2× its p99 without it. The admin
//! listener and `mock-upstream` cut slow clients off by the same deadlines.
//!
//! `make test` runs it with 1,000 sessions; `scripts/idle-abuse.sh` with 10,000
//! (`IDLE_ABUSE_SESSIONS`), printing the figures docs/resilience.md quotes.

#[path = "common/process.rs"]
mod process;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use process::{Server, Session, quantile};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The slow clients' deadlines, short so the test is.
const HEADER_TIMEOUT: Duration = Duration::from_millis(1000);
const BODY_TIMEOUT: Duration = Duration::from_millis(1000);
/// How late a cut may come on a loaded 2-core machine.
const LATE: Duration = Duration::from_secs(3);
/// Slow clients of each kind at once.
const SLOW_CLIENTS: usize = 25;
/// Calls the well-behaved caller times, without the abuse and during it.
const SAMPLES: usize = 1000;

fn sessions() -> usize {
    std::env::var("IDLE_ABUSE_SESSIONS").ok().and_then(|n| n.parse().ok()).unwrap_or(1000)
}

/// Times `SAMPLES` free tool calls (`rate_limit_status`: the guard, the session, no upstream).
async fn latencies(caller: &Session) -> Vec<Duration> {
    let mut samples = Vec::with_capacity(SAMPLES);
    for _ in 0..SAMPLES {
        let started = Instant::now();
        let answer = caller.call("rate_limit_status", json!({})).await.expect("answered");
        samples.push(started.elapsed());
        assert!(answer.status == 200 && !answer.is_error(), "the well-behaved caller was refused: {answer:?}");
    }
    samples
}

/// Opens `count` sessions, each for its own made-up key (as an attacker rotating keys would),
/// `parallel` at a time; returns them with the status of each `initialize`.
async fn open_sessions(url: &str, first: usize, count: usize, parallel: usize) -> Vec<(u16, Session)> {
    let http = reqwest::Client::new();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(first));
    let mut tasks = Vec::new();
    for _ in 0..parallel {
        let (http, url, next) = (http.clone(), url.to_owned(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut opened = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= first + count {
                    return opened;
                }
                let mut session = Session::new(&http, &url, &format!("idle-abuser-{i}"));
                let status = session.open().await.expect("initialize answered");
                opened.push((status, session));
            }
        }));
    }
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await.expect("opener"));
    }
    all
}

/// A client that sends a request's headers a byte every 100 ms until the server hangs up;
/// returns how long the server let it.
async fn slow_headers(addr: &str) -> Duration {
    let mut tcp = TcpStream::connect(addr).await.expect("connect");
    let started = Instant::now();
    let _ = tcp.write_all(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ").await;
    let mut byte = [0u8; 1];
    loop {
        tokio::select! {
            read = tcp.read(&mut byte) => if matches!(read, Ok(0) | Err(_)) { return started.elapsed() },
            () = tokio::time::sleep(Duration::from_millis(100)) => {
                if tcp.write_all(b"a").await.is_err() {
                    return started.elapsed();
                }
            }
        }
        assert!(started.elapsed() < HEADER_TIMEOUT + LATE * 2, "a slow header was never cut off");
    }
}

/// A POST to `/mcp` of a 1000-byte body, as far as its first byte.
const MCP_HEAD: &str = "POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
                        Accept: application/json, text/event-stream\r\nContent-Length: 1000\r\n\r\n{";

/// A client that sends whole headers (and a body's first bytes: `head`), then the rest of its
/// body a byte every 100 ms; returns how long until the answer, and the answer's status line.
async fn slow_body(addr: &str, head: &str) -> (Duration, String) {
    let mut tcp = TcpStream::connect(addr).await.expect("connect");
    tcp.write_all(head.as_bytes()).await.expect("headers sent");
    let started = Instant::now();
    let mut answer = Vec::new();
    let mut buffer = [0u8; 512];
    loop {
        tokio::select! {
            read = tcp.read(&mut buffer) => match read {
                Ok(0) | Err(_) => break,
                Ok(n) => answer.extend_from_slice(&buffer[..n]),
            },
            () = tokio::time::sleep(Duration::from_millis(100)) => {
                if tcp.write_all(b" ").await.is_err() && !answer.is_empty() {
                    break;
                }
            }
        }
        assert!(started.elapsed() < BODY_TIMEOUT + LATE * 2, "a slow body was never cut off");
    }
    let text = String::from_utf8_lossy(&answer);
    (started.elapsed(), text.lines().next().unwrap_or_default().to_owned())
}

/// The slow clients, each kind [`SLOW_CLIENTS`] at a time against `addr`, again and again while
/// `caller` is timed: the caller's latencies, how long each slow header was let trickle, and
/// how long each slow body took to be answered, with the answer's status line.
async fn latencies_under_slow_clients(
    caller: &Session,
    addr: &str,
) -> (Vec<Duration>, Vec<Duration>, Vec<(Duration, String)>) {
    let stop = Arc::new(AtomicBool::new(false));
    let mut header_cuts = Vec::new();
    let mut body_cuts = Vec::new();
    for _ in 0..SLOW_CLIENTS {
        let (at, until) = (addr.to_owned(), stop.clone());
        header_cuts.push(tokio::spawn(async move {
            let mut cuts = Vec::new();
            while !until.load(Ordering::Relaxed) {
                cuts.push(slow_headers(&at).await);
            }
            cuts
        }));
        let (at, until) = (addr.to_owned(), stop.clone());
        body_cuts.push(tokio::spawn(async move {
            let mut cuts = Vec::new();
            while !until.load(Ordering::Relaxed) {
                cuts.push(slow_body(&at, MCP_HEAD).await);
            }
            cuts
        }));
    }
    tokio::time::sleep(HEADER_TIMEOUT / 2).await; // every slow client is connected and trickling
    let abused = latencies(caller).await;
    stop.store(true, Ordering::Relaxed);
    let header_cuts: Vec<Duration> =
        futures::future::join_all(header_cuts).await.into_iter().flatten().flatten().collect();
    let body_cuts: Vec<(Duration, String)> =
        futures::future::join_all(body_cuts).await.into_iter().flatten().flatten().collect();
    (abused, header_cuts, body_cuts)
}

/// What the idle abuse measured: the sessions, memory (RSS, KiB) at each stage, when the idle
/// sessions were reaped, the well-behaved caller's latencies and the slow clients' cuts.
struct Figures {
    /// `max_sessions`, and the sessions opened (the caller's own among them).
    n: usize,
    /// `session_idle_timeout_seconds`.
    idle: Duration,
    /// How long opening the sessions took.
    opening: Duration,
    /// How many initializes past the cap were refused.
    beyond: usize,
    rss_before: u64,
    rss_sessions: u64,
    rss_abused: u64,
    rss_again: u64,
    /// When the cap had room again, from the first session opened.
    reaped_after: Duration,
    /// The caller's latencies without the abuse (before and after it), and during it.
    quiet: Vec<Duration>,
    abused: Vec<Duration>,
    /// How long each slow header was let trickle; each slow body's time and status line.
    header_cuts: Vec<Duration>,
    body_cuts: Vec<(Duration, String)>,
}

impl Figures {
    /// Prints the figures docs/resilience.md quotes, then checks them: no panic in `server`, slow
    /// clients cut at their deadlines, memory bounded per session and not grown by a second wave,
    /// and the caller's p99 under the abuse within 2× its quiet p99.
    fn report_and_check(self, server: &Server) {
        let Self {
            n,
            idle,
            opening,
            beyond,
            rss_before,
            rss_sessions,
            rss_abused,
            rss_again,
            reaped_after,
            quiet,
            abused,
            header_cuts,
            body_cuts,
        } = self;
        let p = |samples: &[Duration], q| quantile(samples, q).as_secs_f64() * 1000.0;
        let per_session = rss_sessions.saturating_sub(rss_before) as f64 * 1024.0 / n as f64;
        let slowest_header = header_cuts.iter().max().copied().unwrap_or_default();
        let fastest_header = header_cuts.iter().min().copied().unwrap_or_default();
        let slowest_body = body_cuts.iter().map(|(d, _)| *d).max().unwrap_or_default();
        println!("idle abuse: {n} sessions (max_sessions {n}, idle time {idle:?})");
        println!("  opened {} sessions in {opening:.1?}; {} initializes past the cap got 503", n - 1, beyond);
        println!(
            "  RSS: {rss_before} KiB before, {rss_sessions} KiB with {n} idle sessions ({per_session:.0} bytes a session), \
             {rss_abused} KiB after the slow clients, {rss_again} KiB with a second wave after the reaping"
        );
        println!("  idle sessions reaped {reaped_after:.1?} after the first was opened (idle time {idle:?})");
        println!(
            "  slow headers: {} connections cut after {fastest_header:.2?}-{slowest_header:.2?} (header_read_timeout {HEADER_TIMEOUT:?})",
            header_cuts.len()
        );
        println!(
            "  slow bodies: {} requests answered {:?} after at most {slowest_body:.2?} (body_read_timeout {BODY_TIMEOUT:?})",
            body_cuts.len(),
            body_cuts.first().map(|(_, s)| s.as_str()).unwrap_or_default()
        );
        println!(
            "  well-behaved caller: p50 {:.2} ms / p99 {:.2} ms quiet ({} calls, before and after); p50 {:.2} ms / p99 {:.2} ms during the abuse ({SAMPLES} calls)",
            p(&quiet, 0.5),
            p(&quiet, 0.99),
            quiet.len(),
            p(&abused, 0.5),
            p(&abused, 0.99)
        );
        println!("  panics: {}", server.process.panics());

        assert_eq!(server.process.panics(), 0, "{}", server.process.log());
        assert!(!header_cuts.is_empty() && !body_cuts.is_empty());
        assert!(
            fastest_header + Duration::from_millis(50) >= HEADER_TIMEOUT && slowest_header <= HEADER_TIMEOUT + LATE,
            "slow headers cut after {fastest_header:?}-{slowest_header:?}, the timeout is {HEADER_TIMEOUT:?}"
        );
        for (took, status) in &body_cuts {
            assert!(status.starts_with("HTTP/1.1 408"), "a slow body got {status:?}");
            assert!(
                *took + Duration::from_millis(50) >= BODY_TIMEOUT && *took <= BODY_TIMEOUT + LATE,
                "408 after {took:?}"
            );
        }
        // The bound: max_sessions × what an idle session costs (about 105 KiB in a debug build).
        assert!(per_session < 160.0 * 1024.0, "{per_session:.0} bytes per idle session");
        assert!(
            rss_again <= rss_sessions.max(rss_abused) + rss_sessions / 10,
            "a second wave after the reaping grew memory: {rss_sessions} -> {rss_again} KiB"
        );
        assert!(
            quantile(&abused, 0.99) <= quantile(&quiet, 0.99) * 2,
            "the caller's p99 went from {:?} to {:?} under the abuse",
            quantile(&quiet, 0.99),
            quantile(&abused, 0.99)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sessions_and_slow_clients_stay_bounded_and_a_caller_keeps_its_latency() {
    let n = sessions();
    // Long enough to open every session and measure before the first is reaped.
    let idle = Duration::from_secs(10 + n as u64 / 250);
    // The server-wide cap is what this test is about: the caps on unverified callers (every
    // session here comes from loopback, each with a made-up key) and the address's request limit
    // are raised out of its way (tests/doors/made_up_keys.rs holds those).
    let config = format!(
        "[server]\nmax_sessions = {n}\nmax_sessions_per_address = {n}\nunverified_session_share = 1.0\n\
         session_idle_timeout_seconds = {}\n\
         header_read_timeout_ms = {}\nbody_read_timeout_ms = {}\n[limits.http]\nburst = 1000000\n\
         [limits.address_http]\nburst = 1000000\n[limits.method.tools_call]\nburst = 1000000\n",
        idle.as_secs(),
        HEADER_TIMEOUT.as_millis(),
        BODY_TIMEOUT.as_millis()
    );
    let server = Server::start(&config, &[]).await;
    let addr = server.base.trim_start_matches("http://").to_owned();
    let http = reqwest::Client::new();
    let mut caller = Session::new(&http, &server.url, "well-behaved");
    assert_eq!(caller.open().await.expect("open"), 200);
    latencies(&caller).await; // warm-up: connections, allocator, the caller's state
    let rss_before = server.process.rss_kib();
    let mut quiet = latencies(&caller).await;

    // The sessions, left idle. The caller's own session counts towards the cap.
    let started = Instant::now();
    let opened = open_sessions(&server.url, 0, n - 1, 16).await;
    let opening = started.elapsed();
    assert!(opened.iter().all(|(status, s)| *status == 200 && s.id.is_some()), "every session below the cap opens");
    let beyond = open_sessions(&server.url, n, 20, 4).await;
    assert!(beyond.iter().all(|(status, _)| *status == 503), "past max_sessions an initialize gets 503");
    let rss_sessions = server.process.rss_kib();

    let (abused, header_cuts, body_cuts) = latencies_under_slow_clients(&caller, &addr).await;
    let rss_abused = server.process.rss_kib();
    let measured = started.elapsed();
    assert!(measured < idle, "opening and measuring took {measured:?}, longer than the idle time {idle:?}");

    // Reaped: once the idle time has passed with no message, the cap has room again…
    let probe = Session::new(&http, &server.url, "after-the-idle-time");
    process::wait_until("idle sessions are reaped and the cap has room", idle + Duration::from_secs(30), || {
        let mut probe = probe.clone();
        async move { probe.open().await.is_ok_and(|s| s == 200) }
    })
    .await;
    let reaped_after = started.elapsed();
    // The baseline is measured twice, before the abuse and after it, so that whatever else
    // the machine is doing weighs on both sides of the comparison.
    let mut caller = Session::new(&http, &server.url, "well-behaved");
    assert_eq!(caller.open().await.expect("open"), 200);
    quiet.extend(latencies(&caller).await);
    // …and once the last of them has been idle that long, they are all gone (404). Asked once
    // each, then: a message to a live session would restart its idle time.
    tokio::time::sleep_until((started + opening + idle + Duration::from_secs(2)).into()).await;
    for (_, session) in opened.iter().step_by((n / 20).max(1)) {
        assert_eq!(session.ping().await.expect("answered"), 404, "an idle session outlived the idle time");
    }
    // A second wave reuses the memory of the first: bounded, not leaking.
    let again = open_sessions(&server.url, 2 * n, n - 3, 16).await; // three callers still hold one each
    assert!(again.iter().all(|(status, _)| *status == 200), "the cap is free again after the reaping");
    let rss_again = server.process.rss_kib();

    let figures = Figures {
        n,
        idle,
        opening,
        beyond: beyond.len(),
        rss_before,
        rss_sessions,
        rss_abused,
        rss_again,
        reaped_after,
        quiet,
        abused,
        header_cuts,
        body_cuts,
    };
    figures.report_and_check(&server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_are_cut_off_on_the_admin_listener_and_the_mock_upstream_too() {
    const KEY: &str = "an-admin-key-for-the-slow-clients";
    let deadlines = format!(
        "[server]\nheader_read_timeout_ms = {}\nbody_read_timeout_ms = {}\n",
        HEADER_TIMEOUT.as_millis(),
        BODY_TIMEOUT.as_millis()
    );
    let admin = format!("127.0.0.1:{}", process::free_port());
    let server = Server::start(&format!("{deadlines}[admin]\nlisten = \"{admin}\"\nkey = \"{KEY}\"\n"), &[]).await;
    let http = reqwest::Client::new();
    let openapi = format!("http://{admin}/admin/openapi.json");
    process::wait_until("the admin API answers", Duration::from_secs(30), || async {
        http.get(&openapi).bearer_auth(KEY).send().await.is_ok_and(|r| r.status().is_success())
    })
    .await;
    let mock = process::Upstream::start(&deadlines).await;
    let upstream = mock.url.trim_start_matches("http://").to_owned();

    // The admin API reads a body only once the key is checked: the slow body carries it.
    let admin_head = format!(
        "POST /admin/callers/tok:0123456789abcdef/reset HTTP/1.1\r\nHost: 127.0.0.1\r\n\
         Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{"
    );
    let upstream_head = "POST /v1/articles HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
                         Content-Length: 1000\r\n\r\n{";
    let (admin_headers, upstream_headers, admin_body, upstream_body) = tokio::join!(
        slow_headers(&admin),
        slow_headers(&upstream),
        slow_body(&admin, &admin_head),
        slow_body(&upstream, upstream_head)
    );
    println!(
        "slow headers cut after {admin_headers:.2?} (admin), {upstream_headers:.2?} (mock upstream); slow bodies \
         answered {:?} after {:.2?} (admin), {:?} after {:.2?} (mock upstream)",
        admin_body.1, admin_body.0, upstream_body.1, upstream_body.0
    );
    for (listener, took) in [("admin", admin_headers), ("mock upstream", upstream_headers)] {
        assert!(
            took + Duration::from_millis(50) >= HEADER_TIMEOUT && took <= HEADER_TIMEOUT + LATE,
            "{listener}: slow headers cut after {took:?}, the timeout is {HEADER_TIMEOUT:?}"
        );
    }
    for (listener, (took, status)) in [("admin", admin_body), ("mock upstream", upstream_body)] {
        assert!(status.starts_with("HTTP/1.1 408"), "{listener}: a slow body got {status:?}");
        assert!(
            took + Duration::from_millis(50) >= BODY_TIMEOUT && took <= BODY_TIMEOUT + LATE,
            "{listener}: 408 after {took:?}, the timeout is {BODY_TIMEOUT:?}"
        );
    }
    assert_eq!(server.process.panics() + mock.process.panics(), 0, "{}", server.process.log());
}

/// The first-request deadline of the connection tests: short, so they are.
const FIRST_REQUEST: Duration = Duration::from_millis(600);

/// Half an HTTP/2 connection preface (hyper-util's auto-detection waits for the rest).
const HALF_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM";

/// A whole HTTP/2 preface and an empty SETTINGS frame: an HTTP/2 connection, then nothing.
const PREFACE_THEN_NOTHING: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";

/// Connects to `addr`, sends `bytes` and then nothing; returns how long the server kept the
/// connection open after that, reading (and dropping) whatever it sent.
async fn kept_open(addr: &str, bytes: &[u8]) -> Duration {
    let mut tcp = TcpStream::connect(addr).await.expect("connect");
    tcp.write_all(bytes).await.expect("sent");
    let started = Instant::now();
    let mut buffer = [0u8; 1024];
    loop {
        match tokio::time::timeout(FIRST_REQUEST + LATE * 2, tcp.read(&mut buffer)).await {
            Ok(Ok(0) | Err(_)) => return started.elapsed(),
            Ok(Ok(_)) => continue,
            Err(_) => panic!("{addr}: a connection that sent {bytes:?} was never closed"),
        }
    }
}

/// The value of the sample of `metric` whose labels contain every one of `labels`.
fn sample(exposition: &str, metric: &str, labels: &[&str]) -> f64 {
    exposition
        .lines()
        .filter(|l| l.strip_prefix(metric).is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' ')))
        .filter(|l| labels.iter().all(|label| l.contains(label)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A `serve` process with `[server]` `server` and the admin API on; its admin address.
async fn with_admin(server: &str) -> (Server, String) {
    const KEY: &str = "an-admin-key-for-the-connection-tests";
    let admin = format!("127.0.0.1:{}", process::free_port());
    let started =
        Server::start(&format!("[server]\n{server}[admin]\nlisten = \"{admin}\"\nkey = \"{KEY}\"\n"), &[]).await;
    let openapi = format!("http://{admin}/admin/openapi.json");
    process::wait_until("the admin API answers", Duration::from_secs(30), || async {
        reqwest::Client::new().get(&openapi).bearer_auth(KEY).send().await.is_ok_and(|r| r.status().is_success())
    })
    .await;
    (started, admin)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_that_present_no_request_are_closed_within_the_deadline_on_every_listener() {
    let deadline = format!("header_read_timeout_ms = {}\n", FIRST_REQUEST.as_millis());
    let (server, admin) = with_admin(&deadline).await;
    let mock = process::Upstream::start(&format!("[server]\n{deadline}")).await;
    let mcp = server.base.trim_start_matches("http://").to_owned();
    let upstream = mock.url.trim_start_matches("http://").to_owned();
    for (listener, addr) in [("mcp", &mcp), ("admin", &admin), ("mock upstream", &upstream)] {
        // Nothing; half an HTTP/2 preface; a whole one and its SETTINGS, then nothing; half an
        // HTTP/1 request (hyper's own timer holds that one too).
        let (nothing, half_preface, preface, half_request) = tokio::join!(
            kept_open(addr, b""),
            kept_open(addr, HALF_PREFACE),
            kept_open(addr, PREFACE_THEN_NOTHING),
            kept_open(addr, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"),
        );
        println!(
            "{listener}: closed after {nothing:.2?} (nothing), {half_preface:.2?} (half a preface), {preface:.2?} \
             (an HTTP/2 preface), {half_request:.2?} (half a request); deadline {FIRST_REQUEST:?}"
        );
        for (what, took) in [
            ("nothing", nothing),
            ("half a preface", half_preface),
            ("a preface", preface),
            ("half a request", half_request),
        ] {
            assert!(
                took + Duration::from_millis(50) >= FIRST_REQUEST && took <= FIRST_REQUEST + LATE,
                "{listener}, {what}: closed after {took:?}, the deadline is {FIRST_REQUEST:?}"
            );
        }
    }
    // Counted where /metrics is: the four that never presented a whole request, on each listener.
    let metrics = server.metrics().await;
    for listener in ["mcp", "admin"] {
        let timed_out =
            sample(&metrics, "mcp_ratelimit_connections_timed_out_total", &[&format!("listener=\"{listener}\"")]);
        assert_eq!(timed_out, 4.0, "{listener}\n{metrics}");
    }
    assert_eq!(server.process.panics() + mock.process.panics(), 0, "{}", server.process.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_http2_connection_is_closed_and_streams_and_clients_of_both_eras_go_on() {
    let server =
        Server::start(&format!("[server]\nheader_read_timeout_ms = {}\n", FIRST_REQUEST.as_millis()), &[]).await;
    let addr = server.base.trim_start_matches("http://").to_owned();
    let tcp = TcpStream::connect(&addr).await.expect("connect");
    let (mut sender, connection) =
        hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), hyper_util::rt::TokioIo::new(tcp))
            .await
            .expect("an HTTP/2 connection");
    let (ended_tx, ended) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let _ = connection.await;
        let _ = ended_tx.send(Instant::now());
    });
    for _ in 0..2 {
        let request = http::Request::get(format!("http://{addr}/health"))
            .body(http_body_util::Empty::<hyper::body::Bytes>::new());
        let answer = sender.send_request(request.expect("a request")).await.expect("answered over HTTP/2");
        assert_eq!(answer.status(), 200);
        let _ = http_body_util::BodyExt::collect(answer.into_body()).await.expect("the body");
    }
    let answered = Instant::now();
    let ended = tokio::time::timeout(FIRST_REQUEST + LATE * 2, ended).await.expect("the idle connection ended");
    let idle = ended.expect("ended") - answered;
    println!("an idle HTTP/2 connection ended {idle:.2?} after its last answer (deadline {FIRST_REQUEST:?})");
    assert!(idle + Duration::from_millis(50) >= FIRST_REQUEST && idle <= FIRST_REQUEST + LATE, "{idle:?}");

    // An SSE stream is a request under way: its connection outlives the deadline many times.
    let http = reqwest::Client::new();
    let mut session = Session::new(&http, &server.url, "streaming");
    assert_eq!(session.open().await.expect("open"), 200);
    let mut stream = http
        .get(&server.url)
        .header("accept", "text/event-stream")
        .header("mcp-session-id", session.id.as_deref().expect("a session"))
        .header("mcp-protocol-version", "2025-11-25")
        .bearer_auth("streaming")
        .send()
        .await
        .expect("the GET stream");
    assert_eq!(stream.status(), 200);
    let quiet =
        tokio::time::timeout(FIRST_REQUEST * 4, async { while let Ok(Some(_)) = stream.chunk().await {} }).await;
    assert!(quiet.is_err(), "the stream ended within {:?}", FIRST_REQUEST * 4);
    assert_eq!(session.ping().await.expect("ping"), 200, "and the session still answers");

    // MCP clients of both eras go on calling across idle spells longer than the deadline.
    use rmcp::model::{CallToolRequestParams, ProtocolVersion};
    use rmcp::transport::StreamableHttpClientTransport;
    use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
    use rmcp::{ClientLifecycleMode, ClientServiceExt, ServiceExt};
    let transport = || {
        let config = StreamableHttpClientTransportConfig::with_uri(server.url.clone()).auth_header("both-eras");
        StreamableHttpClientTransport::from_config(config)
    };
    let legacy = ().serve(transport()).await.expect("a 2025-11-25 session");
    let modern = ().serve_with_lifecycle(
        transport(),
        ClientLifecycleMode::Discover { preferred_versions: vec![ProtocolVersion::V_2026_07_28] },
    );
    let modern = modern.await.expect("a 2026-07-28 client");
    for round in 0..3 {
        for client in [&legacy, &modern] {
            let answer = client.call_tool(CallToolRequestParams::new("rate_limit_status")).await;
            assert_eq!(answer.expect("answered").is_error, Some(false), "round {round}");
        }
        tokio::time::sleep(FIRST_REQUEST * 2).await;
    }
    assert_eq!(server.process.panics(), 0, "{}", server.process.log());
}

/// Connects to `addr` from `from` (a loopback address): the connection, and whether the server
/// refused it at once (the status line it was answered with) or holds it (`None`).
async fn connect_from(from: &str, addr: &str) -> (TcpStream, Option<String>) {
    let socket = tokio::net::TcpSocket::new_v4().expect("a socket");
    socket.bind(format!("{from}:0").parse().expect("an address")).expect("bound to a loopback address");
    let mut tcp = socket.connect(addr.parse().expect("an address")).await.expect("connect");
    let mut answer = Vec::new();
    let mut buffer = [0u8; 1024];
    // A refusal comes at once; a held connection says nothing (its deadline is far off).
    while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(300), tcp.read(&mut buffer)).await {
        if n == 0 {
            break;
        }
        answer.extend_from_slice(&buffer[..n]);
    }
    let text = String::from_utf8_lossy(&answer).into_owned();
    (tcp, (!answer.is_empty()).then_some(text))
}

/// Whether `tcp`, held open and silent, is served a request now.
async fn served(mut tcp: TcpStream) -> bool {
    let request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    if tcp.write_all(request).await.is_err() {
        return false;
    }
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(LATE, tcp.read_to_end(&mut answer)).await;
    // Any answer but a refusal (the admin API wants its key, the mock has no /health).
    let answer = String::from_utf8_lossy(&answer);
    answer.starts_with("HTTP/1.1 ") && !answer.starts_with("HTTP/1.1 429") && !answer.starts_with("HTTP/1.1 503")
}

/// Waits until `server` holds no connection but the scrape asking (and the admin listener none),
/// and that scrape's own connection has gone too.
async fn settled(server: &Server) {
    let open = |metrics: &str, listener: &str| {
        sample(metrics, "mcp_ratelimit_connections_open", &[&format!("listener=\"{listener}\"")])
    };
    process::wait_until("the connections before are gone", Duration::from_secs(30), || async {
        let metrics = server.metrics().await;
        open(&metrics, "mcp") == 1.0 && open(&metrics, "admin") == 0.0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_past_a_cap_is_refused_at_once_and_counted_on_every_listener() {
    let caps = "max_connections = 5\nmax_connections_per_address = 3\n";
    let (server, admin) = with_admin(caps).await;
    let mock = process::Upstream::start(&format!("[server]\n{caps}")).await;
    let mcp = server.base.trim_start_matches("http://").to_owned();
    let upstream = mock.url.trim_start_matches("http://").to_owned();
    // Only the scrape itself is open (the clients that waited for the server have gone).
    settled(&server).await;
    for (listener, addr) in [("mcp", &mcp), ("admin", &admin), ("mock upstream", &upstream)] {
        let mut held = Vec::new();
        for _ in 0..3 {
            let (tcp, refused) = connect_from("127.0.0.1", addr).await;
            assert_eq!(refused, None, "{listener}: within the cap per address");
            held.push(tcp);
        }
        let (_, refused) = connect_from("127.0.0.1", addr).await;
        let refused = refused.expect("the fourth from one address is answered at once");
        assert!(refused.starts_with("HTTP/1.1 429") && refused.contains("Retry-After: 1"), "{listener}: {refused}");
        assert!(refused.contains("max_connections_per_address"), "{refused}");
        for from in ["127.0.0.2", "127.0.0.3"] {
            let (tcp, refused) = connect_from(from, addr).await;
            assert_eq!(refused, None, "{listener}: another address has room until the listener is full");
            held.push(tcp);
        }
        let (_, refused) = connect_from("127.0.0.4", addr).await;
        let refused = refused.expect("the sixth is answered at once");
        assert!(refused.starts_with("HTTP/1.1 503") && refused.contains("Retry-After: 1"), "{listener}: {refused}");
        // Those held are served whenever they speak; once they are gone there is room again.
        for tcp in held {
            assert!(served(tcp).await, "{listener}: a held connection is served");
        }
        settled(&server).await;
    }
    let metrics = server.metrics().await;
    for listener in ["mcp", "admin"] {
        let label = format!("listener=\"{listener}\"");
        let per_address =
            sample(&metrics, "mcp_ratelimit_connections_refused_total", &[&label, "max_connections_per_address"]);
        let full = sample(&metrics, "mcp_ratelimit_connections_refused_total", &[&label, "reason=\"max_connections\""]);
        assert_eq!((per_address, full), (1.0, 1.0), "{listener}\n{metrics}");
    }
    assert_eq!(server.process.panics() + mock.process.panics(), 0, "{}", server.process.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trusted_proxies_are_not_held_to_the_cap_per_address_and_ipv6_peers_are() {
    // Behind a trusted proxy every client arrives from its address: it is held to the listener's
    // cap only.
    let toml = "[server]\nmax_connections_per_address = 2\ntrust_proxy = true\ntrusted_proxies = [\"127.0.0.1/32\"]\n";
    let server = Server::start(toml, &[]).await;
    let addr = server.base.trim_start_matches("http://").to_owned();
    let mut held = Vec::new();
    for n in 0..4 {
        let (tcp, refused) = connect_from("127.0.0.1", &addr).await;
        assert_eq!(refused, None, "connection {n} from the trusted proxy");
        held.push(tcp);
    }
    for n in 0..2 {
        let (tcp, refused) = connect_from("127.0.0.2", &addr).await;
        assert_eq!(refused, None, "connection {n} from another address");
        held.push(tcp);
    }
    assert!(connect_from("127.0.0.2", &addr).await.1.is_some_and(|r| r.starts_with("HTTP/1.1 429")), "another address");
    drop(held);

    // An IPv6 peer (the loopback [::1]) is counted as its address too.
    let port = process::free_port();
    let listen = format!("[::1]:{port}");
    let mut process =
        process::Process::spawn(&["serve", "--listen", &listen], "[server]\nmax_connections_per_address = 2\n", &[]);
    process::wait_until("serve on [::1] answers", Duration::from_secs(30), || async {
        reqwest::get(format!("http://{listen}/health")).await.is_ok_and(|r| r.status().is_success())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await; // the client that asked has gone
    let mut v6 = Vec::new();
    let refused = loop {
        let mut tcp = TcpStream::connect(&listen).await.expect("connect over IPv6");
        let mut buffer = [0u8; 256];
        match tokio::time::timeout(Duration::from_millis(300), tcp.read(&mut buffer)).await {
            Ok(Ok(n)) if n > 0 => break String::from_utf8_lossy(&buffer[..n]).into_owned(),
            _ => v6.push(tcp),
        }
        assert!(v6.len() <= 2, "more than the cap held from [::1]");
    };
    assert_eq!(v6.len(), 2);
    assert!(refused.starts_with("HTTP/1.1 429"), "{refused}");
    assert_eq!(process.panics(), 0, "{}", process.log());
    process.kill().await;
}

#[test]
fn bad_session_and_timeout_settings_are_refused_naming_the_key() {
    for (key, value, says) in [
        ("SESSION_IDLE_TIMEOUT_SECONDS", "0", "server.session_idle_timeout_seconds"),
        ("SESSION_IDLE_TIMEOUT_SECONDS", "100000", "more than a day"),
        ("MAX_SESSIONS", "0", "server.max_sessions"),
        ("HEADER_READ_TIMEOUT_MS", "-5", "server.header_read_timeout_ms"),
        ("BODY_READ_TIMEOUT_MS", "soon", "server.body_read_timeout_ms"),
        ("BODY_READ_TIMEOUT_MS", "0", "must be greater than zero"),
        ("MAX_STREAMS_PER_CONNECTION", "0", "server.max_streams_per_connection"),
        ("MAX_STREAMS_PER_CONNECTION", "many", "server.max_streams_per_connection"),
    ] {
        let output = std::process::Command::new(process::BINARY)
            .arg("check-config")
            .env(format!("MCP_RL__SERVER__{key}"), value)
            .output()
            .expect("check-config runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{key}={value}: {stderr}");
        assert!(stderr.contains(says), "{key}={value} should say {says:?}: {stderr}");
    }
    let output = std::process::Command::new(process::BINARY)
        .arg("check-config")
        .env("MCP_RL__SERVER__SESSION_IDLE_TIMEOUT_SECONDS", "60")
        .env("MCP_RL__SERVER__MAX_SESSIONS", "500")
        .env("MCP_RL__SERVER__HEADER_READ_TIMEOUT_MS", "2000")
        .env("MCP_RL__SERVER__BODY_READ_TIMEOUT_MS", "5000")
        .env("MCP_RL__SERVER__MAX_STREAMS_PER_CONNECTION", "50")
        .output()
        .expect("check-config runs");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let table = String::from_utf8_lossy(&output.stdout);
    assert!(table.contains("50 streams each (HTTP/2)"), "the override is in force: {table}");
}
