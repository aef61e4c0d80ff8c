//! The guard: a dying CUDA process is suspended before it dies.
//!
//! Killing a restored CUDA process, or having it crash, can hang a whole host
//! (report 004); suspending its CUDA state first prevents that. The guard is
//! the tracer of the guarded processes (every thread, every child):
//! - at a **signal-delivery-stop** of a signal that will kill the process
//!   (default action terminate or core, no handler installed), it suspends the
//!   process's CUDA state, then delivers the signal unchanged;
//! - at the **seccomp stop of `exit_group`** (filter installed by `gpusnap
//!   run` before exec, see [`seccomp`]), it suspends, then lets the exit run
//!   with the program's own code.
//!
//! All other stops pass through untouched. Exits are caught *before*
//! `exit_group` runs: at PTRACE_EVENT_EXIT the driver's threads are gone and
//! its calls hang (measured on r580). SIGKILL cannot be caught at all.
//!
//! The guard never uses PTRACE_O_EXITKILL: if it dies, the kernel detaches it
//! and the programs run on. Its keeper (a small standby process) then starts
//! a new guard that re-attaches, so that exits are caught again (a RET_TRACE
//! filter with no tracer would fail `exit_group` with ENOSYS).

pub mod light;
pub mod seccomp;

use gpusnap_core::error::Error;
use gpusnap_core::store::Store;
use gpusnap_core::target::{self, Target};
use gpusnap_cuda::ffi::CUDA_ERROR_NOT_INITIALIZED;
use gpusnap_cuda::{CheckpointApi, Deadline, ProcessState};
use gpusnap_gpu::GpuInventory;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ffi::{CString, OsString};
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const PTRACE_EVENT_STOP: i32 = 128;
const PTRACE_EVENT_SECCOMP: i32 = 7;

/// What the guarded program's main process ended with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    Exited(i32),
    Signaled(i32),
    /// Detached for `hibernate`: the tree lives on in an image.
    Detached,
}

/// The guard's record of whom it guards, for `hibernate` (to ask it to let
/// go) and for its keeper (to re-attach a new guard if it dies).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GuardFile {
    pub guard_pid: i32,
    pub name: Option<String>,
    pub leader: i32,
    pub processes: Vec<i32>,
    pub socket: PathBuf,
}

impl GuardFile {
    /// Writes the record at `path` under a temporary name and renames it:
    /// a reader (hibernate, a keeper) never sees half of one.
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_vec(self).map_err(std::io::Error::other)?)?;
        std::fs::rename(&tmp, path)
    }
}

pub fn guards_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("guards")
}

/// Creates `dir` (the guards' sockets live there) readable by its owner
/// only, and checks an existing one: a socket is bound before its mode can
/// be set, so the directory is what keeps other users out.
pub fn private_dir(dir: &Path) -> Result<(), Error> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    let fail = |why: String| Error::Proc {
        pid: std::process::id() as i32,
        reason: format!("{}: {why}", dir.display()),
    };
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent).map_err(|e| fail(e.to_string()))?;
    }
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(fail(e.to_string())),
    }
    let m = std::fs::symlink_metadata(dir).map_err(|e| fail(e.to_string()))?;
    if !m.is_dir() {
        return Err(fail("not a directory".into()));
    }
    let me = nix::unistd::geteuid().as_raw();
    if m.uid() != me {
        return Err(fail(format!("owned by uid {}, not by this user ({me})", m.uid())));
    }
    if m.mode() & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| fail(e.to_string()))?;
    }
    Ok(())
}

/// Every live guard's record.
pub fn live_guards(state_dir: &Path) -> Vec<GuardFile> {
    let Ok(rd) = std::fs::read_dir(guards_dir(state_dir)) else { return Vec::new() };
    rd.filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
        .filter_map(|e| serde_json::from_slice::<GuardFile>(&std::fs::read(e.path()).ok()?).ok())
        .filter(|g| Path::new(&format!("/proc/{}", g.guard_pid)).exists())
        .collect()
}

/// Asks the guards of `pids` to detach from them (before CRIU seizes the
/// tree). Returns the pids that were guarded.
pub fn detach_for(state_dir: &Path, pids: &[i32]) -> Result<Vec<i32>, Error> {
    let mut out = Vec::new();
    for g in live_guards(state_dir) {
        let mine: Vec<i32> = pids.iter().copied().filter(|p| g.processes.contains(p)).collect();
        if mine.is_empty() {
            continue;
        }
        let fail = |why: String| Error::Proc {
            pid: g.guard_pid,
            reason: format!("cannot ask the guard to detach: {why}"),
        };
        let mut s = UnixStream::connect(&g.socket).map_err(|e| fail(e.to_string()))?;
        s.set_read_timeout(Some(Duration::from_secs(30))).ok();
        let line = format!("detach {}\n", mine.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(" "));
        s.write_all(line.as_bytes()).map_err(|e| fail(e.to_string()))?;
        let mut reply = String::new();
        BufReader::new(&s).read_line(&mut reply).map_err(|e| fail(e.to_string()))?;
        if reply.trim() != "ok" {
            return Err(fail(reply.trim().to_string()));
        }
        out.extend(mine);
    }
    Ok(out)
}

/// The process's threads (task ids).
pub fn threads_of(pid: i32) -> Vec<i32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|rd| rd.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect())
        .unwrap_or_default()
}

fn tgid_of(tid: i32) -> Option<i32> {
    procfs::process::Process::new(tid).ok()?.status().ok().map(|s| s.tgid)
}

/// Signals whose default action ends the process (terminate or core dump).
fn kills_by_default(sig: i32) -> bool {
    !matches!(
        sig,
        libc::SIGCHLD
            | libc::SIGCONT
            | libc::SIGURG
            | libc::SIGWINCH
            | libc::SIGSTOP
            | libc::SIGTSTP
            | libc::SIGTTIN
            | libc::SIGTTOU
    ) && sig > 0
        && sig != libc::SIGKILL
}

/// Whether `sig`, delivered to thread `tid` now, will end its process: the
/// default action kills and no handler is installed (SigCgt) and it is not
/// ignored (SigIgn). A synchronous fault (SEGV, BUS, ILL, FPE) on an ignored
/// or blocked signal is forced to its default by the kernel, so it kills too.
fn is_fatal(tid: i32, sig: i32) -> bool {
    if !kills_by_default(sig) {
        return false;
    }
    let Ok(status) = std::fs::read_to_string(format!("/proc/{tid}/status")) else { return false };
    let mask = |key: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .unwrap_or(0)
    };
    let bit = 1u64 << (sig - 1);
    if mask("SigCgt:") & bit != 0 {
        return false;
    }
    let fault = matches!(sig, libc::SIGSEGV | libc::SIGBUS | libc::SIGILL | libc::SIGFPE);
    fault || mask("SigIgn:") & bit == 0
}

/// The si_code and sender pid of the signal thread `tid` is stopped for
/// (the pid is 0 unless the code is one of a sent signal).
fn siginfo(tid: i32) -> Option<(i32, i32)> {
    // SAFETY: siginfo_t is plain data; PTRACE_GETSIGINFO fills it for a
    // tracee in a signal-delivery-stop.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above; the pointer is valid for the call.
    let r = unsafe {
        libc::ptrace(
            libc::PTRACE_GETSIGINFO,
            tid,
            std::ptr::null_mut::<libc::c_void>(),
            &mut info as *mut libc::siginfo_t,
        )
    };
    if r != 0 {
        return None;
    }
    // SI_USER (0), SI_QUEUE (-1), SI_TKILL (-6): sent by a process; for
    // these codes the kill fields are the valid ones.
    // SAFETY: as said.
    let from = if matches!(info.si_code, 0 | -1 | -6) { unsafe { info.si_pid() } } else { 0 };
    Some((info.si_code, from))
}

/// How a signal came, by si_code (the kernel's word), never by the sender's
/// pid alone: 0 is the kernel's and also any sender's in another pid
/// namespace (a container's SIGTERM). The preload library
/// (crates/preload) decides the same way; it cannot share this code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    /// A fault of the stopped thread (SEGV, BUS, ILL, FPE, TRAP, SYS with a
    /// kernel code): it stands at a known instruction.
    Fault,
    /// Sent by the process to itself: `raise`, `abort`, the kernel's
    /// SIGPIPE for its own write.
    Own,
    /// Another process's `kill` (any namespace, `gpusnap run` forwarding
    /// one), a terminal's Ctrl-C or hang-up, `alarm`, SIGXCPU, a timer: the
    /// thread may have been stopped anywhere, even inside a driver call.
    Async,
}

fn origin(sig: i32, code: i32, sender: i32, pid: i32) -> Origin {
    let fault_sig = matches!(
        sig,
        libc::SIGSEGV | libc::SIGBUS | libc::SIGILL | libc::SIGFPE | libc::SIGTRAP | libc::SIGSYS
    );
    if code > 0 {
        return if fault_sig { Origin::Fault } else { Origin::Async };
    }
    if matches!(code, 0 | -1 | -6) && sender == pid && pid > 0 {
        return Origin::Own;
    }
    Origin::Async
}

enum Refused {
    /// Traced by this thread already.
    Ours,
    /// Exiting or gone.
    Ending,
    /// Traced by someone else, or not ours to trace.
    Other,
}

/// Why a PTRACE_SEIZE of `tid` answered EPERM. A thread of a program that
/// keeps making short-lived ones may be between its exit and its
/// disappearance from /proc, where the kernel refuses it and /proc still
/// shows it untraced; asked again a moment later it is gone.
fn seize_refused(tid: i32) -> Refused {
    // SAFETY: gettid has no preconditions.
    let me = unsafe { libc::gettid() };
    for _ in 0..20 {
        let Ok(status) = std::fs::read_to_string(format!("/proc/{tid}/status")) else {
            return Refused::Ending;
        };
        let field = |key: &str| status.lines().find_map(|l| l.strip_prefix(key)).map(str::trim).unwrap_or("");
        if matches!(field("State:").chars().next(), Some('Z' | 'X')) {
            return Refused::Ending;
        }
        match field("TracerPid:").parse::<i32>() {
            Ok(t) if t == me => return Refused::Ours,
            Ok(0) => {}
            _ => return Refused::Other,
        }
        std::thread::sleep(Duration::from_millis(1));
        match seize(tid).map_err(|e| e.raw_os_error()) {
            Ok(()) => return Refused::Ours,
            Err(Some(libc::ESRCH)) => return Refused::Ending,
            Err(_) => {}
        }
    }
    Refused::Other
}

/// One decoded waitpid status.
#[derive(Debug)]
enum Event {
    Exited(i32, i32),
    Signaled(i32, i32),
    /// A signal-delivery-stop.
    Signal(i32, i32),
    /// A ptrace event stop: (tid, event, stop signal).
    Ptrace(i32, i32, i32),
}

/// What waiting found: an event, nothing yet (or interrupted), or no tracee left.
enum Waited {
    Event(Event),
    Nothing,
    NoChildren,
}

fn wait_event(block: bool) -> Waited {
    let mut status = 0;
    let flags = libc::__WALL | if block { 0 } else { libc::WNOHANG };
    // SAFETY: waitpid writes one int.
    let pid = unsafe { libc::waitpid(-1, &mut status, flags) };
    if pid < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD) {
        return Waited::NoChildren;
    }
    match decode(pid, status) {
        Some(e) => Waited::Event(e),
        None => Waited::Nothing,
    }
}

fn wait_any(block: bool) -> Option<Event> {
    match wait_event(block) {
        Waited::Event(e) => Some(e),
        _ => None,
    }
}

fn decode(pid: i32, status: i32) -> Option<Event> {
    if pid <= 0 {
        return None;
    }
    Some(if libc::WIFEXITED(status) {
        Event::Exited(pid, libc::WEXITSTATUS(status))
    } else if libc::WIFSIGNALED(status) {
        Event::Signaled(pid, libc::WTERMSIG(status))
    } else if libc::WIFSTOPPED(status) {
        let event = (status >> 16) & 0xff;
        let sig = libc::WSTOPSIG(status);
        if event == 0 {
            Event::Signal(pid, sig)
        } else {
            Event::Ptrace(pid, event, sig)
        }
    } else {
        // WIFCONTINUED: nothing to do.
        return None;
    })
}

pub fn ptrace_raw(req: libc::c_uint, tid: i32, data: usize) -> std::io::Result<()> {
    // SAFETY: PTRACE_CONT/LISTEN/SEIZE/DETACH/INTERRUPT take integers only.
    let r =
        unsafe { libc::ptrace(req, tid, std::ptr::null_mut::<libc::c_void>(), data as *mut libc::c_void) };
    if r == -1 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn seize(tid: i32) -> std::io::Result<()> {
    let opts = libc::PTRACE_O_TRACECLONE
        | libc::PTRACE_O_TRACEFORK
        | libc::PTRACE_O_TRACEVFORK
        | libc::PTRACE_O_TRACEEXEC
        | libc::PTRACE_O_TRACESECCOMP;
    ptrace_raw(libc::PTRACE_SEIZE, tid, opts as usize)
}

fn cont(tid: i32, sig: i32) {
    if let Err(e) = ptrace_raw(libc::PTRACE_CONT, tid, sig as usize) {
        tracing::debug!(tid, "PTRACE_CONT: {e}");
    }
}

pub struct Guard<A: CheckpointApi, G: GpuInventory> {
    api: Deadline<A>,
    gpus: Arc<G>,
    store: Store,
    state_dir: PathBuf,
    /// The guarded processes, shared with the out-of-memory watch.
    shared: Arc<Mutex<Vec<i32>>>,
    oom_watch: bool,
    lock_timeout_ms: u32,
    name: Option<String>,
    /// tid -> tgid of every traced thread.
    tids: HashMap<i32, i32>,
    leader: i32,
    ending: Option<Ending>,
    /// Per process being suspended on a thread of its own: what to do when
    /// it is done (the ptrace requests must come from the event loop).
    jobs: HashMap<i32, Vec<After>>,
    /// (pid, signal) the guard sent again after a suspend: the stop they
    /// cause is let through. Anything else sent from this process (the
    /// `run` front end forwarding a SIGTERM) is a death like any other.
    resent: BTreeSet<(i32, i32)>,
    /// Requests and finished suspends for the event loop.
    inbox: Arc<Inbox>,
    /// The process being attached: in the record from before the first
    /// seize, so that a guard killed while it attaches (its keeper fires
    /// as soon as it dies) leaves its keeper something to take over.
    attaching: Option<i32>,
}

/// What the event loop does for a process once its suspend is done.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum After {
    /// Let thread `tid` go on with signal `sig` (0: none): a fault, an own
    /// signal, an `exit_group` held at its stop.
    Cont(i32, i32),
    /// Send `sig` again (it was held back: an asynchronous signal).
    Resend(i32),
}

enum Msg {
    Detach(Detach),
    /// The suspend of this process is done; the process as it was then.
    Suspended(i32, Option<Target>),
}

/// Messages for the event loop, which sleeps in waitpid: each poster
/// interrupts that wait with a signal until its message has been taken, so
/// a message posted just before the loop blocks is not left waiting for
/// the next ptrace event.
#[derive(Default)]
struct Inbox {
    queue: Mutex<Vec<Msg>>,
    posted: std::sync::atomic::AtomicU64,
    taken: std::sync::atomic::AtomicU64,
    /// The event loop's thread (pthread_t), once it runs.
    waiter: std::sync::atomic::AtomicU64,
}

impl Inbox {
    fn post(&self, m: Msg) {
        use std::sync::atomic::Ordering::SeqCst;
        let seq = {
            let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
            q.push(m);
            self.posted.fetch_add(1, SeqCst) + 1
        };
        let end = Instant::now() + Duration::from_secs(60);
        while self.taken.load(SeqCst) < seq && Instant::now() < end {
            let w = self.waiter.load(SeqCst);
            if w != 0 {
                // SAFETY: the event loop's thread, which lives as long as
                // the process; its handler for this signal does nothing.
                unsafe { libc::pthread_kill(w as libc::pthread_t, wakeup_signal()) };
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn take(&self) -> Vec<Msg> {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        let v = std::mem::take(&mut *q);
        self.taken.store(
            self.posted.load(std::sync::atomic::Ordering::SeqCst),
            std::sync::atomic::Ordering::SeqCst,
        );
        v
    }
}

/// Suspends process `pid` (lock with a timeout, checkpoint), journaled, and
/// checks with NVML that its device memory is gone.
fn suspend_now<A: CheckpointApi, G: GpuInventory + ?Sized>(
    api: &Deadline<A>,
    gpus: &G,
    store: &mut Store,
    pid: i32,
    why: &str,
    lock_timeout_ms: u32,
) -> Result<String, Error> {
    // Not resolve_callable: the dying thread sits in a ptrace stop (state
    // t), which the driver tolerates (measured: lock + checkpoint at a
    // signal-delivery-stop and at a seccomp stop both succeed).
    let t: Target = target::resolve(pid)?;
    let _serial = store.lock_target(pid)?;
    let st = match api.get_state(pid) {
        Ok(s) => s,
        Err(e) if e.code() == Some(CUDA_ERROR_NOT_INITIALIZED) => return Ok("no CUDA state".into()),
        Err(e) => return Err(Error::Driver { pid, source: e }),
    };
    match st {
        ProcessState::Checkpointed => return Ok("already suspended".into()),
        ProcessState::Running | ProcessState::Locked => {}
        other => return Ok(format!("driver state {other}; left as it is")),
    }
    let mut fp = BTreeMap::new();
    for u in gpus.usage_of(pid as u32)? {
        *fp.entry(u.uuid).or_insert(0u64) += u.bytes.unwrap_or(0);
    }
    let total: u64 = fp.values().sum();
    store.record(&t, st.as_str(), Some(&fp))?;
    store.note(&t, "guard", None, &format!("dying: {why}"))?;
    if st == ProcessState::Running {
        let id = store.begin(&t, "lock")?;
        let r = api.lock(pid, lock_timeout_ms);
        let msg = r.as_ref().err().map(|e| e.to_string());
        store.end(id, &t, "lock", msg.as_deref().map_or(Ok("locked"), Err))?;
        r.map_err(|source| Error::Driver { pid, source })?;
    }
    let id = store.begin(&t, "checkpoint")?;
    let r = api.checkpoint_within(pid, total);
    let msg = r.as_ref().err().map(|e| e.to_string());
    store.end(id, &t, "checkpoint", msg.as_deref().map_or(Ok("checkpointed"), Err))?;
    r.map_err(|source| Error::Driver { pid, source })?;
    // Check the result: no device memory left (NVML), before the death proceeds.
    let end = Instant::now() + Duration::from_secs(5);
    let released = loop {
        let left: u64 = gpus.usage_of(pid as u32)?.iter().map(|u| u.bytes.unwrap_or(0)).sum();
        if left == 0 {
            break true;
        }
        if Instant::now() > end {
            break false;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let outcome =
        format!("suspended {} MiB{}", total >> 20, if released { "" } else { "; NVML still shows memory" });
    store.note(&t, "guard", Some("checkpointed"), &format!("{outcome} before death ({why})"))?;
    Ok(outcome)
}

/// [`suspend_now`] for a process about to die of `why`; the outcome, good or
/// bad, goes into the journal and the log, and is returned.
pub(crate) fn suspend_before_death<A: CheckpointApi, G: GpuInventory + ?Sized>(
    api: &Deadline<A>,
    gpus: &G,
    store: &mut Store,
    pid: i32,
    why: &str,
    lock_timeout_ms: u32,
) -> String {
    let outcome = suspend_now(api, gpus, store, pid, why, lock_timeout_ms).unwrap_or_else(|e| {
        let msg = format!("could not suspend before death ({why}): {e}");
        if let Ok(t) = target::resolve(pid) {
            let _ = store.note(&t, "guard", None, &msg);
        }
        msg
    });
    tracing::info!(pid, why, outcome = %outcome, "guard");
    outcome
}

/// A request from another gpusnap (hibernate) to the guard's event loop.
struct Detach {
    pids: Vec<i32>,
    /// The asker's connection: the event loop answers on it before it can
    /// end (a reply left to another thread would race with the exit).
    conn: UnixStream,
}

impl<A: CheckpointApi, G: GpuInventory> Guard<A, G> {
    pub fn new(
        api: Deadline<A>,
        gpus: G,
        store: Store,
        state_dir: &Path,
        lock_timeout_ms: u32,
        name: Option<String>,
    ) -> Self {
        Self {
            api,
            gpus: Arc::new(gpus),
            store,
            shared: Arc::new(Mutex::new(Vec::new())),
            oom_watch: false,
            state_dir: state_dir.to_path_buf(),
            lock_timeout_ms,
            name,
            tids: HashMap::new(),
            leader: 0,
            ending: None,
            jobs: HashMap::new(),
            resent: BTreeSet::new(),
            inbox: Arc::new(Inbox::default()),
            attaching: None,
        }
    }

    fn record_file(&self) -> PathBuf {
        guards_dir(&self.state_dir).join(format!("{}.json", std::process::id()))
    }

    fn socket_path(&self) -> PathBuf {
        guards_dir(&self.state_dir).join(format!("{}.sock", std::process::id()))
    }

    fn processes(&self) -> Vec<i32> {
        self.tids.values().copied().chain(self.attaching).collect::<BTreeSet<_>>().into_iter().collect()
    }

    /// Watch the memory cgroups of the guarded processes and suspend them
    /// while there is still room for their device memory in host memory.
    pub fn with_oom_watch(mut self, on: bool) -> Self {
        self.oom_watch = on;
        self
    }

    fn save(&self) {
        if let Ok(mut p) = self.shared.lock() {
            *p = self.processes();
        }
        let g = GuardFile {
            guard_pid: std::process::id() as i32,
            name: self.name.clone(),
            leader: self.leader,
            processes: self.processes(),
            socket: self.socket_path(),
        };
        let _ = g.save(&self.record_file());
    }

    /// Seizes every thread of `pid` (again until no new thread appears).
    pub fn attach(&mut self, pid: i32) -> Result<(), Error> {
        let t = target::resolve(pid)?;
        self.attaching = Some(pid);
        self.save();
        let r = self.seize_all(pid, &t);
        self.attaching = None;
        self.save();
        r
    }

    fn seize_all(&mut self, pid: i32, t: &Target) -> Result<(), Error> {
        loop {
            let mut new = 0;
            for tid in threads_of(pid) {
                if self.tids.contains_key(&tid) {
                    continue;
                }
                match seize(tid).map_err(|e| e.raw_os_error()) {
                    Ok(()) => {
                        self.tids.insert(tid, pid);
                        new += 1;
                    }
                    // Gone between the listing and the seize: nothing to guard.
                    Err(Some(libc::ESRCH)) => {}
                    // Created by a thread already seized, so traced by us
                    // already (PTRACE_O_TRACECLONE), or ending (the kernel
                    // refuses a thread that is exiting). Not counted as
                    // new: a program that keeps making threads would keep
                    // this loop going, and its new threads are ours anyway.
                    Err(Some(libc::EPERM)) => match seize_refused(tid) {
                        Refused::Ours => {
                            self.tids.insert(tid, pid);
                        }
                        Refused::Ending => {}
                        Refused::Other => {
                            return Err(Error::Proc {
                                pid,
                                reason: "cannot trace it (already traced by another tool, or no permission)"
                                    .into(),
                            })
                        }
                    },
                    Err(e) => {
                        let e = std::io::Error::from_raw_os_error(e.unwrap_or(libc::EIO));
                        return Err(Error::Proc {
                            pid,
                            reason: format!("PTRACE_SEIZE of thread {tid}: {e}"),
                        });
                    }
                }
            }
            if new == 0 {
                break;
            }
        }
        self.store.note(t, "guard", None, &format!("guarded by gpusnap {}", std::process::id()))?;
        if self.leader == 0 {
            self.leader = pid;
        }
        Ok(())
    }

    /// Suspends the CUDA state of process `pid` before it dies of `why`.
    /// Suspends process `pid` before it dies of `why`; the outcome, good or
    /// bad, goes into the journal.
    fn suspend_dying(&mut self, pid: i32, why: &str) {
        suspend_before_death(&self.api, &*self.gpus, &mut self.store, pid, why, self.lock_timeout_ms);
    }

    /// Suspends `pid` on a thread of its own, so that the event loop goes
    /// on serving the other stops meanwhile (a thread of the program that
    /// receives a signal or starts a thread must not stay stopped, maybe
    /// holding a lock the suspend waits for); `after` is done when it ends.
    /// A process already being suspended only gets `after` added.
    fn suspend_then(&mut self, pid: i32, why: String, after: After) {
        if let Some(list) = self.jobs.get_mut(&pid) {
            if !list.contains(&after) {
                list.push(after);
            }
            return;
        }
        self.jobs.insert(pid, vec![after]);
        let (api, gpus, dir, lt, inbox) = (
            self.api.clone(),
            Arc::clone(&self.gpus),
            self.state_dir.clone(),
            self.lock_timeout_ms,
            Arc::clone(&self.inbox),
        );
        // Taken now: a re-sent signal must reach this process, not one that
        // took its pid during a long suspend.
        let who = target::resolve(pid).ok();
        std::thread::spawn(move || {
            match Store::open(&dir) {
                Ok(mut store) => {
                    suspend_before_death(&api, &*gpus, &mut store, pid, &why, lt);
                }
                Err(e) => tracing::error!(pid, why, "guard: no journal, nothing suspended: {e}"),
            }
            inbox.post(Msg::Suspended(pid, who));
        });
    }

    /// A suspend is done: the held threads go on, held-back signals go again.
    fn suspended(&mut self, pid: i32, who: Option<Target>) {
        for after in self.jobs.remove(&pid).unwrap_or_default() {
            match after {
                After::Cont(tid, sig) => cont(tid, sig),
                After::Resend(sig) => {
                    if who.as_ref().is_some_and(target::is_alive) {
                        self.resent.insert((pid, sig));
                        // SAFETY: kill with a signal number we were given.
                        unsafe { libc::kill(pid, sig) };
                    }
                }
            }
        }
    }

    fn held(&self) -> BTreeSet<i32> {
        self.jobs
            .values()
            .flatten()
            .filter_map(|a| match a {
                After::Cont(tid, _) => Some(*tid),
                After::Resend(_) => None,
            })
            .collect()
    }

    fn on_gone(&mut self, tid: i32, ending: Ending) {
        self.tids.remove(&tid);
        if tid == self.leader && self.ending.is_none() {
            self.ending = Some(ending);
        }
    }

    fn handle(&mut self, ev: Event) {
        match ev {
            Event::Exited(tid, code) => self.on_gone(tid, Ending::Exited(code)),
            Event::Signaled(tid, sig) => self.on_gone(tid, Ending::Signaled(sig)),
            Event::Signal(tid, sig) => {
                self.adopt(tid);
                let Some(&pid) = self.tids.get(&tid) else {
                    cont(tid, sig);
                    return;
                };
                if !is_fatal(tid, sig) {
                    cont(tid, sig);
                    return;
                }
                let (code, from) = siginfo(tid).unwrap_or((0, 0));
                // Our own re-sent signal: the process is suspended already.
                // Not told by the sender pid: seen from a tracee in another
                // pid namespace the guard's pid reads 0, and whatever else
                // kills it now kills a suspended process.
                if self.resent.remove(&(pid, sig)) {
                    cont(tid, sig);
                    return;
                }
                match origin(sig, code, from, pid) {
                    // The thread may have been stopped anywhere, even inside
                    // a driver call holding the driver's locks. Hold the
                    // signal back, suspend the process while it runs, then
                    // send the signal again.
                    Origin::Async => {
                        cont(tid, 0);
                        let why = if from > 0 {
                            format!("signal {} from pid {from}", signal_name(sig))
                        } else {
                            format!("signal {}", signal_name(sig))
                        };
                        self.suspend_then(pid, why, After::Resend(sig));
                    }
                    // A fault or the process's own raise()/abort(): the thread
                    // stands at a known point; suspend with it held.
                    Origin::Fault | Origin::Own => {
                        self.suspend_then(pid, format!("signal {}", signal_name(sig)), After::Cont(tid, sig));
                    }
                }
            }
            Event::Ptrace(tid, event, sig) => {
                self.adopt(tid);
                match event {
                    PTRACE_EVENT_SECCOMP => match self.tids.get(&tid) {
                        Some(&pid) => self.suspend_then(pid, "exit_group".into(), After::Cont(tid, 0)),
                        None => cont(tid, 0),
                    },
                    PTRACE_EVENT_STOP => {
                        if matches!(sig, libc::SIGSTOP | libc::SIGTSTP | libc::SIGTTIN | libc::SIGTTOU) {
                            // A group-stop: keep it stopped as it would be
                            // untraced, but let SIGCONT wake it.
                            if let Err(e) = ptrace_raw(libc::PTRACE_LISTEN, tid, 0) {
                                tracing::debug!(tid, "PTRACE_LISTEN: {e}");
                            }
                        } else {
                            cont(tid, 0);
                        }
                    }
                    _ => {
                        if event == libc::PTRACE_EVENT_EXEC {
                            // The leader's tid survives exec; other threads vanish.
                            if let Some(&pid) = self.tids.get(&tid) {
                                self.tids.retain(|t, p| {
                                    *p != pid || *t == tid || Path::new(&format!("/proc/{t}")).exists()
                                });
                            }
                        }
                        cont(tid, 0);
                    }
                }
            }
        }
    }

    /// A tid reported by waitpid that we have not seen: a new thread or child.
    fn adopt(&mut self, tid: i32) {
        if self.tids.contains_key(&tid) {
            return;
        }
        if let Some(tgid) = tgid_of(tid) {
            let new_process = !self.tids.values().any(|p| *p == tgid);
            self.tids.insert(tid, tgid);
            if new_process {
                // No journal note: forks are frequent, and the note would
                // cost every short-lived child a write.
                self.save();
            }
        }
    }

    fn detach(&mut self, pids: &[i32]) -> String {
        // Threads held for a suspend in flight stay held: they go on (and
        // die) when it ends.
        let held = self.held();
        let tids: Vec<i32> = self
            .tids
            .iter()
            .filter(|(t, p)| pids.contains(p) && !held.contains(t))
            .map(|(t, _)| *t)
            .collect();
        for &tid in &tids {
            let _ = ptrace_raw(libc::PTRACE_INTERRUPT, tid, 0);
        }
        let mut pending: BTreeSet<i32> = tids.iter().copied().collect();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !pending.is_empty() && Instant::now() < deadline {
            match wait_any(false) {
                Some(Event::Signal(tid, sig)) if pending.contains(&tid) => {
                    // The signal it was stopped for goes with the detach; a
                    // fatal one kills untraced, so the suspend comes first.
                    if let (Some(&pid), true) = (self.tids.get(&tid), is_fatal(tid, sig)) {
                        self.suspend_dying(pid, &format!("signal {}", signal_name(sig)));
                    }
                    let _ = ptrace_raw(libc::PTRACE_DETACH, tid, sig as usize);
                    pending.remove(&tid);
                    self.tids.remove(&tid);
                }
                Some(Event::Ptrace(tid, event, _)) if pending.contains(&tid) => {
                    // Stopped at its exit_group: released, it exits at once.
                    if let (Some(&pid), PTRACE_EVENT_SECCOMP) = (self.tids.get(&tid), event) {
                        self.suspend_dying(pid, "exit_group");
                    }
                    let _ = ptrace_raw(libc::PTRACE_DETACH, tid, 0);
                    pending.remove(&tid);
                    self.tids.remove(&tid);
                }
                Some(other) => self.handle(other),
                None => std::thread::sleep(Duration::from_millis(2)),
            }
        }
        for tid in &pending {
            self.tids.remove(tid);
        }
        if pids.contains(&self.leader) && self.ending.is_none() {
            self.ending = Some(Ending::Detached);
        }
        for &p in pids {
            if let Ok(t) = target::resolve(p) {
                let _ = self.store.note(&t, "guard", None, "guard detached (hibernate)");
            }
        }
        self.save();
        if pending.is_empty() {
            "ok".into()
        } else {
            format!("err threads {pending:?} did not stop")
        }
    }

    /// The event loop: runs until every guarded process is gone (or was
    /// detached). Returns how the leader ended.
    pub fn run_loop(&mut self) -> Result<Ending, Error> {
        private_dir(&guards_dir(&self.state_dir))?;
        let _ = std::fs::remove_file(self.socket_path());
        let listener = UnixListener::bind(self.socket_path()).map_err(|e| Error::Proc {
            pid: std::process::id() as i32,
            reason: format!("guard socket: {e}"),
        })?;
        // Ptrace requests must come from this thread, which blocks in
        // waitpid; the control thread and the suspends interrupt that wait
        // with a signal whose handler does nothing (no SA_RESTART), so
        // requests are served at once and stops never wait for a poll
        // interval (see Inbox).
        install_wakeup_handler();
        // SAFETY: pthread_self has no preconditions.
        let me = unsafe { libc::pthread_self() };
        self.inbox.waiter.store(me as u64, std::sync::atomic::Ordering::SeqCst);
        let inbox = Arc::clone(&self.inbox);
        std::thread::spawn(move || serve_control(listener, inbox));
        self.save();
        if self.oom_watch {
            let (api, gpus, shared) = (self.api.clone(), Arc::clone(&self.gpus), Arc::clone(&self.shared));
            let store = Store::open(&self.state_dir)?;
            let lock_timeout = self.lock_timeout_ms;
            std::thread::spawn(move || oom_watch(api, gpus, store, shared, lock_timeout));
        }
        while !self.tids.is_empty() {
            let mut took = false;
            for m in self.inbox.take() {
                took = true;
                match m {
                    Msg::Detach(req) => {
                        let answer = self.detach(&req.pids);
                        let _ = (&req.conn).write_all(format!("{answer}\n").as_bytes());
                    }
                    Msg::Suspended(pid, who) => self.suspended(pid, who),
                }
            }
            if took {
                continue;
            }
            match wait_event(true) {
                Waited::Event(ev) => self.handle(ev),
                Waited::Nothing => {}
                Waited::NoChildren => break,
            }
        }
        let _ = std::fs::remove_file(self.record_file());
        let _ = std::fs::remove_file(self.socket_path());
        Ok(self.ending.unwrap_or(Ending::Detached))
    }
}

/// The signal that interrupts the guard's waitpid; above glibc's own
/// real-time signals (it uses SIGRTMIN .. SIGRTMIN+2).
fn wakeup_signal() -> i32 {
    libc::SIGRTMIN() + 6
}

extern "C" fn nothing(_: libc::c_int) {}

fn install_wakeup_handler() {
    // SAFETY: a sigaction with a handler that does nothing, no SA_RESTART.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = nothing as extern "C" fn(libc::c_int) as usize;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(wakeup_signal(), &sa, std::ptr::null_mut());
    }
}

/// Usage and limit of the memory cgroup of `pid` (v2, or v1's memory
/// controller); `None` without a limit.
pub fn cgroup_memory(pid: i32) -> Option<(u64, u64)> {
    let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    let read = |p: PathBuf| std::fs::read_to_string(p).ok().and_then(|s| s.trim().parse::<u64>().ok());
    for line in cg.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, ctrls, path) = (parts.next()?, parts.next()?, parts.next()?);
        let path = path.trim_start_matches('/');
        let (usage, limit) = if ctrls.split(',').any(|c| c == "memory") {
            let d = Path::new("/sys/fs/cgroup/memory").join(path);
            (read(d.join("memory.usage_in_bytes")), read(d.join("memory.limit_in_bytes")))
        } else if ctrls.is_empty() {
            let d = Path::new("/sys/fs/cgroup").join(path);
            (read(d.join("memory.current")), read(d.join("memory.max")))
        } else {
            continue;
        };
        if let (Some(u), Some(l)) = (usage, limit) {
            // "max" (v2) does not parse; v1 says "no limit" with a huge number.
            if l < (1 << 60) {
                return Some((u, l));
            }
        }
    }
    None
}

/// The out-of-memory watch: when a guarded CUDA process's cgroup has less
/// room left than its device memory would take in host memory (plus 10 % and
/// 256 MiB), suspend it now, while that is still possible. The kernel's OOM
/// killer uses SIGKILL, which nothing can catch; a suspended process can be
/// killed safely, a live restored one can take the host with it.
pub(crate) fn oom_watch<A: CheckpointApi, G: GpuInventory>(
    api: Deadline<A>,
    gpus: Arc<G>,
    mut store: Store,
    shared: Arc<Mutex<Vec<i32>>>,
    lock_timeout_ms: u32,
) {
    let mut done: BTreeSet<i32> = BTreeSet::new();
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let pids = shared.lock().map(|p| p.clone()).unwrap_or_default();
        if pids.is_empty() {
            continue;
        }
        done.retain(|p| pids.contains(p));
        for pid in pids {
            if done.contains(&pid) {
                continue;
            }
            let Some((usage, limit)) = cgroup_memory(pid) else { continue };
            let Ok(usage_of) = gpus.usage_of(pid as u32) else { continue };
            let footprint: u64 = usage_of.iter().map(|u| u.bytes.unwrap_or(0)).sum();
            if footprint == 0 {
                continue;
            }
            let room = limit.saturating_sub(usage);
            if room > footprint + footprint / 10 + (256 << 20) {
                continue;
            }
            let why = format!(
                "its memory cgroup has {} MiB left of {} MiB, its device memory needs {} MiB in host memory",
                room >> 20,
                limit >> 20,
                footprint >> 20
            );
            let outcome = suspend_now(&api, &*gpus, &mut store, pid, &why, lock_timeout_ms)
                .unwrap_or_else(|e| format!("could not suspend: {e}"));
            tracing::warn!(pid, outcome = %outcome, "out-of-memory watch");
            done.insert(pid);
        }
    }
}

fn serve_control(listener: UnixListener, inbox: Arc<Inbox>) {
    for conn in listener.incoming().flatten() {
        let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
        let mut line = String::new();
        if BufReader::new(&conn).read_line(&mut line).is_err() {
            continue;
        }
        let mut words = line.split_whitespace();
        match words.next() {
            Some("detach") => {
                let pids: Vec<i32> = words.filter_map(|w| w.parse().ok()).collect();
                inbox.post(Msg::Detach(Detach { pids, conn }));
            }
            _ => {
                let _ = (&conn).write_all(b"err unknown request\n");
            }
        }
    }
}

pub fn signal_name(sig: i32) -> String {
    nix::sys::signal::Signal::try_from(sig)
        .map(|s| s.as_str().to_string())
        .unwrap_or_else(|_| format!("SIGRT{sig}"))
}

/// A program started under the guard, still held before exec.
pub struct Launched {
    pub pid: i32,
    go: OwnedFd,
}

impl Launched {
    /// Lets the child exec the program.
    pub fn release(self) {
        // SAFETY: writing one byte to a pipe we own.
        unsafe { libc::write(self.go.as_raw_fd(), b"g".as_ptr().cast(), 1) };
    }
}

/// Forks the program: the child installs the exit_group filter, waits for
/// the guard to be attached (a byte on a pipe), then execs `cmd`.
pub fn launch(cmd: &[OsString]) -> Result<Launched, Error> {
    let prog = |e: String| Error::Proc { pid: 0, reason: e };
    if cmd.is_empty() {
        return Err(prog("no command given".into()));
    }
    // Everything the child needs is prepared here: after fork it may only
    // make async-signal-safe calls.
    let args: Vec<CString> = cmd
        .iter()
        .map(|a| CString::new(a.as_bytes()))
        .collect::<Result<_, _>>()
        .map_err(|e| prog(e.to_string()))?;
    let mut argv: Vec<*const libc::c_char> = args.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    // A program whose session leader is outside its pid namespace cannot be
    // dumped by CRIU (hibernate refuses it): where ours is, the program gets
    // a session of its own. Where ours is visible it keeps it, and with it
    // the terminal and job control.
    let own_session = gpusnap_core::target::session_leader_visible_self() == Some(false);
    let mut ready = [0; 2];
    let mut go = [0; 2];
    // SAFETY: pipe2 fills two fds.
    if unsafe { libc::pipe2(ready.as_mut_ptr(), libc::O_CLOEXEC) } != 0
        // SAFETY: as above.
        || unsafe { libc::pipe2(go.as_mut_ptr(), libc::O_CLOEXEC) } != 0
    {
        return Err(prog(format!("pipe: {}", std::io::Error::last_os_error())));
    }
    // SAFETY: fork; the child branch below only makes async-signal-safe calls.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(prog(format!("fork: {}", std::io::Error::last_os_error())));
    }
    if pid == 0 {
        // SAFETY: child after fork: raw syscalls only, then exec or _exit.
        unsafe {
            let mut code: i32 = 0;
            if own_session {
                libc::setsid();
            }
            if let Err(e) = seccomp::install_in_child() {
                code = e;
            }
            libc::write(ready[1], (&code as *const i32).cast(), 4);
            let mut b = 0u8;
            if libc::read(go[0], (&mut b as *mut u8).cast(), 1) != 1 || code != 0 {
                libc::_exit(126);
            }
            libc::execvp(argv[0], argv.as_ptr());
            // exec failed: report the errno as the shells do (127).
            libc::_exit(127);
        }
    }
    // SAFETY: fds we own; close the child's ends.
    let (r, gr) = unsafe {
        libc::close(ready[1]);
        libc::close(go[0]);
        (OwnedFd::from_raw_fd(ready[0]), OwnedFd::from_raw_fd(go[1]))
    };
    let mut code = [0u8; 4];
    // SAFETY: reading 4 bytes into a buffer of 4.
    let n = unsafe { libc::read(r.as_raw_fd(), code.as_mut_ptr().cast(), 4) };
    let code = i32::from_ne_bytes(code);
    if n != 4 || code != 0 {
        return Err(prog(format!(
            "could not install the exit filter: {}",
            std::io::Error::from_raw_os_error(if code == 0 { libc::EIO } else { code })
        )));
    }
    Ok(Launched { pid, go: gr })
}

/// Starts the standby keeper: a process outside the guard's tree that waits
/// for this guard to die and then starts `gpusnap guard --takeover` so the
/// guarded programs are re-attached. `argv` is the full command to exec.
pub fn start_keeper(argv: &[OsString]) -> Result<(), Error> {
    let me = std::process::id() as i32;
    let pidfd =
        seccomp::pidfd_open(me).map_err(|e| Error::Proc { pid: me, reason: format!("pidfd_open: {e}") })?;
    let args: Vec<CString> = argv
        .iter()
        .map(|a| CString::new(a.as_bytes()))
        .collect::<Result<_, _>>()
        .map_err(|e| Error::Proc { pid: me, reason: e.to_string() })?;
    let mut cargv: Vec<*const libc::c_char> = args.iter().map(|a| a.as_ptr()).collect();
    cargv.push(std::ptr::null());
    let exe = CString::new("/proc/self/exe").expect("no NUL");
    // SAFETY: double fork; the children only make async-signal-safe calls
    // before exec.
    unsafe {
        let first = libc::fork();
        if first < 0 {
            return Err(Error::Proc { pid: me, reason: "fork".into() });
        }
        if first == 0 {
            libc::setsid();
            if libc::fork() != 0 {
                libc::_exit(0);
            }
            // The keeper holds nothing of the guard's but its pidfd (moved to
            // fd 3): a pipe end kept open here would keep whoever waits on
            // the other end waiting.
            libc::dup2(pidfd.as_raw_fd(), 3);
            libc::syscall(libc::SYS_close_range, 4u32, u32::MAX, 0u32);
            // The keeper: wait until the guard is gone, then exec a new guard.
            let mut p = libc::pollfd { fd: 3, events: libc::POLLIN, revents: 0 };
            while libc::poll(&mut p, 1, -1) < 0 {}
            let devnull = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
            libc::dup2(devnull, 0);
            libc::dup2(devnull, 1);
            libc::dup2(devnull, 2);
            libc::execv(exe.as_ptr(), cargv.as_ptr());
            libc::_exit(127);
        }
        let mut st = 0;
        libc::waitpid(first, &mut st, 0);
    }
    Ok(())
}
