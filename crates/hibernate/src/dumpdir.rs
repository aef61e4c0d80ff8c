//! Where CRIU writes a hibernate's images: a tmpfs directory when the host
//! has the memory to spare, so that its pages files never reach the disk.
//!
//! On a disk, CRIU's pages files are written back (dirty page cache) while
//! the follower ([`crate::follow`]) turns them into chunks, which are
//! written too: the disk carries the process's memory twice (measured on
//! the H200 host, docs/benchmarks.md). On a tmpfs nothing of them is
//! written; the small CRIU files are copied into the image directory after
//! the dump and the tmpfs directory is removed once the follower is done.
//! With `GPUSNAP_FOLLOW_PUNCH=1` the follower punches each segment out once
//! it is chunked, which frees its memory at once (the tmpfs then holds only
//! the follower's lag), but it made CRIU's dump twice as slow on a 2-core
//! host (bench/cpu/dumpdir.sh), so it is off: the checks below
//! leave room for the whole dump anyway.
//!
//! The tmpfs is used when `MemAvailable` minus the memory to dump (the
//! tree's RSS, the CUDA checkpoint's host copy included) stays above a
//! margin of max(25% of `MemTotal`, 8 GiB): at worst (a follower that
//! cannot keep up) the whole dump sits in memory; and only when the tmpfs
//! has room for the whole dump. `GPUSNAP_DUMP_TMPFS=0`
//! forces the disk, `=1` the tmpfs; `GPUSNAP_DUMP_TMPFS_DIR` names the
//! tmpfs (default `/dev/shm`). Each directory is
//! `gpusnap-<pid>-<start time>-<random>` (mode 0700) and is removed in
//! every outcome; one left by a gpusnap that was killed (its pid gone or
//! now another process) is removed by the next hibernate.

use std::fs;
use std::path::{Path, PathBuf};

/// "0": the disk; "1": the tmpfs; unset: chosen by the memory available.
pub const ENV: &str = "GPUSNAP_DUMP_TMPFS";
/// The tmpfs to use (default [`DEFAULT_BASE`]).
pub const DIR_ENV: &str = "GPUSNAP_DUMP_TMPFS_DIR";
pub const DEFAULT_BASE: &str = "/dev/shm";
const PREFIX: &str = "gpusnap-";

use nix::fcntl::{Flock, FlockArg};

/// A tmpfs directory for one dump; removed when dropped. Its lock file
/// ([`LOCK`]) is held (flock) for its whole life: that, not the pid in its
/// name, is what tells another gpusnap it is in use (a gpusnap in another
/// pid namespace sharing the tmpfs sees no such pid: the pid alone made it
/// remove live dumps, seen when two test runs shared /dev/shm).
#[derive(Debug)]
pub struct TmpfsDump {
    dir: PathBuf,
    _lock: Flock<fs::File>,
}

/// The lock file in every dump directory.
const LOCK: &str = ".owner";

impl TmpfsDump {
    /// The directory that plays the image directory for the follower.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where CRIU writes its images.
    pub fn criu_dir(&self) -> PathBuf {
        self.dir.join("criu")
    }

    /// Copies every file CRIU wrote but the pages files in `skip` (those
    /// the follower chunked) into `to`.
    pub fn copy_into(&self, to: &Path, skip: &dyn Fn(&str) -> bool) -> std::io::Result<()> {
        for e in fs::read_dir(self.criu_dir())? {
            let e = e?;
            let name = e.file_name().to_string_lossy().into_owned();
            if skip(&format!("criu/{name}")) {
                continue;
            }
            let ft = e.file_type()?;
            if ft.is_file() {
                fs::copy(e.path(), to.join(&name))?;
            } else if ft.is_dir() {
                // CRIU writes none; refused rather than lost.
                return Err(std::io::Error::other(format!("a directory from CRIU: {name}")));
            }
        }
        Ok(())
    }
}

impl Drop for TmpfsDump {
    fn drop(&mut self) {
        if let Err(e) = fs::remove_dir_all(&self.dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!("remove {}: {e}", self.dir.display());
            }
        }
    }
}

fn base() -> PathBuf {
    std::env::var_os(DIR_ENV).map_or_else(|| PathBuf::from(DEFAULT_BASE), PathBuf::from)
}

/// The margin of memory a tmpfs dump must leave available.
pub fn margin(total: u64) -> u64 {
    (total / 4).max(8 << 30)
}

/// Would a dump of `dump_bytes` fit in memory with the margin left?
pub fn fits(total: u64, available: u64, dump_bytes: u64) -> bool {
    available.saturating_sub(dump_bytes) > margin(total)
}

/// MemTotal and MemAvailable, in bytes.
pub(crate) use gpusnap_images::chunkfile::meminfo;

/// A tmpfs directory for a dump of `dump_bytes`, or None for the disk (by
/// [`ENV`], for want of memory, or when the directory cannot be made).
pub fn choose(dump_bytes: u64) -> Option<TmpfsDump> {
    let base = base();
    clean_stale(&base);
    let forced = match std::env::var(ENV).as_deref() {
        Ok("0") => return None,
        Ok("1") => true,
        _ => false,
    };
    if !forced {
        match meminfo() {
            Some((total, avail)) if fits(total, avail, dump_bytes) => {}
            _ => return None,
        }
        // A tmpfs with room for the whole dump (the worst case): a small
        // one (a container's 64 MiB /dev/shm) would fail CRIU midway.
        match tmpfs_room(&base) {
            Some(room) if room >= dump_bytes => {}
            _ => return None,
        }
    }
    match create(&base) {
        Ok(d) => Some(d),
        Err(e) => {
            tracing::warn!("a dump directory under {}: {e}; dumping to the disk", base.display());
            None
        }
    }
}

/// The bytes free on `base` when it is a tmpfs; None when it is not (or
/// cannot be looked at).
fn tmpfs_room(base: &Path) -> Option<u64> {
    let st = nix::sys::statfs::statfs(base).ok()?;
    if st.filesystem_type() != nix::sys::statfs::TMPFS_MAGIC {
        return None;
    }
    Some(st.blocks_available().saturating_mul(st.block_size() as u64))
}

fn self_start_time() -> u64 {
    procfs::process::Process::myself().and_then(|p| p.stat()).map_or(0, |s| s.starttime)
}

fn create(base: &Path) -> std::io::Result<TmpfsDump> {
    use std::os::unix::fs::DirBuilderExt;
    let rand = rand::random::<u64>();
    let name = format!("{PREFIX}{}-{}-{rand:016x}", std::process::id(), self_start_time());
    // Made under a name no cleaner looks at, locked, then renamed: a
    // directory under its final name always has its lock held.
    let new = base.join(format!(".{PREFIX}new-{rand:016x}"));
    // Not recursive: the base must exist, the directory must not.
    fs::DirBuilder::new().mode(0o700).create(&new)?;
    let made = (|| {
        let lock = gpusnap_files::create_private(&new.join(LOCK))?;
        let lock =
            Flock::lock(lock, FlockArg::LockExclusiveNonblock).map_err(|(_, e)| std::io::Error::from(e))?;
        fs::DirBuilder::new().mode(0o700).create(new.join("criu"))?;
        let dir = base.join(&name);
        fs::rename(&new, &dir)?;
        Ok(TmpfsDump { dir, _lock: lock })
    })();
    if made.is_err() {
        let _ = fs::remove_dir_all(&new);
    }
    made
}

/// Is the dump directory `dir` (named for `pid` started at `start`) still
/// used? By its lock when it has one (any gpusnap, any pid namespace), else
/// (made by an older gpusnap) by its pid.
fn in_use(dir: &Path, pid: i32, start: u64) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    match fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(dir.join(LOCK))
    {
        // Unlocked: its owner is gone (the lock goes with the process).
        Ok(f) => Flock::lock(f, FlockArg::LockExclusiveNonblock).is_err(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            procfs::process::Process::new(pid).and_then(|p| p.stat()).is_ok_and(|s| s.starttime == start)
        }
        // Unreadable: left alone.
        Err(_) => true,
    }
}

/// (pid, start time) of a directory name this module makes.
fn owner(name: &str) -> Option<(i32, u64)> {
    let mut it = name.strip_prefix(PREFIX)?.splitn(3, '-');
    let pid = it.next()?.parse().ok()?;
    let start = it.next()?.parse().ok()?;
    it.next()?;
    Some((pid, start))
}

/// Removes the dump directories under `base` of gpusnaps that are gone
/// (their lock not held; without one, their pid free or taken by a process
/// started at another time).
pub fn clean_stale(base: &Path) {
    let Ok(entries) = fs::read_dir(base) else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some((pid, start)) = owner(&name) else { continue };
        // Only directories of our own making: not a link, owned by us.
        let ours = fs::symlink_metadata(e.path()).is_ok_and(|m| {
            use std::os::unix::fs::MetadataExt;
            // SAFETY: geteuid takes nothing and cannot fail.
            m.is_dir() && m.uid() == unsafe { libc::geteuid() }
        });
        if ours && !in_use(&e.path(), pid, start) {
            match fs::remove_dir_all(e.path()) {
                Ok(()) => tracing::info!("removed {} (left by a gpusnap that ended)", e.path().display()),
                Err(err) => tracing::warn!("remove {}: {err}", e.path().display()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_margin_is_a_quarter_or_8_gib() {
        let g = 1u64 << 30;
        assert_eq!(margin(16 * g), 8 * g);
        assert_eq!(margin(128 * g), 32 * g);
        assert!(fits(128 * g, 100 * g, 20 * g));
        assert!(!fits(128 * g, 50 * g, 20 * g));
        assert!(!fits(16 * g, 4 * g, 0));
    }

    #[test]
    fn dev_shm_is_a_tmpfs_and_tmp_dirs_may_not_be() {
        if Path::new(DEFAULT_BASE).exists() {
            assert!(tmpfs_room(Path::new(DEFAULT_BASE)).is_some());
        }
        assert_eq!(tmpfs_room(Path::new("/proc")), None);
    }

    #[test]
    fn stale_directories_of_dead_gpusnaps_go_live_ones_stay() {
        let tmp = tempfile::tempdir().unwrap();
        let me = create(tmp.path()).unwrap();
        fs::write(me.criu_dir().join("pages-1.img"), b"x").unwrap();
        // A pid that cannot exist (above pid_max), and ours with another start.
        let dead = tmp.path().join(format!("{PREFIX}{}-1-ab", i32::MAX));
        let reused = tmp.path().join(format!("{PREFIX}{}-{}-cd", std::process::id(), self_start_time() + 1));
        let other = tmp.path().join("gpusnap-not-ours");
        for d in [&dead, &reused, &other] {
            fs::create_dir_all(d.join("criu")).unwrap();
        }
        // Another pid namespace's gpusnap: no such pid here, its lock held.
        let elsewhere = create(tmp.path()).unwrap();
        let foreign = tmp.path().join(format!("{PREFIX}{}-1-ef", i32::MAX - 1));
        fs::rename(elsewhere.dir(), &foreign).unwrap();
        // A locked directory of a gpusnap that died: its lock file, unlocked.
        let died = tmp.path().join(format!("{PREFIX}{}-1-12", i32::MAX - 2));
        fs::create_dir_all(died.join("criu")).unwrap();
        fs::write(died.join(LOCK), b"").unwrap();
        clean_stale(tmp.path());
        assert!(me.dir().exists());
        assert!(!dead.exists());
        assert!(!reused.exists());
        assert!(other.exists());
        assert!(foreign.exists(), "a live dump of another pid namespace stays");
        assert!(!died.exists());
        drop(elsewhere);
        clean_stale(tmp.path());
        assert!(!foreign.exists(), "its lock let go with its owner");
        let d = me.dir().to_path_buf();
        drop(me);
        assert!(!d.exists());
    }
}
