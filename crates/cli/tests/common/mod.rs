//! Test harness: the real `gpusnap` binary against the fake driver and NVML
//! (see docs/design/fakes.md), each test in its own fake GPU world.

#![allow(dead_code)]

mod agent;
mod fake_criu;
pub mod http;
mod moto;
mod rootfs;

#[allow(unused_imports)] // each test binary uses what it needs
pub use agent::*;
#[allow(unused_imports)]
pub use fake_criu::*;
#[allow(unused_imports)]
pub use moto::*;
#[allow(unused_imports)]
pub use rootfs::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

pub const MIB: u64 = 1 << 20;

fn target_dir() -> PathBuf {
    // .../target/debug/gpusnap
    PathBuf::from(env!("CARGO_BIN_EXE_gpusnap")).parent().unwrap().to_path_buf()
}

/// Builds the fakes once per test process (unless `GPUSNAP_TEST_PREBUILT`
/// says scripts/test.sh has just built the workspace) and links them under
/// their real names.
pub fn fake_libdir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let profile_dir = target_dir();
        let release = profile_dir.file_name().is_some_and(|n| n == "release");
        if std::env::var_os("GPUSNAP_TEST_PREBUILT").is_none() {
            build_fakes(release);
        }
        let dir = profile_dir.join("fakelib");
        std::fs::create_dir_all(&dir).unwrap();
        for (src, dst) in
            [("libgpusnap_fake_cuda.so", "libcuda.so.1"), ("libgpusnap_fake_nvml.so", "libnvidia-ml.so.1")]
        {
            let (link, want) = (dir.join(dst), profile_dir.join(src));
            if std::fs::read_link(&link).ok().as_deref() == Some(want.as_path()) {
                continue;
            }
            // Test processes running side by side link the same names: each
            // links a name of its own and renames it over, so that none sees
            // the link missing or fails on one another made.
            let mine = dir.join(format!("{dst}.{}", std::process::id()));
            let _ = std::fs::remove_file(&mine);
            std::os::unix::fs::symlink(&want, &mine).unwrap();
            std::fs::rename(&mine, &link).unwrap();
        }
        dir
    })
}

fn build_fakes(release: bool) {
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args([
        "build",
        "-q",
        "-p",
        "gpusnap-fake-cuda",
        "-p",
        "gpusnap-fake-nvml",
        "-p",
        "gpusnap-fake-workload",
        // `run --light` finds it next to the gpusnap binary.
        "-p",
        "gpusnap-preload",
    ]);
    if release {
        cmd.arg("--release");
    }
    let st = cmd.status().expect("cargo build of the fakes");
    assert!(st.success(), "building the fakes failed");
}

pub fn fake_workload_bin() -> PathBuf {
    fake_libdir();
    target_dir().join("fake-workload")
}

/// One isolated fake host: a fake GPU world and a gpusnap state dir.
/// A child process reaped by a thread of its own as soon as it exits, as a
/// real supervisor would: a killed workload leaves no zombie holding its pid.
pub struct Kid {
    pid: i32,
    /// The process itself, not its number: the waiter thread reaps it as
    /// soon as it exits and its pid may then be another test's process.
    pidfd: Option<Pidfd>,
    exited: Arc<(Mutex<Option<ExitStatus>>, Condvar)>,
}

/// A pidfd (pidfd_open(2)): signals sent through it reach the process it
/// was opened on or nobody, never a later process with the same pid. The
/// tests run side by side and pids are reused quickly; a stray SIGKILL by
/// number once ended another test's process.
pub struct Pidfd(std::os::fd::OwnedFd);

impl Pidfd {
    /// Opens one on `pid`; None when it is gone already.
    pub fn open(pid: i32) -> Option<Pidfd> {
        use std::os::fd::FromRawFd;
        // SAFETY: pidfd_open takes a pid and flags and returns a new
        // descriptor or -1; nothing of ours is read or written.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        // SAFETY: a descriptor the kernel just gave us, owned from here.
        (fd >= 0).then(|| Pidfd(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) }))
    }

    /// Whether the process is alive (not yet exited).
    pub fn alive(&self) -> bool {
        self.signal(0)
    }

    /// Sends `sig` (0: only checks); false when the process is gone.
    pub fn signal(&self, sig: i32) -> bool {
        use std::os::fd::AsRawFd;
        // SAFETY: the descriptor is ours and open; no siginfo is passed.
        unsafe {
            libc::syscall(libc::SYS_pidfd_send_signal, self.0.as_raw_fd(), sig, std::ptr::null::<u8>(), 0)
                == 0
        }
    }
}

impl Kid {
    /// Each child gets a session of its own, as a service manager or a
    /// container runtime gives one: CRIU cannot dump a process whose session
    /// leader is outside its pid namespace, which is where a test runner
    /// started by `docker exec` (CI) leaves its children.
    fn spawn(mut cmd: Command) -> Kid {
        use std::os::unix::process::CommandExt;
        // SAFETY: setsid is async-signal-safe; nothing else runs between
        // fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                libc::setsid();
                Ok(())
            });
        }
        let mut child = cmd.spawn().expect("spawn");
        let pid = child.id() as i32;
        // Opened before the waiter thread can reap it: it is this process.
        let pidfd = Pidfd::open(pid);
        let exited = Arc::new((Mutex::new(None), Condvar::new()));
        let e2 = Arc::clone(&exited);
        std::thread::spawn(move || {
            let st = child.wait().ok();
            *e2.0.lock().unwrap() = st;
            e2.1.notify_all();
        });
        Kid { pid, pidfd, exited }
    }

    pub fn id(&self) -> u32 {
        self.pid as u32
    }

    pub fn try_wait(&self) -> Option<ExitStatus> {
        *self.exited.0.lock().unwrap()
    }

    pub fn wait(&self) -> Option<ExitStatus> {
        let (m, cv) = &*self.exited;
        let g = cv.wait_timeout_while(m.lock().unwrap(), Duration::from_secs(60), |s| s.is_none()).unwrap().0;
        *g
    }

    pub fn kill(&self) {
        match &self.pidfd {
            Some(fd) => {
                fd.signal(libc::SIGKILL);
            }
            // No pidfd could be opened (out of descriptors): by number,
            // while it is known not to have been reaped yet.
            None if self.try_wait().is_none() => {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(self.pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            None => {}
        }
    }
}

pub struct World {
    pub tmp: tempfile::TempDir,
    pub children: Vec<Kid>,
    /// Processes restored by CRIU (not our children), ended on drop.
    pub adopted: Vec<i32>,
    /// Their pidfds, opened when adopted (see [`Pidfd`]).
    adopted_fds: Vec<Option<Pidfd>>,
    /// More environment for every gpusnap run (a remote's credentials).
    pub env_extra: Vec<(String, String)>,
    /// How long one gpusnap run may take before it counts as hung.
    pub run_limit: Duration,
}

pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    pub fn json(&self) -> Value {
        let line = self.stdout.lines().last().unwrap_or("");
        serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}\nstderr: {}", self.stdout, self.stderr))
    }
}

impl World {
    /// `gpus`: total MiB of each fake GPU.
    pub fn new(gpus: &[u64]) -> Self {
        Self::with_config(gpus, serde_json::json!({}))
    }

    pub fn with_config(gpus: &[u64], extra: Value) -> Self {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(tmp.path().join("fake")).unwrap();
        let gpus: Vec<Value> = gpus
            .iter()
            .enumerate()
            .map(|(i, mib)| {
                serde_json::json!({
                    "uuid": format!("GPU-{i:08x}-0000-0000-0000-000000000000"),
                    "name": "NVIDIA H200 (fake)",
                    "total_mib": mib,
                })
            })
            .collect();
        let mut cfg = serde_json::json!({
            "driver_version": 13000, "driver_string": "580.159.04",
            "gpus": gpus, "checkpoint_gbps": 100.0, "restore_gbps": 100.0, "inject": [],
        });
        if let (Some(c), Some(e)) = (cfg.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                c.insert(k.clone(), v.clone());
            }
        }
        let w = Self {
            tmp,
            children: Vec::new(),
            adopted: Vec::new(),
            adopted_fds: Vec::new(),
            env_extra: Vec::new(),
            run_limit: Duration::from_secs(60),
        };
        w.write_config(&cfg);
        w
    }

    pub fn write_config(&self, cfg: &Value) {
        std::fs::write(self.fake_dir().join("config.json"), serde_json::to_vec_pretty(cfg).unwrap()).unwrap();
    }

    pub fn config(&self) -> Value {
        serde_json::from_slice(&std::fs::read(self.fake_dir().join("config.json")).unwrap()).unwrap()
    }

    pub fn set_config(&self, key: &str, v: Value) {
        let mut c = self.config();
        c[key] = v;
        self.write_config(&c);
    }

    pub fn fake_dir(&self) -> PathBuf {
        self.tmp.path().join("fake")
    }

    pub fn state_dir(&self) -> PathBuf {
        self.tmp.path().join("state")
    }

    pub fn env(&self, cmd: &mut Command) {
        cmd.env("LD_LIBRARY_PATH", fake_libdir())
            .env("GPUSNAP_FAKE_DIR", self.fake_dir())
            .env("GPUSNAP_STATE_DIR", self.state_dir())
            .env_remove("GPUSNAP_LOG");
        for (k, v) in &self.env_extra {
            cmd.env(k, v);
        }
    }

    pub fn gpusnap_cmd(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpusnap"));
        self.env(&mut cmd);
        cmd.args(args).stdin(Stdio::null());
        cmd
    }

    /// Runs gpusnap to completion (bounded: a hang fails the test, with
    /// what it printed so far and where each of its threads waits).
    pub fn gpusnap(&self, args: &[&str]) -> Run {
        use std::io::Read;
        let mut child = self.gpusnap_cmd(args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        // Drained while it runs: a full pipe must not look like a hang.
        let drain = |mut r: Box<dyn Read + Send>| {
            std::thread::spawn(move || {
                let mut v = Vec::new();
                let _ = r.read_to_end(&mut v);
                v
            })
        };
        let out = drain(Box::new(child.stdout.take().unwrap()));
        let err = drain(Box::new(child.stderr.take().unwrap()));
        let end = Instant::now() + self.run_limit;
        let status = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break st;
            }
            if Instant::now() > end {
                let pid = child.id();
                let mut waits = String::new();
                for t in std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten() {
                    let wchan = std::fs::read_to_string(t.path().join("wchan")).unwrap_or_default();
                    let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
                    waits += &format!("{} {} {wchan}; ", t.file_name().to_string_lossy(), comm.trim());
                }
                let kids = children_of(pid as i32);
                let _ = child.kill();
                let _ = child.wait();
                let stderr = String::from_utf8_lossy(&err.join().unwrap_or_default()).into_owned();
                panic!("gpusnap {args:?} hung; threads: {waits}children: {kids:?}; stderr: {stderr}");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let (stdout, stderr) = (out.join().unwrap_or_default(), err.join().unwrap_or_default());
        Run {
            code: status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&stdout).into_owned(),
            stderr: String::from_utf8_lossy(&stderr).into_owned(),
        }
    }

    pub fn json(&self, args: &[&str]) -> Run {
        let mut a = vec!["--json"];
        a.extend_from_slice(args);
        self.gpusnap(&a)
    }

    /// Starts a fake CUDA program holding `mib` on GPU `gpu`; returns its pid
    /// once it has allocated and reported its first intact iteration.
    pub fn workload(&mut self, mib: u64, gpu: u32, extra: &[&str]) -> i32 {
        let status = self.tmp.path().join(format!("status-{}", self.children.len()));
        let mut cmd = Command::new(fake_workload_bin());
        self.env(&mut cmd);
        cmd.args(["--mib", &mib.to_string(), "--gpu", &gpu.to_string(), "--status"])
            .arg(&status)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            // A file, not a pipe: CRIU restores a pipe whose reader is outside
            // the tree as a pipe with no reader.
            .stderr(
                std::fs::File::create(self.tmp.path().join(format!("workload-{}.log", self.children.len())))
                    .unwrap(),
            );
        let child = Kid::spawn(cmd);
        let pid = child.pid;
        self.children.push(child);
        wait_for(Duration::from_secs(20), || self.status_of(pid).is_some_and(|s| s.1 >= 1));
        pid
    }

    pub fn status_path(&self, pid: i32) -> PathBuf {
        let idx = self.children.iter().position(|c| c.id() as i32 == pid).expect("a workload of this world");
        self.tmp.path().join(format!("status-{idx}"))
    }

    /// (pid, iteration, intact) from the workload's status file.
    pub fn status_of(&self, pid: i32) -> Option<(i32, u64, bool)> {
        read_status(&self.status_path(pid))
    }

    /// Waits until the workload has done `n` more intact iterations.
    pub fn assert_progressing(&self, pid: i32) {
        assert_progressing_at(&self.status_path(pid));
    }
}

/// (pid, iteration, intact) from a workload's status file.
pub fn read_status(path: &Path) -> Option<(i32, u64, bool)> {
    {
        let s = std::fs::read_to_string(path).ok()?;
        let f: Vec<&str> = s.split_whitespace().collect();
        Some((f.first()?.parse().ok()?, f.get(1)?.parse().ok()?, *f.get(2)? == "1"))
    }
}

/// Waits until the workload writing `path` has done two more intact iterations.
pub fn assert_progressing_at(path: &Path) {
    let (_, start, _) = read_status(path).expect("status");
    wait_for(Duration::from_secs(20), || read_status(path).is_some_and(|s| s.1 >= start + 2 && s.2));
}

impl World {
    pub fn iteration(&self, pid: i32) -> u64 {
        self.status_of(pid).map(|s| s.1).unwrap_or(0)
    }

    /// The fake driver's journal: (call, target pid, rc).
    pub fn journal(&self) -> Vec<(String, i32, i32)> {
        std::fs::read_to_string(self.fake_dir().join("journal.log"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                Some((f.get(2)?.to_string(), f.get(3)?.parse().ok()?, f.get(4)?.parse().ok()?))
            })
            .collect()
    }

    /// The journaled calls on `pid` other than get-state, as "call=rc".
    pub fn calls_on(&self, pid: i32) -> Vec<String> {
        self.journal()
            .into_iter()
            .filter(|(c, p, _)| *p == pid && c != "get_state")
            .map(|(c, _, rc)| format!("{c}={rc}"))
            .collect()
    }

    /// What the fake driver's restores of `pid` read in its host copy
    /// (`fake-workload --host-copy-mib`), oldest first: the journal's
    /// `restore_data` notes (`ok`, `zeros:PAGES`, `bad:PAGES`, `short:BYTES`).
    pub fn restore_data(&self, pid: i32) -> Vec<String> {
        std::fs::read_to_string(self.fake_dir().join("journal.log"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                let mine = f.get(2) == Some(&"restore_data") && f.get(3)?.parse() == Ok(pid);
                mine.then(|| f.get(4).map(|s| s.to_string())).flatten()
            })
            .collect()
    }

    /// The thread the fake driver names as `pid`'s restore thread
    /// (`fake-workload --host-copy-mib` starts it, named `cuda-restore`), from
    /// the fake's state; None when it registered none (the pid is named).
    pub fn fake_restore_tid(&self, pid: i32) -> Option<i32> {
        let s: Value =
            serde_json::from_str(&std::fs::read_to_string(self.fake_dir().join("state.json")).ok()?).ok()?;
        s["procs"][pid.to_string()]["restore_tid"].as_i64().map(|t| t as i32)
    }

    /// Whether the child still runs: a zombie leader whose other threads
    /// are still being torn down (not yet reapable) counts as gone.
    pub fn alive(&mut self, pid: i32) -> bool {
        let c = self.children.iter().find(|c| c.pid == pid).expect("child");
        if c.try_wait().is_some() {
            return false;
        }
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next());
        !matches!(state, None | Some("Z") | Some("X"))
    }

    /// Kills a workload that holds no live (restored) CUDA state.
    pub fn kill(&mut self, pid: i32) {
        let c = self.children.iter().find(|c| c.pid == pid).expect("child");
        c.kill();
        c.wait();
    }
}

impl World {
    /// Reaps a child that something else (hibernate) ended, so its pid is free.
    pub fn reap(&mut self, pid: i32) {
        let c = self.children.iter().find(|c| c.pid == pid).expect("child");
        c.wait();
    }

    /// Starts a plain CPU process tree (python: a thread, an open file, a
    /// pipe to a child) that counts in FILE; returns its root pid.
    pub fn cpu_tree(&mut self) -> (i32, PathBuf) {
        let out = self.tmp.path().join(format!("count-{}", self.children.len()));
        let script = r#"
import os, sys, threading, time
out = sys.argv[1]
r, w = os.pipe()
child = os.fork()
if child == 0:
    os.close(w)
    with open(out + ".child", "w") as f:
        while True:
            b = os.read(r, 64)
            if not b: os._exit(0)
            f.write(b.decode()); f.flush()
os.close(r)
ticks = [0]
def tick():
    while True:
        ticks[0] += 1; time.sleep(0.01)
threading.Thread(target=tick, daemon=True).start()
log = open(out + ".log", "a")
i = 0
while True:
    i += 1
    log.write(f"{i}\n"); log.flush()
    os.write(w, f"{i}\n".encode())
    tmp = out + ".tmp"
    with open(tmp, "w") as f: f.write(f"{i} {ticks[0]}\n")
    os.replace(tmp, out)
    time.sleep(0.05)
"#;
        let mut cmd = Command::new("python3");
        cmd.args(["-c", script])
            .arg(&out)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(self.tmp.path().join("cpu.log")).unwrap());
        let child = Kid::spawn(cmd);
        let pid = child.pid;
        self.children.push(child);
        wait_for(Duration::from_secs(10), || std::fs::read_to_string(&out).is_ok_and(|s| !s.is_empty()));
        (pid, out)
    }

    /// Starts `prog args` with the fake world's environment, in the
    /// background (a child reaped on exit; its stderr in a file).
    pub fn spawn_env(&mut self, prog: &str, args: &[&str]) -> usize {
        let n = self.children.len();
        let mut cmd = Command::new(prog);
        self.env(&mut cmd);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(self.tmp.path().join(format!("spawned-{n}.log"))).unwrap());
        self.children.push(Kid::spawn(cmd));
        n
    }

    /// Starts `cmd` as a child of the test (its own session, reaped on
    /// exit, ended on drop); returns its pid.
    #[allow(dead_code)]
    pub fn spawn_cmd(&mut self, cmd: Command) -> i32 {
        let kid = Kid::spawn(cmd);
        let pid = kid.pid;
        self.children.push(kid);
        pid
    }

    /// Starts gpusnap in the background (a child reaped on exit).
    pub fn spawn_gpusnap(&mut self, args: &[&str]) -> usize {
        self.spawn_gpusnap_env(args, &[])
    }

    /// [`World::spawn_gpusnap`] with more environment variables.
    pub fn spawn_gpusnap_env(&mut self, args: &[&str], env: &[(&str, &str)]) -> usize {
        let mut cmd = self.gpusnap_cmd(args);
        cmd.envs(env.iter().copied());
        let n = self.children.len();
        cmd.stdout(std::fs::File::create(self.tmp.path().join(format!("gpusnap-{n}.out"))).unwrap())
            .stderr(std::fs::File::create(self.tmp.path().join(format!("gpusnap-{n}.err"))).unwrap());
        self.children.push(Kid::spawn(cmd));
        n
    }

    /// A program's exit status, waiting for it (bounded).
    pub fn wait_child(&self, index: usize) -> ExitStatus {
        self.children[index].wait().expect("exited within 60 s")
    }

    pub fn child_pid(&self, index: usize) -> i32 {
        self.children[index].pid
    }

    /// Registers a process this test did not start (CRIU restored it) to be
    /// ended on drop. A pid adopted again whose process has ended since (a
    /// hibernate and wake restore the same pid) now names the restored one.
    pub fn adopt(&mut self, pid: i32) {
        match self.adopted.iter().position(|&p| p == pid) {
            Some(i) if self.adopted_fds[i].as_ref().is_some_and(Pidfd::alive) => {}
            Some(i) => self.adopted_fds[i] = Pidfd::open(pid),
            None => {
                self.adopted.push(pid);
                self.adopted_fds.push(Pidfd::open(pid));
            }
        }
    }
}

/// The counter a cpu_tree last wrote.
pub fn count(out: &Path) -> u64 {
    std::fs::read_to_string(out).ok().and_then(|s| s.split_whitespace().next()?.parse().ok()).unwrap_or(0)
}

/// Whether some process has that pid now.
pub fn pid_exists(pid: i32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Children of `pid` (from /proc).
pub fn children_of(pid: i32) -> Vec<i32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect()
}

impl Drop for World {
    fn drop(&mut self) {
        // Only the processes adopted, through their pidfds: by number, a
        // pid that ended and was reused would be another test's process.
        for (&pid, fd) in self.adopted.iter().zip(&self.adopted_fds) {
            let Some(fd) = fd.as_ref().filter(|fd| fd.alive()) else { continue };
            for c in children_of(pid) {
                if let Some(cfd) = Pidfd::open(c) {
                    cfd.signal(libc::SIGKILL);
                }
            }
            fd.signal(libc::SIGKILL);
        }
        for c in &self.children {
            c.kill();
            c.wait();
        }
    }
}

/// A python process holding `mib` MiB made by the Python expression `make`
/// (of `n`, the size in bytes; e.g. `bytearray(os.urandom(n))`), checking
/// them (sha256) over and over: each check appends "N ok" or "N bad" to
/// the file returned.
pub fn checking_holder(w: &mut World, mib: u64, make: &str) -> (i32, PathBuf) {
    let out = w.tmp.path().join(format!("hold-{}", w.children.len()));
    let script = format!(
        r#"
import hashlib, os, sys, time
n = int(sys.argv[1]) << 20
buf = {make}
want = hashlib.sha256(buf).digest()
out = sys.argv[2]
i = 0
while True:
    i += 1
    ok = hashlib.sha256(buf).digest() == want
    with open(out, "a") as f: f.write(f"{{i}} {{'ok' if ok else 'bad'}}\n")
    time.sleep(0.05)
"#
    );
    let n = w.spawn_env("python3", &["-c", &script, &mib.to_string(), out.to_str().unwrap()]);
    let pid = w.child_pid(n);
    // Making and hashing the bytes takes a while on a busy 2-core machine
    // (1200 MiB took over 30 s in a CI run): the wait grows with the size.
    wait_for(Duration::from_secs((30 + mib / 10).max(60)), || {
        std::fs::read_to_string(&out).is_ok_and(|s| s.contains(" ok"))
    });
    (pid, out)
}

/// The checks a [`checking_holder`] wrote so far: (passed, failed).
pub fn checks(out: &Path) -> (usize, usize) {
    let s = std::fs::read_to_string(out).unwrap_or_default();
    (s.lines().filter(|l| l.ends_with(" ok")).count(), s.lines().filter(|l| l.ends_with(" bad")).count())
}

/// The [`checking_holder`] `pid`, hibernated as `image`, ended, then woken:
/// it goes on checking its memory and every check after the wake passes.
pub fn wake_intact(w: &mut World, pid: i32, image: &str, out: &Path) {
    w.reap(pid);
    wait_for(Duration::from_secs(10), || !pid_exists(pid));
    let (good, bad) = checks(out);
    assert_eq!(bad, 0);
    let r = w.json(&["wake", image, "--wait", "30"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    wait_for(Duration::from_secs(60), || checks(out).0 > good + 2);
    assert_eq!(checks(out).1, 0, "the memory came back intact");
}

pub fn wait_for(limit: Duration, f: impl FnMut() -> bool) {
    assert!(wait_until(limit, f), "condition not met within {limit:?}");
}

/// Whether `f` came true within `limit` (checked every 20 ms), for a caller
/// that asserts with its own message.
pub fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    while !f() {
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

// ---------------------------------------------------------------- the guard's tests

/// A file in the world's scratch directory.
pub fn status_file(w: &World, name: &str) -> PathBuf {
    w.tmp.path().join(name)
}

/// The pid a workload wrote into its status file (waits for it).
pub fn pid_in(path: &PathBuf) -> i32 {
    wait_for(Duration::from_secs(20), || {
        std::fs::read_to_string(path).is_ok_and(|s| s.split_whitespace().count() >= 3)
    });
    std::fs::read_to_string(path).unwrap().split_whitespace().next().unwrap().parse().unwrap()
}

/// Starts the fake workload under `run --light --fast-swap` with
/// verification on; returns the `run` child's index and the workload's pid.
pub fn run_fast(w: &mut World, st: &PathBuf, extra: &[&str]) -> (usize, i32) {
    let wl = fake_workload_bin();
    let mut args =
        vec!["run", "--light", "--fast-swap", "--", wl.to_str().unwrap(), "--status", st.to_str().unwrap()];
    args.extend_from_slice(extra);
    let idx = w.spawn_gpusnap_env(&args, &[("GPUSNAP_FAST_SWAP_VERIFY", "1")]);
    (idx, pid_in(st))
}

/// The fake workload run with `args` and no guard, for its natural ending.
pub fn unguarded(w: &World, args: &[&str]) -> ExitStatus {
    let mut cmd = Command::new(fake_workload_bin());
    w.env(&mut cmd);
    cmd.args(args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
    cmd.status().unwrap()
}

/// The fake driver's journal shows a lock and then a checkpoint of `pid`.
pub fn assert_suspended_before_death(w: &World, pid: i32) {
    let calls = w.calls_on(pid);
    assert!(
        calls.windows(2).any(|c| c[0] == "lock=0" && c[1] == "checkpoint=0"),
        "no lock + checkpoint of {pid} before it died: {calls:?}"
    );
}

/// The details of `pid`'s journal entries (`gpusnap history`).
pub fn history_notes(w: &World, pid: i32) -> Vec<String> {
    let h = w.json(&["history", &pid.to_string()]).json();
    h["events"].as_array().unwrap().iter().filter_map(|e| e["detail"].as_str().map(str::to_string)).collect()
}

/// The guarded `run` (child `idx`) ends by signal `sig`, its CUDA process
/// `pid` suspended before it died and a journal detail saying so (`note`).
pub fn assert_died_suspended(w: &World, idx: usize, pid: i32, sig: i32, note: &str, ctx: &str) {
    use std::os::unix::process::ExitStatusExt;
    let s = w.wait_child(idx);
    assert_eq!(s.signal(), Some(sig), "{ctx}: {s:?}");
    assert_suspended_before_death(w, pid);
    let notes = history_notes(w, pid);
    assert!(notes.iter().any(|n| n.contains(note)), "{ctx}: {notes:?}");
}

/// TracerPid of `pid` (-1 when it is gone).
pub fn tracer(pid: i32) -> i32 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| l.strip_prefix("TracerPid:").map(|v| v.trim().parse().unwrap_or(0)))
        })
        .unwrap_or(-1)
}

/// A memory cgroup for one test (v1's memory controller or v2), removed on drop.
pub struct Cgroup(pub PathBuf);

impl Cgroup {
    pub fn new(limit: u64) -> Option<Self> {
        // Unique per test: tests of one binary run at the same time.
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let name = format!("gpusnap-test-{}-{n}", std::process::id());
        for (root, limit_file) in
            [("/sys/fs/cgroup/memory", "memory.limit_in_bytes"), ("/sys/fs/cgroup", "memory.max")]
        {
            let d = PathBuf::from(root).join(&name);
            if std::fs::create_dir(&d).is_ok() {
                if std::fs::write(d.join(limit_file), limit.to_string()).is_ok() {
                    return Some(Cgroup(d));
                }
                let _ = std::fs::remove_dir(&d);
            }
        }
        None
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.0).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// A docker-like container cgroup (`docker-ID.scope`, cgroup v2) made by the
/// test: what gpusnap reads as a container of its own. Removed on drop.
#[allow(dead_code)]
pub struct Container {
    dir: PathBuf,
}

#[allow(dead_code)]
impl Container {
    pub fn new(tag: u64) -> Option<Self> {
        let root = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"].into_iter().find(|r| {
            std::path::Path::new(r).join("cgroup.procs").is_file()
                && std::path::Path::new(r).join("cgroup.controllers").is_file()
        });
        let Some(root) = root else {
            gpusnap_testkit::skip("no cgroup v2 hierarchy to make a container's cgroup in");
            return None;
        };
        let id = format!("{:016x}{:048x}", std::process::id(), tag);
        let dir = PathBuf::from(root).join(format!("docker-{id}.scope"));
        if std::fs::create_dir(&dir).is_err() {
            gpusnap_testkit::skip(format!("cannot create a cgroup under {root}"));
            return None;
        }
        Some(Container { dir })
    }

    /// Moves process `pid` into it.
    pub fn enter(&self, pid: i32) {
        std::fs::write(self.dir.join("cgroup.procs"), pid.to_string()).unwrap();
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        for _ in 0..100 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// The image tests need a real CRIU on PATH (CI installs it).
pub fn criu_present() {
    let ok = Command::new("criu").arg("--version").output().is_ok_and(|o| o.status.success());
    assert!(ok, "these tests need CRIU >= 4 on PATH (scripts/install-criu.sh)");
}

/// The chunks (blake3 names) of an image's pages files, largest file first,
/// from its manifest.
#[allow(dead_code)]
pub fn pages_chunks(state_dir: &Path, image: &str) -> Vec<String> {
    let m: Value = serde_json::from_str(
        &std::fs::read_to_string(state_dir.join("images").join(image).join("manifest.json")).unwrap(),
    )
    .unwrap();
    let mut files: Vec<&Value> = m["files"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["path"].as_str().unwrap().contains("/pages-"))
        .collect();
    files.sort_by_key(|f| std::cmp::Reverse(f["size"].as_u64().unwrap()));
    files
        .iter()
        .flat_map(|f| {
            f["chunks"].as_array().unwrap().iter().map(|c| c["blake3"].as_str().unwrap().to_string())
        })
        .collect()
}

/// Flips a byte in the middle of a stored chunk of `image`'s largest pages
/// file that no image in `spare` refers to; returns its path and its good
/// bytes (to put back).
#[allow(dead_code)]
pub fn corrupt_pages_chunk(state_dir: &Path, image: &str, spare: &[&str]) -> (PathBuf, Vec<u8>) {
    let keep: std::collections::HashSet<String> =
        spare.iter().flat_map(|s| pages_chunks(state_dir, s)).collect();
    let mine = pages_chunks(state_dir, image);
    let h = mine
        .iter()
        .skip(mine.len() / 2)
        .chain(mine.iter())
        .find(|h| !keep.contains(*h))
        .expect("a chunk of its own");
    let p = state_dir.join("store/chunks").join(&h[..2]).join(h);
    let good = std::fs::read(&p).unwrap();
    let mut bad = good.clone();
    let at = bad.len() / 2;
    bad[at] ^= 0x5a;
    std::fs::write(&p, &bad).unwrap();
    (p, good)
}

/// The memory workload of the lazy-wake tests (`lazy_mem.py`).
pub const LAZY_MEM: &str = include_str!("../lazy_mem.py");

/// A python process with `mib` MiB in each of four regions (lazy_mem.py);
/// returns its pid and the path its files start with.
pub fn mem_proc(w: &mut World, tag: &str, mib: u64) -> (i32, PathBuf) {
    let out = w.state_dir().with_file_name(format!("mem-{tag}"));
    let i = w.spawn_env("python3", &["-c", LAZY_MEM, out.to_str().unwrap(), &mib.to_string()]);
    let pid = w.child_pid(i);
    wait_for(Duration::from_secs(60), || out.with_extension("before").exists() && out.exists());
    (pid, out)
}

/// What a lazy_mem.py process wrote to `p` with extension `ext`, trimmed.
pub fn read_ext(p: &Path, ext: &str) -> String {
    std::fs::read_to_string(p.with_extension(ext)).unwrap_or_default().trim().to_string()
}

/// A loopback port free now and not handed out before in this test binary
/// (its tests run side by side: two servers given one port would each find
/// the other's). A port freed and taken by another program before its
/// server binds it stays possible; the server's start-up check names that.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// A fake CUDA workload whose checkpoint leaves `host_mib` MiB of host copy
/// in it (docs/design/fakes.md, "The host copy"), hibernated as `image`; returns
/// its pid (gone, its image written, no restore yet).
pub fn hibernated_host_copy(w: &mut World, host_mib: u64, image: &str) -> i32 {
    let pid = w.workload(64, 0, &["--host-copy-mib", &host_mib.to_string()]);
    let r = w.json(&["hibernate", &pid.to_string(), "--image", image]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.reap(pid);
    wait_for(Duration::from_secs(10), || !pid_exists(pid));
    assert!(w.restore_data(pid).is_empty(), "no restore yet: {:?}", w.restore_data(pid));
    pid
}

/// A CRIU (a wrapper beside the state directory) that refuses
/// `--lazy-pages` as a CRIU or kernel without lazy restores does, and runs
/// the real one otherwise; for `--criu`.
pub fn criu_without_lazy(w: &World) -> PathBuf {
    let wrapper = w.state_dir().with_file_name("criu-no-lazy");
    std::fs::write(
        &wrapper,
        "#!/bin/sh\nfor a in \"$@\"; do [ \"$a\" = --lazy-pages ] && { echo 'Error (criu/uffd.c:1): Lazy pages are not available' >&2; exit 1; }; done\nexec criu \"$@\"\n",
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    wrapper
}

/// Runs `cmd` to completion within `limit` (killed and failing the test
/// past it), its output.
pub fn bounded(mut cmd: Command, limit: Duration) -> std::process::Output {
    use std::io::Read;
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn");
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = r.read_to_end(&mut v);
            v
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let end = Instant::now() + limit;
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    std::process::Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    }
}
