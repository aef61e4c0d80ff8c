//! Hibernating a service the agent started: its tree dumped by CRIU to an
//! image, off the GPU and out of host memory.

use super::LOCK_TIMEOUT_MS;
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
/// The longest a hibernation waits for the front door's idle backend
/// connections to close (each closes as soon as its task sees the change).
const POOL_CLOSE: Duration = Duration::from_secs(10);

impl Agent {
    /// Hibernates a suspended service with no open connection.
    pub(super) async fn hibernate(self: &Arc<Self>, svc: &Arc<Service>, reason: &str) -> Result<(), String> {
        {
            let mut g = svc.lock();
            if !matches!(g.state, State::Suspended | State::Running) {
                return Err(format!("{} is {}", svc.name, g.state.as_str()));
            }
            // Hibernating ends the process and CRIU brings it back as a
            // child of the agent: a server adopted from its owner (systemd,
            // a container runtime) would be taken from it. It stays suspended.
            if svc.cfg.adopted() {
                return Err(format!(
                    "{} was adopted (pid_file/cgroup), not started by the agent: it is never hibernated",
                    svc.name
                ));
            }
            // CRIU cannot take the backend's half of an open connection along.
            if !g.conns.is_empty() || g.waiting > 0 {
                return Err(format!("{} has open connections", svc.name));
            }
            g.ending_on_purpose = true;
            svc.set_state(&mut g, State::Hibernating);
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
            .unwrap_or_else(|e| Err(e.to_string()));
        self.metrics().transition(&svc.name, "hibernate", r.is_ok(), started.elapsed().as_secs_f64());
        let mut g = svc.lock();
        match &r {
            Ok(image) => {
                g.image = Some(image.clone());
                svc.set_state(&mut g, State::Hibernated);
            }
            Err(e) => {
                g.ending_on_purpose = false;
                g.last_error = Some(e.clone());
                g.hibernate_not_before = Some(Instant::now() + HIBERNATE_RETRY);
                let back = match g.process.as_ref().map(|t| self.cuda_pids(t.pid)) {
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

    fn hibernate_blocking(&self, svc: &Service) -> Result<String, String> {
        let (root, kept) = {
            let g = svc.lock();
            (g.process.clone().ok_or("no process")?, g.image.clone())
        };
        let name = super::image_name(&svc.name);
        // One the service still keeps (woken, not yet resumed) stays: this
        // hibernation waits for a later try. One left from an earlier
        // hibernation whose process runs again (a wake removes it; this
        // catches one that could not) goes.
        if kept.as_deref() == Some(name.as_str()) {
            return Err(format!("{name} is kept until the process it was woken into runs"));
        }
        if self.images().manifest(&name).is_ok() {
            self.images().remove(&name).map_err(|e| format!("{name}: an older image is in the way: {e}"))?;
        }
        {
            svc.lock().image = Some(name.clone());
        }
        self.persist_doing(svc, "hibernate");
        let mut e = self.engine().map_err(|e| e.to_string())?;
        let criu = self.criu().map_err(|e| e.to_string())?;
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
        let detached = gpusnap_guard::detach_for(self.state_dir(), &tree).map_err(|e| e.to_string())?;
        match e.hibernate(&criu, self.images(), root.pid, &opts) {
            Ok(r) => Ok(r.image),
            Err(err) => {
                svc.lock().image = None;
                self.start_guard(
                    &detached.into_iter().filter(|p| target::resolve(*p).is_ok()).collect::<Vec<_>>(),
                );
                Err(err.to_string())
            }
        }
    }

    fn all_checkpointed(&self, pids: &[i32]) -> bool {
        let Ok(mut e) = self.engine() else { return false };
        pids.iter().all(|p| e.state(*p).is_ok_and(|s| s.state == "checkpointed"))
    }
}
