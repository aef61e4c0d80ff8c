//! `gpusnap run --light --fast-swap`: the preload library serves the fake
//! program's allocations from the fake driver's VMM calls, moves them to
//! pinned host memory on suspend (checked with blake3 on the way back), and
//! maps them back at the same addresses on resume, all or nothing; what it
//! cannot serve stays with the driver and is named.

mod common;

use common::*;
use serde_json::Value;
use std::time::Duration;

const MIB: u64 = 1 << 20;

/// The fake driver's entry for `pid`.
fn fake_proc(w: &World, pid: i32) -> Value {
    let s: Value = serde_json::from_slice(&std::fs::read(w.fake_dir().join("state.json")).unwrap()).unwrap();
    s["procs"][pid.to_string()].clone()
}

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

fn count(v: &Value) -> usize {
    v.as_object().map_or(0, |o| o.len())
}

#[test]
fn served_memory_leaves_and_comes_back_at_the_same_addresses_and_managed_memory_stays_with_the_driver() {
    let mut w = World::new(&[16_384]);
    let st = status_file(&w, "fs");
    let (_idx, pid) = run_fast(&mut w, &st, &["--mib", "256", "--extra-allocs", "1", "--managed-mib", "64"]);
    assert_progressing_at(&st);
    let p = fake_proc(&w, pid);
    assert_eq!(count(&p["handles"]), 2, "served from the VMM API: {p}");
    let reservations = p["reservations"].clone();
    let fs = fast_swap_of(&w, pid);
    assert_eq!(
        (fs["phase"].as_str(), fs["movable"].as_u64(), fs["movable_bytes"].as_u64()),
        (Some("resident"), Some(2), Some(512 * MIB)),
        "{fs}"
    );
    assert_eq!((fs["kept"].as_u64(), fs["kept_bytes"].as_u64()), (Some(1), Some(64 * MIB)), "{fs}");
    assert!(fs["kept_why"].to_string().contains("managed"), "{fs}");
    let d = w.json(&["doctor", &pid.to_string()]).json();
    let finding =
        d["findings"].as_array().unwrap().iter().find(|f| f["check"] == "fast-swap").cloned().unwrap();
    assert!(finding["message"].as_str().unwrap().contains("64 MiB, stay with the driver"), "{finding}");

    for round in 0..2 {
        let r = w.json(&["suspend", &pid.to_string()]);
        assert_eq!(r.code, 0, "round {round}: {}", r.stderr);
        assert_eq!(
            r.json()["results"][0]["footprint_bytes"].as_u64(),
            Some(576 * MIB),
            "admission asks for the whole footprint"
        );
        let p = fake_proc(&w, pid);
        // The physical memory went back; the reservations stayed; the
        // driver's checkpoint had only the managed memory left.
        assert_eq!(count(&p["handles"]), 0, "{p}");
        assert_eq!(p["reservations"], reservations);
        assert_eq!(p["state"], 2);
        assert_eq!(fast_swap_of(&w, pid)["phase"], "offloaded");
        let notes = history_notes(&w, pid);
        assert!(
            notes.iter().any(|n| n.contains("512 MiB moved to pinned host memory") && n.contains("managed")),
            "{notes:?}"
        );

        let r = w.json(&["resume", &pid.to_string()]);
        assert_eq!(r.code, 0, "round {round}: {}", r.stderr);
        let p = fake_proc(&w, pid);
        assert_eq!(count(&p["handles"]), 2, "{p}");
        assert_eq!(p["reservations"], reservations, "the same addresses");
        assert_eq!(fast_swap_of(&w, pid)["phase"], "resident");
        assert_progressing_at(&st);
        assert!(history_notes(&w, pid).iter().any(|n| n.contains("mapped and copied back")));
    }
    assert_eq!(w.json(&["stop", &pid.to_string()]).code, 0);
}

#[test]
fn allocations_of_several_chunks_move_intact_with_either_pinning_and_with_kept_copies() {
    // 600 MiB: two full 256 MiB chunks and a shorter last one, each pinned,
    // copied and checked on its own.
    for (pin, keep) in [("alloc", "0"), ("register", "1")] {
        let mut w = World::new(&[16_384]);
        let st = status_file(&w, "fs");
        let wl = fake_workload_bin();
        let args = [
            "run",
            "--light",
            "--fast-swap",
            "--",
            wl.to_str().unwrap(),
            "--status",
            st.to_str().unwrap(),
            "--mib",
            "600",
        ];
        w.spawn_gpusnap_env(
            &args,
            &[
                ("GPUSNAP_FAST_SWAP_VERIFY", "1"),
                ("GPUSNAP_FAST_SWAP_PIN", pin),
                ("GPUSNAP_FAST_SWAP_KEEP", keep),
            ],
        );
        let pid = pid_in(&st);
        assert_progressing_at(&st);
        for round in 0..2 {
            let r = w.json(&["suspend", &pid.to_string()]);
            assert_eq!(r.code, 0, "{pin} round {round}: {}", r.stderr);
            assert_eq!(count(&fake_proc(&w, pid)["handles"]), 0, "{pin} round {round}");
            let r = w.json(&["resume", &pid.to_string()]);
            assert_eq!(r.code, 0, "{pin} round {round}: {}", r.stderr);
            assert_eq!(fast_swap_of(&w, pid)["phase"], "resident");
            // The workload checks its own data as it runs.
            assert_progressing_at(&st);
        }
        assert_eq!(w.json(&["stop", &pid.to_string()]).code, 0);
    }
}

#[test]
fn a_resume_without_room_for_every_allocation_takes_none_and_a_later_one_succeeds() {
    let mut w = World::new(&[2048]);
    let st = status_file(&w, "aon");
    let (_idx, pid) = run_fast(&mut w, &st, &["--mib", "256", "--extra-allocs", "3"]);
    assert_progressing_at(&st);
    assert_eq!(w.json(&["suspend", &pid.to_string()]).code, 0);
    // Another program takes all but 848 MiB: room for three of the four.
    let hog = w.workload(1200, 0, &[]);
    // Admission told to ask for less: the driver's part comes back, the
    // library's cannot all be mapped.
    let r = w.json(&["resume", &pid.to_string(), "--footprint", "1"]);
    assert_eq!(r.code, 3, "{} {}", r.stdout, r.stderr);
    let p = fake_proc(&w, pid);
    assert_eq!(count(&p["handles"]), 0, "nothing taken: {p}");
    assert_eq!(fast_swap_of(&w, pid)["phase"], "offloaded");
    // Its memory is still away: the program is held at the gate.
    let before = read_status(&st).unwrap().1;
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(read_status(&st).unwrap().1, before, "no copy ran while its memory was away");
    // Suspended again meanwhile, it still records all of its memory.
    let r = w.json(&["suspend", &pid.to_string()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()["results"][0]["footprint_bytes"].as_u64(), Some(1024 * MIB));
    w.kill(hog);
    let r = w.json(&["resume", &pid.to_string()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(count(&fake_proc(&w, pid)["handles"]), 4);
    assert_progressing_at(&st);
}

/// The library maps its memory back on the GPU it took it from: a resume
/// onto another GPU is refused before anything is touched (the agent, whose
/// resume of a full GPU goes to another one, keeps a fast-swap server on its
/// own), and the resume on its own GPU goes through.
#[test]
fn a_fast_swap_program_resumes_on_its_own_gpu_not_another() {
    let mut w = World::new(&[2048, 2048]);
    let st = status_file(&w, "own");
    let (_idx, pid) = run_fast(&mut w, &st, &["--mib", "256"]);
    assert_progressing_at(&st);
    let p = pid.to_string();
    assert_eq!(w.json(&["suspend", &p]).code, 0);
    let r = w.json(&["resume", &p, "--device-map", "0=1"]);
    assert_eq!(r.code, 2, "{} {}", r.stdout, r.stderr);
    assert!(r.stderr.contains("fast swap") && r.stderr.lines().count() == 1, "{}", r.stderr);
    assert_eq!(fast_swap_of(&w, pid)["phase"], "offloaded");
    assert_eq!(w.json(&["state", &p]).json()["state"], "checkpointed");
    let r = w.json(&["resume", &p]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(fake_proc(&w, pid)["contexts"], serde_json::json!([0]));
    assert_progressing_at(&st);
}

#[test]
fn a_gpusnap_killed_in_each_phase_is_reconciled_by_the_next_command() {
    // Copies at 0.1 GB/s: an offload or restore of 512 MiB takes seconds.
    let mut w = World::with_config(&[16_384], serde_json::json!({ "copy_gbps": 0.1 }));
    let st = status_file(&w, "k9");
    let (_idx, pid) = run_fast(&mut w, &st, &["--mib", "256", "--extra-allocs", "1"]);
    assert_progressing_at(&st);
    let phase = |w: &World| fast_swap_of(w, pid)["phase"].as_str().unwrap_or("").to_string();
    // Killed in the offload, then in the restore of the library's memory.
    for (cmd, during) in [("suspend", "offloading"), ("resume", "restoring")] {
        let idx = w.spawn_gpusnap(&[cmd, &pid.to_string()]);
        wait_for(Duration::from_secs(30), || phase(&w) == during);
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(w.child_pid(idx)),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        w.wait_child(idx);
        // The library finishes what it began; the next command goes on
        // from there.
        let r = w.json(&[cmd, &pid.to_string()]);
        assert_eq!(r.code, 0, "{cmd} after a kill in {during}: {}", r.stderr);
    }
    assert_eq!(phase(&w), "resident");
    assert_progressing_at(&st);
    // Killed while the driver locks (after the offload): the next resume
    // brings both back.
    w.set_config("inject", serde_json::json!([{ "call": "checkpoint", "hang": true, "count": 1 }]));
    let locks = |w: &World| w.calls_on(pid).iter().filter(|c| c.starts_with("lock")).count();
    let before = locks(&w);
    let idx = w.spawn_gpusnap(&["suspend", &pid.to_string()]);
    wait_for(Duration::from_secs(30), || locks(&w) > before);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(w.child_pid(idx)), nix::sys::signal::Signal::SIGKILL)
        .unwrap();
    w.wait_child(idx);
    w.set_config("inject", serde_json::json!([]));
    let ps = w.json(&["ps"]);
    assert_eq!(phase(&w), "offloaded", "{} {}", ps.stdout, ps.stderr);
    let r = w.json(&["resume", &pid.to_string()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(phase(&w), "resident");
    assert_progressing_at(&st);
}

#[test]
fn a_program_killed_during_its_offload_fails_the_suspend_without_a_hang() {
    let mut w = World::with_config(&[16_384], serde_json::json!({ "copy_gbps": 0.1 }));
    let st = status_file(&w, "pk");
    let (_idx, pid) = run_fast(&mut w, &st, &["--mib", "256", "--extra-allocs", "1"]);
    assert_progressing_at(&st);
    let idx = w.spawn_gpusnap(&["suspend", &pid.to_string()]);
    wait_for(Duration::from_secs(30), || fast_swap_of(&w, pid)["phase"] == "offloading");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).unwrap();
    let s = w.wait_child(idx);
    assert_ne!(s.code(), Some(0));
    wait_for(Duration::from_secs(20), || !pid_exists(pid));
    assert!(fast_swap_of(&w, pid).is_null());
}

#[test]
fn calls_reached_through_cu_get_proc_address_are_served_and_gated_too() {
    let mut w = World::new(&[16_384]);
    let st = status_file(&w, "gpa");
    let (_idx, pid) = run_fast(&mut w, &st, &["--mib", "128", "--proc-address"]);
    assert_progressing_at(&st);
    assert_eq!(count(&fake_proc(&w, pid)["handles"]), 1, "served: {}", fake_proc(&w, pid));
    assert_eq!(w.json(&["suspend", &pid.to_string()]).code, 0);
    assert_eq!(count(&fake_proc(&w, pid)["handles"]), 0);
    assert_eq!(w.json(&["resume", &pid.to_string()]).code, 0);
    assert_progressing_at(&st);
    // A program killed while suspended: the next resume says so, at once.
    assert_eq!(w.json(&["suspend", &pid.to_string()]).code, 0);
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).unwrap();
    wait_for(Duration::from_secs(20), || !pid_exists(pid));
    assert_ne!(w.json(&["resume", &pid.to_string()]).code, 0);
}

#[test]
fn cuda_ipc_on_served_memory_is_refused_with_the_way_out_and_named_by_doctor() {
    let mut w = World::new(&[4096]);
    let st = status_file(&w, "ipc");
    let (idx, pid) = run_fast(&mut w, &st, &["--mib", "64", "--ipc"]);
    assert_progressing_at(&st);
    let err = std::fs::read_to_string(w.tmp.path().join(format!("gpusnap-{idx}.err"))).unwrap();
    assert!(err.contains("ipc rc=801"), "CUDA_ERROR_NOT_SUPPORTED: {err}");
    assert!(err.contains("CUDA IPC") && err.contains("fast_swap = false"), "{err}");
    assert_eq!(fast_swap_of(&w, pid)["ipc_refused"], 1);
    let d = w.json(&["doctor", &pid.to_string()]).json();
    let finding =
        d["findings"].as_array().unwrap().iter().find(|f| f["check"] == "fast-swap").cloned().unwrap();
    assert_eq!(finding["severity"], "warn", "{finding}");
    assert!(finding["fix"].as_str().unwrap().contains("without --fast-swap"), "{finding}");
    // The program runs on, and swaps as any other.
    assert_eq!(w.json(&["suspend", &pid.to_string()]).code, 0);
    assert_eq!(w.json(&["resume", &pid.to_string()]).code, 0);
    assert_progressing_at(&st);
    assert_eq!(w.json(&["stop", &pid.to_string()]).code, 0);

    // Without fast swap the driver's own call answers.
    let st = status_file(&w, "ipc-driver");
    let wl = fake_workload_bin();
    let idx = w.spawn_gpusnap(&[
        "run",
        "--light",
        "--",
        wl.to_str().unwrap(),
        "--status",
        st.to_str().unwrap(),
        "--mib",
        "64",
        "--ipc",
    ]);
    let pid = pid_in(&st);
    assert_progressing_at(&st);
    let err = std::fs::read_to_string(w.tmp.path().join(format!("gpusnap-{idx}.err"))).unwrap();
    assert!(err.contains("ipc rc=0") && !err.contains("CUDA IPC"), "{err}");
    assert_eq!(w.json(&["stop", &pid.to_string()]).code, 0);
}

#[test]
fn a_hibernated_fast_swap_program_wakes_with_its_memory_and_its_control_socket() {
    criu_present();
    let mut w = World::new(&[16_384]);
    let st = status_file(&w, "hib");
    let wl = fake_workload_bin();
    // Its stderr is a file of its own (see guard_light's hibernate test).
    let idx = w.spawn_gpusnap_env(
        &[
            "run",
            "--light",
            "--fast-swap",
            "--",
            "sh",
            "-c",
            "exec \"$0\" \"$@\" 2>/dev/null",
            wl.to_str().unwrap(),
            "--mib",
            "256",
            "--extra-allocs",
            "1",
            "--status",
            st.to_str().unwrap(),
        ],
        &[("GPUSNAP_FAST_SWAP_VERIFY", "1")],
    );
    let pid = pid_in(&st);
    assert_progressing_at(&st);
    let p = pid.to_string();
    let r = w.json(&["hibernate", &p, "--image", "fs"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(history_notes(&w, pid).iter().any(|n| n.contains("512 MiB moved to pinned host memory")));
    assert_eq!(w.wait_child(idx).code(), Some(0));
    wait_for(Duration::from_secs(10), || !pid_exists(pid));
    let r = w.json(&["wake", "fs", "--wait", "10"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    // The reservations came back with the process; the library's socket
    // too, and the memory is mapped again at the same addresses.
    assert_eq!(fast_swap_of(&w, pid)["phase"], "resident");
    assert_eq!(count(&fake_proc(&w, pid)["handles"]), 2);
    assert_progressing_at(&st);
    std::fs::write(format!("{}.exit", st.display()), b"").unwrap();
}

/// Opens `n` connections to the library's control socket of `pid` as
/// `uid` (python3, dropped to that user), sends `send` on each, prints the
/// answers read within a second, one per line, then holds every
/// connection open until its standard input closes.
fn hold_connections(pid: i32, uid: u32, n: usize, send: &str) -> std::process::Child {
    use std::os::unix::process::CommandExt;
    let name = control_socket(pid).expect("the library listens");
    let script = format!(
        r#"
import socket, sys
name = "{name}"
conns = []
for _ in range({n}):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("\0" + name[1:])
    s.sendall({send:?}.encode())
    conns.append(s)
for s in conns:
    s.settimeout(1.0)
    try:
        print(s.recv(200).decode().strip() or "closed", flush=True)
    except socket.timeout:
        print("waiting", flush=True)
sys.stdin.read()
"#
    );
    std::process::Command::new("python3")
        .args(["-c", &script])
        .uid(uid)
        .gid(uid)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python3")
}

/// The name of `pid`'s control socket (`@gpusnap-swap-PID-RANDOM`), from
/// its network namespace's socket table.
fn control_socket(pid: i32) -> Option<String> {
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/unix")).ok()?;
    let prefix = format!("@gpusnap-swap-{pid}-");
    table
        .lines()
        .filter_map(|l| l.split_whitespace().nth(7))
        .find(|n| n.starts_with(&prefix))
        .map(str::to_string)
}

fn answers(child: &mut std::process::Child, n: usize) -> Vec<String> {
    use std::io::BufRead;
    let out = child.stdout.take().unwrap();
    std::io::BufReader::new(out).lines().take(n).map(|l| l.unwrap()).collect()
}

#[test]
fn strangers_and_nonsense_on_the_control_socket_never_keep_gpusnap_from_it() {
    if !nix::unistd::geteuid().is_root() {
        gpusnap_testkit::skip("needs root (a peer of another user)");
        return;
    }
    let mut w = World::new(&[16_384]);
    let st = status_file(&w, "fs");
    let (_idx, pid) = run_fast(&mut w, &st, &["--mib", "256"]);
    assert_progressing_at(&st);

    // Another user's connections are refused at once and take no place
    // from gpusnap, however many it holds open.
    let mut strangers = hold_connections(pid, 65534, 20, "");
    let got = answers(&mut strangers, 20);
    assert!(got.iter().all(|a| a.starts_with("error denied")), "{got:?}");
    // The program's own user: a line past the bound, and silent peers
    // (each dropped after the read's time limit).
    let mut own = hold_connections(pid, 0, 1, &"x".repeat(300));
    assert_eq!(answers(&mut own, 1), vec!["error unknown: unknown request".to_string()]);

    let r = w.json(&["suspend", &pid.to_string()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        history_notes(&w, pid).iter().any(|n| n.contains("moved to pinned host memory")),
        "the library did the offload: {:?}",
        history_notes(&w, pid)
    );
    assert_eq!(w.json(&["resume", &pid.to_string()]).code, 0);
    assert_progressing_at(&st);
    for mut c in [strangers, own] {
        drop(c.stdin.take());
        let _ = c.wait();
    }
    assert_eq!(w.json(&["stop", &pid.to_string()]).code, 0);
}

/// Memory the program maps itself through the VMM API (PyTorch's expandable
/// segments, vLLM's sleep-mode allocator): copied out, unmapped and
/// released on suspend, created and mapped again at the same addresses with
/// the same access on resume, a handle the program released while mapped
/// included; the program's data checked every round.
#[test]
fn memory_the_program_maps_itself_leaves_and_comes_back_at_its_addresses() {
    let mut w = World::new(&[16_384]);
    let st = status_file(&w, "vmm");
    let (_idx, pid) = run_fast(&mut w, &st, &["--mib", "64", "--vmm-mib", "128"]);
    assert_progressing_at(&st);
    let fs = fast_swap_of(&w, pid);
    assert_eq!(
        (fs["movable"].as_u64(), fs["movable_bytes"].as_u64(), fs["vmm"].as_u64(), fs["vmm_bytes"].as_u64()),
        (Some(3), Some(320 * MIB), Some(2), Some(256 * MIB)),
        "{fs}"
    );
    assert_eq!(fs["kept"].as_u64(), Some(0), "{fs}");
    let p = fake_proc(&w, pid);
    assert_eq!(count(&p["handles"]), 3, "{p}");
    let reservations = p["reservations"].clone();
    for round in 0..2 {
        let r = w.json(&["suspend", &pid.to_string()]);
        assert_eq!(r.code, 0, "round {round}: {}", r.stderr);
        let p = fake_proc(&w, pid);
        assert_eq!(count(&p["handles"]), 0, "round {round}: every physical allocation went back: {p}");
        assert_eq!(p["reservations"], reservations);
        assert!(
            history_notes(&w, pid).iter().any(|n| n.contains("320 MiB moved")),
            "{:?}",
            history_notes(&w, pid)
        );
        let r = w.json(&["resume", &pid.to_string()]);
        assert_eq!(r.code, 0, "round {round}: {}", r.stderr);
        let p = fake_proc(&w, pid);
        assert_eq!(count(&p["handles"]), 3, "round {round}: {p}");
        assert_eq!(p["reservations"], reservations, "the same addresses");
        // Its reads of all three allocations come back intact.
        assert_progressing_at(&st);
    }
    assert_eq!(w.json(&["stop", &pid.to_string()]).code, 0);
}

/// With kept copies the library pins them ahead of time once the
/// program's allocations have settled, within its pinned budget; a restore
/// that leaves more pinned than the budget gives copies back (the next
/// offload pins them anew), and the data comes back intact either way.
#[test]
fn kept_copies_are_pinned_ahead_of_time_within_the_budget() {
    let mut w = World::new(&[16_384]);
    let st = status_file(&w, "pre");
    let wl = fake_workload_bin();
    let args = [
        "run",
        "--light",
        "--fast-swap",
        "--keep-pinned",
        "--",
        wl.to_str().unwrap(),
        "--status",
        st.to_str().unwrap(),
        "--mib",
        "64",
        "--extra-allocs",
        "2",
    ];
    let budget = (150 * MIB).to_string();
    w.spawn_gpusnap_env(
        &args,
        &[
            ("GPUSNAP_FAST_SWAP_VERIFY", "1"),
            ("GPUSNAP_FAST_SWAP_SETTLE_MS", "200"),
            ("GPUSNAP_FAST_SWAP_PIN_BUDGET", &budget),
        ],
    );
    let pid = pid_in(&st);
    assert_progressing_at(&st);
    let pinned = |w: &World| fast_swap_of(w, pid)["pinned_bytes"].as_u64().unwrap_or(0);
    // Before any suspend: two of the three 64 MiB copies fit the budget.
    wait_for(Duration::from_secs(20), || pinned(&w) == 128 * MIB);
    assert_eq!(fast_swap_of(&w, pid)["pin_budget"].as_u64(), Some(150 * MIB));
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(pinned(&w), 128 * MIB, "no copy pinned ahead past the budget");
    for round in 0..2 {
        let r = w.json(&["suspend", &pid.to_string()]);
        assert_eq!(r.code, 0, "round {round}: {}", r.stderr);
        // The offload pinned the third copy (as every offload pins a missing copy).
        assert_eq!(pinned(&w), 192 * MIB, "round {round}");
        let r = w.json(&["resume", &pid.to_string()]);
        assert_eq!(r.code, 0, "round {round}: {}", r.stderr);
        // Over the budget after the restore: one copy goes back.
        wait_for(Duration::from_secs(20), || pinned(&w) <= 150 * MIB);
        assert_progressing_at(&st);
    }
    assert_eq!(w.json(&["stop", &pid.to_string()]).code, 0);
}

/// Memory of the driver's stream-ordered pool (`cuMemAllocAsync`) stays
/// with the driver and is named, in `ps --json` and under `ps`'s table; the
/// driver's checkpoint moves it with the rest.
#[test]
fn stream_ordered_pool_memory_is_named_as_left_with_the_driver() {
    let mut w = World::new(&[16_384]);
    let st = status_file(&w, "pool");
    let (_idx, pid) = run_fast(&mut w, &st, &["--mib", "64", "--async-mib", "32"]);
    assert_progressing_at(&st);
    let fs = fast_swap_of(&w, pid);
    assert_eq!((fs["kept"].as_u64(), fs["kept_bytes"].as_u64()), (Some(1), Some(32 * MIB)), "{fs}");
    assert!(fs["kept_why"].to_string().contains("stream-ordered pool"), "{fs}");
    let ps = w.gpusnap(&["ps"]);
    assert!(
        ps.stdout.contains(&format!("{pid}: fast swap leaves 1 allocation(s), 32 MiB, with the driver")),
        "{}",
        ps.stdout
    );
    let r = w.json(&["suspend", &pid.to_string()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        history_notes(&w, pid).iter().any(|n| n.contains("stream-ordered pool")),
        "{:?}",
        history_notes(&w, pid)
    );
    assert_eq!(w.json(&["resume", &pid.to_string()]).code, 0);
    assert_progressing_at(&st);
}

#[test]
fn a_stop_suspends_through_the_driver_without_moving_memory_out_and_reports_its_whole_time() {
    // 1 GB/s: the driver's checkpoint of 512 MiB takes half a second at least.
    let mut w = World::with_config(&[16_384], serde_json::json!({ "checkpoint_gbps": 1.0 }));
    let st = status_file(&w, "fs");
    let (idx, pid) = run_fast(&mut w, &st, &["--mib", "512"]);
    assert_eq!(fast_swap_of(&w, pid)["phase"], "resident");
    let r = w.json(&["stop", &pid.to_string()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.wait_child(idx);
    // Still suspended by the driver before the signal: never killed with
    // its state on the GPU.
    assert_suspended_before_death(&w, pid);
    let h = w.json(&["history", &pid.to_string()]).json();
    let ops: Vec<&str> = h["events"].as_array().unwrap().iter().filter_map(|e| e["op"].as_str()).collect();
    assert!(!ops.contains(&"offload"), "a stop moved the memory to host memory first: {ops:?}");
    // The time reported is the stop's, its suspend included.
    let ms = r.json()["results"][0]["total_ms"].as_u64().unwrap();
    assert!(ms >= 400, "{ms} ms reported: {}", r.stdout);
}
