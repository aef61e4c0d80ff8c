use crate::criu::CriuError;
use gpusnap_images::manifest::ImageError;
use gpusnap_images::sign::SignError;

/// A hibernate, wake or recover that ended badly: the process lifecycle's
/// own errors ([`gpusnap_core::Error`]), the image's, CRIU's, the page
/// server's, and what only a whole-tree dump or restore can meet.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Core(#[from] gpusnap_core::Error),
    #[error(transparent)]
    Images(#[from] gpusnap_images::Error),
    #[error(transparent)]
    Criu(#[from] CriuError),
    #[error("page server: {0}")]
    Pages(#[from] gpusnap_pages::PagesError),
    #[error("pid {pid} is held by another program ({comm}); the image needs it free: stop that program or wake elsewhere")]
    PidBusy { pid: i32, comm: String },
    #[error("process {pid} still maps {path}, the map file of a mapped wake, as its own memory (not the driver's host copy, which the driver's checkpoint replaces): CRIU would write an image that needs that file. Restart the process to hibernate it; wake its images with GPUSNAP_MAP=0 to avoid this")]
    MapStillMapped { pid: i32, path: String },
    #[error("process {pid} ({comm}) is in a session whose leader is outside its pid namespace, which CRIU cannot dump; start it in a session of its own (setsid, or `gpusnap run`)")]
    ForeignSession { pid: i32, comm: String },
    #[error("process {pid} ({comm}) died after CRIU restored it, before its CUDA state was back ({how}); the image is kept. A thread of it ran on memory the driver maps back only in its restore (seen with JAX and XLA_PYTHON_CLIENT_PREALLOCATE=false: docs/design/wake.md)")]
    DiedAfterRestore { pid: i32, comm: String, how: String },
    #[error("process {pid} ({comm}) from this image is still running")]
    StillRunning { pid: i32, comm: String },
    #[error("process {pid} ({comm}) uses CUDA, but gpusnap cannot load the driver: {why}")]
    CudaWithoutDriver { pid: i32, comm: String, why: String },
    #[error("this host cannot take image {image}: {why}")]
    Incompatible { image: String, why: String },
    #[error("member {pid} of the group: {source}")]
    Member { pid: i32, source: Box<Error> },
    #[error("image {image} of the group: {source}")]
    GroupImage { image: String, source: Box<Error> },
}

impl From<gpusnap_gpu::GpuError> for Error {
    fn from(e: gpusnap_gpu::GpuError) -> Self {
        Self::Core(e.into())
    }
}

impl gpusnap_core::group::GroupError for Error {
    fn member(pid: i32, e: Self) -> Self {
        Self::Member { pid, source: Box::new(e) }
    }
}

impl From<ImageError> for Error {
    fn from(e: ImageError) -> Self {
        Self::Images(e.into())
    }
}

impl From<SignError> for Error {
    fn from(e: SignError) -> Self {
        Self::Images(e.into())
    }
}

impl From<gpusnap_chunks::ChunkError> for Error {
    fn from(e: gpusnap_chunks::ChunkError) -> Self {
        Self::Images(e.into())
    }
}

impl Error {
    /// The lifecycle's error inside, if that is what this is.
    pub fn core(&self) -> Option<&gpusnap_core::Error> {
        match self {
            Self::Core(e) => Some(e),
            Self::Member { source, .. } | Self::GroupImage { source, .. } => source.core(),
            _ => None,
        }
    }

    /// What to do about it, where there is something to say beyond the message.
    pub fn hint(&self) -> Option<&'static str> {
        match self {
            Self::Core(e) => e.hint(),
            Self::Images(e) => e.hint(),
            _ => None,
        }
    }

    /// The exit code, as [`gpusnap_core::Error::exit_code`].
    pub fn exit_code(&self) -> i32 {
        match self {
            Self::Core(e) => e.exit_code(),
            Self::Images(e) => e.exit_code(),
            Self::Member { source, .. } | Self::GroupImage { source, .. } => source.exit_code(),
            Self::ForeignSession { .. } | Self::MapStillMapped { .. } | Self::Incompatible { .. } => 2,
            Self::Criu(_)
            | Self::Pages(_)
            | Self::PidBusy { .. }
            | Self::StillRunning { .. }
            | Self::DiedAfterRestore { .. }
            | Self::CudaWithoutDriver { .. } => 1,
        }
    }

    /// A short machine-readable kind for `--json` output.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Core(e) => e.kind(),
            Self::Images(e) => e.kind(),
            Self::Member { source, .. } | Self::GroupImage { source, .. } => source.kind(),
            Self::Criu(_) => "criu",
            Self::Pages(_) => "pages",
            Self::PidBusy { .. } => "pid_busy",
            Self::StillRunning { .. } => "still_running",
            Self::DiedAfterRestore { .. } => "died_after_restore",
            Self::ForeignSession { .. } => "foreign_session",
            Self::MapStillMapped { .. } => "map_still_mapped",
            Self::CudaWithoutDriver { .. } => "no_driver",
            Self::Incompatible { .. } => "incompatible",
        }
    }
}
