//! `gpusnap agent`, `gpusnap services`, `gpusnap service NAME ACTION`: the
//! daemon and its remote control live in the agent crate.

use crate::cli::{AgentAt, Cli};
use crate::output::Out;
use gpusnap_agent::client::{self, ClientError};
use gpusnap_agent::control::Action;
use gpusnap_agent::{AgentError, Config, Setup};
use gpusnap_cuda::{Absent, CheckpointApi, CudaDriver, Deadline, OrAbsent, Timeouts};
use gpusnap_gpu::{GpuInventory, NoGpus, NvmlInventory};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The exit code an agent or client error carries.
pub fn exit_code(e: &anyhow::Error) -> Option<i32> {
    e.downcast_ref::<AgentError>()
        .map(AgentError::exit_code)
        .or_else(|| e.downcast_ref::<ClientError>().map(ClientError::exit_code))
}

pub fn run_agent(cli: &Cli, path: &Path) -> anyhow::Result<()> {
    let config = Config::load(path).map_err(AgentError::from)?;
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
        config_path: Some(std::path::absolute(path)?),
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

/// The socket of the agent a reload asks: as [`socket`] finds it, except
/// that the config (being edited) need only be TOML with its `[agent]
/// socket`: the agent itself says what else is wrong with it.
pub fn reload_socket(at: &AgentAt) -> anyhow::Result<PathBuf> {
    let Some(config) = at.config.as_ref().filter(|_| at.socket.is_none()) else { return socket(at) };
    let text = std::fs::read_to_string(config).map_err(|e| {
        AgentError::from(gpusnap_agent::config::ConfigError::Read {
            path: config.display().to_string(),
            reason: e.to_string(),
        })
    })?;
    match gpusnap_agent::config::socket_in(&text) {
        Some(s) => Ok(s),
        None => socket(at),
    }
}

pub fn reload(out: &Out, socket: &Path, stop_removed: bool) -> anyhow::Result<()> {
    let q = if stop_removed { "?stop_removed=true" } else { "" };
    let body = client::request(socket, "POST", &format!("/v1/reload{q}"))?;
    out.agent_reload(&serde_json::from_str(&body)?);
    Ok(())
}

/// Between two reads of a followed log.
const FOLLOW_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

/// A service's output: read from the state directory where this user may,
/// else through the agent's API.
pub fn logs(cli: &Cli, at: &AgentAt, name: &str, lines: usize, follow: bool) -> anyhow::Result<()> {
    if name.is_empty()
        || name.starts_with('.')
        || !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return Err(AgentError::BadInput(format!(
            "{name:?} is no service name (letters, digits, '-', '_', '.')"
        ))
        .into());
    }
    let path = gpusnap_agent::logs::path(&cli.state_dir, name);
    let mut stdout = std::io::stdout().lock();
    let local = match gpusnap_agent::logs::tail(&path, lines) {
        Ok(r) => Some(r),
        Err(e) if matches!(e.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied) => {
            None
        }
        Err(e) => return Err(anyhow::anyhow!("{}: {e}", path.display())),
    };
    if let Some((text, mut offset)) = local {
        stdout.write_all(&text)?;
        stdout.flush()?;
        if !follow {
            return Ok(());
        }
        loop {
            std::thread::sleep(FOLLOW_EVERY);
            let (text, next) = gpusnap_agent::logs::since(&path, offset)?;
            stdout.write_all(&text)?;
            stdout.flush()?;
            offset = next;
        }
    }
    // Not readable here: the agent reads it (root and its group may ask).
    let socket = socket(at)?;
    let read = |q: String| -> anyhow::Result<u64> {
        let body = client::request(&socket, "GET", &format!("/v1/services/{name}/logs?{q}"))?;
        let v: serde_json::Value = serde_json::from_str(&body)?;
        let mut stdout = std::io::stdout().lock();
        stdout.write_all(v["text"].as_str().unwrap_or_default().as_bytes())?;
        stdout.flush()?;
        Ok(v["offset"].as_u64().unwrap_or(0))
    };
    drop(stdout);
    let mut offset = read(format!("lines={lines}"))?;
    if !follow {
        return Ok(());
    }
    loop {
        std::thread::sleep(FOLLOW_EVERY);
        offset = read(format!("after={offset}"))?;
    }
}
