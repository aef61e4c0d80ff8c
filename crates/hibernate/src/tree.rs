//! What hibernate and wake do to a whole process tree from outside:
//! continue it, kill it, wait for its pids to come free.

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
