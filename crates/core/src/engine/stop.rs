//! Stop: the one lifecycle operation that ends a process. Kept apart from
//! suspend and resume because its rule is about the kill, not the driver:
//! a process whose CUDA state may still be on the GPU is never signalled
//! (killing it can hang the host), so it is suspended and its release seen
//! in NVML first, unless `--force` says otherwise.

use super::{ms, Engine};
use crate::error::Error;
use crate::reports::{StopOptions, StopReport};
use crate::store::FAULTED;
use crate::target::{self, Target};
use gpusnap_cuda::{CheckpointApi, ProcessState};
use gpusnap_gpu::GpuInventory;
use std::time::{Duration, Instant};

impl<A: CheckpointApi, G: GpuInventory> Engine<A, G> {
    /// Safe teardown: suspend, verify the GPU memory is released, then
    /// SIGTERM, SIGKILL after the grace, and wait until the pid is gone.
    pub fn stop(&mut self, pid: i32, opts: &StopOptions) -> Result<StopReport, Error> {
        let started = Instant::now();
        let t = target::resolve(pid)?;
        let mut suspended = false;
        let mut cuda = true;
        let stopped = target::run_state(pid)?.is_stopped();
        let refuse = |reason: String| Error::StopRefused { pid, reason };
        if self.store.get(&t)?.is_some_and(|r| r.state == FAULTED) {
            return self.stop_faulted(&t, opts, started);
        }
        if stopped {
            if !opts.force {
                return Err(refuse(
                    "it is stopped (SIGSTOP or a tracer), so its CUDA state cannot be suspended first; send SIGCONT"
                        .into(),
                ));
            }
        } else {
            match self.driver_state(&t) {
                Err(Error::NotCuda { .. })
                    if self.api.api_version() == 0 && target::pid_maps_libcuda(pid) =>
                {
                    if !opts.force {
                        return Err(refuse(
                            "it maps libcuda but gpusnap cannot load the driver to suspend it first".into(),
                        ));
                    }
                    cuda = false;
                }
                Err(Error::NotCuda { .. }) => cuda = false,
                Ok(ProcessState::Checkpointed) => {
                    // Restored by CRIU outside gpusnap: its record goes on under the new start time.
                    self.record_now(&t)?;
                    suspended = true
                }
                Ok(ProcessState::Running | ProcessState::Locked) => {
                    match self.suspend_to_end(pid, opts.lock_timeout_ms) {
                        Ok(_) => suspended = true,
                        Err(e) if opts.force => {
                            tracing::warn!(pid, "suspend failed, killing anyway (--force): {e}")
                        }
                        Err(e) => return Err(refuse(format!("suspend failed ({e})"))),
                    }
                }
                Ok(other) if opts.force => {
                    tracing::warn!(pid, "driver state {other}, killing anyway (--force)")
                }
                Ok(other) => return Err(refuse(format!("the driver reports it {other}"))),
                Err(e) if opts.force => tracing::warn!(pid, "{e}; killing anyway (--force)"),
                Err(e) => return Err(refuse(e.to_string())),
            }
        }
        let released = if cuda { self.wait_released(pid)?.0 } else { true };
        if !released && !opts.force {
            return Err(refuse("NVML still shows device memory for it after suspend".into()));
        }
        self.store.note(&t, "stop", None, &format!("suspended={suspended} released={released}; SIGTERM"))?;
        let signal = terminate(&t, opts.grace)?;
        if cuda || self.store.get(&t)?.is_some() {
            self.store.note(&t, "stop", Some("stopped"), &format!("ended by {signal}"))?;
        }
        Ok(StopReport { pid, suspended, released_before_kill: released, signal, cuda, total_ms: ms(started) })
    }
}

impl<A: CheckpointApi, G: GpuInventory> Engine<A, G> {
    /// A process whose CUDA context faulted cannot be suspended (its lock
    /// answers the sticky error), and may be held by its guard (stopped, or
    /// waiting in its exit path), where SIGTERM does nothing. Without
    /// `--force` it is left as it is; with it, SIGKILL at once: the process
    /// tears its faulted context down, which on some drivers hangs the host.
    fn stop_faulted(
        &mut self,
        t: &Target,
        opts: &StopOptions,
        started: Instant,
    ) -> Result<StopReport, Error> {
        if !opts.force {
            return Err(Error::StopRefused {
                pid: t.pid,
                reason: "its CUDA context faulted, so it cannot be suspended first, and tearing a faulted \
                         context down can hang the host on some drivers (docs/design/safety.md): drain the \
                         node and reboot"
                    .into(),
            });
        }
        self.store.note(t, "stop", None, "faulted CUDA context; --force: SIGKILL, not suspended")?;
        // No SIGTERM: a held process would not act on it (or, in light
        // mode, ask its guard again).
        if target::is_alive(t) {
            use nix::sys::signal::{kill, Signal};
            match kill(nix::unistd::Pid::from_raw(t.pid), Signal::SIGKILL) {
                Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
                Err(nix::errno::Errno::EPERM) => return Err(Error::Permission { pid: t.pid }),
                Err(e) => return Err(Error::Proc { pid: t.pid, reason: e.to_string() }),
            }
        }
        let end = Instant::now() + Duration::from_secs(60);
        while target::is_alive(t) {
            if Instant::now() >= end {
                return Err(Error::DidNotExit { pid: t.pid, secs: 60 });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let signal = "SIGKILL".to_string();
        self.store.note(t, "stop", Some("stopped"), "ended by SIGKILL (faulted, --force)")?;
        Ok(StopReport {
            pid: t.pid,
            suspended: false,
            released_before_kill: false,
            signal,
            cuda: true,
            total_ms: ms(started),
        })
    }
}

/// SIGTERM, then SIGKILL after `grace`; returns the signal that ended it.
fn terminate(t: &Target, grace: Duration) -> Result<String, Error> {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    let send = |sig: Signal| {
        // The pid could have been reused between checks; only signal the
        // process we identified.
        if target::is_alive(t) {
            match kill(Pid::from_raw(t.pid), sig) {
                Ok(()) | Err(nix::errno::Errno::ESRCH) => Ok(()),
                Err(nix::errno::Errno::EPERM) => Err(Error::Permission { pid: t.pid }),
                Err(e) => Err(Error::Proc { pid: t.pid, reason: e.to_string() }),
            }
        } else {
            Ok(())
        }
    };
    let gone_within = |d: Duration| {
        let end = Instant::now() + d;
        loop {
            if !target::is_alive(t) {
                return true;
            }
            if Instant::now() >= end {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    send(Signal::SIGTERM)?;
    if gone_within(grace) {
        return Ok("SIGTERM".into());
    }
    send(Signal::SIGKILL)?;
    let wait = Duration::from_secs(60);
    if gone_within(wait) {
        return Ok("SIGKILL".into());
    }
    Err(Error::DidNotExit { pid: t.pid, secs: wait.as_secs() })
}
