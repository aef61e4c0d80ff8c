//! What the API and the proxies may ask of the agent. They see the services,
//! the metrics and these few requests; how the agent keeps its state and
//! decides stays behind this trait (the policy implements it).

use crate::metrics::Metrics;
use crate::service::Service;
use gpusnap_core::engine::StateReport;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

/// A request under way, owning what it needs.
pub type Pending<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// What a client may ask a service to do: the API's `POST
/// /v1/services/NAME/ACTION` and `gpusnap service NAME ACTION` (with the
/// `clap` feature) name it alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Action {
    /// Take its GPU state to host RAM.
    Suspend,
    /// Move its memory to pinned host RAM, its CUDA context kept on the
    /// GPU (a server the agent started with fast swap).
    Park,
    /// Bring it back, from parked, suspended or hibernated, as a request would.
    Resume,
    /// Dump it into an image and end it.
    Hibernate,
    /// As resume.
    Wake,
    /// End it (suspended first, as `gpusnap stop` does) and start it anew;
    /// only a service the agent started.
    Restart,
}

impl Action {
    pub const ALL: [Action; 6] =
        [Action::Suspend, Action::Park, Action::Resume, Action::Hibernate, Action::Wake, Action::Restart];

    pub fn as_str(self) -> &'static str {
        match self {
            Action::Suspend => "suspend",
            Action::Park => "park",
            Action::Resume => "resume",
            Action::Hibernate => "hibernate",
            Action::Wake => "wake",
            Action::Restart => "restart",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.as_str() == s)
    }
}

/// Why a connection could not be given its service.
#[derive(Debug, Clone)]
pub struct Unavailable(pub String);

/// Why a request is answered at once instead of waiting: its service cannot
/// come back (its start failing, its image gone, too many waiting), and
/// when to try again.
#[derive(Debug, Clone)]
pub struct Refusal {
    pub reason: String,
    pub retry_after: std::time::Duration,
}

pub trait Control: Send + Sync + 'static {
    /// The group whose members may use the API besides root.
    fn api_group(&self) -> Option<&str>;

    /// The services now (a snapshot).
    fn services(&self) -> Arc<Vec<Arc<Service>>>;

    fn service(&self, name: &str) -> Option<Arc<Service>> {
        self.services().iter().find(|s| s.name == name).cloned()
    }

    fn metrics(&self) -> &Metrics;

    /// Waits until `svc` runs, starting whatever transition brings it back,
    /// until `deadline`. Returns whether it had to wait. `accepted`: when
    /// the connection that asks came (the wake it causes is traced from there).
    fn wait_running(
        self: Arc<Self>,
        svc: Arc<Service>,
        deadline: Instant,
        accepted: Option<Instant>,
    ) -> Pending<Result<bool, Unavailable>>;

    /// Why `svc` cannot come back for a request now, if it cannot: its last
    /// start failed and the next is not due, its image is gone with no
    /// remote or cold start to fall back to.
    fn hopeless(&self, svc: &Service) -> Option<Refusal>;

    /// Does `action` to `svc` now; the error says why it could not.
    fn act(
        self: Arc<Self>,
        svc: Arc<Service>,
        action: Action,
    ) -> Pending<Result<(), crate::policy::PolicyError>>;

    /// Every CUDA process of the host, as `gpusnap ps` shows them, read
    /// only: nothing recorded, reconciled or adopted (blocks).
    fn processes(&self) -> Result<Vec<StateReport>, gpusnap_hibernate::Error>;

    /// The CUDA processes among `pids`, each as `gpusnap state` reports it,
    /// read only: nothing recorded or changed, for a probe (blocks). A pid
    /// that is gone or has no CUDA context is left out.
    fn look(&self, pids: &[i32]) -> Result<Vec<StateReport>, gpusnap_hibernate::Error>;

    /// The journal, to read its entries (blocks).
    fn journal_store(&self) -> Result<gpusnap_core::Store, gpusnap_core::Error>;

    /// The metrics as Prometheus text, or OpenMetrics, their gauges read
    /// anew (blocks).
    fn metrics_text(&self, openmetrics: bool) -> String;

    /// Journals `what` on the service's process (blocks).
    fn note(&self, svc: &Service, what: &str);

    /// Reads the config file again and applies it (see `crate::reload`):
    /// what changed, or the one-line error that refused it.
    fn reload(self: Arc<Self>, stop_removed: bool) -> Pending<Result<crate::reload::Outcome, String>>;

    /// Where `svc`'s server writes its output (see `crate::logs`).
    fn log_path(&self, svc: &Service) -> std::path::PathBuf;

    /// What `svc` holds now: GPU, host memory and image bytes (blocks).
    fn held(&self, svc: &Service) -> crate::held::Held;
}
