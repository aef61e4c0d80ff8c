//! `state.json` and the rules of the simulated driver, kept free of I/O so
//! that they can be tested on their own: each checkpoint-API call that takes
//! time is split into a `begin_*` that decides (and says how long to sleep)
//! and a `finish_*` that completes it after the sleep.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::codes::*;
use crate::config::Config;
use crate::MIB;

/// `CUprocessState`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "u8", try_from = "u8")]
pub enum ProcState {
    Running = 0,
    Locked = 1,
    Checkpointed = 2,
    Failed = 3,
}

impl From<ProcState> for u8 {
    fn from(s: ProcState) -> u8 {
        s as u8
    }
}

impl TryFrom<u8> for ProcState {
    type Error = String;
    fn try_from(v: u8) -> Result<Self, String> {
        Ok(match v {
            0 => Self::Running,
            1 => Self::Locked,
            2 => Self::Checkpointed,
            3 => Self::Failed,
            _ => return Err(format!("no process state {v}")),
        })
    }
}

/// One device allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Alloc {
    /// Device ordinal in `config.json`'s `gpus`.
    pub gpu: u32,
    pub bytes: u64,
    /// The physical allocation (`cuMemCreate`) mapped here; None for
    /// `cuMemAlloc`'s memory. Its bytes count once, with the handle.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handle: Option<u64>,
}

/// Where the first allocation of every process starts: an address that looks
/// like a device pointer and is never 0.
const FIRST_PTR: u64 = 0x7f00_0000_0000;
/// Allocations are spaced like the real allocator's 2 MiB pages.
pub(crate) const PTR_ALIGN: u64 = 2 * MIB;

/// A process that created a CUDA context.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Proc {
    /// Field 22 of `/proc/PID/stat` when the entry was made (or adopted by a
    /// CRIU-restored process with the same pid).
    pub start_time: u64,
    pub state: ProcState,
    /// Stuck after a restore that ran out of memory: never runs again.
    #[serde(default)]
    pub poisoned: bool,
    /// The sticky error its context took (`fakeFault`): every later call of
    /// the process, and a lock, checkpoint, restore or unlock of it, answers
    /// this code; get-state still answers (not measured on the driver).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub faulted: Option<CuResult>,
    /// Holds device memory. Not derivable from `state`: a restore takes the
    /// memory before its copy finishes and the process leaves CHECKPOINTED.
    pub resident: bool,
    /// The GPUs it has a context on.
    #[serde(default)]
    pub contexts: BTreeSet<u32>,
    /// Allocations by device pointer.
    #[serde(default)]
    pub allocs: BTreeMap<u64, Alloc>,
    pub next_ptr: u64,
    /// Queued GPU work runs until then (unix ms); a lock waits for it.
    #[serde(default)]
    pub busy_until_ms: u64,
    /// When its last checkpoint freed its device memory (unix ms): NVML's
    /// configured lag runs from there.
    #[serde(default)]
    pub released_ms: u64,
    /// Where the process keeps the host copy a checkpoint writes and a
    /// restore reads (`fakeRegisterHostCopy`; see `hostcopy`). None: the
    /// fake only moves its data files, as before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_copy: Option<HostCopy>,
    /// The thread `cuCheckpointProcessGetRestoreThreadId` names (registered
    /// with the host copy); None: the pid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_tid: Option<i32>,
    /// Virtual ranges reserved with `cuMemAddressReserve` (address -> size):
    /// no memory, and they survive a checkpoint and restore (see `vmm`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub reservations: BTreeMap<u64, u64>,
    /// Physical allocations made with `cuMemCreate`, by handle.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub handles: BTreeMap<u64, crate::vmm::Phys>,
    /// A restore under way: its copy is done then (unix ms). The copy is the
    /// process's own restore thread's work, so it goes on when the caller
    /// that asked for it dies (see `driver::restore`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restoring_until_ms: Option<u64>,
    /// The name of the mark a process in a pid namespace of its own holds
    /// open (`ids/TOKEN`, see the driver's `moved`): how a call naming its
    /// new host pid after a CRIU restore into a new namespace finds this
    /// entry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// Threads inside a workload call that waits (a copy at the configured
    /// speed, a synchronize) now: a lock that finds any journals
    /// `lock_inside` (see the driver's `lock`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub inside: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A range of the process's own anonymous memory that holds its "device
/// memory" while it is checkpointed, as the real driver's host copy does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostCopy {
    pub addr: u64,
    pub len: u64,
}

/// How a lock on a RUNNING process goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockWait {
    /// Queued work drains in this many ms; then the process is locked.
    Drains(u64),
    /// The queued work outlasts the timeout: sleep this many ms, then answer
    /// `CUDA_ERROR_NOT_READY` and leave the process running.
    TimesOut(u64),
}

impl Proc {
    pub fn new(start_time: u64) -> Self {
        Self {
            start_time,
            state: ProcState::Running,
            poisoned: false,
            faulted: None,
            resident: true,
            contexts: BTreeSet::new(),
            allocs: BTreeMap::new(),
            next_ptr: FIRST_PTR,
            busy_until_ms: 0,
            released_ms: 0,
            host_copy: None,
            restore_tid: None,
            reservations: BTreeMap::new(),
            handles: BTreeMap::new(),
            token: None,
            inside: 0,
            restoring_until_ms: None,
        }
    }

    /// Device bytes this process holds on `gpu` when resident.
    pub fn bytes_on(&self, gpu: u32, context_bytes: u64) -> u64 {
        self.memory_bytes(Some(gpu)) + if self.contexts.contains(&gpu) { context_bytes } else { 0 }
    }

    /// Device bytes on all GPUs: what checkpoint and restore copy.
    pub fn footprint(&self, context_bytes: u64) -> u64 {
        self.memory_bytes(None) + self.contexts.len() as u64 * context_bytes
    }

    /// Whether the process's own CUDA calls may proceed; they block otherwise,
    /// as a locked process's calls do on a real driver.
    pub fn accepts_work(&self) -> bool {
        self.state == ProcState::Running && !self.poisoned
    }

    /// What get-state reports: a poisoned process still says CHECKPOINTED.
    pub fn reported_state(&self) -> ProcState {
        if self.poisoned {
            ProcState::Checkpointed
        } else {
            self.state
        }
    }

    /// A faulted context answers its sticky error to every call on it.
    pub fn check_fault(&self) -> Result<(), CuResult> {
        self.faulted.map_or(Ok(()), Err)
    }

    pub fn begin_lock(&self, now_ms: u64, timeout_ms: u32) -> Result<LockWait, CuResult> {
        self.check_fault()?;
        if self.poisoned || self.state != ProcState::Running {
            return Err(CUDA_ERROR_ILLEGAL_STATE);
        }
        let wait = self.busy_until_ms.saturating_sub(now_ms);
        let timeout = u64::from(timeout_ms);
        Ok(if timeout > 0 && wait > timeout { LockWait::TimesOut(timeout) } else { LockWait::Drains(wait) })
    }

    pub fn finish_lock(&mut self) -> Result<(), CuResult> {
        self.check_fault()?;
        if self.poisoned || self.state != ProcState::Running {
            return Err(CUDA_ERROR_ILLEGAL_STATE);
        }
        self.state = ProcState::Locked;
        Ok(())
    }

    /// Returns the bytes to copy to the host.
    pub fn begin_checkpoint(&self, context_bytes: u64) -> Result<u64, CuResult> {
        self.check_fault()?;
        if self.poisoned || self.state != ProcState::Locked {
            return Err(CUDA_ERROR_ILLEGAL_STATE);
        }
        Ok(self.footprint(context_bytes))
    }

    pub fn finish_checkpoint(&mut self) -> Result<(), CuResult> {
        if self.poisoned || self.state != ProcState::Locked {
            return Err(CUDA_ERROR_ILLEGAL_STATE);
        }
        self.state = ProcState::Checkpointed;
        self.resident = false;
        Ok(())
    }

    pub fn finish_restore(&mut self) -> Result<(), CuResult> {
        self.restoring_until_ms = None;
        if self.poisoned || self.state != ProcState::Checkpointed || !self.resident {
            return Err(CUDA_ERROR_ILLEGAL_STATE);
        }
        self.state = ProcState::Locked;
        Ok(())
    }

    /// A restore whose caller is gone (the calls on a process are
    /// serialised, so one found under way by the next call has lost its
    /// caller): the process's restore thread finishes it. How many ms are
    /// left of its copy (0: finished now, or none was under way).
    pub fn finish_orphaned_restore(&mut self, now_ms: u64) -> u64 {
        match self.restoring_until_ms {
            Some(until) if until > now_ms => until - now_ms,
            Some(_) => {
                let _ = self.finish_restore();
                0
            }
            None => 0,
        }
    }

    pub fn unlock(&mut self) -> Result<(), CuResult> {
        self.check_fault()?;
        if self.poisoned || self.state != ProcState::Locked {
            return Err(CUDA_ERROR_ILLEGAL_STATE);
        }
        self.state = ProcState::Running;
        Ok(())
    }

    /// Queues `ms` of GPU work from `now_ms` on.
    pub fn enqueue_work(&mut self, now_ms: u64, ms: u32) {
        self.busy_until_ms = self.busy_until_ms.max(now_ms + u64::from(ms));
    }

    /// The allocation holding `[ptr, ptr + len)`, as (its base, offset of ptr).
    pub fn locate(&self, ptr: u64, len: u64) -> Result<(u64, u64), CuResult> {
        let (&base, alloc) = self.allocs.range(..=ptr).next_back().ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let offset = ptr - base;
        match offset.checked_add(len) {
            Some(end) if end <= alloc.bytes => Ok((base, offset)),
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        }
    }
}

/// The whole of `state.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct State {
    /// By pid (the thread group id).
    #[serde(default)]
    pub procs: BTreeMap<i32, Proc>,
}

/// A `CUcheckpointGpuPair`: old and new GPU uuid bytes.
pub type GpuPair = ([u8; 16], [u8; 16]);

impl State {
    /// Device bytes in use on `gpu`: every resident process's allocations
    /// there plus a context's cost for each context there.
    pub fn used_bytes(&self, cfg: &Config, gpu: u32) -> u64 {
        let ctx = cfg.context_mib * MIB;
        self.procs.values().filter(|p| p.resident).map(|p| p.bytes_on(gpu, ctx)).sum()
    }

    pub fn total_bytes(cfg: &Config, gpu: u32) -> u64 {
        cfg.gpus.get(gpu as usize).map_or(0, |g| g.total_mib * MIB)
    }

    pub fn free_bytes(&self, cfg: &Config, gpu: u32) -> u64 {
        Self::total_bytes(cfg, gpu).saturating_sub(self.used_bytes(cfg, gpu))
    }

    /// Whether NVML still shows `p` holding its memory at `now_ms`, `lag_ms`
    /// after a checkpoint released it.
    fn nvml_holds(p: &Proc, lag_ms: u64, now_ms: u64) -> bool {
        p.resident || (lag_ms > 0 && p.released_ms > 0 && now_ms < p.released_ms.saturating_add(lag_ms))
    }

    /// [`Self::used_bytes`] as NVML reports it at `now_ms` (with
    /// `nvml_memory_lag_ms`).
    pub fn nvml_used_bytes(&self, cfg: &Config, gpu: u32, now_ms: u64) -> u64 {
        let ctx = cfg.context_mib * MIB;
        self.procs
            .values()
            .filter(|p| Self::nvml_holds(p, cfg.nvml_memory_lag_ms, now_ms))
            .map(|p| p.bytes_on(gpu, ctx))
            .sum()
    }

    /// [`Self::gpu_processes`] as NVML reports them at `now_ms` (with
    /// `nvml_process_lag_ms`).
    pub fn nvml_gpu_processes(&self, cfg: &Config, gpu: u32, now_ms: u64) -> Vec<(i32, u64)> {
        let ctx = cfg.context_mib * MIB;
        self.procs
            .iter()
            .filter(|(_, p)| {
                Self::nvml_holds(p, cfg.nvml_process_lag_ms, now_ms)
                    && (p.contexts.contains(&gpu) || p.holds_on(gpu))
            })
            .map(|(&pid, p)| (pid, p.bytes_on(gpu, ctx)))
            .collect()
    }

    /// The processes holding memory on `gpu`, as (pid, bytes), for NVML.
    pub fn gpu_processes(&self, cfg: &Config, gpu: u32) -> Vec<(i32, u64)> {
        let ctx = cfg.context_mib * MIB;
        self.procs
            .iter()
            .filter(|(_, p)| p.resident && (p.contexts.contains(&gpu) || p.holds_on(gpu)))
            .map(|(&pid, p)| (pid, p.bytes_on(gpu, ctx)))
            .collect()
    }

    /// Drops the entries of processes that are gone (`alive(pid, start_time)`
    /// false), which frees their memory, and returns their pids so that the
    /// caller can delete their data. Checkpointed entries stay, without
    /// device memory: their data is in host memory, and a CRIU-restored
    /// process with the same pid must find it.
    pub fn collect_garbage(&mut self, alive: impl Fn(i32, u64) -> bool) -> Vec<i32> {
        let mut gone = Vec::new();
        self.procs.retain(|&pid, p| {
            if alive(pid, p.start_time) {
                return true;
            }
            if p.state == ProcState::Checkpointed {
                p.resident = false;
                p.restoring_until_ms = None;
                return true;
            }
            gone.push(pid);
            false
        });
        gone
    }

    /// `cuCtxCreate` by process `pid` on `gpu`. A stale entry of an earlier
    /// process with the same pid is replaced; returns whether one was, so
    /// that the caller can drop that process's data.
    pub fn create_context(
        &mut self,
        cfg: &Config,
        pid: i32,
        start_time: u64,
        gpu: u32,
    ) -> Result<bool, CuResult> {
        if gpu as usize >= cfg.gpus.len() {
            return Err(CUDA_ERROR_INVALID_DEVICE);
        }
        let stale = self.procs.get(&pid).is_some_and(|p| p.start_time != start_time);
        if stale {
            self.procs.remove(&pid);
        }
        let has_context = self.procs.get(&pid).is_some_and(|p| p.contexts.contains(&gpu));
        if !has_context && self.free_bytes(cfg, gpu) < cfg.context_mib * MIB {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        self.procs.entry(pid).or_insert_with(|| Proc::new(start_time)).contexts.insert(gpu);
        Ok(stale)
    }

    /// `cuMemAlloc` of `bytes` on `gpu` by `pid`; returns the device pointer.
    pub fn alloc(&mut self, cfg: &Config, pid: i32, gpu: u32, bytes: u64) -> Result<u64, CuResult> {
        if bytes == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if !self.procs.get(&pid).is_some_and(|p| p.contexts.contains(&gpu)) {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        if self.free_bytes(cfg, gpu) < bytes {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let p = self.procs.get_mut(&pid).ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        let ptr = p.next_ptr;
        p.next_ptr += bytes.div_ceil(PTR_ALIGN) * PTR_ALIGN;
        p.allocs.insert(ptr, Alloc { gpu, bytes, handle: None });
        Ok(ptr)
    }

    /// `cuMemFree` of a pointer `cuMemAlloc` returned.
    pub fn free(&mut self, pid: i32, ptr: u64) -> Result<(), CuResult> {
        let p = self.procs.get_mut(&pid).ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        // Mapped VMM memory is not cuMemAlloc's to free.
        if p.allocs.get(&ptr).is_some_and(|a| a.handle.is_some()) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        p.allocs.remove(&ptr).map(|_| ()).ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    /// Decides a restore of `pid` and, when it goes ahead, takes the device
    /// memory (on the GPUs `pairs` map to). Returns the bytes to copy back.
    ///
    /// A restore that finds too little free memory poisons the process, as on
    /// the real driver: it answers `CUDA_ERROR_OUT_OF_MEMORY` now and
    /// `CUDA_ERROR_OPERATING_SYSTEM` to every later restore.
    pub fn begin_restore(
        &mut self,
        cfg: &Config,
        pid: i32,
        pairs: Option<&[GpuPair]>,
    ) -> Result<u64, CuResult> {
        let p = self.procs.get(&pid).ok_or(CUDA_ERROR_NOT_INITIALIZED)?;
        if p.poisoned {
            return Err(CUDA_ERROR_OPERATING_SYSTEM);
        }
        if p.state != ProcState::Checkpointed || p.resident {
            return Err(CUDA_ERROR_ILLEGAL_STATE);
        }
        let map = match pairs {
            Some(pairs) => Some(gpu_map(cfg, pairs)?),
            None => None,
        };
        let moved = |gpu: u32| map.as_ref().map_or(gpu, |m| m[gpu as usize]);

        let ctx = cfg.context_mib * MIB;
        let mut need: BTreeMap<u32, u64> = BTreeMap::new();
        for a in p.allocs.values().filter(|a| a.handle.is_none()) {
            *need.entry(moved(a.gpu)).or_default() += a.bytes;
        }
        for h in p.handles.values() {
            *need.entry(moved(h.gpu)).or_default() += h.bytes;
        }
        for &gpu in &p.contexts {
            *need.entry(moved(gpu)).or_default() += ctx;
        }
        if need.iter().any(|(&gpu, &bytes)| self.free_bytes(cfg, gpu) < bytes) {
            if let Some(p) = self.procs.get_mut(&pid) {
                p.poisoned = true;
            }
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }

        let p = self.procs.get_mut(&pid).ok_or(CUDA_ERROR_NOT_INITIALIZED)?;
        for a in p.allocs.values_mut() {
            a.gpu = moved(a.gpu);
        }
        for h in p.handles.values_mut() {
            h.gpu = moved(h.gpu);
        }
        p.contexts = p.contexts.iter().map(|&g| moved(g)).collect();
        p.resident = true;
        Ok(p.footprint(ctx))
    }
}

/// Turns gpu pairs into "old ordinal -> new ordinal". The real driver wants
/// pairs (13.0 on) that cover every GPU the process can see, here every GPU
/// in the config, and answers `CUDA_ERROR_INVALID_VALUE` otherwise without
/// harming the process.
fn gpu_map(cfg: &Config, pairs: &[GpuPair]) -> Result<Vec<u32>, CuResult> {
    if cfg.driver_version < 13000 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut map: Vec<Option<u32>> = vec![None; cfg.gpus.len()];
    for (old, new) in pairs {
        let old = cfg.gpu_by_uuid_bytes(old).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let new = cfg.gpu_by_uuid_bytes(new).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        match map[old as usize] {
            Some(seen) if seen != new => return Err(CUDA_ERROR_INVALID_VALUE),
            _ => map[old as usize] = Some(new),
        }
    }
    map.into_iter().map(|m| m.ok_or(CUDA_ERROR_INVALID_VALUE)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{parse_uuid, GpuConfig};

    /// The gpu pair moving config GPU `old` to `new`.
    fn pair(cfg: &Config, old: usize, new: usize) -> Option<GpuPair> {
        Some((parse_uuid(&cfg.gpus.get(old)?.uuid)?, parse_uuid(&cfg.gpus.get(new)?.uuid)?))
    }

    #[test]
    fn nvml_may_report_a_release_late() {
        let mut cfg = config(&[1000]);
        cfg.nvml_process_lag_ms = 50;
        cfg.nvml_memory_lag_ms = 80;
        let mut st = State::default();
        with_proc(&mut st, &cfg, 1, 0, 100);
        let p = st.procs.get_mut(&1).unwrap();
        p.state = ProcState::Checkpointed;
        p.resident = false;
        p.released_ms = 10_000;
        // The driver's view has no lag.
        assert_eq!(st.used_bytes(&cfg, 0), 0);
        assert_eq!(st.nvml_gpu_processes(&cfg, 0, 10_049), vec![(1, 110 * MIB)]);
        assert!(st.nvml_gpu_processes(&cfg, 0, 10_050).is_empty());
        assert_eq!(st.nvml_used_bytes(&cfg, 0, 10_079), 110 * MIB);
        assert_eq!(st.nvml_used_bytes(&cfg, 0, 10_080), 0);
    }

    fn config(gpus: &[u64]) -> Config {
        let mut cfg = Config {
            gpus: gpus.iter().map(|&total_mib| GpuConfig { total_mib, ..GpuConfig::default() }).collect(),
            context_mib: 10,
            ..Config::default()
        };
        cfg.normalize();
        cfg
    }

    /// A process on `gpu` with one allocation of `mib`.
    fn with_proc(state: &mut State, cfg: &Config, pid: i32, gpu: u32, mib: u64) -> u64 {
        state.create_context(cfg, pid, 1000 + pid as u64, gpu).unwrap();
        state.alloc(cfg, pid, gpu, mib * MIB).unwrap()
    }

    fn lock_and_checkpoint(state: &mut State, cfg: &Config, pid: i32) {
        let p = state.procs.get_mut(&pid).unwrap();
        assert_eq!(p.begin_lock(0, 0), Ok(LockWait::Drains(0)));
        p.finish_lock().unwrap();
        p.begin_checkpoint(cfg.context_mib * MIB).unwrap();
        p.finish_checkpoint().unwrap();
    }

    #[test]
    fn full_cycle_moves_memory_and_states() {
        let cfg = config(&[1000]);
        let mut st = State::default();
        with_proc(&mut st, &cfg, 1, 0, 500);
        assert_eq!(st.used_bytes(&cfg, 0), 510 * MIB);
        assert_eq!(st.gpu_processes(&cfg, 0), vec![(1, 510 * MIB)]);

        let p = st.procs.get_mut(&1).unwrap();
        p.finish_lock().unwrap();
        assert_eq!(p.reported_state(), ProcState::Locked);
        assert!(!p.accepts_work());
        assert_eq!(p.begin_lock(0, 0), Err(CUDA_ERROR_ILLEGAL_STATE));
        assert_eq!(p.begin_checkpoint(10 * MIB), Ok(510 * MIB));
        p.finish_checkpoint().unwrap();
        assert_eq!(p.begin_lock(0, 0), Err(CUDA_ERROR_ILLEGAL_STATE));
        assert_eq!(p.unlock(), Err(CUDA_ERROR_ILLEGAL_STATE));
        assert_eq!(p.begin_checkpoint(0), Err(CUDA_ERROR_ILLEGAL_STATE));
        assert_eq!(st.used_bytes(&cfg, 0), 0);
        assert!(st.gpu_processes(&cfg, 0).is_empty());

        assert_eq!(st.begin_restore(&cfg, 1, None), Ok(510 * MIB));
        // The memory is taken before the copy ends.
        assert_eq!(st.used_bytes(&cfg, 0), 510 * MIB);
        assert_eq!(st.begin_restore(&cfg, 1, None), Err(CUDA_ERROR_ILLEGAL_STATE));
        let p = st.procs.get_mut(&1).unwrap();
        p.finish_restore().unwrap();
        assert_eq!(p.reported_state(), ProcState::Locked);
        p.unlock().unwrap();
        assert!(p.accepts_work());
        assert_eq!(p.unlock(), Err(CUDA_ERROR_ILLEGAL_STATE));
    }

    #[test]
    fn restore_without_room_poisons_the_process() {
        let cfg = config(&[1000]);
        let mut st = State::default();
        with_proc(&mut st, &cfg, 1, 0, 600);
        lock_and_checkpoint(&mut st, &cfg, 1);
        with_proc(&mut st, &cfg, 2, 0, 600);

        assert_eq!(st.begin_restore(&cfg, 1, None), Err(CUDA_ERROR_OUT_OF_MEMORY));
        st.procs.remove(&2);
        // Room again, but the process is stuck for good.
        assert_eq!(st.begin_restore(&cfg, 1, None), Err(CUDA_ERROR_OPERATING_SYSTEM));
        let p = st.procs.get_mut(&1).unwrap();
        assert_eq!(p.reported_state(), ProcState::Checkpointed);
        assert_eq!(p.unlock(), Err(CUDA_ERROR_ILLEGAL_STATE));
        assert_eq!(p.begin_lock(0, 0), Err(CUDA_ERROR_ILLEGAL_STATE));
        assert_eq!(p.begin_checkpoint(0), Err(CUDA_ERROR_ILLEGAL_STATE));
        assert!(!p.accepts_work());
        assert_eq!(st.used_bytes(&cfg, 0), 0);
    }

    #[test]
    fn a_faulted_context_answers_its_sticky_error_and_keeps_its_memory() {
        let cfg = config(&[1000]);
        let mut st = State::default();
        with_proc(&mut st, &cfg, 1, 0, 600);
        let p = st.procs.get_mut(&1).unwrap();
        p.faulted = Some(CUDA_ERROR_ILLEGAL_ADDRESS);
        assert_eq!(p.begin_lock(0, 0), Err(CUDA_ERROR_ILLEGAL_ADDRESS));
        assert_eq!(p.finish_lock(), Err(CUDA_ERROR_ILLEGAL_ADDRESS));
        assert_eq!(p.begin_checkpoint(0), Err(CUDA_ERROR_ILLEGAL_ADDRESS));
        assert_eq!(p.unlock(), Err(CUDA_ERROR_ILLEGAL_ADDRESS));
        assert_eq!(p.reported_state(), ProcState::Running);
        // Still on the GPU (NVML lists it) until the process is gone.
        let held = st.used_bytes(&cfg, 0);
        assert!(held >= 600 * MIB, "{held}");
        let back: State = serde_json::from_str(&serde_json::to_string(&st).unwrap()).unwrap();
        assert_eq!(back.procs[&1].faulted, Some(CUDA_ERROR_ILLEGAL_ADDRESS));
    }

    #[test]
    fn lock_waits_for_queued_work_or_times_out() {
        let mut p = Proc::new(1);
        p.enqueue_work(1000, 500);
        p.enqueue_work(1100, 100); // does not shorten what is queued
        assert_eq!(p.busy_until_ms, 1500);
        assert_eq!(p.begin_lock(1200, 0), Ok(LockWait::Drains(300)));
        assert_eq!(p.begin_lock(1200, 300), Ok(LockWait::Drains(300)));
        assert_eq!(p.begin_lock(1200, 299), Ok(LockWait::TimesOut(299)));
        assert_eq!(p.begin_lock(2000, 1), Ok(LockWait::Drains(0)));
        assert_eq!(p.state, ProcState::Running);
    }

    #[test]
    fn gpu_pairs_must_cover_every_gpu() {
        let cfg = config(&[1000, 1000]);
        let mut st = State::default();
        with_proc(&mut st, &cfg, 1, 0, 300);
        lock_and_checkpoint(&mut st, &cfg, 1);

        let only_one = [pair(&cfg, 0, 1).unwrap()];
        assert_eq!(st.begin_restore(&cfg, 1, Some(&only_one)), Err(CUDA_ERROR_INVALID_VALUE));
        let unknown = [pair(&cfg, 0, 1).unwrap(), ([9; 16], [9; 16])];
        assert_eq!(st.begin_restore(&cfg, 1, Some(&unknown)), Err(CUDA_ERROR_INVALID_VALUE));
        let conflicting = [pair(&cfg, 0, 1).unwrap(), pair(&cfg, 0, 0).unwrap(), pair(&cfg, 1, 0).unwrap()];
        assert_eq!(st.begin_restore(&cfg, 1, Some(&conflicting)), Err(CUDA_ERROR_INVALID_VALUE));
        // A wrong map does not strand the process.
        assert!(!st.procs[&1].poisoned);

        let swap = [pair(&cfg, 0, 1).unwrap(), pair(&cfg, 1, 0).unwrap()];
        assert_eq!(st.begin_restore(&cfg, 1, Some(&swap)), Ok(310 * MIB));
        assert_eq!(st.used_bytes(&cfg, 0), 0);
        assert_eq!(st.used_bytes(&cfg, 1), 310 * MIB);
        assert_eq!(st.gpu_processes(&cfg, 1), vec![(1, 310 * MIB)]);
    }

    #[test]
    fn gpu_pairs_need_driver_13() {
        let mut cfg = config(&[1000]);
        cfg.driver_version = 12080;
        let mut st = State::default();
        with_proc(&mut st, &cfg, 1, 0, 1);
        lock_and_checkpoint(&mut st, &cfg, 1);
        let same = [pair(&cfg, 0, 0).unwrap()];
        assert_eq!(st.begin_restore(&cfg, 1, Some(&same)), Err(CUDA_ERROR_INVALID_VALUE));
        assert!(st.begin_restore(&cfg, 1, None).is_ok());
    }

    #[test]
    fn restore_onto_a_full_gpu_poisons_even_with_pairs() {
        let cfg = config(&[1000, 1000]);
        let mut st = State::default();
        with_proc(&mut st, &cfg, 1, 0, 600);
        lock_and_checkpoint(&mut st, &cfg, 1);
        with_proc(&mut st, &cfg, 2, 1, 600);
        let to_full = [pair(&cfg, 0, 1).unwrap(), pair(&cfg, 1, 0).unwrap()];
        assert_eq!(st.begin_restore(&cfg, 1, Some(&to_full)), Err(CUDA_ERROR_OUT_OF_MEMORY));
        assert_eq!(st.begin_restore(&cfg, 1, None), Err(CUDA_ERROR_OPERATING_SYSTEM));
    }

    #[test]
    fn allocation_rules() {
        let cfg = config(&[100]);
        let mut st = State::default();
        assert_eq!(st.alloc(&cfg, 1, 0, MIB), Err(CUDA_ERROR_INVALID_CONTEXT));
        assert_eq!(st.create_context(&cfg, 1, 5, 1), Err(CUDA_ERROR_INVALID_DEVICE));
        assert_eq!(st.create_context(&cfg, 1, 5, 0), Ok(false));
        assert_eq!(st.alloc(&cfg, 1, 0, 0), Err(CUDA_ERROR_INVALID_VALUE));
        let a = st.alloc(&cfg, 1, 0, 3 * MIB + 1).unwrap();
        let b = st.alloc(&cfg, 1, 0, MIB).unwrap();
        assert_eq!(b - a, 4 * MIB);
        assert_eq!(st.alloc(&cfg, 1, 0, 90 * MIB), Err(CUDA_ERROR_OUT_OF_MEMORY));

        let p = &st.procs[&1];
        assert_eq!(p.locate(a + 10, 100), Ok((a, 10)));
        assert_eq!(p.locate(a + 3 * MIB, 2), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(p.locate(a - 1, 1), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(p.locate(b, u64::MAX), Err(CUDA_ERROR_INVALID_VALUE));

        assert_eq!(st.free(1, a + 1), Err(CUDA_ERROR_INVALID_VALUE));
        st.free(1, a).unwrap();
        assert_eq!(st.used_bytes(&cfg, 0), 11 * MIB);
        // A later process with the same pid starts afresh.
        assert_eq!(st.create_context(&cfg, 1, 6, 0), Ok(true));
        assert!(st.procs[&1].allocs.is_empty());
    }

    #[test]
    fn a_restore_whose_caller_died_is_finished_by_the_process() {
        let cfg = config(&[1000]);
        let mut st = State::default();
        with_proc(&mut st, &cfg, 1, 0, 100);
        lock_and_checkpoint(&mut st, &cfg, 1);
        st.begin_restore(&cfg, 1, None).unwrap();
        let p = st.procs.get_mut(&1).unwrap();
        p.restoring_until_ms = Some(5000);
        // The caller is gone mid-copy: the next call waits for the copy,
        // then finds the process restored (LOCKED), ready to unlock.
        assert_eq!(p.finish_orphaned_restore(4000), 1000);
        assert_eq!(p.reported_state(), ProcState::Checkpointed);
        assert_eq!(p.finish_orphaned_restore(5000), 0);
        assert_eq!(p.reported_state(), ProcState::Locked);
        assert_eq!(p.restoring_until_ms, None);
        assert_eq!(p.unlock(), Ok(()));
        assert_eq!(p.finish_orphaned_restore(6000), 0);
        assert_eq!(p.reported_state(), ProcState::Running);
    }

    #[test]
    fn garbage_collection_keeps_checkpointed_entries() {
        let cfg = config(&[1000]);
        let mut st = State::default();
        with_proc(&mut st, &cfg, 1, 0, 100);
        with_proc(&mut st, &cfg, 2, 0, 100);
        with_proc(&mut st, &cfg, 3, 0, 100);
        lock_and_checkpoint(&mut st, &cfg, 2);
        // Process 3 restores; it dies before the copy ends.
        lock_and_checkpoint(&mut st, &cfg, 3);
        st.begin_restore(&cfg, 3, None).unwrap();
        assert_eq!(st.used_bytes(&cfg, 0), 220 * MIB);

        let gone = st.collect_garbage(|pid, _| pid == 1);
        assert_eq!(gone, Vec::<i32>::new());
        assert_eq!(st.used_bytes(&cfg, 0), 110 * MIB);
        assert_eq!(st.procs.len(), 3);

        let gone = st.collect_garbage(|_, _| false);
        assert_eq!(gone, vec![1]);
        assert_eq!(st.procs.keys().copied().collect::<Vec<_>>(), vec![2, 3]);
    }

    #[test]
    fn state_round_trips_through_json() {
        let cfg = config(&[1000]);
        let mut st = State::default();
        with_proc(&mut st, &cfg, 42, 0, 5);
        lock_and_checkpoint(&mut st, &cfg, 42);
        let text = serde_json::to_string(&st).unwrap();
        assert!(text.contains(r#""state":2"#), "{text}");
        assert_eq!(serde_json::from_str::<State>(&text).unwrap(), st);
        assert!(serde_json::from_str::<State>(r#"{"procs":{"1":{"state":9}}}"#).is_err());
    }
}
