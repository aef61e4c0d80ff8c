//! Images and the state directory as untrusted input: what an
//! image may hold, signatures, links, sizes, the state dir's permissions,
//! interrupted hibernates and store errors after CRIU acted.

mod common;

use common::*;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// A directory that looks like an image to a careless reader (a manifest
/// with the magic), unsigned.
fn fake_image(dir: &Path) {
    std::fs::create_dir_all(dir.join("criu")).unwrap();
    std::fs::write(
        dir.join("manifest.json"),
        r#"{"magic":"gpusnap-image","format":2,"gpusnap_version":"x","name":"x","host":"h","created_ms":1,
            "driver_api":null,"driver_version":null,"gpus":[],"root_pid":1,"processes":[],"criu_version":"4.2","files":[]}"#,
    )
    .unwrap();
}

#[test]
fn images_rm_removes_images_and_nothing_else() {
    let w = World::new(&[8192]);
    let images = w.state_dir().join("images");
    let kept = images.join("kept");
    fake_image(&kept);
    let victim = w.tmp.path().join("x/victim");
    std::fs::create_dir_all(&victim).unwrap();
    std::fs::write(victim.join("data"), b"precious").unwrap();
    for (args, what) in [
        (vec!["images", "rm", ""], "an empty name"),
        (vec!["images", "rm", "."], "a dot"),
        (vec!["images", "rm", "/"], "the root"),
        (vec!["images", "rm", victim.to_str().unwrap()], "a directory with no manifest"),
        (vec!["images", "rm", "../images"], "a path out of the store"),
    ] {
        let r = w.json(&args);
        assert_eq!(r.code, 2, "{what}: {}", r.stderr);
        assert!(!r.stderr.contains("removed"), "{what}: {}", r.stderr);
    }
    // Relative to the working directory: refused unless it is an image.
    let mut cmd = w.gpusnap_cmd(&["images", "rm", "somedir/"]);
    std::fs::create_dir_all(w.tmp.path().join("somedir")).unwrap();
    let out = cmd.current_dir(w.tmp.path()).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(w.tmp.path().join("somedir").is_dir());
    assert!(victim.join("data").is_file(), "nothing outside the store was touched");
    assert!(kept.is_dir(), "the store is intact");
    // A link in the store is not followed.
    std::os::unix::fs::symlink(&victim, images.join("link")).unwrap();
    assert_eq!(w.json(&["images", "rm", "link"]).code, 2);
    assert!(victim.join("data").is_file());
    // An image of the store, and a directory holding a gpusnap manifest, go.
    assert_eq!(w.json(&["images", "rm", "kept"]).code, 0);
    assert!(!kept.exists());
    let elsewhere = w.tmp.path().join("old-image");
    fake_image(&elsewhere);
    let r = w.json(&["images", "rm", elsewhere.to_str().unwrap()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(!elsewhere.exists());
}

/// Copies an image directory (as `cp -a`).
fn copy_image(from: &Path, to: &Path) {
    let st = Command::new("cp").arg("-a").arg(from).arg(to).status().unwrap();
    assert!(st.success());
}

fn page_file(dir: &Path) -> PathBuf {
    std::fs::read_dir(dir.join("criu"))
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        // The pages files are chunks in the store: a file CRIU reads whole.
        .find(|p| p.file_name().unwrap().to_str().unwrap().starts_with("core-"))
        .unwrap()
}

#[test]
fn tampered_linked_unlisted_oversized_and_unsigned_images_are_refused() {
    criu_present();
    let mut w = World::new(&[8192]);
    let (pid, _) = w.cpu_tree();
    let r = w.json(&["hibernate", &pid.to_string(), "--image", "good"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.reap(pid);
    let images = w.state_dir().join("images");
    let good = images.join("good");
    assert!(good.join("manifest.sig").is_file() && !good.join("manifest.b3").exists());
    assert_eq!(w.json(&["images", "verify", "good"]).code, 0);
    let outside = w.tmp.path().join("outside");
    std::fs::create_dir_all(&outside).unwrap();

    let variant = |name: &str, damage: &dyn Fn(&Path)| -> Run {
        let dir = images.join(name);
        copy_image(&good, &dir);
        damage(&dir);
        w.json(&["wake", name])
    };
    let refused = |r: &Run, what: &str, why: &str| {
        assert_eq!(r.code, 2, "{what}: {}", r.stderr);
        assert!(r.stderr.contains(why), "{what}: {}", r.stderr);
        assert!(!pid_exists(pid), "{what}: nothing was restored");
    };
    // An edited manifest (an empty file list verified as "ok, 0 files").
    let r = variant("edited", &|d| {
        let m = std::fs::read_to_string(d.join("manifest.json")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&m).unwrap();
        let mut v = v.clone();
        v["files"] = serde_json::json!([]);
        let body = serde_json::to_vec_pretty(&v).unwrap();
        // What passed before images were signed: the checksum recomputed.
        std::fs::write(d.join("manifest.b3"), blake3::hash(&body).to_hex().as_bytes()).unwrap();
        std::fs::write(d.join("manifest.json"), body).unwrap();
    });
    refused(&r, "edited", "signature does not match");
    // Unsigned.
    let r = variant("unsigned", &|d| std::fs::remove_file(d.join("manifest.sig")).unwrap());
    refused(&r, "unsigned", "not signed");
    // A file CRIU would read that the manifest does not list.
    let r = variant("unlisted", &|d| std::fs::write(d.join("criu/core-99999.img"), b"evil").unwrap());
    refused(&r, "unlisted", "not listed");
    // A listed file replaced by a link to a copy elsewhere (same bytes).
    let r = variant("linked", &|d| {
        let p = page_file(d);
        let copy = outside.join("pages-copy.img");
        std::fs::copy(&p, &copy).unwrap();
        std::fs::remove_file(&p).unwrap();
        std::os::unix::fs::symlink(&copy, &p).unwrap();
    });
    refused(&r, "linked", "symbolic link");
    // A hard link to a file outside the image.
    let r = variant("hardlinked", &|d| {
        let p = page_file(d);
        std::fs::hard_link(&p, outside.join("hard")).unwrap();
    });
    refused(&r, "hardlinked", "hard link");
    // The directory CRIU writes its logs to, linked outside (wake wrote
    // restore.log and restore.pid there, and chmodded what it pointed to).
    std::fs::set_permissions(&outside, std::fs::Permissions::from_mode(0o755)).unwrap();
    let r = variant("logs", &|d| std::os::unix::fs::symlink(&outside, d.join("logs")).unwrap());
    refused(&r, "logs", "symbolic link");
    // CRIU's directory itself moved out and linked (it verified and woke).
    let r = variant("criudir", &|d| {
        let away = outside.join("criu-away");
        std::fs::rename(d.join("criu"), &away).unwrap();
        std::os::unix::fs::symlink(&away, d.join("criu")).unwrap();
    });
    refused(&r, "criudir", "symbolic link");
    assert!(!outside.join("restore.log").exists() && !outside.join("restore.pid").exists());
    assert!(!outside.join("criu-away/restore.log").exists());
    assert_eq!(std::fs::metadata(&outside).unwrap().permissions().mode() & 0o777, 0o755);
    // A FIFO, and a link to /dev/zero with size 0: refused at once, no hang, no OOM.
    let r = variant("fifo", &|d| {
        let p = page_file(d);
        std::fs::remove_file(&p).unwrap();
        nix::unistd::mkfifo(&p, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    });
    refused(&r, "fifo", "not a regular file");
    let r = variant("zero", &|d| {
        let p = page_file(d);
        std::fs::remove_file(&p).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &p).unwrap();
    });
    refused(&r, "zero", "symbolic link");
    let r = w.json(&["images", "verify", "zero"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    // A manifest that is /dev/zero breaks neither `images list` nor the
    // other images.
    let bad = images.join("bad");
    std::fs::create_dir_all(&bad).unwrap();
    std::os::unix::fs::symlink("/dev/zero", bad.join("manifest.json")).unwrap();
    let big = images.join("big");
    std::fs::create_dir_all(&big).unwrap();
    std::fs::File::create(big.join("manifest.json")).unwrap().set_len(1 << 30).unwrap();
    let r = w.json(&["images"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let list = r.json()["images"].as_array().unwrap().clone();
    let entry = |n: &str| list.iter().find(|i| i["name"] == n).cloned().unwrap();
    assert!(entry("good")["error"].is_null(), "{list:?}");
    assert!(entry("bad")["error"].as_str().unwrap().contains("symbolic link"), "{list:?}");
    assert!(entry("big")["error"].as_str().unwrap().contains("too large"), "{list:?}");
    // A copy under another name is listed by its directory's name.
    copy_image(&good, &images.join("renamed"));
    let r = w.json(&["images"]);
    assert!(r.json()["images"]
        .as_array()
        .unwrap()
        .iter()
        .any(|i| i["name"] == "renamed" && i["error"].is_null()));

    // Another host's image: refused unless its key is trusted.
    let other = World::new(&[8192]);
    let theirs = other.state_dir().join("images");
    std::fs::create_dir_all(&theirs).unwrap();
    std::fs::set_permissions(other.state_dir(), std::fs::Permissions::from_mode(0o700)).unwrap();
    copy_image(&good, &theirs.join("good"));
    // The image's pages are chunks in the store: that host has them too
    // (as after a pull).
    copy_image(&w.state_dir().join("store"), &other.state_dir().join("store"));
    let r = other.json(&["images", "verify", "good"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("not this host's"), "{}", r.stderr);
    let key = w.json(&["images", "key"]).json()["key"].as_str().unwrap().to_string();
    let r = other.json(&["--trust", &key, "images", "verify", "good"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let keyfile = other.tmp.path().join("peer.pub");
    std::fs::write(&keyfile, format!("{key}\n")).unwrap();
    assert_eq!(other.json(&["--trust", keyfile.to_str().unwrap(), "images", "verify", "good"]).code, 0);
    assert_eq!(other.json(&["--trust", "nonsense", "images", "verify", "good"]).code, 2);

    // The good image wakes; CRIU's restore log is in the state dir, not the image.
    let r = w.json(&["wake", "good", "--wait", "10"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    let logs: Vec<_> =
        std::fs::read_dir(w.state_dir().join("logs")).unwrap().filter_map(|e| e.ok()).collect();
    assert!(logs.iter().any(|e| e.path().join("restore.log").is_file()), "{logs:?}");
    assert!(!good.join("logs").exists());
    assert_eq!(w.json(&["images", "verify", "good"]).code, 0, "waking changed nothing in the image");
}

#[test]
fn an_image_given_by_path_is_copied_into_the_store_before_criu_reads_it() {
    criu_present();
    let mut w = World::new(&[8192]);
    let (pid, out) = w.cpu_tree();
    assert_eq!(w.json(&["hibernate", &pid.to_string(), "--image", "src"]).code, 0);
    w.reap(pid);
    let away = w.tmp.path().join("carried");
    std::fs::create_dir_all(&away).unwrap();
    std::fs::rename(w.state_dir().join("images/src"), away.join("moved")).unwrap();
    let path = away.join("moved");
    let r = w.json(&["wake", path.to_str().unwrap(), "--wait", "10"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    assert_eq!(r.json()["image"], "moved");
    assert!(w.state_dir().join("images/moved/manifest.sig").is_file(), "imported into the store");
    let at = count(&out);
    wait_for(Duration::from_secs(10), || count(&out) > at + 2);
}

#[test]
fn recover_acts_only_on_signed_images_of_the_store() {
    let mut w = World::new(&[8192]);
    let stuck = w.workload(512, 0, &[]);
    let bystander = w.workload(512, 0, &[]);
    let start = |p: i32| -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap();
        let after = &s[s.rfind(')').unwrap() + 2..];
        after.split_whitespace().nth(19).unwrap().parse().unwrap()
    };
    let dir = w.state_dir().join("images/planted");
    std::fs::create_dir_all(dir.join("criu")).unwrap();
    let m = serde_json::json!({
        "magic": "gpusnap-image", "format": 2, "gpusnap_version": "x", "name": "/tmp/elsewhere",
        "host": "h", "created_ms": 1, "driver_api": null, "driver_version": null, "gpus": [],
        "root_pid": stuck, "criu_version": "4.2", "files": [],
        "processes": [
            { "pid": stuck, "ppid": 1, "start_time": start(stuck), "comm": "w", "cuda": true, "was_running": true, "footprint": {} },
            { "pid": bystander, "ppid": 1, "start_time": start(bystander), "comm": "w", "cuda": true, "was_running": true, "footprint": {} }
        ]
    });
    let body = serde_json::to_vec(&m).unwrap();
    // What passed before images were signed: the checksum anyone can compute.
    std::fs::write(dir.join("manifest.b3"), blake3::hash(&body).to_hex().as_bytes()).unwrap();
    std::fs::write(dir.join("manifest.json"), body).unwrap();
    let r = w.json(&["recover", "--force", &stuck.to_string()]);
    assert_eq!(r.code, 5, "{}", r.stderr);
    assert!(r.stderr.contains("no image"), "{}", r.stderr);
    assert!(w.alive(stuck) && w.alive(bystander), "nobody was killed");
    w.assert_progressing(bystander);
}

#[test]
fn the_state_dir_must_be_private_and_hold_no_links() {
    let w = World::new(&[8192]);
    let state = w.state_dir();
    std::fs::create_dir_all(&state).unwrap();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o1777)).unwrap();
    for args in [&["history", "1"][..], &["images"][..], &["ps"][..]] {
        let r = w.json(args);
        assert_eq!(r.code, 1, "{args:?}: {}", r.stderr);
        assert!(r.stderr.contains("writable by others") && r.stderr.contains("chmod 700"), "{}", r.stderr);
    }
    assert!(!state.join("gpusnap.db").exists());
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700)).unwrap();
    assert_eq!(w.json(&["ps"]).code, 0);
    let mode = std::fs::metadata(state.join("gpusnap.db")).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the database is private");
    // A planted link is refused, and what it points to is left alone.
    let elsewhere = w.tmp.path().join("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();
    std::fs::set_permissions(&elsewhere, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::symlink(&elsewhere, state.join("images")).unwrap();
    for args in [&["images"][..], &["ps"][..], &["history", "1"][..]] {
        let r = w.json(args);
        assert_eq!(r.code, 1, "{args:?}: {}", r.stderr);
        assert!(r.stderr.contains("symbolic link"), "{args:?}: {}", r.stderr);
    }
    assert_eq!(std::fs::metadata(&elsewhere).unwrap().permissions().mode() & 0o777, 0o755);
    assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);
}

#[test]
fn read_only_commands_do_not_wait_behind_a_writer() {
    let mut w = World::new(&[8192]);
    let pid = w.workload(512, 0, &[]);
    let p = pid.to_string();
    assert_eq!(w.json(&["suspend", &p]).code, 0);
    let db = rusqlite::Connection::open(w.state_dir().join("gpusnap.db")).unwrap();
    db.execute_batch("BEGIN IMMEDIATE; INSERT INTO events (ts_ms, pid, start_time, op, phase, actor) VALUES (0, 0, 0, 'x', 'note', 0);")
        .unwrap();
    let t = std::time::Instant::now();
    for args in [&["history", &p][..], &["state", &p][..], &["ps"][..]] {
        let r = w.json(args);
        assert_eq!(r.code, 0, "{args:?}: {}", r.stderr);
    }
    assert!(t.elapsed() < Duration::from_secs(50), "they waited for the writer");
    db.execute_batch("ROLLBACK").unwrap();
    let r = w.json(&["history", &p]);
    assert!(!r.json()["events"].as_array().unwrap().is_empty(), "{}", r.stdout);
    // On a read-only state directory ("unable to open database file").
    for args in [&["history", &p][..], &["state", &p][..], &["ps"][..]] {
        let mut cmd = Command::new("unshare");
        w.env(&mut cmd);
        let state = w.state_dir();
        cmd.args([
            "-m",
            "sh",
            "-c",
            "mount --bind -o ro \"$0\" \"$0\" && touch \"$0/x\" 2>/dev/null && exit 99; shift; exec \"$@\"",
        ])
        .arg(&state)
        .arg("--")
        .arg(env!("CARGO_BIN_EXE_gpusnap"))
        .arg("--json")
        .args(args)
        .stdin(Stdio::null());
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{args:?} on a read-only state dir: {err}");
    }
    assert_eq!(w.json(&["state", &p]).json()["state"], "checkpointed");
    // A state dir with no database yet reads as empty, and is not created.
    let fresh = World::new(&[8192]);
    let r = fresh.json(&["history", "1"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(!fresh.state_dir().join("gpusnap.db").exists());
}

#[test]
fn sizes_from_untrusted_numbers_saturate_and_names_are_escaped() {
    let mut w = World::new(&[8192]);
    let pid = w.workload(1024, 0, &[]);
    let p = pid.to_string();
    assert_eq!(w.json(&["suspend", &p]).code, 0);
    // A margin of 2^64-1 MiB wrapped to a small one and was admitted.
    let r = w.json(&["resume", &p, "--margin", &u64::MAX.to_string()]);
    assert_eq!(r.code, 3, "{}", r.stderr);
    let r = w.json(&["resume", &p, "--footprint", &u64::MAX.to_string()]);
    assert!(r.code == 3 || r.code == 0, "{}", r.stderr);
    if r.code == 3 {
        assert_eq!(w.json(&["resume", &p]).code, 0);
    }
    // A directory name with a terminal escape is shown escaped.
    let evil = w.state_dir().join("images").join("evil\x1b[2Jname");
    std::fs::create_dir_all(&evil).unwrap();
    let r = w.gpusnap(&["images"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(!r.stdout.contains('\x1b'), "{:?}", r.stdout);
    assert!(r.stdout.contains("evil\\u{1b}[2Jname"), "{:?}", r.stdout);
}

/// A criu that runs the real one and then, after a successful OP, says so
/// in `flag` (with its own pid) and waits until `go` exists.
fn pausing_criu(w: &World, op: &str) -> (PathBuf, PathBuf, PathBuf) {
    let real = String::from_utf8(Command::new("sh").args(["-c", "command -v criu"]).output().unwrap().stdout)
        .unwrap()
        .trim()
        .to_string();
    let flag = w.tmp.path().join(format!("{op}.done"));
    let go = w.tmp.path().join(format!("{op}.go"));
    let script = w.tmp.path().join(format!("criu-pauses-after-{op}"));
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n\"{real}\" \"$@\"\nrc=$?\nif [ \"$1\" = {op} ] && [ $rc = 0 ]; then\n  echo $$ > \"{flag}\"\n  \
             i=0; while [ ! -e \"{go}\" ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done\nfi\nexit $rc\n",
            flag = flag.display(),
            go = go.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    (script, flag, go)
}

/// Starts gpusnap with extra environment; returns the child.
fn spawn_with(w: &World, env: &[(&str, &str)], args: &[&str]) -> std::process::Child {
    let mut cmd = w.gpusnap_cmd(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
}

fn finish(child: std::process::Child) -> (i32, String) {
    let mut child = child;
    let end = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            let out = child.wait_with_output().unwrap();
            return (st.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned());
        }
        assert!(std::time::Instant::now() < end, "gpusnap hung");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn proc_state(pid: i32) -> char {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    s.rfind(')').and_then(|i| s[i + 2..].chars().next()).unwrap_or('?')
}

/// The process's state once it is `want`, or after 10 s whatever it is.
/// CRIU leaves a tree with a SIGSTOP pending and detaches: a process shows
/// 'R' until it runs to take it, which on a busy machine is a while (seen
/// in CI).
fn settled_state(pid: i32, want: char) -> char {
    wait_until(Duration::from_secs(10), || proc_state(pid) == want);
    proc_state(pid)
}

#[test]
fn a_hibernate_killed_after_the_dump_is_reconciled_by_the_next_run() {
    criu_present();
    let mut w = World::new(&[8192]);
    let pid = w.workload(1024, 0, &[]);
    let p = pid.to_string();
    let (criu, flag, _go) = pausing_criu(&w, "dump");
    let child = spawn_with(&w, &[], &["--criu", criu.to_str().unwrap(), "hibernate", &p, "--image", "cut"]);
    wait_for(Duration::from_secs(60), || flag.exists());
    // Killed after CRIU's dump: the tree is stopped, suspended, and the
    // temporary image stays.
    let gs = child.id() as i32;
    let mut child = child;
    child.kill().unwrap();
    child.wait().unwrap();
    if let Ok(s) = std::fs::read_to_string(&flag) {
        if let Ok(wrapper) = s.trim().parse::<i32>() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(wrapper),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
    assert_eq!(settled_state(pid, 'T'), 'T', "CRIU left it stopped");
    let tmp = w.state_dir().join(format!("images/.cut.tmp-{gs}"));
    assert!(tmp.is_dir());
    let r = w.json(&["doctor"]);
    assert!(r.stdout.contains("interrupted-hibernate") && r.stdout.contains("stale-image"), "{}", r.stdout);
    let r = w.json(&["images", "gc"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(!tmp.exists(), "the temporary image is removed");
    assert_eq!(r.json()["reconciled"][0]["outcome"], "resumed", "{}", r.stdout);
    wait_for(Duration::from_secs(10), || proc_state(pid) != 'T');
    assert_eq!(w.json(&["state", &p]).json()["state"], "running");
    w.assert_progressing(pid);
    // Reconciled once: nothing is left to report.
    let r = w.json(&["doctor"]);
    assert!(!r.stdout.contains("interrupted-hibernate") && !r.stdout.contains("stale-image"), "{}", r.stdout);
}

#[test]
fn store_errors_after_criu_acted_are_undone_or_finished() {
    criu_present();
    let mut w = World::new(&[8192]);
    let pid = w.workload(1024, 0, &[]);
    let p = pid.to_string();
    let db_path = w.state_dir().join("gpusnap.db");
    assert_eq!(w.json(&["state", &p]).code, 0);

    // Hibernate: the database locked once CRIU has dumped. The image is
    // written, so the hibernate is finished (the tree ended), not left
    // stopped.
    let (criu, flag, go) = pausing_criu(&w, "dump");
    let child = spawn_with(
        &w,
        &[("GPUSNAP_DB_WAIT", "1")],
        &["--criu", criu.to_str().unwrap(), "hibernate", &p, "--image", "locked"],
    );
    wait_for(Duration::from_secs(60), || flag.exists());
    let db = rusqlite::Connection::open(&db_path).unwrap();
    db.execute_batch("BEGIN EXCLUSIVE").unwrap();
    std::fs::write(&go, b"").unwrap();
    let (code, err) = finish(child);
    db.execute_batch("ROLLBACK").unwrap();
    assert_eq!(code, 0, "{err}");
    w.reap(pid);
    assert!(!pid_exists(pid), "the hibernated tree was ended");
    assert_eq!(w.json(&["images", "verify", "locked"]).code, 0);

    // Wake: the database locked once CRIU has restored. The restored
    // process is ended (it is off the GPU), the image kept for a retry.
    let (criu, flag, go) = pausing_criu(&w, "restore");
    let child = spawn_with(
        &w,
        &[("GPUSNAP_DB_WAIT", "1")],
        &["--criu", criu.to_str().unwrap(), "wake", "locked", "--wait", "10", "--no-guard"],
    );
    wait_for(Duration::from_secs(60), || flag.exists());
    db.execute_batch("BEGIN EXCLUSIVE").unwrap();
    std::fs::write(&go, b"").unwrap();
    let (code, err) = finish(child);
    db.execute_batch("ROLLBACK").unwrap();
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("locked"), "{err}");
    wait_for(Duration::from_secs(20), || !pid_exists(pid));
    let r = w.json(&["wake", "locked", "--wait", "10"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    w.assert_progressing(pid);
    assert_eq!(w.json(&["stop", &p, "--grace", "2"]).code, 0);
}

#[test]
fn a_failed_dump_names_criu_s_first_error_and_keeps_its_log() {
    let mut w = World::new(&[8192]);
    let pid = w.workload(512, 0, &[]);
    let fake = w.tmp.path().join("criu-broken");
    fake_criu(
        &fake,
        "--images-dir",
        "printf '(00.1) Error (criu/plugin.c:1): Unable to open directory /usr/lib/criu: No such file\\n(00.2) Error (criu/cr-dump.c:2): Unable to detach from 1098: No such process\\n' > \"$d/dump.log\"\nexit 1\n",
    );
    let r = w.json(&["--criu", fake.to_str().unwrap(), "hibernate", &pid.to_string(), "--image", "x"]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(r.stderr.contains("Unable to open directory /usr/lib/criu"), "{}", r.stderr);
    assert!(r.stderr.contains("last error: Unable to detach"), "{}", r.stderr);
    let log = r.stderr.split("(log: ").nth(1).and_then(|s| s.split(')').next()).unwrap().to_string();
    assert!(log.starts_with(&w.state_dir().join("logs").display().to_string()), "{log}");
    assert!(std::fs::read_to_string(&log).unwrap().contains("Unable to detach"), "the log named exists");
    w.assert_progressing(pid);
}

#[test]
fn a_dump_without_criu_s_plugin_directory_names_the_cause() {
    // What was seen on the H200: CRIU's first error is the cause; the
    // detach error after it is a consequence; the log named must exist.
    criu_present();
    let mut w = World::new(&[8192]);
    let pid = w.workload(512, 0, &[]);
    let real = String::from_utf8(Command::new("sh").args(["-c", "command -v criu"]).output().unwrap().stdout)
        .unwrap()
        .trim()
        .to_string();
    let wrap = w.tmp.path().join("criu-no-plugins");
    let missing = w.tmp.path().join("no-such-plugin-dir");
    std::fs::write(
        &wrap,
        format!(
            "#!/bin/sh\ncase \"$1\" in\ndump|restore) op=$1; shift; exec \"{real}\" \"$op\" -L \"{}\" \"$@\" ;;\n*) exec \"{real}\" \"$@\" ;;\nesac\n",
            missing.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&wrap, std::fs::Permissions::from_mode(0o755)).unwrap();
    let r = w.json(&["--criu", wrap.to_str().unwrap(), "hibernate", &pid.to_string(), "--image", "np"]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    let msg = r.stderr.lines().next().unwrap();
    assert!(msg.contains("criu dump failed: Unable to open directory"), "{msg}");
    let log = msg.split("(log: ").nth(1).and_then(|s| s.split(')').next()).unwrap().to_string();
    assert!(log.starts_with(&w.state_dir().join("logs").display().to_string()), "{log}");
    assert!(std::fs::metadata(&log).unwrap().len() > 0, "the log named exists");
    assert!(!w.state_dir().join("images/np").exists());
    assert_eq!(w.json(&["state", &pid.to_string()]).json()["state"], "running");
    w.assert_progressing(pid);
}

#[test]
fn a_hibernate_killed_after_its_image_was_committed_is_finished_by_the_next_run() {
    criu_present();
    let mut w = World::new(&[8192]);
    let pid = w.workload(1024, 0, &[]);
    let p = pid.to_string();
    assert_eq!(w.json(&["state", &p]).code, 0);
    // The database held after the dump keeps gpusnap waiting in its first
    // journal note after the commit: killed there, the image is complete
    // and the tree still stopped.
    let (criu, flag, go) = pausing_criu(&w, "dump");
    let mut child = spawn_with(
        &w,
        &[("GPUSNAP_DB_WAIT", "120")],
        &["--criu", criu.to_str().unwrap(), "hibernate", &p, "--image", "done"],
    );
    wait_for(Duration::from_secs(60), || flag.exists());
    let db = rusqlite::Connection::open(w.state_dir().join("gpusnap.db")).unwrap();
    db.execute_batch("BEGIN EXCLUSIVE").unwrap();
    std::fs::write(&go, b"").unwrap();
    let image = w.state_dir().join("images/done");
    wait_for(Duration::from_secs(60), || image.join("manifest.sig").is_file());
    child.kill().unwrap();
    child.wait().unwrap();
    db.execute_batch("ROLLBACK").unwrap();
    assert_eq!(settled_state(pid, 'T'), 'T', "left stopped");
    let r = w.json(&["images", "gc"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()["reconciled"][0]["outcome"], "finished", "{}", r.stdout);
    w.reap(pid);
    assert!(!pid_exists(pid), "the hibernate was finished: the tree ended");
    let r = w.json(&["wake", "done", "--wait", "10"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    w.assert_progressing(pid);
    assert_eq!(w.json(&["stop", &p, "--grace", "2"]).code, 0);
}

#[test]
fn a_failed_restore_names_criu_s_first_error_and_a_log_that_exists() {
    criu_present();
    let mut w = World::new(&[8192]);
    let (pid, _) = w.cpu_tree();
    assert_eq!(w.json(&["hibernate", &pid.to_string(), "--image", "fr"]).code, 0);
    w.reap(pid);
    let fake = w.tmp.path().join("criu-restore-fails");
    fake_criu(
        &fake,
        "--work-dir",
        "printf '(00.1) Error (criu/files.c:1): cause of it all\\n(00.2) Error (criu/cr-restore.c:2): what followed\\n' > \"$d/restore.log\"\nexit 1\n",
    );
    let r = w.json(&["--criu", fake.to_str().unwrap(), "wake", "fr"]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    // The lazy restore fails first (a notice: waking eagerly), then the
    // eager one: the error line is the eager restore's.
    let msg = r.stderr.lines().find(|l| l.starts_with("gpusnap: ")).unwrap_or_default();
    assert!(msg.contains("criu restore failed: cause of it all; last error: what followed"), "{}", r.stderr);
    let log = msg.split("(log: ").nth(1).and_then(|s| s.split(')').next()).unwrap().to_string();
    assert!(log.starts_with(&w.state_dir().join("logs").display().to_string()), "{log}");
    assert!(std::fs::read_to_string(&log).unwrap().contains("cause of it all"));
    assert_eq!(w.json(&["images", "verify", "fr"]).code, 0, "the image is kept for a retry");
}
