//! Whether every service settles: each one, on its own, is seen running,
//! parked, suspended or hibernated (or seen to leave its transition through one of
//! those) within the bound. Not all of them at one instant: while the
//! clients run on a loaded machine a swap is nearly always under way
//! somewhere, and services that each settle within seconds may go minutes
//! without ever being settled all together. What must never happen is one
//! service held in one transition: its `in_state_ms` grows and it is never
//! seen anywhere else.

use serde_json::Value;
use std::collections::BTreeMap;

pub(crate) const SETTLED: [&str; 4] = ["running", "parked", "suspended", "hibernated"];

/// What the polls saw of one service.
#[derive(Default)]
struct Seen {
    /// Seen settled at a poll.
    settled: bool,
    /// Seen to leave a transition through a settled state between two
    /// polls (too quickly for a poll to see it settled).
    passed: bool,
    /// Its state and time in it at the last poll.
    last: Option<(String, u64)>,
}

impl Seen {
    fn done(&self) -> bool {
        self.settled || self.passed
    }
}

/// The services' listings, poll after poll.
#[derive(Default)]
pub struct Settle {
    seen: BTreeMap<String, Seen>,
}

/// A service now in `next`, in `prev` at the poll before, went through a
/// settled state in between: the agent enters `suspending` (a suspend or a
/// park) and `hibernating` only from `running`, `parked` or `suspended`,
/// `waking` only from `hibernated` (or `idle`), and `resuming` from
/// `suspended` or `parked`, or straight
/// from `waking` within one wake (that one is no sign of an end). (A
/// failed `after_resume` hook goes from `resuming` to `suspending`; the
/// soak's services have no hooks.)
fn through_settled(prev: &str, next: &str) -> bool {
    match next {
        "suspending" | "hibernating" | "waking" => true,
        "resuming" => prev != "waking",
        _ => false,
    }
}

impl Settle {
    /// Takes one listing of every service (`GET /v1/services`).
    pub fn observe(&mut self, list: &[Value]) {
        for s in list {
            let Some(name) = s["name"].as_str() else { continue };
            let state = s["state"].as_str().unwrap_or("").to_string();
            let ms = s["in_state_ms"].as_u64().unwrap_or(0);
            let seen = self.seen.entry(name.to_string()).or_default();
            if SETTLED.contains(&state.as_str()) {
                seen.settled = true;
            } else if let Some((prev, prev_ms)) = &seen.last {
                // Another state, or the same one entered again (the agent's
                // time in it went back: it was left and entered anew).
                let entered = *prev != state || ms < *prev_ms;
                if entered && through_settled(prev, &state) {
                    seen.passed = true;
                }
            }
            seen.last = Some((state, ms));
        }
    }

    /// Every service listed has settled, at one poll or another.
    pub fn done(&self) -> bool {
        !self.seen.is_empty() && self.seen.values().all(Seen::done)
    }

    /// Each service never seen settled: `name=state for N ms` as last seen.
    pub fn held(&self) -> Vec<String> {
        self.seen
            .iter()
            .filter(|(_, s)| !s.done())
            .map(|(n, s)| {
                let (state, ms) = s.last.clone().unwrap_or_default();
                format!("{n}={state} for {ms} ms")
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn list(states: &[(&str, &str, u64)]) -> Vec<Value> {
        states.iter().map(|(n, s, ms)| json!({"name": n, "state": s, "in_state_ms": ms})).collect()
    }

    #[test]
    fn services_that_each_settle_are_settled_though_never_all_at_once() {
        // The shape of seed 21's cycle 75 on a loaded machine: at every
        // poll some service is in a swap, never the same one for long.
        let mut s = Settle::default();
        s.observe(&list(&[("a", "waking", 100), ("b", "suspending", 50), ("c", "running", 900)]));
        assert!(!s.done());
        s.observe(&list(&[("a", "resuming", 20), ("b", "suspended", 10), ("c", "suspending", 30)]));
        assert!(!s.done(), "a went from waking to resuming: one wake, not yet back");
        s.observe(&list(&[("a", "running", 40), ("b", "resuming", 90), ("c", "suspending", 130)]));
        assert!(s.done(), "{:?}", s.held());
    }

    #[test]
    fn a_service_held_in_one_transition_is_not_settled() {
        let mut s = Settle::default();
        for i in 0..20u64 {
            s.observe(&list(&[("a", "running", 10 + i), ("b", "suspending", 1000 + i * 100)]));
        }
        assert!(!s.done());
        assert_eq!(s.held(), vec!["b=suspending for 2900 ms".to_string()]);
    }

    #[test]
    fn a_transition_left_and_entered_again_between_polls_counts_as_settled() {
        // resuming, back and suspended again, resuming again: the time in
        // the state went back.
        let mut s = Settle::default();
        s.observe(&list(&[("a", "resuming", 400)]));
        s.observe(&list(&[("a", "resuming", 30)]));
        assert!(s.done(), "{:?}", s.held());
        // From resuming to suspending goes through running.
        let mut s = Settle::default();
        s.observe(&list(&[("a", "resuming", 400)]));
        s.observe(&list(&[("a", "suspending", 30)]));
        assert!(s.done(), "{:?}", s.held());
        // A restart (dead, starting) is no sign of anything settled.
        let mut s = Settle::default();
        s.observe(&list(&[("a", "dead", 400)]));
        s.observe(&list(&[("a", "starting", 30)]));
        s.observe(&list(&[("a", "dead", 10)]));
        assert!(!s.done());
        assert_eq!(s.held(), vec!["a=dead for 10 ms".to_string()]);
    }
}
