//! Hibernating a service the agent started: its tree dumped by CRIU to an
//! image, off the GPU and out of host memory.

use super::{PolicyError, LOCK_TIMEOUT_MS};
use crate::service::{Service, State};
use crate::state::Agent;
use gpusnap_core::target;
use gpusnap_core::tree::process_tree;
use gpusnap_hibernate::Hibernate;
use gpusnap_hibernate::HibernateOptions;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// After a failed hibernation, the policy waits this long before another.
const HIBERNATE_RETRY: Duration = Duration::from_secs(60);
/// How long the idle connections of a service to hibernate may take to close.
const CLOSE_IDLE: Duration = Duration::from_secs(10);
/// The longest a hibernation waits for the front door's idle backend
/// connections to close (each closes as soon as its task sees the change).
const POOL_CLOSE: Duration = Duration::from_secs(10);

impl Agent {
    /// Hibernates a suspended service with no request in flight (its idle
    /// connections are closed).
    pub(super) async fn hibernate(
        self: &Arc<Self>,
        svc: &Arc<Service>,
        reason: &str,
    ) -> Result<(), PolicyError> {
        let before = {
            let mut g = svc.lock();
            if !matches!(g.state, State::Suspended | State::Parked | State::Running) {
                return Err(PolicyError::not_in_state(svc, g.state));
            }
            // Hibernating ends the process and CRIU brings it back as a
            // child of the agent: a server adopted from its owner (systemd,
            // a container runtime) would be taken from it. It stays suspended.
            if svc.cfg.adopted() {
                return Err(PolicyError::AdoptedNotHibernated { service: svc.name.clone() });
            }
            if Service::has_traffic(&g) {
                return Err(PolicyError::has_traffic(svc));
            }
            let before = g.state;
            g.ending_on_purpose = true;
            svc.set_state(&mut g, State::Hibernating);
            before
        };
        // CRIU cannot take the backend's half of an open connection along:
        // the proxy closes the idle ones as it sees the service hibernate.
        if let Err(e) = self.close_idle_connections(svc).await {
            let mut g = svc.lock();
            g.ending_on_purpose = false;
            svc.set_state(&mut g, before);
            return Err(e);
        }
        self.journal(svc, None, &format!("hibernate: {reason}"));
        let started = Instant::now();
        // The front door's kept backend connections close as the service
        // leaves `running`, each in its own task: CRIU's dump waits for
        // them (it cannot take the server's half of one along). Bounded:
        // one still open then fails the dump, which says so.
        let mut kept = svc.backend_conns.subscribe();
        let closed = async { kept.wait_for(|n| *n == 0).await.is_ok() };
        if tokio::time::timeout(POOL_CLOSE, closed).await.is_err() {
            tracing::warn!(service = svc.name, "backend connections still open after {POOL_CLOSE:?}");
        }
        let (a, s) = (Arc::clone(self), Arc::clone(svc));
        let r = tokio::task::spawn_blocking(move || a.hibernate_blocking(&s))
            .await
            .unwrap_or_else(|e| Err(e.into()));
        self.metrics().transition(&svc.name, "hibernate", r.is_ok(), started.elapsed().as_secs_f64());
        // A parked service whose hibernate failed before its suspend is
        // parked still.
        let parked = r.is_err() && before == State::Parked && self.parked_now(svc);
        let mut g = svc.lock();
        match &r {
            Ok(image) => {
                g.image = Some(image.clone());
                svc.set_state(&mut g, State::Hibernated);
            }
            Err(e) => {
                g.ending_on_purpose = false;
                g.last_error = Some(e.to_string());
                g.hibernate_not_before = Some(Instant::now() + HIBERNATE_RETRY);
                let back = match g.process.as_ref().map(|t| self.cuda_pids(t.pid)) {
                    _ if parked => State::Parked,
                    Some(p) if !p.is_empty() && self.all_checkpointed(&p) => State::Suspended,
                    _ => State::Running,
                };
                svc.set_state(&mut g, back);
            }
        }
        drop(g);
        self.persist();
        match r {
            Ok(image) => {
                self.journal(svc, None, &format!("hibernated to {image}"));
                self.spawn_push(svc, image);
                Ok(())
            }
            Err(e) => {
                self.journal(svc, None, &format!("hibernate failed: {e}"));
                Err(e)
            }
        }
    }

    fn hibernate_blocking(&self, svc: &Service) -> Result<String, PolicyError> {
        let (root, kept) = {
            let g = svc.lock();
            (g.process.clone().ok_or(PolicyError::NoProcess)?, g.image.clone())
        };
        let name = super::image_name(&svc.name);
        // One the service still keeps (woken, not yet resumed) stays: this
        // hibernation waits for a later try. One left from an earlier
        // hibernation whose process runs again (a wake removes it; this
        // catches one that could not) goes.
        if kept.as_deref() == Some(name.as_str()) {
            return Err(PolicyError::ImageKept(name));
        }
        if self.images().manifest(&name).is_ok() {
            self.images()
                .remove(&name)
                .map_err(|e| PolicyError::ImageInTheWay { name: name.clone(), source: e.into() })?;
        }
        {
            svc.lock().image = Some(name.clone());
        }
        self.persist_doing(svc, "hibernate");
        let mut e = self.engine()?;
        let criu = self.criu()?;
        let opts = HibernateOptions {
            name: Some(name),
            leave_running: false,
            lock_timeout_ms: LOCK_TIMEOUT_MS,
            durable: true,
            big_pipes: false,
            // A map file is a second page-cache copy of the host copies: the
            // agent hibernates to free host memory, so it builds none.
            map: false,
        };
        // A running service is suspended first by the hibernate: that
        // checkpoint is sped up as a suspend's is.
        let pids = self.cuda_pids(root.pid);
        let _thp = if self.all_checkpointed(&pids) { None } else { self.thp_for(svc)? };
        // CRIU must be the tree's only tracer: a traced guard (attached after
        // an earlier wake) lets go first, and comes back if the tree stays.
        let tree: Vec<i32> = process_tree(root.pid).into_iter().map(|(p, _)| p).collect();
        let detached = gpusnap_guard::detach_for(self.state_dir(), &tree)?;
        match e.hibernate(&criu, self.images(), root.pid, &opts) {
            Ok(r) => Ok(r.image),
            Err(err) => {
                svc.lock().image = None;
                self.start_guard(
                    &detached.into_iter().filter(|p| target::resolve(*p).is_ok()).collect::<Vec<_>>(),
                    svc.cfg.on_fault,
                );
                Err(err.into())
            }
        }
    }

    /// Waits (bounded) until no connection of `svc` holds a connection to
    /// its backend: the proxy closes the idle ones when the service enters
    /// `hibernating`, and a new one waits for the service to come back.
    async fn close_idle_connections(&self, svc: &Service) -> Result<(), PolicyError> {
        let deadline = Instant::now() + CLOSE_IDLE;
        let port = svc.cfg.backend.port();
        loop {
            // Ours closed, and the server's ends too (it reads the end of
            // each and closes it itself, a moment later).
            let ours = svc.lock().conns.values().filter(|c| c.backend).count();
            let open = if ours > 0 { ours } else { open_tcp_on(port) };
            if open == 0 {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(PolicyError::ConnectionsOpen(open));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn all_checkpointed(&self, pids: &[i32]) -> bool {
        let Ok(mut e) = self.engine() else { return false };
        pids.iter().all(|p| e.state(*p).is_ok_and(|s| s.state == "checkpointed"))
    }
}

/// TCP connections of this host whose local port is `port`, other than a
/// listener and those past their close (TIME_WAIT): what CRIU would find
/// established or half closed in the server (/proc/net/tcp and tcp6).
fn open_tcp_on(port: u16) -> usize {
    const LISTEN: &str = "0A";
    const TIME_WAIT: &str = "06";
    const CLOSE: &str = "07";
    let mut n = 0;
    for f in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(f) else { continue };
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(st)) = (cols.get(1), cols.get(3)) else { continue };
            let lport = local.rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok());
            if lport == Some(port) && ![LISTEN, TIME_WAIT, CLOSE].contains(st) {
                n += 1;
            }
        }
    }
    n
}
