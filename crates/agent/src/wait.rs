//! The wait for a service, and the answer when it cannot come: a request is
//! held (bounded by `max_waiting` and `wake_timeout`) while the policy
//! brings its service back, and refused at once when the service cannot
//! come back, or as soon as the start, wake or resume it waited for fails.
//! A client that hangs up meanwhile drops this future: it leaves the wait,
//! and its request is never forwarded. Both doors use it: the front door
//! (`frontdoor`) and a service's own port (`proxy`).

use crate::control::{Control, Refusal};
use crate::metrics::ServiceLabels;
use crate::service::{Conn, Service, State};
use crate::trace::WakeTrace;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Front door requests count as connections of their service; their ids
/// are apart from the per-port proxy's.
static NEXT: AtomicU64 = AtomicU64::new(1 << 62);
/// After a wait that ran out, or a transition that failed.
const RETRY_AFTER: Duration = Duration::from_secs(5);

/// One request given its running service: it counts as a connection (in
/// flight until its answer's first byte) until dropped.
pub struct InFlight {
    pub agent: Arc<dyn Control>,
    pub svc: Arc<Service>,
    pub id: u64,
    /// The wake this request waited for, until its first byte.
    pub trace: Option<WakeTrace>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut g = self.svc.lock();
        g.conns.remove(&self.id);
        g.last_activity = Instant::now();
        drop(g);
        self.agent.metrics().in_flight.get_or_create(&ServiceLabels { service: self.svc.name.clone() }).dec();
    }
}

impl InFlight {
    /// The backend answered (its headers came).
    pub fn answered(&mut self) {
        {
            let mut g = self.svc.lock();
            if let Some(c) = g.conns.get_mut(&self.id) {
                c.awaiting = false;
            }
            g.last_activity = Instant::now();
        }
        if let Some(mut t) = self.trace.take() {
            t.mark_now("first_byte");
            self.agent.metrics().swap_done(&self.svc.name, &t);
            let (agent, svc) = (Arc::clone(&self.agent), Arc::clone(&self.svc));
            tokio::task::spawn_blocking(move || agent.note(&svc, &t.summary()));
        }
    }

    /// Marks the request in flight if the service runs: under the lock the
    /// policy decides to suspend under, so it cannot be suspended between
    /// this check and the request reaching the backend.
    fn begin(&self) -> bool {
        let mut g = self.svc.lock();
        if g.state != State::Running {
            return false;
        }
        let bound = self.svc.cfg.request_timeout;
        if let Some(c) = g.conns.get_mut(&self.id) {
            if !c.awaiting {
                c.stale_at = bound.and_then(|b| Instant::now().checked_add(b));
            }
            c.awaiting = true;
        }
        g.last_activity = Instant::now();
        g.last_used_ms = gpusnap_core::store::now_ms();
        true
    }
}

/// Waits until `svc` runs, then counts the request in flight; or says why not.
pub async fn admit(agent: &Arc<dyn Control>, svc: &Arc<Service>) -> Result<InFlight, Refusal> {
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    {
        let mut g = svc.lock();
        g.conns.insert(id, Conn { awaiting: false, stale_at: None, backend: false });
        g.last_activity = Instant::now();
    }
    agent.metrics().in_flight.get_or_create(&ServiceLabels { service: svc.name.clone() }).inc();
    let mut f = InFlight { agent: Arc::clone(agent), svc: Arc::clone(svc), id, trace: None };
    while !f.begin() {
        match wait(agent, svc).await {
            Ok(Some(t)) => f.trace = Some(t),
            Ok(None) => {}
            Err(r) => {
                agent
                    .metrics()
                    .connections_closed
                    .get_or_create(&ServiceLabels { service: svc.name.clone() })
                    .inc();
                tracing::warn!(service = svc.name, "refused a request: {}", r.reason);
                return Err(r);
            }
        }
    }
    Ok(f)
}

/// Counts a request or connection as waiting for its service (bounded by
/// max_waiting); the front door's waits and the port proxy's share it.
pub(crate) struct Waiting<'a>(&'a Service);

impl<'a> Waiting<'a> {
    /// Counts one more waiter, or gives how many already wait when
    /// `max_waiting` is reached.
    pub(crate) fn take(svc: &'a Service) -> Result<Self, usize> {
        let mut g = svc.lock();
        if g.waiting >= svc.cfg.max_waiting {
            return Err(g.waiting);
        }
        g.waiting += 1;
        Ok(Waiting(svc))
    }
}

/// A wait that ended with `svc` running: observed and logged (`who`: what
/// waited); the trace of the wake, if this waiter is the first to see it
/// done.
pub(crate) fn waited(agent: &Arc<dyn Control>, svc: &Service, t0: Instant, who: &str) -> Option<WakeTrace> {
    agent
        .metrics()
        .wait
        .get_or_create(&ServiceLabels { service: svc.name.clone() })
        .observe(t0.elapsed().as_secs_f64());
    tracing::info!(
        service = svc.name,
        waited_ms = t0.elapsed().as_millis() as u64,
        "{who} waited for its service"
    );
    let mut t = svc.lock().trace.take();
    if let Some(t) = t.as_mut() {
        t.mark_now("ready");
    }
    t
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.lock().waiting -= 1;
    }
}

/// One wait for `svc`, as the per-port proxy's, refused early when the
/// service cannot come back. Returns the trace of the wake it waited for,
/// if it is the first to see it done.
pub async fn wait(agent: &Arc<dyn Control>, svc: &Arc<Service>) -> Result<Option<WakeTrace>, Refusal> {
    // Subscribed before the first look: no change is missed between.
    let rx = svc.changed.subscribe();
    if let Some(r) = agent.hopeless(svc) {
        return Err(r);
    }
    let _w = Waiting::take(svc).map_err(|n| Refusal {
        reason: format!("{}: {n} requests already wait (max_waiting)", svc.name),
        retry_after: Duration::from_secs(1),
    })?;
    let t0 = Instant::now();
    let running = Arc::clone(agent).wait_running(Arc::clone(svc), t0 + svc.cfg.wake_timeout, Some(t0));
    let r = tokio::select! {
        r = running => r.map_err(|e| Refusal { reason: e.0, retry_after: RETRY_AFTER }),
        r = failed(agent, svc, rx) => Err(r),
    };
    if let Ok(true) = r {
        return Ok(waited(agent, svc, t0, "request"));
    }
    r.map(|_| None)
}

/// Resolves once the transition that would bring `svc` back fails (a start,
/// wake or resume that falls back to where it was): the wait is then over.
async fn failed(
    agent: &Arc<dyn Control>,
    svc: &Service,
    mut rx: tokio::sync::watch::Receiver<u64>,
) -> Refusal {
    let mut prev = svc.lock().state;
    loop {
        if rx.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
        let (now, last_error) = {
            let g = svc.lock();
            (g.state, g.last_error.clone())
        };
        let (from, to) = (prev, now);
        prev = now;
        // However it got there (a failure this wait saw or not).
        if let Some(r) = agent.hopeless(svc) {
            return r;
        }
        let bringing_back = matches!(from, State::Starting | State::Waking | State::Resuming);
        if bringing_back
            && matches!(
                to,
                State::Dead
                    | State::Exited
                    | State::Hibernated
                    | State::Suspended
                    | State::Parked
                    | State::Idle
            )
        {
            return Refusal {
                reason: format!(
                    "{}: {} failed: {}",
                    svc.name,
                    match from {
                        State::Starting => "its start",
                        State::Waking => "its wake",
                        _ => "its resume",
                    },
                    last_error.as_deref().unwrap_or("no reason recorded")
                ),
                retry_after: RETRY_AFTER,
            };
        }
    }
}

pub(crate) fn retry_secs(r: &Refusal) -> u64 {
    r.retry_after.as_secs_f64().ceil().max(1.0) as u64
}

/// The refusal in OpenAI's error format, without host paths.
pub(crate) fn refusal_json(svc: &Service, r: &Refusal) -> serde_json::Value {
    serde_json::json!({ "error": {
        "message": without_paths(&r.reason),
        "type": "service_unavailable",
        "code": "service_unavailable",
        "service": svc.name,
        "retry_after": retry_secs(r),
    }})
}

/// The same 503 as bytes, for a service's own port (`fail_fast`).
pub fn refused_bytes(svc: &Service, r: &Refusal) -> Vec<u8> {
    let secs = retry_secs(r);
    let body = refusal_json(svc, r).to_string();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n\
         Retry-After: {secs}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// [`wait`] for a connection on a service's own port (`fail_fast`), reading
/// what the client sends meanwhile into `early` (at most `cap` bytes).
/// `None`: the client hung up first; nothing of it is to be forwarded.
pub async fn wait_reading(
    agent: &Arc<dyn Control>,
    svc: &Arc<Service>,
    client: &mut tokio::net::TcpStream,
    early: &mut Vec<u8>,
    cap: usize,
) -> Option<Result<Option<WakeTrace>, Refusal>> {
    use tokio::io::AsyncReadExt;
    let w = wait(agent, svc);
    tokio::pin!(w);
    let mut buf = vec![0u8; cap];
    loop {
        let room = cap - early.len();
        tokio::select! {
            r = &mut w => return Some(r),
            n = client.read(&mut buf[..room]), if room > 0 => match n {
                Ok(0) | Err(_) => return None,
                Ok(n) => early.extend_from_slice(&buf[..n]),
            },
        }
    }
}

/// `text` with every word that names a path (it holds a `/`) left out: an
/// anonymous client learns why a service is down, not the host's layout.
pub fn without_paths(text: &str) -> String {
    text.split(' ')
        .map(|w| {
            if !w.contains('/') {
                return w.to_string();
            }
            // The punctuation around it is the sentence's, not the path's.
            let lead = w.len() - w.trim_start_matches(['(', '[', '"', '\'']).len();
            let tail = w.trim_end_matches([')', ']', ';', ',', ':', '.', '"', '\'']);
            format!("{}[path]{}", &w[..lead], &w[tail.len()..])
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_left_out_of_reasons() {
        assert_eq!(
            without_paths("alpha: its start failed: exited 1 (see /var/lib/gpusnap/agent/alpha.log); next"),
            "alpha: its start failed: exited 1 (see [path]); next"
        );
    }
}
