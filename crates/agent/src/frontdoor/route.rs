//! Which service a request is for, in this order: the `Host` header (`NAME`
//! or `NAME.anything`), a path prefix (`/NAME/...`, stripped before the
//! request is forwarded), the JSON body's `model` (one of a service's
//! `models`, or its name).

use super::{error, Body};
use crate::service::Service;
use hyper::body::Bytes;
use hyper::http::request::Parts;
use hyper::{Response, StatusCode};
use std::sync::Arc;

/// The service, and the path and query to forward.
pub fn route<'a>(
    services: &'a [Arc<Service>],
    parts: &Parts,
    body: &Bytes,
) -> Result<(&'a Arc<Service>, String), Box<Response<Body>>> {
    let path_and_query = parts.uri.path_and_query().map_or("/", |p| p.as_str()).to_string();
    let by_name = |n: &str| services.iter().find(|s| s.name == n);
    let host = parts.headers.get(hyper::header::HOST).and_then(|h| h.to_str().ok()).map(|h| {
        h.rsplit_once(':').filter(|(_, p)| p.bytes().all(|b| b.is_ascii_digit())).map_or(h, |(h, _)| h)
    });
    if let Some(host) = host {
        if let Some(s) = by_name(host).or_else(|| host.split_once('.').and_then(|(first, _)| by_name(first)))
        {
            return Ok((s, path_and_query));
        }
    }
    if let Some((first, rest)) = path_and_query.strip_prefix('/').and_then(|p| p.split_once('/')) {
        if let Some(s) = by_name(first) {
            return Ok((s, format!("/{rest}")));
        }
    }
    let model = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("model").and_then(|m| m.as_str()).map(str::to_string));
    let Some(model) = model else {
        return Err(Box::new(error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "no service for this request: give a JSON body with a \"model\", a Host naming a service, or a path /SERVICE/...",
        )));
    };
    services
        .iter()
        .find(|s| s.cfg.models.iter().any(|m| *m.get_ref() == model))
        .or_else(|| by_name(&model))
        .map(|s| (s, path_and_query))
        .ok_or_else(|| {
            Box::new(super::json(
                StatusCode::NOT_FOUND,
                &serde_json::json!({ "error": {
                    "message": format!("the model {model:?} does not exist here (GET /v1/models lists them)"),
                    "type": "invalid_request_error",
                    "code": "model_not_found",
                }}),
            ))
        })
}

/// The model a request to `svc` counts under: its body's `model` where
/// `svc` serves it (one of its `models`, or its name), else the service's
/// name; never a string only the client chose.
pub fn model_label(svc: &Service, body: &Bytes) -> String {
    let model = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("model").and_then(|m| m.as_str()).map(str::to_string));
    model
        .filter(|m| *m == svc.name || svc.cfg.models.iter().any(|x| x.get_ref() == m))
        .unwrap_or_else(|| svc.name.clone())
}
