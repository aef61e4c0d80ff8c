//! Per-service HTTP hooks around suspends and resumes (vLLM's sleep mode,
//! SGLang's `/release_memory_occupation`): one request to the service's own
//! backend, with hyper (as the CLI's client), bounded by the hook's timeout.

use crate::config::Hook;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// What a hook did: its status, or why it failed; how long it took.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub result: Result<u16, String>,
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
        Err(_) => Err(format!("no answer within {} ms", hook.timeout.as_millis())),
    };
    Outcome { result, took: t0.elapsed() }
}

async fn send(backend: SocketAddr, hook: &Hook) -> Result<u16, String> {
    let stream =
        tokio::net::TcpStream::connect(backend).await.map_err(|e| format!("connect {backend}: {e}"))?;
    let _ = stream.set_nodelay(true);
    let (mut tx, conn) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(|e| e.to_string())?;
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
    let req = req.body(Full::new(Bytes::from(body))).map_err(|e| e.to_string())?;
    let resp = tx.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
    if (200..300).contains(&status) {
        Ok(status)
    } else {
        let text = String::from_utf8_lossy(&body);
        let text: String = text.trim().chars().take(200).collect();
        Err(format!("HTTP {status}: {text}"))
    }
}
