//! The per-service proxies' listeners, kept by service name: bound at the
//! agent's start, and by a reload for a new service or a changed `listen`;
//! let go (the port closed) when the service is removed or moved.

use crate::control::Control;
use crate::limits::Cap;
use crate::service::Service;
use crate::state::Agent;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// How a proxy is served: the agent's total connection cap and the
/// header timeout.
pub(super) struct Doors {
    total: Arc<Cap>,
    header_timeout: Duration,
}

/// One service's proxy: its address and the task that accepts on it.
pub(super) struct Proxy {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Agent {
    /// How proxies are served from now on (the daemon, once).
    pub fn set_doors(&self, total: Arc<Cap>, header_timeout: Duration) {
        let _ = self.reloading.doors.set(Doors { total, header_timeout });
    }

    /// Serves `svc`'s proxy on `listener` (bound to its `listen`).
    pub fn serve_proxy(self: &Arc<Self>, svc: &Arc<Service>, listener: tokio::net::TcpListener) {
        let Some(d) = self.reloading.doors.get() else { return };
        let Some(addr) = svc.cfg.listen.as_ref().map(|l| *l.get_ref()) else { return };
        let bounds = crate::listen::Bounds {
            own: Cap::new(svc.cfg.max_connections),
            total: Arc::clone(&d.total),
            header_timeout: d.header_timeout,
        };
        let ctl: Arc<dyn Control> = Arc::clone(self) as Arc<dyn Control>;
        let task = tokio::spawn(crate::proxy::serve(ctl, svc.name.clone(), addr, listener, bounds));
        let old = self
            .reloading
            .proxies
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(svc.name.clone(), Proxy { addr, task });
        if let Some(old) = old {
            old.task.abort();
        }
    }

    /// Binds `svc`'s `listen` unless its proxy is there already.
    pub(super) async fn open_proxy(self: &Arc<Self>, svc: &Arc<Service>) -> Result<(), String> {
        let Some(addr) = svc.cfg.listen.as_ref().map(|l| *l.get_ref()) else { return Ok(()) };
        if self.proxy_at(&svc.name) == Some(addr) {
            return Ok(());
        }
        self.close_proxy(&svc.name).await;
        let l = tokio::net::TcpListener::bind(addr).await.map_err(|e| format!("listen {addr}: {e}"))?;
        self.serve_proxy(svc, l);
        Ok(())
    }

    /// Where `name`'s proxy listens, if it has one.
    pub(super) fn proxy_at(&self, name: &str) -> Option<SocketAddr> {
        self.reloading.proxies.lock().unwrap_or_else(|e| e.into_inner()).get(name).map(|p| p.addr)
    }

    /// Closes `name`'s proxy: its port is free once this returns.
    /// Connections already accepted go on.
    pub(super) async fn close_proxy(&self, name: &str) {
        let p = self.reloading.proxies.lock().unwrap_or_else(|e| e.into_inner()).remove(name);
        if let Some(p) = p {
            p.task.abort();
            let _ = p.task.await;
        }
    }
}
