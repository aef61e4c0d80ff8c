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

use serde::Serialize;
use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

/// The environment variable `run --light --fast-swap` sets for the library.
pub const FAST_SWAP_ENV: &str = "GPUSNAP_FAST_SWAP";
/// Set beside `FAST_SWAP_ENV` by `run --keep-pinned`: the library keeps its
/// pinned host copies after each resume.
pub const KEEP_PINNED_ENV: &str = "GPUSNAP_FAST_SWAP_KEEP";

/// How long an offload or restore may go without a word from the library
/// (it says `progress` every second while it works): a stopped, frozen or
/// wedged process fails the request this soon.
const STALL_LIMIT: Duration = Duration::from_secs(30);
/// How long an offload or restore may take in all (55 GB at 2 GB/s, with room).
const WORK_LIMIT: Duration = Duration::from_secs(600);
/// The most candidate sockets tried for one process.
const MAX_CANDIDATES: usize = 4;
/// What every control socket's name starts with.
const NAME_PREFIX: &str = "@gpusnap-swap-";
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

/// Connects to `pid`'s library; `None` when it has no fast swap (it holds
/// no control socket) or the listener is not `pid` itself.
fn connect(pid: i32) -> Option<UnixStream> {
    for name in names_held(pid) {
        let Some(s) = connect_abstract(&name) else { continue };
        match peer_is(&s, pid) {
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
    let ok_name = path.strip_prefix(NAME_PREFIX).is_some_and(|rest| {
        !rest.is_empty() && rest.len() < 90 && rest.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
    });
    // __SO_ACCEPTCON (listening), SOCK_STREAM, and nothing after the name.
    (flags == "00010000" && kind == "0001" && ok_name && f.next().is_none())
        .then(|| Some((inode.parse().ok()?, path.to_string())))
        .flatten()
}

/// Connects to the abstract socket `name` (`@...`).
fn connect_abstract(name: &str) -> Option<UnixStream> {
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
    let name = name.strip_prefix('@')?.as_bytes();
    if name.len() + 1 >= addr.sun_path.len() {
        return None;
    }
    for (d, s) in addr.sun_path[1..].iter_mut().zip(name) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + name.len();
    // SAFETY: a valid address of `len` bytes.
    let r = unsafe { libc::connect(fd, (&addr as *const libc::sockaddr_un).cast(), len as libc::socklen_t) };
    (r == 0).then(|| UnixStream::from(owned))
}

/// Whether the process that listens behind `s` is `pid` itself, now: a
/// pidfd of the listener names it exactly (a process that has ended, or a
/// later one given its pid, is another); without `SO_PEERPIDFD` (Linux
/// before 6.5), its pid and user at `listen()` must be `pid`'s.
fn peer_is(s: &UnixStream, pid: i32) -> Result<(), String> {
    let mut pidfd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: a valid socket and a buffer of `len` bytes.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERPIDFD,
            (&mut pidfd as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if r == 0 && pidfd >= 0 {
        // SAFETY: the pidfd the kernel just gave us, owned once.
        let owned = unsafe { OwnedFd::from_raw_fd(pidfd) };
        let peer = pidfd_pid(&owned);
        return match peer {
            Some(p) if p == pid => Ok(()),
            Some(p) if p <= 0 => Err("its listener has ended".into()),
            Some(p) => Err(format!("held by process {p}")),
            None => Err("its listener cannot be named".into()),
        };
    }
    let err = std::io::Error::last_os_error();
    if r == 0 || !matches!(err.raw_os_error(), Some(libc::ENOPROTOOPT) | Some(libc::EINVAL)) {
        return Err(format!("no pidfd of its listener ({err})"));
    }
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
        return Err(format!("held by process {}", cred.pid));
    }
    if euid_of(pid) != Some(cred.uid) {
        return Err(format!("listened as uid {}, not the process's user", cred.uid));
    }
    Ok(())
}

/// The pid a pidfd refers to, in this pid namespace (`-1` once it ended).
fn pidfd_pid(fd: &OwnedFd) -> Option<i32> {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd())).ok()?;
    info.lines().find_map(|l| l.strip_prefix("Pid:")).and_then(|v| v.trim().parse().ok())
}

/// A process's effective uid.
fn euid_of(pid: i32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().nth(1)?.parse().ok())
}

/// Sends `req` and reads the one-line answer (each line at most 4 KiB).
/// A status must come within `STATUS_LIMIT`; an offload or restore may
/// take up to `WORK_LIMIT` as long as the library says `progress` at least
/// every `STALL_LIMIT`.
fn ask(pid: i32, req: &str, work: bool) -> Option<Result<Vec<String>, String>> {
    let s = connect(pid)?;
    let _ = s.set_read_timeout(Some(if work { STALL_LIMIT } else { STATUS_LIMIT }));
    let _ = s.set_write_timeout(Some(STATUS_LIMIT));
    if let Err(e) = (&s).write_all(format!("{req}\n").as_bytes()) {
        return Some(Err(format!("fast swap {req}: {e}")));
    }
    let t = Instant::now();
    let mut reader = BufReader::new(&s);
    loop {
        let mut line = String::new();
        let got = (&mut reader).take(4096).read_line(&mut line);
        match got {
            Ok(0) => return Some(Err(format!("fast swap {req}: the process closed the connection"))),
            Ok(_) if work && line.starts_with("progress") && t.elapsed() < WORK_LIMIT => continue,
            Ok(_) if line.starts_with("progress") => {
                return Some(Err(format!("fast swap {req}: not done after {} s", WORK_LIMIT.as_secs())))
            }
            Ok(_) => return Some(Ok(line.split_whitespace().map(str::to_string).collect())),
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
    let words = ask(pid, "status", false)?.ok()?;
    let w: Vec<&str> = words.iter().map(String::as_str).collect();
    (w.first() == Some(&"ok")).then(|| SwapStatus::parse(&w[1..]))
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
pub fn request(pid: i32, what: &str) -> Option<Result<Answer, String>> {
    let words = match ask(pid, what, true)? {
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
