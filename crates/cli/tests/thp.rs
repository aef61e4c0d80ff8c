//! `--thp`: transparent huge pages `always` for the checkpoint, put back
//! after it and after a gpusnap that died (against a fake sysfs file: its
//! own binary, the file is named through the environment).

mod common;

use common::*;
use serde_json::json;
use std::time::Duration;

fn selected(p: &std::path::Path) -> String {
    let s = std::fs::read_to_string(p).unwrap();
    let w = s.split_whitespace().find(|w| w.starts_with('[')).or_else(|| s.split_whitespace().next());
    w.unwrap_or("").trim_matches(['[', ']']).to_string()
}

#[test]
fn thp_is_always_during_the_checkpoint_and_put_back_after_even_after_a_crash() {
    // A slow checkpoint (512 MiB at 0.25 GB/s): long enough to be seen.
    let mut w = World::with_config(&[16_384], json!({ "checkpoint_gbps": 0.25 }));
    let sysfs = w.state_dir().with_file_name("thp-enabled");
    std::fs::write(&sysfs, "always [madvise] never\n").unwrap();
    std::env::set_var("GPUSNAP_THP_SYSFS", &sysfs);
    let pid = w.workload(512, 0, &[]);
    let p = pid.to_string();

    let i = w.spawn_gpusnap(&["--json", "suspend", &p, "--thp"]);
    wait_for(Duration::from_secs(30), || selected(&sysfs) == "always");
    assert!(w.wait_child(i).success());
    assert_eq!(selected(&sysfs), "madvise", "put back after the checkpoint");
    assert!(!w.state_dir().join("thp.json").exists());
    assert_eq!(w.json(&["state", &p]).json()["state"], "checkpointed");

    // Already `always`: nothing to switch, nothing put back.
    assert_eq!(w.json(&["resume", &p]).code, 0);
    std::fs::write(&sysfs, "[always] madvise never\n").unwrap();
    let r = w.json(&["suspend", &p, "--thp"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(selected(&sysfs), "always");
    assert_eq!(w.json(&["resume", &p]).code, 0);

    // A gpusnap that died with THP switched: the next command puts it back.
    std::fs::write(&sysfs, "always").unwrap();
    let dead = w.spawn_env("true", &[]);
    let dead_pid = w.child_pid(dead);
    w.wait_child(dead);
    std::fs::create_dir_all(w.state_dir()).unwrap();
    std::fs::write(
        w.state_dir().join("thp.json"),
        json!({ "previous": "never", "owners": [[dead_pid, 1]] }).to_string(),
    )
    .unwrap();
    assert_eq!(w.json(&["ps"]).code, 0);
    assert_eq!(selected(&sysfs), "never");
    assert!(!w.state_dir().join("thp.json").exists());

    // A sysfs that cannot be written: a clear error before anything is done.
    std::env::set_var("GPUSNAP_THP_SYSFS", "/nonexistent/enabled");
    let r = w.json(&["suspend", &p, "--thp"]);
    assert_ne!(r.code, 0);
    assert!(r.stderr.contains("transparent huge pages"), "{}", r.stderr);
    std::env::remove_var("GPUSNAP_THP_SYSFS");
    assert_eq!(w.json(&["state", &p]).json()["state"], "running");
    assert_eq!(w.json(&["stop", &p, "--grace", "2"]).code, 0);
}
