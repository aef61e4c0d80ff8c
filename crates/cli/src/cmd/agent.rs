//! `gpusnap agent`, `gpusnap services`, `gpusnap service NAME ACTION`: the
//! daemon and its remote control live in the agent crate.

use crate::cli::{AgentAt, Cli};
use crate::output::Out;
use gpusnap_agent::client::{self, ClientError};
use gpusnap_agent::control::Action;
use gpusnap_agent::{AgentError, Config, Setup};
use gpusnap_cuda::{Absent, CheckpointApi, CudaDriver, Deadline, OrAbsent, Timeouts};
use gpusnap_gpu::{GpuInventory, NoGpus, NvmlInventory};
use std::path::{Path, PathBuf};

/// The exit code an agent or client error carries.
pub fn exit_code(e: &anyhow::Error) -> Option<i32> {
    e.downcast_ref::<AgentError>()
        .map(AgentError::exit_code)
        .or_else(|| e.downcast_ref::<ClientError>().map(ClientError::exit_code))
}

pub fn run_agent(cli: &Cli, config: &Path) -> anyhow::Result<()> {
    let config = Config::load(config).map_err(AgentError::from)?;
    // A host without a driver still proxies (and starts) its services: the
    // agent then only cannot take them off the GPU, which each attempt says.
    // The driver's start-up runs in the background (see OrAbsent).
    let api: Box<dyn CheckpointApi> = match CudaDriver::load() {
        Ok(d) => Box::new(OrAbsent::new(d)),
        Err(e) => Box::new(Absent { why: e.to_string() }),
    };
    let gpus: Box<dyn GpuInventory> = match NvmlInventory::load() {
        Ok(n) => Box::new(n),
        Err(_) => Box::new(NoGpus),
    };
    let exe = std::env::current_exe()?;
    gpusnap_agent::run(Setup {
        config,
        state_dir: cli.state_dir.clone(),
        criu: cli.criu.clone(),
        api: Deadline::new(api, Timeouts::default()),
        gpus,
        exe,
    })?;
    Ok(())
}

/// The agent's configuration when none is named.
const DEFAULT_CONFIG: &str = "/etc/gpusnap/agent.toml";

/// The admin socket `at` names: --socket (or GPUSNAP_AGENT_SOCKET), else
/// the `[agent] socket` of --config, else of the default config when it
/// exists, else the default socket.
pub fn socket(at: &AgentAt) -> anyhow::Result<PathBuf> {
    if let Some(s) = &at.socket {
        return Ok(s.clone());
    }
    let config = match &at.config {
        Some(c) => c.clone(),
        None if Path::new(DEFAULT_CONFIG).exists() => PathBuf::from(DEFAULT_CONFIG),
        None => return Ok(gpusnap_agent::config::AgentConfig::default().socket),
    };
    Ok(Config::load(&config).map_err(AgentError::from)?.agent.socket)
}

pub fn services(out: &Out, socket: &Path) -> anyhow::Result<()> {
    let body = client::request(socket, "GET", "/v1/services")?;
    let v: serde_json::Value = serde_json::from_str(&body)?;
    out.agent_services(&v);
    Ok(())
}

pub fn service(out: &Out, socket: &Path, name: &str, action: Action) -> anyhow::Result<()> {
    let body = client::request(socket, "POST", &format!("/v1/services/{name}/{}", action.as_str()))?;
    let v: serde_json::Value = serde_json::from_str(&body)?;
    out.agent_services(&serde_json::Value::Array(vec![v]));
    Ok(())
}
