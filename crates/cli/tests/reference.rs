//! docs/reference/cli.md is what the binary says about its command line.

use std::path::Path;
use std::process::Command;

const REGENERATE: &str = "cargo run -q -p gpusnap -- man --markdown > docs/reference/cli.md";

#[test]
fn the_cli_reference_is_up_to_date() {
    let out = Command::new(env!("CARGO_BIN_EXE_gpusnap")).args(["man", "--markdown"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let generated = String::from_utf8(out.stdout).unwrap();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/reference/cli.md");
    let committed = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}; generate it: {REGENERATE}", path.display()));
    if committed != generated {
        let (n, (c, g)) = committed
            .lines()
            .chain(std::iter::repeat("<end of file>"))
            .zip(generated.lines().chain(std::iter::repeat("<end of output>")))
            .enumerate()
            .find(|(_, (c, g))| c != g)
            .unwrap_or((0, ("", "")));
        panic!(
            "docs/reference/cli.md differs from what gpusnap generates; regenerate it: {REGENERATE}\n\
             first difference, line {}:\n  committed: {c}\n  generated: {g}",
            n + 1
        );
    }
}
