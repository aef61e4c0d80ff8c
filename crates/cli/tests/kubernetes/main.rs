//! The agent on a Kubernetes node, against a real containerd driven as the
//! kubelet drives it (its CRI API): pods annotated `gpusnap.io/enabled`
//! become services, each pod's container a fake CUDA program on the fake
//! driver and NVML.

#[path = "../common/mod.rs"]
mod common;
mod containerd;
mod image;
mod probe;
mod wake;

use common::*;
use containerd::*;
use serde_json::Value;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

const LONG: Duration = Duration::from_secs(120);

/// An agent following a containerd's pods; its API socket and config.
struct Agent {
    socket: PathBuf,
    config: PathBuf,
    child: Option<usize>,
}

impl Agent {
    fn new(w: &World, ctd: &Containerd) -> Agent {
        Self::with(w, ctd, "")
    }

    /// An agent whose `[kubernetes]` table has `more` keys too.
    fn with(w: &World, ctd: &Containerd, more: &str) -> Agent {
        Self::at(w, ctd, w.tmp.path().join("agent.sock"), more)
    }

    /// An agent whose API socket is `socket`.
    fn at(w: &World, ctd: &Containerd, socket: PathBuf, more: &str) -> Agent {
        let config = w.tmp.path().join("agent.toml");
        let text = format!(
            "[agent]\nsocket = {:?}\ntick = \"50ms\"\n\n{}{more}\n",
            socket.display().to_string(),
            ctd.agent_config()
        );
        std::fs::write(&config, text).unwrap();
        Agent { socket, config, child: None }
    }

    fn start(&mut self, w: &mut World) {
        let _ = std::fs::remove_file(&self.socket);
        let cfg = self.config.display().to_string();
        self.child = Some(w.spawn_gpusnap(&["agent", "--config", &cfg]));
        let sock = self.socket.clone();
        wait_for(LONG, || UnixStream::connect(&sock).is_ok());
    }

    fn kill9(&mut self, w: &mut World) {
        let n = self.child.take().unwrap();
        w.children[n].kill();
        w.children[n].wait();
    }

    fn api(&self, method: &str, path: &str) -> (u16, String) {
        http::split(&http::unix_request(&self.socket, method, path, LONG).0)
    }

    /// The service named `name`, if the agent serves it.
    fn service(&self, name: &str) -> Option<Value> {
        let (code, body) = self.api("GET", "/v1/services");
        assert_eq!(code, 200, "{body}");
        let all: Vec<Value> = serde_json::from_str(&body).unwrap();
        all.into_iter().find(|s| s["name"] == name)
    }

    fn state(&self, name: &str) -> String {
        self.service(name).map(|s| s["state"].as_str().unwrap_or("").to_string()).unwrap_or_default()
    }

    fn act(&self, name: &str, action: &str) {
        let (code, body) = self.api("POST", &format!("/v1/services/{name}/{action}"));
        assert_eq!(code, 200, "{action} {name}: {body}");
    }

    /// What the agent has logged so far.
    fn log(&self, w: &World) -> String {
        let n = self.child.expect("a started agent");
        std::fs::read_to_string(w.tmp.path().join(format!("gpusnap-{n}.err"))).unwrap_or_default()
    }

    /// The journal's entries so far (as `/v1/events?follow=false` gives them).
    fn events(&self) -> String {
        let (code, body) = self.api("GET", "/v1/events?follow=false&after=0");
        assert_eq!(code, 200, "{body}");
        body
    }
}

fn enabled(extra: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
    let mut a = vec![("gpusnap.io/enabled", "true"), ("gpusnap.io/port", "8000")];
    a.extend_from_slice(extra);
    a
}

fn driver_state(w: &World, pid: i32) -> String {
    let r = w.json(&["state", &pid.to_string()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    r.json()["state"].as_str().unwrap().to_string()
}

#[test]
fn pods_annotated_enabled_are_served_others_ignored_and_new_ones_followed() {
    let mut w = World::new(&[8192]);
    let Some(ctd) = Containerd::new() else { return };
    let served = ctd.run_pod(&w, "test", "served", &enabled(&[("gpusnap.io/suspend-after", "never")]), 256);
    let plain = ctd.run_pod(&w, "test", "plain", &[("gpusnap.io/enabled", "false")], 256);
    let mut agent = Agent::new(&w, &ctd);
    agent.start(&mut w);
    wait_for(LONG, || agent.state("test.served") == "running");
    let s = agent.service("test.served").unwrap();
    assert_eq!(s["pid"], served.pid);
    assert_eq!(s["pod"], "test/served");
    assert!(agent.service("test.plain").is_none(), "a pod without gpusnap.io/enabled=true is not served");
    // A pod that comes while the agent runs is served at the next poll.
    let later = ctd.run_pod(&w, "test", "later", &enabled(&[("gpusnap.io/suspend-after", "never")]), 256);
    wait_for(LONG, || agent.state("test.later") == "running");
    assert_eq!(agent.service("test.later").unwrap()["pid"], later.pid);
    // Nothing was done to the processes: all still run on the GPU.
    for p in [&served, &plain, &later] {
        assert_eq!(driver_state(&w, p.pid), "running");
        assert_progressing_at(&p.status);
    }
}

#[test]
fn bad_annotations_are_reported_by_pod_and_key_and_the_pod_left_alone() {
    let mut w = World::new(&[8192]);
    let Some(ctd) = Containerd::new() else { return };
    let bad = ctd.run_pod(
        &w,
        "test",
        "bad",
        &[("gpusnap.io/enabled", "true"), ("gpusnap.io/port", "http"), ("gpusnap.io/engine", "tgi")],
        256,
    );
    let mut agent = Agent::new(&w, &ctd);
    agent.start(&mut w);
    let events = || agent.events();
    wait_for(LONG, || {
        events().contains("annotation gpusnap.io/port") && events().contains("annotation gpusnap.io/engine")
    });
    let (code, metrics) = agent.api("GET", "/metrics");
    assert_eq!(code, 200);
    for key in ["port", "engine"] {
        let line = format!(
            "gpusnap_agent_kubernetes_annotation_errors_total{{pod=\"test/bad\",key=\"gpusnap.io/{key}\"}} 1"
        );
        assert!(metrics.contains(&line), "{line} not in:\n{metrics}");
    }
    assert!(agent.service("test.bad").is_none());
    assert_eq!(driver_state(&w, bad.pid), "running");
    assert_progressing_at(&bad.status);
}

#[test]
fn a_pods_cuda_process_is_suspended_idle_and_through_the_api_and_resumed() {
    let mut w = World::new(&[8192]);
    let Some(ctd) = Containerd::new() else { return };
    let api = ctd.run_pod(&w, "test", "api", &enabled(&[("gpusnap.io/suspend-after", "never")]), 512);
    let idle = ctd.run_pod(&w, "test", "idle", &enabled(&[("gpusnap.io/suspend-after", "1s")]), 512);
    let mut agent = Agent::new(&w, &ctd);
    agent.start(&mut w);
    wait_for(LONG, || agent.state("test.api") == "running");
    // Idle for its suspend-after: suspended by the policy.
    wait_for(LONG, || agent.state("test.idle") == "suspended");
    assert_eq!(driver_state(&w, idle.pid), "checkpointed");

    agent.act("test.api", "suspend");
    assert_eq!(agent.state("test.api"), "suspended");
    assert_eq!(driver_state(&w, api.pid), "checkpointed");
    agent.act("test.api", "resume");
    assert_eq!(agent.state("test.api"), "running");
    assert_eq!(driver_state(&w, api.pid), "running");
    assert_progressing_at(&api.status);
}

#[test]
fn a_pod_deleted_while_suspended_has_its_record_closed_and_nothing_touched() {
    let mut w = World::new(&[8192]);
    let Some(ctd) = Containerd::new() else { return };
    let pod = ctd.run_pod(&w, "test", "gone", &enabled(&[("gpusnap.io/suspend-after", "never")]), 256);
    let mut agent = Agent::new(&w, &ctd);
    agent.start(&mut w);
    wait_for(LONG, || agent.state("test.gone") == "running");
    agent.act("test.gone", "suspend");
    assert!(agent_records(&w).get("test.gone").is_some());
    ctd.remove_pod(&pod.id);
    wait_for(LONG, || agent.service("test.gone").is_none());
    wait_for(LONG, || agent_records(&w).get("test.gone").is_none());
    // Journaled as it was when let go: suspended, or exited if the policy
    // saw the runtime end its process first.
    let events = agent.events();
    assert!(events.contains("its pod is gone (it was "), "{events}");
    assert!(events.contains("): its record is closed, nothing touched"), "{events}");
    // The agent goes on: a new pod of the same name is a new service.
    let again = ctd.run_pod(&w, "test", "gone", &enabled(&[("gpusnap.io/suspend-after", "never")]), 256);
    wait_for(LONG, || {
        agent.service("test.gone").is_some_and(|s| s["pid"] == again.pid && s["state"] == "running")
    });
}

#[test]
fn a_killed_agent_adopts_the_pods_as_they_were() {
    let mut w = World::new(&[8192]);
    let Some(ctd) = Containerd::new() else { return };
    let never = [("gpusnap.io/suspend-after", "never")];
    let asleep = ctd.run_pod(&w, "test", "asleep", &enabled(&never), 512);
    let awake = ctd.run_pod(&w, "test", "awake", &enabled(&never), 512);
    let mut agent = Agent::new(&w, &ctd);
    agent.start(&mut w);
    wait_for(LONG, || agent.state("test.asleep") == "running" && agent.state("test.awake") == "running");
    agent.act("test.asleep", "suspend");
    agent.kill9(&mut w);
    agent.start(&mut w);
    wait_for(LONG, || agent.service("test.asleep").is_some() && agent.service("test.awake").is_some());
    assert_eq!(agent.state("test.asleep"), "suspended");
    assert_eq!(agent.state("test.awake"), "running");
    assert_eq!(driver_state(&w, asleep.pid), "checkpointed");
    agent.act("test.asleep", "resume");
    assert_eq!(driver_state(&w, asleep.pid), "running");
    for p in [&asleep, &awake] {
        assert_progressing_at(&p.status);
    }
}

#[test]
fn a_pod_resumed_on_a_full_gpu_takes_the_place_of_an_idle_one() {
    let mut w = World::new(&[1024]);
    let Some(ctd) = Containerd::new() else { return };
    let never = [("gpusnap.io/suspend-after", "never")];
    let first = ctd.run_pod(&w, "test", "first", &enabled(&never), 600);
    let mut agent = Agent::new(&w, &ctd);
    agent.start(&mut w);
    wait_for(LONG, || agent.state("test.first") == "running");
    agent.act("test.first", "suspend");
    // The GPU holds one of them: the second runs in the first's room.
    let second = ctd.run_pod(&w, "test", "second", &enabled(&never), 600);
    wait_for(LONG, || agent.state("test.second") == "running");
    agent.act("test.first", "resume");
    assert_eq!(agent.state("test.first"), "running");
    assert_eq!(agent.state("test.second"), "suspended");
    assert_eq!(driver_state(&w, first.pid), "running");
    assert_eq!(driver_state(&w, second.pid), "checkpointed");
    assert_progressing_at(&first.status);
}

#[test]
fn a_restarted_container_is_adopted_anew() {
    let mut w = World::new(&[8192]);
    let Some(ctd) = Containerd::new() else { return };
    let mut pod =
        ctd.run_pod(&w, "test", "restarts", &enabled(&[("gpusnap.io/suspend-after", "never")]), 256);
    let mut agent = Agent::new(&w, &ctd);
    agent.start(&mut w);
    wait_for(LONG, || agent.state("test.restarts") == "running");
    let old = pod.pid;
    ctd.restart_container(&mut pod);
    assert_ne!(old, pod.pid);
    // Its old process ended (exited), the runtime says which is new: adopted.
    wait_for(LONG, || {
        agent.service("test.restarts").is_some_and(|s| s["pid"] == pod.pid && s["state"] == "running")
    });
    agent.act("test.restarts", "suspend");
    assert_eq!(driver_state(&w, pod.pid), "checkpointed");
    agent.act("test.restarts", "resume");
    assert_progressing_at(&pod.status);
}

/// What one poll of the agent asks the runtime, timed with N pods on the
/// node: `ListPodSandbox` and `ListContainers` every poll, and a verbose
/// `ContainerStatus` once per container when it is first seen. Not a check:
/// bench/cpu/kubernetes-poll.sh runs it and prints the table
/// (`cargo test ... -- --ignored`).
#[test]
#[ignore]
fn bench_cri_poll() {
    let Some(ctd) = Containerd::new() else { return };
    let rounds: usize = std::env::var("ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(20);
    println!("| pods | a poll: ListPodSandbox + ListContainers, ms (median) | (max) | first sight: ContainerStatus of every pod, ms (median) |");
    println!("|---|---|---|---|");
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let ms = |t: std::time::Instant| t.elapsed().as_secs_f64() * 1e3;
    let mut started = 0;
    for n in [1usize, 8, 32] {
        while started < n {
            ctd.run_sleeper("bench", &format!("pod-{started}"));
            started += 1;
        }
        let (mut poll, mut first) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            let t = std::time::Instant::now();
            let pods = ctd.rt.block_on(ctd.cri.pods()).unwrap();
            let all = ctd.rt.block_on(ctd.cri.containers(None)).unwrap();
            poll.push(ms(t));
            assert_eq!(pods.len(), n);
            let t = std::time::Instant::now();
            for c in all.iter().filter(|c| c.running) {
                ctd.rt.block_on(ctd.cri.container_status(&c.id)).unwrap();
            }
            first.push(ms(t));
        }
        let max = poll.iter().cloned().fold(0.0, f64::max);
        println!("| {n} | {:.2} | {:.2} | {:.2} |", median(&mut poll), max, median(&mut first));
    }
}
