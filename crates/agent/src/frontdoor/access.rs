//! One line a request in the agent's log (tracing target `access`), once
//! its answer has gone: the model, its service, the status, how long it
//! waited for its service and whether that wait was a swap (a wake it
//! caused or joined), the bytes each way and the whole duration; and the
//! request counted in `gpusnap_agent_requests_total{model, status}`.

use super::Body;
use crate::control::Control;
use http_body_util::BodyExt;
use hyper::body::{Bytes, Frame, SizeHint};
use hyper::Response;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

/// What the log line says of one request, filled as it goes.
pub(super) struct Record {
    /// A model some service serves (or a service's name), else `unknown`:
    /// never the client's string, which would let a client make series.
    pub model: String,
    pub service: Option<String>,
    pub wait_ms: u64,
    pub swap: bool,
    pub bytes_in: u64,
    pub began: Instant,
}

impl Record {
    pub fn new() -> Self {
        Record {
            model: "unknown".into(),
            service: None,
            wait_ms: 0,
            swap: false,
            bytes_in: 0,
            began: Instant::now(),
        }
    }
}

/// Counts the request, and logs its line once its answer's body is sent
/// (or dropped: the client hung up).
pub(super) fn finish(agent: &Arc<dyn Control>, rec: Record, resp: Response<Body>) -> Response<Body> {
    let status = resp.status().as_u16();
    let labels = crate::metrics::RequestLabels { model: rec.model.clone(), status: status.to_string() };
    agent.metrics().requests.get_or_create(&labels).inc();
    let (parts, body) = resp.into_parts();
    Response::from_parts(parts, Counted { inner: body, bytes: 0, status, rec: Some(rec) }.boxed())
}

/// The answer's body, its bytes counted.
struct Counted {
    inner: Body,
    bytes: u64,
    status: u16,
    rec: Option<Record>,
}

impl hyper::body::Body for Counted {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(f))) = &r {
            if let Some(d) = f.data_ref() {
                this.bytes += d.len() as u64;
            }
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        let Some(r) = self.rec.take() else { return };
        tracing::info!(
            target: "access",
            model = r.model,
            service = r.service.as_deref().unwrap_or("-"),
            status = self.status,
            wait_ms = r.wait_ms,
            swap = r.swap,
            bytes_in = r.bytes_in,
            bytes_out = self.bytes,
            duration_ms = r.began.elapsed().as_millis() as u64,
            "access"
        );
    }
}
