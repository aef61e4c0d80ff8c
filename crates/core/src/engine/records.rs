//! What gpusnap recorded of a process, found again for a process CRIU
//! restored outside gpusnap (a plain `criu restore`, a container runtime's
//! restore, CRIU's CUDA plugin calling gpusnap as its `cuda-checkpoint`).

use super::Engine;
use crate::error::Error;
use crate::store::Record;
use crate::target::{self, Target};
use gpusnap_cuda::{CheckpointApi, ProcessState};
use gpusnap_gpu::GpuInventory;

impl<A: CheckpointApi, G: GpuInventory> Engine<A, G> {
    /// Looks up what gpusnap recorded of `t`, refusing a pid that now belongs
    /// to another program than the one that was suspended there.
    ///
    /// A process that CRIU restored outside gpusnap (`criu dump` + `criu
    /// restore`, a container runtime's checkpoint) comes back under its old
    /// pid with a new start time: it is recognised as the recorded one when
    /// the driver has it locked or checkpointed (a program that merely got
    /// the pid cannot be: a fresh process starts running), and it runs the
    /// same executable with the same command line, from another time
    /// namespace ([`target::Fingerprint::restored_as`]). Its record then
    /// moves to the new start time (journaled, `adopt`).
    ///
    /// A container with a pid namespace of its own comes back under a new
    /// host pid, with the same pid inside its (new) namespace: when nothing
    /// is recorded under the host pid, the record of a process that had that
    /// pid inside a namespace of its own, is gone, and ran the same program,
    /// moves to it the same way ([`Self::record_across_pid_namespaces`]).
    pub fn record_of(&mut self, t: &Target) -> Result<Option<Record>, Error> {
        let same_pid = self.record_under_pid(t);
        match same_pid {
            Ok(None) | Err(Error::Reused { .. }) if target::ns_pid(t.pid).is_some() => {
                match self.record_across_pid_namespaces(t)? {
                    Some(r) => Ok(Some(r)),
                    None => same_pid,
                }
            }
            other => other,
        }
    }

    fn record_under_pid(&mut self, t: &Target) -> Result<Option<Record>, Error> {
        if let Some(r) = self.store.get(t)? {
            return Ok(Some(r));
        }
        let old = match self.store.latest_for_pid(t.pid)? {
            Some(old) if old.state == "checkpointed" || old.state == "locked" => old,
            _ => return Ok(None),
        };
        let reused = |why: String| {
            tracing::info!(pid = t.pid, "not the process gpusnap recorded: {why}");
            Err(Error::Reused { pid: t.pid, comm: t.comm.clone() })
        };
        if old.start_time >= t.start_time {
            return reused("it started before the recorded one".into());
        }
        let Some(was) = self.store.identity(t.pid, old.start_time)? else {
            return reused("nothing but the pid was recorded".into());
        };
        if let Err(why) = was.restored_as(&target::fingerprint(t.pid)) {
            return reused(why);
        }
        match self.restored_state(t)? {
            Ok(st) => {
                let detail = format!(
                    "restored outside gpusnap (same program, driver state {st}): record moved from start time {}",
                    old.start_time
                );
                tracing::info!(pid = t.pid, "{detail}");
                self.store.adopt(&old, t, &detail)?;
                self.store.get(t)
            }
            Err(why) => reused(why),
        }
    }

    /// The driver's state of a process that may be a restored one: locked or
    /// checkpointed, or why it is not.
    fn restored_state(&self, t: &Target) -> Result<Result<ProcessState, String>, Error> {
        match self.driver_state(t) {
            Ok(st @ (ProcessState::Locked | ProcessState::Checkpointed)) => Ok(Ok(st)),
            Ok(st) => Ok(Err(format!("the driver reports it {st}"))),
            Err(Error::NotCuda { .. }) => Ok(Err("it has no CUDA context".into())),
            Err(e) => Err(e),
        }
    }

    /// The record of the process `t` was before CRIU restored it into a new
    /// pid namespace: recorded with `t`'s pid inside a namespace of its own,
    /// locked or checkpointed, gone now, the same executable and command line
    /// from another time namespace; and `t` locked or checkpointed by the
    /// driver. Two such records (replicas of one container) cannot be told
    /// apart: the one with the larger footprint moves, so that admission
    /// never counts on less memory than the restored process may need.
    pub fn record_across_pid_namespaces(&mut self, t: &Target) -> Result<Option<Record>, Error> {
        let Some(inner) = target::ns_pid(t.pid) else { return Ok(None) };
        let now = target::fingerprint(t.pid);
        let mut found = Vec::new();
        for r in self.store.checkpointed_with_ns_pid(inner)? {
            let was = Target { pid: r.pid, start_time: r.start_time, comm: r.comm.clone(), uid: t.uid };
            if r.pid == t.pid || target::is_alive(&was) {
                continue;
            }
            match self.store.identity(r.pid, r.start_time)? {
                Some(id) if id.restored_as(&now).is_ok() => found.push(r),
                _ => {}
            }
        }
        let n = found.len();
        let Some(old) = found.into_iter().max_by_key(|r| (r.footprint_bytes(), r.updated_ms)) else {
            return Ok(None);
        };
        let st = match self.restored_state(t)? {
            Ok(st) => st,
            Err(why) => {
                tracing::info!(pid = t.pid, "not a restored process gpusnap recorded: {why}");
                return Ok(None);
            }
        };
        let mut detail = format!(
            "restored outside gpusnap into a new pid namespace (pid {inner} inside, same program, driver state {st}): record moved from pid {} start time {}",
            old.pid, old.start_time
        );
        if n > 1 {
            detail.push_str(&format!(
                "; {n} recorded processes match, the largest footprint ({} bytes) taken",
                old.footprint_bytes()
            ));
        }
        tracing::info!(pid = t.pid, "{detail}");
        self.store.adopt(&old, t, &detail)?;
        self.store.get(t)
    }

    /// [`Self::record_of`] for commands that act on whatever process holds
    /// the pid now (state, ps, suspend, stop): a reused pid simply has no
    /// record.
    pub fn record_now(&mut self, t: &Target) -> Result<Option<Record>, Error> {
        match self.record_of(t) {
            Err(Error::Reused { .. }) => Ok(None),
            other => other,
        }
    }
}
