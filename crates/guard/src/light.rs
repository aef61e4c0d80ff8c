//! The guard's side of light mode (`gpusnap run --light`): no tracing at
//! all. The program carries `libgpusnap_preload.so` (crates/preload), which
//! connects to the guard's unix socket when a process that loaded libcuda
//! is about to die (a fatal signal left at its default, `exit`, `_exit`),
//! sends `dying WHY`, and waits. The guard takes the sender's pid from the
//! socket's peer credentials (not from the message), suspends that process
//! (the same journaled lock + checkpoint + NVML check as the ptrace guard),
//! and answers `ok`; the death then goes on unchanged.
//!
//! The same socket answers `detach PIDS` from `hibernate` (nothing to let go
//! of; the guard notes that the program leaves it). The socket's path is in
//! the program's environment (`GPUSNAP_GUARD_SOCKET`), so a guard started
//! later for the same process (after `snapshot`, or `wake`: CRIU restores
//! the environment) binds the same path and serves it again.
//!
//! The environment is the program's to change, and the guard runs as root:
//! a path from it is served only if it names gpusnap's own
//! `STATE/guards/light-PID.sock` (docs/design/trust.md). The directory is
//! opened with O_NOFOLLOW and checked on its descriptor, and the socket is
//! removed, bound and chmodded by name relative to it: nothing is created,
//! changed or removed anywhere else.

use super::suspend_before_death;
use crate::fault::{OnFault, FAULTED};
use gpusnap_core::error::Error;
use gpusnap_core::store::Store;
use gpusnap_core::target::{self, Target};
use gpusnap_cuda::{CheckpointApi, Deadline};
use gpusnap_gpu::GpuInventory;
use gpusnap_wire::guard::{Answer, Request, Why};
use gpusnap_wire::{names, sock};
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The environment variable that tells the preload library where the guard
/// listens.
pub const SOCKET_ENV: &str = names::GUARD_SOCKET_ENV;
/// The library's file name; `gpusnap` looks for it next to itself.
pub const LIBRARY: &str = "libgpusnap_preload.so";

/// Where `gpusnap run --light` with pid `run_pid` listens.
pub fn socket_for(state_dir: &Path, run_pid: u32) -> PathBuf {
    super::guards_dir(state_dir).join(names::guard_socket_file(run_pid))
}

/// The preload library: `explicit`, else `GPUSNAP_PRELOAD`, else next to
/// the running executable or in `../lib/gpusnap/` from it.
pub fn find_library(explicit: Option<&Path>) -> Result<PathBuf, Error> {
    let lib = locate_library(explicit)?;
    // LD_PRELOAD splits its list at spaces and colons.
    let text = lib.to_string_lossy();
    if text.contains([' ', ':', '\t', '\n']) {
        return Err(Error::Proc {
            pid: 0,
            reason: format!(
                "{text}: LD_PRELOAD cannot name a path with spaces or colons; pass --preload PATH"
            ),
        });
    }
    Ok(lib)
}

fn locate_library(explicit: Option<&Path>) -> Result<PathBuf, Error> {
    let missing = |why: String| Error::Proc { pid: 0, reason: why };
    if let Some(p) =
        explicit.map(Path::to_path_buf).or_else(|| std::env::var_os("GPUSNAP_PRELOAD").map(PathBuf::from))
    {
        return if p.is_file() {
            Ok(p)
        } else {
            Err(missing(format!("{}: no such preload library", p.display())))
        };
    }
    let exe = std::env::current_exe().map_err(|e| missing(format!("cannot find gpusnap's own path: {e}")))?;
    let dir = exe.parent().unwrap_or(Path::new("/"));
    let candidates = [dir.join(LIBRARY), dir.join("../lib/gpusnap").join(LIBRARY)];
    candidates.iter().find(|p| p.is_file()).cloned().ok_or_else(|| {
        missing(format!(
            "{LIBRARY} not found next to {} (build it with `cargo build --release`, or pass --preload PATH)",
            exe.display()
        ))
    })
}

/// The socket path a light-mode program was started with, from its
/// environment; `None` for any other process.
pub fn socket_of(pid: i32) -> Option<PathBuf> {
    socket_in_environ(&std::fs::read(format!("/proc/{pid}/environ")).ok()?)
}

/// The socket path in an environment block (NUL-separated `KEY=VALUE`).
pub fn socket_in_environ(env: &[u8]) -> Option<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    let key = format!("{SOCKET_ENV}=");
    env.split(|b| *b == 0)
        .find_map(|kv| kv.strip_prefix(key.as_bytes()).map(|v| PathBuf::from(std::ffi::OsStr::from_bytes(v))))
}

/// The guards' directory of `state_dir`, open and checked (see
/// [`gpusnap_files::PrivateDir`]).
fn guards(state_dir: &Path) -> Result<gpusnap_files::PrivateDir, Error> {
    gpusnap_files::PrivateDir::open(state_dir, super::registry::GUARDS)
        .map_err(|e| Error::Proc { pid: std::process::id() as i32, reason: format!("guard sockets: {e}") })
}

/// The name of `path` in `dir` if it is a light guard's socket there
/// (`light-PID.sock` in that very directory); an error that says so for any
/// other path.
fn own_name(dir: &gpusnap_files::PrivateDir, path: &Path) -> Result<String, Error> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let well_named = names::guard_socket_pid(name).is_some();
    if well_named && path.parent().is_some_and(|p| dir.is(p)) {
        return Ok(name.to_string());
    }
    Err(Error::Proc {
        pid: std::process::id() as i32,
        reason: format!(
            "{SOCKET_ENV}={} is not a light guard's socket in {} (light-PID.sock): not served, nothing made there",
            path.display(),
            dir.path().display()
        ),
    })
}

/// Checks that `path` (from a program's environment) names a light guard's
/// socket of `state_dir`, the only place a guard serves one.
pub fn check_socket(state_dir: &Path, path: &Path) -> Result<(), Error> {
    own_name(&guards(state_dir)?, path).map(drop)
}

/// Removes the socket at `path` if it is still the one this process bound
/// (its inode `ino`): a newer guard may have taken the path over.
pub fn unbind(state_dir: &Path, path: &Path, ino: u64) {
    let Ok(dir) = guards(state_dir) else { return };
    let Ok(name) = own_name(&dir, path) else { return };
    if dir.stat(&name).is_ok_and(|st| st.st_ino == ino) {
        let _ = dir.unlink(&name);
    }
}

/// Whether a guard answers on `path` now.
pub fn is_served(path: &Path) -> bool {
    UnixStream::connect(path).is_ok()
}

/// The pid of the process at the other end of `s`.
fn peer_pid(s: &UnixStream) -> Option<i32> {
    sock::peer_cred(s.as_fd()).ok().map(|c| c.pid).filter(|&p| p > 0)
}

/// A light-mode guard: the listening socket and what a suspend needs.
pub struct LightGuard<A: CheckpointApi, G: GpuInventory> {
    api: Deadline<A>,
    gpus: Arc<G>,
    state_dir: PathBuf,
    lock_timeout_ms: u32,
    /// Set once `hibernate` has asked the guard to let the program go.
    pub detached: Arc<AtomicBool>,
    /// Requests being answered now, and the listeners (to see requests not
    /// yet accepted): a guard that ends waits for both, so that even a late
    /// answer is journaled.
    in_flight: Arc<std::sync::atomic::AtomicUsize>,
    listeners: std::sync::Mutex<Vec<UnixListener>>,
    on_fault: OnFault,
    /// Set once a dying process's CUDA context was found faulted.
    pub faulted: Arc<AtomicBool>,
}

impl<A: CheckpointApi, G: GpuInventory> LightGuard<A, G> {
    pub fn new(api: Deadline<A>, gpus: G, state_dir: &Path, lock_timeout_ms: u32) -> Self {
        Self {
            api,
            gpus: Arc::new(gpus),
            state_dir: state_dir.to_path_buf(),
            lock_timeout_ms,
            detached: Arc::new(AtomicBool::new(false)),
            in_flight: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            listeners: std::sync::Mutex::new(Vec::new()),
            on_fault: OnFault::Exit,
            faulted: Arc::new(AtomicBool::new(false)),
        }
    }

    /// What to do with a dying process whose CUDA context faulted: under
    /// `OnFault::Hold` the answer is `hold`, and the library keeps the
    /// process in its exit path for good (SIGKILL ends it).
    pub fn with_on_fault(mut self, on_fault: OnFault) -> Self {
        self.on_fault = on_fault;
        self
    }

    /// Waits (at most `limit`) until no request is waiting or being
    /// answered.
    pub fn quiesce(&self, limit: Duration) {
        let end = std::time::Instant::now() + limit;
        let pending = || {
            self.listeners.lock().is_ok_and(|ls| {
                ls.iter().any(|l| {
                    let mut p = libc::pollfd { fd: l.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                    // SAFETY: one valid pollfd; no waiting.
                    unsafe { libc::poll(&mut p, 1, 0) > 0 }
                })
            })
        };
        while (self.in_flight.load(Ordering::SeqCst) > 0 || pending()) && std::time::Instant::now() < end {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Watches the memory cgroups of `leader` and its descendants (as
    /// `run --oom-watch` does for traced programs, see [`super::oom_watch`]),
    /// on threads of their own.
    pub fn watch_memory(&self, leader: i32) -> Result<(), Error> {
        let shared = Arc::new(std::sync::Mutex::new(vec![leader]));
        let store = Store::open(&self.state_dir)?;
        let (api, gpus, lt) = (self.api.clone(), Arc::clone(&self.gpus), self.lock_timeout_ms);
        let tree = Arc::clone(&shared);
        // The tree, again every second: a light guard sees no forks.
        std::thread::spawn(move || loop {
            let pids: Vec<i32> =
                gpusnap_core::tree::process_tree(leader).into_iter().map(|(p, _)| p).collect();
            if let Ok(mut t) = tree.lock() {
                *t = pids;
            }
            std::thread::sleep(Duration::from_secs(1));
        });
        std::thread::spawn(move || super::oom_watch(api, gpus, store, shared, lt));
        Ok(())
    }

    /// Binds `path`, which must be a light guard's socket of the state
    /// directory (see [`check_socket`]), mode 0600 (a stale socket left by
    /// a dead guard is replaced), and serves it on a thread of its own until
    /// the process ends.
    pub fn serve(&self, path: &Path) -> Result<u64, Error> {
        let fail = |e: std::io::Error| Error::Proc {
            pid: std::process::id() as i32,
            reason: format!("guard socket {}: {e}", path.display()),
        };
        let dir = guards(&self.state_dir)?;
        let name = own_name(&dir, path)?;
        // The newest guard owns the path: one that served it before (the
        // `run` of a snapshotted program, a guard of the image's earlier
        // life) keeps a listener no one can reach any more. Only a socket
        // is replaced.
        if dir.is_socket(&name) {
            let _ = dir.unlink(&name);
        }
        // Bound by its own path, not through the directory's descriptor: the
        // name a socket is bound under is what CRIU binds again when it
        // restores the guard (a container checkpointed with its guard as
        // PID 1), and `/proc/self/fd/N/...` would mean another directory
        // then. The directory is private (root's, 0700, checked above): no
        // one else can swap it meanwhile; it is checked again after.
        let listener = UnixListener::bind(path).map_err(fail)?;
        if !(path.parent().is_some_and(|p| dir.is(p)) && dir.is_socket(&name)) {
            return Err(fail(std::io::Error::other(
                "the guards directory changed while its socket was bound",
            )));
        }
        dir.chmod(&name, 0o600).map_err(fail)?;
        let ino = dir.stat(&name).map_err(fail)?.st_ino;
        if let (Ok(l), Ok(mut ls)) = (listener.try_clone(), self.listeners.lock()) {
            ls.push(l);
        }
        let (api, gpus, dir, lt, detached, in_flight) = (
            self.api.clone(),
            Arc::clone(&self.gpus),
            self.state_dir.clone(),
            self.lock_timeout_ms,
            Arc::clone(&self.detached),
            Arc::clone(&self.in_flight),
        );
        let (on_fault, faulted) = (self.on_fault, Arc::clone(&self.faulted));
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                in_flight.fetch_add(1, Ordering::SeqCst);
                let (api, gpus, dir, detached, in_flight, faulted) = (
                    api.clone(),
                    Arc::clone(&gpus),
                    dir.clone(),
                    Arc::clone(&detached),
                    Arc::clone(&in_flight),
                    Arc::clone(&faulted),
                );
                // One thread per caller: processes of a group die together,
                // and each waits only for its own suspend.
                std::thread::spawn(move || {
                    let policy = Policy { on_fault, faulted: &faulted, detached: &detached };
                    answer(conn, &api, &*gpus, &dir, lt, &policy);
                    in_flight.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        Ok(ino)
    }
}

/// The preload library's reason in the traced guard's words: `signal 11`
/// -> `signal SIGSEGV`, `exit` -> `exit_group via exit`, `_exit` ->
/// `exit_group via _exit`.
fn light_why(why: Why) -> String {
    match why {
        Why::Signal(sig) => format!("signal {}", super::signal_name(sig)),
        Why::Exit => "exit_group via exit".to_string(),
        Why::UnderscoreExit => "exit_group via _exit".to_string(),
    }
}

/// The uid of the process at the other end of `s`.
fn peer_uid(s: &UnixStream) -> Option<u32> {
    sock::peer_cred(s.as_fd()).ok().map(|c| c.uid)
}

/// What a guard that answers late writes in the journal: the process did
/// not wait (its bound ran out, or it was gone before the guard read its
/// request).
const NOT_ANSWERED: &str =
    "the guard did not answer in time (stopped or stuck): the process did not wait, and died unsuspended";

/// Sends a heartbeat byte every second on `conn` until `done`, so that the
/// dying process (which waits only while it hears from the guard, see
/// crates/preload) keeps waiting through a long checkpoint. A failed write
/// means the process is gone or gave up: that is journaled at once (the
/// suspend may be stuck for good), and reported.
fn heartbeat(
    conn: UnixStream,
    done: Arc<AtomicBool>,
    gone: Arc<AtomicBool>,
    key: Option<Target>,
    state_dir: PathBuf,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        while !done.load(Ordering::SeqCst) {
            if (&conn).write_all(b".").is_err() {
                if !gone.swap(true, Ordering::SeqCst) {
                    journal_not_answered(&state_dir, key.as_ref());
                }
                return;
            }
            let end = std::time::Instant::now() + Duration::from_secs(1);
            while !done.load(Ordering::SeqCst) && std::time::Instant::now() < end {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    })
}

fn journal_not_answered(state_dir: &Path, key: Option<&Target>) {
    let Some(t) = key else { return };
    tracing::warn!(pid = t.pid, "light guard: {NOT_ANSWERED}");
    if let Ok(mut store) = Store::open(state_dir) {
        let _ = store.note(t, "guard", None, NOT_ANSWERED);
    }
}

/// What a light guard decides beyond the suspend, and what it reports.
struct Policy<'a> {
    on_fault: OnFault,
    faulted: &'a AtomicBool,
    detached: &'a AtomicBool,
}

fn answer<A: CheckpointApi, G: GpuInventory + ?Sized>(
    conn: UnixStream,
    api: &Deadline<A>,
    gpus: &G,
    state_dir: &Path,
    lock_timeout_ms: u32,
    policy: &Policy,
) {
    let detached = policy.detached;
    let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
    let mut line = String::new();
    if BufReader::new(&conn).read_line(&mut line).is_err() {
        return;
    }
    // The library adds its start time: the journal's key for the process
    // even when it is gone by the time the guard reads this.
    let reply = match Request::parse(&line) {
        Ok(Request::Dying { asynchronous, why, start }) => {
            let resend = match why {
                Why::Signal(sig) if asynchronous => Some(sig),
                _ => None,
            };
            let why = light_why(why);
            let Some(pid) = peer_pid(&conn) else {
                let _ = (&conn).write_all(Answer::Error("no peer credentials".into()).encode().as_bytes());
                return;
            };
            // The process that asked (its start time as it reads it may
            // differ from ours: CRIU restores into a time namespace, which
            // shifts /proc's start times; so it only names a process that
            // is gone).
            let who = target::resolve(pid).ok();
            let key = who
                .clone()
                .or_else(|| start.map(|s| Target { pid, start_time: s, comm: String::new(), uid: u32::MAX }));
            let (done, gone) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
            let beat = conn.try_clone().ok().map(|c| {
                heartbeat(c, Arc::clone(&done), Arc::clone(&gone), key.clone(), state_dir.to_path_buf())
            });
            let mut hold = false;
            if let Some(t) = &who {
                match Store::open(state_dir) {
                    Ok(mut store) => {
                        let death = suspend_before_death(api, gpus, &mut store, pid, &why, lock_timeout_ms);
                        if death.is_some() {
                            policy.faulted.store(true, Ordering::SeqCst);
                            hold = policy.on_fault == OnFault::Hold;
                        }
                        if hold {
                            let _ = store.note(
                                t,
                                "guard",
                                Some(FAULTED),
                                &format!(
                                    "held (on-fault hold): the process waits in its exit path so that its \
                                     faulted context is not torn down; `gpusnap stop --force {pid}` ends it"
                                ),
                            );
                            tracing::warn!(
                                pid,
                                "light guard: CUDA context faulted; process held (on-fault hold)"
                            );
                        }
                    }
                    Err(e) => tracing::error!(pid, why, "light guard: no journal, nothing suspended: {e}"),
                }
            }
            done.store(true, Ordering::SeqCst);
            if let Some(b) = beat {
                let _ = b.join();
            }
            if hold {
                // The library blocks for good on this answer; no signal again.
                let _ = (&conn).write_all(Answer::Hold.encode().as_bytes());
                return;
            }
            // Alive before the answer: once answered, it dies at once.
            let alive = who.as_ref().is_some_and(target::is_alive);
            let answered = (&conn).write_all(Answer::Ok.encode().as_bytes()).is_ok() && alive;
            if !answered && !gone.swap(true, Ordering::SeqCst) {
                journal_not_answered(state_dir, key.as_ref());
            }
            if let (Some(sig), true) = (resend, answered) {
                // The library let the program run on: the answer first,
                // then the signal again, which now kills.
                // SAFETY: kill with a pid and a signal number.
                unsafe { libc::kill(pid, sig) };
            }
            return;
        }
        // Only the guard's own user (or root) may make it let go.
        Ok(Request::Detach { .. })
            if peer_uid(&conn).is_some_and(|u| u == 0 || u == nix::unistd::geteuid().as_raw()) =>
        {
            detached.store(true, Ordering::SeqCst);
            Answer::Ok
        }
        Ok(Request::Detach { .. }) => Answer::Error("not allowed".into()),
        Err(_) => Answer::Error("unknown request".into()),
    };
    let _ = (&conn).write_all(reply.encode().as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_library_path_ld_preload_cannot_carry_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let bad = d.path().join("with space.so");
        std::fs::write(&bad, b"").unwrap();
        let e = find_library(Some(&bad)).unwrap_err();
        assert!(e.to_string().contains("spaces or colons"), "{e}");
        let good = d.path().join("lib.so");
        std::fs::write(&good, b"").unwrap();
        assert_eq!(find_library(Some(&good)).unwrap(), good);
        assert!(find_library(Some(&d.path().join("missing.so"))).is_err());
    }

    #[test]
    fn reasons_in_the_guards_words() {
        assert_eq!(light_why(Why::Signal(11)), "signal SIGSEGV");
        assert_eq!(light_why(Why::Exit), "exit_group via exit");
        assert_eq!(light_why(Why::UnderscoreExit), "exit_group via _exit");
    }
}
