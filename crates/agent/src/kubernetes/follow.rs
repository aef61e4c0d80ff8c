//! Following the node's pods: each poll lists the sandboxes and containers
//! (two calls; a container's pid is asked once, when it is first seen),
//! serves the enabled pods not yet served, follows the pid of their
//! container, and closes the record of the pods gone. A failed listing
//! changes nothing: a pod is gone only when the runtime says so.

use super::annotations::{self, BadAnnotation};
use super::PodEndpoint;
use crate::config::PodRef;
use crate::metrics::PodKeyLabels;
use crate::service::Service;
use crate::state::Agent;
use gpusnap_core::target;
use gpusnap_cri::{Container, Cri, CriError, Pod};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

/// How long the agent waits for the runtime when it starts.
const FIRST_POLL: Duration = Duration::from_secs(60);

static LIST_FAILED: crate::ratelimit::Every = crate::ratelimit::Every::new(Duration::from_secs(60));

/// The agent's view of the node's runtime, kept between polls.
pub struct Follower {
    cri: Cri,
    /// The bad annotations already reported, by pod sandbox: each once.
    reported: HashMap<String, BTreeSet<String>>,
    /// The host pid of each running container seen, by container id.
    pids: HashMap<String, i32>,
    /// `node_addresses`: the peers a pod's watch ignores (the kubelet's probes).
    nodes: Vec<std::net::IpAddr>,
    /// `max_priority`: the most a pod's annotation may ask.
    max_priority: i64,
}

/// A pod to serve: its listing, and the container chosen.
struct Found {
    pod: Pod,
    container: String,
    pid: i32,
}

impl Follower {
    pub fn new(cfg: &crate::config::KubernetesConfig) -> Result<Self, CriError> {
        Ok(Self {
            cri: Cri::new(&cfg.cri_socket, cfg.cri_timeout)?,
            reported: HashMap::new(),
            pids: HashMap::new(),
            nodes: cfg.node_addresses.clone(),
            max_priority: cfg.max_priority,
        })
    }

    /// Follows the pods for ever, each `poll_interval`.
    pub async fn run(mut self, agent: Arc<Agent>, every: Duration) {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if let Err(e) = self.poll(&agent, true).await {
                crate::warn_every!(LIST_FAILED, "kubernetes: {e}");
            }
        }
    }

    /// The first look, before the agent adopts anything: a runtime that is
    /// restarting is given a minute; past it the agent does not start
    /// (rather than forget the records of pods it could not see).
    pub async fn first_poll(&mut self, agent: &Arc<Agent>) -> Result<(), CriError> {
        let end = tokio::time::Instant::now() + FIRST_POLL;
        loop {
            match self.poll(agent, false).await {
                Ok(()) => {
                    if let Ok(v) = self.cri.version().await {
                        tracing::info!(
                            socket = %self.cri.socket().display(),
                            runtime = v.runtime_name,
                            version = v.runtime_version,
                            api = v.runtime_api_version,
                            pods = agent.services().iter().filter(|s| s.cfg.pod.is_some()).count(),
                            "kubernetes: following the node's pods"
                        );
                    }
                    return Ok(());
                }
                Err(e) if tokio::time::Instant::now() >= end => return Err(e),
                Err(e) => {
                    crate::warn_every!(LIST_FAILED, "kubernetes: {e}; trying again");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }

    /// One look at the node. `adopt`: the new pods' processes are adopted
    /// now (false before the agent's first adoption, which adopts them).
    pub async fn poll(&mut self, agent: &Arc<Agent>, adopt: bool) -> Result<(), CriError> {
        let pods = self.cri.pods().await?;
        let listed: HashSet<String> = pods.iter().map(|p| p.id.clone()).collect();
        self.reported.retain(|id, _| listed.contains(id));
        // One listing of every container, when a pod asks to be served.
        let containers = match pods.iter().any(|p| p.ready && annotations::enabled(&p.annotations)) {
            true => self.cri.containers(None).await?,
            false => Vec::new(),
        };
        let running: HashSet<&str> = containers.iter().filter(|c| c.running).map(|c| c.id.as_str()).collect();
        self.pids.retain(|id, _| running.contains(id.as_str()));
        let mut keep = HashSet::new();
        for pod in pods.into_iter().filter(|p| p.ready && annotations::enabled(&p.annotations)) {
            let name = annotations::service_name(&pod.namespace, &pod.name);
            let found = match self.container_of(&pod, &containers).await {
                Ok(f) => f,
                // Gone between the two calls: the next poll says so.
                Err(e) if e.is_not_found() => None,
                Err(e) => return Err(e),
            };
            let served = agent.service(&name);
            match (served, found) {
                (Some(svc), found) if svc.cfg.pod.as_ref().is_some_and(|p| p.sandbox_id == pod.id) => {
                    keep.insert(name);
                    // No running container: its process is gone, which the
                    // policy sees; a new one is adopted once it runs.
                    svc.set_pod_pid(found.map(|f| f.pid));
                }
                (_, None) => {
                    // Not running yet: served once its container runs.
                    if agent.service(&name).is_some_and(|s| s.cfg.pod.is_some()) {
                        keep.insert(name);
                    }
                }
                (served, Some(f)) => {
                    if served.as_ref().is_some_and(|s| s.cfg.pod.is_none()) {
                        self.report(
                            agent,
                            &f,
                            &[BadAnnotation {
                                key: "enabled".into(),
                                reason: format!(
                                    "the service name {name:?} is a [[service]] of the configuration"
                                ),
                            }],
                        );
                        continue;
                    }
                    if served.is_some() {
                        // The same name, another sandbox: the pod was made anew.
                        self.close(agent, &name, "its pod was replaced by a new one");
                    }
                    if self.serve(agent, f, adopt).await? {
                        keep.insert(name);
                    }
                }
            }
        }
        for svc in agent.services().iter().filter(|s| s.cfg.pod.is_some() && !keep.contains(&s.name)) {
            self.close(agent, &svc.name, "its pod is gone");
        }
        Ok(())
    }

    /// The pod's container to serve (`gpusnap.io/container`, else the
    /// first running one by name) and its pid; None when none runs.
    /// The pid of a container is asked once (a verbose `ContainerStatus`):
    /// a container's first process never changes, a restart is a new container.
    async fn container_of(&mut self, pod: &Pod, all: &[Container]) -> Result<Option<Found>, CriError> {
        let mut list: Vec<&Container> = all.iter().filter(|c| c.pod_id == pod.id && c.running).collect();
        list.sort_by(|a, b| a.name.cmp(&b.name));
        let wanted = annotations::container(&pod.annotations);
        let Some(c) = list.into_iter().find(|c| wanted.is_none_or(|w| w == c.name)) else {
            return Ok(None);
        };
        let pid = match self.pids.get(&c.id) {
            Some(pid) => Some(*pid),
            None => {
                let st = self.cri.container_status(&c.id).await?;
                let pid = st.pid.filter(|_| st.running);
                if let Some(pid) = pid {
                    self.pids.insert(c.id.clone(), pid);
                }
                pid
            }
        };
        Ok(pid.map(|pid| Found { pod: pod.clone(), container: c.name.clone(), pid }))
    }

    /// Serves a pod: its service made from its annotations, its process
    /// adopted. False when its annotations are bad (reported, pod left alone).
    async fn serve(&mut self, agent: &Arc<Agent>, f: Found, adopt: bool) -> Result<bool, CriError> {
        let status = self.cri.pod_status(&f.pod.id).await?;
        let ip = status.ip.parse::<IpAddr>().ok();
        let pod = PodRef {
            namespace: f.pod.namespace.clone(),
            name: f.pod.name.clone(),
            uid: f.pod.uid.clone(),
            sandbox_id: f.pod.id.clone(),
            container: f.container.clone(),
        };
        let cfg = match annotations::service(&f.pod.annotations, ip, pod) {
            Ok(mut c) => {
                // The kubelet's probes come from the node's addresses: set,
                // they are the ones the watch ignores (else the node's own).
                if !self.nodes.is_empty() {
                    c.ignore_peers =
                        Some(self.nodes.iter().map(|a| toml::Spanned::new(0..0, a.to_string())).collect());
                }
                let (priority, lowered) = annotations::capped(c.priority, self.max_priority);
                if lowered {
                    tracing::warn!(
                        service = c.name.get_ref().as_str(),
                        "its priority annotation asks {}, above [kubernetes] max_priority: {priority}",
                        c.priority
                    );
                }
                c.priority = priority;
                c
            }
            Err(bad) => {
                self.report(agent, &f, &bad);
                return Ok(false);
            }
        };
        let port = cfg.backend.port();
        let svc = Arc::new(Service::new(cfg));
        svc.set_pod_pid(Some(f.pid));
        if !agent.add_service(Arc::clone(&svc)) {
            return Ok(false);
        }
        tracing::info!(
            service = svc.name,
            pid = f.pid,
            container = f.container,
            "kubernetes: serving the pod"
        );
        if adopt {
            let (a, s) = (Arc::clone(agent), Arc::clone(&svc));
            let _ = tokio::task::spawn_blocking(move || {
                let rec = a.load_persisted().remove(&s.name).unwrap_or_default();
                a.adopt_one(&s, &rec);
                a.persist();
            })
            .await;
        }
        let endpoint = PodEndpoint { sandbox_pid: status.pid, pid: f.pid, ip, port };
        agent.watch_pod_sockets(&svc, &endpoint);
        Ok(true)
    }

    /// Stops serving a pod's service: its record closed, its processes
    /// left as they are (the runtime ends them with the pod).
    fn close(&self, agent: &Arc<Agent>, name: &str, why: &str) {
        let Some(svc) = agent.remove_service(name) else { return };
        let state = svc.lock().state;
        agent.journal(
            &svc,
            None,
            &format!("{why} (it was {}): its record is closed, nothing touched", state.as_str()),
        );
        agent.persist();
    }

    /// Each bad annotation of a pod, once: a journal note on the pod's
    /// process (an event of `/v1/events`), a count in the metrics.
    fn report(&mut self, agent: &Agent, f: &Found, bad: &[BadAnnotation]) {
        let pod = format!("{}/{}", f.pod.namespace, f.pod.name);
        let seen = self.reported.entry(f.pod.id.clone()).or_default();
        for b in bad {
            if !seen.insert(format!("{}={}", b.key, b.reason)) {
                continue;
            }
            agent
                .metrics()
                .annotation_errors
                .get_or_create(&PodKeyLabels {
                    pod: pod.clone(),
                    key: format!("{}{}", annotations::PREFIX, b.key),
                })
                .inc();
            let what = format!(
                "pod {pod}: annotation {}{}: {}; the pod is left alone",
                annotations::PREFIX,
                b.key,
                b.reason
            );
            tracing::warn!("kubernetes: {what}");
            if let Ok(t) = target::resolve(f.pid) {
                agent.note_on(&t, "kubernetes", &what);
            }
        }
    }
}
