//! What changed between two configurations, read as TOML: services by name
//! (added, removed, changed and which keys), and the keys of the other
//! sections (`[agent]`, `[kubernetes]`), which the agent reads only at
//! start. Comparing the TOML rather than the parsed config leaves comments,
//! order and spacing out of it.

use std::collections::BTreeMap;

#[derive(Debug, Default, PartialEq, Eq)]
pub struct Diff {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    /// A service whose table differs, and the keys that differ.
    pub changed: Vec<(String, Vec<String>)>,
    pub unchanged: Vec<String>,
}

/// Each `[[service]]` table of `raw` by its name.
pub fn services(raw: &toml::Table) -> BTreeMap<String, toml::Value> {
    let mut out = BTreeMap::new();
    for s in raw.get("service").and_then(toml::Value::as_array).into_iter().flatten() {
        if let Some(name) = s.get("name").and_then(toml::Value::as_str) {
            out.insert(name.to_string(), s.clone());
        }
    }
    out
}

/// The keys whose values differ between two tables (nested tables as
/// `table.key`), in order.
pub fn keys(prefix: &str, old: Option<&toml::Value>, new: Option<&toml::Value>) -> Vec<String> {
    let empty = toml::Table::new();
    let (o, n) = (
        old.and_then(toml::Value::as_table).unwrap_or(&empty),
        new.and_then(toml::Value::as_table).unwrap_or(&empty),
    );
    let mut all: Vec<&String> = o.keys().chain(n.keys()).collect();
    all.sort();
    all.dedup();
    let mut out = Vec::new();
    for k in all {
        let (a, b) = (o.get(k), n.get(k));
        if a == b {
            continue;
        }
        let name = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
        if a.is_some_and(toml::Value::is_table) || b.is_some_and(toml::Value::is_table) {
            out.extend(keys(&name, a, b));
        } else {
            out.push(name);
        }
    }
    out
}

/// The keys outside `[[service]]` that differ (`agent.socket`,
/// `agent.http.max_body`, `kubernetes.poll_interval`).
pub fn agent_keys(old: &toml::Table, new: &toml::Table) -> Vec<String> {
    let strip = |t: &toml::Table| {
        let mut t = t.clone();
        t.remove("service");
        toml::Value::Table(t)
    };
    keys("", Some(&strip(old)), Some(&strip(new)))
}

/// The services of `new` against those now served (`old`, by name).
pub fn diff(old: &BTreeMap<String, toml::Value>, new: &BTreeMap<String, toml::Value>) -> Diff {
    let mut d = Diff::default();
    for (name, n) in new {
        match old.get(name) {
            None => d.added.push(name.clone()),
            Some(o) if o == n => d.unchanged.push(name.clone()),
            Some(o) => d.changed.push((name.clone(), keys("", Some(o), Some(n)))),
        }
    }
    d.removed = old.keys().filter(|k| !new.contains_key(*k)).cloned().collect();
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> toml::Table {
        toml::from_str(s).unwrap()
    }

    #[test]
    fn services_are_compared_by_name_and_keys_by_value() {
        let old = t("[agent]\nsocket = \"/a\"\n[[service]]\nname = \"a\"\nlisten = \"x\"\n[[service]]\nname = \"b\"\n[[service]]\nname = \"c\"\n");
        // Comments, order and spacing are no change.
        let new = t("# moved\n[[service]]\nname = \"c\"\n[[service]]\nlisten = \"y\"\nname = \"a\"\n[[service]]\nname = \"d\"\n[agent]\nsocket = \"/b\"\n[agent.http]\nmax_body = 1\n");
        let d = diff(&services(&old), &services(&new));
        assert_eq!(d.added, ["d"]);
        assert_eq!(d.removed, ["b"]);
        assert_eq!(d.changed, [("a".to_string(), vec!["listen".to_string()])]);
        assert_eq!(d.unchanged, ["c"]);
        assert_eq!(agent_keys(&old, &new), ["agent.http.max_body", "agent.socket"]);
        assert!(agent_keys(&old, &old).is_empty());
    }
}
