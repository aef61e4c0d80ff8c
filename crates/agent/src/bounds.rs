//! The range of every number in the agent's configuration. A value outside
//! its range (a `tick` of 0, a `wake_timeout` of 292 billion years) is
//! refused when the file is read, naming the key and its line, instead of
//! panicking a task or overflowing a deadline later.

use crate::config::{Config, ServiceConfig};
use std::time::Duration;

const MS: Duration = Duration::from_millis(1);
const SEC: Duration = Duration::from_secs(1);
const DAY: Duration = Duration::from_secs(86_400);
const MAX_CONNECTIONS: usize = 1 << 20;
const TIB: u64 = 1 << 40;

/// A duration's range: `[min, max]`, both inclusive.
fn within(key: &str, d: Duration, min: Duration, max: Duration) -> Result<(), String> {
    if d < min || d > max {
        return Err(format!("{key} = {d:?}: must be between {min:?} and {max:?}"));
    }
    Ok(())
}

fn count(key: &str, n: usize, min: usize, max: usize) -> Result<(), String> {
    if n < min || n > max {
        return Err(format!("{key} = {n}: must be between {min} and {max}"));
    }
    Ok(())
}

fn bytes(key: &str, n: u64, min: u64, max: u64) -> Result<(), String> {
    if n < min || n > max {
        return Err(format!("{key} = {n} bytes: must be between {min} and {max} bytes"));
    }
    Ok(())
}

/// Checks every number; on a bad one, the offset of its key in `text` (or
/// of its table) and why.
pub fn check(cfg: &Config, text: &str) -> Result<(), (usize, String)> {
    let a = &cfg.agent;
    let agent_at = section_start(text, "[agent]").unwrap_or(0);
    let at = |key: &str| key_offset(text, agent_at, key).unwrap_or(agent_at);
    let agent = [
        ("tick", within("tick", a.tick, 10 * MS, 3600 * SEC)),
        ("header_timeout", within("header_timeout", a.header_timeout, 100 * MS, 600 * SEC)),
        (
            "max_connections",
            a.max_connections.map_or(Ok(()), |n| count("max_connections", n, 1, MAX_CONNECTIONS)),
        ),
        (
            "min_host_available",
            a.min_host_available.map_or(Ok(()), |n| bytes("min_host_available", n, 0, 1024 * TIB)),
        ),
    ];
    for (key, r) in agent {
        r.map_err(|e| (at(key), e))?;
    }
    for s in &cfg.service {
        check_service(s, text)?;
    }
    Ok(())
}

fn check_service(s: &ServiceConfig, text: &str) -> Result<(), (usize, String)> {
    let name_at = s.name.span().start;
    let table = text[..name_at.min(text.len())].rfind("[[service]]").unwrap_or(name_at);
    let at = |key: &str| key_offset(text, table, key).unwrap_or(name_at);
    let name = s.name.get_ref();
    let opt = |key: &str, d: Option<Duration>, min: Duration, max: Duration| {
        d.map_or(Ok(()), |d| within(key, d, min, max))
    };
    let checks = [
        ("wake_timeout", within("wake_timeout", s.wake_timeout, MS, DAY)),
        ("suspend_after", opt("suspend_after", s.suspend_after, Duration::ZERO, 365 * DAY)),
        ("hibernate_after", opt("hibernate_after", s.hibernate_after, Duration::ZERO, 365 * DAY)),
        ("request_timeout", opt("request_timeout", s.request_timeout, SEC, 7 * DAY)),
        ("max_waiting", count("max_waiting", s.max_waiting, 1, MAX_CONNECTIONS)),
        ("max_connections", count("max_connections", s.max_connections, 1, MAX_CONNECTIONS)),
        ("margin", bytes("margin", s.margin, 0, TIB)),
        ("gpu_memory", s.gpu_memory.map_or(Ok(()), |n| bytes("gpu_memory", n, 1, 64 * TIB))),
        (
            "priority",
            if s.priority.unsigned_abs() > 1_000_000 {
                Err(format!("priority = {}: must be between -1000000 and 1000000", s.priority))
            } else {
                Ok(())
            },
        ),
    ];
    for (key, r) in checks {
        r.map_err(|e| (at(key), format!("service {name:?}: {e}")))?;
    }
    Ok(())
}

/// Where a table header starts (at the start of a line).
fn section_start(text: &str, header: &str) -> Option<usize> {
    let mut off = 0;
    for line in text.split_inclusive('\n') {
        if line.trim_start().starts_with(header) {
            return Some(off);
        }
        off += line.len();
    }
    None
}

/// Where `key = ...` is written in the table that starts at `from` (up to
/// the next table header).
fn key_offset(text: &str, from: usize, key: &str) -> Option<usize> {
    let mut off = from;
    for (i, line) in text[from..].split_inclusive('\n').enumerate() {
        let t = line.trim_start();
        if i > 0 && t.starts_with('[') {
            return None;
        }
        if let Some(rest) = t.strip_prefix(key) {
            if rest.trim_start().starts_with('=') {
                return Some(off + (line.len() - t.len()));
            }
        }
        off += line.len();
    }
    None
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    const BASE: &str =
        "[agent]\nsocket = \"/tmp/a.sock\"\n\n[[service]]\nname = \"a\"\nlisten = \"127.0.0.1:8000\"\n\
                        backend = \"127.0.0.1:18000\"\ncommand = [\"serve\"]\n";

    fn err(text: &str) -> String {
        Config::parse(text, "x.toml").unwrap_err().to_string()
    }

    #[test]
    fn out_of_range_numbers_name_their_key_and_line() {
        let e = err(&BASE.replace("[agent]\n", "[agent]\ntick = 0\n"));
        assert!(e.starts_with("x.toml:2:") && e.contains("tick = 0ns"), "{e}");
        for (line, what) in [
            ("max_waiting = 0", "max_waiting = 0"),
            ("wake_timeout = 9223372036854775807", "wake_timeout"),
            ("max_connections = 0", "max_connections = 0"),
            ("request_timeout = \"10ms\"", "request_timeout"),
            ("hibernate_after = \"1000d\"", "hibernate_after"),
            ("priority = 9223372036854775807", "priority"),
            ("gpu_memory = 0", "gpu_memory"),
        ] {
            let e = err(&format!("{BASE}{line}\n"));
            assert!(
                e.starts_with("x.toml:9:") && e.contains(what) && e.contains("service \"a\""),
                "{line}: {e}"
            );
        }
        // The key of the second service, not the first's.
        let two = format!(
            "{BASE}max_waiting = 5\n\n[[service]]\nname = \"b\"\nlisten = \"127.0.0.1:8001\"\n\
             backend = \"127.0.0.1:18001\"\ncommand = [\"s\"]\nmax_waiting = 0\n"
        );
        let e = err(&two);
        assert!(e.starts_with("x.toml:16:") && e.contains("service \"b\""), "{e}");
        assert!(Config::parse(&format!("{BASE}max_waiting = 1\nrequest_timeout = \"never\"\n"), "x").is_ok());
    }
}
