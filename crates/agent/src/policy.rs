//! What the agent decides and how it carries it out: start, suspend when
//! idle, resume on demand (evicting idle services when the GPU is full),
//! hibernate under host-memory pressure or after `hibernate_after`, wake,
//! restart a service that died. Every transition goes through the core
//! `Engine` (journal, admission, locks); every decision is journaled with its
//! reason as an `agent` note on the service's process.

use crate::daemon::Agent;
use crate::service::{Service, State};
use gpusnap_core::engine::{ResumeOptions, StopOptions, SuspendReport};
use gpusnap_core::target::{self, Target};
use gpusnap_core::tree::process_tree;
use gpusnap_core::Quiet;
use gpusnap_hibernate::Hibernate;
use gpusnap_hibernate::{HibernateOptions, WakeOptions};
use std::sync::Arc;
use std::time::{Duration, Instant};

const LOCK_TIMEOUT_MS: u32 = 30_000;
const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// After a failed hibernation, the policy waits this long before another.
const HIBERNATE_RETRY: Duration = Duration::from_secs(60);
/// Waiting for GPU memory with nothing to evict: NVML is read this often,
/// and admission asked again after at most MEMORY_WAIT_MAX.
const MEMORY_POLL: Duration = Duration::from_millis(5);
const MEMORY_WAIT_MAX: Duration = Duration::from_millis(200);

fn quiet() -> Box<dyn gpusnap_core::Progress> {
    Box::new(Quiet)
}

/// The CUDA processes of a service: those of its tree that map libcuda or
/// that the driver knows (a driver library installed under another name).
pub fn cuda_pids(agent: &Agent, root: i32) -> Vec<i32> {
    cuda_pids_in(agent.engine().ok().as_mut(), root)
}

/// [`cuda_pids`] with an engine the caller already has.
fn cuda_pids_in(mut e: Option<&mut crate::daemon::DynEngine>, root: i32) -> Vec<i32> {
    let tree: Vec<i32> = process_tree(root).into_iter().map(|(p, _)| p).collect();
    tree.into_iter()
        .filter(|p| target::pid_maps_libcuda(*p) || e.as_mut().is_some_and(|e| e.state(*p).is_ok()))
        .collect()
}

/// What a successful attempt to bring a service back spent in the driver
/// (and, for a wake, in CRIU's restore before it), for the wake trace.
#[derive(Debug, Clone, Copy)]
struct Done {
    wake: Duration,
    driver: Duration,
}

/// Why a connection could not be given its service.
#[derive(Debug, Clone)]
pub struct Unavailable(pub String);

impl Agent {
    /// Journals a decision on the service's process (or the one it last had).
    pub fn journal(&self, svc: &Service, t: Option<&Target>, what: &str) {
        tracing::info!(service = svc.name, "{what}");
        let t = t.cloned().or_else(|| svc.lock().process.clone());
        let Some(t) = t else { return };
        let detail = format!("{}: {what}", svc.name);
        if let Err(err) =
            gpusnap_core::Store::open(&self.state_dir).and_then(|mut s| s.note(&t, "agent", None, &detail))
        {
            tracing::warn!(service = svc.name, "could not journal: {err}");
        }
    }

    /// Waits until `svc` is running, starting whatever transition brings it
    /// back. Returns whether it had to wait. `accepted`: when the connection
    /// that asks came (a resume or wake it starts is then traced, from there).
    pub async fn ensure_running(
        self: &Arc<Self>,
        svc: &Arc<Service>,
        deadline: Instant,
        accepted: Option<Instant>,
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
                    State::Suspended => {
                        svc.set_state(&mut g, State::Resuming);
                        g.trace = trace("resume");
                        drop(g);
                        self.spawn_bring_back(svc, "a connection arrived");
                    }
                    State::Hibernated => {
                        svc.set_state(&mut g, State::Waking);
                        g.trace = trace("wake");
                        drop(g);
                        self.spawn_bring_back(svc, "a connection arrived");
                    }
                    State::Exited | State::Dead if svc.cfg.adopted() => {
                        return Err(Unavailable(format!(
                            "{}: its process ended, and the agent does not start a server it adopted",
                            svc.name
                        )));
                    }
                    State::Dead if g.restart_at.is_none() => {
                        svc.set_state(&mut g, State::Starting);
                        drop(g);
                        self.spawn_start(svc, "a connection arrived");
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

    fn spawn_bring_back(self: &Arc<Self>, svc: &Arc<Service>, why: &'static str) {
        let (agent, svc) = (Arc::clone(self), Arc::clone(svc));
        tokio::spawn(async move { agent.bring_back(&svc, why).await });
    }

    pub fn spawn_start(self: &Arc<Self>, svc: &Arc<Service>, why: &'static str) {
        let (agent, svc) = (Arc::clone(self), Arc::clone(svc));
        tokio::spawn(async move {
            // A server that declares its size starts only once it fits, and
            // holds the GPU lock until it listens (has loaded): two cold
            // starts must not both count the same free memory.
            let _gpu = match svc.cfg.gpu_memory {
                Some(need) => Some(agent.make_room(&svc, need).await),
                None => None,
            };
            let a = Arc::clone(&agent);
            let s = Arc::clone(&svc);
            let r = tokio::task::spawn_blocking(move || a.start_blocking(&s, why)).await;
            if let Ok(Err(e)) | Err(e) = r.map_err(|e| e.to_string()) {
                agent.died(&svc, &format!("could not start: {e}"));
            }
        });
    }

    /// Suspends idle services (as a resume would) until `need` bytes are
    /// free on the GPU with the most free memory, or wake_timeout passes.
    async fn make_room(self: &Arc<Self>, svc: &Arc<Service>, need: u64) -> tokio::sync::MutexGuard<'_, ()> {
        let gpu = self.gpu_lock.lock().await;
        let deadline = Instant::now() + svc.cfg.wake_timeout;
        loop {
            let a = Arc::clone(self);
            let free = tokio::task::spawn_blocking(move || {
                a.engine()
                    .ok()
                    .and_then(|e| e.gpus().gpus().ok())
                    .map(|g| g.iter().map(|g| g.free_bytes).max().unwrap_or(0))
            })
            .await
            .ok()
            .flatten()
            .unwrap_or(u64::MAX);
            if free >= need.saturating_add(svc.cfg.margin) || Instant::now() >= deadline {
                return gpu;
            }
            match self.pick_victim(svc) {
                Some(v) => {
                    let reason = format!(
                        "evicted to make room for {} to start ({} MiB free, {} MiB needed)",
                        svc.name,
                        free >> 20,
                        need >> 20
                    );
                    if self.suspend(&v, &reason).await.is_err() {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
                None => {
                    self.wait_for_memory(None, deadline).await;
                }
            }
        }
    }

    /// Resume (state Resuming) or wake (state Waking) `svc`, making room on
    /// the GPU first when admission refuses: idle services are suspended,
    /// lowest priority first, then least recently used. Each step is added
    /// to the service's wake trace (when a connection caused the wake).
    pub async fn bring_back(self: &Arc<Self>, svc: &Arc<Service>, why: &str) {
        let kind = if svc.lock().state == State::Waking { "wake" } else { "resume" };
        let deadline = Instant::now() + svc.cfg.wake_timeout;
        // One admission decision at a time: two services coming back together
        // must not evict each other.
        let _gpu = self.gpu_lock.lock().await;
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
            let r = r.unwrap_or_else(|e| Err((1, e.to_string())));
            let end = Instant::now();
            svc.trace(|t| t.counts.admissions += 1);
            match r {
                Ok(done) => {
                    self.metrics.transition(&svc.name, kind, true, (end - attempt).as_secs_f64());
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
                        self.metrics.transition(&svc.name, "hook_resume", out.ok(), out.took.as_secs_f64());
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
                Err((3, msg)) if Instant::now() < deadline => {
                    svc.trace(|t| {
                        t.counts.refusals += 1;
                        t.mark("admission", end);
                    });
                    self.metrics
                        .refusals
                        .get_or_create(&crate::metrics::ServiceLabels { service: svc.name.clone() })
                        .inc();
                    let victim = self.pick_victim(svc);
                    svc.trace(|t| t.mark_now("pick"));
                    match victim {
                        Some(v) => {
                            let reason = format!("evicted to make room for {} ({msg})", svc.name);
                            match self.suspend_reports(&v, &reason).await {
                                Ok((reports, hook)) => {
                                    let max = |f: fn(&SuspendReport) -> u64| {
                                        Duration::from_millis(reports.iter().map(f).max().unwrap_or(0))
                                    };
                                    let driver = max(|r| r.lock_ms + r.checkpoint_ms);
                                    let release = max(|r| r.release_ms);
                                    let polls: u32 = reports.iter().map(|r| r.release_polls).sum();
                                    svc.trace(|t| {
                                        t.counts.evictions += 1;
                                        t.counts.release_polls += polls;
                                        let mut parts = vec![("suspend", driver), ("release_wait", release)];
                                        if v.cfg.hooks.before_suspend.is_some() {
                                            parts.insert(0, ("hook_suspend", hook));
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
                Err((_, msg)) => {
                    self.metrics.transition(&svc.name, kind, false, 0.0);
                    self.journal(svc, None, &format!("{kind} failed: {msg}"));
                    {
                        let mut g = svc.lock();
                        g.last_error = Some(msg);
                        g.trace = None;
                        let back =
                            if g.state == State::Waking { State::Hibernated } else { State::Suspended };
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

    /// After admission refused and nothing can be evicted: returns as soon
    /// as NVML shows what the resume of `svc` needs free on each of its GPUs
    /// (its recorded footprint and margin; without one, `svc` None or not
    /// known: as soon as free memory grows on some GPU), or after
    /// MEMORY_WAIT_MAX, or at `deadline`. The caller then asks admission
    /// again, which decides: this only chooses when to ask. NVML is read
    /// every MEMORY_POLL (a checkpoint's release it reports late, a process
    /// that ended); it used to be a fixed 200 ms sleep. Returns the reads.
    async fn wait_for_memory(self: &Arc<Self>, svc: Option<&Arc<Service>>, deadline: Instant) -> u32 {
        let until = (Instant::now() + MEMORY_WAIT_MAX).min(deadline);
        let (a, s) = (Arc::clone(self), svc.cloned());
        tokio::task::spawn_blocking(move || {
            let need = s.map(|s| a.resume_need(&s)).unwrap_or_default();
            let Ok(e) = a.engine() else {
                std::thread::sleep(until.saturating_duration_since(Instant::now()));
                return 0;
            };
            let read = || -> Option<std::collections::BTreeMap<String, u64>> {
                e.gpus().gpus().ok().map(|g| g.into_iter().map(|g| (g.uuid, g.free_bytes)).collect())
            };
            let first = read();
            let mut reads = 1;
            loop {
                let left = until.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return reads;
                }
                std::thread::sleep(MEMORY_POLL.min(left));
                reads += 1;
                let Some(now) = read() else { continue };
                let enough = if need.is_empty() {
                    first.as_ref().is_some_and(|f| now.iter().any(|(u, b)| f.get(u).is_some_and(|g| b > g)))
                } else {
                    need.iter().all(|(u, b)| now.get(u).is_some_and(|f| f >= b))
                };
                if enough {
                    return reads;
                }
            }
        })
        .await
        .unwrap_or(0)
    }

    /// Per GPU, what admission asks for a resume of `svc`: the footprint
    /// recorded for its CUDA processes plus its margin (empty if unknown).
    fn resume_need(&self, svc: &Service) -> std::collections::BTreeMap<String, u64> {
        let mut need = std::collections::BTreeMap::new();
        let Some(root) = svc.lock().process.as_ref().map(|t| t.pid) else { return need };
        let mut e = self.engine().ok();
        let pids = cuda_pids_in(e.as_mut(), root);
        let Some(e) = e else { return need };
        for pid in pids {
            if let Ok(Some(r)) = e.store().latest_for_pid(pid) {
                for (u, b) in r.footprint {
                    *need.entry(u).or_insert(0u64) += b;
                }
            }
        }
        let extra = Self::full_size(svc).map(|full| full.saturating_sub(need.values().sum()));
        for b in need.values_mut() {
            *b = b.saturating_add(svc.cfg.margin).saturating_add(extra.unwrap_or(0));
        }
        need
    }

    /// One attempt, no waiting for memory: `Err((exit code, message))`.
    fn bring_back_once(&self, svc: &Service, waking: bool) -> Result<Done, (i32, String)> {
        fn err(e: impl Into<gpusnap_hibernate::Error>) -> (i32, String) {
            let e = e.into();
            (e.exit_code(), e.to_string())
        }
        let mut e = self.engine().map_err(|e| (1, e.to_string()))?;
        if waking {
            let t_wake = Instant::now();
            let image = svc.lock().image.clone().ok_or((1, "no image to wake".to_string()))?;
            self.persist_doing(svc, "wake");
            let opts = WakeOptions {
                wait: Duration::ZERO,
                margin_bytes: svc.cfg.margin,
                force_resume: Vec::new(),
                device_map: Vec::new(),
                force: false,
                // Lazy only when asked: its page server lives in this
                // process, and an agent killed mid-fill would let the woken
                // processes fault in zero pages (docs/pages.md). Eager, the
                // agent can die at any moment (docs/agent.md).
                eager: !svc.cfg.lazy_wake.unwrap_or(self.cfg.lazy_wake),
            };
            let r = e.wake(&self.criu().map_err(err)?, &self.images, &image, &opts).map_err(err)?;
            let t = target::resolve(r.root_pid).map_err(err)?;
            // The light guard's runner ended with the hibernated tree; a
            // running tree can only take the traced guard, as `gpusnap wake` gives it.
            self.start_guard(&r.processes);
            {
                let mut g = svc.lock();
                g.process = Some(t.clone());
                g.runner = None;
            }
            // The image is kept until the process runs again: nothing is
            // deleted before its replacement is verified.
            if let Err(err) = self.images.remove(&image) {
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
            self.bring_back_once(svc, false).map(|d| Done { wake: woke, ..d })
        } else {
            let (root, kept) = {
                let g = svc.lock();
                (g.process.clone().ok_or((1, "no process".to_string()))?, g.image.clone())
            };
            let pids = cuda_pids_in(Some(&mut e), root.pid);
            // Room for what the after_resume hook will allocate too: two
            // woken servers must never both grow into one GPU.
            let margin = svc.cfg.margin.saturating_add(self.growth(svc, &mut e, &pids));
            let mut opts = ResumeOptions { margin_bytes: margin, ..Default::default() };
            // Woken by an agent that died before the driver's restore was
            // recorded: the image's manifest has the footprint the store lacks.
            if let Some((_, m)) = kept.as_ref().and_then(|i| self.images.manifest(i).ok()) {
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
                match self.images.remove(&image) {
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

    /// The idle running service to suspend for `for_svc`: never one with
    /// traffic in flight; lowest priority, then least recently used. One
    /// engine and one NVML process list for all the candidates (a swap
    /// waits on this).
    fn pick_victim(&self, for_svc: &Service) -> Option<Arc<Service>> {
        let mut e = self.engine().ok();
        // Only services on the GPUs the resume needs (its footprint's);
        // unknown (a cold start): any.
        let needed = self.footprint_gpus(&mut e, for_svc);
        let mut nvml: Option<Vec<gpusnap_gpu::ProcessUsage>> = None;
        let mut best: Option<(i64, i64, Arc<Service>)> = None;
        for s in &self.services {
            if s.name == for_svc.name {
                continue;
            }
            let (key, root) = {
                let g = s.lock();
                if g.state != State::Running || Service::has_traffic(&g) {
                    continue;
                }
                ((s.cfg.priority, g.last_used_ms), g.process.as_ref().map(|t| t.pid))
            };
            if best.as_ref().is_some_and(|(p, u, _)| key >= (*p, *u)) {
                continue;
            }
            if let (false, Some(root)) = (needed.is_empty(), root) {
                let procs = nvml.get_or_insert_with(|| {
                    e.as_ref().and_then(|e| e.gpus().processes().ok()).unwrap_or_default()
                });
                let pids = cuda_pids_in(e.as_mut(), root);
                let on: std::collections::BTreeSet<String> =
                    procs.iter().filter(|p| pids.contains(&(p.pid as i32))).map(|p| p.uuid.clone()).collect();
                if !on.is_empty() && on.is_disjoint(&needed) {
                    continue;
                }
            }
            best = Some((key.0, key.1, Arc::clone(s)));
        }
        best.map(|(_, _, s)| s)
    }

    /// The GPUs a suspended service's recorded footprint is on.
    fn footprint_gpus(
        &self,
        e: &mut Option<crate::daemon::DynEngine>,
        svc: &Service,
    ) -> std::collections::BTreeSet<String> {
        let Some(root) = svc.lock().process.as_ref().map(|t| t.pid) else { return Default::default() };
        let pids = cuda_pids_in(e.as_mut(), root);
        let Some(e) = e.as_ref() else { return Default::default() };
        pids.into_iter()
            .filter_map(|p| e.store().latest_for_pid(p).ok().flatten())
            .flat_map(|r| r.footprint.into_keys())
            .collect()
    }

    /// Suspends a running service unless traffic arrived meanwhile.
    pub async fn suspend(self: &Arc<Self>, svc: &Arc<Service>, reason: &str) -> Result<(), String> {
        self.suspend_reports(svc, reason).await.map(|_| ())
    }

    /// An after_resume hook failed: the server runs but did not take its
    /// memory back (or answers no more). It is suspended again, off the
    /// GPU, and the connections that waited for it get a 503 (the proxy);
    /// the next connection tries a resume (and the hook) again.
    async fn after_resume_failed(self: &Arc<Self>, svc: &Arc<Service>, what: &str) {
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
            .unwrap_or_else(|e| Err(e.to_string()));
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

    /// What the service's processes hold on the GPU now (NVML), if known.
    fn gpu_usage(&self, svc: &Service) -> Option<u64> {
        let root = svc.lock().process.as_ref().map(|t| t.pid)?;
        let mut e = self.engine().ok()?;
        let pids = cuda_pids_in(Some(&mut e), root);
        let procs = e.gpus().processes().ok()?;
        let used: u64 = procs.iter().filter(|p| pids.contains(&(p.pid as i32))).filter_map(|p| p.bytes).sum();
        (used > 0).then_some(used)
    }

    /// The size of a service with hooks once its after_resume hook has run:
    /// what it held before its last before_suspend hook (NVML), or its
    /// declared `gpu_memory` if larger (or if NVML could not tell).
    fn full_size(svc: &Service) -> Option<u64> {
        if !svc.cfg.hooks.any() {
            return None;
        }
        let seen = svc.lock().full_footprint;
        match (seen, svc.cfg.gpu_memory) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        }
    }

    /// What the service will take after its after_resume hook beyond what
    /// its suspend recorded (the before_suspend hook gave it back): admission
    /// asks for it on top of the margin.
    fn growth(&self, svc: &Service, e: &mut crate::daemon::DynEngine, pids: &[i32]) -> u64 {
        let Some(full) = Self::full_size(svc) else { return 0 };
        let recorded: u64 = pids
            .iter()
            .filter_map(|p| e.store().latest_for_pid(*p).ok().flatten())
            .map(|r| r.footprint.values().sum::<u64>())
            .sum();
        full.saturating_sub(recorded)
    }

    /// [`Self::suspend`], with the engine's reports (lock, checkpoint and
    /// release times per process).
    /// and the time its before_suspend hook took.
    pub async fn suspend_reports(
        self: &Arc<Self>,
        svc: &Arc<Service>,
        reason: &str,
    ) -> Result<(Vec<SuspendReport>, Duration), String> {
        {
            let mut g = svc.lock();
            if g.state != State::Running {
                return Err(format!("{} is {}", svc.name, g.state.as_str()));
            }
            if Service::has_traffic(&g) {
                return Err(format!("{} has a request in flight", svc.name));
            }
            svc.set_state(&mut g, State::Suspending);
        }
        let thp = if svc.cfg.thp.unwrap_or(self.cfg.thp) { " (THP always for its checkpoint)" } else { "" };
        self.journal(svc, None, &format!("suspend: {reason}{thp}"));
        let started = Instant::now();
        // Suspending: connections arriving meanwhile wait, as for the suspend.
        let mut hook_ok = None;
        if let Some(hook) = svc.cfg.hooks.before_suspend.as_ref().map(|h| h.get_ref()) {
            // What it holds before it gives anything back: its size once
            // its after_resume hook has run.
            let (a, s) = (Arc::clone(self), Arc::clone(svc));
            if let Ok(Some(used)) = tokio::task::spawn_blocking(move || a.gpu_usage(&s)).await {
                svc.lock().full_footprint = Some(used);
            }
            let out = crate::hooks::call(svc.cfg.backend, hook).await;
            self.metrics.transition(&svc.name, "hook_suspend", out.ok(), out.took.as_secs_f64());
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
            .unwrap_or_else(|e| Err(e.to_string()));
        // The server gave its memory back but stays on the GPU: it takes it
        // again before it serves.
        if let (Err(_), Some(true), Some(hook)) =
            (&r, hook_ok, svc.cfg.hooks.after_resume.as_ref().map(|h| h.get_ref()))
        {
            let out = crate::hooks::call(svc.cfg.backend, hook).await;
            self.metrics.transition(&svc.name, "hook_resume", out.ok(), out.took.as_secs_f64());
            self.journal(
                svc,
                None,
                &format!("the suspend failed: after_resume hook: {}", out.describe(hook)),
            );
        }
        let ok = r.is_ok();
        // The hook is timed on its own (hook_suspend).
        self.metrics.transition(&svc.name, "suspend", ok, (started.elapsed() - hook_time).as_secs_f64());
        {
            let mut g = svc.lock();
            match &r {
                Ok(_) => svc.set_state(&mut g, State::Suspended),
                Err(e) => {
                    g.last_error = Some(e.clone());
                    // Not again before another suspend_after.
                    g.last_activity = Instant::now();
                    // The engine leaves a process as it found it when it fails.
                    svc.set_state(&mut g, State::Running);
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

    fn suspend_blocking(&self, svc: &Service) -> Result<Vec<SuspendReport>, String> {
        let root = svc.lock().process.clone().ok_or("no process")?;
        let mut e = self.engine().map_err(|e| e.to_string())?;
        let pids = cuda_pids_in(Some(&mut e), root.pid);
        if pids.is_empty() {
            return Err(format!("no CUDA process in the tree of {}", root.pid));
        }
        let _thp = self.thp_for(svc)?;
        e.suspend_group(&pids, LOCK_TIMEOUT_MS, &quiet).map_err(|e| e.to_string())
    }

    /// THP `always` for the length of a checkpoint, when the service wants
    /// it (core's `--thp`: the previous mode is journaled in the state
    /// directory and put back after, or by the next gpusnap after a crash).
    fn thp_for(&self, svc: &Service) -> Result<Option<gpusnap_core::thp::Always>, String> {
        if !svc.cfg.thp.unwrap_or(self.cfg.thp) {
            return Ok(None);
        }
        gpusnap_core::thp::Always::on(&self.state_dir).map(Some).map_err(|e| e.to_string())
    }

    /// Hibernates a suspended service with no open connection.
    pub async fn hibernate(self: &Arc<Self>, svc: &Arc<Service>, reason: &str) -> Result<(), String> {
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
        let (a, s) = (Arc::clone(self), Arc::clone(svc));
        let r = tokio::task::spawn_blocking(move || a.hibernate_blocking(&s))
            .await
            .unwrap_or_else(|e| Err(e.to_string()));
        self.metrics.transition(&svc.name, "hibernate", r.is_ok(), started.elapsed().as_secs_f64());
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
                let back = match g.process.as_ref().map(|t| cuda_pids(self, t.pid)) {
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
                Ok(())
            }
            Err(e) => {
                self.journal(svc, None, &format!("hibernate failed: {e}"));
                Err(e)
            }
        }
    }

    fn hibernate_blocking(&self, svc: &Service) -> Result<String, String> {
        let root = svc.lock().process.clone().ok_or("no process")?;
        let name = format!("agent-{}-{}", svc.name, gpusnap_core::store::now_ms());
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
        let pids = cuda_pids(self, root.pid);
        let _thp = if self.all_checkpointed(&pids) { None } else { self.thp_for(svc)? };
        // CRIU must be the tree's only tracer: a traced guard (attached after
        // an earlier wake) lets go first, and comes back if the tree stays.
        let tree: Vec<i32> = process_tree(root.pid).into_iter().map(|(p, _)| p).collect();
        let detached = gpusnap_guard::detach_for(&self.state_dir, &tree).map_err(|e| e.to_string())?;
        match e.hibernate(&criu, &self.images, root.pid, &opts) {
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

    /// For a service suspended from one GPU: another GPU of the same model
    /// with room for its footprint (and the margin), as (old, new) uuids.
    fn other_gpu(
        &self,
        e: &mut crate::daemon::DynEngine,
        pids: &[i32],
        margin: u64,
    ) -> Option<(String, String)> {
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

    /// `gpusnap guard --daemon PIDS`, as `gpusnap wake` starts it.
    pub(crate) fn start_guard(&self, pids: &[i32]) {
        if pids.is_empty() {
            return;
        }
        let st = std::process::Command::new(&self.exe)
            .arg("--state-dir")
            .arg(&self.state_dir)
            .args(["guard", "--daemon"])
            .args(pids.iter().map(|p| p.to_string()))
            .stdin(std::process::Stdio::null())
            .status();
        if !st.is_ok_and(|s| s.success()) {
            tracing::warn!(?pids, "the guard could not attach to the woken processes");
        }
    }

    pub fn all_checkpointed(&self, pids: &[i32]) -> bool {
        let Ok(mut e) = self.engine() else { return false };
        pids.iter().all(|p| e.state(*p).is_ok_and(|s| s.state == "checkpointed"))
    }

    /// Starts the service's command under the light guard (`gpusnap run
    /// --light`), in a session of its own so that it outlives the agent.
    pub fn start_blocking(&self, svc: &Service, why: &str) -> Result<(), String> {
        let Some(cmd) = svc.cfg.command.clone() else {
            return Err("no command to start".into());
        };
        let logs = self.state_dir.join("agent");
        std::fs::create_dir_all(&logs).map_err(|e| e.to_string())?;
        let log_path = logs.join(format!("{}.log", svc.name));
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| e.to_string())?;
        let mut c = std::process::Command::new(&self.exe);
        c.arg("--state-dir")
            .arg(&self.state_dir)
            .args(["run", "--light", "--name", &svc.name, "--"])
            .args(&cmd)
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log);
        use std::os::unix::process::CommandExt;
        // SAFETY: setsid is async-signal-safe and touches no memory of ours.
        unsafe {
            c.pre_exec(|| {
                nix::unistd::setsid().map_err(std::io::Error::from)?;
                Ok(())
            });
        }
        let child = c.spawn().map_err(|e| format!("{}: {e}", self.exe.display()))?;
        let runner = child.id() as i32;
        self.children.lock().unwrap_or_else(|e| e.into_inner()).push(child);
        // The program is the runner's child; it appears once run has set up.
        let deadline = Instant::now() + Duration::from_secs(30);
        let program = loop {
            let kids =
                std::fs::read_to_string(format!("/proc/{runner}/task/{runner}/children")).unwrap_or_default();
            if let Some(p) = kids.split_whitespace().next().and_then(|p| p.parse::<i32>().ok()) {
                break p;
            }
            if Instant::now() > deadline || !std::path::Path::new(&format!("/proc/{runner}")).exists() {
                return Err(format!("the program did not start (see {})", log_path.display()));
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let t = target::resolve(program).map_err(|e| e.to_string())?;
        {
            let mut g = svc.lock();
            g.process = Some(t.clone());
            g.runner = Some(runner);
            g.image = None;
            g.ending_on_purpose = false;
        }
        self.persist();
        // Started means serving: a model server listens once it has loaded.
        let deadline = Instant::now() + svc.cfg.wake_timeout;
        while std::net::TcpStream::connect_timeout(&svc.cfg.backend, Duration::from_secs(1)).is_err() {
            if !target::is_alive(&t) {
                return Err(format!(
                    "the program ended before it listened on {} (see {})",
                    svc.cfg.backend,
                    log_path.display()
                ));
            }
            if Instant::now() > deadline {
                tracing::warn!(service = svc.name, "not listening on {} after wake_timeout", svc.cfg.backend);
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        {
            let mut g = svc.lock();
            g.last_activity = Instant::now();
            svc.set_state(&mut g, State::Running);
        }
        self.journal(svc, Some(&t), &format!("started (pid {program}, under run --light {runner}): {why}"));
        Ok(())
    }

    /// The service's process is gone without the agent ending it.
    pub fn died(&self, svc: &Service, why: &str) {
        if svc.cfg.adopted() {
            // Not ours to start: its owner (systemd, a container runtime)
            // may start it again, and the tick adopts the new process.
            // Journaled before the state shows: whoever sees `exited` finds why.
            let t = svc.lock().process.clone();
            self.journal(
                svc,
                t.as_ref(),
                &format!("{why}; adopted, not started by the agent: not restarted"),
            );
            let mut g = svc.lock();
            g.last_error = Some(why.to_string());
            g.exited_at = Some(std::time::SystemTime::now());
            svc.set_state(&mut g, State::Exited);
            drop(g);
            self.persist();
            return;
        }
        let mut g = svc.lock();
        let backoff = Duration::from_secs(1 << g.restarts.min(6)).min(MAX_BACKOFF);
        g.last_error = Some(why.to_string());
        g.runner = None;
        if svc.cfg.restart && svc.cfg.command.is_some() {
            g.restart_at = Some(Instant::now() + backoff);
            g.restarts += 1;
        }
        let t = g.process.clone();
        svc.set_state(&mut g, State::Dead);
        drop(g);
        self.persist();
        let next = if svc.cfg.restart && svc.cfg.command.is_some() {
            format!("; restart in {} s", backoff.as_secs())
        } else {
            String::new()
        };
        self.journal(svc, t.as_ref(), &format!("{why}{next}"));
    }

    /// Ends the service (suspended first, as `gpusnap stop` does) and starts it anew.
    pub async fn restart(self: &Arc<Self>, svc: &Arc<Service>) -> Result<(), String> {
        {
            let mut g = svc.lock();
            if g.state.in_transition() {
                return Err(format!("{} is {}", svc.name, g.state.as_str()));
            }
            if svc.cfg.command.is_none() {
                return Err(format!(
                    "{} was adopted, not started by the agent: it cannot be restarted",
                    svc.name
                ));
            }
            g.ending_on_purpose = true;
            svc.set_state(&mut g, State::Stopping);
        }
        self.journal(svc, None, "restart: asked through the API");
        let (a, s) = (Arc::clone(self), Arc::clone(svc));
        let r = tokio::task::spawn_blocking(move || {
            a.stop_blocking(&s)?;
            a.start_blocking(&s, "restart")
        })
        .await
        .unwrap_or_else(|e| Err(e.to_string()));
        self.metrics.transition(&svc.name, "restart", r.is_ok(), 0.0);
        if let Err(e) = &r {
            self.died(svc, &format!("restart failed: {e}"));
        }
        r
    }

    fn stop_blocking(&self, svc: &Service) -> Result<(), String> {
        let (root, image) = {
            let g = svc.lock();
            (g.process.clone(), g.image.clone())
        };
        if let Some(image) = image {
            let _ = self.images.remove(&image);
        }
        let Some(root) = root.filter(target::is_alive) else { return Ok(()) };
        let mut e = self.engine().map_err(|e| e.to_string())?;
        let opts =
            StopOptions { grace: Duration::from_secs(10), force: false, lock_timeout_ms: LOCK_TIMEOUT_MS };
        let pids = cuda_pids(self, root.pid);
        if !pids.is_empty() {
            e.stop_group(&pids, &opts, &quiet).map_err(|e| e.to_string())?;
        }
        if target::is_alive(&root) {
            e.stop(root.pid, &opts).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// The policy, once per tick: reap, notice deaths, restart, suspend the
    /// idle, hibernate the long-suspended and, under host-memory pressure,
    /// the longest-suspended.
    pub async fn tick(self: &Arc<Self>) {
        self.reap();
        let mut hibernate_one: Option<(Instant, Arc<Service>)> = None;
        for svc in self.services.clone() {
            let (state, since, alive, restart_due, may_hibernate) = {
                let g = svc.lock();
                let alive = g.process.as_ref().is_some_and(target::is_alive);
                let may_hibernate =
                    g.conns.is_empty() && g.hibernate_not_before.is_none_or(|t| Instant::now() >= t);
                (g.state, g.since, alive, g.restart_at.is_some_and(|t| Instant::now() >= t), may_hibernate)
            };
            match state {
                State::Running | State::Suspended if !alive => {
                    self.died(&svc, "the process ended on its own");
                }
                State::Dead if restart_due => {
                    let mut g = svc.lock();
                    g.restart_at = None;
                    svc.set_state(&mut g, State::Starting);
                    drop(g);
                    self.spawn_start(&svc, "restart after the process died");
                }
                State::Running => {
                    let idle = svc.cfg.suspend_after.filter(|d| Service::idle_for(&svc.lock(), *d));
                    if let Some(d) = idle {
                        let (a, s) = (Arc::clone(self), Arc::clone(&svc));
                        tokio::spawn(async move {
                            let _ = a.suspend(&s, &format!("idle for {}", crate::fmt_duration(d))).await;
                        });
                    }
                }
                State::Exited => {
                    let a = Arc::clone(self);
                    let s = Arc::clone(&svc);
                    let _ = tokio::task::spawn_blocking(move || a.readopt(&s)).await;
                }
                State::Suspended if may_hibernate && !svc.cfg.adopted() => {
                    if let Some(d) = svc.cfg.hibernate_after.filter(|d| since.elapsed() >= *d) {
                        let (a, s) = (Arc::clone(self), Arc::clone(&svc));
                        tokio::spawn(async move {
                            let _ =
                                a.hibernate(&s, &format!("suspended for {}", crate::fmt_duration(d))).await;
                        });
                        continue;
                    }
                    if hibernate_one.as_ref().is_none_or(|(t, _)| since < *t) {
                        hibernate_one = Some((since, Arc::clone(&svc)));
                    }
                }
                _ => {}
            }
        }
        if let (Some(min), Some((_, svc))) = (self.cfg.min_host_available, hibernate_one) {
            if let Some(avail) = host_available() {
                if avail < min {
                    let reason = format!(
                        "host memory available {} MiB < min_host_available {} MiB",
                        avail >> 20,
                        min >> 20
                    );
                    let a = Arc::clone(self);
                    tokio::spawn(async move {
                        let _ = a.hibernate(&svc, &reason).await;
                    });
                }
            }
        }
    }

    /// Collects the runners the agent started that have ended.
    fn reap(&self) {
        let mut kids = self.children.lock().unwrap_or_else(|e| e.into_inner());
        kids.retain_mut(|c| !matches!(c.try_wait(), Ok(Some(_)) | Err(_)));
    }
}

pub fn host_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
