//! A container's program holding a deleted /dev/shm file mapped (a POSIX
//! semaphore after `sem_unlink`, as vLLM's and SGLang's Python holds them)
//! through `podman container checkpoint` and `restore`: where it survives,
//! where CRIU's `link-remap` makes the restore fail, and what doctor says.

use crate::common::*;
use crate::podman::*;
use std::path::Path;
use std::time::Duration;

/// Container `name` of the fake workload with `--shm-semaphore`, CRIU's
/// configuration `criu_conf` (annotation), and `extra` flags; its host pid
/// once it runs.
fn holder(pm: &Podman, w: &World, name: &str, criu_conf: &Path, extra: &[String]) -> i32 {
    let status = pm.shared.join(format!("status-{name}"));
    let mut args: Vec<String> = vec!["run".into(), "-d".into(), "--name".into(), name.into()];
    let conf = format!("org.criu.config={}", criu_conf.display());
    args.extend(pm.world_flags(w).into_iter().map(|f| {
        if f.starts_with("org.criu.config=") {
            conf.clone()
        } else {
            f
        }
    }));
    args.extend(extra.iter().cloned());
    args.extend([IMAGE.into(), fake_workload_bin().display().to_string(), "--mib".into(), "128".into()]);
    args.extend(["--shm-semaphore".into(), "--status".into(), status.display().to_string()]);
    pm.ok(&args.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    wait_for(Duration::from_secs(60), || read_status(&status).is_some_and(|s| s.1 >= 1));
    let pid = pm.pid(name);
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    assert!(maps.contains("/dev/shm/sem.tmp") && maps.contains("(deleted)"), "{maps}");
    pid
}

fn conf(pm: &Podman, name: &str, link_remap: bool) -> std::path::PathBuf {
    let mut text = std::fs::read_to_string(&pm.criu_conf).unwrap();
    if link_remap {
        text.push_str("link-remap\n");
    }
    let p = pm.dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn a_named_dev_shm_semaphore_needs_link_remap_and_the_dev_shm_it_was_dumped_from() {
    criu_present();
    let w = World::new(&[8192]);
    let Some(pm) = Podman::new(&w) else { return };
    if cuda_plugin_dir().is_none() {
        return;
    }
    // Without link-remap CRIU cannot dump the file: the checkpoint fails,
    // the container and its CUDA program run on, and doctor said so first.
    let c = conf(&pm, "criu-plain.conf", false);
    let pid = holder(&pm, &w, "plain", &c, &[]);
    let mut cmd = w.gpusnap_cmd(&["--json", "doctor", &pid.to_string()]);
    pm.env(&mut cmd);
    let out = String::from_utf8_lossy(&bounded(cmd, Duration::from_secs(120)).stdout).to_string();
    assert!(out.contains("\"shm\"") && out.contains("another name still links"), "{out}");
    let o = pm.podman(&["container", "checkpoint", "plain"]);
    assert!(!o.status.success(), "CRIU cannot dump it without link-remap");
    assert_eq!(pm.status("plain"), "running");
    let status = pm.shared.join("status-plain");
    assert_progressing_at(&status);
    assert_eq!(w.json(&["state", &pid.to_string()]).json()["state"], "running");
    pm.ok(&["rm", "--force", "--time", "0", "plain"]);

    // With link-remap, in the container's own /dev/shm: podman carries it
    // in the checkpoint, the link_remap file with it.
    let c = conf(&pm, "criu-remap.conf", true);
    holder(&pm, &w, "own", &c, &[]);
    pm.ok(&["container", "checkpoint", "own"]);
    pm.ok(&["container", "restore", "own"]);
    assert_eq!(pm.status("own"), "running");
    assert_progressing_at(&pm.shared.join("status-own"));
    pm.ok(&["rm", "--force", "--time", "0", "own"]);

    // A /dev/shm that is not the container's own (a pod's, from its
    // sandbox: a directory of the host here), new at the restore as a new
    // pod's would be: the link_remap file is not there, the restore fails.
    let shm = w.tmp.path().join("pod-shm");
    std::fs::create_dir_all(&shm).unwrap();
    let mount = ["-v".to_string(), format!("{}:/dev/shm", shm.display())];
    holder(&pm, &w, "pod", &c, &mount);
    pm.ok(&["container", "checkpoint", "pod"]);
    let left: Vec<String> = std::fs::read_dir(&shm)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    assert!(left.iter().any(|n| n.starts_with("link_remap.")), "{left:?}");
    for e in std::fs::read_dir(&shm).unwrap().flatten() {
        let _ = std::fs::remove_file(e.path());
    }
    let o = pm.podman(&["container", "restore", "pod"]);
    assert!(!o.status.success(), "the restore cannot relink the file");
    assert_ne!(pm.status("pod"), "running");
}
