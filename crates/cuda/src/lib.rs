//! gpusnap's view of the CUDA driver: the process checkpoint API.
//!
//! Three layers, as in Firecracker and youki:
//! - [`ffi`]: raw `#[repr(C)]` structs and function-pointer types;
//! - [`CudaDriver`]: the library loaded at run time with `libloading`, each
//!   call turned into a `Result` (never a panic, never a missing-symbol abort);
//! - [`CheckpointApi`]: the trait the lifecycle logic is written against, and
//!   [`Deadline`], which runs every call under gpusnap's own time limit because
//!   the driver can hang (a stopped target ignores the lock timeout).

mod deadline;
mod driver;
mod error;
pub mod ffi;
mod uuid;

pub use deadline::{Deadline, Timeouts};
pub use driver::CudaDriver;
pub use error::{Code, DriverError};
pub use uuid::{GpuPair, GpuUuid};

use std::fmt;

/// The driver's `CUprocessState`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProcessState {
    Running,
    Locked,
    Checkpointed,
    Failed,
    Unknown(i32),
}

impl ProcessState {
    pub fn from_raw(v: i32) -> Self {
        match v {
            0 => Self::Running,
            1 => Self::Locked,
            2 => Self::Checkpointed,
            3 => Self::Failed,
            other => Self::Unknown(other),
        }
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Locked => "locked",
            Self::Checkpointed => "checkpointed",
            Self::Failed => "failed",
            Self::Unknown(_) => "unknown",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "running" => Self::Running,
            "locked" => Self::Locked,
            "checkpointed" => Self::Checkpointed,
            "failed" => Self::Failed,
            _ => return None,
        })
    }
}

impl fmt::Display for ProcessState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The driver's checkpoint calls on one process, as the lifecycle sees them.
///
/// `pid` must already be a process id (not a thread id) that the caller has
/// checked is alive and not stopped: the driver does neither check.
pub trait CheckpointApi: Send + Sync + 'static {
    /// `cuDriverGetVersion`, e.g. 13000.
    fn api_version(&self) -> i32;
    fn get_state(&self, pid: i32) -> Result<ProcessState, DriverError>;
    /// `timeout_ms == 0` waits for queued GPU work without limit.
    fn lock(&self, pid: i32, timeout_ms: u32) -> Result<(), DriverError>;
    fn checkpoint(&self, pid: i32) -> Result<(), DriverError>;
    /// An empty `pairs` restores onto the GPUs the process was checkpointed on.
    fn restore(&self, pid: i32, pairs: &[GpuPair]) -> Result<(), DriverError>;
    fn unlock(&self, pid: i32) -> Result<(), DriverError>;
    fn restore_thread_id(&self, pid: i32) -> Result<i32, DriverError>;
}

/// Which driver call an error or a journal entry is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    Init,
    GetState,
    Lock,
    Checkpoint,
    Restore,
    Unlock,
    GetRestoreThreadId,
}

impl Call {
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Init => "cuInit",
            Self::GetState => "cuCheckpointProcessGetState",
            Self::Lock => "cuCheckpointProcessLock",
            Self::Checkpoint => "cuCheckpointProcessCheckpoint",
            Self::Restore => "cuCheckpointProcessRestore",
            Self::Unlock => "cuCheckpointProcessUnlock",
            Self::GetRestoreThreadId => "cuCheckpointProcessGetRestoreThreadId",
        }
    }
}

impl fmt::Display for Call {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl<T: CheckpointApi + ?Sized> CheckpointApi for Box<T> {
    fn api_version(&self) -> i32 {
        (**self).api_version()
    }
    fn get_state(&self, pid: i32) -> Result<ProcessState, DriverError> {
        (**self).get_state(pid)
    }
    fn lock(&self, pid: i32, timeout_ms: u32) -> Result<(), DriverError> {
        (**self).lock(pid, timeout_ms)
    }
    fn checkpoint(&self, pid: i32) -> Result<(), DriverError> {
        (**self).checkpoint(pid)
    }
    fn restore(&self, pid: i32, pairs: &[GpuPair]) -> Result<(), DriverError> {
        (**self).restore(pid, pairs)
    }
    fn unlock(&self, pid: i32) -> Result<(), DriverError> {
        (**self).unlock(pid)
    }
    fn restore_thread_id(&self, pid: i32) -> Result<i32, DriverError> {
        (**self).restore_thread_id(pid)
    }
}

/// The driver of a host that has none: every process answers "no CUDA
/// context", so gpusnap can still hibernate and wake plain process trees.
/// Callers must refuse processes that map libcuda themselves.
#[derive(Debug, Clone)]
pub struct Absent {
    pub why: String,
}

impl Absent {
    fn none(&self, call: Call) -> DriverError {
        DriverError::Call {
            call,
            code: Code { raw: ffi::CUDA_ERROR_NOT_INITIALIZED, name: "CUDA_ERROR_NOT_INITIALIZED".into() },
        }
    }
}

impl CheckpointApi for Absent {
    fn api_version(&self) -> i32 {
        0
    }
    fn get_state(&self, _: i32) -> Result<ProcessState, DriverError> {
        Err(self.none(Call::GetState))
    }
    fn lock(&self, _: i32, _: u32) -> Result<(), DriverError> {
        Err(self.none(Call::Lock))
    }
    fn checkpoint(&self, _: i32) -> Result<(), DriverError> {
        Err(self.none(Call::Checkpoint))
    }
    fn restore(&self, _: i32, _: &[GpuPair]) -> Result<(), DriverError> {
        Err(self.none(Call::Restore))
    }
    fn unlock(&self, _: i32) -> Result<(), DriverError> {
        Err(self.none(Call::Unlock))
    }
    fn restore_thread_id(&self, _: i32) -> Result<i32, DriverError> {
        Err(self.none(Call::GetRestoreThreadId))
    }
}
