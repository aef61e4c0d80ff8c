//! Where the time of a wake caused by a request goes (a swap, when it
//! evicts another service first): consecutive phases from the proxy's
//! accept to the first byte of the answer written to the client, so that
//! they add up to the whole. Journaled on the service's process and
//! observed in `gpusnap_agent_swap_phase_seconds{phase}`.

use std::time::{Duration, Instant};

/// The phases, in the order they happen (a phase may repeat: two
/// evictions, two refused admissions; its times are then added).
pub const PHASES: &[(&str, &str)] = &[
    ("decide", "accept -> the agent holds the GPU lock and has journaled its decision"),
    ("admission", "resume attempts admission refused (process tree, driver state, NVML free memory)"),
    ("pick", "choosing the service to evict"),
    ("evict_prep", "the eviction's own bookkeeping (journal, process tree, driver state, footprint)"),
    ("hook_suspend", "the evicted service's before_suspend hook (it gives back its KV cache)"),
    (
        "suspend",
        "the evicted service's suspend: its fast-swap offload, then the driver's lock and checkpoint",
    ),
    ("release_wait", "checkpoint returned -> NVML shows the evicted process's memory released"),
    ("memory_wait", "waiting for free GPU memory with nothing to evict"),
    ("resume_prep", "the admitted attempt before the driver's restore (tree, state, NVML, reservation)"),
    ("wake", "CRIU restore of a hibernated service (wakes only)"),
    ("resume", "the driver's restore and unlock"),
    ("hook_resume", "the service's after_resume hook (it allocates its KV cache again)"),
    ("ready", "resume returned -> the waiting connection sees the service running (journal, state file)"),
    ("connect", "connecting to the backend (with retries)"),
    ("first_byte", "request forwarded -> the answer's first byte written to the client"),
];

/// What a wake had to do, counted.
#[derive(Debug, Default, Clone)]
pub struct Counts {
    /// Resume attempts, each one NVML read of free memory by admission.
    pub admissions: u32,
    pub refusals: u32,
    pub evictions: u32,
    /// NVML reads until the evicted process's memory showed released.
    pub release_polls: u32,
    /// NVML reads while waiting for memory with nothing to evict.
    pub memory_polls: u32,
    pub connect_retries: u32,
}

#[derive(Debug, Clone)]
pub struct WakeTrace {
    pub kind: &'static str,
    t0: Instant,
    last: Instant,
    phases: Vec<(&'static str, Duration)>,
    pub counts: Counts,
}

impl WakeTrace {
    pub fn new(kind: &'static str, accepted: Instant) -> Self {
        Self { kind, t0: accepted, last: accepted, phases: Vec::new(), counts: Counts::default() }
    }

    /// Ends `phase` (running since the last mark) at `at`.
    pub fn mark(&mut self, phase: &'static str, at: Instant) {
        let at = at.max(self.last);
        self.phases.push((phase, at - self.last));
        self.last = at;
    }

    pub fn mark_now(&mut self, phase: &'static str) {
        self.mark(phase, Instant::now());
    }

    /// A span that ended at `end`, split by a report: `parts` (in order,
    /// from the report's own timers) end it, `rest` is what is left before
    /// them. Parts longer than the span are cut to it.
    pub fn span(&mut self, end: Instant, rest: &'static str, parts: &[(&'static str, Duration)]) {
        let end = end.max(self.last);
        let total = end - self.last;
        let sum: Duration = parts.iter().map(|(_, d)| *d).sum();
        let mut at = self.last + total.saturating_sub(sum);
        self.mark(rest, at);
        for (p, d) in parts {
            at = (at + *d).min(end);
            self.mark(p, at);
        }
    }

    /// From the accept to the last mark.
    pub fn total(&self) -> Duration {
        self.last - self.t0
    }

    /// Each phase's time (repeats added), in [`PHASES`] order; only those
    /// that occurred.
    pub fn phases(&self) -> Vec<(&'static str, Duration)> {
        let mut out: Vec<(&'static str, Duration)> = Vec::new();
        for &(p, d) in &self.phases {
            match out.iter_mut().find(|(q, _)| *q == p) {
                Some((_, t)) => *t += d,
                None => out.push((p, d)),
            }
        }
        let rank = |p: &str| PHASES.iter().position(|(q, _)| *q == p).unwrap_or(usize::MAX);
        out.sort_by_key(|(p, _)| rank(p));
        out
    }

    /// One line for the journal: `1.234 s from accept to first byte:
    /// decide 1 ms, ...; 2 admissions (1 refused), 1 eviction, ...`.
    pub fn summary(&self) -> String {
        let ms = |d: Duration| format!("{:.1} ms", d.as_secs_f64() * 1e3);
        let phases: Vec<String> = self.phases().into_iter().map(|(p, d)| format!("{p} {}", ms(d))).collect();
        let c = &self.counts;
        format!(
            "{} by request: {:.3} s from accept to first byte: {}; {} admissions ({} refused), {} evictions, \
             {} NVML reads for the release, {} while waiting for memory, {} backend connect retries",
            self.kind,
            self.total().as_secs_f64(),
            phases.join(", "),
            c.admissions,
            c.refusals,
            c.evictions,
            c.release_polls,
            c.memory_polls,
            c.connect_retries
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_add_up_to_the_total() {
        let t0 = Instant::now();
        let mut t = WakeTrace::new("resume", t0);
        t.mark("decide", t0 + Duration::from_millis(2));
        t.mark("admission", t0 + Duration::from_millis(5));
        t.mark("pick", t0 + Duration::from_millis(6));
        t.span(
            t0 + Duration::from_millis(106),
            "evict_prep",
            &[("suspend", Duration::from_millis(90)), ("release_wait", Duration::from_millis(4))],
        );
        t.mark("admission", t0 + Duration::from_millis(108));
        // A report longer than its span (ms rounding) is cut to it.
        t.span(t0 + Duration::from_millis(150), "resume_prep", &[("resume", Duration::from_millis(60))]);
        // A mark before the last one is taken as the last one.
        t.mark("ready", t0 + Duration::from_millis(140));
        t.mark("first_byte", t0 + Duration::from_millis(170));
        let p = t.phases();
        let sum: Duration = p.iter().map(|(_, d)| *d).sum();
        assert_eq!(sum, t.total());
        assert_eq!(t.total(), Duration::from_millis(170));
        let get = |n: &str| p.iter().find(|(q, _)| *q == n).map(|(_, d)| *d);
        assert_eq!(get("admission"), Some(Duration::from_millis(5)));
        assert_eq!(get("evict_prep"), Some(Duration::from_millis(6)));
        assert_eq!(get("suspend"), Some(Duration::from_millis(90)));
        assert_eq!(get("release_wait"), Some(Duration::from_millis(4)));
        assert_eq!(get("resume_prep"), Some(Duration::ZERO));
        assert_eq!(get("resume"), Some(Duration::from_millis(42)));
        assert_eq!(get("ready"), Some(Duration::ZERO));
        let order: Vec<&str> = p.iter().map(|(n, _)| *n).collect();
        assert_eq!(
            order,
            [
                "decide",
                "admission",
                "pick",
                "evict_prep",
                "suspend",
                "release_wait",
                "resume_prep",
                "resume",
                "ready",
                "first_byte"
            ]
        );
        assert!(t.summary().starts_with("resume by request: 0.170 s"), "{}", t.summary());
    }
}
