//! The front door on a node shared by tenants: it asks for a key before it
//! routes, lists or wakes anything; a client cannot hold a body open or
//! fill the agent's memory with bodies; its anonymous answers name no path
//! of the host; with `route_only_models` only services that list `models`
//! are reached.

mod common;

use common::*;
use serde_json::Value;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

const LONG: Duration = Duration::from_secs(60);
const KEY: &str = "sk-tenant-0123456789abcdef";

struct Agent {
    w: World,
    socket: PathBuf,
    http: u16,
    secret: String,
    idx: usize,
    _sockdir: tempfile::TempDir,
}

impl Agent {
    /// An agent with `[agent.http]` keys `http`, a service `alpha` (an
    /// OpenAI-style server of model `m-alpha`, started `start`) and
    /// `services` more (TOML tables).
    fn start(http_keys: &str, start: &str, services: &str) -> Self {
        let w = World::new(&[1000]);
        let sockdir = tempfile::Builder::new().prefix("gpusnap-keys-test").tempdir_in("/tmp").unwrap();
        let socket = sockdir.path().join("agent.sock");
        let script = w.tmp.path().join("fake_openai.py");
        std::fs::write(&script, include_str!("fake_openai.py")).unwrap();
        let py = Command::new("python3").args(["-c", "import sys; print(sys.executable)"]).output().unwrap();
        let py = String::from_utf8(py.stdout).unwrap().trim().to_string();
        let (http, listen, backend) = (free_port(), free_port(), free_port());
        let secret = format!("secret-alpha-{}", std::process::id());
        let text = format!(
            "[agent]\nsocket = {:?}\nhttp_listen = \"127.0.0.1:{http}\"\n[agent.http]\n{http_keys}\n\n\
             [[service]]\nname = \"alpha\"\nlisten = \"127.0.0.1:{listen}\"\nbackend = \"127.0.0.1:{backend}\"\n\
             models = [\"m-alpha\"]\nstart = \"{start}\"\nsuspend_after = \"never\"\n\
             command = [{py:?}, {:?}, \"--port\", \"{backend}\", \"--model\", \"m-alpha\", \"--secret\", \"{secret}\"]\n\
             {services}\n",
            socket.display().to_string(),
            script.display().to_string(),
        );
        let config = w.tmp.path().join("agent.toml");
        std::fs::write(&config, text).unwrap();
        let mut a = Agent { w, socket, http, secret, idx: 0, _sockdir: sockdir };
        a.idx = a.w.spawn_gpusnap(&["agent", "--config", config.to_str().unwrap()]);
        let sock = a.socket.clone();
        let up = wait_until(LONG, || UnixStream::connect(&sock).is_ok());
        assert!(up, "the agent did not start: {}", a.log());
        a
    }

    /// curl on the front door: (status, body).
    fn curl(&self, args: &[&str], path: &str) -> (u16, String) {
        let out = Command::new("curl")
            .args(["-sS", "-i", "--max-time", "60"])
            .args(args)
            .arg(format!("http://127.0.0.1:{}{path}", self.http))
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        (head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0), body.to_string())
    }

    fn chat(&self, model: &str, extra: &[&str]) -> (u16, String) {
        let body =
            format!("{{\"model\":\"{model}\",\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}]}}");
        let mut args = vec!["-H", "Content-Type: application/json", "--data-binary", &body];
        args.extend_from_slice(extra);
        self.curl(&args, "/v1/chat/completions")
    }
}

impl AgentClient for Agent {
    fn api(&self, method: &str, path: &str) -> (u16, String) {
        let (text, read) = http::unix_request(&self.socket, method, path, LONG);
        read.unwrap();
        http::split(&text)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.w.tmp.path().join(format!("gpusnap-{}.err", self.idx)))
            .unwrap_or_default()
    }

    fn world(&mut self) -> &mut World {
        &mut self.w
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.w.children[self.idx].kill();
        adopt_recorded_services(&mut self.w);
    }
}

fn json(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}"))
}

#[test]
fn the_front_door_asks_for_a_key_before_it_routes_lists_or_wakes() {
    let a = Agent::start(&format!("api_keys = [{KEY:?}]"), "on-demand", "");
    let bearer = format!("Authorization: Bearer {KEY}");
    for extra in [vec![], vec!["-H", "Authorization: Bearer sk-someone-elses-key-000"]] {
        let (code, body) = a.chat("m-alpha", &extra);
        assert_eq!(code, 401, "{body}");
        assert_eq!(json(&body)["error"]["type"], "invalid_request_error", "{body}");
        let (code, body) = a.curl(&extra, "/v1/models");
        assert_eq!(code, 401, "{body}");
        assert!(!body.contains("m-alpha"), "{body}");
    }
    // Nothing was started for them.
    let state = a.service("alpha")["state"].clone();
    assert!(state != "running" && state != "starting", "{state}");
    // The health check answers anyone; the key opens the rest.
    assert_eq!(a.curl(&[], "/healthz").0, 200);
    let (code, body) = a.curl(&["-H", &bearer], "/v1/models");
    assert_eq!(code, 200, "{body}");
    let (code, body) = a.chat("m-alpha", &["-H", &bearer]);
    assert_eq!(code, 200, "{body}");
    assert!(body.contains(&a.secret), "{body}");
}

/// Reads until the agent closes or answers; the status line's code.
fn status_of(s: &mut TcpStream) -> u16 {
    s.set_read_timeout(Some(LONG)).unwrap();
    let mut buf = [0u8; 4096];
    let n = s.read(&mut buf).unwrap_or(0);
    let text = String::from_utf8_lossy(&buf[..n]).to_string();
    text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0)
}

#[test]
fn the_front_door_holds_no_body_past_its_time_or_its_budget() {
    let a = Agent::start(
        "body_timeout = \"2s\"\nmax_body = \"40KiB\"\nmax_body_in_flight = \"64KiB\"",
        "boot",
        "",
    );
    let connect = || TcpStream::connect(("127.0.0.1", a.http)).unwrap();
    // A body sent one byte and no more is answered 408, not held.
    let mut slow = connect();
    slow.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
        .unwrap();
    // While it is held, a body that would take the bytes in flight past
    // the budget is refused at once, before it is read.
    let mut big = connect();
    big.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 40000\r\n\r\n").unwrap();
    let mut bigger = connect();
    bigger
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 40000\r\n\r\n")
        .unwrap();
    let codes = [status_of(&mut slow), status_of(&mut big), status_of(&mut bigger)];
    assert_eq!(codes.iter().filter(|c| **c == 408).count(), 2, "{codes:?}");
    assert_eq!(codes.iter().filter(|c| **c == 503).count(), 1, "{codes:?}");
    assert_eq!(a.curl(&[], "/healthz").0, 200);
    let (code, body) = a.chat("m-alpha", &[]);
    assert_eq!(code, 200, "the budget came back: {body}");
}

#[test]
fn anonymous_answers_name_no_path_and_only_services_with_models_are_routed() {
    let more: String = [("beta", ""), ("gamma", "models = [\"m-gamma\"]\n")]
        .iter()
        .map(|(name, models)| {
            format!(
                "[[service]]\nname = \"{name}\"\nlisten = \"127.0.0.1:{}\"\nbackend = \"127.0.0.1:{}\"\n{models}\
                 command = [\"/nonexistent/gpusnap-test/server\"]\nsuspend_after = \"never\"\n\n",
                free_port(),
                free_port()
            )
        })
        .collect();
    let a = Agent::start("route_only_models = true", "boot", &more);
    let failed = wait_until(LONG, || !a.service("gamma")["last_error"].is_null());
    assert!(failed, "{}", a.service("gamma"));
    let why = a.service("gamma")["last_error"].as_str().unwrap_or_default().to_string();
    assert!(why.contains("/"), "the reason names a path of the host: {why}");
    let (code, body) = a.curl(&[], "/v1/models");
    assert_eq!(code, 200, "{body}");
    assert!(!body.contains("/nonexistent"), "a path of the host in an anonymous answer: {body}");
    let (_, body) = a.chat("m-gamma", &[]);
    assert!(!body.contains("/nonexistent"), "{body}");
    // beta lists no models: not by model, Host, nor path.
    assert!(!body.contains("\"beta\""), "{body}");
    let (_, models) = a.curl(&[], "/v1/models");
    assert!(!models.contains("beta"), "{models}");
    for (args, path) in [(vec![], "/beta/v1/models"), (vec!["-H", "Host: beta"], "/v1/completions")] {
        let (code, body) = a.curl(&args, path);
        assert_eq!(code, 404, "{path}: {body}");
    }
    let (code, body) = a.chat("beta", &[]);
    assert_eq!(code, 404, "{body}");
}
