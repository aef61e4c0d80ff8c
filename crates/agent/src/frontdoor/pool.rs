//! Backend connections kept open between requests, per service: a request
//! need not connect (and the server accept) anew. Only while the service
//! runs: an idle connection is closed as soon as its service leaves
//! `running` (a suspend, a hibernate: CRIU cannot take an open connection
//! along), and one in use is not kept once its answer ends.

use crate::service::{Service, State};
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::client::conn::http1::SendRequest;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Idle connections kept per service.
const KEEP: usize = 32;

pub type Sender = SendRequest<Full<Bytes>>;

/// One backend connection: its sender, and whether a request uses it.
pub struct Conn {
    pub send: Sender,
    pub busy: Arc<AtomicBool>,
}

#[derive(Default)]
pub struct Pool(Mutex<HashMap<String, Vec<Conn>>>);

impl Pool {
    /// An idle connection to `svc`'s backend, marked busy.
    pub fn take(&self, svc: &Service) -> Option<Conn> {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let list = m.get_mut(&svc.name)?;
        while let Some(c) = list.pop() {
            if c.send.is_ready() {
                c.busy.store(true, Ordering::SeqCst);
                return Some(c);
            }
        }
        None
    }

    /// Keeps `c` for the next request while its service runs.
    pub fn put(&self, svc: &Service, c: Conn) {
        c.busy.store(false, Ordering::SeqCst);
        if svc.lock().state != State::Running || c.send.is_closed() {
            return;
        }
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let list = m.entry(svc.name.clone()).or_default();
        if list.len() < KEEP {
            list.push(c);
        }
    }
}

/// Uncounts a backend connection (counted when made) once it is closed.
struct Counted(Arc<Service>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.backend_conns.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// Drives one backend connection until it ends, or until its service
/// leaves `running` while no request uses it; it is closed (its socket
/// shut) before it is uncounted.
pub async fn drive<F>(svc: Arc<Service>, busy: Arc<AtomicBool>, conn: F)
where
    F: std::future::Future<Output = hyper::Result<()>>,
{
    // Declared first, dropped last: after the connection.
    let _counted = Counted(Arc::clone(&svc));
    let mut rx = svc.changed.subscribe();
    tokio::pin!(conn);
    loop {
        tokio::select! {
            r = &mut conn => {
                if let Err(e) = r {
                    tracing::debug!(service = svc.name, "backend connection: {e}");
                }
                return;
            }
            changed = rx.changed() => {
                let leaving = changed.is_err() || svc.lock().state != State::Running;
                if leaving && !busy.load(Ordering::SeqCst) {
                    return;
                }
            }
        }
    }
}
