//! The drop-in `cuda-checkpoint`: NVIDIA's flags and output formats, as CRIU's
//! CUDA plugin and gVisor parse them, with gpusnap's refusals.

mod common;

use common::*;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Runs `cuda-checkpoint ARGS` through a link of that name.
fn cc(w: &World, args: &[&str]) -> (i32, String, String) {
    let link = w.tmp.path().join("bin/cuda-checkpoint");
    if !link.exists() {
        std::fs::create_dir_all(link.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_gpusnap"), &link).unwrap();
    }
    let mut cmd = Command::new(&link);
    w.env(&mut cmd);
    let out = cmd.args(args).stdin(Stdio::null()).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_criu_plugin_sequence_and_its_output_formats() {
    let mut w = World::new(&[8192]);
    let pid = w.workload(2048, 0, &[]);
    let p = pid.to_string();
    assert_eq!(cc(&w, &["--get-state", "--pid", &p]), (0, "running\n".into(), String::new()));
    assert_eq!(cc(&w, &["--get-restore-tid", "--pid", &p]), (0, format!("{pid}\n"), String::new()));
    assert_eq!(
        cc(&w, &["--action", "lock", "--pid", &p, "--timeout", "5000"]),
        (0, String::new(), String::new())
    );
    assert_eq!(cc(&w, &["--get-state", "--pid", &p]).1, "locked\n");
    assert_eq!(cc(&w, &["--action", "checkpoint", "--pid", &p]), (0, String::new(), String::new()));
    assert_eq!(cc(&w, &["--get-state", "--pid", &p]).1, "checkpointed\n");
    assert_eq!(cc(&w, &["--action", "restore", "--pid", &p]), (0, String::new(), String::new()));
    assert_eq!(cc(&w, &["--action", "unlock", "--pid", &p]), (0, String::new(), String::new()));
    assert_eq!(cc(&w, &["--get-state", "--pid", &p]).1, "running\n");
    w.assert_progressing(pid);
    // gpusnap's own commands see the same process and its journal.
    assert_eq!(w.json(&["state", &p]).json()["state"], "running");
    assert_eq!(w.calls_on(pid), ["get_restore_tid=0", "lock=0", "checkpoint=0", "restore=0", "unlock=0"]);
    // --toggle, both ways; the subcommand form too.
    assert_eq!(cc(&w, &["--toggle", "--pid", &p]).0, 0);
    assert_eq!(cc(&w, &["--get-state", "--pid", &p]).1, "checkpointed\n");
    let r = w.gpusnap(&["cuda-checkpoint", "--toggle", "--pid", &p]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(cc(&w, &["--get-state", "--pid", &p]).1, "running\n");
    w.assert_progressing(pid);
}

#[test]
fn a_restore_without_memory_is_refused_not_stranded() {
    let mut w = World::new(&[8192]);
    let pid = w.workload(4096, 0, &[]);
    let p = pid.to_string();
    assert_eq!(cc(&w, &["--action", "lock", "--pid", &p]).0, 0);
    assert_eq!(cc(&w, &["--action", "checkpoint", "--pid", &p]).0, 0);
    let filler = w.workload(6000, 0, &[]);
    let (code, out, err) = cc(&w, &["--action", "restore", "--pid", &p]);
    assert_eq!(code, 1);
    assert!(out.is_empty());
    assert!(err.contains("not enough GPU memory"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(!w.calls_on(pid).iter().any(|c| c.starts_with("restore")), "the driver was not asked");
    w.kill(filler);
    assert_eq!(cc(&w, &["--toggle", "--pid", &p]).0, 0);
    w.assert_progressing(pid);
}

#[test]
fn thread_ids_stopped_processes_and_nonsense() {
    let mut w = World::new(&[8192]);
    let pid = w.workload(512, 0, &["--threads", "2"]);
    let p = pid.to_string();
    let tid: i32 = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .find(|t| *t != pid)
        .unwrap();
    let (code, _, err) = cc(&w, &["--action", "lock", "--pid", &tid.to_string()]);
    assert_eq!(code, 1);
    assert!(err.contains(&format!("{tid} is a thread of {pid}")), "{err}");

    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGSTOP).unwrap();
    wait_for(Duration::from_secs(5), || {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.contains(") T "))
    });
    let t0 = Instant::now();
    let (code, _, err) = cc(&w, &["--get-state", "--pid", &p]);
    assert_eq!(code, 1);
    assert!(err.contains("is stopped"), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGCONT).unwrap();

    assert_eq!(cc(&w, &["--get-state", "--pid", "999999999"]).0, 1);
    assert_eq!(cc(&w, &["--action", "explode", "--pid", &p]).0, 1);
    assert_eq!(cc(&w, &["--get-state"]).0, 1);
    let (code, out, _) = cc(&w, &["--help"]);
    assert_eq!(code, 0);
    assert!(out.contains("--action") && out.contains("--get-restore-tid"));
    let mut sleep = Command::new("sleep").arg("20").spawn().unwrap();
    let (code, _, err) = cc(&w, &["--get-restore-tid", "--pid", &sleep.id().to_string()]);
    assert_eq!(code, 1, "a process without CUDA has no restore thread");
    assert!(err.contains("no CUDA context"), "{err}");
    let _ = sleep.kill();
    let _ = sleep.wait();
}
