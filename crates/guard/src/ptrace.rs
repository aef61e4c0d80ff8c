//! ptrace and the signals it stops on: seizing threads, waiting for their
//! stops, telling a fatal signal (and where it came from) from the rest.

use std::time::Duration;

pub(crate) const PTRACE_EVENT_STOP: i32 = 128;
pub(crate) const PTRACE_EVENT_SECCOMP: i32 = 7;

/// The process's threads (task ids).
pub fn threads_of(pid: i32) -> Vec<i32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|rd| rd.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect())
        .unwrap_or_default()
}

pub(crate) fn tgid_of(tid: i32) -> Option<i32> {
    procfs::process::Process::new(tid).ok()?.status().ok().map(|s| s.tgid)
}

/// Signals whose default action ends the process (terminate or core dump).
pub(crate) fn kills_by_default(sig: i32) -> bool {
    !matches!(
        sig,
        libc::SIGCHLD
            | libc::SIGCONT
            | libc::SIGURG
            | libc::SIGWINCH
            | libc::SIGSTOP
            | libc::SIGTSTP
            | libc::SIGTTIN
            | libc::SIGTTOU
    ) && sig > 0
        && sig != libc::SIGKILL
}

/// Whether `sig`, delivered to thread `tid` now, will end its process: the
/// default action kills and no handler is installed (SigCgt) and it is not
/// ignored (SigIgn). A synchronous fault (SEGV, BUS, ILL, FPE) on an ignored
/// or blocked signal is forced to its default by the kernel, so it kills too.
pub(crate) fn is_fatal(tid: i32, sig: i32) -> bool {
    if !kills_by_default(sig) {
        return false;
    }
    let Ok(status) = std::fs::read_to_string(format!("/proc/{tid}/status")) else { return false };
    let mask = |key: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .unwrap_or(0)
    };
    let bit = 1u64 << (sig - 1);
    if mask("SigCgt:") & bit != 0 {
        return false;
    }
    let fault = matches!(sig, libc::SIGSEGV | libc::SIGBUS | libc::SIGILL | libc::SIGFPE);
    fault || mask("SigIgn:") & bit == 0
}

/// The si_code and sender pid of the signal thread `tid` is stopped for
/// (the pid is 0 unless the code is one of a sent signal).
pub(crate) fn siginfo(tid: i32) -> Option<(i32, i32)> {
    // SAFETY: siginfo_t is plain data; PTRACE_GETSIGINFO fills it for a
    // tracee in a signal-delivery-stop.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above; the pointer is valid for the call.
    let r = unsafe {
        libc::ptrace(
            libc::PTRACE_GETSIGINFO,
            tid,
            std::ptr::null_mut::<libc::c_void>(),
            &mut info as *mut libc::siginfo_t,
        )
    };
    if r != 0 {
        return None;
    }
    // SI_USER (0), SI_QUEUE (-1), SI_TKILL (-6): sent by a process; for
    // these codes the kill fields are the valid ones.
    // SAFETY: as said.
    let from = if matches!(info.si_code, 0 | -1 | -6) { unsafe { info.si_pid() } } else { 0 };
    Some((info.si_code, from))
}

/// How a signal came, by si_code (the kernel's word), never by the sender's
/// pid alone: 0 is the kernel's and also any sender's in another pid
/// namespace (a container's SIGTERM). The preload library
/// (crates/preload) decides the same way; it cannot share this code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Origin {
    /// A fault of the stopped thread (SEGV, BUS, ILL, FPE, TRAP, SYS with a
    /// kernel code): it stands at a known instruction.
    Fault,
    /// Sent by the process to itself: `raise`, `abort`, the kernel's
    /// SIGPIPE for its own write.
    Own,
    /// Another process's `kill` (any namespace, `gpusnap run` forwarding
    /// one), a terminal's Ctrl-C or hang-up, `alarm`, SIGXCPU, a timer: the
    /// thread may have been stopped anywhere, even inside a driver call.
    Async,
}

pub(crate) fn origin(sig: i32, code: i32, sender: i32, pid: i32) -> Origin {
    let fault_sig = matches!(
        sig,
        libc::SIGSEGV | libc::SIGBUS | libc::SIGILL | libc::SIGFPE | libc::SIGTRAP | libc::SIGSYS
    );
    if code > 0 {
        return if fault_sig { Origin::Fault } else { Origin::Async };
    }
    if matches!(code, 0 | -1 | -6) && sender == pid && pid > 0 {
        return Origin::Own;
    }
    Origin::Async
}

pub(crate) enum Refused {
    /// Traced by this thread already.
    Ours,
    /// Exiting or gone.
    Ending,
    /// Traced by someone else, or not ours to trace.
    Other,
}

/// Why a PTRACE_SEIZE of `tid` answered EPERM. A thread of a program that
/// keeps making short-lived ones may be between its exit and its
/// disappearance from /proc, where the kernel refuses it and /proc still
/// shows it untraced; asked again a moment later it is gone.
pub(crate) fn seize_refused(tid: i32) -> Refused {
    // SAFETY: gettid has no preconditions.
    let me = unsafe { libc::gettid() };
    for _ in 0..20 {
        let Ok(status) = std::fs::read_to_string(format!("/proc/{tid}/status")) else {
            return Refused::Ending;
        };
        let field = |key: &str| status.lines().find_map(|l| l.strip_prefix(key)).map(str::trim).unwrap_or("");
        if matches!(field("State:").chars().next(), Some('Z' | 'X')) {
            return Refused::Ending;
        }
        match field("TracerPid:").parse::<i32>() {
            Ok(t) if t == me => return Refused::Ours,
            Ok(0) => {}
            _ => return Refused::Other,
        }
        std::thread::sleep(Duration::from_millis(1));
        match seize(tid).map_err(|e| e.raw_os_error()) {
            Ok(()) => return Refused::Ours,
            Err(Some(libc::ESRCH)) => return Refused::Ending,
            Err(_) => {}
        }
    }
    Refused::Other
}

/// One decoded waitpid status.
#[derive(Debug)]
pub(crate) enum Event {
    Exited(i32, i32),
    Signaled(i32, i32),
    /// A signal-delivery-stop.
    Signal(i32, i32),
    /// A ptrace event stop: (tid, event, stop signal).
    Ptrace(i32, i32, i32),
}

/// What waiting found: an event, nothing yet (or interrupted), or no tracee left.
pub(crate) enum Waited {
    Event(Event),
    Nothing,
    NoChildren,
}

pub(crate) fn wait_event(block: bool) -> Waited {
    let mut status = 0;
    let flags = libc::__WALL | if block { 0 } else { libc::WNOHANG };
    // SAFETY: waitpid writes one int.
    let pid = unsafe { libc::waitpid(-1, &mut status, flags) };
    if pid < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD) {
        return Waited::NoChildren;
    }
    match decode(pid, status) {
        Some(e) => Waited::Event(e),
        None => Waited::Nothing,
    }
}

pub(crate) fn wait_any(block: bool) -> Option<Event> {
    match wait_event(block) {
        Waited::Event(e) => Some(e),
        _ => None,
    }
}

pub(crate) fn decode(pid: i32, status: i32) -> Option<Event> {
    if pid <= 0 {
        return None;
    }
    Some(if libc::WIFEXITED(status) {
        Event::Exited(pid, libc::WEXITSTATUS(status))
    } else if libc::WIFSIGNALED(status) {
        Event::Signaled(pid, libc::WTERMSIG(status))
    } else if libc::WIFSTOPPED(status) {
        let event = (status >> 16) & 0xff;
        let sig = libc::WSTOPSIG(status);
        if event == 0 {
            Event::Signal(pid, sig)
        } else {
            Event::Ptrace(pid, event, sig)
        }
    } else {
        // WIFCONTINUED: nothing to do.
        return None;
    })
}

pub fn ptrace_raw(req: libc::c_uint, tid: i32, data: usize) -> std::io::Result<()> {
    // SAFETY: PTRACE_CONT/LISTEN/SEIZE/DETACH/INTERRUPT take integers only.
    let r =
        unsafe { libc::ptrace(req, tid, std::ptr::null_mut::<libc::c_void>(), data as *mut libc::c_void) };
    if r == -1 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

pub(crate) fn seize(tid: i32) -> std::io::Result<()> {
    let opts = libc::PTRACE_O_TRACECLONE
        | libc::PTRACE_O_TRACEFORK
        | libc::PTRACE_O_TRACEVFORK
        | libc::PTRACE_O_TRACEEXEC
        | libc::PTRACE_O_TRACESECCOMP;
    ptrace_raw(libc::PTRACE_SEIZE, tid, opts as usize)
}

pub(crate) fn cont(tid: i32, sig: i32) {
    if let Err(e) = ptrace_raw(libc::PTRACE_CONT, tid, sig as usize) {
        tracing::debug!(tid, "PTRACE_CONT: {e}");
    }
}
