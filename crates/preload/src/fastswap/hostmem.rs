//! Pinned host memory for the copies of an offload, one chunk at a time.
//!
//! Two ways to have it, chosen with `GPUSNAP_FAST_SWAP_PIN`:
//! - `register` (the default): an anonymous mapping of the host's memory,
//!   asked for in transparent huge pages, populated by the kernel
//!   (`MADV_POPULATE_WRITE`), then page-locked for the device with
//!   `cuMemHostRegister`. Huge pages make the kernel's zeroing and the
//!   driver's pinning cost per 2 MiB rather than per 4 KiB page;
//! - `alloc`: the driver's `cuMemHostAlloc`, which pins 4 KiB pages as it
//!   allocates (measured at ~2.5 GB/s on the H200's host).
//!
//! Each chunk is pinned, filled and later given back on its own, so that a
//! large allocation is spread over every copy thread.

use super::driver as cu;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

/// Pinned host bytes this library holds now (copies under way, away, or
/// kept).
pub static PINNED: AtomicU64 = AtomicU64::new(0);

/// The size of one chunk (the last of an allocation may be shorter).
pub const CHUNK: u64 = 256 << 20;
/// Transparent huge page size.
const HUGE: usize = 2 << 20;
/// `CU_MEMHOSTREGISTER_PORTABLE` / `CU_MEMHOSTALLOC_PORTABLE`: pinned for
/// every context, not only the current one.
const PORTABLE: u32 = 1;
/// `MADV_POPULATE_WRITE` (Linux 5.14).
const MADV_POPULATE_WRITE: i32 = 23;

/// How chunks are pinned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum How {
    Register,
    Alloc,
}

impl How {
    pub fn from_env() -> How {
        match std::env::var("GPUSNAP_FAST_SWAP_PIN").as_deref() {
            Ok("alloc") => How::Alloc,
            _ => How::Register,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            How::Register => "register",
            How::Alloc => "alloc",
        }
    }
}

/// The chunks of an allocation of `bytes`: `(offset, length)` each.
pub fn chunks(bytes: u64) -> impl Iterator<Item = (u64, u64)> {
    (0..bytes.div_ceil(CHUNK)).map(move |k| (k * CHUNK, CHUNK.min(bytes - k * CHUNK)))
}

/// The length of the host mapping behind a chunk of `len` bytes.
fn mapped(len: u64) -> usize {
    (len as usize).div_ceil(HUGE) * HUGE
}

/// `len` bytes of pinned host memory, or why not (nothing left taken).
pub fn pin(how: How, len: u64) -> Result<usize, String> {
    let p = pin_raw(how, len)?;
    PINNED.fetch_add(len, Ordering::SeqCst);
    Ok(p)
}

fn pin_raw(how: How, len: u64) -> Result<usize, String> {
    match how {
        How::Alloc => {
            let mut p: *mut c_void = std::ptr::null_mut();
            // SAFETY: an out-pointer to a local.
            let rc = unsafe { cu::host_alloc(&mut p, len as usize, PORTABLE) };
            if rc != cu::SUCCESS {
                return Err(format!("cuMemHostAlloc of {len} bytes: {rc}"));
            }
            Ok(p as usize)
        }
        How::Register => register(len),
    }
}

fn register(len: u64) -> Result<usize, String> {
    let size = mapped(len);
    // Aligned to a huge page, so that the whole chunk can be backed by them.
    // SAFETY: a fresh anonymous private mapping, trimmed below.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size + HUGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return Err(format!("mmap of {size} bytes: {}", std::io::Error::last_os_error()));
    }
    let raw = raw as usize;
    let p = raw.div_ceil(HUGE) * HUGE;
    // SAFETY: the parts of the mapping before and after the aligned range.
    unsafe {
        if p > raw {
            libc::munmap(raw as *mut c_void, p - raw);
        }
        let end = p + size;
        if raw + size + HUGE > end {
            libc::munmap(end as *mut c_void, raw + size + HUGE - end);
        }
        // Advice only: without huge pages it still works, slower.
        libc::madvise(p as *mut c_void, size, libc::MADV_HUGEPAGE);
    }
    // SAFETY: the aligned mapping made above.
    if unsafe { libc::madvise(p as *mut c_void, size, MADV_POPULATE_WRITE) } != 0 {
        // An older kernel: touch every page instead.
        for off in (0..size).step_by(4096) {
            // SAFETY: inside the writable mapping.
            unsafe { std::ptr::write_volatile((p + off) as *mut u8, 0) };
        }
    }
    // SAFETY: the mapping above, `size` bytes, populated.
    let rc = unsafe { cu::host_register(p as *mut c_void, size, PORTABLE) };
    if rc != cu::SUCCESS {
        // SAFETY: the mapping made above, nothing refers to it.
        unsafe { libc::munmap(p as *mut c_void, size) };
        return Err(format!("cuMemHostRegister of {size} bytes: {rc}"));
    }
    Ok(p)
}

/// Gives back a chunk `pin` returned for `len` bytes.
///
/// # Safety
/// `p` came from `pin(how, len)` and nothing refers to it any more.
pub unsafe fn unpin(how: How, p: usize, len: u64) {
    let _ = PINNED.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| Some(v.saturating_sub(len)));
    match how {
        // SAFETY: the caller's promise.
        How::Alloc => unsafe {
            cu::free_host(p as *mut c_void);
        },
        // SAFETY: the caller's promise: a registered mapping of ours.
        How::Register => unsafe {
            cu::host_unregister(p as *mut c_void);
            libc::munmap(p as *mut c_void, mapped(len));
        },
    }
}

/// How chunks are pinned in this program (set once at load).
static HOW: AtomicU8 = AtomicU8::new(0);

pub fn set_how(how: How) {
    HOW.store(if how == How::Alloc { 1 } else { 0 }, Ordering::Relaxed);
}

pub fn how() -> How {
    if HOW.load(Ordering::Relaxed) == 1 {
        How::Alloc
    } else {
        How::Register
    }
}

/// Gives back the pinned chunks `host` (of an allocation of `bytes`), 0s
/// skipped.
pub fn unpin_all(host: &[usize], bytes: u64) {
    let how = how();
    for (&p, (_, len)) in host.iter().zip(chunks(bytes)) {
        if p != 0 {
            // SAFETY: a chunk this library pinned for that allocation, which
            // nothing refers to any more (the callers' contract).
            unsafe { unpin(how, p, len) };
        }
    }
}
