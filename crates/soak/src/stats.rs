//! What a soak counted: requests and their waits, swaps, faults and
//! violations by kind; and the table it prints.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

#[derive(Default)]
pub struct Counts {
    pub cycles: u64,
    pub requests: u64,
    pub answered: u64,
    pub refused: u64,
    /// Seconds from connect to the whole answer, of answered requests.
    pub waits: Vec<f64>,
    pub faults: BTreeMap<String, u64>,
    /// Faults that could not be injected on this host, with why.
    pub skipped: BTreeMap<String, String>,
    pub violations: BTreeMap<String, u64>,
    /// The first few violations in words, for the report.
    pub details: Vec<String>,
    pub commands: u64,
}

/// Shared by the clients and the fault loop.
#[derive(Default)]
pub struct Stats(Mutex<Counts>);

impl Stats {
    pub fn with<T>(&self, f: impl FnOnce(&mut Counts) -> T) -> T {
        f(&mut self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }

    pub fn violation(&self, kind: &str, detail: String) {
        eprintln!("soak: VIOLATION {kind}: {detail}");
        self.with(|c| {
            *c.violations.entry(kind.to_string()).or_default() += 1;
            if c.details.len() < 50 {
                c.details.push(format!("{kind}: {detail}"));
            }
        });
    }

    pub fn fault(&self, kind: &str) {
        self.with(|c| *c.faults.entry(kind.to_string()).or_default() += 1);
    }

    pub fn skip(&self, kind: &str, why: &str) {
        self.with(|c| {
            c.skipped.entry(kind.to_string()).or_insert_with(|| why.to_string());
        });
    }

    pub fn violations(&self) -> u64 {
        self.with(|c| c.violations.values().sum())
    }
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// The markdown table of a run.
pub fn table(c: &Counts, swaps: u64, seed: u64, faults: &str, elapsed: Duration) -> String {
    let mut waits = c.waits.clone();
    waits.sort_by(f64::total_cmp);
    let mut s = String::new();
    s += &format!("Seed {seed}, faults `{faults}`, {:.0} s.\n\n", elapsed.as_secs_f64());
    s += "| measure | value |\n|---|---|\n";
    s += &format!("| cycles | {} |\n", c.cycles);
    s += &format!(
        "| requests | {} ({} answered right, {} refused clearly) |\n",
        c.requests, c.answered, c.refused
    );
    s += &format!("| swaps (agent, traced) | {swaps} |\n");
    s += &format!("| gpusnap commands run | {} |\n", c.commands);
    s += &format!("| faults injected | {} |\n", c.faults.values().sum::<u64>());
    s += &format!("| violations | {} |\n", c.violations.values().sum::<u64>());
    s += &format!("| request wait p50 | {:.3} s |\n", quantile(&waits, 0.5));
    s += &format!("| request wait p99 | {:.3} s |\n", quantile(&waits, 0.99));
    s += &format!("| request wait max | {:.3} s |\n", waits.last().copied().unwrap_or(0.0));
    s += "\n| fault kind | injected |\n|---|---|\n";
    for (k, n) in &c.faults {
        s += &format!("| {k} | {n} |\n");
    }
    if !c.skipped.is_empty() {
        s += "\n| fault kind | not injected here, why |\n|---|---|\n";
        for (k, why) in &c.skipped {
            s += &format!("| {k} | {why} |\n");
        }
    }
    s += "\n| violation kind | count |\n|---|---|\n";
    if c.violations.is_empty() {
        s += "| (none) | 0 |\n";
    }
    for (k, n) in &c.violations {
        s += &format!("| {k} | {n} |\n");
    }
    if !c.details.is_empty() {
        s += "\nViolations:\n\n";
        for d in &c.details {
            s += &format!("- {}\n", d.replace('\n', " "));
        }
    }
    s
}
