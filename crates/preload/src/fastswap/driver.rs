//! The real driver's functions that the library itself calls (the VMM API,
//! pinned host memory, copies, contexts), resolved in the loaded libcuda
//! with the real `dlsym`, so that none of them passes through our own
//! wrappers or the gate.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};

pub type CuResult = c_int;
pub const SUCCESS: CuResult = 0;
pub const OUT_OF_MEMORY: CuResult = 2;
pub const NOT_INITIALIZED: CuResult = 3;
/// `CUDA_ERROR_NOT_SUPPORTED`.
pub const NOT_SUPPORTED: CuResult = 801;

/// `CUmemLocation`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Location {
    pub kind: c_int,
    pub id: c_int,
}

/// `CUmemAllocationProp` (32 bytes).
#[repr(C)]
pub struct AllocationProp {
    pub kind: c_int,
    pub requested_handle_types: c_int,
    pub location: Location,
    pub win32_handle_meta_data: *mut c_void,
    pub alloc_flags: [u8; 8],
}

/// `CUmemAccessDesc` (12 bytes).
#[repr(C)]
pub struct AccessDesc {
    pub location: Location,
    pub flags: c_int,
}

const _: () = assert!(std::mem::size_of::<AllocationProp>() == 32);
const _: () = assert!(std::mem::size_of::<AccessDesc>() == 12);

/// Pinned device memory on device `dev`, no shareable handle.
pub fn prop(dev: i32) -> AllocationProp {
    AllocationProp {
        kind: 1,
        requested_handle_types: 0,
        location: Location { kind: 1, id: dev },
        win32_handle_meta_data: std::ptr::null_mut(),
        alloc_flags: [0; 8],
    }
}

/// Read and write access for device `dev`.
pub fn access(dev: i32) -> AccessDesc {
    AccessDesc { location: Location { kind: 1, id: dev }, flags: 3 }
}

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

static REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);
static LIBCUDA: AtomicUsize = AtomicUsize::new(0);

/// glibc's own `dlsym` (ours wraps it), found with `dlvsym`.
pub fn real_dlsym() -> Option<DlsymFn> {
    let mut p = REAL_DLSYM.load(Ordering::Acquire);
    if p == 0 {
        for v in [c"GLIBC_2.34", c"GLIBC_2.2.5"] {
            // SAFETY: dlvsym with NUL-terminated strings.
            p = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), v.as_ptr()) } as usize;
            if p != 0 {
                break;
            }
        }
        REAL_DLSYM.store(p, Ordering::Release);
    }
    // SAFETY: glibc's dlsym has this signature.
    (p != 0).then(|| unsafe { std::mem::transmute::<usize, DlsymFn>(p) })
}

/// The loaded libcuda's handle, once it is loaded (never loads it).
fn libcuda() -> usize {
    let h = LIBCUDA.load(Ordering::Acquire);
    if h != 0 {
        return h;
    }
    // SAFETY: dlopen of a library already loaded (RTLD_NOLOAD) only finds it.
    let h = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY) } as usize;
    if h != 0 {
        LIBCUDA.store(h, Ordering::Release);
    }
    h
}

/// The driver's own `name`, 0 while libcuda is not loaded or lacks it.
pub fn real(name: &CStr) -> usize {
    let h = libcuda();
    if h == 0 {
        return 0;
    }
    let Some(dlsym) = real_dlsym() else { return 0 };
    // SAFETY: a live handle and a NUL-terminated name.
    unsafe { dlsym(h as *mut c_void, name.as_ptr()) as usize }
}

/// Declares the driver functions the library calls, each resolved once.
macro_rules! calls {
    ($($fn:ident = $sym:literal ($($arg:ident: $ty:ty),*);)*) => {
        $(
            /// The driver's own function of that name.
            ///
            /// # Safety
            /// The driver's contract for its arguments.
            #[allow(non_snake_case, clippy::missing_safety_doc)]
            pub unsafe fn $fn($($arg: $ty),*) -> CuResult {
                static SLOT: AtomicUsize = AtomicUsize::new(0);
                let mut p = SLOT.load(Ordering::Acquire);
                if p == 0 {
                    p = real($sym);
                    SLOT.store(p, Ordering::Release);
                }
                if p == 0 {
                    return NOT_INITIALIZED;
                }
                // SAFETY: the driver's function has this signature (cuda.h).
                let f = unsafe { std::mem::transmute::<usize, unsafe extern "C" fn($($ty),*) -> CuResult>(p) };
                // SAFETY: the caller's arguments, under the driver's contract.
                unsafe { f($($arg),*) }
            }
        )*
    };
}

calls! {
    mem_alloc = c"cuMemAlloc_v2" (p: *mut u64, bytes: usize);
    mem_free = c"cuMemFree_v2" (p: u64);
    mem_alloc_pitch = c"cuMemAllocPitch_v2" (p: *mut u64, pitch: *mut usize, w: usize, h: usize, elem: c_uint);
    mem_alloc_managed = c"cuMemAllocManaged" (p: *mut u64, bytes: usize, flags: c_uint);
    ipc_get_mem_handle = c"cuIpcGetMemHandle" (h: *mut c_void, p: u64);
    address_reserve = c"cuMemAddressReserve" (p: *mut u64, size: usize, align: usize, addr: u64, flags: u64);
    address_free = c"cuMemAddressFree" (p: u64, size: usize);
    create = c"cuMemCreate" (h: *mut u64, size: usize, prop: *const AllocationProp, flags: u64);
    release = c"cuMemRelease" (h: u64);
    map = c"cuMemMap" (p: u64, size: usize, offset: usize, h: u64, flags: u64);
    export = c"cuMemExportToShareableHandle" (out: *mut c_void, h: u64, kind: c_int, flags: u64);
    props_of = c"cuMemGetAllocationPropertiesFromHandle" (prop: *mut AllocationProp, h: u64);
    retain = c"cuMemRetainAllocationHandle" (out: *mut u64, p: *mut c_void);
    alloc_async = c"cuMemAllocAsync" (p: *mut u64, bytes: usize, stream: *mut c_void);
    alloc_from_pool_async = c"cuMemAllocFromPoolAsync" (p: *mut u64, bytes: usize, pool: *mut c_void, stream: *mut c_void);
    free_async = c"cuMemFreeAsync" (p: u64, stream: *mut c_void);
    unmap = c"cuMemUnmap" (p: u64, size: usize);
    set_access = c"cuMemSetAccess" (p: u64, size: usize, desc: *const AccessDesc, count: usize);
    granularity = c"cuMemGetAllocationGranularity" (g: *mut usize, prop: *const AllocationProp, option: c_int);
    host_alloc = c"cuMemHostAlloc" (p: *mut *mut c_void, bytes: usize, flags: c_uint);
    free_host = c"cuMemFreeHost" (p: *mut c_void);
    host_register = c"cuMemHostRegister_v2" (p: *mut c_void, bytes: usize, flags: c_uint);
    host_unregister = c"cuMemHostUnregister" (p: *mut c_void);
    copy_dtoh = c"cuMemcpyDtoH_v2" (dst: *mut c_void, src: u64, bytes: usize);
    copy_htod = c"cuMemcpyHtoD_v2" (dst: u64, src: *const c_void, bytes: usize);
    ctx_get_current = c"cuCtxGetCurrent" (ctx: *mut usize);
    ctx_set_current = c"cuCtxSetCurrent" (ctx: usize);
    ctx_get_device = c"cuCtxGetDevice" (dev: *mut c_int);
    ctx_synchronize = c"cuCtxSynchronize" ();
    get_proc_address = c"cuGetProcAddress" (sym: *const c_char, pfn: *mut *mut c_void, ver: c_int, flags: u64);
    get_proc_address_v2 = c"cuGetProcAddress_v2" (sym: *const c_char, pfn: *mut *mut c_void, ver: c_int, flags: u64, status: *mut c_int);
}

/// Whether the code address `p` lies in libcuda (the driver's own function,
/// not a wrapper of ours or of another library's).
pub fn in_libcuda(p: usize) -> bool {
    // SAFETY: dladdr fills a zeroed Dl_info for any address.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::dladdr(p as *const c_void, &mut info) } == 0 {
        return false;
    }
    // SAFETY: dli_fname is null or the loader's NUL-terminated name.
    unsafe { crate::is_libcuda(info.dli_fname) }
}
