//! The servers' output: each service's stdout and stderr go to
//! `STATE_DIR/agent/NAME.log`, kept under [`MAX_LOG`]: past it, the file is
//! copied to `NAME.log.1` (the previous `.1` replaced) and truncated in
//! place (logrotate's copytruncate). The server keeps writing to the same
//! open file (opened for appending, its writes land at the new end), so it
//! needs no signal and the agent holds no pipe whose end would die with it.
//!
//! [`tail`] and [`since`] read them back (`gpusnap logs`, `GET
//! /v1/services/NAME/logs`), across one rotation, bounded in bytes.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// The most one read gives back (bytes).
pub const MAX_READ: u64 = 1 << 20;

/// A server's log grows to this size before it is rotated.
pub const MAX_LOG: u64 = 64 << 20;

/// Where a service's output goes.
pub fn path(state_dir: &Path, service: &str) -> PathBuf {
    state_dir.join("agent").join(format!("{service}.log"))
}

/// Opens `log` for a server to append to (made if need be, rotated if
/// past [`MAX_LOG`]): the file 0640 of group `gid` where given (the
/// agent's group), else 0600. Its directory stays owner-only (0700), as
/// the state directory's checks keep it: the group reads through the
/// agent's API, or where an operator opens the directories to it.
pub fn open_for_server(log: &Path, gid: Option<u32>) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
    let file_mode = if gid.is_some() { 0o640 } else { 0o600 };
    if let Some(dir) = log.parent() {
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    }
    let _ = rotate(log, MAX_LOG);
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(file_mode)
        .custom_flags(libc::O_NOFOLLOW)
        .open(log)?;
    if gid.is_some() {
        std::os::unix::fs::fchown(&f, None, gid)?;
    }
    // One made before under other modes.
    f.set_permissions(std::fs::Permissions::from_mode(file_mode))?;
    Ok(f)
}

/// Rotates `log` if it is past `max`. Lines written during the copy may be
/// lost (as with copytruncate); the rest is in one file or the other.
pub fn rotate(log: &Path, max: u64) -> std::io::Result<bool> {
    let len = match std::fs::metadata(log) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    if len <= max {
        return Ok(false);
    }
    let tmp = log.with_extension("log.1.tmp");
    // The copy keeps the file's mode and group (std::fs::copy copies the mode).
    std::fs::copy(log, &tmp)?;
    if let Ok(m) = std::fs::metadata(log) {
        use std::os::unix::fs::MetadataExt;
        let _ = std::os::unix::fs::chown(&tmp, None, Some(m.gid()));
    }
    std::fs::rename(&tmp, previous(log))?;
    std::fs::OpenOptions::new().write(true).open(log)?.set_len(0)?;
    Ok(true)
}

/// The rotated file of `log` (`NAME.log.1`).
pub fn previous(log: &Path) -> PathBuf {
    let mut old = log.as_os_str().to_owned();
    old.push(".1");
    PathBuf::from(old)
}

/// `len` bytes of `path` from `from` (fewer at its end); an absent file
/// reads as empty.
fn read_range(path: &Path, from: u64, len: u64) -> std::io::Result<Vec<u8>> {
    let mut f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    f.seek(SeekFrom::Start(from))?;
    let mut out = Vec::new();
    f.take(len).read_to_end(&mut out)?;
    Ok(out)
}

fn len_of(path: &Path) -> std::io::Result<Option<u64>> {
    match std::fs::metadata(path) {
        Ok(m) => Ok(Some(m.len())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// The last `lines` lines of `log` (the rotated file's end first where
/// the current has fewer), at most [`MAX_READ`] bytes, and where a follow
/// goes on (the current file's length). Neither file: NotFound.
pub fn tail(log: &Path, lines: usize) -> std::io::Result<(Vec<u8>, u64)> {
    let old = previous(log);
    let (cur_len, old_len) = (len_of(log)?, len_of(&old)?);
    if cur_len.is_none() && old_len.is_none() {
        return Err(std::io::Error::new(std::io::ErrorKind::NotFound, format!("no {}", log.display())));
    }
    let cur_len = cur_len.unwrap_or(0);
    let take = cur_len.min(MAX_READ);
    let mut text = read_range(log, cur_len - take, take)?;
    let newlines = |t: &[u8]| t.iter().filter(|b| **b == b'\n').count();
    if newlines(&text) <= lines && take < MAX_READ {
        let old_len = old_len.unwrap_or(0);
        let more = old_len.min(MAX_READ - take);
        let mut before = read_range(&old, old_len - more, more)?;
        before.extend_from_slice(&text);
        text = before;
    }
    // The last `lines` lines: after the `lines`-th newline from the end,
    // the file's last newline not counted.
    let mut seen = 0;
    let mut start = if lines == 0 { text.len() } else { 0 };
    for (i, b) in text.iter().enumerate().rev() {
        if lines > 0 && *b == b'\n' && i + 1 < text.len() {
            seen += 1;
            if seen == lines {
                start = i + 1;
                break;
            }
        }
    }
    Ok((text.split_off(start), cur_len))
}

/// What was written to `log` after `offset` (a length [`tail`] or this
/// gave), at most [`MAX_READ`] bytes, and the offset to go on from. A
/// file shorter than `offset` was rotated: the rest of the rotated file
/// comes first, then the new one from its start.
pub fn since(log: &Path, offset: u64) -> std::io::Result<(Vec<u8>, u64)> {
    let len = len_of(log)?.unwrap_or(0);
    if len >= offset {
        let take = (len - offset).min(MAX_READ);
        return Ok((read_range(log, offset, take)?, offset + take));
    }
    let old = previous(log);
    let old_len = len_of(&old)?.unwrap_or(0);
    let mut text = read_range(&old, offset.min(old_len), MAX_READ)?;
    let take = len.min(MAX_READ - text.len() as u64);
    text.extend(read_range(log, 0, take)?);
    Ok((text, take))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn the_last_lines_come_across_a_rotation_and_a_follow_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("a.log");
        assert_eq!(tail(&log, 3).unwrap_err().kind(), std::io::ErrorKind::NotFound);
        std::fs::write(previous(&log), "one\ntwo\nthree\n").unwrap();
        std::fs::write(&log, "four\nfive").unwrap();
        assert_eq!(tail(&log, 3).unwrap(), (b"three\nfour\nfive".to_vec(), 9));
        assert_eq!(tail(&log, 1).unwrap().0, b"five");
        assert_eq!(tail(&log, 0).unwrap().0, b"");
        std::fs::write(dir.path().join("b.log"), "a\nb\n").unwrap();
        assert_eq!(tail(&dir.path().join("b.log"), 1).unwrap().0, b"b\n");
        assert_eq!(tail(&log, 100).unwrap().0, b"one\ntwo\nthree\nfour\nfive");
        let mut w = std::fs::OpenOptions::new().append(true).open(&log).unwrap();
        w.write_all(b"\nsix\n").unwrap();
        assert_eq!(since(&log, 9).unwrap(), (b"\nsix\n".to_vec(), 14));
        // Rotated: the old file's rest, then the new one.
        std::fs::write(previous(&log), "four\nfive\nsix\nseven\n").unwrap();
        std::fs::write(&log, "eight\n").unwrap();
        assert_eq!(since(&log, 14).unwrap(), (b"seven\neight\n".to_vec(), 6));
    }

    #[test]
    fn a_log_past_its_size_is_kept_once_and_started_again() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("a.log");
        let mut w = std::fs::OpenOptions::new().create(true).append(true).open(&log).unwrap();
        w.write_all(&[b'x'; 100]).unwrap();
        assert!(!rotate(&log, 100).unwrap());
        w.write_all(b"y").unwrap();
        assert!(rotate(&log, 100).unwrap());
        assert_eq!(std::fs::metadata(dir.path().join("a.log.1")).unwrap().len(), 101);
        // The writer goes on at the start of the truncated file.
        w.write_all(b"after").unwrap();
        assert_eq!(std::fs::read(&log).unwrap(), b"after");
        assert!(!rotate(&dir.path().join("none.log"), 1).unwrap());
    }
}
