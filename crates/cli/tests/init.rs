//! The driver's start-up (`cuInit`) runs in the background of a command's
//! first steps; one that fails (a driver that loads but cannot start, set by
//! the fake's `init_rc`) still gives the errors and exit codes it gave when
//! it was waited for at load. No timings here: the overlap itself is
//! measured on the GPU (bench/gpu/init-timing.sh).

mod common;

use common::*;
use serde_json::json;
use std::time::Duration;

const NO_DEVICE: &str = "cuInit failed: CUDA_ERROR_NO_DEVICE (100)";

/// One line on stderr, containing `what`.
fn one_line(r: &Run, what: &str) {
    assert!(r.stderr.contains(what), "{}", r.stderr);
    assert_eq!(r.stderr.trim_end().lines().count(), 1, "{}", r.stderr);
}

#[test]
fn a_driver_that_cannot_start_fails_each_command_as_at_load() {
    let mut w = World::new(&[8192]);
    let pid = w.workload(512, 0, &[]);
    let p = pid.to_string();
    // Set after the workload started: it calls cuInit too.
    w.set_config("init_rc", json!(100));
    w.set_config("init_ms", json!(200));
    for args in [vec!["suspend", &p], vec!["resume", &p], vec!["state", &p], vec!["ps"]] {
        let r = w.gpusnap(&args);
        assert_eq!(r.code, 1, "{args:?}: {}", r.stderr);
        one_line(&r, NO_DEVICE);
    }
    // Bad input is still bad input, found before the driver is asked.
    let r = w.gpusnap(&["state", "999999999"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert_eq!(r.stderr.trim_end().lines().count(), 1, "{}", r.stderr);
    // The driver was never asked about the process, and it runs on.
    assert!(w.calls_on(pid).is_empty(), "{:?}", w.calls_on(pid));
    w.assert_progressing(pid);
    // A plain process is still stopped (stop is lenient: no driver, no CUDA).
    let mut sleep = std::process::Command::new("sleep").arg("30").spawn().unwrap();
    let r = w.gpusnap(&["stop", &sleep.id().to_string(), "--grace", "1"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let _ = sleep.wait();

    w.set_config("init_rc", json!(0));
    let r = w.gpusnap(&["suspend", &p]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(w.gpusnap(&["resume", &p]).code, 0);
    w.assert_progressing(pid);
}

#[test]
fn a_wake_whose_driver_cannot_start_is_refused_and_can_be_retried() {
    criu_present();
    let mut w = World::new(&[8192]);
    let pid = w.workload(1024, 0, &[]);
    let p = pid.to_string();
    assert_eq!(w.json(&["hibernate", &p, "--image", "i"]).code, 0);
    w.reap(pid);
    let before = w.calls_on(pid);
    w.set_config("init_rc", json!(100));
    w.set_config("init_ms", json!(300));
    for eager in [false, true] {
        let mut args = vec!["wake", "i", "--wait", "10"];
        if eager {
            args.push("--eager");
        }
        let r = w.gpusnap(&args);
        // As on a host without a driver: the image is refused (exit 2).
        assert_eq!(r.code, 2, "{args:?}: {}", r.stderr);
        one_line(
            &r,
            "this host cannot take image i: it holds CUDA processes and this host has no CUDA driver",
        );
        // What CRIU restored while the driver started was ended, the
        // driver never asked to restore it; the image stays.
        wait_for(Duration::from_secs(10), || !pid_exists(pid));
        assert_eq!(w.calls_on(pid), before);
        assert_eq!(w.json(&["images", "verify", "i"]).code, 0);
    }
    w.set_config("init_rc", json!(0));
    let r = w.json(&["wake", "i", "--wait", "10"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    w.assert_progressing(pid);
    assert_eq!(w.json(&["stop", &p, "--grace", "2"]).code, 0);
}

#[test]
fn a_plain_tree_wakes_while_the_driver_cannot_start() {
    criu_present();
    let mut w = World::new(&[8192]);
    let (pid, out) = w.cpu_tree();
    let p = pid.to_string();
    assert_eq!(w.json(&["hibernate", &p, "--image", "cpu"]).code, 0);
    w.reap(pid);
    wait_for(Duration::from_secs(10), || !pid_exists(pid));
    let at = count(&out);
    w.set_config("init_rc", json!(100));
    let r = w.json(&["wake", "cpu", "--wait", "10"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    wait_for(Duration::from_secs(10), || count(&out) > at + 3);
}

#[test]
fn the_guard_runs_a_program_while_the_driver_cannot_start() {
    let w = World::new(&[8192]);
    w.set_config("init_rc", json!(100));
    // Its exit is looked at by the driver (no CUDA state: no driver) and passed on.
    for light in [false, true] {
        let mut args = vec!["run", "--no-keeper"];
        if light {
            args = vec!["run", "--light"];
        }
        args.extend(["--", "sh", "-c", "exit 3"]);
        let r = w.gpusnap(&args);
        assert_eq!(r.code, 3, "{args:?}: {}", r.stderr);
    }
}

/// `stop` of a plain process right after it was started, over and over
/// while other threads keep the CPU busy: each one is found and ended,
/// never reported missing. Bounded in count and in time, not timed.
#[test]
fn a_process_stopped_right_after_it_starts_is_found_and_ended() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let w = World::new(&[8192]);
    w.set_config("init_rc", json!(100));
    w.set_config("init_ms", json!(200));
    let done = Arc::new(AtomicBool::new(false));
    let hogs: Vec<_> = (0..2)
        .map(|_| {
            let done = Arc::clone(&done);
            std::thread::spawn(move || {
                while !done.load(Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        })
        .collect();
    let until = std::time::Instant::now() + Duration::from_secs(60);
    let mut runs = 0;
    while runs < 40 && std::time::Instant::now() < until {
        let mut sleep = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let r = w.gpusnap(&["stop", &sleep.id().to_string(), "--grace", "1"]);
        let _ = sleep.kill();
        let _ = sleep.wait();
        if r.code != 0 {
            done.store(true, Ordering::Relaxed);
        }
        assert_eq!(r.code, 0, "run {runs}: {}", r.stderr);
        runs += 1;
    }
    done.store(true, Ordering::Relaxed);
    for h in hogs {
        h.join().unwrap();
    }
}
