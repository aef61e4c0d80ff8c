//! The keeper of a lazy wake: gpusnap killed (SIGKILL) in the middle of a
//! lazy wake must not let the woken process read zeros where its memory was
//! still missing (docs/design/wake.md, "Safety"). With the real CRIU.

mod common;

use common::*;
use std::path::Path;
use std::time::Duration;

/// Waits for what the process read after OUT.go, and compares it with what
/// it held before the hibernate (the child forked during the wake too).
fn assert_memory_intact(out: &Path) {
    wait_for(Duration::from_secs(90), || out.with_extension("after").exists());
    let before = read_ext(out, "before");
    assert_eq!(read_ext(out, "after"), before, "memory after the wake (A, moved B, C, D half removed)");
    assert_eq!(read_ext(out, "child"), before.split(' ').next().unwrap(), "a child forked during the wake");
}

/// The keepers of this world's wakes that are running (their command
/// line names the wake's work dir, under the state dir).
fn keepers(w: &World) -> Vec<i32> {
    let sd = w.state_dir().to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let c = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let c = String::from_utf8_lossy(&c);
            c.contains("__pages-keeper") && c.contains(&sd)
        })
        .filter(|&pid| running(pid))
        .collect()
}

/// Exists and is not a zombie (an orphan's zombie is reaped by whatever
/// pid 1 the test runs under, which may never do it).
fn running(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !s.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'),
        Err(_) => false,
    }
}

fn keeper_logs(w: &World) -> String {
    let mut all = String::new();
    for e in std::fs::read_dir(w.state_dir().join("logs")).unwrap().filter_map(|e| e.ok()) {
        all += &std::fs::read_to_string(e.path().join("keeper.log")).unwrap_or_default();
    }
    all
}

fn hibernate(w: &World, pid: i32, image: &str) {
    let r = w.json(&["hibernate", &pid.to_string(), "--image", image]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    wait_for(Duration::from_secs(10), || !pid_exists(pid));
}

/// When the wake is killed: as soon as the process is back (its faults
/// pending), or once it has forked, remapped, unmapped and removed (the
/// events the dead wake had read are replayed by the keeper).
#[derive(PartialEq)]
enum Kill {
    Early,
    AfterEvents,
}

fn killed_mid_fill(kill: Kill) {
    criu_present();
    let mut w = World::new(&[8192]);
    let (pid, out) = mem_proc(&mut w, "killed", 32);
    hibernate(&w, pid, "mem");
    // The process forks, remaps, unmaps and removes right after the wake,
    // while the (slowed) page server still fills: the keeper must know of
    // those events too.
    std::fs::write(out.with_extension("go"), "").unwrap();
    let i = w.spawn_gpusnap_env(
        &["wake", "mem", "--no-guard"],
        &[("GPUSNAP_PAGES_SLOW_US", "50000"), ("GPUSNAP_PAGES_THREADS", "1")],
    );
    let wake = w.child_pid(i);
    wait_for(Duration::from_secs(60), || pid_exists(pid) && !keepers(&w).is_empty());
    w.adopt(pid);
    let keeper = keepers(&w)[0];
    if kill == Kill::Early {
        std::thread::sleep(Duration::from_millis(1500));
    } else {
        // The child wrote what it read of A: the fork, and the parent's
        // mremap, munmap and madvise before it waits for the child, are done.
        wait_for(Duration::from_secs(60), || out.with_extension("child").exists());
    }
    assert!(w.children[i].try_wait().is_none(), "the wake ended before it could be killed mid-fill");
    assert!(!out.with_extension("after").exists(), "the process read all of its memory already");

    // gpusnap dies in the middle of the fill.
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(wake), nix::sys::signal::Signal::SIGKILL).unwrap();
    w.wait_child(i);

    // The keeper fills what was missing, then exits (reaped by init: it is
    // in a session of its own, and no child of the test).
    assert_memory_intact(&out);
    wait_for(Duration::from_secs(60), || !running(keeper));
    let log = keeper_logs(&w);
    eprintln!("{log}");
    assert!(log.contains("the wake died before every page was in place"), "{log}");
    assert!(log.contains("every page in place"), "{log}");
    // The copies of the image's files (they hold a process's memory) are
    // gone, as a wake that ends removes its own.
    for e in std::fs::read_dir(w.state_dir().join("logs")).unwrap().filter_map(|e| e.ok()) {
        for left in ["img", "keeper", "keeper-manifest.json"] {
            assert!(!e.path().join(left).exists(), "{} left", e.path().join(left).display());
        }
    }
    if kill == Kill::AfterEvents {
        // FORK, REMAP, UNMAP (munmap) and REMOVE (madvise) at least.
        let n: u32 = log
            .split(" events replayed")
            .next()
            .and_then(|s| s.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0);
        assert!(n >= 4, "{log}");
    }
    // Every page is there now: read once more.
    let _ = std::fs::remove_file(out.with_extension("after"));
    std::fs::write(out.with_extension("go"), "").unwrap();
    assert_memory_intact(&out);

    // The next gpusnap commands run, and the image is intact for a retry.
    let r = w.json(&["ps"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(w.json(&["images", "verify", "mem"]).code, 0);
}

#[test]
fn a_wake_killed_mid_fill_leaves_the_keeper_to_fill_every_page() {
    killed_mid_fill(Kill::Early);
}

#[test]
fn a_wake_killed_after_fork_remap_unmap_and_remove_leaves_the_keeper_to_replay_them() {
    killed_mid_fill(Kill::AfterEvents);
}

#[test]
fn a_cuda_wake_killed_mid_fill_is_filled_by_the_keeper_and_the_next_command_brings_it_back() {
    criu_present();
    let mut w = World::new(&[16_384]);
    // 256 MiB on the fake GPU, all of it checked every iteration: after the
    // suspend it is host memory of the process, so in the image's pages.
    let pid = w.workload(256, 0, &["--data-kib", "262144"]);
    let p = pid.to_string();
    hibernate(&w, pid, "cuda");
    w.reap(pid);
    let i = w.spawn_gpusnap_env(
        &["wake", "cuda", "--no-guard", "--wait", "10"],
        &[("GPUSNAP_PAGES_SLOW_US", "50000"), ("GPUSNAP_PAGES_THREADS", "1")],
    );
    let wake = w.child_pid(i);
    wait_for(Duration::from_secs(60), || pid_exists(pid) && !keepers(&w).is_empty());
    w.adopt(pid);
    let keeper = keepers(&w)[0];
    std::thread::sleep(Duration::from_millis(1000));
    assert!(w.children[i].try_wait().is_none(), "the wake ended before it could be killed mid-fill");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(wake), nix::sys::signal::Signal::SIGKILL).unwrap();
    w.wait_child(i);
    wait_for(Duration::from_secs(60), || !running(keeper));
    let log = keeper_logs(&w);
    assert!(log.contains("every page in place"), "{log}");

    // The next command sees the process as the interrupted wake left it;
    // brought back (resumed if the driver's restore did not finish), it
    // computes on intact memory.
    let r = w.json(&["state", &p]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    if r.json()["state"] != "running" {
        let r = w.json(&["resume", &p]);
        assert_eq!(r.code, 0, "{}", r.stderr);
    }
    assert_eq!(w.json(&["state", &p]).json()["state"], "running");
    w.assert_progressing(pid);
    assert!(w.status_of(pid).is_some_and(|s| s.2), "the workload's data after the keeper");
    assert_eq!(w.json(&["stop", &p, "--grace", "2"]).code, 0);
}

#[test]
fn a_lazy_wake_that_ends_leaves_no_keeper_behind() {
    criu_present();
    let mut w = World::new(&[8192]);
    let (pid, out) = mem_proc(&mut w, "done", 16);
    hibernate(&w, pid, "mem");
    std::fs::write(out.with_extension("go"), "").unwrap();
    let r = w.json(&["wake", "mem", "--no-guard"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    assert_eq!(r.json()["lazy"], true, "{}", r.stdout);
    // A keeper ran (its log exists), said nothing, and is gone (waited for
    // by the wake: no zombie).
    assert!(std::fs::read_dir(w.state_dir().join("logs"))
        .unwrap()
        .filter_map(|e| e.ok())
        .any(|e| e.path().join("keeper.log").exists()));
    assert_eq!(keeper_logs(&w), "");
    assert!(std::fs::read_dir(w.state_dir().join("logs"))
        .unwrap()
        .filter_map(|e| e.ok())
        .all(|e| !e.path().join("keeper-manifest.json").exists()));
    assert!(keepers(&w).is_empty(), "a keeper is left: {:?}", keepers(&w));
    assert_memory_intact(&out);
}

#[test]
fn the_keeper_is_hidden_and_refuses_to_run_by_hand() {
    let w = World::new(&[8192]);
    let r = w.gpusnap(&["--help"]);
    assert!(!r.stdout.contains("__pages-keeper") && !r.stdout.contains("keeper"), "{}", r.stdout);
    // Not started by a wake (stdin is no socket): one line, exit 2.
    let r = w.gpusnap(&["__pages-keeper", "/nonexistent", "/nonexistent"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert_eq!(r.stderr.trim().lines().count(), 1, "{}", r.stderr);
    assert!(r.stderr.contains("not the socket of a lazy wake"), "{}", r.stderr);
}
