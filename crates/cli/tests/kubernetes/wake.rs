//! Wake on request without a proxy, through a real containerd: the pod's
//! container is the fake model server (`fake-workload --http`) listening on
//! the pod's own IP and port, reached from the node over the CNI bridge as
//! any client reaches a pod; the agent watches that port in the pod's
//! network namespace. The node's probes come from the bridge's address (the
//! gateway, listed in `node_addresses`), clients from another address of
//! the node.

use super::*;
use std::io::Write;
use std::net::{SocketAddr, TcpStream};

const WAKES: &str = "gpusnap_agent_socket_wakes_total{service=";

/// The value of the metric line that starts with `prefix` (0 when none).
fn metric(agent: &Agent, prefix: &str) -> u64 {
    let (code, m) = agent.api("GET", "/metrics");
    assert_eq!(code, 200);
    m.lines().find(|l| l.starts_with(prefix)).and_then(|l| l.rsplit(' ').next()?.parse().ok()).unwrap_or(0)
}

/// The pod at `addr`: its server's answers and the node's two addresses.
struct Ends {
    addr: SocketAddr,
    ok: String,
    node: String,
    client: String,
}

fn ends(ctd: &Containerd, pod: &TestPod) -> Ends {
    Ends {
        addr: SocketAddr::new(ctd.pod_ip(pod), 8000),
        ok: format!("ok {} ", pod.pid),
        node: ctd.gateway().to_string(),
        client: ctd.client_address().to_string(),
    }
}

/// Waits for `agent` to log that it watches `service`'s port, and asserts
/// it did once: one watch of the port (each watch logs as it opens; called
/// again once the pod was woken, when a second watch would have opened).
fn watched_once(agent: &Agent, w: &World, service: &str) {
    let watching = |l: &&str| l.contains("watching the server's port") && l.contains(service);
    wait_for(LONG, || agent.log(w).lines().any(|l| watching(&l)));
    let log = agent.log(w);
    assert_eq!(log.lines().filter(watching).count(), 1, "{log}");
}

#[test]
fn an_idle_pod_is_woken_by_a_connection_to_its_ip_and_port_not_by_the_kubelets_probes() {
    let mut w = World::new(&[8192]);
    let Some(ctd) = Containerd::new() else { return };
    let pod =
        ctd.run_server_pod(&w, "test", "web", &enabled(&[("gpusnap.io/suspend-after", "1s")]), 256, 8000);
    let e = ends(&ctd, &pod);
    // Reached from the node through the pod network: the server's own answer.
    let body = http::get_kept_alive(&mut TcpStream::connect(e.addr).unwrap());
    assert!(body.starts_with(&e.ok) && body.ends_with(" 1"), "{body}");
    let mut agent = Agent::with(&w, &ctd, &format!("node_addresses = [\"{}\"]", e.node));
    agent.start(&mut w);
    watched_once(&agent, &w, "test.web");

    // Probes from the node every 100 ms, answered while it runs: they do not
    // keep it up.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let prober = {
        let (stop, node, addr) = (std::sync::Arc::clone(&stop), e.node.clone(), e.addr);
        std::thread::spawn(move || {
            let mut s = http::connect_from(&node, addr);
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                if write!(s, "GET / HTTP/1.1\r\nHost: x\r\n\r\n").is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    wait_for(LONG, || agent.state("test.web") == "suspended");
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    prober.join().unwrap();
    assert_eq!(driver_state(&w, pod.pid), "checkpointed");
    // A probe's request waits in the suspended server; nothing wakes. The
    // watch looks every millisecond: a second is a thousand looks.
    let mut probe = http::connect_from(&e.node, e.addr);
    write!(probe, "GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(agent.state("test.web"), "suspended");
    let wakes = &format!("{WAKES}\"test.web\"}}");
    assert_eq!(metric(&agent, wakes), 0);
    // The kubelet's exec probe, run in the pod's container: ready (it is
    // suspended, so wakeable), and nothing woken.
    let probe_state = || {
        let pid = pod.pid.to_string();
        let cmd = [env!("CARGO_BIN_EXE_gpusnap"), "--json", "probe", "--pid", &pid, "--port", "8000"];
        let (code, out) = ctd.exec(&pod, &cmd);
        assert_eq!(code, 0, "{out}");
        let v: serde_json::Value = serde_json::from_str(out.lines().last().unwrap_or("")).expect(&out);
        v["state"].as_str().unwrap_or_default().to_string()
    };
    assert_eq!(probe_state(), "suspended");
    assert_eq!(agent.state("test.web"), "suspended");
    assert_eq!(metric(&agent, wakes), 0);

    // A client's request: it waits in the server while the agent resumes
    // the pod, and is answered by the same process, its memory intact.
    let body = http::get_kept_alive(&mut http::connect_from(&e.client, e.addr));
    assert!(body.starts_with(&e.ok) && body.ends_with(" 1"), "{body}");
    wait_for(LONG, || agent.state("test.web") == "running");
    assert_eq!(driver_state(&w, pod.pid), "running");
    assert_eq!(probe_state(), "running");
    // One wake (one watch of the port), journaled as a resume by request.
    let events = agent.events();
    assert_eq!(metric(&agent, wakes), 1, "{events}");
    let woke = |l: &&str| l.contains("resume by request") && l.contains("(a new connection)");
    assert_eq!(events.lines().filter(woke).count(), 1, "{events}");
    watched_once(&agent, &w, "test.web");
    drop(probe);
}

#[test]
fn bytes_on_a_kept_alive_connection_wake_a_pod_also_once_a_killed_agent_is_back() {
    let mut w = World::new(&[8192]);
    let Some(ctd) = Containerd::new() else { return };
    let pod =
        ctd.run_server_pod(&w, "test", "kept", &enabled(&[("gpusnap.io/suspend-after", "1s")]), 256, 8000);
    let e = ends(&ctd, &pod);
    // A client's connection, kept alive since before the agent came.
    let mut kept = http::connect_from(&e.client, e.addr);
    assert!(http::get_kept_alive(&mut kept).starts_with(&e.ok));
    let mut agent = Agent::with(&w, &ctd, &format!("node_addresses = [\"{}\"]", e.node));
    agent.start(&mut w);
    let wakes = &format!("{WAKES}\"test.kept\"}}");
    let by_bytes = |events: &str| {
        events
            .lines()
            .filter(|l| l.contains("resume by request") && l.contains("(bytes on a kept-alive connection)"))
            .count()
    };

    // Open, with no request: it does not keep the pod up.
    wait_for(LONG, || agent.state("test.kept") == "suspended");
    assert_eq!(metric(&agent, wakes), 0);
    let body = http::get_kept_alive(&mut kept);
    assert!(body.starts_with(&e.ok) && body.ends_with(" 1"), "{body}");
    wait_for(LONG, || agent.state("test.kept") == "running");
    assert_eq!(metric(&agent, wakes), 1);
    assert_eq!(by_bytes(&agent.events()), 1);

    // Suspended again, the agent killed: the next one adopts the pod as
    // suspended, watches its port again, and the next request wakes it.
    wait_for(LONG, || agent.state("test.kept") == "suspended");
    agent.kill9(&mut w);
    agent.start(&mut w);
    wait_for(LONG, || agent.service("test.kept").is_some());
    assert_eq!(agent.state("test.kept"), "suspended");
    assert_eq!(driver_state(&w, pod.pid), "checkpointed");
    watched_once(&agent, &w, "test.kept");
    let body = http::get_kept_alive(&mut kept);
    assert!(body.starts_with(&e.ok) && body.ends_with(" 1"), "{body}");
    wait_for(LONG, || agent.state("test.kept") == "running");
    assert_eq!(driver_state(&w, pod.pid), "running");
    assert_eq!(metric(&agent, wakes), 1);
    let events = agent.events();
    assert_eq!(by_bytes(&events), 2, "{events}");
}
