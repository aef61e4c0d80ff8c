//! `podman container checkpoint` / `restore` of a fake CUDA container:
//! runc or crun calls CRIU, CRIU's CUDA plugin calls gpusnap as
//! `cuda-checkpoint`. Each flow runs with both runtimes.

use crate::common::*;
use crate::podman::*;
use std::time::Duration;

fn gpu(mib: u64) -> serde_json::Value {
    serde_json::json!([{ "uuid": "GPU-00000000-0000-0000-0000-000000000000", "total_mib": mib }])
}

#[test]
fn a_container_checkpointed_through_gpusnap_comes_back_checkpointed_when_memory_is_short() {
    short_restore(Oci::Runc);
}

#[test]
fn a_container_checkpointed_through_gpusnap_comes_back_checkpointed_when_memory_is_short_with_crun() {
    short_restore(Oci::Crun);
}

fn short_restore(oci: Oci) {
    criu_present();
    let w = World::new(&[8192]);
    let Some(pm) = Podman::with(&w, oci) else { return };
    if cuda_plugin_dir().is_none() {
        return;
    }
    let (pid, status) = pm.workload(&w, "ckpt", 1024);
    let p = pid.to_string();
    let runtime = if oci == Oci::Crun { "crun" } else { "runc" };
    assert_eq!(pm.ok(&["inspect", "--format", "{{.OCIRuntime}}", "ckpt"]), runtime);

    pm.ok(&["container", "checkpoint", "ckpt"]);
    assert_eq!(pm.status("ckpt"), "exited");
    // The driver saw gpusnap's lock and checkpoint, journaled by gpusnap.
    assert_eq!(w.calls_on(pid), ["get_restore_tid=0", "lock=0", "get_restore_tid=0", "checkpoint=0"]);
    let h = w.json(&["history", &p]).stdout;
    assert!(h.contains("\"lock\"") && h.contains("\"checkpoint\""), "{h}");

    // Restore while the GPU lacks the memory: the container runs again,
    // its CUDA process checkpointed and recoverable, never stranded.
    w.set_config("gpus", gpu(600));
    pm.ok(&["container", "restore", "ckpt"]);
    assert_eq!(pm.status("ckpt"), "running");
    assert_eq!(pm.pid("ckpt"), pid, "the host's pid namespace: the same pid");
    assert!(!w.calls_on(pid).iter().any(|c| c.starts_with("restore")), "no restore was attempted");
    let v = w.json(&["state", &p]).json();
    assert_eq!(v["state"], "checkpointed");
    assert_eq!(v["unrecoverable"], false);
    assert_eq!(v["footprint_bytes"], 1024 * MIB);
    let r = w.json(&["resume", &p]);
    assert_eq!(r.code, 3, "still no room: {}", r.stderr);

    // Memory freed: resume, by pid or by container.
    w.set_config("gpus", gpu(8192));
    let mut cmd = w.gpusnap_cmd(&["--json", "resume", "--container", "ckpt"]);
    pm.env(&mut cmd);
    let o = bounded(cmd, Duration::from_secs(120));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_progressing_at(&status);
    assert_eq!(w.json(&["state", &p]).json()["state"], "running");
}

#[test]
fn a_container_exported_to_a_tarball_is_restored_under_another_name() {
    export_import(Oci::Runc);
}

#[test]
fn a_container_exported_to_a_tarball_is_restored_under_another_name_with_crun() {
    export_import(Oci::Crun);
}

fn export_import(oci: Oci) {
    criu_present();
    let w = World::new(&[8192]);
    let Some(pm) = Podman::with(&w, oci) else { return };
    if cuda_plugin_dir().is_none() {
        return;
    }
    let (pid, status) = pm.workload(&w, "orig", 512);
    let tar = w.tmp.path().join("orig-checkpoint.tar.gz");
    let t = tar.to_str().unwrap();
    pm.ok(&["container", "checkpoint", "--export", t, "orig"]);
    assert!(tar.is_file());
    assert_eq!(w.json(&["state", &pid.to_string()]).code, 2, "the process is gone with its container");
    // The pid must be free for the copy (the host's pid namespace).
    pm.ok(&["rm", "orig"]);
    pm.ok(&["container", "restore", "--import", t, "--name", "copy"]);
    assert_eq!(pm.status("copy"), "running");
    assert_eq!(pm.pid("copy"), pid);
    // The plugin restored it through gpusnap: memory was there.
    let calls = w.calls_on(pid);
    assert!(calls.iter().any(|c| c == "restore=0") && calls.iter().any(|c| c == "unlock=0"), "{calls:?}");
    assert_eq!(w.json(&["state", &pid.to_string()]).json()["state"], "running");
    wait_for(Duration::from_secs(30), || read_status(&status).is_some_and(|s| s.2));
    assert_progressing_at(&status);
    let mut cmd = w.gpusnap_cmd(&["--json", "ps", "--container", "copy"]);
    pm.env(&mut cmd);
    let o = bounded(cmd, Duration::from_secs(120));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["processes"][0]["pid"], pid, "{v}");
    assert_eq!(v["processes"][0]["container"]["name"], "copy", "{v}");
}
