//! The units of the agent's configuration: durations (`300`, `"500ms"`,
//! `"5m"`, `"never"`) and sizes (`1024`, `"16GiB"`), as plain parsers and as
//! serde field deserializers.

use serde::de::{self, Deserializer};
use serde::Deserialize;
use std::time::Duration;

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

pub(crate) fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    match NumOrStr::deserialize(d)? {
        NumOrStr::Int(n) => Ok(Duration::from_secs(n)),
        NumOrStr::Float(f) => Duration::try_from_secs_f64(f).map_err(de::Error::custom),
        NumOrStr::Str(s) => parse_duration(&s).map_err(de::Error::custom),
    }
}

pub(crate) fn duration_or_never<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    match NumOrStr::deserialize(d)? {
        NumOrStr::Str(s) if s.trim() == "never" => Ok(None),
        NumOrStr::Int(n) => Ok(Some(Duration::from_secs(n))),
        NumOrStr::Float(f) => Duration::try_from_secs_f64(f).map(Some).map_err(de::Error::custom),
        NumOrStr::Str(s) => parse_duration(&s).map(Some).map_err(de::Error::custom),
    }
}

pub(crate) fn duration_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    duration(d).map(Some)
}

pub(crate) fn size<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    match NumOrStr::deserialize(d)? {
        NumOrStr::Int(n) => Ok(n),
        NumOrStr::Float(f) => Ok(f as u64),
        NumOrStr::Str(s) => parse_size(&s).map_err(de::Error::custom),
    }
}

pub(crate) fn size_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    size(d).map(Some)
}
