//! Suspending a running service (idle, evicted, or asked through the API),
//! with its before_suspend hook, and suspending it again when its
//! after_resume hook failed.

use super::{quiet, PolicyError, LOCK_TIMEOUT_MS};
use crate::service::{Service, State};
use crate::state::{cuda_pids_in, Agent};
use gpusnap_core::engine::SuspendReport;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What the service record says while a before_suspend hook may have run
/// and the checkpoint is not done.
pub(super) const HOOKED_SUSPEND: &str = "hooked suspend";

impl Agent {
    /// Suspends a running service unless traffic arrived meanwhile.
    pub(super) async fn suspend(
        self: &Arc<Self>,
        svc: &Arc<Service>,
        reason: &str,
    ) -> Result<(), PolicyError> {
        self.suspend_reports(svc, reason).await.map(|_| ())
    }

    /// An after_resume hook failed: the server runs but did not take its
    /// memory back (or answers no more). It is suspended again, off the
    /// GPU, and the connections that waited for it get a 503 (the proxy);
    /// the next connection tries a resume (and the hook) again.
    pub(super) async fn after_resume_failed(self: &Arc<Self>, svc: &Arc<Service>, what: &str) {
        {
            let mut g = svc.lock();
            g.last_error = Some(format!("after_resume hook: {what}"));
            g.hook_failures += 1;
            svc.set_state(&mut g, State::Suspending);
        }
        self.journal(
            svc,
            None,
            &format!("after_resume hook failed: {what}; suspended again, waiting connections get 503"),
        );
        let (a, s) = (Arc::clone(self), Arc::clone(svc));
        let r = tokio::task::spawn_blocking(move || a.suspend_blocking(&s))
            .await
            .unwrap_or_else(|e| Err(e.into()));
        {
            let mut g = svc.lock();
            match r {
                Ok(_) => svc.set_state(&mut g, State::Suspended),
                Err(e) => {
                    // Left running as the engine found it: the next idle tick
                    // or eviction suspends it (its hook runs then).
                    g.last_error = Some(format!("after_resume hook: {what}; suspending again failed: {e}"));
                    g.last_activity = Instant::now();
                    svc.set_state(&mut g, State::Running);
                }
            }
        }
        let a = Arc::clone(self);
        let _ = tokio::task::spawn_blocking(move || a.persist()).await;
    }

    /// [`Self::suspend`], with the engine's reports (lock, checkpoint and
    /// release times per process) and the time its before_suspend hook took.
    pub(super) async fn suspend_reports(
        self: &Arc<Self>,
        svc: &Arc<Service>,
        reason: &str,
    ) -> Result<(Vec<SuspendReport>, Duration), PolicyError> {
        // A parked service is suspended in full (its residual is the room
        // needed); a failure leaves it parked.
        let from = {
            let mut g = svc.lock();
            let from = g.state;
            if !matches!(from, State::Running | State::Parked) {
                return Err(PolicyError::not_in_state(svc, g.state));
            }
            if Service::has_traffic(&g) {
                return Err(PolicyError::has_traffic(svc));
            }
            svc.set_state(&mut g, State::Suspending);
            from
        };
        let thp = if svc.cfg.thp.unwrap_or(self.cfg().thp) { " (THP always for its checkpoint)" } else { "" };
        self.journal(svc, None, &format!("suspend: {reason}{thp}"));
        let started = Instant::now();
        // Suspending: connections arriving meanwhile wait, as for the suspend.
        let mut hook_ok = None;
        if let Some(hook) = svc.cfg.hooks.before_suspend.as_ref().map(|h| h.get_ref()) {
            // What it holds before it gives anything back: its size once
            // its after_resume hook has run. Recorded with the hooked
            // suspend under way before the hook runs: an agent killed
            // between the hook and the checkpoint leaves a server that
            // runs but gave its memory back, and the next one must call
            // after_resume when it adopts it.
            let (a, s) = (Arc::clone(self), Arc::clone(svc));
            let _ = tokio::task::spawn_blocking(move || {
                if let Some(used) = a.gpu_usage(&s) {
                    s.lock().full_footprint = Some(used);
                }
                a.persist_doing(&s, HOOKED_SUSPEND);
            })
            .await;
            let out = crate::hooks::call(svc.cfg.backend, hook).await;
            self.metrics().transition(&svc.name, "hook_suspend", out.ok(), out.took.as_secs_f64());
            if out.ok() {
                self.journal(svc, None, &format!("before_suspend hook: {}", out.describe(hook)));
            } else {
                // An optimisation, never a reason to keep the GPU busy.
                self.journal(
                    svc,
                    None,
                    &format!("before_suspend hook failed: {}; suspending anyway", out.describe(hook)),
                );
            }
            hook_ok = Some(out.ok());
        }
        let hook_time = started.elapsed();
        let (a, s) = (Arc::clone(self), Arc::clone(svc));
        let r = tokio::task::spawn_blocking(move || a.suspend_blocking(&s))
            .await
            .unwrap_or_else(|e| Err(e.into()));
        // The server gave its memory back but stays on the GPU: it takes it
        // again before it serves.
        if let (Err(_), Some(true), Some(hook)) =
            (&r, hook_ok, svc.cfg.hooks.after_resume.as_ref().map(|h| h.get_ref()))
        {
            let out = crate::hooks::call(svc.cfg.backend, hook).await;
            self.metrics().transition(&svc.name, "hook_resume", out.ok(), out.took.as_secs_f64());
            self.journal(
                svc,
                None,
                &format!("the suspend failed: after_resume hook: {}", out.describe(hook)),
            );
        }
        let ok = r.is_ok();
        // The hook is timed on its own (hook_suspend).
        self.metrics().transition(&svc.name, "suspend", ok, (started.elapsed() - hook_time).as_secs_f64());
        {
            let mut g = svc.lock();
            match &r {
                Ok(reports) => {
                    let bytes: u64 = reports.iter().map(|r| r.footprint_bytes).sum();
                    if bytes > 0 {
                        g.footprint = Some(bytes);
                    }
                    svc.set_state(&mut g, State::Suspended)
                }
                Err(e) => {
                    g.last_error = Some(e.to_string());
                    // Not again before another suspend_after.
                    g.last_activity = Instant::now();
                    // The engine leaves a process as it found it when it fails.
                    svc.set_state(&mut g, from);
                }
            }
        }
        if let Err(e) = &r {
            self.journal(svc, None, &format!("suspend failed: {e}"));
        }
        if hook_ok.is_some() {
            let a = Arc::clone(self);
            let _ = tokio::task::spawn_blocking(move || a.persist()).await;
        }
        r.map(|reports| (reports, hook_time))
    }

    fn suspend_blocking(&self, svc: &Service) -> Result<Vec<SuspendReport>, PolicyError> {
        let root = svc.lock().process.clone().ok_or(PolicyError::NoProcess)?;
        let mut e = self.engine()?;
        let pids = cuda_pids_in(Some(&mut e), root.pid);
        if pids.is_empty() {
            return Err(PolicyError::NoCudaProcess(root.pid));
        }
        let _thp = self.thp_for(svc)?;
        Ok(e.suspend_group(&pids, LOCK_TIMEOUT_MS, &quiet)?)
    }

    /// What the service's processes hold on the GPU now (NVML), if known.
    fn gpu_usage(&self, svc: &Service) -> Option<u64> {
        let root = svc.lock().process.as_ref().map(|t| t.pid)?;
        let mut e = self.engine().ok()?;
        let pids = cuda_pids_in(Some(&mut e), root);
        let procs = e.gpus().processes().ok()?;
        let used: u64 = procs.iter().filter(|p| pids.contains(&(p.pid as i32))).filter_map(|p| p.bytes).sum();
        (used > 0).then_some(used)
    }

    /// THP `always` for the length of a checkpoint, when the service wants
    /// it (core's `--thp`: the previous mode is journaled in the state
    /// directory and put back after, or by the next gpusnap after a crash).
    pub(super) fn thp_for(&self, svc: &Service) -> Result<Option<gpusnap_core::thp::Always>, PolicyError> {
        if !svc.cfg.thp.unwrap_or(self.cfg().thp) {
            return Ok(None);
        }
        Ok(gpusnap_core::thp::Always::on(self.state_dir()).map(Some)?)
    }
}
