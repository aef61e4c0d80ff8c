//! What the page server's threads share: the processes served (their
//! userfaultfd, pages and pieces), the counters of the report, the trace.

use crate::mmstate::MmState;
use crate::options::Options;
use crate::pacer::Pacer;
use crate::report::Report;
use crate::source::{PageSource, PagesFile};
use crate::PagesError;
use serde::Serialize;
use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub(crate) const TICK: Duration = Duration::from_millis(50);

pub(crate) struct Mm {
    pub(crate) pid: i32,
    /// Its number for the keeper.
    pub(crate) key: u32,
    pub(crate) uffd: OwnedFd,
    pub(crate) pages: Arc<dyn PagesFile>,
    pub(crate) st: Mutex<MmState>,
    /// Held (shared) by every `UFFDIO_COPY` until what it copied is in
    /// `landed`; taken alone by a REMOVE, so that every copy that landed
    /// before its unregister is counted.
    pub(crate) copying: RwLock<()>,
    /// Ranges copied in since the event thread last began a read: a
    /// removed range one of them meets may hold the image's bytes where
    /// the process must read zeros (see the REMOVE event).
    pub(crate) landed: Mutex<Vec<(u64, u64)>>,
}

impl Mm {
    pub(crate) fn new(pid: i32, key: u32, uffd: OwnedFd, pages: Arc<dyn PagesFile>, st: MmState) -> Self {
        Self { pid, key, uffd, pages, st: Mutex::new(st), copying: RwLock::new(()), landed: Mutex::default() }
    }
}

pub(crate) struct Shared {
    pub(crate) images: PathBuf,
    pub(crate) source: Arc<dyn PageSource>,
    pub(crate) opts: Options,
    pub(crate) mms: Mutex<Vec<Arc<Mm>>>,
    pub(crate) bell: (Mutex<()>, Condvar),
    pub(crate) restore_done: AtomicBool,
    pub(crate) stop: AtomicBool,
    /// Set only when the server is dropped: ends the rescue's threads
    /// ([`Rescuer::zero_missing`]), which run on after a failure.
    pub(crate) halt: AtomicBool,
    /// The rescue's zero pages are being served.
    pub(crate) zeroing: AtomicBool,
    pub(crate) error: Mutex<Option<PagesError>>,
    pub(crate) next_id: AtomicU64,
    pub(crate) served: AtomicU64,
    pub(crate) dropped: AtomicU64,
    pub(crate) zero_pages: AtomicU64,
    pub(crate) forks: AtomicUsize,
    pub(crate) total: AtomicU64,
    pub(crate) threads: Mutex<Vec<JoinHandle<()>>>,
    pub(crate) started: Instant,
    pub(crate) stats: Stats,
    /// The keeper holding a copy of every userfaultfd (crate::keeper).
    pub(crate) keeper: std::sync::OnceLock<crate::keeper::Keeper>,
    pub(crate) next_key: std::sync::atomic::AtomicU32,
    /// With [`Options::trace`]: what the trace file gets.
    pub(crate) trace: Option<Mutex<Trace>>,
    /// The pace of the background fill ([`Options::pace`]).
    pub(crate) pacer: Pacer,
    /// [`Options::give_back_at`] has been acted on.
    pub(crate) gave_back: AtomicBool,
}

/// A wake's trace ([`Options::trace`]); times in microseconds since the
/// server started. Bounded: past [`Trace::MAX`] entries of a kind, the rest
/// are counted, not kept.
#[derive(Default, Serialize)]
pub(crate) struct Trace {
    /// When the caller's head start ended (the driver's restore starts).
    pub(crate) head_done_us: u64,
    pub(crate) restore_done_us: u64,
    /// Per process: its pieces to fill, `[start, length]`, in address order.
    pub(crate) pieces: BTreeMap<i32, Vec<[u64; 2]>>,
    /// `[time, pid, address, how]`: how 0 = waited for a fill in flight,
    /// 1 = filled by this fault, 2 = a zero page.
    pub(crate) faults: Vec<[u64; 4]>,
    /// `[start time, end time, pid, address, length, by a fault, its read
    /// us, its copy us, and during it the thread's us on a CPU, us waiting
    /// for one, voluntary and involuntary context switches]`.
    pub(crate) fills: Vec<[u64; 12]>,
    pub(crate) dropped: u64,
}

impl Trace {
    const MAX: usize = 1 << 20;
    pub(crate) fn push<T>(v: &mut Vec<T>, dropped: &mut u64, e: T) {
        if v.len() < Self::MAX {
            v.push(e);
        } else {
            *dropped += 1;
        }
    }
    pub(crate) fn fault(&mut self, e: [u64; 4]) {
        Self::push(&mut self.faults, &mut self.dropped, e);
    }
    pub(crate) fn fill(&mut self, e: [u64; 12]) {
        Self::push(&mut self.fills, &mut self.dropped, e);
    }
}

/// Counters of the report; times in microseconds since `started`, 0 for
/// "not yet" (a real time is stored + 1).
#[derive(Default)]
pub(crate) struct Stats {
    pub(crate) faults: AtomicU64,
    pub(crate) faults_in_flight: AtomicU64,
    pub(crate) faults_backward: AtomicU64,
    pub(crate) fault_bytes: AtomicU64,
    pub(crate) fill_bytes: AtomicU64,
    pub(crate) eexist_pages: AtomicU64,
    pub(crate) restore_done_us: AtomicU64,
    pub(crate) first_fault_us: AtomicU64,
    pub(crate) last_fault_us: AtomicU64,
    pub(crate) last_page_us: AtomicU64,
    pub(crate) fault_busy_us: AtomicU64,
    pub(crate) read_us: AtomicU64,
    pub(crate) copy_us: AtomicU64,
    pub(crate) in_place_bytes: AtomicU64,
    pub(crate) pieces: AtomicU64,
    pub(crate) book_us: AtomicU64,
    pub(crate) nap_us: AtomicU64,
    pub(crate) pace_wait_us: AtomicU64,
}

pub(crate) fn us(d: Duration) -> u64 {
    d.as_micros() as u64
}

pub(crate) fn at_ms(v: u64) -> Option<u64> {
    (v > 0).then(|| (v - 1) / 1000)
}

impl Shared {
    pub(crate) fn new(images: &Path, source: Arc<dyn PageSource>, opts: Options) -> Self {
        Shared {
            trace: opts.trace.as_ref().map(|_| Mutex::default()),
            pacer: Pacer::new(opts.pace_cfg),
            gave_back: AtomicBool::new(false),
            images: images.to_path_buf(),
            source,
            opts,
            mms: Mutex::new(Vec::new()),
            bell: (Mutex::new(()), Condvar::new()),
            restore_done: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            halt: AtomicBool::new(false),
            zeroing: AtomicBool::new(false),
            error: Mutex::new(None),
            next_id: AtomicU64::new(1),
            served: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            zero_pages: AtomicU64::new(0),
            forks: AtomicUsize::new(0),
            total: AtomicU64::new(crate::image::lazy_bytes(images)),
            threads: Mutex::new(Vec::new()),
            started: Instant::now(),
            stats: Stats::default(),
            keeper: std::sync::OnceLock::new(),
            next_key: std::sync::atomic::AtomicU32::new(1),
        }
    }
    pub(crate) fn trace(&self, f: impl FnOnce(&mut Trace)) {
        if let Some(t) = &self.trace {
            if let Ok(mut t) = t.lock() {
                f(&mut t);
            }
        }
    }
    /// Writes the trace, if one was asked for (best effort: a diagnostic).
    pub(crate) fn write_trace(&self) {
        let (Some(t), Some(path)) = (&self.trace, &self.opts.trace) else { return };
        let Ok(mut t) = t.lock() else { return };
        t.restore_done_us = self.stats.restore_done_us.load(SeqCst);
        let tmp = path.with_extension("tmp");
        let r = serde_json::to_vec(&*t)
            .map_err(std::io::Error::other)
            .and_then(|b| std::fs::write(&tmp, b))
            .and_then(|()| std::fs::rename(&tmp, path));
        match r {
            Ok(()) => tracing::info!(path = %path.display(), "page server: trace written"),
            Err(e) => tracing::warn!(path = %path.display(), "page server: the trace was not written: {e}"),
        }
    }
    /// Hands `m` (and `fd`) to the keeper, if there is one.
    pub(crate) fn forward(&self, m: crate::keeper::Msg, fd: Option<std::os::fd::BorrowedFd<'_>>) {
        if let Some(k) = self.keeper.get() {
            k.send(m, fd);
        }
    }
    pub(crate) fn key(&self) -> u32 {
        self.next_key.fetch_add(1, SeqCst)
    }
    pub(crate) fn fail(&self, e: PagesError) {
        tracing::error!("page server: {e}");
        let mut g = self.error.lock().unwrap();
        if g.is_none() {
            *g = Some(e);
        }
        drop(g);
        self.ring();
    }
    pub(crate) fn failed(&self) -> bool {
        self.error.lock().unwrap().is_some()
    }
    pub(crate) fn ring(&self) {
        let _g = self.bell.0.lock().unwrap();
        self.bell.1.notify_all();
    }
    pub(crate) fn now_us(&self) -> u64 {
        us(self.started.elapsed()) + 1
    }
    pub(crate) fn report(&self) -> Report {
        let st = &self.stats;
        let g = |a: &AtomicU64| a.load(SeqCst);
        let processes = self.mms.lock().unwrap().len();
        let bytes = self.served.load(SeqCst);
        let done = g(&st.restore_done_us);
        let last = g(&st.last_page_us);
        let span = last.saturating_sub(done.max(1));
        Report {
            processes,
            forks: self.forks.load(SeqCst),
            bytes,
            zero_pages: self.zero_pages.load(SeqCst),
            ms: self.started.elapsed().as_millis() as u64,
            faults: g(&st.faults),
            faults_in_flight: g(&st.faults_in_flight),
            faults_backward: g(&st.faults_backward),
            fault_bytes: g(&st.fault_bytes),
            fill_bytes: g(&st.fill_bytes),
            eexist_pages: g(&st.eexist_pages),
            restore_done_ms: at_ms(done),
            first_fault_ms: at_ms(g(&st.first_fault_us)),
            last_fault_ms: at_ms(g(&st.last_fault_us)),
            last_page_ms: at_ms(last).unwrap_or(0),
            fill_gbps: if span > 0 && done > 0 {
                // Bytes per microsecond are MB/s.
                (g(&st.fault_bytes) + g(&st.fill_bytes)) as f64 / span as f64 / 1e3
            } else {
                0.0
            },
            fault_busy_ms: g(&st.fault_busy_us) / 1000,
            read_ms: g(&st.read_us) / 1000,
            copy_ms: g(&st.copy_us) / 1000,
            in_place_bytes: g(&st.in_place_bytes),
            pieces: g(&st.pieces),
            book_ms: g(&st.book_us) / 1000,
            nap_ms: g(&st.nap_us) / 1000,
            pace_wait_ms: g(&st.pace_wait_us) / 1000,
            pace: self.pacer.stats(self.now_us()),
            options: Some(self.opts.clone()),
        }
    }
    pub(crate) fn nap(&self) {
        self.nap_for(TICK);
    }
    pub(crate) fn nap_for(&self, most: Duration) {
        let g = self.bell.0.lock().unwrap();
        let _ = self.bell.1.wait_timeout(g, most);
    }
    pub(crate) fn finished(&self) -> bool {
        self.restore_done.load(SeqCst)
            && self.mms.lock().unwrap().iter().all(|m| {
                let st = m.st.lock().unwrap();
                st.gone || st.pieces.is_empty()
            })
    }
    pub(crate) fn spawn(self: &Arc<Self>, name: &str, f: impl FnOnce(Arc<Shared>) + Send + 'static) {
        let me = self.clone();
        match std::thread::Builder::new().name(name.into()).spawn(move || f(me)) {
            Ok(h) => self.threads.lock().unwrap().push(h),
            Err(e) => self
                .fail(PagesError::Socket { path: name.into(), err: format!("cannot start a thread: {e}") }),
        }
    }
}
