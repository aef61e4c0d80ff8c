//! `[agent.http]`: who may use the front door (`api_keys`), what it
//! reaches (`route_only_models`), and what one client may take of it.

use super::{default_header_timeout, default_max_connections};
use crate::units::{duration, size};
use serde::Deserialize;
use std::time::Duration;

/// `[agent.http]`: who may use the front door and what one client may take.
/// Everything a client controls is bounded: connections, header bytes, body
/// bytes (each and all at once), the time to send its headers and its body,
/// the time a connection stays open.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpLimits {
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
    /// Time to send a request's whole body, once its headers are in: a
    /// slower one gets a 408.
    #[serde(default = "default_body_timeout", deserialize_with = "duration")]
    pub body_timeout: Duration,
    /// Bytes of request bodies held at once, over every request: a body
    /// that would go past it gets a 503 (its client retries).
    #[serde(default = "default_max_body_in_flight", deserialize_with = "size")]
    pub max_body_in_flight: u64,
    /// Keys a client must give (`Authorization: Bearer KEY`), checked
    /// before a request is routed or wakes anything; empty: no key asked.
    /// `/healthz` answers without one.
    #[serde(default)]
    pub api_keys: Vec<String>,
    /// Route only to services that list `models`: one without is reached
    /// neither by `Host`, nor by path, nor by its name as a model.
    #[serde(default)]
    pub route_only_models: bool,
    /// A read-only status page at `/ui` (its data behind `api_keys` when
    /// they are set).
    #[serde(default)]
    pub ui: bool,
}

impl std::fmt::Debug for HttpLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpLimits")
            .field("max_connections", &self.max_connections)
            .field("max_header", &self.max_header)
            .field("max_body", &self.max_body)
            .field("header_timeout", &self.header_timeout)
            .field("connection_timeout", &self.connection_timeout)
            .field("body_timeout", &self.body_timeout)
            .field("max_body_in_flight", &self.max_body_in_flight)
            .field("api_keys", &format_args!("[{} key(s)]", self.api_keys.len()))
            .field("route_only_models", &self.route_only_models)
            .field("ui", &self.ui)
            .finish()
    }
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            max_connections: default_max_connections(),
            max_header: default_max_header(),
            max_body: default_max_body(),
            header_timeout: default_header_timeout(),
            connection_timeout: default_connection_timeout(),
            body_timeout: default_body_timeout(),
            max_body_in_flight: default_max_body_in_flight(),
            api_keys: Vec::new(),
            route_only_models: false,
            ui: false,
        }
    }
}

impl HttpLimits {
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
        if !(self.max_body..=1 << 40).contains(&self.max_body_in_flight) {
            return Err("[agent.http] max_body_in_flight must be from max_body to 1TiB".into());
        }
        if let Some(k) = self.api_keys.iter().find(|k| k.len() < 16 || k.len() > 4096) {
            let shown: String = k.chars().take(4).collect();
            return Err(format!(
                "[agent.http] api_keys: the key starting {shown:?} must be 16 to 4096 characters"
            ));
        }
        if self.api_keys.iter().any(|k| !k.bytes().all(|b| b.is_ascii_graphic())) {
            return Err("[agent.http] api_keys: a key must be printable ASCII without spaces".into());
        }
        for (key, d) in [
            ("header_timeout", self.header_timeout),
            ("connection_timeout", self.connection_timeout),
            ("body_timeout", self.body_timeout),
        ] {
            if d.is_zero() || d > Duration::from_secs(7 * 86400) {
                return Err(format!("[agent.http] {key} must be above 0 and at most 7d"));
            }
        }
        Ok(())
    }
}

fn default_max_header() -> u64 {
    64 << 10
}
fn default_max_body() -> u64 {
    32 << 20
}
fn default_connection_timeout() -> Duration {
    Duration::from_secs(3600)
}
fn default_body_timeout() -> Duration {
    Duration::from_secs(60)
}
fn default_max_body_in_flight() -> u64 {
    256 << 20
}
