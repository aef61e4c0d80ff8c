//! The agent's state and its one owner, [`Agent`]: the configuration, the
//! services, the metrics, the driver and NVML, the image store, the record
//! that outlives the agent and the journal. The policy, the API and the
//! proxies reach it only through the methods here (the API and the proxies
//! through `Control`, which the policy implements on it).

use crate::config::{AgentConfig, Config};
use crate::error::AgentError;
use crate::metrics::Metrics;
use crate::service::{self, Persisted, Service, State};
use gpusnap_core::target::{self, Target};
use gpusnap_core::tree::process_tree;
use gpusnap_core::{Engine, Store};
use gpusnap_cuda::{CheckpointApi, Deadline};
use gpusnap_gpu::GpuInventory;
use gpusnap_hibernate::criu::Criu;
use gpusnap_images::image::ImageStore;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

pub type DynEngine = Engine<Box<dyn CheckpointApi>, Box<dyn GpuInventory>>;

/// What the caller (the CLI) hands the agent.
pub struct Setup {
    pub config: Config,
    pub state_dir: PathBuf,
    pub criu: Option<PathBuf>,
    pub api: Deadline<Box<dyn CheckpointApi>>,
    pub gpus: Box<dyn GpuInventory>,
    /// The gpusnap binary that runs services (`run --light`).
    pub exe: PathBuf,
    /// The file the config was read from: what a reload reads again
    /// (None: a reload is refused).
    pub config_path: Option<PathBuf>,
}

pub struct Agent {
    cfg: AgentConfig,
    kubernetes: Option<crate::config::KubernetesConfig>,
    /// The services: the file's, then the pods found on the node as they
    /// come and go. Readers take a snapshot (the `Arc`), which a change
    /// replaces.
    services: std::sync::RwLock<Arc<Vec<Arc<Service>>>>,
    metrics: Metrics,
    state_dir: PathBuf,
    images: ImageStore,
    exe: PathBuf,
    criu_path: Option<PathBuf>,
    /// The driver and NVML, loaded once; each operation forks its own engine.
    base: Mutex<DynEngine>,
    /// One admission decision (or cold start) at a time.
    gpu_lock: tokio::sync::Mutex<()>,
    /// The runners the agent started, reaped once they end.
    children: Mutex<Vec<std::process::Child>>,
    persist_lock: Mutex<()>,
    /// What a reload needs: the config as served, the changes waiting for
    /// their service to be idle, the proxies' listeners.
    pub(crate) reloading: crate::reload::Reloading,
}

impl Agent {
    pub fn new(s: Setup) -> Result<Self, AgentError> {
        let store = Store::open(&s.state_dir)?;
        // The agent wakes images it hibernated itself (this host's key) and
        // those signed by the keys of `[agent] trust`.
        let images = ImageStore::new(
            s.state_dir.join("images"),
            gpusnap_images::sign::Trust::new(&s.state_dir, &s.config.agent.trust).map_err(|e| match e {
                // A key of `trust` that does not parse: bad input (exit 2).
                gpusnap_images::sign::SignError::BadKey(_) | gpusnap_images::sign::SignError::BadScope(_) => {
                    AgentError::Config(crate::config::ConfigError::Read {
                        path: "[agent] trust".into(),
                        reason: e.to_string(),
                    })
                }
                e => gpusnap_hibernate::Error::from(e).into(),
            })?,
        );
        let reloading = crate::reload::Reloading::new(s.config_path.clone(), &s.config.raw);
        let services = s.config.service.into_iter().map(|c| Arc::new(Service::new(c))).collect();
        Ok(Self {
            cfg: s.config.agent,
            kubernetes: s.config.kubernetes,
            services: std::sync::RwLock::new(Arc::new(services)),
            metrics: Metrics::new(),
            images,
            state_dir: s.state_dir,
            exe: s.exe,
            criu_path: s.criu,
            base: Mutex::new(Engine::new(s.api, s.gpus, store)),
            gpu_lock: tokio::sync::Mutex::new(()),
            children: Mutex::new(Vec::new()),
            persist_lock: Mutex::new(()),
            reloading,
        })
    }

    pub fn cfg(&self) -> &AgentConfig {
        &self.cfg
    }

    /// `[kubernetes]`, when the agent follows the node's pods.
    pub fn kubernetes(&self) -> Option<&crate::config::KubernetesConfig> {
        self.kubernetes.as_ref()
    }

    /// The services now (a snapshot: a pod may come or go meanwhile).
    pub fn services(&self) -> Arc<Vec<Arc<Service>>> {
        Arc::clone(&self.services.read().unwrap_or_else(|e| e.into_inner()))
    }

    pub fn service(&self, name: &str) -> Option<Arc<Service>> {
        self.services().iter().find(|s| s.name == name).cloned()
    }

    /// Adds a service (a pod found on the node); false when the name is taken.
    pub fn add_service(&self, svc: Arc<Service>) -> bool {
        let mut all = self.services.write().unwrap_or_else(|e| e.into_inner());
        if all.iter().any(|s| s.name == svc.name) {
            return false;
        }
        let mut next = Vec::clone(&all);
        next.push(svc);
        *all = Arc::new(next);
        true
    }

    /// Puts `svc` in the place of the service of its name (a reload that
    /// changed its config); false when there is none.
    pub fn replace_service(&self, svc: Arc<Service>) -> bool {
        let mut all = self.services.write().unwrap_or_else(|e| e.into_inner());
        let Some(at) = all.iter().position(|s| s.name == svc.name) else { return false };
        let mut next = Vec::clone(&all);
        next[at] = svc;
        *all = Arc::new(next);
        true
    }

    /// Removes a service (a pod gone from the node); its record goes with
    /// the next write of the records.
    pub fn remove_service(&self, name: &str) -> Option<Arc<Service>> {
        let mut all = self.services.write().unwrap_or_else(|e| e.into_inner());
        let gone = all.iter().find(|s| s.name == name).cloned()?;
        *all = Arc::new(all.iter().filter(|s| s.name != name).cloned().collect());
        Some(gone)
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    pub fn images(&self) -> &ImageStore {
        &self.images
    }

    /// The gpusnap binary that runs services and guards.
    pub fn exe(&self) -> &Path {
        &self.exe
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

    /// Held for one admission decision or cold start: two services coming
    /// back together must not count the same free memory.
    pub async fn gpu_lock(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.gpu_lock.lock().await
    }

    /// Keeps a runner the agent started, to be reaped once it ends.
    pub fn keep_child(&self, child: std::process::Child) {
        self.children.lock().unwrap_or_else(|e| e.into_inner()).push(child);
    }

    /// Collects the runners the agent started that have ended.
    pub fn reap(&self) {
        let mut kids = self.children.lock().unwrap_or_else(|e| e.into_inner());
        kids.retain_mut(|c| !matches!(c.try_wait(), Ok(Some(_)) | Err(_)));
    }

    pub(crate) fn persisted_of(svc: &Service) -> Persisted {
        let g = svc.lock();
        Persisted {
            pid: g.process.as_ref().map(|t| t.pid),
            start_time: g.process.as_ref().map(|t| t.start_time),
            comm: g.process.as_ref().map(|t| t.comm.clone()),
            runner: g.runner,
            image: g.image.clone(),
            doing: None,
            full_footprint: g.full_footprint,
            launched: g.launched.clone(),
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
        for s in self.services().iter() {
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

    /// What the previous agent recorded, per service.
    pub fn load_persisted(&self) -> BTreeMap<String, Persisted> {
        service::load_persisted(&self.state_dir)
    }

    /// Journals a decision on the service's process (or the one it last had).
    pub fn journal(&self, svc: &Service, t: Option<&Target>, what: &str) {
        tracing::info!(service = svc.name, "{what}");
        let t = t.cloned().or_else(|| svc.lock().process.clone());
        let Some(t) = t else { return };
        let detail = format!("{}: {what}", svc.name);
        if let Err(err) = Store::open(&self.state_dir).and_then(|mut s| s.note(&t, "agent", None, &detail)) {
            tracing::warn!(service = svc.name, "could not journal: {err}");
        }
    }

    /// Journals `what` on a process that is no service's (yet): a pod the
    /// agent does not serve.
    pub fn note_on(&self, t: &Target, op: &str, what: &str) {
        if let Err(err) = Store::open(&self.state_dir).and_then(|mut s| s.note(t, op, None, what)) {
            tracing::warn!(pid = t.pid, "could not journal: {err}");
        }
    }

    /// The CUDA processes of a service: those of its tree that map libcuda or
    /// that the driver knows (a driver library installed under another name).
    pub fn cuda_pids(&self, root: i32) -> Vec<i32> {
        cuda_pids_in(self.engine().ok().as_mut(), root)
    }

    /// The gauges that are read from the world rather than counted.
    pub fn refresh_gauges(&self) {
        let mut by_state = std::collections::HashMap::new();
        let mut host = 0u64;
        let mut images = 0u64;
        let store = Store::open(&self.state_dir).ok();
        let mut fast = Vec::new();
        for s in self.services().iter() {
            let g = s.lock();
            *by_state.entry(g.state).or_insert(0i64) += 1;
            if s.cfg.fast_swap_on() && matches!(g.state, State::Running | State::Suspended) {
                fast.extend(g.process.as_ref().map(|t| t.pid));
            }
            if g.state == State::Suspended {
                if let (Some(t), Some(st)) = (g.process.as_ref(), store.as_ref()) {
                    for pid in self.cuda_pids(t.pid) {
                        if let Ok(Some(r)) = st.latest_for_pid(pid) {
                            host += r.footprint_bytes();
                        }
                    }
                }
            }
            // Parked: what the fast-swap libraries hold in host memory.
            if let Some(t) = g.process.as_ref().filter(|_| g.state == State::Parked) {
                for pid in self.cuda_pids(t.pid) {
                    host += gpusnap_core::swap::status(pid).map_or(0, |s| s.movable_bytes);
                }
            }
            if let Some(image) = g.image.as_ref().filter(|_| g.state == State::Hibernated) {
                if let Ok((_, m)) = self.images.manifest(image) {
                    images += m.files.iter().map(|f| f.size).sum::<u64>();
                }
            }
        }
        for st in State::ALL {
            let n = by_state.get(&st).copied().unwrap_or(0);
            self.metrics
                .services
                .get_or_create(&crate::metrics::StateLabels { state: st.as_str().into() })
                .set(n);
        }
        self.metrics.host_bytes.set(host);
        self.metrics.image_bytes.set(images);
        // Asked with no service's lock held (each answer is bounded in time).
        let pinned: u64 = fast
            .into_iter()
            .flat_map(|root| self.cuda_pids(root))
            .filter_map(gpusnap_core::swap::status)
            .map(|st| st.pinned_bytes)
            .sum();
        self.metrics.pinned_bytes.set(pinned);
    }
}

/// [`Agent::cuda_pids`] with an engine the caller already has.
pub fn cuda_pids_in(mut e: Option<&mut DynEngine>, root: i32) -> Vec<i32> {
    let tree: Vec<i32> = process_tree(root).into_iter().map(|(p, _)| p).collect();
    tree.into_iter()
        .filter(|p| target::pid_maps_libcuda(*p) || e.as_mut().is_some_and(|e| e.state(*p).is_ok()))
        .collect()
}
