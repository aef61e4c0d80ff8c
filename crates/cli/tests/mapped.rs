//! The mapped wake (docs/design/wake.md, "The mapped wake"): `images map` builds
//! an image's map file, and a wake maps the CUDA processes' large regions
//! (the fake driver's host copy here) from it instead of filling them. Real
//! CRIU, fake CUDA: the fake driver's restore reads the host copy from the
//! mapping and says whether it read what its checkpoint wrote.

mod common;

use common::*;

fn maps_of(pid: i32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default()
}

#[test]
fn a_wake_maps_the_host_copy_from_the_map_file_and_the_driver_reads_it_intact() {
    criu_present();
    let mut w = World::new(&[16_384]);
    let pid = hibernated_host_copy(&mut w, 128, "mp");
    let r = w.json(&["images", "map", "mp"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let b = r.json();
    assert!(b["regions"].as_u64().unwrap() >= 1, "{b}");
    assert!(b["bytes"].as_u64().unwrap() >= 128 << 20, "{b}");
    // CRIU's pagemap entries (~1 MiB each) merged into a few runs, so the
    // wake's check hashes chunks where they lie.
    let idx: serde_json::Value =
        serde_json::from_slice(&std::fs::read(w.state_dir().join("maps/mp.json")).unwrap()).unwrap();
    for r in idx["regions"].as_array().unwrap() {
        assert!(r["runs"].as_array().unwrap().len() <= 4, "{r}");
    }
    let map = w.state_dir().join("maps/mp.map");
    assert!(map.is_file() && w.state_dir().join("maps/mp.json").is_file());
    // The build's work copy is gone with it (no log dir left for it).
    let logs: Vec<String> = std::fs::read_dir(w.state_dir().join("logs"))
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    assert!(!logs.iter().any(|n| n.contains("-map-")), "{logs:?}");
    // `images list` says which image has a map file, and how large.
    let l = w.json(&["images", "list"]);
    let img = &l.json()["images"][0];
    assert_eq!(img["name"], "mp", "{}", l.stdout);
    assert_eq!(img["map_bytes"].as_u64(), Some(std::fs::metadata(&map).unwrap().len()), "{}", l.stdout);
    let human = w.gpusnap(&["images"]);
    assert!(human.stdout.contains("MAP FILE"), "{}", human.stdout);

    let r = w.json(&["wake", "mp", "--no-guard", "--wait", "10"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    let v = r.json();
    assert!(v["mapped_bytes"].as_u64().unwrap() >= 128 << 20, "{v}");
    assert!(v["stages"]["map_hash"].as_u64().unwrap() <= v["stages"]["map_check"].as_u64().unwrap(), "{v}");
    assert!(!r.stderr.contains("notice"), "{}", r.stderr);
    // The page server served the rest only: not the host copy.
    assert!(v["pages_bytes"].as_u64().unwrap() < 128 << 20, "{v}");
    // The driver's restore read, from the mapping, what its checkpoint wrote.
    assert_eq!(w.restore_data(pid), ["ok"], "{v}");
    let canon = std::fs::canonicalize(&map).unwrap();
    assert!(maps_of(pid).contains(canon.to_str().unwrap()), "{}", maps_of(pid));
    w.assert_progressing(pid);
    assert_eq!(w.status_of(pid).map(|s| s.2), Some(true));

    // The fake driver's checkpoint writes its host copy back into the same
    // mapping (the real one maps fresh memory there): an image of it would
    // need the map file, so the hibernate is refused and the process runs on.
    let h = w.json(&["hibernate", &pid.to_string(), "--image", "mp2"]);
    assert_eq!(h.code, 2, "{}", h.stderr);
    assert_eq!(h.json()["error"]["kind"], "map_still_mapped", "{}", h.stderr);
    w.assert_progressing(pid);
    assert_eq!(w.json(&["stop", &pid.to_string(), "--grace", "2"]).code, 0);

    // `images rm` takes the map file with the image.
    assert_eq!(w.json(&["images", "rm", "mp"]).code, 0);
    assert!(!map.exists() && !w.state_dir().join("maps/mp.json").exists());

    // `images gc` removes what no image owns: a killed build's temporary
    // file, the map of an image gone another way; a live image's stays.
    let maps = w.state_dir().join("maps");
    assert_eq!(w.json(&["images", "map", "mp2x"]).code, 2, "no such image");
    std::fs::write(maps.join("gone.map"), b"x").unwrap();
    std::fs::write(maps.join("gone.json"), b"{}").unwrap();
    std::fs::write(maps.join("keep.map.tmp-1"), b"x").unwrap();
    hibernated_host_copy(&mut w, 64, "keep");
    let k = w.json(&["images", "map", "keep"]);
    assert_eq!(k.code, 0, "{}", k.stderr);
    assert!(k.json()["regions"].as_u64().unwrap() >= 1, "{}", k.stdout);
    let g = w.json(&["images", "gc"]);
    assert_eq!(g.code, 0, "{}", g.stderr);
    let mut left: Vec<String> =
        std::fs::read_dir(&maps).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    left.sort();
    assert_eq!(left, ["keep.json", "keep.map"], "{}", g.stdout);
}

#[test]
fn a_map_file_that_differs_from_the_image_is_not_used_and_the_wake_fills_memory() {
    criu_present();
    let mut w = World::new(&[16_384]);
    let pid = hibernated_host_copy(&mut w, 64, "bad");
    assert_eq!(w.json(&["images", "map", "bad"]).code, 0);
    // One byte of the host copy's pages changed in the map file.
    let idx: serde_json::Value =
        serde_json::from_slice(&std::fs::read(w.state_dir().join("maps/bad.json")).unwrap()).unwrap();
    let region = &idx["regions"][0];
    let (start, run) = (region["start"].as_u64().unwrap(), &region["runs"][0]);
    let at = region["file_off"].as_u64().unwrap() + run[0].as_u64().unwrap() - start + 4097;
    let map = w.state_dir().join("maps/bad.map");
    let mut bytes = std::fs::read(&map).unwrap();
    bytes[at as usize] ^= 0x5a;
    std::fs::write(&map, &bytes).unwrap();

    let r = w.json(&["wake", "bad", "--no-guard", "--wait", "10"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    let v = r.json();
    assert_eq!(v["mapped_bytes"], 0, "{v}");
    assert!(r.stderr.contains("notice") && r.stderr.contains("map file"), "{}", r.stderr);
    assert!(v["pages_bytes"].as_u64().unwrap() >= 64 << 20, "{v}");
    assert_eq!(w.restore_data(pid), ["ok"], "{v}");
    assert!(!maps_of(pid).contains("bad.map"));
    assert_eq!(w.json(&["stop", &pid.to_string(), "--grace", "2"]).code, 0);
}

#[test]
fn hibernate_map_builds_the_map_file_and_one_out_of_the_page_cache_is_not_used() {
    use std::os::fd::AsRawFd;
    criu_present();
    let mut w = World::new(&[16_384]);
    // `hibernate --map` builds the map file with the image.
    let pid = w.workload(64, 0, &["--host-copy-mib", "64"]);
    let r = w.json(&["hibernate", &pid.to_string(), "--image", "cold", "--map"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.reap(pid);
    let b = r.json();
    assert!(b["map"]["regions"].as_u64().unwrap() >= 1, "{b}");
    assert!(b["map"]["bytes"].as_u64().unwrap() >= 64 << 20, "{b}");
    assert!(w.state_dir().join("maps/cold.json").is_file());
    // A tree with no CUDA process has nothing to map: a notice, the image stands.
    let (plain, _) = w.cpu_tree();
    let r = w.json(&["hibernate", &plain.to_string(), "--image", "plain", "--map"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.reap(plain);
    assert!(r.json().get("map").is_none(), "{}", r.stdout);
    assert!(r.stderr.contains("no region to map"), "{}", r.stderr);
    assert!(!w.state_dir().join("maps/plain.json").exists());
    // The build flushed it: dropped from the page cache, it is cold (its
    // faults would be the driver's, one thread, where the page server
    // reads the image on many).
    let f = std::fs::File::open(w.state_dir().join("maps/cold.map")).unwrap();
    // SAFETY: fadvise on an open file of the test's own state directory.
    assert_eq!(unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) }, 0);
    let r = w.json(&["wake", "cold", "--no-guard", "--wait", "10"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    let v = r.json();
    assert_eq!(v["mapped_bytes"], 0, "{v}");
    assert!(r.stderr.contains("in the page cache"), "{}", r.stderr);
    assert_eq!(w.restore_data(pid), ["ok"], "{v}");
    assert!(!maps_of(pid).contains("cold.map"));
    assert_eq!(w.json(&["stop", &pid.to_string(), "--grace", "2"]).code, 0);
}

#[test]
fn an_image_hibernated_again_under_the_same_name_does_not_use_the_old_map_file() {
    criu_present();
    let mut w = World::new(&[16_384]);
    let pid = hibernated_host_copy(&mut w, 64, "again");
    assert_eq!(w.json(&["images", "map", "again"]).code, 0);
    assert_eq!(w.json(&["images", "rm", "again"]).code, 0);
    // rm took the map: put a stale index back to see the wake refuse it.
    let pid2 = hibernated_host_copy(&mut w, 64, "again");
    let old = serde_json::json!({"format": 1, "image": "again", "created_ms": 1, "root_pid": pid,
        "size": 4096, "regions": []});
    std::fs::write(w.state_dir().join("maps/again.json"), old.to_string()).unwrap();
    std::fs::write(w.state_dir().join("maps/again.map"), vec![0u8; 4096]).unwrap();
    // A map file of another image of that name is none of this one's.
    let l = w.json(&["images", "list"]);
    assert!(l.json()["images"][0]["map_bytes"].is_null(), "{}", l.stdout);
    let r = w.json(&["wake", "again", "--no-guard", "--wait", "10"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid2);
    assert_eq!(r.json()["mapped_bytes"], 0);
    assert!(r.stderr.contains("another image"), "{}", r.stderr);
    assert_eq!(w.restore_data(pid2), ["ok"]);
    assert_eq!(w.json(&["stop", &pid2.to_string(), "--grace", "2"]).code, 0);
}

#[test]
fn a_mapped_wake_whose_lazy_restore_fails_restores_eagerly_over_the_mapping() {
    criu_present();
    let mut w = World::new(&[16_384]);
    let pid = hibernated_host_copy(&mut w, 64, "eg");
    assert_eq!(w.json(&["images", "map", "eg"]).code, 0);
    // A CRIU that refuses --lazy-pages: the wake falls back to an eager
    // restore of the same work copy, where CRIU writes the regions' pages
    // over the file's mapping (copy-on-write): the same bytes, no gain.
    let wrapper = criu_without_lazy(&w);
    let r = w.json(&["--criu", wrapper.to_str().unwrap(), "wake", "eg", "--no-guard", "--wait", "10"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    let v = r.json();
    assert_eq!(v["lazy"], false, "{v}");
    assert_eq!(v["mapped_bytes"], 0, "{v}");
    assert!(v["stages"]["map_check"].as_u64().is_some(), "{v}");
    assert_eq!(w.restore_data(pid), ["ok"], "{v}");
    w.assert_progressing(pid);
    assert_eq!(w.status_of(pid).map(|s| s.2), Some(true));
    assert_eq!(w.json(&["stop", &pid.to_string(), "--grace", "2"]).code, 0);
}

#[test]
fn images_map_refuses_a_path_and_a_corrupt_image_and_leaves_nothing_behind() {
    criu_present();
    let mut w = World::new(&[16_384]);
    hibernated_host_copy(&mut w, 64, "cm");
    // A path: map files are kept for the store's images.
    let dir = w.state_dir().join("images/cm");
    let r = w.json(&["images", "map", dir.to_str().unwrap()]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("map files are kept for images of the store"), "{}", r.stderr);
    // Every chunk of its pages damaged: the build reads them checked and
    // stops at the first bad one; no map file, index or temporary is left.
    let mut good = Vec::new();
    for h in pages_chunks(&w.state_dir(), "cm") {
        let p = w.state_dir().join("store/chunks").join(&h[..2]).join(&h);
        let bytes = std::fs::read(&p).unwrap();
        let mut bad = bytes.clone();
        let at = bad.len() / 2;
        bad[at] ^= 0x5a;
        std::fs::write(&p, &bad).unwrap();
        good.push((p, bytes));
    }
    let r = w.json(&["images", "map", "cm"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert_eq!(r.json()["error"]["kind"], "image_invalid", "{}", r.stderr);
    let maps = w.state_dir().join("maps");
    let left: Vec<_> =
        std::fs::read_dir(&maps).map(|d| d.filter_map(|e| e.ok()).collect()).unwrap_or_default();
    assert!(left.is_empty(), "{:?}", left.iter().map(|e| e.file_name()).collect::<Vec<_>>());
    // Nothing lost: the chunks put back, the map builds.
    for (p, bytes) in good {
        std::fs::write(&p, bytes).unwrap();
    }
    let r = w.json(&["images", "map", "cm"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.json()["regions"].as_u64().unwrap() >= 1, "{}", r.stdout);
}

/// The map file a wake checked is the one CRIU maps: a file of other bytes
/// renamed over it between the check and CRIU's restore (by someone able
/// to write STATE/maps) is not what the process gets.
#[test]
fn a_map_file_swapped_after_the_check_is_not_what_criu_maps() {
    use std::os::unix::fs::PermissionsExt;
    criu_present();
    let mut w = World::new(&[16_384]);
    let pid = hibernated_host_copy(&mut w, 64, "sw");
    assert_eq!(w.json(&["images", "map", "sw"]).code, 0);
    let maps = w.state_dir().join("maps");
    let map = maps.join("sw.map");
    let mut bytes = std::fs::read(&map).unwrap();
    for b in bytes.iter_mut().step_by(4096) {
        *b ^= 0x5a;
    }
    let evil = maps.join("evil");
    std::fs::write(&evil, &bytes).unwrap();
    // A CRIU that, asked to restore, waits for the swap first.
    let real = String::from_utf8(
        std::process::Command::new("sh").args(["-c", "command -v criu"]).output().unwrap().stdout,
    )
    .unwrap()
    .trim()
    .to_string();
    let (flag, go) = (w.tmp.path().join("restore.asked"), w.tmp.path().join("restore.go"));
    let criu = w.tmp.path().join("criu-waits-before-restore");
    std::fs::write(
        &criu,
        format!(
            "#!/bin/sh\nif [ \"$1\" = restore ]; then\n  : > \"{f}\"\n  i=0; while [ ! -e \"{g}\" ] && [ $i -lt 1200 ]; do \
             sleep 0.1; i=$((i+1)); done\nfi\nexec \"{real}\" \"$@\"\n",
            f = flag.display(),
            g = go.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&criu, std::fs::Permissions::from_mode(0o755)).unwrap();
    let idx = w.spawn_gpusnap(&[
        "--json",
        "--criu",
        criu.to_str().unwrap(),
        "wake",
        "sw",
        "--no-guard",
        "--wait",
        "10",
    ]);
    wait_for(std::time::Duration::from_secs(120), || flag.exists());
    std::fs::rename(&evil, &map).unwrap();
    std::fs::write(&go, b"").unwrap();
    let st = w.wait_child(idx);
    let out = std::fs::read_to_string(w.tmp.path().join(format!("gpusnap-{idx}.out"))).unwrap();
    let err = std::fs::read_to_string(w.tmp.path().join(format!("gpusnap-{idx}.err"))).unwrap();
    assert_eq!(st.code(), Some(0), "{out} {err}");
    w.adopt(pid);
    let v: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert!(v["mapped_bytes"].as_u64().unwrap() >= 64 << 20, "{v}");
    // The driver's restore read the checked bytes, not the swapped ones.
    assert_eq!(w.restore_data(pid), ["ok"], "{v}");
    assert!(maps_of(pid).contains("sw.map (deleted)"), "{}", maps_of(pid));
    assert_eq!(w.json(&["stop", &pid.to_string(), "--grace", "2"]).code, 0);
}
