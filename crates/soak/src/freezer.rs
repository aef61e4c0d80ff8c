//! A process's cgroup frozen (the freezer of cgroup v1, or v2's
//! `cgroup.freeze`), as a container runtime pausing a container does.

use anyhow::{bail, Context, Result};
use std::path::PathBuf;

pub struct Freezer {
    dir: PathBuf,
    parent: PathBuf,
    pid: i32,
    v1: bool,
}

impl Freezer {
    /// Moves `pid` into a cgroup of its own and freezes it.
    pub fn freeze(pid: i32) -> Result<Freezer> {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let name = format!("gpusnap-soak-{}-{n}", std::process::id());
        let (parent, v1) = if PathBuf::from("/sys/fs/cgroup/freezer/cgroup.procs").exists() {
            (PathBuf::from("/sys/fs/cgroup/freezer"), true)
        } else if PathBuf::from("/sys/fs/cgroup/cgroup.controllers").exists() {
            (PathBuf::from("/sys/fs/cgroup"), false)
        } else {
            bail!("no cgroup freezer on this host");
        };
        let dir = parent.join(name);
        std::fs::create_dir(&dir).with_context(|| format!("create {} (needs root)", dir.display()))?;
        let f = Freezer { dir, parent, pid, v1 };
        std::fs::write(f.dir.join("cgroup.procs"), pid.to_string()).context("move the service into it")?;
        if v1 {
            std::fs::write(f.dir.join("freezer.state"), "FROZEN")?;
        } else {
            std::fs::write(f.dir.join("cgroup.freeze"), "1")?;
        }
        Ok(f)
    }

    /// Thaws it, moves it back and removes the cgroup.
    pub fn thaw(self) {
        if self.v1 {
            let _ = std::fs::write(self.dir.join("freezer.state"), "THAWED");
        } else {
            let _ = std::fs::write(self.dir.join("cgroup.freeze"), "0");
        }
        let procs = std::fs::read_to_string(self.dir.join("cgroup.procs")).unwrap_or_default();
        for p in procs.split_whitespace().chain(std::iter::once(self.pid.to_string().as_str())) {
            let _ = std::fs::write(self.parent.join("cgroup.procs"), p);
        }
        for _ in 0..100 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
}
