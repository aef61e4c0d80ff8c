//! Reading the config file again while the agent runs (SIGHUP, `systemctl
//! reload`, `POST /v1/reload`, `gpusnap agent reload`). A config that does
//! not parse or check is refused whole: the agent goes on with the one it
//! has. Otherwise, service by service (compared as TOML, by name):
//!
//! - a new service is started as at the agent's start (its `start`);
//! - a removed one is no longer served: its process is left running,
//!   unmanaged, unless the reload asks `stop_removed` (then it is stopped,
//!   suspended first, as `gpusnap stop` does);
//! - a changed one is restarted with its new config once no request is in
//!   flight (at once when idle, else by the policy's tick when it is): one
//!   that ran is started again at once, one off the GPU (suspended, parked,
//!   hibernated, not started) comes back started cold by its next request;
//!   an adopted one (`pid_file`, `cgroup`) is not the agent's to restart:
//!   it is found again under its new config;
//! - an unchanged one is not touched.
//!
//! `[agent]` and `[kubernetes]` are read at start only: a change there is
//! reported as needing a restart of the agent.
//!
//! - `diff`: what changed between two configs;
//! - `apply`: the reload itself;
//! - `doors`: the per-service proxies' listeners, bound and let go.

mod apply;
pub mod diff;
mod doors;

pub use apply::{Change, DriftSeen, Outcome};

use crate::config::ServiceConfig;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

/// What a reload needs besides the services (kept by the agent).
pub struct Reloading {
    /// The file read again (None: a reload is refused).
    path: Option<PathBuf>,
    /// The config the agent started with: its `[agent]` is the one served.
    started: toml::Table,
    /// The TOML of each file service as now served.
    served: Mutex<BTreeMap<String, toml::Value>>,
    /// Changed services waiting to be idle: their new config and its TOML.
    pending: Mutex<BTreeMap<String, (ServiceConfig, toml::Value)>>,
    /// One reload at a time.
    one: tokio::sync::Mutex<()>,
    /// How a service's proxy is served, set once the daemon has them.
    doors: OnceLock<doors::Doors>,
    /// Each proxied service's listener task, by service name.
    proxies: Mutex<HashMap<String, doors::Proxy>>,
}

impl Reloading {
    pub fn new(path: Option<PathBuf>, raw: &toml::Table) -> Self {
        Self {
            path,
            started: raw.clone(),
            served: Mutex::new(diff::services(raw)),
            pending: Mutex::new(BTreeMap::new()),
            one: tokio::sync::Mutex::new(()),
            doors: OnceLock::new(),
            proxies: Mutex::new(HashMap::new()),
        }
    }
}
