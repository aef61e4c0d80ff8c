//! The guard's known defects, one regression test each (named after the
//! defect), in the mode(s) it was found in. Each failed before its fix.

mod common;

use common::*;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::Duration;

const TRACED: &str = "--no-keeper";
const LIGHT: &str = "--light";

fn kill(pid: i32, sig: nix::sys::signal::Signal) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), sig).unwrap();
}

/// Gone, or a zombie its (stopped) parent has not reaped yet.
fn dead(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')))
        .unwrap_or(true)
}

/// Runs `script` with python3, unguarded or under `gpusnap run --light`:
/// (status, stdout, stderr).
fn python(w: &World, light: bool, script: &str, args: &[&str]) -> (ExitStatus, String, String) {
    let mut cmd = if light {
        let mut a = vec!["run", "--light", "--", "python3", "-c", script];
        a.extend_from_slice(args);
        w.gpusnap_cmd(&a)
    } else {
        let mut c = Command::new("python3");
        w.env(&mut c);
        c.args(["-c", script]).args(args).stdin(Stdio::null());
        c
    };
    let out = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).output().unwrap();
    (
        out.status,
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Compiles C source `src` with `cc` into `out` (extra flags after).
fn cc(dir: &Path, src: &str, out: &str, flags: &[&str]) {
    let c = dir.join(format!("{out}.c"));
    std::fs::write(&c, src).unwrap();
    let st = Command::new("cc")
        .arg("-o")
        .arg(dir.join(out))
        .arg(&c)
        .args(flags)
        .current_dir(dir)
        .status()
        .expect("cc (build-essential) is needed for this test");
    assert!(st.success(), "cc {out} failed");
}

/// The busy GPU worker (tests/gpu/dying_worker.py on the fake driver): its
/// main thread is nearly always inside a CUDA call. `pre` runs first (in
/// the same interpreter).
fn busy_worker_args(st: &Path, pre: &str) -> Vec<String> {
    let worker = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/gpu/dying_worker.py");
    let wrap = format!(
        "import runpy, signal, sys\n{pre}\nsys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n"
    );
    vec![
        "python3".into(),
        "-c".into(),
        wrap,
        worker.to_str().unwrap().into(),
        "1".into(),
        st.to_str().unwrap().into(),
        "--backend".into(),
        "driver".into(),
        "--interval".into(),
        "0".into(),
        "--no-setsid".into(),
    ]
}

fn wait_busy(st: &Path) -> i32 {
    wait_for(Duration::from_secs(30), || {
        std::fs::read_to_string(st).is_ok_and(|s| s.split_whitespace().nth(1).is_some_and(|i| i != "0"))
    });
    pid_in(&st.to_path_buf())
}

/// a SIGTERM to `gpusnap run` itself (Kubernetes, `docker stop`)
/// is forwarded to the program and suspends it first, in both modes.
#[test]
fn sigterm_to_the_run_pid_is_suspended_before_it_kills() {
    let mut w = World::new(&[16_384]);
    for mode in [TRACED, LIGHT] {
        let st = status_file(&w, &format!("run-pid{mode}"));
        let wl = fake_workload_bin();
        let idx = w.spawn_gpusnap(&[
            "run",
            mode,
            "--",
            wl.to_str().unwrap(),
            "--mib",
            "512",
            "--status",
            st.to_str().unwrap(),
        ]);
        let pid = pid_in(&st);
        assert_progressing_at(&st);
        kill(w.child_pid(idx), nix::sys::signal::Signal::SIGTERM);
        assert_died_suspended(&w, idx, pid, libc::SIGTERM, "before death (signal SIGTERM", mode);
    }
}

/// CPython's subprocess resets SIGPIPE in a vfork child, which
/// shares the parent's memory; the parent's view of SIGPIPE must stay its
/// own (SIG_IGN), so a save/ignore/restore (libcurl) leaves it ignored and
/// a broken pipe is a BrokenPipeError, not a death.
#[test]
fn light_a_vfork_child_does_not_change_the_parents_signal_view() {
    let w = World::new(&[8192]);
    let script = r#"
import ctypes, os, signal, subprocess, sys
ctypes.CDLL("libcuda.so.1")
libc = ctypes.CDLL(None)
libc.signal.restype = ctypes.c_void_p
libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
for _ in range(3):
    subprocess.run(["true"], check=True)
old = libc.signal(signal.SIGPIPE, 1)  # SIG_IGN, as libcurl does
print("old", old or 0, flush=True)
libc.signal(signal.SIGPIPE, old)
r, w = os.pipe()
os.close(r)
try:
    os.write(w, b"x")
except BrokenPipeError:
    print("BrokenPipeError", flush=True)
"#;
    let (plain, plain_out, plain_err) = python(&w, false, script, &[]);
    let (light, light_out, light_err) = python(&w, true, script, &[]);
    assert_eq!(plain.code(), Some(0), "{plain_err}");
    assert!(plain_out.contains("old 1") && plain_out.contains("BrokenPipeError"), "{plain_out}");
    assert_eq!((light.code(), light.signal()), (Some(0), None), "{light_out}{light_err}");
    assert_eq!(light_out, plain_out, "{light_err}");
}

/// a library whose RUNPATH is `$ORIGIN/sub` dlopens `libplug.so`:
/// it must find it under the preload library as without, and a successful
/// dlopen leaves dlerror() empty.
#[test]
fn light_dlopen_keeps_the_callers_runpath_and_dlerror() {
    let w = World::new(&[8192]);
    let d = w.tmp.path().join("dl");
    std::fs::create_dir_all(d.join("sub")).unwrap();
    cc(&d.join("sub"), "int plug(void) { return 42; }\n", "libplug.so", &["-shared", "-fPIC"]);
    let loader = r#"
#include <dlfcn.h>
#include <stdio.h>
int load_plug(void) {
    void *h = dlopen("libplug.so", RTLD_NOW);
    if (!h) { fprintf(stderr, "dlopen: %s\n", dlerror()); return -1; }
    const char *e = dlerror();
    if (e) { fprintf(stderr, "dlerror after a successful dlopen: %s\n", e); return -2; }
    int (*f)(void) = (int (*)(void))dlsym(h, "plug");
    return f ? f() : -3;
}
"#;
    cc(
        &d,
        loader,
        "libloader.so",
        &["-shared", "-fPIC", "-Wl,--enable-new-dtags,-rpath,$ORIGIN/sub", "-ldl"],
    );
    let script = r#"
import ctypes, sys
r = ctypes.CDLL(sys.argv[1]).load_plug()
print("plug", r, flush=True)
ctypes.CDLL("libcuda.so.1")
sys.exit(0 if r == 42 else 1)
"#;
    let lib = d.join("libloader.so");
    let (plain, plain_out, plain_err) = python(&w, false, script, &[lib.to_str().unwrap()]);
    assert_eq!(plain.code(), Some(0), "{plain_out}{plain_err}");
    let (light, light_out, light_err) = python(&w, true, script, &[lib.to_str().unwrap()]);
    assert_eq!(light.code(), Some(0), "{light_out}{light_err}");
}

/// `int3` resumes after the instruction; unguarded it kills
/// (SIGTRAP), so under the library it must kill too, not return.
#[cfg(target_arch = "x86_64")]
#[test]
fn light_a_trap_that_does_not_repeat_still_kills() {
    let w = World::new(&[8192]);
    let script = r#"
import ctypes, mmap
ctypes.CDLL("libcuda.so.1")
m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
m.write(b"\xcc\xc3")  # int3; ret
ctypes.CFUNCTYPE(None)(ctypes.addressof(ctypes.c_char.from_buffer(m)))()
print("CONTINUED", flush=True)
"#;
    let (plain, _, _) = python(&w, false, script, &[]);
    assert_eq!(plain.signal(), Some(libc::SIGTRAP), "{plain:?}");
    let (light, out, err) = python(&w, true, script, &[]);
    assert_eq!(light.signal(), Some(libc::SIGTRAP), "{light:?}: {out}{err}");
    assert!(!out.contains("CONTINUED"), "{out}");
}

/// a terminating signal with no sender pid (here `alarm`'s
/// SIGALRM, SI_KERNEL; and in light mode a SIGTERM whose sender is in
/// another pid namespace, si_pid 0) to a program busy in CUDA calls is
/// asynchronous: not waited for where it landed (the thread may hold the
/// driver's lock), so the process is suspended and then dies of it.
#[test]
fn an_asynchronous_signal_without_a_sender_pid_is_suspended_before_it_kills() {
    let mut w = World::new(&[16_384]);
    for mode in [TRACED, LIGHT] {
        let st = status_file(&w, &format!("alarm{mode}"));
        let mut args = vec!["run".to_string(), mode.to_string(), "--".to_string()];
        args.extend(busy_worker_args(&st, "signal.setitimer(signal.ITIMER_REAL, 2.0)"));
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        let idx = w.spawn_gpusnap(&a);
        // The alarm may come before the worker reports an iteration.
        let pid = pid_in(&st);
        assert_died_suspended(&w, idx, pid, libc::SIGALRM, "before death (signal SIGALRM)", mode);
    }
    // A SIGTERM from another pid namespace: si_code SI_QUEUE, si_pid 0.
    let st = status_file(&w, "ns");
    let mut args = vec!["run".to_string(), LIGHT.to_string(), "--".to_string()];
    args.extend(busy_worker_args(&st, ""));
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let idx = w.spawn_gpusnap(&a);
    let pid = wait_busy(&st);
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: a zeroed siginfo with the fields the kernel takes from it.
    unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        info.si_signo = libc::SIGTERM;
        info.si_code = libc::SI_QUEUE;
        let r = libc::syscall(libc::SYS_rt_sigqueueinfo, pid, libc::SIGTERM, &info as *const libc::siginfo_t);
        assert_eq!(r, 0, "rt_sigqueueinfo: {}", std::io::Error::last_os_error());
    }
    let s = w.wait_child(idx);
    assert_eq!(s.signal(), Some(libc::SIGTERM), "{s:?}");
    assert_suspended_before_death(&w, pid);
}

/// a guard that does not answer (stopped here) must not hang a
/// dying light program: it waits GPUSNAP_GUARD_WAIT_MS of silence, then
/// dies unsuspended, and the guard journals that it did not answer.
#[test]
fn light_a_guard_that_does_not_answer_does_not_hang_a_dying_program() {
    let mut w = World::new(&[16_384]);
    let st = status_file(&w, "stopped");
    let wl = fake_workload_bin();
    let idx = w.spawn_gpusnap_env(
        &["run", "--light", "--", wl.to_str().unwrap(), "--mib", "512", "--status", st.to_str().unwrap()],
        &[("GPUSNAP_GUARD_WAIT_MS", "1500")],
    );
    let pid = pid_in(&st);
    assert_progressing_at(&st);
    let run = w.child_pid(idx);
    kill(run, nix::sys::signal::Signal::SIGSTOP);
    std::fs::write(format!("{}.exit", st.display()), b"").unwrap();
    wait_for(Duration::from_secs(30), || dead(pid));
    kill(run, nix::sys::signal::Signal::SIGCONT);
    assert_eq!(w.wait_child(idx).code(), Some(3));
    wait_for(Duration::from_secs(20), || history_notes(&w, pid).iter().any(|n| n.contains("did not answer")));
}

/// `run --light` serves its socket while a process of the tree
/// lives, not only the leader: a child that outlives it is still guarded.
#[test]
fn light_run_guards_children_that_outlive_the_leader() {
    let mut w = World::new(&[16_384]);
    let st = status_file(&w, "orphan");
    let wl = fake_workload_bin();
    let script = format!("\"{}\" --mib 256 --status \"{}\" & exit 0", wl.display(), st.display());
    let idx = w.spawn_gpusnap(&["run", "--light", "--", "sh", "-c", &script]);
    let kid = pid_in(&st);
    assert_progressing_at(&st);
    // The leader (sh) is gone; the child runs on, and so does `run`.
    assert!(w.children[idx].try_wait().is_none(), "run ended with its leader");
    std::fs::write(format!("{}.exit", st.display()), b"").unwrap();
    assert_eq!(w.wait_child(idx).code(), Some(0));
    assert!(dead(kid));
    assert_suspended_before_death(&w, kid);
}

/// a library linked at start registers (in its constructor) an
/// exit handler that makes a CUDA call. The suspend must come after it: a
/// CUDA call of a suspended process blocks for good.
#[test]
fn light_exit_handlers_of_libraries_linked_at_start_run_before_the_suspend() {
    let w = World::new(&[16_384]);
    let d = w.tmp.path().join("early");
    std::fs::create_dir_all(&d).unwrap();
    let early = r#"
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
static void late(void) {
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    int (*sync)(void) = h ? (int (*)(void))dlsym(h, "cuCtxSynchronize") : 0;
    fprintf(stderr, "late handler rc=%d\n", sync ? sync() : -1);
}
__attribute__((constructor)) static void early_init(void) { atexit(late); }
void early_hello(void) {}
"#;
    cc(&d, early, "libearly.so", &["-shared", "-fPIC", "-ldl"]);
    let main = r#"
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
extern void early_hello(void);
int main(void) {
    early_hello();
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!h) return 10;
    int (*init)(unsigned) = (int (*)(unsigned))dlsym(h, "cuInit");
    int (*dev)(int *, int) = (int (*)(int *, int))dlsym(h, "cuDeviceGet");
    int (*ctx)(void **, unsigned, int) = (int (*)(void **, unsigned, int))dlsym(h, "cuCtxCreate_v2");
    int (*alloc)(unsigned long long *, size_t) = (int (*)(unsigned long long *, size_t))dlsym(h, "cuMemAlloc_v2");
    int d = 0; void *c = 0; unsigned long long p = 0;
    if (init(0) || dev(&d, 0) || ctx(&c, 0, d) || alloc(&p, 64u << 20)) return 11;
    printf("%d ready\n", getpid());
    fflush(stdout);
    exit(0);
}
"#;
    cc(&d, main, "main", &["-L.", "-learly", "-Wl,-rpath,$ORIGIN", "-ldl", "-include", "unistd.h"]);
    let (o, e) = (w.tmp.path().join("early.out"), w.tmp.path().join("early.err"));
    let mut cmd = w.gpusnap_cmd(&["run", "--light", "--", d.join("main").to_str().unwrap()]);
    cmd.stdout(std::fs::File::create(&o).unwrap()).stderr(std::fs::File::create(&e).unwrap());
    let mut child = cmd.spawn().unwrap();
    // Before the fix the late handler's CUDA call blocked for good.
    let mut status = None;
    wait_for(Duration::from_secs(60), || {
        status = child.try_wait().unwrap();
        status.is_some()
    });
    let (stdout, stderr) = (std::fs::read_to_string(&o).unwrap(), std::fs::read_to_string(&e).unwrap());
    assert_eq!(status.unwrap().code(), Some(0), "{stdout}{stderr}");
    assert!(stderr.contains("late handler rc=0"), "{stderr}");
    let pid: i32 = stdout.split_whitespace().next().unwrap().parse().unwrap();
    assert_suspended_before_death(&w, pid);
}

/// attaching to a program that makes a thread every 0.5 ms: a
/// thread made by one already seized is ours already (EPERM on a second
/// seize), one may end before it is seized (ESRCH). Neither may fail
/// `guard PID`, nor the keeper's takeover after the guard is killed.
#[test]
fn traced_attach_races_with_threads_that_come_and_go() {
    let mut w = World::new(&[16_384]);
    // Many threads to seize (so the first pass takes a while), and one that
    // makes a short-lived thread every 0.5 ms.
    let pid = w.workload(256, 0, &["--churn-us", "500", "--threads", "300"]);
    let r = w.gpusnap(&["guard", "--daemon", &pid.to_string()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let guard = tracer(pid);
    assert!(guard > 0);
    let mut guard = guard;
    for _ in 0..3 {
        // The keeper's takeover attaches to the same churning program; the
        // new guard is killed again as soon as it traces the program (even
        // while it is still attaching).
        kill(guard, nix::sys::signal::Signal::SIGKILL);
        wait_for(Duration::from_secs(30), || {
            let t = tracer(pid);
            t > 0 && t != guard
        });
        guard = tracer(pid);
    }
    kill(pid, nix::sys::signal::Signal::SIGABRT);
    wait_for(Duration::from_secs(30), || !w.alive(pid));
    assert_suspended_before_death(&w, pid);
    kill_quietly(guard);
}

fn kill_quietly(pid: i32) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
}

/// while the traced guard suspends a process (a SIGTERM to a
/// busy program, a slow checkpoint), the program's other stops are still
/// served: a storm of SIGUSR1 (it has a handler) must not leave a thread
/// stopped, maybe holding the lock the suspend waits for.
#[test]
fn traced_stops_are_served_while_a_suspend_runs() {
    let mut w = World::with_config(&[16_384], serde_json::json!({ "checkpoint_gbps": 0.5 }));
    let st = status_file(&w, "storm");
    // A second thread queues 200 ms of GPU work over and over (so the
    // guard's lock waits for it, and the thread is nearly always inside the
    // driver, holding its lock), and takes the SIGUSR1 storm.
    let pre = r#"
import ctypes, os, threading, time
signal.signal(signal.SIGUSR1, lambda *a: None)
status = sys.argv[3]
def enqueue():
    cu = ctypes.CDLL("libcuda.so.1")
    while not os.path.exists(status):
        time.sleep(0.01)
    with open(status + ".tid.tmp", "w") as f:
        f.write(str(threading.get_native_id()))
    os.replace(status + ".tid.tmp", status + ".tid")
    while True:
        cu.fakeEnqueueWork(200)
threading.Thread(target=enqueue, daemon=True).start()
"#;
    let mut args = vec!["run".to_string(), TRACED.to_string(), "--".to_string()];
    args.extend(busy_worker_args(&st, pre));
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let idx = w.spawn_gpusnap(&a);
    let pid = wait_busy(&st);
    let tid_file = PathBuf::from(format!("{}.tid", st.display()));
    wait_for(Duration::from_secs(20), || tid_file.exists());
    let tid: i32 = std::fs::read_to_string(&tid_file).unwrap().trim().parse().unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let s2 = std::sync::Arc::clone(&stop);
    let storm = std::thread::spawn(move || {
        while !s2.load(std::sync::atomic::Ordering::SeqCst) {
            // SAFETY: tgkill with integer arguments.
            if unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, libc::SIGUSR1) } != 0 {
                break;
            }
            std::thread::sleep(Duration::from_micros(500));
        }
    });
    std::thread::sleep(Duration::from_millis(300));
    kill(pid, nix::sys::signal::Signal::SIGTERM);
    let s = w.wait_child(idx);
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    storm.join().unwrap();
    assert_eq!(s.signal(), Some(libc::SIGTERM), "{s:?}");
    assert_suspended_before_death(&w, pid);
}

/// Low items, light mode: `bsd_signal`, `sysv_signal` and `sigset` see the
/// default where the library's handler sits, and resetting through them
/// brings the guard back; `signal` keeps libc's flags (siginterrupt).
#[test]
fn light_the_whole_signal_family_sees_its_own_dispositions() {
    let w = World::new(&[16_384]);
    let script = r#"
import ctypes, os, signal, sys, time
ctypes.CDLL("libcuda.so.1")
libc = ctypes.CDLL(None)
for name in ("signal", "bsd_signal", "sysv_signal", "sigset"):
    f = getattr(libc, name)
    f.restype = ctypes.c_void_p
    f.argtypes = [ctypes.c_int, ctypes.c_void_p]
    old = f(signal.SIGTERM, 1)
    assert (old or 0) == 0, (name, old)
    assert (f(signal.SIGTERM, 0) or 0) == 1, name
print("views ok", flush=True)
"#;
    let (plain, out, err) = python(&w, false, script, &[]);
    assert!(plain.success() && out.contains("views ok"), "{out}{err}");
    let (light, out, err) = python(&w, true, script, &[]);
    assert!(light.success() && out.contains("views ok"), "{out}{err}");
}

/// Low item: the guards' directory, where the sockets are bound before
/// their mode can be set, is private: made 0700 when missing, and an
/// existing one that others can write is refused with the fix (as every
/// directory of the state dir is), never used.
#[test]
fn the_guard_socket_directory_is_private() {
    use std::os::unix::fs::PermissionsExt;
    let mut w = World::new(&[8192]);
    let dir: PathBuf = w.state_dir().join("guards");
    for mode in [LIGHT, TRACED] {
        let _ = std::fs::remove_dir_all(&dir);
        let idx = w.spawn_gpusnap(&["run", mode, "--", "sleep", "1"]);
        assert_eq!(w.wait_child(idx).code(), Some(0), "{mode}");
        let m = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(m, 0o700, "{mode}: {m:o}");

        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let r = w.gpusnap(&["run", mode, "--", "true"]);
        assert_eq!(r.code, 1, "{mode}: {} {}", r.stdout, r.stderr);
        assert!(r.stderr.contains("writable by others"), "{mode}: {}", r.stderr);
        let m = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(m, 0o777, "{mode}: refused, left as it was: {m:o}");
    }
}
