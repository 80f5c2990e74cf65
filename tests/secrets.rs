//! A raw credential never reaches a log line or a metric label, even with every log level on;
//! no secret of the config (a Redis password, a plaintext key, the admin key, `auth.id_secret`, an
//! upstream's password) reaches a Debug print of the config or the running server, nor
//! `check-config`'s output. (The log capture is process-wide: only the first test installs it,
//! and the others use none of its token.)

mod common;

use std::io::Write;

use common::*;
use mcp_ratelimit::clock::ManualClock;
use mcp_ratelimit::{App, Config};
use serde_json::json;
use sha2::{Digest, Sha256};

const TOKEN: &str = "sk-live-DO-NOT-LOG-7f3a91c2";

#[tokio::test]
async fn the_raw_token_never_appears_in_logs_or_metrics() {
    let capture = LogCapture::default();
    let writer = capture.clone();
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .init();

    // The paid API's key goes out with every upstream request, at TRACE too, and is logged nowhere.
    let server = TestServer::start(&format!(
        "[limits.http]\nburst = 40\n[mock_upstream]\nmax_concurrent_predictions = 1000\napi_key = \"{API_KEY}\"\n\
         [upstream]\napi_key = \"{API_KEY}\"\n"
    ))
    .await;
    let client = server.client(Some(TOKEN)).await;
    client.list_all_tools().await.expect("tools/list");
    spend_until_refused(&client, "generate_image", json!({"prompt": "p"}), 20).await;
    call(&client, "generate_image", json!({"prompt": "x".repeat(4001)})).await;
    let raw = RawSession::new(&server.url, &[("x-api-key", TOKEN)]);
    for id in 0..50 {
        raw.ping(id).await;
    }
    let metrics =
        reqwest::get(format!("http://{}/metrics", server.addr)).await.expect("metrics").text().await.expect("text");

    let logs = capture.text();
    assert!(logs.contains("refused"), "the capture saw the rejections:\n{logs}");
    assert!(logs.contains("rmcp::"), "the capture includes the MCP library's own trace logs");
    assert!(metrics.contains("mcp_ratelimit_rejections_total"), "{metrics}");
    assert!(metrics.contains("client_bucket=\"b"), "{metrics}");
    assert_eq!(server.upstream_usage().await["refused_401"], 0, "the key was sent");
    for haystack in [&logs, &metrics] {
        assert!(!haystack.contains(API_KEY), "the paid API's key leaked");
        assert!(!haystack.contains(TOKEN), "raw token leaked");
        assert!(!haystack.contains("DO-NOT-LOG"), "part of the raw token leaked");
    }
    assert!(!metrics.contains("tok:"), "no caller id in metric labels");
}

const REDIS_PASSWORD: &str = "redis-pw-NEVER-PRINTED-93af";
const PLAIN_KEY: &str = "sk-plain-NEVER-PRINTED-41c7";
const HASHED_KEY: &str = "sk-hashed-NEVER-PRINTED-0b3e";
const ADMIN_KEY: &str = "admin-NEVER-PRINTED-5e2b90d1";
const ID_SECRET: &str = "idsecret-NEVER-PRINTED-77d0";
const API_KEY: &str = "apikey-NEVER-PRINTED-c4d2";
const UPSTREAM_PASSWORD: &str = "upstream-pw-NEVER-PRINTED-c4";
/// A Standard Webhooks secret: its key is the bytes of "NEVER-PRINTED-webhook-key".
const WEBHOOK_SECRET: &str = "whsec_TkVWRVItUFJJTlRFRC13ZWJob29rLWtleQ==";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A config holding one of every secret, on the given store backend.
fn secret_config(backend: &str, upstream: &str) -> String {
    format!(
        "[store]\nbackend = \"{backend}\"\nredis_url = \"redis://:{REDIS_PASSWORD}@127.0.0.1:6399/0\"\n\
         [upstream]\nurl = \"{upstream}\"\napi_key = \"{API_KEY}\"\nwebhook_secret = \"{WEBHOOK_SECRET}\"\n\
         webhook_url = \"https://hook:{UPSTREAM_PASSWORD}@mcp.example.com/webhooks/upstream\"\n\
         [mock_upstream]\napi_key = \"{API_KEY}\"\nwebhook_secret = \"{WEBHOOK_SECRET}\"\n\
         [admin]\nkey = \"{ADMIN_KEY}\"\n\
         [auth]\nid_secret = \"{ID_SECRET}\"\n\
         [[auth.keys]]\nkey = \"{PLAIN_KEY}\"\ntenant = \"acme\"\n\
         [[auth.keys]]\nsha256 = \"{}\"\n",
        hex(&Sha256::digest(HASHED_KEY))
    )
}

/// Every secret of [`secret_config`], and the forms that would give one away: the keys' and the
/// admin key's SHA-256, in hex and as Debug prints a byte array.
fn secrets() -> Vec<String> {
    let mut all: Vec<String> = [
        REDIS_PASSWORD,
        PLAIN_KEY,
        HASHED_KEY,
        ADMIN_KEY,
        ID_SECRET,
        UPSTREAM_PASSWORD,
        API_KEY,
        WEBHOOK_SECRET,
        "NEVER-PRINTED",
    ]
    .map(str::to_owned)
    .into();
    // The webhook key's base64 without its prefix, and its bytes as Debug prints them.
    all.push(WEBHOOK_SECRET.trim_start_matches("whsec_").to_owned());
    all.push(format!("{:?}", b"NEVER-PRINTED-webhook-key"));
    for key in [PLAIN_KEY, HASHED_KEY, ADMIN_KEY] {
        let digest: [u8; 32] = Sha256::digest(key).into();
        all.push(hex(&digest));
        all.push(format!("{digest:?}"));
        all.push(format!("{:?}", &digest[..8]));
    }
    all
}

fn assert_no_secret(what: &str, printed: &str) {
    for secret in secrets() {
        assert!(!printed.contains(&secret), "{what} shows `{secret}`:\n{printed}");
    }
}

#[tokio::test]
async fn no_debug_print_of_the_config_or_the_server_shows_a_secret() {
    let upstream = format!("http://agent:{UPSTREAM_PASSWORD}@127.0.0.1:9/");
    let catalogue = mcp_ratelimit::mcp::tools::catalogue();
    let config = Config::from_toml(&secret_config("memory", &upstream), &catalogue).expect("config");
    for printed in [format!("{config:?}"), format!("{config:#?}")] {
        assert_no_secret("the config", &printed);
        assert!(printed.contains("redis://***@127.0.0.1:6399/0"), "the URL shows, without its password: {printed}");
        assert!(printed.contains("http://***@127.0.0.1:9/"), "{printed}");
        assert!(printed.contains("acme"), "the rest of the config shows: {printed}");
    }
    let app = App::start(config, ManualClock::new()).await.expect("server starts");
    for printed in [format!("{app:?}"), format!("{app:#?}"), format!("{:#?}", app.state())] {
        assert_no_secret("the server", &printed);
        assert!(printed.contains("Identifier") && printed.contains("Upstream"), "{printed}");
    }
    app.stop();
}

#[test]
fn check_config_prints_no_secret() {
    let check = |toml: &str| {
        let mut file = tempfile::NamedTempFile::new().expect("temp file");
        file.write_all(toml.as_bytes()).expect("write config");
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_mcp-ratelimit"))
            .arg("check-config")
            .arg(file.path())
            .output()
            .expect("binary runs");
        let printed = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        (out.status.success(), printed)
    };
    let upstream = format!("https://agent:{UPSTREAM_PASSWORD}@api.example.com/v1/");
    let (ok, printed) = check(&secret_config("redis", &upstream));
    assert!(ok && printed.contains("config OK") && printed.contains("2 configured key(s)"), "{printed}");
    assert_no_secret("check-config", &printed);
    // Refused URLs are named without their passwords.
    let bad_redis = secret_config("redis", "").replace("6399/0", "not-a-port/0");
    let (ok, printed) = check(&bad_redis);
    assert!(!ok && printed.contains("store.redis_url"), "{printed}");
    assert_no_secret("check-config refusing the Redis URL", &printed);
    let bad_cluster = secret_config("redis", "")
        .replace("redis://:", "redis+cluster://:")
        .replace("@127.0.0.1:6399/0", "@127.0.0.1:6399,127.0.0.1:x/0");
    let (ok, printed) = check(&bad_cluster);
    assert!(!ok && printed.contains("store.redis_url"), "{printed}");
    assert_no_secret("check-config refusing a cluster URL", &printed);
    let short = secret_config("memory", "").replace(ID_SECRET, "NEVER-PRINTED");
    let (ok, printed) = check(&short);
    assert!(!ok && printed.contains("auth.id_secret"), "{printed}");
    assert_no_secret("check-config refusing a short id secret", &printed);
}
