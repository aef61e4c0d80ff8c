//! Receiving CRIU's pages through FIFOs instead of pages files (for
//! hibernates of tens of GB).
//!
//! CRIU's dump drains a process's memory into pipes (the parasite's
//! `vmsplice`, fast) and then splices those pipes into `pages-N.img`, one
//! thread for the whole tree. Into a file that splice copies every page
//! into the page cache: on the H200's host 26.3 of a 29.8 s dump of 49 GB
//! went there (`memwrite` in CRIU's stats, bench/results/043), and gpusnap then reads
//! the file again to chunk it. A FIFO put where a pages file goes turns
//! CRIU's splice into a move of page references from pipe to pipe (CRIU
//! 4.2.1 dumps into one without complaint: docs/benchmarks.md, "CRIU
//! dumping into a FIFO"); a [`Receiver`] reads each FIFO a
//! [`SEGMENT`] at a time into its own buffers, hashes it into the file's
//! checksum in order, and hands it to a pool that cuts, hashes, compresses
//! and stages its chunks exactly as [`gpusnap_chunks::store_slice`] cuts a
//! whole file (same chunk lists, same dedup). No pages file exists
//! anywhere: no tmpfs holding a second copy of the memory, no disk write of
//! pages that are then thrown away.
//!
//! CRIU names the pages files `pages-1.img`, `pages-2.img`, ... in the order
//! it opens them (the tree's shared anonymous memory first, then each
//! process in pstree order; seen with 4.2.1). A FIFO is made for each name
//! that can be used ([`Receiver::start`] is given how many); a name CRIU
//! goes past gets an ordinary file, which the commit chunks as before, and
//! a FIFO CRIU did not open is removed. Every FIFO is open for reading
//! before CRIU starts, so CRIU's open never blocks.
//!
//! Nothing is half-done:
//! - a chunking error does not stop the reading (a reader that stopped
//!   would leave CRIU blocked in its splice): the rest is read and thrown
//!   away, and the error is returned once CRIU has exited, with every staged
//!   chunk removed; the hibernate then puts the tree back as after a failed
//!   dump;
//! - a gpusnap that dies mid-dump closes the FIFOs: CRIU, which ignores
//!   SIGPIPE, fails its splice with EPIPE, fails the dump and lets the tree
//!   run (the journal's reconcile finishes the rest);
//! - a dump that fails leaves staged chunks only, removed by
//!   [`Receiver::abandon`].
//!
//! - and a gpusnap that dies before CRIU has opened every FIFO must not
//!   leave CRIU blocked in `open` (a FIFO nobody reads): a keeper process
//!   (`gpusnap __dump-keeper`, [`keeper_main`]) holds every FIFO open for
//!   reading from before CRIU starts; when gpusnap ends without saying
//!   "done" it reads and drops whatever CRIU sends until no CRIU works on
//!   the image any more, then removes the FIFOs. CRIU's dump then ends (the
//!   image is never committed) and the next gpusnap reconciles the journal
//!   (the tree is continued and resumed). Killing CRIU instead would kill
//!   the dumped process with it (its parasite traps once CRIU is gone).
//!
//! `GPUSNAP_DUMP_FIFO=0` turns it off (CRIU writes pages files, followed on
//! a tmpfs or the disk: [`crate::follow`], [`crate::dumpdir`]).

use std::collections::HashSet;
use std::fs;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use gpusnap_chunks::{LocalStore, Stored, SEGMENT};

use crate::chunking::ChunkingError;
use crate::drain::{make_fifo, read_fifo, Buffers, Drained, Job, Shared, Times};
use crate::dumpkeeper::Keeper;
use crate::follow::{FollowStats, Followed, FollowedFile};

/// "0" turns the FIFOs off, "1" on (the default).
pub const DUMP_FIFO_ENV: &str = "GPUSNAP_DUMP_FIFO";
/// Test hook: the receiver's chunking fails once it has chunked this many
/// segments (the reading goes on to the end, as on a real error).
pub const FAIL_AFTER_ENV: &str = "GPUSNAP_TEST_FIFO_FAIL_AFTER";
/// Threads that copy a FIFO's pages out of the kernel ("1": the reader
/// alone; default: half the cores, 2 to 8: an idle copier only waits in
/// `poll`, and on the H200's 16 cores 8 took 0.5-0.9 s off a 49 GB dump
/// against 4, bench/results/061-062).
pub const COPIERS_ENV: &str = "GPUSNAP_DUMP_FIFO_COPIERS";

/// Are the FIFOs on (`GPUSNAP_DUMP_FIFO`, default on)?
pub fn enabled() -> bool {
    gpusnap_pages::flag_setting(DUMP_FIFO_ENV, std::env::var(DUMP_FIFO_ENV).ok(), true)
}

/// How many pages files CRIU may write for `pids`: one per process and one
/// per shared anonymous mapping (counted generously: every shared mapping,
/// a file's too), plus a few. A name CRIU goes past is an
/// ordinary file; one it does not use is removed.
pub fn names_for(pids: &[i32]) -> usize {
    let shared: usize = pids
        .iter()
        .filter_map(|p| fs::read_to_string(format!("/proc/{p}/maps")).ok())
        .map(|maps| {
            maps.lines()
                .filter(|l| l.split_whitespace().nth(1).is_some_and(|perms| perms.ends_with('s')))
                .count()
        })
        .sum();
    pids.len() + shared.min(256) + 4
}

/// The copiers of each FIFO ([`COPIERS_ENV`]; nonsense: the default, said
/// in a warning).
fn copiers_setting(value: Option<String>, threads: usize) -> usize {
    let default = (threads / 2).clamp(2, 8);
    match value {
        None => default,
        Some(v) => match v.trim().parse::<usize>() {
            Ok(n) if (1..=64).contains(&n) => n,
            _ => {
                tracing::warn!("{COPIERS_ENV}={v}: not a number from 1 to 64; ignored");
                default
            }
        },
    }
}

/// How many segment buffers a receiver may hold: enough for every chunker
/// and the readers, at most an eighth of the memory available.
fn buffer_limit(threads: usize) -> usize {
    let avail = crate::dumpdir::meminfo().map_or(8 << 30, |(_, avail)| avail);
    let by_mem = (avail / 8 / SEGMENT as u64) as usize;
    (threads + 2).min(by_mem).max(2)
}

/// The FIFOs of one dump and the threads that read and chunk them.
pub struct Receiver {
    criu_dir: PathBuf,
    fifos: Vec<PathBuf>,
    stop: Arc<AtomicBool>,
    readers: Vec<JoinHandle<Drained>>,
    workers: Vec<JoinHandle<()>>,
    job_tx: Option<mpsc::Sender<Job>>,
    received: Arc<AtomicU64>,
    chunked_bytes: Arc<AtomicU64>,
    failed: Arc<Mutex<Option<ChunkingError>>>,
    store: Arc<LocalStore>,
    keeper: Option<Keeper>,
    times: Arc<Times>,
    copiers: usize,
    chunkers: usize,
    /// The store's shared lock, from before the first chunk is staged until
    /// the manifest refers to them (handed on in [`Followed::lock`]).
    lock: Option<gpusnap_chunks::StoreLock>,
}

impl Receiver {
    /// Makes `criu_dir/pages-1.img` .. `pages-{count}.img` FIFOs, opens each
    /// for reading and starts their readers, a chunking pool that stages
    /// into the store at `store_root`, and their keeper (its messages
    /// appended to `keeper_log`): without a keeper there are no FIFOs.
    pub fn start(
        criu_dir: &Path,
        store_root: &Path,
        durable: bool,
        count: usize,
        keeper_log: &Path,
    ) -> std::io::Result<Self> {
        let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        Self::start_with(
            criu_dir,
            store_root,
            durable,
            count,
            Some(keeper_log),
            copiers_setting(std::env::var(COPIERS_ENV).ok(), threads),
        )
    }

    /// [`Self::start`]; tests of the receiver alone go without a keeper.
    fn start_with(
        criu_dir: &Path,
        store_root: &Path,
        durable: bool,
        count: usize,
        keeper_log: Option<&Path>,
        copiers: usize,
    ) -> std::io::Result<Self> {
        let store = Arc::new(
            LocalStore::open(store_root.to_path_buf()).map_err(|e| std::io::Error::other(e.to_string()))?,
        );
        let lock = store.shared_lock().map_err(|e| std::io::Error::other(e.to_string()))?;
        let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        let buffers = Arc::new(Buffers::new(buffer_limit(threads)));
        let stop = Arc::new(AtomicBool::new(false));
        let received = Arc::new(AtomicU64::new(0));
        let chunked_bytes = Arc::new(AtomicU64::new(0));
        let failed: Arc<Mutex<Option<ChunkingError>>> = Arc::default();
        let fail_after: Option<usize> = std::env::var(FAIL_AFTER_ENV).ok().and_then(|v| v.parse().ok());
        let chunked = Arc::new(AtomicUsize::new(0));
        let taken: Arc<Mutex<HashSet<String>>> = Arc::default();
        let times: Arc<Times> = Arc::default();

        let (job_tx, job_rx) = mpsc::channel::<Job>();
        let job_rx = Arc::new(Mutex::new(job_rx));
        let mut workers = Vec::new();
        for i in 0..threads {
            let (job_rx, store, taken, failed, chunked, buffers, chunked_bytes, times) = (
                job_rx.clone(),
                store.clone(),
                taken.clone(),
                failed.clone(),
                chunked.clone(),
                buffers.clone(),
                chunked_bytes.clone(),
                times.clone(),
            );
            workers.push(std::thread::Builder::new().name(format!("gpusnap-fifo-chunk-{i}")).spawn(
                move || loop {
                    let job = match job_rx.lock().map(|r| r.recv()) {
                        Ok(Ok(j)) => j,
                        _ => break,
                    };
                    let n = chunked.fetch_add(1, Ordering::Relaxed) + 1;
                    let already = failed.lock().map(|f| f.is_some()).unwrap_or(true);
                    let r = if already {
                        Err(ChunkingError::EarlierSegment)
                    } else if fail_after.is_some_and(|f| n > f) {
                        Err(ChunkingError::Injected("test hook: the FIFO receiver's chunking fails"))
                    } else {
                        let t = Instant::now();
                        let r = gpusnap_chunks::store_segment(&job.buf[..job.len], &store, durable, &taken)
                            .map_err(|e| ChunkingError::Store(e.to_string()));
                        Times::add(&times.chunk, t);
                        r
                    };
                    match &r {
                        Ok(_) => {
                            chunked_bytes.fetch_add(job.len as u64, Ordering::Relaxed);
                        }
                        Err(e) => {
                            if let Ok(mut f) = failed.lock() {
                                f.get_or_insert_with(|| e.clone());
                            }
                        }
                    }
                    let _ = job.results.lock().map(|mut res| res.insert(job.index, r));
                    buffers.put(job.buf);
                },
            )?);
        }

        let mut me = Self {
            criu_dir: criu_dir.to_path_buf(),
            fifos: Vec::new(),
            stop,
            readers: Vec::new(),
            workers,
            job_tx: Some(job_tx),
            received,
            chunked_bytes,
            failed,
            store,
            keeper: None,
            lock: Some(lock),
            times,
            copiers,
            chunkers: threads,
        };
        for i in 1..=count {
            let path = criu_dir.join(format!("pages-{i}.img"));
            let file = match make_fifo(&path) {
                Ok((f, size)) => {
                    me.times.fifo_pipe.fetch_min(size as u64, Ordering::Relaxed);
                    f
                }
                Err(e) => {
                    me.abandon();
                    return Err(std::io::Error::other(format!("FIFO {}: {e}", path.display())));
                }
            };
            me.fifos.push(path);
            let rel = format!("criu/pages-{i}.img");
            let (stop, received, failed, buffers, times) =
                (me.stop.clone(), me.received.clone(), me.failed.clone(), buffers.clone(), me.times.clone());
            let jobs = me.job_tx.clone().ok_or_else(|| std::io::Error::other("receiver stopped"))?;
            let reader =
                std::thread::Builder::new().name(format!("gpusnap-fifo-read-{i}")).spawn(move || {
                    let shared = Shared {
                        received: &received,
                        failed: &failed,
                        buffers: &buffers,
                        jobs: &jobs,
                        times: &times,
                    };
                    read_fifo(rel, file, &stop, &shared, copiers)
                });
            match reader {
                Ok(h) => me.readers.push(h),
                Err(e) => {
                    me.abandon();
                    return Err(e);
                }
            }
        }
        if let Some(log) = keeper_log {
            match Keeper::start(criu_dir, count, log) {
                Ok(k) => me.keeper = Some(k),
                Err(e) => {
                    me.abandon();
                    return Err(e);
                }
            }
        }
        Ok(me)
    }

    /// Bytes read from the FIFOs so far (the dump's progress).
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// CRIU exited successfully: waits for every reader and every chunk,
    /// removes the FIFOs and returns the pages files CRIU wrote into them
    /// (an empty one becomes an empty file in `criu_dir`: CRIU's restore
    /// opens it).
    pub fn finish(mut self) -> Result<Followed, ChunkingError> {
        let ended = Instant::now();
        let overlapped = self.chunked_bytes.load(Ordering::Relaxed);
        let reads = self.join();
        let segments = reads.iter().map(|r| r.segs).sum();
        let mut out = Followed::default();
        let mut err = self.failed.lock().ok().and_then(|f| f.clone());
        for r in reads {
            if let Some(e) = &r.err {
                err.get_or_insert_with(|| e.clone().of_file(&r.rel));
            }
            let results = r.results.lock().map(|mut m| std::mem::take(&mut *m)).unwrap_or_default();
            let mut stored = Stored::default();
            let mut seen = 0;
            for (_, res) in results {
                seen += 1;
                match res {
                    Ok((list, staged)) => {
                        stored.chunks.extend(list);
                        stored.staged.extend(staged);
                    }
                    Err(e) => {
                        err.get_or_insert(e);
                    }
                }
            }
            if seen != r.segs {
                err.get_or_insert_with(|| ChunkingError::NotChunked(r.rel.clone()));
            }
            if !r.opened {
                continue;
            }
            if r.size == 0 {
                let p = self.criu_dir.join(r.rel.trim_start_matches("criu/"));
                if let Err(e) = gpusnap_files::create_private(&p) {
                    err.get_or_insert_with(|| ChunkingError::Os(Arc::new(e)).of_file(&r.rel));
                }
                continue;
            }
            out.files.insert(r.rel, FollowedFile { size: r.size, blake3: r.blake3, stored });
        }
        out.stats = FollowStats {
            overlapped_bytes: overlapped,
            after_bytes: self.chunked_bytes.load(Ordering::Relaxed).saturating_sub(overlapped),
            finish_ms: ended.elapsed().as_millis() as u64,
            punched_bytes: 0,
            fifo: Some(self.times.stats(segments, self.copiers, self.chunkers)),
        };
        out.elsewhere = true;
        if let Some(e) = err {
            out.abandon(&self.store);
            return Err(e);
        }
        out.lock = self.lock.take();
        Ok(out)
    }

    /// The dump failed (or the hibernate did): waits for the readers (CRIU
    /// has exited, so they are at their ends), removes every staged chunk
    /// and the FIFOs.
    pub fn abandon(mut self) {
        let reads = self.join();
        for r in reads {
            let results = r.results.lock().map(|mut m| std::mem::take(&mut *m)).unwrap_or_default();
            for (_, res) in results {
                if let Ok((_, staged)) = res {
                    self.store.abandon(staged);
                }
            }
        }
    }

    /// Stops the readers still waiting for CRIU, joins every thread and
    /// removes the FIFOs.
    fn join(&mut self) -> Vec<Drained> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(mut k) = self.keeper.take() {
            k.done();
        }
        let reads: Vec<Drained> = self
            .readers
            .drain(..)
            .map(|h| {
                h.join().unwrap_or_else(|_| Drained {
                    rel: "a FIFO".into(),
                    opened: true,
                    size: 0,
                    segs: 0,
                    blake3: String::new(),
                    results: Arc::default(),
                    err: Some(ChunkingError::Thread("its reader panicked")),
                })
            })
            .collect();
        self.job_tx = None;
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
        for p in self.fifos.drain(..) {
            if fs::symlink_metadata(&p).is_ok_and(|m| m.file_type().is_fifo()) {
                let _ = fs::remove_file(&p);
            }
        }
        reads
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        // Neither finished nor abandoned (a panic): no thread left behind
        // waiting on a FIFO, no FIFO left in the image.
        if !self.readers.is_empty() || !self.workers.is_empty() || self.keeper.is_some() {
            let _ = self.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::drain::PIECE;
    use gpusnap_chunks::Staged;
    use std::io::Write;

    /// Eight bytes a step: the tests make hundreds of MiB of it, in a
    /// debug build.
    fn noise(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        let mut v = Vec::with_capacity(n + 8);
        while v.len() < n {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            v.extend_from_slice(&x.to_le_bytes());
        }
        v.truncate(n);
        v
    }

    fn writer(p: PathBuf, data: Vec<u8>) -> JoinHandle<()> {
        std::thread::spawn(move || {
            let mut f = fs::OpenOptions::new().write(true).open(&p).expect("open the FIFO for writing");
            for part in data.chunks(3 << 20) {
                f.write_all(part).expect("write into the FIFO");
            }
        })
    }

    fn files_under(p: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for e in fs::read_dir(p).into_iter().flatten().flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                out.extend(files_under(&e.path()));
            } else {
                out.push(e.path());
            }
        }
        out
    }

    fn setup() -> (tempfile::TempDir, PathBuf, PathBuf) {
        let tmp = tempfile::tempdir().expect("tempdir");
        let criu = tmp.path().join("criu");
        let store = tmp.path().join("store");
        fs::create_dir_all(&criu).expect("mkdir");
        (tmp, criu, store)
    }

    #[test]
    fn pages_sent_into_fifos_are_chunked_as_the_whole_file_would_be() {
        let (_tmp, criu, store_root) = setup();
        let rx = Receiver::start_with(&criu, &store_root, false, 4, None, 3).expect("start");
        // Two segments and a bit, a file of one page, one opened and left
        // empty, one never opened.
        let big = noise(2 * SEGMENT + 12345 * 4, 7);
        let small = noise(4096, 9);
        let w1 = writer(criu.join("pages-1.img"), big.clone());
        let w2 = writer(criu.join("pages-2.img"), small.clone());
        let w3 = writer(criu.join("pages-3.img"), Vec::new());
        for w in [w1, w2, w3] {
            w.join().expect("writer");
        }
        let got = rx.finish().expect("finish");
        assert!(got.elsewhere);
        assert_eq!(got.files.len(), 2, "{:?}", got.files.keys().collect::<Vec<_>>());
        // Where the threads spent it: 3 segments and 1, 3 copiers, the
        // chunkers at work on each segment (a segment of noise takes them
        // more than a millisecond); the readers' waits lie inside their
        // reading (3 FIFOs opened, the longest read_ms).
        let t = got.stats.fifo.expect("the receiver's times");
        assert_eq!((t.segments, t.copiers), (4, 3), "{t:?}");
        assert!(t.chunkers >= 1 && t.chunk_ms > 0 && t.read_ms > 0, "{t:?}");
        // The pipes as granted: at least fs.pipe-max-size's default (1
        // MiB) for the FIFOs, and a copier's piece no larger than PIECE
        // nor left at a pipe's 64 KiB default.
        assert!(t.pipe_bytes >= 1 << 20, "{t:?}");
        assert!(t.piece_bytes >= 256 << 10 && t.piece_bytes <= PIECE as u64, "{t:?}");
        for wait in
            [t.wait_buffer_ms, t.wait_hash_ms, t.wait_copy_ms, t.wait_criu_ms, t.wait_room_ms, t.move_ms]
        {
            assert!(wait <= 3 * t.read_ms + 3, "{t:?}");
        }
        let store = LocalStore::open(store_root.clone()).expect("store");
        for (rel, data) in [("criu/pages-1.img", &big), ("criu/pages-2.img", &small)] {
            let f = &got.files[rel];
            assert_eq!(f.size, data.len() as u64);
            assert_eq!(f.blake3, blake3::hash(data).to_hex().to_string());
            let want = gpusnap_chunks::chunk_slice(data, 1, &|_| {});
            assert_eq!(f.stored.chunks, want, "{rel}: cut as the whole file");
        }
        // The empty one is an empty file now, the others are gone.
        assert_eq!(fs::metadata(criu.join("pages-3.img")).expect("pages-3").len(), 0);
        assert!(fs::metadata(criu.join("pages-3.img")).expect("pages-3").is_file());
        for n in [1, 2, 4] {
            assert!(fs::symlink_metadata(criu.join(format!("pages-{n}.img"))).is_err(), "pages-{n} left");
        }
        let mut got = got;
        let staged: Vec<Staged> =
            got.files.values_mut().flat_map(|f| std::mem::take(&mut f.stored.staged)).collect();
        store.finish(staged, false).expect("finish the staged chunks");
        for f in got.files.values() {
            store.verify_chunks(&f.stored.chunks, 2).expect("every chunk stored");
        }
    }

    #[test]
    fn a_chunking_failure_still_reads_every_byte_and_leaves_nothing() {
        let (_tmp, criu, store_root) = setup();
        let rx = Receiver::start_with(&criu, &store_root, false, 2, None, 2).expect("start");
        // Fail from the first chunk on: the writer must still finish.
        let _ = rx.failed.lock().map(|mut f| *f = Some(ChunkingError::Injected("injected")));
        let data = noise(SEGMENT + 8192, 3);
        writer(criu.join("pages-1.img"), data.clone()).join().expect("the writer was never blocked");
        assert!(rx.received() >= data.len() as u64);
        let e = rx.finish().err().expect("a failure");
        assert!(e.to_string().contains("injected"), "{e}");
        assert!(files_under(&store_root.join("chunks")).is_empty(), "nothing stored, nothing staged");
        assert!(fs::read_dir(&criu).expect("dir").next().is_none(), "no FIFO left");
    }

    #[test]
    fn an_abandoned_receiver_removes_its_chunks_and_fifos() {
        let (_tmp, criu, store_root) = setup();
        let rx = Receiver::start_with(&criu, &store_root, false, 3, None, 1).expect("start");
        let data = noise(SEGMENT / 2, 5);
        writer(criu.join("pages-2.img"), data).join().expect("writer");
        rx.abandon();
        assert!(fs::read_dir(&criu).expect("dir").next().is_none(), "no FIFO left");
        assert!(files_under(&store_root.join("chunks")).is_empty(), "nothing stored, nothing staged");
    }

    #[test]
    fn copiers_are_half_the_cores_unless_set() {
        assert_eq!(copiers_setting(None, 16), 8);
        assert_eq!(copiers_setting(None, 8), 4);
        assert_eq!(copiers_setting(None, 2), 2);
        assert_eq!(copiers_setting(None, 128), 8);
        assert_eq!(copiers_setting(Some("1".into()), 16), 1);
        assert_eq!(copiers_setting(Some(" 12 ".into()), 16), 12);
        for bad in ["0", "65", "many", ""] {
            assert_eq!(copiers_setting(Some(bad.into()), 16), 8, "{bad}");
        }
    }

    #[test]
    fn one_reader_and_many_copiers_read_the_same_bytes() {
        for copiers in [1, 2, 5] {
            let (_tmp, criu, store_root) = setup();
            let rx = Receiver::start_with(&criu, &store_root, false, 1, None, copiers).expect("start");
            let data = noise(SEGMENT + 3 * PIECE + 4096 * 7, copiers as u64);
            writer(criu.join("pages-1.img"), data.clone()).join().expect("writer");
            let got = rx.finish().expect("finish");
            let f = &got.files["criu/pages-1.img"];
            assert_eq!(f.size, data.len() as u64, "{copiers} copiers");
            assert_eq!(f.blake3, blake3::hash(&data).to_hex().to_string(), "{copiers} copiers");
            let store = LocalStore::open(store_root).expect("store");
            got.abandon(&store);
        }
    }

    #[test]
    fn a_name_taken_already_is_refused() {
        let (_tmp, criu, store_root) = setup();
        fs::write(criu.join("pages-2.img"), b"x").expect("write");
        let e = Receiver::start_with(&criu, &store_root, false, 3, None, 2).err().expect("refused");
        assert!(e.to_string().contains("pages-2.img"), "{e}");
        assert!(fs::symlink_metadata(criu.join("pages-1.img")).is_err(), "the first FIFO removed again");
        assert_eq!(fs::read(criu.join("pages-2.img")).expect("kept"), b"x");
    }
}
