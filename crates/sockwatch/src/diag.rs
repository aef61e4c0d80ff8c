//! One `inet_diag` dump of the TCP sockets on a port: the request, and its
//! answer read into a [`Snapshot`], bounded in bytes and time.
//!
//! The kernel filters by the request's source port (`idiag_sport`) for
//! both listening and established sockets, so a dump carries only the
//! port's sockets; the answer is checked again here all the same.

use crate::{Connection, Error, Limits, Listener, Snapshot};
use netlink_packet_core::{NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_DUMP, NLM_F_REQUEST};
use netlink_packet_sock_diag::constants::IPPROTO_TCP;
use netlink_packet_sock_diag::inet::{nlas::Nla, ExtensionFlags, InetRequest, SocketId, StateFlags};
use netlink_packet_sock_diag::SockDiagMessage;
use netlink_sys::{protocols::NETLINK_SOCK_DIAG, Socket, SocketAddr as NlAddr};
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// `TCP_LISTEN` in the kernel's numbering of TCP states.
const TCP_LISTEN: u8 = 10;
/// Offsets of `tcpi_bytes_acked` and `tcpi_bytes_received` in `struct
/// tcp_info` (since Linux 4.1; a shorter one from an older kernel has none).
const BYTES_ACKED: usize = 120;
/// `tcpi_last_data_sent` and `tcpi_last_data_recv` (milliseconds ago).
const LAST_DATA_SENT: usize = 44;
const LAST_DATA_RECV: usize = 52;
const BYTES_RECEIVED: usize = 128;

/// A `NETLINK_SOCK_DIAG` socket in the calling thread's namespace, each
/// receive bounded by `timeout`.
pub fn socket(timeout: Duration) -> Result<Socket, Error> {
    let mut s = Socket::new(NETLINK_SOCK_DIAG).map_err(Error::Socket)?;
    s.bind_auto().map_err(Error::Socket)?;
    s.connect(&NlAddr::new(0, 0)).map_err(Error::Socket)?;
    let tv = libc::timeval {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_usec: timeout.subsec_micros().max(1) as libc::suseconds_t,
    };
    // SAFETY: the descriptor is the socket's own and open; `tv` is a valid
    // timeval that outlives the call, its size passed with it.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(Error::Socket(std::io::Error::last_os_error()));
    }
    Ok(s)
}

fn request(seq: u32, family: u8, port: u16, listeners_only: bool) -> Vec<u8> {
    let mut id = if family == libc::AF_INET6 as u8 { SocketId::new_v6() } else { SocketId::new_v4() };
    id.source_port = port;
    let mut hdr = NetlinkHeader::default();
    hdr.flags = NLM_F_REQUEST | NLM_F_DUMP;
    hdr.sequence_number = seq;
    let mut msg = NetlinkMessage::new(
        hdr,
        SockDiagMessage::InetRequest(InetRequest {
            family,
            protocol: IPPROTO_TCP,
            extensions: ExtensionFlags::INFO,
            // Listening sockets only: an answer whose size does not grow
            // with the connections (a probe on a port with thousands).
            states: if listeners_only {
                StateFlags::LISTEN
            } else {
                StateFlags::LISTEN | StateFlags::ESTABLISHED | StateFlags::CLOSE_WAIT
            },
            socket_id: id,
        })
        .into(),
    );
    msg.finalize();
    let mut buf = vec![0; msg.buffer_len()];
    msg.serialize(&mut buf);
    buf
}

/// Asks for the `family` sockets on `port` and adds what the answer holds
/// to `into`. `buf` is reused between calls.
#[allow(clippy::too_many_arguments)]
pub fn dump(
    socket: &Socket,
    buf: &mut [u8],
    seq: u32,
    family: u8,
    port: u16,
    listeners_only: bool,
    limits: &Limits,
    into: &mut Snapshot,
) -> Result<(), Error> {
    let started = Instant::now();
    tracing::trace!(family, port, listeners_only, "sock_diag dump");
    socket.send(&request(seq, family, port, listeners_only), 0).map_err(Error::Socket)?;
    let mut total = 0usize;
    loop {
        if started.elapsed() > limits.timeout {
            return Err(Error::TimedOut(limits.timeout));
        }
        let n = match socket.recv(&mut &mut buf[..], 0) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return Err(Error::TimedOut(limits.timeout))
            }
            Err(e) => return Err(Error::Socket(e)),
        };
        if n > buf.len() {
            return Err(Error::Decode(format!("a datagram of {n} bytes in a buffer of {}", buf.len())));
        }
        total += n;
        if total > limits.max_bytes {
            return Err(Error::TooLarge(limits.max_bytes));
        }
        let mut at = 0;
        while at < n {
            let msg = NetlinkMessage::<SockDiagMessage>::deserialize(&buf[at..n])
                .map_err(|e| Error::Decode(e.to_string()))?;
            let len = msg.header.length as usize;
            if len == 0 {
                break;
            }
            // An answer to an earlier request that timed out: not ours.
            let ours = msg.header.sequence_number == seq;
            match msg.payload {
                NetlinkPayload::Done(_) if ours => return Ok(()),
                NetlinkPayload::Error(e) if ours => {
                    if e.code.is_none() {
                        return Ok(());
                    }
                    return Err(Error::Refused(e.to_io()));
                }
                NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(r)) if ours => add(&r, port, into),
                _ => {}
            }
            at += (len + 3) & !3;
        }
    }
}

fn add(r: &netlink_packet_sock_diag::inet::InetResponse, port: u16, into: &mut Snapshot) {
    let id = &r.header.socket_id;
    if id.source_port != port {
        return;
    }
    let local = SocketAddr::new(id.source_address, id.source_port);
    if r.header.state == TCP_LISTEN {
        into.listeners.push(Listener {
            local,
            accept_queue: r.header.recv_queue,
            backlog: r.header.send_queue,
        });
        return;
    }
    let info = r.nlas.iter().find_map(|n| match n {
        Nla::TcpInfo(b) => Some(b.as_slice()),
        _ => None,
    });
    let (acked, received) = info.map_or((0, 0), |b| (u64_at(b, BYTES_ACKED), u64_at(b, BYTES_RECEIVED)));
    let (since_sent, since_recv) =
        info.map_or((u32::MAX, u32::MAX), |b| (u32_at(b, LAST_DATA_SENT), u32_at(b, LAST_DATA_RECV)));
    into.connections.push(Connection {
        local,
        peer: SocketAddr::new(unmapped(id.destination_address), id.destination_port),
        cookie: u64::from_ne_bytes(id.cookie),
        bytes_received: received,
        bytes_acked: acked,
        unread: r.header.recv_queue,
        since_recv_ms: since_recv,
        since_sent_ms: since_sent,
    });
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4).and_then(|s| s.try_into().ok()).map_or(u32::MAX, u32::from_ne_bytes)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 8).and_then(|s| s.try_into().ok()).map_or(0, u64::from_ne_bytes)
}

/// `::ffff:10.0.0.1` (an IPv4 client of a dual-stack listener) as `10.0.0.1`.
fn unmapped(a: std::net::IpAddr) -> std::net::IpAddr {
    match a {
        std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(a, std::net::IpAddr::V4),
        v4 => v4,
    }
}
