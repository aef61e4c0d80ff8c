//! `[kubernetes]`: the pods of this node, found through the container
//! runtime's CRI socket, served besides the `[[service]]`s.

use crate::units::duration;
use serde::Deserialize;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesConfig {
    /// The runtime's CRI socket (containerd's, CRI-O's).
    pub cri_socket: PathBuf,
    /// How often the pods and containers are listed anew.
    #[serde(default = "default_poll_interval", deserialize_with = "duration")]
    pub poll_interval: Duration,
    /// How long one CRI call may take.
    #[serde(default = "default_cri_timeout", deserialize_with = "duration")]
    pub cri_timeout: Duration,
    /// The node's own addresses: connections from them (the kubelet's
    /// probes) neither wake a pod nor count as its traffic. Empty: the
    /// addresses of the agent's own network namespace.
    #[serde(default)]
    pub node_addresses: Vec<IpAddr>,
    /// The highest `gpusnap.io/priority` a pod's annotation may ask: a
    /// higher one is lowered to it (a tenant cannot put its pod above the
    /// node's own services).
    #[serde(default = "default_max_priority")]
    pub max_priority: i64,
}

fn default_max_priority() -> i64 {
    1_000_000
}

fn default_poll_interval() -> Duration {
    Duration::from_secs(2)
}

fn default_cri_timeout() -> Duration {
    Duration::from_secs(5)
}

/// The pod a service was made for (no `[[service]]` of the file): the
/// agent adopts the process of its container, never starts or ends it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// The runtime's id of the pod's sandbox.
    pub sandbox_id: String,
    /// The container whose processes are the service's.
    pub container: String,
}
