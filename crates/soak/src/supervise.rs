//! The soak's supervisor: whatever way the soak ends (its cycles done, past
//! its hard deadline, SIGINT/SIGTERM/SIGHUP, a panic, the soak itself killed
//! with SIGKILL), nothing it started is left behind.
//!
//! `gpusnap-soak` runs as two processes. The first (this module) makes
//! itself a child subreaper, creates the scratch directory and starts the
//! second, the worker, which runs the soak. The agent's services are
//! started with setsid and the trees CRIU restores are detached, so
//! neither a process group nor a parent's death reaches them; as a
//! subreaper the supervisor inherits every one of them that its parent
//! leaves. Only a SIGKILL of the supervisor itself escapes this. When the worker has exited, or on a signal or
//! the hard deadline (then the worker is ended first), the supervisor thaws
//! the freezer cgroups the worker made, kills every process under it,
//! reaps them, unmounts what is mounted in the scratch directory and
//! removes it (unless `--keep`).

use anyhow::{Context, Result};
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

/// Set in the worker's environment: the scratch directory to use.
pub const ROOT_ENV: &str = "GPUSNAP_SOAK_ROOT";

/// The signal that asked the soak to stop (0: none).
static STOP: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_stop(sig: libc::c_int) {
    STOP.store(sig, Ordering::SeqCst);
}

fn errno_result(r: libc::c_int, what: &str) -> Result<()> {
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error()).with_context(|| what.to_string())
    }
}

/// Runs the worker (this program again, `ROOT_ENV` set) and cleans up after
/// it; the worker's exit status, or 2 when it was ended.
pub fn supervise(hard_limit: Duration, keep: bool) -> Result<u8> {
    // SAFETY: prctl with integer arguments only.
    let r = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    errno_result(r, "become a child subreaper")?;
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: the handler only stores to an atomic (async-signal-safe);
        // the sigaction struct is zeroed and then filled.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_stop as extern "C" fn(libc::c_int) as usize;
            libc::sigemptyset(&mut sa.sa_mask);
            errno_result(libc::sigaction(sig, &sa, std::ptr::null_mut()), "install a signal handler")?;
        }
    }
    let root = tempfile::Builder::new().prefix("gpusnap-soak").tempdir()?;
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args(std::env::args_os().skip(1)).env(ROOT_ENV, root.path());
    let worker = cmd.spawn().context("start the soak's worker")?;
    let wpid = worker.id() as i32;
    eprintln!("gpusnap-soak: scratch {}; worker pid {wpid}", root.path().display());
    // Reaped below with waitpid(-1), with every orphan that comes here.
    std::mem::forget(worker);
    let end = Instant::now() + hard_limit;
    let mut status = None;
    let mut ended = None;
    loop {
        reap(wpid, &mut status);
        if status.is_some() {
            break;
        }
        let sig = STOP.load(Ordering::SeqCst);
        let why = if sig != 0 {
            Some(format!("signal {sig}"))
        } else if Instant::now() > end {
            Some(format!("its hard deadline ({} s)", hard_limit.as_secs()))
        } else {
            None
        };
        if let Some(why) = why {
            eprintln!("gpusnap-soak: stopped by {why}: ending the worker and everything it started");
            // SAFETY: kill(2) on the worker's pid, a child not yet reaped.
            unsafe { libc::kill(wpid, libc::SIGKILL) };
            ended = Some(why);
            while status.is_none() {
                reap(wpid, &mut status);
                std::thread::sleep(Duration::from_millis(20));
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let left = end_descendants(wpid);
    if left > 0 {
        eprintln!("gpusnap-soak: {left} processes it started could not be ended");
    }
    for m in crate::check::mounts_under(root.path()).iter().rev() {
        crate::infra::umount(Path::new(m));
    }
    if keep {
        eprintln!("gpusnap-soak: kept {}", root.keep().display());
    }
    let code = status.unwrap_or(-1);
    Ok(match ended {
        Some(_) => 2,
        None if libc::WIFEXITED(code) => libc::WEXITSTATUS(code) as u8,
        None => {
            eprintln!("gpusnap-soak: the worker died (wait status {code})");
            2
        }
    })
}

/// Reaps every child that has exited (orphans included); the worker's
/// wait status into `status`.
fn reap(wpid: i32, status: &mut Option<i32>) {
    loop {
        let mut st = 0;
        // SAFETY: waitpid with a valid pointer to an int.
        let pid = unsafe { libc::waitpid(-1, &mut st, libc::WNOHANG) };
        if pid <= 0 {
            return;
        }
        if pid == wpid {
            *status = Some(st);
        }
    }
}

/// The processes under this one (children, theirs, ...), from /proc, each
/// with its parent.
fn descendants() -> Vec<(i32, i32)> {
    let me = std::process::id() as i32;
    let mut parent: Vec<(i32, i32)> = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else { continue };
        // "PID (COMM) S PPID ...": COMM may hold spaces and parentheses.
        let ppid = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse().ok());
        if let Some(ppid) = ppid {
            parent.push((pid, ppid));
        }
    }
    let mut out = vec![(me, 0)];
    let mut i = 0;
    while i < out.len() {
        let p = out[i].0;
        out.extend(parent.iter().filter(|(_, pp)| *pp == p).copied());
        i += 1;
    }
    out.remove(0);
    out
}

/// Thaws the freezer cgroups the worker `wpid` made (a frozen process of
/// cgroup v1 does not die until thawed) and removes them once empty.
fn thaw_cgroups(wpid: i32) -> Vec<std::path::PathBuf> {
    let prefix = format!("gpusnap-soak-{wpid}-");
    let mut dirs = Vec::new();
    for parent in ["/sys/fs/cgroup/freezer", "/sys/fs/cgroup"] {
        for e in std::fs::read_dir(parent).into_iter().flatten().flatten() {
            if e.file_name().to_str().is_some_and(|n| n.starts_with(&prefix)) {
                let d = e.path();
                let _ = std::fs::write(d.join("freezer.state"), "THAWED");
                let _ = std::fs::write(d.join("cgroup.freeze"), "0");
                dirs.push(d);
            }
        }
    }
    dirs
}

/// Kills every process under this one (a stopped one is continued first, a
/// frozen one thawed) and reaps them, until none is left or a minute has
/// passed; how many are left. Only this process's own children are
/// signalled, each round: their pids cannot be reused before this process
/// reaps them, and the children of one killed come here (a subreaper).
fn end_descendants(wpid: i32) -> usize {
    let cgroups = thaw_cgroups(wpid);
    let me = std::process::id() as i32;
    let end = Instant::now() + Duration::from_secs(60);
    let mut status = None;
    let left = loop {
        let all = descendants();
        if all.is_empty() || Instant::now() > end {
            break all.len();
        }
        for &(p, _) in all.iter().filter(|(_, pp)| *pp == me) {
            // SAFETY: kill(2) on a child of this process, not yet reaped.
            unsafe {
                libc::kill(p, libc::SIGCONT);
                libc::kill(p, libc::SIGKILL);
            }
        }
        std::thread::sleep(Duration::from_millis(20));
        reap(wpid, &mut status);
    };
    for d in cgroups {
        let _ = std::fs::remove_dir(d);
    }
    left
}
