//! The agent's config read again while it runs (SIGHUP, `POST /v1/reload`,
//! `gpusnap agent reload`), the servers' output (`gpusnap logs`, `GET
//! /v1/services/NAME/logs`), and the front door's access lines and
//! per-model request counts, each on a real agent over the fake driver.

mod common;

use common::*;
use serde_json::Value;
use std::collections::BTreeMap;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

const LONG: Duration = Duration::from_secs(60);

/// An agent on one fake GPU whose config the test rewrites: each service a
/// fake server (started through `sh`, which says its name on its output
/// first) with ports kept by name.
struct Node {
    w: World,
    socket: PathBuf,
    config: PathBuf,
    ports: BTreeMap<String, (u16, u16)>,
    door: u16,
    agent: Option<usize>,
    _sockdir: tempfile::TempDir,
}

impl Node {
    fn new() -> Self {
        let w = World::new(&[4000]);
        let sockdir = tempfile::Builder::new().prefix("gpusnap-reload").tempdir_in("/tmp").unwrap();
        let socket = sockdir.path().join("agent.sock");
        let config = w.tmp.path().join("agent.toml");
        Self { w, socket, config, ports: BTreeMap::new(), door: free_port(), agent: None, _sockdir: sockdir }
    }

    /// Writes the config: `[agent]` with `agent_extra`, then each service
    /// (name, MiB, more TOML lines).
    fn write(&mut self, agent_extra: &str, svcs: &[(&str, u64, &str)]) {
        let mut text = format!(
            "[agent]\nsocket = {:?}\ntick = \"100ms\"\nhttp_listen = \"127.0.0.1:{}\"\n{agent_extra}\n",
            self.socket.display().to_string(),
            self.door
        );
        for (name, mib, extra) in svcs {
            let (listen, backend) =
                *self.ports.entry(name.to_string()).or_insert_with(|| (free_port(), free_port()));
            let script = format!(
                "echo server {name} says hello; exec {} --mib {mib} --gpu 0 --http {backend}",
                fake_workload_bin().display()
            );
            text += &format!(
                "\n[[service]]\nname = \"{name}\"\nlisten = \"127.0.0.1:{listen}\"\nbackend = \"127.0.0.1:{backend}\"\n\
                 command = [\"/bin/sh\", \"-c\", {script:?}]\nmodels = [\"{name}-model\"]\npark = false\n\
                 suspend_after = \"never\"\n{extra}\n"
            );
        }
        std::fs::write(&self.config, text).unwrap();
    }

    fn spawn(&mut self) {
        let cfg = self.config.display().to_string();
        self.agent = Some(self.w.spawn_gpusnap(&["agent", "--config", &cfg]));
        let sock = self.socket.clone();
        wait_for(LONG, || UnixStream::connect(&sock).is_ok());
    }

    fn reload(&self, query: &str) -> (u16, Value) {
        let (code, body) = self.api("POST", &format!("/v1/reload{query}"));
        (code, serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}")))
    }

    fn metrics(&self) -> String {
        let (code, body) = self.api("GET", "/metrics");
        assert_eq!(code, 200, "{body}");
        body
    }

    fn pid(&self, name: &str) -> i32 {
        self.service(name)["pid"].as_i64().unwrap_or_else(|| panic!("{name} has no pid: {}", self.log()))
            as i32
    }

    fn agent_pid(&self) -> i32 {
        self.w.child_pid(self.agent.unwrap())
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
        adopt_recorded_services(&mut self.w);
    }
}

fn alive(pid: i32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next());
    !matches!(state, None | Some("Z") | Some("X"))
}

fn change<'a>(o: &'a Value, name: &str) -> &'a Value {
    o["changes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["service"] == name)
        .unwrap_or_else(|| panic!("no {name}: {o}"))
}

fn curl(port: u16, body: &str) -> u16 {
    let out = Command::new("curl")
        .args(["-sS", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "60", "--data-binary", body])
        .arg(format!("http://127.0.0.1:{port}/v1/completions"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap_or(0)
}

#[test]
fn a_reload_starts_the_new_restarts_the_changed_and_leaves_the_removed_running() {
    let mut n = Node::new();
    n.write("", &[("same", 100, ""), ("changed", 100, ""), ("gone", 100, "")]);
    n.spawn();
    for s in ["same", "changed", "gone"] {
        n.wait_state(s, "running");
    }
    let (same, changed, gone) = (n.pid("same"), n.pid("changed"), n.pid("gone"));
    // Comments and order are no change; a service's new command and a new
    // service are; `[agent]` keys are read at start only.
    n.write(
        "# a comment\nmax_connections = 500",
        &[("changed", 200, ""), ("same", 100, ""), ("new", 100, "")],
    );
    let (code, o) = n.reload("");
    assert_eq!(code, 200, "{o}");
    assert_eq!(change(&o, "changed")["change"], "changed", "{o}");
    assert_eq!(change(&o, "changed")["done"], "restarted", "{o}");
    assert_eq!(change(&o, "changed")["keys"], serde_json::json!(["command"]), "{o}");
    assert_eq!(change(&o, "gone")["done"], "left_running", "{o}");
    assert_eq!(change(&o, "new")["change"], "added", "{o}");
    assert_eq!(o["unchanged"], serde_json::json!(["same"]), "{o}");
    assert_eq!(o["needs_agent_restart"], serde_json::json!(["agent.max_connections"]), "{o}");
    n.wait_state("new", "running");
    let v = n.wait_state("changed", "running");
    assert_ne!(v["pid"].as_i64(), Some(changed as i64), "{v}");
    assert!(!alive(changed), "the changed service's old process still runs");
    // Untouched, and left running though no longer served.
    assert_eq!(n.pid("same"), same);
    assert!(alive(gone), "a removed service's process was ended");
    let (code, _) = n.api("GET", "/v1/services/gone");
    assert_eq!(code, 404);
    assert!(n.metrics().contains("gpusnap_agent_reloads_total{result=\"ok\"} 1"), "{}", n.metrics());
    // Its proxy let go of its port.
    let gone_port = n.ports["gone"].0;
    wait_for(LONG, || std::net::TcpStream::connect(("127.0.0.1", gone_port)).is_err());
    // The new service answers on its own port and at the front door.
    assert_eq!(curl(n.door, "{\"model\":\"new-model\",\"prompt\":\"hi\"}"), 200);
    n.w.adopt(gone);
}

#[test]
fn a_config_that_does_not_parse_is_refused_and_the_one_in_use_kept() {
    let mut n = Node::new();
    n.write("", &[("a", 100, "")]);
    n.spawn();
    n.wait_state("a", "running");
    let pid = n.pid("a");
    let good = std::fs::read_to_string(&n.config).unwrap();
    std::fs::write(&n.config, format!("{good}\n[[service]]\nname = \"b\"\nlisten = 12\n")).unwrap();
    let (code, o) = n.reload("");
    assert_eq!(code, 422, "{o}");
    let msg = o["error"]["message"].as_str().unwrap();
    assert!(msg.contains("agent.toml:") && !msg.contains('\n'), "{msg}");
    assert_eq!(o["error"]["exit_code"], 2);
    // SIGHUP (systemctl reload) is refused alike, and the agent goes on.
    let agent = n.agent_pid();
    // SAFETY: kill sends a signal to the agent this test started.
    assert_eq!(unsafe { libc::kill(agent, libc::SIGHUP) }, 0);
    wait_for(LONG, || n.metrics().contains("gpusnap_agent_reloads_total{result=\"refused\"} 2"));
    assert!(n.log().contains("reload refused, the config in use is kept"), "{}", n.log());
    assert_eq!(n.pid("a"), pid);
    assert_eq!(n.service("a")["state"], "running");
    let (code, _) = n.api("GET", "/v1/services/b");
    assert_eq!(code, 404);
    // The CLI says it in one line, exit 2.
    let cfg = n.config.display().to_string();
    let r = n.w.gpusnap(&["agent", "reload", "--config", &cfg]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("reload refused"), "{}", r.stderr);
}

#[test]
fn stop_removed_stops_what_the_file_no_longer_names() {
    let mut n = Node::new();
    n.write("", &[("keep", 100, ""), ("drop", 100, "")]);
    n.spawn();
    n.wait_state("keep", "running");
    n.wait_state("drop", "running");
    let dropped = n.pid("drop");
    n.write("", &[("keep", 100, "")]);
    let cfg = n.config.display().to_string();
    let r = n.w.gpusnap(&["--json", "agent", "reload", "--stop-removed", "--config", &cfg]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let o: Value = serde_json::from_str(r.stdout.trim()).unwrap();
    assert_eq!(change(&o, "drop")["done"], "stopped", "{o}");
    wait_for(LONG, || !alive(dropped));
    assert_eq!(n.service("keep")["state"], "running");
}

#[test]
fn logs_show_a_servers_output_from_the_file_and_through_the_api() {
    let mut n = Node::new();
    n.write("", &[("a", 100, "")]);
    n.spawn();
    n.wait_state("a", "running");
    let r = n.w.gpusnap(&["logs", "a", "--lines", "5"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.contains("server a says hello"), "{}", r.stdout);
    let (code, body) = n.api("GET", "/v1/services/a/logs?lines=1");
    assert_eq!(code, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert!(v["text"].as_str().unwrap().contains("server a says hello"), "{v}");
    // Another state directory: read through the agent.
    let sock = n.socket.display().to_string();
    let r = n.w.gpusnap(&["--state-dir", "/nonexistent", "logs", "a", "--socket", &sock]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.contains("server a says hello"), "{}", r.stdout);
    let r = n.w.gpusnap(&["--state-dir", "/nonexistent", "logs", "nosuch", "--socket", &sock]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    let r = n.w.gpusnap(&["logs", "../x"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
}

#[test]
fn the_front_door_logs_each_request_and_counts_it_by_model() {
    let mut n = Node::new();
    n.write("", &[("a", 100, "")]);
    n.spawn();
    n.wait_state("a", "running");
    assert_eq!(curl(n.door, "{\"model\":\"a-model\",\"prompt\":\"hi\"}"), 200);
    assert_eq!(curl(n.door, "{\"model\":\"made-up-by-a-client\",\"prompt\":\"hi\"}"), 404);
    let m = n.metrics();
    assert!(m.contains("gpusnap_agent_requests_total{model=\"a-model\",status=\"200\"} 1"), "{m}");
    assert!(m.contains("gpusnap_agent_requests_total{model=\"unknown\",status=\"404\"} 1"), "{m}");
    assert!(!m.contains("made-up-by-a-client"), "{m}");
    wait_for(LONG, || n.log().contains(" access model="));
    let line = n
        .log()
        .lines()
        .find(|l| l.contains(" access model=") && l.contains("a-model"))
        .unwrap_or_default()
        .to_string();
    for k in
        ["service=\"a\"", "status=200", "wait_ms=", "swap=false", "bytes_in=", "bytes_out=", "duration_ms="]
    {
        assert!(line.contains(k), "{k} missing: {line}");
    }
}

#[test]
fn a_changed_service_with_a_request_in_flight_is_restarted_once_it_ends() {
    let mut n = Node::new();
    n.write("", &[("busy", 100, "")]);
    n.spawn();
    n.wait_state("busy", "running");
    let old = n.pid("busy");
    // A request whose answer has not come (its headers never end): in flight.
    let mut client = std::net::TcpStream::connect(("127.0.0.1", n.ports["busy"].0)).unwrap();
    std::io::Write::write_all(&mut client, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n").unwrap();
    wait_for(LONG, || n.service("busy")["connections"] == 1);
    n.write("", &[("busy", 200, "")]);
    let (code, o) = n.reload("");
    assert_eq!(code, 200, "{o}");
    let c = change(&o, "busy");
    assert_eq!(c["done"], "pending", "{o}");
    assert!(c["detail"].as_str().unwrap().contains("in flight"), "{o}");
    // Until then it runs as started, and says so.
    let d = o["drift"].as_array().unwrap().iter().find(|d| d["service"] == "busy").expect("drift reported");
    assert!(d["drift"].as_str().unwrap().contains("command"), "{o}");
    assert!(n.metrics().contains("gpusnap_agent_service_config_drift{service=\"busy\"} 1"));
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(n.pid("busy"), old);
    assert!(alive(old));
    drop(client);
    wait_for(LONG, || n.service("busy")["pid"].as_i64().is_some_and(|p| p != old as i64));
    n.wait_state("busy", "running");
    assert!(!alive(old), "the old process still runs");
    assert!(n.service("busy")["config_drift"].is_null(), "{}", n.service("busy"));
}

#[test]
fn a_changed_service_off_the_gpu_comes_back_with_its_new_config_on_its_next_request() {
    let mut n = Node::new();
    n.write("", &[("s", 100, "")]);
    n.spawn();
    n.wait_state("s", "running");
    let old = n.pid("s");
    let (code, body) = n.api("POST", "/v1/services/s/suspend");
    assert_eq!(code, 200, "{body}");
    n.write("", &[("s", 200, "")]);
    let (code, o) = n.reload("");
    assert_eq!(code, 200, "{o}");
    assert_eq!(change(&o, "s")["done"], "restarted", "{o}");
    n.wait_state("s", "idle");
    assert!(!alive(old), "the old process still runs");
    // Its next request starts it, cold, as the file now says.
    assert_eq!(curl(n.door, "{\"model\":\"s-model\",\"prompt\":\"hi\"}"), 200);
    let v = n.wait_state("s", "running");
    assert_ne!(v["pid"].as_i64(), Some(old as i64), "{v}");
}

/// `gpusnap logs NAME` as `uid` with `groups` (none: no group at all).
fn logs_as(n: &Node, uid: u32, groups: Option<&str>) -> std::process::Output {
    let mut cmd = Command::new("setpriv");
    cmd.arg(format!("--reuid={uid}")).arg(format!("--regid={uid}"));
    match groups {
        Some(g) => cmd.arg(format!("--groups={g}")),
        None => cmd.arg("--clear-groups"),
    };
    cmd.arg(env!("CARGO_BIN_EXE_gpusnap"))
        .arg("--state-dir")
        .arg(n.w.state_dir())
        .args(["logs", "a", "--socket"])
        .arg(&n.socket)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

#[test]
fn the_agents_group_reads_a_servers_output_without_root() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let mut n = Node::new();
    n.write("group = \"4242\"", &[("a", 100, "")]);
    n.spawn();
    n.wait_state("a", "running");
    let log = n.w.state_dir().join("agent").join("a.log");
    let (f, d) = (std::fs::metadata(&log).unwrap(), std::fs::metadata(log.parent().unwrap()).unwrap());
    assert_eq!((f.mode() & 0o777, f.gid()), (0o640, 4242), "{:o}", f.mode());
    // Its directory is owner-only, as the state directory: the agent reads
    // it for them.
    assert_eq!(d.mode() & 0o777, 0o700, "{:o}", d.mode());
    std::fs::set_permissions(n.socket.parent().unwrap(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = logs_as(&n, 65534, Some("4242"));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("server a says hello"), "{text}");
    let out = logs_as(&n, 65534, None);
    assert!(!out.status.success());
    assert!(!String::from_utf8_lossy(&out.stdout).contains("hello"));
}

#[test]
fn logs_follow_what_a_server_writes_next() {
    let mut n = Node::new();
    n.write("", &[("a", 100, "")]);
    n.spawn();
    n.wait_state("a", "running");
    let k = n.w.spawn_gpusnap(&["logs", "a", "-f", "--lines", "10"]);
    let out = n.w.tmp.path().join(format!("gpusnap-{k}.out"));
    let hellos = || std::fs::read_to_string(&out).unwrap_or_default().matches("server a says hello").count();
    wait_for(LONG, || hellos() == 1);
    // A restart: its new server says hello again, in the same file.
    let (code, body) = n.api("POST", "/v1/services/a/restart");
    assert_eq!(code, 200, "{body}");
    wait_for(LONG, || hellos() == 2);
}

#[test]
fn a_reload_moves_a_proxy_and_gives_a_removed_services_port_to_a_new_one() {
    let mut n = Node::new();
    n.write("", &[("a", 100, ""), ("b", 100, "")]);
    n.spawn();
    n.wait_state("a", "running");
    n.wait_state("b", "running");
    let (a_old, b_port) = (n.ports["a"].0, n.ports["b"].0);
    let b = n.pid("b");
    n.ports.get_mut("a").unwrap().0 = free_port();
    n.ports.insert("c".into(), (b_port, free_port()));
    n.write("", &[("a", 100, ""), ("c", 100, "")]);
    let (code, o) = n.reload("?stop_removed=true");
    assert_eq!(code, 200, "{o}");
    assert_eq!(change(&o, "a")["keys"], serde_json::json!(["listen"]), "{o}");
    assert_eq!(change(&o, "c")["done"], "started", "{o}");
    n.wait_state("a", "running");
    n.wait_state("c", "running");
    wait_for(LONG, || !alive(b));
    for port in [n.ports["a"].0, b_port] {
        let r = http::tcp_get(port, "/", LONG).unwrap();
        assert_eq!(http::split(&r).0, 200, "{r}");
    }
    assert!(std::net::TcpStream::connect(("127.0.0.1", a_old)).is_err(), "a's old port still open");
}

#[test]
fn sighup_reloads_as_systemctl_reload_does() {
    let mut n = Node::new();
    n.write("", &[("a", 100, "")]);
    n.spawn();
    n.wait_state("a", "running");
    let a = n.pid("a");
    n.write("", &[("a", 100, ""), ("b", 100, "start = \"on-demand\"")]);
    // SAFETY: kill sends a signal to the agent this test started.
    assert_eq!(unsafe { libc::kill(n.agent_pid(), libc::SIGHUP) }, 0);
    wait_for(LONG, || n.api("GET", "/v1/services/b").0 == 200);
    n.wait_state("b", "idle");
    assert!(n.metrics().contains("gpusnap_agent_reloads_total{result=\"ok\"} 1"));
    assert!(n.log().contains("reload: added: started by its first request"), "{}", n.log());
    assert_eq!(n.pid("a"), a);
    // Its first request starts it.
    assert_eq!(curl(n.door, "{\"model\":\"b-model\",\"prompt\":\"hi\"}"), 200);
}
