//! The shell scripts CI runs stay safe under `set -o pipefail`: no pipeline ends in a reader that
//! stops before its writer is done (`head`, `grep -q`, `grep -m`), which kills the writer with
//! SIGPIPE and fails the script with 141 whenever the writer had more to say (the Inspector
//! stage's `echo "$refusal" | head -c 400` did, now and then). Print a prefix with
//! `printf '%.400s\n' "$x"`, match with `grep -q … <<<"$x"` or `[[ $x =~ … ]]`.

use std::path::Path;

/// The pieces of a pipeline, after a `|` (not `||`), that may stop reading early.
const EARLY_READERS: &[&str] = &["head", "grep -q", "grep -Eq", "grep -qE", "grep -m", "grep -Em", "grep -Fq"];

/// A script's lines that pipe into an early reader, with their numbers; a line may say why it
/// may (`# sigpipe: …`, e.g. a background pipeline whose status nobody reads).
fn early_readers(script: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    for (n, line) in script.lines().enumerate() {
        let code = line.trim_start();
        if code.starts_with('#') || line.contains("# sigpipe:") {
            continue;
        }
        let pieces = line.split('|').collect::<Vec<_>>();
        for pair in pieces.windows(2) {
            // `a || b` splits into an empty piece: not a pipe.
            let (before, after) = (pair[0], pair[1].trim_start());
            if before.is_empty() || pair[1].is_empty() {
                continue;
            }
            if EARLY_READERS.iter().any(|reader| after.starts_with(reader)) {
                found.push((n + 1, line.trim().to_owned()));
            }
        }
    }
    found
}

#[test]
fn no_script_under_pipefail_pipes_into_a_reader_that_stops_early() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut scripts: Vec<_> = std::fs::read_dir(root.join("scripts"))
        .expect("scripts/")
        .map(|entry| entry.expect("an entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "sh"))
        .collect();
    scripts.push(root.join(".ci/run"));
    let mut unsafe_lines = Vec::new();
    for script in &scripts {
        let text = std::fs::read_to_string(script).unwrap_or_else(|e| panic!("{}: {e}", script.display()));
        if !text.contains("pipefail") {
            continue;
        }
        for (n, line) in early_readers(&text) {
            unsafe_lines.push(format!("{}:{n}: {line}", script.strip_prefix(root).unwrap_or(script).display()));
        }
    }
    assert!(scripts.len() > 10, "the scripts were found: {scripts:?}");
    assert!(unsafe_lines.is_empty(), "pipelines that can die of SIGPIPE under pipefail:\n{}", unsafe_lines.join("\n"));
    // The check itself finds what it is for.
    let planted = "set -o pipefail\necho \"$refusal\" | head -c 400\nx=$(grep -Eo a <<<\"$y\" | head -n 1)\n\
                   a || b\ncurl -s \"$u\" | grep -q ok\n";
    assert_eq!(early_readers(planted).iter().map(|(n, _)| *n).collect::<Vec<_>>(), [2, 3, 5]);
}
