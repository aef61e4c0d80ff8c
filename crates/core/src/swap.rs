//! gpusnap's side of fast swap: asks a program's preload library (run under
//! `gpusnap run --light --fast-swap`) to move its served allocations to
//! pinned host memory (`offload`) and back (`restore`), or what it holds
//! (`status`), over the library's control socket: the abstract unix socket
//! `@gpusnap-swap-PID` (see crates/preload/src/fastswap/control.rs). The
//! answer counts only from the process itself: the socket's peer must be
//! `pid` (peer credentials), so no other process can pose as it.

use serde::Serialize;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

/// The environment variable `run --light --fast-swap` sets for the library.
pub const FAST_SWAP_ENV: &str = "GPUSNAP_FAST_SWAP";
/// Set beside `FAST_SWAP_ENV` by `run --keep-pinned`: the library keeps its
/// pinned host copies after each resume.
pub const KEEP_PINNED_ENV: &str = "GPUSNAP_FAST_SWAP_KEEP";

/// How long an offload or restore may take (55 GB at 2 GB/s, with room).
const WORK_LIMIT: Duration = Duration::from_secs(600);
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

impl SwapStatus {
    fn parse(words: &[&str]) -> Self {
        let mut s = SwapStatus::default();
        for w in words {
            let Some((k, v)) = w.split_once('=') else { continue };
            let n = || v.parse::<u64>().unwrap_or(0);
            match k {
                "phase" => s.phase = v.to_string(),
                "movable" => s.movable = n(),
                "movable_bytes" => s.movable_bytes = n(),
                "kept" => s.kept = n(),
                "kept_bytes" => s.kept_bytes = n(),
                "ipc_refused" => s.ipc_refused = n(),
                "inside" => s.inside = n(),
                "vmm" => s.vmm = n(),
                "vmm_bytes" => s.vmm_bytes = n(),
                "pinned_bytes" => s.pinned_bytes = n(),
                "pin_budget" => s.pin_budget = n(),
                "kept_why" if v != "-" => s.kept_why = v.split(',').map(|x| x.replace('_', " ")).collect(),
                _ => {}
            }
        }
        s
    }

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

/// Connects to `pid`'s library; `None` when it has no fast swap (no one
/// listens) or the listener is not `pid` itself.
fn connect(pid: i32) -> Option<UnixStream> {
    // SAFETY: a new socket; ownership moves to OwnedFd.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: the fd just made, owned once.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_un is plain data.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let name = format!("gpusnap-swap-{pid}");
    for (d, s) in addr.sun_path[1..].iter_mut().zip(name.as_bytes()) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + name.len();
    // SAFETY: a valid address of `len` bytes.
    let r = unsafe { libc::connect(fd, (&addr as *const libc::sockaddr_un).cast(), len as libc::socklen_t) };
    if r != 0 {
        return None;
    }
    let s = UnixStream::from(owned);
    // SAFETY: ucred is plain data; getsockopt fills at most `len` bytes.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut clen = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: a valid socket and a buffer of `clen` bytes.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut clen,
        )
    };
    if r != 0 || cred.pid != pid {
        tracing::warn!(pid, peer = cred.pid, "fast swap socket of {pid} is held by another process: ignored");
        return None;
    }
    Some(s)
}

/// Sends `req` and reads the one-line answer (at most 4 KiB, within `limit`).
fn ask(pid: i32, req: &str, limit: Duration) -> Option<Result<Vec<String>, String>> {
    let s = connect(pid)?;
    let _ = s.set_read_timeout(Some(limit));
    let _ = s.set_write_timeout(Some(STATUS_LIMIT));
    if let Err(e) = (&s).write_all(format!("{req}\n").as_bytes()) {
        return Some(Err(format!("fast swap {req}: {e}")));
    }
    let mut line = String::new();
    match BufReader::new((&s).take(4096)).read_line(&mut line) {
        Ok(0) => Some(Err(format!("fast swap {req}: the process closed the connection"))),
        Ok(_) => Some(Ok(line.split_whitespace().map(str::to_string).collect())),
        Err(e) => Some(Err(format!("fast swap {req}: {e}"))),
    }
}

/// What `pid`'s library holds; `None` for a process without fast swap.
pub fn status(pid: i32) -> Option<SwapStatus> {
    let words = ask(pid, "status", STATUS_LIMIT)?.ok()?;
    let w: Vec<&str> = words.iter().map(String::as_str).collect();
    (w.first() == Some(&"ok")).then(|| SwapStatus::parse(&w[1..]))
}

/// Asks for `offload` or `restore`; `None` for a process without fast swap.
pub fn request(pid: i32, what: &str) -> Option<Result<Answer, String>> {
    let words = match ask(pid, what, WORK_LIMIT)? {
        Ok(w) => w,
        Err(e) => return Some(Err(e)),
    };
    let w: Vec<&str> = words.iter().map(String::as_str).collect();
    Some(Ok(answer_of(&w)))
}

/// The library's one-line answer, in words.
fn answer_of(w: &[&str]) -> Answer {
    match w.first() {
        Some(&"ok") => {
            let num = |k: &str| {
                w.iter().find_map(|x| x.strip_prefix(k)?.strip_prefix('=')?.parse::<u64>().ok()).unwrap_or(0)
            };
            let phases = w[1..]
                .iter()
                .filter_map(|x| {
                    let (k, v) = x.split_once('=')?;
                    let name = k.strip_suffix("_ms")?;
                    Some((name.to_string(), v.parse::<u64>().ok()?))
                })
                .collect();
            Answer::Done { bytes: num("bytes"), ms: num("ms"), status: SwapStatus::parse(&w[1..]), phases }
        }
        _ => {
            let kind = w.get(1).map(|k| k.trim_end_matches(':').to_string()).unwrap_or_default();
            Answer::Failed { kind, detail: w.get(2..).map(|d| d.join(" ")).unwrap_or_default() }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_lines_are_read_by_key() {
        let s = SwapStatus::parse(&[
            "phase=offloaded",
            "gate=closed",
            "inside=0",
            "movable=3",
            "movable_bytes=100",
            "kept=1",
            "kept_bytes=7",
            "kept_why=managed_(cuMemAllocManaged)",
        ]);
        assert!(s.offloaded());
        assert_eq!((s.movable, s.movable_bytes, s.kept, s.kept_bytes), (3, 100, 1, 7));
        assert_eq!(s.kept_why, vec!["managed (cuMemAllocManaged)".to_string()]);
    }

    #[test]
    fn answers_carry_bytes_time_and_phases() {
        let a =
            answer_of(&["ok", "bytes=42", "ms=9", "map_ms=3", "copy_ms=5", "phase=resident", "movable=1"]);
        let Answer::Done { bytes, ms, status, phases } = a else { panic!("{a:?}") };
        assert_eq!((bytes, ms, status.phase.as_str()), (42, 9, "resident"));
        assert_eq!(phases, vec![("map".to_string(), 3), ("copy".to_string(), 5)]);
        let f = answer_of(&["error", "no-memory:", "mapping", "8", "bytes"]);
        assert_eq!(f, Answer::Failed { kind: "no-memory".into(), detail: "mapping 8 bytes".into() });
    }

    #[test]
    fn a_process_without_fast_swap_has_no_status() {
        assert_eq!(status(std::process::id() as i32), None);
    }
}
