//! A CRIU that fails during a hibernate's dump, whatever it did to the tree
//! first: the tree is left running (no tracer, no thread stopped), its CUDA
//! state back on the GPU, and no image. Replays the soak's `criu-dump-fail`
//! (seed 7), where a CRIU that dumped the tree, left it stopped and then
//! failed left the service's process stopped while the agent said running.

mod common;

use common::*;
use std::path::PathBuf;

/// A CRIU (a wrapper beside the state directory) whose dump fails:
/// `after`: it dumps the tree, leaves it stopped as gpusnap asks, and then
/// reports a failure; `killed`: it is killed (SIGKILL) as soon as it has
/// seized the tree (the root shows a tracer).
fn failing_criu(w: &World, how: &str) -> PathBuf {
    let wrapper = w.state_dir().with_file_name(format!("criu-dump-{how}"));
    let script = match how {
        "after" => "#!/bin/sh\nif [ \"$1\" = dump ]; then criu \"$@\"; echo 'Error (wrapper): failed after the dump' >&2; exit 1; fi\nexec criu \"$@\"\n",
        _ => r#"#!/bin/bash
if [ "$1" = dump ]; then
    prev="" root=""
    for a in "$@"; do [ "$prev" = --tree ] && root=$a; prev=$a; done
    criu "$@" &
    c=$!
    seized=0
    while [ "$seized" = 0 ] && kill -0 "$c" 2>/dev/null; do
        while read -r k v; do
            [ "$k" = TracerPid: ] && [ "$v" != 0 ] && seized=1
        done <"/proc/$root/status"
    done
    kill -9 "$c"
    wait "$c"
    echo 'Error (wrapper): criu killed while it held the tree' >&2
    exit 1
fi
exec criu "$@"
"#,
    };
    std::fs::write(&wrapper, script).unwrap();
    std::fs::set_permissions(&wrapper, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    wrapper
}

/// Each thread of `pid`: (tid, state letter, tracer pid).
fn threads(pid: i32) -> Vec<(String, String, String)> {
    let mut out = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
        let field = |k: &str| {
            status.lines().find_map(|l| l.strip_prefix(k)).map(|v| v.trim().to_string()).unwrap_or_default()
        };
        out.push((t.file_name().to_string_lossy().into_owned(), field("State:"), field("TracerPid:")));
    }
    out
}

#[test]
fn a_criu_failing_mid_dump_leaves_the_tree_running_and_no_image() {
    criu_present();
    let mut w = World::new(&[16_384]);
    let pid = w.workload(256, 0, &[]);
    let p = pid.to_string();
    for how in ["after", "killed"] {
        let criu = failing_criu(&w, how);
        let image = format!("x-{how}");
        let r = w.json(&["--criu", criu.to_str().unwrap(), "hibernate", &p, "--image", &image]);
        assert_ne!(r.code, 0, "{how}: {}", r.stdout);
        // When gpusnap has answered, no thread of the tree is stopped or
        // traced, whatever CRIU did.
        let ts = threads(pid);
        assert!(
            ts.iter().all(|(_, st, tracer)| !st.starts_with('T') && !st.starts_with('t') && tracer == "0"),
            "{how}: {ts:?}"
        );
        assert_eq!(w.json(&["state", &p]).json()["state"], "running", "{how}");
        w.assert_progressing(pid);
        assert_ne!(w.json(&["images", "verify", &image]).code, 0, "{how}: no image is left");
    }
    // Nothing is in the way of a hibernate that works.
    let r = w.json(&["hibernate", &p, "--image", "ok"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.reap(pid);
    assert_eq!(w.json(&["images", "verify", "ok"]).code, 0);
}
