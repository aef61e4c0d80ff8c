//! The state model shared by the fake `libcuda.so.1`, the fake
//! `libnvidia-ml.so.1` and `fake-workload` (see `docs/design/fakes.md`).
//!
//! Every process that loads one of the fakes sees the same simulated GPUs
//! through one directory (`$GPUSNAP_FAKE_DIR`): the libraries keep no state
//! of their own beyond "has cuInit run", so a driver call made by gpusnap and
//! the CUDA calls of the workload it suspends agree on what is where.
//!
//! The pure rules (what a lock, checkpoint, restore or unlock does to a
//! process, how much memory a GPU has left) live in [`state`] and are unit
//! tested; [`store`] adds the files, the locking and the journal; [`procfs`]
//! is the little of `/proc` the fakes need.

pub mod codes;
pub mod config;
pub mod hostcopy;
pub mod procfs;
pub mod state;
pub mod store;
pub mod vmm;

pub use config::{Config, GpuConfig, Injection};
pub use state::{Alloc, HostCopy, Proc, ProcState, State};
pub use store::{Store, Txn};

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// One mebibyte, the unit of sizes in `config.json` and NVML.
pub const MIB: u64 = 1 << 20;

/// Milliseconds since the Unix epoch: the clock of `busy_until_ms` and the
/// journal, shared by every process.
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// How long moving `bytes` takes at `gbps` (1e9 bytes per second); a speed of
/// zero or less means "instant" so that a config can switch the sleeps off.
pub fn copy_time(bytes: u64, gbps: f64) -> Duration {
    if gbps <= 0.0 || !gbps.is_finite() {
        return Duration::ZERO;
    }
    Duration::from_secs_f64(bytes as f64 / (gbps * 1e9))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_time_scales_with_speed() {
        assert_eq!(copy_time(2_000_000_000, 1.0), Duration::from_secs(2));
        assert_eq!(copy_time(1_000_000_000, 4.0), Duration::from_millis(250));
        assert_eq!(copy_time(1 << 30, 0.0), Duration::ZERO);
        assert_eq!(copy_time(1 << 30, f64::NAN), Duration::ZERO);
    }
}
