//! Printing: human text on a terminal, one JSON object with `--json`.

use crate::finding::{Finding, Severity};
use gpusnap_core::engine::{ParkReport, ResumeReport, StateReport, StopReport, SuspendReport};
use gpusnap_core::store::Event;
use gpusnap_core::Progress;
use gpusnap_hibernate::{HibernateReport, WakeReport};
use gpusnap_images::image::Named;
use gpusnap_images::manifest::ImageError;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use serde_json::json;
use std::io::IsTerminal;
use std::sync::Mutex;

pub struct Out {
    json: bool,
    /// All bars of one command, drawn together (groups run in parallel).
    bars: indicatif::MultiProgress,
    /// What a command finished before it failed: part of the error's JSON
    /// object, so that `--json` prints one object either way.
    partial: std::sync::Mutex<Option<serde_json::Value>>,
}

fn gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
}

fn secs(ms: u64) -> String {
    format!("{:.2} s", ms as f64 / 1000.0)
}

pub fn suspended(r: &SuspendReport) -> String {
    if r.already {
        return format!("{} was already suspended ({} recorded)", r.pid, gib(r.footprint_bytes));
    }
    format!(
        "suspended {}: {} off the GPU in {} (lock {}, checkpoint {})",
        r.pid,
        gib(r.footprint_bytes),
        secs(r.total_ms),
        secs(r.lock_ms),
        secs(r.checkpoint_ms)
    )
}

pub fn parked(r: &ParkReport) -> String {
    if r.already {
        return format!(
            "{} was already parked ({} in host memory, {} on the GPU)",
            r.pid,
            gib(r.host_bytes),
            gib(r.residual_bytes)
        );
    }
    format!(
        "parked {}: {} to host memory in {}, {} stays on the GPU",
        r.pid,
        gib(r.host_bytes),
        secs(r.total_ms),
        gib(r.residual_bytes)
    )
}

pub fn resumed(r: &ResumeReport) -> String {
    if r.already {
        return format!("{} is already running", r.pid);
    }
    let waited =
        if r.waited_ms > 500 { format!(", waited {} for memory", secs(r.waited_ms)) } else { String::new() };
    format!(
        "resumed {}: {} back on the GPU in {} (restore {}, unlock {}{waited})",
        r.pid,
        gib(r.footprint_bytes),
        secs(r.total_ms),
        secs(r.restore_ms),
        secs(r.unlock_ms)
    )
}

pub fn hibernated(r: &HibernateReport) -> String {
    let what = if r.left_running { "left running" } else { "ended" };
    let map = r.map.as_ref().map_or(String::new(), |b| {
        format!("; map file {} ({} in {} regions, {})", b.path, gib(b.bytes), b.regions, secs(b.ms))
    });
    format!(
        "image {} ({}): {} process(es), {} with CUDA, {} in {} (suspend {}, dump {}, write {}); tree {what}{map}",
        r.image,
        r.path.display(),
        r.processes.len(),
        r.cuda.len(),
        gib(r.image_bytes),
        secs(r.total_ms),
        secs(r.suspend_ms),
        secs(r.dump_ms),
        secs(r.write_ms)
    )
}

pub fn woken(r: &WakeReport) -> String {
    let pages = match (&r.pages, r.lazy) {
        (Some(p), true) => format!(", pages {} (lazy, {} faults)", secs(r.stages.pages), p.faults),
        (None, true) => format!(", pages {} (lazy)", secs(r.stages.pages)),
        _ => String::new(),
    };
    format!(
        "woke {}: root pid {}, {} process(es), {} back on the GPU, in {} (verify {}, criu {}, restore {}{pages})",
        r.image,
        r.root_pid,
        r.processes.len(),
        r.resumed.len(),
        secs(r.total_ms),
        secs(r.verify_ms),
        secs(r.criu_ms),
        secs(r.restore_ms)
    )
}

/// A resume that had to go through recovery, reported as a resume.
pub fn recovered_as_resume(pid: i32, w: &WakeReport, footprint_bytes: u64) -> ResumeReport {
    ResumeReport {
        pid,
        state: "running".into(),
        already: false,
        footprint_bytes,
        waited_ms: w.waited_ms,
        restore_ms: w.restore_ms,
        unlock_ms: 0,
        total_ms: w.total_ms,
        recovered_from: Some(w.image.clone()),
    }
}

/// `4242 (python): checkpointed, 2.0 GiB on 1 GPU(s)`, and why it cannot
/// be restored in place when it cannot.
fn state_line(r: &StateReport) -> String {
    let stuck = match &r.reason {
        Some(why) => format!("; UNRECOVERABLE: {why}"),
        None => String::new(),
    };
    let host = match &r.parked {
        Some(p) => format!(", {} in host memory", gib(p.host_bytes)),
        None => String::new(),
    };
    format!(
        "{} ({}): {}, {} on {} GPU(s){host}{stuck}",
        r.pid,
        r.comm,
        r.state,
        gib(r.footprint_bytes),
        r.gpus.len()
    )
}

pub fn stopped(r: &StopReport) -> String {
    let how = match (r.cuda, r.suspended, r.released_before_kill) {
        (false, _, _) => "no CUDA state".to_string(),
        (true, true, true) => "suspended, GPU memory released".to_string(),
        (true, s, rel) => format!("suspended={s}, GPU memory released={rel} (forced)"),
    };
    format!("stopped {} ({how}) by {} in {}", r.pid, r.signal, secs(r.total_ms))
}

impl Out {
    pub fn new(json: bool) -> Self {
        Self {
            json,
            bars: indicatif::MultiProgress::with_draw_target(ProgressDrawTarget::stderr()),
            partial: std::sync::Mutex::new(None),
        }
    }

    fn emit(&self, v: serde_json::Value) {
        println!("{v}");
    }

    /// A line for people; nothing in JSON mode (the final object says it all).
    pub fn line(&self, s: &str) {
        if !self.json {
            println!("{s}");
        }
    }

    /// Every result: its line each, or one JSON object.
    pub fn all<T: Serialize>(&self, r: &[T], human: impl Fn(&T) -> String) {
        for x in r {
            self.line(&human(x));
        }
        self.results(r);
    }

    pub fn results<T: Serialize>(&self, r: &[T]) {
        if self.json {
            self.emit(json!({ "results": r }));
        }
    }

    /// The results of a command that then failed: printed with its error.
    pub fn partial_results<T: Serialize>(&self, r: &[T]) {
        if self.json {
            let v = serde_json::to_value(r).unwrap_or_default();
            *self.partial.lock().unwrap_or_else(|e| e.into_inner()) = Some(v);
        }
    }

    pub fn error(&self, kind: &str, msg: &str, hint: Option<&str>, code: i32) {
        eprintln!("gpusnap: {msg}");
        if let Some(h) = hint {
            eprintln!("  hint: {h}");
        }
        if self.json {
            let mut v = json!({ "error": { "kind": kind, "message": msg, "hint": hint, "exit_code": code } });
            if let Some(done) = self.partial.lock().unwrap_or_else(|e| e.into_inner()).take() {
                v["results"] = done;
            }
            self.emit(v);
        }
    }

    /// The agent's services (`GET /v1/services`) as a table, or as they came.
    /// What a reload of the agent's config did.
    pub fn agent_reload(&self, o: &serde_json::Value) {
        if self.json {
            self.emit(o.clone());
            return;
        }
        for c in o["changes"].as_array().into_iter().flatten() {
            println!(
                "{:<20} {:<8} {:<12} {}",
                c["service"].as_str().unwrap_or("?"),
                c["change"].as_str().unwrap_or("?"),
                c["done"].as_str().unwrap_or("?"),
                c["detail"].as_str().unwrap_or("")
            );
        }
        let n = o["unchanged"].as_array().map_or(0, Vec::len);
        println!("{n} service(s) unchanged");
        for k in o["needs_agent_restart"].as_array().into_iter().flatten() {
            println!(
                "{}: read at start only, applied once the agent is restarted",
                k.as_str().unwrap_or("?")
            );
        }
        for d in o["drift"].as_array().into_iter().flatten() {
            println!("{}: {}", d["service"].as_str().unwrap_or("?"), d["drift"].as_str().unwrap_or(""));
        }
    }

    pub fn agent_services(&self, list: &serde_json::Value) {
        if self.json {
            self.emit(list.clone());
            return;
        }
        println!(
            "{:<20} {:<12} {:<22} {:>8} {:>6} {:>9} {:>8}  {:<18} IMAGE",
            "SERVICE", "STATE", "LISTEN", "PID", "CONNS", "GPU", "IDLE", "NEXT"
        );
        let secs = |ms: u64| {
            let s = ms as f64 / 1000.0;
            match s {
                s if s < 120.0 => format!("{s:.1}s"),
                s if s < 7200.0 => format!("{:.1}m", s / 60.0),
                s => format!("{:.1}h", s / 3600.0),
            }
        };
        for s in list.as_array().into_iter().flatten() {
            let pid = s["pid"].as_i64().map_or("-".to_string(), |p| p.to_string());
            let gpu = s["gpu_memory"]
                .as_u64()
                .map_or("-".to_string(), |b| format!("{:.1}GiB", b as f64 / (1u64 << 30) as f64));
            let next = match (s["next"]["action"].as_str(), s["next"]["in_ms"].as_u64()) {
                (Some(a), Some(ms)) => format!("{a} in {}", secs(ms)),
                _ => "-".to_string(),
            };
            println!(
                "{:<20} {:<12} {:<22} {:>8} {:>6} {:>9} {:>8}  {:<18} {}",
                s["name"].as_str().unwrap_or("?"),
                s["state"].as_str().unwrap_or("?"),
                s["listen"].as_str().unwrap_or("?"),
                pid,
                s["connections"].as_u64().unwrap_or(0),
                gpu,
                secs(s["idle_ms"].as_u64().unwrap_or(0)),
                next,
                s["image"].as_str().unwrap_or("-"),
            );
            if let Some(e) = s["last_error"].as_str() {
                println!("  last error: {e}");
            }
            if let Some(d) = s["config_drift"].as_str() {
                println!("  config drift: {d}");
            }
        }
    }

    /// One result: its JSON, or its line.
    pub fn one<T: Serialize>(&self, v: &T, human: &str) {
        if self.json {
            self.emit(serde_json::to_value(v).unwrap_or_default());
        } else {
            println!("{human}");
        }
    }

    /// Images by their directories' names; what a manifest says is
    /// untrusted text (escaped) until it is verified.
    /// The store's images; `maps`: the size of each one's map file, if it
    /// has one (`images map`).
    pub fn images(&self, list: &[Result<Named, (String, ImageError)>], maps: &[Option<u64>]) {
        let map_of = |i: usize| maps.get(i).copied().flatten();
        if self.json {
            let v: Vec<_> = list
                .iter()
                .enumerate()
                .map(|(i, r)| match r {
                    Ok((n, m)) => {
                        json!({ "name": n, "created_ms": m.created_ms, "host": m.host, "root_pid": m.root_pid,
                        "processes": m.processes.len(), "cuda": m.processes.iter().filter(|p| p.cuda).count(),
                        "bytes": m.total_bytes(), "footprint_bytes": m.footprint_total(), "signer": m.signer,
                        "map_bytes": map_of(i) })
                    }
                    Err((n, e)) => json!({ "name": n, "error": e.to_string() }),
                })
                .collect();
            self.emit(json!({ "images": v }));
            return;
        }
        println!(
            "{:<40} {:>8} {:>6} {:>10} {:>12} {:>10}  HOST",
            "IMAGE", "ROOT", "PROCS", "SIZE", "GPU MEMORY", "MAP FILE"
        );
        for (i, r) in list.iter().enumerate() {
            match r {
                Ok((n, m)) => println!(
                    "{:<40} {:>8} {:>6} {:>10} {:>12} {:>10}  {}",
                    printable(n),
                    m.root_pid,
                    m.processes.len(),
                    gib(m.total_bytes()),
                    gib(m.footprint_total()),
                    map_of(i).map_or("-".to_string(), gib),
                    printable(&m.host)
                ),
                Err((n, e)) => println!("{:<40} unreadable: {}", printable(n), printable(&e.to_string())),
            }
        }
    }

    /// One process's state: its line, or its JSON object.
    pub fn state(&self, r: &StateReport) {
        self.one(r, &state_line(r));
    }

    /// Several processes' states: a line each, or `{"processes": [...]}`
    /// (the shape of `ps`).
    pub fn states(&self, rows: &[StateReport]) {
        if self.json {
            self.emit(json!({ "processes": rows }));
            return;
        }
        for r in rows {
            println!("{}", state_line(r));
        }
    }

    pub fn ps(&self, rows: &[StateReport]) {
        if self.json {
            self.emit(json!({ "processes": rows }));
            return;
        }
        let containers = rows.iter().any(|r| r.container.is_some());
        let head = format!("{:>8}  {:<16} {:<13} {:>10}  GPUS", "PID", "COMMAND", "STATE", "MEMORY");
        let parked = rows.iter().any(|r| r.parked.is_some());
        println!("{head}{}", if containers { "           CONTAINER" } else { "" });
        for r in rows {
            let state = if r.unrecoverable { format!("{}!", r.state) } else { r.state.clone() };
            let gpus: Vec<String> = r.gpus.iter().map(|g| g.uuid.chars().take(12).collect()).collect();
            let container = r.container.as_ref().map(|c| {
                let id: String = c.id.chars().take(12).collect();
                match &c.name {
                    Some(n) => format!("  {n} ({} {id})", c.runtime),
                    None => format!("  {} {id}", c.runtime),
                }
            });
            let gpus = match container {
                Some(c) => format!("{:<14}{c}", gpus.join(",")),
                None => gpus.join(","),
            };
            println!("{:>8}  {:<16} {:<13} {:>10}  {gpus}", r.pid, r.comm, state, gib(r.footprint_bytes));
        }
        if parked {
            println!(
                "parked: MEMORY is what stays on the GPU; `gpusnap state PID` adds the bytes in host memory"
            );
        }
        if rows.iter().any(|r| r.unrecoverable) {
            println!("! cannot be restored in place: see `gpusnap state PID`");
        }
        for r in rows {
            if let Some(fs) = r.fast_swap.as_ref().filter(|f| f.kept > 0) {
                println!(
                    "{}: fast swap leaves {} allocation(s), {} MiB, with the driver: {}",
                    r.pid,
                    fs.kept,
                    fs.kept_bytes >> 20,
                    fs.kept_why.join(", ")
                );
            }
        }
    }

    pub fn history(&self, pid: i32, h: &[Event]) {
        if self.json {
            self.emit(json!({ "pid": pid, "events": h }));
            return;
        }
        for e in h {
            println!(
                "{} {:<12} {:<8} {}{}",
                e.ts_ms,
                e.op,
                e.phase,
                e.state.as_deref().unwrap_or(""),
                e.detail.as_deref().map(|d| format!(" {d}")).unwrap_or_default()
            );
        }
    }

    pub fn doctor(&self, findings: &[Finding]) {
        if self.json {
            self.emit(json!({ "findings": findings }));
            return;
        }
        for f in findings {
            let tag = match f.severity {
                Severity::Ok => "ok   ",
                Severity::Info => "info ",
                Severity::Warn => "WARN ",
                Severity::Error => "ERROR",
            };
            println!("{tag} {:<10} {}", f.check, f.message);
            if let Some(fix) = &f.fix {
                println!("      {:<10} fix: {fix}", "");
            }
        }
    }

    /// A progress bar on a terminal; nothing with `--json` or when piped.
    pub fn progress(&self) -> Box<dyn Progress> {
        if self.json || !std::io::stderr().is_terminal() {
            return Box::new(gpusnap_core::Quiet);
        }
        Box::new(Bar(Mutex::new(None), self.bars.clone()))
    }
}

struct Bar(Mutex<Option<ProgressBar>>, indicatif::MultiProgress);

impl Progress for Bar {
    fn begin(&self, label: &str, total: u64) {
        let pb = self.1.add(ProgressBar::new(total));
        pb.set_style(
            ProgressStyle::with_template(
                "{msg:>14} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        pb.set_message(label.to_string());
        if let Ok(mut g) = self.0.lock() {
            *g = Some(pb);
        }
    }

    fn update(&self, done: u64) {
        if let Ok(g) = self.0.lock() {
            if let Some(pb) = g.as_ref() {
                pb.set_position(done);
            }
        }
    }

    fn end(&self) {
        if let Ok(mut g) = self.0.lock() {
            if let Some(pb) = g.take() {
                pb.finish_and_clear();
            }
        }
    }

    fn sibling(&self) -> Box<dyn Progress> {
        Box::new(Bar(Mutex::new(None), self.1.clone()))
    }
}

/// Text from an image or a file name, safe on a terminal: control
/// characters (escape sequences among them) are shown escaped.
pub fn printable(s: &str) -> String {
    s.chars()
        .flat_map(|c| {
            let esc: Vec<char> = if c.is_control() { c.escape_default().collect() } else { vec![c] };
            esc
        })
        .collect()
}
