//! A guarded CUDA process whose context faults (the fake driver's sticky
//! error: the workload's context takes 700, and so does the guard's lock):
//! the guard tells it apart and records it (journal, `ps` state `faulted`,
//! `run` exits 7); under `--on-fault hold` it keeps the process from dying
//! until `gpusnap stop --force`. Both guards, on a process that was
//! suspended and resumed before it faulted and on one that was not.

mod common;

use common::*;
use std::time::Duration;

/// `run`'s exit code after a faulted context (docs/reference/exit-codes.md).
const FAULTED_EXIT: i32 = 7;

/// Starts the fake workload under `run` (`--light` when `light`) with
/// `--on-fault policy`; suspends and resumes it when `restored`; then makes
/// its context fault. Returns the `run` child's index and the workload's pid.
fn faulted(w: &mut World, light: bool, policy: &str, restored: bool, name: &str) -> (usize, i32) {
    let st = status_file(w, name);
    let wl = fake_workload_bin();
    let mut args = vec!["run"];
    if light {
        args.push("--light");
    }
    args.extend(["--on-fault", policy, "--", wl.to_str().unwrap(), "--mib", "256"]);
    args.extend(["--status", st.to_str().unwrap()]);
    let idx = w.spawn_gpusnap(&args);
    let pid = pid_in(&st);
    if restored {
        assert_eq!(w.json(&["suspend", &pid.to_string()]).code, 0, "{name}");
        assert_eq!(w.json(&["resume", &pid.to_string()]).code, 0, "{name}");
        assert_progressing_at(&st);
    }
    let mut trigger = st.as_os_str().to_owned();
    trigger.push(".fault");
    std::fs::write(trigger, b"").unwrap();
    (idx, pid)
}

/// The journal says the context faulted, and the driver's lock said 700.
fn assert_fault_recorded(w: &World, pid: i32, ctx: &str) {
    let notes = history_notes(w, pid);
    assert!(
        notes.iter().any(|n| n.contains("CUDA context faulted") && n.contains("CUDA_ERROR_ILLEGAL_ADDRESS")),
        "{ctx}: {notes:?}"
    );
    assert!(w.calls_on(pid).contains(&"lock=700".to_string()), "{ctx}: {:?}", w.calls_on(pid));
}

/// Whether `pid` runs (or is held), not ended nor a zombie.
fn living(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z')))
}

fn ps_state(w: &World, pid: i32) -> Option<String> {
    let ps = w.json(&["ps"]).json();
    ps["processes"].as_array()?.iter().find(|r| r["pid"] == pid)?["state"].as_str().map(str::to_string)
}

fn exit_and_hold(light: bool) {
    let mut w = World::new(&[16_384]);
    let mode = if light { "light" } else { "traced" };
    for restored in [false, true] {
        let ctx = format!("{mode}, {}", if restored { "restored" } else { "not restored" });

        // exit: the death goes on (the program's own exit 1), run says 7.
        let (idx, pid) = faulted(&mut w, light, "exit", restored, &format!("{mode}-exit-{restored}"));
        let s = w.wait_child(idx);
        assert_eq!(s.code(), Some(FAULTED_EXIT), "{ctx}: {s:?}");
        assert_fault_recorded(&w, pid, &ctx);
        assert!(!pid_exists(pid), "{ctx}");

        // hold: the process is kept from dying, listed as faulted, and only
        // `stop --force` ends it.
        let (idx, pid) = faulted(&mut w, light, "hold", restored, &format!("{mode}-hold-{restored}"));
        wait_for(Duration::from_secs(60), || {
            history_notes(&w, pid).iter().any(|n| n.contains("held (on-fault hold)"))
        });
        assert_fault_recorded(&w, pid, &ctx);
        assert!(living(pid), "{ctx}: held, not dead");
        assert_eq!(ps_state(&w, pid).as_deref(), Some("faulted"), "{ctx}");
        let r = w.json(&["stop", &pid.to_string()]);
        assert_eq!(
            (r.code, r.json()["error"]["kind"].as_str()),
            (1, Some("stop_refused")),
            "{ctx}: {}",
            r.stderr
        );
        assert!(r.stderr.contains("faulted"), "{ctx}: {}", r.stderr);
        assert!(living(pid), "{ctx}: a plain stop leaves it held");
        let r = w.json(&["stop", "--force", &pid.to_string()]);
        assert_eq!(r.code, 0, "{ctx}: {}", r.stderr);
        assert_eq!(r.json()["results"][0]["signal"], "SIGKILL", "{ctx}: {}", r.stdout);
        let s = w.wait_child(idx);
        assert_eq!(s.code(), Some(FAULTED_EXIT), "{ctx}: {s:?}");
        assert!(!pid_exists(pid), "{ctx}");
        assert!(history_notes(&w, pid).iter().any(|n| n.contains("SIGKILL (faulted, --force)")), "{ctx}");
    }
}

#[test]
fn traced_guard_records_a_faulted_context_and_holds_it_when_asked() {
    exit_and_hold(false);
}

#[test]
fn light_guard_records_a_faulted_context_and_holds_it_when_asked() {
    exit_and_hold(true);
}
