//! One service: its state, its connections, and what survives the agent
//! (the record in `STATE_DIR/agent/services.json`).

use crate::config::ServiceConfig;
use gpusnap_core::target::Target;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    Starting,
    Running,
    Suspending,
    Suspended,
    /// Its fast-swap library holds its memory in pinned host memory; its
    /// CUDA context stays on the GPU (`gpusnap park`).
    Parked,
    Resuming,
    Hibernating,
    Hibernated,
    Waking,
    Stopping,
    /// The process is gone (died, or could not be started); restarted when allowed.
    Dead,
    /// An adopted server (`pid_file`, `cgroup`) whose process ended: the
    /// agent never starts what it did not start. A new process that its
    /// owner starts (a newer pid file, a process in the cgroup) is adopted.
    Exited,
    /// Its CUDA context faulted and its guard holds the process from dying
    /// (`on_fault = "hold"`): not routed to, not restarted, until the
    /// operator ends the process (`gpusnap stop --force`).
    Faulted,
    /// An on-demand service before its first request: nothing started yet
    /// (or a start from its remote refused); its first request starts it.
    Idle,
}

impl State {
    pub const ALL: [State; 14] = [
        State::Starting,
        State::Running,
        State::Suspending,
        State::Suspended,
        State::Parked,
        State::Resuming,
        State::Hibernating,
        State::Hibernated,
        State::Waking,
        State::Stopping,
        State::Dead,
        State::Exited,
        State::Faulted,
        State::Idle,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            State::Starting => "starting",
            State::Running => "running",
            State::Suspending => "suspending",
            State::Suspended => "suspended",
            State::Parked => "parked",
            State::Resuming => "resuming",
            State::Hibernating => "hibernating",
            State::Hibernated => "hibernated",
            State::Waking => "waking",
            State::Stopping => "stopping",
            State::Dead => "dead",
            State::Exited => "exited",
            State::Faulted => "faulted",
            State::Idle => "idle",
        }
    }

    /// A transition is under way: nobody else may start one.
    pub fn in_transition(self) -> bool {
        matches!(
            self,
            State::Starting
                | State::Suspending
                | State::Resuming
                | State::Hibernating
                | State::Waking
                | State::Stopping
        )
    }
}

/// One client connection as the idle rule sees it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Conn {
    /// The client sent bytes that the backend has not answered yet: a request
    /// is in flight, however long the backend thinks.
    pub awaiting: bool,
    /// When the request in flight stops counting (`request_timeout` after
    /// its first byte): a request never finished must not keep the service
    /// busy for ever. None: never.
    pub stale_at: Option<Instant>,
    /// Connected to the backend: CRIU cannot dump the backend's half, so a
    /// hibernate closes it first (the connection being idle).
    pub backend: bool,
}

impl Conn {
    /// A request is in flight and not yet past `request_timeout`.
    pub fn busy(&self) -> bool {
        self.awaiting && self.stale_at.is_none_or(|t| Instant::now() < t)
    }
}

#[derive(Debug)]
pub struct Inner {
    pub state: State,
    /// The service's program (the root of its process tree).
    pub process: Option<Target>,
    /// `gpusnap run --light` that started it, when the agent did.
    pub runner: Option<i32>,
    /// Its image while hibernated (and while being woken).
    pub image: Option<String>,
    pub conns: HashMap<u64, Conn>,
    pub last_activity: Instant,
    pub last_used_ms: i64,
    /// When the current state was entered.
    pub since: Instant,
    pub waiting: usize,
    pub restarts: u32,
    pub restart_at: Option<Instant>,
    pub last_error: Option<String>,
    /// No hibernation before this (one failed: CRIU missing, say); the
    /// policy must not retry it every tick.
    pub hibernate_not_before: Option<Instant>,
    /// A state change the agent makes itself (hibernate, stop): the process
    /// ending is expected, not a crash.
    pub ending_on_purpose: bool,
    /// When an adopted server's process was seen gone: a pid file written
    /// after this names its successor.
    pub exited_at: Option<std::time::SystemTime>,
    /// The phases of the wake a connection caused, until a waiting
    /// connection takes it to add its connect and first byte.
    pub trace: Option<crate::trace::WakeTrace>,
    /// What the service held on the GPU (NVML, all its processes) just
    /// before its last before_suspend hook: what it takes again once its
    /// after_resume hook has run, and what admission must find room for.
    pub full_footprint: Option<u64>,
    /// Bumped when an after_resume hook fails: the connections that waited
    /// for that resume are answered 503 instead of starting another.
    pub hook_failures: u64,
    /// What its last suspend checkpointed off the GPU (bytes).
    pub footprint: Option<u64>,
    /// How the agent started its process (None: adopted, or started by an
    /// agent that did not record it).
    pub launched: Option<Launched>,
    /// How the config differs from what the process was started with
    /// (`command`, `fast_swap`): it runs as it was started until restarted.
    pub drift: Option<String>,
}

pub struct Service {
    pub cfg: ServiceConfig,
    pub name: String,
    pub inner: Mutex<Inner>,
    /// Bumped on every state change; waiters watch it.
    pub changed: tokio::sync::watch::Sender<u64>,
    /// Backend connections the front door holds open (kept or in use): a
    /// hibernation waits for them to be closed before CRIU's dump.
    pub backend_conns: tokio::sync::watch::Sender<usize>,
    /// A pod's service: the host pid of its container's first process, as
    /// the runtime last said (0: none running).
    pod_pid: std::sync::atomic::AtomicI32,
    /// Whether its process runs with fast swap: 0 as the config says, 1
    /// yes, 2 no (read without the lock: `parks` is asked under it).
    runs_fast_swap: std::sync::atomic::AtomicU8,
}

/// How long a service brought back stays on the GPU before an eviction may
/// take it off again, unless its `min_resident` says otherwise. Long enough
/// that two clients alternating between two models on one GPU are served in
/// turns of a few requests each rather than one swap per request (a parked
/// model of tens of GB comes back in well under a second, so a turn of 2 s
/// spends at most about a third of the time moving memory), short enough
/// that the other model's first request waits little more than a swap.
pub const MIN_RESIDENT: Duration = Duration::from_secs(2);

impl Service {
    /// Whether it is parked rather than suspended when idle or evicted: a
    /// server the agent started with fast swap and no before_suspend hook
    /// (the hook's server gives its memory back itself: it is suspended),
    /// unless its `park = false`.
    /// A process started with another `fast_swap` than the config says now
    /// (see [`Launched::drift`]) parks as it was started.
    pub fn parks(&self) -> bool {
        let fast = match self.runs_fast_swap.load(std::sync::atomic::Ordering::Relaxed) {
            1 => true,
            2 => false,
            _ => self.cfg.fast_swap_on(),
        };
        self.cfg.park != Some(false) && fast && self.cfg.hooks.before_suspend.is_none()
    }

    /// Records how its process was started (None: as the config says).
    pub fn set_launched(&self, inner: &mut Inner, launched: Option<Launched>) {
        let v = launched.as_ref().map_or(0, |l| if l.fast_swap { 1 } else { 2 });
        self.runs_fast_swap.store(v, std::sync::atomic::Ordering::Relaxed);
        inner.drift = launched.as_ref().and_then(|l| l.drift(&self.cfg));
        inner.launched = launched;
    }

    /// See [`MIN_RESIDENT`].
    pub fn min_resident(&self) -> Duration {
        self.cfg.min_resident.unwrap_or(MIN_RESIDENT)
    }

    pub fn new(cfg: ServiceConfig) -> Self {
        let name = cfg.name.get_ref().clone();
        Self {
            cfg,
            name,
            inner: Mutex::new(Inner {
                state: State::Dead,
                process: None,
                runner: None,
                image: None,
                conns: HashMap::new(),
                last_activity: Instant::now(),
                last_used_ms: gpusnap_core::store::now_ms(),
                since: Instant::now(),
                waiting: 0,
                restarts: 0,
                restart_at: None,
                last_error: None,
                hibernate_not_before: None,
                ending_on_purpose: false,
                exited_at: None,
                trace: None,
                full_footprint: None,
                hook_failures: 0,
                footprint: None,
                launched: None,
                drift: None,
            }),
            changed: tokio::sync::watch::channel(0).0,
            backend_conns: tokio::sync::watch::channel(0).0,
            pod_pid: std::sync::atomic::AtomicI32::new(0),
            runs_fast_swap: std::sync::atomic::AtomicU8::new(0),
        }
    }

    /// A pod's service: its container's pid, as the runtime last said.
    pub fn pod_pid(&self) -> Option<i32> {
        Some(self.pod_pid.load(std::sync::atomic::Ordering::Relaxed)).filter(|p| *p > 0)
    }

    pub fn set_pod_pid(&self, pid: Option<i32>) {
        self.pod_pid.store(pid.unwrap_or(0), std::sync::atomic::Ordering::Relaxed);
    }

    pub fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic in another holder leaves plain data behind: keep serving.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn set_state(&self, inner: &mut Inner, state: State) {
        if inner.state != state {
            tracing::info!(service = self.name, from = inner.state.as_str(), to = state.as_str(), "state");
            // Back to serving after a start, resume or wake: the last error
            // is history (the journal keeps it).
            if state == State::Running
                && matches!(inner.state, State::Starting | State::Resuming | State::Waking)
            {
                inner.last_error = None;
            }
            inner.state = state;
            inner.since = Instant::now();
            // A wake's trace lives through Waking, Resuming and Running
            // until a connection takes it; any other state ends it untaken.
            if !matches!(state, State::Waking | State::Resuming | State::Running) {
                inner.trace = None;
            }
        }
        self.changed.send_modify(|v| *v += 1);
    }

    /// Adds to the trace of the wake under way, if a connection caused it.
    pub fn trace(&self, f: impl FnOnce(&mut crate::trace::WakeTrace)) {
        if let Some(t) = self.lock().trace.as_mut() {
            f(t);
        }
    }

    /// No bytes for `after`, no request awaiting its answer, nobody waiting.
    pub fn idle_for(inner: &Inner, after: Duration) -> bool {
        inner.waiting == 0 && !inner.conns.values().any(Conn::busy) && inner.last_activity.elapsed() >= after
    }

    /// Busy enough that it must not be taken off the GPU for another service,
    /// nor hibernated: a connection waits for it, or a request is in flight
    /// (for at most `request_timeout`). Idle connections do not count.
    pub fn has_traffic(inner: &Inner) -> bool {
        inner.waiting > 0 || inner.conns.values().any(Conn::busy)
    }
}

/// What a server was started with, of what its config may change: a
/// process found again after the config changed is not what the config
/// says (see [`Launched::drift`]).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Launched {
    pub command: Vec<String>,
    pub fast_swap: bool,
}

impl Launched {
    /// What a server started now from `cfg` would be started with.
    pub fn of(cfg: &ServiceConfig) -> Option<Self> {
        Some(Self { command: cfg.command.clone()?, fast_swap: cfg.fast_swap_on() })
    }

    /// How `cfg` differs from this, in words (None: it does not).
    pub fn drift(&self, cfg: &ServiceConfig) -> Option<String> {
        let now = Self::of(cfg)?;
        let mut what = Vec::new();
        if now.command != self.command {
            what.push(format!("command (it runs {:?}, the config says {:?})", self.command, now.command));
        }
        if now.fast_swap != self.fast_swap {
            what.push(format!(
                "fast_swap (it runs with {}, the config says {})",
                self.fast_swap, now.fast_swap
            ));
        }
        if what.is_empty() {
            return None;
        }
        Some(format!(
            "the config changed since its process was started: {}; it runs as it was started until \
             `gpusnap service NAME restart`",
            what.join(", ")
        ))
    }
}

/// What the agent must find again after a crash or a restart.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Persisted {
    pub pid: Option<i32>,
    pub start_time: Option<u64>,
    pub comm: Option<String>,
    pub runner: Option<i32>,
    pub image: Option<String>,
    /// The transition under way when this was written ("hibernate", "wake").
    pub doing: Option<String>,
    /// [`Inner::full_footprint`], kept for the next agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub full_footprint: Option<u64>,
    /// [`Inner::launched`], kept for the next agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launched: Option<Launched>,
}

pub fn state_file(state_dir: &Path) -> std::path::PathBuf {
    state_dir.join("agent").join("services.json")
}

pub fn load_persisted(state_dir: &Path) -> BTreeMap<String, Persisted> {
    std::fs::read(state_file(state_dir))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

/// Temp name + fsync + rename: a crash leaves the old file or the new one.
pub fn save_persisted(state_dir: &Path, all: &BTreeMap<String, Persisted>) -> std::io::Result<()> {
    use std::io::Write;
    let path = state_file(state_dir);
    let dir = path.parent().unwrap_or(state_dir);
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    let tmp = dir.join(format!(".services.json.{}", std::process::id()));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)?;
    {
        use std::os::unix::fs::PermissionsExt;
        f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    }
    f.write_all(&serde_json::to_vec_pretty(all).map_err(std::io::Error::other)?)?;
    f.sync_all()?;
    std::fs::rename(&tmp, &path)?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}
