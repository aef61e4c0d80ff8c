//! An image's files flushed to disk: write-back started while CRIU writes,
//! waited for before the image is renamed into place.

use crate::manifest::chunked_name;
use std::fs;
use std::path::{Path, PathBuf};

/// Every regular file under `dir`, as paths relative to `base`.
pub(crate) fn files_under(base: &Path, dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for e in fs::read_dir(dir)? {
        let e = e?;
        let ft = e.file_type()?;
        if ft.is_dir() {
            files_under(base, &e.path(), out)?;
        } else if ft.is_file() {
            out.push(e.path().strip_prefix(base).unwrap_or(&e.path()).to_path_buf());
        }
    }
    Ok(())
}

/// Queues the dirty pages of every file under `dir` for write-back and
/// returns at once (sync_file_range WRITE: no waiting). Called while CRIU
/// is still writing, so that the disk works alongside it and little is left
/// for [`sync_tree`] at the end. Only the image's own files: unlike a
/// syncfs, another program's dirty data on the same filesystem never makes
/// a hibernate wait.
pub fn start_writeback(dir: &Path) {
    use std::os::fd::AsRawFd;
    let mut rel = Vec::new();
    if files_under(dir, dir, &mut rel).is_err() {
        return;
    }
    // Pages files become chunks: writing them back would put the memory
    // on the disk twice (the file, then its chunks).
    for r in rel.into_iter().filter(|r| !chunked_name(&r.to_string_lossy())) {
        if let Ok(f) = fs::File::open(dir.join(r)) {
            // SAFETY: a valid fd; offset 0 and length 0 mean the whole file.
            unsafe { libc::sync_file_range(f.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE) };
        }
    }
}

/// Puts every file under `dir`, and the directories themselves, on disk
/// (fdatasync each: one page file holds nearly all of an image's bytes).
pub fn sync_tree(dir: &Path) -> std::io::Result<()> {
    sync_tree_but(dir, |_| false)
}

/// [`sync_tree`], leaving out the files `skip` names (by their path).
pub(crate) fn sync_tree_but(dir: &Path, skip: fn(&str) -> bool) -> std::io::Result<()> {
    let mut rel = Vec::new();
    files_under(dir, dir, &mut rel)?;
    for r in rel.iter().filter(|r| !skip(&r.to_string_lossy())) {
        fs::File::open(dir.join(r))?.sync_data()?;
    }
    let mut dirs: Vec<PathBuf> = rel.iter().filter_map(|r| r.parent().map(|p| dir.join(p))).collect();
    dirs.sort();
    dirs.dedup();
    for d in dirs {
        sync_dir(&d)?;
    }
    sync_dir(dir)
}

pub(crate) fn sync_dir(p: &Path) -> std::io::Result<()> {
    fs::File::open(p)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_back_and_sync_of_a_tree() {
        let d = tempfile::tempdir().unwrap();
        fs::create_dir_all(d.path().join("criu/sub")).unwrap();
        fs::write(d.path().join("criu/pages-1.img"), vec![7u8; 1 << 20]).unwrap();
        fs::write(d.path().join("criu/sub/x.img"), b"x").unwrap();
        start_writeback(d.path());
        sync_tree(d.path()).unwrap();
        assert!(sync_tree(&d.path().join("missing")).is_err());
    }
}
