//! What a client can do to the agent, bounded: floods of silent
//! connections, half-sent requests and concurrent requests under a low
//! open-file limit (on loopback, bounded in count and time), a request
//! never finished, an idle connection at hibernate time, a pid file
//! others could write, an agent killed after a before_suspend hook, and
//! numbers out of range in its config. Each test reproduces the attack
//! with the command that did it and checks that the agent keeps serving.
//! And what the agent reports: a suspend asked twice, a taken backend
//! port, the last error once it recovered, a wake's phases after an
//! eviction.

mod common;

use common::*;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const LONG: Duration = Duration::from_secs(60);

struct Agent {
    w: World,
    socket: PathBuf,
    config: PathBuf,
    /// (listen, backend) per service, in config order.
    ports: Vec<(u16, u16)>,
    agent: Option<usize>,
    _sockdir: tempfile::TempDir,
}

impl Agent {
    /// A config of fake servers (`name`, more TOML lines) and the agent's
    /// own lines; not started.
    fn config(agent_extra: &str, svcs: &[(&str, &str)]) -> Self {
        Self::config_on(4000, 100, agent_extra, svcs)
    }

    /// The same on a GPU of `gpu_mib`, each server taking `mib`.
    fn config_on(gpu_mib: u64, mib: u64, agent_extra: &str, svcs: &[(&str, &str)]) -> Self {
        let w = World::new(&[gpu_mib]);
        let sockdir = tempfile::Builder::new().prefix("gpusnap-agent-limits").tempdir_in("/tmp").unwrap();
        let socket = sockdir.path().join("agent.sock");
        let mut text = format!("[agent]\nsocket = {:?}\n{agent_extra}\n", socket.display().to_string());
        let mut ports = Vec::new();
        for (name, extra) in svcs {
            let (listen, backend) = (free_port(), free_port());
            ports.push((listen, backend));
            let more: String = extra
                .lines()
                .filter_map(|l| l.strip_prefix("# fake-workload: "))
                .flat_map(|a| a.split_whitespace())
                .map(|a| format!(", {a:?}"))
                .collect();
            text += &format!(
                "\n[[service]]\nname = \"{name}\"\nlisten = \"127.0.0.1:{listen}\"\nbackend = \"127.0.0.1:{backend}\"\n\
                 command = [{:?}, \"--mib\", \"{mib}\", \"--gpu\", \"0\", \"--http\", \"{backend}\"{more}]\n{extra}\npark = false\nmin_resident = \"0s\"\n",
                fake_workload_bin().display().to_string(),
            );
        }
        let config = w.tmp.path().join("agent.toml");
        std::fs::write(&config, text).unwrap();
        Self { w, socket, config, ports, agent: None, _sockdir: sockdir }
    }

    /// Starts the agent, under `prlimit --nofile=N:N` when `nofile` is given.
    fn start(&mut self, nofile: Option<u64>) {
        let _ = std::fs::remove_file(&self.socket);
        let cfg = self.config.display().to_string();
        let n = match nofile {
            None => {
                self.w.spawn_gpusnap_env(&["agent", "--config", &cfg], &[("AWS_SECRET_ACCESS_KEY", "secret")])
            }
            Some(n) => {
                let limit = format!("--nofile={n}:{n}");
                let bin = env!("CARGO_BIN_EXE_gpusnap");
                let state = self.w.state_dir().display().to_string();
                self.w.spawn_env(
                    "prlimit",
                    &[&limit, "--", bin, "--state-dir", &state, "agent", "--config", &cfg],
                )
            }
        };
        self.agent = Some(n);
        let sock = self.socket.clone();
        wait_for(LONG, || UnixStream::connect(&sock).is_ok());
    }

    fn pid(&self) -> i32 {
        self.w.child_pid(self.agent.unwrap())
    }

    fn port(&self, i: usize) -> u16 {
        self.ports[i].0
    }

    /// Descriptors the agent holds now.
    fn fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.agent_process())).map_or(0, |d| d.count())
    }

    /// The agent itself (under prlimit, prlimit execs it: the same pid).
    fn agent_process(&self) -> i32 {
        self.pid()
    }
}

impl AgentClient for Agent {
    fn api(&self, method: &str, path: &str) -> (u16, String) {
        let (text, read) = http::unix_request(&self.socket, method, path, LONG);
        read.unwrap();
        http::split(&text)
    }

    fn log(&self) -> String {
        let n = self.agent.unwrap_or(0);
        let a =
            std::fs::read_to_string(self.w.tmp.path().join(format!("gpusnap-{n}.err"))).unwrap_or_default();
        let b =
            std::fs::read_to_string(self.w.tmp.path().join(format!("spawned-{n}.log"))).unwrap_or_default();
        a + &b
    }

    fn world(&mut self) -> &mut World {
        &mut self.w
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(n) = self.agent.take() {
            self.w.children[n].kill();
        }
        adopt_recorded_services(&mut self.w);
    }
}

/// One request through a port: its status (0: closed without an answer).
fn get(port: u16, path: &str) -> (u16, String) {
    http::tcp_get(port, path, LONG).map_or((0, String::new()), |text| http::split(&text))
}

/// Polls `get` until it answers 200 (bounded).
fn answers(port: u16) -> String {
    let end = Instant::now() + LONG;
    loop {
        let (code, body) = get(port, "/");
        if code == 200 {
            return body;
        }
        assert!(Instant::now() < end, "port {port} did not answer 200 within {LONG:?}: {code} {body}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// This test process may open what the floods need.
fn raise_own_nofile() {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit write and read this one struct.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut r);
        r.rlim_cur = r.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &r);
    }
}

/// `n` connections to `port` that each send `bytes` and then wait.
fn flood(port: u16, n: usize, bytes: &[u8]) -> Vec<TcpStream> {
    let mut v = Vec::new();
    for _ in 0..n {
        if let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) {
            let _ = s.write_all(bytes);
            v.push(s);
        }
    }
    v
}

/// How many of `conns` the agent closed (a read gives EOF or an error),
/// waiting up to `limit` for each in turn.
fn closed_by_agent(conns: &mut [TcpStream], limit: Duration) -> usize {
    let end = Instant::now() + limit;
    let mut n = 0;
    for c in conns.iter_mut() {
        let left = end.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        c.set_read_timeout(Some(left)).unwrap();
        let mut b = [0u8; 256];
        match c.read(&mut b) {
            Ok(0) => n += 1,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => n += 1,
        }
    }
    n
}

fn count(log: &str, what: &str) -> usize {
    log.lines().filter(|l| l.contains(what)).count()
}

#[test]
fn seven_hundred_silent_connections_are_capped_and_closed_and_every_service_answers() {
    raise_own_nofile();
    let mut a = Agent::config(
        "header_timeout = \"2s\"",
        &[("a", "suspend_after = \"never\"\nmax_connections = 50"), ("b", "suspend_after = \"never\"")],
    );
    a.start(None);
    let pa = a.wait_state("a", "running")["pid"].as_i64().unwrap();
    a.wait_state("b", "running");
    // The flood: 700 connections on a's port that send nothing.
    let mut silent = flood(a.port(0), 700, b"");
    // The agent holds at most a's cap of them (two descriptors each).
    let fds = a.fds();
    assert!(fds < 50 * 2 + 100, "the agent holds {fds} descriptors");
    // The API and the other service answer meanwhile; a answers or refuses.
    assert_eq!(a.api("GET", "/v1/services").0, 200);
    assert!(answers(a.port(1)).starts_with("ok "));
    let (code, _) = get(a.port(0), "/");
    assert!(code == 200 || code == 0 || code == 503, "{code}");
    // Every silent one is closed: at once beyond the cap, after the header
    // timeout within it.
    let closed = closed_by_agent(&mut silent, LONG);
    assert_eq!(closed, 700, "{closed} of 700 silent connections closed\n{}", a.log());
    drop(silent);
    // Nothing was restarted; a answers as the same process.
    let body = answers(a.port(0));
    assert!(body.starts_with(&format!("ok {pa} ")), "{body}");
    for s in ["a", "b"] {
        let v = a.service(s);
        assert_eq!((v["state"].as_str(), v["restarts"].as_u64()), (Some("running"), Some(0)), "{v}");
    }
    // 650 refusals, a few warnings (at most one a second).
    let log = a.log();
    let warned = count(&log, "refused a connection");
    assert!((1..=60).contains(&warned), "{warned} warnings:\n{log}");
    assert!(log.contains("more like it not logged") || warned < 2, "{log}");
}

#[test]
fn eleven_hundred_half_sent_requests_on_the_metrics_port_time_out_and_the_api_answers() {
    raise_own_nofile();
    let metrics = free_port();
    let mut a = Agent::config(
        &format!("metrics_listen = \"127.0.0.1:{metrics}\"\nheader_timeout = \"1s\""),
        &[("a", "suspend_after = \"never\"")],
    );
    a.start(None);
    a.wait_state("a", "running");
    let mut half = flood(metrics, 1100, b"GET /metrics HTTP/1.1\r\nHost: x\r\n");
    let fds = a.fds();
    assert!(fds < 64 + 100, "the agent holds {fds} descriptors");
    assert_eq!(a.api("GET", "/v1/services").0, 200);
    assert!(answers(a.port(0)).starts_with("ok "));
    let closed = closed_by_agent(&mut half, LONG);
    assert_eq!(closed, 1100, "{closed} of 1100 half-sent requests closed\n{}", a.log());
    drop(half);
    let end = Instant::now() + LONG;
    loop {
        let (code, body) = get(metrics, "/metrics");
        if code == 200 {
            assert!(body.contains("gpusnap_agent_services"), "{body}");
            break;
        }
        assert!(Instant::now() < end, "metrics did not answer after the flood: {code}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn eighty_concurrent_requests_under_ulimit_n_64_never_make_a_live_server_dead() {
    raise_own_nofile();
    let mut a = Agent::config("", &[("a", "suspend_after = \"never\""), ("b", "suspend_after = \"never\"")]);
    a.start(Some(64));
    let pa = a.wait_state("a", "running")["pid"].as_i64().unwrap();
    let pb = a.wait_state("b", "running")["pid"].as_i64().unwrap();
    // 80 requests at once, each held open until the others are sent.
    let port = a.port(0);
    let held = flood(port, 80, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    let threads: Vec<_> = (0..80).map(|_| std::thread::spawn(move || get(port, "/").0)).collect();
    let codes: Vec<u16> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert!(codes.iter().all(|c| [0, 200, 503].contains(c)), "{codes:?}");
    drop(held);
    // A few policy ticks under the flood's aftermath: still the same servers.
    assert!(answers(a.port(0)).starts_with(&format!("ok {pa} ")));
    assert!(answers(a.port(1)).starts_with(&format!("ok {pb} ")));
    for (s, pid) in [("a", pa), ("b", pb)] {
        let v = a.service(s);
        assert_eq!(
            (v["state"].as_str(), v["restarts"].as_u64(), v["pid"].as_i64()),
            (Some("running"), Some(0), Some(pid)),
            "{v}\n{}",
            a.log()
        );
    }
    let log = a.log();
    assert!(!log.contains("the process ended on its own"), "{log}");
    assert!(log.contains("connections allowed"), "{log}");
}

#[test]
fn one_byte_never_finished_does_not_keep_a_service_on_the_gpu() {
    let mut a = Agent::config("", &[("a", "suspend_after = \"1s\"\nrequest_timeout = \"2s\"")]);
    a.start(None);
    a.wait_state("a", "running");
    // One byte of a request, never finished.
    let mut c = TcpStream::connect(("127.0.0.1", a.port(0))).unwrap();
    c.write_all(b"G").unwrap();
    // Busy for request_timeout, then idle: suspended though it stays open.
    a.wait_state("a", "suspended");
    let v = a.service("a");
    assert_eq!(v["connections"], 1, "{v}");
    drop(c);
    assert!(answers(a.port(0)).starts_with("ok "));
}

#[test]
fn an_idle_connection_never_blocks_a_hibernate() {
    criu_present();
    let mut a = Agent::config("", &[("h", "suspend_after = \"500ms\"\nhibernate_after = \"1s\"")]);
    a.start(None);
    a.wait_state("h", "running");
    // A keep-alive connection that got its answer and stays open.
    let mut c = TcpStream::connect(("127.0.0.1", a.port(0))).unwrap();
    c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut b = [0u8; 512];
    c.set_read_timeout(Some(LONG)).unwrap();
    assert!(c.read(&mut b).unwrap() > 0);
    let s = a.wait_state("h", "hibernated");
    assert!(s["image"].as_str().is_some(), "{s}");
    // The agent closed it for the hibernate; a new request wakes the server.
    assert_eq!(closed_by_agent(std::slice::from_mut(&mut c), LONG), 1);
    assert!(answers(a.port(0)).starts_with("ok "));
    let pid = a.wait_state("h", "running")["pid"].as_i64().unwrap();
    a.w.adopt(pid as i32);
}

/// A process of ours that a pid file names.
fn sleeper(w: &mut World) -> i32 {
    let n = w.spawn_env("sleep", &["600"]);
    w.child_pid(n)
}

#[test]
fn a_pid_file_others_may_write_or_of_another_owner_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let mut a = Agent::config("", &[]);
    let pid = sleeper(&mut a.w);
    let dir = a.w.tmp.path().to_path_buf();
    let (open, other) = (dir.join("open.pid"), dir.join("other.pid"));
    std::fs::write(&open, format!("{pid}\n")).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o666)).unwrap();
    std::fs::write(&other, format!("{pid}\n")).unwrap();
    std::os::unix::fs::chown(&other, Some(65534), None).unwrap();
    let mut text = std::fs::read_to_string(&a.config).unwrap();
    for (name, pf) in [("open", &open), ("other", &other)] {
        text += &format!(
            "\n[[service]]\nname = \"{name}\"\nlisten = \"127.0.0.1:{}\"\nbackend = \"127.0.0.1:{}\"\npid_file = {:?}\n",
            free_port(),
            free_port(),
            pf.display().to_string()
        );
    }
    std::fs::write(&a.config, text).unwrap();
    a.start(None);
    for (name, why) in [("open", "others may write it"), ("other", "belongs to uid 65534")] {
        let v = a.wait_state(name, "exited");
        assert!(v["pid"].is_null(), "{v}");
        let e = v["last_error"].as_str().unwrap_or_default();
        assert!(e.contains(why), "{name}: {v}");
    }
    assert!(pid_exists(pid));
}

#[test]
fn numbers_out_of_range_are_refused_naming_the_key_and_line() {
    for (line, key) in [("tick = 0", "tick"), ("header_timeout = \"1h\"", "header_timeout")] {
        let a = Agent::config(line, &[("a", "")]);
        let r = a.w.gpusnap(&["agent", "--config", &a.config.display().to_string()]);
        assert_eq!(r.code, 2, "{line}: {}", r.stderr);
        assert!(r.stderr.contains(&format!("agent.toml:3: {key} =")), "{line}: {}", r.stderr);
    }
    for (line, key) in [
        ("max_waiting = 0", "max_waiting"),
        ("wake_timeout = 9223372036854775807", "wake_timeout"),
        ("max_connections = 0", "max_connections"),
    ] {
        let a = Agent::config("", &[("a", line)]);
        let r = a.w.gpusnap(&["agent", "--config", &a.config.display().to_string()]);
        assert_eq!(r.code, 2, "{line}: {}", r.stderr);
        assert!(r.stderr.contains(":10: service \"a\": ") && r.stderr.contains(key), "{line}: {}", r.stderr);
    }
}

#[test]
fn an_agent_killed_after_a_before_suspend_hook_wakes_the_server_when_it_adopts_it() {
    let hooks = "suspend_after = \"1h\"\n# fake-workload: --kv-mib 100\n\
                 hooks.before_suspend = { path = \"/sleep?delay_ms=25000\", timeout = \"120s\" }\n\
                 hooks.after_resume = { path = \"/wake_up\", timeout = \"30s\" }";
    let mut a = Agent::config("", &[("a", hooks)]);
    a.start(None);
    let pid = a.wait_state("a", "running")["pid"].as_i64().unwrap();
    let socket = a.socket.clone();
    let bg = std::thread::spawn(move || {
        let mut s = UnixStream::connect(&socket).unwrap();
        let _ = write!(s, "POST /v1/services/a/suspend HTTP/1.1\r\nHost: a\r\nConnection: close\r\nContent-Length: 0\r\n\r\n");
        let mut t = String::new();
        let _ = s.read_to_string(&mut t);
    });
    // The hooked suspend is recorded before the hook runs: kill -9 then
    // (the hook answers after 25 s: time enough on a loaded machine).
    let rec = a.w.state_dir().join("agent").join("services.json");
    wait_for(LONG, || std::fs::read_to_string(&rec).is_ok_and(|t| t.contains("hooked suspend")));
    // And the hook's request is on its way: the agent's connection to the
    // backend is up (the record is written just before it connects; a kill
    // in between would leave the server awake, nothing to test).
    let backend = a.ports[0].1;
    wait_for(LONG, || established_to(backend));
    let n = a.agent.take().unwrap();
    a.w.children[n].kill();
    a.w.children[n].wait();
    let _ = bg.join();
    // The hook finishes on the server's side: it is asleep (503 on its own
    // port). The server answers one connection at a time: each ask waits
    // for its answer (a client that gave up would leave it writing to a
    // closed connection).
    wait_for(LONG, || {
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", backend)) else { return false };
        s.set_read_timeout(Some(LONG)).unwrap();
        let _ = s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        let mut t = String::new();
        let _ = s.read_to_string(&mut t);
        http::split(&t).0 == 503
    });
    a.start(None);
    let v = a.wait_state("a", "running");
    assert_eq!(v["pid"].as_i64(), Some(pid), "{v}");
    // The new agent ran after_resume: the server answers through the proxy.
    let body = answers(a.port(0));
    assert!(body.starts_with(&format!("ok {pid} ")), "{body}");
}

#[test]
fn suspend_of_a_suspended_service_succeeds_and_recovery_clears_the_last_error() {
    let mut a = Agent::config("", &[("a", "suspend_after = \"never\"")]);
    // The backend port is another program's when the agent starts.
    let taken = std::net::TcpListener::bind(("127.0.0.1", a.ports[0].1)).unwrap();
    a.start(None);
    let end = Instant::now() + LONG;
    let v = loop {
        let v = a.service("a");
        if v["last_error"].as_str().is_some_and(|e| e.contains("already in use by another program")) {
            break v;
        }
        assert!(Instant::now() < end, "{v}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_ne!(v["state"], "running", "{v}");
    drop(taken);
    let v = a.wait_state("a", "running");
    assert!(v["last_error"].is_null(), "{v}");
    for _ in 0..2 {
        let r = a.w.gpusnap(&["service", "a", "suspend", "--socket", &a.socket.display().to_string()]);
        assert_eq!(r.code, 0, "{}", r.stderr);
    }
    let r = a.w.gpusnap(&["services", "--socket", &a.socket.display().to_string()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let head = r.stdout.lines().next().unwrap_or_default().to_string();
    for col in ["GPU", "IDLE", "NEXT", "IMAGE"] {
        assert!(head.contains(col), "{}", r.stdout);
    }
    let v = a.service("a");
    assert!(v["gpu_memory"].as_u64().is_some_and(|b| b >= 100 << 20), "{v}");
    // Transitions are logged without -v, in plain text (stderr is a file).
    let log = a.log();
    assert!(log.contains("to=\"running\"") && log.contains("to=\"suspended\""), "{log}");
    assert!(!log.contains('\x1b'), "colour codes in a log that is not a terminal:\n{log}");
}

#[test]
fn a_wake_that_needed_an_eviction_traces_criu_as_the_wake() {
    criu_present();
    // A GPU that fits one server: h hibernates, then its request evicts r.
    let mut a = Agent::config_on(
        1000,
        600,
        "",
        &[
            (
                "h",
                "suspend_after = \"300ms\"\nhibernate_after = \"300ms\"\nwake_timeout = \"60s\"\n\
                 margin = \"16MiB\"\ngpu_memory = \"600MiB\"",
            ),
            ("r", "suspend_after = \"never\"\nmargin = \"16MiB\"\ngpu_memory = \"600MiB\""),
        ],
    );
    a.start(None);
    a.wait_state("h", "hibernated");
    // r was suspended to make room for h's start, or never was: running now.
    assert_eq!(a.api("POST", "/v1/services/r/resume").0, 200);
    a.wait_state("r", "running");
    let body = answers(a.port(0));
    assert!(body.starts_with("ok "), "{body}");
    let pid = a.wait_state("h", "running")["pid"].as_i64().unwrap();
    a.w.adopt(pid as i32);
    assert_eq!(a.service("r")["state"], "suspended");
    // The trace is observed just after the first byte: poll the metrics.
    let sample = |m: &str, what: &str, p: &str| {
        m.lines()
            .find(|l| l.starts_with(&format!("gpusnap_agent_swap_phase_seconds_{what}{{phase=\"{p}\"}}")))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let phase = |m: &str, p: &str| sample(m, "count", p);
    let end = Instant::now() + LONG;
    let m = loop {
        let m = a.api("GET", "/metrics").1;
        if phase(&m, "first_byte") > 0.0 {
            break m;
        }
        assert!(Instant::now() < end, "no traced wake: {m}");
        std::thread::sleep(Duration::from_millis(50));
    };
    // CRIU's restore took time, and it is the wake's, not admission's.
    assert!(sample(&m, "sum", "wake") > 0.0, "CRIU's restore is not the wake phase:\n{m}");
    assert!(phase(&m, "suspend") > 0.0, "no eviction traced:\n{m}");
}

#[test]
fn a_server_runs_in_a_scope_of_its_own_where_systemd_can_make_one() {
    if !Path::new("/run/systemd/system").is_dir() {
        gpusnap_testkit::skip(
            "systemd does not run this host (no /run/systemd/system): no scope can be made",
        );
        return;
    }
    let mut a = Agent::config("server_scope = \"on\"", &[("a", "suspend_after = \"never\"")]);
    a.start(None);
    let pid = a.wait_state("a", "running")["pid"].as_i64().unwrap();
    let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    assert!(cg.contains("gpusnap.slice/gpusnap-server-a-"), "{cg}");
    assert!(answers(a.port(0)).starts_with("ok "));
}

#[test]
fn a_server_gets_its_own_environment_not_the_agents() {
    let mut a = Agent::config(
        "",
        &[("a", "suspend_after = \"never\"\npass_environment = [\"HF_HOME_NOT_SET\"]\nenvironment = { MODEL = \"llama-8b\" }")],
    );
    a.start(None);
    let pid = a.wait_state("a", "running")["pid"].as_i64().unwrap();
    let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let vars: Vec<String> = env.split(|b| *b == 0).map(|v| String::from_utf8_lossy(v).into_owned()).collect();
    assert!(vars.iter().any(|v| v == "MODEL=llama-8b"), "{vars:?}");
    assert!(vars.iter().any(|v| v.starts_with("GPUSNAP_FAKE_DIR=")), "{vars:?}");
    // The agent has it (the test gave it); the server does not.
    assert!(!vars.iter().any(|v| v.starts_with("AWS_SECRET_ACCESS_KEY")), "{vars:?}");
}

#[test]
fn at_most_sixteen_clients_follow_the_events() {
    let mut a = Agent::config("", &[("a", "suspend_after = \"never\"")]);
    a.start(None);
    a.wait_state("a", "running");
    let follow = || {
        let mut s = UnixStream::connect(&a.socket).unwrap();
        s.set_read_timeout(Some(LONG)).unwrap();
        write!(s, "GET /v1/events HTTP/1.1\r\nHost: agent\r\n\r\n").unwrap();
        let mut head = [0u8; 12];
        s.read_exact(&mut head).unwrap();
        (String::from_utf8_lossy(&head).into_owned(), s)
    };
    let followers: Vec<_> = (0..16).map(|_| follow()).collect();
    assert!(
        followers.iter().all(|(h, _)| h == "HTTP/1.1 200"),
        "{:?}",
        followers.iter().map(|f| &f.0).collect::<Vec<_>>()
    );
    assert_eq!(follow().0, "HTTP/1.1 503");
    // Not following is always served; a follower that hangs up frees its place.
    assert_eq!(a.api("GET", "/v1/events?follow=false").0, 200);
    drop(followers);
    let end = Instant::now() + LONG;
    while follow().0 != "HTTP/1.1 200" {
        assert!(Instant::now() < end, "no follower's place came free");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn an_agent_out_of_descriptors_never_takes_a_live_server_for_dead() {
    let mut a = Agent::config("tick = \"50ms\"", &[("a", "suspend_after = \"never\"")]);
    a.start(None);
    let pid = a.wait_state("a", "running")["pid"].as_i64().unwrap();
    // Its limit lowered to what it holds: every /proc read of the policy's
    // liveness check now fails with EMFILE.
    let agent = a.pid().to_string();
    let held = a.fds();
    let limits = std::fs::read_to_string(format!("/proc/{agent}/limits")).unwrap();
    let line = limits.lines().find(|l| l.starts_with("Max open files")).unwrap().to_string();
    let f: Vec<&str> = line.split_whitespace().collect();
    let (soft, hard) = (f[3].to_string(), f[4].to_string());
    let set = |n: &str| {
        let st = std::process::Command::new("prlimit")
            .args(["--pid", &agent, &format!("--nofile={n}:{hard}")])
            .status()
            .unwrap();
        assert!(st.success());
    };
    set(&held.to_string());
    // Many ticks meanwhile (a fixed wait: the check is that nothing happens).
    std::thread::sleep(Duration::from_secs(2));
    set(&soft);
    let v = a.service("a");
    assert_eq!(
        (v["state"].as_str(), v["restarts"].as_u64(), v["pid"].as_i64()),
        (Some("running"), Some(0), Some(pid)),
        "{v}\n{}",
        a.log()
    );
    assert!(!a.log().contains("the process ended on its own"), "{}", a.log());
    assert!(answers(a.port(0)).starts_with(&format!("ok {pid} ")));
}

#[test]
fn a_server_runs_as_the_user_and_group_its_service_names() {
    let w = World::new(&[1000]);
    let r = w.gpusnap(&["run", "--light", "--user", "nobody", "--", "/bin/sh", "-c", "id -u; id -g; id -G"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let nobody = nix::unistd::User::from_name("nobody").unwrap().unwrap();
    let (uid, gid) = (nobody.uid.as_raw().to_string(), nobody.gid.as_raw().to_string());
    let lines: Vec<&str> = r.stdout.lines().collect();
    // Its uid, its primary group, and no supplementary group of gpusnap's.
    assert_eq!(lines, [uid.as_str(), gid.as_str(), gid.as_str()], "{}", r.stdout);
    let r = w.gpusnap(&["run", "--light", "--user", "no-such-user-here", "--", "true"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("no user \"no-such-user-here\""), "{}", r.stderr);
}

/// Whether a TCP connection to local port `port` is established (the
/// kernel's table, IPv4 and IPv6).
fn established_to(port: u16) -> bool {
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|t| {
        std::fs::read_to_string(t).unwrap_or_default().lines().skip(1).any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 3
                && f[3] == "01"
                && f[1].rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok()) == Some(port)
        })
    })
}
