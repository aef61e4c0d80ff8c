//! What the lifecycle's operations (suspend, resume, stop, state) are asked
//! and what they report.

use serde::Serialize;
use std::time::Duration;

const MIB: u64 = 1 << 20;

#[derive(Debug, Clone, Serialize)]
pub struct GpuBytes {
    pub uuid: String,
    pub bytes: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct StateReport {
    pub pid: i32,
    pub start_time: u64,
    pub comm: String,
    pub state: String,
    pub unrecoverable: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Device memory now (running) or when it was suspended (checkpointed).
    pub footprint_bytes: u64,
    pub gpus: Vec<GpuBytes>,
    /// Its pid inside its own pid namespace, when that differs (a container).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ns_pid: Option<i32>,
    /// The container it runs in, from its cgroup.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container: Option<crate::container::ContainerRef>,
    /// Run with `--fast-swap`: where its served memory is, and what stays
    /// with the driver (and why).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fast_swap: Option<crate::swap::SwapStatus>,
    /// Parked (state `parked`, or `parking`/`unparking` while its library
    /// moves memory): what stays on the GPU and what waits in host memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parked: Option<ParkedBytes>,
}

/// A parked process's memory: on the GPU (the context, modules, graphs and
/// what the library does not serve) and in pinned host memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ParkedBytes {
    /// Device memory it still holds, as NVML shows it now.
    pub residual_bytes: u64,
    /// The library's allocations, in pinned host memory.
    pub host_bytes: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ParkReport {
    pub pid: i32,
    pub state: String,
    /// It was parked already: nothing was moved.
    pub already: bool,
    /// Device memory before the park (what its unpark's admission asks
    /// for, less the residual).
    pub footprint_bytes: u64,
    /// Device memory it holds now, as NVML shows it.
    pub residual_bytes: u64,
    /// Bytes the library moved to pinned host memory.
    pub host_bytes: u64,
    pub gpus: Vec<GpuBytes>,
    pub offload_ms: u64,
    pub total_ms: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct SuspendReport {
    pub pid: i32,
    pub state: String,
    /// It was already checkpointed: nothing was done.
    pub already: bool,
    pub footprint_bytes: u64,
    pub gpus: Vec<GpuBytes>,
    /// Fast swap: the program's library moving its memory to host memory
    /// (0 without fast swap).
    pub offload_ms: u64,
    pub lock_ms: u64,
    pub checkpoint_ms: u64,
    /// From the checkpoint's return until NVML showed the process's device
    /// memory released (what admission of the next resume waits for).
    pub release_ms: u64,
    /// NVML reads that took.
    pub release_polls: u32,
    pub total_ms: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ResumeReport {
    pub pid: i32,
    pub state: String,
    pub already: bool,
    pub footprint_bytes: u64,
    /// Time spent waiting for GPU memory (`--wait`).
    pub waited_ms: u64,
    pub restore_ms: u64,
    pub unlock_ms: u64,
    pub total_ms: u64,
    /// It was stuck and came back from this image instead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recovered_from: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct StopReport {
    pub pid: i32,
    /// Its CUDA state was checkpointed before any signal was sent.
    pub suspended: bool,
    /// NVML showed no device memory for it before the first signal.
    pub released_before_kill: bool,
    /// The signal that ended it.
    pub signal: String,
    pub cuda: bool,
    pub total_ms: u64,
}

#[derive(Debug, Clone)]
pub struct ResumeOptions {
    /// Extra free memory required on each GPU beyond the footprint.
    pub margin_bytes: u64,
    /// How long to wait for enough free memory before refusing.
    pub wait: Duration,
    /// The footprint to assume when none was recorded.
    pub footprint_bytes: Option<u64>,
    /// Restore onto other GPUs: (old, new) as indices or UUIDs.
    pub device_map: Vec<(String, String)>,
}

impl Default for ResumeOptions {
    fn default() -> Self {
        Self { margin_bytes: 256 * MIB, wait: Duration::ZERO, footprint_bytes: None, device_map: Vec::new() }
    }
}

#[derive(Debug, Clone)]
pub struct StopOptions {
    pub grace: Duration,
    pub force: bool,
    pub lock_timeout_ms: u32,
}
