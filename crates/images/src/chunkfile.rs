//! A store-held pages file as the page server reads it ([`StoreSource`]):
//! an offset found in the file's chunk list, its chunk read from the local
//! store (or fetched from the image's remote), decoded and checked before
//! any byte is handed on, a few verified chunks kept for the neighbouring
//! reads (see [`crate::chunksrc`]).

use crate::manifest::ImageError;
use gpusnap_chunks::{ChunkError, ChunkRef, LocalStore, Remote, Scratch};
use gpusnap_pages::{DirSource, PageSource, PagesError, PagesFile};
use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::sync::{Arc, Mutex};

/// Decoded chunks kept per file, by hash: SHARDS x PER_SHARD, chunks
/// stored compressed only (a raw chunk, once checked, is read straight
/// from its file into the page server's buffer, as a pages file is). The
/// page server's threads read in address order, each a few MiB at a time,
/// so a chunk is wanted again by the next reads of the same thread or a
/// neighbour's, or, for a chunk that recurs (zero pages, a repeated
/// pattern), anywhere in the file.
pub(crate) const SHARDS: usize = 32;
pub(crate) const PER_SHARD: usize = 2;
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
/// against 7.7 s alone, bench/results/031).
pub(crate) const RECURRING_MIN: u64 = 2 << 30;
pub(crate) const RECURRING_MAX: u64 = 16 << 30;

/// The budget of kept recurring chunks for a wake that starts with
/// `available` bytes of memory available.
pub(crate) fn recurring_budget(available: u64) -> u64 {
    (available / 8).max(RECURRING_MIN.min(available / 4)).min(RECURRING_MAX)
}
/// Chunk buffers kept for reuse per wake (a fresh multi-MiB buffer per
/// chunk would be faulted in page by page).
pub(crate) const POOL: usize = 32;
/// Chunks a streaming wake's prefetcher fetches at once.
pub(crate) const PREFETCH_THREADS: usize = 8;

/// The first chunk that failed its check in a wake (the wake's error names
/// it, and it is refused as a corrupt image, exit 2).
pub type Bad = Arc<Mutex<Option<ImageError>>>;

pub(crate) struct Shared {
    pub(crate) image: String,
    pub(crate) store: Arc<LocalStore>,
    pub(crate) remote: Option<Arc<Remote>>,
    pub(crate) bad: Bad,
    /// Chunk buffers to reuse.
    pub(crate) pool: Mutex<Vec<Vec<u8>>>,
    /// Chunks read whole (decoded, checked) so far: by the fill and the
    /// verify, each once unless evicted from the cache.
    pub(crate) loads: AtomicU64,
    /// Bytes kept of recurring chunks (at most `recurring_budget`).
    pub(crate) recurring: AtomicU64,
    pub(crate) recurring_budget: u64,
    /// Raw chunks given to the page server in place, from their files'
    /// mapping (`GPUSNAP_PAGES_MAP_RAW=1`), rather than read into its
    /// buffer (the default). One mapping per chunk costs an `mmap` and a
    /// `munmap` (a TLB shootdown across the page server's cores): on the
    /// H200 with 8 fill and 8 verify threads the fill of 20.5 GB of random
    /// memory ran at 6.2-6.5 GB/s mapped against 8.1-8.4 GB/s read, on one
    /// host, alternating (bench/results/036).
    pub(crate) map_raw: bool,
}

thread_local! {
    /// A reading thread's zstd context, encoded-chunk buffer and the raw
    /// chunk file it read last.
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// Runs `f` with this thread's [`SCRATCH`] (a fresh one if it is in use
/// further up the stack).
pub(crate) fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut s) => f(&mut s),
        Err(_) => f(&mut Scratch::default()),
    })
}

impl Shared {
    pub(crate) fn new(
        image: &str,
        store: LocalStore,
        remote: Option<Remote>,
        bad: Bad,
        map_raw: bool,
    ) -> Arc<Self> {
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
    pub(crate) fn load(
        &self,
        path: &str,
        c: &ChunkRef,
        out: &mut Vec<u8>,
        checked: bool,
    ) -> Result<bool, ImageError> {
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

    pub(crate) fn buffer(&self) -> Vec<u8> {
        self.pool.lock().ok().and_then(|mut p| p.pop()).unwrap_or_default()
    }

    pub(crate) fn give_back(&self, b: Vec<u8>) {
        if let Ok(mut p) = self.pool.lock() {
            if p.len() < POOL {
                p.push(b);
            }
        }
    }

    pub(crate) fn note(&self, e: &ImageError) {
        if let Ok(mut b) = self.bad.lock() {
            if b.is_none() {
                *b = Some(copy_of(&self.image, e));
            }
        }
    }
}

/// `e` as the wake's error ([`Bad`]): a corrupt chunk as it is, anything
/// else as a failed read of the image's chunks.
pub(crate) fn copy_of(image: &str, e: &ImageError) -> ImageError {
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
pub(crate) type Shard = Vec<(String, Arc<Vec<u8>>)>;

pub(crate) struct ChunkedFile {
    pub(crate) path: String,
    pub(crate) chunks: Vec<ChunkRef>,
    /// End offset of each chunk (prefix sums of the sizes).
    pub(crate) ends: Vec<u64>,
    /// The first index of chunk i's hash in the file: a chunk that recurs
    /// is checked, and kept, by that index.
    pub(crate) canon: Vec<u32>,
    /// Chunk i's hash occurs more than once in the file.
    pub(crate) recurs: Vec<bool>,
    /// By canonical index: checked in full in this wake (by the verify
    /// before it, or by a read): its bytes are read from then on without
    /// hashing them again. The store is root's only: a chunk's file holds
    /// the bytes that were checked, as an image directory's pages file does
    /// after the verify that precedes every wake.
    pub(crate) checked: Vec<AtomicBool>,
    /// By canonical index: the decoded bytes of a compressed chunk that
    /// recurs (see [`RECURRING_MIN`]).
    pub(crate) kept: Vec<OnceLock<Arc<Vec<u8>>>>,
    /// By canonical index: stored compressed (found so by a mapping that
    /// was refused), so not mapped again.
    pub(crate) unmappable: Vec<AtomicBool>,
    /// Raw chunks' mappings (`GPUSNAP_PAGES_MAP_RAW=1`), by canonical index,
    /// kept until the wake ends: unmapping one while the fill runs is a TLB
    /// shootdown across every core the page server's threads are on
    /// (measured: mapping and unmapping a chunk per read slowed the fill
    /// from 8.1-8.4 to 6.2-6.5 GB/s on the H200).
    pub(crate) mapped: Vec<OnceLock<Arc<memmap2::Mmap>>>,
    /// By canonical index: held by the one thread reading, decoding and
    /// checking the chunk (a fill thread or the verify), so that no other
    /// does it again at the same time: the fill threads on either side of a
    /// batch's edge, and the verify, which starts where the fill does, met
    /// on the same compressed chunks and each decoded them (H200, Runs
    /// 54-55: 5-8 ms a MiB where a decode takes ~1.5). A waiting thread
    /// then finds the chunk checked, and decoded in the cache.
    pub(crate) loading: Vec<Mutex<()>>,
    /// By canonical index: a fill thread waits for the chunk's `loading`:
    /// the verify then leaves what it decoded in the cache.
    pub(crate) wanted: Vec<AtomicBool>,
    pub(crate) cache: Vec<Mutex<Shard>>,
    pub(crate) shared: Arc<Shared>,
}

impl ChunkedFile {
    pub(crate) fn new(path: &str, chunks: &[ChunkRef], shared: Arc<Shared>, checked: bool) -> Self {
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

    pub(crate) fn size(&self) -> u64 {
        self.ends.last().copied().unwrap_or(0)
    }

    pub(crate) fn shard(&self, i: usize) -> &Mutex<Shard> {
        let hash = &self.chunks[i].blake3;
        let slot = hash.get(..8).and_then(|h| usize::from_str_radix(h, 16).ok()).unwrap_or(i);
        &self.cache[slot % SHARDS]
    }

    /// Copies bytes `from..from + dst.len()` of chunk `i` into `dst`,
    /// checked: from the cache, straight from a raw chunk's file once the
    /// chunk was checked, else the whole chunk read, decoded and checked,
    /// by one thread at a time (`loading`).
    pub(crate) fn piece(&self, i: usize, from: usize, dst: &mut [u8]) -> Result<(), ImageError> {
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
    pub(crate) fn at_hand(&self, i: usize, from: usize, dst: &mut [u8]) -> bool {
        if let Some(d) = self.kept[self.canon[i] as usize].get() {
            dst.copy_from_slice(&d[from..from + dst.len()]);
            return true;
        }
        self.cached(i, from, dst) || self.checked_raw(i, from, dst)
    }

    /// Takes `loading[k]`, the right to load canonical chunk `k`. Held by
    /// another thread: `busy` says whether to wait for it (`None`: not).
    pub(crate) fn load_lock(
        &self,
        k: usize,
        busy: impl FnOnce() -> bool,
    ) -> Option<std::sync::MutexGuard<'_, ()>> {
        match self.loading[k].try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::WouldBlock) => {
                busy().then(|| self.loading[k].lock().unwrap_or_else(|e| e.into_inner()))
            }
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
        }
    }

    /// Copies from the cache of decoded chunks, if chunk `i` is there.
    pub(crate) fn cached(&self, i: usize, from: usize, dst: &mut [u8]) -> bool {
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
    pub(crate) fn checked_raw(&self, i: usize, from: usize, dst: &mut [u8]) -> bool {
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
    pub(crate) fn keep_decoded(&self, i: usize, b: Vec<u8>) {
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
    pub(crate) fn raw_mapped(&self, i: usize) -> Option<Arc<memmap2::Mmap>> {
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
    pub(crate) fn room(&self, bytes: u64) -> bool {
        let used = self.shared.recurring.fetch_add(bytes, Ordering::Relaxed);
        if used + bytes > self.shared.recurring_budget {
            self.shared.recurring.fetch_sub(bytes, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Copies verified bytes at `offset` into `buf`.
    pub(crate) fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), ImageError> {
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
    pub(crate) files: HashMap<String, Arc<ChunkedFile>>,
    pub(crate) dir: DirSource,
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

/// Whether raw chunks are given to the page server from their files'
/// mapping (1) or read into its buffer (0, the default; see
/// `Shared::map_raw`).
pub const PAGES_MAP_RAW_ENV: &str = "GPUSNAP_PAGES_MAP_RAW";

/// [`PAGES_MAP_RAW_ENV`] as set; a value that is not 1 or 0 is said and left.
pub(crate) fn map_raw_from_env() -> bool {
    map_raw_from(std::env::var(PAGES_MAP_RAW_ENV).ok())
}

pub(crate) fn map_raw_from(v: Option<String>) -> bool {
    gpusnap_pages::flag_setting(PAGES_MAP_RAW_ENV, v, false)
}
