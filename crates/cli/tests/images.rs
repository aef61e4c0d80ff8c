//! hibernate / wake / snapshot / recover with the real CRIU and the fakes.

mod common;

use common::*;
use serde_json::json;
use std::process::Stdio;
use std::time::Duration;

#[test]
fn a_plain_process_tree_hibernates_and_wakes_where_it_left_off() {
    criu_present();
    let mut w = World::new(&[8192]);
    let (pid, out) = w.cpu_tree();
    let p = pid.to_string();
    let child = children_of(pid);
    assert_eq!(child.len(), 1);
    let r = w.json(&["hibernate", &p, "--image", "cpu"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let v = r.json();
    assert_eq!(v["processes"].as_array().unwrap().len(), 2);
    assert_eq!(v["cuda"].as_array().unwrap().len(), 0);
    w.reap(pid);
    // The child was reparented to init when its parent died; init reaps it.
    wait_for(Duration::from_secs(10), || !pid_exists(pid) && !pid_exists(child[0]));
    let at = count(&out);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(count(&out), at, "the tree is gone");

    let r = w.json(&["images", "verify", "cpu"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let r = w.json(&["wake", "cpu", "--wait", "10"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    assert_eq!(r.json()["root_pid"], pid);
    // Same pids, same program, and it goes on counting from where it was.
    wait_for(Duration::from_secs(10), || count(&out) > at + 5);
    assert_eq!(children_of(pid), child);
    let log = std::fs::read_to_string(out.with_extension("log")).unwrap();
    let nums: Vec<u64> = log.lines().filter_map(|l| l.parse().ok()).collect();
    assert!(nums.windows(2).all(|x| x[1] > x[0]), "the log continues without restarting");
    // The pipe to the child survived too.
    wait_for(Duration::from_secs(5), || {
        std::fs::read_to_string(format!("{}.child", out.display()))
            .is_ok_and(|s| s.lines().last().and_then(|l| l.parse::<u64>().ok()).unwrap_or(0) > at)
    });
    // The image stays (wake can be repeated elsewhere); remove it explicitly.
    assert_eq!(w.json(&["images", "rm", "cpu"]).code, 0);
    assert_eq!(w.json(&["images"]).json()["images"].as_array().unwrap().len(), 0);
}

#[test]
fn a_cuda_process_hibernates_and_wakes_with_its_data() {
    criu_present();
    let mut w = World::new(&[16_384]);
    let pid = w.workload(4096, 0, &[]);
    let p = pid.to_string();
    let r = w.json(&["hibernate", &p, "--image", "gpu"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()["cuda"][0], pid);
    w.reap(pid);
    // The GPU is free again.
    let r = w.json(&["ps"]).json();
    assert!(r["processes"].as_array().unwrap().iter().all(|x| x["pid"] != pid));

    let r = w.json(&["wake", "gpu", "--wait", "10"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    assert_eq!(r.json()["resumed"][0], pid);
    w.assert_progressing(pid);
    assert_eq!(w.json(&["state", &p]).json()["state"], "running");
    // A lazy wake asks for the restore thread first (crate::rescue).
    assert_eq!(w.calls_on(pid), ["lock=0", "checkpoint=0", "get_restore_tid=0", "restore=0", "unlock=0"]);
    let r = w.json(&["stop", &p, "--grace", "2"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()["results"][0]["suspended"], true);
}

#[test]
fn a_tree_of_two_cuda_processes_hibernates_and_wakes_together() {
    criu_present();
    let mut w = World::with_config(&[16_384], json!({ "checkpoint_gbps": 4.0, "restore_gbps": 4.0 }));
    let pid = w.workload(2048, 0, &["--child"]);
    let kid_status = std::path::PathBuf::from(format!("{}.child", w.status_path(pid).display()));
    wait_for(Duration::from_secs(20), || read_status(&kid_status).is_some_and(|s| s.1 >= 1));
    let kid = read_status(&kid_status).unwrap().0;
    let r = w.json(&["hibernate", &pid.to_string(), "--image", "pair"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let mut cuda: Vec<i64> =
        r.json()["cuda"].as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect();
    cuda.sort();
    let mut want = vec![pid as i64, kid as i64];
    want.sort();
    assert_eq!(cuda, want);
    w.reap(pid);
    wait_for(Duration::from_secs(10), || !pid_exists(pid) && !pid_exists(kid));
    let r = w.json(&["wake", "pair", "--wait", "10"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    w.adopt(kid);
    w.assert_progressing(pid);
    let n = read_status(&kid_status).unwrap().1;
    wait_for(Duration::from_secs(20), || read_status(&kid_status).is_some_and(|s| s.1 > n + 2 && s.2));
    for p in [pid, kid] {
        assert_eq!(
            w.calls_on(p),
            ["lock=0", "checkpoint=0", "get_restore_tid=0", "restore=0", "unlock=0"],
            "{p}"
        );
    }
    let r = w.json(&["stop", "--tree", &pid.to_string(), "--grace", "2"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
}

#[test]
fn leave_running_keeps_the_tree_as_it_was() {
    criu_present();
    let mut w = World::new(&[8192]);
    let pid = w.workload(1024, 0, &[]);
    let p = pid.to_string();
    let r = w.json(&["snapshot", &p, "--image", "snap"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(w.alive(pid));
    w.assert_progressing(pid);
    assert_eq!(w.json(&["state", &p]).json()["state"], "running");
    // Waking it while the original runs is refused, naming the process.
    let r = w.json(&["wake", "snap"]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert_eq!(r.json()["error"]["kind"], "still_running");
    w.assert_progressing(pid);
}

#[test]
fn a_failed_dump_brings_the_tree_back_and_leaves_no_image() {
    criu_present();
    let mut w = World::new(&[8192]);
    let pid = w.workload(1024, 0, &[]);
    let p = pid.to_string();
    // A criu that is new enough but fails every dump mid-way.
    let fake = w.tmp.path().join("criu-fails");
    fake_criu(
        &fake,
        "--images-dir",
        "echo partial > \"$d/pages-1.img\"\necho '(00.1) Error (criu/cr-dump.c:1): disk on fire' > \"$d/dump.log\"\nexit 1\n",
    );
    let r = w.json(&["--criu", fake.to_str().unwrap(), "hibernate", &p, "--image", "x"]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(r.stderr.contains("disk on fire"), "{}", r.stderr);
    // Back as it was: running, data intact, and no image (partial or not).
    assert_eq!(w.json(&["state", &p]).json()["state"], "running");
    w.assert_progressing(pid);
    let images = w.state_dir().join("images");
    assert_eq!(std::fs::read_dir(&images).map(|d| d.count()).unwrap_or(0), 0);
    assert_eq!(w.calls_on(pid), ["lock=0", "checkpoint=0", "restore=0", "unlock=0"]);
}

#[test]
fn criu_missing_or_old_is_refused_before_anything_changes() {
    let mut w = World::new(&[8192]);
    let pid = w.workload(512, 0, &[]);
    let p = pid.to_string();
    let r = w.json(&["--criu", "/nonexistent/criu", "hibernate", &p]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.contains("criu not found"), "{}", r.stderr);
    let old = w.tmp.path().join("criu-old");
    std::fs::write(&old, "#!/bin/sh\necho 'Version: 3.17.1'\n").unwrap();
    std::fs::set_permissions(&old, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let r = w.json(&["--criu", old.to_str().unwrap(), "hibernate", &p]);
    assert_eq!(r.code, 1);
    assert!(r.stderr.contains("3.17.1 is too old"), "{}", r.stderr);
    assert!(w.calls_on(pid).is_empty(), "the driver was never asked");
}

#[test]
fn corrupt_missing_and_foreign_images_are_refused() {
    criu_present();
    let mut w = World::new(&[8192]);
    let (pid, _) = w.cpu_tree();
    let cmdline = |p: i32| std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
    let its = cmdline(pid);
    assert_eq!(w.json(&["hibernate", &pid.to_string(), "--image", "c"]).code, 0);
    w.reap(pid);
    // The pages are chunks in the store: one of them damaged.
    corrupt_pages_chunk(&w.state_dir(), "c", &[]);
    let r = w.json(&["wake", "c"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("fails its checksum"), "{}", r.stderr);
    // Its pid may be another program's by now (a loaded machine reuses
    // pids): nothing of the image runs under it.
    assert!(!pid_exists(pid) || cmdline(pid) != its, "nothing was restored");
    let r = w.json(&["wake", "nope"]);
    assert_eq!(r.code, 2);
    assert!(r.stderr.contains("no image nope"), "{}", r.stderr);
    for cmd in [&["images", "verify", "nope"][..], &["images", "rm", "nope"][..]] {
        let r = w.json(cmd);
        assert_eq!(r.code, 2, "{cmd:?}: {}", r.stderr);
        assert!(r.stderr.contains("no image nope"), "{}", r.stderr);
    }
    let r = w.json(&["doctor", "999999999"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.contains("no process 999999999"), "{}", r.stdout);
    std::fs::create_dir_all(w.state_dir().join("images/foreign")).unwrap();
    let r = w.json(&["wake", "foreign"]);
    assert_eq!(r.code, 2);
    assert!(r.stderr.contains("not a gpusnap image"), "{}", r.stderr);
    let r = w.json(&["images", "verify", "c"]);
    assert_eq!(r.code, 2);
}

#[test]
fn wake_without_gpu_memory_is_refused_and_can_be_retried() {
    criu_present();
    let mut w = World::new(&[8192]);
    let pid = w.workload(4096, 0, &[]);
    let p = pid.to_string();
    assert_eq!(w.json(&["hibernate", &p, "--image", "m"]).code, 0);
    w.reap(pid);
    let filler = w.workload(6000, 0, &[]);
    let r = w.json(&["wake", "m"]);
    assert_eq!(r.code, 3, "{}", r.stderr);
    assert!(!pid_exists(pid), "nothing was restored");
    w.kill(filler);
    let r = w.json(&["wake", "m"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    w.assert_progressing(pid);
    assert_eq!(w.json(&["stop", &p, "--grace", "2"]).code, 0);
}

#[test]
fn a_failed_cuda_restore_on_wake_leaves_the_image_for_a_retry() {
    criu_present();
    let mut w = World::new(&[8192]);
    let pid = w.workload(1024, 0, &[]);
    let p = pid.to_string();
    assert_eq!(w.json(&["hibernate", &p, "--image", "r"]).code, 0);
    w.reap(pid);
    w.set_config("inject", json!([{ "call": "restore", "pid": pid, "rc": 999, "count": 1 }]));
    let r = w.json(&["wake", "r", "--wait", "10"]);
    assert_eq!(r.code, 4, "{}", r.stderr);
    // The restored (still suspended) process was ended, the image kept.
    wait_for(Duration::from_secs(10), || !pid_exists(pid));
    assert_eq!(w.json(&["images", "verify", "r"]).code, 0);
    let r = w.json(&["wake", "r", "--wait", "10"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    w.assert_progressing(pid);
    assert_eq!(w.json(&["stop", &p, "--grace", "2"]).code, 0);
}

#[test]
fn a_stuck_process_is_recovered_from_its_snapshot() {
    criu_present();
    let mut w = World::new(&[8192]);
    let pid = w.workload(2048, 0, &[]);
    let p = pid.to_string();
    assert_eq!(w.json(&["suspend", &p]).code, 0);
    // resume --snapshot-first keeps an image of the suspended process; here
    // a tenant outside gpusnap then races the restore (injected as the
    // driver's own out-of-memory answer).
    w.set_config("inject", json!([{ "call": "restore", "pid": pid, "rc": 2, "count": 1 }]));
    let r = w.json(&["resume", &p, "--snapshot-first", "--wait", "10"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let v = r.json();
    assert!(v["results"][0]["recovered_from"].as_str().unwrap().starts_with("resume-"), "{v}");
    // What came back: its footprint as the image recorded it (2 GiB and the
    // fake driver's context), not zero.
    assert!(v["results"][0]["footprint_bytes"].as_u64().unwrap() >= 2048 << 20, "{v}");
    w.reap(pid);
    w.adopt(pid);
    w.assert_progressing(pid);
    assert_eq!(w.json(&["state", &p]).json()["state"], "running");
    assert_eq!(w.json(&["stop", &p, "--grace", "2"]).code, 0);
}

#[test]
fn recover_refuses_healthy_processes_and_needs_an_image() {
    let mut w = World::new(&[8192]);
    let pid = w.workload(512, 0, &[]);
    // A process that is not stuck is not rolled back unless asked.
    let r = w.json(&["recover", &pid.to_string()]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("not stuck"), "{}", r.stderr);
    let r = w.json(&["recover", "--force", &pid.to_string()]);
    assert_eq!(r.code, 5, "{}", r.stderr);
    assert!(r.stderr.contains("no image"), "{}", r.stderr);
}

#[test]
fn children_born_during_the_dump_are_ended_with_the_tree() {
    criu_present();
    let w = World::new(&[8192]);
    for i in 0..3 {
        // A shell that starts a new child every 50 ms: the tree CRIU dumps
        // has children the first walk of the tree did not see.
        let count = w.tmp.path().join(format!("count-{i}"));
        let mut sh = std::process::Command::new("setsid")
            .args(["bash", "-c", "i=0; while :; do i=$((i+1)); echo $i >\"$1\"; sleep 0.05; done", "_"])
            .arg(&count)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let pid = sh.id() as i32;
        wait_for(Duration::from_secs(10), || count.exists());
        std::thread::sleep(Duration::from_millis(300));
        let name = format!("born-{i}");
        let r = w.json(&["hibernate", &pid.to_string(), "--image", &name]);
        assert_eq!(r.code, 0, "{}", r.stderr);
        let _ = sh.wait();
        // Every process of the image is gone, so the wake finds its pids free.
        for p in r.json()["processes"].as_array().unwrap() {
            let p = p.as_i64().unwrap() as i32;
            wait_for(Duration::from_secs(10), || !pid_exists(p));
        }
        let r = w.json(&["wake", &name, "--wait", "10"]);
        assert_eq!(r.code, 0, "{}", r.stderr);
        let at = count_of(&count);
        wait_for(Duration::from_secs(10), || count_of(&count) > at);
        let r = w.json(&["stop", &pid.to_string(), "--grace", "1"]);
        assert_eq!(r.code, 0, "{}", r.stderr);
    }
}

fn count_of(p: &std::path::Path) -> u64 {
    std::fs::read_to_string(p).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0)
}

/// The last field of a /proc status line (the value in the innermost
/// namespace), e.g. NSsid.
fn ns_field(pid: i32, key: &str) -> Option<i32> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines().find_map(|l| l.strip_prefix(key))?.split_whitespace().last()?.parse().ok()
}

#[test]
fn a_session_leader_outside_the_namespace_is_explained_refused_and_avoided_by_run() {
    criu_present();
    let w = World::new(&[8192]);
    // `unshare --pid` without a new session: inside its namespace the
    // program's session leader is invisible, as under `docker exec`.
    let mut ns = std::process::Command::new("unshare")
        .args(["--pid", "--fork", "sleep", "60"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for(Duration::from_secs(10), || !children_of(ns.id() as i32).is_empty());
    let sleep = children_of(ns.id() as i32)[0];
    assert_eq!(ns_field(sleep, "NSsid:"), Some(0));
    let r = w.json(&["doctor", &sleep.to_string()]);
    let findings = r.json()["findings"].clone();
    assert!(
        findings.as_array().unwrap().iter().any(|f| f["check"] == "session" && f["severity"] == "warn"),
        "{findings}"
    );
    let r = w.json(&["hibernate", &sleep.to_string(), "--image", "foreign"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert_eq!(r.json()["error"]["kind"], "foreign_session", "{}", r.stdout);
    assert!(r.stderr.contains("setsid"), "{}", r.stderr);
    // Refused before anything was touched: the program runs on, no image.
    let state = std::fs::read_to_string(format!("/proc/{sleep}/stat")).unwrap();
    assert!(state.contains(") S "), "{state}");
    assert_eq!(w.json(&["images", "list"]).json()["images"].as_array().map_or(0, Vec::len), 0);
    let _ = ns.kill();
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(sleep), nix::sys::signal::Signal::SIGKILL);
    let _ = ns.wait();

    // `gpusnap run` started that way gives its program a session of its own.
    let st = w.tmp.path().join("ns-run-status");
    let wl = fake_workload_bin();
    let g = w.gpusnap_cmd(&[
        "run",
        "--no-keeper",
        "--",
        wl.to_str().unwrap(),
        "--mib",
        "256",
        "--status",
        st.to_str().unwrap(),
    ]);
    let mut cmd = std::process::Command::new("unshare");
    cmd.args(["--pid", "--fork", "--mount-proc"]).arg(g.get_program()).args(g.get_args());
    for (k, v) in g.get_envs() {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    let mut ns = cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    wait_for(Duration::from_secs(20), || read_status(&st).is_some());
    let run = children_of(ns.id() as i32)[0];
    let prog = children_of(run)[0];
    assert_eq!(ns_field(run, "NSsid:"), Some(0), "run itself is in the outside session");
    let sid = ns_field(prog, "NSsid:");
    assert_eq!(sid, ns_field(prog, "NSpid:"), "the program leads a session of its own");
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(prog), nix::sys::signal::Signal::SIGKILL);
    wait_for(Duration::from_secs(20), || ns.try_wait().unwrap().is_some());
}

/// Starts the fake workload inside cgroup `cg` (it joins before exec).
fn workload_in(w: &mut World, cg: &std::path::Path, name: &str) -> (i32, std::path::PathBuf) {
    let st = w.tmp.path().join(name);
    let wl = fake_workload_bin();
    let script = format!("echo $$ > {}/cgroup.procs && exec \"$@\"", cg.display());
    w.spawn_env(
        "sh",
        &["-c", &script, "sh", wl.to_str().unwrap(), "--mib", "1024", "--status", st.to_str().unwrap()],
    );
    wait_for(Duration::from_secs(20), || read_status(&st).is_some_and(|s| s.1 >= 1));
    (read_status(&st).unwrap().0, st)
}

#[test]
fn a_cgroup_of_two_trees_hibernates_all_or_nothing() {
    criu_present();
    let Some(cg) = Cgroup::new(1 << 40) else {
        gpusnap_testkit::skip("no cgroup can be created here");
        return;
    };
    let mut w = World::new(&[16_384]);
    let (a, st_a) = workload_in(&mut w, &cg.0, "pod-a");
    let (b, st_b) = workload_in(&mut w, &cg.0, "pod-b");
    let cgs = cg.0.to_str().unwrap().to_string();

    // The second tree's checkpoint fails: the first tree is put back as it
    // was and its image removed; nothing was ended.
    let second = a.max(b);
    w.set_config("inject", json!([{ "call": "checkpoint", "pid": second, "rc": 999, "count": 1 }]));
    let r = w.json(&["hibernate", "--cgroup", &cgs, "--image", "pod"]);
    assert_eq!(r.code, 4, "{}", r.stderr);
    assert!(r.stderr.contains(&format!("member {second}")), "{}", r.stderr);
    for (p, st) in [(a, &st_a), (b, &st_b)] {
        assert!(w.alive(p));
        assert_eq!(w.json(&["state", &p.to_string()]).json()["state"], "running");
        assert_progressing_at(st);
    }
    assert_eq!(w.json(&["images", "list"]).json()["images"].as_array().unwrap().len(), 0);

    // Then both, one image each.
    let r = w.json(&["hibernate", "--cgroup", &cgs, "--image", "pod"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let results = r.json()["results"].as_array().unwrap().clone();
    assert_eq!(results.len(), 2, "{results:?}");
    for p in [a, b] {
        w.reap(p);
        wait_for(Duration::from_secs(10), || !pid_exists(p));
    }
    // The group wakes all or nothing: the second image's CUDA restore
    // fails, the first tree is ended safely, both images stay.
    let (ia, ib) = (format!("pod-{}", a.min(b)), format!("pod-{}", a.max(b)));
    w.set_config("inject", json!([{ "call": "restore", "pid": second, "rc": 999, "count": 1 }]));
    let r = w.json(&["wake", &ia, &ib, "--wait", "10", "--no-guard"]);
    assert_eq!(r.code, 4, "{}", r.stderr);
    assert!(r.stderr.contains(&format!("image {ib} of the group")), "{}", r.stderr);
    for p in [a, b] {
        wait_for(Duration::from_secs(20), || !pid_exists(p));
    }
    assert_eq!(w.json(&["images", "list"]).json()["images"].as_array().unwrap().len(), 2);
    let r = w.json(&["wake", &ia, &ib, "--wait", "10", "--no-guard"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()["results"].as_array().unwrap().len(), 2);
    w.adopt(a);
    w.adopt(b);
    assert_progressing_at(&st_a);
    assert_progressing_at(&st_b);
}

#[test]
fn an_empty_group_hibernates_nothing() {
    criu_present();
    // Not --all: the other tests' fake workloads run beside this one.
    let Some(cg) = Cgroup::new(1 << 40) else {
        gpusnap_testkit::skip("no cgroup can be created here");
        return;
    };
    let w = World::new(&[8192]);
    let r = w.json(&["hibernate", "--cgroup", cg.0.to_str().unwrap()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()["results"].as_array().unwrap().len(), 0);
    assert!(r.stderr.contains("nothing to hibernate"), "{}", r.stderr);
}

/// The group forms of hibernate and wake fed nonsense: clear errors, and
/// nothing restored, ended or removed.
#[test]
fn group_hibernate_and_wake_refuse_bad_input() {
    criu_present();
    let mut w = World::new(&[8192]);
    let (pid, out) = w.cpu_tree();
    let tid: i32 = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .find(|t| *t != pid)
        .expect("the tree's root has a second thread");
    let r = w.json(&["hibernate", &pid.to_string(), &tid.to_string()]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains(&format!("{tid} is a thread of {pid}")), "{}", r.stderr);
    let r = w.json(&["hibernate", &pid.to_string(), "999999999"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("no process 999999999"), "{}", r.stderr);
    let r = w.json(&["hibernate", "--cgroup", "/nonexistent/cgroup"]);
    assert_ne!(r.code, 0, "{}", r.stderr);
    assert!(r.stderr.contains("is not a cgroup"), "{}", r.stderr);
    // Nothing was touched: the tree runs on, no image was written.
    let n = count(&out);
    wait_for(Duration::from_secs(10), || count(&out) > n);
    assert_eq!(w.json(&["images", "list"]).json()["images"].as_array().unwrap().len(), 0);

    // A group wake with a missing or a corrupt member restores nothing.
    assert_eq!(w.json(&["hibernate", &pid.to_string(), "--image", "good"]).code, 0);
    w.reap(pid);
    wait_for(Duration::from_secs(10), || !pid_exists(pid));
    let r = w.json(&["wake", "good", "nope"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("image nope of the group: no image nope"), "{}", r.stderr);
    assert_eq!(r.json()["error"]["kind"], "image_missing");
    assert!(!pid_exists(pid), "nothing was restored");
    let (p2, _) = w.cpu_tree();
    assert_eq!(w.json(&["hibernate", &p2.to_string(), "--image", "bad"]).code, 0);
    w.reap(p2);
    // A chunk of bad's own (not one good shares) damaged.
    corrupt_pages_chunk(&w.state_dir(), "bad", &["good"]);
    let r = w.json(&["wake", "good", "bad"]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("fails its checksum"), "{}", r.stderr);
    assert!(!pid_exists(pid) && !pid_exists(p2), "nothing was restored");
    // The good image is still whole and wakes alone.
    let r = w.json(&["wake", "good", "--wait", "10", "--no-guard"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
}

#[test]
fn an_image_whose_pages_are_files_verifies_and_import_makes_them_chunks() {
    criu_present();
    let mut w = World::new(&[8192]);
    let (pid, out) = w.cpu_tree();
    let r = w.json(&["hibernate", &pid.to_string(), "--image", "old"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.reap(pid);
    wait_for(Duration::from_secs(10), || !pid_exists(pid));
    let at = count(&out);
    // An image as gpusnap wrote them before: its pages files are files (and
    // the store has none of their chunks).
    let state = w.state_dir();
    let dir = state.join("images/old");
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    let store = gpusnap_chunks::LocalStore::open(state.join("store")).unwrap();
    let mut pages = Vec::new();
    for f in m["files"].as_array().unwrap() {
        let path = f["path"].as_str().unwrap();
        if !path.contains("/pages-") || f["chunks"].as_array().map(|c| c.is_empty()).unwrap_or(true) {
            continue;
        }
        let mut data = Vec::new();
        for c in f["chunks"].as_array().unwrap() {
            data.extend(store.get(c["blake3"].as_str().unwrap()).unwrap());
        }
        std::fs::write(dir.join(path), &data).unwrap();
        std::fs::set_permissions(dir.join(path), std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
        pages.push(dir.join(path));
    }
    assert!(!pages.is_empty());
    std::fs::remove_dir_all(state.join("store/chunks")).unwrap();
    let r = w.json(&["images", "verify", "old"]);
    assert_eq!(r.code, 0, "an image with its pages as files: {}", r.stderr);
    // Imported: its pages become chunks (checked), the files go.
    let r = w.json(&["images", "import", "old"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(pages.iter().all(|p| !p.exists()), "the pages files are removed");
    let r = w.json(&["images", "verify", "old"]);
    assert_eq!(r.code, 0, "every chunk there and whole: {}", r.stderr);
    let r = w.json(&["wake", "old", "--wait", "10", "--no-guard"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    wait_for(Duration::from_secs(20), || count(&out) > at + 5);
}

#[test]
fn a_corrupted_chunk_of_a_cuda_image_is_refused_before_any_process_runs() {
    criu_present();
    let mut w = World::new(&[16_384]);
    // Its expected data in anonymous memory: most of its pages are served
    // lazily (the damaged chunk is one of them).
    let pid = w.workload(2048, 0, &["--data-kib", "32768"]);
    let r = w.json(&["hibernate", &pid.to_string(), "--image", "gpu"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.reap(pid);
    wait_for(Duration::from_secs(10), || !pid_exists(pid));
    // Every chunk of a CUDA image is checked before its process runs: in
    // the background of a lazy restore, the driver's restore reading only
    // chunks the page server checked and the unlock waiting for the whole
    // image; before an eager restore. A driver restore that met the bad
    // chunk is let run to its end on zero pages with the process's other
    // threads stopped, then checkpointed again (crate::rescue).
    let (chunk, good) = corrupt_pages_chunk(&w.state_dir(), "gpu", &[]);
    // Lazy with its verify beside the driver, lazy with none there (the
    // page server's checks, then the rest at the unlocks' gate), eager.
    for (eager, verify_threads) in [(false, None), (false, Some("0")), (true, None)] {
        let mut args = vec!["wake", "gpu", "--wait", "10"];
        if eager {
            args.push("--eager");
        }
        if let Some(n) = verify_threads {
            w.env_extra.push(("GPUSNAP_VERIFY_THREADS".into(), n.into()));
        }
        let r = w.json(&args);
        w.env_extra.clear();
        assert_eq!(r.code, 2, "eager {eager}: {}", r.stderr);
        assert!(r.stderr.contains("fails its checksum"), "{}", r.stderr);
        assert_eq!(r.json()["error"]["kind"], "image_invalid", "{}", r.stdout);
        // What CRIU restored was ended, its CUDA state never unlocked: a
        // restore that ran was followed by a checkpoint.
        wait_for(Duration::from_secs(20), || !pid_exists(pid));
        assert!(!pid_exists(pid), "nothing was left running");
        let calls = w.calls_on(pid);
        let after = calls.iter().skip(2).cloned().collect::<Vec<_>>();
        assert!(!after.iter().any(|c| c.starts_with("unlock")), "the process was unlocked: {calls:?}");
        if let Some(i) = after.iter().position(|c| c == "restore=0") {
            assert_eq!(after.get(i + 1).map(String::as_str), Some("checkpoint=0"), "{calls:?}");
        }
        assert!(!eager || !after.iter().any(|c| c.starts_with("restore")), "eager: {calls:?}");
        // Lazy: CRIU restored the tree while the chunks were checked.
        let criu_ran = std::fs::read_dir(w.state_dir().join("logs"))
            .unwrap()
            .filter_map(|e| e.ok())
            .any(|e| e.path().join("restore.log").exists());
        assert!(eager || criu_ran, "CRIU's restore ran");
    }
    std::fs::write(&chunk, &good).unwrap();
    let r = w.json(&["wake", "gpu", "--wait", "10"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.adopt(pid);
    let v = r.json();
    assert_eq!(v["lazy"], true, "{v}");
    // The chunks were checked in the background, to the end before the
    // unlock.
    let st = &v["stages"];
    assert!(st["verify_background"].is_u64() && st["verify_wait"].is_u64(), "{v}");
    assert!(st["verify_wait"].as_u64() <= st["verify_background"].as_u64(), "{v}");
    w.assert_progressing(pid);
    let r = w.json(&["stop", &pid.to_string(), "--grace", "2"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
}

#[test]
fn a_process_that_dies_right_after_criu_restores_it_is_named_and_its_image_kept() {
    criu_present();
    let mut w = World::new(&[8192]);
    // As JAX's worker with XLA_PYTHON_CLIENT_PREALLOCATE=false on the H200:
    // a thread runs once CRIU has restored the process and faults before
    // the driver's restore.
    // Its host copy (256 MiB the fake's checkpoint writes) is all filled
    // before the driver's restore starts (a head start of all of it), so
    // it is dead by then.
    let pid = w.workload(256, 0, &["--segv-after-restore", "--host-copy-mib", "256"]);
    let p = pid.to_string();
    let r = w.json(&["hibernate", &p, "--image", "dies"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    w.reap(pid);
    wait_for(Duration::from_secs(10), || !pid_exists(pid));
    w.env_extra.push(("GPUSNAP_PAGES_HEAD_START".into(), "100%".into()));
    let r = w.json(&["wake", "dies", "--wait", "10"]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    let e = &r.json()["error"];
    assert_eq!(e["kind"], "died_after_restore", "{e}");
    let msg = e["message"].as_str().unwrap();
    // How it ended, unless its init reaped it first (a pid namespace's
    // init that reaps orphans at once, as CI's).
    assert!(msg.contains(&format!("process {pid}")), "{msg}");
    assert!(msg.contains("killed by SIGSEGV") || msg.contains("reaped before gpusnap saw"), "{msg}");
    assert!(msg.contains("the image is kept"), "{msg}");
    // Nothing of it is left, the driver never restored it, and the image
    // is whole.
    wait_for(Duration::from_secs(10), || !pid_exists(pid));
    assert!(!w.calls_on(pid).iter().any(|c| c == "unlock=0"), "{:?}", w.calls_on(pid));
    assert_eq!(w.json(&["images", "verify", "dies"]).code, 0);
}
