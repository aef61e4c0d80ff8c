//! The little of `/proc` the fakes read: is a pid there, which process a
//! thread id belongs to, its run state and its start time (which tells a
//! process from a later one that got the same pid).

use std::fs;
use std::sync::OnceLock;

/// Where the fakes read the kernel's view of the processes: `/proc`, or
/// `$GPUSNAP_FAKE_PROC` (the host's /proc mounted into a container with a
/// pid namespace of its own, whose own /proc shows only its processes). The
/// real driver is in the kernel and knows every process by its host pid;
/// with the host's /proc the fake does too.
pub fn root() -> &'static str {
    static ROOT: OnceLock<String> = OnceLock::new();
    ROOT.get_or_init(|| std::env::var("GPUSNAP_FAKE_PROC").unwrap_or_else(|_| "/proc".into()))
}

/// What `/proc/PID/stat` says about a task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    /// Field 3: `R`, `S`, `D`, `T` (stopped), `t` (traced), `Z` (zombie), ...
    pub state: char,
    /// Field 22, in clock ticks since boot.
    pub start_time: u64,
}

impl Stat {
    /// Stopped by a signal or held in a ptrace stop: the real driver's calls
    /// into such a process hang.
    /// Stopped by a signal (SIGSTOP, group-stop): the real driver hangs on
    /// such a process. A thread held in a ptrace stop (`t`, as the guard
    /// holds a dying one) does not make it hang (measured on r580).
    pub fn is_stopped(&self) -> bool {
        self.state == 'T'
    }

    /// Exited but not reaped: holds no GPU memory and answers no driver call.
    pub fn is_dead(&self) -> bool {
        matches!(self.state, 'Z' | 'X' | 'x')
    }
}

/// Reads `/proc/PID/stat`; `None` when there is no such task. Thread ids work
/// too: `/proc/TID` exists for every thread although it is not listed.
pub fn stat(pid: i32) -> Option<Stat> {
    if pid <= 0 {
        return None;
    }
    parse_stat(&fs::read_to_string(format!("{}/{pid}/stat", root())).ok()?)
}

/// Parses a stat line. The command name (field 2) may hold spaces and
/// parentheses, so the fields are counted from its last `)`.
pub fn parse_stat(line: &str) -> Option<Stat> {
    let rest = &line[line.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    // Field 3 was the state; field 22 is 19 further on.
    let start_time = fields.nth(18)?.parse().ok()?;
    Some(Stat { state, start_time })
}

/// The process (thread group) a task id belongs to, from
/// `/proc/TID/status`; `None` when there is no such task.
pub fn tgid(tid: i32) -> Option<i32> {
    if tid <= 0 {
        return None;
    }
    let status = fs::read_to_string(format!("{}/{tid}/status", root())).ok()?;
    status.lines().find_map(|l| l.strip_prefix("Tgid:")).and_then(|v| v.trim().parse().ok())
}

/// Whether `pid` is still the process that started at `start_time` and has
/// not exited.
/// This process's pid as /proc (and so the checkpoint API's callers) see
/// it. In a pid namespace whose /proc is the host's, getpid() says the
/// namespace's pid while the driver is called with the host's; the kernel
/// driver knows its processes by task, so the fake follows /proc.
pub fn self_pid() -> i32 {
    std::fs::read_link(format!("{}/self", root()))
        .ok()
        .and_then(|p| p.to_str()?.parse().ok())
        .unwrap_or(std::process::id() as i32)
}

/// Whether /proc shows the calling process in a pid namespace below the one
/// /proc belongs to (NSpid has more than one pid): a container whose /proc
/// is the host's.
pub fn in_child_pid_namespace() -> bool {
    fs::read_to_string(format!("{}/self/status", root())).ok().and_then(|s| {
        s.lines().find_map(|l| l.strip_prefix("NSpid:")).map(|v| v.split_whitespace().count() > 1)
    }) == Some(true)
}

/// The calling thread's id as /proc sees it (see [`self_pid`]), from
/// `/proc/thread-self` (`PID/task/TID`).
pub fn self_tid() -> i32 {
    std::fs::read_link(format!("{}/thread-self", root()))
        .ok()
        .and_then(|p| p.file_name()?.to_str()?.parse().ok())
        .unwrap_or_else(|| nix::unistd::gettid().as_raw())
}

/// Whether this process shares the initial time namespace. A CRIU-restored
/// process gets a time namespace whose clocks are offset to continue from the
/// dump: its /proc/self/timens_offsets is not all zeros. (Comparing with
/// /proc/1/ns/time is not enough: pid 1's namespace links can be unreadable
/// in a container, as on this project's CI.)
pub fn in_initial_time_namespace() -> bool {
    if let Ok(s) = std::fs::read_to_string("/proc/self/timens_offsets") {
        return offsets_are_zero(&s);
    }
    match (std::fs::read_link("/proc/self/ns/time"), std::fs::read_link("/proc/1/ns/time")) {
        (Ok(a), Ok(b)) => a == b,
        _ => true,
    }
}

fn offsets_are_zero(s: &str) -> bool {
    s.lines().flat_map(|l| l.split_whitespace().skip(1)).all(|n| n == "0")
}

pub fn is_same_live_process(pid: i32, start_time: u64) -> bool {
    stat(pid).is_some_and(|s| s.start_time == start_time && !s.is_dead())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_namespace_offsets() {
        assert!(offsets_are_zero("monotonic           0         0\nboottime            0         0\n"));
        assert!(!offsets_are_zero("monotonic          -8 397967774\nboottime           -8 397963055\n"));
    }

    #[test]
    fn parses_names_with_spaces_and_parens() {
        let line = "1234 (a b) (c)) S 1 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 98765 1000 100 18446744073709551615";
        assert_eq!(parse_stat(line), Some(Stat { state: 'S', start_time: 98765 }));
        assert_eq!(parse_stat("1 (x) R 1"), None);
    }

    #[test]
    fn reads_this_process() {
        let me = std::process::id() as i32;
        let st = stat(me).unwrap();
        assert!(!st.is_stopped() && !st.is_dead());
        assert_eq!(tgid(me), Some(me));
        assert!(is_same_live_process(me, st.start_time));
        assert!(!is_same_live_process(me, st.start_time + 1));
        assert_eq!(stat(-5), None);
        assert_eq!(tgid(0), None);
    }

    #[test]
    fn a_thread_id_leads_to_its_process() {
        let me = std::process::id() as i32;
        let tid = std::thread::spawn(|| {
            let tid = nix::unistd::gettid().as_raw();
            (tid, tgid(tid))
        })
        .join()
        .unwrap();
        assert_ne!(tid.0, me);
        assert_eq!(tid.1, Some(me));
        let other = std::thread::spawn(|| (self_tid(), nix::unistd::gettid().as_raw())).join().unwrap();
        assert_eq!(other.0, other.1);
        assert_ne!(other.0, me);
    }
}
