//! The invariants, checked after every fault and at the end: every service
//! running, suspended and resumable, or hibernated with a valid signed
//! image, and answering right; nothing of a killed gpusnap left unfinished
//! in the journal; no temporary files or mounts left.

use serde_json::Value;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::agent::Agent;
use crate::clients::ask;
use crate::host::{alive, Host};
use crate::stats::Stats;

const SETTLED: [&str; 3] = ["running", "suspended", "hibernated"];

/// Waits (bounded) until every service is in a settled state; the list.
fn settle(agent: &Agent, stats: &Stats, limit: Duration) -> Option<Vec<Value>> {
    let end = Instant::now() + limit;
    let mut last = Vec::new();
    loop {
        match agent.list() {
            Ok(l) => {
                if l.iter().all(|s| SETTLED.iter().any(|st| s["state"] == *st)) {
                    return Some(l);
                }
                last = l;
            }
            Err(e) => {
                if Instant::now() >= end {
                    stats.violation("agent_unanswering", format!("{e:#}"));
                    return None;
                }
            }
        }
        if Instant::now() >= end {
            let states: Vec<String> = last.iter().map(|s| format!("{}={}", s["name"], s["state"])).collect();
            stats.violation("not_settled", format!("within {limit:?}: {}", states.join(" ")));
            return None;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Each settled service's process and image agree with its state. A
/// service that moved meanwhile (the clients run) is looked at next time.
pub fn services(host: &Host, agent: &Agent, stats: &Stats, context: &str) {
    let Some(list) = settle(agent, stats, Duration::from_secs(150)) else { return };
    for s in &list {
        let name = s["name"].as_str().unwrap_or("?").to_string();
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
            // Still the same? (It may have moved since it was listed.)
            let now = agent.service(&name).unwrap_or_default();
            if now["state"] == state && now["pid"].as_i64().unwrap_or(0) as i32 == pid {
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
