//! docs/ARCHITECTURE.md's map of the tree names every module of the core, the daemon, the
//! client and the CLI, so that a newcomer finds each file there.
//!
//! A module is a `.rs` file under `src/`, `server/src/`, `client/src/` or `cli/src/`, except
//! files of unit tests (`tests.rs`, `tests_*.rs`, `*_tests.rs`). The map is the fenced block under
//! "## A map of the tree"; each crate's part of it starts with an unindented line naming the
//! crate's source directory, and holds entries: a line indented by two, with the lines indented
//! further below it. A file is named, within its crate's part, by its path relative to the source
//! directory (`pool/recover.rs`); a file in a subdirectory also by its file name in an entry that
//! names its directory (`pool/` with `recover.rs`); a directory's `mod.rs` by the directory alone.
#![cfg(not(loom))]

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

/// The source directories the map covers, as the map's unindented lines name them.
const CRATES: [&str; 4] = ["src/", "server/src/", "client/src/", "cli/src/"];

#[test]
fn the_architecture_map_names_every_module() {
    let root = repo_root();
    let doc = fs::read_to_string(root.join("docs/ARCHITECTURE.md")).expect("docs/ARCHITECTURE.md");
    let map = map_block(&doc);
    let mut missing = Vec::new();
    for krate in CRATES {
        let entries = entries_of(&map, krate);
        assert!(!entries.is_empty(), "the map has no part for `{krate}`");
        for module in modules(&root.join(krate)) {
            if !is_named(&module, &entries) {
                missing.push(format!("{krate}{module}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "docs/ARCHITECTURE.md's map of the tree does not name these modules; add each to its \
         crate's part of the map (by its path, or by its file name in the entry of its \
         directory):\n  {}",
        missing.join("\n  ")
    );
}

#[test]
fn a_module_is_named_by_its_path_or_in_its_directorys_entry() {
    let map = "```\nsrc/    core\n  lib.rs a.rs   one\n  pool/   index\n          \
               keys.rs: keys\n  other.rs   mentions tail.rs\nserver/src/   daemon\n  \
               b.rs\n```\n";
    let entries = entries_of(map, "src/");
    for named in ["lib.rs", "a.rs", "pool/mod.rs", "pool/keys.rs", "other.rs"] {
        assert!(is_named(named, &entries), "{named}");
    }
    for unnamed in ["b.rs", "pool/tail.rs", "alloc/keys.rs", "alloc/mod.rs"] {
        assert!(!is_named(unnamed, &entries), "{unnamed}");
    }
    assert!(!is_test_file("index.rs"));
    for test in ["tests.rs", "tests_cancel.rs", "model_tests.rs"] {
        assert!(is_test_file(test), "{test}");
    }
}

/// The workspace root: this package's manifest lives in `tests/`.
fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_path_buf()
}

/// The fenced block that follows the map's heading.
fn map_block(doc: &str) -> String {
    let after = doc
        .split_once("## A map of the tree")
        .expect("docs/ARCHITECTURE.md has a \"## A map of the tree\" section")
        .1;
    let start = after.find("```").expect("the map's fenced block") + 3;
    let body = &after[start..];
    let end = body.find("```").expect("the end of the map's fenced block");
    body[..end].to_string()
}

/// The entries of one crate's part of the map, each as the set of its words.
fn entries_of(map: &str, krate: &str) -> Vec<BTreeSet<String>> {
    let mut entries: Vec<BTreeSet<String>> = Vec::new();
    let mut inside = false;
    for line in map.lines() {
        let indent = line.len() - line.trim_start().len();
        if line.trim().is_empty() {
            continue;
        }
        if indent == 0 {
            inside = line.split_whitespace().next() == Some(krate);
            continue;
        }
        if !inside {
            continue;
        }
        if indent <= 2 || entries.is_empty() {
            entries.push(BTreeSet::new());
        }
        let entry = entries.last_mut().expect("an entry was just pushed");
        entry.extend(words(line));
    }
    entries
}

/// The words of a line, without the punctuation and backquotes around them.
fn words(line: &str) -> impl Iterator<Item = String> + '_ {
    line.split_whitespace()
        .map(|w| w.trim_matches(|c: char| ",;:()`'\"".contains(c)))
        .filter(|w| !w.is_empty())
        .map(str::to_string)
}

/// Whether the map names a module, given as its path relative to its crate's source directory.
fn is_named(module: &str, entries: &[BTreeSet<String>]) -> bool {
    if entries.iter().any(|e| e.contains(module)) {
        return true;
    }
    let Some((dir, file)) = module.rsplit_once('/') else {
        return false;
    };
    let dir = format!("{dir}/");
    entries
        .iter()
        .any(|e| e.contains(&dir) && (file == "mod.rs" || e.contains(file)))
}

/// Every module under a source directory, as paths relative to it, sorted.
fn modules(dir: &Path) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                todo.push(path);
                continue;
            }
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if !name.ends_with(".rs") || is_test_file(name) {
                continue;
            }
            let rel = path.strip_prefix(dir).expect("under the source directory");
            found.insert(rel.to_string_lossy().replace('\\', "/"));
        }
    }
    found
}

/// Whether a file name is that of a file of unit tests.
fn is_test_file(name: &str) -> bool {
    name == "tests.rs" || name.starts_with("tests_") || name.ends_with("_tests.rs")
}
