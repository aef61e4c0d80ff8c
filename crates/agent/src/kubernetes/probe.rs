//! A pod's probe endpoint, placed in the pod without a volume: the agent
//! binds the abstract unix socket `@gpusnap-probe` in the pod's network
//! namespace (abstract names belong to a network namespace), and serves on
//! it what the probe socket serves ([`crate::probe`]): one read-only
//! request about the caller's own pid namespace, the caller pinned by
//! SO_PEERPIDFD. `gpusnap probe` in the pod finds it there when no probe
//! socket is mounted, so a pod under Pod Security "baseline" (no
//! `hostPath`) still learns whether its server is suspended or cannot come
//! back.
//!
//! Only the pod's own processes reach it (each pod has its own network
//! namespace). A process of the pod that binds the name first (before the
//! agent served the pod, or while the agent restarts) only answers its own
//! pod's probes; the agent logs that it could not bind.

use crate::service::Service;
use crate::state::Agent;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

/// The abstract name (without its leading NUL) in each pod's network namespace.
pub const NAME: &str = "gpusnap-probe";

/// Connections one pod may hold on its probe endpoint at once.
const PER_POD: usize = 4;
/// Connections all the pods' probe endpoints hold at once.
const ALL_PODS: usize = 64;

static TOTAL: LazyLock<Arc<crate::limits::Cap>> = LazyLock::new(|| crate::limits::Cap::new(ALL_PODS));

/// How often an endpoint looks whether its pod is still served.
const CHECK: Duration = Duration::from_secs(1);

/// Binds `@gpusnap-probe` in the network namespace `ns` (`/proc/PID/ns/net`).
fn bind_in(ns: &std::path::Path) -> std::io::Result<std::os::unix::net::UnixListener> {
    use std::os::linux::net::SocketAddrExt;
    let bound = gpusnap_sockwatch::netns::inside(ns, || {
        let at = std::os::unix::net::SocketAddr::from_abstract_name(NAME.as_bytes());
        Ok(at.and_then(|a| std::os::unix::net::UnixListener::bind_addr(&a)))
    });
    let l = bound.map_err(std::io::Error::other)??;
    l.set_nonblocking(true)?;
    Ok(l)
}

/// Serves the probe endpoint in the pod of `svc` (network namespace of
/// host pid `pid`) until the agent no longer serves `svc`.
pub fn spawn(agent: &Arc<Agent>, svc: &Arc<Service>, pid: i32, rt: tokio::runtime::Handle) {
    let (agent, svc) = (Arc::clone(agent), Arc::clone(svc));
    rt.spawn(async move {
        let ns = std::path::PathBuf::from(format!("/proc/{pid}/ns/net"));
        let bound = tokio::task::spawn_blocking(move || bind_in(&ns)).await;
        let listener = match bound {
            Ok(Ok(l)) => l,
            Ok(Err(e)) => {
                tracing::warn!(service = svc.name, "the pod's probe endpoint @{NAME}: {e}");
                return;
            }
            Err(e) => {
                tracing::warn!(service = svc.name, "the pod's probe endpoint: {e}");
                return;
            }
        };
        let listener = match tokio::net::UnixListener::from_std(listener) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(service = svc.name, "the pod's probe endpoint: {e}");
                return;
            }
        };
        tracing::debug!(service = svc.name, "serving the pod's probe endpoint @{NAME}");
        let ctl: Arc<dyn crate::control::Control> = Arc::clone(&agent) as _;
        let bounds = crate::listen::Bounds {
            own: crate::limits::Cap::new(PER_POD),
            total: Arc::clone(&TOTAL),
            header_timeout: agent.cfg().header_timeout,
        };
        let serve = crate::listen::serve_unix(listener, crate::probe::router(ctl), bounds);
        let served = async {
            loop {
                tokio::time::sleep(CHECK).await;
                if !agent.service(&svc.name).is_some_and(|s| Arc::ptr_eq(&s, &svc)) {
                    return;
                }
            }
        };
        // The listener closes with the task: the name is free in the pod again.
        tokio::select! {
            _ = serve => {}
            _ = served => tracing::debug!(service = svc.name, "the pod is no longer served: its probe endpoint closes"),
        }
    });
}
