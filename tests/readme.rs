//! The README shows the examples' code as it is: each block after an
//! `<!-- include: PATH -->` marker must be that file, byte for byte.

#[test]
fn the_readme_shows_the_examples_as_they_are() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let mut checked = Vec::new();
    for (at, _) in readme.match_indices("<!-- include: ") {
        let rest = &readme[at + "<!-- include: ".len()..];
        let path = rest.split(" -->").next().expect("marker closes");
        let block = rest.split_once("```rust\n").map(|(_, code)| code).expect("a rust block follows the marker");
        // The fence that closes the block starts a line; the file's own doc fences start `//!`.
        let (block, _) = block.split_once("\n```\n").expect("the block closes");
        let file = std::fs::read_to_string(root.join(path)).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert!(format!("{block}\n") == file, "README's copy of {path} differs from the file: paste the file again");
        checked.push(path.to_owned());
    }
    assert_eq!(checked, ["examples/rmcp_server.rs", "examples/axum_only.rs"]);
}
