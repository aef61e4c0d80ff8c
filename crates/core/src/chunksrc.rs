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

use crate::image::{mkdir_private, open_regular, ImageError, Manifest};
use gpusnap_chunks::{ChunkError, ChunkRef, LocalStore, Remote};
use gpusnap_pages::{DirSource, PageSource, PagesError, PagesFile};
use std::collections::HashMap;
use std::fs;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Verified chunks kept per file: SHARDS x PER_SHARD (about 64 MiB at the
/// 1 MiB average): the page server's threads read in address order, each
/// a few MiB at a time, so a chunk is wanted again only by a neighbour.
const SHARDS: usize = 32;
const PER_SHARD: usize = 2;
/// Chunks a streaming wake's prefetcher fetches at once.
const PREFETCH_THREADS: usize = 8;

/// The first chunk that failed its check in a wake (the wake's error names
/// it, and it is refused as a corrupt image, exit 2).
pub type Bad = Arc<Mutex<Option<ImageError>>>;

struct Shared {
    image: String,
    store: Arc<LocalStore>,
    remote: Option<Arc<Remote>>,
    bad: Bad,
}

impl Shared {
    /// The verified bytes of chunk `c` of file `path`.
    fn load(&self, path: &str, c: &ChunkRef) -> Result<Vec<u8>, ImageError> {
        let got = match self.store.get(&c.blake3) {
            Err(ChunkError::Missing(_)) if self.remote.is_some() => {
                let r = self.remote.as_ref().expect("checked");
                r.fetch_one(&self.store, &c.blake3).and_then(|_| self.store.get(&c.blake3))
            }
            other => other,
        };
        let fail = |why: String| ImageError::Corrupt { name: self.image.clone(), why };
        match got {
            Ok(d) if d.len() as u64 == c.size => Ok(d),
            Ok(_) => Err(fail(format!("{path}: chunk {} fails its checksum (its size)", c.blake3))),
            Err(ChunkError::Corrupt { hash, why }) => {
                Err(fail(format!("{path}: chunk {hash} fails its checksum ({why})")))
            }
            Err(ChunkError::Missing(hash)) => {
                Err(fail(format!("{path}: chunk {hash} is missing from the store (pull the image again)")))
            }
            Err(e) => Err(ImageError::Io {
                name: self.image.clone(),
                op: format!("read {path}"),
                err: io::Error::other(e.to_string()),
            }),
        }
    }

    fn note(&self, e: &ImageError) {
        if let Ok(mut b) = self.bad.lock() {
            if b.is_none() {
                *b = Some(match e {
                    ImageError::Corrupt { name, why } => {
                        ImageError::Corrupt { name: name.clone(), why: why.clone() }
                    }
                    other => ImageError::Io {
                        name: self.image.clone(),
                        op: "read chunks".into(),
                        err: io::Error::other(other.to_string()),
                    },
                });
            }
        }
    }
}

/// Verified chunks of one shard, by their hash: one chunk that recurs
/// (the zero pages of a preallocated KV cache, a repeated pattern) is read,
/// decoded and checked once, not once per place it appears in the file.
type Shard = Vec<(String, Arc<Vec<u8>>)>;

struct ChunkedFile {
    path: String,
    chunks: Vec<ChunkRef>,
    /// End offset of each chunk (prefix sums of the sizes).
    ends: Vec<u64>,
    cache: Vec<Mutex<Shard>>,
    shared: Arc<Shared>,
}

impl ChunkedFile {
    fn new(path: &str, chunks: &[ChunkRef], shared: Arc<Shared>) -> Self {
        let mut end = 0u64;
        let ends = chunks
            .iter()
            .map(|c| {
                end += c.size;
                end
            })
            .collect();
        Self {
            path: path.into(),
            chunks: chunks.to_vec(),
            ends,
            cache: (0..SHARDS).map(|_| Mutex::new(Vec::with_capacity(PER_SHARD))).collect(),
            shared,
        }
    }

    fn size(&self) -> u64 {
        self.ends.last().copied().unwrap_or(0)
    }

    fn chunk(&self, i: usize) -> Result<Arc<Vec<u8>>, ImageError> {
        let hash = &self.chunks[i].blake3;
        let slot = hash.get(..8).and_then(|h| usize::from_str_radix(h, 16).ok()).unwrap_or(i);
        let shard = &self.cache[slot % SHARDS];
        if let Some(d) =
            shard.lock().ok().and_then(|s| s.iter().find(|(k, _)| k == hash).map(|(_, d)| d.clone()))
        {
            return Ok(d);
        }
        // Read and checked outside the lock: two threads may load one chunk
        // at once, which costs a read, never a wait on another's I/O.
        let d = Arc::new(self.shared.load(&self.path, &self.chunks[i]).inspect_err(|e| self.shared.note(e))?);
        if let Ok(mut s) = shard.lock() {
            if s.len() >= PER_SHARD {
                s.remove(0);
            }
            s.push((hash.clone(), d.clone()));
        }
        Ok(d)
    }

    /// Copies verified bytes at `offset` into `buf`.
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ImageError> {
        let mut pos = offset;
        let mut out = 0usize;
        while out < buf.len() {
            let i = self.ends.partition_point(|&e| e <= pos);
            let Some(c) = self.chunks.get(i) else {
                return Err(ImageError::Corrupt {
                    name: self.shared.image.clone(),
                    why: format!("{}: a read at {pos:#x} is past its end", self.path),
                });
            };
            let data = self.chunk(i)?;
            let from = (pos - (self.ends[i] - c.size)) as usize;
            let n = (data.len() - from).min(buf.len() - out);
            buf[out..out + n].copy_from_slice(&data[from..from + n]);
            out += n;
            pos += n as u64;
        }
        Ok(())
    }
}

impl PagesFile for ChunkedFile {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.read(offset, buf).map_err(|e| io::Error::other(e.to_string()))
    }
}

/// The pages files of an image: those held by the store read chunk by
/// chunk (verified), any other from the image directory (verified whole
/// before the wake).
pub struct StoreSource {
    files: HashMap<String, Arc<ChunkedFile>>,
    dir: DirSource,
}

impl PageSource for StoreSource {
    fn open(&self, name: &str) -> Result<Arc<dyn PagesFile>, PagesError> {
        match self.files.get(name) {
            Some(f) => Ok(f.clone()),
            None => self.dir.open(name),
        }
    }
}

/// A wake's view of an image held (in part) by the chunk store.
pub struct Workdir {
    /// CRIU's images directory for the wake: small files and pages files.
    pub images: PathBuf,
    pub source: Arc<StoreSource>,
    pub bad: Bad,
    files: Vec<Arc<ChunkedFile>>,
    stop: Arc<AtomicBool>,
    prefetch: Vec<std::thread::JoinHandle<()>>,
}

impl Workdir {
    /// Prepares `work/img` for an image whose pages files are (some of them)
    /// in the store: the image's other files copied there. `None`: no file
    /// of the image is in the store (CRIU reads the image as it is).
    pub fn prepare(
        name: &str,
        dir: &Path,
        m: &Manifest,
        store: LocalStore,
        remote: Option<Remote>,
        work: &Path,
    ) -> Result<Option<Self>, ImageError> {
        if !m.files.iter().any(|f| f.in_store(dir)) {
            return Ok(None);
        }
        let ioe = |op: String| move |e: io::Error| ImageError::Io { name: name.into(), op, err: e };
        let images = work.join("img");
        mkdir_private(&images).map_err(ioe("create the restore directory".into()))?;
        let bad: Bad = Arc::new(Mutex::new(None));
        let shared = Arc::new(Shared {
            image: name.into(),
            store: Arc::new(store),
            remote: remote.map(Arc::new),
            bad: bad.clone(),
        });
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
                let cf = Arc::new(ChunkedFile::new(&f.path, &f.chunks, shared.clone()));
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

    /// Every chunk of the image's store-held files is in the local store.
    pub fn complete(&self) -> bool {
        self.files.iter().all(|f| f.chunks.iter().all(|c| f.shared.store.has(&c.blake3)))
    }

    /// The first chunk that failed its check, if one did.
    pub fn bad(&self) -> Option<ImageError> {
        self.bad.lock().ok().and_then(|mut b| b.take())
    }

    fn name(&self) -> &str {
        self.files.first().map(|f| f.shared.image.as_str()).unwrap_or("image")
    }

    fn io(&self, op: &str, e: io::Error) -> ImageError {
        ImageError::Io { name: self.name().into(), op: op.into(), err: e }
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
        let _ = fs::remove_dir_all(&self.images);
    }
}

fn create_private(p: &Path) -> io::Result<fs::File> {
    fs::OpenOptions::new().write(true).create_new(true).mode(0o600).custom_flags(libc::O_NOFOLLOW).open(p)
}
