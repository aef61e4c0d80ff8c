//! `gpusnap probe`: whether a server can answer, for a readiness or
//! liveness probe. Running and suspended (wakeable) servers that listen on
//! their port are ready; dead, stuck, unrecoverable ones and those that do
//! not listen are not, each with its own exit code. It only looks: nothing
//! is resumed or woken, no socket is connected to.

use crate::cli::Cli;
use gpusnap_core::target;
use serde::Serialize;

/// The exit codes of `gpusnap probe` (docs/reference/exit-codes.md).
pub const UNRECOVERABLE: i32 = 5;
pub const DEAD: i32 = 8;
pub const NOT_LISTENING: i32 = 9;
pub const STUCK: i32 = 10;

#[derive(Serialize)]
struct Verdict {
    ready: bool,
    /// running, suspended, dead, stuck, unrecoverable, not_listening.
    state: &'static str,
    pid: i32,
    port: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
    exit_code: i32,
}

pub fn probe(cli: &Cli, pid: Option<i32>, container: Option<&str>, port: u16) -> anyhow::Result<()> {
    let root = match (pid, container) {
        (Some(p), _) => p,
        (None, Some(c)) => {
            let r = gpusnap_core::container::resolve(c)?;
            *r.pids.iter().min().ok_or_else(|| anyhow::anyhow!("container {c}: no process"))?
        }
        (None, None) => anyhow::bail!("give --pid or --container"),
    };
    let v = judge(cli, root, port)?;
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

fn judge(cli: &Cli, root: i32, port: u16) -> anyhow::Result<Verdict> {
    let verdict = |state, code: i32, reason: Option<String>| Verdict {
        ready: code == 0,
        state,
        pid: root,
        port,
        reason,
        exit_code: code,
    };
    match target::resolve(root) {
        Ok(_) => {}
        Err(e @ (gpusnap_core::Error::NoProcess { .. } | gpusnap_core::Error::Zombie { .. })) => {
            return Ok(verdict("dead", DEAD, Some(e.to_string())))
        }
        Err(e) => return Err(e.into()),
    }
    let tree: Vec<i32> = gpusnap_core::tree::process_tree(root).into_iter().map(|(p, _)| p).collect();
    // Stopped by a signal or a tracer that went away (a dump interrupted
    // half-way): it answers nothing, and a wake would not help.
    for p in &tree {
        if let Ok(st) = target::run_state(*p) {
            if st.is_stopped() {
                return Ok(verdict("stuck", STUCK, Some(format!("process {p} is stopped (state {})", st.0))));
            }
        }
    }
    // The driver's view, read only: a process whose restore failed cannot
    // come back in place.
    let mut state = "running";
    let mut e = crate::setup::engine_at(&cli.state_dir)?;
    for r in e.ps()?.into_iter().filter(|r| tree.contains(&r.pid)) {
        if r.unrecoverable || r.state == "failed" {
            let why = r.reason.unwrap_or_else(|| format!("its driver state is {}", r.state));
            return Ok(verdict(
                "unrecoverable",
                UNRECOVERABLE,
                Some(format!("process {} cannot be restored: {why}", r.pid)),
            ));
        }
        if r.state == "checkpointed" {
            state = "suspended";
        }
    }
    let ns = std::path::PathBuf::from(format!("/proc/{root}/ns/net"));
    let mut w = gpusnap_sockwatch::Watcher::open_in(&ns, gpusnap_sockwatch::Limits::default())?;
    use gpusnap_sockwatch::Sockets;
    if !w.look(port)?.listening() {
        return Ok(verdict("not_listening", NOT_LISTENING, Some(format!("nothing listens on port {port}"))));
    }
    Ok(verdict(state, 0, None))
}
