//! gpusnap with a real container stack: podman, runc and the project's
//! CRIU, a local image built from a rootfs tarball (no registry), the fake
//! driver and NVML bind-mounted into the containers; a containerd of the
//! test's own for `--container` of its tasks.

#[path = "../common/mod.rs"]
mod common;
mod containerd;
mod podman;

use common::*;
use podman::*;

/// The stack runs with the configuration the guide gives (no per-run
/// ulimit flags): a fake CUDA program in a container is a CUDA process of
/// the host, which gpusnap suspends and resumes by pid.
#[test]
fn a_fake_cuda_container_runs_and_is_suspended_from_the_host() {
    let w = World::new(&[8192]);
    let Some(pm) = Podman::new(&w) else { return };
    let (pid, status) = pm.workload(&w, "worker", 1024);
    assert_eq!(pm.status("worker"), "running");
    // With the test's podman: `ps` asks it for the containers' names.
    let mut cmd = w.gpusnap_cmd(&["--json", "ps"]);
    pm.env(&mut cmd);
    let o = bounded(cmd, std::time::Duration::from_secs(120));
    let ps: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let row = ps["processes"].as_array().unwrap().iter().find(|r| r["pid"] == pid).cloned();
    assert_eq!(row.expect("ps lists the container's process")["footprint_bytes"], 1024 * MIB);

    let p = pid.to_string();
    let r = w.json(&["suspend", &p]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(w.json(&["state", &p]).json()["state"], "checkpointed");
    let r = w.json(&["resume", &p]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_progressing_at(&status);
}

mod checkpoint;
mod guard;
mod guard_deaths;
mod shm;
mod targets;
mod targets_containerd;
