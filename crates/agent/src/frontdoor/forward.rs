//! The request to its backend, and the answer streamed back untouched:
//! status, headers (less the hop-by-hop ones) and the body frame by frame
//! as the backend sends it (SSE, chunked), until it ends or the client
//! hangs up (then the backend's connection is closed too).

use super::pool::{self, Conn, Pool};
use super::{error, Body};
use crate::service::Service;
use crate::wait::InFlight;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::header::{HeaderMap, HeaderValue};
use hyper::http::request::Parts;
use hyper::{Request, Response, StatusCode};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpStream;

/// Between connects to a backend that does not listen yet.
const CONNECT_RETRY: Duration = Duration::from_millis(10);

/// Headers of one hop only (RFC 9110 7.6.1): never forwarded.
const HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
];

fn strip_hop(h: &mut HeaderMap) {
    let named: Vec<String> = h
        .get_all(hyper::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|n| n.trim().to_ascii_lowercase()))
        .collect();
    for n in HOP.iter().copied().chain(named.iter().map(String::as_str)) {
        h.remove(n);
    }
    h.remove(hyper::header::UPGRADE);
}

/// A new connection to the backend, driven in the background.
async fn connect(svc: &Arc<Service>) -> Result<Conn, String> {
    let backend = svc.cfg.backend;
    // A server just started may not listen yet (a resumed one does: its
    // socket stayed open).
    let deadline = Instant::now() + svc.cfg.wake_timeout;
    let stream = loop {
        match TcpStream::connect(backend).await {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => tokio::time::sleep(CONNECT_RETRY).await,
            Err(e) => return Err(format!("{}: backend {backend}: {e}", svc.name)),
        }
    };
    let _ = stream.set_nodelay(true);
    let (send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .map_err(|e| format!("{}: backend: {e}", svc.name))?;
    let busy = Arc::new(AtomicBool::new(true));
    // Counted before the request can end (and a hibernation look).
    svc.backend_conns.send_modify(|n| *n += 1);
    tokio::spawn(pool::drive(Arc::clone(svc), Arc::clone(&busy), conn));
    Ok(Conn { send, busy })
}

pub async fn forward(
    svc: Arc<Service>,
    pool: Arc<Pool>,
    mut f: InFlight,
    parts: Parts,
    path: String,
    body: Bytes,
) -> Response<Body> {
    let uri: hyper::Uri = match path.parse() {
        Ok(u) => u,
        Err(e) => {
            return error(StatusCode::BAD_REQUEST, "invalid_request_error", &format!("path {path:?}: {e}"))
        }
    };
    let mut headers = parts.headers;
    strip_hop(&mut headers);
    headers.remove(hyper::header::CONTENT_LENGTH);
    if let Ok(h) = HeaderValue::from_str(&svc.cfg.backend.to_string()) {
        headers.insert(hyper::header::HOST, h);
    }
    let request = || {
        let mut req = Request::new(Full::new(body.clone()));
        *req.method_mut() = parts.method.clone();
        *req.uri_mut() = uri.clone();
        *req.headers_mut() = headers.clone();
        req
    };
    // A kept connection first; one the server closed meanwhile is no
    // failure of the request: it goes on a new connection (nothing of it
    // was answered).
    let mut sent = None;
    if let Some(mut c) = pool.take(&svc) {
        if let Ok(r) = c.send.send_request(request()).await {
            sent = Some((c, r));
        }
    }
    let (c, resp) = match sent {
        Some(s) => s,
        None => {
            let mut c = match connect(&svc).await {
                Ok(c) => c,
                Err(e) => return error(StatusCode::BAD_GATEWAY, "bad_gateway", &e),
            };
            if let Some(t) = f.trace.as_mut() {
                t.mark_now("connect");
            }
            match c.send.send_request(request()).await {
                Ok(r) => (c, r),
                Err(e) => {
                    return error(
                        StatusCode::BAD_GATEWAY,
                        "bad_gateway",
                        &format!("{}: backend: {e}", svc.name),
                    )
                }
            }
        }
    };
    f.answered();
    let (mut head, incoming) = resp.into_parts();
    strip_hop(&mut head.headers);
    // The request stays in its service's books (a connection: no hibernate
    // while it streams) until its answer's last frame, or the client left;
    // then its backend connection is kept for the next.
    let keep = Keep { pool, svc, conn: Some(c), _request: f };
    let body = incoming
        .map_frame(move |frame| {
            let _keep = &keep;
            frame
        })
        .boxed();
    Response::from_parts(head, body)
}

/// Held by an answer's body until it is dropped.
struct Keep {
    pool: Arc<Pool>,
    svc: Arc<Service>,
    conn: Option<Conn>,
    _request: InFlight,
}

impl Drop for Keep {
    fn drop(&mut self) {
        if let Some(c) = self.conn.take() {
            self.pool.put(&self.svc, c);
        }
    }
}
