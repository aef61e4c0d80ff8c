//! The front door: one HTTP/1.1 listener (`[agent] http_listen`) in front of
//! every service, as llama-swap or Ollama offer. OpenAI-compatible requests
//! go to the service that serves their `model`; others by `Host` or a path
//! prefix. A service that is not running is brought back exactly as for a
//! connection on its own port (through [`Control`]); one that cannot come
//! back is answered at once with a 503, a JSON reason and `Retry-After`.
//!
//! - [`route`]: which service a request is for;
//! - [`wait`]: the wait for the service, and the answer when it cannot come;
//! - [`forward`]: the request to the backend, its answer streamed back;
//! - [`pool`]: backend connections kept between requests;
//! - [`models`]: `/v1/models`, `/healthz`, `/readyz`;
//! - [`gate`]: who may ask (`api_keys`), and the bytes of bodies held;
//! - [`ui`]: the status page (`ui = true`).

mod access;
mod forward;
mod gate;
mod models;
mod pool;
mod route;
mod ui;

use crate::config::HttpLimits as Limits;
use crate::control::Control;
use crate::limits::Cap;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

/// What the front door answers with: a backend's body streamed, or its own.
pub(crate) type Body = BoxBody<Bytes, hyper::Error>;

/// A JSON answer of the front door's own.
pub(crate) fn json(status: StatusCode, value: &serde_json::Value) -> Response<Body> {
    let body = Full::new(Bytes::from(value.to_string())).map_err(|never| match never {}).boxed();
    let mut r = Response::new(body);
    *r.status_mut() = status;
    r.headers_mut()
        .insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("application/json"));
    r
}

/// An error in OpenAI's format (clients of that API show `message`): its
/// `code` a string, as OpenAI's is, never the status's number.
pub(crate) fn error(status: StatusCode, kind: &str, message: &str) -> Response<Body> {
    json(
        status,
        &serde_json::json!({ "error": { "message": message, "type": kind, "code": code_of(status) } }),
    )
}

/// The `code` of an error answer with `status`.
fn code_of(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 => "bad_request",
        401 => "invalid_api_key",
        404 => "not_found",
        408 => "request_timeout",
        413 => "request_too_large",
        431 => "headers_too_large",
        502 => "bad_gateway",
        503 => "service_unavailable",
        _ => "error",
    }
}

/// Serves the front door until the agent ends. Connections past
/// `max_connections`, or past the agent's descriptor budget (`total`, shared
/// with the services' ports, so that the API and the state store keep
/// theirs), are closed at once (their slot would hold a file descriptor and
/// a task for as long as the client likes).
pub async fn serve(agent: Arc<dyn Control>, listener: TcpListener, limits: Limits, total: Arc<Cap>) {
    let own = Cap::new(limits.max_connections);
    let gate = Arc::new(gate::Gate::new(&limits));
    let limits = Arc::new(limits);
    let pool = Arc::new(pool::Pool::default());
    let mut refused_at: Option<std::time::Instant> = None;
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("front door: accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let slot = match crate::limits::admit(&own, &total) {
            Ok(s) => s,
            Err(full) => {
                // Once a minute at most: a flood must not flood the log too.
                if refused_at.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
                    tracing::warn!("front door: {full}, closing new connections");
                    refused_at = Some(std::time::Instant::now());
                }
                drop(stream);
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let (agent, limits, pool, gate) =
            (Arc::clone(&agent), Arc::clone(&limits), Arc::clone(&pool), Arc::clone(&gate));
        tokio::spawn(async move {
            let _slot = slot;
            let svc = {
                let limits = Arc::clone(&limits);
                hyper::service::service_fn(move |req| {
                    let (agent, limits, pool, gate) =
                        (Arc::clone(&agent), Arc::clone(&limits), Arc::clone(&pool), Arc::clone(&gate));
                    async move {
                        Ok::<_, std::convert::Infallible>(handle(agent, &limits, &gate, pool, req).await)
                    }
                })
            };
            let mut b = hyper::server::conn::http1::Builder::new();
            b.timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.header_timeout)
                .max_buf_size(limits.max_header as usize)
                .keep_alive(true);
            let conn = b.serve_connection(hyper_util::rt::TokioIo::new(stream), svc);
            // Bounded in time as a whole: a connection is no lease for life.
            match tokio::time::timeout(limits.connection_timeout, conn).await {
                Ok(Err(e)) => tracing::debug!("front door connection: {e}"),
                Ok(Ok(())) => {}
                Err(_) => tracing::debug!("front door connection: open past connection_timeout, closed"),
            }
        });
    }
}

/// One request: answered, and (past the lists and pages) counted and
/// logged (see [`access`]).
async fn handle(
    agent: Arc<dyn Control>,
    limits: &Limits,
    gate: &gate::Gate,
    pool: Arc<pool::Pool>,
    req: Request<Incoming>,
) -> Response<Body> {
    let mut rec = None;
    let resp = answer(Arc::clone(&agent), limits, gate, pool, req, &mut rec).await;
    match rec {
        Some(rec) => access::finish(&agent, rec, resp),
        None => resp,
    }
}

async fn answer(
    agent: Arc<dyn Control>,
    limits: &Limits,
    gate: &gate::Gate,
    pool: Arc<pool::Pool>,
    req: Request<Incoming>,
    rec: &mut Option<access::Record>,
) -> Response<Body> {
    let path = req.uri().path();
    if req.method() == hyper::Method::GET && path == "/healthz" {
        return models::healthz();
    }
    // The page's own files hold no data: served before the key, so that a
    // browser can load the page that then asks for one.
    if limits.ui && req.method() == hyper::Method::GET {
        if let Some(r) = ui::asset(path) {
            return r;
        }
    }
    // Before anything is routed, listed or woken.
    if let Err(refused) = gate.key(req.headers()) {
        return *refused;
    }
    let services = routable(&agent, limits);
    if req.method() == hyper::Method::GET {
        match path {
            "/readyz" => return models::readyz(&agent, &services),
            "/v1/models" => return models::list(&agent, &services),
            "/ui/state" if limits.ui => return ui::state(agent, services).await,
            _ => {}
        }
        if let Some(id) = path.strip_prefix("/v1/models/") {
            return models::one(&agent, &services, id);
        }
    }
    let rec = rec.insert(access::Record::new());
    let (parts, body) = req.into_parts();
    // Its place among the bodies held at once, before a byte is read.
    let _held = match gate.hold(&parts.headers) {
        Ok(h) => h,
        Err(refused) => return *refused,
    };
    // The whole body, bounded in size and time: its `model` decides, and a
    // client that hangs up while its service comes back is then seen (and
    // dropped).
    let read =
        tokio::time::timeout(limits.body_timeout, Limited::new(body, limits.max_body as usize).collect());
    let body = match read.await {
        Err(_) => {
            return error(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                &format!(
                    "request body not received within {} s ([agent.http] body_timeout)",
                    limits.body_timeout.as_secs()
                ),
            )
        }
        Ok(Ok(b)) => b.to_bytes(),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                &format!("request body over {} bytes ([agent.http] max_body)", limits.max_body),
            )
        }
        Ok(Err(e)) => {
            return error(StatusCode::BAD_REQUEST, "invalid_request_error", &format!("request body: {e}"))
        }
    };
    rec.bytes_in = body.len() as u64;
    let (svc, path) = match route::route(&services, &parts, &body) {
        Ok(r) => r,
        Err(resp) => return *resp,
    };
    let svc = Arc::clone(svc);
    rec.service = Some(svc.name.clone());
    rec.model = route::model_label(&svc, &body);
    let waited = std::time::Instant::now();
    let admitted = crate::wait::admit(&agent, &svc).await;
    rec.wait_ms = waited.elapsed().as_millis() as u64;
    let in_flight = match admitted {
        Ok(f) => f,
        Err(refusal) => return refused(&svc, &refusal),
    };
    rec.swap = in_flight.trace.is_some();
    forward::forward(svc, pool, in_flight, parts, path, body).await
}

/// The services the front door reaches: all, or with `route_only_models`
/// those that list `models`.
fn routable(agent: &Arc<dyn Control>, limits: &Limits) -> Vec<Arc<crate::service::Service>> {
    let mut all: Vec<_> = agent.services().as_ref().clone();
    if limits.route_only_models {
        all.retain(|s| !s.cfg.models.is_empty());
    }
    all
}

/// The 503 for a request that cannot be served: a JSON reason (in OpenAI's
/// error format) and `Retry-After`.
fn refused(svc: &crate::service::Service, r: &crate::control::Refusal) -> Response<Body> {
    let secs = crate::wait::retry_secs(r);
    let mut resp = json(StatusCode::SERVICE_UNAVAILABLE, &crate::wait::refusal_json(svc, r));
    resp.headers_mut().insert(hyper::header::RETRY_AFTER, hyper::header::HeaderValue::from(secs));
    resp
}
