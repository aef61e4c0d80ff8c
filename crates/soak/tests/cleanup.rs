//! The soak ends everything it started whichever way it ends: asked to stop
//! (SIGTERM, as a test runner's timeout does), its worker dying (SIGKILL, as
//! a panic or the OOM killer ends it), or past its own hard deadline.

mod common;

use common::build;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

/// Starts a soak that would run for minutes; its stderr, line by line.
fn start(bin: &Path, extra: &[&str]) -> (Child, Receiver<String>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpusnap-soak"))
        .args(["--seed", "3", "--cycles", "1000", "--max-secs", "600", "--services", "2", "--clients", "1"])
        .args(["--faults", "crash-unguarded,nvml-late"])
        .args(extra)
        .env("GPUSNAP_BIN", bin)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start gpusnap-soak");
    let err = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            eprintln!("{line}");
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    (child, rx)
}

/// Waits (bounded) for a line holding `what`; every line read on the way
/// is passed to `seen`.
fn wait_line(rx: &Receiver<String>, what: &str, mut seen: impl FnMut(&str)) {
    let end = Instant::now() + Duration::from_secs(300);
    loop {
        match rx.recv_timeout(Duration::from_secs(1)) {
            Ok(l) => {
                seen(&l);
                if l.contains(what) {
                    return;
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => panic!("the soak ended before printing {what:?}"),
        }
        assert!(Instant::now() < end, "the soak printed no {what:?} within 300 s");
    }
}

/// Every process whose environment names the scratch directory (whatever
/// the soak started inherits it, trees CRIU restored included).
fn processes_of(scratch: &Path) -> Vec<(i32, String)> {
    let needle = scratch.to_string_lossy().into_owned().into_bytes();
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        let Ok(env) = std::fs::read(e.path().join("environ")) else { continue };
        if env.windows(needle.len()).any(|w| w == needle.as_slice()) {
            let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
            out.push((pid, comm.trim().to_string()));
        }
    }
    out
}

fn wait_exit(child: &mut Child) -> i32 {
    let end = Instant::now() + Duration::from_secs(180);
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st.code().unwrap_or(-1);
        }
        assert!(Instant::now() < end, "the soak did not end within 180 s of being stopped");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_soak_stopped_any_way_leaves_no_process_and_no_scratch_directory() {
    let bin = build();
    for how in ["sigterm", "worker-killed", "hard-deadline"] {
        let extra: &[&str] = if how == "hard-deadline" { &["--hard-secs", "20"] } else { &[] };
        let (mut child, rx) = start(&bin, extra);
        let (mut scratch, mut worker) = (PathBuf::new(), 0);
        wait_line(&rx, "worker pid", |l| {
            if let Some((_, rest)) = l.split_once("scratch ") {
                let (dir, pid) = rest.split_once("; worker pid ").expect("scratch DIR; worker pid N");
                scratch = PathBuf::from(dir);
                worker = pid.trim().parse().unwrap();
            }
        });
        if how != "hard-deadline" {
            // The agent, its services and the command lane's program run.
            wait_line(&rx, "cycle 0:", |_| {});
            assert!(processes_of(&scratch).len() >= 3, "{how}: {:?}", processes_of(&scratch));
            let (pid, sig) = match how {
                "sigterm" => (child.id() as i32, libc::SIGTERM),
                _ => (worker, libc::SIGKILL),
            };
            // SAFETY: kill(2) on a pid this test started (or its worker).
            assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
        }
        let code = wait_exit(&mut child);
        assert_eq!(code, 2, "{how}: the soak's status");
        let left = processes_of(&scratch);
        assert!(left.is_empty(), "{how}: left running: {left:?}");
        assert!(!scratch.exists(), "{how}: {} was not removed", scratch.display());
    }
}
