//! The layering a newcomer can see from `ls crates/`, checked. Cargo keeps the crates apart
//! (the core cannot name rmcp: it does not depend on it); these tests keep the dependency lists
//! from growing back (`cargo tree` of the kernel shows neither the guard nor its config, of the
//! Redis store no crate but the kernel's, of the core no MCP, HTTP or Redis crate, of the rmcp
//! integration none of the server's), no two top-level modules of one crate import each other,
//! nothing above the stores names a backend, and no source file is over 800 lines. Read from the source and from `cargo tree`, so a
//! change that breaks it fails here, naming the file and the line or the crate.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every crate of the workspace, by its source directory.
const CRATES: [&str; 5] = ["src", "crates/kernel/src", "crates/core/src", "crates/redis/src", "crates/rmcp/src"];

/// What each library crate must not depend on, even indirectly.
const FORBIDDEN: [(&str, &[&str]); 4] = [
    // The clock, the algorithms and the store traits: nothing of the guard, its config or metrics.
    (
        "mcp-ratelimit-kernel",
        &["mcp-ratelimit-core", "rmcp", "axum", "hyper", "reqwest", "redis", "tower", "config", "metrics", "evalexpr"],
    ),
    // The Redis store depends on the kernel alone.
    ("mcp-ratelimit-redis", &["mcp-ratelimit-core", "rmcp", "axum", "hyper", "reqwest", "tower", "config", "metrics"]),
    ("mcp-ratelimit-core", &["rmcp", "axum", "hyper", "reqwest", "redis", "tower", "plotters", "notify", "clap"]),
    ("mcp-ratelimit-rmcp", &["plotters", "notify", "clap", "reqwest"]),
];

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

/// The top-level module a file belongs to (`crates/core/src/guard/scope.rs` → `guard`).
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

fn graph(dir: &str) -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files {
        let Some(module) = module_of(&src, &file) else { continue };
        let text = std::fs::read_to_string(&file).expect("source is readable");
        edges.entry(module.clone()).or_default();
        for (_, target, _) in imports(&text) {
            if target != module {
                edges.entry(module.clone()).or_default().insert(target);
            }
        }
    }
    edges
}

#[test]
fn the_library_crates_depend_on_nothing_above_them() {
    let root = env!("CARGO_MANIFEST_DIR");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    for (package, forbidden) in FORBIDDEN {
        let output = std::process::Command::new(&cargo)
            .current_dir(root)
            .args(["tree", "--offline", "-p", package, "-e", "normal", "--prefix", "none", "--format", "{p}"])
            .output()
            .expect("cargo runs");
        assert!(output.status.success(), "cargo tree -p {package}: {}", String::from_utf8_lossy(&output.stderr));
        let tree = String::from_utf8_lossy(&output.stdout);
        let names: BTreeSet<&str> = tree.lines().filter_map(|line| line.split_whitespace().next()).collect();
        assert!(names.len() > 10, "cargo tree -p {package} listed too little to trust: {tree}");
        let found: Vec<&&str> = forbidden.iter().filter(|name| names.contains(**name)).collect();
        assert!(found.is_empty(), "{package} depends on {found:?} (cargo tree -p {package} -i NAME says through what)");
    }
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
    for dir in CRATES {
        let edges = graph(dir);
        assert!(edges.len() >= 3, "{dir}: too few modules found to trust");
        if let Some(cycle) = find_cycle(&edges) {
            panic!("import cycle between top-level modules of {dir}: {}", cycle.join(" → "));
        }
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
/// roots that pick a backend, `rate_limits`, `config` and `app`, are the exceptions.)
#[test]
fn the_guard_and_the_upstream_name_no_concrete_store() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for layer in [
        "crates/core/src/guard",
        "crates/rmcp/src/http",
        "src/upstream",
        "src/mcp",
        "src/http",
        "src/admin",
        "src/dashboard",
    ] {
        rust_files(&root.join(layer), &mut files);
    }
    files.extend(["crates/rmcp/src/limited.rs", "crates/rmcp/src/results.rs"].map(|f| root.join(f)));
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

#[test]
fn no_library_crate_names_the_reference_servers_tools() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("src/mcp/tools/methods.rs")).expect("readable");
    // The reference server's tools, as its `#[tool]` methods name them.
    let tools: Vec<&str> =
        text.split("#[tool(").skip(1).filter_map(|after| after.split("async fn ").nth(1)?.split('(').next()).collect();
    assert!(tools.len() >= 7 && tools.contains(&"rate_limit_status"), "the tools were read: {tools:?}");
    let mut found = Vec::new();
    for library in ["crates/kernel/src", "crates/core/src", "crates/redis/src", "crates/rmcp/src"] {
        let mut files = Vec::new();
        rust_files(&root.join(library), &mut files);
        for file in &files {
            let text = std::fs::read_to_string(file).expect("readable");
            // A file's unit tests, after its `#[cfg(test)]` or in a `tests.rs` module of their own
            // (declared under one), may name any tool.
            let unit_tests = file.file_name().is_some_and(|name| name == "tests.rs");
            let code = if unit_tests { "" } else { text.split("#[cfg(test)]").next().unwrap_or_default() };
            for (number, line) in code.lines().enumerate() {
                let line = line.trim_start();
                if line.starts_with("//") {
                    continue;
                }
                for tool in tools.iter().filter(|tool| line.contains(**tool)) {
                    found.push(format!("{}:{}: {tool}: {line}", file.display(), number + 1));
                }
            }
        }
    }
    assert!(found.is_empty(), "a library crate names a tool of the reference server's:\n{}", found.join("\n"));
}

/// The most lines a source file of a crate may have: one idea a reader holds in their head. (A
/// function's limit, 80 lines, is clippy's `too_many_lines`, set in `clippy.toml`.)
const MOST_LINES: usize = 800;

#[test]
fn no_source_file_is_over_800_lines() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut over = Vec::new();
    for krate in CRATES {
        let mut files = Vec::new();
        rust_files(&root.join(krate), &mut files);
        assert!(files.len() > 3, "{krate}'s files were read");
        for file in files {
            let lines = std::fs::read_to_string(&file).expect("readable").lines().count();
            if lines > MOST_LINES {
                over.push(format!("{}: {lines} lines", file.strip_prefix(root).unwrap_or(&file).display()));
            }
        }
    }
    assert!(over.is_empty(), "split these into modules of at most {MOST_LINES} lines:\n{}", over.join("\n"));
}
