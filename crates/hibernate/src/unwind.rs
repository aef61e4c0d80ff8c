//! Ending what a failed wake restored. Kept apart from the wake's steps
//! because its rule is the opposite one: the wake puts processes back, this
//! takes them down without ever killing a process whose CUDA state is on
//! the GPU (it is suspended first, or left running).

use crate::tree::kill_tree;
use gpusnap_core::engine::{Engine, StopOptions};
use gpusnap_core::target::{self, Target};
use gpusnap_cuda::{CheckpointApi, ProcessState};
use gpusnap_gpu::GpuInventory;
use gpusnap_images::manifest::{Manifest, ProcDesc};
use std::time::Duration;

/// The ends of a failed wake, on the lifecycle engine.
pub(crate) trait Unwind {
    /// The CUDA processes of a rescued wake (crate::rescue): those the
    /// driver's restore left locked are checkpointed again, then the whole
    /// tree is killed while its threads are still stopped.
    fn end_rescued(&mut self, m: &Manifest, resume: &[&ProcDesc]) -> Vec<Target>;

    /// Ends restored processes of a wake that failed, safely: not forced, so
    /// a process already back on the GPU is suspended before it is killed,
    /// or left running if that fails.
    fn end_woken(&mut self, pids: impl Iterator<Item = i32>);
}

impl<A: CheckpointApi, G: GpuInventory> Unwind for Engine<A, G> {
    fn end_rescued(&mut self, m: &Manifest, resume: &[&ProcDesc]) -> Vec<Target> {
        for p in resume {
            let Ok(t) = target::resolve(p.pid) else { continue };
            match self.api_ref().get_state(p.pid) {
                Ok(ProcessState::Locked) => {
                    if let Err(e) =
                        self.journaled(&t, "checkpoint", "checkpointed", |api| api.checkpoint(t.pid))
                    {
                        tracing::error!(pid = t.pid, "rescue: checkpoint after the restore failed: {e}");
                    }
                }
                Ok(s) => tracing::warn!(pid = t.pid, state = %s, "rescue: not locked after the restore"),
                Err(e) => tracing::warn!(pid = t.pid, "rescue: driver state: {e}"),
            }
            let _ =
                self.store_mut().note(&t, "wake", None, "the page server failed during the restore: ended");
        }
        let tree: Vec<Target> =
            m.processes.iter().rev().filter_map(|p| target::resolve(p.pid).ok()).collect();
        for t in &tree {
            let _ =
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(t.pid), nix::sys::signal::Signal::SIGKILL);
        }
        tree
    }

    fn end_woken(&mut self, pids: impl Iterator<Item = i32>) {
        let stop = StopOptions { grace: Duration::from_secs(2), force: false, lock_timeout_ms: 30_000 };
        for pid in pids {
            if let Ok(t) = target::resolve(pid) {
                if let Err(e) = self.stop(t.pid, &stop) {
                    // stop journals, so a store error stops it too; a process
                    // whose CUDA state is not on the GPU (or that has none)
                    // is safe to kill without it.
                    let on_gpu = target::resolve_callable(pid)
                        .ok()
                        .and_then(|t| self.driver_state(&t).ok())
                        .is_some_and(|s| s == ProcessState::Running);
                    if on_gpu || !target::is_alive(&t) {
                        tracing::error!(pid, "could not end a restored process after a failed wake: {e}");
                    } else if let Err(e) = kill_tree(std::slice::from_ref(&t)) {
                        tracing::error!(pid, "could not end a restored process after a failed wake: {e}");
                    }
                }
            }
        }
    }
}
