//! The reload itself: the file read and checked again, then each service
//! added, removed, changed or left as it is (see the module above).

use super::diff;
use crate::config::{Config, ServiceConfig, Start, WakeOn};
use crate::service::{Service, State};
use crate::state::Agent;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::Arc;

/// What a reload did to one service.
#[derive(Debug, Clone, Serialize)]
pub struct Change {
    pub service: String,
    /// `added`, `removed` or `changed`.
    pub change: &'static str,
    /// What was done: `started`, `idle` (started by its first request),
    /// `adopted`, `left_running` (removed, no longer managed), `stopped`,
    /// `restarted`, `pending` (restarted once idle), `failed`.
    pub done: &'static str,
    /// The same, in words.
    pub detail: String,
    /// A changed service: the keys that changed.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub keys: Vec<String>,
}

/// A process that does not run as its config now says (config drift).
#[derive(Debug, Clone, Serialize)]
pub struct DriftSeen {
    pub service: String,
    pub pid: Option<i32>,
    pub drift: String,
}

/// What a reload did, as `POST /v1/reload` answers it.
#[derive(Debug, Default, Serialize)]
pub struct Outcome {
    pub changes: Vec<Change>,
    pub unchanged: Vec<String>,
    /// Keys of `[agent]` or `[kubernetes]` that changed: read at start
    /// only, they apply once the agent is restarted.
    pub needs_agent_restart: Vec<String>,
    /// The processes whose command or settings differ from the config.
    pub drift: Vec<DriftSeen>,
}

fn change(service: &str, change: &'static str, done: &'static str, detail: String) -> Change {
    Change { service: service.to_string(), change, done, detail, keys: Vec::new() }
}

impl Agent {
    /// Reads the config file again and applies it; a config that does not
    /// parse or check is refused (the error, one line) and nothing changes.
    /// `stop_removed`: the removed services are stopped rather than left
    /// running.
    pub async fn reload(self: &Arc<Self>, stop_removed: bool) -> Result<Outcome, String> {
        let _one = self.reloading.one.lock().await;
        let r = self.reload_locked(stop_removed).await;
        let result = if r.is_ok() { "ok" } else { "refused" };
        self.metrics().reloads.get_or_create(&crate::metrics::ResultLabels { result: result.into() }).inc();
        match &r {
            Err(e) => tracing::error!("reload refused, the config in use is kept: {e}"),
            Ok(o) => {
                for c in &o.changes {
                    tracing::info!(service = c.service, done = c.done, "reload: {}: {}", c.change, c.detail);
                }
                if !o.needs_agent_restart.is_empty() {
                    tracing::warn!(
                        "reload: {} changed: read at start only, applied once the agent is restarted",
                        o.needs_agent_restart.join(", ")
                    );
                }
                for d in &o.drift {
                    tracing::warn!(service = d.service, pid = d.pid, "{}", d.drift);
                }
                tracing::info!(
                    changes = o.changes.len(),
                    unchanged = o.unchanged.len(),
                    "reloaded the config"
                );
            }
        }
        r
    }

    async fn reload_locked(self: &Arc<Self>, stop_removed: bool) -> Result<Outcome, String> {
        let Some(path) = self.reloading.path.clone() else {
            return Err("the agent was started without a config file to read again".into());
        };
        let new = tokio::task::spawn_blocking(move || Config::load(&path))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
        let news = diff::services(&new.raw);
        let served = self.reloading.served.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let d = diff::diff(&served, &news);
        if let Some(name) = d.added.iter().find(|n| self.service(n).is_some()) {
            return Err(format!("service {name:?}: the name is taken by a pod of the node"));
        }
        let mut cfgs: BTreeMap<String, ServiceConfig> =
            new.service.into_iter().map(|c| (c.name.get_ref().clone(), c)).collect();
        let mut out = Outcome {
            needs_agent_restart: diff::agent_keys(&self.reloading.started, &new.raw),
            unchanged: d.unchanged,
            ..Default::default()
        };
        // A change still waiting is replaced by what the file says now.
        self.reloading.pending.lock().unwrap_or_else(|e| e.into_inner()).clear();
        // The removed first: their ports may be the new services'.
        for name in &d.removed {
            out.changes.push(self.drop_service(name, stop_removed).await);
        }
        for (name, keys) in d.changed {
            let (Some(cfg), Some(raw)) = (cfgs.remove(&name), news.get(&name).cloned()) else { continue };
            let mut c = self.change_service(cfg, raw).await;
            c.keys = keys;
            out.changes.push(c);
        }
        for name in &d.added {
            let (Some(cfg), Some(raw)) = (cfgs.remove(name), news.get(name).cloned()) else { continue };
            out.changes.push(self.new_service(cfg, raw).await);
        }
        out.drift = self.drift_seen();
        self.persist();
        Ok(out)
    }

    /// A service the file no longer names: no longer served, its process
    /// left running or (`stop`) stopped.
    async fn drop_service(self: &Arc<Self>, name: &str, stop: bool) -> Change {
        self.reloading.served.lock().unwrap_or_else(|e| e.into_inner()).remove(name);
        let Some(svc) = self.remove_service(name) else {
            return change(name, "removed", "stopped", "it was gone already".into());
        };
        self.close_proxy(name).await;
        let (state, pid) = {
            let g = svc.lock();
            (g.state, g.process.as_ref().map(|t| t.pid))
        };
        let Some(pid) =
            pid.filter(|_| !matches!(state, State::Dead | State::Exited | State::Idle | State::Hibernated))
        else {
            if stop && state == State::Hibernated {
                let a = Arc::clone(self);
                let s = Arc::clone(&svc);
                let _ = tokio::task::spawn_blocking(move || a.stop_blocking(&s)).await;
                return change(name, "removed", "stopped", "no longer served; its image removed".into());
            }
            return change(
                name,
                "removed",
                "stopped",
                format!("no longer served ({}, no process)", state.as_str()),
            );
        };
        if !stop {
            let detail = format!(
                "no longer served; its process {pid} is left {}, no longer managed by the agent \
                 (`gpusnap stop {pid}` ends it, or reload with stop_removed)",
                state.as_str()
            );
            self.journal(&svc, None, &format!("removed from the config: {detail}"));
            return change(name, "removed", "left_running", detail);
        }
        {
            let mut g = svc.lock();
            g.ending_on_purpose = true;
            svc.set_state(&mut g, State::Stopping);
        }
        let a = Arc::clone(self);
        let s = Arc::clone(&svc);
        match tokio::task::spawn_blocking(move || a.stop_blocking(&s)).await.unwrap_or_else(|e| Err(e.into()))
        {
            Ok(()) => {
                self.journal(&svc, None, "removed from the config: stopped (reload with stop_removed)");
                change(name, "removed", "stopped", format!("no longer served; its process {pid} was stopped"))
            }
            Err(e) => {
                change(name, "removed", "failed", format!("no longer served; stopping {pid} failed: {e}"))
            }
        }
    }

    /// A service the file names anew: started as at the agent's start.
    async fn new_service(self: &Arc<Self>, cfg: ServiceConfig, raw: toml::Value) -> Change {
        let name = cfg.name.get_ref().clone();
        let svc = Arc::new(Service::new(cfg));
        if !self.add_service(Arc::clone(&svc)) {
            return change(&name, "added", "failed", "the name is taken".into());
        }
        self.reloading.served.lock().unwrap_or_else(|e| e.into_inner()).insert(name.clone(), raw);
        if let Err(e) = self.open_proxy(&svc).await {
            svc.lock().last_error = Some(e.clone());
            return change(&name, "added", "failed", format!("its proxy could not listen: {e}"));
        }
        self.found_again(&svc, crate::service::Persisted::default()).await;
        let state = svc.lock().state;
        let (done, detail) = match state {
            State::Idle => ("idle", "started by its first request".to_string()),
            State::Starting | State::Running => ("started", "started".to_string()),
            s if svc.cfg.adopted() => ("adopted", format!("found as {}", s.as_str())),
            s => ("started", s.as_str().to_string()),
        };
        change(&name, "added", done, detail)
    }

    /// Adopts (or starts) `svc` from `rec`, and watches its socket.
    async fn found_again(self: &Arc<Self>, svc: &Arc<Service>, rec: crate::service::Persisted) {
        let (a, s) = (Arc::clone(self), Arc::clone(svc));
        let _ = tokio::task::spawn_blocking(move || a.adopt_one(&s, &rec)).await;
        if svc.cfg.wake_on == WakeOn::Socket && svc.cfg.pod.is_none() {
            let ctl: Arc<dyn crate::control::Control> = Arc::clone(self) as _;
            crate::sockwake::spawn(ctl, Arc::clone(svc), tokio::runtime::Handle::current());
        }
    }

    /// A service whose config changed: restarted with it now if idle, else
    /// once idle (see [`Agent::apply_pending`]).
    async fn change_service(self: &Arc<Self>, cfg: ServiceConfig, raw: toml::Value) -> Change {
        let name = cfg.name.get_ref().clone();
        let Some(old) = self.service(&name) else {
            return self.new_service(cfg, raw).await;
        };
        match self.apply_change(&old, cfg.clone(), raw.clone()).await {
            Ok((done, detail)) => change(&name, "changed", done, detail),
            Err(why) => {
                let drift = old.lock().launched.as_ref().and_then(|l| l.drift(&cfg));
                if drift.is_some() {
                    let labels = crate::metrics::ServiceLabels { service: name.clone() };
                    self.metrics().config_drift.get_or_create(&labels).set(1);
                    old.lock().drift = drift;
                }
                self.reloading
                    .pending
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(name.clone(), (cfg, raw));
                change(&name, "changed", "pending", format!("restarted with its new config once idle: {why}"))
            }
        }
    }

    /// Restarts `old` under `cfg` if it is idle; the error says why not yet.
    async fn apply_change(
        self: &Arc<Self>,
        old: &Arc<Service>,
        cfg: ServiceConfig,
        raw: toml::Value,
    ) -> Result<(&'static str, String), String> {
        let new = Arc::new(Service::new(cfg));
        let adopted = old.cfg.adopted() || new.cfg.adopted();
        let was = {
            let mut g = old.lock();
            if g.state.in_transition() {
                return Err(format!("it is {}", g.state.as_str()));
            }
            if Service::has_traffic(&g) {
                let n = g.waiting + g.conns.values().filter(|c| c.busy()).count();
                return Err(format!("{n} request(s) in flight"));
            }
            let was = g.state;
            // The old one is inert from now on: the policy leaves a
            // stopping service alone.
            g.ending_on_purpose = !adopted;
            old.set_state(&mut g, State::Stopping);
            if !adopted {
                // Requests now wait for the new one.
                let mut n = new.lock();
                new.set_state(&mut n, State::Starting);
            }
            was
        };
        let rec = Self::persisted_of(old);
        self.replace_service(Arc::clone(&new));
        self.reloading.served.lock().unwrap_or_else(|e| e.into_inner()).insert(new.name.clone(), raw);
        let proxy = self.open_proxy(&new).await.err();
        let note = proxy.as_ref().map_or(String::new(), |e| format!("; its proxy could not listen: {e}"));
        if adopted {
            // Not the agent's to restart: found again under its new config.
            self.found_again(&new, rec).await;
            let state = new.lock().state;
            return Ok(("adopted", format!("found again under its new config, {}{note}", state.as_str())));
        }
        let (a, s) = (Arc::clone(self), Arc::clone(old));
        let stopped =
            tokio::task::spawn_blocking(move || a.stop_blocking(&s)).await.unwrap_or_else(|e| Err(e.into()));
        if let Err(e) = stopped {
            self.died(
                &new,
                &format!("restart with its new config: the old process could not be stopped: {e}"),
            );
            return Ok(("failed", format!("its old process could not be stopped: {e}")));
        }
        self.journal(old, None, "stopped: its config changed (reload)");
        if new.cfg.wake_on == WakeOn::Socket && new.cfg.pod.is_none() {
            let ctl: Arc<dyn crate::control::Control> = Arc::clone(self) as _;
            crate::sockwake::spawn(ctl, Arc::clone(&new), tokio::runtime::Handle::current());
        }
        let off_gpu = matches!(was, State::Suspended | State::Parked | State::Hibernated | State::Idle);
        if (off_gpu || new.cfg.start == Start::OnDemand) && new.cfg.wake_on == WakeOn::Proxy {
            let mut g = new.lock();
            new.set_state(&mut g, State::Idle);
            return Ok((
                "restarted",
                format!("stopped; started with its new config by its next request{note}"),
            ));
        }
        self.spawn_start(&new, "restarted with its new config (reload)");
        Ok(("restarted", format!("restarted with its new config{note}")))
    }

    /// The changes of a reload that waited for their service to be idle,
    /// applied once it is (the policy's tick).
    pub async fn apply_pending(self: &Arc<Self>) {
        let Ok(_one) = self.reloading.one.try_lock() else { return };
        let pending = self.reloading.pending.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for (name, (cfg, raw)) in pending {
            let Some(old) = self.service(&name) else {
                self.reloading.pending.lock().unwrap_or_else(|e| e.into_inner()).remove(&name);
                continue;
            };
            if let Ok((done, detail)) = self.apply_change(&old, cfg, raw).await {
                self.reloading.pending.lock().unwrap_or_else(|e| e.into_inner()).remove(&name);
                tracing::info!(service = name, done, "reload: changed: {detail}");
                self.persist();
            }
        }
    }

    /// Whether a reload's change waits for its service to be idle.
    pub fn reloading_waits(&self) -> bool {
        !self.reloading.pending.lock().unwrap_or_else(|e| e.into_inner()).is_empty()
    }

    fn drift_seen(&self) -> Vec<DriftSeen> {
        self.services()
            .iter()
            .filter_map(|s| {
                let g = s.lock();
                g.drift.clone().map(|drift| DriftSeen {
                    service: s.name.clone(),
                    pid: g.process.as_ref().map(|t| t.pid),
                    drift,
                })
            })
            .collect()
    }
}
