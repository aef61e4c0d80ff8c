//! The command lane: one fake CUDA program outside the agent, driven by
//! `gpusnap` commands (suspend, resume, hibernate, wake, push, pull) in a
//! state directory of its own, with the commands killed, CRIU, the page
//! server, the S3 server, the chunk store or the disk failing under them.
//! After each fault the lane reconciles (`images gc`) and brings the
//! program back; a program that cannot be brought back is lost.

use anyhow::{Context, Result};
use rand::rngs::StdRng;
use rand::Rng;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::host::{alive, signal, wait_until, Host};
use crate::infra::Moto;
use crate::stats::Stats;

pub struct Lone<'a> {
    pub host: &'a Host,
    pub stats: Arc<Stats>,
    pub state: PathBuf,
    pub pid: i32,
    status: PathBuf,
    /// Images taken of it, oldest first.
    images: Vec<String>,
    n: u32,
    pub moto: Option<Moto>,
    /// The tmpfs the state directory is on (root only), for the full disk.
    pub tmpfs: Option<PathBuf>,
    key: String,
}

/// (pid, iteration, intact) of a fake program's status file.
pub(crate) fn status(path: &std::path::Path) -> Option<(i32, u64, bool)> {
    let s = std::fs::read_to_string(path).ok()?;
    let f: Vec<&str> = s.split_whitespace().collect();
    Some((f.first()?.parse().ok()?, f.get(1)?.parse().ok()?, *f.get(2)? == "1"))
}

impl<'a> Lone<'a> {
    pub fn new(host: &'a Host, stats: Arc<Stats>, moto: Option<Moto>) -> Result<Lone<'a>> {
        let state = host.path("lone");
        std::fs::create_dir_all(&state)?;
        let tmpfs = crate::infra::mount_tmpfs(&state, 256).then(|| state.clone());
        let mut l = Lone {
            host,
            stats,
            state,
            pid: 0,
            status: host.path("lone.status"),
            images: Vec::new(),
            n: 0,
            moto,
            tmpfs,
            key: String::new(),
        };
        l.start_program()?;
        let k = l.run(&["images", "key"], &[]);
        l.key = k.json()["key"].as_str().unwrap_or("").to_string();
        Ok(l)
    }

    fn start_program(&mut self) -> Result<()> {
        let _ = std::fs::remove_file(&self.status);
        let st = self.status.display().to_string();
        self.pid = self.host.spawn(
            &self.host.fake_workload(),
            &["--mib", "48", "--gpu", "1", "--status", &st],
            &self.state,
            &[],
            "lone.log",
        )?;
        if !wait_until(Duration::from_secs(60), || status(&self.status).is_some_and(|s| s.1 >= 1)) {
            anyhow::bail!("the lane's program did not start");
        }
        Ok(())
    }

    fn run(&self, args: &[&str], env: &[(&str, &str)]) -> crate::host::Outcome {
        self.host.gpusnap(&self.stats, &self.state, args, env)
    }

    fn next_image(&mut self) -> String {
        self.n += 1;
        format!("lone-{}", self.n)
    }

    /// Runs `args` in the background and kill -9s it after `delay` (if it
    /// still runs then).
    fn killed(&self, args: &[&str], env: &[(&str, &str)], delay: Duration) -> Result<crate::host::Outcome> {
        self.stats.with(|c| c.commands += 1);
        let (fd, h) = self.host.start_gpusnap(&self.state, args, env)?;
        std::thread::sleep(delay);
        // Through its pidfd: it may have ended, and its pid be another's.
        if let Some(fd) = fd {
            fd.signal(libc::SIGKILL);
        }
        let o = h.join().map_err(|_| anyhow::anyhow!("runner panicked"))?;
        if o.killed {
            self.stats.violation("command_past_deadline", format!("gpusnap {args:?}"));
        }
        Ok(o)
    }

    /// Hibernates the program (for the faults that need an image); its image.
    fn hibernate(&mut self) -> Option<String> {
        let img = self.next_image();
        let p = self.pid.to_string();
        let r = self.run(&["hibernate", &p, "--image", &img], &[]);
        if r.code != 0 {
            self.stats.violation("setup_failed", format!("hibernate: {}", r.stderr.trim()));
            return None;
        }
        self.images.push(img.clone());
        wait_until(Duration::from_secs(20), || !alive(self.pid));
        Some(img)
    }

    fn s3_url(&self) -> String {
        "s3://soak/lone".to_string()
    }

    fn s3_env(&self) -> Vec<(String, String)> {
        self.moto.as_ref().map(|m| m.env()).unwrap_or_default()
    }

    /// Injects one fault of `kind`, then reconciles and brings the program
    /// back, whatever the fault did; false when the kind is not a lane one.
    pub fn inject(&mut self, kind: &str, rng: &mut StdRng) -> Result<bool> {
        const KINDS: &[&str] = &[
            "kill-suspend",
            "kill-resume",
            "kill-hibernate",
            "kill-wake",
            "kill-push",
            "kill-pull",
            "s3-stop-push",
            "s3-stop-pull",
            "pages-fail",
            "corrupt-chunk",
            "full-fs",
        ];
        if !KINDS.contains(&kind) {
            return Ok(false);
        }
        let r = self.fault(kind, rng);
        self.recover(kind)?;
        r.map(|()| true)
    }

    fn fault(&mut self, kind: &str, rng: &mut StdRng) -> Result<()> {
        let delay = Duration::from_millis(rng.gen_range(0..1200));
        let p = self.pid.to_string();
        let s3: Vec<(String, String)> = self.s3_env();
        let s3: Vec<(&str, &str)> = s3.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        match kind {
            "kill-suspend" => {
                self.killed(&["suspend", &p], &[], delay)?;
            }
            "kill-resume" => {
                self.run(&["suspend", &p], &[]);
                self.killed(&["resume", &p, "--wait", "20"], &[], delay)?;
            }
            "kill-hibernate" => {
                let img = self.next_image();
                self.images.push(img.clone());
                self.killed(&["hibernate", &p, "--image", &img], &[], delay)?;
            }
            "kill-wake" => {
                let Some(img) = self.hibernate() else { return Ok(()) };
                self.killed(&["wake", &img, "--wait", "20"], &[], delay)?;
            }
            "kill-push" | "kill-pull" | "s3-stop-push" | "s3-stop-pull" => {
                if self.moto.is_none() {
                    self.stats.skip(kind, "moto_server is not installed");
                    return Ok(());
                }
                let img = self.next_image();
                let r = self.run(&["snapshot", &p, "--image", &img], &[]);
                if r.code != 0 {
                    self.stats.violation("setup_failed", format!("snapshot: {}", r.stderr.trim()));
                    return Ok(());
                }
                self.images.push(img.clone());
                let url = format!("{}/{img}", self.s3_url());
                let pulled = format!("pulled-{img}");
                let base = self.s3_url();
                let push = ["images", "push", img.as_str(), base.as_str()];
                let pull =
                    ["--trust", self.key.as_str(), "images", "pull", url.as_str(), "--as", pulled.as_str()];
                if kind.ends_with("pull") {
                    let r = self.run(&push, &s3);
                    if r.code != 0 {
                        self.stats.violation("setup_failed", format!("push: {}", r.stderr.trim()));
                    }
                }
                let args: &[&str] = if kind.ends_with("push") { &push } else { &pull };
                if kind.starts_with("kill") {
                    self.killed(args, &s3, delay)?;
                } else {
                    self.stats.with(|c| c.commands += 1);
                    let (_, h) = self.host.start_gpusnap(&self.state, args, &s3)?;
                    std::thread::sleep(delay);
                    if let Some(m) = self.moto.as_mut() {
                        m.kill();
                    }
                    let o = h.join().map_err(|_| anyhow::anyhow!("runner panicked"))?;
                    if o.killed {
                        self.stats
                            .violation("command_past_deadline", format!("gpusnap {args:?} with S3 down"));
                    }
                    if o.code != 0 && !matches!(o.code, 1 | 6) {
                        self.stats.violation(
                            "unclear_error",
                            format!("{args:?}: exit {} {}", o.code, o.stderr.trim()),
                        );
                    }
                    if let Some(m) = self.moto.as_mut() {
                        m.restart()?;
                    }
                }
                // A pulled image is there whole (it verifies) or not at all;
                // a push, retried, completes.
                let v = self.run(&["--trust", &self.key.clone(), "images", "verify", &pulled], &[]);
                if v.code == 0 || self.state.join("images").join(&pulled).exists() {
                    if v.code != 0 {
                        self.stats
                            .violation("bad_image", format!("{pulled} does not verify: {}", v.stderr.trim()));
                    }
                    self.run(&["images", "rm", &pulled], &[]);
                }
                let r = self.run(&push, &s3);
                if r.code != 0 {
                    self.stats.violation("not_reconcilable", format!("push again: {}", r.stderr.trim()));
                }
            }
            "pages-fail" => {
                let Some(img) = self.hibernate() else { return Ok(()) };
                let after = rng.gen_range(4096..4 << 20).to_string();
                let r = self.run(&["wake", &img, "--wait", "20"], &[("GPUSNAP_PAGES_FAIL_AFTER", &after)]);
                if r.code != 0 && r.error_kind() != "pages" {
                    self.stats
                        .violation("unclear_error", format!("wake, pages failing: {}", r.stderr.trim()));
                }
            }
            "corrupt-chunk" => {
                let Some(img) = self.hibernate() else { return Ok(()) };
                let Some((path, good)) = self.corrupt(&img, rng) else {
                    self.stats.skip(kind, "no chunk of its own in the image");
                    return Ok(());
                };
                let r = self.run(&["wake", &img, "--wait", "20"], &[]);
                if r.code == 0 {
                    self.stats.violation("corrupt_accepted", format!("{img} woke from a damaged chunk"));
                }
                std::fs::write(&path, good)?;
            }
            "full-fs" => {
                let Some(mnt) = self.tmpfs.clone() else {
                    self.stats.skip(kind, "needs root to mount a small tmpfs");
                    return Ok(());
                };
                let filler = mnt.join("filler");
                crate::infra::fill(&mnt, &filler, rng.gen_range(0..24 << 20));
                let img = self.next_image();
                self.images.push(img.clone());
                let r = self.run(&["hibernate", &p, "--image", &img], &[]);
                let _ = std::fs::remove_file(&filler);
                if r.code != 0 && r.code != 1 {
                    self.stats.violation(
                        "unclear_error",
                        format!("hibernate on a full disk: exit {} {}", r.code, r.stderr.trim()),
                    );
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Flips a byte in a chunk only `img` refers to; the chunk's path and
    /// its good bytes.
    fn corrupt(&self, img: &str, rng: &mut StdRng) -> Option<(PathBuf, Vec<u8>)> {
        let chunks = |name: &str| -> Vec<String> {
            let m: serde_json::Value =
                std::fs::read(self.state.join("images").join(name).join("manifest.json"))
                    .ok()
                    .and_then(|b| serde_json::from_slice(&b).ok())
                    .unwrap_or_default();
            m["files"]
                .as_array()
                .into_iter()
                .flatten()
                // The pages' chunks are in the store; small files may not be.
                .filter(|f| f["path"].as_str().is_some_and(|p| p.contains("/pages-")))
                .flat_map(|f| f["chunks"].as_array().cloned().unwrap_or_default())
                .filter_map(|c| c["blake3"].as_str().map(str::to_string))
                .collect()
        };
        let others: std::collections::HashSet<String> =
            self.images.iter().filter(|i| *i != img).flat_map(|i| chunks(i)).collect();
        let mine: Vec<String> = chunks(img).into_iter().filter(|c| !others.contains(c)).collect();
        if mine.is_empty() {
            return None;
        }
        let h = &mine[rng.gen_range(0..mine.len())];
        let path = self.state.join("store/chunks").join(&h[..2]).join(h);
        let good = std::fs::read(&path).ok()?;
        let mut bad = good.clone();
        let at = rng.gen_range(0..bad.len().max(1));
        if let Some(b) = bad.get_mut(at) {
            *b ^= 0x5a;
        }
        std::fs::write(&path, bad).ok()?;
        Some((path, good))
    }

    /// Reconciles and brings the program back running with its memory
    /// intact; what cannot be is a violation.
    pub fn recover(&mut self, kind: &str) -> Result<()> {
        let gc = self.run(&["images", "gc"], &[]);
        if gc.code != 0 {
            self.stats
                .violation("not_reconcilable", format!("after {kind}: images gc: {}", gc.stderr.trim()));
        }
        let p = self.pid.to_string();
        if alive(self.pid) {
            let st = self.run(&["state", &p], &[]).json()["state"].as_str().unwrap_or("").to_string();
            match st.as_str() {
                "running" => {}
                "checkpointed" | "locked" => {
                    let r = self.run(&["resume", &p, "--wait", "30"], &[]);
                    if r.code != 0 {
                        self.stats.violation(
                            "stranded",
                            format!("after {kind}: {st}, resume: {}", r.stderr.trim()),
                        );
                    }
                }
                other => self.stats.violation("stranded", format!("after {kind}: the program is {other:?}")),
            }
        } else {
            // Gone: its newest image that verifies brings it back.
            let mut woke = false;
            for img in self.images.clone().iter().rev() {
                if !self.state.join("images").join(img).join("manifest.json").exists() {
                    continue;
                }
                if self.run(&["images", "verify", img], &[]).code != 0 {
                    self.stats.violation("bad_image", format!("after {kind}: {img} does not verify"));
                    continue;
                }
                let r = self.run(&["wake", img, "--wait", "30"], &[]);
                if r.code == 0 {
                    woke = true;
                    break;
                }
                self.stats.violation("wake_failed", format!("after {kind}: wake {img}: {}", r.stderr.trim()));
            }
            if !woke {
                self.stats.violation(
                    "lost",
                    format!("after {kind}: the program is gone and no image brings it back"),
                );
                self.start_program().context("start the lane's program again")?;
                return Ok(());
            }
        }
        // Running again, its GPU memory intact.
        let before = status(&self.status).map(|s| s.1).unwrap_or(0);
        let ok = wait_until(Duration::from_secs(30), || {
            status(&self.status).is_some_and(|s| s.0 == self.pid && s.1 >= before + 2)
        });
        match status(&self.status) {
            Some((_, _, false)) => {
                self.stats.violation("corrupt_memory", format!("after {kind}: the program's memory changed"))
            }
            _ if !ok => {
                let st = self.run(&["state", &p], &[]);
                let proc_state = std::fs::read_to_string(format!("/proc/{}/status", self.pid))
                    .unwrap_or_default()
                    .lines()
                    .find(|l| l.starts_with("State:"))
                    .unwrap_or("")
                    .to_string();
                self.stats.violation(
                    "stranded",
                    format!(
                        "after {kind}: the program does not progress ({proc_state}; state: {})",
                        st.stdout.trim()
                    ),
                )
            }
            _ => {}
        }
        // No image is kept: the disk is small.
        for img in std::mem::take(&mut self.images) {
            self.run(&["images", "rm", &img], &[]);
        }
        Ok(())
    }

    /// Ends the program; unmounts the tmpfs.
    pub fn finish(&mut self) {
        signal(self.pid, libc::SIGKILL);
        wait_until(Duration::from_secs(10), || !alive(self.pid));
        if let Some(m) = self.moto.as_mut() {
            m.kill();
        }
        if let Some(t) = self.tmpfs.take() {
            crate::infra::umount(&t);
        }
    }
}
