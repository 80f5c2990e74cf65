//! A slow or lossy link to a TCP server (Redis, say): a relay of the test's own that delays every
//! chunk it forwards by a latency (in order, per direction) and holds a lost one for a
//! retransmission timeout, as TCP turns loss into a stall. Both can be changed while it runs.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How long a lost segment is held: TCP's initial retransmission timeout (RFC 6298).
pub(crate) const RETRANSMISSION: Duration = Duration::from_secs(1);

/// What the relay does to every chunk it forwards, changed while it runs.
#[derive(Default)]
pub(crate) struct Impairment {
    pub latency_ms: AtomicU64,
    /// Chunks lost, per thousand.
    pub loss_per_mille: AtomicU64,
}

impl Impairment {
    /// A link that delays every chunk by `latency` each way, and loses none.
    pub(crate) fn latency(latency: Duration) -> Arc<Self> {
        let impairment = Arc::new(Self::default());
        impairment.latency_ms.store(latency.as_millis() as u64, Ordering::Relaxed);
        impairment
    }
}

/// Starts a relay to `target` that impairs every connection as `impairment` says; its address.
pub(crate) async fn start(target: SocketAddr, impairment: Arc<Impairment>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the relay");
    let addr = listener.local_addr().expect("relay address");
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let impairment = impairment.clone();
            tokio::spawn(async move {
                let Ok(server) = TcpStream::connect(target).await else { return };
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                // Either direction ending closes both: a broken connection, as the client sees it.
                tokio::select! {
                    () = impaired(client_read, server_write, impairment.clone()) => {}
                    () = impaired(server_read, client_write, impairment) => {}
                }
            });
        }
    });
    addr
}

/// The address a `redis://host:port/` URL names.
pub(crate) fn address_of(url: &str) -> SocketAddr {
    let rest = url.trim_start_matches("redis://").trim_end_matches('/');
    rest.parse().expect("a redis://127.0.0.1:PORT/ URL")
}

async fn impaired<R, W>(mut from: R, mut to: W, impairment: Arc<Impairment>)
where
    R: AsyncReadExt + Unpin,
    W: AsyncWriteExt + Unpin,
{
    let (chunks, mut arrived) = tokio::sync::mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let read = async move {
        let mut buffer = vec![0u8; 16 * 1024];
        while let Ok(n @ 1..) = from.read(&mut buffer).await {
            if chunks.send((Instant::now(), buffer[..n].to_vec())).is_err() {
                return;
            }
        }
    };
    let write = async move {
        while let Some((at, chunk)) = arrived.recv().await {
            let mut due = at + Duration::from_millis(impairment.latency_ms.load(Ordering::Relaxed));
            if rand::random_range(0..1000) < impairment.loss_per_mille.load(Ordering::Relaxed) {
                due += RETRANSMISSION;
            }
            tokio::time::sleep_until(due.into()).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
    };
    tokio::join!(read, write);
}
