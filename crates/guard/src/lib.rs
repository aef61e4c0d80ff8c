//! The guard: a dying CUDA process is suspended before it dies.
//!
//! Killing a restored CUDA process, or having it crash, can hang a whole
//! host; suspending its CUDA state first prevents that. The guard is
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
pub mod fault;
pub mod launch;
pub mod light;
pub mod oom;
pub mod ptrace;
pub mod registry;
pub mod seccomp;
pub mod suspend;

use crate::oom::oom_watch;
use crate::ptrace::*;
use crate::suspend::suspend_before_death;
use gpusnap_core::error::Error;
use gpusnap_core::store::Store;
use gpusnap_core::target::{self, Target};
use gpusnap_cuda::{CheckpointApi, Deadline};
use gpusnap_gpu::GpuInventory;
use std::collections::{BTreeSet, HashMap};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use fault::{OnFault, FAULTED};
pub use launch::{launch, signal_name, start_keeper, Launched};
pub use oom::cgroup_memory;
pub use ptrace::{ptrace_raw, threads_of};
pub use registry::{detach_for, guards_dir, live_guards, private_dir, GuardFile};

/// What the guarded program's main process ended with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    Exited(i32),
    Signaled(i32),
    /// Detached for `hibernate`: the tree lives on in an image.
    Detached,
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
    on_fault: OnFault,
    /// Processes whose CUDA context was found faulted at their death.
    faulted: BTreeSet<i32>,
    /// Faulted processes held stopped (`OnFault::Hold`): none of their
    /// threads is let go on again; SIGKILL ends them.
    holding: BTreeSet<i32>,
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
    /// The suspend of this process is done; the process as it was then, and
    /// whether its CUDA context was found faulted.
    Suspended(i32, Option<Target>, bool),
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
            on_fault: OnFault::Exit,
            faulted: BTreeSet::new(),
            holding: BTreeSet::new(),
        }
    }

    /// What to do with a dying process whose CUDA context faulted.
    pub fn with_on_fault(mut self, on_fault: OnFault) -> Self {
        self.on_fault = on_fault;
        self
    }

    /// Whether a guarded process's CUDA context was found faulted.
    pub fn faulted(&self) -> bool {
        !self.faulted.is_empty()
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
        let _ = suspend_before_death(&self.api, &*self.gpus, &mut self.store, pid, why, self.lock_timeout_ms);
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
            let faulted = match Store::open(&dir) {
                Ok(mut store) => suspend_before_death(&api, &*gpus, &mut store, pid, &why, lt).is_some(),
                Err(e) => {
                    tracing::error!(pid, why, "guard: no journal, nothing suspended: {e}");
                    false
                }
            };
            inbox.post(Msg::Suspended(pid, who, faulted));
        });
    }

    /// A suspend is done: the held threads go on, held-back signals go again;
    /// a faulted process under `OnFault::Hold` is held instead.
    fn suspended(&mut self, pid: i32, who: Option<Target>, faulted: bool) {
        if faulted {
            self.faulted.insert(pid);
            if self.on_fault == OnFault::Hold && who.as_ref().is_some_and(target::is_alive) {
                self.jobs.remove(&pid);
                self.hold(pid, who.as_ref());
                return;
            }
        }
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

    /// Keeps faulted process `pid` from dying: the threads stopped for its
    /// death stay stopped, the others are stopped too, and none goes on
    /// again. Nothing of it is touched (its context would be torn down).
    fn hold(&mut self, pid: i32, who: Option<&Target>) {
        self.holding.insert(pid);
        for (&tid, _) in self.tids.iter().filter(|(_, p)| **p == pid) {
            let _ = ptrace_raw(libc::PTRACE_INTERRUPT, tid, 0);
        }
        if let Some(t) = who {
            let _ = self.store.note(
                t,
                "guard",
                Some(FAULTED),
                &format!(
                    "held (on-fault hold): the process is kept stopped so that its faulted context is not \
                     torn down; `gpusnap stop --force {pid}` ends it"
                ),
            );
        }
        tracing::warn!(pid, "guard: CUDA context faulted; process held (on-fault hold)");
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
            // A held process's threads stay where they stopped.
            Event::Signal(tid, _) | Event::Ptrace(tid, _, _)
                if self.tids.get(&tid).is_some_and(|p| self.holding.contains(p)) => {}
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
        if let Some(p) = pids.iter().find(|p| self.holding.contains(p)) {
            return format!("err process {p} is held: its CUDA context faulted");
        }
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
                    Msg::Suspended(pid, who, faulted) => self.suspended(pid, who, faulted),
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

fn serve_control(listener: UnixListener, inbox: Arc<Inbox>) {
    for conn in listener.incoming().flatten() {
        let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
        let mut line = String::new();
        if BufReader::new(&conn).read_line(&mut line).is_err() {
            continue;
        }
        match gpusnap_wire::guard::Request::parse(&line) {
            Ok(gpusnap_wire::guard::Request::Detach { pids }) => {
                inbox.post(Msg::Detach(Detach { pids, conn }));
            }
            _ => {
                let _ = (&conn).write_all(b"err unknown request\n");
            }
        }
    }
}
