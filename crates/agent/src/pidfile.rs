//! Whether a `pid_file` may name the server the agent adopts. The agent
//! suspends what it adopts, as root: a pid file that another user could
//! write would let that user point it at any CUDA process of the host (a
//! tenant's, or pid 1). Refused: a file that anyone but its owner may
//! write (group- or world-writable), and a process whose owner is neither
//! the file's owner nor root's file (root may name any user's server);
//! pid 1 and the agent itself, always.

use gpusnap_core::target::Target;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;

/// The warning about a refused pid file, at most once a minute.
pub static REFUSED: crate::ratelimit::Every = crate::ratelimit::Every::new(Duration::from_secs(60));

/// Ok when `file` may name `t`; else why not.
pub fn trusted(file: &Path, t: &Target) -> Result<(), String> {
    if t.pid <= 1 || t.pid as u32 == std::process::id() {
        return Err(format!("it names pid {}, never a server", t.pid));
    }
    let m = std::fs::metadata(file).map_err(|e| e.to_string())?;
    judge(m.mode(), m.uid(), t)
}

fn judge(mode: u32, file_uid: u32, t: &Target) -> Result<(), String> {
    if mode & 0o022 != 0 {
        return Err(format!(
            "others may write it (mode {:o}): make it writable by its owner only",
            mode & 0o777
        ));
    }
    if file_uid != 0 && file_uid != t.uid {
        return Err(format!(
            "it belongs to uid {file_uid} and names pid {} of uid {}: a pid file names a process of its own owner",
            t.pid, t.uid
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(uid: u32) -> Target {
        Target { pid: 4242, start_time: 1, comm: "server".into(), uid }
    }

    #[test]
    fn others_writable_or_another_owners_process_is_refused() {
        assert!(judge(0o100644, 1000, &t(1000)).is_ok());
        assert!(judge(0o100600, 0, &t(1000)).is_ok());
        assert!(judge(0o100666, 1000, &t(1000)).unwrap_err().contains("others may write"));
        assert!(judge(0o100664, 1000, &t(1000)).unwrap_err().contains("mode 664"));
        assert!(judge(0o100644, 1000, &t(0)).unwrap_err().contains("uid 1000"));
        assert!(judge(0o100644, 1000, &t(1001)).is_err());
        let one = Target { pid: 1, ..t(0) };
        assert!(trusted(Path::new("/nonexistent"), &one).unwrap_err().contains("pid 1"));
    }
}
