//! The keeper: a process of its own that holds a copy of every userfaultfd
//! of a lazy wake, so that the death of the wake's page server (gpusnap
//! killed with SIGKILL, or by the OOM killer) never lets a woken process
//! read zeros where its memory is still missing.
//!
//! While any process holds a userfaultfd, the kernel keeps its ranges
//! registered: a missing page blocks the process that touches it. The
//! wake's server hands the keeper a duplicate of each userfaultfd it gets
//! (from CRIU, or from a FORK event), and every event it reads (FORK,
//! REMAP, UNMAP, REMOVE) before acting on it, over a socketpair (the
//! keeper's stdin). When the wake is done with its userfaultfds (every page
//! in place, or the tree ended) it says "done" and the keeper exits. If the
//! socket reaches its end without "done", the wake died: the keeper replays
//! the events onto the image's lazy pieces and serves what is still missing
//! with the same server ([`crate::Server`]), then exits. See docs/design/wake.md.

use crate::image::lazy_iovs;
use crate::PagesError;
use nix::sys::socket::{
    recvmsg, sendmsg, socketpair, AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag,
    SockType,
};
use std::io::IoSlice;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Mutex;

const UFFD: u32 = 1;
const FORK: u32 = 2;
const REMAP: u32 = 3;
const UNMAP: u32 = 4;
const REMOVE: u32 = 5;
const DONE: u32 = 6;
const LEN: usize = 40;

/// One message: what happened to userfaultfd `key` (the wake numbers them
/// in the order it got them).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Msg {
    pub kind: u32,
    pub key: u32,
    pub pid: i32,
    pub a: [u64; 3],
}

impl Msg {
    fn bytes(&self) -> [u8; LEN] {
        let mut b = [0u8; LEN];
        b[0..4].copy_from_slice(&self.kind.to_ne_bytes());
        b[4..8].copy_from_slice(&self.key.to_ne_bytes());
        b[8..12].copy_from_slice(&self.pid.to_ne_bytes());
        for (i, v) in self.a.iter().enumerate() {
            b[16 + 8 * i..24 + 8 * i].copy_from_slice(&v.to_ne_bytes());
        }
        b
    }
    fn parse(b: &[u8; LEN]) -> Self {
        let u32_at = |i: usize| u32::from_ne_bytes(b[i..i + 4].try_into().unwrap_or_default());
        let u64_at = |i: usize| u64::from_ne_bytes(b[i..i + 8].try_into().unwrap_or_default());
        Msg {
            kind: u32_at(0),
            key: u32_at(4),
            pid: u32_at(8) as i32,
            a: [u64_at(16), u64_at(24), u64_at(32)],
        }
    }
}

/// The wake's side: the keeper process and the socket to it.
pub struct Keeper {
    sock: Mutex<Option<OwnedFd>>,
    child: Mutex<Option<Child>>,
    broken: AtomicBool,
}

impl Keeper {
    /// Starts `cmd` (gpusnap's hidden `__pages-keeper`) as the keeper: its
    /// stdin is its end of the socket, it runs in a session of its own (a
    /// signal to the wake's process group or session does not reach it),
    /// and nothing asks the kernel to kill it when the wake dies.
    pub fn spawn(mut cmd: Command) -> std::io::Result<Self> {
        use std::os::unix::process::CommandExt;
        // SEQPACKET: one message per record, its fd with it. CLOEXEC: the
        // wake's end must not leak into CRIU or the keeper, or the keeper
        // would never see it close when the wake dies.
        let (ours, theirs) =
            socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC)
                .map_err(std::io::Error::from)?;
        cmd.stdin(Stdio::from(theirs)).stdout(Stdio::null());
        // SAFETY: setsid is async-signal-safe; nothing else runs between
        // fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                libc::setsid();
                Ok(())
            });
        }
        let child = cmd.spawn()?;
        Ok(Self {
            sock: Mutex::new(Some(ours)),
            child: Mutex::new(Some(child)),
            broken: AtomicBool::new(false),
        })
    }

    /// The keeper's pid (until it was released).
    pub fn pid(&self) -> Option<u32> {
        self.child.lock().unwrap().as_ref().map(|c| c.id())
    }

    pub(crate) fn send(&self, m: Msg, fd: Option<BorrowedFd<'_>>) {
        let g = self.sock.lock().unwrap();
        let Some(sock) = g.as_ref() else { return };
        let b = m.bytes();
        let iov = [IoSlice::new(&b)];
        let fds: Vec<RawFd> = fd.map(|f| f.as_raw_fd()).into_iter().collect();
        let cmsg = [ControlMessage::ScmRights(&fds)];
        let r = sendmsg::<()>(
            sock.as_raw_fd(),
            &iov,
            if fds.is_empty() { &[] } else { &cmsg },
            MsgFlags::MSG_NOSIGNAL,
            None,
        );
        if let Err(e) = r {
            if !self.broken.swap(true, SeqCst) {
                tracing::error!(
                    "page server: the keeper is gone ({e}): this wake is no longer safe against gpusnap's death"
                );
            }
        }
    }

    /// The wake is done with its userfaultfds: the keeper closes its copies
    /// and exits (waited for: no zombie).
    pub fn release(&self) {
        self.send(Msg { kind: DONE, key: 0, pid: 0, a: [0; 3] }, None);
        drop(self.sock.lock().unwrap().take());
        if let Some(mut c) = self.child.lock().unwrap().take() {
            let _ = c.wait();
        }
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        self.release();
    }
}

pub(crate) fn uffd(key: u32, pid: i32) -> Msg {
    Msg { kind: UFFD, key, pid, a: [0; 3] }
}
pub(crate) fn fork(child: u32, parent: u32) -> Msg {
    Msg { kind: FORK, key: child, pid: 0, a: [parent as u64, 0, 0] }
}
pub(crate) fn remap(key: u32, from: u64, to: u64, len: u64) -> Msg {
    Msg { kind: REMAP, key, pid: 0, a: [from, to, len] }
}
pub(crate) fn unmap(key: u32, start: u64, end: u64, remove: bool) -> Msg {
    Msg { kind: if remove { REMOVE } else { UNMAP }, key, pid: 0, a: [start, end, 0] }
}

/// What the keeper heard.
pub enum Kept {
    /// The wake said "done": nothing to do.
    Released,
    /// The wake died first: these messages (with their fds) are what it
    /// handed over, in order ([`crate::Server::adopt`] serves them).
    Orphaned(Vec<(Msg, Option<OwnedFd>)>),
}

impl Kept {
    /// Userfaultfds held (processes and forked children).
    pub fn uffds(&self) -> usize {
        match self {
            Kept::Released => 0,
            Kept::Orphaned(v) => v.iter().filter(|(_, f)| f.is_some()).count(),
        }
    }
}

/// The keeper's side: holds everything the wake sends on `sock` until the
/// wake says "done" or dies (the socket's end without "done").
pub fn keep(sock: &OwnedFd) -> Kept {
    let mut log = Vec::new();
    loop {
        let mut b = [0u8; LEN];
        let mut cmsg = nix::cmsg_space!([RawFd; 2]);
        let mut iov = [std::io::IoSliceMut::new(&mut b)];
        let got = match recvmsg::<()>(sock.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC)
        {
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => {
                tracing::warn!("keeper: reading from the wake: {e}");
                return Kept::Orphaned(log);
            }
            Ok(m) => {
                let mut fd = None;
                for c in m.cmsgs().into_iter().flatten() {
                    if let ControlMessageOwned::ScmRights(fds) = c {
                        for f in fds {
                            // SAFETY: the kernel installed this fd in our
                            // table for us; nothing else owns it.
                            let owned = unsafe { OwnedFd::from_raw_fd(f) };
                            if fd.is_none() {
                                fd = Some(owned);
                            }
                        }
                    }
                }
                (m.bytes, fd)
            }
        };
        let (n, fd) = got;
        if n == 0 {
            return Kept::Orphaned(log);
        }
        let m = Msg::parse(&b);
        if m.kind == DONE {
            return Kept::Released;
        }
        log.push((m, fd));
    }
}

/// One userfaultfd as the replay of the wake's messages leaves it.
pub(crate) struct Replayed {
    pub pid: i32,
    pub uffd: OwnedFd,
    pub pages_id: u32,
    pub pieces: Vec<crate::Iov>,
}

/// Replays the wake's messages: each process's lazy pieces from the image,
/// a forked child's from its parent's at the fork, then the events as the
/// wake read them (a REMOVE unregisters again: idempotent).
pub(crate) fn replay(images: &Path, log: Vec<(Msg, Option<OwnedFd>)>) -> Result<Vec<Replayed>, PagesError> {
    use std::collections::BTreeMap;
    let mut mms: BTreeMap<u32, Replayed> = BTreeMap::new();
    for (m, fd) in log {
        match m.kind {
            UFFD => {
                let Some(fd) = fd else { continue };
                let (pages_id, iovs) = lazy_iovs(images, m.pid)?;
                mms.insert(m.key, Replayed { pid: m.pid, uffd: fd, pages_id, pieces: iovs });
            }
            FORK => {
                let Some(fd) = fd else { continue };
                if let Some(p) = mms.get(&(m.a[0] as u32)) {
                    let r = Replayed { pid: p.pid, uffd: fd, pages_id: p.pages_id, pieces: p.pieces.clone() };
                    mms.insert(m.key, r);
                }
            }
            REMAP | UNMAP | REMOVE => {
                let Some(r) = mms.get_mut(&m.key) else { continue };
                let mut p = crate::mmstate::MmState::of(std::mem::take(&mut r.pieces));
                match m.kind {
                    REMAP => p.remap(m.a[0], m.a[1], m.a[2]),
                    _ => {
                        if m.kind == REMOVE {
                            use std::os::fd::AsFd;
                            let _ = crate::sys::unregister(r.uffd.as_fd(), m.a[0], m.a[1] - m.a[0]);
                        }
                        p.drop_range(m.a[0], m.a[1]);
                    }
                }
                r.pieces = p.iovs();
            }
            _ => {}
        }
    }
    Ok(mms.into_values().collect())
}

/// Wakes every fault waiting on `uffd` in the whole address space: those
/// the dead wake had read but not answered would wait for a WAKE that never
/// comes. A page still missing faults again, and the keeper reads it.
pub(crate) fn wake_all(uffd: BorrowedFd<'_>) -> bool {
    let page = crate::sys::PAGE;
    let lo = std::fs::read_to_string("/proc/sys/vm/mmap_min_addr")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(1 << 16)
        .max(page)
        .div_ceil(page)
        * page;
    // The top of user space depends on the machine (x86-64: 47 or 56
    // bits, arm64: 48 or 52): the widest range the kernel takes.
    let tops = [1u64 << 56, 1 << 52, 1 << 48, (1 << 47) - page];
    tops.iter().any(|&hi| crate::sys::wake(uffd, lo, hi.saturating_sub(lo)).is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wake_all_covers_the_address_space() {
        // Needs a userfaultfd (root, or vm.unprivileged_userfaultfd).
        let Ok((fd, _)) = crate::sys::open(0) else { return };
        use std::os::fd::AsFd;
        assert!(wake_all(fd.as_fd()));
    }

    #[test]
    fn messages_round_trip() {
        for m in [uffd(3, 1234), fork(5, 3), remap(5, 0x1000, 0x9000, 0x2000), unmap(3, 0x1000, 0x3000, true)]
        {
            assert_eq!(Msg::parse(&m.bytes()), m);
        }
    }

    #[test]
    fn keep_holds_until_done_or_the_end() {
        let (a, b) =
            socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC).unwrap();
        let k = Keeper { sock: Mutex::new(Some(a)), child: Mutex::new(None), broken: AtomicBool::new(false) };
        let f = std::fs::File::open("/dev/null").unwrap();
        use std::os::fd::AsFd;
        k.send(uffd(1, 42), Some(f.as_fd()));
        k.send(remap(1, 0x1000, 0x5000, 0x1000), None);
        // The wake dies: the socket ends without "done".
        drop(k.sock.lock().unwrap().take());
        match keep(&b) {
            Kept::Orphaned(v) => {
                assert_eq!(v.len(), 2);
                assert_eq!(v[0].0, uffd(1, 42));
                assert!(v[0].1.is_some() && v[1].1.is_none());
            }
            Kept::Released => panic!("released without done"),
        }
        let (a, b) =
            socketpair(AddressFamily::Unix, SockType::SeqPacket, None, SockFlag::SOCK_CLOEXEC).unwrap();
        let k = Keeper { sock: Mutex::new(Some(a)), child: Mutex::new(None), broken: AtomicBool::new(false) };
        k.send(uffd(1, 42), Some(f.as_fd()));
        k.release();
        assert!(matches!(keep(&b), Kept::Released));
    }
}
