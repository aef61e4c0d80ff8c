//! A pid an image (or a suspended process) needs, held by another program. In a test binary of its
//! own: it moves the kernel's pid counter (ns_last_pid), and so the pids of
//! every process started meanwhile, which would make the other image tests'
//! pids collide if they ran beside it.

mod common;

use common::*;
use std::time::Duration;

/// The tests here move the pid counter one at a time: one's squatting must
/// not hand another's pid away.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn a_pid_held_by_another_program_is_named() {
    let _serial = serial();
    criu_present();
    let mut w = World::new(&[8192]);
    let (pid, _) = w.cpu_tree();
    assert_eq!(w.json(&["hibernate", &pid.to_string(), "--image", "busy"]).code, 0);
    w.reap(pid);
    wait_for(Duration::from_secs(10), || !pid_exists(pid));
    // Hand the pid to another program, the way CRIU itself picks pids.
    let mut squatter = None;
    for _ in 0..50 {
        if std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).is_err() {
            gpusnap_testkit::skip("cannot set ns_last_pid here");
            return;
        }
        let c = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        if c.id() as i32 == pid {
            squatter = Some(c);
            break;
        }
        let mut c = c;
        let _ = c.kill();
        let _ = c.wait();
    }
    let Some(mut squatter) = squatter else {
        gpusnap_testkit::skip("another process took the pid first every time");
        return;
    };
    let r = w.json(&["wake", "busy", "--wait", "1"]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert_eq!(r.json()["error"]["kind"], "pid_busy");
    assert!(r.stderr.contains(&format!("pid {pid} is held by another program (sleep)")), "{}", r.stderr);
    let _ = squatter.kill();
    let _ = squatter.wait();
    let r = w.json(&["wake", "busy", "--wait", "10"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
}

/// Starts `prog args` (with the world's environment) until it gets `pid`,
/// the way CRIU itself picks pids; `None` when that is not possible here.
fn squat(w: &mut World, pid: i32, prog: &str, args: &[&str]) -> Option<usize> {
    for _ in 0..50 {
        if std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).is_err() {
            gpusnap_testkit::skip("cannot set ns_last_pid here");
            return None;
        }
        let i = w.spawn_env(prog, args);
        if w.child_pid(i) == pid {
            return Some(i);
        }
        w.children[i].kill();
        w.children[i].wait();
    }
    gpusnap_testkit::skip("another process took the pid first every time");
    None
}

/// A suspended process that died, its pid handed to a new copy of the same
/// program with the same command line: not the process gpusnap suspended
/// (it runs, in the time namespace the old one had), so resume refuses it.
#[test]
fn the_same_program_started_anew_under_a_suspended_pid_is_refused() {
    let _serial = serial();
    let mut w = World::new(&[8192]);
    let status = w.tmp.path().join("same-status");
    let s = status.to_str().unwrap().to_string();
    let args = ["--mib", "512", "--gpu", "0", "--status", &s];
    let first = w.spawn_env(fake_workload_bin().to_str().unwrap(), &args);
    let pid = w.child_pid(first);
    wait_for(Duration::from_secs(20), || read_status(&status).is_some_and(|x| x.0 == pid && x.1 >= 1));
    let p = pid.to_string();
    assert_eq!(w.json(&["suspend", &p]).code, 0);
    w.children[first].kill();
    w.children[first].wait();
    wait_for(Duration::from_secs(10), || !pid_exists(pid));
    let _ = std::fs::remove_file(&status);
    let Some(_) = squat(&mut w, pid, fake_workload_bin().to_str().unwrap(), &args) else { return };
    wait_for(Duration::from_secs(20), || read_status(&status).is_some_and(|x| x.0 == pid && x.1 >= 1));
    let r = w.json(&["resume", &p]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert_eq!(r.json()["error"]["kind"], "pid_reused");
    assert!(r.stderr.contains("now belongs to another program"), "{}", r.stderr);
    let r = w.json(&["resume", &p, "--footprint", "512"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    // It is simply another process: state and suspend work on it, unchanged.
    assert_eq!(w.json(&["state", &p]).json()["state"], "running");
    assert_progressing_at(&status);
}

/// The same, with another program (`sleep`) on the pid.
#[test]
fn another_program_under_a_suspended_pid_is_refused() {
    let _serial = serial();
    let mut w = World::new(&[8192]);
    let pid = w.workload(512, 0, &[]);
    let p = pid.to_string();
    assert_eq!(w.json(&["suspend", &p]).code, 0);
    w.kill(pid);
    wait_for(Duration::from_secs(10), || !pid_exists(pid));
    let Some(_) = squat(&mut w, pid, "sleep", &["30"]) else { return };
    for args in [vec!["resume", &p], vec!["resume", &p, "--footprint", "512"]] {
        let r = w.json(&args);
        assert_eq!(r.code, 2, "{}", r.stderr);
        assert_eq!(r.json()["error"]["kind"], "pid_reused");
    }
}
