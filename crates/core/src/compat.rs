//! What NVIDIA's `cuda-checkpoint` does, with gpusnap's safety: the calls
//! CRIU's CUDA plugin and gVisor make, one at a time.
//!
//! Differences from calling the driver raw, all of them refusals:
//! - a thread id is accepted only when it is its process's CUDA restore
//!   thread (CRIU's plugin asks for the state by that tid); any other thread
//!   id is refused, naming its process;
//! - a process stopped by a signal (state T) is refused instead of hanging the
//!   caller (the driver ignores the lock timeout there); a ptrace stop (t) is
//!   allowed, since CRIU holds the tree in one while its plugin works;
//! - a restore goes through admission (the footprint recorded at lock time;
//!   when CRIU restored the process with a new start time, its record moves
//!   to it, see `Engine::record_of`), and an out-of-memory restore is
//!   recorded as stuck.

use crate::engine::Engine;
use crate::error::Error;
use crate::target::{self, Target};
use gpusnap_cuda::{CheckpointApi, GpuPair, ProcessState};
use gpusnap_gpu::GpuInventory;
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Lock { timeout_ms: u32 },
    Checkpoint,
    Restore { device_map: Vec<(String, String)> },
    Unlock,
}

impl<A: CheckpointApi, G: GpuInventory> Engine<A, G> {
    /// The process `pid` names, for the compatibility calls.
    pub fn compat_target(&self, pid: i32) -> Result<Target, Error> {
        let t = match target::resolve(pid) {
            Ok(t) => t,
            Err(Error::Thread { tid, pid: tgid }) => {
                let restore_tid = self.api_ref().restore_thread_id(tgid).ok();
                if restore_tid != Some(tid) {
                    return Err(Error::Thread { tid, pid: tgid });
                }
                target::resolve(tgid)?
            }
            Err(e) => return Err(e),
        };
        let st = target::run_state(t.pid)?;
        if st.0 == 'T' {
            return Err(Error::Stopped { pid: t.pid, comm: t.comm, state: st.0 });
        }
        Ok(t)
    }

    pub fn compat_state(&mut self, pid: i32) -> Result<ProcessState, Error> {
        let t = self.compat_target(pid)?;
        // Read only: the record of a process CRIU restored moves when its
        // restore is asked for, not when its state is read.
        self.driver_state(&t)
    }

    pub fn compat_restore_tid(&mut self, pid: i32) -> Result<i32, Error> {
        let t = self.compat_target(pid)?;
        self.api_ref().restore_thread_id(t.pid).map_err(|source| match source.code() {
            Some(gpusnap_cuda::ffi::CUDA_ERROR_NOT_INITIALIZED) => {
                Error::NotCuda { pid: t.pid, comm: t.comm.clone() }
            }
            _ => Error::Driver { pid: t.pid, source },
        })
    }

    pub fn compat_action(&mut self, pid: i32, action: &Action, margin_bytes: u64) -> Result<(), Error> {
        let t = self.compat_target(pid)?;
        let _serial = self.store().lock_target(t.pid)?;
        match action {
            Action::Lock { timeout_ms } => {
                // The footprint is what a later restore will need: record it now.
                let mut fp = BTreeMap::new();
                for u in self.gpus().usage_of(t.pid as u32)? {
                    *fp.entry(u.uuid).or_insert(0u64) += u.bytes.unwrap_or(0);
                }
                self.store_mut().record(&t, "running", Some(&fp))?;
                let timeout = *timeout_ms;
                self.journaled(&t, "lock", "locked", move |api| api.lock(t.pid, timeout))
            }
            Action::Checkpoint => {
                let total = self.store().get(&t)?.map(|r| r.footprint_bytes()).unwrap_or(0);
                self.journaled(&t, "checkpoint", "checkpointed", move |api| {
                    api.checkpoint_within(t.pid, total)
                })
            }
            Action::Unlock => self.journaled(&t, "unlock", "running", move |api| api.unlock(t.pid)),
            Action::Restore { device_map } => self.compat_restore(&t, device_map, margin_bytes),
        }
    }

    fn compat_restore(
        &mut self,
        t: &Target,
        device_map: &[(String, String)],
        margin: u64,
    ) -> Result<(), Error> {
        // CRIU restored it: same pid, new start time. Recognised, its record
        // (footprint included) moves to it, so that a restore refused here
        // leaves a process `gpusnap resume` can finish.
        let rec = match self.record_of(t) {
            // Not recognisably the same program (a record of an older
            // gpusnap has no identity): the newest footprint under the pid is
            // still the best estimate for admission.
            Err(Error::Reused { .. }) => self.store().latest_for_pid(t.pid)?,
            other => other?,
        };
        if let Some(reason) = rec.as_ref().and_then(|r| r.unrecoverable.clone()) {
            if rec.as_ref().is_some_and(|r| r.start_time == t.start_time) {
                return Err(Error::Unrecoverable { pid: t.pid, reason });
            }
        }
        let footprint = rec.map(|r| r.footprint).unwrap_or_default();
        let (pairs, need): (Vec<GpuPair>, BTreeMap<String, u64>) = if device_map.is_empty() {
            (Vec::new(), footprint)
        } else {
            let host = self.host_gpus()?;
            let visible = crate::remap::visible_to(t.pid, &host);
            self.plan_remap(device_map, &visible, &visible, &footprint)?
        };
        if need.is_empty() {
            tracing::warn!(
                pid = t.pid,
                "no footprint known for this process: restoring without admission control"
            );
        }
        self.store_mut().record(t, "checkpointed", None)?;
        let ids = if need.is_empty() { Vec::new() } else { self.admit(t.pid, &need, margin)? };
        let res = self.restore_only(t, &need, &pairs);
        self.store_mut().release(&ids)?;
        res
    }
}
