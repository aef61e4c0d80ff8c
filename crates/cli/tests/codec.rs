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
/// shrinks them), checking them.
fn holder(w: &mut World, mib: u64) -> (i32, std::path::PathBuf) {
    checking_holder(w, mib, "bytearray(os.urandom(n).translate(bytes(i & 15 for i in range(256))))")
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
    wake_intact(&mut w, pid, "z", &out);
    let r = w.json(&["snapshot", &p, "--image", "again"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stderr.contains("GPUSNAP_CHUNK_CODEC=gzip"), "{}", r.stderr);
}
