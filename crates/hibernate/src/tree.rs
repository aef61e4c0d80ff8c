//! What hibernate and wake do to a whole process tree from outside:
//! continue it, release it from a CRIU that failed, kill it, wait for its
//! pids to come free.

use crate::Error;
use gpusnap_core::target::{self, Target};
use gpusnap_core::Error as CoreError;
use gpusnap_images::manifest::ProcDesc;
use procfs::process::Process;
use std::time::{Duration, Instant};

/// SIGCONT to a tree CRIU left stopped.
pub(crate) fn continue_tree(ts: &[Target]) {
    for t in ts {
        if target::is_alive(t) {
            let _ =
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(t.pid), nix::sys::signal::Signal::SIGCONT);
        }
    }
}

/// One thread of a process as /proc shows it: (tid, state, tracer pid).
fn threads(pid: i32) -> Vec<(i32, char, i32)> {
    let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    rd.flatten()
        .filter_map(|e| {
            let tid: i32 = e.file_name().to_str()?.parse().ok()?;
            let status = std::fs::read_to_string(e.path().join("status")).ok()?;
            let field = |k: &str| status.lines().find_map(|l| l.strip_prefix(k)).map(str::trim);
            let state = field("State:")?.chars().next()?;
            let tracer = field("TracerPid:")?.parse().ok()?;
            Some((tid, state, tracer))
        })
        .collect()
}

/// The processes of `pids` that something outside gpusnap holds now: a
/// thread stopped (state T) or traced. Taken before CRIU runs, so that
/// [`release_tree`] leaves them as they were.
pub(crate) fn held_now(pids: &[i32]) -> Vec<i32> {
    pids.iter()
        .copied()
        .filter(|&p| threads(p).iter().any(|&(_, st, tracer)| st == 'T' || tracer != 0))
        .collect()
}

/// After a CRIU dump that failed, whatever CRIU did (failed at once, was
/// killed while it held the tree, or dumped it, left it stopped and then
/// reported a failure): waits (bounded) until no thread of the tree rooted
/// at `root` (or of `known`) is traced any more, then continues every
/// process with a thread stopped (SIGCONT), until /proc shows none stopped.
/// Processes in `held` (stopped or traced before CRIU ran) are left as they
/// were. False when the tree could not be released within `limit`.
pub(crate) fn release_tree(root: i32, known: &[i32], held: &[i32], limit: Duration) -> bool {
    use nix::sys::signal::{kill, Signal};
    let end = Instant::now() + limit;
    loop {
        let mut pids: Vec<i32> = gpusnap_core::tree::process_tree(root).into_iter().map(|(p, _)| p).collect();
        for &p in known {
            if !pids.contains(&p) {
                pids.push(p);
            }
        }
        let mut traced = Vec::new();
        let mut stopped = Vec::new();
        for &p in pids.iter().filter(|p| !held.contains(p)) {
            for (tid, st, tracer) in threads(p) {
                if tracer != 0 || st == 't' {
                    traced.push(tid);
                } else if st == 'T' && !stopped.contains(&p) {
                    stopped.push(p);
                }
            }
        }
        if traced.is_empty() && stopped.is_empty() {
            return true;
        }
        // A stopped process of a tree still traced is CRIU's until its
        // tracer lets go (a SIGCONT now would be taken by the tracer).
        if traced.is_empty() {
            for &p in &stopped {
                tracing::debug!(pid = p, "continuing a process a failed criu left stopped");
                let _ = kill(nix::unistd::Pid::from_raw(p), Signal::SIGCONT);
            }
        }
        if Instant::now() >= end {
            tracing::error!(
                root,
                ?traced,
                ?stopped,
                "the tree a failed criu dump left is still held after {limit:?}"
            );
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// SIGKILL to each process (only if it is still the one identified), then
/// wait until all are gone. Only for processes whose CUDA state is suspended.
pub fn kill_tree(ts: &[Target]) -> Result<(), Error> {
    use nix::sys::signal::{kill, Signal};
    for t in ts {
        if target::is_alive(t) {
            let _ = kill(nix::unistd::Pid::from_raw(t.pid), Signal::SIGKILL);
        }
    }
    let end = Instant::now() + Duration::from_secs(60);
    for t in ts {
        while target::is_alive(t) {
            if Instant::now() > end {
                return Err(CoreError::DidNotExit { pid: t.pid, secs: 60 }.into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    Ok(())
}

/// Waits for `p.pid` to be free (no process or thread, no zombie).
pub(crate) fn wait_pid_free(p: &ProcDesc, wait: Duration) -> Result<(), Error> {
    let end = Instant::now() + wait;
    loop {
        let Ok(stat) = Process::new(p.pid).and_then(|x| x.stat()) else { return Ok(()) };
        let zombie = target::RunState(stat.state).is_zombie();
        if stat.starttime == p.start_time && !zombie {
            return Err(Error::StillRunning { pid: p.pid, comm: stat.comm });
        }
        if Instant::now() >= end {
            let comm = if zombie {
                format!("{} (a zombie its parent has not reaped)", stat.comm)
            } else {
                stat.comm
            };
            return Err(Error::PidBusy { pid: p.pid, comm });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
