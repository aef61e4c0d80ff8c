//! suspend / resume / stop end to end: the real binary against the fakes.

mod common;

use common::*;
use serde_json::json;
use std::time::Duration;

const GPU0: &str = "GPU-00000000-0000-0000-0000-000000000000";

#[test]
fn suspend_and_resume_keep_the_data_and_free_the_gpu() {
    let mut w = World::new(&[16_384]);
    let pid = w.workload(4096, 0, &[]);
    let p = pid.to_string();

    let st = w.json(&["state", &p]).json();
    assert_eq!(st["state"], "running");
    assert_eq!(st["footprint_bytes"], 4096 * MIB);

    let r = w.json(&["suspend", &p]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let res = &r.json()["results"][0];
    assert_eq!(res["state"], "checkpointed");
    assert_eq!(res["footprint_bytes"], 4096 * MIB);
    assert_eq!(res["gpus"][0]["uuid"], GPU0);

    // Suspended: no iterations, and the state (with its footprint) is remembered.
    let it = w.iteration(pid);
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(w.iteration(pid), it, "a checkpointed process must not run GPU work");
    let st = w.json(&["state", &p]).json();
    assert_eq!(st["state"], "checkpointed");
    assert_eq!(st["footprint_bytes"], 4096 * MIB);

    // Idempotent: suspending again is a no-op that says so.
    let again = w.json(&["suspend", &p]).json();
    assert_eq!(again["results"][0]["already"], true);

    let r = w.json(&["resume", &p]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()["results"][0]["state"], "running");
    w.assert_progressing(pid);
    assert_eq!(w.calls_on(pid), ["lock=0", "checkpoint=0", "restore=0", "unlock=0"]);

    let ps = w.json(&["ps"]).json();
    let row = ps["processes"].as_array().unwrap().iter().find(|r| r["pid"] == pid).expect("in ps");
    assert_eq!(row["state"], "running");

    // The journal has a begin and an end around every driver call.
    let h = w.json(&["history", &p]).json();
    let phases: Vec<String> = h["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["phase"] != "note")
        .map(|e| format!("{}:{}", e["op"].as_str().unwrap(), e["phase"].as_str().unwrap()))
        .collect();
    assert_eq!(
        phases,
        [
            "lock:begin",
            "lock:ok",
            "checkpoint:begin",
            "checkpoint:ok",
            "restore:begin",
            "restore:ok",
            "unlock:begin",
            "unlock:ok"
        ]
    );
    stop(&mut w, pid);
}

fn stop(w: &mut World, pid: i32) {
    let r = w.json(&["stop", &pid.to_string(), "--grace", "2"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    // Gone once stop returns; its waiter thread records the exit a moment
    // later (bounded wait), only then is the child's status known here.
    w.reap(pid);
    assert!(!w.alive(pid));
}

#[test]
fn resume_is_refused_without_memory_and_works_once_it_is_free() {
    let mut w = World::new(&[8192]);
    let pid = w.workload(4096, 0, &[]);
    let p = pid.to_string();
    assert_eq!(w.json(&["suspend", &p]).code, 0);
    let filler = w.workload(6000, 0, &[]);

    let r = w.json(&["resume", &p]);
    assert_eq!(r.code, 3, "{}", r.stderr);
    assert_eq!(r.json()["error"]["kind"], "no_memory");
    // One JSON object on stdout: the error, with what was done before it.
    assert_eq!(r.stdout.lines().count(), 1, "{}", r.stdout);
    assert_eq!(r.json()["results"], json!([]));
    assert!(r.stderr.contains("needs 4352 MiB"), "{}", r.stderr);
    // Nothing was attempted: the driver saw no restore, the process stays resumable.
    assert!(!w.calls_on(pid).iter().any(|c| c.starts_with("restore")));
    assert_eq!(w.json(&["state", &p]).json()["state"], "checkpointed");

    let t0 = std::time::Instant::now();
    let r = w.json(&["resume", &p, "--wait", "1"]);
    assert_eq!(r.code, 3);
    assert!(t0.elapsed() >= Duration::from_secs(1));

    // The filler was never checkpointed: killing it is safe.
    w.kill(filler);
    let r = w.json(&["resume", &p]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.assert_progressing(pid);
    stop(&mut w, pid);
}

#[test]
fn resume_waits_for_memory_to_come_free() {
    let mut w = World::new(&[8192]);
    let pid = w.workload(4096, 0, &[]);
    let p = pid.to_string();
    assert_eq!(w.json(&["suspend", &p]).code, 0);
    let filler = w.workload(6000, 0, &[]);
    let child = w
        .gpusnap_cmd(&["--json", "resume", &p, "--wait", "20"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(700));
    w.kill(filler);
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["results"][0]["waited_ms"].as_u64().unwrap() >= 500);
    w.assert_progressing(pid);
    stop(&mut w, pid);
}

#[test]
fn concurrent_resumes_never_take_the_same_memory() {
    // Restores take ~1 s, so both gpusnaps overlap; only one fits.
    let mut w = World::with_config(&[8192], json!({ "restore_gbps": 3.0 }));
    let a = w.workload(3000, 0, &[]);
    let b = w.workload(3000, 0, &[]);
    assert_eq!(w.json(&["suspend", &a.to_string(), &b.to_string()]).code, 0);
    let _filler = w.workload(2000, 0, &[]);
    let spawn = |pid: i32| {
        w.gpusnap_cmd(&["--json", "resume", &pid.to_string()])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (ca, cb) = (spawn(a), spawn(b));
    let (ra, rb) = (ca.wait_with_output().unwrap(), cb.wait_with_output().unwrap());
    let mut codes = [ra.status.code().unwrap(), rb.status.code().unwrap()];
    codes.sort();
    assert_eq!(
        codes,
        [0, 3],
        "a: {:?} b: {:?}",
        String::from_utf8_lossy(&ra.stderr),
        String::from_utf8_lossy(&rb.stderr)
    );
    // Neither was stranded: the refused one never reached the driver.
    for pid in [a, b] {
        assert!(!w.calls_on(pid).contains(&"restore=2".to_string()));
    }
    for pid in [a, b] {
        stop(&mut w, pid);
    }
}

#[test]
fn a_restore_that_runs_out_of_memory_is_reported_unrecoverable() {
    let mut w = World::new(&[8192]);
    let pid = w.workload(2048, 0, &[]);
    let p = pid.to_string();
    assert_eq!(w.json(&["suspend", &p]).code, 0);
    // A tenant outside gpusnap races it: the driver itself answers 2.
    w.set_config("inject", json!([{ "call": "restore", "pid": pid, "rc": 2, "count": 1 }]));
    let r = w.json(&["resume", &p]);
    assert_eq!(r.code, 5, "{}", r.stderr);
    assert_eq!(r.json()["error"]["kind"], "unrecoverable");
    let st = w.json(&["state", &p]).json();
    assert_eq!(st["unrecoverable"], true);
    // Further resumes are refused without touching the driver again.
    let before = w.calls_on(pid).len();
    assert_eq!(w.json(&["resume", &p]).code, 5);
    assert_eq!(w.calls_on(pid).len(), before);
    // It holds no GPU memory: stop kills it without a suspend.
    stop(&mut w, pid);
}

#[test]
fn a_process_stuck_outside_gpusnap_is_reported_unrecoverable() {
    let mut w = World::new(&[8192]);
    let pid = w.workload(2048, 0, &[]);
    let p = pid.to_string();
    assert_eq!(w.json(&["suspend", &p]).code, 0);
    // The stuck state itself (the fake models r580: 2, then 304 forever):
    // another tool restored it while the GPU was full.
    let filler = w.workload(7000, 0, &[]);
    w.set_config("inject", json!([]));
    let raw = raw_driver(&w, &["restore", &p]);
    assert!(raw.contains("rc=2"), "{raw}");
    w.kill(filler);
    let r = w.json(&["resume", &p]);
    assert_eq!(r.code, 5, "{}", r.stderr);
    assert!(r.stderr.contains("304"), "{}", r.stderr);
    assert_eq!(w.json(&["state", &p]).json()["unrecoverable"], true);
    stop(&mut w, pid);
}

/// Calls the fake driver the way another tool would, bypassing gpusnap.
fn raw_driver(w: &World, args: &[&str]) -> String {
    let mut cmd = std::process::Command::new(fake_workload_bin());
    w.env(&mut cmd);
    let out = cmd.arg("--driver-call").args(args).output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn stop_suspends_before_it_kills() {
    let mut w = World::new(&[8192]);
    let pid = w.workload(2048, 0, &[]);
    let p = pid.to_string();
    assert_eq!(w.json(&["suspend", &p]).code, 0);
    assert_eq!(w.json(&["resume", &p]).code, 0);
    let r = w.json(&["stop", &p, "--grace", "2"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let res = &r.json()["results"][0];
    assert_eq!(res["suspended"], true);
    assert_eq!(res["released_before_kill"], true);
    assert_eq!(res["signal"], "SIGTERM");
    assert!(!w.alive(pid));
    let calls = w.calls_on(pid);
    assert_eq!(&calls[calls.len() - 2..], ["lock=0", "checkpoint=0"]);
}

#[test]
fn stop_refuses_when_it_cannot_suspend_unless_forced() {
    let mut w = World::new(&[8192]);
    let pid = w.workload(1024, 0, &["--busy-ms", "60000"]);
    let p = pid.to_string();
    let r = w.json(&["stop", &p, "--lock-timeout", "100"]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert_eq!(r.json()["error"]["kind"], "stop_refused");
    assert!(w.alive(pid));
    assert_eq!(w.json(&["state", &p]).json()["state"], "running");
    let r = w.json(&["stop", &p, "--lock-timeout", "100", "--force", "--grace", "1"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    // Gone once stop returns; its waiter thread records the exit a moment
    // later (bounded wait), only then is the child's status known here.
    w.reap(pid);
    assert!(!w.alive(pid));
}

#[test]
fn a_lock_timeout_leaves_the_process_running() {
    let mut w = World::new(&[8192]);
    let pid = w.workload(1024, 0, &["--busy-ms", "60000"]);
    let p = pid.to_string();
    let r = w.json(&["suspend", &p, "--lock-timeout", "100"]);
    assert_eq!(r.code, 4, "{}", r.stderr);
    assert!(r.stderr.contains("CUDA_ERROR_NOT_READY"), "{}", r.stderr);
    assert!(r.stderr.contains("--lock-timeout"), "{}", r.stderr);
    assert_eq!(w.json(&["state", &p]).json()["state"], "running");
}

#[test]
fn a_failed_checkpoint_puts_the_process_back() {
    let mut w = World::new(&[8192]);
    let pid = w.workload(1024, 0, &[]);
    let p = pid.to_string();
    w.set_config("inject", json!([{ "call": "checkpoint", "pid": pid, "rc": 999, "count": 1 }]));
    let r = w.json(&["suspend", &p]);
    assert_eq!(r.code, 4, "{}", r.stderr);
    assert_eq!(w.calls_on(pid), ["lock=0", "checkpoint=999", "unlock=0"]);
    assert_eq!(w.json(&["state", &p]).json()["state"], "running");
    w.assert_progressing(pid);
}

#[test]
fn an_interrupted_gpusnap_is_reconciled_on_the_next_run() {
    // A slow checkpoint (2 GiB at 0.5 GB/s = 4 s) so gpusnap can be killed mid-call.
    let mut w = World::with_config(&[8192], json!({ "checkpoint_gbps": 0.5 }));
    let pid = w.workload(2048, 0, &[]);
    let p = pid.to_string();
    let mut g = w.gpusnap_cmd(&["--json", "suspend", &p]).spawn().unwrap();
    wait_for(Duration::from_secs(10), || w.calls_on(pid).iter().any(|c| c == "lock=0"));
    std::thread::sleep(Duration::from_millis(300));
    g.kill().unwrap();
    g.wait().unwrap();
    // The next gpusnap finds the open journal entry and asks the driver.
    let st = w.json(&["state", &p]);
    assert_eq!(st.code, 0, "{}", st.stderr);
    let h = w.json(&["history", &p]).json();
    let ev = h["events"].as_array().unwrap();
    assert!(
        ev.iter().any(|e| e["op"] == "checkpoint"
            && e["phase"] == "failed"
            && e["detail"].as_str().unwrap().contains("interrupted")),
        "{h}"
    );
    assert!(ev.iter().any(|e| e["op"] == "reconcile"), "{h}");
    // Whatever the driver finished, resume brings it back.
    wait_for(Duration::from_secs(10), || {
        let s = w.json(&["state", &p]).json();
        s["state"] == "checkpointed" || s["state"] == "locked"
    });
    let r = w.json(&["resume", &p]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.assert_progressing(pid);
    stop(&mut w, pid);
}

#[test]
fn resume_onto_another_gpu() {
    let mut w = World::new(&[8192, 8192]);
    let pid = w.workload(2048, 0, &[]);
    let p = pid.to_string();
    assert_eq!(w.json(&["suspend", &p]).code, 0);
    // A map that names an absent GPU, or a map on a GPU too small, is refused
    // before the driver is asked.
    let r = w.json(&["resume", &p, "--device-map", "0=7"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert_eq!(r.json()["error"]["kind"], "bad_device_map");
    let filler = w.workload(7000, 1, &[]);
    let r = w.json(&["resume", &p, "--device-map", "0=1"]);
    assert_eq!(r.code, 3, "{}", r.stderr);
    assert!(r.stderr.contains("GPU 1 needs"), "{}", r.stderr);
    w.kill(filler);
    let r = w.json(&["resume", &p, "--device-map", "0=1"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.assert_progressing(pid);
    let st = w.json(&["state", &p]).json();
    assert_eq!(st["gpus"][0]["uuid"], "GPU-00000001-0000-0000-0000-000000000000", "{st}");
    // Its next suspend/resume cycle stays on GPU 1.
    assert_eq!(w.json(&["suspend", &p]).code, 0);
    assert_eq!(w.json(&["resume", &p]).code, 0);
    let st = w.json(&["state", &p]).json();
    assert_eq!(st["gpus"][0]["uuid"], "GPU-00000001-0000-0000-0000-000000000000", "{st}");
    stop(&mut w, pid);
}

#[test]
fn a_resume_killed_inside_the_drivers_restore_is_finished_by_the_next_resume() {
    // Restores at 0.2 GB/s: the driver's restore of 1 GiB takes about 5 s.
    let mut w = World::with_config(&[16_384], json!({ "restore_gbps": 0.2 }));
    let pid = w.workload(1024, 0, &[]);
    let p = pid.to_string();
    assert_eq!(w.json(&["suspend", &p]).code, 0);
    let restoring = |w: &World| {
        std::fs::read(w.fake_dir().join("state.json"))
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .is_some_and(|s| s["procs"][&p]["restoring_until_ms"].is_u64())
    };
    let idx = w.spawn_gpusnap(&["resume", &p]);
    wait_for(Duration::from_secs(30), || restoring(&w));
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(w.child_pid(idx)), nix::sys::signal::Signal::SIGKILL)
        .unwrap();
    w.wait_child(idx);
    // The driver's restore is the process's own work and goes on without
    // its caller: the next resume waits for it and finishes the resume.
    let r = w.json(&["resume", &p]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(w.json(&["state", &p]).json()["state"], "running");
    w.assert_progressing(pid);
}
