//! `--vmm-mib N`: device memory the program maps itself through the VMM
//! API, as PyTorch's expandable segments and vLLM's sleep-mode allocator
//! do: a reservation, physical memory (`cuMemCreate`), a mapping and its
//! access. Two allocations of N MiB: the first keeps its handle, the
//! second's is released right after it is mapped (freed at its unmap).

use std::ffi::{c_int, c_void};

use crate::{CUresult, Cuda};

/// `CUmemAllocationProp`: pinned memory on a device, no shareable handle.
#[repr(C)]
struct Prop {
    kind: c_int,
    handle_types: c_int,
    loc_kind: c_int,
    loc_id: c_int,
    win32: *mut c_void,
    flags: [u8; 8],
}

/// `CUmemAccessDesc`: read and write for a device.
#[repr(C)]
struct Access {
    loc_kind: c_int,
    loc_id: c_int,
    flags: c_int,
}

type Reserve = unsafe extern "C" fn(*mut u64, usize, usize, u64, u64) -> CUresult;
type Create = unsafe extern "C" fn(*mut u64, usize, *const Prop, u64) -> CUresult;
type Map = unsafe extern "C" fn(u64, usize, usize, u64, u64) -> CUresult;
type SetAccess = unsafe extern "C" fn(u64, usize, *const Access, usize) -> CUresult;
type Release = unsafe extern "C" fn(u64) -> CUresult;

/// Maps the two allocations on device `dev` and writes `data` at the start
/// of each; their addresses.
pub fn alloc(cuda: &Cuda, mib: u64, dev: c_int, data: &[u8]) -> Result<Vec<u64>, String> {
    let size = (mib.div_ceil(2) * 2 * 1024 * 1024) as usize;
    if data.len() > size {
        return Err(format!("--data-kib does not fit in --vmm-mib {mib}"));
    }
    // SAFETY: the symbols have these C signatures in cuda.h.
    let (reserve, create, map, set_access, release): (Reserve, Create, Map, SetAccess, Release) = unsafe {
        (
            *cuda._lib.get(b"cuMemAddressReserve\0").map_err(|e| e.to_string())?,
            *cuda._lib.get(b"cuMemCreate\0").map_err(|e| e.to_string())?,
            *cuda._lib.get(b"cuMemMap\0").map_err(|e| e.to_string())?,
            *cuda._lib.get(b"cuMemSetAccess\0").map_err(|e| e.to_string())?,
            *cuda._lib.get(b"cuMemRelease\0").map_err(|e| e.to_string())?,
        )
    };
    let prop = Prop {
        kind: 1,
        handle_types: 0,
        loc_kind: 1,
        loc_id: dev,
        win32: std::ptr::null_mut(),
        flags: [0; 8],
    };
    let access = Access { loc_kind: 1, loc_id: dev, flags: 3 };
    let mut out = Vec::new();
    for released in [false, true] {
        let (mut va, mut h) = (0u64, 0u64);
        // SAFETY: out-pointers to locals, a prop and a descriptor that live
        // through the calls, `data` as long as passed.
        unsafe {
            cuda.check("cuMemAddressReserve", reserve(&mut va, size, 0, 0, 0))?;
            cuda.check("cuMemCreate", create(&mut h, size, &prop, 0))?;
            cuda.check("cuMemMap", map(va, size, 0, h, 0))?;
            cuda.check("cuMemSetAccess", set_access(va, size, &access, 1))?;
            if released {
                cuda.check("cuMemRelease", release(h))?;
            }
            cuda.check("cuMemcpyHtoD_v2", (cuda.memcpy_htod)(va, data.as_ptr().cast(), data.len()))?;
        }
        out.push(va);
    }
    Ok(out)
}

/// `--async-mib N`: N MiB from the driver's stream-ordered pool, held for
/// the program's life (fast swap leaves it with the driver).
pub fn alloc_async(cuda: &Cuda, mib: u64) -> Result<u64, String> {
    type AllocAsync = unsafe extern "C" fn(*mut u64, usize, *mut c_void) -> CUresult;
    // SAFETY: the symbol has this C signature in cuda.h.
    let f: AllocAsync = *unsafe { cuda._lib.get(b"cuMemAllocAsync\0") }.map_err(|e| e.to_string())?;
    let mut p = 0u64;
    // SAFETY: an out-pointer to a local; the default stream.
    cuda.check("cuMemAllocAsync", unsafe { f(&mut p, (mib << 20) as usize, std::ptr::null_mut()) })?;
    Ok(p)
}
