//! The front door's own answers: `/v1/models` (OpenAI's list, each model
//! with its service and that service's state), `/healthz` (the agent
//! serves) and `/readyz` (some service can serve a request now or after a
//! wait: not every one refuses).

use super::{error, json, Body};
use crate::control::Control;
use crate::service::Service;
use hyper::{Response, StatusCode};
use serde_json::{json as j, Value};
use std::sync::Arc;

fn entries(agent: &Arc<dyn Control>, s: &Service) -> Vec<Value> {
    let (state, last_error) = {
        let g = s.lock();
        (g.state.as_str(), g.last_error.as_deref().map(crate::wait::without_paths))
    };
    let available = agent.hopeless(s).is_none();
    let mut ids: Vec<&str> = s.cfg.models.iter().map(|m| m.get_ref().as_str()).collect();
    if ids.is_empty() {
        ids.push(&s.name);
    }
    ids.into_iter()
        .map(|id| {
            j!({
                "id": id,
                "object": "model",
                "created": 0,
                "owned_by": "gpusnap",
                "service": s.name,
                "state": state,
                "available": available,
                "last_error": last_error,
            })
        })
        .collect()
}

pub fn list(agent: &Arc<dyn Control>, services: &[Arc<Service>]) -> Response<Body> {
    let data: Vec<Value> = services.iter().flat_map(|s| entries(agent, s)).collect();
    json(StatusCode::OK, &j!({ "object": "list", "data": data }))
}

pub fn one(agent: &Arc<dyn Control>, services: &[Arc<Service>], id: &str) -> Response<Body> {
    match services.iter().flat_map(|s| entries(agent, s)).find(|e| e["id"] == id) {
        Some(e) => json(StatusCode::OK, &e),
        None => error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            &format!("the model {id:?} does not exist here"),
        ),
    }
}

pub fn healthz() -> Response<Body> {
    json(StatusCode::OK, &j!({ "status": "ok" }))
}

pub fn readyz(agent: &Arc<dyn Control>, services: &[Arc<Service>]) -> Response<Body> {
    let down: Vec<Value> = services
        .iter()
        .filter_map(|s| {
            agent
                .hopeless(s)
                .map(|r| j!({ "service": s.name, "reason": crate::wait::without_paths(&r.reason) }))
        })
        .collect();
    let all = services.len();
    let ready = down.len() < all || all == 0;
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    json(status, &j!({ "ready": ready, "unavailable": down }))
}
