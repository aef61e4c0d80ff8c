//! Nonsense in, one clear line and a distinct exit code out, nothing changed.

mod common;

use common::*;
use std::time::{Duration, Instant};

#[test]
fn a_thread_id_names_its_process() {
    let mut w = World::new(&[8192]);
    let pid = w.workload(512, 0, &["--threads", "2"]);
    let tid: i32 = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .find(|t| *t != pid)
        .expect("a second thread");
    for cmd in ["state", "suspend", "resume", "stop"] {
        let r = w.json(&[cmd, &tid.to_string()]);
        assert_eq!(r.code, 2, "{cmd}: {}", r.stderr);
        assert!(r.stderr.contains(&format!("{tid} is a thread of {pid}")), "{}", r.stderr);
        assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
    }
    // Named beside its process, it is the group's bad member, and nothing is said of the others.
    let r = w.json(&["state", &pid.to_string(), &tid.to_string()]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr.contains(&format!("member {tid} of the group: {tid} is a thread of {pid}")),
        "{}",
        r.stderr
    );
    assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
    assert_eq!(r.json()["error"]["kind"], "thread_id");
    assert_eq!(w.json(&["state", &pid.to_string()]).json()["state"], "running");
}

#[test]
fn dead_and_invalid_pids() {
    let w = World::new(&[8192]);
    let r = w.json(&["suspend", "999999999"]);
    assert_eq!(r.code, 2);
    assert!(r.stderr.contains("no process 999999999"), "{}", r.stderr);
    let r = w.gpusnap(&["state", "0"]);
    assert_eq!(r.code, 2);
    let r = w.gpusnap(&["state", "999999999", "999999998"]);
    assert_eq!(r.code, 2);
    assert_eq!(r.stderr.trim(), "gpusnap: member 999999999 of the group: no process 999999999");
    assert!(r.stdout.is_empty(), "{}", r.stdout);
    let r = w.gpusnap(&["state"]);
    assert_eq!(r.code, 2, "a pid or a group is required");
    let r = w.gpusnap(&["state", "abc"]);
    assert_eq!(r.code, 2, "clap usage errors are exit 2");
    let r = w.gpusnap(&["resume"]);
    assert_eq!(r.code, 2);
}

#[test]
fn a_process_without_cuda_is_named_as_such() {
    let w = World::new(&[8192]);
    let mut sleep = std::process::Command::new("sleep").arg("30").spawn().unwrap();
    let p = sleep.id().to_string();
    for cmd in ["state", "suspend", "resume"] {
        let r = w.json(&[cmd, &p]);
        assert_eq!(r.code, 2, "{cmd}: {}", r.stderr);
        assert!(r.stderr.contains("has no CUDA context"), "{}", r.stderr);
    }
    // stop works on any process: no CUDA state, so nothing to suspend.
    let r = w.json(&["stop", &p, "--grace", "2"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()["results"][0]["cuda"], false);
    let _ = sleep.wait();
}

#[test]
fn a_stopped_process_is_refused_without_hanging() {
    let mut w = World::new(&[8192]);
    let pid = w.workload(512, 0, &[]);
    let p = pid.to_string();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGSTOP).unwrap();
    wait_for(Duration::from_secs(5), || {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| s.contains(") T "))
    });
    let t0 = Instant::now();
    for cmd in ["state", "suspend", "resume"] {
        let r = w.json(&[cmd, &p]);
        assert_eq!(r.code, 2, "{cmd}: {}", r.stderr);
        assert!(r.stderr.contains("is stopped"), "{}", r.stderr);
    }
    let r = w.json(&["stop", &p]);
    assert_eq!(r.code, 1);
    assert_eq!(r.json()["error"]["kind"], "stop_refused");
    assert!(t0.elapsed() < Duration::from_secs(10));
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGCONT).unwrap();
    w.assert_progressing(pid);
}

#[test]
fn a_reused_pid_is_refused() {
    let mut w = World::new(&[8192]);
    let pid = w.workload(512, 0, &[]);
    let p = pid.to_string();
    assert_eq!(w.json(&["suspend", &p]).code, 0);
    // Make the record belong to an earlier process under the same pid, as if
    // the suspended one had died and the pid been handed to a new program.
    let db = rusqlite::Connection::open(w.state_dir().join("gpusnap.db")).unwrap();
    db.execute("UPDATE processes SET start_time = start_time - 1 WHERE pid = ?1", [pid]).unwrap();
    db.execute("UPDATE footprints SET start_time = start_time - 1 WHERE pid = ?1", [pid]).unwrap();
    let r = w.json(&["resume", &p]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert_eq!(r.json()["error"]["kind"], "pid_reused");
    assert!(r.stderr.contains("now belongs to another program"), "{}", r.stderr);
    w.kill(pid);
}

#[test]
fn no_driver_is_a_clear_error() {
    let w = World::new(&[8192]);
    let mut cmd = w.gpusnap_cmd(&["ps"]);
    cmd.env("LD_LIBRARY_PATH", "/nonexistent");
    let out = cmd.output().unwrap();
    // On a host with a real driver installed this would find it; CI has none.
    if std::path::Path::new("/usr/lib/x86_64-linux-gnu/libcuda.so.1").exists() {
        return;
    }
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot load libcuda.so.1"), "{err}");
    assert!(err.contains("r570"), "{err}");
}

#[test]
fn resume_without_a_record_needs_a_footprint() {
    let mut w = World::new(&[8192]);
    let pid = w.workload(512, 0, &[]);
    let p = pid.to_string();
    assert_eq!(w.json(&["suspend", &p]).code, 0);
    std::fs::remove_dir_all(w.state_dir()).unwrap();
    let r = w.json(&["resume", &p]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("--footprint"), "{}", r.stderr);
    let r = w.json(&["resume", &p, "--footprint", "600"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.assert_progressing(pid);
    let r = w.json(&["stop", &p, "--grace", "2"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
}

#[test]
fn piped_output_has_no_progress_bar() {
    let mut w = World::with_config(&[8192], serde_json::json!({ "checkpoint_gbps": 2.0 }));
    let pid = w.workload(2048, 0, &[]);
    let r = w.gpusnap(&["suspend", &pid.to_string()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.starts_with(&format!("suspended {pid}: 2.0 GiB")), "{}", r.stdout);
    assert!(r.stderr.is_empty(), "{:?}", r.stderr);
    w.kill(pid);
}

/// On a host without the driver, bad targets are still bad input (exit 2,
/// the same line as with a driver): they are checked before the driver is
/// loaded, which only live targets need.
#[test]
fn targets_are_checked_before_the_driver_is_loaded() {
    let w = World::new(&[8192]);
    let mut sleep = std::process::Command::new("sleep").arg("30").spawn().unwrap();
    let live = sleep.id().to_string();
    // A thread of this test process, alive while the cases run.
    let (tx, rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let th = std::thread::spawn(move || {
        tx.send(nix::unistd::gettid().as_raw()).unwrap();
        let _ = done_rx.recv();
    });
    let tid = rx.recv().unwrap().to_string();
    let thread_of = format!("{tid} is a thread of {}", std::process::id());
    let member_thread = format!("member {tid} of the group: {thread_of}");
    let cases: &[(&[&str], &str)] = &[
        (&["state", &tid], &thread_of),
        (&["resume", &tid], &thread_of),
        (&["stop", &tid], &thread_of),
        (&["suspend", "999999999"], "no process 999999999"),
        (&["resume", "999999999"], "no process 999999999"),
        (&["resume", "999999999", "--footprint", "100"], "no process 999999999"),
        (&["state", "0"], "0 is not a valid process id"),
        (&["state", "999999999"], "no process 999999999"),
        (&["suspend", "--tree", "999999999"], "no process 999999999"),
        (&["resume", "--tree", "999999999"], "no process 999999999"),
        (&["stop", "999999999"], "no process 999999999"),
        (&["stop", "--tree", "999999999"], "no process 999999999"),
        (&["suspend", &live, "999999999"], "member 999999999 of the group: no process 999999999"),
        (&["state", &live, "999999999"], "member 999999999 of the group: no process 999999999"),
        (&["state", &live, &tid], &member_thread),
        (&["state", "--tree", "999999999"], "no process 999999999"),
        (&["state", "--cgroup", "/nonexistent/cgroup"], "/nonexistent/cgroup is not a cgroup"),
        (&["suspend", "--cgroup", "/nonexistent/cgroup"], "/nonexistent/cgroup is not a cgroup"),
        (&["stop", "--cgroup", "/nonexistent/cgroup"], "/nonexistent/cgroup is not a cgroup"),
        (&["hibernate", "--cgroup", "/nonexistent/cgroup"], "/nonexistent/cgroup is not a cgroup"),
        (&["hibernate", "999999999"], "no process 999999999"),
        (&["hibernate", "999999999", "--map"], "no process 999999999"),
        (&["snapshot", "999999999"], "no process 999999999"),
        (&["recover", "999999999"], "no process 999999999"),
    ];
    for (args, want) in cases {
        let with = w.json(args);
        let mut cmd = w.gpusnap_cmd(&[&["--json"], *args].concat());
        // No fake driver or NVML here (a GPU host's real driver is in the
        // system's library path and would still be found: then this only
        // repeats the first half).
        cmd.env("LD_LIBRARY_PATH", "/nonexistent").env("GPUSNAP_CRIU", "/nonexistent/criu");
        let out = cmd.output().unwrap();
        let without = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(with.code, 2, "{args:?} with the driver: {}", with.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?} without the driver: {without}");
        assert!(with.stderr.contains(want), "{args:?}: {}", with.stderr);
        assert_eq!(without.lines().next(), with.stderr.lines().next(), "{args:?}");
        assert_eq!(without.lines().count(), 1, "{args:?}: {without}");
    }
    // A live process still needs the driver (suspend), or not (stop of a
    // process without CUDA).
    let mut cmd = w.gpusnap_cmd(&["suspend", &live]);
    cmd.env("LD_LIBRARY_PATH", "/nonexistent");
    let out = cmd.output().unwrap();
    if !std::path::Path::new("/usr/lib/x86_64-linux-gnu/libcuda.so.1").exists() {
        assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stderr).contains("cannot load libcuda.so.1"));
    }
    let _ = sleep.kill();
    let _ = sleep.wait();
    let _ = done_tx.send(());
    th.join().unwrap();
}

#[test]
fn the_guard_and_fast_swap_options_refuse_nonsense() {
    let w = World::new(&[8192]);
    // A guard with a fault policy, for a pid that does not exist.
    let r = w.gpusnap(&["guard", "--on-fault", "hold", "999999999"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("no process 999999999"), "{}", r.stderr);
    assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
    // Options that need others, and a policy that does not exist.
    for args in [
        &["run", "--fast-swap", "--", "true"][..],
        &["run", "--light", "--keep-pinned", "--", "true"][..],
        &["run", "--light", "--on-fault", "sometimes", "--", "true"][..],
    ] {
        let r = w.gpusnap(args);
        assert_eq!(r.code, 2, "{args:?}: {}", r.stderr);
    }
}
