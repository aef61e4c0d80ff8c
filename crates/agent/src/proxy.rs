//! The TCP proxy in front of each service (as Knative's activator and KEDA's
//! interceptor do): bytes both ways, any protocol, never parsed. It sees
//! enough to know whether a request is in flight: the client sent bytes the
//! backend has not answered yet. Client bytes for a service that is not
//! running wait until it is back (resumed, woken or started).

use crate::control::{Control, Refusal};
use crate::limits;
use crate::listen::Bounds;
use crate::metrics::ServiceLabels;
use crate::ratelimit::Every;
use crate::service::{Conn, Service, State};
use crate::trace::WakeTrace;
use crate::wait::{waited, Waiting};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

static NEXT_CONN: AtomicU64 = AtomicU64::new(1);
const BUF: usize = 64 * 1024;
/// Between connects to a backend that does not listen yet (a server still
/// loading); was 50 ms, a latency a request paid for nothing.
const CONNECT_RETRY: Duration = Duration::from_millis(10);

static ACCEPT_FAILED: Every = Every::new(Duration::from_secs(1));
static REFUSED: Every = Every::new(Duration::from_secs(1));
static CLOSED: Every = Every::new(Duration::from_secs(1));

/// Accepts the connections of the service named `name`, each under its cap
/// and the agent's total (`bounds`): one beyond either is closed at once. A
/// failed accept (out of descriptors) backs off instead of spinning, warned
/// about at most once a second. Each connection goes to the service of that
/// name as it is then (a reload may have given it a new config); once there
/// is none listening at `addr` (removed, or moved by a reload), the listener
/// is closed.
pub async fn serve(
    agent: Arc<dyn Control>,
    name: String,
    addr: std::net::SocketAddr,
    listener: TcpListener,
    bounds: Bounds,
) {
    loop {
        match listener.accept().await {
            Ok((client, _)) => {
                let current = agent
                    .service(&name)
                    .filter(|s| s.cfg.listen.as_ref().map(|l| *l.get_ref()) == Some(addr));
                let Some(svc) = current else {
                    tracing::info!(service = name, "no longer served on {addr}: its proxy is closed");
                    return;
                };
                let slot = match limits::admit(&bounds.own, &bounds.total) {
                    Ok(s) => s,
                    Err(full) => {
                        crate::warn_every!(REFUSED, service = svc.name, "refused a connection: {full}");
                        agent
                            .metrics()
                            .connections_closed
                            .get_or_create(&ServiceLabels { service: svc.name.clone() })
                            .inc();
                        continue;
                    }
                };
                let (a, s) = (Arc::clone(&agent), svc);
                let first_byte = bounds.header_timeout;
                tokio::spawn(async move {
                    let _slot = slot;
                    handle(a, s, client, first_byte).await
                });
            }
            Err(e) => {
                crate::warn_every!(ACCEPT_FAILED, service = name, "accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Takes a connection out of the books when it ends, however it ends.
struct Registered {
    svc: Arc<Service>,
    agent: Arc<dyn Control>,
    id: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        let mut g = self.svc.lock();
        g.conns.remove(&self.id);
        g.last_activity = Instant::now();
        drop(g);
        self.agent.metrics().in_flight.get_or_create(&ServiceLabels { service: self.svc.name.clone() }).dec();
    }
}

impl Service {
    /// Marks a request in flight, if the service is running: under the same
    /// lock the policy decides to suspend under, so it can never suspend
    /// between this check and the bytes reaching the backend.
    fn begin_request(&self, id: u64) -> bool {
        let mut g = self.lock();
        if g.state != State::Running {
            return false;
        }
        let bound = self.cfg.request_timeout;
        if let Some(c) = g.conns.get_mut(&id) {
            if !c.awaiting {
                c.stale_at = bound.and_then(|b| Instant::now().checked_add(b));
            }
            c.awaiting = true;
        }
        g.last_activity = Instant::now();
        g.last_used_ms = gpusnap_core::store::now_ms();
        true
    }

    fn answered(&self, id: u64) {
        let mut g = self.lock();
        if let Some(c) = g.conns.get_mut(&id) {
            c.awaiting = false;
            c.stale_at = None;
        }
        g.last_activity = Instant::now();
    }

    /// Marks the connection as holding one to the backend.
    fn connected(&self, id: u64) {
        if let Some(c) = self.lock().conns.get_mut(&id) {
            c.backend = true;
        }
    }

    /// Whether connection `id` is to be closed now: the service hibernates
    /// (CRIU cannot take its backend half along) and it carries no request
    /// (or one past `request_timeout`).
    fn to_close(&self, id: u64) -> bool {
        let g = self.lock();
        g.state == State::Hibernating && !g.conns.get(&id).is_some_and(|c| c.busy())
    }
}

/// Resolves once connection `id` is to be closed (see [`Service::to_close`]).
async fn closing(svc: Arc<Service>, id: u64) {
    let mut rx = svc.changed.subscribe();
    loop {
        if svc.to_close(id) {
            return;
        }
        if rx.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// Waits for the service, bounded in count and time; records the wait.
/// Returns the trace of the wake this connection waited for, if it is the
/// first to see it done (the trace then goes on to its first byte).
async fn wait_for(agent: &Arc<dyn Control>, svc: &Arc<Service>) -> Result<Option<WakeTrace>, String> {
    let _w = Waiting::take(svc).map_err(|n| format!("{}: {n} connections already wait", svc.name))?;
    let t0 = Instant::now();
    let r = Arc::clone(agent).wait_running(Arc::clone(svc), t0 + svc.cfg.wake_timeout, Some(t0)).await;
    if let Ok(true) = r {
        return Ok(waited(agent, svc, t0, "connection"));
    }
    r.map(|_| None).map_err(|e| e.0)
}

/// A trace that reached its first byte: journaled (in the background: the
/// answer streams on) and observed.
fn finish(agent: &Arc<dyn Control>, svc: &Arc<Service>, pending: &Mutex<Option<WakeTrace>>) {
    let Some(mut t) = pending.lock().unwrap_or_else(|e| e.into_inner()).take() else { return };
    t.mark_now("first_byte");
    agent.metrics().swap_done(&svc.name, &t);
    let (agent, svc) = (Arc::clone(agent), Arc::clone(svc));
    tokio::task::spawn_blocking(move || agent.note(&svc, &t.summary()));
}

/// The client's bytes to the backend: the request read meanwhile first
/// (`fail_fast`), a first byte within `first_byte`, and a wait for the
/// service before each request on a connection that outlived a suspension.
/// `Err`: the connection is to be closed (`Some`: with that refusal).
#[allow(clippy::too_many_arguments)]
async fn client_to_backend(
    agent: Arc<dyn Control>,
    svc: Arc<Service>,
    id: u64,
    pending_up: Arc<Mutex<Option<WakeTrace>>>,
    mut cr: tokio::net::tcp::OwnedReadHalf,
    mut bw: tokio::net::tcp::OwnedWriteHalf,
    mut early: Vec<u8>,
    first_byte: Duration,
) -> Result<(), Option<Refusal>> {
    let mut buf = vec![0u8; BUF];
    let mut first = true;
    loop {
        let n = if !early.is_empty() {
            // What a fail_fast client sent while it waited.
            first = false;
            buf[..early.len()].copy_from_slice(&early);
            std::mem::take(&mut early).len()
        } else {
            // A client that sends nothing at all within the header
            // timeout holds a connection for nothing: closed.
            let read = cr.read(&mut buf);
            let r = if std::mem::take(&mut first) {
                match tokio::time::timeout(first_byte, read).await {
                    Ok(r) => r,
                    Err(_) => {
                        tracing::debug!(service = svc.name, "closing a connection that sent nothing");
                        return Err(None);
                    }
                }
            } else {
                read.await
            };
            match r {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            }
        };
        // A keep-alive connection may outlive a suspension: bytes on
        // it bring the service back as a new connection would (and
        // with fail_fast, are refused as a new connection would be).
        while !svc.begin_request(id) {
            let waited = if svc.cfg.fail_fast {
                crate::wait::wait(&agent, &svc).await
            } else {
                wait_for(&agent, &svc)
                    .await
                    .map_err(|reason| Refusal { reason, retry_after: Duration::from_secs(1) })
            };
            match waited {
                Ok(Some(t)) => *pending_up.lock().unwrap_or_else(|e| e.into_inner()) = Some(t),
                Ok(None) => {}
                Err(r) => {
                    crate::warn_every!(CLOSED, service = svc.name, "closing a connection: {}", r.reason);
                    agent
                        .metrics()
                        .connections_closed
                        .get_or_create(&ServiceLabels { service: svc.name.clone() })
                        .inc();
                    return Err(Some(r));
                }
            }
        }
        if bw.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = bw.shutdown().await;
    Ok(())
}

/// The backend's answer to the client, each piece counted as answered and
/// the swap's trace finished at its first byte.
async fn backend_to_client(
    agent: Arc<dyn Control>,
    svc: Arc<Service>,
    id: u64,
    pending: Arc<Mutex<Option<WakeTrace>>>,
    mut br: tokio::net::tcp::OwnedReadHalf,
    cw: &mut tokio::net::tcp::OwnedWriteHalf,
) {
    let mut buf = vec![0u8; BUF];
    loop {
        let n = match br.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        svc.answered(id);
        if cw.write_all(&buf[..n]).await.is_err() {
            break;
        }
        finish(&agent, &svc, &pending);
    }
    let _ = cw.shutdown().await;
}

/// Tells a client its connection is refused, as its service speaks: a
/// JSON 503 for `fail_fast`, a plain 503 for a service with hooks (it
/// speaks HTTP: nothing of the request was forwarded, and a clear 503 beats
/// a bare close), else a bare close.
async fn refuse(svc: &Service, client: &mut TcpStream, r: &Refusal) {
    if svc.cfg.fail_fast {
        let _ = client.write_all(&crate::wait::refused_bytes(svc, r)).await;
    } else if svc.cfg.hooks.any() {
        let body = format!("gpusnap agent: {}\n", r.reason);
        let head = format!(
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nConnection: close\r\n\
             Retry-After: 1\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        let _ = client.write_all(format!("{head}{body}").as_bytes()).await;
    }
    let _ = client.shutdown().await;
}

/// A connection to the service's backend and the retries it took: a server
/// just started may not listen yet, so it is retried until `wake_timeout`
/// (a resumed one listens already: its socket stayed open). `None` when it
/// never answered.
async fn connect_backend(svc: &Service) -> Option<(TcpStream, u32)> {
    let deadline = Instant::now() + svc.cfg.wake_timeout;
    let mut retries = 0;
    loop {
        match TcpStream::connect(svc.cfg.backend).await {
            Ok(b) => return Some((b, retries)),
            Err(e) if Instant::now() < deadline => {
                tracing::debug!(service = svc.name, "backend not there yet: {e}");
                retries += 1;
                tokio::time::sleep(CONNECT_RETRY).await;
            }
            Err(e) => {
                crate::warn_every!(CLOSED, service = svc.name, "backend {}: {e}", svc.cfg.backend);
                return None;
            }
        }
    }
}

async fn handle(agent: Arc<dyn Control>, svc: Arc<Service>, mut client: TcpStream, first_byte: Duration) {
    let _ = client.set_nodelay(true);
    let id = NEXT_CONN.fetch_add(1, Ordering::Relaxed);
    {
        let mut g = svc.lock();
        g.conns.insert(id, Conn::default());
        g.last_activity = Instant::now();
    }
    agent.metrics().in_flight.get_or_create(&ServiceLabels { service: svc.name.clone() }).inc();
    let _reg = Registered { svc: Arc::clone(&svc), agent: Arc::clone(&agent), id };
    let closed = || {
        agent.metrics().connections_closed.get_or_create(&ServiceLabels { service: svc.name.clone() }).inc()
    };

    let pending: Arc<Mutex<Option<WakeTrace>>> = Arc::new(Mutex::new(None));
    // fail_fast: the request read meanwhile (a client that hangs up leaves
    // the wait, its request never forwarded) and a JSON 503 when refused.
    let mut early = Vec::new();
    let waited = if svc.cfg.fail_fast {
        match crate::wait::wait_reading(&agent, &svc, &mut client, &mut early, BUF).await {
            Some(r) => r,
            None => {
                tracing::info!(service = svc.name, "a client hung up while waiting: dropped");
                closed();
                return;
            }
        }
    } else {
        wait_for(&agent, &svc).await.map_err(|reason| Refusal { reason, retry_after: Duration::from_secs(1) })
    };
    match waited {
        Ok(t) => *pending.lock().unwrap_or_else(|e| e.into_inner()) = t,
        Err(r) => {
            crate::warn_every!(CLOSED, service = svc.name, "closing a connection: {}", r.reason);
            closed();
            refuse(&svc, &mut client, &r).await;
            return;
        }
    }
    let Some((backend, retries)) = connect_backend(&svc).await else {
        closed();
        return;
    };
    if let Some(t) = pending.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
        t.counts.connect_retries = retries;
        t.mark_now("connect");
    }
    let _ = backend.set_nodelay(true);
    svc.connected(id);
    let (cr, mut cw) = client.into_split();
    let (br, bw) = backend.into_split();

    let up = client_to_backend(
        Arc::clone(&agent),
        Arc::clone(&svc),
        id,
        Arc::clone(&pending),
        cr,
        bw,
        early,
        first_byte,
    );
    let down = backend_to_client(Arc::clone(&agent), Arc::clone(&svc), id, Arc::clone(&pending), br, &mut cw);
    let close = closing(Arc::clone(&svc), id);
    // The client's half ending is not the end: the answer may still come.
    // The backend's half ending is (it closed the connection), unless the
    // client gave up sending or a later request's wait was refused, which
    // closes both (answered 503 with fail_fast: nothing of that request
    // reached the server). A hibernate closes an idle connection (both
    // halves).
    let refused = {
        tokio::pin!(up);
        tokio::pin!(down);
        tokio::pin!(close);
        tokio::select! {
            r = &mut up => match r {
                Ok(()) => {
                    tokio::select! {
                        _ = &mut down => {}
                        _ = &mut close => {}
                    }
                    None
                }
                Err(refused) => refused,
            },
            _ = &mut down => None,
            _ = &mut close => {
                tracing::debug!(service = svc.name, "closed an idle connection: the service hibernates");
                None
            }
        }
    };
    if let Some(r) = refused {
        if svc.cfg.fail_fast {
            let _ = cw.write_all(&crate::wait::refused_bytes(&svc, &r)).await;
        }
        let _ = cw.shutdown().await;
    }
}
