//! `config.json`: the simulated machine (driver, GPUs, copy speeds) and the
//! failures a test wants injected. Every field is optional.

use serde::{Deserialize, Serialize};

/// The whole of `config.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Config {
    /// What `cuDriverGetVersion` and NVML's CUDA driver version answer; gpu
    /// pairs on restore are only accepted from 13000 on.
    pub driver_version: i32,
    /// NVML's `nvmlSystemGetDriverVersion`.
    pub driver_string: String,
    pub gpus: Vec<GpuConfig>,
    /// Device memory a context costs, on top of its allocations.
    pub context_mib: u64,
    /// Simulated copy speeds in GB/s (1e9 bytes), so that suspend and resume
    /// take a time proportional to the footprint as on a real GPU.
    pub checkpoint_gbps: f64,
    pub restore_gbps: f64,
    /// The speed of the process's own copies (`cuMemcpy*`, GB/s; 0: at
    /// once), so that a test can catch a copy under way.
    pub copy_gbps: f64,
    /// NVML reporting a checkpoint's release late, as a real NVML may: for
    /// this many ms after a checkpoint returned, the process is still listed
    /// with its memory (`nvml_process_lag_ms`) and the GPU's used memory
    /// still counts it (`nvml_memory_lag_ms`). The driver's own view (a
    /// restore's memory check) has no lag. 0: none.
    pub nvml_process_lag_ms: u64,
    pub nvml_memory_lag_ms: u64,
    /// How long `cuInit` takes (a real one: ~0.1-0.3 s with persistence
    /// mode, seconds without), so that a wake can be seen to overlap it.
    pub init_ms: u64,
    /// What `cuInit` answers when not 0 (after `init_ms`), e.g. 100
    /// (`CUDA_ERROR_NO_DEVICE`): a driver that loads but cannot start.
    pub init_rc: i32,
    pub inject: Vec<Injection>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            driver_version: 13000,
            driver_string: "580.159.04".into(),
            gpus: vec![GpuConfig::default()],
            context_mib: 0,
            checkpoint_gbps: 100.0,
            restore_gbps: 100.0,
            copy_gbps: 0.0,
            nvml_process_lag_ms: 0,
            nvml_memory_lag_ms: 0,
            init_ms: 0,
            init_rc: 0,
            inject: Vec::new(),
        }
    }
}

/// One simulated GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct GpuConfig {
    /// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`; empty means "derive from
    /// the index" (see [`Config::normalize`]).
    pub uuid: String,
    pub name: String,
    pub total_mib: u64,
}

impl Default for GpuConfig {
    fn default() -> Self {
        Self { uuid: String::new(), name: "NVIDIA H200 (fake)".into(), total_mib: 143771 }
    }
}

/// A failure to inject: the named checkpoint-API call on `pid` (any pid when
/// absent) answers `rc`, or never returns when `hang` is set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Injection {
    /// `lock`, `checkpoint`, `restore`, `unlock`, `get_state` or
    /// `get_restore_tid`.
    pub call: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<i32>,
    #[serde(default = "default_inject_rc")]
    pub rc: i32,
    /// Times left to fire; absent means forever.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u32>,
    #[serde(default)]
    pub hang: bool,
}

fn default_inject_rc() -> i32 {
    crate::codes::CUDA_ERROR_UNKNOWN
}

/// The uuid GPU `index` gets when the config names none.
pub fn default_uuid(index: usize) -> String {
    format!("GPU-{index:08x}-0000-0000-0000-000000000000")
}

impl Config {
    /// Fills in what a hand-written config may leave out (uuids), so that the
    /// rest of the code never has to.
    pub fn normalize(&mut self) {
        for (i, gpu) in self.gpus.iter_mut().enumerate() {
            if gpu.uuid.is_empty() {
                gpu.uuid = default_uuid(i);
            }
        }
    }

    /// The ordinal of the GPU with this 16-byte uuid.
    pub fn gpu_by_uuid_bytes(&self, bytes: &[u8; 16]) -> Option<u32> {
        self.gpus.iter().position(|g| parse_uuid(&g.uuid).as_ref() == Some(bytes)).map(|i| i as u32)
    }

    /// Takes one firing of the first injection that matches, decrementing
    /// (and at zero removing) its count. Returns `None` when nothing matches.
    pub fn take_injection(&mut self, call: &str, pid: i32) -> Option<Injection> {
        let i = self.inject.iter().position(|inj| inj.call == call && inj.pid.unwrap_or(pid) == pid)?;
        let fired = self.inject[i].clone();
        if let Some(count) = &mut self.inject[i].count {
            *count = count.saturating_sub(1);
            if *count == 0 {
                self.inject.remove(i);
            }
        }
        Some(fired)
    }
}

/// The 16 bytes of a `GPU-<canonical uuid>` string (the `CUuuid` the driver
/// uses in gpu pairs); `None` when it is not one.
pub fn parse_uuid(text: &str) -> Option<[u8; 16]> {
    let hex: Vec<u8> = text.strip_prefix("GPU-")?.bytes().filter(|&b| b != b'-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (byte, pair) in out.iter_mut().zip(hex.chunks(2)) {
        *byte = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_config_gets_defaults() {
        let mut cfg: Config = serde_json::from_str(
            r#"{"gpus":[{"total_mib":1024},{"uuid":"GPU-aabbccdd-0000-0000-0000-000000000001","total_mib":2048}]}"#,
        )
        .unwrap();
        cfg.normalize();
        assert_eq!(cfg.driver_version, 13000);
        assert_eq!(cfg.gpus[0].uuid, "GPU-00000000-0000-0000-0000-000000000000");
        assert_eq!(cfg.gpus[0].name, "NVIDIA H200 (fake)");
        assert_eq!(cfg.gpus[1].uuid, "GPU-aabbccdd-0000-0000-0000-000000000001");
        let mut second = [0u8; 16];
        second[..4].copy_from_slice(&[0xaa, 0xbb, 0xcc, 0xdd]);
        second[15] = 1;
        assert_eq!(cfg.gpu_by_uuid_bytes(&second), Some(1));
        assert_eq!(cfg.gpu_by_uuid_bytes(&[7; 16]), None);
    }

    #[test]
    fn uuid_parsing_rejects_garbage() {
        assert_eq!(parse_uuid("GPU-00000001-0000-0000-0000-000000000000").unwrap()[3], 1);
        assert_eq!(parse_uuid("00000001-0000-0000-0000-000000000000"), None);
        assert_eq!(parse_uuid("GPU-0001"), None);
        assert_eq!(parse_uuid("GPU-zz000001-0000-0000-0000-000000000000"), None);
    }

    #[test]
    fn injections_count_down_and_match_pid() {
        let mut cfg: Config = serde_json::from_str(
            r#"{"inject":[{"call":"lock","pid":7,"rc":2,"count":2},{"call":"restore","rc":304}]}"#,
        )
        .unwrap();
        assert_eq!(cfg.take_injection("lock", 8), None);
        assert_eq!(cfg.take_injection("lock", 7).unwrap().rc, 2);
        assert_eq!(cfg.inject[0].count, Some(1));
        assert_eq!(cfg.take_injection("lock", 7).unwrap().rc, 2);
        assert_eq!(cfg.take_injection("lock", 7), None);
        // Without a count it fires forever, for any pid.
        for pid in [1, 2, 3] {
            assert_eq!(cfg.take_injection("restore", pid).unwrap().rc, 304);
        }
        assert_eq!(cfg.inject.len(), 1);
    }
}
