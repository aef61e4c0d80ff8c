//! What the tests of this workspace share beside the fakes: a test that
//! cannot run on this machine (a missing tool, no root, no systemd) says so
//! through [`skip`], which
//! - prints `skipped: WHY` on the test's stderr,
//! - records the test's name and reason in the directory that
//!   `GPUSNAP_TEST_SKIPS` names (set by `scripts/test.sh`, whose summary
//!   counts these tests as skipped, by name, never as passed),
//! - and under `CI=true` fails the test unless it is named, with its
//!   reason, in `.config/ci-skips.txt`: CI installs everything the suite
//!   needs, so a skip there is a bug unless that list says why the test
//!   cannot run on CI's machine.
//!
//! The caller returns right after: `if !ready { return skip("why"); }`.

use std::fmt::Display;
use std::path::{Path, PathBuf};

/// The list of tests allowed to skip under `CI=true`, relative to the
/// workspace's root: `BINARY_ID TEST_NAME<TAB>why it cannot run on CI`.
pub const CI_SKIPS: &str = ".config/ci-skips.txt";

/// The environment variable naming the directory where skips are recorded.
pub const SKIPS_DIR_ENV: &str = "GPUSNAP_TEST_SKIPS";

/// Whether this runs under CI (`CI=true`).
pub fn in_ci() -> bool {
    std::env::var("CI").as_deref() == Ok("true")
}

/// This test's name as nextest reports it (`BINARY_ID TEST_NAME`), or the
/// test thread's name under `cargo test`.
pub fn test_id() -> String {
    match (std::env::var("NEXTEST_BINARY_ID"), std::env::var("NEXTEST_TEST_NAME")) {
        (Ok(bin), Ok(name)) => format!("{bin} {name}"),
        _ => std::thread::current().name().unwrap_or("unnamed").to_string(),
    }
}

/// The workspace's root (two levels above this crate).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Marks this test as skipped because of `why` (see the crate's doc): the
/// caller returns right after. Under `CI=true` it panics unless
/// `.config/ci-skips.txt` names the test.
pub fn skip(why: impl Display) {
    let id = test_id();
    let why = why.to_string().replace(['\n', '\t'], " ");
    eprintln!("skipped: {why}");
    if let Some(dir) = std::env::var_os(SKIPS_DIR_ENV) {
        let file: String = id.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
        // A test that cannot record its skip still skips; the summary then
        // counts it as passed, which the record exists to prevent: say so.
        if let Err(e) = std::fs::write(Path::new(&dir).join(file), format!("{id}\t{why}\n")) {
            eprintln!("testkit: could not record the skip of {id} in {}: {e}", Path::new(&dir).display());
        }
    }
    if in_ci() {
        let list = std::fs::read_to_string(workspace_root().join(CI_SKIPS)).unwrap_or_default();
        if allowed(&list, &id).is_none() {
            panic!("{id} skipped under CI=true ({why}), and {CI_SKIPS} does not say why CI may skip it");
        }
    }
}

/// The reason `list` gives for letting `id` skip on CI, if it names it.
fn allowed<'a>(list: &'a str, id: &str) -> Option<&'a str> {
    list.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .filter_map(|l| l.split_once('\t'))
        .find(|(name, _)| name.trim() == id)
        .map(|(_, why)| why.trim())
        .filter(|why| !why.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ci_list_names_a_test_with_its_reason() {
        let list = "# comment\ngpusnap::agent_limits a_test\tno systemd on CI\nx y\t\n";
        assert_eq!(allowed(list, "gpusnap::agent_limits a_test"), Some("no systemd on CI"));
        assert_eq!(allowed(list, "x y"), None, "a name without a reason is not allowed");
        assert_eq!(allowed(list, "gpusnap::agent_limits"), None);
    }

    #[test]
    fn every_entry_of_the_ci_list_has_a_reason() {
        let list = std::fs::read_to_string(workspace_root().join(CI_SKIPS)).unwrap();
        for l in list.lines().filter(|l| !l.trim().is_empty() && !l.starts_with('#')) {
            let (name, why) = l.split_once('\t').unwrap_or((l, ""));
            assert!(
                name.contains(' ') && !why.trim().is_empty(),
                "{CI_SKIPS}: `{l}` needs BINARY_ID TEST_NAME<TAB>REASON"
            );
        }
    }
}
