//! A page server that fails in the middle of a wake. The failure is
//! injected through the environment of each gpusnap the test runs
//! (`World::env_extra`), never the test binary's own: its tests run in
//! parallel threads that share one environment, so a process-wide
//! variable made the other test's retry fail too (seen in CI).

mod common;

use common::*;
use std::time::Duration;

#[test]
fn a_page_server_failing_mid_wake_ends_the_tree_and_keeps_the_image() {
    criu_present();
    let mut w = World::new(&[16_384]);
    let pid = w.workload(1024, 0, &[]);
    let p = pid.to_string();
    let r = w.json(&["hibernate", &p, "--image", "x"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.reap(pid);
    wait_for(Duration::from_secs(10), || !pid_exists(pid));

    // Once its first pages are in, the page server fails.
    w.env_extra.push(("GPUSNAP_PAGES_FAIL_AFTER".into(), "4096".into()));
    let r = w.json(&["wake", "x", "--no-guard", "--wait", "10"]);
    w.env_extra.retain(|(k, _)| k != "GPUSNAP_PAGES_FAIL_AFTER");
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert_eq!(r.json()["error"]["kind"], "pages", "{}", r.stdout);
    // The woken tree was ended (suspended first when it was back on the GPU).
    wait_for(Duration::from_secs(20), || !pid_exists(pid));
    let ps = w.json(&["ps"]).json();
    assert!(
        ps["processes"].as_array().unwrap().iter().all(|x| x["pid"] != pid),
        "nothing of it is left on the GPU"
    );
    // The image is intact and the retry wakes it.
    assert_eq!(w.json(&["images", "verify", "x"]).code, 0);
    let r = w.json(&["wake", "x", "--no-guard", "--wait", "10"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    assert_eq!(r.json()["lazy"], true);
    w.assert_progressing(pid);
    assert_eq!(w.json(&["stop", &p, "--grace", "2"]).code, 0);
}

#[test]
fn a_page_server_failing_during_its_head_start_never_starts_the_driver() {
    criu_present();
    let mut w = World::new(&[16_384]);
    let pid = w.workload(512, 0, &[]);
    let p = pid.to_string();
    let r = w.json(&["hibernate", &p, "--image", "h"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.reap(pid);
    wait_for(Duration::from_secs(10), || !pid_exists(pid));
    let restores_before = w.calls_on(pid).iter().filter(|c| c.starts_with("restore")).count();

    // The driver's restore waits for all of the memory; the page server
    // fails before that.
    w.env_extra.push(("GPUSNAP_PAGES_HEAD_START".into(), "100%".into()));
    w.env_extra.push(("GPUSNAP_PAGES_FAIL_AFTER".into(), "4096".into()));
    let r = w.json(&["wake", "h", "--no-guard", "--wait", "10"]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert_eq!(r.json()["error"]["kind"], "pages", "{}", r.stdout);
    wait_for(Duration::from_secs(20), || !pid_exists(pid));
    let restores = w.calls_on(pid).iter().filter(|c| c.starts_with("restore")).count();
    assert_eq!(restores, restores_before, "the driver was asked to restore: {:?}", w.calls_on(pid));
    // The image is intact and the retry (with the head start) wakes it.
    assert_eq!(w.json(&["images", "verify", "h"]).code, 0);
    w.env_extra.retain(|(k, _)| k != "GPUSNAP_PAGES_FAIL_AFTER");
    let r = w.json(&["wake", "h", "--no-guard", "--wait", "10"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    let v = r.json();
    assert_eq!(v["lazy"], true, "{v}");
    assert_eq!(v["pages"]["options"]["head_start"]["fraction"], 1.0, "{v}");
    w.assert_progressing(pid);
    assert_eq!(w.json(&["stop", &p, "--grace", "2"]).code, 0);
}

/// A CRIU (a wrapper beside the state directory) whose restore restores the
/// tree and then reports a failure anyway, as a CRIU that crashes after
/// detaching the tree does (the soak's `criu-restore-fail`, seed 5).
fn criu_failing_after_restore(w: &World) -> std::path::PathBuf {
    let wrapper = w.state_dir().with_file_name("criu-fail-after-restore");
    std::fs::write(
        &wrapper,
        "#!/bin/sh\nif [ \"$1\" = restore ]; then criu \"$@\"; echo 'Error (wrapper): failed after the restore' >&2; exit 1; fi\nexec criu \"$@\"\n",
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    wrapper
}

#[test]
fn a_criu_failing_after_its_restore_leaves_no_tree_and_the_wake_can_be_retried() {
    criu_present();
    let mut w = World::new(&[16_384]);
    let pid = w.workload(64, 0, &[]);
    let p = pid.to_string();
    let r = w.json(&["hibernate", &p, "--image", "f"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.reap(pid);
    wait_for(Duration::from_secs(10), || !pid_exists(pid));

    for eager in [false, true] {
        let criu = criu_failing_after_restore(&w);
        let mut args = vec!["--criu", criu.to_str().unwrap(), "wake", "f", "--no-guard", "--wait", "10"];
        if eager {
            args.push("--eager");
        }
        let r = w.json(&args);
        assert_ne!(r.code, 0, "eager {eager}: {}", r.stdout);
        // The tree CRIU restored before failing was ended: its pid is free
        // for the retry, nothing of it is on the GPU.
        wait_for(Duration::from_secs(30), || !pid_exists(pid));
        assert_eq!(w.json(&["images", "verify", "f"]).code, 0);
    }
    let r = w.json(&["wake", "f", "--no-guard", "--wait", "10"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    w.assert_progressing(pid);
    assert_eq!(w.json(&["stop", &p, "--grace", "2"]).code, 0);
}

/// A CRIU whose restore restores the tree and then kills the gpusnap that
/// ran it, as a `kill -9` of a wake just after CRIU's restore does (the
/// soak's `kill-wake`, seed 2): the woken process lives, suspended, and
/// nothing recorded it.
fn criu_killing_the_wake_after_restore(w: &World) -> std::path::PathBuf {
    let wrapper = w.state_dir().with_file_name("criu-kill-the-wake");
    std::fs::write(
        &wrapper,
        "#!/bin/sh\nif [ \"$1\" = restore ]; then criu \"$@\"; rc=$?; kill -9 $PPID; exit $rc; fi\nexec criu \"$@\"\n",
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    wrapper
}

#[test]
fn a_wake_killed_once_criu_restored_the_tree_is_finished_by_resume() {
    criu_present();
    let mut w = World::new(&[16_384]);
    let pid = w.workload(64, 0, &[]);
    let p = pid.to_string();
    let r = w.json(&["hibernate", &p, "--image", "k"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.reap(pid);
    wait_for(Duration::from_secs(10), || !pid_exists(pid));

    let criu = criu_killing_the_wake_after_restore(&w);
    let r = w.json(&["--criu", criu.to_str().unwrap(), "wake", "k", "--no-guard", "--eager", "--wait", "10"]);
    assert_ne!(r.code, 0, "the wake was killed: {}", r.stdout);
    // The tree CRIU restored lives, suspended; resume takes its footprint
    // from the image and brings it back.
    wait_for(Duration::from_secs(30), || pid_exists(pid));
    let r = w.json(&["resume", &p]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    w.assert_progressing(pid);
    assert_eq!(w.json(&["stop", &p, "--grace", "2"]).code, 0);
}
