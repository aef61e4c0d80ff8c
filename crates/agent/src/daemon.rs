//! The daemon: builds the services from the config, adopts what a previous
//! agent left (crash safety), starts the proxies, the policy loop and the
//! API, and tells systemd it is ready (`Type=notify`).

use crate::config::{AgentConfig, Config};
use crate::metrics::Metrics;
use crate::policy::cuda_pids;
use crate::service::{self, Persisted, Service, State};
use gpusnap_core::target::{self, Target};
use gpusnap_core::{Engine, Store};
use gpusnap_cuda::{CheckpointApi, Deadline};
use gpusnap_gpu::GpuInventory;
use gpusnap_hibernate::criu::Criu;
use gpusnap_hibernate::Hibernate;
use gpusnap_images::image::ImageStore;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

pub type DynEngine = Engine<Box<dyn CheckpointApi>, Box<dyn GpuInventory>>;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error("{0}")]
    Setup(String),
    #[error(transparent)]
    Core(#[from] gpusnap_hibernate::Error),
}

impl From<gpusnap_core::Error> for AgentError {
    fn from(e: gpusnap_core::Error) -> Self {
        Self::Core(e.into())
    }
}

impl AgentError {
    pub fn exit_code(&self) -> i32 {
        match self {
            AgentError::Config(_) => 2,
            AgentError::Setup(_) => 1,
            AgentError::Core(e) => e.exit_code(),
        }
    }
}

pub struct Agent {
    pub cfg: AgentConfig,
    pub services: Vec<Arc<Service>>,
    pub metrics: Metrics,
    pub state_dir: PathBuf,
    pub images: ImageStore,
    pub exe: PathBuf,
    criu_path: Option<PathBuf>,
    /// The driver and NVML, loaded once; each operation forks its own engine.
    base: Mutex<DynEngine>,
    pub gpu_lock: tokio::sync::Mutex<()>,
    pub children: Mutex<Vec<std::process::Child>>,
    persist_lock: Mutex<()>,
    pub started: Instant,
}

/// What the caller (the CLI) hands the agent.
pub struct Setup {
    pub config: Config,
    pub state_dir: PathBuf,
    pub criu: Option<PathBuf>,
    pub api: Deadline<Box<dyn CheckpointApi>>,
    pub gpus: Box<dyn GpuInventory>,
    /// The gpusnap binary that runs services (`run --light`).
    pub exe: PathBuf,
}

impl Agent {
    pub fn new(s: Setup) -> Result<Self, AgentError> {
        let store = Store::open(&s.state_dir)?;
        let services = s.config.service.into_iter().map(|c| Arc::new(Service::new(c))).collect();
        Ok(Self {
            cfg: s.config.agent,
            services,
            metrics: Metrics::new(),
            // The agent wakes only images it hibernated itself: this host's key.
            images: ImageStore::new(
                s.state_dir.join("images"),
                gpusnap_images::sign::Trust::host_only(&s.state_dir)
                    .map_err(gpusnap_hibernate::Error::from)?,
            ),
            state_dir: s.state_dir,
            exe: s.exe,
            criu_path: s.criu,
            base: Mutex::new(Engine::new(s.api, s.gpus, store)),
            gpu_lock: tokio::sync::Mutex::new(()),
            children: Mutex::new(Vec::new()),
            persist_lock: Mutex::new(()),
            started: Instant::now(),
        })
    }

    pub fn engine(&self) -> Result<DynEngine, gpusnap_hibernate::Error> {
        self.base
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .fork(Box::new(gpusnap_core::Quiet))
            .map_err(Into::into)
    }

    pub fn criu(&self) -> Result<Criu, gpusnap_hibernate::Error> {
        Ok(Criu::find(self.criu_path.as_deref())?)
    }

    pub fn service(&self, name: &str) -> Option<&Arc<Service>> {
        self.services.iter().find(|s| s.name == name)
    }

    fn persisted_of(svc: &Service) -> Persisted {
        let g = svc.lock();
        Persisted {
            pid: g.process.as_ref().map(|t| t.pid),
            start_time: g.process.as_ref().map(|t| t.start_time),
            comm: g.process.as_ref().map(|t| t.comm.clone()),
            runner: g.runner,
            image: g.image.clone(),
            doing: None,
            full_footprint: g.full_footprint,
        }
    }

    /// Writes every service's record (atomically).
    pub fn persist(&self) {
        self.persist_with(None);
    }

    /// Writes the records, marking `svc` as in the middle of `doing`, before
    /// a transition whose crash the next agent must understand.
    pub fn persist_doing(&self, svc: &Service, doing: &str) {
        self.persist_with(Some((&svc.name, doing)));
    }

    fn persist_with(&self, doing: Option<(&str, &str)>) {
        let _g = self.persist_lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut all = BTreeMap::new();
        for s in &self.services {
            let mut p = Self::persisted_of(s);
            if let Some((name, what)) = doing {
                if name == s.name {
                    p.doing = Some(what.to_string());
                }
            }
            all.insert(s.name.clone(), p);
        }
        if let Err(e) = service::save_persisted(&self.state_dir, &all) {
            tracing::error!("cannot write {}: {e}", service::state_file(&self.state_dir).display());
        }
    }

    /// Finds every service again: what a previous agent recorded (a live
    /// process, possibly woken from its image meanwhile; an image), a
    /// pid_file or cgroup, or nothing (then it is started). Transitions that
    /// a killed agent left half done were journaled by the engine, whose
    /// state calls reconcile them against the driver.
    pub fn adopt(self: &Arc<Self>) {
        // A hibernate that a killed agent (or CLI) left between its dump and
        // its end is finished or undone first, so that adoption sees either
        // the running tree or the finished image, never a stopped tree.
        match self.engine().and_then(|mut e| e.reconcile_hibernates(&self.images)) {
            Ok(list) => {
                for i in list {
                    tracing::warn!(image = %i.image, outcome = %i.outcome, pids = ?i.pids, "reconciled an interrupted hibernate");
                }
            }
            Err(err) => tracing::warn!("could not reconcile interrupted hibernates: {err}"),
        }
        // Temporary images of dead gpusnaps (a hibernate killed before its
        // commit, undone just above) go: nothing refers to them.
        for stale in self.images.gc() {
            tracing::warn!(path = %stale.path.display(), "removed the temporary image of an interrupted hibernate");
        }
        let old = service::load_persisted(&self.state_dir);
        for svc in &self.services {
            let rec = old.get(&svc.name).cloned().unwrap_or_default();
            let found = self.find_process(svc, &rec);
            let mut g = svc.lock();
            g.runner = rec.runner;
            g.full_footprint = rec.full_footprint;
            match found {
                Some(t) => {
                    let pids = cuda_pids(self, t.pid);
                    g.process = Some(t.clone());
                    drop(g);
                    let woken = rec.image.as_ref().filter(|_| {
                        rec.doing.as_deref() == Some("wake")
                            && rec.start_time.is_some_and(|st| st != t.start_time)
                    });
                    let state = self.adopted_state(&pids);
                    let mut g = svc.lock();
                    svc.set_state(&mut g, state);
                    drop(g);
                    self.journal(svc, Some(&t), &format!("adopted as {} (pid {})", state.as_str(), t.pid));
                    if let Some(image) = woken {
                        // The previous agent died mid-wake, after CRIU had
                        // restored the tree and before the driver's restore
                        // was recorded: the live process is the service now
                        // (a second wake would find its pids taken). Its
                        // image stays until it runs again: it holds the
                        // footprint the resume needs, and nothing is deleted
                        // before its replacement is verified.
                        self.start_guard(&pids);
                        self.journal(
                            svc,
                            Some(&t),
                            &format!(
                                "woken from {image} by the previous agent; the image is kept until it runs"
                            ),
                        );
                    }
                    // A woken process not yet resumed keeps its image (above,
                    // or an agent ago); one that runs has replaced it.
                    if state == State::Suspended {
                        svc.lock().image = rec.image.clone().filter(|i| self.images.manifest(i).is_ok());
                    } else if let Some(image) = woken {
                        if let Err(err) = self.images.remove(image) {
                            tracing::warn!(
                                service = svc.name,
                                image,
                                "could not remove the woken image: {err}"
                            );
                        }
                    }
                }
                None => match rec.image.filter(|i| self.images.manifest(i).is_ok()) {
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
                    None if svc.cfg.command.is_some() => {
                        svc.set_state(&mut g, State::Starting);
                        drop(g);
                        self.spawn_start(svc, "the agent started and found no process for it");
                    }
                    None => {
                        g.last_error = Some("no process found (pid_file/cgroup)".into());
                        svc.set_state(&mut g, State::Exited);
                    }
                },
            }
        }
        self.persist();
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
            return target::resolve(pid).ok();
        }
        if let Some(cg) = &svc.cfg.cgroup {
            let pids = target::cgroup_processes(cg).ok()?;
            let roots = gpusnap_core::tree::roots_of(&pids);
            return roots.first().and_then(|p| target::resolve(*p).ok());
        }
        None
    }

    /// An exited adopted service: adopts the process its owner started anew.
    pub fn readopt(self: &Arc<Self>, svc: &Arc<Service>) {
        let (old, at) = {
            let g = svc.lock();
            (g.process.clone(), g.exited_at)
        };
        let Some(t) = self.find_adopted(svc, old.as_ref(), at) else { return };
        if old.as_ref().is_some_and(|o| o.pid == t.pid && o.start_time == t.start_time) {
            return;
        }
        let pids = cuda_pids(self, t.pid);
        let state = self.adopted_state(&pids);
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

    fn adopted_state(&self, pids: &[i32]) -> State {
        if pids.is_empty() {
            return State::Running;
        }
        let Ok(mut e) = self.engine() else { return State::Running };
        let states: Vec<String> =
            pids.iter().map(|p| e.state(*p).map(|s| s.state).unwrap_or_else(|_| "running".into())).collect();
        if states.iter().all(|s| s == "checkpointed") {
            return State::Suspended;
        }
        // A process left locked (an agent killed between lock and checkpoint)
        // holds its memory: unlock it by resuming, which only unlocks.
        if states.iter().any(|s| s == "locked" || s == "checkpointed") {
            let opts = gpusnap_core::ResumeOptions::default();
            if let Err(err) = e.resume_group(pids, &opts, &|| Box::new(gpusnap_core::Quiet)) {
                tracing::warn!("could not finish the resume of an adopted service: {err}");
                return State::Suspended;
            }
        }
        State::Running
    }
}

/// Binds the API socket: removes a stale one, refuses when another agent
/// answers there, then sets mode 0660 and the configured group.
fn bind_socket(path: &Path, group: Option<&str>) -> Result<tokio::net::UnixListener, AgentError> {
    let setup =
        |what: &str, e: &dyn std::fmt::Display| AgentError::Setup(format!("{}: {what}: {e}", path.display()));
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(AgentError::Setup(format!("{}: another agent is serving there", path.display())));
        }
        std::fs::remove_file(path).map_err(|e| setup("remove the stale socket", &e))?;
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| setup("create its directory", &e))?;
    }
    let l = tokio::net::UnixListener::bind(path).map_err(|e| setup("bind", &e))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660)).map_err(|e| setup("chmod", &e))?;
    if let Some(g) = group {
        let gid = crate::api::group_id(g).ok_or_else(|| AgentError::Setup(format!("no group {g:?}")))?;
        nix::unistd::chown(path, None, Some(nix::unistd::Gid::from_raw(gid)))
            .map_err(|e| setup("chown", &e))?;
    }
    Ok(l)
}

/// Runs the agent until SIGTERM or SIGINT. The services are left as they
/// are: a later agent adopts them.
pub fn run(setup: Setup) -> Result<(), AgentError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .worker_threads(4)
        .build()
        .map_err(|e| AgentError::Setup(format!("tokio: {e}")))?;
    rt.block_on(async move {
        let agent = Arc::new(Agent::new(setup)?);
        let api_listener =
            bind_socket(&agent.cfg.socket, agent.cfg.group.as_ref().map(|g| g.get_ref().as_str()))?;
        // Bind every listen address before anything else: a taken port is a
        // setup error now, not a silent hole later.
        let mut proxies = Vec::new();
        for svc in &agent.services {
            let addr = *svc.cfg.listen.get_ref();
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| AgentError::Setup(format!("service {}: listen {addr}: {e}", svc.name)))?;
            proxies.push((Arc::clone(svc), l));
        }
        let metrics_listener = match agent.cfg.metrics_listen {
            Some(a) => Some(
                tokio::net::TcpListener::bind(a)
                    .await
                    .map_err(|e| AgentError::Setup(format!("metrics_listen {a}: {e}")))?,
            ),
            None => None,
        };
        {
            let a = Arc::clone(&agent);
            tokio::task::spawn_blocking(move || a.adopt())
                .await
                .map_err(|e| AgentError::Setup(format!("adopt: {e}")))?;
        }
        for (svc, l) in proxies {
            tokio::spawn(crate::proxy::serve(Arc::clone(&agent), svc, l));
        }
        tokio::spawn(crate::api::serve(Arc::clone(&agent), api_listener));
        if let Some(l) = metrics_listener {
            tokio::spawn(crate::api::serve_metrics(Arc::clone(&agent), l));
        }
        {
            let a = Arc::clone(&agent);
            tokio::spawn(async move {
                let mut every = tokio::time::interval(a.cfg.tick);
                every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    every.tick().await;
                    a.tick().await;
                }
            });
        }
        let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);
        tracing::info!(socket = %agent.cfg.socket.display(), services = agent.services.len(), "agent ready");
        eprintln!(
            "gpusnap agent: ready ({} services, API on {})",
            agent.services.len(),
            agent.cfg.socket.display()
        );
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).map_err(|e| AgentError::Setup(e.to_string()))?;
        let mut int = signal(SignalKind::interrupt()).map_err(|e| AgentError::Setup(e.to_string()))?;
        tokio::select! {
            _ = term.recv() => {},
            _ = int.recv() => {},
        }
        let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
        agent.persist();
        let _ = std::fs::remove_file(&agent.cfg.socket);
        Ok(())
    })
}
