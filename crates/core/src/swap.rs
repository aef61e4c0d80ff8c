//! gpusnap's side of fast swap: asks a program's preload library (run under
//! `gpusnap run --light --fast-swap`) to move its served allocations to
//! pinned host memory (`offload`) and back (`restore`), or what it holds
//! (`status`), over the library's control socket: an abstract unix socket
//! `@gpusnap-swap-PID-RANDOM` (see crates/preload/src/fastswap/control.rs).
//! The answer counts only from the process itself: the socket is looked for
//! only among those `pid` holds (its descriptors, matched by inode in its
//! network namespace's socket table), and the listener must be `pid` itself
//! (a pidfd of the peer, `SO_PEERPIDFD`; on kernels without it, the peer's
//! pid and uid). A name bound by a process that held that pid once, or by
//! anyone else, is never asked.

use gpusnap_wire::sock;
use gpusnap_wire::swap::{Reply, Status};
use serde::Serialize;
use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

pub use gpusnap_wire::names::{FAST_SWAP_ENV, KEEP_PINNED_ENV};
pub use gpusnap_wire::swap::Request;

/// How long an offload or restore may go without a word from the library
/// (it says `progress` every second while it works): a stopped, frozen or
/// wedged process fails the request this soon.
const STALL_LIMIT: Duration = Duration::from_secs(30);
/// How long an offload or restore may take in all (55 GB at 2 GB/s, with room).
const WORK_LIMIT: Duration = Duration::from_secs(600);
/// The most candidate sockets tried for one process.
const MAX_CANDIDATES: usize = 4;
/// How long a status request may take (a stopped process never answers).
const STATUS_LIMIT: Duration = Duration::from_secs(5);

/// What the library holds, as its status line says.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SwapStatus {
    /// `resident`, `offloading`, `offloaded`, `restoring`.
    pub phase: String,
    /// Allocations the library serves (moved by a fast swap).
    pub movable: u64,
    pub movable_bytes: u64,
    /// Of those, the physical allocations the program made and mapped
    /// itself through the VMM API (`cuMemCreate` + `cuMemMap`).
    pub vmm: u64,
    pub vmm_bytes: u64,
    /// Allocations left with the driver (its checkpoint moves them).
    pub kept: u64,
    pub kept_bytes: u64,
    /// Why they were left with the driver.
    pub kept_why: Vec<String>,
    /// `cuIpcGetMemHandle` calls refused on served memory (CUDA IPC cannot
    /// share it: such a program should run without fast swap).
    pub ipc_refused: u64,
    /// Threads inside a driver call the library gates (launches, copies,
    /// synchronizes, queries) now: 0 once an offload has quiesced the
    /// program, and the driver may lock it.
    pub inside: u64,
    /// Pinned host bytes the library holds now (copies under way, away, or
    /// kept), and its budget for them (0: none).
    pub pinned_bytes: u64,
    pub pin_budget: u64,
}

impl From<Status> for SwapStatus {
    fn from(s: Status) -> Self {
        SwapStatus {
            phase: s.phase.word().to_string(),
            movable: s.movable,
            movable_bytes: s.movable_bytes,
            vmm: s.vmm,
            vmm_bytes: s.vmm_bytes,
            kept: s.kept,
            kept_bytes: s.kept_bytes,
            kept_why: s.kept_why,
            ipc_refused: s.ipc_refused,
            inside: s.inside,
            pinned_bytes: s.pinned_bytes,
            pin_budget: s.pin_budget.unwrap_or(0),
        }
    }
}

impl SwapStatus {
    pub fn offloaded(&self) -> bool {
        self.phase == "offloaded"
    }

    /// Its memory is not all in place: offloaded, or on its way out or
    /// back (a request the library finishes on its own, even when the
    /// gpusnap that asked is gone).
    pub fn away(&self) -> bool {
        matches!(self.phase.as_str(), "offloaded" | "offloading" | "restoring")
    }
}

/// The answer to an offload or restore.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// Done: bytes moved, the library's own milliseconds, its status after,
    /// and its phases (`copy_ms`, `release_ms`, `map_ms`: name and ms).
    Done { bytes: u64, ms: u64, status: SwapStatus, phases: Vec<(String, u64)> },
    /// Refused or failed: a word (`no-memory`, `busy`, `driver`, ...) and
    /// the library's detail; nothing was given back or taken.
    Failed { kind: String, detail: String },
}

/// Connects to `pid`'s library; `None` when it has no fast swap (it holds
/// no control socket) or the listener is not `pid` itself.
fn connect(pid: i32) -> Option<UnixStream> {
    for name in names_held(pid) {
        let Ok(s) = sock::connect_abstract(name.trim_start_matches('@')) else { continue };
        match sock::peer_is(&s, pid) {
            Ok(()) => return Some(s),
            Err(why) => tracing::warn!(pid, "fast swap socket {name} of {pid}: {why}: ignored"),
        }
    }
    None
}

/// The inodes of the sockets `pid` holds open.
fn socket_inodes(pid: i32) -> HashSet<u64> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return HashSet::new() };
    dir.flatten()
        .filter_map(|e| {
            let link = std::fs::read_link(e.path()).ok()?;
            let s = link.to_str()?;
            s.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
        })
        .collect()
}

/// The names of the listening fast-swap sockets `pid` holds: its network
/// namespace's unix socket table, read line by line (it may be large on a
/// busy host), kept only where the inode is one of `pid`'s own.
fn names_held(pid: i32) -> Vec<String> {
    let held = socket_inodes(pid);
    if held.is_empty() {
        return Vec::new();
    }
    let Ok(f) = std::fs::File::open(format!("/proc/{pid}/net/unix")) else { return Vec::new() };
    let mut out = Vec::new();
    for line in BufReader::new(f).split(b'\n').map_while(Result::ok) {
        let Ok(line) = std::str::from_utf8(&line) else { continue };
        if let Some(name) = listening_name(line).filter(|(ino, _)| held.contains(ino)).map(|(_, n)| n) {
            if !out.contains(&name) {
                out.push(name);
            }
            if out.len() == MAX_CANDIDATES {
                break;
            }
        }
    }
    out
}

/// A line of `/proc/net/unix` naming a listening stream socket whose
/// abstract name is a control socket's: its inode and the name.
fn listening_name(line: &str) -> Option<(u64, String)> {
    let mut f = line.split(' ').filter(|w| !w.is_empty());
    let (_num, _refs, _proto, flags, kind, _st, inode) =
        (f.next()?, f.next()?, f.next()?, f.next()?, f.next()?, f.next()?, f.next()?);
    let path = f.next()?;
    let ok_name = gpusnap_wire::names::swap_name_shown(path).is_some();
    // __SO_ACCEPTCON (listening), SOCK_STREAM, and nothing after the name.
    (flags == "00010000" && kind == "0001" && ok_name && f.next().is_none())
        .then(|| Some((inode.parse().ok()?, path.to_string())))
        .flatten()
}

/// Sends `req` and reads the one-line answer (each line at most 4 KiB).
/// A status must come within `STATUS_LIMIT`; an offload or restore may
/// take up to `WORK_LIMIT` as long as the library says `progress` at least
/// every `STALL_LIMIT`.
fn ask(pid: i32, req: Request) -> Option<Result<Reply, String>> {
    let work = req != Request::Status;
    let s = connect(pid)?;
    let _ = s.set_read_timeout(Some(if work { STALL_LIMIT } else { STATUS_LIMIT }));
    let _ = s.set_write_timeout(Some(STATUS_LIMIT));
    if let Err(e) = (&s).write_all(req.encode().as_bytes()) {
        return Some(Err(format!("fast swap {req}: {e}")));
    }
    let t = Instant::now();
    let mut reader = BufReader::new(&s);
    loop {
        let mut line = String::new();
        let got = (&mut reader).take(4096).read_line(&mut line);
        match got {
            Ok(0) => return Some(Err(format!("fast swap {req}: the process closed the connection"))),
            Ok(_) => match Reply::parse(&line) {
                Ok(Reply::Progress { .. }) if work && t.elapsed() < WORK_LIMIT => continue,
                Ok(Reply::Progress { .. }) => {
                    return Some(Err(format!("fast swap {req}: not done after {} s", WORK_LIMIT.as_secs())))
                }
                Ok(reply) => return Some(Ok(reply)),
                Err(e) => return Some(Err(format!("fast swap {req}: {e}"))),
            },
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                let quiet = if work { STALL_LIMIT } else { STATUS_LIMIT };
                return Some(Err(format!(
                    "fast swap {req}: no word from the process in {} s",
                    quiet.as_secs()
                )));
            }
            Err(e) => return Some(Err(format!("fast swap {req}: {e}"))),
        }
    }
}

/// What `pid`'s library holds; `None` for a process without fast swap.
pub fn status(pid: i32) -> Option<SwapStatus> {
    match ask(pid, Request::Status)?.ok()? {
        Reply::Status(s) => Some(s.into()),
        _ => None,
    }
}

/// Whether `pid` was started for fast swap (`GPUSNAP_FAST_SWAP=1` in its
/// environment as it began, and the preload library mapped): such a
/// process without a control socket has fast swap off, and said why on its
/// standard error.
pub fn asked(pid: i32) -> bool {
    let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    let wanted = format!("{FAST_SWAP_ENV}=1");
    if !env.split(|b| *b == 0).any(|v| v == wanted.as_bytes()) {
        return false;
    }
    let Ok(maps) = std::fs::File::open(format!("/proc/{pid}/maps")) else { return false };
    BufReader::new(maps).lines().map_while(Result::ok).any(|l| l.ends_with("/libgpusnap_preload.so"))
}

/// Whether `pid` was started for fast swap ([`asked`]) and holds no
/// listening control socket: its library could not bind one (it said why
/// on its standard error), so fast swap is off in it.
pub fn unbound(pid: i32) -> bool {
    asked(pid) && names_held(pid).is_empty()
}

/// Asks for `offload` or `restore`; `None` for a process without fast swap.
pub fn request(pid: i32, what: Request) -> Option<Result<Answer, String>> {
    Some(ask(pid, what)?.and_then(|r| answer_of(what, r)))
}

/// The library's answer to an offload or restore.
fn answer_of(what: Request, reply: Reply) -> Result<Answer, String> {
    match reply {
        Reply::Done(d) => {
            Ok(Answer::Done { bytes: d.bytes, ms: d.ms, status: d.status.into(), phases: d.phases })
        }
        Reply::Failed { kind, detail } => Ok(Answer::Failed { kind, detail }),
        other => Err(format!("fast swap {what}: an answer that is not one: {other:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(line: &str) -> Reply {
        Reply::parse(line).unwrap()
    }

    #[test]
    fn status_lines_are_read_by_key() {
        let Reply::Status(s) = reply(
            "ok phase=offloaded gate=closed inside=0 movable=3 movable_bytes=100 kept=1 kept_bytes=7 \
             kept_why=managed_(cuMemAllocManaged) pin_budget=-",
        ) else {
            panic!()
        };
        let s = SwapStatus::from(s);
        assert!(s.offloaded());
        assert_eq!((s.movable, s.movable_bytes, s.kept, s.kept_bytes, s.pin_budget), (3, 100, 1, 7, 0));
        assert_eq!(s.kept_why, vec!["managed (cuMemAllocManaged)".to_string()]);
    }

    #[test]
    fn answers_carry_bytes_time_and_phases() {
        let a = answer_of(
            Request::Offload,
            reply("ok bytes=42 ms=9 map_ms=3 copy_ms=5 phase=resident movable=1"),
        );
        let Ok(Answer::Done { bytes, ms, status, phases }) = a else { panic!("{a:?}") };
        assert_eq!((bytes, ms, status.phase.as_str()), (42, 9, "resident"));
        assert_eq!(phases, vec![("map".to_string(), 3), ("copy".to_string(), 5)]);
        let f = answer_of(Request::Offload, reply("error no-memory: mapping 8 bytes"));
        assert_eq!(f, Ok(Answer::Failed { kind: "no-memory".into(), detail: "mapping 8 bytes".into() }));
        assert!(answer_of(Request::Restore, reply("ok phase=resident")).is_err());
    }

    #[test]
    fn only_listening_control_sockets_are_named() {
        let ok = "0000000000000000: 00000002 00000000 00010000 0001 01 4242 @gpusnap-swap-7-00ff";
        assert_eq!(listening_name(ok), Some((4242, "@gpusnap-swap-7-00ff".to_string())));
        // Connected, not listening; a datagram socket; another name; a
        // name with more after it.
        for bad in [
            "0000000000000000: 00000003 00000000 00000000 0001 03 4242 @gpusnap-swap-7-00ff",
            "0000000000000000: 00000002 00000000 00010000 0002 01 4242 @gpusnap-swap-7-00ff",
            "0000000000000000: 00000002 00000000 00010000 0001 01 4242 @other",
            "0000000000000000: 00000002 00000000 00010000 0001 01 4242 @gpusnap-swap-7 x",
            "0000000000000000: 00000002 00000000 00010000 0001 01 4242 /run/gpusnap-swap-7",
        ] {
            assert_eq!(listening_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_process_without_fast_swap_has_no_status() {
        assert_eq!(status(std::process::id() as i32), None);
    }
}
