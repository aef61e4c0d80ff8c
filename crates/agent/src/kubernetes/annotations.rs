//! A pod's `gpusnap.io/*` annotations, read into the service the agent
//! makes for it: the keys of a `[[service]]` that make sense for a server
//! the agent adopts. Every bad key is reported, none guessed at.

use crate::bounds::{bytes, within, DAY, MS, TIB};
use crate::config::{Hook, Hooks, OnFault, PodRef, ServiceConfig, Start, WakeOn};
use crate::units::{parse_duration, parse_size};
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

pub const PREFIX: &str = "gpusnap.io/";
/// `"true"`: the agent serves the pod. Anything else: it leaves it alone.
pub const ENABLED: &str = "gpusnap.io/enabled";

/// The keys a pod may carry, besides `enabled`.
pub const KEYS: [&str; 7] =
    ["port", "suspend-after", "priority", "gpu-memory", "wake-timeout", "engine", "container"];

/// What one bad annotation is: its key (without the prefix) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadAnnotation {
    pub key: String,
    pub reason: String,
}

/// The serving engine whose sleep and wake calls are the service's hooks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// vLLM's sleep mode (`VLLM_SERVER_DEV_MODE=1`, `--enable-sleep-mode`).
    Vllm,
    /// SGLang's memory release (`--enable-memory-saver`).
    Sglang,
    None,
}

impl Engine {
    fn parse(s: &str) -> Option<Self> {
        match s {
            "vllm" => Some(Engine::Vllm),
            "sglang" => Some(Engine::Sglang),
            "none" => Some(Engine::None),
            _ => None,
        }
    }

    /// The hooks docs/guides/serving-engines.md gives for the engine.
    pub fn hooks(self) -> Hooks {
        let hook = |path: &str, body: Option<&str>, secs: u64| {
            Some(toml::Spanned::new(
                0..0,
                Hook {
                    method: "POST".into(),
                    path: path.into(),
                    body: body.map(str::to_string),
                    timeout: Duration::from_secs(secs),
                },
            ))
        };
        match self {
            Engine::Vllm => Hooks {
                before_suspend: hook("/sleep?level=1", None, 30),
                after_resume: hook("/wake_up", None, 60),
            },
            Engine::Sglang => Hooks {
                before_suspend: hook("/release_memory_occupation", Some("{}"), 30),
                after_resume: hook("/resume_memory_occupation", Some("{}"), 60),
            },
            Engine::None => Hooks::default(),
        }
    }
}

/// Whether the pod asks to be served.
pub fn enabled(annotations: &HashMap<String, String>) -> bool {
    annotations.get(ENABLED).is_some_and(|v| v == "true")
}

/// The container named by `gpusnap.io/container`, if any.
pub fn container(annotations: &HashMap<String, String>) -> Option<&str> {
    annotations.get(&format!("{PREFIX}container")).map(String::as_str)
}

/// The service name of a pod: `NAMESPACE.POD` (a namespace has no dot, so
/// the first dot splits it again).
pub fn service_name(namespace: &str, pod: &str) -> String {
    format!("{namespace}.{pod}")
}

/// The priority a pod's annotation asked, lowered to the node's
/// `[kubernetes] max_priority`; and whether it was lowered.
pub fn capped(asked: i64, max: i64) -> (i64, bool) {
    (asked.min(max), asked > max)
}

/// The service for an enabled pod at `ip`, or every bad annotation.
pub fn service(
    annotations: &HashMap<String, String>,
    ip: Option<IpAddr>,
    pod: PodRef,
) -> Result<ServiceConfig, Vec<BadAnnotation>> {
    let mut bad = Vec::new();
    let mut fail = |key: &str, reason: String| bad.push(BadAnnotation { key: key.to_string(), reason });
    let get = |key: &str| annotations.get(&format!("{PREFIX}{key}")).map(|v| v.trim());
    for k in annotations.keys().filter_map(|k| k.strip_prefix(PREFIX)) {
        if k != "enabled" && !KEYS.contains(&k) {
            fail(k, format!("unknown key (known: enabled, {})", KEYS.join(", ")));
        }
    }
    let port = match get("port").map(|v| v.parse::<u16>()) {
        None => {
            fail("port", "missing: the port the server listens on in the pod".into());
            0
        }
        Some(Ok(p)) if p > 0 => p,
        Some(_) => {
            fail("port", format!("{:?}: not a port (1 to 65535)", get("port").unwrap_or_default()));
            0
        }
    };
    let mut duration_key =
        |key: &str, never: bool, min: Duration, max: Duration| -> Option<Option<Duration>> {
            let v = get(key)?;
            if never && v == "never" {
                return Some(None);
            }
            match parse_duration(v).and_then(|d| within(key, d, min, max).map(|_| d)) {
                Ok(d) => Some(Some(d)),
                Err(e) => {
                    fail(key, e);
                    None
                }
            }
        };
    let suspend_after = duration_key("suspend-after", true, Duration::ZERO, 365 * DAY);
    let wake_timeout = duration_key("wake-timeout", false, MS, DAY).flatten();
    let priority = match get("priority").map(|v| v.parse::<i64>()) {
        None => 0,
        Some(Ok(p)) if p.unsigned_abs() <= 1_000_000 => p,
        Some(_) => {
            fail(
                "priority",
                format!("{:?}: a whole number from -1000000 to 1000000", get("priority").unwrap_or_default()),
            );
            0
        }
    };
    let gpu_memory = match get("gpu-memory")
        .map(|v| parse_size(v).and_then(|n| bytes("gpu-memory", n, 1, 64 * TIB).map(|_| n)))
    {
        None => None,
        Some(Ok(n)) => Some(n),
        Some(Err(e)) => {
            fail("gpu-memory", e);
            None
        }
    };
    let engine = match get("engine") {
        None => Engine::None,
        Some(v) => Engine::parse(v).unwrap_or_else(|| {
            fail("engine", format!("{v:?}: vllm, sglang or none"));
            Engine::None
        }),
    };
    if get("container").is_some_and(str::is_empty) {
        fail("container", "empty".into());
    }
    if !bad.is_empty() {
        bad.sort_by(|a, b| a.key.cmp(&b.key));
        return Err(bad);
    }
    let addr = SocketAddr::new(ip.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST)), port);
    Ok(ServiceConfig {
        name: toml::Spanned::new(0..0, service_name(&pod.namespace, &pod.name)),
        // Clients reach the pod at its own address: no proxy stands between;
        // a watch of the pod's port in its network namespace wakes it.
        listen: None,
        wake_on: WakeOn::Socket,
        netns: None,
        ignore_peers: None,
        socket_poll: Duration::from_millis(1),
        socket_poll_running: Duration::from_millis(100),
        backend: addr,
        command: None,
        pid_file: None,
        cgroup: None,
        suspend_after: suspend_after.unwrap_or(Some(Duration::from_secs(300))),
        // The disk tier of a pod is its runtime's checkpoint, never a
        // hibernate from outside the runtime.
        hibernate_after: None,
        wake_timeout: wake_timeout.unwrap_or(Duration::from_secs(120)),
        priority,
        restart: false,
        max_waiting: 1024,
        margin: 256 << 20,
        gpu_memory,
        thp: None,
        lazy_wake: None,
        hooks: engine.hooks(),
        models: Vec::new(),
        start: Start::Boot,
        fail_fast: false,
        remote: None,
        max_connections: 1024,
        request_timeout: Some(Duration::from_secs(600)),
        pass_environment: Vec::new(),
        environment: Default::default(),
        user: None,
        group: None,
        on_fault: OnFault::Exit,
        fast_swap: None,
        keep_pinned: None,
        // Root and the agent's group, on the admin socket: a pod never
        // reaches it, and its annotations grant nothing.
        allow_users: None,
        allow_groups: None,
        min_resident: None,
        park: None,
        pod: Some(pod),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod() -> PodRef {
        PodRef {
            namespace: "models".into(),
            name: "llama-0".into(),
            uid: "u".into(),
            sandbox_id: "s".into(),
            container: "server".into(),
        }
    }

    fn ann(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (format!("{PREFIX}{k}"), v.to_string())).collect()
    }

    #[test]
    fn a_pod_cannot_ask_more_than_the_node_allows() {
        assert_eq!(capped(1_000_000, 10), (10, true));
        assert_eq!(capped(-3, 10), (-3, false));
        assert_eq!(capped(10, 10), (10, false));
    }

    #[test]
    fn only_true_enables() {
        assert!(enabled(&ann(&[("enabled", "true")])));
        for v in ["True", "yes", "1", ""] {
            assert!(!enabled(&ann(&[("enabled", v)])), "{v:?}");
        }
        assert!(!enabled(&HashMap::new()));
    }

    #[test]
    fn annotations_become_the_service_keys() {
        let a = ann(&[
            ("enabled", "true"),
            ("port", "8000"),
            ("suspend-after", "90s"),
            ("priority", "-3"),
            ("gpu-memory", "20GiB"),
            ("wake-timeout", "5m"),
            ("engine", "vllm"),
        ]);
        let s = service(&a, Some("10.1.2.3".parse().unwrap()), pod()).unwrap();
        assert_eq!(s.name.get_ref(), "models.llama-0");
        assert_eq!(s.backend, "10.1.2.3:8000".parse().unwrap());
        assert_eq!(s.suspend_after, Some(Duration::from_secs(90)));
        assert_eq!(s.priority, -3);
        assert_eq!(s.gpu_memory, Some(20 << 30));
        assert_eq!(s.wake_timeout, Duration::from_secs(300));
        assert_eq!(s.hooks.before_suspend.as_ref().unwrap().get_ref().path, "/sleep?level=1");
        assert!(s.adopted() && s.hibernate_after.is_none() && !s.restart);
    }

    #[test]
    fn defaults_and_never() {
        let s = service(&ann(&[("port", "80"), ("suspend-after", "never")]), None, pod()).unwrap();
        assert_eq!(s.suspend_after, None);
        assert!(!s.hooks.any());
        let s = service(&ann(&[("port", "80")]), None, pod()).unwrap();
        assert_eq!(s.suspend_after, Some(Duration::from_secs(300)));
    }

    #[test]
    fn every_bad_key_is_named() {
        let a = ann(&[
            ("port", "http"),
            ("suspend-after", "soon"),
            ("priority", "high"),
            ("gpu-memory", "lots"),
            ("engine", "tgi"),
            ("suspend_after", "1m"),
        ]);
        let bad = service(&a, None, pod()).unwrap_err();
        let keys: Vec<&str> = bad.iter().map(|b| b.key.as_str()).collect();
        assert_eq!(keys, ["engine", "gpu-memory", "port", "priority", "suspend-after", "suspend_after"]);
        let bad = service(&HashMap::new(), None, pod()).unwrap_err();
        assert_eq!(bad[0].key, "port");
        assert!(bad[0].reason.contains("missing"));
    }
}
