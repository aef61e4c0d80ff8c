//! A cgroup of its own for each server the agent starts: the server runs
//! in a transient systemd scope (`systemd-run --scope`, in `gpusnap.slice`),
//! so that its memory, CPU and tasks are charged to it and not to the
//! agent's unit, and `systemctl status` shows it apart. The scope outlives
//! the agent as the server does (the unit's `KillMode=process` ends only
//! the agent).
//!
//! `server_scope = "auto"` (the default) does so when it can: systemd runs
//! the host (`/run/systemd/system`), the agent runs as one of its services
//! (`INVOCATION_ID`) and `systemd-run` is on PATH. Anywhere else (a
//! container, a test) the server is a plain child in the agent's cgroup.

use serde::Deserialize;
use std::path::Path;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ServerScope {
    /// When systemd runs the host and the agent (see the module doc).
    #[default]
    Auto,
    /// Always (starting a server fails where systemd cannot make a scope).
    On,
    /// Never: servers share the agent's cgroup.
    Off,
}

impl ServerScope {
    /// Whether servers are started in scopes here.
    pub fn applies(self) -> bool {
        match self {
            ServerScope::On => true,
            ServerScope::Off => false,
            ServerScope::Auto => {
                Path::new("/run/systemd/system").is_dir()
                    && std::env::var_os("INVOCATION_ID").is_some()
                    && which("systemd-run")
            }
        }
    }
}

fn which(prog: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(prog).is_file()))
}

/// The command that runs `exe` for service `name`: under `systemd-run
/// --scope` when `scope` applies (it runs `exe` in its own process, the
/// pid the agent records), else `exe` itself.
pub fn command(exe: &Path, name: &str, scope: ServerScope) -> std::process::Command {
    if !scope.applies() {
        return std::process::Command::new(exe);
    }
    let unit = format!("gpusnap-server-{name}-{}", gpusnap_core::store::now_ms());
    let mut c = std::process::Command::new("systemd-run");
    c.args(["--scope", "--quiet", "--collect", "--slice=gpusnap.slice"])
        .arg(format!("--unit={unit}"))
        .arg(format!("--description=gpusnap server {name}"))
        .arg("--")
        .arg(exe);
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_runs_the_program_itself_and_on_wraps_it() {
        let off = command(Path::new("/usr/bin/gpusnap"), "a", ServerScope::Off);
        assert_eq!(off.get_program(), "/usr/bin/gpusnap");
        let on = command(Path::new("/usr/bin/gpusnap"), "a", ServerScope::On);
        assert_eq!(on.get_program(), "systemd-run");
        let args: Vec<String> = on.get_args().map(|a| a.to_string_lossy().into_owned()).collect();
        assert_eq!(args[..4], ["--scope", "--quiet", "--collect", "--slice=gpusnap.slice"]);
        assert!(args[4].starts_with("--unit=gpusnap-server-a-"), "{args:?}");
        assert_eq!(args[6..], ["--", "/usr/bin/gpusnap"]);
    }
}
