//! Starting a program under the guard (held before exec until the guard is
//! attached), and the guard's standby keeper.

use gpusnap_core::error::Error;
use std::ffi::{CString, OsString};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

pub fn signal_name(sig: i32) -> String {
    nix::sys::signal::Signal::try_from(sig)
        .map(|s| s.as_str().to_string())
        .unwrap_or_else(|_| format!("SIGRT{sig}"))
}

/// A program started under the guard, still held before exec.
pub struct Launched {
    pub pid: i32,
    go: OwnedFd,
}

impl Launched {
    /// Lets the child exec the program.
    pub fn release(self) {
        // SAFETY: writing one byte to a pipe we own.
        unsafe { libc::write(self.go.as_raw_fd(), b"g".as_ptr().cast(), 1) };
    }
}

/// Forks the program: the child installs the exit_group filter, waits for
/// the guard to be attached (a byte on a pipe), then execs `cmd`.
pub fn launch(cmd: &[OsString]) -> Result<Launched, Error> {
    let prog = |e: String| Error::Proc { pid: 0, reason: e };
    if cmd.is_empty() {
        return Err(prog("no command given".into()));
    }
    // Everything the child needs is prepared here: after fork it may only
    // make async-signal-safe calls.
    let args: Vec<CString> = cmd
        .iter()
        .map(|a| CString::new(a.as_bytes()))
        .collect::<Result<_, _>>()
        .map_err(|e| prog(e.to_string()))?;
    let mut argv: Vec<*const libc::c_char> = args.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    // A program whose session leader is outside its pid namespace cannot be
    // dumped by CRIU (hibernate refuses it): where ours is, the program gets
    // a session of its own. Where ours is visible it keeps it, and with it
    // the terminal and job control.
    let own_session = gpusnap_core::target::session_leader_visible_self() == Some(false);
    let mut ready = [0; 2];
    let mut go = [0; 2];
    // SAFETY: pipe2 fills two fds.
    if unsafe { libc::pipe2(ready.as_mut_ptr(), libc::O_CLOEXEC) } != 0
        // SAFETY: as above.
        || unsafe { libc::pipe2(go.as_mut_ptr(), libc::O_CLOEXEC) } != 0
    {
        return Err(prog(format!("pipe: {}", std::io::Error::last_os_error())));
    }
    // SAFETY: fork; the child branch below only makes async-signal-safe calls.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(prog(format!("fork: {}", std::io::Error::last_os_error())));
    }
    if pid == 0 {
        // SAFETY: child after fork: raw syscalls only, then exec or _exit.
        unsafe {
            let mut code: i32 = 0;
            if own_session {
                libc::setsid();
            }
            if let Err(e) = crate::seccomp::install_in_child() {
                code = e;
            }
            libc::write(ready[1], (&code as *const i32).cast(), 4);
            let mut b = 0u8;
            if libc::read(go[0], (&mut b as *mut u8).cast(), 1) != 1 || code != 0 {
                libc::_exit(126);
            }
            libc::execvp(argv[0], argv.as_ptr());
            // exec failed: report the errno as the shells do (127).
            libc::_exit(127);
        }
    }
    // SAFETY: fds we own; close the child's ends.
    let (r, gr) = unsafe {
        libc::close(ready[1]);
        libc::close(go[0]);
        (OwnedFd::from_raw_fd(ready[0]), OwnedFd::from_raw_fd(go[1]))
    };
    let mut code = [0u8; 4];
    // SAFETY: reading 4 bytes into a buffer of 4.
    let n = unsafe { libc::read(r.as_raw_fd(), code.as_mut_ptr().cast(), 4) };
    let code = i32::from_ne_bytes(code);
    if n != 4 || code != 0 {
        return Err(prog(format!(
            "could not install the exit filter: {}",
            std::io::Error::from_raw_os_error(if code == 0 { libc::EIO } else { code })
        )));
    }
    Ok(Launched { pid, go: gr })
}

/// Starts the standby keeper: a process outside the guard's tree that waits
/// for this guard to die and then starts `gpusnap guard --takeover` so the
/// guarded programs are re-attached. `argv` is the full command to exec.
pub fn start_keeper(argv: &[OsString]) -> Result<(), Error> {
    let me = std::process::id() as i32;
    let pidfd = crate::seccomp::pidfd_open(me)
        .map_err(|e| Error::Proc { pid: me, reason: format!("pidfd_open: {e}") })?;
    let args: Vec<CString> = argv
        .iter()
        .map(|a| CString::new(a.as_bytes()))
        .collect::<Result<_, _>>()
        .map_err(|e| Error::Proc { pid: me, reason: e.to_string() })?;
    let mut cargv: Vec<*const libc::c_char> = args.iter().map(|a| a.as_ptr()).collect();
    cargv.push(std::ptr::null());
    let exe = CString::new("/proc/self/exe").expect("no NUL");
    // SAFETY: double fork; the children only make async-signal-safe calls
    // before exec.
    unsafe {
        let first = libc::fork();
        if first < 0 {
            return Err(Error::Proc { pid: me, reason: "fork".into() });
        }
        if first == 0 {
            libc::setsid();
            if libc::fork() != 0 {
                libc::_exit(0);
            }
            // The keeper holds nothing of the guard's but its pidfd (moved to
            // fd 3): a pipe end kept open here would keep whoever waits on
            // the other end waiting.
            libc::dup2(pidfd.as_raw_fd(), 3);
            libc::syscall(libc::SYS_close_range, 4u32, u32::MAX, 0u32);
            // The keeper: wait until the guard is gone, then exec a new guard.
            let mut p = libc::pollfd { fd: 3, events: libc::POLLIN, revents: 0 };
            while libc::poll(&mut p, 1, -1) < 0 {}
            let devnull = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
            libc::dup2(devnull, 0);
            libc::dup2(devnull, 1);
            libc::dup2(devnull, 2);
            libc::execv(exe.as_ptr(), cargv.as_ptr());
            libc::_exit(127);
        }
        let mut st = 0;
        libc::waitpid(first, &mut st, 0);
    }
    Ok(())
}
