//! The allocations the library serves from the VMM API (a reserved range,
//! physical memory created and mapped into it, access set), and those it
//! leaves to the driver, named: a swap moves the first and leaves the
//! second to the driver's checkpoint.

use super::driver as cu;
use super::gate;
use std::collections::BTreeMap;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

/// One served allocation.
#[derive(Debug, Clone)]
pub struct Entry {
    /// The bytes the program asked for (what a swap copies).
    pub bytes: u64,
    /// The reserved and mapped size (rounded up to the granularity).
    pub size: u64,
    pub device: i32,
    /// The context current when it was made (a `CUcontext`).
    pub ctx: usize,
    /// The physical allocation; 0 while the memory is away.
    pub handle: u64,
    /// The pinned host copy, chunk by chunk (`hostmem::chunks`), while the
    /// memory is away (and, when copies are kept, while it is back); empty
    /// when there is none.
    pub host: Vec<usize>,
    /// blake3 of each chunk's contents when they left (verification only).
    pub sum: Vec<[u8; 32]>,
    /// 0 for an allocation the library made; else the program's own VMM
    /// handle (`program`) whose memory this is.
    pub program: u64,
}

/// An allocation left with the driver, and why.
#[derive(Debug, Clone)]
pub struct Kept {
    pub bytes: u64,
    pub why: &'static str,
}

#[derive(Default)]
pub struct Table {
    pub served: BTreeMap<u64, Entry>,
    pub kept: BTreeMap<u64, Kept>,
    /// Granularity per device.
    gran: BTreeMap<i32, u64>,
}

static TABLE: Mutex<Option<Table>> = Mutex::new(None);
/// Serving is on (`GPUSNAP_FAST_SWAP=1` in a light-mode program).
pub static SERVING: AtomicBool = AtomicBool::new(false);

pub fn table() -> MutexGuard<'static, Option<Table>> {
    TABLE.lock().unwrap_or_else(|e| e.into_inner())
}

fn with<T>(f: impl FnOnce(&mut Table) -> T) -> T {
    let mut g = table();
    f(g.get_or_insert_with(Table::default))
}

fn keep(ptr: u64, bytes: u64, why: &'static str) {
    with(|t| t.kept.insert(ptr, Kept { bytes, why }));
}

/// The device and context current on this thread.
fn current() -> Result<(i32, usize), c_int> {
    let mut ctx = 0usize;
    let mut dev: c_int = 0;
    // SAFETY: out-pointers to locals.
    let rc = unsafe { cu::ctx_get_current(&mut ctx) };
    if rc != cu::SUCCESS {
        return Err(rc);
    }
    // SAFETY: as above.
    let rc = unsafe { cu::ctx_get_device(&mut dev) };
    if rc != cu::SUCCESS {
        return Err(rc);
    }
    Ok((dev, ctx))
}

fn granularity(dev: i32) -> Result<u64, c_int> {
    if let Some(g) = with(|t| t.gran.get(&dev).copied()) {
        return Ok(g);
    }
    let mut g = 0usize;
    let prop = cu::prop(dev);
    // SAFETY: a valid prop and out-pointer; option 0 = minimum granularity.
    let rc = unsafe { cu::granularity(&mut g, &prop, 0) };
    if rc != cu::SUCCESS || g == 0 {
        return Err(if rc == cu::SUCCESS { 1 } else { rc });
    }
    with(|t| t.gran.insert(dev, g as u64));
    Ok(g as u64)
}

/// Physical memory of `size` bytes on `dev`, mapped at `va` with access
/// set: the handle, or the driver's answer (nothing left taken).
pub fn back(va: u64, size: u64, dev: i32) -> Result<u64, c_int> {
    let mut h = 0u64;
    let prop = cu::prop(dev);
    // SAFETY: out-pointer to a local, a valid prop.
    let rc = unsafe { cu::create(&mut h, size as usize, &prop, 0) };
    if rc != cu::SUCCESS {
        return Err(rc);
    }
    // SAFETY: a reserved range of `size` and a handle of `size`.
    let rc = unsafe { cu::map(va, size as usize, 0, h, 0) };
    if rc != cu::SUCCESS {
        // SAFETY: the handle just made.
        unsafe { cu::release(h) };
        return Err(rc);
    }
    let desc = cu::access(dev);
    // SAFETY: the range just mapped; one descriptor.
    let rc = unsafe { cu::set_access(va, size as usize, &desc, 1) };
    if rc != cu::SUCCESS {
        // SAFETY: undoing the two steps above.
        unsafe {
            cu::unmap(va, size as usize);
            cu::release(h);
        }
        return Err(rc);
    }
    Ok(h)
}

/// Unmaps `size` bytes at `va` and releases `handle` (the reservation stays).
pub fn unback(va: u64, size: u64, handle: u64) -> c_int {
    // SAFETY: a mapping this library made, and its handle.
    let rc = unsafe { cu::unmap(va, size as usize) };
    // SAFETY: as above.
    let rc2 = unsafe { cu::release(handle) };
    if rc != cu::SUCCESS {
        rc
    } else {
        rc2
    }
}

/// Serves one allocation: a reservation and memory mapped into it. `None`
/// when the VMM API refuses for a reason other than memory (the caller then
/// falls back to the driver's allocator).
fn serve(bytes: usize) -> Option<Result<u64, c_int>> {
    let (dev, ctx) = match current() {
        Ok(c) => c,
        Err(rc) => return Some(Err(rc)),
    };
    let g = granularity(dev).ok()?;
    let size = (bytes as u64).div_ceil(g) * g;
    let mut va = 0u64;
    // SAFETY: out-pointer to a local; no fixed address, default alignment.
    if unsafe { cu::address_reserve(&mut va, size as usize, 0, 0, 0) } != cu::SUCCESS {
        return None;
    }
    match back(va, size, dev) {
        Ok(handle) => {
            let e = Entry {
                bytes: bytes as u64,
                size,
                device: dev,
                ctx,
                handle,
                host: Vec::new(),
                sum: Vec::new(),
                program: 0,
            };
            with(|t| t.served.insert(va, e));
            Some(Ok(va))
        }
        Err(rc) => {
            // SAFETY: the reservation just made, with nothing mapped.
            unsafe { cu::address_free(va, size as usize) };
            if rc == cu::OUT_OF_MEMORY {
                Some(Err(rc))
            } else {
                None
            }
        }
    }
}

/// `cuMemAlloc_v2`, served from the VMM API.
///
/// # Safety
/// `dptr` is NULL or writable (the driver's contract).
pub unsafe extern "C" fn mem_alloc(dptr: *mut u64, bytes: usize) -> c_int {
    if !SERVING.load(Ordering::Relaxed) || dptr.is_null() || bytes == 0 {
        // SAFETY: the caller's arguments, passed on.
        return unsafe { cu::mem_alloc(dptr, bytes) };
    }
    gate::enter();
    super::prepin::changed();
    let r = match serve(bytes) {
        Some(Ok(va)) => {
            // SAFETY: checked non-NULL; the caller's contract.
            unsafe { dptr.write_unaligned(va) };
            cu::SUCCESS
        }
        Some(Err(rc)) => rc,
        None => {
            // SAFETY: the caller's arguments, passed on.
            let rc = unsafe { cu::mem_alloc(dptr, bytes) };
            if rc == cu::SUCCESS {
                // SAFETY: the driver wrote it.
                keep(unsafe { dptr.read_unaligned() }, bytes as u64, "the VMM API refused it");
            }
            rc
        }
    };
    gate::leave();
    r
}

/// `cuMemFree_v2`: a served allocation's memory and reservation go back.
pub extern "C" fn mem_free(ptr: u64) -> c_int {
    gate::enter();
    super::prepin::changed();
    let served = with(|t| {
        t.kept.remove(&ptr);
        t.served.remove(&ptr)
    });
    let rc = match served {
        Some(e) => {
            let mut rc = cu::SUCCESS;
            // cuMemFree waits for the device (cudaFree's documented
            // behaviour); an unmap does not: no kernel may still use it.
            // SAFETY: no arguments; waits for the current context's work.
            unsafe { cu::ctx_synchronize() };
            if e.handle != 0 {
                rc = unback(ptr, e.size, e.handle);
            }
            super::hostmem::unpin_all(&e.host, e.bytes);
            // SAFETY: the reservation this library made, now empty.
            let rc2 = unsafe { cu::address_free(ptr, e.size as usize) };
            if rc != cu::SUCCESS {
                rc
            } else {
                rc2
            }
        }
        // SAFETY: not ours: the driver's own free.
        None => unsafe { cu::mem_free(ptr) },
    };
    gate::leave();
    rc
}

/// `cuMemAllocPitch_v2`: left with the driver, named.
///
/// # Safety
/// The driver's contract.
pub unsafe extern "C" fn mem_alloc_pitch(
    p: *mut u64,
    pitch: *mut usize,
    w: usize,
    h: usize,
    e: c_uint,
) -> c_int {
    // SAFETY: the caller's arguments, passed on.
    let rc = unsafe { cu::mem_alloc_pitch(p, pitch, w, h, e) };
    if rc == cu::SUCCESS && !p.is_null() && !pitch.is_null() {
        // SAFETY: the driver wrote both.
        let (ptr, pitch) = unsafe { (p.read_unaligned(), pitch.read_unaligned()) };
        keep(ptr, (pitch * h) as u64, "pitched (cuMemAllocPitch)");
    }
    rc
}

/// `cuMemAllocManaged`: left with the driver, named.
///
/// # Safety
/// The driver's contract.
pub unsafe extern "C" fn mem_alloc_managed(p: *mut u64, bytes: usize, flags: c_uint) -> c_int {
    // SAFETY: the caller's arguments, passed on.
    let rc = unsafe { cu::mem_alloc_managed(p, bytes, flags) };
    if rc == cu::SUCCESS && !p.is_null() {
        // SAFETY: the driver wrote it.
        keep(unsafe { p.read_unaligned() }, bytes as u64, "managed (cuMemAllocManaged)");
    }
    rc
}

/// `cuIpcGetMemHandle`: memory the library serves is VMM memory, which the
/// driver's legacy IPC cannot share. Refused with `CUDA_ERROR_NOT_SUPPORTED`
/// and, once per process, a line on stderr naming the way out; memory left
/// with the driver goes to the driver's own call.
///
/// # Safety
/// The driver's contract.
pub unsafe extern "C" fn ipc_get_mem_handle(handle: *mut c_void, ptr: u64) -> c_int {
    let served = with(|t| t.served.range(..=ptr).next_back().is_some_and(|(va, e)| ptr < va + e.size));
    if !served {
        // SAFETY: the caller's arguments, passed on.
        return unsafe { cu::ipc_get_mem_handle(handle, ptr) };
    }
    IPC_REFUSED.fetch_add(1, Ordering::Relaxed);
    if !IPC_SAID.swap(true, Ordering::Relaxed) {
        eprintln!(
            "gpusnap: fast swap serves the device memory at {ptr:#x} through the VMM API, which CUDA IPC \
             (cuIpcGetMemHandle) cannot share: run this program without --fast-swap (an agent's service: \
             fast_swap = false)"
        );
    }
    cu::NOT_SUPPORTED
}

/// `cuIpcGetMemHandle` calls refused on served memory.
pub static IPC_REFUSED: AtomicU64 = AtomicU64::new(0);
static IPC_SAID: AtomicBool = AtomicBool::new(false);

/// What the table holds: (served count, served bytes, kept count, kept
/// bytes, kept reasons).
pub fn summary() -> (usize, u64, usize, u64, Vec<&'static str>) {
    with(|t| {
        let mut why: Vec<&'static str> = t.kept.values().map(|k| k.why).collect();
        why.sort_unstable();
        why.dedup();
        (
            t.served.len(),
            t.served.values().map(|e| e.bytes).sum(),
            t.kept.len(),
            t.kept.values().map(|k| k.bytes).sum(),
            why,
        )
    })
}

/// `cuMemAllocAsync`: memory of the driver's stream-ordered pool, left with
/// the driver (the pool keeps freed memory for reuse, and the library cannot
/// give a pool's memory back and have it again at the same address), named.
///
/// # Safety
/// The driver's contract.
pub unsafe extern "C" fn mem_alloc_async(p: *mut u64, bytes: usize, stream: *mut c_void) -> c_int {
    // SAFETY: the caller's arguments, passed on.
    let rc = unsafe { cu::alloc_async(p, bytes, stream) };
    if rc == cu::SUCCESS && !p.is_null() {
        // SAFETY: the driver wrote it.
        keep(unsafe { p.read_unaligned() }, bytes as u64, POOL_WHY);
    }
    rc
}

/// `cuMemAllocFromPoolAsync`: as `cuMemAllocAsync`.
///
/// # Safety
/// The driver's contract.
pub unsafe extern "C" fn mem_alloc_from_pool_async(
    p: *mut u64,
    bytes: usize,
    pool: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    // SAFETY: the caller's arguments, passed on.
    let rc = unsafe { cu::alloc_from_pool_async(p, bytes, pool, stream) };
    if rc == cu::SUCCESS && !p.is_null() {
        // SAFETY: the driver wrote it.
        keep(unsafe { p.read_unaligned() }, bytes as u64, POOL_WHY);
    }
    rc
}

/// `cuMemFreeAsync`: no longer named (the pool may still hold the memory).
pub extern "C" fn mem_free_async(ptr: u64, stream: *mut c_void) -> c_int {
    with(|t| t.kept.remove(&ptr));
    // SAFETY: the caller's arguments, passed on.
    unsafe { cu::free_async(ptr, stream) }
}

const POOL_WHY: &str = "stream-ordered pool (cuMemAllocAsync)";
