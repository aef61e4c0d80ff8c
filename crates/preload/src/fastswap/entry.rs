//! How the program's driver calls reach the library's wrappers:
//! - a program linked to libcuda calls the exported names below (this
//!   library is preloaded, so its definitions come first);
//! - a program that loads libcuda itself (the CUDA runtime, CuPy, this
//!   project's test workload) looks the functions up with `dlsym` on its
//!   own handle, which LD_PRELOAD alone does not see: `dlsym` is wrapped
//!   (x86-64) and, for a function of libcuda's that the library serves or
//!   gates, hands out the wrapper instead;
//! - the CUDA runtime asks the driver for most functions with
//!   `cuGetProcAddress`: the wrapped `cuGetProcAddress` hands out the
//!   library's wrappers for the functions it serves and gated forwarders for
//!   those it gates, and the driver's own for the rest.
//!
//! The `dlsym` wrapper is a two-instruction trampoline: a lookup relative to
//! the caller (`RTLD_NEXT`), and every lookup while fast swap is off, jump
//! straight into glibc's `dlsym`, which then sees the caller's own return
//! address as it must.

use super::driver as cu;
use super::{gate, program, table};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Wrappers are handed out (fast swap is on in this process).
pub static ACTIVE: AtomicBool = AtomicBool::new(false);
/// glibc's `dlsym`, for the trampoline.
static REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);

/// What a lookup of the driver function `name` that resolved to `real`
/// hands out.
fn replace(name: &str, real: usize, version: Option<c_int>) -> usize {
    if real == 0 || !ACTIVE.load(Ordering::Relaxed) || !cu::in_libcuda(real) {
        return real;
    }
    // cuGetProcAddress names a function by its base name and a version;
    // the `_v2` forms came with CUDA 3.2 (the 64-bit pointers).
    let v2 = version.is_none_or(|v| v >= 3020);
    let by_proc = version.is_some();
    match name {
        "cuGetProcAddress" if by_proc => {
            if version.is_some_and(|v| v >= 12000) {
                get_proc_address_v2 as *const () as usize
            } else {
                get_proc_address as *const () as usize
            }
        }
        "cuGetProcAddress" => get_proc_address as *const () as usize,
        "cuGetProcAddress_v2" => get_proc_address_v2 as *const () as usize,
        "cuMemAlloc" if by_proc && v2 => table::mem_alloc as *const () as usize,
        "cuMemAlloc_v2" if !by_proc => table::mem_alloc as *const () as usize,
        "cuMemFree" if by_proc && v2 => table::mem_free as *const () as usize,
        "cuMemFree_v2" if !by_proc => table::mem_free as *const () as usize,
        "cuMemAllocPitch" if by_proc && v2 => table::mem_alloc_pitch as *const () as usize,
        "cuMemAllocPitch_v2" if !by_proc => table::mem_alloc_pitch as *const () as usize,
        "cuMemAllocManaged" => table::mem_alloc_managed as *const () as usize,
        "cuIpcGetMemHandle" => table::ipc_get_mem_handle as *const () as usize,
        "cuMemCreate" => program::mem_create as *const () as usize,
        "cuMemRelease" => program::mem_release as *const () as usize,
        "cuMemMap" => program::mem_map as *const () as usize,
        "cuMemUnmap" => program::mem_unmap as *const () as usize,
        "cuMemSetAccess" => program::mem_set_access as *const () as usize,
        "cuMemExportToShareableHandle" => program::mem_export as *const () as usize,
        "cuMemGetAllocationPropertiesFromHandle" => program::mem_props as *const () as usize,
        "cuMemRetainAllocationHandle" => program::mem_retain as *const () as usize,
        "cuMemAllocAsync" | "cuMemAllocAsync_ptsz" => table::mem_alloc_async as *const () as usize,
        "cuMemAllocFromPoolAsync" | "cuMemAllocFromPoolAsync_ptsz" => {
            table::mem_alloc_from_pool_async as *const () as usize
        }
        "cuMemFreeAsync" | "cuMemFreeAsync_ptsz" => table::mem_free_async as *const () as usize,
        n if gate::is_gated(n) => gate::gated(real, n),
        _ => real,
    }
}

/// The `dlsym` lookups the trampoline does not pass straight on.
unsafe extern "C" fn dlsym_mapped(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    let Some(real) = cu::real_dlsym() else { return std::ptr::null_mut() };
    REAL_DLSYM.store(real as usize, Ordering::Release);
    // SAFETY: the caller's arguments, passed on.
    let p = unsafe { real(handle, name) } as usize;
    if p == 0 || name.is_null() {
        return p as *mut c_void;
    }
    // SAFETY: a NUL-terminated name (the caller's contract).
    let Ok(n) = unsafe { CStr::from_ptr(name) }.to_str() else { return p as *mut c_void };
    replace(n, p, None) as *mut c_void
}

/// The wrapped `dlsym` (see the module doc).
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[no_mangle]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    core::arch::naked_asm!(
        "mov rax, qword ptr [rip + {real}]",
        "test rax, rax",
        "jz 2f",
        "cmp byte ptr [rip + {active}], 0",
        "je 3f",
        "cmp rdi, -1",
        "je 3f",
        "2:",
        "jmp {mapped}",
        "3:",
        "jmp rax",
        real = sym REAL_DLSYM,
        active = sym ACTIVE,
        mapped = sym dlsym_mapped,
    )
}

/// Fills the trampoline's pointer to glibc's `dlsym` (at load).
pub fn prepare() {
    if let Some(real) = cu::real_dlsym() {
        REAL_DLSYM.store(real as usize, Ordering::Release);
    }
}

/// The wrapped `cuGetProcAddress` (CUDA 11.3-12.x).
///
/// # Safety
/// The driver's contract.
#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress(
    sym: *const c_char,
    pfn: *mut *mut c_void,
    ver: c_int,
    flags: u64,
) -> c_int {
    // SAFETY: the caller's arguments, passed on.
    let rc = unsafe { cu::get_proc_address(sym, pfn, ver, flags) };
    // SAFETY: as the driver wrote them.
    unsafe { after_proc_address(rc, sym, pfn, ver) }
}

/// The wrapped `cuGetProcAddress_v2` (CUDA 12.0 on).
///
/// # Safety
/// The driver's contract.
#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    sym: *const c_char,
    pfn: *mut *mut c_void,
    ver: c_int,
    flags: u64,
    status: *mut c_int,
) -> c_int {
    // SAFETY: the caller's arguments, passed on.
    let rc = unsafe { cu::get_proc_address_v2(sym, pfn, ver, flags, status) };
    // SAFETY: as the driver wrote them.
    unsafe { after_proc_address(rc, sym, pfn, ver) }
}

unsafe extern "C" fn get_proc_address(
    sym: *const c_char,
    pfn: *mut *mut c_void,
    ver: c_int,
    flags: u64,
) -> c_int {
    // SAFETY: the caller's arguments.
    unsafe { cuGetProcAddress(sym, pfn, ver, flags) }
}

unsafe extern "C" fn get_proc_address_v2(
    sym: *const c_char,
    pfn: *mut *mut c_void,
    ver: c_int,
    flags: u64,
    status: *mut c_int,
) -> c_int {
    // SAFETY: the caller's arguments.
    unsafe { cuGetProcAddress_v2(sym, pfn, ver, flags, status) }
}

/// Swaps the driver's answer for our wrapper where we serve or gate it.
///
/// # Safety
/// `sym` a C string and `pfn` the pointer the driver just wrote through.
unsafe fn after_proc_address(rc: c_int, sym: *const c_char, pfn: *mut *mut c_void, ver: c_int) -> c_int {
    if rc != cu::SUCCESS || sym.is_null() || pfn.is_null() {
        return rc;
    }
    // SAFETY: the caller's contract.
    let (name, p) = unsafe { (CStr::from_ptr(sym), *pfn as usize) };
    if let Ok(n) = name.to_str() {
        // SAFETY: as above.
        unsafe { *pfn = replace(n, p, Some(ver)) as *mut c_void };
    }
    rc
}

/// Exported driver names for programs linked to libcuda: each forwards to
/// libcuda's own definition (found past this library), through the gate.
macro_rules! exported {
    ($($name:ident)*) => {
        $(
            #[no_mangle]
            #[allow(non_snake_case, clippy::too_many_arguments, clippy::missing_safety_doc)]
            pub unsafe extern "C" fn $name(
                a0: usize, a1: usize, a2: usize, a3: usize, a4: usize, a5: usize,
                a6: usize, a7: usize, a8: usize, a9: usize, a10: usize, a11: usize,
            ) -> c_int {
                static REAL: AtomicUsize = AtomicUsize::new(0);
                // The gate's pool slot plus one (0: none yet or none to be had).
                static SLOT: AtomicUsize = AtomicUsize::new(0);
                let mut p = REAL.load(Ordering::Acquire);
                if p == 0 {
                    p = next(concat!(stringify!($name), "\0"));
                    if let Some(i) = gate::slot_of(p, stringify!($name)) {
                        SLOT.store(i + 1, Ordering::Release);
                    }
                    REAL.store(p, Ordering::Release);
                }
                let slot = SLOT.load(Ordering::Acquire).checked_sub(1);
                // SAFETY: libcuda's function of this name, with the caller's arguments.
                unsafe { gate::through(slot, p, [a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11]) }
            }
        )*
    };
}

/// The next definition of `name` (NUL-terminated) after this library:
/// libcuda's, for a program linked to it.
fn next(name: &str) -> usize {
    let Ok(c) = CStr::from_bytes_with_nul(name.as_bytes()) else { return 0 };
    let Some(real) = cu::real_dlsym() else { return 0 };
    // SAFETY: RTLD_NEXT from this library, a NUL-terminated name.
    let p = unsafe { real(libc::RTLD_NEXT, c.as_ptr()) } as usize;
    if p != 0 {
        p
    } else {
        cu::real(c)
    }
}

exported! {
    cuLaunchKernel cuLaunchKernel_ptsz cuLaunchKernelEx cuLaunchKernelEx_ptsz
    cuLaunchCooperativeKernel cuLaunchCooperativeKernel_ptsz cuGraphLaunch cuGraphLaunch_ptsz
    cuMemcpy cuMemcpy_ptds cuMemcpyAsync cuMemcpyAsync_ptsz
    cuMemcpyHtoD_v2 cuMemcpyHtoD_v2_ptds cuMemcpyDtoH_v2 cuMemcpyDtoH_v2_ptds
    cuMemcpyDtoD_v2 cuMemcpyDtoD_v2_ptds cuMemcpyHtoDAsync_v2 cuMemcpyHtoDAsync_v2_ptsz
    cuMemcpyDtoHAsync_v2 cuMemcpyDtoHAsync_v2_ptsz cuMemcpyDtoDAsync_v2 cuMemcpyDtoDAsync_v2_ptsz
    cuMemsetD8_v2 cuMemsetD8_v2_ptds cuMemsetD32_v2 cuMemsetD32_v2_ptds
    cuMemsetD8Async cuMemsetD8Async_ptsz cuMemsetD32Async cuMemsetD32Async_ptsz
    cuCtxSynchronize cuStreamSynchronize cuStreamSynchronize_ptsz cuEventSynchronize
    cuStreamQuery cuStreamQuery_ptsz cuEventQuery cuStreamWaitEvent cuStreamWaitEvent_ptsz
    cuEventRecord cuEventRecord_ptsz cuLaunchHostFunc cuLaunchHostFunc_ptsz
}

/// The exported allocation calls: served while fast swap is on.
///
/// # Safety
/// The driver's contract.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut u64, bytes: usize) -> c_int {
    // SAFETY: the caller's arguments.
    unsafe { table::mem_alloc(dptr, bytes) }
}

#[no_mangle]
pub extern "C" fn cuMemFree_v2(ptr: u64) -> c_int {
    table::mem_free(ptr)
}

/// # Safety
/// The driver's contract.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    p: *mut u64,
    pitch: *mut usize,
    w: usize,
    h: usize,
    e: c_uint,
) -> c_int {
    // SAFETY: the caller's arguments.
    unsafe { table::mem_alloc_pitch(p, pitch, w, h, e) }
}

/// # Safety
/// The driver's contract.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocManaged(p: *mut u64, bytes: usize, flags: c_uint) -> c_int {
    // SAFETY: the caller's arguments.
    unsafe { table::mem_alloc_managed(p, bytes, flags) }
}

/// # Safety
/// The driver's contract.
#[no_mangle]
pub unsafe extern "C" fn cuIpcGetMemHandle(h: *mut c_void, ptr: u64) -> c_int {
    // SAFETY: the caller's arguments.
    unsafe { table::ipc_get_mem_handle(h, ptr) }
}

/// The program's own VMM calls, exported for programs linked to libcuda
/// (see `program`).
///
/// # Safety
/// The driver's contract.
#[no_mangle]
pub unsafe extern "C" fn cuMemCreate(
    h: *mut u64,
    size: usize,
    prop: *const cu::AllocationProp,
    flags: u64,
) -> c_int {
    // SAFETY: the caller's arguments.
    unsafe { program::mem_create(h, size, prop, flags) }
}

#[no_mangle]
pub extern "C" fn cuMemRelease(h: u64) -> c_int {
    program::mem_release(h)
}

#[no_mangle]
pub extern "C" fn cuMemMap(va: u64, size: usize, offset: usize, h: u64, flags: u64) -> c_int {
    program::mem_map(va, size, offset, h, flags)
}

#[no_mangle]
pub extern "C" fn cuMemUnmap(va: u64, size: usize) -> c_int {
    program::mem_unmap(va, size)
}

/// # Safety
/// The driver's contract.
#[no_mangle]
pub unsafe extern "C" fn cuMemSetAccess(
    va: u64,
    size: usize,
    desc: *const cu::AccessDesc,
    count: usize,
) -> c_int {
    // SAFETY: the caller's arguments.
    unsafe { program::mem_set_access(va, size, desc, count) }
}

/// # Safety
/// The driver's contract.
#[no_mangle]
pub unsafe extern "C" fn cuMemExportToShareableHandle(
    out: *mut c_void,
    h: u64,
    kind: c_int,
    flags: u64,
) -> c_int {
    // SAFETY: the caller's arguments.
    unsafe { program::mem_export(out, h, kind, flags) }
}

/// # Safety
/// The driver's contract.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetAllocationPropertiesFromHandle(
    prop: *mut cu::AllocationProp,
    h: u64,
) -> c_int {
    // SAFETY: the caller's arguments.
    unsafe { program::mem_props(prop, h) }
}

/// # Safety
/// The driver's contract.
#[no_mangle]
pub unsafe extern "C" fn cuMemRetainAllocationHandle(out: *mut u64, va: *mut c_void) -> c_int {
    // SAFETY: the caller's arguments.
    unsafe { program::mem_retain(out, va) }
}

/// # Safety
/// The driver's contract.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(p: *mut u64, bytes: usize, stream: *mut c_void) -> c_int {
    // SAFETY: the caller's arguments.
    unsafe { table::mem_alloc_async(p, bytes, stream) }
}

#[no_mangle]
pub extern "C" fn cuMemFreeAsync(p: u64, stream: *mut c_void) -> c_int {
    table::mem_free_async(p, stream)
}
