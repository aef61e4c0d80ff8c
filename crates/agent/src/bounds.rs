//! Ranges for the numbers of the agent's configuration, and where a key is
//! written in the file: `config` checks every number with these when it
//! reads the file, so that a value outside its range (a `tick` of 0, a
//! `wake_timeout` of 292 billion years) is refused naming the key and its
//! line, instead of panicking a task or overflowing a deadline later.

use std::time::Duration;

pub const MS: Duration = Duration::from_millis(1);
pub const SEC: Duration = Duration::from_secs(1);
pub const DAY: Duration = Duration::from_secs(86_400);
pub const MAX_CONNECTIONS: usize = 1 << 20;
pub const TIB: u64 = 1 << 40;

/// A duration's range: `[min, max]`, both inclusive.
pub fn within(key: &str, d: Duration, min: Duration, max: Duration) -> Result<(), String> {
    if d < min || d > max {
        return Err(format!("{key} = {d:?}: must be between {min:?} and {max:?}"));
    }
    Ok(())
}

pub fn count(key: &str, n: usize, min: usize, max: usize) -> Result<(), String> {
    if n < min || n > max {
        return Err(format!("{key} = {n}: must be between {min} and {max}"));
    }
    Ok(())
}

pub fn bytes(key: &str, n: u64, min: u64, max: u64) -> Result<(), String> {
    if n < min || n > max {
        return Err(format!("{key} = {n} bytes: must be between {min} and {max} bytes"));
    }
    Ok(())
}

/// Where a table header starts (at the start of a line).
pub fn section_start(text: &str, header: &str) -> Option<usize> {
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
pub fn key_offset(text: &str, from: usize, key: &str) -> Option<usize> {
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
