//! `gpusnap probe`: whether a server can answer, for a readiness or
//! liveness probe. Running and suspended (wakeable) servers that listen on
//! their port are ready; dead, stuck, unrecoverable ones and those that do
//! not listen are not, each with its own exit code. It only looks: nothing
//! is resumed or woken, no socket is connected to, nothing is written.
//!
//! Its process, its tree and its port it sees itself, in its own pid and
//! network namespaces (a pod's container). Whether the server is suspended
//! or cannot come back it asks the agent, on its probe socket or the
//! endpoint the agent places in a served pod's network namespace (the
//! agent knows the server by its host pid and translates the pid through
//! the caller's pid namespace), else the
//! driver and the state directory where it shares the host's pid
//! namespace; with neither it judges from what it sees.

use crate::cli::Cli;
use gpusnap_agent::client::{self, ClientError};
use gpusnap_core::{pidns, target};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::Duration;

/// The exit codes of `gpusnap probe` (docs/reference/exit-codes.md).
pub const UNRECOVERABLE: i32 = 5;
pub const DEAD: i32 = 8;
pub const NOT_LISTENING: i32 = 9;
pub const STUCK: i32 = 10;

/// How long the agent has to answer: well inside a kubelet's probe timeout
/// (the example gives 5 s), so that a wedged agent still gets an answer
/// from what the probe sees itself.
const AGENT_LIMIT: Duration = Duration::from_secs(2);

#[derive(Serialize)]
struct Verdict {
    ready: bool,
    /// running, suspended, alive (running or suspended, which is not
    /// known), dead, stuck, unrecoverable, not_listening.
    state: &'static str,
    pid: i32,
    port: u16,
    /// Where the driver's view came from: agent, driver, or process (what
    /// the probe sees of the process only).
    source: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
    exit_code: i32,
}

/// One CUDA process of the tree as the agent or the driver reports it.
#[derive(Deserialize)]
struct Row {
    pid: i32,
    state: String,
    #[serde(default)]
    unrecoverable: bool,
    #[serde(default)]
    reason: Option<String>,
}

pub fn probe(
    cli: &Cli,
    pid: Option<i32>,
    container: Option<&str>,
    port: u16,
    socket: &Path,
) -> anyhow::Result<()> {
    let root = match (pid, container) {
        (Some(p), _) => p,
        (None, Some(c)) => {
            let r = gpusnap_core::container::resolve(c)?;
            *r.pids.iter().min().ok_or_else(|| anyhow::anyhow!("container {c}: no process"))?
        }
        (None, None) => anyhow::bail!("give --pid or --container"),
    };
    let v = judge(cli, root, port, socket)?;
    if cli.json {
        println!("{}", serde_json::to_string(&v)?);
    } else if v.ready {
        println!("ready: {} (pid {}, port {})", v.state, v.pid, v.port);
    } else {
        eprintln!("gpusnap: not ready: {}", v.reason.as_deref().unwrap_or(v.state));
    }
    if v.exit_code != 0 {
        std::process::exit(v.exit_code);
    }
    Ok(())
}

fn judge(cli: &Cli, root: i32, port: u16, socket: &Path) -> anyhow::Result<Verdict> {
    let mut source = "process";
    let verdict = |state, code: i32, reason: Option<String>, source| Verdict {
        ready: code == 0,
        state,
        pid: root,
        port,
        source,
        reason,
        exit_code: code,
    };
    let t = match target::resolve(root) {
        Ok(t) => t,
        Err(e @ (gpusnap_core::Error::NoProcess { .. } | gpusnap_core::Error::Zombie { .. })) => {
            return Ok(verdict("dead", DEAD, Some(e.to_string()), source))
        }
        Err(e) => return Err(e.into()),
    };
    let tree: Vec<i32> = gpusnap_core::tree::process_tree(root).into_iter().map(|(p, _)| p).collect();
    // Stopped by a signal or a tracer that went away (a dump interrupted
    // half-way): it answers nothing, and a wake would not help.
    for p in &tree {
        if let Ok(st) = target::run_state(*p) {
            if st.is_stopped() {
                let why = format!("process {p} is stopped (state {})", st.0);
                return Ok(verdict("stuck", STUCK, Some(why), source));
            }
        }
    }
    let rows = match from_agent(root, socket)? {
        Some(rows) => {
            source = "agent";
            Some(rows)
        }
        // The store keys its records by host pid (and the driver is asked
        // with them): only in the host's pid namespace are they this
        // process's pids.
        None if pidns::in_initial() => {
            source = "driver";
            Some(from_driver(cli, &tree)?)
        }
        None => None,
    };
    let no_cuda = || gpusnap_core::Error::NotCuda { pid: root, comm: t.comm.clone() };
    let state = match rows {
        Some(rows) if rows.is_empty() => return Err(no_cuda().into()),
        Some(rows) => {
            if let Some(r) = rows.iter().find(|r| r.unrecoverable || r.state == "failed") {
                let why = r.reason.clone().unwrap_or_else(|| format!("its driver state is {}", r.state));
                let why = format!("process {} cannot be restored: {why}", r.pid);
                return Ok(verdict("unrecoverable", UNRECOVERABLE, Some(why), source));
            }
            if let Some(r) = rows.iter().find(|r| r.state == "stopped" || r.state == "frozen") {
                let why = format!("process {} is {}", r.pid, r.state);
                return Ok(verdict("stuck", STUCK, Some(why), source));
            }
            if rows.iter().any(|r| r.state == "checkpointed") {
                "suspended"
            } else if rows.iter().any(|r| r.state == "parked") {
                // Its memory in host memory, its context on the GPU: a
                // connection brings it back, as for a suspended one.
                "parked"
            } else {
                "running"
            }
        }
        // Whether it is a CUDA process at all only the driver says.
        None => "alive",
    };
    let ns = std::path::PathBuf::from(format!("/proc/{root}/ns/net"));
    let mut w = gpusnap_sockwatch::Watcher::open_in(&ns, gpusnap_sockwatch::Limits::default())?;
    if w.listeners(port)?.is_empty() {
        let why = format!("nothing listens on port {port}");
        return Ok(verdict("not_listening", NOT_LISTENING, Some(why), source));
    }
    Ok(verdict(state, 0, None, source))
}

/// The agent's view of `root`'s tree (`GET /v1/processes?tree=ROOT`, read
/// only) on the probe socket `socket`, or where it is not, on the endpoint
/// the agent places in a served pod (`@gpusnap-probe`); `None` when no
/// agent answers for it: none listens, it refuses this caller or does not
/// know the process, it fails or is too slow. Its refusal of bad input (a reused pid) is the probe's.
fn from_agent(root: i32, socket: &Path) -> anyhow::Result<Option<Vec<Row>>> {
    // No probe socket mounted (a pod under Pod Security "baseline"): the
    // endpoint the agent places in the pod's network namespace.
    let pod_endpoint = std::path::PathBuf::from(format!("@{}", gpusnap_agent::kubernetes::probe::NAME));
    let socket = if socket.exists() { socket } else { pod_endpoint.as_path() };
    match client::request_within(socket, "GET", &format!("/v1/processes?tree={root}"), AGENT_LIMIT) {
        Ok(body) => match serde_json::from_str(&body) {
            Ok(rows) => Ok(Some(rows)),
            Err(e) => {
                tracing::info!("the agent's answer does not parse ({e}); judging without it");
                Ok(None)
            }
        },
        // Bad input the agent found (a reused pid); a refused peer (403) or
        // an unknown process (404) only means the agent cannot say.
        Err(e @ ClientError::Api { exit_code: 2, status: 500, .. }) => Err(e.into()),
        Err(e) => {
            tracing::info!("no answer from the agent ({e}); judging without it");
            Ok(None)
        }
    }
}

/// The driver's view of the CUDA processes of `tree`, read only.
fn from_driver(cli: &Cli, tree: &[i32]) -> anyhow::Result<Vec<Row>> {
    let e = crate::setup::engine_read_only(&cli.state_dir)?;
    let mut rows = Vec::new();
    for &p in tree {
        match e.look(p) {
            Ok(r) => rows.push(Row {
                pid: r.pid,
                state: r.state,
                unrecoverable: r.unrecoverable,
                reason: r.reason,
            }),
            Err(
                gpusnap_core::Error::NotCuda { .. }
                | gpusnap_core::Error::NoProcess { .. }
                | gpusnap_core::Error::Zombie { .. },
            ) => {}
            Err(err) => return Err(err.into()),
        }
    }
    Ok(rows)
}
