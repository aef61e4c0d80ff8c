//! The library's control socket: gpusnap asks it to `offload`, `restore`,
//! or report its `status`. An abstract unix socket named after the process
//! (`@gpusnap-swap-PID`): no file to leave behind or to collide with when
//! CRIU restores the process, which it re-creates with the rest. Only the
//! program's own user or root may ask (peer credentials); one request at a
//! time, each line bounded, each read bounded in time.

use super::{swap, table};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Requests being answered now, and the most at once.
static ANSWERING: AtomicUsize = AtomicUsize::new(0);
const MAX_ANSWERING: usize = 8;

/// The abstract name of process `pid`'s socket (without the leading NUL).
pub fn name(pid: u32) -> String {
    format!("gpusnap-swap-{pid}")
}

/// Binds the socket and answers on a thread of its own.
pub fn serve() {
    let pid = std::process::id();
    let Some(listener) = bind(&name(pid)) else { return };
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

fn bind(name: &str) -> Option<UnixListener> {
    // SAFETY: a new socket; fd ownership moves to OwnedFd below.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: the fd just made, owned once.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_un is plain data.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = name.as_bytes();
    if bytes.len() + 1 >= addr.sun_path.len() {
        return None;
    }
    for (d, s) in addr.sun_path[1..].iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + bytes.len();
    // SAFETY: a valid address of `len` bytes.
    let r = unsafe { libc::bind(fd, (&addr as *const libc::sockaddr_un).cast(), len as libc::socklen_t) };
    // SAFETY: a bound socket.
    if r != 0 || unsafe { libc::listen(fd, 4) } != 0 {
        return None;
    }
    Some(UnixListener::from(owned))
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
    let mut line = String::new();
    if BufReader::new((&conn).take(256)).read_line(&mut line).is_err() {
        return;
    }
    let t = Instant::now();
    let reply = match line.trim() {
        "status" => format!("ok {}\n", status_line()),
        what @ ("offload" | "restore") => {
            let done = if what == "offload" { swap::offload() } else { swap::restore() };
            match done {
                Ok(b) => {
                    format!("ok bytes={b} ms={} {} {}\n", swap::ms(t), swap::phase_words(what), status_line())
                }
                Err(f) => format!("error {}: {}\n", f.kind, f.detail),
            }
        }
        _ => "error unknown: unknown request\n".to_string(),
    };
    let _ = (&conn).write_all(reply.as_bytes());
}
