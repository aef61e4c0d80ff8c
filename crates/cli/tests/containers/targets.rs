//! `--container NAME|ID`: a podman container's CUDA processes as one group.

use crate::common::*;
use crate::podman::*;
use std::path::PathBuf;
use std::time::Duration;

/// Container `name` running two fake CUDA programs (512 and 256 MiB) under
/// busybox's sh; their status files.
fn two_workloads(pm: &Podman, w: &World, name: &str) -> (PathBuf, PathBuf) {
    let (a, b) = (pm.shared.join(format!("{name}-a")), pm.shared.join(format!("{name}-b")));
    let wl = fake_workload_bin().display().to_string();
    let script =
        format!("{wl} --mib 512 --status {} & exec {wl} --mib 256 --status {}", a.display(), b.display());
    let mut args: Vec<String> = vec!["run".into(), "-d".into(), "--name".into(), name.into()];
    args.extend(pm.world_flags(w));
    args.extend([IMAGE.into(), "/bin/sh".into(), "-c".into(), script]);
    pm.ok(&args.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    for s in [&a, &b] {
        wait_for(Duration::from_secs(60), || read_status(s).is_some_and(|s| s.1 >= 1));
    }
    (a, b)
}

fn pids(v: &serde_json::Value) -> Vec<i64> {
    let mut p: Vec<i64> =
        v["processes"].as_array().unwrap().iter().map(|r| r["pid"].as_i64().unwrap()).collect();
    p.sort_unstable();
    p
}

#[test]
fn suspend_resume_stop_and_ps_of_a_container_by_name_and_id() {
    let w = World::new(&[8192]);
    let Some(pm) = Podman::new(&w) else { return };
    let (a, b) = two_workloads(&pm, &w, "pair");
    // Another container's CUDA process, and one of the host: left alone.
    let (other, other_status) = pm.workload(&w, "other", 128);
    let id = pm.ok(&["inspect", "--format", "{{.Id}}", "pair"]);
    let gs = |args: &[&str]| {
        let mut cmd = w.gpusnap_cmd(&[]);
        pm.env(&mut cmd);
        cmd.arg("--json").args(args);
        let o = bounded(cmd, Duration::from_secs(120));
        let (out, err) =
            (String::from_utf8_lossy(&o.stdout).to_string(), String::from_utf8_lossy(&o.stderr).to_string());
        (o.status.code().unwrap_or(-1), out, err)
    };
    let json =
        |s: &str| -> serde_json::Value { serde_json::from_str(s.lines().last().unwrap_or("")).unwrap() };

    // ps names each process's container; --container keeps one container's.
    let (code, out, err) = gs(&["ps"]);
    assert_eq!(code, 0, "{err}");
    let all = json(&out);
    let row = all["processes"].as_array().unwrap().iter().find(|r| r["pid"] == other).cloned().unwrap();
    assert_eq!(row["container"]["name"], "other", "{row}");
    assert_eq!(row["container"]["runtime"], "podman", "{row}");
    let (code, out, err) = gs(&["ps", "--container", "pair"]);
    assert_eq!(code, 0, "{err}");
    let mine = json(&out);
    let members = pids(&mine);
    assert_eq!(members.len(), 2, "{mine}");
    assert!(
        mine["processes"].as_array().unwrap().iter().all(|r| r["container"]["id"] == id.as_str()),
        "{mine}"
    );
    let mut cmd = w.gpusnap_cmd(&["ps"]);
    pm.env(&mut cmd);
    let text = String::from_utf8_lossy(&bounded(cmd, Duration::from_secs(120)).stdout).to_string();
    assert!(text.contains("CONTAINER") && text.contains(&format!("pair (podman {})", &id[..12])), "{text}");

    // suspend by name: both, and nothing else.
    let (code, _, err) = gs(&["suspend", "--container", "pair"]);
    assert_eq!(code, 0, "{err}");
    let (_, out, _) = gs(&["state", "--container", "pair"]);
    let st = json(&out);
    assert!(st["processes"].as_array().unwrap().iter().all(|r| r["state"] == "checkpointed"), "{st}");
    assert_eq!(pids(&st), members);
    assert_eq!(w.json(&["state", &other.to_string()]).json()["state"], "running");
    assert_progressing_at(&other_status);

    // resume by id prefix.
    let (code, _, err) = gs(&["resume", "--container", &id[..12]]);
    assert_eq!(code, 0, "{err}");
    assert_progressing_at(&a);
    assert_progressing_at(&b);

    // stop: suspended first, then ended; the container exits.
    let (code, out, err) = gs(&["stop", "--container", "pair", "--grace", "5"]);
    assert_eq!(code, 0, "{err}");
    let r = json(&out);
    assert!(r["results"].as_array().unwrap().iter().all(|x| x["suspended"] == true), "{r}");
    wait_for(Duration::from_secs(60), || pm.status("pair") != "running");
    assert_eq!(w.json(&["state", &other.to_string()]).json()["state"], "running");
}

#[test]
fn unknown_and_stopped_containers_are_refused() {
    let w = World::new(&[8192]);
    let Some(pm) = Podman::new(&w) else { return };
    pm.ok(&["create", "--name", "idle", IMAGE, "/bin/sh"]);
    let gs = |args: &[&str]| {
        let mut cmd = w.gpusnap_cmd(&[]);
        pm.env(&mut cmd);
        cmd.arg("--json").args(args);
        let o = bounded(cmd, Duration::from_secs(120));
        (
            o.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&o.stdout).to_string(),
            String::from_utf8_lossy(&o.stderr).to_string(),
        )
    };
    for cmd in ["suspend", "resume", "stop", "hibernate", "state"] {
        let (code, out, err) = gs(&[cmd, "--container", "nosuch"]);
        assert_eq!(code, 2, "{cmd}: {err}");
        assert!(
            err.contains("container nosuch: no such container (asked podman, containerd, cri-o)"),
            "{cmd}: {err}"
        );
        assert!(out.contains("\"kind\":\"container\""), "{out}");
        let (code, _, err) = gs(&[cmd, "--container", "idle"]);
        assert_eq!(code, 2, "{cmd}: {err}");
        assert!(err.contains("the podman container idle is created, not running"), "{cmd}: {err}");
    }
    let (code, _, err) = gs(&["ps", "--container", "nosuch"]);
    assert_eq!(code, 2, "{err}");
    // Without podman on PATH: nothing to ask, the same refusal.
    let mut cmd = w.gpusnap_cmd(&["suspend", "--container", "idle"]);
    cmd.env("PATH", "/nonexistent");
    let o = bounded(cmd, Duration::from_secs(60));
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("no such container"));
}

/// A paused container (its cgroup frozen) is refused before the driver is
/// called, which would hang on it; doctor says what a container's process
/// depends on (its container, mount namespace, a deleted /dev/shm file).
#[test]
fn a_paused_container_is_refused_and_doctor_names_the_container_costs() {
    let w = World::new(&[8192]);
    let Some(pm) = Podman::new(&w) else { return };
    let (pid, status) = pm.workload(&w, "held", 256);
    let pid_s = pid.to_string();
    let gs = |args: &[&str]| {
        let mut cmd = w.gpusnap_cmd(&[]);
        pm.env(&mut cmd);
        cmd.arg("--json").args(args);
        let o = bounded(cmd, Duration::from_secs(120));
        (
            o.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&o.stdout).to_string(),
            String::from_utf8_lossy(&o.stderr).to_string(),
        )
    };
    let (code, out, _) = gs(&["doctor", &pid.to_string()]);
    assert_eq!(code, 0);
    assert!(out.contains("\"container\"") && out.contains("runs in podman container"), "{out}");
    assert!(out.contains("\"mount-namespace\""), "{out}");
    // The host's check: podman is there; the test's cuda-checkpoint is a
    // wrapper and runc.conf is not set up here: said, with the fix.
    assert!(out.contains("\"container-runtime\""), "{out}");

    pm.ok(&["pause", "held"]);
    let (code, _, err) = gs(&["suspend", "--container", "held"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("the podman container held is paused: its cgroup is frozen"), "{err}");
    let (code, out, err) = gs(&["suspend", &pid.to_string()]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("frozen cgroup") && out.contains("\"kind\":\"frozen\""), "{err} {out}");
    let (_, out, _) = gs(&["doctor", &pid.to_string()]);
    assert!(out.contains("\"frozen\""), "{out}");
    pm.ok(&["unpause", "held"]);
    let (code, _, err) = gs(&["suspend", "--container", "held"]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = gs(&["resume", "--container", "held"]);
    assert_eq!(code, 0, "{err}");
    assert_progressing_at(&status);
    // CRIU cannot dump a container's process alone: said before it tries.
    for args in
        [vec!["hibernate", "--container", "held"], vec!["hibernate", &pid_s], vec!["snapshot", &pid_s]]
    {
        let (code, _, err) = gs(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(
            err.contains("CRIU cannot dump it alone") && err.contains("podman container checkpoint"),
            "{err}"
        );
    }
    assert_eq!(w.json(&["state", &pid_s]).json()["state"], "running");

    // A deleted /dev/shm file held open, no name left: CRIU's ghost file.
    let mut args: Vec<String> = vec!["run".into(), "-d".into(), "--name".into(), "shm".into()];
    args.extend(pm.world_flags(&w));
    args.extend([
        IMAGE.into(),
        "/bin/sh".into(),
        "-c".into(),
        "exec 3<>/dev/shm/segment; rm /dev/shm/segment; exec sleep 1000".into(),
    ]);
    pm.ok(&args.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    let spid = pm.pid("shm");
    wait_for(Duration::from_secs(30), || {
        std::fs::read_to_string(format!("/proc/{spid}/comm")).is_ok_and(|c| c.trim() == "sleep")
    });
    let (_, out, _) = gs(&["doctor", &spid.to_string()]);
    assert!(out.contains("\"shm\"") && out.contains("ghost files"), "{out}");
}

/// A container of a runtime gpusnap does not ask (docker here), known by
/// its processes' cgroup: refused with the reason and the way around it.
#[test]
fn a_container_of_another_runtime_is_refused() {
    let w = World::new(&[8192]);
    let id = format!("{:016x}{:048x}", std::process::id(), 0xd0c4e5u64);
    let root = ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"].into_iter().find(|r| {
        std::path::Path::new(r).join("cgroup.procs").is_file()
            && std::fs::metadata(format!("{r}/cgroup.controllers")).is_ok()
    });
    let Some(root) = root else {
        gpusnap_testkit::skip("no cgroup v2 hierarchy to make a docker-like cgroup in");
        return;
    };
    let cg = PathBuf::from(root).join(format!("docker-{id}.scope"));
    if std::fs::create_dir(&cg).is_err() {
        gpusnap_testkit::skip(format!("cannot create a cgroup under {root}"));
        return;
    }
    let mut sleep = std::process::Command::new("sleep").arg("600").spawn().unwrap();
    std::fs::write(cg.join("cgroup.procs"), sleep.id().to_string()).unwrap();
    let mut cmd = w.gpusnap_cmd(&["--json", "suspend", "--container", &id[..12]]);
    // Whether or not podman is installed, it does not know the container.
    if let Some(pm) = Podman::new(&w) {
        pm.env(&mut cmd);
    }
    let o = bounded(cmd, Duration::from_secs(120));
    let _ = sleep.kill();
    let _ = sleep.wait();
    let _ = std::fs::remove_dir(&cg);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("it is a docker container") && err.contains("--cgroup"), "{err}");
}
