//! The rescue of a lazy CUDA wake whose page server fails while a driver
//! restore reads the memory it serves (docs/design/wake.md, "Safety").
//!
//! The driver's restore cannot be cancelled: a fault it waits on blocks it
//! until the page comes. Killing the process then (its CUDA state half on
//! the GPU) is what hangs hosts, and serving the missing
//! pages as zeros would let its other threads run on them. So a watch runs
//! beside the driver's calls; if the page server fails (a chunk that fails
//! its check, a read error), it stops every thread of the woken tree except
//! each CUDA process's restore thread (ptrace, as CRIU's CUDA plugin keeps
//! a tree while the driver restores it), then has the page server answer
//! every missing page with zeros. The driver's restore returns; the wake
//! checkpoints each process again (it is never unlocked, so nothing runs
//! on the GPU state), kills the tree, and only then lets the threads go.

use gpusnap_guard::{ptrace_raw, threads_of};
use gpusnap_images::chunkfile::Bad;
use gpusnap_pages::Rescuer;
use std::collections::BTreeSet;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often the watch looks at the page server and the chunks' checks.
const TICK: Duration = Duration::from_millis(5);
/// How long the stopped threads have to reach their stop before the zero
/// pages are served anyway (a thread in an uninterruptible wait stops when
/// it leaves it, before it runs any code of its own).
const STOP_WAIT: Duration = Duration::from_secs(5);

#[derive(Clone, Copy, PartialEq, Debug)]
enum Phase {
    Watching,
    Rescuing,
    DriverDone,
    Release,
}

/// One woken process: its pid and, for a CUDA process, the driver's restore
/// thread (the one thread left running).
#[derive(Clone, Debug)]
pub struct Member {
    pub pid: i32,
    pub restore_tid: Option<i32>,
    pub cuda: bool,
}

/// The watch over one lazy wake's driver restores.
pub struct Watch {
    state: Arc<(Mutex<Phase>, Condvar)>,
    handle: Option<JoinHandle<()>>,
}

impl Watch {
    /// Starts watching `rescuer` (the page server) and `bad` (the chunks'
    /// checks) for the tree `members`. A CUDA member without a known
    /// restore thread cannot be rescued: the watch then only logs.
    pub fn start(rescuer: Rescuer, bad: Option<Bad>, members: Vec<Member>) -> Self {
        let state = Arc::new((Mutex::new(Phase::Watching), Condvar::new()));
        let st = state.clone();
        let handle = std::thread::Builder::new()
            .name("wake-rescue".into())
            .spawn(move || watch(&st, &rescuer, bad.as_ref(), &members))
            .map_err(|e| tracing::error!("cannot start the wake's rescue watch: {e}"))
            .ok();
        Self { state, handle }
    }

    /// The driver's calls are over: returns whether the tree was rescued
    /// (its threads stopped, zero pages served); then the caller must
    /// checkpoint its CUDA processes again, kill the tree and
    /// [`Watch::release`].
    pub fn driver_done(&self) -> bool {
        let (m, cv) = &*self.state;
        let mut p = m.lock().unwrap_or_else(|e| e.into_inner());
        if *p == Phase::Rescuing {
            return true;
        }
        *p = Phase::DriverDone;
        cv.notify_all();
        false
    }

    /// Ends the watch; a rescued tree's threads are let go (the tracer
    /// thread exits): call it after the tree was killed.
    pub fn release(mut self) {
        self.end();
    }

    fn end(&mut self) {
        {
            let (m, cv) = &*self.state;
            *m.lock().unwrap_or_else(|e| e.into_inner()) = Phase::Release;
            cv.notify_all();
        }
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.end();
    }
}

fn failed(rescuer: &Rescuer, bad: Option<&Bad>) -> Option<String> {
    if let Some(b) = bad {
        if let Some(e) = b.lock().ok().and_then(|g| g.as_ref().map(|e| e.to_string())) {
            return Some(e);
        }
    }
    rescuer.failed().then(|| "the page server failed".to_string())
}

fn watch(state: &(Mutex<Phase>, Condvar), rescuer: &Rescuer, bad: Option<&Bad>, members: &[Member]) {
    let (m, cv) = state;
    let why = {
        let mut p = m.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if *p != Phase::Watching {
                return;
            }
            if let Some(why) = failed(rescuer, bad) {
                *p = Phase::Rescuing;
                break why;
            }
            p = cv.wait_timeout(p, TICK).unwrap_or_else(|e| e.into_inner()).0;
        }
    };
    if let Some(m) = members.iter().find(|m| m.cuda && m.restore_tid.is_none()) {
        tracing::error!(
            pid = m.pid,
            "the page server failed ({why}) during the driver's restore, and the restore thread is unknown: \
             the restore waits until its deadline"
        );
        rescuer.stop_serving(&why);
    } else {
        tracing::warn!(
            "the page server failed during the driver's restore ({why}): stopping the tree to end it"
        );
        rescuer.stop_serving(&why);
        let seized = stop_threads(members);
        tracing::warn!(threads = seized.len(), "rescue: threads stopped; serving zero pages to the restore");
        rescuer.zero_missing();
    }
    // The tracer must outlive the tree: its exit would let the threads go.
    let mut p = m.lock().unwrap_or_else(|e| e.into_inner());
    while *p != Phase::Release {
        p = cv.wait(p).unwrap_or_else(|e| e.into_inner());
    }
}

/// Seizes and interrupts every thread of `members` except the restore
/// threads (new threads are caught by PTRACE_O_TRACECLONE, and the listing
/// is repeated until it brings none), then waits until each has stopped.
fn stop_threads(members: &[Member]) -> BTreeSet<i32> {
    let keep: BTreeSet<i32> = members.iter().filter_map(|m| m.restore_tid).collect();
    let mut seized = BTreeSet::new();
    for _ in 0..100 {
        let mut new = 0;
        for m in members {
            for tid in threads_of(m.pid) {
                if keep.contains(&tid) || seized.contains(&tid) {
                    continue;
                }
                let opts = libc::PTRACE_O_TRACECLONE as usize;
                match ptrace_raw(libc::PTRACE_SEIZE, tid, opts) {
                    Ok(()) => {
                        if let Err(e) = ptrace_raw(libc::PTRACE_INTERRUPT, tid, 0) {
                            tracing::warn!(tid, "rescue: PTRACE_INTERRUPT: {e}");
                        }
                        seized.insert(tid);
                        new += 1;
                    }
                    Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                    // Already ours (a clone of a seized thread) or traced
                    // by someone else: it is listed as seized either way,
                    // and waited for below if ours.
                    Err(e) => {
                        tracing::debug!(tid, "rescue: PTRACE_SEIZE: {e}");
                        seized.insert(tid);
                    }
                }
            }
        }
        if new == 0 {
            break;
        }
    }
    // Each seized thread reports its stop to this thread (its tracer).
    let mut waiting: BTreeSet<i32> = seized.clone();
    let end = Instant::now() + STOP_WAIT;
    while !waiting.is_empty() && Instant::now() < end {
        waiting.retain(|&tid| {
            let mut status = 0;
            // SAFETY: waitpid writes one int through a valid pointer. Per
            // thread, never -1: that could reap a child of gpusnap (the
            // keeper) whose status another thread waits for.
            let r = unsafe { libc::waitpid(tid, &mut status, libc::__WALL | libc::WNOHANG) };
            // Reported a stop (or gone, or not ours to wait for); a thread
            // stopped before the interrupt reports nothing new: its state
            // says so.
            !(r == tid || r < 0 || stopped(tid))
        });
        std::thread::sleep(Duration::from_millis(1));
    }
    if !waiting.is_empty() {
        tracing::warn!(tids = ?waiting, "rescue: threads not stopped yet (in the kernel); they stop before running again");
    }
    seized
}

/// The thread is in a stop (or gone).
fn stopped(tid: i32) -> bool {
    gpusnap_core::target::run_state(tid).map_or(true, |s| s.is_stopped() || s.is_zombie())
}

/// Restores back, whether one failed, and the decision once made.
type Arrivals = (usize, bool, Option<Result<(), Held>>);

/// Why the processes of a wake stay locked (every restore gets the same
/// answer).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Held {
    /// Another process of the wake failed its driver restore.
    #[error("another process of the wake failed its restore")]
    AnotherFailed,
    /// The image did not verify whole.
    #[error("{0}")]
    Verify(String),
    /// The lazy wake's page server failed while the driver restored.
    #[error("the page server failed during the driver's restore")]
    PageServerFailed,
}

/// Where each driver restore of a wake waits before its unlock: until every
/// restore of the wake has returned, and then for one decision for all:
/// the image's whole verify passed (the driver's restores began before it
/// ended: every byte they read was checked, but the image must be whole
/// before any process runs) and the tree was not rescued.
pub struct Gate<'a> {
    n: usize,
    state: Mutex<Arrivals>,
    cv: Condvar,
    decide: Box<dyn Fn() -> Result<(), Held> + Sync + 'a>,
}

impl<'a> Gate<'a> {
    /// A gate for `n` restores; `decide` runs once, when all are back and
    /// all succeeded.
    pub fn new(n: usize, decide: impl Fn() -> Result<(), Held> + Sync + 'a) -> Self {
        Self { n, state: Mutex::new((0, false, None)), cv: Condvar::new(), decide: Box::new(decide) }
    }

    /// One restore is back (`ok`: it succeeded); blocks until the decision.
    pub fn arrive(&self, ok: bool) -> Result<(), Held> {
        let mut g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        g.0 += 1;
        g.1 |= !ok;
        if g.0 >= self.n && g.2.is_none() {
            let d = if g.1 { Err(Held::AnotherFailed) } else { (self.decide)() };
            g.2 = Some(d);
            self.cv.notify_all();
        }
        while g.2.is_none() {
            g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        g.2.clone().unwrap_or(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn the_gate_decides_once_when_every_restore_is_back() {
        let calls = AtomicUsize::new(0);
        let gate = Gate::new(3, || {
            calls.fetch_add(1, Ordering::SeqCst);
            Ok(())
        });
        let got: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3).map(|_| s.spawn(|| gate.arrive(true))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(got.iter().all(|r| r.is_ok()), "{got:?}");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_failed_restore_keeps_every_process_locked_without_deciding() {
        let calls = AtomicUsize::new(0);
        let gate = Gate::new(2, || {
            calls.fetch_add(1, Ordering::SeqCst);
            Ok(())
        });
        let got: Vec<_> = std::thread::scope(|s| {
            let a = s.spawn(|| gate.arrive(true));
            let b = s.spawn(|| gate.arrive(false));
            vec![a.join().unwrap(), b.join().unwrap()]
        });
        assert!(got.iter().all(|r| r.is_err()), "{got:?}");
        assert_eq!(calls.load(Ordering::SeqCst), 0, "the verify is not waited for");
    }

    #[test]
    fn the_decision_is_every_restore_s_answer() {
        let gate = Gate::new(1, || Err(Held::Verify("chunk abc fails its checksum".into())));
        assert_eq!(gate.arrive(true), Err(Held::Verify("chunk abc fails its checksum".into())));
        assert_eq!(Held::AnotherFailed.to_string(), "another process of the wake failed its restore");
        assert_eq!(Held::Verify("chunk abc".into()).to_string(), "chunk abc");
    }

    #[test]
    fn a_stopped_thread_is_seen_stopped() {
        // This thread runs; a pid that does not exist counts as stopped
        // (gone) so that the wait for stops never waits on it.
        // SAFETY: gettid has no preconditions.
        let me = unsafe { libc::gettid() };
        assert!(!stopped(me));
        assert!(stopped(i32::MAX));
    }
}
