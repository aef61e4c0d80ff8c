//! Doctor's checks of a process in a container: what a checkpoint of it
//! depends on that a bare process does not (its mount namespace, the
//! device nodes and driver libraries the runtime put there, its /dev/shm,
//! a frozen cgroup).

use super::{Finding, Severity};
use std::path::Path;

fn f(check: &'static str, severity: Severity, message: String, fix: Option<&str>) -> Finding {
    Finding { check, severity, message, fix: fix.map(str::to_string) }
}

/// The findings for `pid` under `root` (/proc): none for a process of no
/// container, except a frozen cgroup, which hangs the driver wherever it is.
pub fn findings(root: &Path, pid: i32) -> Vec<Finding> {
    let mut out = Vec::new();
    if let Some(cg) = gpusnap_core::container::frozen(pid) {
        out.push(f(
            "frozen",
            Severity::Error,
            format!("its cgroup {cg} is frozen (a paused container, or a checkpoint in progress): the driver hangs on it"),
            Some("thaw it first (podman unpause); gpusnap refuses it meanwhile (exit 2, frozen)"),
        ));
    }
    let Some(c) = gpusnap_core::container::of_pid(pid) else { return out };
    let dir = root.join(pid.to_string());
    let id: String = c.id.chars().take(12).collect();
    out.push(f("container", Severity::Info, format!("runs in {} container {id}", c.runtime), None));
    let ns = |p: &Path| std::fs::read_link(p.join("ns/mnt")).ok();
    if ns(&dir) != ns(&root.join("self")) {
        out.push(f(
            "mount-namespace",
            Severity::Info,
            "its mount namespace is not gpusnap's: `hibernate` dumps its process tree alone; the whole container (namespaces, mounts, network) is checkpointed by its runtime".into(),
            Some("podman container checkpoint, with CRIU's CUDA plugin and gpusnap as its cuda-checkpoint (docs/guides/containers.md)"),
        ));
    }
    let fds: Vec<String> = std::fs::read_dir(dir.join("fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|p| p.display().to_string())
        .collect();
    let mut devices: Vec<&str> =
        fds.iter().filter(|p| p.starts_with("/dev/nvidia")).map(|s| s.as_str()).collect();
    devices.sort_unstable();
    devices.dedup();
    if !devices.is_empty() {
        out.push(f(
            "devices",
            Severity::Info,
            format!("holds {}: a restore needs the same device nodes in the container", devices.join(", ")),
            Some("restore on a host with the same GPUs and driver, the runtime giving the container the same /dev/nvidia* nodes"),
        ));
    }
    let maps = std::fs::read_to_string(dir.join("maps")).unwrap_or_default();
    let libcuda = maps.lines().filter_map(|l| l.split_whitespace().nth(5)).find(|p| p.contains("libcuda.so"));
    if let Some(lib) = libcuda {
        out.push(f(
            "driver-libraries",
            Severity::Info,
            format!("maps the driver library {lib}, which the runtime mounts from the host"),
            Some("the restore host must mount the same driver version at the same path; CRIU refuses a restore whose mapped files differ"),
        ));
    }
    // Deleted /dev/shm files, by the links their inodes still have: none
    // (a ghost file for CRIU) or some (a named semaphore's other name).
    use std::os::unix::fs::MetadataExt;
    let deleted = |p: &str| p.starts_with("/dev/shm/") && p.ends_with("(deleted)");
    let links = |p: std::path::PathBuf| std::fs::metadata(p).map(|m| m.nlink()).unwrap_or(1);
    let mut shm_links: Vec<u64> = std::fs::read_dir(dir.join("fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| std::fs::read_link(e.path()).is_ok_and(|p| deleted(&p.display().to_string())))
        .map(|e| links(e.path()))
        .collect();
    for l in maps.lines() {
        if let (Some(range), Some((_, r))) = (l.split_whitespace().next(), l.split_once(" /dev/shm/")) {
            if deleted(&format!("/dev/shm/{}", r.trim())) {
                shm_links.push(links(dir.join("map_files").join(range)));
            }
        }
    }
    if shm_links.iter().any(|&n| n > 0) {
        out.push(f(
            "shm",
            Severity::Warn,
            "holds /dev/shm files under removed names that another name still links (named POSIX semaphores, as vLLM's and SGLang's Python leave them): CRIU dumps them only with link-remap, as link_remap files left in that /dev/shm; without it the container's checkpoint fails (the container runs on), and a restore whose /dev/shm is not the one dumped (a Kubernetes pod's, from its sandbox) cannot relink them (checkpoint-restore/criu#2980)".into(),
            Some("link-remap in CRIU's configuration for the runtime (/etc/criu/runc.conf, crun.conf); podman carries a container's own /dev/shm in its checkpoint; a pod's restore needs the /dev/shm the dump left its link_remap files in; gpusnap's own suspend (no CRIU) is not affected"),
        ));
    } else if !shm_links.is_empty() {
        out.push(f(
            "shm",
            Severity::Info,
            "holds deleted /dev/shm files that no name links: CRIU dumps their contents as ghost files (up to its ghost limit, 1 MiB by default), whatever /dev/shm the restore has".into(),
            None,
        ));
    }
    out
}

/// Where a container runtime is installed: whether CRIU's CUDA plugin would
/// find gpusnap as `cuda-checkpoint`, and runc's CRIU configuration its
/// plugin directory (docs/guides/containers.md). None without a runtime.
pub fn host() -> Option<Finding> {
    let on_path = |name: &str| {
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    };
    let runtime = ["podman", "runc", "crun"].into_iter().find(|r| on_path(r).is_some())?;
    let mut problems: Vec<String> = Vec::new();
    match on_path("cuda-checkpoint") {
        None => problems.push(
            "no cuda-checkpoint on PATH: CRIU's CUDA plugin cannot checkpoint a container's CUDA processes"
                .into(),
        ),
        Some(p) => {
            let me = std::env::current_exe().ok().and_then(|e| std::fs::canonicalize(e).ok());
            if std::fs::canonicalize(&p).ok() != me {
                problems.push(format!(
                    "{} is not this gpusnap: a restore through it has no admission control",
                    p.display()
                ));
            }
        }
    }
    // crun reads crun.conf, else runc.conf; runc reads runc.conf.
    let libdir = |file: &str| {
        std::fs::read_to_string(file)
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.trim().strip_prefix("libdir").map(|d| d.trim().trim_matches('"').to_string()))
            .filter(|d| Path::new(d).join("cuda_plugin.so").is_file())
    };
    if libdir("/etc/criu/runc.conf").is_none() && libdir("/etc/criu/crun.conf").is_none() {
        problems.push("neither /etc/criu/runc.conf nor /etc/criu/crun.conf names a libdir holding cuda_plugin.so: the runtime's CRIU loads no CUDA plugin (unless a container's org.criu.config names a configuration that does)".into());
    }
    if let Some(crun) = on_path("crun") {
        let version = std::process::Command::new(&crun)
            .arg("--version")
            .stdin(std::process::Stdio::null())
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
            .unwrap_or_default();
        if !version.contains("+CRIU") {
            problems.push(format!(
                "{} is built without CRIU: a container run by it cannot be checkpointed (scripts/install-criu.sh --crun installs one that can; or use runc)",
                crun.display()
            ));
        } else if std::fs::read_to_string("/sys/fs/cgroup/unified/cgroup.controllers")
            .is_ok_and(|c| !c.trim().is_empty())
        {
            problems.push("cgroups are hybrid with a controller on the v2 hierarchy: crun refuses every container here (\"cgroups in hybrid mode not supported\"); use runc".into());
        }
    }
    Some(if problems.is_empty() {
        f(
            "container-runtime",
            Severity::Ok,
            format!("{runtime}: CRIU's CUDA plugin calls gpusnap as cuda-checkpoint"),
            None,
        )
    } else {
        f(
            "container-runtime",
            Severity::Warn,
            format!("{runtime} is installed; {}", problems.join("; ")),
            Some("ln -s $(command -v gpusnap) /usr/local/bin/cuda-checkpoint; `libdir /opt/gpusnap/criu/lib/criu` and `file-locks` in /etc/criu/runc.conf (docs/guides/containers.md)"),
        )
    })
}
