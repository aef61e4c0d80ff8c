//! The guard: dying fake CUDA processes are suspended before they die, and
//! die exactly as they would have unguarded.

mod common;

use common::*;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;
/// Runs the workload under `gpusnap run`, returns (its exit status, the
/// workload's pid).
fn guarded(w: &mut World, status: &str, extra: &[&str]) -> (ExitStatus, i32) {
    let st = status_file(w, status);
    let st_s = st.to_str().unwrap().to_string();
    let wl = fake_workload_bin();
    let mut args = vec!["run", "--no-keeper", "--", wl.to_str().unwrap(), "--mib", "1024", "--status", &st_s];
    args.extend_from_slice(extra);
    let idx = w.spawn_gpusnap(&args);
    let pid = pid_in(&st);
    (w.wait_child(idx), pid)
}

/// Starts the fake workload (512 MiB, status file `st`) under `gpusnap run`
/// and waits for it; returns the `run` child's index and the workload's pid.
fn run_guarded(w: &mut World, st: &PathBuf, keeper: bool, extra: &[&str]) -> (usize, i32) {
    let wl = fake_workload_bin();
    let mut args = vec!["run"];
    if !keeper {
        args.push("--no-keeper");
    }
    args.extend(["--", wl.to_str().unwrap(), "--mib", "512", "--status", st.to_str().unwrap()]);
    args.extend_from_slice(extra);
    let idx = w.spawn_gpusnap(&args);
    (idx, pid_in(st))
}
#[test]
fn deaths_are_suspended_and_keep_their_status() {
    let mut w = World::new(&[16_384]);
    for (name, die, extra) in [
        ("segv", "segv", Vec::<&str>::new()),
        ("abort", "abort", vec![]),
        ("exit", "exit:5", vec![]),
        ("exit-thread", "exit-thread:7", vec![]),
        ("_exit", "_exit:9", vec![]),
    ] {
        let mut args = vec!["--die", die, "--after-ms", "300"];
        args.extend(extra.iter().copied());
        let natural = unguarded(&w, &args);
        let (st, pid) = guarded(&mut w, name, &args);
        assert_eq!(
            (st.code(), st.signal()),
            (natural.code(), natural.signal()),
            "{name}: guarded {st:?} vs {natural:?}"
        );
        assert_suspended_before_death(&w, pid);
        assert!(!pid_exists(pid));
    }
}

#[test]
fn sigterm_with_and_without_a_handler() {
    let mut w = World::new(&[16_384]);
    // No handler: the default action kills; suspended first.
    let st = status_file(&w, "t1");
    let (idx, pid) = run_guarded(&mut w, &st, false, &[]);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM).unwrap();
    let s = w.wait_child(idx);
    assert_eq!(s.signal(), Some(libc::SIGTERM), "{s:?}");
    assert_suspended_before_death(&w, pid);

    // A handler that exits(4): the signal passes untouched, the exit is caught.
    let st = status_file(&w, "t2");
    let (idx, pid) = run_guarded(&mut w, &st, false, &["--sigterm-exit", "4"]);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM).unwrap();
    let s = w.wait_child(idx);
    assert_eq!(s.code(), Some(4), "{s:?}");
    assert_suspended_before_death(&w, pid);
    let h = w.json(&["history", &pid.to_string()]).json();
    let notes: Vec<String> = h["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["detail"].as_str().map(str::to_string))
        .collect();
    assert!(notes.iter().any(|d| d.contains("exit_group")), "{notes:?}");
}

#[test]
fn children_are_guarded_too() {
    let mut w = World::new(&[16_384]);
    let (st, pid) = guarded(&mut w, "kids", &["--child", "--die", "exit:6", "--after-ms", "800"]);
    assert_eq!(st.code(), Some(6));
    let kid = pid_in(&status_file(&w, "kids.child"));
    assert_ne!(kid, pid);
    assert_suspended_before_death(&w, pid);
    assert_suspended_before_death(&w, kid);
}

#[test]
fn other_signals_pass_through_and_a_living_program_is_untouched() {
    let mut w = World::new(&[16_384]);
    let st = status_file(&w, "live");
    let (idx, pid) = run_guarded(&mut w, &st, false, &[]);
    for sig in [
        nix::sys::signal::Signal::SIGWINCH,
        nix::sys::signal::Signal::SIGCHLD,
        nix::sys::signal::Signal::SIGURG,
    ] {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig).unwrap();
    }
    assert_progressing_at(&st);
    assert!(w.calls_on(pid).is_empty(), "nothing was suspended: {:?}", w.calls_on(pid));
    // It is an ordinary CUDA process for the other commands.
    assert_eq!(w.json(&["suspend", &pid.to_string()]).code, 0);
    assert_eq!(w.json(&["resume", &pid.to_string()]).code, 0);
    assert_progressing_at(&st);
    std::fs::write(format!("{}.exit", st.display()), b"").unwrap();
    assert_eq!(w.wait_child(idx).code(), Some(3));
}

#[test]
fn a_killed_guard_leaves_the_program_running_and_its_keeper_takes_over() {
    let mut w = World::new(&[16_384]);
    let st = status_file(&w, "k");
    let (idx, pid) = run_guarded(&mut w, &st, true, &[]);
    let guard = w.child_pid(idx);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(guard), nix::sys::signal::Signal::SIGKILL).unwrap();
    w.wait_child(idx);
    // The program goes on.
    assert_progressing_at(&st);
    // The keeper started a new guard that traces it.
    wait_for(Duration::from_secs(10), || {
        std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|s| {
            s.lines().any(|l| l.starts_with("TracerPid:") && l.split_whitespace().nth(1) != Some("0"))
        })
    });
    // And it can still exit normally; the exit is caught again.
    std::fs::write(format!("{}.exit", st.display()), b"").unwrap();
    wait_for(Duration::from_secs(20), || !pid_exists(pid));
    assert_suspended_before_death(&w, pid);
}

#[test]
fn without_its_guard_or_keeper_the_program_still_runs() {
    let mut w = World::new(&[16_384]);
    let st = status_file(&w, "nk");
    let (idx, pid) = run_guarded(&mut w, &st, false, &[]);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(w.child_pid(idx)), nix::sys::signal::Signal::SIGKILL)
        .unwrap();
    w.wait_child(idx);
    assert_progressing_at(&st);
    // A restarted guard re-attaches.
    let r = w.gpusnap(&["guard", "--daemon", &pid.to_string()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGABRT).unwrap();
    wait_for(Duration::from_secs(20), || !pid_exists(pid));
    assert_suspended_before_death(&w, pid);
}

#[test]
fn guard_refuses_bad_pids() {
    let w = World::new(&[8192]);
    let r = w.gpusnap(&["guard", "999999999"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("no process"), "{}", r.stderr);
    let r = w.gpusnap(&["run", "--", "/nonexistent/program"]);
    assert_eq!(r.code, 127, "{}", r.stderr);
}

#[test]
fn hibernate_detaches_the_guard_and_wake_attaches_one() {
    let mut w = World::new(&[16_384]);
    let st = status_file(&w, "hw");
    let (idx, pid) = run_guarded(&mut w, &st, false, &[]);
    let p = pid.to_string();
    assert_eq!(tracer(pid), w.child_pid(idx));
    // CRIU must be the only tracer while it dumps: the guard lets go.
    let r = w.json(&["hibernate", &p, "--image", "guarded"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    // `run` ends as the guard let go of its program.
    assert_eq!(w.wait_child(idx).code(), Some(0));
    wait_for(Duration::from_secs(10), || !pid_exists(pid));
    let r = w.json(&["wake", "guarded", "--wait", "10"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    assert_progressing_at(&st);
    // A guard is attached to the woken process, and its exits (the filter
    // came back with it) are caught again.
    wait_for(Duration::from_secs(10), || tracer(pid) != 0);
    let before = w.calls_on(pid).len();
    std::fs::write(format!("{}.exit", st.display()), b"").unwrap();
    wait_for(Duration::from_secs(20), || !pid_exists(pid));
    let calls = w.calls_on(pid)[before..].to_vec();
    assert!(calls.windows(2).any(|c| c[0] == "lock=0" && c[1] == "checkpoint=0"), "{calls:?}");
}

#[test]
fn the_oom_watch_suspends_while_host_memory_can_still_take_it() {
    // Traced, and light (`run --light --oom-watch`).
    for mode in ["--no-keeper", "--light"] {
        let Some(cg) = Cgroup::new(256 << 20) else {
            gpusnap_testkit::skip("no memory cgroup can be created here");
            return;
        };
        let w = World::new(&[16_384]);
        let st = status_file(&w, "oom");
        let wl = fake_workload_bin();
        // The program joins the cgroup (256 MiB) before it starts: its 2 GiB
        // of device memory would not fit in what is left of it.
        let script = format!("echo $$ > {}/cgroup.procs && exec \"$@\"", cg.0.display());
        let mut cmd = std::process::Command::new("sh");
        w.env(&mut cmd);
        cmd.args(["-c", &script, "sh", env!("CARGO_BIN_EXE_gpusnap"), "run", mode, "--oom-watch", "--"])
            .arg(&wl)
            .args(["--mib", "2048", "--status"])
            .arg(&st)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let mut run = cmd.spawn().unwrap();
        let pid = pid_in(&st);
        // Suspended while alive, journaled as the watch's doing.
        wait_for(Duration::from_secs(20), || {
            w.json(&["state", &pid.to_string()]).json()["state"] == "checkpointed"
        });
        assert!(pid_exists(pid), "{mode}");
        assert!(w.calls_on(pid).windows(2).any(|c| c[0] == "lock=0" && c[1] == "checkpoint=0"), "{mode}");
        let h = w.json(&["history", &pid.to_string()]).json();
        assert!(
            h["events"]
                .as_array()
                .unwrap()
                .iter()
                .any(|e| e["detail"].as_str().is_some_and(|d| d.contains("memory cgroup"))),
            "{mode}: {h}"
        );
        // It is safe to end now.
        assert_eq!(w.json(&["stop", &pid.to_string(), "--grace", "1"]).code, 0, "{mode}");
        let _ = run.wait();
    }
}
