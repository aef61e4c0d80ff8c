//! The gate in front of every driver call that puts work on the GPU
//! (kernel launches, graph launches, copies, sets) and of the served
//! allocation calls: while the program's memory is away no kernel may touch
//! it, so an offload closes the gate, waits until no call is inside, and
//! opens it again only once the memory is back. A caller that finds the gate
//! closed waits in it, before the driver is entered (so outside any lock of
//! the driver's).
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
static WAIT: Mutex<()> = Mutex::new(());
static CHANGED: Condvar = Condvar::new();

thread_local! {
    /// Gated calls this thread is inside: a nested one (a wrapper reached
    /// through another) passes, or an offload would wait for it forever.
    static DEPTH: Cell<u32> = const { Cell::new(0) };
}

/// Enters the gate, waiting while it is closed.
pub fn enter() {
    if DEPTH.with(|d| d.get()) > 0 {
        DEPTH.with(|d| d.set(d.get() + 1));
        return;
    }
    loop {
        IN_FLIGHT.fetch_add(1, Ordering::SeqCst);
        if !PAUSED.load(Ordering::SeqCst) {
            DEPTH.with(|d| d.set(1));
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
        leave_count();
    }
}

fn leave_count() {
    if IN_FLIGHT.fetch_sub(1, Ordering::SeqCst) == 1 && PAUSED.load(Ordering::SeqCst) {
        let _g = WAIT.lock().unwrap_or_else(|e| e.into_inner());
        CHANGED.notify_all();
    }
}

/// Closes the gate and waits (at most `limit`) until no call is inside;
/// whether it drained. One that did not is opened again.
pub fn close(limit: Duration) -> bool {
    PAUSED.store(true, Ordering::SeqCst);
    let end = Instant::now() + limit;
    let mut g = WAIT.lock().unwrap_or_else(|e| e.into_inner());
    while IN_FLIGHT.load(Ordering::SeqCst) > 0 {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            drop(g);
            open();
            return false;
        }
        g = CHANGED.wait_timeout(g, left.min(Duration::from_millis(50))).unwrap_or_else(|e| e.into_inner()).0;
    }
    true
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

/// Runs the real function `real` inside the gate.
///
/// # Safety
/// `real` is a driver function whose arguments are the caller's.
#[allow(clippy::too_many_arguments)]
pub unsafe fn through(real: usize, a: [usize; 12]) -> c_int {
    if real == 0 {
        // CUDA_ERROR_NOT_INITIALIZED: no driver function to call.
        return 3;
    }
    // SAFETY: a driver function, called with the caller's own arguments in
    // the same registers and slots (see the module doc).
    let f = unsafe { std::mem::transmute::<usize, Raw>(real) };
    enter();
    // SAFETY: as above.
    let r = unsafe { f(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11]) };
    leave();
    r
}

const POOL: usize = 160;
static REAL: [AtomicUsize; POOL] = [const { AtomicUsize::new(0) }; POOL];
static TAKEN: Mutex<Vec<usize>> = Mutex::new(Vec::new());
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
    unsafe { through(REAL[I].load(Ordering::Acquire), [a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11]) }
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

/// A gated forwarder for the real function at `real` (the same one each
/// time it is asked for); `real` itself once the pool is used up.
pub fn gated(real: usize) -> usize {
    if real == 0 {
        return 0;
    }
    let Ok(mut taken) = TAKEN.lock() else { return real };
    if let Some(i) = taken.iter().position(|&r| r == real) {
        return FORWARDERS[i] as usize;
    }
    if taken.len() >= POOL {
        UNGATED.fetch_add(1, Ordering::Relaxed);
        return real;
    }
    let i = taken.len();
    REAL[i].store(real, Ordering::Release);
    taken.push(real);
    FORWARDERS[i] as usize
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
        assert!(!is_gated("cuCtxSynchronize"));
        assert!(!is_gated("cuMemAlloc_v2"));
    }

    #[test]
    fn one_forwarder_per_real_function() {
        let a = gated(0x1000);
        assert_eq!(gated(0x1000), a);
        assert_ne!(gated(0x2000), a);
        assert_eq!(gated(0), 0);
    }

    #[test]
    fn a_closed_gate_holds_callers_until_it_opens() {
        assert!(close(Duration::from_secs(5)));
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
        assert!(!close(Duration::from_millis(100)));
        assert!(!is_closed());
        leave();
    }
}
