//! `gpusnap park`: a fast-swap program's library moves its memory to pinned
//! host memory and the driver is never asked to lock or checkpoint it (the
//! context stays on the GPU: the residual). `resume` is admitted for the
//! moved bytes and brings them back; `suspend` finishes the job with the
//! driver; the guard and `stop` treat a parked process as a running one; a
//! gpusnap killed in either phase leaves a state the next command reads.

mod common;

use common::*;
use serde_json::Value;
use std::time::Duration;

fn state_of(w: &World, pid: i32) -> Value {
    w.json(&["state", &pid.to_string()]).json()
}

fn phase(w: &World, pid: i32) -> String {
    state_of(w, pid)["fast_swap"]["phase"].as_str().unwrap_or("").to_string()
}

fn ps_row(w: &World, pid: i32) -> Value {
    let ps = w.json(&["ps"]).json();
    ps["processes"].as_array().unwrap().iter().find(|p| p["pid"] == pid).cloned().unwrap_or_default()
}

fn driver_calls(w: &World, pid: i32, name: &str) -> usize {
    w.calls_on(pid).iter().filter(|c| c.starts_with(name)).count()
}

/// Whether the workload stands still (its memory away, it waits at the gate).
fn standing_still(st: &std::path::Path) -> bool {
    let before = read_status(st).unwrap().1;
    std::thread::sleep(Duration::from_millis(400));
    read_status(st).unwrap().1 == before
}

#[test]
fn a_parked_program_keeps_its_context_on_the_gpu_and_comes_back_intact() {
    let mut w = World::with_config(&[16_384], serde_json::json!({ "context_mib": 100 }));
    let st = status_file(&w, "park");
    let (_idx, pid) = run_fast(&mut w, &st, &["--mib", "256", "--extra-allocs", "1", "--managed-mib", "64"]);
    assert_progressing_at(&st);
    let p = pid.to_string();
    for round in 0..2 {
        let r = w.json(&["park", &p]);
        assert_eq!(r.code, 0, "round {round}: {} {}", r.stdout, r.stderr);
        let res = &r.json()["results"][0];
        assert_eq!(res["state"], "parked", "{res}");
        assert_eq!(res["host_bytes"].as_u64(), Some(512 * MIB), "{res}");
        // The context (100 MiB) and the managed memory stay on the GPU.
        assert_eq!(res["residual_bytes"].as_u64(), Some(164 * MIB), "{res}");
        assert_eq!(res["footprint_bytes"].as_u64(), Some(676 * MIB), "{res}");
        // The driver was never asked to lock or checkpoint it.
        assert_eq!(driver_calls(&w, pid, "lock") + driver_calls(&w, pid, "checkpoint"), 0, "round {round}");
        let s = state_of(&w, pid);
        assert_eq!(s["state"], "parked", "{s}");
        assert_eq!(s["parked"]["residual_bytes"].as_u64(), Some(164 * MIB), "{s}");
        assert_eq!(s["parked"]["host_bytes"].as_u64(), Some(512 * MIB), "{s}");
        assert_eq!(s["footprint_bytes"].as_u64(), Some(164 * MIB), "NVML's figure: {s}");
        let row = ps_row(&w, pid);
        assert_eq!(
            (row["state"].as_str(), row["parked"]["host_bytes"].as_u64()),
            (Some("parked"), Some(512 * MIB))
        );
        assert!(standing_still(&st), "no copy ran while its memory was away");
        // Parking again changes nothing.
        let again = w.json(&["park", &p]);
        assert_eq!(again.code, 0, "{}", again.stderr);
        assert_eq!(again.json()["results"][0]["already"], true);
        assert!(history_notes(&w, pid).iter().any(|n| n.contains("512 MiB in pinned host memory")));

        let r = w.json(&["resume", &p]);
        assert_eq!(r.code, 0, "round {round}: {}", r.stderr);
        assert_eq!(state_of(&w, pid)["state"], "running");
        assert_eq!(phase(&w, pid), "resident");
        // The library checked every allocation's digest on the way back;
        // the workload checks its own data as it runs.
        assert_progressing_at(&st);
        assert!(history_notes(&w, pid).iter().any(|n| n.contains("mapped and copied back")));
    }
    assert_eq!(driver_calls(&w, pid, "restore"), 0, "the driver restored nothing");

    // A suspend of a parked process locks and checkpoints what is left,
    // moves nothing again, and records the whole footprint for its resume.
    assert_eq!(w.json(&["park", &p]).code, 0);
    let r = w.json(&["suspend", &p]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()["results"][0]["footprint_bytes"].as_u64(), Some(676 * MIB));
    assert_eq!((driver_calls(&w, pid, "lock"), driver_calls(&w, pid, "checkpoint")), (1, 1));
    assert!(history_notes(&w, pid).iter().any(|n| n.contains("already offloaded")));
    assert_eq!(state_of(&w, pid)["state"], "checkpointed");
    let r = w.json(&["resume", &p]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(phase(&w, pid), "resident");
    assert_progressing_at(&st);
    assert_eq!(w.json(&["stop", &p]).code, 0);
}

#[test]
fn a_process_without_fast_swap_is_refused_with_its_own_exit_code_and_the_way_out() {
    let mut w = World::new(&[4096]);
    let pid = w.workload(256, 0, &[]);
    let r = w.json(&["park", &pid.to_string()]);
    assert_eq!(r.code, 11, "{} {}", r.stdout, r.stderr);
    assert_eq!(r.json()["error"]["kind"], "no_fast_swap");
    assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
    assert!(r.stderr.contains(&format!("gpusnap suspend {pid}")), "{}", r.stderr);
    assert!(w.calls_on(pid).is_empty(), "nothing was asked of the driver: {:?}", w.calls_on(pid));
    assert_eq!(state_of(&w, pid)["state"], "running");
    w.assert_progressing(pid);
}

/// Admission counts a parked process's residual as taken (NVML shows it on
/// the GPU), and an unpark asks only for the bytes that moved.
#[test]
fn the_residual_counts_in_admission_and_an_unpark_asks_for_the_moved_bytes() {
    let mut w = World::new(&[2048]);
    let st = status_file(&w, "room");
    // 256 MiB served, 768 MiB managed (left with the driver: the residual).
    let (_idx, a) = run_fast(&mut w, &st, &["--mib", "256", "--managed-mib", "768"]);
    assert_progressing_at(&st);
    let b = w.workload(1024, 0, &[]);
    assert_eq!(w.json(&["suspend", &b.to_string()]).code, 0);
    let r = w.json(&["park", &a.to_string()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()["results"][0]["residual_bytes"].as_u64(), Some(768 * MIB));
    // 1280 MiB free: B with 300 MiB of margin does not fit beside the
    // residual, though A's footprint and B's would fit the GPU alone.
    let r = w.json(&["resume", &b.to_string(), "--margin", "300"]);
    assert_eq!(r.code, 3, "{} {}", r.stdout, r.stderr);
    assert!(r.stderr.contains("1280 MiB free"), "{}", r.stderr);
    assert_eq!(state_of(&w, b)["state"], "checkpointed");
    let r = w.json(&["resume", &b.to_string(), "--margin", "0"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    // 256 MiB free: A's unpark needs its 256 moved MiB, not its footprint.
    let r = w.json(&["resume", &a.to_string()]);
    assert_eq!(r.code, 3, "256 MiB + the default margin: {} {}", r.stdout, r.stderr);
    assert!(r.stderr.contains("needs 512 MiB (footprint 256 MiB"), "{}", r.stderr);
    assert_eq!(state_of(&w, a)["state"], "parked", "nothing was changed");
    let r = w.json(&["resume", &a.to_string(), "--margin", "0"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(phase(&w, a), "resident");
    assert_progressing_at(&st);
    w.assert_progressing(b);
}

/// `--wait`: an unpark waits for the room its moved bytes need.
#[test]
fn an_unpark_waits_for_room_with_wait() {
    let mut w = World::new(&[2048]);
    let st = status_file(&w, "wait");
    let (_idx, a) = run_fast(&mut w, &st, &["--mib", "512"]);
    assert_progressing_at(&st);
    assert_eq!(w.json(&["park", &a.to_string()]).code, 0);
    let hog = w.workload(1600, 0, &[]);
    let idx = w.spawn_gpusnap(&["resume", &a.to_string(), "--wait", "60"]);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(phase(&w, a), "offloaded", "it waits for room");
    w.kill(hog);
    assert_eq!(w.wait_child(idx).code(), Some(0));
    assert_eq!(phase(&w, a), "resident");
    assert_progressing_at(&st);
}

#[test]
fn a_parked_process_that_dies_under_the_guard_is_suspended_first() {
    let mut w = World::with_config(&[16_384], serde_json::json!({ "context_mib": 100 }));
    let st = status_file(&w, "die");
    let (idx, pid) = run_fast(&mut w, &st, &["--mib", "256", "--extra-allocs", "1"]);
    assert_progressing_at(&st);
    assert_eq!(w.json(&["park", &pid.to_string()]).code, 0);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM).unwrap();
    assert_died_suspended(&w, idx, pid, libc::SIGTERM, "before death", "parked");
    // It was recorded with all of its memory, the moved bytes included.
    let notes = history_notes(&w, pid);
    assert!(notes.iter().any(|n| n.contains("suspended 612 MiB")), "{notes:?}");
}

#[test]
fn stop_of_a_parked_process_suspends_it_in_full_before_any_signal() {
    let mut w = World::with_config(&[16_384], serde_json::json!({ "context_mib": 100 }));
    let st = status_file(&w, "stop");
    let (_idx, pid) = run_fast(&mut w, &st, &["--mib", "256"]);
    assert_progressing_at(&st);
    assert_eq!(w.json(&["park", &pid.to_string()]).code, 0);
    let r = w.json(&["stop", &pid.to_string()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let res = &r.json()["results"][0];
    assert_eq!((res["suspended"].as_bool(), res["released_before_kill"].as_bool()), (Some(true), Some(true)));
    let calls = w.calls_on(pid);
    assert!(calls.windows(2).any(|c| c[0] == "lock=0" && c[1] == "checkpoint=0"), "{calls:?}");
    wait_for(Duration::from_secs(20), || !pid_exists(pid));
}

#[test]
fn a_gpusnap_killed_while_parking_or_unparking_leaves_a_state_the_next_command_reads() {
    // Copies at 0.1 GB/s: moving 512 MiB takes seconds.
    let mut w = World::with_config(&[16_384], serde_json::json!({ "copy_gbps": 0.1 }));
    let st = status_file(&w, "k9");
    let (_idx, pid) = run_fast(&mut w, &st, &["--mib", "256", "--extra-allocs", "1"]);
    assert_progressing_at(&st);
    let p = pid.to_string();
    let kill9 = |w: &mut World, args: &[&str], during: &str, shown: &str| {
        let idx = w.spawn_gpusnap(args);
        wait_for(Duration::from_secs(30), || phase(w, pid) == during);
        assert_eq!(state_of(w, pid)["state"], shown);
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(w.child_pid(idx)),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        w.wait_child(idx);
    };
    // Killed while parking: the library finishes on its own and `state`
    // says so; a park again finds it parked.
    kill9(&mut w, &["park", &p], "offloading", "parking");
    wait_for(Duration::from_secs(30), || state_of(&w, pid)["state"] == "parked");
    let r = w.json(&["park", &p]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()["results"][0]["already"], true);
    // Killed while unparking: the next resume waits for the copy back.
    kill9(&mut w, &["resume", &p], "restoring", "unparking");
    let r = w.json(&["resume", &p]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(state_of(&w, pid)["state"], "running");
    assert_progressing_at(&st);
    // Killed while parking, then resumed at once: the resume waits for the
    // park to end and brings the memory back.
    kill9(&mut w, &["park", &p], "offloading", "parking");
    let r = w.json(&["resume", &p]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(phase(&w, pid), "resident");
    assert_progressing_at(&st);
    // Every interrupted journal entry was closed by the next command.
    let h = w.json(&["history", &p]).json();
    let events = h["events"].as_array().unwrap();
    let begun = events.iter().filter(|e| e["phase"] == "begin").count();
    let ended = events.iter().filter(|e| e["phase"] == "ok" || e["phase"] == "failed").count();
    assert_eq!(begun, ended, "{h}");
    assert_eq!(driver_calls(&w, pid, "lock"), 0);
}
