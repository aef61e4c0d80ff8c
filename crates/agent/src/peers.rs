//! Which peers a socket-woken service ignores (`ignore_peers`): addresses
//! and CIDRs, and the node's own addresses, from which a kubelet's httpGet
//! probes come.

use std::net::IpAddr;

/// An address block: `10.0.0.0/8`, `fd00::/8`, or one address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl Cidr {
    pub fn parse(s: &str) -> Result<Self, String> {
        let (a, p) = s.split_once('/').map_or((s, None), |(a, p)| (a, Some(p)));
        let addr: IpAddr = a.trim().parse().map_err(|_| format!("{s:?} is not an address or a CIDR"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match p {
            None => max,
            Some(p) => p
                .trim()
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| format!("{s:?}: the prefix must be 0 to {max}"))?,
        };
        Ok(Self { addr, prefix })
    }

    pub fn host(addr: IpAddr) -> Self {
        Self { addr, prefix: if addr.is_ipv4() { 32 } else { 128 } }
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        match (self.addr, ip) {
            (IpAddr::V4(n), IpAddr::V4(a)) => {
                masked(u32::from(n).into(), 32, self.prefix) == masked(u32::from(a).into(), 32, self.prefix)
            }
            (IpAddr::V6(n), IpAddr::V6(a)) => {
                masked(u128::from(n), 128, self.prefix) == masked(u128::from(a), 128, self.prefix)
            }
            _ => false,
        }
    }
}

fn masked(v: u128, bits: u32, prefix: u8) -> u128 {
    let keep = u32::from(prefix).min(bits);
    if keep == 0 {
        0
    } else {
        v >> (bits - keep)
    }
}

pub fn any_contains(list: &[Cidr], ip: IpAddr) -> bool {
    list.iter().any(|c| c.contains(ip))
}

/// The addresses of this network namespace's interfaces, but loopback:
/// what a kubelet's probes to a pod come from.
pub fn node_addresses() -> Vec<Cidr> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list it allocates, freed below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        tracing::warn!("getifaddrs: {}", std::io::Error::last_os_error());
        return out;
    }
    let mut at = head;
    while !at.is_null() {
        // SAFETY: `at` is a node of the list getifaddrs returned, not freed yet.
        let ifa = unsafe { &*at };
        at = ifa.ifa_next;
        if ifa.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: a non-null ifa_addr points to a sockaddr whose family says
        // which larger struct it is; each is read as that struct only.
        let ip = unsafe {
            match i32::from((*ifa.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    Some(IpAddr::from(u32::from_be(sin.sin_addr.s_addr).to_be_bytes()))
                }
                libc::AF_INET6 => {
                    let sin6 = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    Some(IpAddr::from(sin6.sin6_addr.s6_addr))
                }
                _ => None,
            }
        };
        if let Some(ip) = ip.filter(|ip| !ip.is_loopback()) {
            out.push(Cidr::host(ip));
        }
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_and_addresses() {
        let c = Cidr::parse("10.1.0.0/16").unwrap();
        assert!(c.contains("10.1.200.3".parse().unwrap()));
        assert!(!c.contains("10.2.0.1".parse().unwrap()));
        assert!(c.contains("::ffff:10.1.0.9".parse().unwrap()), "an IPv4 peer of a dual-stack socket");
        assert!(Cidr::parse("127.0.0.2").unwrap().contains("127.0.0.2".parse().unwrap()));
        assert!(!Cidr::parse("127.0.0.2").unwrap().contains("127.0.0.1".parse().unwrap()));
        assert!(Cidr::parse("0.0.0.0/0").unwrap().contains("8.8.8.8".parse().unwrap()));
        assert!(Cidr::parse("fd00::/8").unwrap().contains("fd12::1".parse().unwrap()));
        assert!(Cidr::parse("10.0.0.0/33").is_err());
        assert!(Cidr::parse("node").is_err());
    }

    #[test]
    fn node_addresses_leave_out_loopback() {
        assert!(node_addresses().iter().all(|c| !c.addr.is_loopback()));
    }
}
