//! The agent's two unix sockets and their directories.
//!
//! - The **admin socket** (`socket`): the whole API. Its directory is made
//!   0750 (group: `[agent] group`) when the agent creates it, the socket
//!   0660; only root and the group reach it. It is never in the probe
//!   socket's directory or below it (refused at start).
//! - The **probe socket** (`probe_socket`): one read-only request, for
//!   anyone (0666). Its directory is the agent's own: owned by the agent's
//!   user, writable by nobody else (made 0755; one owned by another user is
//!   refused). Pods mount that directory read-only, so no pod can remove
//!   the socket or bind another in its place: not by the directory's mode
//!   (a pod's root is root, without user namespaces) but by the read-only
//!   mount, which a pod without CAP_SYS_ADMIN cannot make writable.

use crate::error::AgentError;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

fn setup(path: &Path, what: &str, e: &dyn std::fmt::Display) -> AgentError {
    AgentError::Setup(format!("{}: {what}: {e}", path.display()))
}

/// Removes a stale socket at `path`; refuses when another agent answers there.
fn clear(path: &Path) -> Result<(), AgentError> {
    if std::fs::symlink_metadata(path).is_ok() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(AgentError::Setup(format!("{}: another agent is serving there", path.display())));
        }
        std::fs::remove_file(path).map_err(|e| setup(path, "remove the stale socket", &e))?;
    }
    Ok(())
}

/// Makes `dir` (its parents 0755) with `mode` if it is missing; whether it made it.
fn make_dir(dir: &Path, mode: u32) -> Result<bool, AgentError> {
    if std::fs::symlink_metadata(dir).is_ok() {
        return Ok(false);
    }
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent).map_err(|e| setup(dir, "create its parent", &e))?;
    }
    use std::os::unix::fs::DirBuilderExt;
    match std::fs::DirBuilder::new().mode(mode).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Ok(false),
        Err(e) => return Err(setup(dir, "create", &e)),
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))
        .map_err(|e| setup(dir, "chmod", &e))?;
    Ok(true)
}

/// The real path of a socket's directory (made before).
fn real_dir(socket: &Path) -> Result<std::path::PathBuf, AgentError> {
    let dir = socket.parent().unwrap_or(Path::new("."));
    std::fs::canonicalize(dir).map_err(|e| setup(dir, "resolve", &e))
}

/// Binds both sockets: the probe's, then the admin one; refuses an admin
/// socket whose directory, links resolved, is the probe's or below it.
pub fn bind(
    admin: &Path,
    probe: &Path,
    group: Option<&str>,
) -> Result<(tokio::net::UnixListener, tokio::net::UnixListener), AgentError> {
    let probe_listener = bind_probe(probe)?;
    let gid = match group {
        Some(g) => {
            Some(crate::peer::group_id(g).ok_or_else(|| AgentError::Setup(format!("no group {g:?}")))?)
        }
        None => None,
    };
    if let Some(dir) = admin.parent() {
        if make_dir(dir, 0o750)? {
            if let Some(gid) = gid {
                nix::unistd::chown(dir, None, Some(nix::unistd::Gid::from_raw(gid)))
                    .map_err(|e| setup(dir, "chown", &e))?;
            }
        }
    }
    let (a, p) = (real_dir(admin)?, real_dir(probe)?);
    crate::config::sockets_apart(&a.join("agent.sock"), &p.join("probe.sock")).map_err(AgentError::Setup)?;
    clear(admin)?;
    let l = tokio::net::UnixListener::bind(admin).map_err(|e| setup(admin, "bind", &e))?;
    std::fs::set_permissions(admin, std::fs::Permissions::from_mode(0o660))
        .map_err(|e| setup(admin, "chmod", &e))?;
    if let Some(gid) = gid {
        nix::unistd::chown(admin, None, Some(nix::unistd::Gid::from_raw(gid)))
            .map_err(|e| setup(admin, "chown", &e))?;
    }
    Ok((l, probe_listener))
}

/// The probe socket, 0666, in a directory of the agent's user that nobody
/// else can write (a link in its place is refused).
fn bind_probe(path: &Path) -> Result<tokio::net::UnixListener, AgentError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    make_dir(dir, 0o755)?;
    let meta = std::fs::symlink_metadata(dir).map_err(|e| setup(dir, "stat", &e))?;
    if !meta.is_dir() {
        return Err(AgentError::Setup(format!(
            "{}: the probe socket's directory is not a directory (a link?)",
            dir.display()
        )));
    }
    let me = nix::unistd::geteuid().as_raw();
    if meta.uid() != me {
        return Err(AgentError::Setup(format!(
            "{}: the probe socket's directory belongs to uid {}, not the agent's {me}: whoever owns it could replace the socket",
            dir.display(),
            meta.uid()
        )));
    }
    if meta.mode() & 0o022 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| setup(dir, "chmod", &e))?;
    }
    clear(path)?;
    let l = tokio::net::UnixListener::bind(path).map_err(|e| setup(path, "bind", &e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))
        .map_err(|e| setup(path, "chmod", &e))?;
    Ok(l)
}
