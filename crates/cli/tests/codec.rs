//! How new chunks are encoded (`GPUSNAP_CHUNK_CODEC`, crates/chunks/src/lib.rs
//! `Codec`): the default keeps raw what only entropy coding would shrink,
//! `zstd` codes it; images of either kind wake the same way. Real CRIU.

mod common;

use common::*;
use std::path::Path;
use std::time::Duration;

/// Bytes of the store's chunks, by their tag: (raw, zstd frames).
fn by_tag(state: &Path) -> (u64, u64) {
    let (mut raw, mut z) = (0, 0);
    for d in std::fs::read_dir(state.join("store").join("chunks")).into_iter().flatten().flatten() {
        for f in std::fs::read_dir(d.path()).into_iter().flatten().flatten() {
            let b = std::fs::read(f.path()).unwrap();
            match b.first() {
                Some(b'R') => raw += b.len() as u64 - 1,
                Some(b'Z') => z += b.len() as u64 - 1,
                _ => {}
            }
        }
    }
    (raw, z)
}

/// A python process holding `mib` MiB of random bytes below 16 (four bits
/// of entropy each, no repeats: as a model's weights, only entropy coding
/// shrinks them), checking them over and over: each check appends "N ok"
/// or "N bad" to OUT.
fn holder(w: &mut World, mib: u64) -> (i32, std::path::PathBuf) {
    let out = w.tmp.path().join("hold");
    let script = r#"
import hashlib, os, sys, time
buf = bytearray(os.urandom(int(sys.argv[1]) << 20).translate(bytes(i & 15 for i in range(256))))
want = hashlib.sha256(buf).digest()
out = sys.argv[2]
i = 0
while True:
    i += 1
    ok = hashlib.sha256(buf).digest() == want
    with open(out, "a") as f: f.write(f"{i} {'ok' if ok else 'bad'}\n")
    time.sleep(0.05)
"#;
    let n = w.spawn_env("python3", &["-c", script, &mib.to_string(), out.to_str().unwrap()]);
    let pid = w.child_pid(n);
    wait_for(Duration::from_secs(60), || std::fs::read_to_string(&out).is_ok_and(|s| s.contains(" ok")));
    (pid, out)
}

fn checks(out: &Path) -> (usize, usize) {
    let s = std::fs::read_to_string(out).unwrap_or_default();
    (s.lines().filter(|l| l.ends_with(" ok")).count(), s.lines().filter(|l| l.ends_with(" bad")).count())
}

#[test]
fn the_codec_setting_picks_how_new_chunks_are_stored_and_both_wake() {
    criu_present();
    let mut w = World::new(&[8192]);
    w.run_limit = Duration::from_secs(300);
    let (pid, out) = holder(&mut w, 96);
    let p = pid.to_string();
    let state = w.state_dir();

    // The default: the 96 MiB are stored raw.
    let r = w.json(&["snapshot", &p, "--image", "lz"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let (raw, z) = by_tag(&state);
    assert!(raw > 90 << 20, "raw {raw}, zstd {z}");

    // Removed, the same memory again with zstd: about half as many bytes.
    assert_eq!(w.json(&["images", "rm", "lz"]).code, 0);
    assert_eq!(w.json(&["images", "gc"]).code, 0);
    w.env_extra.push(("GPUSNAP_CHUNK_CODEC".into(), "zstd".into()));
    let r = w.json(&["hibernate", &p, "--image", "z"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let (raw, z) = by_tag(&state);
    assert!(z > 30 << 20 && z < 64 << 20 && raw < 8 << 20, "raw {raw}, zstd {z}");

    // A value it does not know: said so, and lz is used; the zstd image
    // wakes intact either way.
    w.env_extra.retain(|(k, _)| k != "GPUSNAP_CHUNK_CODEC");
    w.env_extra.push(("GPUSNAP_CHUNK_CODEC".into(), "gzip".into()));
    w.reap(pid);
    wait_for(Duration::from_secs(10), || !pid_exists(pid));
    let (good, bad) = checks(&out);
    assert_eq!(bad, 0);
    let r = w.json(&["wake", "z", "--wait", "30"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    wait_for(Duration::from_secs(60), || checks(&out).0 > good + 2);
    assert_eq!(checks(&out).1, 0, "the memory came back intact");
    let r = w.json(&["snapshot", &p, "--image", "again"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stderr.contains("GPUSNAP_CHUNK_CODEC=gzip"), "{}", r.stderr);
}
