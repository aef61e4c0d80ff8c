//! Steps 1-4 of a hibernate (see [`crate::hibernate`]): the tree's CUDA
//! processes suspended, the tree dumped by CRIU and its image committed,
//! then the tree ended, or everything put back.

use crate::criu::{Criu, DumpOptions};
use crate::ms;
use crate::options::{HibernateOptions, HibernateReport, HibernateStages};
use crate::tree::{continue_tree, held_now, kill_tree, release_tree};
use crate::Error;
use gpusnap_core::engine::Engine;
use gpusnap_core::progress::{observe, Progress};
use gpusnap_core::store::now_ms;
use gpusnap_core::target::{self, Target};
use gpusnap_core::tree::process_tree;
use gpusnap_core::Error as CoreError;
use gpusnap_cuda::{CheckpointApi, ProcessState};
use gpusnap_gpu::GpuInventory;
use gpusnap_images::image::ImageStore;
use gpusnap_images::manifest::{GpuDesc, Manifest, ProcDesc, FORMAT, MAGIC};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::{Duration, Instant};

/// A tree dumped and its image committed, not yet ended (see
/// [`Engine::hibernate_group`]).
pub(crate) struct Dumped {
    pub(crate) report: HibernateReport,
    pub(crate) started: Instant,
    pub(crate) pids: Vec<Target>,
    pub(crate) cuda_members: Vec<Target>,
    pub(crate) suspended: Vec<i32>,
    pub(crate) journal: Vec<(i64, Target)>,
}

/// How long a failed dump waits for CRIU to let go of the tree.
const RELEASE_LIMIT: Duration = Duration::from_secs(30);

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

fn sanitize(s: &str) -> String {
    s.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect()
}

/// The steps of a hibernate, on the lifecycle engine.
pub(crate) trait Dump {
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
}

impl<A: CheckpointApi, G: GpuInventory> Dump for Engine<A, G> {
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
        // Stopped or traced by something else before gpusnap acts: a failed
        // dump leaves those as they are, and continues the rest.
        let held = held_now(&tree.iter().map(|(p, _)| *p).collect::<Vec<_>>());
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
                                gpusnap_images::sync::start_writeback(&dir);
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
            // CRIU may have left the tree stopped (a dump that completed,
            // leaving it stopped, and then failed) or been killed while it
            // held it: whatever it did, the tree runs again before its CUDA
            // processes are resumed. Its log is kept outside the partial
            // image, which is removed.
            if !release_tree(root, &tree_pids, &held, RELEASE_LIMIT) {
                tracing::error!(root, "a process of the tree is still stopped after the failed dump");
            }
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
                let err = Error::from(gpusnap_images::manifest::ImageError::Io {
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
                let err = Error::from(gpusnap_images::manifest::ImageError::Io {
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
}
