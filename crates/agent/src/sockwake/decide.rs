//! What one look at a port means, compared with the one before: which
//! connections came and went, which carried a request (the client's bytes
//! grew) or an answer (the server's acknowledged bytes grew), and whether
//! that is a reason to bring a suspended server back. Pure: it sees
//! snapshots, never the kernel.

use crate::peers::{any_contains, Cidr};
use gpusnap_sockwatch::Snapshot;
use std::collections::HashMap;

/// Why a look asks for the service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// A connection from a counted peer that was not there before.
    Connection,
    /// Bytes from a counted peer on a connection seen before (keep-alive).
    Bytes,
    /// The accept queue holds connections, none of them seen yet.
    Queued,
    /// More connections on the port than a look may read: traffic, by
    /// all appearances, never a reason to stop watching.
    Crowded,
}

impl Why {
    pub fn as_str(self) -> &'static str {
        match self {
            Why::Connection => "a new connection",
            Why::Bytes => "bytes on a kept-alive connection",
            Why::Queued => "connections in the accept queue",
            Why::Crowded => "more connections than a look reads",
        }
    }
}

/// What changed since the last look (connections named by the kernel's cookie).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Changes {
    pub opened: Vec<u64>,
    pub closed: Vec<u64>,
    /// The client sent bytes: a request in flight.
    pub sent: Vec<u64>,
    /// The server's bytes were acknowledged: an answer.
    pub answered: Vec<u64>,
    pub wake: Option<Why>,
}

impl Changes {
    /// Bytes moved, or connections came or went.
    pub fn traffic(&self) -> bool {
        !(self.opened.is_empty()
            && self.closed.is_empty()
            && self.sent.is_empty()
            && self.answered.is_empty())
    }
}

#[derive(Debug, Clone, Copy)]
struct Counters {
    received: u64,
    acked: u64,
}

/// The connections of the last look, with their counters.
#[derive(Debug, Default)]
pub struct Tracker {
    known: HashMap<u64, Counters>,
    primed: bool,
}

impl Tracker {
    /// Compares `snap` with the last look. Connections from `ignore` are
    /// left out entirely: they neither wake nor count as traffic. The first
    /// look only learns what is there (a kept-alive connection is no
    /// request), unless the accept queue holds connections.
    pub fn see(&mut self, snap: &Snapshot, ignore: &[Cidr]) -> Changes {
        let mut ch = Changes::default();
        let mut now = HashMap::new();
        let mut counted = 0usize;
        // (counted: connections of peers not ignored)
        for c in &snap.connections {
            if any_contains(ignore, c.peer.ip()) {
                continue;
            }
            counted += 1;
            let counters = Counters { received: c.bytes_received, acked: c.bytes_acked };
            now.insert(c.cookie, counters);
            match self.known.get(&c.cookie) {
                None => {
                    ch.opened.push(c.cookie);
                    if self.primed {
                        ch.wake.get_or_insert(Why::Connection);
                    }
                    // Bytes it already carries are a request in flight; on
                    // the first look (a kept-alive connection carried
                    // earlier requests) only if the client sent after the
                    // server's last answer: a request that came just
                    // before the look, while suspended, must wake.
                    if self.primed && c.bytes_received > 0 {
                        ch.sent.push(c.cookie);
                    } else if !self.primed && (c.unread > 0 || c.awaits_answer()) {
                        ch.sent.push(c.cookie);
                        ch.wake.get_or_insert(Why::Bytes);
                    }
                }
                Some(old) => {
                    if c.bytes_received > old.received {
                        ch.sent.push(c.cookie);
                        ch.wake.get_or_insert(Why::Bytes);
                    }
                    if c.bytes_acked > old.acked {
                        ch.answered.push(c.cookie);
                    }
                }
            }
        }
        ch.closed = self.known.keys().filter(|k| !now.contains_key(k)).copied().collect();
        ch.closed.sort_unstable();
        // Queued connections that the dump did not show (or not yet): the
        // queue is the kernel's own count. Ignored peers' queued
        // connections are shown, so an all-ignored queue never wakes. On
        // the first look, a queue beside counted connections does.
        let queued = snap.accept_queue() > 0;
        if queued && (snap.connections.is_empty() || (!self.primed && counted > 0)) {
            ch.wake.get_or_insert(Why::Queued);
        }
        self.known = now;
        self.primed = true;
        ch
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpusnap_sockwatch::{Connection, Listener};

    fn conn(cookie: u64, peer: &str, received: u64, acked: u64) -> Connection {
        Connection {
            local: "127.0.0.1:8000".parse().unwrap(),
            peer: format!("{peer}:40000").parse().unwrap(),
            cookie,
            bytes_received: received,
            bytes_acked: acked,
            unread: 0,
            // Answered after the last request (or nothing received yet).
            since_recv_ms: 5000,
            since_sent_ms: if acked > 0 { 1000 } else { u32::MAX },
        }
    }

    fn snap(queue: u32, conns: Vec<Connection>) -> Snapshot {
        Snapshot {
            listeners: vec![Listener {
                local: "127.0.0.1:8000".parse().unwrap(),
                accept_queue: queue,
                backlog: 128,
            }],
            connections: conns,
        }
    }

    #[test]
    fn the_first_look_learns_kept_alive_connections_without_waking() {
        let mut t = Tracker::default();
        let ch = t.see(&snap(0, vec![conn(1, "10.0.0.5", 100, 200)]), &[]);
        assert_eq!(ch.wake, None);
        assert_eq!(ch.opened, vec![1]);
        assert_eq!(t.see(&snap(0, vec![conn(1, "10.0.0.5", 100, 200)]), &[]), Changes::default());
    }

    #[test]
    fn a_new_connection_then_its_request_then_its_answer() {
        let mut t = Tracker::default();
        t.see(&snap(0, vec![]), &[]);
        let ch = t.see(&snap(1, vec![conn(7, "10.0.0.5", 0, 0)]), &[]);
        assert_eq!((ch.wake, ch.opened.clone()), (Some(Why::Connection), vec![7]));
        let ch = t.see(&snap(0, vec![conn(7, "10.0.0.5", 80, 0)]), &[]);
        assert_eq!((ch.wake, ch.sent.clone()), (Some(Why::Bytes), vec![7]));
        let ch = t.see(&snap(0, vec![conn(7, "10.0.0.5", 80, 500)]), &[]);
        assert_eq!((ch.wake, ch.answered.clone()), (None, vec![7]));
        let ch = t.see(&snap(0, vec![]), &[]);
        assert_eq!((ch.wake, ch.closed.clone()), (None, vec![7]));
        assert!(ch.traffic());
    }

    #[test]
    fn ignored_peers_neither_wake_nor_count() {
        let ignore = [Cidr::parse("10.88.0.1").unwrap()];
        let mut t = Tracker::default();
        t.see(&snap(0, vec![]), &ignore);
        let ch = t.see(&snap(1, vec![conn(3, "10.88.0.1", 90, 0)]), &ignore);
        assert_eq!(ch, Changes::default(), "a probe in the queue");
        let ch = t.see(&snap(0, vec![conn(3, "10.88.0.1", 90, 400)]), &ignore);
        assert_eq!(ch, Changes::default(), "its answer");
        let ch = t.see(&snap(1, vec![conn(3, "10.88.0.1", 90, 400), conn(4, "10.0.0.9", 0, 0)]), &ignore);
        assert_eq!(ch.wake, Some(Why::Connection));
        assert_eq!(ch.opened, vec![4]);
    }

    #[test]
    fn the_first_look_wakes_for_a_request_the_server_read_but_did_not_answer() {
        let mut t = Tracker::default();
        let mut c = conn(5, "10.0.0.5", 180, 400);
        c.since_recv_ms = 3;
        c.since_sent_ms = 9000;
        let ch = t.see(&snap(0, vec![c]), &[]);
        assert_eq!((ch.wake, ch.sent.clone()), (Some(Why::Bytes), vec![5]));
    }

    #[test]
    fn a_queue_the_dump_did_not_show_wakes() {
        let mut t = Tracker::default();
        assert_eq!(t.see(&snap(2, vec![]), &[]).wake, Some(Why::Queued), "on the first look too");
        let mut t = Tracker::default();
        t.see(&snap(0, vec![]), &[]);
        assert_eq!(t.see(&snap(1, vec![]), &[]).wake, Some(Why::Queued));
    }

    #[test]
    fn a_connection_seen_first_with_bytes_carries_a_request() {
        let mut t = Tracker::default();
        t.see(&snap(0, vec![]), &[]);
        let ch = t.see(&snap(1, vec![conn(9, "10.0.0.5", 120, 0)]), &[]);
        assert_eq!(ch.sent, vec![9]);
        assert_eq!(ch.wake, Some(Why::Connection));
    }
}
