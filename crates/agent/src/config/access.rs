//! Who reaches what: the admin socket kept out of the probe socket's
//! directory, and each service's `allow_users` and `allow_groups`.

use super::Config;
use std::path::Path;

/// The admin socket's directory must not be the probe socket's, nor below
/// it: pods mount the probe's directory, and whoever reaches the admin
/// socket may act on every service. The error: the offset of the key at
/// fault in the file (or 0), and why.
pub(super) fn check(cfg: &Config) -> Result<(), (usize, String)> {
    let a = &cfg.agent;
    sockets_apart(&a.socket, &a.probe_path()).map_err(|why| (0, why))?;
    for s in &cfg.service {
        let name = s.name.get_ref();
        let lists = [("allow_users", &s.allow_users), ("allow_groups", &s.allow_groups)];
        for (key, list) in lists {
            for v in list.iter().flatten() {
                let known = match key {
                    "allow_users" => crate::peer::user_id(v.get_ref()).is_some(),
                    _ => crate::peer::group_id(v.get_ref()).is_some(),
                };
                if !known {
                    let what = if key == "allow_users" { "user" } else { "group" };
                    return Err((
                        v.span().start,
                        format!(
                            "service {name:?}: {key}: {what} {:?}: no such {what} on this host",
                            v.get_ref()
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Refuses an admin socket in the probe socket's directory or below it
/// (a directory pods mount), and two sockets at one path.
pub fn sockets_apart(admin: &Path, probe: &Path) -> Result<(), String> {
    let (Some(admin_dir), Some(probe_dir)) = (admin.parent(), probe.parent()) else {
        return Ok(());
    };
    let admin_dir = normal(admin_dir);
    let probe_dir = normal(probe_dir);
    if admin_dir.starts_with(&probe_dir) {
        return Err(format!(
            "socket {} is in probe_socket's directory {} or below it, which pods may mount: put the admin socket in a directory of its own",
            admin.display(),
            probe_dir.display()
        ));
    }
    Ok(())
}

/// `path` with `.` and `..` taken out by name (the directories may not exist yet).
fn normal(path: &Path) -> std::path::PathBuf {
    let mut out = std::path::PathBuf::new();
    for c in path.components() {
        match c {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_admin_socket_stays_out_of_the_probe_directory() {
        let ok = |a: &str, p: &str| sockets_apart(Path::new(a), Path::new(p));
        assert!(ok("/run/gpusnap/admin/agent.sock", "/run/gpusnap/probe/probe.sock").is_ok());
        assert!(ok("/run/gpusnap/agent.sock", "/run/gpusnap/probe/probe.sock").is_ok());
        assert!(ok("/run/gpusnap/probe/agent.sock", "/run/gpusnap/probe/probe.sock").is_err());
        assert!(ok("/run/gpusnap/probe/admin/agent.sock", "/run/gpusnap/probe/probe.sock").is_err());
        assert!(ok("/run/gpusnap/probe/../probe/x/agent.sock", "/run/gpusnap/probe/probe.sock").is_err());
        assert!(ok("/run/gpusnap/agent.sock", "/run/gpusnap/probe.sock").is_err());
    }
}
