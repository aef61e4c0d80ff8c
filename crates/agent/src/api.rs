//! The API: HTTP/JSON on a unix socket (axum), as Cloud Hypervisor's
//! daemon serves its own. Requests become requests to the agent through
//! [`Control`]; HTTP stays here. Every peer is checked with SO_PEERCRED:
//! root or the configured group, else 403. [`routes`] lists every route;
//! `openapi.json` (served at `/v1/openapi.json`) describes them.

use crate::control::{Action, Control};
use crate::peer::Peer;
use crate::service::{Service, State};
use axum::extract::connect_info::ConnectInfo;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, Request, State as AxState};
use axum::handler::Handler;
use axum::http::{Method, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, MethodRouter};
use axum::{Json, Router};
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::UnixListener;

/// The agent, as the API sees it.
type Ctl = Arc<dyn Control>;

/// The OpenAPI 3.1 document of the API on the socket.
pub const OPENAPI: &str = include_str!("../openapi.json");

#[derive(Serialize)]
struct ApiError {
    error: ErrorBody,
}

#[derive(Serialize)]
struct ErrorBody {
    message: String,
    exit_code: i32,
}

pub(crate) fn error(status: StatusCode, message: impl Into<String>, exit_code: i32) -> Response {
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
        return error(
            StatusCode::FORBIDDEN,
            format!("{who} is neither root nor in the agent's group (`[agent] group` in its config)"),
            2,
        );
    }
    next.run(req).await
}

#[derive(Serialize)]
pub struct ServiceView {
    pub name: String,
    pub state: &'static str,
    pub listen: String,
    /// `proxy` or `socket`: what brings it back when suspended.
    pub wake_on: &'static str,
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
    /// What it takes on the GPU when it runs (bytes): what NVML saw before
    /// its last before_suspend hook, else its footprint when last
    /// suspended, else its declared `gpu_memory`. None: not known yet.
    pub gpu_memory: Option<u64>,
    /// What the policy does next if nothing changes, and when:
    /// `{"action": "suspend", "in_ms": 240000}`. None: nothing planned.
    pub next: Option<NextStep>,
    /// How the config differs from what its process was started with
    /// (`command`, `fast_swap`); None: it does not (or cannot be told).
    pub config_drift: Option<String>,
    /// A pod's service (`[kubernetes]`): the pod, `NAMESPACE/NAME`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
}

#[derive(Serialize)]
pub struct NextStep {
    pub action: &'static str,
    pub in_ms: u64,
}

/// The policy's next step for a service in state `g`, if nothing changes.
fn next_step(s: &Service, g: &crate::service::Inner) -> Option<NextStep> {
    let left = |after: std::time::Duration, elapsed: std::time::Duration| {
        after.saturating_sub(elapsed).as_millis() as u64
    };
    match g.state {
        State::Running if !Service::has_traffic(g) => s.cfg.suspend_after.map(|d| NextStep {
            action: if s.parks() { "park" } else { "suspend" },
            in_ms: left(d, g.last_activity.elapsed()),
        }),
        State::Suspended | State::Parked if !s.cfg.adopted() => {
            s.cfg.hibernate_after.map(|d| NextStep { action: "hibernate", in_ms: left(d, g.since.elapsed()) })
        }
        State::Dead if s.cfg.start != crate::config::Start::OnDemand => g.restart_at.map(|t| NextStep {
            action: "restart",
            in_ms: t.saturating_duration_since(std::time::Instant::now()).as_millis() as u64,
        }),
        _ => None,
    }
}

pub fn view(s: &Service) -> ServiceView {
    let g = s.lock();
    ServiceView {
        name: s.name.clone(),
        state: g.state.as_str(),
        listen: s.cfg.client_addr().to_string(),
        wake_on: s.cfg.wake_on.as_str(),
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
        gpu_memory: g.full_footprint.or(g.footprint).or(s.cfg.gpu_memory),
        next: next_step(s, &g),
        config_drift: g.drift.clone(),
        pod: s.cfg.pod.as_ref().map(|p| format!("{}/{}", p.namespace, p.name)),
    }
}

async fn services(AxState(agent): AxState<Ctl>) -> Response {
    Json(agent.services().iter().map(|s| view(s)).collect::<Vec<_>>()).into_response()
}

/// A path or query that does not parse: the error format, exit code 2.
fn bad_request(why: String) -> Response {
    error(StatusCode::BAD_REQUEST, why, 2)
}

async fn one_service(AxState(agent): AxState<Ctl>, name: Result<Path<String>, PathRejection>) -> Response {
    let Path(name) = match name {
        Ok(n) => n,
        Err(e) => return bad_request(e.body_text()),
    };
    match agent.service(&name) {
        Some(s) => Json(view(&s)).into_response(),
        None => error(StatusCode::NOT_FOUND, format!("no service {name:?}"), 2),
    }
}

async fn action(
    AxState(agent): AxState<Ctl>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Response {
    let Path((name, action)) = match path {
        Ok(p) => p,
        Err(e) => return bad_request(e.body_text()),
    };
    let Some(svc) = agent.service(&name) else {
        return error(StatusCode::NOT_FOUND, format!("no service {name:?}"), 2);
    };
    let Some(act) = Action::parse(&action) else {
        let all: Vec<&str> = Action::ALL.iter().map(|a| a.as_str()).collect();
        return error(StatusCode::NOT_FOUND, format!("no action {action:?} ({})", all.join(", ")), 2);
    };
    if !crate::access::may_act(&peer, &svc.cfg) {
        tracing::warn!(?peer, service = %name, action = act.as_str(), "refused an action");
        let who = peer.uid.map_or("an unknown peer".to_string(), |u| format!("uid {u}"));
        return error(
            StatusCode::FORBIDDEN,
            format!("{who} may not act on service {name:?} (its allow_users and allow_groups)"),
            2,
        );
    }
    match Arc::clone(&agent).act(Arc::clone(&svc), act).await {
        Ok(()) => Json(view(&svc)).into_response(),
        Err(e) => error(StatusCode::CONFLICT, e.to_string(), 1),
    }
}

#[derive(serde::Deserialize)]
struct ProcessesQuery {
    /// Only the CUDA processes of this process's tree, read only; the pid
    /// as the caller sees it (in its own pid namespace).
    tree: Option<i32>,
}

/// Every CUDA process of the host, read only, or (`?tree=PID`) those of
/// one process's tree (see [`tree`]).
async fn processes(
    AxState(agent): AxState<Ctl>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    q: Result<Query<ProcessesQuery>, QueryRejection>,
) -> Response {
    let Query(q) = match q {
        Ok(q) => q,
        Err(e) => return bad_request(e.body_text()),
    };
    if let Some(pid) = q.tree {
        return tree(agent, peer, pid).await;
    }
    match tokio::task::spawn_blocking(move || agent.processes()).await {
        Ok(Ok(ps)) => Json(ps).into_response(),
        Ok(Err(e)) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), e.exit_code()),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), 1),
    }
}

/// The CUDA processes of one process's tree, read only, `pid` read in the
/// caller's pid namespace: a probe in a container with a pid namespace of
/// its own names its server as it sees it (pid 1). The caller is the
/// process the kernel pinned at accept (SO_PEERPIDFD); its namespace is read
/// from /proc and the pin checked after, so a pid reused meanwhile answers
/// nothing. Only processes of that very namespace are found, and a caller
/// in the agent's own namespace that is not root only its own (`only_own`:
/// the probe socket, which anyone may reach).
pub(crate) async fn tree_of(agent: Ctl, peer: Peer, pid: i32, only_own: bool) -> Response {
    let uid = peer.uid;
    // /proc is read off the runtime's threads.
    let found = tokio::task::spawn_blocking(move || {
        let (_, ns) = peer.pid_namespace()?;
        let host = gpusnap_core::pidns::find_in(&ns, pid)?;
        if only_own
            && uid != Some(0)
            && gpusnap_core::pidns::of(std::process::id() as i32).as_deref() == Some(&ns)
        {
            let owner = gpusnap_core::target::resolve(host).ok()?.uid;
            if Some(owner) != uid {
                return None;
            }
        }
        let tree: Vec<i32> = gpusnap_core::tree::process_tree(host).into_iter().map(|(p, _)| p).collect();
        Some(agent.look(&tree))
    })
    .await;
    match found {
        Ok(Some(Ok(ps))) => Json(ps).into_response(),
        Ok(Some(Err(e))) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), e.exit_code()),
        _ => error(StatusCode::NOT_FOUND, format!("no process {pid} in the caller's pid namespace"), 2),
    }
}

async fn tree(agent: Ctl, peer: Peer, pid: i32) -> Response {
    tree_of(agent, peer, pid, false).await
}

#[derive(serde::Deserialize)]
struct ReloadQuery {
    /// Stop the services the file no longer names (else left running).
    #[serde(default)]
    stop_removed: bool,
}

/// Reads the config file again: what changed, or 422 with the one-line
/// error that refused it (the config in use kept).
async fn reload(
    AxState(agent): AxState<Ctl>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    q: Result<Query<ReloadQuery>, QueryRejection>,
) -> Response {
    let Query(q) = match q {
        Ok(q) => q,
        Err(e) => return bad_request(e.body_text()),
    };
    // Starting and stopping every service: root and the agent's group
    // (the socket's peers) only, unless a service narrows its actions.
    if let Some(s) = agent.services().iter().find(|s| !crate::access::may_act(&peer, &s.cfg)) {
        let who = peer.uid.map_or("an unknown peer".to_string(), |u| format!("uid {u}"));
        return error(
            StatusCode::FORBIDDEN,
            format!(
                "{who} may not reload: service {:?} allows only its allow_users and allow_groups",
                s.name
            ),
            2,
        );
    }
    match agent.reload(q.stop_removed).await {
        Ok(o) => Json(o).into_response(),
        Err(e) => error(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("reload refused, the config in use is kept: {e}"),
            2,
        ),
    }
}

/// Lines a log read gives at most, whatever is asked.
pub const MAX_LOG_LINES: usize = 100_000;

#[derive(serde::Deserialize)]
struct LogsQuery {
    /// The last N lines (default 100).
    lines: Option<usize>,
    /// What was written after this offset (a previous answer's `offset`).
    after: Option<u64>,
}

#[derive(Serialize)]
struct LogsAnswer {
    service: String,
    /// The output, lossy UTF-8, at most `crate::logs::MAX_READ` bytes.
    text: String,
    /// Where the next read (`after`) goes on.
    offset: u64,
}

/// A service's server output (`STATE_DIR/agent/NAME.log`, across one
/// rotation), bounded in bytes.
async fn logs(
    AxState(agent): AxState<Ctl>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    name: Result<Path<String>, PathRejection>,
    q: Result<Query<LogsQuery>, QueryRejection>,
) -> Response {
    let (Path(name), Query(q)) = match (name, q) {
        (Ok(n), Ok(q)) => (n, q),
        (Err(e), _) => return bad_request(e.body_text()),
        (_, Err(e)) => return bad_request(e.body_text()),
    };
    let Some(svc) = agent.service(&name) else {
        return error(StatusCode::NOT_FOUND, format!("no service {name:?}"), 2);
    };
    if !crate::access::may_act(&peer, &svc.cfg) {
        let who = peer.uid.map_or("an unknown peer".to_string(), |u| format!("uid {u}"));
        return error(
            StatusCode::FORBIDDEN,
            format!("{who} may not read service {name:?}'s output (its allow_users and allow_groups)"),
            2,
        );
    }
    let path = agent.log_path(&svc);
    let lines = q.lines.unwrap_or(100).min(MAX_LOG_LINES);
    let read = tokio::task::spawn_blocking(move || match q.after {
        Some(after) => crate::logs::since(&path, after),
        None => crate::logs::tail(&path, lines),
    })
    .await;
    match read {
        Ok(Ok((text, offset))) => {
            Json(LogsAnswer { service: name, text: String::from_utf8_lossy(&text).into_owned(), offset })
                .into_response()
        }
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::NotFound => error(
            StatusCode::NOT_FOUND,
            format!("service {name:?} has no output yet (the agent did not start it)"),
            2,
        ),
        Ok(Err(e)) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), 1),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), 1),
    }
}

/// Without `after`, `/v1/events` starts with this many of the newest entries.
pub const EVENTS_WINDOW: i64 = 100;
/// Clients following `/v1/events` at once; one more gets a 503.
pub const EVENTS_FOLLOWERS: usize = 16;

/// The followers of `/v1/events` now.
static FOLLOWERS: std::sync::LazyLock<Arc<crate::limits::Cap>> =
    std::sync::LazyLock::new(|| crate::limits::Cap::new(EVENTS_FOLLOWERS));
/// [`crate::limits::admit`] takes two caps; followers have only the one.
static FOLLOWERS_TOTAL: std::sync::LazyLock<Arc<crate::limits::Cap>> =
    std::sync::LazyLock::new(|| crate::limits::Cap::new(EVENTS_FOLLOWERS));

#[derive(serde::Deserialize)]
struct EventsQuery {
    /// Start after this journal entry (default: the last EVENTS_WINDOW entries).
    after: Option<i64>,
    /// Keep following the journal (the default), or stop after the entries already there.
    #[serde(default)]
    follow: Option<bool>,
}

/// The journal as newline-delimited JSON, followed as it grows.
async fn events(AxState(agent): AxState<Ctl>, q: Result<Query<EventsQuery>, QueryRejection>) -> Response {
    let Query(q) = match q {
        Ok(q) => q,
        Err(e) => return bad_request(e.body_text()),
    };
    let store = match agent.journal_store() {
        Ok(s) => s,
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), 1),
    };
    let follow = q.follow.unwrap_or(true);
    // A follower holds its place until it hangs up.
    let place = match follow {
        true => match crate::limits::admit(&FOLLOWERS, &FOLLOWERS_TOTAL) {
            Ok(slot) => Some(slot),
            Err(_) => {
                return error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("{EVENTS_FOLLOWERS} clients already follow the events: try again, or ask with follow=false"),
                    1,
                )
            }
        },
        false => None,
    };
    let start = match q.after {
        Some(a) => a,
        None => store.last_event_id().unwrap_or(0).saturating_sub(EVENTS_WINDOW).max(0),
    };
    let store = Arc::new(std::sync::Mutex::new(store));
    let place = Arc::new(place);
    let stream = futures_util::stream::unfold(start, move |after| {
        let store = Arc::clone(&store);
        let _place = Arc::clone(&place);
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

async fn openapi() -> Response {
    ([("content-type", "application/json")], OPENAPI).into_response()
}

/// A path the API does not serve: the error format, not an empty 404.
async fn no_route(method: Method, uri: Uri) -> Response {
    error(StatusCode::NOT_FOUND, format!("no route {method} {}", uri.path()), 2)
}

async fn wrong_method(method: Method, uri: Uri) -> Response {
    error(StatusCode::METHOD_NOT_ALLOWED, format!("{} does not take {method}", uri.path()), 2)
}

/// One route of the API: its method and path, as the OpenAPI document
/// writes them, and its handler.
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

/// Every route the API serves on its socket: the router is built from this
/// list, and the OpenAPI document is checked against it.
pub fn routes() -> Vec<Route> {
    vec![
        Route::get("/v1/services", services),
        Route::get("/v1/services/{name}", one_service),
        Route::get("/v1/services/{name}/logs", logs),
        Route::post("/v1/services/{name}/{action}", action),
        Route::post("/v1/reload", reload),
        Route::get("/v1/processes", processes),
        Route::get("/v1/events", events),
        Route::get("/v1/openapi.json", openapi),
        Route::get("/metrics", metrics),
    ]
}

pub fn router(agent: Ctl) -> Router {
    let mut r = Router::new();
    for route in routes() {
        r = r.route(route.path, route.handler);
    }
    r.fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .layer(axum::middleware::from_fn_with_state(Arc::clone(&agent), check_peer))
        .with_state(agent)
}

pub async fn serve(agent: Ctl, listener: UnixListener, bounds: crate::listen::Bounds) {
    crate::listen::serve_unix(listener, router(agent), bounds).await;
}

/// /metrics on TCP for Prometheus (no credentials to check there: bind it
/// to an address only the scraper reaches).
pub async fn serve_metrics(agent: Ctl, listener: tokio::net::TcpListener, bounds: crate::listen::Bounds) {
    let app = Router::new().route("/metrics", get(metrics)).with_state(agent);
    crate::listen::serve_tcp(listener, app, bounds).await;
}
