//! Processes that CRIU dumped and restored outside gpusnap (plain `criu
//! dump`/`criu restore`, as container runtimes do, and CRIU's own CUDA
//! plugin with gpusnap as its `cuda-checkpoint`): same pid, new start time,
//! and gpusnap still knows them.

mod common;

use common::*;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Runs criu with `args` in a session of its own (a restored tree's
/// session must be reachable from it), failing the test with its log.
fn criu(w: &World, args: &[&str], log: &Path, env: &[(&str, &str)]) {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new("criu");
    w.env(&mut cmd);
    cmd.args(args).arg("-v4").arg("--log-file").arg(log).stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    // SAFETY: setsid is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let out = cmd.output().unwrap();
    let text = std::fs::read_to_string(log).unwrap_or_default();
    assert!(
        out.status.success(),
        "criu {args:?}: {}\n{}\nlog tail:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        text.lines().rev().take(30).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
    );
}

/// Field 22 of /proc/PID/stat.
fn start_time(pid: i32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    s[s.rfind(')').unwrap() + 2..].split_whitespace().nth(19).unwrap().parse().unwrap()
}

/// `criu dump` of `pid` (which CRIU then ends), waits until the pid is free.
fn dump(w: &mut World, pid: i32, dir: &Path, env: &[(&str, &str)]) {
    std::fs::create_dir_all(dir).unwrap();
    let d = dir.to_str().unwrap();
    criu(
        w,
        &["dump", "--tree", &pid.to_string(), "--images-dir", d, "--file-locks"],
        &dir.join("dump.log"),
        env,
    );
    w.reap(pid);
    wait_for(Duration::from_secs(30), || !pid_exists(pid));
}

fn restore(w: &mut World, pid: i32, dir: &Path, env: &[(&str, &str)]) {
    let d = dir.to_str().unwrap();
    criu(
        w,
        &["restore", "--restore-detached", "--images-dir", d, "--file-locks"],
        &dir.join("restore.log"),
        env,
    );
    w.adopt(pid);
    assert!(pid_exists(pid), "criu restored {pid}");
}

#[test]
fn a_suspended_process_restored_by_plain_criu_resumes_without_flags() {
    criu_present();
    let mut w = World::new(&[8192]);
    let pid = w.workload(1024, 0, &[]);
    let p = pid.to_string();
    let r = w.json(&["suspend", &p]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let before = start_time(pid);

    let img = w.tmp.path().join("img");
    dump(&mut w, pid, &img, &[]);
    restore(&mut w, pid, &img, &[]);
    assert_ne!(start_time(pid), before, "a restored process has a new start time");

    // state and ps know it, with the footprint recorded at suspend.
    let r = w.json(&["state", &p]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let v = r.json();
    assert_eq!(v["state"], "checkpointed");
    assert_eq!(v["footprint_bytes"], 1024 * MIB);
    assert_eq!(v["start_time"], start_time(pid));
    let ps = w.json(&["ps"]).json();
    let row = ps["processes"].as_array().unwrap().iter().find(|x| x["pid"] == pid).cloned();
    assert_eq!(row.expect("ps lists it")["footprint_bytes"], 1024 * MIB);

    // resume with no flags: admission with the recorded footprint.
    let r = w.json(&["resume", &p]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()["results"][0]["footprint_bytes"], 1024 * MIB);
    w.assert_progressing(pid);
    assert_eq!(w.json(&["state", &p]).json()["state"], "running");

    // The move of the record is in the journal.
    let h = w.json(&["history", &p]);
    assert!(h.stdout.contains("\"adopt\""), "{}", h.stdout);
    assert!(h.stdout.contains("restored outside gpusnap"), "{}", h.stdout);

    let r = w.json(&["stop", &p, "--grace", "2"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()["results"][0]["suspended"], true);
}

#[test]
fn a_restored_process_can_be_stopped_and_driven_by_the_drop_in() {
    criu_present();
    let mut w = World::new(&[8192]);
    let pid = w.workload(512, 0, &[]);
    let p = pid.to_string();
    assert_eq!(w.json(&["suspend", &p]).code, 0);
    let img = w.tmp.path().join("img");
    dump(&mut w, pid, &img, &[]);
    restore(&mut w, pid, &img, &[]);

    // NVIDIA's command line, through gpusnap: the state, then a toggle back.
    let cc = |args: &[&str]| {
        let mut a = vec!["cuda-checkpoint"];
        a.extend_from_slice(args);
        w.gpusnap(&a)
    };
    let r = cc(&["--get-state", "--pid", &p]);
    assert_eq!((r.code, r.stdout.trim()), (0, "checkpointed"), "{}", r.stderr);
    let r = cc(&["--toggle", "--pid", &p]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.assert_progressing(pid);
    let r = w.json(&["stop", &p, "--grace", "2"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()["results"][0]["suspended"], true);
    wait_for(Duration::from_secs(30), || !pid_exists(pid));
}

#[test]
fn resume_of_a_restored_process_is_refused_when_memory_is_short() {
    criu_present();
    let mut w = World::new(&[4096]);
    let pid = w.workload(2048, 0, &[]);
    let p = pid.to_string();
    assert_eq!(w.json(&["suspend", &p]).code, 0);
    let img = w.tmp.path().join("img");
    dump(&mut w, pid, &img, &[]);
    restore(&mut w, pid, &img, &[]);
    // Another tenant takes most of the GPU meanwhile.
    let hog = w.workload(3000, 0, &[]);
    let r = w.json(&["resume", &p]);
    assert_eq!(r.code, 3, "{}", r.stderr);
    assert!(r.stderr.contains("footprint 2048 MiB"), "{}", r.stderr);
    w.kill(hog);
    let r = w.json(&["resume", &p, "--wait", "30"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.assert_progressing(pid);
    assert_eq!(w.json(&["stop", &p, "--grace", "2"]).code, 0);
}

/// The directory holding CRIU's CUDA plugin for the `criu` these tests run:
/// GPUSNAP_TEST_CRIU_PLUGINS, else PREFIX/lib/criu next to the wrapper that
/// scripts/install-criu.sh --cuda-plugin writes (PREFIX/bin/criu). `None`
/// (the test is skipped, saying why) where there is none, except in CI
/// (CI=true), which installs it and must prove it.
fn cuda_plugin_dir() -> Option<std::path::PathBuf> {
    let mut dirs: Vec<std::path::PathBuf> =
        std::env::var_os("GPUSNAP_TEST_CRIU_PLUGINS").map(std::path::PathBuf::from).into_iter().collect();
    let criu = std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|d| d.join("criu"))
        .find(|p| p.is_file());
    // PREFIX/bin/criu as found on PATH, and where its links lead.
    for c in criu.iter().cloned().chain(criu.as_ref().and_then(|c| std::fs::canonicalize(c).ok())) {
        if let Some(prefix) = c.parent().and_then(|b| b.parent()) {
            dirs.push(prefix.join("lib/criu"));
        }
    }
    if let Some(d) = dirs.into_iter().find(|d| d.join("cuda_plugin.so").is_file()) {
        return Some(d);
    }
    let why = "CRIU's cuda_plugin.so is not installed next to the criu on PATH \
               (scripts/install-criu.sh --cuda-plugin, or GPUSNAP_TEST_CRIU_PLUGINS=DIR)";
    gpusnap_testkit::skip(why);
    None
}

/// A PATH with gpusnap linked as `cuda-checkpoint` first, for CRIU's CUDA
/// plugin.
fn plugin_path(w: &World) -> String {
    let bin = w.tmp.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_gpusnap"), bin.join("cuda-checkpoint")).unwrap();
    format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default())
}

/// CRIU's own CUDA plugin, with gpusnap linked as `cuda-checkpoint` on its
/// PATH and the plugin turned on without a GPU (CRIU_FAULT=138): `criu dump`
/// locks and checkpoints the process through gpusnap; `criu restore` while
/// the GPU lacks the memory: gpusnap refuses the plugin's restore, CRIU
/// still succeeds, and the process is back, checkpointed and recoverable;
/// `gpusnap resume` (no flags) then runs it once there is room.
#[test]
fn criu_cuda_plugin_through_gpusnap_with_too_little_memory_on_restore() {
    criu_present();
    let Some(plugins) = cuda_plugin_dir() else { return };
    let mut w = World::new(&[8192]);
    let pid = w.workload(1024, 0, &[]);
    let p = pid.to_string();
    let path = plugin_path(&w);
    let env = [("PATH", path.as_str()), ("CRIU_FAULT", "138"), ("CRIU_LIBS_DIR", plugins.to_str().unwrap())];

    let img = w.tmp.path().join("img");
    dump(&mut w, pid, &img, &env);
    let log = std::fs::read_to_string(img.join("dump.log")).unwrap();
    assert!(log.contains("cuda_plugin: pausing devices on pid"), "the plugin ran:\n{log}");
    // The driver saw gpusnap's lock and checkpoint, nothing else.
    assert_eq!(w.calls_on(pid), ["get_restore_tid=0", "lock=0", "get_restore_tid=0", "checkpoint=0"]);
    let h = w.json(&["history", &p]).stdout;
    assert!(h.contains("\"lock\"") && h.contains("\"checkpoint\""), "{h}");

    // Restore with less GPU memory than the process needs.
    let gpu = |mib: u64| serde_json::json!([{ "uuid": "GPU-00000000-0000-0000-0000-000000000000", "total_mib": mib }]);
    w.set_config("gpus", gpu(600));
    restore(&mut w, pid, &img, &env);
    let log = std::fs::read_to_string(img.join("restore.log")).unwrap();
    assert!(log.contains("RESUME_DEVICES RESTORE failed"), "{log}");
    assert!(log.contains("not enough GPU memory"), "{log}");
    assert!(!w.calls_on(pid).iter().any(|c| c.starts_with("restore")), "no restore was attempted");

    let r = w.json(&["state", &p]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let v = r.json();
    assert_eq!(v["state"], "checkpointed");
    assert_eq!(v["unrecoverable"], false);
    assert_eq!(v["footprint_bytes"], 1024 * MIB, "the footprint the drop-in recorded at lock");
    let r = w.json(&["resume", &p]);
    assert_eq!(r.code, 3, "still no room: {}", r.stderr);

    w.set_config("gpus", gpu(8192));
    let r = w.json(&["resume", &p]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.assert_progressing(pid);
    let r = w.json(&["stop", &p, "--grace", "2"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
}

/// The host pid of the only child of `parent`.
fn child_of(parent: i32) -> Option<i32> {
    let s = std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children")).ok()?;
    s.split_whitespace().next()?.parse().ok()
}

/// A container's restore: the process lives in a container (its cgroup)
/// and a pid namespace of its own (as pid 1 there, /proc the host's), CRIU's
/// CUDA plugin checkpoints it
/// through gpusnap, and CRIU restores the tree into a new pid namespace,
/// where it has the same pid inside and a new host pid. gpusnap knows it
/// there (the checkpoint's record and footprint move to the new pid), so a
/// restore that does not fit is refused by admission, and a plain
/// `gpusnap resume` of the new pid finishes it once there is room.
#[test]
fn a_container_restored_into_a_new_pid_namespace_keeps_its_record() {
    criu_present();
    let Some(plugins) = cuda_plugin_dir() else { return };
    let mut w = World::new(&[8192]);
    let Some(container) = Container::new(0xc0de) else { return };
    let status = w.tmp.path().join("status-ns");
    let mut cmd = Command::new("unshare");
    w.env(&mut cmd);
    // The program's own output goes to a file of its own: unshare writes to
    // its stderr when its child ends, which would change a file CRIU
    // restores with the tree.
    let wl_log = w.tmp.path().join("workload-ns.log");
    cmd.args(["--pid", "--fork", "sh", "-c", r#"exec setsid "$0" --mib 1024 --status "$1" 2>"$2""#])
        .arg(fake_workload_bin())
        .arg(&status)
        .arg(&wl_log)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let unshare = w.spawn_cmd(cmd);
    let mut pid = 0;
    wait_for(Duration::from_secs(30), || {
        pid = child_of(unshare).unwrap_or(0);
        pid > 0 && read_status(&status).is_some()
    });
    container.enter(pid);
    w.adopt(pid);
    assert_progressing_at(&status);
    let path = plugin_path(&w);
    let env = [("PATH", path.as_str()), ("CRIU_FAULT", "138"), ("CRIU_LIBS_DIR", plugins.to_str().unwrap())];

    let img = w.tmp.path().join("img");
    std::fs::create_dir_all(&img).unwrap();
    let d = img.to_str().unwrap();
    criu(
        &w,
        &["dump", "--tree", &pid.to_string(), "--images-dir", d, "--file-locks"],
        &img.join("dump.log"),
        &env,
    );
    w.reap(unshare);
    wait_for(Duration::from_secs(30), || !pid_exists(pid));
    let h = w.json(&["history", &pid.to_string()]).stdout;
    assert!(h.contains("\"lock\"") && h.contains("\"checkpoint\""), "{h}");

    // Restored with less GPU memory than the process needs.
    let gpu = |mib: u64| serde_json::json!([{ "uuid": "GPU-00000000-0000-0000-0000-000000000000", "total_mib": mib }]);
    w.set_config("gpus", gpu(600));
    let pidfile = img.join("restored.pid");
    criu(
        &w,
        &[
            "restore",
            "--restore-detached",
            "--images-dir",
            d,
            "--file-locks",
            "--pidfile",
            pidfile.to_str().unwrap(),
        ],
        &img.join("restore.log"),
        &env,
    );
    let new_pid: i32 = std::fs::read_to_string(&pidfile).unwrap().trim().parse().unwrap();
    w.adopt(new_pid);
    assert_ne!(new_pid, pid, "a new pid namespace gives the tree another host pid");
    let log = std::fs::read_to_string(img.join("restore.log")).unwrap();
    assert!(log.contains("not enough GPU memory"), "admission refused the plugin's restore:\n{log}");

    let np = new_pid.to_string();
    let r = w.json(&["state", &np]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let v = r.json();
    assert_eq!(v["state"], "checkpointed");
    assert_eq!(v["footprint_bytes"], 1024 * MIB, "the footprint recorded at the checkpoint's lock");
    let h = w.json(&["history", &np]).stdout;
    assert!(h.contains("new pid namespace") && h.contains(&format!("from pid {pid} ")), "{h}");
    assert_eq!(w.json(&["resume", &np]).code, 3, "still no room");

    w.set_config("gpus", gpu(8192));
    let r = w.json(&["resume", &np]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_progressing_at(&status);
    let r = w.json(&["stop", &np, "--grace", "2"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
}
