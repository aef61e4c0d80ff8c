//! Faults injected into the agent and its services while the clients run.

use anyhow::Result;
use rand::rngs::StdRng;
use rand::Rng;
use std::sync::Arc;
use std::time::Duration;

use crate::agent::Agent;
use crate::clients::ask;
use crate::host::{alive, signal, Host};
use crate::stats::Stats;

pub struct Lane<'a> {
    pub host: &'a Host,
    pub agent: &'a Agent,
    pub stats: Arc<Stats>,
    /// Swaps traced by agents killed since.
    pub swaps_before: u64,
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

impl Lane<'_> {
    /// A service in one of `states` (at random), else any.
    fn pick(&self, rng: &mut StdRng, states: &[&str]) -> (String, u16) {
        let list = self.agent.list().unwrap_or_default();
        let fit: Vec<String> = list
            .iter()
            .filter(|s| states.iter().any(|st| s["state"] == *st))
            .filter_map(|s| s["name"].as_str().map(str::to_string))
            .collect();
        let name = if fit.is_empty() {
            self.agent.services[rng.gen_range(0..self.agent.services.len())].name.clone()
        } else {
            fit[rng.gen_range(0..fit.len())].clone()
        };
        let port = self.agent.services.iter().find(|s| s.name == name).map(|s| s.listen).unwrap_or(0);
        (name, port)
    }

    /// A request to `name` in the background (counted and checked).
    fn ask_later(&self, name: &str, port: u16) -> std::thread::JoinHandle<()> {
        let (stats, name) = (Arc::clone(&self.stats), name.to_string());
        std::thread::spawn(move || {
            ask(&stats, port, &name);
        })
    }

    /// An API call in the background; one unanswered within `limit` while
    /// the agent lives is a violation.
    fn api_later(&self, path: &str, limit: Duration) -> std::thread::JoinHandle<Option<u16>> {
        let (socket, stats, path) = (self.agent.socket.clone(), Arc::clone(&self.stats), path.to_string());
        std::thread::spawn(move || match crate::agent::api(&socket, "POST", &path, limit) {
            Ok((code, _)) => Some(code),
            Err(e) => {
                let text = format!("{e:#}");
                if text.contains("no answer within") && !text.contains("reset") {
                    stats.violation("api_past_deadline", format!("POST {path}: {text}"));
                }
                None
            }
        })
    }

    fn restart_agent(&mut self, rng: &mut StdRng) -> Result<()> {
        self.swaps_before += self.agent.swaps();
        self.agent.kill9();
        std::thread::sleep(ms(rng.gen_range(0..500)));
        self.agent.start(self.host)
    }

    /// A hibernated service, hibernating one when none is (None: none could be).
    fn hibernated(&self, rng: &mut StdRng) -> Option<(String, u16)> {
        let (name, port) = self.pick(rng, &["hibernated"]);
        if self.agent.service(&name).is_some_and(|s| s["state"] == "hibernated") {
            return Some((name, port));
        }
        let (name, port) = self.pick(rng, &["suspended"]);
        let r = self.agent.api("POST", &format!("/v1/services/{name}/hibernate"), Duration::from_secs(120));
        matches!(r, Ok((200, _))).then_some((name, port))
    }

    /// A parked service, parking one when none is (None: none could be).
    fn parked(&self, rng: &mut StdRng) -> Option<(String, u16)> {
        let (name, port) = self.pick(rng, &["parked"]);
        if self.agent.service(&name).is_some_and(|s| s["state"] == "parked") {
            return Some((name, port));
        }
        let (name, port) = self.pick(rng, &["running"]);
        let r = self.agent.api("POST", &format!("/v1/services/{name}/park"), Duration::from_secs(120));
        matches!(r, Ok((200, _))).then_some((name, port))
    }

    /// Injects one fault of `kind`; false when the kind is not an agent one.
    pub fn inject(&mut self, kind: &str, rng: &mut StdRng) -> Result<bool> {
        let stats = Arc::clone(&self.stats);
        match kind {
            "agent-kill-swap" => {
                let (name, port) = self.pick(rng, &["suspended", "parked", "hibernated"]);
                let t = self.ask_later(&name, port);
                std::thread::sleep(ms(rng.gen_range(0..1500)));
                self.restart_agent(rng)?;
                let _ = t.join();
            }
            "agent-kill-park" => {
                // Killed while parking: the library finishes on its own and
                // the next agent finds it parked, or running if it had not
                // begun.
                let (name, _) = self.pick(rng, &["running"]);
                let t = self.api_later(&format!("/v1/services/{name}/park"), Duration::from_secs(120));
                std::thread::sleep(ms(rng.gen_range(0..800)));
                self.restart_agent(rng)?;
                let _ = t.join();
            }
            "agent-kill-unpark" => {
                let Some((name, port)) = self.parked(rng) else {
                    stats.skip(kind, "no service could be parked this cycle");
                    return Ok(true);
                };
                let t = self.ask_later(&name, port);
                std::thread::sleep(ms(rng.gen_range(0..800)));
                self.restart_agent(rng)?;
                let _ = t.join();
            }
            "agent-kill-hibernate" => {
                let (name, _) = self.pick(rng, &["suspended", "running"]);
                let t = self.api_later(&format!("/v1/services/{name}/hibernate"), Duration::from_secs(120));
                std::thread::sleep(ms(rng.gen_range(0..2500)));
                self.restart_agent(rng)?;
                let _ = t.join();
            }
            "agent-kill-wake" => {
                let Some((name, port)) = self.hibernated(rng) else {
                    stats.skip(kind, "no service could be hibernated this cycle");
                    return Ok(true);
                };
                let t = self.ask_later(&name, port);
                std::thread::sleep(ms(rng.gen_range(0..2500)));
                self.restart_agent(rng)?;
                let _ = t.join();
            }
            "tenant" => {
                let (name, port) = self.pick(rng, &["suspended", "parked", "hibernated"]);
                let t = self.ask_later(&name, port);
                std::thread::sleep(ms(rng.gen_range(0..300)));
                let mib = rng.gen_range(self.host.gpu_mib / 4..self.host.gpu_mib * 3 / 4).to_string();
                let pid = self.host.spawn(
                    &self.host.fake_workload(),
                    &["--mib", &mib, "--gpu", "0"],
                    &self.agent.state,
                    &[],
                    "tenant.log",
                )?;
                std::thread::sleep(ms(rng.gen_range(500..5000)));
                // It may have ended at once (no room) and its pid be
                // another's by now: through its pidfd.
                if let Some(fd) = self.host.pidfd_of(pid) {
                    fd.signal(libc::SIGKILL);
                }
                let _ = t.join();
            }
            "nvml-late" => {
                self.host.write_fake_config(rng.gen_range(10..200), rng.gen_range(100..1500))?;
                std::thread::sleep(ms(rng.gen_range(1000..4000)));
                let (name, port) = self.pick(rng, &["suspended"]);
                let _ = self.ask_later(&name, port).join();
                self.host.write_fake_config(0, 0)?;
            }
            "crash-guarded" | "crash-unguarded" => {
                let (name, port) = self.pick(rng, &["running", "parked", "suspended"]);
                let pid = self.agent.service_pid(&name);
                // SIGSEGV: the guard suspends it before it dies; SIGKILL:
                // nothing sees it coming.
                let sig = if kind == "crash-guarded" { libc::SIGSEGV } else { libc::SIGKILL };
                if alive(pid) {
                    signal(pid, sig);
                }
                std::thread::sleep(ms(rng.gen_range(0..1500)));
                let _ = self.ask_later(&name, port).join();
            }
            "criu-dump-fail" => {
                let after = rng.gen_bool(0.5);
                let flag = if after { "fail-after-dump" } else { "fail-dump" };
                self.host.fault_flag(flag, true);
                let (name, _) = self.pick(rng, &["suspended", "running"]);
                let r = self.agent.api(
                    "POST",
                    &format!("/v1/services/{name}/hibernate"),
                    Duration::from_secs(120),
                );
                self.host.fault_flag(flag, false);
                if let Ok((200, body)) = &r {
                    stats.violation(
                        "criu_failure_ignored",
                        format!("{name}: hibernated although CRIU's dump failed ({flag}): {body}"),
                    );
                }
            }
            "criu-restore-fail" => {
                let Some((name, port)) = self.hibernated(rng) else {
                    stats.skip(kind, "no service could be hibernated this cycle");
                    return Ok(true);
                };
                let flag = if rng.gen_bool(0.5) { "fail-after-restore" } else { "fail-restore" };
                self.host.fault_flag(flag, true);
                let _ = self.ask_later(&name, port).join();
                self.host.fault_flag(flag, false);
            }
            "sigstop" | "freeze" => {
                let (name, _) = self.pick(rng, &["running", "suspended"]);
                let pid = self.agent.service_pid(&name);
                if !alive(pid) {
                    return Ok(true);
                }
                let frozen = if kind == "freeze" {
                    match crate::freezer::Freezer::freeze(pid) {
                        Ok(f) => Some(f),
                        Err(e) => {
                            stats.skip(kind, &format!("{e:#}"));
                            return Ok(true);
                        }
                    }
                } else {
                    signal(pid, libc::SIGSTOP);
                    None
                };
                let t = self.api_later(&format!("/v1/services/{name}/suspend"), Duration::from_secs(90));
                // And a request: a suspended service must not be said to be
                // back while its process cannot be resumed.
                let port = self.agent.services.iter().find(|s| s.name == name).map(|s| s.listen).unwrap_or(0);
                let r = self.ask_later(&name, port);
                std::thread::sleep(ms(rng.gen_range(500..3000)));
                match frozen {
                    Some(f) => f.thaw(),
                    None => {
                        signal(pid, libc::SIGCONT);
                    }
                }
                let _ = t.join();
                let _ = r.join();
            }
            _ => return Ok(false),
        }
        Ok(true)
    }
}
