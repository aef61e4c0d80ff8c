//! Receiving CRIU's pages through FIFOs instead of pages files (P7, the
//! hibernate of tens of GB).
//!
//! CRIU's dump drains a process's memory into pipes (the parasite's
//! `vmsplice`, fast) and then splices those pipes into `pages-N.img`, one
//! thread for the whole tree. Into a file that splice copies every page
//! into the page cache: on the H200's host 26.3 of a 29.8 s dump of 49 GB
//! went there (`memwrite` in CRIU's stats, Run 43), and gpusnap then reads
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

use std::collections::{BTreeMap, HashSet};
use std::fs;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use gpusnap_chunks::{ChunkRef, LocalStore, Staged, Stored, SEGMENT};

use crate::follow::{FifoStats, FollowStats, Followed, FollowedFile};

/// Where the receiver's threads spend their time, in ns summed over the
/// threads of a kind ([`FifoStats`]: what CRIU's write waited for).
struct Times {
    /// The longest FIFO from CRIU's open to its end.
    read: AtomicU64,
    wait_criu: AtomicU64,
    wait_room: AtomicU64,
    moving: AtomicU64,
    wait_copy: AtomicU64,
    wait_buffer: AtomicU64,
    wait_hash: AtomicU64,
    wait_reader: AtomicU64,
    copy: AtomicU64,
    hash: AtomicU64,
    chunk: AtomicU64,
    /// The smallest pipe a FIFO was granted, and the smallest piece a
    /// copier took (bytes; `u64::MAX` until one is known).
    fifo_pipe: AtomicU64,
    piece: AtomicU64,
}

impl Default for Times {
    fn default() -> Self {
        let z = || AtomicU64::new(0);
        Self {
            read: z(),
            wait_criu: z(),
            wait_room: z(),
            moving: z(),
            wait_copy: z(),
            wait_buffer: z(),
            wait_hash: z(),
            wait_reader: z(),
            copy: z(),
            hash: z(),
            chunk: z(),
            fifo_pipe: AtomicU64::new(u64::MAX),
            piece: AtomicU64::new(u64::MAX),
        }
    }
}

impl Times {
    fn add(at: &AtomicU64, since: Instant) {
        at.fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    /// Waits, timed into `at`, until `fd` polls ready for `flags` or hangs
    /// up or fails (the call made next says which).
    fn await_fd(fd: std::os::fd::BorrowedFd<'_>, flags: nix::poll::PollFlags, at: &AtomicU64) {
        let t = Instant::now();
        loop {
            let mut fds = [nix::poll::PollFd::new(fd, flags)];
            match nix::poll::poll(&mut fds, nix::poll::PollTimeout::NONE) {
                Err(nix::errno::Errno::EINTR) => continue,
                _ => break,
            }
        }
        Self::add(at, t);
    }

    fn stats(&self, segments: usize, copiers: usize, chunkers: usize) -> FifoStats {
        let ms = |a: &AtomicU64| a.load(Ordering::Relaxed) / 1_000_000;
        let bytes = |a: &AtomicU64| match a.load(Ordering::Relaxed) {
            u64::MAX => 0,
            n => n,
        };
        FifoStats {
            pipe_bytes: bytes(&self.fifo_pipe),
            piece_bytes: bytes(&self.piece),
            read_ms: ms(&self.read),
            wait_criu_ms: ms(&self.wait_criu),
            wait_room_ms: ms(&self.wait_room),
            move_ms: ms(&self.moving),
            wait_copy_ms: ms(&self.wait_copy),
            wait_buffer_ms: ms(&self.wait_buffer),
            wait_hash_ms: ms(&self.wait_hash),
            wait_reader_ms: ms(&self.wait_reader),
            copy_ms: ms(&self.copy),
            hash_ms: ms(&self.hash),
            chunk_ms: ms(&self.chunk),
            segments: segments as u64,
            copiers: copiers as u64,
            chunkers: chunkers as u64,
        }
    }
}

/// "0" turns the FIFOs off, "1" on (the default).
pub const DUMP_FIFO_ENV: &str = "GPUSNAP_DUMP_FIFO";
/// Test hook: the receiver's chunking fails once it has chunked this many
/// segments (the reading goes on to the end, as on a real error).
pub const FAIL_AFTER_ENV: &str = "GPUSNAP_TEST_FIFO_FAIL_AFTER";

/// The size asked for each FIFO's pipe: CRIU's splice moves at most what
/// fits, then waits for the reader. Larger than `fs.pipe-max-size` (1 MiB
/// by default) needs CAP_SYS_RESOURCE; the largest that is allowed is kept.
const PIPE_SIZES: [i32; 5] = [64 << 20, 16 << 20, 4 << 20, 1 << 20, 256 << 10];
/// Threads that copy a FIFO's pages out of the kernel ("1": the reader
/// alone; default: half the cores, 2 to 8: an idle copier only waits in
/// `poll`, and on the H200's 16 cores 8 took 0.5-0.9 s off a 49 GB dump
/// against 4, Runs 61-62).
pub const COPIERS_ENV: &str = "GPUSNAP_DUMP_FIFO_COPIERS";
/// Bytes of a segment one copier takes at a time (less if the kernel
/// grants a smaller pipe).
const PIECE: usize = 4 << 20;
/// The sizes asked for a copier's pipe, largest first ([`grow_pipe`]).
const PIECE_SIZES: [i32; 3] = [PIECE as i32, 1 << 20, 256 << 10];
/// How often a reader whose FIFO CRIU has not opened looks at the stop flag.
const WAIT_MS: u16 = 50;

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

/// Buffers of [`SEGMENT`] bytes, made as needed up to a limit and reused
/// (anonymous mappings asked for huge pages: a fresh 256 MiB buffer per
/// segment would be faulted in 4 KiB at a time).
struct Buffers {
    free: Mutex<(Vec<memmap2::MmapMut>, usize)>,
    freed: Condvar,
    limit: usize,
}

impl Buffers {
    fn new(limit: usize) -> Self {
        Self { free: Mutex::new((Vec::new(), 0)), freed: Condvar::new(), limit: limit.max(2) }
    }

    fn take(&self) -> std::io::Result<memmap2::MmapMut> {
        let mut g = self.free.lock().map_err(|_| std::io::Error::other("buffer pool poisoned"))?;
        loop {
            if let Some(b) = g.0.pop() {
                return Ok(b);
            }
            if g.1 < self.limit {
                g.1 += 1;
                drop(g);
                let b = memmap2::MmapMut::map_anon(SEGMENT)?;
                let _ = b.advise(memmap2::Advice::HugePage);
                return Ok(b);
            }
            g = self.freed.wait(g).map_err(|_| std::io::Error::other("buffer pool poisoned"))?;
        }
    }

    fn put(&self, b: memmap2::MmapMut) {
        if let Ok(mut g) = self.free.lock() {
            g.0.push(b);
        }
        self.freed.notify_one();
    }
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

type SegResult = Result<(Vec<ChunkRef>, Vec<Staged>), String>;
type Results = Arc<Mutex<BTreeMap<usize, SegResult>>>;

struct Job {
    buf: memmap2::MmapMut,
    len: usize,
    index: usize,
    results: Results,
}

/// What one FIFO's reader saw.
struct Drained {
    /// Under the image directory, e.g. `criu/pages-1.img`.
    rel: String,
    /// CRIU opened it.
    opened: bool,
    size: u64,
    segs: usize,
    blake3: String,
    results: Results,
    err: Option<String>,
}

/// The argument that runs a dump's keeper (hidden; started by hibernate).
pub const KEEPER_ARG: &str = "__dump-keeper";

/// A dump's keeper, as its hibernate holds it.
struct Keeper {
    child: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
}

impl Keeper {
    /// Starts `PROGRAM __dump-keeper CRIU_DIR COUNT` and waits until it has
    /// every FIFO open.
    fn start(criu_dir: &Path, count: usize, log: &Path) -> std::io::Result<Self> {
        use std::io::BufRead;
        use std::process::{Command, Stdio};
        let exe = crate::lazy::keeper_exe().ok_or_else(|| std::io::Error::other("no keeper program"))?;
        let log = fs::OpenOptions::new().create(true).append(true).open(log)?;
        let mut child = Command::new(exe)
            .arg(KEEPER_ARG)
            .arg(criu_dir)
            .arg(count.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()?;
        let stdin = child.stdin.take();
        let mut me = Self { child, stdin };
        let mut line = String::new();
        let ready =
            me.child.stdout.take().map(|o| std::io::BufReader::new(o).read_line(&mut line)).transpose()?;
        if ready.is_none() || line.trim() != "ready" {
            me.done();
            return Err(std::io::Error::other(format!("the keeper did not start ({:?})", line.trim())));
        }
        Ok(me)
    }

    /// The dump is over (finished or failed): the keeper exits at once.
    fn done(&mut self) {
        use std::io::Write;
        if let Some(mut s) = self.stdin.take() {
            let _ = s.write_all(b"done\n");
        }
        let _ = self.child.wait();
    }
}

/// The keeper (`gpusnap __dump-keeper CRIU_DIR COUNT`, its stdin a pipe
/// from the hibernate): opens `CRIU_DIR/pages-1.img` .. `pages-COUNT.img`
/// for reading, says "ready", and waits. "done" from the hibernate: exits.
/// The end of its stdin without it: the hibernate died; reads and drops
/// everything CRIU writes into them until no CRIU has CRIU_DIR on its
/// command line, removes them and exits. Returns the exit status.
pub fn keeper_main(args: &[std::ffi::OsString]) -> i32 {
    use std::io::{BufRead, Read, Write};
    let pid = std::process::id();
    let say = |line: &str| eprintln!("{} gpusnap dump keeper[{pid}]: {line}", crate::lazy::now_secs());
    let (Some(dir), Some(count), 2) =
        (args.first(), args.get(1).and_then(|c| c.to_str()?.parse::<usize>().ok()), args.len())
    else {
        say("usage: __dump-keeper CRIU_DIR COUNT (started by hibernate)");
        return 2;
    };
    let dir = PathBuf::from(dir);
    // The OOM killer that took the hibernate must not take its keeper.
    let _ = fs::write("/proc/self/oom_score_adj", "-1000");
    let mut fifos: Vec<(PathBuf, fs::File)> = Vec::new();
    for i in 1..=count {
        let p = dir.join(format!("pages-{i}.img"));
        let f = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&p);
        if let Ok(f) = f {
            if f.metadata().is_ok_and(|m| m.file_type().is_fifo()) {
                fifos.push((p, f));
            }
        }
    }
    let mut out = std::io::stdout();
    if writeln!(out, "ready").and_then(|_| out.flush()).is_err() {
        return 1;
    }
    let mut line = String::new();
    let stdin = std::io::stdin();
    let mut lock = stdin.lock();
    loop {
        line.clear();
        match lock.read_line(&mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) if line.trim() == "done" => return 0,
            Ok(_) => {}
        }
    }
    say(&format!(
        "the hibernate died during its dump: reading what CRIU sends into {} FIFOs in {} until CRIU is gone",
        fifos.len(),
        dir.display()
    ));
    let mut buf = vec![0u8; 1 << 20];
    let mut dropped = 0u64;
    let mut gone_checks = 0;
    while gone_checks < 3 {
        use nix::poll::{PollFd, PollFlags, PollTimeout};
        let mut ended = Vec::new();
        {
            let mut fds: Vec<PollFd> =
                fifos.iter().map(|(_, f)| PollFd::new(f.as_fd(), PollFlags::POLLIN)).collect();
            let _ = nix::poll::poll(&mut fds, PollTimeout::from(200u16));
            for (i, fd) in fds.iter().enumerate() {
                if fd.revents().is_some_and(|r| !r.is_empty()) {
                    ended.push(i);
                }
            }
        }
        let mut closed = Vec::new();
        for i in ended {
            loop {
                match (&fifos[i].1).read(&mut buf) {
                    Ok(0) => {
                        // A writer came and went: CRIU is done with this one
                        // (each pages file is opened once).
                        closed.push(i);
                        break;
                    }
                    Ok(n) => dropped += n as u64,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
        }
        for i in closed.into_iter().rev() {
            let (p, _) = fifos.remove(i);
            let _ = fs::remove_file(p);
        }
        if criu_on(&dir) {
            gone_checks = 0;
        } else {
            gone_checks += 1;
        }
    }
    for (p, _) in fifos {
        let _ = fs::remove_file(p);
    }
    say(&format!("CRIU is gone; {dropped} bytes of pages dropped, the FIFOs removed"));
    0
}

/// Does a process have `dir` on its command line (a CRIU dumping into it)?
fn criu_on(dir: &Path) -> bool {
    let want = dir.as_os_str().as_encoded_bytes();
    let me = std::process::id().to_string();
    let Ok(rd) = fs::read_dir("/proc") else { return true };
    rd.flatten().any(|e| {
        let name = e.file_name();
        let n = name.to_string_lossy();
        if !n.bytes().all(|b| b.is_ascii_digit()) || n == me {
            return false;
        }
        fs::read(e.path().join("cmdline")).is_ok_and(|c| c.split(|b| *b == 0).any(|a| a == want))
    })
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
    failed: Arc<Mutex<Option<String>>>,
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
        let failed: Arc<Mutex<Option<String>>> = Arc::default();
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
                        Err("an earlier segment failed".to_string())
                    } else if fail_after.is_some_and(|f| n > f) {
                        Err("test hook: the FIFO receiver's chunking fails".to_string())
                    } else {
                        let t = Instant::now();
                        let r = gpusnap_chunks::store_segment(&job.buf[..job.len], &store, durable, &taken)
                            .map_err(|e| e.to_string());
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
    pub fn finish(mut self) -> Result<Followed, String> {
        let ended = Instant::now();
        let overlapped = self.chunked_bytes.load(Ordering::Relaxed);
        let reads = self.join();
        let segments = reads.iter().map(|r| r.segs).sum();
        let mut out = Followed::default();
        let mut err = self.failed.lock().ok().and_then(|f| f.clone());
        for r in reads {
            if let Some(e) = &r.err {
                err.get_or_insert_with(|| format!("{}: {e}", r.rel));
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
                err.get_or_insert_with(|| format!("{}: a segment was not chunked", r.rel));
            }
            if !r.opened {
                continue;
            }
            if r.size == 0 {
                let p = self.criu_dir.join(r.rel.trim_start_matches("criu/"));
                if let Err(e) = gpusnap_files::create_private(&p) {
                    err.get_or_insert_with(|| format!("{}: {e}", r.rel));
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
                    err: Some("its reader panicked".into()),
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

/// Makes a FIFO at `path` (mode 0600, refused if anything is there) and
/// opens it for reading without waiting for a writer, its pipe as large as
/// allowed: the file and the pipe's size.
fn make_fifo(path: &Path) -> std::io::Result<(fs::File, usize)> {
    nix::unistd::mkfifo(path, nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR)
        .map_err(std::io::Error::from)?;
    let f = fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)?;
    if !f.metadata()?.file_type().is_fifo() {
        return Err(std::io::Error::other("not the FIFO just made"));
    }
    let size = grow_pipe(f.as_fd(), &PIPE_SIZES);
    Ok((f, size))
}

/// Asks for each size in turn (largest first) until the kernel grants one;
/// the pipe's size then. Above `fs.pipe-max-size` (1 MiB by default) needs
/// CAP_SYS_RESOURCE, which containers often lack: the largest allowed is
/// what a pipe gets there.
fn grow_pipe(fd: std::os::fd::BorrowedFd<'_>, sizes: &[i32]) -> usize {
    use nix::fcntl::{fcntl, FcntlArg};
    let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
    for &size in sizes {
        if fcntl(raw, FcntlArg::F_SETPIPE_SZ(size)).is_ok() {
            break;
        }
    }
    fcntl(raw, FcntlArg::F_GETPIPE_SZ).unwrap_or(0).max(0) as usize
}

/// Waits until CRIU opens the FIFO (or `stop`: it never will), then reads
/// it to its end a segment at a time: each hashed into the file's checksum
/// and handed to the chunkers. After a chunking error the rest is read and
/// dropped, so that CRIU is never left blocked.
fn read_fifo(rel: String, file: fs::File, stop: &AtomicBool, shared: &Shared<'_>, copiers: usize) -> Drained {
    let Shared { buffers, jobs, times, .. } = *shared;
    use nix::poll::{PollFd, PollFlags, PollTimeout};
    let results: Results = Arc::default();
    let mut out = Drained {
        rel,
        opened: false,
        size: 0,
        segs: 0,
        blake3: String::new(),
        results: results.clone(),
        err: None,
    };
    // Until a writer has opened it, a FIFO polls neither readable nor hung
    // up (the kernel hides the hang-up of a FIFO no writer has opened yet).
    loop {
        let mut fds = [PollFd::new(file.as_fd(), PollFlags::POLLIN)];
        match nix::poll::poll(&mut fds, PollTimeout::from(WAIT_MS)) {
            Ok(n) if n > 0 => break,
            Ok(_) | Err(nix::errno::Errno::EINTR) => {
                if stop.load(Ordering::Relaxed) {
                    return out;
                }
            }
            Err(e) => {
                out.err = Some(format!("poll: {e}"));
                return out;
            }
        }
    }
    out.opened = true;
    let opened = Instant::now();
    // Blocking reads from here: a writer is there, and its close is the end.
    // SAFETY: fcntl on a descriptor this function owns; no memory passed.
    unsafe {
        let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
        let fl = libc::fcntl(fd, libc::F_GETFL);
        if fl >= 0 {
            libc::fcntl(fd, libc::F_SETFL, fl & !libc::O_NONBLOCK);
        }
    }
    let mut file = file;
    // The file's checksum runs on a thread of its own, in order, so that
    // reading (a copy out of the pipe, the pace CRIU waits for) never waits
    // for hashing: on the H200's host, hashing in line held the reading
    // to 4.1 GB/s (Run 44).
    let pool_gone = AtomicBool::new(false);
    let (hash_tx, hash_rx) = mpsc::sync_channel::<Job>(2);
    std::thread::scope(|s| {
        let hashing = s.spawn(|| {
            let mut hasher = blake3::Hasher::new();
            for job in hash_rx {
                let t = Instant::now();
                hasher.update_rayon(&job.buf[..job.len]);
                Times::add(&times.hash, t);
                if let Err(mpsc::SendError(job)) = jobs.send(job) {
                    buffers.put(job.buf);
                    pool_gone.store(true, Ordering::Relaxed);
                }
            }
            hasher.finalize().to_hex().to_string()
        });
        let io = Io { shared, hash_tx: &hash_tx, pool_gone: &pool_gone, copiers };
        read_segments(&mut file, &mut out, &results, &io);
        times.read.fetch_max(opened.elapsed().as_nanos() as u64, Ordering::Relaxed);
        drop(hash_tx);
        match hashing.join() {
            Ok(h) => out.blake3 = h,
            Err(_) => {
                out.err.get_or_insert_with(|| "the hashing thread panicked".into());
            }
        }
    });
    if pool_gone.load(Ordering::Relaxed) {
        out.err.get_or_insert_with(|| "the chunking pool stopped".into());
    }
    out
}

/// What every FIFO's reader shares with the receiver.
struct Shared<'a> {
    received: &'a AtomicU64,
    failed: &'a Mutex<Option<String>>,
    buffers: &'a Buffers,
    jobs: &'a mpsc::Sender<Job>,
    times: &'a Times,
}

/// What [`read_segments`] shares with the rest of the receiver: what every
/// reader does, and its own checksum's thread.
struct Io<'a> {
    shared: &'a Shared<'a>,
    hash_tx: &'a mpsc::SyncSender<Job>,
    pool_gone: &'a AtomicBool,
    copiers: usize,
}

/// [`read_fifo`]'s reading: segments into buffers, sent to `hash_tx` (the
/// checksum, then the chunkers), until the FIFO's end.
fn read_segments(file: &mut fs::File, out: &mut Drained, results: &Results, io: &Io<'_>) {
    let Io { shared, hash_tx, pool_gone, copiers } = *io;
    let Shared { received, failed, buffers, times, .. } = *shared;
    let mut drop_buf: Option<Vec<u8>> = None;
    loop {
        use std::io::Read;
        let giving_up = out.err.is_some()
            || pool_gone.load(Ordering::Relaxed)
            || failed.lock().map(|f| f.is_some()).unwrap_or(true);
        if giving_up {
            // Read to the end and drop it: CRIU must not block.
            let b = drop_buf.get_or_insert_with(|| vec![0u8; 4 << 20]);
            match file.read(b) {
                Ok(0) => break,
                Ok(n) => {
                    received.fetch_add(n as u64, Ordering::Relaxed);
                    out.size += n as u64;
                    continue;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    out.err.get_or_insert_with(|| format!("read: {e}"));
                    break;
                }
            }
        }
        let t = Instant::now();
        let taken = buffers.take();
        Times::add(&times.wait_buffer, t);
        let mut buf = match taken {
            Ok(b) => b,
            Err(e) => {
                out.err = Some(format!("a buffer: {e}"));
                continue;
            }
        };
        let (n, eof) = match fill_segment(file, &mut buf[..], copiers, received, times) {
            Ok(r) => r,
            Err((n, e)) => {
                out.err = Some(format!("read: {e}"));
                (n, false)
            }
        };
        out.size += n as u64;
        if n == 0 || out.err.is_some() {
            buffers.put(buf);
            if eof {
                break;
            }
            continue;
        }
        let job = Job { buf, len: n, index: out.segs, results: results.clone() };
        out.segs += 1;
        let t = Instant::now();
        let sent = hash_tx.send(job);
        Times::add(&times.wait_hash, t);
        if let Err(mpsc::SendError(job)) = sent {
            buffers.put(job.buf);
            out.segs -= 1;
            out.err = Some("the hashing thread stopped".into());
            continue;
        }
        if eof {
            break;
        }
    }
}

/// Reads `buf` full from the FIFO (or to its end): the bytes read and
/// whether the end came. With `copiers` > 1, the reader only moves the
/// FIFO's pages, [`PIECE`] by piece, into one pipe per copier (a `splice`
/// between pipes moves page references, no bytes), and the copiers copy
/// them out into their pieces of `buf` on their own cores: one thread's
/// copy out of a pipe is what CRIU would wait for. On an error, the bytes
/// read before it.
fn fill_segment(
    fifo: &fs::File,
    buf: &mut [u8],
    copiers: usize,
    received: &AtomicU64,
    times: &Times,
) -> Result<(usize, bool), (usize, std::io::Error)> {
    use nix::fcntl::{splice, SpliceFFlags};
    let alone = |buf: &mut [u8]| read_into(fifo, buf, received, (&times.wait_criu, &times.copy));
    if copiers <= 1 {
        return alone(buf);
    }
    let mut ends = Vec::with_capacity(copiers);
    let mut piece = PIECE;
    for _ in 0..copiers {
        let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| (0, e.into()))?;
        // Without CAP_SYS_RESOURCE a pipe gets at most fs.pipe-max-size
        // (1 MiB by default), not PIECE: asking for PIECE alone left the
        // pipes at their 64 KiB default there, 16 times the splices, polls
        // and wake-ups per byte.
        let got = grow_pipe(w.as_fd(), &PIECE_SIZES);
        piece = piece.min(got / 4096 * 4096);
        ends.push((r, w));
    }
    times.piece.fetch_min(piece as u64, Ordering::Relaxed);
    if piece < (64 << 10) {
        // Pipes too small to be worth it: the reader copies alone.
        return alone(buf);
    }
    let (readers, writers): (Vec<_>, Vec<_>) = ends.into_iter().unzip();
    let mut mine: Vec<Vec<&mut [u8]>> = (0..copiers).map(|_| Vec::new()).collect();
    let len = buf.len();
    let pieces = len.div_ceil(piece);
    for (i, p) in buf.chunks_mut(piece).enumerate() {
        mine[i % copiers].push(p);
    }
    std::thread::scope(|s| {
        let copying: Vec<_> = mine
            .into_iter()
            .zip(readers)
            .map(|(mine, r)| {
                s.spawn(move || -> std::io::Result<usize> {
                    let f = fs::File::from(r);
                    let mut got = 0;
                    for p in mine {
                        let (n, _) = read_into(&f, p, &AtomicU64::new(0), (&times.wait_reader, &times.copy))
                            .map_err(|(_, e)| e)?;
                        got += n;
                        if n < p.len() {
                            break;
                        }
                    }
                    Ok(got)
                })
            })
            .collect();
        let mut moved_all = 0usize;
        let mut eof = false;
        let mut err = None;
        'pieces: for i in 0..pieces {
            let want = piece.min(len - i * piece);
            let mut moved = 0;
            while moved < want {
                // Waited for apart (for CRIU's bytes, for a copier's room),
                // then moved without blocking: where the time goes is then
                // known ([`FifoStats`]). A poll that says ready (or hung
                // up) lets the splice move a page at least, or see the end.
                use nix::poll::PollFlags;
                Times::await_fd(fifo.as_fd(), PollFlags::POLLIN, &times.wait_criu);
                Times::await_fd(writers[i % copiers].as_fd(), PollFlags::POLLOUT, &times.wait_room);
                let t = Instant::now();
                let r = splice(
                    fifo,
                    None,
                    &writers[i % copiers],
                    None,
                    want - moved,
                    SpliceFFlags::SPLICE_F_MOVE | SpliceFFlags::SPLICE_F_NONBLOCK,
                );
                Times::add(&times.moving, t);
                match r {
                    Ok(0) => {
                        eof = true;
                        break 'pieces;
                    }
                    Ok(n) => {
                        moved += n;
                        moved_all += n;
                        received.fetch_add(n as u64, Ordering::Relaxed);
                    }
                    Err(nix::errno::Errno::EINTR | nix::errno::Errno::EAGAIN) => {}
                    Err(e) => {
                        err = Some(std::io::Error::from(e));
                        break 'pieces;
                    }
                }
            }
        }
        // The copiers see their pipes end.
        drop(writers);
        let waiting = Instant::now();
        let mut copied = 0;
        for c in copying {
            match c.join() {
                Ok(Ok(n)) => copied += n,
                Ok(Err(e)) => {
                    err.get_or_insert(e);
                }
                Err(_) => {
                    err.get_or_insert_with(|| std::io::Error::other("a copier panicked"));
                }
            }
        }
        Times::add(&times.wait_copy, waiting);
        if err.is_none() && copied != moved_all {
            err = Some(std::io::Error::other(format!("copied {copied} of {moved_all} bytes")));
        }
        match err {
            Some(e) => Err((copied.min(moved_all), e)),
            None => Ok((moved_all, eof)),
        }
    })
}

/// Reads `buf` full from `f` (or to its end): the bytes read and whether
/// the end came; on an error, the bytes read before it. The time spent
/// waiting for bytes and reading them goes to `times` (waiting, reading).
fn read_into(
    mut f: &fs::File,
    buf: &mut [u8],
    received: &AtomicU64,
    times: (&AtomicU64, &AtomicU64),
) -> Result<(usize, bool), (usize, std::io::Error)> {
    use std::io::Read;
    let mut n = 0;
    while n < buf.len() {
        // Readable (or ended) after the wait: the read copies what is there.
        Times::await_fd(f.as_fd(), nix::poll::PollFlags::POLLIN, times.0);
        let t = Instant::now();
        let r = f.read(&mut buf[n..]);
        Times::add(times.1, t);
        match r {
            Ok(0) => return Ok((n, true)),
            Ok(k) => {
                n += k;
                received.fetch_add(k as u64, Ordering::Relaxed);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err((n, e)),
        }
    }
    Ok((n, false))
}

#[cfg(test)]
mod tests {
    use super::*;
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
        let _ = rx.failed.lock().map(|mut f| *f = Some("injected".into()));
        let data = noise(SEGMENT + 8192, 3);
        writer(criu.join("pages-1.img"), data.clone()).join().expect("the writer was never blocked");
        assert!(rx.received() >= data.len() as u64);
        let e = rx.finish().err().expect("a failure");
        assert!(e.contains("injected"), "{e}");
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
