//! The invariants, checked after every fault and at the end: every service
//! running, parked (its context kept, never locked), suspended and
//! resumable, or hibernated with a valid signed
//! image, and answering right; nothing of a killed gpusnap left unfinished
//! in the journal; no temporary files or mounts left.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::agent::Agent;
use crate::clients::ask;
use crate::host::{alive, Host};
use crate::settle::{Settle, SETTLED};
use crate::stats::Stats;

/// Waits (bounded) until every service has been seen settled, each at a
/// poll of its own (see [`crate::settle`]); false after a violation.
fn settle(agent: &Agent, stats: &Stats, limit: Duration, context: &str) -> bool {
    let end = Instant::now() + limit;
    let mut seen = Settle::default();
    loop {
        match agent.list() {
            Ok(l) => {
                seen.observe(&l);
                if seen.done() {
                    return true;
                }
            }
            Err(e) => {
                if Instant::now() >= end {
                    stats.violation("agent_unanswering", format!("after {context}: {e:#}"));
                    return false;
                }
            }
        }
        if Instant::now() >= end {
            let held = seen.held().join(" ");
            stats.violation("not_settled", format!("after {context}, within {limit:?}: {held}"));
            return false;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Every service settles, and each settled service's process and image
/// agree with its state. A service that is moving (the clients run) is
/// looked at next time.
pub fn services(host: &Host, agent: &Agent, stats: &Stats, context: &str) {
    if !settle(agent, stats, Duration::from_secs(150), context) {
        return;
    }
    for svc in &agent.services {
        let name = svc.name.clone();
        let Some(s) = agent.service(&name).filter(|s| SETTLED.iter().any(|st| s["state"] == *st)) else {
            continue;
        };
        let pid = s["pid"].as_i64().unwrap_or(0) as i32;
        let state = s["state"].as_str().unwrap_or("").to_string();
        let problem = match state.as_str() {
            "running" | "suspended" => {
                if !alive(pid) {
                    Some(format!("{state} but its process {pid} is gone"))
                } else {
                    let r = host.gpusnap(stats, &agent.state, &["state", &pid.to_string()], &[]);
                    let driver = r.json()["state"].as_str().unwrap_or("").to_string();
                    let want = if state == "running" { "running" } else { "checkpointed" };
                    (driver != want)
                        .then(|| format!("{state} but the driver says {driver:?} ({})", r.stderr.trim()))
                }
            }
            "parked" => {
                if !alive(pid) {
                    Some(format!("parked but its process {pid} is gone"))
                } else {
                    // Its memory in host memory, its context on the GPU:
                    // never locked by the driver.
                    let r = host.gpusnap(stats, &agent.state, &["state", &pid.to_string()], &[]);
                    let driver = r.json()["state"].as_str().unwrap_or("").to_string();
                    (driver != "parked")
                        .then(|| format!("parked but gpusnap says {driver:?} ({})", r.stderr.trim()))
                }
            }
            _ => {
                let image = s["image"].as_str().unwrap_or("").to_string();
                if image.is_empty() {
                    Some("hibernated without an image".to_string())
                } else {
                    let r = host.gpusnap(stats, &agent.state, &["images", "verify", &image], &[]);
                    (r.code != 0).then(|| format!("its image {image} does not verify: {}", r.stderr.trim()))
                }
            }
        };
        if let Some(p) = problem {
            // Still the same, never left since? (It may have moved since it
            // was listed: its time in the state would have gone back.)
            let now = agent.service(&name).unwrap_or_default();
            let stayed = now["in_state_ms"].as_u64().unwrap_or(0) >= s["in_state_ms"].as_u64().unwrap_or(0);
            if now["state"] == state && now["pid"].as_i64().unwrap_or(0) as i32 == pid && stayed {
                stats.violation("inconsistent_service", format!("after {context}: {name}: {p}"));
            }
        }
    }
}

/// Every service answers right, within a few tries (a refusal may be
/// right once, while a tenant holds the GPU; never every time).
pub fn answers(agent: &Agent, stats: &Stats, context: &str) {
    for s in &agent.services {
        let ok = (0..4).any(|i| {
            if i > 0 {
                std::thread::sleep(Duration::from_secs(2));
            }
            ask(stats, s.listen, &s.name)
        });
        if !ok {
            let st = agent.service(&s.name).unwrap_or_default();
            stats
                .violation("service_lost", format!("after {context}: {} never answered right: {st}", s.name));
        }
    }
}

/// Names under `dir` that a finished command must not leave: temporary
/// images and files.
pub fn temporaries(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.contains(".tmp") || name.starts_with(".tmp") || name.ends_with(".part") {
                out.push(e.path().display().to_string());
            }
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(e.path());
            }
        }
    }
    out
}

/// Mount points under `dir`.
pub fn mounts_under(dir: &Path) -> Vec<String> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let d = dir.display().to_string();
    text.lines()
        .filter_map(|l| l.split_whitespace().nth(4))
        .filter(|m| m.starts_with(&d))
        .map(str::to_string)
        .collect()
}

/// The end: with the agent stopped, the journal of each state directory
/// reconciles (`images gc`, then `doctor` finds nothing interrupted) and
/// nothing temporary is left.
pub fn at_rest(host: &Host, stats: &Stats, state: &Path) {
    let gc = host.gpusnap(stats, state, &["images", "gc"], &[]);
    if gc.code != 0 {
        stats.violation("not_reconcilable", format!("{}: images gc: {}", state.display(), gc.stderr.trim()));
    }
    let doc = host.gpusnap(stats, state, &["doctor"], &[]);
    for what in ["interrupted-hibernate", "stale-image"] {
        if doc.stdout.contains(what) {
            stats.violation("not_reconcilable", format!("{}: doctor still finds {what}", state.display()));
        }
    }
    let t = temporaries(state);
    if !t.is_empty() {
        stats.violation("temporary_left", format!("{t:?}"));
    }
}
