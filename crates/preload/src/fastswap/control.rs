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
use gpusnap_wire::names;
use gpusnap_wire::sock;
use gpusnap_wire::swap::{Done, Phase, Reply, Request, Status};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixStream;
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
    if let Some(n) = std::env::var(names::FAST_SWAP_NAME_ENV).ok().filter(|n| !n.is_empty()) {
        return Some(n);
    }
    let mut r = [0u8; 16];
    // SAFETY: getrandom fills at most `r.len()` bytes of `r`.
    let got = unsafe { libc::getrandom(r.as_mut_ptr().cast(), r.len(), 0) };
    if got != r.len() as isize {
        return None;
    }
    Some(names::swap_name(pid, &r))
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
    let listener = match sock::listen_abstract(&name, 4) {
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
                let _ = (&conn).write_all(failed("denied", "not allowed").as_bytes());
                continue;
            }
            // A thread per request (a status is answered while an offload
            // runs), at most a few at once.
            if ANSWERING.fetch_add(1, Ordering::SeqCst) >= MAX_ANSWERING {
                ANSWERING.fetch_sub(1, Ordering::SeqCst);
                let _ = (&conn).write_all(failed("busy", "too many requests").as_bytes());
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

/// An `error KIND: DETAIL` answer line.
fn failed(kind: &str, detail: impl Into<String>) -> String {
    Reply::Failed { kind: kind.to_string(), detail: detail.into() }.encode()
}

/// The library's status: where the memory is, and what is served and kept.
pub fn status() -> Status {
    let (n, bytes, mut kept, mut kept_bytes, mut why) = table::summary();
    let (vmm, vmm_bytes, vmm_kept) = super::program::summary();
    for (b, w) in vmm_kept {
        kept += 1;
        kept_bytes += b;
        why.push(w);
    }
    why.sort_unstable();
    why.dedup();
    Status {
        phase: match swap::phase() {
            swap::Phase::Resident => Phase::Resident,
            swap::Phase::Offloading => Phase::Offloading,
            swap::Phase::Offloaded => Phase::Offloaded,
            swap::Phase::Restoring => Phase::Restoring,
        },
        gate_closed: super::gate::is_closed(),
        inside: super::gate::inside() as u64,
        movable: (n + vmm) as u64,
        movable_bytes: bytes + vmm_bytes,
        vmm: vmm as u64,
        vmm_bytes,
        kept: kept as u64,
        kept_bytes,
        kept_why: why.into_iter().map(str::to_string).collect(),
        ungated: super::gate::UNGATED.load(Ordering::Relaxed) as u64,
        pin: super::hostmem::how().name().to_string(),
        keep: swap::KEEP.load(Ordering::Relaxed),
        ipc_refused: table::IPC_REFUSED.load(Ordering::Relaxed),
        pinned_bytes: super::hostmem::PINNED.load(Ordering::Relaxed),
        pin_budget: match super::prepin::BUDGET.load(Ordering::Relaxed) {
            u64::MAX => None,
            b => Some(b),
        },
    }
}

/// Only the program's own user or root may ask.
fn allowed(conn: &UnixStream) -> bool {
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    sock::peer_cred(conn.as_fd()).is_ok_and(|c| c.uid == 0 || c.uid == me)
}

fn answer(conn: UnixStream) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
    let _ = conn.set_write_timeout(Some(PROGRESS_EVERY));
    let mut line = String::new();
    if BufReader::new((&conn).take(256)).read_line(&mut line).is_err() {
        return;
    }
    let reply = match Request::parse(&line) {
        Ok(Request::Status) => Reply::Status(status()).encode(),
        Ok(what) => work(&conn, what),
        Err(_) => failed("unknown", "unknown request"),
    };
    let _ = (&conn).write_all(reply.as_bytes());
}

/// Runs an offload or restore, saying `progress ms=N` every second while
/// it runs; returns the answer line. A gpusnap that stopped reading (or
/// left) changes nothing: the work finishes on its own.
fn work(conn: &UnixStream, what: Request) -> String {
    let t = Instant::now();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        let spawned =
            std::thread::Builder::new().name("gpusnap-swap-work".into()).spawn_scoped(s, move || {
                let done = if what == Request::Offload { swap::offload() } else { swap::restore() };
                let _ = tx.send(done);
            });
        if let Err(e) = spawned {
            return failed("busy", format!("no thread for the {what}: {e}"));
        }
        let mut heard = true;
        loop {
            match rx.recv_timeout(PROGRESS_EVERY) {
                Ok(Ok(bytes)) => {
                    let phases = swap::phases(what == Request::Offload);
                    return Reply::Done(Done { bytes, ms: swap::ms(t), phases, status: status() }).encode();
                }
                Ok(Err(f)) => return failed(f.kind, f.detail),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) if heard => {
                    let progress = Reply::Progress { ms: swap::ms(t) }.encode();
                    heard = (&*conn).write_all(progress.as_bytes()).is_ok();
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    return failed("driver", format!("the {what} ended without an answer"))
                }
            }
        }
    })
}
