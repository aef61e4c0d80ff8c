use super::*;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

fn watcher() -> Watcher {
    Watcher::open(Limits::default()).expect("a sock_diag socket")
}

/// Looks until `ok` holds, for at most a generous minute (a loaded host).
fn look_until(w: &mut Watcher, port: u16, ok: impl Fn(&Snapshot) -> bool) -> Snapshot {
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        let s = w.look(port).unwrap();
        if ok(&s) {
            return s;
        }
        assert!(Instant::now() < end, "not seen: {s:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_listener_and_its_accept_queue() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let mut w = watcher();
    let s = w.look(port).unwrap();
    assert!(s.listening(), "{s:?}");
    assert_eq!(s.accept_queue(), 0);
    assert!(s.connections.is_empty(), "{s:?}");

    // Not accepted: the kernel completes it and queues it.
    let _c = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let s = look_until(&mut w, port, |s| s.accept_queue() == 1);
    // The server's half is established already, in the queue.
    assert!(s.connections.iter().all(|c| c.local.port() == port), "{s:?}");

    let (_conn, _) = l.accept().unwrap();
    look_until(&mut w, port, |s| s.accept_queue() == 0 && s.connections.len() == 1);
}

#[test]
fn byte_counters_of_a_connection_move_with_its_bytes() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let mut w = watcher();
    let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let (mut server, peer) = l.accept().unwrap();
    let s = look_until(&mut w, port, |s| s.connections.len() == 1);
    let first = s.connections[0].clone();
    assert_eq!(first.peer, peer);
    assert_eq!(first.bytes_received, 0);

    c.write_all(b"hello").unwrap();
    let s = look_until(&mut w, port, |s| s.connections[0].bytes_received == 5);
    assert_eq!(s.connections[0].cookie, first.cookie, "the same socket");
    assert_eq!(s.connections[0].unread, 5, "the server has not read them");

    assert!(s.connections[0].awaits_answer(), "{s:?}");
    let mut got = [0u8; 5];
    server.read_exact(&mut got).unwrap();
    server.write_all(b"answer").unwrap();
    let s = look_until(&mut w, port, |s| s.connections[0].bytes_acked == 6);
    assert_eq!(s.connections[0].unread, 0);
    // Answered in the same millisecond as asked reads as answered only
    // from the next: the counters say so at once, the clocks a moment later.
    look_until(&mut w, port, |s| !s.connections[0].awaits_answer());
}

#[test]
fn other_ports_are_not_reported() {
    let a = TcpListener::bind("127.0.0.1:0").unwrap();
    let b = TcpListener::bind("127.0.0.1:0").unwrap();
    let (pa, pb) = (a.local_addr().unwrap().port(), b.local_addr().unwrap().port());
    let _c = TcpStream::connect(("127.0.0.1", pb)).unwrap();
    let mut w = watcher();
    let s = w.look(pa).unwrap();
    assert_eq!(s.listeners.len(), 1, "{s:?}");
    assert!(s.connections.is_empty(), "{s:?}");
    assert_eq!(s.accept_queue(), 0);
}

#[test]
fn an_ipv4_client_of_a_dual_stack_listener_is_seen_with_its_ipv4_address() {
    let Ok(l) = TcpListener::bind("[::]:0") else { return };
    let port = l.local_addr().unwrap().port();
    let mut w = watcher();
    let c = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let s = look_until(&mut w, port, |s| s.accept_queue() == 1 && !s.connections.is_empty());
    assert_eq!(s.connections[0].peer, c.local_addr().unwrap());
}

#[test]
fn a_port_nobody_listens_on_is_empty() {
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    assert_eq!(watcher().look(port).unwrap(), Snapshot::default());
}

#[test]
fn an_answer_larger_than_the_bound_is_refused() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let mut w = Watcher::open(Limits { max_bytes: 16, timeout: Duration::from_secs(5) }).unwrap();
    assert!(matches!(w.look(port), Err(Error::TooLarge(16))));
}

#[test]
fn listeners_are_told_without_the_connections_of_their_port() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    // Enough idle connections that a look at all of them is over the
    // bound, which a look at the listener alone never is.
    let conns: Vec<_> = (0..200)
        .map(|_| (std::net::TcpStream::connect(("127.0.0.1", port)).unwrap(), l.accept().unwrap().0))
        .collect();
    let limits = Limits { max_bytes: 32 << 10, timeout: Duration::from_secs(5) };
    assert!(matches!(Watcher::open(limits).unwrap().look(port), Err(Error::TooLarge(_))));
    let listeners = Watcher::open(limits).unwrap().listeners(port).unwrap();
    assert_eq!(listeners.len(), 1, "{listeners:?}");
    drop(conns);
}

#[test]
fn a_watcher_opened_in_its_own_namespace_sees_the_same() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let mut w = Watcher::open_in(Path::new("/proc/self/ns/net"), Limits::default()).unwrap();
    assert!(w.look(port).unwrap().listening());
    let e = Watcher::open_in(Path::new("/nonexistent/ns"), Limits::default()).err().unwrap();
    assert!(e.to_string().starts_with("network namespace /nonexistent/ns: "), "{e}");
}

#[test]
fn the_namespaces_tcp_counters_move_with_a_connection_and_its_bytes() {
    let me = std::process::id() as i32;
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let before = counters::tcp(me).expect("/proc/PID/net/snmp");
    let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let (_s, _) = l.accept().unwrap();
    c.write_all(b"x").unwrap();
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        let now = counters::tcp(me).unwrap();
        if now.passive_opens > before.passive_opens && now.in_segs > before.in_segs {
            break;
        }
        assert!(Instant::now() < end, "{before:?} -> {now:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(counters::tcp(i32::MAX), None);
}

/// Drops CAP_SYS_ADMIN from the calling thread's effective set (a thread's
/// capabilities are its own; threads it starts inherit them).
fn drop_sys_admin() {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Default, Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const VERSION_3: u32 = 0x2008_0522;
    const CAP_SYS_ADMIN: u32 = 21;
    let mut h = Header { version: VERSION_3, pid: 0 };
    let mut d = [Data::default(); 2];
    // SAFETY: capget with a version 3 header and the two data structs it
    // fills, both alive for the call; pid 0 is the calling thread.
    let rc = unsafe { libc::syscall(libc::SYS_capget, &mut h as *mut Header, d.as_mut_ptr()) };
    assert_eq!(rc, 0, "capget: {}", std::io::Error::last_os_error());
    d[0].effective &= !(1 << CAP_SYS_ADMIN);
    // SAFETY: as above; capset only reads the structs. Dropping an
    // effective capability is always allowed.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &mut h as *mut Header, d.as_ptr()) };
    assert_eq!(rc, 0, "capset: {}", std::io::Error::last_os_error());
}

#[test]
fn a_watcher_opened_in_its_own_namespace_needs_no_capability() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    // As a probe run in a pod's container: no CAP_SYS_ADMIN, so no setns,
    // not even into its own namespace.
    let seen = std::thread::spawn(move || {
        drop_sys_admin();
        let own = std::fs::File::open("/proc/thread-self/ns/net").unwrap();
        let entered = nix::sched::setns(&own, nix::sched::CloneFlags::CLONE_NEWNET);
        assert_eq!(entered, Err(nix::errno::Errno::EPERM));
        let mut w = Watcher::open_in(Path::new("/proc/self/ns/net"), Limits::default()).unwrap();
        w.look(port).unwrap().listening()
    })
    .join()
    .unwrap();
    assert!(seen);
}
