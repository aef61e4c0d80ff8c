//! The agent's front door (`[agent] http_listen`) against real processes:
//! the agent, curl as the client, OpenAI-style servers (fake_openai.py,
//! streaming server-sent events with a secret only each server knows) and
//! fake CUDA servers (`fake-workload --http`) behind it; moto_server as the
//! remote a hibernated service's image is pushed to and pulled from.

mod common;

use common::*;
use serde_json::Value;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const LONG: Duration = Duration::from_secs(60);

enum Kind {
    /// fake_openai.py: start delayed this many seconds, or failing.
    OpenAi { delay: f64, fail: bool },
    /// fake-workload --http holding this many MiB on the fake GPU 0.
    Gpu { mib: u64 },
}

struct S {
    name: &'static str,
    kind: Kind,
    extra: &'static str,
}

fn openai(name: &'static str, extra: &'static str) -> S {
    S { name, kind: Kind::OpenAi { delay: 0.0, fail: false }, extra }
}

struct Door {
    w: World,
    socket: PathBuf,
    http: u16,
    /// Per service: (listen, backend) ports and its secret.
    svcs: HashMap<String, (u16, u16, String)>,
    agent: Option<usize>,
    _sockdir: tempfile::TempDir,
}

fn python() -> String {
    let out = Command::new("python3").args(["-c", "import sys; print(sys.executable)"]).output().unwrap();
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

impl Door {
    fn start(gpu_mib: u64, agent_extra: &str, svcs: &[S], env: &[(String, String)]) -> Self {
        Self::start_on(gpu_mib, agent_extra, svcs, env, &HashMap::new())
    }

    /// [`Door::start`] with these services' backends on given ports.
    fn start_on(
        gpu_mib: u64,
        agent_extra: &str,
        svcs: &[S],
        env: &[(String, String)],
        backends: &HashMap<&str, u16>,
    ) -> Self {
        let w = World::new(&[gpu_mib]);
        let sockdir = tempfile::Builder::new().prefix("gpusnap-door-test").tempdir_in("/tmp").unwrap();
        let socket = sockdir.path().join("agent.sock");
        let script = w.tmp.path().join("fake_openai.py");
        std::fs::write(&script, include_str!("fake_openai.py")).unwrap();
        let http = free_port();
        let (agent_keys, agent_tables) =
            agent_extra.split_once("\n[").map_or((agent_extra, String::new()), |(k, t)| (k, format!("[{t}")));
        let mut text = format!(
            "[agent]\nsocket = {:?}\nhttp_listen = \"127.0.0.1:{http}\"\n{agent_keys}\n{agent_tables}\n",
            socket.display().to_string()
        );
        let py = python();
        let mut ports = HashMap::new();
        for s in svcs {
            let (listen, backend) = (free_port(), backends.get(s.name).copied().unwrap_or_else(free_port));
            let secret = format!("secret-{}-{}", s.name, std::process::id());
            let command = match s.kind {
                Kind::OpenAi { delay, fail } => {
                    let mut c = format!(
                        "[{py:?}, {:?}, \"--port\", \"{backend}\", \"--model\", \"{}\", \"--secret\", \"{secret}\", \"--delay-start\", \"{delay}\"",
                        script.display().to_string(),
                        s.name
                    );
                    if fail {
                        c += ", \"--fail\"";
                    }
                    c + "]"
                }
                Kind::Gpu { mib } => format!(
                    "[{:?}, \"--mib\", \"{mib}\", \"--gpu\", \"0\", \"--http\", \"{backend}\"]",
                    fake_workload_bin().display().to_string()
                ),
            };
            // Parking is off unless the service asks for it.
            let park = if s.extra.contains("park = ") { "" } else { "park = false\n" };
            text += &format!(
                "\n[[service]]\nname = \"{}\"\nlisten = \"127.0.0.1:{listen}\"\nbackend = \"127.0.0.1:{backend}\"\ncommand = {command}\n{park}min_resident = \"0s\"\n{}\n",
                s.name, s.extra
            );
            ports.insert(s.name.to_string(), (listen, backend, secret));
        }
        let config = w.tmp.path().join("agent.toml");
        std::fs::write(&config, text).unwrap();
        let mut d = Door { w, socket, http, svcs: ports, agent: None, _sockdir: sockdir };
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let cfg = config.display().to_string();
        d.agent = Some(d.w.spawn_gpusnap_env(&["agent", "--config", &cfg], &env));
        let sock = d.socket.clone();
        let up = wait_until(LONG, || UnixStream::connect(&sock).is_ok());
        assert!(up, "the agent did not start: {}", d.log());
        d
    }

    fn secret(&self, name: &str) -> &str {
        &self.svcs[name].2
    }

    /// curl against the front door: (status, headers, body).
    fn curl(&self, args: &[&str]) -> (u16, String, String) {
        curl_at(self.http, args)
    }

    fn chat(&self, model: &str, stream: bool) -> (u16, String, String) {
        let body = format!(
            "{{\"model\":\"{model}\",\"stream\":{stream},\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}]}}"
        );
        self.curl(&[
            "-N",
            "-H",
            "Content-Type: application/json",
            "--data-binary",
            &body,
            "/v1/chat/completions",
        ])
    }

    /// The agent's journal notes, as text.
    fn notes(&self) -> String {
        let (code, events) = self.api("GET", "/v1/events?after=0&follow=false");
        assert_eq!(code, 200);
        events
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|e| e["op"] == "agent")
            .map(|e| e["detail"].as_str().unwrap_or_default().to_string() + "\n")
            .collect()
    }

    fn wait_note(&self, what: &str) {
        let found = wait_until(LONG, || self.notes().contains(what));
        assert!(found, "no note {what:?}:\n{}\nagent log: {}", self.notes(), self.log());
    }
}

impl AgentClient for Door {
    fn api(&self, method: &str, path: &str) -> (u16, String) {
        let (text, read) = http::unix_request(&self.socket, method, path, LONG);
        read.unwrap();
        http::split(&text)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.w.tmp.path().join(format!("gpusnap-{}.err", self.agent.unwrap_or(0))))
            .unwrap_or_default()
    }

    fn world(&mut self) -> &mut World {
        &mut self.w
    }
}

impl Drop for Door {
    fn drop(&mut self) {
        if let Some(n) = self.agent.take() {
            self.w.children[n].kill();
        }
        adopt_recorded_services(&mut self.w);
    }
}

/// curl on 127.0.0.1:PORT; the last argument is the path. (status, headers, body).
fn curl_at(port: u16, args: &[&str]) -> (u16, String, String) {
    let (path, rest) = args.split_last().unwrap();
    let t0 = Instant::now();
    let out = Command::new("curl")
        .args(["-sS", "-i", "--max-time", "60"])
        .args(rest)
        .arg(format!("http://127.0.0.1:{port}{path}"))
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let code = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    eprintln!("curl {args:?}: {code} in {:?}", t0.elapsed());
    (code, head.to_string(), body.to_string())
}

fn json(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}"))
}

#[test]
fn front_door_routes_by_model_and_streams_answers_untouched() {
    let mut d = Door::start(
        1000,
        "[agent.http]\nmax_body = \"16KiB\"",
        &[
            openai("alpha", "models = [\"alpha-7b\"]\nsuspend_after = \"never\""),
            openai(
                "beta",
                "models = [\"beta-8b\", \"beta-70b\"]\nsuspend_after = \"never\"\nstart = \"on-demand\"",
            ),
        ],
        &[],
    );
    d.wait_state("alpha", "running");
    // On demand: not started with the agent, and shown as such everywhere.
    let beta = d.service("beta");
    assert_eq!((beta["state"].as_str(), beta["pid"].as_i64()), (Some("idle"), None), "{beta}");
    assert_eq!(beta["last_error"], Value::Null, "{beta}");
    let r = d.w.gpusnap(&["services", "--socket", &d.socket.display().to_string()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let line = r.stdout.lines().find(|l| l.starts_with("beta")).unwrap_or_default();
    assert!(line.contains("idle") && !line.contains("dead"), "{}", r.stdout);
    let (code, metrics) = d.api("GET", "/metrics");
    assert_eq!(code, 200);
    let idle = metrics.lines().find(|l| l.contains("_services{state=\"idle\"}"));
    assert!(idle.is_some_and(|l| l.ends_with(" 1")), "{metrics}");

    let (code, _, body) = d.curl(&["/healthz"]);
    assert_eq!(code, 200, "{body}");
    let (code, _, body) = d.curl(&["/readyz"]);
    assert_eq!(code, 200, "{body}");
    let (code, _, body) = d.curl(&["/v1/models"]);
    assert_eq!(code, 200, "{body}");
    let models = json(&body);
    let listed: Vec<(String, String, String)> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["id"].as_str().unwrap().into(),
                m["service"].as_str().unwrap().into(),
                m["state"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert_eq!(
        listed,
        vec![
            ("alpha-7b".into(), "alpha".into(), "running".into()),
            ("beta-8b".into(), "beta".into(), "idle".into()),
            ("beta-70b".into(), "beta".into(), "idle".into()),
        ],
        "{body}"
    );

    // The first request for beta's model starts it, waits, and streams its
    // answer: the same bytes as the server sends to a client of its own.
    let (code, head, through) = d.chat("beta-70b", true);
    assert_eq!(code, 200, "{head}\n{through}\n{}", d.log());
    assert!(head.to_ascii_lowercase().contains("content-type: text/event-stream"), "{head}");
    assert!(through.contains(d.secret("beta")) && through.ends_with("data: [DONE]\n\n"), "{through}");
    assert_eq!(through.matches("data: ").count(), 4, "{through}");
    d.wait_state("beta", "running");
    let backend = d.svcs["beta"].1;
    let body = "{\"model\":\"beta-70b\",\"stream\":true,\"messages\":[]}";
    let (_, _, direct) = curl_at(backend, &["-N", "--data-binary", body, "/v1/chat/completions"]);
    assert_eq!(through, direct);

    // Each model to its service, not streamed too.
    let (code, _, body) = d.chat("alpha-7b", false);
    assert_eq!(code, 200, "{body}");
    let v = json(&body);
    assert_eq!(v["choices"][0]["message"]["content"], format!("Hello from {}", d.secret("alpha")), "{body}");
    let (_, _, body) = d.chat("beta-8b", false);
    assert!(body.contains(d.secret("beta")), "{body}");

    // Keep-alive: two requests, one connection.
    let out = Command::new("curl")
        .args(["-sS", "-o", "/dev/null", "-o", "/dev/null", "-w", "%{http_code} %{num_connects}\n"])
        .arg(format!("http://127.0.0.1:{}/alpha/count", d.http))
        .arg(format!("http://127.0.0.1:{}/beta/count", d.http))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "200 1\n200 0\n");

    // By path prefix (stripped) and by Host.
    let (code, _, body) = d.curl(&["/alpha/count"]);
    assert_eq!((code, json(&body)["served"].as_u64()), (200, Some(1)), "{body}");
    let (_, _, body) = d.curl(&["-H", "Host: beta.models.example", "/some/path?x=1"]);
    let v = json(&body);
    assert_eq!((v["model"].as_str(), v["path"].as_str()), (Some("beta"), Some("/some/path?x=1")), "{body}");

    // What cannot be routed, and what is too large.
    let (code, _, body) = d.chat("gamma", false);
    assert_eq!(code, 404, "{body}");
    assert_eq!(json(&body)["error"]["code"], "model_not_found", "{body}");
    let (code, _, body) = d.curl(&["--data-binary", "not json", "/v1/completions"]);
    assert_eq!(code, 404, "{body}");
    let big = format!("{{\"model\":\"alpha-7b\",\"prompt\":\"{}\"}}", "x".repeat(20 << 10));
    let file = d.w.tmp.path().join("big.json");
    std::fs::write(&file, big).unwrap();
    let (code, _, body) = d.curl(&["--data-binary", &format!("@{}", file.display()), "/v1/completions"]);
    assert_eq!(code, 413, "{body}");
    // Nothing of those reached a server.
    let (_, _, body) = d.curl(&["/alpha/count"]);
    assert_eq!(json(&body)["served"], 1, "{body}");
}

/// A 503 with a JSON reason (containing `why`) and a Retry-After header.
fn assert_refused(r: &(u16, String, String), why: &str) -> Value {
    let (code, head, body) = r;
    assert_eq!(*code, 503, "{head}\n{body}");
    assert!(head.to_ascii_lowercase().contains("\r\nretry-after: "), "{head}");
    let v = json(body);
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains(why), "{why:?} not in {body}");
    // OpenAI's `code` is a string: the same kind of value on every answer.
    assert_eq!(v["error"]["code"], "service_unavailable", "{body}");
    v
}

#[test]
fn front_door_fails_fast_with_an_answer_and_drops_clients_that_hang_up() {
    let mut d = Door::start(
        1000,
        "",
        &[
            // A start that fails: the answer comes at once, not after wake_timeout.
            S {
                name: "broken",
                kind: Kind::OpenAi { delay: 0.0, fail: true },
                extra: "start = \"on-demand\"\nwake_timeout = \"600s\"",
            },
            // The same on its own port, opted in.
            S {
                name: "own",
                kind: Kind::OpenAi { delay: 0.0, fail: true },
                extra: "start = \"on-demand\"\nwake_timeout = \"600s\"\nfail_fast = true",
            },
            S {
                name: "slow",
                kind: Kind::OpenAi { delay: 8.0, fail: false },
                extra: "start = \"on-demand\"\nmax_waiting = 1\nsuspend_after = \"never\"",
            },
            S {
                name: "late",
                kind: Kind::OpenAi { delay: 600.0, fail: false },
                extra: "start = \"on-demand\"\nwake_timeout = \"1s\"",
            },
            S {
                name: "hang2",
                kind: Kind::OpenAi { delay: 8.0, fail: false },
                extra: "start = \"on-demand\"\nsuspend_after = \"never\"\nfail_fast = true",
            },
            S {
                name: "hang",
                kind: Kind::OpenAi { delay: 8.0, fail: false },
                extra: "start = \"on-demand\"\nsuspend_after = \"never\"",
            },
        ],
        &[],
    );
    let v = assert_refused(&d.chat("broken", false), "could not start");
    assert_eq!(v["error"]["service"], "broken");
    // While its restart is not due, at once again, saying when.
    assert_refused(&d.chat("broken", false), "next start in");
    let (code, _, body) = d.curl(&["/v1/models"]);
    assert_eq!(code, 200);
    let broken =
        json(&body)["data"].as_array().unwrap().iter().find(|m| m["id"] == "broken").unwrap().clone();
    assert_eq!(broken["available"], false, "{broken}");

    let own = d.svcs["own"].0;
    assert_refused(&curl_at(own, &["--data-binary", "{}", "/v1/completions"]), "own");

    // max_waiting full: the second request is refused while the first waits.
    let port = d.http;
    let first = std::thread::spawn(move || {
        curl_at(port, &["--data-binary", "{\"model\":\"slow\"}", "/v1/chat/completions"])
    });
    let waiting = wait_until(LONG, || d.service("slow")["waiting"] == 1);
    assert!(waiting, "{}", d.service("slow"));
    assert_refused(&d.chat("slow", false), "already wait");
    let (code, _, body) = first.join().unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(body.contains(d.secret("slow")), "{body}");

    // wake_timeout reached.
    assert_refused(&d.chat("late", false), "wake_timeout");

    // A client that hangs up while its service starts leaves the wait; its
    // request never reaches the server.
    let mut s = std::net::TcpStream::connect(("127.0.0.1", d.http)).unwrap();
    let body = "{\"model\":\"hang\"}";
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let started = wait_until(LONG, || d.service("hang")["waiting"] == 1);
    assert!(started, "{}", d.service("hang"));
    drop(s);
    let left = wait_until(LONG, || d.service("hang")["waiting"] == 0);
    assert!(left, "{}", d.service("hang"));
    d.wait_state("hang", "running");
    let (code, _, body) = d.curl(&["/hang/count"]);
    assert_eq!((code, json(&body)["served"].as_u64()), (200, Some(0)), "{body}");
    // So does a service's own port, with fail_fast.
    let mut s = std::net::TcpStream::connect(("127.0.0.1", d.svcs["hang2"].0)).unwrap();
    write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{{}}").unwrap();
    let started = wait_until(LONG, || d.service("hang2")["waiting"] == 1);
    assert!(started, "{}", d.service("hang2"));
    drop(s);
    let left = wait_until(LONG, || d.service("hang2")["waiting"] == 0);
    assert!(left, "{}", d.service("hang2"));
    d.wait_state("hang2", "running");
    let (code, _, body) = d.curl(&["/hang2/count"]);
    assert_eq!((code, json(&body)["served"].as_u64()), (200, Some(0)), "{body}");
}

/// moto_server with a bucket `models`; without it the test is skipped here
/// and fails on CI (.ci/run installs it).
fn moto_models() -> Option<Moto> {
    let m = moto(&[])?;
    let (code, _, _) = curl_at(m.port, &["-X", "PUT", "/models"]);
    assert_eq!(code, 200, "bucket created");
    Some(m)
}

/// fake-workload's answer: (pid, requests served, memory intact).
fn served_by(r: &(u16, String, String)) -> (i64, u64, bool) {
    assert_eq!(r.0, 200, "{}\n{}", r.1, r.2);
    let text = completion_text(&r.2);
    let f: Vec<&str> = text.split_whitespace().collect();
    assert_eq!(f.first(), Some(&"ok"), "{}", r.2);
    (f[1].parse().unwrap(), f[2].parse().unwrap(), f[3] == "1")
}

/// The text of a fake model server's answer to a chat completion: OpenAI's
/// JSON, or its server-sent events (each chunk's delta), or plain text.
fn completion_text(body: &str) -> String {
    if let Ok(v) = serde_json::from_str::<Value>(body) {
        let c = &v["choices"][0];
        return c["message"]["content"].as_str().or(c["text"].as_str()).unwrap_or_default().to_string();
    }
    if body.contains("data: ") {
        return body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter_map(|d| serde_json::from_str::<Value>(d).ok())
            .filter_map(|v| v["choices"][0]["delta"]["content"].as_str().map(str::to_string))
            .collect();
    }
    body.to_string()
}

#[test]
fn front_door_swaps_models_and_a_lost_image_comes_back_from_the_remote_or_cold() {
    criu_present();
    let Some(m) = moto_models() else { return };
    macro_rules! gpu {
        ($more:literal) => {
            concat!("suspend_after = \"1h\"\ngpu_memory = \"600MiB\"\nwake_timeout = \"60s\"\n", $more)
        };
    }
    const A: &str = gpu!("models = [\"a-model\"]\nremote = \"s3://models/node1\"");
    const B: &str = gpu!("models = [\"b-model\"]\nstart = \"on-demand\"");
    let mut d = Door::start(
        1000,
        "",
        &[
            S { name: "a", kind: Kind::Gpu { mib: 600 }, extra: A },
            S { name: "b", kind: Kind::Gpu { mib: 600 }, extra: B },
        ],
        &s3_env(m.port),
    );
    // Both on one GPU that holds one: each request for the other model swaps.
    let pa = d.wait_state("a", "running")["pid"].as_i64().unwrap();
    assert_eq!(served_by(&d.chat("a-model", false)), (pa, 1, true));
    let (pb, n, intact) = served_by(&d.chat("b-model", false));
    assert_eq!((n, intact), (1, true));
    d.wait_state("b", "running");
    assert_eq!(d.service("a")["state"], "suspended");
    assert_eq!(served_by(&d.chat("a-model", false)), (pa, 2, true));
    assert_eq!(d.service("b")["state"], "suspended");

    // Hibernated: its image has the service's stable name and is pushed.
    let (code, body) = d.api("POST", "/v1/services/a/hibernate");
    assert_eq!(code, 200, "{body}");
    assert_eq!(d.wait_state("a", "hibernated")["image"], "agent.a");
    d.wait_note("agent.a pushed to s3://models/node1");
    // The image a service wakes from is not removed by mistake.
    let r = d.w.gpusnap(&["images", "rm", "agent.a"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("wakes from") && r.stderr.contains("--force"), "{}", r.stderr);
    let r = d.w.gpusnap(&["images", "rm", "agent.a", "--force"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    // Gone here: the request wakes it from the remote, the same process
    // with its memory (its count of requests) intact.
    assert_eq!(served_by(&d.chat("a-model", false)), (pa, 3, true));
    d.wait_state("a", "running");
    d.wait_note("image agent.a was gone: pulled from s3://models/node1/agent.a");

    // Without a remote, a service that may restart starts cold.
    let (code, body) = d.api("POST", "/v1/services/b/hibernate");
    assert_eq!(code, 200, "{body}");
    d.wait_state("b", "hibernated");
    let r = d.w.gpusnap(&["images", "rm", "agent.b", "--force"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let (cold, n, intact) = served_by(&d.chat("b-model", false));
    assert_ne!(cold, pb);
    assert_eq!((n, intact), (1, true));
    d.wait_state("b", "running");
    d.wait_note("image agent.b is gone (no remote): a cold start");
}

/// Reads until the server closes the connection (or resets it): what it
/// sent before, if anything.
fn until_closed(s: &mut std::net::TcpStream) -> String {
    s.set_read_timeout(Some(LONG)).unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("still open: {e}; read so far: {:?}", String::from_utf8_lossy(&out)),
        }
    }
    String::from_utf8_lossy(&out).to_string()
}

#[test]
fn front_door_bounds_connections_header_time_and_size() {
    let d = Door::start(
        1000,
        "[agent.http]\nmax_connections = 2\nheader_timeout = \"5s\"\nmax_header = \"8KiB\"",
        &[openai("alpha", "suspend_after = \"never\"")],
        &[],
    );
    let connect = || std::net::TcpStream::connect(("127.0.0.1", d.http)).unwrap();
    // Two clients that never finish their headers hold both slots...
    let mut slow: Vec<_> = (0..2).map(|_| connect()).collect();
    for s in &mut slow {
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n").unwrap();
    }
    // ...so a third is closed unanswered, its request complete or not.
    let mut third = connect();
    let _ = third.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n");
    let answer = until_closed(&mut third);
    assert!(answer.is_empty(), "{answer}");
    // The slow ones are disconnected at header_timeout; the slots are free again.
    for s in &mut slow {
        let answer = until_closed(s);
        assert!(!answer.contains("200 OK"), "{answer}");
    }
    let (code, _, body) = d.curl(&["/healthz"]);
    assert_eq!(code, 200, "{body}");
    // Headers over max_header end the connection.
    let mut big = connect();
    let _ = write!(big, "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n", "y".repeat(16 << 10));
    let answer = until_closed(&mut big);
    assert!(!answer.contains("200 OK"), "{answer}");
    let (code, _, body) = d.curl(&["/healthz"]);
    assert_eq!(code, 200, "{body}");
}

#[test]
fn front_door_wakes_another_nodes_image_from_the_remote_only_if_its_key_is_trusted() {
    criu_present();
    let Some(m) = moto_models() else { return };
    const ON_DEMAND: &str = "models = [\"a-model\"]\nsuspend_after = \"1h\"\ngpu_memory = \"600MiB\"\n\
                             wake_timeout = \"60s\"\nremote = \"s3://models/shared\"\nstart = \"on-demand\"";
    let a_svc = |extra| [S { name: "a", kind: Kind::Gpu { mib: 600 }, extra }];
    // Node 1: its remote holds nothing yet, so the first request starts
    // the server cold; then it is hibernated and its image pushed.
    let mut one = Door::start(1000, "", &a_svc(ON_DEMAND), &s3_env(m.port));
    assert_eq!(one.service("a")["state"], "idle");
    let (pa, n, intact) = served_by(&one.chat("a-model", false));
    assert_eq!((n, intact), (1, true));
    assert_eq!(one.wait_state("a", "running")["pid"].as_i64(), Some(pa));
    let (code, body) = one.api("POST", "/v1/services/a/hibernate");
    assert_eq!(code, 200, "{body}");
    one.wait_state("a", "hibernated");
    one.wait_note("agent.a pushed to s3://models/shared");
    let r = one.w.gpusnap(&["images", "key"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let key = r.stdout.trim().to_string();
    assert_eq!(key.len(), 64, "{key}");

    // A node that does not trust node 1's key refuses its image, with why,
    // and starts nothing in its place.
    let mut other = Door::start(1000, "", &a_svc(ON_DEMAND), &s3_env(m.port));
    assert_eq!(other.service("a")["state"], "idle");
    let r = other.chat("a-model", false);
    let v = assert_refused(&r, &key);
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("[agent] trust"), "{v}");
    let s = other.wait_state("a", "idle");
    assert_eq!(s["pid"], Value::Null, "{s}");
    assert!(s["last_error"].as_str().unwrap_or_default().contains(&key), "{s}");
    drop(other);

    // A node that trusts it wakes node 1's process on its first request:
    // the same process, its memory (its count of requests) intact. (Its
    // own state directory; the fake GPU is node 1's, whose driver state the
    // process carries.)
    let mut env = s3_env(m.port);
    env.push(("GPUSNAP_FAKE_DIR".into(), one.w.fake_dir().display().to_string()));
    // The woken server listens where it did on node 1: its backend port.
    let backend = HashMap::from([("a", one.svcs["a"].1)]);
    let mut two = Door::start_on(1000, &format!("trust = [\"{key}\"]"), &a_svc(ON_DEMAND), &env, &backend);
    assert_eq!(two.service("a")["state"], "idle");
    let r = two.chat("a-model", false);
    assert_eq!(r.0, 200, "{r:?}\nagent log: {}", two.log());
    assert_eq!(served_by(&r), (pa, 2, true));
    two.wait_state("a", "running");
    two.wait_note("a: woken from agent.a");
}

#[test]
fn front_door_hibernate_right_after_a_request_waits_for_its_kept_backend_connection() {
    criu_present();
    const A: &str =
        "models = [\"a-model\"]\nsuspend_after = \"1h\"\ngpu_memory = \"600MiB\"\nwake_timeout = \"60s\"";
    let mut d = Door::start(1000, "", &[S { name: "a", kind: Kind::Gpu { mib: 600 }, extra: A }], &[]);
    let pa = d.wait_state("a", "running")["pid"].as_i64().unwrap();
    // Each request leaves its backend connection kept; the hibernation
    // asked right after it must not find it open (CRIU cannot dump it).
    for n in 1..=3 {
        assert_eq!(served_by(&d.chat("a-model", false)), (pa, n, true));
        let (code, body) = d.api("POST", "/v1/services/a/hibernate");
        assert_eq!(code, 200, "hibernation {n}: {body}\nagent log: {}", d.log());
        d.wait_state("a", "hibernated");
    }
    assert_eq!(served_by(&d.chat("a-model", false)), (pa, 4, true));
}

/// Reads one HTTP/1.1 answer (with Content-Length) from `s`: its head and body.
fn read_answer(s: &mut std::net::TcpStream) -> (String, String) {
    s.set_read_timeout(Some(LONG)).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&got).to_string();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().to_string())
                })
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(0);
            if body.len() >= len {
                return (head.to_string(), body[..len].to_string());
            }
        }
        match s.read(&mut buf) {
            Ok(0) => panic!("closed after {text:?}"),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => panic!("{e}; read so far: {text:?}"),
        }
    }
}

#[test]
fn fail_fast_answers_every_request_of_a_kept_alive_connection() {
    const K: &str = "suspend_after = \"1h\"\nfail_fast = true\nwake_timeout = \"60s\"\n\
                     hooks.after_resume = { path = \"/wake_up?fail=1\" }";
    let mut d = Door::start(1000, "", &[S { name: "k", kind: Kind::Gpu { mib: 300 }, extra: K }], &[]);
    let pid = d.wait_state("k", "running")["pid"].as_i64().unwrap();
    let mut s = std::net::TcpStream::connect(("127.0.0.1", d.svcs["k"].0)).unwrap();
    let ask = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}";
    s.write_all(ask.as_bytes()).unwrap();
    let (head, body) = read_answer(&mut s);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}\n{body}");
    assert!(completion_text(&body).starts_with(&format!("ok {pid} 1 ")), "{body}");
    // Suspended with the connection open; its resume then fails (the
    // after_resume hook): the next request on the same connection gets the
    // 503 with the reason, as a new connection would.
    let (code, body) = d.api("POST", "/v1/services/k/suspend");
    assert_eq!(code, 200, "{body}");
    s.write_all(ask.as_bytes()).unwrap();
    let (head, body) = read_answer(&mut s);
    assert!(head.starts_with("HTTP/1.1 503"), "{head}\n{body}");
    assert!(head.to_ascii_lowercase().contains("\r\nretry-after: "), "{head}");
    let v = json(&body);
    assert!(v["error"]["message"].as_str().unwrap_or_default().contains("after_resume"), "{v}");
    assert_eq!(v["error"]["service"], "k", "{v}");
    let rest = until_closed(&mut s);
    assert!(rest.is_empty(), "{rest}");
}

#[test]
fn an_agent_trust_key_that_does_not_parse_is_refused_at_start() {
    let w = World::new(&[1000]);
    let config = w.tmp.path().join("agent.toml");
    let socket = w.tmp.path().join("agent.sock");
    let (listen, backend) = (free_port(), free_port());
    std::fs::write(
        &config,
        format!(
            "[agent]\nsocket = {:?}\ntrust = [\"not-a-key\"]\n\n[[service]]\nname = \"m\"\n\
             listen = \"127.0.0.1:{listen}\"\nbackend = \"127.0.0.1:{backend}\"\ncommand = [\"true\"]\n",
            socket.display().to_string()
        ),
    )
    .unwrap();
    let r = w.gpusnap(&["agent", "--config", &config.display().to_string()]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("[agent] trust: not a public key: not-a-key"), "{}", r.stderr);
}

/// `gpusnap service NAME resume` through the API: a server that cannot
/// start is answered at once with its reason, as the front door answers
/// (not after `wake_timeout`), and the journal says who asked.
#[test]
fn the_apis_resume_answers_a_failed_start_at_once_and_the_journal_says_who_asked() {
    let d = Door::start(
        1000,
        "",
        &[
            S {
                name: "broken",
                kind: Kind::OpenAi { delay: 0.0, fail: true },
                extra: "start = \"on-demand\"\nwake_timeout = \"600s\"",
            },
            S {
                name: "ok",
                kind: Kind::OpenAi { delay: 0.0, fail: false },
                extra: "start = \"on-demand\"\nsuspend_after = \"never\"",
            },
        ],
        &[],
    );
    let t0 = Instant::now();
    let (code, body) = d.api("POST", "/v1/services/broken/resume");
    assert_ne!(code, 200, "{body}");
    assert!(body.contains("could not start"), "{body}");
    // Far below the 600 s wake_timeout it waited for before.
    assert!(t0.elapsed() < Duration::from_secs(120), "{:?}", t0.elapsed());
    let (code, body) = d.api("POST", "/v1/services/broken/resume");
    assert_ne!(code, 200, "{body}");
    assert!(body.contains("next start in"), "{body}");

    // Its first start, asked for through the API.
    let (code, body) = d.api("POST", "/v1/services/ok/resume");
    assert_eq!(code, 200, "{body}");
    let (code, events) = d.api("GET", "/v1/events?after=0&follow=false");
    assert_eq!(code, 200);
    let details: Vec<String> = events
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|e| e["op"] == "agent")
        .filter_map(|e| e["detail"].as_str().map(str::to_string))
        .collect();
    assert!(
        details.iter().any(|d| d.starts_with("ok: started") && d.ends_with("asked through the API")),
        "{details:?}"
    );
    assert!(
        !details.iter().any(|d| d.contains("a connection arrived") || d.contains("first request arrived")),
        "{details:?}"
    );
}

/// With parking on (the agent's default for the servers it starts), a swap
/// through the front door parks the other model instead of suspending it:
/// its context stays on the GPU, the driver is never asked to lock either
/// process, and each comes back with its data intact, streamed or not.
#[test]
fn front_door_swaps_by_parking_without_the_drivers_lock() {
    macro_rules! parked {
        ($more:literal) => {
            concat!(
                "suspend_after = \"1h\"\ngpu_memory = \"600MiB\"\nwake_timeout = \"60s\"\npark = true\n",
                $more
            )
        };
    }
    const A: &str = parked!("models = [\"a-model\"]");
    const B: &str = parked!("models = [\"b-model\"]\nstart = \"on-demand\"");
    let mut d = Door::start(
        1000,
        "",
        &[
            S { name: "a", kind: Kind::Gpu { mib: 600 }, extra: A },
            S { name: "b", kind: Kind::Gpu { mib: 600 }, extra: B },
        ],
        &[],
    );
    let pa = d.wait_state("a", "running")["pid"].as_i64().unwrap();
    assert_eq!(served_by(&d.chat("a-model", false)), (pa, 1, true));
    let (pb, n, intact) = served_by(&d.chat("b-model", false));
    assert_eq!((n, intact), (1, true));
    d.wait_state("b", "running");
    assert_eq!(d.service("a")["state"], "parked");
    assert_eq!(served_by(&d.chat("a-model", true)), (pa, 2, true));
    assert_eq!(d.service("b")["state"], "parked");
    assert_eq!(served_by(&d.chat("b-model", true)), (pb, 2, true));
    let locks = |pid: i64| d.w.calls_on(pid as i32).iter().filter(|c| c.starts_with("lock")).count();
    assert_eq!((locks(pa), locks(pb)), (0, 0), "parked and back, never the driver's lock");
}

/// A headless Chromium's DOM of `url` once its scripts ran, and its
/// screenshot written to `png`; None (after a skip) where none runs.
fn headless(url: &str, png: &std::path::Path) -> Option<String> {
    let run = |extra: &[&str]| {
        Command::new("chromium")
            .args(["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
            .args(["--virtual-time-budget=5000", "--window-size=1400,900"])
            .arg(format!("--user-data-dir={}", png.with_extension("profile").display()))
            .args(extra)
            .arg(url)
            .stdin(Stdio::null())
            .output()
    };
    let dom = match run(&["--dump-dom"]) {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).to_string(),
        Ok(o) => panic!("chromium failed: {}", String::from_utf8_lossy(&o.stderr)),
        Err(e) => {
            gpusnap_testkit::skip(format!(
                "chromium does not run ({e}): apt-get install chromium; .ci/run installs it"
            ));
            return None;
        }
    };
    let shot = run(&[&format!("--screenshot={}", png.display())]).unwrap();
    assert!(shot.status.success(), "{}", String::from_utf8_lossy(&shot.stderr));
    let img = std::fs::read(png).unwrap();
    assert!(img.starts_with(b"\x89PNG") && img.len() > 10_000, "a screenshot of {} bytes", img.len());
    Some(dom)
}

/// The status page in a real browser: each service with its state and the
/// memory it holds, and the last swaps with their phases.
#[test]
fn the_status_page_shows_services_memory_and_swaps_in_a_real_browser() {
    macro_rules! gpu {
        ($more:literal) => {
            concat!("suspend_after = \"1h\"\ngpu_memory = \"600MiB\"\nwake_timeout = \"60s\"\n", $more)
        };
    }
    const A: &str = gpu!("models = [\"a-model\"]");
    const B: &str = gpu!("models = [\"b-model\"]\nstart = \"on-demand\"");
    let mut d = Door::start(
        1000,
        "[agent.http]\nui = true",
        &[
            S { name: "a", kind: Kind::Gpu { mib: 600 }, extra: A },
            S { name: "b", kind: Kind::Gpu { mib: 600 }, extra: B },
        ],
        &[],
    );
    d.wait_state("a", "running");
    served_by(&d.chat("b-model", false));
    d.wait_state("b", "running");
    // a comes back for its request: a swap, traced.
    served_by(&d.chat("a-model", false));
    d.wait_state("a", "running");
    d.wait_state("b", "suspended");

    let (code, _, body) = d.curl(&["/ui/state"]);
    assert_eq!(code, 200, "{body}");
    let s = json(&body);
    let svc = |n: &str| s["services"].as_array().unwrap().iter().find(|x| x["name"] == n).unwrap().clone();
    assert_eq!(
        (svc("a")["state"].as_str(), svc("a")["models"][0].as_str()),
        (Some("running"), Some("a-model"))
    );
    assert_eq!(svc("a")["gpu_bytes"].as_u64(), Some(600 << 20), "{s}");
    assert_eq!(
        (svc("b")["state"].as_str(), svc("b")["host_bytes"].as_u64()),
        (Some("suspended"), Some(600 << 20))
    );
    let swap =
        s["swaps"].as_array().unwrap().iter().rev().find(|w| w["service"] == "a").cloned().expect("a's swap");
    let phases: Vec<&str> =
        swap["phases"].as_array().unwrap().iter().filter_map(|p| p["phase"].as_str()).collect();
    assert!(phases.contains(&"resume") && phases.contains(&"first_byte"), "{swap}");

    let png = d.w.tmp.path().join("status-page.png");
    let Some(dom) = headless(&format!("http://127.0.0.1:{}/ui", d.http), &png) else { return };
    assert!(dom.contains("data-loaded=\"1\""), "the page never drew its data: {dom}");
    assert!(dom.contains("<tr data-service=\"a\">") && dom.contains("<tr data-service=\"b\">"), "{dom}");
    assert!(dom.contains("class=\"state state-running\">running<"), "{dom}");
    assert!(dom.contains("class=\"state state-suspended\">suspended<"), "{dom}");
    assert!(dom.contains(">600.0 MiB<"), "{dom}");
    assert!(dom.contains("<div class=\"swap\" data-service=\"a\">"), "{dom}");
    assert!(dom.contains("title=\"resume: "), "{dom}");
}

/// Off unless enabled; on, its files answer without a key (they hold no
/// data) and its data only with one, which the page asks for.
#[test]
fn the_status_page_is_off_by_default_and_its_data_is_behind_the_api_keys() {
    let off = Door::start(1000, "", &[openai("alpha", "suspend_after = \"never\"")], &[]);
    let (code, _, body) = off.curl(&["/ui"]);
    assert!(!body.contains("<title>gpusnap</title>"), "{code} {body}");
    drop(off);

    const KEY: &str = "sk-status-page-0123456789";
    let d = Door::start(
        1000,
        &format!("[agent.http]\nui = true\napi_keys = [{KEY:?}]"),
        &[openai("alpha", "suspend_after = \"never\"")],
        &[],
    );
    let (code, head, body) = d.curl(&["/ui"]);
    assert_eq!(code, 200, "{head}");
    assert!(body.contains("<title>gpusnap</title>") && head.contains("text/html"), "{head}");
    assert!(head.to_ascii_lowercase().contains("content-security-policy: default-src 'self'"), "{head}");
    assert_eq!(d.curl(&["/ui/state"]).0, 401);
    let auth = format!("Authorization: Bearer {KEY}");
    let (code, _, body) = d.curl(&["-H", &auth, "/ui/state"]);
    assert_eq!(code, 200, "{body}");
    assert_eq!(json(&body)["services"][0]["name"], "alpha");
    let png = d.w.tmp.path().join("status-page-key.png");
    let Some(dom) = headless(&format!("http://127.0.0.1:{}/ui", d.http), &png) else { return };
    assert!(dom.contains("an API key is needed"), "{dom}");
    assert!(!dom.contains("data-service=\"alpha\""), "{dom}");
}
