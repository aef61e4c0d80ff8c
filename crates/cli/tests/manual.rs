//! `gpusnap man` and `gpusnap completions`: the manual pages and completion
//! scripts the binary generates, checked with the tools that read them.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Output};

fn gpusnap(args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_gpusnap")).args(args).output().expect("run gpusnap");
    assert!(out.status.success(), "gpusnap {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    out
}

fn text(out: &Output) -> String {
    String::from_utf8(out.stdout.clone()).expect("UTF-8")
}

/// Every command, as its words after `gpusnap` ("images push"), read from
/// the binary's own `--help` (its "Commands:" lists), not from the pages.
fn commands(prefix: &[&str]) -> Vec<Vec<String>> {
    let mut args: Vec<&str> = prefix.to_vec();
    args.push("--help");
    let help = text(&gpusnap(&args));
    let mut out = Vec::new();
    let mut listing = false;
    for line in help.lines() {
        if line == "Commands:" {
            listing = true;
            continue;
        }
        if listing {
            // "  suspend  Take processes' GPU state..."; a blank line ends it.
            let Some(name) = line.strip_prefix("  ").and_then(|l| l.split_whitespace().next()) else {
                break;
            };
            if line.starts_with("   ") || name == "help" {
                continue;
            }
            let mut words: Vec<String> = prefix.iter().map(|s| s.to_string()).collect();
            words.push(name.to_string());
            let w: Vec<&str> = words.iter().map(String::as_str).collect();
            out.extend(commands(&w));
            out.push(words);
        }
    }
    out
}

#[test]
fn every_command_has_a_page() {
    let dir = tempfile::tempdir().unwrap();
    let man = dir.path().join("man1");
    gpusnap(&["man", "--dir", man.to_str().unwrap()]);
    let got: BTreeSet<String> =
        std::fs::read_dir(&man).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    let mut want: BTreeSet<String> =
        commands(&[]).iter().map(|w| format!("gpusnap-{}.1", w.join("-"))).collect();
    want.insert("gpusnap.1".into());
    for name in ["gpusnap-suspend.1", "gpusnap-state.1", "gpusnap-images-push.1", "gpusnap-completions.1"] {
        assert!(want.contains(name), "{name} not among the commands: {want:?}");
    }
    assert_eq!(got, want);
}

/// A page as `man` shows it, or None where man cannot be run here.
fn rendered(page: &Path) -> Option<(String, String)> {
    let out = Command::new("man")
        .arg("-l")
        .arg(page)
        .env("MANPAGER", "cat")
        .env("MANWIDTH", "100")
        .env("MAN_KEEP_FORMATTING", "")
        .output()
        .ok()?;
    // A minimized system's man is a stub that says so and fails.
    if !out.status.success() {
        return None;
    }
    Some((
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

#[test]
fn the_pages_render() {
    let dir = tempfile::tempdir().unwrap();
    gpusnap(&["man", "--dir", dir.path().to_str().unwrap()]);
    for (page, title, says) in [
        ("gpusnap.1", "gpusnap", "Exit status"),
        ("gpusnap-suspend.1", "gpusnap-suspend", "--lock-timeout"),
        ("gpusnap-state.1", "gpusnap-state", "--cgroup"),
        ("gpusnap-images-push.1", "gpusnap-images-push", "s3://BUCKET/PREFIX"),
    ] {
        let path = dir.path().join(page);
        let roff = std::fs::read_to_string(&path).unwrap();
        assert!(roff.contains(&format!(".TH {title} 1 ")), "{page}: {}", &roff[..roff.len().min(300)]);
        assert!(roff.contains(".SH NAME") && roff.contains(".SH SYNOPSIS"), "{page}");
        match rendered(&path) {
            Some((shown, warnings)) => {
                assert!(shown.contains("NAME") && shown.contains("SYNOPSIS"), "{page}: {shown}");
                assert!(shown.contains(says), "{page} lacks {says:?}: {shown}");
                assert!(warnings.is_empty(), "{page}: {warnings}");
            }
            None => eprintln!("man cannot run here: checked the roff of {page} only"),
        }
    }
}

#[test]
fn man_without_a_directory_prints_the_top_page() {
    let roff = text(&gpusnap(&["man"]));
    assert!(roff.contains(".TH gpusnap 1 "), "{}", &roff[..roff.len().min(300)]);
    for sub in ["gpusnap\\-suspend(1)", "gpusnap\\-images(1)", "gpusnap\\-completions(1)"] {
        assert!(roff.contains(sub), "no {sub} in gpusnap(1)");
    }
}

#[test]
fn a_directory_that_cannot_be_made_is_one_line_and_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, "").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_gpusnap"))
        .args(["man", "--dir"])
        .arg(file.join("man1"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("gpusnap: cannot create "), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
}

#[test]
fn bash_completion_parses_and_completes_commands() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("gpusnap.bash");
    std::fs::write(&script, gpusnap(&["completions", "bash"]).stdout).unwrap();
    let check = Command::new("bash").arg("-n").arg(&script).output().unwrap();
    assert!(check.status.success(), "bash -n: {}", String::from_utf8_lossy(&check.stderr));
    // Sourced, as bash-completion does, and asked as bash asks on TAB.
    let probe = r#"
source "$1"
comp() {
    COMP_WORDS=("$@"); COMP_CWORD=$(( $# - 1 )); COMP_LINE="$*"; COMP_POINT=${#COMP_LINE}; COMPREPLY=()
    _gpusnap gpusnap "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"
    echo "${COMPREPLY[*]}"
}
comp gpusnap su
comp gpusnap images p
comp gpusnap state --a
comp gpusnap completions ""
"#;
    let out = Command::new("bash").args(["-c", probe, "probe"]).arg(&script).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<String> = String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect();
    assert_eq!(lines[0], "suspend");
    assert_eq!(lines[1], "push pull");
    assert_eq!(lines[2], "--all");
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        assert!(lines[3].split(' ').any(|w| w == shell), "{shell} not offered: {}", lines[3]);
    }
}

#[test]
fn every_shell_gets_a_script() {
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let script = text(&gpusnap(&["completions", shell]));
        assert!(script.contains("gpusnap"), "{shell}");
        assert!(script.contains("suspend") && script.contains("lock-timeout"), "{shell}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_gpusnap")).args(["completions", "tcsh"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "an unknown shell is a usage error");
}
