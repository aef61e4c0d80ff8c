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
    /// `cuDriverGetVersion`, e.g. 13000. Known at load, without waiting for
    /// the driver's initialisation.
    fn api_version(&self) -> i32;
    /// Waits until the driver has initialised (`cuInit`, which
    /// [`CudaDriver`] runs in the background) and says whether it could.
    /// Every other call waits for it too; this is for callers that must
    /// know before they act.
    fn ready(&self) -> Result<(), DriverError> {
        Ok(())
    }
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
    fn ready(&self) -> Result<(), DriverError> {
        (**self).ready()
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

/// The driver for callers that treat a driver that cannot start like none
/// at all ([`Absent`]), without waiting for its start-up at load: each call
/// waits for `cuInit` and, if it failed, answers as [`Absent`] does
/// (`api_version` 0 included). The guard uses it: `gpusnap wake` waits for
/// its guard to attach, which needs no driver call, so the guard's own
/// `cuInit` stays out of the wake's time.
#[derive(Debug)]
pub struct OrAbsent {
    driver: CudaDriver,
    absent: std::sync::OnceLock<Option<Absent>>,
}

impl OrAbsent {
    pub fn new(driver: CudaDriver) -> Self {
        Self { driver, absent: std::sync::OnceLock::new() }
    }

    /// `None` once the driver has started; `Some` if it could not.
    fn absent(&self) -> Option<&Absent> {
        self.absent
            .get_or_init(|| {
                self.driver.ready().err().map(|e| {
                    tracing::info!(
                        "the CUDA driver did not start ({e}); only processes without CUDA can be handled"
                    );
                    Absent { why: e.to_string() }
                })
            })
            .as_ref()
    }
}

impl CheckpointApi for OrAbsent {
    fn api_version(&self) -> i32 {
        match self.absent() {
            Some(a) => a.api_version(),
            None => self.driver.api_version(),
        }
    }
    fn get_state(&self, pid: i32) -> Result<ProcessState, DriverError> {
        match self.absent() {
            Some(a) => a.get_state(pid),
            None => self.driver.get_state(pid),
        }
    }
    fn lock(&self, pid: i32, timeout_ms: u32) -> Result<(), DriverError> {
        match self.absent() {
            Some(a) => a.lock(pid, timeout_ms),
            None => self.driver.lock(pid, timeout_ms),
        }
    }
    fn checkpoint(&self, pid: i32) -> Result<(), DriverError> {
        match self.absent() {
            Some(a) => a.checkpoint(pid),
            None => self.driver.checkpoint(pid),
        }
    }
    fn restore(&self, pid: i32, pairs: &[GpuPair]) -> Result<(), DriverError> {
        match self.absent() {
            Some(a) => a.restore(pid, pairs),
            None => self.driver.restore(pid, pairs),
        }
    }
    fn unlock(&self, pid: i32) -> Result<(), DriverError> {
        match self.absent() {
            Some(a) => a.unlock(pid),
            None => self.driver.unlock(pid),
        }
    }
    fn restore_thread_id(&self, pid: i32) -> Result<i32, DriverError> {
        match self.absent() {
            Some(a) => a.restore_thread_id(pid),
            None => self.driver.restore_thread_id(pid),
        }
    }
}
