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
//!   terminating signal at its default action. `sigaction`, `signal`,
//!   `bsd_signal`, `sysv_signal` and `sigset` are wrapped so that the program
//!   still sees, sets and gets back its own dispositions; a handler the
//!   program installs replaces ours (its signal is then no death), and one it
//!   resets to the default brings ours back. After the answer the default
//!   action is restored and the signal raised again (a fault that repeats
//!   simply repeats), so the process dies of it as it would have, core dump
//!   and wait status included;
//! - **`exit()`** and a return from `main`: an exit handler registered
//!   before any other (`__cxa_atexit` and `atexit` are wrapped for that), so
//!   it runs after every handler of the program and of its libraries;
//! - **`_exit()` / `_Exit()`**: wrapped.
//!
//! A guard whose policy holds a process with a faulted CUDA context
//! (`run --on-fault hold`) answers `hold` instead of `ok`: the dying thread
//! then sleeps where it asked, for good (only SIGKILL ends the process).
//!
//! Signals that do not kill, and the program's own handlers, are never
//! touched: they cost nothing. `dlopen` is not wrapped (glibc resolves a
//! `dlopen` by its caller's RUNPATH and namespace, and the caller would be
//! us): whether libcuda is loaded is read from the loader's list of loaded
//! objects at the moment of death. What light mode cannot see: a raw
//! `exit_group` system call or signal disposition changed by raw system
//! call (Go, static binaries), children whose environment drops
//! `LD_PRELOAD`, and a stack overflow on a thread without an alternate
//! signal stack. The ptrace guard (`gpusnap run` without `--light`) sees all
//! of those.
//!
//! The wrappers, the handlers and the exchange with the guard stay in this
//! file: they all read and write the same handful of globals
//! (the address, the saved dispositions, the next definitions from dlsym)
//! under one rule, async-signal safety, that holds only if every access is
//! checked against every other; split across modules, those globals would
//! have to be made visible crate-wide and the rule checked across files.
//!
//! Written by hand: no crate does in-process interposition of libc's
//! signal and exit functions. Everything reachable from a signal handler
//! makes only async-signal-safe system calls and touches only atomics and
//! memory the loader keeps consistent for debuggers.

#![allow(clippy::missing_safety_doc)]

/// Fast swap: allocations served from the VMM API, moved on request.
mod fastswap;
/// Whether libcuda is loaded, read from the loader's list of objects.
mod loaded;

pub(crate) use loaded::is_libcuda;
use loaded::{cuda_loaded, R_DEBUG};

use gpusnap_wire::guard::{self, Scan, Why};
use gpusnap_wire::{names, sock};
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicI64, AtomicU64, AtomicUsize, Ordering};

/// The guard's socket address (`sockaddr_un`), written once at load.
static ADDR_LEN: AtomicUsize = AtomicUsize::new(0);
static mut ADDR: libc::sockaddr_un = libc::sockaddr_un { sun_family: 0, sun_path: [0; 108] };
/// How long a dying process waits without a word from the guard
/// (`GPUSNAP_GUARD_WAIT_MS`); the guard sends a byte every second while it
/// works, so only a stopped or stuck guard runs into it.
static WAIT_MS: AtomicI64 = AtomicI64::new(15_000);
/// The longest a dying process waits for the guard at all, heartbeats or
/// not: a guard stuck in a driver or NVML call must not hang the program.
const TOTAL_MS: i64 = 600_000;
/// The next definitions of the wrapped functions (libc's), from dlsym.
static REAL_SIGACTION: AtomicUsize = AtomicUsize::new(0);
static REAL_SIGNAL: AtomicUsize = AtomicUsize::new(0);
static REAL_BSD_SIGNAL: AtomicUsize = AtomicUsize::new(0);
static REAL_SYSV_SIGNAL: AtomicUsize = AtomicUsize::new(0);
static REAL_SIGSET: AtomicUsize = AtomicUsize::new(0);
static REAL_EXIT: AtomicUsize = AtomicUsize::new(0);
static REAL_EXIT2: AtomicUsize = AtomicUsize::new(0);
static REAL_CXA_ATEXIT: AtomicUsize = AtomicUsize::new(0);
/// Our exit handler is registered (it must be the first of all).
static EXIT_HANDLER: AtomicBool = AtomicBool::new(false);
/// The guard answered `hold`: this process's CUDA context faulted and the
/// guard's policy keeps it from dying (`run --on-fault hold`).
static HOLD: AtomicBool = AtomicBool::new(false);

type SigactionFn = unsafe extern "C" fn(c_int, *const libc::sigaction, *mut libc::sigaction) -> c_int;
type SignalFn = unsafe extern "C" fn(c_int, libc::sighandler_t) -> libc::sighandler_t;
type ExitFn = unsafe extern "C" fn(c_int) -> !;
type CxaAtexitFn = unsafe extern "C" fn(extern "C" fn(*mut c_void), *mut c_void, *mut c_void) -> c_int;

/// `dlsym(RTLD_NEXT, name)`, cached in `slot`. Not async-signal-safe the
/// first time: every slot a handler needs is filled at load.
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

fn active() -> bool {
    ADDR_LEN.load(Ordering::Acquire) != 0
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

fn our_handler() -> usize {
    on_fatal as *const () as usize
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
    a.sa_sigaction = our_handler();
    a
}

/// Installs our handler on `sig` where the program wants the default
/// action; the previous action goes to `old` (null: not wanted).
fn install(sig: c_int, like: Option<&libc::sigaction>, old: *mut libc::sigaction) -> c_int {
    let a = our_action(like);
    // SAFETY: a valid action; `old` is null or the caller's sigaction.
    unsafe { real_sigaction()(sig, &a, old) }
}

/// What the program set where our handler sits: the default action. Read
/// from the kernel's own record (the handler is ours or it is not), never
/// from a table of ours: a vfork child shares our memory but not our
/// dispositions, and what it changes must not change our view.
fn as_program_sees(old: &mut libc::sigaction) {
    if old.sa_sigaction == our_handler() {
        old.sa_sigaction = libc::SIG_DFL;
        old.sa_flags &= !libc::SA_SIGINFO;
    }
}

fn as_program_sees_handler(h: libc::sighandler_t) -> libc::sighandler_t {
    if h == our_handler() {
        libc::SIG_DFL
    } else {
        h
    }
}

/// The wrapped `sigaction`: the program sets and reads its own view.
#[no_mangle]
pub unsafe extern "C" fn sigaction(
    sig: c_int,
    act: *const libc::sigaction,
    old: *mut libc::sigaction,
) -> c_int {
    let real = real_sigaction();
    if !guarded(sig) || !active() {
        // SAFETY: the caller's arguments, passed on.
        return unsafe { real(sig, act, old) };
    }
    // SAFETY: `act` is null or points at a sigaction (the caller's contract).
    let r = match unsafe { act.as_ref() } {
        Some(a) if a.sa_sigaction == libc::SIG_DFL => install(sig, Some(a), old),
        // SAFETY: the caller's arguments, passed on (a handler, an ignore, a query).
        _ => unsafe { real(sig, act, old) },
    };
    if r == 0 {
        // SAFETY: `old` is null or points at a sigaction the caller owns.
        if let Some(o) = unsafe { old.as_mut() } {
            as_program_sees(o);
        }
    }
    r
}

/// The `signal` family: glibc's versions call its internal sigaction, not
/// ours, so each is wrapped. A handler or an ignore goes to libc's own (its
/// flags stay libc's: `siginterrupt` keeps working); the default action is
/// ours again right after.
fn signal_via(
    slot: &AtomicUsize,
    name: &std::ffi::CStr,
    sig: c_int,
    h: libc::sighandler_t,
) -> libc::sighandler_t {
    let p = next(slot, name);
    if p == 0 {
        return libc::SIG_ERR;
    }
    // SAFETY: the signal family shares this signature.
    let real = unsafe { std::mem::transmute::<usize, SignalFn>(p) };
    // SAFETY: the caller's arguments, passed on.
    let old = unsafe { real(sig, h) };
    if !guarded(sig) || !active() || old == libc::SIG_ERR {
        return old;
    }
    if h == libc::SIG_DFL {
        install(sig, None, std::ptr::null_mut());
    }
    as_program_sees_handler(old)
}

#[no_mangle]
pub unsafe extern "C" fn signal(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    signal_via(&REAL_SIGNAL, c"signal", sig, handler)
}

#[no_mangle]
pub unsafe extern "C" fn bsd_signal(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    signal_via(&REAL_BSD_SIGNAL, c"bsd_signal", sig, handler)
}

#[no_mangle]
pub unsafe extern "C" fn sysv_signal(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    signal_via(&REAL_SYSV_SIGNAL, c"sysv_signal", sig, handler)
}

#[no_mangle]
pub unsafe extern "C" fn sigset(sig: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    signal_via(&REAL_SIGSET, c"sigset", sig, handler)
}

/// The wrapped `__cxa_atexit` (what `atexit` and C++ static destructors
/// register with): our exit handler goes in before the first registration
/// of anyone, so it runs after all of them. Libraries linked at start run
/// their constructors (and register their handlers) before ours runs.
#[no_mangle]
pub unsafe extern "C" fn __cxa_atexit(
    f: extern "C" fn(*mut c_void),
    arg: *mut c_void,
    dso: *mut c_void,
) -> c_int {
    let real = register_exit_handler();
    match real {
        // SAFETY: the caller's arguments, passed on to libc's.
        Some(real) => unsafe { real(f, arg, dso) },
        None => -1,
    }
}

/// Registers our exit handler once, first; libc's `__cxa_atexit`.
fn register_exit_handler() -> Option<CxaAtexitFn> {
    let p = next(&REAL_CXA_ATEXIT, c"__cxa_atexit");
    if p == 0 {
        return None;
    }
    // SAFETY: libc's __cxa_atexit has this signature.
    let real = unsafe { std::mem::transmute::<usize, CxaAtexitFn>(p) };
    if !EXIT_HANDLER.swap(true, Ordering::SeqCst) {
        // SAFETY: a function that lives as long as the process (this
        // library is never unloaded); no DSO handle, so no dlclose runs it.
        unsafe { real(at_exit, std::ptr::null_mut(), std::ptr::null_mut()) };
    }
    Some(real)
}

#[no_mangle]
pub unsafe extern "C" fn _exit(code: c_int) -> ! {
    notify(Why::UnderscoreExit);
    let p = next(&REAL_EXIT, c"_exit");
    // SAFETY: libc's _exit has this signature and does not return.
    unsafe { std::mem::transmute::<usize, ExitFn>(p)(code) }
}

#[no_mangle]
pub unsafe extern "C" fn _Exit(code: c_int) -> ! {
    notify(Why::UnderscoreExit);
    let p = next(&REAL_EXIT2, c"_Exit");
    // SAFETY: libc's _Exit has this signature and does not return.
    unsafe { std::mem::transmute::<usize, ExitFn>(p)(code) }
}

extern "C" fn at_exit(_: *mut c_void) {
    notify(Why::Exit);
}

fn errno_ptr() -> *mut c_int {
    // SAFETY: always valid for the calling thread.
    unsafe { libc::__errno_location() }
}

fn now_ms() -> i64 {
    // SAFETY: zeroed timespec, filled by clock_gettime (async-signal-safe).
    let mut t: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    t.tv_sec * 1000 + t.tv_nsec / 1_000_000
}

/// Per signal: the connection on which an asynchronous death was announced
/// to the guard and not yet answered (-1: none), the inode of that socket
/// (the program may close the fd and reuse its number), and when the guard
/// was last heard on it.
static PENDING: [AtomicI32; 65] = [const { AtomicI32::new(-1) }; 65];
static PENDING_INO: [AtomicU64; 65] = [const { AtomicU64::new(0) }; 65];
static PENDING_HEARD: [AtomicI64; 65] = [const { AtomicI64::new(0) }; 65];

/// How a signal came: decided by si_code, the kernel's own word, never by
/// the sender's pid (0 for the kernel and for a sender in another pid
/// namespace alike).
#[derive(PartialEq, Eq, Clone, Copy)]
enum Origin {
    /// A fault of this thread's (SEGV, BUS, ILL, FPE, TRAP, SYS from the
    /// kernel): the thread stands at a known instruction.
    Fault,
    /// Sent by this process to itself (`raise`, `abort`, `kill(getpid())`,
    /// the kernel's SIGPIPE or SIGXFSZ for this thread's write).
    Own,
    /// Anything else: another process's `kill` (any namespace), a terminal's
    /// Ctrl-C or hang-up, `alarm`, SIGXCPU, a POSIX timer. The thread may have
    /// been stopped anywhere, even inside a driver call.
    Async,
}

fn origin(sig: c_int, code: c_int, sender: i32, me: i32) -> Origin {
    let fault_sig = matches!(
        sig,
        libc::SIGSEGV | libc::SIGBUS | libc::SIGILL | libc::SIGFPE | libc::SIGTRAP | libc::SIGSYS
    );
    if code > 0 {
        // SI_KERNEL (tty, alarm, XCPU) or a fault code.
        return if fault_sig { Origin::Fault } else { Origin::Async };
    }
    // SI_USER, SI_QUEUE, SI_TKILL from this very process.
    if matches!(code, 0 | -1 | -6) && sender == me && me > 0 {
        return Origin::Own;
    }
    Origin::Async
}

/// The handler on a terminating signal the program left at its default.
///
/// An asynchronous signal (see [`Origin`]) may find this thread inside a
/// CUDA call, holding the driver's locks that the guard's lock call then
/// waits for: so the handler only announces the death and returns, the
/// program runs on (its CUDA calls block once the guard has locked it),
/// and the guard sends the same signal again when the process is
/// suspended; the handler then finds the answer and lets the signal kill.
/// A fault, or a signal the process sent itself, is answered here: the
/// thread waits, then dies of it.
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
    let how = origin(sig, code, sender, me);
    if how == Origin::Async && guarded_process() {
        if !async_death(sig) {
            // SAFETY: as above.
            unsafe { *errno_ptr() = saved };
            return;
        }
    } else {
        notify(Why::Signal(sig));
    }
    hold_if_told();
    // SAFETY: zeroed sigaction with SIG_DFL; the real sigaction.
    unsafe {
        let mut dfl: libc::sigaction = std::mem::zeroed();
        dfl.sa_sigaction = libc::SIG_DFL;
        real_sigaction()(sig, &dfl, std::ptr::null_mut());
    }
    // A fault that repeats (the instruction runs again) kills on its own as
    // this handler returns; a trap (int3, a seccomp SIGSYS) resumes after
    // the instruction, so it is sent again like any other signal.
    let repeats =
        how == Origin::Fault && matches!(sig, libc::SIGSEGV | libc::SIGBUS | libc::SIGILL | libc::SIGFPE);
    if !repeats {
        // SAFETY: raw system calls with integer arguments.
        unsafe {
            libc::syscall(libc::SYS_tgkill, me, libc::syscall(libc::SYS_gettid), sig);
        }
    }
    // SAFETY: as above.
    unsafe { *errno_ptr() = saved };
}

/// An asynchronous death of `sig`: announced to the guard the first time
/// (the program runs on), then, at the guard's own re-sent signal, allowed.
/// Returns whether the death goes on now.
fn async_death(sig: c_int) -> bool {
    let i = sig as usize;
    let slot = &PENDING[i];
    let fd = slot.load(Ordering::SeqCst);
    if fd < 0 {
        let Some(fd) = announce(true, Why::Signal(sig)) else {
            // No guard answers: the death goes on now.
            return true;
        };
        PENDING_INO[i].store(inode_of(fd).unwrap_or(0), Ordering::SeqCst);
        PENDING_HEARD[i].store(now_ms(), Ordering::SeqCst);
        if slot.compare_exchange(-1, fd, Ordering::SeqCst, Ordering::SeqCst).is_err() {
            // SAFETY: our own fd; another thread announced first.
            unsafe { libc::close(fd) };
        }
        return false;
    }
    if inode_of(fd).is_none_or(|ino| ino != PENDING_INO[i].load(Ordering::SeqCst)) {
        // The program closed our connection (its number may now be a file
        // of its own, which we must not touch): the answer is lost.
        let _ = slot.compare_exchange(fd, -1, Ordering::SeqCst, Ordering::SeqCst);
        return true;
    }
    let go = match poll_answer(fd) {
        Answer::Done => true,
        Answer::Heard => {
            PENDING_HEARD[i].store(now_ms(), Ordering::SeqCst);
            false
        }
        // A guard that has said nothing for that long (stopped, stuck) is
        // not waited for: the death goes on, unsuspended.
        Answer::Silent => {
            now_ms() - PENDING_HEARD[i].load(Ordering::SeqCst) > WAIT_MS.load(Ordering::Relaxed)
        }
    };
    if go && slot.compare_exchange(fd, -1, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
        // SAFETY: the fd this slot held (checked to be our socket above).
        unsafe { libc::close(fd) };
    }
    go
}

/// The inode of the socket `fd`, if it is one.
fn inode_of(fd: c_int) -> Option<u64> {
    // SAFETY: zeroed stat, filled by fstat (async-signal-safe).
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer.
    if unsafe { libc::fstat(fd, &mut st) } != 0 || st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return None;
    }
    Some(st.st_ino)
}

enum Answer {
    /// A whole answer (a line), or the connection closed.
    Done,
    /// Heartbeats only: the guard is at work.
    Heard,
    /// Nothing to read now.
    Silent,
}

/// What the guard has sent on `fd` so far, read without waiting.
fn poll_answer(fd: c_int) -> Answer {
    let mut heard = false;
    let mut buf = [0u8; 64];
    loop {
        // SAFETY: reads into a buffer of its length; never blocks.
        let r = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        if r == 0 {
            return Answer::Done;
        }
        if r < 0 {
            // SAFETY: errno of this thread.
            let e = unsafe { *errno_ptr() };
            return match e {
                libc::EAGAIN | libc::EINTR if heard => Answer::Heard,
                libc::EAGAIN | libc::EINTR => Answer::Silent,
                _ => Answer::Done,
            };
        }
        match guard::scan_answer(&buf[..r as usize]) {
            Scan::Answer { hold } => {
                if hold {
                    HOLD.store(true, Ordering::SeqCst);
                }
                return Answer::Done;
            }
            Scan::Heartbeats => heard = true,
        }
    }
}

/// Whether this process has something for the guard to suspend, and a
/// guard to ask.
fn guarded_process() -> bool {
    active() && cuda_loaded()
}

/// Field 22 of /proc/self/stat (the start time the journal keys processes
/// by), read with raw system calls: the guard can journal a death it
/// learns of only after the process is gone.
fn start_time() -> Option<u64> {
    let mut buf = [0u8; 1024];
    // SAFETY: open/read/close with a NUL-terminated path and a buffer of
    // its length.
    let n = unsafe {
        let fd = libc::open(c"/proc/self/stat".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return None;
        }
        let n = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
        libc::close(fd);
        n
    };
    let text = buf.get(..usize::try_from(n).ok()?)?;
    let close = text.iter().rposition(|b| *b == b')')?;
    // Fields after the command: state is field 3, start time field 22.
    let field = text[close + 1..].split(|b| *b == b' ').filter(|f| !f.is_empty()).nth(19)?;
    let mut v: u64 = 0;
    for b in field {
        if !b.is_ascii_digit() {
            return None;
        }
        v = v.checked_mul(10)?.checked_add(u64::from(b - b'0'))?;
    }
    Some(v)
}

/// Waits until `fd` is ready for `events`, at most `ms`; whether it is.
fn wait_fd(fd: c_int, events: libc::c_short, ms: i64) -> bool {
    let end = now_ms() + ms;
    loop {
        let left = end - now_ms();
        if left <= 0 {
            return false;
        }
        let mut p = libc::pollfd { fd, events, revents: 0 };
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut p, 1, left.min(i32::MAX as i64) as c_int) };
        if r > 0 {
            return true;
        }
        // SAFETY: errno of this thread.
        if r < 0 && unsafe { *errno_ptr() } != libc::EINTR {
            return false;
        }
    }
}

/// Connects to the guard and sends its `dying` line (with this process's
/// start time); the open connection, or `None` when no guard answers in
/// time. Every wait is bounded (a stopped guard, a full backlog).
fn announce(asynchronous: bool, why: Why) -> Option<c_int> {
    let len = ADDR_LEN.load(Ordering::Acquire);
    let wait = WAIT_MS.load(Ordering::Relaxed);
    let mut msg = [0u8; 96];
    let n = guard::encode_dying(&mut msg, asynchronous, why, start_time());
    // SAFETY: raw socket calls on a fd we own; ADDR is written once before
    // ADDR_LEN is published.
    unsafe {
        let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK, 0);
        if fd < 0 {
            return None;
        }
        let addr = std::ptr::addr_of!(ADDR).cast::<libc::sockaddr>();
        let end = now_ms() + wait;
        loop {
            if libc::connect(fd, addr, len as libc::socklen_t) == 0 {
                break;
            }
            let e = *errno_ptr();
            // A unix socket whose backlog is full answers EAGAIN at once:
            // try again a little later, within the bound.
            if (e == libc::EAGAIN || e == libc::EINTR) && now_ms() < end {
                let pause = libc::timespec { tv_sec: 0, tv_nsec: 10_000_000 };
                libc::nanosleep(&pause, std::ptr::null_mut());
                continue;
            }
            libc::close(fd);
            return None;
        }
        let mut sent = 0;
        while sent < n {
            let r = libc::send(fd, msg[sent..n].as_ptr().cast(), n - sent, libc::MSG_NOSIGNAL);
            if r > 0 {
                sent += r as usize;
                continue;
            }
            let e = *errno_ptr();
            if (e == libc::EAGAIN || e == libc::EINTR) && wait_fd(fd, libc::POLLOUT, end - now_ms()) {
                continue;
            }
            libc::close(fd);
            return None;
        }
        Some(fd)
    }
}

/// Tells the guard "this process is dying" and waits for its answer. Only
/// async-signal-safe system calls; nothing if libcuda was never loaded or
/// no guard listens. The wait ends when the guard has been silent for
/// `GPUSNAP_GUARD_WAIT_MS` or after ten minutes in all: the death then goes
/// on unsuspended (the guard journals that its answer came too late).
fn notify(why: Why) {
    if !guarded_process() {
        return;
    }
    let Some(fd) = announce(false, why) else { return };
    let wait = WAIT_MS.load(Ordering::Relaxed);
    let start = now_ms();
    let mut heard = start;
    loop {
        let now = now_ms();
        if now - start > TOTAL_MS {
            break;
        }
        if !wait_fd(fd, libc::POLLIN, (heard + wait - now).min(start + TOTAL_MS - now)) {
            break;
        }
        match poll_answer(fd) {
            Answer::Done => break,
            Answer::Heard => heard = now_ms(),
            Answer::Silent => {}
        }
    }
    // SAFETY: our own fd.
    unsafe { libc::close(fd) };
    hold_if_told();
}

/// Under the guard's `hold` answer this thread never goes on to die: the
/// faulted context must not be torn down until the operator decides
/// (SIGKILL, `gpusnap stop --force`, still ends the process). Sleeps only.
fn hold_if_told() {
    while HOLD.load(Ordering::SeqCst) {
        let pause = libc::timespec { tv_sec: 3600, tv_nsec: 0 };
        // SAFETY: nanosleep with a valid timespec (async-signal-safe).
        unsafe { libc::nanosleep(&pause, std::ptr::null_mut()) };
    }
}

/// At load: remember the socket, put our handler wherever a terminating
/// signal is at its default, register the exit handler, fill every dlsym
/// slot (handlers must not call dlsym).
extern "C" fn init() {
    let Some(path) = std::env::var_os(names::GUARD_SOCKET_ENV) else { return };
    let Some(addr) = sock::Addr::path(std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str())) else {
        return;
    };
    if let Some(ms) = std::env::var(names::GUARD_WAIT_ENV).ok().and_then(|v| v.parse::<i64>().ok()) {
        WAIT_MS.store(ms.clamp(100, TOTAL_MS), Ordering::Relaxed);
    }
    // SAFETY: written once, here, before ADDR_LEN publishes it.
    unsafe { *std::ptr::addr_of_mut!(ADDR) = addr.raw };
    next(&REAL_EXIT, c"_exit");
    next(&REAL_EXIT2, c"_Exit");
    let sa = real_sigaction();
    // SAFETY: dlsym of the loader's public debugger interface.
    let r = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"_r_debug".as_ptr()) };
    R_DEBUG.store(r as usize, Ordering::Release);
    cuda_loaded();
    ADDR_LEN.store(addr.len as usize, Ordering::Release);
    for sig in 1..=64 {
        if !guarded(sig) {
            continue;
        }
        // SAFETY: a query into a zeroed sigaction.
        let mut cur: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { sa(sig, std::ptr::null(), &mut cur) } == 0 && cur.sa_sigaction == libc::SIG_DFL {
            install(sig, Some(&cur), std::ptr::null_mut());
        }
    }
    register_exit_handler();
    // SAFETY: as above; only the child handler is given.
    unsafe { libc::pthread_atfork(None, None, Some(forget_pending)) };
}

/// In a forked child: the parent's announced deaths are not the child's.
extern "C" fn forget_pending() {
    for (i, slot) in PENDING.iter().enumerate() {
        let fd = slot.swap(-1, Ordering::SeqCst);
        if fd >= 0 && inode_of(fd).is_some_and(|ino| ino == PENDING_INO[i].load(Ordering::SeqCst)) {
            // SAFETY: the child's copy of the parent's connection.
            unsafe { libc::close(fd) };
        }
    }
}

#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = init;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_are_classified_by_si_code_not_by_sender() {
        let me = 100;
        // A fault from the kernel, and int3's SI_KERNEL.
        assert!(origin(libc::SIGSEGV, 1, 0, me) == Origin::Fault);
        assert!(origin(libc::SIGTRAP, 0x80, 0, me) == Origin::Fault);
        // Ctrl-C, alarm, SIGXCPU: SI_KERNEL, no sender pid.
        assert!(origin(libc::SIGINT, 0x80, 0, me) == Origin::Async);
        assert!(origin(libc::SIGALRM, 0x80, 0, me) == Origin::Async);
        // A POSIX timer (SI_TIMER).
        assert!(origin(libc::SIGTERM, -2, 0, me) == Origin::Async);
        // kill from another pid namespace: sender 0.
        assert!(origin(libc::SIGTERM, 0, 0, me) == Origin::Async);
        assert!(origin(libc::SIGTERM, 0, 7, me) == Origin::Async);
        // raise/abort, and the kernel's SIGPIPE for our own write.
        assert!(origin(libc::SIGABRT, -6, me, me) == Origin::Own);
        assert!(origin(libc::SIGPIPE, 0, me, me) == Origin::Own);
        // SIGSEGV sent with kill is no fault.
        assert!(origin(libc::SIGSEGV, 0, 7, me) == Origin::Async);
    }
}
