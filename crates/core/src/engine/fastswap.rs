//! The lifecycle's fast-swap steps (see crate::swap and
//! docs/design/fast-swap.md): a suspend first asks the program's library to
//! offload what it serves, then checkpoints what is left with the driver; a
//! resume restores the rest with the driver, unlocks, then has the library
//! map and copy its allocations back (all or nothing). Each step is
//! journaled; a gpusnap killed in one is reconciled by asking the library
//! where its memory is (an offload it started finishes or undoes itself in
//! the process).

use super::{Engine, MIB};
use crate::error::Error;
use crate::progress::observe;
use crate::swap::{self, Answer};
use crate::target::{self, Target};
use gpusnap_cuda::CheckpointApi;
use gpusnap_gpu::GpuInventory;

impl<A: CheckpointApi, G: GpuInventory> Engine<A, G> {
    /// Before the lock: the library moves its allocations to host memory.
    /// Returns whether memory is offloaded now (a failed checkpoint must
    /// bring it back). A refused offload leaves everything to the driver.
    pub(super) fn offload(&mut self, t: &Target) -> Result<bool, Error> {
        Ok(self.offload_or_why(t)?.is_ok())
    }

    /// [`Self::offload`], saying why memory is not offloaded when it is not
    /// (no fast swap, or the library refused or failed).
    pub(super) fn offload_or_why(&mut self, t: &Target) -> Result<Result<(), String>, Error> {
        let Some(st) = swap::status(t.pid) else { return Ok(Err("no fast swap".into())) };
        if st.offloaded() {
            self.store.note(
                t,
                "offload",
                None,
                "already offloaded (parked, or an earlier suspend moved it)",
            )?;
            return Ok(Ok(()));
        }
        let id = self.store.begin(t, "offload")?;
        // The copies land in the program's own pinned host memory: its
        // resident size grows with them (copies kept from an earlier
        // suspend are resident already, and that offload is quick).
        let pid = t.pid;
        let rss0 = target::rss_bytes(pid).unwrap_or(0);
        let answer = observe(
            &*self.progress,
            &format!("offload {pid}"),
            st.movable_bytes,
            || target::rss_bytes(pid).map(|r| r.saturating_sub(rss0)),
            || swap::request(pid, swap::Request::Offload),
        );
        match answer {
            Some(Ok(Answer::Done { status, .. })) if status.inside > 0 => {
                // The library answered but a thread is inside the driver:
                // the lock must not come. Bring the memory back, keep running.
                let why = format!("{} thread(s) still inside a driver call after the offload", status.inside);
                self.store.end(id, t, "offload", Err(&why))?;
                self.undo_offload(t, true);
                Err(Error::Proc { pid: t.pid, reason: format!("{why}; not locked, the process runs on") })
            }
            Some(Ok(Answer::Failed { kind, detail })) if kind == "inside" => {
                // A thread stayed inside a driver call (a long synchronize, a
                // blocking read): the driver's lock could catch it there,
                // which can crash the program once it is restored. The
                // suspend fails; the library opened its gate again.
                let why = format!("not quiesced: {detail}");
                tracing::warn!(pid = t.pid, "fast swap offload: {why}");
                self.store.end(id, t, "offload", Err(&why))?;
                Err(Error::Proc {
                    pid: t.pid,
                    reason: format!("{why}; not locked, the process runs on: retry when it is idle"),
                })
            }
            Some(Ok(Answer::Done { bytes, ms, status, phases })) => {
                self.store.end(id, t, "offload", Ok("running"))?;
                let kept = if status.kept > 0 {
                    format!(
                        "; {} allocation(s), {} MiB, stay with the driver ({})",
                        status.kept,
                        status.kept_bytes / MIB,
                        status.kept_why.join(", ")
                    )
                } else {
                    String::new()
                };
                let detail = format!(
                    "{} MiB moved to pinned host memory in {ms} ms{}{kept}",
                    bytes / MIB,
                    phase_list(&phases)
                );
                tracing::info!(pid = t.pid, "fast swap: {detail}");
                self.store.note(t, "offload", None, &detail)?;
                Ok(Ok(()))
            }
            Some(Ok(Answer::Failed { kind, detail })) => {
                let why = format!("{kind}: {detail}; nothing was moved");
                tracing::warn!(pid = t.pid, "fast swap offload refused: {why}");
                self.store.end(id, t, "offload", Err(&why))?;
                Ok(Err(why))
            }
            Some(Err(e)) => {
                self.store.end(id, t, "offload", Err(&e))?;
                // The library may still be at work: ask where its memory is.
                Ok(if swap::status(t.pid).is_some_and(|s| s.away()) { Ok(()) } else { Err(e) })
            }
            None => {
                self.store.end(id, t, "offload", Err("the library stopped answering"))?;
                Ok(Err("the library stopped answering".into()))
            }
        }
    }

    /// After the unlock: the library maps and copies its allocations back.
    /// Nothing to do for a process without fast swap or with its memory in
    /// place. Out of memory: nothing taken, the memory stays offloaded, and
    /// the caller reports it (exit 3); a resume again retries.
    pub(super) fn restore_offloaded(&mut self, t: &Target) -> Result<(), Error> {
        let Some(st) = swap::status(t.pid) else { return Ok(()) };
        if !st.away() {
            return Ok(());
        }
        let id = self.store.begin(t, "restore_offloaded")?;
        match swap::request(t.pid, swap::Request::Restore) {
            Some(Ok(Answer::Done { bytes, ms, phases, .. })) => {
                self.store.end(id, t, "restore_offloaded", Ok("running"))?;
                let detail =
                    format!("{} MiB mapped and copied back in {ms} ms{}", bytes / MIB, phase_list(&phases));
                tracing::info!(pid = t.pid, "fast swap: {detail}");
                self.store.note(t, "restore_offloaded", None, &detail)?;
                Ok(())
            }
            Some(Ok(Answer::Failed { kind, detail })) => {
                self.store.end(id, t, "restore_offloaded", Err(&format!("{kind}: {detail}")))?;
                if kind == "no-memory" {
                    Err(Error::NoMemory {
                        pid: t.pid,
                        detail: format!("its allocations could not all be mapped again ({detail}); they stay in host memory"),
                    })
                } else {
                    Err(Error::Proc {
                        pid: t.pid,
                        reason: format!("fast swap restore failed: {kind}: {detail}"),
                    })
                }
            }
            Some(Err(e)) => {
                self.store.end(id, t, "restore_offloaded", Err(&e))?;
                Err(Error::Proc { pid: t.pid, reason: e })
            }
            None => {
                self.store.end(id, t, "restore_offloaded", Err("the library stopped answering"))?;
                Err(Error::Proc { pid: t.pid, reason: "the fast swap library stopped answering".into() })
            }
        }
    }

    /// After a suspend that failed past the offload: the memory comes back
    /// (the process runs on as it was found).
    pub(super) fn undo_offload(&mut self, t: &Target, offloaded: bool) {
        if offloaded {
            if let Err(e) = self.restore_offloaded(t) {
                tracing::error!(
                    pid = t.pid,
                    "fast swap: could not bring the memory back after a failed suspend: {e}"
                );
            }
        }
    }

    /// The footprint a suspend records: what NVML shows, or, while the
    /// library's memory is already in host memory (a resume that could not
    /// map it all), the footprint recorded before, which still counts it.
    pub(super) fn with_offloaded(
        &mut self,
        t: &Target,
        live: std::collections::BTreeMap<String, u64>,
    ) -> Result<std::collections::BTreeMap<String, u64>, Error> {
        if !self.is_offloaded(t) {
            return Ok(live);
        }
        let before = self.store.get(t)?.map(|r| r.footprint).unwrap_or_default();
        Ok(if before.values().sum::<u64>() > live.values().sum::<u64>() { before } else { live })
    }

    /// Whether `t`'s library has its memory offloaded (a resume that the
    /// driver already finished still has to bring it back).
    pub(super) fn is_offloaded(&self, t: &Target) -> bool {
        swap::status(t.pid).is_some_and(|s| s.away())
    }
}

/// " (copy 560 ms, release 120 ms)" from the library's phases; empty when
/// it named none.
fn phase_list(phases: &[(String, u64)]) -> String {
    if phases.is_empty() {
        return String::new();
    }
    let parts: Vec<String> = phases.iter().map(|(k, v)| format!("{k} {v} ms")).collect();
    format!(" ({})", parts.join(", "))
}
