//! The API: HTTP/JSON on a unix socket (axum), as Cloud Hypervisor's
//! daemon serves its own. Requests become actions on the agent; HTTP stays
//! here. Every peer is checked with SO_PEERCRED: root or the configured
//! group, else 403.

use crate::daemon::Agent;
use crate::service::{Service, State};
use axum::extract::connect_info::{ConnectInfo, Connected};
use axum::extract::{Path, Request, State as AxState};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::IncomingStream;
use axum::{Json, Router};
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::UnixListener;

/// The peer's credentials, read once per connection.
#[derive(Clone, Copy, Debug)]
pub struct Peer {
    pub pid: Option<i32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
}

impl Connected<IncomingStream<'_, UnixListener>> for Peer {
    fn connect_info(stream: IncomingStream<'_, UnixListener>) -> Self {
        match stream.io().peer_cred() {
            Ok(c) => Peer { pid: c.pid(), uid: Some(c.uid()), gid: Some(c.gid()) },
            Err(_) => Peer { pid: None, uid: None, gid: None },
        }
    }
}

pub fn group_id(name: &str) -> Option<u32> {
    if let Ok(n) = name.parse::<u32>() {
        return Some(n);
    }
    nix::unistd::Group::from_name(name).ok().flatten().map(|g| g.gid.as_raw())
}

/// The peer's supplementary groups, from /proc (SO_PEERCRED carries only the primary one).
fn supplementary_groups(pid: i32) -> Vec<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .map(|g| g.split_whitespace().filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_default()
}

fn allowed(agent: &Agent, p: &Peer) -> bool {
    let Some(uid) = p.uid else { return false };
    if uid == 0 {
        return true;
    }
    let Some(gid) = agent.cfg.group.as_ref().and_then(|g| group_id(g.get_ref())) else { return false };
    p.gid == Some(gid) || p.pid.is_some_and(|pid| supplementary_groups(pid).contains(&gid))
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
    AxState(agent): AxState<Arc<Agent>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    req: Request,
    next: Next,
) -> Response {
    if !allowed(&agent, &peer) {
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

async fn services(AxState(agent): AxState<Arc<Agent>>) -> Response {
    Json(agent.services.iter().map(|s| view(s)).collect::<Vec<_>>()).into_response()
}

async fn one_service(AxState(agent): AxState<Arc<Agent>>, Path(name): Path<String>) -> Response {
    match agent.service(&name) {
        Some(s) => Json(view(s)).into_response(),
        None => error(StatusCode::NOT_FOUND, format!("no service {name:?}"), 2),
    }
}

async fn action(
    AxState(agent): AxState<Arc<Agent>>,
    Path((name, action)): Path<(String, String)>,
) -> Response {
    let Some(svc) = agent.service(&name).cloned() else {
        return error(StatusCode::NOT_FOUND, format!("no service {name:?}"), 2);
    };
    let why = "asked through the API";
    let r = match action.as_str() {
        "suspend" => agent.suspend(&svc, why).await,
        "hibernate" => agent.hibernate(&svc, why).await,
        "resume" | "wake" => {
            let deadline = std::time::Instant::now() + svc.cfg.wake_timeout;
            agent.ensure_running(&svc, deadline, None).await.map(|_| ()).map_err(|e| e.0)
        }
        "restart" => agent.restart(&svc).await,
        other => {
            return error(
                StatusCode::NOT_FOUND,
                format!("no action {other:?} (suspend, resume, hibernate, wake, restart)"),
                2,
            )
        }
    };
    match r {
        Ok(()) => Json(view(&svc)).into_response(),
        Err(e) => error(StatusCode::CONFLICT, e, 1),
    }
}

async fn processes(AxState(agent): AxState<Arc<Agent>>) -> Response {
    let a = Arc::clone(&agent);
    let r =
        tokio::task::spawn_blocking(move || a.engine().and_then(|mut e| e.ps().map_err(Into::into))).await;
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
    AxState(agent): AxState<Arc<Agent>>,
    axum::extract::Query(q): axum::extract::Query<EventsQuery>,
) -> Response {
    let store = match gpusnap_core::Store::open(&agent.state_dir) {
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
async fn metrics(AxState(agent): AxState<Arc<Agent>>, headers: axum::http::HeaderMap) -> Response {
    let openmetrics = headers
        .get("accept")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/openmetrics-text"));
    let a = Arc::clone(&agent);
    let text = tokio::task::spawn_blocking(move || {
        a.refresh_gauges();
        if openmetrics {
            a.metrics.encode_openmetrics()
        } else {
            a.metrics.encode()
        }
    })
    .await
    .unwrap_or_default();
    let ct = if openmetrics {
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    } else {
        "text/plain; version=0.0.4; charset=utf-8"
    };
    ([("content-type", ct)], text).into_response()
}

impl Agent {
    /// The gauges that are read from the world rather than counted.
    pub fn refresh_gauges(&self) {
        let mut by_state = std::collections::HashMap::new();
        let mut host = 0u64;
        let mut images = 0u64;
        let store = gpusnap_core::Store::open(&self.state_dir).ok();
        for s in &self.services {
            let g = s.lock();
            *by_state.entry(g.state).or_insert(0i64) += 1;
            if g.state == State::Suspended {
                if let (Some(t), Some(st)) = (g.process.as_ref(), store.as_ref()) {
                    for pid in crate::policy::cuda_pids(self, t.pid) {
                        if let Ok(Some(r)) = st.latest_for_pid(pid) {
                            host += r.footprint_bytes();
                        }
                    }
                }
            }
            if let Some(image) = g.image.as_ref().filter(|_| g.state == State::Hibernated) {
                if let Ok((_, m)) = self.images.manifest(image) {
                    images += m.files.iter().map(|f| f.size).sum::<u64>();
                }
            }
        }
        for st in State::ALL {
            let n = by_state.get(&st).copied().unwrap_or(0);
            self.metrics
                .services
                .get_or_create(&crate::metrics::StateLabels { state: st.as_str().into() })
                .set(n);
        }
        self.metrics.host_bytes.set(host);
        self.metrics.image_bytes.set(images);
    }
}

pub fn router(agent: Arc<Agent>) -> Router {
    Router::new()
        .route("/v1/services", get(services))
        .route("/v1/services/{name}", get(one_service))
        .route("/v1/services/{name}/{action}", post(action))
        .route("/v1/processes", get(processes))
        .route("/v1/events", get(events))
        .route("/metrics", get(metrics))
        .layer(axum::middleware::from_fn_with_state(Arc::clone(&agent), check_peer))
        .with_state(agent)
}

pub async fn serve(agent: Arc<Agent>, listener: UnixListener) {
    let app = router(agent).into_make_service_with_connect_info::<Peer>();
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!("API server: {e}");
    }
}

/// /metrics on TCP for Prometheus (no credentials to check there: bind it
/// to an address only the scraper reaches).
pub async fn serve_metrics(agent: Arc<Agent>, listener: tokio::net::TcpListener) {
    let app = Router::new().route("/metrics", get(metrics)).with_state(agent);
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!("metrics server: {e}");
    }
}
