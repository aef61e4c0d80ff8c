//! The API: HTTP/JSON on a unix socket (axum), as Cloud Hypervisor's
//! daemon serves its own. Requests become requests to the agent through
//! [`Control`]; HTTP stays here. Every peer is checked with SO_PEERCRED:
//! root or the configured group, else 403. [`routes`] lists every route.

use crate::control::{Action, Control};
use crate::peer::Peer;
use crate::service::Service;
use axum::extract::connect_info::{ConnectInfo, Connected};
use axum::extract::{Path, Request, State as AxState};
use axum::handler::Handler;
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, MethodRouter};
use axum::serve::IncomingStream;
use axum::{Json, Router};
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::UnixListener;

/// The agent, as the API sees it.
type Ctl = Arc<dyn Control>;

impl Connected<IncomingStream<'_, UnixListener>> for Peer {
    fn connect_info(stream: IncomingStream<'_, UnixListener>) -> Self {
        match stream.io().peer_cred() {
            Ok(c) => Peer { pid: c.pid(), uid: Some(c.uid()), gid: Some(c.gid()) },
            Err(_) => Peer { pid: None, uid: None, gid: None },
        }
    }
}

#[derive(Serialize)]
struct ApiError {
    error: ErrorBody,
}

#[derive(Serialize)]
struct ErrorBody {
    message: String,
    exit_code: i32,
}

fn error(status: StatusCode, message: impl Into<String>, exit_code: i32) -> Response {
    (status, Json(ApiError { error: ErrorBody { message: message.into(), exit_code } })).into_response()
}

async fn check_peer(
    AxState(agent): AxState<Ctl>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    req: Request,
    next: Next,
) -> Response {
    if !peer.allowed(agent.api_group()) {
        tracing::warn!(?peer, path = %req.uri().path(), "refused an API peer");
        let who = peer.uid.map_or("an unknown peer".to_string(), |u| format!("uid {u}"));
        return error(StatusCode::FORBIDDEN, format!("{who} is neither root nor in the agent's group"), 2);
    }
    next.run(req).await
}

#[derive(Serialize)]
pub struct ServiceView {
    pub name: String,
    pub state: &'static str,
    pub listen: String,
    pub backend: String,
    pub pid: Option<i32>,
    /// The `gpusnap run --light` the agent started it under.
    pub runner: Option<i32>,
    pub image: Option<String>,
    pub priority: i64,
    pub connections: usize,
    pub waiting: usize,
    pub in_state_ms: u64,
    pub idle_ms: u64,
    pub restarts: u32,
    pub last_error: Option<String>,
}

pub fn view(s: &Service) -> ServiceView {
    let g = s.lock();
    ServiceView {
        name: s.name.clone(),
        state: g.state.as_str(),
        listen: s.cfg.listen.get_ref().to_string(),
        backend: s.cfg.backend.to_string(),
        pid: g.process.as_ref().map(|t| t.pid),
        runner: g.runner,
        image: g.image.clone(),
        priority: s.cfg.priority,
        connections: g.conns.len(),
        waiting: g.waiting,
        in_state_ms: g.since.elapsed().as_millis() as u64,
        idle_ms: g.last_activity.elapsed().as_millis() as u64,
        restarts: g.restarts,
        last_error: g.last_error.clone(),
    }
}

async fn services(AxState(agent): AxState<Ctl>) -> Response {
    Json(agent.services().iter().map(|s| view(s)).collect::<Vec<_>>()).into_response()
}

async fn one_service(AxState(agent): AxState<Ctl>, Path(name): Path<String>) -> Response {
    match agent.service(&name) {
        Some(s) => Json(view(s)).into_response(),
        None => error(StatusCode::NOT_FOUND, format!("no service {name:?}"), 2),
    }
}

async fn action(AxState(agent): AxState<Ctl>, Path((name, action)): Path<(String, String)>) -> Response {
    let Some(svc) = agent.service(&name).cloned() else {
        return error(StatusCode::NOT_FOUND, format!("no service {name:?}"), 2);
    };
    let Some(act) = Action::parse(&action) else {
        let all: Vec<&str> = Action::ALL.iter().map(|a| a.as_str()).collect();
        return error(StatusCode::NOT_FOUND, format!("no action {action:?} ({})", all.join(", ")), 2);
    };
    match Arc::clone(&agent).act(Arc::clone(&svc), act).await {
        Ok(()) => Json(view(&svc)).into_response(),
        Err(e) => error(StatusCode::CONFLICT, e, 1),
    }
}

async fn processes(AxState(agent): AxState<Ctl>) -> Response {
    let r = tokio::task::spawn_blocking(move || agent.processes()).await;
    match r {
        Ok(Ok(ps)) => Json(ps).into_response(),
        Ok(Err(e)) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), e.exit_code()),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), 1),
    }
}

#[derive(serde::Deserialize)]
struct EventsQuery {
    /// Start after this journal entry (default: the last 100 entries).
    after: Option<i64>,
    /// Stop after the backlog instead of following the journal.
    #[serde(default)]
    follow: Option<bool>,
}

/// The journal as newline-delimited JSON, followed as it grows.
async fn events(
    AxState(agent): AxState<Ctl>,
    axum::extract::Query(q): axum::extract::Query<EventsQuery>,
) -> Response {
    let store = match agent.journal_store() {
        Ok(s) => s,
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), 1),
    };
    let follow = q.follow.unwrap_or(true);
    let start = match q.after {
        Some(a) => a,
        None => store.last_event_id().unwrap_or(0).saturating_sub(100).max(0),
    };
    let store = Arc::new(std::sync::Mutex::new(store));
    let stream = futures_util::stream::unfold(start, move |after| {
        let store = Arc::clone(&store);
        async move {
            loop {
                let s = Arc::clone(&store);
                let rows = tokio::task::spawn_blocking(move || {
                    s.lock().unwrap_or_else(|e| e.into_inner()).events_after(after, 1000)
                })
                .await
                .ok()?
                .ok()?;
                if let Some(last) = rows.last().map(|r| r.id) {
                    let mut text = String::new();
                    for r in rows {
                        text.push_str(&serde_json::to_string(&r).unwrap_or_default());
                        text.push('\n');
                    }
                    return Some((Ok::<_, std::convert::Infallible>(text), last));
                }
                if !follow {
                    return None;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    });
    ([("content-type", "application/x-ndjson")], axum::body::Body::from_stream(stream)).into_response()
}

/// Prometheus text by default; OpenMetrics for a scraper that asks for it.
async fn metrics(AxState(agent): AxState<Ctl>, headers: axum::http::HeaderMap) -> Response {
    let openmetrics = headers
        .get("accept")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/openmetrics-text"));
    let text = tokio::task::spawn_blocking(move || agent.metrics_text(openmetrics)).await.unwrap_or_default();
    let ct = if openmetrics {
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    } else {
        "text/plain; version=0.0.4; charset=utf-8"
    };
    ([("content-type", ct)], text).into_response()
}

/// One route of the API: its method, its path and its handler.
pub struct Route {
    pub method: Method,
    pub path: &'static str,
    handler: MethodRouter<Ctl>,
}

impl Route {
    fn get<H: Handler<T, Ctl>, T: 'static>(path: &'static str, h: H) -> Self {
        Route { method: Method::GET, path, handler: get(h) }
    }

    fn post<H: Handler<T, Ctl>, T: 'static>(path: &'static str, h: H) -> Self {
        Route { method: Method::POST, path, handler: post(h) }
    }
}

/// Every route the API serves on its socket.
pub fn routes() -> Vec<Route> {
    vec![
        Route::get("/v1/services", services),
        Route::get("/v1/services/{name}", one_service),
        Route::post("/v1/services/{name}/{action}", action),
        Route::get("/v1/processes", processes),
        Route::get("/v1/events", events),
        Route::get("/metrics", metrics),
    ]
}

pub fn router(agent: Ctl) -> Router {
    let mut r = Router::new();
    for route in routes() {
        r = r.route(route.path, route.handler);
    }
    r.layer(axum::middleware::from_fn_with_state(Arc::clone(&agent), check_peer)).with_state(agent)
}

pub async fn serve(agent: Ctl, listener: UnixListener) {
    let app = router(agent).into_make_service_with_connect_info::<Peer>();
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!("API server: {e}");
    }
}

/// /metrics on TCP for Prometheus (no credentials to check there: bind it
/// to an address only the scraper reaches).
pub async fn serve_metrics(agent: Ctl, listener: tokio::net::TcpListener) {
    let app = Router::new().route("/metrics", get(metrics)).with_state(agent);
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!("metrics server: {e}");
    }
}
