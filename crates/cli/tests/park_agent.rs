//! The agent's cheapest tier: a server it started with fast swap is parked
//! when idle (its memory in pinned host memory, its CUDA context on the
//! GPU) and a request brings it back; an eviction parks before it
//! suspends; `min_resident` keeps a model on the GPU under alternating
//! demand, so that two clients are served in turns rather than one swap
//! per request.

mod common;

use common::*;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

const LONG: Duration = Duration::from_secs(60);

struct Agent {
    w: World,
    socket: PathBuf,
    config: PathBuf,
    ports: Vec<u16>,
    agent: usize,
    _sockdir: tempfile::TempDir,
}

impl Agent {
    /// An agent on one fake GPU of `gpu_mib` with services (name, fake
    /// workload arguments, more TOML lines), fast swap on (the default).
    fn start(w: World, svcs: &[(&str, &str, &str)]) -> Self {
        Self::start_ticking(w, "100ms", svcs)
    }

    /// As [`Agent::start`], with the policy's tick every `tick`.
    fn start_ticking(w: World, tick: &str, svcs: &[(&str, &str, &str)]) -> Self {
        let sockdir = tempfile::Builder::new().prefix("gpusnap-park-agent").tempdir_in("/tmp").unwrap();
        let socket = sockdir.path().join("agent.sock");
        let mut text = format!("[agent]\nsocket = {:?}\ntick = {tick:?}\n", socket.display().to_string());
        let mut ports = Vec::new();
        for (name, args, extra) in svcs {
            let (listen, backend) = (free_port(), free_port());
            ports.push(listen);
            let args: String = args.split_whitespace().map(|a| format!(", {a:?}")).collect();
            text += &format!(
                "\n[[service]]\nname = \"{name}\"\nlisten = \"127.0.0.1:{listen}\"\nbackend = \"127.0.0.1:{backend}\"\n\
                 command = [{:?}, \"--gpu\", \"0\", \"--http\", \"{backend}\"{args}]\nmargin = \"0\"\n\
                 wake_timeout = \"120s\"\n{extra}\n",
                fake_workload_bin().display().to_string(),
            );
        }
        let config = w.tmp.path().join("agent.toml");
        std::fs::write(&config, text).unwrap();
        let mut a = Self { w, socket, config, ports, agent: 0, _sockdir: sockdir };
        a.spawn();
        a
    }

    fn spawn(&mut self) {
        let _ = std::fs::remove_file(&self.socket);
        self.agent = self.w.spawn_gpusnap(&["agent", "--config", &self.config.display().to_string()]);
        let sock = self.socket.clone();
        wait_for(LONG, || UnixStream::connect(&sock).is_ok());
    }

    /// kill -9 of the agent, and a new one on the same configuration.
    fn kill9_and_restart(&mut self) {
        self.w.children[self.agent].kill();
        self.w.children[self.agent].wait();
        self.spawn();
    }

    fn notes(&self, pid: i64) -> Vec<String> {
        let h = self.w.json(&["history", &pid.to_string()]).json();
        h["events"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["op"] == "agent")
            .filter_map(|e| e["detail"].as_str().map(str::to_string))
            .collect()
    }

    fn locks(&self, pid: i64) -> usize {
        self.w.calls_on(pid as i32).iter().filter(|c| c.starts_with("lock")).count()
    }
}

impl AgentClient for Agent {
    fn api(&self, method: &str, path: &str) -> (u16, String) {
        let (text, read) = http::unix_request(&self.socket, method, path, LONG);
        read.unwrap();
        http::split_dechunked(&text)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.w.tmp.path().join(format!("gpusnap-{}.err", self.agent)))
            .unwrap_or_default()
    }

    fn world(&mut self) -> &mut World {
        &mut self.w
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.w.children[self.agent].kill();
        adopt_recorded_services(&mut self.w);
    }
}

/// One request through the agent's proxy; the server's answer, checked:
/// `ok PID ITERATION INTACT`.
fn ask(port: u16, pid: i64) {
    let text = http::tcp_get(port, "/", LONG).unwrap();
    let (code, body) = http::split_dechunked(&text);
    assert_eq!(code, 200, "{text:?}");
    let f: Vec<&str> = body.split_whitespace().collect();
    assert_eq!((f[0], f[1], f[3]), ("ok", pid.to_string().as_str(), "1"), "{body}");
}

/// The sum of the samples of `name` whose labels include each of `labels`.
fn metric(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && labels.iter().all(|x| l.contains(x)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn an_idle_server_is_parked_and_a_request_brings_it_back() {
    let w = World::with_config(&[1000], serde_json::json!({ "context_mib": 50 }));
    let mut a = Agent::start(w, &[("m", "--mib 300", "suspend_after = \"700ms\"")]);
    let s = a.wait_state("m", "running");
    let pid = s["pid"].as_i64().unwrap();
    ask(a.ports[0], pid);
    a.wait_state("m", "parked");
    // Its context stays on the GPU; the driver was not asked to lock it.
    let st = a.w.json(&["state", &pid.to_string()]).json();
    assert_eq!(st["state"], "parked", "{st}");
    assert_eq!(st["parked"]["residual_bytes"].as_u64(), Some(50 * MIB), "{st}");
    assert_eq!(st["parked"]["host_bytes"].as_u64(), Some(300 * MIB), "{st}");
    assert_eq!(a.locks(pid), 0);
    let (code, text) = a.api("GET", "/metrics");
    assert_eq!(code, 200);
    assert_eq!(metric(&text, "gpusnap_agent_services{", &["state=\"parked\""]), 1.0, "{text}");
    let parks = metric(&text, "gpusnap_agent_transitions_total{", &["kind=\"park\"", "result=\"ok\""]);
    assert!(parks >= 1.0, "{text}");
    assert!(metric(&text, "gpusnap_agent_host_memory_bytes", &[]) >= (300 * MIB) as f64, "{text}");
    assert_eq!(metric(&text, "gpusnap_agent_fast_swap_bind_failures_total", &[]), 0.0, "{text}");
    assert!(a.notes(pid).iter().any(|n| n.contains("park: idle for")), "{:?}", a.notes(pid));

    // A request brings it back, its data intact.
    ask(a.ports[0], pid);
    let s = a.service("m");
    assert_eq!(s["state"], "running", "{s}");
    assert_eq!(a.w.json(&["state", &pid.to_string()]).json()["state"], "running");
    assert_eq!(a.locks(pid), 0, "a park and an unpark, never the driver's lock");
    // The API parks it too.
    let (code, body) = a.api("POST", "/v1/services/m/park");
    assert_eq!(code, 200, "{body}");
    a.wait_state("m", "parked");
    ask(a.ports[0], pid);
}

/// Room for a cold start: the running server is parked, which is enough
/// (its residual is small); its request later parks the other one in turn.
/// Nothing is suspended.
#[test]
fn an_eviction_parks_and_parking_is_enough_when_the_residual_leaves_room() {
    let w = World::new(&[1000]);
    let extra = "suspend_after = \"1h\"\nmin_resident = \"0s\"\ngpu_memory = \"500MiB\"";
    let mut a = Agent::start(
        w,
        &[
            ("a", "--mib 500 --managed-mib 100", extra),
            ("b", "--mib 500", &format!("{extra}\nstart = \"on-demand\"")),
        ],
    );
    let pa = a.wait_state("a", "running")["pid"].as_i64().unwrap();
    // b's first request starts it: a is parked for it.
    let tb = http::tcp_get(a.ports[1], "/", LONG).unwrap();
    assert_eq!(http::split_dechunked(&tb).0, 200, "{tb}");
    let pb = a.wait_state("b", "running")["pid"].as_i64().unwrap();
    assert_eq!(a.service("a")["state"], "parked");
    // a's request: b is parked for it, a comes back.
    ask(a.ports[0], pa);
    assert_eq!(a.service("b")["state"], "parked");
    ask(a.ports[1], pb);
    assert_eq!(a.service("a")["state"], "parked");
    assert_eq!((a.locks(pa), a.locks(pb)), (0, 0), "nothing was suspended");
    assert!(a.notes(pa).iter().any(|n| n.contains("park: evicted to make room for b")), "{:?}", a.notes(pa));
}

/// The parked server's residual is the room needed: parked first, then
/// suspended in full.
#[test]
fn an_eviction_suspends_a_parked_server_only_when_its_residual_is_the_room_needed() {
    let w = World::new(&[1000]);
    let extra = "suspend_after = \"1h\"\nmin_resident = \"0s\"\ngpu_memory = \"600MiB\"";
    let mut a = Agent::start(
        w,
        &[
            ("a", "--mib 200 --managed-mib 500", extra),
            ("b", "--mib 600", &format!("{extra}\nstart = \"on-demand\"")),
        ],
    );
    let pa = a.wait_state("a", "running")["pid"].as_i64().unwrap();
    let tb = http::tcp_get(a.ports[1], "/", LONG).unwrap();
    assert_eq!(http::split_dechunked(&tb).0, 200, "{tb}");
    let pb = a.wait_state("b", "running")["pid"].as_i64().unwrap();
    assert_eq!(a.service("a")["state"], "suspended");
    let notes = a.notes(pa);
    let park = notes.iter().position(|n| n.contains("park: evicted"));
    let suspend = notes.iter().position(|n| n.contains("suspend: evicted"));
    assert!(park.is_some() && suspend.is_some() && park < suspend, "{notes:?}");
    assert_eq!(a.locks(pa), 1);
    // a comes back from suspended (b is parked for it) with its data.
    ask(a.ports[0], pa);
    assert_eq!(a.service("b")["state"], "parked");
    assert_eq!(a.locks(pb), 0);
}

/// Two clients alternating between two models that cannot both be on the
/// GPU: with `min_resident` a model stays while its client's requests come,
/// and the other's wait their turn; each client's requests are then served
/// in one turn, not one swap each.
#[test]
fn min_resident_serves_alternating_clients_in_turns() {
    let w = World::new(&[1000]);
    let extra = "suspend_after = \"1h\"\nmin_resident = \"20s\"\ngpu_memory = \"600MiB\"";
    let mut a = Agent::start(
        w,
        &[("a", "--mib 600", extra), ("b", "--mib 600", &format!("{extra}\nstart = \"on-demand\""))],
    );
    let pa = a.wait_state("a", "running")["pid"].as_i64().unwrap();
    let tb = http::tcp_get(a.ports[1], "/", LONG).unwrap();
    assert_eq!(http::split_dechunked(&tb).0, 200, "{tb}");
    let pb = a.wait_state("b", "running")["pid"].as_i64().unwrap();
    let evictions = |a: &Agent| {
        [pa, pb]
            .iter()
            .map(|p| a.notes(*p).iter().filter(|n| n.contains("evicted to make room")).count())
            .sum::<usize>()
    };
    let before = evictions(&a);
    let (port_a, port_b) = (a.ports[0], a.ports[1]);
    let client = |port: u16, pid: i64| {
        std::thread::spawn(move || {
            for _ in 0..5 {
                ask(port, pid);
            }
        })
    };
    let ca = client(port_a, pa);
    let cb = client(port_b, pb);
    ca.join().unwrap();
    cb.join().unwrap();
    let swaps = evictions(&a) - before;
    assert!(swaps <= 2, "{swaps} swaps for 10 alternating requests:\n{}", a.log());
}

/// An agent killed while its library parks a server: the library finishes
/// on its own, the next agent adopts the server as parked, and a request
/// brings it back intact.
#[test]
fn an_agent_killed_while_parking_adopts_the_server_parked() {
    // Copies at 0.1 GB/s: moving 512 MiB takes seconds.
    let w = World::with_config(&[2000], serde_json::json!({ "copy_gbps": 0.1 }));
    let mut a = Agent::start(w, &[("m", "--mib 256 --extra-allocs 1", "suspend_after = \"500ms\"")]);
    let pid = a.wait_state("m", "running")["pid"].as_i64().unwrap();
    let phase = |a: &Agent| {
        a.w.json(&["state", &pid.to_string()]).json()["fast_swap"]["phase"].as_str().unwrap_or("").to_string()
    };
    wait_for(LONG, || phase(&a) == "offloading");
    a.kill9_and_restart();
    let s = a.wait_state("m", "parked");
    assert_eq!(a.w.json(&["state", &pid.to_string()]).json()["state"], "parked", "{s}");
    assert_eq!(a.locks(pid), 0);
    ask(a.ports[0], pid);
    assert_eq!(a.service("m")["state"], "running");
}

/// A parked server killed with SIGKILL (nothing sees it coming) while
/// requests keep arriving: each request's unpark finds no process, and the
/// agent takes it for dead and starts it again, instead of going back to
/// parked and resuming it anew for every request, forever, between two
/// looks of the policy's tick.
#[test]
fn a_parked_server_killed_under_steady_requests_is_restarted_not_resumed_forever() {
    let w = World::new(&[1000]);
    let mut a = Agent::start_ticking(w, "2s", &[("m", "--mib 300", "suspend_after = \"1h\"")]);
    let pid = a.wait_state("m", "running")["pid"].as_i64().unwrap();
    let (code, body) = a.api("POST", "/v1/services/m/park");
    assert_eq!(code, 200, "{body}");
    a.wait_state("m", "parked");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL)
        .unwrap();
    // Requests back to back, as a busy front door sends them: refusals
    // while it restarts, then an answer from the new process.
    let port = a.ports[0];
    let end = std::time::Instant::now() + LONG;
    let answered = loop {
        assert!(std::time::Instant::now() < end, "never answered again: {}", a.service("m"));
        if let Ok(text) = http::tcp_get(port, "/", Duration::from_secs(15)) {
            let (code, body) = http::split_dechunked(&text);
            if code == 200 {
                break body;
            }
        }
    };
    let new = a.service("m")["pid"].as_i64().unwrap();
    assert_ne!(new, pid);
    assert!(answered.starts_with(&format!("ok {new} ")), "{answered}");
    assert!(a.notes(pid).iter().any(|n| n.contains("ended")), "{:?}", a.notes(pid));
}

/// A server started with fast swap whose library cannot bind its control
/// socket (its name taken by another program first) is not silently a
/// server without fast swap: the journal says so and
/// `gpusnap_agent_fast_swap_bind_failures_total` counts it.
#[test]
fn a_fast_swap_channel_that_cannot_bind_is_journaled_and_counted() {
    use std::os::linux::net::SocketAddrExt;
    let name = format!("gpusnap-swap-taken-agent-{}", std::process::id());
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let taken = std::os::unix::net::UnixListener::bind_addr(&addr).unwrap();
    let env = format!("environment = {{ GPUSNAP_FAST_SWAP_NAME = \"{name}\" }}");
    let w = World::new(&[1000]);
    let mut a = Agent::start(w, &[("m", "--mib 300", &env)]);
    let pid = a.wait_state("m", "running")["pid"].as_i64().unwrap();
    ask(a.ports[0], pid);
    wait_for(LONG, || a.notes(pid).iter().any(|n| n.contains("fast swap is off")));
    let note = a.notes(pid).into_iter().find(|n| n.contains("fast swap is off")).unwrap();
    assert!(note.contains(&format!("process {pid}")) && note.contains("could not bind"), "{note}");
    let (code, text) = a.api("GET", "/metrics");
    assert_eq!(code, 200);
    let n = metric(&text, "gpusnap_agent_fast_swap_bind_failures_total{", &["service=\"m\""]);
    assert_eq!(n, 1.0, "{text}");
    assert!(text.contains("# HELP gpusnap_agent_fast_swap_bind_failures_total "), "{text}");
    drop(taken);
}
