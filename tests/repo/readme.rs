//! The README and the pages under `docs/` stay true to the repository:
//!
//! - each code block after an `<!-- include: PATH -->` marker is that file, byte for byte;
//! - every relative link reaches a file that exists, and every `#anchor` a heading on its page;
//! - the README puts a newcomer's path first and sends them to every page under `docs/`;
//! - the README's config table names every key of `config.toml`, the compiled-in default;
//! - the README's walk-through of the guard's refusals, run as written against a server with the
//!   default config, meets each refusal it promises at the call it says.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The README, `BENCHMARKS.md` and every page under `docs/`, relative to the root, sorted.
fn pages() -> Vec<PathBuf> {
    let mut pages: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("docs/")
        .map(|entry| PathBuf::from("docs").join(entry.expect("an entry").file_name()))
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    pages.extend([PathBuf::from("README.md"), PathBuf::from("BENCHMARKS.md")]);
    pages.sort();
    pages
}

/// The lines of `text` outside fenced code blocks.
fn prose(text: &str) -> impl Iterator<Item = &str> {
    let mut fenced = false;
    text.lines().filter(move |line| {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            return false;
        }
        !fenced
    })
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens.
fn anchor_of(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors(text: &str) -> BTreeSet<String> {
    prose(text)
        .filter_map(|line| line.strip_prefix('#').map(|rest| rest.trim_start_matches('#')))
        .filter_map(|rest| rest.strip_prefix(' '))
        .map(anchor_of)
        .collect()
}

/// The targets of the markdown links `[text](target)` in the prose of `text`.
fn links(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for line in prose(text) {
        for (at, _) in line.match_indices("](") {
            let rest = &line[at + 2..];
            if let Some(end) = rest.find(')') {
                found.push(rest[..end].to_owned());
            }
        }
    }
    found
}

#[test]
fn the_docs_show_the_examples_as_they_are() {
    let mut checked = Vec::new();
    for page in pages() {
        let text = read(&root().join(&page));
        for (at, _) in text.match_indices("<!-- include: ") {
            let rest = &text[at + "<!-- include: ".len()..];
            let path = rest.split(" -->").next().expect("marker closes");
            let block = rest.split_once("```rust\n").map(|(_, code)| code).expect("a rust block follows the marker");
            // The fence that closes the block starts a line; the file's own doc fences start `//!`.
            let (block, _) = block.split_once("\n```\n").expect("the block closes");
            let file = read(&root().join(path));
            assert!(
                format!("{block}\n") == file,
                "{}'s copy of {path} differs from the file: paste the file again",
                page.display()
            );
            checked.push(path.to_owned());
        }
    }
    checked.sort();
    assert_eq!(checked, ["examples/axum_only.rs", "examples/rmcp_server.rs"]);
}

#[test]
fn every_link_reaches_a_file_and_every_anchor_a_heading() {
    let mut broken = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = read(&root().join(&page));
        let here = page.parent().unwrap_or(Path::new(""));
        for link in links(&text) {
            if link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            checked += 1;
            let (path, anchor) = link.split_once('#').unwrap_or((&link, ""));
            let target = if path.is_empty() { page.clone() } else { here.join(path) };
            let Ok(target_text) = std::fs::read(root().join(&target)) else {
                broken.push(format!("{}: {link}: no such file", page.display()));
                continue;
            };
            if !anchor.is_empty() && !anchors(&String::from_utf8_lossy(&target_text)).contains(anchor) {
                broken.push(format!("{}: {link}: no heading #{anchor} in {}", page.display(), target.display()));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    assert!(checked > 50, "the links were found: {checked}");
}

#[test]
fn the_readme_puts_a_newcomers_path_first_and_links_every_page() {
    let readme = read(&root().join("README.md"));
    let sections: Vec<&str> = prose(&readme).filter_map(|line| line.strip_prefix("## ")).collect();
    assert_eq!(
        sections,
        ["Quick start", "Try it", "Make it yours", "Configuration", "Where each technique lives", "Benchmarks"],
        "what a user needs first, in that order; internals live under docs/"
    );
    let lines = readme.lines().count();
    assert!(lines <= 400, "the README is {lines} lines: move internals to docs/");
    for what in ["/dashboard", "make burst", "mcp-inspector --cli", "claude_desktop_config.json", "make install"] {
        let at = readme.find(what).unwrap_or_else(|| panic!("the README says {what}"));
        assert!(readme[..at].lines().count() < 120, "{what} is within a newcomer's first screens");
    }
    let linked: BTreeSet<String> =
        links(&readme).into_iter().map(|l| l.split('#').next().unwrap_or("").to_owned()).collect();
    for page in pages().into_iter().filter(|p| p.starts_with("docs")) {
        let page = page.to_string_lossy().into_owned();
        assert!(linked.contains(&page), "the README links {page}");
    }
}

/// Every leaf key of `value` under `prefix`, dotted (`server.listen`); an array of tables is one
/// key (`auth.keys`).
fn leaf_keys(prefix: &str, value: &serde_json::Value, out: &mut Vec<String>) {
    match value {
        serde_json::Value::Object(table) => {
            for (key, value) in table {
                let name = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
                leaf_keys(&name, value, out);
            }
        }
        _ => out.push(prefix.to_owned()),
    }
}

/// Whether the README's `pattern` (`limits.http.*`, `tools.*.fail`, `tenants.NAME.budget`)
/// names `key`: `*` and `NAME` stand for one segment, a final `*` for any rest.
fn names(pattern: &str, key: &str) -> bool {
    let (pattern, key): (Vec<&str>, Vec<&str>) = (pattern.split('.').collect(), key.split('.').collect());
    if pattern.last() == Some(&"*") && key.len() >= pattern.len() - 1 {
        let fixed = &pattern[..pattern.len() - 1];
        return fixed.iter().zip(&key).all(|(p, k)| p == k || *p == "*" || *p == "NAME");
    }
    pattern.len() == key.len() && pattern.iter().zip(&key).all(|(p, k)| p == k || *p == "*" || *p == "NAME")
}

#[test]
fn the_readmes_config_table_names_every_key_of_the_default_config() {
    let readme = read(&root().join("README.md"));
    // A row's first cell names one key or several: `tiers.admin` / `.default` / `.guest`, or
    // `upstream.cache_max_entries` / `upstream.cache_max_bytes`.
    let mut documented: Vec<String> = Vec::new();
    for cell in
        readme.lines().filter_map(|line| line.strip_prefix("| `")).map(|rest| rest.split(" |").next().unwrap_or(""))
    {
        let mut parts = cell.split('`').step_by(2).map(str::trim).filter(|p| !p.is_empty() && !p.contains(' '));
        let Some(first) = parts.next() else { continue };
        let section = first.rsplit_once('.').map_or("", |(section, _)| section);
        documented.push(first.to_owned());
        documented.extend(parts.map(|p| p.strip_prefix('.').map_or(p.to_owned(), |last| format!("{section}.{last}"))));
    }
    let text = read(&root().join("config.toml"));
    let defaults: serde_json::Value = config::Config::builder()
        .add_source(config::File::from_str(&text, config::FileFormat::Toml))
        .build()
        .and_then(config::Config::try_deserialize)
        .expect("config.toml parses");
    let mut keys = Vec::new();
    leaf_keys("", &defaults, &mut keys);
    assert!(keys.len() > 60, "config.toml's keys were read: {keys:?}");
    let missing: Vec<&String> = keys.iter().filter(|key| !documented.iter().any(|p| names(p, key))).collect();
    assert!(missing.is_empty(), "keys of config.toml the README's config table does not name: {missing:?}");
}

/// The shell block after the README's `<!-- walked: tests/repo/readme.rs -->` marker.
fn walked_block(readme: &str) -> &str {
    let marker = "<!-- walked: tests/repo/readme.rs -->";
    let rest = &readme[readme.find(marker).expect("the README marks its walk-through") + marker.len()..];
    let code = rest.trim_start().strip_prefix("```sh\n").expect("a sh block follows the marker");
    code.split_once("\n```\n").expect("the block closes").0
}

/// What the block's comments promise, in order: for each loop, the call that is refused and its
/// code (`… the 5th is refused loop_detected …`), and the label its output lines carry (the
/// `echo "search $n: …"` of the loop after the comment).
fn promises(block: &str) -> Vec<(String, usize, String)> {
    let mut found = Vec::new();
    let mut promised: Option<(usize, String)> = None;
    for line in block.lines().map(str::trim) {
        if let Some(comment) = line.strip_prefix('#') {
            let words: Vec<&str> = comment.split_whitespace().collect();
            for at in words.windows(5) {
                let nth = at[1].trim_end_matches(|c: char| c.is_ascii_alphabetic());
                if at[0] == "the" && at[2] == "is" && at[3] == "refused" && nth.parse::<usize>().is_ok() {
                    let code: String = at[4].chars().take_while(|c| c.is_ascii_lowercase() || *c == '_').collect();
                    promised = nth.parse().ok().map(|n| (n, code));
                }
            }
        } else if let (Some((n, code)), Some((_, echoed))) = (promised.take(), line.split_once("echo \"")) {
            let label = echoed.split(" $n:").next().expect("a label before $n");
            found.push((label.to_owned(), n, code));
        }
    }
    found
}

/// README "Try it": the loop's refusal and the budget's, reached with the default config by the
/// steps as written (the block run by bash, its URL the test server's, on the server's manual
/// clock: no token comes back meanwhile), each at the call the README says, and not one call
/// sooner.
#[tokio::test]
async fn the_readmes_walk_through_meets_each_refusal_it_promises_at_the_call_it_says() {
    let readme = read(&root().join("README.md"));
    let block = walked_block(&readme);
    let promised = promises(block);
    let codes: Vec<&str> = promised.iter().map(|(_, _, code)| code.as_str()).collect();
    assert_eq!(codes, ["loop_detected", "rate_limited"], "the walk promises the loop's refusal and the budget's");
    let server = crate::common::TestServer::start("").await;
    assert_eq!(block.matches("http://127.0.0.1:3000/mcp").count(), 1, "the walk names make run's URL once");
    let script = block.replace("http://127.0.0.1:3000/mcp", &server.url);
    let out = tokio::process::Command::new("bash").arg("-c").arg(&script).output().await.expect("bash runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "the walk failed: {stdout}{}", String::from_utf8_lossy(&out.stderr));
    for (label, n, code) in &promised {
        let said: Vec<&str> = stdout.lines().filter_map(|l| l.strip_prefix(&format!("{label} "))).collect();
        let expected: Vec<String> =
            (1..=*n).map(|k| if k < *n { format!("{k}: answered") } else { format!("{k}: refused {code}") }).collect();
        assert_eq!(said, expected, "the README's {label}s:\n{stdout}");
    }
}
