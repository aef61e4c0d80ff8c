//! HTTP written by hand, for tests that talk to the agent: one request over
//! its unix socket or a loopback port, and an answer split into status and
//! body; a kept-alive request to a server, a connection from a chosen local
//! address. By hand so that a test sees exactly what was sent.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// `method path` with an empty body over the unix socket at `socket`
/// (`Connection: close`), each read waiting at most `limit`. Returns the
/// answer as read and how the read ended: a failed read leaves what came
/// before it, for callers that take that as the answer.
pub fn unix_request(
    socket: &Path,
    method: &str,
    path: &str,
    limit: Duration,
) -> (String, std::io::Result<usize>) {
    let mut s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(limit)).unwrap();
    write!(s, "{method} {path} HTTP/1.1\r\nHost: agent\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    let read = s.read_to_string(&mut text);
    (text, read)
}

/// `GET path` on 127.0.0.1:`port` (`Connection: close`): the answer as read
/// until the peer closed, a read failed or `limit` passed. An error when no
/// connection was made or the request could not be sent.
pub fn tcp_get(port: u16, path: &str, limit: Duration) -> std::io::Result<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(limit))?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")?;
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    Ok(text)
}

/// An answer's status (0 when there is none) and its body as sent.
pub fn split(text: &str) -> (u16, String) {
    let code = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let (_, body) = text.split_once("\r\n\r\n").unwrap_or((text, ""));
    (code, body.to_string())
}

/// [`split`], with a chunked body put back together.
pub fn split_dechunked(text: &str) -> (u16, String) {
    let (code, body) = split(text);
    let (head, _) = text.split_once("\r\n\r\n").unwrap_or((text, ""));
    if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        return (code, dechunk(&body));
    }
    (code, body)
}

/// The data of a chunked body, up to its last chunk or the first chunk cut short.
pub fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].strip_prefix("\r\n").unwrap_or(&rest[n..]);
    }
    out
}

/// `GET /` on `s`, kept alive (HTTP/1.1, no `Connection: close`), each read
/// waiting at most two minutes: the body of the answer, which must be a 200.
pub fn get_kept_alive(s: &mut TcpStream) -> String {
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(s, "GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "closed before the answer: {:?}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&got);
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len: usize = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse().unwrap())
                })
                .unwrap_or(0);
            if body.len() >= len {
                assert!(head.starts_with("HTTP/1.1 200"), "{text}");
                return body[..len].trim_end().to_string();
            }
        }
    }
}

/// A connection to `to` (IPv4) from the local address `from`.
pub fn connect_from(from: &str, to: std::net::SocketAddr) -> TcpStream {
    use std::os::fd::FromRawFd;
    let sin = |ip: std::net::Ipv4Addr, port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from(ip).to_be() },
        sin_zero: [0; 8],
    };
    let std::net::SocketAddr::V4(to) = to else { panic!("IPv4 only") };
    let (a, b) = (sin(from.parse().unwrap(), 0), sin(*to.ip(), to.port()));
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: a new socket; the addresses are valid sockaddr_in values
    // that outlive the calls, with their size; the descriptor is owned by
    // the TcpStream made of it, and by nothing else.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let s = TcpStream::from_raw_fd(fd);
        assert_eq!(libc::bind(fd, (&a as *const libc::sockaddr_in).cast(), len), 0, "bind {from}");
        assert_eq!(libc::connect(fd, (&b as *const libc::sockaddr_in).cast(), len), 0, "connect {to}");
        s
    }
}
