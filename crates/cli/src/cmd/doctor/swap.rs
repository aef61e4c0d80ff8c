//! Doctor's fast-swap checks of a process: what its preload library moves
//! itself and what it leaves with the driver, and, for a CUDA program not
//! under the library, that the driver's lock can catch one of its threads
//! inside a driver call.

use crate::finding::{Finding, Severity};

const MIB: u64 = 1 << 20;

fn f(check: &'static str, severity: Severity, message: String, fix: Option<&str>) -> Finding {
    Finding { check, severity, message, fix: fix.map(str::to_string) }
}

/// The findings for `pid` (`cuda`: it has libcuda loaded); the library is
/// asked, bounded in time.
pub fn findings(pid: i32, cuda: bool) -> Vec<Finding> {
    match gpusnap_core::swap::status(pid) {
        Some(s) => vec![fast_swap(&s)],
        None if gpusnap_core::swap::asked(pid) => vec![f(
            "fast-swap",
            Severity::Warn,
            "fast swap was asked for but its library does not listen for gpusnap (the program's \
             standard error says why): the driver's checkpoint moves all its memory"
                .to_string(),
            Some("restart the program under `gpusnap run --light --fast-swap`"),
        )],
        None if cuda => vec![f(
            "quiesce",
            Severity::Warn,
            "not under gpusnap's preload library: the driver's checkpoint can lock it while one of its threads \
             is inside a driver call (a blocking read, a synchronize), which has crashed programs (JAX) once \
             restored"
                .into(),
            Some("start it with `gpusnap run --light --fast-swap` (the agent's servers are), which quiesces it first"),
        )],
        None => Vec::new(),
    }
}

/// What a `--fast-swap` program's library moves itself, and what it leaves
/// to the driver's (slower) checkpoint.
fn fast_swap(s: &gpusnap_core::swap::SwapStatus) -> Finding {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cuda_program_not_under_the_library_is_warned_about_and_others_are_not() {
        // This test process has no fast-swap socket.
        let me = std::process::id() as i32;
        let w = findings(me, true);
        assert_eq!(w.len(), 1);
        assert_eq!((w[0].check, w[0].severity), ("quiesce", Severity::Warn));
        assert!(w[0].message.contains("inside a driver call"), "{}", w[0].message);
        assert!(findings(me, false).is_empty(), "no CUDA, nothing to lock");
    }
}
