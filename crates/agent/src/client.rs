//! The CLI's side of the API (as ch-remote is Cloud Hypervisor's): one
//! request over a unix socket with hyper: a path, or `@NAME` for an
//! abstract name.

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach the agent at {path}: {reason}")]
    Connect { path: String, reason: String },
    #[error("{message}")]
    Api { status: u16, message: String, exit_code: i32 },
    #[error("agent: {0}")]
    Protocol(String),
}

impl ClientError {
    pub fn exit_code(&self) -> i32 {
        match self {
            ClientError::Api { exit_code, .. } => *exit_code,
            _ => 1,
        }
    }
}

/// Sends `method path` and returns the body of a 2xx answer.
pub fn request(socket: &Path, method: &str, path: &str) -> Result<String, ClientError> {
    let rt = runtime()?;
    rt.block_on(exchange(socket, method, path))
}

/// [`request`], given up after `limit` (a probe must answer within the
/// kubelet's timeout whatever the agent does).
pub fn request_within(
    socket: &Path,
    method: &str,
    path: &str,
    limit: std::time::Duration,
) -> Result<String, ClientError> {
    let rt = runtime()?;
    rt.block_on(async {
        tokio::time::timeout(limit, exchange(socket, method, path))
            .await
            .map_err(|_| ClientError::Protocol(format!("no answer within {limit:?}")))?
    })
}

fn runtime() -> Result<tokio::runtime::Runtime, ClientError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| ClientError::Protocol(e.to_string()))
}

/// A unix socket of an abstract name (`@NAME`), in this process's network
/// namespace (where the agent places a pod's probe endpoint).
fn connect_abstract(name: &str) -> std::io::Result<tokio::net::UnixStream> {
    use std::os::linux::net::SocketAddrExt;
    let at = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
    let s = std::os::unix::net::UnixStream::connect_addr(&at)?;
    s.set_nonblocking(true)?;
    tokio::net::UnixStream::from_std(s)
}

async fn exchange(socket: &Path, method: &str, path: &str) -> Result<String, ClientError> {
    let connect = |e: std::io::Error| ClientError::Connect {
        path: socket.display().to_string(),
        reason: if e.kind() == std::io::ErrorKind::PermissionDenied {
            format!(
                "{e}: the API is for root and the members of the group `[agent] group` names in the \
                 agent's config (set it, then add the user to that group and log in again)"
            )
        } else {
            e.to_string()
        },
    };
    let stream = match socket.to_str().and_then(|s| s.strip_prefix('@')) {
        Some(name) => connect_abstract(name).map_err(connect)?,
        None => tokio::net::UnixStream::connect(socket).await.map_err(connect)?,
    };
    let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| ClientError::Protocol(e.to_string()))?;
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "gpusnap-agent")
        .body(Empty::<Bytes>::new())
        .map_err(|e| ClientError::Protocol(e.to_string()))?;
    let resp = tx.send_request(req).await.map_err(|e| ClientError::Protocol(e.to_string()))?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.map_err(|e| ClientError::Protocol(e.to_string()))?.to_bytes();
    let text = String::from_utf8_lossy(&body).into_owned();
    if (200..300).contains(&status) {
        return Ok(text);
    }
    let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    let message =
        v["error"]["message"].as_str().map_or_else(|| format!("HTTP {status}: {text}"), str::to_string);
    let exit_code = v["error"]["exit_code"].as_i64().unwrap_or(1) as i32;
    Err(ClientError::Api { status, message, exit_code })
}
