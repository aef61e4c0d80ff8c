//! Doctor's check of a fast-swap program: what its library moves itself
//! and what it leaves to the driver's (slower) checkpoint, or that it was
//! started for fast swap and its library does not listen.

use crate::doctor::{Finding, Severity};

fn f(check: &'static str, severity: Severity, message: String, fix: Option<&str>) -> Finding {
    Finding { check, severity, message, fix: fix.map(str::to_string) }
}

/// The `fast-swap` row for `pid`, if it has or was asked to have fast swap.
pub fn finding(pid: i32) -> Option<Finding> {
    match gpusnap_core::swap::status(pid) {
        Some(s) => Some(fast_swap(&s)),
        None if gpusnap_core::swap::asked(pid) => Some(f(
            "fast-swap",
            Severity::Warn,
            "fast swap was asked for but its library does not listen for gpusnap (the program's \
             standard error says why): the driver's checkpoint moves all its memory"
                .to_string(),
            Some("restart the program under `gpusnap run --light --fast-swap`"),
        )),
        None => None,
    }
}

/// What a `--fast-swap` program's library moves itself, and what it leaves
/// to the driver's (slower) checkpoint.
fn fast_swap(s: &gpusnap_core::swap::SwapStatus) -> Finding {
    const MIB: u64 = 1 << 20;
    let served = format!(
        "fast swap: {} allocation(s), {} MiB, move at the link's speed (now {})",
        s.movable,
        s.movable_bytes / MIB,
        s.phase
    );
    if s.ipc_refused > 0 {
        return f(
            "fast-swap",
            Severity::Warn,
            format!(
                "{served}; the program asked {} time(s) to share served memory through CUDA IPC \
                 (cuIpcGetMemHandle), which fast swap's memory cannot do",
                s.ipc_refused
            ),
            Some("run it without --fast-swap (an agent's service: fast_swap = false)"),
        );
    }
    if s.kept == 0 {
        return f("fast-swap", Severity::Ok, served, None);
    }
    let kept = format!(
        "{served}; {} allocation(s), {} MiB, stay with the driver's checkpoint: {}",
        s.kept,
        s.kept_bytes / MIB,
        s.kept_why.join(", ")
    );
    f("fast-swap", Severity::Info, kept, None)
}
