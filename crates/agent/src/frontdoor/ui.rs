//! The status page (`[agent.http] ui = true`): `/ui` and its script and
//! style, served from files built into the binary, and `/ui/state`, the
//! data it shows: every service with its models, state, memory held, next
//! step and last error, and the last request-driven wakes with their
//! phases. Read only. The page and its files hold no data and answer
//! without a key; `/ui/state` is behind `api_keys` like every other answer
//! (the page asks for a key when it is refused, and sends it as a Bearer
//! token).

use super::{json, Body};
use crate::control::Control;
use crate::service::Service;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::header::{HeaderValue, CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE};
use hyper::{Response, StatusCode};
use serde_json::{json as j, Value};
use std::sync::Arc;

const INDEX: &str = include_str!("ui/index.html");
const SCRIPT: &str = include_str!("ui/app.js");
const STYLE: &str = include_str!("ui/style.css");

/// The page's own files, by path; None for any other path.
pub fn asset(path: &str) -> Option<Response<Body>> {
    let (text, kind) = match path {
        "/ui" | "/ui/" => (INDEX, "text/html; charset=utf-8"),
        "/ui/app.js" => (SCRIPT, "text/javascript; charset=utf-8"),
        "/ui/style.css" => (STYLE, "text/css; charset=utf-8"),
        _ => return None,
    };
    let mut r = Response::new(Full::new(Bytes::from_static(text.as_bytes())).map_err(|n| match n {}).boxed());
    let h = r.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static(kind));
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Its own files only: nothing loaded from elsewhere, no inline script.
    h.insert(
        CONTENT_SECURITY_POLICY,
        HeaderValue::from_static("default-src 'self'; connect-src 'self'; frame-ancestors 'none'"),
    );
    h.insert("x-content-type-options", HeaderValue::from_static("nosniff"));
    Some(r)
}

/// `/ui/state`: what the page shows (blocks on NVML and the store for each
/// service's memory, off the front door's threads).
pub async fn state(agent: Arc<dyn Control>, services: Vec<Arc<Service>>) -> Response<Body> {
    let a = Arc::clone(&agent);
    let rows = tokio::task::spawn_blocking(move || services.iter().map(|s| row(&a, s)).collect::<Vec<_>>())
        .await
        .unwrap_or_default();
    let swaps = agent.metrics().recent.list();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    json(StatusCode::OK, &j!({ "now_unix_ms": now, "services": rows, "swaps": swaps }))
}

fn row(agent: &Arc<dyn Control>, s: &Service) -> Value {
    let v = crate::api::view(s);
    let held = agent.held(s);
    let models: Vec<&str> = s.cfg.models.iter().map(|m| m.get_ref().as_str()).collect();
    j!({
        "name": v.name,
        "models": models,
        "state": v.state,
        "in_state_ms": v.in_state_ms,
        "idle_ms": v.idle_ms,
        "connections": v.connections,
        "waiting": v.waiting,
        "restarts": v.restarts,
        "priority": v.priority,
        "next": v.next,
        "last_error": v.last_error.as_deref().map(crate::wait::without_paths),
        "gpu_bytes": held.gpu_bytes,
        "host_bytes": held.host_bytes,
        "image_bytes": held.image_bytes,
        "wants_gpu_bytes": v.gpu_memory,
    })
}
