//! Who may use the API: root, or a member (primary or supplementary) of
//! the configured group. Everything is taken from the socket when the
//! connection is accepted: the uid and primary gid (SO_PEERCRED) and the
//! supplementary groups (SO_PEERGROUPS), as the kernel recorded them when
//! the peer connected. Nothing is read from /proc later: by then the pid
//! may name another process.

use std::os::fd::AsRawFd;

/// The peer's credentials, taken once per connection at accept.
#[derive(Clone, Debug, Default)]
pub struct Peer {
    pub pid: Option<i32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    /// Supplementary groups (SO_PEERGROUPS); empty when the kernel gave none.
    pub groups: Vec<u32>,
}

/// `SO_PEERGROUPS` (Linux 4.13): the same value on every architecture the
/// agent runs on (x86_64, aarch64).
const SO_PEERGROUPS: libc::c_int = 59;

impl Peer {
    /// The credentials of a connected unix stream's peer.
    pub fn of(stream: &tokio::net::UnixStream) -> Self {
        match stream.peer_cred() {
            Ok(c) => Peer {
                pid: c.pid(),
                uid: Some(c.uid()),
                gid: Some(c.gid()),
                groups: peer_groups(stream.as_raw_fd()).unwrap_or_default(),
            },
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
        self.gid == Some(gid) || self.groups.contains(&gid)
    }
}

/// A group's id, from its name or its number.
pub fn group_id(name: &str) -> Option<u32> {
    if let Ok(n) = name.parse::<u32>() {
        return Some(n);
    }
    nix::unistd::Group::from_name(name).ok().flatten().map(|g| g.gid.as_raw())
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
        let p = Peer { pid: Some(1), uid: Some(1000), gid: Some(1000), groups: vec![4242] };
        assert!(p.allowed(Some("4242")));
        assert!(!p.allowed(Some("4343")));
        assert!(!p.allowed(None));
    }
}
