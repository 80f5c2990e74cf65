//! `simulate` through the binary, on the documented defaults (`save_article`, cost 2, against the
//! caller's bucket of 60 refilling 1 a second: 30 calls at once, then one every 2 s): the runaway
//! loop held to that rate for 8 hours by every algorithm, 2× through a fixed window at its edge
//! and through no other, the obedient agent wasting nothing, one seed printing one output, charts
//! that parse, and bad input refused with exit code 2.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

/// The caller budget of the defaults, in cost units.
const BURST: u64 = 60;
const PER_SEC: u64 = 1;
/// `save_article`'s cost.
const COST: u64 = 2;
const EIGHT_HOURS_SECS: u64 = 8 * 3600;
/// The algorithms that stand in for a rate, in run order.
const RATE_ALGORITHMS: [&str; 6] =
    ["token_bucket", "gcra", "fixed_window", "sliding_log", "sliding_window", "leaky_bucket"];

/// Runs `simulate` with the documented defaults (an empty config file), charts into `out`.
fn simulate(out: &Path, args: &[&str]) -> Output {
    let config = tempfile::NamedTempFile::new().expect("temp config");
    Command::new(env!("CARGO_BIN_EXE_mcp-ratelimit"))
        .arg("simulate")
        .arg("--config")
        .arg(config.path())
        .arg("--out")
        .arg(out)
        .args(args)
        .output()
        .expect("binary runs")
}

/// The JSON report of a successful run.
fn report(args: &[&str]) -> Value {
    let out = tempfile::tempdir().expect("temp dir");
    let mut args = args.to_vec();
    args.extend(["--format", "json"]);
    let output = simulate(out.path(), &args);
    assert!(output.status.success(), "simulate failed: {}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice(&output.stdout).expect("the report is JSON")
}

/// The runs of `shape`, by algorithm.
fn runs<'r>(report: &'r Value, shape: &str) -> Vec<(&'r str, &'r Value)> {
    let shape =
        report["shapes"].as_array().expect("shapes").iter().find(|s| s["shape"] == shape).expect("the shape ran");
    shape["runs"].as_array().expect("runs").iter().map(|r| (r["algorithm"].as_str().expect("algorithm"), r)).collect()
}

fn number(run: &Value, field: &str) -> u64 {
    run[field].as_u64().unwrap_or_else(|| panic!("{field} in {run}"))
}

#[test]
fn the_runaway_loop_is_held_to_the_configured_rate_for_eight_hours_by_every_algorithm() {
    let report = report(&["--shape", "runaway_loop"]);
    let runs = runs(&report, "runaway_loop");
    assert_eq!(runs.iter().map(|(a, _)| *a).collect::<Vec<_>>(), RATE_ALGORITHMS);
    let allowed_by_rate = PER_SEC * EIGHT_HOURS_SECS;
    for (algorithm, run) in &runs {
        // One call a second for 8 hours, twice what the budget sustains.
        assert_eq!(number(run, "calls"), EIGHT_HOURS_SECS, "{algorithm}");
        let spend = number(run, "spend");
        assert_eq!(spend, number(run, "allowed") * COST, "{algorithm}");
        assert!(spend <= allowed_by_rate + BURST, "{algorithm} spent {spend}: more than a burst over rate × time");
        // The weighted sliding window is conservative under steady overload: it may lose up to
        // one call a window (480 windows of 60 s), never more.
        let slack = if *algorithm == "sliding_window" { COST * EIGHT_HOURS_SECS / 60 } else { BURST };
        assert!(spend + slack >= allowed_by_rate, "{algorithm} spent only {spend}");
    }
    // Exact: a bucket admits the first 59 calls (one token back a second against two spent), then
    // every other one; a window admits 30 calls in each of the 480 windows.
    for (algorithm, run) in &runs {
        let exact = match *algorithm {
            "token_bucket" | "gcra" | "leaky_bucket" => COST * (59 + (EIGHT_HOURS_SECS - 60) / 2),
            "fixed_window" | "sliding_log" => allowed_by_rate,
            _ => continue,
        };
        assert_eq!(number(run, "spend"), exact, "{algorithm}");
    }
    // In any minute the upstream saw at most a burst plus a minute's refill (a bucket's contract),
    // and a sliding log at most its limit.
    for (algorithm, run) in &runs {
        let most = if *algorithm == "sliding_log" { BURST } else { BURST + 60 * PER_SEC };
        assert!(number(run, "peak_per_minute") * COST <= most, "{algorithm}: {run}");
    }
}

#[test]
fn a_fixed_window_lets_twice_the_limit_through_at_its_edge_and_no_other_algorithm_does() {
    let report = report(&["--shape", "edge_attack"]);
    let burst_calls = BURST / COST;
    for (algorithm, run) in runs(&report, "edge_attack") {
        let expected = if algorithm == "fixed_window" { 2 * burst_calls } else { burst_calls };
        assert_eq!(number(run, "peak_per_second"), expected, "{algorithm}: {run}");
    }
}

#[test]
fn the_obedient_agent_wastes_no_call_and_gets_as_much_done_as_a_retry_storm() {
    let report = report(&["--shape", "obedient,retry_storm"]);
    let storm = runs(&report, "retry_storm");
    for ((algorithm, obedient), (_, storm)) in runs(&report, "obedient").into_iter().zip(storm) {
        assert_eq!(number(obedient, "wasted"), 0, "{algorithm}: {obedient}");
        // Not vacuous: it did run into the budget, and every retry after the wait it was told landed.
        assert!(number(obedient, "refused") > 0, "{algorithm}: {obedient}");
        assert!(number(obedient, "allowed") + 1 >= number(storm, "allowed"), "{algorithm}: {obedient} vs {storm}");
        assert!(number(storm, "wasted") > 10 * number(storm, "allowed"), "{algorithm}: {storm}");
    }
}

#[test]
fn the_same_seed_prints_the_same_bytes_and_another_seed_other_numbers() {
    let out = tempfile::tempdir().expect("temp dir");
    let run = |seed: &str| {
        let output = simulate(out.path(), &["--seed", seed, "--shape", "fan_out,retry_storm,reconnect_to_reset"]);
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        output.stdout
    };
    let first = run("7");
    assert_eq!(first, run("7"), "two runs with seed 7");
    // The tables alone (the heading names the seed): another seed draws other timings.
    let tables = |out: &[u8]| String::from_utf8_lossy(out).lines().skip(1).collect::<Vec<_>>().join("\n");
    assert_ne!(tables(&first), tables(&run("8")), "the seed drives the jitter");
}

#[test]
fn every_shape_gets_a_well_formed_svg_chart_naming_each_algorithm() {
    let out = tempfile::tempdir().expect("temp dir");
    let output = simulate(out.path(), &[]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let stdout = String::from_utf8_lossy(&output.stdout);
    for shape in [
        "steady",
        "burst_then_steady",
        "fan_out",
        "retry_storm",
        "obedient",
        "runaway_loop",
        "reconnect_to_reset",
        "edge_attack",
    ] {
        let path = out.path().join(format!("{shape}.svg"));
        assert!(stdout.contains(&path.display().to_string()), "the output names {}", path.display());
        let svg = std::fs::read_to_string(&path).expect("chart written");
        let document = roxmltree::Document::parse(&svg).unwrap_or_else(|e| panic!("{shape}.svg is not XML: {e}"));
        assert_eq!(document.root_element().tag_name().name(), "svg");
        let text: String = document.descendants().filter_map(|n| n.text()).collect();
        for algorithm in RATE_ALGORITHMS {
            assert!(text.contains(algorithm), "{shape}.svg names {algorithm}");
        }
        assert!(text.contains(shape), "{shape}.svg is titled");
    }
    // Said, not silently skipped.
    assert!(stdout.contains("concurrency      not simulated: a slot cap"), "{stdout}");
}

#[test]
fn a_job_tool_holds_its_in_flight_slots_until_the_job_is_done() {
    // generate_image costs 5: the caller's 60 would admit 12 at once, but the caller may have only
    // 5 jobs in flight (each 6 s long in the mock), whatever the algorithm.
    let report = report(&["--tool", "generate_image", "--shape", "burst_then_steady"]);
    for (algorithm, run) in runs(&report, "burst_then_steady") {
        assert_eq!(number(run, "peak_per_second"), 5, "{algorithm}: {run}");
    }
}

#[test]
fn bad_input_is_refused_with_exit_code_2_and_a_message_naming_it() {
    let out = tempfile::tempdir().expect("temp dir");
    for (args, says) in [
        (vec!["--shape", "stampede"], vec!["stampede", "edge_attack"]),
        (vec!["--algorithm", "magic"], vec!["magic", "sliding_log"]),
        (vec!["--tool", "make_coffee"], vec!["unknown tool `make_coffee`", "save_article"]),
        (vec!["--tool", "get_prediction"], vec!["`get_prediction` costs nothing"]),
        (vec!["--seed", "lots"], vec!["--seed"]),
    ] {
        let output = simulate(out.path(), &args);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        for said in says {
            assert!(stderr.contains(said), "{args:?}: {stderr}");
        }
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    let mut bad = tempfile::NamedTempFile::new().expect("temp config");
    std::io::Write::write_all(&mut bad, b"[limits.caller]\nalgorithm = \"leaky_faucet\"\n").expect("write");
    let output = Command::new(env!("CARGO_BIN_EXE_mcp-ratelimit"))
        .args(["simulate", "--out"])
        .arg(out.path())
        .arg("--config")
        .arg(bad.path())
        .output()
        .expect("binary runs");
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("limits.caller.algorithm"));
}
