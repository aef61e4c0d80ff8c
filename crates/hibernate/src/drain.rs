//! Reading one FIFO of a dump: CRIU's pages a segment at a time into
//! reused buffers (by a reader and its copiers), hashed into the file's
//! checksum in order and handed to the chunkers (see [`crate::fifo`]).

use std::collections::BTreeMap;
use std::fs;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::Instant;

use gpusnap_chunks::{ChunkRef, Staged, SEGMENT};

use crate::chunking::ChunkingError;
use crate::follow::FifoStats;

/// Where the receiver's threads spend their time, in ns summed over the
/// threads of a kind ([`FifoStats`]: what CRIU's write waited for).
pub(crate) struct Times {
    /// The longest FIFO from CRIU's open to its end.
    pub(crate) read: AtomicU64,
    pub(crate) wait_criu: AtomicU64,
    pub(crate) wait_room: AtomicU64,
    pub(crate) moving: AtomicU64,
    pub(crate) wait_copy: AtomicU64,
    pub(crate) wait_buffer: AtomicU64,
    pub(crate) wait_hash: AtomicU64,
    pub(crate) wait_reader: AtomicU64,
    pub(crate) copy: AtomicU64,
    pub(crate) hash: AtomicU64,
    pub(crate) chunk: AtomicU64,
    /// The smallest pipe a FIFO was granted, and the smallest piece a
    /// copier took (bytes; `u64::MAX` until one is known).
    pub(crate) fifo_pipe: AtomicU64,
    pub(crate) piece: AtomicU64,
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
    pub(crate) fn add(at: &AtomicU64, since: Instant) {
        at.fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    /// Waits, timed into `at`, until `fd` polls ready for `flags` or hangs
    /// up or fails (the call made next says which).
    pub(crate) fn await_fd(fd: std::os::fd::BorrowedFd<'_>, flags: nix::poll::PollFlags, at: &AtomicU64) {
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

    pub(crate) fn stats(&self, segments: usize, copiers: usize, chunkers: usize) -> FifoStats {
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

/// The size asked for each FIFO's pipe: CRIU's splice moves at most what
/// fits, then waits for the reader. Larger than `fs.pipe-max-size` (1 MiB
/// by default) needs CAP_SYS_RESOURCE; the largest that is allowed is kept.
pub(crate) const PIPE_SIZES: [i32; 5] = [64 << 20, 16 << 20, 4 << 20, 1 << 20, 256 << 10];
/// Bytes of a segment one copier takes at a time (less if the kernel
/// grants a smaller pipe).
pub(crate) const PIECE: usize = 4 << 20;
/// The sizes asked for a copier's pipe, largest first ([`grow_pipe`]).
pub(crate) const PIECE_SIZES: [i32; 3] = [PIECE as i32, 1 << 20, 256 << 10];
/// How often a reader whose FIFO CRIU has not opened looks at the stop flag.
pub(crate) const WAIT_MS: u16 = 50;

/// Buffers of [`SEGMENT`] bytes, made as needed up to a limit and reused
/// (anonymous mappings asked for huge pages: a fresh 256 MiB buffer per
/// segment would be faulted in 4 KiB at a time).
pub(crate) struct Buffers {
    pub(crate) free: Mutex<(Vec<memmap2::MmapMut>, usize)>,
    pub(crate) freed: Condvar,
    pub(crate) limit: usize,
}

impl Buffers {
    pub(crate) fn new(limit: usize) -> Self {
        Self { free: Mutex::new((Vec::new(), 0)), freed: Condvar::new(), limit: limit.max(2) }
    }

    pub(crate) fn take(&self) -> std::io::Result<memmap2::MmapMut> {
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

    pub(crate) fn put(&self, b: memmap2::MmapMut) {
        if let Ok(mut g) = self.free.lock() {
            g.0.push(b);
        }
        self.freed.notify_one();
    }
}

pub(crate) type SegResult = Result<(Vec<ChunkRef>, Vec<Staged>), ChunkingError>;
pub(crate) type Results = Arc<Mutex<BTreeMap<usize, SegResult>>>;

pub(crate) struct Job {
    pub(crate) buf: memmap2::MmapMut,
    pub(crate) len: usize,
    pub(crate) index: usize,
    pub(crate) results: Results,
}

/// What one FIFO's reader saw.
pub(crate) struct Drained {
    /// Under the image directory, e.g. `criu/pages-1.img`.
    pub(crate) rel: String,
    /// CRIU opened it.
    pub(crate) opened: bool,
    pub(crate) size: u64,
    pub(crate) segs: usize,
    pub(crate) blake3: String,
    pub(crate) results: Results,
    pub(crate) err: Option<ChunkingError>,
}

/// Makes a FIFO at `path` (mode 0600, refused if anything is there) and
/// opens it for reading without waiting for a writer, its pipe as large as
/// allowed: the file and the pipe's size.
pub(crate) fn make_fifo(path: &Path) -> std::io::Result<(fs::File, usize)> {
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
pub(crate) fn grow_pipe(fd: std::os::fd::BorrowedFd<'_>, sizes: &[i32]) -> usize {
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
pub(crate) fn read_fifo(
    rel: String,
    file: fs::File,
    stop: &AtomicBool,
    shared: &Shared<'_>,
    copiers: usize,
) -> Drained {
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
                out.err = Some(ChunkingError::io("poll", std::io::Error::other(e)));
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
    // to 4.1 GB/s (bench/results/044).
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
                out.err.get_or_insert(ChunkingError::Thread("the hashing thread panicked"));
            }
        }
    });
    if pool_gone.load(Ordering::Relaxed) {
        out.err.get_or_insert(ChunkingError::Thread("the chunking pool stopped"));
    }
    out
}

/// What every FIFO's reader shares with the receiver.
pub(crate) struct Shared<'a> {
    pub(crate) received: &'a AtomicU64,
    pub(crate) failed: &'a Mutex<Option<ChunkingError>>,
    pub(crate) buffers: &'a Buffers,
    pub(crate) jobs: &'a mpsc::Sender<Job>,
    pub(crate) times: &'a Times,
}

/// What [`read_segments`] shares with the rest of the receiver: what every
/// reader does, and its own checksum's thread.
pub(crate) struct Io<'a> {
    pub(crate) shared: &'a Shared<'a>,
    pub(crate) hash_tx: &'a mpsc::SyncSender<Job>,
    pub(crate) pool_gone: &'a AtomicBool,
    pub(crate) copiers: usize,
}

/// [`read_fifo`]'s reading: segments into buffers, sent to `hash_tx` (the
/// checksum, then the chunkers), until the FIFO's end.
pub(crate) fn read_segments(file: &mut fs::File, out: &mut Drained, results: &Results, io: &Io<'_>) {
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
                    out.err.get_or_insert_with(|| ChunkingError::io("read", e));
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
                out.err = Some(ChunkingError::io("a buffer", e));
                continue;
            }
        };
        let (n, eof) = match fill_segment(file, &mut buf[..], copiers, received, times) {
            Ok(r) => r,
            Err((n, e)) => {
                out.err = Some(ChunkingError::io("read", e));
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
            out.err = Some(ChunkingError::Thread("the hashing thread stopped"));
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
pub(crate) fn fill_segment(
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
pub(crate) fn read_into(
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
