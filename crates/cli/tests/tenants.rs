//! A node shared by tenants: what a pod can reach of the agent. A "pod" is
//! root in new pid, network, mount and uts namespaces without a user
//! namespace (`unshare`), the probe directory mounted read-only and the
//! admin directory not mounted, as the manifests of `deploy/` give it. It
//! gets the probe socket's one answer about its own processes and nothing
//! else: no action on another tenant's service, no journal, no other
//! process, no way to replace the socket. And the admin socket: its
//! `/v1/processes` records nothing, a service's `allow_users` and
//! `allow_groups` narrow who may act on it, and the agent refuses an admin
//! socket in the probe directory. Root only (namespaces, other uids).

mod common;

use common::*;
use serde_json::Value;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

const LONG: Duration = Duration::from_secs(60);

/// Whether this test can run: root, and `tools` on PATH.
fn can_run(tools: &[&str]) -> bool {
    if !nix::unistd::geteuid().is_root() {
        gpusnap_testkit::skip("needs root (namespaces, mounts, other uids)");
        return false;
    }
    for t in tools {
        let found =
            Command::new("sh").args(["-c", &format!("command -v {t}")]).stdout(Stdio::null()).status();
        if !found.is_ok_and(|s| s.success()) {
            gpusnap_testkit::skip(format!("{t} is not installed"));
            return false;
        }
    }
    true
}

struct Agent {
    w: World,
    run: PathBuf,
    config: PathBuf,
    agent: Option<usize>,
}

impl Agent {
    /// Two fake servers, `a` and `b` (more TOML lines each), the admin socket
    /// in `run/admin/`, the probe socket in `run/probe/`.
    fn new(agent_extra: &str, a: &str, b: &str) -> Self {
        let w = World::new(&[4000]);
        let run = w.tmp.path().join("run");
        let mut text = format!(
            "[agent]\nsocket = {:?}\nprobe_socket = {:?}\n{agent_extra}\n",
            run.join("admin/agent.sock").display().to_string(),
            run.join("probe/probe.sock").display().to_string(),
        );
        for (name, extra) in [("a", a), ("b", b)] {
            let (listen, backend) = (free_port(), free_port());
            text += &format!(
                "\n[[service]]\nname = \"{name}\"\nlisten = \"127.0.0.1:{listen}\"\nbackend = \"127.0.0.1:{backend}\"\n\
                 suspend_after = \"never\"\n\
                 command = [{:?}, \"--mib\", \"100\", \"--gpu\", \"0\", \"--http\", \"{backend}\"]\n{extra}\n",
                fake_workload_bin().display().to_string(),
            );
        }
        let config = w.tmp.path().join("agent.toml");
        std::fs::write(&config, text).unwrap();
        Agent { w, run, config, agent: None }
    }

    fn admin(&self) -> PathBuf {
        self.run.join("admin/agent.sock")
    }

    fn probe(&self) -> PathBuf {
        self.run.join("probe/probe.sock")
    }

    fn start(&mut self) {
        let cfg = self.config.display().to_string();
        self.agent = Some(self.w.spawn_gpusnap(&["agent", "--config", &cfg]));
        let (admin, probe) = (self.admin(), self.probe());
        let up = wait_until(LONG, || {
            std::os::unix::net::UnixStream::connect(&admin).is_ok()
                && std::os::unix::net::UnixStream::connect(&probe).is_ok()
        });
        assert!(up, "the agent did not serve its sockets: {}", self.log());
        self.wait_state("a", "running");
        self.wait_state("b", "running");
    }
}

impl AgentClient for Agent {
    fn api(&self, method: &str, path: &str) -> (u16, String) {
        let (text, read) = http::unix_request(&self.admin(), method, path, LONG);
        read.unwrap();
        http::split(&text)
    }

    fn log(&self) -> String {
        let n = self.agent.unwrap_or(0);
        std::fs::read_to_string(self.w.tmp.path().join(format!("gpusnap-{n}.err"))).unwrap_or_default()
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

/// Rows the store holds about `pid` (its processes and identities tables).
fn recorded(w: &World, pid: i64) -> i64 {
    let db = rusqlite::Connection::open(w.state_dir().join("gpusnap.db")).unwrap();
    ["processes", "identities"]
        .iter()
        .map(|t| {
            db.query_row(&format!("SELECT count(*) FROM {t} WHERE pid = ?1"), [pid], |r| r.get::<_, i64>(0))
                .unwrap_or(0)
        })
        .sum()
}

/// The pod's script (tests/tenants/pod.py) in new namespaces: its report.
fn pod(a: &Agent, other_pid: i32) -> Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/tenants/pod.py");
    let mut cmd = Command::new("unshare");
    a.w.env(&mut cmd);
    cmd.args(["--pid", "--net", "--mount", "--uts", "--fork", "--propagation", "private", "python3"])
        .arg(script)
        .arg(a.run.join("probe"))
        .arg(a.run.join("admin"))
        .arg(a.w.tmp.path().join("hostproc"))
        .arg(fake_workload_bin())
        .arg(env!("CARGO_BIN_EXE_gpusnap"))
        .arg(other_pid.to_string());
    let out = bounded(cmd, Duration::from_secs(180));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "the pod failed: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

#[test]
fn a_pod_gets_the_probes_answer_about_its_own_processes_and_nothing_else() {
    if !can_run(&["unshare", "python3", "ip", "mount"]) {
        return;
    }
    let mut a = Agent::new("", "", "");
    a.start();
    let (pid_a, pid_b) = (a.service("a")["pid"].as_i64().unwrap(), a.service("b")["pid"].as_i64().unwrap());
    let calls_before = (a.w.calls_on(pid_a as i32), a.w.calls_on(pid_b as i32));

    let r = pod(&a, pid_a as i32);
    let status = |k: &str| r[k]["status"].as_i64().unwrap_or(-1);
    // Another tenant's services: refused, and untouched.
    for k in ["suspend_other", "restart_other", "services", "events", "every_process"] {
        assert_eq!(status(k), 403, "{k}: {}", r[k]);
        assert!(r[k]["body"].as_str().unwrap().contains("/v1/processes?tree=PID"), "{k}: {}", r[k]);
    }
    assert_eq!(a.service("a")["state"], "running");
    assert_eq!(a.service("b")["pid"].as_i64(), Some(pid_b), "b was not restarted");
    let calls = (a.w.calls_on(pid_a as i32), a.w.calls_on(pid_b as i32));
    assert_eq!(calls, calls_before, "the driver was asked nothing for the pod");
    // The admin socket is not in the pod; the probe directory is read-only.
    assert_eq!(status("admin"), 0, "{}", r["admin"]);
    for k in ["unlink", "rename", "bind"] {
        assert_eq!(r[k], "Read-only file system", "{k}");
    }
    assert!(a.probe().exists());
    // Its own tree: its server, by its host pid, and nothing recorded.
    assert_eq!(status("own_tree"), 200, "{}", r["own_tree"]);
    let rows: Vec<Value> = serde_json::from_str(r["own_tree"]["body"].as_str().unwrap()).unwrap();
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0]["ns_pid"], r["server"], "{rows:?}");
    let host = rows[0]["pid"].as_i64().unwrap();
    assert!(host != pid_a && host != pid_b);
    assert_eq!(recorded(&a.w, host), 0, "the probe's answer recorded nothing");
    // Another process of the node, named by its host pid: not the pod's.
    assert_eq!(status("other_tree"), 404, "{}", r["other_tree"]);
    // The example's probe, from the pod, through the probe socket.
    let probe: Value = serde_json::from_str(r["probe"]["stdout"].as_str().unwrap().trim())
        .unwrap_or_else(|e| panic!("{e}: {}", r["probe"]));
    assert_eq!(r["probe"]["code"], 0, "{}", r["probe"]);
    assert_eq!((probe["state"].as_str(), probe["source"].as_str()), (Some("running"), Some("agent")));
}

/// Journal entries the store holds about `pid`.
fn journaled(w: &World, pid: i32) -> i64 {
    let db = rusqlite::Connection::open(w.state_dir().join("gpusnap.db")).unwrap();
    db.query_row("SELECT count(*) FROM events WHERE pid = ?1", [pid], |r| r.get(0)).unwrap()
}

#[test]
fn the_admin_apis_process_list_records_nothing() {
    if !can_run(&[]) {
        return;
    }
    let mut a = Agent::new("", "", "");
    a.start();
    // A process outside the agent, with a driver call that a gpusnap which
    // died left open in the journal: a reader must not close it.
    let outside = a.w.workload(64, 0, &[]);
    let stat = std::fs::read_to_string(format!("/proc/{outside}/stat")).unwrap();
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split_whitespace().collect();
    let start_time: i64 = fields[19].parse().unwrap();
    let db = rusqlite::Connection::open(a.w.state_dir().join("gpusnap.db")).unwrap();
    db.execute(
        "INSERT INTO events (ts_ms, pid, start_time, op, phase, actor) VALUES (0, ?1, ?2, 'checkpoint', 'begin', 999999999)",
        rusqlite::params![outside, start_time],
    )
    .unwrap();
    let before = (recorded(&a.w, outside.into()), journaled(&a.w, outside));
    let (code, body) = a.api("GET", "/v1/processes");
    assert_eq!(code, 200, "{body}");
    let rows: Vec<Value> = serde_json::from_str(&body).unwrap();
    assert!(rows.iter().any(|r| r["pid"] == outside), "{body}");
    let after = (recorded(&a.w, outside.into()), journaled(&a.w, outside));
    assert_eq!(after, before, "GET /v1/processes wrote about {outside} (records, journal entries)");
}

/// `gpusnap service NAME suspend` on the admin socket as uid `uid`, gid `gid`.
fn suspend_as(a: &Agent, uid: u32, gid: u32, name: &str) -> (i32, String) {
    let mut cmd = Command::new("setpriv");
    cmd.arg(format!("--reuid={uid}"))
        .arg(format!("--regid={gid}"))
        .arg("--clear-groups")
        .arg(env!("CARGO_BIN_EXE_gpusnap"))
        .args(["service", name, "suspend", "--socket"])
        .arg(a.admin());
    let out = bounded(cmd, LONG);
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn a_service_names_who_may_act_on_it() {
    if !can_run(&["setpriv"]) {
        return;
    }
    // The agent's group is 4242; a allows uid 1001 only, b every member.
    let mut a = Agent::new("group = \"4242\"", "allow_users = [\"1001\"]", "");
    for d in [a.w.tmp.path().to_path_buf(), a.run.clone()] {
        std::fs::create_dir_all(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o711)).unwrap();
    }
    a.start();
    let (code, err) = suspend_as(&a, 1000, 4242, "a");
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("may not act on service \"a\""), "{err}");
    assert_eq!(a.service("a")["state"], "running");
    let (code, err) = suspend_as(&a, 1000, 4242, "b");
    assert_eq!(code, 0, "{err}");
    let (code, err) = suspend_as(&a, 1001, 4242, "a");
    assert_eq!(code, 0, "{err}");
    // Outside the group, nothing: the admin directory (0750) keeps it out.
    let (code, err) = suspend_as(&a, 1002, 1002, "b");
    assert_ne!(code, 0, "{err}");
    let (code, body) = a.api("POST", "/v1/services/a/resume");
    assert_eq!(code, 200, "root may act on every service: {body}");
}

/// `GET path` on the probe socket as uid `uid` (python3): the status.
fn probe_get_as(a: &Agent, uid: u32, path: &str) -> (i32, String) {
    let code = "import socket, sys\n\
s = socket.socket(socket.AF_UNIX); s.settimeout(60); s.connect(sys.argv[1])\n\
s.sendall(('GET ' + sys.argv[2] + ' HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n').encode())\n\
d = b''\n\
while True:\n    b = s.recv(65536)\n    if not b: break\n    d += b\n\
print(d.decode(errors='replace'))\n";
    let mut cmd = Command::new("setpriv");
    cmd.arg(format!("--reuid={uid}"))
        .arg(format!("--regid={uid}"))
        .arg("--clear-groups")
        .arg(system_python().unwrap())
        .args(["-c", code])
        .arg(a.probe())
        .arg(path);
    let out = bounded(cmd, LONG);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let status = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, text + &String::from_utf8_lossy(&out.stderr))
}

/// A python3 that another user may run (not one under root's home).
fn system_python() -> Option<&'static str> {
    ["/usr/bin/python3", "/usr/local/bin/python3"].into_iter().find(|p| Path::new(p).exists())
}

#[test]
fn a_host_user_gets_from_the_probe_socket_only_its_own_processes() {
    if !can_run(&["setpriv"]) {
        return;
    }
    if system_python().is_none() {
        gpusnap_testkit::skip("no python3 in /usr/bin or /usr/local/bin");
        return;
    }
    let mut a = Agent::new("", "", "");
    std::fs::set_permissions(a.w.tmp.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    a.start();
    std::fs::set_permissions(&a.run, std::fs::Permissions::from_mode(0o711)).unwrap();
    let pid_a = a.service("a")["pid"].as_i64().unwrap();
    // Root's server, asked by uid 1000 in the agent's own pid namespace.
    let (status, text) = probe_get_as(&a, 1000, &format!("/v1/processes?tree={pid_a}"));
    assert_eq!(status, 404, "{text}");
    let (status, text) = probe_get_as(&a, 1000, "/v1/services");
    assert_eq!(status, 403, "{text}");
    // Root asks about any.
    let (status, text) = probe_get_as(&a, 0, &format!("/v1/processes?tree={pid_a}"));
    assert_eq!(status, 200, "{text}");
    assert!(text.contains(&format!("\"pid\":{pid_a}")), "{text}");
}

#[test]
fn the_agent_refuses_an_admin_socket_in_the_probe_directory() {
    let w = World::new(&[4000]);
    let probe = w.tmp.path().join("probe");
    for admin in [probe.join("agent.sock"), probe.join("admin/agent.sock")] {
        let config = w.tmp.path().join("agent.toml");
        std::fs::write(
            &config,
            format!(
                "[agent]\nsocket = {:?}\nprobe_socket = {:?}\n",
                admin.display().to_string(),
                probe.join("probe.sock").display().to_string()
            ),
        )
        .unwrap();
        let r = w.gpusnap(&["agent", "--config", config.to_str().unwrap()]);
        assert_eq!(r.code, 2, "{}", r.stderr);
        assert!(r.stderr.contains("which pods may mount"), "{}", r.stderr);
        assert!(!admin.exists());
    }
}

#[test]
fn a_probe_directory_another_user_owns_is_refused() {
    if !can_run(&[]) {
        return;
    }
    let mut a = Agent::new("", "", "");
    let dir = a.run.join("probe");
    std::fs::create_dir_all(&dir).unwrap();
    nix::unistd::chown(&dir, Some(nix::unistd::Uid::from_raw(1000)), None).unwrap();
    let cfg = a.config.display().to_string();
    let r = a.w.gpusnap(&["agent", "--config", &cfg]);
    assert_ne!(r.code, 0);
    assert!(r.stderr.contains("belongs to uid 1000"), "{}", r.stderr);
    assert!(!a.probe().exists() && !a.admin().exists());
    a.agent = None;
}
