//! Waking an image whose pages files are chunks in `STATE/store`.
//!
//! The page server reads pages through [`StoreSource`]: an offset is found
//! in a file's chunk list (prefix sums), its chunk read from the local
//! store (or, for an image being streamed, fetched from its remote and
//! stored, verified), decoded and checked against its blake3 before any
//! byte of it is handed on; a few verified chunks are kept (sharded by
//! chunk index, so the many threads of the page server never wait on one
//! lock) for the neighbouring reads.
//!
//! CRIU itself still reads from `pages-N.img` what it restores on its own:
//! [`Workdir`] gives it, in CRIU's work directory (never in the image), a
//! copy of the image's small files and the pages files it needs: sparse
//! ones holding only the pages CRIU reads in a lazy restore (present, not
//! lazy), or whole ones for an eager restore. They are removed when the
//! wake ends.

use crate::chunkfile::{copy_of, map_raw_from_env, Bad, ChunkedFile, Shared, StoreSource, PREFETCH_THREADS};
use crate::manifest::{ImageError, Manifest};
use crate::verify::{PendingVerify, Verify, VerifyPace, VerifyStarter, VerifyTimes};
use gpusnap_chunks::{LocalStore, Remote};
use gpusnap_files::{create_private, mkdir_private, open_regular};
use gpusnap_pages::DirSource;
use std::collections::HashMap;
use std::fs;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// A wake's view of an image held (in part) by the chunk store.
pub struct Workdir {
    /// CRIU's images directory for the wake: small files and pages files.
    pub images: PathBuf,
    pub source: Arc<StoreSource>,
    pub bad: Bad,
    files: Vec<Arc<ChunkedFile>>,
    stop: Arc<AtomicBool>,
    prefetch: Vec<std::thread::JoinHandle<()>>,
    verify: Option<Verify>,
}

impl Workdir {
    /// Prepares `work/img` for an image whose pages files are (some of them)
    /// in the store: the image's other files copied there. `None`: no file
    /// of the image is in the store (CRIU reads the image as it is).
    /// `checked`: every chunk of the image was read and checked in full by
    /// this wake's verify, just before (`ChunkCheck::Full`): the page server
    /// then reads them without hashing them a second time.
    pub fn prepare(
        name: &str,
        dir: &Path,
        m: &Manifest,
        store: LocalStore,
        remote: Option<Remote>,
        work: &Path,
        checked: bool,
    ) -> Result<Option<Self>, ImageError> {
        if !m.files.iter().any(|f| f.in_store(dir)) {
            return Ok(None);
        }
        let ioe = |op: String| move |e: io::Error| ImageError::Io { name: name.into(), op, err: e };
        let images = work.join("img");
        mkdir_private(&images).map_err(ioe("create the restore directory".into()))?;
        let bad: Bad = Arc::new(Mutex::new(None));
        let shared = Shared::new(name, store, remote, bad.clone(), map_raw_from_env());
        let mut files = Vec::new();
        let mut by_name = HashMap::new();
        for f in &m.files {
            let base =
                Path::new(&f.path).file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
            // Paths are checked (plain, under criu/); CRIU's files are flat.
            let to = images.join(Path::new(&f.path).strip_prefix("criu").unwrap_or(Path::new(&base)));
            if let Some(p) = to.parent() {
                mkdir_private(p).map_err(ioe("create the restore directory".into()))?;
            }
            if f.in_store(dir) {
                let cf = Arc::new(ChunkedFile::new(&f.path, &f.chunks, shared.clone(), checked));
                by_name.insert(base, cf.clone());
                files.push(cf);
                continue;
            }
            // Verified whole already, in the root-only store.
            let mut from =
                open_regular(&dir.join(&f.path), f.size).map_err(ioe(format!("read {}", f.path)))?;
            let mut out = create_private(&to).map_err(ioe(format!("copy {}", f.path)))?;
            io::copy(&mut from, &mut out).map_err(ioe(format!("copy {}", f.path)))?;
        }
        let source = Arc::new(StoreSource { files: by_name, dir: DirSource::new(&images) });
        Ok(Some(Self {
            images,
            source,
            bad,
            files,
            stop: Arc::new(AtomicBool::new(false)),
            prefetch: Vec::new(),
            verify: None,
        }))
    }

    /// Writes the pages files CRIU reads: `whole`, every byte of each (an
    /// eager restore); else only the ranges CRIU restores itself in a lazy
    /// restore (holes elsewhere), and whole the pages files no process's
    /// pagemap names (shared memory's, which CRIU restores itself).
    pub fn materialise(&self, whole: bool) -> Result<(), ImageError> {
        let mut ranges: HashMap<String, Vec<(u64, u64)>> = HashMap::new();
        if !whole {
            let rd = fs::read_dir(&self.images).map_err(|e| self.io("list", e))?;
            for e in rd.filter_map(|e| e.ok()) {
                let n = e.file_name().to_string_lossy().into_owned();
                let Some(pid) = n
                    .strip_prefix("pagemap-")
                    .and_then(|s| s.strip_suffix(".img"))
                    .and_then(|s| s.parse::<i32>().ok())
                else {
                    continue;
                };
                let (id, r) = gpusnap_pages::eager_ranges(&self.images, pid)
                    .map_err(|e| ImageError::Corrupt { name: self.name().into(), why: e.to_string() })?;
                ranges.entry(format!("pages-{id}.img")).or_default().extend(r);
            }
        }
        // Pieces of at most 4 MiB, written on every core.
        let mut pieces: Vec<(Arc<ChunkedFile>, Arc<fs::File>, u64, u64)> = Vec::new();
        for f in &self.files {
            let base = Path::new(&f.path).file_name().and_then(|n| n.to_str()).unwrap_or_default();
            let to = self.images.join(Path::new(&f.path).strip_prefix("criu").unwrap_or(Path::new(base)));
            // Again over a sparse one when a lazy wake falls back to eager.
            let out = fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&to)
                .map_err(|e| self.io(&format!("write {}", f.path), e))?;
            out.set_len(f.size()).map_err(|e| self.io(&format!("write {}", f.path), e))?;
            let out = Arc::new(out);
            let want = match ranges.get(base) {
                Some(r) if !whole => r.clone(),
                _ => vec![(0, f.size())],
            };
            for (mut off, len) in want {
                let end = off.saturating_add(len).min(f.size());
                while off < end {
                    let n = (end - off).min(4 << 20);
                    pieces.push((f.clone(), out.clone(), off, n));
                    off += n;
                }
            }
        }
        let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(4).clamp(2, 16);
        let next = AtomicUsize::new(0);
        let first: Mutex<Option<ImageError>> = Mutex::new(None);
        std::thread::scope(|s| {
            for _ in 0..threads.min(pieces.len().max(1)) {
                s.spawn(|| {
                    let mut buf = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some((f, out, off, n)) = pieces.get(i) else { break };
                        if first.lock().map(|g| g.is_some()).unwrap_or(true) {
                            break;
                        }
                        buf.resize(*n as usize, 0);
                        let r = f.read(*off, &mut buf).and_then(|_| {
                            out.write_all_at(&buf, *off).map_err(|e| self.io("write pages", e))
                        });
                        if let Err(e) = r {
                            if let Ok(mut g) = first.lock() {
                                g.get_or_insert(e);
                            }
                        }
                    }
                });
            }
        });
        match first.into_inner().ok().flatten() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// For a wake streaming from a remote: fetches the chunks the store
    /// lacks, in address order, on several threads, until every one is
    /// here or the wake ends.
    pub fn start_prefetch(&mut self) {
        let Some(first) = self.files.first() else { return };
        let shared = first.shared.clone();
        let Some(remote) = shared.remote.clone() else {
            self.start_readahead();
            return;
        };
        let mut todo: Vec<String> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for f in &self.files {
            for c in &f.chunks {
                if seen.insert(c.blake3.clone()) && !shared.store.has(&c.blake3) {
                    todo.push(c.blake3.clone());
                }
            }
        }
        let todo = Arc::new(todo);
        let next = Arc::new(AtomicUsize::new(0));
        for _ in 0..PREFETCH_THREADS {
            let (todo, next, stop, shared, remote) =
                (todo.clone(), next.clone(), self.stop.clone(), shared.clone(), remote.clone());
            self.prefetch.push(std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(h) = todo.get(i) else { break };
                    if shared.store.has(h) {
                        continue;
                    }
                    // A chunk that fails here is fetched again, and judged,
                    // when a page in it is read.
                    if let Err(e) = remote.fetch_one(&shared.store, h) {
                        tracing::debug!("prefetch of chunk {h}: {e}");
                    }
                }
            }));
        }
    }

    /// For a local image: asks the kernel to read the chunk files ahead,
    /// in address order (the order the page server fills memory in), so
    /// that the disk works on many at once. Measured on the CPU machine: a
    /// cold lazy wake read thousands of 1 MiB files one at a time, 2.5x
    /// slower than one pages file with the kernel's readahead.
    fn start_readahead(&mut self) {
        let paths: Vec<PathBuf> = self
            .files
            .iter()
            .flat_map(|f| f.chunks.iter().map(|c| f.shared.store.path_of(&c.blake3)))
            .collect();
        let paths = Arc::new(paths);
        let next = Arc::new(AtomicUsize::new(0));
        for _ in 0..PREFETCH_THREADS / 2 {
            let (paths, next, stop) = (paths.clone(), next.clone(), self.stop.clone());
            self.prefetch.push(std::thread::spawn(move || {
                use std::os::fd::AsRawFd;
                while !stop.load(Ordering::Relaxed) {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(p) = paths.get(i) else { break };
                    if let Ok(f) = fs::File::open(p) {
                        // SAFETY: a hint on a descriptor this thread owns;
                        // offset 0 and length 0 mean the whole file.
                        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_WILLNEED) };
                    }
                }
            }));
        }
    }

    /// Starts checking every chunk of the image in full in the background,
    /// in address order (the order the page server fills memory and the
    /// driver reads it), at `pace`; each chunk checked is marked so, and
    /// the page server reads it from then on without hashing it again (one
    /// it reaches first it checks itself: no byte reaches a process
    /// unchecked either way). A CUDA wake waits for the end
    /// ([`Workdir::take_verify`]) before any unlock, so that no process
    /// runs on an image with a bad chunk, while its driver restores read
    /// chunks the page server checked (docs/design/wake.md, "Safety"); with
    /// `GPUSNAP_VERIFY_FIRST=1` before any driver restore
    /// ([`Workdir::wait_verify`]).
    pub fn start_verify(&mut self, pace: VerifyPace) {
        if self.verify.is_none() {
            self.verify = Some(self.verify_starter().start(pace).0);
        }
    }

    /// Waits until the background verify ([`Workdir::start_verify`]) has
    /// checked every chunk; the first bad chunk is the error (the image is
    /// refused as corrupt). Without one started: nothing to wait for.
    pub fn wait_verify(&mut self) -> Result<VerifyTimes, ImageError> {
        self.take_verify().map(PendingVerify::wait).unwrap_or(Ok(VerifyTimes::default()))
    }

    /// The background verify, to wait for elsewhere (a CUDA wake whose
    /// driver restores start before it ends waits for it before any
    /// unlock).
    pub fn take_verify(&mut self) -> Option<PendingVerify> {
        self.verify.take().map(PendingVerify)
    }

    /// What starts a verify of the chunks still unchecked, later.
    pub fn verify_starter(&self) -> VerifyStarter {
        VerifyStarter { files: self.files.clone(), stop: self.stop.clone() }
    }

    /// Checks the bytes a mapped wake maps into a process from its map file
    /// (`map`: the file, mapped) against the chunks of the store-held pages
    /// file `pages`. `runs`: (offset in the pages file, length, offset in
    /// `map`). A chunk wholly inside a run is hashed where it lies in the
    /// map; one across a run's edge is read from the store (checked there)
    /// and its bytes in the run compared. Chunks found good are marked
    /// checked, so the background verify leaves them. On `threads` threads.
    /// Returns the bytes checked.
    pub fn check_mapped(
        &self,
        pages: &str,
        runs: &[(u64, u64, u64)],
        map: &[u8],
        threads: usize,
    ) -> Result<u64, ImageError> {
        let f = self.source.files.get(pages).ok_or_else(|| ImageError::Corrupt {
            name: self.name().into(),
            why: format!("{pages} is not a pages file held by the store"),
        })?;
        let corrupt = |why: String| ImageError::Corrupt { name: self.name().into(), why };
        // Work items: (chunk, run) for every chunk a run covers.
        let mut items: Vec<(usize, usize)> = Vec::new();
        for (r, &(ro, rl, mo)) in runs.iter().enumerate() {
            if mo.checked_add(rl).is_none_or(|e| e > map.len() as u64) {
                return Err(corrupt(format!("the map file is shorter than {pages}'s run at {ro:#x}")));
            }
            let mut i = f.ends.partition_point(|&e| e <= ro);
            while i < f.chunks.len() && f.ends[i] - f.chunks[i].size < ro + rl {
                items.push((i, r));
                i += 1;
            }
        }
        let one = |&(i, r): &(usize, usize)| -> Result<(), ImageError> {
            let (ro, rl, mo) = runs[r];
            let c = &f.chunks[i];
            let (cs, ce) = (f.ends[i] - c.size, f.ends[i]);
            let (s, e) = (cs.max(ro), ce.min(ro + rl));
            let at = (mo + (s - ro)) as usize;
            let here = &map[at..at + (e - s) as usize];
            if cs >= ro && ce <= ro + rl {
                if blake3::hash(here).to_hex().as_str() != c.blake3 {
                    return Err(corrupt(format!(
                        "its map file's bytes at {at:#x} are not chunk {} of {pages}",
                        c.blake3
                    )));
                }
                f.checked[f.canon[i] as usize].store(true, Ordering::Relaxed);
                return Ok(());
            }
            let mut b = vec![0u8; (e - s) as usize];
            f.read(s, &mut b)?;
            if b != here {
                return Err(corrupt(format!(
                    "its map file's bytes at {at:#x} differ from {pages} at {s:#x}"
                )));
            }
            Ok(())
        };
        for_each_on(&items, threads, one)?;
        Ok(runs.iter().map(|r| r.1).sum())
    }

    /// Every chunk of the image's store-held files is in the local store.
    pub fn complete(&self) -> bool {
        self.files.iter().all(|f| f.chunks.iter().all(|c| f.shared.store.has(&c.blake3)))
    }

    /// The first chunk that failed its check, if one did (it stays noted:
    /// every later look sees it too).
    pub fn bad(&self) -> Option<ImageError> {
        let name = self.name().to_string();
        self.bad.lock().ok().and_then(|b| b.as_ref().map(|e| copy_of(&name, e)))
    }

    fn name(&self) -> &str {
        self.files.first().map(|f| f.shared.image.as_str()).unwrap_or("image")
    }

    fn io(&self, op: &str, e: io::Error) -> ImageError {
        ImageError::Io { name: self.name().into(), op: op.into(), err: e }
    }
}

/// Runs `f` on every item on `threads` threads (at least one), items taken
/// in order as threads come free; after the first error no item is begun,
/// and that error is the result.
pub(crate) fn for_each_on<T: Sync, E: Send>(
    items: &[T],
    threads: usize,
    f: impl Fn(&T) -> Result<(), E> + Sync,
) -> Result<(), E> {
    let next = AtomicUsize::new(0);
    let failed: Mutex<Option<E>> = Mutex::new(None);
    let stop = AtomicBool::new(false);
    std::thread::scope(|sc| {
        for _ in 0..threads.max(1) {
            sc.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let Some(item) = items.get(next.fetch_add(1, Ordering::Relaxed)) else { break };
                    if let Err(e) = f(item) {
                        stop.store(true, Ordering::Relaxed);
                        if let Ok(mut g) = failed.lock() {
                            g.get_or_insert(e);
                        }
                    }
                }
            });
        }
    });
    match failed.into_inner().ok().flatten() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

impl Drop for Workdir {
    /// The copies hold a process's memory: they go when the wake ends,
    /// whatever its outcome (CRIU's logs in the work directory stay).
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.prefetch.drain(..) {
            let _ = t.join();
        }
        for t in self.verify.take().map(|v| v.threads).unwrap_or_default() {
            let _ = t.join();
        }
        let _ = fs::remove_dir_all(&self.images);
    }
}
