//! The agent's TOML configuration: `[agent]` and one `[[service]]` per model
//! server. Every error names the file and the line (toml's spans give it).

use crate::bounds::{bytes, count, key_offset, section_start, within, DAY, MAX_CONNECTIONS, MS, SEC, TIB};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;
use toml::Spanned;

mod access;
mod hints;
mod hooks;
mod http;
mod kubernetes;

use crate::units::{duration, duration_opt, duration_or_never, size, size_opt};
pub use crate::units::{parse_duration, parse_size};
pub use access::sockets_apart;
pub use hooks::{Hook, Hooks};
pub use http::HttpLimits;
pub use kubernetes::{KubernetesConfig, PodRef};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: {reason}")]
    Read { path: String, reason: String },
    #[error("{path}:{line}: {reason}")]
    Invalid { path: String, line: usize, reason: String },
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub agent: AgentConfig,
    #[serde(default)]
    pub service: Vec<ServiceConfig>,
    /// The pods of this node, found through the runtime's CRI socket.
    pub kubernetes: Option<KubernetesConfig>,
    /// The file as TOML, what a reload compares (see `crate::reload`).
    #[serde(skip)]
    pub(crate) raw: toml::Table,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    /// The admin socket: the whole API, for root and `group`. Never in a
    /// directory a pod mounts.
    #[serde(default = "default_socket")]
    pub socket: PathBuf,
    /// The probe socket: only `GET /v1/processes?tree=PID`, for anyone,
    /// about the caller's own pid namespace. Its directory is the agent's
    /// alone (root's, 0755), the one pods may mount read-only. Unset: see
    /// [`AgentConfig::probe_path`].
    pub probe_socket: Option<PathBuf>,
    /// Peers allowed on the admin socket besides root (a name or a numeric gid).
    pub group: Option<Spanned<String>>,
    pub metrics_listen: Option<SocketAddr>,
    /// Below this much available host memory, suspended services are hibernated.
    #[serde(default, deserialize_with = "size_opt")]
    pub min_host_available: Option<u64>,
    /// Pinned host memory each fast-swap server may keep (environ::pinned_budget).
    #[serde(default, deserialize_with = "size_opt")]
    pub pinned_budget: Option<u64>,
    /// How often the policy looks at idleness and host memory.
    #[serde(default = "default_tick", deserialize_with = "duration")]
    pub tick: Duration,
    /// Transparent huge pages `always` for the length of each suspend (as
    /// `gpusnap suspend --thp`): the driver's checkpoint, bound by host page
    /// faults, runs about 2x faster; every process of the host gets huge
    /// pages meanwhile. A service may say otherwise.
    #[serde(default)]
    pub thp: bool,
    /// Wake hibernated services lazily (the page server fills their memory
    /// while the driver already restores). Off by default: a lazy wake does
    /// not survive the death of its gpusnap, and the agent must survive
    /// `kill -9` at any moment. A service may say otherwise.
    #[serde(default)]
    pub lazy_wake: bool,
    /// The front door: one HTTP listener for every service, routing by the
    /// request's `model` (docs/guides/many-models-one-endpoint.md).
    pub http_listen: Option<SocketAddr>,
    #[serde(default)]
    pub http: HttpLimits,
    /// Client connections the agent holds in all, on every listener
    /// (unset: what its open-file limit leaves, see docs/design/agent.md).
    pub max_connections: Option<usize>,
    /// How long a client may take to send a request's headers (API, metrics)
    /// or its first byte (a service's port) before it is closed.
    #[serde(default = "default_header_timeout", deserialize_with = "duration")]
    pub header_timeout: Duration,
    /// Start each server in a systemd scope of its own, so that its memory
    /// is charged there, not to the agent's unit (see crate::scope).
    #[serde(default)]
    pub server_scope: crate::scope::ServerScope,
    /// Keys whose images the agent wakes besides this host's own (as
    /// `images pull --trust`): 64 hex digits, or the path of a file holding
    /// them. Another node's key, for the images it pushed to a `remote`.
    #[serde(default)]
    pub trust: Vec<String>,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            socket: default_socket(),
            probe_socket: None,
            group: None,
            metrics_listen: None,
            min_host_available: None,
            pinned_budget: None,
            tick: default_tick(),
            thp: false,
            lazy_wake: false,
            http_listen: None,
            http: Default::default(),
            max_connections: None,
            header_timeout: default_header_timeout(),
            server_scope: Default::default(),
            trust: Vec::new(),
        }
    }
}

fn default_socket() -> PathBuf {
    PathBuf::from("/run/gpusnap/admin/agent.sock")
}

impl AgentConfig {
    /// The probe socket: `probe_socket`, else `/run/gpusnap/probe/probe.sock`
    /// beside the default admin socket, else `probe/probe.sock` in the
    /// admin socket's directory (an agent of its own, a test's).
    pub fn probe_path(&self) -> PathBuf {
        if let Some(p) = &self.probe_socket {
            return p.clone();
        }
        if self.socket == default_socket() {
            return PathBuf::from("/run/gpusnap/probe/probe.sock");
        }
        self.socket.parent().unwrap_or(Path::new(".")).join("probe").join("probe.sock")
    }
}

fn default_tick() -> Duration {
    Duration::from_millis(200)
}

pub(crate) fn default_header_timeout() -> Duration {
    Duration::from_secs(10)
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceConfig {
    pub name: Spanned<String>,
    /// The proxy's address (`wake_on = "proxy"`); none with `"socket"`.
    pub listen: Option<Spanned<SocketAddr>>,
    pub backend: SocketAddr,
    /// How a request brings the service back: through the agent's proxy on
    /// `listen`, or seen on the server's own port (`backend`) in the kernel.
    #[serde(default)]
    pub wake_on: WakeOn,
    /// `wake_on = "socket"`: the network namespace the server listens in
    /// (`/run/netns/NAME`, `/proc/PID/ns/net`); unset: its process's own.
    pub netns: Option<PathBuf>,
    /// `wake_on = "socket"`: peers (addresses or CIDRs) whose connections
    /// neither wake the service nor count as traffic (a kubelet's httpGet
    /// probes). Unset: the node's own addresses but loopback when the server
    /// has a namespace of its own, none when it shares the agent's.
    pub ignore_peers: Option<Vec<Spanned<String>>>,
    /// `wake_on = "socket"`: how often the port is looked at while the
    /// service is off the GPU (suspended, hibernated).
    #[serde(default = "default_socket_poll", deserialize_with = "duration")]
    pub socket_poll: Duration,
    /// `wake_on = "socket"`: how often while it runs (idleness only).
    #[serde(default = "default_socket_poll_running", deserialize_with = "duration")]
    pub socket_poll_running: Duration,
    pub command: Option<Vec<String>>,
    pub pid_file: Option<PathBuf>,
    pub cgroup: Option<PathBuf>,
    #[serde(default = "default_suspend_after", deserialize_with = "duration_or_never")]
    pub suspend_after: Option<Duration>,
    #[serde(default, deserialize_with = "duration_or_never")]
    pub hibernate_after: Option<Duration>,
    #[serde(default = "default_wake_timeout", deserialize_with = "duration")]
    pub wake_timeout: Duration,
    /// See `Service::min_resident` (unset: its default).
    #[serde(default, deserialize_with = "duration_opt")]
    pub min_resident: Option<Duration>,
    /// See `Service::parks` (unset: parked when it can be).
    pub park: Option<bool>,
    #[serde(default)]
    pub priority: i64,
    #[serde(default = "yes")]
    pub restart: bool,
    /// Connections allowed to wait for the service at once; more are closed.
    #[serde(default = "default_max_waiting")]
    pub max_waiting: usize,
    /// Extra GPU memory required beyond the footprint on resume.
    #[serde(default = "default_margin", deserialize_with = "size")]
    pub margin: u64,
    /// What the server takes on the GPU once loaded: before a (cold) start,
    /// idle services are suspended until this much is free. Unset: started
    /// as is (a server that finds the GPU full fails and is restarted).
    #[serde(default, deserialize_with = "size_opt")]
    pub gpu_memory: Option<u64>,
    /// Overrides `[agent] thp` for this service's suspends.
    pub thp: Option<bool>,
    /// Overrides `[agent] lazy_wake` for this service's wakes.
    pub lazy_wake: Option<bool>,
    /// HTTP calls to the server's own backend around its suspends and
    /// resumes (vLLM's sleep mode, SGLang's memory release): see docs/design/agent.md.
    #[serde(default)]
    pub hooks: Hooks,
    /// The model names the front door routes to this service.
    #[serde(default)]
    pub models: Vec<Spanned<String>>,
    /// `"boot"`: started with the agent; `"on-demand"`: at its first request.
    #[serde(default)]
    pub start: Start,
    /// The service speaks HTTP: a request it cannot serve (max_waiting
    /// full, its start failing, its image gone, wake_timeout reached) gets a
    /// 503 with a JSON reason and `Retry-After` on its own port too.
    #[serde(default)]
    pub fail_fast: bool,
    /// `s3://BUCKET/PREFIX` or `file://DIR`: each image of the service is
    /// pushed there once hibernated; a wake whose local image is gone pulls it.
    pub remote: Option<Spanned<String>>,
    /// Client connections open on the service's port at once; more are
    /// closed as they arrive.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// How long a request may go unanswered (bytes sent, none back) and
    /// still keep the service busy: after it, the connection counts as
    /// idle (for suspend_after, evictions and hibernation).
    #[serde(default = "default_request_timeout", deserialize_with = "duration_or_never")]
    pub request_timeout: Option<Duration>,
    /// Variables of the agent's own environment the server gets (besides
    /// the few every server gets: see docs/reference/config.md).
    #[serde(default)]
    pub pass_environment: Vec<String>,
    /// Variables set for the server.
    #[serde(default)]
    pub environment: std::collections::BTreeMap<String, String>,
    /// The user the server runs as (a name or a uid); unset: the agent's.
    pub user: Option<Spanned<String>>,
    /// The server's group (a name or a gid); unset: the user's primary group.
    pub group: Option<Spanned<String>>,
    /// What the guard does when the server's CUDA context faults (`gpusnap
    /// run --on-fault`): `exit` (it dies and is restarted as any death),
    /// `hold` (kept from dying, the service `faulted` until the operator
    /// ends it).
    #[serde(default)]
    pub on_fault: OnFault,
    /// Fast swap (`gpusnap run --light --fast-swap`): the server's library
    /// moves its device memory itself at the host link's speed on each
    /// suspend and resume (docs/design/fast-swap.md). On by default for a
    /// server the agent starts; `false` leaves every byte to the driver.
    #[serde(default)]
    pub fast_swap: Option<Spanned<bool>>,
    /// With `fast_swap`: the pinned host copies stay after each resume
    /// (`--keep-pinned`), so every suspend after the first copies at once.
    #[serde(default)]
    pub keep_pinned: Option<Spanned<bool>>,
    /// Who besides root may act on the service through the API (suspend,
    /// resume, hibernate, wake, restart): users (names or uids). Unset with
    /// `allow_groups`: every member of the agent's group.
    pub allow_users: Option<Vec<Spanned<String>>>,
    /// The same, by group (names or gids, primary or supplementary).
    pub allow_groups: Option<Vec<Spanned<String>>>,
    /// Made for a pod of the node (`[kubernetes]`), not read from the file.
    #[serde(skip)]
    pub(crate) pod: Option<PodRef>,
}

/// `wake_on`: what brings a suspended service back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WakeOn {
    /// A connection to the agent's proxy on `listen`.
    #[default]
    Proxy,
    /// A connection or bytes on the server's own port, seen through the
    /// kernel's sock_diag; no proxy.
    Socket,
}

impl WakeOn {
    pub fn as_str(self) -> &'static str {
        match self {
            WakeOn::Proxy => "proxy",
            WakeOn::Socket => "socket",
        }
    }
}

/// When the agent starts a service it starts itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Start {
    #[default]
    Boot,
    OnDemand,
}

/// `on_fault`: the guard's policy for a faulted CUDA context.
pub use gpusnap_guard::OnFault;

impl ServiceConfig {
    /// Whether the agent started it (and may end it) or adopted it.
    pub fn adopted(&self) -> bool {
        self.command.is_none()
    }

    /// Where clients connect: the proxy, or the server itself.
    pub fn client_addr(&self) -> SocketAddr {
        self.listen.as_ref().map_or(self.backend, |l| *l.get_ref())
    }

    /// Whether the server runs with fast swap: one the agent starts, unless
    /// the file says `fast_swap = false`.
    pub fn fast_swap_on(&self) -> bool {
        !self.adopted() && self.fast_swap.as_ref().map(|f| *f.get_ref()) != Some(false)
    }

    /// Whether its pinned host copies stay after each resume.
    pub fn keep_pinned_on(&self) -> bool {
        self.fast_swap_on() && self.keep_pinned.as_ref().is_some_and(|k| *k.get_ref())
    }

    /// The parsed `ignore_peers`, if given (checked when the file was read).
    pub fn ignore_peers(&self) -> Option<Vec<crate::peers::Cidr>> {
        self.ignore_peers
            .as_ref()
            .map(|v| v.iter().filter_map(|p| crate::peers::Cidr::parse(p.get_ref()).ok()).collect())
    }
}

fn default_socket_poll() -> Duration {
    Duration::from_millis(1)
}
fn default_socket_poll_running() -> Duration {
    Duration::from_millis(100)
}
fn default_suspend_after() -> Option<Duration> {
    Some(Duration::from_secs(300))
}
fn default_wake_timeout() -> Duration {
    Duration::from_secs(120)
}
fn default_max_waiting() -> usize {
    1024
}
pub(crate) fn default_max_connections() -> usize {
    1024
}
fn default_request_timeout() -> Option<Duration> {
    Some(Duration::from_secs(600))
}
fn default_margin() -> u64 {
    256 << 20
}
fn yes() -> bool {
    true
}

/// The `[agent] socket` of a config that need only be TOML (a file being
/// edited, which a reload may refuse): the default when it names none;
/// None when it is not TOML.
pub fn socket_in(text: &str) -> Option<PathBuf> {
    let t: toml::Table = toml::from_str(text).ok()?;
    let named = t.get("agent").and_then(|a| a.get("socket")).and_then(|s| s.as_str()).map(PathBuf::from);
    Some(named.unwrap_or_else(|| AgentConfig::default().socket))
}

fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].bytes().filter(|b| *b == b'\n').count() + 1
}

impl Config {
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::Read { path: path.display().to_string(), reason: e.to_string() })?;
        Self::parse(&text, &path.display().to_string())
    }

    pub fn parse(text: &str, path: &str) -> Result<Self, ConfigError> {
        let invalid = |offset: usize, reason: String| ConfigError::Invalid {
            path: path.to_string(),
            line: line_of(text, offset),
            reason,
        };
        let mut cfg: Config = toml::from_str(text).map_err(|e| {
            let offset = e.span().map_or(0, |s| s.start);
            invalid(offset, hints::explain(text, offset, e.message().trim()))
        })?;
        if let Some(g) = &cfg.agent.group {
            if crate::peer::group_id(g.get_ref()).is_none() {
                return Err(invalid(
                    g.span().start,
                    format!("group {:?}: no such group on this host", g.get_ref()),
                ));
            }
        }
        access::check(&cfg).map_err(|(offset, reason)| invalid(offset, reason))?;
        let mut names = std::collections::HashMap::new();
        let mut ports = std::collections::HashMap::new();
        for s in &cfg.service {
            let at = s.name.span().start;
            let name = s.name.get_ref();
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
                return Err(invalid(
                    at,
                    format!("service name {name:?}: use letters, digits, '-', '_', '.'"),
                ));
            }
            if let Some(first) = names.insert(name.clone(), line_of(text, at)) {
                return Err(invalid(at, format!("duplicate service name {name:?} (first on line {first})")));
            }
            match (s.wake_on, &s.listen) {
                (WakeOn::Proxy, None) => {
                    return Err(invalid(at, format!("service {name:?}: listen is missing (the proxy's address)")))
                }
                (WakeOn::Socket, Some(l)) => {
                    return Err(invalid(
                        l.span().start,
                        format!("service {name:?}: listen is for wake_on = \"proxy\"; with \"socket\" clients connect to backend"),
                    ))
                }
                _ => {}
            }
            if s.wake_on == WakeOn::Socket {
                // Nothing listens before the first start, and no proxy
                // answers for the server.
                for (key, given) in
                    [("start = \"on-demand\"", s.start == Start::OnDemand), ("fail_fast", s.fail_fast)]
                {
                    if given {
                        return Err(invalid(
                            at,
                            format!("service {name:?}: {key} needs wake_on = \"proxy\" (a proxy that listens for the server)"),
                        ));
                    }
                }
            }
            if s.wake_on == WakeOn::Proxy {
                for (key, given) in [("netns", s.netns.is_some()), ("ignore_peers", s.ignore_peers.is_some())]
                {
                    if given {
                        return Err(invalid(
                            at,
                            format!("service {name:?}: {key} is for wake_on = \"socket\""),
                        ));
                    }
                }
            }
            for p in s.ignore_peers.iter().flatten() {
                if let Err(e) = crate::peers::Cidr::parse(p.get_ref()) {
                    return Err(invalid(p.span().start, format!("service {name:?}: ignore_peers: {e}")));
                }
            }
            let listen = s.client_addr();
            let lat = s.listen.as_ref().map_or(at, |l| l.span().start);
            // Servers in namespaces of their own may all use one port.
            if s.netns.is_none() {
                if let Some((other, _)) = ports.get(&listen.port()) {
                    return Err(invalid(
                        lat,
                        format!("service {name:?} listens on port {} as {other:?} does", listen.port()),
                    ));
                }
                ports.insert(listen.port(), (name.clone(), lat));
            }
            if s.wake_on == WakeOn::Proxy && listen == s.backend {
                return Err(invalid(
                    lat,
                    format!("service {name:?}: listen and backend are the same address"),
                ));
            }
            let sources = usize::from(s.command.is_some())
                + usize::from(s.pid_file.is_some())
                + usize::from(s.cgroup.is_some());
            if sources != 1 {
                return Err(invalid(
                    at,
                    format!(
                        "service {name:?}: give exactly one of command, pid_file, cgroup (it has {sources})"
                    ),
                ));
            }
            if s.command.as_ref().is_some_and(|c| c.is_empty()) {
                return Err(invalid(at, format!("service {name:?}: command is empty")));
            }
            for (what, v) in [("user", &s.user), ("group", &s.group)] {
                let Some(v) = v else { continue };
                if s.command.is_none() {
                    return Err(invalid(
                        v.span().start,
                        format!("service {name:?}: {what} is for a server the agent starts (command)"),
                    ));
                }
                let known = match what {
                    "user" => {
                        v.get_ref().parse::<u32>().is_ok()
                            || nix::unistd::User::from_name(v.get_ref()).ok().flatten().is_some()
                    }
                    _ => crate::peer::group_id(v.get_ref()).is_some(),
                };
                if !known {
                    return Err(invalid(
                        v.span().start,
                        format!("service {name:?}: {what} {:?}: no such {what} on this host", v.get_ref()),
                    ));
                }
            }
            if let Some(f) = s.fast_swap.as_ref().filter(|f| *f.get_ref()) {
                if s.command.is_none() {
                    return Err(invalid(
                        f.span().start,
                        format!("service {name:?}: fast_swap is for a server the agent starts (command)"),
                    ));
                }
            }
            if let Some(k) = s.keep_pinned.as_ref().filter(|k| *k.get_ref()) {
                if !s.fast_swap_on() {
                    return Err(invalid(
                        k.span().start,
                        format!("service {name:?}: keep_pinned needs fast swap (a command, and not fast_swap = false)"),
                    ));
                }
            }
            for (which, h) in
                [("before_suspend", &s.hooks.before_suspend), ("after_resume", &s.hooks.after_resume)]
            {
                let Some(h) = h else { continue };
                let (hat, h) = (h.span().start, h.get_ref());
                if !["GET", "POST", "PUT", "PATCH", "DELETE"].contains(&h.method.as_str()) {
                    return Err(invalid(
                        hat,
                        format!(
                            "service {name:?}: hook {which}: method {:?} (GET, POST, PUT, PATCH, DELETE)",
                            h.method
                        ),
                    ));
                }
                if !h.path.starts_with('/') || h.path.chars().any(|c| c.is_whitespace() || c.is_control()) {
                    return Err(invalid(
                        hat,
                        format!(
                            "service {name:?}: hook {which}: path {:?} must start with '/' and have no spaces",
                            h.path
                        ),
                    ));
                }
                if h.path.parse::<hyper::Uri>().is_err() {
                    return Err(invalid(
                        hat,
                        format!("service {name:?}: hook {which}: bad path {:?}", h.path),
                    ));
                }
                if h.timeout.is_zero() || h.timeout > Duration::from_secs(3600) {
                    return Err(invalid(
                        hat,
                        format!("service {name:?}: hook {which}: timeout must be above 0 and at most 1h"),
                    ));
                }
            }
        }
        let mut models = std::collections::HashMap::new();
        for s in &cfg.service {
            for m in &s.models {
                let at = m.span().start;
                if m.get_ref().is_empty() || m.get_ref().chars().any(|c| c.is_control()) {
                    return Err(invalid(
                        at,
                        format!(
                            "service {:?}: model {:?}: empty or with control characters",
                            s.name.get_ref(),
                            m.get_ref()
                        ),
                    ));
                }
                if let Some(first) = models.insert(m.get_ref().clone(), s.name.get_ref().clone()) {
                    return Err(invalid(
                        at,
                        format!("model {:?} is served by {first:?} already", m.get_ref()),
                    ));
                }
            }
            if let Some(r) = &s.remote {
                if let Err(e) = gpusnap_images::remote::Url::parse(r.get_ref()) {
                    return Err(invalid(
                        r.span().start,
                        format!("service {:?}: remote {:?}: {e}", s.name.get_ref(), r.get_ref()),
                    ));
                }
            }
        }
        if let Err(why) = cfg.agent.http.check() {
            let at = text.find("[agent.http]").unwrap_or(0);
            return Err(invalid(at, why));
        }
        if let Some(a) = cfg.agent.http_listen {
            if let Some((other, at)) = ports.get(&a.port()) {
                return Err(invalid(
                    *at,
                    format!("service {other:?} listens on port {}, the http_listen port", a.port()),
                ));
            }
        }
        // Two services on one backend: one's requests would be answered by
        // the other's server (the one that bound the port first).
        let mut backends = std::collections::HashMap::new();
        for s in cfg.service.iter().filter(|s| s.netns.is_none()) {
            if let Some(other) = backends.insert(s.backend, s.name.get_ref().clone()) {
                return Err(invalid(
                    s.name.span().start,
                    format!("service {:?}: backend {} is already {other:?}'s", s.name.get_ref(), s.backend),
                ));
            }
        }
        // A backend of one service that another listens on would loop.
        for s in &cfg.service {
            if let Some((other, at)) = ports.get(&s.backend.port()).filter(|(o, _)| o != s.name.get_ref()) {
                if s.backend.ip().is_loopback() || s.backend.ip().is_unspecified() {
                    return Err(invalid(
                        *at,
                        format!(
                            "service {:?}: backend port {} is where {other:?} listens",
                            s.name.get_ref(),
                            s.backend.port()
                        ),
                    ));
                }
            }
        }
        check(&cfg, text).map_err(|(offset, reason)| invalid(offset, reason))?;
        cfg.raw = toml::from_str(text).unwrap_or_default();
        Ok(cfg)
    }
}

/// Checks every number; on a bad one, the offset of its key in `text` (or
/// of its table) and why.
fn check(cfg: &Config, text: &str) -> Result<(), (usize, String)> {
    let a = &cfg.agent;
    let agent_at = section_start(text, "[agent]").unwrap_or(0);
    let at = |key: &str| key_offset(text, agent_at, key).unwrap_or(agent_at);
    let agent = [
        ("tick", within("tick", a.tick, 10 * MS, 3600 * SEC)),
        ("header_timeout", within("header_timeout", a.header_timeout, 100 * MS, 600 * SEC)),
        (
            "max_connections",
            a.max_connections.map_or(Ok(()), |n| count("max_connections", n, 1, MAX_CONNECTIONS)),
        ),
        (
            "min_host_available",
            a.min_host_available.map_or(Ok(()), |n| bytes("min_host_available", n, 0, 1024 * TIB)),
        ),
        ("pinned_budget", a.pinned_budget.map_or(Ok(()), |n| bytes("pinned_budget", n, 0, 1024 * TIB))),
    ];
    for (key, r) in agent {
        r.map_err(|e| (at(key), e))?;
    }
    for s in &cfg.service {
        check_service(s, text)?;
    }
    if let Some(k) = &cfg.kubernetes {
        let table = section_start(text, "[kubernetes]").unwrap_or(0);
        let at = |key: &str| key_offset(text, table, key).unwrap_or(table);
        within("poll_interval", k.poll_interval, 100 * MS, 600 * SEC)
            .map_err(|e| (at("poll_interval"), e))?;
        within("cri_timeout", k.cri_timeout, 100 * MS, 600 * SEC).map_err(|e| (at("cri_timeout"), e))?;
        if !k.cri_socket.is_absolute() {
            return Err((at("cri_socket"), "[kubernetes] cri_socket must be an absolute path".into()));
        }
        if k.max_priority.unsigned_abs() > 1_000_000 {
            return Err((
                at("max_priority"),
                "[kubernetes] max_priority must be from -1000000 to 1000000".into(),
            ));
        }
    }
    Ok(())
}

fn check_service(s: &ServiceConfig, text: &str) -> Result<(), (usize, String)> {
    let name_at = s.name.span().start;
    let table = text[..name_at.min(text.len())].rfind("[[service]]").unwrap_or(name_at);
    let at = |key: &str| key_offset(text, table, key).unwrap_or(name_at);
    let name = s.name.get_ref();
    let opt = |key: &str, d: Option<Duration>, min: Duration, max: Duration| {
        d.map_or(Ok(()), |d| within(key, d, min, max))
    };
    let checks = [
        ("wake_timeout", within("wake_timeout", s.wake_timeout, MS, DAY)),
        ("suspend_after", opt("suspend_after", s.suspend_after, Duration::ZERO, 365 * DAY)),
        ("hibernate_after", opt("hibernate_after", s.hibernate_after, Duration::ZERO, 365 * DAY)),
        ("min_resident", opt("min_resident", s.min_resident, Duration::ZERO, DAY)),
        ("request_timeout", opt("request_timeout", s.request_timeout, SEC, 7 * DAY)),
        ("max_waiting", count("max_waiting", s.max_waiting, 1, MAX_CONNECTIONS)),
        ("max_connections", count("max_connections", s.max_connections, 1, MAX_CONNECTIONS)),
        ("margin", bytes("margin", s.margin, 0, TIB)),
        ("socket_poll", within("socket_poll", s.socket_poll, MS, 10 * SEC)),
        ("socket_poll_running", within("socket_poll_running", s.socket_poll_running, MS, 60 * SEC)),
        ("gpu_memory", s.gpu_memory.map_or(Ok(()), |n| bytes("gpu_memory", n, 1, 64 * TIB))),
        (
            "priority",
            if s.priority.unsigned_abs() > 1_000_000 {
                Err(format!("priority = {}: must be between -1000000 and 1000000", s.priority))
            } else {
                Ok(())
            },
        ),
    ];
    for (key, r) in checks {
        r.map_err(|e| (at(key), format!("service {name:?}: {e}")))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
