//! The fills: the background threads (paced) and a fault's own, each a
//! read of the image's pages and a `UFFDIO_COPY` into the process.

use crate::image::Iov;
use crate::shared::{us, Mm, Shared, TICK};
use crate::sys::{self, PAGE};
use crate::PagesError;
use nix::errno::Errno;
use std::os::fd::AsFd;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The background threads: the lowest piece still to fill of some process,
/// a batch at a time, until every process is complete.
pub(crate) fn filler(sh: Arc<Shared>) {
    if let Err(e) = crate::prio::lower_this_thread(sh.opts.nice, sh.opts.idle) {
        tracing::warn!("page server: cannot lower the fill threads' priority: {e}");
    }
    let mut buf = match memmap2::MmapMut::map_anon(sh.opts.batch.max(sh.opts.wake_chunk) as usize) {
        Ok(b) => b,
        Err(e) => return sh.fail(PagesError::Fill { pid: 0, addr: 0, err: format!("buffer: {e}") }),
    };
    let mut turn = 0usize;
    while !sh.stop.load(SeqCst) && !sh.failed() {
        if !sh.restore_done.load(SeqCst) {
            // The restorer registers the lazy areas only at the end; faults
            // come meanwhile and are served by the event threads.
            sh.nap();
            continue;
        }
        let t = Instant::now();
        let mms: Vec<Arc<Mm>> = sh.mms.lock().unwrap().clone();
        let id = sh.next_id.fetch_add(1, SeqCst);
        let mut work = None;
        for k in 0..mms.len() {
            let mm = &mms[(turn + k) % mms.len()];
            let mut st = mm.st.lock().unwrap();
            if st.gone {
                continue;
            }
            if let Some(iov) = st.take(None, sh.opts.batch, id) {
                work = Some((mm.clone(), iov));
                break;
            }
        }
        turn = turn.wrapping_add(1);
        sh.stats.book_us.fetch_add(us(t.elapsed()), SeqCst);
        match work {
            Some((mm, iov)) => {
                if let Err(e) = fill(&sh, &mm, id, iov, &mut buf, false) {
                    sh.fail(e);
                }
            }
            None => {
                if sh.finished() {
                    sh.ring();
                    return;
                }
                let t = Instant::now();
                sh.nap();
                sh.stats.nap_us.fetch_add(us(t.elapsed()), SeqCst);
            }
        }
    }
}

/// Holds a background fill back to `rate` bytes per second past the head
/// start, counted from CRIU's hand-over (the fill's start); without a rate,
/// to the reader's pace while [`Server::pace_reader`] holds, and no further
/// than the head start and the pace's lead before it (see [`crate::pacer`]).
pub(crate) fn pace(sh: &Shared) {
    let rate = sh.opts.rate;
    if rate == 0 {
        if !sh.pacer.engaged() {
            return;
        }
        let t = Instant::now();
        sh.pacer.wait(
            || sh.now_us(),
            || sh.served.load(SeqCst),
            // Held for the reader: past the head start and the lead.
            || sh.opts.head_start.bytes_of(sh.total.load(SeqCst)).saturating_add(sh.opts.pace_cfg.lead),
            || sh.stop.load(SeqCst) || sh.failed(),
            TICK,
        );
        let waited = us(t.elapsed());
        if waited > 0 {
            sh.stats.pace_wait_us.fetch_add(waited, SeqCst);
        }
        return;
    }
    let done = sh.stats.restore_done_us.load(SeqCst);
    if done == 0 {
        return;
    }
    let head = sh.opts.head_start.bytes_of(sh.total.load(SeqCst));
    loop {
        let served = sh.served.load(SeqCst);
        let at = done + (served.saturating_sub(head) as f64 / rate as f64 * 1e6) as u64;
        let now = sh.now_us();
        if at <= now || sh.stop.load(SeqCst) || sh.failed() {
            return;
        }
        // At most a tick at a time, so that a stop or a failure is seen.
        std::thread::sleep(Duration::from_micros((at - now).min(TICK.as_micros() as u64)));
    }
}

/// Reads `iov` from the image and copies it into the process without
/// waking it, a chunk at a time (`wake_chunk`; a fault's fill: all at
/// once), waking each chunk's range once it is in.
pub(crate) fn fill(
    sh: &Shared,
    mm: &Mm,
    id: u64,
    iov: Iov,
    buf: &mut [u8],
    by_fault: bool,
) -> Result<(), PagesError> {
    let traced = sh.trace.is_some().then(|| (sh.now_us(), thread_usage()));
    let mut times = FillTimes::default();
    let r = fill_in(sh, mm, id, iov, buf, by_fault, &mut times);
    sh.stats.read_us.fetch_add(times.read_us, SeqCst);
    sh.stats.copy_us.fetch_add(times.copy_us, SeqCst);
    if let Some((t_fill, before)) = traced {
        let after = thread_usage();
        let d = |i: usize| after[i].saturating_sub(before[i]);
        sh.trace(|t| {
            t.fill([
                t_fill,
                sh.now_us(),
                mm.pid as u64,
                iov.start,
                iov.len(),
                by_fault as u64,
                times.read_us,
                times.copy_us,
                d(0),
                d(1),
                d(2),
                d(3),
            ])
        });
    }
    r
}

/// One fill's read and copy times (the report's sums, and the trace).
#[derive(Default)]
pub(crate) struct FillTimes {
    read_us: u64,
    copy_us: u64,
}

/// This thread's time on a CPU and waiting for one (runnable, on a run
/// queue), in us, and its voluntary and involuntary context switches so
/// far: a fill that took long while waiting for a CPU lost its core to
/// other threads; one that neither ran nor waited for a CPU slept in the
/// kernel (a lock, the disk).
pub(crate) fn thread_usage() -> [u64; 4] {
    use nix::sys::resource::{getrusage, UsageWho};
    let sched = procfs::process::Process::myself()
        .and_then(|p| p.task_from_tid(nix::unistd::gettid().as_raw()))
        .and_then(|t| t.schedstat())
        .map(|s| [s.sum_exec_runtime / 1000, s.run_delay / 1000])
        .unwrap_or([0; 2]);
    let switches = getrusage(UsageWho::RUSAGE_THREAD)
        .map(|u| [u.voluntary_context_switches() as u64, u.involuntary_context_switches() as u64])
        .unwrap_or([0; 2]);
    [sched[0], sched[1], switches[0], switches[1]]
}

pub(crate) fn fill_in(
    sh: &Shared,
    mm: &Mm,
    id: u64,
    iov: Iov,
    buf: &mut [u8],
    by_fault: bool,
    times: &mut FillTimes,
) -> Result<(), PagesError> {
    let chunk = if by_fault { iov.len() } else { sh.opts.wake_chunk.max(PAGE).min(iov.len()) };
    let fd = mm.uffd.as_fd();
    let mut at = 0u64;
    let mut requeue = false;
    while at < iov.len() && !requeue {
        let len = chunk.min(iov.len() - at);
        if let Some(d) = sh.opts.slow {
            std::thread::sleep(d);
        }
        if !by_fault {
            pace(sh);
        }
        let start = iov.start + at;
        // The chunk in pieces: what the source has in place (the page cache,
        // a kept chunk) is copied from there, up to where it ends (a chunk
        // of the store: its end); a page across that end, or anything not
        // in place, is read into the buffer first.
        let mut sub = 0u64;
        while sub < len && !requeue {
            let t = Instant::now();
            let off = iov.off + at + sub;
            let want = len - sub;
            let mapped = mm.pages.map_at(off, want as usize);
            let whole = mapped.as_ref().map_or(0, |m| m.len as u64 / PAGE * PAGE);
            let data: &[u8] = match &mapped {
                Some(m) if whole > 0 => {
                    sh.stats.in_place_bytes.fetch_add(whole, SeqCst);
                    &m.bytes()[..whole as usize]
                }
                _ => {
                    let n = if mapped.is_some() { PAGE.min(want) } else { want } as usize;
                    let data = &mut buf[..n];
                    mm.pages.read_at(off, data).map_err(|e| PagesError::Read {
                        pid: mm.pid,
                        off,
                        err: e.to_string(),
                    })?;
                    data
                }
            };
            times.read_us += us(t.elapsed());
            if let Some(n) = sh.opts.fail_after {
                if sh.served.load(SeqCst) >= n {
                    return Err(PagesError::Injected(n));
                }
            }
            let t = Instant::now();
            let n = data.len() as u64;
            requeue = copy_in(sh, mm, start + sub, data, (start, len), by_fault)?;
            if let Some(at) = sh.opts.give_back_at {
                if !by_fault && sh.served.load(SeqCst) >= at && !sh.gave_back.swap(true, SeqCst) {
                    requeue = true;
                }
            }
            times.copy_us += us(t.elapsed());
            sub += n;
        }
        let t = Instant::now();
        let _ = sys::wake(fd, start, len);
        times.copy_us += us(t.elapsed());
        at += len;
    }
    sh.stats.last_page_us.fetch_max(sh.now_us(), SeqCst);
    let t = Instant::now();
    let mut st = mm.st.lock().unwrap();
    let back = if requeue {
        st.pieces.release(id)
    } else {
        let done = st.pieces.finish(id, iov);
        st.recent.extend(done);
        Vec::new()
    };
    drop(st);
    if requeue {
        // A fault that found its page in this fill's pieces left it to this
        // fill's wake, which will not come for what was given back: wake
        // the range claimed and wherever an event moved its pieces (after
        // the release, so that the faults that come again find the pieces
        // free and fill them). Without it such a fault waited until the
        // background fill came round to the pieces, after everything else:
        // on the H200 (bench/results/072) a driver's restore stood still for 5 and
        // 10 s, until the fill's end.
        let _ = sys::wake(fd, iov.start, iov.len());
        for moved in back.iter().filter(|b| b.start < iov.start || b.end > iov.end) {
            let _ = sys::wake(fd, moved.start, moved.len());
        }
    }
    sh.stats.book_us.fetch_add(us(t.elapsed()), SeqCst);
    Ok(())
}

/// Copies `data` into the process at `dst` without waking it, skipping any
/// page already there (another thread's, or a fork's copy).
/// Each copy is counted as served, and as the fault's or the fill's, as it
/// lands (counted later, a report taken once every page is in could miss
/// the last batch's). Returns whether the fill must give its pieces back
/// (the layout is changing, or the process is gone). A copy that fails for
/// good wakes `wake` (start, len) first, so no fault waits on it for ever.
pub(crate) fn copy_in(
    sh: &Shared,
    mm: &Mm,
    dst: u64,
    data: &[u8],
    wake: (u64, u64),
    by_fault: bool,
) -> Result<bool, PagesError> {
    let fd = mm.uffd.as_fd();
    let n = data.len() as u64;
    let counter = if by_fault { &sh.stats.fault_bytes } else { &sh.stats.fill_bytes };
    let mut pos = 0u64;
    while pos < n {
        let (k, err) = {
            let _copying = mm.copying.read().unwrap();
            let (k, err) = sys::copy(fd, dst + pos, &data[pos as usize..]);
            if k > 0 {
                mm.landed.lock().unwrap().push((dst + pos, dst + pos + k));
            }
            (k, err)
        };
        pos += k;
        // Before `served`, as below.
        counter.fetch_add(k, SeqCst);
        sh.served.fetch_add(k, SeqCst);
        match err {
            None => {}
            // Part copied: go on from there.
            Some(Errno::EAGAIN) if k > 0 => {}
            // Already there (another thread, or a fork's copy): skip it.
            Some(Errno::EEXIST) => {
                pos += PAGE;
                // Counted before `served`: the report taken once every page
                // is served holds every page's kind.
                sh.stats.eexist_pages.fetch_add(1, SeqCst);
                sh.served.fetch_add(PAGE, SeqCst);
            }
            // The layout is changing (an event not yet read): try again
            // once the event has edited the pieces.
            Some(Errno::EAGAIN) => return Ok(true),
            // Not registered there any more: moved (mremap), unmapped or
            // removed meanwhile. The pieces go back as the events leave
            // them: moved to where the mapping went, or dropped. Copying
            // on to this address, or forgetting them, would lose the
            // pages of a moved mapping (they would fault in as zeros).
            Some(Errno::ENOENT) => return Ok(true),
            Some(Errno::ESRCH | Errno::ENOSPC) => {
                mm.st.lock().unwrap().gone = true;
                return Ok(true);
            }
            Some(e) => {
                let _ = sys::wake(fd, wake.0, wake.1);
                return Err(PagesError::Fill { pid: mm.pid, addr: dst + pos, err: format!("copy: {e}") });
            }
        }
    }
    Ok(false)
}
