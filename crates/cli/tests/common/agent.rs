//! What tests of the agent share about its state on disk.

use super::World;
use serde_json::Value;

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
