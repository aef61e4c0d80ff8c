//! Bringing a service back when it is needed: a connection (or the API)
//! waits while a suspended service is resumed, a hibernated one woken or a
//! dead one started. When admission refuses, another GPU of the same model
//! takes the resume, or room is made (see [`super::room`]).

use super::{quiet, PolicyError};
use crate::control::Unavailable;
use crate::service::{Service, State};
use crate::state::{cuda_pids_in, Agent, DynEngine};
use gpusnap_core::engine::ResumeOptions;
use gpusnap_core::target;
use gpusnap_hibernate::Hibernate;
use gpusnap_hibernate::WakeOptions;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a successful attempt to bring a service back spent in the driver
/// (and, for a wake, in CRIU's restore before it), for the wake trace.
#[derive(Debug, Clone, Copy)]
struct Done {
    wake: Duration,
    driver: Duration,
}

/// Who asks for a service to be running: the reason its journal gives for
/// the transition, and how long the asker waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Asker {
    /// A connection (a request, bytes on a socket): it waits out a failed
    /// start's backoff, up to `wake_timeout`.
    Connection,
    /// `gpusnap service NAME resume` (the API): a start it caused that
    /// fails answers at once, with the reason.
    Api,
}

impl Asker {
    fn why(self, first: bool) -> &'static str {
        match (self, first) {
            (Asker::Api, _) => "asked through the API",
            (Asker::Connection, true) => "its first request arrived",
            (Asker::Connection, false) => "a connection arrived",
        }
    }
}

impl Agent {
    /// Waits until `svc` is running, starting whatever transition brings it
    /// back. Returns whether it had to wait. `accepted`: when the connection
    /// that asks came (a resume or wake it starts is then traced, from there).
    pub(super) async fn ensure_running(
        self: &Arc<Self>,
        svc: &Arc<Service>,
        deadline: Instant,
        accepted: Option<Instant>,
        asker: Asker,
    ) -> Result<bool, Unavailable> {
        let mut waited = false;
        let mut rx = svc.changed.subscribe();
        let trace = |kind| accepted.map(|t| crate::trace::WakeTrace::new(kind, t));
        let failures = svc.lock().hook_failures;
        loop {
            {
                let mut g = svc.lock();
                if g.hook_failures != failures {
                    // The resume this connection waited for ran, but the
                    // server did not take its memory back: not another try
                    // for the same connection (it would fail the same way).
                    return Err(Unavailable(format!(
                        "{}: its after_resume hook failed: {}",
                        svc.name,
                        g.last_error.as_deref().unwrap_or("?")
                    )));
                }
                match g.state {
                    State::Running => return Ok(waited),
                    State::Suspended | State::Parked => {
                        svc.set_state(&mut g, State::Resuming);
                        // With its wall-clock time: what a client's connect()
                        // is measured against (bench/cpu/sockwake.sh).
                        tracing::info!(service = svc.name, at_unix_us = unix_us(), "resume started");
                        g.trace = trace("resume");
                        drop(g);
                        self.spawn_bring_back(svc, asker.why(false));
                    }
                    State::Hibernated => {
                        svc.set_state(&mut g, State::Waking);
                        g.trace = trace("wake");
                        drop(g);
                        if self.image_lost(svc) {
                            self.spawn_recover(svc, false);
                        } else {
                            self.spawn_bring_back(svc, asker.why(false));
                        }
                    }
                    State::Faulted => {
                        return Err(Unavailable(format!(
                            "{}: its CUDA context faulted; the process is held for the operator",
                            svc.name
                        )));
                    }
                    State::Exited | State::Dead if svc.cfg.adopted() => {
                        return Err(Unavailable(format!(
                            "{}: its process ended, and the agent does not start a server it adopted",
                            svc.name
                        )));
                    }
                    // Its first request: woken from its remote's image when
                    // there is one (a second node, or one that lost its
                    // disk), else started.
                    // The wake this connection caused was refused: not another.
                    State::Idle if waited && g.last_error.is_some() => {
                        return Err(Unavailable(format!(
                            "{}: {}",
                            svc.name,
                            g.last_error.as_deref().unwrap_or("?")
                        )));
                    }
                    State::Idle if svc.cfg.remote.is_some() => {
                        g.image = Some(super::image_name(&svc.name));
                        svc.set_state(&mut g, State::Waking);
                        g.trace = trace("wake");
                        drop(g);
                        if self.image_lost(svc) {
                            self.spawn_recover(svc, true);
                        } else {
                            self.spawn_bring_back(svc, asker.why(true));
                        }
                    }
                    State::Idle => {
                        svc.set_state(&mut g, State::Starting);
                        drop(g);
                        self.spawn_start(svc, asker.why(true));
                    }
                    // The start the API's call caused failed: answered now,
                    // not after its backoff and wake_timeout.
                    State::Dead if waited && asker == Asker::Api && g.last_error.is_some() => {
                        return Err(Unavailable(format!(
                            "{}: {}",
                            svc.name,
                            g.last_error.as_deref().unwrap_or("?")
                        )));
                    }
                    // On demand: never restarted on its own; asked, it
                    // starts once its backoff has passed.
                    State::Dead
                        if svc.cfg.start == crate::config::Start::OnDemand
                            && g.restart_at.is_some_and(|t| Instant::now() >= t) =>
                    {
                        g.restart_at = None;
                        svc.set_state(&mut g, State::Starting);
                        drop(g);
                        self.spawn_start(svc, asker.why(false));
                    }
                    State::Dead if g.restart_at.is_none() => {
                        svc.set_state(&mut g, State::Starting);
                        drop(g);
                        self.spawn_start(svc, asker.why(false));
                    }
                    _ => {}
                }
            }
            waited = true;
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Unavailable(format!("{}: not back within wake_timeout", svc.name)));
            }
            // A tick at most apart, so that a scheduled restart is noticed.
            let _ = tokio::time::timeout(left.min(Duration::from_millis(500)), rx.changed()).await;
        }
    }

    pub(super) fn spawn_bring_back(self: &Arc<Self>, svc: &Arc<Service>, why: &'static str) {
        let (agent, svc) = (Arc::clone(self), Arc::clone(svc));
        tokio::spawn(async move { agent.bring_back(&svc, why).await });
    }

    /// Resume (state Resuming) or wake (state Waking) `svc`, making room on
    /// the GPU first when admission refuses: idle services are suspended,
    /// lowest priority first, then least recently used. Each step is added
    /// to the service's wake trace (when a connection caused the wake).
    async fn bring_back(self: &Arc<Self>, svc: &Arc<Service>, why: &str) {
        let kind = if svc.lock().state == State::Waking { "wake" } else { "resume" };
        let deadline = Instant::now() + svc.cfg.wake_timeout;
        // One admission decision at a time: two services coming back together
        // must not evict each other.
        let _gpu = self.gpu_lock().await;
        self.journal(svc, None, &format!("{kind}: {why}"));
        svc.trace(|t| t.mark_now("decide"));
        let started = Instant::now();
        loop {
            // A woken image whose processes were suspended when it was taken
            // is then resumed: Waking becomes Resuming.
            let waking = svc.lock().state == State::Waking;
            let (a, s) = (Arc::clone(self), Arc::clone(svc));
            // The transition's own time: evictions before it are theirs.
            let attempt = Instant::now();
            let r = tokio::task::spawn_blocking(move || a.bring_back_once(&s, waking)).await;
            let r = r.unwrap_or_else(|e| Err(e.into()));
            let end = Instant::now();
            svc.trace(|t| t.counts.admissions += 1);
            match r {
                Ok(done) => {
                    self.metrics().transition(&svc.name, kind, true, (end - attempt).as_secs_f64());
                    svc.trace(|t| {
                        if kind == "wake" {
                            t.span(end, "resume_prep", &[("wake", done.wake), ("resume", done.driver)]);
                        } else {
                            t.span(end, "resume_prep", &[("resume", done.driver)]);
                        }
                    });
                    // Still Resuming: the proxy holds every request until
                    // the server has its memory back; the GPU lock is held
                    // too, so no other admission counts what it will take.
                    if let Some(hook) = svc.cfg.hooks.after_resume.as_ref().map(|h| h.get_ref()) {
                        let out = crate::hooks::call(svc.cfg.backend, hook).await;
                        svc.trace(|t| t.mark_now("hook_resume"));
                        self.metrics().transition(&svc.name, "hook_resume", out.ok(), out.took.as_secs_f64());
                        if !out.ok() {
                            self.after_resume_failed(svc, &out.describe(hook)).await;
                            return;
                        }
                        self.journal(svc, None, &format!("after_resume hook: {}", out.describe(hook)));
                    }
                    tracing::info!(
                        service = svc.name,
                        kind,
                        total_ms = started.elapsed().as_millis() as u64,
                        "back"
                    );
                    {
                        let mut g = svc.lock();
                        g.image = None;
                        g.ending_on_purpose = false;
                        g.last_activity = Instant::now();
                        svc.set_state(&mut g, State::Running);
                    }
                    // Off this worker: the connection just woken may be
                    // queued behind this task, and the write syncs to disk.
                    let a = Arc::clone(self);
                    let _ = tokio::task::spawn_blocking(move || a.persist()).await;
                    return;
                }
                Err(msg) if msg.no_room() && Instant::now() < deadline => {
                    svc.trace(|t| {
                        t.counts.refusals += 1;
                        t.mark("admission", end);
                    });
                    self.metrics()
                        .refusals
                        .get_or_create(&crate::metrics::ServiceLabels { service: svc.name.clone() })
                        .inc();
                    let victim = self.pick_victim(svc, None);
                    svc.trace(|t| t.mark_now("pick"));
                    match victim {
                        Some(v) => {
                            let reason = format!("evicted to make room for {} ({msg})", svc.name);
                            match self.evict(&v, &reason).await {
                                Ok(ev) => {
                                    svc.trace(|t| {
                                        t.counts.evictions += 1;
                                        t.counts.release_polls += ev.polls;
                                        let mut parts =
                                            vec![("suspend", ev.driver), ("release_wait", ev.release)];
                                        if v.cfg.hooks.before_suspend.is_some() {
                                            parts.insert(0, ("hook_suspend", ev.hook));
                                        }
                                        t.span(Instant::now(), "evict_prep", &parts);
                                    });
                                }
                                Err(e) => {
                                    tracing::warn!(service = v.name, "eviction failed: {e}");
                                    tokio::time::sleep(Duration::from_millis(200)).await;
                                    svc.trace(|t| t.mark_now("evict_prep"));
                                }
                            }
                        }
                        // Everything else is busy: wait for memory to come free.
                        None => {
                            let reads = self.wait_for_memory(Some(svc), deadline).await;
                            svc.trace(|t| {
                                t.counts.memory_polls += reads;
                                t.mark_now("memory_wait");
                            });
                        }
                    }
                }
                Err(msg) => {
                    self.metrics().transition(&svc.name, kind, false, (end - attempt).as_secs_f64());
                    self.journal(svc, None, &format!("{kind} failed: {msg}"));
                    // Its process is gone (killed while suspended or parked):
                    // dead, restarted as the tick would, not resumed anew by
                    // every waiting request before the tick can see it.
                    let gone = {
                        let g = svc.lock();
                        !matches!(g.state, State::Waking)
                            && g.process.as_ref().is_some_and(|p| !target::is_alive(p))
                    };
                    if gone {
                        self.died(svc, &format!("the process ended while it was away from the GPU ({msg})"));
                        return;
                    }
                    // A copy back that was refused leaves it parked.
                    let (a, s) = (Arc::clone(self), Arc::clone(svc));
                    let parked = tokio::task::spawn_blocking(move || a.parked_now(&s)).await.unwrap_or(false);
                    {
                        let mut g = svc.lock();
                        g.last_error = Some(msg.to_string());
                        g.trace = None;
                        let back = match g.state {
                            State::Waking => State::Hibernated,
                            _ if parked => State::Parked,
                            _ => State::Suspended,
                        };
                        svc.set_state(&mut g, back);
                    }
                    // Waiters give up at their own deadline; they must not
                    // restart the same failing transition in a tight loop.
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    return;
                }
            }
        }
    }

    /// One attempt, no waiting for memory (a refusal for room says so:
    /// [`PolicyError::no_room`]).
    fn bring_back_once(&self, svc: &Service, waking: bool) -> Result<Done, PolicyError> {
        fn err(e: impl Into<gpusnap_hibernate::Error>) -> PolicyError {
            PolicyError::Engine(e.into())
        }
        let mut e = self.engine().map_err(PolicyError::NoEngine)?;
        if waking {
            let t_wake = Instant::now();
            let image = svc.lock().image.clone().ok_or(PolicyError::NoImage)?;
            self.persist_doing(svc, "wake");
            let opts = WakeOptions {
                wait: Duration::ZERO,
                margin_bytes: svc.cfg.margin,
                force_resume: Vec::new(),
                device_map: Vec::new(),
                force: false,
                // Lazy only when asked: its page server lives in this
                // process, and an agent killed mid-fill would let the woken
                // processes fault in zero pages (docs/design/wake.md). Eager, the
                // agent can die at any moment (docs/design/agent.md).
                eager: !svc.cfg.lazy_wake.unwrap_or(self.cfg().lazy_wake),
            };
            let r = e.wake(&self.criu().map_err(err)?, self.images(), &image, &opts).map_err(err)?;
            let t = target::resolve(r.root_pid).map_err(err)?;
            // The light guard's runner ended with the hibernated tree; a
            // running tree can only take the traced guard, as `gpusnap wake` gives it.
            self.start_guard(&r.processes, svc.cfg.on_fault);
            {
                let mut g = svc.lock();
                g.process = Some(t.clone());
                g.runner = None;
            }
            // The image is kept until the process runs again: nothing is
            // deleted before its replacement is verified.
            if let Err(err) = self.images().remove(&image) {
                tracing::warn!(service = svc.name, image, "could not remove the woken image: {err}");
            }
            svc.lock().image = None;
            self.journal(svc, Some(&t), &format!("woken from {image} in {} ms", r.total_ms));
            {
                let mut g = svc.lock();
                svc.set_state(&mut g, State::Resuming);
            }
            self.persist();
            let woke = t_wake.elapsed();
            let woken_at = Instant::now();
            let r = self.bring_back_once(svc, false);
            if r.is_err() {
                // The wake is done (the service is Resuming now) and its
                // resume was refused (an eviction comes next): the CRIU
                // restore is the wake's phase, not admission's.
                svc.trace(|t| t.span(woken_at, "resume_prep", &[("wake", woke)]));
            }
            r.map(|d| Done { wake: woke, ..d })
        } else {
            let (root, kept) = {
                let g = svc.lock();
                (g.process.clone().ok_or(PolicyError::NoProcess)?, g.image.clone())
            };
            let pids = cuda_pids_in(Some(&mut e), root.pid);
            // None found (the driver cannot be asked about a stopped
            // process): nothing is resumed, so nothing may be said to be.
            // A suspend refuses the same way.
            if pids.is_empty() {
                return Err(PolicyError::StaysSuspended(root.pid));
            }
            // Room for what the after_resume hook will allocate too: two
            // woken servers must never both grow into one GPU.
            let margin = svc.cfg.margin.saturating_add(self.growth(svc, &mut e, &pids));
            let mut opts = ResumeOptions { margin_bytes: margin, ..Default::default() };
            // Woken by an agent that died before the driver's restore was
            // recorded: the image's manifest has the footprint the store lacks.
            if let Some((_, m)) = kept.as_ref().and_then(|i| self.images().manifest(i).ok()) {
                opts.footprint_bytes =
                    m.processes.iter().filter(|p| p.cuda).map(|p| p.footprint.values().sum::<u64>()).max();
            }
            let r = match e.resume_group(&pids, &opts, &quiet) {
                // Its GPU is full: another GPU of the same model with room
                // takes it before anyone is evicted.
                Err(refused) if refused.exit_code() == 3 => match self.other_gpu(&mut e, &pids, margin) {
                    Some((old, new)) => {
                        self.journal(
                            svc,
                            Some(&root),
                            &format!("resume onto {new}: {old} is full ({refused})"),
                        );
                        opts.device_map = vec![(old, new)];
                        e.resume_group(&pids, &opts, &quiet).map_err(err)?
                    }
                    None => return Err(err(refused)),
                },
                r => r.map_err(err)?,
            };
            let ms: u64 = r.iter().map(|r| r.total_ms).max().unwrap_or(0);
            let driver = r.iter().map(|r| r.restore_ms + r.unlock_ms).max().unwrap_or(0);
            self.journal(svc, Some(&root), &format!("resumed in {ms} ms"));
            if let Some(image) = kept {
                match self.images().remove(&image) {
                    Ok(()) => {
                        self.journal(svc, Some(&root), &format!("{image} removed: its process runs again"))
                    }
                    Err(err) => {
                        tracing::warn!(service = svc.name, image, "could not remove the woken image: {err}")
                    }
                }
            }
            Ok(Done { wake: Duration::ZERO, driver: Duration::from_millis(driver) })
        }
    }

    /// For a service suspended from one GPU: another GPU of the same model
    /// with room for its footprint (and the margin), as (old, new) uuids.
    /// None for a fast-swap server whose memory is offloaded: its library
    /// maps it back on the GPU it came from.
    fn other_gpu(&self, e: &mut DynEngine, pids: &[i32], margin: u64) -> Option<(String, String)> {
        if pids.iter().any(|&pid| gpusnap_core::swap::status(pid).is_some_and(|s| s.away())) {
            return None;
        }
        let mut fp: std::collections::BTreeMap<String, u64> = std::collections::BTreeMap::new();
        for pid in pids {
            for (u, b) in e.store().latest_for_pid(*pid).ok()??.footprint {
                *fp.entry(u).or_insert(0) += b;
            }
        }
        if fp.len() != 1 {
            return None;
        }
        let (old, need) = fp.into_iter().next()?;
        let gpus = e.gpus().gpus().ok()?;
        let model = gpus.iter().find(|g| g.uuid == old)?.name.clone();
        gpus.into_iter()
            .filter(|g| g.uuid != old && g.name == model && g.free_bytes >= need.saturating_add(margin))
            .max_by_key(|g| g.free_bytes)
            .map(|g| (old, g.uuid))
    }
}

fn unix_us() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}
