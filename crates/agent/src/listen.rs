//! The accept loops of the agent's HTTP listeners (the API on its unix
//! socket, `/metrics` on TCP), bounded as every listener of the agent is:
//! a connection takes a [`Slot`](crate::limits::Slot) under its listener's
//! cap and the agent's total or is closed at once; a request's headers must
//! arrive within the header timeout (hyper's `header_read_timeout`), so a
//! client that sends half a request and waits holds nothing for long.
//! Failed accepts (out of descriptors) are warned about at most once a
//! second, and the loop backs off instead of spinning.

use crate::limits::{self, Cap};
use crate::peer::Peer;
use crate::ratelimit::Every;
use axum::extract::connect_info::ConnectInfo;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};

/// How long a client may take to send a request's headers.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// After a failed accept (EMFILE, ENFILE), before the next.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

static ACCEPT_FAILED: Every = Every::new(Duration::from_secs(1));
static REFUSED: Every = Every::new(Duration::from_secs(1));

/// A listener's bounds: its own cap and the agent's total.
#[derive(Clone)]
pub struct Bounds {
    pub own: Arc<Cap>,
    pub total: Arc<Cap>,
    pub header_timeout: Duration,
}

/// Serves `app` on one connection, under its slot.
fn serve_conn<I>(io: I, app: Router, header_timeout: Duration, slot: limits::Slot)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        let _slot = slot;
        let svc = TowerToHyperService::new(app);
        let mut b = hyper::server::conn::http1::Builder::new();
        b.timer(TokioTimer::new()).header_read_timeout(header_timeout).max_buf_size(64 * 1024);
        if let Err(e) = b.serve_connection(TokioIo::new(io), svc).await {
            tracing::debug!("HTTP connection: {e}");
        }
    });
}

/// Backs off after a failed accept, warning at most once a second.
async fn accept_failed(what: &str, e: std::io::Error) {
    crate::warn_every!(ACCEPT_FAILED, "{what}: accept: {e}");
    tokio::time::sleep(ACCEPT_BACKOFF).await;
}

/// The API on its unix socket: each peer's credentials and groups are taken
/// at accept (SO_PEERCRED, SO_PEERGROUPS) and handed to the router.
pub async fn serve_unix(listener: tokio::net::UnixListener, app: Router, b: Bounds) {
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                accept_failed("API", e).await;
                continue;
            }
        };
        let slot = match limits::admit(&b.own, &b.total) {
            Ok(s) => s,
            Err(full) => {
                crate::warn_every!(REFUSED, "API: refused a connection: {full}");
                continue;
            }
        };
        let peer = Peer::of(&stream);
        let app = app.clone().layer(axum::Extension(ConnectInfo(peer)));
        serve_conn(stream, app, b.header_timeout, slot);
    }
}

/// An HTTP router on TCP (`/metrics`).
pub async fn serve_tcp(listener: tokio::net::TcpListener, app: Router, b: Bounds) {
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                accept_failed("metrics", e).await;
                continue;
            }
        };
        let slot = match limits::admit(&b.own, &b.total) {
            Ok(s) => s,
            Err(full) => {
                crate::warn_every!(REFUSED, "metrics: refused a connection: {full}");
                continue;
            }
        };
        serve_conn(stream, app.clone(), b.header_timeout, slot);
    }
}
