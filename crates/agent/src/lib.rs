//! gpusnap's node agent: model servers leave the GPU when idle and are back
//! on the next request; more models than GPUs.
//!
//! - [`config`]: the TOML file;
//! - [`daemon`]: startup, adoption after a crash, systemd readiness;
//! - [`proxy`]: a TCP proxy per service, which wakes it on demand;
//! - [`policy`]: idle suspend, eviction, hibernation, restarts, all through
//!   the core `Engine`;
//! - [`api`]: HTTP/JSON on a unix socket; [`client`]: the CLI's side of it;
//! - [`metrics`]: Prometheus.

pub mod api;
pub mod client;
pub mod config;
pub mod daemon;
pub mod metrics;
pub mod policy;
pub mod proxy;
pub mod service;

pub use config::Config;
pub use daemon::{run, AgentError, Setup};

/// `1.5s`, `5m`, `2h` for journal notes.
pub fn fmt_duration(d: std::time::Duration) -> String {
    let s = d.as_secs_f64();
    if s < 1.0 {
        format!("{} ms", d.as_millis())
    } else if s < 120.0 {
        format!("{s:.1} s")
    } else if s < 7200.0 {
        format!("{:.1} min", s / 60.0)
    } else {
        format!("{:.1} h", s / 3600.0)
    }
}
