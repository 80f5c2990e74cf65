//! A real Redis for a test: the one `REDIS_URL` names, or a `redis-server` the test starts on
//! a free loopback port (no persistence) and kills when it is dropped.
//!
//! Every test gets its own key prefix, so tests never see each other's keys on a shared Redis
//! and nothing ever needs FLUSHDB. A test that touches server-wide state (command statistics,
//! the script cache, pausing the process) asks for a [`TestRedis::private`] server instead.
//! Without a Redis the tests fail, saying how to get one: they never skip silently.
//!
//! [`TestRedisCluster`] is the same for a Redis Cluster: the one `REDIS_CLUSTER_URL` names, or
//! three primaries of the test's own, joined by `redis-cli --cluster create`.
#![allow(dead_code)]

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const INSTALL: &str = "these tests need Redis: install it (`apt-get install redis-server`) so they can start \
                       `redis-server` themselves, or set REDIS_URL to a Redis they may write to";

/// How long a freshly started server has to answer PING.
const STARTUP: Duration = Duration::from_secs(10);

/// A Redis a test may use, and the prefix its keys must carry.
pub(crate) struct TestRedis {
    /// Where to connect: `redis://127.0.0.1:<port>/` or `REDIS_URL`.
    pub url: String,
    prefix: String,
    server: Option<Child>,
}

impl TestRedis {
    /// `REDIS_URL` when it is set, else a `redis-server` of this test's own.
    pub(crate) fn start() -> Self {
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
    pub(crate) fn private() -> Self {
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
    pub(crate) fn kill(&mut self) {
        let server = self.server.as_mut().expect("only a private server can be killed");
        let _ = server.kill();
        let _ = server.wait();
    }

    /// Starts a killed server again on the same port, empty.
    pub(crate) fn restart(&mut self) {
        let port = self.url.trim_end_matches('/').rsplit(':').next().and_then(|p| p.parse().ok()).expect("port");
        let mut child = spawn(port);
        if let Err(e) = wait_for_ping(&self.url, &mut child) {
            panic!("redis-server did not come back on port {port} ({e})");
        }
        self.server = Some(child);
    }

    /// How many EVALSHA calls the server has run (`INFO commandstats`): one per decision.
    pub(crate) fn evalsha_calls(&self) -> u64 {
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
    pub(crate) fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// Freezes the server (SIGSTOP): connections stay open and nothing answers.
    pub(crate) fn pause(&self) {
        self.signal("-STOP");
    }

    /// Lets a paused server run again (SIGCONT).
    pub(crate) fn resume(&self) {
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

/// A `redis-server` of the test's own that speaks only TLS (`rediss://`), with a certificate for
/// 127.0.0.1 signed by a CA made for this server alone (`ca_file`): nothing on the machine
/// trusts it unless told to.
pub(crate) struct TlsRedis {
    /// `rediss://127.0.0.1:<port>/`.
    pub url: String,
    /// The PEM file of the CA that signed the server's certificate.
    pub ca_file: std::path::PathBuf,
    server: Child,
    _dir: tempfile::TempDir,
}

impl TlsRedis {
    /// Makes a CA and a server certificate with `openssl`, and starts the server.
    pub(crate) fn start() -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = |name: &str| dir.path().join(name).to_string_lossy().into_owned();
        make_certificates(dir.path());
        let ca_file = dir.path().join("ca.crt");
        let ca = std::fs::read(&ca_file).expect("the CA certificate");
        let mut last_error = String::new();
        for _ in 0..5 {
            let port = free_port();
            let child = Command::new("redis-server")
                .args(["--port", "0", "--tls-port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--tls-cert-file", &path("server.crt"), "--tls-key-file", &path("server.key")])
                .args(["--tls-ca-cert-file", &path("ca.crt"), "--tls-auth-clients", "no"])
                .args(["--save", "", "--appendonly", "no"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn();
            let mut child = match child {
                Ok(child) => child,
                Err(e) => panic!("cannot start redis-server ({e}); {INSTALL}"),
            };
            let url = format!("rediss://127.0.0.1:{port}/");
            let started = Instant::now();
            let answered = loop {
                if let Ok(Some(status)) = child.try_wait() {
                    break Err(format!("redis-server exited with {status} (built without TLS?)"));
                }
                match tls_ping(&url, &ca) {
                    Ok(()) => break Ok(()),
                    Err(e) if started.elapsed() > STARTUP => break Err(e),
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            };
            match answered {
                Ok(()) => return Self { url, ca_file, server: child, _dir: dir },
                Err(e) => {
                    last_error = e;
                    let _ = child.kill();
                    let _ = child.wait();
                }
            }
        }
        panic!("redis-server with TLS did not come up ({last_error}); {INSTALL}");
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
    }
}

/// Makes, in `dir`, a CA (`ca.key`, `ca.crt`) and a certificate for 127.0.0.1 it signed
/// (`server.key`, `server.crt`), with `openssl`.
fn make_certificates(dir: &std::path::Path) {
    let openssl = |args: &[&str]| {
        let out = Command::new("openssl").args(args).current_dir(dir).output();
        match out {
            Ok(out) if out.status.success() => {}
            Ok(out) => panic!("openssl {args:?} failed: {}", String::from_utf8_lossy(&out.stderr)),
            Err(e) => panic!("cannot run openssl ({e}): install it (`apt-get install openssl`)"),
        }
    };
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
    openssl(
        &[
            &["req", "-x509"][..],
            &ec,
            &["-days", "2", "-subj", "/CN=mcp-ratelimit test CA", "-keyout", "ca.key", "-out", "ca.crt"],
            &["-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign"],
        ]
        .concat(),
    );
    openssl(&[&["req"][..], &ec, &["-subj", "/CN=127.0.0.1", "-keyout", "server.key", "-out", "server.csr"]].concat());
    std::fs::write(dir.join("server.ext"), "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
        .expect("write the extensions file");
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "server.ext",
        "-out",
        "server.crt",
    ]);
}

fn tls_ping(url: &str, ca: &[u8]) -> Result<(), String> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let certificates = redis::TlsCertificates { client_tls: None, root_cert: Some(ca.to_vec()) };
    let client = redis::Client::build_with_tls(url, certificates).map_err(|e| e.to_string())?;
    let mut connection = client.get_connection_with_timeout(Duration::from_secs(1)).map_err(|e| e.to_string())?;
    let pong: String = redis::cmd("PING").query(&mut connection).map_err(|e| e.to_string())?;
    if pong == "PONG" { Ok(()) } else { Err(format!("PING answered {pong}")) }
}

const INSTALL_CLUSTER: &str = "these tests need a Redis Cluster: install Redis (`apt-get install redis-server \
                               redis-tools`) so they can start three `redis-server`s and join them with \
                               `redis-cli --cluster create`, or set REDIS_CLUSTER_URL to a cluster they may write \
                               to (redis+cluster://host1:port1,host2:port2,...)";

/// How long a freshly created cluster has to reach `cluster_state:ok` on every node.
const CLUSTER_STARTUP: Duration = Duration::from_secs(30);

/// A Redis Cluster a test may use, and the suffix its hash tags must carry.
pub(crate) struct TestRedisCluster {
    /// Where to connect: `redis+cluster://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3` or
    /// `REDIS_CLUSTER_URL`.
    pub url: String,
    /// One `redis://` URL per seed node, for commands sent to a node of the test's choosing.
    seeds: Vec<String>,
    run: String,
    servers: Vec<Child>,
    /// Each node's working directory (its `nodes-<port>.conf`), removed when dropped.
    _dirs: Vec<tempfile::TempDir>,
}

impl TestRedisCluster {
    /// `REDIS_CLUSTER_URL` when it is set, else a cluster of this test's own.
    pub(crate) fn start() -> Self {
        match std::env::var("REDIS_CLUSTER_URL") {
            Ok(url) if !url.is_empty() => {
                let cluster = Self { seeds: seeds_of(&url), url, run: run(), servers: vec![], _dirs: vec![] };
                if let Err(e) = cluster_ok(&cluster.seeds[0]) {
                    panic!("REDIS_CLUSTER_URL is set but that cluster is not usable ({e}); {INSTALL_CLUSTER}");
                }
                cluster
            }
            _ => Self::private(),
        }
    }

    /// Three `redis-server --cluster-enabled yes` on free loopback ports, each in a temporary
    /// directory of its own, every slot assigned by `redis-cli --cluster create`.
    pub(crate) fn private() -> Self {
        if let Err(e) = Command::new("redis-cli").arg("--version").output() {
            panic!("cannot run redis-cli ({e}); {INSTALL_CLUSTER}");
        }
        let mut last_error = String::new();
        // As for one server, a free port may be taken before the server binds it: try again.
        for _ in 0..5 {
            let ports = cluster_ports();
            let mut cluster = Self {
                url: format!("redis+cluster://{}", ports.map(|p| format!("127.0.0.1:{p}")).join(",")),
                seeds: ports.iter().map(|p| format!("redis://127.0.0.1:{p}/")).collect(),
                run: run(),
                servers: vec![],
                _dirs: vec![],
            };
            match cluster.spawn_and_join(ports) {
                Ok(()) => return cluster,
                Err(e) => last_error = e,
            }
        }
        panic!("the Redis Cluster did not come up ({last_error}); {INSTALL_CLUSTER}");
    }

    fn spawn_and_join(&mut self, ports: [u16; 3]) -> Result<(), String> {
        for port in ports {
            let dir = tempfile::tempdir().map_err(|e| format!("a temporary directory: {e}"))?;
            let nodes_file = dir.path().join(format!("nodes-{port}.conf"));
            let child = Command::new("redis-server")
                .args(["--cluster-enabled", "yes", "--cluster-config-file"])
                .arg(&nodes_file)
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                .current_dir(dir.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn();
            let mut child = match child {
                Ok(child) => child,
                Err(e) => panic!("cannot start redis-server ({e}); {INSTALL_CLUSTER}"),
            };
            let answered = wait_for_ping(&format!("redis://127.0.0.1:{port}/"), &mut child);
            self.servers.push(child);
            self._dirs.push(dir);
            answered?;
        }
        let create = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(ports.map(|p| format!("127.0.0.1:{p}")))
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("redis-cli --cluster create: {e}"))?;
        if !create.status.success() {
            return Err(format!(
                "redis-cli --cluster create exited with {}: {}",
                create.status,
                String::from_utf8_lossy(&create.stdout).lines().last().unwrap_or_default()
            ));
        }
        let started = Instant::now();
        for seed in &self.seeds {
            loop {
                match cluster_ok(seed) {
                    Ok(()) => break,
                    Err(e) if started.elapsed() > CLUSTER_STARTUP => return Err(format!("{seed}: {e}")),
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
            }
        }
        Ok(())
    }

    /// `{tag}name`, with this test's run in the tag: keys of one tag share a slot, and tests
    /// on a shared cluster never see each other's keys.
    pub(crate) fn key(&self, tag: &str, name: &str) -> String {
        format!("{{{tag}:{}}}{name}", self.run)
    }

    /// `redis://host:port/` of every primary, from `CLUSTER SLOTS`.
    pub(crate) fn primaries(&self) -> Vec<String> {
        let mut primaries: Vec<String> = self.slot_ranges().into_iter().map(|(_, _, node)| node).collect();
        primaries.sort();
        primaries.dedup();
        primaries
    }

    /// `redis://host:port/` of the primary that holds `key`'s slot (`CLUSTER KEYSLOT`).
    pub(crate) fn primary_of(&self, key: &str) -> String {
        let slot: u16 =
            redis::cmd("CLUSTER").arg("KEYSLOT").arg(key).query(&mut connect(&self.seeds[0])).expect("KEYSLOT");
        let ranges = self.slot_ranges();
        let (_, _, node) =
            ranges.into_iter().find(|(start, end, _)| (*start..=*end).contains(&slot)).expect("every slot is served");
        node
    }

    /// Whether the node at `node` (a `redis://` URL) holds `key`.
    pub(crate) fn holds(node: &str, key: &str) -> bool {
        // READONLY-free EXISTS: a primary answers for its own slots and MOVED for the others.
        matches!(redis::cmd("EXISTS").arg(key).query::<i64>(&mut connect(node)), Ok(1))
    }

    /// (first slot, last slot, `redis://host:port/` of the primary) for every range.
    fn slot_ranges(&self) -> Vec<(u16, u16, String)> {
        let slots: Vec<redis::Value> =
            redis::cmd("CLUSTER").arg("SLOTS").query(&mut connect(&self.seeds[0])).expect("SLOTS");
        let int = |v: &redis::Value| match v {
            redis::Value::Int(i) => u16::try_from(*i).expect("a slot or port"),
            other => panic!("CLUSTER SLOTS: {other:?} is not a number"),
        };
        let text = |v: &redis::Value| match v {
            redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
            other => panic!("CLUSTER SLOTS: {other:?} is not a string"),
        };
        slots
            .iter()
            .map(|range| match range {
                // [first, last, [ip, port, id, ...] of the primary, replicas...]
                redis::Value::Array(fields) => match &fields[2] {
                    redis::Value::Array(primary) => (
                        int(&fields[0]),
                        int(&fields[1]),
                        format!("redis://{}:{}/", text(&primary[0]), int(&primary[1])),
                    ),
                    other => panic!("CLUSTER SLOTS: {other:?} is not a node"),
                },
                other => panic!("CLUSTER SLOTS: {other:?} is not a range"),
            })
            .collect()
    }
}

impl Drop for TestRedisCluster {
    fn drop(&mut self) {
        // A shared cluster keeps only what TTLs clear: every key the store writes has one.
        for server in &mut self.servers {
            let _ = server.kill();
            let _ = server.wait();
        }
    }
}

/// One `redis://` URL per seed node of a `redis+cluster://` URL or a comma-separated list.
fn seeds_of(url: &str) -> Vec<String> {
    match url.strip_prefix("redis+cluster://") {
        Some(rest) => {
            let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
            let (auth, hosts) =
                authority.rsplit_once('@').map_or((String::new(), authority), |(a, h)| (format!("{a}@"), h));
            hosts.split(',').map(|host| format!("redis://{auth}{host}/{path}")).collect()
        }
        None => url.split(',').map(str::to_owned).collect(),
    }
}

fn connect(url: &str) -> redis::Connection {
    redis::Client::open(url)
        .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(2)))
        .unwrap_or_else(|e| panic!("cannot reach cluster node {url}: {e}"))
}

/// Whether `CLUSTER INFO` on `node` says `cluster_state:ok`.
fn cluster_ok(node: &str) -> Result<(), String> {
    let client = redis::Client::open(node).map_err(|e| e.to_string())?;
    let mut connection = client.get_connection_with_timeout(Duration::from_secs(1)).map_err(|e| e.to_string())?;
    let info: String = redis::cmd("CLUSTER").arg("INFO").query(&mut connection).map_err(|e| e.to_string())?;
    if info.lines().any(|line| line.trim() == "cluster_state:ok") {
        Ok(())
    } else {
        Err(info.lines().find(|l| l.starts_with("cluster_state")).unwrap_or("no cluster_state").to_owned())
    }
}

/// Three free loopback ports whose cluster bus ports (each port + 10000) are free too.
fn cluster_ports() -> [u16; 3] {
    let mut ports: Vec<u16> = Vec::with_capacity(3);
    while ports.len() < 3 {
        let port = free_port();
        let clashes = ports.iter().any(|&p| [p, p + 10_000].contains(&port) || p == port + 10_000);
        if port < 55_000 && !clashes && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            ports.push(port);
        }
    }
    [ports[0], ports[1], ports[2]]
}

fn run() -> String {
    format!("{:012x}", rand::random::<u64>() >> 16)
}
