//! The last request-driven wakes (swaps), kept for the status page: which
//! service, when, how long to the first byte and where the time went.

use serde::Serialize;
use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

/// How many wakes are kept (the oldest go first).
pub const KEPT: usize = 50;

#[derive(Clone, Debug, Serialize)]
pub struct Phase {
    pub phase: &'static str,
    pub ms: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Swap {
    pub service: String,
    /// `resume` or `wake` (from an image).
    pub kind: &'static str,
    /// When its first byte was written (Unix time, ms).
    pub at_unix_ms: u64,
    pub total_ms: f64,
    pub phases: Vec<Phase>,
}

/// The last [`KEPT`] wakes, oldest first.
#[derive(Default)]
pub struct Recent(Mutex<VecDeque<Swap>>);

impl Recent {
    pub fn push(&self, service: &str, t: &crate::trace::WakeTrace) {
        let ms = |d: std::time::Duration| (d.as_secs_f64() * 1e6).round() / 1e3;
        let swap = Swap {
            service: service.to_string(),
            kind: t.kind,
            at_unix_ms: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64),
            total_ms: ms(t.total()),
            phases: t.phases().into_iter().map(|(phase, d)| Phase { phase, ms: ms(d) }).collect(),
        };
        let mut q = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if q.len() == KEPT {
            q.pop_front();
        }
        q.push_back(swap);
    }

    pub fn list(&self) -> Vec<Swap> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn keeps_the_last_wakes_with_their_phases() {
        let r = Recent::default();
        for i in 0..KEPT + 3 {
            let t0 = Instant::now();
            let mut t = crate::trace::WakeTrace::new("resume", t0);
            t.mark("resume", t0 + Duration::from_millis(10));
            t.mark("first_byte", t0 + Duration::from_millis(12));
            r.push(&format!("s{i}"), &t);
        }
        let l = r.list();
        assert_eq!(l.len(), KEPT);
        assert_eq!(l[0].service, "s3");
        assert_eq!(l.last().unwrap().total_ms, 12.0);
        assert_eq!(
            l.last().unwrap().phases.iter().map(|p| p.phase).collect::<Vec<_>>(),
            ["resume", "first_byte"]
        );
    }
}
