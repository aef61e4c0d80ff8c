//! The memory cgroup watch: a guarded CUDA process about to meet the OOM
//! killer (which uses SIGKILL, which nothing can catch) is suspended first.

use crate::suspend::suspend_now;
use gpusnap_core::store::Store;
use gpusnap_cuda::{CheckpointApi, Deadline};
use gpusnap_gpu::GpuInventory;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Usage and limit of the memory cgroup of `pid` (v2, or v1's memory
/// controller); `None` without a limit.
pub fn cgroup_memory(pid: i32) -> Option<(u64, u64)> {
    let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let read = |p: PathBuf| std::fs::read_to_string(p).ok().and_then(|s| s.trim().parse::<u64>().ok());
    for line in cg.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, ctrls, path) = (parts.next()?, parts.next()?, parts.next()?);
        let path = path.trim_start_matches('/');
        let (usage, limit) = if ctrls.split(',').any(|c| c == "memory") {
            let d = Path::new("/sys/fs/cgroup/memory").join(path);
            (read(d.join("memory.usage_in_bytes")), read(d.join("memory.limit_in_bytes")))
        } else if ctrls.is_empty() {
            let d = Path::new("/sys/fs/cgroup").join(path);
            (read(d.join("memory.current")), read(d.join("memory.max")))
        } else {
            continue;
        };
        if let (Some(u), Some(l)) = (usage, limit) {
            // "max" (v2) does not parse; v1 says "no limit" with a huge number.
            if l < (1 << 60) {
                return Some((u, l));
            }
        }
    }
    None
}

/// The out-of-memory watch: when a guarded CUDA process's cgroup has less
/// room left than its device memory would take in host memory (plus 10 % and
/// 256 MiB), suspend it now, while that is still possible. The kernel's OOM
/// killer uses SIGKILL, which nothing can catch; a suspended process can be
/// killed safely, a live restored one can take the host with it.
pub(crate) fn oom_watch<A: CheckpointApi, G: GpuInventory>(
    api: Deadline<A>,
    gpus: Arc<G>,
    mut store: Store,
    shared: Arc<Mutex<Vec<i32>>>,
    lock_timeout_ms: u32,
) {
    let mut done: BTreeSet<i32> = BTreeSet::new();
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let pids = shared.lock().map(|p| p.clone()).unwrap_or_default();
        if pids.is_empty() {
            continue;
        }
        done.retain(|p| pids.contains(p));
        for pid in pids {
            if done.contains(&pid) {
                continue;
            }
            let Some((usage, limit)) = cgroup_memory(pid) else { continue };
            let Ok(usage_of) = gpus.usage_of(pid as u32) else { continue };
            let footprint: u64 = usage_of.iter().map(|u| u.bytes.unwrap_or(0)).sum();
            if footprint == 0 {
                continue;
            }
            let room = limit.saturating_sub(usage);
            if room > footprint + footprint / 10 + (256 << 20) {
                continue;
            }
            let why = format!(
                "its memory cgroup has {} MiB left of {} MiB, its device memory needs {} MiB in host memory",
                room >> 20,
                limit >> 20,
                footprint >> 20
            );
            let outcome = suspend_now(&api, &*gpus, &mut store, pid, &why, lock_timeout_ms)
                .unwrap_or_else(|e| format!("could not suspend: {e}"));
            tracing::warn!(pid, outcome = %outcome, "out-of-memory watch");
            done.insert(pid);
        }
    }
}
