//! Parking a running service: its fast-swap library moves its memory to
//! pinned host memory and its CUDA context stays on the GPU (`gpusnap
//! park`). The cheapest tier: an idle server the agent started with fast
//! swap is parked rather than suspended, and an eviction parks before it
//! suspends; a parked service is suspended in full only when its residual
//! is the room needed.

use super::{quiet, PolicyError};
use crate::service::{Service, State};
use crate::state::{cuda_pids_in, Agent};
use gpusnap_core::engine::{ParkReport, SuspendReport};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What an eviction spent, for the wake trace of the service it made room for.
pub(super) struct Evicted {
    /// The library's offload (a park), or offload, lock and checkpoint.
    pub driver: Duration,
    /// Until NVML showed the memory released (a suspend).
    pub release: Duration,
    pub polls: u32,
    pub hook: Duration,
}

impl Agent {
    /// Parks `svc` when it parks ([`Service::parks`]) and the park goes
    /// through; suspends it otherwise (a server whose library refused goes
    /// the driver's way).
    pub(super) async fn park_or_suspend(
        self: &Arc<Self>,
        svc: &Arc<Service>,
        reason: &str,
    ) -> Result<(), PolicyError> {
        if svc.parks() {
            let e = match self.park(svc, reason).await {
                Ok(_) => return Ok(()),
                Err(e) => e,
            };
            let again = {
                let g = svc.lock();
                g.state == State::Running && !Service::has_traffic(&g)
            };
            if !again {
                return Err(e);
            }
            tracing::warn!(service = svc.name, "park failed ({e}): suspending instead");
        }
        self.suspend(svc, reason).await
    }

    /// Parks a running service unless traffic arrived meanwhile.
    pub(super) async fn park(
        self: &Arc<Self>,
        svc: &Arc<Service>,
        reason: &str,
    ) -> Result<Vec<ParkReport>, PolicyError> {
        {
            let mut g = svc.lock();
            if g.state != State::Running {
                return Err(PolicyError::not_in_state(svc, g.state));
            }
            if Service::has_traffic(&g) {
                return Err(PolicyError::has_traffic(svc));
            }
            // Connections arriving meanwhile wait, as for a suspend.
            svc.set_state(&mut g, State::Suspending);
        }
        self.journal(svc, None, &format!("park: {reason}"));
        let started = Instant::now();
        let (a, s) = (Arc::clone(self), Arc::clone(svc));
        let r =
            tokio::task::spawn_blocking(move || a.park_blocking(&s)).await.unwrap_or_else(|e| Err(e.into()));
        self.metrics().transition(&svc.name, "park", r.is_ok(), started.elapsed().as_secs_f64());
        {
            let mut g = svc.lock();
            match &r {
                Ok(_) => svc.set_state(&mut g, State::Parked),
                Err(e) => {
                    g.last_error = Some(e.to_string());
                    g.last_activity = Instant::now();
                    // The engine leaves a process as it found it when it fails.
                    svc.set_state(&mut g, State::Running);
                }
            }
        }
        match &r {
            Ok(reports) => {
                let host: u64 = reports.iter().map(|r| r.host_bytes).sum();
                let left: u64 = reports.iter().map(|r| r.residual_bytes).sum();
                self.journal(
                    svc,
                    None,
                    &format!("parked: {} MiB in host memory, {} MiB stay on the GPU", host >> 20, left >> 20),
                );
            }
            Err(e) => self.journal(svc, None, &format!("park failed: {e}")),
        }
        r
    }

    fn park_blocking(&self, svc: &Service) -> Result<Vec<ParkReport>, PolicyError> {
        let root = svc.lock().process.clone().ok_or(PolicyError::NoProcess)?;
        let mut e = self.engine()?;
        let pids = cuda_pids_in(Some(&mut e), root.pid);
        if pids.is_empty() {
            return Err(PolicyError::NoCudaProcess(root.pid));
        }
        Ok(e.park_group(&pids, &quiet)?)
    }

    /// Evicts `v`: a running service that parks is parked; any other is
    /// suspended (a parked one in full: its residual is the room needed).
    pub(super) async fn evict(
        self: &Arc<Self>,
        v: &Arc<Service>,
        reason: &str,
    ) -> Result<Evicted, PolicyError> {
        if v.lock().state == State::Running && v.parks() {
            let reports = self.park(v, reason).await?;
            let driver = reports.iter().map(|r| r.offload_ms).max().unwrap_or(0);
            return Ok(Evicted {
                driver: Duration::from_millis(driver),
                release: Duration::ZERO,
                polls: 0,
                hook: Duration::ZERO,
            });
        }
        let (reports, hook) = self.suspend_reports(v, reason).await?;
        let max =
            |f: fn(&SuspendReport) -> u64| Duration::from_millis(reports.iter().map(f).max().unwrap_or(0));
        Ok(Evicted {
            driver: max(|r| r.offload_ms + r.lock_ms + r.checkpoint_ms),
            release: max(|r| r.release_ms),
            polls: reports.iter().map(|r| r.release_polls).sum(),
            hook,
        })
    }

    /// Whether every CUDA process of `svc` is parked now (a resume whose
    /// copy back was refused leaves it so).
    pub(super) fn parked_now(&self, svc: &Service) -> bool {
        let Some(root) = svc.lock().process.as_ref().map(|t| t.pid) else { return false };
        let Ok(mut e) = self.engine() else { return false };
        let pids = cuda_pids_in(Some(&mut e), root);
        !pids.is_empty()
            && pids.iter().all(|p| e.look(*p).is_ok_and(|r| r.state == gpusnap_core::store::PARKED))
    }
}
