//! What requests held open cost the proxy, and who may hold how many: the streams of one HTTP/2
//! connection (`server.max_streams_per_connection`), and 2026-07-28 subscriptions
//! (`subscriptions/listen`) per configured caller and per address
//! (`proxy.max_subscriptions_per_caller`, `proxy.max_subscriptions_per_address`), which no
//! session cap counts: a subscription opens no session, and a made-up key brings a budget of its
//! own.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use mcp_ratelimit::proxy::Target;
use rmcp::model::SubscriptionFilter;
use rmcp::service::{ServiceError, Subscription};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::clients::modern_client;
use crate::common::{Client, eventually, metric_sum, settle};
use crate::proxy::{Changing, Proxy, proxy_metrics, serve_in_test};

/// The subscriptions the proxy says it holds open (`/metrics`).
async fn open_subscriptions(proxy: &Proxy) -> f64 {
    metric_sum(&proxy_metrics(proxy).await, "mcp_ratelimit_subscriptions_open")
}

/// A proxy in front of a 2026-07-28 server that tells of its changes on subscriptions.
async fn proxy_of_changes(toml: &str) -> Proxy {
    let target = Target::Http { url: serve_in_test(Changing::default()).await, headers: Vec::new() };
    Proxy::start(toml, target).await
}

// Frame types, flags, settings and error codes of HTTP/2 (RFC 9113) the test speaks.
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const MAX_CONCURRENT_STREAMS: u16 = 0x3;
const REFUSED_STREAM: u32 = 0x7;
const CANCEL: u32 = 0x8;

/// An HTTP/2 connection with prior knowledge, in cleartext (h2c), spoken frame by frame: a client
/// library heeds the server's `SETTINGS` and holds back the streams past its limit itself, so
/// only raw frames show what the server does with a client that does not.
struct H2c {
    tcp: TcpStream,
    authority: String,
}

/// A frame the server sent.
struct Frame {
    kind: u8,
    flags: u8,
    stream: u32,
    payload: Vec<u8>,
}

impl H2c {
    /// Connects to the server of `url` and sends the preface and empty `SETTINGS`.
    async fn connect(url: &str) -> Self {
        let authority = url.trim_start_matches("http://").split('/').next().expect("a host").to_owned();
        let tcp = TcpStream::connect(&authority).await.expect("connect");
        let mut h2 = Self { tcp, authority };
        h2.tcp.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await.expect("the preface");
        h2.send(SETTINGS, 0, 0, &[]).await;
        h2
    }

    async fn send(&mut self, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
        let length = u32::try_from(payload.len()).expect("a small frame").to_be_bytes();
        let mut frame = length[1..].to_vec();
        frame.extend([kind, flags]);
        frame.extend(stream.to_be_bytes());
        frame.extend(payload);
        self.tcp.write_all(&frame).await.expect("a frame written");
    }

    /// Opens `stream` with a 2026-07-28 `subscriptions/listen` (request `id`) for the tools'
    /// changes: its headers (HPACK literals, never indexed), then its body, which ends it.
    async fn subscribe(&mut self, stream: u32, id: u32) {
        let authority = self.authority.clone();
        let headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/mcp"),
            (":authority", authority.as_str()),
            ("content-type", "application/json"),
            ("accept", "application/json, text/event-stream"),
            ("mcp-protocol-version", "2026-07-28"),
            ("mcp-method", "subscriptions/listen"),
        ];
        let mut block = Vec::new();
        for (name, value) in headers {
            block.push(0);
            for text in [name, value] {
                block.push(u8::try_from(text.len()).ok().filter(|&n| n < 127).expect("a short string"));
                block.extend(text.as_bytes());
            }
        }
        self.send(HEADERS, END_HEADERS, stream, &block).await;
        let meta = json!({
            "io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {},
            "io.modelcontextprotocol/clientInfo": {"name": "h2c", "version": "1"},
        });
        let body = json!({"jsonrpc": "2.0", "id": id, "method": "subscriptions/listen",
                          "params": {"_meta": meta, "notifications": {"toolsListChanged": true}}});
        self.send(DATA, END_STREAM, stream, body.to_string().as_bytes()).await;
    }

    /// The next frame the server sends (within 10 s), its `SETTINGS` and `PING`s answered.
    async fn next(&mut self) -> Frame {
        let mut head = [0u8; 9];
        let read = tokio::time::timeout(Duration::from_secs(10), self.tcp.read_exact(&mut head)).await;
        read.expect("a frame within 10 s").expect("the connection stands");
        let length = u32::from_be_bytes([0, head[0], head[1], head[2]]);
        let mut payload = vec![0u8; usize::try_from(length).expect("a frame's length")];
        self.tcp.read_exact(&mut payload).await.expect("the frame's payload");
        let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
        let frame = Frame { kind: head[3], flags: head[4], stream, payload };
        match (frame.kind, frame.flags & ACK) {
            (SETTINGS, 0) => self.send(SETTINGS, ACK, 0, &[]).await,
            (PING, 0) => self.send(PING, ACK, 0, &frame.payload.clone()).await,
            _ => {}
        }
        frame
    }

    /// Reads frames until each of `streams` was answered (`HEADERS`, which must say 200) or
    /// reset (`RST_STREAM`); the answered ones, the reset ones with the code of their first reset
    /// (a stream refused is reset again, `STREAM_CLOSED`, for the body sent on it), and the
    /// server's `SETTINGS_MAX_CONCURRENT_STREAMS` if it said it meanwhile.
    async fn outcomes(&mut self, streams: &[u32]) -> (BTreeSet<u32>, BTreeMap<u32, u32>, Option<u32>) {
        let (mut answered, mut reset, mut announced) = (BTreeSet::new(), BTreeMap::new(), None);
        while answered.len() + reset.len() < streams.len() {
            let frame = self.next().await;
            match frame.kind {
                SETTINGS if frame.flags & ACK == 0 => {
                    for setting in frame.payload.chunks_exact(6) {
                        if u16::from_be_bytes([setting[0], setting[1]]) == MAX_CONCURRENT_STREAMS {
                            announced = Some(u32::from_be_bytes([setting[2], setting[3], setting[4], setting[5]]));
                        }
                    }
                }
                HEADERS if streams.contains(&frame.stream) => {
                    // `:status: 200` is entry 8 of HPACK's static table, sent indexed.
                    assert_eq!(frame.payload.first(), Some(&0x88), "stream {} answered 200", frame.stream);
                    answered.insert(frame.stream);
                }
                RST_STREAM if streams.contains(&frame.stream) => {
                    let code = frame.payload.get(..4).map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]));
                    reset.entry(frame.stream).or_insert(code.expect("an error code"));
                }
                GOAWAY => panic!("the server closed the connection: {:?}", frame.payload),
                _ => {}
            }
        }
        (answered, reset, announced)
    }
}

/// One HTTP/2 connection carries at most `server.max_streams_per_connection` requests at once:
/// the server says so in its `SETTINGS`, and of five subscriptions opened on one h2c connection
/// past a limit of three, the last two are refused (`REFUSED_STREAM`) before the proxy hears of
/// them, while the first three are held open as subscriptions. Resetting one gives its stream and
/// its subscription back, and the next stream is served. (hyper's default is 200: on it all five
/// were served.)
#[tokio::test]
async fn an_http2_connection_holds_at_most_its_streams_and_a_stream_past_them_is_refused() {
    let proxy = proxy_of_changes("[server]\nmax_streams_per_connection = 3\n").await;
    let mut h2 = H2c::connect(&proxy.url).await;
    let streams = [1, 3, 5, 7, 9];
    for (id, stream) in (1..).zip(streams) {
        h2.subscribe(stream, id).await;
    }
    let (answered, reset, announced) = h2.outcomes(&streams).await;
    assert_eq!(answered, BTreeSet::from([1, 3, 5]), "served: {answered:?}, reset: {reset:?}");
    assert_eq!(reset, BTreeMap::from([(7, REFUSED_STREAM), (9, REFUSED_STREAM)]));
    assert_eq!(announced, Some(3), "SETTINGS_MAX_CONCURRENT_STREAMS");
    eventually("the three served are subscriptions", || async { open_subscriptions(&proxy).await == 3.0 }).await;

    h2.send(RST_STREAM, 0, 1, &CANCEL.to_be_bytes()).await;
    eventually("the subscription reset is given back", || async { open_subscriptions(&proxy).await == 2.0 }).await;
    h2.subscribe(11, 6).await;
    let (answered, reset, _) = h2.outcomes(&[11]).await;
    assert_eq!((answered, reset), (BTreeSet::from([11]), BTreeMap::new()), "the stream freed is served");
    eventually("and held open", || async { open_subscriptions(&proxy).await == 3.0 }).await;
}

/// A subscription to the tools' changes, acknowledged (rmcp acknowledges one before the proxy's
/// handler runs: one refused ends at once with the refusal).
async fn subscribe(client: &Client) -> Subscription {
    let asked = SubscriptionFilter::builder().tools_list_changed().build();
    client.peer().listen(asked).await.expect("acknowledged")
}

/// The refusal a subscription ended with at once: its `error` data (code, scope, wait).
async fn refusal_of(subscription: &mut Subscription) -> Value {
    let ended = tokio::time::timeout(Duration::from_secs(10), subscription.next()).await.expect("ended at once");
    match ended {
        Err(ServiceError::McpError(error)) => error.data.expect("the refusal's data"),
        other => panic!("not refused: {other:?}"),
    }
}

/// Asserts `refusal` is `busy` for the bound `scope` names, of `limit`, with a wait.
fn assert_busy(refusal: &Value, scope: &str, limit: u64) {
    assert_eq!(refusal["code"], "busy", "{refusal}");
    assert_eq!(refusal["scope"], scope, "{refusal}");
    assert_eq!(refusal["limit"], limit, "{refusal}");
    assert!(refusal["retry_after_ms"].as_u64().is_some_and(|ms| ms > 0), "a wait: {refusal}");
}

/// Five made-up keys of one address hold three subscriptions together
/// (`proxy.max_subscriptions_per_address = 3`): the last two are refused `busy`, naming the bound,
/// whatever key each invented. A configured key from the same address still opens its own two
/// (`max_subscriptions_per_caller = 2`), and its third is refused naming its own bound, charged
/// nothing. Closing one gives its place back at once: the next made-up key opens one, and so does
/// the configured key.
#[tokio::test]
async fn made_up_keys_share_their_addresss_subscriptions_and_a_configured_key_holds_its_own() {
    // The configured key's `limits.method.other` pays for exactly what it opens: its tenant's
    // session to the proxied server, its two subscriptions and the one after closing. Were its
    // refused third charged, that last one would be refused `rate_limited` (the clock never moves).
    let toml = "[proxy]\nmax_subscriptions_per_caller = 2\nmax_subscriptions_per_address = 3\n\
                [limits.method.other]\nalgorithm = \"token_bucket\"\nburst = 4\nrefill_per_sec = 0.001\n\
                [[auth.keys]]\nkey = \"configured-subscriber\"\ntenant = \"acme\"\n";
    let proxy = proxy_of_changes(toml).await;
    let mut made_up = Vec::new();
    for n in 0..5 {
        let client = modern_client(&proxy.url, &format!("made-up-key-{n}")).await;
        let subscription = subscribe(&client).await;
        made_up.push((client, subscription));
    }
    for (_, refused) in &mut made_up[3..] {
        assert_busy(&refusal_of(refused).await, "proxy:max_subscriptions_per_address", 3);
    }
    settle().await;
    for (_, open) in &mut made_up[..3] {
        assert!(futures::FutureExt::now_or_never(open.next()).is_none(), "still open");
    }
    eventually("three held by the address", || async { open_subscriptions(&proxy).await == 3.0 }).await;

    let configured = modern_client(&proxy.url, "configured-subscriber").await;
    let mut own = [subscribe(&configured).await, subscribe(&configured).await, subscribe(&configured).await];
    assert_busy(&refusal_of(&mut own[2]).await, "proxy:max_subscriptions_per_caller", 2);
    eventually("and two by the configured key", || async { open_subscriptions(&proxy).await == 5.0 }).await;

    // Closed, a subscription's place is free again, for the address and for the key.
    made_up[0].1.cancel().await.expect("cancelled");
    eventually("the made-up key's place given back", || async { open_subscriptions(&proxy).await == 4.0 }).await;
    let another = modern_client(&proxy.url, "made-up-key-5").await;
    let _taken = subscribe(&another).await;
    eventually("another made-up key takes it", || async { open_subscriptions(&proxy).await == 5.0 }).await;
    let one_more = modern_client(&proxy.url, "made-up-key-6").await;
    assert_busy(&refusal_of(&mut subscribe(&one_more).await).await, "proxy:max_subscriptions_per_address", 3);
    own[0].cancel().await.expect("cancelled");
    eventually("the configured key's place given back", || async { open_subscriptions(&proxy).await == 4.0 }).await;
    let _again = subscribe(&configured).await;
    eventually("the configured key opens one again", || async { open_subscriptions(&proxy).await == 5.0 }).await;
}
