//! Files gpusnap keeps for its owner alone: private directories and files
//! (never created through a link), reads of regular files bounded in size.
//! Below every crate that writes to the state directory (the journal, the
//! images, CRIU's logs), so that all of them make files the same way.

mod dir;
pub use dir::PrivateDir;

use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// Creates a private directory, or checks that an existing one is a real
/// directory (not a link) before making it private: chmod follows links.
pub fn mkdir_private(p: &Path) -> std::io::Result<()> {
    fs::DirBuilder::new().recursive(true).mode(0o700).create(p)?;
    let meta = fs::symlink_metadata(p)?;
    if !meta.is_dir() {
        return Err(std::io::Error::other(format!("{} is not a directory (a link?)", p.display())));
    }
    fs::set_permissions(p, fs::Permissions::from_mode(0o700))
}

/// Creates a new file, private (0600), never through a link.
pub fn create_private(p: &Path) -> std::io::Result<fs::File> {
    fs::OpenOptions::new().write(true).create_new(true).mode(0o600).custom_flags(libc::O_NOFOLLOW).open(p)
}

/// Opens `p` for reading only if it is a regular file of its own (not a
/// link, not a hard link to elsewhere, not a FIFO or device) of at most
/// `max` bytes: the type is checked on the descriptor, which O_NONBLOCK
/// keeps a FIFO from blocking in open.
pub fn open_regular(p: &Path, max: u64) -> std::io::Result<fs::File> {
    use std::os::unix::fs::MetadataExt;
    let f = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(p)
        .map_err(|e| {
            if e.raw_os_error() == Some(libc::ELOOP) {
                std::io::Error::other("a symbolic link")
            } else {
                e
            }
        })?;
    let meta = f.metadata()?;
    if !meta.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    if meta.nlink() > 1 {
        return Err(std::io::Error::other("a hard link to a file elsewhere"));
    }
    if meta.len() > max {
        return Err(std::io::Error::other(format!("too large ({} bytes)", meta.len())));
    }
    Ok(f)
}

/// Reads a file opened by [`open_regular`], at most `max` bytes.
pub fn read_bounded(f: fs::File, max: u64) -> std::io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    f.take(max.saturating_add(1)).read_to_end(&mut buf)?;
    if buf.len() as u64 > max {
        return Err(std::io::Error::other("too large"));
    }
    Ok(buf)
}

/// Writes `data` to `p` (created 0600 or truncated) and flushes it to disk.
pub fn write_private(p: &Path, data: &[u8]) -> std::io::Result<()> {
    let mut f = fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(p)?;
    f.write_all(data)?;
    f.sync_all()
}
