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

use crate::image::{lazy_iovs, Iov};
use crate::pacer::{PaceConfig, PaceStats, Pacer};
use crate::pieces::{Piece, Pieces};
use crate::source::{DirSource, PageSource, PagesFile};
use crate::sys::{self, PAGE};
use crate::PagesError;
use nix::errno::Errno;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const SOCKET: &str = "lazy-pages.socket";
const RESTORE_FINISHED: u32 = 0x5253_5446;
/// A fault in a run of memory to fill at least this large tells the pace
/// that the reader met the fill's front ([`crate::pacer`]); a CUDA
/// driver's restore also touches small mappings here and there.
const PACE_RUN_MIN: u64 = 64 << 20;
const TICK: Duration = Duration::from_millis(50);
/// How often [`Server::wait_ahead`] looks at the bytes in place: nobody
/// rings as they grow, and the driver's restore waits on it (with
/// [`TICK`], a head start the fill made in 45 ms cost 50 or 100; measured
/// on the H200, Runs 70-71).
const HEAD_TICK: Duration = Duration::from_millis(1);

/// How the server fills memory. Every field can be set from the
/// environment ([`Options::from_env`], docs/pages.md), so that a GPU run
/// can compare settings without a rebuild.
#[derive(Debug, Clone, Serialize)]
pub struct Options {
    /// Threads filling memory in the background.
    pub threads: usize,
    /// Bytes one background fill takes at once (its share of the address
    /// range: the next fill starts past it).
    pub batch: u64,
    /// Bytes a fill reads, copies and then wakes at a time. A fault in a
    /// piece in flight waits for the WAKE of its chunk, not for the whole
    /// batch: a whole-batch WAKE (4 MiB read and copied first) made the
    /// driver, which reads right behind the fill, wait for pages already
    /// read.
    pub wake_chunk: u64,
    /// Bytes a fault brings in (from the faulting page on, or down to it
    /// when the process reads downwards).
    pub fault_batch: u64,
    /// How far past the last fault (in the direction the faults go) the
    /// background fill goes on: 0 = just past it.
    pub ahead: u64,
    /// Nice value of the background fill threads (0: as gpusnap), so that
    /// the restored processes (the driver's restore runs in their threads)
    /// get the cores first; the threads that answer faults keep gpusnap's.
    pub nice: i32,
    /// The background fill threads run as SCHED_IDLE (then `nice` does not
    /// apply): any other thread that wakes takes their core at once (see
    /// [`crate::prio`]). Off by default: no gain measured, and a fault on a
    /// piece such a thread has in flight waits for it, which on a busy
    /// host may be long.
    pub idle: bool,
    /// What the background fill should have in place before the driver's
    /// restore starts (applied by the caller: [`Server::wait_ahead`]).
    pub head_start: HeadStart,
    /// The background fill starts at the first run of contiguous lazy
    /// memory at least this large (0: at the lowest address, the default),
    /// and comes back for the rest after the top. A CUDA process's
    /// checkpointed device memory is such a run, and what the driver's
    /// restore reads; the low addresses hold the interpreter's heap and
    /// small mappings. Measured on the H200 (20.5 GB): the first GB went in
    /// at ~2.4 GB/s, the rest at ~11 (Run 23); starting at the large run
    /// did not make the driver's restore faster (Runs 24-25).
    pub big_first: u64,
    /// Bytes per second the background fill keeps to once the head start is
    /// in (0: as fast as it goes, the default): a fill just ahead of the
    /// driver's restore instead of one that takes the host's cores and
    /// memory bandwidth while the driver reads (issue 10's warm wake).
    /// Faults are never held back.
    pub rate: u64,
    /// Pace the background fill to the reader while the caller's driver
    /// restores run ([`Server::pace_reader`], [`crate::pacer`]); `rate`,
    /// when set, takes precedence.
    pub pace: bool,
    /// The pace's settings.
    pub pace_cfg: PaceConfig,
    /// Fail on purpose once this many bytes are served (tests of a page
    /// server that dies mid-wake).
    #[serde(skip)]
    pub fail_after: Option<u64>,
    /// Sleep this long before each chunk a thread reads (tests: a kill of
    /// the wake lands in the middle of the fill).
    #[serde(skip)]
    pub slow: Option<Duration>,
    /// Take every REMOVE as one that met a copy in flight (tests of the
    /// wake that fails safely on that race).
    #[serde(skip)]
    pub remove_raced: bool,
    /// The first background fill to have this many bytes served behind it
    /// gives its pieces back as a fill does when the layout changes under
    /// it (`UFFDIO_COPY`'s EAGAIN or ENOENT), once (tests: a fault that
    /// waited for that fill is woken to fault again).
    #[serde(skip)]
    pub give_back_at: Option<u64>,
    /// The background fill follows a fault (goes on from it, in its
    /// direction) only when it falls in a run of contiguous memory to fill
    /// of at least this many bytes (0, the default: every fault). A CUDA driver's restore
    /// touches small mappings here and there (its bookkeeping) before and
    /// while it streams the checkpointed device memory, one large run, in
    /// address order: following those faults took every fill thread away
    /// from the stream's front for 0.2 s, through hundreds of small
    /// mappings, and the driver then caught up with the front (H200, Run 52
    /// traces). A fault elsewhere is served by its own batch. Not a gain
    /// measured yet (Run 53), so off.
    pub follow_min: u64,
    /// Write a trace of the wake to this file when the server ends: each
    /// fault (time, address, how it was answered), each fill (start and end
    /// time, range) and the pieces each process had to fill, as JSON (for
    /// finding the order in which a driver's restore reads its memory;
    /// `tests/gpu/pages-trace.py` sums it up). Diagnostics: off by default.
    pub trace: Option<PathBuf>,
}

/// Bytes the page server fills before the driver's restore is started.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum HeadStart {
    Bytes(u64),
    /// A share (0-1) of what there is to serve.
    Fraction(f64),
}

impl HeadStart {
    pub fn bytes_of(&self, total: u64) -> u64 {
        match *self {
            HeadStart::Bytes(b) => b.min(total),
            HeadStart::Fraction(f) => ((total as f64) * f.clamp(0.0, 1.0)) as u64,
        }
    }
}

impl Default for Options {
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(4);
        // Measured on the H200 host (16 cores, 26.4 GB lazy wake, Run 10 of
        // docs/gpu-e2e.md): 16 fill threads at normal priority slowed the
        // driver's restore, which runs on the same cores, to 6.72 s; 8 at
        // nice 10 filled faster (6.3 GB/s against 5.6) and the driver took
        // 5.42 s. So half the cores, below the driver's priority. Batch
        // size 256 KiB-16 MiB made no difference.
        Self {
            threads: (cores / 2).clamp(2, 8),
            batch: 4 << 20,
            wake_chunk: 1 << 20,
            fault_batch: 256 << 10,
            ahead: 0,
            nice: 10,
            // Off: on the H200 (Run 30, 20.5 GB, four samples each,
            // alternating) SCHED_IDLE fill and verify threads woke in
            // 4.38-5.71 s (median 4.53), nice 10 in 4.13-5.61 s (4.67): no
            // difference, and a SCHED_IDLE fill gets no core on a busy host.
            idle: false,
            // Measured on the H200 (20.5 GB, Run 23 of docs/gpu-e2e.md):
            // the driver's restore started right after CRIU's caught up
            // with the fill (driver 5.25 s against 3.29 alone); 512 MiB
            // first: 3.80 s, after a 0.21 s head start.
            head_start: HeadStart::Bytes(512 << 20),
            // Off: on the H200 (Runs 24-25) starting at the large run did not
            // make the driver's restore faster (its slowdown inside a wake
            // came with almost no fault waiting; the hosts varied more than
            // the setting); kept as a setting to measure.
            big_first: 0,
            rate: 0,
            pace: false,
            pace_cfg: PaceConfig::default(),
            fail_after: None,
            remove_raced: false,
            give_back_at: None,
            trace: None,
            // Off: on the H200 (Run 53, ~26 GB, one host) the wakes with
            // 64 MiB took 6.85-7.13 s against 5.39 s following every fault;
            // the fill's front was no further ahead when the driver met it
            // (its fills slow down ~10x for ~0.5 s as the driver's restore
            // starts, whatever the fill follows). Kept as a setting.
            follow_min: 0,
            slow: None,
        }
    }
}

/// The environment variables of [`Options::from_env`].
pub const ENV_THREADS: &str = "GPUSNAP_PAGES_THREADS";
pub const ENV_BATCH: &str = "GPUSNAP_PAGES_BATCH";
pub const ENV_WAKE_CHUNK: &str = "GPUSNAP_PAGES_WAKE_CHUNK";
pub const ENV_FAULT_BATCH: &str = "GPUSNAP_PAGES_FAULT_BATCH";
pub const ENV_AHEAD: &str = "GPUSNAP_PAGES_AHEAD";
pub const ENV_NICE: &str = "GPUSNAP_PAGES_NICE";
pub const ENV_HEAD_START: &str = "GPUSNAP_PAGES_HEAD_START";
pub const ENV_BIG_FIRST: &str = "GPUSNAP_PAGES_BIG_FIRST";
pub const ENV_RATE: &str = "GPUSNAP_PAGES_RATE";
pub const ENV_IDLE: &str = "GPUSNAP_PAGES_IDLE";
pub const ENV_TRACE: &str = "GPUSNAP_PAGES_TRACE";
pub const ENV_FOLLOW_MIN: &str = "GPUSNAP_PAGES_FOLLOW_MIN";
pub const ENV_PACE: &str = "GPUSNAP_PAGES_PACE";
pub const ENV_PACE_START: &str = "GPUSNAP_PAGES_PACE_START";
pub const ENV_PACE_MIN: &str = "GPUSNAP_PAGES_PACE_MIN";
pub const ENV_PACE_LEAD: &str = "GPUSNAP_PAGES_PACE_LEAD";

/// A yes/no setting: `1`/`0` (also `yes`/`no`, `on`/`off`, `true`/`false`).
pub fn parse_flag(v: &str) -> Option<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "yes" | "on" | "true" => Some(true),
        "0" | "no" | "off" | "false" => Some(false),
        _ => None,
    }
}

/// The yes/no setting `name` set to `value` ([`parse_flag`]); unset, or
/// set to something else (said in a warning), `default`.
pub fn flag_setting(name: &str, value: Option<String>, default: bool) -> bool {
    let Some(v) = value else { return default };
    parse_flag(&v).unwrap_or_else(|| {
        tracing::warn!("{name}={v}: not 1 or 0; ignored");
        default
    })
}

/// A size: bytes, or with a K, M or G suffix (binary).
fn parse_size(v: &str) -> Option<u64> {
    let v = v.trim();
    let (num, mult) = match v.chars().last()?.to_ascii_uppercase() {
        'K' => (&v[..v.len() - 1], 1u64 << 10),
        'M' => (&v[..v.len() - 1], 1 << 20),
        'G' => (&v[..v.len() - 1], 1 << 30),
        _ => (v, 1),
    };
    num.trim().parse::<u64>().ok()?.checked_mul(mult)
}

impl Options {
    /// Whether the fill is paced to the reader: asked for, and no fixed
    /// [`Options::rate`] (which takes precedence).
    pub fn paced(&self) -> bool {
        self.pace && self.rate == 0
    }

    /// The defaults, with every `GPUSNAP_PAGES_*` variable that is set
    /// applied; a value that is not one is an error naming it.
    pub fn from_env() -> Result<Self, PagesError> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// As [`Options::from_env`], reading variables through `get`.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self, PagesError> {
        let mut o = Self::default();
        let bad = |name: &str, value: &str, why: &str| PagesError::Setting {
            name: name.to_string(),
            value: value.to_string(),
            why: why.to_string(),
        };
        let size = |name: &str, min: u64| -> Result<Option<u64>, PagesError> {
            let Some(v) = get(name) else { return Ok(None) };
            match parse_size(&v) {
                // Whole pages: UFFDIO_COPY moves pages.
                Some(n) if n >= min => Ok(Some(n.div_ceil(PAGE) * PAGE)),
                Some(_) => Err(bad(name, &v, &format!("at least {min} bytes"))),
                None => Err(bad(name, &v, "not a size (bytes, or with K, M or G)")),
            }
        };
        if let Some(v) = get(ENV_THREADS) {
            o.threads = match v.trim().parse::<usize>() {
                Ok(n) if (1..=256).contains(&n) => n,
                _ => return Err(bad(ENV_THREADS, &v, "a count of threads, 1 to 256")),
            };
        }
        if let Some(n) = size(ENV_BATCH, PAGE)? {
            o.batch = n;
        }
        if let Some(n) = size(ENV_WAKE_CHUNK, PAGE)? {
            o.wake_chunk = n;
        }
        if let Some(n) = size(ENV_FAULT_BATCH, PAGE)? {
            o.fault_batch = n;
        }
        if let Some(n) = size(ENV_AHEAD, 0)? {
            o.ahead = n;
        }
        if let Some(n) = size(ENV_BIG_FIRST, 0)? {
            o.big_first = n;
        }
        if let Some(n) = size(ENV_RATE, 0)? {
            o.rate = n;
        }
        if let Some(n) = size(ENV_FOLLOW_MIN, 0)? {
            o.follow_min = n;
        }
        if let Some(v) = get(ENV_PACE) {
            o.pace = parse_flag(&v).ok_or_else(|| bad(ENV_PACE, &v, "1 or 0"))?;
        }
        // Rates in bytes per second, with K, M or G (binary): 1 GiB/s at least.
        if let Some(n) = size(ENV_PACE_START, 1 << 30)? {
            o.pace_cfg.start = n;
        }
        if let Some(n) = size(ENV_PACE_MIN, 1 << 30)? {
            o.pace_cfg.min = n;
        }
        if let Some(n) = size(ENV_PACE_LEAD, 1 << 20)? {
            o.pace_cfg.lead = n;
        }
        if let Some(v) = get(ENV_NICE) {
            o.nice = match v.trim().parse::<i32>() {
                Ok(n) if (0..=19).contains(&n) => n,
                _ => return Err(bad(ENV_NICE, &v, "a nice value, 0 to 19")),
            };
        }
        if let Some(v) = get(ENV_TRACE) {
            let path = PathBuf::from(v.trim());
            if !path.is_absolute() {
                return Err(bad(ENV_TRACE, &v, "an absolute path"));
            }
            o.trace = Some(path);
        }
        if let Some(v) = get(ENV_IDLE) {
            o.idle = parse_flag(&v).ok_or_else(|| bad(ENV_IDLE, &v, "1 or 0"))?;
        }
        if let Some(v) = get(ENV_HEAD_START) {
            let t = v.trim();
            let frac = if let Some(p) = t.strip_suffix('%') {
                p.trim().parse::<f64>().ok().map(|x| x / 100.0)
            } else if t.contains('.') {
                t.parse::<f64>().ok()
            } else {
                None
            };
            o.head_start = match frac {
                Some(f) if (0.0..=1.0).contains(&f) => HeadStart::Fraction(f),
                Some(_) => return Err(bad(ENV_HEAD_START, &v, "a share from 0 to 1 (or 0% to 100%)")),
                None => match parse_size(t) {
                    Some(b) => HeadStart::Bytes(b),
                    None => {
                        return Err(bad(
                            ENV_HEAD_START,
                            &v,
                            "bytes (with K, M or G), a share such as 0.25, or a percentage",
                        ))
                    }
                },
            };
        }
        Ok(o)
    }
}

/// What a lazy wake's page server did: the figures that tell where the
/// driver's restore waited (docs/pages.md, "Reading the report").
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    /// Processes whose memory was served (forks during the wake included).
    pub processes: usize,
    pub forks: usize,
    /// Bytes in place (copied, or already there).
    pub bytes: u64,
    pub zero_pages: u64,
    /// From the server's start (just before CRIU's restore) until every
    /// page was in place and seen so by the waiter.
    pub ms: u64,
    /// Page faults read from the userfaultfds.
    pub faults: u64,
    /// Of those, faults on a piece a fill had in flight: the faulting thread
    /// waited for that fill's WAKE.
    pub faults_in_flight: u64,
    /// Of those, faults below the same process's previous fault (memory not
    /// read in address order).
    pub faults_backward: u64,
    /// Bytes brought in by faults, and by the background fill.
    pub fault_bytes: u64,
    pub fill_bytes: u64,
    /// Pages a fill found already there (EEXIST: another thread, a fault
    /// or a fork's copy was first).
    pub eexist_pages: u64,
    /// From the server's start until CRIU said the restore was done (the
    /// background fill starts then).
    pub restore_done_ms: Option<u64>,
    pub first_fault_ms: Option<u64>,
    pub last_fault_ms: Option<u64>,
    /// From the server's start until the last page went in.
    pub last_page_ms: u64,
    /// Bytes per second from the restore's end to the last page, in GB/s.
    pub fill_gbps: f64,
    /// Time the fault threads spent answering faults (read, copy, wake),
    /// summed over processes.
    pub fault_busy_ms: u64,
    /// Time all threads spent reading the image, and copying into
    /// processes, summed over threads.
    pub read_ms: u64,
    pub copy_ms: u64,
    /// Bytes the fill copied straight from where the source holds them
    /// ([`crate::PagesFile::map_at`]), not read into its buffer first.
    pub in_place_bytes: u64,
    /// Pieces of memory to fill when the processes were handed over (a
    /// lazy area each, or part of one), summed over processes.
    pub pieces: u64,
    /// Time the fill threads spent taking their next batch and giving it
    /// back done (the processes' piece lists, under their locks), and
    /// waiting with nothing to take, summed over threads.
    pub book_ms: u64,
    pub nap_ms: u64,
    /// Time the fill threads were held back by the pace to the reader,
    /// summed over threads.
    pub pace_wait_ms: u64,
    /// What the pace to the reader did (None: the fill was not paced).
    pub pace: Option<PaceStats>,
    /// The settings this wake ran with.
    pub options: Option<Options>,
}

#[derive(Default)]
pub(crate) struct MmState {
    pieces: Pieces,
    gone: bool,
    /// Where the background fill goes on: just past the last fault (the
    /// process, or the driver inside it, reads on from there) or the last
    /// background batch; from the lowest missing address when nothing is
    /// missing past it.
    hint: Option<u64>,
    /// Pieces filled since the event thread last began a read: a fork's
    /// child lacks those whose copy came after the kernel let copies into
    /// the parent go on again (once the FORK event is read), so it gets
    /// them too (a page the child has already gives EEXIST).
    recent: Vec<Iov>,
    /// The previous fault's page, and whether the faults go downwards
    /// (two in a row below their predecessor): the background fill then
    /// follows them down instead of up.
    last_fault: Option<u64>,
    backward_run: u32,
    down: bool,
    /// The runs of contiguous memory to fill, `(start, end)` in address
    /// order, as they were at the start (for [`Options::follow_min`]; the
    /// events that change the layout later do not matter to a heuristic).
    runs: Vec<(u64, u64)>,
}

impl MmState {
    /// Pieces still to fill, none taken.
    pub(crate) fn of(iovs: Vec<Iov>) -> Self {
        let pieces = Pieces::new(iovs.into_iter().map(|iov| Piece { iov, owner: 0 }));
        // The pieces in address order, contiguous ones joined.
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for p in pieces.iter() {
            match runs.last_mut() {
                Some(r) if r.1 == p.iov.start => r.1 = p.iov.end,
                _ => runs.push((p.iov.start, p.iov.end)),
            }
        }
        Self { pieces, runs, ..Default::default() }
    }
    /// Whether the background fill should follow a fault at `addr`: it lies
    /// in a run of at least `min` bytes (see [`Options::follow_min`]).
    fn follows(&self, addr: u64, min: u64) -> bool {
        if min == 0 {
            return true;
        }
        let i = self.runs.partition_point(|r| r.0 <= addr);
        i > 0 && {
            let (a, b) = self.runs[i - 1];
            addr < b && b - a >= min
        }
    }
    /// Starts the background fill at the first run of contiguous pieces of
    /// at least `min` bytes (see [`Options::big_first`]).
    pub(crate) fn big_first(mut self, min: u64) -> Self {
        if min > 0 {
            self.hint = self.runs.iter().find(|r| r.1 - r.0 >= min).map(|r| r.0);
        }
        self
    }
    pub(crate) fn iovs(&self) -> Vec<Iov> {
        self.pieces.iter().map(|p| p.iov).collect()
    }
    pub(crate) fn drop_range(&mut self, a: u64, b: u64) -> u64 {
        self.pieces.drop_range(a, b)
    }
    pub(crate) fn remap(&mut self, from: u64, to: u64, len: u64) {
        self.pieces.remap(from, to, len)
    }
    /// Notes a fault at `addr`; true when it is below the previous one.
    fn note_fault(&mut self, addr: u64) -> bool {
        let back = self.last_fault.is_some_and(|l| addr < l);
        self.last_fault = Some(addr);
        if back {
            self.backward_run = self.backward_run.saturating_add(1);
            if self.backward_run >= 2 {
                self.down = true;
            }
        } else {
            self.backward_run = 0;
            self.down = false;
        }
        back
    }
    /// As [`MmState::take`], downwards: up to `max` bytes ending at
    /// `below` (or at the hint), in the highest piece still to fill under it.
    fn take_down(&mut self, below: Option<u64>, max: u64, id: u64) -> Option<Iov> {
        let from = below.or(self.hint)?;
        let p = self.pieces.last_free_below(from)?.iov;
        let end = p.end.min(from);
        let start = p.start.max(end.saturating_sub(max));
        let iov = self.pieces.claim(p.start, start, end, id);
        if below.is_none() {
            self.hint = Some(start);
        }
        Some(iov)
    }
    /// Marks up to `max` bytes from `addr` (or from the first piece still
    /// to fill) as taken by fill `id`.
    fn take(&mut self, addr: Option<u64>, max: u64, id: u64) -> Option<Iov> {
        if addr.is_none() && self.down {
            if let Some(iov) = self.take_down(None, max, id) {
                return Some(iov);
            }
        }
        let from = self.hint.unwrap_or(0);
        let p = match addr {
            Some(a) => self.pieces.at(a).filter(|p| p.owner == 0).copied()?,
            None => match self.pieces.first_free_from(from) {
                Some(p) => p,
                None => self.pieces.first_free_from(0)?,
            },
        }
        .iov;
        let start = addr.unwrap_or(if from > p.start && from < p.end { from } else { p.start });
        let end = p.end.min(start + max);
        let iov = self.pieces.claim(p.start, start, end, id);
        if addr.is_none() {
            self.hint = Some(end);
        }
        Some(iov)
    }
    fn in_flight(&self, addr: u64) -> Option<bool> {
        self.pieces.at(addr).map(|p| p.owner != 0)
    }
}

struct Mm {
    pid: i32,
    /// Its number for the keeper.
    key: u32,
    uffd: OwnedFd,
    pages: Arc<dyn PagesFile>,
    st: Mutex<MmState>,
    /// Held (shared) by every `UFFDIO_COPY` until what it copied is in
    /// `landed`; taken alone by a REMOVE, so that every copy that landed
    /// before its unregister is counted.
    copying: RwLock<()>,
    /// Ranges copied in since the event thread last began a read: a
    /// removed range one of them meets may hold the image's bytes where
    /// the process must read zeros (see the REMOVE event).
    landed: Mutex<Vec<(u64, u64)>>,
}

impl Mm {
    fn new(pid: i32, key: u32, uffd: OwnedFd, pages: Arc<dyn PagesFile>, st: MmState) -> Self {
        Self { pid, key, uffd, pages, st: Mutex::new(st), copying: RwLock::new(()), landed: Mutex::default() }
    }
}

struct Shared {
    images: PathBuf,
    source: Arc<dyn PageSource>,
    opts: Options,
    mms: Mutex<Vec<Arc<Mm>>>,
    bell: (Mutex<()>, Condvar),
    restore_done: AtomicBool,
    stop: AtomicBool,
    /// Set only when the server is dropped: ends the rescue's threads
    /// ([`Rescuer::zero_missing`]), which run on after a failure.
    halt: AtomicBool,
    /// The rescue's zero pages are being served.
    zeroing: AtomicBool,
    error: Mutex<Option<PagesError>>,
    next_id: AtomicU64,
    served: AtomicU64,
    dropped: AtomicU64,
    zero_pages: AtomicU64,
    forks: AtomicUsize,
    total: AtomicU64,
    threads: Mutex<Vec<JoinHandle<()>>>,
    started: Instant,
    stats: Stats,
    /// The keeper holding a copy of every userfaultfd (crate::keeper).
    keeper: std::sync::OnceLock<crate::keeper::Keeper>,
    next_key: std::sync::atomic::AtomicU32,
    /// With [`Options::trace`]: what the trace file gets.
    trace: Option<Mutex<Trace>>,
    /// The pace of the background fill ([`Options::pace`]).
    pacer: Pacer,
    /// [`Options::give_back_at`] has been acted on.
    gave_back: AtomicBool,
}

/// A wake's trace ([`Options::trace`]); times in microseconds since the
/// server started. Bounded: past [`Trace::MAX`] entries of a kind, the rest
/// are counted, not kept.
#[derive(Default, Serialize)]
struct Trace {
    /// When the caller's head start ended (the driver's restore starts).
    head_done_us: u64,
    restore_done_us: u64,
    /// Per process: its pieces to fill, `[start, length]`, in address order.
    pieces: BTreeMap<i32, Vec<[u64; 2]>>,
    /// `[time, pid, address, how]`: how 0 = waited for a fill in flight,
    /// 1 = filled by this fault, 2 = a zero page.
    faults: Vec<[u64; 4]>,
    /// `[start time, end time, pid, address, length, by a fault, its read
    /// us, its copy us, and during it the thread's us on a CPU, us waiting
    /// for one, voluntary and involuntary context switches]`.
    fills: Vec<[u64; 12]>,
    dropped: u64,
}

impl Trace {
    const MAX: usize = 1 << 20;
    fn push<T>(v: &mut Vec<T>, dropped: &mut u64, e: T) {
        if v.len() < Self::MAX {
            v.push(e);
        } else {
            *dropped += 1;
        }
    }
    fn fault(&mut self, e: [u64; 4]) {
        Self::push(&mut self.faults, &mut self.dropped, e);
    }
    fn fill(&mut self, e: [u64; 12]) {
        Self::push(&mut self.fills, &mut self.dropped, e);
    }
}

/// Counters of the report; times in microseconds since `started`, 0 for
/// "not yet" (a real time is stored + 1).
#[derive(Default)]
struct Stats {
    faults: AtomicU64,
    faults_in_flight: AtomicU64,
    faults_backward: AtomicU64,
    fault_bytes: AtomicU64,
    fill_bytes: AtomicU64,
    eexist_pages: AtomicU64,
    restore_done_us: AtomicU64,
    first_fault_us: AtomicU64,
    last_fault_us: AtomicU64,
    last_page_us: AtomicU64,
    fault_busy_us: AtomicU64,
    read_us: AtomicU64,
    copy_us: AtomicU64,
    in_place_bytes: AtomicU64,
    pieces: AtomicU64,
    book_us: AtomicU64,
    nap_us: AtomicU64,
    pace_wait_us: AtomicU64,
}

fn us(d: Duration) -> u64 {
    d.as_micros() as u64
}

fn at_ms(v: u64) -> Option<u64> {
    (v > 0).then(|| (v - 1) / 1000)
}

impl Shared {
    fn new(images: &Path, source: Arc<dyn PageSource>, opts: Options) -> Self {
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
    fn trace(&self, f: impl FnOnce(&mut Trace)) {
        if let Some(t) = &self.trace {
            if let Ok(mut t) = t.lock() {
                f(&mut t);
            }
        }
    }
    /// Writes the trace, if one was asked for (best effort: a diagnostic).
    fn write_trace(&self) {
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
    fn forward(&self, m: crate::keeper::Msg, fd: Option<std::os::fd::BorrowedFd<'_>>) {
        if let Some(k) = self.keeper.get() {
            k.send(m, fd);
        }
    }
    fn key(&self) -> u32 {
        self.next_key.fetch_add(1, SeqCst)
    }
    fn fail(&self, e: PagesError) {
        tracing::error!("page server: {e}");
        let mut g = self.error.lock().unwrap();
        if g.is_none() {
            *g = Some(e);
        }
        drop(g);
        self.ring();
    }
    fn failed(&self) -> bool {
        self.error.lock().unwrap().is_some()
    }
    fn ring(&self) {
        let _g = self.bell.0.lock().unwrap();
        self.bell.1.notify_all();
    }
    fn now_us(&self) -> u64 {
        us(self.started.elapsed()) + 1
    }
    fn report(&self) -> Report {
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
    fn nap(&self) {
        self.nap_for(TICK);
    }
    fn nap_for(&self, most: Duration) {
        let g = self.bell.0.lock().unwrap();
        let _ = self.bell.1.wait_timeout(g, most);
    }
    fn finished(&self) -> bool {
        self.restore_done.load(SeqCst)
            && self.mms.lock().unwrap().iter().all(|m| {
                let st = m.st.lock().unwrap();
                st.gone || st.pieces.is_empty()
            })
    }
    fn spawn(self: &Arc<Self>, name: &str, f: impl FnOnce(Arc<Shared>) + Send + 'static) {
        let me = self.clone();
        match std::thread::Builder::new().name(name.into()).spawn(move || f(me)) {
            Ok(h) => self.threads.lock().unwrap().push(h),
            Err(e) => self
                .fail(PagesError::Socket { path: name.into(), err: format!("cannot start a thread: {e}") }),
        }
    }
}

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
    /// this server is dropped (docs/pages.md, "Safety").
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
            // gpusnap dies now, the keeper replays it (docs/pages.md).
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

/// The background threads: the lowest piece still to fill of some process,
/// a batch at a time, until every process is complete.
fn filler(sh: Arc<Shared>) {
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
fn pace(sh: &Shared) {
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
fn fill(sh: &Shared, mm: &Mm, id: u64, iov: Iov, buf: &mut [u8], by_fault: bool) -> Result<(), PagesError> {
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
struct FillTimes {
    read_us: u64,
    copy_us: u64,
}

/// This thread's time on a CPU and waiting for one (runnable, on a run
/// queue), in us, and its voluntary and involuntary context switches so
/// far: a fill that took long while waiting for a CPU lost its core to
/// other threads; one that neither ran nor waited for a CPU slept in the
/// kernel (a lock, the disk).
fn thread_usage() -> [u64; 4] {
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

fn fill_in(
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
        // on the H200 (Run 72) a driver's restore stood still for 5 and
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
fn copy_in(
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

#[cfg(test)]
mod tests {
    use super::*;

    fn st(ranges: &[(u64, u64)]) -> MmState {
        MmState {
            pieces: Pieces::new(
                ranges
                    .iter()
                    .map(|&(s, e)| Piece { iov: Iov { start: s, end: e, off: s * 10 }, owner: 0 })
                    .collect::<Vec<_>>(),
            ),
            ..Default::default()
        }
    }

    #[test]
    fn the_background_fill_follows_faults_downwards() {
        let mut s = st(&[(0x1000, 0x40000)]);
        // Ascending faults: the fill goes up.
        assert!(!s.note_fault(0x10000));
        assert!(!s.note_fault(0x12000));
        assert!(!s.down);
        // Two in a row below their predecessor: the reader goes down.
        assert!(s.note_fault(0x11000));
        assert!(!s.down, "one step back is not a direction");
        s.note_fault(0x30000);
        s.note_fault(0x2f000);
        s.note_fault(0x2e000);
        assert!(s.down);
        let f = s.take_down(Some(0x2e000 + 0x1000), 0x3000, 1).unwrap();
        assert_eq!((f.start, f.end), (0x2c000, 0x2f000));
        s.hint = Some(f.start);
        let a = s.take(None, 0x2000, 2).unwrap();
        assert_eq!((a.start, a.end), (0x2a000, 0x2c000));
        let b = s.take(None, 0x2000, 3).unwrap();
        assert_eq!((b.start, b.end), (0x28000, 0x2a000));
        // Nothing below: up from the hint, then from the lowest.
        s.hint = Some(0x1000);
        let c = s.take(None, 0x2000, 4).unwrap();
        assert_eq!((c.start, c.end), (0x1000, 0x3000));
        // A fault going up again turns the fill back.
        assert!(!s.note_fault(0x2f000));
        assert!(!s.down);
    }

    #[test]
    fn only_faults_in_large_runs_steer_the_fill() {
        let iov = |start: u64, end: u64| Iov { start, end, off: 0 };
        let mut st = MmState::of(vec![
            iov(0x1000, 0x3000),
            iov(0x10_0000, 0x20_0000),
            iov(0x20_0000, 0x80_0000),
            iov(0x90_0000, 0x1000_0000),
        ]);
        assert_eq!(st.runs, vec![(0x1000, 0x3000), (0x10_0000, 0x80_0000), (0x90_0000, 0x1000_0000)]);
        assert!(st.follows(0x2000, 0) && st.follows(0x5000, 0), "0: every fault");
        assert!(!st.follows(0x2000, 64 << 20) && !st.follows(0x40_0000, 64 << 20));
        assert!(st.follows(0x40_0000, 4 << 20) && st.follows(0x90_0000, 64 << 20));
        assert!(!st.follows(0x5000, 1) && !st.follows(0x1000_0000, 1), "outside every run");
        // A fault off the large runs takes its own batch, leaving the hint.
        st.hint = Some(0x90_0000);
        let f = st.take(Some(0x2000), 0x1000, 1).unwrap();
        assert_eq!((f.start, f.end, st.hint), (0x2000, 0x3000, Some(0x90_0000)));
    }

    #[test]
    fn the_fill_starts_at_the_first_large_run() {
        let iov = |start: u64, end: u64| Iov { start, end, off: 0 };
        let st = MmState::of(vec![
            iov(0x1000, 0x3000),
            iov(0x10_0000, 0x20_0000),
            iov(0x20_0000, 0x80_0000),
            iov(0x90_0000, 0x1000_0000),
        ]);
        // 0x10_0000..0x80_0000 is one run of 7 MiB; the last is 247 MiB.
        assert_eq!(MmState::of(st.iovs()).big_first(4 << 20).hint, Some(0x10_0000));
        assert_eq!(MmState::of(st.iovs()).big_first(64 << 20).hint, Some(0x90_0000));
        assert_eq!(MmState::of(st.iovs()).big_first(1 << 30).hint, None);
        assert_eq!(MmState::of(st.iovs()).big_first(0).hint, None);
    }

    #[test]
    fn settings_from_the_environment() {
        let vars = |kv: &'static [(&'static str, &'static str)]| {
            move |k: &str| kv.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        let d = Options::default();
        let o = Options::from_vars(vars(&[])).unwrap();
        assert_eq!((o.threads, o.batch, o.fault_batch, o.ahead), (d.threads, 4 << 20, 256 << 10, 0));
        assert_eq!((o.head_start, o.big_first), (HeadStart::Bytes(512 << 20), 0));
        let o = Options::from_vars(vars(&[(ENV_BIG_FIRST, "0"), (ENV_HEAD_START, "0")])).unwrap();
        assert_eq!((o.head_start, o.big_first), (HeadStart::Bytes(0), 0));
        let o = Options::from_vars(vars(&[
            (ENV_THREADS, "8"),
            (ENV_BATCH, "16M"),
            (ENV_WAKE_CHUNK, "256k"),
            (ENV_FAULT_BATCH, "1M"),
            (ENV_AHEAD, "64M"),
            (ENV_NICE, "10"),
            (ENV_HEAD_START, "25%"),
        ]))
        .unwrap();
        assert_eq!((o.threads, o.batch, o.wake_chunk, o.fault_batch), (8, 16 << 20, 256 << 10, 1 << 20));
        assert_eq!((o.ahead, o.nice, o.head_start), (64 << 20, 10, HeadStart::Fraction(0.25)));
        assert_eq!(HeadStart::Fraction(0.25).bytes_of(1000), 250);
        assert_eq!(HeadStart::Bytes(5000).bytes_of(1000), 1000);
        let o = Options::from_vars(vars(&[(ENV_HEAD_START, "0.5"), (ENV_BATCH, "5000")])).unwrap();
        assert_eq!((o.head_start, o.batch), (HeadStart::Fraction(0.5), 8192));
        let o = Options::from_vars(vars(&[(ENV_HEAD_START, "2G")])).unwrap();
        assert_eq!(o.head_start, HeadStart::Bytes(2 << 30));
        assert_eq!(o.rate, 0);
        let o = Options::from_vars(vars(&[(ENV_RATE, "6G")])).unwrap();
        assert_eq!(o.rate, 6 << 30);
        assert!(!o.idle);
        let o = Options::from_vars(vars(&[(ENV_IDLE, "yes")])).unwrap();
        assert!(o.idle);
        assert_eq!(o.trace, None);
        let o = Options::from_vars(vars(&[(ENV_TRACE, "/tmp/t.json")])).unwrap();
        assert_eq!(o.trace.as_deref(), Some(Path::new("/tmp/t.json")));
        assert_eq!(Options::default().follow_min, 0);
        assert_eq!(Options::from_vars(vars(&[(ENV_FOLLOW_MIN, "64M")])).unwrap().follow_min, 64 << 20);
        assert!(!Options::default().pace);
        let o = Options::from_vars(vars(&[
            (ENV_PACE, "1"),
            (ENV_PACE_START, "8G"),
            (ENV_PACE_MIN, "3G"),
            (ENV_PACE_LEAD, "64M"),
        ]))
        .unwrap();
        assert!(o.pace);
        assert_eq!(o.pace_cfg, PaceConfig { start: 8 << 30, min: 3 << 30, lead: 64 << 20, quiet_ms: 100 });
        for bad in [
            (ENV_PACE, "sometimes"),
            (ENV_PACE_START, "100M"),
            (ENV_PACE_MIN, "fast"),
            (ENV_PACE_LEAD, "4K"),
            (ENV_FOLLOW_MIN, "big"),
            (ENV_TRACE, "t.json"),
            (ENV_THREADS, "0"),
            (ENV_THREADS, "many"),
            (ENV_BATCH, "12"),
            (ENV_BATCH, "4X"),
            (ENV_NICE, "-5"),
            (ENV_HEAD_START, "150%"),
            (ENV_HEAD_START, "1.5"),
            (ENV_RATE, "fast"),
            (ENV_IDLE, "maybe"),
        ] {
            let e = Options::from_vars(move |k| (k == bad.0).then(|| bad.1.to_string())).unwrap_err();
            assert!(e.to_string().starts_with(&format!("{}={}: ", bad.0, bad.1)), "{e}");
        }
    }

    #[test]
    fn batches_taken_one_by_one_cover_every_piece_once() {
        // Many mappings (as a CUDA process has), taken in batches that
        // cut pieces in the middle: every byte is handed out exactly once.
        let ranges: Vec<(u64, u64)> =
            (0..500u64).map(|k| (0x10_0000 * k + 0x1000, 0x10_0000 * k + 0x9_3000)).collect();
        let total: u64 = ranges.iter().map(|(a, b)| b - a).sum();
        let mut s = st(&ranges);
        let mut got = Vec::new();
        let mut id = 1;
        while let Some(iov) = s.take(None, 0x2_5000, id) {
            got.push(iov);
            id += 1;
        }
        assert_eq!(got.iter().map(|i| i.len()).sum::<u64>(), total);
        got.sort_by_key(|i| i.start);
        assert!(got.windows(2).all(|w| w[0].end <= w[1].start));
        assert!(s.pieces.to_vec().windows(2).all(|w| w[0].iov.end <= w[1].iov.start));
        assert!(s.pieces.iter().all(|p| p.owner != 0));
        // The offsets into the pages file follow the addresses.
        assert!(got.iter().all(|i| {
            let r = ranges.iter().find(|r| r.0 <= i.start && i.start < r.1).unwrap();
            i.end <= r.1 && i.off == r.0 * 10 + (i.start - r.0)
        }));
    }

    #[test]
    fn take_splits_and_marks() {
        let mut s = st(&[(0x1000, 0x9000)]);
        let a = s.take(Some(0x3000), 0x2000, 7).unwrap();
        assert_eq!((a.start, a.end, a.off), (0x3000, 0x5000, 0x1000 * 10 + 0x2000));
        assert_eq!(s.in_flight(0x3000), Some(true));
        assert_eq!(s.in_flight(0x1000), Some(false));
        let b = s.take(None, 0x10000, 8).unwrap();
        assert_eq!((b.start, b.end), (0x1000, 0x3000));
        assert_eq!(s.pieces.iter().map(|p| p.iov.len()).sum::<u64>(), 0x8000);
    }

    #[test]
    fn the_background_fill_follows_the_last_fault() {
        let mut s = st(&[(0x1000, 0x20000)]);
        s.hint = Some(0x8000);
        let a = s.take(None, 0x2000, 1).unwrap();
        assert_eq!((a.start, a.end), (0x8000, 0xa000));
        let b = s.take(None, 0x2000, 2).unwrap();
        assert_eq!((b.start, b.end), (0xa000, 0xc000));
        // Nothing missing past the hint: from the lowest again.
        s.hint = Some(0x30000);
        let c = s.take(None, 0x2000, 3).unwrap();
        assert_eq!((c.start, c.end), (0x1000, 0x3000));
    }

    #[test]
    fn remove_and_remap_edit_pieces_in_flight_too() {
        let mut s = st(&[(0x1000, 0x5000), (0x8000, 0xa000)]);
        s.take(Some(0x2000), 0x2000, 3).unwrap();
        assert_eq!(s.drop_range(0x3000, 0x9000), 0x3000);
        s.remap(0x1000, 0x101000, 0x2000);
        let v: Vec<(u64, u64, u64)> = s.pieces.iter().map(|p| (p.iov.start, p.iov.end, p.owner)).collect();
        assert_eq!(v, vec![(0x9000, 0xa000, 0), (0x101000, 0x102000, 0), (0x102000, 0x103000, 3)]);
        // The moved piece still reads from where it was in the image.
        assert_eq!(s.pieces.to_vec()[2].iov.off, 0x1000 * 10 + 0x1000);
    }
}
