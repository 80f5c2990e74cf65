//! Where the store's Redis is (one server, or a Cluster's seed nodes; TLS or not) and the one
//! connection every call shares.

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::cluster::ClusterClient;
use ::redis::cluster_async::ClusterConnection;
use ::redis::{Client, Cmd, FromRedisValue, RedisResult, Script, TlsCertificates, Value};
use std::sync::Arc;
use std::time::Duration;

use mcp_ratelimit_kernel::store::StoreError;

use crate::batch::{Batcher, Invocation, Traffic, no_script};

/// Where the store's Redis is, as `store.redis_url` says.
pub(super) enum Target {
    /// One server: its URL as given, its `host:port` for messages, and whether it is TLS.
    Node { url: String, address: String, tls: bool },
    /// A Redis Cluster: one `redis://` (or `rediss://`) URL per seed node, their `host:port`s
    /// for messages, and whether they are TLS.
    Cluster { nodes: Vec<String>, address: String, tls: bool },
}

impl Target {
    /// Reads a URL of one of the forms [`super::invalid_url`] lists; the error never shows a
    /// password.
    pub(super) fn parse(url: &str) -> Result<Target, StoreError> {
        let url = url.trim();
        let cluster = [("redis+cluster://", "redis"), ("rediss+cluster://", "rediss")]
            .into_iter()
            .find_map(|(prefix, scheme)| url.strip_prefix(prefix).map(|rest| (rest, scheme)));
        let nodes: Vec<String> = if let Some((rest, scheme)) = cluster {
            // The password and the database apply to every node: `[user:pass@]h1:p1,h2:p2[/db]`.
            let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
            let (userinfo, hosts) = authority.rsplit_once('@').map_or(("", authority), |(u, h)| (u, h));
            let at = if userinfo.is_empty() { "" } else { "@" };
            hosts.split(',').map(|host| format!("{scheme}://{userinfo}{at}{}/{path}", host.trim())).collect()
        } else if url.contains(',') {
            url.split(',').map(|node| node.trim().to_owned()).collect()
        } else {
            let address = node_address(url, SCHEMES)?;
            return Ok(Target::Node { url: url.to_owned(), address, tls: url.starts_with("rediss://") });
        };
        let tls = nodes.first().is_some_and(|node| node.starts_with("rediss://"));
        let mut addresses = Vec::with_capacity(nodes.len());
        for node in &nodes {
            addresses.push(node_address(node, SCHEMES)?);
            if node.starts_with("rediss://") != tls {
                return Err(super::invalid_url(
                    "some nodes are rediss:// and some redis://: a cluster's nodes are all TLS or none".into(),
                ));
            }
            let db = url::Url::parse(node).map(|u| u.path().trim_matches('/').to_owned()).unwrap_or_default();
            if !(db.is_empty() || db == "0") {
                return Err(super::invalid_url(format!("database {db}: a Redis Cluster has only database 0")));
            }
        }
        // What the cluster client itself checks: the nodes agree on password and protocol.
        ClusterClient::new(nodes.clone()).map_err(|e| super::invalid_url(e.to_string()))?;
        Ok(Target::Cluster { nodes, address: format!("{} (cluster)", addresses.join(", ")), tls })
    }

    pub(super) fn address(&self) -> &str {
        match self {
            Target::Node { address, .. } | Target::Cluster { address, .. } => address,
        }
    }

    pub(super) fn tls(&self) -> bool {
        match self {
            Target::Node { tls, .. } | Target::Cluster { tls, .. } => *tls,
        }
    }

    /// A client of one node (a cluster's first seed node) for what a shared connection cannot
    /// carry: a subscription. A cluster passes every message published on any node to every
    /// other node, so one node hears them all.
    pub(super) fn listener(&self, certificates: TlsCertificates) -> RedisResult<Client> {
        let (url, tls) = match self {
            Target::Node { url, tls, .. } => (url.as_str(), *tls),
            Target::Cluster { nodes, tls, .. } => (nodes.first().map_or("", String::as_str), *tls),
        };
        if tls && certificates.root_cert.is_some() {
            Client::build_with_tls(url, certificates)
        } else {
            Client::open(url)
        }
    }

    /// Opens the connection, each attempt and each reply bounded by `timeout`; a TLS server is
    /// verified against `certificates` (their root, or the system's trust store without one).
    pub(super) async fn connect(self, timeout: Duration, certificates: TlsCertificates) -> RedisResult<Connection> {
        let custom_root = certificates.root_cert.is_some();
        match self {
            Target::Node { url, tls, .. } => {
                // One retry: a request during an outage fails fast (the guard decides what a
                // failed store means), and the next one starts a new reconnect.
                // Reconnect attempts start at once (not after the default 100 ms), so a dead
                // Redis is noticed, and a revived one found, within the store timeout.
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(timeout))
                    .set_response_timeout(Some(timeout))
                    .set_number_of_retries(1)
                    .set_min_delay(Duration::from_millis(1))
                    .set_max_delay(timeout);
                let client =
                    if tls && custom_root { Client::build_with_tls(url, certificates)? } else { Client::open(url)? };
                let connection = ConnectionManager::new_with_config(client, config).await?;
                let traffic = Arc::new(Traffic::default());
                Ok(Connection::Node {
                    batcher: Batcher::start(connection.clone(), traffic.clone()),
                    connection,
                    traffic,
                })
            }
            Target::Cluster { nodes, tls, .. } => {
                // One retry is also what following a MOVED takes, after slots moved.
                let mut builder =
                    ClusterClient::builder(nodes).connection_timeout(timeout).response_timeout(timeout).retries(1);
                if tls && custom_root {
                    builder = builder.certs(certificates);
                }
                let client = builder.build()?;
                Ok(Connection::Cluster(client.get_async_connection().await?, Arc::default()))
            }
        }
    }
}

/// The URL schemes of one node: plain, and TLS.
const SCHEMES: &[&str] = &["redis", "rediss"];

/// The `host:port` of one node's URL, once its scheme is one of `schemes`, it names a host and
/// its port is a real one.
fn node_address(url: &str, schemes: &[&str]) -> Result<String, StoreError> {
    let invalid = |why: String| super::invalid_url(format!("`{}`: {why}", mcp_ratelimit_kernel::redact::url(url)));
    let parsed = url::Url::parse(url).map_err(|e| invalid(e.to_string()))?;
    if !schemes.contains(&parsed.scheme()) {
        let expected = schemes.iter().map(|s| format!("{s}://")).collect::<Vec<_>>().join(" or ");
        return Err(invalid(format!("the scheme is {}://, not {expected}", parsed.scheme())));
    }
    let host = parsed.host_str().filter(|h| !h.is_empty()).ok_or_else(|| invalid("no host".into()))?;
    match parsed.port().unwrap_or(6379) {
        0 => Err(invalid("port 0".into())),
        port => Ok(format!("{host}:{port}")),
    }
}

/// The connection every call of a store shares.
#[derive(Clone)]
pub(super) enum Connection {
    /// One Redis, through one multiplexed connection that reconnects by itself, and the task that
    /// sends the script calls made at one moment together ([`Batcher`]).
    Node { connection: ConnectionManager, batcher: Batcher, traffic: Arc<Traffic> },
    /// A Redis Cluster: each call goes to the primary holding its keys' slot; and what went.
    Cluster(ClusterConnection, Arc<Traffic>),
}

impl Connection {
    /// Runs a script call (EVALSHA, loading the script where a node answers NOSCRIPT, then
    /// sending it again).
    pub(super) async fn invoke<T: FromRedisValue>(&self, invocation: &Invocation<'_>) -> RedisResult<T> {
        let value = match self.send(invocation.command()).await {
            Err(error) if no_script(&error) => {
                self.load(invocation.script()).await?;
                self.send(invocation.command()).await?
            }
            answer => answer?,
        };
        Ok(::redis::from_redis_value(value)?)
    }

    /// Sends a script call: on one Redis with the calls made at the same moment, in one pipeline
    /// ([`Batcher`]); on a cluster, alone, to the primary of its keys' slot.
    async fn send(&self, command: Cmd) -> RedisResult<Value> {
        match self.clone() {
            Connection::Node { batcher, .. } => batcher.send(command).await,
            Connection::Cluster(mut connection, _) => {
                self.counted().sent(1);
                command.query_async(&mut connection).await
            }
        }
    }

    /// Runs a plain command (routed by its key on a cluster).
    pub(super) async fn query<T: FromRedisValue>(&self, command: &Cmd) -> RedisResult<T> {
        self.counted().sent(1);
        match self.clone() {
            Connection::Node { mut connection, .. } => command.query_async(&mut connection).await,
            Connection::Cluster(mut connection, _) => command.query_async(&mut connection).await,
        }
    }

    /// Where what went to Redis is counted.
    fn counted(&self) -> &Traffic {
        match self {
            Connection::Node { traffic, .. } | Connection::Cluster(_, traffic) => traffic,
        }
    }

    /// Round trips to Redis since the connection opened, and the commands they carried.
    pub(super) fn traffic(&self) -> (u64, u64) {
        self.counted().so_far()
    }

    /// Loads a script (on every node of a cluster).
    pub(super) async fn load(&self, script: &Script) -> RedisResult<()> {
        match self.clone() {
            Connection::Node { mut connection, .. } => script.load_async(&mut connection).await.map(drop),
            Connection::Cluster(mut connection, _) => script.load_async(&mut connection).await.map(drop),
        }
    }
}
