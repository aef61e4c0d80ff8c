//! Raw types of the CUDA driver's checkpoint API (CUDA 12.8 - 13.x headers).
//!
//! Only `#[repr(C)]` layouts and function-pointer types live here; nothing in
//! this module is safe to call directly. See `driver.rs` for the wrapper.

use std::os::raw::{c_char, c_int, c_uint};

pub type CUresult = c_int;

/// `CUcheckpointLockArgs`: 64 bytes; `timeoutMs == 0` means no timeout.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct CUcheckpointLockArgs {
    pub timeout_ms: c_uint,
    pub reserved0: c_uint,
    pub reserved1: [u64; 7],
}

/// `CUuuid`: the 16 raw bytes of a GPU UUID.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CUuuid {
    pub bytes: [u8; 16],
}

/// `CUcheckpointGpuPair` (driver API 13000 and later).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct CUcheckpointGpuPair {
    pub old_uuid: CUuuid,
    pub new_uuid: CUuuid,
}

/// `CUcheckpointRestoreArgs` as of driver API 13000 - 13020: 64 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUcheckpointRestoreArgs {
    pub gpu_pairs: *const CUcheckpointGpuPair,
    pub gpu_pairs_count: c_uint,
    pub reserved: [c_char; 52 - std::mem::size_of::<*const CUcheckpointGpuPair>()],
    pub reserved1: u64,
}

/// Opaque argument structs the driver accepts as NULL.
pub type OpaqueArgs = std::ffi::c_void;

pub type FnInit = unsafe extern "C" fn(flags: c_uint) -> CUresult;
pub type FnDriverGetVersion = unsafe extern "C" fn(version: *mut c_int) -> CUresult;
pub type FnGetErrorName = unsafe extern "C" fn(err: CUresult, out: *mut *const c_char) -> CUresult;
pub type FnLock = unsafe extern "C" fn(pid: c_int, args: *mut CUcheckpointLockArgs) -> CUresult;
pub type FnCheckpoint = unsafe extern "C" fn(pid: c_int, args: *mut OpaqueArgs) -> CUresult;
pub type FnRestore = unsafe extern "C" fn(pid: c_int, args: *mut CUcheckpointRestoreArgs) -> CUresult;
pub type FnUnlock = unsafe extern "C" fn(pid: c_int, args: *mut OpaqueArgs) -> CUresult;
pub type FnGetState = unsafe extern "C" fn(pid: c_int, state: *mut c_int) -> CUresult;
pub type FnGetRestoreThreadId = unsafe extern "C" fn(pid: c_int, tid: *mut c_int) -> CUresult;

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
pub const CUDA_ERROR_OPERATING_SYSTEM: CUresult = 304;
pub const CUDA_ERROR_ILLEGAL_STATE: CUresult = 401;
pub const CUDA_ERROR_NOT_READY: CUresult = 600;
pub const CUDA_ERROR_ILLEGAL_ADDRESS: CUresult = 700;
pub const CUDA_ERROR_UNKNOWN: CUresult = 999;

/// The errors that leave a CUDA context unusable for good ("sticky": every
/// later call in the process returns them, the checkpoint API's lock
/// included): ECC uncorrectable (214), illegal address (700), launch timeout
/// (702), device-side assert (710), hardware stack error (714), illegal
/// instruction (715), misaligned address (716), invalid address space
/// (717), invalid PC (718), launch failed (719).
pub const STICKY_ERRORS: [CUresult; 10] = [214, 700, 702, 710, 714, 715, 716, 717, 718, 719];

/// Whether `code` is one of [`STICKY_ERRORS`].
pub fn is_sticky(code: CUresult) -> bool {
    STICKY_ERRORS.contains(&code)
}

/// First driver API version with `CUcheckpointGpuPair` in the restore args.
pub const GPU_PAIRS_MIN_API: i32 = 13000;
/// First driver API version with the checkpoint API at all (driver r570).
pub const CHECKPOINT_MIN_API: i32 = 12080;

const _: () = assert!(std::mem::size_of::<CUcheckpointLockArgs>() == 64);
const _: () = assert!(std::mem::size_of::<CUcheckpointRestoreArgs>() == 64);
const _: () = assert!(std::mem::size_of::<CUcheckpointGpuPair>() == 32);
