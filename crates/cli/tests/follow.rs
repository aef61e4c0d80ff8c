//! hibernate's pages: received through FIFOs as CRIU sends them (the default,
//! crates/hibernate/src/fifo.rs), or, with `GPUSNAP_DUMP_FIFO=0`, pages files
//! chunked while CRIU writes them (crates/hibernate/src/follow.rs): the real CRIU
//! and the fakes.

mod common;

use common::*;
use std::path::Path;
use std::time::Duration;

/// The entries of the store's chunks directory (named or temporary).
fn chunk_entries(state: &Path) -> impl Iterator<Item = std::fs::DirEntry> {
    let dirs = std::fs::read_dir(state.join("store").join("chunks")).into_iter().flatten().flatten();
    dirs.flat_map(|d| std::fs::read_dir(d.path()).into_iter().flatten().flatten())
}

/// Every file under the store's chunks directory (named or temporary).
fn store_files(state: &Path) -> Vec<String> {
    chunk_entries(state).map(|f| f.file_name().to_string_lossy().into_owned()).collect()
}

fn store_bytes(state: &Path) -> u64 {
    chunk_entries(state).map(|f| f.metadata().map(|m| m.len()).unwrap_or(0)).sum()
}

/// `gpusnap --json ARGS`, which must exit 0.
fn ok(w: &World, args: &[&str]) -> Run {
    let r = w.json(args);
    assert_eq!(r.code, 0, "{}", r.stderr);
    r
}

/// A world whose hibernates write pages files (`GPUSNAP_DUMP_FIFO=0`)
/// rather than FIFOs.
fn world_without_fifos() -> World {
    let mut w = World::new(&[8192]);
    w.env_extra.push(("GPUSNAP_DUMP_FIFO".into(), "0".into()));
    w
}

/// Hibernates `pid` as `x` with a criu that runs `script` (its images
/// directory in `$d`) and fails: exit 1, CRIU's error (`says`) in the
/// message.
fn hibernate_with_failing_criu(w: &World, pid: i32, script: &str, says: &str) {
    let fake = w.tmp.path().join("criu-fails");
    fake_criu(&fake, "--images-dir", script);
    let r = w.json(&["--criu", fake.to_str().unwrap(), "hibernate", &pid.to_string(), "--image", "x"]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(r.stderr.contains(says), "{}", r.stderr);
}

/// What a failed hibernate of `pid` must leave: the process running on as
/// before, no image, not one chunk (named or temporary).
fn assert_undone(w: &World, pid: i32) {
    let state = w.state_dir();
    assert_eq!(w.json(&["state", &pid.to_string()]).json()["state"], "running");
    w.assert_progressing(pid);
    assert_eq!(std::fs::read_dir(state.join("images")).map(|d| d.count()).unwrap_or(0), 0);
    assert_eq!(store_files(&state), Vec::<String>::new());
}

/// Image `name`'s manifest.
fn manifest(state: &Path, name: &str) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(state.join("images").join(name).join("manifest.json")).unwrap())
        .unwrap()
}

/// Hibernates `p` as `image`, its pages through FIFOs.
fn hibernate_through_fifos(w: &World, p: &str, image: &str) {
    let r = ok(w, &["hibernate", p, "--image", image]);
    assert_eq!(r.json()["stages"]["dump_dir"], "fifo");
}

/// `pid`, hibernated as `image`, woken from it and computing again.
fn wake_back(w: &mut World, pid: i32, image: &str) {
    w.reap(pid);
    ok(w, &["wake", image, "--wait", "10"]);
    w.adopt(pid);
    w.assert_progressing(pid);
}

/// The holder writing `out` checks its memory again, more than twice past
/// `good` checks, and intact.
fn assert_checks_intact(out: &Path, good: usize) {
    wait_for(Duration::from_secs(60), || checks(out).0 > good + 2);
    assert_eq!(checks(out).1, 0, "the memory came back intact");
}

/// A python process holding `mib` MiB of random bytes, checking them.
fn holder(w: &mut World, mib: u64) -> (i32, std::path::PathBuf) {
    checking_holder(w, mib, "bytearray(os.urandom(n))")
}

/// Snapshots `p` (holding 300 MiB of random bytes) as images `one` and
/// `two`: more than one 256 MiB segment chunked while CRIU dumps (its pages
/// went where `dump_dir` says, when given), stored once, the second image
/// stored again in chunks the store had, no temporary chunk left.
fn two_snapshots_share_their_chunks(w: &World, p: &str, dump_dir: Option<&str>) {
    let state = w.state_dir();
    let r = ok(w, &["snapshot", p, "--image", "one"]);
    let s = &r.json()["stages"];
    if let Some(d) = dump_dir {
        assert_eq!(s["dump_dir"], d, "{s}");
    }
    let chunked = s["follow_overlapped_bytes"].as_u64().unwrap() + s["follow_after_bytes"].as_u64().unwrap();
    assert!(chunked > 300 << 20, "{s}");
    // Through FIFOs: where the receiver's threads spent the dump, two
    // segments at least; no stages.fifo otherwise.
    if s["dump_dir"] == "fifo" {
        let f = &s["fifo"];
        assert!(f["segments"].as_u64().unwrap() >= 2 && f["read_ms"].as_u64().unwrap() > 0, "{s}");
        for k in
            ["wait_criu_ms", "wait_room_ms", "move_ms", "wait_buffer_ms", "copy_ms", "hash_ms", "chunk_ms"]
        {
            assert!(f[k].is_u64(), "{k}: {s}");
        }
    } else {
        assert!(s.get("fifo").is_none(), "{s}");
    }
    let once = store_bytes(&state);
    assert!(once > 300 << 20, "{once}");
    // The same memory again: its chunks are in the store already.
    ok(w, &["snapshot", p, "--image", "two"]);
    let twice = store_bytes(&state);
    assert!(twice - once < 32 << 20, "stored again: {once} then {twice}");
    assert!(store_files(&state).iter().all(|f| !f.contains(".tmp-")));
}

#[test]
fn memory_larger_than_a_segment_is_followed_deduplicated_and_wakes_intact() {
    criu_present();
    let mut w = world_without_fifos();
    w.run_limit = Duration::from_secs(300);
    // More than one 256 MiB segment: some of it is chunked while CRIU dumps.
    let (pid, out) = holder(&mut w, 300);
    let p = pid.to_string();
    let state = w.state_dir();
    two_snapshots_share_their_chunks(&w, &p, None);
    // Both images are whole; the pages files are gone from them.
    for name in ["one", "two"] {
        ok(&w, &["images", "verify", name]);
        let pages = std::fs::read_dir(state.join("images").join(name).join("criu"))
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("pages-"))
            .count();
        assert_eq!(pages, 0, "{name}");
    }

    ok(&w, &["hibernate", &p, "--image", "three"]);
    wake_intact(&mut w, pid, "three", &out);
}

#[test]
fn a_criu_failure_mid_dump_with_the_follower_running_leaves_nothing() {
    criu_present();
    let mut w = world_without_fifos();
    w.run_limit = Duration::from_secs(300);
    let pid = w.workload(256, 0, &[]);
    let state = w.state_dir();
    let seen = w.tmp.path().join("seen");
    // A criu that writes more than a segment of pages, waits until the
    // follower has staged chunks of it, and fails.
    hibernate_with_failing_criu(
        &w,
        pid,
        &format!(
            "head -c 300M /dev/urandom > \"$d/pages-1.img\"\n\
             i=0; while [ $i -lt 1200 ]; do\n\
               if find '{store}' -name '*.tmp-*' | grep -q .; then echo yes > '{seen}'; break; fi\n\
               sleep 0.1; i=$((i+1)); done\n\
             head -c 1M /dev/urandom >> \"$d/pages-1.img\"\n\
             echo '(00.1) Error (criu/cr-dump.c:1): disk on fire' > \"$d/dump.log\"\nexit 1\n",
            store = state.join("store").display(),
            seen = seen.display()
        ),
        "disk on fire",
    );
    assert!(seen.exists(), "the follower staged chunks while the dump ran");
    // Back as it was, no image, and not one chunk (named or temporary).
    assert_undone(&w, pid);
    assert_eq!(w.calls_on(pid), ["lock=0", "checkpoint=0", "restore=0", "unlock=0"]);
}

/// A hibernate of `pid` whose chunking fails (the test hook `hook`) was
/// undone: exit 1 naming the hook, the process running on as before, no
/// image, not one chunk (named or temporary), no FIFO left.
fn hibernate_fails_and_is_undone(w: &mut World, pid: i32, hook: &str) {
    let p = pid.to_string();
    let state = w.state_dir();
    w.env_extra.push((hook.into(), "0".into()));
    let r = w.json(&["hibernate", &p, "--image", "x"]);
    w.env_extra.retain(|(k, _)| k != hook);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(r.stderr.contains("test hook"), "{}", r.stderr);
    assert_undone(w, pid);
    assert_eq!(fifos_under(&state), Vec::<String>::new());
    assert_eq!(w.calls_on(pid), ["lock=0", "checkpoint=0", "restore=0", "unlock=0"]);
}

#[test]
fn a_follower_that_fails_after_the_dump_undoes_the_hibernate() {
    criu_present();
    let mut w = world_without_fifos();
    let pid = w.workload(512, 0, &[]);
    let p = pid.to_string();
    hibernate_fails_and_is_undone(&mut w, pid, "GPUSNAP_TEST_FOLLOW_FAIL_AFTER");
    // Following off: the same hibernate, chunked after the dump as before.
    w.env_extra.push(("GPUSNAP_FOLLOW".into(), "0".into()));
    let r = ok(&w, &["hibernate", &p, "--image", "x"]);
    assert_eq!(r.json()["stages"]["follow_after_bytes"], 0);
    w.env_extra.retain(|(k, _)| k == "GPUSNAP_DUMP_FIFO");
    wake_back(&mut w, pid, "x");
}

/// A tmpfs base of this test's own under /dev/shm (removed at the end).
struct ShmBase(std::path::PathBuf);

impl ShmBase {
    fn new(tag: &str) -> Self {
        let p = Path::new("/dev/shm").join(format!("gpusnap-test-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }

    fn entries(&self) -> Vec<String> {
        std::fs::read_dir(&self.0)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()
    }
}

impl Drop for ShmBase {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn a_dump_on_tmpfs_is_punched_as_chunked_wakes_intact_and_leaves_no_directory() {
    criu_present();
    let mut w = world_without_fifos();
    w.run_limit = Duration::from_secs(300);
    let base = ShmBase::new("ok");
    // A directory left by a gpusnap that is gone (a pid above pid_max),
    // and one of a live gpusnap (this test's own pid and start time).
    let dead = base.0.join(format!("gpusnap-{}-1-0123", i32::MAX));
    std::fs::create_dir_all(dead.join("criu")).unwrap();
    let me = std::fs::read_to_string("/proc/self/stat").unwrap();
    let start = me.rsplit(')').next().unwrap().split_whitespace().nth(19).unwrap().to_string();
    let live = format!("gpusnap-{}-{start}-4567", std::process::id());
    std::fs::create_dir_all(base.0.join(&live)).unwrap();
    w.env_extra.push(("GPUSNAP_DUMP_TMPFS".into(), "1".into()));
    w.env_extra.push(("GPUSNAP_DUMP_TMPFS_DIR".into(), base.0.display().to_string()));
    w.env_extra.push(("GPUSNAP_FOLLOW_PUNCH".into(), "1".into()));
    let (pid, out) = holder(&mut w, 300);
    let p = pid.to_string();
    let state = w.state_dir();
    let r = ok(&w, &["hibernate", &p, "--image", "t"]);
    let s = &r.json()["stages"];
    assert_eq!(s["dump_dir"], "tmpfs", "{s}");
    assert!(s["follow_punched_bytes"].as_u64().unwrap() >= 256 << 20, "{s}");
    assert_eq!(base.entries(), vec![live.clone()], "the dead one removed, the live one kept, ours gone");
    // CRIU's small files are in the image, its pages files are not.
    let names: Vec<String> = std::fs::read_dir(state.join("images").join("t").join("criu"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().any(|n| n.starts_with("core-")), "{names:?}");
    assert!(!names.iter().any(|n| n.starts_with("pages-")), "{names:?}");
    ok(&w, &["images", "verify", "t"]);
    wake_intact(&mut w, pid, "t", &out);
    // Forced off: the disk, as before.
    w.env_extra.retain(|(k, _)| k != "GPUSNAP_DUMP_TMPFS");
    w.env_extra.push(("GPUSNAP_DUMP_TMPFS".into(), "0".into()));
    let r = ok(&w, &["snapshot", &p, "--image", "d"]);
    assert_eq!(r.json()["stages"]["dump_dir"], "disk");
    // The tmpfs without punching (the default): the same, nothing punched.
    w.env_extra.retain(|(k, _)| k != "GPUSNAP_DUMP_TMPFS" && k != "GPUSNAP_FOLLOW_PUNCH");
    w.env_extra.push(("GPUSNAP_DUMP_TMPFS".into(), "1".into()));
    let r = ok(&w, &["snapshot", &p, "--image", "n"]);
    assert_eq!(r.json()["stages"]["dump_dir"], "tmpfs");
    assert_eq!(r.json()["stages"]["follow_punched_bytes"], 0);
    ok(&w, &["images", "verify", "n"]);
    assert_eq!(base.entries(), vec![live]);
}

#[test]
fn a_criu_failure_on_tmpfs_leaves_no_directory() {
    criu_present();
    let mut w = world_without_fifos();
    let base = ShmBase::new("fail");
    w.env_extra.push(("GPUSNAP_DUMP_TMPFS".into(), "1".into()));
    w.env_extra.push(("GPUSNAP_DUMP_TMPFS_DIR".into(), base.0.display().to_string()));
    let pid = w.workload(256, 0, &[]);
    let seen = w.tmp.path().join("seen");
    hibernate_with_failing_criu(
        &w,
        pid,
        &"echo \"$d\" > {seen}\n\
          head -c 3M /dev/urandom > \"$d/pages-1.img\"\n\
          echo '(00.1) Error (criu/cr-dump.c:1): tmpfs on fire' > \"$d/dump.log\"\nexit 1\n"
            .replace("{seen}", &seen.display().to_string()),
        "tmpfs on fire",
    );
    let used = std::fs::read_to_string(&seen).unwrap();
    assert!(used.starts_with(&format!("{}/gpusnap-", base.0.display())), "{used}");
    assert_eq!(base.entries(), Vec::<String>::new());
    assert_undone(&w, pid);
}

/// Every file under the image directories (FIFOs left behind included).
fn fifos_under(p: &Path) -> Vec<String> {
    use std::os::unix::fs::FileTypeExt;
    let mut out = Vec::new();
    for e in std::fs::read_dir(p).into_iter().flatten().flatten() {
        let t = e.file_type().unwrap();
        if t.is_dir() {
            out.extend(fifos_under(&e.path()));
        } else if t.is_fifo() {
            out.push(e.path().display().to_string());
        }
    }
    out
}

#[test]
fn pages_through_fifos_are_deduplicated_leave_no_pages_file_and_wake_intact() {
    criu_present();
    let mut w = World::new(&[8192]);
    w.run_limit = Duration::from_secs(300);
    let (pid, out) = holder(&mut w, 300);
    let p = pid.to_string();
    let state = w.state_dir();
    two_snapshots_share_their_chunks(&w, &p, Some("fifo"));
    assert_eq!(fifos_under(&state), Vec::<String>::new());
    for name in ["one", "two"] {
        ok(&w, &["images", "verify", name]);
        let m = manifest(&state, name);
        let pages: Vec<_> = m["files"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|f| f["path"].as_str().unwrap().contains("pages-"))
            .collect();
        assert!(pages.iter().any(|f| f["size"].as_u64().unwrap() > 300 << 20), "{name}: {pages:?}");
        assert!(pages.iter().all(|f| !f["chunks"].as_array().unwrap().is_empty() || f["size"] == 0));
    }
    hibernate_through_fifos(&w, &p, "three");
    wake_intact(&mut w, pid, "three", &out);
}

#[test]
fn a_tree_with_shared_memory_goes_through_fifos_and_wakes_intact() {
    criu_present();
    let mut w = World::new(&[8192]);
    w.run_limit = Duration::from_secs(300);
    let out = w.tmp.path().join("tree");
    // Shared anonymous memory (its own pages file, first) and a child.
    let script = r#"
import hashlib, mmap, os, sys, time
shared = mmap.mmap(-1, 8 << 20)
shared.write(os.urandom(8 << 20))
mine = bytearray(os.urandom(40 << 20))
pid = os.fork()
if pid == 0:
    mine = bytearray(os.urandom(24 << 20))
want = (hashlib.sha256(shared).digest(), hashlib.sha256(mine).digest())
i = 0
while True:
    i += 1
    ok = (hashlib.sha256(shared).digest(), hashlib.sha256(mine).digest()) == want
    with open(sys.argv[1], "a") as f: f.write(f"{os.getpid()} {i} {'ok' if ok else 'bad'}\n")
    time.sleep(0.05)
"#;
    let n = w.spawn_env("python3", &["-c", script, out.to_str().unwrap()]);
    let pid = w.child_pid(n);
    wait_for(Duration::from_secs(30), || {
        let s = std::fs::read_to_string(&out).unwrap_or_default();
        let pids: std::collections::HashSet<&str> = s.lines().filter_map(|l| l.split(' ').next()).collect();
        pids.len() == 2
    });
    let p = pid.to_string();
    hibernate_through_fifos(&w, &p, "tree");
    let state = w.state_dir();
    let m = manifest(&state, "tree");
    let pages =
        m["files"].as_array().unwrap().iter().filter(|f| f["path"].as_str().unwrap().contains("pages-"));
    assert!(pages.count() >= 3, "shared memory, parent and child: {m}");
    assert_eq!(fifos_under(&state), Vec::<String>::new());
    wake_intact(&mut w, pid, "tree", &out);
    let s = std::fs::read_to_string(&out).unwrap();
    let after: std::collections::HashSet<&str> =
        s.lines().rev().take(40).filter_map(|l| l.split(' ').next()).collect();
    assert_eq!(after.len(), 2, "parent and child both check after the wake");
}

#[test]
fn memfd_and_written_file_mappings_go_through_fifos_and_wake_intact() {
    criu_present();
    let mut w = World::new(&[8192]);
    w.run_limit = Duration::from_secs(300);
    let out = w.tmp.path().join("kinds");
    let file = w.tmp.path().join("backing");
    std::fs::write(&file, vec![7u8; 4 << 20]).unwrap();
    // A memfd mapped shared, a file mapped private and written (its written
    // pages are anonymous now), anonymous private memory: each kind of
    // memory CRIU dumps into a pages file of its own or the process's.
    // (SysV shared memory needs an IPC namespace of its own for CRIU.)
    let script = r#"
import hashlib, mmap, os, sys, time
mfd = os.memfd_create("kinds")
os.ftruncate(mfd, 6 << 20)
shared = mmap.mmap(mfd, 6 << 20, mmap.MAP_SHARED)
shared.write(os.urandom(6 << 20))
f = open(sys.argv[2], "r+b")
priv = mmap.mmap(f.fileno(), 4 << 20, mmap.MAP_PRIVATE)
priv[1 << 20:(1 << 20) + (1 << 20)] = os.urandom(1 << 20)
mine = bytearray(os.urandom(24 << 20))
def sums():
    return [hashlib.sha256(x).digest() for x in (shared, priv, mine)]
want = sums()
i = 0
while True:
    i += 1
    ok = sums() == want
    with open(sys.argv[1], "a") as o: o.write(f"{i} {'ok' if ok else 'bad'}\n")
    time.sleep(0.05)
"#;
    let n = w.spawn_env("python3", &["-c", script, out.to_str().unwrap(), file.to_str().unwrap()]);
    let pid = w.child_pid(n);
    wait_for(Duration::from_secs(30), || std::fs::read_to_string(&out).is_ok_and(|s| s.contains(" ok")));
    let p = pid.to_string();
    hibernate_through_fifos(&w, &p, "kinds");
    assert_eq!(fifos_under(&w.state_dir()), Vec::<String>::new());
    wake_intact(&mut w, pid, "kinds", &out);
}

#[test]
fn a_fifo_receiver_that_fails_undoes_the_hibernate() {
    criu_present();
    let mut w = World::new(&[8192]);
    let pid = w.workload(512, 0, &[]);
    let p = pid.to_string();
    hibernate_fails_and_is_undone(&mut w, pid, "GPUSNAP_TEST_FIFO_FAIL_AFTER");
    ok(&w, &["hibernate", &p, "--image", "x"]);
    wake_back(&mut w, pid, "x");
}

#[test]
fn a_gpusnap_killed_mid_dump_leaves_criu_unblocked_and_the_tree_running() {
    criu_present();
    let mut w = World::new(&[8192]);
    w.run_limit = Duration::from_secs(300);
    let (pid, out) = holder(&mut w, 1200);
    let p = pid.to_string();
    let state = w.state_dir();
    let mut g = w.gpusnap_cmd(&["--json", "hibernate", &p, "--image", "k"]).spawn().unwrap();
    // Mid-dump: the receiver has staged chunks of the first segment.
    wait_for(Duration::from_secs(120), || store_files(&state).iter().any(|f| f.contains(".tmp-")));
    g.kill().unwrap();
    g.wait().unwrap();
    // The keeper reads what CRIU still sends; CRIU ends, the FIFOs go.
    wait_for(Duration::from_secs(120), || fifos_under(&state).is_empty());
    let log = std::fs::read_to_string(state.join("dump-keeper.log")).unwrap_or_default();
    assert!(log.contains("the hibernate died during its dump"), "{log}");
    wait_for(Duration::from_secs(60), || {
        std::fs::read_to_string(state.join("dump-keeper.log")).unwrap_or_default().contains("CRIU is gone")
    });
    // CRIU finished its dump into the keeper: the tree is stopped, without
    // an image. The next gpusnap that reconciles continues it.
    let r = ok(&w, &["images", "gc"]);
    assert!(r.stderr.contains("reconciling a hibernate interrupted"), "{}", r.stderr);
    let good = checks(&out).0;
    assert_checks_intact(&out, good);
    assert!(w.json(&["images", "verify", "k"]).code != 0, "no image k");
}

#[test]
fn raw_chunks_copied_in_place_from_their_kept_mappings_wake_intact() {
    criu_present();
    let mut w = World::new(&[8192]);
    w.run_limit = Duration::from_secs(300);
    // Random bytes: every chunk is stored raw, so with the setting the
    // page server copies each one from its file's mapping (kept for the
    // whole wake), never through its buffer.
    let (pid, out) = holder(&mut w, 96);
    ok(&w, &["hibernate", &pid.to_string(), "--image", "raw"]);
    w.reap(pid);
    wait_for(Duration::from_secs(10), || !pid_exists(pid));
    let good = checks(&out).0;
    w.env_extra.push(("GPUSNAP_PAGES_MAP_RAW".into(), "1".into()));
    let r = ok(&w, &["wake", "raw", "--wait", "30", "--no-guard"]);
    w.adopt(pid);
    let v = r.json();
    assert_eq!(v["lazy"], true, "{v}");
    assert!(v["pages"]["in_place_bytes"].as_u64().unwrap() > 64 << 20, "{v}");
    assert_checks_intact(&out, good);
}

#[test]
fn the_dump_keeper_is_hidden_and_harmless_by_hand() {
    let w = World::new(&[8192]);
    let r = w.gpusnap(&["--help"]);
    assert!(!r.stdout.contains("__dump-keeper"), "{}", r.stdout);
    let r = w.gpusnap(&["__dump-keeper"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert_eq!(r.stderr.trim().lines().count(), 1, "{}", r.stderr);
    assert!(r.stderr.contains("usage: __dump-keeper CRIU_DIR COUNT"), "{}", r.stderr);
    // With no hibernate behind it (its stdin ends at once, no FIFO, no
    // CRIU): it says so and exits, touching nothing.
    let dir = w.tmp.path().join("nothing-here");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("pages-1.img"), b"a file, not a FIFO").unwrap();
    let r = w.gpusnap(&["__dump-keeper", dir.to_str().unwrap(), "3"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stderr.contains("CRIU is gone"), "{}", r.stderr);
    assert_eq!(std::fs::read(dir.join("pages-1.img")).unwrap(), b"a file, not a FIFO");
}

/// `--big-pipes`: fs.pipe-max-size (here a file named through the
/// environment) raised for the dump where gpusnap lacks CAP_SYS_RESOURCE
/// and put back after it; the dump's pipes as stages.fifo says; the image
/// wakes intact; a switch left by a gpusnap that died is put back by the
/// next command.
#[test]
fn big_pipes_are_switched_for_the_dump_only_and_the_image_wakes_intact() {
    criu_present();
    let mut w = World::new(&[8192]);
    w.run_limit = Duration::from_secs(300);
    let (pid, out) = holder(&mut w, 300);
    let p = pid.to_string();
    let sysctl = w.state_dir().with_file_name("pipe-max-size");
    std::fs::write(&sysctl, "1048576\n").unwrap();
    let mut c = w.gpusnap_cmd(&["--json", "hibernate", &p, "--image", "bp", "--big-pipes"]);
    c.env("GPUSNAP_PIPE_MAX_SYSCTL", &sysctl).env("GPUSNAP_LOG", "gpusnap_core::hostknob=debug,warn");
    let r = c.output().unwrap();
    let stderr = String::from_utf8_lossy(&r.stderr);
    assert!(r.status.success(), "{stderr}");
    let j: serde_json::Value = serde_json::from_slice(&r.stdout).unwrap();
    let s = &j["stages"];
    assert_eq!(s["dump_dir"], "fifo", "{s}");
    assert!(s["fifo"]["pipe_bytes"].as_u64().unwrap() >= 64 << 10, "{s}");
    assert!(s["fifo"]["piece_bytes"].as_u64().unwrap() >= 64 << 10, "{s}");
    // Switched to 64 MiB and back, unless the capability made it needless.
    let switched = stderr.lines().filter(|l| l.contains("fs.pipe-max-size switched")).count();
    // With CAP_SYS_RESOURCE there is nothing to switch (the test and the
    // gpusnap it starts hold the same capabilities).
    if gpusnap_core::hostknob::can_exceed_pipe_max() {
        assert_eq!(switched, 0, "{stderr}");
    } else {
        assert_eq!(switched, 2, "{stderr}");
        assert!(stderr.contains("67108864"), "{stderr}");
    }
    assert_eq!(std::fs::read_to_string(&sysctl).unwrap().trim(), "1048576");
    assert!(!w.state_dir().join("pipe-max-size.json").exists());
    wake_intact(&mut w, pid, "bp", &out);

    // A gpusnap that died with the sysctl raised: the next command puts it back.
    std::fs::write(&sysctl, "67108864\n").unwrap();
    let dead = w.spawn_env("true", &[]);
    let dead_pid = w.child_pid(dead);
    w.wait_child(dead);
    std::fs::write(
        w.state_dir().join("pipe-max-size.json"),
        serde_json::json!({ "previous": "1048576", "owners": [[dead_pid, 1]] }).to_string(),
    )
    .unwrap();
    let mut c = w.gpusnap_cmd(&["--json", "ps"]);
    c.env("GPUSNAP_PIPE_MAX_SYSCTL", &sysctl);
    assert!(c.output().unwrap().status.success());
    assert_eq!(std::fs::read_to_string(&sysctl).unwrap().trim(), "1048576");
    assert!(!w.state_dir().join("pipe-max-size.json").exists());
}
