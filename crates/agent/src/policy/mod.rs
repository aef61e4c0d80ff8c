//! What the agent decides and how it carries it out: start, suspend when
//! idle, resume on demand (evicting idle services when the GPU is full),
//! hibernate under host-memory pressure or after `hibernate_after`, wake,
//! restart a service that died. Every transition goes through the core
//! `Engine` (journal, admission, locks); every decision is journaled with its
//! reason as an `agent` note on the service's process.
//!
//! - `tick`: the periodic decisions;
//! - `demand`: a service brought back for a connection or the API;
//! - `room`: room on the GPU (evictions, waiting for memory);
//! - `suspend`, `hibernate`: taking a service off the GPU, out of memory;
//! - `lifecycle`: start, stop, restart, death;
//! - `adopt`: the services found again after the agent restarted.
//!
//! The policy works on the state through [`Agent`]'s methods, and serves
//! the API and the proxies through [`Control`].

mod adopt;
mod demand;
mod error;
mod fallback;
mod hibernate;
mod lifecycle;
mod park;
mod room;
mod suspend;
mod tick;

pub use error::PolicyError;
pub use fallback::image_name;

use crate::control::{Action, Control, Pending, Refusal, Unavailable};
use crate::metrics::Metrics;
use crate::service::{Service, State};
use crate::state::Agent;
use gpusnap_core::engine::StateReport;
use std::sync::Arc;
use std::time::Instant;

const LOCK_TIMEOUT_MS: u32 = 30_000;

fn quiet() -> Box<dyn gpusnap_core::Progress> {
    Box::new(gpusnap_core::Quiet)
}

impl Control for Agent {
    fn api_group(&self) -> Option<&str> {
        self.cfg().group.as_ref().map(|g| g.get_ref().as_str())
    }

    fn services(&self) -> Arc<Vec<Arc<Service>>> {
        Agent::services(self)
    }

    fn metrics(&self) -> &Metrics {
        Agent::metrics(self)
    }

    fn wait_running(
        self: Arc<Self>,
        svc: Arc<Service>,
        deadline: Instant,
        accepted: Option<Instant>,
    ) -> Pending<Result<bool, Unavailable>> {
        Box::pin(
            async move { self.ensure_running(&svc, deadline, accepted, demand::Asker::Connection).await },
        )
    }

    fn hopeless(&self, svc: &Service) -> Option<Refusal> {
        Agent::hopeless(self, svc)
    }

    fn act(self: Arc<Self>, svc: Arc<Service>, action: Action) -> Pending<Result<(), PolicyError>> {
        Box::pin(async move {
            let why = "asked through the API";
            // Asking for the state a service is already in succeeds, as a
            // resume of a running one does.
            let state = svc.lock().state;
            match action {
                Action::Suspend if matches!(state, State::Suspended | State::Hibernated) => Ok(()),
                Action::Park if matches!(state, State::Parked | State::Suspended | State::Hibernated) => {
                    Ok(())
                }
                Action::Park => self.park(&svc, why).await.map(|_| ()),
                Action::Hibernate if state == State::Hibernated => Ok(()),
                Action::Suspend => self.suspend(&svc, why).await,
                Action::Hibernate => self.hibernate(&svc, why).await,
                Action::Resume | Action::Wake => {
                    // What the front door would answer at once (a start
                    // failing, its next not due): answered so here too.
                    if let Some(r) = Agent::hopeless(&self, &svc) {
                        return Err(PolicyError::Unavailable(r.reason));
                    }
                    let deadline = Instant::now() + svc.cfg.wake_timeout;
                    self.ensure_running(&svc, deadline, None, demand::Asker::Api)
                        .await
                        .map(|_| ())
                        .map_err(|e| PolicyError::Unavailable(e.0))
                }
                Action::Restart => self.restart(&svc).await,
            }
        })
    }

    fn processes(&self) -> Result<Vec<StateReport>, gpusnap_hibernate::Error> {
        self.engine().and_then(|e| e.look_all().map_err(Into::into))
    }

    fn look(&self, pids: &[i32]) -> Result<Vec<StateReport>, gpusnap_hibernate::Error> {
        use gpusnap_core::Error as E;
        let e = self.engine()?;
        let mut out = Vec::new();
        for &pid in pids {
            match e.look(pid) {
                Ok(r) => out.push(r),
                Err(E::NotCuda { .. } | E::NoProcess { .. } | E::Zombie { .. }) => {}
                Err(err) => return Err(err.into()),
            }
        }
        Ok(out)
    }

    fn journal_store(&self) -> Result<gpusnap_core::Store, gpusnap_core::Error> {
        gpusnap_core::Store::open(self.state_dir())
    }

    fn metrics_text(&self, openmetrics: bool) -> String {
        self.refresh_gauges();
        if openmetrics {
            Agent::metrics(self).encode_openmetrics()
        } else {
            Agent::metrics(self).encode()
        }
    }

    fn note(&self, svc: &Service, what: &str) {
        self.journal(svc, None, what);
    }

    fn reload(self: Arc<Self>, stop_removed: bool) -> Pending<Result<crate::reload::Outcome, String>> {
        Box::pin(async move { Agent::reload(&self, stop_removed).await })
    }

    fn log_path(&self, svc: &Service) -> std::path::PathBuf {
        crate::logs::path(self.state_dir(), &svc.name)
    }

    fn held(&self, svc: &Service) -> crate::held::Held {
        self.held_by(svc)
    }
}
