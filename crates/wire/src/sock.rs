//! Unix sockets at the preload boundary: addresses (abstract names and
//! paths), connect, bind and listen on abstract names, and who is at the
//! other end (`SO_PEERCRED`, `SO_PEERPIDFD`).

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};

/// A unix socket address and its length, built without allocating (the
/// preload library builds the guard's at load and connects to it from
/// signal handlers).
#[derive(Clone, Copy)]
pub struct Addr {
    pub raw: libc::sockaddr_un,
    pub len: libc::socklen_t,
}

impl Addr {
    /// An abstract name (without the leading NUL): `None` when it does not
    /// fit.
    pub fn abstract_name(name: &[u8]) -> Option<Self> {
        let mut raw = empty();
        if name.len() + 1 >= raw.sun_path.len() {
            return None;
        }
        for (d, s) in raw.sun_path[1..].iter_mut().zip(name) {
            *d = *s as libc::c_char;
        }
        let len = std::mem::size_of::<libc::sa_family_t>() + 1 + name.len();
        Some(Self { raw, len: len as libc::socklen_t })
    }

    /// A path (NUL-terminated in the address): `None` when it is empty or
    /// does not fit.
    pub fn path(path: &[u8]) -> Option<Self> {
        let mut raw = empty();
        if path.is_empty() || path.len() >= raw.sun_path.len() || path.contains(&0) {
            return None;
        }
        for (d, s) in raw.sun_path.iter_mut().zip(path) {
            *d = *s as libc::c_char;
        }
        let len = std::mem::size_of::<libc::sa_family_t>() + path.len() + 1;
        Some(Self { raw, len: len as libc::socklen_t })
    }

    /// The address for `connect`/`bind`.
    pub fn as_ptr(&self) -> *const libc::sockaddr {
        (&self.raw as *const libc::sockaddr_un).cast()
    }
}

fn empty() -> libc::sockaddr_un {
    // SAFETY: sockaddr_un is plain data; all-zero is a valid value.
    let mut raw: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    raw.sun_family = libc::AF_UNIX as libc::sa_family_t;
    raw
}

fn too_long() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, "name too long")
}

/// A new unix stream socket (close-on-exec).
fn stream_socket() -> io::Result<OwnedFd> {
    // SAFETY: socket() with constant arguments; no memory passed.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the fd just made, owned once.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Connects to the abstract socket `name` (without the leading NUL or `@`).
pub fn connect_abstract(name: &str) -> io::Result<UnixStream> {
    let addr = Addr::abstract_name(name.as_bytes()).ok_or_else(too_long)?;
    let fd = stream_socket()?;
    // SAFETY: a valid address of `addr.len` bytes.
    if unsafe { libc::connect(fd.as_raw_fd(), addr.as_ptr(), addr.len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(UnixStream::from(fd))
}

/// Binds the abstract name `name` (without the leading NUL or `@`) and
/// listens with room for `backlog` waiting connections.
pub fn listen_abstract(name: &str, backlog: i32) -> io::Result<UnixListener> {
    let addr = Addr::abstract_name(name.as_bytes()).ok_or_else(too_long)?;
    let fd = stream_socket()?;
    // SAFETY: a valid address of `addr.len` bytes.
    if unsafe { libc::bind(fd.as_raw_fd(), addr.as_ptr(), addr.len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a bound socket.
    if unsafe { libc::listen(fd.as_raw_fd(), backlog) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(UnixListener::from(fd))
}

/// Who is at the other end of a unix socket, as of its `connect` or
/// `listen`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    pub pid: i32,
    pub uid: u32,
    pub gid: u32,
}

/// The credentials of the peer of `s` (`SO_PEERCRED`).
pub fn peer_cred(s: BorrowedFd<'_>) -> io::Result<PeerCred> {
    // SAFETY: ucred is plain data; getsockopt fills at most `len` bytes.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: a valid socket and a buffer of `len` bytes.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(PeerCred { pid: cred.pid, uid: cred.uid, gid: cred.gid })
}

/// A pidfd of the peer of `s` (`SO_PEERPIDFD`); `None` on a kernel
/// without it (Linux before 6.5).
pub fn peer_pidfd(s: BorrowedFd<'_>) -> io::Result<Option<OwnedFd>> {
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
        return Ok(Some(unsafe { OwnedFd::from_raw_fd(pidfd) }));
    }
    let err = io::Error::last_os_error();
    if r != 0 && matches!(err.raw_os_error(), Some(libc::ENOPROTOOPT) | Some(libc::EINVAL)) {
        return Ok(None);
    }
    Err(err)
}

/// Why the peer of a socket is not the process it should be.
#[derive(Debug)]
pub enum NotThePeer {
    /// The listener has ended (its pidfd names no process).
    Ended,
    /// Another process listens.
    Other(i32),
    /// Its pidfd names no pid we can read.
    Unnamed,
    /// The kernel gave no pidfd of it.
    NoPidfd(io::Error),
    /// (Without pidfds) it listened as another user than the process's.
    OtherUser(u32),
}

impl std::fmt::Display for NotThePeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotThePeer::Ended => write!(f, "its listener has ended"),
            NotThePeer::Other(p) => write!(f, "held by process {p}"),
            NotThePeer::Unnamed => write!(f, "its listener cannot be named"),
            NotThePeer::NoPidfd(e) => write!(f, "no pidfd of its listener ({e})"),
            NotThePeer::OtherUser(u) => write!(f, "listened as uid {u}, not the process's user"),
        }
    }
}

impl std::error::Error for NotThePeer {}

/// Whether the process at the other end of `s` is `pid` itself, now: a
/// pidfd of it names it exactly (a process that has ended, or a later one
/// given its pid, is another); without `SO_PEERPIDFD`, its pid and user
/// at `connect()`/`listen()` must be `pid`'s.
pub fn peer_is(s: &impl AsFd, pid: i32) -> Result<(), NotThePeer> {
    match peer_pidfd(s.as_fd()) {
        Ok(Some(pidfd)) => match pidfd_pid(&pidfd) {
            Some(p) if p == pid => Ok(()),
            Some(p) if p <= 0 => Err(NotThePeer::Ended),
            Some(p) => Err(NotThePeer::Other(p)),
            None => Err(NotThePeer::Unnamed),
        },
        Err(e) => Err(NotThePeer::NoPidfd(e)),
        Ok(None) => {
            let cred = peer_cred(s.as_fd()).map_err(|_| NotThePeer::Other(0))?;
            if cred.pid != pid {
                return Err(NotThePeer::Other(cred.pid));
            }
            if euid_of(pid) != Some(cred.uid) {
                return Err(NotThePeer::OtherUser(cred.uid));
            }
            Ok(())
        }
    }
}

/// The pid a pidfd refers to, in this pid namespace (`-1` once it ended).
pub fn pidfd_pid(fd: &OwnedFd) -> Option<i32> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn an_abstract_socket_is_ours_at_both_ends() {
        let name = format!("gpusnap-wire-test-{}-{:?}", std::process::id(), std::thread::current().id());
        let listener = listen_abstract(&name, 4).unwrap();
        let mut client = connect_abstract(&name).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        // SAFETY: getpid/geteuid/getegid have no preconditions.
        let me = unsafe { PeerCred { pid: libc::getpid(), uid: libc::geteuid(), gid: libc::getegid() } };
        assert_eq!(peer_cred(client.as_fd()).unwrap(), me);
        assert_eq!(peer_cred(server.as_fd()).unwrap(), me);
        peer_is(&client, me.pid).unwrap();
        let other = peer_is(&client, me.pid + 1).unwrap_err();
        assert!(matches!(other, NotThePeer::Other(p) if p == me.pid), "{other}");
        // The name is taken while it listens.
        assert!(listen_abstract(&name, 4).is_err());
        client.write_all(b"status\n").unwrap();
        let mut got = [0u8; 7];
        server.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"status\n");
    }

    #[test]
    fn addresses_refuse_what_does_not_fit() {
        assert!(Addr::abstract_name(&[b'a'; 106]).is_some());
        assert!(Addr::abstract_name(&[b'a'; 107]).is_none());
        assert!(Addr::path(b"/run/x.sock").is_some_and(|a| a.len as usize == 2 + 11 + 1));
        assert!(Addr::path(&[b'a'; 108]).is_none());
        assert!(Addr::path(b"").is_none());
        assert!(connect_abstract(&"a".repeat(200)).is_err());
        assert!(connect_abstract(&format!("gpusnap-wire-nobody-{}", std::process::id())).is_err());
    }
}
