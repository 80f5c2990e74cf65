//! The official Python MCP SDK (`mcp` 2.x, in the virtualenv `scripts/proxy-fixtures.sh`
//! installs at `.tools/python`) as a client of the server under test: `tests/fixtures/mcp_walk.py`
//! walks it through a list of steps in one protocol era and says what the SDK made of each answer.
//! The SDK checks every answer as its era requires (`resultType` for 2026-07-28, structured content
//! against the tool's `outputSchema`), which is why the tests use it.
#![allow(dead_code)]

use std::path::PathBuf;

use serde_json::Value;

fn installed(path: PathBuf) -> String {
    assert!(path.exists(), "{} is missing: run scripts/proxy-fixtures.sh (make test does)", path.display());
    path.to_string_lossy().into_owned()
}

/// The protocol version a mode of the Python SDK negotiates with an rmcp 3.x server: `auto` (its
/// default) speaks 2026-07-28, `legacy` the 2025-11-25 handshake.
pub(crate) fn era_of(mode: &str) -> &'static str {
    if mode == "auto" { "2026-07-28" } else { "2025-11-25" }
}

/// The Python SDK client walking `url` in `mode` (`auto` or `legacy`) through `steps` (see
/// `mcp_walk.py`), with extra command-line `args` (`-H 'Name: value'`, `--log-level L`).
/// What it answers: `{"protocol_version", "steps": [{"ok": …} | {"error", "message"}]}`.
pub(crate) async fn walk(url: &str, mode: &str, steps: Value, args: &[&str]) -> Value {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let python = installed(root.join(".tools/python/bin/python"));
    let script = installed(root.join("tests/fixtures/mcp_walk.py"));
    let out = tokio::process::Command::new(python)
        .arg(script)
        .arg(url)
        .arg(mode)
        .arg(steps.to_string())
        .args(args)
        .output()
        .await
        .expect("the Python client runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(&stdout).unwrap_or_else(|_| {
        panic!("the Python client printed no JSON: {stdout}\n{}", String::from_utf8_lossy(&out.stderr))
    })
}

/// Every step of a walk answered without an error the SDK raised.
pub(crate) fn all_ok(walked: &Value) -> bool {
    walked["steps"].as_array().is_some_and(|steps| steps.iter().all(|s| s.get("ok").is_some()))
}
