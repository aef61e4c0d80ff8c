//! The probe socket: what a pod may ask the agent, and nothing more. It
//! answers one request, `GET /v1/processes?tree=PID`, about the processes
//! of the caller's own pid namespace (the caller pinned by SO_PEERPIDFD at
//! accept), read only; every other request is refused with a 403 that
//! names the one it answers. Anyone who reaches it may ask (it is mode
//! 0666): the answer is what the caller could see of its own processes
//! anyway, and their driver state.

use crate::api::{error, tree_of};
use crate::control::Control;
use crate::peer::Peer;
use axum::extract::connect_info::ConnectInfo;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State as AxState};
use axum::http::{Method, StatusCode, Uri};
use axum::response::Response;
use axum::routing::get;
use axum::Router;
use std::sync::Arc;

type Ctl = Arc<dyn Control>;

/// The one request the probe socket answers.
pub const ANSWERS: &str = "GET /v1/processes?tree=PID";

#[derive(serde::Deserialize)]
struct TreeQuery {
    tree: Option<i32>,
}

async fn processes(
    AxState(agent): AxState<Ctl>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    q: Result<Query<TreeQuery>, QueryRejection>,
) -> Response {
    match q {
        Ok(Query(TreeQuery { tree: Some(pid) })) => tree_of(agent, peer, pid, true).await,
        Ok(_) => refuse(Method::GET, "/v1/processes".parse().unwrap_or_default()).await,
        Err(e) => error(StatusCode::BAD_REQUEST, e.body_text(), 2),
    }
}

async fn refuse(method: Method, uri: Uri) -> Response {
    tracing::debug!(%method, path = uri.path(), "probe socket: refused");
    error(
        StatusCode::FORBIDDEN,
        format!("the probe socket answers only {ANSWERS}, not {method} {}: use the admin socket", uri.path()),
        2,
    )
}

pub fn router(agent: Ctl) -> Router {
    Router::new()
        .route("/v1/processes", get(processes))
        .fallback(refuse)
        .method_not_allowed_fallback(refuse)
        .with_state(agent)
}

pub async fn serve(agent: Ctl, listener: tokio::net::UnixListener, bounds: crate::listen::Bounds) {
    crate::listen::serve_unix(listener, router(agent), bounds).await;
}
