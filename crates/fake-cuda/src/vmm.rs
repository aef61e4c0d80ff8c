//! The fake's virtual memory management calls, pinned host memory, context
//! queries and `cuGetProcAddress`: what gpusnap's preload library calls to
//! serve a program's allocations (see `gpusnap_fake_common::vmm` for the
//! model). The C boundary and the few lines of behaviour together: each call
//! is one transaction on the process's entry.

use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::Mutex;

use crate::driver::{self, as_workload, current_device, entry, io_fail};
use crate::{ffi, put, CUcontext, CUdevice, CUdeviceptr, CUresult};
use gpusnap_fake_common::codes::*;
use gpusnap_fake_common::vmm::GRANULARITY;

/// `CUmemLocation`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUmemLocation {
    pub kind: c_int,
    pub id: c_int,
}

/// `CUmemAllocationProp` (32 bytes).
#[repr(C)]
pub struct CUmemAllocationProp {
    pub kind: c_int,
    pub requested_handle_types: c_int,
    pub location: CUmemLocation,
    pub win32_handle_meta_data: *mut c_void,
    pub alloc_flags: [u8; 8],
}

/// `CUmemAccessDesc` (12 bytes).
#[repr(C)]
pub struct CUmemAccessDesc {
    pub location: CUmemLocation,
    pub flags: c_int,
}

const _: () = assert!(std::mem::size_of::<CUmemAllocationProp>() == 32);
const _: () = assert!(std::mem::size_of::<CUmemAccessDesc>() == 12);

/// `CU_MEM_ALLOCATION_TYPE_PINNED`, `CU_MEM_LOCATION_TYPE_DEVICE`.
const ALLOCATION_PINNED: c_int = 1;
const LOCATION_DEVICE: c_int = 1;

/// The device of a location, checked against the config.
fn device_of(loc: CUmemLocation) -> Result<u32, CuResult> {
    if loc.kind != LOCATION_DEVICE {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let gpu = u32::try_from(loc.id).map_err(|_| CUDA_ERROR_INVALID_DEVICE)?;
    as_workload(None, |_, t, _| {
        if (gpu as usize) < t.config.gpus.len() {
            Ok(gpu)
        } else {
            Err(CUDA_ERROR_INVALID_DEVICE)
        }
    })
}

/// # Safety
/// `ptr` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut CUdeviceptr,
    size: usize,
    _alignment: usize,
    addr: CUdeviceptr,
    flags: u64,
) -> CUresult {
    ffi(|| {
        if ptr.is_null() || flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let va = as_workload(None, |_, t, me| entry(t, me)?.reserve(size as u64, addr))?;
        // SAFETY: checked non-NULL above; the caller promises it is writable.
        unsafe { put(ptr, va) }
    })
}

#[no_mangle]
pub extern "C" fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) -> CUresult {
    ffi(|| as_workload(None, |_, t, me| entry(t, me)?.address_free(ptr, size as u64)))
}

/// # Safety
/// `handle` must be NULL or writable; `prop` NULL or a readable prop.
#[no_mangle]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut u64,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: u64,
) -> CUresult {
    ffi(|| {
        // SAFETY: NULL or readable, as the caller promises.
        let prop = unsafe { prop.as_ref() }.ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if handle.is_null() || flags != 0 || prop.kind != ALLOCATION_PINNED {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let gpu = device_of(prop.location)?;
        let h = as_workload(None, |_, t, me| t.state.create(&t.config, me, gpu, size as u64))?;
        // SAFETY: checked non-NULL above; the caller promises it is writable.
        unsafe { put(handle, h) }
    })
}

#[no_mangle]
pub extern "C" fn cuMemRelease(handle: u64) -> CUresult {
    ffi(|| as_workload(None, |_, t, me| entry(t, me)?.release(handle)))
}

#[no_mangle]
pub extern "C" fn cuMemMap(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: u64,
    flags: u64,
) -> CUresult {
    ffi(|| {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        as_workload(None, |_, t, me| entry(t, me)?.map(ptr, size as u64, offset as u64, handle))
    })
}

/// The contents go with the mapping (the fake keeps data per mapped
/// address): gpusnap copies memory out before it unmaps.
#[no_mangle]
pub extern "C" fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    ffi(|| {
        as_workload(None, |store, t, me| {
            entry(t, me)?.unmap(ptr, size as u64)?;
            store.drop_data(me, ptr).map_err(io_fail)
        })
    })
}

/// # Safety
/// `desc` must point to `count` descriptors.
#[no_mangle]
pub unsafe extern "C" fn cuMemSetAccess(
    ptr: CUdeviceptr,
    size: usize,
    desc: *const CUmemAccessDesc,
    count: usize,
) -> CUresult {
    ffi(|| {
        if desc.is_null() || count == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: non-NULL and `count` long, as the caller promises.
        let descs = unsafe { std::slice::from_raw_parts(desc, count) };
        for d in descs {
            device_of(d.location)?;
        }
        as_workload(None, |_, t, me| {
            if entry(t, me)?.is_mapped(ptr, size as u64) {
                Ok(())
            } else {
                Err(CUDA_ERROR_INVALID_VALUE)
            }
        })
    })
}

/// # Safety
/// `granularity` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    granularity: *mut usize,
    prop: *const CUmemAllocationProp,
    _option: c_int,
) -> CUresult {
    ffi(|| {
        if prop.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller's out-pointer, NULL or writable.
        unsafe { put(granularity, GRANULARITY as usize) }
    })
}

/// Pinned host allocations of this process, by address (their lengths).
static HOST: Mutex<BTreeMap<usize, usize>> = Mutex::new(BTreeMap::new());

/// # Safety
/// `pp` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(pp: *mut *mut c_void, bytes: usize, _flags: c_uint) -> CUresult {
    ffi(|| {
        if pp.is_null() || bytes == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        current_device()?;
        // SAFETY: a fresh anonymous private mapping.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        HOST.lock().map_err(|_| CUDA_ERROR_UNKNOWN)?.insert(p as usize, bytes);
        // SAFETY: checked non-NULL above; the caller promises it is writable.
        unsafe { put(pp, p) }
    })
}

#[no_mangle]
pub extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    ffi(|| {
        let len = HOST
            .lock()
            .map_err(|_| CUDA_ERROR_UNKNOWN)?
            .remove(&(p as usize))
            .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        // SAFETY: a mapping cuMemHostAlloc made, `len` long, unmapped once.
        unsafe { libc::munmap(p, len) };
        Ok(())
    })
}

/// Host ranges page-locked with `cuMemHostRegister`, by address (lengths).
static REGISTERED: Mutex<BTreeMap<usize, usize>> = Mutex::new(BTreeMap::new());

/// `cuMemHostRegister_v2`: the range must be mapped (the real driver pins
/// its pages) and not overlap one registered already.
#[no_mangle]
pub extern "C" fn cuMemHostRegister_v2(p: *mut c_void, bytes: usize, _flags: c_uint) -> CUresult {
    ffi(|| {
        if p.is_null() || bytes == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        current_device()?;
        let start = p as usize;
        let mut reg = REGISTERED.lock().map_err(|_| CUDA_ERROR_UNKNOWN)?;
        if reg.range(..start + bytes).next_back().is_some_and(|(a, l)| a + l > start) {
            return Err(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
        }
        // Every page must be mapped: touching one that is not would fault,
        // so ask the kernel (mincore fails with ENOMEM on a hole).
        let page = 4096;
        let first = start & !(page - 1);
        let pages = (start + bytes - first).div_ceil(page);
        let mut vec = vec![0u8; pages];
        // SAFETY: a buffer of one byte per page of the range.
        if unsafe { libc::mincore(first as *mut c_void, pages * page, vec.as_mut_ptr()) } != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        reg.insert(start, bytes);
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuMemHostUnregister(p: *mut c_void) -> CUresult {
    ffi(|| {
        REGISTERED
            .lock()
            .map_err(|_| CUDA_ERROR_UNKNOWN)?
            .remove(&(p as usize))
            .map(|_| ())
            .ok_or(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED)
    })
}

/// # Safety
/// `ptr` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocManaged(ptr: *mut CUdeviceptr, bytes: usize, _flags: c_uint) -> CUresult {
    ffi(|| {
        if ptr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = driver::mem_alloc(bytes as u64)?;
        // SAFETY: checked non-NULL above; the caller promises it is writable.
        unsafe { put(ptr, p) }
    })
}

/// # Safety
/// `ctx` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut CUcontext) -> CUresult {
    ffi(|| {
        let d = driver::current_raw();
        let token = if d < 0 { std::ptr::null_mut() } else { (d as usize + 1) as CUcontext };
        // SAFETY: the caller's out-pointer, NULL or writable.
        unsafe { put(ctx, token) }
    })
}

#[no_mangle]
pub extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    ffi(|| {
        let token = ctx as usize;
        if token == 0 {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        driver::set_current(token as i32 - 1)
    })
}

/// # Safety
/// `device` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(device: *mut CUdevice) -> CUresult {
    ffi(|| {
        let d = current_device()? as CUdevice;
        // SAFETY: the caller's out-pointer, NULL or writable.
        unsafe { put(device, d) }
    })
}

/// `CUipcMemHandle`: 64 opaque bytes.
#[repr(C)]
pub struct CUipcMemHandle {
    pub reserved: [u8; 64],
}

/// `cuIpcGetMemHandle`: a handle for memory `cuMemAlloc` made; memory
/// mapped through the VMM API is refused, as the driver's legacy IPC
/// refuses it (`CUDA_ERROR_INVALID_VALUE`).
///
/// # Safety
/// `handle` must be NULL or writable for 64 bytes.
#[no_mangle]
pub unsafe extern "C" fn cuIpcGetMemHandle(handle: *mut CUipcMemHandle, ptr: CUdeviceptr) -> CUresult {
    ffi(|| {
        if handle.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        current_device()?;
        let base = as_workload(None, |_, t, me| {
            let p = entry(t, me)?;
            let (base, _) = p.locate(ptr, 1)?;
            if p.allocs.get(&base).is_some_and(|a| a.handle.is_some()) {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            Ok(base)
        })?;
        let mut h = CUipcMemHandle { reserved: [0; 64] };
        h.reserved[..8].copy_from_slice(&base.to_le_bytes());
        h.reserved[8..12].copy_from_slice(&std::process::id().to_le_bytes());
        // SAFETY: checked non-NULL above; the caller promises 64 writable bytes.
        unsafe { handle.write_unaligned(h) };
        Ok(())
    })
}

/// The fake's functions by the names `cuGetProcAddress` takes (without
/// version suffixes), for a version at or above the one that introduced
/// the `_v2` forms.
fn proc_address(name: &str) -> Option<usize> {
    Some(match name {
        "cuMemAlloc" => crate::cuMemAlloc_v2 as *const () as usize,
        "cuMemFree" => crate::cuMemFree_v2 as *const () as usize,
        "cuMemcpyHtoD" => crate::cuMemcpyHtoD_v2 as *const () as usize,
        "cuMemcpyDtoH" => crate::cuMemcpyDtoH_v2 as *const () as usize,
        "cuMemAllocManaged" => cuMemAllocManaged as *const () as usize,
        "cuIpcGetMemHandle" => cuIpcGetMemHandle as *const () as usize,
        "cuCtxSynchronize" => crate::cuCtxSynchronize as *const () as usize,
        "cuStreamSynchronize" => crate::cuStreamSynchronize as *const () as usize,
        "cuStreamQuery" => crate::cuStreamQuery as *const () as usize,
        "cuLaunchKernel" => crate::cuLaunchKernel as *const () as usize,
        "cuMemAllocAsync" => crate::cuMemAllocAsync as *const () as usize,
        "cuMemFreeAsync" => crate::cuMemFreeAsync as *const () as usize,
        "cuGetProcAddress" => cuGetProcAddress_v2 as *const () as usize,
        "cuInit" => crate::cuInit as *const () as usize,
        _ => return None,
    })
}

/// # Safety
/// `symbol` must be NULL or a C string; `pfn` and `status` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress_v2(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    _version: c_int,
    _flags: u64,
    status: *mut c_int,
) -> CUresult {
    ffi(|| {
        if symbol.is_null() || pfn.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: a C string, as the caller promises.
        let name = unsafe { CStr::from_ptr(symbol) }.to_str().map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
        let found = proc_address(name);
        if !status.is_null() {
            // SAFETY: non-NULL, writable as the caller promises.
            // CU_GET_PROC_ADDRESS_SUCCESS = 0, SYMBOL_NOT_FOUND = 1.
            unsafe { status.write_unaligned(if found.is_some() { 0 } else { 1 }) };
        }
        let f = found.ok_or(CUDA_ERROR_NOT_FOUND)?;
        // SAFETY: checked non-NULL above; the caller promises it is writable.
        unsafe { put(pfn, f as *mut c_void) }
    })
}

/// # Safety
/// As for [`cuGetProcAddress_v2`].
#[no_mangle]
pub unsafe extern "C" fn cuGetProcAddress(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
) -> CUresult {
    // SAFETY: the caller's arguments, passed on.
    unsafe { cuGetProcAddress_v2(symbol, pfn, version, flags, std::ptr::null_mut()) }
}
