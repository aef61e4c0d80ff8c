//! The Kubernetes manifests and the Helm chart of `deploy/`, checked offline:
//! `kubectl kustomize` builds the kustomization, `helm lint` and `helm
//! template` render the chart, `kubernetes-validate --strict` checks every
//! object against the API's schemas, and the agent's own parser reads the
//! agent.toml each of them carries and the example's annotations. The tools
//! are skipped where not installed, except in CI (CI=true), which installs them.

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
