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

/// An inventory loaded on a thread of its own (NVML's init costs tens of ms
/// or more); each query waits for it. For callers whose fallback does not
/// depend on whether NVML loads: the guard, which takes a host without NVML
/// as one without GPUs either way, and whose attach `gpusnap wake` waits for.
pub struct Deferred {
    thread: std::sync::Mutex<Option<std::thread::JoinHandle<Box<dyn GpuInventory>>>>,
    done: std::sync::OnceLock<Box<dyn GpuInventory>>,
}

impl Deferred {
    /// Runs `load` on a thread (here, if no thread can be had).
    pub fn start(load: impl FnOnce() -> Box<dyn GpuInventory> + Send + 'static) -> Self {
        let (thread, done) = match std::thread::Builder::new().name("nvml-init".into()).spawn(load) {
            Ok(h) => (Some(h), std::sync::OnceLock::new()),
            Err(e) => {
                tracing::debug!("no thread for NVML's init ({e}): NVML taken as absent");
                (None, std::sync::OnceLock::from(Box::new(NoGpus) as Box<dyn GpuInventory>))
            }
        };
        Self { thread: std::sync::Mutex::new(thread), done }
    }

    /// The loaded inventory; the first caller joins the thread, the others
    /// wait on the mutex meanwhile.
    fn get(&self) -> &dyn GpuInventory {
        if let Some(g) = self.done.get() {
            return &**g;
        }
        let mut thread = self.thread.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(h) = thread.take() {
            let _ = self.done.set(h.join().unwrap_or_else(|_| Box::new(NoGpus)));
        }
        drop(thread);
        &**self.done.get_or_init(|| Box::new(NoGpus))
    }
}

impl Drop for Deferred {
    fn drop(&mut self) {
        // NVML is shut down and closed only once its init has returned.
        self.get();
    }
}

impl GpuInventory for Deferred {
    fn driver_version(&self) -> Result<String, GpuError> {
        self.get().driver_version()
    }
    fn gpus(&self) -> Result<Vec<GpuInfo>, GpuError> {
        self.get().gpus()
    }
    fn processes(&self) -> Result<Vec<ProcessUsage>, GpuError> {
        self.get().processes()
    }
    fn usage_of(&self, pid: u32) -> Result<Vec<ProcessUsage>, GpuError> {
        self.get().usage_of(pid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct One;
    impl GpuInventory for One {
        fn driver_version(&self) -> Result<String, GpuError> {
            Ok("1".into())
        }
        fn gpus(&self) -> Result<Vec<GpuInfo>, GpuError> {
            Ok(vec![GpuInfo {
                index: 0,
                uuid: "GPU-0".into(),
                name: "one".into(),
                total_bytes: 1,
                free_bytes: 1,
                used_bytes: 0,
            }])
        }
        fn processes(&self) -> Result<Vec<ProcessUsage>, GpuError> {
            Ok(vec![ProcessUsage { pid: 7, uuid: "GPU-0".into(), bytes: Some(1) }])
        }
    }

    #[test]
    fn deferred_queries_wait_for_the_load() {
        let d = Deferred::start(|| {
            std::thread::sleep(std::time::Duration::from_millis(100));
            Box::new(One)
        });
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| assert_eq!(d.gpus().unwrap().len(), 1));
            }
        });
        assert_eq!(d.usage_of(7).unwrap().len(), 1);
        assert_eq!(d.driver_version().unwrap(), "1");
    }

    #[test]
    fn a_deferred_load_that_panics_is_no_gpus() {
        let d = Deferred::start(|| panic!("no NVML"));
        assert!(d.gpus().unwrap().is_empty());
        assert_eq!(d.driver_version().unwrap(), "none");
    }
}
