//! A service's life outside the GPU transitions: started under the light
//! guard, stopped, restarted, noticed dead (and restarted with a backoff),
//! and the guard given to woken processes.

use super::{quiet, PolicyError, LOCK_TIMEOUT_MS};
use crate::config::OnFault;
use crate::metrics::ServiceLabels;
use crate::service::{Service, State};
use crate::state::Agent;
use gpusnap_core::engine::StopOptions;
use gpusnap_core::store::{Store, FAULTED};
use gpusnap_core::target;
use std::sync::Arc;
use std::time::{Duration, Instant};

const MAX_BACKOFF: Duration = Duration::from_secs(60);

impl Agent {
    pub(crate) fn spawn_start(self: &Arc<Self>, svc: &Arc<Service>, why: &'static str) {
        let (agent, svc) = (Arc::clone(self), Arc::clone(svc));
        tokio::spawn(async move {
            // A server that declares its size starts only once it fits, and
            // holds the GPU lock until it listens (has loaded): two cold
            // starts must not both count the same free memory.
            let _gpu = match svc.cfg.gpu_memory {
                Some(need) => Some(agent.make_room(&svc, need).await),
                None => None,
            };
            let a = Arc::clone(&agent);
            let s = Arc::clone(&svc);
            let r = tokio::task::spawn_blocking(move || a.start_blocking(&s, why)).await;
            if let Ok(Err(e)) | Err(e) = r.map_err(PolicyError::from) {
                agent.died(&svc, &format!("could not start: {e}"));
            }
        });
    }

    /// `gpusnap guard --daemon PIDS`, as `gpusnap wake` starts it.
    pub(super) fn start_guard(&self, pids: &[i32], on_fault: OnFault) {
        if pids.is_empty() {
            return;
        }
        let st = std::process::Command::new(self.exe())
            .arg("--state-dir")
            .arg(self.state_dir())
            .args(["guard", "--daemon", "--on-fault", on_fault.as_str()])
            .args(pids.iter().map(|p| p.to_string()))
            .stdin(std::process::Stdio::null())
            .status();
        if !st.is_ok_and(|s| s.success()) {
            tracing::warn!(?pids, "the guard could not attach to the woken processes");
        }
    }

    /// Starts the service's command under the light guard (`gpusnap run
    /// --light`), in a session of its own so that it outlives the agent.
    fn start_blocking(&self, svc: &Service, why: &str) -> Result<(), PolicyError> {
        let Some(cmd) = svc.cfg.command.clone() else {
            return Err(PolicyError::NoCommand);
        };
        // Started means listening on the backend port: one that answers
        // before the server runs is another program's, and the agent would
        // forward its clients there.
        if std::net::TcpStream::connect_timeout(&svc.cfg.backend, Duration::from_secs(1)).is_ok() {
            return Err(PolicyError::BackendInUse(svc.cfg.backend));
        }
        let log_path = crate::logs::path(self.state_dir(), &svc.name);
        // The services' output is root's and, to read (`gpusnap logs`), the
        // agent's group's (`[agent] group`): 0640, of that group.
        let gid = self.cfg().group.as_ref().and_then(|g| crate::peer::group_id(g.get_ref()));
        let log = crate::logs::open_for_server(&log_path, gid).map_err(PolicyError::Log)?;
        let mut c = crate::scope::command(self.exe(), &svc.name, self.cfg().server_scope);
        c.arg("--state-dir").arg(self.state_dir()).args([
            "run",
            "--light",
            "--on-fault",
            svc.cfg.on_fault.as_str(),
            "--name",
            &svc.name,
        ]);
        if let Some(u) = &svc.cfg.user {
            c.args(["--user", u.get_ref()]);
        }
        if let Some(g) = &svc.cfg.group {
            c.args(["--group", g.get_ref()]);
        }
        if svc.cfg.fast_swap_on() {
            c.arg("--fast-swap");
            if svc.cfg.keep_pinned_on() {
                c.arg("--keep-pinned");
            }
        }
        c.arg("--")
            .args(&cmd)
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone().map_err(PolicyError::Log)?)
            .stderr(log)
            .env_clear()
            .envs(crate::environ::for_server(&svc.cfg));
        if let Some(b) =
            crate::environ::pinned_budget(self.cfg().pinned_budget).filter(|_| svc.cfg.fast_swap_on())
        {
            c.env("GPUSNAP_FAST_SWAP_PIN_BUDGET", b.to_string());
        }
        use std::os::unix::process::CommandExt;
        // SAFETY: setsid is async-signal-safe and touches no memory of ours.
        unsafe {
            c.pre_exec(|| {
                nix::unistd::setsid().map_err(std::io::Error::from)?;
                Ok(())
            });
        }
        let child = c.spawn().map_err(|e| PolicyError::Spawn { exe: self.exe().to_path_buf(), source: e })?;
        let runner = child.id() as i32;
        self.keep_child(child);
        // The program is the runner's child; it appears once run has set up.
        let deadline = Instant::now() + Duration::from_secs(30);
        let program = loop {
            let kids =
                std::fs::read_to_string(format!("/proc/{runner}/task/{runner}/children")).unwrap_or_default();
            if let Some(p) = kids.split_whitespace().next().and_then(|p| p.parse::<i32>().ok()) {
                break p;
            }
            if Instant::now() > deadline || !std::path::Path::new(&format!("/proc/{runner}")).exists() {
                return Err(PolicyError::NotStarted { log: log_path });
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let t = target::resolve(program)?;
        {
            let mut g = svc.lock();
            g.process = Some(t.clone());
            g.runner = Some(runner);
            g.image = None;
            g.ending_on_purpose = false;
            svc.set_launched(&mut g, crate::service::Launched::of(&svc.cfg));
        }
        self.metrics().config_drift.get_or_create(&ServiceLabels { service: svc.name.clone() }).set(0);
        self.persist();
        // Started means serving: a model server listens once it has loaded.
        let deadline = Instant::now() + svc.cfg.wake_timeout;
        while std::net::TcpStream::connect_timeout(&svc.cfg.backend, Duration::from_secs(1)).is_err() {
            if !target::is_alive(&t) {
                return Err(PolicyError::EndedBeforeListening { backend: svc.cfg.backend, log: log_path });
            }
            if Instant::now() > deadline {
                tracing::warn!(service = svc.name, "not listening on {} after wake_timeout", svc.cfg.backend);
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        {
            let mut g = svc.lock();
            g.last_activity = Instant::now();
            svc.set_state(&mut g, State::Running);
        }
        self.journal(svc, Some(&t), &format!("started (pid {program}, under run --light {runner}): {why}"));
        if svc.cfg.fast_swap_on() {
            self.check_fast_swap_channel(svc, &t);
        }
        Ok(())
    }

    /// A server started with fast swap whose library could not bind its
    /// control socket (listening, it has long since tried: the library binds
    /// as it loads): journaled and counted, so that a server that cannot be
    /// parked, and whose suspends move everything through the driver, is
    /// seen as such.
    fn check_fast_swap_channel(&self, svc: &Service, t: &target::Target) {
        for pid in self.cuda_pids(t.pid).into_iter().filter(|&p| gpusnap_core::swap::unbound(p)) {
            self.metrics()
                .fast_swap_bind_failures
                .get_or_create(&ServiceLabels { service: svc.name.clone() })
                .inc();
            self.journal(
                svc,
                Some(t),
                &format!(
                    "fast swap is off in process {pid}: its library could not bind its control socket \
                     (the server's log says why); it cannot be parked, and a suspend moves all its memory through the driver's checkpoint"
                ),
            );
        }
    }

    /// Whether the guard found the service's process's CUDA context
    /// faulted (its record in the journal says so).
    pub(super) fn faulted(&self, svc: &Service) -> bool {
        let Some(t) = svc.lock().process.clone() else { return false };
        Store::open(self.state_dir())
            .and_then(|s| s.get(&t))
            .ok()
            .flatten()
            .is_some_and(|r| r.state == FAULTED)
    }

    /// The service's process is held by its guard with a faulted CUDA
    /// context (`on_fault = "hold"`): the service is failed and not routed
    /// to until the operator ends the process.
    pub(super) fn held_faulted(&self, svc: &Service) {
        let t = svc.lock().process.clone();
        let why = "its CUDA context faulted; the process is held (on_fault = \"hold\"): not routed to until \
                   `gpusnap stop --force PID` ends it (or the host is rebooted)";
        self.metrics().faults.get_or_create(&ServiceLabels { service: svc.name.clone() }).inc();
        {
            let mut g = svc.lock();
            g.last_error = Some(why.to_string());
            svc.set_state(&mut g, State::Faulted);
        }
        self.persist();
        self.journal(svc, t.as_ref(), why);
    }

    /// The service's process is gone without the agent ending it.
    pub(crate) fn died(&self, svc: &Service, why: &str) {
        // Its guard let it die with a faulted context (on_fault = "exit"),
        // or the operator ended one that was held.
        let was_held = svc.lock().state == State::Faulted;
        let faulted;
        let why = if !was_held && self.faulted(svc) {
            self.metrics().faults.get_or_create(&ServiceLabels { service: svc.name.clone() }).inc();
            faulted = format!("{why}: its CUDA context faulted");
            faulted.as_str()
        } else {
            why
        };
        if svc.cfg.adopted() {
            // Not ours to start: its owner (systemd, a container runtime)
            // may start it again, and the tick adopts the new process.
            // Journaled before the state shows: whoever sees `exited` finds why.
            let t = svc.lock().process.clone();
            self.journal(
                svc,
                t.as_ref(),
                &format!("{why}; adopted, not started by the agent: not restarted"),
            );
            let mut g = svc.lock();
            g.last_error = Some(why.to_string());
            g.exited_at = Some(std::time::SystemTime::now());
            svc.set_state(&mut g, State::Exited);
            drop(g);
            self.persist();
            return;
        }
        let mut g = svc.lock();
        let backoff = Duration::from_secs(1 << g.restarts.min(6)).min(MAX_BACKOFF);
        g.last_error = Some(why.to_string());
        g.runner = None;
        if svc.cfg.restart && svc.cfg.command.is_some() {
            g.restart_at = Some(Instant::now() + backoff);
            g.restarts += 1;
        }
        let t = g.process.clone();
        svc.set_state(&mut g, State::Dead);
        drop(g);
        self.persist();
        let on_demand = svc.cfg.start == crate::config::Start::OnDemand;
        let next = if svc.cfg.restart && svc.cfg.command.is_some() && on_demand {
            format!("; started again when asked (a request, an action), not before {} s", backoff.as_secs())
        } else if svc.cfg.restart && svc.cfg.command.is_some() {
            format!("; restart in {} s", backoff.as_secs())
        } else {
            String::new()
        };
        self.journal(svc, t.as_ref(), &format!("{why}{next}"));
    }

    /// Ends the service (suspended first, as `gpusnap stop` does) and starts it anew.
    pub(super) async fn restart(self: &Arc<Self>, svc: &Arc<Service>) -> Result<(), PolicyError> {
        {
            let mut g = svc.lock();
            if g.state.in_transition() {
                return Err(PolicyError::not_in_state(svc, g.state));
            }
            if svc.cfg.command.is_none() {
                return Err(PolicyError::AdoptedNotRestarted { service: svc.name.clone() });
            }
            g.ending_on_purpose = true;
            svc.set_state(&mut g, State::Stopping);
        }
        self.journal(svc, None, "restart: asked through the API");
        let began = Instant::now();
        let (a, s) = (Arc::clone(self), Arc::clone(svc));
        let stopped =
            tokio::task::spawn_blocking(move || a.stop_blocking(&s)).await.unwrap_or_else(|e| Err(e.into()));
        let r = match stopped {
            Err(e) => Err(e),
            Ok(()) => {
                // As an automatic start: a server that declares its size
                // starts once it fits, holding the GPU lock until it listens.
                let _gpu = match svc.cfg.gpu_memory {
                    Some(need) => Some(self.make_room(svc, need).await),
                    None => None,
                };
                let (a, s) = (Arc::clone(self), Arc::clone(svc));
                tokio::task::spawn_blocking(move || a.start_blocking(&s, "restart"))
                    .await
                    .unwrap_or_else(|e| Err(e.into()))
            }
        };
        self.metrics().transition(&svc.name, "restart", r.is_ok(), began.elapsed().as_secs_f64());
        if let Err(e) = &r {
            self.died(svc, &format!("restart failed: {e}"));
        }
        r
    }

    pub(crate) fn stop_blocking(&self, svc: &Service) -> Result<(), PolicyError> {
        let (root, image) = {
            let g = svc.lock();
            (g.process.clone(), g.image.clone())
        };
        if let Some(image) = image {
            let _ = self.images().remove(&image);
        }
        let Some(root) = root.filter(target::is_alive) else { return Ok(()) };
        let mut e = self.engine()?;
        let opts =
            StopOptions { grace: Duration::from_secs(10), force: false, lock_timeout_ms: LOCK_TIMEOUT_MS };
        let pids = self.cuda_pids(root.pid);
        if !pids.is_empty() {
            e.stop_group(&pids, &opts, &quiet)?;
        }
        if target::is_alive(&root) {
            e.stop(root.pid, &opts)?;
        }
        Ok(())
    }
}
