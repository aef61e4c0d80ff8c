//! HTTP written by hand, for tests that talk to the agent: one request over
//! its unix socket or a loopback port, and an answer split into status and
//! body. By hand so that a test sees exactly what the agent sent.

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
