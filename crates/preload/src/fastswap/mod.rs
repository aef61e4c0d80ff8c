//! Fast swap (`gpusnap run --light --fast-swap`, `GPUSNAP_FAST_SWAP=1`):
//! the library serves the program's device allocations from the driver's
//! virtual memory management API, so that on gpusnap's request it can move
//! their contents to pinned host memory at the link's speed and give the
//! device memory back while every address stays reserved; the driver's
//! checkpoint then has only the context and what the library does not
//! serve left to copy. See docs/design/fast-swap.md.
//!
//! Modules, each for one reason:
//! - `driver`: the real driver's functions the library calls, resolved past
//!   every wrapper (its own calls must never wait at the gate);
//! - `entry`: how the program reaches our wrappers at all: exported names
//!   for programs linked to libcuda, `dlsym` for those that load it (the
//!   CUDA runtime), `cuGetProcAddress` for what the runtime asks the driver;
//! - `gate`: the quiescence gate in front of every work-submitting call;
//! - `table`: the served allocations and those left with the driver;
//! - `program`: the program's own VMM memory (`cuMemCreate`, `cuMemMap`);
//! - `hostmem`: pinned host memory for the copies;
//! - `prepin`: kept copies pinned ahead of time, within a budget;
//! - `swap`: offload and restore;
//! - `control`: the socket gpusnap asks on.

mod control;
mod driver;
pub mod entry;
mod gate;
mod hostmem;
mod prepin;
mod program;
mod swap;
mod table;

use std::sync::atomic::Ordering;

/// At load, in a light-mode program with `GPUSNAP_FAST_SWAP=1`: serve
/// allocations and listen for gpusnap.
extern "C" fn init() {
    entry::prepare();
    use gpusnap_wire::names;
    if std::env::var_os(names::GUARD_SOCKET_ENV).is_none()
        || std::env::var(names::FAST_SWAP_ENV).as_deref() != Ok("1")
    {
        return;
    }
    swap::VERIFY.store(std::env::var("GPUSNAP_FAST_SWAP_VERIFY").as_deref() == Ok("1"), Ordering::Relaxed);
    swap::KEEP.store(std::env::var(names::KEEP_PINNED_ENV).as_deref() == Ok("1"), Ordering::Relaxed);
    hostmem::set_how(hostmem::How::from_env());
    swap::set_drain_from_env();
    driver::real_dlsym();
    table::SERVING.store(true, Ordering::SeqCst);
    entry::ACTIVE.store(true, Ordering::SeqCst);
    prepin::start();
    control::serve();
    // SAFETY: only the child handler is given.
    unsafe { libc::pthread_atfork(None, None, Some(forked)) };
}

/// A forked child has no control socket of its own (and CUDA does not
/// carry over a fork): its allocations go to the driver.
extern "C" fn forked() {
    control::forget();
    table::SERVING.store(false, Ordering::SeqCst);
    entry::ACTIVE.store(false, Ordering::SeqCst);
}

#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = init;
