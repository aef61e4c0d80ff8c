//! Which live process may take the record of a checkpointed one that is
//! gone (CRIU restored it outside gpusnap into a new pid namespace): only a
//! process of the container gpusnap recorded, only one, and only when a
//! command acts on it, never when one reads its state.

mod common;

use common::*;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

/// The host pid of the only child of `parent`.
fn child_of(parent: i32) -> Option<i32> {
    let s = std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children")).ok()?;
    s.split_whitespace().next()?.parse().ok()
}

/// Starts the fake workload (`--mib 1024 --status STATUS`, the same command
/// line every time) as pid 1 of a new pid namespace, with a new time
/// namespace when `new_time` (as CRIU restores a tree), in `container`.
/// Returns (unshare's pid, the workload's host pid).
fn start_in_namespace(w: &mut World, status: &Path, new_time: bool, container: &Container) -> (i32, i32) {
    let mut cmd = Command::new("unshare");
    w.env(&mut cmd);
    let _ = std::fs::remove_file(status);
    let n = w.tmp.path().read_dir().map(|d| d.count()).unwrap_or(0);
    let log = w.tmp.path().join(format!("workload-ns-{n}.log"));
    cmd.args(["--pid", "--fork"]);
    if new_time {
        cmd.arg("--time");
    }
    cmd.args(["sh", "-c", r#"exec setsid "$0" --mib 1024 --status "$1" 2>"$2""#])
        .arg(fake_workload_bin())
        .arg(status)
        .arg(&log)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let unshare = w.spawn_cmd(cmd);
    let mut pid = 0;
    wait_for(Duration::from_secs(30), || {
        pid = child_of(unshare).unwrap_or(0);
        pid > 0 && read_status(status).is_some()
    });
    container.enter(pid);
    w.adopt(pid);
    (unshare, pid)
}

/// A raw driver call on `pid`, as any tool of the process's owner can make,
/// once the program has its CUDA context.
fn driver_call(w: &World, action: &str, pid: i32) {
    wait_for(Duration::from_secs(30), || {
        let mut cmd = Command::new(fake_workload_bin());
        w.env(&mut cmd);
        let out = cmd.arg("--driver-call").args([action, &pid.to_string()]).output().unwrap();
        String::from_utf8_lossy(&out.stdout).contains("rc=0")
    });
}

fn end(w: &mut World, unshare: i32, pid: i32) {
    // SAFETY: kill(2) on a pid this test started.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    w.reap(unshare);
    wait_for(Duration::from_secs(30), || !pid_exists(pid));
}

fn adopted(w: &World, pid: i32) -> bool {
    w.json(&["history", &pid.to_string()]).stdout.contains("\"adopt\"")
}

/// A tenant's process suspended in its container, then gone (CRIU dumped
/// it): another container's process crafted to look like it (pid 1 of a pid
/// namespace of its own, the same executable and command line, a new time
/// namespace, locked by its owner) neither takes its record by being read
/// (`state`, `ps`) nor by being resumed. Two processes of the tenant's own
/// container that both fit are refused as ambiguous, journaled; the one
/// restored process then takes the record, footprint included.
#[test]
fn another_containers_process_does_not_take_a_checkpointed_record() {
    let mut w = World::new(&[8192]);
    let Some(victim_ct) = Container::new(0x71c7) else { return };
    let Some(other_ct) = Container::new(0xa77a) else { return };
    let status = w.tmp.path().join("status-ns");

    let (unshare, victim) = start_in_namespace(&mut w, &status, false, &victim_ct);
    let r = w.json(&["suspend", &victim.to_string()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    end(&mut w, unshare, victim);

    // The crafted process, in another container.
    let (_, attacker) = start_in_namespace(&mut w, &status, true, &other_ct);
    driver_call(&w, "lock", attacker);
    let a = attacker.to_string();
    let r = w.json(&["state", &a]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()["state"], "locked");
    let r = w.json(&["ps"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(!adopted(&w, attacker), "reading took the victim's record");
    let r = w.json(&["resume", &a]);
    assert_eq!(r.code, 0, "its own lock, undone: {}", r.stderr);
    assert_eq!(r.json()["results"][0]["footprint_bytes"], 0, "no recorded footprint: {}", r.stdout);
    assert!(!adopted(&w, attacker), "resuming took the victim's record");

    // Two processes of the victim's container fit: neither takes it.
    let (u1, one) = start_in_namespace(&mut w, &status, true, &victim_ct);
    driver_call(&w, "lock", one);
    let (u2, two) = start_in_namespace(&mut w, &status, true, &victim_ct);
    driver_call(&w, "lock", two);
    let r = w.json(&["resume", &one.to_string()]);
    assert_ne!(r.code, 0, "ambiguous: {}", r.stdout);
    assert!(r.stderr.contains("2 processes") || r.stderr.contains("2 live processes"), "{}", r.stderr);
    assert!(!adopted(&w, one) && !adopted(&w, two));
    let h = w.json(&["history", &one.to_string()]).stdout;
    assert!(h.contains("not adopted"), "the refusal is journaled: {h}");
    end(&mut w, u2, two);

    // The one restored process of the victim's container takes it.
    let r = w.json(&["resume", &one.to_string()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()["results"][0]["footprint_bytes"], 1024 * MIB, "the victim's record moved to it");
    assert!(adopted(&w, one));
    end(&mut w, u1, one);
}
