//! Drives the fake `libcuda.so.1` from this process, as gpusnap will, against
//! `fake-workload` children that use it through `LD_LIBRARY_PATH`: the cases
//! of `docs/design/fakes.md` one by one.
//!
//! The fake reads `GPUSNAP_FAKE_DIR` on every call, and it is one library
//! loaded once into this process, so the tests take turns ([`Env`] holds a
//! lock): each sets the variable to its own temporary directory.

use std::ffi::{c_int, c_uint, c_void};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Mutex, MutexGuard, OnceLock};
use std::thread::sleep;
use std::time::{Duration, Instant};

use libloading::Library;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

const SUCCESS: c_int = 0;
const INVALID_VALUE: c_int = 1;
const OUT_OF_MEMORY: c_int = 2;
const NOT_INITIALIZED: c_int = 3;
const OPERATING_SYSTEM: c_int = 304;
const ILLEGAL_STATE: c_int = 401;
const NOT_READY: c_int = 600;
const UNKNOWN: c_int = 999;

const RUNNING: c_int = 0;
const LOCKED: c_int = 1;
const CHECKPOINTED: c_int = 2;

#[repr(C)]
struct LockArgs {
    timeout_ms: c_uint,
    reserved0: c_uint,
    reserved1: [u64; 7],
}

#[repr(C)]
struct GpuPair {
    old_uuid: [u8; 16],
    new_uuid: [u8; 16],
}

#[repr(C)]
struct RestoreArgs {
    gpu_pairs: *const GpuPair,
    gpu_pairs_count: c_uint,
    reserved: [u8; 44],
    reserved1: u64,
}

/// The checkpoint API of one loaded copy of the fake.
struct Cuda {
    init: unsafe extern "C" fn(c_uint) -> c_int,
    lock: unsafe extern "C" fn(c_int, *const LockArgs) -> c_int,
    checkpoint: unsafe extern "C" fn(c_int, *const c_void) -> c_int,
    restore: unsafe extern "C" fn(c_int, *const RestoreArgs) -> c_int,
    unlock: unsafe extern "C" fn(c_int, *const c_void) -> c_int,
    get_state: unsafe extern "C" fn(c_int, *mut c_int) -> c_int,
    restore_tid: unsafe extern "C" fn(c_int, *mut c_int) -> c_int,
    _lib: Library,
}

impl Cuda {
    fn load(path: &Path) -> Self {
        // SAFETY: the fake has no initialisers beyond Rust statics.
        let lib = unsafe { Library::new(path) }.unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: declared with the fake's (the driver's) C signature.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.unwrap()
            };
        }
        Self {
            init: sym!("cuInit"),
            lock: sym!("cuCheckpointProcessLock"),
            checkpoint: sym!("cuCheckpointProcessCheckpoint"),
            restore: sym!("cuCheckpointProcessRestore"),
            unlock: sym!("cuCheckpointProcessUnlock"),
            get_state: sym!("cuCheckpointProcessGetState"),
            restore_tid: sym!("cuCheckpointProcessGetRestoreThreadId"),
            _lib: lib,
        }
    }

    fn lock(&self, pid: i32, timeout_ms: u32) -> c_int {
        let args = LockArgs { timeout_ms, reserved0: 0, reserved1: [0; 7] };
        // SAFETY: a valid lock-args struct.
        unsafe { (self.lock)(pid, &args) }
    }

    fn checkpoint(&self, pid: i32) -> c_int {
        // SAFETY: NULL args are allowed.
        unsafe { (self.checkpoint)(pid, std::ptr::null()) }
    }

    fn restore(&self, pid: i32) -> c_int {
        // SAFETY: NULL args are allowed.
        unsafe { (self.restore)(pid, std::ptr::null()) }
    }

    fn restore_with(&self, pid: i32, pairs: &[GpuPair]) -> c_int {
        let args = RestoreArgs {
            gpu_pairs: pairs.as_ptr(),
            gpu_pairs_count: pairs.len() as c_uint,
            reserved: [0; 44],
            reserved1: 0,
        };
        // SAFETY: the args name `pairs`, alive for the call.
        unsafe { (self.restore)(pid, &args) }
    }

    fn unlock(&self, pid: i32) -> c_int {
        // SAFETY: NULL args are allowed.
        unsafe { (self.unlock)(pid, std::ptr::null()) }
    }

    /// (rc, state); the state is -1 when the call did not set it.
    fn state(&self, pid: i32) -> (c_int, c_int) {
        let mut state = -1;
        // SAFETY: a valid out-pointer.
        let rc = unsafe { (self.get_state)(pid, &mut state) };
        (rc, state)
    }

    fn restore_tid(&self, pid: i32) -> (c_int, c_int) {
        let mut tid = -1;
        // SAFETY: a valid out-pointer.
        let rc = unsafe { (self.restore_tid)(pid, &mut tid) };
        (rc, tid)
    }
}

/// The built fakes: a directory with the real library names for children,
/// and this process's own loaded copy of the driver.
struct Fakes {
    dir: PathBuf,
    out: PathBuf,
    cuda: Cuda,
}

fn fakes() -> &'static Fakes {
    static FAKES: OnceLock<Fakes> = OnceLock::new();
    FAKES.get_or_init(|| {
        // Build what this test binary's own fake-workload was built with.
        let bin = Path::new(env!("CARGO_BIN_EXE_fake-workload"));
        let out = bin.parent().unwrap().to_path_buf();
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fakes");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/fakes.sh");
        let status = Command::new("bash")
            .arg(&script)
            .arg(&dir)
            .env("CARGO", env!("CARGO"))
            .env("CARGO_TARGET_DIR", out.parent().unwrap())
            .env("PROFILE", out.file_name().unwrap())
            .status()
            .unwrap();
        assert!(status.success(), "{} failed", script.display());
        let cuda = Cuda::load(&out.join("libgpusnap_fake_cuda.so"));
        // SAFETY: no pointers.
        assert_eq!(unsafe { (cuda.init)(0) }, SUCCESS);
        Fakes { dir, out, cuda }
    })
}

/// One test's world: its own state directory, its children killed at the end.
struct Env {
    state: tempfile::TempDir,
    cuda: &'static Cuda,
    _turn: MutexGuard<'static, ()>,
}

impl Env {
    fn new(config: &str) -> Self {
        static TURN: Mutex<()> = Mutex::new(());
        let turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
        let fakes = fakes();
        let state = tempfile::tempdir().unwrap();
        std::fs::write(state.path().join("config.json"), config).unwrap();
        // Safe enough: tests take turns, and no thread of an earlier test is
        // still inside the fake.
        std::env::set_var("GPUSNAP_FAKE_DIR", state.path());
        Env { state, cuda: &fakes.cuda, _turn: turn }
    }

    /// `fake-workload` with the fake driver and this test's state.
    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(fakes().dir.join("fake-workload"));
        cmd.args(args).env("LD_LIBRARY_PATH", &fakes().dir).env("GPUSNAP_FAKE_DIR", self.state.path());
        cmd
    }

    /// A running `fake-workload` that has done its first iteration.
    fn workload(&self, args: &[&str]) -> Workload {
        let status = self.state.path().join(format!("status-{}", args.join("_")));
        let mut child = self
            .command(args)
            .arg("--print-ready")
            .arg("--status")
            .arg(&status)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let guard = Workload { child, status };
        let pid = line.strip_prefix("ready ").map(|p| p.trim().parse::<i32>().unwrap());
        assert_eq!(pid, Some(guard.pid()), "fake-workload said {line:?}");
        guard.wait_iterations(1);
        guard
    }

    fn journal(&self) -> Vec<(String, i32, i32)> {
        let text = std::fs::read_to_string(self.state.path().join("journal.log")).unwrap_or_default();
        let me = std::process::id().to_string();
        text.lines()
            .filter(|l| l.split(' ').nth(2) != Some("restore_data"))
            .map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                assert_eq!(f.len(), 5, "journal line {l:?}");
                f[0].parse::<u64>().unwrap();
                assert_eq!(f[1], me);
                (f[2].to_string(), f[3].parse().unwrap(), f[4].parse().unwrap())
            })
            .collect()
    }

    /// The journal's `restore_data` notes: (target, what the restore read).
    fn restore_data(&self) -> Vec<(i32, String)> {
        let text = std::fs::read_to_string(self.state.path().join("journal.log")).unwrap_or_default();
        text.lines()
            .map(|l| l.split(' ').collect::<Vec<_>>())
            .filter(|f| f[2] == "restore_data")
            .map(|f| {
                assert_eq!(f.len(), 5, "journal line {f:?}");
                (f[3].parse().unwrap(), f[4].to_string())
            })
            .collect()
    }

    fn state_json(&self) -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(self.state.path().join("state.json")).unwrap()).unwrap()
    }
}

/// A `fake-workload` child, killed and reaped when dropped.
struct Workload {
    child: Child,
    status: PathBuf,
}

impl Workload {
    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// (iteration, intact) from the status file.
    fn status(&self) -> (u64, bool) {
        let text = std::fs::read_to_string(&self.status).unwrap_or_default();
        let f: Vec<&str> = text.split_whitespace().collect();
        if f.len() != 4 {
            return (0, false);
        }
        assert_eq!(f[0], self.pid().to_string());
        (f[1].parse().unwrap(), f[2] == "1")
    }

    /// Waits until `n` more iterations ran, every one with its data intact.
    fn wait_iterations(&self, n: u64) {
        let start = self.status().0;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (it, intact) = self.status();
            if it > 0 {
                assert!(intact, "data corrupted at iteration {it}");
            }
            if it >= start + n {
                return;
            }
            assert!(Instant::now() < deadline, "stuck at iteration {it}");
            sleep(Duration::from_millis(20));
        }
    }

    /// Asserts that no iteration runs for a while.
    fn assert_frozen(&self) {
        let before = self.status().0;
        sleep(Duration::from_millis(400));
        assert_eq!(self.status().0, before, "ran while it should be suspended");
    }

    fn signal(&self, sig: Signal) {
        kill(Pid::from_raw(self.pid()), sig).unwrap();
    }

    /// Kills the process and waits until its pid is gone.
    fn kill(mut self) -> i32 {
        let pid = self.pid();
        let _ = self.child.kill();
        let _ = self.child.wait();
        pid
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn task_state(pid: i32) -> char {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    stat[stat.rfind(')').unwrap() + 2..].chars().next().unwrap()
}

const ONE_GPU: &str = r#"{"gpus":[{"total_mib":1024}],"checkpoint_gbps":2.0,"restore_gbps":2.0}"#;

#[test]
fn suspend_and_resume_keep_the_data() {
    let env = Env::new(ONE_GPU);
    let w = env.workload(&["--mib", "256", "--data-kib", "64"]);
    let pid = w.pid();
    let cuda = env.cuda;

    assert_eq!(cuda.state(pid), (SUCCESS, RUNNING));
    // Nothing but lock is legal on a running process.
    assert_eq!(cuda.checkpoint(pid), ILLEGAL_STATE);
    assert_eq!(cuda.restore(pid), ILLEGAL_STATE);
    assert_eq!(cuda.unlock(pid), ILLEGAL_STATE);

    assert_eq!(cuda.lock(pid, 5000), SUCCESS);
    assert_eq!(cuda.state(pid), (SUCCESS, LOCKED));
    assert_eq!(cuda.lock(pid, 5000), ILLEGAL_STATE);
    w.assert_frozen();

    // 256 MiB at 2 GB/s: about 134 ms.
    let t = Instant::now();
    assert_eq!(cuda.checkpoint(pid), SUCCESS);
    assert!(t.elapsed() >= Duration::from_millis(120), "{:?}", t.elapsed());
    assert_eq!(cuda.state(pid), (SUCCESS, CHECKPOINTED));
    assert_eq!(cuda.checkpoint(pid), ILLEGAL_STATE);
    assert_eq!(cuda.lock(pid, 0), ILLEGAL_STATE);
    assert_eq!(cuda.unlock(pid), ILLEGAL_STATE);
    let data = env.state.path().join(format!("host/{pid}"));
    assert!(data.is_dir(), "the written bytes are in host memory");
    assert!(!env.state.path().join(format!("mem/{pid}")).exists());
    assert_eq!(env.state_json()["procs"][pid.to_string()]["resident"], false);
    w.assert_frozen();

    assert_eq!(cuda.restore(pid), SUCCESS);
    assert_eq!(cuda.state(pid), (SUCCESS, LOCKED));
    assert!(!data.exists());
    w.assert_frozen();

    assert_eq!(cuda.unlock(pid), SUCCESS);
    assert_eq!(cuda.state(pid), (SUCCESS, RUNNING));
    w.wait_iterations(3);
}

/// `--host-copy-mib`: the checkpoint writes the pattern into the workload's
/// own memory, the restore reads it back and journals what it found, and
/// the restore thread is the workload's `cuda-restore` thread.
#[test]
fn the_host_copy_is_written_by_checkpoint_and_read_back_by_restore() {
    use std::os::unix::fs::FileExt;
    let env = Env::new(ONE_GPU);
    let cuda = env.cuda;
    let w = env.workload(&["--mib", "16", "--host-copy-mib", "8", "--threads", "1"]);
    let pid = w.pid();
    let hc = env.state_json()["procs"][pid.to_string()]["host_copy"].clone();
    let (addr, len) = (hc["addr"].as_u64().unwrap(), hc["len"].as_u64().unwrap());
    assert_eq!(len, 8 << 20);
    let (rc, tid) = cuda.restore_tid(pid);
    assert_eq!(rc, SUCCESS);
    assert_ne!(tid, pid);
    let comm = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm")).unwrap();
    assert_eq!(comm.trim(), "cuda-restore");
    // Asked through a thread id, the answer is the same.
    assert_eq!(cuda.restore_tid(tid), (SUCCESS, tid));

    let mem = std::fs::OpenOptions::new().read(true).write(true).open(format!("/proc/{pid}/mem")).unwrap();
    let page = |i: u64| {
        let mut b = vec![0u8; 4096];
        mem.read_exact_at(&mut b, addr + i * 4096).unwrap();
        b
    };
    assert!(page(0).iter().all(|&b| b == 0), "untouched before a checkpoint");
    assert_eq!(cuda.lock(pid, 0), SUCCESS);
    assert_eq!(cuda.checkpoint(pid), SUCCESS);
    assert_eq!(page(0)[..8], 1u64.to_le_bytes());
    assert_eq!(page(2047)[..8], 2048u64.to_le_bytes());
    assert!(page(5)[8..].iter().all(|&b| b != 0));
    assert_eq!(cuda.restore(pid), SUCCESS);
    assert_eq!(env.restore_data(), [(pid, "ok".to_string())]);
    assert_eq!(cuda.unlock(pid), SUCCESS);
    w.wait_iterations(2);

    // Two pages lost while checkpointed (as zero pages would be): the
    // restore still succeeds, as the real driver's would, and says so.
    assert_eq!(cuda.lock(pid, 0), SUCCESS);
    assert_eq!(cuda.checkpoint(pid), SUCCESS);
    mem.write_all_at(&[0u8; 8192], addr + 100 * 4096).unwrap();
    assert_eq!(cuda.restore(pid), SUCCESS);
    // Something else in a page is "bad".
    assert_eq!(cuda.unlock(pid), SUCCESS);
    assert_eq!(cuda.lock(pid, 0), SUCCESS);
    assert_eq!(cuda.checkpoint(pid), SUCCESS);
    mem.write_all_at(b"x", addr + 7 * 4096 + 9).unwrap();
    assert_eq!(cuda.restore(pid), SUCCESS);
    assert_eq!(cuda.unlock(pid), SUCCESS);
    let notes: Vec<String> = env.restore_data().into_iter().map(|n| n.1).collect();
    assert_eq!(notes, ["ok", "zeros:2", "bad:1"]);
    w.wait_iterations(2);
    // The other calls' journal is as without a host copy.
    let calls: Vec<String> = env.journal().iter().map(|j| j.0.clone()).collect();
    assert_eq!(calls.iter().filter(|c| *c == "restore").count(), 3, "{calls:?}");
}

/// The restore's copy is its restore thread's work: while a tracer holds
/// that thread stopped, the restore does not go on.
#[test]
fn a_restore_waits_while_its_restore_thread_is_stopped() {
    use nix::sys::ptrace;
    use nix::sys::wait::{waitpid, WaitPidFlag};
    let env = Env::new(ONE_GPU);
    let cuda = env.cuda;
    let w = env.workload(&["--mib", "16", "--host-copy-mib", "4"]);
    let pid = w.pid();
    let (_, tid) = cuda.restore_tid(pid);
    assert_ne!(tid, pid);
    assert_eq!(cuda.lock(pid, 0), SUCCESS);
    assert_eq!(cuda.checkpoint(pid), SUCCESS);
    let (stopped_tx, stopped_rx) = mpsc::channel();
    // ptrace requests come from the thread that attached.
    let tracer = std::thread::spawn(move || {
        let t = Pid::from_raw(tid);
        ptrace::seize(t, ptrace::Options::empty()).unwrap();
        ptrace::interrupt(t).unwrap();
        waitpid(t, Some(WaitPidFlag::__WALL)).unwrap();
        stopped_tx.send(()).unwrap();
        sleep(Duration::from_millis(500));
        ptrace::detach(t, None).unwrap();
    });
    stopped_rx.recv().unwrap();
    assert_eq!(task_state(tid), 't');
    let t = Instant::now();
    assert_eq!(cuda.restore(pid), SUCCESS);
    assert!(t.elapsed() >= Duration::from_millis(300), "{:?}", t.elapsed());
    tracer.join().unwrap();
    assert_eq!(env.restore_data(), [(pid, "ok".to_string())]);
    assert_eq!(cuda.unlock(pid), SUCCESS);
    w.wait_iterations(2);
}

#[test]
fn a_restore_without_memory_strands_the_process() {
    let env = Env::new(ONE_GPU);
    let cuda = env.cuda;
    let w = env.workload(&["--mib", "600"]);
    let pid = w.pid();
    assert_eq!(cuda.lock(pid, 0), SUCCESS);
    assert_eq!(cuda.checkpoint(pid), SUCCESS);

    // Its memory is free while it is suspended: another program takes it.
    let filler = env.workload(&["--mib", "600", "--data-kib", "0"]);
    assert_eq!(cuda.restore(pid), OUT_OF_MEMORY);
    assert_eq!(cuda.state(pid), (SUCCESS, CHECKPOINTED));

    filler.kill();
    // The memory is back, but the process never runs again.
    assert_eq!(cuda.restore(pid), OPERATING_SYSTEM);
    assert_eq!(cuda.restore(pid), OPERATING_SYSTEM);
    assert_eq!(cuda.unlock(pid), ILLEGAL_STATE);
    assert_eq!(cuda.lock(pid, 0), ILLEGAL_STATE);
    assert_eq!(cuda.checkpoint(pid), ILLEGAL_STATE);
    assert_eq!(cuda.state(pid), (SUCCESS, CHECKPOINTED));
    w.assert_frozen();

    // A third program can have the memory: the poisoned one holds none.
    let _again = env.workload(&["--mib", "900", "--data-kib", "0"]);
}

#[test]
fn a_workload_that_does_not_fit_fails_with_out_of_memory() {
    let env = Env::new(ONE_GPU);
    let out = env.command(&["--mib", "2000"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cuMemAlloc_v2: 2 CUDA_ERROR_OUT_OF_MEMORY"), "{err}");
    let out = env.command(&["--gpu", "1"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cuDeviceGet: 101 CUDA_ERROR_INVALID_DEVICE"), "{err}");
}

#[test]
fn thread_ids_act_on_their_process() {
    let env = Env::new(ONE_GPU);
    let cuda = env.cuda;
    let w = env.workload(&["--mib", "16", "--threads", "2"]);
    let pid = w.pid();
    let tids: Vec<i32> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_str().unwrap().parse().unwrap())
        .filter(|&t| t != pid)
        .collect();
    assert!(tids.len() >= 2, "{tids:?}");
    let tid = tids[0];

    assert_eq!(cuda.state(tid), (SUCCESS, RUNNING));
    assert_eq!(cuda.lock(tid, 1000), SUCCESS);
    assert_eq!(cuda.state(pid), (SUCCESS, LOCKED));
    assert_eq!(cuda.restore_tid(tid), (SUCCESS, pid));
    assert_eq!(cuda.restore_tid(pid), (SUCCESS, pid));
    assert_eq!(cuda.unlock(tids[1]), SUCCESS);
    assert_eq!(cuda.state(pid), (SUCCESS, RUNNING));

    // The journal names the id the caller passed.
    let targets: Vec<i32> = env.journal().iter().map(|j| j.1).collect();
    assert_eq!(targets, vec![tid, tid, pid, tid, pid, tids[1], pid]);
}

#[test]
fn pids_without_cuda_and_dead_pids() {
    let env = Env::new(ONE_GPU);
    let cuda = env.cuda;

    let mut sleeper = Command::new("sleep").arg("30").spawn().unwrap();
    let pid = sleeper.id() as i32;
    assert_eq!(cuda.state(pid), (NOT_INITIALIZED, -1));
    assert_eq!(cuda.lock(pid, 100), NOT_INITIALIZED);
    assert_eq!(cuda.checkpoint(pid), NOT_INITIALIZED);
    assert_eq!(cuda.restore(pid), NOT_INITIALIZED);
    assert_eq!(cuda.unlock(pid), NOT_INITIALIZED);
    assert_eq!(cuda.restore_tid(pid), (NOT_INITIALIZED, -1));
    sleeper.kill().unwrap();
    sleeper.wait().unwrap();
    assert_eq!(cuda.state(pid), (OPERATING_SYSTEM, -1));
    assert_eq!(cuda.lock(pid, 100), OPERATING_SYSTEM);
    assert_eq!(cuda.state(-1), (OPERATING_SYSTEM, -1));
    assert_eq!(cuda.state(0), (OPERATING_SYSTEM, -1));

    // A CUDA process that exited but is not reaped yet is a zombie.
    let mut w = env.workload(&["--mib", "16"]);
    let pid = w.pid();
    w.signal(Signal::SIGKILL);
    while task_state(pid) != 'Z' {
        sleep(Duration::from_millis(10));
    }
    assert_eq!(cuda.state(pid), (NOT_INITIALIZED, -1));
    assert_eq!(cuda.lock(pid, 0), NOT_INITIALIZED);
    w.child.wait().unwrap();
    assert_eq!(cuda.state(pid), (OPERATING_SYSTEM, -1));

    // A NULL out-pointer is refused, not written through.
    // SAFETY: the fake checks for NULL before writing.
    let rc = unsafe { (cuda.get_state)(std::process::id() as i32, std::ptr::null_mut()) };
    assert_eq!(rc, INVALID_VALUE);
}

#[test]
fn calls_before_cu_init_answer_3() {
    let env = Env::new(ONE_GPU);
    let w = env.workload(&["--mib", "16"]);
    // A copy is a library of its own (another inode), with cuInit not run.
    let copy = env.state.path().join("libcuda-copy.so");
    std::fs::copy(fakes().out.join("libgpusnap_fake_cuda.so"), &copy).unwrap();
    let fresh = Cuda::load(&copy);
    assert_eq!(fresh.state(w.pid()), (NOT_INITIALIZED, -1));
    assert_eq!(fresh.lock(w.pid(), 0), NOT_INITIALIZED);
    // SAFETY: no pointers.
    assert_eq!(unsafe { (fresh.init)(0) }, SUCCESS);
    assert_eq!(fresh.state(w.pid()), (SUCCESS, RUNNING));
}

/// gpusnap's binding against a driver whose start-up is slow, then fails:
/// the load returns without waiting for `cuInit`, every call waits for it
/// and gets its failure, every time.
#[test]
fn the_binding_waits_for_a_background_cu_init() {
    use gpusnap_cuda::{Call, CheckpointApi, CudaDriver, DriverError};
    let env = Env::new(ONE_GPU);
    let w = env.workload(&["--mib", "16"]);
    let with = |cfg: &str, name: &str| {
        std::fs::write(env.state.path().join("config.json"), cfg).unwrap();
        // A copy of its own (another inode), with cuInit not run yet.
        let copy = env.state.path().join(name);
        std::fs::copy(fakes().out.join("libgpusnap_fake_cuda.so"), &copy).unwrap();
        CudaDriver::load_from(copy.to_str().unwrap()).unwrap()
    };
    let d = with(r#"{"init_ms": 300, "init_rc": 100}"#, "libcuda-fails.so");
    assert_eq!(d.api_version(), 13000, "known at load");
    for _ in 0..2 {
        let e = d.get_state(w.pid()).unwrap_err();
        assert!(matches!(&e, DriverError::Call { call: Call::Init, code } if code.raw == 100), "{e}");
        assert_eq!(e.to_string(), "cuInit failed: CUDA_ERROR_NO_DEVICE (100)");
        assert_eq!(d.lock(w.pid(), 0).unwrap_err().to_string(), e.to_string());
        assert_eq!(d.ready().unwrap_err().to_string(), e.to_string());
    }
    drop(d);
    assert!(env.journal().is_empty(), "no checkpoint call reached the driver");
    let d = with(r#"{"init_ms": 300}"#, "libcuda-slow.so");
    // Several callers at once: each waits, none calls before cuInit (3).
    std::thread::scope(|s| {
        for _ in 0..3 {
            s.spawn(|| assert_eq!(d.get_state(w.pid()).unwrap().as_str(), "running"));
        }
    });
    assert!(d.ready().is_ok());
}

#[test]
fn a_stopped_process_hangs_lock_and_get_state() {
    let env = Env::new(ONE_GPU);
    let cuda = env.cuda;
    let w = env.workload(&["--mib", "16"]);
    let pid = w.pid();
    w.signal(Signal::SIGSTOP);
    while task_state(pid) != 'T' {
        sleep(Duration::from_millis(10));
    }

    let (tx, rx) = mpsc::channel();
    let tx2 = tx.clone();
    let getter = std::thread::spawn(move || tx.send(("get_state", cuda.state(pid).0)).unwrap());
    // The timeout does not help.
    let locker = std::thread::spawn(move || tx2.send(("lock", cuda.lock(pid, 100))).unwrap());
    assert!(rx.recv_timeout(Duration::from_millis(1200)).is_err(), "a call returned on a stopped process");

    w.signal(Signal::SIGCONT);
    let mut answers = vec![
        rx.recv_timeout(Duration::from_secs(5)).unwrap(),
        rx.recv_timeout(Duration::from_secs(5)).unwrap(),
    ];
    getter.join().unwrap();
    locker.join().unwrap();
    answers.sort();
    assert_eq!(answers, vec![("get_state", SUCCESS), ("lock", SUCCESS)]);
    assert_eq!(cuda.state(pid), (SUCCESS, LOCKED));
    assert_eq!(cuda.unlock(pid), SUCCESS);
}

#[test]
fn a_lock_times_out_on_queued_work() {
    let env = Env::new(ONE_GPU);
    let cuda = env.cuda;
    let w = env.workload(&["--mib", "16", "--busy-ms", "1500"]);
    let pid = w.pid();

    // It gives up after the timeout, not once the queue (1.5 s) drains.
    let t = Instant::now();
    assert_eq!(cuda.lock(pid, 200), NOT_READY);
    let took = t.elapsed();
    assert!(took >= Duration::from_millis(200) && took < Duration::from_millis(1300), "{took:?}");
    assert_eq!(cuda.state(pid), (SUCCESS, RUNNING));
    w.wait_iterations(2);

    // Without a timeout it waits for the queue to drain: about 1.4 s, as
    // an iteration just queued 1.5 s.
    let t = Instant::now();
    // SAFETY: NULL args are allowed.
    assert_eq!(unsafe { (cuda.lock)(pid, std::ptr::null()) }, SUCCESS);
    assert!(t.elapsed() >= Duration::from_millis(500), "{:?}", t.elapsed());
    assert_eq!(cuda.state(pid), (SUCCESS, LOCKED));
    w.assert_frozen();
    assert_eq!(cuda.unlock(pid), SUCCESS);
    w.wait_iterations(1);
}

#[test]
fn the_journal_records_every_call_in_order() {
    let env = Env::new(ONE_GPU);
    let cuda = env.cuda;
    let w = env.workload(&["--mib", "16"]);
    let pid = w.pid();
    cuda.state(pid);
    cuda.lock(pid, 0);
    cuda.lock(pid, 0);
    cuda.checkpoint(pid);
    cuda.restore(pid);
    cuda.unlock(pid);
    cuda.restore_tid(pid);
    let dead = w.kill();
    cuda.state(dead);

    let expect = [
        ("get_state", pid, SUCCESS),
        ("lock", pid, SUCCESS),
        ("lock", pid, ILLEGAL_STATE),
        ("checkpoint", pid, SUCCESS),
        ("restore", pid, SUCCESS),
        ("unlock", pid, SUCCESS),
        ("get_restore_tid", pid, SUCCESS),
        ("get_state", dead, OPERATING_SYSTEM),
    ];
    let got = env.journal();
    let got: Vec<(&str, i32, i32)> = got.iter().map(|(c, p, rc)| (c.as_str(), *p, *rc)).collect();
    assert_eq!(got, expect);
}

#[test]
fn injected_failures_fire_their_count() {
    let env = Env::new(
        r#"{"gpus":[{"total_mib":1024}],
            "inject":[{"call":"checkpoint","rc":999,"count":1},{"call":"get_state","pid":1,"rc":600}]}"#,
    );
    let cuda = env.cuda;
    let w = env.workload(&["--mib", "16"]);
    let pid = w.pid();
    assert_eq!(cuda.lock(pid, 0), SUCCESS);
    assert_eq!(cuda.checkpoint(pid), UNKNOWN);
    assert_eq!(cuda.state(pid), (SUCCESS, LOCKED));
    assert_eq!(cuda.checkpoint(pid), SUCCESS);
    assert_eq!(cuda.state(1), (NOT_READY, -1));
    assert_eq!(cuda.state(1), (NOT_READY, -1));
    let config = std::fs::read_to_string(env.state.path().join("config.json")).unwrap();
    assert!(!config.contains(r#""checkpoint""#), "{config}");
}

#[test]
fn gpu_pairs_move_a_process_to_another_gpu() {
    let env = Env::new(r#"{"gpus":[{"total_mib":1024},{"total_mib":1024}]}"#);
    let cuda = env.cuda;
    let w = env.workload(&["--mib", "100", "--gpu", "0"]);
    let pid = w.pid();
    assert_eq!(cuda.lock(pid, 0), SUCCESS);
    assert_eq!(cuda.checkpoint(pid), SUCCESS);

    // Default uuids: GPU i is GPU-0000000i-0000-...
    let uuid = |i: u8| {
        let mut b = [0u8; 16];
        b[3] = i;
        b
    };
    let pair = |old, new| GpuPair { old_uuid: uuid(old), new_uuid: uuid(new) };
    assert_eq!(cuda.restore_with(pid, &[pair(0, 1)]), INVALID_VALUE);
    assert_eq!(cuda.restore_with(pid, &[pair(0, 1), pair(7, 0)]), INVALID_VALUE);
    assert_eq!(cuda.state(pid), (SUCCESS, CHECKPOINTED));
    assert_eq!(cuda.restore_with(pid, &[pair(0, 1), pair(1, 0)]), SUCCESS);
    let allocs = &env.state_json()["procs"][pid.to_string()]["allocs"];
    let gpus: Vec<u64> = allocs.as_object().unwrap().values().map(|a| a["gpu"].as_u64().unwrap()).collect();
    assert_eq!(gpus, vec![1]);
    assert_eq!(cuda.unlock(pid), SUCCESS);
    w.wait_iterations(2);
}
