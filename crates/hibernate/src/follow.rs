//! Chunking CRIU's pages files while CRIU still writes them.
//!
//! A hibernate's commit (read the pages files, cut, hash, compress and stage
//! their chunks) used to start only once CRIU had exited, and took as long
//! as the dump itself (docs/benchmarks.md). CRIU writes each
//! `pages-N.img` from the start to the end, appending only (its page
//! transfer writes the drained pipes one after another, never seeking back
//! nor truncating), so every byte below a pages file's size is final. A
//! [`Follower`] polls the image's `criu/` directory; each time a pages file
//! holds one more whole [`gpusnap_chunks::SEGMENT`], that segment is hashed
//! into the file's checksum (in order) and handed to a pool that cuts,
//! hashes, compresses and stages its chunks. Chunks are cut per segment
//! exactly as [`gpusnap_chunks::store_slice`] cuts a whole file, so the
//! chunk lists (and dedup against other images) are the same as when the
//! file is chunked after the dump. When CRIU has exited successfully,
//! [`Follower::finish`] does the rest (each file's last, shorter segment);
//! when it failed, [`Follower::abandon`] removes every chunk staged: staged
//! chunks are temporary files, never under their names, so nothing refers
//! to them and nothing is half-done.
//!
//! The chunked part of a pages file is left alone in the page cache: the
//! file is removed after the commit, and the dirty pages of a removed file
//! are dropped unwritten. Measured on this project's kernel (6.18, ext4,
//! docs/benchmarks.md): `posix_fadvise(DONTNEED)` on 512 MiB of dirty
//! pages starts their write-back (1.1 GB written within 2 s), and
//! `fallocate(PUNCH_HOLE)` writes them out before it punches (0.96 s for
//! 512 MiB), so either would spend the disk on bytes thrown away; doing
//! nothing wrote none. `GPUSNAP_FOLLOW_PUNCH=1` punches each chunked
//! segment out anyway (for measurements on other filesystems; on a tmpfs,
//! [`crate::dumpdir`], it frees the memory at once, but slowed CRIU's dump
//! down twofold where measured);
//! `GPUSNAP_FOLLOW=0` turns following off (the commit chunks the files
//! after the dump, as before).

use crate::chunking::ChunkingError;
use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gpusnap_chunks::{ChunkRef, LocalStore, Staged, Stored, SEGMENT};

/// Turns following off when "0".
pub const FOLLOW_ENV: &str = "GPUSNAP_FOLLOW";
/// Punches the chunked segments out of the pages files when "1" (off by
/// default: see the module and [`crate::dumpdir`]).
pub const PUNCH_ENV: &str = "GPUSNAP_FOLLOW_PUNCH";
/// Test hook: the follower fails once it has chunked this many segments.
pub const FAIL_AFTER_ENV: &str = "GPUSNAP_TEST_FOLLOW_FAIL_AFTER";

const POLL: Duration = Duration::from_millis(20);

/// Is following on (the default)?
pub fn enabled() -> bool {
    std::env::var(FOLLOW_ENV).map_or(true, |v| v != "0")
}

pub use gpusnap_images::manifest::{FollowedFile, Prechunked};

/// What the follower did, for `hibernate --json`.
#[derive(Debug, Default, Clone, Copy)]
pub struct FollowStats {
    /// Bytes of pages files chunked (cut, hashed, compressed and staged)
    /// before CRIU's exit was known.
    pub overlapped_bytes: u64,
    /// Bytes chunked after that (the rest: segments in the pool, the tails).
    pub after_bytes: u64,
    /// From CRIU's exit until every chunk was staged, ms.
    pub finish_ms: u64,
    /// Bytes of the pages files punched out once chunked.
    pub punched_bytes: u64,
    /// Where the FIFO receiver's threads spent the dump (through FIFOs
    /// only, [`crate::fifo`]).
    pub fifo: Option<FifoStats>,
}

/// Where a FIFO receiver's threads spent a dump, in ms (summed over the
/// threads of a kind), for `hibernate --json` (`stages.fifo`): what CRIU's
/// write into the FIFOs (its `memwrite`) waited for. The readers take the
/// bytes out of the FIFOs and wait for buffers, copiers and the checksum;
/// the copiers copy the bytes into the buffers; the checksum and the
/// chunkers work on whole segments.
#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
pub struct FifoStats {
    /// From CRIU's open of a FIFO to its end (the longest of the FIFOs).
    pub read_ms: u64,
    /// The readers waiting for CRIU's next bytes in the FIFOs (CRIU's
    /// drain, or CRIU itself, is the pace).
    pub wait_criu_ms: u64,
    /// The readers waiting for room in a copier's pipe (the copiers are).
    pub wait_room_ms: u64,
    /// The readers moving CRIU's pages into the copiers' pipes (`splice`).
    pub move_ms: u64,
    /// The readers waiting, after a segment's last bytes were taken, for
    /// its copiers to finish.
    pub wait_copy_ms: u64,
    /// The readers waiting for a free segment buffer (every buffer with the
    /// checksum or the chunkers).
    pub wait_buffer_ms: u64,
    /// The readers waiting to hand a segment to the file's checksum.
    pub wait_hash_ms: u64,
    /// The copiers waiting for the reader to fill their pipes, summed.
    pub wait_reader_ms: u64,
    /// The copiers copying out of their pipes into the buffers (a reader
    /// alone: its copy out of the FIFO), summed.
    pub copy_ms: u64,
    /// The file checksums at work.
    pub hash_ms: u64,
    /// The chunkers at work (cut, hash, compress, stage), summed.
    pub chunk_ms: u64,
    /// The smallest pipe a FIFO got (CRIU's splice moves at most this much
    /// ahead of the reader): 64 MiB asked for; above `fs.pipe-max-size`
    /// only with CAP_SYS_RESOURCE.
    pub pipe_bytes: u64,
    /// The smallest piece a copier took at a time (its pipe's size, 4 MiB
    /// asked for; 0 with the reader alone).
    pub piece_bytes: u64,
    pub segments: u64,
    pub copiers: u64,
    pub chunkers: u64,
}

/// Every pages file followed (by its path under the image directory, e.g.
/// `criu/pages-1.img`), and the figures.
#[derive(Default)]
pub struct Followed {
    pub files: BTreeMap<String, FollowedFile>,
    pub stats: FollowStats,
    /// The store's shared lock, held from the first chunk staged until the
    /// manifest that refers to them is in place (`images gc` waits).
    pub lock: Option<gpusnap_chunks::StoreLock>,
    /// The pages files were followed outside the image directory (a tmpfs,
    /// [`crate::dumpdir`]) and are not copied into it: the commit takes
    /// them from here alone.
    pub elsewhere: bool,
}

impl Followed {
    /// What the image's commit takes of it: the files, the lock, where
    /// they are.
    pub fn into_prechunked(self) -> Prechunked {
        Prechunked { files: self.files, lock: self.lock, elsewhere: self.elsewhere }
    }

    /// Abandons every staged chunk (a failed commit).
    pub fn abandon(self, store: &LocalStore) {
        for (_, f) in self.files {
            store.abandon(f.stored.staged);
        }
    }
}

type SegResult = Result<(Vec<ChunkRef>, Vec<Staged>), ChunkingError>;

/// One pages file being followed.
struct Tracked {
    rel: String,
    file: Arc<fs::File>,
    /// Whole segments handed to the pool.
    segs: usize,
    /// The checksum of the bytes handed out so far.
    hasher: blake3::Hasher,
    /// Set once the last, shorter segment is out: the file's size.
    done: Option<u64>,
    results: Arc<Mutex<BTreeMap<usize, SegResult>>>,
}

struct Job {
    file: Arc<fs::File>,
    offset: u64,
    len: usize,
    results: Arc<Mutex<BTreeMap<usize, SegResult>>>,
    index: usize,
}

/// The follower of one hibernate's pages files (see the module).
pub struct Follower {
    stop: Arc<AtomicBool>,
    /// Sent true (CRIU succeeded: finish) or false (abandon).
    end_tx: mpsc::Sender<bool>,
    handle: JoinHandle<Result<Followed, ChunkingError>>,
    store_root: PathBuf,
}

impl Follower {
    /// Starts following the pages files that appear in `image_dir/criu`,
    /// staging their chunks in `store_root` (a [`LocalStore`]).
    pub fn start(image_dir: &Path, store_root: &Path, durable: bool) -> std::io::Result<Self> {
        Self::start_with(image_dir, store_root, durable, SEGMENT, false)
    }

    /// [`Self::start`] cutting by `segment` bytes (tests: [`SEGMENT`] is
    /// what every image uses).
    fn start_with(
        image_dir: &Path,
        store_root: &Path,
        durable: bool,
        segment: usize,
        punch: bool,
    ) -> std::io::Result<Self> {
        let store =
            LocalStore::open(store_root.to_path_buf()).map_err(|e| std::io::Error::other(e.to_string()))?;
        let lock = store.shared_lock().map_err(|e| std::io::Error::other(e.to_string()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let (end_tx, end_rx) = mpsc::channel::<bool>();
        let dir = image_dir.to_path_buf();
        let stop2 = stop.clone();
        let punch = match std::env::var(PUNCH_ENV).as_deref() {
            Ok("1") => true,
            Ok("0") => false,
            _ => punch,
        };
        let fail_after: Option<u64> = std::env::var(FAIL_AFTER_ENV).ok().and_then(|v| v.parse().ok());
        let handle = std::thread::Builder::new().name("gpusnap-follow".into()).spawn(move || {
            let mut r = follow(&dir, store, Settings { durable, segment, punch, fail_after }, stop2, &end_rx);
            if let Ok(f) = &mut r {
                f.lock = Some(lock);
            }
            r
        })?;
        Ok(Self { stop, end_tx, handle, store_root: store_root.to_path_buf() })
    }

    /// CRIU exited successfully: chunks the rest of every pages file and
    /// returns them all.
    pub fn finish(self) -> Result<Followed, ChunkingError> {
        let _ = self.end_tx.send(true);
        self.handle.join().map_err(|_| ChunkingError::Thread("the follower panicked"))?
    }

    /// CRIU failed (or the hibernate did): stops and removes every chunk
    /// the follower staged.
    pub fn abandon(self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.end_tx.send(false);
        if let Ok(Ok(f)) = self.handle.join() {
            if let Ok(store) = LocalStore::open(self.store_root) {
                f.abandon(&store);
            }
        }
    }
}

#[derive(Clone, Copy)]
struct Settings {
    durable: bool,
    segment: usize,
    punch: bool,
    fail_after: Option<u64>,
}

fn follow(
    image_dir: &Path,
    store: LocalStore,
    settings: Settings,
    stop: Arc<AtomicBool>,
    end_rx: &mpsc::Receiver<bool>,
) -> Result<Followed, ChunkingError> {
    let Settings { durable, segment, punch, fail_after } = settings;
    let criu_dir = image_dir.join("criu");
    let store = Arc::new(store);
    let taken: Arc<Mutex<HashSet<String>>> = Arc::default();
    let failed = Arc::new(Mutex::new(None::<ChunkingError>));
    let chunked = Arc::new(AtomicU64::new(0));
    let chunked_bytes = Arc::new(AtomicU64::new(0));
    let punched = Arc::new(AtomicU64::new(0));
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let (job_tx, job_rx) = mpsc::channel::<Job>();
    let job_rx = Arc::new(Mutex::new(job_rx));
    let mut workers = Vec::new();
    for _ in 0..threads {
        let (job_rx, store, taken, failed, chunked, punched, stop, chunked_bytes) = (
            job_rx.clone(),
            store.clone(),
            taken.clone(),
            failed.clone(),
            chunked.clone(),
            punched.clone(),
            stop.clone(),
            chunked_bytes.clone(),
        );
        workers.push(std::thread::spawn(move || loop {
            let job = match job_rx.lock().map(|r| r.recv()) {
                Ok(Ok(j)) => j,
                _ => break,
            };
            let r = if stop.load(Ordering::Relaxed) {
                Err(ChunkingError::Stopped)
            } else {
                let n = chunked.fetch_add(1, Ordering::Relaxed) + 1;
                if fail_after.is_some_and(|f| n > f) {
                    Err(ChunkingError::Injected("test hook: the follower fails"))
                } else {
                    chunk_job(&job, &store, durable, segment, &taken, punch, &punched)
                }
            };
            if r.is_ok() {
                chunked_bytes.fetch_add(job.len as u64, Ordering::Relaxed);
            }
            if let Err(e) = &r {
                if let Ok(mut f) = failed.lock() {
                    f.get_or_insert_with(|| e.clone());
                }
            }
            let _ = job.results.lock().map(|mut res| res.insert(job.index, r));
        }));
    }
    let mut tracked: Vec<Tracked> = Vec::new();
    let mut handed = 0u64;
    let mut overlapped = 0u64;
    let mut ended: Option<(bool, Instant)> = None;
    let result = loop {
        let last = ended.is_some();
        if let Err(e) = scan(&criu_dir, segment, &mut tracked, &job_tx, last, &mut handed) {
            break Err(e);
        }
        if let Some(e) = failed.lock().ok().and_then(|f| f.clone()) {
            break Err(e);
        }
        if let Some((ok, _)) = ended {
            break if ok { Ok(()) } else { Err(ChunkingError::Abandoned) };
        }
        match end_rx.recv_timeout(POLL) {
            Ok(ok) => {
                overlapped = chunked_bytes.load(Ordering::Relaxed);
                ended = Some((ok, Instant::now()));
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => ended = Some((false, Instant::now())),
        }
        if ended.is_some_and(|(ok, _)| !ok) {
            stop.store(true, Ordering::Relaxed);
            break Err(ChunkingError::Abandoned);
        }
    };
    if result.is_err() {
        // The segments still queued are not worth chunking.
        stop.store(true, Ordering::Relaxed);
    }
    drop(job_tx);
    for w in workers {
        let _ = w.join();
    }
    let mut out = Followed::default();
    let mut err = result.err().or_else(|| failed.lock().ok().and_then(|f| f.clone()));
    for t in tracked {
        let results = std::mem::take(&mut *t.results.lock().map_err(|_| ChunkingError::Thread("poisoned"))?);
        let mut stored = Stored::default();
        let expect = t.segs + usize::from(t.done.is_some_and(|d| d > t.segs as u64 * segment as u64));
        let mut seen = 0;
        for (_, r) in results {
            seen += 1;
            match r {
                Ok((list, staged)) => {
                    stored.chunks.extend(list);
                    stored.staged.extend(staged);
                }
                Err(e) => {
                    err.get_or_insert(e);
                }
            }
        }
        if seen != expect {
            err.get_or_insert_with(|| ChunkingError::NotChunked(t.rel.clone()));
        }
        let size = t.done.unwrap_or(t.segs as u64 * segment as u64);
        out.files
            .insert(t.rel, FollowedFile { size, blake3: t.hasher.finalize().to_hex().to_string(), stored });
    }
    out.stats = FollowStats {
        overlapped_bytes: overlapped,
        after_bytes: handed.saturating_sub(overlapped),
        finish_ms: ended.map_or(0, |(_, t)| t.elapsed().as_millis() as u64),
        punched_bytes: punched.load(Ordering::Relaxed),
        fifo: None,
    };
    if let Some(e) = err {
        out.abandon(&store);
        return Err(e);
    }
    Ok(out)
}

/// One pass over `criu_dir`: new pages files are opened, each whole new
/// segment is hashed and handed out; with `last` (CRIU has exited), each
/// file's last segment too.
fn scan(
    criu_dir: &Path,
    segment: usize,
    tracked: &mut Vec<Tracked>,
    jobs: &mpsc::Sender<Job>,
    last: bool,
    counted: &mut u64,
) -> Result<(), ChunkingError> {
    let entries = match fs::read_dir(criu_dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(ChunkingError::io(format!("list {}", criu_dir.display()), e)),
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let rel = format!("criu/{name}");
        if !gpusnap_images::manifest::chunked_name(&rel) || tracked.iter().any(|t| t.rel == rel) {
            continue;
        }
        let file = open_pages(&e.path()).map_err(|e| ChunkingError::io(format!("open {rel}"), e))?;
        tracked.push(Tracked {
            rel,
            file: Arc::new(file),
            segs: 0,
            hasher: blake3::Hasher::new(),
            done: None,
            results: Arc::default(),
        });
    }
    for t in tracked.iter_mut().filter(|t| t.done.is_none()) {
        let len = t.file.metadata().map_err(|e| ChunkingError::io(format!("stat {}", t.rel), e))?.len();
        loop {
            let off = t.segs as u64 * segment as u64;
            let whole = len >= off + segment as u64;
            if !whole && !last {
                break;
            }
            let n = if whole { segment } else { (len - off) as usize };
            if n > 0 {
                hash_range(&t.file, off, n, &mut t.hasher)
                    .map_err(|e| ChunkingError::io(format!("read {}", t.rel), e))?;
                let job = Job {
                    file: t.file.clone(),
                    offset: off,
                    len: n,
                    results: t.results.clone(),
                    index: t.segs,
                };
                jobs.send(job).map_err(|_| ChunkingError::Thread("the chunking pool stopped"))?;
                *counted += n as u64;
            }
            if whole {
                t.segs += 1;
            } else {
                t.done = Some(len);
                break;
            }
        }
    }
    Ok(())
}

/// Opens a pages file CRIU is writing: read and write (the write only to
/// punch out what is chunked), a regular file of its own, as
/// [`gpusnap_files::open_regular`] checks.
fn open_pages(p: &Path) -> std::io::Result<fs::File> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(p)?;
    let meta = f.metadata()?;
    if !meta.is_file() || meta.nlink() > 1 {
        return Err(std::io::Error::other("not a regular file of its own"));
    }
    Ok(f)
}

/// Maps `len` bytes of `file` at `offset` (a multiple of [`SEGMENT`], so of
/// the page size).
fn map_range(file: &fs::File, offset: u64, len: usize) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: a regular file of this hibernate's image in the 0700 store,
    // mapped below the size it had: CRIU only appends to its pages files
    // and never truncates them, so the mapped bytes stay in the file (the
    // risk memmap2 documents for every mapping is a truncation).
    let map = unsafe { memmap2::MmapOptions::new().offset(offset).len(len).map(file)? };
    let _ = map.advise(memmap2::Advice::Sequential);
    Ok(map)
}

fn hash_range(file: &fs::File, offset: u64, len: usize, h: &mut blake3::Hasher) -> std::io::Result<()> {
    let map = map_range(file, offset, len)?;
    h.update_rayon(&map);
    Ok(())
}

fn chunk_job(
    job: &Job,
    store: &LocalStore,
    durable: bool,
    segment: usize,
    taken: &Mutex<HashSet<String>>,
    punch: bool,
    punched: &AtomicU64,
) -> SegResult {
    let map =
        map_range(&job.file, job.offset, job.len).map_err(|e| ChunkingError::io("map a pages file", e))?;
    let r = gpusnap_chunks::store_segment(&map, store, durable, taken)
        .map_err(|e| ChunkingError::Store(e.to_string()))?;
    drop(map);
    // Only whole segments: the last one is where CRIU may still be
    // writing (and it is removed a moment later anyway).
    if punch && job.len == segment {
        // SAFETY: fallocate on a descriptor the job holds; no memory is
        // passed. The range is hashed and chunked already; nothing reads
        // it again (the file is removed after the commit).
        let rc = unsafe {
            libc::fallocate(
                job.file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                job.offset as libc::off_t,
                job.len as libc::off_t,
            )
        };
        if rc == 0 {
            punched.fetch_add(job.len as u64, Ordering::Relaxed);
        }
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn noise(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                // Runs of zeros too: chunks that repeat.
                if (i >> 20) % 5 == 3 {
                    0
                } else {
                    x as u8
                }
            })
            .collect()
    }

    /// What the commit would store for `data` cut by `segment`: the chunk
    /// list of each segment, one after the other.
    fn expected(data: &[u8], segment: usize, store: &LocalStore) -> Vec<ChunkRef> {
        let taken = Mutex::new(HashSet::new());
        let mut out = Vec::new();
        for seg in data.chunks(segment) {
            let (list, staged) = gpusnap_chunks::store_segment(seg, store, false, &taken).unwrap();
            store.abandon(staged);
            out.extend(list);
        }
        out
    }

    #[test]
    fn a_file_followed_as_it_grows_is_cut_as_it_would_be_whole() {
        let tmp = tempfile::tempdir().unwrap();
        let img = tmp.path().join("img");
        std::fs::create_dir_all(img.join("criu")).unwrap();
        let store_root = tmp.path().join("store");
        let segment = 2 << 20;
        let a = noise((9 << 20) + 12345, 7);
        let b = noise(3 << 20, 9);
        let f = Follower::start_with(&img, &store_root, false, segment, false).unwrap();
        // "CRIU": two pages files written in odd-sized appends.
        for (name, data) in [("pages-1.img", &a), ("pages-2.img", &b)] {
            let mut w = std::fs::File::create(img.join("criu").join(name)).unwrap();
            for piece in data.chunks(700_001) {
                w.write_all(piece).unwrap();
                std::thread::sleep(Duration::from_millis(3));
            }
        }
        std::fs::write(img.join("criu").join("core-1.img"), b"not pages").unwrap();
        let got = f.finish().unwrap();
        assert_eq!(got.files.len(), 2);
        let store = LocalStore::open(store_root.clone()).unwrap();
        for (name, data) in [("criu/pages-1.img", &a), ("criu/pages-2.img", &b)] {
            let ff = &got.files[name];
            assert_eq!(ff.size, data.len() as u64);
            assert_eq!(ff.blake3, blake3::hash(data).to_hex().to_string());
            assert_eq!(ff.stored.chunks, expected(data, segment, &store), "{name}");
        }
        let s = got.stats;
        assert_eq!(s.overlapped_bytes + s.after_bytes, (a.len() + b.len()) as u64);
        // Every distinct new chunk staged once, none named yet.
        let staged = got.files.values().map(|f| f.stored.staged.len()).sum::<usize>();
        let distinct: HashSet<&str> =
            got.files.values().flat_map(|f| f.stored.chunks.iter().map(|c| c.blake3.as_str())).collect();
        assert_eq!(staged, distinct.len());
        assert!(store.all().is_empty());
        got.abandon(&store);
        assert_eq!(
            std::fs::read_dir(store_root.join("chunks"))
                .unwrap()
                .flatten()
                .flat_map(|d| std::fs::read_dir(d.path()).unwrap())
                .count(),
            0
        );
    }

    #[test]
    fn an_abandoned_follow_leaves_no_chunk_behind() {
        let tmp = tempfile::tempdir().unwrap();
        let img = tmp.path().join("img");
        std::fs::create_dir_all(img.join("criu")).unwrap();
        let store_root = tmp.path().join("store");
        let segment = 1 << 20;
        let f = Follower::start_with(&img, &store_root, false, segment, false).unwrap();
        std::fs::write(img.join("criu").join("pages-1.img"), noise(5 << 20, 3)).unwrap();
        // Until some of it is staged.
        let chunks = store_root.join("chunks");
        let staged = || {
            std::fs::read_dir(&chunks)
                .map(|d| d.flatten().flat_map(|d| std::fs::read_dir(d.path()).into_iter().flatten()).count())
                .unwrap_or(0)
        };
        let t = Instant::now();
        while staged() == 0 && t.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(staged() > 0);
        f.abandon();
        assert_eq!(staged(), 0);
    }
}
