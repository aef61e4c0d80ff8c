//! When a service cannot come back as it went: the answer for a request
//! that would wait in vain ([`Agent::hopeless`]), and a hibernated service
//! whose image is gone from this host (pulled from the service's `remote`,
//! else started cold when `restart` allows). Each image of a service with a
//! `remote` is pushed there once hibernated.

use crate::control::Refusal;
use crate::service::{Service, State};
use crate::state::Agent;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The image name of a service's hibernations: one per service, stable
/// (what its remote holds under that name is its latest).
pub fn image_name(service: &str) -> String {
    format!("agent.{service}")
}

/// `URL/NAME` for a pull of an image from a remote `URL`.
fn at_remote(url: &str, image: &str) -> String {
    format!("{}/{image}", url.trim_end_matches('/'))
}

impl Agent {
    /// Whether a hibernated service's image is gone from this host.
    pub(super) fn image_lost(&self, svc: &Service) -> bool {
        let image = svc.lock().image.clone();
        image.is_none_or(|i| self.images().manifest(&i).is_err())
    }

    fn may_start_cold(svc: &Service) -> bool {
        svc.cfg.restart && svc.cfg.command.is_some()
    }

    /// See [`crate::control::Control::hopeless`].
    pub(super) fn hopeless(&self, svc: &Service) -> Option<Refusal> {
        let (state, restart_at, last_error) = {
            let g = svc.lock();
            (g.state, g.restart_at, g.last_error.clone())
        };
        match state {
            // Its last start failed (or it died): the next is not due yet.
            State::Dead => {
                // Due: an on-demand one starts for whoever asks now.
                let at = restart_at.filter(|t| *t > Instant::now())?;
                let left = at.saturating_duration_since(Instant::now());
                Some(Refusal {
                    reason: format!(
                        "{}: {}; next start in {} s",
                        svc.name,
                        last_error.as_deref().unwrap_or("its process ended"),
                        left.as_secs_f64().ceil() as u64
                    ),
                    retry_after: left.max(Duration::from_secs(1)),
                })
            }
            State::Exited => Some(Refusal {
                reason: format!(
                    "{}: its process ended, and the agent does not start a server it adopted",
                    svc.name
                ),
                retry_after: Duration::from_secs(30),
            }),
            State::Hibernated
                if svc.cfg.remote.is_none() && !Self::may_start_cold(svc) && self.image_lost(svc) =>
            {
                Some(Refusal {
                    reason: format!(
                        "{}: its image {} is gone, it has no remote, and it may not be started cold (restart = false)",
                        svc.name,
                        svc.lock().image.as_deref().unwrap_or("?")
                    ),
                    retry_after: Duration::from_secs(60),
                })
            }
            _ => None,
        }
    }

    /// A hibernated service (now Waking) whose image is gone from this host,
    /// or an idle one's first request (`first`): pulled from its remote and
    /// woken, else started cold when `restart` allows, else left hibernated
    /// with the reason. An image signed by a key this agent does not trust
    /// (`[agent] trust`) is refused, and nothing is started in its place:
    /// the requests get the reason, and each later one tries the remote again.
    pub(super) fn spawn_recover(self: &Arc<Self>, svc: &Arc<Service>, first: bool) {
        let (agent, svc) = (Arc::clone(self), Arc::clone(svc));
        tokio::spawn(async move {
            let image = svc.lock().image.clone().unwrap_or_else(|| image_name(&svc.name));
            let pulled = match svc.cfg.remote.as_ref().map(|r| at_remote(r.get_ref(), &image)) {
                Some(from) => {
                    let a = Arc::clone(&agent);
                    let at = from.clone();
                    let r = tokio::task::spawn_blocking(move || {
                        gpusnap_images::remote::pull(a.images(), &at, None, false, &|_| {}, &|_| {})
                    })
                    .await;
                    match r {
                        Ok(Ok(_)) => Ok(from),
                        Ok(Err(e)) if e.kind() == "image_untrusted" => {
                            return agent.refuse_untrusted(&svc, &from, &e, first);
                        }
                        Ok(Err(e)) => Err(format!("{from}: {e}")),
                        Err(e) => Err(e.to_string()),
                    }
                }
                None => Err("no remote".to_string()),
            };
            match pulled {
                Ok(from) => {
                    agent.journal(&svc, None, &format!("image {image} was gone: pulled from {from}"));
                    svc.lock().image = Some(image);
                    agent.spawn_bring_back(&svc, "a connection arrived; its image pulled from its remote");
                }
                Err(why) if Self::may_start_cold(&svc) => {
                    agent.journal(&svc, None, &format!("image {image} is gone ({why}): a cold start"));
                    {
                        let mut g = svc.lock();
                        g.image = None;
                        g.process = None;
                        g.runner = None;
                        g.trace = None;
                        g.ending_on_purpose = false;
                        svc.set_state(&mut g, State::Starting);
                    }
                    agent.persist();
                    agent.spawn_start(&svc, "its image was gone: a cold start");
                }
                Err(why) => {
                    let msg = format!("image {image} is gone ({why}) and restart = false: not started cold");
                    agent.journal(&svc, None, &msg);
                    let mut g = svc.lock();
                    g.last_error = Some(msg);
                    svc.set_state(&mut g, State::Hibernated);
                }
            }
        });
    }

    /// The image at `from` is signed by a key this agent does not trust:
    /// the wake fails with that reason (the requests waiting get it in
    /// their 503), and the service goes back to where it was.
    fn refuse_untrusted(&self, svc: &Service, from: &str, e: &gpusnap_images::Error, first: bool) {
        let msg = format!("{from}: {e}; to wake it, add that key to [agent] trust");
        self.journal(svc, None, &format!("refused to wake: {msg}"));
        let mut g = svc.lock();
        g.last_error = Some(msg);
        if first {
            g.image = None;
            svc.set_state(&mut g, State::Idle);
        } else {
            svc.set_state(&mut g, State::Hibernated);
        }
    }

    /// Sends a service's new image to its remote, in the background; the
    /// journal says how it went.
    pub(super) fn spawn_push(self: &Arc<Self>, svc: &Arc<Service>, image: String) {
        let Some(url) = svc.cfg.remote.as_ref().map(|r| r.get_ref().clone()) else { return };
        let (agent, svc) = (Arc::clone(self), Arc::clone(svc));
        tokio::task::spawn_blocking(move || {
            let t0 = Instant::now();
            match gpusnap_images::remote::push(agent.images(), &image, &url, &|_| {}) {
                Ok(r) => agent.journal(
                    &svc,
                    None,
                    &format!(
                        "{image} pushed to {url} in {} ms ({} bytes sent)",
                        t0.elapsed().as_millis(),
                        r.bytes_sent
                    ),
                ),
                Err(e) => {
                    agent.journal(&svc, None, &format!("{image}: push to {url} failed: {e}"));
                    svc.lock().last_error = Some(format!("push to {url} failed: {e}"));
                }
            }
        });
    }
}
