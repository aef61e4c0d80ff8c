//! Who may use the front door, and how much of the agent's memory request
//! bodies may hold. With `[agent.http] api_keys` every request but
//! `/healthz` must carry one of them (`Authorization: Bearer KEY`, as
//! OpenAI's clients send it), checked before the request is routed, listed
//! or wakes anything: any other gets a 401 in OpenAI's error format. Each
//! body takes its size (its `Content-Length`, or `max_body` when it is sent
//! in chunks) from `max_body_in_flight` before a byte of it is read, and
//! gives it back when its request ends: past the budget, a 503.

use super::{error, Body};
use crate::config::HttpLimits;
use hyper::header::{HeaderMap, AUTHORIZATION, CONTENT_LENGTH, RETRY_AFTER, TRANSFER_ENCODING};
use hyper::{Response, StatusCode};
use std::sync::Arc;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The budget's unit: bodies are counted in KiB (a semaphore's permits).
const UNIT: u64 = 1024;

pub struct Gate {
    keys: Vec<Vec<u8>>,
    budget: Arc<Semaphore>,
    max_body: u64,
}

impl Gate {
    pub fn new(limits: &HttpLimits) -> Self {
        let units = (limits.max_body_in_flight / UNIT).clamp(1, u64::from(u32::MAX)) as usize;
        Self {
            keys: limits.api_keys.iter().map(|k| k.as_bytes().to_vec()).collect(),
            budget: Arc::new(Semaphore::new(units)),
            max_body: limits.max_body,
        }
    }

    /// Whether the request carries a key (always, with none configured).
    pub fn key(&self, headers: &HeaderMap) -> Result<(), Box<Response<Body>>> {
        if self.keys.is_empty() {
            return Ok(());
        }
        let given = headers
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
            .map(str::trim);
        // Every key is compared, each in time independent of where it
        // differs.
        let ok = given.is_some_and(|g| self.keys.iter().fold(false, |ok, k| same(k, g.as_bytes()) | ok));
        if ok {
            return Ok(());
        }
        let mut r = error(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            if given.is_some() {
                "Incorrect API key provided."
            } else {
                "You didn't provide an API key: send it as Authorization: Bearer KEY."
            },
        );
        r.headers_mut()
            .insert(hyper::header::WWW_AUTHENTICATE, hyper::header::HeaderValue::from_static("Bearer"));
        Err(Box::new(r))
    }

    /// The body's place in the budget, held until dropped; `None` for a
    /// request without a body.
    pub fn hold(&self, headers: &HeaderMap) -> Result<Option<OwnedSemaphorePermit>, Box<Response<Body>>> {
        let chunked = headers.contains_key(TRANSFER_ENCODING);
        let length = headers
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        let bytes = match (chunked, length) {
            (true, _) => self.max_body,
            (false, Some(n)) => n.min(self.max_body),
            (false, None) => 0,
        };
        if bytes == 0 {
            return Ok(None);
        }
        let units = bytes.div_ceil(UNIT).min(u64::from(u32::MAX)) as u32;
        match Arc::clone(&self.budget).try_acquire_many_owned(units) {
            Ok(p) => Ok(Some(p)),
            Err(_) => {
                let mut r = error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "server_busy",
                    "too many request bodies at once ([agent.http] max_body_in_flight): retry shortly",
                );
                r.headers_mut().insert(RETRY_AFTER, hyper::header::HeaderValue::from(1));
                Err(Box::new(r))
            }
        }
    }
}

/// Equal bytes, in time that depends only on the lengths.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(keys: &[&str], in_flight: u64) -> HttpLimits {
        HttpLimits {
            api_keys: keys.iter().map(|k| k.to_string()).collect(),
            max_body_in_flight: in_flight,
            max_body: 4096,
            ..Default::default()
        }
    }

    fn with(name: hyper::header::HeaderName, value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(name, value.parse().unwrap());
        h
    }

    #[test]
    fn only_a_listed_key_passes() {
        let g = Gate::new(&limits(&["k-0123456789abcdef", "k-fedcba9876543210"], 1 << 20));
        assert!(g.key(&with(AUTHORIZATION, "Bearer k-fedcba9876543210")).is_ok());
        for bad in ["Bearer k-0123456789abcdeX", "Bearer k-0123456789abcde", "Basic k-0123456789abcdef"] {
            assert_eq!(g.key(&with(AUTHORIZATION, bad)).unwrap_err().status(), StatusCode::UNAUTHORIZED);
        }
        assert_eq!(g.key(&HeaderMap::new()).unwrap_err().status(), StatusCode::UNAUTHORIZED);
        assert!(Gate::new(&limits(&[], 1 << 20)).key(&HeaderMap::new()).is_ok());
    }

    #[test]
    fn bodies_share_the_budget_and_give_it_back() {
        let g = Gate::new(&limits(&[], 8192));
        let a = g.hold(&with(CONTENT_LENGTH, "4096")).unwrap();
        let b = g.hold(&with(TRANSFER_ENCODING, "chunked")).unwrap();
        assert_eq!(g.hold(&with(CONTENT_LENGTH, "1")).unwrap_err().status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(g.hold(&HeaderMap::new()).unwrap().is_none(), "no body, no place taken");
        drop(a);
        assert!(g.hold(&with(CONTENT_LENGTH, "4000")).is_ok());
        drop(b);
    }
}
