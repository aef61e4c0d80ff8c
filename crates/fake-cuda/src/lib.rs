//! A fake `libcuda.so.1`: the CUDA driver's checkpoint API, modelled on what
//! driver r580 does on an H200 (`docs/design/fakes.md`), plus the few driver calls
//! `fake-workload` needs to be a "CUDA program". State is shared through
//! `$GPUSNAP_FAKE_DIR` (see `gpusnap-fake-common`).
//!
//! This file is the C boundary only: it checks pointers and argument structs
//! (with the real driver's layouts), runs `driver`, and never lets a panic
//! cross into C (`CUDA_ERROR_UNKNOWN` instead).

mod driver;
mod moved;
mod vmm;

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

use driver::Call;
use gpusnap_fake_common::codes::{
    self, CuResult, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_UNKNOWN, CUDA_SUCCESS,
};
use gpusnap_fake_common::state::GpuPair;

pub type CUresult = c_int;
pub type CUdevice = c_int;
pub type CUdeviceptr = u64;
/// Opaque to callers; the fake hands out small non-null tokens.
pub type CUcontext = *mut c_void;

/// `CUuuid`: 16 raw bytes.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUuuid {
    pub bytes: [u8; 16],
}

#[repr(C)]
pub struct CUcheckpointLockArgs {
    /// 0: no timeout.
    pub timeout_ms: c_uint,
    pub reserved0: c_uint,
    pub reserved1: [u64; 7],
}

#[repr(C)]
pub struct CUcheckpointCheckpointArgs {
    pub reserved: [u64; 8],
}

#[repr(C)]
pub struct CUcheckpointUnlockArgs {
    pub reserved: [u64; 8],
}

#[repr(C)]
pub struct CUcheckpointGpuPair {
    pub old_uuid: CUuuid,
    pub new_uuid: CUuuid,
}

/// The 13.0-13.2 layout: `char reserved[52 - sizeof(CUcheckpointGpuPair*)]`.
#[repr(C)]
pub struct CUcheckpointRestoreArgs {
    pub gpu_pairs: *const CUcheckpointGpuPair,
    pub gpu_pairs_count: c_uint,
    pub reserved: [c_char; 44],
    pub reserved1: u64,
}

const _: () = assert!(std::mem::size_of::<CUcheckpointLockArgs>() == 64);
const _: () = assert!(std::mem::size_of::<CUcheckpointCheckpointArgs>() == 64);
const _: () = assert!(std::mem::size_of::<CUcheckpointUnlockArgs>() == 64);
const _: () = assert!(std::mem::size_of::<CUcheckpointRestoreArgs>() == 64);
const _: () = assert!(std::mem::size_of::<CUcheckpointGpuPair>() == 32);

/// Runs `f`, turning a panic into `CUDA_ERROR_UNKNOWN`: unwinding into C is
/// undefined behaviour.
fn ffi(f: impl FnOnce() -> Result<(), CuResult>) -> CUresult {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(rc)) => rc,
        Err(_) => CUDA_ERROR_UNKNOWN,
    }
}

/// Writes `value` through a caller's out-pointer; `CUDA_ERROR_INVALID_VALUE`
/// for NULL, as the driver answers.
///
/// # Safety
/// `out` must be NULL or valid for a write of `T`.
unsafe fn put<T>(out: *mut T, value: T) -> Result<(), CuResult> {
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: not NULL, and the caller promises it is valid for a write.
    unsafe { out.write_unaligned(value) };
    Ok(())
}

/// Reads an optional argument struct; the driver rejects nonzero reserved
/// fields (an assumption: not measured, but strictness here catches callers
/// that pass garbage).
///
/// # Safety
/// `args` must be NULL or point to a readable `T`.
unsafe fn read_args<'a, T>(args: *const T) -> Option<&'a T> {
    // SAFETY: NULL or readable, as the caller promises; the reference does
    // not outlive the C call it was made in.
    unsafe { args.as_ref() }
}

fn reserved_zero(words: &[u64]) -> Result<(), CuResult> {
    if words.iter().all(|&w| w == 0) {
        Ok(())
    } else {
        Err(CUDA_ERROR_INVALID_VALUE)
    }
}

#[no_mangle]
pub extern "C" fn cuInit(flags: c_uint) -> CUresult {
    ffi(|| driver::init(flags))
}

/// # Safety
/// `version` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    ffi(|| {
        let v = driver::driver_version()?;
        // SAFETY: the caller's out-pointer, NULL or writable.
        unsafe { put(version, v) }
    })
}

/// # Safety
/// `out` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(error: CUresult, out: *mut *const c_char) -> CUresult {
    // SAFETY: the caller's out-pointer, NULL or writable.
    ffi(|| unsafe { put_error_text(out, codes::error_name(error)) })
}

/// # Safety
/// `out` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(error: CUresult, out: *mut *const c_char) -> CUresult {
    // SAFETY: the caller's out-pointer, NULL or writable.
    ffi(|| unsafe { put_error_text(out, codes::error_string(error)) })
}

/// Like the driver: an unknown code gets NULL and `CUDA_ERROR_INVALID_VALUE`.
///
/// # Safety
/// `out` must be NULL or writable.
unsafe fn put_error_text(out: *mut *const c_char, text: Option<&'static str>) -> Result<(), CuResult> {
    let ptr = text.map_or(std::ptr::null(), |t| t.as_ptr().cast());
    // SAFETY: the caller's out-pointer, NULL or writable.
    unsafe { put(out, ptr) }?;
    text.map(|_| ()).ok_or(CUDA_ERROR_INVALID_VALUE)
}

// ---------------------------------------------------------------------------
// The checkpoint API.

/// # Safety
/// `args` must be NULL or point to a `CUcheckpointLockArgs`.
#[no_mangle]
pub unsafe extern "C" fn cuCheckpointProcessLock(pid: c_int, args: *const CUcheckpointLockArgs) -> CUresult {
    ffi(|| {
        // SAFETY: NULL or a lock-args struct, as the caller promises.
        let args = unsafe { read_args(args) };
        let timeout = match args {
            None => Ok(0),
            Some(a) => reserved_zero(&a.reserved1)
                .and(reserved_zero(&[u64::from(a.reserved0)]))
                .map(|()| a.timeout_ms),
        };
        driver::checkpoint_call(Call::Lock, pid, timeout, driver::lock)
    })
}

/// # Safety
/// `args` must be NULL or point to a `CUcheckpointCheckpointArgs`.
#[no_mangle]
pub unsafe extern "C" fn cuCheckpointProcessCheckpoint(
    pid: c_int,
    args: *const CUcheckpointCheckpointArgs,
) -> CUresult {
    ffi(|| {
        // SAFETY: NULL or a checkpoint-args struct, as the caller promises.
        let ok = unsafe { read_args(args) }.map_or(Ok(()), |a| reserved_zero(&a.reserved));
        driver::checkpoint_call(Call::Checkpoint, pid, ok, |s, p, ()| driver::checkpoint(s, p))
    })
}

/// # Safety
/// `args` must be NULL or point to a `CUcheckpointRestoreArgs` whose
/// `gpu_pairs` holds `gpu_pairs_count` pairs.
#[no_mangle]
pub unsafe extern "C" fn cuCheckpointProcessRestore(
    pid: c_int,
    args: *const CUcheckpointRestoreArgs,
) -> CUresult {
    ffi(|| {
        // SAFETY: NULL or a restore-args struct, as the caller promises.
        let pairs = match unsafe { read_args(args) } {
            None => Ok(None),
            // SAFETY: the pairs array is the caller's, `gpu_pairs_count` long.
            Some(a) => unsafe { gpu_pairs(a) },
        };
        driver::checkpoint_call(Call::Restore, pid, pairs, driver::restore)
    })
}

/// The pairs of a restore-args struct; `None` when it names none.
///
/// # Safety
/// `a.gpu_pairs` must be NULL or point to `a.gpu_pairs_count` pairs.
unsafe fn gpu_pairs(a: &CUcheckpointRestoreArgs) -> Result<Option<Vec<GpuPair>>, CuResult> {
    if a.reserved.iter().any(|&b| b != 0) || a.reserved1 != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    match (a.gpu_pairs.is_null(), a.gpu_pairs_count) {
        (true, 0) => Ok(None),
        (true, _) | (false, 0) => Err(CUDA_ERROR_INVALID_VALUE),
        (false, n) => {
            // SAFETY: non-NULL and `n` pairs long, as the caller promises.
            let pairs = unsafe { std::slice::from_raw_parts(a.gpu_pairs, n as usize) };
            Ok(Some(pairs.iter().map(|p| (p.old_uuid.bytes, p.new_uuid.bytes)).collect()))
        }
    }
}

/// # Safety
/// `args` must be NULL or point to a `CUcheckpointUnlockArgs`.
#[no_mangle]
pub unsafe extern "C" fn cuCheckpointProcessUnlock(
    pid: c_int,
    args: *const CUcheckpointUnlockArgs,
) -> CUresult {
    ffi(|| {
        // SAFETY: NULL or an unlock-args struct, as the caller promises.
        let ok = unsafe { read_args(args) }.map_or(Ok(()), |a| reserved_zero(&a.reserved));
        driver::checkpoint_call(Call::Unlock, pid, ok, |s, p, ()| driver::unlock(s, p))
    })
}

/// # Safety
/// `state` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn cuCheckpointProcessGetState(pid: c_int, state: *mut c_int) -> CUresult {
    ffi(|| {
        let out = if state.is_null() { Err(CUDA_ERROR_INVALID_VALUE) } else { Ok(()) };
        let value = driver::checkpoint_call(Call::GetState, pid, out, |s, p, ()| driver::get_state(s, p))?;
        // SAFETY: checked non-NULL above; the caller promises it is writable.
        unsafe { put(state, value) }
    })
}

/// # Safety
/// `tid` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn cuCheckpointProcessGetRestoreThreadId(pid: c_int, tid: *mut c_int) -> CUresult {
    ffi(|| {
        let out = if tid.is_null() { Err(CUDA_ERROR_INVALID_VALUE) } else { Ok(()) };
        let value =
            driver::checkpoint_call(Call::GetRestoreTid, pid, out, |s, p, ()| driver::get_restore_tid(s, p))?;
        // SAFETY: checked non-NULL above; the caller promises it is writable.
        unsafe { put(tid, value) }
    })
}

// ---------------------------------------------------------------------------
// The workload API.

/// # Safety
/// `count` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    ffi(|| {
        let n = driver::device_count()?;
        // SAFETY: the caller's out-pointer, NULL or writable.
        unsafe { put(count, n) }
    })
}

/// # Safety
/// `device` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) -> CUresult {
    ffi(|| {
        let d = driver::device_get(ordinal)?;
        // SAFETY: the caller's out-pointer, NULL or writable.
        unsafe { put(device, d) }
    })
}

/// # Safety
/// `ctx` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn cuCtxCreate_v2(ctx: *mut CUcontext, _flags: c_uint, device: CUdevice) -> CUresult {
    ffi(|| {
        if ctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        driver::ctx_create(device)?;
        // A token, never dereferenced: one past the device so it is not NULL.
        let token = (device as usize + 1) as CUcontext;
        // SAFETY: checked non-NULL above; the caller promises it is writable.
        unsafe { put(ctx, token) }
    })
}

/// # Safety
/// `ptr` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(ptr: *mut CUdeviceptr, bytes: usize) -> CUresult {
    ffi(|| {
        if ptr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = driver::mem_alloc(bytes as u64)?;
        // SAFETY: checked non-NULL above; the caller promises it is writable.
        unsafe { put(ptr, p) }
    })
}

#[no_mangle]
pub extern "C" fn cuMemFree_v2(ptr: CUdeviceptr) -> CUresult {
    ffi(|| driver::mem_free(ptr))
}

/// The stream-ordered allocator: an ordinary allocation in the fake (one
/// queue per process; no pool keeps freed memory).
///
/// # Safety
/// `ptr` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(
    ptr: *mut CUdeviceptr,
    bytes: usize,
    _stream: *mut c_void,
) -> CUresult {
    // SAFETY: the caller's arguments.
    unsafe { cuMemAlloc_v2(ptr, bytes) }
}

#[no_mangle]
pub extern "C" fn cuMemFreeAsync(ptr: CUdeviceptr, _stream: *mut c_void) -> CUresult {
    ffi(|| driver::mem_free(ptr))
}

/// # Safety
/// `src` must be readable for `bytes` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, bytes: usize) -> CUresult {
    ffi(|| {
        if bytes == 0 {
            return Ok(());
        }
        if src.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-NULL and readable for `bytes`, as the caller promises;
        // copied out before the call may block.
        let data = unsafe { std::slice::from_raw_parts(src.cast::<u8>(), bytes) }.to_vec();
        driver::memcpy_htod(dst, &data)
    })
}

/// # Safety
/// `dst` must be writable for `bytes` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, bytes: usize) -> CUresult {
    ffi(|| {
        if bytes == 0 {
            return Ok(());
        }
        if dst.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let data = driver::memcpy_dtoh(src, bytes)?;
        // SAFETY: non-NULL and writable for `bytes`, as the caller promises;
        // `data` is exactly `bytes` long and cannot overlap caller memory.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst.cast::<u8>(), bytes) };
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    ffi(driver::ctx_synchronize)
}

/// Every stream is the process's one queue in the fake.
#[no_mangle]
pub extern "C" fn cuStreamSynchronize(_stream: *mut c_void) -> CUresult {
    ffi(driver::ctx_synchronize)
}

#[no_mangle]
pub extern "C" fn cuStreamQuery(_stream: *mut c_void) -> CUresult {
    ffi(driver::stream_query)
}

/// A kernel of the fake runs for `grid_x` ms: it queues that much work
/// (as `fakeEnqueueWork`) and touches no memory.
///
/// # Safety
/// The pointers are not read.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn cuLaunchKernel(
    f: *mut c_void,
    grid_x: c_uint,
    _grid_y: c_uint,
    _grid_z: c_uint,
    _block_x: c_uint,
    _block_y: c_uint,
    _block_z: c_uint,
    _shared: c_uint,
    _stream: *mut c_void,
    _params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    ffi(|| {
        if f.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        driver::enqueue_work(grid_x)
    })
}

/// Not a CUDA call: queues `ms` of GPU work for the calling process, so that
/// tests can make a lock wait (or time out) as queued kernels make it do.
#[no_mangle]
pub extern "C" fn fakeEnqueueWork(ms: c_uint) -> CUresult {
    ffi(|| driver::enqueue_work(ms))
}

/// Registers the calling process's host copy (see `docs/design/fakes.md`): its
/// checkpoints write a known pattern to `[addr, addr + len)` of its memory
/// and its restores read it back. Needs a context.
#[no_mangle]
pub extern "C" fn fakeRegisterHostCopy(addr: u64, len: u64) -> CUresult {
    ffi(|| driver::register_host_copy(addr, len))
}

/// Makes the calling thread its process's restore thread, the one
/// `cuCheckpointProcessGetRestoreThreadId` answers. Needs a context.
#[no_mangle]
pub extern "C" fn fakeRegisterRestoreThread() -> CUresult {
    ffi(driver::register_restore_thread)
}

/// Not a CUDA call: the calling process's context takes the sticky error
/// `rc` (0: 700, `CUDA_ERROR_ILLEGAL_ADDRESS`), as after a kernel that
/// faulted. From then on every call of the process answers it, and so do
/// a lock, checkpoint, restore or unlock of it. Returns `rc`.
#[no_mangle]
pub extern "C" fn fakeFault(rc: c_int) -> CUresult {
    ffi(|| driver::fault(rc))
}
