//! The fast-swap control channel cannot be held or spoofed by another
//! process: a name bound by an earlier holder of the program's pid never
//! answers for it (`state` shows no fast swap, `suspend` does not skip its
//! offload on its word), names bound in advance cannot keep a program's
//! library from listening, and a library that cannot listen says so.

mod common;

use common::*;
use std::io::BufRead;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

/// A python program, run as `uid`, that binds the control socket names a
/// process would have had (the bare `@gpusnap-swap-PID` and a guess at the
/// random form) for its own pid, or with `ahead` above 0 for the `ahead`
/// pids after its own, answers
/// every connection as a library whose memory is offloaded, prints
/// `ready PID` and then, with `--leave`, exits while a child of it keeps
/// the sockets open and answering.
fn squatter(uid: u32, ahead: u32, leave: bool) -> std::process::Child {
    let script = r#"
import os, resource, selectors, socket, sys
ahead = int(sys.argv[1])
pids = range(os.getpid() + 1, os.getpid() + ahead) if ahead else [os.getpid()]
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
sel = selectors.DefaultSelector()
for p in pids:
    for name in ("gpusnap-swap-%d" % p, "gpusnap-swap-%d-%s" % (p, "0" * 32)):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind("\0" + name)
        except OSError:
            s.close()
            continue
        s.listen(16)
        sel.register(s, selectors.EVENT_READ)
lie = "phase=offloaded gate=closed movable=1 movable_bytes=1048576 kept=0 kept_bytes=0 kept_why=- ipc_refused=0"
def serve():
    while True:
        for key, _ in sel.select():
            c, _ = key.fileobj.accept()
            req = c.recv(64).decode().strip()
            if req == "status":
                c.sendall(("ok " + lie + "\n").encode())
            else:
                c.sendall(("ok bytes=1048576 ms=1 " + lie + "\n").encode())
            c.close()
if sys.argv[2] == "leave":
    child = os.fork()
    if child == 0:
        os.setsid()
        os.close(1)
        serve()
    print("ready", os.getpid(), child, flush=True)
    os._exit(0)
print("ready", os.getpid(), os.getpid(), flush=True)
os.close(1)
serve()
"#;
    Command::new(python3())
        .args(["-c", script, &ahead.to_string(), if leave { "leave" } else { "stay" }])
        .uid(uid)
        .gid(uid)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("python3")
}

/// The squatter's pid and the pid of the process holding its sockets,
/// printed once they listen.
fn ready(child: &mut std::process::Child) -> (i32, i32) {
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let p: Vec<i32> = line.split_whitespace().skip(1).filter_map(|p| p.parse().ok()).collect();
    assert_eq!(p.len(), 2, "the squatter is ready: {line:?}");
    (p[0], p[1])
}

/// A python3 another user can run (not a shim in root's home).
fn python3() -> &'static str {
    if std::path::Path::new("/usr/bin/python3").exists() {
        "/usr/bin/python3"
    } else {
        "python3"
    }
}

/// The processes squatters left holding their sockets, ended on drop.
#[derive(Default)]
struct Holders(Vec<i32>);

impl Drop for Holders {
    fn drop(&mut self) {
        for &pid in &self.0 {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
        }
    }
}

fn uid_of_stranger() -> u32 {
    if nix::unistd::geteuid().is_root() {
        65534
    } else {
        nix::unistd::geteuid().as_raw()
    }
}

#[test]
fn a_socket_bound_by_an_earlier_holder_of_the_pid_never_answers_for_the_process() {
    if !nix::unistd::geteuid().is_root() {
        gpusnap_testkit::skip(
            "needs root (gives a freed pid to the next process, /proc/sys/kernel/ns_last_pid)",
        );
        return;
    }
    let mut w = World::new(&[16_384]);
    let mut holders = Holders::default();
    // A process of another user binds the names of its own pid, leaves a
    // child listening on them, and ends; the next process given that pid
    // is a CUDA program of root's. The pid must be handed on: the kernel
    // gives out the pid after ns_last_pid, which another process on a busy
    // host may take first, so the replay is tried again until it lands.
    let mut victim = None;
    for _ in 0..50 {
        let mut sq = squatter(uid_of_stranger(), 0, true);
        let (n, holder) = ready(&mut sq);
        let _ = sq.wait();
        holders.0.push(holder);
        std::fs::write("/proc/sys/kernel/ns_last_pid", (n - 1).to_string()).unwrap();
        let pid = w.workload(256, 0, &[]);
        if pid == n {
            victim = Some(pid);
            break;
        }
        w.kill(pid);
    }
    let Some(pid) = victim else {
        return gpusnap_testkit::skip("another process took the freed pid first, 50 times over");
    };
    let p = pid.to_string();
    let state = w.json(&["state", &p]);
    assert_eq!(state.code, 0, "{}", state.stderr);
    assert!(
        state.json()["fast_swap"].is_null(),
        "the stranger's word is not the process's: {}",
        state.stdout
    );
    let r = w.json(&["suspend", &p]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let notes = history_notes(&w, pid);
    assert!(
        !notes.iter().any(|n| n.contains("already offloaded")),
        "the suspend took a stranger's word: {notes:?}"
    );
    assert_eq!(w.json(&["state", &p]).json()["state"], "checkpointed", "the driver checkpointed its memory");
    assert_eq!(w.json(&["resume", &p]).code, 0);
    w.assert_progressing(pid);
}

#[test]
fn names_taken_in_advance_do_not_keep_a_program_from_fast_swap() {
    let mut w = World::new(&[16_384]);
    // The names of the next few thousand pids, bound before the program
    // starts.
    let mut sq = squatter(uid_of_stranger(), 3000, false);
    let (squatting, _) = ready(&mut sq);
    let _ended = Holders(vec![squatting]);
    let st = status_file(&w, "fs");
    let wl = fake_workload_bin();
    w.spawn_gpusnap(&[
        "run",
        "--light",
        "--fast-swap",
        "--",
        wl.to_str().unwrap(),
        "--mib",
        "256",
        "--status",
        st.to_str().unwrap(),
    ]);
    let pid = pid_in(&st);
    assert_progressing_at(&st);
    let state = w.json(&["state", &pid.to_string()]);
    assert_eq!(state.json()["fast_swap"]["phase"], "resident", "{}", state.stdout);
    let r = w.json(&["suspend", &pid.to_string()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(history_notes(&w, pid).iter().any(|n| n.contains("moved to pinned host memory")));
    assert_eq!(w.json(&["resume", &pid.to_string()]).code, 0);
    assert_progressing_at(&st);
    std::fs::write(format!("{}.exit", st.display()), b"").unwrap();
}

#[test]
fn a_library_that_cannot_listen_says_so_and_doctor_names_it() {
    let mut w = World::new(&[16_384]);
    let name = format!("gpusnap-swap-taken-{}", std::process::id());
    use std::os::linux::net::SocketAddrExt;
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let taken = std::os::unix::net::UnixListener::bind_addr(&addr).unwrap();
    let st = status_file(&w, "fs");
    let err = st.with_extension("err");
    let wl = fake_workload_bin();
    w.spawn_gpusnap_env(
        &[
            "run",
            "--light",
            "--fast-swap",
            "--",
            "sh",
            "-c",
            "exec \"$0\" \"$@\" 2>\"$ERR\"",
            wl.to_str().unwrap(),
            "--mib",
            "256",
            "--status",
            st.to_str().unwrap(),
        ],
        &[("GPUSNAP_FAST_SWAP_NAME", &name), ("ERR", err.to_str().unwrap())],
    );
    let pid = pid_in(&st);
    assert_progressing_at(&st);
    let said = std::fs::read_to_string(&err).unwrap_or_default();
    assert!(
        said.contains(&format!("fast swap is off in process {pid}: cannot listen on @{name}")),
        "the program's stderr: {said}"
    );
    let d = w.json(&["doctor", &pid.to_string()]);
    let text = d.stdout.clone();
    assert!(text.contains("fast swap was asked for but its library does not listen"), "doctor: {text}");
    drop(taken);
    std::fs::write(format!("{}.exit", st.display()), b"").unwrap();
}
