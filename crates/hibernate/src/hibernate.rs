//! hibernate, wake and recover: whole process trees to an image and back.
//!
//! The order is chosen so that nothing is lost at any step:
//! 1. every CUDA process of the tree is suspended (all or none);
//! 2. CRIU dumps the tree into a temporary directory and leaves it stopped
//!    (SIGSTOP: it cannot make the image stale, and can still go on);
//! 3. the image is checksummed, its manifest written, and renamed into place;
//! 4. only then is the tree ended (its CUDA state is already off the GPU,
//!    so the kill is safe). With `leave_running` the tree runs on throughout
//!    and its CUDA processes are resumed as they were.
//!
//! A failure at 1-3 resumes what was suspended and removes the partial image.

use crate::criu::{Criu, DumpOptions};
use crate::Error;
use gpusnap_core::engine::{Engine, ResumeOptions, StopOptions};
use gpusnap_core::progress::{observe, Progress};
use gpusnap_core::store::now_ms;
use gpusnap_core::target::{self, Target};
use gpusnap_core::tree::process_tree;
use gpusnap_core::Error as CoreError;
use gpusnap_cuda::{CheckpointApi, ProcessState};
use gpusnap_gpu::GpuInventory;
use gpusnap_images::image::{GpuDesc, ImageStore, Manifest, ProcDesc, FORMAT, MAGIC};
use procfs::process::Process;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

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

/// One image of a wake, verified and checked, not yet restored.
struct WakePlan {
    name: String,
    started: Instant,
    dir: PathBuf,
    m: Manifest,
    /// The CUDA processes to put back on the GPU, in the image's order.
    resume: Vec<ProcDesc>,
    /// What each of them needs, per GPU it goes to.
    fps: Vec<BTreeMap<String, u64>>,
    pairs: Vec<gpusnap_cuda::GpuPair>,
    verify_ms: u64,
    /// What the host's checks took after the verify (the driver, the GPUs,
    /// the footprints where they go).
    check_ms: u64,
    /// Every chunk of the image was checked in full by the verify: the
    /// page server need not hash them again.
    chunks_checked: bool,
    /// The full check of the chunks is left to the restore: in the
    /// background of a lazy wake, finished before any unlock (a CUDA
    /// image; see [`gpusnap_images::chunksrc::Workdir::start_verify`]).
    verify_deferred: bool,
}

/// An error of one image of a group wake, named by the image (alone, the
/// error itself).
fn member(names: &[String], name: &str, e: Error) -> Error {
    if names.len() <= 1 {
        return e;
    }
    Error::GroupImage { image: name.to_string(), source: Box::new(e) }
}

/// A tree dumped and its image committed, not yet ended (see
/// [`Engine::hibernate_group`]).
struct Dumped {
    report: HibernateReport,
    started: Instant,
    pids: Vec<Target>,
    cuda_members: Vec<Target>,
    suspended: Vec<i32>,
    journal: Vec<(i64, Target)>,
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
    /// by the background fill, timings, the settings (docs/pages.md).
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

/// An image of CUDA processes on a host whose driver is missing or could not start.
fn no_driver(m: &Manifest) -> Error {
    Error::Incompatible {
        image: m.name.clone(),
        why: "it holds CUDA processes and this host has no CUDA driver".into(),
    }
}

/// Why a lazy wake's pages failed: a chunk that failed its check (the
/// image refused), else the page server's own error.
fn pages_failure(
    wd: Option<&gpusnap_images::chunksrc::Workdir>,
    srv: Option<&gpusnap_pages::Server>,
) -> Error {
    match (wd.and_then(|wd| wd.bad()), srv) {
        (Some(bad), _) => bad.into(),
        (None, Some(srv)) => Error::Pages(srv.wait().err().unwrap_or(gpusnap_pages::PagesError::Aborted)),
        (None, None) => Error::Pages(gpusnap_pages::PagesError::Aborted),
    }
}

/// What restoring one admitted image did.
struct Woken {
    root: i32,
    criu_ms: u64,
    head_ms: u64,
    /// The journal of the restored processes, after CRIU.
    journal_ms: u64,
    /// From the head start's end to the driver's first restore: the
    /// driver's start-up (begun in the background), the verify's hand-off.
    driver_start_ms: u64,
    driver_ms: u64,
    /// From the driver's last unlock to the wake's end: the last pages,
    /// the page server's report.
    finish_ms: u64,
    pages_ms: u64,
    pages_bytes: u64,
    mapped: gpusnap_images::mapfile::Mapped,
    /// Of the processes' own files, asked to be read ahead (0: off).
    file_pages_bytes: u64,
    lazy: bool,
    verify: gpusnap_images::chunksrc::VerifyTimes,
    notice: Option<String>,
    report: Option<gpusnap_pages::Report>,
}

/// `GPUSNAP_VERIFY_FIRST=1`: a lazy CUDA wake's driver restores wait for
/// the whole image's verify (the order before the rescue existed).
pub const VERIFY_FIRST_ENV: &str = "GPUSNAP_VERIFY_FIRST";

fn verify_first() -> bool {
    std::env::var(VERIFY_FIRST_ENV).is_ok_and(|v| v == "1")
}

fn ms(since: Instant) -> u64 {
    since.elapsed().as_millis() as u64
}

fn dir_bytes(p: &Path) -> u64 {
    std::fs::read_dir(p)
        .map(|rd| rd.filter_map(|e| e.ok()?.metadata().ok()).map(|m| m.len()).sum())
        .unwrap_or(0)
}

/// Whether `--big-pipes` was given or
/// [`gpusnap_core::hostknob::BIG_PIPES_ENV`] is 1.
fn big_pipes_wanted(flag: bool) -> bool {
    use gpusnap_core::hostknob::BIG_PIPES_ENV;
    flag || gpusnap_pages::flag_setting(BIG_PIPES_ENV, std::env::var(BIG_PIPES_ENV).ok(), false)
}

fn hostname() -> String {
    nix::unistd::gethostname().map(|h| h.to_string_lossy().into_owned()).unwrap_or_else(|_| "unknown".into())
}

/// Hibernate, wake and recover, on the lifecycle engine: whole process
/// trees to an image and back.
pub trait Hibernate {
    /// Hibernates the tree rooted at `root` (or, with `leave_running`,
    /// snapshots it): every CUDA process suspended (all or none), the tree
    /// dumped by CRIU, the image checksummed and renamed into place, and only
    /// then the tree ended. A failure at any step puts everything back.
    fn hibernate(
        &mut self,
        criu: &Criu,
        images: &ImageStore,
        root: i32,
        opts: &HibernateOptions,
    ) -> Result<HibernateReport, Error>;

    /// Hibernates several trees (a group: the roots of the processes of a
    /// cgroup, say), one image each (`NAME-ROOT` when a name is given), all
    /// or nothing: every tree is dumped and its image written before any
    /// tree is ended; if one fails, the others are put back as they were
    /// and their images removed.
    fn hibernate_group(
        &mut self,
        criu: &Criu,
        images: &ImageStore,
        roots: &[i32],
        opts: &HibernateOptions,
    ) -> Result<Vec<HibernateReport>, Error>;

    fn wake(
        &mut self,
        criu: &Criu,
        images: &ImageStore,
        name: &str,
        opts: &WakeOptions,
    ) -> Result<WakeReport, Error>;

    /// Wakes several images (the trees of a hibernated group), all or
    /// nothing: every image is verified and checked against this host, and
    /// their processes admitted together, before any is restored; if one
    /// fails, the trees already woken are ended safely (suspended first) and
    /// every image stays as it was, for a retry.
    fn wake_group(
        &mut self,
        criu: &Criu,
        images: &ImageStore,
        names: &[String],
        opts: &WakeOptions,
    ) -> Result<Vec<WakeReport>, Error>;

    /// A process stuck after a failed restore, brought back from its newest
    /// image: the stuck tree is ended (it holds no GPU memory) and woken.
    fn recover(
        &mut self,
        criu: &Criu,
        images: &ImageStore,
        pid: i32,
        opts: &WakeOptions,
    ) -> Result<WakeReport, Error>;

    /// Reconciles hibernates that a gpusnap killed mid-way left open: if
    /// their image was committed (signed and complete), the hibernate is
    /// finished (the tree, stopped by CRIU and off the GPU, is ended);
    /// otherwise the tree is continued and the CUDA processes it suspended
    /// are resumed. Only processes still the ones journaled (pid and start
    /// time) are touched. Temporary images are removed by [`ImageStore::gc`].
    fn reconcile_hibernates(&mut self, images: &ImageStore) -> Result<Vec<Interrupted>, Error>;
}

/// The steps of [`Hibernate`], on the same engine.
trait Steps {
    /// Classifies the tree's processes: CUDA (with driver state) or plain.
    /// A member other than the root that is gone (or a zombie) by the time it
    /// is looked at is dropped from `tree`: a tree that starts and ends
    /// short-lived children loses some between the walk and now.
    fn cuda_members(&self, tree: &mut Vec<(i32, i32)>) -> Result<Vec<(Target, Option<ProcessState>)>, Error>;

    /// Builds the map file of a committed image (`--map`). The image and
    /// the hibernate stand whatever happens here: a failure is a notice.
    fn map_after(&self, images: &ImageStore, r: &mut HibernateReport);

    /// Steps 1-3 of a hibernate: suspended, dumped, image committed; the
    /// tree is left stopped (or running) for [`Self::finish_hibernate`] or
    /// [`Self::abandon_hibernate`].
    fn dump_tree(
        &mut self,
        criu: &Criu,
        images: &ImageStore,
        root: i32,
        opts: &HibernateOptions,
    ) -> Result<Dumped, Error>;

    /// Closes a hibernate's journal entries; a store error here is logged
    /// (what they describe is already done or undone).
    fn close_journal(&mut self, journal: &[(i64, Target)], ok: bool, detail: &str);

    /// Step 4: the image is safe: end the tree, or put it back as it was.
    fn finish_hibernate(&mut self, d: Dumped, opts: &HibernateOptions) -> Result<HibernateReport, Error>;

    /// Undoes steps 1-3 for a tree of a group whose other member failed:
    /// the tree runs on as it was, its image is removed.
    fn abandon_hibernate(&mut self, d: Dumped, images: &ImageStore, opts: &HibernateOptions);

    /// Everything about waking one image that can be decided before anything
    /// is restored: the image verified (manifest, every checksum), this host
    /// checked (driver, GPUs), the CUDA processes to put back and the memory
    /// each needs where it goes.
    fn plan_wake(
        &mut self,
        images: &ImageStore,
        name: &str,
        opts: &WakeOptions,
        group: bool,
    ) -> Result<WakePlan, Error>;

    #[allow(clippy::too_many_arguments)]
    fn wake_admitted(
        &mut self,
        criu: &Criu,
        state_dir: &Path,
        plan: &WakePlan,
        resume: &[&ProcDesc],
        eager: bool,
    ) -> Result<Woken, Error>;

    /// The CUDA processes of a rescued wake (crate::rescue): those the
    /// driver's restore left locked are checkpointed again, then the whole
    /// tree is killed while its threads are still stopped.
    fn end_rescued(&mut self, m: &Manifest, resume: &[&ProcDesc]) -> Vec<Target>;

    /// Ends restored processes of a wake that failed, safely: not forced, so
    /// a process already back on the GPU is suspended before it is killed,
    /// or left running if that fails.
    fn end_woken(&mut self, pids: impl Iterator<Item = i32>);

    /// Is this host's driver able to restore the image's CUDA processes?
    fn check_host_driver(&self, m: &Manifest) -> Result<(), Error>;

    /// Can this host take the image's CUDA processes on the GPUs they had?
    fn check_host(&self, m: &Manifest) -> Result<(), Error>;
}

impl<A: CheckpointApi, G: GpuInventory> Hibernate for Engine<A, G> {
    fn hibernate(
        &mut self,
        criu: &Criu,
        images: &ImageStore,
        root: i32,
        opts: &HibernateOptions,
    ) -> Result<HibernateReport, Error> {
        let d = self.dump_tree(criu, images, root, opts)?;
        let mut r = self.finish_hibernate(d, opts)?;
        if opts.map {
            self.map_after(images, &mut r);
        }
        Ok(r)
    }

    fn hibernate_group(
        &mut self,
        criu: &Criu,
        images: &ImageStore,
        roots: &[i32],
        opts: &HibernateOptions,
    ) -> Result<Vec<HibernateReport>, Error> {
        if roots.len() == 1 {
            return self.hibernate(criu, images, roots[0], opts).map(|r| vec![r]);
        }
        let mut dumped: Vec<Dumped> = Vec::new();
        for &root in roots {
            let o =
                HibernateOptions { name: opts.name.as_ref().map(|n| format!("{n}-{root}")), ..opts.clone() };
            match self.dump_tree(criu, images, root, &o) {
                Ok(d) => dumped.push(d),
                Err(e) => {
                    for d in dumped.into_iter().rev() {
                        self.abandon_hibernate(d, images, opts);
                    }
                    return Err(Error::Member { pid: root, source: Box::new(e) });
                }
            }
        }
        // Every image is safe by now: a failure here is one tree's, with
        // nothing to put back.
        let results: Vec<_> =
            dumped.into_iter().map(|d| (d.report.root_pid, self.finish_hibernate(d, opts))).collect();
        let mut reports = Self::fail_group(results, |_| {})?;
        if opts.map {
            for r in &mut reports {
                self.map_after(images, r);
            }
        }
        Ok(reports)
    }

    fn wake(
        &mut self,
        criu: &Criu,
        images: &ImageStore,
        name: &str,
        opts: &WakeOptions,
    ) -> Result<WakeReport, Error> {
        let names = [name.to_string()];
        let mut r = self.wake_group(criu, images, &names, opts)?;
        Ok(r.remove(0))
    }

    fn wake_group(
        &mut self,
        criu: &Criu,
        images: &ImageStore,
        names: &[String],
        opts: &WakeOptions,
    ) -> Result<Vec<WakeReport>, Error> {
        let mut plans = Vec::new();
        for name in names {
            let plan =
                self.plan_wake(images, name, opts, names.len() > 1).map_err(|e| member(names, name, e))?;
            // An image from another host may come from a newer CRIU, whose
            // image files an older one may misread.
            if crate::criu::newer_version(&plan.m.criu_version, &criu.version) {
                let e = Error::Incompatible {
                    image: plan.m.name.clone(),
                    why: format!(
                        "it was dumped by CRIU {}, this host's CRIU {} is older (install CRIU {} or newer: scripts/install-criu.sh)",
                        plan.m.criu_version, criu.version, plan.m.criu_version
                    ),
                };
                return Err(member(names, name, e));
            }
            plans.push(plan);
        }
        // The images' pids must be free: a dying old process may still hold one.
        let t_wait = Instant::now();
        for plan in &plans {
            for p in &plan.m.processes {
                wait_pid_free(p, opts.wait.max(Duration::from_secs(10)))
                    .map_err(|e| member(names, &plan.name, e))?;
            }
        }
        let mut need: BTreeMap<String, u64> = BTreeMap::new();
        for plan in &plans {
            for fp in &plan.fps {
                for (u, b) in fp {
                    let e = need.entry(u.clone()).or_insert(0u64);
                    *e = e.saturating_add(*b);
                }
            }
        }
        let reservation = if need.is_empty() {
            Vec::new()
        } else {
            // The images' processes do not exist yet: nothing to journal on.
            let left = opts.wait.saturating_sub(t_wait.elapsed());
            let first = plans[0].m.root_pid;
            self.admit_waiting(first, None, &need, opts.margin_bytes, left)?.0
        };
        let waited_ms = ms(t_wait);

        let mut out: Vec<WakeReport> = Vec::new();
        let mut failed = None;
        for plan in &plans {
            let resume: Vec<&ProcDesc> = plan.resume.iter().collect();
            match self.wake_admitted(criu, images.state_dir(), plan, &resume, opts.eager) {
                Ok(w) => out.push(WakeReport {
                    image: plan.name.clone(),
                    root_pid: w.root,
                    processes: plan.m.processes.iter().map(|p| p.pid).collect(),
                    resumed: plan.resume.iter().map(|p| p.pid).collect(),
                    // The verify on the wake's critical path: before the
                    // restore, and the driver's wait for its background part.
                    verify_ms: plan.verify_ms + w.verify.wait_ms,
                    waited_ms,
                    criu_ms: w.criu_ms,
                    restore_ms: w.driver_ms,
                    total_ms: ms(plan.started),
                    lazy: w.lazy,
                    pages_bytes: w.pages_bytes,
                    mapped_bytes: w.mapped.bytes,
                    file_pages_bytes: w.file_pages_bytes,
                    notice: w.notice,
                    stages: Stages {
                        verify: plan.verify_ms,
                        waited: waited_ms,
                        criu: w.criu_ms,
                        head_start: w.head_ms,
                        driver: w.driver_ms,
                        pages: w.pages_ms,
                        verify_background: w.verify.verify_ms,
                        verify_wait: w.verify.wait_ms,
                        check: plan.check_ms,
                        journal: w.journal_ms,
                        driver_start: w.driver_start_ms,
                        finish: w.finish_ms,
                        map_check: w.mapped.check_ms,
                        map_hash: w.mapped.hash_ms,
                    },
                    pages: w.report,
                }),
                Err(e) => {
                    failed = Some(member(names, &plan.name, e));
                    break;
                }
            }
        }
        // Best effort: a reservation of a gpusnap that exits is void anyway,
        // and a store error must not skip the undo below.
        if let Err(e) = self.store_mut().release(&reservation) {
            tracing::warn!("could not release the reservation: {e}");
        }
        if let Some(err) = failed {
            // The images are untouched; the trees woken before are ended so
            // that the whole group can be woken again.
            self.end_woken(out.iter().rev().flat_map(|r| r.processes.iter().rev().copied()));
            return Err(err);
        }
        Ok(out)
    }

    fn recover(
        &mut self,
        criu: &Criu,
        images: &ImageStore,
        pid: i32,
        opts: &WakeOptions,
    ) -> Result<WakeReport, Error> {
        let t = target::resolve(pid)?;
        let stuck = self.store().get(&t)?.is_some_and(|r| r.unrecoverable.is_some());
        if !stuck && !opts.force {
            return Err(CoreError::WrongState {
                pid,
                state:
                    "not stuck (use `gpusnap resume`; `recover --force` rolls it back to its image anyway)"
                        .into(),
                op: "recover",
            }
            .into());
        }
        // Only a signed image of the store, by its directory's name: a
        // manifest's own claims (its name, its processes) count only once
        // its signature says gpusnap wrote it.
        let Some((image, m)) = images.find_for(pid, t.start_time) else {
            return Err(CoreError::Unrecoverable {
                pid,
                reason: "no image of it exists (take one with `gpusnap snapshot` while it is suspended)"
                    .into(),
            }
            .into());
        };
        // Everything of that tree still alive must go, and none of it may hold GPU memory.
        let alive: Vec<Target> = m
            .processes
            .iter()
            .filter_map(|p| target::resolve(p.pid).ok().filter(|t| t.start_time == p.start_time))
            .collect();
        for a in &alive {
            if self.gpus().usage_of(a.pid as u32)?.iter().any(|u| u.bytes.unwrap_or(1) > 0) {
                return Err(CoreError::StopRefused {
                    pid: a.pid,
                    reason: "it still holds GPU memory, so it is not stuck: use `gpusnap resume`".into(),
                }
                .into());
            }
        }
        for a in &alive {
            self.store_mut().note(a, "recover", Some("stopped"), &format!("ended to wake image {image}"))?;
        }
        kill_tree(&alive)?;
        let mut o = opts.clone();
        o.force_resume.push(pid);
        self.wake(criu, images, &image, &o)
    }

    fn reconcile_hibernates(&mut self, images: &ImageStore) -> Result<Vec<Interrupted>, Error> {
        let open = self.store().open_entries("hibernate")?;
        type Entries = Vec<(i64, Target, String)>;
        let mut by_image: Vec<(String, Entries)> = Vec::new();
        for e in open {
            let image = detail_field(&e.2, "image").unwrap_or("?").to_string();
            match by_image.iter_mut().find(|(i, _)| *i == image) {
                Some((_, v)) => v.push(e),
                None => by_image.push((image, vec![e])),
            }
        }
        let mut out = Vec::new();
        for (image, entries) in by_image {
            let alive: Entries = entries
                .iter()
                .filter(|(_, t, _)| target::resolve(t.pid).is_ok_and(|now| now.start_time == t.start_time))
                .cloned()
                .collect();
            let stopping = entries.iter().any(|(_, _, d)| detail_field(d, "stop") == Some("1"));
            // Complete: committed, signed, and holding these very processes
            // (an image of the same name taken since is not this one).
            let complete = if gpusnap_images::image::valid_name(&image) {
                images.manifest(&image).ok().map(|(_, m)| m).filter(|m| {
                    entries.iter().all(|(_, t, _)| {
                        m.processes.iter().any(|p| p.pid == t.pid && p.start_time == t.start_time)
                    })
                })
            } else {
                None
            };
            let finish = stopping && complete.is_some();
            tracing::warn!(image, finish, "reconciling a hibernate interrupted by a gpusnap that died");
            if let (true, Some(m)) = (finish, &complete) {
                // Every process of the tree (children born during the dump
                // too) is in the image, which is safe: end those still the
                // ones it holds.
                let ts: Vec<Target> = m
                    .processes
                    .iter()
                    .filter_map(|p| target::resolve(p.pid).ok().filter(|t| t.start_time == p.start_time))
                    .collect();
                kill_tree(&ts)?;
            } else {
                // CRIU stopped the whole tree, children born during the dump
                // (not journaled) included.
                let mut ts: Vec<Target> = Vec::new();
                for (_, t, _) in &alive {
                    for (p, _) in process_tree(t.pid) {
                        if let Ok(k) = target::resolve(p) {
                            if !ts.iter().any(|x| x.pid == k.pid) {
                                ts.push(k);
                            }
                        }
                    }
                }
                continue_tree(&ts);
                for (_, t, d) in &alive {
                    if detail_field(d, "resume") != Some("1") {
                        continue;
                    }
                    // SIGCONT is seen at once by the kernel, but wait for it:
                    // the driver hangs on a stopped process.
                    let end = Instant::now() + Duration::from_secs(10);
                    while target::resolve_callable(t.pid)
                        .is_err_and(|e| matches!(e, CoreError::Stopped { .. }))
                        && Instant::now() < end
                    {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    let state = target::resolve_callable(t.pid).and_then(|t| self.driver_state(&t));
                    if matches!(state, Ok(ProcessState::Checkpointed | ProcessState::Locked)) {
                        let opts = ResumeOptions { wait: Duration::from_secs(30), ..Default::default() };
                        if let Err(e) = self.resume(t.pid, &opts) {
                            tracing::error!(
                                pid = t.pid,
                                "could not resume after an interrupted hibernate: {e}"
                            );
                        }
                    }
                }
            }
            let outcome = if finish { "finished" } else { "resumed" };
            for (id, t, _) in &entries {
                self.store_mut().close(*id, t, "hibernate", finish, &format!("reconciled: {outcome}"))?;
            }
            out.push(Interrupted {
                image,
                pids: entries.iter().map(|(_, t, _)| t.pid).collect(),
                outcome: outcome.into(),
            });
        }
        Ok(out)
    }
}

impl<A: CheckpointApi, G: GpuInventory> Steps for Engine<A, G> {
    fn cuda_members(&self, tree: &mut Vec<(i32, i32)>) -> Result<Vec<(Target, Option<ProcessState>)>, Error> {
        let driverless = self.api_version() == 0;
        let mapping: std::collections::HashSet<i32> = if driverless {
            target::processes_mapping_libcuda().into_iter().collect()
        } else {
            Default::default()
        };
        let root = tree.first().map(|(p, _)| *p);
        let mut out = Vec::new();
        let mut gone = Vec::new();
        for &(pid, _) in tree.iter() {
            let t = match target::resolve_callable(pid) {
                Ok(t) => t,
                Err(CoreError::NoProcess { .. } | CoreError::Zombie { .. }) if Some(pid) != root => {
                    gone.push(pid);
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            if driverless {
                if mapping.contains(&pid) {
                    return Err(Error::CudaWithoutDriver {
                        pid,
                        comm: t.comm,
                        why: "libcuda.so.1 could not be loaded".into(),
                    });
                }
                out.push((t, None));
                continue;
            }
            match self.driver_state(&t) {
                Ok(s) => out.push((t, Some(s))),
                Err(CoreError::NotCuda { .. }) => out.push((t, None)),
                Err(_) if Some(pid) != root && !target::is_alive(&t) => gone.push(pid),
                Err(e) => return Err(Error::Member { pid, source: Box::new(e.into()) }),
            }
        }
        tree.retain(|(p, _)| !gone.contains(p));
        Ok(out)
    }

    fn map_after(&self, images: &ImageStore, r: &mut HibernateReport) {
        let built = images.manifest(&r.image).and_then(|(dir, m)| {
            gpusnap_images::mapfile::build(images.state_dir(), &r.image, &dir, &m, self.progress())
        });
        match built {
            Ok(Some(b)) => r.map = Some(b),
            Ok(None) => eprintln!(
                "gpusnap: notice: image {}: no region to map (no large memory of a CUDA process)",
                r.image
            ),
            Err(e) => eprintln!(
                "gpusnap: notice: image {}: its map file was not built ({e}); a wake fills its memory",
                r.image
            ),
        }
    }

    fn dump_tree(
        &mut self,
        criu: &Criu,
        images: &ImageStore,
        root: i32,
        opts: &HibernateOptions,
    ) -> Result<Dumped, Error> {
        let started = Instant::now();
        let root_t = target::resolve_callable(root)?;
        // How new chunks will be encoded, read (and a bad value said) now,
        // not at the first new chunk.
        let codec = gpusnap_chunks::Codec::configured();
        tracing::debug!("new chunks encoded as {codec:?}");
        let mut tree = process_tree(root);
        // Refused before anything is suspended: CRIU would fail on it only
        // after the GPU state had gone to host memory.
        for &(p, _) in &tree {
            if target::session_leader_visible(p) == Some(false) {
                let comm = target::resolve(p).map(|t| t.comm).unwrap_or_default();
                return Err(Error::ForeignSession { pid: p, comm });
            }
        }
        let members = self.cuda_members(&mut tree)?;
        let name =
            opts.name.clone().unwrap_or_else(|| format!("{}-{}-{}", sanitize(&root_t.comm), root, now_ms()));
        let pending = images.begin(&name)?;
        let cuda: Vec<i32> = members.iter().filter(|(_, s)| s.is_some()).map(|(t, _)| t.pid).collect();
        let was_running: Vec<i32> = members
            .iter()
            .filter(|(_, s)| matches!(s, Some(ProcessState::Running | ProcessState::Locked)))
            .map(|(t, _)| t.pid)
            .collect();
        // Journaled before anything is done, so that a gpusnap killed in
        // the middle (after CRIU stopped the tree, say) is reconciled by the
        // next run (see [`Engine::reconcile_hibernates`]).
        let mut journal: Vec<(i64, Target)> = Vec::new();
        for (t, _) in &members {
            let detail = format!(
                "image={name} resume={} stop={}",
                u8::from(was_running.contains(&t.pid)),
                u8::from(!opts.leave_running)
            );
            match self.store_mut().begin_with(t, "hibernate", &detail) {
                Ok(id) => journal.push((id, t.clone())),
                Err(e) => {
                    self.close_journal(&journal, false, "not started");
                    return Err(e.into());
                }
            }
        }

        // 1. CUDA state off the GPU, all or none.
        let t_suspend = Instant::now();
        let suspended = match self.suspend_all(&cuda, opts.lock_timeout_ms) {
            Ok(s) => s,
            Err(e) => {
                self.close_journal(&journal, false, "suspend failed");
                return Err(e.into());
            }
        };
        let suspend_ms = ms(t_suspend);
        let undo = |e: &mut Self, err: Error| -> Error {
            e.resume_after_failure(&suspended);
            e.close_journal(&journal, false, &format!("undone: {err}"));
            err
        };
        // Read before CRIU acts: after it, a store error must not leave
        // the tree stopped.
        let mut footprints: HashMap<i32, BTreeMap<String, u64>> = HashMap::new();
        for (t, st) in &members {
            if st.is_some() {
                match self.store().get(t) {
                    Ok(r) => {
                        footprints.insert(t.pid, r.map(|r| r.footprint).unwrap_or_default());
                    }
                    Err(err) => return Err(undo(self, err.into())),
                }
            }
        }

        let tree_pids: Vec<i32> = tree.iter().map(|(p, _)| *p).collect();
        // A map file still mapped after the driver's checkpoint (see
        // gpusnap_images::mapfile::still_mapped): refused, the tree as it was.
        if let Some((pid, path)) = gpusnap_images::mapfile::still_mapped(images.state_dir(), &tree_pids) {
            return Err(undo(self, Error::MapStillMapped { pid, path }));
        }
        // The pages of their own files the processes have in memory, read
        // ahead by a cold wake (gpusnap_images::workingset).
        let file_pages = gpusnap_images::workingset::capture(&tree_pids);
        // 2. CRIU dump, leaving the tree stopped (or, with leave_running,
        // running) until the image is safe.
        let t_dump = Instant::now();
        let expect: u64 = tree.iter().filter_map(|(p, _)| target::rss_bytes(*p)).sum();
        let progress: &dyn Progress = self.progress();
        let store_root = images.state_dir().join("store");
        // CRIU's pages go through FIFOs straight to the chunkers (see
        // crate::fifo); where that cannot start, CRIU writes pages files.
        let mut receiver = None;
        let fifos = crate::fifo::enabled();
        // Held until the dump is over: CRIU's pipes and the FIFOs get
        // their size when they are made. A switch that fails costs speed
        // only (the pipes keep the sysctl's size), so it is said and left.
        let _pipes = (fifos && big_pipes_wanted(opts.big_pipes))
            .then(|| gpusnap_core::hostknob::BigPipes::on(images.state_dir()))
            .and_then(|r| r.map_err(|e| tracing::warn!("--big-pipes: {e}; the pipes keep their size")).ok());
        if fifos {
            let names = crate::fifo::names_for(&tree_pids);
            let log = images.state_dir().join("dump-keeper.log");
            match crate::fifo::Receiver::start(&pending.criu_dir(), &store_root, opts.durable, names, &log) {
                Ok(r) => receiver = Some(r),
                Err(e) => tracing::warn!("pages through FIFOs: {e}; CRIU writes pages files"),
            }
        }
        // Otherwise CRIU writes to a tmpfs when the host has the memory (see
        // crate::dumpdir); only with a follower (without one the pages
        // files would all be copied).
        let mut tmpfs = if crate::follow::enabled() && receiver.is_none() {
            crate::dumpdir::choose(expect)
        } else {
            None
        };
        let mut follower = None;
        if let Some(t) = &tmpfs {
            match crate::follow::Follower::start(t.dir(), &store_root, opts.durable) {
                Ok(f) => follower = Some(f),
                Err(e) => tracing::warn!("chunking while CRIU dumps: {e}"),
            }
        }
        if follower.is_none() {
            tmpfs = None;
        }
        let criu_dir = tmpfs.as_ref().map_or_else(|| pending.criu_dir(), |t| t.criu_dir());
        // The pages files are chunked as CRIU writes them. A follower that
        // cannot start costs only the overlap: the commit chunks them.
        if tmpfs.is_none() && receiver.is_none() && crate::follow::enabled() {
            follower = crate::follow::Follower::start(&pending.dir, &store_root, opts.durable)
                .map_err(|e| tracing::warn!("chunking while CRIU dumps: {e}"))
                .ok();
        }
        let dumped = observe(
            progress,
            &format!("dump {root}"),
            expect,
            || Some(receiver.as_ref().map_or_else(|| dir_bytes(&criu_dir), |r| r.received())),
            || {
                let o = DumpOptions { leave_running: opts.leave_running, leave_stopped: !opts.leave_running };
                // A durable image must reach the disk before the tree ends:
                // write it back while CRIU is still writing, so that little
                // is left to flush at the end.
                let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
                std::thread::scope(|s| {
                    if opts.durable && tmpfs.is_none() && receiver.is_none() {
                        let dir = criu_dir.clone();
                        s.spawn(move || {
                            while done_rx.recv_timeout(Duration::from_millis(250))
                                == Err(std::sync::mpsc::RecvTimeoutError::Timeout)
                            {
                                gpusnap_images::image::start_writeback(&dir);
                            }
                        });
                    }
                    let r = criu.dump(root, &criu_dir, &criu_dir, &o);
                    drop(done_tx);
                    r
                })
            },
        );
        if let Err(e) = dumped {
            // Every chunk the follower staged goes with the partial image.
            if let Some(f) = follower {
                f.abandon();
            }
            if let Some(r) = receiver {
                r.abandon();
            }
            // CRIU leaves the tree running when a dump fails. Its log is
            // kept outside the partial image, which is removed.
            let e = e.keep_log(images.state_dir(), &format!("dump-{name}"));
            drop(tmpfs);
            return Err(undo(self, e.into()));
        }
        // The tree as CRIU dumped it: it is stopped now (or, left running,
        // as close as can be seen), and may hold children born since the
        // first walk. Those are in the image, so they are ended with it.
        let tree_now = process_tree(root);
        let mut pids: Vec<Target> = members.iter().map(|(t, _)| t.clone()).collect();
        let mut born: Vec<(Target, i32)> = Vec::new();
        for &(p, ppid) in &tree_now {
            if !pids.iter().any(|t| t.pid == p) {
                if let Ok(t) = target::resolve(p) {
                    pids.push(t.clone());
                    born.push((t, ppid));
                }
            }
        }
        let undo = |e: &mut Self, err: Error| -> Error {
            if !opts.leave_running {
                continue_tree(&pids);
            }
            e.resume_after_failure(&suspended);
            e.close_journal(&journal, false, &format!("undone: {err}"));
            err
        };
        let dump_ms = ms(t_dump);
        // Where CRIU's time went (information only: a file CRIU did not
        // write, or could not, costs nothing but the figures).
        let criu_stats = gpusnap_pages::dump_stats(&criu_dir).unwrap_or_else(|e| {
            tracing::warn!("criu's dump statistics: {e}");
            None
        });

        // 3. Manifest and checksums, then the rename that makes it an image.
        let t_write = Instant::now();
        let through_fifos = receiver.is_some();
        let finished = match receiver {
            Some(r) => Some(r.finish()),
            None => follower.map(|f| f.finish()),
        };
        let mut followed = match finished {
            Some(Ok(f)) => Some(f),
            Some(Err(e)) => {
                let err = Error::from(gpusnap_images::image::ImageError::Io {
                    name: name.clone(),
                    op: "chunk the pages files".into(),
                    err: std::io::Error::other(e),
                });
                drop(tmpfs);
                return Err(undo(self, err));
            }
            None => None,
        };
        // From the tmpfs: CRIU's small files into the image, the pages
        // files the follower chunked left out (then the tmpfs is freed).
        // (A tmpfs dump always has a follower: tmpfs is None without one.)
        let dump_dir = if let (Some(t), Some(f)) = (tmpfs.take(), followed.as_mut()) {
            f.elsewhere = true;
            let chunked = |rel: &str| f.files.get(rel).is_some_and(|x| !x.stored.chunks.is_empty());
            if let Err(e) = t.copy_into(&pending.criu_dir(), &chunked) {
                if let Some(f) = followed {
                    if let Ok(store) = gpusnap_chunks::LocalStore::open(store_root.clone()) {
                        f.abandon(&store);
                    }
                }
                let err = Error::from(gpusnap_images::image::ImageError::Io {
                    name: name.clone(),
                    op: "copy CRIU's files from the tmpfs".into(),
                    err: e,
                });
                return Err(undo(self, err));
            }
            "tmpfs"
        } else if through_fifos {
            "fifo"
        } else {
            "disk"
        };
        let fstats = followed.as_ref().map(|f| f.stats).unwrap_or_default();
        let mut procs = Vec::new();
        let mut gpu_uuids = std::collections::BTreeSet::new();
        for ((t, st), (_, ppid)) in members.iter().zip(tree.iter()) {
            let footprint = if st.is_some() {
                footprints.get(&t.pid).cloned().unwrap_or_default()
            } else {
                BTreeMap::new()
            };
            gpu_uuids.extend(footprint.keys().cloned());
            procs.push(ProcDesc {
                pid: t.pid,
                ppid: *ppid,
                start_time: t.start_time,
                comm: t.comm.clone(),
                cuda: st.is_some(),
                was_running: was_running.contains(&t.pid),
                footprint,
            });
        }
        for (t, ppid) in &born {
            procs.push(ProcDesc {
                pid: t.pid,
                ppid: *ppid,
                start_time: t.start_time,
                comm: t.comm.clone(),
                cuda: false,
                was_running: false,
                footprint: BTreeMap::new(),
            });
        }
        let host = self.gpus().gpus().unwrap_or_default();
        let desc = |g: &gpusnap_gpu::GpuInfo| GpuDesc {
            uuid: g.uuid.clone(),
            name: g.name.clone(),
            total_bytes: g.total_bytes,
        };
        let gpus: Vec<GpuDesc> = host.iter().filter(|g| gpu_uuids.contains(&g.uuid)).map(desc).collect();
        let host_refs: Vec<gpusnap_core::remap::Gpu> = host
            .iter()
            .map(|g| gpusnap_core::remap::Gpu {
                index: Some(g.index),
                uuid: g.uuid.clone(),
                name: g.name.clone(),
            })
            .collect();
        let mut seen = std::collections::BTreeSet::new();
        for (t, st) in &members {
            if st.is_some() {
                seen.extend(gpusnap_core::remap::visible_to(t.pid, &host_refs).into_iter().map(|g| g.uuid));
            }
        }
        let visible_gpus: Vec<GpuDesc> = host.iter().filter(|g| seen.contains(&g.uuid)).map(desc).collect();
        let manifest = Manifest {
            magic: MAGIC.into(),
            format: FORMAT,
            gpusnap_version: env!("CARGO_PKG_VERSION").into(),
            name: name.clone(),
            host: hostname(),
            created_ms: now_ms(),
            driver_api: (!cuda.is_empty()).then(|| self.api_version()),
            driver_version: if cuda.is_empty() { None } else { self.gpus().driver_version().ok() },
            gpus,
            visible_gpus,
            root_pid: root,
            processes: procs,
            criu_version: criu.version.clone(),
            signer: String::new(),
            files: Vec::new(),
            file_pages,
        };
        let total_img = dir_bytes(&pending.criu_dir());
        progress.begin(&format!("checksum {name}"), total_img);
        let mut hashed = 0u64;
        let committed = pending.commit_followed(
            manifest,
            opts.durable,
            followed.map(crate::follow::Followed::into_prechunked),
            |n| {
                hashed += n;
                progress.update(hashed);
            },
        );
        progress.end();
        let manifest = match committed {
            Ok(m) => m,
            Err(e) => return Err(undo(self, e.into())),
        };
        let write_ms = ms(t_write);
        let path = images.root.join(&name);
        let cuda_members: Vec<Target> =
            members.iter().filter(|(_, st)| st.is_some()).map(|(t, _)| t.clone()).collect();
        Ok(Dumped {
            report: HibernateReport {
                image: name,
                path,
                root_pid: root,
                processes: pids.iter().map(|t| t.pid).collect(),
                cuda,
                image_bytes: manifest.total_bytes(),
                left_running: opts.leave_running,
                suspend_ms,
                dump_ms,
                write_ms,
                total_ms: 0,
                stages: HibernateStages {
                    suspend: suspend_ms,
                    dump: dump_ms,
                    commit: write_ms,
                    criu_frozen: criu_stats.as_ref().map_or(0, |c| c.frozen_ms),
                    criu_drain: criu_stats.as_ref().map_or(0, |c| c.drain_ms),
                    criu_memwrite: criu_stats.as_ref().map_or(0, |c| c.memwrite_ms),
                    follow_overlapped_bytes: fstats.overlapped_bytes,
                    follow_after_bytes: fstats.after_bytes,
                    follow_finish: fstats.finish_ms,
                    follow_punched_bytes: fstats.punched_bytes,
                    fifo: fstats.fifo,
                    dump_dir,
                },
                criu_stats,
                map: None,
            },
            started,
            pids,
            cuda_members,
            suspended,
            journal,
        })
    }

    fn close_journal(&mut self, journal: &[(i64, Target)], ok: bool, detail: &str) {
        for (id, t) in journal {
            if let Err(e) = self.store_mut().close(*id, t, "hibernate", ok, detail) {
                tracing::error!(pid = t.pid, "cannot journal the end of hibernate: {e}");
            }
        }
    }

    fn finish_hibernate(&mut self, d: Dumped, opts: &HibernateOptions) -> Result<HibernateReport, Error> {
        let Dumped { mut report, started, pids, cuda_members, suspended, journal } = d;
        // The image is committed: from here the hibernate is finished
        // whatever the store says (an error here used to leave the tree
        // stopped for good); the records are only notes.
        for t in &cuda_members {
            let state = if opts.leave_running { None } else { Some("hibernated") };
            if let Err(e) = self.store_mut().note(t, "hibernate", state, &format!("image {}", report.image)) {
                tracing::error!(pid = t.pid, "hibernated, but the journal could not record it: {e}");
            }
        }
        let res = if opts.leave_running {
            // The image is safe either way; a process that could not be put
            // back on the GPU is still reported.
            match self.resume_after_failure(&suspended) {
                Some(e) => Err(e.into()),
                None => Ok(()),
            }
        } else {
            kill_tree(&pids)
        };
        self.close_journal(&journal, res.is_ok(), &format!("image {}", report.image));
        res?;
        report.total_ms = ms(started);
        Ok(report)
    }

    fn abandon_hibernate(&mut self, d: Dumped, images: &ImageStore, opts: &HibernateOptions) {
        if !opts.leave_running {
            continue_tree(&d.pids);
        }
        if let Some(e) = self.resume_after_failure(&d.suspended) {
            tracing::error!(root = d.report.root_pid, "could not put the tree back on the GPU: {e}");
        }
        self.close_journal(&d.journal, false, "undone: another tree of the group failed");
        if let Err(e) = images.remove(&d.report.image) {
            tracing::error!(image = d.report.image, "could not remove the image: {e}");
        }
    }

    fn plan_wake(
        &mut self,
        images: &ImageStore,
        name: &str,
        opts: &WakeOptions,
        group: bool,
    ) -> Result<WakePlan, Error> {
        let started = Instant::now();
        // Verify everything before anything is restored; an image given by
        // path is copied into the store as it is verified.
        let (_, m) = images.manifest(name)?;
        let progress: &dyn Progress = self.progress();
        progress.begin(&format!("verify {name}"), m.total_bytes());
        let mut seen = 0u64;
        // An image being streamed from its remote lacks chunks until its
        // pages are read; any other must hold every chunk (each is checked
        // as it is read).
        // A group is all or nothing: every chunk of every member is checked
        // before any tree runs (a member woken, then ended because another
        // member's chunk failed, would have run on for a moment). A
        // streamed image's chunks are checked as they arrive (docs/images.md:
        // not yet cut short). A lone CUDA image's chunks are checked in the
        // background of its restore instead, to the end before any unlock
        // (a bad one ends the tree safely, its driver restores rescued if
        // they were reading: crate::rescue): only the manifest, the small
        // files and the chunks' presence here.
        let cuda = m.processes.iter().any(|p| p.cuda);
        let streamed = gpusnap_images::remote::origin(images.state_dir(), name).is_some();
        let verify_deferred = cuda && !group && !streamed;
        let check = if streamed {
            gpusnap_images::image::ChunkCheck::Listed
        } else if group || (cuda && !verify_deferred) {
            gpusnap_images::image::ChunkCheck::Full
        } else {
            gpusnap_images::image::ChunkCheck::Present
        };
        let verified = images.verified_in_store(name, check, |n| {
            seen = seen.saturating_add(n);
            progress.update(seen);
        });
        progress.end();
        let (name, dir, m, chunks_checked) = verified?;
        let name = name.as_str();
        let verify_ms = ms(started);

        let resume: Vec<&ProcDesc> = m
            .processes
            .iter()
            .filter(|p| p.cuda && (p.was_running || opts.force_resume.contains(&p.pid)))
            // Without a footprint there is no admission: such a process stays
            // suspended (`gpusnap resume --footprint MIB PID` brings it back).
            .filter(|p| {
                let known = !p.footprint.is_empty();
                if !known {
                    tracing::warn!(pid = p.pid, "no footprint recorded in the image: left suspended");
                }
                known
            })
            .collect();
        // Where each old GPU goes (identity unless a device map is given).
        let (pairs, remapped) = if opts.device_map.is_empty() {
            if m.processes.iter().any(|p| p.cuda) {
                self.check_host(&m)?;
            }
            (Vec::new(), None)
        } else {
            self.check_host_driver(&m)?;
            let olds: Vec<gpusnap_core::remap::Gpu> =
                if m.visible_gpus.is_empty() { &m.gpus } else { &m.visible_gpus }
                    .iter()
                    .map(|g| gpusnap_core::remap::Gpu {
                        index: None,
                        uuid: g.uuid.clone(),
                        name: g.name.clone(),
                    })
                    .collect();
            let news = self.host_gpus()?;
            let (pairs, _) = self.plan_remap(&opts.device_map, &olds, &news, &BTreeMap::new())?;
            let map: BTreeMap<gpusnap_cuda::GpuUuid, String> =
                pairs.iter().map(|p| (p.old, p.new.to_string())).collect();
            (pairs, Some(map))
        };
        let moved = |fp: &BTreeMap<String, u64>| -> BTreeMap<String, u64> {
            let mut out = BTreeMap::new();
            for (u, b) in fp {
                let key = u.parse::<gpusnap_cuda::GpuUuid>().ok();
                let to = remapped.as_ref().zip(key).and_then(|(m, k)| m.get(&k)).cloned();
                let e = out.entry(to.unwrap_or_else(|| u.clone())).or_insert(0u64);
                *e = e.saturating_add(*b);
            }
            out
        };
        let fps: Vec<BTreeMap<String, u64>> = resume.iter().map(|p| moved(&p.footprint)).collect();
        let resume: Vec<ProcDesc> = resume.into_iter().cloned().collect();
        Ok(WakePlan {
            name: name.to_string(),
            started,
            dir,
            m,
            resume,
            fps,
            pairs,
            verify_ms,
            check_ms: ms(started).saturating_sub(verify_ms),
            chunks_checked,
            verify_deferred,
        })
    }

    // One image's restore: what plan_wake decided, plus the wake's choice of
    // path; a struct of them would only be unpacked again here.
    #[allow(clippy::too_many_arguments)]
    fn wake_admitted(
        &mut self,
        criu: &Criu,
        state_dir: &Path,
        plan: &WakePlan,
        resume: &[&ProcDesc],
        eager: bool,
    ) -> Result<Woken, Error> {
        let WakePlan { name, dir, m, fps: footprints, pairs, chunks_checked, verify_deferred, .. } = plan;
        // The processes' own files read ahead while CRIU restores them (the
        // kernel may hold the thread while its queue is full; nobody waits).
        let mut file_pages_bytes = 0;
        if !m.file_pages.is_empty() && gpusnap_images::workingset::enabled() {
            file_pages_bytes = m.file_pages.iter().map(|f| f.bytes()).sum();
            let sets = m.file_pages.clone();
            let spawned = std::thread::Builder::new().name("file-pages".into()).spawn(move || {
                let p = gpusnap_images::workingset::prefetch(&sets);
                tracing::debug!(
                    files = p.files,
                    bytes = p.bytes,
                    skipped = p.skipped,
                    "wake: files read ahead"
                );
            });
            if let Err(e) = spawned {
                tracing::debug!("wake: no thread to read the files ahead: {e}");
            }
        }
        let t_criu = Instant::now();
        // CRIU's log and pidfile go to the state directory, never into the
        // image (a link planted there made root write elsewhere).
        let work = crate::criu::new_log_dir(state_dir, &format!("restore-{name}")).map_err(|e| {
            Error::from(gpusnap_images::image::ImageError::Io {
                name: name.clone(),
                op: "create the log directory".into(),
                err: e,
            })
        })?;
        // Where a streamed image's missing chunks come from (None: a local image).
        let origin = gpusnap_images::remote::origin(state_dir, name);
        // An image whose pages are chunks: CRIU gets its files in the work
        // directory, the page server reads the chunks (see chunksrc).
        let chunked = {
            let store = gpusnap_chunks::LocalStore::open(state_dir.join("store")).map_err(|e| {
                Error::from(gpusnap_images::image::ImageError::Io {
                    name: name.clone(),
                    op: "open the chunk store".into(),
                    err: std::io::Error::other(e.to_string()),
                })
            })?;
            let remote = match &origin {
                Some(url) => Some(gpusnap_images::remote::open_origin(url)?),
                None => None,
            };
            gpusnap_images::chunksrc::Workdir::prepare(name, dir, m, store, remote, &work, *chunks_checked)?
        };
        let mut chunked = chunked;
        let lazy_possible = !eager && gpusnap_pages::support().why_not.is_none();
        if let Some(wd) = chunked.as_mut() {
            // An eager restore's pages files are written whole first, every
            // chunk checked as it is read: the verify itself (a streamed
            // image's chunks fetched ahead meanwhile).
            if !lazy_possible {
                wd.start_prefetch();
            }
            wd.materialise(!lazy_possible)?;
        }
        // The image's large regions mapped from its map file, if it has one
        // ready (gpusnap_images::mapfile): checked here, before CRIU maps it.
        let mut mapped = gpusnap_images::mapfile::Mapped::default();
        let mut map_notice = None;
        if let (true, Some(wd)) = (lazy_possible, chunked.as_ref()) {
            match gpusnap_images::mapfile::for_wake(state_dir, name, dir, m, wd) {
                Ok(Some(mp)) => {
                    tracing::debug!(
                        bytes = mp.bytes,
                        check_ms = mp.check_ms,
                        "wake: regions mapped from the map file"
                    );
                    mapped = mp;
                }
                Ok(None) => {}
                Err(why) => map_notice = Some(format!("image {name}: {why}; its memory is filled instead")),
            }
        }
        let whole = std::sync::atomic::AtomicBool::new(!lazy_possible);
        let before_eager = || -> Result<(), crate::criu::CriuError> {
            let Some(wd) = chunked.as_ref() else { return Ok(()) };
            if whole.swap(true, std::sync::atomic::Ordering::Relaxed) {
                return Ok(());
            }
            wd.materialise(true).map_err(|e| crate::criu::CriuError::Failed {
                op: "restore",
                line: format!("the image's pages could not be put in place: {e}"),
                log: work.join("restore.log").display().to_string(),
            })
        };
        let criu_images = chunked.as_ref().map(|wd| wd.images.clone()).unwrap_or_else(|| dir.join("criu"));
        let source: Option<std::sync::Arc<dyn gpusnap_pages::PageSource>> =
            chunked.as_ref().map(|wd| wd.source.clone() as std::sync::Arc<dyn gpusnap_pages::PageSource>);
        // If gpusnap dies mid-wake, the keeper reads the chunks itself.
        let keeper_chunks = chunked.as_ref().map(|_| crate::lazy::KeeperChunks {
            state_dir,
            name: name.as_str(),
            dir: dir.as_path(),
        });
        let progress: &dyn Progress = self.progress();
        let expect: u64 = m.total_bytes();
        let restored = observe(
            progress,
            &format!("wake {name}"),
            expect,
            || None,
            || {
                // A pid can still be held for a moment after its /proc entry
                // looked free (a reaper racing us): CRIU then says "File exists".
                let mut tries = 0;
                loop {
                    match crate::lazy::restore_from(
                        criu,
                        &criu_images,
                        &work,
                        eager,
                        source.clone(),
                        &before_eager,
                        keeper_chunks.as_ref().map(|c| (c, m)),
                    ) {
                        Err(crate::criu::CriuError::Failed { line, .. })
                            if line.contains("File exists") && tries < 5 =>
                        {
                            tries += 1;
                            std::thread::sleep(Duration::from_millis(500));
                        }
                        other => return other,
                    }
                }
            },
        );
        // A chunk that failed its check is the error (an image refused),
        // whatever CRIU made of the missing pages.
        let restored = match (restored, chunked.as_ref().and_then(|wd| wd.bad())) {
            (Err(_), Some(bad)) => return Err(bad.into()),
            (r, _) => r?,
        };
        // The reads of the whole image (the readahead, the background
        // verify) begin once CRIU's restore is done: on a cold page cache,
        // queued first, they held CRIU's own small reads (the files its
        // restore opens and checks) behind 20 GB on the disk (H200, Runs
        // 26-27: CRIU 11.2-12.7 s instead of 0.3 s, ending with the verify).
        if let (true, Some(wd)) = (restored.pages.is_some(), chunked.as_mut()) {
            wd.start_prefetch();
            if *verify_deferred {
                let pace = if verify_first() {
                    gpusnap_images::chunksrc::VerifyPace::all_cores()
                } else {
                    gpusnap_images::chunksrc::VerifyPace::beside_the_driver_from_env()
                };
                if pace.threads > 0 {
                    wd.start_verify(pace);
                }
            }
        }
        let criu_ms = ms(t_criu);
        let t_pages = Instant::now();
        // Every CUDA process of the image is known again, resumed or not,
        // with the footprint it needs, before anything else can happen to
        // it: a wake that dies from here on (during the page server's head
        // start, say) leaves processes that `resume` can bring back.
        let recorded = (|| {
            for p in m.processes.iter().filter(|p| p.cuda) {
                let Ok(t) = target::resolve(p.pid) else { continue };
                match resume.iter().position(|r| r.pid == p.pid) {
                    Some(i) => self.store_mut().record(&t, "checkpointed", footprints.get(i))?,
                    None => {
                        self.store_mut().record(&t, "checkpointed", Some(&p.footprint))?;
                        self.store_mut().note(
                            &t,
                            "wake",
                            None,
                            &format!("restored by CRIU from image {name}, left suspended"),
                        )?;
                    }
                }
            }
            Ok::<_, Error>(())
        })();
        if let Err(err) = recorded {
            self.end_woken(m.processes.iter().rev().map(|p| p.pid));
            return Err(err);
        }
        // The journal is the first thing done after CRIU's return.
        let journal_ms = ms(t_pages);
        // The page server's head start, if one is asked for: until then
        // the driver's restore is not started.
        // (Only for a driver restore: a tree without one runs at once.)
        let head = if resume.is_empty() { Ok(0) } else { restored.head_start() };
        let t_head_end = Instant::now();
        let (root, pages, notice) = (restored.root, restored.pages, restored.notice);
        if let Some(n) = &map_notice {
            eprintln!("gpusnap: notice: {n}");
        }
        // The processes CRIU made (pid and start time), for a failed lazy
        // wake to know exactly what is its own.
        let woken: Vec<Target> = m.processes.iter().filter_map(|p| target::resolve(p.pid).ok()).collect();
        if let Some(n) = &notice {
            // Shown even without -v: the wake is slower than it could be.
            eprintln!("gpusnap: notice: {n}");
        }

        // CRIU has acted: from here every error ends what it restored
        // (the image stays for a retry).
        let (head_ms, mut head_failed) = match head {
            Ok(ms) => (ms, None),
            Err(e) => (0, Some(Error::Pages(e))),
        };
        // The image's whole verify: by default the driver's restores start
        // without waiting for its end (every byte they read is a chunk the
        // page server checked first) and their unlocks wait for it, so no
        // process runs unless the whole image is good; with
        // GPUSNAP_VERIFY_FIRST=1 it ends before any driver restore.
        let mut verify = gpusnap_images::chunksrc::VerifyTimes::default();
        let stream = pages.is_some() && !verify_first();
        let mut pending = None;
        let mut starter = None;
        if let (None, Some(wd)) = (&head_failed, chunked.as_mut()) {
            if stream {
                pending = wd.take_verify();
                // No verify beside the driver (GPUSNAP_VERIFY_THREADS=0):
                // the gate checks what the page server has not.
                if pending.is_none() && *verify_deferred {
                    starter = Some(wd.verify_starter());
                }
            } else {
                match wd.wait_verify() {
                    Ok(v) => verify = v,
                    Err(e) => head_failed = Some(e.into()),
                }
            }
        }
        // A failure known already ends the wake before any driver restore.
        let known_bad = chunked.as_ref().is_some_and(|wd| wd.bad().is_some());
        if head_failed.is_none() && (known_bad || pages.as_ref().is_some_and(|s| s.rescuer().failed())) {
            head_failed = Some(pages_failure(chunked.as_ref(), pages.as_ref()));
        }
        // The driver's start-up ran in the background of everything above;
        // one that failed is a host without a CUDA driver, as when it is
        // known at load (see check_host_driver), with the tree ended.
        if head_failed.is_none() && m.processes.iter().any(|p| p.cuda) {
            if let Err(e) = self.driver_ready() {
                tracing::info!("the CUDA driver did not start: {e}");
                head_failed = Some(no_driver(m));
            }
        }
        let t_restore = Instant::now();
        let driver_start_ms = ms(t_head_end);
        type Item<'f> = (i32, (i32, &'f BTreeMap<String, u64>));
        let items: Vec<Item<'_>> =
            resume.iter().zip(footprints).map(|(p, fp)| (p.pid, (p.pid, fp))).collect();
        // While the driver restores memory the page server brings, a watch
        // ends the tree safely if the server fails (crate::rescue).
        let watch = match (&head_failed, &pages) {
            (None, Some(srv)) if !items.is_empty() => {
                let members = m
                    .processes
                    .iter()
                    .filter(|p| target::resolve(p.pid).is_ok())
                    .map(|p| {
                        let cuda = resume.iter().any(|r| r.pid == p.pid);
                        let restore_tid =
                            if cuda { self.api_ref().restore_thread_id(p.pid).ok() } else { None };
                        crate::rescue::Member { pid: p.pid, restore_tid, cuda }
                    })
                    .collect();
                Some(crate::rescue::Watch::start(
                    srv.rescuer(),
                    chunked.as_ref().map(|wd| wd.bad.clone()),
                    members,
                ))
            }
            _ => None,
        };
        let waited_verify = std::sync::Mutex::new(gpusnap_images::chunksrc::VerifyTimes::default());
        let pending = std::sync::Mutex::new(pending);
        let gate = crate::rescue::Gate::new(items.len(), || {
            let late =
                || starter.as_ref().map(|s| s.start(gpusnap_images::chunksrc::VerifyPace::all_cores()));
            let times = match pending.lock().ok().and_then(|mut p| p.take()).or_else(late) {
                Some(v) => v.wait().map_err(|e| e.to_string())?,
                None => gpusnap_images::chunksrc::VerifyTimes::default(),
            };
            if let Ok(mut w) = waited_verify.lock() {
                *w = times;
            }
            if watch.as_ref().is_some_and(|w| w.driver_done()) {
                return Err("the page server failed during the driver's restore".into());
            }
            Ok(())
        });
        let pass =
            |ok: bool| gate.arrive(ok).map_err(|why| Error::Pages(gpusnap_pages::PagesError::Stopped(why)));
        // The CUDA processes back on their GPUs, in parallel: the driver's
        // calls on different processes are independent.
        let back = |e: &mut Self, (pid, fp): (i32, &BTreeMap<String, u64>)| {
            let known = target::resolve(pid).and_then(|t| {
                e.store_mut().note(&t, "wake", None, &format!("restored by CRIU from image {name}"))?;
                Ok(t)
            });
            let t = match known {
                Ok(t) => t,
                Err(err) => {
                    let _ = pass(false);
                    // CRIU restored it a moment ago: one gone now died on
                    // its own, before its driver restore.
                    return Err(match err {
                        CoreError::Zombie { pid, comm } => {
                            Error::DiedAfterRestore { pid, comm, how: target::how_it_ended(pid) }
                        }
                        CoreError::NoProcess { pid } => {
                            let comm = m.processes.iter().find(|p| p.pid == pid).map(|p| p.comm.clone());
                            Error::DiedAfterRestore {
                                pid,
                                comm: comm.unwrap_or_default(),
                                how: target::how_it_ended(pid),
                            }
                        }
                        other => other.into(),
                    });
                }
            };
            if let Err(err) = e.restore_gated(&t, fp, pairs, &pass) {
                // A driver error on a process that is dead now: it died
                // under the driver's restore, which is why that failed.
                // (Not for what the restore's own failure handling does
                // next, `Unrecoverable` and its recovery, which may end
                // and replace the process itself.)
                let died = matches!(err, Error::Core(CoreError::Driver { .. }))
                    && match target::resolve(pid) {
                        Err(CoreError::Zombie { .. } | CoreError::NoProcess { .. }) => true,
                        Ok(now) => now.start_time != t.start_time,
                        Err(_) => false,
                    };
                if died {
                    let how =
                        format!("{}; the driver's restore then failed: {err}", target::how_it_ended(pid));
                    return Err(Error::DiedAfterRestore { pid, comm: t.comm.clone(), how });
                }
                return Err(err);
            }
            Ok::<_, Error>(t)
        };
        // While the driver's restores read what the page server fills, its
        // background fill keeps to their pace (GPUSNAP_PAGES_PACE,
        // gpusnap_pages::Server::pace_reader); afterwards the rest goes in
        // at full speed.
        let pace = match (&head_failed, &pages) {
            (None, Some(srv)) if !items.is_empty() => Some(srv.pace_reader()),
            _ => None,
        };
        // One process alone runs here, with the engine's progress display.
        let results = if head_failed.is_some() {
            Vec::new()
        } else if items.len() == 1 {
            let (pid, item) = items[0];
            vec![(pid, back(self, item))]
        } else {
            let proto = self.progress().sibling();
            self.in_parallel(items, &|| proto.sibling(), back)
        };
        let driver_ms = ms(t_restore);
        let t_finish = Instant::now();
        tracing::debug!(driver_ms, "wake: the driver's restores and unlocks returned");
        drop(pace);
        drop(gate);
        if stream {
            verify = waited_verify.into_inner().unwrap_or_default();
        }
        let rescued = watch.as_ref().is_some_and(|w| w.driver_done());
        if rescued {
            // Its threads stopped, the driver's restores back on zero pages:
            // checkpointed again and killed before the threads are let go.
            let tree = self.end_rescued(m, resume);
            if let Some(w) = watch {
                w.release();
            }
            if let Err(e) = kill_tree(&tree) {
                tracing::error!("rescue: the tree did not end: {e}");
            }
            let err = pages_failure(chunked.as_ref(), pages.as_ref());
            drop(pages);
            return Err(err);
        }
        drop(watch);
        let mut failed = head_failed.or_else(|| Self::fail_group(results, |_| {}).err());
        // A chunk that failed its check (found by the verify the unlocks
        // waited for) is the error: the image is refused.
        if failed.is_some() {
            if let Some(bad) = chunked.as_ref().and_then(|wd| wd.bad()) {
                failed = Some(bad.into());
            }
        }
        let (mut pages_ms, mut pages_bytes) = (0, 0);
        if let (None, Some(srv)) = (&failed, &pages) {
            // Only a tree with every page in place is woken: until then a
            // dying page server would leave it running on missing memory.
            let served = observe(
                self.progress(),
                &format!("pages {name}"),
                srv.total_bytes(),
                || Some(srv.done_bytes()),
                || srv.wait(),
            );
            pages_ms = ms(t_pages);
            match served {
                Ok(r) => pages_bytes = r.bytes,
                // A chunk that failed its check stopped the page server:
                // the image is refused (its bytes never reached a process).
                Err(e) => {
                    failed = Some(match chunked.as_ref().and_then(|wd| wd.bad()) {
                        Some(bad) => bad.into(),
                        None => Error::Pages(e),
                    })
                }
            }
        }
        let report = pages.as_ref().map(|s| s.report());
        tracing::debug!(finish_ms = ms(t_finish), "wake: every page in place, the report taken");
        if let Some(err) = failed {
            // The image is untouched: end what was restored so that wake can
            // be retried. The page server keeps every userfaultfd open until
            // then, so that no process runs on for a moment on zero pages
            // where its memory should be.
            self.end_woken(m.processes.iter().rev().map(|p| p.pid));
            if pages.is_some() {
                // One that could not be suspended would run on zero pages
                // where its memory is missing once the page server closes:
                // its state is not the image's any more, so it is killed.
                let left: Vec<Target> = woken.into_iter().filter(target::is_alive).collect();
                if !left.is_empty() {
                    tracing::error!(pids = ?left.iter().map(|t| t.pid).collect::<Vec<_>>(), "killing what a failed lazy wake could not end safely");
                    let _ = kill_tree(&left);
                }
            }
            drop(pages);
            return Err(err);
        }
        // A streamed image whose chunks are all here now is a local image.
        // (Only a streamed one is looked at: the look is a stat per chunk,
        // 40-60 ms of each wake of ~26 GB on the H200, Runs 75-76.)
        if origin.is_some() && chunked.as_ref().is_some_and(|wd| wd.complete()) {
            gpusnap_images::remote::clear_origin(state_dir, name);
        }
        Ok(Woken {
            root,
            criu_ms,
            head_ms,
            journal_ms,
            driver_start_ms,
            driver_ms,
            finish_ms: ms(t_finish),
            pages_ms,
            pages_bytes,
            // A lazy restore that fell back to an eager one copied the
            // regions in over the file's mapping: nothing was mapped.
            mapped: if pages.is_some() {
                mapped
            } else {
                gpusnap_images::mapfile::Mapped { bytes: 0, ..mapped }
            },
            file_pages_bytes,
            lazy: pages.is_some(),
            verify,
            notice,
            report,
        })
    }

    fn end_rescued(&mut self, m: &Manifest, resume: &[&ProcDesc]) -> Vec<Target> {
        for p in resume {
            let Ok(t) = target::resolve(p.pid) else { continue };
            match self.api_ref().get_state(p.pid) {
                Ok(ProcessState::Locked) => {
                    if let Err(e) =
                        self.journaled(&t, "checkpoint", "checkpointed", |api| api.checkpoint(t.pid))
                    {
                        tracing::error!(pid = t.pid, "rescue: checkpoint after the restore failed: {e}");
                    }
                }
                Ok(s) => tracing::warn!(pid = t.pid, state = %s, "rescue: not locked after the restore"),
                Err(e) => tracing::warn!(pid = t.pid, "rescue: driver state: {e}"),
            }
            let _ =
                self.store_mut().note(&t, "wake", None, "the page server failed during the restore: ended");
        }
        let tree: Vec<Target> =
            m.processes.iter().rev().filter_map(|p| target::resolve(p.pid).ok()).collect();
        for t in &tree {
            let _ =
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(t.pid), nix::sys::signal::Signal::SIGKILL);
        }
        tree
    }

    fn end_woken(&mut self, pids: impl Iterator<Item = i32>) {
        let stop = StopOptions { grace: Duration::from_secs(2), force: false, lock_timeout_ms: 30_000 };
        for pid in pids {
            if let Ok(t) = target::resolve(pid) {
                if let Err(e) = self.stop(t.pid, &stop) {
                    // stop journals, so a store error stops it too; a process
                    // whose CUDA state is not on the GPU (or that has none)
                    // is safe to kill without it.
                    let on_gpu = target::resolve_callable(pid)
                        .ok()
                        .and_then(|t| self.driver_state(&t).ok())
                        .is_some_and(|s| s == ProcessState::Running);
                    if on_gpu || !target::is_alive(&t) {
                        tracing::error!(pid, "could not end a restored process after a failed wake: {e}");
                    } else if let Err(e) = kill_tree(std::slice::from_ref(&t)) {
                        tracing::error!(pid, "could not end a restored process after a failed wake: {e}");
                    }
                }
            }
        }
    }

    fn check_host_driver(&self, m: &Manifest) -> Result<(), Error> {
        let inc = |why: String| Error::Incompatible { image: m.name.clone(), why };
        let api = self.api_version();
        if api == 0 {
            return Err(no_driver(m));
        }
        if let Some(img_api) = m.driver_api {
            if api < img_api {
                return Err(inc(format!("its driver API is {img_api}, this host's is older ({api})")));
            }
        }
        Ok(())
    }

    fn check_host(&self, m: &Manifest) -> Result<(), Error> {
        self.check_host_driver(m)?;
        let inc = |why: String| Error::Incompatible { image: m.name.clone(), why };
        let here = self.gpus().gpus()?;
        for g in &m.gpus {
            if !here.iter().any(|h| h.uuid == g.uuid) {
                return Err(inc(format!(
                    "it was taken on GPU {} ({}), which this host does not have (restoring onto other GPUs needs a device map)",
                    g.uuid, g.name
                )));
            }
        }
        Ok(())
    }
}

/// A hibernate that a gpusnap killed mid-way left behind, as its journal
/// says (for `doctor`, and what [`Engine::reconcile_hibernates`] did).
#[derive(Debug, Clone, Serialize)]
pub struct Interrupted {
    pub image: String,
    pub pids: Vec<i32>,
    /// finished (the image was complete: the stopped tree was ended),
    /// resumed (the tree was continued and its CUDA processes resumed), or
    /// pending (not reconciled yet).
    pub outcome: String,
}

/// The fields of a hibernate journal entry's detail.
fn detail_field<'a>(detail: &'a str, key: &str) -> Option<&'a str> {
    detail.split(' ').find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

/// Hibernates begun by a gpusnap that is gone and never finished, by image.
pub fn interrupted_hibernates(store: &gpusnap_core::Store) -> Result<Vec<Interrupted>, Error> {
    let mut out: Vec<Interrupted> = Vec::new();
    for (_, t, detail) in store.open_entries("hibernate")? {
        let image = detail_field(&detail, "image").unwrap_or("?").to_string();
        match out.iter_mut().find(|i| i.image == image) {
            Some(i) => i.pids.push(t.pid),
            None => out.push(Interrupted { image, pids: vec![t.pid], outcome: "pending".into() }),
        }
    }
    Ok(out)
}

fn sanitize(s: &str) -> String {
    s.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect()
}

/// SIGCONT to a tree CRIU left stopped.
fn continue_tree(ts: &[Target]) {
    for t in ts {
        if target::is_alive(t) {
            let _ =
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(t.pid), nix::sys::signal::Signal::SIGCONT);
        }
    }
}

/// SIGKILL to each process (only if it is still the one identified), then
/// wait until all are gone. Only for processes whose CUDA state is suspended.
pub fn kill_tree(ts: &[Target]) -> Result<(), Error> {
    use nix::sys::signal::{kill, Signal};
    for t in ts {
        if target::is_alive(t) {
            let _ = kill(nix::unistd::Pid::from_raw(t.pid), Signal::SIGKILL);
        }
    }
    let end = Instant::now() + Duration::from_secs(60);
    for t in ts {
        while target::is_alive(t) {
            if Instant::now() > end {
                return Err(CoreError::DidNotExit { pid: t.pid, secs: 60 }.into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    Ok(())
}

/// Waits for `p.pid` to be free (no process or thread, no zombie).
fn wait_pid_free(p: &ProcDesc, wait: Duration) -> Result<(), Error> {
    let end = Instant::now() + wait;
    loop {
        let Ok(stat) = Process::new(p.pid).and_then(|x| x.stat()) else { return Ok(()) };
        let zombie = target::RunState(stat.state).is_zombie();
        if stat.starttime == p.start_time && !zombie {
            return Err(Error::StillRunning { pid: p.pid, comm: stat.comm });
        }
        if Instant::now() >= end {
            let comm = if zombie {
                format!("{} (a zombie its parent has not reaped)", stat.comm)
            } else {
                stat.comm
            };
            return Err(Error::PidBusy { pid: p.pid, comm });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
