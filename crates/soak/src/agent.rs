//! The agent under test: `gpusnap agent` with its services (fake model
//! servers that answer with their name), started, killed and restarted,
//! and its API.

use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use crate::host::{alive, free_port, signal, wait_until, Host};

/// One call to the agent's API on `socket`; Err when it did not answer
/// within `limit`.
pub fn api(socket: &Path, method: &str, path: &str, limit: Duration) -> Result<(u16, String)> {
    let mut s = UnixStream::connect(socket).context("connect to the agent")?;
    s.set_read_timeout(Some(limit))?;
    write!(s, "{method} {path} HTTP/1.1\r\nHost: agent\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text).with_context(|| format!("{method} {path}: no answer within {limit:?}"))?;
    let code = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map(|x| x.1).unwrap_or("").to_string();
    Ok((code, body))
}

pub struct Service {
    pub name: String,
    pub listen: u16,
}

pub struct Agent {
    pub state: PathBuf,
    pub socket: PathBuf,
    pub config: PathBuf,
    pub services: Vec<Service>,
    pid: Mutex<i32>,
    pidfd: Mutex<Option<crate::host::Pidfd>>,
    starts: Mutex<u32>,
}

/// Service `i`'s size: a mix, so that evictions free different amounts.
fn service_mib(i: usize) -> u64 {
    [160, 96, 128, 192, 64, 224, 96, 128][i % 8]
}

impl Agent {
    /// Writes the config of `n` services; `hibernating`: how many of them
    /// also hibernate when suspended a while; `park`: two in three park
    /// first (the others are suspended when evicted or idle).
    pub fn configure(host: &Host, n: usize, hibernating: usize, park: bool) -> Result<Agent> {
        let state = host.path("state");
        let socket = host.path("agent.sock");
        let mut text = format!("[agent]\nsocket = {:?}\ntick = \"100ms\"\n", socket.display().to_string());
        let mut services = Vec::new();
        for i in 0..n {
            let name = format!("svc{i}");
            let (listen, backend) = (free_port(), free_port());
            let mib = service_mib(i);
            let hib = if i < hibernating { "hibernate_after = \"4s\"\n" } else { "" };
            let parks = park && i % 3 != 2;
            text += &format!(
                "\n[[service]]\nname = \"{name}\"\nlisten = \"127.0.0.1:{listen}\"\nbackend = \"127.0.0.1:{backend}\"\n\
                 command = [{:?}, \"--mib\", \"{mib}\", \"--gpu\", \"0\", \"--http\", \"{backend}\", \"--tag\", \"{name}\"]\n\
                 park = {parks}\nmin_resident = \"0s\"\nsuspend_after = \"{}ms\"\n{hib}wake_timeout = \"30s\"\ngpu_memory = \"{mib}MiB\"\nmargin = \"32MiB\"\n",
                host.fake_workload().display().to_string(),
                700 + 300 * i
            );
            services.push(Service { name, listen });
        }
        let config = host.path("agent.toml");
        std::fs::write(&config, text)?;
        Ok(Agent {
            state,
            socket,
            config,
            services,
            pid: Mutex::new(0),
            pidfd: Mutex::new(None),
            starts: Mutex::new(0),
        })
    }

    pub fn pid(&self) -> i32 {
        *self.pid.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts the agent and waits (bounded) for its API.
    pub fn start(&self, host: &Host) -> Result<()> {
        let _ = std::fs::remove_file(&self.socket);
        let cfg = self.config.display().to_string();
        let pid = host.spawn(&host.bin, &["agent", "--config", &cfg], &self.state, &[], "agent.log")?;
        *self.pid.lock().unwrap_or_else(|e| e.into_inner()) = pid;
        *self.pidfd.lock().unwrap_or_else(|e| e.into_inner()) = host.pidfd_of(pid);
        *self.starts.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        if !wait_until(Duration::from_secs(90), || UnixStream::connect(&self.socket).is_ok() || !alive(pid)) {
            bail!("the agent's API did not come up within 90 s");
        }
        if !alive(pid) {
            let log = std::fs::read_to_string(host.path("agent.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(5).collect();
            bail!("the agent exited at its start: {:?}", tail);
        }
        Ok(())
    }

    /// kill -9 of the agent (each service runs on, setsid apart from it).
    pub fn kill9(&self) {
        let pid = self.pid();
        // Through its pidfd: an agent that ended on its own left its pid
        // to whoever comes next.
        match self.pidfd.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            Some(fd) => {
                fd.signal(libc::SIGKILL);
            }
            None => {
                signal(pid, libc::SIGKILL);
            }
        }
        // Its main thread a zombie is not enough: until its last thread has
        // exited, its descriptors (the sockets) stay open and answer, and
        // the next agent would take it for one still serving there.
        wait_until(Duration::from_secs(30), || !alive(pid) && UnixStream::connect(&self.socket).is_err());
    }

    /// One API call; Err when the agent did not answer within `limit`.
    pub fn api(&self, method: &str, path: &str, limit: Duration) -> Result<(u16, String)> {
        api(&self.socket, method, path, limit)
    }

    pub fn list(&self) -> Result<Vec<Value>> {
        let (code, body) = self.api("GET", "/v1/services", Duration::from_secs(30))?;
        if code != 200 {
            bail!("GET /v1/services: {code} {body}");
        }
        Ok(serde_json::from_str::<Value>(&body)?.as_array().cloned().unwrap_or_default())
    }

    pub fn service(&self, name: &str) -> Option<Value> {
        self.list().ok()?.into_iter().find(|s| s["name"] == name)
    }

    /// The service's current pid (0 when none).
    pub fn service_pid(&self, name: &str) -> i32 {
        self.service(name).and_then(|s| s["pid"].as_i64()).unwrap_or(0) as i32
    }

    /// Every pid the agent last recorded (services and their runners), for
    /// the teardown.
    pub fn recorded_pids(&self) -> Vec<i32> {
        let path = self.state.join("agent").join("services.json");
        let v: Value =
            std::fs::read(&path).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
        v.as_object()
            .into_iter()
            .flat_map(|o| o.values())
            .flat_map(|r| ["runner", "pid"].map(|k| r[k].as_i64().unwrap_or(0) as i32))
            .filter(|&p| p > 0)
            .collect()
    }

    /// The swaps the agent traced (its metrics), since its last start.
    pub fn swaps(&self) -> u64 {
        let Ok((200, text)) = self.api("GET", "/metrics", Duration::from_secs(30)) else { return 0 };
        text.lines()
            .filter(|l| l.starts_with("gpusnap_agent_swap_seconds_count"))
            .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    }
}
