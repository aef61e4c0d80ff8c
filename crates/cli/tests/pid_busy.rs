//! A pid an image needs, held by another program. In a test binary of its
//! own: it moves the kernel's pid counter (ns_last_pid), and so the pids of
//! every process started meanwhile, which would make the other image tests'
//! pids collide if they ran beside it.

mod common;

use common::*;
use std::time::Duration;

#[test]
fn a_pid_held_by_another_program_is_named() {
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
            eprintln!("skipped: cannot set ns_last_pid here");
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
        eprintln!("skipped: another process took the pid first every time");
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
