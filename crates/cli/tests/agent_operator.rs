//! What an operator meets first with the agent: restarting a service on a
//! full GPU, a restart's metrics, evictions that take no more than they
//! need, an on-demand service whose start fails, a config changed under a
//! running service, and `gpusnap services` finding the agent by its config.

mod common;

use common::*;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

const LONG: Duration = Duration::from_secs(60);

/// A service of the test: its name, the MiB its fake server takes on GPU 0,
/// and more TOML lines.
struct Svc<'a> {
    name: &'a str,
    mib: u64,
    extra: &'a str,
}

struct Node {
    w: World,
    socket: PathBuf,
    config: PathBuf,
    ports: Vec<(u16, u16)>,
    agent: Option<usize>,
    _sockdir: tempfile::TempDir,
}

impl Node {
    /// An agent on one fake GPU of `gpu_mib` with `svcs` (fake servers it
    /// starts, `park = false`, `min_resident = "0s"`, `margin = "0"` unless
    /// their lines say otherwise), not started yet.
    fn unstarted(gpu_mib: u64, agent_extra: &str, svcs: &[Svc]) -> Self {
        let w = World::new(&[gpu_mib]);
        let sockdir = tempfile::Builder::new().prefix("gpusnap-agent-op").tempdir_in("/tmp").unwrap();
        let socket = sockdir.path().join("agent.sock");
        let mut text = format!(
            "[agent]\nsocket = {:?}\ntick = \"100ms\"\n{agent_extra}\n",
            socket.display().to_string()
        );
        let mut ports = Vec::new();
        for s in svcs {
            let (listen, backend) = (free_port(), free_port());
            ports.push((listen, backend));
            let mut lines = String::new();
            for (key, default) in [
                ("park", "park = false"),
                ("min_resident", "min_resident = \"0s\""),
                ("margin", "margin = \"0\""),
            ] {
                if !s.extra.contains(&format!("{key} =")) {
                    lines += default;
                    lines += "\n";
                }
            }
            text += &format!(
                "\n[[service]]\nname = \"{}\"\nlisten = \"127.0.0.1:{listen}\"\nbackend = \"127.0.0.1:{backend}\"\n\
                 command = [{:?}, \"--mib\", \"{}\", \"--gpu\", \"0\", \"--http\", \"{backend}\"]\n{lines}{}\n",
                s.name,
                fake_workload_bin().display().to_string(),
                s.mib,
                s.extra,
            );
        }
        let config = w.tmp.path().join("agent.toml");
        std::fs::write(&config, text).unwrap();
        Self { w, socket, config, ports, agent: None, _sockdir: sockdir }
    }

    fn start(gpu_mib: u64, agent_extra: &str, svcs: &[Svc]) -> Self {
        let mut n = Self::unstarted(gpu_mib, agent_extra, svcs);
        n.spawn();
        n
    }

    fn spawn(&mut self) {
        let _ = std::fs::remove_file(&self.socket);
        let cfg = self.config.display().to_string();
        self.agent = Some(self.w.spawn_gpusnap(&["agent", "--config", &cfg]));
        let sock = self.socket.clone();
        wait_for(LONG, || UnixStream::connect(&sock).is_ok());
    }

    fn kill9(&mut self) {
        let n = self.agent.take().unwrap();
        self.w.children[n].kill();
        self.w.children[n].wait();
    }

    fn port(&self, i: usize) -> u16 {
        self.ports[i].0
    }

    fn metrics(&self) -> String {
        let (code, body) = self.api("GET", "/metrics");
        assert_eq!(code, 200, "{body}");
        body
    }

    fn state(&self, name: &str) -> String {
        self.service(name)["state"].as_str().unwrap_or("").to_string()
    }

    /// Waits until one of `a`, `b` runs with its memory and the other is
    /// suspended; returns (running, suspended).
    fn settle_one_running(&mut self, a: &str, b: &str) -> (String, String) {
        let end = Instant::now() + LONG;
        loop {
            let (sa, sb) = (self.state(a), self.state(b));
            match (sa.as_str(), sb.as_str()) {
                ("running", "suspended") => break (a.to_string(), b.to_string()),
                ("suspended", "running") => break (b.to_string(), a.to_string()),
                _ => {}
            }
            assert!(Instant::now() < end, "never settled: {a} {sa}, {b} {sb}\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl AgentClient for Node {
    fn api(&self, method: &str, path: &str) -> (u16, String) {
        let (text, read) = http::unix_request(&self.socket, method, path, LONG);
        read.unwrap();
        http::split_dechunked(&text)
    }

    fn log(&self) -> String {
        let n = self.agent.unwrap_or(0);
        std::fs::read_to_string(self.w.tmp.path().join(format!("gpusnap-{n}.err"))).unwrap_or_default()
    }

    fn world(&mut self) -> &mut World {
        &mut self.w
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(n) = self.agent.take() {
            self.w.children[n].kill();
        }
        adopt_recorded_services(&mut self.w);
    }
}

/// The sum of the samples of `name` whose labels include each of `labels`.
fn metric(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && labels.iter().all(|x| l.contains(x)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn get(port: u16) -> (u16, String) {
    match http::tcp_get(port, "/", LONG) {
        Ok(text) => http::split_dechunked(&text),
        Err(e) => (0, e.to_string()),
    }
}

const SIZED: &str = "suspend_after = \"1h\"\nwake_timeout = \"60s\"\ngpu_memory = \"600MiB\"";

#[test]
fn a_restart_of_a_suspended_service_on_a_full_gpu_makes_room_as_a_start_does() {
    // 1000 MiB, two servers of 600: only one fits.
    let mut n = Node::start(
        1000,
        "",
        &[Svc { name: "a", mib: 600, extra: SIZED }, Svc { name: "b", mib: 600, extra: SIZED }],
    );
    let (running, suspended) = n.settle_one_running("a", "b");
    let old = n.wait_state(&suspended, "suspended")["pid"].as_i64().unwrap();
    let (code, body) = n.api("POST", &format!("/v1/services/{suspended}/restart"));
    assert_eq!(code, 200, "{body}\n{}", n.log());
    let v = n.wait_state(&suspended, "running");
    assert_ne!(v["pid"].as_i64(), Some(old), "{v}");
    n.wait_state(&running, "suspended");
    let i = if suspended == "a" { 0 } else { 1 };
    let (code, body) = get(n.port(i));
    assert_eq!(code, 200, "{body}");
    // The restart took its time, and says so.
    let m = n.metrics();
    let sum = metric(&m, "gpusnap_agent_transition_duration_seconds_sum", &["kind=\"restart\""]);
    assert!(sum > 0.0, "{m}");
}

#[test]
fn an_agent_restarted_on_a_changed_command_or_fast_swap_reports_the_drift_until_a_restart() {
    let extra = "suspend_after = \"1h\"\npark = true";
    let mut n = Node::start(4000, "", &[Svc { name: "a", mib: 100, extra }]);
    let pid = n.wait_state("a", "running")["pid"].as_i64().unwrap();
    assert!(n.service("a")["config_drift"].is_null());
    assert_eq!(n.service("a")["next"]["action"], "park");
    n.kill9();
    let text = std::fs::read_to_string(&n.config).unwrap();
    let changed = text.replace("\"--mib\", \"100\"", "\"--mib\", \"120\"") + "fast_swap = false\n";
    assert_ne!(text, changed);
    std::fs::write(&n.config, changed).unwrap();
    n.spawn();
    let v = n.wait_state("a", "running");
    // The same process, found again, and said not to match its config.
    assert_eq!(v["pid"].as_i64(), Some(pid), "{v}");
    let drift = v["config_drift"].as_str().unwrap_or_else(|| panic!("no drift reported: {v}"));
    assert!(drift.contains("command") && drift.contains("fast_swap"), "{drift}");
    // It runs with fast swap still: it is parked as it was started.
    assert_eq!(v["next"]["action"], "park", "{v}");
    assert!(n.log().contains("the config changed since its process was started"), "{}", n.log());
    let m = n.metrics();
    assert_eq!(metric(&m, "gpusnap_agent_service_config_drift", &["service=\"a\""]), 1.0, "{m}");
    let r = n.w.gpusnap(&["services", "--socket", n.socket.to_str().unwrap()]);
    assert!(r.stdout.contains("config drift: the config changed"), "{}{}", r.stdout, r.stderr);
    // A restart starts it as the config says.
    let (code, body) = n.api("POST", "/v1/services/a/restart");
    assert_eq!(code, 200, "{body}");
    let v = n.wait_state("a", "running");
    assert_ne!(v["pid"].as_i64(), Some(pid), "{v}");
    assert!(v["config_drift"].is_null(), "{v}");
    assert_eq!(v["next"]["action"], "suspend", "{v}");
    let m = n.metrics();
    assert_eq!(metric(&m, "gpusnap_agent_service_config_drift", &["service=\"a\""]), 0.0, "{m}");
}

#[test]
fn a_cold_start_evicts_one_service_when_one_frees_enough() {
    // 1024 MiB: a and b (200 each) and c (550) run, 74 free; d needs 614.
    // c alone frees enough; a and b together do not, and a is the least
    // recently used.
    let idle = "suspend_after = \"1h\"\nfast_swap = false";
    let mut n = Node::start(1024, "", &[
        Svc { name: "a", mib: 200, extra: idle },
        Svc { name: "b", mib: 200, extra: idle },
        Svc { name: "c", mib: 550, extra: idle },
        Svc {
            name: "d",
            mib: 614,
            extra: "suspend_after = \"1h\"\nfast_swap = false\nstart = \"on-demand\"\ngpu_memory = \"614MiB\"\n\
                    wake_timeout = \"60s\"",
        },
    ]);
    for s in ["a", "b", "c"] {
        n.wait_state(s, "running");
    }
    // Used in this order: a, c, b.
    for i in [0, 2, 1] {
        let (code, body) = get(n.port(i));
        assert_eq!(code, 200, "{body}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (code, body) = get(n.port(3));
    assert_eq!(code, 200, "{body}\n{}", n.log());
    n.wait_state("d", "running");
    let states: Vec<String> = ["a", "b", "c"].iter().map(|s| n.state(s)).collect();
    assert_eq!(states, ["running", "running", "suspended"], "{}", n.log());
}

#[test]
fn an_on_demand_service_whose_start_fails_starts_again_only_when_asked() {
    // 2000 MiB on a GPU of 1000: each start fails.
    let mut n = Node::start(
        1000,
        "",
        &[Svc {
            name: "od",
            mib: 2000,
            extra: "start = \"on-demand\"\nsuspend_after = \"1h\"\nfail_fast = true\nwake_timeout = \"20s\"",
        }],
    );
    assert_eq!(n.state("od"), "idle");
    let (code, body) = get(n.port(0));
    assert_ne!(code, 200, "{body}");
    let v = n.wait_state("od", "dead");
    assert_eq!(v["restarts"], 1, "{v}");
    // Nobody asks: no start in the background (its backoff was 1 s).
    std::thread::sleep(Duration::from_secs(5));
    let v = n.service("od");
    assert_eq!((v["state"].as_str(), v["restarts"].as_u64()), (Some("dead"), Some(1)), "{v}\n{}", n.log());
    assert!(v["next"].is_null(), "{v}");
    // Asked again, it starts again (and fails again).
    let (code, body) = get(n.port(0));
    assert_ne!(code, 200, "{body}");
    let end = Instant::now() + LONG;
    while n.service("od")["restarts"] != 2 {
        assert!(Instant::now() < end, "not started again: {}\n{}", n.service("od"), n.log());
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn services_find_the_agent_by_its_config_and_the_agent_says_where_it_listens() {
    let mut n = Node::start(1000, "", &[Svc { name: "a", mib: 100, extra: "suspend_after = \"1h\"" }]);
    n.wait_state("a", "running");
    let config = n.config.display().to_string();
    let r = n.w.gpusnap(&["--json", "services", "--config", &config]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()[0]["name"], "a", "{}", r.stdout);
    let r = n.w.gpusnap(&["--json", "service", "a", "suspend", "--config", &config]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    n.wait_state("a", "suspended");
    // Every address, at start.
    let log = n.log();
    for want in [
        format!("listening: API (admin socket) at={}", n.socket.display()),
        format!("listening: service a (proxy) at=127.0.0.1:{}", n.port(0)),
        "listening: probe socket".to_string(),
    ] {
        assert!(log.contains(&want), "{want} not in:\n{log}");
    }
    // A user the socket refuses is told what lets them in.
    let mut cmd = n.w.gpusnap_cmd(&["services", "--socket", n.socket.to_str().unwrap()]);
    use std::os::unix::process::CommandExt;
    cmd.uid(65534).gid(65534).current_dir("/");
    let out = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("`[agent] group`"), "{err}");
}
