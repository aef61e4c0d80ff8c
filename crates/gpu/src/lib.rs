//! What the GPUs of this host hold: NVML behind the [`GpuInventory`] trait.

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::Nvml;
use serde::Serialize;

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("cannot load NVML (libnvidia-ml.so.1): {0}")]
    Load(String),
    #[error("NVML {what} failed: {reason}")]
    Query { what: &'static str, reason: String },
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct GpuInfo {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub total_bytes: u64,
    pub free_bytes: u64,
    pub used_bytes: u64,
}

/// Device memory one process holds on one GPU.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ProcessUsage {
    pub pid: u32,
    pub uuid: String,
    /// `None` where NVML cannot tell (some containers).
    pub bytes: Option<u64>,
}

pub trait GpuInventory: Send + Sync + 'static {
    /// The kernel driver's version string, e.g. `580.159.04`.
    fn driver_version(&self) -> Result<String, GpuError>;
    fn gpus(&self) -> Result<Vec<GpuInfo>, GpuError>;
    /// Every compute process on every GPU.
    fn processes(&self) -> Result<Vec<ProcessUsage>, GpuError>;

    /// The device memory `pid` holds, per GPU UUID (empty when none).
    fn usage_of(&self, pid: u32) -> Result<Vec<ProcessUsage>, GpuError> {
        Ok(self.processes()?.into_iter().filter(|p| p.pid == pid).collect())
    }
}

/// NVML, loaded from `libnvidia-ml.so.1` at run time.
pub struct NvmlInventory {
    nvml: Nvml,
}

fn q<T>(what: &'static str, r: Result<T, nvml_wrapper::error::NvmlError>) -> Result<T, GpuError> {
    r.map_err(|e| GpuError::Query { what, reason: e.to_string() })
}

impl NvmlInventory {
    pub fn load() -> Result<Self, GpuError> {
        tracing::debug!("loading NVML");
        // The default name, libnvidia-ml.so, exists only with the development
        // package; the driver itself always installs the .so.1.
        let nvml = Nvml::builder()
            .lib_path(std::ffi::OsStr::new("libnvidia-ml.so.1"))
            .init()
            .map_err(|e| GpuError::Load(e.to_string()))?;
        Ok(Self { nvml })
    }

    fn each_device<T>(
        &self,
        mut f: impl FnMut(u32, &nvml_wrapper::Device<'_>) -> Result<T, GpuError>,
    ) -> Result<Vec<T>, GpuError> {
        let n = q("device count", self.nvml.device_count())?;
        (0..n)
            .map(|i| {
                let d = q("device handle", self.nvml.device_by_index(i))?;
                f(i, &d)
            })
            .collect()
    }
}

impl NvmlInventory {
    /// How many GPUs have persistence mode off.
    pub fn persistence_off(&self) -> Result<usize, GpuError> {
        Ok(self
            .each_device(|_, d| Ok(!d.is_in_persistent_mode().unwrap_or(true)))?
            .into_iter()
            .filter(|x| *x)
            .count())
    }
}

impl GpuInventory for NvmlInventory {
    fn driver_version(&self) -> Result<String, GpuError> {
        q("driver version", self.nvml.sys_driver_version())
    }

    fn gpus(&self) -> Result<Vec<GpuInfo>, GpuError> {
        self.each_device(|index, d| {
            let mem = q("memory info", d.memory_info())?;
            Ok(GpuInfo {
                index,
                uuid: q("uuid", d.uuid())?,
                name: q("name", d.name())?,
                total_bytes: mem.total,
                free_bytes: mem.free,
                used_bytes: mem.used,
            })
        })
    }

    fn processes(&self) -> Result<Vec<ProcessUsage>, GpuError> {
        let per_gpu = self.each_device(|_, d| {
            let uuid = q("uuid", d.uuid())?;
            let procs = q("compute processes", d.running_compute_processes())?;
            Ok(procs
                .into_iter()
                .map(|p| ProcessUsage {
                    pid: p.pid,
                    uuid: uuid.clone(),
                    bytes: match p.used_gpu_memory {
                        UsedGpuMemory::Used(b) => Some(b),
                        UsedGpuMemory::Unavailable => None,
                    },
                })
                .collect::<Vec<_>>())
        })?;
        Ok(per_gpu.into_iter().flatten().collect())
    }
}

impl<T: GpuInventory + ?Sized> GpuInventory for Box<T> {
    fn driver_version(&self) -> Result<String, GpuError> {
        (**self).driver_version()
    }
    fn gpus(&self) -> Result<Vec<GpuInfo>, GpuError> {
        (**self).gpus()
    }
    fn processes(&self) -> Result<Vec<ProcessUsage>, GpuError> {
        (**self).processes()
    }
}

/// The inventory of a host without NVML: no GPUs, no GPU processes.
#[derive(Debug, Clone, Default)]
pub struct NoGpus;

impl GpuInventory for NoGpus {
    fn driver_version(&self) -> Result<String, GpuError> {
        Ok("none".into())
    }
    fn gpus(&self) -> Result<Vec<GpuInfo>, GpuError> {
        Ok(Vec::new())
    }
    fn processes(&self) -> Result<Vec<ProcessUsage>, GpuError> {
        Ok(Vec::new())
    }
}
