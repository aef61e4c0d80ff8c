//! `gpusnap run --light`: the preload library asks the guard to suspend a
//! dying fake CUDA process from inside it; nothing is traced, and every death
//! keeps its own status.

mod common;

use common::*;
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;
/// Starts the fake workload (512 MiB, status file `st`) under `gpusnap run
/// --light`; returns the `run` child's index and the workload's pid.
fn run_light(w: &mut World, st: &PathBuf, extra: &[&str]) -> (usize, i32) {
    let wl = fake_workload_bin();
    let mut args =
        vec!["run", "--light", "--", wl.to_str().unwrap(), "--mib", "512", "--status", st.to_str().unwrap()];
    args.extend_from_slice(extra);
    let idx = w.spawn_gpusnap(&args);
    (idx, pid_in(st))
}

#[test]
fn deaths_are_suspended_and_keep_their_status_without_tracing() {
    let mut w = World::new(&[16_384]);
    for (name, die) in [
        ("segv", "segv"),
        ("abort", "abort"),
        ("exit", "exit:5"),
        ("exit-thread", "exit-thread:7"),
        ("_exit", "_exit:9"),
    ] {
        let args = ["--die", die, "--after-ms", "400"];
        let natural = unguarded(&w, &args);
        let st = status_file(&w, name);
        let (idx, pid) = run_light(&mut w, &st, &args);
        assert_eq!(tracer(pid), 0, "{name}: light mode traces nothing");
        let s = w.wait_child(idx);
        assert_eq!(
            (s.code(), s.signal()),
            (natural.code(), natural.signal()),
            "{name}: {s:?} vs {natural:?}"
        );
        assert_suspended_before_death(&w, pid);
        assert!(
            history_notes(&w, pid).iter().any(|n| n.contains("(light)")),
            "{name}: {:?}",
            history_notes(&w, pid)
        );
        assert!(!pid_exists(pid));
    }
}

#[test]
fn sigterm_with_and_without_a_handler_and_harmless_signals() {
    let mut w = World::new(&[16_384]);
    let st = status_file(&w, "t1");
    let (idx, pid) = run_light(&mut w, &st, &[]);
    // Signals that do not kill, and a CUDA process that lives on: untouched.
    for sig in [nix::sys::signal::Signal::SIGWINCH, nix::sys::signal::Signal::SIGCHLD] {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig).unwrap();
    }
    assert_progressing_at(&st);
    assert!(w.calls_on(pid).is_empty(), "{:?}", w.calls_on(pid));
    // It is an ordinary CUDA process for the other commands.
    assert_eq!(w.json(&["suspend", &pid.to_string()]).code, 0);
    assert_eq!(w.json(&["resume", &pid.to_string()]).code, 0);
    assert_progressing_at(&st);
    // No handler: the default action kills; suspended first.
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM).unwrap();
    let s = w.wait_child(idx);
    assert_eq!(s.signal(), Some(libc::SIGTERM), "{s:?}");
    assert_suspended_before_death(&w, pid);

    // The program's own handler runs (its signal is no death); its exit is.
    let st = status_file(&w, "t2");
    let (idx, pid) = run_light(&mut w, &st, &["--sigterm-exit", "4"]);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM).unwrap();
    let s = w.wait_child(idx);
    assert_eq!(s.code(), Some(4), "{s:?}");
    assert_suspended_before_death(&w, pid);
    assert!(history_notes(&w, pid).iter().any(|n| n.contains("dying: exit")), "{:?}", history_notes(&w, pid));
}

#[test]
fn children_are_guarded_too() {
    let mut w = World::new(&[16_384]);
    let st = status_file(&w, "kids");
    let (idx, pid) = run_light(&mut w, &st, &["--child", "--die", "exit:6", "--after-ms", "800"]);
    let kid = pid_in(&status_file(&w, "kids.child"));
    assert_eq!(w.wait_child(idx).code(), Some(6));
    assert_ne!(kid, pid);
    wait_for(Duration::from_secs(20), || !pid_exists(kid));
    assert_suspended_before_death(&w, pid);
    assert_suspended_before_death(&w, kid);
}

#[test]
fn a_killed_guard_leaves_the_program_running_and_a_new_guard_serves_it() {
    let mut w = World::new(&[16_384]);
    let st = status_file(&w, "k");
    let (idx, pid) = run_light(&mut w, &st, &[]);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(w.child_pid(idx)), nix::sys::signal::Signal::SIGKILL)
        .unwrap();
    w.wait_child(idx);
    assert_progressing_at(&st);
    let guard_finding = |w: &World| -> String {
        let d = w.json(&["doctor", &pid.to_string()]).json();
        let f = d["findings"].as_array().unwrap().iter().find(|f| f["check"] == "guard").cloned();
        f.map(|f| f["severity"].as_str().unwrap_or("").to_string()).unwrap_or_default()
    };
    // doctor sees that no one answers for it now.
    assert_eq!(guard_finding(&w), "warn");
    // `gpusnap guard` sees a light program and serves its socket again,
    // without tracing it.
    let r = w.gpusnap(&["guard", "--daemon", &pid.to_string()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(tracer(pid), 0);
    assert_eq!(guard_finding(&w), "ok");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGABRT).unwrap();
    wait_for(Duration::from_secs(20), || !pid_exists(pid));
    assert_suspended_before_death(&w, pid);

    // Without any guard the program still exits normally, unsuspended.
    let st = status_file(&w, "k2");
    let (idx, pid) = run_light(&mut w, &st, &[]);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(w.child_pid(idx)), nix::sys::signal::Signal::SIGKILL)
        .unwrap();
    w.wait_child(idx);
    std::fs::write(format!("{}.exit", st.display()), b"").unwrap();
    wait_for(Duration::from_secs(20), || !pid_exists(pid));
    assert!(w.calls_on(pid).is_empty(), "{:?}", w.calls_on(pid));
}

#[test]
fn hibernate_lets_run_go_and_wake_serves_the_program_again() {
    criu_present();
    let mut w = World::new(&[16_384]);
    let st = status_file(&w, "hl");
    // The program's stderr is a file of its own: `run` writes to its own
    // after the dump, and CRIU refuses a file whose size changed.
    let wl = fake_workload_bin();
    let idx = w.spawn_gpusnap(&[
        "run",
        "--light",
        "--",
        "sh",
        "-c",
        "exec \"$0\" \"$@\" 2>/dev/null",
        wl.to_str().unwrap(),
        "--mib",
        "512",
        "--status",
        st.to_str().unwrap(),
    ]);
    let pid = pid_in(&st);
    let p = pid.to_string();
    let r = w.json(&["hibernate", &p, "--image", "light"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(w.wait_child(idx).code(), Some(0), "run ends as the program leaves it");
    wait_for(Duration::from_secs(10), || !pid_exists(pid));
    let r = w.json(&["wake", "light", "--wait", "10"]);
    if r.code != 0 {
        let log = r.stderr.split("log: ").nth(1).unwrap_or("").trim().trim_end_matches(')').to_string();
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let err: Vec<&str> = text.lines().filter(|l| l.contains("Error") || l.contains("fd=2")).collect();
        panic!("{}\n{}", r.stderr, err.join("\n"));
    }
    w.adopt(pid);
    assert_progressing_at(&st);
    // The guard wake started serves the program's socket; no tracer.
    wait_for(Duration::from_secs(10), || {
        history_notes(&w, pid).iter().filter(|n| n.contains("(light)")).count() >= 2
    });
    assert_eq!(tracer(pid), 0);
    std::fs::write(format!("{}.exit", st.display()), b"").unwrap();
    wait_for(Duration::from_secs(20), || !pid_exists(pid));
    let calls = w.calls_on(pid);
    // Suspended for the hibernate, restored by the wake, then suspended
    // again before its exit.
    assert!(calls.iter().filter(|c| *c == "checkpoint=0").count() >= 2, "{calls:?}");
    assert_eq!(calls.last().map(String::as_str), Some("checkpoint=0"), "{calls:?}");
}

#[test]
fn a_missing_preload_library_is_named() {
    let w = World::new(&[8192]);
    let r = w.gpusnap(&["run", "--light", "--preload", "/nonexistent/lib.so", "--", "true"]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(r.stderr.contains("/nonexistent/lib.so: no such preload library"), "{}", r.stderr);
    let r = w.gpusnap(&["run", "--light", "--", "/nonexistent/program"]);
    assert_eq!(r.code, 127, "{}", r.stderr);
}

/// A Python program sees its own signal dispositions under `--light`, and
/// its own fatal-signal handler (faulthandler) runs and dies as it would.
#[test]
fn a_python_program_sees_no_difference() {
    let w = World::new(&[8192]);
    let script = r#"
import ctypes, faulthandler, os, signal, sys
ctypes.CDLL("libcuda.so.1")  # the fake: the library now counts the process as CUDA
assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, signal.getsignal(signal.SIGTERM)
assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
old = signal.signal(signal.SIGUSR1, lambda s, f: None)
assert old == signal.SIG_DFL, old
os.kill(os.getpid(), signal.SIGUSR1)  # handled: no death
assert signal.signal(signal.SIGUSR1, signal.SIG_DFL) is not signal.SIG_DFL
assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
print("dispositions ok", flush=True)
faulthandler.enable()
ctypes.string_at(0)
"#;
    let run = |light: bool| {
        let mut cmd = if light {
            let mut c = w.gpusnap_cmd(&["run", "--light", "--", "python3", "-c", script]);
            c.stdout(Stdio::piped()).stderr(Stdio::piped());
            c
        } else {
            let mut c = Command::new("python3");
            w.env(&mut c);
            c.args(["-c", script]).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
            c
        };
        let out = cmd.output().unwrap();
        (
            out.status,
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (plain, plain_out, plain_err) = run(false);
    let (light, light_out, light_err) = run(true);
    assert_eq!(plain.signal(), Some(libc::SIGSEGV), "{plain_err}");
    assert_eq!(light.signal(), Some(libc::SIGSEGV), "{light_err}");
    assert!(
        plain_out.contains("dispositions ok") && light_out.contains("dispositions ok"),
        "{light_out}{light_err}"
    );
    for err in [&plain_err, &light_err] {
        assert!(err.contains("Fatal Python error: Segmentation fault"), "{err}");
    }
}

/// SIGTERM from outside to a program whose main thread is nearly always
/// inside a (fake) CUDA call, holding the driver's lock: the library must
/// not wait inside that call (the guard's lock would wait for it), so the
/// program runs on until the guard has suspended it, and then dies of the
/// SIGTERM.
#[test]
fn sigterm_to_a_busy_program_is_suspended_before_it_kills() {
    let mut w = World::new(&[16_384]);
    let st = status_file(&w, "busy");
    let worker = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/gpu/dying_worker.py");
    let idx = w.spawn_gpusnap(&[
        "run",
        "--light",
        "--",
        "python3",
        worker.to_str().unwrap(),
        "1",
        st.to_str().unwrap(),
        "--backend",
        "driver",
        "--interval",
        "0",
        "--no-setsid",
    ]);
    wait_for(Duration::from_secs(20), || {
        std::fs::read_to_string(&st).is_ok_and(|s| s.split_whitespace().nth(1).is_some_and(|i| i != "0"))
    });
    let pid = pid_in(&st);
    std::thread::sleep(Duration::from_millis(300));
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM).unwrap();
    assert_died_suspended(&w, idx, pid, libc::SIGTERM, "before death (signal SIGTERM)", "sigterm");
}

/// A program the library cannot reach (here: a wrapper drops LD_PRELOAD)
/// is named, not guarded in silence.
#[test]
fn a_program_without_the_library_is_named() {
    let w = World::new(&[8192]);
    let r = w.gpusnap(&["run", "--light", "--", "env", "-u", "LD_PRELOAD", "sleep", "3"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stderr.contains("libgpusnap_preload.so is not loaded in the program"), "{}", r.stderr);
}
