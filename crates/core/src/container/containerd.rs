//! containerd's containers, from the task state its shims keep
//! (`STATE/io.containerd.runtime.v2.task/NAMESPACE/ID/` with the bundle's
//! `config.json` and the task's `init.pid`): no gRPC, no socket. A task's
//! processes are those in its first process's cgroup, which `ctr run`
//! names `/NAMESPACE/ID` and the CRI plugin `cri-containerd-ID.scope` (the
//! first process's tree where no cgroup names it).

use super::{alive, cgroup_members, frozen, pick, ContainerRef, Found, Runtime};
use crate::error::Error;
use std::io::Read;
use std::path::PathBuf;

/// containerd's state directory (`--state`, `state` in config.toml):
/// `GPUSNAP_CONTAINERD_STATE`, else `/run/containerd`.
pub struct Containerd {
    state: PathBuf,
}

/// A task the shim keeps state for.
struct Task {
    namespace: String,
    id: String,
    dir: PathBuf,
}

/// A bundle's config.json is the runtime spec the shim was given; more than
/// this is not one.
const CONFIG_BYTES: u64 = 1 << 20;

impl Containerd {
    pub fn from_env() -> Self {
        let state = std::env::var_os("GPUSNAP_CONTAINERD_STATE")
            .filter(|s| !s.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/run/containerd"));
        Containerd { state }
    }

    /// Every task, namespace `k8s.io` (Kubernetes' pods) first, then the
    /// others by name.
    fn tasks(&self) -> Vec<Task> {
        let root = self.state.join("io.containerd.runtime.v2.task");
        let dirs = |p: &std::path::Path| -> Vec<String> {
            let mut v: Vec<String> = std::fs::read_dir(p)
                .into_iter()
                .flatten()
                .flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .filter_map(|e| e.file_name().to_str().map(str::to_string))
                .collect();
            v.sort();
            v
        };
        let mut namespaces = dirs(&root);
        namespaces.sort_by_key(|n| n != "k8s.io");
        let mut out = Vec::new();
        for ns in namespaces {
            for id in dirs(&root.join(&ns)) {
                out.push(Task { dir: root.join(&ns).join(&id), namespace: ns.clone(), id });
            }
        }
        tracing::debug!("containerd tasks under {}: {}", root.display(), out.len());
        out
    }

    fn found(&self, t: &Task) -> Found {
        let pid: i32 = std::fs::read_to_string(t.dir.join("init.pid"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
        let status = if pid <= 0 {
            "created"
        } else if !alive(pid) {
            "stopped"
        } else if frozen(pid).is_some() {
            "paused"
        } else {
            "running"
        };
        Found { id: t.id.clone(), name: name(t), status: status.into(), pid }
    }
}

/// What `ps` calls the task: Kubernetes' container name where the CRI
/// plugin annotated the bundle (`POD/CONTAINER`), else `NAMESPACE/ID`.
fn name(t: &Task) -> String {
    let mut text = String::new();
    if let Ok(f) = std::fs::File::open(t.dir.join("config.json")) {
        let _ = f.take(CONFIG_BYTES).read_to_string(&mut text);
    }
    let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    let a = &v["annotations"];
    match (a["io.kubernetes.cri.sandbox-name"].as_str(), a["io.kubernetes.cri.container-name"].as_str()) {
        (Some(pod), Some(c)) => format!("{pod}/{c}"),
        (None, Some(c)) => c.to_string(),
        _ => format!("{}/{}", t.namespace, t.id),
    }
}

impl Runtime for Containerd {
    fn name(&self) -> &'static str {
        "containerd"
    }

    /// `ID`, a unique prefix of one, or `NAMESPACE/ID`.
    fn find(&self, name_or_id: &str) -> Result<Option<Found>, Error> {
        let mut tasks = self.tasks();
        let mut want = name_or_id;
        if let Some((ns, id)) = name_or_id.split_once('/') {
            tasks.retain(|t| t.namespace == ns);
            want = id;
        }
        let ids: Vec<String> = tasks.iter().map(|t| t.id.clone()).collect();
        let Some(id) = pick("containerd", want, &ids)? else { return Ok(None) };
        let t = tasks.iter().find(|t| &t.id == id).expect("picked from these");
        let f = self.found(t);
        tracing::debug!("containerd task {}/{}: {} pid {}", t.namespace, t.id, f.status, f.pid);
        Ok(Some(f))
    }

    fn names(&self) -> Vec<(String, String)> {
        self.tasks().iter().map(|t| (t.id.clone(), name(t))).collect()
    }

    fn members(&self, found: &Found) -> Vec<i32> {
        cgroup_members(found.pid, &found.id)
    }

    fn running(&self) -> Vec<(ContainerRef, Vec<i32>)> {
        self.tasks()
            .iter()
            .map(|t| self.found(t))
            .filter(|f| f.status == "running" || f.status == "paused")
            .map(|f| {
                let pids = cgroup_members(f.pid, &f.id);
                (ContainerRef { runtime: "containerd", id: f.id, name: Some(f.name) }, pids)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(state: &std::path::Path, ns: &str, id: &str, pid: i32) {
        let d = state.join("io.containerd.runtime.v2.task").join(ns).join(id);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("init.pid"), pid.to_string()).unwrap();
    }

    #[test]
    fn finds_a_task_by_id_prefix_or_namespace_and_says_whether_it_runs() {
        let tmp = tempfile::tempdir().unwrap();
        let me = std::process::id() as i32;
        task(tmp.path(), "default", "worker-a", me);
        task(tmp.path(), "default", "worker-b", i32::MAX);
        task(tmp.path(), "k8s.io", "0123456789abcdef", me);
        let c = Containerd { state: tmp.path().to_path_buf() };
        let f = c.find("worker-a").unwrap().unwrap();
        assert_eq!((f.status.as_str(), f.pid, f.name.as_str()), ("running", me, "default/worker-a"));
        assert_eq!(c.find("worker-b").unwrap().unwrap().status, "stopped");
        assert_eq!(c.find("0123").unwrap().unwrap().id, "0123456789abcdef");
        assert_eq!(c.find("default/worker-a").unwrap().unwrap().id, "worker-a");
        assert!(c.find("k8s.io/worker-a").unwrap().is_none());
        assert!(c.find("nothing").unwrap().is_none());
        let e = c.find("worker").unwrap_err().to_string();
        assert!(e.contains("ambiguous") && e.contains("2 containerd containers"), "{e}");
        // Kubernetes' pods first.
        assert_eq!(c.tasks()[0].namespace, "k8s.io");
    }

    #[test]
    fn names_a_kubernetes_container_by_its_pod() {
        let tmp = tempfile::tempdir().unwrap();
        task(tmp.path(), "k8s.io", "abc", 1);
        let d = tmp.path().join("io.containerd.runtime.v2.task/k8s.io/abc/config.json");
        std::fs::write(
            d,
            r#"{"annotations":{"io.kubernetes.cri.sandbox-name":"vllm-0","io.kubernetes.cri.container-name":"engine"}}"#,
        )
        .unwrap();
        let c = Containerd { state: tmp.path().to_path_buf() };
        assert_eq!(c.names(), [("abc".to_string(), "vllm-0/engine".to_string())]);
    }

    #[test]
    fn no_state_directory_is_no_container() {
        let c = Containerd { state: "/nonexistent/containerd".into() };
        assert!(c.find("x").unwrap().is_none());
        assert!(c.running().is_empty());
    }
}
