//! Groups: all or nothing, in parallel, with the whole group's admission.

mod common;

use common::*;
use serde_json::json;

fn states(w: &World, pids: &[i32]) -> Vec<String> {
    pids.iter()
        .map(|p| w.json(&["state", &p.to_string()]).json()["state"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn a_group_suspends_and_resumes_together() {
    let mut w = World::with_config(&[16_384], json!({ "checkpoint_gbps": 2.0, "restore_gbps": 4.0 }));
    let pids: Vec<i32> = (0..3).map(|_| w.workload(2048, 0, &[])).collect();
    let args: Vec<String> = pids.iter().map(|p| p.to_string()).collect();
    let mut a: Vec<&str> = vec!["suspend"];
    a.extend(args.iter().map(String::as_str));
    let r = w.json(&a);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()["results"].as_array().unwrap().len(), 3);
    assert_eq!(states(&w, &pids), ["checkpointed"; 3]);
    a[0] = "resume";
    let r = w.json(&a);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(states(&w, &pids), ["running"; 3]);
    for p in &pids {
        w.assert_progressing(*p);
    }
    let r = w.json(&["stop", "--all", "--grace", "2"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()["results"].as_array().unwrap().len(), 3);
    for p in &pids {
        assert!(!w.alive(*p));
    }
}

#[test]
fn one_member_failing_puts_the_others_back() {
    let mut w = World::new(&[16_384]);
    let pids: Vec<i32> = (0..3).map(|_| w.workload(1024, 0, &[])).collect();
    let args: Vec<String> = pids.iter().map(|p| p.to_string()).collect();
    // Suspend: the second member's checkpoint fails.
    w.set_config("inject", json!([{ "call": "checkpoint", "pid": pids[1], "rc": 999, "count": 1 }]));
    let mut a: Vec<&str> = vec!["suspend"];
    a.extend(args.iter().map(String::as_str));
    let r = w.json(&a);
    assert_eq!(r.code, 4, "{}", r.stderr);
    assert!(r.stderr.contains(&format!("member {}", pids[1])), "{}", r.stderr);
    assert_eq!(states(&w, &pids), ["running"; 3]);
    for p in &pids {
        w.assert_progressing(*p);
    }
    // Resume: the third member's restore fails; the others are suspended again.
    assert_eq!(w.json(&a).code, 0);
    w.set_config("inject", json!([{ "call": "restore", "pid": pids[2], "rc": 999, "count": 1 }]));
    a[0] = "resume";
    let r = w.json(&a);
    assert_eq!(r.code, 4, "{}", r.stderr);
    assert!(r.stderr.contains(&format!("member {}", pids[2])), "{}", r.stderr);
    assert_eq!(states(&w, &pids), ["checkpointed"; 3]);
    // And then the whole group comes back.
    let r = w.json(&a);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(states(&w, &pids), ["running"; 3]);
}

#[test]
fn admission_counts_the_whole_group() {
    let mut w = World::new(&[8192]);
    let pids: Vec<i32> = (0..3).map(|_| w.workload(2500, 0, &[])).collect();
    let args: Vec<String> = pids.iter().map(|p| p.to_string()).collect();
    let mut a: Vec<&str> = vec!["suspend"];
    a.extend(args.iter().map(String::as_str));
    assert_eq!(w.json(&a).code, 0);
    let _filler = w.workload(1000, 0, &[]);
    a[0] = "resume";
    // 3 x 2500 MiB + margin does not fit beside the filler: nothing is restored.
    let r = w.json(&a);
    assert_eq!(r.code, 3, "{}", r.stderr);
    assert_eq!(states(&w, &pids), ["checkpointed"; 3]);
    assert!(w.journal().iter().all(|(c, _, _)| c != "restore"));
    // Two of them fit.
    let r = w.json(&["resume", &args[0], &args[1]]);
    assert_eq!(r.code, 0, "{}", r.stderr);
}

#[test]
fn stop_of_a_group_is_refused_when_one_cannot_be_suspended() {
    let mut w = World::new(&[16_384]);
    let a = w.workload(1024, 0, &[]);
    let b = w.workload(1024, 0, &["--busy-ms", "60000"]);
    let r = w.json(&["stop", &a.to_string(), &b.to_string(), "--lock-timeout", "200"]);
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert_eq!(r.json()["error"]["kind"], "stop_refused");
    assert!(w.alive(a) && w.alive(b));
    assert_eq!(states(&w, &[a, b]), ["running", "running"]);
}

#[test]
fn tree_and_pid_namespaces() {
    let mut w = World::new(&[16_384]);
    let pid = w.workload(1024, 0, &["--child"]);
    let kid_status = format!("{}.child", w.status_path(pid).display());
    wait_for(std::time::Duration::from_secs(20), || read_status(std::path::Path::new(&kid_status)).is_some());
    let kid = read_status(std::path::Path::new(&kid_status)).unwrap().0;
    let r = w.json(&["suspend", "--tree", &pid.to_string()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let got: Vec<i64> =
        r.json()["results"].as_array().unwrap().iter().map(|x| x["pid"].as_i64().unwrap()).collect();
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(got.contains(&(kid as i64)));
    assert_eq!(w.json(&["resume", "--tree", &pid.to_string()]).code, 0);

    // A process in its own pid namespace: gpusnap and NVML use host pids, and
    // ps shows the pid the process sees itself as.
    let status = w.tmp.path().join("ns-status");
    let mut cmd = std::process::Command::new("unshare");
    w.env(&mut cmd);
    let mut ns = cmd
        .args(["--pid", "--fork"])
        .arg(fake_workload_bin())
        .args(["--mib", "512", "--status"])
        .arg(&status)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_for(std::time::Duration::from_secs(20), || read_status(&status).is_some());
    assert_eq!(read_status(&status).unwrap().0, 1, "inside its namespace it is pid 1");
    let host_pid: i32 = children_of(ns.id() as i32)[0];
    let ps = w.json(&["ps"]).json();
    let row =
        ps["processes"].as_array().unwrap().iter().find(|r| r["pid"] == host_pid).expect("listed").clone();
    assert_eq!(row["ns_pid"], 1, "{row}");
    assert_eq!(w.json(&["suspend", &host_pid.to_string()]).code, 0);
    assert_eq!(w.json(&["resume", &host_pid.to_string()]).code, 0);
    assert_progressing_at(&status);
    let r = w.json(&["stop", &host_pid.to_string(), "--grace", "2"]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let _ = ns.wait();
}

/// `state` of several pids and of groups: a line each, or `{"processes"}`;
/// a pid named alone keeps its object.
#[test]
fn state_of_several_pids_and_of_groups() {
    let mut w = World::new(&[16_384]);
    let pids: Vec<i32> = (0..3).map(|_| w.workload(1024, 0, &[])).collect();
    let args: Vec<String> = pids.iter().map(|p| p.to_string()).collect();
    assert_eq!(w.json(&["suspend", &args[1]]).code, 0);

    // People: one line per process, in the order named, each once.
    let r = w.gpusnap(&["state", &args[2], &args[0], &args[1], &args[0]]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{}", r.stdout);
    assert!(lines[0].starts_with(&format!("{} (", pids[2])) && lines[0].contains(": running, 1.0 GiB"));
    assert!(lines[1].starts_with(&format!("{} (", pids[0])) && lines[1].contains(": running"));
    assert!(lines[2].starts_with(&format!("{} (", pids[1])) && lines[2].contains(": checkpointed, 1.0 GiB"));

    // JSON: the shape of `ps`.
    let v = w.json(&["state", &args[0], &args[1]]).json();
    let list = v["processes"].as_array().unwrap_or_else(|| panic!("{v}"));
    let got: Vec<(i64, &str)> =
        list.iter().map(|x| (x["pid"].as_i64().unwrap(), x["state"].as_str().unwrap())).collect();
    assert_eq!(got, [(pids[0] as i64, "running"), (pids[1] as i64, "checkpointed")]);
    assert_eq!(list[1]["footprint_bytes"], 1024 * MIB);

    // A pid named alone: its object, as before.
    let one = w.json(&["state", &args[1]]).json();
    assert_eq!(one["pid"], pids[1]);
    assert_eq!(one["state"], "checkpointed");

    // --all: every CUDA process, ours among them with their states.
    let v = w.json(&["state", "--all"]).json();
    let all = v["processes"].as_array().unwrap();
    for (p, want) in pids.iter().zip(["running", "checkpointed", "running"]) {
        let row = all.iter().find(|x| x["pid"] == *p).unwrap_or_else(|| panic!("{p} not in {v}"));
        assert_eq!(row["state"], want, "{row}");
    }

    // A group's stopped member is listed as stopped; named, it is refused.
    let stop = |sig| nix::sys::signal::kill(nix::unistd::Pid::from_raw(pids[2]), sig).unwrap();
    stop(nix::sys::signal::Signal::SIGSTOP);
    wait_for(std::time::Duration::from_secs(5), || {
        std::fs::read_to_string(format!("/proc/{}/stat", pids[2])).is_ok_and(|s| s.contains(") T "))
    });
    let v = w.json(&["state", "--all"]).json();
    let row = v["processes"].as_array().unwrap().iter().find(|x| x["pid"] == pids[2]).cloned();
    assert_eq!(row.unwrap_or_default()["state"], "stopped", "{v}");
    let r = w.json(&["state", &args[0], &args[2]]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains(&format!("member {} of the group: ", pids[2])), "{}", r.stderr);
    assert!(r.stderr.contains("is stopped"), "{}", r.stderr);
    assert_eq!(r.stderr.lines().count(), 1, "{}", r.stderr);
    stop(nix::sys::signal::Signal::SIGCONT);
    w.assert_progressing(pids[2]);
}

#[test]
fn state_of_a_tree() {
    let mut w = World::new(&[16_384]);
    let pid = w.workload(1024, 0, &["--child"]);
    let kid_status = format!("{}.child", w.status_path(pid).display());
    wait_for(std::time::Duration::from_secs(20), || read_status(std::path::Path::new(&kid_status)).is_some());
    let kid = read_status(std::path::Path::new(&kid_status)).unwrap().0;
    let v = w.json(&["state", "--tree", &pid.to_string()]).json();
    let mut got: Vec<i64> =
        v["processes"].as_array().unwrap().iter().map(|x| x["pid"].as_i64().unwrap()).collect();
    got.sort();
    let mut want = vec![pid as i64, kid as i64];
    want.sort();
    assert_eq!(got, want, "{v}");

    // A tree without CUDA: an empty list, no error.
    let mut sleep = std::process::Command::new("sleep").arg("30").spawn().unwrap();
    let r = w.json(&["state", "--tree", &sleep.id().to_string()]);
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert_eq!(r.json()["processes"], json!([]));
    let _ = sleep.kill();
    let _ = sleep.wait();
}
