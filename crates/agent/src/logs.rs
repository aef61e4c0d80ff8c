//! The servers' output: each service's stdout and stderr go to
//! `STATE_DIR/agent/NAME.log`, kept under [`MAX_LOG`]: past it, the file is
//! copied to `NAME.log.1` (the previous `.1` replaced) and truncated in
//! place (logrotate's copytruncate). The server keeps writing to the same
//! open file (opened for appending, its writes land at the new end), so it
//! needs no signal and the agent holds no pipe whose end would die with it.

use std::path::{Path, PathBuf};

/// A server's log grows to this size before it is rotated.
pub const MAX_LOG: u64 = 64 << 20;

/// Where a service's output goes.
pub fn path(state_dir: &Path, service: &str) -> PathBuf {
    state_dir.join("agent").join(format!("{service}.log"))
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
    let mut old = log.as_os_str().to_owned();
    old.push(".1");
    let tmp = log.with_extension("log.1.tmp");
    std::fs::copy(log, &tmp)?;
    std::fs::rename(&tmp, PathBuf::from(old))?;
    std::fs::OpenOptions::new().write(true).open(log)?.set_len(0)?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

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
