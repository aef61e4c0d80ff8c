//! The request to its backend, and the answer streamed back untouched:
//! status, headers (less the hop-by-hop ones) and the body frame by frame
//! as the backend sends it (SSE, chunked), until it ends or the client
//! hangs up (then the backend's connection is closed too).

use super::wait::InFlight;
use super::{error, Body};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::header::{HeaderMap, HeaderValue};
use hyper::http::request::Parts;
use hyper::{Request, Response, StatusCode};
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

pub async fn forward(
    svc: Arc<crate::service::Service>,
    mut f: InFlight,
    parts: Parts,
    path: String,
    body: Bytes,
) -> Response<Body> {
    let backend = svc.cfg.backend;
    // A server just started may not listen yet (a resumed one does: its
    // socket stayed open).
    let deadline = Instant::now() + svc.cfg.wake_timeout;
    let stream = loop {
        match TcpStream::connect(backend).await {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => tokio::time::sleep(CONNECT_RETRY).await,
            Err(e) => {
                return error(
                    StatusCode::BAD_GATEWAY,
                    "bad_gateway",
                    &format!("{}: backend {backend}: {e}", svc.name),
                )
            }
        }
    };
    if let Some(t) = f.trace.as_mut() {
        t.mark_now("connect");
    }
    let _ = stream.set_nodelay(true);
    let (mut send, conn) =
        match hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await {
            Ok(c) => c,
            Err(e) => {
                return error(StatusCode::BAD_GATEWAY, "bad_gateway", &format!("{}: backend: {e}", svc.name))
            }
        };
    let name = svc.name.clone();
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(service = name, "backend connection: {e}");
        }
    });
    let mut req = Request::new(Full::new(body));
    *req.method_mut() = parts.method;
    *req.uri_mut() = match path.parse() {
        Ok(u) => u,
        Err(e) => {
            return error(StatusCode::BAD_REQUEST, "invalid_request_error", &format!("path {path:?}: {e}"))
        }
    };
    *req.headers_mut() = parts.headers;
    strip_hop(req.headers_mut());
    req.headers_mut().remove(hyper::header::CONTENT_LENGTH);
    if let Ok(h) = HeaderValue::from_str(&backend.to_string()) {
        req.headers_mut().insert(hyper::header::HOST, h);
    }
    let resp = match send.send_request(req).await {
        Ok(r) => r,
        Err(e) => {
            return error(StatusCode::BAD_GATEWAY, "bad_gateway", &format!("{}: backend: {e}", svc.name))
        }
    };
    f.answered();
    let (mut head, incoming) = resp.into_parts();
    strip_hop(&mut head.headers);
    // The request stays in its service's books (a connection: no hibernate
    // while it streams) until its answer's last frame, or the client left.
    let body = incoming
        .map_frame(move |frame| {
            let _keep = &f;
            frame
        })
        .boxed();
    Response::from_parts(head, body)
}
