//! Wake on request without a proxy (`wake_on = "socket"`): the fake model
//! server (`fake-workload --http`, a fake CUDA process that touches its
//! device memory before it answers) keeps its own port, and the agent
//! watches that port through sock_diag; `gpusnap probe` for exec probes.

mod common;

use common::*;
use serde_json::Value;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

const LONG: Duration = Duration::from_secs(60);

/// A socket-woken service: name, port, host, command prefix, MiB, more keys.
type Svc<'a> = (&'a str, u16, &'a str, &'a [&'a str], u64, &'a str);

struct SockWorld {
    w: World,
    socket: PathBuf,
    config: PathBuf,
    agent: Option<usize>,
    _sockdir: tempfile::TempDir,
}

impl SockWorld {
    /// One socket-woken service `m` on `port` (127.0.0.1 unless `host`),
    /// its command prefixed by `wrap` (`ip netns exec NS`), `extra` keys.
    fn new(port: u16, host: &str, wrap: &[&str], extra: &str) -> Self {
        Self::with(1000, &[("m", port, host, wrap, 300, extra)])
    }

    /// One socket-woken service `m` on a free port of 127.0.0.1 with `extra`
    /// keys, running and taking connections: the world, the server's pid and
    /// its address.
    fn running(extra: &str) -> (Self, i64, SocketAddr) {
        let port = free_port();
        let mut a = Self::new(port, "127.0.0.1", &[], extra);
        let pid = a.wait_state("running")["pid"].as_i64().unwrap();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        wait_for(LONG, || TcpStream::connect(addr).is_ok());
        (a, pid, addr)
    }

    /// `body` answered a request by `pid` after it was woken (its first
    /// wake: the fake's pass count 1), once, through the socket watch.
    fn assert_woken(&mut self, pid: i64, body: &str) {
        assert!(body.starts_with(&format!("ok {pid} ")) && body.ends_with(" 1"), "{body}");
        // Answered once its driver state is restored, maybe a moment before
        // the agent records it running.
        self.wait_state("running");
        assert_eq!(self.socket_wakes(), 1, "{}", self.metrics());
    }

    /// Socket-woken services (name, port, host, wrap, MiB, extra) on one
    /// fake GPU of `gpu_mib`.
    fn with(gpu_mib: u64, svcs: &[Svc]) -> Self {
        Self::with_agent(gpu_mib, "", svcs)
    }

    /// As [`Self::with`], with more `[agent]` keys.
    fn with_agent(gpu_mib: u64, agent: &str, svcs: &[Svc]) -> Self {
        let w = World::new(&[gpu_mib]);
        let sockdir = tempfile::Builder::new().prefix("gpusnap-sockwake-test").tempdir_in("/tmp").unwrap();
        let socket = sockdir.path().join("agent.sock");
        let mut text = format!("[agent]\nsocket = {:?}\n{agent}\n", socket.display().to_string());
        for (name, port, host, wrap, mib, extra) in svcs {
            let mut cmd: Vec<String> = wrap.iter().map(|s| s.to_string()).collect();
            cmd.extend([
                fake_workload_bin().display().to_string(),
                "--mib".into(),
                mib.to_string(),
                "--http".into(),
                port.to_string(),
                "--http-host".into(),
                host.to_string(),
            ]);
            // Parking is off unless the service asks for it.
            let park = if extra.contains("park = ") { "" } else { "park = false\n" };
            text += &format!(
                "\n[[service]]\nname = \"{name}\"\nwake_on = \"socket\"\nbackend = \"{host}:{port}\"\n\
                 command = {cmd:?}\nwake_timeout = \"60s\"\n{park}min_resident = \"0s\"\n{extra}\n"
            );
        }
        let config = w.tmp.path().join("agent.toml");
        std::fs::write(&config, text).unwrap();
        let mut s = Self { w, socket, config, agent: None, _sockdir: sockdir };
        s.start();
        s
    }

    fn start(&mut self) {
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

    fn api(&self, method: &str, path: &str) -> (u16, String) {
        let mut s = UnixStream::connect(&self.socket).unwrap();
        s.set_read_timeout(Some(LONG)).unwrap();
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: agent\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
        )
        .unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).unwrap();
        let code = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        (code, text.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_string())
    }

    fn service(&self) -> Value {
        self.service_of("m")
    }

    fn service_of(&self, name: &str) -> Value {
        let (code, body) = self.api("GET", &format!("/v1/services/{name}"));
        assert_eq!(code, 200, "{body}");
        serde_json::from_str(&body).unwrap()
    }

    fn wait_state(&mut self, state: &str) -> Value {
        self.wait_state_of("m", state)
    }

    fn wait_state_of(&mut self, name: &str, state: &str) -> Value {
        let end = Instant::now() + LONG;
        loop {
            let s = self.service_of(name);
            if s["state"] == state {
                for k in ["runner", "pid"] {
                    if let Some(p) = s[k].as_i64() {
                        self.w.adopt(p as i32);
                    }
                }
                return s;
            }
            assert!(
                Instant::now() < end,
                "{name} not {state} within {LONG:?}: {s}\nagent log: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn log(&self) -> String {
        let n = self.agent.unwrap_or(0);
        std::fs::read_to_string(self.w.tmp.path().join(format!("gpusnap-{n}.err"))).unwrap_or_default()
    }

    fn metrics(&self) -> String {
        let (code, body) = self.api("GET", "/metrics");
        assert_eq!(code, 200);
        body
    }

    fn socket_wakes(&self) -> u64 {
        let m = self.metrics();
        m.lines()
            .find(|l| l.starts_with("gpusnap_agent_socket_wakes_total{service=\"m\"}"))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0)
    }

    fn driver_state(&self, pid: i64) -> String {
        let r = self.w.json(&["state", &pid.to_string()]);
        assert_eq!(r.code, 0, "{}", r.stderr);
        r.json()["state"].as_str().unwrap().to_string()
    }

    fn probe(&self, pid: i64, port: u16) -> (i32, Value) {
        let r = self.w.json(&["probe", "--pid", &pid.to_string(), "--port", &port.to_string()]);
        let v = serde_json::from_str(r.stdout.lines().last().unwrap_or("null")).unwrap_or(Value::Null);
        (r.code, v)
    }
}

impl Drop for SockWorld {
    fn drop(&mut self) {
        if let Some(n) = self.agent.take() {
            self.w.children[n].kill();
        }
        let path = self.w.state_dir().join("agent").join("services.json");
        let v: Value =
            std::fs::read(&path).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
        for rec in v.as_object().into_iter().flat_map(|o| o.values()) {
            for k in ["runner", "pid"] {
                if let Some(p) = rec[k].as_i64() {
                    self.w.adopt(p as i32);
                }
            }
        }
    }
}

fn get(addr: SocketAddr) -> String {
    http::get_kept_alive(&mut TcpStream::connect(addr).unwrap())
}

#[test]
fn an_idle_server_is_suspended_and_a_new_connection_to_its_own_port_wakes_it() {
    let (mut a, pid, addr) = SockWorld::running("suspend_after = \"700ms\"");
    let s = a.service();
    assert_eq!(s["wake_on"], "socket");
    assert_eq!(s["listen"], addr.to_string());
    assert!(get(addr).starts_with(&format!("ok {pid} ")));

    // No traffic: suspended, the server's process still there, its port too.
    a.wait_state("suspended");
    assert_eq!(a.driver_state(pid), "checkpointed");

    // A request waits in the server (its CUDA call blocks) while the agent
    // resumes it; answered by the same process, its memory intact.
    a.assert_woken(pid, &get(addr));
    let m = a.metrics();
    assert!(m.contains("gpusnap_agent_socket_wake_delay_seconds_count{service=\"m\"} 1"), "{m}");
    let notes = a.w.json(&["history", &pid.to_string()]).stdout;
    assert!(notes.contains("resume: a connection arrived"), "{notes}");
}

#[test]
fn bytes_on_a_kept_alive_connection_wake_the_server() {
    let (mut a, pid, addr) = SockWorld::running("suspend_after = \"700ms\"");
    let mut kept = TcpStream::connect(addr).unwrap();
    assert!(http::get_kept_alive(&mut kept).starts_with(&format!("ok {pid} ")));
    // An open connection with no request does not keep it up.
    a.wait_state("suspended");
    assert_eq!(a.socket_wakes(), 0);
    a.assert_woken(pid, &http::get_kept_alive(&mut kept));
}

#[test]
fn connections_from_ignored_peers_neither_wake_nor_keep_the_server_up() {
    let (mut a, pid, addr) =
        SockWorld::running("suspend_after = \"700ms\"\nignore_peers = [\"127.0.0.2/32\"]");
    // Probes from the ignored address every 100 ms, answered while it runs:
    // they do not keep it up.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let prober = {
        let stop = std::sync::Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut s = http::connect_from("127.0.0.2", addr);
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                if write!(s, "GET / HTTP/1.1\r\nHost: x\r\n\r\n").is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    a.wait_state("suspended");
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    prober.join().unwrap();
    assert_eq!(a.socket_wakes(), 0, "{}", a.log());
    // A probe from the ignored address: connected, its request sent (the
    // server takes it and waits for its GPU), and nothing wakes. The watch
    // looks every millisecond: a second is a thousand looks.
    let mut probe = http::connect_from("127.0.0.2", addr);
    write!(probe, "GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(a.service()["state"], "suspended", "{}", a.log());
    assert_eq!(a.socket_wakes(), 0);
    // A counted client wakes it; the probe is answered too.
    assert!(get(addr).starts_with(&format!("ok {pid} ")));
    assert_eq!(a.socket_wakes(), 1);
}

#[test]
fn a_request_to_a_suspended_socket_woken_server_evicts_an_idle_one_from_a_full_gpu() {
    let (pa, pb) = (free_port(), free_port());
    let keys = "suspend_after = \"never\"\ngpu_memory = \"600MiB\"";
    let mut a = SockWorld::with(
        1000,
        &[("a", pa, "127.0.0.1", &[], 600, keys), ("b", pb, "127.0.0.1", &[], 600, keys)],
    );
    // Both started: the second one's start made room by suspending the first.
    let end = Instant::now() + LONG;
    let (first, second) = loop {
        let (sa, sb) = (a.service_of("a")["state"].clone(), a.service_of("b")["state"].clone());
        if sa == "running" && sb == "suspended" {
            break ((pb, "b"), (pa, "a"));
        }
        if sa == "suspended" && sb == "running" {
            break ((pa, "a"), (pb, "b"));
        }
        assert!(Instant::now() < end, "a {sa}, b {sb}\n{}", a.log());
        std::thread::sleep(Duration::from_millis(20));
    };
    let ((port_s, suspended), (_, running)) = (first, second);
    let pid = a.wait_state_of(suspended, "suspended")["pid"].as_i64().unwrap();
    a.wait_state_of(running, "running");
    // A request to the suspended one's own port: it is resumed, the other
    // (idle) evicted to make room, and the answer comes from its process.
    let body = get(format!("127.0.0.1:{port_s}").parse().unwrap());
    assert!(body.starts_with(&format!("ok {pid} ")) && body.ends_with(" 1"), "{body}");
    a.wait_state_of(suspended, "running");
    a.wait_state_of(running, "suspended");
    let notes = a.w.json(&["history", &pid.to_string()]).stdout;
    assert!(notes.contains("evict"), "{notes}");
}

#[test]
fn host_memory_pressure_never_hibernates_a_socket_woken_server() {
    let port = free_port();
    // Always below: every tick looks for a suspended service to hibernate.
    let mut a = SockWorld::with_agent(
        1000,
        "min_host_available = \"1PiB\"\ntick = \"50ms\"",
        &[("m", port, "127.0.0.1", &[], 300, "suspend_after = \"700ms\"")],
    );
    let pid = a.wait_state("running")["pid"].as_i64().unwrap();
    a.wait_state("suspended");
    // Forty ticks.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(a.service()["state"], "suspended", "{}", a.log());
    let notes = a.w.json(&["history", &pid.to_string()]).stdout;
    assert!(!notes.contains("hibernate"), "{notes}");
    // Still woken by a request.
    assert!(get(format!("127.0.0.1:{port}").parse().unwrap()).starts_with(&format!("ok {pid} ")));
}

#[test]
fn gpusnap_probe_answers_for_running_suspended_stopped_and_dead_servers_without_waking() {
    let (mut a, pid, addr) = SockWorld::running("suspend_after = \"700ms\"\nrestart = false");
    let port = addr.port();

    let (code, v) = a.probe(pid, port);
    assert_eq!((code, v["state"].as_str()), (0, Some("running")), "{v}");
    assert_eq!(v["ready"], true);

    a.wait_state("suspended");
    let (code, v) = a.probe(pid, port);
    assert_eq!((code, v["state"].as_str()), (0, Some("suspended")), "{v}");
    assert_eq!(a.service()["state"], "suspended", "the probe woke nothing");
    assert_eq!(a.socket_wakes(), 0);
    // The same from the agent, which the probe asks first when it answers.
    let sock = a.socket.display().to_string();
    let r = a.w.json(&["probe", "--pid", &pid.to_string(), "--port", &port.to_string(), "--socket", &sock]);
    let v: Value = serde_json::from_str(r.stdout.lines().last().unwrap_or("null")).unwrap_or(Value::Null);
    assert_eq!(
        (r.code, v["state"].as_str(), v["source"].as_str()),
        (0, Some("suspended"), Some("agent")),
        "{v}"
    );
    assert_eq!(a.service()["state"], "suspended", "the probe woke nothing");

    // Nothing on another port.
    let (code, v) = a.probe(pid, free_port());
    assert_eq!((code, v["state"].as_str()), (9, Some("not_listening")), "{v}");
    let r = a.w.gpusnap(&["probe", "--pid", &pid.to_string(), "--port", &free_port().to_string()]);
    assert_eq!(r.code, 9);
    assert!(r.stderr.starts_with("gpusnap: not ready: nothing listens on port "), "{}", r.stderr);
    assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);

    // Stopped: stuck.
    let signal = |sig: nix::sys::signal::Signal| {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig).unwrap()
    };
    signal(nix::sys::signal::Signal::SIGSTOP);
    wait_for(LONG, || a.probe(pid, port).0 == 10);
    signal(nix::sys::signal::Signal::SIGCONT);
    wait_for(LONG, || a.probe(pid, port).0 == 0);

    // Dead.
    signal(nix::sys::signal::Signal::SIGKILL);
    wait_for(LONG, || !pid_exists(pid as i32) || a.probe(pid, port).0 == 8);
    let (code, v) = a.probe(pid, port);
    assert_eq!((code, v["state"].as_str()), (8, Some("dead")), "{v}");
}

#[test]
fn a_killed_agent_adopts_a_suspended_socket_woken_server_and_a_request_still_wakes_it() {
    let (mut a, pid, addr) = SockWorld::running("suspend_after = \"700ms\"");
    let mut kept = TcpStream::connect(addr).unwrap();
    assert!(http::get_kept_alive(&mut kept).starts_with(&format!("ok {pid} ")));
    a.wait_state("suspended");
    a.kill9();
    a.start();
    let s = a.wait_state("suspended");
    assert_eq!(s["pid"].as_i64(), Some(pid), "adopted, not started again");
    // The new agent learns the kept-alive connection without waking for
    // it; its next request wakes the server.
    let mut copy = kept.try_clone().unwrap();
    let body = std::panic::catch_unwind(move || http::get_kept_alive(&mut copy))
        .unwrap_or_else(|_| panic!("no answer; agent log:\n{}", a.log()));
    a.assert_woken(pid, &body);
}

/// A network namespace with a veth pair to this one: `gsw-N` holds
/// 10.231.N.2/24, this side 10.231.N.1/24. Removed on drop.
struct Netns {
    name: String,
    host_if: String,
}

impl Netns {
    /// None (the test is skipped, saying why) where `ip netns` cannot be
    /// used, except in CI (CI=true), which runs as root and must prove it.
    fn new(n: u8) -> Option<Self> {
        let name = format!("gsw-{}-{n}", std::process::id() % 10000);
        let host_if = format!("gswh{}{n}", std::process::id() % 10000);
        let ip = |args: &[&str]| {
            std::process::Command::new("ip").args(args).status().map(|s| s.success()).unwrap_or(false)
        };
        let ok = nix::unistd::geteuid().is_root()
            && ip(&["netns", "add", &name])
            && ip(&["link", "add", &host_if, "type", "veth", "peer", "name", "eth0", "netns", &name])
            && ip(&["addr", "add", &format!("10.231.{n}.1/24"), "dev", &host_if])
            && ip(&["link", "set", &host_if, "up"])
            && ip(&["-n", &name, "addr", "add", &format!("10.231.{n}.2/24"), "dev", "eth0"])
            && ip(&["-n", &name, "link", "set", "eth0", "up"])
            && ip(&["-n", &name, "link", "set", "lo", "up"]);
        let ns = Self { name, host_if };
        if !ok {
            let why = "ip netns is not usable here (needs root and iproute2)";
            gpusnap_testkit::skip(why);
            return None;
        }
        Some(ns)
    }

    /// Runs `f` on a thread inside the namespace (its sockets stay there).
    fn inside<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/run/netns/{}", self.name);
        std::thread::spawn(move || {
            let ns = std::fs::File::open(path).unwrap();
            nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            f()
        })
        .join()
        .unwrap()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip").args(["link", "del", &self.host_if]).status();
        let _ = std::process::Command::new("ip").args(["netns", "del", &self.name]).status();
    }
}

#[test]
fn a_server_in_its_own_network_namespace_is_woken_by_a_client_there_not_by_the_nodes_probes() {
    let Some(ns) = Netns::new(7) else { return };
    let port = 18080;
    let host = "10.231.7.2";
    let mut a =
        SockWorld::new(port, host, &["ip", "netns", "exec", &ns.name.clone()], "suspend_after = \"700ms\"");
    let pid = a.wait_state("running")["pid"].as_i64().unwrap();
    let addr: SocketAddr = format!("{host}:{port}").parse().unwrap();
    wait_for(LONG, || TcpStream::connect(addr).is_ok());
    a.wait_state("suspended");

    // From the node (10.231.7.1, one of its own addresses): a kubelet's
    // httpGet probe. Ignored by default.
    let mut probe = TcpStream::connect(addr).unwrap();
    write!(probe, "GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(a.service()["state"], "suspended", "{}", a.log());
    assert_eq!(a.socket_wakes(), 0);
    let (code, v) = a.probe(pid, port);
    assert_eq!((code, v["state"].as_str()), (0, Some("suspended")), "{v}");

    // From inside the namespace (a client beside the server): wakes it.
    a.assert_woken(pid, &ns.inside(move || get(addr)));
    drop(probe);
}

#[test]
fn gpusnap_probe_refuses_bad_input_with_one_line_and_its_exit_code() {
    let mut w = World::new(&[8192]);
    let threads = w.workload(512, 0, &["--threads", "2"]);
    let reused = w.workload(512, 0, &[]);
    let mut sleep = std::process::Command::new("sleep").arg("60").spawn().unwrap();
    let tid: i32 = std::fs::read_dir(format!("/proc/{threads}/task"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .find(|t| *t != threads)
        .expect("a second thread");
    // The probe's answer on stderr for `pid`: (exit code, its one line).
    let probe = |pid: i32| {
        let r = w.gpusnap(&[
            "probe",
            "--pid",
            &pid.to_string(),
            "--port",
            "1",
            "--socket",
            "/nonexistent/agent.sock",
        ]);
        assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
        assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
        (r.code, r.stderr.trim().to_string())
    };
    let (code, err) = probe(tid);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains(&format!("{tid} is a thread of {threads}")), "{err}");

    let (code, err) = probe(sleep.id() as i32);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("has no CUDA context"), "{err}");

    let (code, err) = probe(999_999_999);
    assert_eq!((code, err.as_str()), (8, "gpusnap: not ready: no process 999999999"));

    // The record of a suspended process under the pid, the process there
    // now another one (as if the suspended one died and its pid was given
    // to a new program).
    let p = reused.to_string();
    assert_eq!(w.json(&["suspend", &p]).code, 0);
    assert_eq!(w.json(&["resume", &p]).code, 0);
    let db = rusqlite::Connection::open(w.state_dir().join("gpusnap.db")).unwrap();
    for table in ["processes", "footprints"] {
        let sql = format!("UPDATE {table} SET start_time = start_time - 1 WHERE pid = ?1");
        db.execute(&sql, [reused]).unwrap();
    }
    db.execute("UPDATE processes SET state = 'checkpointed' WHERE pid = ?1", [reused]).unwrap();
    let (code, err) = probe(reused);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("now belongs to another program"), "{err}");
    let _ = sleep.kill();
    let _ = sleep.wait();
}

/// A parked server (its memory in host memory, its context on the GPU) is
/// woken by a connection to its own port, without a proxy and without the
/// driver's lock; `gpusnap probe` says it is parked and ready, and wakes
/// nothing.
#[test]
fn a_parked_server_is_woken_by_its_own_port_and_the_probe_says_parked() {
    let (mut a, pid, addr) = SockWorld::running("suspend_after = \"700ms\"\npark = true");
    a.wait_state("parked");
    let sock = a.socket.display().to_string();
    let r = a.w.json(&[
        "probe",
        "--pid",
        &pid.to_string(),
        "--port",
        &addr.port().to_string(),
        "--socket",
        &sock,
    ]);
    let v: Value = serde_json::from_str(r.stdout.lines().last().unwrap_or("null")).unwrap_or(Value::Null);
    assert_eq!((r.code, v["state"].as_str(), v["ready"].as_bool()), (0, Some("parked"), Some(true)), "{v}");
    // And from the driver's side, with no agent to ask.
    let (code, v) = a.probe(pid, addr.port());
    assert_eq!((code, v["state"].as_str()), (0, Some("parked")), "{v}");
    assert_eq!(a.service()["state"], "parked", "the probe woke nothing");
    assert_eq!(a.socket_wakes(), 0);

    let body = get(addr);
    assert!(body.starts_with(&format!("ok {pid} ")), "{body}");
    a.wait_state("running");
    assert_eq!(a.socket_wakes(), 1, "{}", a.metrics());
    let locks = a.w.calls_on(pid as i32).iter().filter(|c| c.starts_with("lock")).count();
    assert_eq!(locks, 0, "parked and back, never the driver's lock");
}
