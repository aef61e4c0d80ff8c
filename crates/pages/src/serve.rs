//! The serving side: one thread per process reading its faults and events,
//! and a pool of threads filling everything else in address order.
//!
//! Every process's memory still to fill is a sorted list of pieces; a piece
//! taken by a thread is marked with that thread's fill id until its pages
//! are in. Events (fork, remap, remove, unmap) edit the pieces in place,
//! in flight or not, so a fill never lands where the process no longer
//! expects it: a fill whose range moved or went meanwhile fails with
//! EAGAIN or ENOENT and its pieces go back to the list as the events left
//! them. A fault in a piece in flight needs nothing: the fill's WAKE wakes it.

use crate::fill::{fill, filler};
use crate::image::lazy_iovs;
use crate::mmstate::MmState;
use crate::options::Options;
use crate::pieces::{Piece, Pieces};
use crate::report::Report;
use crate::shared::{us, Mm, Shared, TICK};
use crate::source::{DirSource, PageSource};
use crate::sys::{self, PAGE};
use crate::PagesError;
use nix::errno::Errno;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SOCKET: &str = "lazy-pages.socket";
const RESTORE_FINISHED: u32 = 0x5253_5446;
/// A fault in a run of memory to fill at least this large tells the pace
/// that the reader met the fill's front ([`crate::pacer`]); a CUDA
/// driver's restore also touches small mappings here and there.
const PACE_RUN_MIN: u64 = 64 << 20;
/// How often [`Server::wait_ahead`] looks at the bytes in place: nobody
/// rings as they grow, and the driver's restore waits on it (with
/// [`TICK`], a head start the fill made in 45 ms cost 50 or 100; measured
/// on the H200, bench/results/070-071).
const HEAD_TICK: Duration = Duration::from_millis(1);
/// A running page server. Dropping it stops serving and closes every
/// userfaultfd: call [`Server::wait`] first, or end the processes first
/// (a closed userfaultfd lets their pending faults through as zero pages).
pub struct Server {
    shared: Arc<Shared>,
    socket: PathBuf,
}

impl Server {
    /// Listens on `work/lazy-pages.socket` for the `criu restore
    /// --lazy-pages` about to run with that work dir, serving from `images`.
    pub fn start(images: &Path, work: &Path, opts: Options) -> Result<Self, PagesError> {
        Self::start_with(images, Arc::new(DirSource::new(images)), work, opts)
    }

    /// As [`Server::start`], with the pages files read through `source`
    /// (the pagemap and mm images still come from `images`).
    pub fn start_with(
        images: &Path,
        source: Arc<dyn PageSource>,
        work: &Path,
        opts: Options,
    ) -> Result<Self, PagesError> {
        let socket = work.join(SOCKET);
        let _ = std::fs::remove_file(&socket);
        let sock_err =
            |e: std::io::Error| PagesError::Socket { path: socket.display().to_string(), err: e.to_string() };
        // sun_path holds 107 bytes: a deep work dir is reached through its fd.
        let dir = File::open(work).map_err(sock_err)?;
        let listener = if socket.as_os_str().len() < 100 {
            UnixListener::bind(&socket)
        } else {
            UnixListener::bind(format!("/proc/self/fd/{}/{SOCKET}", dir.as_raw_fd()))
        }
        .map_err(sock_err)?;
        listener.set_nonblocking(true).map_err(sock_err)?;
        let shared = Arc::new(Shared::new(images, source, opts));
        if shared.opts.paced() {
            // Past the head start, the fill waits for the driver's restores
            // ([`Server::pace_reader`]) to keep to their pace.
            shared.pacer.hold();
        }
        shared.spawn("pages-accept", move |sh| {
            if let Err(e) = accept(&sh, listener) {
                sh.fail(e);
            }
        });
        for i in 0..shared.opts.threads.max(1) {
            shared.spawn(&format!("pages-fill-{i}"), filler);
        }
        Ok(Self { shared, socket })
    }

    /// Hands a copy of every userfaultfd, and every event, to `keeper`
    /// from now on (before `criu restore` starts), and releases it once
    /// this server is dropped (docs/design/wake.md, "Safety").
    pub fn keep_with(&self, keeper: crate::keeper::Keeper) {
        let _ = self.shared.keeper.set(keeper);
    }

    /// The keeper's side, once the wake died before every page was in
    /// place: serves what the wake handed over (its messages, replayed onto
    /// the image's lazy pieces) until every page is in place
    /// ([`Server::wait`]). Pages already there give EEXIST and are skipped.
    pub fn adopt(
        images: &Path,
        source: Arc<dyn PageSource>,
        opts: Options,
        log: Vec<(crate::keeper::Msg, Option<OwnedFd>)>,
    ) -> Result<Self, PagesError> {
        let mms = crate::keeper::replay(images, log)?;
        let shared = Arc::new(Shared::new(images, source, opts));
        let mut total = 0;
        for r in mms {
            let pages = shared.source.open(&format!("pages-{}.img", r.pages_id))?;
            total += r.pieces.iter().map(|i| i.len()).sum::<u64>();
            // Faults the dead server had read but not answered wait for a
            // WAKE that would never come: wake the whole address space
            // once; a page still missing faults again, and is read here.
            if !crate::keeper::wake_all(r.uffd.as_fd()) {
                tracing::warn!(pid = r.pid, "keeper: cannot wake the faults the wake had read");
            }
            let mm = Arc::new(Mm::new(r.pid, shared.key(), r.uffd, pages, MmState::of(r.pieces)));
            add_mm(&shared, mm);
        }
        shared.total.store(total, SeqCst);
        shared.stats.restore_done_us.store(shared.now_us(), SeqCst);
        shared.restore_done.store(true, SeqCst);
        for i in 0..shared.opts.threads.max(1) {
            shared.spawn(&format!("pages-fill-{i}"), filler);
        }
        shared.ring();
        Ok(Self { shared, socket: PathBuf::new() })
    }

    /// Bytes in place (or no longer needed: unmapped, removed) so far.
    pub fn done_bytes(&self) -> u64 {
        self.shared.served.load(SeqCst) + self.shared.dropped.load(SeqCst)
    }

    /// Bytes to serve in all (grows when a process forks during the wake).
    pub fn total_bytes(&self) -> u64 {
        self.shared.total.load(SeqCst)
    }

    /// Blocks until every page of every process is in place, or the server
    /// failed. On failure nothing is closed: the processes stay blocked on
    /// what is missing (never handed zeros) until the server is dropped.
    pub fn wait(&self) -> Result<Report, PagesError> {
        // No reader runs while its caller waits: a held fill goes on.
        self.shared.pacer.stop(self.shared.now_us());
        loop {
            if let Some(e) = self.shared.error.lock().unwrap().take() {
                self.shared.stop.store(true, SeqCst);
                return Err(e);
            }
            if self.shared.stop.load(SeqCst) {
                return Err(PagesError::Aborted);
            }
            if self.shared.finished() {
                return Ok(self.shared.report());
            }
            self.shared.nap();
        }
    }

    /// The figures so far (also of a server that failed).
    pub fn report(&self) -> Report {
        self.shared.report()
    }

    /// Blocks until `bytes` are in place (or everything is, or a process
    /// of the tree is gone), so that the driver's restore starts behind a
    /// head start of the background fill. An error is the server's failure:
    /// the caller must not start the driver on memory that will never come.
    pub fn wait_ahead(&self, bytes: u64) -> Result<(), PagesError> {
        let want = bytes.min(self.total_bytes());
        loop {
            if let Some(e) = self.shared.error.lock().unwrap().take() {
                self.shared.stop.store(true, SeqCst);
                return Err(e);
            }
            if self.shared.stop.load(SeqCst) {
                return Err(PagesError::Aborted);
            }
            if self.done_bytes() >= want
                || self.shared.finished()
                || self.shared.mms.lock().unwrap().iter().any(|m| m.st.lock().unwrap().gone)
            {
                let now = self.shared.now_us();
                self.shared.trace(|t| t.head_done_us = now);
                return Ok(());
            }
            self.shared.nap_for(HEAD_TICK);
        }
    }

    /// Stops serving (the restore failed: CRIU ends what it restored).
    pub fn abort(&self) {
        self.shared.stop.store(true, SeqCst);
        self.shared.pacer.stop(self.shared.now_us());
        self.shared.ring();
    }

    /// The driver's restores start reading the memory this server fills:
    /// with [`Options::pace`] the background fill keeps to their pace until
    /// the guard is dropped ([`crate::pacer`]); faults are never held back.
    /// Without it (or with a fixed [`Options::rate`]) the guard does nothing.
    pub fn pace_reader(&self) -> PaceGuard<'_> {
        let sh = &self.shared;
        let on = sh.opts.paced() && !sh.finished();
        if on {
            sh.pacer.start(sh.now_us(), sh.served.load(SeqCst));
        }
        PaceGuard { server: self, on }
    }

    /// A handle for the thread that watches this server while a CUDA
    /// driver restore reads the memory it serves (see [`Rescuer`]).
    pub fn rescuer(&self) -> Rescuer {
        Rescuer(self.shared.clone())
    }
}

/// What a failed lazy wake needs while a CUDA driver restore is blocked on
/// memory the server will never bring: the driver's call cannot be
/// cancelled, and the process must not be killed in the middle of it (a
/// killed or crashed process whose CUDA state is half on the GPU is what
/// hangs hosts). So the caller stops every other thread of the process
/// (ptrace, as CRIU's CUDA plugin keeps a tree during its restore), then
/// lets the restore run to its end on zero pages, checkpoints the process
/// again and kills it. Nothing of the process runs on the zero pages: its
/// threads are stopped, and its CUDA state is never unlocked.
#[derive(Clone)]
pub struct Rescuer(Arc<Shared>);

/// The background fill keeps to the reader's pace while this lives
/// ([`Server::pace_reader`]); dropped, the rest goes in at full speed.
#[must_use = "the pace ends when the guard is dropped"]
pub struct PaceGuard<'a> {
    server: &'a Server,
    on: bool,
}

impl Drop for PaceGuard<'_> {
    fn drop(&mut self) {
        if self.on {
            let sh = &self.server.shared;
            sh.pacer.stop(sh.now_us());
        }
    }
}

impl Rescuer {
    /// The server failed (a read, a chunk that failed its check, a copy).
    pub fn failed(&self) -> bool {
        self.0.failed() || self.0.zeroing.load(SeqCst)
    }

    /// Stops serving the image, as a failure of the server: `why` becomes
    /// the error of [`Server::wait`] unless it failed already.
    pub fn stop_serving(&self, why: &str) {
        self.0.fail(PagesError::Stopped(why.to_string()));
    }

    /// From now on every fault of every process is answered with zero
    /// pages (the rest of its piece, up to [`ZERO_SPAN`], at once), and
    /// the faults read but never answered are woken to fault again.
    /// Serving the image stops. Only for a tree whose threads other than
    /// the driver's restore threads are stopped and that will be killed.
    pub fn zero_missing(&self) {
        let sh = &self.0;
        if sh.zeroing.swap(true, SeqCst) {
            return;
        }
        if !sh.failed() {
            sh.fail(PagesError::Stopped("the wake is being ended".into()));
        }
        let mms: Vec<Arc<Mm>> = sh.mms.lock().unwrap().clone();
        tracing::warn!(
            processes = mms.len(),
            "page server: answering every missing page with zeros (rescue)"
        );
        for mm in mms {
            sh.spawn(&format!("pages-zero-{}", mm.pid), move |sh| zero_faults(&sh, &mm));
        }
    }
}

/// Bytes of zero pages a rescue maps at a fault at most.
pub const ZERO_SPAN: u64 = 64 << 20;

/// The rescue's side of one process: zero pages for every fault, until the
/// server is dropped (after the tree was killed).
fn zero_faults(sh: &Arc<Shared>, mm: &Arc<Mm>) {
    let fd = mm.uffd.as_fd();
    let mut last_wake: Option<Instant> = None;
    while !sh.halt.load(SeqCst) {
        // Faults read by the server's threads before they stopped wait for
        // a WAKE that will not come: wake the whole address space now and
        // then (a thread of the old server may still read one late); a page
        // still missing faults again and is answered here.
        if last_wake.is_none_or(|t| t.elapsed() >= TICK) {
            if !crate::keeper::wake_all(fd) {
                tracing::warn!(pid = mm.pid, "rescue: cannot wake the waiting faults");
            }
            last_wake = Some(Instant::now());
        }
        let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd for the call.
        unsafe { libc::poll(&mut p, 1, TICK.as_millis() as i32) };
        loop {
            let msg = match sys::read_msg(fd) {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(_) => return,
            };
            match msg.event {
                sys::EVENT_PAGEFAULT => zero_at(sh, mm, msg.arg[1] & !(PAGE - 1)),
                sys::EVENT_FORK => {
                    // SAFETY: reading the FORK event installed this fd in our
                    // table; owned here only to be closed (the child of a
                    // tree being ended).
                    drop(unsafe { OwnedFd::from_raw_fd(msg.arg[0] as u32 as RawFd) });
                }
                _ => {}
            }
        }
    }
}

/// Zero pages from `addr` to the end of its piece (at most [`ZERO_SPAN`]),
/// skipping pages already there.
fn zero_at(sh: &Shared, mm: &Mm, addr: u64) {
    let end = {
        let st = mm.st.lock().unwrap();
        st.pieces.at(addr).map(|p| p.iov.end.min(addr + ZERO_SPAN)).unwrap_or(addr + PAGE)
    };
    let fd = mm.uffd.as_fd();
    let mut at = addr;
    let mut busy = 0;
    while at < end {
        let (n, err) = sys::zeropage_part(fd, at, end - at);
        at += n;
        sh.zero_pages.fetch_add(n / PAGE, SeqCst);
        match err {
            None => break,
            Some(Errno::EAGAIN) if n > 0 => {}
            Some(Errno::EEXIST) => {
                let _ = sys::wake(fd, at, PAGE);
                at += PAGE;
            }
            // The layout is changing (an event not read yet): a few tries,
            // then the fault comes again after the next wake.
            Some(Errno::EAGAIN) if busy < 100 => {
                busy += 1;
                std::thread::sleep(Duration::from_millis(1));
            }
            Some(e) => {
                if !matches!(e, Errno::ENOENT | Errno::ESRCH | Errno::ENOSPC) {
                    tracing::warn!(pid = mm.pid, addr = at, "rescue: zeropage: {e}");
                }
                let _ = sys::wake(fd, addr, PAGE);
                break;
            }
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shared.halt.store(true, SeqCst);
        self.abort();
        let hs: Vec<_> = std::mem::take(&mut *self.shared.threads.lock().unwrap());
        for h in hs {
            let _ = h.join();
        }
        // Late forks may have added threads while joining.
        let hs: Vec<_> = std::mem::take(&mut *self.shared.threads.lock().unwrap());
        for h in hs {
            let _ = h.join();
        }
        self.shared.write_trace();
        if !self.socket.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.socket);
        }
        // Every page is in place or the tree was ended: the keeper closes
        // its copies of the userfaultfds and exits.
        if let Some(k) = self.shared.keeper.get() {
            k.release();
        }
    }
}

fn ready(fd: RawFd, stop: &AtomicBool) -> bool {
    while !stop.load(SeqCst) {
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd for the call.
        let r = unsafe { libc::poll(&mut p, 1, TICK.as_millis() as i32) };
        if r > 0 {
            return true;
        }
    }
    false
}

/// Reads exactly `buf.len()` bytes, and the fd that came with them if any.
fn recv(s: &UnixStream, buf: &mut [u8], stop: &AtomicBool) -> Result<Option<OwnedFd>, PagesError> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let mut got = 0;
    let mut fd = None;
    while got < buf.len() {
        if !ready(s.as_raw_fd(), stop) {
            return Err(PagesError::Aborted);
        }
        let mut cmsg = nix::cmsg_space!([RawFd; 4]);
        let mut iov = [std::io::IoSliceMut::new(&mut buf[got..])];
        let msg = recvmsg::<()>(s.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC)
            .map_err(|e| PagesError::Socket { path: SOCKET.into(), err: e.to_string() })?;
        if msg.bytes == 0 {
            return Err(PagesError::HungUp);
        }
        for c in msg.cmsgs().into_iter().flatten() {
            if let ControlMessageOwned::ScmRights(fds) = c {
                for f in fds {
                    // SAFETY: the kernel installed this fd in our table for us.
                    let owned = unsafe { OwnedFd::from_raw_fd(f) };
                    if fd.is_none() {
                        fd = Some(owned);
                    }
                }
            }
        }
        got += msg.bytes;
    }
    Ok(fd)
}

fn accept(sh: &Arc<Shared>, listener: UnixListener) -> Result<(), PagesError> {
    if !ready(listener.as_raw_fd(), &sh.stop) {
        return Ok(());
    }
    let (conn, _) =
        listener.accept().map_err(|e| PagesError::Socket { path: SOCKET.into(), err: e.to_string() })?;
    drop(listener);
    loop {
        let mut w = [0u8; 4];
        recv(&conn, &mut w, &sh.stop)?;
        let v = u32::from_ne_bytes(w);
        if v == RESTORE_FINISHED {
            tracing::debug!("page server: restore finished");
            sh.stats.restore_done_us.store(sh.now_us(), SeqCst);
            sh.restore_done.store(true, SeqCst);
            sh.ring();
            return Ok(());
        }
        let pid = v as i32;
        if pid < 0 {
            tracing::debug!(pid = -pid, "page server: a zombie, nothing to serve");
            continue;
        }
        let mut one = [0u8; 1];
        let uffd = recv(&conn, &mut one, &sh.stop)?.ok_or_else(|| PagesError::Socket {
            path: SOCKET.into(),
            err: format!("no userfaultfd came for {pid}"),
        })?;
        // To the keeper first thing: the moment this process dies, the
        // userfaultfd is held there.
        let key = sh.key();
        sh.forward(crate::keeper::uffd(key, pid), Some(uffd.as_fd()));
        let (pages_id, iovs) = lazy_iovs(&sh.images, pid)?;
        let pages = sh.source.open(&format!("pages-{pages_id}.img"))?;
        tracing::debug!(pid, pieces = iovs.len(), "page server: a process to serve");
        sh.trace(|t| {
            t.pieces.insert(pid, iovs.iter().map(|i| [i.start, i.len()]).collect());
        });
        let mm = Arc::new(Mm::new(pid, key, uffd, pages, MmState::of(iovs).big_first(sh.opts.big_first)));
        add_mm(sh, mm);
    }
}

fn add_mm(sh: &Arc<Shared>, mm: Arc<Mm>) {
    let pieces = mm.st.lock().unwrap().pieces.len() as u64;
    sh.stats.pieces.fetch_add(pieces, SeqCst);
    sh.mms.lock().unwrap().push(mm.clone());
    sh.spawn(&format!("pages-uffd-{}", mm.pid), move |sh| events(&sh, &mm));
    sh.ring();
}

/// One process's faults and events, until it is gone or the server stops.
fn events(sh: &Arc<Shared>, mm: &Arc<Mm>) {
    let fd = mm.uffd.as_fd();
    let mut retry: Vec<u64> = Vec::new();
    let mut buf = vec![0u8; sh.opts.fault_batch as usize];
    while !sh.stop.load(SeqCst) && !sh.failed() {
        if mm.st.lock().unwrap().gone {
            return;
        }
        let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd for the call.
        unsafe { libc::poll(&mut p, 1, TICK.as_millis() as i32) };
        for addr in std::mem::take(&mut retry) {
            fault(sh, mm, addr, &mut retry, &mut buf);
        }
        loop {
            mm.st.lock().unwrap().recent.clear();
            mm.landed.lock().unwrap().clear();
            let msg = match sys::read_msg(fd) {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(_) => {
                    mm.st.lock().unwrap().gone = true;
                    sh.ring();
                    return;
                }
            };
            let [a0, a1, a2] = msg.arg;
            // The keeper hears of every event before it is acted on: if
            // gpusnap dies now, the keeper replays it (docs/design/wake.md).
            let child_key = match msg.event {
                sys::EVENT_FORK => {
                    let k = sh.key();
                    // SAFETY: the fd the FORK event installed; borrowed
                    // only for this call, owned just below.
                    let child = unsafe { std::os::fd::BorrowedFd::borrow_raw(a0 as u32 as RawFd) };
                    sh.forward(crate::keeper::fork(k, mm.key), Some(child));
                    k
                }
                sys::EVENT_REMAP => {
                    sh.forward(crate::keeper::remap(mm.key, a0, a1, a2), None);
                    0
                }
                sys::EVENT_REMOVE | sys::EVENT_UNMAP => {
                    sh.forward(crate::keeper::unmap(mm.key, a0, a1, msg.event == sys::EVENT_REMOVE), None);
                    0
                }
                _ => 0,
            };
            match msg.event {
                sys::EVENT_PAGEFAULT => fault(sh, mm, a1 & !(PAGE - 1), &mut retry, &mut buf),
                sys::EVENT_FORK => {
                    // SAFETY: reading the FORK event installed this new fd in
                    // our table; nothing else owns it.
                    let child = unsafe { OwnedFd::from_raw_fd(a0 as u32 as RawFd) };
                    let (pieces, runs): (Pieces, Vec<(u64, u64)>) = {
                        let st = mm.st.lock().unwrap();
                        let mut v: Vec<Piece> =
                            st.pieces.iter().map(|p| Piece { iov: p.iov, owner: 0 }).collect();
                        v.extend(st.recent.iter().map(|iov| Piece { iov: *iov, owner: 0 }));
                        (Pieces::new(v), st.runs.clone())
                    };
                    let bytes: u64 = pieces.iter().map(|p| p.iov.len()).sum();
                    tracing::debug!(pid = mm.pid, bytes, "page server: FORK");
                    sh.total.fetch_add(bytes, SeqCst);
                    sh.forks.fetch_add(1, SeqCst);
                    add_mm(
                        sh,
                        Arc::new(Mm::new(
                            mm.pid,
                            child_key,
                            child,
                            mm.pages.clone(),
                            MmState { pieces, runs, ..Default::default() },
                        )),
                    );
                }
                sys::EVENT_REMAP => {
                    tracing::debug!(pid = mm.pid, from = a0, to = a1, len = a2, "page server: REMAP");
                    mm.st.lock().unwrap().remap(a0, a1, a2);
                }
                sys::EVENT_REMOVE | sys::EVENT_UNMAP => {
                    tracing::debug!(
                        pid = mm.pid,
                        start = a0,
                        end = a1,
                        ev = msg.event,
                        "page server: REMOVE/UNMAP"
                    );
                    // A removed range keeps its VMA: faults there must be the
                    // kernel's zero pages from now on, not ours (criu/uffd.c
                    // handle_remove does the same).
                    if msg.event == sys::EVENT_REMOVE {
                        if let Err(e) = sys::unregister(fd, a0, a1 - a0) {
                            if e == Errno::ENOMEM {
                                mm.st.lock().unwrap().gone = true;
                                return;
                            }
                            sh.fail(PagesError::Fill {
                                pid: mm.pid,
                                addr: a0,
                                err: format!("unregister: {e}"),
                            });
                            return;
                        }
                    }
                    // A copy into a removed range that lands after the
                    // kernel zapped it would leave the image's bytes where
                    // the process must read zeros. The zap comes only once
                    // this event is read (the madvise waits for that), and
                    // copies after the unregister above fail; so the copies
                    // that may have landed after it are those still in
                    // flight at the unregister and those that landed since
                    // this read began (`landed`). None can be undone (no
                    // MADV_DONTNEED on another process): the wake fails
                    // safely instead (the tree ended, the image kept).
                    let raced = msg.event == sys::EVENT_REMOVE && {
                        // Every copy that got in before the unregister has
                        // said where it landed once this is taken.
                        drop(mm.copying.write().unwrap());
                        sh.opts.remove_raced
                            || mm.landed.lock().unwrap().iter().any(|&(s, e)| s < a1 && e > a0)
                    };
                    let d = mm.st.lock().unwrap().drop_range(a0, a1);
                    sh.dropped.fetch_add(d, SeqCst);
                    if raced {
                        sh.fail(PagesError::Fill {
                            pid: mm.pid,
                            addr: a0,
                            err: format!(
                                "the process removed {a0:#x}..{a1:#x} (MADV_DONTNEED) while a copy into it was in flight: it might read the image's bytes there instead of zeros"
                            ),
                        });
                        return;
                    }
                }
                other => {
                    sh.fail(PagesError::Fill {
                        pid: mm.pid,
                        addr: 0,
                        err: format!("unexpected uffd event {other:#x}"),
                    });
                    return;
                }
            }
            sh.ring();
        }
    }
}

fn fault(sh: &Arc<Shared>, mm: &Arc<Mm>, addr: u64, retry: &mut Vec<u64>, buf: &mut [u8]) {
    let t0 = Instant::now();
    let s = &sh.stats;
    let now = sh.now_us();
    let _ = s.first_fault_us.compare_exchange(0, now, SeqCst, SeqCst);
    s.last_fault_us.store(now, SeqCst);
    s.faults.fetch_add(1, SeqCst);
    let id = sh.next_id.fetch_add(1, SeqCst);
    let taken = {
        let mut st = mm.st.lock().unwrap();
        // Faults off the large runs neither steer the fill nor count for
        // its direction.
        let follow = st.follows(addr, sh.opts.follow_min);
        if follow && st.note_fault(addr) {
            s.faults_backward.fetch_add(1, SeqCst);
        }
        let in_flight = st.in_flight(addr);
        // The reader met memory still to fill in a large run: the fill's
        // front, where the pace must not hold it back.
        if sh.pacer.is_on() && in_flight.is_some() && st.follows(addr, PACE_RUN_MIN) {
            sh.pacer.caught_up(now, sh.served.load(SeqCst));
        }
        match in_flight {
            // Another thread is filling it: its WAKE wakes this fault.
            Some(true) => {
                s.faults_in_flight.fetch_add(1, SeqCst);
                sh.trace(|t| t.fault([now, mm.pid as u64, addr, 0]));
                return;
            }
            Some(false) if !follow => st.take(Some(addr), sh.opts.fault_batch, id),
            Some(false) => {
                // The background fill follows the reader, in its direction,
                // `ahead` bytes on.
                let ahead = sh.opts.ahead;
                if st.down {
                    let got = st.take_down(Some(addr + PAGE), sh.opts.fault_batch, id);
                    st.hint = got.map(|iov| iov.start.saturating_sub(ahead));
                    got
                } else {
                    let got = st.take(Some(addr), sh.opts.fault_batch, id);
                    st.hint = got.map(|iov| iov.end.saturating_add(ahead));
                    got
                }
            }
            None => None,
        }
    };
    sh.trace(|t| t.fault([now, mm.pid as u64, addr, if taken.is_some() { 1 } else { 2 }]));
    match taken {
        Some(iov) => {
            if let Err(e) = fill(sh, mm, id, iov, buf, true) {
                sh.fail(e);
            }
            s.fault_busy_us.fetch_add(us(t0.elapsed()), SeqCst);
        }
        None => {
            // Counted first: the zero page wakes the process, which may
            // look at the report before this thread runs again.
            sh.zero_pages.fetch_add(1, SeqCst);
            let r = sys::zeropage(mm.uffd.as_fd(), addr, PAGE);
            if r.is_err() {
                sh.zero_pages.fetch_sub(1, SeqCst);
            }
            match r {
                Ok(()) => {}
                // Filled meanwhile: only the wake is missing.
                Err(Errno::EEXIST) => {
                    let _ = sys::wake(mm.uffd.as_fd(), addr, PAGE);
                }
                Err(Errno::EAGAIN) => retry.push(addr),
                Err(Errno::ENOENT | Errno::ESRCH | Errno::ENOSPC) => {}
                Err(e) => sh.fail(PagesError::Fill { pid: mm.pid, addr, err: format!("zeropage: {e}") }),
            }
        }
    }
}
