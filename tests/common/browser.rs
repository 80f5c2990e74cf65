//! Headless Chromium, driven over the Chrome DevTools Protocol, for tests that look at a page the
//! way a person would: load it, let its scripts run, read what it shows, take a screenshot.
//!
//! Debian's `chromium` (or the binary `CHROMIUM` names) is started with a fresh profile and
//! everything that would reach for the network turned off (the test machine may have none, and
//! Chromium stalls on refused connections otherwise). The protocol is JSON over one WebSocket:
//! the few commands these tests need are sent by hand instead of through a client crate that
//! would compile the whole protocol. Without Chromium the tests fail, saying how to install it:
//! they never skip silently.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use base64::Engine;
use futures::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

const INSTALL: &str = "this test drives headless Chromium: install Debian's package (`apt-get install chromium`; \
                       `make test` and `.ci/run` do it when missing and they may), or set CHROMIUM to a \
                       Chromium or Chrome binary";

/// How long Chromium has to start, and any one protocol command to answer.
const PATIENCE: Duration = Duration::from_secs(30);

/// The window every page is laid out in.
pub(crate) const WIDTH: u32 = 1280;
pub(crate) const HEIGHT: u32 = 900;

/// A running headless Chromium with one page open. Killed when dropped.
pub(crate) struct Browser {
    child: tokio::process::Child,
    _profile: tempfile::TempDir,
    page: WebSocketStream<MaybeTlsStream<TcpStream>>,
    next_id: u64,
}

/// The Chromium binary: `CHROMIUM`, else `chromium` on the PATH.
fn chromium() -> PathBuf {
    if let Some(path) = std::env::var_os("CHROMIUM").filter(|p| !p.is_empty()) {
        return PathBuf::from(path);
    }
    let found = std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).map(|dir| dir.join("chromium")).find(|p| p.is_file()));
    found.flatten().unwrap_or_else(|| panic!("chromium not found on the PATH; {INSTALL}"))
}

impl Browser {
    /// Starts Chromium and connects to its first page.
    pub(crate) async fn launch() -> Self {
        let binary = chromium();
        let profile = tempfile::tempdir().expect("a profile directory");
        let log = profile.path().join("chromium.log");
        let child = tokio::process::Command::new(&binary)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-dev-shm-usage",
                "--hide-scrollbars",
                "--force-device-scale-factor=1",
                &format!("--window-size={WIDTH},{HEIGHT}"),
                &format!("--user-data-dir={}", profile.path().display()),
                "--remote-debugging-port=0",
                "about:blank",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("chromium's log"))
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}; {INSTALL}", binary.display()));
        let port = devtools_port(profile.path(), &log).await;
        let page = page_socket(port).await;
        let (page, _) = tokio_tungstenite::connect_async(page.as_str()).await.expect("connect to the page");
        Self { child, _profile: profile, page, next_id: 0 }
    }

    /// Sends one protocol command and returns its result (panics on a protocol error).
    pub(crate) async fn command(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let message = json!({"id": id, "method": method, "params": params}).to_string();
        self.page.send(Message::text(message)).await.expect("send a command");
        let answer = tokio::time::timeout(PATIENCE, async {
            while let Some(message) = self.page.next().await {
                let Ok(Message::Text(text)) = message else { continue };
                let Ok(value) = serde_json::from_str::<Value>(text.as_str()) else { continue };
                // Events (no id) and answers to earlier commands are not ours.
                if value["id"].as_u64() == Some(id) {
                    return value;
                }
            }
            panic!("Chromium closed the connection during {method}");
        })
        .await
        .unwrap_or_else(|_| panic!("Chromium did not answer {method} in {PATIENCE:?}"));
        if let Some(error) = answer.get("error") {
            panic!("{method} failed: {error}");
        }
        answer["result"].clone()
    }

    /// Opens `url` and waits until it has loaded.
    pub(crate) async fn open(&mut self, url: &str) {
        self.command("Page.enable", json!({})).await;
        let navigated = self.command("Page.navigate", json!({"url": url})).await;
        if let Some(problem) = navigated["errorText"].as_str() {
            panic!("cannot open {url}: {problem}");
        }
        self.wait_for("the page to load", "document.readyState === 'complete'").await;
    }

    /// The value of a JavaScript expression in the page (promises awaited).
    pub(crate) async fn eval(&mut self, expression: &str) -> Value {
        let answer = self
            .command("Runtime.evaluate", json!({"expression": expression, "returnByValue": true, "awaitPromise": true}))
            .await;
        if let Some(thrown) = answer.get("exceptionDetails") {
            panic!("`{expression}` threw: {thrown}");
        }
        answer["result"]["value"].clone()
    }

    /// Waits a bounded real time (the page polls on the browser's own clock) until `expression`
    /// is true in the page.
    pub(crate) async fn wait_for(&mut self, what: &str, expression: &str) {
        let give_up = tokio::time::Instant::now() + PATIENCE;
        while tokio::time::Instant::now() < give_up {
            if self.eval(expression).await == Value::Bool(true) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let text = self.eval("document.body ? document.body.innerText : ''").await;
        panic!("the page never showed {what} in {PATIENCE:?}; it shows:\n{}", text.as_str().unwrap_or_default());
    }

    /// A PNG of the whole page (its full height) written to `path`.
    pub(crate) async fn screenshot(&mut self, path: &Path) {
        let height = self.eval("document.documentElement.scrollHeight").await.as_u64().unwrap_or(u64::from(HEIGHT));
        let metrics =
            json!({"width": WIDTH, "height": height.max(u64::from(HEIGHT)), "deviceScaleFactor": 1, "mobile": false});
        self.command("Emulation.setDeviceMetricsOverride", metrics).await;
        let shot = self.command("Page.captureScreenshot", json!({"format": "png"})).await;
        let png = base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().expect("screenshot data"))
            .expect("screenshot is base64");
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("screenshot directory");
        }
        std::fs::write(path, png).expect("write the screenshot");
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

/// The DevTools port Chromium picked: the first line of `DevToolsActivePort` in its profile.
async fn devtools_port(profile: &Path, log: &Path) -> u16 {
    let file = profile.join("DevToolsActivePort");
    let give_up = tokio::time::Instant::now() + PATIENCE;
    while tokio::time::Instant::now() < give_up {
        if let Some(port) = std::fs::read_to_string(&file).ok().and_then(|s| s.lines().next()?.trim().parse().ok()) {
            return port;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let log = std::fs::read_to_string(log).unwrap_or_default();
    panic!("Chromium did not open its DevTools port in {PATIENCE:?}; its log:\n{log}");
}

/// The WebSocket of the browser's first page.
async fn page_socket(port: u16) -> String {
    let list: Value = reqwest::get(format!("http://127.0.0.1:{port}/json/list"))
        .await
        .expect("DevTools answers")
        .json()
        .await
        .expect("DevTools target list");
    list.as_array()
        .and_then(|targets| targets.iter().find(|t| t["type"] == "page"))
        .and_then(|page| page["webSocketDebuggerUrl"].as_str())
        .map(str::to_owned)
        .unwrap_or_else(|| panic!("Chromium has no page to drive: {list}"))
}
