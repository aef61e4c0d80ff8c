//! A namespace's TCP counters (`/proc/PID/net/snmp`, the `Tcp:` lines):
//! one small read that says whether anything happened on TCP there since
//! the last, before a dump (which walks the kernel's whole connection
//! table) is asked. A pid names the namespace it lives in.

/// The counters that move when a connection is accepted or a segment comes in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tcp {
    /// Connections accepted (SYN_RECV -> ESTABLISHED), in all.
    pub passive_opens: u64,
    /// Segments received, in all.
    pub in_segs: u64,
}

/// The TCP counters of the network namespace process `pid` is in; None
/// when they cannot be read (the process is gone).
pub fn tcp(pid: i32) -> Option<Tcp> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/net/snmp")).ok()?;
    parse(&text)
}

fn parse(text: &str) -> Option<Tcp> {
    let mut lines = text.lines().filter(|l| l.starts_with("Tcp:"));
    let names: Vec<&str> = lines.next()?.split_whitespace().collect();
    let values: Vec<&str> = lines.next()?.split_whitespace().collect();
    let get = |name: &str| values.get(names.iter().position(|n| *n == name)?)?.parse().ok();
    Some(Tcp { passive_opens: get("PassiveOpens")?, in_segs: get("InSegs")? })
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_tcp_lines() {
        let text = "Ip: Forwarding DefaultTTL\nIp: 1 64\n\
                    Tcp: RtoAlgorithm RtoMin ActiveOpens PassiveOpens AttemptFails InSegs\n\
                    Tcp: 1 200 7 3 0 1234\nUdp: InDatagrams\nUdp: 5\n";
        assert_eq!(super::parse(text), Some(super::Tcp { passive_opens: 3, in_segs: 1234 }));
        assert_eq!(super::parse("Tcp: A B\n"), None);
    }
}
