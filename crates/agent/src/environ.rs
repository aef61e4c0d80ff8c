//! The environment a server starts with. The agent's own is not passed
//! through (it may hold cloud credentials, a token for the remote store):
//! a server gets the few variables every program needs ([`ALWAYS`], and
//! those starting with [`PREFIXES`]: the GPU's and gpusnap's own), the
//! ones its service names in `pass_environment`, and its `environment`.

use crate::config::ServiceConfig;
use std::collections::BTreeMap;

/// Passed from the agent's environment to every server.
pub const ALWAYS: [&str; 9] =
    ["PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TZ", "TMPDIR", "LD_LIBRARY_PATH"];
/// Variables starting so are passed too: the GPU's (`CUDA_VISIBLE_DEVICES`,
/// `NVIDIA_VISIBLE_DEVICES`) and gpusnap's own (`GPUSNAP_*`).
pub const PREFIXES: [&str; 3] = ["CUDA_", "NVIDIA_", "GPUSNAP_"];

/// The pinned host memory each fast-swap server may keep for its copies
/// (`GPUSNAP_FAST_SWAP_PIN_BUDGET`): `[agent] pinned_budget`, or half of
/// the host's memory (`MemTotal`); `None` when neither is known.
pub fn pinned_budget(configured: Option<u64>) -> Option<u64> {
    configured.or_else(|| {
        let info = std::fs::read_to_string("/proc/meminfo").ok()?;
        let kib: u64 = info
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()?;
        Some(kib * 1024 / 2)
    })
}

/// The server's environment, from the agent's (`std::env::vars_os`).
pub fn for_server(cfg: &ServiceConfig) -> BTreeMap<std::ffi::OsString, std::ffi::OsString> {
    from(cfg, std::env::vars_os())
}

fn from(
    cfg: &ServiceConfig,
    agent: impl Iterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
) -> BTreeMap<std::ffi::OsString, std::ffi::OsString> {
    let mut env: BTreeMap<_, _> = agent
        .filter(|(k, _)| {
            let k = k.to_string_lossy();
            ALWAYS.contains(&k.as_ref())
                || PREFIXES.iter().any(|p| k.starts_with(p))
                || cfg.pass_environment.iter().any(|p| *p == k)
        })
        .collect();
    for (k, v) in &cfg.environment {
        env.insert(k.into(), v.into());
    }
    env
}

#[cfg(test)]
mod budget_tests {
    #[test]
    fn the_pinned_budget_is_the_configured_one_or_half_the_host() {
        assert_eq!(super::pinned_budget(Some(7 << 30)), Some(7 << 30));
        let half = super::pinned_budget(None).unwrap();
        assert!(half > 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_named_variables_reach_the_server() {
        let text = "[[service]]\nname = \"a\"\nlisten = \"127.0.0.1:8000\"\nbackend = \"127.0.0.1:18000\"\n\
                    command = [\"s\"]\npass_environment = [\"HF_TOKEN\"]\nenvironment = { MODEL = \"llama\", PATH = \"/opt/bin\" }\n";
        let cfg = crate::Config::parse(text, "x").unwrap();
        let agent = [
            ("PATH", "/usr/bin"),
            ("AWS_SECRET_ACCESS_KEY", "secret"),
            ("HF_TOKEN", "hf"),
            ("CUDA_VISIBLE_DEVICES", "1"),
            ("GPUSNAP_STATE_DIR", "/var/lib/gpusnap"),
        ]
        .map(|(k, v)| (k.into(), v.into()));
        let env = from(&cfg.service[0], agent.into_iter());
        let got: Vec<(String, String)> = env
            .into_iter()
            .map(|(k, v)| (k.to_string_lossy().into_owned(), v.to_string_lossy().into_owned()))
            .collect();
        let want = [
            ("CUDA_VISIBLE_DEVICES", "1"),
            ("GPUSNAP_STATE_DIR", "/var/lib/gpusnap"),
            ("HF_TOKEN", "hf"),
            ("MODEL", "llama"),
            ("PATH", "/opt/bin"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        assert_eq!(got, want);
    }
}
