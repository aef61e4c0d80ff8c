//! Who is on the other end of a unix socket. Everything is taken from the
//! socket when the connection is accepted: the uid and primary gid
//! (SO_PEERCRED), the supplementary groups (SO_PEERGROUPS), as the kernel
//! recorded them when the peer connected, and the peer process itself as a
//! pidfd (SO_PEERPIDFD, Linux 6.5), which names that process and no other
//! for as long as it is held. Where the kernel has no SO_PEERPIDFD, the pid
//! of SO_PEERCRED and its start time read at accept stand in for it: a pid
//! reused after the accept is then seen by its start time.
//!
//! The admin socket admits root or a member of the agent's group; the probe
//! socket admits anyone and answers from the peer's pid namespace only
//! ([`Peer::pid_namespace`]).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

/// The peer's credentials, taken once per connection at accept.
#[derive(Clone, Debug, Default)]
pub struct Peer {
    pub pid: Option<i32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    /// Supplementary groups (SO_PEERGROUPS); empty when the kernel gave none.
    pub groups: Vec<u32>,
    /// What pins `pid` to the process that connected.
    pub process: Option<Pinned>,
}

/// The connecting process, held so that its pid cannot name another one
/// unnoticed.
#[derive(Clone, Debug)]
pub enum Pinned {
    /// SO_PEERPIDFD.
    Pidfd(Arc<OwnedFd>),
    /// SO_PEERCRED's pid and its start time at accept (older kernels).
    StartTime(u64),
}

/// `SO_PEERGROUPS` (Linux 4.13) and `SO_PEERPIDFD` (Linux 6.5): the same
/// values on every architecture the agent runs on (x86_64, aarch64).
const SO_PEERGROUPS: libc::c_int = 59;
const SO_PEERPIDFD: libc::c_int = 77;

impl Peer {
    /// The credentials of a connected unix stream's peer.
    pub fn of(stream: &tokio::net::UnixStream) -> Self {
        match stream.peer_cred() {
            Ok(c) => {
                let fd = stream.as_raw_fd();
                let pid = c.pid().filter(|p| *p > 0);
                let process = match peer_pidfd(fd) {
                    Some(pidfd) => Some(Pinned::Pidfd(Arc::new(pidfd))),
                    None => pid.and_then(start_time).map(Pinned::StartTime),
                };
                Peer {
                    pid,
                    uid: Some(c.uid()),
                    gid: Some(c.gid()),
                    groups: peer_groups(fd).unwrap_or_default(),
                    process,
                }
            }
            Err(_) => Peer::default(),
        }
    }

    /// Root, or in `group` (a name or a numeric gid).
    pub fn allowed(&self, group: Option<&str>) -> bool {
        let Some(uid) = self.uid else { return false };
        if uid == 0 {
            return true;
        }
        let Some(gid) = group.and_then(group_id) else { return false };
        self.in_group(gid)
    }

    /// Whether `gid` is the peer's primary or a supplementary group.
    pub fn in_group(&self, gid: u32) -> bool {
        self.gid == Some(gid) || self.groups.contains(&gid)
    }

    /// The peer's pid (as the agent sees it) and its pid namespace
    /// (`pid:[INODE]`), read from /proc and then checked to still be the
    /// process that connected: `None` when it is gone, or its pid now names
    /// another process (blocks: reads /proc).
    pub fn pid_namespace(&self) -> Option<(i32, String)> {
        let (pid, pinned) = match &self.process {
            Some(Pinned::Pidfd(fd)) => (pidfd_pid(fd)?, self.process.as_ref()?),
            Some(p @ Pinned::StartTime(_)) => (self.pid?, p),
            None => return None,
        };
        let ns = gpusnap_core::pidns::of(pid)?;
        // Read first, then checked: while the connecting process lives, its
        // pid is its own, so what was read was its.
        let same = match pinned {
            Pinned::Pidfd(fd) => pidfd_alive(fd) && pidfd_pid(fd) == Some(pid),
            Pinned::StartTime(t) => start_time(pid) == Some(*t),
        };
        same.then_some((pid, ns))
    }
}

/// A group's id, from its name or its number.
pub fn group_id(name: &str) -> Option<u32> {
    if let Ok(n) = name.parse::<u32>() {
        return Some(n);
    }
    nix::unistd::Group::from_name(name).ok().flatten().map(|g| g.gid.as_raw())
}

/// A user's id, from its name or its number.
pub fn user_id(name: &str) -> Option<u32> {
    if let Ok(n) = name.parse::<u32>() {
        return Some(n);
    }
    nix::unistd::User::from_name(name).ok().flatten().map(|u| u.uid.as_raw())
}

fn start_time(pid: i32) -> Option<u64> {
    gpusnap_core::target::resolve(pid).ok().map(|t| t.start_time)
}

/// The pidfd of the process that connected to `fd` (SO_PEERPIDFD); `None`
/// on a kernel without it.
fn peer_pidfd(fd: std::os::fd::RawFd) -> Option<OwnedFd> {
    let mut pidfd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `pidfd` is a c_int the kernel writes at most `len` bytes to;
    // both live for the call.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            (&mut pidfd as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if r != 0 || pidfd < 0 {
        tracing::debug!("SO_PEERPIDFD: {}", std::io::Error::last_os_error());
        return None;
    }
    // SAFETY: the kernel just gave this descriptor to this process; nothing
    // else owns it.
    Some(unsafe { OwnedFd::from_raw_fd(pidfd) })
}

/// The pid a pidfd names, as this process sees it (`Pid:` of its fdinfo);
/// `None` once the process has been reaped (the kernel then says -1).
fn pidfd_pid(fd: &OwnedFd) -> Option<i32> {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd())).ok()?;
    let pid: i32 = info.lines().find_map(|l| l.strip_prefix("Pid:"))?.trim().parse().ok()?;
    (pid > 0).then_some(pid)
}

/// Whether the pidfd's process has not exited (signal 0: nothing is sent).
fn pidfd_alive(fd: &OwnedFd) -> bool {
    // SAFETY: pidfd_send_signal with signal 0 and no siginfo only checks
    // that the process exists and may be signalled; the descriptor is open.
    let r = unsafe {
        libc::syscall(libc::SYS_pidfd_send_signal, fd.as_raw_fd(), 0, std::ptr::null::<libc::siginfo_t>(), 0)
    };
    r == 0
}

/// The supplementary groups the kernel recorded for the peer of `fd` when
/// it connected (getsockopt SO_PEERGROUPS), growing the buffer on ERANGE.
pub fn peer_groups(fd: std::os::fd::RawFd) -> Option<Vec<u32>> {
    let mut groups: Vec<libc::gid_t> = vec![0; 64];
    for _ in 0..4 {
        let mut len = (groups.len() * std::mem::size_of::<libc::gid_t>()) as libc::socklen_t;
        // SAFETY: the buffer is `len` bytes of gid_t, owned and alive for
        // the call; the kernel writes at most `len` bytes and sets `len` to
        // what it wrote (or to what it needs, with ERANGE).
        let r = unsafe {
            libc::getsockopt(fd, libc::SOL_SOCKET, SO_PEERGROUPS, groups.as_mut_ptr().cast(), &mut len)
        };
        let n = len as usize / std::mem::size_of::<libc::gid_t>();
        if r == 0 {
            groups.truncate(n);
            return Some(groups);
        }
        if std::io::Error::last_os_error().raw_os_error() != Some(libc::ERANGE) {
            return None;
        }
        groups.resize(n.max(groups.len() * 2), 0);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_come_from_the_socket() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let got = peer_groups(a.as_raw_fd()).unwrap();
        let mut mine: Vec<u32> = nix::unistd::getgroups().unwrap().iter().map(|g| g.as_raw()).collect();
        let mut got_sorted = got.clone();
        mine.sort_unstable();
        got_sorted.sort_unstable();
        assert_eq!(got_sorted, mine);
    }

    #[test]
    fn a_supplementary_group_lets_in() {
        let p = Peer { pid: Some(1), uid: Some(1000), gid: Some(1000), groups: vec![4242], process: None };
        assert!(p.allowed(Some("4242")));
        assert!(!p.allowed(Some("4343")));
        assert!(!p.allowed(None));
    }

    #[tokio::test]
    async fn the_peer_is_pinned_and_its_namespace_read() {
        let (a, _b) = tokio::net::UnixStream::pair().unwrap();
        let p = Peer::of(&a);
        let me = std::process::id() as i32;
        assert!(p.process.is_some(), "SO_PEERPIDFD or the start time pins the peer");
        let (pid, ns) = p.pid_namespace().expect("this process is alive");
        assert_eq!(pid, me);
        assert_eq!(Some(ns), gpusnap_core::pidns::of(me));
    }

    #[test]
    fn a_peer_that_is_gone_has_no_namespace() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        let t = start_time(pid);
        child.wait().unwrap();
        let p =
            Peer { pid: Some(pid), uid: Some(0), process: t.map(Pinned::StartTime), ..Default::default() };
        assert_eq!(p.pid_namespace(), None);
    }
}
