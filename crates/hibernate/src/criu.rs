//! CRIU, the engine that dumps and restores whole process trees.
//!
//! Driven through its command line rather than `criu swrk` RPC: the command
//! line is what users debug with, its flags are stable across 3.x/4.x, and it
//! keeps protobuf out of the build. A failure is surfaced as the first error
//! line of its log (the cause; later errors are often its consequences) and
//! the last, and the log of every failed dump or restore is kept in
//! `STATE_DIR/logs/` (pruned to the newest [`KEEP_LOGS`]), which the error names.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The first CRIU that works on current kernels (3.17 fails on 6.x vDSO
/// layouts; 4.1.1 is what was measured working).
pub const MIN_VERSION: (u32, u32) = (4, 0);

#[derive(Debug, thiserror::Error)]
pub enum CriuError {
    #[error("criu not found ({0}); install CRIU >= 4.0 (scripts/install-criu.sh) or pass --criu PATH")]
    NotFound(String),
    #[error("criu {found} is too old: gpusnap needs CRIU >= {}.{} (Debian bookworm's 3.17 fails on current kernels; trixie's 4.1.1 works)", MIN_VERSION.0, MIN_VERSION.1)]
    TooOld { found: String },
    #[error("criu {op} failed: {line} (log: {log})")]
    /// `line`: CRIU's first error, and its last when they differ.
    Failed { op: &'static str, line: String, log: String },
    #[error("cannot run criu: {0}")]
    Spawn(String),
}

#[derive(Debug, Clone)]
pub struct Criu {
    pub bin: PathBuf,
    pub version: String,
}

/// Options of a dump that depend on the tree, not on gpusnap.
#[derive(Debug, Clone, Default)]
pub struct DumpOptions {
    pub leave_running: bool,
    /// Leave the tree SIGSTOPped after the dump: nothing it does can make
    /// the image stale (a file growing after the dump makes CRIU refuse to
    /// restore it), and it can still be continued if the image fails.
    pub leave_stopped: bool,
}

fn parse_version(s: &str) -> Option<(u32, u32, String)> {
    let v = s.lines().find_map(|l| l.trim().strip_prefix("Version:"))?.trim().to_string();
    let mut it = v.split('.');
    let major = it.next()?.parse().ok()?;
    let minor = it.next().and_then(|m| m.parse().ok()).unwrap_or(0);
    Some((major, minor, v))
}

/// Is CRIU version `a` (an image's) newer than `b` (this host's), by
/// major.minor (patch releases read the same images)? An unreadable version
/// is never newer.
pub fn newer_version(a: &str, b: &str) -> bool {
    let nums = |v: &str| -> Option<Vec<u32>> {
        v.trim().split('.').take(2).map(|p| p.trim().parse::<u32>().ok()).collect()
    };
    match (nums(a), nums(b)) {
        (Some(x), Some(y)) => x > y,
        _ => false,
    }
}

impl Criu {
    /// Finds criu (`explicit`, else on PATH) and checks its version.
    pub fn find(explicit: Option<&Path>) -> Result<Self, CriuError> {
        let bin = match explicit {
            Some(p) => p.to_path_buf(),
            None => which("criu").ok_or_else(|| CriuError::NotFound("not on PATH".into()))?,
        };
        let out = Command::new(&bin)
            .arg("--version")
            .stdin(Stdio::null())
            .output()
            .map_err(|e| CriuError::NotFound(format!("{}: {e}", bin.display())))?;
        let text = String::from_utf8_lossy(&out.stdout);
        let (major, minor, version) = parse_version(&text)
            .ok_or_else(|| CriuError::NotFound(format!("{} printed no version", bin.display())))?;
        if (major, minor) < MIN_VERSION {
            return Err(CriuError::TooOld { found: version });
        }
        Ok(Self { bin, version })
    }

    fn common(&self, cmd: &mut Command, images: &Path, work: &Path, log: &str) {
        cmd.arg("--images-dir")
            .arg(images)
            .arg("--work-dir")
            .arg(work)
            .args(["--log-file", log, "-v4"])
            // A tree started from a terminal shares its session; the flags
            // below let CRIU take processes as ordinary tools leave them.
            .args(["--shell-job", "--file-locks", "--ext-unix-sk", "--tcp-established"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
    }

    /// Dumps the tree rooted at `pid` into `images`.
    pub fn dump(&self, pid: i32, images: &Path, work: &Path, opts: &DumpOptions) -> Result<(), CriuError> {
        let mut cmd = Command::new(&self.bin);
        cmd.args(["dump", "--tree", &pid.to_string()]);
        if opts.leave_running {
            cmd.arg("--leave-running");
        } else if opts.leave_stopped {
            cmd.arg("--leave-stopped");
        }
        self.common(&mut cmd, images, work, "dump.log");
        self.run("dump", cmd, &work.join("dump.log"))
    }

    /// Restores the image in `images` detached; returns the root's pid.
    pub fn restore(&self, images: &Path, work: &Path) -> Result<i32, CriuError> {
        self.restore_with(images, work, &[])
    }

    /// [`Criu::restore`] with more of CRIU's flags (`--lazy-pages`: see
    /// `crate::lazy`).
    pub fn restore_with(&self, images: &Path, work: &Path, extra: &[&str]) -> Result<i32, CriuError> {
        let pidfile = work.join("restore.pid");
        let _ = std::fs::remove_file(&pidfile);
        let mut cmd = Command::new(&self.bin);
        cmd.args(["restore", "--restore-detached", "--pidfile"]).arg(&pidfile).args(extra);
        self.common(&mut cmd, images, work, "restore.log");
        // With --shell-job a tree restored without its session leader joins
        // CRIU's session: it must be one the woken tree can be dumped in again.
        gpusnap_core::target::own_session_where_needed(&mut cmd);
        if let Err(e) = self.run("restore", cmd, &work.join("restore.log")) {
            end_left_tree(&pidfile);
            return Err(e);
        }
        let pid =
            std::fs::read_to_string(&pidfile).ok().and_then(|s| s.trim().parse().ok()).ok_or_else(|| {
                CriuError::Failed {
                    op: "restore",
                    line: "no pidfile written".into(),
                    log: work.join("restore.log").display().to_string(),
                }
            })?;
        Ok(pid)
    }

    fn run(&self, op: &'static str, mut cmd: Command, log: &Path) -> Result<(), CriuError> {
        tracing::debug!(?cmd, "running criu");
        let mut tries = 0;
        loop {
            let out = cmd.output().map_err(|e| CriuError::Spawn(e.to_string()))?;
            if out.status.success() {
                return Ok(());
            }
            let text = read_log(log);
            let line = first_and_last_error(&text)
                .or_else(|| String::from_utf8_lossy(&out.stderr).lines().last().map(str::to_string))
                .unwrap_or_else(|| format!("exit status {}", out.status));
            // CRIU probes the kernel before it touches any process; those
            // probes can fail while other CRIUs run (measured: several
            // dumps at once). Nothing was done yet: try again.
            if line.contains("kernel features detection") && tries < 3 {
                tries += 1;
                tracing::warn!(op, tries, "criu could not probe the kernel; trying again");
                std::thread::sleep(std::time::Duration::from_millis(300 * tries));
                continue;
            }
            return Err(CriuError::Failed { op, line, log: log.display().to_string() });
        }
    }
}

/// A restore that CRIU reports failed after writing its pidfile (the tree
/// was restored and detached, then CRIU, or what ran it, failed) leaves a
/// tree that nobody resumes and that holds the image's pids, so every retry
/// would be refused: it is ended here, and the failure leaves nothing
/// behind. Its CUDA processes are still checkpointed (the driver's restore
/// comes after CRIU's), so killing them is safe.
fn end_left_tree(pidfile: &Path) {
    use nix::sys::signal::{kill, Signal};
    let Some(root) = std::fs::read_to_string(pidfile).ok().and_then(|s| s.trim().parse::<i32>().ok()) else {
        return;
    };
    let _ = std::fs::remove_file(pidfile);
    let tree = gpusnap_core::tree::process_tree(root);
    tracing::warn!(root, processes = tree.len(), "criu restored a tree and then failed: ending the tree");
    for &(pid, _) in tree.iter().rev() {
        let _ = kill(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL);
    }
    // Reaped by their new parent (init or a subreaper); bounded.
    let end = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while tree.iter().any(|&(pid, _)| gpusnap_core::target::resolve(pid).is_ok()) {
        if std::time::Instant::now() > end {
            tracing::error!(root, "the tree a failed restore left did not exit within 30 s");
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// How many CRIU logs `STATE_DIR/logs/` keeps.
pub const KEEP_LOGS: usize = 20;

/// The tail of a CRIU log (with -v4 it can be large; the errors that
/// matter are at its start and end, and the start is kept whole).
fn read_log(log: &Path) -> String {
    use std::io::Read;
    let mut buf = Vec::new();
    if let Ok(f) = gpusnap_files::open_regular(log, u64::MAX) {
        let _ = f.take(64 << 20).read_to_end(&mut buf);
    }
    String::from_utf8_lossy(&buf).into_owned()
}

/// A new directory for one CRIU run's logs: `STATE_DIR/logs/MILLIS-LABEL`
/// (0700), the oldest beyond [`KEEP_LOGS`] removed.
pub fn new_log_dir(state_dir: &Path, label: &str) -> std::io::Result<PathBuf> {
    let logs = state_dir.join("logs");
    gpusnap_files::mkdir_private(&logs)?;
    let mut old: Vec<PathBuf> = std::fs::read_dir(&logs)?
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name().to_str().is_some_and(|n| n.as_bytes().first().is_some_and(u8::is_ascii_digit))
        })
        .map(|e| e.path())
        .collect();
    old.sort();
    let excess = (old.len() + 1).saturating_sub(KEEP_LOGS);
    for p in old.into_iter().take(excess) {
        let _ = if p.is_dir() { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) };
    }
    let label: String = label
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') { c } else { '_' })
        .collect();
    let dir = logs.join(format!("{:013}-{label}", gpusnap_core::store::now_ms()));
    gpusnap_files::mkdir_private(&dir)?;
    Ok(dir)
}

impl CriuError {
    /// Keeps the log of a failed run in `STATE_DIR/logs/` (its own place may
    /// be a partial image about to be removed) and names that copy.
    pub fn keep_log(self, state_dir: &Path, label: &str) -> Self {
        match self {
            Self::Failed { op, line, log } => {
                let src = PathBuf::from(&log);
                let kept = new_log_dir(state_dir, label).and_then(|d| {
                    let to = d.join(src.file_name().unwrap_or_default());
                    std::fs::copy(&src, &to).map(|_| to)
                });
                let log = match kept {
                    Ok(p) => p.display().to_string(),
                    Err(e) => {
                        tracing::warn!("could not keep CRIU's log {log}: {e}");
                        log
                    }
                };
                Self::Failed { op, line, log }
            }
            other => other,
        }
    }
}

/// CRIU's error lines, each without its timestamp and source prefix.
fn error_lines(log: &str) -> impl DoubleEndedIterator<Item = String> + '_ {
    log.lines()
        .filter(|l| l.contains("Error (") || l.contains("Error:"))
        // Printed by every run without CAP_SYS_RESOURCE, and harmless; the
        // closing "Restoring FAILED." says nothing about why, nor does
        // "Restorer fail PID", which follows the restorer's own error.
        .filter(|l| !l.contains("RLIMIT_NOFILE") && !l.ends_with("FAILED.") && !l.contains("Restorer fail"))
        .map(|l| {
            let l = l.trim();
            // "(00.012345) Error (criu/cr-dump.c:123): message"
            match l.find("): ") {
                Some(i) if l.contains("Error (") => l[i + 3..].to_string(),
                _ => l.trim_start_matches(|c: char| c != 'E').to_string(),
            }
        })
}

/// The last error line of a CRIU log.
pub fn last_error(log: &str) -> Option<String> {
    error_lines(log).next_back()
}

/// The first error line of a CRIU log (the cause), and the last when it is
/// another: "FIRST; last error: LAST".
pub fn first_and_last_error(log: &str) -> Option<String> {
    let mut it = error_lines(log);
    let first = it.next()?;
    match it.next_back() {
        Some(last) if last != first => Some(format!("{first}; last error: {last}")),
        _ => Some(first),
    }
}

fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/local/sbin"), PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newer_versions() {
        assert!(newer_version("4.2.1", "4.1"));
        assert!(!newer_version("4.2.1", "4.2"));
        assert!(newer_version("5.0", "4.2.1"));
        assert!(!newer_version("4.1.1", "4.2.1"));
        assert!(!newer_version("4.2.1", "4.2.1"));
        assert!(!newer_version("garbage", "4.0"));
    }

    #[test]
    fn versions() {
        assert_eq!(parse_version("Version: 4.1.1\n").unwrap().0, 4);
        let (maj, min, v) = parse_version("Version: 3.17.1\nGitID: v3.17.1\n").unwrap();
        assert_eq!((maj, min, v.as_str()), (3, 17, "3.17.1"));
        assert!(parse_version("garbage").is_none());
    }

    #[test]
    fn the_restorers_own_error_is_named() {
        let log = "(00.1) pie: 42: Error (criu/pie/restorer.c:1700): Unable to restore timers: -22\n(00.2) Error (criu/cr-restore.c:2100): Restorer fail 42\n(00.3) Error (criu/cr-restore.c:2331): Restoring FAILED.\n";
        assert_eq!(last_error(log).unwrap(), "Unable to restore timers: -22");
    }

    #[test]
    fn the_first_error_is_the_cause() {
        let log = "(00.1) Error (criu/plugin.c:9): Unable to open directory /usr/lib/criu: No such file\n(00.2) info\n(00.3) Error (criu/cr-dump.c:5): Unable to detach from 1098: No such process\n";
        assert_eq!(
            first_and_last_error(log).unwrap(),
            "Unable to open directory /usr/lib/criu: No such file; last error: Unable to detach from 1098: No such process"
        );
        assert_eq!(first_and_last_error("(0.1) Error (a.c:1): one\n").unwrap(), "one");
        assert!(first_and_last_error("(0.1) fine\n").is_none());
    }

    #[test]
    fn logs_are_kept_and_pruned() {
        let d = tempfile::tempdir().unwrap();
        let src = d.path().join("dump.log");
        std::fs::write(&src, "x").unwrap();
        for _ in 0..KEEP_LOGS + 5 {
            let e = CriuError::Failed { op: "dump", line: "l".into(), log: src.display().to_string() };
            let CriuError::Failed { log, .. } = e.keep_log(d.path(), "dump-a") else { panic!() };
            assert!(log.starts_with(&d.path().join("logs").display().to_string()), "{log}");
            assert!(Path::new(&log).is_file());
        }
        assert!(std::fs::read_dir(d.path().join("logs")).unwrap().count() <= KEEP_LOGS);
    }

    #[test]
    fn last_error_line() {
        let log = "(00.001) info\n(00.002) Error (criu/cr-restore.c:1234): Can't fork for 4242: File exists\n(00.003) done\n";
        assert_eq!(last_error(log).unwrap(), "Can't fork for 4242: File exists");
    }
}
