//! The park lane: one fast-swap program outside the agent (`gpusnap run
//! --light --fast-swap`), parked and unparked by `gpusnap park` and
//! `gpusnap resume`, with the command killed at a random moment of either
//! phase. After each fault the lane brings the program back resident and
//! checks that it progresses with its memory intact; the driver is never
//! asked to lock it.

use anyhow::{bail, Result};
use rand::rngs::StdRng;
use rand::Rng;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::host::{alive, signal, wait_until, Host};
use crate::lone::status;
use crate::stats::Stats;

pub const KINDS: &[&str] = &["kill-park", "kill-unpark"];

pub struct Parked<'a> {
    host: &'a Host,
    stats: Arc<Stats>,
    pub state: PathBuf,
    /// The program (not its `gpusnap run`).
    pub pid: i32,
    status: PathBuf,
}

impl<'a> Parked<'a> {
    pub fn new(host: &'a Host, stats: Arc<Stats>) -> Result<Parked<'a>> {
        let state = host.path("parked");
        std::fs::create_dir_all(&state)?;
        let mut p = Parked { host, stats, state, pid: 0, status: host.path("parked.status") };
        p.start_program()?;
        Ok(p)
    }

    fn start_program(&mut self) -> Result<()> {
        let _ = std::fs::remove_file(&self.status);
        let (wl, st) = (self.host.fake_workload().display().to_string(), self.status.display().to_string());
        let args = ["run", "--light", "--fast-swap", "--", &wl, "--mib", "96", "--extra-allocs", "2"];
        let args: Vec<&str> = args.into_iter().chain(["--gpu", "1", "--status", &st]).collect();
        let bin = self.host.bin.clone();
        self.host.spawn(&bin, &args, &self.state, &[("GPUSNAP_FAST_SWAP_VERIFY", "1")], "parked.log")?;
        if !wait_until(Duration::from_secs(60), || status(&self.status).is_some_and(|s| s.1 >= 1)) {
            bail!("the park lane's program did not start");
        }
        self.pid = status(&self.status).map(|s| s.0).unwrap_or(0);
        Ok(())
    }

    fn run(&self, args: &[&str]) -> crate::host::Outcome {
        self.host.gpusnap(&self.stats, &self.state, args, &[])
    }

    fn driver_state(&self) -> String {
        let r = self.run(&["state", &self.pid.to_string()]);
        r.json()["state"].as_str().unwrap_or("").to_string()
    }

    /// Runs `args` in the background and kill -9s it after `delay`.
    fn killed(&self, args: &[&str], delay: Duration) -> Result<()> {
        self.stats.with(|c| c.commands += 1);
        let (fd, h) = self.host.start_gpusnap(&self.state, args, &[])?;
        std::thread::sleep(delay);
        // Through its pidfd: it may have ended, and its pid be another's.
        if let Some(fd) = fd {
            fd.signal(libc::SIGKILL);
        }
        let o = h.join().map_err(|_| anyhow::anyhow!("runner panicked"))?;
        if o.killed {
            self.stats.violation("command_past_deadline", format!("gpusnap {args:?}"));
        }
        Ok(())
    }

    /// Injects one fault of `kind`, then brings the program back resident;
    /// false when the kind is not a park one.
    pub fn inject(&mut self, kind: &str, rng: &mut StdRng) -> Result<bool> {
        if !KINDS.contains(&kind) {
            return Ok(false);
        }
        let delay = Duration::from_millis(rng.gen_range(0..600));
        let p = self.pid.to_string();
        if kind == "kill-park" {
            self.killed(&["park", &p], delay)?;
        } else {
            let r = self.run(&["park", &p]);
            if r.code != 0 {
                self.stats.violation("park_failed", format!("park: {}", r.stderr.trim()));
            }
            self.killed(&["resume", &p], delay)?;
        }
        self.recover(kind)?;
        Ok(true)
    }

    /// Parked, parking, unparking or running: a resume brings it back, its
    /// memory intact, with no lock of the driver's along the way.
    fn recover(&mut self, kind: &str) -> Result<()> {
        if !alive(self.pid) {
            self.stats.violation("lost", format!("after {kind}: the parked program died"));
            return self.start_program();
        }
        let st = self.driver_state();
        match st.as_str() {
            "running" => {}
            "parked" | "parking" | "unparking" => {
                let r = self.run(&["resume", &self.pid.to_string()]);
                if r.code != 0 {
                    self.stats
                        .violation("stranded", format!("after {kind}: {st}, resume: {}", r.stderr.trim()));
                }
            }
            other => self.stats.violation("stranded", format!("after {kind}: the program is {other:?}")),
        }
        let after = self.driver_state();
        if after != "running" {
            self.stats.violation("stranded", format!("after {kind}: still {after:?} after a resume"));
        }
        let before = status(&self.status).map(|s| s.1).unwrap_or(0);
        let ok =
            wait_until(Duration::from_secs(30), || status(&self.status).is_some_and(|s| s.1 >= before + 2));
        match status(&self.status) {
            Some((_, _, false)) => self
                .stats
                .violation("corrupt_memory", format!("after {kind}: the parked program's memory changed")),
            _ if !ok => {
                self.stats.violation("stranded", format!("after {kind}: the program does not progress"))
            }
            _ => {}
        }
        Ok(())
    }

    /// Ends the program (resident, so nothing is left with the driver).
    pub fn finish(&self) {
        signal(self.pid, libc::SIGKILL);
        wait_until(Duration::from_secs(10), || !alive(self.pid));
    }
}
