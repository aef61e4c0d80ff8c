//! gpusnap's node agent: model servers leave the GPU when idle and are back
//! on the next request; more models than GPUs.
//!
//! - [`config`] reads the TOML file;
//! - [`daemon`] starts, adopts after a crash, tells systemd it is ready;
//! - [`proxy`] is a TCP proxy per service, which wakes it on demand;
//! - [`policy`] suspends the idle, evicts, hibernates and restarts, all
//!   through the core `Engine`;
//! - [`api`] serves HTTP/JSON on a unix socket, [`client`] is the CLI's side;
//! - [`metrics`] holds the Prometheus metrics;
//! - [`trace`] breaks a wake caused by a request (a swap) into phases.

pub mod api;
pub mod client;
pub mod config;
pub mod daemon;
pub mod hooks;
pub mod metrics;
pub mod policy;
pub mod proxy;
pub mod service;
pub mod trace;

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
