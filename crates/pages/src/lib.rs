//! gpusnap's lazy page server: it takes the place of `criu lazy-pages`.
//!
//! `criu restore --lazy-pages` restores a tree without the pages of its
//! anonymous private memory and hands every process's userfaultfd to
//! whoever listens on `lazy-pages.socket` in CRIU's work dir. CRIU's own
//! daemon then answers one 4 KiB fault at a time from one thread; this
//! server answers faults first and meanwhile fills everything else from
//! many threads, in address order, in large batches (UFFDIO_COPY without
//! waking, then one UFFDIO_WAKE per batch), so that the driver's restore,
//! which reads the process's memory in address order, runs while the image
//! streams in. See docs/design/wake.md.
//!
//! The protocol, from CRIU 4.2's criu/uffd.c: one unix stream connection;
//! per task a native-endian i32 pid, then one byte with the uffd as
//! SCM_RIGHTS (a zombie: the negated pid and no fd); when the whole restore
//! is done, the u32 0x52535446. The restorer registers the lazy areas of
//! each process (MISSING) before that.

mod fill;
mod image;
pub mod keeper;
pub mod mapped;
mod mmstate;
mod options;
mod pacer;
mod pieces;
pub mod prio;
mod report;
mod serve;
mod shared;
mod source;
mod stats;
pub mod sys;

pub use image::eager_ranges;
pub use image::{
    layout, lazy_bytes, lazy_iovs, Iov, Run, Vma, PE_LAZY, PE_PRESENT, VMA_ANON_PRIVATE, VMA_FILE_PRIVATE,
};
pub use options::{
    flag_setting, parse_flag, HeadStart, Options, ENV_AHEAD, ENV_BATCH, ENV_BIG_FIRST, ENV_FAULT_BATCH,
    ENV_HEAD_START, ENV_IDLE, ENV_NICE, ENV_PACE, ENV_PACE_LEAD, ENV_PACE_MIN, ENV_PACE_START, ENV_RATE,
    ENV_THREADS, ENV_TRACE, ENV_WAKE_CHUNK,
};
pub use pacer::{PaceConfig, PaceStats};
pub use report::Report;
pub use serve::{PaceGuard, Rescuer, Server};
pub use source::{DirSource, Mapped, PageSource, PagesFile};
pub use stats::{dump_stats, DumpStats};

#[derive(Debug, thiserror::Error)]
pub enum PagesError {
    #[error("image {path}: {why}")]
    Image { path: String, why: String },
    #[error("lazy-pages socket {path}: {err}")]
    Socket { path: String, err: String },
    #[error("the restore hung up before it was done")]
    HungUp,
    #[error("reading pages of {pid} at {off:#x}: {err}")]
    Read { pid: i32, off: u64, err: String },
    #[error("filling memory of {pid} at {addr:#x}: {err}")]
    Fill { pid: i32, addr: u64, err: String },
    #[error("failed on purpose after {0} bytes (GPUSNAP_PAGES_FAIL_AFTER)")]
    Injected(u64),
    #[error("stopped before every page was in place")]
    Aborted,
    #[error("{0}")]
    Stopped(String),
    #[error("{name}={value}: {why}")]
    Setting { name: String, value: String, why: String },
}

/// What this kernel offers for lazy restores.
#[derive(Debug, Clone)]
pub struct Support {
    /// A userfaultfd can be opened here (by this caller).
    pub userfaultfd: bool,
    /// FORK, REMAP, REMOVE and UNMAP events: needed for CRIU's lazy restore.
    pub noncooperative: bool,
    /// `vm.unprivileged_userfaultfd` (None: not readable).
    pub unprivileged: Option<bool>,
    /// Why lazy restores cannot be used, when they cannot.
    pub why_not: Option<String>,
}

/// Probes the kernel the way CRIU does before a lazy restore.
pub fn support() -> Support {
    let unprivileged =
        std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd").ok().map(|s| s.trim() == "1");
    match sys::open(sys::NONCOOP) {
        Err(e) => Support {
            userfaultfd: false,
            noncooperative: false,
            unprivileged,
            why_not: Some(format!("userfaultfd: {e}")),
        },
        Ok((_, got)) => {
            let nc = got & sys::NONCOOP == sys::NONCOOP;
            Support {
                userfaultfd: true,
                noncooperative: nc,
                unprivileged,
                why_not: (!nc).then(|| "the kernel's userfaultfd has no fork/remap/unmap events".to_string()),
            }
        }
    }
}
