//! The TCP sockets on one port of one network namespace: the listening
//! socket's accept queue and the established connections with their byte
//! counters, as the kernel reports them through `NETLINK_SOCK_DIAG`
//! (`inet_diag`, what `ss -ti` reads).
//!
//! - [`netns`] opens the netlink socket inside a namespace (a thread that
//!   enters it, opens the socket and ends; the socket stays bound to it);
//! - [`counters`] reads a namespace's TCP counters, a cheap sign that
//!   something happened there before a dump is asked;
//! - [`diag`] asks one dump and reads its answer, bounded in bytes and time;
//! - [`Sockets`] is what a user of the crate sees, so that its logic can be
//!   tested against snapshots it makes up.
//!
//! Nothing here decides anything: what counts as a request is the agent's.

pub mod counters;
pub mod diag;
pub mod netns;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("network namespace {path}: {source}")]
    Namespace { path: String, source: std::io::Error },
    #[error("netlink socket: {0}")]
    Socket(std::io::Error),
    #[error("sock_diag answer: {0}")]
    Decode(String),
    #[error("sock_diag answer larger than {0} bytes")]
    TooLarge(usize),
    #[error("sock_diag answer not complete within {0:?}")]
    TimedOut(Duration),
    #[error("sock_diag refused the request: {0}")]
    Refused(std::io::Error),
}

/// A listening socket on the port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listener {
    pub local: SocketAddr,
    /// Connections the kernel completed that the server has not accepted yet.
    pub accept_queue: u32,
    /// The most it holds (the server's `listen()` backlog).
    pub backlog: u32,
}

/// An established (or half-closed) connection to the port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connection {
    pub local: SocketAddr,
    pub peer: SocketAddr,
    /// The kernel's identity of the socket: stays the same while it lives,
    /// never given to another while the namespace lives.
    pub cookie: u64,
    /// `tcp_info.bytes_received`: the bytes the peer sent, in all.
    pub bytes_received: u64,
    /// `tcp_info.bytes_acked`: the bytes the server sent that the peer acknowledged.
    pub bytes_acked: u64,
    /// Bytes received that the server has not read yet.
    pub unread: u32,
    /// Milliseconds since the last data received, and since the last data
    /// sent (`tcp_info.last_data_recv`, `last_data_sent`; never sent: as
    /// long as the host's uptime): received more recently than sent, the
    /// client waits for an answer.
    pub since_recv_ms: u32,
    pub since_sent_ms: u32,
}

impl Connection {
    /// The client sent data and the server never answered, or the client
    /// sent after the server's last data (to the millisecond: within one,
    /// it counts as answered): a request unanswered.
    pub fn awaits_answer(&self) -> bool {
        self.bytes_received > 0 && (self.bytes_acked == 0 || self.since_recv_ms < self.since_sent_ms)
    }
}

/// What one look at a port found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub listeners: Vec<Listener>,
    pub connections: Vec<Connection>,
}

impl Snapshot {
    pub fn listening(&self) -> bool {
        !self.listeners.is_empty()
    }

    /// Connections waiting in every listener's accept queue.
    pub fn accept_queue(&self) -> u32 {
        self.listeners.iter().map(|l| l.accept_queue).sum()
    }
}

/// The bounds of one look: a dump larger or slower than these is an error,
/// never an unbounded read.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_bytes: usize,
    pub timeout: Duration,
}

impl Default for Limits {
    /// 64 MiB: about 300,000 connections on one port, more than a node's
    /// server holds (each answer holds a connection's `tcp_info`).
    fn default() -> Self {
        Self { max_bytes: 64 << 20, timeout: Duration::from_secs(1) }
    }
}

/// The sockets on a port, looked at anew at each call.
pub trait Sockets: Send {
    fn look(&mut self, port: u16) -> Result<Snapshot, Error>;
}

/// The real thing: a `NETLINK_SOCK_DIAG` socket in one namespace.
pub struct Watcher {
    socket: netlink_sys::Socket,
    limits: Limits,
    seq: u32,
    buf: Vec<u8>,
    /// The address families of the port's listeners at the last full
    /// look: a dump walks the kernel's whole table of connections (shared
    /// by every namespace unless `tcp_child_ehash_entries` gives one its
    /// own), so a family no listener has is not asked about. An IPv4
    /// client of a dual-stack listener is an IPv6 socket.
    families: Vec<u8>,
    last_full: Option<std::time::Instant>,
}

/// Every family is asked about at least this often (a new listener).
const FULL_EVERY: Duration = Duration::from_secs(1);

impl Watcher {
    /// In the caller's own network namespace.
    pub fn open(limits: Limits) -> Result<Self, Error> {
        Ok(Self::with(diag::socket(limits.timeout)?, limits))
    }

    /// In the namespace `ns` names (`/proc/PID/ns/net`, `/run/netns/NAME`).
    pub fn open_in(ns: &Path, limits: Limits) -> Result<Self, Error> {
        let socket = netns::inside(ns, move || diag::socket(limits.timeout))?;
        Ok(Self::with(socket, limits))
    }

    fn with(socket: netlink_sys::Socket, limits: Limits) -> Self {
        Self { socket, limits, seq: 0, buf: vec![0; 64 << 10], families: Vec::new(), last_full: None }
    }

    /// The listening sockets on `port` only, however many connections it
    /// has: an answer of a few hundred bytes (a liveness probe's question).
    pub fn listeners(&mut self, port: u16) -> Result<Vec<Listener>, Error> {
        let mut snap = Snapshot::default();
        for family in [libc::AF_INET as u8, libc::AF_INET6 as u8] {
            self.seq = self.seq.wrapping_add(1);
            diag::dump(&self.socket, &mut self.buf, self.seq, family, port, true, &self.limits, &mut snap)?;
        }
        Ok(snap.listeners)
    }
}

impl Sockets for Watcher {
    fn look(&mut self, port: u16) -> Result<Snapshot, Error> {
        let all = [libc::AF_INET as u8, libc::AF_INET6 as u8];
        let full = self.families.is_empty() || self.last_full.is_none_or(|t| t.elapsed() >= FULL_EVERY);
        let families = if full { all.to_vec() } else { self.families.clone() };
        let mut snap = Snapshot::default();
        for family in families {
            self.seq = self.seq.wrapping_add(1);
            diag::dump(&self.socket, &mut self.buf, self.seq, family, port, false, &self.limits, &mut snap)?;
        }
        if full {
            self.last_full = Some(std::time::Instant::now());
            self.families = all
                .into_iter()
                .filter(|f| {
                    snap.listeners
                        .iter()
                        .any(|l| (l.local.is_ipv4() && *f == all[0]) || (l.local.is_ipv6() && *f == all[1]))
                })
                .collect();
        }
        Ok(snap)
    }
}

#[cfg(test)]
mod tests;
