//! Finding the services again when the agent starts, and after an adopted
//! server's owner started it anew: what a previous agent recorded (a live
//! process, possibly woken from its image meanwhile; an image), a pid_file
//! or cgroup, or nothing (then it is started).

use crate::service::{Persisted, Service, State};
use crate::state::Agent;
use gpusnap_core::target::{self, Target};
use gpusnap_hibernate::Hibernate;
use std::sync::Arc;
use std::time::Instant;

impl Agent {
    /// Finds every service again: what a previous agent recorded (a live
    /// process, possibly woken from its image meanwhile; an image), a
    /// pid_file or cgroup, or nothing (then it is started). Transitions that
    /// a killed agent left half done were journaled by the engine, whose
    /// state calls reconcile them against the driver.
    pub fn adopt(self: &Arc<Self>) {
        // A hibernate that a killed agent (or CLI) left between its dump and
        // its end is finished or undone first, so that adoption sees either
        // the running tree or the finished image, never a stopped tree.
        match self.engine().and_then(|mut e| e.reconcile_hibernates(self.images())) {
            Ok(list) => {
                for i in list {
                    tracing::warn!(image = %i.image, outcome = %i.outcome, pids = ?i.pids, "reconciled an interrupted hibernate");
                }
            }
            Err(err) => tracing::warn!("could not reconcile interrupted hibernates: {err}"),
        }
        // Temporary images of dead gpusnaps (a hibernate killed before its
        // commit, undone just above) go: nothing refers to them.
        for stale in self.images().gc() {
            tracing::warn!(path = %stale.path.display(), "removed the temporary image of an interrupted hibernate");
        }
        let old = self.load_persisted();
        for svc in self.services().iter() {
            let rec = old.get(&svc.name).cloned().unwrap_or_default();
            self.adopt_one(svc, &rec);
        }
        self.persist();
    }

    /// Finds one service again from its record `rec` (empty: none).
    pub(crate) fn adopt_one(self: &Arc<Self>, svc: &Arc<Service>, rec: &Persisted) {
        let rec = rec.clone();
        let found = self.find_process(svc, &rec);
        let mut g = svc.lock();
        g.runner = rec.runner;
        g.full_footprint = rec.full_footprint;
        match found {
            Some(t) => {
                let pids = self.cuda_pids(t.pid);
                g.process = Some(t.clone());
                svc.set_launched(&mut g, rec.launched.clone());
                let drift = g.drift.clone();
                drop(g);
                let labels = crate::metrics::ServiceLabels { service: svc.name.clone() };
                self.metrics().config_drift.get_or_create(&labels).set(i64::from(drift.is_some()));
                if let Some(d) = &drift {
                    tracing::warn!(service = svc.name, pid = t.pid, "{d}");
                    self.journal(svc, Some(&t), d);
                }
                let woken = rec.image.as_ref().filter(|_| {
                    rec.doing.as_deref() == Some("wake")
                        && rec.start_time.is_some_and(|st| st != t.start_time)
                });
                // A process its guard holds with a faulted context stays held.
                let state =
                    if self.faulted(svc) { State::Faulted } else { self.adopted_state(&pids, svc.parks()) };
                let mut g = svc.lock();
                svc.set_state(&mut g, state);
                drop(g);
                self.journal(svc, Some(&t), &format!("adopted as {} (pid {})", state.as_str(), t.pid));
                if rec.doing.as_deref() == Some(super::suspend::HOOKED_SUSPEND) && state == State::Running {
                    self.undo_hook(svc);
                }
                if let Some(image) = woken {
                    // The previous agent died mid-wake, after CRIU had
                    // restored the tree and before the driver's restore
                    // was recorded: the live process is the service now
                    // (a second wake would find its pids taken). Its
                    // image stays until it runs again: it holds the
                    // footprint the resume needs, and nothing is deleted
                    // before its replacement is verified.
                    self.start_guard(&pids, svc.cfg.on_fault);
                    self.journal(
                        svc,
                        Some(&t),
                        &format!("woken from {image} by the previous agent; the image is kept until it runs"),
                    );
                }
                // A woken process not yet resumed keeps its image (above,
                // or an agent ago); one that runs has replaced it.
                if state == State::Suspended {
                    svc.lock().image = rec.image.clone().filter(|i| self.images().manifest(i).is_ok());
                } else if let Some(image) = woken {
                    if let Err(err) = self.images().remove(image) {
                        tracing::warn!(service = svc.name, image, "could not remove the woken image: {err}");
                    }
                }
            }
            None => match rec.image.filter(|i| self.images().manifest(i).is_ok()) {
                Some(image) => {
                    g.image = Some(image.clone());
                    g.process = rec.pid.zip(rec.start_time).map(|(pid, start_time)| Target {
                        pid,
                        start_time,
                        comm: rec.comm.clone().unwrap_or_default(),
                        uid: 0,
                    });
                    svc.set_state(&mut g, State::Hibernated);
                    drop(g);
                    self.journal(svc, None, &format!("adopted as hibernated (image {image})"));
                }
                None if svc.cfg.start == crate::config::Start::OnDemand => {
                    // Started (or woken from its remote) by its first request.
                    g.process = None;
                    svc.set_state(&mut g, State::Idle);
                }
                None if svc.cfg.command.is_some() => {
                    svc.set_state(&mut g, State::Starting);
                    drop(g);
                    self.spawn_start(svc, "the agent started and found no process for it");
                }
                None => {
                    // A refused pid file said why already.
                    let why =
                        g.last_error.take().unwrap_or_else(|| "no process found (pid_file/cgroup)".into());
                    g.last_error = Some(why);
                    svc.set_state(&mut g, State::Exited);
                }
            },
        }
    }

    /// The previous agent ran the before_suspend hook and died before the
    /// checkpoint: the server runs without its memory (asleep). Its
    /// after_resume hook gives it back before any request is forwarded; if
    /// that fails, the service says so (`last_error`) rather than `running`
    /// as if it served, and is suspended.
    fn undo_hook(self: &Arc<Self>, svc: &Arc<Service>) {
        let Some(hook) = svc.cfg.hooks.after_resume.as_ref().map(|h| h.get_ref()) else {
            self.journal(svc, None, "the previous agent ran before_suspend and died before the checkpoint; no after_resume hook to undo it");
            return;
        };
        let out = tokio::runtime::Handle::current().block_on(crate::hooks::call(svc.cfg.backend, hook));
        self.metrics().transition(&svc.name, "hook_resume", out.ok(), out.took.as_secs_f64());
        let what = format!(
            "the previous agent ran before_suspend and died before the checkpoint: after_resume hook: {}",
            out.describe(hook)
        );
        if out.ok() {
            self.journal(svc, None, &what);
        } else {
            // Taken off the GPU for real: the next request resumes it and
            // calls the hook again.
            tokio::runtime::Handle::current().block_on(self.after_resume_failed(svc, &what));
        }
    }

    fn find_process(&self, svc: &Service, rec: &Persisted) -> Option<Target> {
        if let (Some(pid), Some(st)) = (rec.pid, rec.start_time) {
            if let Ok(t) = target::resolve(pid) {
                if t.start_time == st {
                    return Some(t);
                }
                // Woken by CRIU (same pid, new start time) while the old
                // agent was waiting for the wake to finish.
                if rec.image.is_some() && rec.doing.as_deref() == Some("wake") && t.start_time > st {
                    return Some(t);
                }
            }
        }
        self.find_adopted(svc, None, None)
    }

    /// The server of an adopted service: the live process its `pid_file`
    /// names, or the root of its `cgroup`'s tree. After `old` ended (at
    /// `exited_at`), a pid file that still names `old`'s pid counts only
    /// if it was written since (a reused pid is not the server).
    fn find_adopted(
        &self,
        svc: &Service,
        old: Option<&Target>,
        exited_at: Option<std::time::SystemTime>,
    ) -> Option<Target> {
        if let Some(pf) = &svc.cfg.pid_file {
            let pid = std::fs::read_to_string(pf).ok()?.trim().parse::<i32>().ok()?;
            if let (Some(old), Some(at)) = (old, exited_at) {
                let written = std::fs::metadata(pf).and_then(|m| m.modified()).ok()?;
                if old.pid == pid && written < at {
                    return None;
                }
            }
            let t = target::resolve(pid).ok()?;
            if let Err(why) = crate::pidfile::trusted(pf, &t) {
                let why = format!("pid_file {}: {why}: not adopted", pf.display());
                crate::warn_every!(crate::pidfile::REFUSED, service = svc.name, "{why}");
                svc.lock().last_error = Some(why);
                return None;
            }
            return Some(t);
        }
        if svc.cfg.pod.is_some() {
            // The pid of the pod's container, as the runtime last said.
            return svc.pod_pid().and_then(|p| target::resolve(p).ok());
        }
        if let Some(cg) = &svc.cfg.cgroup {
            let pids = target::cgroup_processes(cg).ok()?;
            let roots = gpusnap_core::tree::roots_of(&pids);
            return roots.first().and_then(|p| target::resolve(*p).ok());
        }
        None
    }

    /// An exited adopted service: adopts the process its owner started anew.
    pub(super) fn readopt(self: &Arc<Self>, svc: &Arc<Service>) {
        let (old, at) = {
            let g = svc.lock();
            (g.process.clone(), g.exited_at)
        };
        let Some(t) = self.find_adopted(svc, old.as_ref(), at) else { return };
        if old.as_ref().is_some_and(|o| o.pid == t.pid && o.start_time == t.start_time) {
            return;
        }
        let pids = self.cuda_pids(t.pid);
        let state = self.adopted_state(&pids, svc.parks());
        {
            let mut g = svc.lock();
            if g.state != State::Exited {
                return;
            }
            g.process = Some(t.clone());
            g.exited_at = None;
            g.last_activity = Instant::now();
            svc.set_state(&mut g, state);
        }
        self.persist();
        self.journal(svc, Some(&t), &format!("adopted a new process as {} (pid {})", state.as_str(), t.pid));
    }

    /// `parks`: a service that parks is adopted parked when its libraries
    /// hold its memory and the driver runs it (a park the previous agent
    /// began and the library finished).
    fn adopted_state(&self, pids: &[i32], parks: bool) -> State {
        if pids.is_empty() {
            return State::Running;
        }
        let Ok(mut e) = self.engine() else { return State::Running };
        let states: Vec<String> =
            pids.iter().map(|p| e.state(*p).map(|s| s.state).unwrap_or_else(|_| "running".into())).collect();
        if states.iter().all(|s| s == "checkpointed") {
            return State::Suspended;
        }
        // A fast-swap library finishes an offload or a restore on its own
        // (an agent killed inside the offload that begins a suspend, or
        // inside a resume's copy back): wait for it. One whose memory is
        // then away (the driver may run it, locked or not) waits at the
        // library's gate: its suspend is finished (the lock and the
        // checkpoint), which needs no memory; the next request resumes it.
        let phases = settled_phases(pids);
        let parked = |p: &i32| e.state(*p).is_ok_and(|s| s.state == gpusnap_core::store::PARKED);
        if parks && !phases.is_empty() && phases.iter().all(|p| p == "offloaded") && pids.iter().all(parked) {
            return State::Parked;
        }
        if phases.iter().any(|p| p == "offloaded") {
            match e.suspend_group(pids, super::LOCK_TIMEOUT_MS, &super::quiet) {
                Ok(_) => return State::Suspended,
                Err(err) => tracing::warn!("could not finish the suspend of an adopted service: {err}"),
            }
        }
        // A process left locked (an agent killed between lock and checkpoint)
        // holds its memory: unlock it by resuming, which only unlocks.
        let away = phases.iter().any(|p| p != "resident");
        if away || states.iter().any(|s| s == "locked" || s == "checkpointed") {
            let opts = gpusnap_core::ResumeOptions::default();
            if let Err(err) = e.resume_group(pids, &opts, &|| Box::new(gpusnap_core::Quiet)) {
                tracing::warn!("could not finish the resume of an adopted service: {err}");
                return State::Suspended;
            }
        }
        State::Running
    }
}

/// The fast-swap phases of `pids`' libraries once none is moving memory
/// (each finishes what it began on its own), waited for up to a minute.
fn settled_phases(pids: &[i32]) -> Vec<String> {
    let end = Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let phases: Vec<String> =
            pids.iter().filter_map(|p| gpusnap_core::swap::status(*p)).map(|s| s.phase).collect();
        let moving = phases.iter().any(|p| p == "offloading" || p == "restoring");
        if !moving || Instant::now() >= end {
            return phases;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}
