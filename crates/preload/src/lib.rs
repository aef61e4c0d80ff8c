//! `libgpusnap_preload.so`: the in-process half of `gpusnap run --light`.
//!
//! The ptrace guard stops the program at every signal it receives (about
//! 30 µs each) and at every fork; a signal-heavy program pays for that. In
//! light mode `gpusnap run` instead loads this library into the program
//! (`LD_PRELOAD`) and listens on a unix socket (`GPUSNAP_GUARD_SOCKET`).
//! The library tells the guard when a process that has loaded libcuda is
//! about to die, waits for its answer (the guard suspends the process's CUDA
//! state meanwhile), then lets the death go on unchanged:
//! - **fatal signals**: a handler of ours sits wherever the program leaves a
//!   terminating signal at its default action. `sigaction` and `signal` are
//!   wrapped so that the program still sees, sets and gets back its own
//!   dispositions; a handler the program installs replaces ours (its signal
//!   is then no death), and one it resets to the default brings ours back.
//!   After the answer the default action is restored and the signal raised
//!   again (a fault simply repeats), so the process dies of it as it would
//!   have, core dump and wait status included;
//! - **`exit()`** and a return from `main`: an `atexit` handler registered
//!   before any of the program's, so it runs after them (no CUDA call of
//!   the program can come after the suspend and block on it);
//! - **`_exit()` / `_Exit()`**: wrapped.
//!
//! Signals that do not kill, and the program's own handlers, are never
//! touched: they cost nothing. What light mode cannot see: a raw
//! `exit_group` system call or signal disposition changed by raw system
//! call (Go, static binaries), children whose environment drops
//! `LD_PRELOAD`, and a stack overflow on a thread without an alternate
//! signal stack. The ptrace guard (`gpusnap run` without `--light`) sees all
//! of those.
//!
//! Written by hand: no crate does in-process interposition of libc's
//! signal and exit functions. Everything reachable from a signal handler
//! makes only async-signal-safe system calls and touches only atomics.

#![allow(clippy::missing_safety_doc)]

use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};

/// Set once libcuda is seen in the process (at load, or after a `dlopen`):
/// only such a process has anything to suspend.
static CUDA: AtomicBool = AtomicBool::new(false);
/// The guard's socket address (`sockaddr_un`), written once at load.
static ADDR_LEN: AtomicUsize = AtomicUsize::new(0);
static mut ADDR: libc::sockaddr_un = libc::sockaddr_un { sun_family: 0, sun_path: [0; 108] };
/// Per signal: our handler is installed (the program wants the default).
static OURS: [AtomicBool; 65] = [const { AtomicBool::new(false) }; 65];
/// The next definitions of the wrapped functions (libc's), from dlsym.
static REAL_SIGACTION: AtomicUsize = AtomicUsize::new(0);
static REAL_SIGNAL: AtomicUsize = AtomicUsize::new(0);
static REAL_EXIT: AtomicUsize = AtomicUsize::new(0);
static REAL_EXIT2: AtomicUsize = AtomicUsize::new(0);
static REAL_DLOPEN: AtomicUsize = AtomicUsize::new(0);

type SigactionFn = unsafe extern "C" fn(c_int, *const libc::sigaction, *mut libc::sigaction) -> c_int;
type SignalFn = unsafe extern "C" fn(c_int, libc::sighandler_t) -> libc::sighandler_t;
type ExitFn = unsafe extern "C" fn(c_int) -> !;
type DlopenFn = unsafe extern "C" fn(*const c_char, c_int) -> *mut c_void;

/// `dlsym(RTLD_NEXT, name)`, cached in `slot`. Not async-signal-safe the
/// first time: every slot is filled at load, before a handler can run.
fn next(slot: &AtomicUsize, name: &std::ffi::CStr) -> usize {
    let p = slot.load(Ordering::Acquire);
    if p != 0 {
        return p;
    }
    // SAFETY: dlsym with a NUL-terminated name.
    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize;
    slot.store(p, Ordering::Release);
    p
}

fn real_sigaction() -> SigactionFn {
    let p = next(&REAL_SIGACTION, c"sigaction");
    // SAFETY: libc's sigaction has this signature; it always exists.
    unsafe { std::mem::transmute::<usize, SigactionFn>(p) }
}

/// Signals whose default action ends the process and that can be caught.
/// 32 and 33 are glibc's own (thread cancellation, setxid).
fn guarded(sig: c_int) -> bool {
    match sig {
        libc::SIGKILL | libc::SIGSTOP => false,
        libc::SIGCHLD | libc::SIGCONT | libc::SIGURG | libc::SIGWINCH => false,
        libc::SIGTSTP | libc::SIGTTIN | libc::SIGTTOU => false,
        1..=31 => true,
        34..=64 => true,
        _ => false,
    }
}

fn is_default(handler: libc::sighandler_t) -> bool {
    handler == libc::SIG_DFL
}

/// Our handler for `sig`, keeping the program's mask and flags.
fn our_action(like: Option<&libc::sigaction>) -> libc::sigaction {
    // SAFETY: sigaction is plain data; all-zero is a valid value.
    let mut a: libc::sigaction = unsafe { std::mem::zeroed() };
    if let Some(l) = like {
        a.sa_mask = l.sa_mask;
        a.sa_flags = l.sa_flags & (libc::SA_RESTART | libc::SA_ONSTACK);
    }
    a.sa_flags |= libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_RESTART;
    a.sa_sigaction = on_fatal as *const () as usize;
    a
}

/// Installs our handler on `sig` where the program wants the default
/// action; the previous action goes to `old` (null: not wanted).
fn install(sig: c_int, like: Option<&libc::sigaction>, old: *mut libc::sigaction) -> c_int {
    let a = our_action(like);
    // SAFETY: a valid action; `old` is null or the caller's sigaction.
    let r = unsafe { real_sigaction()(sig, &a, old) };
    if r == 0 {
        OURS[sig as usize].store(true, Ordering::SeqCst);
    }
    r
}

/// The wrapped `sigaction`: the program sets and reads its own view.
#[no_mangle]
pub unsafe extern "C" fn sigaction(
    sig: c_int,
    act: *const libc::sigaction,
    old: *mut libc::sigaction,
) -> c_int {
    let real = real_sigaction();
    if !guarded(sig) || ADDR_LEN.load(Ordering::Acquire) == 0 {
        // SAFETY: the caller's arguments, passed on.
        return unsafe { real(sig, act, old) };
    }
    let i = sig as usize;
    let ours_before = OURS[i].load(Ordering::SeqCst);
    // SAFETY: `act` is null or points at a sigaction (the caller's contract).
    let new = unsafe { act.as_ref() };
    let r = match new {
        Some(a) if is_default(a.sa_sigaction) => install(sig, Some(a), old),
        Some(_) => {
            // SAFETY: as above.
            let r = unsafe { real(sig, act, old) };
            if r == 0 {
                OURS[i].store(false, Ordering::SeqCst);
            }
            r
        }
        // SAFETY: a query; passed on.
        None => unsafe { real(sig, act, old) },
    };
    if r == 0 && ours_before {
        // SAFETY: `old` is null or points at a sigaction the caller owns.
        if let Some(o) = unsafe { old.as_mut() } {
            // What the program set: the default action.
            o.sa_sigaction = libc::SIG_DFL;
            o.sa_flags &= !libc::SA_SIGINFO;
        }
    }
    r
}

/// The wrapped `signal` (glibc's calls its internal sigaction, not ours).
#[no_mangle]
pub unsafe extern "C" fn signal(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    if !guarded(sig) || ADDR_LEN.load(Ordering::Acquire) == 0 {
        let p = next(&REAL_SIGNAL, c"signal");
        // SAFETY: libc's signal has this signature.
        let real = unsafe { std::mem::transmute::<usize, SignalFn>(p) };
        // SAFETY: the caller's arguments, passed on.
        return unsafe { real(sig, handler) };
    }
    // SAFETY: zeroed sigaction is valid; BSD semantics as glibc's signal().
    let mut a: libc::sigaction = unsafe { std::mem::zeroed() };
    a.sa_sigaction = handler;
    a.sa_flags = libc::SA_RESTART;
    // SAFETY: zeroed sigaction is valid.
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointers for the call.
    if unsafe { sigaction(sig, &a, &mut old) } != 0 {
        return libc::SIG_ERR;
    }
    old.sa_sigaction
}

/// The wrapped `dlopen`: notes when libcuda arrives.
#[no_mangle]
pub unsafe extern "C" fn dlopen(file: *const c_char, mode: c_int) -> *mut c_void {
    let p = next(&REAL_DLOPEN, c"dlopen");
    // SAFETY: libc's dlopen has this signature.
    let real = unsafe { std::mem::transmute::<usize, DlopenFn>(p) };
    // SAFETY: the caller's arguments, passed on.
    let h = unsafe { real(file, mode) };
    if !h.is_null() && !CUDA.load(Ordering::Relaxed) {
        note_cuda(real);
    }
    h
}

/// Whether libcuda is loaded now (a no-load dlopen of it succeeds).
fn note_cuda(real: DlopenFn) {
    // SAFETY: RTLD_NOLOAD only looks; the handle is released at once.
    unsafe {
        let h = real(c"libcuda.so.1".as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD);
        if !h.is_null() {
            CUDA.store(true, Ordering::SeqCst);
            libc::dlclose(h);
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn _exit(code: c_int) -> ! {
    notify(b"_exit");
    let p = next(&REAL_EXIT, c"_exit");
    // SAFETY: libc's _exit has this signature and does not return.
    unsafe { std::mem::transmute::<usize, ExitFn>(p)(code) }
}

#[no_mangle]
pub unsafe extern "C" fn _Exit(code: c_int) -> ! {
    notify(b"_exit");
    let p = next(&REAL_EXIT2, c"_Exit");
    // SAFETY: libc's _Exit has this signature and does not return.
    unsafe { std::mem::transmute::<usize, ExitFn>(p)(code) }
}

extern "C" fn at_exit() {
    notify(b"exit");
}

fn errno_ptr() -> *mut c_int {
    // SAFETY: always valid for the calling thread.
    unsafe { libc::__errno_location() }
}

/// Per signal: the connection on which an asynchronous death was announced
/// to the guard and not yet answered (-1: none).
static PENDING: [AtomicI32; 65] = [const { AtomicI32::new(-1) }; 65];

/// The handler on a terminating signal the program left at its default.
///
/// A signal sent by another process (SIGTERM from a supervisor, say) may
/// find this thread inside a CUDA call, holding the driver's locks that the
/// guard's lock call then waits for: so the handler only announces the
/// death and returns, the program runs on (its CUDA calls block once the
/// guard has locked it), and the guard sends the same signal again when the
/// process is suspended; the handler then finds the answer and lets the
/// signal kill. A fault, or a signal the process sent itself (abort,
/// raise), is answered here: the thread waits, then dies of it.
extern "C" fn on_fatal(sig: c_int, info: *mut libc::siginfo_t, _ctx: *mut c_void) {
    // SAFETY: errno of this thread, saved and restored around the handler.
    let saved = unsafe { *errno_ptr() };
    // SAFETY: `info` is the kernel's siginfo for this delivery; for the
    // codes of a sent signal (SI_USER, SI_QUEUE, SI_TKILL) si_pid is valid.
    let (code, sender) = unsafe {
        match info.as_ref() {
            Some(i) if matches!(i.si_code, 0 | -1 | -6) => (i.si_code, i.si_pid()),
            Some(i) => (i.si_code, 0),
            None => (0, 0),
        }
    };
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    let from_outside = sender > 0 && sender != me;
    let mut why = *b"signal   ";
    let mut n = sig as u32;
    let mut i = why.len();
    while n > 0 && i > 7 {
        i -= 1;
        why[i] = b'0' + (n % 10) as u8;
        n /= 10;
    }
    let slot = &PENDING[sig as usize];
    if from_outside && guarded_process() {
        let fd = slot.load(Ordering::SeqCst);
        if fd < 0 {
            if let Some(fd) = announce(b"dying-async ", &why[..]) {
                if slot.compare_exchange(-1, fd, Ordering::SeqCst, Ordering::SeqCst).is_err() {
                    // SAFETY: our own fd; another thread announced first.
                    unsafe { libc::close(fd) };
                }
                // SAFETY: as above.
                unsafe { *errno_ptr() = saved };
                return;
            }
            // No guard answers: the death goes on now.
        } else if !answered(fd) {
            // SAFETY: as above.
            unsafe { *errno_ptr() = saved };
            return;
        } else if slot.compare_exchange(fd, -1, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
            // SAFETY: the fd this slot held.
            unsafe { libc::close(fd) };
        }
    } else {
        notify(&why[..]);
    }
    // SAFETY: zeroed sigaction with SIG_DFL; the real sigaction.
    unsafe {
        let mut dfl: libc::sigaction = std::mem::zeroed();
        dfl.sa_sigaction = libc::SIG_DFL;
        real_sigaction()(sig, &dfl, std::ptr::null_mut());
    }
    OURS[sig as usize].store(false, Ordering::SeqCst);
    let fault = matches!(
        sig,
        libc::SIGSEGV | libc::SIGBUS | libc::SIGILL | libc::SIGFPE | libc::SIGTRAP | libc::SIGSYS
    );
    if !(fault && code > 0) {
        // Sent (kill, raise, abort, a timer): send it again; it is taken
        // with the default action as this handler returns. A fault simply
        // happens again.
        // SAFETY: raw system calls with integer arguments.
        unsafe {
            libc::syscall(libc::SYS_tgkill, me, libc::syscall(libc::SYS_gettid), sig);
        }
    }
    // SAFETY: as above.
    unsafe { *errno_ptr() = saved };
}

/// Whether this process has something for the guard to suspend, and a
/// guard to ask.
fn guarded_process() -> bool {
    ADDR_LEN.load(Ordering::Acquire) != 0 && CUDA.load(Ordering::SeqCst)
}

/// Whether the guard has answered on `fd` (a line, or the connection
/// closed): a poll that does not wait.
fn answered(fd: c_int) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd; no waiting.
    let r = unsafe { libc::poll(&mut p, 1, 0) };
    r > 0 && p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0
}

/// Connects to the guard and sends `head` + `why` + newline; the open
/// connection, or `None` when no guard answers.
fn announce(head: &[u8], why: &[u8]) -> Option<c_int> {
    let len = ADDR_LEN.load(Ordering::Acquire);
    // SAFETY: raw socket calls on a fd we own; ADDR is written once before
    // ADDR_LEN is published.
    unsafe {
        let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return None;
        }
        let addr = std::ptr::addr_of!(ADDR).cast::<libc::sockaddr>();
        if libc::connect(fd, addr, len as libc::socklen_t) != 0 {
            libc::close(fd);
            return None;
        }
        let mut msg = [0u8; 64];
        let n = (head.len() + why.len()).min(62);
        let h = head.len().min(n);
        msg[..h].copy_from_slice(&head[..h]);
        msg[h..n].copy_from_slice(&why[..n - h]);
        msg[n] = b'\n';
        if libc::write(fd, msg.as_ptr().cast(), n + 1) != (n + 1) as isize {
            libc::close(fd);
            return None;
        }
        Some(fd)
    }
}

/// Tells the guard "this process is dying" and waits for its answer. Only
/// async-signal-safe system calls; nothing if libcuda was never loaded or
/// no guard listens.
fn notify(why: &[u8]) {
    if !guarded_process() {
        return;
    }
    let Some(fd) = announce(b"dying ", why) else { return };
    // Wait for the answer (the guard closes the connection after it).
    let mut buf = [0u8; 16];
    // SAFETY: reads into a buffer of its length from a fd we own.
    unsafe {
        loop {
            let r = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
            if r > 0 && buf[..r as usize].contains(&b'\n') {
                break;
            }
            if r == 0 || (r < 0 && *errno_ptr() != libc::EINTR) {
                break;
            }
        }
        libc::close(fd);
    }
}

/// At load: remember the socket, put our handler wherever a terminating
/// signal is at its default, register the exit handler, fill every dlsym
/// slot (handlers must not call dlsym).
extern "C" fn init() {
    let Some(path) = std::env::var_os("GPUSNAP_GUARD_SOCKET") else { return };
    let bytes = std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str());
    if bytes.is_empty() || bytes.len() >= 108 {
        return;
    }
    // SAFETY: written once, here, before ADDR_LEN publishes it.
    unsafe {
        let a = &mut *std::ptr::addr_of_mut!(ADDR);
        a.sun_family = libc::AF_UNIX as libc::sa_family_t;
        for (d, s) in a.sun_path.iter_mut().zip(bytes) {
            *d = *s as c_char;
        }
    }
    let real = next(&REAL_DLOPEN, c"dlopen");
    next(&REAL_SIGNAL, c"signal");
    next(&REAL_EXIT, c"_exit");
    next(&REAL_EXIT2, c"_Exit");
    let sa = real_sigaction();
    // SAFETY: libc's dlopen.
    note_cuda(unsafe { std::mem::transmute::<usize, DlopenFn>(real) });
    ADDR_LEN.store(std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1, Ordering::Release);
    for sig in 1..=64 {
        if !guarded(sig) {
            continue;
        }
        // SAFETY: a query into a zeroed sigaction.
        let mut cur: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { sa(sig, std::ptr::null(), &mut cur) } == 0 && is_default(cur.sa_sigaction) {
            install(sig, Some(&cur), std::ptr::null_mut());
        }
    }
    // SAFETY: registering a function that lives as long as the process
    // (this library is never unloaded).
    unsafe { libc::atexit(at_exit) };
    // SAFETY: as above; only the child handler is given.
    unsafe { libc::pthread_atfork(None, None, Some(forget_pending)) };
}

/// In a forked child: the parent's announced deaths are not the child's.
extern "C" fn forget_pending() {
    for slot in &PENDING {
        let fd = slot.swap(-1, Ordering::SeqCst);
        if fd >= 0 {
            // SAFETY: the child's copy of the parent's connection.
            unsafe { libc::close(fd) };
        }
    }
}

#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = init;
