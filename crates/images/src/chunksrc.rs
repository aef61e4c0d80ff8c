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

use crate::image::{ImageError, Manifest};
use gpusnap_chunks::{ChunkError, ChunkRef, LocalStore, Remote, Scratch};
use gpusnap_files::{create_private, mkdir_private, open_regular};
use gpusnap_pages::{DirSource, PageSource, PagesError, PagesFile};
use std::collections::HashMap;
use std::fs;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::sync::{Arc, Mutex};

/// Decoded chunks kept per file, by hash: SHARDS x PER_SHARD, chunks
/// stored compressed only (a raw chunk, once checked, is read straight
/// from its file into the page server's buffer, as a pages file is). The
/// page server's threads read in address order, each a few MiB at a time,
/// so a chunk is wanted again by the next reads of the same thread or a
/// neighbour's, or, for a chunk that recurs (zero pages, a repeated
/// pattern), anywhere in the file.
const SHARDS: usize = 32;
const PER_SHARD: usize = 2;
/// Decoded bytes a wake keeps of compressed chunks that recur in a file
/// (zero pages of a preallocated KV cache, a repeated pattern: the GPU
/// tests' worker holds 26-49 GB of two patterns, float32 and float64, cut
/// into distinct 4 MiB chunks (375, 1.5 GiB, at 26 GB; more at 49 GB, each
/// pattern meeting the chunks at more offsets), read over and over in
/// address order, which a small cache misses every time): each is decoded
/// once and kept until the wake ends, up to an eighth of the memory
/// available when the wake starts, between [`RECURRING_MIN`] (or a quarter
/// of what is available, if less) and [`RECURRING_MAX`]. With 2 GiB at most,
/// a 49 GB worker's wake on the H200 decoded most chunks again and again:
/// the fill read 3.9 GB/s and the driver's restore waited for it (14.0 s
/// against 7.7 s alone, Run 31).
const RECURRING_MIN: u64 = 2 << 30;
const RECURRING_MAX: u64 = 16 << 30;

/// The budget of kept recurring chunks for a wake that starts with
/// `available` bytes of memory available.
fn recurring_budget(available: u64) -> u64 {
    (available / 8).max(RECURRING_MIN.min(available / 4)).min(RECURRING_MAX)
}
/// Chunk buffers kept for reuse per wake (a fresh multi-MiB buffer per
/// chunk would be faulted in page by page).
const POOL: usize = 32;
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
    /// Chunk buffers to reuse.
    pool: Mutex<Vec<Vec<u8>>>,
    /// Chunks read whole (decoded, checked) so far: by the fill and the
    /// verify, each once unless evicted from the cache.
    loads: AtomicU64,
    /// Bytes kept of recurring chunks (at most `recurring_budget`).
    recurring: AtomicU64,
    recurring_budget: u64,
    /// Raw chunks given to the page server in place, from their files'
    /// mapping (`GPUSNAP_PAGES_MAP_RAW=1`), rather than read into its
    /// buffer (the default). One mapping per chunk costs an `mmap` and a
    /// `munmap` (a TLB shootdown across the page server's cores): on the
    /// H200 with 8 fill and 8 verify threads the fill of 20.5 GB of random
    /// memory ran at 6.2-6.5 GB/s mapped against 8.1-8.4 GB/s read, on one
    /// host, alternating (Run 36).
    map_raw: bool,
}

thread_local! {
    /// A reading thread's zstd context, encoded-chunk buffer and the raw
    /// chunk file it read last.
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// Runs `f` with this thread's [`SCRATCH`] (a fresh one if it is in use
/// further up the stack).
fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut s) => f(&mut s),
        Err(_) => f(&mut Scratch::default()),
    })
}

impl Shared {
    fn new(image: &str, store: LocalStore, remote: Option<Remote>, bad: Bad, map_raw: bool) -> Arc<Self> {
        Arc::new(Self {
            image: image.into(),
            store: Arc::new(store),
            remote: remote.map(Arc::new),
            bad,
            pool: Mutex::new(Vec::new()),
            loads: AtomicU64::new(0),
            recurring: AtomicU64::new(0),
            recurring_budget: recurring_budget(
                meminfo().map(|(_, avail)| avail).unwrap_or(RECURRING_MIN * 4),
            ),
            map_raw,
        })
    }

    /// Reads chunk `c` of file `path` into `out`, decoded, and checked
    /// against its blake3 unless `checked` (checked in full already in this
    /// wake); fetched from the remote first when the store lacks it.
    /// Returns whether it is stored raw.
    fn load(&self, path: &str, c: &ChunkRef, out: &mut Vec<u8>, checked: bool) -> Result<bool, ImageError> {
        self.loads.fetch_add(1, Ordering::Relaxed);
        let mut read =
            |checked: bool| with_scratch(|s| self.store.read_into(&c.blake3, c.size, out, s, checked));
        let got = match read(checked) {
            Err(ChunkError::Missing(_)) if self.remote.is_some() => {
                let r = self.remote.as_ref().expect("checked");
                r.fetch_one(&self.store, &c.blake3).and_then(|_| read(false))
            }
            other => other,
        };
        let fail = |why: String| ImageError::Corrupt { name: self.image.clone(), why };
        match got {
            Ok(raw) => Ok(raw),
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

    fn buffer(&self) -> Vec<u8> {
        self.pool.lock().ok().and_then(|mut p| p.pop()).unwrap_or_default()
    }

    fn give_back(&self, b: Vec<u8>) {
        if let Ok(mut p) = self.pool.lock() {
            if p.len() < POOL {
                p.push(b);
            }
        }
    }

    fn note(&self, e: &ImageError) {
        if let Ok(mut b) = self.bad.lock() {
            if b.is_none() {
                *b = Some(copy_of(&self.image, e));
            }
        }
    }
}

/// `e` as the wake's error ([`Bad`]): a corrupt chunk as it is, anything
/// else as a failed read of the image's chunks.
fn copy_of(image: &str, e: &ImageError) -> ImageError {
    match e {
        ImageError::Corrupt { name, why } => ImageError::Corrupt { name: name.clone(), why: why.clone() },
        other => ImageError::Io {
            name: image.to_string(),
            op: "read chunks".into(),
            err: io::Error::other(other.to_string()),
        },
    }
}

/// Decoded chunks of one shard, by their hash, the most recently used last.
type Shard = Vec<(String, Arc<Vec<u8>>)>;

struct ChunkedFile {
    path: String,
    chunks: Vec<ChunkRef>,
    /// End offset of each chunk (prefix sums of the sizes).
    ends: Vec<u64>,
    /// The first index of chunk i's hash in the file: a chunk that recurs
    /// is checked, and kept, by that index.
    canon: Vec<u32>,
    /// Chunk i's hash occurs more than once in the file.
    recurs: Vec<bool>,
    /// By canonical index: checked in full in this wake (by the verify
    /// before it, or by a read): its bytes are read from then on without
    /// hashing them again. The store is root's only: a chunk's file holds
    /// the bytes that were checked, as an image directory's pages file does
    /// after the verify that precedes every wake.
    checked: Vec<AtomicBool>,
    /// By canonical index: the decoded bytes of a compressed chunk that
    /// recurs (see [`RECURRING_MIN`]).
    kept: Vec<OnceLock<Arc<Vec<u8>>>>,
    /// By canonical index: stored compressed (found so by a mapping that
    /// was refused), so not mapped again.
    unmappable: Vec<AtomicBool>,
    /// Raw chunks' mappings (`GPUSNAP_PAGES_MAP_RAW=1`), by canonical index,
    /// kept until the wake ends: unmapping one while the fill runs is a TLB
    /// shootdown across every core the page server's threads are on
    /// (session 7: mapping and unmapping a chunk per read slowed the fill
    /// from 8.1-8.4 to 6.2-6.5 GB/s on the H200).
    mapped: Vec<OnceLock<Arc<memmap2::Mmap>>>,
    /// By canonical index: held by the one thread reading, decoding and
    /// checking the chunk (a fill thread or the verify), so that no other
    /// does it again at the same time: the fill threads on either side of a
    /// batch's edge, and the verify, which starts where the fill does, met
    /// on the same compressed chunks and each decoded them (H200, Runs
    /// 54-55: 5-8 ms a MiB where a decode takes ~1.5). A waiting thread
    /// then finds the chunk checked, and decoded in the cache.
    loading: Vec<Mutex<()>>,
    /// By canonical index: a fill thread waits for the chunk's `loading`:
    /// the verify then leaves what it decoded in the cache.
    wanted: Vec<AtomicBool>,
    cache: Vec<Mutex<Shard>>,
    shared: Arc<Shared>,
}

impl ChunkedFile {
    fn new(path: &str, chunks: &[ChunkRef], shared: Arc<Shared>, checked: bool) -> Self {
        let mut end = 0u64;
        let ends = chunks
            .iter()
            .map(|c| {
                end += c.size;
                end
            })
            .collect();
        let mut first: HashMap<&str, u32> = HashMap::new();
        let canon: Vec<u32> = chunks
            .iter()
            .enumerate()
            .map(|(i, c)| *first.entry(c.blake3.as_str()).or_insert(i as u32))
            .collect();
        let mut count = vec![0u32; chunks.len()];
        for &k in &canon {
            count[k as usize] += 1;
        }
        let recurs = canon.iter().map(|&k| count[k as usize] > 1).collect();
        Self {
            path: path.into(),
            chunks: chunks.to_vec(),
            ends,
            canon,
            recurs,
            checked: chunks.iter().map(|_| AtomicBool::new(checked)).collect(),
            kept: chunks.iter().map(|_| OnceLock::new()).collect(),
            unmappable: chunks.iter().map(|_| AtomicBool::new(false)).collect(),
            mapped: chunks.iter().map(|_| OnceLock::new()).collect(),
            loading: chunks.iter().map(|_| Mutex::new(())).collect(),
            wanted: chunks.iter().map(|_| AtomicBool::new(false)).collect(),
            cache: (0..SHARDS).map(|_| Mutex::new(Vec::with_capacity(PER_SHARD))).collect(),
            shared,
        }
    }

    fn size(&self) -> u64 {
        self.ends.last().copied().unwrap_or(0)
    }

    fn shard(&self, i: usize) -> &Mutex<Shard> {
        let hash = &self.chunks[i].blake3;
        let slot = hash.get(..8).and_then(|h| usize::from_str_radix(h, 16).ok()).unwrap_or(i);
        &self.cache[slot % SHARDS]
    }

    /// Copies bytes `from..from + dst.len()` of chunk `i` into `dst`,
    /// checked: from the cache, straight from a raw chunk's file once the
    /// chunk was checked, else the whole chunk read, decoded and checked,
    /// by one thread at a time (`loading`).
    fn piece(&self, i: usize, from: usize, dst: &mut [u8]) -> Result<(), ImageError> {
        let k = self.canon[i] as usize;
        if self.at_hand(i, from, dst) {
            return Ok(());
        }
        if !self.checked[k].load(Ordering::Relaxed) {
            if let Some(m) = self.shared.map_raw.then(|| self.raw_mapped(i)).flatten() {
                // A raw chunk not checked yet: hashed in place, then copied
                // from there (the page server then finds it mapped and
                // checked), rather than read whole into a buffer to hash it.
                dst.copy_from_slice(&m[1 + from..1 + from + dst.len()]);
                return Ok(());
            }
        }
        // One thread loads the chunk; one that comes meanwhile waits for it
        // and then finds it as above (what the verify decodes for a waiting
        // fill it leaves in the cache).
        let _one = self.load_lock(k, || {
            self.wanted[k].store(true, Ordering::Relaxed);
            true
        });
        if self.at_hand(i, from, dst) {
            return Ok(());
        }
        let checked = self.checked[k].load(Ordering::Relaxed);
        let mut b = self.shared.buffer();
        let raw = match self.shared.load(&self.path, &self.chunks[i], &mut b, checked) {
            Ok(raw) => raw,
            Err(e) => {
                self.shared.note(&e);
                self.shared.give_back(b);
                return Err(e);
            }
        };
        self.checked[k].store(true, Ordering::Relaxed);
        dst.copy_from_slice(&b[from..from + dst.len()]);
        if raw {
            self.shared.give_back(b);
            return Ok(());
        }
        let held = b.capacity() as u64;
        if self.recurs[i] && self.room(held) {
            if let Err(b) = self.kept[k].set(Arc::new(b)) {
                // Another thread kept it first.
                self.shared.recurring.fetch_sub(held, Ordering::Relaxed);
                self.shared.give_back(Arc::try_unwrap(b).unwrap_or_default());
            }
            return Ok(());
        }
        self.keep_decoded(i, b);
        Ok(())
    }

    /// Copies bytes of chunk `i` from where they are at hand, if they are:
    /// its kept bytes, the cache, or a raw chunk's file once checked.
    fn at_hand(&self, i: usize, from: usize, dst: &mut [u8]) -> bool {
        if let Some(d) = self.kept[self.canon[i] as usize].get() {
            dst.copy_from_slice(&d[from..from + dst.len()]);
            return true;
        }
        self.cached(i, from, dst) || self.checked_raw(i, from, dst)
    }

    /// Takes `loading[k]`, the right to load canonical chunk `k`. Held by
    /// another thread: `busy` says whether to wait for it (`None`: not).
    fn load_lock(&self, k: usize, busy: impl FnOnce() -> bool) -> Option<std::sync::MutexGuard<'_, ()>> {
        match self.loading[k].try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::WouldBlock) => {
                busy().then(|| self.loading[k].lock().unwrap_or_else(|e| e.into_inner()))
            }
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
        }
    }

    /// Copies from the cache of decoded chunks, if chunk `i` is there.
    fn cached(&self, i: usize, from: usize, dst: &mut [u8]) -> bool {
        let c = &self.chunks[i];
        if let Ok(mut s) = self.shard(i).lock() {
            if let Some(pos) = s.iter().position(|(h, _)| *h == c.blake3) {
                let e = s.remove(pos);
                dst.copy_from_slice(&e.1[from..from + dst.len()]);
                s.push(e);
                return true;
            }
        }
        false
    }

    /// Reads straight from chunk `i`'s file if it was checked in this wake
    /// and is stored raw. Any error here is reported by the whole read
    /// that follows (`false`).
    fn checked_raw(&self, i: usize, from: usize, dst: &mut [u8]) -> bool {
        let (c, k) = (&self.chunks[i], self.canon[i] as usize);
        self.checked[k].load(Ordering::Relaxed)
            && matches!(
                with_scratch(|s| self.shared.store.read_checked_raw_at(
                    &c.blake3,
                    c.size,
                    from as u64,
                    dst,
                    s
                )),
                Ok(true)
            )
    }

    /// Keeps the decoded bytes of chunk `i` in the cache, the least
    /// recently used of its shard going back to the pool.
    fn keep_decoded(&self, i: usize, b: Vec<u8>) {
        let c = &self.chunks[i];
        let old = match self.shard(i).lock() {
            Ok(mut s) if !s.iter().any(|(h, _)| *h == c.blake3) => {
                s.push((c.blake3.clone(), Arc::new(b)));
                (s.len() > PER_SHARD).then(|| s.remove(0).1)
            }
            _ => Some(Arc::new(b)),
        };
        if let Some(v) = old.and_then(|a| Arc::try_unwrap(a).ok()) {
            self.shared.give_back(v);
        }
    }

    /// Chunk `i`'s file mapped (a tag byte, then the chunk), if it is
    /// stored raw: hashed from the mapping first if it was not checked yet
    /// in this wake, then marked checked. `None` for a compressed chunk
    /// (remembered: not opened for that again) and for one that fails its
    /// check (a read then reports it).
    fn raw_mapped(&self, i: usize) -> Option<Arc<memmap2::Mmap>> {
        let (c, k) = (&self.chunks[i], self.canon[i] as usize);
        if let Some(m) = self.mapped[k].get() {
            return Some(m.clone());
        }
        if self.unmappable[k].load(Ordering::Relaxed) {
            return None;
        }
        let checked = self.checked[k].load(Ordering::Relaxed);
        let store = &self.shared.store;
        match with_scratch(|s| store.map_checked_raw(&c.blake3, c.size, s, checked)) {
            Ok(Some(m)) => {
                self.checked[k].store(true, Ordering::Relaxed);
                // Kept (only checked mappings come back): another thread's,
                // if it was first.
                Some(self.mapped[k].get_or_init(|| m).clone())
            }
            Ok(None) => {
                self.unmappable[k].store(true, Ordering::Relaxed);
                None
            }
            Err(_) => None,
        }
    }

    /// Room in the wake's budget ([`recurring_budget`]) to keep `bytes`
    /// more (taken when there is).
    fn room(&self, bytes: u64) -> bool {
        let used = self.shared.recurring.fetch_add(bytes, Ordering::Relaxed);
        if used + bytes > self.shared.recurring_budget {
            self.shared.recurring.fetch_sub(bytes, Ordering::Relaxed);
            return false;
        }
        true
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
            let from = (pos - (self.ends[i] - c.size)) as usize;
            let n = (c.size as usize - from).min(buf.len() - out);
            self.piece(i, from, &mut buf[out..out + n])?;
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

    /// The bytes at `offset`, up to `len` but not past the end of their
    /// chunk, in place: a recurring compressed chunk's kept bytes, or a
    /// raw chunk's file's mapping, the whole chunk hashed from
    /// there first if it was not checked yet in this wake; anything else
    /// (and a chunk that fails its check: the read reports it) is read and
    /// checked.
    fn map_at(&self, offset: u64, len: usize) -> Option<gpusnap_pages::Mapped> {
        let i = self.ends.partition_point(|&e| e <= offset);
        let c = self.chunks.get(i)?;
        let from = offset - (self.ends[i] - c.size);
        // Up to the chunk's end: the caller reads a page across it.
        let len = len.min((c.size - from) as usize);
        let k = self.canon[i] as usize;
        // A recurring compressed chunk decoded (and checked) already: from
        // its kept bytes, not copied into the fill's buffer first.
        if let Some(d) = self.kept[k].get() {
            let hold: Arc<dyn AsRef<[u8]> + Send + Sync> = d.clone();
            return Some(gpusnap_pages::Mapped { hold, start: from as usize, len });
        }
        if !self.shared.map_raw {
            return None;
        }
        let m = self.raw_mapped(i)?;
        // The file is a tag byte, then the chunk.
        Some(gpusnap_pages::Mapped { hold: m, start: 1 + from as usize, len })
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

/// One store-held pages file as the page server reads it, for
/// benchmarks (`examples/bench_pagesrc.rs`): `verified`, every chunk of it
/// was checked in full in this wake already (the up-front verify).
#[doc(hidden)]
/// The host's total and available memory, bytes (`/proc/meminfo`).
pub fn meminfo() -> Option<(u64, u64)> {
    use procfs::Current;
    let m = procfs::Meminfo::current().ok()?;
    Some((m.mem_total, m.mem_available?))
}

pub fn bench_file(
    image: &str,
    path: &str,
    chunks: &[ChunkRef],
    store: LocalStore,
    verified: bool,
) -> Arc<dyn PagesFile> {
    let shared = Shared::new(image, store, None, Arc::new(Mutex::new(None)), map_raw_from_env());
    Arc::new(ChunkedFile::new(path, chunks, shared, verified))
}

/// One distinct chunk for the background verify: its file and index, and
/// every (file, canonical index) it marks checked.
type ToCheck = (usize, usize, Vec<(usize, usize)>);

/// The threads of [`Workdir::start_verify`].
/// How the background verify runs: beside the driver's restores it takes
/// half the cores below their priority (the page server's fill checks any
/// chunk it reaches first, so the verify only has to end before the
/// unlocks); before them, every core.
#[derive(Clone, Copy, Debug)]
pub struct VerifyPace {
    pub threads: usize,
    pub nice: i32,
    /// SCHED_IDLE (then `nice` does not apply; `gpusnap_pages::prio`).
    pub idle: bool,
    /// From the top address down, meeting the page server's fill (which
    /// goes up and checks a chunk it reaches first itself) in the middle:
    /// each chunk read for its check once, by one of them, instead of the
    /// verify reading all of them beside the fill. No gain on the H200
    /// (Run 35).
    pub downwards: bool,
}

impl VerifyPace {
    pub fn all_cores() -> Self {
        Self { threads: cores().clamp(1, 16), nice: 0, idle: false, downwards: false }
    }
    pub fn beside_the_driver() -> Self {
        Self { threads: (cores() / 2).clamp(2, 8), nice: 10, idle: false, downwards: false }
    }

    /// [`VerifyPace::beside_the_driver`] with `GPUSNAP_VERIFY_THREADS`
    /// (0: no verify beside the driver; what the page server has not
    /// checked by the unlocks is checked then, on every core) and
    /// `GPUSNAP_VERIFY_NICE` applied, so that a GPU run can compare them
    /// (docs/pages.md, settings); a value that is not one is said and left.
    pub fn beside_the_driver_from_env() -> Self {
        Self::beside_the_driver_from(|k| std::env::var(k).ok())
    }

    /// As [`VerifyPace::beside_the_driver_from_env`], reading variables through `get`.
    fn beside_the_driver_from(get: impl Fn(&str) -> Option<String>) -> Self {
        let mut p = Self::beside_the_driver();
        let num = |name: &str, max: i64| -> Option<i64> {
            let v = get(name)?;
            match v.trim().parse::<i64>() {
                Ok(n) if (0..=max).contains(&n) => Some(n),
                _ => {
                    tracing::warn!("{name}={v}: not a number from 0 to {max}; ignored");
                    None
                }
            }
        };
        if let Some(n) = num(VERIFY_THREADS_ENV, 64) {
            p.threads = n as usize;
        }
        if let Some(n) = num(VERIFY_NICE_ENV, 19) {
            p.nice = n as i32;
        }
        for (name, field) in [(VERIFY_IDLE_ENV, &mut p.idle), (VERIFY_DOWN_ENV, &mut p.downwards)] {
            *field = gpusnap_pages::flag_setting(name, get(name), *field);
        }
        p
    }
}

/// Threads of the verify beside a wake's driver restores (see
/// [`VerifyPace::beside_the_driver_from_env`]).
pub const VERIFY_THREADS_ENV: &str = "GPUSNAP_VERIFY_THREADS";
/// Their nice value.
pub const VERIFY_NICE_ENV: &str = "GPUSNAP_VERIFY_NICE";
/// Whether they run as SCHED_IDLE (1) or at their nice value (0, the default).
pub const VERIFY_IDLE_ENV: &str = "GPUSNAP_VERIFY_IDLE";
/// Whether they go from the top address down (1) or up (0, the default).
pub const VERIFY_DOWN_ENV: &str = "GPUSNAP_VERIFY_DOWN";

/// Whether raw chunks are given to the page server from their files'
/// mapping (1) or read into its buffer (0, the default; see
/// `Shared::map_raw`).
pub const PAGES_MAP_RAW_ENV: &str = "GPUSNAP_PAGES_MAP_RAW";

/// [`PAGES_MAP_RAW_ENV`] as set; a value that is not 1 or 0 is said and left.
fn map_raw_from_env() -> bool {
    map_raw_from(std::env::var(PAGES_MAP_RAW_ENV).ok())
}

fn map_raw_from(v: Option<String>) -> bool {
    gpusnap_pages::flag_setting(PAGES_MAP_RAW_ENV, v, false)
}

/// Starts a verify of an image's chunks later, from another thread (the
/// unlocks' gate of a wake whose verify did not run beside the driver):
/// chunks checked meanwhile are skipped.
pub struct VerifyStarter {
    files: Vec<Arc<ChunkedFile>>,
    stop: Arc<AtomicBool>,
}

impl VerifyStarter {
    pub fn start(&self, pace: VerifyPace) -> PendingVerify {
        PendingVerify(spawn_verify(&self.files, self.stop.clone(), pace))
    }
}

fn cores() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(4)
}

fn spawn_verify(files: &[Arc<ChunkedFile>], stop: Arc<AtomicBool>, pace: VerifyPace) -> Verify {
    // Each distinct chunk once, at its first place in address order,
    // with every (file, canonical index) it marks.
    let mut todo: Vec<ToCheck> = Vec::new();
    let mut at: HashMap<&str, usize> = HashMap::new();
    for (fi, f) in files.iter().enumerate() {
        for (i, c) in f.chunks.iter().enumerate() {
            let k = f.canon[i] as usize;
            if k != i {
                continue;
            }
            match at.get(c.blake3.as_str()) {
                Some(&t) => todo[t].2.push((fi, k)),
                None => {
                    at.insert(c.blake3.as_str(), todo.len());
                    todo.push((fi, i, vec![(fi, k)]));
                }
            }
        }
    }
    if pace.downwards {
        todo.reverse();
    }
    let todo = Arc::new(todo);
    let files = Arc::new(files.to_vec());
    let next = Arc::new(AtomicUsize::new(0));
    let failed: Arc<Mutex<Option<(usize, ImageError)>>> = Arc::new(Mutex::new(None));
    let took_ms = Arc::new(AtomicU64::new(0));
    let started = std::time::Instant::now();
    let mut threads = Vec::new();
    for _ in 0..pace.threads.min(todo.len()).max(1) {
        let (todo, files, next, failed, took, stop) =
            (todo.clone(), files.clone(), next.clone(), failed.clone(), took_ms.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            if let Err(e) = gpusnap_pages::prio::lower_this_thread(pace.nice, pace.idle) {
                tracing::warn!("verify: cannot lower the threads' priority: {e}");
            }
            let Some(first) = files.first() else { return };
            let shared = first.shared.clone();
            let mut buf = shared.buffer();
            // Chunks a fill thread was loading when this thread came to
            // them: it checks them itself; any it has not by the end are
            // checked then.
            let mut later = Vec::new();
            let check = |j: usize, wait: bool, buf: &mut Vec<u8>| -> bool {
                let (fi, i, marks) = &todo[j];
                let f = &files[*fi];
                let done = || marks.iter().all(|&(g, k)| files[g].checked[k].load(Ordering::Relaxed));
                if done() {
                    return true;
                }
                let Some(_one) = f.load_lock(*i, || wait) else { return false };
                if done() {
                    return true;
                }
                match shared.load(&f.path, &f.chunks[*i], buf, false) {
                    Ok(raw) => {
                        for &(g, k) in marks {
                            files[g].checked[k].store(true, Ordering::Relaxed);
                        }
                        // A fill thread waits for this chunk: what it needs
                        // is decoded already.
                        if !raw && f.wanted[*i].load(Ordering::Relaxed) {
                            f.keep_decoded(*i, std::mem::replace(buf, shared.buffer()));
                        }
                    }
                    Err(e) => {
                        shared.note(&e);
                        if let Ok(mut g) = failed.lock() {
                            if g.as_ref().is_none_or(|(at, _)| j < *at) {
                                *g = Some((j, e));
                            }
                        }
                    }
                }
                true
            };
            let stopped =
                || stop.load(Ordering::Relaxed) || failed.lock().map(|g| g.is_some()).unwrap_or(true);
            loop {
                if stopped() {
                    break;
                }
                let j = next.fetch_add(1, Ordering::Relaxed);
                if j >= todo.len() {
                    break;
                }
                if !check(j, false, &mut buf) {
                    later.push(j);
                }
            }
            for j in later {
                if stopped() {
                    break;
                }
                check(j, true, &mut buf);
            }
            shared.give_back(buf);
            took.fetch_max(started.elapsed().as_millis() as u64, Ordering::Relaxed);
        }));
    }
    let image = files.first().map(|f| f.shared.image.clone()).unwrap_or_default();
    Verify { image, threads, failed, took_ms }
}

/// Waits for the threads of [`spawn_verify`]; the first bad chunk is the error.
fn join_verify(v: Verify) -> Result<VerifyTimes, ImageError> {
    let t = std::time::Instant::now();
    // A thread that panicked left chunks unchecked: never a pass.
    let mut whole = true;
    for h in v.threads {
        whole &= h.join().is_ok();
    }
    let wait_ms = t.elapsed().as_millis() as u64;
    match v.failed.lock().ok().and_then(|mut g| g.take()) {
        Some((_, e)) => Err(e),
        None if !whole => Err(ImageError::Io {
            name: v.image,
            op: "verify chunks".into(),
            err: io::Error::other("a verify thread failed"),
        }),
        None => Ok(VerifyTimes { verify_ms: v.took_ms.load(Ordering::Relaxed), wait_ms }),
    }
}

/// One store-held pages file as the page server reads it while the
/// background verify of a CUDA wake runs over it, for benchmarks: wait on
/// the second (the verify's end) once the reads are done.
#[doc(hidden)]
pub fn bench_file_verifying(
    image: &str,
    path: &str,
    chunks: &[ChunkRef],
    store: LocalStore,
) -> (Arc<dyn PagesFile>, PendingVerify) {
    bench_file_verifying_at(image, path, chunks, store, VerifyPace::all_cores())
}

/// [`bench_file_verifying`] with the verify at `pace`.
#[doc(hidden)]
pub fn bench_file_verifying_at(
    image: &str,
    path: &str,
    chunks: &[ChunkRef],
    store: LocalStore,
    pace: VerifyPace,
) -> (Arc<dyn PagesFile>, PendingVerify) {
    let shared = Shared::new(image, store, None, Arc::new(Mutex::new(None)), map_raw_from_env());
    let f = Arc::new(ChunkedFile::new(path, chunks, shared, false));
    let v = spawn_verify(std::slice::from_ref(&f), Arc::new(AtomicBool::new(false)), pace);
    (f, PendingVerify(v))
}

/// A background verify still running ([`Workdir::take_verify`],
/// [`bench_file_verifying`]).
pub struct PendingVerify(Verify);

impl PendingVerify {
    /// Waits until every chunk was checked; the first bad one is the error.
    pub fn wait(self) -> Result<VerifyTimes, ImageError> {
        join_verify(self.0)
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
    verify: Option<Verify>,
}

/// The whole-image verify of a lazy CUDA wake, run in the background while
/// CRIU restores the tree and the page server fills its memory (see
/// [`Workdir::start_verify`]).
struct Verify {
    image: String,
    threads: Vec<std::thread::JoinHandle<()>>,
    /// The first chunk that failed, by its position in address order.
    failed: Arc<Mutex<Option<(usize, ImageError)>>>,
    /// Ms from the start until the last thread ended.
    took_ms: Arc<AtomicU64>,
}

/// What the background verify took ([`Workdir::wait_verify`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct VerifyTimes {
    /// From its start until every chunk was checked.
    pub verify_ms: u64,
    /// How long the caller waited for it (the rest overlapped the restore).
    pub wait_ms: u64,
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
    /// chunks the page server checked (docs/pages.md, "Safety"); with
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

#[cfg(test)]
mod tests {
    use super::*;
    use rand::RngCore;

    /// 8 MiB of random bytes (raw chunks), then 24 MiB of a pattern whose
    /// period divides the largest chunk (compressed chunks that recur),
    /// stored as chunks.
    fn stored(dir: &Path) -> (Vec<u8>, Vec<ChunkRef>) {
        let mut data = vec![0u8; 8 << 20];
        rand::thread_rng().fill_bytes(&mut data);
        data.extend((0..24u32 << 20).map(|i| (i % 256) as u8));
        let store = LocalStore::open(dir.join("store")).unwrap();
        let st = gpusnap_chunks::store_slice(&data, 2, &store, false, &|_| {}).unwrap();
        store.finish(st.staged, false).unwrap();
        (data, st.chunks)
    }

    fn read_all(f: &Arc<dyn PagesFile>, len: usize) -> io::Result<Vec<u8>> {
        let mut out = vec![0u8; len];
        // Odd pieces, so that reads start and end inside chunks.
        for (k, piece) in out.chunks_mut(700_001).enumerate() {
            f.read_at(k as u64 * 700_001, piece)?;
        }
        Ok(out)
    }

    #[test]
    fn chunks_are_given_in_place_only_once_checked() {
        let d = tempfile::tempdir().unwrap();
        let (data, chunks) = stored(d.path());
        let store = || LocalStore::open(d.path().join("store")).unwrap();
        let file = |checked: bool| {
            let shared = Shared::new("img", store(), None, Arc::new(Mutex::new(None)), true);
            ChunkedFile::new("pages-1.img", &chunks, shared, checked)
        };
        let f = file(false);
        let (mut at, mut mapped, mut later) = (0u64, 0, 0);
        for (i, c) in chunks.iter().enumerate() {
            let want = &data[at as usize..(at + c.size) as usize];
            match f.map_at(at, c.size as usize) {
                // A raw chunk, hashed from its mapping: checked from now on.
                Some(m) => {
                    assert_eq!(m.bytes(), want);
                    assert!(f.checked[f.canon[i] as usize].load(Ordering::Relaxed));
                    mapped += 1;
                }
                // A compressed one: read (decoded, checked, kept when it
                // recurs), then in place if it was kept.
                None => {
                    let mut b = vec![0u8; c.size as usize];
                    f.read_at(at, &mut b).unwrap();
                    assert_eq!(b, want);
                    if let Some(m) = f.map_at(at, c.size as usize) {
                        assert_eq!(m.bytes(), want);
                        later += 1;
                    }
                }
            }
            // A piece across two chunks is given up to the first one's end.
            if i + 1 < chunks.len() {
                if let Some(m) = f.map_at(at + c.size - 4096, 8192) {
                    assert_eq!(m.bytes(), &want[want.len() - 4096..]);
                }
            }
            at += c.size;
        }
        assert!(mapped > 0 && later > 0, "raw {mapped}, kept {later}");
        // A raw chunk with a flipped byte is not given in place, and its
        // read fails, unless it was checked before (then it is trusted, as
        // an image directory's pages file is after its verify).
        let c0 = &chunks[0];
        let p = store().path_of(&c0.blake3);
        let mut b = std::fs::read(&p).unwrap();
        b[100] ^= 1;
        std::fs::write(&p, b).unwrap();
        let f = file(false);
        assert!(f.map_at(0, 4096).is_none());
        assert!(f.read_at(0, &mut [0u8; 4096]).is_err());
        assert!(file(true).map_at(0, 4096).is_some());
    }

    #[test]
    fn raw_chunks_are_read_not_mapped_unless_asked() {
        let d = tempfile::tempdir().unwrap();
        let (data, chunks) = stored(d.path());
        let shared = Shared::new(
            "img",
            LocalStore::open(d.path().join("store")).unwrap(),
            None,
            Arc::default(),
            false,
        );
        let f = ChunkedFile::new("pages-1.img", &chunks, shared, false);
        let (mut at, mut raw, mut kept) = (0u64, 0, 0);
        for c in &chunks {
            let want = &data[at as usize..(at + c.size) as usize];
            let mut b = vec![0u8; c.size as usize];
            f.read_at(at, &mut b).unwrap();
            assert_eq!(b, want);
            // Read once: a recurring compressed chunk is kept and given in
            // place from then on; a raw one never is.
            match f.map_at(at, c.size as usize) {
                Some(m) => {
                    assert_eq!(m.bytes(), want);
                    kept += 1;
                }
                None => raw += 1,
            }
            at += c.size;
        }
        assert!(raw > 0 && kept > 0, "raw {raw}, kept {kept}");
        assert_eq!(read_all(&(Arc::new(f) as Arc<dyn PagesFile>), data.len()).unwrap(), data);
        // The setting: 1 or 0, anything else ignored (off).
        assert!(map_raw_from(Some("1".into())));
        assert!(!map_raw_from(Some("0".into())));
        assert!(!map_raw_from(Some("yes please".into())));
        assert!(!map_raw_from(None));
    }

    #[test]
    fn the_recurring_chunks_budget_follows_the_memory_available() {
        const G: u64 = 1 << 30;
        assert_eq!(recurring_budget(70 * G), 70 * G / 8);
        assert_eq!(recurring_budget(500 * G), RECURRING_MAX);
        assert_eq!(recurring_budget(12 * G), RECURRING_MIN);
        assert_eq!(recurring_budget(4 * G), G);
        assert_eq!(recurring_budget(0), 0);
    }

    #[test]
    fn the_verify_pace_takes_its_settings_and_ignores_nonsense() {
        let d = VerifyPace::beside_the_driver();
        let with = |kv: &[(&str, &str)]| {
            VerifyPace::beside_the_driver_from(|k| {
                kv.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
            })
        };
        let p = with(&[
            (VERIFY_THREADS_ENV, "0"),
            (VERIFY_NICE_ENV, "5"),
            (VERIFY_IDLE_ENV, "1"),
            (VERIFY_DOWN_ENV, "1"),
        ]);
        assert_eq!((p.threads, p.nice, p.idle, p.downwards), (0, 5, true, true));
        assert!(!d.idle && !d.downwards);
        for bad in ["-1", "65", "lots", ""] {
            let p = with(&[
                (VERIFY_THREADS_ENV, bad),
                (VERIFY_NICE_ENV, bad),
                (VERIFY_IDLE_ENV, bad),
                (VERIFY_DOWN_ENV, bad),
            ]);
            assert_eq!(
                (p.threads, p.nice, p.idle, p.downwards),
                (d.threads, d.nice, d.idle, d.downwards),
                "{bad:?}"
            );
        }
        assert_eq!(with(&[(VERIFY_NICE_ENV, "20")]).nice, d.nice);
    }

    #[test]
    fn chunked_reads_give_the_bytes_checked_or_not_and_twice() {
        let d = tempfile::tempdir().unwrap();
        let (data, chunks) = stored(d.path());
        let distinct: std::collections::HashSet<_> = chunks.iter().map(|c| &c.blake3).collect();
        assert!(distinct.len() < chunks.len(), "the pattern's chunks recur");
        for checked in [false, true] {
            let store = LocalStore::open(d.path().join("store")).unwrap();
            let f = bench_file("t", "criu/pages-1.img", &chunks, store, checked);
            // Twice: the second pass reads checked raw chunks straight from
            // their files and the recurring ones from memory.
            assert!(read_all(&f, data.len()).unwrap() == data);
            assert!(read_all(&f, data.len()).unwrap() == data);
        }
    }

    #[test]
    fn a_damaged_chunk_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let (data, chunks) = stored(d.path());
        let store = LocalStore::open(d.path().join("store")).unwrap();
        let p = store.path_of(&chunks[0].blake3);
        let mut b = fs::read(&p).unwrap();
        assert_eq!(b[0], b'R');
        b[100] ^= 1;
        fs::write(&p, &b).unwrap();
        let f = bench_file("t", "criu/pages-1.img", &chunks, store, false);
        let mut buf = vec![0u8; 4096];
        let e = f.read_at(0, &mut buf).unwrap_err();
        assert!(e.to_string().contains("fails its checksum"), "{e}");
        // The wake's verify refuses it too (before any process exists).
        let store = LocalStore::open(d.path().join("store")).unwrap();
        assert!(store.verify_chunks(&chunks, 2).is_err());
        // A chunk that was not damaged still reads.
        let at = chunks[0].size;
        f.read_at(at, &mut buf).unwrap();
        assert!(buf[..] == data[at as usize..at as usize + 4096]);
        // The background verify of a CUDA wake finds it, and the reads
        // beside it still refuse it.
        let store = LocalStore::open(d.path().join("store")).unwrap();
        let (f, v) = bench_file_verifying("t", "criu/pages-1.img", &chunks, store);
        let e = v.wait().unwrap_err();
        assert!(e.to_string().contains("fails its checksum"), "{e}");
        assert!(f.read_at(0, &mut buf).is_err());
    }

    #[test]
    fn threads_that_meet_on_a_compressed_chunk_decode_it_once() {
        let d = tempfile::tempdir().unwrap();
        // 8 MiB of compressed chunks that do not recur: random 64-byte
        // runs between zeros.
        let mut data = vec![0u8; 8 << 20];
        for run in data.chunks_mut(1024) {
            rand::thread_rng().fill_bytes(&mut run[..64]);
        }
        let store = LocalStore::open(d.path().join("store")).unwrap();
        let st = gpusnap_chunks::store_slice(&data, 2, &store, false, &|_| {}).unwrap();
        store.finish(st.staged, false).unwrap();
        let chunks = st.chunks;
        assert!(chunks.iter().all(|c| store.get_encoded(&c.blake3).unwrap()[0] == b'Z'));
        let open = |pace: Option<VerifyPace>| {
            let store = LocalStore::open(d.path().join("store")).unwrap();
            let shared = Shared::new("t", store, None, Arc::new(Mutex::new(None)), false);
            let f = Arc::new(ChunkedFile::new("criu/pages-1.img", &chunks, shared, false));
            let v = pace.map(|p| spawn_verify(std::slice::from_ref(&f), Arc::new(AtomicBool::new(false)), p));
            (f, v)
        };
        // Eight threads reading the same pieces at the same time (each
        // 256 KiB, so that four of them fall in each chunk), then the same
        // with the verify beside them: each chunk is loaded once (a few
        // more if the cache dropped one before the last thread came).
        for pace in [None, Some(VerifyPace { threads: 2, ..VerifyPace::all_cores() })] {
            let (f, v) = open(pace);
            let start = std::sync::Barrier::new(8);
            std::thread::scope(|s| {
                for _ in 0..8 {
                    s.spawn(|| {
                        start.wait();
                        let mut got = vec![0u8; data.len()];
                        for (k, piece) in got.chunks_mut(256 << 10).enumerate() {
                            f.read_at(k as u64 * (256 << 10), piece).unwrap();
                        }
                        assert!(got == data);
                    });
                }
            });
            if let Some(v) = v {
                join_verify(v).unwrap();
            }
            assert!(f.checked.iter().all(|c| c.load(Ordering::Relaxed)));
            // Eight threads decoding on their own would load each chunk
            // eight times; sharing, once, plus what a lagging thread finds
            // dropped from the cache (two chunks in one shard): on CI's two
            // busy cores 15 loads of 7 chunks were seen, so at most half
            // of the threads' count.
            let loads = f.shared.loads.load(Ordering::Relaxed);
            assert!(
                loads >= chunks.len() as u64 && loads <= 4 * chunks.len() as u64,
                "{loads} loads of {} chunks",
                chunks.len()
            );
        }
    }

    #[test]
    fn the_background_verify_checks_every_chunk_while_reads_go_on() {
        let d = tempfile::tempdir().unwrap();
        let (data, chunks) = stored(d.path());
        let store = LocalStore::open(d.path().join("store")).unwrap();
        let (f, v) = bench_file_verifying("t", "criu/pages-1.img", &chunks, store);
        assert!(read_all(&f, data.len()).unwrap() == data);
        v.wait().unwrap();
        // Every chunk marked checked: read again without hashing.
        assert!(read_all(&f, data.len()).unwrap() == data);
        // Downwards, with a bad chunk at the bottom: found, named.
        let store = LocalStore::open(d.path().join("store")).unwrap();
        let p = store.path_of(&chunks[0].blake3);
        let mut b = std::fs::read(&p).unwrap();
        b[100] ^= 1;
        std::fs::write(&p, b).unwrap();
        let pace = VerifyPace { downwards: true, threads: 1, ..VerifyPace::all_cores() };
        let (_f, v) = bench_file_verifying_at("t", "criu/pages-1.img", &chunks, store, pace);
        let e = v.wait().unwrap_err().to_string();
        assert!(e.contains(&chunks[0].blake3), "{e}");
    }
}
