//! `[agent.http]`: what one client of the front door may take. Everything a
//! client controls is bounded: connections, header bytes, body bytes, the
//! time to send its headers, the time a connection stays open.

use crate::config::{duration, size};
use serde::Deserialize;
use std::time::Duration;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Open connections at once; more are closed as they come.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// The request line and headers, in bytes (at least 8 KiB).
    #[serde(default = "default_max_header", deserialize_with = "size")]
    pub max_header: u64,
    /// A request's body, in bytes: larger ones get a 413.
    #[serde(default = "default_max_body", deserialize_with = "size")]
    pub max_body: u64,
    /// Time to send the request line and headers, from the first byte (or
    /// from the connection, for its first request).
    #[serde(default = "default_header_timeout", deserialize_with = "duration")]
    pub header_timeout: Duration,
    /// A connection is closed once open this long, answer streaming or not.
    #[serde(default = "default_connection_timeout", deserialize_with = "duration")]
    pub connection_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: default_max_connections(),
            max_header: default_max_header(),
            max_body: default_max_body(),
            header_timeout: default_header_timeout(),
            connection_timeout: default_connection_timeout(),
        }
    }
}

impl Limits {
    /// The values hyper and the agent can work with; the error names the key.
    pub fn check(&self) -> Result<(), String> {
        if !(1..=1_000_000).contains(&self.max_connections) {
            return Err("[agent.http] max_connections must be from 1 to 1000000".into());
        }
        if !(8 << 10..=16 << 20).contains(&self.max_header) {
            return Err("[agent.http] max_header must be from 8KiB to 16MiB".into());
        }
        if !(1..=1 << 32).contains(&self.max_body) {
            return Err("[agent.http] max_body must be from 1 byte to 4GiB".into());
        }
        for (key, d) in [("header_timeout", self.header_timeout), ("connection_timeout", self.connection_timeout)] {
            if d.is_zero() || d > Duration::from_secs(7 * 86400) {
                return Err(format!("[agent.http] {key} must be above 0 and at most 7d"));
            }
        }
        Ok(())
    }
}

fn default_max_connections() -> usize {
    1024
}
fn default_max_header() -> u64 {
    64 << 10
}
fn default_max_body() -> u64 {
    32 << 20
}
fn default_header_timeout() -> Duration {
    Duration::from_secs(10)
}
fn default_connection_timeout() -> Duration {
    Duration::from_secs(3600)
}
