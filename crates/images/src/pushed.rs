//! The newest push version seen of each image name on each remote
//! (`STATE/store/pushes/KEY`, KEY a hash of the remote and the name): what
//! a pull compares a remote's push record with, to refuse a rollback (an
//! older push put back over a newer one).

use std::path::{Path, PathBuf};

fn path(state_dir: &Path, remote: &str, name: &str) -> PathBuf {
    let mut h = blake3::Hasher::new();
    h.update(remote.trim_end_matches('/').as_bytes());
    h.update(b"\0");
    h.update(name.as_bytes());
    let key = h.finalize().to_hex();
    state_dir.join("store").join("pushes").join(&key.as_str()[..32])
}

/// The newest version of `name` on `remote` this host has pushed or
/// pulled; 0 for none.
pub fn seen(state_dir: &Path, remote: &str, name: &str) -> u64 {
    let Ok(f) = gpusnap_files::open_regular(&path(state_dir, remote, name), 64) else { return 0 };
    gpusnap_files::read_bounded(f, 64)
        .ok()
        .and_then(|b| String::from_utf8(b).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Records `version` of `name` on `remote` as seen (kept if older than
/// the one already recorded).
pub fn note(state_dir: &Path, remote: &str, name: &str, version: u64) -> std::io::Result<()> {
    if version <= seen(state_dir, remote, name) {
        return Ok(());
    }
    let p = path(state_dir, remote, name);
    if let Some(d) = p.parent() {
        gpusnap_files::mkdir_private(d)?;
    }
    // Under a temporary name, then renamed: never half a number.
    let tmp = p.with_extension(format!("tmp-{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    gpusnap_files::write_private(&tmp, version.to_string().as_bytes())?;
    std::fs::rename(&tmp, &p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_only_grow_and_are_kept_per_remote_and_name() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(seen(d.path(), "s3://b/p", "a"), 0);
        note(d.path(), "s3://b/p/", "a", 3).unwrap();
        assert_eq!(seen(d.path(), "s3://b/p", "a"), 3);
        note(d.path(), "s3://b/p", "a", 2).unwrap();
        assert_eq!(seen(d.path(), "s3://b/p", "a"), 3);
        assert_eq!(seen(d.path(), "s3://b/p", "b"), 0);
        assert_eq!(seen(d.path(), "s3://b/q", "a"), 0);
    }
}
