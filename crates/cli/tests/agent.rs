//! The node agent against the fakes: fake model servers (`fake-workload
//! --http`, a fake CUDA process that touches its device memory before it
//! answers) behind `gpusnap agent`.

mod common;

use common::*;
use serde_json::Value;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const LONG: Duration = Duration::from_secs(60);

/// `park = false` and `min_resident = "0s"` unless `extra` says otherwise:
/// these tests are about the suspend tier and evictions as soon as a
/// service is idle (crates/cli/tests/park_agent.rs has the agent's parking
/// and `min_resident`).
fn suspends(extra: &str) -> String {
    let park = if extra.contains("park =") { "" } else { "park = false\n" };
    let min = if extra.contains("min_resident =") { "" } else { "min_resident = \"0s\"\n" };
    format!("{park}{min}")
}

struct Svc {
    name: &'static str,
    mib: u64,
    gpu: u32,
    extra: &'static str,
}

struct AgentWorld {
    w: World,
    socket: PathBuf,
    config: PathBuf,
    ports: Vec<(u16, u16)>,
    agent: Option<usize>,
    /// More environment for the agent (tests' hooks: a THP file, a CRIU).
    agent_env: Vec<(String, String)>,
    _sockdir: tempfile::TempDir,
}

impl AgentWorld {
    fn new(gpu_mib: u64, agent_extra: &str, svcs: &[Svc]) -> Self {
        Self::on_gpus(&[gpu_mib], agent_extra, svcs)
    }

    fn on_gpus(gpus: &[u64], agent_extra: &str, svcs: &[Svc]) -> Self {
        let mut a = Self::unstarted(World::new(gpus), agent_extra, svcs, &[]);
        a.start();
        a
    }

    /// The world and its config, the agent not started yet. `raw`: services
    /// given as (name, TOML lines without name/listen/backend): adopted ones.
    fn unstarted(w: World, agent_extra: &str, svcs: &[Svc], raw: &[(&str, String)]) -> Self {
        // A directory others may enter: the 403 test connects as nobody.
        let sockdir = tempfile::Builder::new().prefix("gpusnap-agent-test").tempdir_in("/tmp").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(sockdir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let socket = sockdir.path().join("agent.sock");
        let mut text = format!("[agent]\nsocket = {:?}\n{agent_extra}\n", socket.display().to_string());
        let mut ports = Vec::new();
        for s in svcs {
            let (listen, backend) = (free_port(), free_port());
            ports.push((listen, backend));
            // A comment line `# fake-workload: ARGS` in extra: more arguments.
            let more: String = s
                .extra
                .lines()
                .filter_map(|l| l.strip_prefix("# fake-workload: "))
                .flat_map(|a| a.split_whitespace())
                .map(|a| format!(", {a:?}"))
                .collect();
            text += &format!(
                "\n[[service]]\nname = \"{}\"\nlisten = \"127.0.0.1:{listen}\"\nbackend = \"127.0.0.1:{backend}\"\n\
                 command = [{:?}, \"--mib\", \"{}\", \"--gpu\", \"{}\", \"--http\", \"{backend}\"{more}]\n{}{}\n",
                s.name,
                fake_workload_bin().display().to_string(),
                s.mib,
                s.gpu,
                suspends(s.extra),
                s.extra
            );
        }
        for (name, lines) in raw {
            let (listen, backend) = (free_port(), free_port());
            ports.push((listen, backend));
            text += &format!(
                "\n[[service]]\nname = \"{name}\"\nlisten = \"127.0.0.1:{listen}\"\nbackend = \"127.0.0.1:{backend}\"\n{lines}\n"
            );
        }
        let config = w.tmp.path().join("agent.toml");
        std::fs::write(&config, text).unwrap();
        Self { w, socket, config, ports, agent: None, agent_env: Vec::new(), _sockdir: sockdir }
    }

    fn start(&mut self) {
        let _ = std::fs::remove_file(&self.socket);
        let cfg = self.config.display().to_string();
        let env: Vec<(&str, &str)> = self.agent_env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let n = self.w.spawn_gpusnap_env(&["agent", "--config", &cfg], &env);
        self.agent = Some(n);
        let sock = self.socket.clone();
        wait_for(LONG, || UnixStream::connect(&sock).is_ok());
    }

    fn kill9(&mut self) {
        let n = self.agent.take().unwrap();
        self.w.children[n].kill();
        self.w.children[n].wait();
    }

    fn services(&self) -> Vec<Value> {
        let (code, body) = self.api("GET", "/v1/services");
        assert_eq!(code, 200, "{body}");
        serde_json::from_str::<Value>(&body).unwrap().as_array().unwrap().clone()
    }

    fn state(&self, name: &str) -> String {
        self.service(name)["state"].as_str().unwrap().to_string()
    }

    fn port(&self, i: usize) -> u16 {
        self.ports[i].0
    }

    fn notes(&self, pid: i64) -> Vec<Value> {
        let r = self.w.json(&["history", &pid.to_string()]);
        assert_eq!(r.code, 0, "{}", r.stderr);
        let v = r.json();
        let list = v.get("events").cloned().unwrap_or(v);
        list.as_array().unwrap().iter().filter(|e| e["op"] == "agent").cloned().collect()
    }

    fn metrics(&self) -> String {
        let (code, body) = self.api("GET", "/metrics");
        assert_eq!(code, 200);
        body
    }
}

impl AgentClient for AgentWorld {
    fn api(&self, method: &str, path: &str) -> (u16, String) {
        api_call(&self.socket, method, path)
    }

    fn log(&self) -> String {
        let n = self.agent.unwrap_or(0);
        std::fs::read_to_string(self.w.tmp.path().join(format!("gpusnap-{n}.err"))).unwrap_or_default()
    }

    fn world(&mut self) -> &mut World {
        &mut self.w
    }
}

impl Drop for AgentWorld {
    /// The services run in sessions of their own and outlive the agent (on
    /// purpose): end what the agent last recorded, even after a failure.
    fn drop(&mut self) {
        if let Some(n) = self.agent.take() {
            self.w.children[n].kill();
        }
        adopt_recorded_services(&mut self.w);
    }
}

fn api_call(socket: &Path, method: &str, path: &str) -> (u16, String) {
    let (text, read) = http::unix_request(socket, method, path, LONG);
    read.unwrap();
    http::split_dechunked(&text)
}

/// One HTTP request through the agent's proxy: its status and body.
fn get_any(port: u16, path: &str) -> (u16, String) {
    // A connection the agent closes unanswered may do so before the request
    // is written (a broken pipe) or after: either way, no answer (code 0).
    match http::tcp_get(port, path, LONG) {
        Ok(text) => http::split_dechunked(&text),
        Err(e) => (0, e.to_string()),
    }
}

/// One HTTP request through the agent's proxy; the body of its answer.
fn get(port: u16, path: &str) -> String {
    let text = http::tcp_get(port, path, LONG).unwrap();
    let (code, body) = http::split_dechunked(&text);
    assert_eq!(code, 200, "GET {path} on {port}: {text:?}");
    body
}

fn driver_state(w: &World, pid: i64) -> String {
    let r = w.json(&["state", &pid.to_string()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    r.json()["state"].as_str().unwrap().to_string()
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64
}

#[test]
fn idle_service_is_suspended_and_a_request_wakes_it() {
    let mut a = AgentWorld::new(
        1000,
        "",
        &[Svc { name: "m", mib: 300, gpu: 0, extra: "suspend_after = \"700ms\"\nwake_timeout = \"60s\"" }],
    );
    let s = a.wait_state("m", "running");
    let pid = s["pid"].as_i64().unwrap();
    // A first request keeps it up; from its end, idleness is counted.
    assert!(get(a.port(0), "/").starts_with(&format!("ok {pid} ")));
    let answered = now_ms();
    a.wait_state("m", "suspended");
    assert_eq!(driver_state(&a.w, pid), "checkpointed");
    let notes = a.notes(pid);
    let decided = notes
        .iter()
        .filter(|n| n["detail"].as_str().unwrap().contains("suspend: idle for"))
        .map(|n| n["ts_ms"].as_i64().unwrap())
        .find(|t| *t >= answered)
        .unwrap_or_else(|| panic!("no idle suspend after the request: {notes:?}"));
    // suspend_after (700 ms) + 1 s.
    assert!(decided - answered <= 1700, "suspended {} ms after the last byte", decided - answered);

    // A request to the suspended service is held, the service resumed, and
    // the answer comes from the same process with its memory intact.
    let body = get(a.port(0), "/");
    assert_eq!(body.trim_end(), format!("ok {pid} 2 1"));
    assert_eq!(a.state("m"), "running");
    let notes = a.notes(pid);
    assert!(
        notes.iter().any(|n| n["detail"].as_str().unwrap().contains("resume: a connection arrived")),
        "{notes:?}"
    );
    let m = a.metrics();
    let waited = m
        .lines()
        .find(|l| l.starts_with("gpusnap_agent_request_wait_seconds_count{service=\"m\"}"))
        .unwrap_or_else(|| panic!("no wait recorded:\n{m}"));
    assert!(waited.ends_with(" 1"), "{waited}");
    assert!(
        m.contains("gpusnap_agent_transitions_total{service=\"m\",kind=\"resume\",result=\"ok\"} 1"),
        "{m}"
    );

    // The journal through the API: the decisions with their reasons.
    let (code, events) = a.api("GET", "/v1/events?after=0&follow=false");
    assert_eq!(code, 200);
    let decisions: Vec<Value> = events
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|e| e["op"] == "agent" && e["pid"] == pid)
        .collect();
    assert!(
        decisions.iter().any(|e| e["detail"].as_str().unwrap().contains("suspend: idle for")),
        "{events}"
    );
    assert!(
        decisions.iter().any(|e| e["detail"].as_str().unwrap().contains("resume: a connection arrived")),
        "{events}"
    );

    // The CLI client talks to the same API.
    let r = a.w.gpusnap(&["services", "--socket", &a.socket.display().to_string()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.contains("running"), "{}", r.stdout);
    let r = a.w.json(&["service", "m", "suspend", "--socket", &a.socket.display().to_string()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()[0]["state"], "suspended");
    let r = a.w.gpusnap(&["service", "nope", "resume", "--socket", &a.socket.display().to_string()]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("no service \"nope\""), "{}", r.stderr);

    // The services' output and records are root's alone.
    use std::os::unix::fs::PermissionsExt;
    let dir = a.w.state_dir().join("agent");
    for (p, want) in [(dir.clone(), 0o700), (dir.join("m.log"), 0o600), (dir.join("services.json"), 0o600)] {
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, want, "{}: {mode:o}", p.display());
    }
}

#[test]
fn a_stream_longer_than_suspend_after_is_not_cut() {
    // Chunks 100 ms apart, suspend_after 1.5 s: a pause in a stream longer
    // than suspend_after would count as idle (the proxy cannot tell it from
    // the end of a response), so the gap is kept well under it.
    let mut a = AgentWorld::new(
        1000,
        "",
        &[Svc { name: "s", mib: 200, gpu: 0, extra: "suspend_after = \"1500ms\"" }],
    );
    let pid = a.wait_state("s", "running")["pid"].as_i64().unwrap();
    get(a.port(0), "/");
    a.wait_state("s", "suspended");
    let from = now_ms();
    // 40 chunks 100 ms apart: 4 s of streaming, more than twice suspend_after.
    let body = get(a.port(0), "/stream?chunks=40&ms=100");
    let lines: Vec<&str> = body.lines().collect();
    assert_eq!(lines.len(), 40, "{body}");
    assert!(lines.iter().all(|l| l.ends_with(" 1")), "{body}");
    let to = now_ms();
    let suspends: Vec<i64> = a
        .notes(pid)
        .iter()
        .filter(|n| n["detail"].as_str().unwrap().contains("suspend: idle"))
        .map(|n| n["ts_ms"].as_i64().unwrap())
        .filter(|t| *t > from + 100 && *t < to - 100)
        .collect();
    assert!(suspends.is_empty(), "suspended while streaming at {suspends:?} ({from}..{to})");
}

/// Whether the fake driver holds device memory for `pid` now.
fn resident(w: &World, pid: i64) -> Option<bool> {
    resident_in(&w.fake_dir(), pid)
}

/// Whether the fake driver (its state in `fake_dir`) has `pid` resident.
fn resident_in(fake_dir: &Path, pid: i64) -> Option<bool> {
    let text = std::fs::read_to_string(fake_dir.join("state.json")).ok()?;
    let v: Value = serde_json::from_str(&text).ok()?;
    let e = v.get("procs")?.get(pid.to_string())?;
    e["resident"].as_bool()
}

/// Watches the fake driver all along, every 5 ms, for two servers resident
/// at once.
struct BothResidentWatch {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<usize>,
}

impl BothResidentWatch {
    fn start(w: &World, pa: i64, pb: i64) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let thread = {
            let stop = std::sync::Arc::clone(&stop);
            let dir = w.fake_dir();
            std::thread::spawn(move || {
                let mut both = 0;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    if resident_in(&dir, pa) == Some(true) && resident_in(&dir, pb) == Some(true) {
                        both += 1;
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                both
            })
        };
        Self { stop, thread }
    }

    /// How many times both were seen resident.
    fn stop(self) -> usize {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        self.thread.join().unwrap()
    }
}

impl AgentWorld {
    /// Services `a` and `b` on a GPU that fits one: waits until one is
    /// suspended and the other running with its memory (it may have been
    /// restarted meanwhile, having started first); both registered for
    /// cleanup. Their pids, `a`'s first.
    fn settle_one_resident(&mut self) -> (i64, i64) {
        let end = Instant::now() + LONG;
        let pids = loop {
            let v = self.services();
            let pid = |i: usize| v[i]["pid"].as_i64().filter(|p| pid_exists(*p as i32));
            let st = |i: usize| v[i]["state"].as_str().unwrap_or("").to_string();
            if let (Some(x), Some(y)) = (pid(0), pid(1)) {
                let settled = match (st(0).as_str(), st(1).as_str()) {
                    ("running", "suspended") => resident(&self.w, x) == Some(true),
                    ("suspended", "running") => resident(&self.w, y) == Some(true),
                    _ => false,
                };
                if settled {
                    break (x, y);
                }
            }
            assert!(Instant::now() < end, "the services never settled: {v:?}\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        };
        self.wait_state("a", self.state("a").as_str());
        self.wait_state("b", self.state("b").as_str());
        pids
    }

    /// The metrics once `swaps` swaps are traced, or at the latest after
    /// LONG (the caller's checks then say what is missing).
    fn metrics_after_swaps(&self, swaps: f64) -> String {
        let end = Instant::now() + LONG;
        let mut text = self.metrics();
        while metric_sum(&text, "gpusnap_agent_swap_seconds_count") < swaps && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(20));
            text = self.metrics();
        }
        text
    }
}

#[test]
fn two_services_on_a_gpu_that_fits_one_swap_on_demand() {
    // 1000 MiB, two servers of 600: only one can be resident. They declare
    // their size, so the second starts only once the first is evicted.
    let extra = "suspend_after = \"1h\"\nwake_timeout = \"60s\"\ngpu_memory = \"600MiB\"";
    let mut a = AgentWorld::new(
        1000,
        "",
        &[Svc { name: "a", mib: 600, gpu: 0, extra }, Svc { name: "b", mib: 600, gpu: 0, extra }],
    );
    // Settled: one suspended (idle) and the other running with its memory.
    let (pa, pb) = a.settle_one_resident();
    let restarts = |a: &AgentWorld| a.services().iter().map(|s| s["restarts"].as_u64().unwrap()).sum::<u64>();
    let restarts_before = restarts(&a);

    // Watch the fake driver all along: never both resident.
    let watcher = BothResidentWatch::start(&a.w, pa, pb);
    let mut answers = Vec::new();
    for i in 0..6 {
        let (port, pid) = if i % 2 == 0 { (a.port(0), pa) } else { (a.port(1), pb) };
        let body = get(port, "/");
        let f: Vec<&str> = body.split_whitespace().collect();
        assert_eq!((f[0], f[1], f[3]), ("ok", pid.to_string().as_str(), "1"), "request {i}: {body}");
        answers.push(body);
    }
    assert_eq!(watcher.stop(), 0, "both servers were resident at once");
    assert_eq!(restarts(&a), restarts_before, "a server was restarted: {:?}", a.services());
    assert_eq!(restarts_before, 0, "a server failed to start: {:?}", a.services());
    assert_eq!(answers.len(), 6);
    assert!(resident(&a.w, pb) == Some(true) && resident(&a.w, pa) != Some(true));
    let notes = a.notes(pa);
    assert!(
        notes.iter().any(|n| n["detail"].as_str().unwrap().contains("evicted to make room for b")),
        "{notes:?}"
    );

    // Every swap was traced: its phases add up to its time from accept to
    // first byte, the eviction's suspend and the resume among them, and
    // each is journaled on the woken service.
    // (The last answer's trace is observed just after its first byte.)
    let text = a.metrics_after_swaps(5.0);
    let swaps = metric_sum(&text, "gpusnap_agent_swap_seconds_count");
    assert!(swaps >= 5.0, "{swaps} swaps traced:\n{text}");
    let total = metric_sum(&text, "gpusnap_agent_swap_seconds_sum");
    let phases = metric_sum(&text, "gpusnap_agent_swap_phase_seconds_sum");
    assert!(
        total > 0.0 && (phases - total).abs() < 1e-6 * swaps,
        "phases {phases} s, swaps {total} s:\n{text}"
    );
    for phase in
        ["decide", "admission", "pick", "suspend", "release_wait", "resume", "ready", "connect", "first_byte"]
    {
        let n = metric_sum(&text, &format!("gpusnap_agent_swap_phase_seconds_count{{phase=\"{phase}\"}}"));
        assert!(n >= swaps - 1.0, "phase {phase}: {n} of {swaps} swaps:\n{text}");
    }
    assert!(
        metric_sum(&text, "gpusnap_agent_swap_events_total{event=\"eviction\"}") >= swaps - 1.0,
        "{text}"
    );
    let notes = a.notes(pb);
    assert!(
        notes.iter().any(|n| {
            let d = n["detail"].as_str().unwrap();
            d.contains("resume by request: ") && d.contains(" suspend ") && d.contains(" first_byte ")
        }),
        "{notes:?}"
    );
}

#[test]
fn a_swap_waits_out_a_late_nvml_and_traces_the_wait() {
    // NVML reports a checkpoint's release late (its process list by 40 ms,
    // the GPU's used memory by 400 ms): the eviction's suspend waits until
    // NVML shows the process released, and admission, refused meanwhile
    // with nothing left to evict, is asked again once NVML shows the memory
    // free. Every request answered; the waits are in the trace. The driver
    // path: with fast swap the library gives the memory back before the
    // checkpoint, and NVML has caught up by the suspend's end.
    let extra = "suspend_after = \"1h\"\nwake_timeout = \"60s\"\ngpu_memory = \"600MiB\"\nfast_swap = false";
    let w = World::new(&[1000]);
    w.set_config("nvml_process_lag_ms", serde_json::json!(40));
    w.set_config("nvml_memory_lag_ms", serde_json::json!(400));
    let mut a = AgentWorld::unstarted(
        w,
        "",
        &[Svc { name: "a", mib: 600, gpu: 0, extra }, Svc { name: "b", mib: 600, gpu: 0, extra }],
        &[],
    );
    a.start();
    let end = Instant::now() + LONG;
    loop {
        let mut st: Vec<String> =
            a.services().iter().map(|s| s["state"].as_str().unwrap().to_string()).collect();
        st.sort();
        if st == ["running", "suspended"] {
            break;
        }
        assert!(Instant::now() < end, "the services never settled: {:?}\n{}", a.services(), a.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    let (pa, pb) = (a.wait_state("a", &a.state("a"))["pid"].as_i64().unwrap(), a.state("b"));
    let pb = a.wait_state("b", &pb)["pid"].as_i64().unwrap();
    for i in 0..4 {
        let (name, port, pid) =
            if a.state("a") == "running" { ("b", a.port(1), pb) } else { ("a", a.port(0), pa) };
        let body = get(port, "/");
        let f: Vec<&str> = body.split_whitespace().collect();
        assert_eq!(
            (f[0], f[1], f[3]),
            ("ok", pid.to_string().as_str(), "1"),
            "request {i} to {name}: {body}"
        );
    }
    let text = a.metrics_after_swaps(4.0);
    let swaps = metric_sum(&text, "gpusnap_agent_swap_seconds_count");
    assert_eq!(swaps, 4.0, "{text}");
    let ev = |e: &str| metric_sum(&text, &format!("gpusnap_agent_swap_events_total{{event=\"{e}\"}}"));
    assert_eq!(ev("eviction"), 4.0, "{text}");
    // More than one NVML read until the release showed, and admission
    // refused again after the eviction (memory not yet shown free).
    assert!(ev("release_poll") > swaps, "{text}");
    assert!(ev("refusal") >= 2.0 * swaps, "{text}");
    assert!(ev("memory_poll") >= swaps, "{text}");
    let phase =
        |p: &str| metric_sum(&text, &format!("gpusnap_agent_swap_phase_seconds_sum{{phase=\"{p}\"}}"));
    assert!(phase("release_wait") >= 0.03 * swaps, "{text}");
    assert!(phase("memory_wait") > 0.0, "{text}");
}

/// The sum of the samples whose line starts with `prefix` (a name, or a
/// name and the start of its labels).
fn metric_sum(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn host_memory_pressure_hibernates_and_a_request_wakes() {
    criu_present();
    // A threshold no host meets: every suspended service is under pressure.
    let mut a = AgentWorld::new(
        1000,
        "min_host_available = \"1PiB\"",
        &[Svc { name: "h", mib: 300, gpu: 0, extra: "suspend_after = \"500ms\"\nwake_timeout = \"60s\"" }],
    );
    let pid = a.wait_state("h", "running")["pid"].as_i64().unwrap();
    let s = a.wait_state("h", "hibernated");
    let image = s["image"].as_str().unwrap().to_string();
    // One image name per service, stable across its hibernations.
    assert_eq!(image, "agent.h");
    assert!(a.w.state_dir().join("images").join(&image).join("manifest.json").exists());
    // Ended with its tree (its runner reaps it a moment later).
    assert!(
        wait_until(Duration::from_secs(10), || !pid_exists(pid as i32)),
        "the hibernated server still runs"
    );
    let notes = a.notes(pid);
    assert!(
        notes.iter().any(|n| n["detail"].as_str().unwrap().contains("< min_host_available")),
        "{notes:?}"
    );
    // The request wakes it (CRIU restores the same pid) and its memory is intact.
    let body = get(a.port(0), "/");
    let f: Vec<&str> = body.split_whitespace().collect();
    assert_eq!((f[0], f[1], f[3]), ("ok", pid.to_string().as_str(), "1"), "{body}");
    a.w.adopt(pid as i32);
    // Again: the woken server carries the traced guard now (as after
    // `gpusnap wake`), which must let go for CRIU.
    let s = a.wait_state("h", "hibernated");
    assert_eq!(s["image"].as_str().unwrap(), image);
    let body = get(a.port(0), "/");
    assert!(body.starts_with(&format!("ok {pid} ")) && body.trim_end().ends_with(" 1"), "{body}");
    let m = a.metrics();
    assert!(m.contains("kind=\"hibernate\",result=\"ok\""), "{m}");
    assert!(m.contains("kind=\"wake\",result=\"ok\""), "{m}");
}

#[test]
fn a_killed_agent_is_restarted_and_adopts_every_service_as_it_was() {
    let mut a = AgentWorld::new(
        2000,
        "",
        &[
            Svc { name: "idle", mib: 300, gpu: 0, extra: "suspend_after = \"500ms\"" },
            Svc { name: "busy", mib: 300, gpu: 0, extra: "suspend_after = \"1h\"" },
        ],
    );
    let idle = a.wait_state("idle", "suspended")["pid"].as_i64().unwrap();
    let busy = a.wait_state("busy", "running")["pid"].as_i64().unwrap();
    let restores =
        |a: &AgentWorld| a.w.calls_on(idle as i32).iter().filter(|c| c.starts_with("restore=")).count();
    let restores_before = restores(&a);
    a.kill9();
    // The services do not notice.
    assert_eq!(driver_state(&a.w, idle), "checkpointed");
    assert_eq!(driver_state(&a.w, busy), "running");
    a.start();
    let s = a.service("idle");
    assert_eq!((s["state"].as_str(), s["pid"].as_i64()), (Some("suspended"), Some(idle)), "{s}");
    let s = a.service("busy");
    assert_eq!((s["state"].as_str(), s["pid"].as_i64()), (Some("running"), Some(busy)), "{s}");
    // None resumed (or started) twice.
    assert_eq!(restores(&a), restores_before);
    assert!(a.notes(idle).iter().any(|n| n["detail"].as_str().unwrap().contains("adopted as suspended")));
    // And it serves as before.
    let body = get(a.port(0), "/");
    assert!(body.starts_with(&format!("ok {idle} ")), "{body}");
}

/// A request in the background: the agent may die under it.
fn get_in_background(port: u16) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let _ = get_any(port, "/");
    })
}

/// Polls the agent (bounded) until `f` holds for its services' listing.
fn wait_services(a: &AgentWorld, what: &str, f: impl Fn(&[Value]) -> bool) {
    let end = Instant::now() + LONG;
    loop {
        let list = a.services();
        if f(&list) {
            return;
        }
        assert!(Instant::now() < end, "{what}: not within {LONG:?}: {list:?}\n{}", a.log());
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn state_of<'a>(list: &'a [Value], name: &str) -> &'a str {
    list.iter().find(|s| s["name"] == name).and_then(|s| s["state"].as_str()).unwrap_or("")
}

/// Where a fast-swap process's memory is, as `gpusnap ps` has it.
fn swap_phase(w: &World, pid: i64) -> String {
    let ps = w.json(&["ps"]).json();
    ps["processes"]
        .as_array()
        .and_then(|l| l.iter().find(|p| p["pid"] == pid))
        .and_then(|p| p["fast_swap"]["phase"].as_str())
        .unwrap_or("")
        .to_string()
}

#[test]
fn an_agent_killed_mid_swap_is_restarted_and_every_service_settles_and_answers() {
    // Two servers on a GPU that holds one: a request to the suspended one
    // (a) evicts the other (b: a checkpoint), then resumes it (a restore),
    // each slow enough here to kill the agent inside it.
    let extra = "suspend_after = \"1h\"\nwake_timeout = \"60s\"\ngpu_memory = \"600MiB\"";
    let mut a = AgentWorld::new(
        1000,
        "",
        &[Svc { name: "a", mib: 600, gpu: 0, extra }, Svc { name: "b", mib: 600, gpu: 0, extra }],
    );
    a.settle_one_resident();
    get(a.port(1), "/");
    a.wait_state("a", "suspended");
    a.w.set_config("checkpoint_gbps", serde_json::json!(0.3));
    a.w.set_config("restore_gbps", serde_json::json!(0.3));
    // Fast swap's library copies as slowly: killed inside its offload (the
    // driver still runs b, its memory away) and inside its restore.
    a.w.set_config("copy_gbps", serde_json::json!(0.3));
    // Killed while b is being suspended (inside its library's offload: the
    // driver runs b, its memory on the way out), then while a is being
    // resumed after b was.
    for kill_when in ["offloading", "resuming"] {
        let t = get_in_background(a.port(0));
        wait_services(&a, "a asked for", |l| match kill_when {
            "offloading" => {
                state_of(l, "b") == "suspending"
                    && l.iter()
                        .find(|s| s["name"] == "b")
                        .and_then(|s| s["pid"].as_i64())
                        .is_some_and(|p| swap_phase(&a.w, p) == "offloading")
            }
            _ => state_of(l, "b") == "suspended" && state_of(l, "a") == "resuming",
        });
        a.kill9();
        let _ = t.join();
        a.start();
        // Every service settles: the new agent found each as the driver
        // has it, and nothing of the killed swap stays in transition ...
        wait_services(&a, "every service settled", |l| {
            l.iter().all(|s| ["running", "suspended"].contains(&s["state"].as_str().unwrap_or("")))
        });
        // ... as the driver says, and each answers right: b first (left
        // running with its memory away, it would never answer), then a,
        // then b again, which ends running and a suspended, as before.
        for s in a.services() {
            let want = if s["state"] == "running" { "running" } else { "checkpointed" };
            assert_eq!(driver_state(&a.w, s["pid"].as_i64().unwrap()), want, "{s}\n{}", a.log());
        }
        for i in [1, 0, 1] {
            let body = get(a.port(i), "/");
            assert!(body.trim_end().ends_with(" 1"), "{body}");
        }
        a.wait_state("a", "suspended");
    }
}

#[test]
fn a_service_that_dies_is_restarted() {
    let mut a =
        AgentWorld::new(1000, "", &[Svc { name: "d", mib: 100, gpu: 0, extra: "suspend_after = \"1h\"" }]);
    let pid = a.wait_state("d", "running")["pid"].as_i64().unwrap();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::Signal::SIGKILL)
        .unwrap();
    let end = Instant::now() + LONG;
    let new = loop {
        let s = a.service("d");
        if s["state"] == "running" && s["pid"].as_i64().is_some_and(|p| p != pid) {
            break s;
        }
        assert!(Instant::now() < end, "not restarted: {s}\n{}", a.log());
        std::thread::sleep(Duration::from_millis(50));
    };
    a.wait_state("d", "running");
    assert_eq!(new["restarts"], 1);
    let body = get(a.port(0), "/");
    assert!(body.starts_with(&format!("ok {} ", new["pid"])), "{body}");
}

#[test]
fn a_full_gpu_sends_the_resume_to_another_gpu_of_the_same_model() {
    // The driver path (a fast-swap server comes back on its own GPU: the
    // next test).
    let mut a = AgentWorld::on_gpus(
        &[1000, 1000],
        "",
        &[Svc {
            name: "r",
            mib: 600,
            gpu: 0,
            extra: "suspend_after = \"500ms\"\nwake_timeout = \"60s\"\nfast_swap = false",
        }],
    );
    let pid = a.wait_state("r", "suspended")["pid"].as_i64().unwrap();
    // A tenant outside the agent takes GPU 0: nobody the agent could evict.
    a.w.workload(600, 0, &[]);
    let body = get(a.port(0), "/");
    let f: Vec<&str> = body.split_whitespace().collect();
    assert_eq!((f[0], f[1], f[3]), ("ok", pid.to_string().as_str(), "1"), "{body}");
    let text = std::fs::read_to_string(a.w.fake_dir().join("state.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["procs"][pid.to_string()]["contexts"], serde_json::json!([1]), "{text}");
    let notes = a.notes(pid);
    assert!(
        notes.iter().any(|n| n["detail"].as_str().unwrap().contains("resume onto GPU-00000001")),
        "{notes:?}"
    );
}

/// A fast-swap server's memory comes back on the GPU it left: with that GPU
/// full, the agent does not send it to another one; it comes back there
/// once there is room.
#[test]
fn a_fast_swap_server_is_not_sent_to_another_gpu() {
    let mut a = AgentWorld::on_gpus(
        &[1000, 1000],
        "",
        &[Svc {
            name: "r",
            mib: 400,
            gpu: 0,
            extra: "suspend_after = \"500ms\"\nwake_timeout = \"3s\"\nfast_swap = true",
        }],
    );
    let pid = a.wait_state("r", "suspended")["pid"].as_i64().unwrap();
    // Its pinned budget: half of the host's memory, no pinned_budget given.
    let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let total: u64 = std::fs::read_to_string("/proc/meminfo")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:")?.split_whitespace().next()?.parse().ok())
        .unwrap();
    let want = format!("GPUSNAP_FAST_SWAP_PIN_BUDGET={}", total * 1024 / 2);
    assert!(env.split(|b| *b == 0).any(|v| v == want.as_bytes()), "{want}");
    // Suspended, its library holds its 400 MiB in pinned host memory.
    let m = a.metrics();
    let line = m.lines().find(|l| l.starts_with("gpusnap_agent_pinned_host_memory_bytes ")).unwrap_or("");
    assert_eq!(line, format!("gpusnap_agent_pinned_host_memory_bytes {}", 400u64 << 20), "{m}");
    let hog = a.w.workload(700, 0, &[]);
    let mut s = TcpStream::connect(("127.0.0.1", a.port(0))).unwrap();
    s.set_read_timeout(Some(LONG)).unwrap();
    write!(s, "GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    assert_eq!(text, "", "no GPU of its own to come back to, and no other one for it");
    a.w.kill(hog);
    // The resume the first request started may still be waiting for memory
    // (a request that joins it ends with it): ask until one is answered.
    let mut body = String::new();
    wait_for(LONG, || {
        let (code, b) = get_any(a.port(0), "/");
        body = b;
        code == 200
    });
    let f: Vec<&str> = body.split_whitespace().collect();
    assert_eq!((f[0], f[1], f[3]), ("ok", pid.to_string().as_str(), "1"), "{body}");
    let text = std::fs::read_to_string(a.w.fake_dir().join("state.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["procs"][pid.to_string()]["contexts"], serde_json::json!([0]), "{text}");
}

#[test]
fn only_services_on_the_full_gpu_are_evicted_and_a_late_one_is_closed() {
    // x runs on GPU 0 (no room left there for y), y was suspended from GPU 1,
    // which a tenant outside the agent then fills: suspending x would not
    // help y, so x stays, and y's connection is closed after wake_timeout.
    let mut a = AgentWorld::on_gpus(
        &[1000, 1000],
        "",
        &[
            Svc { name: "x", mib: 600, gpu: 0, extra: "suspend_after = \"1h\"" },
            Svc { name: "y", mib: 600, gpu: 1, extra: "suspend_after = \"500ms\"\nwake_timeout = \"2s\"" },
        ],
    );
    a.wait_state("x", "running");
    let y = a.wait_state("y", "suspended")["pid"].as_i64().unwrap();
    a.w.workload(600, 1, &[]);
    let mut s = TcpStream::connect(("127.0.0.1", a.port(1))).unwrap();
    s.set_read_timeout(Some(LONG)).unwrap();
    write!(s, "GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    assert_eq!(text, "", "a connection to a service that could not come back was answered");
    assert_eq!(a.state("x"), "running");
    // The resume gives up at its own wake_timeout, a moment after the connection's.
    a.wait_state("y", "suspended");
    assert_eq!(a.state("x"), "running");
    assert_eq!(driver_state(&a.w, y), "checkpointed");
    let m = a.metrics();
    assert!(m.contains("gpusnap_agent_connections_closed_unserved_total{service=\"y\"} 1"), "{m}");
    assert!(m.contains("gpusnap_agent_admission_refusals_total{service=\"y\"}"), "{m}");
}

/// Asks the API as `nobody` (tests run as root).
fn api_as_nobody(socket: &Path) -> i32 {
    api_as(socket, 65534, &[])
}

/// Asks the API as uid 65534 with primary group `gid` and supplementary
/// `groups`: a forked child drops its privileges and makes one raw request;
/// its exit code is the HTTP status / 100 (90: could not drop, 91: could not
/// connect, 92: no answer).
fn api_as(socket: &Path, gid: u32, groups: &[u32]) -> i32 {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(socket.as_os_str().as_bytes()).unwrap();
    let req = b"GET /v1/services HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n";
    let groups: Vec<libc::gid_t> = groups.to_vec();
    // SAFETY: the child only makes raw system calls on memory prepared
    // before the fork (no allocation, no locks) and ends with _exit.
    unsafe {
        let pid = libc::fork();
        assert!(pid >= 0);
        if pid == 0 {
            if libc::setgroups(groups.len(), groups.as_ptr()) != 0
                || libc::setgid(gid) != 0
                || libc::setuid(65534) != 0
            {
                libc::_exit(90);
            }
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
            let mut addr: libc::sockaddr_un = std::mem::zeroed();
            addr.sun_family = libc::AF_UNIX as u16;
            let bytes = path.as_bytes_with_nul();
            for (i, b) in bytes.iter().enumerate() {
                addr.sun_path[i] = *b as libc::c_char;
            }
            let len = std::mem::size_of::<libc::sockaddr_un>() as u32;
            if libc::connect(fd, (&raw const addr).cast(), len) != 0 {
                libc::_exit(91);
            }
            libc::write(fd, req.as_ptr().cast(), req.len());
            let mut buf = [0u8; 16];
            let n = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
            // "HTTP/1.1 403"
            if n < 12 {
                libc::_exit(92);
            }
            libc::_exit(i32::from(buf[9] - b'0'));
        }
        let mut st = 0;
        libc::waitpid(pid, &mut st, 0);
        libc::WEXITSTATUS(st)
    }
}

/// A group made for one test (`groupadd`), removed after it.
struct TempGroup {
    name: String,
    gid: u32,
}

impl TempGroup {
    fn new() -> Self {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let name = format!("gsnapt{}x{n}", std::process::id());
        let st = std::process::Command::new("groupadd").arg(&name).status().expect("groupadd");
        assert!(st.success(), "groupadd {name}");
        let gid = nix::unistd::Group::from_name(&name).unwrap().expect("the new group").gid.as_raw();
        Self { name, gid }
    }
}

impl Drop for TempGroup {
    fn drop(&mut self) {
        let _ = std::process::Command::new("groupdel").arg(&self.name).status();
    }
}

#[test]
fn the_api_lets_in_the_configured_group_and_refuses_others() {
    if !nix::unistd::geteuid().is_root() {
        gpusnap_testkit::skip("needs root (groupadd, a peer with other ids)");
        return;
    }
    let g = TempGroup::new();
    let mut a = AgentWorld::new(
        1000,
        &format!("group = {:?}", g.name),
        &[Svc { name: "g", mib: 100, gpu: 0, extra: "suspend_after = \"1h\"" }],
    );
    a.wait_state("g", "running");
    use std::os::unix::fs::MetadataExt;
    let md = std::fs::metadata(&a.socket).unwrap();
    assert_eq!((md.mode() & 0o777, md.gid()), (0o660, g.gid), "the socket's mode and group");
    // A member, supplementary or primary, is let in.
    assert_eq!(api_as(&a.socket, 65534, &[g.gid]), 2, "a supplementary member was not let in");
    assert_eq!(api_as(&a.socket, g.gid, &[]), 2, "a primary member was not let in");
    // Anyone else: the mode keeps them out, and with the mode opened, the
    // credentials check does.
    assert_eq!(api_as(&a.socket, 65534, &[]), 91, "the socket let a non-member connect");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&a.socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    assert_eq!(api_as(&a.socket, 65534, &[]), 4, "a non-member was not refused with 403");
    assert_eq!(api_as(&a.socket, 65534, &[g.gid]), 2);
}

#[test]
fn the_api_refuses_a_peer_that_is_neither_root_nor_in_the_group() {
    let mut a = AgentWorld::new(1000, "", &[Svc { name: "p", mib: 100, gpu: 0, extra: "" }]);
    a.wait_state("p", "running");
    // The socket's mode already keeps others out (0660); open it to show
    // that the credentials check stands on its own.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&a.socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    assert_eq!(api_as_nobody(&a.socket), 4, "nobody was not refused with 403");
    // Root is let in.
    assert_eq!(a.api("GET", "/v1/services").0, 200);
    let (code, body) = a.api("GET", "/v1/processes");
    assert_eq!(code, 200, "{body}");
}

#[test]
fn metrics_pass_promtool() {
    let mut a =
        AgentWorld::new(1000, "", &[Svc { name: "x", mib: 100, gpu: 0, extra: "suspend_after = \"500ms\"" }]);
    a.wait_state("x", "suspended");
    get(a.port(0), "/");
    // The wake's trace is observed just after the answer's first byte.
    let end = Instant::now() + LONG;
    let mut text = a.metrics();
    while !text.contains("gpusnap_agent_swap_seconds_count") && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(20));
        text = a.metrics();
    }
    for name in [
        "gpusnap_agent_services{state=\"running\"}",
        "gpusnap_agent_transitions_total",
        "gpusnap_agent_transition_duration_seconds_bucket",
        "gpusnap_agent_request_wait_seconds_bucket",
        "gpusnap_agent_connections_in_flight",
        "gpusnap_agent_host_memory_bytes",
        "gpusnap_agent_image_bytes",
        "gpusnap_agent_swap_phase_seconds_count{phase=\"resume\"}",
        "gpusnap_agent_swap_seconds_count{kind=\"resume\"}",
        "gpusnap_agent_swap_events_total{event=\"admission\"}",
    ] {
        assert!(text.contains(name), "{name} missing:\n{text}");
    }
    let promtool = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn();
    let mut child = match promtool {
        Ok(c) => c,
        Err(e) => {
            gpusnap_testkit::skip(format!(
                "promtool does not run ({e}): apt-get install prometheus; .ci/run installs it"
            ));
            return;
        }
    };
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn bad_configs_are_refused_naming_the_line() {
    let w = World::new(&[1000]);
    let good = "[agent]\nsocket = \"/tmp/x.sock\"\n\n[[service]]\nname = \"a\"\nlisten = \"127.0.0.1:1\"\n\
                backend = \"127.0.0.1:2\"\ncommand = [\"x\"]\n";
    let second = "\n[[service]]\nname = \"b\"\nlisten = \"127.0.0.1:3\"\nbackend = \"127.0.0.1:4\"\ncommand = [\"y\"]\n";
    let cases = [
        (good.replace("command", "colour = 1\ncommand"), 8, "unknown key `colour`"),
        (
            good.replace("command", "suspend_aftr = \"5m\"\ncommand"),
            8,
            "unknown key `suspend_aftr` in [[service]]: did you mean `suspend_after`?",
        ),
        (good.replace("[[service]]", "[service]"), 4, "write `[[service]]`"),
        (
            good.replace("\"127.0.0.1:2\"", "\"localhost:2\""),
            7,
            "backend = \"localhost:2\": expected IP:PORT, an IP address and port, such as \"127.0.0.1:2\"",
        ),
        (format!("{good}{}", second.replace("\"b\"", "\"a\"")), 11, "duplicate service name \"a\""),
        (format!("{good}{}", second.replace("127.0.0.1:3", "127.0.0.1:1")), 12, "port 1"),
        (good.replace("command = [\"x\"]\n", ""), 5, "exactly one of command, pid_file, cgroup"),
        (good.replace("command", "suspend_after = \"soon\"\ncommand"), 8, "bad duration"),
        (format!("{good}min_host_available = 1"), 0, ""),
        (
            format!("{good}hooks.before_suspend = {{ method = \"FETCH\", path = \"/s\" }}\n"),
            9,
            "method \"FETCH\"",
        ),
        (format!("{good}hooks.after_resume = {{ path = \"/w\", timeout = \"soon\" }}\n"), 9, "bad duration"),
    ];
    for (i, (text, line, what)) in cases.iter().enumerate() {
        let path = w.tmp.path().join(format!("bad{i}.toml"));
        std::fs::write(&path, text).unwrap();
        let r = w.gpusnap(&["agent", "--config", &path.display().to_string()]);
        if *line == 0 {
            // A key of [agent] after a [[service]] belongs to the service.
            assert_eq!(r.code, 2, "{text}\n{}", r.stderr);
            continue;
        }
        assert_eq!(r.code, 2, "{text}\n{}", r.stderr);
        let want = format!("{}:{line}:", path.display());
        assert!(r.stderr.contains(&want) && r.stderr.contains(what), "want {want} {what}, got: {}", r.stderr);
        assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
    }
    // A group this host does not have.
    let path = w.tmp.path().join("badgroup.toml");
    std::fs::write(&path, good.replace("[agent]\n", "[agent]\ngroup = \"gpusnap-no-such-group\"\n")).unwrap();
    let r = w.gpusnap(&["agent", "--config", &path.display().to_string()]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    let want = format!("{}:2: group \"gpusnap-no-such-group\": no such group", path.display());
    assert!(r.stderr.contains(&want), "want {want}, got: {}", r.stderr);
    assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
    let r = w.gpusnap(&["agent", "--config", "/nonexistent/agent.toml"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
}

/// Starts a fake model server the way its owner would (not the agent), in
/// `cgroup` when given; waits until it listens.
fn owner_starts_server(w: &mut World, port: u16, cgroup: Option<&Path>) -> i32 {
    let wl = fake_workload_bin().display().to_string();
    let p = port.to_string();
    let n = match cgroup {
        Some(cg) => {
            let script = format!("echo $$ > {}/cgroup.procs && exec \"$@\"", cg.display());
            w.spawn_env("sh", &["-c", &script, "sh", &wl, "--mib", "300", "--http", &p])
        }
        None => w.spawn_env(&wl, &["--mib", "300", "--http", &p]),
    };
    wait_for(LONG, || TcpStream::connect(("127.0.0.1", port)).is_ok());
    w.child_pid(n)
}

/// An adopted server: idle -> suspended, a request wakes it, the agent
/// never ends it (no restart, no hibernate, it outlives the agent), and when
/// it dies on its own it is `exited`, journaled, not restarted, until its
/// owner starts it again.
fn adopted_server_lifecycle(how: &str) {
    let cg = if how == "cgroup" {
        match Cgroup::new(1 << 40) {
            Some(c) => Some(c),
            None => {
                gpusnap_testkit::skip("no cgroup can be created here");
                return;
            }
        }
    } else {
        None
    };
    let w = World::new(&[1000]);
    let pidfile = w.tmp.path().join("server.pid");
    let source = match &cg {
        Some(c) => format!("cgroup = {:?}", c.0.display().to_string()),
        None => format!("pid_file = {:?}", pidfile.display().to_string()),
    };
    let mut a = AgentWorld::unstarted(
        w,
        "",
        &[],
        &[("p", format!("{source}\nsuspend_after = \"700ms\"\nwake_timeout = \"20s\""))],
    );
    let backend = a.ports[0].1;
    let pid = owner_starts_server(&mut a.w, backend, cg.as_ref().map(|c| c.0.as_path()));
    std::fs::write(&pidfile, format!("{pid}\n")).unwrap();
    a.start();
    let s = a.wait_state("p", "suspended");
    assert_eq!((s["pid"].as_i64(), s["runner"].as_i64()), (Some(i64::from(pid)), None), "{s}");
    assert_eq!(driver_state(&a.w, i64::from(pid)), "checkpointed");
    let body = get(a.port(0), "/");
    assert!(body.starts_with(&format!("ok {pid} ")) && body.trim_end().ends_with(" 1"), "{body}");
    a.wait_state("p", "suspended");

    // Nothing the agent would end it for: restart and hibernate are refused.
    let (code, body) = a.api("POST", "/v1/services/p/restart");
    assert_eq!(code, 409, "{body}");
    assert!(body.contains("adopted"), "{body}");
    let (code, body) = a.api("POST", "/v1/services/p/hibernate");
    assert_eq!(code, 409, "{body}");
    assert!(body.contains("never hibernated"), "{body}");
    // It outlives the agent, and the next agent adopts it as it was.
    a.kill9();
    assert!(pid_exists(pid));
    a.start();
    let s = a.service("p");
    assert_eq!((s["state"].as_str(), s["pid"].as_i64()), (Some("suspended"), Some(i64::from(pid))), "{s}");
    let body = get(a.port(0), "/");
    assert!(body.starts_with(&format!("ok {pid} ")), "{body}");

    // It dies on its own: exited, journaled, not restarted.
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).unwrap();
    let s = a.wait_state("p", "exited");
    assert_eq!(s["restarts"], 0, "{s}");
    let notes = a.notes(i64::from(pid));
    assert!(
        notes.iter().any(|n| n["detail"]
            .as_str()
            .unwrap()
            .contains("ended on its own; adopted, not started by the agent: not restarted")),
        "{notes:?}"
    );
    // A connection meanwhile is closed, not answered.
    let mut c = TcpStream::connect(("127.0.0.1", a.port(0))).unwrap();
    c.set_read_timeout(Some(LONG)).unwrap();
    write!(c, "GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    let _ = c.read_to_string(&mut text);
    assert_eq!(text, "", "a connection to an exited service was answered");
    assert_eq!(a.state("p"), "exited");
    assert!(a.services().iter().all(|s| s["runner"].is_null()), "the agent started something");

    // Its owner starts it again: the new process is adopted.
    let new = owner_starts_server(&mut a.w, backend, cg.as_ref().map(|c| c.0.as_path()));
    std::fs::write(&pidfile, format!("{new}\n")).unwrap();
    let end = Instant::now() + LONG;
    while a.service("p")["pid"].as_i64() != Some(i64::from(new)) {
        assert!(Instant::now() < end, "the new server was not adopted: {}\n{}", a.service("p"), a.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    let body = get(a.port(0), "/");
    assert!(body.starts_with(&format!("ok {new} ")), "{body}");
    drop(a);
    drop(cg);
}

#[test]
fn a_server_adopted_by_pid_file_is_suspended_woken_and_never_ended_by_the_agent() {
    adopted_server_lifecycle("pid_file");
}

#[test]
fn a_server_adopted_by_cgroup_is_suspended_woken_and_never_ended_by_the_agent() {
    adopted_server_lifecycle("cgroup");
}

fn thp_selected(p: &Path) -> String {
    let s = std::fs::read_to_string(p).unwrap();
    let w = s.split_whitespace().find(|w| w.starts_with('[')).or_else(|| s.split_whitespace().next());
    w.unwrap_or("").trim_matches(['[', ']']).to_string()
}

/// POSTs an action in the background: the agent may die under it.
fn post_in_background(socket: &Path, path: &str) -> std::thread::JoinHandle<()> {
    let (socket, path) = (socket.to_path_buf(), path.to_string());
    std::thread::spawn(move || {
        if let Ok(mut s) = UnixStream::connect(&socket) {
            let _ = s.set_read_timeout(Some(LONG));
            let _ = write!(
                s,
                "POST {path} HTTP/1.1\r\nHost: a\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
            );
            let mut text = String::new();
            let _ = s.read_to_string(&mut text);
        }
    })
}

#[test]
fn thp_is_always_for_the_agents_suspends_and_put_back_even_after_a_kill() {
    // 512 MiB at 0.25 GB/s: a checkpoint of about 2 s, long enough to see.
    let w = World::with_config(&[16_384], serde_json::json!({ "checkpoint_gbps": 0.25 }));
    let sysfs = w.tmp.path().join("thp-enabled");
    std::fs::write(&sysfs, "always [madvise] never\n").unwrap();
    let svc = |name: &'static str, extra: &'static str| Svc { name, mib: 512, gpu: 0, extra };
    let mut a = AgentWorld::unstarted(
        w,
        "thp = true",
        &[svc("on", "suspend_after = \"1h\""), svc("off", "suspend_after = \"1h\"\nthp = false")],
        &[],
    );
    a.agent_env.push(("GPUSNAP_THP_SYSFS".into(), sysfs.display().to_string()));
    a.start();
    a.wait_state("on", "running");
    a.wait_state("off", "running");
    let thp_json = a.w.state_dir().join("thp.json");

    // `[agent] thp = true`: always while the checkpoint runs, then put back.
    let t = post_in_background(&a.socket, "/v1/services/on/suspend");
    wait_for(LONG, || thp_selected(&sysfs) == "always");
    assert!(thp_json.exists(), "the previous mode is journaled while switched");
    t.join().unwrap();
    a.wait_state("on", "suspended");
    assert_eq!(thp_selected(&sysfs), "madvise");
    assert!(!thp_json.exists());

    let notes = a.notes(a.service("on")["pid"].as_i64().unwrap());
    assert!(
        notes.iter().any(|n| n["detail"].as_str().unwrap().contains("(THP always for its checkpoint)")),
        "{notes:?}"
    );
    // `thp = false` on the service: never switched.
    let t = post_in_background(&a.socket, "/v1/services/off/suspend");
    let mut seen = Vec::new();
    while a.state("off") != "suspended" {
        seen.push(thp_selected(&sysfs));
        std::thread::sleep(Duration::from_millis(20));
    }
    t.join().unwrap();
    assert!(seen.iter().all(|m| m == "madvise"), "{seen:?}");

    // The agent killed mid-suspend: the next one puts the mode back and
    // finds the service as the driver and its library have it: running
    // (killed in the checkpoint, the driver left it locked: unlocked), or
    // suspended (killed in the fast-swap offload before it: finished).
    let pid = a.service("on")["pid"].as_i64().unwrap();
    get(a.port(0), "/");
    let _t = post_in_background(&a.socket, "/v1/services/on/suspend");
    wait_for(LONG, || thp_selected(&sysfs) == "always");
    a.kill9();
    assert_eq!(thp_selected(&sysfs), "always");
    a.start();
    assert_eq!(thp_selected(&sysfs), "madvise", "the restarted agent did not put THP back");
    assert!(!thp_json.exists());
    let end = Instant::now() + LONG;
    let s = loop {
        let s = a.service("on");
        if s["state"] == "running" || s["state"] == "suspended" {
            break s;
        }
        assert!(Instant::now() < end, "on never settled: {s}\n{}", a.log());
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(s["pid"].as_i64(), Some(pid));
    let want = if s["state"] == "running" { "running" } else { "checkpointed" };
    assert_eq!(driver_state(&a.w, pid), want, "{s}");
    let body = get(a.port(0), "/");
    assert!(body.starts_with(&format!("ok {pid} ")) && body.trim_end().ends_with(" 1"), "{body}");
}

/// A CRIU that, armed by a file, waits after its `dump` or `restore` until
/// the agent that ran it is gone: the window in which the test kills it.
fn pausing_criu(dir: &Path) -> PathBuf {
    let out = std::process::Command::new("sh").args(["-c", "command -v criu"]).output().unwrap();
    let real = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(!real.is_empty(), "criu not on PATH");
    let path = dir.join("criu-pausing");
    let d = dir.display();
    std::fs::write(
        &path,
        format!(
            "#!/bin/sh\n{real:?} \"$@\"\nrc=$?\n\
             if [ $rc = 0 ] && [ -e {d}/pause-$1 ]; then\n\
             rm -f {d}/pause-$1\n\
             touch {d}/paused-$1\n\
             n=0\n\
             while kill -0 $PPID 2>/dev/null && [ $n -lt 1200 ]; do sleep 0.05; n=$((n + 1)); done\n\
             fi\n\
             exit $rc\n"
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

fn image_entries(w: &World) -> Vec<String> {
    std::fs::read_dir(w.state_dir().join("images"))
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default()
}

#[test]
fn an_agent_killed_mid_hibernate_or_mid_wake_leaves_one_consistent_state() {
    criu_present();
    let mut a = AgentWorld::unstarted(
        World::new(&[1000]),
        "",
        &[Svc { name: "k", mib: 300, gpu: 0, extra: "suspend_after = \"500ms\"\nwake_timeout = \"60s\"" }],
        &[],
    );
    let hooks = a.w.tmp.path().join("hooks");
    std::fs::create_dir_all(&hooks).unwrap();
    let criu = pausing_criu(&hooks);
    a.agent_env.push(("GPUSNAP_CRIU".into(), criu.display().to_string()));
    a.start();
    let pid = a.wait_state("k", "suspended")["pid"].as_i64().unwrap();

    // Killed after CRIU's dump, before the image is committed and the tree
    // ended: the next agent continues the tree, drops the temporary image,
    // and finds the service suspended, as it was.
    std::fs::write(hooks.join("pause-dump"), "").unwrap();
    let _t = post_in_background(&a.socket, "/v1/services/k/hibernate");
    wait_for(LONG, || hooks.join("paused-dump").exists());
    assert!(image_entries(&a.w).iter().any(|e| e.contains(".tmp-")), "{:?}", image_entries(&a.w));
    a.kill9();
    a.start();
    let s = a.wait_state("k", "suspended");
    assert_eq!((s["pid"].as_i64(), s["image"].as_str()), (Some(pid), None), "{s}");
    assert_eq!(driver_state(&a.w, pid), "checkpointed");
    assert_eq!(image_entries(&a.w), Vec::<String>::new(), "an image or a temporary one was left behind");
    let body = get(a.port(0), "/");
    assert!(body.starts_with(&format!("ok {pid} ")) && body.trim_end().ends_with(" 1"), "{body}");

    // Hibernated for real, then killed mid-wake (CRIU has restored the
    // tree, the driver has not): the next agent adopts the woken process
    // (suspended), does not wake it a second time, and keeps the image only
    // until the process runs again (its manifest has the footprint).
    a.wait_state("k", "suspended");
    let (code, body) = a.api("POST", "/v1/services/k/hibernate");
    assert_eq!(code, 200, "{body}");
    let image = a.wait_state("k", "hibernated")["image"].as_str().unwrap().to_string();
    // Ended with its tree (its runner reaps it a moment later).
    assert!(
        wait_until(Duration::from_secs(10), || !pid_exists(pid as i32)),
        "the hibernated server still runs"
    );
    std::fs::write(hooks.join("pause-restore"), "").unwrap();
    let _t = std::thread::spawn({
        let port = a.port(0);
        move || {
            if let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) {
                let _ = s.set_read_timeout(Some(LONG));
                let _ = write!(s, "GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
                let mut text = String::new();
                let _ = s.read_to_string(&mut text);
            }
        }
    });
    wait_for(LONG, || hooks.join("paused-restore").exists());
    a.w.adopt(pid as i32);
    a.kill9();
    a.start();
    let s = a.wait_state("k", "suspended");
    assert_eq!((s["pid"].as_i64(), s["image"].as_str()), (Some(pid), Some(image.as_str())), "{s}");
    let restores = a.w.calls_on(pid as i32).iter().filter(|c| c.starts_with("restore=")).count();
    let body = std::panic::catch_unwind(|| get(a.port(0), "/")).unwrap_or_else(|_| {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let st = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        panic!(
            "LOG {}\nSTAT {stat}\nSTATUS {st}\nCALLS {:?}\nNOTES {:?}\nSVC {}",
            a.log(),
            a.w.calls_on(pid as i32),
            a.notes(pid),
            a.service("k")
        )
    });
    assert!(body.starts_with(&format!("ok {pid} ")) && body.trim_end().ends_with(" 1"), "{body}");
    assert_eq!(
        a.w.calls_on(pid as i32).iter().filter(|c| c.starts_with("restore=")).count(),
        restores + 1,
        "one driver restore for the request"
    );
    assert_eq!(a.state("k"), "running");
    assert_eq!(image_entries(&a.w), Vec::<String>::new(), "the woken image was left");
    assert!(a.service("k")["image"].is_null());
}

const HOOKS: &str =
    "hooks.before_suspend = { method = \"POST\", path = \"/sleep?level=1\", timeout = \"10s\" }\n\
                     hooks.after_resume = { method = \"POST\", path = \"/wake_up\", timeout = \"10s\" }";

#[test]
fn a_swap_with_hooks_never_has_both_services_resident_and_answers_right() {
    // 1000 MiB; each server 200 MiB of weights + 400 of KV cache. Asleep it
    // is suspended with 200: admission must still find room for 600 (what
    // its after_resume hook allocates again), or the second server would be
    // resumed beside the first (200 + 16 MiB of margin fit in the 400 left)
    // and could not take its KV cache back.
    let extra =
        "suspend_after = \"1h\"\nwake_timeout = \"60s\"\ngpu_memory = \"600MiB\"\nmargin = \"16MiB\"\n\
                 # fake-workload: --kv-mib 400";
    let extra: &'static str = Box::leak(format!("{extra}\n{HOOKS}").into_boxed_str());
    let mut a = AgentWorld::new(
        1000,
        "",
        &[Svc { name: "a", mib: 200, gpu: 0, extra }, Svc { name: "b", mib: 200, gpu: 0, extra }],
    );
    let (pa, pb) = a.settle_one_resident();

    let watcher = BothResidentWatch::start(&a.w, pa, pb);
    for i in 0..6 {
        let (port, pid) = if i % 2 == 0 { (a.port(0), pa) } else { (a.port(1), pb) };
        let (code, body) = get_any(port, "/");
        assert_eq!(code, 200, "request {i}: {body}\n{}", a.log());
        let f: Vec<&str> = body.split_whitespace().collect();
        assert_eq!((f[0], f[1], f[3]), ("ok", pid.to_string().as_str(), "1"), "request {i}: {body}");
    }
    assert_eq!(watcher.stop(), 0, "both servers were resident at once");
    for s in a.services() {
        assert_eq!(s["restarts"], 0, "{s}");
        assert!(s["last_error"].is_null(), "{s}");
    }
    // Each swap ran both hooks, journaled and traced.
    let notes = a.notes(pa);
    let has = |n: &[Value], what: &str| n.iter().any(|n| n["detail"].as_str().unwrap().contains(what));
    assert!(has(&notes, "before_suspend hook: POST /sleep?level=1 -> 200"), "{notes:?}");
    assert!(has(&notes, "after_resume hook: POST /wake_up -> 200"), "{notes:?}");
    let text = a.metrics_after_swaps(5.0);
    let swaps = metric_sum(&text, "gpusnap_agent_swap_seconds_count");
    for phase in ["hook_suspend", "suspend", "resume", "hook_resume", "first_byte"] {
        let n = metric_sum(&text, &format!("gpusnap_agent_swap_phase_seconds_count{{phase=\"{phase}\"}}"));
        assert!(n >= swaps - 1.0 && n > 0.0, "phase {phase}: {n} of {swaps} swaps:\n{text}");
    }
    for kind in ["hook_suspend", "hook_resume"] {
        let n = metric_sum(
            &text,
            &format!("gpusnap_agent_transitions_total{{service=\"a\",kind=\"{kind}\",result=\"ok\"}}"),
        );
        assert!(n >= 2.0, "{kind}: {n}\n{text}");
    }
    let total = metric_sum(&text, "gpusnap_agent_swap_seconds_sum");
    let phases = metric_sum(&text, "gpusnap_agent_swap_phase_seconds_sum");
    assert!((phases - total).abs() < 1e-6 * swaps, "phases {phases} s, swaps {total} s");

    // The full size survives the agent: killed and restarted, it still
    // evicts for 600 MiB (or the next resume would run out of memory in
    // its after_resume hook and answer 503).
    let rec: Value =
        serde_json::from_slice(&std::fs::read(a.w.state_dir().join("agent/services.json")).unwrap()).unwrap();
    for n in ["a", "b"] {
        let full = rec[n]["full_footprint"].as_u64().unwrap_or(0);
        assert!(full >= 600 << 20, "{n}: full_footprint {full}: {rec}");
    }
    a.kill9();
    a.start();
    let suspended = if a.wait_state("a", a.state("a").as_str())["state"] == "suspended" { 0 } else { 1 };
    for i in 0..2 {
        let (port, pid) = if (suspended + i) % 2 == 0 { (a.port(0), pa) } else { (a.port(1), pb) };
        let (code, body) = get_any(port, "/");
        assert_eq!(code, 200, "after the restart, request {i}: {body}\n{}", a.log());
        assert!(body.starts_with(&format!("ok {pid} ")) && body.trim_end().ends_with(" 1"), "{body}");
    }
}

#[test]
fn a_failing_or_late_before_suspend_hook_still_suspends() {
    let mut a = AgentWorld::new(
        1000,
        "",
        &[
            Svc {
                name: "f",
                mib: 100,
                gpu: 0,
                extra: "suspend_after = \"500ms\"\n# fake-workload: --kv-mib 100\n\
                        hooks.before_suspend = { path = \"/sleep?fail=1\" }",
            },
            Svc {
                name: "l",
                mib: 100,
                gpu: 0,
                extra: "suspend_after = \"500ms\"\n# fake-workload: --kv-mib 100\n\
                        hooks.before_suspend = { path = \"/sleep?fail=1&delay_ms=5000\", timeout = \"300ms\" }",
            },
        ],
    );
    for (i, name) in ["f", "l"].into_iter().enumerate() {
        let pid = a.wait_state(name, "suspended")["pid"].as_i64().unwrap();
        assert_eq!(driver_state(&a.w, pid), "checkpointed");
        let notes = a.notes(pid);
        let why = if name == "f" { "HTTP 500" } else { "no answer within 300 ms" };
        assert!(
            notes.iter().any(|n| {
                let d = n["detail"].as_str().unwrap();
                d.contains("before_suspend hook failed") && d.contains(why) && d.contains("suspending anyway")
            }),
            "{notes:?}"
        );
        // It never slept: a request finds it whole.
        let (code, body) = get_any(a.port(i), "/");
        assert_eq!(code, 200, "{body}");
        assert!(body.starts_with(&format!("ok {pid} ")) && body.trim_end().ends_with(" 1"), "{body}");
    }
    let m = a.metrics();
    assert!(
        m.contains("gpusnap_agent_transitions_total{service=\"f\",kind=\"hook_suspend\",result=\"failed\"}"),
        "{m}"
    );
}

#[test]
fn a_failing_after_resume_hook_answers_503_and_suspends_again() {
    let mut a = AgentWorld::new(
        1000,
        "",
        &[Svc {
            name: "w",
            mib: 100,
            gpu: 0,
            extra: "suspend_after = \"500ms\"\nwake_timeout = \"30s\"\n# fake-workload: --kv-mib 100\n\
                    hooks.before_suspend = { path = \"/sleep\" }\n\
                    hooks.after_resume = { path = \"/wake_up?fail=1\", timeout = \"5s\" }",
        }],
    );
    let pid = a.wait_state("w", "running")["pid"].as_i64().unwrap();
    a.wait_state("w", "suspended");
    // The request waits for the resume, whose hook fails: a clear 503, not
    // an answer from a server without its KV cache, nor another try.
    let t0 = Instant::now();
    let (code, body) = get_any(a.port(0), "/");
    assert_eq!(code, 503, "{body}\n{}", a.log());
    assert!(body.contains("after_resume hook failed") && body.contains("HTTP 500"), "{body}");
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    let s = a.wait_state("w", "suspended");
    assert!(s["last_error"].as_str().unwrap_or("").contains("after_resume hook"), "{s}");
    assert_eq!(driver_state(&a.w, pid), "checkpointed");
    let notes = a.notes(pid);
    assert!(
        notes.iter().any(|n| {
            let d = n["detail"].as_str().unwrap();
            d.contains("after_resume hook failed: POST /wake_up?fail=1") && d.contains("suspended again")
        }),
        "{notes:?}"
    );
    let m = a.metrics();
    assert!(
        m.contains("gpusnap_agent_transitions_total{service=\"w\",kind=\"hook_resume\",result=\"failed\"} 1"),
        "{m}"
    );
}

/// Requests that follow the journal (`/v1/events`, held open) are bounded:
/// past the cap, 503; a request that stops after what is there is still
/// answered.
#[test]
fn journal_followers_are_bounded() {
    let mut a = AgentWorld::new(1000, "", &[Svc { name: "f", mib: 100, gpu: 0, extra: "" }]);
    a.wait_state("f", "running");
    let follow = || {
        let mut s = UnixStream::connect(&a.socket).unwrap();
        s.set_read_timeout(Some(LONG)).unwrap();
        write!(s, "GET /v1/events?after=0 HTTP/1.1\r\nHost: agent\r\n\r\n").unwrap();
        let mut head = Vec::new();
        let mut b = [0u8; 1];
        while !head.ends_with(b"\r\n") && s.read(&mut b).unwrap() == 1 {
            head.push(b[0]);
        }
        let code: u16 = String::from_utf8_lossy(&head).split_whitespace().nth(1).unwrap().parse().unwrap();
        (s, code)
    };
    let cap = gpusnap_agent::api::EVENTS_FOLLOWERS;
    let held: Vec<UnixStream> = (0..cap)
        .map(|i| {
            let (s, code) = follow();
            assert_eq!(code, 200, "follower {i}");
            s
        })
        .collect();
    assert_eq!(follow().1, 503, "one past {cap} followers");
    let (code, body) = api_call(&a.socket, "GET", "/v1/events?after=0&follow=false");
    assert_eq!(code, 200, "{body}");
    drop(held);
}

#[test]
fn a_faulted_service_is_held_failed_and_not_routed_to_until_the_operator_ends_it() {
    let mut a = AgentWorld::new(
        1000,
        "",
        &[Svc { name: "f", mib: 100, gpu: 0, extra: "suspend_after = \"1h\"\non_fault = \"hold\"" }],
    );
    let pid = a.wait_state("f", "running")["pid"].as_i64().unwrap();
    // An illegal-address kernel in the middle of a request: the server's
    // context faults and it exits; its light guard holds it.
    // (Sent straight to the backend, not waited on: the held server keeps
    // the connection open.)
    let mut c = TcpStream::connect(("127.0.0.1", a.ports[0].1)).unwrap();
    write!(c, "GET /fault HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let s = a.wait_state("f", "faulted");
    assert!(s["last_error"].as_str().unwrap_or("").contains("CUDA context faulted"), "{s}");
    assert_eq!(s["pid"], pid, "{s}");
    assert!(std::path::Path::new(&format!("/proc/{pid}")).exists(), "held, not dead");
    assert_eq!(metric_sum(&a.metrics(), "gpusnap_agent_faults_total"), 1.0, "{}", a.metrics());
    // Not routed to: a request is closed unanswered, the service stays held.
    let (code, _) = get_any(a.port(0), "/");
    assert_ne!(code, 200);
    assert_eq!(a.state("f"), "faulted");
    // The operator ends it: a death like any other, restarted.
    let r = a.w.json(&["stop", "--force", &pid.to_string()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let end = Instant::now() + LONG;
    loop {
        let s = a.service("f");
        if s["state"] == "running" && s["pid"].as_i64().is_some_and(|p| p != pid) {
            break;
        }
        assert!(Instant::now() < end, "not restarted: {s}\n{}", a.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    a.wait_state("f", "running");
    assert!(get(a.port(0), "/").starts_with("ok "));
    drop(c);
}

#[test]
fn a_request_to_a_suspended_server_that_is_stopped_is_refused_and_it_stays_suspended() {
    // The soak's sigstop (seed 11): a request came for a suspended server
    // whose process was stopped; the driver cannot be asked about a stopped
    // process, no CUDA process was found, and the agent said the server was
    // back (resumed in 0 ms) while the driver still had it checkpointed.
    let mut a = AgentWorld::new(
        1000,
        "",
        &[Svc { name: "s", mib: 100, gpu: 0, extra: "suspend_after = \"500ms\"\nwake_timeout = \"3s\"" }],
    );
    let pid = a.wait_state("s", "suspended")["pid"].as_i64().unwrap();
    let stop = |sig| nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig).unwrap();
    stop(nix::sys::signal::Signal::SIGSTOP);
    let (code, _) = get_any(a.port(0), "/");
    assert_ne!(code, 200);
    let s = a.service("s");
    stop(nix::sys::signal::Signal::SIGCONT);
    assert_ne!(s["state"], "running", "{s}");
    a.wait_state("s", "suspended");
    assert_eq!(driver_state(&a.w, pid), "checkpointed");
    // Continued, it is resumed by the next request and answers right.
    let body = get(a.port(0), "/");
    assert!(body.starts_with(&format!("ok {pid} ")) && body.trim_end().ends_with(" 1"), "{body}");
}
