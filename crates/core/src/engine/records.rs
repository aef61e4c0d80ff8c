//! What gpusnap recorded of a process, found again for a process CRIU
//! restored outside gpusnap (a plain `criu restore`, a container runtime's
//! restore, CRIU's CUDA plugin calling gpusnap as its `cuda-checkpoint`).

use super::Engine;
use crate::error::Error;
use crate::store::Record;
use crate::target::{self, Target};
use gpusnap_cuda::{CheckpointApi, ProcessState};
use gpusnap_gpu::GpuInventory;

/// What gpusnap knows of a live process.
enum Found {
    /// Its own record, or none.
    Own(Option<Record>),
    /// The record of the process it was before CRIU restored it outside
    /// gpusnap: to move to it (`detail` for the journal).
    Restored { old: Record, detail: String },
}

impl<A: CheckpointApi, G: GpuInventory> Engine<A, G> {
    /// Looks up what gpusnap recorded of `t`, refusing a pid that now belongs
    /// to another program than the one that was suspended there.
    ///
    /// A process that CRIU restored outside gpusnap (`criu dump` + `criu
    /// restore`, a container runtime's checkpoint) comes back under its old
    /// pid with a new start time: it is recognised as the recorded one when
    /// the driver has it locked or checkpointed (a program that merely got
    /// the pid cannot be: a fresh process starts running), it runs the same
    /// executable with the same command line, from another time namespace
    /// ([`target::Fingerprint::restored_as`]), in the cgroup and container
    /// the recorded one lived in. Its record then moves to the new start
    /// time (journaled, `adopt`).
    ///
    /// A container with a pid namespace of its own comes back under a new
    /// host pid, with the same pid inside its (new) namespace: when nothing
    /// is recorded under the host pid, the record of a process of the same
    /// container that had that pid inside, is gone, and ran the same
    /// program, moves to it the same way.
    ///
    /// A write path: commands that act on the process (resume, suspend,
    /// stop, CRIU's restore). Reading uses [`Self::record_seen`].
    pub fn record_of(&mut self, t: &Target) -> Result<Option<Record>, Error> {
        match self.find_record(t) {
            Ok(Found::Own(r)) => Ok(r),
            Ok(Found::Restored { old, detail }) => {
                tracing::info!(pid = t.pid, "{detail}");
                self.store.adopt(&old, t, &detail)?;
                self.store.get(t)
            }
            Err(e @ Error::AmbiguousRecord { .. }) => {
                self.store.note(t, "adopt_refused", None, &format!("not adopted: {e}"))?;
                Err(e)
            }
            Err(e) => Err(e),
        }
    }

    /// What [`Self::record_of`] finds for `t`, changing nothing: a record it
    /// would move to `t` is shown as `t`'s (its pid and start time), and a
    /// pid reused or a record that more than one process could take shows
    /// none. For `state` and `ps`: reading never moves a record.
    pub fn record_seen(&self, t: &Target) -> Result<Option<Record>, Error> {
        match self.find_record(t) {
            Ok(Found::Own(r)) => Ok(r),
            Ok(Found::Restored { mut old, .. }) => {
                (old.pid, old.start_time, old.comm) = (t.pid, t.start_time, t.comm.clone());
                old.unrecoverable = None;
                Ok(Some(old))
            }
            Err(Error::Reused { .. } | Error::AmbiguousRecord { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn find_record(&self, t: &Target) -> Result<Found, Error> {
        let same_pid = self.find_under_pid(t);
        match same_pid {
            Ok(Found::Own(None)) | Err(Error::Reused { .. }) if target::ns_pid(t.pid).is_some() => {
                match self.find_across_pid_namespaces(t)? {
                    Some(found) => Ok(found),
                    None => same_pid,
                }
            }
            other => other,
        }
    }

    fn find_under_pid(&self, t: &Target) -> Result<Found, Error> {
        if let Some(r) = self.store.get(t)? {
            return Ok(Found::Own(Some(r)));
        }
        let old = match self.store.latest_for_pid(t.pid)? {
            Some(old) if old.state == "checkpointed" || old.state == "locked" => old,
            _ => return Ok(Found::Own(None)),
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
        // A record that names where the process lived (every record of this
        // gpusnap) moves only within that cgroup and container.
        if let Some(at) = self.store.placement(t.pid, old.start_time)? {
            if let Err(why) = same_placement(&at, t.pid) {
                return reused(why);
            }
        }
        match self.restored_state(t)? {
            Ok(st) => {
                let detail = format!(
                    "restored outside gpusnap (same program, same cgroup, driver state {st}): record moved from start time {}",
                    old.start_time
                );
                Ok(Found::Restored { old, detail })
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
    /// pid namespace: recorded in a container, with `t`'s pid inside a
    /// namespace of its own, locked or checkpointed, gone now, the same
    /// executable and command line from another time namespace, the same
    /// container and cgroup as `t`; and `t` locked or checkpointed by the
    /// driver. A process of another container (another tenant's, crafted
    /// to look the same) never qualifies. Two such records, or another live
    /// process that could take the same one, cannot be told apart: refused
    /// ([`Error::AmbiguousRecord`]), nothing moves.
    fn find_across_pid_namespaces(&self, t: &Target) -> Result<Option<Found>, Error> {
        let Some(inner) = target::ns_pid(t.pid) else { return Ok(None) };
        let now = target::fingerprint(t.pid);
        let mut found = Vec::new();
        for r in self.store.checkpointed_with_ns_pid(inner)? {
            let was = Target { pid: r.pid, start_time: r.start_time, comm: r.comm.clone(), uid: t.uid };
            if r.pid == t.pid || target::is_alive(&was) {
                continue;
            }
            let Some(id) = self.store.identity(r.pid, r.start_time)? else { continue };
            if id.restored_as(&now).is_err() {
                continue;
            }
            let at = self.store.placement(r.pid, r.start_time)?;
            match at.as_ref().map(|at| (at, same_placement(at, t.pid))) {
                Some((at, Ok(()))) if at.container.is_some() => found.push((r, id, at.clone())),
                Some((_, Err(why))) => {
                    tracing::info!(pid = t.pid, "not the process recorded as pid {}: {why}", r.pid)
                }
                _ => tracing::info!(pid = t.pid, "pid {} was recorded in no container: not moved", r.pid),
            }
        }
        let (old, was, at) = match found.len() {
            0 => return Ok(None),
            1 => found.remove(0),
            n => {
                let pids: Vec<String> = found.iter().map(|(r, _, _)| r.pid.to_string()).collect();
                return Err(Error::AmbiguousRecord {
                    pid: t.pid,
                    reason: format!(
                        "{n} checkpointed processes of its container (pids {}) had pid {inner} inside and ran the same program",
                        pids.join(", ")
                    ),
                });
            }
        };
        let st = match self.restored_state(t)? {
            Ok(st) => st,
            Err(why) => {
                tracing::info!(pid = t.pid, "not a restored process gpusnap recorded: {why}");
                return Ok(None);
            }
        };
        let rivals: Vec<i32> = crate::container::placement_members(&at)
            .into_iter()
            .filter(|&p| p != t.pid && target::ns_pid(p) == Some(inner))
            .filter(|&p| was.restored_as(&target::fingerprint(p)).is_ok())
            .filter(|&p| target::resolve(p).is_ok_and(|rt| self.restored_state(&rt).is_ok_and(|s| s.is_ok())))
            .collect();
        if !rivals.is_empty() {
            let n = rivals.len() + 1;
            return Err(Error::AmbiguousRecord {
                pid: t.pid,
                reason: format!(
                    "{n} live processes of its container (pids {}, {}) could be the checkpointed pid {}",
                    t.pid,
                    rivals.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(", "),
                    old.pid
                ),
            });
        }
        let detail = format!(
            "restored outside gpusnap into a new pid namespace (pid {inner} inside, same program, same container, driver state {st}): record moved from pid {} start time {}",
            old.pid, old.start_time
        );
        Ok(Some(Found::Restored { old, detail }))
    }

    /// [`Self::record_of`] for commands that act on whatever process holds
    /// the pid now (suspend, stop, park): a reused pid simply has no record.
    pub fn record_now(&mut self, t: &Target) -> Result<Option<Record>, Error> {
        match self.record_of(t) {
            Err(Error::Reused { .. }) => Ok(None),
            other => other,
        }
    }
}

/// Whether process `pid` lives where `at` says a recorded one did: the same
/// cgroup and the same container, or why not.
fn same_placement(at: &crate::container::Placement, pid: i32) -> Result<(), String> {
    match crate::container::placement(pid) {
        Some(now) if now == *at => Ok(()),
        Some(now) if now.container != at.container => Err(format!(
            "it lives in {}, the recorded process in {}",
            now.container.as_deref().unwrap_or("no container"),
            at.container.as_deref().unwrap_or("no container")
        )),
        Some(now) => Err(format!("it lives in cgroup {}, the recorded process in {}", now.cgroup, at.cgroup)),
        None => Err("its cgroup is unknown".into()),
    }
}
