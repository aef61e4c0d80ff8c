//! The short soak of CI: a fixed seed, a few cycles of the fault kinds whose
//! handling is settled, and no violation allowed. Seed 178 draws 8 of the 10
//! kinds below in its 8 cycles, among them every kind whose open case was
//! closed (`criu-dump-fail`, `kill-resume`, `agent-kill-swap`,
//! `agent-kill-wake`). The same run by hand:
//! `target/debug/gpusnap-soak --seed 178 --cycles 8 --max-secs 90 --services 4 --clients 2 --faults FAULTS`.

mod common;

use common::build;
use std::process::Command;

/// The kinds of the CI run.
const FAULTS: &str = "tenant,nvml-late,crash-guarded,corrupt-chunk,kill-suspend,kill-push,kill-resume,criu-dump-fail,agent-kill-swap,agent-kill-wake";

#[test]
fn a_short_seeded_soak_finds_no_violation() {
    let bin = build();
    let out = Command::new(env!("CARGO_BIN_EXE_gpusnap-soak"))
        .args(["--seed", "178", "--cycles", "8", "--max-secs", "90", "--services", "4", "--clients", "2"])
        .args(["--faults", FAULTS])
        .env("GPUSNAP_BIN", &bin)
        .output()
        .expect("run gpusnap-soak");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "the soak found violations (or failed):\n{stdout}\n{stderr}");
    assert!(stdout.contains("| violations | 0 |"), "{stdout}");
}
