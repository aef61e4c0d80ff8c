//! The policy's periodic look at every service: deaths, restarts due, the
//! idle to suspend, the long-suspended to hibernate and, under host-memory
//! pressure, the longest-suspended.

use crate::service::{Service, State};
use crate::state::Agent;
use gpusnap_core::target;
use std::sync::Arc;
use std::time::{Duration, Instant};

static LOG_ROTATE: crate::ratelimit::Every = crate::ratelimit::Every::new(Duration::from_secs(60));

impl Agent {
    /// The policy, once per tick: reap, notice deaths, restart, suspend the
    /// idle, hibernate the long-suspended and, under host-memory pressure,
    /// the longest-suspended.
    pub async fn tick(self: &Arc<Self>) {
        self.reap();
        // A reload's changes waiting for their service to be idle.
        if self.reloading_waits() {
            let a = Arc::clone(self);
            tokio::spawn(async move { a.apply_pending().await });
        }
        let mut hibernate_one: Option<(Instant, Arc<Service>)> = None;
        for svc in self.services().to_vec() {
            if svc.cfg.command.is_some() {
                let log = crate::logs::path(self.state_dir(), &svc.name);
                if let Err(e) = crate::logs::rotate(&log, crate::logs::MAX_LOG) {
                    crate::warn_every!(LOG_ROTATE, service = svc.name, "rotating {}: {e}", log.display());
                }
            }
            let (state, since, alive, restart_due, may_hibernate) = {
                let g = svc.lock();
                let alive = g.process.as_ref().is_some_and(target::is_alive);
                // Idle connections are closed by the hibernate: only traffic holds it off.
                let may_hibernate =
                    !Service::has_traffic(&g) && g.hibernate_not_before.is_none_or(|t| Instant::now() >= t);
                (g.state, g.since, alive, g.restart_at.is_some_and(|t| Instant::now() >= t), may_hibernate)
            };
            match state {
                State::Running | State::Suspended | State::Parked if !alive => {
                    self.died(&svc, "the process ended on its own");
                }
                State::Faulted if !alive => {
                    self.died(&svc, "the held process with a faulted CUDA context was ended");
                }
                State::Running if svc.cfg.on_fault == crate::config::OnFault::Hold && self.faulted(&svc) => {
                    self.held_faulted(&svc);
                }
                // An on-demand service starts again only when asked (a
                // request, an action), its backoff passed: see ensure_running.
                State::Dead if restart_due && svc.cfg.start != crate::config::Start::OnDemand => {
                    let mut g = svc.lock();
                    g.restart_at = None;
                    svc.set_state(&mut g, State::Starting);
                    drop(g);
                    self.spawn_start(&svc, "restart after the process died");
                }
                State::Running => {
                    let idle = svc.cfg.suspend_after.filter(|d| Service::idle_for(&svc.lock(), *d));
                    if let Some(d) = idle {
                        let (a, s) = (Arc::clone(self), Arc::clone(&svc));
                        tokio::spawn(async move {
                            let _ = a.park_or_suspend(&s, &format!("idle for {}", fmt_duration(d))).await;
                        });
                    }
                }
                State::Exited => {
                    let a = Arc::clone(self);
                    let s = Arc::clone(&svc);
                    let _ = tokio::task::spawn_blocking(move || a.readopt(&s)).await;
                }
                State::Suspended | State::Parked if may_hibernate && !svc.cfg.adopted() => {
                    if let Some(d) = svc.cfg.hibernate_after.filter(|d| since.elapsed() >= *d) {
                        let (a, s) = (Arc::clone(self), Arc::clone(&svc));
                        tokio::spawn(async move {
                            let _ = a.hibernate(&s, &format!("suspended for {}", fmt_duration(d))).await;
                        });
                        continue;
                    }
                    // A socket-woken server hibernated would have no
                    // listener, its clients refused: host memory pressure
                    // never picks one (its own hibernate_after may).
                    let socket = svc.cfg.wake_on == crate::config::WakeOn::Socket;
                    if !socket && hibernate_one.as_ref().is_none_or(|(t, _)| since < *t) {
                        hibernate_one = Some((since, Arc::clone(&svc)));
                    }
                }
                _ => {}
            }
        }
        if let (Some(min), Some((_, svc))) = (self.cfg().min_host_available, hibernate_one) {
            if let Some(avail) = host_available() {
                if avail < min {
                    let reason = format!(
                        "host memory available {} MiB < min_host_available {} MiB",
                        avail >> 20,
                        min >> 20
                    );
                    let a = Arc::clone(self);
                    tokio::spawn(async move {
                        let _ = a.hibernate(&svc, &reason).await;
                    });
                }
            }
        }
    }
}

fn host_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// `1.5s`, `5m`, `2h` for journal notes.
fn fmt_duration(d: std::time::Duration) -> String {
    let s = d.as_secs_f64();
    if s < 1.0 {
        format!("{} ms", d.as_millis())
    } else if s < 120.0 {
        format!("{s:.1} s")
    } else if s < 7200.0 {
        format!("{:.1} min", s / 60.0)
    } else {
        format!("{:.1} h", s / 3600.0)
    }
}
