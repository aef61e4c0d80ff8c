//! The reference docs list what the code has: every `GPUSNAP_*` variable,
//! every error kind, every agent metric and every `agent.toml` key. A name
//! added to the code without its line in docs/reference/ fails here.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let p = entry.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// The `GPUSNAP_*` words in `text`; a word ending in `_` is a prefix, not a name.
fn gpusnap_vars(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("GPUSNAP_") {
        let tail = &rest[i..];
        let len = tail
            .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        let word = &tail[..len];
        if !word.ends_with('_') {
            out.push(word.to_string());
        }
        rest = &tail[len..];
    }
    out
}

/// The names between quotes in `text` after each `after`.
fn quoted_after(text: &str, after: &str) -> Vec<String> {
    text.match_indices(after)
        .filter_map(|(i, _)| {
            let s = &text[i + after.len()..];
            let s = s.trim_start().strip_prefix('"')?;
            Some(s[..s.find('"')?].to_string())
        })
        .collect()
}

fn missing(names: impl IntoIterator<Item = String>, doc: &str, form: impl Fn(&str) -> String) -> Vec<String> {
    let mut v: Vec<String> = names.into_iter().filter(|n| !doc.contains(&form(n))).collect();
    v.sort();
    v.dedup();
    v
}

#[test]
fn every_environment_variable_is_in_the_reference() {
    let mut files = Vec::new();
    rust_files(&root().join("crates"), &mut files);
    let vars = files.iter().flat_map(|f| gpusnap_vars(&std::fs::read_to_string(f).unwrap()));
    let doc = read("docs/reference/environment.md");
    let m = missing(vars, &doc, |n| format!("`{n}`"));
    assert!(m.is_empty(), "not in docs/reference/environment.md: {m:?}");
}

#[test]
fn every_error_kind_is_in_the_reference() {
    let mut kinds = Vec::new();
    for f in ["crates/core/src/error.rs", "crates/images/src/error.rs", "crates/hibernate/src/error.rs"] {
        let src = read(f);
        let body = &src[src.find("fn kind(").unwrap_or_else(|| panic!("{f}: no fn kind"))..];
        kinds.extend(quoted_after(body, "=>"));
    }
    assert!(kinds.len() > 30, "{kinds:?}");
    let doc = read("docs/reference/exit-codes.md");
    let m = missing(kinds, &doc, |k| format!("| `{k}` |"));
    assert!(m.is_empty(), "not in docs/reference/exit-codes.md: {m:?}");
}

#[test]
fn every_agent_metric_is_in_the_reference() {
    let text = gpusnap_agent::metrics::Metrics::new().encode();
    let names: Vec<String> =
        text.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.split(' ').next().map(String::from)).collect();
    assert!(names.len() >= 12, "{text}");
    let doc = read("docs/reference/metrics.md");
    let m = missing(names, &doc, |n| format!("| `{n}` |"));
    assert!(m.is_empty(), "not in docs/reference/metrics.md: {m:?}");
}

#[test]
fn every_agent_toml_key_is_in_the_reference() {
    let src = read("crates/agent/src/config/mod.rs");
    let code = &src[..src.find("#[cfg(test)]").unwrap_or(src.len())];
    let keys: Vec<String> = code
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("pub ")?.split_once(':').map(|(k, _)| k.to_string()))
        .filter(|k| k.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
        .filter(|k| k != "agent" && k != "service")
        .collect();
    assert!(keys.len() > 20, "{keys:?}");
    let doc = read("docs/reference/config.md");
    let m = missing(keys, &doc, |k| format!("| `{k}` |"));
    assert!(m.is_empty(), "not in docs/reference/config.md: {m:?}");
}

/// ARCHITECTURE.md's code map names every crate, and no source file grows
/// past what one reading holds (800 lines, tests included).
#[test]
fn architecture_names_every_crate_and_files_stay_small() {
    let arch = read("ARCHITECTURE.md");
    let mut unnamed = Vec::new();
    let mut long = Vec::new();
    let mut crates: Vec<PathBuf> =
        std::fs::read_dir(root().join("crates")).unwrap().flatten().map(|e| e.path()).collect();
    crates.sort();
    for dir in crates.iter().filter(|p| p.is_dir()) {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        if !arch.contains(&format!("crates/{name}")) {
            unnamed.push(name);
        }
        let mut files = Vec::new();
        let src = dir.join("src");
        if src.is_dir() {
            rust_files(&src, &mut files);
        }
        for f in files {
            let text = std::fs::read_to_string(&f).unwrap();
            if text.lines().count() > 800 {
                long.push(f.strip_prefix(root()).unwrap_or(&f).display().to_string());
            }
        }
    }
    assert!(unnamed.is_empty(), "crates not named in ARCHITECTURE.md: {unnamed:?}");
    assert!(long.is_empty(), "over 800 lines: split by what each part does: {long:?}");
}
