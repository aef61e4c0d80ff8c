//! What tests of the agent share: its API as a client sees it, and its
//! state on disk.

use super::{wait_until, World};
use serde_json::Value;
use std::time::Duration;

/// A test's handle on a running agent: the requests its API answers, built
/// on the one call each test makes in its own way.
pub trait AgentClient {
    /// One request to the agent's API: status and body.
    fn api(&self, method: &str, path: &str) -> (u16, String);
    /// What the agent logged so far, for failure messages.
    fn log(&self) -> String;
    /// The world the agent runs in.
    fn world(&mut self) -> &mut World;

    /// The service's record (`GET /v1/services/NAME`, which must answer 200).
    fn service(&self, name: &str) -> Value {
        let (code, body) = self.api("GET", &format!("/v1/services/{name}"));
        assert_eq!(code, 200, "{body}");
        serde_json::from_str(&body).unwrap()
    }

    /// Waits (a minute at most) for the service's state; registers its
    /// processes for cleanup.
    fn wait_state(&mut self, name: &str, state: &str) -> Value {
        let limit = Duration::from_secs(60);
        let mut last = Value::Null;
        let ok = wait_until(limit, || {
            last = self.service(name);
            last["state"] == state
        });
        assert!(ok, "{name} not {state} within {limit:?}: {last}\nagent log: {}", self.log());
        for k in ["runner", "pid"] {
            if let Some(p) = last[k].as_i64() {
                self.world().adopt(p as i32);
            }
        }
        last
    }
}

/// The agent's service records (`agent/services.json` in the state
/// directory); `null` when there are none or they do not parse.
pub fn agent_records(w: &World) -> Value {
    let path = w.state_dir().join("agent").join("services.json");
    std::fs::read(path).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default()
}

/// Registers every process the agent last recorded (runner and server) for
/// cleanup: the services run in sessions of their own and outlive the agent
/// on purpose, so a test ends them itself, even after a failure.
pub fn adopt_recorded_services(w: &mut World) {
    let v = agent_records(w);
    for rec in v.as_object().into_iter().flat_map(|o| o.values()) {
        for k in ["runner", "pid"] {
            if let Some(p) = rec[k].as_i64() {
                w.adopt(p as i32);
            }
        }
    }
}
