//! Quiescence before the driver's lock: a fast-swap program whose threads
//! are always inside the driver (a launcher of kernels, a reader looping on
//! synchronizes and blocking device-to-host reads, as JAX reading results
//! back) is locked only once its library says no thread is inside a driver
//! call; one that stays inside a long synchronize fails the suspend, named,
//! with no lock.

mod common;

use common::*;
use serde_json::Value;
use std::path::PathBuf;
use std::time::Duration;

fn fast_swap_of(w: &World, pid: i32) -> Value {
    let ps = w.json(&["ps"]).json();
    ps["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pid"] == pid)
        .map(|p| p["fast_swap"].clone())
        .unwrap_or_default()
}

fn run_fast(w: &mut World, st: &PathBuf, extra: &[&str], env: &[(&str, &str)]) -> i32 {
    let wl = fake_workload_bin();
    let mut args =
        vec!["run", "--light", "--fast-swap", "--", wl.to_str().unwrap(), "--status", st.to_str().unwrap()];
    args.extend_from_slice(extra);
    let mut all = vec![("GPUSNAP_FAST_SWAP_VERIFY", "1")];
    all.extend_from_slice(env);
    w.spawn_gpusnap_env(&args, &all);
    pid_in(st)
}

/// The fake driver's `lock_inside` notes on `pid`: locks that came while a
/// thread of it was inside a driver call.
fn locks_inside(w: &World, pid: i32) -> usize {
    w.journal().iter().filter(|(c, p, _)| c == "lock_inside" && *p == pid).count()
}

#[test]
fn a_program_always_inside_the_driver_is_locked_only_once_quiesced_twenty_times_with_its_data_intact() {
    // Reads of 1 MiB at 0.05 GB/s block for ~20 ms each; kernels of 30 ms
    // follow one another, so the reader is nearly always inside a
    // synchronize or a read.
    let mut w = World::with_config(&[16_384], serde_json::json!({ "copy_gbps": 0.05 }));
    let st = status_file(&w, "q");
    let pid = run_fast(&mut w, &st, &["--mib", "2", "--data-kib", "1024", "--sync-loop", "30"], &[]);
    assert_progressing_at(&st);
    let p = pid.to_string();
    for round in 0..20 {
        let r = w.json(&["suspend", &p]);
        assert_eq!(r.code, 0, "round {round}: {}", r.stderr);
        let fs = fast_swap_of(&w, pid);
        assert_eq!((fs["phase"].as_str(), fs["inside"].as_u64()), (Some("offloaded"), Some(0)), "{fs}");
        let r = w.json(&["resume", &p]);
        assert_eq!(r.code, 0, "round {round}: {}", r.stderr);
        // Progressing and intact: the reader's reads and the main loop's.
        assert_progressing_at(&st);
        assert_eq!(locks_inside(&w, pid), 0, "round {round}: the driver locked a thread inside a call");
    }
    let locks = w.calls_on(pid).iter().filter(|c| c.as_str() == "lock=0").count();
    assert_eq!(locks, 20);
    assert_eq!(w.json(&["stop", &p]).code, 0);
}

#[test]
fn a_thread_that_never_leaves_a_synchronize_fails_the_suspend_named_and_the_driver_never_locks() {
    let mut w = World::new(&[16_384]);
    let st = status_file(&w, "stuck");
    // Kernels of 60 s: the reader stays inside one cuCtxSynchronize.
    let pid =
        run_fast(&mut w, &st, &["--mib", "2", "--sync-loop", "60000"], &[("GPUSNAP_FAST_SWAP_DRAIN_S", "1")]);
    wait_for(Duration::from_secs(20), || fast_swap_of(&w, pid)["inside"].as_u64().unwrap_or(0) >= 1);
    let r = w.json(&["suspend", &pid.to_string()]);
    assert_eq!(r.code, 1, "{} {}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("not quiesced")
            && r.stderr.contains("cuCtxSynchronize")
            && r.stderr.contains("not locked"),
        "{}",
        r.stderr
    );
    assert!(!w.calls_on(pid).iter().any(|c| c.starts_with("lock")), "{:?}", w.calls_on(pid));
    let fs = fast_swap_of(&w, pid);
    assert_eq!(fs["phase"], "resident", "{fs}");
    assert_eq!(w.json(&["state", &pid.to_string()]).json()["state"], "running");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).unwrap();
}
