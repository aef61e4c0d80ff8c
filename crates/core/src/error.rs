use gpusnap_cuda::DriverError;

/// Every way a gpusnap operation can end badly, each with its exit code
/// (see [`Error::exit_code`] and the README's table).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{pid} is not a valid process id")]
    BadPid { pid: i32 },
    #[error("no process {pid}")]
    NoProcess { pid: i32 },
    #[error("{tid} is a thread of {pid}; give the process id {pid}")]
    Thread { tid: i32, pid: i32 },
    #[error("process {pid} ({comm}) has exited and is a zombie")]
    Zombie { pid: i32, comm: String },
    #[error("process {pid} ({comm}) is stopped (state {state}); the driver hangs on stopped processes: send it SIGCONT (or detach the tracer) first")]
    Stopped { pid: i32, comm: String, state: char },
    #[error("permission denied on process {pid}: run gpusnap as root or with CAP_SYS_PTRACE")]
    Permission { pid: i32 },
    #[error("cannot read /proc/{pid}: {reason}")]
    Proc { pid: i32, reason: String },
    #[error("{path} is not a cgroup (no cgroup.procs)")]
    NoCgroup { path: String },
    #[error("process {pid} ({comm}) is in the frozen cgroup {cgroup} (a paused container, or a checkpoint in progress); the driver hangs on frozen processes: thaw it first (podman unpause)")]
    Frozen { pid: i32, comm: String, cgroup: String },
    #[error("container {name}: {reason}")]
    Container { name: String, reason: String },
    #[error(
        "pid {pid} now belongs to another program ({comm}); the process gpusnap suspended there is gone"
    )]
    Reused { pid: i32, comm: String },
    #[error("process {pid}: {reason}: gpusnap moves a checkpointed process's record only to the one process that can be it; its record is left where it is")]
    AmbiguousRecord { pid: i32, reason: String },
    #[error("process {pid} ({comm}) has no CUDA context")]
    NotCuda { pid: i32, comm: String },
    #[error("process {pid} is {state}; cannot {op} it")]
    WrongState { pid: i32, state: String, op: &'static str },
    #[error("process {pid} ({comm}) does not run with fast swap, so it cannot be parked (its memory would stay on the GPU); `gpusnap suspend {pid}` takes it off the GPU, and programs started with `gpusnap run --light --fast-swap` can be parked")]
    NoFastSwap { pid: i32, comm: String },
    #[error("process {pid}: fast swap could not park it: {reason}")]
    ParkFailed { pid: i32, reason: String },
    #[error("no footprint recorded for process {pid} (suspended outside gpusnap?); pass --footprint MIB to resume it")]
    NoFootprint { pid: i32 },
    #[error("not enough GPU memory to resume {pid}: {detail}")]
    NoMemory { pid: i32, detail: String },
    #[error("process {pid}: {source}")]
    Driver { pid: i32, source: DriverError },
    #[error("process {pid}: the driver reported success but NVML still shows {mib} MiB of device memory after {secs}s")]
    NotReleased { pid: i32, mib: u64, secs: u64 },
    #[error("process {pid} cannot be restored in place: {reason}")]
    Unrecoverable { pid: i32, reason: String },
    #[error("refusing to stop process {pid}: {reason}; --force kills it anyway")]
    StopRefused { pid: i32, reason: String },
    #[error("process {pid} did not exit after SIGKILL within {secs}s")]
    DidNotExit { pid: i32, secs: u64 },
    #[error("{0}")]
    Driverless(DriverError),
    #[error("device map: {0}")]
    BadMap(String),
    #[error("member {pid} of the group: {source}")]
    Member { pid: i32, source: Box<Error> },
    #[error(transparent)]
    Gpu(#[from] gpusnap_gpu::GpuError),
    #[error("state store {path}: {reason}")]
    Store { path: String, reason: String },
}

impl Error {
    /// What to do about it, where there is something to say beyond the message.
    pub fn hint(&self) -> Option<&'static str> {
        use gpusnap_cuda::ffi::{
            CUDA_ERROR_ILLEGAL_STATE, CUDA_ERROR_NOT_READY, CUDA_ERROR_OPERATING_SYSTEM,
        };
        match self {
            Self::Driver { source, .. } => match source.code() {
                Some(CUDA_ERROR_NOT_READY) => Some("queued GPU work did not drain within the lock timeout; the process keeps running: retry with a larger --lock-timeout"),
                Some(CUDA_ERROR_ILLEGAL_STATE) => Some("the process is not in the state this step needs (another tool may be driving it); see `gpusnap state`"),
                Some(CUDA_ERROR_OPERATING_SYSTEM) => Some("the driver could not act on the process (sandboxed, e.g. gVisor, or gone); see `gpusnap doctor`"),
                _ => None,
            },
            Self::NoMemory { .. } => Some("nothing was changed; the process stays suspended: free GPU memory, or retry with --wait SECS"),
            _ => None,
        }
    }

    /// 0 done; 1 failed; 2 bad usage or bad input; 3 refused, not enough GPU
    /// memory; 4 the driver failed; 5 cannot be restored in place; 11 park
    /// of a process without fast swap.
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::BadPid { .. }
            | Self::NoProcess { .. }
            | Self::Thread { .. }
            | Self::Zombie { .. }
            | Self::Stopped { .. }
            | Self::Permission { .. }
            | Self::Reused { .. }
            | Self::AmbiguousRecord { .. }
            | Self::NotCuda { .. }
            | Self::WrongState { .. }
            | Self::NoFootprint { .. }
            | Self::NoCgroup { .. }
            | Self::Container { .. }
            | Self::Frozen { .. } => 2,
            Self::NoMemory { .. } => 3,
            Self::Member { source, .. } => source.exit_code(),
            Self::BadMap(_) => 2,
            Self::Driver { .. } | Self::NotReleased { .. } => 4,
            Self::Unrecoverable { .. } => 5,
            Self::NoFastSwap { .. } => 11,
            Self::Proc { .. }
            | Self::ParkFailed { .. }
            | Self::StopRefused { .. }
            | Self::DidNotExit { .. }
            | Self::Driverless(_)
            | Self::Gpu(_)
            | Self::Store { .. } => 1,
        }
    }

    /// A short machine-readable kind for `--json` output.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::BadPid { .. } => "bad_pid",
            Self::NoProcess { .. } => "no_process",
            Self::Thread { .. } => "thread_id",
            Self::Zombie { .. } => "zombie",
            Self::Stopped { .. } => "stopped",
            Self::Permission { .. } => "permission",
            Self::Proc { .. } => "proc",
            Self::NoCgroup { .. } => "no_cgroup",
            Self::Container { .. } => "container",
            Self::Frozen { .. } => "frozen",
            Self::Reused { .. } => "pid_reused",
            Self::AmbiguousRecord { .. } => "ambiguous_record",
            Self::NotCuda { .. } => "not_cuda",
            Self::WrongState { .. } => "wrong_state",
            Self::NoFootprint { .. } => "no_footprint",
            Self::NoFastSwap { .. } => "no_fast_swap",
            Self::ParkFailed { .. } => "park_failed",
            Self::NoMemory { .. } => "no_memory",
            Self::Driver { .. } => "driver",
            Self::NotReleased { .. } => "not_released",
            Self::Unrecoverable { .. } => "unrecoverable",
            Self::StopRefused { .. } => "stop_refused",
            Self::DidNotExit { .. } => "did_not_exit",
            Self::Driverless(_) => "driver_missing",
            Self::Gpu(_) => "nvml",
            Self::Store { .. } => "store",
            Self::BadMap(_) => "bad_device_map",
            Self::Member { source, .. } => source.kind(),
        }
    }
}
