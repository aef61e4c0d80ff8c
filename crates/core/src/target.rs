//! Process identity: a target is a pid *and* its start time, so that a pid
//! reused by another program is never mistaken for the process gpusnap saw.

use crate::error::Error;
use procfs::process::Process;
use procfs::ProcError;
use serde::Serialize;
use std::path::Path;

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Target {
    pub pid: i32,
    /// Clock ticks after boot (field 22 of /proc/PID/stat).
    pub start_time: u64,
    pub comm: String,
    pub uid: u32,
}

/// The scheduler state letter, as /proc/PID/stat has it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunState(pub char);

impl RunState {
    /// `T` (stopped by a signal) or `t` (stopped by a tracer): the driver's
    /// checkpoint calls hang on such a process, ignoring their timeout.
    pub fn is_stopped(self) -> bool {
        matches!(self.0, 'T' | 't')
    }
    pub fn is_zombie(self) -> bool {
        matches!(self.0, 'Z' | 'X')
    }
}

fn proc_err(pid: i32, e: ProcError) -> Error {
    match e {
        ProcError::NotFound(_) => Error::NoProcess { pid },
        ProcError::PermissionDenied(_) => Error::Permission { pid },
        other => Error::Proc { pid, reason: other.to_string() },
    }
}

/// Looks `pid` up and checks that it is a process gpusnap may act on.
///
/// Thread ids are refused with the process they belong to: the driver accepts
/// a tid as if it were the process (measured on r580), which would make the
/// journal lie about whom it acted on.
pub fn resolve(pid: i32) -> Result<Target, Error> {
    if pid <= 0 {
        return Err(Error::BadPid { pid });
    }
    let p = Process::new(pid).map_err(|e| proc_err(pid, e))?;
    let status = p.status().map_err(|e| proc_err(pid, e))?;
    if status.tgid != pid {
        return Err(Error::Thread { tid: pid, pid: status.tgid });
    }
    let stat = p.stat().map_err(|e| proc_err(pid, e))?;
    let t = Target { pid, start_time: stat.starttime, comm: stat.comm.clone(), uid: status.euid };
    let rs = RunState(stat.state);
    if rs.is_zombie() {
        return Err(Error::Zombie { pid, comm: t.comm });
    }
    check_permission(&t)?;
    Ok(t)
}

/// How process `pid` ended, for a zombie (its wait status, which
/// /proc/PID/stat keeps until it is reaped): "killed by SIGSEGV (core
/// dumped)", "exited with status 3"; once it is reaped (by its init, if
/// CRIU's restore left it an orphan), only that.
pub fn how_it_ended(pid: i32) -> String {
    let status = Process::new(pid).and_then(|p| p.stat()).ok().and_then(|s| s.exit_code);
    match status {
        None => "reaped before gpusnap saw how it ended: see the kernel log for a segfault".into(),
        Some(st) if st & 0x7f != 0 => {
            let sig = nix::sys::signal::Signal::try_from(st & 0x7f)
                .map_or_else(|_| format!("signal {}", st & 0x7f), |s| s.as_str().to_string());
            format!("killed by {sig}{}", if st & 0x80 != 0 { " (core dumped)" } else { "" })
        }
        Some(st) => format!("exited with status {}", (st >> 8) & 0xff),
    }
}

/// Like [`resolve`], and also refuses a stopped process: call this right
/// before every driver call.
pub fn resolve_callable(pid: i32) -> Result<Target, Error> {
    let t = resolve(pid)?;
    let st = run_state(pid)?;
    if st.is_stopped() {
        return Err(Error::Stopped { pid, comm: t.comm, state: st.0 });
    }
    if let Some(cgroup) = crate::container::frozen(pid) {
        return Err(Error::Frozen { pid, comm: t.comm, cgroup });
    }
    Ok(t)
}

pub fn run_state(pid: i32) -> Result<RunState, Error> {
    let p = Process::new(pid).map_err(|e| proc_err(pid, e))?;
    Ok(RunState(p.stat().map_err(|e| proc_err(pid, e))?.state))
}

/// The driver needs ptrace-level access to the target (root, or
/// CAP_SYS_PTRACE over a process of another user).
fn check_permission(t: &Target) -> Result<(), Error> {
    let euid = nix::unistd::geteuid().as_raw();
    if euid == 0 || euid == t.uid {
        return Ok(());
    }
    Err(Error::Permission { pid: t.pid })
}

/// Whether the process `t` named is still the one running under its pid.
/// A zombie counts as gone: it holds no memory and only waits to be reaped.
///
/// Gone means the kernel said so: no such process (ENOENT, ESRCH), a zombie,
/// or another start time under the pid. Any other failure to read /proc (out
/// of file descriptors, EMFILE; out of memory) says nothing about the
/// process, which then counts as alive: taking a live server for dead would
/// start a second one beside it.
pub fn is_alive(t: &Target) -> bool {
    match Process::new(t.pid).and_then(|p| p.stat()) {
        Ok(s) => s.starttime == t.start_time && !RunState(s.state).is_zombie(),
        Err(e) => !proves_gone(&e),
    }
}

/// Whether a failed /proc read proves the process is gone (ENOENT, ESRCH).
pub fn proves_gone(e: &ProcError) -> bool {
    match e {
        ProcError::NotFound(_) => true,
        ProcError::Io(io, _) => {
            matches!(io.raw_os_error(), Some(libc::ENOENT) | Some(libc::ESRCH))
                || io.kind() == std::io::ErrorKind::NotFound
        }
        _ => false,
    }
}

/// What a process runs and where its clocks come from: enough to tell the
/// process CRIU restored under a recorded pid (same program, new start time)
/// from another program that was handed that pid.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fingerprint {
    /// The target of /proc/PID/exe.
    pub exe: Option<String>,
    /// /proc/PID/cmdline as it is (NUL-separated).
    pub cmdline: Option<Vec<u8>>,
    /// The target of /proc/PID/ns/time (`time:[INODE]`). CRIU restores a
    /// tree into a time namespace of its own (so that its clocks go on from
    /// the dump) wherever the kernel has them, so a restored process never
    /// shares the namespace the recorded one had, and a program that merely
    /// got the pid usually does.
    pub timens: Option<String>,
}

pub fn fingerprint(pid: i32) -> Fingerprint {
    let link = |what: &str| {
        std::fs::read_link(format!("/proc/{pid}/{what}")).ok().map(|p| p.to_string_lossy().into_owned())
    };
    Fingerprint {
        exe: link("exe"),
        cmdline: std::fs::read(format!("/proc/{pid}/cmdline")).ok().filter(|c| !c.is_empty()),
        timens: link("ns/time"),
    }
}

impl Fingerprint {
    /// Whether `now` (a live process under the pid this one was recorded
    /// for) can be the recorded process brought back by CRIU: the same
    /// executable and command line, and not the time namespace the recorded
    /// one lived in. Unknown executable or command line: no.
    pub fn restored_as(&self, now: &Fingerprint) -> Result<(), String> {
        match (&self.exe, &now.exe) {
            (Some(a), Some(b)) if a == b => {}
            (Some(a), Some(b)) => return Err(format!("it runs {b}, not {a}")),
            _ => return Err("its executable is unknown".into()),
        }
        match (&self.cmdline, &now.cmdline) {
            (Some(a), Some(b)) if a == b => {}
            (Some(_), Some(_)) => return Err("its command line differs".into()),
            _ => return Err("its command line is unknown".into()),
        }
        if let (Some(a), Some(b)) = (&self.timens, &now.timens) {
            if a == b {
                return Err(format!(
                    "it shares the recorded process's time namespace ({a}), which a CRIU restore would not"
                ));
            }
        }
        Ok(())
    }
}

/// The pid `pid` has inside its own pid namespace, when that namespace is
/// below the one gpusnap sees it from (a container's): the last field of
/// `NSpid` in /proc/PID/status. CRIU restores a container's tree into a new
/// pid namespace with the same pids inside it, while the host pid changes.
pub fn ns_pid(pid: i32) -> Option<i32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_ns_pid(&status)
}

fn parse_ns_pid(status: &str) -> Option<i32> {
    let line = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
    let pids: Vec<i32> = line.split_whitespace().filter_map(|p| p.parse().ok()).collect();
    (pids.len() > 1).then(|| pids.last().copied()).flatten()
}

/// Resident memory in bytes (VmRSS), used to show checkpoint progress: the
/// driver copies device memory into the target's own address space.
pub fn rss_bytes(pid: i32) -> Option<u64> {
    Process::new(pid).ok()?.status().ok()?.vmrss.map(|kb| kb * 1024)
}

/// Every process whose address space maps the CUDA driver library: the
/// candidates for `ps`, including suspended ones that NVML no longer lists.
pub fn processes_mapping_libcuda() -> Vec<i32> {
    let Ok(all) = procfs::process::all_processes() else { return Vec::new() };
    all.filter_map(Result::ok).filter(maps_libcuda).map(|p| p.pid).collect()
}

/// Whether `pid` has the CUDA driver library mapped (it may hold CUDA state).
pub fn pid_maps_libcuda(pid: i32) -> bool {
    Process::new(pid).is_ok_and(|p| maps_libcuda(&p))
}

fn maps_libcuda(p: &Process) -> bool {
    p.maps().is_ok_and(|maps| {
        maps.iter().any(|m| match &m.pathname {
            procfs::process::MMapPath::Path(path) => {
                path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libcuda.so"))
            }
            _ => false,
        })
    })
}

/// Whether the leader of `pid`'s session is visible in `pid`'s own pid
/// namespace (the last field of NSsid is not 0). CRIU refuses to dump a
/// process whose session leader is outside its namespace ("A session leader
/// of N is outside of its pid namespace"): a program started without a
/// session of its own under a container's exec, for instance. `None` when
/// the kernel does not say (no NSsid before Linux 4.1).
pub fn session_leader_visible(pid: i32) -> Option<bool> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    session_visible_in(&s)
}

/// [`session_leader_visible`] for the calling process (through /proc/self,
/// right even where getpid() and the /proc mount disagree on the namespace).
pub fn session_leader_visible_self() -> Option<bool> {
    session_visible_in(&std::fs::read_to_string("/proc/self/status").ok()?)
}

/// Gives the program `cmd` starts a session of its own where this
/// process's session leader is outside its pid namespace (a runner started
/// by `docker exec`): CRIU could not dump it otherwise. Where ours is
/// visible the program keeps it, and with it the terminal's job control.
pub fn own_session_where_needed(cmd: &mut std::process::Command) {
    if session_leader_visible_self() == Some(false) {
        use std::os::unix::process::CommandExt;
        // SAFETY: setsid is async-signal-safe and touches no memory.
        unsafe {
            cmd.pre_exec(|| {
                libc::setsid();
                Ok(())
            });
        }
    }
}

pub fn session_visible_in(status: &str) -> Option<bool> {
    let sid: i32 =
        status.lines().find_map(|l| l.strip_prefix("NSsid:"))?.split_whitespace().last()?.parse().ok()?;
    Some(sid != 0)
}

/// Every process in cgroup `path` (v2) and its descendants. `path` is
/// absolute, or relative to /sys/fs/cgroup.
pub fn cgroup_processes(path: &Path) -> Result<Vec<i32>, Error> {
    let root = if path.is_absolute() { path.to_path_buf() } else { Path::new("/sys/fs/cgroup").join(path) };
    if !root.join("cgroup.procs").is_file() {
        return Err(Error::NoCgroup { path: root.display().to_string() });
    }
    let mut out = Vec::new();
    let mut dirs = vec![root];
    while let Some(d) = dirs.pop() {
        if let Ok(s) = std::fs::read_to_string(d.join("cgroup.procs")) {
            out.extend(s.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
        }
        if let Ok(rd) = std::fs::read_dir(&d) {
            dirs.extend(rd.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.is_dir()));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn self_resolves() {
        let me = std::process::id() as i32;
        let t = resolve(me).unwrap();
        assert_eq!(t.pid, me);
        assert!(is_alive(&t));
    }

    #[test]
    fn the_pid_inside_a_namespace_is_the_last_of_nspid() {
        assert_eq!(parse_ns_pid("Name:\tx\nNSpid:\t4242\t17\t1\n"), Some(1));
        assert_eq!(parse_ns_pid("NSpid:\t4242\n"), None);
        assert_eq!(parse_ns_pid("Name:\tx\n"), None);
    }

    #[test]
    fn only_the_kernel_saying_no_such_process_proves_death() {
        let io = |n| ProcError::Io(std::io::Error::from_raw_os_error(n), None);
        assert!(proves_gone(&ProcError::NotFound(None)));
        assert!(proves_gone(&io(libc::ESRCH)));
        assert!(proves_gone(&io(libc::ENOENT)));
        assert!(!proves_gone(&io(libc::EMFILE)));
        assert!(!proves_gone(&io(libc::ENOMEM)));
        assert!(!proves_gone(&ProcError::PermissionDenied(None)));
    }

    #[test]
    fn a_thread_is_named_with_its_process() {
        let (tx, rx) = std::sync::mpsc::channel();
        let h = std::thread::spawn(move || {
            tx.send(nix::unistd::gettid().as_raw()).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(300));
        });
        let tid = rx.recv().unwrap();
        let err = resolve(tid).unwrap_err();
        assert!(err.to_string().contains("is a thread of"), "{err}");
        h.join().unwrap();
    }

    #[test]
    fn a_session_leader_outside_the_namespace_is_seen() {
        assert_eq!(session_visible_in("Name:\tx\nNSsid:\t6774\t0\n"), Some(false));
        assert_eq!(session_visible_in("Name:\tx\nNSsid:\t6774\n"), Some(true));
        assert_eq!(session_visible_in("Name:\tx\n"), None);
    }

    #[test]
    fn dead_and_bad_pids() {
        assert!(matches!(resolve(0), Err(Error::BadPid { .. })));
        assert!(matches!(resolve(i32::MAX), Err(Error::NoProcess { .. })));
    }
}
