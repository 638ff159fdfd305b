//! The library's layers, bottom up (ARCHITECTURE.md, "The modules, from the bottom up"):
//! a module may name only modules listed before it, so no import goes up a layer and none
//! forms a circle, and a reader can stop at any layer. "Name" is any `crate::<module>` in
//! a module's files, in code or in an intra-doc link (rustdoc resolves those as it
//! resolves imports); a doc comment that points up to a caller says so in plain text.
//! The binary (`main.rs`, `cli/`) is its own crate, on top of all of them.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The layers, bottom up, each with its modules in the order they may import each other.
/// A new module goes here, in the layer whose modules are the highest it imports.
const LAYERS: &[(&str, &[&str])] = &[
    ("base", &["error", "atomic_file", "machine"]),
    (
        "formats",
        &[
            "config",
            "checkpoint",
            "pack",
            "tokenizer",
            "chat_template",
            "image_processor",
        ],
    ),
    ("I/O", &["io"]),
    ("records contract", &["records"]),
    ("compute", &["backend"]),
    ("pool", &["pool", "plan"]),
    ("expert sources", &["experts"]),
    ("model", &["context", "routing_model", "ngram", "model"]),
    (
        "generation",
        &[
            "sampling",
            "constraint",
            "generate",
            "prompt_cache",
            "chat",
            "score",
            "reply",
        ],
    ),
    ("library API", &["engine"]),
    ("edges", &["server", "tools"]),
];

/// Crates the formats layer does without: reading a checkpoint or a pack needs neither a
/// runtime nor a GPU.
const NOT_IN_FORMATS: &[&str] = &["tokio::", "wgpu::"];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The library's top-level module a file under src/ belongs to (`model` for src/model/mod.rs
/// and src/model/snapshot.rs); `None` for the crate roots and the binary's files.
fn module_of(rel: &Path) -> Option<String> {
    let first = rel.components().next()?.as_os_str().to_str()?;
    let module = first.strip_suffix(".rs").unwrap_or(first);
    (!matches!(module, "lib" | "main" | "cli")).then(|| module.to_string())
}

/// The modules `text` names as `crate::<module>`, with their 1-based line numbers.
fn named_modules(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let mut rest = line;
        while let Some(at) = rest.find("crate::") {
            let before = rest[..at].chars().next_back();
            let after = &rest[at + "crate::".len()..];
            let name: String = after
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') && !name.is_empty() {
                out.push((n + 1, name));
            }
            rest = after;
        }
    }
    out
}

#[test]
fn no_module_names_a_higher_layer() {
    let rank: HashMap<&str, (usize, &str)> = LAYERS
        .iter()
        .flat_map(|(layer, modules)| modules.iter().map(move |m| (*m, *layer)))
        .enumerate()
        .map(|(i, (m, layer))| (m, (i, layer)))
        .collect();
    assert_eq!(
        rank.len(),
        LAYERS.iter().map(|(_, m)| m.len()).sum::<usize>(),
        "a module is listed twice in LAYERS"
    );

    // Every module lib.rs declares has a place, and every place a module.
    let lib = std::fs::read_to_string(src().join("lib.rs")).unwrap();
    let mut declared: Vec<&str> = lib
        .lines()
        .filter_map(|l| l.strip_prefix("pub mod ")?.strip_suffix(';'))
        .collect();
    let mut listed: Vec<&str> = rank.keys().copied().collect();
    declared.sort_unstable();
    listed.sort_unstable();
    assert_eq!(declared, listed, "lib.rs's modules and LAYERS differ");
    // What lib.rs re-exports (`pub use error::{Error, Result};`) counts as its module.
    let reexports: HashMap<&str, &str> = lib
        .lines()
        .filter_map(|l| {
            l.strip_prefix("pub use ")?
                .strip_suffix(';')?
                .split_once("::")
        })
        .flat_map(|(module, items)| {
            items
                .trim_matches(|c| c == '{' || c == '}')
                .split(',')
                .map(move |item| (item.trim(), module))
        })
        .collect();

    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    files.sort();
    let mut wrong = Vec::new();
    for path in &files {
        let rel = path.strip_prefix(src()).unwrap();
        let Some(module) = module_of(rel) else {
            continue;
        };
        let (own, layer) = rank[module.as_str()];
        let text = std::fs::read_to_string(path).unwrap();
        for (line, named) in named_modules(&text) {
            let named = reexports.get(named.as_str()).map_or(named.as_str(), |m| *m);
            match rank.get(named) {
                Some(&(other, other_layer)) if other > own => wrong.push(format!(
                    "src/{}:{line}: {module} ({layer}) names crate::{named} ({other_layer})",
                    rel.display()
                )),
                Some(_) => {}
                None => wrong.push(format!(
                    "src/{}:{line}: crate::{named} is not a module in LAYERS",
                    rel.display()
                )),
            }
        }
        if layer == "formats" {
            for (n, l) in text.lines().enumerate() {
                for name in NOT_IN_FORMATS.iter().filter(|c| l.contains(**c)) {
                    wrong.push(format!(
                        "src/{}:{}: {module} (formats) uses {name}",
                        rel.display(),
                        n + 1
                    ));
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports against the layers (tests/integration/layers.rs):\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_scan_finds_crate_paths() {
    let text = "use crate::pool::SlotPool;\n/// See [`crate::engine::Engine`] and $crate::backend.\nlet x = mycrate::io;";
    let found: Vec<_> = named_modules(text);
    assert_eq!(
        found,
        [
            (1, "pool".to_string()),
            (2, "engine".to_string()),
            (2, "backend".to_string())
        ]
    );
}
