//! The state directory: created private, owned by this user (or root),
//! writable by nobody else, and holding no links.

use crate::error::Error;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// What lives in the state directory; none of it may be a link (root would
/// follow it: chmod, writes, images placed elsewhere).
const STATE_ENTRIES: &[&str] = &[
    "gpusnap.db",
    "gpusnap.db-wal",
    "gpusnap.db-shm",
    "host.key",
    "images",
    "logs",
    "locks",
    "guards",
    "maps",
    "store",
    "agent",
];

/// The directories that hold what other users must not read (processes'
/// memory in images, chunks and map files; programs' output in logs):
/// owner only (0700), never 0755.
const PRIVATE_DIRS: &[&str] = &["images", "logs", "guards", "maps", "store", "agent"];

/// The state directory (created 0700 if missing) must belong to this user
/// (or root) and be writable by nobody else, and nothing in it may be a
/// link: its journal, keys and images are trusted, and root acts on them.
pub fn check_state_dir(dir: &Path) -> Result<(), Error> {
    create_private_dir(dir).map_err(|e| Error::Store {
        path: dir.display().to_string(),
        reason: format!("cannot create: {e}"),
    })?;
    check_state_dir_only(dir)
}

pub(crate) fn check_state_dir_only(dir: &Path) -> Result<(), Error> {
    let bad = |reason: String| Error::Store { path: dir.display().to_string(), reason };
    let meta = std::fs::metadata(dir).map_err(|e| bad(e.to_string()))?;
    if !meta.is_dir() {
        return Err(bad("not a directory".into()));
    }
    private_dir(dir, &meta).map_err(bad)?;
    for name in STATE_ENTRIES {
        let p = dir.join(name);
        let Ok(m) = std::fs::symlink_metadata(&p) else { continue };
        if m.file_type().is_symlink() {
            return Err(bad(format!(
                "{} is a symbolic link; gpusnap follows none in its state directory: remove it",
                p.display()
            )));
        }
        if m.is_dir() {
            private_dir(&p, &m).map_err(bad)?;
            if PRIVATE_DIRS.contains(name) && m.mode() & 0o077 != 0 {
                owner_only(dir, name, &m).map_err(bad)?;
            }
        }
    }
    Ok(())
}

/// `dir/name`, readable by others (0755, say), made 0700 if it is this
/// user's (on its descriptor: a link swapped in meanwhile is refused);
/// refused otherwise.
fn owner_only(dir: &Path, name: &str, m: &std::fs::Metadata) -> Result<(), String> {
    let p = dir.join(name);
    let me = nix::unistd::geteuid().as_raw();
    if m.uid() != me {
        return Err(format!(
            "{} is readable by others (mode {:o}) and not this user's to fix: `chmod 700 {}`",
            p.display(),
            m.mode() & 0o7777,
            p.display()
        ));
    }
    match gpusnap_files::PrivateDir::open(dir, name) {
        Ok(_) => {}
        // A read-only filesystem: nothing is written there, and it can be
        // made private only where it is writable.
        Err(e) if e.raw_os_error() == Some(libc::EROFS) => {
            tracing::warn!(path = %p.display(), "readable by others, on a read-only filesystem: left as it is");
            return Ok(());
        }
        Err(e) => return Err(e.to_string()),
    }
    tracing::debug!(path = %p.display(), mode = format!("{:o}", m.mode() & 0o7777), "made owner-only (0700)");
    Ok(())
}

/// A directory of ours: owned by this user or root, writable by nobody else.
fn private_dir(p: &Path, meta: &std::fs::Metadata) -> Result<(), String> {
    let me = nix::unistd::geteuid().as_raw();
    if meta.uid() != me && meta.uid() != 0 {
        return Err(format!(
            "{} belongs to uid {}, not to this user: `chown {me} {}` (or choose another --state-dir)",
            p.display(),
            meta.uid(),
            p.display()
        ));
    }
    if meta.mode() & 0o022 != 0 {
        return Err(format!(
            "{} is writable by others (mode {:o}): `chmod 700 {}` (or choose another --state-dir)",
            p.display(),
            meta.mode() & 0o7777,
            p.display()
        ));
    }
    Ok(())
}

fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    if dir.is_dir() {
        return Ok(());
    }
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)
}
