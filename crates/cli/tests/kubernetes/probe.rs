//! `gpusnap probe` as the kubelet runs it in a pod (an exec probe through
//! the CRI's `ExecSync`), in pods like the example's
//! (`deploy/kubernetes/examples/vllm.yaml`): the server's container has a
//! pid namespace of its own (the server is pid 1 there) and the agent's
//! probe directory mounted read-only at `/run/gpusnap/probe` (the admin
//! socket stays on the node); one pod without the node's state directory,
//! one with it mounted read-only, and one that mounts nothing of the node
//! and finds the endpoint the agent places in its network namespace.

use super::*;

/// The example's probe command, run in the pod's container: its exit code,
/// its answer (`--json`) and its whole output; `None` when the runtime
/// cannot run it (the container ended), which the kubelet counts as a
/// failed probe.
fn probe(ctd: &Containerd, pod: &TestPod) -> Option<(i32, Value, String)> {
    let cmd = [env!("CARGO_BIN_EXE_gpusnap"), "--json", "probe", "--pid", "1", "--port", "8000"];
    let (code, out) = ctd.exec_status(pod, &cmd).ok()?;
    let v = out.lines().rev().find_map(|l| serde_json::from_str(l).ok()).unwrap_or(Value::Null);
    Some((code, v, out))
}

/// The probe's exit code and `state`, asserting it answered with one JSON
/// object and said where its view came from.
fn answer(ctd: &Containerd, pod: &TestPod) -> (i32, String, String) {
    let (code, v, out) = probe(ctd, pod).expect("the probe runs in a live container");
    assert_eq!(v["exit_code"], code, "{out}");
    assert_eq!(v["pid"], 1, "{out}");
    let s = |k: &str| v[k].as_str().unwrap_or_default().to_string();
    (code, s("state"), s("source"))
}

#[test]
fn the_examples_exec_probe_in_a_pod_of_its_own_pid_namespace_answers_without_waking_it() {
    let mut w = World::new(&[8192]);
    let Some(ctd) = Containerd::new() else { return };
    let run = w.tmp.path().join("run");
    // A resume that cannot succeed gives up after its wake-timeout.
    let keys = [("gpusnap.io/suspend-after", "never"), ("gpusnap.io/wake-timeout", "3s")];
    // "bare" mounts nothing of the node (Pod Security "baseline", as the
    // example): its probe finds the endpoint the agent placed in its
    // network namespace.
    let pods: Vec<(String, TestPod)> =
        [("plain", false, true), ("statedir", true, true), ("bare", false, false)]
            .into_iter()
            .map(|(name, state_dir, mounted)| {
                let sight = Sight::OwnPids { state_dir, run_dir: mounted.then(|| run.clone()) };
                let pod = ctd.run_server_pod_seeing(&w, "test", name, &enabled(&keys), 256, 8000, &sight);
                (format!("test.{name}"), pod)
            })
            .collect();
    let mut agent = Agent::at(&w, &ctd, run.join("agent.sock"), "");
    agent.start(&mut w);
    let host_pid = |svc: &str| agent.service(svc).unwrap()["pid"].as_i64().unwrap() as i32;
    for (svc, pod) in &pods {
        wait_for(LONG, || agent.state(svc) == "running");
        // The agent names the server by its host pid, the probe by pid 1.
        assert_ne!(host_pid(svc), 1);
        // The agent places a pod's endpoint as it starts serving the pod;
        // until then the probe judges without it.
        let mut last = (0, String::new(), String::new());
        let asked = wait_until(LONG, || {
            last = answer(&ctd, pod);
            last.2 == "agent"
        });
        assert!(asked, "{svc}: the probe never reached the agent: {last:?}");
        assert_eq!(last, (0, "running".into(), "agent".into()), "{svc}");
    }

    // The pod's endpoint answers the probe's question and nothing else.
    let (_, bare) = &pods[2];
    let gpusnap = env!("CARGO_BIN_EXE_gpusnap");
    let act = [gpusnap, "service", "test.plain", "suspend", "--socket", "@gpusnap-probe"];
    let (code, out) = ctd.exec_status(bare, &act).unwrap();
    assert_eq!(code, 2, "{out}");
    assert!(out.contains("answers only GET /v1/processes?tree=PID"), "{out}");
    assert_eq!(agent.state("test.plain"), "running");

    // Suspended by the agent: ready, and still suspended after.
    for (svc, pod) in &pods {
        agent.act(svc, "suspend");
        assert_eq!(answer(&ctd, pod), (0, "suspended".into(), "agent".into()), "{svc}");
        assert_eq!(agent.state(svc), "suspended");
        assert_eq!(driver_state(&w, host_pid(svc)), "checkpointed");
    }

    // A restore that fails (the driver answers 2, out of memory, as when a
    // tenant outside gpusnap took the GPU): it cannot come back in place.
    let (svc, pod) = &pods[1];
    let pid = host_pid(svc);
    w.set_config("inject", serde_json::json!([{ "call": "restore", "pid": pid, "rc": 2, "count": 1 }]));
    let (code, body) = agent.api("POST", &format!("/v1/services/{svc}/resume"));
    assert_ne!(code, 200, "{body}");
    eprintln!("{code} {body}");
    let (code, v, out) = probe(&ctd, pod).unwrap();
    assert_eq!((code, v["state"].as_str()), (5, Some("unrecoverable")), "{out}");
    assert!(v["reason"].as_str().is_some_and(|r| r.contains("cannot be restored")), "{out}");

    // Without the agent (killed, being upgraded) the probe judges from what
    // it sees: the server lives and listens, so it stays ready.
    agent.kill9(&mut w);
    let (_, bare) = &pods[2];
    assert_eq!(answer(&ctd, bare), (0, "alive".into(), "process".into()));
    let (_, pod) = &pods[0];
    assert_eq!(answer(&ctd, pod), (0, "alive".into(), "process".into()));
    assert_eq!(driver_state(&w, pod.pid), "checkpointed", "the probe woke nothing");

    // The server killed: its container ends with it, and the probe cannot
    // run (a failed probe) or answers not ready.
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pod.pid), nix::sys::signal::Signal::SIGKILL).unwrap();
    wait_for(LONG, || probe(&ctd, pod).is_none_or(|(code, _, _)| code != 0));
}
