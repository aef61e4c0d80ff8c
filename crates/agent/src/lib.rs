//! gpusnap's node agent: model servers leave the GPU when idle and are back
//! on the next request; more models than GPUs.
//!
//! - [`config`] reads the TOML file, [`units`] its durations and sizes;
//! - [`state`] owns the agent's state: services, driver, images, records;
//! - [`policy`] suspends the idle, evicts, hibernates and restarts, all
//!   through the core `Engine`, and adopts the services after a restart;
//! - [`control`] is what the API and the proxies may ask of the agent;
//! - [`proxy`] is a TCP proxy per service, which wakes it on demand;
//! - [`frontdoor`] is one HTTP listener for all, routing by model;
//! - [`kubernetes`] serves the node's annotated pods, found through the
//!   runtime's CRI socket;
//! - [`api`] serves HTTP/JSON on the admin socket to the peers [`peer`]
//!   lets in, [`access`] says who may act on which service, [`probe`]
//!   answers pods' probes on the probe socket, [`sockets`] binds both,
//!   [`client`] is the CLI's side;
//! - [`daemon`] starts it all and tells systemd it is ready;
//! - [`service`] is one service's state, [`hooks`] its HTTP hooks;
//! - [`metrics`] holds the Prometheus metrics;
//! - [`trace`] breaks a wake caused by a request (a swap) into phases;
//! - [`limits`] bounds descriptors and connections, [`listen`] serves the
//!   HTTP listeners under those bounds, [`ratelimit`] keeps floods out of
//!   the log, [`bounds`] range-checks the config's numbers.
//!
//! The modules import each other without a circle: `daemon` above `api`,
//! `proxy`, `frontdoor` and `policy`; `api`, `proxy` and `frontdoor` see
//! the agent only through
//! `control`; `policy` implements `control` on `state`.

pub mod access;
pub mod api;
pub mod bounds;
pub mod client;
pub mod config;
pub mod control;
pub mod daemon;
pub mod environ;
pub mod error;
pub mod frontdoor;
pub mod held;
pub mod hooks;
pub mod kubernetes;
pub mod limits;
pub mod listen;
pub mod logs;
pub mod metrics;
pub mod peer;
pub mod peers;
pub mod pidfile;
pub mod policy;
pub mod probe;
pub mod proxy;
pub mod ratelimit;
pub mod recent;
pub mod reload;
pub mod scope;
pub mod service;
pub mod sockets;
pub mod sockwake;
pub mod state;
pub mod trace;
pub mod units;
pub mod wait;

pub use config::Config;
pub use daemon::run;
pub use error::AgentError;
pub use state::{Agent, Setup};
