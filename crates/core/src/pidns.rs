//! Pids across pid namespaces. A process in a container with a pid
//! namespace of its own knows its server as pid 1; the driver, the store
//! and the agent know it by its pid in the namespace they see it from.

use std::path::Path;

/// The initial pid namespace's inode (`PROC_PID_INIT_INO` in the kernel):
/// the same on every Linux.
const INITIAL: &str = "pid:[4026531836]";

/// The pid namespace of process `pid` (`/proc/PID/ns/pid`), as its link
/// names it: `pid:[INODE]`.
pub fn of(pid: i32) -> Option<String> {
    link(&format!("/proc/{pid}/ns/pid"))
}

fn link(path: &str) -> Option<String> {
    std::fs::read_link(path).ok()?.to_str().map(str::to_owned)
}

/// Whether this process lives in the host's pid namespace, where the driver's
/// and the store's pids are the ones /proc shows.
pub fn in_initial() -> bool {
    link("/proc/self/ns/pid").as_deref() == Some(INITIAL)
}

/// The pid, as this process sees it, of the process that has pid `pid`
/// in the pid namespace of process `caller` (`caller` as this process sees
/// it). `None` when there is none, or when `caller`'s namespace cannot be
/// read. In this process's own namespace, `pid` itself.
pub fn translate(caller: i32, pid: i32) -> Option<i32> {
    find_in(&of(caller)?, pid)
}

/// The pid, as this process sees it, of the process that has pid `pid` in
/// pid namespace `ns` (`pid:[INODE]`, as [`of`] names it), and lives in
/// that very namespace (not in one nested below it). In this process's own
/// namespace, `pid` itself.
pub fn find_in(ns: &str, pid: i32) -> Option<i32> {
    if pid <= 0 {
        return None;
    }
    if link("/proc/self/ns/pid").as_deref() == Some(ns) {
        return Path::new(&format!("/proc/{pid}")).exists().then_some(pid);
    }
    let entries = std::fs::read_dir("/proc").ok()?;
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .find(|&p| crate::target::ns_pid(p) == Some(pid) && of(p).as_deref() == Some(ns))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_names_itself_in_its_own_namespace() {
        let me = std::process::id() as i32;
        assert_eq!(translate(me, me), Some(me));
        assert!(of(me).is_some_and(|ns| ns.starts_with("pid:[")));
        assert_eq!(translate(me, i32::MAX), None);
        assert_eq!(translate(-1, me), None);
    }
}
