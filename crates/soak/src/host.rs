//! The soak's host: a fake GPU world (the fake driver and NVML), the real
//! `gpusnap` binary, the processes the soak starts, and a runner for
//! gpusnap commands that holds each to a deadline.

use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::stats::Stats;

/// One finished (or ended) gpusnap command.
pub struct Outcome {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
    pub killed: bool,
}

impl Outcome {
    /// The `--json` object it printed last (Null when none).
    pub fn json(&self) -> Value {
        self.stdout.lines().rev().find_map(|l| serde_json::from_str(l).ok()).unwrap_or(Value::Null)
    }

    pub fn error_kind(&self) -> String {
        self.json()["error"]["kind"].as_str().unwrap_or("").to_string()
    }
}

pub struct Host {
    /// The scratch directory (the supervisor's: it removes it).
    pub root: PathBuf,
    pub bin: PathBuf,
    pub bindir: PathBuf,
    pub libdir: PathBuf,
    pub fake: PathBuf,
    /// The CRIU the soak's gpusnaps run: the real one, failing on request.
    pub criu: PathBuf,
    pub faultdir: PathBuf,
    pub gpu_mib: u64,
    /// How long any gpusnap command may take before it counts as hung.
    pub deadline: Duration,
    /// Every process the soak started, ended at the end.
    started: Mutex<Vec<Pidfd>>,
}

/// Starts `cmd` in a session of its own (CRIU dumps only trees whose session
/// leader is inside them).
pub fn spawn_session(cmd: &mut Command) -> std::io::Result<Child> {
    // SAFETY: setsid is async-signal-safe; nothing else runs between fork
    // and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    cmd.spawn()
}

pub fn signal(pid: i32, sig: i32) -> bool {
    if pid <= 0 {
        return false;
    }
    // SAFETY: kill(2) on a pid number; no memory is passed.
    unsafe { libc::kill(pid, sig) == 0 }
}

/// A process the soak started, held by a pidfd opened before anything could
/// reap it: a signal through it reaches that process or nobody, never a
/// later one given its pid (this host may reuse pids within seconds).
pub struct Pidfd(std::os::fd::OwnedFd, i32);

impl Pidfd {
    /// Opens `pid`'s pidfd; call it while `pid` is an unreaped child.
    pub fn open(pid: i32) -> Option<Pidfd> {
        use std::os::fd::FromRawFd;
        // SAFETY: pidfd_open(2) takes a pid and flags; no memory is passed.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return None;
        }
        // SAFETY: the kernel just gave us this descriptor; nothing else owns it.
        Some(Pidfd(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) }, pid))
    }

    pub fn pid(&self) -> i32 {
        self.1
    }

    /// Sends `sig`; false when the process is gone.
    pub fn signal(&self, sig: i32) -> bool {
        use std::os::fd::AsRawFd;
        // SAFETY: pidfd_send_signal(2) on our descriptor, with no siginfo
        // (a null pointer, which the call allows).
        unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.0.as_raw_fd(),
                sig,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            ) == 0
        }
    }

    pub fn try_clone(&self) -> Option<Pidfd> {
        Some(Pidfd(self.0.try_clone().ok()?, self.1))
    }
}

pub fn alive(pid: i32) -> bool {
    pid > 0 && std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "))
}

pub fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// A loopback port free now and never handed out before by this soak (two
/// services given one backend would answer for each other).
pub fn free_port() -> u16 {
    static GIVEN: Mutex<Vec<u16>> = Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap_or(0);
        if port != 0 && !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

fn find_criu() -> Option<PathBuf> {
    let out = Command::new("sh").args(["-c", "command -v criu"]).output().ok()?;
    let p = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (!p.is_empty()).then(|| PathBuf::from(p))
}

impl Host {
    pub fn new(root: PathBuf, bin: PathBuf, gpu_mib: u64, deadline: Duration) -> Result<Host> {
        let bindir = bin.parent().context("the gpusnap binary's directory")?.to_path_buf();
        for lib in ["libgpusnap_fake_cuda.so", "libgpusnap_fake_nvml.so", "fake-workload"] {
            if !bindir.join(lib).exists() {
                bail!(
                    "{} is missing: cargo build -p gpusnap-fake-cuda -p gpusnap-fake-nvml -p gpusnap-fake-workload",
                    bindir.join(lib).display()
                );
            }
        }
        let libdir = root.join("lib");
        std::fs::create_dir_all(&libdir)?;
        for (src, dst) in [
            ("libgpusnap_fake_cuda.so", "libcuda.so.1"),
            ("libgpusnap_fake_nvml.so", "libnvidia-ml.so.1"),
            ("libgpusnap_fake_nvml.so", "libnvidia-ml.so"),
        ] {
            std::os::unix::fs::symlink(bindir.join(src), libdir.join(dst))?;
        }
        let fake = root.join("fake");
        let faultdir = root.join("faults");
        std::fs::create_dir_all(&fake)?;
        std::fs::create_dir_all(&faultdir)?;
        let real = find_criu().context("criu is not on PATH (scripts/install-criu.sh)")?;
        let criu = root.join("criu");
        // `fail-ACTION`: this CRIU action fails before doing anything;
        // `fail-after-ACTION`: it runs and then reports a failure anyway.
        std::fs::write(
            &criu,
            format!(
                "#!/bin/sh\nd={fd:?}\nif [ -e \"$d/fail-$1\" ]; then echo \"Error (soak): injected failure of criu $1\" >&2; exit 1; fi\n\
                 if [ -e \"$d/fail-after-$1\" ]; then {real:?} \"$@\"; echo \"Error (soak): injected failure after criu $1\" >&2; exit 1; fi\n\
                 exec {real:?} \"$@\"\n",
                fd = faultdir.display().to_string(),
                real = real.display().to_string()
            ),
        )?;
        std::fs::set_permissions(&criu, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
        let h = Host {
            root,
            bin,
            bindir,
            libdir,
            fake,
            criu,
            faultdir,
            gpu_mib,
            deadline,
            started: Mutex::new(Vec::new()),
        };
        h.write_fake_config(0, 0)?;
        Ok(h)
    }

    /// The fake world's config; `lag_*`: NVML reporting releases late.
    pub fn write_fake_config(&self, lag_process_ms: u64, lag_memory_ms: u64) -> Result<()> {
        let cfg = serde_json::json!({
            "driver_version": 13000, "driver_string": "580.159.04",
            // GPU 0: the agent's, smaller than its services. GPU 1: the
            // command lane's, another model (the agent never moves a
            // service there), so that the two never race for memory.
            "gpus": [
                {"uuid": "GPU-00000000-0000-0000-0000-000000000000", "name": "NVIDIA H200 (fake)", "total_mib": self.gpu_mib},
                {"uuid": "GPU-00000001-0000-0000-0000-000000000000", "name": "NVIDIA H100 (fake)", "total_mib": 2048},
            ],
            "checkpoint_gbps": 20.0, "restore_gbps": 20.0, "inject": [],
            "nvml_process_lag_ms": lag_process_ms, "nvml_memory_lag_ms": lag_memory_ms,
        });
        let tmp = self.fake.join("config.json.tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(&cfg)?)?;
        std::fs::rename(&tmp, self.fake.join("config.json"))?;
        Ok(())
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }

    pub fn fault_flag(&self, name: &str, on: bool) {
        let p = self.faultdir.join(name);
        if on {
            let _ = std::fs::write(p, "");
        } else {
            let _ = std::fs::remove_file(p);
        }
    }

    /// The environment of every program of the fake world, for `state`.
    pub fn env(&self, cmd: &mut Command, state: &Path) {
        cmd.env("LD_LIBRARY_PATH", &self.libdir)
            .env("GPUSNAP_FAKE_DIR", &self.fake)
            .env("GPUSNAP_STATE_DIR", state)
            .env("GPUSNAP_CRIU", &self.criu)
            .env_remove("GPUSNAP_LOG")
            .stdin(Stdio::null());
    }

    fn remember(&self, fd: Pidfd) {
        self.started.lock().unwrap_or_else(|e| e.into_inner()).push(fd);
    }

    /// A pidfd of `pid`, a process [`Host::spawn`] started (None for any other).
    pub fn pidfd_of(&self, pid: i32) -> Option<Pidfd> {
        let started = self.started.lock().unwrap_or_else(|e| e.into_inner());
        started.iter().rev().find(|f| f.pid() == pid).and_then(Pidfd::try_clone)
    }

    /// Starts a program of the fake world in the background (setsid, as
    /// a service manager does; output to `log`), reaped by a thread of its own.
    pub fn spawn(
        &self,
        prog: &Path,
        args: &[&str],
        state: &Path,
        env: &[(&str, &str)],
        log: &str,
    ) -> Result<i32> {
        let mut cmd = Command::new(prog);
        self.env(&mut cmd, state);
        cmd.args(args).envs(env.iter().copied());
        let f = std::fs::OpenOptions::new().create(true).append(true).open(self.path(log))?;
        cmd.stdout(f.try_clone()?).stderr(f);
        let mut child = spawn_session(&mut cmd).with_context(|| format!("start {}", prog.display()))?;
        let pid = child.id() as i32;
        // Before the reaper can reap it.
        if let Some(fd) = Pidfd::open(pid) {
            self.remember(fd);
        }
        std::thread::spawn(move || child.wait());
        Ok(pid)
    }

    pub fn fake_workload(&self) -> PathBuf {
        self.bindir.join("fake-workload")
    }

    /// Starts a gpusnap command in the background: its pidfd (None where
    /// the kernel has none) and a handle to its outcome (killed when past
    /// the deadline).
    pub fn start_gpusnap(
        &self,
        state: &Path,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Result<(Option<Pidfd>, std::thread::JoinHandle<Outcome>)> {
        let mut cmd = Command::new(&self.bin);
        self.env(&mut cmd, state);
        cmd.arg("--json").args(args).envs(env.iter().copied()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = spawn_session(&mut cmd)?;
        // Before the thread below can reap it.
        let fd = Pidfd::open(child.id() as i32);
        let deadline = self.deadline;
        let h = std::thread::spawn(move || {
            use std::io::Read;
            let mut out = child.stdout.take();
            let mut err = child.stderr.take();
            let o = std::thread::spawn(move || {
                let mut s = String::new();
                if let Some(o) = out.as_mut() {
                    let _ = o.read_to_string(&mut s);
                }
                s
            });
            let e = std::thread::spawn(move || {
                let mut s = String::new();
                if let Some(e) = err.as_mut() {
                    let _ = e.read_to_string(&mut s);
                }
                s
            });
            let end = Instant::now() + deadline;
            let mut killed = false;
            let status = loop {
                if let Ok(Some(st)) = child.try_wait() {
                    break Some(st);
                }
                if Instant::now() > end {
                    killed = true;
                    let _ = child.kill();
                    break child.wait().ok();
                }
                std::thread::sleep(Duration::from_millis(10));
            };
            let code = status.and_then(|s| s.code()).unwrap_or(-1);
            Outcome {
                code,
                stdout: o.join().unwrap_or_default(),
                stderr: e.join().unwrap_or_default(),
                killed,
            }
        });
        Ok((fd, h))
    }

    /// Runs a gpusnap command to its end; one past the deadline is a
    /// violation (and is ended).
    pub fn gpusnap(&self, stats: &Stats, state: &Path, args: &[&str], env: &[(&str, &str)]) -> Outcome {
        stats.with(|c| c.commands += 1);
        let o = match self.start_gpusnap(state, args, env) {
            Ok((_, h)) => h.join().unwrap_or(Outcome {
                code: -1,
                stdout: String::new(),
                stderr: "the runner thread panicked".into(),
                killed: false,
            }),
            Err(e) => Outcome { code: -1, stdout: String::new(), stderr: e.to_string(), killed: false },
        };
        if o.killed {
            stats.violation("command_past_deadline", format!("gpusnap {args:?}: {}", o.stderr.trim()));
        }
        o
    }

    /// Ends every process the soak started, and what they started.
    pub fn end_all(&self, extra: &[i32]) {
        // The agent's services (its records, read now): by pid.
        for &pid in extra {
            if alive(pid) {
                signal(pid, libc::SIGCONT);
                signal(pid, libc::SIGKILL);
            }
        }
        // What the soak started: by pidfd, never a later owner of a pid.
        for fd in self.started.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            fd.signal(libc::SIGCONT);
            fd.signal(libc::SIGKILL);
        }
    }
}

impl Drop for Host {
    /// Whatever happened, ends what the soak started and what the agent
    /// started for it, and unmounts the command lane's tmpfs.
    fn drop(&mut self) {
        let v: Value = std::fs::read(self.path("state").join("agent").join("services.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        let recorded: Vec<i32> = v
            .as_object()
            .into_iter()
            .flat_map(|o| o.values())
            .flat_map(|r| ["runner", "pid"].map(|k| r[k].as_i64().unwrap_or(0) as i32))
            .collect();
        self.end_all(&recorded);
        let lone = self.path("lone");
        if crate::check::mounts_under(&lone).iter().any(|m| std::path::Path::new(m) == lone) {
            crate::infra::umount(&lone);
        }
    }
}
