//! deploy/monitoring: the Prometheus alert rules pass `promtool check
//! rules` and their unit tests (`promtool test rules`); the Grafana
//! dashboard's queries parse (promtool, as recording rules) and name only
//! metrics the agent exports.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn monitoring() -> PathBuf {
    root().join("deploy/monitoring")
}

/// `promtool ARGS` in `dir`; None (after a skip) when promtool does not run.
fn promtool(dir: &Path, args: &[&str]) -> Option<(bool, String)> {
    match Command::new("promtool").args(args).current_dir(dir).output() {
        Ok(o) => Some((
            o.status.success(),
            format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)),
        )),
        Err(e) => {
            gpusnap_testkit::skip(format!(
                "promtool does not run ({e}): apt-get install prometheus; .ci/run installs it"
            ));
            None
        }
    }
}

/// The metric families the agent exports (`# TYPE` lines of its /metrics).
fn exported() -> BTreeSet<String> {
    let text = gpusnap_agent::metrics::Metrics::new().encode();
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.split_whitespace().next().map(str::to_string))
        .collect()
}

/// Every `gpusnap_...` name in `expr`.
fn names_in(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = expr;
    while let Some(i) = rest.find("gpusnap_") {
        let tail = &rest[i..];
        let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
        out.push(tail[..end].to_string());
        rest = &tail[end..];
    }
    out
}

/// Whether a sample name belongs to one of the families (a counter's
/// `_total`, a histogram's `_bucket`, `_sum`, `_count`).
fn is_exported(name: &str, families: &BTreeSet<String>) -> bool {
    families.contains(name)
        || ["_total", "_bucket", "_sum", "_count"]
            .iter()
            .any(|s| name.strip_suffix(s).is_some_and(|f| families.contains(f)))
}

#[test]
fn the_alert_rules_pass_promtool_and_their_unit_tests() {
    let Some((ok, out)) = promtool(&monitoring(), &["check", "rules", "alerts.yaml"]) else { return };
    assert!(ok, "promtool check rules: {out}");
    let Some((ok, out)) = promtool(&monitoring(), &["test", "rules", "alerts.test.yaml"]) else { return };
    assert!(ok, "promtool test rules: {out}");
    let rules = std::fs::read_to_string(monitoring().join("alerts.yaml")).unwrap();
    let families = exported();
    for line in rules.lines().filter(|l| l.trim_start().starts_with("expr:")) {
        for n in names_in(line) {
            assert!(is_exported(&n, &families), "alerts.yaml names {n}, which the agent does not export");
        }
    }
}

#[test]
fn the_dashboards_queries_parse_and_name_only_exported_metrics() {
    let text = std::fs::read_to_string(monitoring().join("grafana-dashboard.json")).unwrap();
    let dash: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut exprs = Vec::new();
    for p in dash["panels"].as_array().expect("panels") {
        assert!(p["title"].as_str().is_some_and(|t| !t.is_empty()), "{p}");
        for t in p["targets"].as_array().expect("targets") {
            exprs.push(t["expr"].as_str().expect("expr").to_string());
        }
    }
    assert!(exprs.len() >= 10, "{exprs:?}");
    let families = exported();
    let mut named = BTreeSet::new();
    for e in &exprs {
        for n in names_in(e) {
            assert!(
                is_exported(&n, &families),
                "the dashboard names {n}, which the agent does not export: {e}"
            );
            named.insert(n);
        }
    }
    // Each family the agent exports is on the dashboard.
    for f in &families {
        assert!(named.iter().any(|n| is_exported(n, &BTreeSet::from([f.clone()]))), "{f} is on no panel");
    }
    // The queries parse: promtool checks them as recording rules, with
    // Grafana's variables given values.
    let dir = tempfile::tempdir().unwrap();
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, e) in exprs.iter().enumerate() {
        let e = e.replace("$__rate_interval", "5m").replace("$instance", ".*").replace("$service", ".*");
        rules += &format!(
            "      - record: dashboard:panel_{i}\n        expr: {}\n",
            serde_json::to_string(&e).unwrap()
        );
    }
    std::fs::write(dir.path().join("dashboard.yaml"), rules).unwrap();
    let Some((ok, out)) = promtool(dir.path(), &["check", "rules", "dashboard.yaml"]) else { return };
    assert!(ok, "the dashboard's queries: {out}");
}
