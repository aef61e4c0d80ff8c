//! Printing: human text on a terminal, one JSON object with `--json`.

use gpusnap_core::doctor::{Finding, Severity};
use gpusnap_core::engine::{ResumeReport, StateReport, StopReport, SuspendReport};
use gpusnap_core::store::Event;
use gpusnap_core::Progress;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use serde_json::json;
use std::io::IsTerminal;
use std::sync::Mutex;

pub struct Out {
    json: bool,
}

fn gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
}

fn secs(ms: u64) -> String {
    format!("{:.2} s", ms as f64 / 1000.0)
}

pub fn suspended(r: &SuspendReport) -> String {
    if r.already {
        return format!(
            "{} was already suspended ({} recorded)",
            r.pid,
            gib(r.footprint_bytes)
        );
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

pub fn resumed(r: &ResumeReport) -> String {
    if r.already {
        return format!("{} is already running", r.pid);
    }
    let waited = if r.waited_ms > 500 {
        format!(", waited {} for memory", secs(r.waited_ms))
    } else {
        String::new()
    };
    format!(
        "resumed {}: {} back on the GPU in {} (restore {}, unlock {}{waited})",
        r.pid,
        gib(r.footprint_bytes),
        secs(r.total_ms),
        secs(r.restore_ms),
        secs(r.unlock_ms)
    )
}

pub fn stopped(r: &StopReport) -> String {
    let how = match (r.cuda, r.suspended, r.released_before_kill) {
        (false, _, _) => "no CUDA state".to_string(),
        (true, true, true) => "suspended, GPU memory released".to_string(),
        (true, s, rel) => format!("suspended={s}, GPU memory released={rel} (forced)"),
    };
    format!(
        "stopped {} ({how}) by {} in {}",
        r.pid,
        r.signal,
        secs(r.total_ms)
    )
}

impl Out {
    pub fn new(json: bool) -> Self {
        Self { json }
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

    pub fn results<T: Serialize>(&self, r: &[T]) {
        if self.json {
            self.emit(json!({ "results": r }));
        }
    }

    pub fn error(&self, kind: &str, msg: &str, hint: Option<&str>, code: i32) {
        eprintln!("gpusnap: {msg}");
        if let Some(h) = hint {
            eprintln!("  hint: {h}");
        }
        if self.json {
            self.emit(json!({ "error": { "kind": kind, "message": msg, "hint": hint, "exit_code": code } }));
        }
    }

    pub fn state(&self, r: &StateReport) {
        if self.json {
            self.emit(serde_json::to_value(r).unwrap_or_default());
            return;
        }
        let extra = match &r.reason {
            Some(why) => format!("\n  UNRECOVERABLE: {why}"),
            None => String::new(),
        };
        println!(
            "{} ({}): {}, {} on {} GPU(s){extra}",
            r.pid,
            r.comm,
            r.state,
            gib(r.footprint_bytes),
            r.gpus.len()
        );
    }

    pub fn ps(&self, rows: &[StateReport]) {
        if self.json {
            self.emit(json!({ "processes": rows }));
            return;
        }
        println!(
            "{:>8}  {:<16} {:<13} {:>10}  GPUS",
            "PID", "COMMAND", "STATE", "MEMORY"
        );
        for r in rows {
            let state = if r.unrecoverable {
                format!("{}!", r.state)
            } else {
                r.state.clone()
            };
            let gpus: Vec<String> = r
                .gpus
                .iter()
                .map(|g| g.uuid.chars().take(12).collect())
                .collect();
            println!(
                "{:>8}  {:<16} {:<13} {:>10}  {}",
                r.pid,
                r.comm,
                state,
                gib(r.footprint_bytes),
                gpus.join(",")
            );
        }
        if rows.iter().any(|r| r.unrecoverable) {
            println!("! cannot be restored in place: see `gpusnap state PID`");
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
                e.detail
                    .as_deref()
                    .map(|d| format!(" {d}"))
                    .unwrap_or_default()
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
        Box::new(Bar(Mutex::new(None)))
    }
}

struct Bar(Mutex<Option<ProgressBar>>);

impl Progress for Bar {
    fn begin(&self, label: &str, total: u64) {
        let pb = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
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
}
