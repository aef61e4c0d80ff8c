//! `gpusnap run --light` as a container's PID 1 when its program dies
//! of itself (a crash, a fatal CUDA error) and when the runtime's stop
//! timeout runs out on a program that ignores SIGTERM: suspended first,
//! the container ending as the program did.

use crate::common::*;
use crate::podman::*;
use std::path::PathBuf;
use std::time::Duration;

/// Container `name`, PID 1 `gpusnap run --light` (the traced guard where
/// not `light`, with CAP_SYS_PTRACE) of `sh -c SCRIPT` whose
/// `{wl}` is the fake workload, `{status}` its status file; the status file
/// and the guard's state directory.
fn pid1(pm: &Podman, w: &World, name: &str, light: bool, script: &str) -> (PathBuf, PathBuf) {
    let status = pm.shared.join(format!("status-{name}"));
    let state = pm.shared.join(format!("state-{name}"));
    let script = script
        .replace("{wl}", &fake_workload_bin().display().to_string())
        .replace("{status}", &status.display().to_string());
    let mut args: Vec<String> =
        vec!["run".into(), "-d".into(), "--init=false".into(), "--name".into(), name.into()];
    args.extend(pm.mounts(w));
    if !light {
        args.extend(["--cap-add".into(), "SYS_PTRACE".into()]);
    }
    args.extend([IMAGE.into(), env!("CARGO_BIN_EXE_gpusnap").into(), "--state-dir".into()]);
    args.extend([state.display().to_string(), "run".into()]);
    if light {
        args.push("--light".into());
    }
    args.push("--".into());
    args.extend(["/bin/sh".into(), "-c".into(), script]);
    pm.ok(&args.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    (status, state)
}

/// The calls the fake driver saw on `pid` (its pid in the container, which
/// another container's program may have had: those after the first `skip`).
fn lock_and_checkpoint(w: &World, pid: i32, skip: usize) -> Vec<String> {
    w.journal()
        .into_iter()
        .skip(skip)
        .filter(|(c, p, _)| *p == pid && (c == "lock" || c == "checkpoint"))
        .map(|(c, _, rc)| format!("{c}={rc}"))
        .collect()
}

fn history(w: &World, state: &std::path::Path, pid: i32) -> String {
    let st = state.display().to_string();
    w.gpusnap(&["--state-dir", &st, "history", &pid.to_string()]).stdout
}

fn exited(pm: &Podman, name: &str) -> String {
    wait_for(Duration::from_secs(120), || pm.status(name) == "exited");
    pm.ok(&["inspect", "--format", "{{.State.ExitCode}}", name])
}

#[test]
fn a_crash_of_the_program_under_the_guard_as_pid_1_is_suspended_and_the_container_exits_as_it_did() {
    let w = World::new(&[8192]);
    let Some(pm) = Podman::new(&w) else { return };
    for (name, die, code) in [("segv", "segv", "139"), ("abort", "abort", "134")] {
        let skip = w.journal().len();
        let (status, state) = pid1(
            &pm,
            &w,
            name,
            true,
            &format!("exec {{wl}} --mib 256 --status {{status}} --die {die} --after-ms 3000"),
        );
        let code_seen = exited(&pm, name);
        let (pid, _, _) = read_status(&status).expect("the program ran an iteration before it died");
        let h = history(&w, &state, pid);
        assert_eq!(code_seen, code, "{name}: 128 + the signal; history:\n{h}");
        assert_eq!(
            lock_and_checkpoint(&w, pid, skip),
            ["lock=0", "checkpoint=0"],
            "{name}: suspended before it died\n{h}"
        );
        assert!(h.contains("before death"), "{name}: {h}");
    }
}

#[test]
fn a_fatal_cuda_error_under_the_guard_as_pid_1_is_recorded_and_the_container_exits_7() {
    let w = World::new(&[8192]);
    let Some(pm) = Podman::new(&w) else { return };
    let (status, state) =
        pid1(&pm, &w, "fault", true, "exec {wl} --mib 256 --status {status} --die fault --after-ms 3000");
    let code = exited(&pm, "fault");
    let (pid, _, _) = read_status(&status).expect("the program ran an iteration before it faulted");
    let h = history(&w, &state, pid);
    // The driver refuses to lock a faulted context (700): nothing to
    // suspend; `run` says so with its own exit code.
    assert_eq!(code, "7", "history:\n{h}");
    assert!(w.calls_on(pid).contains(&"lock=700".to_string()), "{:?}", w.calls_on(pid));
    assert!(h.contains("CUDA context faulted"), "{h}");
}

/// A program that ignores SIGTERM ends by the runtime's SIGKILL to PID 1
/// when `podman stop -t N` runs out; the guard suspends it when the SIGTERM
/// comes, before the SIGKILL can.
#[test]
fn a_program_ignoring_sigterm_is_suspended_before_the_stop_timeout_kills_the_container() {
    ignoring_sigterm(true);
}

#[test]
fn a_program_ignoring_sigterm_under_the_traced_guard_is_suspended_before_the_stop_timeout() {
    ignoring_sigterm(false);
}

fn ignoring_sigterm(light: bool) {
    let w = World::new(&[8192]);
    let Some(pm) = Podman::new(&w) else { return };
    let (status, state) = pid1(&pm, &w, "deaf", light, "trap '' TERM; exec {wl} --mib 256 --status {status}");
    wait_for(Duration::from_secs(60), || read_status(&status).is_some_and(|s| s.1 >= 1));
    let (pid, _, _) = read_status(&status).unwrap();
    // Room for the suspend on a loaded machine before the runtime's SIGKILL.
    pm.ok(&["stop", "-t", "20", "deaf"]);
    let code = exited(&pm, "deaf");
    let h = history(&w, &state, pid);
    assert_eq!(code, "137", "the runtime's SIGKILL; history:\n{h}");
    assert_eq!(
        lock_and_checkpoint(&w, pid, 0),
        ["lock=0", "checkpoint=0"],
        "suspended before the SIGKILL\n{h}"
    );
    assert!(h.contains("ignores the SIGTERM"), "{h}");
}
