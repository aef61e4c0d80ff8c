//! The pods of this node as services (`[kubernetes]`): the agent lists the
//! pod sandboxes and containers through the runtime's CRI socket, as the
//! kubelet does, and serves the pods annotated `gpusnap.io/enabled: "true"`.
//!
//! A pod's service is adopted, never started or ended by the agent: its
//! CUDA processes are those of the tree of its container's first process.
//! It is suspended when idle or through the API, resumed through the API,
//! evicted by priority and least recent use as any service; it is never
//! hibernated (a pod's disk tier is its runtime's checkpoint). No proxy
//! stands before it: clients reach the pod's own address.
//!
//! - [`annotations`] reads a pod's annotations into its service;
//! - `follow` lists the pods each `poll_interval` and adds, updates and
//!   removes their services;
//! - [`probe`] places a probe endpoint in each served pod's network
//!   namespace, for `gpusnap probe` in a pod that mounts nothing of the node.

pub mod annotations;
mod follow;
pub mod probe;

pub use follow::Follower;

use crate::service::Service;
use crate::state::Agent;
use std::net::IpAddr;
use std::sync::Arc;

/// Where a pod's traffic arrives: what a watcher of its sockets needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodEndpoint {
    /// The host pid of the pod's sandbox process: `/proc/PID/ns/net` is
    /// the pod's network namespace.
    pub sandbox_pid: Option<i32>,
    /// The host pid of the served container's first process.
    pub pid: i32,
    /// The pod's IP (None with the host's network).
    pub ip: Option<IpAddr>,
    /// The port the server listens on in the pod (`gpusnap.io/port`).
    pub port: u16,
}

impl Agent {
    /// Called once for each pod the agent starts serving: its probe
    /// endpoint ([`probe`]), and a watch of the
    /// pod's port in its network namespace (the server's own, found from
    /// its pid) counts its traffic and wakes it on a new connection or
    /// bytes on a kept-alive one (`wake_on = "socket"`, sockwake). The
    /// watch ends once `self.service(&svc.name)` is no longer `svc` (the
    /// pod is gone).
    pub fn watch_pod_sockets(self: &Arc<Self>, svc: &Arc<Service>, endpoint: &PodEndpoint) {
        tracing::debug!(service = svc.name, ?endpoint, "watching the pod's port");
        let ctl: Arc<dyn crate::control::Control> = Arc::clone(self) as _;
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                let netns_of = endpoint.sandbox_pid.unwrap_or(endpoint.pid);
                probe::spawn(self, svc, netns_of, rt.clone());
                crate::sockwake::spawn(ctl, Arc::clone(svc), rt)
            }
            Err(_) => {
                tracing::warn!(service = svc.name, "no runtime to wake the pod on: its port is not watched")
            }
        }
    }
}
