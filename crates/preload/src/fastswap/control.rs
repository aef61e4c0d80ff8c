//! The library's control socket: gpusnap asks it to `offload`, `restore`,
//! or report its `status`. An abstract unix socket whose name carries the
//! pid and 128 random bits (`@gpusnap-swap-PID-RANDOM`): nobody can bind it
//! before the library does, so no other process can hold the name a program
//! will need, and no file is left behind or collides when CRIU restores the
//! process, which it re-creates with the rest. gpusnap finds the name among
//! the sockets the process itself holds and checks that the listener is
//! that very process (crates/core/src/swap.rs). Only the program's own user
//! or root may ask (peer credentials); one request at a time, each line
//! bounded, each read bounded in time. While an offload or restore runs,
//! a `progress` line goes out every second: gpusnap gives up on a request
//! only when they stop.

use super::{swap, table};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Requests being answered now, and the most at once.
static ANSWERING: AtomicUsize = AtomicUsize::new(0);
const MAX_ANSWERING: usize = 8;
/// The listening socket's descriptor (closed in a forked child, which
/// must never answer for its parent).
static LISTENER: AtomicI32 = AtomicI32::new(-1);
/// How often a running offload or restore says it is still at work.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// The abstract name of process `pid`'s socket (without the leading NUL):
/// the pid for people reading `ss -xl`, and 128 random bits so that no one
/// can take the name first. `GPUSNAP_FAST_SWAP_NAME` replaces the whole
/// name (tests: a name taken in advance).
fn name(pid: u32) -> Option<String> {
    if let Some(n) = std::env::var("GPUSNAP_FAST_SWAP_NAME").ok().filter(|n| !n.is_empty()) {
        return Some(n);
    }
    let mut r = [0u8; 16];
    // SAFETY: getrandom fills at most `r.len()` bytes of `r`.
    let got = unsafe { libc::getrandom(r.as_mut_ptr().cast(), r.len(), 0) };
    if got != r.len() as isize {
        return None;
    }
    let hex: String = r.iter().map(|b| format!("{b:02x}")).collect();
    Some(format!("gpusnap-swap-{pid}-{hex}"))
}

/// Binds the socket and answers on a thread of its own. A socket that
/// cannot be had is said on standard error: fast swap is off in this
/// process (`gpusnap doctor PID` names it too), the driver's checkpoint
/// moves everything.
pub fn serve() {
    let pid = std::process::id();
    let Some(name) = name(pid) else {
        eprintln!(
            "gpusnap: fast swap is off in process {pid}: no random bytes for its control socket's name"
        );
        return;
    };
    let listener = match bind(&name) {
        Ok(l) => l,
        Err(e) => {
            eprintln!(
                "gpusnap: fast swap is off in process {pid}: cannot listen on @{name} ({e}); \
                 the driver's checkpoint moves all its memory"
            );
            return;
        }
    };
    LISTENER.store(listener.as_raw_fd(), Ordering::SeqCst);
    let _ = std::thread::Builder::new().name("gpusnap-swap".into()).spawn(move || {
        for conn in listener.incoming().flatten() {
            // Who asks is known at once: a stranger never takes one of the
            // few places below (they would hold them for the read's time).
            if !allowed(&conn) {
                let _ = (&conn).write_all(b"error denied: not allowed\n");
                continue;
            }
            // A thread per request (a status is answered while an offload
            // runs), at most a few at once.
            if ANSWERING.fetch_add(1, Ordering::SeqCst) >= MAX_ANSWERING {
                ANSWERING.fetch_sub(1, Ordering::SeqCst);
                let _ = (&conn).write_all(b"error busy: too many requests\n");
                continue;
            }
            let spawned = std::thread::Builder::new().name("gpusnap-swap-req".into()).spawn(move || {
                answer(conn);
                ANSWERING.fetch_sub(1, Ordering::SeqCst);
            });
            if spawned.is_err() {
                ANSWERING.fetch_sub(1, Ordering::SeqCst);
            }
        }
    });
}

fn bind(name: &str) -> std::io::Result<UnixListener> {
    let err = std::io::Error::last_os_error;
    // SAFETY: a new socket; fd ownership moves to OwnedFd below.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(err());
    }
    // SAFETY: the fd just made, owned once.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_un is plain data.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = name.as_bytes();
    if bytes.len() + 1 >= addr.sun_path.len() {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "name too long"));
    }
    for (d, s) in addr.sun_path[1..].iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + bytes.len();
    // SAFETY: a valid address of `len` bytes.
    if unsafe { libc::bind(fd, (&addr as *const libc::sockaddr_un).cast(), len as libc::socklen_t) } != 0 {
        return Err(err());
    }
    // SAFETY: a bound socket.
    if unsafe { libc::listen(fd, 4) } != 0 {
        return Err(err());
    }
    Ok(UnixListener::from(owned))
}

/// In a forked child: the parent's listening socket is not the child's to
/// answer on (the child has no thread accepting on it, and gpusnap must
/// never reach a process other than the one that listened).
pub fn forget() {
    let fd = LISTENER.swap(-1, Ordering::SeqCst);
    if fd >= 0 {
        // SAFETY: the child's copy of the parent's listening socket, which
        // nothing else in the child uses.
        unsafe { libc::close(fd) };
    }
}

fn peer_uid(s: &UnixStream) -> Option<u32> {
    // SAFETY: ucred is plain data; getsockopt fills at most `len` bytes.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: a valid socket fd and a buffer of `len` bytes.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (r == 0).then_some(cred.uid)
}

/// The status line: where the memory is, and what is served and kept.
pub fn status_line() -> String {
    let (n, bytes, mut kept, mut kept_bytes, mut why) = table::summary();
    let (vmm, vmm_bytes, vmm_kept) = super::program::summary();
    for (b, w) in vmm_kept {
        kept += 1;
        kept_bytes += b;
        why.push(w);
    }
    why.sort_unstable();
    why.dedup();
    let (n, bytes) = (n + vmm, bytes + vmm_bytes);
    let why = if why.is_empty() { "-".to_string() } else { why.join(",").replace(' ', "_") };
    format!(
        "phase={} gate={} inside={} movable={n} movable_bytes={bytes} vmm={vmm} vmm_bytes={vmm_bytes} kept={kept} kept_bytes={kept_bytes} kept_why={why} ungated={} pin={} keep={} ipc_refused={} pinned_bytes={} pin_budget={}",
        swap::phase().name(),
        if super::gate::is_closed() { "closed" } else { "open" },
        super::gate::inside(),
        super::gate::UNGATED.load(Ordering::Relaxed),
        super::hostmem::how().name(),
        u8::from(swap::KEEP.load(Ordering::Relaxed)),
        table::IPC_REFUSED.load(Ordering::Relaxed),
        super::hostmem::PINNED.load(Ordering::Relaxed),
        match super::prepin::BUDGET.load(Ordering::Relaxed) {
            u64::MAX => "-".to_string(),
            b => b.to_string(),
        }
    )
}

/// Only the program's own user or root may ask.
fn allowed(conn: &UnixStream) -> bool {
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    peer_uid(conn).is_some_and(|u| u == 0 || u == me)
}

fn answer(conn: UnixStream) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
    let _ = conn.set_write_timeout(Some(PROGRESS_EVERY));
    let mut line = String::new();
    if BufReader::new((&conn).take(256)).read_line(&mut line).is_err() {
        return;
    }
    let reply = match line.trim() {
        "status" => format!("ok {}\n", status_line()),
        what @ ("offload" | "restore") => work(&conn, what),
        _ => "error unknown: unknown request\n".to_string(),
    };
    let _ = (&conn).write_all(reply.as_bytes());
}

/// Runs an offload or restore, saying `progress ms=N` every second while
/// it runs; returns the answer line. A gpusnap that stopped reading (or
/// left) changes nothing: the work finishes on its own.
fn work(conn: &UnixStream, what: &str) -> String {
    let t = Instant::now();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        let spawned =
            std::thread::Builder::new().name("gpusnap-swap-work".into()).spawn_scoped(s, move || {
                let done = if what == "offload" { swap::offload() } else { swap::restore() };
                let _ = tx.send(done);
            });
        if let Err(e) = spawned {
            return format!("error busy: no thread for the {what}: {e}\n");
        }
        let mut heard = true;
        loop {
            match rx.recv_timeout(PROGRESS_EVERY) {
                Ok(Ok(b)) => {
                    return format!(
                        "ok bytes={b} ms={} {} {}\n",
                        swap::ms(t),
                        swap::phase_words(what),
                        status_line()
                    )
                }
                Ok(Err(f)) => return format!("error {}: {}\n", f.kind, f.detail),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) if heard => {
                    heard = (&*conn).write_all(format!("progress ms={}\n", swap::ms(t)).as_bytes()).is_ok();
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    return format!("error driver: the {what} ended without an answer\n")
                }
            }
        }
    })
}
