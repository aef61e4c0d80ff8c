//! A fake `libnvidia-ml.so.1`: the NVML calls `nvml-wrapper` 0.13 makes for
//! gpusnap (init, driver versions, devices by index and uuid, their names,
//! memory, compute processes and persistence mode), answered from the GPUs
//! in `$GPUSNAP_FAKE_DIR` that the fake `libcuda.so.1` allocates from.
//!
//! `nvml-wrapper-sys` resolves every symbol lazily (a missing one fails only
//! the call that needs it), so nothing beyond these has to exist. Names and
//! layouts are those of `nvml-wrapper-sys` 0.10: `_v2` init, count, handle
//! and memory calls, `_v3` process listing with `nvmlProcessInfo_v2_t`.

// The C names of NVML's types, so the exports read like `nvml.h`.
#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU32, Ordering};

use gpusnap_fake_common::{Config, State, Store};

pub type nvmlReturn_t = c_uint;
/// An opaque handle: a pointer into [`HANDLES`].
pub type nvmlDevice_t = *mut c_void;
pub type nvmlEnableState_t = c_uint;

pub const NVML_SUCCESS: nvmlReturn_t = 0;
pub const NVML_ERROR_UNINITIALIZED: nvmlReturn_t = 1;
pub const NVML_ERROR_INVALID_ARGUMENT: nvmlReturn_t = 2;
pub const NVML_ERROR_NOT_FOUND: nvmlReturn_t = 6;
pub const NVML_ERROR_INSUFFICIENT_SIZE: nvmlReturn_t = 7;
pub const NVML_ERROR_ARGUMENT_VERSION_MISMATCH: nvmlReturn_t = 25;
pub const NVML_ERROR_UNKNOWN: nvmlReturn_t = 999;

pub const NVML_FEATURE_ENABLED: nvmlEnableState_t = 1;

/// `nvmlMemory_v2_t`.
#[repr(C)]
pub struct nvmlMemory_v2_t {
    pub version: c_uint,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}

/// `NVML_STRUCT_VERSION(Memory, 2)`: the size in the low bits, 2 in the top
/// byte; what `nvml-wrapper` puts in `version`.
const MEMORY_V2_VERSION: c_uint = (std::mem::size_of::<nvmlMemory_v2_t>() | (2 << 24)) as c_uint;

/// `nvmlProcessInfo_t` (= `nvmlProcessInfo_v2_t`) as the `_v3` listing fills it.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct nvmlProcessInfo_t {
    pub pid: c_uint,
    pub used_gpu_memory: u64,
    pub gpu_instance_id: c_uint,
    pub compute_instance_id: c_uint,
}

const _: () = assert!(std::mem::size_of::<nvmlMemory_v2_t>() == 40);
const _: () = assert!(std::mem::size_of::<nvmlProcessInfo_t>() == 24);

/// "No MIG instance" in the process info ids.
const NO_INSTANCE: c_uint = 0xFFFF_FFFF;

/// The most GPUs a config may list and still get handles.
const MAX_GPUS: usize = 64;
/// Device handles point at these bytes (never read or written): the offset
/// from the start is the index, and a pointer elsewhere is no handle.
static HANDLES: [u8; MAX_GPUS] = [0; MAX_GPUS];

/// `nvmlInit` calls not yet matched by `nvmlShutdown`, as NVML counts them.
static INIT_COUNT: AtomicU32 = AtomicU32::new(0);

type NvmlResult<T> = Result<T, nvmlReturn_t>;

/// Runs `f` unless NVML is uninitialised; a panic becomes
/// `NVML_ERROR_UNKNOWN`, since unwinding into C is undefined behaviour.
fn ffi(f: impl FnOnce() -> NvmlResult<()>) -> nvmlReturn_t {
    if INIT_COUNT.load(Ordering::SeqCst) == 0 {
        return NVML_ERROR_UNINITIALIZED;
    }
    ffi_any(f)
}

fn ffi_any(f: impl FnOnce() -> NvmlResult<()>) -> nvmlReturn_t {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => NVML_SUCCESS,
        Ok(Err(rc)) => rc,
        Err(_) => NVML_ERROR_UNKNOWN,
    }
}

/// The fake failed itself (a bad config or state file): say why on stderr.
fn io_fail(e: io::Error) -> nvmlReturn_t {
    eprintln!("gpusnap-fake-nvml: {e}");
    NVML_ERROR_UNKNOWN
}

fn config() -> NvmlResult<Config> {
    Store::from_env().load_config().map_err(io_fail)
}

/// Runs `f` on the GPU behind `device` with the current config and state.
fn with_gpu<T>(device: nvmlDevice_t, f: impl FnOnce(&Config, &State, u32) -> T) -> NvmlResult<T> {
    let index = (device as usize).wrapping_sub(HANDLES.as_ptr() as usize);
    if index >= MAX_GPUS {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    Store::from_env()
        .transact(|t| {
            if index >= t.config.gpus.len() {
                return Err(NVML_ERROR_INVALID_ARGUMENT);
            }
            Ok(f(&t.config, &t.state, index as u32))
        })
        .map_err(io_fail)?
}

fn handle(index: usize) -> NvmlResult<nvmlDevice_t> {
    if index >= MAX_GPUS {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    Ok(HANDLES.as_ptr().wrapping_add(index).cast_mut().cast())
}

/// Writes through an out-pointer; `NVML_ERROR_INVALID_ARGUMENT` for NULL.
///
/// # Safety
/// `out` must be NULL or valid for a write of `T`.
unsafe fn put<T>(out: *mut T, value: T) -> NvmlResult<()> {
    if out.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: not NULL, and the caller promises it is valid for a write.
    unsafe { out.write_unaligned(value) };
    Ok(())
}

/// Copies `text` and its NUL into the caller's buffer of `len` bytes;
/// `NVML_ERROR_INSUFFICIENT_SIZE` when it does not fit.
///
/// # Safety
/// `buf` must be NULL or writable for `len` bytes.
unsafe fn put_str(buf: *mut c_char, len: c_uint, text: &str) -> NvmlResult<()> {
    if buf.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    if text.len() + 1 > len as usize {
        return Err(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    // SAFETY: `buf` is writable for `len` bytes and text plus NUL fit in it.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), text.len());
        buf.add(text.len()).write(0);
    }
    Ok(())
}

#[no_mangle]
pub extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    ffi_any(|| {
        config()?;
        INIT_COUNT.fetch_add(1, Ordering::SeqCst);
        Ok(())
    })
}

/// The flags (no GPUs, no attach) change nothing for the fake.
#[no_mangle]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nvmlReturn_t {
    nvmlInit_v2()
}

#[no_mangle]
pub extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    ffi(|| {
        INIT_COUNT
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .map(|_| ())
            .map_err(|_| NVML_ERROR_UNINITIALIZED)
    })
}

/// NVML's own texts for its codes; works before init, as the real one does.
#[no_mangle]
pub extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    let text: &'static CStr = match result {
        0 => c"Success",
        1 => c"Uninitialized",
        2 => c"Invalid Argument",
        3 => c"Not Supported",
        4 => c"Insufficient Permissions",
        5 => c"Already Initialized",
        6 => c"Not Found",
        7 => c"Insufficient Size",
        9 => c"Driver Not Loaded",
        25 => c"Argument version mismatch",
        _ => c"Unknown Error",
    };
    text.as_ptr()
}

/// # Safety
/// `version` must be NULL or writable for `length` bytes.
#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(version: *mut c_char, length: c_uint) -> nvmlReturn_t {
    ffi(|| {
        let text = config()?.driver_string;
        // SAFETY: the caller's buffer, NULL or `length` bytes.
        unsafe { put_str(version, length, &text) }
    })
}

/// # Safety
/// `version` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(version: *mut c_int) -> nvmlReturn_t {
    ffi(|| {
        let v = config()?.driver_version;
        // SAFETY: the caller's out-pointer, NULL or writable.
        unsafe { put(version, v) }
    })
}

/// # Safety
/// `count` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> nvmlReturn_t {
    ffi(|| {
        let n = config()?.gpus.len().min(MAX_GPUS) as c_uint;
        // SAFETY: the caller's out-pointer, NULL or writable.
        unsafe { put(count, n) }
    })
}

/// # Safety
/// `device` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    ffi(|| {
        if index as usize >= config()?.gpus.len() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let h = handle(index as usize)?;
        // SAFETY: the caller's out-pointer, NULL or writable.
        unsafe { put(device, h) }
    })
}

/// # Safety
/// `uuid` must be NULL or a NUL-terminated string; `device` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    ffi(|| {
        if uuid.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-NULL and NUL-terminated, as the caller promises.
        let wanted = unsafe { CStr::from_ptr(uuid) }.to_bytes();
        let index =
            config()?.gpus.iter().position(|g| g.uuid.as_bytes() == wanted).ok_or(NVML_ERROR_NOT_FOUND)?;
        let h = handle(index)?;
        // SAFETY: the caller's out-pointer, NULL or writable.
        unsafe { put(device, h) }
    })
}

/// # Safety
/// `uuid` must be NULL or writable for `length` bytes.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: nvmlDevice_t,
    uuid: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let text = with_gpu(device, |cfg, _, gpu| cfg.gpus[gpu as usize].uuid.clone())?;
        // SAFETY: the caller's buffer, NULL or `length` bytes.
        unsafe { put_str(uuid, length, &text) }
    })
}

/// # Safety
/// `name` must be NULL or writable for `length` bytes.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: nvmlDevice_t,
    name: *mut c_char,
    length: c_uint,
) -> nvmlReturn_t {
    ffi(|| {
        let text = with_gpu(device, |cfg, _, gpu| cfg.gpus[gpu as usize].name.clone())?;
        // SAFETY: the caller's buffer, NULL or `length` bytes.
        unsafe { put_str(name, length, &text) }
    })
}

/// # Safety
/// `index` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetIndex(device: nvmlDevice_t, index: *mut c_uint) -> nvmlReturn_t {
    ffi(|| {
        let i = with_gpu(device, |_, _, gpu| gpu)?;
        // SAFETY: the caller's out-pointer, NULL or writable.
        unsafe { put(index, i) }
    })
}

/// Used is what resident processes hold there (allocations plus contexts);
/// nothing is reserved.
///
/// # Safety
/// `memory` must be NULL or point to a writable `nvmlMemory_v2_t`.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    ffi(|| {
        if memory.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        // SAFETY: non-NULL and a memory struct, as the caller promises.
        let version = unsafe { std::ptr::addr_of!((*memory).version).read_unaligned() };
        if version != MEMORY_V2_VERSION {
            return Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        let info = with_gpu(device, |cfg, st, gpu| {
            let total = State::total_bytes(cfg, gpu);
            let used = st.nvml_used_bytes(cfg, gpu, gpusnap_fake_common::now_ms()).min(total);
            nvmlMemory_v2_t { version, total, reserved: 0, free: total - used, used }
        })?;
        // SAFETY: checked non-NULL above; the caller promises it is writable.
        unsafe { put(memory, info) }
    })
}

/// NVML's two-step listing: with too small a `count` (0 and NULL to ask),
/// it answers `NVML_ERROR_INSUFFICIENT_SIZE` with the count needed.
///
/// # Safety
/// `count` must be NULL or read-writable; `infos` NULL or writable for
/// `*count` entries.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    ffi(|| {
        if count.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let procs =
            with_gpu(device, |cfg, st, gpu| st.nvml_gpu_processes(cfg, gpu, gpusnap_fake_common::now_ms()))?;
        // SAFETY: non-NULL and read-writable, as the caller promises.
        let room = unsafe { count.read_unaligned() } as usize;
        // SAFETY: as above.
        unsafe { count.write_unaligned(procs.len() as c_uint) };
        if room < procs.len() {
            return Err(NVML_ERROR_INSUFFICIENT_SIZE);
        }
        if procs.is_empty() {
            return Ok(());
        }
        if infos.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        for (i, (pid, bytes)) in procs.into_iter().enumerate() {
            let info = nvmlProcessInfo_t {
                pid: pid as c_uint,
                used_gpu_memory: bytes,
                gpu_instance_id: NO_INSTANCE,
                compute_instance_id: NO_INSTANCE,
            };
            // SAFETY: `i` < `procs.len()` <= `room`, the entries the caller
            // promises are writable.
            unsafe { infos.add(i).write_unaligned(info) };
        }
        Ok(())
    })
}

/// Always enabled, as on the servers gpusnap targets.
///
/// # Safety
/// `mode` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPersistenceMode(
    device: nvmlDevice_t,
    mode: *mut nvmlEnableState_t,
) -> nvmlReturn_t {
    ffi(|| {
        with_gpu(device, |_, _, _| ())?;
        // SAFETY: the caller's out-pointer, NULL or writable.
        unsafe { put(mode, NVML_FEATURE_ENABLED) }
    })
}
