//! The agent's TOML configuration: `[agent]` and one `[[service]]` per model
//! server. Every error names the file and the line (toml's spans give it).

use serde::de::{self, Deserializer};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;
use toml::Spanned;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: {reason}")]
    Read { path: String, reason: String },
    #[error("{path}:{line}: {reason}")]
    Invalid { path: String, line: usize, reason: String },
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub agent: AgentConfig,
    #[serde(default)]
    pub service: Vec<ServiceConfig>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    #[serde(default = "default_socket")]
    pub socket: PathBuf,
    /// Peers allowed on the socket besides root (a name or a numeric gid).
    pub group: Option<Spanned<String>>,
    pub metrics_listen: Option<SocketAddr>,
    /// Below this much available host memory, suspended services are hibernated.
    #[serde(default, deserialize_with = "size_opt")]
    pub min_host_available: Option<u64>,
    /// How often the policy looks at idleness and host memory.
    #[serde(default = "default_tick", deserialize_with = "duration")]
    pub tick: Duration,
    /// Transparent huge pages `always` for the length of each suspend (as
    /// `gpusnap suspend --thp`): the driver's checkpoint, bound by host page
    /// faults, runs about 2x faster; every process of the host gets huge
    /// pages meanwhile. A service may say otherwise.
    #[serde(default)]
    pub thp: bool,
    /// Wake hibernated services lazily (the page server fills their memory
    /// while the driver already restores). Off by default: a lazy wake does
    /// not survive the death of its gpusnap, and the agent must survive
    /// `kill -9` at any moment. A service may say otherwise.
    #[serde(default)]
    pub lazy_wake: bool,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            socket: default_socket(),
            group: None,
            metrics_listen: None,
            min_host_available: None,
            tick: default_tick(),
            thp: false,
            lazy_wake: false,
        }
    }
}

fn default_socket() -> PathBuf {
    PathBuf::from("/run/gpusnap/agent.sock")
}

fn default_tick() -> Duration {
    Duration::from_millis(200)
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceConfig {
    pub name: Spanned<String>,
    pub listen: Spanned<SocketAddr>,
    pub backend: SocketAddr,
    pub command: Option<Vec<String>>,
    pub pid_file: Option<PathBuf>,
    pub cgroup: Option<PathBuf>,
    #[serde(default = "default_suspend_after", deserialize_with = "duration_or_never")]
    pub suspend_after: Option<Duration>,
    #[serde(default, deserialize_with = "duration_or_never")]
    pub hibernate_after: Option<Duration>,
    #[serde(default = "default_wake_timeout", deserialize_with = "duration")]
    pub wake_timeout: Duration,
    #[serde(default)]
    pub priority: i64,
    #[serde(default = "yes")]
    pub restart: bool,
    /// Connections allowed to wait for the service at once; more are closed.
    #[serde(default = "default_max_waiting")]
    pub max_waiting: usize,
    /// Extra GPU memory required beyond the footprint on resume.
    #[serde(default = "default_margin", deserialize_with = "size")]
    pub margin: u64,
    /// What the server takes on the GPU once loaded: before a (cold) start,
    /// idle services are suspended until this much is free. Unset: started
    /// as is (a server that finds the GPU full fails and is restarted).
    #[serde(default, deserialize_with = "size_opt")]
    pub gpu_memory: Option<u64>,
    /// Overrides `[agent] thp` for this service's suspends.
    pub thp: Option<bool>,
    /// Overrides `[agent] lazy_wake` for this service's wakes.
    pub lazy_wake: Option<bool>,
    /// HTTP calls to the server's own backend around its suspends and
    /// resumes (vLLM's sleep mode, SGLang's memory release): see docs/design/agent.md.
    #[serde(default)]
    pub hooks: Hooks,
}

/// `[service.hooks]` (in a `[[service]]` array: `hooks.before_suspend = {...}`
/// or a `[service.hooks]` table after the service's keys).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hooks {
    /// Before each suspend (idle, eviction, API): the server gives back what
    /// need not be saved (its KV cache). Failing or late, the suspend goes on.
    pub before_suspend: Option<Spanned<Hook>>,
    /// After each resume or wake, before any request is forwarded: the
    /// server takes it again. Failing or late: the service is suspended
    /// again and its waiting connections get a 503.
    pub after_resume: Option<Spanned<Hook>>,
}

impl Hooks {
    pub fn any(&self) -> bool {
        self.before_suspend.is_some() || self.after_resume.is_some()
    }
}

/// One HTTP request to the service's backend; any 2xx answer is success.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hook {
    #[serde(default = "default_hook_method")]
    pub method: String,
    /// Path and query, e.g. `/sleep?level=1`.
    pub path: String,
    /// Request body (sent as `application/json` when it parses as JSON).
    #[serde(default)]
    pub body: Option<String>,
    #[serde(default = "default_hook_timeout", deserialize_with = "duration")]
    pub timeout: Duration,
}

impl Hook {
    /// `POST /sleep?level=1`, for the journal.
    pub fn describe(&self) -> String {
        format!("{} {}", self.method, self.path)
    }
}

fn default_hook_method() -> String {
    "POST".into()
}
fn default_hook_timeout() -> Duration {
    Duration::from_secs(30)
}

impl ServiceConfig {
    /// Whether the agent started it (and may end it) or adopted it.
    pub fn adopted(&self) -> bool {
        self.command.is_none()
    }
}

fn default_suspend_after() -> Option<Duration> {
    Some(Duration::from_secs(300))
}
fn default_wake_timeout() -> Duration {
    Duration::from_secs(120)
}
fn default_max_waiting() -> usize {
    1024
}
fn default_margin() -> u64 {
    256 << 20
}
fn yes() -> bool {
    true
}

/// `300` (seconds), `"300"`, `"500ms"`, `"5m"`, `"2h"`, `"1.5s"`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("bad duration {s:?}: expected e.g. 300, 500ms, 5m, 2h"))?;
    let scale = match unit.trim() {
        "" | "s" => 1.0,
        "ms" => 0.001,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        "d" => 86400.0,
        u => return Err(format!("bad duration {s:?}: unknown unit {u:?} (ms, s, m, h, d)")),
    };
    Duration::try_from_secs_f64(n * scale).map_err(|e| format!("bad duration {s:?}: {e}"))
}

/// `1024` (bytes), `"512MiB"`, `"16GiB"`, `"1TB"`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("bad size {s:?}: expected e.g. 16GiB, 512MiB"))?;
    let scale: f64 = match unit.trim() {
        "" | "B" => 1.0,
        "KiB" => 1024.0,
        "MiB" => 1024f64.powi(2),
        "GiB" => 1024f64.powi(3),
        "TiB" => 1024f64.powi(4),
        "PiB" => 1024f64.powi(5),
        "kB" | "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        u => return Err(format!("bad size {s:?}: unknown unit {u:?} (KiB, MiB, GiB, TiB, KB, MB, GB, TB)")),
    };
    Ok((n * scale) as u64)
}

#[derive(Deserialize)]
#[serde(untagged)]
enum NumOrStr {
    Int(u64),
    Float(f64),
    Str(String),
}

fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    match NumOrStr::deserialize(d)? {
        NumOrStr::Int(n) => Ok(Duration::from_secs(n)),
        NumOrStr::Float(f) => Duration::try_from_secs_f64(f).map_err(de::Error::custom),
        NumOrStr::Str(s) => parse_duration(&s).map_err(de::Error::custom),
    }
}

fn duration_or_never<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    match NumOrStr::deserialize(d)? {
        NumOrStr::Str(s) if s.trim() == "never" => Ok(None),
        NumOrStr::Int(n) => Ok(Some(Duration::from_secs(n))),
        NumOrStr::Float(f) => Duration::try_from_secs_f64(f).map(Some).map_err(de::Error::custom),
        NumOrStr::Str(s) => parse_duration(&s).map(Some).map_err(de::Error::custom),
    }
}

fn size<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    match NumOrStr::deserialize(d)? {
        NumOrStr::Int(n) => Ok(n),
        NumOrStr::Float(f) => Ok(f as u64),
        NumOrStr::Str(s) => parse_size(&s).map_err(de::Error::custom),
    }
}

fn size_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    size(d).map(Some)
}

fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].bytes().filter(|b| *b == b'\n').count() + 1
}

impl Config {
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::Read { path: path.display().to_string(), reason: e.to_string() })?;
        Self::parse(&text, &path.display().to_string())
    }

    pub fn parse(text: &str, path: &str) -> Result<Self, ConfigError> {
        let invalid = |offset: usize, reason: String| ConfigError::Invalid {
            path: path.to_string(),
            line: line_of(text, offset),
            reason,
        };
        let cfg: Config = toml::from_str(text).map_err(|e| {
            let offset = e.span().map_or(0, |s| s.start);
            invalid(offset, e.message().trim().to_string())
        })?;
        if let Some(g) = &cfg.agent.group {
            if crate::peer::group_id(g.get_ref()).is_none() {
                return Err(invalid(
                    g.span().start,
                    format!("group {:?}: no such group on this host", g.get_ref()),
                ));
            }
        }
        let mut names = std::collections::HashMap::new();
        let mut ports = std::collections::HashMap::new();
        for s in &cfg.service {
            let at = s.name.span().start;
            let name = s.name.get_ref();
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
                return Err(invalid(
                    at,
                    format!("service name {name:?}: use letters, digits, '-', '_', '.'"),
                ));
            }
            if let Some(first) = names.insert(name.clone(), line_of(text, at)) {
                return Err(invalid(at, format!("duplicate service name {name:?} (first on line {first})")));
            }
            let listen = *s.listen.get_ref();
            let lat = s.listen.span().start;
            if let Some((other, _)) = ports.get(&listen.port()) {
                return Err(invalid(
                    lat,
                    format!("service {name:?} listens on port {} as {other:?} does", listen.port()),
                ));
            }
            ports.insert(listen.port(), (name.clone(), lat));
            if listen == s.backend {
                return Err(invalid(
                    lat,
                    format!("service {name:?}: listen and backend are the same address"),
                ));
            }
            let sources = usize::from(s.command.is_some())
                + usize::from(s.pid_file.is_some())
                + usize::from(s.cgroup.is_some());
            if sources != 1 {
                return Err(invalid(
                    at,
                    format!(
                        "service {name:?}: give exactly one of command, pid_file, cgroup (it has {sources})"
                    ),
                ));
            }
            if s.command.as_ref().is_some_and(|c| c.is_empty()) {
                return Err(invalid(at, format!("service {name:?}: command is empty")));
            }
            for (which, h) in
                [("before_suspend", &s.hooks.before_suspend), ("after_resume", &s.hooks.after_resume)]
            {
                let Some(h) = h else { continue };
                let (hat, h) = (h.span().start, h.get_ref());
                if !["GET", "POST", "PUT", "PATCH", "DELETE"].contains(&h.method.as_str()) {
                    return Err(invalid(
                        hat,
                        format!(
                            "service {name:?}: hook {which}: method {:?} (GET, POST, PUT, PATCH, DELETE)",
                            h.method
                        ),
                    ));
                }
                if !h.path.starts_with('/') || h.path.chars().any(|c| c.is_whitespace() || c.is_control()) {
                    return Err(invalid(
                        hat,
                        format!(
                            "service {name:?}: hook {which}: path {:?} must start with '/' and have no spaces",
                            h.path
                        ),
                    ));
                }
                if h.path.parse::<hyper::Uri>().is_err() {
                    return Err(invalid(
                        hat,
                        format!("service {name:?}: hook {which}: bad path {:?}", h.path),
                    ));
                }
                if h.timeout.is_zero() || h.timeout > Duration::from_secs(3600) {
                    return Err(invalid(
                        hat,
                        format!("service {name:?}: hook {which}: timeout must be above 0 and at most 1h"),
                    ));
                }
            }
        }
        // Two services on one backend: one's requests would be answered by
        // the other's server (the one that bound the port first).
        let mut backends = std::collections::HashMap::new();
        for s in &cfg.service {
            if let Some(other) = backends.insert(s.backend, s.name.get_ref().clone()) {
                return Err(invalid(
                    s.name.span().start,
                    format!("service {:?}: backend {} is already {other:?}'s", s.name.get_ref(), s.backend),
                ));
            }
        }
        // A backend of one service that another listens on would loop.
        for s in &cfg.service {
            if let Some((other, at)) = ports.get(&s.backend.port()) {
                if s.backend.ip().is_loopback() || s.backend.ip().is_unspecified() {
                    return Err(invalid(
                        *at,
                        format!(
                            "service {:?}: backend port {} is where {other:?} listens",
                            s.name.get_ref(),
                            s.backend.port()
                        ),
                    ));
                }
            }
        }
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_sizes() {
        assert_eq!(parse_duration("300").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_duration("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_duration("2h").unwrap(), Duration::from_secs(7200));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert!(parse_duration("5x").is_err());
        assert_eq!(parse_size("16GiB").unwrap(), 16 << 30);
        assert_eq!(parse_size("1024").unwrap(), 1024);
        assert!(parse_size("3 apples").is_err());
    }

    const GOOD: &str = r#"
[agent]
socket = "/tmp/a.sock"
min_host_available = "16GiB"

[[service]]
name = "a"
listen = "127.0.0.1:8000"
backend = "127.0.0.1:18000"
command = ["serve"]
suspend_after = "5m"
hibernate_after = "never"
wake_timeout = "120s"
priority = 10
"#;

    #[test]
    fn good_config() {
        let c = Config::parse(GOOD, "x.toml").unwrap();
        assert_eq!(c.agent.min_host_available, Some(16 << 30));
        let s = &c.service[0];
        assert_eq!(s.suspend_after, Some(Duration::from_secs(300)));
        assert_eq!(s.hibernate_after, None);
        assert!(s.restart);
    }

    fn err(text: &str) -> String {
        Config::parse(text, "x.toml").unwrap_err().to_string()
    }

    #[test]
    fn hooks() {
        let text = format!(
            "{GOOD}hooks.before_suspend = {{ method = \"POST\", path = \"/sleep?level=1\", timeout = \"30s\" }}\n\
             hooks.after_resume = {{ path = \"/wake_up\", timeout = \"60s\" }}\n"
        );
        let c = Config::parse(&text, "x.toml").unwrap();
        let h = &c.service[0].hooks;
        let b = h.before_suspend.as_ref().unwrap().get_ref();
        assert_eq!(
            (b.method.as_str(), b.path.as_str(), b.timeout),
            ("POST", "/sleep?level=1", Duration::from_secs(30))
        );
        let a = h.after_resume.as_ref().unwrap().get_ref();
        assert_eq!((a.method.as_str(), a.timeout), ("POST", Duration::from_secs(60)));
        // The table form, as SGLang's operators would write it.
        let text = format!(
            "{GOOD}\n[service.hooks]\nbefore_suspend = {{ path = \"/release_memory_occupation\", body = \"{{}}\" }}\n"
        );
        let c = Config::parse(&text, "x.toml").unwrap();
        assert_eq!(c.service[0].hooks.before_suspend.as_ref().unwrap().get_ref().body.as_deref(), Some("{}"));
        assert!(c.service[0].hooks.after_resume.is_none());
        for (bad, what) in [
            ("hooks.before_suspend = { method = \"FETCH\", path = \"/sleep\" }", "method \"FETCH\""),
            ("hooks.before_suspend = { path = \"sleep\" }", "must start with '/'"),
            ("hooks.after_resume = { path = \"/wake up\" }", "must start with '/'"),
            ("hooks.after_resume = { path = \"/w\", timeout = \"0s\" }", "timeout must be above 0"),
            ("hooks.after_resume = { path = \"/w\", retries = 3 }", "unknown field `retries`"),
            ("hooks.after_suspend = { path = \"/w\" }", "unknown field `after_suspend`"),
            ("hooks.after_resume = { timeout = \"1s\" }", "missing field `path`"),
        ] {
            let e = err(&format!("{GOOD}{bad}\n"));
            assert!(e.starts_with("x.toml:15:") && e.contains(what), "{bad}: {e}");
        }
    }

    #[test]
    fn errors_name_the_line() {
        let e = err(&GOOD.replace("priority = 10", "priority = 10\nfoo = 1"));
        assert!(e.starts_with("x.toml:15:") && e.contains("foo"), "{e}");
        let dup = format!("{GOOD}\n[[service]]\nname = \"a\"\nlisten = \"127.0.0.1:8001\"\nbackend = \"127.0.0.1:18001\"\ncommand = [\"s\"]\n");
        let e = err(&dup);
        assert!(e.starts_with("x.toml:17:") && e.contains("duplicate service name"), "{e}");
        let port = dup.replace(
            "name = \"a\"\nlisten = \"127.0.0.1:8001\"",
            "name = \"b\"\nlisten = \"127.0.0.1:8000\"",
        );
        let e = err(&port);
        assert!(e.starts_with("x.toml:18:") && e.contains("port 8000"), "{e}");
        let shared = format!("{GOOD}\n[[service]]\nname = \"b\"\nlisten = \"127.0.0.1:8001\"\nbackend = \"127.0.0.1:18000\"\ncommand = [\"s\"]\n");
        let e = err(&shared);
        assert!(
            e.starts_with("x.toml:17:") && e.contains("backend 127.0.0.1:18000 is already \"a\"'s"),
            "{e}"
        );
        let e = err(&GOOD.replace("command = [\"serve\"]\n", ""));
        assert!(e.starts_with("x.toml:7:") && e.contains("exactly one of command"), "{e}");
        let e = err(&GOOD.replace("\"5m\"", "\"5 parsecs\""));
        assert!(e.starts_with("x.toml:11:") && e.contains("bad duration"), "{e}");
    }
}
