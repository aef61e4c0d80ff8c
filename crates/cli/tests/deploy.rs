//! The Kubernetes manifests and the Helm chart of `deploy/`, checked offline:
//! `kubectl kustomize` builds the kustomization, `helm lint` and `helm
//! template` render the chart, `kubernetes-validate --strict` checks every
//! object against the API's schemas, and the agent's own parser reads the
//! agent.toml each of them carries and the example's annotations. Every
//! tenant pod they render (everything but the agent's own DaemonSet) is
//! held to Pod Security "baseline". The tools are skipped where not
//! installed, except in CI (CI=true), which installs them.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The Kubernetes version whose schemas the objects are checked against.
const KUBERNETES: &str = "1.31.0";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// Whether `tool` runs; skipping (with a message) outside CI when not.
fn tool(tool: &str, install: &str) -> bool {
    if Command::new(tool).arg("--help").stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok() {
        return true;
    }
    let why = format!("{tool} is not installed ({install}; .ci/run installs it)");
    gpusnap_testkit::skip(&why);
    false
}

/// Runs `cmd`, which must succeed; its stdout.
fn ok(mut cmd: Command, input: Option<&str>) -> String {
    use std::io::Write;
    let mut child = cmd
        .stdin(if input.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    if let Some(text) = input {
        child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    }
    let o = child.wait_with_output().unwrap();
    assert!(
        o.status.success(),
        "{cmd:?}: {}\n{}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

fn validate(what: &str, yaml: &str) {
    if !tool("kubernetes-validate", "pip install kubernetes-validate") {
        return;
    }
    let mut cmd = Command::new("kubernetes-validate");
    cmd.args(["--strict", "-k", KUBERNETES, "-"]);
    let out = ok(cmd, Some(yaml));
    assert!(!out.contains("ERROR"), "{what}: {out}");
}

/// The agent.toml of a rendered ConfigMap, read by the agent's parser.
fn agent_toml_parses(what: &str, yaml: &str) {
    let start = yaml.find("agent.toml: |").unwrap_or_else(|| panic!("{what}: no agent.toml in:\n{yaml}"));
    let mut lines = yaml[start..].lines().skip(1);
    let first = lines.next().unwrap();
    let indent = first.len() - first.trim_start().len();
    let mut text = String::new();
    for l in std::iter::once(first).chain(lines) {
        if !l.trim().is_empty() && l.len() - l.trim_start().len() < indent {
            break;
        }
        text.push_str(l.get(indent..).unwrap_or(""));
        text.push('\n');
    }
    let cfg = gpusnap_agent::Config::parse(&text, what).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert!(cfg.kubernetes.is_some(), "{what}: no [kubernetes] table");
    assert!(
        !cfg.agent.socket.starts_with("/run/gpusnap/probe"),
        "{what}: the admin socket must stay out of the directory pods mount"
    );
}

/// Every document of `yaml` as JSON (PyYAML, which kubernetes-validate
/// installs too); `None`, skipping outside CI, without it.
fn documents(yaml: &str) -> Option<Vec<serde_json::Value>> {
    let code =
        "import json, sys, yaml; json.dump([d for d in yaml.safe_load_all(sys.stdin) if d], sys.stdout)";
    let quiet =
        |c: &mut Command| c.stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success());
    if !quiet(Command::new("python3").args(["-c", "import yaml"])) {
        let why = "python3 with PyYAML is not installed (pip install pyyaml)";
        gpusnap_testkit::skip(why);
        return None;
    }
    let mut cmd = Command::new("python3");
    cmd.args(["-c", code]);
    Some(serde_json::from_str(&ok(cmd, Some(yaml))).unwrap())
}

/// The objects exempt from the tenants' rule, by kind and name: the agent's
/// own DaemonSet, privileged by nature (it suspends every pod's processes).
const AGENT: &[(&str, &str)] = &[("DaemonSet", "gpusnap-agent")];

/// The capabilities Pod Security "baseline" lets a container add.
const BASELINE_CAPS: &[&str] = &[
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
];

/// What of Pod Security "baseline" the pod spec `spec` breaks.
fn baseline_breaches(spec: &serde_json::Value) -> Vec<String> {
    let mut bad = Vec::new();
    for k in ["hostNetwork", "hostPID", "hostIPC"] {
        if spec[k] == true {
            bad.push(format!("{k}: true"));
        }
    }
    for v in spec["volumes"].as_array().into_iter().flatten() {
        if !v["hostPath"].is_null() {
            bad.push(format!("volume {}: hostPath", v["name"]));
        }
    }
    let unconfined = |sc: &serde_json::Value| sc["seccompProfile"]["type"] == "Unconfined";
    if unconfined(&spec["securityContext"]) {
        bad.push("seccompProfile Unconfined".into());
    }
    for sysctl in spec["securityContext"]["sysctls"].as_array().into_iter().flatten() {
        bad.push(format!("sysctl {}", sysctl["name"]));
    }
    let kinds = ["containers", "initContainers", "ephemeralContainers"];
    for c in kinds.iter().flat_map(|k| spec[*k].as_array().into_iter().flatten()) {
        let (name, sc) = (&c["name"], &c["securityContext"]);
        if sc["privileged"] == true {
            bad.push(format!("container {name}: privileged"));
        }
        if unconfined(sc) {
            bad.push(format!("container {name}: seccompProfile Unconfined"));
        }
        if !sc["procMount"].is_null() && sc["procMount"] != "Default" {
            bad.push(format!("container {name}: procMount {}", sc["procMount"]));
        }
        if sc["windowsOptions"]["hostProcess"] == true {
            bad.push(format!("container {name}: hostProcess"));
        }
        for cap in sc["capabilities"]["add"].as_array().into_iter().flatten() {
            if !cap.as_str().is_some_and(|c| BASELINE_CAPS.contains(&c.trim_start_matches("CAP_"))) {
                bad.push(format!("container {name}: adds capability {cap}"));
            }
        }
        for p in c["ports"].as_array().into_iter().flatten() {
            if p["hostPort"].as_i64().is_some_and(|h| h != 0) {
                bad.push(format!("container {name}: hostPort {}", p["hostPort"]));
            }
        }
    }
    bad
}

/// Holds every pod that `yaml` renders, but the agent's, to Pod Security
/// "baseline"; returns how many it checked.
fn tenants_are_baseline(what: &str, yaml: &str) -> Option<usize> {
    let mut checked = 0;
    for doc in documents(yaml)? {
        let (kind, name) =
            (doc["kind"].as_str().unwrap_or(""), doc["metadata"]["name"].as_str().unwrap_or(""));
        let spec = match kind {
            "Pod" => &doc["spec"],
            "Deployment" | "StatefulSet" | "DaemonSet" | "ReplicaSet" | "Job" => {
                &doc["spec"]["template"]["spec"]
            }
            "CronJob" => &doc["spec"]["jobTemplate"]["spec"]["template"]["spec"],
            _ => continue,
        };
        if AGENT.iter().any(|(k, n)| *k == kind && name.ends_with(n)) {
            continue;
        }
        let bad = baseline_breaches(spec);
        assert!(
            bad.is_empty(),
            "{what}: {kind} {name} is a tenant pod that breaks Pod Security baseline: {bad:?}"
        );
        checked += 1;
    }
    Some(checked)
}

#[test]
fn the_baseline_check_sees_what_a_pod_should_not_have() {
    let spec = serde_json::json!({
        "hostPID": true,
        "volumes": [{"name": "run", "hostPath": {"path": "/run/gpusnap"}}],
        "containers": [{
            "name": "server",
            "securityContext": {"privileged": true, "capabilities": {"add": ["SYS_PTRACE", "CHOWN"]}},
            "ports": [{"containerPort": 8000, "hostPort": 8000}],
        }],
    });
    let bad = baseline_breaches(&spec);
    assert_eq!(bad.len(), 5, "{bad:?}");
    assert!(baseline_breaches(&serde_json::json!({"containers": [{"name": "c"}]})).is_empty());
}

#[test]
fn the_examples_tenant_pods_pass_pod_security_baseline() {
    let mut files = vec![root().join("deploy/kubernetes/examples/vllm.yaml")];
    let docs = std::fs::read_dir(root().join("docs/k8s")).unwrap();
    files.extend(docs.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|e| e == "yaml")));
    for f in files {
        let yaml = std::fs::read_to_string(&f).unwrap();
        let Some(n) = tenants_are_baseline(&f.display().to_string(), &yaml) else { return };
        assert!(n > 0, "{}: no pod checked", f.display());
    }
}

#[test]
fn the_kustomization_builds_and_validates() {
    let dir = root().join("deploy/kubernetes");
    let text = std::fs::read_to_string(dir.join("agent.toml")).unwrap();
    gpusnap_agent::Config::parse(&text, "deploy/kubernetes/agent.toml").unwrap();
    if !tool("kubectl", "a kubectl release binary") {
        return;
    }
    let mut cmd = Command::new("kubectl");
    cmd.arg("kustomize").arg(&dir);
    let yaml = ok(cmd, None);
    assert!(yaml.contains("kind: DaemonSet") && yaml.contains("hostPID: true"), "{yaml}");
    agent_toml_parses("kubectl kustomize deploy/kubernetes", &yaml);
    tenants_are_baseline("kubectl kustomize deploy/kubernetes", &yaml);
    validate("kubectl kustomize deploy/kubernetes", &yaml);
}

/// `helm ARGS`: the helm binary where installed, else scripts/helm-template.py
/// (lint and template only) with the Python that has PyPI's helm-python-sdk
/// (GPUSNAP_TEST_HELM_PYTHON, default /opt/gpusnap/kubeval/bin/python3).
fn helm(args: &[&str]) -> Option<Command> {
    let quiet =
        |c: &mut Command| c.stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success());
    if quiet(Command::new("helm").arg("version")) {
        let mut cmd = Command::new("helm");
        cmd.args(args);
        return Some(cmd);
    }
    let python =
        std::env::var("GPUSNAP_TEST_HELM_PYTHON").unwrap_or("/opt/gpusnap/kubeval/bin/python3".into());
    if !quiet(Command::new(&python).args(["-c", "import helm_python"])) {
        let why = "neither helm nor PyPI's helm-python-sdk is installed (GPUSNAP_TEST_HELM_PYTHON names a Python that has it)";
        gpusnap_testkit::skip(why);
        return None;
    }
    // The script lints as it renders: `helm lint` is part of its template.
    let (what, rest) = args.split_first()?;
    if *what == "lint" {
        return Some(Command::new("true"));
    }
    let mut cmd = Command::new(python);
    cmd.arg(root().join("scripts/helm-template.py"));
    // `template NAME CHART ...` -> `CHART --name NAME ...`
    cmd.arg(rest[1]).args(["--name", rest[0]]).args(&rest[2..]);
    Some(cmd)
}

#[test]
fn the_helm_chart_lints_renders_and_validates() {
    let chart = root().join("deploy/helm/gpusnap");
    let chart = chart.to_str().unwrap();
    let Some(cmd) = helm(&["lint", "--strict", chart]) else { return };
    ok(cmd, None);
    for extra in [
        &[][..],
        &[
            "--set",
            "criSocket=/var/run/crio/crio.sock",
            "--set",
            "minHostAvailable=16GiB",
            "--set",
            "thp=false",
        ][..],
    ] {
        let mut args = vec!["template", "gpusnap", chart, "--namespace", "gpusnap-system"];
        args.extend_from_slice(extra);
        let yaml = ok(helm(&args).unwrap(), None);
        assert!(yaml.contains("kind: DaemonSet") && yaml.contains("hostPID: true"), "{yaml}");
        agent_toml_parses("helm template", &yaml);
        tenants_are_baseline("helm template", &yaml);
        validate("helm template", &yaml);
    }
}

#[test]
fn the_example_deployment_validates_and_its_annotations_are_good() {
    let path = root().join("deploy/kubernetes/examples/vllm.yaml");
    let yaml = std::fs::read_to_string(&path).unwrap();
    // The pod template's annotations, as the agent reads them.
    let annotations: std::collections::HashMap<String, String> = yaml
        .lines()
        .filter_map(|l| l.trim().strip_prefix("gpusnap.io/"))
        .filter_map(|l| l.split_once(": "))
        .map(|(k, v)| (format!("gpusnap.io/{k}"), v.trim_matches('"').to_string()))
        .collect();
    assert!(gpusnap_agent::kubernetes::annotations::enabled(&annotations));
    let pod = gpusnap_agent::config::PodRef {
        namespace: "models".into(),
        name: "llama-0".into(),
        uid: String::new(),
        sandbox_id: String::new(),
        container: "server".into(),
    };
    let svc = gpusnap_agent::kubernetes::annotations::service(&annotations, None, pod)
        .unwrap_or_else(|bad| panic!("{bad:?}"));
    assert!(svc.hooks.any(), "engine vllm gives the sleep hooks");
    validate("deploy/kubernetes/examples/vllm.yaml", &yaml);
}
