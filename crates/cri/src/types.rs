//! Pods and containers as the node's runtime describes them, without the
//! generated types' noise: what a node agent needs to find a pod's
//! processes and its network.

use crate::api;
use std::collections::HashMap;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Version {
    pub runtime_name: String,
    pub runtime_version: String,
    pub runtime_api_version: String,
}

/// A pod sandbox: the pod as the runtime knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pod {
    pub id: String,
    pub name: String,
    pub namespace: String,
    pub uid: String,
    /// The sandbox is ready (its network set up); not ready: stopped.
    pub ready: bool,
    pub labels: HashMap<String, String>,
    pub annotations: HashMap<String, String>,
}

impl From<api::PodSandbox> for Pod {
    fn from(p: api::PodSandbox) -> Self {
        let m = p.metadata.unwrap_or_default();
        Pod {
            id: p.id,
            name: m.name,
            namespace: m.namespace,
            uid: m.uid,
            ready: p.state == api::PodSandboxState::SandboxReady as i32,
            labels: p.labels,
            annotations: p.annotations,
        }
    }
}

/// What `PodSandboxStatus` says of a pod beyond its listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodStatus {
    pub ready: bool,
    /// The pod's IP (empty with the host's network).
    pub ip: String,
    /// The host pid of the sandbox's process (the pause container), whose
    /// network namespace (`/proc/PID/ns/net`) is the pod's; from the
    /// runtime's verbose info, when it gives one.
    pub pid: Option<i32>,
}

impl PodStatus {
    pub(crate) fn new(s: api::PodSandboxStatus, info: &HashMap<String, String>) -> Self {
        PodStatus {
            ready: s.state == api::PodSandboxState::SandboxReady as i32,
            ip: s.network.map(|n| n.ip).unwrap_or_default(),
            pid: info_pid(info),
        }
    }
}

/// A container of a pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Container {
    pub id: String,
    pub pod_id: String,
    pub name: String,
    pub running: bool,
    pub labels: HashMap<String, String>,
    pub annotations: HashMap<String, String>,
}

impl From<api::Container> for Container {
    fn from(c: api::Container) -> Self {
        Container {
            id: c.id,
            pod_id: c.pod_sandbox_id,
            name: c.metadata.map(|m| m.name).unwrap_or_default(),
            running: c.state == api::ContainerState::ContainerRunning as i32,
            labels: c.labels,
            annotations: c.annotations,
        }
    }
}

/// What `ContainerStatus` says of a container beyond its listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerStatus {
    pub running: bool,
    /// The host pid of its first process, from the verbose info.
    pub pid: Option<i32>,
}

impl ContainerStatus {
    pub(crate) fn new(s: api::ContainerStatus, info: &HashMap<String, String>) -> Self {
        ContainerStatus {
            running: s.state == api::ContainerState::ContainerRunning as i32,
            pid: info_pid(info),
        }
    }
}

/// The `pid` of the verbose `info` JSON (containerd and CRI-O both put it
/// there); None when absent or not a positive number.
fn info_pid(info: &HashMap<String, String>) -> Option<i32> {
    let v: serde_json::Value = serde_json::from_str(info.get("info")?).ok()?;
    v.get("pid")?.as_i64().and_then(|p| i32::try_from(p).ok()).filter(|p| *p > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pid_comes_from_the_verbose_info() {
        let mut info = HashMap::new();
        assert_eq!(info_pid(&info), None);
        info.insert("info".to_string(), r#"{"sandboxID":"x","pid":4242,"runtimeSpec":{}}"#.to_string());
        assert_eq!(info_pid(&info), Some(4242));
        info.insert("info".to_string(), r#"{"pid":0}"#.to_string());
        assert_eq!(info_pid(&info), None);
        info.insert("info".to_string(), "not json".to_string());
        assert_eq!(info_pid(&info), None);
    }

    #[test]
    fn a_listed_pod_keeps_its_metadata_and_annotations() {
        let p = api::PodSandbox {
            id: "abc".into(),
            metadata: Some(api::PodSandboxMetadata {
                name: "vllm-0".into(),
                namespace: "models".into(),
                uid: "u".into(),
                attempt: 0,
            }),
            state: api::PodSandboxState::SandboxReady as i32,
            annotations: [("gpusnap.io/enabled".to_string(), "true".to_string())].into(),
            ..Default::default()
        };
        let p = Pod::from(p);
        assert!(p.ready);
        assert_eq!((p.namespace.as_str(), p.name.as_str()), ("models", "vllm-0"));
        assert_eq!(p.annotations["gpusnap.io/enabled"], "true");
    }
}
