//! `--container` for containerd's tasks, resolved from the shims' task
//! state (no gRPC): by id, unique prefix or `NAMESPACE/ID`; `ps` names
//! them; unknown, ambiguous, paused and stopped ones refused with exit 2.

use crate::common::*;
use crate::containerd::*;
use std::time::Duration;

fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s.lines().last().unwrap_or("")).unwrap_or_else(|e| panic!("{e}: {s}"))
}

#[test]
fn a_containerd_task_is_a_target_by_id_prefix_or_namespace_and_ps_names_it() {
    let w = World::new(&[8192]);
    let Some(cd) = Containerd::new(&w) else { return };
    let (pid, status) = cd.workload(&w, "fake-worker-1", 1024);
    let p = pid.to_string();

    let (code, out, err) = cd.gpusnap(&w, &["ps"]);
    assert_eq!(code, 0, "{err}");
    let ps = json(&out);
    let row = ps["processes"].as_array().unwrap().iter().find(|r| r["pid"] == pid).cloned();
    let row = row.unwrap_or_else(|| panic!("ps lists the task's process: {ps}"));
    assert_eq!(row["container"]["runtime"], "containerd", "{row}");
    assert_eq!(row["container"]["id"], "fake-worker-1", "{row}");
    assert_eq!(row["container"]["name"], format!("{NS}/fake-worker-1"), "{row}");
    let (code, out, _) = cd.gpusnap(&w, &["ps", "--container", "fake-worker-1"]);
    assert_eq!(code, 0);
    assert_eq!(json(&out)["processes"].as_array().unwrap().len(), 1, "{out}");

    // A unique prefix, then the namespace's own spelling.
    let (code, _, err) = cd.gpusnap(&w, &["suspend", "--container", "fake-w"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(w.json(&["state", &p]).json()["state"], "checkpointed");
    let (code, _, err) = cd.gpusnap(&w, &["resume", "--container", &format!("{NS}/fake-worker-1")]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(w.json(&["state", &p]).json()["state"], "running");
    assert_progressing_at(&status);
    assert_eq!(w.calls_on(pid).iter().filter(|c| *c == "checkpoint=0" || *c == "restore=0").count(), 2);
}

#[test]
fn unknown_ambiguous_paused_and_stopped_containerd_tasks_are_refused_with_the_reason() {
    let w = World::new(&[8192]);
    let Some(cd) = Containerd::new(&w) else { return };
    cd.run(&w, "idle-a", &["/bin/sleep", "100000"]);
    cd.run(&w, "idle-b", &["/bin/sleep", "100000"]);

    let (code, _, err) = cd.gpusnap(&w, &["suspend", "--container", "idle"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("ambiguous") && err.contains("2 containerd containers"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");

    let (code, _, err) = cd.gpusnap(&w, &["suspend", "--container", "no-such-task"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("no such container"), "{err}");

    let b = cd.init_pid("idle-b");
    cd.ok(&["task", "kill", "-s", "SIGKILL", "idle-b"]);
    wait_for(Duration::from_secs(60), || !pid_exists(b));
    let (code, _, err) = cd.gpusnap(&w, &["suspend", "--container", "idle-b"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("idle-b is stopped, not running"), "{err}");

    // A paused task: its cgroup is frozen, refused.
    cd.ok(&["task", "pause", "idle-a"]);
    let (code, _, err) = cd.gpusnap(&w, &["suspend", "--container", "idle-a"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("is paused"), "{err}");
    cd.ok(&["task", "resume", "idle-a"]);

    // The running one resolves, and holds no CUDA process.
    let (code, out, err) = cd.gpusnap(&w, &["ps", "--container", "idle-a"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(json(&out)["processes"].as_array().unwrap().len(), 0, "{out}");
}
