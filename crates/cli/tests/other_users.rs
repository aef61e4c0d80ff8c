//! What another user can reach: a process's own environment naming a
//! path for root's guard, the state directory's parts and the modes of
//! what gpusnap writes there, paths renamed under `images rm`.

mod common;

use common::*;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// A root-owned directory (0755) holding one root-owned file: what a
/// hostile path names.
fn victim(w: &World) -> (PathBuf, PathBuf) {
    let dir = w.tmp.path().join("etc");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let file = dir.join("passwd");
    std::fs::write(&file, b"root:x:0:0:root:/root:/bin/bash\n").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    (dir, file)
}

fn assert_untouched(dir: &Path, file: &Path) {
    let d = std::fs::symlink_metadata(dir).unwrap();
    assert!(d.is_dir() && d.mode() & 0o7777 == 0o755 && d.uid() == 0, "{:o}", d.mode());
    let f = std::fs::symlink_metadata(file).unwrap();
    assert!(f.is_file() && f.mode() & 0o7777 == 0o644, "{:o}", f.mode());
    assert_eq!(std::fs::read(file).unwrap(), b"root:x:0:0:root:/root:/bin/bash\n");
    assert_eq!(std::fs::read_dir(dir).unwrap().count(), 1, "nothing made beside it");
}

/// `sleep` as `uid` (`nobody`: 65534), its environment naming `socket` for
/// the guard.
fn sleeping_as(w: &mut World, uid: u32, socket: &Path) -> i32 {
    let mut cmd = Command::new("setpriv");
    cmd.arg(format!("--reuid={uid}"))
        .arg(format!("--regid={uid}"))
        .args(["--clear-groups", "env"])
        .arg(format!("GPUSNAP_GUARD_SOCKET={}", socket.display()))
        .args(["sleep", "600"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let pid = w.spawn_cmd(cmd);
    // Up once it is sleep, as nobody, with the variable.
    wait_for(Duration::from_secs(20), || {
        std::fs::read(format!("/proc/{pid}/environ"))
            .is_ok_and(|e| e.windows(20).any(|x| x == b"GPUSNAP_GUARD_SOCKET"))
            && std::fs::metadata(format!("/proc/{pid}")).is_ok_and(|m| m.uid() == uid)
    });
    pid
}

/// High: the guard's socket path comes from the target's environment,
/// which the target sets. A path outside gpusnap's own guards directory is
/// refused (nothing removed, bound or chmodded there), by `guard --daemon`
/// and by the guard a wake starts.
#[test]
fn a_guard_serves_no_socket_outside_its_own_directory() {
    criu_present();
    let mut w = World::new(&[8192]);
    let (dir, file) = victim(&w);
    let pid = sleeping_as(&mut w, 65534, &file);
    let r = w.gpusnap(&["guard", "--daemon", &pid.to_string()]);
    assert_ne!(r.code, 0, "{} {}", r.stdout, r.stderr);
    assert!(r.stderr.contains("not a light guard's socket"), "{}", r.stderr);
    assert_untouched(&dir, &file);
    // A path dressed as a light guard's socket, elsewhere: the same.
    let dressed = dir.join("light-1.sock");
    let pid2 = sleeping_as(&mut w, 65534, &dressed);
    let r = w.gpusnap(&["guard", "--daemon", &pid2.to_string()]);
    assert_ne!(r.code, 0, "{} {}", r.stdout, r.stderr);
    assert_untouched(&dir, &file);

    // Hibernated and woken: CRIU restores the environment, and the guard
    // the wake starts refuses it too (the wake itself succeeds). (Root's
    // process here: CRIU in a container may lack the right to read another
    // user's limits; the variable is the same.)
    let pid = sleeping_as(&mut w, 0, &file);
    let p = pid.to_string();
    let r = w.json(&["hibernate", &p, "--image", "env"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.reap(pid);
    wait_for(Duration::from_secs(10), || !pid_exists(pid));
    let r = w.json(&["wake", "env", "--wait", "10"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    assert!(r.stderr.contains("not a light guard's socket"), "{}", r.stderr);
    assert_untouched(&dir, &file);
    // The guards' directory of the state dir holds no socket of it.
    let guards = w.state_dir().join("guards");
    let socks: Vec<_> = std::fs::read_dir(&guards)
        .map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(socks.iter().all(|n| !n.to_string_lossy().starts_with("light-")), "{socks:?}");
}

fn mode_of(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().mode() & 0o7777
}

/// STATE/maps, store and agent are checked as images/ is: writable by
/// others, refused (left as they are); a link, refused (its target
/// untouched); readable by others (0755), made owner-only.
#[test]
fn the_state_dirs_parts_are_checked_and_kept_owner_only() {
    let w = World::new(&[8192]);
    assert_eq!(w.json(&["ps"]).code, 0);
    let state = w.state_dir();
    let elsewhere = w.tmp.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    std::fs::set_permissions(&elsewhere, std::fs::Permissions::from_mode(0o755)).unwrap();
    for d in ["maps", "store", "agent", "images", "logs"] {
        let p = state.join(d);
        std::fs::create_dir_all(&p).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o777)).unwrap();
        let r = w.json(&["ps"]);
        assert_eq!(r.code, 1, "{d}: {}", r.stderr);
        assert!(r.stderr.contains("writable by others"), "{d}: {}", r.stderr);
        assert_eq!(mode_of(&p), 0o777, "{d}: refused, left as it was");

        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        let r = w.json(&["ps"]);
        assert_eq!(r.code, 0, "{d}: {}", r.stderr);
        assert_eq!(mode_of(&p), 0o700, "{d}: made owner-only");

        let kept = w.tmp.path().join(format!("{d}.kept"));
        std::fs::rename(&p, &kept).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &p).unwrap();
        let r = w.json(&["ps"]);
        assert_eq!(r.code, 1, "{d}: {}", r.stderr);
        assert!(r.stderr.contains("symbolic link"), "{d}: {}", r.stderr);
        assert_eq!(mode_of(&elsewhere), 0o755);
        assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);
        std::fs::remove_file(&p).unwrap();
        std::fs::rename(&kept, &p).unwrap();
    }
}
