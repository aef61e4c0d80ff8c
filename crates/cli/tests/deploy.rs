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
    assert!(std::env::var("CI").as_deref() != Ok("true"), "{why}; CI must run this test");
    eprintln!("skipped: {why}");
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

#[test]
fn the_helm_chart_lints_renders_and_validates() {
    if !tool("helm", "a helm release binary") {
        return;
    }
    let chart = root().join("deploy/helm/gpusnap");
    let mut cmd = Command::new("helm");
    cmd.arg("lint").arg(&chart);
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
        let mut cmd = Command::new("helm");
        cmd.args(["template", "gpusnap"]).arg(&chart).args(["--namespace", "gpusnap-system"]).args(extra);
        let yaml = ok(cmd, None);
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
