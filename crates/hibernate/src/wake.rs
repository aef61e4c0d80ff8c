//! Waking one image: verified and checked against this host before
//! anything is restored, then restored by CRIU (lazily through the page
//! server, or eagerly) and its CUDA processes put back on the GPU.

use crate::criu::Criu;
use crate::ms;
use crate::options::WakeOptions;
use crate::tree::kill_tree;
use crate::unwind::Unwind;
use crate::Error;
use gpusnap_core::engine::Engine;
use gpusnap_core::progress::{observe, Progress};
use gpusnap_core::target::{self, Target};
use gpusnap_core::Error as CoreError;
use gpusnap_cuda::CheckpointApi;
use gpusnap_gpu::GpuInventory;
use gpusnap_images::image::ImageStore;
use gpusnap_images::manifest::{Manifest, ProcDesc};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// One image of a wake, verified and checked, not yet restored.
pub(crate) struct WakePlan {
    pub(crate) name: String,
    pub(crate) started: Instant,
    pub(crate) dir: PathBuf,
    pub(crate) m: Manifest,
    /// The CUDA processes to put back on the GPU, in the image's order.
    pub(crate) resume: Vec<ProcDesc>,
    /// What each of them needs, per GPU it goes to.
    pub(crate) fps: Vec<BTreeMap<String, u64>>,
    pub(crate) pairs: Vec<gpusnap_cuda::GpuPair>,
    pub(crate) verify_ms: u64,
    /// What the host's checks took after the verify (the driver, the GPUs,
    /// the footprints where they go).
    pub(crate) check_ms: u64,
    /// Every chunk of the image was checked in full by the verify: the
    /// page server need not hash them again.
    pub(crate) chunks_checked: bool,
    /// The full check of the chunks is left to the restore: in the
    /// background of a lazy wake, finished before any unlock (a CUDA
    /// image; see [`gpusnap_images::chunksrc::Workdir::start_verify`]).
    pub(crate) verify_deferred: bool,
}

/// An image of CUDA processes on a host whose driver is missing or could not start.
pub(crate) fn no_driver(m: &Manifest) -> Error {
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
pub(crate) struct Woken {
    pub(crate) root: i32,
    pub(crate) criu_ms: u64,
    pub(crate) head_ms: u64,
    /// The journal of the restored processes, after CRIU.
    pub(crate) journal_ms: u64,
    /// From the head start's end to the driver's first restore: the
    /// driver's start-up (begun in the background), the verify's hand-off.
    pub(crate) driver_start_ms: u64,
    pub(crate) driver_ms: u64,
    /// From the driver's last unlock to the wake's end: the last pages,
    /// the page server's report.
    pub(crate) finish_ms: u64,
    pub(crate) pages_ms: u64,
    pub(crate) pages_bytes: u64,
    pub(crate) mapped: gpusnap_images::mapfile::Mapped,
    /// Of the processes' own files, asked to be read ahead (0: off).
    pub(crate) file_pages_bytes: u64,
    pub(crate) lazy: bool,
    pub(crate) verify: gpusnap_images::verify::VerifyTimes,
    pub(crate) notice: Option<String>,
    pub(crate) report: Option<gpusnap_pages::Report>,
}

/// `GPUSNAP_VERIFY_FIRST=1`: a lazy CUDA wake's driver restores wait for
/// the whole image's verify (the order before the rescue existed).
pub const VERIFY_FIRST_ENV: &str = "GPUSNAP_VERIFY_FIRST";

fn verify_first() -> bool {
    std::env::var(VERIFY_FIRST_ENV).is_ok_and(|v| v == "1")
}

/// The steps of a wake, on the lifecycle engine.
pub(crate) trait Wake {
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

    /// Is this host's driver able to restore the image's CUDA processes?
    fn check_host_driver(&self, m: &Manifest) -> Result<(), Error>;

    /// Can this host take the image's CUDA processes on the GPUs they had?
    fn check_host(&self, m: &Manifest) -> Result<(), Error>;
}

impl<A: CheckpointApi, G: GpuInventory> Wake for Engine<A, G> {
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
        // streamed image's chunks are checked as they arrive (docs/design/chunk-store.md:
        // not yet cut short). A lone CUDA image's chunks are checked in the
        // background of its restore instead, to the end before any unlock
        // (a bad one ends the tree safely, its driver restores rescued if
        // they were reading: crate::rescue): only the manifest, the small
        // files and the chunks' presence here.
        let cuda = m.processes.iter().any(|p| p.cuda);
        let streamed = gpusnap_images::origin::origin(images.state_dir(), name).is_some();
        let verify_deferred = cuda && !group && !streamed;
        let check = if streamed {
            gpusnap_images::manifest::ChunkCheck::Listed
        } else if group || (cuda && !verify_deferred) {
            gpusnap_images::manifest::ChunkCheck::Full
        } else {
            gpusnap_images::manifest::ChunkCheck::Present
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
            Error::from(gpusnap_images::manifest::ImageError::Io {
                name: name.clone(),
                op: "create the log directory".into(),
                err: e,
            })
        })?;
        // Where a streamed image's missing chunks come from (None: a local image).
        let origin = gpusnap_images::origin::origin(state_dir, name);
        // An image whose pages are chunks: CRIU gets its files in the work
        // directory, the page server reads the chunks (see chunksrc).
        let chunked = {
            let store = gpusnap_chunks::LocalStore::open(state_dir.join("store")).map_err(|e| {
                Error::from(gpusnap_images::manifest::ImageError::Io {
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
                    gpusnap_images::verify::VerifyPace::all_cores()
                } else {
                    gpusnap_images::verify::VerifyPace::beside_the_driver_from_env()
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
        let mut verify = gpusnap_images::verify::VerifyTimes::default();
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
        let waited_verify = std::sync::Mutex::new(gpusnap_images::verify::VerifyTimes::default());
        let pending = std::sync::Mutex::new(pending);
        let gate = crate::rescue::Gate::new(items.len(), || {
            let late = || starter.as_ref().map(|s| s.start(gpusnap_images::verify::VerifyPace::all_cores()));
            let times = match pending.lock().ok().and_then(|mut p| p.take()).or_else(late) {
                Some(v) => v.wait().map_err(|e| crate::rescue::Held::Verify(e.to_string()))?,
                None => gpusnap_images::verify::VerifyTimes::default(),
            };
            if let Ok(mut w) = waited_verify.lock() {
                *w = times;
            }
            if watch.as_ref().is_some_and(|w| w.driver_done()) {
                return Err(crate::rescue::Held::PageServerFailed);
            }
            Ok(())
        });
        let pass = |ok: bool| {
            gate.arrive(ok).map_err(|why| Error::Pages(gpusnap_pages::PagesError::Stopped(why.to_string())))
        };
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
        // 40-60 ms of each wake of ~26 GB on the H200, bench/results/075-076.)
        if origin.is_some() && chunked.as_ref().is_some_and(|wd| wd.complete()) {
            gpusnap_images::origin::clear_origin(state_dir, name);
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
