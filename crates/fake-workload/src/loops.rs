//! `--sync-loop MS`: a program that always has a thread inside the driver,
//! as JAX's reading a result back in a loop does. A launcher thread queues
//! a "kernel" of MS ms after another (`cuLaunchKernel`), a waiter thread
//! asks `cuStreamQuery` and waits in `cuCtxSynchronize` and
//! `cuStreamSynchronize` in a loop, and a reader thread loops on a
//! blocking device-to-host read of the pattern, which it checks; the main
//! loop reports a bad read as not intact.

use std::ffi::{c_int, c_uint, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::sleep;
use std::time::Duration;

use crate::{CUresult, Cuda};

/// A read of the reader thread came back wrong.
pub static BAD: AtomicBool = AtomicBool::new(false);
/// The reader thread's completed reads.
pub static READS: AtomicU64 = AtomicU64::new(0);

type Launch = unsafe extern "C" fn(
    *mut c_void,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    *mut c_void,
    *mut *mut c_void,
    *mut *mut c_void,
) -> CUresult;
type Sync = unsafe extern "C" fn() -> CUresult;
type StreamSync = unsafe extern "C" fn(*mut c_void) -> CUresult;
type Query = unsafe extern "C" fn(*mut c_void) -> CUresult;

/// Starts the launcher and the reader on the allocation at `ptr`, whose
/// first `data.len()` bytes hold `data`.
pub fn start(cuda: &Cuda, kernel_ms: u32, ptr: u64, data: Vec<u8>) -> Result<(), String> {
    // SAFETY: the symbols have these C signatures in cuda.h.
    let (launch, sync, stream_sync, query): (Launch, Sync, StreamSync, Query) = unsafe {
        (
            *cuda._lib.get(b"cuLaunchKernel\0").map_err(|e| e.to_string())?,
            *cuda._lib.get(b"cuCtxSynchronize\0").map_err(|e| e.to_string())?,
            *cuda._lib.get(b"cuStreamSynchronize\0").map_err(|e| e.to_string())?,
            *cuda._lib.get(b"cuStreamQuery\0").map_err(|e| e.to_string())?,
        )
    };
    let dtoh = cuda.memcpy_dtoh;
    std::thread::Builder::new()
        .name("launcher".into())
        .spawn(move || loop {
            // A non-NULL function handle; the fake's kernel touches nothing.
            let f = std::ptr::dangling_mut::<c_void>();
            // SAFETY: the fake reads no pointer of a launch.
            let rc = unsafe {
                launch(
                    f,
                    kernel_ms,
                    1,
                    1,
                    1,
                    1,
                    1,
                    0,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                )
            };
            if rc != 0 {
                eprintln!("fake-workload: cuLaunchKernel: {rc}");
                BAD.store(true, Ordering::SeqCst);
            }
            sleep(Duration::from_millis(u64::from(kernel_ms / 2).max(1)));
        })
        .map_err(|e| e.to_string())?;
    std::thread::Builder::new()
        .name("waiter".into())
        .spawn(move || loop {
            // SAFETY: no pointers; the default stream.
            // A query (NOT_READY while a kernel runs), then the waits.
            let rc: c_int = unsafe {
                match (query(std::ptr::null_mut()), sync()) {
                    (0 | 600, 0) => stream_sync(std::ptr::null_mut()),
                    (0 | 600, s) => s,
                    (q, _) => q,
                }
            };
            if rc != 0 {
                eprintln!("fake-workload: waiter: {rc}");
                BAD.store(true, Ordering::SeqCst);
            }
        })
        .map_err(|e| e.to_string())?;
    std::thread::Builder::new()
        .name("reader".into())
        .spawn(move || {
            let mut back = vec![0u8; data.len()];
            loop {
                // SAFETY: `back` is as long as the length passed.
                let rc = unsafe { dtoh(back.as_mut_ptr().cast(), ptr, back.len()) };
                if rc != 0 || back != data {
                    eprintln!("fake-workload: reader: read {rc}, intact {}", back == data);
                    BAD.store(true, Ordering::SeqCst);
                }
                READS.fetch_add(1, Ordering::SeqCst);
                sleep(Duration::from_millis(2));
            }
        })
        .map_err(|e| e.to_string())?;
    Ok(())
}
