//! The layering a newcomer can see from `ls src/`, checked: the limiting core knows nothing of
//! MCP, of our tools or of the server around it, and no two top-level modules import each other
//! (directly or round a longer cycle). Read from the source, so a new `use` that breaks it fails
//! here, naming the file and the line.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The core: what any rmcp server needs to limit its tools, and nothing else.
const CORE: [&str; 10] =
    ["activity", "breaker", "clock", "config", "guard", "identity", "limit", "metrics", "redact", "store"];

/// Crates that are MCP itself; the core must not name them.
const MCP_CRATES: [&str; 2] = ["rmcp", "rmcp_macros"];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("src is readable") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file belongs to (`src/guard/scope.rs` → `guard`).
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let relative = file.strip_prefix(src).ok()?;
    let first = relative.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (name != "lib" && name != "main").then(|| name.to_owned())
}

/// Every `crate::NAME` a line of code (not a comment) mentions, with the line.
fn imports(text: &str) -> Vec<(usize, String, String)> {
    let mut found = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let code = line.trim_start();
        if code.starts_with("//") {
            continue;
        }
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            let after = &rest[at + "crate::".len()..];
            let name: String = after.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            if !name.is_empty() {
                found.push((number + 1, name, line.trim().to_owned()));
            }
            rest = after;
        }
    }
    found
}

fn graph() -> (BTreeMap<String, BTreeSet<String>>, Vec<String>) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut problems = Vec::new();
    for file in files {
        let Some(module) = module_of(&src, &file) else { continue };
        let text = std::fs::read_to_string(&file).expect("source is readable");
        edges.entry(module.clone()).or_default();
        for (line, target, code) in imports(&text) {
            if target != module {
                if CORE.contains(&module.as_str()) && !CORE.contains(&target.as_str()) {
                    problems.push(format!("{}:{line}: core `{module}` imports `{target}`: {code}", file.display()));
                }
                edges.entry(module.clone()).or_default().insert(target);
            }
        }
        if CORE.contains(&module.as_str()) {
            for (number, line) in text.lines().enumerate() {
                let code = line.trim_start();
                if !code.starts_with("//") && MCP_CRATES.iter().any(|c| code.contains(&format!("{c}::"))) {
                    problems.push(format!(
                        "{}:{}: core `{module}` uses MCP: {}",
                        file.display(),
                        number + 1,
                        line.trim()
                    ));
                }
            }
        }
    }
    (edges, problems)
}

#[test]
fn the_core_imports_nothing_of_mcp_tools_or_the_server() {
    let (edges, problems) = graph();
    for core in CORE {
        assert!(edges.contains_key(core), "no module `{core}` in src/: update CORE");
    }
    assert!(problems.is_empty(), "the core reaches above itself:\n{}", problems.join("\n"));
}

/// A cycle in `edges`, as the path round it, if there is one (depth-first search for a back edge).
fn find_cycle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in edges.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, edges, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    edges.keys().find_map(|node| visit(node, edges, &mut Vec::new(), &mut done))
}

#[test]
fn no_two_modules_import_each_other() {
    let (edges, _) = graph();
    if let Some(cycle) = find_cycle(&edges) {
        panic!("import cycle between top-level modules: {}", cycle.join(" → "));
    }
}

#[test]
fn the_checks_see_an_upward_import_and_a_cycle() {
    // A comment is not an import; code is.
    let text = "//! see [`crate::mcp`]\nuse crate::mcp::tools;\n    let x = crate::app::App::start;\n";
    let found: Vec<String> = imports(text).into_iter().map(|(_, name, _)| name).collect();
    assert_eq!(found, ["mcp", "app"]);
    // app → http → state → app is found; app → http → state is not a cycle.
    let edge = |from: &str, to: &str| (from.to_owned(), BTreeSet::from([to.to_owned()]));
    let mut edges = BTreeMap::from([edge("app", "http"), edge("http", "state"), edge("state", "app")]);
    assert_eq!(find_cycle(&edges).map(|c| c.len()), Some(4));
    edges.insert("state".to_owned(), BTreeSet::new());
    assert_eq!(find_cycle(&edges), None);
}

/// The layers above the stores talk to the `Store`, `LoopHistory` and `JobMirror` traits, never to
/// a backend: a third backend implements the traits and nothing above changes. (The composition
/// roots that pick a backend, `rate_limits` and `app`, are the exceptions.)
#[test]
fn the_guard_and_the_upstream_name_no_concrete_store() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    for layer in ["guard", "upstream", "mcp", "http", "admin", "dashboard"] {
        rust_files(&src.join(layer), &mut files);
    }
    let mut found = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).expect("readable");
        for (number, line) in text.lines().enumerate() {
            let code = line.trim_start();
            if code.starts_with("//") {
                continue;
            }
            for backend in ["MemoryStore", "RedisStore"] {
                if code.contains(backend) {
                    found.push(format!("{}:{}: {}", file.display(), number + 1, line.trim()));
                }
            }
        }
    }
    assert!(found.is_empty(), "a layer above the stores names a backend:\n{}", found.join("\n"));
}
