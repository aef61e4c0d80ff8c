//! Suspending a guarded process before it dies: its CUDA state locked and
//! checkpointed, journaled, and checked with NVML to be off the GPU.

use crate::fault::{xid_lines, Fault, FAULTED};
use gpusnap_core::error::Error;
use gpusnap_core::store::Store;
use gpusnap_core::target::{self, Target};
use gpusnap_cuda::ffi::CUDA_ERROR_NOT_INITIALIZED;
use gpusnap_cuda::{CheckpointApi, Deadline, ProcessState};
use gpusnap_gpu::GpuInventory;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Suspends process `pid` (lock with a timeout, checkpoint), journaled, and
/// checks with NVML that its device memory is gone.
pub(crate) fn suspend_now<A: CheckpointApi, G: GpuInventory + ?Sized>(
    api: &Deadline<A>,
    gpus: &G,
    store: &mut Store,
    pid: i32,
    why: &str,
    lock_timeout_ms: u32,
) -> Result<String, Error> {
    // Not resolve_callable: the dying thread sits in a ptrace stop (state
    // t), which the driver tolerates (measured: lock + checkpoint at a
    // signal-delivery-stop and at a seccomp stop both succeed).
    let t: Target = target::resolve(pid)?;
    let _serial = store.lock_target(pid)?;
    let st = match api.get_state(pid) {
        Ok(s) => s,
        Err(e) if e.code() == Some(CUDA_ERROR_NOT_INITIALIZED) => return Ok("no CUDA state".into()),
        Err(e) => return Err(Error::Driver { pid, source: e }),
    };
    match st {
        ProcessState::Checkpointed => return Ok("already suspended".into()),
        ProcessState::Running | ProcessState::Locked => {}
        other => return Ok(format!("driver state {other}; left as it is")),
    }
    let mut fp = BTreeMap::new();
    for u in gpus.usage_of(pid as u32)? {
        *fp.entry(u.uuid).or_insert(0u64) += u.bytes.unwrap_or(0);
    }
    // A parked process (a fast-swap library holding its memory in host
    // memory) keeps the footprint recorded before its park: that memory
    // comes back with it too. Only a record that says parked asks the
    // library (a dying process's library may not answer).
    if let Some(before) = store.get(&t)?.filter(|r| r.state == gpusnap_core::store::PARKED) {
        if before.footprint_bytes() > fp.values().sum::<u64>()
            && gpusnap_core::swap::status(pid).is_some_and(|s| s.away())
        {
            fp = before.footprint;
        }
    }
    let total: u64 = fp.values().sum();
    store.record(&t, st.as_str(), Some(&fp))?;
    store.note(&t, "guard", None, &format!("dying: {why}"))?;
    if st == ProcessState::Running {
        let id = store.begin(&t, "lock")?;
        let r = api.lock(pid, lock_timeout_ms);
        let msg = r.as_ref().err().map(|e| e.to_string());
        store.end(id, &t, "lock", msg.as_deref().map_or(Ok("locked"), Err))?;
        r.map_err(|source| Error::Driver { pid, source })?;
    }
    let id = store.begin(&t, "checkpoint")?;
    let r = api.checkpoint_within(pid, total);
    let msg = r.as_ref().err().map(|e| e.to_string());
    store.end(id, &t, "checkpoint", msg.as_deref().map_or(Ok("checkpointed"), Err))?;
    r.map_err(|source| Error::Driver { pid, source })?;
    // Check the result: no device memory left (NVML), before the death proceeds.
    let end = Instant::now() + Duration::from_secs(5);
    let released = loop {
        let left: u64 = gpus.usage_of(pid as u32)?.iter().map(|u| u.bytes.unwrap_or(0)).sum();
        if left == 0 {
            break true;
        }
        if Instant::now() > end {
            break false;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let outcome =
        format!("suspended {} MiB{}", total >> 20, if released { "" } else { "; NVML still shows memory" });
    store.note(&t, "guard", Some("checkpointed"), &format!("{outcome} before death ({why})"))?;
    Ok(outcome)
}

/// [`suspend_now`] for a process about to die of `why`; the outcome, good or
/// bad, goes into the journal and the log. A context that answered a
/// sticky error is journaled as faulted (record state `faulted`), with the
/// kernel log's Xid lines for it where readable, and returned.
pub(crate) fn suspend_before_death<A: CheckpointApi, G: GpuInventory + ?Sized>(
    api: &Deadline<A>,
    gpus: &G,
    store: &mut Store,
    pid: i32,
    why: &str,
    lock_timeout_ms: u32,
) -> Option<Fault> {
    let mut fault = None;
    let outcome = suspend_now(api, gpus, store, pid, why, lock_timeout_ms).unwrap_or_else(|e| {
        let msg = format!("could not suspend before death ({why}): {e}");
        let t = target::resolve(pid).ok();
        if let Some(t) = &t {
            let _ = store.note(t, "guard", None, &msg);
        }
        if let Error::Driver { source, .. } = &e {
            if source.is_sticky() {
                let f = Fault {
                    code: source.code().unwrap_or(0),
                    detail: source.to_string(),
                    xids: xid_lines(pid),
                };
                if let Some(t) = &t {
                    let _ = store.note(t, "guard", Some(FAULTED), &f.describe());
                }
                tracing::warn!(pid, why, "guard: {}", f.describe());
                fault = Some(f);
            }
        }
        msg
    });
    tracing::info!(pid, why, outcome = %outcome, "guard");
    fault
}
