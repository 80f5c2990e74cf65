//! A real Redis for a test: the one `REDIS_URL` names, or a `redis-server` the test starts on
//! a free loopback port (no persistence) and kills when it is dropped.
//!
//! Every test gets its own key prefix, so tests never see each other's keys on a shared Redis
//! and nothing ever needs FLUSHDB. A test that touches server-wide state (command statistics,
//! the script cache, pausing the process) asks for a [`TestRedis::private`] server instead.
//! Without a Redis the tests fail, saying how to get one: they never skip silently.
#![allow(dead_code)]

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const INSTALL: &str = "these tests need Redis: install it (`apt-get install redis-server`) so they can start \
                       `redis-server` themselves, or set REDIS_URL to a Redis they may write to";

/// How long a freshly started server has to answer PING.
const STARTUP: Duration = Duration::from_secs(10);

/// A Redis a test may use, and the prefix its keys must carry.
pub struct TestRedis {
    /// Where to connect: `redis://127.0.0.1:<port>/` or `REDIS_URL`.
    pub url: String,
    prefix: String,
    server: Option<Child>,
}

impl TestRedis {
    /// `REDIS_URL` when it is set, else a `redis-server` of this test's own.
    pub fn start() -> Self {
        match std::env::var("REDIS_URL") {
            Ok(url) if !url.is_empty() => {
                if let Err(e) = ping(&url) {
                    panic!("REDIS_URL is set but does not answer PING ({e}); {INSTALL}");
                }
                Self { url, prefix: prefix(), server: None }
            }
            _ => Self::private(),
        }
    }

    /// A `redis-server` of this test's own, whatever `REDIS_URL` says.
    pub fn private() -> Self {
        let mut last_error = String::new();
        // The free port is found by binding and letting go, so another process may take it
        // first: then the server exits and another port is tried.
        for _ in 0..5 {
            let port = free_port();
            let url = format!("redis://127.0.0.1:{port}/");
            let mut child = spawn(port);
            match wait_for_ping(&url, &mut child) {
                Ok(()) => return Self { url, prefix: prefix(), server: Some(child) },
                Err(e) => {
                    last_error = e;
                    let _ = child.kill();
                    let _ = child.wait();
                }
            }
        }
        panic!("redis-server did not come up ({last_error}); {INSTALL}");
    }

    /// Kills the server (SIGKILL): connections break and the port stops answering.
    pub fn kill(&mut self) {
        let server = self.server.as_mut().expect("only a private server can be killed");
        let _ = server.kill();
        let _ = server.wait();
    }

    /// Starts a killed server again on the same port, empty.
    pub fn restart(&mut self) {
        let port = self.url.trim_end_matches('/').rsplit(':').next().and_then(|p| p.parse().ok()).expect("port");
        let mut child = spawn(port);
        if let Err(e) = wait_for_ping(&self.url, &mut child) {
            panic!("redis-server did not come back on port {port} ({e})");
        }
        self.server = Some(child);
    }

    /// How many EVALSHA calls the server has run (`INFO commandstats`): one per decision.
    pub fn evalsha_calls(&self) -> u64 {
        let info: String = redis::Client::open(self.url.as_str())
            .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(1)))
            .and_then(|mut c| redis::cmd("INFO").arg("commandstats").query(&mut c))
            .expect("INFO commandstats");
        info.lines()
            .find_map(|line| line.strip_prefix("cmdstat_evalsha:calls="))
            .and_then(|rest| rest.split(',').next())
            .and_then(|calls| calls.parse().ok())
            .unwrap_or(0)
    }

    /// `name` under this test's prefix.
    pub fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// Freezes the server (SIGSTOP): connections stay open and nothing answers.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Lets a paused server run again (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let server = self.server.as_ref().expect("only a private server can be paused");
        let status = Command::new("kill").args([signal, &server.id().to_string()]).status().expect("kill runs");
        assert!(status.success(), "kill {signal} failed");
    }
}

impl Drop for TestRedis {
    fn drop(&mut self) {
        match &mut self.server {
            Some(server) => {
                // SIGKILL also ends a stopped process.
                let _ = server.kill();
                let _ = server.wait();
            }
            // A shared Redis keeps only what TTLs will clear: held slots have none.
            None => {
                let _ = delete_prefixed(&self.url, &self.prefix);
            }
        }
    }
}

fn spawn(port: u16) -> Child {
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    match child {
        Ok(child) => child,
        Err(e) => panic!("cannot start redis-server ({e}); {INSTALL}"),
    }
}

fn delete_prefixed(url: &str, prefix: &str) -> redis::RedisResult<()> {
    let mut connection = redis::Client::open(url)?.get_connection_with_timeout(Duration::from_secs(1))?;
    let keys: Vec<String> =
        redis::Commands::scan_match(&mut connection, format!("{prefix}*"))?.collect::<Result<_, _>>()?;
    if !keys.is_empty() {
        redis::cmd("DEL").arg(keys).exec(&mut connection)?;
    }
    Ok(())
}

fn prefix() -> String {
    format!("test:{:016x}:", rand::random::<u64>())
}

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    listener.local_addr().expect("local address").port()
}

fn ping(url: &str) -> Result<(), String> {
    let client = redis::Client::open(url).map_err(|e| e.to_string())?;
    let mut connection = client.get_connection_with_timeout(Duration::from_secs(1)).map_err(|e| e.to_string())?;
    let pong: String = redis::cmd("PING").query(&mut connection).map_err(|e| e.to_string())?;
    if pong == "PONG" { Ok(()) } else { Err(format!("PING answered {pong}")) }
}

fn wait_for_ping(url: &str, child: &mut Child) -> Result<(), String> {
    let started = Instant::now();
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("redis-server exited with {status}"));
        }
        match ping(url) {
            Ok(()) => return Ok(()),
            Err(e) if started.elapsed() > STARTUP => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}
