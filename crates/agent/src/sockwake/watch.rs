//! The watch of one socket-woken service: a thread of its own (a netlink
//! dump is a blocking call, made every `socket_poll` while the service is
//! off the GPU) that looks at the port, keeps the service's connections
//! in its books as the proxy does, and asks the agent to bring the service
//! back through [`Control::wait_running`], as a proxied connection does.

use super::decide::{Changes, Tracker, Why};
use crate::control::Control;
use crate::metrics::ServiceLabels;
use crate::peers::Cidr;
use crate::ratelimit::Every;
use crate::service::{Conn, Service, State};
use gpusnap_sockwatch::{Limits, Sockets, Watcher};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

static LOOK_FAILED: Every = Every::new(Duration::from_secs(1));

/// Starts the watch of `svc` on a thread of its own; wakes run on `rt`.
pub fn spawn(ctl: Arc<dyn Control>, svc: Arc<Service>, rt: tokio::runtime::Handle) {
    let name = format!("sockwake-{}", svc.name);
    let r = std::thread::Builder::new().name(name).spawn(move || Watch::new(ctl, svc, rt).run());
    if let Err(e) = r {
        tracing::error!("could not start a socket watch: {e}");
    }
}

/// The namespace being watched and the socket opened in it.
struct Open {
    ns: (u64, u64),
    sockets: Box<dyn Sockets>,
    ignore: Vec<Cidr>,
}

struct Watch {
    ctl: Arc<dyn Control>,
    svc: Arc<Service>,
    rt: tokio::runtime::Handle,
    open: Option<Open>,
    tracker: Tracker,
    own_ns: Option<(u64, u64)>,
    /// A reason to come back seen while the service was between states
    /// (suspending): acted on once it is suspended.
    pending: Option<(Instant, Why)>,
    waking: Arc<AtomicBool>,
    /// The namespace's TCP counters at the last dump, and when it was.
    counters: Option<gpusnap_sockwatch::counters::Tcp>,
    last_dump: Option<Instant>,
}

fn ns_id(path: &std::path::Path) -> Option<(u64, u64)> {
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

impl Watch {
    fn new(ctl: Arc<dyn Control>, svc: Arc<Service>, rt: tokio::runtime::Handle) -> Self {
        Self {
            ctl,
            svc,
            rt,
            open: None,
            tracker: Tracker::default(),
            own_ns: ns_id(std::path::Path::new("/proc/self/ns/net")),
            pending: None,
            waking: Arc::new(AtomicBool::new(false)),
            counters: None,
            last_dump: None,
        }
    }

    fn run(mut self) {
        let port = self.svc.cfg.backend.port();
        loop {
            // A service the agent no longer serves (a pod deleted) is not
            // watched any more.
            if !self.ctl.service(&self.svc.name).is_some_and(|s| Arc::ptr_eq(&s, &self.svc)) {
                return;
            }
            let (before, pid) = {
                let g = self.svc.lock();
                (g.state, g.process.as_ref().map(|t| t.pid))
            };
            self.sleep(before);
            let Some(path) = self
                .svc
                .cfg
                .netns
                .clone()
                .or_else(|| pid.map(|p| PathBuf::from(format!("/proc/{p}/ns/net"))))
            else {
                continue;
            };
            if !self.reopen(&path) {
                continue;
            }
            // Off the GPU, a dump (it walks the kernel's whole connection
            // table) only when the namespace's TCP counters moved, or every
            // socket_poll_running; read before the dump, so that nothing
            // that moves them after is missed.
            if !self.worth_a_look(before, pid) {
                continue;
            }
            let Some(open) = self.open.as_mut() else { continue };
            let snap = match open.sockets.look(port) {
                Ok(s) => s,
                Err(e @ gpusnap_sockwatch::Error::TooLarge(_)) => {
                    // So many connections are traffic: a server that is
                    // away comes back for them, and the watch goes on (on a
                    // socket opened anew: the rest of that answer is still
                    // in this one).
                    crate::warn_every!(
                        LOOK_FAILED,
                        service = self.svc.name,
                        "socket watch on port {port}: {e}"
                    );
                    let state = self.svc.lock().state;
                    if matches!(state, State::Suspended | State::Hibernated)
                        && !self.waking.load(Ordering::SeqCst)
                    {
                        self.wake(Instant::now(), Why::Crowded);
                    }
                    self.open = None;
                    continue;
                }
                Err(e) => {
                    crate::warn_every!(
                        LOOK_FAILED,
                        service = self.svc.name,
                        "socket watch on port {port}: {e}"
                    );
                    self.open = None;
                    continue;
                }
            };
            let seen = Instant::now();
            let ch = self.tracker.see(&snap, &open.ignore);
            self.book(&ch);
            // The state now, after the look: a service still running now
            // was running when the look saw the request, and serves it.
            // One that is not (a suspend began during the look, or during
            // the sleep before it) must come back for it.
            let state = self.svc.lock().state;
            if state == State::Running {
                self.pending = None;
            } else if let Some(why) = ch.wake {
                self.pending.get_or_insert((seen, why));
            }
            if matches!(state, State::Suspended | State::Parked | State::Hibernated)
                && !self.waking.load(Ordering::SeqCst)
            {
                if let Some((seen, why)) = self.pending.take() {
                    self.wake(seen, why);
                }
            }
        }
    }

    /// Whether to dump now: always while the service runs (looks are
    /// `socket_poll_running` apart then); off the GPU, when the TCP
    /// counters of the server's namespace moved since the last dump (a
    /// connection accepted, a segment received), when they cannot be read
    /// there (a `netns` the server's process is not in), or every
    /// `socket_poll_running` all the same.
    fn worth_a_look(&mut self, state: State, pid: Option<i32>) -> bool {
        let off = matches!(state, State::Suspended | State::Parked | State::Hibernated | State::Suspending);
        let same_ns = |p: i32| {
            self.open
                .as_ref()
                .is_some_and(|o| ns_id(std::path::Path::new(&format!("/proc/{p}/ns/net"))) == Some(o.ns))
        };
        let now = pid.filter(|p| same_ns(*p)).and_then(gpusnap_sockwatch::counters::tcp);
        let due = self.last_dump.is_none_or(|t| t.elapsed() >= self.svc.cfg.socket_poll_running);
        let look = !off || due || now.is_none() || now != self.counters;
        if look {
            self.counters = now;
            self.last_dump = Some(Instant::now());
        }
        look
    }

    /// Until the next look: `socket_poll` while the service is off the GPU
    /// (or going off it), else `socket_poll_running`, cut short as soon as
    /// it starts going off (a look at once, not up to 100 ms later).
    fn sleep(&self, state: State) {
        let off =
            |s: State| matches!(s, State::Suspended | State::Parked | State::Hibernated | State::Suspending);
        if off(state) {
            std::thread::sleep(self.svc.cfg.socket_poll);
            return;
        }
        let end = Instant::now() + self.svc.cfg.socket_poll_running;
        let step = self.svc.cfg.socket_poll.min(self.svc.cfg.socket_poll_running);
        while Instant::now() < end {
            std::thread::sleep(step.min(end.saturating_duration_since(Instant::now())));
            if off(self.svc.lock().state) {
                return;
            }
        }
    }

    /// Opens the watch in `path`'s namespace if it is not open there yet
    /// (the server was restarted or woken into another one).
    fn reopen(&mut self, path: &std::path::Path) -> bool {
        let Some(ns) = ns_id(path) else { return self.open.is_some() };
        if self.open.as_ref().is_some_and(|o| o.ns == ns) {
            return true;
        }
        let own = Some(ns) == self.own_ns;
        let opened =
            if own { Watcher::open(Limits::default()) } else { Watcher::open_in(path, Limits::default()) };
        match opened {
            Ok(w) => {
                let ignore = self.svc.cfg.ignore_peers().unwrap_or_else(|| {
                    // In the agent's own namespace every local client has a
                    // node address: none is ignored unless asked.
                    if own {
                        Vec::new()
                    } else {
                        crate::peers::node_addresses()
                    }
                });
                tracing::info!(
                    service = self.svc.name,
                    netns = %path.display(),
                    own,
                    ignored = ignore.len(),
                    "watching the server's port"
                );
                self.tracker = Tracker::default();
                self.open = Some(Open { ns, sockets: Box::new(w), ignore });
                true
            }
            Err(e) => {
                crate::warn_every!(LOOK_FAILED, service = self.svc.name, "socket watch: {e}");
                false
            }
        }
    }

    /// The connections into the service's books, as the proxy keeps them:
    /// the idle rule, evictions and hibernation read them the same way.
    fn book(&self, ch: &Changes) {
        if !ch.traffic() {
            return;
        }
        let labels = ServiceLabels { service: self.svc.name.clone() };
        let gauge = self.ctl.metrics().in_flight.get_or_create(&labels);
        let now = Instant::now();
        let mut g = self.svc.lock();
        for id in &ch.opened {
            if g.conns.insert(*id, Conn::default()).is_none() {
                gauge.inc();
            }
        }
        for id in &ch.closed {
            if g.conns.remove(id).is_some() {
                gauge.dec();
            }
        }
        let bound = self.svc.cfg.request_timeout;
        for id in &ch.sent {
            if let Some(c) = g.conns.get_mut(id) {
                if !c.awaiting {
                    c.stale_at = bound.and_then(|b| now.checked_add(b));
                }
                c.awaiting = true;
            }
        }
        for id in &ch.answered {
            if let Some(c) = g.conns.get_mut(id) {
                c.awaiting = false;
                c.stale_at = None;
            }
        }
        g.last_activity = now;
        if !ch.sent.is_empty() || !ch.opened.is_empty() {
            g.last_used_ms = gpusnap_core::store::now_ms();
        }
    }

    /// Asks for the service back, as a proxied connection does; one wake at
    /// a time (a reason seen meanwhile waits in `pending`).
    fn wake(&self, seen: Instant, why: Why) {
        self.waking.store(true, Ordering::SeqCst);
        let (ctl, svc, waking) = (Arc::clone(&self.ctl), Arc::clone(&self.svc), Arc::clone(&self.waking));
        self.rt.spawn(async move {
            let labels = ServiceLabels { service: svc.name.clone() };
            let start = Instant::now();
            ctl.metrics().socket_wakes.get_or_create(&labels).inc();
            ctl.metrics().socket_wake_delay.get_or_create(&labels).observe((start - seen).as_secs_f64());
            tracing::info!(
                service = svc.name,
                why = why.as_str(),
                seen_us = (start - seen).as_micros() as u64,
                start_unix_us = unix_us(SystemTime::now()),
                "socket wake"
            );
            let deadline = start + svc.cfg.wake_timeout;
            let r = Arc::clone(&ctl).wait_running(Arc::clone(&svc), deadline, Some(seen)).await;
            match r {
                Ok(true) => {
                    if let Some(t) = crate::wait::waited(&ctl, &svc, seen, "a socket wake") {
                        ctl.metrics().swap_done(&svc.name, &t);
                        let summary = format!("{} ({})", t.summary(), why.as_str());
                        let _ = tokio::task::spawn_blocking(move || ctl.note(&svc, &summary)).await;
                    }
                }
                Ok(false) => {}
                Err(e) => tracing::warn!(service = svc.name, "a socket wake failed: {}", e.0),
            }
            waking.store(false, Ordering::SeqCst);
        });
    }
}

fn unix_us(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}
