//! What a hibernate and a wake are asked to do, and what they report.

use serde::Serialize;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct HibernateOptions {
    pub name: Option<String>,
    pub leave_running: bool,
    pub lock_timeout_ms: u32,
    /// Wait for the image to reach the disk before the tree is ended.
    pub durable: bool,
    /// Raise `fs.pipe-max-size` for the dump where gpusnap lacks
    /// CAP_SYS_RESOURCE (`--big-pipes`, [`gpusnap_core::hostknob::BigPipes`]; also
    /// `GPUSNAP_DUMP_BIG_PIPES=1`).
    pub big_pipes: bool,
    /// Build each image's map file once it is committed (`--map`, as
    /// `gpusnap images map`; [`gpusnap_images::mapfile`]): a warm wake then maps its
    /// CUDA processes' host copies instead of filling them. A map file that
    /// cannot be built is a notice; the image stands.
    pub map: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct HibernateReport {
    pub image: String,
    pub path: PathBuf,
    pub root_pid: i32,
    pub processes: Vec<i32>,
    pub cuda: Vec<i32>,
    pub image_bytes: u64,
    pub left_running: bool,
    pub suspend_ms: u64,
    pub dump_ms: u64,
    pub write_ms: u64,
    pub total_ms: u64,
    /// CRIU's own account of its dump (its `stats-dump` file): frozen, memdump
    /// (draining + writing), memwrite (writing), pages; None when CRIU
    /// wrote none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub criu_stats: Option<gpusnap_pages::DumpStats>,
    /// The map file built after it (`--map`); None without one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub map: Option<gpusnap_images::mapfile::Built>,
    /// Time of each stage in ms: suspend, dump (CRIU as a whole), commit
    /// (gpusnap's checksums, chunking, manifest, flush), and inside dump
    /// CRIU's own: frozen, drain (the parasite draining pages into pipes)
    /// and memwrite (the pipes written to the image); 0 without CRIU's
    /// statistics.
    pub stages: HibernateStages,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct HibernateStages {
    pub suspend: u64,
    pub dump: u64,
    pub commit: u64,
    pub criu_frozen: u64,
    pub criu_drain: u64,
    pub criu_memwrite: u64,
    /// Chunking while CRIU dumps (see [`crate::follow`]): bytes of the
    /// pages files chunked before CRIU exited, and after (their tails);
    /// follow_finish: ms from CRIU's exit until every chunk was staged
    /// (inside commit); follow_punched: bytes dropped from the pages files
    /// once chunked. All 0 when following is off (`GPUSNAP_FOLLOW=0`).
    pub follow_overlapped_bytes: u64,
    pub follow_after_bytes: u64,
    pub follow_finish: u64,
    pub follow_punched_bytes: u64,
    /// Through FIFOs: where the receiver's threads spent the dump
    /// ([`crate::follow::FifoStats`]); absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fifo: Option<crate::follow::FifoStats>,
    /// Where CRIU wrote its images: "tmpfs" (the pages files never reach
    /// the disk, [`crate::dumpdir`]) or "disk".
    pub dump_dir: &'static str,
}

#[derive(Debug, Clone)]
pub struct WakeOptions {
    /// How long to wait for GPU memory and for the image's pids to come free.
    pub wait: Duration,
    pub margin_bytes: u64,
    /// Also resume these CUDA processes, even if they were suspended when
    /// the image was taken (recover uses this).
    pub force_resume: Vec<i32>,
    /// Restore onto other GPUs: (old, new) as indices of this host or UUIDs.
    pub device_map: Vec<(String, String)>,
    /// `recover` a process that is not known to be stuck (a rollback).
    pub force: bool,
    /// Restore every page before the tree runs (CRIU alone), not lazily
    /// through gpusnap's page server.
    pub eager: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct WakeReport {
    pub image: String,
    pub root_pid: i32,
    pub processes: Vec<i32>,
    /// CUDA processes resumed onto the GPU.
    pub resumed: Vec<i32>,
    pub verify_ms: u64,
    pub waited_ms: u64,
    pub criu_ms: u64,
    pub restore_ms: u64,
    pub total_ms: u64,
    /// Memory filled by gpusnap's page server while the tree ran (false:
    /// CRIU restored every page before the tree ran).
    pub lazy: bool,
    /// Bytes the page server put in place.
    pub pages_bytes: u64,
    /// Bytes mapped from the image's map file instead (gpusnap_images::mapfile).
    pub mapped_bytes: u64,
    /// Why a lazy wake fell back to an eager one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub notice: Option<String>,
    /// Time of each stage in ms: verify, waited, criu, head_start (the
    /// page server's lead before the driver starts; 0 unless asked for),
    /// driver (the CUDA restores) and pages (from CRIU's return until the
    /// last page was in place; it overlaps head_start and driver). A lazy
    /// wake of CUDA processes checks the image's chunks in the background
    /// (verify is then the manifest and small files only): verify_background
    /// is what that took, verify_wait what the driver's restore waited for
    /// it (the rest overlapped CRIU and the page server).
    pub stages: Stages,
    /// Bytes of the processes' own files (libraries, ...) the wake asked
    /// the kernel to read ahead, as they were in memory at the hibernate
    /// (`GPUSNAP_FILE_PAGES=1`, see `gpusnap_images::workingset`; read on a thread,
    /// not waited for); 0 when off.
    pub file_pages_bytes: u64,
    /// What the page server did (lazy wakes): faults, bytes by faults and
    /// by the background fill, timings, the settings (docs/design/wake.md).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pages: Option<gpusnap_pages::Report>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Stages {
    pub verify: u64,
    pub waited: u64,
    pub criu: u64,
    pub head_start: u64,
    pub driver: u64,
    pub pages: u64,
    pub verify_background: u64,
    pub verify_wait: u64,
    /// The rest of the wake, in order: the host's checks after the verify,
    /// the journal of the restored processes after CRIU, the wait from the
    /// head start's end to the driver's first restore, and the end after
    /// the driver's last unlock. With the stages above (less `pages`,
    /// `verify_background` and `verify_wait`, which overlap them: the wait
    /// for the verify falls in `driver`, or with GPUSNAP_VERIFY_FIRST=1 in
    /// `driver_start`) they make up `total_ms` but for what is spent
    /// between them.
    pub check: u64,
    pub journal: u64,
    pub driver_start: u64,
    pub finish: u64,
    /// The check of the map file against the image's chunks before CRIU
    /// (part of `criu`; 0 without a map file).
    pub map_check: u64,
    /// The hash of the map file's bytes in it (part of `map_check`).
    pub map_hash: u64,
}
