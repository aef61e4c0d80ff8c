//! `gpusnap run` as a container's PID 1 (`podman run --init=false`): an
//! init that reaps, forwards signals and exits as its program did, and
//! suspends the program when `podman stop` ends it.

use crate::common::*;
use crate::podman::*;
use std::path::PathBuf;
use std::time::Duration;

/// Container `name` whose PID 1 is `gpusnap run [--light]` of a shell that
/// leaves an orphan behind and becomes a fake CUDA program; the status file
/// and the guard's state directory.
fn guarded(pm: &Podman, w: &World, name: &str, light: bool) -> (PathBuf, PathBuf) {
    let status = pm.shared.join(format!("status-{name}"));
    let state = pm.shared.join(format!("state-{name}"));
    let wl = fake_workload_bin().display().to_string();
    // The orphan: a short sleep whose parent subshell is gone at once.
    let script = format!("(sleep 1 &); exec {wl} --mib 512 --status {}", status.display());
    let mut args: Vec<String> =
        vec!["run".into(), "-d".into(), "--init=false".into(), "--name".into(), name.into()];
    args.extend(pm.mounts(w));
    if !light {
        args.extend(["--cap-add".into(), "SYS_PTRACE".into()]);
    }
    args.extend([IMAGE.into(), env!("CARGO_BIN_EXE_gpusnap").into(), "--state-dir".into()]);
    args.push(state.display().to_string());
    args.push("run".into());
    if light {
        args.push("--light".into());
    }
    args.extend(["--".into(), "/bin/sh".into(), "-c".into(), script]);
    pm.ok(&args.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    wait_for(Duration::from_secs(60), || read_status(&status).is_some_and(|s| s.1 >= 1));
    (status, state)
}

fn pid1_stop(light: bool) {
    let w = World::new(&[8192]);
    let Some(pm) = Podman::new(&w) else { return };
    let name = if light { "light" } else { "traced" };
    let (status, state) = guarded(&pm, &w, name, light);
    let id = pm.ok(&["inspect", "--format", "{{.Id}}", name]);
    // The program's pid as it and the fake driver see it, in the container.
    let (inner, _, _) = read_status(&status).unwrap();
    assert_ne!(inner, 1, "the program is not PID 1: the guard is");
    // PID 1 is gpusnap; the orphaned sleep is reaped, no zombie is left.
    let host_pid1 = pm.pid(name);
    let comm = std::fs::read_to_string(format!("/proc/{host_pid1}/comm")).unwrap();
    assert_eq!(comm.trim(), "gpusnap");
    let zombies = || {
        gpusnap_members(&id)
            .into_iter()
            .filter(|p| std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|s| s.contains(") Z ")))
            .count()
    };
    let sleeping = || {
        gpusnap_members(&id)
            .into_iter()
            .any(|p| std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == "sleep"))
    };
    wait_for(Duration::from_secs(30), || zombies() == 0 && !sleeping());
    assert_progressing_at(&status);

    // The runtime's stop: SIGTERM to PID 1, which forwards it; the program
    // is suspended before it dies; the container exits as the program did.
    pm.ok(&["stop", "-t", "30", name]);
    assert_eq!(pm.status(name), "exited");
    let logs = String::from_utf8_lossy(&pm.podman(&["logs", name]).stderr).to_string();
    let journal = std::fs::read_to_string(w.fake_dir().join("journal.log")).unwrap_or_default();
    let st = state.display().to_string();
    let history = w.gpusnap(&["--state-dir", &st, "history", &inner.to_string()]).stdout;
    assert_eq!(
        pm.ok(&["inspect", "--format", "{{.State.ExitCode}}", name]),
        "143",
        "128 + SIGTERM; program {inner}; logs:\n{logs}\njournal:\n{journal}\nhistory:\n{history}"
    );
    let calls: Vec<String> = w
        .journal()
        .into_iter()
        .filter(|(c, p, _)| *p == inner && (c == "lock" || c == "checkpoint"))
        .map(|(c, _, rc)| format!("{c}={rc}"))
        .collect();
    assert_eq!(calls, ["lock=0", "checkpoint=0"], "suspended before it died");
    let h = std::fs::read_dir(&state).is_ok();
    assert!(h, "the guard's state directory");
}

fn gpusnap_members(id: &str) -> Vec<i32> {
    // The container's processes, from their cgroups (as --container does).
    let mut v = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
        if std::fs::read_to_string(format!("/proc/{p}/cgroup"))
            .is_ok_and(|c| c.contains(&format!("libpod-{id}")))
        {
            v.push(p);
        }
    }
    v
}

#[test]
fn the_traced_guard_as_pid_1_reaps_forwards_and_suspends_on_podman_stop() {
    pid1_stop(false);
}

#[test]
fn the_light_guard_as_pid_1_reaps_forwards_and_suspends_on_podman_stop() {
    pid1_stop(true);
}

/// The light guard as the entrypoint (in the host's pid namespace, where
/// the fake driver follows CRIU's restore) is part of the tree the runtime
/// checkpoints: after `podman container checkpoint` and `restore` it still
/// guards its program, which `podman stop` then finds suspended.
#[test]
fn the_light_guard_survives_a_container_checkpoint_and_restore() {
    criu_present();
    let w = World::new(&[8192]);
    let Some(pm) = Podman::new(&w) else { return };
    if cuda_plugin_dir().is_none() {
        return;
    }
    let status = pm.shared.join("status-g");
    let state = pm.shared.join("state-g");
    let mut args: Vec<String> =
        vec!["run".into(), "-d".into(), "--init=false".into(), "--name".into(), "g".into()];
    args.extend(pm.world_flags(&w));
    args.extend([IMAGE.into(), env!("CARGO_BIN_EXE_gpusnap").into(), "--state-dir".into()]);
    args.push(state.display().to_string());
    args.extend(["run".into(), "--light".into(), "--".into(), fake_workload_bin().display().to_string()]);
    args.extend(["--mib".into(), "256".into(), "--status".into(), status.display().to_string()]);
    pm.ok(&args.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    wait_for(Duration::from_secs(60), || read_status(&status).is_some_and(|s| s.1 >= 1));
    let (pid, _, _) = read_status(&status).unwrap();
    let guard = pm.pid("g");

    pm.ok(&["container", "checkpoint", "g"]);
    pm.ok(&["container", "restore", "g"]);
    assert_eq!(pm.pid("g"), guard, "the guard is back, same pid");
    assert_progressing_at(&status);
    let calls = w.calls_on(pid);
    assert!(
        calls.contains(&"checkpoint=0".to_string()) && calls.contains(&"restore=0".to_string()),
        "{calls:?}"
    );

    pm.ok(&["stop", "-t", "30", "g"]);
    assert_eq!(pm.ok(&["inspect", "--format", "{{.State.ExitCode}}", "g"]), "143");
    let st = state.display().to_string();
    let h = w.gpusnap(&["--state-dir", &st, "history", &pid.to_string()]).stdout;
    assert!(h.contains("before death (signal SIGTERM)"), "{h}");
}
