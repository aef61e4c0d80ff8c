//! The gate in front of every driver call that puts work on the GPU
//! (kernel launches, graph launches, copies, sets), that waits for it or
//! asks about it (synchronizes, queries, stream waits), and of the served
//! allocation calls: while the program's memory is away no kernel may touch
//! it, and when the driver locks the process no thread may be inside one of
//! its calls (a thread caught in a blocking read or a synchronize by the
//! driver's checkpoint can crash the program once it is restored). So an
//! offload closes the gate, waits until no call is inside, and opens it
//! again only once the memory is back. A caller that finds the gate closed
//! waits in it, before the driver is entered (so outside any lock of the
//! driver's).
//!
//! The gated calls are forwarded through one shape: twelve integer-class
//! arguments, passed on unchanged. Every driver call gated here takes only
//! integer and pointer arguments, at most eleven, and on x86-64 and aarch64
//! such arguments travel in the same registers and stack slots whatever
//! their C type, so one forwarder per real function serves them all. The
//! forwarders come from a fixed pool, one per distinct real address (what
//! `dlsym` and `cuGetProcAddress` handed out), so that the same function
//! reached under several names or versions is gated once.

use std::cell::Cell;
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// The generic shape of a gated driver call.
pub type Raw = unsafe extern "C" fn(
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
) -> c_int;

static PAUSED: AtomicBool = AtomicBool::new(false);
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);
/// Calls that have left the gate since the process started: an offload
/// waiting for the gate to drain sees progress while it grows.
static LEFT: AtomicUsize = AtomicUsize::new(0);
/// Threads past the gate, inside a gated call (IN_FLIGHT also counts, for
/// an instant, those that find it closed and go back to wait).
static ENTERED: AtomicUsize = AtomicUsize::new(0);
static WAIT: Mutex<()> = Mutex::new(());
static CHANGED: Condvar = Condvar::new();

thread_local! {
    /// Gated calls this thread is inside: a nested one (a wrapper reached
    /// through another) passes, or an offload would wait for it forever.
    static DEPTH: Cell<u32> = const { Cell::new(0) };
    /// The pool slot of the outermost gated call this thread is inside.
    static SLOT_OF: Cell<usize> = const { Cell::new(NONE) };
}

/// Enters the gate, waiting while it is closed.
pub fn enter() {
    enter_as(NONE);
}

/// Slot of calls that are not forwarded through the pool (the served
/// allocation calls, the library's own).
const NONE: usize = POOL;

/// Enters the gate for the forwarded call of pool slot `slot` (`NONE` for
/// others), waiting while it is closed.
fn enter_as(slot: usize) {
    if DEPTH.with(|d| d.get()) > 0 {
        DEPTH.with(|d| d.set(d.get() + 1));
        return;
    }
    loop {
        IN_FLIGHT.fetch_add(1, Ordering::SeqCst);
        if !PAUSED.load(Ordering::SeqCst) {
            DEPTH.with(|d| d.set(1));
            ENTERED.fetch_add(1, Ordering::SeqCst);
            SLOT_OF.with(|c| c.set(slot));
            if slot < POOL {
                INSIDE[slot].fetch_add(1, Ordering::SeqCst);
            }
            return;
        }
        leave_count();
        let mut g = WAIT.lock().unwrap_or_else(|e| e.into_inner());
        while PAUSED.load(Ordering::SeqCst) {
            g = CHANGED.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Leaves the gate.
pub fn leave() {
    let depth = DEPTH.with(|d| {
        let v = d.get().saturating_sub(1);
        d.set(v);
        v
    });
    if depth == 0 {
        let slot = SLOT_OF.with(|c| c.replace(NONE));
        if slot < POOL {
            INSIDE[slot].fetch_sub(1, Ordering::SeqCst);
        }
        LEFT.fetch_add(1, Ordering::SeqCst);
        ENTERED.fetch_sub(1, Ordering::SeqCst);
        leave_count();
    }
}

/// Threads inside a gated call now (inside the driver, or about to be);
/// not those waiting at the closed gate.
pub fn inside() -> usize {
    ENTERED.load(Ordering::SeqCst)
}

/// The gated calls threads are inside now, by name, with how many
/// threads: "cuCtxSynchronize x2, cuLaunchKernel" (empty when they are
/// none of the pool's, or none).
pub fn inside_names() -> String {
    let Ok(names) = NAMES.lock() else { return String::new() };
    let mut out = Vec::new();
    for (i, n) in names.iter().enumerate() {
        let k = INSIDE[i].load(Ordering::SeqCst);
        match k {
            0 => {}
            1 => out.push(n.clone()),
            _ => out.push(format!("{n} x{k}")),
        }
    }
    out.join(", ")
}

fn leave_count() {
    if IN_FLIGHT.fetch_sub(1, Ordering::SeqCst) == 1 && PAUSED.load(Ordering::SeqCst) {
        let _g = WAIT.lock().unwrap_or_else(|e| e.into_inner());
        CHANGED.notify_all();
    }
}

/// Closes the gate and waits until no call is inside, for as long as calls
/// keep leaving: it gives up once none has left for `limit`. A gate that
/// did not drain is opened again, and the error names the calls that
/// stayed inside and for how long.
pub fn close(limit: Duration) -> Result<(), String> {
    PAUSED.store(true, Ordering::SeqCst);
    let mut end = Instant::now() + limit;
    let mut left_seen = LEFT.load(Ordering::SeqCst);
    let mut g = WAIT.lock().unwrap_or_else(|e| e.into_inner());
    while IN_FLIGHT.load(Ordering::SeqCst) > 0 {
        let now = Instant::now();
        let left = LEFT.load(Ordering::SeqCst);
        if left != left_seen {
            // Progress: a call left; the others get the whole limit again.
            left_seen = left;
            end = now + limit;
        }
        let wait = end.saturating_duration_since(now);
        if wait.is_zero() {
            let n = ENTERED.load(Ordering::SeqCst);
            let names = inside_names();
            drop(g);
            open();
            let what = if names.is_empty() { String::new() } else { format!(" ({names})") };
            return Err(format!(
                "{n} thread(s) stayed inside a driver call{what} for {} s with none leaving",
                limit.as_secs_f64()
            ));
        }
        g = CHANGED.wait_timeout(g, wait.min(Duration::from_millis(50))).unwrap_or_else(|e| e.into_inner()).0;
    }
    Ok(())
}

/// Opens the gate; the waiting callers go on.
pub fn open() {
    PAUSED.store(false, Ordering::SeqCst);
    let _g = WAIT.lock().unwrap_or_else(|e| e.into_inner());
    CHANGED.notify_all();
}

pub fn is_closed() -> bool {
    PAUSED.load(Ordering::SeqCst)
}

/// Runs the real function `real` inside the gate, counted under pool slot
/// `slot` (`NONE`: not a pool function).
///
/// # Safety
/// `real` is a driver function whose arguments are the caller's.
unsafe fn through_slot(slot: usize, real: usize, a: [usize; 12]) -> c_int {
    if real == 0 {
        // CUDA_ERROR_NOT_INITIALIZED: no driver function to call.
        return 3;
    }
    // SAFETY: a driver function, called with the caller's own arguments in
    // the same registers and slots (see the module doc).
    let f = unsafe { std::mem::transmute::<usize, Raw>(real) };
    enter_as(slot);
    // SAFETY: as above.
    let r = unsafe { f(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11]) };
    leave();
    r
}

/// Runs the real function of pool slot `slot` (from `slot_of`; `None`: the
/// function `real`, uncounted) inside the gate.
///
/// # Safety
/// `real` is a driver function whose arguments are the caller's, and the
/// slot's function when there is one.
pub unsafe fn through(slot: Option<usize>, real: usize, a: [usize; 12]) -> c_int {
    // SAFETY: the caller's promise.
    unsafe { through_slot(slot.unwrap_or(NONE), real, a) }
}

const POOL: usize = 160;
static REAL: [AtomicUsize; POOL] = [const { AtomicUsize::new(0) }; POOL];
static TAKEN: Mutex<Vec<usize>> = Mutex::new(Vec::new());
/// The name each slot's function was first asked for by.
static NAMES: Mutex<Vec<String>> = Mutex::new(Vec::new());
/// Threads inside each slot's function now.
static INSIDE: [AtomicUsize; POOL] = [const { AtomicUsize::new(0) }; POOL];
/// Real functions handed out ungated because the pool ran out (named in
/// the library's status).
pub static UNGATED: AtomicUsize = AtomicUsize::new(0);

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn forwarder<const I: usize>(
    a0: usize,
    a1: usize,
    a2: usize,
    a3: usize,
    a4: usize,
    a5: usize,
    a6: usize,
    a7: usize,
    a8: usize,
    a9: usize,
    a10: usize,
    a11: usize,
) -> c_int {
    // SAFETY: REAL[I] was set to a driver function before this forwarder
    // was handed out for it.
    unsafe {
        through_slot(I, REAL[I].load(Ordering::Acquire), [a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11])
    }
}

macro_rules! pool {
    ($($i:literal)*) => { [$(forwarder::<$i> as Raw),*] };
}

static FORWARDERS: [Raw; POOL] = pool!(
    0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31
    32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60 61 62 63
    64 65 66 67 68 69 70 71 72 73 74 75 76 77 78 79 80 81 82 83 84 85 86 87 88 89 90 91 92 93 94 95
    96 97 98 99 100 101 102 103 104 105 106 107 108 109 110 111 112 113 114 115 116 117 118 119
    120 121 122 123 124 125 126 127 128 129 130 131 132 133 134 135 136 137 138 139 140 141 142 143
    144 145 146 147 148 149 150 151 152 153 154 155 156 157 158 159
);

/// A gated forwarder for the real function at `real`, asked for as
/// `name` (the same one each time it is asked for); `real` itself once the
/// pool is used up.
pub fn gated(real: usize, name: &str) -> usize {
    match slot_of(real, name) {
        Some(i) => FORWARDERS[i] as usize,
        None => real,
    }
}

/// The pool slot of the real function at `real`, taken on first use;
/// `None` for 0 or once the pool is used up (counted in `UNGATED`).
pub fn slot_of(real: usize, name: &str) -> Option<usize> {
    if real == 0 {
        return None;
    }
    let mut taken = TAKEN.lock().ok()?;
    if let Some(i) = taken.iter().position(|&r| r == real) {
        return Some(i);
    }
    if taken.len() >= POOL {
        UNGATED.fetch_add(1, Ordering::Relaxed);
        return None;
    }
    let i = taken.len();
    REAL[i].store(real, Ordering::Release);
    taken.push(real);
    if let Ok(mut names) = NAMES.lock() {
        names.push(base_name(name).to_string());
    }
    Some(i)
}

/// The driver calls that put work on the GPU or move memory, by base name
/// (the name `cuGetProcAddress` takes; exported names add `_v2`, `_v3`,
/// `_ptds`, `_ptsz`). Listed in docs/design/fast-swap.md.
pub const GATED: &[&str] = &[
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cuLaunchCooperativeKernel",
    "cuLaunchCooperativeKernelMultiDevice",
    "cuLaunchGrid",
    "cuLaunchGridAsync",
    "cuLaunch",
    "cuGraphLaunch",
    "cuMemcpy",
    "cuMemcpyAsync",
    "cuMemcpyPeer",
    "cuMemcpyPeerAsync",
    "cuMemcpyHtoD",
    "cuMemcpyHtoDAsync",
    "cuMemcpyDtoH",
    "cuMemcpyDtoHAsync",
    "cuMemcpyDtoD",
    "cuMemcpyDtoDAsync",
    "cuMemcpyDtoA",
    "cuMemcpyAtoD",
    "cuMemcpy2D",
    "cuMemcpy2DAsync",
    "cuMemcpy2DUnaligned",
    "cuMemcpy3D",
    "cuMemcpy3DAsync",
    "cuMemcpy3DPeer",
    "cuMemcpy3DPeerAsync",
    "cuMemcpyBatchAsync",
    "cuMemcpy3DBatchAsync",
    "cuMemPrefetchAsync",
    "cuMemsetD8",
    "cuMemsetD16",
    "cuMemsetD32",
    "cuMemsetD2D8",
    "cuMemsetD2D16",
    "cuMemsetD2D32",
    "cuMemsetD8Async",
    "cuMemsetD16Async",
    "cuMemsetD32Async",
    "cuMemsetD2D8Async",
    "cuMemsetD2D16Async",
    "cuMemsetD2D32Async",
    // Calls that wait for the GPU's work or ask about it: the driver's lock
    // must not catch a thread inside one.
    "cuCtxSynchronize",
    "cuStreamSynchronize",
    "cuEventSynchronize",
    "cuStreamQuery",
    "cuEventQuery",
    "cuStreamWaitEvent",
    "cuEventRecord",
    "cuEventRecordWithFlags",
    "cuStreamWaitValue32",
    "cuStreamWaitValue64",
    "cuStreamWriteValue32",
    "cuStreamWriteValue64",
    "cuStreamBatchMemOp",
    "cuLaunchHostFunc",
    "cuStreamAddCallback",
];

/// The base name of an exported driver symbol: without `_ptds`/`_ptsz`,
/// then without `_v2`/`_v3`.
pub fn base_name(name: &str) -> &str {
    let n = name.strip_suffix("_ptds").or_else(|| name.strip_suffix("_ptsz")).unwrap_or(name);
    n.strip_suffix("_v2").or_else(|| n.strip_suffix("_v3")).unwrap_or(n)
}

pub fn is_gated(name: &str) -> bool {
    GATED.contains(&base_name(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_gated_by_their_base() {
        assert!(is_gated("cuLaunchKernel"));
        assert!(is_gated("cuLaunchKernel_ptsz"));
        assert!(is_gated("cuMemcpyHtoD_v2"));
        assert!(is_gated("cuMemcpyDtoHAsync_v2_ptsz"));
        assert!(is_gated("cuCtxSynchronize"));
        assert!(is_gated("cuStreamSynchronize_ptsz"));
        assert!(is_gated("cuEventQuery"));
        assert!(!is_gated("cuCtxGetCurrent"));
        assert!(!is_gated("cuMemAlloc_v2"));
    }

    #[test]
    fn one_forwarder_per_real_function() {
        let a = gated(0x1000, "cuLaunchKernel");
        assert_eq!(gated(0x1000, "cuLaunchKernel_ptsz"), a);
        assert_ne!(gated(0x2000, "cuMemcpy"), a);
        assert_eq!(gated(0, "cuMemcpy"), 0);
    }

    #[test]
    fn a_closed_gate_holds_callers_until_it_opens() {
        assert!(close(Duration::from_secs(5)).is_ok());
        let done = std::sync::Arc::new(AtomicBool::new(false));
        let d = std::sync::Arc::clone(&done);
        let t = std::thread::spawn(move || {
            enter();
            d.store(true, Ordering::SeqCst);
            leave();
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(!done.load(Ordering::SeqCst));
        open();
        t.join().unwrap();
        assert!(done.load(Ordering::SeqCst));
        // A caller inside keeps the gate from draining.
        enter();
        let e = close(Duration::from_millis(100)).unwrap_err();
        assert!(e.contains("1 thread(s) stayed inside a driver call"), "{e}");
        assert!(!is_closed());
        leave();
    }
}
