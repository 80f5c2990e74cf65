//! The command line: `check-config` accepts the defaults and names the key of every mistake.

use std::io::Write;
use std::process::Command;

use crate::common;

fn check_config(toml: &str, env: &[(&str, &str)]) -> (bool, String, String) {
    let mut file = tempfile::NamedTempFile::new().expect("temp file");
    file.write_all(toml.as_bytes()).expect("write config");
    let mut command = Command::new(env!("CARGO_BIN_EXE_mcp-ratelimit"));
    command.arg("check-config").arg(file.path());
    for (k, v) in env {
        command.env(k, v);
    }
    let out = command.output().expect("binary runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn documented_defaults_pass_and_print_the_limits_table() {
    let (ok, stdout, _) = check_config("", &[]);
    assert!(ok);
    assert!(stdout.contains("token_bucket") && stdout.contains("generate_image_to_video"), "{stdout}");
}

#[test]
fn cost_larger_than_its_bucket_fails_naming_both_keys() {
    let (ok, _, stderr) = check_config("[tools.generate_image_to_video]\ncost = 100\n", &[]);
    assert!(!ok);
    assert!(stderr.contains("tools.generate_image_to_video.cost"), "{stderr}");
    assert!(stderr.contains("limits.caller.burst"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn every_kind_of_mistake_names_its_key() {
    for (toml, key) in [
        ("[limits.caller]\nalgorithm = \"leaky_faucet\"\n", "limits.caller.algorithm"),
        ("[limits.caller]\nrefill_per_sec = 0.0\n", "limits.caller.refill_per_sec"),
        ("[limits.caller]\nburst = -3\n", "limits.caller.burst"),
        ("[tools.teleport]\ncost = 1\n", "tools.teleport"),
        ("[upstream]\nurl = \"not a url\"\n", "upstream.url"),
        ("[server]\nlisten = \"nowhere\"\n", "server.listen"),
        ("[limits.caller\n", "TOML"),
    ] {
        let (ok, _, stderr) = check_config(toml, &[]);
        assert!(!ok, "{toml} should fail");
        assert!(stderr.to_lowercase().contains(&key.to_lowercase()), "{toml}: {stderr}");
    }
}

#[test]
fn a_cost_formula_too_deep_for_a_stack_is_refused_naming_its_key_not_a_crash() {
    // 10,000 deep crashed `serve` on the first call, 200,000 deep `check-config` itself (exit 134).
    for depth in [10_000, 200_000] {
        let formula = format!("{}1{}", "(".repeat(depth), ")".repeat(depth));
        let toml = format!("[tools.generate_image]\ncost = \"{formula}\"\ncost_max = 5\n");
        let mut file = tempfile::NamedTempFile::new().expect("temp file");
        file.write_all(toml.as_bytes()).expect("write config");
        let out = Command::new(env!("CARGO_BIN_EXE_mcp-ratelimit"))
            .arg("check-config")
            .arg(file.path())
            .output()
            .expect("binary runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{depth} deep: refused as a config error: {stderr}");
        assert!(stderr.contains("tools.generate_image.cost"), "{stderr}");
        assert!(stderr.contains("at most 256 bytes"), "{stderr}");
        assert!(stderr.len() < 1_000, "the formula is not printed back: {} bytes", stderr.len());
    }
    let (ok, _, stderr) = check_config(
        &format!("[tools.generate_image]\ncost = \"{}1{}\"\ncost_max = 5\n", "(".repeat(33), ")".repeat(33)),
        &[],
    );
    assert!(!ok && stderr.contains("tools.generate_image.cost") && stderr.contains("33 deep"), "{stderr}");
}

#[test]
fn a_rate_too_slow_to_keep_is_refused_naming_its_key_and_a_slow_one_is_printed_as_it_is() {
    // Each passed before: as 10^9 per second (1e-300), 184466 of 1000000 after one call, and a
    // wait of 18446744074 seconds.
    for (toml, key) in [
        ("[limits.caller]\nrefill_per_sec = 1e-300\n", "`limits.caller.refill_per_sec`"),
        ("[limits.caller]\nburst = 1000000\nrefill_per_sec = 0.00001\n", "`limits.caller.refill_per_sec`"),
        ("[limits.caller]\nburst = 300\nrefill_per_sec = 1e-12\n", "`limits.caller.refill_per_sec`"),
        (
            "[limits.tenant]\nalgorithm = \"leaky_bucket\"\nburst = 1000\nleak_per_sec = 0.00001\n",
            "`limits.tenant.leak_per_sec`",
        ),
        (
            "[limits.tenant]\nalgorithm = \"gcra\"\nburst = 1000\nrefill_per_sec = 1e-320\n",
            "`limits.tenant.refill_per_sec`",
        ),
    ] {
        let (ok, _, stderr) = check_config(toml, &[]);
        assert!(!ok, "{toml} should fail");
        assert!(stderr.contains(key) && stderr.contains("within a year (31536000 s)"), "{toml}: {stderr}");
    }
    let (ok, _, stderr) = check_config("[limits.caller]\nburst = 300\nrefill_per_sec = 1e-12\n", &[]);
    assert!(!ok && stderr.contains("at least 300 / 31536000 = 9.513e-6 per second"), "{stderr}");
    // A tier that rounds a burst up stretches its bucket past a year: named with the tier.
    let tiered = "[limits.caller]\nburst = 60\nrefill_per_sec = 0.0000019218\n[tiers]\nthrifty = 0.4917\n";
    let (ok, _, stderr) = check_config(tiered, &[]);
    assert!(!ok, "{stderr}");
    assert!(stderr.contains("`limits.caller`") && stderr.contains("`tiers.thrifty` (0.4917)"), "{stderr}");
    assert!(stderr.contains("more than a year (31536000 s)"), "{stderr}");
    // The slowest a burst of 60 may have (within a year), printed as the rate the limiter keeps.
    let (ok, stdout, stderr) = check_config("[limits.caller]\nburst = 60\nrefill_per_sec = 0.000002\n", &[]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("burst 60, refill 0.000002/s"), "{stdout}");
}

#[test]
fn environment_overrides_the_file_and_is_validated_too() {
    let (ok, stdout, _) = check_config("", &[("MCP_RL__LIMITS__CALLER__BURST", "120")]);
    assert!(ok);
    assert!(stdout.contains("burst 120,"), "{stdout}");
    let (ok, _, stderr) = check_config("", &[("MCP_RL__LIMITS__CALLER__BURST", "lots")]);
    assert!(!ok);
    assert!(stderr.contains("limits.caller.burst"), "{stderr}");
}

#[test]
fn the_telemetry_endpoint_is_set_from_the_environment_and_checked_there_too() {
    let (ok, _, stderr) = check_config("", &[("MCP_RL__TELEMETRY__OTLP_ENDPOINT", "http://127.0.0.1:4318")]);
    assert!(ok, "{stderr}");
    let (ok, _, stderr) = check_config("", &[("MCP_RL__TELEMETRY__OTLP_ENDPOINT", "collector:4318")]);
    assert!(!ok);
    assert!(stderr.contains("telemetry.otlp_endpoint") && stderr.contains("http://"), "{stderr}");
}

#[test]
fn a_timeout_beyond_any_clock_is_refused_naming_its_key_from_a_file_or_the_environment() {
    let huge = "18446744073709551615";
    for (toml, env) in [
        (format!("[upstream]\ntimeout_ms = {huge}\n"), vec![]),
        (String::new(), vec![("MCP_RL__UPSTREAM__TIMEOUT_MS", huge)]),
    ] {
        let (ok, _, stderr) = check_config(&toml, &env);
        assert!(!ok, "{toml}{env:?}");
        assert!(stderr.contains("upstream.timeout_ms"), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    let (ok, _, stderr) = check_config("[upstream]\njob_expiry_seconds = 604801\n", &[]);
    assert!(!ok && stderr.contains("upstream.job_expiry_seconds") && stderr.contains("a week"), "{stderr}");
}

#[test]
fn an_insurance_share_too_small_for_a_tool_fails_naming_the_instances_and_the_limit() {
    let toml = "[store]\nbackend = \"redis\"\nexpected_instances = 5\n[tools.generate_image]\nfail = \"open\"\n\
                [tools.generate_image_to_video]\ncost = 20\n[limits.caller]\nburst = 40\n";
    let (ok, _, stderr) = check_config(toml, &[]);
    assert!(!ok);
    assert!(stderr.contains("store.expected_instances"), "{stderr}");
    // 40 × guest 0.5 = 20, a fifth of which is 4, below the image's 5.
    assert!(stderr.contains("`limits.caller.burst` × `tiers.guest` (20 → 4)") && stderr.contains("cost 5"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn a_missing_config_file_is_an_error_not_a_default() {
    let out = Command::new(env!("CARGO_BIN_EXE_mcp-ratelimit"))
        .args(["check-config", "/nonexistent/mcp-ratelimit.toml"])
        .output()
        .expect("binary runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("nonexistent"));
}

#[test]
fn serve_stops_cleanly_on_sigterm() {
    let (mut child, _) = serve_on_a_free_port(|c| {
        c.env("RUST_LOG", "warn");
    });
    let killed = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().expect("kill runs");
    assert!(killed.success());
    let exited = (0..200).find_map(|_| {
        std::thread::sleep(std::time::Duration::from_millis(25)); // polling the child process, bounded
        child.try_wait().ok().flatten()
    });
    let status = exited.unwrap_or_else(|| {
        let _ = child.kill();
        panic!("server ignored SIGTERM");
    });
    assert!(status.success(), "graceful exit, got {status}");
}

#[tokio::test]
async fn serve_logs_where_to_look_without_colour_codes_when_not_on_a_terminal() {
    let (child, port) = serve_on_a_free_port(|c| {
        c.env_remove("RUST_LOG")
            .env("MCP_RL__LIMITS__METHOD__OTHER__BURST", "1")
            .current_dir(std::env::temp_dir())
            .stderr(std::process::Stdio::piped());
    });
    // A refused ping is logged once, by the server's own rate-limited refusal log, not again by
    // rmcp as a WARN with the whole error (make burst would fill the terminal with those).
    let mut session = common::RawSession::new(&format!("http://127.0.0.1:{port}/mcp"), &[]);
    session.open().await;
    session.ping(1).await;
    let (_, _, refused) = session.ping(2).await;
    assert!(refused.contains("rate_limited"), "{refused}");
    Command::new("kill").args(["-TERM", &child.id().to_string()]).status().expect("kill runs");
    let out = child.wait_with_output().expect("exits");
    let log = String::from_utf8_lossy(&out.stderr);
    for url in ["mcp", "dashboard", "metrics"] {
        assert!(log.contains(&format!("http://127.0.0.1:{port}/{url}")), "{url} in: {log}");
    }
    assert!(!log.contains('\u{1b}'), "no ANSI escapes in a piped log: {log:?}");
    assert!(log.contains("refused") && !log.contains("WARN"), "one INFO line for the refusal, no WARN: {log}");
}

/// `serve` on a free loopback port, set up by `configure`, once it accepts connections (a bounded
/// poll of the child process).
fn serve_on_a_free_port(configure: impl FnOnce(&mut Command)) -> (std::process::Child, u16) {
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("free port").port();
    let mut command = Command::new(env!("CARGO_BIN_EXE_mcp-ratelimit"));
    command.args(["serve", "--listen", &format!("127.0.0.1:{port}")]);
    configure(&mut command);
    let child = command.spawn().expect("server starts");
    let up = (0..200).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(25)); // polling the child process, bounded
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    assert!(up, "server never listened");
    (child, port)
}

/// `serve` with `[telemetry]` exporting to `receiver` (set as a user sets it, in the file, with
/// `telemetry` added to the section), `key` configured with `auth` added to its entry; the
/// directory holding the file, the child, an agent of `key`, and the server's MCP URL.
async fn serve_traced(
    receiver: &crate::otlp::Receiver,
    key: &str,
    auth: &str,
    telemetry: &str,
) -> (tempfile::TempDir, tokio::process::Child, crate::common::Client, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("config.toml");
    let toml = format!(
        "[[auth.keys]]\nkey = \"{key}\"\n{auth}[telemetry]\notlp_endpoint = \"{}\"\nexport_interval_ms = 100\n{telemetry}",
        receiver.url
    );
    std::fs::write(&file, toml).expect("config written");
    let (child, agent, port) = crate::common::serve_file(&file, key).await;
    (dir, child, agent, format!("http://127.0.0.1:{port}/mcp"))
}

/// `serve` with `[telemetry]`: the binary's own subscriber sends the call's spans to the
/// collector, named for the caller's tenant, never its key.
#[tokio::test]
async fn serve_with_telemetry_sends_a_calls_spans_to_the_collector() {
    use crate::otlp::{Receiver, attribute};
    let receiver = Receiver::start();
    let key = "binary-telemetry-key-0123456789";
    let (_dir, _child, agent, _url) = serve_traced(&receiver, key, "tenant = \"acme\"\n", "").await;
    let answered = crate::common::call(&agent, "list_articles", serde_json::json!({})).await;
    assert!(!crate::common::is_error(&answered));
    let spans = receiver
        .eventually("the call's spans", |spans| {
            ["tools/call", "upstream.request"].iter().all(|name| spans.iter().any(|s| s.name == *name))
        })
        .await;
    let decided = spans.iter().find(|s| s.name == "tools/call").expect("found");
    assert_eq!(attribute(decided, "ratelimit.caller.tenant").as_deref(), Some("acme"));
    assert_eq!(attribute(decided, "ratelimit.outcome").as_deref(), Some("answered"));
    let sent = spans.iter().find(|s| s.name == "upstream.request").expect("found");
    assert_eq!(sent.parent_span_id, decided.span_id, "the paid API's request is the call's child");
    let bytes = receiver.bytes();
    assert!(!bytes.windows(key.len()).any(|w| w == key.as_bytes()), "the key in an exported span");
}

/// `telemetry.sample_ratio = 0`: a call that comes with no trace context of its caller's makes no
/// span at all (the draw is made before any is made, so it costs what traces off cost), while one
/// whose caller sent a sampled `traceparent` is traced whole — through clients of both eras: rmcp's
/// (2025-11-25, the context in `_meta`) and the Python SDK's default (2026-07-28, the context as a
/// header). In the binary, a process of its own: the ratio is the process's.
#[tokio::test]
async fn serve_with_a_sample_ratio_of_zero_traces_only_what_the_caller_started() {
    use crate::otlp::{Receiver, hex, names};
    let receiver = Receiver::start();
    let key = "binary-sampled-key-0123456789";
    let (_dir, _child, agent, url) = serve_traced(&receiver, key, "", "sample_ratio = 0.0\n").await;
    let trace = "0af7651916cd43dd8448eb211c80319c";
    // Untraced first: three calls of the 2025-11-25 client, one of the 2026-07-28 one.
    for page in ["0", "10", "20"] {
        let answered = crate::common::call(&agent, "list_articles", serde_json::json!({"cursor": page})).await;
        assert!(!crate::common::is_error(&answered));
    }
    let authorization = format!("Authorization: Bearer {key}");
    let one_call = |page: &str| serde_json::json!([{"op": "call", "tool": "list_articles", "args": {"cursor": page}}]);
    let walked = crate::python::walk(&url, "auto", one_call("30"), &["-H", &authorization]).await;
    assert!(crate::python::all_ok(&walked), "{walked}");
    assert_eq!(walked["protocol_version"], crate::python::era_of("auto"), "{walked}");
    // Then one call of each that carries the caller's trace.
    let mut request = rmcp::model::CallToolRequestParams::new("list_articles");
    let mut meta = rmcp::model::RequestMetaObject::default();
    meta.0.insert("traceparent".to_owned(), format!("00-{trace}-b7ad6b7169203331-01").into());
    request.meta = Some(meta);
    let answered = agent.call_tool(request).await.expect("tools/call answered");
    assert!(!crate::common::is_error(&answered));
    let traceparent = format!("traceparent: 00-{trace}-00f067aa0ba902b7-01");
    let walked = crate::python::walk(&url, "auto", one_call("40"), &["-H", &authorization, "-H", &traceparent]).await;
    assert!(crate::python::all_ok(&walked), "{walked}");
    // Spans are exported in the order they end: once the traced calls' are in, the four before
    // them would be too, had they made any.
    let spans = receiver
        .eventually("both traced calls' spans", |spans| {
            spans.iter().filter(|s| s.name == "tools/call").count() >= 2
                && spans.iter().filter(|s| s.name == "upstream.request").count() >= 2
        })
        .await;
    assert!(spans.iter().all(|s| hex(&s.trace_id) == trace), "{:#?}", names(&spans));
    assert_eq!(spans.iter().filter(|s| s.name == "tools/call").count(), 2, "{:#?}", names(&spans));
}
