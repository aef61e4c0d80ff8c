//! The daemon: builds the agent's state from the config, adopts what a
//! previous agent left (crash safety), starts the proxies, the policy loop
//! and the API, and tells systemd it is ready (`Type=notify`).

use crate::control::Control;
use crate::error::AgentError;
use crate::state::{Agent, Setup};
use std::sync::Arc;

/// Runs the agent until SIGTERM or SIGINT. The services are left as they
/// are: a later agent adopts them.
pub fn run(setup: Setup) -> Result<(), AgentError> {
    // Before anything opens a descriptor: every listener's cap comes from it.
    let nofile = crate::limits::raise_nofile();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .worker_threads(4)
        .build()
        .map_err(|e| AgentError::Setup(format!("tokio: {e}")))?;
    rt.block_on(async move {
        // SIGHUP's default would end the agent: a reload asked while it
        // starts waits until it is ready instead.
        use tokio::signal::unix::{signal, SignalKind};
        let mut hup = signal(SignalKind::hangup()).map_err(|e| AgentError::Setup(e.to_string()))?;
        let agent = Arc::new(Agent::new(setup)?);
        let (api_listener, probe_listener) = crate::sockets::bind(
            &agent.cfg().socket,
            &agent.cfg().probe_path(),
            agent.cfg().group.as_ref().map(|g| g.get_ref().as_str()),
        )?;
        // Bind every listen address before anything else: a taken port is a
        // setup error now, not a silent hole later.
        let mut proxies = Vec::new();
        for svc in agent.services().iter() {
            // A socket-woken service has no proxy: its server keeps its port.
            let Some(addr) = svc.cfg.listen.as_ref().map(|l| *l.get_ref()) else { continue };
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| AgentError::Setup(format!("service {}: listen {addr}: {e}", svc.name)))?;
            proxies.push((Arc::clone(svc), l));
        }
        let front_door = match agent.cfg().http_listen {
            Some(a) => Some(
                tokio::net::TcpListener::bind(a)
                    .await
                    .map_err(|e| AgentError::Setup(format!("http_listen {a}: {e}")))?,
            ),
            None => None,
        };
        let metrics_listener = match agent.cfg().metrics_listen {
            Some(a) => Some(
                tokio::net::TcpListener::bind(a)
                    .await
                    .map_err(|e| AgentError::Setup(format!("metrics_listen {a}: {e}")))?,
            ),
            None => None,
        };
        // The node's pods are listed before the adoption, which finds them
        // again as it finds the file's services.
        let follower = match agent.kubernetes() {
            Some(k) => {
                let mut f = crate::kubernetes::Follower::new(k)
                    .map_err(|e| AgentError::Setup(format!("[kubernetes] {e}")))?;
                f.first_poll(&agent)
                    .await
                    .map_err(|e| AgentError::Setup(format!("[kubernetes] the runtime did not answer: {e}")))?;
                Some((f, k.poll_interval))
            }
            None => None,
        };
        {
            let a = Arc::clone(&agent);
            tokio::task::spawn_blocking(move || a.adopt())
                .await
                .map_err(|e| AgentError::Setup(format!("adopt: {e}")))?;
        }
        // Every address the agent listens on, said once at start.
        let mut addrs: Vec<(String, String)> = vec![
            ("API (admin socket)".into(), agent.cfg().socket.display().to_string()),
            ("probe socket".into(), agent.cfg().probe_path().display().to_string()),
        ];
        let tcp = |l: &tokio::net::TcpListener| l.local_addr().map_or("?".into(), |a| a.to_string());
        for (svc, l) in &proxies {
            addrs.push((format!("service {} (proxy)", svc.name), tcp(l)));
        }
        for svc in agent.services().iter().filter(|s| s.cfg.listen.is_none()) {
            addrs.push((format!("service {} (its own port, wake_on = \"socket\")", svc.name), svc.cfg.backend.to_string()));
        }
        if let Some(l) = &front_door {
            addrs.push(("front door (http_listen)".into(), tcp(l)));
        }
        if let Some(l) = &metrics_listener {
            addrs.push(("metrics (metrics_listen)".into(), tcp(l)));
        }
        // The proxies and the API see the agent only through Control.
        let ctl: Arc<dyn Control> = agent.clone();
        let budget = nofile.budget();
        let total = crate::limits::Cap::new(agent.cfg().max_connections.map_or(budget.proxies, |m| m.min(budget.proxies)));
        tracing::info!(
            open_files = nofile.soft,
            services = total.max(),
            api = budget.api,
            metrics = budget.metrics,
            "connections allowed (the open-file limit less a reserve; the probe socket takes a quarter of the API's)"
        );
        let header_timeout = agent.cfg().header_timeout;
        let bounds = |own: usize, total: &Arc<crate::limits::Cap>| crate::listen::Bounds {
            own: crate::limits::Cap::new(own),
            total: Arc::clone(total),
            header_timeout,
        };
        agent.set_doors(Arc::clone(&total), header_timeout);
        for (svc, l) in proxies {
            agent.serve_proxy(&svc, l);
        }
        // A pod's watch was started by the follower when it served the pod
        // (the first poll above): one watch a service, one wake a connection.
        let socket_woken = |s: &&Arc<crate::service::Service>| {
            s.cfg.wake_on == crate::config::WakeOn::Socket && s.cfg.pod.is_none()
        };
        for svc in agent.services().iter().filter(socket_woken) {
            crate::sockwake::spawn(Arc::clone(&ctl), Arc::clone(svc), tokio::runtime::Handle::current());
        }
        if let Some(l) = front_door {
            tokio::spawn(crate::frontdoor::serve(Arc::clone(&ctl), l, agent.cfg().http.clone(), Arc::clone(&total)));
        }
        // The probe socket takes a quarter of the API's share: pods flooding
        // it leave the admin socket the rest.
        let probes = (budget.api / 4).max(1);
        let admin = budget.api.saturating_sub(probes).max(1);
        tokio::spawn(crate::api::serve(Arc::clone(&ctl), api_listener, bounds(admin, &crate::limits::Cap::new(admin))));
        tokio::spawn(crate::probe::serve(Arc::clone(&ctl), probe_listener, bounds(probes, &crate::limits::Cap::new(probes))));
        if let Some(l) = metrics_listener {
            tokio::spawn(crate::api::serve_metrics(ctl, l, bounds(budget.metrics, &crate::limits::Cap::new(budget.metrics))));
        }
        {
            let a = Arc::clone(&agent);
            tokio::spawn(async move {
                let mut every = tokio::time::interval(a.cfg().tick);
                every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    every.tick().await;
                    a.tick().await;
                }
            });
        }
        if let Some((f, every)) = follower {
            tokio::spawn(f.run(Arc::clone(&agent), every));
        }
        let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);
        for (what, at) in &addrs {
            tracing::info!(at = %at, "listening: {what}");
        }
        tracing::info!(socket = %agent.cfg().socket.display(), services = agent.services().len(), "agent ready");
        eprintln!(
            "gpusnap agent: ready ({} services, API on {}, probes on {})",
            agent.services().len(),
            agent.cfg().socket.display(),
            agent.cfg().probe_path().display()
        );
        let mut term = signal(SignalKind::terminate()).map_err(|e| AgentError::Setup(e.to_string()))?;
        let mut int = signal(SignalKind::interrupt()).map_err(|e| AgentError::Setup(e.to_string()))?;
        loop {
            tokio::select! {
                _ = term.recv() => break,
                _ = int.recv() => break,
                // `systemctl reload`: the config file read again; what
                // changed (or why it was refused) goes to the log.
                _ = hup.recv() => {
                    let a = Arc::clone(&agent);
                    tokio::spawn(async move {
                        let _ = a.reload(false).await;
                    });
                }
            }
        }
        let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
        agent.persist();
        let _ = std::fs::remove_file(&agent.cfg().socket);
        let _ = std::fs::remove_file(agent.cfg().probe_path());
        Ok(())
    })
}
