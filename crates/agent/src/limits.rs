//! What a client may hold of the agent: file descriptors and connections.
//!
//! At start the agent raises its soft `RLIMIT_NOFILE` to the hard limit and
//! keeps a reserve of descriptors for itself (256, or half of a lower limit) (journal, state files, /proc,
//! CRIU's pipes); what is left is the connection budget ([`Budget`]). Every
//! listener takes a [`Slot`] before it serves a connection, from its own cap
//! (a service's `max_connections`) and from the agent's total; a connection
//! beyond either is closed at once, never queued. A proxied connection costs
//! two descriptors (the client's and the backend's).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Descriptors kept for the agent's own work, whatever the clients do.
pub const RESERVE: u64 = 256;

/// The descriptor limit the agent runs under, after [`raise_nofile`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nofile {
    pub soft: u64,
    pub hard: u64,
}

/// Raises the soft limit on open files to the hard one (systemd's
/// `LimitNOFILE=` sets both; a shell's `ulimit -n` often only the soft one).
pub fn raise_nofile() -> Nofile {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return Nofile { soft: 1024, hard: 1024 };
    };
    if soft < hard {
        match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => {
                tracing::debug!(from = soft, to = hard, "raised the open-file limit");
                return Nofile { soft: hard, hard };
            }
            Err(e) => tracing::warn!("could not raise the open-file limit from {soft} to {hard}: {e}"),
        }
    }
    Nofile { soft, hard }
}

/// Connections the API's socket serves at once (fewer under a low limit).
pub const API_CONNECTIONS: usize = 256;
/// Connections the metrics listener serves at once (fewer under a low limit).
pub const METRICS_CONNECTIONS: usize = 64;

/// How the descriptors left after the reserve are shared: the API and the
/// metrics listener have caps of their own (a flood on a service's port
/// never locks the operator out), the services' ports share the rest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// Connections on all the services' ports together (two descriptors each).
    pub proxies: usize,
    pub api: usize,
    pub metrics: usize,
}

impl Nofile {
    /// The connection budget. Under a low limit (`ulimit -n 64`) half of it
    /// is the reserve, and the API and metrics get an eighth each.
    pub fn budget(self) -> Budget {
        let usable =
            usize::try_from(self.soft.saturating_sub(RESERVE.min(self.soft / 2))).unwrap_or(usize::MAX);
        let api = API_CONNECTIONS.min(usable / 8).max(1);
        let metrics = METRICS_CONNECTIONS.min(usable / 8).max(1);
        let proxies = (usable.saturating_sub(api + metrics) / 2).max(1);
        Budget { proxies, api, metrics }
    }
}

/// A count of connections held, bounded by a cap.
#[derive(Debug)]
pub struct Cap {
    held: AtomicUsize,
    max: usize,
}

impl Cap {
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Self { held: AtomicUsize::new(0), max })
    }

    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    pub fn max(&self) -> usize {
        self.max
    }

    fn take(self: &Arc<Self>) -> Option<Held> {
        let mut now = self.held.load(Ordering::Relaxed);
        loop {
            if now >= self.max {
                return None;
            }
            match self.held.compare_exchange_weak(now, now + 1, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return Some(Held(Arc::clone(self))),
                Err(n) => now = n,
            }
        }
    }
}

#[derive(Debug)]
struct Held(Arc<Cap>);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.held.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One connection's place under its listener's cap and the agent's total;
/// given back when dropped.
#[derive(Debug)]
pub struct Slot {
    _own: Held,
    _total: Held,
}

/// Which cap refused a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Full {
    /// The listener's own cap (a service's `max_connections`).
    Listener(usize),
    /// The agent's total, under its descriptor budget.
    Total(usize),
}

impl std::fmt::Display for Full {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Full::Listener(n) => write!(f, "{n} connections already open on this listener"),
            Full::Total(n) => write!(f, "{n} connections already open in all (the descriptor budget)"),
        }
    }
}

/// Takes a slot under `own` and `total`, or says which is full.
pub fn admit(own: &Arc<Cap>, total: &Arc<Cap>) -> Result<Slot, Full> {
    let o = own.take().ok_or(Full::Listener(own.max))?;
    let t = total.take().ok_or(Full::Total(total.max))?;
    Ok(Slot { _own: o, _total: t })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_refuse_beyond_their_max_and_free_on_drop() {
        let total = Cap::new(3);
        let (a, b) = (Cap::new(2), Cap::new(2));
        let s1 = admit(&a, &total).unwrap();
        let _s2 = admit(&a, &total).unwrap();
        assert_eq!(admit(&a, &total).unwrap_err(), Full::Listener(2));
        let _s3 = admit(&b, &total).unwrap();
        assert_eq!(admit(&b, &total).unwrap_err(), Full::Total(3));
        // The refused one took nothing from b.
        assert_eq!(b.held(), 1);
        drop(s1);
        assert!(admit(&b, &total).is_ok());
    }

    #[test]
    fn the_budget_keeps_the_reserve() {
        assert_eq!(Nofile { soft: 64, hard: 64 }.budget(), Budget { proxies: 12, api: 4, metrics: 4 });
        assert_eq!(Nofile { soft: 1024, hard: 4096 }.budget(), Budget { proxies: 304, api: 96, metrics: 64 });
        let big = Nofile { soft: 1 << 20, hard: 1 << 20 }.budget();
        assert_eq!(big, Budget { proxies: ((1 << 20) - 256 - 256 - 64) / 2, api: 256, metrics: 64 });
    }
}
