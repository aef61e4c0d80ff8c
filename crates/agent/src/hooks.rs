//! Per-service HTTP hooks around suspends and resumes (vLLM's sleep mode,
//! SGLang's `/release_memory_occupation`): one request to the service's own
//! backend, with hyper (as the CLI's client), bounded by the hook's timeout.

use crate::config::Hook;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Why a hook failed.
#[derive(Debug, thiserror::Error)]
pub enum HookError {
    /// No answer within the hook's timeout.
    #[error("no answer within {} ms", .0.as_millis())]
    Timeout(Duration),
    /// The backend could not be reached.
    #[error("connect {backend}: {source}")]
    Connect { backend: SocketAddr, source: std::io::Error },
    /// The request could not be made (a method or path the config let by).
    #[error(transparent)]
    Request(#[from] hyper::http::Error),
    /// The HTTP exchange failed (handshake, send, or the body).
    #[error(transparent)]
    Http(#[from] hyper::Error),
    /// The backend answered, with a status other than 2xx (and the first
    /// 200 characters of its body).
    #[error("HTTP {status}: {body}")]
    Status { status: u16, body: String },
}

/// What a hook did: its status, or why it failed; how long it took.
#[derive(Debug)]
pub struct Outcome {
    pub result: Result<u16, HookError>,
    pub took: Duration,
}

impl Outcome {
    pub fn ok(&self) -> bool {
        self.result.is_ok()
    }

    /// `POST /sleep?level=1 -> 200 in 12 ms` or `... failed: why (after 30000 ms)`.
    pub fn describe(&self, hook: &Hook) -> String {
        let ms = self.took.as_millis();
        match &self.result {
            Ok(code) => format!("{} -> {code} in {ms} ms", hook.describe()),
            Err(e) => format!("{} failed after {ms} ms: {e}", hook.describe()),
        }
    }
}

/// Sends the hook's request to `backend`; a 2xx answer (its body read to the
/// end) is success, anything else or the timeout a failure.
pub async fn call(backend: SocketAddr, hook: &Hook) -> Outcome {
    let t0 = Instant::now();
    let result = match tokio::time::timeout(hook.timeout, send(backend, hook)).await {
        Ok(r) => r,
        Err(_) => Err(HookError::Timeout(hook.timeout)),
    };
    Outcome { result, took: t0.elapsed() }
}

async fn send(backend: SocketAddr, hook: &Hook) -> Result<u16, HookError> {
    let stream = tokio::net::TcpStream::connect(backend)
        .await
        .map_err(|source| HookError::Connect { backend, source })?;
    let _ = stream.set_nodelay(true);
    let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let body = hook.body.clone().unwrap_or_default();
    let mut req = hyper::Request::builder()
        .method(hook.method.as_str())
        .uri(hook.path.as_str())
        .header("host", backend.to_string())
        .header("user-agent", "gpusnap-agent");
    if serde_json::from_str::<serde_json::Value>(&body).is_ok() {
        req = req.header("content-type", "application/json");
    }
    let req = req.body(Full::new(Bytes::from(body)))?;
    let resp = tx.send_request(req).await?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await?.to_bytes();
    if (200..300).contains(&status) {
        Ok(status)
    } else {
        let text = String::from_utf8_lossy(&body);
        Err(HookError::Status { status, body: text.trim().chars().take(200).collect() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hook_failures_say_what_the_journal_said() {
        assert_eq!(HookError::Timeout(Duration::from_millis(300)).to_string(), "no answer within 300 ms");
        let s = HookError::Status { status: 500, body: "boom".into() };
        assert_eq!(s.to_string(), "HTTP 500: boom");
        let backend: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let c = HookError::Connect { backend, source: std::io::ErrorKind::ConnectionRefused.into() };
        assert!(c.to_string().starts_with("connect 127.0.0.1:9: "), "{c}");
    }
}
