//! Whether libcuda is loaded in this process, read from the loader's list
//! of loaded objects: async-signal-safe (a fatal signal's handler asks), and
//! touching only this module's two globals.

use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Set once libcuda is seen loaded in the process: only such a process has
/// anything to suspend (and a library, once loaded, stays for good).
static CUDA: AtomicBool = AtomicBool::new(false);
/// The loader's `_r_debug` (its list of loaded objects), found at load.
pub(crate) static R_DEBUG: AtomicUsize = AtomicUsize::new(0);

/// The loader's `struct r_debug` and `struct link_map` (the public heads of
/// both, as <link.h> has them): debuggers read them from outside at any
/// time, so a read from a signal handler is as safe.
#[repr(C)]
struct RDebug {
    version: c_int,
    map: *const LinkMap,
}

#[repr(C)]
struct LinkMap {
    addr: usize,
    name: *const c_char,
    ld: *const c_void,
    next: *const LinkMap,
    prev: *const LinkMap,
}

/// Whether libcuda is loaded now: an object whose file name starts with
/// `libcuda.so` in the loader's list. Without the list (not glibc's loader),
/// assume so: the guard then asks the driver, which answers for a process
/// without CUDA state at once.
pub(crate) fn cuda_loaded() -> bool {
    if CUDA.load(Ordering::Relaxed) {
        return true;
    }
    let r = R_DEBUG.load(Ordering::Acquire) as *const RDebug;
    if r.is_null() {
        return true;
    }
    // SAFETY: the loader's list; entries are never freed while a library
    // stays loaded, and a new one is linked in only once complete. At most
    // 100000 entries, so a torn read cannot loop for ever.
    let found = unsafe {
        let mut m = (*r).map;
        let mut n = 0;
        let mut found = false;
        while !m.is_null() && n < 100_000 {
            if is_libcuda((*m).name) {
                found = true;
                break;
            }
            m = (*m).next;
            n += 1;
        }
        found
    };
    if found {
        CUDA.store(true, Ordering::Relaxed);
    }
    found
}

/// Whether the C string `name`'s last path component starts with `libcuda.so`.
///
/// # Safety
/// `name` is null or a NUL-terminated string.
pub(crate) unsafe fn is_libcuda(name: *const c_char) -> bool {
    if name.is_null() {
        return false;
    }
    const WANT: &[u8] = b"libcuda.so";
    let (mut i, mut base) = (0usize, 0usize);
    // SAFETY: reading up to the NUL (the caller's contract), at most 4096.
    unsafe {
        while *name.add(i) != 0 && i < 4096 {
            if *name.add(i) as u8 == b'/' {
                base = i + 1;
            }
            i += 1;
        }
        (0..WANT.len()).all(|k| base + k < i && *name.add(base + k) as u8 == WANT[k])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libcuda_by_file_name() {
        // SAFETY: NUL-terminated literals.
        unsafe {
            assert!(is_libcuda(c"/usr/lib/x86_64-linux-gnu/libcuda.so.1".as_ptr()));
            assert!(is_libcuda(c"libcuda.so.580.1".as_ptr()));
            assert!(!is_libcuda(c"/usr/lib/libcudart.so.12".as_ptr()));
            assert!(!is_libcuda(c"/x/libcuda.so/libc.so.6".as_ptr()));
            assert!(!is_libcuda(std::ptr::null()));
        }
    }
}
